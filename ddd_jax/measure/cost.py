"""Cost curve: target forward time vs number of tokens verified at once (KV cache at a realistic length).

This is what decides tree sizes: a tree of N tokens pays t(N) per target call and wins only if
tau(N) * t(1) > t(N) + draft time. On accelerators t(N) is flat up to a large N; on CPU it grows quickly.
The draft-step curve (one head forward + projection onto the head's draft vocabulary for a beam of k tokens,
as `drafting.draft_step` runs it) prices each draft step.

What is verified is, by default, what decoding verifies: the cache holds `context` tokens the target itself decoded
greedily after a chat prompt, and the n tokens are the next ones it decodes (`inputs="decoded"`). The forward's cost
depends on its inputs where the greedy lm_head is screened (`kernels.greedy_screened` recomputes the columns its
int8 copy cannot rule out): over a zero cache and the token ids 0..n-1 (`inputs="synthetic"`, what this curve timed
until 2026-11-26) SmolLM2's rows had 6-240 such columns; over decoded text 7 on average (median 4).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ddd_jax import llama, ops
from ddd_jax.cache import with_length
from ddd_jax.eagle import draft_logits, head_forward, new_cache as new_draft_cache
from ddd_jax.layers import causal_mask

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _seconds(fn) -> float:
    """Wall seconds of one call of fn, its result ready."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


# The cache is donated and handed back with its length reset, as in generate's loops (where K/V writes are
# in place): without donation every call would also pay a copy of the whole cache.
# A greedy step returns the tokens only (`forward(..., return_logits=False, greedy=True)`), as greedy decoding's
# verification does (and so runs the screened lm_head where the output projection has a screen); logits=True times
# the forward with full logits, as sampling's verification runs it.
@partial(jax.jit, static_argnames=("cfg", "logits"), donate_argnames=("cache",))
def _target_step(params, cfg, cache, tokens, positions, mask, logits: bool = False):
    out = llama.forward(params, cfg, tokens, positions, cache, attn_mask=mask, return_logits=logits,
                        greedy=not logits)
    return (out.logits if logits else out.greedy), with_length(out.cache, cache.length)


@partial(jax.jit, static_argnames=("dcfg", "tcfg"), donate_argnames=("cache",))
def _draft_step(dparams, dcfg, tparams, tcfg, cache, tokens, feats, positions, mask):
    h, new = head_forward(dparams, dcfg, tparams["embed"], tokens, feats, positions, cache, mask)
    return draft_logits(dparams, tparams, tcfg, h, dcfg), with_length(new, cache.length)


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _greedy_step(params, cfg, cache, tokens, positions):
    out = llama.forward(params, cfg, tokens, positions, cache, return_logits=False, greedy=True)
    return out.greedy[:, -1], out.cache


COST_PROMPT = "Write a detailed essay on the history of the printing press and how it changed Europe."


def cost_prompt_ids(target) -> list[int]:
    """`COST_PROMPT` as the target's chat renders it; the token ids 1..8 for a target without a chat template."""
    if getattr(target, "chat_template", None):
        return target.encode_chat([{"role": "user", "content": COST_PROMPT}])
    return [1 + i % (target.config.vocab_size - 1) for i in range(8)]


def decoded_inputs(target, n: int, capacity: int, dtype):
    """(ids [n], cache): the first n tokens of a greedy decode by the target itself -- a chat prompt (`COST_PROMPT`;
    the token ids 1..8 for a target without a tokenizer) and its continuation, end-of-turn tokens included -- and
    a cache of `capacity` slots holding all of them."""
    if n > capacity:
        raise ValueError(f"{n} decoded tokens exceed capacity={capacity}")
    cfg = target.config
    prompt = cost_prompt_ids(target)
    prompt = prompt[:n]
    cache = llama.new_cache(cfg, 1, capacity, dtype)
    ids = list(prompt)
    nxt, cache = _greedy_step(target.params, cfg, cache, jnp.asarray([prompt], jnp.int32),
                              jnp.arange(len(prompt), dtype=jnp.int32)[None])
    while len(ids) < n:
        ids.append(int(nxt[0]))
        p = jnp.full((1, 1), len(ids) - 1, jnp.int32)
        nxt, cache = _greedy_step(target.params, cfg, cache, jnp.asarray([[ids[-1]]], jnp.int32), p)
    return np.asarray(ids, np.int32), cache


def _rows(cache, batch: int):
    """A one-row cache repeated into `batch` identical rows."""
    if batch == 1:
        return cache
    return dataclasses.replace(cache, k=jnp.repeat(cache.k, batch, axis=1), v=jnp.repeat(cache.v, batch, axis=1),
                               length=jnp.repeat(cache.length, batch, axis=0))


