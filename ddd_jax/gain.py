"""The expected-gain DDD rule on the device (`DDDConfig(rule="gain")`, its inputs a `GainModel`): how much a cycle's
tree is expected to yield at calibrated acceptance probabilities, what it costs on this host, whether one more draft
step pays, and how many rows to verify. Pure functions over a `tree.Beam`, or over plain [B, P] pool arrays
(`signal`, `kept_nodes`): `measure.node_acceptance.Replay` calls the same functions on recorded pools (for
calibration's predictions).

A node's calibrated probability p is `GainModel.accept[depth - 1][score bin]`. Greedy verification accepts at most
one node per depth, and the nodes it accepts form the accepted path, so a tree keeping the m best-scored nodes
(an ancestor-closed set: `tree` module docstring) yields E = 1 + sum of their p tokens in expectation. After j
steps, a verify width w keeps m = min(w - 1, N - 1, drafted) nodes and costs C = t(w) + d (1 + j) + fixed.

* Width: the compiled width maximising E - rate * C (rate: the tokens per ms the decode reaches, `GainModel.rate`,
  so every row must earn its time at that rate; rate 0: E / C, the cycle's own ratio).
* Depth: one more step is expected to add g = cont[j] * sum of the beam's p (its children continue an accepted
  beam node that often), minus what its nodes would push out of a full tree, for d plus the rows it adds. The
  signal log(g) - log(cost * rate) is compared with `DDDConfig.threshold` (0: break even) at each check step, in
  every sync mode alike.

Axis letters: B batch, P pool, k beam, Wn compiled widths.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from .config import GainModel
from .tree import Beam


def pool_depths(k: int, max_depth: int) -> np.ndarray:
    """[P] depth of each slot of the head's candidate pool (`tree` layout: pool[0:k] depth 1, step j's k*k
    children depth j + 1)."""
    return np.concatenate([np.ones(k, np.int32)] + [np.full(k * k, j + 1, np.int32) for j in range(1, max_depth + 1)])


def _probs(gm: GainModel, score, depth):
    """Calibrated P(accepted) of nodes with cumulative log-prob `score` at `depth` (broadcast; -inf -> 0)."""
    acc = jnp.asarray(gm.accept, jnp.float32)
    b = jnp.searchsorted(jnp.asarray(gm.score_edges, jnp.float32), score, side="right")
    d = jnp.clip(depth - 1, 0, acc.shape[0] - 1)
    return jnp.where(jnp.isfinite(score), acc[d, b], 0.0)


def ranked(gm: GainModel, pool_score, k: int, max_depth: int, pool_p=None):
    """(order [B, P] best first (stable), cumulative p along it [B, P + 1], drafted nodes [B]) of a pool laid out
    as `pool_depths(k, max_depth)`.

    pool_p [B, P]: each node's P(accepted) given by a learned acceptance output (0 where not drafted), ranked by it
    (a child's is never above its parent's, so the best m stay ancestor-closed); None: the table's, by score."""
    if pool_p is None:
        depth = jnp.asarray(pool_depths(k, max_depth))
        p = _probs(gm, pool_score, depth[None])
        order = jnp.argsort(-pool_score, axis=1, stable=True)
    else:
        p = jnp.where(jnp.isfinite(pool_score), pool_p, 0.0)
        order = jnp.argsort(-jnp.where(jnp.isfinite(pool_score), pool_p, -1.0), axis=1, stable=True)
    cum = jnp.cumsum(jnp.take_along_axis(p, order, axis=1), axis=1)
    cum = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum], axis=1)
    return order, cum, jnp.sum(jnp.isfinite(pool_score), axis=1)


