"""Decode speed of vanilla and DDD device at several batch sizes (prefill excluded), the two methods alternating
in one process, with the library's default settings (this device's calibration when one is saved, else the shipped
settings file; DDD_JAX_CALIBRATE=0 for the file). The first round compiles; the ratio is the median over `--rounds`
timed rounds of each round's DDD / vanilla decode speed.

    python experiments/batch_speed.py [--batches 1,4,8,16] [--new-tokens 64] [--rounds 3] [--gguf-blocks]
        [--method eagle2]   (EAGLE-2's defaults instead of DDD device's; the column keeps its name)
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import jax.numpy as jnp

from ddd_jax import generate, load_draft, load_target
from ddd_jax.bench.mtbench import load_questions
from ddd_jax.settings.calibration import cpu_model


def decode_speed(r, b: int) -> float:
    """New tokens a second after the prefill (the prefill's own token excluded)."""
    return (r.stats["new_tokens"] - b) / r.stats["decode_s"]


def _mean(stats: dict, key: str) -> float:
    """A per-sequence mean, averaged over a batch's sequences."""
    seqs = stats.get("per_sequence", [stats])
    return round(statistics.mean(s[key] for s in seqs), 3)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gguf-blocks", action="store_true", help="the target kept as GGUF blocks")
    ap.add_argument("--method", default="ddd", choices=("ddd", "eagle2"), help="the speculative method beside vanilla")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    target = load_target("smollm2-135m-instruct", gguf_blocks=args.gguf_blocks)
    draft = load_draft("smollm2-135m-instruct-eagle", target).astype(jnp.float16)
    qs = load_questions(limit=max(batches))
    prompts = [target.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in qs]
    print(json.dumps({"host": cpu_model() or platform.processor(), "new_tokens": args.new_tokens,
                      "storage": "blocks" if args.gguf_blocks else "float32", "rounds": args.rounds}), flush=True)
    for b in batches:
        ps = prompts[:b] if b > 1 else prompts[0]
        speed = {"vanilla": [], "ddd": []}
        for rnd in range(args.rounds + 1):  # round 0 compiles
            for m in ("vanilla", "ddd"):
                r = generate(target, draft if m == "ddd" else None, ps, max_new_tokens=args.new_tokens,
                             method=args.method if m == "ddd" else m)
                if rnd:
                    speed[m].append(decode_speed(r, b if b > 1 else 1))
                if m == "ddd":
                    st = r.stats
        ratios = [d / v for d, v in zip(speed["ddd"], speed["vanilla"])]
        s = st["settings"]
        print(json.dumps({"batch": b, "vanilla_tok_s": round(statistics.median(speed["vanilla"]), 1),
                          "ddd_tok_s": round(statistics.median(speed["ddd"]), 1),
                          "method": args.method, "ddd_device": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios],
                          "decoded_as": s.get("decoded_as"), "why": s.get("why", "")[:120],
                          "tau": _mean(st, "mean_accepted"), "mean_verified": _mean(st, "mean_verified"),
                          "tree": s["tree"], "ddd": s.get("ddd"), "source": s["source"][:80]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
