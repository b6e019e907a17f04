"""Acceptance-only measurement: τ and draft depth over many prompts, decoded in batches (no timing).

τ and the depth DDD reaches do not depend on wall time, so they can be measured with batched generation, which
uses the CPU far better than one prompt at a time. Every sequence's tree, DDD decisions and acceptance are its own
(buffers and decisions are per sequence), so the per-prompt figures equal single-prompt runs; outputs are checked
token for token against batched vanilla decoding.
"""
from __future__ import annotations

import numpy as np
from tqdm import tqdm

from ddd_jax import DDDConfig, TreeConfig, generate
from ddd_jax.generate import cache_capacity, make_plan


def measure_acceptance(target, draft, prompt_ids: list, methods=("eagle2", "ddd"), *, tree: TreeConfig,
                       ddd: DDDConfig, max_new_tokens: int = 128, batch_size: int = 8, progress: bool = True) -> dict:
    """{method: {"tau", "mean_depth", "depth_hist", "target_calls", "new_tokens", "identical", "per_prompt"}}."""
    # one cache size for every batch: one compile per method
    longest = max(len(p) for p in prompt_ids)
    capacity = max(cache_capacity(longest, make_plan(target, draft if m != "vanilla" else None, method=m,
                                                     sync="device", tree=tree, ddd=ddd, temperature=0.0, top_p=1.0,
                                                     max_new_tokens=max_new_tokens))
                   for m in ("vanilla", *methods))
    batches = [prompt_ids[i:i + batch_size] for i in range(0, len(prompt_ids), batch_size)]
    out = {m: {"per_prompt": []} for m in methods}
    bar = tqdm(total=len(batches) * (len(methods) + 1), desc="acceptance", disable=not progress)
    for batch in batches:
        pad = batch + [batch[-1]] * (batch_size - len(batch))  # fixed batch shape: no recompiles
        ref = generate(target, None, pad, max_new_tokens=max_new_tokens, capacity=capacity)
        bar.update()
        for m in methods:
            r = generate(target, draft, pad, max_new_tokens=max_new_tokens, method=m, sync="device", tree=tree,
                         ddd=ddd, capacity=capacity)
            for i in range(len(batch)):
                st = r.stats["per_sequence"][i]
                out[m]["per_prompt"].append({"accepted_per_call": st["accepted_per_call"],
                                             "depth_per_call": st["depth_per_call"],
                                             "identical": r.tokens[i] == ref.tokens[i]})
            bar.update()
    bar.close()
    for m, res in out.items():
        acc = [a for p in res["per_prompt"] for a in p["accepted_per_call"]]
        dep = [d for p in res["per_prompt"] for d in p["depth_per_call"]]
        res.update(tau=float(np.mean(acc)) if acc else 0.0, mean_depth=float(np.mean(dep)) if dep else 0.0,
                   depth_hist={int(k): int(v) for k, v in zip(*np.unique(dep, return_counts=True))} if dep else {},
                   target_calls=len(acc), new_tokens=int(sum(acc)),
                   identical=int(sum(p["identical"] for p in res["per_prompt"])), prompts=len(res["per_prompt"]))
    return out
