"""Self-distillation data (`train-draft regenerate`): the target's own greedy replies, resumable, as loss-masked examples."""
from __future__ import annotations

import json
import time

import jax
import numpy as np
import pytest

from ddd_jax import generate
from train_draft.regen import (CompileCounter, choose_buckets, compile_plan, example_from_record, load_records,
                               regen_plan, regenerate)
from test_train_fit import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(name="tiny-regen")


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [(f"c{i}", [int(x) for x in rng.integers(1, 60, size=int(rng.integers(3, 12)))]) for i in range(n)]


def test_records_are_the_targets_greedy_replies_and_resume(target, tmp_path):
    out = tmp_path / "regen.jsonl"
    prompts = _prompts(7)
    r1 = regenerate(target, prompts[:5], out, max_new_tokens=4, batch_size=3, progress=False)
    assert (r1["records"], r1["new_records"]) == (5, 5)
    with open(out, "a") as f:  # an interrupted write: a torn last line
        f.write('{"id": "c9", "prompt_')
    r2 = regenerate(target, prompts, out, max_new_tokens=4, batch_size=3, progress=False)
    assert (r2["records"], r2["new_records"]) == (7, 2)  # c0..c4 skipped, torn line dropped
    recs = load_records(out)
    assert sorted(r["id"] for r in recs) == [f"c{i}" for i in range(7)]
    for rec in recs:
        ids = dict(prompts)[rec["id"]]
        assert rec["prompt_len"] == len(ids) and rec["ids"][:len(ids)] == ids
        alone = generate(target, None, ids, max_new_tokens=4).tokens  # decoded alone, not in a batch
        assert rec["ids"][len(ids):] == alone
        assert rec["finished"] == (len(alone) < 4)


@pytest.mark.slow  # ~6 s
def test_one_plan_compiles_once_for_every_mix_and_keeps_the_greedy_replies(target, tmp_path):
    """Two parts (a held-out one, then a training one) of prompts from 3 to 300 tokens share one plan: few buckets,
    one cache capacity, fixed rows. The first part compiles a bounded set of programs, the second none, and every
    reply is what the target gives the prompt decoded alone."""
    rng = np.random.default_rng(1)
    lengths = [3, 40, 300, 90, 7, 150, 260, 12, 64, 33, 200, 5, 120, 70, 9, 290]  # spread over 5 decoder buckets
    parts = [[(f"{name}{i}", [int(x) for x in rng.integers(1, 60, size=n)]) for i, n in enumerate(lengths[k::2])]
             for k, name in enumerate("ht")]
    plan = regen_plan(target, parts, batch_size=3, max_new_tokens=8)
    assert plan["batch_size"] == 3 and len(plan["buckets"]) <= 3 and plan["buckets"][-1] == 512
    assert plan["buckets"] == choose_buckets(lengths) and plan["capacity"] >= 512 + 8
    r1 = regenerate(target, parts[0], tmp_path / "h.jsonl", max_new_tokens=8, progress=False, **plan)
    r2 = regenerate(target, parts[1], tmp_path / "t.jsonl", max_new_tokens=8, progress=False, **plan)
    assert r1["records"] == r2["records"] == 8
    # a prefill per bucket and one decoding loop, not per batch (programs: built or loaded from jax's persistent cache,
    # which `make test` keeps between runs, so `compiles` alone may be 0)
    assert 1 <= r1["programs"] <= 3 * len(plan["buckets"]) + 4 and 0 <= r1["compiles"] <= r1["programs"]
    assert r2["programs"] == r2["compiles"] == 0  # a different mix of prompts, the same programs
    for r in (r1, r2):
        assert (r["rows"], r["buckets"], r["capacity"]) == (3, list(plan["buckets"]), plan["capacity"])
        assert r["new_tokens_per_s"] > 0 and r["new_reply_tokens"] > 0
    recs = load_records(tmp_path / "h.jsonl") + load_records(tmp_path / "t.jsonl")
    prompts = dict(parts[0] + parts[1])
    for rec in recs:
        ids = prompts[rec["id"]]
        assert rec["ids"][:len(ids)] == ids and rec["ids"][len(ids):] == generate(target, None, ids,
                                                                                  max_new_tokens=8).tokens
    fresh = float(time.time_ns() % 1_000_003)  # a constant no persistent compilation cache can already hold
    with CompileCounter() as cc:  # nested counters both see a compile
        with CompileCounter() as inner:
            jax.jit(lambda x: x * 3 + fresh)(np.arange(5))
    assert cc.compiles == inner.compiles >= 1 and cc.built == inner.built >= 1 and cc.seconds > 0


