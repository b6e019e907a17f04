"""What every backend shares with the model code's one door (`ddd_jax.ops`): the packed-weight protocol and the
float32 precision rule. Backends live in subpackages (`cpu/`); model code never imports them."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def precision(*operands):
    """The `precision` of this package's forward products under XLA: `lax.Precision.HIGHEST` when every operand is
    float32 and no default matmul precision is set (`JAX_DEFAULT_MATMUL_PRECISION`, `jax.default_matmul_precision`),
    else None (JAX's default). So float32 means float32 products on every backend: JAX's default runs them as TF32
    on recent NVIDIA GPUs, and then a forward of several tokens and one of a single token round differently, so
    speculative decoding leaves vanilla's tokens at near-ties. Setting a default precision (e.g. "tensorfloat32")
    trades that for speed, also for training on a GPU (autodiff of these products keeps their precision)."""
    if jax.config.jax_default_matmul_precision is not None:
        return None
    return jax.lax.Precision.HIGHEST if all(jnp.dtype(o.dtype) == jnp.float32 for o in operands) else None


class Packed:
    """A weight stored in a backend's own layout (panels, GGUF blocks, ...): a registered pytree that knows its own
    product, so model code calls `ops.matmul` and never asks which kind of weight it holds.

    `shape` / `ndim` / `dtype` describe the logical array it stands for; `rows` says whether that array is output
    rows [..., N, K] (used as x @ w.T) or [..., K, N] (used as x @ w)."""

    def product(self, x, layer=None, *, transposed: bool = False):
        """x [..., K] @ the logical weight (or its layer `layer` of a stacked one): [..., N] float32."""
        raise NotImplementedError

    def take(self, ids):
        """Rows `ids` [...] of an unstacked rows-layout weight (an embedding): [..., K]."""
        raise NotImplementedError(f"{type(self).__name__} has no row lookup")

    def as_rows(self):
        """The output-embedding rows [V, D] of an untied lm_head stored [D, V] (the same storage, no copy)."""
        return self.T

    def greedy(self, hidden, pick):
        """(logits, greedy tokens) of hidden @ w in one pass where the backend can (None: compute them apart)."""
        return None

    def greedy_tokens(self, hidden, pick):
        """The greedy tokens alone, cheaper than the logits where the backend can (None: from `greedy`)."""
        return None


def check_layout(w, rows: bool, transposed: bool) -> None:
    """A stored weight whose logical layout is output rows (`rows`) serves x @ w.T (transposed) only, and a
    [K, N] one x @ w only."""
    if transposed != rows:
        raise ValueError(f"a {'rows-layout' if rows else '[K, N]'} {type(w).__name__} used as "
                         f"{'rows' if transposed else 'x @ w'}: its layout does not match the product")
