"""τ of two or more heads over the MT-bench first turns, replayed from recorded pools instead of decoded: each head
drafts its full candidate pool (top_k beams, max_depth steps) at every position of the target's greedy reply to
every turn (`measure.node_acceptance.pool_records`), and `Replay` walks the cycles a decode would take. Greedy
acceptance of a tree is the number of its nodes on the target's path, so τ is exactly a decode's for that tree,
at a small fraction of verifying 60-row trees on a CPU; it checks no output (the decode tests do).

    python experiments/head_ab.py --limit 80 HEAD [HEAD ...] [--out FILE.json]

Per head: τ of EAGLE-2's default tree (top_k 10, 60 tokens, depth 5), of the tuned CPU tree without lookup
(top_k 4, 7 tokens, depth 2), and of DDD's threshold rule at the paper's checks S = {5, 7, 9}, max depth 11, at
thresholds -0.3 and -1.0 over the default tree, with the share of cycles drafting past step 5; and per level the
chance that some node at the level is accepted given the level before was (over every recorded position).
"""
from __future__ import annotations

import argparse
import json

import numpy as np

import ddd_jax
from ddd_jax.measure import node_acceptance as na
from ddd_jax.measure.prompts import load_questions

COSTS = {"target_ms": {1: 1.0, 64: 1.0}, "draft_ms": 0.0, "fixed_ms": 0.0}  # τ only: costs do not enter it


def levels(rec: dict) -> list:
    """P(some node at level d + 1 accepted | some node at level d accepted), d = 1 .. max_depth."""
    acc, depth = rec["accepted"], rec["depth"]
    hit = np.stack([acc[:, depth == d].any(1) for d in range(1, int(rec["max_depth"]) + 2)], 1)
    return [float(hit[:, d].sum() / max(hit[:, d - 1].sum(), 1)) for d in range(1, hit.shape[1])]


def head_ab(target, heads: dict, ids: list, max_new_tokens: int = 64) -> dict:
    out = {}
    for name, draft in heads.items():
        r = {}
        rec = na.pool_records(target, draft, ids, top_k=10, max_depth=11, max_new_tokens=max_new_tokens,
                              rows=16, progress=True)
        table = na.acceptance_table(rec)
        rp = na.Replay(rec, table, COSTS, (64,))
        r["eagle2_default_tau"] = rp.static(60, 5)["tau"]
        for x in (-0.3, -1.0):
            t = rp.threshold(60, (5, 7, 9), x, 11)
            r[f"ddd_paper_{x}_tau"] = t["tau"]
            hist = {int(k): v for k, v in t["depth_hist"].items()}
            r[f"ddd_paper_{x}_past5"] = sum(v for k, v in hist.items() if k > 5) / max(sum(hist.values()), 1)
        r["levels_k10"] = levels(rec)
        rec4 = na.pool_records(target, draft, ids, top_k=4, max_depth=2, max_new_tokens=max_new_tokens, rows=16)
        r["cpu_tree_tau"] = na.Replay(rec4, na.acceptance_table(rec4), COSTS, (64,)).static(7, 2)["tau"]
        r["cycles"] = int(rec["score"].shape[0])
        out[name] = r
        print(name, json.dumps(r), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("heads", nargs="+", help="head names or paths")
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    target = ddd_jax.load_target("smollm2-135m-instruct")
    heads = {h: ddd_jax.load_draft(h, target).astype("float16") for h in args.heads}
    ids = [target.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in load_questions(None)[:args.limit]]
    res = head_ab(target, heads, ids, args.max_new_tokens)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
