"""Cost curve: target forward time vs number of tokens verified at once (KV cache at a realistic length).

This is what decides tree sizes: a tree of N tokens pays t(N) per target call and wins only if
tau(N) * t(1) > t(N) + draft time. On accelerators t(N) is flat up to a large N; on CPU it grows quickly.
The draft-step curve (one head forward + vocab projection for a beam of k tokens) prices each draft step.
"""
from __future__ import annotations

import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ddd_jax import llama
from ddd_jax.cache import with_length
from ddd_jax.eagle import head_forward, new_cache as new_draft_cache

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _time(fn, repeat: int) -> tuple[float, list]:
    """(compile+first-run seconds, [seconds of each timed run])."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return first, times


@partial(jax.jit, static_argnames=("cfg",))
def _target_step(params, cfg, cache, tokens, positions, mask):
    return llama.forward(params, cfg, tokens, positions, cache, attn_mask=mask)


@partial(jax.jit, static_argnames=("dcfg", "tcfg"))
def _draft_step(dparams, dcfg, tparams, tcfg, cache, tokens, feats, positions, mask):
    h, cache = head_forward(dparams, dcfg, tparams["embed"], tokens, feats, positions, cache,
                            llama.tree_kv_mask(cache.length, cache.capacity, mask))
    return jax.nn.log_softmax(llama.lm_head(tparams, tcfg, h), axis=-1), cache


def cost_curve(target, draft=None, sizes=DEFAULT_SIZES, context: int = 256, capacity: int | None = None,
               repeat: int = 5, progress: bool = False) -> dict:
    """Median wall time of one target forward over n new tokens (tree-masked like verification) for n in
    `sizes`, with `context` tokens already in a cache of `capacity` slots (default: context + 256, rounded
    up to 256 like the benchmark's shared capacity). With a draft, also one draft step over a beam of n tokens."""
    cfg = target.config
    capacity = capacity or -(-(context + 256) // 256) * 256
    if context + max(sizes) > capacity:
        raise ValueError(f"context={context} + {max(sizes)} tokens exceed capacity={capacity}")
    dtype = target.params["embed"].dtype
    cache = with_length(llama.new_cache(cfg, 1, capacity, dtype), jnp.full((1,), context, jnp.int32))
    rows = []
    it = sizes
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(sizes, desc="cost curve", unit="size")
    for n in it:
        toks = jnp.asarray(np.arange(n, dtype=np.int32)[None] % cfg.vocab_size)
        pos = context + jnp.arange(n, dtype=jnp.int32)[None]
        mask = llama.causal_mask(1, n)
        first, times = _time(lambda: _target_step(target.params, cfg, cache, toks, pos, mask), repeat)
        row = {"tokens": n, "target_ms": 1e3 * statistics.median(times), "target_ms_min": 1e3 * min(times),
               "target_ms_all": [1e3 * t for t in times], "target_compile_s": first}
        if draft is not None:
            dcache = with_length(new_draft_cache(draft.config, 1, capacity, dtype), jnp.full((1,), context, jnp.int32))
            feats = jnp.zeros((1, n, cfg.hidden_size), dtype)
            first, times = _time(lambda: _draft_step(draft.params, draft.config, target.params, cfg, dcache, toks,
                                                     feats, pos, mask), repeat)
            row.update(draft_ms=1e3 * statistics.median(times), draft_ms_min=1e3 * min(times),
                       draft_ms_all=[1e3 * t for t in times], draft_compile_s=first)
        rows.append(row)
    base = rows[0]["target_ms"] if rows and rows[0]["tokens"] == 1 else None
    for r in rows:
        r["target_rel_1"] = r["target_ms"] / base if base else None
        # tokens a tree of this size must yield per call just to break even with vanilla (ignoring drafting)
        r["break_even_tau"] = r["target_rel_1"]
    return {"format": "ddd-jax-cost-curve", "target": target.name, "context": context, "capacity": capacity,
            "repeat": repeat, "dtype": str(dtype), "rows": rows}
