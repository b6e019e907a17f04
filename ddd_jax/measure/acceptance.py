"""Acceptance-only measurement: τ and draft depth over many prompts, decoded in batches (no timing).

τ and the depth DDD reaches do not depend on wall time, so they can be measured with batched generation, which
uses the CPU far better than one prompt at a time. Every sequence's tree, DDD decisions and acceptance are its own
(buffers and decisions are per sequence), so the per-prompt figures equal single-prompt runs; outputs are checked
token for token against batched vanilla decoding.
"""
from __future__ import annotations

import time

import numpy as np
from tqdm import tqdm

from ddd_jax.config import DDDConfig, TreeConfig
from ddd_jax.decode import cache_capacity, generate, make_plan


def measure_acceptance(target, draft, prompt_ids: list, methods=("eagle2", "ddd"), *, tree: TreeConfig,
                       ddd: DDDConfig, max_new_tokens: int = 128, batch_size: int = 8, progress: bool = True) -> dict:
    """{method: {"tau", "mean_depth", "depth_hist", "mean_verified", "need_hist", ..., "identical", "per_prompt"}}
    (`measure_runs`)."""
    runs = {m: {"draft": draft, "method": m, "tree": tree, "ddd": ddd} for m in methods}
    return measure_runs(target, prompt_ids, runs, max_new_tokens=max_new_tokens, batch_size=batch_size,
                        progress=progress)


def measure_runs(target, prompt_ids: list, runs: dict, *, max_new_tokens: int = 128, batch_size: int = 8,
                 progress: bool = True, on_result=None, deadline: float | None = None) -> dict:
    """Acceptance of several (head, method, tree, DDD rule) runs over the same prompts, each checked against one
    batched vanilla decode. runs: {label: {"draft", "method", "tree", "ddd"}}, measured in their order, one label
    over all the prompts before the next (so a run cut short leaves whole results); `on_result(label, result)` is
    called as each finishes; runs that would start after `deadline` (a time.time() value) are left out. Returns
    {label: {"tau", "mean_depth", "depth_hist", "mean_verified", "mean_needed", "need_hist", "target_calls",
    "new_tokens", "identical", "prompts", "per_prompt"}} (`summarize_acceptance`)."""
    # one cache size for every batch and run: one compile per run
    longest = max(len(p) for p in prompt_ids)
    plans = [make_plan(target, None, method="vanilla", sync="device", tree=TreeConfig(), ddd=DDDConfig(),
                       temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens)]
    plans += [make_plan(target, r["draft"], method=r["method"], sync="device", tree=r["tree"], ddd=r["ddd"],
                        temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens) for r in runs.values()]
    capacity = max(cache_capacity(longest, p) for p in plans)
    batches = [prompt_ids[i:i + batch_size] for i in range(0, len(prompt_ids), batch_size)]
    pad = lambda b: b + [b[-1]] * (batch_size - len(b))  # noqa: E731  fixed batch shape: no recompiles
    bar = tqdm(total=len(batches) * (len(runs) + 1), desc="acceptance", disable=not progress)
    refs = []
    for batch in batches:
        refs.append(generate(target, None, pad(batch), max_new_tokens=max_new_tokens, capacity=capacity).tokens)
        bar.update()
    out = {}
    for label, r in runs.items():
        if deadline is not None and time.time() > deadline:
            break
        per = []
        for batch, ref in zip(batches, refs):
            g = generate(target, r["draft"], pad(batch), max_new_tokens=max_new_tokens, method=r["method"],
                         sync="device", tree=r["tree"], ddd=r["ddd"], capacity=capacity)
            for i in range(len(batch)):
                st = g.stats["per_sequence"][i]
                per.append({"accepted_per_call": st["accepted_per_call"], "depth_per_call": st["depth_per_call"],
                            "verified_per_call": st["verified_per_call"], "needed_per_call": st["needed_per_call"],
                            "identical": g.tokens[i] == ref[i]})
            bar.update()
        out[label] = summarize_acceptance(per)
        if on_result is not None:
            on_result(label, out[label])
    bar.close()
    return out


def histogram(values: list) -> dict:
    """{value: count}, ascending."""
    return {int(k): int(v) for k, v in zip(*np.unique(values, return_counts=True))} if len(values) else {}


def summarize_acceptance(per_prompt: list) -> dict:
    """τ (mean tokens a target call), draft depth, verified rows and identity over per-prompt records.

    mean_verified: the rows the target verified per call, as decoded (a batch verifies the width its widest tree
    needs); need_hist {rows: calls} and mean_needed: the rows each sequence's own tree needed (its root and valid
    nodes) -- what a cycle of that sequence alone verifies at the narrowest width that holds them, so the
    histogram is batch-1's whatever batch the prompts were decoded in (`calibration.predict` reads it)."""
    acc = [a for p in per_prompt for a in p["accepted_per_call"]]
    dep = [d for p in per_prompt for d in p["depth_per_call"]]
    rows = [r for p in per_prompt for r in p.get("verified_per_call", ())]
    need = [r for p in per_prompt for r in p.get("needed_per_call", ())]
    return {"tau": float(np.mean(acc)) if acc else 0.0, "mean_depth": float(np.mean(dep)) if dep else 0.0,
            "depth_hist": histogram(dep),
            "mean_verified": float(np.mean(rows)) if rows else None,
            "mean_needed": float(np.mean(need)) if need else None, "need_hist": histogram(need),
            "target_calls": len(acc), "new_tokens": int(sum(acc)),
            "identical": int(sum(p["identical"] for p in per_prompt)), "prompts": len(per_prompt),
            "per_prompt": per_prompt}
