"""Decode speed of vanilla and DDD device at several batch sizes (prefill excluded), the methods alternating per
batch size in one process, with the library's default settings (a calibration when one is saved) or the shipped
settings file (DDD_JAX_CALIBRATE=0). Usage: python experiments/batch_speed.py [BATCHES] [NEW_TOKENS]
e.g. python experiments/batch_speed.py 1,4,8,16 64"""
from __future__ import annotations

import json
import sys

import jax.numpy as jnp

from ddd_jax import generate, load_draft, load_target
from ddd_jax.bench.mtbench import load_questions


def main(argv):
    batches = [int(b) for b in (argv[0] if argv else "1,4,8,16").split(",")]
    new = int(argv[1]) if len(argv) > 1 else 64
    target = load_target("smollm2-135m-instruct")
    draft = load_draft("smollm2-135m-instruct-eagle", target).astype(jnp.float16)
    qs = load_questions(limit=max(batches))
    prompts = [target.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in qs]
    rows = []
    for b in batches:
        ps = prompts[:b] if b > 1 else prompts[0]
        run = {}
        for rnd in range(2):  # the first round compiles
            for m in ("vanilla", "ddd"):
                r = generate(target, draft if m == "ddd" else None, ps, max_new_tokens=new, method=m)
                run[m] = (r.stats["new_tokens"] - (b if b > 1 else 1)) / r.stats["decode_s"]
                if m == "ddd":
                    run["settings"] = r.stats["settings"]
        rows.append({"batch": b, "vanilla_tok_s": round(run["vanilla"], 1),
                     "ddd_device": round(run["ddd"] / run["vanilla"], 3),
                     "tree": run["settings"]["tree"], "source": run["settings"]["source"][:60]})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
