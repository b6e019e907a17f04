"""The CPU kernels' L2-prefetch row threshold (`kernels.l2_prefetch_rows`) head to head in one process: vanilla and
DDD device (the shipped head in float16, the tuned settings) at each threshold, interleaved per prompt.

    python experiments/prefetch_ab.py N START ROWS[,ROWS...]
    e.g. python experiments/prefetch_ab.py 80 0 6,1     (Intel's default against AMD's)

MT-bench first turns [START, START+N) with the chat template, 64 new tokens, greedy. The threshold is a runtime
setting of the kernel library (prefetches only: no recompile, no bit changes), so every variant runs the same
compiled loops. Prints per variant: tok/s (decode time only), speed-up vs the vanilla of the same threshold and vs
the first threshold's vanilla, τ, outputs identical to the first threshold's vanilla.
"""
import sys
import time

import ddd_jax as dj
from ddd_jax.backends.cpu import kernels
from ddd_jax.bench.mtbench import load_questions

HEAD = "smollm2-135m-instruct-eagle"


def main(argv) -> int:
    if len(argv) != 3:
        raise SystemExit(__doc__)
    n, start = int(argv[0]), int(argv[1])
    variants = [int(v) for v in argv[2].split(",")]
    if not kernels.avx512():
        raise SystemExit("the L2-prefetch threshold applies to the AVX-512 kernels, which do not run here")
    target = dj.load_target("smollm2-135m-instruct")
    draft = dj.load_draft(HEAD, target).astype("float16")
    qs = load_questions(None)[start:start + n]
    ids = [target.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in qs]
    runs = [(v, m) for v in variants for m in ("vanilla", "ddd")]
    ref = (variants[0], "vanilla")

    def run(rows, method, p):
        kernels.set_l2_prefetch_rows(rows)
        return dj.generate(target, draft if method == "ddd" else None, p, max_new_tokens=64, method=method)

    t0 = time.time()
    for method in ("vanilla", "ddd"):  # compile every prompt bucket
        for p in ids:
            run(variants[0], method, p)
    print(f"warm-up {time.time() - t0:.0f} s", flush=True)
    tok, sec, calls, same = (dict.fromkeys(runs, 0) for _ in range(4))
    for i, p in enumerate(ids):
        out = {}
        for r in (runs if i % 2 == 0 else runs[::-1]):
            res = run(*r, p)
            out[r] = res.tokens
            tok[r] += res.stats["new_tokens"] - 1
            sec[r] += res.stats["decode_s"]
            calls[r] += res.stats["target_calls"]
        for r in runs:
            same[r] += out[r] == out[ref]
    speed = {r: tok[r] / sec[r] for r in runs}
    for r in runs:
        print(f"l2rows={r[0]:<3d} {r[1]:8s} {speed[r]:6.1f} tok/s  speedup {speed[r] / speed[(r[0], 'vanilla')]:.3f}"
              f"  vs l2rows={variants[0]} vanilla {speed[r] / speed[ref]:.3f}  tau {tok[r] / max(calls[r], 1):.3f}"
              f"  identical {same[r]}/{len(ids)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
