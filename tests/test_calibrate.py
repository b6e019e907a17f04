"""`ddd_jax.calibrate`: the prediction's arithmetic, a calibration saved and used by generate, the never-slower
fallback, the switch that turns calibrations off, and `ddd-jax calibrate` on bad input."""
from __future__ import annotations

import dataclasses
import json

import pytest

from ddd_jax import DDDConfig, TreeConfig, generate
from ddd_jax import calibration as cal
from spec_helpers import fitted_draft, prompts, tiny_target

SMALL = (("eagle2-k2-n3-d1", "eagle2", TreeConfig(top_k=2, total_tokens=3, depth=1), DDDConfig()),
         ("eagle2-k4-n7-d2", "eagle2", TreeConfig(top_k=4, total_tokens=7, depth=2), DDDConfig()),
         ("ddd-k4-n7-s13", "ddd", TreeConfig(top_k=4, total_tokens=7, depth=2),
          DDDConfig(check_steps=(1, 3), threshold=-1.0, max_depth=4)))


@pytest.fixture
def calibrating(monkeypatch, tmp_path):
    monkeypatch.setenv("DDD_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv("DDD_JAX_CALIBRATE", raising=False)
    return tiny_target(), dataclasses.replace(fitted_draft(), name="tiny-head")


@pytest.fixture
def no_fixed_cost(monkeypatch):
    """Tests that price cycles by hand: no per-cycle fixed cost measured by a real decode."""
    def loop(target, draft, costs, **_):  # the curve's costs as they are
        return {"scale": 1.0, "draft_ms": cal._interp(costs["draft_ms"])(1), "draft_k": 1, "fixed_ms": 0.0}
    monkeypatch.setattr(cal, "measure_loop", loop)


def test_the_public_function():
    import ddd_jax
    assert ddd_jax.calibrate is cal.calibrate and "calibrate" in ddd_jax.__all__


@pytest.mark.slow  # two calibrations (~13 s)
def test_a_head_in_another_dtype_has_its_own_calibration(monkeypatch, tmp_path):
    """A float16 or bfloat16 copy of a head (or a q8_0 one) drafts at another cost: its calibration is kept apart
    from the float32 head's, whose key is unchanged (no dtype in it)."""
    from ddd_jax.settings.calibration import calibration_path
    monkeypatch.setenv("DDD_JAX_CACHE", str(tmp_path))
    target = tiny_target()
    head = dataclasses.replace(fitted_draft(), name="tiny-head")
    paths = {d: calibration_path(target, head if d == "float32" else head.astype(d)) for d in
             ("float32", "float16", "bfloat16")}
    assert len(set(paths.values())) == 3
    assert "float" not in paths["float32"].name.split("tiny-head")[1] and "bfloat16" in paths["bfloat16"].name
    assert calibration_path(target, dataclasses.replace(fitted_draft(), name="tiny-head")) == paths["float32"]


def test_predict_is_tau_times_t1_over_the_cycle():
    prof = {"entries": [{"label": "a", "method": "eagle2", "tree": {"top_k": 4, "total_tokens": 8, "depth": 1},
                         "ddd": None, "tau": 2.0, "mean_depth": 1.0, "need_hist": {8: 3}}]}
    costs = {"target_ms": {1: 10.0, 4: 14.0, 8: 20.0}, "draft_ms": {1: 1.0, 4: 2.0, 8: 3.0}}
    (p,) = cal.predict(prof, costs)
    assert p["cycle_ms"] == pytest.approx(20.0 + 2.0 * 2)  # t(8) + d(4) x (step 0 + one beam step)
    assert p["predicted_speedup"] == pytest.approx(2.0 * 10.0 / 24.0)
    costs["target_ms"] = {1: 10.0, 16: 30.0}  # interpolated between the measured sizes
    assert cal.predict(prof, costs)[0]["cycle_ms"] == pytest.approx(10.0 + 20.0 * 7 / 15 + 4.0)
    del prof["entries"][0]["need_hist"]  # a profile from before need histograms is refused, not misread
    with pytest.raises(ValueError, match="need_hist"):
        cal.predict(prof, costs)


def test_width_probabilities_and_the_deepest_draft_of_a_batch():
    """A batch verifies the narrowest compiled width holding its widest tree: P(W_i) = F(W_i)^b - F(W_i-1)^b."""
    need = {1: 2, 3: 1, 7: 1}  # F(1) = 1/2, F(2) = 1/2, F(4) = 3/4, F(7) = 1
    assert cal.width_probs(need, (1, 2, 4, 7), 1) == pytest.approx({1: 0.5, 2: 0.0, 4: 0.25, 7: 0.25})
    assert cal.width_probs(need, (1, 2, 4, 7), 2) == pytest.approx({1: 0.25, 2: 0.0, 4: 0.5625 - 0.25,
                                                                   7: 1 - 0.5625})
    assert cal.expected_max({0: 1, 2: 1}, 1) == pytest.approx(1.0)
    assert cal.expected_max({0: 1, 2: 1}, 2) == pytest.approx(1.5)  # both stop at 0 a quarter of the time


# a hand-made profile: EAGLE-2 always verifies its 8 rows; DDD's step-0 check stops half the cycles (the root alone)
PROFILE = {"format": cal.PROFILE_FORMAT, "version": cal.PROFILE_VERSION, "entries": [
    {"label": "eagle2-k4-n8-d2", "method": "eagle2", "tree": {"top_k": 4, "total_tokens": 8, "depth": 2}, "ddd": None,
     "tau": 2.0, "mean_depth": 2.0, "depth_hist": {2: 10}, "need_hist": {8: 10}},
    {"label": "ddd-k4-n8-s01", "method": "ddd", "tree": {"top_k": 4, "total_tokens": 8, "depth": 2},
     "ddd": {"check_steps": [0, 1], "threshold": -1.0, "max_depth": 3}, "tau": 1.8, "mean_depth": 1.0,
     "depth_hist": {0: 5, 2: 5}, "need_hist": {1: 5, 8: 5}}]}
# batch 1: a row costs little past the first (memory-bound); batch 16: every row costs its FMAs; batch 4 between
COSTS = {1: {"target_ms": {1: 10.0, 2: 10.5, 4: 11.0, 8: 14.0}, "draft_ms": {1: 1.0, 2: 1.0, 4: 1.0}},
         4: {"target_ms": {1: 10.0, 2: 12.0, 4: 14.0, 8: 16.0}, "draft_ms": {1: 1.0, 2: 1.0, 4: 1.0}},
         16: {"target_ms": {1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0}, "draft_ms": {1: 4.0, 2: 4.0, 4: 4.0}}}


def test_prediction_picks_ddd_at_batch_1_and_vanilla_at_batch_16():
    e2, ddd = cal.predict(PROFILE, COSTS[1], batch=1)
    assert e2["cycle_ms"] == pytest.approx(14.0 + 1.0 * 3)  # t(8) + d(4) x (step 0 + 2 steps)
    assert e2["predicted_speedup"] == pytest.approx(2.0 * 10.0 / 17.0)
    assert ddd["width_probs"] == {1: 0.5, 2: 0.0, 4: 0.0, 8: 0.5}
    assert ddd["cycle_ms"] == pytest.approx(0.5 * 10.0 + 0.5 * 14.0 + 1.0 * (1 + 1.0))  # 14
    assert ddd["predicted_speedup"] == pytest.approx(1.8 * 10.0 / 14.0)  # 1.286
    p1 = cal.pick([e2, ddd])
    assert p1["recommended_method"] == "ddd" and p1["best_overall"] == ("ddd-k4-n8-s01", 1.286)
    assert p1["ddd"]["check_steps"] == [0, 1] and p1["tree"] == PROFILE["entries"][0]["tree"]
    e2, ddd = cal.predict(PROFILE, COSTS[4], batch=4)  # EAGLE-2 still wins; DDD's best does not beat vanilla
    assert e2["predicted_speedup"] == pytest.approx(20.0 / 19.0)
    assert ddd["width_probs"][1] == pytest.approx(1 / 16) and ddd["draft_steps"] == pytest.approx(1 + 2 * 15 / 16)
    assert ddd["predicted_speedup"] == pytest.approx(18.0 / (10.0 / 16 + 16.0 * 15 / 16 + 2.875))  # 0.973
    p4 = cal.pick([e2, ddd])
    assert p4["recommended_method"] == "eagle2" and p4["predicted_best"]["ddd"] == ("ddd-k4-n8-s01", 0.973)
    e2, ddd = cal.predict(PROFILE, COSTS[16], batch=16)
    q = 0.5 ** 16  # all 16 sequences stop at step 0: the only cycles that verify one row
    assert ddd["width_probs"][1] == pytest.approx(q, abs=1e-6)
    assert ddd["cycle_ms"] == pytest.approx(q * 10.0 + (1 - q) * 80.0 + 4.0 * (1 + 2 * (1 - q)))
    assert ddd["predicted_speedup"] == pytest.approx(18.0 / (92.0 - 78.0 * q))  # 0.196
    assert e2["predicted_speedup"] == pytest.approx(20.0 / 92.0)
    p16 = cal.pick([e2, ddd])
    assert p16["recommended_method"] == "vanilla" and p16["vanilla_predicted_faster"]
    assert p16["best_overall"] == ("eagle2-k4-n8-d2", 0.217)


@pytest.mark.slow  # a calibration (~15 s)
def test_generate_decodes_as_vanilla_where_the_calibration_says_so(calibrating, monkeypatch, no_fixed_cost):
    """A calibration that says vanilla at batch >= 8: generate's defaults decode a batch of 8 as vanilla does (and
    say why), a single prompt speculatively; at batch 4 only EAGLE-2 is predicted to beat vanilla, so DDD's defaults
    decode as vanilla there; an explicit tree always decodes speculatively."""
    target, draft = calibrating
    monkeypatch.setattr(cal, "measure_costs", lambda *a, batch=1, **k: COSTS[batch if batch < 8 else 16])
    c = cal.calibrate(target, draft, profile=PROFILE, batch_sizes=(1, 4, 8))
    assert [c["by_batch"][b]["recommended_method"] for b in ("1", "4", "8")] == ["ddd", "eagle2", "vanilla"]
    ps = prompts(8, seed=3)
    ref = generate(target, None, ps, max_new_tokens=10)
    for method in ("ddd", "eagle2"):
        r = generate(target, draft, ps, max_new_tokens=10, method=method)
        st = r.stats["settings"]
        assert r.tokens == ref.tokens and st["decoded_as"] == "vanilla"
        assert st["why"].startswith("no speculative setting is predicted to beat vanilla at batch 8 on ")
        assert "(best: eagle2-k4-n8-d2 0.22x)" in st["why"] and st["source"].startswith("calibrated on ")
        assert all(s["method"] == method and set(s["verified_per_call"]) <= {1} for s in r.stats["per_sequence"])
        assert all(s["target_calls"] == len(t) - 1 for s, t in zip(r.stats["per_sequence"], r.tokens))
    r = generate(target, draft, ps[:2] * 8, max_new_tokens=10, method="eagle2")  # batch 16: past every size
    assert r.tokens == ref.tokens[:2] * 8 and r.stats["settings"]["decoded_as"] == "vanilla"
    assert r.stats["settings"]["why"].startswith("batch 16 is larger than every batch size calibrated on ")
    assert "(1, 4, 8)" in r.stats["settings"]["why"] and "--batch-sizes 1,4,8,16" in r.stats["settings"]["why"]
    r = generate(target, draft, ps[:2], max_new_tokens=10, method="eagle2")  # batch 2: batch 4's choice
    assert r.stats["settings"]["decoded_as"] == "eagle2" and ", batch 4," in r.stats["settings"]["source"]
    # batch 4: EAGLE-2's best beats vanilla, DDD's does not -- DDD's defaults decode as vanilla, EAGLE-2's do not
    r = generate(target, draft, ps[:4], max_new_tokens=10, method="ddd")
    assert r.tokens == ref.tokens[:4] and r.stats["settings"]["decoded_as"] == "vanilla"
    assert r.stats["settings"]["why"].startswith("no DDD setting is predicted to beat vanilla at batch 4 on ")
    assert "(best: ddd-k4-n8-s01 0.97x; EAGLE-2's eagle2-k4-n8-d2 1.05x)" in r.stats["settings"]["why"]
    r = generate(target, draft, ps[:4], max_new_tokens=10, method="eagle2")
    assert r.tokens == ref.tokens[:4] and r.stats["settings"]["decoded_as"] == "eagle2"
    one = generate(target, draft, ps[0], max_new_tokens=10, method="ddd")
    assert one.tokens == ref.tokens[0] and one.stats["settings"]["decoded_as"] == "ddd"
    assert "why" not in one.stats["settings"] and one.stats["settings"]["ddd"]["check_steps"] == (0, 1)
    ex = generate(target, draft, ps, max_new_tokens=10, method="eagle2", tree=TreeConfig(top_k=2, total_tokens=3,
                                                                                       depth=1))
    assert ex.tokens == ref.tokens and ex.stats["settings"]["decoded_as"] == "eagle2"
    assert max(r for s in ex.stats["per_sequence"] for r in s["verified_per_call"]) == 3


@pytest.mark.slow  # ~25 s of compiles; `make test` runs it
def test_calibration_is_saved_keyed_and_used_by_generate(calibrating):
    target, draft = calibrating
    ps = prompts(4, seed=11)
    prof = cal.acceptance_profile(target, draft, ps, candidates=SMALL, max_new_tokens=16, batch_size=4)
    assert [e["label"] for e in prof["entries"]] == [c[0] for c in SMALL]
    assert all(e["identical"] == 4 and e["tau"] >= 1.0 for e in prof["entries"])
    c = cal.calibrate(target, draft, profile=prof, repeat=1)
    saved = json.loads(open(c["path"]).read())
    assert saved["key"] == {**cal.device_key(target), "draft": "tiny-head"} and saved["key"]["backend"] == "cpu"
    assert {p["label"] for p in saved["predictions"]} == {c[0] for c in SMALL}
    assert set(saved["costs"]["target_ms"]) >= {"1", "3", "7"}
    p = ps[0]
    ref = generate(target, None, p, max_new_tokens=12).tokens
    for method in ("eagle2", "ddd"):
        r = generate(target, draft, p, max_new_tokens=12, method=method)
        assert r.tokens == ref and r.stats["settings"]["source"].startswith("calibrated on ")
        want = saved["ddd_tree"] if method == "ddd" else saved["tree"]
        assert r.stats["settings"]["tree"] == want
    # an explicit tree still wins; DDD_JAX_CALIBRATE=0 turns the calibration off
    r = generate(target, draft, p, max_new_tokens=12, method="eagle2", tree=TreeConfig(top_k=2, total_tokens=3,
                                                                                       depth=1))
    assert not r.stats["settings"]["source"].startswith("calibrated")
    import os
    os.environ["DDD_JAX_CALIBRATE"] = "0"
    try:
        assert cal.calibrated_configs(target, draft) is None
    finally:
        del os.environ["DDD_JAX_CALIBRATE"]


def test_when_nothing_beats_vanilla_the_cheapest_trees_are_saved(calibrating, monkeypatch, no_fixed_cost):
    target, draft = calibrating
    prof = {"format": cal.PROFILE_FORMAT, "entries": [
        {"label": label, "method": m, "tree": t.to_dict(), "ddd": dataclasses.asdict(d) if m == "ddd" else None,
         "tau": 1.2, "mean_depth": float(t.depth), "need_hist": {t.total_tokens: 1}} for label, m, t, d in SMALL]}
    monkeypatch.setattr(cal, "measure_costs", lambda *a, **k: {"target_ms": {1: 10.0, 3: 30.0, 7: 70.0},
                                                               "draft_ms": {1: 1.0, 2: 1.0, 4: 1.0}})
    c = cal.calibrate(target, draft, profile=prof)
    assert c["vanilla_predicted_faster"] and c["recommended_method"] == "vanilla"
    assert c["tree"] == {"top_k": 2, "total_tokens": 3, "depth": 1}  # the cheapest EAGLE-2 cycle
    tree, ddd, source = cal.calibrated_configs(target, draft, "ddd")
    assert ddd.check_steps == (1, 3) and "vanilla is predicted to be as fast" in source


def test_cli_refuses_bad_input(capsys):
    from ddd_jax.cli import main
    assert main(["calibrate", "--repeat", "0"]) == 2
    assert "--repeat must be >= 1" in capsys.readouterr().err


def test_bigger_batches_pick_smaller_trees_and_generate_follows_its_batch(calibrating, monkeypatch, no_fixed_cost):
    target, draft = calibrating
    prof = {"format": cal.PROFILE_FORMAT, "entries": [
        {"label": label, "method": m, "tree": t.to_dict(), "ddd": dataclasses.asdict(d) if m == "ddd" else None,
         "tau": tau, "mean_depth": float(t.depth), "need_hist": {t.total_tokens: 1}}
        for (label, m, t, d), tau in zip(SMALL, (1.5, 2.4, 2.4))]}

    def costs(target, draft, sizes, beams, repeat=3, progress=False, batch=1):
        # one row costs 10 ms; each extra row verified adds 0.5 ms at batch 1, 4 ms at batch 8 (compute-bound)
        per = 0.5 if batch == 1 else 4.0
        return {"target_ms": {n: 10.0 + per * (n - 1) for n in (1, 3, 7)}, "draft_ms": {1: 0.1, 2: 0.1, 4: 0.1}}

    monkeypatch.setattr(cal, "measure_costs", costs)
    c = cal.calibrate(target, draft, profile=prof, batch_sizes=(1, 8))
    assert c["by_batch"]["1"]["tree"]["total_tokens"] == 7 and c["by_batch"]["8"]["tree"]["total_tokens"] == 3
    assert c["tree"] == c["by_batch"]["1"]["tree"]
    assert cal.calibrated_configs(target, draft, "eagle2", batch=1)[0].total_tokens == 7
    assert cal.calibrated_configs(target, draft, "eagle2", batch=2)[0].total_tokens == 3  # smallest size >= 2
    r = generate(target, draft, prompts(8, seed=2), max_new_tokens=6, method="eagle2")
    assert r.stats["settings"]["tree"]["total_tokens"] == 3 and ", batch 8," in r.stats["settings"]["source"]
