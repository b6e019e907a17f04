"""Panel-major float32 weights (and a float16 draft head's): the layout the CPU kernel streams fastest.

A decoder matrix [..., K, N] (x @ w: wq, wk, wv, wo, w_gate, w_up, w_down) is stored as [..., P, K, W] with
P = ceil(N / W): panel p holds columns [W p, W p + W) row by row, zeros past N. The width W is 48 by default and 16
on request (`load_target(..., panels=16)`, `pack(..., width=16)`, or `DDD_JAX_PANEL_WIDTH=16` for every default):
on AVX-512 hosts 16-column panels let the kernel run 9 or more rows as 16-row tiles that read each weight from
memory once, but its 3- to 8-row tiles then read three panels as three streams where the 48-column tile reads one
(docs/cpu.md weighs the two). The kernel reads either width, with the same bits. A product reads each panel's K rows
as one contiguous run of memory -- a few sequential streams the hardware prefetchers follow -- where the row-major
[K, N] layout is read as K rows N floats apart.

The kernel (`kernels.product_panels`) reduces every output element in the same order as the row-major kernel, so
a product is bitwise the unpacked weight's product, for every number of rows: decoding and tree verification stay
token-identical. llama.cpp repacks its CPU weights at load the same way. Off CPU (and without the kernel library)
the weight is unpacked by XLA for the product; gradients go through XLA too.

`load_target(..., panels=None)` packs a float32 target's layer matrices and its output projection (a tied embedding
as rows: the panels of its transpose, plus its row-major array for lookups) when the CPU kernel runs (the CPU
backend, no mesh); `panels=False` keeps the row-major arrays. A draft head bound to a panel-major target packs its
own matrices and draft-vocabulary rows for the decode loops too (`pack_head`, `Draft.packed`; float16 as stored).
The output projection also gets a **screen** where the CPU has AVX-512 BF16 (`kernels.screen()`): an int8 copy of
its rows, 48-column panels of k pairs, with two error-bound floats and a scale per output column (`screen_of`).
Greedy decoding's lm_head (`llama.forward(..., greedy=True, return_logits=False)`) runs bfloat16 products over it
(the int8 weights widen exactly), keeps every column that could still be the row's maximum under a certified bound
and recomputes those exactly from the float32 panels, so the token is the exact product's first maximum
(`kernels.greedy_screened`). It reads a quarter of the bytes at one row and does half the instructions at many.
`pack_params(..., screen=False)` goes without.
Wherever a float array is wanted (saving, the PyTorch counterpart, nnx modules) `unpack` / `unpack_params` (and
`quant.as_float` / `quant.dequantize_tree`) give the logical weight back.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .. import Packed, check_layout
from .layout import DTYPES, PANEL, PANEL16, WIDTHS, pack_array, unpack_array  # noqa: F401 (re-exported)


def default_width() -> int:
    """The panel width `pack` uses when given none: `DDD_JAX_PANEL_WIDTH` (16 or 48) when set, else 48. Either
    width gives the same bits."""
    import os
    env = os.environ.get("DDD_JAX_PANEL_WIDTH")
    if env:
        if env not in ("16", "48"):
            raise ValueError(f"DDD_JAX_PANEL_WIDTH={env!r}: panels are 16 or 48 columns wide")
        return int(env)
    return PANEL


def width_of(tree) -> int | None:
    """The width of the first PanelWeight in `tree` (None: it holds none) -- what a head bound to a target packs
    its own panels with."""
    for x in jax.tree.leaves(tree, is_leaf=is_panels):
        if is_panels(x):
            return x.width
    return None


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True, eq=False)  # identity: its array has no truth value
class PanelWeight(Packed):
    """A float32 (or float16) matrix stored panel-major.

    data: [..., P, K, W] float32 or float16 -- P = ceil(N / W) panels of W (`width`: 16 or 48) columns (a leading
        layer axis when stacked).
    n: (static) N, the product's output width (the last panel's columns past it are zeros).
    rows: (static) the logical layout: False -- [..., K, N], used as x @ w (decoder matrices, an untied lm_head
        [D, V]); True -- [..., N, K], output rows used as x @ w.T (a tied embedding [V, D], whose lookups gather
        its rows back out of the panels).
    table: None, or (rows layout, unstacked) the same matrix row-major [N, K], kept for lookups: a row out of the
        panels touches one cache line per float (K lines, W floats apart), out of the table one per 16 floats.
        A tied embedding keeps one (`pack_params`), for 4 bytes more per weight.
    screen: None, or (unstacked output projection) its int8 copy [ceil(N / 48), ceil(K / 2), 96] for greedy
        decoding's screened lm_head (`screen_of`; 1 byte more per weight).
    screen_bound: None, or [3, N] float32: the screen's per-column error bounds and scales (`screen_of`).
    """

    data: jax.Array
    n: int
    rows: bool = False
    table: jax.Array | None = None
    screen: jax.Array | None = None
    screen_bound: jax.Array | None = None

    def tree_flatten(self):
        return (self.data, self.table, self.screen, self.screen_bound), (self.n, self.rows)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux, table=children[1], screen=children[2], screen_bound=children[3])

    @property
    def shape(self) -> tuple:
        """The logical shape, [..., K, N] (or [..., N, K] for rows), of the array it stands for."""
        K = self.data.shape[-2]
        return tuple(self.data.shape[:-3]) + ((self.n, K) if self.rows else (K, self.n))

    @property
    def width(self) -> int:
        """Columns of one panel (16 or 48)."""
        return int(self.data.shape[-1])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return sum(int(a.size) * a.dtype.itemsize for a in (self.data, self.table, self.screen, self.screen_bound)
                   if a is not None)

    @property
    def T(self) -> "PanelWeight":
        """The same panels as the transposed logical matrix (no copy)."""
        return PanelWeight(self.data, self.n, not self.rows)

    def unpack(self) -> jax.Array:
        if self.table is not None:
            return self.table
        w = unpack_array(self.data, self.n)
        return jnp.swapaxes(w, -1, -2) if self.rows else w

    def take(self, ids):
        """Rows `ids` [...] of an unstacked rows-layout weight [N, K]: [..., K] (from its table if it keeps one,
        else gathered out of the panels: the same values)."""
        if not self.rows or self.data.ndim != 3:
            raise ValueError("PanelWeight.take needs an unstacked rows-layout weight (a tied embedding)")
        ids = jnp.asarray(ids, jnp.int32)
        if self.table is not None:
            return jnp.take(self.table, ids, axis=0)
        W = self.width
        return self.data[ids // W, :, ids % W]

    def product(self, x, layer=None, *, transposed: bool = False):
        """x @ w (or x @ rows.T for a rows-layout one): the panel kernel, bitwise the row-major product."""
        from . import kernels
        check_layout(self, self.rows, transposed)
        return kernels.product_panels(x, self.data, self.n, layer)

    def greedy(self, hidden, pick):
        """(logits, tokens) in one kernel call: the tokens found while each column chunk is in cache."""
        from . import kernels
        return kernels.greedy_panels(hidden, self.data, self.n, pick)

    def greedy_tokens(self, hidden, pick):
        """With an int8 screen: bfloat16 products over the int8 copy, the columns that could still be the maximum
        recomputed exactly -- the same tokens from a quarter of the bytes."""
        if self.screen is None:
            return None
        from . import kernels
        return kernels.greedy_screened(hidden, self.data, self.n, self.screen, self.screen_bound, pick)


SCREEN = 48  # columns of a screen panel (the kernel's; whatever the float32 panels' width)
_U = 2.0 ** -24


def screen_gamma(K: int) -> float:
    """The summation-error factor of the screen's bound for K products, taken twice over (see `screen_of`)."""
    return 2.0 * (2.0 * K * _U / (1.0 - 2.0 * K * _U))


