"""EAGLE-3 draft-head training: soft cross-entropy against the target over the draft vocabulary with training-time
test (TTT), no feature regression. Target features are computed on the fly from the stored token ids.

Objective (SafeAILab/EAGLE `eagle/traineagle3/cnets.py` `Model.forward`). For a packed row of tokens x_0..x_{n-1}
the target gives, in one frozen forward, the features a_c (inputs of layers 2, L//2, L-3, concatenated) and its
logits z_c. Step 0 runs the head over the pairs (x_{c+1}, fc(a_c)); step k >= 1 runs it over (x_{c+1+k}, g^{k-1}_c)
-- the head's own output of step k-1 at the same row position c -- attending to step 0's keys causally and to
steps 1..k's keys at position c only (the official diagonal mask: `cache_hidden` and `attn_weightsi` there).
Every step's logits q^k_c = lm_head(norm(g^k_c)) over the draft vocabulary are scored against
p_{c+1+k} = softmax(z_{c+1+k} restricted to the draft vocabulary) (`target_p`), counted only where the loss mask
of x_{c+2+k} is set and the target's own argmax lies in the draft vocabulary (`position_mask` from `t2d`):

    loss = sum_k 0.8^k * ( -sum_c m^k_c sum_v p log q ) / sum_c m^0_c        (K = ttt_steps, official 7)

The draft vocabulary is the `draft_vocab_size` most frequent loss-masked tokens of the training data (EOS always
in); it is fixed for the run and recorded in fit.json, and `d2t` is never trained.

Differences from the official recipe, on purpose: step k's pairs sit at rope position c+k (where decoding puts
them; the official trainer keeps position c), packed rows (block-diagonal masks; each sequence loses its last
token), gradient-norm clipping and a cosine schedule as `train.py`.

Arithmetic: `dtype="bfloat16"` runs the frozen target and the head in bfloat16 (float32 master weights and
optimizer state, float32 softmax and loss); the default float32 is the CPU's. The learning rate enters the
jitted step as an argument (`schedule(cfg)` on the host), so the compiled step does not depend on `steps`:
`time_budget_s` times the first steps and then fixes `steps` to what fits, without a second compile.

Storage: only the token ids and loss masks of the feature shards are read (`train_draft.extract` output; their
final-normed features are ignored), so EAGLE-3 needs no 3x feature storage; the price is one frozen target
forward per step. Storing the three layers plus the final hidden state (for the soft labels) in float16 would
take 4.6 KB per token (4.6 GB per 1M tokens) -- so features are computed on the fly. Determinism and resume are as in `train.py`: the batch of step s is a pure function of
(seed, s), and `resume=True` continues bit-for-bit from the orbax checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddd_jax import eagle, eagle3, layers, llama
from ddd_jax import io as dio
from ddd_jax.checkpoints.ours import save_draft
from ddd_jax.config import DraftConfig

from . import ttt
from .extract import FeatureSet
from .train import TrainConfig, pack_rows
from .vocab import frequent_tokens


@dataclass(frozen=True)
class Fit3Config(TrainConfig):
    """Everything that determines the trained EAGLE-3 weights (stored in fit.json; resume must match):
    `train.TrainConfig` plus training-time test's fields."""

    ttt_steps: int = 7  # K: unrolled draft steps (official: 7)
    step_decay: float = 0.8  # weight of step k: step_decay**k
    draft_vocab_size: int = 8192
    max_epochs: float = 2.0  # steps are capped at this many passes over the training rows (0: no cap)

    def __post_init__(self):
        super().__post_init__()
        for name in ("ttt_steps", "draft_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"Fit3Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_epochs < 0:
            raise ValueError(f"Fit3Config.max_epochs must be >= 0 (0: no cap), got {self.max_epochs}")


def schedule(cfg: Fit3Config):
    """Learning rate of step s (host side): linear warmup, cosine decay to lr * end_lr_frac at cfg.steps."""
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(cfg.warmup, 1), max(cfg.steps, cfg.warmup + 1),
                                              end_value=cfg.lr * cfg.end_lr_frac)


def make_optimizer(cfg: Fit3Config):
    """AdamW without its learning rate (clip -> Adam -> decoupled weight decay); the step scales by -lr."""
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2),
                       optax.add_decayed_weights(cfg.weight_decay))


