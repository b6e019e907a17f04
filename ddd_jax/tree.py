"""EAGLE-2 dynamic draft trees with static shapes: beam expansion bookkeeping, rerank, tree mask / depths / parents.

Step numbering (see `TreeConfig`): step 0 is the head forward over the newly committed prefix and gives the
top_k depth-1 candidates (the first beam); step j >= 1 runs the head on the depth-j beam and gives top_k**2
depth-(j+1) candidates, of which the best top_k (by cumulative log-prob) form the next beam.

The candidate pool is laid out by step: pool[0:k] are step-0 candidates, pool[k + (j-1)k^2 + i*k + c] is child c
of beam node i at step j. A parent therefore always has a smaller pool index than its children, and
(children's cumulative log-prob <= parent's) a stable sort by (-score, index) keeps every kept set
ancestor-closed, i.e. a tree. Pool entries of steps never run have score -inf and are never preferred over
real ones.

Lookup candidates (`TreeConfig.lookup`) are appended after the head's entries (`add_lookup`), each after its
parent and scoring at most its parent, so the same rerank keeps them in a tree.

Axis letters: B batch, k top_k, P pool size, W = max_depth*k draft scratch slots, N total_tokens.
"""
from __future__ import annotations

import dataclasses
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
    ent: jax.Array | None = None  # [B, k] float32 entropy (nats) of the draft distribution each beam node's token
    # was drawn from (its parent's; DDD rule "adaedl"); None when not tracked (`first_beam(..., entropy=False)`)


@jax.tree_util.register_dataclass
@dataclass
class Tree:
    """The verified tree: slot 0 is the root (last emitted token), slots 1.. the kept draft nodes."""

    tokens: jax.Array  # [B, N] int32
    parent: jax.Array  # [B, N] int32 tree slot of the parent (root: 0)
    anc: jax.Array  # [B, N, N] bool ancestor-or-self matrix (the tree attention mask)
    depth: jax.Array  # [B, N] int32 (root 0); verify positions = prefix length + depth
    valid: jax.Array  # [B, N] bool (False only if the pool had fewer finite candidates than N-1); the valid
    # slots come first: slots [0, valid.sum()) (`verify_rows`)


def pool_size(k: int, max_depth: int) -> int:
    return k + max_depth * k * k


def draft_entropy(logp):
    """[...] Shannon entropy in nats of distributions given as log-probs [..., V] (-inf entries count 0)."""
    return -jnp.sum(jnp.where(jnp.isfinite(logp), jnp.exp(logp) * logp, 0.0), axis=-1).astype(jnp.float32)


def first_beam(logp, h0, k: int, max_depth: int, tok_map=None, entropy: bool = False) -> Beam:
    """Beam after step 0. logp: [B, V] draft log-probs at the prefix's last pair; h0: [B, D] its output feature.
    tok_map: optional [V'] target ids of a reduced draft vocabulary (logp is then over V'). entropy: also keep
    each beam node's draft entropy (`Beam.ent`; here the root's distribution's, the same for all k); `expand`
    then keeps it too."""
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
                anc=anc, pool_tok=pool_tok, pool_score=pool_score, pool_parent=pool_parent,
                ent=jnp.broadcast_to(draft_entropy(logp)[:, None], (B, k)) if entropy else None)


def expand(beam: Beam, h, logp, k: int, max_depth: int, tok_map=None) -> Beam:
    """Bookkeeping of step j = beam.step + 1 given the head's outputs on the beam.

    h: [B, k, D] predicted features of the beam nodes; logp: [B, k, V] their children's log-probs.
    Sequences with active=False add nothing (their new pool entries stay -inf) and keep their beam.
    When the beam keeps entropies (`Beam.ent`), each new beam node gets the entropy of its parent's logp row.
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
    ent = None if beam.ent is None else pick(jnp.take_along_axis(draft_entropy(logp), src, axis=1), beam.ent)
    return Beam(step=j, depth=beam.depth + act.astype(jnp.int32), active=act,
                tok=pick(new_tok, beam.tok), feat=pick(new_feat, beam.feat), score=pick(top_score, beam.score),
                pool_idx=pick((base + top_i).astype(jnp.int32), beam.pool_idx), anc=pick(new_anc, beam.anc),
                pool_tok=pool_tok, pool_score=pool_score, pool_parent=pool_parent, ent=ent)


def confidence(beam: Beam):
    """DDD confidence [B]: log of the total probability of the current beam's sequences."""
    return jax.nn.logsumexp(beam.score, axis=-1)


# ----------------------------------------------------------------------------------------------- context lookup
def lookup_chain(ctx, pos, length: int, ngram: int, max_ngram: int):
    """Prompt-lookup candidates (Saxena 2023), with static shapes. ctx: [B, C] int32 tokens by position (prompt,
    then emitted tokens; entries past `pos` are ignored); pos: [B] int32 position of the root (the last emitted
    token, ctx[pos]). For n = max_ngram .. ngram, find the most recent j < pos with ctx[j-n+1 .. j] ==
    ctx[pos-n+1 .. pos]; the longest n that matches wins. Returns (tok [B, length] = ctx[j+1 .. j+length],
    ok [B, length] bool: a match exists and the token is known, i.e. j + 1 + t <= pos)."""
    C = ctx.shape[1]

    def one(c, i):
        j = jnp.arange(C)
        match = jnp.ones((C,), bool)
        best = jnp.int32(-1)
        found = [None] * (max_ngram + 1)
        for d in range(max_ngram):  # match now: suffixes of length d + 1 agree at j
            here = jnp.take(c, jnp.clip(j - d, 0, C - 1)) == c[jnp.clip(i - d, 0, C - 1)]
            match = match & here & (j - d >= 0) & (i - d >= 0)
            found[d + 1] = jnp.max(jnp.where(match & (j < i), j, -1)).astype(jnp.int32)
        for n in range(ngram, max_ngram + 1):  # longer matches override shorter ones
            best = jnp.where(found[n] >= 0, found[n], best)
        t = best + 1 + jnp.arange(length, dtype=jnp.int32)
        ok = (best >= 0) & (t <= i)
        return jnp.where(ok, jnp.take(c, jnp.clip(t, 0, C - 1)), 0).astype(jnp.int32), ok

    return jax.vmap(one)(ctx, pos)


