"""EAGLE draft-head training loop: packed feature batches, the EAGLE objective, optax AdamW, orbax checkpoints, metrics.

Objective (EAGLE-1 `train/main.py`, which EAGLE-2 reuses unchanged). For a sequence with target features
f_0..f_{n-1} (final-normed last hidden states) and tokens x_0..x_{n-1}, position t = 0..n-2 holds the pair
(embed(x_{t+1}), f_t + u_t) and the head predicts g_t ~ f_{t+1}:

    u_t        ~ U(-0.5, 0.5)^D * noise              (noise = 0.2: EAGLE's "uniform" data noise with std=0.2;
                                                      EAGLE's code also scales it by 512/seq_len, we do not)
    vloss      = sum_t m_t * mean_d SmoothL1_{beta=1}(g_t - f_{t+1}) / sum_t m_t        (EAGLE's v_w = 1.0)
    p_t        = softmax(lm_head(f_{t+1}))                                              (soft labels, frozen)
    ploss      = -sum_t m_t * sum_v p_t[v] * log_softmax(lm_head(g_t))[v] / sum_t m_t   (EAGLE's p_w = 0.1)
    loss       = vloss + w_cls * ploss,   w_cls = 0.1

with m_t = loss mask of token x_{t+1} (assistant-turn tokens; every token for plain text). The target's
embedding and lm_head are shared and frozen (passed as arguments, never trained). With gradient accumulation
the sums run over all micro-batches before dividing, so the result equals one big batch. Reported top-1 accuracy
compares argmax lm_head(g_t) with the target's own argmax lm_head(f_{t+1}).

Differences from EAGLE's script, on purpose: gradient *norm* clipping (EAGLE clips values at 0.5), a cosine
schedule after warmup (EAGLE decays linearly), and sequences packed into fixed-length rows with a block-diagonal
causal mask (positions restart per sequence) instead of padding, so one jit shape serves the whole run; and an
optional `ce_positions` budget: the two vocab projections (87% of a step's FLOPs for a 49k vocab) are then
computed on that many random loss positions per row, weighted so the CE sum is an unbiased estimate.

Determinism: the data order of epoch e is a permutation drawn from (seed, e); the noise of step s comes from
fold_in(PRNGKey(seed), s). The batch of step s is a pure function of (seed, s), so `--resume` continues
bit-for-bit from an orbax checkpoint (which holds params, optimizer state and the step).

Training state: the head as an `EagleHeadModule` and an `nnx.Optimizer(head, tx, wrt=nnx.Param)` (optax
underneath), split once into (graphdef, state); the jitted step takes and donates the state's leaves and merges
them into the module inside the trace, so per-step overhead is a `jax.jit` call over ~40 arrays, not an `nnx.jit`
call. Checkpoints are that state, `{"model": nnx.State, "optimizer": nnx.State}`, saved with orbax.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ddd_jax import eagle, ops
from ddd_jax import io as dio
from ddd_jax.checkpoints.ours import save_draft
from ddd_jax.config import DraftConfig
from ddd_jax.modules import EagleHeadModule

from . import ttt
from .extract import FeatureSet


@dataclass(frozen=True)
class TrainConfig:
    """The fields every head fit shares: the packed batch, the optimizer recipe (AdamW, warmup then cosine decay to
    lr * end_lr_frac, global-norm clipping), the compute dtype (float32 master weights either way) and the seed."""

    steps: int = 1000
    batch_size: int = 2  # packed rows per micro-batch
    seq_len: int = 1024  # pairs (tokens) per packed row
    lr: float = 3e-4
    warmup: int = 50
    end_lr_frac: float = 0.05
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.0
    clip_norm: float = 0.5
    dtype: str = "float32"  # compute dtype ("bfloat16" on accelerators); master weights stay float32
    seed: int = 0

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"{type(self).__name__}.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FitConfig(TrainConfig):
    """Everything that determines an EAGLE-1/2 head's trained weights (stored next to the checkpoints; resume must
    match): `TrainConfig` plus the EAGLE objective's fields."""

    accum: int = 1  # micro-batches per optimizer step
    ttt_steps: int = 1  # K: draft steps unrolled in training (1: EAGLE's teacher-forced objective; `train_draft.ttt`)
    step_decay: float = 0.8  # weight of unrolled step k: step_decay**k (EAGLE-3's)
    w_cls: float = 0.1
    noise: float = 0.2
    init: str = "random"  # or "target-last-layer" or "head:<dir>" (warm start)
    ce_positions: int = 0  # >0: vocab terms (CE, top-1) from this many random loss positions per row (unbiased)

    def __post_init__(self):
        super().__post_init__()
        if self.ttt_steps < 1:
            raise ValueError(f"FitConfig.ttt_steps must be >= 1, got {self.ttt_steps}")


