"""What one GPU window's recipe hands back and learns from: the export folder within a remote run's limits (also
when the run is killed mid-fit), the deadline, text sources in the inputs, the EAGLE-3 fit's epoch cap, held-out
scoring with the best head kept, and a fit continued from a head."""
from __future__ import annotations

import dataclasses
import gzip
import json
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from ddd_jax import generate, load_draft
from tests.test_recipe import TINY, CharChat, fake_inputs, tiny_target
from train_draft.export_dir import (MAX_FILES, ExportDir, HeadWriter, check_head_fits, check_limits, load_regen,
                                   save_regen, write_head_tar)
from train_draft.recipe import run_recipe, token_set
from train_draft.recipe_inputs import fit_to_bytes, load_inputs, prepare_inputs, save_inputs


def _records(n, start=2, prompt_len=3, length=40, tag="s"):
    return [{"id": f"{tag}{i}", "prompt_len": prompt_len, "ids": [(start + i + j) % 90 + 2 for j in range(length)],
             "finished": bool(i % 2)} for i in range(n)]


def test_export_dir_refuses_what_would_not_come_back(tmp_path):
    ex = ExportDir(tmp_path / "out")
    for i in range(MAX_FILES):
        assert ex.put_bytes(f"f{i}.bin", b"x" * 10) is None
    assert "over 8" in ex.put_bytes("one-more.bin", b"x")
    assert ex.put_bytes("f0.bin", b"y" * 20) is None  # rewriting a file is not one more
    assert "over 16777216 a file" in ex.put_bytes("f1.bin", b"x" * (16 * 2 ** 20 + 1))
    assert check_limits(tmp_path / "out") == {"files": 8, "bytes": 90, "largest": 20, "problems": []}
    (tmp_path / "out" / "a" / "b").mkdir(parents=True)
    (tmp_path / "out" / "a" / "b" / "deep.txt").write_text("z")
    assert any("9 files" in p for p in check_limits(tmp_path / "out")["problems"])


def test_a_head_is_exported_in_the_first_form_that_fits_a_returned_file(tmp_path):
    """float16 while it fits; else bfloat16 in one xz stream (SmolLM2's EAGLE-3 head: 19.7 MB in 16 bits, which
    the first GPU window's export refused); else refused with the sizes. The writer works off the caller's thread."""
    import ml_dtypes

    from ddd_jax import eagle, init_draft
    from ddd_jax.config import DraftConfig, ModelConfig
    t = tiny_target()
    d = eagle.with_draft_vocab(init_draft(t, 3), np.arange(64))
    assert write_head_tar(d, tmp_path / "a.tar") == "float16"
    plain = (tmp_path / "a.tar").stat().st_size
    assert write_head_tar(d, tmp_path / "b.tar", limit=plain - 1) == "bfloat16+xz"
    small = (tmp_path / "b.tar").stat().st_size
    assert small < plain
    back = load_draft(tmp_path / "b.tar", t)
    np.testing.assert_array_equal(np.asarray(back.params["fc_w"], np.float32),
                                  np.asarray(d.params["fc_w"]).astype(ml_dtypes.bfloat16).astype(np.float32))
    with pytest.raises(ValueError, match=rf"c.tar: float16 {plain}, bfloat16\+xz \d+ bytes, over 100 a file"):
        write_head_tar(d, tmp_path / "c.tar", limit=100)
    assert not (tmp_path / "c.tar").exists()
    # the writer: the newest head of a name wins, and refusals come back as reasons
    ex = ExportDir(tmp_path / "out")
    w = HeadWriter(ex, tmp_path)
    w.submit("h", d, {"step": 1})
    w.submit("h", d, {"step": 2})
    assert w.flush(timeout=60) == {"h": (None, "float16")}
    assert json.loads(load_draft_config(ex.path / "h.tar"))["extra"] == {"step": 2}
    for i in range(MAX_FILES - 1):
        assert ex.put_bytes(f"f{i}.bin", b"x") is None
    w.submit("h2", d)
    assert w.flush(timeout=60) == {"h2": ("h2.tar: would be file 9, over 8", "float16")}
    # before a window is spent: SmolLM2-135M's EAGLE-3 head needs the compressed form; a 32k vocabulary fits none
    smol = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192)
    fits = check_head_fits(DraftConfig.from_target(smol, head_type="eagle3", fc_bias=False, draft_vocab_size=8192),
                           "test")
    assert fits["form"] == "bfloat16+xz" and 19_000_000 < fits["float16_bytes"] < 20_000_000
    with pytest.raises(ValueError, match=r"test: the head's weights take .*\(draft_vocab_size=32768"):
        check_head_fits(DraftConfig.from_target(smol, head_type="eagle3", fc_bias=False, draft_vocab_size=32768),
                        "test")


