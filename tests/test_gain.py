"""The expected-gain DDD rule (`DDDConfig(rule="gain")`, `ddd_jax.gain`) and its calibration data
(`measure.node_acceptance`): node labels by hand, the table's shape, every sync mode lossless and taking the same
decisions, the decode taking exactly the depths and widths the offline replay predicts, and bad input refused."""
from __future__ import annotations

import numpy as np
import pytest

import ddd_jax
from ddd_jax import DDDConfig, TreeConfig
from ddd_jax.config import GainModel, verify_widths
from ddd_jax.measure import node_acceptance as na
from ddd_jax.measure.acceptance import histogram

from spec_helpers import fitted_draft, prompts, tiny_target

K, DEPTH, N, MAX_NEW = 2, 4, 6, 24
COSTS = {"target_ms": {1: 10.0, 2: 10.2, 4: 10.5, 6: 11.0}, "draft_ms": 0.2, "fixed_ms": 0.5}
PROMPTS = prompts(6, seed=5)


def test_label_pool_by_hand():
    # k=2, depth 2: pool[0:2] depth 1, pool[2:6] the children of the step-1 beam (parents 0, 0, 1, 1)
    depth = na.pool_depths(2, 1)
    assert list(depth) == [1, 1, 2, 2, 2, 2]
    tok = np.array([7, 8, 5, 9, 9, 3])
    parent = np.array([-1, -1, 0, 0, 1, 1])
    assert list(na.label_pool(tok, parent, depth, [7, 9])) == [True, False, False, True, False, False]
    assert list(na.label_pool(tok, parent, depth, [8, 9])) == [False, True, False, False, True, False]
    assert list(na.label_pool(tok, parent, depth, [8])) == [False, True, False, False, False, False]  # no 2nd token


@pytest.fixture(scope="module")
def tiny():
    target, draft = tiny_target(), fitted_draft()
    rec = na.pool_records(target, draft, PROMPTS, top_k=K, max_depth=DEPTH, max_new_tokens=MAX_NEW, rows=8)
    return target, draft, rec


@pytest.mark.slow  # pools drafted (~7 s)
def test_records_and_table(tiny):
    _, _, rec = tiny
    C, P = rec["score"].shape
    assert P == K + DEPTH * K * K and C == len(rec["prompt"]) and rec["accepted"].shape == (C, P)
    assert not rec["accepted"][~np.isfinite(rec["score"])].any()  # only drafted nodes are accepted
    # each cycle accepts at most one node per depth, and a node only under an accepted parent
    for d in range(1, DEPTH + 2):
        assert rec["accepted"][:, rec["depth"] == d].sum(1).max() <= 1
    tab = na.acceptance_table(rec)
    acc = np.asarray(tab["accept"])
    assert acc.shape == (DEPTH + 1, len(tab["edges"]) + 1)
    assert (np.diff(acc, axis=1) >= 0).all() and ((0 <= acc) & (acc <= 1)).all()  # monotone in score
    rel = na.reliability(tab, rec)
    assert rel["observed_per_cycle"] == pytest.approx(rec["accepted"].sum() / C)


def _model(tab, rate):
    # a table whose probabilities follow the scores (the tiny head's own table is nearly flat), so that decisions
    # vary from cycle to cycle
    edges = np.asarray(tab["edges"])
    centers = np.r_[edges[0] - 1, (edges[1:] + edges[:-1]) / 2, edges[-1] / 2]
    tab = {**tab, "accept": [list(np.exp(centers))] * len(tab["accept"]), "cont": [0.8] * len(tab["cont"])}
    ws = verify_widths(N)
    gm = GainModel(tab["edges"], tab["accept"], tab["cont"], ws, [COSTS["target_ms"][w] for w in ws],
                   COSTS["draft_ms"], COSTS["fixed_ms"], rate)
    return tab, gm


