"""The PyTorch counterpart of the decode loop (ddd_jax.bench.torch_decoding) and `ddd-jax lazy-eval`, on a tiny random
target: torch vanilla = transformers' generate, every torch mode = torch vanilla, torch depths = JAX depths, the
JSON contract of the CLI, and its refusals."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import ddd_jax  # noqa: E402
from ddd_jax import DDDConfig, Target, TreeConfig  # noqa: E402
from ddd_jax.bench import torch_decoding as td  # noqa: E402
from ddd_jax.bench.lazy_eval import ROW_FIELDS, ROWS, row_label, run_lazy_eval  # noqa: E402
from ddd_jax.cli import main  # noqa: E402
from ddd_jax.eagle import with_draft_vocab  # noqa: E402

from spec_helpers import fitted_draft, prompts, tiny_target  # noqa: E402

# threshold -2.5 with checks after steps 1 and 3 makes this head stop at depth 1 or 3 (and sometimes 5)
TREE = TreeConfig(top_k=2, total_tokens=6, depth=3)
DDD = DDDConfig(check_steps=(1, 3), threshold=-2.5, max_depth=5)
MAX_NEW = 16
PROMPTS = prompts(3, seed=3)
SPEC = (("eagle2", "device"), ("ddd", "host"), ("ddd", "device"))


@pytest.fixture(scope="module")
def tiny():
    target, draft = tiny_target(), fitted_draft()
    return target, draft, td.load_torch(target, draft)


def test_torch_vanilla_equals_transformers_generate(tiny):
    target, _, m = tiny
    for p in PROMPTS:
        ref = m.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,  # explicit mask: 0 is a token
                               eos_token_id=list(target.eos_token_ids))[0, len(p):].tolist()
        got = td.generate(m, p, MAX_NEW)
        assert got.tokens == ref
        assert got.stats["target_calls"] == len(ref) - 1 and got.stats["host_syncs"] == len(ref) - 1  # 1 read/token
        assert got.tokens == ddd_jax.generate(target, None, p, max_new_tokens=MAX_NEW).tokens  # same as JAX


@pytest.mark.parametrize("vocab", ["full", "reduced"])
@pytest.mark.slow  # both vocabularies (~15 s)
def test_torch_speculative_modes_equal_vanilla_and_take_jax_depths(tiny, vocab):
    """Every torch mode emits torch vanilla's tokens and takes JAX's depths and acceptances. JAX's own modes agree
    with each other (tests/test_spec.py), so JAX runs one mode per method here, and only DDD with the reduced
    vocabulary (fewer compiles; the plans are shared with the CLI test below)."""
    target, draft, m = tiny
    if vocab == "reduced":  # the head drafts over 64 of the 96 tokens (d2t / lm_sub)
        draft = with_draft_vocab(draft, np.arange(95, 31, -1))
        m = td.load_torch(target, draft)
        assert m.d2t is not None and m.draft_out.shape == (64, target.config.hidden_size)
    depths = set()
    for p in PROMPTS:
        van = td.generate(m, p, MAX_NEW).tokens
        ref = {meth: ddd_jax.generate(target, draft, p, max_new_tokens=MAX_NEW, method=meth, sync="device", tree=TREE,
                                      ddd=DDD) for meth in (("eagle2", "ddd") if vocab == "full" else ("ddd",))}
        for method, sync in SPEC:
            if method not in ref:
                continue
            got = td.generate(m, p, MAX_NEW, method=method, sync=sync, tree=TREE, ddd=DDD)
            st, jx = got.stats, ref[method].stats
            assert got.tokens == van, (method, sync)
            assert got.tokens == ref[method].tokens and st["depth_per_call"] == jx["depth_per_call"], (method, sync)
            assert st["accepted_per_call"] == jx["accepted_per_call"] and st["ddd_checks"] == jx["ddd_checks"]
            assert st["target_calls"] == len(st["depth_per_call"]) and sum(st["accepted_per_call"]) == len(van) - 1
            # syncs: one .item() per DDD check in host mode, none in device mode; 2 per cycle outside the draft
            assert st["draft_syncs"] == (st["ddd_checks"] if sync == "host" and method == "ddd" else 0)
            assert st["host_syncs"] == st["draft_syncs"] + 2 * st["target_calls"]
            depths.update(st["depth_per_call"])
    assert {1, 3} <= depths and max(depths) <= DDD.max_depth  # DDD stopped at both checks and went past them


@pytest.mark.slow  # ~5 s
def test_official_export_read_as_eagle_reads_it_decodes_as_ddd_jax(tiny, tmp_path):
    """A head with a reduced vocabulary, exported in the official layout: the torch counterpart reads it as
    SafeAILab/EAGLE does (model.safetensors only, strict=True; the side file never opened) and drafts over the whole
    vocabulary, as EAGLE's code does. ddd-jax's own load of the same directory over the whole vocabulary takes the
    same acceptances and depths, and both emit vanilla's tokens; ddd-jax's load keeps the side file's vocabulary."""
    target, draft, _ = tiny
    d = with_draft_vocab(draft, np.arange(95, 31, -1))
    out = ddd_jax.save_official(d, tmp_path / "official", dtype="float32")
    m = td.load_torch(target, official=out)
    assert m.d2t is None and m.draft_out is m.model.lm_head.weight
    ours = ddd_jax.load_draft(out, target)
    assert np.array_equal(np.asarray(ours.params["d2t"]), np.arange(95, 31, -1))  # ddd-jax reads the side file
    full = td.full_vocabulary(ours)
    for p in PROMPTS:
        van = td.generate(m, p, MAX_NEW).tokens
        for method in ("eagle2", "ddd"):
            got = td.generate(m, p, MAX_NEW, method=method, sync="device", tree=TREE, ddd=DDD)
            jx = ddd_jax.generate(target, full, p, max_new_tokens=MAX_NEW, method=method, sync="device", tree=TREE,
                                  ddd=DDD)
            assert got.tokens == van == jx.tokens, method
            assert got.stats["accepted_per_call"] == jx.stats["accepted_per_call"], method
            assert got.stats["depth_per_call"] == jx.stats["depth_per_call"], method