def screen_of(rows):
    """The screen of an output projection given as its output rows [N, K] float32 (a tied embedding as it is, an
    untied lm_head [D, V] transposed): (screen [ceil(N / 48), ceil(K / 2), 96] int8, bound [3, N] float32).

    screen: each row v as int8 q_v with one float32 scale s_v = max |w_v| / 127 (q = round(w / s), so the copy is
        w^_v = s_v q_v), panel p holding rows [48 p, 48 p + 48), k in pairs: [p, i, 2 c + j] = q[48 p + c, 2 i + j],
        zeros past N and K (and for a row that is not finite or tiny).
    bound: A_v = gamma |w_v| + |w_v - w^_v|, B_v = |w^_v| (2-norms over k, in float32, inflated by
        max(1e-3, 8 K 2^-24) to cover their rounding; gamma = `screen_gamma(K)`), and s_v. A_v = inf for a row
        that is not finite, has |w_v| >= 1e7 or has its largest weight in (0, 1e-18), so the kernel always
        recomputes it. With these the kernel bounds
        |exact - screened| for a row x by |x| A_v + (|x - x~| + gamma |x~|) B_v plus the float32 rounding of the
        screened logit (x~: x in bfloat16), a Cauchy-Schwarz bound plus both products' summation errors
        (csrc/cpu_kernels.cc, "greedy lm_head screened by an int8 copy")."""
    if np.ndim(rows) != 2:
        raise ValueError(f"screen_of: rows must be [N, K]; got {np.shape(rows)}")
    # rows of tiny nonzero weights, whose squares (and scale) may underflow or be flushed to zero in float32
    # arithmetic, are always recomputed; found on the host, where nothing is flushed
    amax = np.abs(np.asarray(rows, np.float32)).max(axis=1)
    return _screen_of(jnp.asarray(rows, jnp.float32), jnp.asarray((amax > 0) & (amax < 1e-18)))