def load_draft_config(tar_path) -> str:
    import tarfile
    with tarfile.open(tar_path) as tar:
        return tar.extractfile("config.json").read().decode()


def test_regen_files_round_trip_from_npz_and_jsonl(tmp_path):
    parts = {"train": _records(5), "holdout": _records(2, tag="h")}
    save_regen(parts, tmp_path / "regen.npz", {"target": "tiny4"})
    assert load_regen(tmp_path / "regen.npz") == parts
    with gzip.open(tmp_path / "regen-train.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in parts["train"]) + '{"id": "torn')
    assert load_regen(tmp_path / "regen-train.jsonl.gz") == {"train": parts["train"]}
    cut = tmp_path / "cut.npz"
    cut.write_bytes((tmp_path / "regen.npz").read_bytes()[:100])
    with pytest.raises(ValueError, match="cut.npz: not a readable regen.npz"):
        load_regen(cut)
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="a regen.npz or a .jsonl"):
        load_regen(tmp_path / "x.bin")


def test_inputs_carry_earlier_replies_and_sharegpt_text_within_a_size(tmp_path):
    t = CharChat()
    sg = tmp_path / "sharegpt.json"
    sg.write_text(json.dumps([{"id": c, "conversations": [{"from": "human", "value": f"question {c}"},
                                                           {"from": "gpt", "value": "answer"}]}
                              for c in ("a", "b", "c")]))
    qs = tmp_path / "question.jsonl"
    qs.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem."]}) + "\n")
    a_ids = t.encode_chat([{"role": "user", "content": "question a"}])
    prior = {"train": [{"id": "a", "prompt_len": len(a_ids), "ids": a_ids + [7, 8, 9, 1], "finished": True}]}
    save_regen(prior, tmp_path / "old.npz", {"target": "chars"})
    inputs = prepare_inputs(t, max_prompt_len=64, max_context_len=0, holdout_percent=0, sharegpt=sg, questions=qs,
                            prior_regen=[tmp_path / "old.npz"], progress=False)
    assert sorted(k for k, _ in inputs["train"]) == ["b", "c"]  # "a" was answered by the earlier run
    assert inputs["text"] == [("regen:a", a_ids + [7, 8, 9, 1], [0] * len(a_ids) + [1] * 4)]
    assert inputs["meta"]["train_order"]["answered_by_prior_regen"] == 1
    # ShareGPT text is cut from the end to fit a size; prompts and earlier replies never are
    rng = np.random.default_rng(0)
    sg_text = [(f"sharegpt:{i}", rng.integers(2, 250, 300).tolist(), [0] * 100 + [1] * 200) for i in range(200)]
    big = {**inputs, "text": inputs["text"] + sg_text}
    full = save_inputs(big, tmp_path / "full.npz").stat().st_size
    limit = full // 2
    path = save_inputs(big, tmp_path / "half.npz", max_bytes=limit)
    back = load_inputs(path)
    assert path.stat().st_size <= limit and back["text"][0] == inputs["text"][0]
    assert 20 < len(back["text"]) - 1 < 200 and back["text"][1:] == [tuple(e) for e in sg_text[:len(back["text"]) - 1]]
    assert back["meta"]["text"]["sharegpt_tokens"] == 300 * (len(back["text"]) - 1)
    with pytest.raises(ValueError, match="alone take .* bytes, over max_bytes=100"):
        fit_to_bytes(big, 100)