@pytest.mark.slow  # ~6 s
def test_torch_step0_check_takes_jax_decisions(tiny):
    """A DDD check at step 0 (before any expansion step): torch's host and device modes stop where JAX stops."""
    target, draft, m = tiny
    tree, ddd = TreeConfig(top_k=2, total_tokens=3, depth=2), DDDConfig(check_steps=(0, 2), threshold=-0.4, max_depth=4)
    depths = set()
    for p in PROMPTS:
        jx = ddd_jax.generate(target, draft, p, max_new_tokens=MAX_NEW, method="ddd", sync="device", tree=tree, ddd=ddd)
        for sync in ("host", "device"):
            got = td.generate(m, p, MAX_NEW, method="ddd", sync=sync, tree=tree, ddd=ddd)
            assert got.tokens == jx.tokens == td.generate(m, p, MAX_NEW).tokens, sync
            assert got.stats["depth_per_call"] == jx.stats["depth_per_call"], sync
            assert got.stats["ddd_checks"] == jx.stats["ddd_checks"], sync
        depths.update(jx.stats["depth_per_call"])
    assert 0 in depths and len(depths) >= 2, depths


# the rule variants a host-synced torch DDD must follow: a step-0 check whose stop leaves a pool (the root's top_k
# children) shorter than total_tokens - 1, keeping all of them (-1) or none (0); a tree wider than the plan's
# narrowest verify width; a check at step 0 alone
RULES = {
    "s0-pool-shorter-than-tree": (TreeConfig(top_k=2, total_tokens=6, depth=2),
                                  DDDConfig(check_steps=(0, 2), threshold=-0.4, max_depth=4)),
    "s0-keep0": (TreeConfig(top_k=2, total_tokens=6, depth=2),
                 DDDConfig(check_steps=(0, 2), threshold=-0.4, max_depth=4, stop0_nodes=0)),
    "s0-keep1-wide": (TreeConfig(top_k=3, total_tokens=9, depth=2),
                      DDDConfig(check_steps=(0, 1, 3), threshold=-0.6, max_depth=5, stop0_nodes=1)),
    "s0-only": (TreeConfig(top_k=2, total_tokens=5, depth=1),
                DDDConfig(check_steps=(0,), threshold=-0.4, max_depth=2, stop0_nodes=-1)),
}


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.slow  # four rule variants (~20 s)
def test_torch_host_and_device_ddd_equal_vanilla_over_rule_variants(tiny, rule):
    """Every torch sync mode emits torch vanilla's tokens and takes JAX's depths, for rules whose stops leave fewer
    candidates than the tree holds (the host mode's tree once read past the pool there)."""
    target, draft, m = tiny
    tree, ddd = RULES[rule]
    depths = set()
    for p in PROMPTS:
        van = td.generate(m, p, MAX_NEW).tokens
        jx = ddd_jax.generate(target, draft, p, max_new_tokens=MAX_NEW, method="ddd", sync="device", tree=tree,
                              ddd=ddd)
        assert jx.tokens == van
        for sync in td.SYNCS:
            got = td.generate(m, p, MAX_NEW, method="ddd", sync=sync, tree=tree, ddd=ddd)
            assert got.tokens == van, (rule, sync)
            assert got.stats["depth_per_call"] == jx.stats["depth_per_call"], (rule, sync)
            assert got.stats["accepted_per_call"] == jx.stats["accepted_per_call"], (rule, sync)
        depths.update(jx.stats["depth_per_call"])
    assert 0 in depths and len(depths) >= 2, (rule, depths)  # the step-0 stop and a deeper draft both happened


