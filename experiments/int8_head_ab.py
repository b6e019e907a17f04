"""int8 vanilla with the output projection through integer products (the default of `gguf_blocks="int8"`) against
the same load with its exact float32 output projection, and against exact blocks, interleaved per prompt in one
process:

    python experiments/int8_head_ab.py [N=6]

The first N MT-bench first turns, 64 new tokens, twice; prints tok/s per load (decode time only) and how many
replies the two int8 loads share.
"""
import dataclasses
import json
import sys


def main(argv) -> int:
    import ddd_jax
    from ddd_jax import generate
    from ddd_jax.backends.cpu import quant
    from ddd_jax.measure.prompts import build_prompt, load_questions

    t8 = ddd_jax.load_target("smollm2-135m-instruct", gguf_blocks="int8")
    p = dict(t8.params)
    p["embed"] = quant.pack_blocks(p["embed"], int8=False)  # the exact output projection (lookups unchanged)
    runs = {"int8": t8, "int8, exact output projection": dataclasses.replace(t8, params=p),
            "exact blocks": ddd_jax.load_target("smollm2-135m-instruct", gguf_blocks=True)}
    ids = [build_prompt(t8, q, 0, []) for q in load_questions(limit=int(argv[0]) if argv else 6)]
    for t in runs.values():  # compile
        generate(t, None, ids[0], max_new_tokens=64, capacity=1024)
    tok, sec, same = {k: 0 for k in runs}, {k: 0.0 for k in runs}, 0
    for _ in range(2):
        for prompt in ids:
            out = {}
            for k, t in runs.items():
                g = generate(t, None, prompt, max_new_tokens=64, capacity=1024)
                tok[k] += len(g.tokens) - 1
                sec[k] += g.stats["decode_s"]
                out[k] = g.tokens
            same += out["int8"] == out["int8, exact output projection"]
    print(json.dumps({**{k: round(tok[k] / sec[k], 1) for k in runs}, "int8_replies_identical": same,
                      "replies": 2 * len(ids)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
