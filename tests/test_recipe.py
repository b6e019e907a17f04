"""The head-training recipe (`train_draft.recipe`, `ddd-jax train-draft recipe`): every stage on a tiny target, the
inputs file (round trip, truncation, another target's), and the CLI's --smoke run on the real SmolLM2."""
from __future__ import annotations

import dataclasses
import json
import shutil
import time

import jax
import numpy as np
import pytest

from ddd_jax import generate, llama, load_draft
from ddd_jax.config import ModelConfig
from ddd_jax.target import Target
from train_draft.recipe import (SMOKE, RecipeConfig, check_inputs_for, load_inputs, run_recipe, save_inputs,
                                 with_overrides)

V = 96


def tiny_target(vocab=V, hidden=32, name="tiny4"):
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      eos_token_id=(1,))
    params = llama.init_params(cfg, jax.random.PRNGKey(0), std=0.2)
    params["embed"] = params["embed"] * 4.0
    return Target(name, cfg, params)


def fake_inputs(target, n_train=10, n_hold=3, n_mt=2, seed=0):
    rng = np.random.default_rng(seed)
    part = lambda n, tag: [(f"{tag}{i}", [int(x) for x in rng.integers(2, target.config.vocab_size,  # noqa: E731
                                                                        rng.integers(3, 9))]) for i in range(n)]
    meta = {"format": "ddd-jax-recipe-inputs", "version": 1, "target": target.name,
            "vocab_size": target.config.vocab_size, "hidden_size": target.config.hidden_size, "probe_ids": [],
            "counts": {"train": n_train, "holdout": n_hold, "mtbench": n_mt}}
    return {"meta": meta, "train": part(n_train, "t"), "holdout": part(n_hold, "h"), "mtbench": part(n_mt, "m")}


TINY = dataclasses.replace(SMOKE, train_prompts=0, holdout_prompts=3, regen_batch=4, regen_max_new=12,
                           eagle3=dataclasses.replace(SMOKE.eagle3, seq_len=48, draft_vocab_size=32, steps=6),
                           eagle1=dataclasses.replace(SMOKE.eagle1, seq_len=48, steps=5), tau_max_new=8,
                           tau_labels=0)


def test_inputs_round_trip_and_errors(tmp_path):
    t = tiny_target()
    inputs = fake_inputs(t)
    path = save_inputs(inputs, tmp_path / "in.npz")
    back = load_inputs(path)
    assert back["meta"] == inputs["meta"]
    for part in ("train", "holdout", "mtbench"):
        assert back[part] == inputs[part]
    with np.load(path) as z:
        assert z["train_ids"].dtype == np.uint16
    cut = tmp_path / "cut.npz"
    cut.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    with pytest.raises(ValueError, match="cut.npz.*not a readable .npz"):
        load_inputs(cut)
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        load_inputs(tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="made for 'tiny4'.*vocab_size=96"):
        check_inputs_for(tiny_target(vocab=128, name="other"), inputs)
    big = {**inputs, "meta": {**inputs["meta"], "vocab_size": 70000}}
    with pytest.raises(ValueError, match="uint16"):
        save_inputs(big, tmp_path / "big.npz")


def test_overrides_reach_the_fits_configs_and_are_checked():
    cfg = with_overrides(RecipeConfig(), ["eagle3.batch_size=16", "regen_max_new = 128", "eagle1.lr=1e-3",
                                          "eagle3.dtype=float32", "budget_s=900"])
    assert (cfg.eagle3.batch_size, cfg.regen_max_new, cfg.eagle1.lr, cfg.eagle3.dtype, cfg.budget_s) == \
        (16, 128, 1e-3, "float32", 900.0)
    assert cfg.eagle3.ttt_steps == RecipeConfig().eagle3.ttt_steps and with_overrides(cfg, []) == cfg
    for bad, msg in [("eagle3.batch=4", "Fit3Config has no field 'batch'.*batch_size"),
                     ("eagle3.batch_size=lots", "'lots' is not a valid int"), ("eagle3=4", "is a config"),
                     ("regen_batch.size=2", "not a config with fields"), ("budget_s", "expected FIELD=VALUE"),
                     ("regen_until=0.9", "regen_until < eagle3_until"), ("eagle3.dtype=float16", "dtype must be")]:
        with pytest.raises(ValueError, match=msg):
            with_overrides(RecipeConfig(), [bad])


