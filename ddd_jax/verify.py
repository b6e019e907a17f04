"""Tree verification: greedy longest-accepted-path and EAGLE's lossless multi-candidate rejection sampling.

Both take the target's logits over the tree slots and return an `Accept`: the accepted path (tree slots,
root first), how many slots it has, and the tokens it emits (the accepted drafts plus one bonus token).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .layers import greedy_token
from .tree import Tree


@jax.tree_util.register_dataclass
@dataclass
class Accept:
    path: jax.Array  # [B, M] int32 tree slots of the accepted path, root first (padded with 0)
    n: jax.Array  # [B] int32 path length incl. the root (= tokens emitted this cycle)
    emitted: jax.Array  # [B, M] int32 accepted draft tokens then the bonus token (first n are real)


def process_logits(logits, temperature: float, top_p: float):
    """Log-probs after temperature and top-p (nucleus) filtering; the same function serves vanilla sampling
    and tree verification so both sample from exactly the same distribution. logits: [..., V]."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    if top_p < 1.0:
        srt = jnp.sort(lp, axis=-1)[..., ::-1]
        cum = jnp.cumsum(jnp.exp(srt), axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        n_keep = jnp.sum(cum - jnp.exp(srt) < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
        lp = jnp.where(lp >= cutoff, lp, -jnp.inf)
        lp = jax.nn.log_softmax(lp, axis=-1)
    return lp


def _path_from(deepest, anc, depth, M: int):
    on_path = anc[deepest]  # [N]
    idx = jnp.where(on_path, depth, M)  # out of range -> dropped
    N = anc.shape[0]
    return jnp.zeros((M,), jnp.int32).at[idx].set(jnp.arange(N, dtype=jnp.int32), mode="drop")


def _emitted(tokens, path, n, bonus, M: int):
    nxt = jnp.concatenate([tokens[path[1:]], jnp.zeros((1,), jnp.int32)])
    return nxt.at[n - 1].set(bonus).astype(jnp.int32)


def accept_greedy(tree: Tree, logits, M: int, pred=None) -> Accept:
    """A node is accepted iff its token is the argmax of its parent's logits and its parent is accepted.
    logits: [B, N, V], or None with pred. pred: optional [B, N] int32 greedy tokens of `logits`
    (`greedy_token(logits)`), when the forward computed them (greedy decoding's forwards return only those)."""
    pred = greedy_token(logits) if pred is None else pred

    def one(tokens, parent, anc, depth, valid, pred):  # pred [N]
        correct = (tokens == pred[parent]) & valid
        correct = correct.at[0].set(True)
        accepted = ~jnp.any(anc & ~correct[None, :], axis=-1)  # all ancestors-or-self correct (matmul-free)
        deepest = jnp.argmax(jnp.where(accepted, depth, -1))
        n = depth[deepest] + 1
        path = _path_from(deepest, anc, depth, M)
        return Accept(path=path, n=n.astype(jnp.int32), emitted=_emitted(tokens, path, n, pred[deepest], M))

    return jax.vmap(one)(tree.tokens, tree.parent, tree.anc, tree.depth, tree.valid, pred)


def accept_sample(tree: Tree, logits, key, temperature: float, top_p: float, M: int, draws: int | None = None) -> Accept:
    """EAGLE's lossless multi-candidate rejection sampling with deterministic (top-k) draft candidates.

    Walk from the root: at node c with target distribution p (temperature/top-p processed), try c's
    children in slot order; child x is accepted with probability p(x) (the draft proposal counts as
    q(x) = 1, since the candidates are a deterministic function of the draft); on rejection p(x) <- 0 and
    p is renormalised. If a child is accepted, descend; if every child is rejected, the bonus token is drawn
    from the residual p; at a leaf, from the fresh p of the leaf. The output distribution equals sampling
    from the target token by token. draws: how many uniforms to draw (default: the tree's slots), so a tree cut
    to its first slots (`tree.truncate`) draws the same numbers as the whole tree.
    """
    N = tree.tokens.shape[1]
    draws = N if draws is None else draws

    def one(tokens, parent, depth, valid, lg, k):
        logp = process_logits(lg, temperature, top_p)  # [N, V]
        k_u, k_bonus = jax.random.split(k)
        u = jax.random.uniform(k_u, (draws,))[:N]

        def level(carry):
            cur, p, path, n, stop = carry
            def try_child(i, c):
                p, acc = c
                cand = (parent[i] == cur) & valid[i] & (acc < 0)
                px = p[tokens[i]]
                ok = cand & (u[i] <= px)
                rej = cand & ~ok
                p = jnp.where(rej, p.at[tokens[i]].set(0.0), p)
                p = jnp.where(rej, p / jnp.maximum(p.sum(), 1e-30), p)
                acc = jnp.where(ok, i, acc)
                return p, acc

            p, acc = jax.lax.fori_loop(1, N, try_child, (p, jnp.int32(-1)))
            path = jnp.where(acc >= 0, path.at[n].set(acc), path)
            n = jnp.where(acc >= 0, n + 1, n)
            new_cur = jnp.where(acc >= 0, acc, cur)
            # bonus distribution: residual p if children were all rejected, fresh p at a leaf
            fresh = jnp.exp(logp[new_cur])
            p_next = jnp.where(acc >= 0, fresh, p)
            stop = acc < 0
            return new_cur, p_next, path, n, stop

        p0 = jnp.exp(logp[0])
        init = (jnp.int32(0), p0, jnp.zeros((M,), jnp.int32), jnp.int32(1), jnp.bool_(False))
        cur, p, path, n, _ = jax.lax.while_loop(lambda c: ~c[4], level, init)
        bonus = jax.random.categorical(k_bonus, jnp.log(jnp.maximum(p, 0.0))).astype(jnp.int32)
        return Accept(path=path, n=n, emitted=_emitted(tokens, path, n, bonus, M))

    keys = jax.random.split(key, tree.tokens.shape[0])
    return jax.vmap(one)(tree.tokens, tree.parent, tree.depth, tree.valid, logits, keys)
