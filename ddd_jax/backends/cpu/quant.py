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

On CPU, `load_target` stores them panel-major instead (`BlockPanels`, `pack_blocks`): the kernel
(`kernels.product_qpanels`) dequantizes a panel's K rows in registers and reduces in the float32 panel kernel's
order, so a product is bitwise the float32 panels' product of the dequantized weight (a GGUF target's logits are
its float32 load's, bit for bit). `BlockPanels.int8` (`load_target(..., gguf_blocks="int8")`) multiplies the same
panels by integer dot products over int8-quantized activations instead (`kernels.product_qpanels_int8`): close to
the float32 product, not bitwise, and still independent of the number of rows.

`layers.linear` and `layers.embed` take a BlockWeight wherever they take an array; off CPU, for more than
`kernels.MAX_ROWS` rows, and for gradients (with respect to the activations only; blocks are constants) the weight
is dequantized by XLA.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .. import Packed, check_layout
from .layout import (BLOCK, GGUF_KINDS, KINDS, from_panels, panel_header, quant_offset, to_panels,  # noqa: F401
                     check_kind, dequantize_blocks)
from .panels import PANEL, is_panels, unpack


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class BlockWeight(Packed):
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

    def product(self, x, layer=None, *, transposed: bool = False):
        """x @ rows.T (outputs are rows): the block kernel, bitwise the float32 kernel's product of the dequantized
        weight."""
        from . import kernels
        check_layout(self, not self.transposed, transposed)
        return kernels.product_blocks(x, self.blocks, self.kind, layer)

    def take(self, ids):
        return take_rows(self, ids)

    def as_rows(self):
        return BlockWeight(self.blocks, self.kind, transposed=False)


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True, eq=False)  # identity: its arrays have no truth value
class BlockPanels(Packed):
    """GGUF blocks stored panel-major: the layout the CPU kernel streams (`pack_blocks`; the C++ file's
    "quantized panels"). The same bytes as a BlockWeight, regrouped so that a product reads each panel's K rows as
    one contiguous run, dequantizes them in registers and reduces every output element in the float32 panels'
    order: a product is bitwise the float32 product of the dequantized weight (for a GGUF target: its float32
    load's product), for every number of rows, from ~1/6 of the bytes.

    data: [..., P, K // 32, 48 * block bytes] uint8 -- panel p, K block b: the blocks of output columns
        [48p, 48p + 48) over K rows [32b, 32b + 32) (zero blocks past n), as 48 float16 d, (q4_1) 48 float16 m,
        then the quants K row by K row: [16][48] bytes (q4_*: byte (j, c) holds rows j and 16 + j of column c in its
        low and high nibble, as in a GGUF block) or [32][48] int8 (q8_0). With `int8` the quants are quad-major
        instead, the order the integer dot products read: [nq / 4][48][4], byte rows 4i .. 4i + 3 of column c
        side by side (one 32-bit lane), so the kernel never reorders a byte (`layout.quant_offset`).
    kind: "q4_1" | "q8_0" | "q4_0"; n: the output width N; rows: the logical layout -- False [..., K, N] (x @ w:
        decoder matrices, an untied lm_head), True [..., N, K] (output rows: a tied embedding, used as x @ w.T);
        all static.
    table: None, or (rows layout, unstacked) the same matrix as a row-layout BlockWeight, for lookups.
    int8: (static) products by integer dot products (`gguf_blocks="int8"`): each activation row quantized per 32
        values to int8 with a float32 scale, exact integer sums against the blocks, scaled in float32
        (`kernels.product_qpanels_int8`) -- close to the float32 product, not bitwise, and still the same bits for
        a row whatever the number of rows. False: the exact float32 product of the dequantized weight.
    """

    data: jax.Array
    kind: str
    n: int
    rows: bool = False
    table: "BlockWeight | None" = None
    int8: bool = False

    def tree_flatten(self):
        return (self.data, self.table), (self.kind, self.n, self.rows, self.int8)

    @classmethod
    def tree_unflatten(cls, aux, children):
        kind, n, rows, int8 = aux
        return cls(children[0], kind, n, rows, table=children[1], int8=int8)

    @property
    def block_bytes(self) -> int:
        return KINDS[self.kind][1]

    @property
    def in_features(self) -> int:
        return self.data.shape[-2] * BLOCK

    @property
    def shape(self) -> tuple:
        """The logical float shape (as the float32 weight it stands for)."""
        lead, K = tuple(self.data.shape[:-3]), self.in_features
        return lead + ((self.n, K) if self.rows else (K, self.n))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.data.shape)) + (0 if self.table is None else self.table.nbytes)

    @property
    def T(self) -> "BlockPanels":
        """The same panels as the transposed logical matrix (no copy)."""
        return BlockPanels(self.data, self.kind, self.n, not self.rows, int8=self.int8)

    def blocks(self) -> BlockWeight:
        """The GGUF blocks back in their row layout (a BlockWeight: outputs as rows)."""
        return BlockWeight(from_panels(self.data, self.kind, self.n, self.int8), self.kind, transposed=not self.rows)

    def dequantize(self) -> jax.Array:
        """The float32 weight in its logical layout (`shape`)."""
        return self.blocks().dequantize()

    def take(self, ids):
        """Rows `ids` [...] of an unstacked rows-layout weight [N, K], dequantized: [..., K] float32 (from its
        table if it keeps one, else gathered out of the panels: the same values)."""
        if not self.rows or self.data.ndim != 3:
            raise ValueError("BlockPanels.take needs an unstacked rows-layout weight (an embedding)")
        if self.table is not None:
            return take_rows(self.table, ids)
        ids = jnp.asarray(ids, jnp.int32)
        c = (ids % PANEL)[..., None, None]
        nq = panel_header(self.kind)[1]
        d = 2 * c + jnp.arange(2)
        offs = [d, d + 2 * PANEL] if self.kind == "q4_1" else [d]
        offs.append(quant_offset(self.kind, jnp.arange(nq), c, self.int8))
        offs = jnp.concatenate([jnp.broadcast_to(o, ids.shape + (1, o.shape[-1])) for o in offs], -1)
        got = jnp.take_along_axis(self.data[ids // PANEL], offs, axis=-1)  # [..., nb, block bytes]
        return dequantize_blocks(got.reshape(*ids.shape, -1), self.kind)

    def product(self, x, layer=None, *, transposed: bool = False):
        """x @ w (or x @ rows.T): dequantized in registers, bitwise the float32 panels' product; with `int8`, by
        integer products over int8-quantized activations (`kernels.product_qpanels_int8`)."""
        from . import kernels
        check_layout(self, self.rows, transposed)
        if self.int8:
            return kernels.product_qpanels_int8(x, self.data, self.kind, self.n, layer)
        return kernels.product_qpanels(x, self.data, self.kind, self.n, layer)

    def greedy(self, hidden, pick):
        """With `int8`, an unstacked output projection: (logits, tokens) in one kernel call, the tokens found while
        each column chunk is in cache (`kernels.greedy_qpanels_int8`). Else None (logits, then `pick`)."""
        if not self.int8 or self.data.ndim != 3:
            return None
        from . import kernels
        return kernels.greedy_qpanels_int8(hidden, self.data, self.kind, self.n, pick)


def pack_blocks(w: BlockWeight, table: bool = False, int8: bool | None = None) -> BlockPanels:
    """A BlockWeight as BlockPanels (the same bytes, panel-major). table=True (an unstacked row-layout weight: an
    embedding) keeps the BlockWeight for lookups (`BlockPanels.take`). int8=True: products by integer dot products
    (`BlockPanels.int8`, its quants quad-major); None: a BlockPanels keeps its own, a BlockWeight gets the exact
    float32 product."""
    if isinstance(w, BlockPanels):
        if int8 is None or w.int8 == int8:
            return w
        data = to_panels(from_panels(w.data, w.kind, w.data.shape[-3] * PANEL, w.int8), w.kind, bool(int8))
        return BlockPanels(data, w.kind, w.n, w.rows, table=w.table, int8=bool(int8))
    if not isinstance(w, BlockWeight):
        raise ValueError(f"pack_blocks takes a BlockWeight, not {type(w).__name__}")
    if table and (w.transposed or w.ndim != 2):
        raise ValueError("pack_blocks: a lookup table goes with an unstacked row-layout BlockWeight (an embedding)")
    n = w.blocks.shape[-2]
    return BlockPanels(to_panels(jnp.asarray(w.blocks), w.kind, bool(int8)), w.kind, n, rows=not w.transposed,
                       table=w if table else None, int8=bool(int8))


def pack_block_params(params: dict, tied: bool, int8: bool = False) -> dict:
    """A target's params with every BlockWeight panel-major (`BlockPanels`): the stacked layer matrices, an untied
    lm_head, and a tied embedding (which keeps its BlockWeight as the lookup table). Anything else as it is.
    int8=True: the layer matrices and the output projection take integer products (`BlockPanels.int8`); the
    embedding's lookups stay exact (its rows dequantized)."""
    out = dict(params)
    out["layers"] = {k: pack_blocks(v, int8=int8) if is_block(v) else v for k, v in params["layers"].items()}
    if "lm_head" in params and is_block(params["lm_head"]):
        out["lm_head"] = pack_blocks(params["lm_head"], int8=int8)
    if tied and is_block(params["embed"]):
        out["embed"] = pack_blocks(params["embed"], table=True, int8=int8)
    return out


def int8_products(x, ws, layer=None):
    """(x @ w for w in ws) in one integer product (`kernels.product_qpanels_int8_group`: x quantized once, one call)
    when every w is an int8 BlockPanels in the x @ w layout with x's K and the same stacking; else None (the caller
    multiplies one weight at a time: the same bits)."""
    from . import kernels
    ok = (len(ws) > 1 and all(isinstance(w, BlockPanels) and w.int8 and not w.rows for w in ws)
          and len({(w.in_features, w.data.ndim) for w in ws}) == 1 and ws[0].in_features == x.shape[-1])
    if not ok:
        return None
    return kernels.product_qpanels_int8_group(x, [w.data for w in ws], [w.kind for w in ws], [w.n for w in ws],
                                              layer)


def has_int8_blocks(tree) -> bool:
    """Whether any weight of `tree` is GGUF blocks multiplied by integer products (`BlockPanels.int8`)."""
    return any(isinstance(x, BlockPanels) and x.int8 for x in jax.tree.leaves(tree, is_leaf=is_block))


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
    """A weight kept as GGUF blocks: a BlockWeight or BlockPanels."""
    return isinstance(x, (BlockWeight, BlockPanels))


def has_blocks(tree) -> bool:
    return any(is_block(x) for x in jax.tree.leaves(tree, is_leaf=is_block))


def has_block_panels(tree) -> bool:
    """Whether any weight of `tree` is GGUF blocks stored panel-major (`BlockPanels`)."""
    return any(isinstance(x, BlockPanels) for x in jax.tree.leaves(tree, is_leaf=is_block))


def as_float(w):
    """A float array for w: a BlockWeight dequantized, a `panels.PanelWeight` unpacked (logical layout), anything
    else as it is."""
    return w.dequantize() if is_block(w) else unpack(w)


def dequantize_tree(tree):
    """The same pytree with every BlockWeight and PanelWeight replaced by its float array (logical layout)."""
    stored = lambda x: is_block(x) or is_panels(x)  # noqa: E731
    return jax.tree.map(as_float, tree, is_leaf=stored)


def describe(tree) -> str:
    """'float32' (the float dtype of plain weights; ' (panels)' when panel-major, ' (16-column panels)' for
    16-column ones, ' + int8 screen' when the output projection has one: `panels.screen_of`), or e.g.
    'gguf blocks q4_1+q8_0' when any weight is blocks (' (panels)' when they are BlockPanels)."""
    blocks = [x for x in jax.tree.leaves(tree, is_leaf=is_block) if is_block(x)]
    if blocks:
        layout = " (panels)" if any(isinstance(x, BlockPanels) for x in blocks) else ""
        layout += " int8" if any(isinstance(x, BlockPanels) and x.int8 for x in blocks) else ""
        return "gguf blocks " + "+".join(sorted({x.kind for x in blocks})) + layout
    floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    from .panels import PANEL16, is_panels, width_of
    width = width_of(tree)
    layout = "" if width is None else " (16-column panels)" if width == PANEL16 else " (panels)"
    if any(x.screen is not None for x in jax.tree.leaves(tree, is_leaf=is_panels) if is_panels(x)):
        layout += " + int8 screen"
    return str(floats[0].dtype) + layout if floats else "none"


def nbytes_tree(tree) -> int:
    """Bytes of the stored weights (blocks count as stored)."""
    return sum(x.nbytes if is_block(x) else int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree, is_leaf=is_block))