def draft_vocab(fs: FeatureSet, size: int, vocab_size: int, always=()) -> np.ndarray:
    """The `size` most frequent loss-masked tokens of the training data (sorted target ids)."""
    mask = fs.mask.astype(bool)
    counts = np.bincount(fs.ids[mask], minlength=vocab_size)[:vocab_size]
    return frequent_tokens(counts, min(size, vocab_size), always=always)


def make_batch(fs: FeatureSet, rows, seq_len: int):
    """Packed rows -> (ids, mask, pos, seg) [R, L]; row r holds the first n tokens of each of its sequences."""
    R, L = len(rows), seq_len
    ids, msk = np.zeros((R, L), np.int32), np.zeros((R, L), np.float32)
    pos, seg = np.zeros((R, L), np.int32), np.zeros((R, L), np.int32)
    for r, row in enumerate(rows):
        c = 0
        for s, (k, n) in enumerate(row):
            o = int(fs.offsets[k])
            ids[r, c:c + n] = fs.ids[o:o + n]
            msk[r, c:c + n] = fs.mask[o:o + n]
            pos[r, c:c + n] = np.arange(n)
            seg[r, c:c + n] = s + 1
            c += n
    return ids, msk, pos, seg


class RowPlan:
    """Rows of every step as a pure function of (seed, step): epoch e packs a fresh permutation. With `groups`
    ([S] int, one per sequence), each epoch takes group 0's sequences first (their own permutation, packed), then
    group 1's, and so on: a fit that ends early has learnt from the first groups alone."""

    def __init__(self, fs: FeatureSet, cfg: Fit3Config, groups=None):
        self.fs, self.cfg = fs, cfg
        self.lengths = np.diff(fs.offsets)
        self.groups = None if groups is None else np.asarray(groups)
        if self.groups is not None and self.groups.shape != self.lengths.shape:
            raise ValueError(f"groups: one per sequence ({len(self.lengths)}), got {self.groups.shape}")
        self._cache: dict = {}
        self.steps_per_epoch = len(self.rows(0)) // cfg.batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"not enough data for one step: {len(self.rows(0))} packed rows of {cfg.seq_len} "
                             f"tokens, a step needs {cfg.batch_size}")

    def rows(self, epoch: int):
        """The packed rows of epoch `epoch`: lists of (sequence, tokens) pairs (the last epoch asked for is kept)."""
        if epoch not in self._cache:
            order = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.lengths))
            if self.groups is None:
                rows = pack_rows(self.lengths, order, self.cfg.seq_len)
            else:  # the same permutation, split by group, each group packed in turn
                rows = [r for g in np.unique(self.groups)
                        for r in pack_rows(self.lengths, order[self.groups[order] == g], self.cfg.seq_len)]
            self._cache = {epoch: rows}
        return self._cache[epoch]

    def batch(self, step: int):
        e, i = divmod(step, self.steps_per_epoch)
        B = self.cfg.batch_size
        return make_batch(self.fs, self.rows(e)[i * B:(i + 1) * B], self.cfg.seq_len)


