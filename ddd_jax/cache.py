"""KV cache pytree with static capacity: slot writes happen in the model, `commit` compacts accepted tree paths.

Two layouts of k / v, named by the cache's static `layout` field:
    "head"  [L, B, K, S, H]  head-major: one KV head's slots are one run of memory, which attention reads head by
                             head (what `init_cache` and the models' `new_cache` make);
    "slot"  [L, B, S, K, H]  slot-major: the layout of every cache before head-major ones, and still what
                             `KVCache(k, v, length)` without a layout means, so caches built by hand keep working.
Both hold the same numbers and decode the same tokens (the attention kernel sums the same slots in the same order).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: jax.Array  # [L, B, K, S, H] (layout "head") or [L, B, S, K, H] ("slot"): keys per layer / sequence / slot
    v: jax.Array  # the same shape as k
    length: jax.Array  # [B] int32: slots [0, length) hold the committed prefix
    layout: str = field(default="slot", metadata=dict(static=True))  # "head" | "slot" (see the module docstring)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"KVCache layout must be one of {LAYOUTS}, not {self.layout!r}")

    @property
    def slot_axis(self) -> int:
        """The axis of k / v that indexes cache slots: 3 head-major, 2 slot-major."""
        return 3 if self.layout == "head" else 2

    @property
    def capacity(self) -> int:
        return self.k.shape[self.slot_axis]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


LAYOUTS = ("head", "slot")


def check_cache(cache: KVCache, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
    """A clear error when the cache's k / v do not have the shape its layout names for this model. A head-major
    cache built by hand without layout="head" is caught here (unless its capacity equals the number of KV heads)."""
    head = cache.layout == "head"
    form = "[L, B, K, S, H]" if head else "[L, B, S, K, H]"
    for name, x in (("k", cache.k), ("v", cache.v)):
        if x.ndim != 5 or (x.shape[0], x.shape[2 if head else 3], x.shape[4]) != (num_layers, num_kv_heads, head_dim):
            raise ValueError(f"KV cache {name} {list(x.shape)} is not {form} with L={num_layers}, K={num_kv_heads}, "
                             f"H={head_dim} (layout {cache.layout!r})"
                             + ("; a head-major cache needs KVCache(..., layout='head')" if not head else ""))


def init_cache(num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
               dtype=jnp.float32, layout: str = "head") -> KVCache:
    """An empty cache (length 0) of `capacity` slots, head-major unless layout="slot" (another layout: KVCache's
    error)."""
    shape = ((num_layers, batch, num_kv_heads, capacity, head_dim) if layout == "head" else
             (num_layers, batch, capacity, num_kv_heads, head_dim))
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), length=jnp.zeros((batch,), jnp.int32),
                   layout=layout)


def commit(cache: KVCache, start, accepted_slots, n) -> KVCache:
    """Move the KV entries of an accepted tree path to contiguous slots.

    start: [B] slot where the tree's first token (its root) was written;
    accepted_slots: [B, M] tree indices (relative to start) of the path, root first, padded arbitrarily;
    n: [B] how many of them are real. Afterwards slots [start, start+n) hold the path and length = start + n;
    slots past that are scratch (a batch copies its padding entries there, one sequence leaves them).

    One sequence (B = 1) moves its n real entries one after another in a loop, each a dynamic slice of all layers
    written back in place (under donation); that is safe because a path's i-th node sits at tree index >= i, so
    entry i never overwrites a later entry's source. A batch takes one gather + scatter of all M entries per layer
    stack, which on XLA:CPU costs more than the loop over the ~2 entries a cycle accepts. Off the CPU the loop runs all M entries, the
    padding masked (`move_entries`), so XLA:GPU need not read its trip count on the host.
    """
    start = jnp.asarray(start, jnp.int32)
    n_ = jnp.broadcast_to(jnp.asarray(n, jnp.int32), start.shape)
    M = accepted_slots.shape[1]
    src = jnp.clip(start[:, None] + jnp.asarray(accepted_slots, jnp.int32), 0, cache.capacity - 1)  # [B, M]
    dst = start[:, None] + jnp.arange(M, dtype=jnp.int32)[None]
    b = jnp.arange(cache.batch)[:, None]

    ax = cache.slot_axis

    def move(x):  # x: [L, B, K, S, H] (head-major) or [L, B, S, K, H]
        if cache.batch != 1:
            if cache.layout == "head":
                return x.at[:, b, :, dst].set(x[:, b, :, src], mode="drop")  # (both index [B, M, L, K, H])
            return x.at[:, b, dst].set(x[:, b, src], mode="drop")
        # on the CPU a loop over the n real entries only (a cycle commits ~2); elsewhere all M, the rest masked
        one_sequence = partial(move_entries, src=src[0], dst=dst[0], n=n_[0], axis=ax)
        return jax.lax.platform_dependent(x, cpu=one_sequence, default=partial(one_sequence, static=True))

    return dataclasses.replace(cache, k=move(cache.k), v=move(cache.v), length=(start + n_).astype(jnp.int32))


def move_entries(x, *, src, dst, n, axis: int, static: bool = False):
    """One sequence's commit along the slot axis of x: entry i (< n) copied from slot src[i] to dst[i], in order,
    each a dynamic slice of all layers written back in place; an entry past the capacity is dropped (as the batched
    scatter's mode="drop"). src, dst [M] int32, n [] int32.

    static=False loops over the n real entries (a loop of n steps); static=True over all M with the others written
    back unchanged: the same result, in a loop of static length, which XLA:GPU runs without reading its condition
    on the host each step (WhileThunk). (Unrolled, XLA copied the whole cache per entry.)"""
    S, M = x.shape[axis], src.shape[0]
    size = x.shape[:axis] + (1,) + x.shape[axis + 1:]

    def at(slot):
        return tuple(slot if a == axis else 0 for a in range(x.ndim))

    def one(i, x):
        d = jnp.minimum(dst[i], S - 1)
        row = jax.lax.dynamic_slice(x, at(src[i]), size)
        keep = jax.lax.dynamic_slice(x, at(d), size)
        live = (dst[i] < S) & (i < n) if static else dst[i] < S
        return jax.lax.dynamic_update_slice(x, jnp.where(live, row, keep), at(d))

    return jax.lax.fori_loop(0, M if static else jnp.clip(n, 0, M), one, x)


def with_length(cache: KVCache, length) -> KVCache:
    return dataclasses.replace(cache, length=jnp.asarray(length, jnp.int32))
