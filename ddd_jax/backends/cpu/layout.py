"""The CPU backend's array formats, below everything else in it: panel-major float matrices and GGUF blocks (plain
or panel-major) as arrays, and the exact dequantization (see `panels` and `quant` for the weight types)."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

PANEL = 48  # columns of a panel by default: three 16-float vectors (six 8-float AVX2 ones)
PANEL16 = 16  # on request: one AVX-512 vector
WIDTHS = (PANEL16, PANEL)
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16))  # float16: a draft head's weight-only storage
BLOCK = 32
KINDS = {"q4_1": (0, 20), "q8_0": (1, 34), "q4_0": (2, 18)}  # name -> (the kernel's `kind` attribute, bytes a block)
GGUF_KINDS = {"Q4_1": "q4_1", "Q8_0": "q8_0", "Q4_0": "q4_0"}  # gguf.GGMLQuantizationType names kept as blocks


@partial(jax.jit, static_argnames=("n",))
def unpack_array(data, n: int):
    """[..., P, K, W] -> [..., K, n]."""
    w = jnp.moveaxis(data, -3, -2)  # [..., K, P, W]
    return w.reshape(*w.shape[:-2], -1)[..., :n]


@partial(jax.jit, static_argnames=("width",))
def pack_array(w, width: int):
    K, N = w.shape[-2:]
    P = -(-N // width)
    w = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, P * width - N)])
    return jnp.moveaxis(w.reshape(*w.shape[:-1], P, width), -2, -3)  # [..., P, K, width]


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown block kind {kind!r}; known: {sorted(KINDS)}")


def dequantize_blocks(blocks, kind: str):
    """[..., R, nb * bytes] uint8 -> [..., R, nb * 32] float32, exactly as gguf's dequantizer (see module doc)."""
    check_kind(kind)
    nbytes = KINDS[kind][1]
    blocks = jnp.asarray(blocks)
    if blocks.dtype != jnp.uint8 or blocks.shape[-1] % nbytes:
        raise ValueError(f"{kind} blocks must be uint8 [..., R, n * {nbytes}]; got {blocks.dtype} {blocks.shape}")
    nb = blocks.shape[-1] // nbytes
    b = blocks.reshape(*blocks.shape[:-1], nb, nbytes)
    d = jax.lax.bitcast_convert_type(b[..., 0:2].reshape(*b.shape[:-1], 1, 2), jnp.float16).astype(jnp.float32)
    if kind == "q4_1":
        m = jax.lax.bitcast_convert_type(b[..., 2:4].reshape(*b.shape[:-1], 1, 2), jnp.float16).astype(jnp.float32)
        qs = b[..., 4:20]
        q = jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(jnp.float32)
        w = d * q + m
    elif kind == "q4_0":
        qs = b[..., 2:18]
        q = jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(jnp.int32) - 8
        w = d * q.astype(jnp.float32)
    else:
        q = jax.lax.bitcast_convert_type(b[..., 2:34], jnp.int8).astype(jnp.float32)
        w = q * d
    return w.reshape(*blocks.shape[:-1], nb * BLOCK)


def panel_header(kind: str) -> tuple[int, int]:
    """(bytes before a panel block's quants, quant bytes per column)."""
    return (4 * PANEL if kind == "q4_1" else 2 * PANEL), KINDS[kind][1] - (4 if kind == "q4_1" else 2)


QUAD = 4  # K rows (of one column) in one 32-bit lane of an integer dot product


def _quad_major(q, nq: int):
    """Quants [..., nq, 48] (byte row by byte row) -> [..., nq * 48] in the integer products' order: quad i of
    byte rows, column c, row 4i + t at (i, c, t)."""
    q = q.reshape(*q.shape[:-2], nq // QUAD, QUAD, PANEL)
    return jnp.swapaxes(q, -1, -2).reshape(*q.shape[:-3], -1)


def _row_major(q, nq: int):
    """The inverse of _quad_major: [..., nq * 48] -> [..., nq, 48]."""
    q = q.reshape(*q.shape[:-1], nq // QUAD, PANEL, QUAD)
    return jnp.swapaxes(q, -1, -2).reshape(*q.shape[:-3], nq, PANEL)


def quant_offset(kind: str, j, c, int8: bool):
    """Where byte j (0 .. nq-1) of column c's quants lies in a panel block (see BlockPanels)."""
    hdr = panel_header(kind)[0]
    return hdr + ((j // QUAD) * PANEL * QUAD + c * QUAD + j % QUAD if int8 else j * PANEL + c)


@partial(jax.jit, static_argnames=("kind", "int8"))
def to_panels(blocks, kind: str, int8: bool = False):
    """[..., R, nb * bytes] GGUF rows -> [..., P, nb, 48 * bytes] panels (see BlockPanels; `int8`: the quants in
    the integer products' quad-major order)."""
    nbytes = KINDS[kind][1]
    lead, R, nb = blocks.shape[:-2], blocks.shape[-2], blocks.shape[-1] // nbytes
    P = -(-R // PANEL)
    b = jnp.pad(blocks, [(0, 0)] * len(lead) + [(0, P * PANEL - R), (0, 0)])
    b = jnp.swapaxes(b.reshape(*lead, P, PANEL, nb, nbytes), -3, -2)  # [..., P, nb, 48, bytes]
    nq = panel_header(kind)[1]
    quants = nbytes - nq  # where a GGUF block's quants start (after d, m)
    parts = [b[..., 0:2].reshape(*b.shape[:-2], 2 * PANEL)]
    if kind == "q4_1":
        parts.append(b[..., 2:4].reshape(*b.shape[:-2], 2 * PANEL))
    q = jnp.swapaxes(b[..., quants:], -1, -2)  # [..., nq, 48]
    parts.append(_quad_major(q, nq) if int8 else q.reshape(*b.shape[:-2], -1))
    return jnp.concatenate(parts, -1)


@partial(jax.jit, static_argnames=("kind", "n", "int8"))
def from_panels(data, kind: str, n: int, int8: bool = False):
    """The inverse of to_panels: [..., P, nb, 48 * bytes] -> [..., n, nb * bytes]."""
    hdr, nq = panel_header(kind)
    lead, P = data.shape[:-3], data.shape[-3]
    parts = [data[..., 0:2 * PANEL].reshape(*data.shape[:-1], PANEL, 2)]
    if kind == "q4_1":
        parts.append(data[..., 2 * PANEL:4 * PANEL].reshape(*data.shape[:-1], PANEL, 2))
    q = _row_major(data[..., hdr:], nq) if int8 else data[..., hdr:].reshape(*data.shape[:-1], nq, PANEL)
    parts.append(jnp.swapaxes(q, -1, -2))
    b = jnp.concatenate(parts, -1)  # [..., P, nb, 48, bytes]
    b = jnp.swapaxes(b, -3, -2).reshape(*lead, P * PANEL, -1)
    return b[..., :n, :]
