"""A learned acceptance output (SpecDec++, per node), fitted and judged on recorded pools, where labels cost nothing.

It predicts q = P(a drafted node is accepted | its parent was) from what drafted the node: the head's predicted
feature at the parent (`pool_records(hidden=True)`'s "h"), the entropy of the parent's distribution, and the node's
own log-prob under it, its rank among its siblings, its parent's cumulative score and its depth. A node's
probability of being accepted is the product of q along its path (`path_probs`), which `Replay(probs=...)` and the
gain rule's arithmetic (`gain.ranked(pool_p=...)`) read in place of the calibration table.

The model: logit = a(h)[rank] + w . x + c, where a is a small MLP of the parent's feature with one output per
sibling rank (one evaluation per expanded node, as a decode would run it once per beam node and step) and x the
node's scalar inputs, standardised. kind "dist" leaves a out (the scalars only); "hidden" keeps it.
Fitted by full-batch Adam on a logistic loss with L2, the step kept where a validation split's loss is lowest.

Axis letters: C cycles, P pool, X expanded nodes (1 + max_depth * k), D feature width, F scalar inputs, H hidden.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("dist", "hidden")


def _onehot(i, n):
    return (np.asarray(i)[..., None] == np.arange(n)).astype(np.float32)


def scalar_inputs(records: dict) -> np.ndarray:
    """[C, P, F] float32 per node: own log-prob under its parent's distribution, the parent's cumulative score,
    that distribution's entropy, rank among siblings (one-hot k) and depth (one-hot max_depth + 1)."""
    score, parent = records["score"], records["parent"]
    k, R = int(records["top_k"]), int(records["max_depth"])
    depth = np.asarray(records["depth"])
    pscore = np.where(parent >= 0, np.take_along_axis(score, np.maximum(parent, 0), axis=1), 0.0)
    local = np.where(np.isfinite(score), score - pscore, -30.0)
    pscore = np.where(np.isfinite(pscore), pscore, -30.0)
    C, P = score.shape
    ent = records["ent"][:, records["expanded"]]
    cols = [local[..., None], pscore[..., None], ent[..., None],
            np.broadcast_to(_onehot(_rank_of(records), k)[None], (C, P, k)),
            np.broadcast_to(_onehot(depth - 1, R + 1)[None], (C, P, R + 1))]
    return np.concatenate(cols, axis=-1).astype(np.float32)


def conditional_labels(records: dict) -> tuple[np.ndarray, np.ndarray]:
    """(label [C, P] bool: accepted, known [C, P] bool: the node is drafted and its parent accepted (or it is a
    child of the root): where P(accepted | parent accepted) is observed)."""
    acc, parent = records["accepted"], records["parent"]
    pacc = np.where(parent >= 0, np.take_along_axis(acc, np.maximum(parent, 0), axis=1), True)
    return acc, pacc & np.isfinite(records["score"])


@dataclass(frozen=True)
class AcceptanceModel:
    """A fitted acceptance output: `kind`, the scalar inputs' mean/std [F], and params (w [F], c [], and for
    "hidden" the features' mean/std h_mean, h_std [D], W1 [D, H], b1 [H], W2 [H, k])."""

    kind: str
    mean: np.ndarray  # [F]
    std: np.ndarray  # [F]
    params: dict


def _logits(params, kind, h, x, rank_of, expanded):
    """[C, P] logits. h [C, X, D], x [C, P, F] standardised, rank_of [P], expanded [P]."""
    z = x @ params["w"] + params["c"]
    if kind == "hidden":
        hs = (h - params["h_mean"]) / params["h_std"]  # a few feature dimensions run 20x wider than the rest
        a = jax.nn.relu(hs @ params["W1"] + params["b1"]) @ params["W2"]  # [C, X, k]
        z = z + a[:, expanded, rank_of]
    return z


def _init(kind, F, D, k, hidden, seed):
    key = jax.random.PRNGKey(seed)
    p = {"w": jnp.zeros((F,), jnp.float32), "c": jnp.zeros((), jnp.float32)}
    if kind == "hidden":
        k1, k2 = jax.random.split(key)
        p["W1"] = jax.random.normal(k1, (D, hidden), jnp.float32) / np.sqrt(D)
        p["b1"] = jnp.zeros((hidden,), jnp.float32)
        p["W2"] = jax.random.normal(k2, (hidden, k), jnp.float32) * 0.01
    return p


def _rank_of(records):
    """[P] each slot's rank among its siblings (the root's children: their own index)."""
    k, P = int(records["top_k"]), len(records["depth"])
    return np.where(np.asarray(records["depth"]) == 1, np.arange(P), (np.arange(P) - k) % k).astype(np.int32)


