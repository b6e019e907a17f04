"""One of two processes (tests/test_sharding.py): jax.distributed over localhost with CPU (gloo) collectives, 2
devices each, a (2, 2) mesh whose "data" axis spans the processes; generate must give the single-device tokens."""
from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import json  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

from ddd_jax import sharding  # noqa: E402


def main(port: int, pid: int):
    assert sharding.initialize_distributed(f"localhost:{port}", 2, pid)
    sys.path.insert(0, os.path.dirname(__file__))
    from sharding_worker import DDD, MAX_NEW, TREE, target  # noqa: E402
    from ddd_jax import generate, init_draft
    prompts = [[5, 9, 12], [40, 2, 7, 7, 81, 3, 60], [11]]
    t1 = target()
    d1 = init_draft(t1, 0)
    mesh = sharding.make_mesh(2, 2)
    t = target(mesh)
    d = init_draft(t, 0)
    out = {"process_count": jax.process_count(), "devices": jax.device_count(),
           "data_spans_processes": sorted({dev.process_index for dev in mesh.devices[:, 0]}) == [0, 1]}
    # eagle2 runs on every single-process mesh (test_sharding); here: plain, one on-device program, host syncs
    for method, sync in (("vanilla", "device"), ("ddd", "device"), ("ddd", "host")):
        kw = dict(max_new_tokens=MAX_NEW, method=method, sync=sync, tree=TREE, ddd=DDD)
        ref = generate(t1, None if method == "vanilla" else d1, prompts, **kw).tokens
        got = generate(t, None if method == "vanilla" else d, prompts, **kw).tokens
        out[f"{method}-{sync}"] = got == ref
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