def ttt_loss(params, d2t, dcfg: DraftConfig, fcfg: Fit3Config, tparams, tcfg, ids, msk, pos, seg):
    """(loss, metrics) of one packed batch [B, L]: the frozen target forward, then K unrolled head steps
    (`ttt.unroll`)."""
    dt = jnp.dtype(fcfg.dtype)
    if dt != jnp.float32:  # compute copies; the float32 masters get the gradients
        params = jax.tree.map(lambda w: w.astype(dt), params)
        tparams = jax.tree.map(lambda w: w.astype(dt) if jnp.issubdtype(w.dtype, jnp.floating) else w, tparams)
    causal_same = ttt.packed_causal(seg)
    o = llama.forward(tparams, tcfg, ids, pos, attn_mask=causal_same, return_logits=False,
                      aux_layers=eagle3.feature_layers(tcfg))
    aux = jax.lax.stop_gradient(o.aux)
    lm_rows = llama.output_embedding(tparams, tcfg)  # [V, D]
    full = layers.linear(o.hidden, lm_rows, transposed=True).astype(jnp.float32)  # [B, L, V] (any stored layout)
    in_vocab = jnp.zeros((tcfg.vocab_size,), bool).at[d2t].set(True)
    top_ok = in_vocab[jnp.argmax(full, -1)]  # official position_mask: the target's argmax is drafted
    p_all = jax.lax.stop_gradient(jax.nn.softmax(full[..., d2t], axis=-1))  # [B, L, V'] target_p
    dp = {**params, "d2t": d2t}
    shift = ttt.shift
    m0 = shift(msk, 2) * shift(top_ok, 1, False) * (shift(seg, 2) == seg) * (seg > 0)
    denom = jnp.maximum(jnp.sum(m0), 1.0)

    def step_loss(k, h):
        valid = shift(seg, 2 + k) == seg  # x_{c+1+k}, p_{c+1+k} and x_{c+2+k} belong to position c's sequence
        m = shift(msk, 2 + k) * shift(top_ok, 1 + k, False) * valid * (seg > 0)  # loss mask of x_{c+2+k}
        logq = jax.nn.log_softmax(eagle3.logits(dp, dcfg, h).astype(jnp.float32), axis=-1)
        p = shift(p_all, 1 + k)
        ce = -jnp.sum(p * logq, axis=-1)
        n = jnp.maximum(jnp.sum(m), 1.0)
        return jnp.sum(m * ce) / denom, {"ploss": jnp.sum(m * ce) / n,
                                         "acc": jnp.sum(m * (jnp.argmax(logq, -1) == jnp.argmax(p, -1))) / n}

    loss, metrics = ttt.unroll(dp, dcfg, tparams["embed"], shift(ids, 1), eagle3.project_features(dp, dcfg, aux),
                               pos, causal_same, fcfg.ttt_steps, step_loss, fcfg.step_decay)
    metrics["loss"] = loss
    return loss, metrics


def make_step(dcfg: DraftConfig, fcfg: Fit3Config, tcfg, tx):
    """Jitted (state, lr, d2t, tparams, ids, msk, pos, seg) -> (state, metrics); the state is donated."""
    def step(state, lr, d2t, tparams, ids, msk, pos, seg):
        (_, m), g = jax.value_and_grad(ttt_loss, has_aux=True)(state["params"], d2t, dcfg, fcfg, tparams, tcfg,
                                                                ids, msk, pos, seg)
        updates, opt = tx.update(g, state["opt_state"], state["params"])
        updates = jax.tree.map(lambda u: -lr * u, updates)
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt,
                "step": state["step"] + 1}, m

    return jax.jit(step, donate_argnums=(0,))


def make_eval(dcfg: DraftConfig, fcfg: Fit3Config, tcfg):
    """Jitted (params, d2t, tparams, ids, msk, pos, seg) -> the held-out batch's `ttt_loss` metrics."""
    return jax.jit(lambda p, d2t, tparams, *a: ttt_loss(p, d2t, dcfg, fcfg, tparams, tcfg, *a)[1])


def program_key(target, cfg: Fit3Config, n_vocab: int) -> tuple:
    """What the fit's compiled programs depend on: the target's config, the draft vocabulary's size and `cfg` but
    for `steps` (the schedule runs on the host, and `fit_eagle3` fixes `steps` only once it runs)."""
    return target.config, int(n_vocab), dataclasses.replace(cfg, steps=1)