def cost_curve(target, draft=None, sizes=DEFAULT_SIZES, context: int = 256, capacity: int | None = None,
               repeat: int = 5, progress: bool = False, logits: bool = False, inputs: str = "decoded",
               batch: int = 1) -> dict:
    """Median wall time of one target forward over n new tokens (tree-masked like verification) for n in
    `sizes`, with `context` tokens already in a cache of `capacity` slots (default: context + 256, rounded
    up to 256 like the benchmark's shared capacity). With a draft, also one draft step over a beam of n tokens.
    The forward returns each token's greedy token, as greedy verification runs it; logits=True: the full logits
    (sampling's verification).

    Every size is compiled and run once first; then `repeat` rounds each time every size once, in order, so all
    sizes see the same stretch of the machine (a CPU VM's memory speed drifts over tens of seconds: timing the
    sizes one after another put t(1) and t(16) in different phases and moved their ratio by ~10%). Each row
    also gets `target_rel_1_rounds`: t(n) / t(1) within each round.

    inputs: "decoded" (default) -- the cache holds `context` tokens the target decoded greedily and the n tokens
    are the next ones it decodes (`decoded_inputs`), as in decoding; "synthetic" -- a zero cache and the token ids
    0..n-1 (the screened lm_head then recomputes many more columns: see the module docstring).
    batch: sequences verified (and drafted) together, each the same n tokens over the same cache: t(n) of a batch
    forward of batch x n rows."""
    cfg = target.config
    capacity = capacity or -(-(context + 256) // 256) * 256
    if context + max(sizes) > capacity:
        raise ValueError(f"context={context} + {max(sizes)} tokens exceed capacity={capacity}")
    if repeat < 1:
        raise ValueError(f"repeat={repeat}: need at least one timed round")
    if inputs not in ("decoded", "synthetic"):
        raise ValueError(f"inputs must be 'decoded' or 'synthetic', got {inputs!r}")
    if batch < 1:
        raise ValueError(f"batch={batch}: need at least one sequence")
    dtype = target.params["embed"].dtype
    length = lambda: jnp.full((batch,), context, jnp.int32)  # noqa: E731  (a fresh buffer each: caches are donated)
    # one target cache and one draft cache, threaded through every call (donated, handed back at `context`)
    if inputs == "decoded":
        ids, cache = decoded_inputs(target, context + max(sizes), capacity, dtype)
        verified = ids[context:]
    else:
        cache, verified = llama.new_cache(cfg, 1, capacity, dtype), np.arange(max(sizes), dtype=np.int32)
    caches = {"target": with_length(_rows(cache, batch), length())}
    if draft is not None:
        caches["draft"] = with_length(new_draft_cache(draft.config, batch, capacity, dtype), length())
        dparams = draft.decode_params()

    def calls(n):
        toks = jnp.asarray(np.repeat(verified[None, :n] % cfg.vocab_size, batch, axis=0))
        pos = jnp.broadcast_to(context + jnp.arange(n, dtype=jnp.int32)[None], (batch, n))
        mask = causal_mask(batch, n)

        def target_call():
            out, caches["target"] = _target_step(target.params, cfg, caches["target"], toks, pos, mask, logits)
            return out

        out = {"target": target_call}
        if draft is not None:
            feats = jnp.zeros((batch, n, draft.config.hidden_size), dtype)  # beam features: the head's own width

            def draft_call():
                out, caches["draft"] = _draft_step(dparams, draft.config, target.params, cfg, caches["draft"], toks,
                                                   feats, pos, mask)
                return out

            out["draft"] = draft_call
        return out

    fns = {n: calls(n) for n in sizes}
    first = {n: {k: _seconds(f) for k, f in fns[n].items()} for n in sizes}  # compile + one run each
    times = {n: {k: [] for k in fns[n]} for n in sizes}
    rounds = range(repeat)
    if progress:
        from tqdm.auto import tqdm
        rounds = tqdm(rounds, desc="cost curve", unit="round")
    for _ in rounds:
        for n in sizes:
            for k, f in fns[n].items():
                times[n][k].append(_seconds(f))
    rows = []
    for n in sizes:
        t = times[n]["target"]
        row = {"tokens": n, "target_ms": 1e3 * statistics.median(t), "target_ms_min": 1e3 * min(t),
               "target_ms_all": [1e3 * x for x in t], "target_compile_s": first[n]["target"]}
        if draft is not None:
            d = times[n]["draft"]
            row.update(draft_ms=1e3 * statistics.median(d), draft_ms_min=1e3 * min(d),
                       draft_ms_all=[1e3 * x for x in d], draft_compile_s=first[n]["draft"])
        rows.append(row)
    one = rows[0] if rows and rows[0]["tokens"] == 1 else None
    for r in rows:
        r["target_rel_1"] = r["target_ms"] / one["target_ms"] if one else None
        r["target_rel_1_rounds"] = ([a / b for a, b in zip(r["target_ms_all"], one["target_ms_all"])]
                                    if one else None)
        # tokens a tree of this size must yield per call just to break even with vanilla (ignoring drafting)
        r["break_even_tau"] = r["target_rel_1"]
    return {"format": "ddd-jax-cost-curve", "target": target.name, "context": context, "capacity": capacity,
            "batch": batch,
            "repeat": repeat, "interleaved": True, "dtype": str(dtype), "weights": ops.describe_weights(target.params),
            "forward": "logits" if logits else "greedy tokens", "inputs": inputs,
            "rows": rows}