@pytest.mark.parametrize("rate", [0.0, pytest.param(0.115, marks=pytest.mark.deep)])
@pytest.mark.slow  # three sync modes (~25 s)
def test_gain_rule_is_lossless_in_every_sync_mode_and_decodes_as_replayed(tiny, rate):
    target, draft, rec = tiny
    tab, gm = _model(na.acceptance_table(rec), rate)
    ddd = DDDConfig(check_steps=tuple(range(DEPTH)), threshold=0.0, max_depth=DEPTH, rule="gain", gain=gm)
    tree = TreeConfig(top_k=K, total_tokens=N, depth=2)
    depths, needs = [], []
    for p in PROMPTS:
        van = ddd_jax.generate(target, None, p, max_new_tokens=MAX_NEW).tokens
        seen = {}
        for sync in ("device", "callback", "host"):
            r = ddd_jax.generate(target, draft, p, max_new_tokens=MAX_NEW, method="ddd", sync=sync, tree=tree, ddd=ddd)
            assert r.tokens == van, sync
            seen[sync] = (r.stats["depth_per_call"], r.stats["needed_per_call"])
        assert seen["device"] == seen["callback"] == seen["host"]
        depths += seen["device"][0]
        needs += seen["device"][1]
    replay = na.Replay(rec, tab, COSTS, verify_widths(N)).gain(N, DEPTH, 0.0, rate or None)
    assert histogram(depths) == replay["depth_hist"] and histogram(needs) == replay["need_hist"]
    assert len(set(depths)) >= 2 and len(set(needs)) >= 2  # the rule decided differently across cycles


def test_gain_rule_refuses_bad_input(tiny):
    target, draft, rec = tiny
    _, gm = _model(na.acceptance_table(rec), 0.0)
    with pytest.raises(ValueError, match="needs gain"):
        DDDConfig(check_steps=(0,), max_depth=2, rule="gain")
    with pytest.raises(ValueError, match="rule must be one of"):
        DDDConfig(rule="entropy?")
    with pytest.raises(ValueError, match="stop0_nodes"):
        DDDConfig(check_steps=(0,), max_depth=2, rule="gain", gain=gm, stop0_nodes=0)
    with pytest.raises(ValueError, match="accept must hold"):
        GainModel((-1.0, 0.0), ((0.5,),), (0.5,), (1, 2), (1.0, 1.0), 1.0, 1.0)
    ddd = DDDConfig(check_steps=(0, 1), threshold=0.0, max_depth=DEPTH, rule="gain", gain=gm)
    with pytest.raises(ValueError, match="lookup=0"):
        ddd_jax.generate(target, draft, PROMPTS[0], max_new_tokens=4, method="ddd", ddd=ddd,
                         tree=TreeConfig(top_k=K, total_tokens=N, depth=2, lookup=2))
    with pytest.raises(ValueError, match="calibrate for this tree"):
        ddd_jax.generate(target, draft, PROMPTS[0], max_new_tokens=4, method="ddd", ddd=ddd,
                         tree=TreeConfig(top_k=K, total_tokens=8, depth=2))
    assert DDDConfig.from_dict(ddd.to_dict()) == ddd  # round trip through JSON-able dicts


