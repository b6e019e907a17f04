"""Sharding over a ("data", "model") device mesh: one rules table from logical axes to mesh axes, weight / batch /
cache placement, per-device memory planning, and multi-host initialisation.

Every weight's logical axes come from the one description beside its shapes (`llama.param_axes`,
`eagle.param_axes`); `RULES` maps them to mesh axes. JAX's SPMD partitioner does the rest: the decode loops run
unchanged under jit with these input shardings propagated (no hand-written collectives, no `shard_map`).

    query / KV heads, MLP hidden, vocabulary  -> "model"      everything else of the weights -> replicated
    batch (prompts, caches, decode state)     -> "data"       KV caches' KV-head axis          -> "model"
"""
from __future__ import annotations

import math
import os
from functools import reduce

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "model")

# logical axis -> mesh axis (None: replicated). One table for weights, caches and activations.
RULES = {
    "vocab": "model", "q_heads": "model", "kv_heads": "model", "ffw": "model",
    "batch": "data",
    "layers": None, "embed": None, "embed2": None, "draft_vocab": None, "seq": None, "head_dim": None,
}

# KV cache k / v: [L, B, K, S, H] (`ddd_jax.cache`)
CACHE_AXES = ("layers", "batch", "kv_heads", "seq", "head_dim")


# ---------------------------------------------------------------------------------------------------------
# meshes