@pytest.mark.slow  # a plan's programs built on three threads (test-fast's budget); `make test` runs it
def test_a_plan_compiled_ahead_leaves_its_calls_no_program_to_build(target, tmp_path):
    """`compile_plan` builds every bucket's prefill and the decoding loop on other threads at once; a call with
    `warm=` waits for its batches' programs and builds none of them on its own thread, with the same replies."""
    rng = np.random.default_rng(2)
    prompts = [(f"w{i}", [int(x) for x in rng.integers(1, 60, size=n)]) for i, n in enumerate([4, 30, 140, 9, 70])]
    plan = regen_plan(target, [prompts], batch_size=2, max_new_tokens=5)  # shapes no other test decodes
    warm = compile_plan(target, plan, 5)
    assert set(warm) == {"loop", *plan["buckets"]} and len(plan["buckets"]) >= 2
    r = regenerate(target, prompts, tmp_path / "w.jsonl", max_new_tokens=5, progress=False, warm=warm, **plan)
    assert all(f.result() > 0 for f in warm.values())
    # on this thread at most the batches' host-to-device copies (one small program per shape), no prefill or loop
    assert r["programs"] <= len(plan["buckets"]) + 1 and r["warm_wait_s"] >= 0
    plain = regenerate(target, prompts, tmp_path / "p.jsonl", max_new_tokens=5, progress=False, **plan)
    assert plain["programs"] == 0  # the same programs, already built
    assert load_records(tmp_path / "w.jsonl") == load_records(tmp_path / "p.jsonl")


def test_max_records_and_bad_arguments(target, tmp_path):
    out = tmp_path / "r.jsonl"
    r = regenerate(target, _prompts(5), out, max_new_tokens=4, batch_size=3, max_records=4, progress=False)
    assert r["records"] == 4 and len(load_records(out)) == 4
    with pytest.raises(ValueError, match="batch_size"):
        regenerate(target, _prompts(2), out, batch_size=0, progress=False)
    with pytest.raises(ValueError, match="largest bucket"):
        regenerate(target, [("x", [1] * 40)], out, buckets=[32], progress=False)
    with pytest.raises(ValueError, match="capacity=64"):
        regenerate(target, _prompts(2), out, max_new_tokens=40, buckets=[32], capacity=64, progress=False)
    with pytest.raises(ValueError, match="prompt_len=8"):
        generate(target, None, [[1] * 9, [2]], max_new_tokens=2, prompt_len=8)


def test_a_spent_time_limit_still_takes_min_batches(target, tmp_path):
    """With no time left, nothing is generated, unless the caller asks for a first batch anyway (the recipe's
    training replies, which the later stages cannot do without)."""
    r0 = regenerate(target, _prompts(5), tmp_path / "a.jsonl", max_new_tokens=4, batch_size=2, time_limit_s=0.0,
                    progress=False)
    assert r0["records"] == 0
    r1 = regenerate(target, _prompts(5), tmp_path / "b.jsonl", max_new_tokens=4, batch_size=2, time_limit_s=0.0,
                    min_batches=1, progress=False)
    assert r1["records"] == 2 and len(load_records(tmp_path / "b.jsonl")) == 2


