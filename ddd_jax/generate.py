"""Generation: prefill, vanilla decoding (the baseline), and the speculative cycle (draft -> verify -> commit).

Loops:
* vanilla: one jitted `lax.while_loop` over tokens (``loop="device"``) or a Python loop (``loop="host"``,
  streaming).
* speculative ``method="eagle2"`` / ``"ddd"`` with ``sync="device"`` or ``"callback"``: by default the whole
  generation is one jitted `lax.while_loop` over cycles; ``loop="host"`` runs one fused jitted cycle per
  Python iteration (one sync per cycle to read the done flag).
* ``sync="host"``: Python loop over cycles; each draft phase is a first jitted segment (prefix + steps up to
  the first check) followed, per check, by a host read of the confidence and possibly another segment.

``profile=True`` runs each phase as its own jitted call and blocks after it to split wall time into
draft / verify / commit (same tokens; the blocking adds time, so use it for the split, not for speed).

Every sync counted in ``stats["host_syncs"]`` happens during decoding; the final transfer of results is not
counted. ``draft_syncs`` counts those inside draft phases (one per DDD check executed in host and callback
modes; 0 in device mode and for EAGLE-2).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import llama
from .cache import KVCache, commit, with_length
from .config import DDDConfig, DraftConfig, ModelConfig, TreeConfig
from .depth import SyncCounter, draft_prefix, run_steps, set_callback_context, threshold_policy
from .eagle import head_forward, new_cache as new_draft_cache, runtime_params
from .tree import Beam, build_tree, confidence, first_beam
from .verify import accept_greedy, accept_sample, process_logits

METHODS = ("vanilla", "eagle2", "ddd")
SYNCS = ("host", "callback", "device")
PROMPT_BUCKETS = (32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


@dataclass(frozen=True)
class Plan:
    """Everything static about one decode: hashable, passed to jit as a static argument."""

    tcfg: ModelConfig
    dcfg: DraftConfig | None
    method: str
    sync: str
    top_k: int
    n_tree: int
    max_depth: int  # maximum draft steps (EAGLE-2: tree.depth; DDD: ddd.max_depth)
    first_end: int  # steps run before the first host check (host mode)
    check_steps: tuple
    temperature: float
    top_p: float
    max_new: int
    eos: tuple

    @property
    def M(self) -> int:  # longest accepted path incl. root (= most tokens one cycle emits)
        return self.max_depth + 2

    @property
    def scratch(self) -> int:  # draft cache scratch slots for beam nodes
        return self.max_depth * self.top_k

    @property
    def device_mode(self) -> str:
        if self.method == "eagle2":
            return "none"
        return {"device": "device", "callback": "callback", "host": "none"}[self.sync]


@jax.tree_util.register_dataclass
@dataclass
class State:
    tcache: KVCache
    dcache: KVCache | None
    root: jax.Array  # [B] int32 last emitted token (not yet in the target cache)
    pend_tok: jax.Array  # [B, M] int32 draft pairs to commit next cycle: token at position p+1 ...
    pend_feat: jax.Array  # [B, M, D] ... and the target feature at position p
    pend_n: jax.Array  # [B] int32
    out: jax.Array  # [B, max_new + M] int32 emitted tokens
    out_len: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    key: jax.Array  # PRNG key
    cycle: jax.Array  # [] int32 target calls after the prefill
    acc_hist: jax.Array  # [C, B] int32 tokens emitted per target call
    depth_hist: jax.Array  # [C, B] int32 draft steps per cycle


@dataclass
class GenerateResult:
    tokens: list  # new tokens (list[int]; list of lists for a batch)
    text: str | list
    stats: dict = field(default_factory=dict)


def bucket_length(n: int) -> int:
    for b in PROMPT_BUCKETS:
        if n <= b:
            return b
    return -(-n // 2048) * 2048


def _choose(logits, key, temperature: float, top_p: float):
    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, process_logits(logits, temperature, top_p), axis=-1).astype(jnp.int32)


def _emit(plan: Plan, state_out, out_len, done, emitted, n):
    """Append n[b] of emitted[b] to the output, cut at EOS (kept) and at max_new. Returns (out, out_len, done, kept)."""
    B, M = emitted.shape
    live = ~done
    i = jnp.arange(M)[None]
    eos = jnp.asarray(plan.eos if plan.eos else (-1,), jnp.int32)
    is_eos = jnp.any(emitted[..., None] == eos, axis=-1) & (i < n[:, None])
    has_eos = jnp.any(is_eos, axis=1)
    first = jnp.argmax(is_eos, axis=1)
    keep = jnp.where(has_eos, jnp.minimum(n, first + 1), n)
    keep = jnp.minimum(keep, plan.max_new - out_len)
    keep = jnp.where(live, keep, 0)
    out = jax.vmap(lambda o, e, p: jax.lax.dynamic_update_slice(o, e, (p,)))(state_out, emitted, out_len)
    out = jnp.where(live[:, None], out, state_out)
    new_len = out_len + keep
    hit_eos = has_eos & (first < keep)
    new_done = done | (live & (hit_eos | (new_len >= plan.max_new)))
    return out, new_len, new_done, keep


# ----------------------------------------------------------------------------------------------- prefill
@partial(jax.jit, static_argnames=("plan", "capacity"))
def _prefill(tparams, dparams, plan: Plan, tokens, plen, key, *, capacity: int) -> State:
    B, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    tcache = llama.new_cache(plan.tcfg, B, capacity, tparams["embed"].dtype)
    out = llama.forward(tparams, plan.tcfg, tokens, pos, tcache, logit_index=(plen - 1)[:, None])
    tcache = with_length(out.cache, plen)
    key, sub = jax.random.split(key)
    first = _choose(out.logits[:, 0], sub, plan.temperature, plan.top_p)
    M = plan.M
    D = plan.tcfg.hidden_size
    feat_last = jnp.take_along_axis(out.hidden, (plen - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    dcache = None
    if plan.dcfg is not None:
        # pairs (x_{i+1}, f_i) for i < plen-1 enter the draft prefix now; the last pair (first, f_{plen-1})
        # is pending and is processed by the first cycle's step 0.
        shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
        dcache = new_draft_cache(plan.dcfg, B, capacity, tparams["embed"].dtype)
        _, dcache = head_forward(dparams, plan.dcfg, tparams["embed"], shifted, out.hidden, pos, dcache,
                                 llama.tree_kv_mask(dcache.length, capacity, llama.causal_mask(B, T)))
        dcache = with_length(dcache, plen - 1)
    C = plan.max_new
    state = State(
        tcache=tcache, dcache=dcache, root=first,
        pend_tok=jnp.zeros((B, M), jnp.int32).at[:, 0].set(first),
        pend_feat=jnp.zeros((B, M, D), out.hidden.dtype).at[:, 0].set(feat_last),
        pend_n=jnp.ones((B,), jnp.int32),
        out=jnp.zeros((B, plan.max_new + M), jnp.int32), out_len=jnp.zeros((B,), jnp.int32),
        done=jnp.zeros((B,), bool), key=key, cycle=jnp.zeros((), jnp.int32),
        acc_hist=jnp.zeros((C, B), jnp.int32), depth_hist=jnp.zeros((C, B), jnp.int32))
    out_buf, out_len, done, _ = _emit(plan, state.out, state.out_len, state.done, first[:, None].repeat(M, 1),
                                      jnp.ones((B,), jnp.int32))
    return State(**{**state.__dict__, "out": out_buf, "out_len": out_len, "done": done})


# ----------------------------------------------------------------------------------------------- vanilla
def _vanilla_step(tparams, plan: Plan, s: State) -> State:
    B = s.root.shape[0]
    L = s.tcache.length
    o = llama.forward(tparams, plan.tcfg, s.root[:, None], L[:, None], s.tcache)
    key, sub = jax.random.split(s.key)
    nxt = _choose(o.logits[:, 0], sub, plan.temperature, plan.top_p)
    live = ~s.done
    M = plan.M
    out, out_len, done, keep = _emit(plan, s.out, s.out_len, s.done, nxt[:, None].repeat(M, 1), jnp.ones((B,), jnp.int32))
    tcache = with_length(o.cache, jnp.where(live, L + 1, L))
    return State(tcache=tcache, dcache=s.dcache, root=jnp.where(live, nxt, s.root), pend_tok=s.pend_tok,
                 pend_feat=s.pend_feat, pend_n=s.pend_n, out=out, out_len=out_len, done=done, key=key,
                 cycle=s.cycle + 1, acc_hist=s.acc_hist.at[s.cycle].set(keep),
                 depth_hist=s.depth_hist)


_vanilla_step_jit = jax.jit(_vanilla_step, static_argnums=(1,), donate_argnums=(2,))


@partial(jax.jit, static_argnums=(1,), donate_argnums=(2,))
def _vanilla_loop(tparams, plan: Plan, s: State) -> State:
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done) & (s.cycle < plan.max_new),
                              lambda s: _vanilla_step(tparams, plan, s), s)


# ----------------------------------------------------------------------------------------------- speculative
def _draft_begin(tparams, dparams, plan: Plan, s: State, end_step, threshold):
    """Step 0 + first beam + steps up to end_step (with in-loop checks for device/callback modes)."""
    dcache, h0, logp0 = draft_prefix(dparams, plan.dcfg, tparams, plan.tcfg, s.dcache, s.pend_tok, s.pend_feat,
                                     s.pend_n)
    base = dcache.length
    beam = first_beam(logp0, h0, plan.top_k, plan.max_depth, dparams.get("d2t"))
    dcache, beam = run_steps(dparams, plan.dcfg, tparams, plan.tcfg, dcache, base, beam, end_step,
                             k=plan.top_k, max_depth=plan.max_depth, mode=plan.device_mode,
                             check_steps=plan.check_steps, threshold=threshold)
    return dcache, base, beam


def _draft_segment(tparams, dparams, plan: Plan, dcache, base, beam: Beam, end_step):
    return run_steps(dparams, plan.dcfg, tparams, plan.tcfg, dcache, base, beam, end_step,
                     k=plan.top_k, max_depth=plan.max_depth, mode="none")


def _verify(tparams, plan: Plan, s: State, beam: Beam):
    tree = build_tree(s.root, beam, plan.n_tree)
    L = s.tcache.length
    o = llama.forward(tparams, plan.tcfg, tree.tokens, L[:, None] + tree.depth, s.tcache, attn_mask=tree.anc)
    if plan.temperature <= 0.0:
        acc = accept_greedy(tree, o.logits, plan.M)
        key = s.key
    else:
        key, sub = jax.random.split(s.key)
        acc = accept_sample(tree, o.logits, sub, plan.temperature, plan.top_p, plan.M)
    return o.cache, o.hidden, acc, key


def _commit(plan: Plan, s: State, tcache_new, hidden, acc, key, dcache, base, beam: Beam) -> State:
    live = ~s.done
    L = s.tcache.length
    tcache = commit(tcache_new, L, acc.path, acc.n)
    tcache = with_length(tcache, jnp.where(live, tcache.length, L))
    dcache = with_length(dcache, jnp.where(live, base, s.dcache.length))
    out, out_len, done, keep = _emit(plan, s.out, s.out_len, s.done, acc.emitted, acc.n)
    feat = jnp.take_along_axis(hidden, acc.path[:, :, None], axis=1)  # [B, M, D]
    root = jnp.take_along_axis(acc.emitted, (acc.n - 1)[:, None], axis=1)[:, 0]
    pick = lambda new, old: jnp.where(live.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
    return State(tcache=tcache, dcache=dcache, root=pick(root, s.root), pend_tok=pick(acc.emitted, s.pend_tok),
                 pend_feat=pick(feat.astype(s.pend_feat.dtype), s.pend_feat), pend_n=pick(acc.n, s.pend_n),
                 out=out, out_len=out_len, done=done, key=key, cycle=s.cycle + 1,
                 acc_hist=s.acc_hist.at[s.cycle].set(keep),
                 depth_hist=s.depth_hist.at[s.cycle].set(jnp.where(live, beam.depth, 0)))


def _cycle(tparams, dparams, plan: Plan, s: State, threshold) -> State:
    dcache, base, beam = _draft_begin(tparams, dparams, plan, s, plan.max_depth, threshold)
    tcache_new, hidden, acc, key = _verify(tparams, plan, s, beam)
    return _commit(plan, s, tcache_new, hidden, acc, key, dcache, base, beam)


_cycle_jit = jax.jit(_cycle, static_argnums=(2,), donate_argnums=(3,))
_draft_begin_jit = jax.jit(_draft_begin, static_argnums=(2,))
_draft_segment_jit = jax.jit(_draft_segment, static_argnums=(2,), donate_argnums=(3, 5))
_verify_jit = jax.jit(_verify, static_argnums=(1,))
_commit_jit = jax.jit(_commit, static_argnums=(0,), donate_argnums=(1, 2))


@partial(jax.jit, static_argnums=(2,), donate_argnums=(3,))
def _spec_loop(tparams, dparams, plan: Plan, s: State, threshold) -> State:
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done) & (s.cycle < plan.max_new),
                              lambda s: _cycle(tparams, dparams, plan, s, threshold), s)


# ----------------------------------------------------------------------------------------------- public API
def make_plan(target, draft, *, method: str, sync: str, tree: TreeConfig, ddd: DDDConfig, temperature: float,
              top_p: float, max_new_tokens: int) -> Plan:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if sync not in SYNCS:
        raise ValueError(f"sync must be one of {SYNCS}, got {sync!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not (0.0 < top_p <= 1.0):
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got temperature={temperature}, top_p={top_p}")
    dcfg = None
    if method != "vanilla":
        if draft is None:
            raise ValueError(f"method={method!r} needs a draft head (load_draft / init_draft)")
        draft.config.check_target(target.config)
        dcfg = draft.config
        if dcfg.draft_vocab_size and tree.top_k > dcfg.draft_vocab_size:
            raise ValueError(f"top_k={tree.top_k} exceeds the draft vocabulary ({dcfg.draft_vocab_size} tokens)")
    if method == "ddd":
        max_depth, checks, first_end = ddd.max_depth, tuple(ddd.check_steps), ddd.check_steps[0]
        if tree.total_tokens - 1 > tree.pool_size(ddd.check_steps[0]):
            raise ValueError(
                f"total_tokens - 1 = {tree.total_tokens - 1} exceeds the candidate pool at DDD's shallowest stop "
                f"(step {ddd.check_steps[0]}): {tree.pool_size(ddd.check_steps[0])}")
    else:
        max_depth, checks, first_end = tree.depth, (), tree.depth
    return Plan(tcfg=target.config, dcfg=dcfg, method=method, sync=sync, top_k=tree.top_k, n_tree=tree.total_tokens,
                max_depth=max_depth, first_end=first_end, check_steps=checks, temperature=float(temperature),
                top_p=float(top_p), max_new=int(max_new_tokens), eos=tuple(target.eos_token_ids))


def _prepare_prompts(target, prompt_ids, plan: Plan, capacity: int | None):
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty")
    batched = isinstance(prompt_ids[0], (list, tuple, np.ndarray))
    prompts = [list(map(int, p)) for p in (prompt_ids if batched else [prompt_ids])]
    V = target.config.vocab_size
    for p in prompts:
        if not p:
            raise ValueError("a prompt is empty")
        bad = [t for t in p if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {V})")
    P = max(len(p) for p in prompts)
    T = bucket_length(P)
    slack = plan.n_tree + plan.M + plan.scratch + 8 if plan.method != "vanilla" else plan.M + 8
    need = max(T, P + plan.max_new + slack)
    if capacity is None:
        capacity = -(-need // 256) * 256
    elif need > capacity:
        raise ValueError(f"prompt of {P} tokens + max_new_tokens={plan.max_new} (+{slack} slots of tree scratch) "
                         f"needs a cache of {need} slots, but capacity={capacity}")
    if P + plan.max_new > target.config.max_position_embeddings:
        raise ValueError(f"prompt of {P} tokens + max_new_tokens={plan.max_new} exceeds the model's "
                         f"max_position_embeddings={target.config.max_position_embeddings}")
    toks = np.zeros((len(prompts), T), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    plen = np.array([len(p) for p in prompts], np.int32)
    return batched, jnp.asarray(toks), jnp.asarray(plen), capacity


def generate(target, draft, prompt_ids, max_new_tokens: int = 128, method: str = "vanilla", sync: str = "device",
             tree: TreeConfig | None = None, ddd: DDDConfig | None = None, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, loop: str | None = None, profile: bool = False,
             policy=None, capacity: int | None = None, stream=None) -> GenerateResult:
    """Generate new tokens for `prompt_ids` (list[int], or a list of lists for a batch).

    method: "vanilla" (baseline), "eagle2" (fixed-depth EAGLE-2 tree), "ddd" (Dynamic Depth Decoding).
    sync (ddd only): "host" | "callback" | "device" (see `ddd_jax.depth`). loop: "device" (one jitted loop
    over the whole generation) or "host" (Python loop over cycles/tokens); default "device" except for
    sync="host", profile=True or stream. policy: host function for sync="callback"
    ((step, confidence, active, threshold) -> keep-drafting mask). stream: callable(new_token_ids) invoked
    after each cycle (forces loop="host").
    """
    tree = tree or TreeConfig()
    ddd = ddd or DDDConfig()
    plan = make_plan(target, draft, method=method, sync=sync if method == "ddd" else "device", tree=tree, ddd=ddd,
                     temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    if loop is None:
        loop = "host" if (profile or stream is not None or plan.sync == "host") else "device"
    if loop not in ("host", "device"):
        raise ValueError(f"loop must be 'host' or 'device', got {loop!r}")
    if plan.sync == "host" and plan.method == "ddd" and loop == "device":
        raise ValueError("sync='host' reads the confidence on the host each check: it needs loop='host'")
    batched, toks, plen, capacity = _prepare_prompts(target, prompt_ids, plan, capacity)
    tparams = target.params
    dparams = runtime_params(draft) if plan.method != "vanilla" else None
    threshold = jnp.float32(ddd.threshold)
    counter = SyncCounter()
    times = {"draft_s": 0.0, "verify_s": 0.0, "commit_s": 0.0}

    t0 = time.perf_counter()
    s = _prefill(tparams, dparams, plan, toks, plen, jax.random.PRNGKey(seed), capacity=capacity)
    jax.block_until_ready(s)
    t1 = time.perf_counter()
    set_callback_context(policy if plan.sync == "callback" else None, counter)
    try:
        if plan.method == "vanilla":
            s = _run_vanilla(tparams, plan, s, loop, counter, stream)
        else:
            s = _run_spec(tparams, dparams, plan, s, threshold, loop, counter, profile, times, stream)
        jax.block_until_ready(s)
    finally:
        set_callback_context(None, None)
    t2 = time.perf_counter()
    return _result(target, plan, s, batched, counter, times, t1 - t0, t2 - t1)


def _run_vanilla(tparams, plan, s, loop, counter, stream):
    if loop == "device":
        return _vanilla_loop(tparams, plan, s)
    shown = 0
    while True:
        s = _vanilla_step_jit(tparams, plan, s)
        shown, finished = _poll(s, plan, counter, stream, shown)
        if finished:
            return s


def _poll(s: State, plan: Plan, counter: SyncCounter, stream, shown: int):
    """The one per-cycle host sync of the Python loops: done flags (and new tokens when streaming)."""
    if stream is None:
        done, cyc = counter.read((s.done, s.cycle))
    else:
        done, cyc, out, n = counter.read((s.done, s.cycle, s.out, s.out_len))
        stream([int(t) for t in out[0, shown:int(n[0])]])
        shown = int(n[0])
    return shown, bool(done.all()) or int(cyc) >= plan.max_new


def _run_spec(tparams, dparams, plan, s, threshold, loop, counter, profile, times, stream):
    if loop == "device" and not profile:
        return _spec_loop(tparams, dparams, plan, s, threshold)
    shown = 0
    while True:
        if plan.sync == "host" and plan.method == "ddd" or profile:
            ta = time.perf_counter()
            end = plan.first_end if (plan.sync == "host" and plan.method == "ddd") else plan.max_depth
            dcache, base, beam = _draft_begin_jit(tparams, dparams, plan, s, end, threshold)
            if plan.sync == "host" and plan.method == "ddd":
                checks = plan.check_steps
                for i, step in enumerate(checks):
                    conf, active = counter.read((confidence(beam), beam.active), draft=True)
                    keep = threshold_policy(step, conf, active, float(threshold))
                    beam = Beam(**{**beam.__dict__, "active": jnp.asarray(keep)})
                    if not keep.any():
                        break
                    nxt = checks[i + 1] if i + 1 < len(checks) else plan.max_depth
                    dcache, beam = _draft_segment_jit(tparams, dparams, plan, dcache, base, beam, nxt)
            if profile:
                jax.block_until_ready(beam)
            tb = time.perf_counter()
            tc_new, hidden, acc, key = _verify_jit(tparams, plan, s, beam)
            if profile:
                jax.block_until_ready(acc)
            tcc = time.perf_counter()
            s = _commit_jit(plan, s, tc_new, hidden, acc, key, dcache, base, beam)
            if profile:
                jax.block_until_ready(s)
                td = time.perf_counter()
                times["draft_s"] += tb - ta
                times["verify_s"] += tcc - tb
                times["commit_s"] += td - tcc
        else:
            s = _cycle_jit(tparams, dparams, plan, s, threshold)
        shown, finished = _poll(s, plan, counter, stream, shown)
        if finished:
            return s


def _result(target, plan: Plan, s: State, batched: bool, counter: SyncCounter, times, prefill_s, decode_s):
    out = np.asarray(s.out)
    out_len = np.asarray(s.out_len)
    cycles = int(np.asarray(s.cycle))
    acc_hist = np.asarray(s.acc_hist)[:cycles]
    depth_hist = np.asarray(s.depth_hist)[:cycles]
    toks = [[int(t) for t in out[b, : out_len[b]]] for b in range(out.shape[0])]
    stats = []
    for b in range(out.shape[0]):
        calls = acc_hist[:, b] > 0
        acc = [int(x) for x in acc_hist[calls, b]]
        dep = [int(x) for x in depth_hist[calls, b]] if plan.method != "vanilla" else []
        n_new = len(toks[b])
        st = {
            "method": plan.method, "sync": plan.sync if plan.method == "ddd" else None,
            "new_tokens": n_new, "target_calls": len(acc),
            "draft_steps": int(sum(d + 1 for d in dep)),
            "accepted_per_call": acc, "mean_accepted": float(np.mean(acc)) if acc else 0.0,
            "depth_per_call": dep, "mean_depth": float(np.mean(dep)) if dep else 0.0,
            "draft_syncs": counter.draft, "host_syncs": counter.total,
            "prefill_s": prefill_s, "decode_s": decode_s, "total_s": prefill_s + decode_s,
            "tokens_per_s": (n_new - 1) / decode_s if decode_s > 0 and n_new > 1 else 0.0,
            **times,
        }
        stats.append(st)
    texts = [target.decode(t) for t in toks]
    if batched:
        return GenerateResult(tokens=toks, text=texts, stats={"per_sequence": stats, **_merge(stats)})
    return GenerateResult(tokens=toks[0], text=texts[0], stats=stats[0])


def _merge(stats: list) -> dict:
    return {"new_tokens": sum(s["new_tokens"] for s in stats), "host_syncs": stats[0]["host_syncs"],
            "draft_syncs": stats[0]["draft_syncs"], "prefill_s": stats[0]["prefill_s"],
            "decode_s": stats[0]["decode_s"]}
