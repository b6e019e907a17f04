"""KV cache pytree with static capacity: slot writes happen in the model, `commit` compacts accepted tree paths.

k / v are head-major, [L, B, K, S, H]: one KV head's slots are one run of memory, which attention reads head by
head.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: jax.Array  # [L, B, K, S, H]: keys per layer / sequence / KV head / slot
    v: jax.Array  # [L, B, K, S, H]: values, as k
    length: jax.Array  # [B] int32: slots [0, length) hold the committed prefix

    @property
    def capacity(self) -> int:
        return self.k.shape[SLOT_AXIS]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


SLOT_AXIS = 3  # of k / v [L, B, K, S, H]


def check_cache(cache: KVCache, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
    """A clear error when the cache's k / v are not [L, B, K, S, H] for this model (e.g. a cache built by hand
    slot-major, [L, B, S, K, H], is caught here unless its capacity equals the number of KV heads)."""
    for name, x in (("k", cache.k), ("v", cache.v)):
        if x.ndim != 5 or (x.shape[0], x.shape[2], x.shape[4]) != (num_layers, num_kv_heads, head_dim):
            raise ValueError(f"KV cache {name} {list(x.shape)} is not [L, B, K, S, H] with L={num_layers}, "
                             f"K={num_kv_heads}, H={head_dim}")


def init_cache(num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
               dtype=jnp.float32) -> KVCache:
    """An empty cache (length 0) of `capacity` slots."""
    shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), length=jnp.zeros((batch,), jnp.int32))


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

    def move(x):  # x: [L, B, K, S, H]
        if cache.batch != 1:
            return x.at[:, b, :, dst].set(x[:, b, :, src], mode="drop")  # (both index [B, M, L, K, H])
        # on the CPU a loop over the n real entries only (a cycle commits ~2); elsewhere all M, the rest masked
        one_sequence = partial(move_entries, src=src[0], dst=dst[0], n=n_[0], axis=SLOT_AXIS)
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