def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh over the first data*model devices (all processes' devices on several hosts)."""
    devices = list(jax.devices() if devices is None else devices)
    n = data * model
    if data < 1 or model < 1 or n > len(devices):
        raise ValueError(f"a {data}x{model} mesh needs {n} devices; {len(devices)} available "
                         f"(on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts)")
    return Mesh(np.asarray(devices[:n], dtype=object).reshape(data, model), MESH_AXES)


def parse_mesh(text: str) -> tuple[int, int]:
    """"2x4" -> (data=2, model=4)."""
    try:
        d, m = (int(x) for x in str(text).lower().split("x"))
    except ValueError:
        raise ValueError(f"mesh must be DATAxMODEL like 1x8, got {text!r}") from None
    if d < 1 or m < 1:
        raise ValueError(f"mesh sizes must be >= 1, got {text!r}")
    return d, m


def check_mesh(mesh) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes {MESH_AXES}, got {type(mesh).__name__}")
    if sorted(mesh.axis_names) != sorted(MESH_AXES):
        raise ValueError(f"mesh must have exactly the axes {MESH_AXES} (either may have size 1), "
                         f"got {tuple(mesh.axis_names)}")
    return mesh


def mesh_sizes(mesh) -> dict:
    """{"data": n, "model": m} of a Mesh or of a (data, model) tuple."""
    if isinstance(mesh, tuple):
        return dict(zip(MESH_AXES, mesh))
    return dict(mesh.shape)


def _divisors(n: int, upto: int = 64) -> list[int]:
    return [d for d in range(1, min(n, upto) + 1) if n % d == 0]


def check_divisible(cfg, mesh, what: str = "target") -> None:
    """Every axis sharded over "model" must divide it: a clear error naming the sizes, never silent replication."""
    m = mesh_sizes(mesh)["model"]
    sizes = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
             "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
    bad = {k: v for k, v in sizes.items() if v % m}
    if bad:
        ok = _divisors(reduce(math.gcd, sizes.values()))
        raise ValueError(f"{what}: {', '.join(f'{k}={v}' for k, v in bad.items())} not divisible by the mesh's "
                         f"'model' axis ({m}); 'model' sizes that divide all of {sizes}: {ok}")


# ---------------------------------------------------------------------------------------------------------
# specs and placement

def spec(axes) -> P:
    """PartitionSpec of a tuple of logical axis names through `RULES` (unknown names are an error)."""
    unknown = [a for a in axes if a not in RULES]
    if unknown:
        raise ValueError(f"no sharding rule for logical axes {unknown} (add them to ddd_jax.sharding.RULES)")
    return P(*(RULES[a] for a in axes))


def flat_axes(axes_tree: dict) -> dict:
    from . import io as dio
    return dio.flatten(axes_tree)


def named(mesh, axes) -> NamedSharding:
    return NamedSharding(mesh, spec(axes))


def shard_shape(shape, axes, mesh) -> tuple:
    """The per-device shape of a global `shape` with logical `axes` on `mesh` (a Mesh or (data, model) sizes)."""
    sizes = mesh_sizes(mesh)
    out = []
    for n, a in zip(shape, axes):
        m = RULES[a]
        k = 1 if m is None else sizes[m]
        if n % k:
            raise ValueError(f"axis {a!r} of size {n} does not divide the mesh's {m!r} axis ({k})")
        out.append(n // k)
    return tuple(out)


def put(x, sharding: NamedSharding):
    """Place one host (numpy) or device array with `sharding`; each device receives only its shard (also across
    processes), so a tensor is never whole on one device. No-op for an array already placed that way."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if isinstance(x, jax.Array) and x.is_fully_addressable and sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    arr = to_host(x)  # host values (gathered when x spans several processes)
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx], dtype=arr.dtype)


def placer(mesh, axes_tree: dict):
    """place(flat_key, host_array) -> jax.Array: what the checkpoint loaders call on each finished tensor
    (mesh None: an ordinary single-device array)."""
    if mesh is None:
        import jax.numpy as jnp
        return lambda key, x: jnp.asarray(x)
    check_mesh(mesh)
    axes = flat_axes(axes_tree)

    def place(key, x):
        if axes.get(key) is None:
            raise ValueError(f"no logical axes for weight {key!r}: add it to llama.WEIGHT_AXES / eagle.DRAFT_AXES")
        return put(x, named(mesh, axes[key]))
    return place


def place_params(params: dict, axes_tree: dict, mesh) -> dict:
    """Place every leaf of nested `params` by its logical axes (tensor by tensor)."""
    from . import io as dio
    place = placer(mesh, axes_tree)
    flat = dio.flatten(params)
    return dio.unflatten({k: place(k, v) for k, v in flat.items()})


def param_shardings(axes_tree: dict, mesh) -> dict:
    from . import io as dio
    return dio.unflatten({k: named(mesh, a) for k, a in flat_axes(axes_tree).items()})


def batch_sharding(mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
    return NamedSharding(mesh, P(*["data" if i == batch_axis else None for i in range(ndim)]))


def cache_sharding(mesh) -> NamedSharding:
    return named(mesh, CACHE_AXES)


def pad_batch(n: int, mesh) -> int:
    """Rows to append so that a batch of n divides the "data" axis."""
    d = mesh_sizes(mesh)["data"]
    return -n % d


def constrain_state(state, mesh):
    """Sharding constraints for a decode `State` (inside jit): KV caches over batch and KV heads,
    per-sequence fields over "data" on their batch axis ([C, B] histories on axis 1), scalars replicated."""
    from .cache import KVCache
    import dataclasses

    def cache(c):
        if c is None:
            return None
        s = cache_sharding(mesh)
        return dataclasses.replace(c, k=jax.lax.with_sharding_constraint(c.k, s),
                                   v=jax.lax.with_sharding_constraint(c.v, s),
                                   length=jax.lax.with_sharding_constraint(c.length, batch_sharding(mesh, 1)))

    upd = {}
    for f in dataclasses.fields(state):
        x = getattr(state, f.name)
        if isinstance(x, KVCache) or x is None and f.name.endswith("cache"):
            upd[f.name] = cache(x)
        elif f.name in ("key", "cycle", "checks") or x is None or x.ndim == 0:
            continue
        else:
            ax = 1 if f.name.endswith("_hist") else 0
            upd[f.name] = jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim, ax))
    return dataclasses.replace(state, **upd)


def to_host(x):
    """A numpy copy of a (possibly multi-process, sharded) array: the whole global value on every process."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def describe(params: dict) -> dict:
    """{flat key: (global shape, per-device shard shape, PartitionSpec)} of placed params (for tests / debugging)."""
    from . import io as dio
    return {k: (tuple(v.shape), tuple(v.addressable_shards[0].data.shape), v.sharding.spec)
            for k, v in dio.flatten(params).items()}


# ---------------------------------------------------------------------------------------------------------
# several hosts

def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, local_device_ids=None) -> bool:
    """`jax.distributed.initialize` from arguments or the environment (DDD_JAX_COORDINATOR,
    DDD_JAX_NUM_PROCESSES, DDD_JAX_PROCESS_ID). Returns False (single process) when no coordinator is given and
    none is set; on TPU pods / SLURM / Open MPI clusters JAX auto-detects, so pass coordinator "auto" there."""
    addr = coordinator_address or os.environ.get("DDD_JAX_COORDINATOR")
    if not addr:
        return False
    n = num_processes if num_processes is not None else os.environ.get("DDD_JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else os.environ.get("DDD_JAX_PROCESS_ID")
    if addr == "auto":
        jax.distributed.initialize()
        return True
    if n is None or pid is None:
        raise ValueError("multi-host: a coordinator address needs num_processes and process_id "
                         "(flags or DDD_JAX_NUM_PROCESSES / DDD_JAX_PROCESS_ID)")
    jax.distributed.initialize(coordinator_address=addr, num_processes=int(n), process_id=int(pid),
                               local_device_ids=local_device_ids)
    return True


def add_mesh_args(p) -> None:
    """--mesh and the multi-host flags, shared by the CLIs that run on a mesh (generate, train-draft fit)."""
    p.add_argument("--mesh", default=None, help="DATAxMODEL device mesh, e.g. 1x8 (default: one device)")
    p.add_argument("--coordinator", default=None, help="multi-host: coordinator HOST:PORT (process 0's), or 'auto' "
                   "on TPU pods / SLURM / Open MPI (env DDD_JAX_COORDINATOR)")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: processes (env DDD_JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process (env DDD_JAX_PROCESS_ID)")


def mesh_from_args(args):
    """Initialise multi-host JAX if asked, then the --mesh over every process's devices (None without --mesh)."""
    initialize_distributed(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                           getattr(args, "process_id", None))
    text = getattr(args, "mesh", None)
    return make_mesh(*parse_mesh(text)) if text else None
