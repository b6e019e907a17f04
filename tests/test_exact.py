"""Exact-array unit tests (gemma style) for the bookkeeping functions: tree expansion with inactive rows, cache
commit with padded paths, and EOS inside an accepted block. Small hand-computed inputs, exact expected arrays."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ddd_jax import DDDConfig, Target, TreeConfig, llama
from ddd_jax.cache import KVCache, commit
from ddd_jax.decode import make_plan
from ddd_jax.decode.cycle import _emit
from ddd_jax.tree import Beam, build_tree, expand, first_beam
from spec_helpers import TINY

NEG = -np.inf
T, F = True, False

# Jitted as generate runs them (one compile each instead of an eager dispatch per op).
first_beam_jit = jax.jit(first_beam, static_argnums=(2, 3))
expand_jit = jax.jit(expand, static_argnums=(3, 4))
build_tree_jit = jax.jit(build_tree, static_argnums=2)
commit_jit = jax.jit(commit)
emit_jit = jax.jit(_emit, static_argnums=0)


def assert_exact(got, want, what=""):
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    np.testing.assert_array_equal(got, want, err_msg=what)


# ------------------------------------------------------------------------------------------------ tree.expand
# k=2, max_depth=2 -> pool P = 2 + 2*2*2 = 10, draft scratch W = 4; vocabulary V = 4; feature size D = 1.
# Log-probs are powers of two so every cumulative score is exact in float32.
K, MAX_DEPTH = 2, 2

# Step-0 log-probs: row 0 -> top-2 tokens (3, 1) with (-0.5, -1.0); row 1 -> (2, 0) with (-0.25, -2.0).
LOGP0 = np.array([[-4.0, -1.0, -8.0, -0.5],
                  [-2.0, -16.0, -0.25, -32.0]], np.float32)
H0 = np.array([[10.0], [20.0]], np.float32)


def step0_beam(active) -> Beam:
    """The beam after step 0, written out by hand (test_first_beam_exact checks first_beam gives exactly this)."""
    pool_tok = np.zeros((2, 10), np.int32)
    pool_tok[:, :2] = [[3, 1], [2, 0]]
    pool_score = np.full((2, 10), NEG, np.float32)
    pool_score[:, :2] = [[-0.5, -1.0], [-0.25, -2.0]]
    anc = np.array([[[T, F, F, F], [F, T, F, F]]] * 2)
    return Beam(step=jnp.asarray(0, jnp.int32), depth=jnp.zeros((2,), jnp.int32), active=jnp.asarray(active),
                tok=jnp.asarray([[3, 1], [2, 0]], jnp.int32), feat=jnp.asarray([[[10.0], [10.0]], [[20.0], [20.0]]]),
                score=jnp.asarray([[-0.5, -1.0], [-0.25, -2.0]], jnp.float32),
                pool_idx=jnp.asarray([[0, 1], [0, 1]], jnp.int32), anc=jnp.asarray(anc),
                pool_tok=jnp.asarray(pool_tok), pool_score=jnp.asarray(pool_score),
                pool_parent=jnp.full((2, 10), -1, jnp.int32))


def test_first_beam_exact():
    got, want = first_beam_jit(jnp.asarray(LOGP0), jnp.asarray(H0), K, MAX_DEPTH), step0_beam([T, T])
    for f in dataclasses.fields(Beam):
        assert_exact(getattr(got, f.name), getattr(want, f.name), f.name)


# Step-1 head outputs on the beam: features h [B, k, D] and children's log-probs [B, k, V].
H1 = np.array([[[1.0], [2.0]], [[3.0], [4.0]]], np.float32)
LOGP1 = np.array([
    [[-3.0, -0.75, -1.0, -4.0],      # row 0, node 0 (score -0.5): children 1, 2 -> cum -1.25, -1.5
     [-0.125, -5.0, -6.0, -2.0]],    # row 0, node 1 (score -1.0): children 0, 3 -> cum -1.125, -3.0
    [[-0.5, -0.0625, -8.0, -9.0],    # row 1 is inactive: whatever it predicts is ignored
     [-1.0, -2.0, -0.03125, -4.0]],
], np.float32)


def test_expand_with_inactive_row_exact():
    beam = step0_beam([T, F])  # row 1 stopped drafting
    got = expand_jit(beam, jnp.asarray(H1), jnp.asarray(LOGP1), K, MAX_DEPTH)

    # Row 0: pool[2:6] = children of node 0 (pool 0) then node 1 (pool 1), cum scores (-1.25, -1.5, -1.125, -3.0).
    # New beam = best two: pool 4 (token 0, -1.125, from node 1) then pool 2 (token 1, -1.25, from node 0);
    # each takes its source node's feature and ancestors plus its own scratch slot (step 1 -> slots 2, 3).
    # Row 1: the beam and depth are unchanged and its new pool entries stay -inf.
    assert_exact(got.step, np.int32(1), "step")
    assert_exact(got.depth, np.array([1, 0], np.int32), "depth")
    assert_exact(got.active, np.array([T, F]), "active")
    assert_exact(got.tok, np.array([[0, 1], [2, 0]], np.int32), "tok")
    assert_exact(got.feat, np.array([[[2.0], [1.0]], [[20.0], [20.0]]], np.float32), "feat")
    assert_exact(got.score, np.array([[-1.125, -1.25], [-0.25, -2.0]], np.float32), "score")
    assert_exact(got.pool_idx, np.array([[4, 2], [0, 1]], np.int32), "pool_idx")
    assert_exact(got.anc, np.array([[[F, T, T, F], [T, F, F, T]],
                                    [[T, F, F, F], [F, T, F, F]]]), "anc")
    assert_exact(got.pool_score, np.array([
        [-0.5, -1.0, -1.25, -1.5, -1.125, -3.0, NEG, NEG, NEG, NEG],
        [-0.25, -2.0, NEG, NEG, NEG, NEG, NEG, NEG, NEG, NEG]], np.float32), "pool_score")
    # Token / parent entries only mean something where the score is finite (an inactive row's new entries
    # may hold anything: they are never kept ahead of a real candidate and build_tree marks them invalid).
    live = np.isfinite(np.asarray(got.pool_score))
    assert_exact(np.where(live, got.pool_tok, -9), np.array([
        [3, 1, 1, 2, 0, 3, -9, -9, -9, -9],
        [2, 0, -9, -9, -9, -9, -9, -9, -9, -9]], np.int32), "pool_tok")
    assert_exact(np.where(live, got.pool_parent, -9), np.array([
        [-1, -1, 0, 0, 1, 1, -9, -9, -9, -9],
        [-1, -1, -9, -9, -9, -9, -9, -9, -9, -9]], np.int32), "pool_parent")

    # An inactive row expanded again still does not change (and the active row's next beam lands in pool 6..9).
    again = expand_jit(got, jnp.asarray(H1), jnp.asarray(LOGP1), K, MAX_DEPTH)
    for f in ("depth", "tok", "feat", "score", "pool_idx", "anc", "pool_score"):
        assert_exact(getattr(again, f)[1], getattr(beam, f)[1], f)
    assert_exact(again.depth, np.array([2, 0], np.int32), "depth after step 2")

    # The tree built from the step-1 pool (root + 4 nodes). Row 0 keeps pool 0 (-0.5), 1 (-1.0), 4 (-1.125),
    # 2 (-1.25), laid out by pool index: slots 1..4 = pool 0, 1, 2, 4. Row 1 has only two real candidates:
    # slots 3, 4 are invalid (hang off the root, tokens meaningless).
    tree = build_tree_jit(jnp.asarray([7, 8], jnp.int32), got, 5)
    assert_exact(tree.valid, np.array([[T, T, T, T, T], [T, T, T, F, F]]), "valid")
    assert_exact(np.where(tree.valid, tree.tokens, -9), np.array([[7, 3, 1, 1, 0], [8, 2, 0, -9, -9]], np.int32),
                 "tokens")
    assert_exact(tree.parent, np.array([[0, 0, 0, 1, 2], [0, 0, 0, 0, 0]], np.int32), "parent")
    assert_exact(tree.depth, np.array([[0, 1, 1, 2, 2], [0, 1, 1, 1, 1]], np.int32), "depth")
    assert_exact(tree.anc, np.array([
        [[T, F, F, F, F], [T, T, F, F, F], [T, F, T, F, F], [T, T, F, T, F], [T, F, T, F, T]],
        [[T, F, F, F, F], [T, T, F, F, F], [T, F, T, F, F], [T, F, F, T, F], [T, F, F, F, T]]]), "anc")


# ----------------------------------------------------------------------------------------------- cache.commit
def test_commit_with_padded_paths_exact():
    # L=2 layers, B=3 rows, S=8 slots, 1 kv head of size 1: k = 1000*layer + 100*row + slot, v = -k.
    L, B, S = 2, 3, 8
    k = (1000 * np.arange(L)[:, None, None] + 100 * np.arange(B)[None, :, None]
         + np.arange(S)[None, None, :]).astype(np.float32)[:, :, None, :, None]  # [L, B, 1, S, 1]
    cache = KVCache(k=jnp.asarray(k), v=jnp.asarray(-k), length=jnp.asarray([9, 9, 9], jnp.int32))
    start = jnp.asarray([2, 5, 6], jnp.int32)
    slots = jnp.asarray([[0, 2, 3],    # row 0: path root, tree 2, tree 3 (n=3, nothing padded)
                         [0, 2, 9],    # row 1: n=2; the pad (9) points past the capacity and is clipped
                         [0, 0, 1]],   # row 2: n=1; two pad entries, the last one's destination is past S
                        jnp.int32)
    n = jnp.asarray([3, 2, 1], jnp.int32)
    got = commit_jit(cache, start, slots, n)

    # Slots [start, start+M) get the gathered entries (pads included, as scratch past the new length); slots
    # before start and from start+M on are untouched; writes past the capacity are dropped.
    want_l0 = np.array([[0, 1, 2, 4, 5, 5, 6, 7],            # 2,3,4 <- 2,4,5
                        [100, 101, 102, 103, 104, 105, 107, 107],  # 5,6,7 <- 5,7,7 (14 clipped to 7)
                        [200, 201, 202, 203, 204, 205, 206, 206]],  # 6,7 <- 6,6 (8 <- 7 dropped)
                       np.float32)
    want = np.stack([want_l0, want_l0 + 1000])[:, :, None, :, None]
    assert_exact(got.k, want, "k")
    assert_exact(got.v, -want, "v")
    assert_exact(got.length, np.array([5, 7, 7], np.int32), "length")


# ------------------------------------------------------------------------------------------ EOS in a block
def emit_plan(max_new_tokens: int, eos: tuple):
    """The one place this file builds a generate.Plan (only its EOS ids and max-new-tokens matter to _emit)."""
    cfg = dataclasses.replace(TINY, eos_token_id=eos)
    target = Target("emit", cfg, llama.abstract_params(cfg))  # shapes only: a plan needs no weights
    return make_plan(target, None, method="vanilla", sync="device", tree=TreeConfig(), ddd=DDDConfig(),
                     temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens)


def test_emit_cuts_after_eos_and_at_max_new_exact():
    plan = emit_plan(6, (9, 11))
    out = np.zeros((5, 6 + 4), np.int32)  # [B, max_new + M]
    out[0, :1] = [5]
    out[1, :4] = [5, 5, 5, 5]
    out[3, :5] = [5, 5, 5, 5, 5]
    out[4, :3] = [4, 4, 4]
    out_len = np.array([1, 4, 0, 5, 3], np.int32)
    done = np.array([F, F, F, F, T])
    emitted = np.array([[3, 11, 4, 9],   # EOS (11) inside the block: keep 3, 11; stop
                        [1, 2, 3, 4],    # no EOS: only 2 fit under max_new=6; stop
                        [7, 8, 9, 1],    # n=2: the 9 is padding, not an EOS; go on
                        [1, 9, 2, 0],    # the EOS would come after max_new: emit 1 only; stop without EOS
                        [9, 9, 9, 9]],   # row already done: nothing changes
                       np.int32)
    n = np.array([4, 4, 2, 3, 4], np.int32)
    got_out, got_len, got_done, kept = emit_jit(plan, jnp.asarray(out), jnp.asarray(out_len), jnp.asarray(done),
                                             jnp.asarray(emitted), jnp.asarray(n))

    assert_exact(kept, np.array([2, 2, 2, 1, 0], np.int32), "kept")
    assert_exact(got_len, np.array([3, 6, 2, 6, 3], np.int32), "out_len")
    assert_exact(got_done, np.array([T, T, F, T, T]), "done")
    # The output up to out_len (what callers read); past it the array is scratch.
    shown = np.where(np.arange(out.shape[1])[None] < np.asarray(got_len)[:, None], got_out, -1)
    assert_exact(shown, np.array([[5, 3, 11, -1, -1, -1, -1, -1, -1, -1],
                                  [5, 5, 5, 5, 1, 2, -1, -1, -1, -1],
                                  [7, 8, -1, -1, -1, -1, -1, -1, -1, -1],
                                  [5, 5, 5, 5, 5, 1, -1, -1, -1, -1],
                                  [4, 4, 4, -1, -1, -1, -1, -1, -1, -1]], np.int32), "out")
    assert_exact(got_out[4], out[4], "done row, whole buffer")


def test_greedy_token_is_argmax_with_ties_and_infinities():
    from ddd_jax.verify import greedy_token
    rng = np.random.default_rng(0)
    V = 49152
    x = rng.standard_normal((7, V)).astype(np.float32)
    x[1, [5, 900, 40000]] = 9.0  # a three-way tie: the lowest index wins
    x[2, :] = -np.inf  # no finite entry: every index ties, index 0
    x[3, 123] = np.inf
    x[4, :] = np.round(x[4, :])  # many ties at the max
    x[5, V - 1] = 50.0  # the last index
    x[6, :] = 0.0
    got = np.asarray(jax.jit(greedy_token)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got.dtype == np.int32 and got[1] == 5 and got[2] == 0 and got[5] == V - 1
    x16 = jnp.asarray(x[:, :1000], jnp.bfloat16)  # ties made by rounding, still the first index
    np.testing.assert_array_equal(np.asarray(greedy_token(x16)), np.asarray(jnp.argmax(x16, axis=-1)))
    batched = rng.standard_normal((2, 3, 50)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(greedy_token(jnp.asarray(batched))), np.argmax(batched, axis=-1))