def compile_ahead(target, cfg: Fit3Config, n_vocab: int):
    """Start compiling the fit's step and held-out loss for `cfg`'s batch shape on a background thread -- in the
    recipe, while the target regenerates replies: on the first GPU runs these compiles took 111 s of a 310 s fit.
    Returns a Future of {"key": `program_key`, "step", "eval"} (ahead-of-time compiled executables);
    `fit_eagle3(ahead=...)` runs them when its own key matches, and compiles as usual otherwise."""
    from concurrent.futures import ThreadPoolExecutor

    def build():
        t0 = time.time()
        dcfg, tx = eagle3_config(target, n_vocab), make_optimizer(cfg)
        sds = jax.ShapeDtypeStruct
        params = jax.eval_shape(lambda: trainable(eagle3.init_params(dcfg, jax.random.PRNGKey(0), jnp.float32)))
        state = {"params": params, "opt_state": jax.eval_shape(tx.init, params), "step": sds((), jnp.int32)}
        tparams = jax.eval_shape(lambda p: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), p), target.params)
        shape = (cfg.batch_size, cfg.seq_len)
        batch = (sds(shape, jnp.int32), sds(shape, jnp.float32), sds(shape, jnp.int32), sds(shape, jnp.int32))
        d2t = sds((n_vocab,), jnp.int32)
        step = make_step(dcfg, cfg, target.config, tx).lower(state, sds((), jnp.float32), d2t, tparams, *batch)
        held = make_eval(dcfg, cfg, target.config).lower(params, d2t, tparams, *batch)
        return {"key": program_key(target, cfg, n_vocab), "step": step.compile(), "eval": held.compile(),
                "seconds": round(time.time() - t0, 1)}

    pool = ThreadPoolExecutor(1, thread_name_prefix="fit-compile")
    future = pool.submit(build)
    pool.shutdown(wait=False)
    return future


def _ahead(future, key) -> tuple[dict | None, dict]:
    """(the executables of `compile_ahead`'s future if they were built for `key`, else None; what happened)."""
    if future is None:
        return None, {"status": "none"}
    t0 = time.time()
    try:
        got = future.result()
    except Exception as e:  # noqa: BLE001 -- the fit compiles as usual; the reason is recorded
        return None, {"status": f"failed: {type(e).__name__}: {e}"[:300], "waited_s": round(time.time() - t0, 1)}
    info = {"compile_s": got["seconds"], "waited_s": round(time.time() - t0, 1)}
    if got["key"] != key:
        return None, {"status": "built for other shapes (compiled again)", **info}
    return got, {"status": "used", **info}


def eval_batches(eval_set: FeatureSet, cfg: Fit3Config, max_batches: int = 8) -> list:
    """Up to `max_batches` packed batches [B, L] of `eval_set` (sequences in order, no shuffle): (ids, msk, pos, seg)."""
    lengths = np.diff(eval_set.offsets)
    rows = pack_rows(lengths, np.arange(len(lengths)), cfg.seq_len)
    B = cfg.batch_size
    out = []
    for i in range(0, min(len(rows), B * max_batches), B):
        chunk = rows[i:i + B] + [[]] * max(0, B - len(rows[i:i + B]))
        out.append(make_batch(eval_set, chunk, cfg.seq_len))
    return out


def eval_metrics(loss_fn, params: dict, d2t, tparams, batches: list) -> dict:
    """Held-out TTT metrics averaged over `batches`, weighted by each batch's loss tokens; `loss_fn(params, d2t,
    tparams, ids, msk, pos, seg)` returns `ttt_loss`'s metrics."""
    sums, weight = {}, 0.0
    for ids, msk, pos, seg in batches:
        m = jax.device_get(loss_fn(params, d2t, tparams, ids, msk, pos, seg))
        w = float(msk.sum())
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + w * float(v)
        weight += w
    if weight == 0:
        raise ValueError("evaluate: the held-out set has no loss tokens")
    out = {k: v / weight for k, v in sums.items()}
    out["tokens"] = int(weight)
    return out


def evaluate(target, params: dict, eval_set: FeatureSet, cfg: Fit3Config, max_batches: int = 8) -> dict:
    """Held-out TTT metrics of a trained head (`params` with d2t): top-1 agreement with the target (acc{k}) and
    soft CE (ploss{k}) at each unrolled step k, averaged over up to `max_batches` packed batches of `eval_set`
    (sequences in order, no shuffle), weighted by each batch's step-0 loss tokens."""
    d2t = jnp.asarray(params["d2t"], jnp.int32)
    dcfg = eagle3_config(target, len(params["d2t"]))
    tparams = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), target.params)
    loss = jax.jit(lambda p, d2t, tparams, *a: ttt_loss(p, d2t, dcfg, cfg, tparams, target.config, *a)[1])
    return eval_metrics(loss, trainable(params), d2t, tparams, eval_batches(eval_set, cfg, max_batches))


def eagle3_config(target, draft_vocab_size: int) -> DraftConfig:
    eagle3.feature_layers(target.config)  # the target must be deep enough
    return DraftConfig.from_target(target.config, target_name=target.name, head_type="eagle3", fc_bias=False,
                                   draft_vocab_size=int(draft_vocab_size))