@pytest.mark.slow  # a fit (~14 s)
def test_eagle3_fit_stays_within_its_epochs_scores_held_out_and_keeps_the_best(tmp_path):
    from train_draft.eagle3_fit import Fit3Config, RowPlan, fit_eagle3
    t = tiny_target()
    fs, held = token_set(_records(12), 64), token_set(_records(3, start=50, tag="h"), 64)
    cfg = Fit3Config(steps=1000, batch_size=1, seq_len=48, ttt_steps=2, draft_vocab_size=32, warmup=3, lr=3e-3,
                     max_epochs=2.0)
    per_epoch = RowPlan(fs, cfg).steps_per_epoch
    seen = []
    r = fit_eagle3(t, fs, tmp_path / "f", cfg, log_every=1, ckpt_every=10 ** 9, eval_set=held, eval_every=3,
                   on_best=lambda p, s, m: seen.append((s, m["loss"])), export_dir=tmp_path / "head")
    assert r["step"] == 2 * per_epoch and r["epochs"] == 2.0
    lines = [json.loads(x) for x in (tmp_path / "f" / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if x.get("split") == "eval"]
    assert [x["step"] for x in evals] == sorted({*range(3, r["step"] + 1, 3), r["step"]})
    assert lines[-2]["epoch"] == 2.0 and {"acc0", "acc1", "loss"} <= evals[0].keys()
    best = min(evals, key=lambda x: x["loss"])
    assert r["best"]["step"] == best["step"] == seen[-1][0] and [s for s, _ in seen] == sorted(s for s, _ in seen)
    assert json.loads((tmp_path / "f" / "fit.json").read_text())["epoch_cap"]["steps_per_epoch"] == per_epoch
    head = load_draft(tmp_path / "head", t)  # the best params, not the last
    np.testing.assert_allclose(np.asarray(head.params["fc_w"], np.float32),
                               r["params"]["fc_w"].astype(np.float16).astype(np.float32))
    # a fit continued from that head starts where it ended, not from scratch
    again = fit_eagle3(t, fs, tmp_path / "g", dataclasses.replace(cfg, max_epochs=0.0, steps=1), ckpt_every=10 ** 9,
                       eval_set=held, eval_every=1, init=dict(head.params))
    fresh = fit_eagle3(t, fs, tmp_path / "h", dataclasses.replace(cfg, max_epochs=0.0, steps=1), ckpt_every=10 ** 9,
                       eval_set=held, eval_every=1)
    assert again["best"]["eval"]["loss"] < fresh["best"]["eval"]["loss"]
    assert abs(again["best"]["eval"]["loss"] - best["loss"]) < 0.05 * best["loss"]
    np.testing.assert_array_equal(again["params"]["d2t"], np.asarray(head.params["d2t"]))


@pytest.mark.slow  # three small fits (test-fast's budget); `make test` runs it
def test_a_fit_runs_the_programs_compiled_ahead_for_its_shapes(tmp_path):
    """`compile_ahead` builds the step and held-out loss on another thread (the recipe: while it regenerates);
    the fit that runs them gives the same params bit for bit, and a fit of other shapes compiles its own."""
    from train_draft.eagle3_fit import Fit3Config, compile_ahead, fit_eagle3, measure_step
    from train_draft.regen import CompileCounter
    t = tiny_target()
    fs, held = token_set(_records(12), 64), token_set(_records(3, start=50, tag="h"), 64)
    cfg = Fit3Config(steps=4, batch_size=2, seq_len=48, ttt_steps=2, draft_vocab_size=32, warmup=3, lr=3e-3)
    kw = dict(ckpt_every=10 ** 9, eval_set=held, eval_every=2)
    ahead = compile_ahead(t, cfg, 32)
    ahead.result()
    timing = measure_step(t, cfg, ahead.result(), 32, steps=2)  # what the recipe predicts its fit from
    assert timing["step_s"] > 0 and timing["eval_batch_s"] > 0 and timing["steps_timed"] == 2
    with CompileCounter() as cc:  # the programs came from the other thread: the counter on this one saw none
        r = fit_eagle3(t, fs, tmp_path / "a", cfg, ahead=ahead, **kw)
    assert r["ahead"]["status"] == "used" and r["ahead"]["compile_s"] > 0
    assert json.loads((tmp_path / "a" / "fit.json").read_text())["ahead"]["status"] == "used"
    plain = fit_eagle3(t, fs, tmp_path / "b", cfg, **kw)
    assert plain["ahead"] == {"status": "none"}
    from ddd_jax import io as dio
    a, b = dio.flatten(r["params"]), dio.flatten(plain["params"])
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    assert r["best"] == plain["best"]
    other = fit_eagle3(t, fs, tmp_path / "c", dataclasses.replace(cfg, batch_size=1), ahead=ahead, **kw)
    assert other["ahead"]["status"] == "built for other shapes (compiled again)" and other["step"] == 4
    assert cc.compiles < 50  # eager ops only, not the two fit programs (a bound: the step alone is one program)


EXPORT_RUN = dataclasses.replace(TINY, train_eagle1="off", acceptance="off", eval_every=2)


@pytest.mark.slow  # a tiny recipe run with compiles; `make test` runs it
def test_the_export_folder_gets_each_stage_as_it_ends_and_the_run_keeps_its_deadline(tmp_path):
    t = tiny_target()
    start = time.time()
    r = run_recipe(t, fake_inputs(t), tmp_path / "run", EXPORT_RUN, progress=False, export_dir=tmp_path / "out",
                   deadline=start + 120)
    assert time.time() - start < 120 and r["budget_s"] <= 120
    out = tmp_path / "out"
    assert check_limits(out)["problems"] == []
    assert sorted(p.name for p in out.iterdir()) == ["eagle3-metrics.jsonl.gz", "recipe.json", "regen.npz",
                                                      "tiny4-eagle3.tar"]
    assert r["head_forms"]["tiny4-eagle3.tar"] == "float16" and r["exported"]["tiny4-eagle3.tar"] == "written (float16)"
    assert json.loads((out / "recipe.json").read_text()) == json.loads(json.dumps(r))
    st = r["stages"]
    assert st["eagle1"]["status"] == "skipped" and st["acceptance"]["status"] == "skipped"
    assert st["regenerate"]["programs"] >= st["regenerate"]["compiles"] >= 0
    assert st["regenerate"]["new_tokens_per_s"] > 0
    # every bucket's prefill and the loop were built ahead, on other threads
    assert set(st["regenerate"]["compiled_ahead_s"]) == {"loop", *map(str, st["regenerate"]["buckets"])}
    assert st["eagle3"]["epochs"] > 0 and st["eagle3"]["best"]["step"] >= 1
    assert st["eagle3"]["ahead"]["status"] == "used"  # compiled while the target regenerated
    assert st["heldout"]["heads"]["tiny4-eagle3"]["step"] == st["eagle3"]["best"]["step"]
    regen = load_regen(out / "regen.npz")
    assert len(regen["train"]) == 10 and len(regen["holdout"]) == 3
    head = load_draft(str(out / "tiny4-eagle3.tar"), t)
    ps = [[5, 6, 7], [9, 10, 11, 12]]
    assert generate(t, head, ps, max_new_tokens=8, method="eagle2").tokens == generate(t, None, ps,
                                                                                       max_new_tokens=8).tokens
    # a later run continues that head
    r2 = run_recipe(t, fake_inputs(t), tmp_path / "run2", EXPORT_RUN, progress=False, init=out / "tiny4-eagle3.tar")
    assert r2["stages"]["eagle3"]["init"] is True and r2["init"].endswith("tiny4-eagle3.tar")


def _run_until_killed(out, export, ready):
    t = tiny_target()
    slow = dataclasses.replace(EXPORT_RUN, eagle3=dataclasses.replace(EXPORT_RUN.eagle3, steps=10 ** 6),
                               budget_s=3600.0)
    run_recipe(t, fake_inputs(t), out, slow, progress=False, export_dir=export)


@pytest.mark.slow  # a recipe run killed in its fit; `make test` runs it
def test_a_run_killed_mid_fit_leaves_what_it_finished_within_the_limits(tmp_path):
    out, export = tmp_path / "run", tmp_path / "out"
    proc = mp.get_context("spawn").Process(target=_run_until_killed, args=(out, export, None))
    proc.start()
    try:
        deadline = time.time() + 240
        while time.time() < deadline:  # killed once the fit has exported a first best head
            if (export / "tiny4-eagle3.tar").is_file():
                break
            assert proc.is_alive(), "the recipe process ended before its fit exported a head"
            time.sleep(0.2)
        else:
            pytest.fail("no head was exported within 240 s")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.join(30)
    assert check_limits(export)["problems"] == []
    assert not [p for p in export.iterdir() if p.name.startswith(".")]  # no half-written file
    rec = json.loads((export / "recipe.json").read_text())
    assert rec["stages"]["regenerate"]["status"] == "done" and rec["stages"]["eagle3"]["status"] == "running"
    assert len(load_regen(export / "regen.npz")["train"]) == 10
    t = tiny_target()
    assert load_draft(str(export / "tiny4-eagle3.tar"), t).config.head_type == "eagle3"


def test_regen_first_takes_the_targets_replies_before_sharegpt_in_every_epoch():
    from train_draft.eagle3_fit import Fit3Config, RowPlan
    from train_draft.recipe import fit_groups, fit_text
    text = [(f"sharegpt:{i}", list(range(2, 30)), [1] * 28) for i in range(6)] + \
        [(f"regen:{i}", list(range(3, 31)), [0] * 3 + [1] * 25) for i in range(2)]
    inputs = {"text": text}
    assert [k for k, _, _ in fit_text(inputs, "regen")] == ["regen:0", "regen:1"]
    assert [k for k, _, _ in fit_text(inputs, "regen-first")][:2] == ["regen:0", "regen:1"]
    fs = token_set(_records(4), 64, fit_text(inputs, "regen-first"))  # 4 replies of this run, 2 earlier, 6 ShareGPT
    groups = fit_groups(fs, "regen-first")
    assert groups.tolist() == [0] * 6 + [1] * 6 and fit_groups(fs, "all") is None
    plan = RowPlan(fs, Fit3Config(batch_size=1, seq_len=40), groups)
    for epoch in (0, 1):
        seqs = [k for row in plan.rows(epoch) for k, _ in row]
        assert sorted(seqs) == list(range(12)) and set(seqs[:6]) == set(range(6)), seqs  # replies first
    assert plan.rows(0) != RowPlan(fs, Fit3Config(batch_size=1, seq_len=40, seed=1), groups).rows(0)