class Batch(NamedTuple):
    tokens: np.ndarray  # [A, B, L] int32   token_{t+1}
    feat_in: np.ndarray  # [A, B, L, D] float16  feature_t
    feat_tgt: np.ndarray  # [A, B, L, D] float16  feature_{t+1}
    mask: np.ndarray  # [A, B, L] float32  loss mask of token_{t+1} (0 on padding)
    positions: np.ndarray  # [A, B, L] int32  restart at 0 for every packed sequence
    segments: np.ndarray  # [A, B, L] int32  packed sequence number, 1-based (0 = padding)


# ---------------------------------------------------------------------------------------------- data order

def pack_rows(lengths: np.ndarray, order: np.ndarray, seq_len: int, min_free: int = 16) -> list[list[tuple[int, int]]]:
    """First-fit packing of sequences (in `order`) into rows of `seq_len` pairs.

    lengths[k] is the number of pairs of sequence k (tokens - 1), truncated to seq_len. Returns rows as lists
    of (sequence, n_pairs). Rows with fewer than `min_free` free slots are closed. Deterministic.
    """
    rows: list[list[tuple[int, int]]] = []
    free: list[int] = []
    open_rows: list[int] = []
    for k in order:
        n = int(min(lengths[k], seq_len))
        if n <= 0:
            continue
        for j, r in enumerate(open_rows):
            if free[r] >= n:
                break
        else:
            rows.append([])
            free.append(seq_len)
            r = len(rows) - 1
            open_rows.append(r)
            j = len(open_rows) - 1
        rows[r].append((int(k), n))
        free[r] -= n
        if free[r] < min_free:
            open_rows.pop(j)
    return rows


class BatchPlan:
    """The batch of every optimizer step, as a pure function of (seed, step): epoch e packs a fresh permutation."""

    def __init__(self, fs: FeatureSet, cfg: FitConfig, shuffle: bool = True):
        self.fs, self.cfg, self.shuffle = fs, cfg, shuffle
        self.lengths = np.diff(fs.offsets) - 1
        self._epochs: dict[int, list] = {}
        rows0 = self._rows(0)
        self.rows_per_step = cfg.batch_size * cfg.accum
        self.steps_per_epoch = len(rows0) // self.rows_per_step
        if self.steps_per_epoch == 0:
            raise ValueError(f"not enough data for one step: {len(rows0)} packed rows of {cfg.seq_len} pairs, "
                             f"but a step needs batch_size*accum = {self.rows_per_step}")

    def _rows(self, epoch: int):
        if epoch not in self._epochs:
            n = len(self.lengths)
            order = (np.random.default_rng([self.cfg.seed, epoch]).permutation(n) if self.shuffle
                     else np.arange(n))
            self._epochs = {epoch: pack_rows(self.lengths, order, self.cfg.seq_len)}
        return self._epochs[epoch]

    def epoch_of(self, step: int) -> float:
        return step / self.steps_per_epoch

    def batch(self, step: int) -> Batch:
        e, i = divmod(step, self.steps_per_epoch)
        rows = self._rows(e)[i * self.rows_per_step:(i + 1) * self.rows_per_step]
        return self.make(rows)

    def make(self, rows) -> Batch:
        cfg, fs = self.cfg, self.fs
        A, B, L, D = cfg.accum, cfg.batch_size, cfg.seq_len, fs.features.shape[1]
        R = len(rows)
        tok = np.zeros((R, L), np.int32)
        fin = np.zeros((R, L, D), np.float16)
        ftg = np.zeros((R, L, D), np.float16)
        msk = np.zeros((R, L), np.float32)
        pos = np.zeros((R, L), np.int32)
        seg = np.zeros((R, L), np.int32)
        for r, row in enumerate(rows):
            c = 0
            for s, (k, n) in enumerate(row):
                o = int(fs.offsets[k])
                tok[r, c:c + n] = fs.ids[o + 1:o + 1 + n]
                fin[r, c:c + n] = fs.features[o:o + n]
                ftg[r, c:c + n] = fs.features[o + 1:o + 1 + n]
                msk[r, c:c + n] = fs.mask[o + 1:o + 1 + n]
                pos[r, c:c + n] = np.arange(n)
                seg[r, c:c + n] = s + 1
                c += n
        shp = lambda x: x.reshape((A, B) + x.shape[1:]) if R == A * B else x[None]
        return Batch(*(shp(x) for x in (tok, fin, ftg, msk, pos, seg)))