def trainable(params: dict) -> dict:
    """A head's params without d2t (what the fit trains)."""
    return {k: v for k, v in params.items() if k != "d2t"}


_trainable = trainable  # the old name, which experiments/recipe_memory.py still imports


def _manager(ckpt_dir: Path, keep: int):
    import orbax.checkpoint as ocp
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager(ckpt_dir.absolute(), options=opts)


def initial_params(dcfg: DraftConfig, cfg: Fit3Config, init: dict | None = None) -> dict:
    """The fit's float32 starting weights without d2t: `init`'s (checked against this head's shapes), else a random
    head from `cfg.seed`."""
    if init is None:
        return trainable(eagle3.init_params(dcfg, jax.random.PRNGKey(cfg.seed), jnp.float32))
    params = {k: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), v) for k, v in trainable(init).items()}
    want = jax.eval_shape(lambda: trainable(eagle3.init_params(dcfg, jax.random.PRNGKey(0), jnp.float32)))
    if jax.tree.map(lambda x: x.shape, params) != jax.tree.map(lambda x: x.shape, want):
        raise ValueError("init: the head's weights do not have this target's EAGLE-3 head shapes")
    return params


def measure_step(target, cfg: Fit3Config, programs: dict, n_vocab: int, steps: int = 3) -> dict:
    """Seconds a step and a held-out batch of the fit take on this device, timed on a synthetic batch with
    `compile_ahead`'s executables (`programs`: its future's result): one untimed call each, then `steps` timed
    steps. What the recipe predicts its fit's steps from before the fit starts."""
    dcfg, tx = eagle3_config(target, n_vocab), make_optimizer(cfg)
    params = initial_params(dcfg, cfg)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.asarray(0, jnp.int32)}
    tparams = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), target.params)
    B, L = cfg.batch_size, cfg.seq_len
    ids = jnp.asarray(np.random.default_rng(0).integers(0, target.config.vocab_size, (B, L)), jnp.int32)
    batch = (ids, jnp.ones((B, L), jnp.float32), jnp.tile(jnp.arange(L, dtype=jnp.int32), (B, 1)),
             jnp.ones((B, L), jnp.int32))
    d2t, lr = jnp.arange(n_vocab, dtype=jnp.int32), jnp.float32(0.0)
    state, _ = programs["step"](state, lr, d2t, tparams, *batch)
    jax.block_until_ready(state["step"])
    t = time.time()
    for _ in range(steps):
        state, _ = programs["step"](state, lr, d2t, tparams, *batch)
    jax.block_until_ready(state["step"])
    step_s = (time.time() - t) / steps
    jax.block_until_ready(programs["eval"](state["params"], d2t, tparams, *batch))
    t = time.time()
    jax.block_until_ready(programs["eval"](state["params"], d2t, tparams, *batch))
    return {"step_s": step_s, "eval_batch_s": time.time() - t, "steps_timed": steps}


@dataclass
class _Run:
    """One fit's moving parts, shared by the named parts of `fit_eagle3`."""

    cfg: Fit3Config
    dcfg: DraftConfig
    plan: RowPlan
    vocab: np.ndarray  # the draft vocabulary (sorted target ids)
    meta: dict  # fit.json
    out: Path
    mgr: object = None  # orbax's CheckpointManager, None without checkpoints
    state: dict | None = None
    last: dict | None = None  # the last training metrics line
    held: "_HeldOut | None" = None

    def write_meta(self) -> None:
        dio.atomic_write_text(self.out / "fit.json", json.dumps(self.meta, indent=1))

    def log(self, line: dict) -> None:
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def epoch(self, step: int) -> float:
        return round(step / self.plan.steps_per_epoch, 4)

    def save(self, step: int) -> None:
        import orbax.checkpoint as ocp
        if self.mgr is not None:
            self.mgr.save(step, args=ocp.args.StandardSave(self.state), force=True)
            self.mgr.wait_until_finished()