def fit(records: dict, kind: str = "hidden", *, val_fraction: float = 0.2, steps: int = 1500, lr: float = 3e-3,
        l2: float = 1e-4, hidden: int = 32, seed: int = 0, progress: bool = False) -> tuple[AcceptanceModel, dict]:
    """Fit on `records` (`pool_records(hidden=True)`); the last `val_fraction` of its prompts validate, and the
    parameters of the step with the lowest validation loss are kept. Returns (model, {"train_loss", "val_loss",
    "best_step", "train_nodes", "val_nodes"})."""
    if kind not in KINDS:
        raise ValueError(f"acceptance output kind {kind!r}: expected one of {KINDS}")
    for key in ("ent", "parent", "expanded") + (("h",) if kind == "hidden" else ()):
        if key not in records:
            raise ValueError(f"records carry no {key!r}: record them with pool_records(..., hidden=True)")
    x = scalar_inputs(records)
    y, known = conditional_labels(records)
    prompts = np.unique(records["prompt"])
    if len(prompts) < 2:
        raise ValueError("fit: the records hold one prompt; a validation split needs at least two")
    cut = prompts[min(max(1, int(round(len(prompts) * (1 - val_fraction)))), len(prompts) - 1)]
    tr = (records["prompt"] < cut)[:, None] & known
    va = (records["prompt"] >= cut)[:, None] & known
    mean = x[tr].mean(0)
    std = x[tr].std(0) + 1e-3
    data = {"x": jnp.asarray((x - mean) / std), "y": jnp.asarray(y, jnp.float32),
            "tr": jnp.asarray(tr, jnp.float32), "va": jnp.asarray(va, jnp.float32),
            "h": jnp.asarray(records["h"], jnp.float32) if kind == "hidden" else None}
    rank_of, expanded = _rank_of(records), np.asarray(records["expanded"])
    k = int(records["top_k"])
    params = _init(kind, x.shape[-1], records["h"].shape[-1] if kind == "hidden" else 0, k, hidden, seed)
    fixed = {}
    if kind == "hidden":  # the features' standardisation, from the training nodes' drafting rows (not trained)
        rows = np.asarray(records["h"][records["prompt"] < cut], np.float32).reshape(-1, records["h"].shape[-1])
        fixed = {"h_mean": jnp.asarray(rows.mean(0)), "h_std": jnp.asarray(rows.std(0) + 1e-3)}

    def loss(p, d, mask):
        z = _logits(p | fixed, kind, d["h"], d["x"], rank_of, expanded)
        return jnp.sum(mask * (jax.nn.softplus(z) - d["y"] * z)) / jnp.maximum(jnp.sum(mask), 1.0)

    def objective(p, d):
        reg = sum(jnp.sum(v ** 2) for n, v in p.items() if n in ("w", "W1", "W2"))
        return loss(p, d, d["tr"]) + l2 * reg

    @jax.jit
    def update(p, m, v, t, d):
        g = jax.grad(objective)(p, d)
        m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
        v = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, v, g)
        p = jax.tree.map(lambda a, mm, vv: a - lr * (mm / (1 - 0.9 ** t)) / (jnp.sqrt(vv / (1 - 0.999 ** t)) + 1e-8),
                         p, m, v)
        return p, m, v

    val = jax.jit(lambda p, d: (loss(p, d, d["tr"]), loss(p, d, d["va"])))
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    best, best_p, best_step, hist = np.inf, params, 0, (np.nan, np.nan)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=steps, desc=f"acceptance output ({kind})", unit="step")
    for t in range(1, steps + 1):
        params, m, v = update(params, m, v, jnp.float32(t), data)
        if t % 25 == 0 or t == steps:
            tl, vl = (float(a) for a in val(params, data))
            if vl < best:
                best, best_p, best_step, hist = vl, params, t, (tl, vl)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    model = AcceptanceModel(kind, mean, std, {n: np.asarray(a) for n, a in (best_p | fixed).items()})
    return model, {"train_loss": hist[0], "val_loss": hist[1], "best_step": best_step,
                   "train_nodes": int(tr.sum()), "val_nodes": int(va.sum())}


def conditional_probs(model: AcceptanceModel, records: dict) -> np.ndarray:
    """[C, P] q = P(accepted | parent accepted) of every node of `records` (0 where not drafted)."""
    x = (scalar_inputs(records) - model.mean) / model.std
    h = jnp.asarray(records["h"], jnp.float32) if model.kind == "hidden" else None
    params = {n: jnp.asarray(a) for n, a in model.params.items()}
    z = np.asarray(_logits(params, model.kind, h, jnp.asarray(x), _rank_of(records),
                           np.asarray(records["expanded"])))
    return np.where(np.isfinite(records["score"]), 1.0 / (1.0 + np.exp(-z)), 0.0).astype(np.float32)


def path_probs(q: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """[C, P] P(accepted) of each node: the product of q along its path from the root (parents come first)."""
    p = q.astype(np.float64).copy()
    rows = np.arange(len(q))
    for i in range(q.shape[1]):
        par = parent[:, i]
        has = par >= 0
        p[has, i] *= p[rows[has], par[has]]
    return p.astype(np.float32)


def auc(p: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half)."""
    p, y = np.asarray(p, np.float64), np.asarray(y, bool)
    npos, nneg = int(y.sum()), int((~y).sum())
    if npos == 0 or nneg == 0:
        return float("nan")
    order = np.argsort(p, kind="stable")
    ranks = np.empty(len(p))
    sp = p[order]
    # average ranks over ties
    start = np.r_[0, np.flatnonzero(np.diff(sp)) + 1]
    end = np.r_[start[1:], len(sp)]
    avg = (start + end - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, end - start)
    return float((ranks[y].sum() - npos * (npos + 1) / 2.0) / (npos * nneg))


def judge(probs: np.ndarray, records: dict, cond: np.ndarray | None = None) -> dict:
    """How well per-node probabilities [C, P] predict acceptance on `records`: AUC, Brier and log loss over every
    drafted node, predicted and observed accepted nodes per cycle, and (given conditional probabilities `cond`)
    the conditional AUC over the nodes whose parent was accepted."""
    ok = np.isfinite(records["score"])
    p, y = np.clip(probs[ok], 1e-6, 1 - 1e-6), records["accepted"][ok]
    out = {"auc": auc(p, y), "brier": float(np.mean((p - y) ** 2)),
           "log_loss": float(-np.mean(y * np.log(p) + (~y) * np.log(1 - p))),
           "predicted_per_cycle": float(p.sum() / len(ok)), "observed_per_cycle": float(y.sum() / len(ok))}
    if cond is not None:
        lab, known = conditional_labels(records)
        out["cond_auc"] = auc(cond[known], lab[known])
    return out
