"""Decode speed of whichever ddd_jax checkout is importable -- for before/after comparisons of two checkouts in one
session, where `ddd-jax bench` may not exist in the older one. It uses only the long-stable public API.

    PYTHONPATH=/path/to/old/checkout python experiments/decode_speed.py 8 question.jsonl
    python experiments/decode_speed.py 8 question.jsonl          # this checkout (the installed package)

Loads SmolLM2-135M-Instruct and the shipped head, runs vanilla, EAGLE-2 and DDD (device, host) with the tuned CPU
trees (top_k 2, 8 tokens, depth 2; DDD S={2,4}, x=-1, n=6) on the first N MT-bench first turns (chat template,
64 new tokens, capacity 1024), methods interleaved per prompt after one compile pass, and prints one JSON line:
tok/s per method (decode time only), speed-ups vs vanilla, and how many outputs equal vanilla's.
"""
import json
import sys


def main(argv) -> int:
    import ddd_jax
    from ddd_jax import DDDConfig, TreeConfig, generate

    n = int(argv[0]) if argv else 8
    qs = [json.loads(line) for line in open(argv[1])][:n]
    t = ddd_jax.load_target("smollm2-135m-instruct")
    d = ddd_jax.load_draft("smollm2-135m-instruct-eagle", t)
    tree = TreeConfig(top_k=2, total_tokens=8, depth=2)
    ddd = DDDConfig(check_steps=(2, 4), threshold=-1.0, max_depth=6)
    ids = [t.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in qs]
    runs = {"vanilla": dict(method="vanilla"), "eagle2": dict(method="eagle2", tree=tree, ddd=ddd),
            "ddd-device": dict(method="ddd", sync="device", tree=tree, ddd=ddd),
            "ddd-host": dict(method="ddd", sync="host", tree=tree, ddd=ddd)}
    for kw in runs.values():  # compile
        generate(t, d, ids[0], max_new_tokens=64, capacity=1024, **kw)
    tok, sec, same = ({k: 0 for k in runs}, {k: 0.0 for k in runs}, {k: 0 for k in runs})
    for p in ids:
        ref = None
        for k, kw in runs.items():
            r = generate(t, d, p, max_new_tokens=64, capacity=1024, **kw)
            ref = r.tokens if ref is None else ref
            same[k] += r.tokens == ref
            tok[k] += len(r.tokens) - 1
            sec[k] += r.stats["decode_s"]
    out = {k: tok[k] / sec[k] for k in runs}
    out.update({f"{k}_speedup": out[k] / out["vanilla"] for k in runs})
    out["identical"] = {k: f"{same[k]}/{len(ids)}" for k in runs}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