def eval_rows(fs: FeatureSet, cfg: FitConfig, max_batches: int) -> list[Batch]:
    """Fixed held-out micro-batches (no shuffle), shaped [1, B, L] so they share one compiled eval step."""
    plan = BatchPlan.__new__(BatchPlan)
    plan.fs, plan.cfg, plan.shuffle = fs, dataclasses.replace(cfg, accum=1), False
    plan.lengths = np.diff(fs.offsets) - 1
    plan._epochs = {}
    rows = plan._rows(0)
    B = cfg.batch_size
    out = []
    for i in range(0, len(rows), B):
        chunk = rows[i:i + B]
        while len(chunk) < B:
            chunk = chunk + [[]]
        out.append(plan.make(chunk))
        if len(out) >= max_batches:
            break
    return out


# ---------------------------------------------------------------------------------------------- the objective

def smooth_l1(x):
    ax = jnp.abs(x)
    return jnp.where(ax < 1.0, 0.5 * x * x, ax - 0.5)


def packed_mask(segments):
    """[B, L] segment ids -> [B, L, L] causal mask within each packed sequence."""
    L = segments.shape[-1]
    causal = jnp.tril(jnp.ones((L, L), bool))
    same = segments[:, :, None] == segments[:, None, :]
    return causal[None] & same


def loss_sums(params, dcfg: DraftConfig, embed, lm_w, mb: Batch, key, noise: float, w_cls: float, dtype,
              ce_positions: int = 0, steps: int = 1, step_decay: float = 0.8, on_path: bool = False):
    """Unnormalised sums over one micro-batch [B, L]: (weighted loss sum, metrics sums).

    steps = 1: the EAGLE objective (module docstring). steps = K > 1: training-time test (`ttt.unroll`): step k
    reads the token x_{t+1+k} and the head's own output of step k-1, and is scored against the target's feature
    f_{t+1+k} and its soft labels, weighted step_decay**k; its metrics sums are `correct{k}` and `count{k}`
    (`vloss`, `ploss`, `correct`, `count` stay step 0's, and `count` normalises every step's loss).
    on_path (every position scored, no `ce_positions`): also `pcorrect{k}` and `pcount{k}` for k >= 1, top-1 at
    step k counted only where steps 0..k-1 of the same chain were all right -- the level-to-level acceptance a
    draft tree sees, as a drafted path ends at its first miss. (Free-running top-1 `correct{k}` also counts chains
    that already missed, which no tree keeps.)
    """
    if on_path and ce_positions:
        raise ValueError("loss_sums: on_path scores every position (ce_positions must be 0)")
    hits = []  # per step: top-1 right [B, L] (on_path)
    f_in = mb.feat_in.astype(jnp.float32)
    if noise:
        f_in = f_in + (jax.random.uniform(key, f_in.shape, jnp.float32) - 0.5) * noise
    p = jax.tree.map(lambda w: w.astype(dtype), params)
    seg, tgt_all = mb.segments, mb.feat_tgt.astype(jnp.float32)

    def step_loss(k, g):
        g = g.astype(jnp.float32)
        tgt = ttt.shift(tgt_all, k)  # f_{t+1+k}
        m = ttt.shift(mb.mask, k) * ((ttt.shift(seg, k) == seg) & (seg > 0))  # loss mask of x_{t+1+k}
        v = jnp.sum(m * jnp.mean(smooth_l1(g - tgt), axis=-1))
        w = m
        if ce_positions and ce_positions < m.shape[-1]:
            # Unbiased estimate of the vocab terms from `ce_positions` random loss positions per row (the lm_head
            # projections dominate the step's FLOPs): pick masked positions first, in random order, and weight
            # each pick by n_masked / n_picked.
            score = m + 0.5 * jax.random.uniform(jax.random.fold_in(key, 1 + k), m.shape)
            _, idx = jax.lax.top_k(score, ce_positions)  # [B, K]
            take = lambda x: jnp.take_along_axis(x, idx[..., None], axis=1)  # noqa: E731
            g, tgt = take(g), take(tgt)
            picked = jnp.take_along_axis(m, idx, axis=1)
            n = jnp.sum(m, axis=-1, keepdims=True)
            w = picked * n / jnp.maximum(jnp.sum(picked, axis=-1, keepdims=True), 1.0)
        logits = jnp.einsum("bld,dv->blv", g, lm_w, preferred_element_type=jnp.float32)
        t_logits = jax.lax.stop_gradient(jnp.einsum("bld,dv->blv", tgt, lm_w, preferred_element_type=jnp.float32))
        ce = -jnp.sum(jax.nn.softmax(t_logits, axis=-1) * jax.nn.log_softmax(logits, axis=-1), axis=-1)
        pl = jnp.sum(w * ce)
        hit = (jnp.argmax(logits, -1) == jnp.argmax(t_logits, -1)).astype(jnp.float32)
        correct = jnp.sum(w * hit)
        out = {"vloss": v, "ploss": pl, "correct": correct, "count": jnp.sum(m)}
        if on_path and k > 0:
            path = m * jnp.prod(jnp.stack(hits), axis=0)  # chains whose steps 0..k-1 were all right
            out.update(pcorrect=jnp.sum(path * hit), pcount=jnp.sum(path))
        if on_path:
            hits.append(hit)
        return v + w_cls * pl, out

    total, per = ttt.unroll(p, dcfg, embed.astype(dtype), mb.tokens, f_in.astype(dtype), mb.positions,
                            packed_mask(seg), steps, step_loss, step_decay)
    sums = {k: per[k + "0"] for k in SUM_KEYS}
    sums.update({f"{k}{j}": per[f"{k}{j}"] for j in range(1, steps) for k in ("correct", "count")})
    if on_path:
        sums.update({f"{k}{j}": per[f"{k}{j}"] for j in range(1, steps) for k in ("pcorrect", "pcount")})
    return total, sums


