"""The int8 block products' VNNI variants checked on any AVX2 CPU, against the AVX2 variant, bitwise.

    python experiments/int8_emulation.py [BUILD]

BUILD: a cpu_kernels.cc path or a git revision (default: this checkout's kernels). Its source is compiled into
`int8_emulation.cc` (beside this file), which emulates the AVX-512 VNNI and AVX-VNNI intrinsics of the integer
tiles in scalar code and compares every variant's product with the AVX2 variant's (see the harness's header). A
host without VNNI cannot run those variants otherwise; `tests/test_int8_blocks.py` checks the AVX2 variant (and
each variant the CPU has) against a numpy model of the arithmetic. Prints {"checks": n, "mismatches": k}.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kernel_ab import FLAGS, ROOT, source  # run from experiments/ (python experiments/int8_emulation.py)

HARNESS = Path(__file__).resolve().parent / "int8_emulation.cc"
KERNELS = ROOT / "ddd_jax" / "backends" / "cpu" / "csrc" / "cpu_kernels.cc"


def build(rev: str, out_dir: str) -> str:
    """The harness binary for `rev`: a cpu_kernels.cc path, or the kernels of git revision `rev`."""
    src = str(Path(rev).resolve()) if rev.endswith(".cc") else str(source(rev, out_dir, tool="int8_emulation"))
    if not Path(src).exists():
        raise SystemExit(f"int8_emulation: no kernel source {src}")
    import jax.ffi  # the FFI headers, as setup.py finds them
    exe = str(Path(out_dir) / "int8_emulation")
    r = subprocess.run(["g++", *FLAGS, "-Wno-psabi", f"-I{jax.ffi.include_dir()}", f'-DKERNEL_CC="{src}"',
                        str(HARNESS), "-o", exe, "-lpthread"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"int8_emulation: building {rev} failed:\n{r.stderr[-2000:]}")
    return exe


def run(exe: str) -> dict:
    """{"checks": n, "mismatches": k, "stderr": each mismatch}."""
    r = subprocess.run([exe], capture_output=True, text=True)
    if r.returncode not in (0, 1) or not r.stdout.strip():
        raise SystemExit(f"int8_emulation: {exe} failed ({r.returncode}): {r.stderr.strip()}")
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "stderr": r.stderr}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rev = argv[0] if argv else str(KERNELS)
    with tempfile.TemporaryDirectory() as d:
        out = run(build(rev, d))
    sys.stderr.write(out.pop("stderr"))
    print(json.dumps(out))
    return 1 if out["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