def add_lookup(beam: Beam, tok, ok, logp: float, k: int) -> Beam:
    """The pool with a lookup chain appended (`lookup_chain`'s tok, ok: [B, c]): entry t descends from entry t-1,
    the first from the root -- or, when the first token is one of the head's step-0 candidates (pool[0:k]), the
    chain continues under that candidate and its own first entry stays empty. Entry t scores min(parent score,
    (t + 1) * logp) on the head's scale of cumulative log-probs, never above its parent, so the rerank keeps the
    kept set ancestor-closed (see the module docstring)."""
    B, c = tok.shape
    P = beam.pool_tok.shape[1]
    head_tok, head_score = beam.pool_tok[:, :k], beam.pool_score[:, :k]
    same = (head_tok == tok[:, :1]) & jnp.isfinite(head_score) & ok[:, :1]  # [B, k]
    dup = jnp.any(same, axis=1)
    dup_i = jnp.argmax(same, axis=1).astype(jnp.int32)
    dup_score = jnp.take_along_axis(head_score, dup_i[:, None], axis=1)[:, 0]
    own = (jnp.arange(1, c + 1, dtype=jnp.float32) * logp)[None, :]  # [1, c]
    first = jnp.where(dup, dup_score, own[:, 0])
    # running min along the chain: entry t <= entry t-1 <= ... <= the first (or the head candidate it sits under)
    score = jax.lax.cummin(jnp.concatenate([first[:, None], jnp.broadcast_to(own[:, 1:], (B, c - 1))], axis=1), axis=1)
    score = jnp.where(ok, score, NEG)
    score = score.at[:, 0].set(jnp.where(dup, NEG, score[:, 0]))
    parent = P + jnp.arange(c, dtype=jnp.int32)[None, :] - 1  # the previous chain entry
    parent = jnp.broadcast_to(parent, (B, c)).at[:, 0].set(-1)
    if c > 1:
        parent = parent.at[:, 1].set(jnp.where(dup, dup_i, P))
    return dataclasses.replace(beam, pool_tok=jnp.concatenate([beam.pool_tok, tok.astype(jnp.int32)], axis=1),
                               pool_score=jnp.concatenate([beam.pool_score, score.astype(jnp.float32)], axis=1),
                               pool_parent=jnp.concatenate([beam.pool_parent, parent], axis=1))


def _build_one(root, pool_tok, pool_score, pool_parent, n: int) -> Tree:
    P = pool_tok.shape[0]
    order = jnp.argsort(-pool_score, stable=True)  # best first; ties -> smaller index (parents first)
    # the kept nodes, real ones first, each group by ascending pool index: parents before children, and the real
    # nodes in slots [0, count) so that a narrower verify forward over the first slots holds all of them
    key = jnp.sort(jnp.where(jnp.isfinite(pool_score[order[: n - 1]]), 0, P) + order[: n - 1])
    kept = key % P
    kept_score = pool_score[kept]
    valid = jnp.concatenate([jnp.ones((1,), bool), jnp.isfinite(kept_score)])
    tokens = jnp.concatenate([root[None], pool_tok[kept]]).astype(jnp.int32)
    ppool = pool_parent[kept]  # [n-1]
    pos = jnp.searchsorted(key, jnp.maximum(ppool, 0))  # a real node's parent is real: among the first slots
    parent = jnp.where(ppool < 0, 0, pos + 1).astype(jnp.int32)
    parent = jnp.concatenate([jnp.zeros((1,), jnp.int32), parent])
    parent = jnp.where(valid, parent, 0)
    eye = jnp.eye(n, dtype=bool)

    def body(i, anc):
        return anc.at[i].set(anc[parent[i]] | eye[i])

    anc = jax.lax.fori_loop(1, n, body, eye)
    depth = anc.sum(-1).astype(jnp.int32) - 1
    return Tree(tokens=tokens, parent=parent, anc=anc, depth=depth, valid=valid)


def truncate(tree: Tree, rows: int) -> Tree:
    """The first `rows` slots of `tree` (all its valid nodes when rows >= `verify_rows`)."""
    return Tree(tokens=tree.tokens[:, :rows], parent=tree.parent[:, :rows], anc=tree.anc[:, :rows, :rows],
                depth=tree.depth[:, :rows], valid=tree.valid[:, :rows])


def verify_rows(tree: Tree):
    """[B] int32 slots each tree needs verified: the root and its valid nodes (which come first)."""
    return jnp.sum(tree.valid, axis=1).astype(jnp.int32)


def build_tree(root, beam: Beam, n: int) -> Tree:
    """Rerank the pool by cumulative log-prob and keep the best n-1 nodes under the root. root: [B]."""
    return jax.vmap(lambda r, t, s, p: _build_one(r, t, s, p, n))(root, beam.pool_tok, beam.pool_score,
                                                                  beam.pool_parent)
