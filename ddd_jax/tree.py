"""EAGLE-2 dynamic draft trees with static shapes: beam expansion bookkeeping, rerank, tree mask / depths / parents.

Step numbering (see `TreeConfig`): step 0 is the head forward over the newly committed prefix and gives the
top_k depth-1 candidates (the first beam); step j >= 1 runs the head on the depth-j beam and gives top_k**2
depth-(j+1) candidates, of which the best top_k (by cumulative log-prob) form the next beam.

The candidate pool is laid out by step: pool[0:k] are step-0 candidates, pool[k + (j-1)k^2 + i*k + c] is child c
of beam node i at step j. A parent therefore always has a smaller pool index than its children, and
(children's cumulative log-prob <= parent's) a stable sort by (-score, index) keeps every kept set
ancestor-closed, i.e. a tree. Pool entries of steps never run have score -inf and are never preferred over
real ones.

Axis letters: B batch, k top_k, P pool size, W = max_depth*k draft scratch slots, N total_tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

NEG = -jnp.inf


@jax.tree_util.register_dataclass
@dataclass
class Beam:
    """Draft-phase state that changes every step (the draft KV cache travels separately)."""

    step: jax.Array  # [] int32: steps done (0 after the prefix forward)
    depth: jax.Array  # [B] int32: steps done per sequence (frozen once a sequence stops)
    active: jax.Array  # [B] bool: sequence still drafting
    tok: jax.Array  # [B, k] int32 beam tokens (depth = step + 1)
    feat: jax.Array  # [B, k, D] feature each beam node is paired with (its parent's predicted feature)
    score: jax.Array  # [B, k] float32 cumulative log-probs
    pool_idx: jax.Array  # [B, k] int32 pool index of each beam node
    anc: jax.Array  # [B, k, W] bool: scratch slots of each beam node's ancestors (incl. its own next slot)
    pool_tok: jax.Array  # [B, P] int32
    pool_score: jax.Array  # [B, P] float32 (-inf = empty)
    pool_parent: jax.Array  # [B, P] int32 pool index of the parent, -1 = the root


@jax.tree_util.register_dataclass
@dataclass
class Tree:
    """The verified tree: slot 0 is the root (last emitted token), slots 1.. the kept draft nodes."""

    tokens: jax.Array  # [B, N] int32
    parent: jax.Array  # [B, N] int32 tree slot of the parent (root: 0)
    anc: jax.Array  # [B, N, N] bool ancestor-or-self matrix (the tree attention mask)
    depth: jax.Array  # [B, N] int32 (root 0); verify positions = prefix length + depth
    valid: jax.Array  # [B, N] bool (False only if the pool had fewer finite candidates than N-1)


def pool_size(k: int, max_depth: int) -> int:
    return k + max_depth * k * k


def first_beam(logp, h0, k: int, max_depth: int, tok_map=None) -> Beam:
    """Beam after step 0. logp: [B, V] draft log-probs at the prefix's last pair; h0: [B, D] its output feature.
    tok_map: optional [V'] target ids of a reduced draft vocabulary (logp is then over V')."""
    B = logp.shape[0]
    P, W = pool_size(k, max_depth), max_depth * k
    score, tok = jax.lax.top_k(logp, k)  # [B, k]
    if tok_map is not None:
        tok = jnp.take(tok_map, tok)
    pool_tok = jnp.zeros((B, P), jnp.int32).at[:, :k].set(tok)
    pool_score = jnp.full((B, P), NEG, jnp.float32).at[:, :k].set(score)
    pool_parent = jnp.full((B, P), -1, jnp.int32)
    anc = jnp.zeros((B, k, W), bool).at[:, :, :k].set(jnp.eye(k, dtype=bool)[None])
    return Beam(step=jnp.zeros((), jnp.int32), depth=jnp.zeros((B,), jnp.int32), active=jnp.ones((B,), bool),
                tok=tok.astype(jnp.int32), feat=jnp.broadcast_to(h0[:, None, :], (B, k, h0.shape[-1])),
                score=score.astype(jnp.float32), pool_idx=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (B, k)),
                anc=anc, pool_tok=pool_tok, pool_score=pool_score, pool_parent=pool_parent)


def expand(beam: Beam, h, logp, k: int, max_depth: int, tok_map=None) -> Beam:
    """Bookkeeping of step j = beam.step + 1 given the head's outputs on the beam.

    h: [B, k, D] predicted features of the beam nodes; logp: [B, k, V] their children's log-probs.
    Sequences with active=False add nothing (their new pool entries stay -inf) and keep their beam.
    """
    B, _, D = h.shape
    j = beam.step + 1
    child_lp, child_tok = jax.lax.top_k(logp, k)  # [B, k, k]
    if tok_map is not None:
        child_tok = jnp.take(tok_map, child_tok)
    cu = beam.score[:, :, None] + child_lp  # [B, k, k]
    cu = jnp.where(beam.active[:, None, None], cu, NEG)
    flat_cu = cu.reshape(B, k * k)
    flat_tok = child_tok.reshape(B, k * k).astype(jnp.int32)
    base = k + (j - 1) * k * k
    parents = jnp.repeat(beam.pool_idx, k, axis=1)  # [B, k*k]
    pool_tok = jax.lax.dynamic_update_slice(beam.pool_tok, flat_tok, (0, base))
    pool_score = jax.lax.dynamic_update_slice(beam.pool_score, flat_cu, (0, base))
    pool_parent = jax.lax.dynamic_update_slice(beam.pool_parent, parents, (0, base))

    top_score, top_i = jax.lax.top_k(flat_cu, k)  # [B, k]
    src = top_i // k  # beam row each new beam node descends from
    new_tok = jnp.take_along_axis(flat_tok, top_i, axis=1)
    new_feat = jnp.take_along_axis(h, src[:, :, None], axis=1)
    new_anc = jnp.take_along_axis(beam.anc, src[:, :, None], axis=1)  # [B, k, W]
    slot = j * k + jnp.arange(k)  # scratch slots of the new beam (written at step j+1)
    W = beam.anc.shape[-1]
    own = (jnp.arange(W)[None, :] == slot[:, None])  # [k, W] (all False past the scratch end)
    new_anc = new_anc | own[None]
    act = beam.active
    pick = lambda new, old: jnp.where(act.reshape((B,) + (1,) * (new.ndim - 1)), new, old)
    return Beam(step=j, depth=beam.depth + act.astype(jnp.int32), active=act,
                tok=pick(new_tok, beam.tok), feat=pick(new_feat, beam.feat), score=pick(top_score, beam.score),
                pool_idx=pick((base + top_i).astype(jnp.int32), beam.pool_idx), anc=pick(new_anc, beam.anc),
                pool_tok=pool_tok, pool_score=pool_score, pool_parent=pool_parent)


def confidence(beam: Beam):
    """DDD confidence [B]: log of the total probability of the current beam's sequences."""
    return jax.nn.logsumexp(beam.score, axis=-1)


