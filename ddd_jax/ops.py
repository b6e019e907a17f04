"""The one door between model code and the backends: products, embedding rows, the greedy output head, attention,
precision, and the weight formats a head may be stored in.

Model and decode code (layers, llama, eagle, eagle1, eagle3, drafting, generate) call these and nothing below them. A
packed weight (`backends.Packed`: panels, GGUF blocks, ...) carries its own product; a plain array takes the
backend's kernel where one applies (`backends/cpu`: float32 work of at most 128 rows) and XLA otherwise. The
results do not depend on which path ran: the CPU kernels are bitwise the float32 products they replace, row by
row, whatever the number of rows -- except GGUF blocks loaded as `gguf_blocks="int8"`, whose weights carry their
own integer product (close to the float32 one, and still the same bits whatever the number of rows).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .backends import Packed, precision
from .backends.cpu import kernels as _cpu
from .backends.cpu import pack as _pack
from .backends.cpu import panels as _panels
from .backends.cpu import quant as _quant

__all__ = ["Packed", "precision", "matmul", "matmuls", "products_together", "take_rows", "output_rows",
           "greedy_head", "greedy_tokens", "attention", "as_stored", "BLOCK_KINDS", "is_block", "has_blocks",
           "quantize", "pack_head", "choose_kernel_variants"]

BLOCK_KINDS = tuple(_quant.KINDS)  # GGUF block kinds a weight may be stored as ("q8_0", "q4_0", "q4_1")


def matmul(x, w, layer=None, *, transposed: bool = False, f32: bool = False):
    """x [..., K] @ w [K, N] -> [..., N], or with transposed=True x @ w.T for w [N, K] (output-embedding rows:
    float32 result). f32: a float32 result (accumulated in float32) for the non-transposed product too.
    layer: w is stacked [L, K, N] / [L, N, K] and `layer` (an int, may be traced) picks one, read in place."""
    if isinstance(w, Packed):
        return w.product(x, layer, transposed=transposed)
    if _cpu.usable(x, w):
        return _cpu.product(x, w, layer, trans=transposed)
    if layer is not None:
        w = jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)
    prec = precision(x, w)
    if transposed:
        return jnp.einsum("...d,vd->...v", x, w, precision=prec, preferred_element_type=jnp.float32)
    if f32:
        return jnp.einsum("...d,dv->...v", x, w, precision=prec, preferred_element_type=jnp.float32)
    return jnp.matmul(x, w, precision=prec)


def matmuls(x, ws, layer=None):
    """(x @ w for w in ws): one input and several weights of its K (q, k and v; gate and up), each result `matmul`'s
    bitwise: `products_together` where the storage shares the input's work, else one weight at a time."""
    ws = tuple(ws)
    together = products_together(x, ws, layer)
    return together if together is not None else tuple(matmul(x, w, layer) for w in ws)


def products_together(x, ws, layer=None):
    """(x @ w for w in ws) as one product where the weights' storage can share the input's work (int8 GGUF blocks:
    x quantized once, one call whose threads share every weight), each result `matmul`'s bitwise; else None."""
    return _quant.int8_products(x, tuple(ws), layer)


def take_rows(w, ids):
    """Rows `ids` [...] of an embedding w [V, D] (an array or a packed rows-layout weight): [..., D]."""
    if isinstance(w, Packed):
        return w.take(ids)
    return jnp.take(w, ids, axis=0)


def output_rows(w):
    """The rows [V, D] of an untied output projection stored [D, V] (a view where the storage allows)."""
    return w.as_rows() if isinstance(w, Packed) else w.T


def greedy_head(hidden, w, pick):
    """(logits, tokens) of hidden against output projection `w` computed in one pass where its storage allows,
    else None (the caller computes the logits and `pick`s from them)."""
    return w.greedy(hidden, pick) if isinstance(w, Packed) else None


def greedy_tokens(hidden, w, pick):
    """The greedy tokens alone where `w`'s storage has a cheaper way than the logits, else None."""
    return w.greedy_tokens(hidden, pick) if isinstance(w, Packed) else None


def attention(q, k, v, mask, layer, reference):
    """`reference(q, k, v, mask)` (XLA attention over the layer's caches), or the backend's kernel for it where one
    applies: only the slots a row may attend, summed in slot order, so a row's output does not depend on the
    other rows. k, v are stacked [L, ...] caches when `layer` is given."""
    if _cpu.attention_usable(q, k):
        return _cpu.attention(q, k, v, mask, layer, reference)
    if layer is not None:
        k, v = k[layer], v[layer]
    return reference(q, k, v, mask)


def as_stored(w, dtype):
    """A weight for activations of `dtype`: packed weights and float16 weights under float32 activations stay as
    stored (products widen them exactly as they read them), anything else is cast."""
    if isinstance(w, Packed):
        return w
    return w if (w.dtype == jnp.float16 and dtype == jnp.float32) else w.astype(dtype)


def is_block(x) -> bool:
    """A weight kept as GGUF blocks (any layout)."""
    return _quant.is_block(x)


def has_blocks(tree) -> bool:
    """Whether any weight of `tree` is kept as GGUF blocks."""
    return _quant.has_blocks(tree)


def has_panels(tree) -> bool:
    """Whether any float weight of `tree` is laid out for the backend's products (the CPU's panel-major matrices)."""
    return _panels.has_panels(tree)


def unpacked(tree):
    """The same pytree with every backend-laid-out float weight as its plain row-major array."""
    return _panels.unpack_params(tree)


def as_float(w):
    """A weight as its plain float array in the logical layout: GGUF blocks dequantized, panels unpacked."""
    return _quant.as_float(w)


def describe_weights(tree) -> str:
    """How a pytree's weights are stored, for records: e.g. 'float32', 'float32 (panels)', 'gguf blocks q4_1+q8_0'."""
    return _quant.describe(tree)


def quantize(w, kind: str, transposed: bool = False):
    """`w` stored as GGUF blocks of `kind` (gguf's reference quantizer): transposed=True for a [K, N] matrix used
    as x @ w."""
    return _quant.quantize(w, kind, transposed=transposed)


def pack_head(params: dict, lm_sub, target_params) -> dict | None:
    """An EAGLE-1/2 head's decode params laid out as its target's are (panel-major float or quantized panels), so
    a draft step reads them as the target's products do; None when the target's weights are not packed."""
    return _pack.pack_draft(params, lm_sub, target_params)


def choose_kernel_variants(force: bool = False) -> dict | None:
    """Where the backend has several exact variants of a product (the CPU's AVX-512 and AVX2 panel tiles), time them
    on this device once and keep the faster per row count; the choice is saved per CPU model and applied at load,
    and the results' bits never depend on it. Returns the choice (None where there is nothing to choose), measuring
    only when none is saved or `force`."""
    if not _cpu.avx512():
        return None
    saved = None if force else _cpu.read_panel_tiles()
    return saved if saved is not None else _cpu.choose_panel_tiles()
