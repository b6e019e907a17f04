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


def test_the_public_function():
    import ddd_jax
    assert ddd_jax.calibrate is cal.calibrate and "calibrate" in ddd_jax.__all__


def test_predict_is_tau_times_t1_over_the_cycle():
    prof = {"entries": [{"label": "a", "method": "eagle2", "tree": {"top_k": 4, "total_tokens": 8, "depth": 1},
                         "ddd": None, "tau": 2.0, "mean_depth": 1.0}]}
    costs = {"target_ms": {1: 10.0, 4: 14.0, 8: 20.0}, "draft_ms": {1: 1.0, 4: 2.0, 8: 3.0}}
    (p,) = cal.predict(prof, costs)
    assert p["cycle_ms"] == pytest.approx(20.0 + 2.0 * 2)  # t(8) + d(4) x (step 0 + one beam step)
    assert p["predicted_speedup"] == pytest.approx(2.0 * 10.0 / 24.0)
    costs["target_ms"] = {1: 10.0, 16: 30.0}  # interpolated between the measured sizes
    assert cal.predict(prof, costs)[0]["cycle_ms"] == pytest.approx(10.0 + 20.0 * 7 / 15 + 4.0)


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


def test_when_nothing_beats_vanilla_the_cheapest_trees_are_saved(calibrating, monkeypatch):
    target, draft = calibrating
    prof = {"format": cal.PROFILE_FORMAT, "entries": [
        {"label": label, "method": m, "tree": t.to_dict(), "ddd": dataclasses.asdict(d) if m == "ddd" else None,
         "tau": 1.2, "mean_depth": float(t.depth)} for label, m, t, d in SMALL]}
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


def test_bigger_batches_pick_smaller_trees_and_generate_follows_its_batch(calibrating, monkeypatch):
    target, draft = calibrating
    prof = {"format": cal.PROFILE_FORMAT, "entries": [
        {"label": label, "method": m, "tree": t.to_dict(), "ddd": dataclasses.asdict(d) if m == "ddd" else None,
         "tau": tau, "mean_depth": float(t.depth)} for (label, m, t, d), tau in zip(SMALL, (1.5, 2.4, 2.4))]}

    def costs(target, draft, sizes, beams, repeat=3, progress=False, batch=1):
        # one row costs 10 ms; each extra row verified adds 0.5 ms at batch 1, 4 ms at batch 8 (compute-bound)
        per = 0.5 if batch == 1 else 4.0
        return {"target_ms": {n: 10.0 + per * (n - 1) for n in (1, 3, 7)}, "draft_ms": {1: 0.1, 2: 0.1, 4: 0.1}}

    monkeypatch.setattr(cal, "measure_costs", costs)
    c = cal.calibrate(target, draft, profile=prof, batch_sizes=(1, 8))
    assert c["by_batch"]["1"]["tree"]["total_tokens"] == 7 and c["by_batch"]["8"]["tree"]["total_tokens"] == 3
    assert c["tree"] == c["by_batch"]["1"]["tree"]
    assert cal.calibrated_configs(target, draft, "eagle2", batch=1)[0].total_tokens == 7
    assert cal.calibrated_configs(target, draft, "eagle2", batch=16)[0].total_tokens == 3  # largest size <= 16
    r = generate(target, draft, prompts(8, seed=2), max_new_tokens=6, method="eagle2")
    assert r.stats["settings"]["tree"]["total_tokens"] == 3 and ", batch 8," in r.stats["settings"]["source"]