SUM_KEYS = ("vloss", "ploss", "correct", "count")


def sum_keys(steps: int) -> tuple:
    """The names of `loss_sums`' metrics sums for a `steps`-step objective."""
    return SUM_KEYS + tuple(f"{k}{j}" for j in range(1, steps) for k in ("correct", "count"))


def make_optimizer(cfg):
    """AdamW with warmup + cosine decay and global-norm clipping, from FitConfig's optimizer fields (lr, warmup,
    steps, end_lr_frac, b1, b2, weight_decay, clip_norm)."""
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(cfg.warmup, 1), max(cfg.steps, cfg.warmup + 1),
                                               end_value=cfg.lr * cfg.end_lr_frac)
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))
    return tx, sched


def metric_means(sums):
    """Means per loss token of `loss_sums`' sums: {"vloss", "ploss", "acc", "count"} (count: the loss tokens), and
    "acc{k}" of each later unrolled step k (top-1 on the head's own features of step k-1), and with on-path sums
    "acc_path{k}" (top-1 at step k where steps 0..k-1 were right: the level-to-level acceptance a tree sees)."""
    c = jnp.maximum(sums["count"], 1e-5)
    vl, pl = sums["vloss"] / c, sums["ploss"] / c
    out = {"vloss": vl, "ploss": pl, "acc": sums["correct"] / c, "count": sums["count"]}
    k = 1
    while f"count{k}" in sums:
        out[f"acc{k}"] = sums[f"correct{k}"] / jnp.maximum(sums[f"count{k}"], 1e-5)
        if f"pcount{k}" in sums:
            out[f"acc_path{k}"] = sums[f"pcorrect{k}"] / jnp.maximum(sums[f"pcount{k}"], 1e-5)
        k += 1
    return out


def make_train_step(graphdef: nnx.GraphDef, treedef, dcfg: DraftConfig, cfg: FitConfig):
    """Jitted step over the training state's leaves: (leaves, embed, lm_w, batch, base_key) -> (leaves, metrics).

    `leaves` are `jax.tree.leaves` of the {"model", "optimizer"} nnx.State (donated); inside the trace they are
    rebuilt with `treedef`, merged with `graphdef` into the module and the optimizer, and flattened on the way out,
    so a call is a plain `jax.jit` dispatch over a list of arrays. Carrying the leaves rather than the nnx.State
    matters for small heads: flattening and rebuilding a State (each Variable is a pytree node) costs Python time
    on every call. The weights are bit-identical to a dict-state step's.
    """
    dtype = jnp.dtype(cfg.dtype)

    def step(leaves, embed, lm_w, batch: Batch, base_key):
        train = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        head, opt = train["model"], train["optimizer"]
        key = jax.random.fold_in(base_key, opt.step[...])
        keys = jax.random.split(key, cfg.accum)
        params, rest = nnx.state(head, nnx.Param, ...)  # trainable Params; the rest (d2t) stays fixed

        def loss(p, mb, k):
            return loss_sums(nnx.to_pure_dict(nnx.merge_state(p, rest)), dcfg, embed, lm_w, mb, k, cfg.noise,
                             cfg.w_cls, dtype, cfg.ce_positions, cfg.ttt_steps, cfg.step_decay)

        grad_fn = jax.grad(loss, has_aux=True)

        def micro(acc, xs):
            mb, k = xs
            g, aux = grad_fn(params, mb, k)
            return jax.tree.map(jnp.add, acc, (g, aux)), None

        zero = (jax.tree.map(jnp.zeros_like, params),
                {k: jnp.zeros((), jnp.float32) for k in sum_keys(cfg.ttt_steps)})
        (grads, sums), _ = jax.lax.scan(micro, zero, (batch, keys))
        c = jnp.maximum(sums["count"], 1e-5)
        grads = jax.tree.map(lambda x: x / c, grads)
        opt.update(head, grads)  # optax chain (clip, adamw) on the Params; advances opt.step
        metrics = metric_means(sums)
        metrics["loss"] = metrics["vloss"] + cfg.w_cls * metrics["ploss"]
        metrics["grad_norm"] = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        return jax.tree.leaves(nnx.state(train)), metrics

    return jax.jit(step, donate_argnums=(0,))


