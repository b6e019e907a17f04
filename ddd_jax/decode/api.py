"""The public decode API: `generate` (one call, a GenerateResult) and `stream` (an iterator over new tokens)."""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from .. import settings, sharding
from ..config import DDDConfig, TreeConfig
from . import cycle as C
from . import drivers
from .drafting import SyncCounter
from .state import GenerateResult, Plan, bucket_length, cache_capacity, cache_slack, make_plan, vanilla_plan


def _batched(prompt_ids) -> bool:
    """A batch of prompts (a list of token-id lists), not one prompt."""
    return len(prompt_ids) > 0 and isinstance(prompt_ids[0], (list, tuple, np.ndarray))


def _prepare_prompts(target, prompt_ids, plan: Plan, capacity: int | None, prompt_len: int | None = None):
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty")
    batched = _batched(prompt_ids)
    prompts = [list(map(int, p)) for p in (prompt_ids if batched else [prompt_ids])]
    V = target.config.vocab_size
    for p in prompts:
        if not p:
            raise ValueError("a prompt is empty")
        bad = [t for t in p if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {V})")
    P = max(len(p) for p in prompts)
    if prompt_len is not None and prompt_len < P:
        raise ValueError(f"prompt_len={prompt_len} is shorter than the longest prompt ({P} tokens)")
    T = bucket_length(P) if prompt_len is None else int(prompt_len)
    need = max(T, P + plan.max_new_tokens + cache_slack(plan))
    if capacity is None:
        capacity = cache_capacity(P, plan)
    elif need > capacity:
        raise ValueError(f"prompt of {P} tokens + max_new_tokens={plan.max_new_tokens} (+{cache_slack(plan)} slots "
                         f"of tree scratch) needs a cache of {need} slots, but capacity={capacity}")
    if P + plan.max_new_tokens > target.config.max_position_embeddings:
        raise ValueError(f"prompt of {P} tokens + max_new_tokens={plan.max_new_tokens} exceeds the model's "
                         f"max_position_embeddings={target.config.max_position_embeddings}")
    toks = np.zeros((len(prompts), T), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    plen = np.array([len(p) for p in prompts], np.int32)
    return batched, jnp.asarray(toks), jnp.asarray(plen), capacity


def generate(target, draft, prompt_ids, max_new_tokens: int = 128, method: str = "vanilla", sync: str = "device",
             tree: TreeConfig | None = None, ddd: DDDConfig | None = None, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, loop: str | None = None, profile: bool = False,
             policy=None, capacity: int | None = None, stream=None, prompt_len: int | None = None) -> GenerateResult:
    """Generate new tokens for `prompt_ids` (list[int], or a list of lists for a batch).

    method: "vanilla" (baseline), "eagle2" (fixed-depth EAGLE-2 tree), "ddd" (Dynamic Depth Decoding).
    tree / ddd: None = this device's calibration for this target and head (`ddd_jax.calibrate`, per batch size),
    else this backend's tuned settings for them when `ddd-jax tune` saved some, else the paper's defaults
    (`ddd_jax.settings.resolve`); stats["settings"] says which were used and why, and the head's weight dtype (a
    float16 head -- `draft.astype(jnp.float16)` -- drafts at half the bytes on CPU). Where those settings say that
    no speculative setting beats vanilla at this batch size (`settings.vanilla_fallback`), a call with no tree, ddd
    or policy decodes as vanilla does: stats["settings"]["decoded_as"] is "vanilla" and ["why"] says why, while
    stats["method"] stays the method asked for. Explicit tree / ddd / policy always decode speculatively.
    sync (ddd only): "host" | "callback" | "device" (see `ddd_jax.decode.drafting`). loop: "device" (one jitted
    loop over the whole generation) or "host" (Python loop over cycles/tokens); default "device" except for
    sync="host", profile=True or stream. policy: host function for sync="host" or "callback"
    ((step, confidence, active, threshold) -> keep-drafting mask; default: DDD's threshold rule). It is part of
    the static plan, so each distinct policy compiles once. stream: callable(new_token_ids) invoked after each
    cycle (forces loop="host"; `stream()` is the same as an iterator). capacity: the KV cache's slots (default
    `cache_capacity` of the longest prompt). prompt_len: the prefill's padded prompt length (>= the longest prompt;
    default `bucket_length` of it). Calls with the same batch size, prompt_len and capacity run the same programs
    whatever their prompts (what `train_draft.regen` does to compile once per stage); the tokens do not depend on
    either.
    """
    run = _decode(target, draft, prompt_ids, max_new_tokens, method, sync, tree, ddd, temperature, top_p, seed,
                  loop, profile, policy, capacity, streaming=stream is not None, prompt_len=prompt_len)
    while True:
        try:
            new = next(run)
        except StopIteration as done:
            return done.value
        stream(new)


def stream(target, draft, prompt_ids, max_new_tokens: int = 128, method: str = "vanilla", sync: str = "device",
           tree: TreeConfig | None = None, ddd: DDDConfig | None = None, temperature: float = 0.0,
           top_p: float = 1.0, seed: int = 0, policy=None, capacity: int | None = None):
    """The new tokens of one prompt as they are decided, one list per cycle (a Python loop over jitted cycles):
    `for chunk in stream(target, draft, ids, method="ddd"): ...`. The arguments are `generate`'s; the tokens are
    exactly `generate`'s. The GenerateResult is the iterator's return value (`StopIteration.value`)."""
    if _batched(prompt_ids):
        raise ValueError("stream() decodes one prompt (a list of token ids); use generate() for a batch")
    run = _decode(target, draft, prompt_ids, max_new_tokens, method, sync, tree, ddd, temperature, top_p, seed, "host",
                  False, policy, capacity, streaming=True)
    while True:
        try:
            new = next(run)
        except StopIteration as done:
            return done.value
        if new:
            yield new


def compile_vanilla(target, n_rows: int, prompt_len: int, capacity: int, max_new_tokens: int = 128,
                    parts=("prefill", "loop")) -> None:
    """Compile, without running anything, the programs `generate(target, None, prompts, max_new_tokens,
    capacity=capacity, prompt_len=prompt_len)` runs for `n_rows` prompts (greedy vanilla, the device loop): its
    prefill and its decoding loop (`parts`). jax keeps them, so a later such call in this process -- on any thread
    -- compiles nothing; several threads can build different ones at once (`train_draft.regen`: one per prompt
    bucket). A target on a mesh is not supported."""
    if getattr(target, "mesh", None) is not None:
        raise ValueError("compile_vanilla: a target on a mesh is not supported")
    unknown = set(parts) - {"prefill", "loop"}
    if unknown:
        raise ValueError(f"compile_vanilla: parts must be 'prefill' and/or 'loop', got {sorted(unknown)}")
    plan = vanilla_plan(target, max_new_tokens)  # the plan `_decode` makes for such a call
    sds = jax.ShapeDtypeStruct
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    prefill = C.prefill_state.lower(target.params, None, plan, sds((n_rows, prompt_len), jnp.int32),
                               sds((n_rows,), jnp.int32), key, capacity=capacity, mesh=None)
    if "prefill" in parts:
        prefill.compile()
    if "loop" in parts:
        C.vanilla_loop.lower(target.params, plan, prefill.out_info).compile()


def _decode(target, draft, prompt_ids, max_new_tokens, method, sync, tree, ddd, temperature, top_p, seed, loop,
            profile, policy, capacity, *, streaming: bool, prompt_len: int | None = None):
    """generate's body as a generator: yields each cycle's new tokens when streaming, returns the GenerateResult."""
    why = None  # why the defaults decode this batch as vanilla does
    if method == "vanilla":
        tree, ddd, source = tree or TreeConfig(), ddd or DDDConfig(), None
    else:
        batch = len(prompt_ids) if _batched(prompt_ids) else 1
        defaults = tree is None and ddd is None and policy is None
        tree, ddd, source = settings.resolve(target, draft, tree, ddd, method=method, batch=batch)
        if defaults:
            why = settings.vanilla_fallback(target, draft, method, batch)
    decoded_as = "vanilla" if why else method
    plan = make_plan(target, draft, method=decoded_as, sync=sync, tree=tree, ddd=ddd, temperature=temperature,
                     top_p=top_p, max_new_tokens=max_new_tokens, policy=policy)
    if loop is None:
        loop = "host" if (profile or streaming or plan.host_checks) else "device"
    if loop not in ("host", "device"):
        raise ValueError(f"loop must be 'host' or 'device', got {loop!r}")
    if plan.host_checks and loop == "device":
        raise ValueError("sync='host' reads the confidence on the host each check: it needs loop='host'")
    batched, toks, plen, capacity = _prepare_prompts(target, prompt_ids, plan, capacity, prompt_len)
    n_rows = toks.shape[0]
    mesh = getattr(target, "mesh", None)
    if mesh is not None:  # batch over "data": pad with copies of the last prompt (dropped from the results)
        pad = sharding.pad_batch(n_rows, mesh)
        toks = jnp.concatenate([toks, jnp.repeat(toks[-1:], pad, axis=0)]) if pad else toks
        plen = jnp.concatenate([plen, jnp.repeat(plen[-1:], pad)]) if pad else plen
        toks = sharding.put(np.asarray(toks), sharding.batch_sharding(mesh, 2))
        plen = sharding.put(np.asarray(plen), sharding.batch_sharding(mesh, 1))
    tparams = target.params
    dparams = draft.decode_params() if plan.method != "vanilla" else None
    threshold = jnp.float32(ddd.threshold)
    counter = SyncCounter()
    clock = drivers.PhaseClock(profile)

    t0 = time.perf_counter()
    key = jax.random.PRNGKey(seed)
    if mesh is not None:  # replicated: a global array on every process of a multi-host mesh
        key = sharding.put(np.asarray(key), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    s = C.prefill_state(tparams, dparams, plan, toks, plen, key, capacity=capacity, mesh=mesh)
    jax.block_until_ready(s)
    t1 = time.perf_counter()
    if plan.method == "vanilla":
        s = yield from drivers.run_vanilla(tparams, plan, s, loop, counter, streaming)
    else:
        s = yield from drivers.run_spec(tparams, dparams, plan, s, threshold, loop, counter, clock, streaming)
    jax.block_until_ready(s)
    t2 = time.perf_counter()
    if mesh is not None and jax.process_count() > 1:  # every process gets every sequence's results
        s = jax.tree.map(sharding.to_host, s)
    used = None if source is None else {"tree": tree.to_dict(), "source": source,
                                        **({"ddd": dataclasses.asdict(ddd)} if method == "ddd" else {}),
                                        "draft_dtype": draft.weight_dtype, "decoded_as": decoded_as,
                                        **({"why": why} if why else {})}
    res = drivers.result(target, plan, s, batched, counter, clock.times, t1 - t0, t2 - t1, used, n_rows)
    if why:  # decoded as vanilla: the stats still name the method asked for (settings["decoded_as"] says how)
        for st in res.stats.get("per_sequence", [res.stats]):
            st.update(method=method, sync=sync if method == "ddd" else None)
    return res