def test_torch_decoding_refuses_bad_input(tiny):
    target, _, m = tiny
    with pytest.raises(ValueError, match="callback"):
        td.generate(m, [1, 2], 4, method="ddd", sync="callback", tree=TREE, ddd=DDD)
    with pytest.raises(ValueError, match="batches"):
        td.generate(m, [[1, 2], [3]], 4)
    with pytest.raises(ValueError, match="vocabulary|lie in"):
        td.generate(m, [1, 999], 4)
    with pytest.raises(ValueError, match="draft head"):
        td.generate(td.load_torch(target), [1, 2], 4, method="eagle2", tree=TREE)
    with pytest.raises(ValueError, match="unknown torch device"):
        td.torch_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            td.torch_device("gpu")


def test_sync_cost_is_measured_in_both_frameworks(tiny):
    import jax

    from ddd_jax.bench.lazy_eval import jax_sync_loop, sync_cost, sync_work, torch_sync_loop
    target, draft, _ = tiny
    work = sync_work(target, draft)
    assert work[0].shape == (48, 48) and work[1].shape == (96, 48)
    for loop in (torch_sync_loop(work, "cpu", 2), jax_sync_loop(work, jax.devices("cpu")[0], 2)):
        res = sync_cost(loop, steps=5, rounds=3)
        assert len(res["diffs_us"]) == 3 and res["p25_us"] <= res["us"] <= res["p75_us"]
        assert res["step_us"] > 0 and np.isfinite(res["us"])


