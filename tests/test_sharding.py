"""Sharding over a ("data", "model") mesh of 4 simulated CPU devices (a subprocess: XLA_FLAGS must be set before JAX
starts): token identity with the single-device run for vanilla, EAGLE-2 and DDD in every sync mode, on meshes
(1, 4), (2, 2), (4, 1) with 3 prompts of different lengths (padded to the "data" axis); weights, head and caches
really sharded; loading onto a mesh; clear errors for bad meshes and sizes.

`make test` runs vanilla and DDD on device on mesh (2, 2) plus the placement, loading and error checks, and
`test_same_tokens_on_every_mesh` every method and sync mode on (2, 2) and vanilla and DDD on device on (1, 4) /
(4, 1) (the compiles dominate on a CPU); DDD_JAX_SHARD_FULL=1 runs every method and sync mode on every mesh.
`make test-fast` skips the module: its subprocess alone takes over a minute.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # the module's 4-device subprocess (~75 s): make test

MODES = [["vanilla", "device"], ["eagle2", "device"], ["ddd", "host"], ["ddd", "callback"], ["ddd", "device"]]
FAST_MODES = [["vanilla", "device"], ["ddd", "device"]]
MESHES = [[1, 4], [2, 2], [4, 1]]


def _slow_lane_runs(config) -> bool:
    """Whether this session runs the tests marked slow (`make test`; `make test-fast` deselects them)."""
    return "not slow" not in (config.getoption("markexpr") or "")


@pytest.fixture(scope="module")
def found(request):
    """The fast lane: vanilla and DDD on device, single device and mesh (2, 2), plus the checks. When the slow lane
    runs too, its one subprocess (a superset: every mode on (2, 2), the checks included) serves both, so the fast
    lane's programs are not compiled a second time in another process."""
    if _slow_lane_runs(request.config):
        return request.getfixturevalue("found_all")
    return _worker({"modes": FAST_MODES, "meshes": [[2, 2]], "checks": True, "mesh_modes": {}})


@pytest.fixture(scope="module")
def found_all(request):
    full = os.environ.get("DDD_JAX_SHARD_FULL") == "1"
    return _worker({"modes": MODES, "meshes": MESHES, "checks": _slow_lane_runs(request.config),
                    "mesh_modes": {} if full else {"1x4": FAST_MODES, "4x1": FAST_MODES}})


def _worker(spec):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    worker = Path(__file__).with_name("sharding_worker.py")
    p = subprocess.run([sys.executable, str(worker), json.dumps(spec)], capture_output=True, text=True, env=env,
                       timeout=3600)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_four_devices_and_speculation_accepts(found):
    assert found["devices"] == 4
    # the fitted head gets drafts accepted, so verification and commit paths are exercised
    assert all(found["max_accepted"][f"{m}-{s}"] >= 2 for m, s in FAST_MODES if m != "vanilla")
    # lossless on one device (the reference the mesh is compared with)
    ref = found["ref"]
    assert all(ref[f"{m}-{s}"] == ref["vanilla-device"] for m, s in FAST_MODES)


def test_same_tokens_on_a_2x2_mesh(found):
    assert {k: v for k, v in found["same"].items() if k.startswith("2x2/") and k.split("/")[1] in
            ("vanilla-device", "ddd-device")} == {"2x2/vanilla-device": True, "2x2/ddd-device": True}


@pytest.mark.slow
def test_same_tokens_on_every_mesh(found_all):
    assert found_all["devices"] == 4
    assert all(found_all["max_accepted"][f"{m}-{s}"] >= 2 for m, s in MODES if m != "vanilla")
    ref = found_all["ref"]
    assert all(ref[f"{m}-{s}"] == ref["vanilla-device"] for m, s in MODES)
    same = found_all["same"]
    assert {k.split("/")[0] for k in same} == {"1x4", "2x2", "4x1"}
    assert all(f"2x2/{m}-{s}" in same for m, s in MODES)
    bad = [k for k, v in same.items() if not v]
    assert not bad, f"sharded runs differ from the single-device run: {bad}"