EVAL_STEPS = 6  # held-out top-1 is reported for at least this many free-running draft steps


def make_eval_step(dcfg: DraftConfig, cfg: FitConfig, steps: int | None = None):
    """Jitted (params, embed, lm_w, batch [1, B, L]) -> held-out metrics sums over `steps` unrolled draft steps
    (default max(cfg.ttt_steps, EVAL_STEPS)): step k > 0 free-running on the head's own features, with the
    on-path sums (`loss_sums(on_path=True)`: top-1 where the chain's earlier steps were right)."""
    dtype = jnp.dtype(cfg.dtype)
    steps = max(cfg.ttt_steps, EVAL_STEPS) if steps is None else steps

    @jax.jit
    def ev(params, embed, lm_w, batch: Batch):
        mb = jax.tree.map(lambda x: x[0], batch)
        _, sums = loss_sums(params, dcfg, embed, lm_w, mb, None, 0.0, cfg.w_cls, dtype, steps=steps,
                            step_decay=cfg.step_decay, on_path=True)
        return sums

    return ev


# ---------------------------------------------------------------------------------------------- init / state

def init_head_params(dcfg: DraftConfig, target, cfg: FitConfig) -> dict:
    """Random head (EAGLE init); init="target-last-layer": the target's last decoder layer (minus its input norm)
    and an fc that passes the feature half through unchanged (embedding half random); init="head:<dir>": warm
    start from an exported head."""
    params = eagle.init_params(dcfg, jax.random.PRNGKey(cfg.seed), jnp.float32)
    if cfg.init == "target-last-layer":
        lp = target.params["layers"]
        params["layers"] = {k: jnp.asarray(ops.as_float(lp[k])[-1:], jnp.float32) for k in params["layers"]}
        D = dcfg.hidden_size
        params["fc_w"] = params["fc_w"].at[D:].set(jnp.eye(D, dtype=jnp.float32))
    elif cfg.init.startswith("head:"):  # warm start from a head (packaged name, our format, official layout)
        from ddd_jax.checkpoints.loading import load_draft
        d = load_draft(cfg.init[len("head:"):], target, dtype=jnp.float32)
        # a reduced draft vocabulary is not trained (`train-draft draft-vocab` sets it afterwards): warm starts
        # from a head that has one keep its weights and drop its d2t
        got = dataclasses.replace(d.config, draft_vocab_size=dcfg.draft_vocab_size)
        if got != dcfg:
            raise ValueError(f"init head {cfg.init!r} has config {d.config}, expected {dcfg}")
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), {k: v for k, v in d.params.items() if k != "d2t"})
    elif cfg.init != "random":
        raise ValueError(f"unknown init {cfg.init!r} (random | target-last-layer | head:<name or path>)")
    return params


def _data_parallel(mesh, cfg: FitConfig, state):
    """(batch placer, replicated state) for data-parallel training: batches [A, B, ...] split over "data" on B."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from ddd_jax.sharding import check_mesh, mesh_sizes
    check_mesh(mesh)
    n = mesh_sizes(mesh)["data"]
    if cfg.batch_size % n:
        raise ValueError(f"--batch-size {cfg.batch_size} does not divide the mesh's 'data' axis ({n})")
    rows = NamedSharding(mesh, P(None, "data"))
    return (lambda b: jax.tree.map(lambda x: jax.device_put(x, rows), b),
            jax.device_put(state, NamedSharding(mesh, P())))


def frozen_target_arrays(target):
    """(embed [V, D], lm_head weight [D, V]) of the target, float32 arrays whatever the stored layout (panels,
    GGUF blocks); never trained."""
    embed = jnp.asarray(ops.as_float(target.params["embed"]), jnp.float32)
    lm_w = embed.T if target.config.tie_word_embeddings else jnp.asarray(ops.as_float(target.params["lm_head"]),
                                                                         jnp.float32)
    return embed, lm_w


def train_objects(dcfg: DraftConfig, params: dict, tx) -> dict:
    """{"model": EagleHeadModule over `params`, "optimizer": nnx.Optimizer(model, tx, wrt=nnx.Param)}."""
    head = EagleHeadModule.from_params(dcfg, params)
    return {"model": head, "optimizer": nnx.Optimizer(head, tx, wrt=nnx.Param)}


def new_train_state(dcfg: DraftConfig, params: dict, tx) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of `train_objects`: what the jitted step takes."""
    return nnx.split(train_objects(dcfg, params, tx))


