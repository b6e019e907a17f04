"""A learned acceptance output against the calibration table, on held-out MT-bench pools (issue: a head that knows
when it will miss). Fits `measure.learned_acceptance` ("dist": the node's scalars; "hidden": plus the head's
feature at its parent) on pools drafted over held-out ShareGPT prompts, then on the first --limit MT-bench turns:
AUC / Brier / log loss of each node's P(accepted) against the table's, and the replay at this host's calibrated
costs (best static tree, table gain rule, learned gain rule, SpecDec++'s stop rule, p-oracle, oracle).

    python experiments/learned_acceptance.py [--train 48] [--train-source sharegpt|mtbench] [--limit 16]
        [--l2 1e-4] [--hidden 32] [--out DIR]

--train-source mtbench fits on MT-bench's other first turns (from --limit on): in-domain, to ask whether the
hidden state carries a signal at all (a head shipped that way would have seen the benchmark's prompts).
Pools are kept in DIR (train-SOURCE.npz, mtbench.npz) and reused by a rerun.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from ddd_jax.config import verify_widths
from ddd_jax.measure import learned_acceptance as la
from ddd_jax.measure import node_acceptance as na
from ddd_jax.measure.prompts import load_questions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rule_ceiling import calibrated_pair, p_oracle  # noqa: E402


def sharegpt_prompts(target, n: int, max_tokens: int = 200) -> list:
    """First user turns of ShareGPT's held-out conversations (the head's training split never holds them), whose
    text no training conversation's first turn repeats, deduplicated, at most max_tokens once chat-rendered."""
    from train_draft.data import load_sharegpt
    split = load_sharegpt()
    norm = lambda t: " ".join(t.split()).lower()  # noqa: E731
    first = lambda msgs: next((m["content"] for m in msgs if m["role"] == "user"), None)  # noqa: E731
    seen = {norm(t) for _, msgs in split.train if (t := first(msgs))}
    out = []
    for _, msgs in split.holdout:
        t = first(msgs)
        if not t or norm(t) in seen or len(t) < 20:
            continue
        seen.add(norm(t))
        ids = target.encode_chat([{"role": "user", "content": t}])
        if len(ids) <= max_tokens:
            out.append(ids)
        if len(out) == n:
            break
    return out


def records(path: Path, make) -> dict:
    if path.is_file():
        with np.load(path) as z:
            return {k: (z[k].item() if z[k].ndim == 0 else z[k]) for k in z.files}
    rec = make()
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **rec)
    os.replace(tmp, path)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", type=int, default=48, help="held-out ShareGPT prompts to fit on")
    ap.add_argument("--limit", type=int, default=16, help="MT-bench first turns to judge on")
    ap.add_argument("--train-source", choices=("sharegpt", "mtbench"), default="sharegpt")
    ap.add_argument("--l2", type=float, default=1e-4)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="runs/learned_acceptance")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    target, draft, costs, own = calibrated_pair()
    k, R = int(own["top_k"]), int(own["max_depth"])
    kw = dict(top_k=k, max_depth=R, max_new_tokens=args.max_new_tokens, progress=True, hidden=True)
    firsts = [target.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in load_questions(None)]
    ids = firsts[:args.limit]
    source = {"sharegpt": lambda: sharegpt_prompts(target, args.train),
              "mtbench": lambda: firsts[args.limit:args.limit + args.train]}[args.train_source]
    name = "train.npz" if args.train_source == "sharegpt" else f"train-{args.train_source}.npz"
    train = records(out_dir / name, lambda: na.pool_records(target, draft, source(), **kw))
    test = records(out_dir / "mtbench.npz", lambda: na.pool_records(target, draft, ids, **kw))
    print(f"cycles: train {len(train['score'])}, MT-bench {len(test['score'])}", flush=True)

    tables = {"table (head's pools)": na.acceptance_table(own), "table (train pools)": na.acceptance_table(train)}
    probs, res = {}, {"judge": {}, "fit": {}, "trees": {}}
    for name, tab in tables.items():
        probs[name] = na.lookup_accept(tab, np.broadcast_to(test["depth"], test["score"].shape), test["score"])
        res["judge"][name] = la.judge(probs[name], test)
    for kind in la.KINDS:
        model, info = la.fit(train, kind, l2=args.l2, hidden=args.hidden, progress=True)
        q = la.conditional_probs(model, test)
        probs[f"learned ({kind})"] = la.path_probs(q, test["parent"])
        res["fit"][kind] = info
        res["judge"][f"learned ({kind})"] = la.judge(probs[f"learned ({kind})"], test, q)
        np.savez(out_dir / f"model_{kind}-{args.train_source}.npz", mean=model.mean, std=model.std, **model.params)
    print(json.dumps(res["judge"], indent=1), flush=True)

    table = tables["table (head's pools)"]
    d_ms = sorted((int(a), float(b)) for a, b in costs["draft_ms"].items())
    cost = {**costs, "draft_ms": float(np.interp(k, [a for a, _ in d_ms], [b for _, b in d_ms]))}
    for n in (5, 8, 16):
        base = na.Replay(test, table, cost, verify_widths(n))
        static = max((base.static(n, d) for d in range(R + 1)), key=lambda r: r["speedup"])
        row = {"best static": static["speedup"]}

        def gain_of(rp):
            rate, g = 0.0, None
            for _ in range(4):
                g = rp.gain(n, R, 0.0, rate or None)
                rate = g["speedup"] / rp.t1
            return g, rate

        g, rate = gain_of(base)
        row["table gain"] = g["speedup"]
        row["p-oracle"] = p_oracle(base, n, rate)["speedup"]
        for kind in la.KINDS:
            rp = na.Replay(test, table, cost, verify_widths(n), probs=probs[f"learned ({kind})"])
            row[f"learned gain ({kind})"] = gain_of(rp)[0]["speedup"]
            row[f"learned static ({kind})"] = max((rp.static(n, d) for d in range(R + 1)),
                                                  key=lambda r: r["speedup"])["speedup"]
            row[f"specdec ({kind})"] = max((rp.specdec(n, R, h) for h in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)),
                                           key=lambda r: r["speedup"])["speedup"]
        row["oracle"] = base.oracle()["speedup"]
        res["trees"][f"k{k}-n{n}"] = row
        print(f"k{k}-n{n}", json.dumps(row), flush=True)
    text = json.dumps(res, indent=1)
    (out_dir / f"result-{args.train_source}.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
