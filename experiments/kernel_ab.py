"""Two builds of the CPU kernel library head to head on the target forward, in alternating processes.

    python experiments/kernel_ab.py BUILD BUILD [BUILD ...] [--sizes 1,7,16] [--rounds 6] [--context 256] [--reps 15]
                              [--gguf-blocks]
    e.g. python experiments/kernel_ab.py 23b57b9 HEAD --sizes 1,8,16,32

Each argument is a built library (a path ending in .so) or a git revision whose kernel source (`KERNEL_SOURCES`) is
compiled with setup.py's flags into a temporary library. A kernel change is C++, not a runtime switch, so the two
builds cannot share one process: each round starts one process per build (in alternating order, round by round)
that loads the SmolLM2 target with that library (`DDD_JAX_KERNELS_LIB`) and times the target forward of each size
(`ddd_jax.measure.cost.cost_curve`, what `ddd-jax bench --cost-curve` times: the target's own greedy tokens at positions
`context`.. after its decoded context, in a 512-slot cache, causal among themselves), median of `reps` calls, three passes over the sizes. Prints every
round's numbers, then per build the median over rounds [min-max] in ms. The VM's memory speed drifts between
minutes (README, "memory phases"): read the rounds side by side, not one build's number alone.
`--gguf-blocks` loads the target as the GGUF file's blocks (`load_target(..., gguf_blocks=True)`: quantized panels on
the CPU) instead of float32 panels.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-Wno-attributes", "-Wno-return-type"]  # setup.py's


KERNEL_SOURCES = ("ddd_jax/backends/cpu/csrc/cpu_kernels.cc", "ddd_jax/csrc/cpu_kernels.cc")  # now, before the move


def source(rev: str, out_dir: str, tool: str = "kernel_ab") -> Path:
    """The kernels' source at git revision `rev`, written into out_dir."""
    for path in KERNEL_SOURCES:
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True)
        if src.returncode == 0:
            break
    else:
        raise SystemExit(f"{tool}: git revision {rev!r} has no kernel source ({src.stderr.strip()})")
    cc = Path(out_dir) / f"{rev.replace('/', '_')}.cc"
    cc.write_text(src.stdout)
    return cc


def build(rev: str, out_dir: str) -> str:
    """A library path: `rev` itself when it is a .so, else the kernels of git revision `rev` compiled."""
    if rev.endswith(".so"):
        if not os.path.exists(rev):
            raise SystemExit(f"kernel_ab: no library {rev}")
        return rev
    import jax.ffi  # the FFI headers, as setup.py finds them
    cc = source(rev, out_dir)
    so = cc.with_suffix(".so")
    r = subprocess.run(["g++", *FLAGS, "-fPIC", "-shared", f"-I{jax.ffi.include_dir()}", str(cc), "-o", str(so),
                        "-lpthread"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"kernel_ab: building {rev} failed:\n{r.stderr[-2000:]}")
    return str(so)


def child(sizes: list, context: int, reps: int, gguf_blocks: bool = False) -> None:
    """One build's timings (the library comes from DDD_JAX_KERNELS_LIB): one JSON line {size: ms}, the median of
    three `cost_curve` passes (each a median of `reps` forwards)."""
    import ddd_jax as dj
    from ddd_jax.backends.cpu import kernels
    from ddd_jax.measure.cost import cost_curve

    if not kernels.available():
        raise SystemExit("kernel_ab: the kernel library did not load")
    target = dj.load_target("smollm2-135m-instruct", gguf_blocks=gguf_blocks)
    passes = [cost_curve(target, None, sizes, context=context, capacity=512, repeat=reps)["rows"] for _ in range(3)]
    print(json.dumps({n: statistics.median(p[i]["target_ms"] for p in passes) for i, n in enumerate(sizes)}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="*", help="git revisions or built .so paths")
    ap.add_argument("--sizes", default="1,7,16", help="tokens per forward, comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache (< 448)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--gguf-blocks", action="store_true", help="the target as GGUF blocks (quantized panels)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in a.sizes.split(",")]
    except ValueError:
        raise SystemExit(f"kernel_ab: --sizes must be integers, got {a.sizes!r}")
    if any(s < 1 for s in sizes) or a.context < 0 or a.context + max(sizes) > 512:
        raise SystemExit("kernel_ab: sizes must be >= 1 and context + the largest size at most 512 (the cache)")
    if a.child:
        child(sizes, a.context, a.reps, a.gguf_blocks)
        return 0
    if len(a.builds) < 2:
        raise SystemExit("kernel_ab: name at least two builds (git revisions or .so paths)")
    if a.rounds < 1:
        raise SystemExit("kernel_ab: --rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="ddd_jax_kernel_ab_") as tmp:
        libs = [build(b, tmp) for b in a.builds]
        res = {b: {n: [] for n in sizes} for b in a.builds}
        child_args = ["--child", "--sizes", a.sizes, "--context", str(a.context), "--reps", str(a.reps)]
        child_args += ["--gguf-blocks"] if a.gguf_blocks else []
        for rnd in range(a.rounds):
            order = list(zip(a.builds, libs))
            for b, lib in (order if rnd % 2 == 0 else order[::-1]):
                r = subprocess.run([sys.executable, __file__, *child_args],
                                   env={**os.environ, "DDD_JAX_KERNELS_LIB": lib}, capture_output=True, text=True)
                if r.returncode != 0:
                    raise SystemExit(f"kernel_ab: the run of {b} failed:\n{r.stderr[-2000:]}")
                got = json.loads(r.stdout.strip().splitlines()[-1])
                print(f"round {rnd} {b}: " + " ".join(f"t({n})={got[str(n)]:.2f}" for n in sizes), flush=True)
                for n in sizes:
                    res[b][n].append(got[str(n)])
    for b in a.builds:
        print(f"{b}: " + " ".join(f"t({n}) {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"
                                  for n, v in res[b].items()) + " ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
