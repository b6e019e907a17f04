"""scripts/gpu_recipe.sh prepare and the two remote calls it writes (.device/call1/run.sh, .device/call2/run.sh),
with small fake files: no GPU, no real GGUF, no recipe (a stub python records the recipe's command line)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_recipe.sh"
LIMIT = 3 << 20  # LIMIT_BYTES for the test: 3 MiB a call, 1 MiB of it spare
BUDGET = LIMIT - (1 << 20)
TREE = 300_000

STUB = """#!/usr/bin/env bash
# the recipe's python: records its arguments and environment, writes one file to $OUT
{ printf '%s\\n' "$@"; echo "PYTHONPATH=$PYTHONPATH"; echo "DDD_JAX_NO_KERNELS=$DDD_JAX_NO_KERNELS"; } > "$OUT/args.txt"
"""


@pytest.fixture
def files(tmp_path):
    rng = os.urandom
    gguf = tmp_path / "fake.gguf"  # 3 MB: 2 MB incompressible, 1 MB that compresses
    gguf.write_bytes(rng(2_000_000) + bytes(1_000_000))
    inputs = tmp_path / "inputs.npz"
    inputs.write_bytes(rng(150_000))
    head = tmp_path / "best-eagle3.tar"
    head.write_bytes(rng(10_000))
    return gguf, inputs, head


def prepare(tmp_path, gguf, inputs, tree=TREE, **env):
    e = {**os.environ, "DEVICE_DIR": str(tmp_path / "prep" / ".device"), "GGUF": str(gguf), "INPUTS": str(inputs),
         "RUNS": str(tmp_path / "no-runs"), "PY": sys.executable, "LIMIT_BYTES": str(LIMIT), "XZ_PRESET": "1", **env}
    return subprocess.run(["bash", str(SCRIPT), "prepare", str(tree)], env=e, capture_output=True, text=True,
                          timeout=120)


def totals(stdout):
    return {int(k): int(v) for k, v in re.findall(r"call (\d) carries (\d+) bytes", stdout)}


def folder_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def run_call(checkout: Path, n: int, stage: Path, out: Path, **env):
    e = {**os.environ, "DDD_RECIPE_STAGE": str(stage), "OUT": str(out), "PY_TOOL": sys.executable, **env}
    return subprocess.run(["bash", f".device/call{n}/run.sh"], cwd=checkout, env=e, capture_output=True, text=True,
                          timeout=120)


def test_prepare_writes_two_folders_within_the_limit_and_they_rebuild_the_target_in_another_checkout(tmp_path, files):
    gguf, inputs, head = files
    r = prepare(tmp_path, gguf, inputs, INIT_HEAD=str(head), RECIPE_EXTRA="--set eagle3.batch_size=16")
    assert r.returncode == 0, r.stdout + r.stderr
    dev = tmp_path / "prep" / ".device"
    for n in (1, 2):
        assert (dev / f"call{n}" / "run.sh").is_file()
    assert (dev / "call1" / "gguf.xz.part0").stat().st_size > 0
    assert (dev / "call2" / "gguf.xz.part1").stat().st_size > 0  # the stream did not fit one call here
    assert (dev / "call2" / "pylib" / "gguf" / "gguf_reader.py").is_file()
    assert (dev / "call2" / "recipe_inputs.npz").read_bytes() == inputs.read_bytes()
    t = totals(r.stdout)
    assert sorted(t) == [1, 2] and all(v <= BUDGET for v in t.values()), r.stdout
    for n in (1, 2):  # the printed totals are the folders' bytes and the tree's
        assert t[n] == TREE + folder_bytes(dev / f"call{n}")

    # a fresh checkout: the repository's files are not needed by the scripts themselves, only the two folders
    co = tmp_path / "checkout"
    for n in (1, 2):
        shutil.copytree(dev / f"call{n}", co / ".device" / f"call{n}")
    stub = tmp_path / "stub-python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    stage, out = tmp_path / "stage", tmp_path / "out"
    out.mkdir()
    r1 = run_call(co, 1, stage, out)
    assert r1.returncode == 0, r1.stdout + r1.stderr
    assert list(out.iterdir()) == []
    r2 = run_call(co, 2, stage, out, PY_RUN=str(stub), LIMIT_S="600")
    assert r2.returncode == 0, r2.stdout + r2.stderr
    target = stage / "target.gguf"
    assert hashlib.sha256(target.read_bytes()).digest() == hashlib.sha256(gguf.read_bytes()).digest()
    assert sorted(p.name for p in out.iterdir()) == ["args.txt"]  # the script adds nothing to $OUT
    lines = (out / "args.txt").read_text().splitlines()
    assert lines[:4] == ["-m", "ddd_jax.cli", "train-draft", "recipe"]
    arg = {k: v for k, v in zip(lines, lines[1:])}
    assert arg["--export-dir"] == str(out)
    assert 0 < float(arg["--deadline-s"]) <= 600 - 40
    assert arg["--target"] == str(target)
    assert arg["--inputs"] == str(co / ".device" / "call2" / "recipe_inputs.npz")
    assert arg["--init"] == str(co / ".device" / "call2" / "init" / head.name)
    assert arg["--set"] == "eagle3.batch_size=16"
    path = next(x for x in lines if x.startswith("PYTHONPATH="))[len("PYTHONPATH="):]
    assert path.split(":")[:2] == [str(co), str(co / ".device" / "call2" / "pylib")]
    assert "DDD_JAX_NO_KERNELS=1" in lines

    # a rerun of call 2 on the same machine reuses the checked target; run-time flags come after the baked ones
    r3 = run_call(co, 2, stage, out, PY_RUN=str(stub), RECIPE_EXTRA="--set regen_max_new=128")
    assert r3.returncode == 0 and "already there" in r3.stdout, r3.stdout + r3.stderr
    assert (out / "args.txt").read_text().splitlines()[-4:-2] == ["--set", "regen_max_new=128"]


def test_prepare_fails_clearly_when_a_call_would_not_fit(tmp_path, files):
    gguf, inputs, _ = files
    r = prepare(tmp_path, gguf, inputs, tree=BUDGET - 100_000)
    assert r.returncode == 2
    assert "call 2" in r.stderr and "over" in r.stderr, r.stderr
    r = prepare(tmp_path, gguf, inputs, tree=BUDGET + 1)
    assert r.returncode == 2 and "no room in call 1" in r.stderr, r.stderr
    r = prepare(tmp_path, gguf, inputs, tree="9.9MB")
    assert r.returncode == 2 and "TREE_BYTES" in r.stderr


def test_call2_needs_call1_and_enough_time(tmp_path, files):
    gguf, inputs, _ = files
    assert prepare(tmp_path, gguf, inputs).returncode == 0
    co = tmp_path / "checkout"
    shutil.copytree(tmp_path / "prep" / ".device" / "call2", co / ".device" / "call2")
    out = tmp_path / "out"
    out.mkdir()
    r = run_call(co, 2, tmp_path / "stage", out, PY_RUN="false")
    assert r.returncode != 0 and "call1/run.sh" in r.stderr, r.stderr
    shutil.copytree(tmp_path / "prep" / ".device" / "call1", co / ".device" / "call1")
    assert run_call(co, 1, tmp_path / "stage", out).returncode == 0
    r = run_call(co, 2, tmp_path / "stage", out, PY_RUN="false", LIMIT_S="90")
    assert r.returncode == 2 and "would be left for the recipe" in r.stderr, r.stderr
    assert list(out.iterdir()) == []


DEAF = """#!/usr/bin/env bash
# a recipe that ignores its deadline and SIGINT: logs when it starts and when SIGINT comes, leaves a temporary file of
# a write in $OUT, and sleeps forever
log="$DDD_RECIPE_STAGE/deaf.log"
echo "start $(date +%s.%N)" >> "$log"
trap 'echo "INT $(date +%s.%N)" >> "$log"' INT
echo '{}' > "$OUT/recipe.json"
echo 'half a head' > "$OUT/.h.tar.x1y2z3"
while true; do sleep 0.2; done
"""


@pytest.mark.slow  # ~18 s of a stub recipe waiting for its signals; make test runs it
@pytest.mark.deep  # waits out a deadline (~19 s): make test-deep
def test_call2_interrupts_then_kills_a_recipe_that_ignores_its_deadline_before_the_limit(tmp_path, files):
    gguf, inputs, _ = files
    assert prepare(tmp_path, gguf, inputs, INIT_HEAD="").returncode == 0
    co = tmp_path / "checkout"
    for n in (1, 2):
        shutil.copytree(tmp_path / "prep" / ".device" / f"call{n}", co / ".device" / f"call{n}")
    stage, out = tmp_path / "stage", tmp_path / "out"
    out.mkdir()
    assert run_call(co, 1, stage, out).returncode == 0
    deaf = tmp_path / "deaf-python"
    deaf.write_text(DEAF)
    deaf.chmod(0o755)
    limit = 20
    t0 = time.time()
    r = run_call(co, 2, stage, out, PY_RUN=str(deaf), SKIP_DEP_CHECK="1", LIMIT_S=str(limit), MARGIN_S="8",
                 INT_BEFORE_S="5", KILL_AFTER_S="2", MIN_RECIPE_S="1")
    took = time.time() - t0
    assert r.returncode == 137 and "killed (SIGKILL)" in r.stdout, r.stdout + r.stderr
    assert took < limit, took
    log = dict(line.split() for line in (stage / "deaf.log").read_text().splitlines())
    assert t0 + limit - 5 - 1 <= float(log["INT"]) < t0 + limit - 2, (float(log["INT"]) - t0)
    assert sorted(p.name for p in out.iterdir()) == ["recipe.json"]  # the cut-short write is gone
    assert "removed a cut-short write" in r.stdout


def test_prepare_starts_from_the_best_head_returned_and_warns(tmp_path, files):
    gguf, inputs, _ = files
    runs = tmp_path / "runs"
    for name, acc, steps in (("2026-01-01-h200", 0.55, 100), ("2026-01-02-h200", 0.61, 100),
                             ("2026-01-03-h200", None, 100)):
        (runs / name).mkdir(parents=True)
        (runs / name / "m-eagle3.tar").write_bytes(name.encode())
        st = {"eagle3": {"steps": steps, "seconds": 10.0, "step_s": 0.1,
                         **({"best": {"eval": {"acc0": acc}}} if acc is not None else {})},
              "regenerate": {"train_tokens": 10_000}}
        cfg = {"eagle3": {"seq_len": 100, "batch_size": 1, "max_epochs": 2.0}}
        (runs / name / "recipe.json").write_text(json.dumps({"stages": st, "config": cfg, "inputs": {}}))
    np.savez(tmp_path / "inputs.npz", meta=np.asarray(json.dumps({"text_tokens": 5_000})))
    r = prepare(tmp_path, gguf, tmp_path / "inputs.npz", tree=TREE + 1, RUNS=str(runs))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"--init {runs}/2026-01-02-h200/m-eagle3.tar (held-out top-1 0.6100" in r.stdout
    init = tmp_path / "prep" / ".device" / "call2" / "init" / "m-eagle3.tar"
    assert init.read_bytes() == b"2026-01-02-h200"
    # 0.1 s a step over (0.97 - 0.35) of a 537 s window: ~3,300 steps, against 2 epochs of 150 steps
    assert "exceed its epoch cap of 300" in r.stderr, r.stderr
    assert "over TREE_BYTES" in r.stderr  # this checkout is larger than the 300 kB given
    r = prepare(tmp_path, gguf, tmp_path / "inputs.npz", RUNS=str(runs), INIT_HEAD="")
    assert r.returncode == 0 and "--init" not in r.stdout
    assert not (tmp_path / "prep" / ".device" / "call2" / "init").exists()