def best_width(gm: GainModel, cum, drafted, steps, total_tokens: int):
    """Per sequence: (index into gm.widths, expected tokens E, cost C in ms, nodes kept m) of the best width after
    `steps` [B] draft steps (E - rate * C, or E / C at rate 0)."""
    ws = jnp.asarray(gm.widths, jnp.int32)
    m = jnp.minimum(jnp.minimum(ws[None] - 1, total_tokens - 1), drafted[:, None])  # [B, Wn]
    E = 1.0 + jnp.take_along_axis(cum, m, axis=1)
    C = jnp.asarray(gm.verify_ms, jnp.float32)[None] + gm.draft_ms * (1 + steps[:, None]) + gm.fixed_ms
    wi = jnp.argmax(E - gm.rate * C if gm.rate > 0 else E / C, axis=1)
    pick = lambda x: jnp.take_along_axis(x, wi[:, None], axis=1)[:, 0]  # noqa: E731
    return wi, pick(E), pick(C), pick(m)


def signal(gm: GainModel, pool_score, beam_score, step, steps, total_tokens: int, max_depth: int, pool_p=None,
           beam_p=None):
    """[B] float32: log(expected tokens one more step adds) - log(its cost in ms * rate); -inf when it adds none.

    pool_score [B, P] (`pool_depths(k, max_depth)` layout; -inf: not drafted), beam_score [B, k] the beam's
    cumulative log-probs (its nodes at depth step + 1), step: draft steps done (scalar), steps [B] per sequence.
    pool_p [B, P], beam_p [B, k]: learned probabilities in place of the table's (`ranked`).
    `step_signal` over a decode's `Beam`; `measure.node_acceptance.Replay` over recorded pools."""
    k = beam_score.shape[1]
    _, cum, drafted = ranked(gm, pool_score, k, max_depth, pool_p)
    wi, E, C, m = best_width(gm, cum, drafted, steps, total_tokens)
    cont = jnp.asarray(gm.cont, jnp.float32)[jnp.minimum(step, len(gm.cont) - 1)]
    bp = _probs(gm, beam_score, step + 1) if beam_p is None else jnp.where(jnp.isfinite(beam_score), beam_p, 0.0)
    g = cont * jnp.sum(bp, axis=1)
    ws, t = jnp.asarray(gm.widths, jnp.int32), jnp.asarray(gm.verify_ms, jnp.float32)
    rows = jnp.minimum(total_tokens, ws[wi] + k)
    nxt = jnp.minimum(jnp.sum(ws[None] < rows[:, None], axis=1), len(gm.widths) - 1)
    over = jnp.maximum(0, ws[wi] + k - total_tokens)  # nodes of a full tree the new ones would push out
    lost = (jnp.take_along_axis(cum, m[:, None], axis=1) - jnp.take_along_axis(cum, jnp.maximum(m - over, 0)[:, None],
                                                                               axis=1))[:, 0]
    g = g - lost
    cost = gm.draft_ms + t[nxt] - t[wi]
    rate = gm.rate if gm.rate > 0 else E / C
    sig = jnp.log(jnp.maximum(g, 1e-30)) - jnp.log(jnp.maximum(cost * rate, 1e-30))
    return jnp.where(g > 0, sig, -jnp.inf).astype(jnp.float32)


def step_signal(gm: GainModel, beam: Beam, total_tokens: int, max_depth: int):
    """[B] float32: `signal` of a decode's beam."""
    return signal(gm, beam.pool_score, beam.score, beam.step, beam.depth, total_tokens, max_depth)


def kept_nodes(gm: GainModel, pool_score, steps, k: int, total_tokens: int, max_depth: int, pool_p=None):
    """(order [B, P] best first, nodes kept m [B]): the m best nodes of each pool that its best width verifies
    after `steps` [B] draft steps (pool_p: `ranked`)."""
    order, cum, drafted = ranked(gm, pool_score, k, max_depth, pool_p)
    _, _, _, m = best_width(gm, cum, drafted, steps, total_tokens)
    return order, m


def keep_best_width(gm: GainModel, beam: Beam, total_tokens: int, max_depth: int) -> Beam:
    """The beam with every pool entry past each sequence's best width's m best nodes set to -inf (the tree then
    holds those m; the rest of its slots are invalid and never verified)."""
    order, m = kept_nodes(gm, beam.pool_score, beam.depth, beam.tok.shape[1], total_tokens, max_depth)
    rank = jnp.argsort(order, axis=1)
    return dataclasses.replace(beam, pool_score=jnp.where(rank < m[:, None], beam.pool_score, -jnp.inf))
