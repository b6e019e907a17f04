"""Two or more builds of the CPU attention kernel head to head, alone, in alternating processes.

    python experiments/attention_ab.py BUILD BUILD [BUILD ...] [--sizes 1,7,16] [--mode stream] [--threads 2]
                                 [--rounds 4] [--reps 30]
    e.g. python experiments/attention_ab.py HEAD~1 HEAD --sizes 7,16

Each BUILD is a git revision or a path to a cpu_kernels.cc; its source is compiled into `attention_harness.cc`
(beside this file), which times `Attention`'s body -- the chunking over threads and `attend_rows` -- for SmolLM2's
30 layers at 256 cached tokens plus T new rows (see the harness's header): mode "stream" reads 3.5 MB of other data
before each layer's call, as the layer's products do in the target forward, so keys and values come from memory;
mode "l2" keeps one layer's keys and values hot (the arithmetic alone; best with --threads 1). Each round runs
every build once per size (builds in alternating order, round by round) and prints microseconds a layer (the
median of --reps passes); then per build the median over rounds [min-max]. The checksums of the outputs are printed
too: a change meant to keep the bits must keep them.

The target forward (experiments/kernel_ab.py) moves by +-10% between minutes on a noisy VM, more than a kernel change of
a few percent of it; the kernel alone resolves more (2026-11-26, commit 6f6b06a against its parent: 16 rows on one
thread in L2 145.8 -> 131.8 us a layer over 4 rounds, ranges apart, where the forward read t(16) 29.48 / 29.01 ms).
Streamed runs drift too: read many rounds.
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

from kernel_ab import FLAGS, ROOT, source  # run from experiments/ (python experiments/attention_ab.py)

HARNESS = Path(__file__).resolve().parent / "attention_harness.cc"


def build(rev: str, out_dir: str) -> str:
    """The harness binary for `rev`: a cpu_kernels.cc path, or the kernels of git revision `rev`."""
    if rev.endswith(".cc"):
        if not os.path.exists(rev):
            raise SystemExit(f"attention_ab: no kernel source {rev}")
        src = os.path.abspath(rev)
    else:
        src = str(source(rev, out_dir, tool="attention_ab"))
    import jax.ffi  # the FFI headers, as setup.py finds them
    exe = str(Path(out_dir) / (Path(src).stem + f"_{abs(hash(rev)) % 10**8}"))
    r = subprocess.run(["g++", *FLAGS, f"-I{jax.ffi.include_dir()}", f'-DKERNEL_CC="{src}"', str(HARNESS), "-o",
                        exe, "-lpthread"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"attention_ab: building {rev} failed:\n{r.stderr[-2000:]}")
    return exe


def run(exe: str, size: int, mode: str, reps: int, threads: int) -> dict:
    r = subprocess.run([exe, str(size), mode, str(reps), str(threads)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"attention_ab: {exe} {size} {mode} failed ({r.returncode}): {r.stderr.strip()}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="*", help="git revisions or cpu_kernels.cc paths")
    ap.add_argument("--sizes", default="1,7,16", help="new rows a call, comma-separated (1 to 256)")
    ap.add_argument("--mode", default="stream", choices=["stream", "l2"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in a.sizes.split(",")]
    except ValueError:
        raise SystemExit(f"attention_ab: --sizes must be integers, got {a.sizes!r}")
    if any(not 1 <= s <= 256 for s in sizes):
        raise SystemExit("attention_ab: sizes must be in [1, 256] (the harness's 512-slot cache holds 256 cached)")
    if len(a.builds) < 2:
        raise SystemExit("attention_ab: name at least two builds (git revisions or cpu_kernels.cc paths)")
    if a.rounds < 1 or a.reps < 1 or a.threads < 1:
        raise SystemExit("attention_ab: --rounds, --reps and --threads must be at least 1")
    with tempfile.TemporaryDirectory(prefix="ddd_jax_attention_ab_") as tmp:
        exes = [build(b, tmp) for b in a.builds]
        res = {b: {n: [] for n in sizes} for b in a.builds}
        sums = {b: {} for b in a.builds}
        for rnd in range(a.rounds):
            order = list(zip(a.builds, exes))
            for b, exe in (order if rnd % 2 == 0 else order[::-1]):
                got = {n: run(exe, n, a.mode, a.reps, a.threads) for n in sizes}
                for n in sizes:
                    res[b][n].append(got[n]["us"])
                    sums[b][n] = got[n]["checksum"]
                print(f"round {rnd} {b}: " + " ".join(f"T={n} {got[n]['us']:.1f}" for n in sizes) + " us",
                      flush=True)
    for b in a.builds:
        print(f"{b}: " + " ".join(f"T={n} {statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]"
                                  for n, v in res[b].items()) + f" us a layer ({a.mode}, {a.threads} threads); "
              "checksums " + " ".join(f"{sums[b][n]:.9g}" for n in sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