# ----------------------------------------------------------------------------------------------- CLI and contract
def _word_target(tmp_path):
    """The tiny target with a word-level tokenizer ("w0".."w95") and a plain chat template, saved in our format,
    and the fitted head saved beside it: a tokenizer-complete model for the CLI."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    base = tiny_target()
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(base.config.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    t = Target("tiny-words", base.config, base.params, tok, "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    ddd_jax.checkpoints.ours.save_target(t, tmp_path / "target")
    ddd_jax.save_draft(fitted_draft(), tmp_path / "head")
    return tmp_path / "target", tmp_path / "head"


def _questions(path, n=2):
    rows = [{"question_id": 81 + i, "category": "writing", "turns": [" ".join(f"w{t}" for t in p), "w1 w2"]}
            for i, p in enumerate(prompts(n, seed=5, hi=12))]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _flags():
    return ["--settings", "none", "--tree-top-k", str(TREE.top_k), "--total-tokens", str(TREE.total_tokens),
            "--depth", str(TREE.depth), "--ddd-checks", "1,3", f"--ddd-threshold={DDD.threshold}",
            "--ddd-max-depth", str(DDD.max_depth), "--max-new-tokens", str(MAX_NEW), "--no-progress"]


@pytest.mark.slow  # the whole CLI (~10 s); make test runs it
def test_cli_lazy_eval_writes_the_contract(tmp_path, capsys):
    tdir, hdir = _word_target(tmp_path)
    q = _questions(tmp_path / "q.jsonl")
    out = tmp_path / "out"
    rc = main(["lazy-eval", "--questions", str(q), "--target", str(tdir), "--draft", str(hdir), "--out", str(out),
               "--limit", "1", "--profile-prompts", "1", "--sync-rounds", "1", "--loop-rounds", "1",
               "--torch-threads", "1", *_flags()])
    assert rc == 0, capsys.readouterr().err
    r = json.loads((out / "lazy_eval.json").read_text())
    assert not (out / "lazy_eval.partial.jsonl").exists()  # the checkpoint goes once the outputs are written
    assert set(r["sync_cost_us"]) == {"jax", "torch"}
    assert all(isinstance(v, float) for v in r["sync_cost_us"].values())
    got = [(x["framework"], x["method"], x["sync"]) for x in r["rows"]]
    assert got == [(fw, m, s) for fw in ("jax", "torch") for m, s in ROWS[fw]]
    for row in r["rows"]:
        assert set(ROW_FIELDS) <= set(row)
        assert row["framework"] in ("jax", "torch") and row["method"] in ("vanilla", "eagle2", "ddd")
        assert row["sync"] in (("host", "callback", "device") if row["method"] == "ddd" else (None,))
        for k in ("tokens_per_s", "draft_syncs_per_call", "host_syncs_per_call", "draft_ms_per_call",
                  "verify_ms_per_call"):
            assert isinstance(row[k], float) and row[k] >= 0, (row["label"], k)
        assert isinstance(row["target_calls"], int) and row["target_calls"] > 0
        assert row["identical_to_vanilla"] is True, row["label"]
        if row["framework"] == "torch":
            assert row["tokens_identical_to_jax"] == 1
    by = {x["label"]: x for x in r["rows"]}
    assert by["jax:ddd-device"]["host_syncs_per_call"] == 0 and by["jax:ddd-host"]["draft_syncs_per_call"] >= 1
    assert by["torch:ddd-device"]["draft_syncs_per_call"] == 0 and by["torch:ddd-host"]["draft_syncs_per_call"] >= 1
    assert by["torch:ddd-host"]["depths_identical_to_jax"] == 1
    assert r["config"]["prompts"] == 1 and r["records"][0]["id"] == 81 and r["env"]["torch_threads"] == 1
    assert "text" in r["records"][0]["runs"]["jax:vanilla"]
    lc = r["loop_cost"]  # JAX's DDD (device sync) from a Python loop against its on-device loop
    assert lc["identical"] is True and lc["prompts"] == 1 and lc["rounds"] == 1
    assert lc["host_loop_ms_per_call"] > 0 and lc["device_loop_ms_per_call"] > 0
    assert lc["ms_per_call"] == pytest.approx(lc["host_loop_ms_per_call"] - lc["device_loop_ms_per_call"])
    md = (out / "lazy_eval.md").read_text()
    assert md.count("\n| ") == 2 + len(r["rows"]) - 1 and "from a Python loop" in md
    assert (out / "time_split.png").stat().st_size > 1000


def test_cli_lazy_eval_refusals_write_nothing(tmp_path, capsys, monkeypatch):
    q = _questions(tmp_path / "q.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = tmp_path / "out"
    base = ["lazy-eval", "--questions", str(q), "--out", str(out), "--target", "/nonexistent/model"]
    cases = [(["--frameworks", "jax,mxnet"], "unknown framework"), (["--device", "tpu"], "unknown device"),
             (["--max-new-tokens", "0"], "max-new-tokens"), (["--loop-rounds", "-1"], "loop-rounds")]
    if not torch.cuda.is_available():
        cases.append((["--device", "gpu"], "GPU"))
    for extra, msg in cases:
        assert main(base + extra) == 2
        assert msg in capsys.readouterr().err
    assert main(["lazy-eval", "--questions", str(empty), "--out", str(out)]) == 2
    assert "no questions" in capsys.readouterr().err
    # torch missing: the error names the extra to install
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delitem(sys.modules, "ddd_jax.bench.torch_decoding")
    monkeypatch.delattr(ddd_jax.bench, "torch_decoding", raising=False)
    assert main(base) == 2
    assert "pip install 'ddd-jax[torch]'" in capsys.readouterr().err
    assert not out.exists()


def test_library_run_on_token_prompts(tiny):
    """run_lazy_eval on token-id prompts (no tokenizer), one framework: its rows only, no cross-framework identity."""
    target, draft, _ = tiny
    r = run_lazy_eval(target, draft, PROMPTS[:2], tree=TREE, ddd=DDD, max_new_tokens=MAX_NEW, frameworks="torch",
                      profile_prompts=0, progress=False, sync_rounds=1)
    assert [x["label"] for x in r["rows"]] == [row_label("torch", m, s) for m, s in ROWS["torch"]]
    assert set(r["sync_cost_us"]) == {"torch"} and "torch_vs_jax" not in r["identity"]
    assert all(x["identical_to_vanilla"] for x in r["rows"]) and r["config"]["prompts"] == 2
    assert r["rows"][1]["draft_ms_per_call"] is None  # no profile pass asked for
    assert r["loop_cost"] is None  # JAX-only, on the profile prompts


def test_library_refuses_a_lookup_tree_for_torch_before_running(tiny):
    """The torch counterpart has no context lookup, so a tree with lookup candidates is refused up front (it used to
    fail after the JAX rows had run); JAX alone takes it."""
    import dataclasses
    target, draft, _ = tiny
    tree = dataclasses.replace(TREE, lookup=2)
    with pytest.raises(ValueError, match="lookup=2"):
        run_lazy_eval(target, draft, PROMPTS[:1], tree=tree, ddd=DDD, max_new_tokens=MAX_NEW, frameworks="jax,torch",
                      profile_prompts=0, progress=False, sync_rounds=1, warmup=False)
    # what the CLI runs instead for tuned settings with a lookup (cpu.json's tree), and a tree whose tokens need the
    # lookup's candidates beside what DDD can draft by its max depth
    from ddd_jax.bench.lazy_eval import without_lookup
    from ddd_jax.config import check_tree_for_ddd
    cpu, ddd = TreeConfig(top_k=4, total_tokens=7, depth=2, lookup=4), DDDConfig(check_steps=(0, 1, 3, 5))
    t, why = without_lookup(cpu, ddd)
    assert (t.lookup, t.total_tokens, t.top_k, t.depth) == (0, 7, 4, 2) and "total_tokens=7" in why
    check_tree_for_ddd(t, ddd)
    narrow, shallow = TreeConfig(top_k=1, total_tokens=5, depth=4, lookup=2), DDDConfig(check_steps=(0,), max_depth=2)
    check_tree_for_ddd(narrow, shallow)
    with pytest.raises(ValueError, match="candidate pool"):
        check_tree_for_ddd(dataclasses.replace(narrow, lookup=0), shallow)
    t, why = without_lookup(narrow, shallow)
    assert t.total_tokens == 4 and "total_tokens=4" in why
    assert without_lookup(dataclasses.replace(cpu, total_tokens=3), ddd)[0].total_tokens == 3  # small trees stay


@pytest.mark.slow  # ~6 s
def test_library_run_resumes_after_the_prompts_a_killed_run_finished(tiny, tmp_path, monkeypatch):
    """A checkpoint takes each prompt's runs as it finishes; a killed run's successor keeps them as measured and
    runs only the rest; another configuration is refused by name."""
    import ddd_jax.bench.lazy_eval as le
    target, draft, _ = tiny
    ckpt = tmp_path / le.PARTIAL_NAME
    kw = dict(tree=TREE, ddd=DDD, max_new_tokens=MAX_NEW, frameworks="torch", profile_prompts=0, progress=False,
              sync_rounds=1, warmup=False, checkpoint=ckpt)
    real, seen = le._progress, []

    class Bar:  # counts the runs through the progress hook, and kills the run at the second prompt
        def __init__(self, total):
            self.n = 0

        def update(self, k):
            self.n += k
            seen.append(self.n)
            if kill and self.n > len(ROWS["torch"]):
                raise RuntimeError("killed")

        def close(self):
            pass

    monkeypatch.setattr(le, "_progress", lambda total, enabled, desc: Bar(total))
    kill = True
    with pytest.raises(RuntimeError, match="killed"):
        run_lazy_eval(target, draft, PROMPTS, **kw)
    lines = ckpt.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["prompt"] == 0
    first = json.loads(lines[1])["record"]
    kill, seen[:] = False, []
    r = run_lazy_eval(target, draft, PROMPTS, **kw)
    n_rows = len(ROWS["torch"])
    assert seen[0] == n_rows and seen[-1] == len(PROMPTS) * n_rows  # resumed: prompt 0 counted, not run again
    assert len(seen) == 1 + (len(PROMPTS) - 1) * n_rows
    assert r["records"][0] == first and r["config"]["prompts"] == len(PROMPTS)
    assert all(x["identical_to_vanilla"] for x in r["rows"])
    with pytest.raises(ValueError, match=r"different run \(differs in: max_new_tokens\)"):
        run_lazy_eval(target, draft, PROMPTS, **{**kw, "max_new_tokens": MAX_NEW - 1})


@pytest.mark.deep  # the real SmolLM2 pair in both frameworks over MT-bench turns: make test-deep
def test_smollm2_export_read_as_eagle_reads_it_decodes_as_ddd_jax_over_mtbench(smollm2, smollm2_head, tmp_path):
    """The shipped head exported in the official layout, read by the strict mirror of EAGLE's loader and drafting
    over the whole vocabulary (as EAGLE's code does), against ddd-jax's load of the same export over the whole
    vocabulary: on MT-bench first turns at EAGLE-2's default tree, the same tokens (vanilla's) and the same
    acceptance per cycle."""
    from ddd_jax.measure.prompts import load_questions
    out = ddd_jax.save_official(smollm2_head, tmp_path / "official")
    m = td.load_torch(smollm2, official=out)
    full = td.full_vocabulary(ddd_jax.load_draft(out, smollm2))
    tree = TreeConfig(top_k=10, total_tokens=60, depth=5)
    for q in load_questions(None)[:3]:
        p = smollm2.encode_chat([{"role": "user", "content": q["turns"][0]}])
        got = td.generate(m, p, 32, method="eagle2", tree=tree)
        jx = ddd_jax.generate(smollm2, full, p, max_new_tokens=32, method="eagle2", tree=tree)
        assert got.tokens == jx.tokens == td.generate(m, p, 32).tokens
        assert got.stats["accepted_per_call"] == jx.stats["accepted_per_call"]


@pytest.mark.deep  # the real SmolLM2 pair in both frameworks (~1 min a backend): make test-deep
@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_torch_on_smollm2_with_the_shipped_rules_equals_vanilla_and_takes_jax_depths(smollm2, smollm2_head, backend):
    """The shipped cpu.json and gpu.json rules (the context lookup dropped, as lazy-eval drops it for torch): every
    torch sync mode emits torch vanilla's tokens on two chat prompts, and its depth per call equals JAX's."""
    from ddd_jax.bench.lazy_eval import without_lookup
    from ddd_jax.settings import load_settings, to_configs
    tree, ddd = to_configs(load_settings(backend))
    tree, _ = without_lookup(tree, ddd)
    m = td.load_torch(smollm2, smollm2_head)
    for q in ("Compose an engaging travel blog post about a recent trip to Hawaii.",
              "Explain the difference between a list and a tuple in Python."):
        p = smollm2.encode_chat([{"role": "user", "content": q}])
        van = td.generate(m, p, 48).tokens
        jx = ddd_jax.generate(smollm2, smollm2_head, p, max_new_tokens=48, method="ddd", sync="device", tree=tree,
                              ddd=ddd)
        for sync in td.SYNCS:
            got = td.generate(m, p, 48, method="ddd", sync=sync, tree=tree, ddd=ddd)
            assert got.tokens == van, (backend, sync, q)
            assert got.stats["depth_per_call"] == jx.stats["depth_per_call"], (backend, sync, q)
