"""Teacher-forced accuracy of draft heads on the target's own greedy replies: how often the head's next token (its
top-1 / top-4) is the target's greedy token, given the target's true features -- the first draft step of every
speculative cycle. No timing, no tree: it separates a head's quality from the decoding settings.

    python experiments/teacher_forced.py [--tokens 64] [--holdout FILE.jsonl] [--cache DIR] HEAD [HEAD ...]

Two sets of replies, the first --tokens tokens of each: the target's greedy replies to the 80 MT-bench first turns
(chat template; evaluation only, never trained on) and the replies in --holdout (a `train-draft regenerate` file of
held-out ShareGPT first turns, e.g. runs/sd/holdout.jsonl; --holdout '' for none). The target's features are
computed once per set and cached in --cache. HEAD: a packaged head name or a head directory.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import ddd_jax as dj
from ddd_jax.bench.mtbench import load_questions

BUCKETS = (128, 256, 384, 512)


def replies(target, name: str, holdout: str | None, tokens: int) -> list:
    """Set `name`'s sequences [(ids, prompt_len)]: prompt + the first `tokens` reply tokens."""
    if name == "holdout":
        from train_draft.regen import load_records
        return [(r["ids"][:r["prompt_len"] + tokens], r["prompt_len"]) for r in load_records(holdout)]
    out = []
    for q in load_questions(None):
        p = target.encode_chat([{"role": "user", "content": q["turns"][0]}])
        r = dj.generate(target, None, p, max_new_tokens=tokens, method="vanilla")
        out.append((list(map(int, p)) + list(map(int, r.tokens)), len(p)))
    return out


def features(target, names: list, cache: Path, make) -> dict:
    """{set name: [(ids, features [T, D] float16, prompt_len)]}, from the cache or computed (`make(name)` gives the
    set's sequences) and cached."""
    from train_draft.extract import _write_npz_atomic, target_features
    out = {}
    for name in names:
        f = cache / f"{name}.npz"
        if not f.exists():
            rows = [(np.asarray(ids, np.int32), pl) for ids, pl in make(name)]
            cache.mkdir(parents=True, exist_ok=True)
            _write_npz_atomic(f, ids=np.array([ids for ids, _ in rows], dtype=object),
                              feats=np.array([target_features(target, ids, BUCKETS) for ids, _ in rows], dtype=object),
                              prompt_len=np.array([pl for _, pl in rows]))
        with np.load(f, allow_pickle=True) as z:
            out[name] = list(zip(z["ids"], z["feats"], z["prompt_len"]))
    return out


def accuracy(target, head, seqs, tokens: int) -> dict:
    """Top-1 / top-4 hits of `head` (`Draft.forward`, an EAGLE-1/2 head) against the target's greedy tokens, over
    the tokens it drafts from: its draft vocabulary (`d2t`) when it has one, as drafting does."""
    from train_draft.train import frozen_target_arrays
    _, lm_w = frozen_target_arrays(target)  # [D, V] float32
    allowed = None
    if "d2t" in head.params:
        allowed = jnp.zeros(target.config.vocab_size, bool).at[jnp.asarray(head.params["d2t"])].set(True)

    @jax.jit
    def judge(logits, f_tgt):  # [L, V], [L, D]
        want = jnp.argmax(f_tgt @ lm_w, -1)
        if allowed is not None:
            logits = jnp.where(allowed, logits, -jnp.inf)
        top4 = jax.lax.top_k(logits, 4)[1]
        return jnp.argmax(logits, -1) == want, jnp.any(top4 == want[:, None], -1)

    hit1, hit4, cnt = np.zeros(tokens), np.zeros(tokens), np.zeros(tokens)
    for ids, f, pl in seqs:
        n = len(ids) - 1  # input t: feature t and token t+1 -> token t+2 (the target's argmax at feature t+1)
        L = next(b for b in BUCKETS if n <= b)
        tok = np.zeros((1, L), np.int32)
        tok[0, :n] = ids[1:]
        fin = np.zeros((1, L, f.shape[1]), np.float32)
        fin[0, :n] = f[:-1]
        ftg = np.zeros_like(fin)
        ftg[0, :n] = f[1:]
        _, logits = head.forward(tok, fin)
        h1, h4 = (np.asarray(a) for a in judge(logits[0], ftg[0]))  # [L] each
        for t in range(n - 1):  # the last input has no target token
            j = t + 2 - pl  # reply position of the predicted token (0 = the first reply token, never drafted)
            if 1 <= j < tokens:
                hit1[j] += h1[t]
                hit4[j] += h4[t]
                cnt[j] += 1
    part = lambda a, lo, hi: float(a[lo:hi].sum() / max(cnt[lo:hi].sum(), 1))
    return {"top1": part(hit1, 0, tokens), "top4": part(hit4, 0, tokens), "tokens": int(cnt.sum()),
            "top1_by_position": {"1-8": part(hit1, 1, 9), "9-32": part(hit1, 9, 33), f"33-{tokens - 1}":
                                 part(hit1, 33, tokens)}}


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--holdout", default="runs/sd/holdout.jsonl")
    ap.add_argument("--cache", default="runs/teacher_forced")
    args = ap.parse_args(argv)
    target = dj.load_target("smollm2-135m-instruct")
    cache = Path(args.cache) / f"{target.name}-{args.tokens}-{Path(args.holdout).stem if args.holdout else 'none'}"
    names = ["mtbench"] + (["holdout"] if args.holdout else [])
    sets = features(target, names, cache, lambda name: replies(target, name, args.holdout, args.tokens))
    for h in args.heads:
        head = dj.load_draft(h, target, dtype=jnp.float32)
        for name, seqs in sets.items():
            r = accuracy(target, head, seqs, args.tokens)
            pos = "  ".join(f"{k} {v:.3f}" for k, v in r["top1_by_position"].items())
            print(f"{h:40s} {name:8s} top-1 {r['top1']:.3f}  top-4 {r['top4']:.3f}  (top-1 at reply positions {pos}; "
                  f"{r['tokens']} tokens)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