def state_params(state) -> dict:
    """The head's plain params dict (`eagle.param_shapes` layout) from a training state."""
    return nnx.to_pure_dict(state["model"])


def state_step(state) -> int:
    """Optimizer steps taken so far (host int; a sync point)."""
    return int(state["optimizer"]["step"][...])


def save_head(target, dcfg: DraftConfig, params, out, extra: dict | None = None) -> None:
    """Write our head format (float16 head weights only; embeddings/lm_head stay with the target)."""
    draft = eagle.Draft(dcfg, jax.tree.map(np.asarray, params), target)
    save_draft(draft, out, dtype=np.float16, extra=extra)


# ---------------------------------------------------------------------------------------------- checkpoints

def _manager(ckpt_dir: Path, keep: int):
    import orbax.checkpoint as ocp
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager(ckpt_dir.absolute(), options=opts, item_handlers=ocp.StandardCheckpointHandler())


def _restore(mgr, step: int, abstract_state):
    import orbax.checkpoint as ocp
    if "params" in (mgr.item_metadata(step).tree or {}):
        raise ValueError(f"{mgr.directory}/{step} holds the former dict training state (params/opt_state/step); this "
                         "version reads {model, optimizer} nnx state: export it with the version that wrote it")
    return mgr.restore(step, args=ocp.args.StandardRestore(abstract_state))


def restore_state(ckpt_dir, abstract_state, step: int | None = None):
    mgr = _manager(Path(ckpt_dir), keep=10 ** 6)
    step = mgr.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir}")
    state = _restore(mgr, step, abstract_state)
    mgr.close()
    return state, step


def abstract_train_state(dcfg: DraftConfig, cfg: FitConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state of ShapeDtypeStructs) of a training state: the restore target for orbax."""
    tx, _ = make_optimizer(cfg)
    return nnx.split(nnx.eval_shape(
        lambda: train_objects(dcfg, eagle.init_params(dcfg, jax.random.PRNGKey(0), jnp.float32), tx)))


def load_fit_dir(run_dir):
    """(DraftConfig, FitConfig, meta) recorded by `fit` in run_dir/fit.json."""
    meta = dio.read_json(Path(run_dir) / "fit.json")
    return DraftConfig.from_dict(meta["draft_config"]), FitConfig(**meta["fit_config"]), meta


# ---------------------------------------------------------------------------------------------- tau

def measure_tau(target, dcfg: DraftConfig, params, prompts: list, max_new_tokens: int = 64) -> dict:
    """Mean accepted tokens per target call with `ddd_jax.generate(method="eagle2")` on a few prompts."""
    from ddd_jax.decode import generate
    draft = eagle.Draft(dcfg, jax.tree.map(lambda x: jnp.asarray(x, target.params["embed"].dtype), params), target)
    calls = new = 0
    per = []
    for ids in prompts:
        r = generate(target, draft, list(ids), max_new_tokens=max_new_tokens, method="eagle2")
        calls += int(r.stats["target_calls"])
        new += int(r.stats["new_tokens"])
        per.append(float(r.stats["mean_accepted"]))
    return {"tau": float(np.mean(per)) if per else float("nan"), "tokens_per_call": new / max(calls, 1),
            "n_prompts": len(prompts)}


# ---------------------------------------------------------------------------------------------- the loop

def _append_jsonl(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _trim_metrics(path: Path, upto_step: int) -> None:
    """On resume, drop metric lines written after the checkpoint we continue from."""
    if not path.exists():
        return
    keep = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l).get("step", 0) <= upto_step]
    dio.atomic_write_text(path, "".join(l + "\n" for l in keep))


def evaluate(eval_step, params, embed, lm_w, batches: list) -> dict:
    """Held-out means {"vloss", "ploss", "acc", "count"} (floats) of `make_eval_step`'s sums over `batches`."""
    tot = None
    for b in batches:
        s = eval_step(params, embed, lm_w, b)
        tot = s if tot is None else jax.tree.map(jnp.add, tot, s)
    return {k: float(v) for k, v in metric_means(jax.device_get(tot)).items()}