def _open_run(target, train: FeatureSet, out_dir, cfg: Fit3Config, vocab, init, groups, resume: bool,
              ckpt_every) -> _Run:
    """The draft vocabulary, the row plan, the epoch cap and fit.json (checked against a resumed run's)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if init is not None:
        vocab = init["d2t"]
    ids_vocab = (draft_vocab(train, cfg.draft_vocab_size, target.config.vocab_size, always=target.eos_token_ids)
                 if vocab is None else np.unique(np.asarray(vocab, np.int32)))
    dcfg = eagle3_config(target, len(ids_vocab))
    plan = RowPlan(train, cfg, groups)
    cap = int(cfg.max_epochs * plan.steps_per_epoch) if cfg.max_epochs else cfg.steps
    cfg = dataclasses.replace(cfg, steps=max(1, min(cfg.steps, cap)))
    plan.cfg = cfg
    meta = {"head_type": "eagle3", "draft_config": dcfg.to_dict(), "fit_config": cfg.to_dict(),
            "target": target.name, "train_tokens": train.n_tokens, "train_seqs": train.n_seqs,
            "train_loss_tokens": int(train.mask.sum()), "draft_vocab": ids_vocab.tolist(),
            "epoch_cap": {"max_epochs": cfg.max_epochs, "steps_per_epoch": plan.steps_per_epoch, "steps": cap},
            "init": None if init is None else "given"}
    fit_json, ckpt_dir = out / "fit.json", out / "checkpoints"
    if resume and ckpt_every is None:
        raise ValueError("resume needs checkpoints (ckpt_every=None writes none)")
    if resume and fit_json.exists():
        old = dio.read_json(fit_json)
        for k in ("fit_config", "draft_config", "train_tokens", "draft_vocab"):
            if old.get(k) != meta[k]:
                raise ValueError(f"--resume: {fit_json} was written with a different {k}")
    elif not resume and ckpt_dir.exists() and any(ckpt_dir.iterdir()):
        raise ValueError(f"{ckpt_dir} already holds checkpoints: pass --resume or use a new output directory")
    run = _Run(cfg, dcfg, plan, ids_vocab, meta, out)
    run.write_meta()
    return run


def _start_state(run: _Run, tx, init, resume: bool, keep: int, ckpt_every) -> None:
    """run.state: restored from the latest checkpoint (metrics.jsonl cut back to it), else fresh; run.mgr."""
    import orbax.checkpoint as ocp
    params = initial_params(run.dcfg, run.cfg, init)
    metrics_path = run.out / "metrics.jsonl"
    run.mgr = None if ckpt_every is None else _manager(run.out / "checkpoints", keep)
    if resume and run.mgr.latest_step() is not None:
        abstract = {"params": jax.eval_shape(lambda: params), "opt_state": jax.eval_shape(tx.init, params),
                    "step": jax.ShapeDtypeStruct((), jnp.int32)}
        run.state = run.mgr.restore(run.mgr.latest_step(), args=ocp.args.StandardRestore(abstract))
        if metrics_path.exists():
            keep_lines = [ln for ln in metrics_path.read_text().splitlines()
                          if ln.strip() and json.loads(ln)["step"] <= int(run.state["step"])]
            dio.atomic_write_text(metrics_path, "".join(ln + "\n" for ln in keep_lines))
    else:
        run.state = {"params": params, "opt_state": tx.init(params), "step": jnp.asarray(0, jnp.int32)}
        if metrics_path.exists():
            metrics_path.unlink()


def _size_to_budget(run: _Run, done: int, per_step: float, deadline: float, budget_s: float) -> None:
    """Fix `steps` to what fits before `deadline` at `per_step` seconds a step (never more than given)."""
    fits = done + int(max(0.0, deadline - time.time()) * 0.95 / per_step)
    run.cfg = dataclasses.replace(run.cfg, steps=max(done, min(run.cfg.steps, fits)))
    run.meta["fit_config"] = run.cfg.to_dict()
    run.meta["sized_to_budget"] = {"budget_s": budget_s, "probe_s_per_step": per_step}
    run.write_meta()


def _train(run: _Run, step_fn, d2t, tparams, *, stop_after, budget_s, probe_steps, log_every, eval_every,
           ckpt_every, stop, progress, t0) -> None:
    """The training loop: steps until `cfg.steps` (sized to the budget after the probe), the deadline, `stop()` or
    `stop_after`; metrics every `log_every` steps, held-out scores every `eval_every`, checkpoints every
    `ckpt_every` (None: none)."""
    start = step = int(run.state["step"])
    sched = schedule(run.cfg)
    ends = lambda: run.cfg.steps if stop_after is None else min(run.cfg.steps, stop_after)  # noqa: E731
    sized = budget_s is None or start > 0
    deadline = None if budget_s is None else t0 + budget_s
    pending, t_probe = [], None
    while step < ends():
        if step > start and ((deadline is not None and time.time() > deadline) or (stop is not None and stop())):
            break
        run.state, m = step_fn(run.state, jnp.float32(sched(step)), d2t, tparams, *run.plan.batch(step))
        pending.append(m)
        step = done = step + 1
        if not sized and done in (start + 1, start + 1 + probe_steps):
            jax.block_until_ready(run.state["step"])
            if done == start + 1:
                t_probe = time.time()
            else:
                _size_to_budget(run, done, (time.time() - t_probe) / probe_steps, deadline, budget_s)
                sched, sized = schedule(run.cfg), True
        end = ends()
        if done % log_every == 0 or done == end:
            ms = jax.device_get(pending)
            run.last = {"step": done, "epoch": run.epoch(done), "lr": float(sched(done - 1)),
                        **{k: float(np.mean([x[k] for x in ms])) for k in ms[0]}, "elapsed_s": time.time() - t0}
            run.log(run.last)
            if progress:
                print(f"fit-eagle3 step {done}/{end} (epoch {run.last['epoch']:.2f}): loss {run.last['loss']:.4f} "
                      f"acc0 {run.last['acc0']:.3f}", flush=True)
            pending = []
        if run.held is not None and (done % eval_every == 0 or done == end):
            run.log({"split": "eval", "step": done, "epoch": run.epoch(done),
                     **run.held.score(run.state["params"], done), "elapsed_s": time.time() - t0})
        if ckpt_every is not None and (done % ckpt_every == 0 or done == end):
            run.save(done)


def _finish(run: _Run, target, train: FeatureSet, export_dir, ckpt_every, t0) -> dict:
    """The last held-out score (when a deadline ended the loop between scores), the last checkpoint, the best
    head exported; `fit_eagle3`'s result."""
    final_step = int(run.state["step"])
    held = run.held
    if held is not None and held.last_step != final_step:
        run.log({"split": "eval", "step": final_step, "epoch": run.epoch(final_step),
                 **held.score(run.state["params"], final_step), "elapsed_s": time.time() - t0})
    if run.mgr is not None:
        if run.mgr.latest_step() != final_step:
            run.save(final_step)
        run.mgr.close()
    if held is not None:
        full, out_step = held.best["params"], held.best["step"]
    else:
        full = {**jax.tree.map(np.asarray, run.state["params"]), "d2t": np.asarray(run.vocab, np.int32)}
        out_step = final_step
    best = None if held is None else {"step": held.best["step"], "eval": held.best["metrics"]}
    if export_dir is not None:
        save_draft(eagle.Draft(run.dcfg, full, target), export_dir, dtype=np.float16,
                   extra={"trained_for": target.name, "step": out_step, "fit_config": run.cfg.to_dict(),
                          "train_tokens": train.n_tokens, "epochs": run.epoch(final_step),
                          "train_metrics": run.last, "heldout": best})
    return {"params": full, "step": final_step, "epochs": run.epoch(final_step), "last_metrics": run.last,
            "best": best, "draft_config": run.dcfg, "fit_config": run.cfg, "ahead": run.meta["ahead"],
            "epoch_cap": run.meta["epoch_cap"], "sized_to_budget": run.meta.get("sized_to_budget"),
            "seconds": round(time.time() - t0, 1)}


