"""AdaEDL's entropy stop as a DDD rule (`DDDConfig(rule="adaedl")`, `ddd_jax.adaedl`): the entropies the beam keeps
and the bound, by hand; every sync mode lossless and taking the same depths, which vary from cycle to cycle; bad
input refused."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddd_jax
from ddd_jax import DDDConfig, TreeConfig, adaedl
from ddd_jax.decode import make_plan
from ddd_jax.tree import draft_entropy, expand, first_beam

from spec_helpers import fitted_draft, prompts, tiny_target

LN2 = math.log(2.0)
NEG = -np.inf
first_beam_jit = jax.jit(first_beam, static_argnums=(2, 3), static_argnames=("entropy",))
expand_jit = jax.jit(expand, static_argnums=(3, 4))


def _log(p):
    with np.errstate(divide="ignore"):  # log 0 = -inf: a token the distribution never draws
        return np.log(p)


def test_entropy_and_bound_exact():
    # rows: uniform over 4 (ln 4), {1/2, 1/4, 1/4} with a -inf entry (1.5 ln 2), a point mass (0)
    logp = _log(np.array([[0.25, 0.25, 0.25, 0.25], [0.5, 0.25, 0.25, 0.0], [1.0, 0.0, 0.0, 0.0]], np.float32))
    got = np.asarray(draft_entropy(jnp.asarray(logp)))
    np.testing.assert_allclose(got, [2 * LN2, 1.5 * LN2, 0.0], rtol=1e-6, atol=0)
    # 1 - sqrt(gamma * H): gamma * H = 1, 1/4, 0, and a rounding error below zero counts as 0
    np.testing.assert_array_equal(np.asarray(adaedl.lower_bound(jnp.asarray([2.0, 0.5, 0.0, -1e-9]), 0.5)),
                                  np.asarray([0.0, 0.5, 1.0, 1.0], np.float32))


def test_beam_keeps_the_parents_entropy_exact():
    # k=2, V=4. Step 0: the root's distribution {1/2, 1/4, 1/4, 0} -> both beam nodes carry 1.5 ln 2.
    logp0 = _log(np.array([[0.5, 0.25, 0.25, 0.0]], np.float32))
    beam = first_beam_jit(jnp.asarray(logp0), jnp.zeros((1, 1)), 2, 2, entropy=True)
    np.testing.assert_allclose(np.asarray(beam.ent), [[1.5 * LN2] * 2], rtol=1e-6)
    assert first_beam_jit(jnp.asarray(logp0), jnp.zeros((1, 1)), 2, 2).ent is None  # off unless asked
    # beam node 0 (token 0, score ln 1/2) predicts a point mass on token 3 (entropy 0); node 1 (token 1, score
    # ln 1/4) a uniform distribution (ln 4). The best children: token 3 under node 0 (ln 1/2), then token 0 under
    # node 1 (ln 1/16), each carrying its parent's entropy.
    logp1 = _log(np.array([[[0.0, 0.0, 0.0, 1.0], [0.25, 0.25, 0.25, 0.25]]], np.float32))
    nxt = expand_jit(beam, jnp.zeros((1, 2, 1)), jnp.asarray(logp1), 2, 2)
    np.testing.assert_array_equal(np.asarray(nxt.tok), [[3, 0]])
    np.testing.assert_allclose(np.asarray(nxt.ent), [[0.0, 2 * LN2]], rtol=1e-6, atol=0)
    # the signal reads the best node: node 0 of the new beam (score ln 1/2), entropy 0 -> bound 1
    np.testing.assert_array_equal(np.asarray(adaedl.stop_signal(nxt, 1.0)), np.asarray([1.0], np.float32))
    # an inactive row keeps its beam, entropies included
    frozen = expand_jit(dataclasses.replace(beam, active=jnp.asarray([False])), jnp.zeros((1, 2, 1)),
                        jnp.asarray(logp1), 2, 2)
    np.testing.assert_array_equal(np.asarray(frozen.ent), np.asarray(beam.ent))
    with pytest.raises(ValueError, match="entropy=True"):
        adaedl.stop_signal(first_beam(jnp.asarray(logp0), jnp.zeros((1, 1)), 2, 2), 1.0)


K, N, MAX_NEW = 2, 6, 24
TREE = TreeConfig(top_k=K, total_tokens=N, depth=2)
# gamma and lambda chosen so that the tiny head's entropies cross the bound from cycle to cycle
RULE = DDDConfig(check_steps=(0, 1, 2, 3), threshold=0.5, max_depth=4, rule="adaedl", gamma=0.1)


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(), fitted_draft()


@pytest.mark.slow  # three sync modes (~17 s)
def test_adaedl_is_lossless_in_every_sync_mode_with_the_same_depths(tiny):
    target, draft = tiny
    depths = []
    for p in prompts(4, seed=5):
        van = ddd_jax.generate(target, None, p, max_new_tokens=MAX_NEW).tokens
        seen = {}
        for sync in ("device", "callback", "host"):
            r = ddd_jax.generate(target, draft, p, max_new_tokens=MAX_NEW, method="ddd", sync=sync, tree=TREE,
                                 ddd=RULE)
            assert r.tokens == van, sync
            seen[sync] = (r.stats["depth_per_call"], r.stats["ddd_checks"])
        assert seen["device"] == seen["callback"] == seen["host"]
        depths += seen["device"][0]
    assert len(set(depths)) >= 3  # the bound decided differently across cycles
    # the device mode's decisions add no host sync
    r = ddd_jax.generate(target, draft, prompts(1, seed=5)[0], max_new_tokens=MAX_NEW, method="ddd", sync="device",
                         tree=TREE, ddd=RULE)
    assert r.stats["draft_syncs"] == 0


def test_adaedl_plan_and_bad_input(tiny):
    target, draft = tiny
    plan = make_plan(target, draft, method="ddd", sync="device", tree=TREE, ddd=RULE, temperature=0.0, top_p=1.0,
                     max_new_tokens=4)
    assert plan.adaedl_gamma == 0.1 and plan.gain is None
    eagle = make_plan(target, draft, method="eagle2", sync="device", tree=TREE, ddd=RULE, temperature=0.0, top_p=1.0,
                      max_new_tokens=4)
    assert eagle.adaedl_gamma is None
    assert DDDConfig(rule="adaedl", threshold=0.3).gamma == 1.0  # the default gamma
    for gamma in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="gamma must be finite and > 0"):
            DDDConfig(rule="adaedl", threshold=0.3, gamma=gamma)
    with pytest.raises(ValueError, match="threshold .lambda. must be finite"):
        DDDConfig(rule="adaedl", threshold=float("-inf"))
    with pytest.raises(ValueError, match="gamma belongs to rule='adaedl'"):
        DDDConfig(threshold=0.3, gamma=0.5)
    with pytest.raises(ValueError, match="rule must be one of"):
        DDDConfig(rule="AdaEDL")
    d = RULE.to_dict()
    assert d["rule"] == "adaedl" and d["gamma"] == 0.1 and "gain" not in d
    assert DDDConfig.from_dict(d) == RULE and "rule" not in DDDConfig().to_dict()


def test_torch_counterpart_refuses_adaedl():
    pytest.importorskip("torch")
    from ddd_jax.bench import torch_decoding as td
    with pytest.raises(ValueError, match="rule='adaedl' is JAX-only"):
        td.generate(SimpleNamespace(head=object()), [1, 2], method="ddd", sync="device", ddd=RULE)
