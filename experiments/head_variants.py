"""Speculative variants that `ddd-jax bench` cannot put in one run -- the same head in different weight dtypes, the
target's float32 weights beside its GGUF blocks -- interleaved per prompt with vanilla in one process, so their
speed-ups share one stretch of the host.

    python experiments/head_variants.py N START [--weights float,blocks] VARIANT [VARIANT ...]
    VARIANT = name:dtype:method:top_k:total_tokens:depth:checks:threshold:max_depth[:head]
            | name:dtype:tuned[:head]   (DDD with the settings `generate` resolves for the shipped head: `cpu.json`
                                         here; a `head` directory drafts with them too, as a candidate version)
            | name:dtype:tuned+KEY=VALUE,...[:head]   (those settings with some fields replaced: any TreeConfig
                                         or DDDConfig field; check_steps as 0/1/3)
    e.g. python experiments/head_variants.py 20 0 ddd32:float32:ddd:4:4:2:1/3/5:-1:6 ddd16:float16:ddd:4:4:2:1/3/5:-1:6
         python experiments/head_variants.py 40 0 ddd16:float16:tuned ddd8:q8_0:tuned
         python experiments/head_variants.py 80 0 n7:float16:tuned n8:float16:tuned+total_tokens=8,threshold=-1.5

MT-bench first turns [START, START+N) with the chat template, 64 new tokens, greedy; SmolLM2-135M-Instruct and the
shipped head (or `head`: a head directory, to compare candidate heads in one run); every variant compiled for
every prompt first, then per prompt all variants in alternating order.
--weights: the target loads to run them on (default float: float32 weights; blocks: `gguf_blocks=True`; int8:
`gguf_blocks="int8"`, integer products whose tokens differ from float vanilla's; float48 /
float16: float32 weights in 48- / 16-column panels, `panels=48` / `panels=16`); every
variant and vanilla runs on each, named `<name>/<weights>` when there is more than one.
Prints per variant: tok/s (decode time only), speed-up vs the vanilla of the same weights (and vs float vanilla),
τ, outputs identical to that vanilla's.
"""
import dataclasses
import sys
import time

import jax.numpy as jnp

import ddd_jax as dj
from ddd_jax.bench.mtbench import load_questions

SHIPPED_HEAD = "smollm2-135m-instruct-eagle"


def _replaced(target, draft, edits: str):
    """The tuned (TreeConfig, DDDConfig) this pair resolves to, with `edits` ("key=value,...") replaced."""
    from ddd_jax.config import check_tree_for_ddd
    from ddd_jax.settings import resolve
    tree, ddd, _ = resolve(target, draft)
    for edit in edits.split(","):
        key, _, value = edit.partition("=")
        cfg = tree if key in {f.name for f in dataclasses.fields(tree)} else ddd
        if key not in {f.name for f in dataclasses.fields(cfg)}:
            raise SystemExit(f"tuned+{edits}: {key!r} is no TreeConfig or DDDConfig field")
        old = getattr(cfg, key)
        new = tuple(int(c) for c in value.split("/")) if isinstance(old, tuple) else type(old)(value)
        if cfg is tree:
            tree = dataclasses.replace(tree, **{key: new})
        else:
            ddd = dataclasses.replace(ddd, **{key: new})
    check_tree_for_ddd(tree, ddd)
    return tree, ddd


# --weights: load_target's panels
PANEL_WIDTH = {"float": None, "blocks": None, "int8": None, "float48": 48, "float16": 16}
GGUF_BLOCKS = {"blocks": True, "int8": "int8"}  # --weights: load_target's gguf_blocks (others: False)


