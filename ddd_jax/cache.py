"""KV cache pytree with static capacity: slot writes happen in the model, `commit` compacts accepted tree paths."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: jax.Array  # [L, B, S, K, H]  keys per layer / sequence / slot
    v: jax.Array  # [L, B, S, K, H]
    length: jax.Array  # [B] int32: slots [0, length) hold the committed prefix

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_cache(num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
               dtype=jnp.float32) -> KVCache:
    shape = (num_layers, batch, capacity, num_kv_heads, head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), length=jnp.zeros((batch,), jnp.int32))


def write(layer_cache, new, pos):
    """Write new entries [B, T, K, H] into one layer's cache [B, S, K, H] at per-sequence slot pos[B]."""
    return jax.vmap(lambda c, x, p: jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (p, 0, 0)))(
        layer_cache, new, pos)


def commit(cache: KVCache, start, accepted_slots, n) -> KVCache:
    """Move the KV entries of an accepted tree path to contiguous slots.

    start: [B] slot where the tree's first token (its root) was written;
    accepted_slots: [B, M] tree indices (relative to start) of the path, root first, padded arbitrarily;
    n: [B] how many of them are real. Afterwards slots [start, start+n) hold the path and length = start + n.
    Entries past n are copied too (as scratch beyond the new length) so shapes stay static.
    """
    start = jnp.asarray(start, jnp.int32)
    src = start[:, None] + jnp.asarray(accepted_slots, jnp.int32)  # [B, M]
    src = jnp.clip(src, 0, cache.capacity - 1)

    def move(x):  # x: [L, B, S, K, H]
        def one(xb, s, st):  # xb: [L, S, K, H]
            g = jnp.take(xb, s, axis=1)  # [L, M, K, H]
            return jax.lax.dynamic_update_slice(xb, g, (0, st, 0, 0))
        return jax.vmap(one, in_axes=(1, 0, 0), out_axes=1)(x, src, start)

    return KVCache(k=move(cache.k), v=move(cache.v), length=(start + jnp.asarray(n, jnp.int32)).astype(jnp.int32))


def with_length(cache: KVCache, length) -> KVCache:
    return KVCache(k=cache.k, v=cache.v, length=jnp.asarray(length, jnp.int32))
