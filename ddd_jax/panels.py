"""Panel-major float32 weights: the layout the CPU kernel streams fastest.

A decoder matrix [..., K, N] (x @ w: wq, wk, wv, wo, w_gate, w_up, w_down) is stored as [..., P, K, PANEL] with
P = ceil(N / PANEL): panel p holds columns [PANEL p, PANEL p + PANEL) row by row, zeros past N. A product then reads
each panel's K rows as one contiguous run of memory -- a few sequential streams the hardware prefetchers follow --
where the row-major [K, N] layout is read as KB rows N floats apart. On the 2-core Xeon VM, 30 SmolLM2-sized layers
streamed from memory take 20.0 -> 14.7 ms at one row and 26.8 -> 21.9 ms at 16 (the bench numbers are in README).

The kernel (`kernels.product_panels`) reduces every output element in the same order as the row-major kernel, so
a product is bitwise the unpacked weight's product, for every number of rows: decoding and tree verification stay
token-identical. llama.cpp repacks its CPU weights at load the same way. Off CPU (and without the kernel library)
the weight is unpacked by XLA for the product; gradients go through XLA too.

`load_target(..., panels=None)` packs a float32 target's layer matrices when the CPU kernel runs (the CPU backend,
no mesh); `panels=False` keeps the row-major arrays. Wherever a float array is wanted (saving, the PyTorch
counterpart, nnx modules) `unpack` / `unpack_params` (and `quant.as_float` / `quant.dequantize_tree`) give the
logical [..., K, N] weight back.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

PANEL = 48  # columns of a panel: three 16-float AVX-512 vectors (the kernel's register tile)


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True, eq=False)  # identity: its array has no truth value
class PanelWeight:
    """A float32 matrix [..., K, N] stored panel-major.

    data: [..., P, K, PANEL] float32 -- P = ceil(N / PANEL) panels (a leading layer axis when stacked).
    n: (static) N, the logical output width (the last panel's columns past it are zeros).
    """

    data: jax.Array
    n: int

    def tree_flatten(self):
        return (self.data,), (self.n,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def shape(self) -> tuple:
        """The logical shape [..., K, N] (as the row-major weight it stands for)."""
        return tuple(self.data.shape[:-3]) + (self.data.shape[-2], self.n)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return int(self.data.size) * self.data.dtype.itemsize

    def unpack(self) -> jax.Array:
        return unpack_array(self.data, self.n)


@partial(jax.jit, static_argnames=("n",))
def unpack_array(data, n: int):
    """[..., P, K, PANEL] -> [..., K, n]."""
    w = jnp.moveaxis(data, -3, -2)  # [..., K, P, PANEL]
    return w.reshape(*w.shape[:-2], -1)[..., :n]


@jax.jit
def _pack_array(w):
    K, N = w.shape[-2:]
    P = -(-N // PANEL)
    w = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, P * PANEL - N)])
    return jnp.moveaxis(w.reshape(*w.shape[:-1], P, PANEL), -2, -3)  # [..., P, K, PANEL]


def pack(w) -> PanelWeight:
    """A float32 matrix [..., K, N] (x @ w) as a PanelWeight (the same values, panel-major)."""
    if isinstance(w, PanelWeight):
        return w
    if w.ndim < 2 or jnp.dtype(w.dtype) != jnp.float32:
        raise ValueError(f"panels hold float32 matrices [..., K, N]; got {jnp.dtype(w.dtype)} {tuple(w.shape)}")
    return PanelWeight(_pack_array(w), int(w.shape[-1]))


def unpack(w):
    """The row-major array for a PanelWeight; anything else as it is."""
    return w.unpack() if isinstance(w, PanelWeight) else w


def is_panels(x) -> bool:
    return isinstance(x, PanelWeight)


def has_panels(tree) -> bool:
    return any(is_panels(x) for x in jax.tree.leaves(tree, is_leaf=is_panels))


def pack_params(params: dict) -> dict:
    """A target's params with every stacked float32 layer matrix ([L, K, N] under "layers") panel-major; norms,
    biases, the embedding and an untied lm_head stay as they are."""
    out = dict(params)
    out["layers"] = {k: pack(v) if _packable(v) else v for k, v in params["layers"].items()}
    return out


def unpack_params(tree):
    """The same pytree with every PanelWeight replaced by its row-major array."""
    return jax.tree.map(unpack, tree, is_leaf=is_panels)


def _packable(v) -> bool:
    return isinstance(v, PanelWeight) or (isinstance(v, (jax.Array, np.ndarray)) and v.ndim == 3
                                          and jnp.dtype(v.dtype) == jnp.float32)


def auto() -> bool:
    """Whether panels pay here: the default backend is the CPU and the kernel library runs."""
    from . import kernels
    return jax.default_backend() == "cpu" and kernels.available()
