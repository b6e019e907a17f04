"""A learned acceptance output (`measure.learned_acceptance`) and what it reads: pools recorded with what drafted each
node (the head's feature at its parent reproduces the node's log-prob), path probabilities and AUC by brute force,
a fit that finds a signal only the hidden state carries, and the replay and gain arithmetic taking given
probabilities (perfect ones keep exactly the accepted path)."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddd_jax import gain
from ddd_jax.config import verify_widths
from ddd_jax.eagle import draft_logits
from ddd_jax.measure import learned_acceptance as la
from ddd_jax.measure import node_acceptance as na

from spec_helpers import fitted_draft, prompts, tiny_target

K, DEPTH, MAX_NEW = 2, 3, 16
COSTS = {"target_ms": {1: 10.0, 2: 10.2, 4: 10.5, 6: 11.0}, "draft_ms": 0.2, "fixed_ms": 0.5}


@pytest.fixture(scope="module")
def recs():
    target, draft = tiny_target(), fitted_draft()
    kw = dict(top_k=K, max_depth=DEPTH, max_new_tokens=MAX_NEW, rows=8)
    ps = prompts(64, seed=100, lo=2, hi=8)[:4]  # prompts the head was fitted on (`fit_draft`): long accepted paths
    return target, draft, na.pool_records(target, draft, ps, **kw), na.pool_records(target, draft, ps, hidden=True,
                                                                                    **kw)


@pytest.mark.slow  # pools drafted twice (~8 s)
def test_hidden_records_say_what_drafted_each_node(recs):
    target, draft, plain, rec = recs
    np.testing.assert_array_equal(rec["score"], plain["score"])  # the same steps
    np.testing.assert_array_equal(rec["accepted"], plain["accepted"])
    C, P = rec["score"].shape
    X = 1 + DEPTH * K
    assert rec["h"].shape == (C, X, draft.config.hidden_size) and rec["ent"].shape == (C, X)
    assert rec["parent"].shape == (C, P) and list(rec["expanded"]) == list(na.expanded_of(K, DEPTH))
    depth = rec["depth"]
    par = rec["parent"]
    assert (par[:, depth == 1] == -1).all()
    assert (depth[np.maximum(par[:, depth > 1], 0)] == depth[depth > 1] - 1).all()
    # the node's own log-prob is its parent's distribution (from the recorded feature) at its token
    logp = np.asarray(draft_logits(draft.decode_params(), target.params, target.config,
                                   jnp.asarray(rec["h"], jnp.float32), draft.config))  # [C, X, V]
    pscore = np.where(par >= 0, np.take_along_axis(rec["score"], np.maximum(par, 0), axis=1), 0.0)
    own = np.take_along_axis(logp[:, rec["expanded"]], rec["tok"][..., None], axis=2)[..., 0]
    np.testing.assert_allclose(own, rec["score"] - pscore, atol=0.03)
    ent = -np.sum(np.exp(logp) * logp, axis=-1)
    np.testing.assert_allclose(rec["ent"], ent, atol=0.03)


def test_path_probs_and_auc_by_brute_force():
    rng = np.random.default_rng(0)
    parent = np.array([[-1, -1, 0, 0, 1, 1, 3, 3]] * 3)
    q = rng.uniform(size=parent.shape).astype(np.float32)
    p = la.path_probs(q, parent)
    for c, i in itertools.product(range(3), range(8)):
        want, j = 1.0, i
        while j >= 0:
            want, j = want * q[c, j], parent[c, j]
        assert p[c, i] == pytest.approx(want, rel=1e-6)
    s = rng.normal(size=200)
    y = rng.uniform(size=200) < 1 / (1 + np.exp(-2 * s))
    s[:20] = s[20:40]  # ties count half
    pairs = [(a, b) for a in s[y] for b in s[~y]]
    brute = np.mean([1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs])
    assert la.auc(s, y) == pytest.approx(brute, abs=1e-12)


def _synthetic(C=600, k=2, R=2, D=8, seed=0):
    """Records whose conditional acceptance depends on the parent's feature only (scores carry no signal)."""
    rng = np.random.default_rng(seed)
    depth = na.pool_depths(k, R)
    P, X = len(depth), 1 + R * k
    expanded = na.expanded_of(k, R)
    h = rng.normal(size=(C, X, D)).astype(np.float16)
    parent = np.full((C, P), -1, np.int32)
    for s in range(R):
        for i in range(k):
            sl = slice(k + s * k * k + i * k, k + s * k * k + (i + 1) * k)
            parent[:, sl] = (0 if s == 0 else k + (s - 1) * k * k) + i  # the beam: the first k of the level
    score = np.cumsum(np.log(rng.uniform(0.05, 1.0, size=(C, P))), axis=1).astype(np.float32)
    q_true = 1 / (1 + np.exp(-3.0 * h[:, expanded, 0].astype(np.float32)))
    acc = np.zeros((C, P), bool)
    for i in range(P):
        ok = parent[:, i] < 0
        ok = np.where(ok, True, acc[np.arange(C), np.maximum(parent[:, i], 0)])
        acc[:, i] = ok & (rng.uniform(size=C) < q_true[:, i])
    return {"score": score, "accepted": acc, "parent": parent, "h": h, "ent": rng.uniform(size=(C, X)),
            "expanded": expanded, "depth": depth, "top_k": k, "max_depth": R, "prompt": np.arange(C) // 10,
            "prompts": C // 10}


def test_fit_finds_what_only_the_hidden_state_carries():
    train, test = _synthetic(seed=0), _synthetic(seed=1)
    got = {}
    for kind in la.KINDS:
        model, info = la.fit(train, kind, steps=400, lr=1e-2)
        assert info["train_nodes"] > 0 and info["val_nodes"] > 0 and np.isfinite(info["val_loss"])
        q = la.conditional_probs(model, test)
        got[kind] = la.judge(la.path_probs(q, test["parent"]), test, q)
    assert got["dist"]["cond_auc"] < 0.6 < 0.8 < got["hidden"]["cond_auc"]
    assert got["hidden"]["brier"] < got["dist"]["brier"]
    with pytest.raises(ValueError, match="hidden=True"):
        la.fit({k: v for k, v in train.items() if k != "h"}, "hidden")
    with pytest.raises(ValueError, match="kind"):
        la.fit(train, "oracle")


def test_ranked_reads_given_probabilities():
    gm = na.Replay({"score": np.zeros((1, 6), np.float32), "accepted": np.zeros((1, 6), bool),
                    "depth": na.pool_depths(2, 1), "top_k": 2, "max_depth": 1},
                   {"edges": [0.0], "accept": [[0.1, 0.2], [0.1, 0.2]], "cont": [0.5, 0.0]}, COSTS,
                   verify_widths(6)).model()
    score = jnp.asarray([[-1.0, -2.0, -1.5, -3.0, -2.5, -np.inf]])
    p = jnp.asarray([[0.5, 0.9, 0.4, 0.1, 0.8, 0.7]])
    order, cum, drafted = gain.ranked(gm, score, 2, 1, p)
    assert list(np.asarray(order[0, :5])) == [1, 4, 0, 2, 3] and int(drafted[0]) == 5
    np.testing.assert_allclose(np.asarray(cum[0]), np.r_[0, np.cumsum([0.9, 0.8, 0.5, 0.4, 0.1]), 2.7], atol=1e-6)


@pytest.mark.slow  # ~3 s beside the pools
def test_replay_with_perfect_probabilities_keeps_the_accepted_path(recs):
    _, _, _, rec = recs
    tab = na.acceptance_table(rec)
    perfect = rec["accepted"].astype(np.float32) * 0.98 + 0.01
    n = 1 + K + DEPTH * K * K
    learned = na.Replay(rec, tab, COSTS, verify_widths(n), probs=perfect)
    table = na.Replay(rec, tab, COSTS, verify_widths(n))
    small = 2 + DEPTH  # room for the longest accepted path (DEPTH + 1 nodes) only, if it is ranked first
    acc = rec["accepted"].sum(1)  # each cycle's accepted path, walked as a decode walks the cycles
    want = float(np.mean(1 + acc[learned.cycles(acc)]))
    assert acc.max() >= 2 and learned.static(small, DEPTH)["tau"] == pytest.approx(want)
    assert table.static(small, DEPTH)["tau"] <= learned.static(small, DEPTH)["tau"]
    # SpecDec++'s rule: a sure beam never stops, a hopeless one stops at once
    assert learned.specdec(n, DEPTH, 0.999)["mean_depth"] > 0
    sure = na.Replay(rec, tab, COSTS, verify_widths(n), probs=np.ones_like(perfect))
    assert sure.specdec(n, DEPTH, 0.5)["mean_depth"] == DEPTH
    never = na.Replay(rec, tab, COSTS, verify_widths(n), probs=np.zeros_like(perfect))
    assert never.specdec(n, DEPTH, 0.5)["mean_depth"] == 0
    with pytest.raises(ValueError, match="probs"):
        table.specdec(n, DEPTH, 0.5)
    # the gain rule reads them too: with perfect probabilities it drafts and keeps each cycle's accepted path
    assert learned.gain(n, DEPTH)["tau"] == pytest.approx(want)
    jax.clear_caches()