def _build_one(root, pool_tok, pool_score, pool_parent, n: int) -> Tree:
    order = jnp.argsort(-pool_score, stable=True)  # best first; ties -> smaller index (parents first)
    kept = jnp.sort(order[: n - 1])  # pool indices, ascending: parents before children
    kept_score = pool_score[kept]
    valid = jnp.concatenate([jnp.ones((1,), bool), jnp.isfinite(kept_score)])
    tokens = jnp.concatenate([root[None], pool_tok[kept]]).astype(jnp.int32)
    ppool = pool_parent[kept]  # [n-1]
    pos = jnp.searchsorted(kept, jnp.maximum(ppool, 0))
    parent = jnp.where(ppool < 0, 0, pos + 1).astype(jnp.int32)
    parent = jnp.concatenate([jnp.zeros((1,), jnp.int32), parent])
    parent = jnp.where(valid, parent, 0)
    eye = jnp.eye(n, dtype=bool)

    def body(i, anc):
        return anc.at[i].set(anc[parent[i]] | eye[i])

    anc = jax.lax.fori_loop(1, n, body, eye)
    depth = anc.sum(-1).astype(jnp.int32) - 1
    return Tree(tokens=tokens, parent=parent, anc=anc, depth=depth, valid=valid)


def build_tree(root, beam: Beam, n: int) -> Tree:
    """Rerank the pool by cumulative log-prob and keep the best n-1 nodes under the root. root: [B]."""
    return jax.vmap(lambda r, t, s, p: _build_one(r, t, s, p, n))(root, beam.pool_tok, beam.pool_score,
                                                                  beam.pool_parent)