@jax.jit
def _screen_of(w, tiny):
    N, K = w.shape
    P, K2 = -(-N // SCREEN), -(-K // 2)
    scale = jnp.max(jnp.abs(w), axis=-1) / 127.0
    ok = jnp.isfinite(scale) & ~tiny
    scale = jnp.where(ok, scale, 0.0)
    q = jnp.where(scale[:, None] > 0, jnp.clip(jnp.round(w / jnp.where(scale > 0, scale, 1.0)[:, None]), -127, 127),
                  0.0)
    q = jnp.where(jnp.isfinite(q), q, 0.0)
    copy = q * scale[:, None]  # w^, rounded to float32: within 2^-24 |w^| per weight (the 4 2^-24 |w^| term)
    # float32 sums of K squares are within ~(K + 1) 2^-24 of the exact ones in any order, and the sqrt, products and
    # sums below add a few 2^-24 more: the inflation covers twice that
    inflate = 1.0 + max(1e-3, 8 * K * _U)
    nw = jnp.sqrt(jnp.sum(w * w, axis=-1))
    nc = jnp.sqrt(jnp.sum(copy * copy, axis=-1))
    A = (screen_gamma(K) * nw + jnp.sqrt(jnp.sum((w - copy) ** 2, axis=-1)) + 4 * _U * nc) * inflate
    A = jnp.where(ok & jnp.isfinite(nw) & (nw < 1e7), A, jnp.inf)
    B = nc * inflate
    bound = jnp.stack([A, jnp.where(jnp.isnan(B), jnp.inf, B), scale])
    qp = jnp.zeros((P * SCREEN, 2 * K2), jnp.int8).at[:N, :K].set(q.astype(jnp.int8))
    return qp.reshape(P, SCREEN, K2, 2).transpose(0, 2, 1, 3).reshape(P, K2, 2 * SCREEN), bound


def with_screen(w: "PanelWeight", screen: bool = True) -> "PanelWeight":
    """An unstacked output projection's PanelWeight with (screen=True) or without its screen (`screen_of`)."""
    if not screen:
        return PanelWeight(w.data, w.n, w.rows, table=w.table)
    if w.screen is not None:
        return w
    if w.data.ndim != 3 or w.dtype != jnp.float32:
        raise ValueError("with_screen: a screen goes with an unstacked float32 output projection")
    rows = w.unpack()
    scr, bound = screen_of(rows if w.rows else rows.T)
    return PanelWeight(w.data, w.n, w.rows, table=w.table, screen=scr, screen_bound=bound)


def pack(w, rows: bool = False, table: bool = False, width: int | None = None) -> PanelWeight:
    """A float32 matrix as a PanelWeight (the same values, panel-major): [..., K, N] used as x @ w, or with
    rows=True [..., N, K] output rows used as x @ w.T (a tied embedding). table=True (rows, unstacked) keeps the
    row-major matrix too, for lookups (`PanelWeight.table`). width: columns a panel, 16 or 48 (default
    `default_width()`); a PanelWeight of another width is repacked (without its screen: `with_screen`)."""
    if table and (not rows or w.ndim != 2):
        raise ValueError(f"pack: a lookup table goes with an unstacked rows-layout matrix (a tied embedding [V, D]); "
                         f"got rows={rows}, shape {tuple(w.shape)}")
    width = default_width() if width is None else width
    if width not in WIDTHS:
        raise ValueError(f"pack: width={width}: panels are 16 or 48 columns wide")
    if isinstance(w, PanelWeight):
        if w.rows != rows:
            raise ValueError(f"a {'rows' if w.rows else 'x @ w'} PanelWeight asked for as "
                             f"{'rows' if rows else 'x @ w'}")
        if w.width != width:
            return pack(w.unpack(), rows, table or w.table is not None, width)
        if table and w.table is None:
            return PanelWeight(w.data, w.n, True, table=w.unpack(), screen=w.screen, screen_bound=w.screen_bound)
        return w
    if w.ndim < 2 or jnp.dtype(w.dtype) not in DTYPES:
        raise ValueError(f"panels hold float32 (or float16) matrices [..., K, N]; got {jnp.dtype(w.dtype)} "
                         f"{tuple(w.shape)}")
    if rows:
        w = jnp.asarray(w)
        return PanelWeight(pack_array(jnp.swapaxes(w, -1, -2), width), int(w.shape[-2]), True,
                           table=w if table else None)
    return PanelWeight(pack_array(w, width), int(w.shape[-1]))


def unpack(w):
    """The row-major array for a PanelWeight; anything else as it is."""
    return w.unpack() if isinstance(w, PanelWeight) else w


def is_panels(x) -> bool:
    return isinstance(x, PanelWeight)


def has_panels(tree) -> bool:
    return any(is_panels(x) for x in jax.tree.leaves(tree, is_leaf=is_panels))


def pack_params(params: dict, width: int | None = None, screen: bool | None = None) -> dict:
    """A target's params with its float32 matrices panel-major: every stacked layer matrix ([L, K, N] under
    "layers"), the output projection -- an untied lm_head [D, V], or else the tied embedding [V, D] as rows, which
    keeps its row-major array as the lookup table (`PanelWeight.table`; an untied model's embedding is only looked
    up and stays as it is). Norms and biases stay as they are. width: columns a panel (default `default_width()`).
    screen: give the output projection its int8 screen for greedy decoding (`screen_of`); None: where the
    kernel runs it (`kernels.screen()`)."""
    if screen is None:
        from . import kernels
        screen = kernels.screen()
    out = dict(params)
    out["layers"] = {k: pack(v, width=width) if _packable(v, 3) else v for k, v in params["layers"].items()}
    key = "lm_head" if "lm_head" in params else "embed"
    if key == "lm_head":
        if _packable(params["lm_head"], 2):
            out["lm_head"] = pack(params["lm_head"], width=width)
    elif _packable(params["embed"], 2):
        out["embed"] = pack(params["embed"], rows=True, table=True, width=width)
    if isinstance(out[key], PanelWeight) and out[key].dtype == jnp.float32 and out[key].data.ndim == 3:
        out[key] = with_screen(out[key], screen)
    return out


def pack_head(params: dict, width: int | None = None) -> dict:
    """A draft head's params with its float32 / float16 matrices panel-major: `fc_w` [2D, D] and the layer's
    [1, K, N] products (x @ w). Norms, biases and `d2t` stay as they are. For the decode loops only (a head's
    `params` stay row-major arrays: saving, training and nnx modules use them)."""
    out = dict(params)
    if _packable(params.get("fc_w"), 2, DTYPES):
        out["fc_w"] = pack(params["fc_w"], width=width)
    out["layers"] = {k: pack(v, width=width) if _packable(v, 3, DTYPES) else v for k, v in params["layers"].items()}
    return out


def unpack_params(tree):
    """The same pytree with every PanelWeight replaced by its row-major array."""
    return jax.tree.map(unpack, tree, is_leaf=is_panels)


def _packable(v, ndim: int, dtypes=(jnp.dtype(jnp.float32),)) -> bool:
    return isinstance(v, PanelWeight) or (isinstance(v, (jax.Array, np.ndarray)) and v.ndim == ndim
                                          and jnp.dtype(v.dtype) in dtypes)


def auto() -> bool:
    """Whether panels pay here: the default backend is the CPU and the kernel library runs."""
    from . import kernels
    return jax.default_backend() == "cpu" and kernels.available()
