"""Draft-phase loops and depth policies: fixed depth (EAGLE-2) and Dynamic Depth Decoding in three sync modes.

* ``none``     -- run steps up to a given end step (EAGLE-2; and the segments of host mode).
* ``host``     -- the caller runs segments between check steps as separate jitted while-loops and reads the
                  confidence on the host at each check (`SyncCounter.read`): the paper's lazy-evaluation break.
* ``callback`` -- one jitted loop; at each check `jax.experimental.io_callback` calls a host Python policy.
* ``device``   -- one jitted loop; the decision `confidence >= threshold` is taken on device, no host sync.

A check at step s happens after step s (see `TreeConfig` for step numbering) and looks at the beam that
step produced. All three modes take the same decisions on the same inputs.
"""
from __future__ import annotations

import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from .cache import KVCache, with_length
from .config import DraftConfig, ModelConfig
from .eagle import draft_logits, head_forward
from .llama import causal_mask, tree_kv_mask
from .tree import Beam, confidence, expand


class SyncCounter:
    """Every device->host read in a decode loop goes through here, so sync statistics are exact."""

    def __init__(self):
        self.total = 0
        self.draft = 0

    def read(self, x, draft: bool = False):
        """One device->host transfer of a pytree of arrays (counted once)."""
        self.total += 1
        self.draft += int(draft)
        return jax.tree.map(np.asarray, jax.device_get(x))

    def note_callback(self) -> None:
        self.total += 1
        self.draft += 1


# Policy for sync="callback": (step, confidence[B], active[B], threshold) -> keep drafting [B] bool.
Policy = Callable[[int, np.ndarray, np.ndarray, float], np.ndarray]


def threshold_policy(step: int, conf: np.ndarray, active: np.ndarray, threshold: float) -> np.ndarray:
    """DDD's rule: keep drafting while the beam's confidence is at least the threshold."""
    return active & (conf >= threshold)


# io_callback needs a stable function identity (jit caches on it); the per-call policy and counter are
# installed here by `generate` for the duration of one call. Callbacks run on a runtime thread, so this is a
# process-wide slot guarded by a lock (one callback-mode generate at a time).
_ctx: dict = {"policy": None, "counter": None}
_ctx_lock = threading.Lock()


def set_callback_context(policy: Policy | None, counter: SyncCounter | None) -> None:
    with _ctx_lock:
        _ctx["policy"] = policy
        _ctx["counter"] = counter


def _callback_entry(step, conf, active, threshold):
    with _ctx_lock:
        policy = _ctx["policy"] or threshold_policy
        counter = _ctx["counter"]
    if counter is not None:
        counter.note_callback()
    out = policy(int(step), np.asarray(conf), np.asarray(active), float(threshold))
    return np.asarray(out, dtype=bool).reshape(np.shape(active))


def draft_prefix(dparams, dcfg: DraftConfig, tparams, tcfg: ModelConfig, dcache: KVCache, pend_tok, pend_feat, pend_n):
    """Step 0: run the head over the newly committed pairs (pend_n[b] of M), extend the draft prefix.

    Returns (dcache with length += pend_n, h0 [B, D] output at the last real pair, logp0 [B, V])."""
    B, M = pend_tok.shape
    pos = dcache.length[:, None] + jnp.arange(M, dtype=jnp.int32)[None]
    kv = tree_kv_mask(dcache.length, dcache.capacity, causal_mask(B, M))
    h, dc = head_forward(dparams, dcfg, tparams["embed"], pend_tok, pend_feat, pos, dcache, kv)
    last = jnp.take_along_axis(h, (pend_n - 1)[:, None, None], axis=1)  # [B, 1, D]
    logp = draft_logits(dparams, tparams, tcfg, last[:, 0])
    return with_length(dc, dcache.length + pend_n), last[:, 0], logp


def draft_step(dparams, dcfg: DraftConfig, tparams, tcfg: ModelConfig, dcache: KVCache, base, beam: Beam,
               k: int, max_depth: int):
    """One expansion step: the head on the beam (each node sees the prefix [0, base) and its ancestors in the
    scratch area [base, base + max_depth*k)), then `tree.expand`."""
    B = beam.tok.shape[0]
    W = max_depth * k
    S = dcache.capacity
    rel = jnp.arange(S)[None, :] - base[:, None]  # [B, S]
    in_scr = (rel >= 0) & (rel < W)
    anc = jnp.take_along_axis(beam.anc, jnp.broadcast_to(jnp.clip(rel, 0, W - 1)[:, None, :], (B, k, S)), axis=2)
    kv = (rel < 0)[:, None, :] | (in_scr[:, None, :] & anc)
    pos = jnp.broadcast_to((base + beam.step)[:, None], (B, k)).astype(jnp.int32)
    view = with_length(dcache, base + beam.step * k)
    h, dc = head_forward(dparams, dcfg, tparams["embed"], beam.tok, beam.feat, pos, view, kv)
    logp = draft_logits(dparams, tparams, tcfg, h)
    return with_length(dc, dcache.length), expand(beam, h, logp, k, max_depth, dparams.get("d2t"))


def run_steps(dparams, dcfg, tparams, tcfg, dcache, base, beam: Beam, end_step, *, k: int, max_depth: int,
              mode: str, check_steps: tuple = (), threshold=0.0):
    """Draft steps until `end_step` or until no sequence is active, as one `lax.while_loop`.

    mode "none": no checks inside (fixed depth, or a host-mode segment); "device": DDD decision on device;
    "callback": DDD decision by the host policy through io_callback at each check step."""
    checks = jnp.asarray(check_steps if check_steps else (-1,), jnp.int32)

    def cond(c):
        _, b = c
        return (b.step < end_step) & jnp.any(b.active)

    def body(c):
        dc, b = c
        dc, b = draft_step(dparams, dcfg, tparams, tcfg, dc, base, b, k, max_depth)
        if mode in ("device", "callback"):
            is_check = jnp.any(b.step == checks)
            conf = confidence(b)
            if mode == "device":
                act = jnp.where(is_check, b.active & (conf >= threshold), b.active)
            else:
                act = jax.lax.cond(
                    is_check,
                    lambda: io_callback(_callback_entry, jax.ShapeDtypeStruct(b.active.shape, jnp.bool_),
                                        b.step, conf, b.active, threshold, ordered=False),
                    lambda: b.active)
            b = Beam(**{**b.__dict__, "active": act})
        return dc, b

    return jax.lax.while_loop(cond, body, (dcache, beam))
