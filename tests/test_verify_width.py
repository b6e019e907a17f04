"""The verify forward follows the draft: each cycle verifies the narrowest compiled width that holds every live
sequence's root and valid tree nodes. Every width keeps greedy output vanilla's in every sync mode, and sampling
draws exactly what the full-width forward draws; a sequence DDD stops at its step-0 check verifies its root only."""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

from ddd_jax import DDDConfig, TreeConfig, generate
from ddd_jax.decode.state import Plan
from spec_helpers import fitted_draft, prompts, tiny_target
from test_spec import check_identical, train_prompts

# top_k 1: a sequence that drafted d >= 1 steps holds 1 + (1 + d) rows, one stopped at step 0 its root alone
# (stop0_nodes=0) or with the root's child (the default); with the tiny head DDD stops at steps 0 and 1 (1 or 2, and 3
# rows: widths 1 or 2, and 4 of (1, 2, 4, 7)), and a rule that never stops drafts to depth 5 (7 rows)
TREE = TreeConfig(top_k=1, total_tokens=7, depth=5)
DDD = DDDConfig(check_steps=(0, 1), threshold=-1.5, max_depth=5, stop0_nodes=0)
WIDTHS = (1, 2, 4, 7)


def width(need: int) -> int:
    return min(w for w in WIDTHS if w >= need)


@pytest.fixture(scope="module")
def setup():
    target, draft = tiny_target(), fitted_draft()
    ps = train_prompts(6) + prompts(2, seed=7, lo=20, hi=40)
    return target, draft, ps, generate(target, None, ps, max_new_tokens=24)


def full_width(monkeypatch):
    """Every cycle verifies total_tokens rows (jit caches programs by the plan's value: start them anew)."""
    monkeypatch.setattr(Plan, "verify_widths", property(lambda self: (self.total_tokens,)))
    jax.clear_caches()


@pytest.mark.parametrize("sync", [pytest.param("host", marks=pytest.mark.slow),  # test-fast: one sync mode
                                  pytest.param("callback", marks=pytest.mark.deep),  # ~20 s: test-deep
                                  pytest.param("device", marks=pytest.mark.slow)])  # ~9 s
def test_every_width_is_lossless_in_every_sync_mode(setup, sync):
    target, draft, ps, ref = setup
    seen = set()
    for p, r in zip(ps[:4], ref.tokens[:4]):
        for ddd in (DDD, dataclasses.replace(DDD, stop0_nodes=-1), dataclasses.replace(DDD, threshold=-math.inf)):
            g = generate(target, draft, p, max_new_tokens=24, method="ddd", sync=sync, tree=TREE, ddd=ddd)
            check_identical(target, [p], [r], [g.tokens], f"ddd {sync}")
            st = g.stats
            assert len(st["verified_per_call"]) == st["target_calls"]
            for rows, depth, acc, needed in zip(st["verified_per_call"], st["depth_per_call"],
                                                st["accepted_per_call"], st["needed_per_call"]):
                need = (1 if ddd.stop0_nodes == 0 else 2) if depth == 0 else 2 + depth  # stopped at step 0
                assert rows == width(need) and needed == need and acc <= need, (rows, depth, acc, needed)
            seen.update(st["verified_per_call"])
    assert seen == {1, 2, 4, 7}, seen
    if sync != "device":
        return
    e = generate(target, draft, ps[:2], max_new_tokens=24, method="eagle2",
                 tree=TreeConfig(top_k=1, total_tokens=2, depth=0))  # one drafted node: width 2
    check_identical(target, ps[:2], ref.tokens[:2], e.tokens, "eagle2 depth 0")
    assert {r for s in e.stats["per_sequence"] for r in s["verified_per_call"]} == {2}


def test_a_batch_verifies_what_its_widest_live_sequence_needs(setup):
    target, draft, ps, ref = setup
    g = generate(target, draft, ps, max_new_tokens=24, method="ddd", sync="device", tree=TREE, ddd=DDD)
    check_identical(target, ps, ref.tokens, g.tokens, "ddd device batch")
    per = g.stats["per_sequence"]
    calls = max(s["target_calls"] for s in per)
    for c in range(calls):
        live = [s for s in per if c < s["target_calls"]]
        need = max(1 if s["depth_per_call"][c] == 0 else 2 + s["depth_per_call"][c] for s in live)
        assert {s["verified_per_call"][c] for s in live} == {width(need)}


