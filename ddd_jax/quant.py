"""Weights kept as a GGUF file's quantized blocks (weight-only; float32 activations and arithmetic).

A `BlockWeight` holds one matrix (or a stack of them) exactly as llama.cpp stores it: one row per output feature,
each row K/32 blocks of 32 weights.

    q4_1 (20 bytes a block): float16 d, float16 m, 16 bytes of nibbles -- w = d * q + m (q in 0..15; element
                             j < 16 is the low nibble of byte j, element 16 + j its high nibble)
    q8_0 (34 bytes a block): float16 d, 32 int8 -- w = d * q
    q4_0 (18 bytes a block): float16 d, 16 bytes of nibbles as q4_1's -- w = d * (q - 8)

`dequantize_blocks` computes what `gguf.quants.dequantize` computes, bit for bit (in float32 d * q is exact, so
the one rounding is the same), and so does the CPU kernel (`kernels.product_blocks`), which dequantizes four rows
(eight on AVX-512) at a time into L1 and multiplies them with the float32 transposed kernel: a product with a
BlockWeight equals that kernel's product with the dequantized weight, and a row's result does not depend on the
other rows (decoding and tree verification stay token-identical). What changes is the bytes a forward streams:
SmolLM2-135M's Q4_1 layers and Q8_0 embedding are ~96 MB against 540 MB of float32.

`layers.linear` and `layers.embed` take a BlockWeight wherever they take an array; off CPU, for more than
`kernels.MAX_ROWS` rows, and for gradients (with respect to the activations only; blocks are constants) the weight
is dequantized by XLA.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .panels import has_panels, is_panels, unpack

BLOCK = 32
KINDS = {"q4_1": (0, 20), "q8_0": (1, 34), "q4_0": (2, 18)}  # name -> (the kernel's `kind` attribute, bytes a block)
GGUF_KINDS = {"Q4_1": "q4_1", "Q8_0": "q8_0", "Q4_0": "q4_0"}  # gguf.GGMLQuantizationType names kept as blocks


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class BlockWeight:
    """A weight stored as GGUF blocks.

    blocks: [..., R, K // 32 * bytes] uint8 -- R output rows (a leading layer axis when stacked), K inputs each.
    kind: "q4_1" | "q8_0" | "q4_0" (static).
    transposed: (static) the weight's logical layout is [..., K, R] (x @ w, our decoder layout: wq [L, D, N*H]);
        False: [..., R, K] (output-embedding rows: the tied embedding [V, D]).
    """

    blocks: jax.Array
    kind: str
    transposed: bool = False

    def tree_flatten(self):
        return (self.blocks,), (self.kind, self.transposed)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def block_bytes(self) -> int:
        return KINDS[self.kind][1]

    @property
    def in_features(self) -> int:
        return self.blocks.shape[-1] // self.block_bytes * BLOCK

    @property
    def shape(self) -> tuple:
        """The logical float shape (as the float32 weight it stands for)."""
        lead, R, K = tuple(self.blocks.shape[:-2]), self.blocks.shape[-2], self.in_features
        return lead + ((K, R) if self.transposed else (R, K))

    @property
    def ndim(self) -> int:
        return len(self.blocks.shape)

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)  # the dtype of the values it stands for (and of every product's result)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.blocks.shape))

    def rows(self) -> jax.Array:
        """[..., R, K] float32: the dequantized rows (storage layout)."""
        return dequantize_blocks(self.blocks, self.kind)

    def dequantize(self) -> jax.Array:
        """The float32 weight in its logical layout (`shape`)."""
        w = self.rows()
        return jnp.swapaxes(w, -1, -2) if self.transposed else w


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


def quantize(w, kind: str, transposed: bool = False) -> BlockWeight:
    """A float weight stored as `kind` blocks by gguf's reference quantizer (numpy, on the host; lossy, as a GGUF
    file's own weights were). w is the logical weight: [..., K, R] with transposed (x @ w), else rows [..., R, K];
    K a multiple of 32."""
    import gguf
    from gguf.quants import quantize as gguf_quantize
    check_kind(kind)
    a = np.asarray(w, np.float32)
    rows = np.swapaxes(a, -1, -2) if transposed else a
    if rows.ndim < 2 or rows.shape[-1] % BLOCK:
        raise ValueError(f"quantize: the reduced axis of a weight of shape {a.shape} is not a multiple of {BLOCK}")
    blocks = gguf_quantize(np.ascontiguousarray(rows), gguf.GGMLQuantizationType[kind.upper()])
    return BlockWeight(jnp.asarray(blocks), kind, transposed)


def take_rows(w: BlockWeight, idx):
    """Rows `idx` of an untransposed (row-layout, e.g. embedding) BlockWeight, dequantized: [..., K] float32."""
    if w.transposed or w.ndim != 2:
        raise ValueError("take_rows needs an unstacked row-layout BlockWeight (an embedding)")
    return dequantize_blocks(jnp.take(w.blocks, idx, axis=0), w.kind)


def is_block(x) -> bool:
    return isinstance(x, BlockWeight)


def has_blocks(tree) -> bool:
    return any(is_block(x) for x in jax.tree.leaves(tree, is_leaf=is_block))


def as_float(w):
    """A float array for w: a BlockWeight dequantized, a `panels.PanelWeight` unpacked (logical layout), anything
    else as it is."""
    return w.dequantize() if is_block(w) else unpack(w)


def dequantize_tree(tree):
    """The same pytree with every BlockWeight and PanelWeight replaced by its float array (logical layout)."""
    stored = lambda x: is_block(x) or is_panels(x)  # noqa: E731
    return jax.tree.map(as_float, tree, is_leaf=stored)


def describe(tree) -> str:
    """'float32' (the float dtype of plain weights), or e.g. 'gguf blocks q4_1+q8_0' when any weight is blocks."""
    kinds = sorted({x.kind for x in jax.tree.leaves(tree, is_leaf=is_block) if is_block(x)})
    if kinds:
        return "gguf blocks " + "+".join(kinds)
    floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    layout = " (panels)" if has_panels(tree) else ""
    return str(floats[0].dtype) + layout if floats else "none"


def nbytes_tree(tree) -> int:
    """Bytes of the stored weights (blocks count as stored)."""
    return sum(x.nbytes if is_block(x) else int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree, is_leaf=is_block))