def test_weights_head_and_caches_are_sharded(found):
    t = found["target_shards"]
    # [global shape, per-device shape, spec] on the 2x2 mesh: heads, MLP hidden, vocabulary over "model" (2)
    assert t["layers.wq"][:2] == [[1, 32, 32], [1, 32, 16]]
    assert t["layers.wk"][:2] == [[1, 32, 32], [1, 32, 16]]
    assert t["layers.wo"][:2] == [[1, 32, 32], [1, 16, 32]]
    assert t["layers.w_up"][:2] == [[1, 32, 64], [1, 32, 32]] and t["layers.w_down"][:2] == [[1, 64, 32], [1, 32, 32]]
    assert t["embed"][:2] == [[96, 32], [48, 32]] and t["lm_head"][:2] == [[32, 96], [32, 48]]
    assert t["final_norm"][1] == [32] and t["layers.attn_norm"][1] == [1, 32]  # replicated
    d = found["draft_shards"]
    assert d["layers.wq"][1] == [1, 32, 16] and d["layers.w_gate"][1] == [1, 32, 32] and d["fc_w"][1] == [64, 32]
    assert found["n_devices_per_weight"] == 4
    assert found["init_same_values"]  # init_draft on a mesh: the same values as unsharded
    # KV caches [L, B, K, S, H] (head-major): 4 sequences over "data" (2), 4 KV heads over "model" (2)
    assert found["tcache_spec"] == found["dcache_spec"] == "PartitionSpec(None, 'data', 'model')" or \
        found["tcache_spec"] == found["dcache_spec"] == "P(None, 'data', 'model')"
    assert found["tcache_shard"] == [1, 2, 2, found["tcache_shape"][3], 8]


def test_loading_onto_a_mesh(found):
    assert found["loaded_mesh"] and found["loaded_same_values"]
    assert found["loaded_specs"] == ["P('model', None)", "P(None, None, 'model')"] or \
        found["loaded_specs"] == ["PartitionSpec('model', None)", "PartitionSpec(None, None, 'model')"]


def test_hf_directory_loads_onto_a_mesh(found):
    hf = found["hf_loaded"]
    if isinstance(hf, str):
        pytest.skip(hf)
    assert hf["same_values"] and hf["wk_shape"] == [2, 64, 32] and hf["wk_shard"] == [2, 64, 16]


def test_bad_meshes_and_sizes_are_clear_errors(found):
    e = found["errors"]
    assert "('data', 'model')" in e["axes"] and "('x', 'y')" in e["axes"]
    assert "num_key_value_heads=2" in e["heads"] and "'model' axis (4)" in e["heads"] and "[1, 2]" in e["heads"]


@pytest.mark.slow  # time (test-fast budget); `make test` runs it
def test_data_parallel_fit_matches_one_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    worker = Path(__file__).with_name("sharding_train_worker.py")
    p = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    r = json.loads(lines[-1][len("RESULT "):])
    for mesh in ("4x1", "2x2"):
        np.testing.assert_allclose(r[mesh]["loss"], r["one"]["loss"], rtol=1e-5)
        np.testing.assert_allclose(r[mesh]["params"], r["one"]["params"], rtol=1e-4, atol=1e-5)
    assert "does not divide the mesh's 'data' axis (2)" in r["error"]


@pytest.mark.deep  # two JAX processes on localhost (a minute and a half): make test-deep
def test_two_processes_on_localhost():
    """jax.distributed over localhost with CPU (gloo) collectives: 2 processes x 2 devices, "data" across them."""
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    worker = Path(__file__).with_name("sharding_multihost_worker.py")
    procs = [subprocess.Popen([sys.executable, str(worker), str(port), str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (out, err) in zip(procs, outs):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert p.returncode == 0 and lines, err[-4000:]
        r = json.loads(lines[-1][len("RESULT "):])
        assert r["process_count"] == 2 and r["devices"] == 4 and r["data_spans_processes"]
        assert all(r[k] for k in ("vanilla-device", "ddd-device", "ddd-host")), r