def fit_eagle3(target, train: FeatureSet, out_dir, cfg: Fit3Config, *, resume: bool = False,
               ckpt_every: int | None = 200, keep: int = 3, log_every: int = 10, export_dir=None,
               stop_after: int | None = None, time_budget_s: float | None = None, probe_steps: int = 3,
               progress: bool = False, vocab=None, init: dict | None = None, eval_set: FeatureSet | None = None,
               eval_every: int = 0, eval_max_batches: int = 8, on_best=None, groups=None, ahead=None,
               stop=None) -> dict:
    """Train an EAGLE-3 head on the token ids of `train`; metrics.jsonl, fit.json and checkpoints go to out_dir.

    Steps: at most `cfg.steps`, and at most `cfg.max_epochs` passes over the packed training rows (fit.json's
    `epoch_cap`; every metrics line has its `epoch`). time_budget_s (a fresh run): after the first step (the
    compile) and `probe_steps` timed steps, `cfg.steps` becomes the number of steps that fit the budget (never more
    than given); fit.json and the schedule follow it. The probe runs inside the warmup (warmup > probe_steps + 1
    keeps its learning rates independent of the final count). The budget is also a hard stop: a step that starts
    past it is not taken; so is one that starts once `stop()` (a callable, checked before every step but the first)
    returns true.
    ckpt_every: an orbax checkpoint of the params and optimizer state every N steps and at the end, what `resume`
    continues from; None writes none (the recipe, which never resumes a fit).
    vocab: the draft vocabulary (target token ids) to use instead of `draft_vocab(train, ...)`, e.g. one shared
    by heads fitted on different data. init: a head's params (with d2t, e.g. `load_draft(...).params`) to start
    from instead of a random head; its d2t is the draft vocabulary.
    eval_set / eval_every: held-out TTT metrics every `eval_every` steps and at the end (metrics lines with
    "split": "eval", in the fit's dtype, the same `eval_max_batches` batches each time); the params with the lowest
    held-out loss are the ones returned and exported, and `on_best(params, step, metrics)` sees each new best.
    groups: [S] int per training sequence: each epoch goes through group 0 first, then group 1, ... (`RowPlan`).
    ahead: `compile_ahead(...)`'s future: its programs run when they were built for this fit's shapes (fit.json's
    `ahead` says whether they were).
    Returns {"params" (with d2t), "step", "epochs", "last_metrics", "best", "draft_config", "fit_config", "ahead",
    "epoch_cap", "sized_to_budget", "seconds"}."""
    t0 = time.time()
    run = _open_run(target, train, out_dir, cfg, vocab, init, groups, resume, ckpt_every)
    tx = make_optimizer(run.cfg)
    tparams = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), target.params)
    d2t = jnp.asarray(run.vocab, jnp.int32)
    programs, run.meta["ahead"] = _ahead(ahead, program_key(target, run.cfg, len(run.vocab)))
    if ahead is not None:
        run.write_meta()
    step_fn = programs["step"] if programs else make_step(run.dcfg, run.cfg, target.config, tx)
    _start_state(run, tx, init, resume, keep, ckpt_every)
    if eval_set is not None and eval_every > 0:
        run.held = _HeldOut(programs["eval"] if programs else make_eval(run.dcfg, run.cfg, target.config), run.cfg,
                            tparams, d2t, eval_set, eval_max_batches, run.vocab, on_best)
    _train(run, step_fn, d2t, tparams, stop_after=stop_after, budget_s=time_budget_s, probe_steps=probe_steps,
           log_every=log_every, eval_every=eval_every, ckpt_every=ckpt_every, stop=stop, progress=progress, t0=t0)
    return _finish(run, target, train, export_dir, ckpt_every, t0)


class _HeldOut:
    """The fit's held-out scoring: one jitted loss over fixed batches, and the best params so far (by loss)."""

    def __init__(self, fn, cfg, tparams, d2t, eval_set, max_batches, ids_vocab, on_best):
        self.fn = fn
        self.batches = eval_batches(eval_set, cfg, max_batches)
        self.tparams, self.d2t, self.vocab, self.on_best = tparams, d2t, np.asarray(ids_vocab, np.int32), on_best
        self.best, self.last_step = None, None

    def score(self, params, step: int) -> dict:
        m = eval_metrics(self.fn, params, self.d2t, self.tparams, self.batches)
        self.last_step = step
        if self.best is None or m["loss"] < self.best["metrics"]["loss"]:
            full = {**jax.tree.map(np.asarray, jax.device_get(params)), "d2t": self.vocab}
            self.best = {"params": full, "step": step, "metrics": m}
            if self.on_best is not None:
                self.on_best(full, step, m)
        return {**m, "best_step": self.best["step"]}
