"""Pure LLaMA building blocks: the matrix product every layer uses, RMSNorm, rotary embeddings, attention masks,
masked GQA attention over a KV cache, SwiGLU MLP.

Axis letters: B batch, T new tokens, S cache slots, D model width, N query heads, K kv heads,
G = N/K query heads per kv head, H head dim, F MLP width.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import ops
from .config import ModelConfig

NEG_INF = -1e30  # large finite negative: fully-masked rows stay NaN-free


def linear(x, w, layer=None, *, transposed: bool = False, f32: bool = False):
    """The one matrix product of the model: x [..., K] @ w [K, N] -> [..., N], or with transposed=True
    x @ w.T for w [N, K] (output-embedding rows: lm_head, the draft vocabulary; float32 result). f32: a float32
    result (accumulated in float32) for the non-transposed product too (an untied lm_head stored [D, V]).
    w may be an array or a packed weight (`ops.Packed`); layer: w is stacked [L, K, N] / [L, N, K] and `layer`
    (an int, may be traced) picks one, read in place. See `ops.matmul`."""
    return ops.matmul(x, w, layer, transposed=transposed, f32=f32)


def linears(x, ws, layer=None):
    """(linear(x, w, layer) for w in ws), bitwise: one input and several weights (q, k, v; gate, up), which the
    backend may multiply in one call (`ops.matmuls`)."""
    return ops.matmuls(x, ws, layer)


def embed(w, ids):
    """Rows `ids` [...] of an embedding w [V, D] (an array or a packed rows-layout weight): [..., D]."""
    return ops.take_rows(w, ids)


def greedy_token(logits):
    """The index of the first maximum over the last axis: `jnp.argmax`'s answer (ties to the lowest index; a NaN
    row, which has no answer, gives V - 1 here), computed as a max and a min over the row, which XLA:CPU runs
    faster than `argmax`'s variadic (value, index) reduce. logits: [..., V] -> [...] int32."""
    V = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    idx = jnp.where(logits == top, jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1), V)
    return jnp.minimum(jnp.min(idx, axis=-1), V - 1)


def rms_norm(x, w, eps: float):
    """HF LlamaRMSNorm: normalise in float32, scale by w in the input dtype."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    # sum of squares through `linear` (a product with a row of ones): XLA's own row reduction changes its order
    # with the number of rows (M >= 8 here), the kernel's does not
    ss = linear(x32 * x32, jnp.ones((1, x.shape[-1]), jnp.float32), transposed=True)  # [..., 1]
    x32 = x32 * jax.lax.rsqrt(ss / x.shape[-1] + eps)
    return w * x32.astype(dtype)


def rope_inv_freq(cfg: ModelConfig):
    """Inverse frequencies [H/2], with optional llama3 scaling (as transformers computes them)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    rs = cfg.rope_scaling_dict()
    if rs.get("rope_type", rs.get("type")) == "llama3":
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs["original_max_position_embeddings"]
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        inv_l = jnp.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        is_medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = jnp.where(is_medium, smoothed, inv_l)
    return inv


def apply_rope(x, positions, inv_freq):
    """Rotate-half RoPE (HF layout). x: [B, T, N, H]; positions: [B, T] int."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def causal_mask(B: int, T: int):
    """[B, T, T] lower-triangular mask over T new tokens."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))


def tree_kv_mask(length, capacity: int, attn_mask):
    """[B, T, S] mask over cache slots: every slot before length[b] plus the W slots [length, length+W) as
    attn_mask [B, T, W] allows (W = T for new tokens: causal, or a tree's ancestor matrix; a draft beam's ancestors
    among the draft's scratch slots)."""
    W = attn_mask.shape[-1]
    rel = jnp.arange(capacity)[None, :] - length[:, None]  # [B, S]
    in_new = (rel >= 0) & (rel < W)
    new_part = jnp.take_along_axis(attn_mask, jnp.clip(rel, 0, W - 1)[:, None, :].repeat(attn_mask.shape[1], 1), axis=2)
    return (rel < 0)[:, None, :] | (in_new[:, None, :] & new_part)


def cache_mask(attn_mask, cache, start=None):
    """What a model's new tokens attend, from their mask attn_mask [B, T, W]. Without a cache attn_mask itself
    ([B, T, T]); with one, [B, T, S] over its slots: every slot before start [B] (default cache.length, where the
    new K/V are written) and the W slots from start as attn_mask allows. The one place the models turn their new
    tokens' mask into a mask over cache slots."""
    if cache is None:
        return attn_mask
    return tree_kv_mask(cache.length if start is None else start, cache.capacity, attn_mask)