def test_acceptance_measures_the_reference_at_the_default_tree_right_after_the_new_heads():
    from train_draft.recipe import acceptance_runs
    runs = acceptance_runs({"e3": "d3", "e1": "d1"}, {"ref": "dr"})
    keys = list(runs)
    assert keys[:5] == ["e3/eagle2-default", "e1/eagle2-default", "ref/eagle2-default", "e3/ddd-paper",
                        "e1/ddd-paper"]
    assert runs["ref/eagle2-default"]["draft"] == "dr" and runs["ref/eagle2-default"]["tree"].total_tokens == 60
    assert {k.split("/")[1] for k in keys if k.startswith("ref/")} == {k.split("/")[1] for k in keys
                                                                         if k.startswith("e3/")}
    assert all(k.startswith("ref/") for k in keys[len(keys) - (len(keys) // 3 - 1):])  # the rest of it last
    assert list(acceptance_runs({"e3": "d3"})) == [k for k in keys if k.startswith("e3/")]
    assert list(acceptance_runs({"e3": "d3", "e1": "d1"}, {"ref": "dr"}, labels=2)) == keys[:2] + [
        "ref/eagle2-default", "e3/ddd-paper", "e1/ddd-paper", "ref/ddd-paper"]


class CharChat:
    """A stand-in target for tokenizing: a character per token, a header token per role, 1 ends a turn."""
    name = "chars"
    config = ModelConfig(vocab_size=256, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=8)

    def encode(self, text):
        return [2 + ord(c) % 250 for c in text]

    def encode_chat(self, msgs, add_generation_prompt=True):
        ids = []
        for m in msgs:
            ids += [252 if m["role"] == "user" else 253] + self.encode(m["content"]) + [1]
        return ids + [253] * add_generation_prompt


def test_inputs_take_short_first_turns_first_then_longer_and_later_turns(tmp_path):
    from train_draft.data import mtbench_questions
    from train_draft.recipe import prepare_inputs

    def conv(cid, *turns):
        return {"id": cid, "conversations": [{"from": "human" if k % 2 == 0 else "gpt", "value": t}
                                             for k, t in enumerate(turns)]}
    mt_turn = sorted(mtbench_questions())[0]
    convs = [conv("a", "hi", "hello there", "and then?", "more", "last one", "ok"),   # 3 user turns, all short
             conv("b", "x" * 30, "long first turn"),                                  # first turn over 24 tokens
             conv("c", "q", "y" * 40, "follow-up", "sure"),                           # second turn over 48
             conv("d", "short", "reply", mt_turn, "no"),                              # repeats MT-bench: dropped
             conv("e", "z" * 60, "too long for anything")]                            # over 48: skipped
    sg = tmp_path / "sharegpt.json"
    sg.write_text(json.dumps(convs))
    qs = tmp_path / "question.jsonl"
    qs.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem."]}) + "\n")
    t = CharChat()
    inputs = prepare_inputs(t, max_prompt_len=24, max_context_len=48, holdout_percent=0, sharegpt=sg,
                            questions=qs, progress=False)
    meta, train = inputs["meta"], dict(inputs["train"])
    msgs_a = [{"role": "user" if k % 2 == 0 else "assistant", "content": x}
              for k, x in enumerate(["hi", "hello there", "and then?", "more", "last one", "ok"])]
    assert train["a#2"] == t.encode_chat(msgs_a[:3]) and train["a#3"] == t.encode_chat(msgs_a[:5])
    assert train["a"] == t.encode_chat(msgs_a[:1]) and train["c"] == t.encode_chat([{"role": "user", "content": "q"}])
    assert len(train["b"]) > 24
    assert not any(k.startswith("d") for k in train)                       # no turn of it trains
    assert sorted(train) == ["a", "a#2", "a#3", "b", "c"]
    keys = [k for k, _ in inputs["train"]]
    assert sorted(keys[:2]) == ["a", "c"] and sorted(keys[2:]) == ["a#2", "a#3", "b"]  # short first turns first
    assert meta["train_order"] == {"short_first_turns": 2, "long_first_turns": 1, "later_turns": 2,
                                   "answered_by_prior_regen": 0}
    assert meta["skipped_long"]["train_first_turns"] == 1 and meta["skipped_long"]["train_later_turns"] == 1
    assert inputs["mtbench"] == [("81", t.encode_chat([{"role": "user", "content": "Write a poem."}]))]
    firsts = prepare_inputs(t, max_prompt_len=24, max_context_len=0, holdout_percent=0, sharegpt=sg, questions=qs,
                            progress=False)
    assert sorted(k for k, _ in firsts["train"]) == ["a", "c"]
    with pytest.raises(ValueError, match="max_context_len"):
        prepare_inputs(t, max_prompt_len=24, max_context_len=12, sharegpt=sg, questions=qs, progress=False)


@pytest.mark.slow  # ~1 minute of compiles; `make test` runs it
def test_every_stage_runs_and_records_itself(tmp_path):
    t = tiny_target()
    r = run_recipe(t, fake_inputs(t), tmp_path / "run", TINY, smoke=True, progress=False)
    assert json.loads((tmp_path / "run" / "recipe.json").read_text()) == json.loads(json.dumps(r))
    st = r["stages"]
    assert {k: v["status"] for k, v in st.items()} == {k: "done" for k in
                                                       ("regenerate", "eagle3", "eagle1", "export", "heldout",
                                                        "acceptance")}
    assert st["regenerate"]["train"]["records"] == 10 and st["regenerate"]["holdout"]["records"] == 3
    assert st["eagle3"]["steps"] == 6 and st["eagle3"]["fit_config"]["ttt_steps"] == TINY.eagle3.ttt_steps
    assert set(st["heldout"]["heads"]["tiny4-eagle3"]) >= {"acc0", "acc1", "tokens"}
    assert 0 <= st["heldout"]["heads"]["tiny4-eagle"]["acc0"] <= 1
    res = st["acceptance"]["results"]
    assert "tiny4-eagle3/eagle2-default" in res and "tiny4-eagle/ddd-paper" in res
    assert all(v["identical"] == v["prompts"] == 2 for v in res.values())  # lossless, every run
    assert "past_first_check" in res["tiny4-eagle3/ddd-paper"]
    assert r["reference"] == {"head": None, "reason": "no packaged head 'tiny4-eagle'"}
    from train_draft.accept import reference_head
    refs, info = reference_head(t, str(tmp_path / "nowhere"))
    assert refs == {}  # recorded, not raised
    assert "FileNotFoundError" in info["reason"] and "nowhere" in info["reason"]
    # the exported heads load, carry a draft vocabulary, and decode vanilla's tokens
    for name, kind in (("tiny4-eagle3", "eagle3"), ("tiny4-eagle", "eagle1")):
        d = load_draft(tmp_path / "run" / "heads" / name, t)
        assert d.config.head_type == kind and d.config.draft_vocab_size == 32
        ps = [[5, 6, 7], [9, 10, 11, 12]]
        assert generate(t, d, ps, max_new_tokens=10, method="eagle2").tokens == \
            generate(t, None, ps, max_new_tokens=10).tokens
    # a rerun skips what is done (regenerated replies are not decoded again)
    mtime = (tmp_path / "run" / "regen" / "train.jsonl").stat().st_mtime_ns
    r2 = run_recipe(t, fake_inputs(t), tmp_path / "run", TINY, smoke=True, progress=False)
    assert (tmp_path / "run" / "regen" / "train.jsonl").stat().st_mtime_ns == mtime
    assert r2["stages"]["eagle3"]["started_utc"] == st["eagle3"]["started_utc"]


def test_a_fit_out_of_device_memory_or_data_halves_its_batch():
    from train_draft.eagle3_fit import Fit3Config
    from train_draft.recipe import halving_batch
    seen = []

    def run(cfg):
        seen.append(cfg.batch_size)
        if cfg.batch_size > 4:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.4GiB")
        if cfg.batch_size > 2:
            raise ValueError("not enough data for one step: 3 packed rows of 1024 tokens, a step needs 4")
        return "ok"

    out, used, retries = halving_batch(run, Fit3Config(batch_size=16))
    assert out == "ok" and used.batch_size == 2 and seen == [16, 8, 4, 2]
    assert [(r["batch_size"], r["reason"]) for r in retries] == [(16, "out of memory"), (8, "out of memory"),
                                                                  (4, "not enough data")]
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):  # one row still too many
        halving_batch(lambda cfg: run(Fit3Config(batch_size=8)), Fit3Config(batch_size=1))
    with pytest.raises(ValueError, match="other"):  # any other error is not retried
        halving_batch(lambda cfg: (_ for _ in ()).throw(ValueError("other")), Fit3Config(batch_size=8))


@pytest.mark.slow  # ~5 s
def test_eagle3_fit_sizes_itself_to_a_budget(tmp_path):
    from train_draft.eagle3_fit import Fit3Config, fit_eagle3
    from train_draft.recipe import token_set
    t = tiny_target()
    recs = [{"id": f"s{i}", "prompt_len": 3, "ids": list(range(2 + i, 40 + i))} for i in range(12)]
    fs = token_set(recs, 64)
    cfg = Fit3Config(steps=10 ** 6, batch_size=1, seq_len=48, ttt_steps=2, draft_vocab_size=32, warmup=10)
    # the budget also holds the first step's compile (5-10 s here, more on a loaded machine)
    r = fit_eagle3(t, fs, tmp_path / "f", cfg, time_budget_s=20.0, probe_steps=2, log_every=1, ckpt_every=10 ** 9)
    meta = json.loads((tmp_path / "f" / "fit.json").read_text())
    assert 3 <= r["step"] < 10 ** 6 and meta["fit_config"]["steps"] == r["fit_config"].steps
    assert meta["sized_to_budget"]["probe_s_per_step"] > 0


@pytest.mark.deep  # the real SmolLM2 through the whole recipe (minutes): make test-deep
def test_cli_smoke_on_smollm2(smollm2_by_name, tmp_path, capsys):
    from ddd_jax.cli import main
    from train_draft.recipe import process_start
    # --deadline-s counts from the process's start: this test's process (a pytest worker) may be old already
    limit = int(time.time() - process_start()) + 900
    assert main(["train-draft", "recipe", "--smoke", "--out", str(tmp_path / "r"), "--export-dir",
                 str(tmp_path / "out"), "--deadline-s", str(limit)]) == 0
    r = json.loads((tmp_path / "r" / "recipe.json").read_text())
    assert r == json.loads((tmp_path / "out" / "recipe.json").read_text()) and 0 < r["deadline_s"] <= limit
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "eagle3-metrics.jsonl.gz", "recipe.json", "regen.npz", "smollm2-135m-instruct-eagle.tar",
        "smollm2-135m-instruct-eagle3.tar"]
    assert r["inputs"]["text_tokens"] > 0 and r["stages"]["regenerate"]["text_entries"] > 0
    assert r["smoke"] and r["device"]["backend"] == "cpu"
    assert all(v["status"] == "done" for v in r["stages"].values())
    assert (tmp_path / "r" / "heads" / "smollm2-135m-instruct-eagle3" / "model.safetensors").is_file()
    assert (tmp_path / "r" / "heads" / "smollm2-135m-instruct-eagle" / "model.safetensors").is_file()
    res = r["stages"]["acceptance"]["results"]
    assert res["smollm2-135m-instruct-eagle3/eagle2-default"]["identical"] == 2
    # the shipped head, measured beside the new ones on the same prompts
    assert r["reference"]["head"] == "smollm2-135m-instruct-eagle" and r["reference"]["step"] >= 1
    assert res["reference-smollm2-135m-instruct-eagle/eagle2-default"]["identical"] == 2


@pytest.mark.slow  # two tiny recipe runs; `make test` runs it
def test_a_rerun_fits_what_failed_and_measures_the_new_head(tmp_path, monkeypatch):
    """A stage that failed runs again on a rerun, its old error gone, and the head it exports is evaluated and
    measured then, while what was measured before is kept."""
    import train_draft.recipe as recipe
    t = tiny_target()
    real = recipe.eagle1_stage

    def broken(*a, **k):
        raise RuntimeError("a fit that failed")

    monkeypatch.setattr(recipe, "eagle1_stage", broken)
    st = run_recipe(t, fake_inputs(t), tmp_path / "run", TINY, smoke=True, progress=False)["stages"]
    assert st["eagle1"]["status"] == "failed" and "a fit that failed" in st["eagle1"]["error"]
    assert set(st["heldout"]["heads"]) == {"tiny4-eagle3"}
    first = json.loads(json.dumps(st["acceptance"]["results"]))  # as recipe.json holds it
    assert first and all(k.startswith("tiny4-eagle3/") for k in first)
    monkeypatch.setattr(recipe, "eagle1_stage", real)
    # the rerun also measures a reference head (a directory) beside the new ones
    ref = tmp_path / "ref"
    shutil.copytree(tmp_path / "run" / "heads" / "tiny4-eagle3", ref)
    r2 = run_recipe(t, fake_inputs(t), tmp_path / "run", dataclasses.replace(TINY, reference_head=str(ref)),
                    smoke=True, progress=False)
    st2 = r2["stages"]
    assert r2["reference"]["head"] == str(ref) and r2["reference"]["head_type"] == "eagle3"
    assert st2["acceptance"]["results"]["reference-ref/eagle2-default"]["identical"] == 2
    assert st2["eagle1"]["status"] == "done" and "error" not in st2["eagle1"]
    assert set(st2["heldout"]["heads"]) == {"tiny4-eagle3", "tiny4-eagle"}
    res = st2["acceptance"]["results"]
    assert any(k.startswith("tiny4-eagle/") for k in res)
    assert all(res[k] == v for k, v in first.items())  # kept, not measured again
