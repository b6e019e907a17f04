"""How much any per-cycle stop rule could gain with a head, replayed over its recorded pools (no decoding): the best
static EAGLE-2 tree of the pools' top_k, DDD's threshold rule, the expected-gain rule, a rule that knew every step's
calibrated probabilities in advance ("p-oracle": the most calibrated probabilities can give), and one that knew each
cycle's accepted length ("oracle"). Costs are this device's calibration (its in-loop costs at batch 1).

    python experiments/rule_ceiling.py [--limit 16] [--gguf-blocks] [--out FILE.json]

The pools are drafted at every position of the target's greedy replies to the first --limit MT-bench turns
(`measure.node_acceptance.pool_records`); the calibration table comes from the head's own pools (the calibration
prompts), so the MT-bench replay is held out.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

import ddd_jax
from ddd_jax.config import verify_widths
from ddd_jax.measure import node_acceptance as na
from ddd_jax.measure.prompts import load_questions
from ddd_jax.settings.calibration import calibrated_choice, load_pools


def p_oracle(replay: na.Replay, n: int, lam: float, rounds: int = 6) -> dict:
    """Each cycle drafts to the depth and verifies the width that maximise E - lam * C with E from the calibrated
    probabilities of the nodes it would have then (known in advance), lam iterated to the rule's own rate."""
    r = None
    for _ in range(rounds):
        C = replay.rec["score"].shape[0]
        best, dep, kept = np.full(C, -np.inf), np.zeros(C, int), np.zeros(C, int)
        for j in range(int(replay.rec["max_depth"]) + 1):
            _, E, Cst, m = replay.best_width(j, n, lam)
            v = E - lam * Cst
            up = v > best
            best[up], dep[up], kept[up] = v[up], j, m[up]
        r = replay._result(dep, kept)
        lam = r["speedup"] / replay.t1
    return r


def calibrated_pair(gguf_blocks: bool = False):
    """(SmolLM2, its shipped head in float16, this device's calibrated costs at batch 1, the head's recorded pools);
    exits saying what to run where the calibration or the pools are missing."""
    target = ddd_jax.load_target("smollm2-135m-instruct", gguf_blocks=gguf_blocks)
    draft = ddd_jax.load_draft("smollm2-135m-instruct-eagle", target).astype("float16")
    got = calibrated_choice(target, draft, 1)
    if got is None or got[0] is None:
        raise SystemExit("no calibration for this device: run `ddd-jax calibrate` first")
    own = load_pools(draft)
    if own is None:
        raise SystemExit("the head has no recorded pools: `ddd-jax calibrate` records them")
    return target, draft, got[0]["costs"], own


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--gguf-blocks", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    target, draft, costs, own = calibrated_pair(args.gguf_blocks)
    table = na.acceptance_table(own)
    ids = [target.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in load_questions(None)[:args.limit]]
    rec = na.pool_records(target, draft, ids, top_k=own["top_k"], max_depth=own["max_depth"], progress=True)
    k = own["top_k"]
    out = {"reliability": {x: v for x, v in na.reliability(table, rec).items() if x != "deciles"}, "trees": {}}
    for n in (5, 8, 16):
        replay = na.Replay(rec, table, {**costs, "draft_ms": na._interp(costs["draft_ms"])(k)}, verify_widths(n))
        static = max((replay.static(n, d) for d in range(own["max_depth"] + 1)), key=lambda r: r["speedup"])
        thr = max((replay.threshold(n, s, x, own["max_depth"]) for s in ((0, 1, 3, 5), (1, 3, 5), (0, 1, 2, 3, 4, 5))
                   for x in (-0.5, -1.0, -2.0)), key=lambda r: r["speedup"])
        rate, gain = 0.0, None
        for _ in range(4):
            gain = replay.gain(n, own["max_depth"], 0.0, rate or None)
            rate = gain["speedup"] / replay.t1
        out["trees"][f"k{k}-n{n}"] = {
            "best static": static["speedup"], "best threshold": thr["speedup"], "gain": gain["speedup"],
            "p-oracle": p_oracle(replay, n, rate)["speedup"], "oracle": replay.oracle()["speedup"],
            "tau": {"static": static["tau"], "gain": gain["tau"]}}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
