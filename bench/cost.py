"""Cost curve: target forward time vs number of tokens verified at once (KV cache at a realistic length).

This is what decides tree sizes: a tree of N tokens pays t(N) per target call and wins only if
tau(N) * t(1) > t(N) + draft time. On accelerators t(N) is flat up to a large N; on CPU it grows quickly.
The draft-step curve (one head forward + projection onto the head's draft vocabulary for a beam of k tokens,
as `drafting.draft_step` runs it) prices each draft step.
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
from ddd_jax.eagle import draft_logits, head_forward, new_cache as new_draft_cache
from ddd_jax.layers import causal_mask, tree_kv_mask

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


# The cache is donated and handed back with its length reset, as in generate's loops (where K/V writes are
# in place): without donation every call would also pay a copy of the whole cache.
@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _target_step(params, cfg, cache, tokens, positions, mask):
    out = llama.forward(params, cfg, tokens, positions, cache, attn_mask=mask)
    return out.logits, with_length(out.cache, cache.length)


@partial(jax.jit, static_argnames=("dcfg", "tcfg"), donate_argnames=("cache",))
def _draft_step(dparams, dcfg, tparams, tcfg, cache, tokens, feats, positions, mask):
    h, new = head_forward(dparams, dcfg, tparams["embed"], tokens, feats, positions, cache,
                          tree_kv_mask(cache.length, cache.capacity, mask))
    return draft_logits(dparams, tparams, tcfg, h, dcfg), with_length(new, cache.length)


class _Looper:
    """Calls step(cache) -> (out, cache) repeatedly, threading the donated cache through."""

    def __init__(self, step, cache):
        self.step, self.cache = step, cache

    def __call__(self):
        out, self.cache = self.step(self.cache)
        return out


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
    length = lambda: jnp.full((1,), context, jnp.int32)  # noqa: E731  (a fresh buffer each: caches are donated)
    cache = with_length(llama.new_cache(cfg, 1, capacity, dtype), length())
    dcache = with_length(new_draft_cache(draft.config, 1, capacity, dtype), length()) if draft is not None else None
    rows = []
    it = sizes
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(sizes, desc="cost curve", unit="size")
    for n in it:
        toks = jnp.asarray(np.arange(n, dtype=np.int32)[None] % cfg.vocab_size)
        pos = context + jnp.arange(n, dtype=jnp.int32)[None]
        mask = causal_mask(1, n)
        run = _Looper(lambda c: _target_step(target.params, cfg, c, toks, pos, mask), cache)
        first, times = _time(run, repeat)
        cache = run.cache
        row = {"tokens": n, "target_ms": 1e3 * statistics.median(times), "target_ms_min": 1e3 * min(times),
               "target_ms_all": [1e3 * t for t in times], "target_compile_s": first}
        if draft is not None:
            feats = jnp.zeros((1, n, draft.config.hidden_size), dtype)  # beam features: the head's own width
            dparams = draft.decode_params()
            run = _Looper(lambda c: _draft_step(dparams, draft.config, target.params, cfg, c, toks, feats, pos,
                                                mask), dcache)
            first, times = _time(run, repeat)
            dcache = run.cache
            row.update(draft_ms=1e3 * statistics.median(times), draft_ms_min=1e3 * min(times),
                       draft_ms_all=[1e3 * t for t in times], draft_compile_s=first)
        rows.append(row)
    base = rows[0]["target_ms"] if rows and rows[0]["tokens"] == 1 else None
    for r in rows:
        r["target_rel_1"] = r["target_ms"] / base if base else None
        # tokens a tree of this size must yield per call just to break even with vanilla (ignoring drafting)
        r["break_even_tau"] = r["target_rel_1"]
    from ddd_jax.quant import describe
    return {"format": "ddd-jax-cost-curve", "target": target.name, "context": context, "capacity": capacity,
            "repeat": repeat, "dtype": str(dtype), "weights": describe(target.params), "rows": rows}