@dataclass
class _Run:
    """One fit's moving parts, shared by the named parts of `fit`: the training state's leaves (the step donates
    them; `state()` rebuilds the nnx State of the latest ones when needed), its checkpoints and its metrics."""

    out: Path
    meta: dict  # fit.json
    mgr: object  # orbax's CheckpointManager
    graphdef: nnx.GraphDef
    treedef: object
    leaves: list
    last: dict | None = None  # the last training metrics line
    last_eval: dict | None = None  # the last held-out line

    def log(self, line: dict) -> None:
        _append_jsonl(self.out / "metrics.jsonl", line)

    def state(self):
        return jax.tree.unflatten(self.treedef, self.leaves)

    def params(self) -> dict:
        return state_params(self.state())

    def save(self, step: int) -> None:
        import orbax.checkpoint as ocp
        self.mgr.save(step, args=ocp.args.StandardSave(self.state()), force=True)
        self.mgr.wait_until_finished()


def _write_fit_json(out_dir: Path, meta: dict, resume: bool) -> None:
    """out_dir/fit.json, checked against a resumed run's (same configuration, same data)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fit_json, ckpt_dir = out_dir / "fit.json", out_dir / "checkpoints"
    if resume and fit_json.exists():
        old = dio.read_json(fit_json)
        if old["fit_config"] != meta["fit_config"] or old["draft_config"] != meta["draft_config"]:
            raise ValueError(f"--resume: {fit_json} was written with a different configuration "
                             f"{old['fit_config']} vs {meta['fit_config']}")
        if old.get("train_tokens") != meta["train_tokens"]:
            raise ValueError(f"--resume: training data changed ({old.get('train_tokens')} -> {meta['train_tokens']} "
                             "tokens); the data order would differ")
    elif not resume and ckpt_dir.exists() and any(ckpt_dir.iterdir()):
        raise ValueError(f"{ckpt_dir} already holds checkpoints: pass --resume or use a new output directory")
    dio.atomic_write_text(fit_json, json.dumps(meta, indent=1))


def _open_run(target, dcfg: DraftConfig, cfg: FitConfig, out_dir: Path, meta: dict, tx, resume: bool,
              keep: int) -> _Run:
    """The training state restored from the latest checkpoint (metrics.jsonl cut back to it), else fresh."""
    metrics_path = out_dir / "metrics.jsonl"
    mgr = _manager(out_dir / "checkpoints", keep)
    if resume and mgr.latest_step() is not None:
        graphdef, abstract = abstract_train_state(dcfg, cfg)
        state = _restore(mgr, mgr.latest_step(), abstract)
        _trim_metrics(metrics_path, state_step(state))
    else:
        graphdef, state = new_train_state(dcfg, init_head_params(dcfg, target, cfg), tx)
        if metrics_path.exists():
            metrics_path.unlink()
    leaves, treedef = jax.tree.flatten(state)
    return _Run(out_dir, meta, mgr, graphdef, treedef, leaves)


class _Progress:
    """The steps since the last metrics line (their metrics and tokens) and the tqdm bar (None without progress)."""

    def __init__(self, start: int, end: int, progress: bool):
        self.bar = None
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=end, initial=start, unit="step", desc="fit", mininterval=5.0)
        self.pending, self.t_last, self.tokens = [], time.time(), 0

    def step(self, metrics, tokens: int) -> None:
        self.pending.append(metrics)
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(1)

    def line(self, done: int, plan: BatchPlan, sched, t_start: float) -> dict:
        """The metrics line of the steps since the last one (means), and the bar's postfix; starts the next."""
        ms = jax.device_get(self.pending)
        dt = time.time() - self.t_last
        rec = {"step": done, "epoch": round(plan.epoch_of(done), 4), "lr": float(sched(done - 1)),
               **{k: float(np.mean([x[k] for x in ms])) for k in ms[-1] if k != "count"},
               "tokens_per_s": self.tokens / max(dt, 1e-9), "elapsed_s": time.time() - t_start}
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['acc']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        self.pending, self.t_last, self.tokens = [], time.time(), 0
        return rec

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def fit(target, train: FeatureSet, out_dir, cfg: FitConfig, *, eval_set: FeatureSet | None = None,
        resume: bool = False, ckpt_every: int = 200, keep: int = 3, log_every: int = 10, eval_every: int = 200,
        eval_batches: int = 8, tau_every: int = 0, tau_prompts: list | None = None, tau_max_new: int = 64,
        export_every: int = 0, export_dir=None, stop_after: int | None = None, progress: bool = True,
        extra_meta: dict | None = None, mesh=None, time_limit_s: float | None = None) -> dict:
    """Train a head on `train` features; checkpoints, metrics.jsonl and fit.json go to out_dir.

    stop_after: end this call after that global step (as an interruption would), leaving a checkpoint.
    time_limit_s: likewise stop at the first step that would start after this many seconds of this call.
    mesh: a ("data", "model") `jax.sharding.Mesh`: data-parallel training, each micro-batch's rows over "data"
    (batch_size must divide it), head and optimizer state replicated; the same loss as one device.
    Returns {"params" (plain dict), "module" (EagleHeadModule over the same arrays), "step", "last_metrics",
    "last_eval", "draft_config"}.
    """
    out_dir = Path(out_dir)
    dcfg = DraftConfig.from_target(target.config, target_name=target.name)
    meta = {"draft_config": dcfg.to_dict(), "fit_config": cfg.to_dict(), "target": target.name,
            "train_features": train.manifest.get("source"), "train_tokens": train.n_tokens,
            "train_seqs": train.n_seqs, **(extra_meta or {})}
    _write_fit_json(out_dir, meta, resume)
    tx, sched = make_optimizer(cfg)
    run = _open_run(target, dcfg, cfg, out_dir, meta, tx, resume, keep)
    shard_batch = lambda b: b  # noqa: E731
    if mesh is not None:
        shard_batch, run.leaves = _data_parallel(mesh, cfg, run.leaves)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    _train(run, target, dcfg, cfg, BatchPlan(train, cfg), sched, shard_batch, end=end, progress=progress,
           time_limit_s=time_limit_s, log_every=log_every, ckpt_every=ckpt_every,
           held=eval_rows(eval_set, cfg, eval_batches) if eval_set is not None else [], eval_every=eval_every,
           tau_every=tau_every, tau_prompts=tau_prompts, tau_max_new=tau_max_new, export_every=export_every,
           export_dir=export_dir)
    state = run.state()
    if run.mgr.latest_step() != state_step(state):
        run.save(state_step(state))
    run.mgr.close()
    return {"params": state_params(state), "module": nnx.merge(run.graphdef, state)["model"],
            "step": state_step(state), "last_metrics": run.last, "last_eval": run.last_eval, "draft_config": dcfg}