def slot_positions(length, capacity: int, positions):
    """[B, S] the position of each cache slot after new tokens at `positions` [B, T] are written at slots
    [length, length+T): a committed slot s holds position s; slots past the new tokens get a large position."""
    T = positions.shape[1]
    rel = jnp.arange(capacity)[None, :] - length[:, None]  # [B, S]
    new = jnp.take_along_axis(positions, jnp.clip(rel, 0, T - 1), axis=1)
    return jnp.where(rel < 0, jnp.arange(capacity)[None, :], jnp.where(rel < T, new, jnp.iinfo(jnp.int32).max))


def sliding_window_mask(q_positions, kv_positions, window: int):
    """[B, T, S] True where key position p' is within the window of query position p: p - window < p'
    (HF's `sliding_window_overlay`; causality comes from the other masks)."""
    return kv_positions[:, None, :] > q_positions[:, :, None] - window


def attention(q, k, v, mask, layer=None):
    """Grouped-query attention.

    q: [B, T, N, H]; k, v: head-major [B, K, S, H], or stacked caches [L, B, K, S, H] with `layer` (an int, may be
    traced: read in place on the kernel path); mask: [B, T, S] bool (True = may attend). Returns [B, T, N*H].
    Softmax in float32. Where the backend has an attention kernel (`ops.attention`), a row attends only the slots
    it may, summed in slot order, so a row's output does not depend on the other rows (a tree node gets exactly
    what decoding its path one token at a time gives).
    """
    return ops.attention(q, k, v, mask, layer, _attention_xla)


def _attention_xla(q, k, v, mask):  # k, v [B, K, S, H]
    B, T, N, H = q.shape
    K = k.shape[1]
    G = N // K
    qg = q.reshape(B, T, K, G, H)
    logits = jnp.einsum("btkgh,bksh->bkgts", qg, k, precision=ops.precision(qg, k),
                        preferred_element_type=jnp.float32)
    logits = logits * (1.0 / math.sqrt(H))
    logits = jnp.where(mask[:, None, None, :, :], logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksh->btkgh", probs, v, precision=ops.precision(probs, v))
    return out.reshape(B, T, N * H)


def ttt_attention(q, k, v, mask0, steps: int):
    """Training-time test's attention (EAGLE-3): unrolled step `steps` of a head over T positions, with step s's
    keys / values in slots [s*T, (s+1)*T) of k, v [B, K, S, H]. Query t attends step 0's slots as mask0 [B, T, T]
    allows (causal within its packed sequence) and, from each step 1 <= s <= steps, the slot of its own position
    (s*T + t). `attention` over the equivalent [B, T, S] mask gives the same values (to float rounding) computing
    T*S scores; this computes T*(T + steps). Softmax in float32. Returns [B, T, N*H]."""
    B, T, N, H = q.shape
    K = k.shape[1]
    G = N // K
    qg = q.reshape(B, T, K, G, H)
    scale = 1.0 / math.sqrt(H)
    k0, v0 = k[:, :, :T], v[:, :, :T]
    s0 = jnp.einsum("btkgh,bksh->bkgts", qg, k0, precision=ops.precision(qg, k0), preferred_element_type=jnp.float32)
    logits = jnp.where(mask0[:, None, None], s0 * scale, NEG_INF)  # [B, K, G, T, T]
    if steps:
        kd = k[:, :, T:(steps + 1) * T].reshape(B, K, steps, T, H)  # [B, K, steps, T, H]: step s at position t
        vd = v[:, :, T:(steps + 1) * T].reshape(B, K, steps, T, H)
        sd = jnp.einsum("btkgh,bksth->bkgts", qg, kd, precision=ops.precision(qg, kd),
                        preferred_element_type=jnp.float32)  # [B, K, G, T, steps]
        logits = jnp.concatenate([logits, sd * scale], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    p0 = probs[..., :T]
    out = jnp.einsum("bkgts,bksh->btkgh", p0, v0, precision=ops.precision(p0, v0))
    if steps:
        pd = probs[..., T:]
        out = out + jnp.einsum("bkgts,bksth->btkgh", pd, vd, precision=ops.precision(pd, vd))
    return out.reshape(B, T, N * H)


def mlp(x, w_gate, w_up, w_down, layer=None):
    """SwiGLU: down(silu(gate(x)) * up(x)). w_gate/w_up: [D, F]; w_down: [F, D] (or stacked, see `linear`)."""
    together = ops.products_together(x, (w_gate, w_up), layer)  # int8 blocks: one call for gate and up
    if together is None:
        return linear(jax.nn.silu(linear(x, w_gate, layer)) * linear(x, w_up, layer), w_down, layer)
    g, u = together
    return linear(jax.nn.silu(g) * u, w_down, layer)
