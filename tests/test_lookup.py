"""Context-lookup candidates (`TreeConfig.lookup`): the on-device n-gram search against a brute-force reference,
the pool they join stays a tree under the EAGLE-2 rerank, decoding with them is token-identical to vanilla (every
sync mode) and they are really accepted; bad settings are refused with a clear error."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddd_jax import DDDConfig, TreeConfig, generate
from ddd_jax.config import LOOKUP_MAX_NGRAM
from ddd_jax.tree import NEG, add_lookup, build_tree, first_beam, lookup_chain
from spec_helpers import fitted_draft, tiny_target
from test_spec import check_identical

lookup_jit = jax.jit(lookup_chain, static_argnames=("length", "ngram", "max_ngram"))
add_jit = jax.jit(add_lookup, static_argnames=("k",))
build_jit = jax.jit(build_tree, static_argnames=("n",))


def reference_lookup(ctx: list, i: int, length: int, ngram: int, max_ngram: int):
    """The most recent earlier occurrence of the longest suffix (max_ngram .. ngram tokens) ending at i."""
    for n in range(max_ngram, ngram - 1, -1):
        if i - n + 1 < 0:
            continue
        for j in range(i - 1, n - 2, -1):
            if ctx[j - n + 1: j + 1] == ctx[i - n + 1: i + 1]:
                return [ctx[j + 1 + t] for t in range(length) if j + 1 + t <= i]
    return []


@pytest.mark.parametrize("ngram,length", [(1, 3), (2, 4), (3, 1), (4, 2)])
def test_lookup_chain_matches_reference(ngram, length):
    rng = np.random.RandomState(ngram * 10 + length)
    C = 40
    for _ in range(6):
        # a small vocabulary and a repeated stretch: matches of every length occur
        ctx = rng.randint(0, 4, C)
        ctx[20:30] = ctx[5:15]
        pos = np.arange(C - 2)  # every root position, one batch row each
        batch = np.repeat(ctx[None], len(pos), 0)
        # what lies past the root is never read: stale tokens of rejected drafts sit there during decoding
        batch = np.where(np.arange(C)[None] > pos[:, None], rng.randint(0, 4, batch.shape), batch)
        tok, ok = lookup_jit(jnp.asarray(batch, jnp.int32), jnp.asarray(pos, jnp.int32), length, ngram,
                             LOOKUP_MAX_NGRAM)
        tok, ok = np.asarray(tok), np.asarray(ok)
        for r, i in enumerate(pos):
            want = reference_lookup(ctx.tolist(), int(i), length, ngram, LOOKUP_MAX_NGRAM)
            assert ok[r].tolist() == [t < len(want) for t in range(length)], (i, want, ok[r])
            assert tok[r][ok[r]].tolist() == want


def _pool(head_tok, head_lp, k=4):
    return first_beam(jnp.full((1, 32), -30.0).at[0, jnp.asarray(head_tok)].set(jnp.asarray(head_lp)),
                      jnp.zeros((1, 2)), k, 1)


def test_lookup_chain_joins_the_tree():
    beam = _pool([5, 7, 9, 11], [-0.1, -1.0, -2.0, -3.0])  # head: 5 likely, the rest not
    # chain 7 8 6: its first token is the head's second candidate, so it continues under that node
    b = add_jit(beam, jnp.asarray([[7, 8, 6]]), jnp.asarray([[True, True, True]]), -0.4, k=4)
    score = np.asarray(b.pool_score[0])
    P = beam.pool_tok.shape[1]
    assert score[P] == -np.inf and np.asarray(b.pool_parent[0, P + 1]) == 1  # deduplicated under the head's 7
    assert score[P + 1] == -1.0 and score[P + 2] == -1.2  # min(parent, (t + 1) * logp): never above the parent
    tree = build_jit(jnp.asarray([3]), b, 5)
    toks, parent = np.asarray(tree.tokens[0]).tolist(), np.asarray(tree.parent[0]).tolist()
    assert toks == [3, 5, 7, 8, 6] and parent == [0, 0, 0, 2, 3]  # 5 (-0.1), 7 (-1), its chain (-1, -1.2)
    assert np.asarray(tree.depth[0]).tolist() == [0, 1, 1, 2, 3]
    # a chain the head did not propose hangs under the root; unknown tokens (ok=False) never enter the tree
    b = add_jit(beam, jnp.asarray([[4, 8, 6]]), jnp.asarray([[True, True, False]]), -0.2, k=4)
    tree = build_jit(jnp.asarray([3]), b, 5)
    assert np.asarray(tree.tokens[0]).tolist() == [3, 5, 7, 4, 8]
    assert np.asarray(tree.parent[0]).tolist() == [0, 0, 0, 0, 3]
    b = add_jit(beam, jnp.asarray([[4, 8, 6]]), jnp.asarray([[False] * 3]), -0.2, k=4)  # no match: head only
    assert np.asarray(build_jit(jnp.asarray([3]), b, 5).tokens[0]).tolist() == [3, 5, 7, 9, 11]


def test_lookup_pool_stays_a_tree():
    rng = np.random.RandomState(0)
    for _ in range(20):
        k, c, n = 4, int(rng.randint(1, 5)), int(rng.randint(2, 9))
        lp = -np.sort(rng.exponential(1.0, k))
        beam = _pool(rng.choice(16, k, replace=False), lp, k)
        tok = rng.randint(0, 16, (1, c))
        if rng.rand() < 0.5:
            tok[0, 0] = int(beam.pool_tok[0, rng.randint(k)])
        ok = np.arange(c)[None] < rng.randint(0, c + 1)
        b = add_jit(beam, jnp.asarray(tok), jnp.asarray(ok), float(-rng.exponential(0.5)), k=k)
        score, par = np.asarray(b.pool_score[0]), np.asarray(b.pool_parent[0])
        for q in range(len(score)):  # scores never rise along a path
            if np.isfinite(score[q]) and par[q] >= 0:
                assert score[q] <= score[par[q]] and np.isfinite(score[par[q]])
        tree = build_jit(jnp.asarray([99]), b, n)
        parent, valid = np.asarray(tree.parent[0]), np.asarray(tree.valid[0])
        assert all(parent[i] < i for i in range(1, n) if valid[i])
        assert all(valid[parent[i]] for i in range(n))


@pytest.fixture(scope="module")
def looping():
    """Prompts whose greedy continuations repeat themselves (the tiny target falls into loops on its training
    prompts' continuations), so lookups find matches."""
    target, draft = tiny_target(), fitted_draft()
    ps = [[7, 3, 9, 7, 3, 9, 7, 3], [11, 12, 13, 14, 11, 12, 13], [40, 41, 40, 41, 40]]
    ref = generate(target, None, ps, max_new_tokens=40)
    return target, draft, ps, ref


@pytest.mark.parametrize("method,sync", [pytest.param("eagle2", "device", marks=pytest.mark.slow),
                                         pytest.param("ddd", "host", marks=pytest.mark.slow),
                                         pytest.param("ddd", "callback", marks=pytest.mark.deep),
                                         pytest.param("ddd", "device", marks=pytest.mark.slow)])  # ~20 s with its head
def test_lookup_is_lossless_and_accepted(looping, method, sync):
    target, draft, ps, ref = looping
    # depth 0: the head alone accepts at most one drafted token a cycle; longer paths are lookup chains
    tree = TreeConfig(top_k=4, total_tokens=6, depth=0, lookup=5, lookup_ngram=1, lookup_logp=-0.1)
    ddd = DDDConfig(check_steps=(0,), threshold=0.0, max_depth=1)  # never confident: DDD stops at step 0
    res = generate(target, draft, ps, max_new_tokens=40, method=method, sync=sync, tree=tree, ddd=ddd)
    check_identical(target, ps, ref.tokens, res.tokens, f"lookup {method}/{sync}")
    acc = [a for s in res.stats["per_sequence"] for a in s["accepted_per_call"]]
    assert max(acc) > 2, f"no lookup chain was accepted: {acc}"
    assert max(acc) <= 6  # root + at most lookup tokens
    for st, toks in zip(res.stats["per_sequence"], res.tokens):
        assert sum(st["accepted_per_call"]) == len(toks) - 1


def test_lookup_bad_settings():
    for kw, msg in [(dict(lookup=-1), "lookup must be"), (dict(lookup_ngram=0), "lookup_ngram"),
                    (dict(lookup_ngram=LOOKUP_MAX_NGRAM + 1), "lookup_ngram"), (dict(lookup_logp=0.5), "lookup_logp"),
                    (dict(lookup_logp=float("nan")), "lookup_logp"), (dict(lookup_logp=NEG), "lookup_logp")]:
        with pytest.raises(ValueError, match=msg):
            TreeConfig(top_k=4, total_tokens=4, depth=1, **kw)


def test_lookup_in_settings_and_method_specs():
    from ddd_jax.bench.run import method_label, parse_method
    from ddd_jax.settings import to_configs, validate
    s = {"tree": {"top_k": 4, "total_tokens": 4, "depth": 2, "lookup": 3, "lookup_ngram": 2, "lookup_logp": -0.3},
         "ddd": {"check_steps": [0, 1], "threshold": -0.5, "max_depth": 4}}
    tree, _ = to_configs(validate(s))
    assert (tree.lookup, tree.lookup_ngram, tree.lookup_logp) == (3, 2, -0.3)
    with pytest.raises(ValueError, match="keys"):
        validate({**s, "tree": {**s["tree"], "lookahead": 2}})
    spec = parse_method("ddd-device[k=4,N=4,S=0/1,x=-0.5,n=4,L=3,g=1,p=-0.2]")
    assert (spec.tree.lookup, spec.tree.lookup_ngram, spec.tree.lookup_logp) == (3, 1, -0.2)
    assert parse_method(method_label("ddd-device", spec.tree, spec.ddd)).tree == spec.tree
    with pytest.raises(ValueError, match="lookup_ngram"):
        parse_method("eagle2[L=2,g=9]")