def main(argv) -> int:
    weights = ["float"]
    if "--weights" in argv:
        i = argv.index("--weights")
        weights = argv[i + 1].split(",")
        argv = argv[:i] + argv[i + 2:]
        if not weights or set(weights) - set(PANEL_WIDTH):
            raise SystemExit(f"--weights takes {', '.join(PANEL_WIDTH)}, got {weights}")
    n, start = int(argv[0]), int(argv[1])
    # (a head packs its panels at its target's width)
    targets = {w: dj.load_target("smollm2-135m-instruct", gguf_blocks=GGUF_BLOCKS.get(w, False), panels=PANEL_WIDTH[w])
               for w in weights}
    specs = [("vanilla", None)] + [(v.split(":")[0], v.split(":")[1:]) for v in argv[2:]]
    runs = {}
    for w, target in targets.items():
        heads = {}
        for name, spec in specs:
            key = name if len(targets) == 1 else f"{name}/{w}"
            if spec is None:
                runs[key] = dict(target=target, draft=None, method="vanilla", base=key)
                continue
            tuned = len(spec) in (2, 3) and spec[1].split("+")[0] == "tuned"
            if not tuned and len(spec) not in (8, 9):
                raise SystemExit(f"variant {name}: want 9 or 10 ':'-separated fields (or name:dtype:tuned[:head]), "
                                 f"got {len(spec) + 1}")
            head_name = spec[-1] if len(spec) in (3, 9) else SHIPPED_HEAD
            if head_name not in heads:
                heads[head_name] = dj.load_draft(head_name, target)
            base = "vanilla" if len(targets) == 1 else f"vanilla/{w}"
            if tuned:  # tree and DDD settings resolved by generate (the head's tuned settings for this backend);
                # a candidate head directory counts as a version of the shipped head, so it drafts with its settings
                draft = dataclasses.replace(heads[head_name], name=SHIPPED_HEAD)
                runs[key] = dict(target=target, draft=draft.astype(spec[0]), method="ddd", base=base)
                if "+" in spec[1]:
                    runs[key]["tree"], runs[key]["ddd"] = _replaced(target, draft, spec[1].split("+", 1)[1])
                continue
            dtype, method, k, N, d, checks, x, depth = spec[:8]
            runs[key] = dict(target=target, draft=heads[head_name].astype(dtype), method=method, base=base,
                             tree=dj.TreeConfig(top_k=int(k), total_tokens=int(N), depth=int(d)),
                             ddd=dj.DDDConfig(check_steps=tuple(int(c) for c in checks.split("/")),
                                              threshold=float(x), max_depth=int(depth)))
    qs = load_questions(None)[start:start + n]
    for k, kw in runs.items():
        if kw.get("tree") is not None:
            print(f"{k}: {kw['tree']} {kw['ddd']}", flush=True)
    first = next(iter(targets.values()))
    ids = [first.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in qs]

    def run(kw, p):
        return dj.generate(kw["target"], kw["draft"], p, max_new_tokens=64, method=kw["method"],
                           tree=kw.get("tree"), ddd=kw.get("ddd"))

    t0 = time.time()
    for kw in runs.values():  # compile every prompt bucket
        for p in ids:
            run(kw, p)
    print(f"warm-up {time.time() - t0:.0f} s", flush=True)
    tok = dict.fromkeys(runs, 0)
    sec = dict.fromkeys(runs, 0.0)
    calls = dict.fromkeys(runs, 0)
    same = dict.fromkeys(runs, 0)
    same_vanilla = dict.fromkeys(runs, 0)
    for i, p in enumerate(ids):
        out = {}
        for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            r = run(runs[name], p)
            out[name] = r.tokens
            tok[name] += r.stats["new_tokens"] - 1
            sec[name] += r.stats["decode_s"]
            calls[name] += r.stats["target_calls"]
        for name in runs:
            same[name] += out[name] == out[runs[name]["base"]]
            same_vanilla[name] += out[name] == out[next(iter(runs))]
    ref = tok[next(iter(runs))] / sec[next(iter(runs))]  # the first weights' vanilla
    if len(targets) > 1:  # do the weights' vanilla runs agree with the first weights' (summation orders differ)?
        first_v = runs[next(iter(runs))]["base"]
        for k, kw in runs.items():
            if kw["draft"] is None and k != first_v:
                same[f"{k} == {first_v}"] = same_vanilla[k]
    for k, kw in runs.items():
        speed = tok[k] / sec[k]
        base = tok[kw["base"]] / sec[kw["base"]]
        print(f"{k:16s} {speed:6.1f} tok/s  speedup {speed / base:.3f}  vs {next(iter(runs))} {speed / ref:.3f}  "
              f"tau {tok[k] / max(calls[k], 1):.2f}  identical {same[k]}/{len(ids)}", flush=True)
    for k in [k for k in same if "==" in k]:
        print(f"{k}: {same[k]}/{len(ids)} outputs identical", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