def test_example_masks_only_the_reply_and_bad_files(tmp_path):
    ex = example_from_record({"id": "a", "prompt_len": 3, "ids": [5, 6, 7, 8, 9]}, max_len=4)
    assert ex["ids"].tolist() == [5, 6, 7, 8] and ex["mask"].tolist() == [0, 0, 0, 1]
    assert example_from_record({"id": "b", "prompt_len": 3, "ids": [5, 6, 7, 8]}, max_len=3) is None  # no reply left
    with pytest.raises(FileNotFoundError, match="regenerate"):
        load_records(tmp_path / "missing.jsonl")
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"id": "a", "prompt_len": 1, "ids": [1, 2]}\n{"id": "b", "pro')
    assert [r["id"] for r in load_records(torn)] == ["a"]  # the torn tail is skipped, the file left alone
    assert torn.read_text().endswith('"pro')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('not json\n{"id": "a", "prompt_len": 1, "ids": [1, 2]}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_records(bad)
    bad.write_text(json.dumps({"id": "a", "prompt_len": 5, "ids": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match="malformed"):
        load_records(bad)


def test_cli_extract_regenerated_checks_the_split_and_masks_replies(target, tmp_path, monkeypatch, capsys):
    from ddd_jax.cli import main
    from train_draft import cli as tcli
    from train_draft.data import is_holdout
    from train_draft.extract import load_features
    monkeypatch.setattr(tcli, "_load_target", lambda name, **kw: target)
    held = next(f"h{i}" for i in range(10000) if is_holdout(f"h{i}", 2.0))
    train = [f"t{i}" for i in range(50) if not is_holdout(f"t{i}", 2.0)][:2]
    out = tmp_path / "r.jsonl"
    regenerate(target, [(train[0], [3, 4, 5]), (train[1], [7, 8]), (held, [9, 10])], out, max_new_tokens=4,
               batch_size=3, progress=False)
    args = ["train-draft", "extract", "--target", "tiny", "--regenerated", str(out), "--out", str(tmp_path / "f"),
            "--max-len", "16", "--buckets", "16", "--shard-size", "4"]
    assert main(args) == 2
    assert "1 records" in capsys.readouterr().err and not (tmp_path / "f").exists()
    out.write_text("".join(line for line in out.read_text().splitlines(keepends=True) if held not in line))
    assert main(args) == 0
    fs = load_features(tmp_path / "f", target)
    assert fs.n_seqs == 2 and fs.manifest["source"]["kind"] == "regenerated"
    masks = {i: fs.mask[a:b].tolist() for i, a, b in zip(fs.seq_ids, fs.offsets[:-1], fs.offsets[1:])}
    assert masks == {train[0]: [0, 0, 0, 1, 1, 1, 1], train[1]: [0, 0, 1, 1, 1, 1]}
    # several feature directories: concatenated in order, each checked against its own split
    from train_draft.vocab import token_counts
    out_h = tmp_path / "h.jsonl"
    regenerate(target, [(held, [9, 10])], out_h, max_new_tokens=4, batch_size=1, progress=False)
    assert main(["train-draft", "extract", "--target", "tiny", "--regenerated", str(out_h), "--split", "holdout",
                 "--out", str(tmp_path / "fh"), "--max-len", "16", "--buckets", "16"]) == 0
    both = load_features([tmp_path / "f", tmp_path / "fh"], target)
    assert both.n_seqs == 3 and both.seq_ids == fs.seq_ids + [held]
    assert [p["seqs"] for p in both.parts] == [[0, 2], [2, 3]] and both.manifest["source"]["kind"] == "several"
    np.testing.assert_array_equal(both.ids[:fs.n_tokens], fs.ids)
    twice = token_counts([tmp_path / "f", tmp_path / "f"], 64)
    np.testing.assert_array_equal(twice, 2 * token_counts(tmp_path / "f", 64))
    assert load_features([tmp_path / "f", tmp_path / "fh"], target, max_shards=1).n_seqs == 2
    fit = ["train-draft", "fit", "--target", "tiny", "--out", str(tmp_path / "run"), "--steps", "1"]
    capsys.readouterr()
    assert main(fit + ["--features", str(tmp_path / "f"), str(tmp_path / "fh")]) == 2
    err = capsys.readouterr().err
    assert "1 training sequences" in err and str(tmp_path / "fh") in err
    assert main(fit + ["--features", str(tmp_path / "f"), "--eval-features", str(tmp_path / "f")]) == 2
    assert "not in the ShareGPT holdout" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything is written
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        load_features([tmp_path / "f", tmp_path / "missing"], target)


def test_cli_regenerate_skip_prompts_starts_later_in_the_order(target, tmp_path, monkeypatch, capsys):
    """`--skip-prompts N` answers the prompts after the first N of the order (an earlier file's); past the end fails."""
    from ddd_jax.cli import main
    from train_draft import cli as tcli
    from train_draft import regen
    items = [(f"c{i}", [{"role": "user", "content": str(i)}]) for i in range(5)]
    monkeypatch.setattr(tcli, "_load_target", lambda name, **kw: target)
    monkeypatch.setattr(tcli, "_sharegpt_items", lambda args, split: (items, {split: len(items)}))
    monkeypatch.setattr(regen, "first_turn_prompts", lambda t, its, n: ([(i, [3 + k, 4]) for k, (i, _) in
                                                                          enumerate(its)], 0))
    out = tmp_path / "r.jsonl"
    args = ["train-draft", "regenerate", "--target", "tiny", "--out", str(out), "--max-new-tokens", "2",
            "--batch-size", "2"]
    assert main(args + ["--skip-prompts", "3"]) == 0
    assert [r["id"] for r in load_records(out)] == ["c3", "c4"]
    assert [r["ids"][:2] for r in load_records(out)] == [[6, 4], [7, 4]]
    capsys.readouterr()
    assert main(args + ["--skip-prompts", "5"]) == 2
    assert "--skip-prompts 5" in capsys.readouterr().err