def _train(run: _Run, target, dcfg: DraftConfig, cfg: FitConfig, plan: BatchPlan, sched, shard_batch, *, end: int,
           progress: bool, time_limit_s, log_every: int, ckpt_every: int, held: list, eval_every: int,
           tau_every: int, tau_prompts, tau_max_new: int, export_every: int, export_dir) -> None:
    """The training loop from the state's step to `end` (or `time_limit_s`): metrics every `log_every` steps,
    held-out scores every `eval_every`, τ every `tau_every`, checkpoints every `ckpt_every`, the head exported
    every `export_every`, each also at the last step."""
    embed, lm_w = frozen_target_arrays(target)
    eval_step, train_step = make_eval_step(dcfg, cfg), make_train_step(run.graphdef, run.treedef, dcfg, cfg)
    base_key = jax.random.PRNGKey(cfg.seed)
    start = state_step(run.state())
    prog = _Progress(start, end, progress)
    t_start = time.time()
    for step in range(start, end):
        if time_limit_s is not None and step > start and time.time() - t_start > time_limit_s:
            break
        batch = plan.batch(step)
        n_tok = int((batch.segments > 0).sum())
        run.leaves, m = train_step(run.leaves, embed, lm_w, shard_batch(batch), base_key)
        prog.step(m, n_tok)
        done = step + 1
        if done % log_every == 0 or done == end:
            run.last = prog.line(done, plan, sched, t_start)
            run.log(run.last)
        if eval_every and held and (done % eval_every == 0 or done == end):
            r = evaluate(eval_step, run.params(), embed, lm_w, held)
            run.last_eval = {"step": done, "split": "eval", "eval_vloss": r["vloss"], "eval_ploss": r["ploss"],
                             "eval_loss": r["vloss"] + cfg.w_cls * r["ploss"], "eval_acc": r["acc"],
                             "eval_tokens": r["count"],
                             **{f"eval_{k}": v for k, v in r.items() if k.startswith("acc") and k != "acc"}}
            run.log(run.last_eval)
        if tau_every and tau_prompts and (done % tau_every == 0 or done == end):
            run.log({"step": done, "split": "tau", **measure_tau(target, dcfg, run.params(), tau_prompts, tau_max_new)})
        if done % ckpt_every == 0 or done == end:
            run.save(done)
        if export_every and export_dir and (done % export_every == 0 or done == end):
            save_head(target, dcfg, run.params(), export_dir,
                      extra=export_extra(run.meta, done, run.last, run.last_eval))
    prog.close()


def export_extra(meta: dict, step: int, last_metrics=None, last_eval=None) -> dict:
    """Provenance recorded in the exported head's config.json."""
    return {"trained_for": meta.get("target"), "step": step, "fit_config": meta.get("fit_config"),
            "train_tokens": meta.get("train_tokens"), "train_seqs": meta.get("train_seqs"),
            "data": meta.get("train_features"),
            "train_metrics": last_metrics, "eval_metrics": last_eval}
