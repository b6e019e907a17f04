"""Which text the EAGLE-3 fit should learn from, at equal loss tokens: ShareGPT's own assistant replies, the target's
regenerated replies, or half of each. One head per arm, then held-out top-1 per TTT step on the target's own replies
to held-out prompts.

    python experiments/data_mix.py --out /tmp/data_mix --loss-tokens 60000 \
        --regen-train /work/shared/gpu-runs/2026-11-27-h200/regen-train.jsonl.gz \
        --regen-holdout /work/shared/gpu-runs/2026-11-27-h200/regen-holdout.jsonl.gz

Arms (`--arms`, default all three):
  sharegpt  ShareGPT training-split conversations (`data.load_sharegpt(...).train`: held-out ids and MT-bench overlaps
            excluded), shuffled by the seed, chat-rendered, loss on the assistant tokens (`data.render_example`);
  regen     the regenerated training records, shuffled by the seed, loss on the reply (`regen.example_from_record`);
  mix       the first half of the sharegpt arm's loss tokens and the first half of the regen arm's.
Every arm holds exactly `--loss-tokens` loss-masked tokens (the last sequence taken is cut where the count is reached)
and is fitted for one epoch of its packed rows (batch 1, so every row once, none twice). The draft vocabulary is the
same for all arms: the `--draft-vocab-size` most frequent loss tokens of the sharegpt and regen arms together (EOS
always in). Same seed, learning rate, warmup fraction and float32 for every arm; the held-out batches are the same.

Resumable: the arms' data go to OUT/data.npz once; each arm's fit checkpoints under OUT/fit-<arm> and its result is
written atomically to OUT/results/<arm>.json when it ends; a rerun skips finished arms and resumes a cut-off fit.
OUT/results.md holds the table of the finished arms.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ARMS = ("sharegpt", "regen", "mix")
GPU_RUN = Path("/work/shared/gpu-runs/2026-11-27-h200")


def read_jsonl(path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def take_loss_tokens(examples, n: int) -> list[dict]:
    """Examples from the iterable, in order, until their loss tokens sum to exactly `n` (the last one cut)."""
    out, left = [], n
    for ex in examples:
        if left <= 0:
            break
        if ex is None:
            continue
        c = np.cumsum(ex["mask"])
        if c[-1] > left:  # cut just after the loss token that reaches the count
            end = int(np.searchsorted(c, left)) + 1
            ex = {**ex, "ids": ex["ids"][:end], "mask": ex["mask"][:end]}
        out.append(ex)
        left -= int(ex["mask"].sum())
    if left > 0:
        raise SystemExit(f"the source ran out: {n - left} of {n} loss tokens")
    return out


def token_set(examples: list[dict], source: str):
    """FeatureSet of ids + loss masks (no features: the EAGLE-3 fit computes them)."""
    from train_draft.extract import FeatureSet
    offs = np.concatenate([[0], np.cumsum([len(e["ids"]) for e in examples])]).astype(np.int64)
    return FeatureSet(np.concatenate([e["ids"] for e in examples]).astype(np.int32), None,
                      np.concatenate([e["mask"] for e in examples]).astype(np.uint8), offs,
                      [str(e["id"]) for e in examples], {"source": {"kind": source}})


def build_data(target, a) -> dict:
    """{arm: FeatureSet} and the shared vocabulary, made once and kept in OUT/data.npz."""
    from train_draft import data, regen
    from train_draft.vocab import frequent_tokens
    path = a.out / "data.npz"
    key = json.dumps({"loss_tokens": a.loss_tokens, "seed": a.seed, "max_len": a.max_len,
                      "regen_train": str(a.regen_train), "vocab_size": a.draft_vocab_size,
                      "holdout_percent": a.holdout_percent})
    if path.exists():
        with np.load(path) as z:
            if str(z["key"]) != key:
                raise SystemExit(f"{path} was made with other settings ({z['key']}); use another --out")
            sets = {arm: token_set([{"id": i, "ids": z[f"{arm}_ids"][s:e], "mask": z[f"{arm}_mask"][s:e]}
                                    for i, s, e in zip(z[f"{arm}_seq"], z[f"{arm}_off"][:-1], z[f"{arm}_off"][1:])],
                                   arm) for arm in ARMS}
            return {"sets": sets, "vocab": z["vocab"], "stats": json.loads(str(z["stats"]))}
    t0 = time.time()
    N = a.loss_tokens
    recs = read_jsonl(a.regen_train)
    order = np.random.default_rng([a.seed, 1]).permutation(len(recs))
    reg = take_loss_tokens((regen.example_from_record(recs[i], a.max_len) for i in order), N)
    print(f"regen: {len(reg)} replies of {len(recs)} records, {time.time() - t0:.0f} s", flush=True)
    split = data.load_sharegpt(holdout_percent=a.holdout_percent)
    convs = data.shuffled(split.train, a.seed)
    print(f"sharegpt: {len(split.train)} training conversations, {time.time() - t0:.0f} s", flush=True)
    from tqdm import tqdm
    bar = tqdm(total=N, unit="tok", unit_scale=True, desc="render sharegpt", mininterval=5.0)

    def rendered():
        for cid, msgs in convs:
            assert not data.is_holdout(cid, a.holdout_percent)
            ex = data.render_example(target, cid, msgs, a.max_len)
            if ex is not None:
                bar.update(min(int(ex["mask"].sum()), bar.total - bar.n))
            yield ex

    sg = take_loss_tokens(rendered(), N)
    bar.close()
    half = N // 2
    mix = take_loss_tokens(iter(sg), half) + take_loss_tokens(iter(reg), N - half)
    sets = {"sharegpt": token_set(sg, "sharegpt"), "regen": token_set(reg, "regen"), "mix": token_set(mix, "mix")}
    V = target.config.vocab_size
    counts = sum(np.bincount(fs.ids[fs.mask.astype(bool)], minlength=V)[:V] for fs in (sets["sharegpt"], sets["regen"]))
    vocab = frequent_tokens(counts, min(a.draft_vocab_size, V), always=target.eos_token_ids)
    stats = {arm: {"seqs": fs.n_seqs, "tokens": fs.n_tokens, "loss_tokens": int(fs.mask.sum())}
             for arm, fs in sets.items()}
    arrays = {"key": np.asarray(key), "vocab": vocab, "stats": np.asarray(json.dumps(stats))}
    for arm, fs in sets.items():
        arrays.update({f"{arm}_ids": fs.ids, f"{arm}_mask": fs.mask, f"{arm}_off": fs.offsets,
                       f"{arm}_seq": np.asarray(fs.seq_ids, dtype=str)})
    fd, tmp = tempfile.mkstemp(prefix=".data.", suffix=".npz", dir=a.out)
    with os.fdopen(fd, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)
    print(f"data: {json.dumps(stats)} ({time.time() - t0:.0f} s)", flush=True)
    return {"sets": sets, "vocab": vocab, "stats": stats}


def run_arm(target, arm: str, fs, vocab, held, a) -> dict:
    from ddd_jax import io as dio
    from train_draft import eagle3_fit
    from train_draft.eagle3_fit import Fit3Config, RowPlan
    base = Fit3Config(steps=1, batch_size=1, seq_len=a.max_len, ttt_steps=a.ttt_steps,
                      draft_vocab_size=a.draft_vocab_size, lr=a.lr, warmup=1, dtype="float32", seed=a.seed)
    steps = RowPlan(fs, base).steps_per_epoch  # batch 1: every packed row once
    if a.stop_after:
        steps = min(steps, a.stop_after)
    cfg = dataclasses.replace(base, steps=steps, warmup=max(1, round(a.warmup_frac * steps)))
    print(f"[{arm}] {fs.n_seqs} sequences, {fs.n_tokens} tokens, {int(fs.mask.sum())} loss tokens: {steps} steps "
          f"of 1 x {a.max_len}, warmup {cfg.warmup}", flush=True)
    t0 = time.time()
    r = eagle3_fit.fit_eagle3(target, fs, a.out / f"fit-{arm}", cfg, resume=True, ckpt_every=a.ckpt_every,
                              keep=1, log_every=a.log_every, progress=True, vocab=vocab)
    fit_s = time.time() - t0
    t1 = time.time()
    held_m = eagle3_fit.evaluate(target, r["params"], held, cfg, a.eval_batches)
    res = {"arm": arm, "seqs": fs.n_seqs, "tokens": fs.n_tokens, "loss_tokens": int(fs.mask.sum()),
           "steps": r["step"], "fit_config": cfg.to_dict(), "draft_vocab": len(vocab),
           "fit_s_this_run": round(fit_s, 1), "eval_s": round(time.time() - t1, 1),
           "train_last_metrics": r["last_metrics"],
           "heldout": {"tokens": held_m["tokens"], "batches": a.eval_batches,
                       "acc": [held_m[f"acc{k}"] for k in range(a.ttt_steps)],
                       "ploss": [held_m[f"ploss{k}"] for k in range(a.ttt_steps)]}}
    (a.out / "results").mkdir(exist_ok=True)
    dio.atomic_write_text(a.out / "results" / f"{arm}.json", json.dumps(res, indent=1))
    print(f"[{arm}] held-out top-1 per TTT step: {', '.join(f'{x:.3f}' for x in res['heldout']['acc'])} "
          f"(fit {fit_s:.0f} s, eval {res['eval_s']:.0f} s)", flush=True)
    return res


def table(results: list[dict]) -> str:
    K = max(len(r["heldout"]["acc"]) for r in results)
    head = f"| arm | loss tokens | tokens | steps | held-out top-1, TTT step 0 … {K - 1} | held-out soft CE, step 0 |"
    lines = [head,
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['arm']} | {r['loss_tokens']:,} | {r['tokens']:,} | {r['steps']} | "
                     + ", ".join(f"{x:.3f}" for x in r["heldout"]["acc"]) + f" | {r['heldout']['ploss'][0]:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--loss-tokens", type=int, default=60_000, help="loss-masked tokens of every arm")
    ap.add_argument("--regen-train", type=Path, default=GPU_RUN / "regen-train.jsonl.gz")
    ap.add_argument("--regen-holdout", type=Path, default=GPU_RUN / "regen-holdout.jsonl.gz")
    ap.add_argument("--holdout-percent", type=float, default=2.0)
    ap.add_argument("--max-len", type=int, default=1024, help="sequence truncation and packed row length")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup-frac", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-batches", type=int, default=8, help="held-out packed rows of max-len tokens")
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--stop-after", type=int, default=0, help="timing probe: at most this many steps an arm")
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    if not arms or set(arms) - set(ARMS):
        ap.error(f"--arms: choose from {', '.join(ARMS)}")
    a.out.mkdir(parents=True, exist_ok=True)

    import ddd_jax
    from ddd_jax import io as dio
    from train_draft import regen
    print(f"host: {_cpu_name()}, {os.cpu_count()} CPUs; argv: {' '.join(sys.argv[1:])}", flush=True)
    t0 = time.time()
    target = ddd_jax.load_target(a.target, dtype="float32")
    d = build_data(target, a)
    held_ex = [e for e in (regen.example_from_record(r, a.max_len) for r in read_jsonl(a.regen_holdout)) if e]
    held = token_set(held_ex, "regen-holdout")
    print(f"held-out: {held.n_seqs} replies, {held.n_tokens} tokens; draft vocabulary {len(d['vocab'])} "
          f"({time.time() - t0:.0f} s)", flush=True)
    results = []
    for arm in arms:
        path = a.out / "results" / f"{arm}.json"
        if path.exists():
            print(f"[{arm}] done before: {path}", flush=True)
            results.append(json.loads(path.read_text()))
            continue
        results.append(run_arm(target, arm, d["sets"][arm], d["vocab"], held, a))
        dio.atomic_write_text(a.out / "results.md", table(results))
    dio.atomic_write_text(a.out / "results.md", table(results))
    print(table(results), flush=True)
    print(f"total {time.time() - t0:.0f} s", flush=True)
    return 0


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