@pytest.mark.parametrize("sync", ["device", "host"])
@pytest.mark.slow  # chi-square per sync mode (~10 s)
def test_sampling_draws_what_the_full_width_draws(setup, monkeypatch, sync):
    target, draft, ps, _ = setup
    kw = dict(max_new_tokens=24, method="ddd", sync=sync, tree=TREE, ddd=dataclasses.replace(DDD, threshold=-2.0),
              temperature=0.8, seed=3)
    narrow = generate(target, draft, ps[:3], **kw)
    try:
        full_width(monkeypatch)
        full = generate(target, draft, ps[:3], **kw)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert narrow.tokens == full.tokens
    assert {r for s in full.stats["per_sequence"] for r in s["verified_per_call"]} == {7}
    assert len({r for s in narrow.stats["per_sequence"] for r in s["verified_per_call"]}) >= 2
    assert [s["depth_per_call"] for s in narrow.stats["per_sequence"]] == \
        [s["depth_per_call"] for s in full.stats["per_sequence"]]


def test_vanilla_verifies_one_row_a_call(setup):
    target, _, ps, ref = setup
    st = ref.stats["per_sequence"][0]
    assert st["verified_per_call"] == [1] * st["target_calls"] and np.isclose(st["mean_verified"], 1.0)


def test_a_plan_compiles_only_the_widths_its_cycles_can_need(setup):
    from ddd_jax.decode.state import make_plan
    target, draft, _, _ = setup

    def widths(method, tree, ddd=DDDConfig()):
        return make_plan(target, draft, method=method, sync="device", tree=tree, ddd=ddd, temperature=0.0,
                         top_p=1.0, max_new_tokens=8).verify_widths

    cpu = TreeConfig(top_k=4, total_tokens=7, depth=2, lookup=4)
    rule = DDDConfig(check_steps=(0, 1, 3, 5), threshold=-1.0, max_depth=6)
    assert widths("ddd", cpu, rule) == (7,)  # the root's 4 children are always kept: 5 rows at least
    assert widths("ddd", cpu, dataclasses.replace(rule, stop0_nodes=0)) == (1, 2, 4, 7)
    assert widths("ddd", cpu, dataclasses.replace(rule, stop0_nodes=1)) == (2, 4, 7)
    assert widths("eagle2", TreeConfig(top_k=1, total_tokens=8, depth=7)) == (2, 4, 8)
    assert widths("ddd", TREE, dataclasses.replace(DDD, check_steps=(1,))) == (2, 4, 7)  # no step-0 check


def test_the_width_switch_never_copies_the_cache():
    """The switch over widths wraps each layer's products, not the KV cache: a branch that wrote the cache would
    make XLA copy it whole every cycle (what a cycle cost on the CPU before). The compiled forward with a donated
    cache holds no copy of a cache-sized buffer, and its rows within the width equal the full-width forward's."""
    import re

    import jax.numpy as jnp

    from ddd_jax import llama
    target = tiny_target()
    cfg = target.config
    cache = llama.new_cache(cfg, 2, 256)
    toks = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 7)), jnp.int32)
    pos = jnp.arange(7, dtype=jnp.int32)[None].repeat(2, 0)
    mask = jnp.tril(jnp.ones((2, 7, 7), bool))

    def step(params, cache, pick):
        o = llama.forward(params, cfg, toks, pos, cache, attn_mask=mask, return_logits=False, greedy=True,
                          rows=(pick, WIDTHS))
        return o.cache, o.greedy, o.hidden

    fn = jax.jit(step, donate_argnums=1)
    hlo = fn.lower(target.params, cache, jnp.int32(1)).compile().as_text()
    shape = "f32[" + ",".join(map(str, cache.k.shape)) + "]"
    copies = [line for line in hlo.splitlines() if re.search(re.escape(shape) + r"\{[^}]*\} copy\(", line)]
    assert "conditional" in hlo and not copies, copies[:3]
    full = llama.forward(target.params, cfg, toks, pos, llama.new_cache(cfg, 2, 256), attn_mask=mask,
                         return_logits=False, greedy=True)
    for pick, w in enumerate(WIDTHS):
        _, ids, hidden = fn(target.params, llama.new_cache(cfg, 2, 256), jnp.int32(pick))
        np.testing.assert_array_equal(np.asarray(ids)[:, :w], np.asarray(full.greedy)[:, :w])
        np.testing.assert_allclose(np.asarray(hidden)[:, :w], np.asarray(full.hidden)[:, :w], rtol=1e-5, atol=1e-6)