@pytest.mark.slow  # a calibration (~25 s)
def test_calibration_offers_the_gain_rule_and_generate_uses_it(monkeypatch, tmp_path):
    """`calibrate` builds the gain rule from the batch size's costs and the head's recorded pools (measured on the
    prompts given, stored for the next calibration), predicts it by replay, and generate's defaults decode with it,
    losslessly, when it is predicted best."""
    import dataclasses

    from ddd_jax import calibration as cal
    monkeypatch.setenv("DDD_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv("DDD_JAX_CALIBRATE", raising=False)
    target, draft = tiny_target(), dataclasses.replace(fitted_draft(), name="tiny-head")
    # the static candidate is made to lose (tau 1.0): the choice is between DDD rules
    prof = {"format": cal.PROFILE_FORMAT, "entries": [
        {"label": "eagle2-k2-n3-d1", "method": "eagle2", "tree": {"top_k": 2, "total_tokens": 3, "depth": 1},
         "ddd": None, "tau": 1.0, "mean_depth": 1.0, "need_hist": {3: 1}}]}
    flat = {n: 10.0 + 0.05 * n for n in (1, 2, 3, 4, 5, 8, 16)}
    monkeypatch.setattr(cal, "measure_costs", lambda *a, **k: {"target_ms": flat, "draft_ms": {2: 0.1, 4: 0.1}})
    monkeypatch.setattr(cal, "measure_loop", lambda *a, **k: {"scale": 1.0, "draft_ms": 0.1, "draft_k": 4,
                                                                "fixed_ms": 0.5})
    c = cal.calibrate(target, draft, profile=prof, prompt_ids=PROMPTS)
    assert c["pools_measured_now"] and cal.load_pools(draft)["score"].shape[1] == 4 + 6 * 16
    gains = [p for p in c["predictions"] if p["label"].startswith("ddd-gain-")]
    assert len(gains) == len(cal.GAIN_TREES) and all(p["fixed_ms"] == 0.5 for p in gains)
    assert c["best"]["ddd"][0].startswith("ddd-gain-")
    again = cal.calibrate(target, draft, profile=prof, prompt_ids=PROMPTS)
    assert not again["pools_measured_now"]  # the pools stored beside the profile are read back
    p = PROMPTS[0]
    r = ddd_jax.generate(target, draft, p, max_new_tokens=MAX_NEW, method="ddd")
    assert r.stats["settings"]["source"].startswith("calibrated on ")
    assert r.tokens == ddd_jax.generate(target, None, p, max_new_tokens=MAX_NEW).tokens
    tree, ddd, _ = cal.calibrated_configs(target, draft, "ddd")
    assert ddd.rule == "gain" and ddd.gain.widths == verify_widths(tree.total_tokens) and ddd.gain.rate > 0


def test_calibration_measures_its_shortlist_and_chooses_by_the_measurement(monkeypatch, tmp_path):
    """With prompts to decode, the best-predicted candidates are decoded against vanilla and the choice is made
    among them by that measurement, even where the prediction ranked them otherwise."""
    import dataclasses

    from ddd_jax import calibration as cal
    monkeypatch.setenv("DDD_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv("DDD_JAX_CALIBRATE", raising=False)
    target, draft = tiny_target(), dataclasses.replace(fitted_draft(), name="tiny-head")
    trees = {"eagle2-k2-n3-d1": TreeConfig(top_k=2, total_tokens=3, depth=1),
             "eagle2-k2-n6-d2": TreeConfig(top_k=2, total_tokens=6, depth=2)}
    prof = {"format": cal.PROFILE_FORMAT, "entries": [
        {"label": k, "method": "eagle2", "tree": t.to_dict(), "ddd": None, "tau": tau, "mean_depth": float(t.depth),
         "need_hist": {t.total_tokens: 1}} for (k, t), tau in zip(trees.items(), (2.0, 2.5))]}
    monkeypatch.setattr(cal, "measure_costs", lambda *a, **k: {"target_ms": {n: 10.0 for n in (1, 2, 3, 4, 6)},
                                                               "draft_ms": {2: 0.1}})
    monkeypatch.setattr(cal, "measure_loop", lambda *a, **k: {"scale": 1.0, "draft_ms": 0.1, "draft_k": 2,
                                                              "fixed_ms": 0.0})
    fake = {"vanilla": 10.0, "eagle2-k2-n3-d1": 20.0 / 1.3, "eagle2-k2-n6-d2": 25.0 / 0.9}  # reverses the prediction
    seen = []

    def measured(target, draft, entries, prompt_ids, batch=1, **k):
        seen.append((sorted(e["label"] for e in entries), len(prompt_ids), batch))
        return {k: fake[k] for k in ["vanilla"] + [e["label"] for e in entries]}

    monkeypatch.setattr(cal, "measure_cycles", measured)
    c = cal.calibrate(target, draft, profile=prof, prompt_ids=PROMPTS, gain=False, measure=2)
    assert seen == [(sorted(trees), 2, 1)]  # the two best predicted, on two of the prompts
    preds = {p["label"]: p for p in c["predictions"]}
    assert preds["eagle2-k2-n6-d2"]["predicted_speedup"] > preds["eagle2-k2-n3-d1"]["predicted_speedup"]
    assert c["chosen_by"] == "checked" and c["best"]["eagle2"] == ("eagle2-k2-n3-d1", 1.3)  # tau 2 x 10 / 15.4
    assert c["tree"] == trees["eagle2-k2-n3-d1"].to_dict()
    # the real measurement: vanilla's step and each entry's cycle, decoded
    monkeypatch.undo()
    got = cal.measure_cycles(target, draft, [{"label": "x", "method": "eagle2", "tree": trees["eagle2-k2-n6-d2"]
                                             .to_dict(), "ddd": None}], PROMPTS[:2], batch=2, rounds=1,
                             max_new_tokens=8)
    # (times only: which is larger depends on the machine's load, so no order is asserted)
    assert set(got) == {"vanilla", "x"} and all(0 < v < float("inf") for v in got.values())


@pytest.mark.deep  # each draw is a new plan (a compile): make test-deep
def test_gain_rule_is_lossless_for_drawn_models_batches_and_sync_modes(tiny):
    """Hypothesis: drawn costs, rates, margins, trees and batches; every sync mode decodes vanilla's tokens and
    takes the same depths."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    target, draft, rec = tiny
    base = na.acceptance_table(rec)

    @settings(max_examples=6, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(n=st.sampled_from([3, 5, 6]), per_row=st.floats(0.0, 2.0), draft_ms=st.floats(0.05, 3.0),
           rate=st.sampled_from([0.0, 0.05, 0.2]), margin=st.sampled_from([-1.0, 0.0, 0.5]),
           batch=st.integers(1, 3), sharp=st.booleans())
    def prop(n, per_row, draft_ms, rate, margin, batch, sharp):
        tab = _model(base, 0.0)[0] if sharp else base  # the score-following table, or the head's own
        ws = verify_widths(n)
        gm = GainModel(tab["edges"], tab["accept"], tab["cont"], ws, [10.0 + per_row * (w - 1) for w in ws],
                       draft_ms, 0.5, rate)
        ddd = DDDConfig(check_steps=tuple(range(DEPTH)), threshold=margin, max_depth=DEPTH, rule="gain", gain=gm)
        tree = TreeConfig(top_k=K, total_tokens=n, depth=1)
        ps = PROMPTS[:batch]
        van = ddd_jax.generate(target, None, ps, max_new_tokens=12).tokens
        seen = []
        for sync in ("device", "callback", "host"):
            r = ddd_jax.generate(target, draft, ps, max_new_tokens=12, method="ddd", sync=sync, tree=tree, ddd=ddd)
            assert r.tokens == van, (sync, gm, margin)
            seen.append([s["depth_per_call"] for s in r.stats["per_sequence"]])
        assert seen[0] == seen[1] == seen[2]

    prop()


def test_a_checked_shortlist_that_loses_to_vanilla_saves_the_cheapest_trees(monkeypatch, tmp_path):
    import dataclasses

    from ddd_jax import calibration as cal
    monkeypatch.setenv("DDD_JAX_CACHE", str(tmp_path))
    target, draft = tiny_target(), dataclasses.replace(fitted_draft(), name="tiny-head")
    trees = {"eagle2-k2-n3-d1": TreeConfig(top_k=2, total_tokens=3, depth=1),
             "eagle2-k2-n6-d2": TreeConfig(top_k=2, total_tokens=6, depth=2)}
    prof = {"format": cal.PROFILE_FORMAT, "entries": [
        {"label": k, "method": "eagle2", "tree": t.to_dict(), "ddd": None, "tau": 1.2, "mean_depth": float(t.depth),
         "need_hist": {t.total_tokens: 1}} for k, t in trees.items()]}
    monkeypatch.setattr(cal, "measure_costs", lambda *a, **k: {"target_ms": {n: 10.0 * n for n in (1, 2, 3, 4, 6)},
                                                               "draft_ms": {2: 0.1}})
    monkeypatch.setattr(cal, "measure_loop", lambda *a, **k: {"scale": 1.0, "draft_ms": 0.1, "draft_k": 2,
                                                              "fixed_ms": 0.0})
    monkeypatch.setattr(cal, "measure_cycles", lambda t, d, entries, *a, **k: {
        "vanilla": 10.0, **{e["label"]: 40.0 for e in entries}})
    c = cal.calibrate(target, draft, profile=prof, prompt_ids=PROMPTS, gain=False, measure=1)
    assert c["recommended_method"] == "vanilla" and c["tree"] == trees["eagle2-k2-n3-d1"].to_dict()
