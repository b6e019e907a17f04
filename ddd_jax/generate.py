"""Generation: prefill, vanilla decoding (the baseline), and the speculative cycle (draft -> verify -> commit).

The draft phase -- how deep to draft and every DDD stop decision -- lives in `ddd_jax.drafting`; this module
asks it for a beam, verifies the tree in one target forward and commits what was accepted.

Loops:
* vanilla: one jitted `lax.while_loop` over tokens (``loop="device"``) or a Python loop (``loop="host"``,
  streaming).
* speculative ``method="eagle2"`` / ``"ddd"`` with ``sync="device"`` or ``"callback"``: by default the whole
  generation is one jitted `lax.while_loop` over cycles; ``loop="host"`` runs one fused jitted cycle per
  Python iteration (one sync per cycle to read the done flag).
* ``sync="host"``: a Python loop in the fewest programs the host's decisions allow -- one per check. A cycle's
  verification and commit run in one program with the next cycle's draft up to its first check, the host reads
  that check's confidence together with the done flags (one sync), and each later check is a segment program and
  a read (`drafting.finish_from_host`).
* ``profile=True``: a Python loop over cycles whose phases (draft, verify, commit) are separate jitted calls;
  drafting is `drafting.draft_from_host`.

``profile=True`` blocks after each phase to split wall time into draft / verify / commit (same tokens; the
blocking adds time, so use it for the split, not for speed).

Every sync counted in ``stats["host_syncs"]`` happens during decoding; the final transfer of results is not
counted. ``draft_syncs`` counts those inside draft phases (one per DDD check executed in host and callback
modes; 0 in device mode and for EAGLE-2).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import drafting, eagle3, llama, settings, sharding
from .cache import KVCache, commit, with_length
from .config import LOOKUP_MAX_NGRAM, DDDConfig, DraftConfig, ModelConfig, TreeConfig, check_tree_for_ddd
from .drafting import SyncCounter, threshold_policy
from .tree import add_lookup, build_tree, lookup_chain
from .verify import accept_greedy, accept_sample, process_logits

METHODS = ("vanilla", "eagle2", "ddd")
SYNCS = ("host", "callback", "device")
PROMPT_BUCKETS = (32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


@dataclass(frozen=True)
class Plan:
    """Everything static about one decode: hashable, passed to jit as a static argument."""

    tcfg: ModelConfig
    dcfg: DraftConfig | None
    method: str  # "vanilla" | "eagle2" | "ddd"
    sync: str  # DDD's stop decision: "host" | "callback" | "device" ("device" for eagle2 / vanilla)
    top_k: int
    total_tokens: int  # verified tokens per cycle: root + total_tokens - 1 drafted nodes
    max_depth: int  # maximum draft steps (EAGLE-2: tree.depth; DDD: ddd.max_depth)
    check_steps: tuple  # DDD check steps (empty for EAGLE-2)
    temperature: float
    top_p: float
    max_new_tokens: int
    eos: tuple
    policy: Callable | None = None  # DDD host policy (sync "host" / "callback"): see `drafting.Policy`
    lookup: int = 0  # context-lookup candidates per cycle (TreeConfig.lookup; 0 = off)
    lookup_ngram: int = 2
    lookup_logp: float = -0.4

    @property
    def M(self) -> int:  # longest accepted path incl. root (= most tokens one cycle emits)
        return max(self.max_depth + 2, self.lookup + 1)

    @property
    def scratch(self) -> int:  # draft cache scratch slots for beam nodes
        return self.max_depth * self.top_k

    @property
    def host_checks(self) -> bool:  # DDD decisions taken by the host between jitted segments
        return self.method == "ddd" and self.sync == "host"


@jax.tree_util.register_dataclass
@dataclass
class State:
    tcache: KVCache
    dcache: KVCache | None
    root: jax.Array  # [B] int32 last emitted token (not yet in the target cache)
    pend_tok: jax.Array  # [B, M] int32 draft pairs to commit next cycle: token at position p+1 ...
    pend_feat: jax.Array  # [B, M, Df] ... and the target feature at position p (Df = dcfg.feature_size)
    pend_n: jax.Array  # [B] int32
    out: jax.Array  # [B, max_new_tokens + M] int32 emitted tokens
    out_len: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    key: jax.Array  # PRNG key
    cycle: jax.Array  # [] int32 target calls after the prefill
    acc_hist: jax.Array  # [C, B] int32 tokens emitted per target call
    depth_hist: jax.Array  # [C, B] int32 draft steps per cycle
    checks: jax.Array  # [] int32 DDD checks executed inside jitted draft loops
    ctx: jax.Array  # [B, S + M] int32 token at each position, prompt then emitted (lookup; [B, 0] when off)


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


def cache_slack(plan: Plan) -> int:
    """Cache slots a decode needs past prompt + max_new_tokens: one cycle's tree, its accepted path and the
    draft scratch (speculative), or one path (vanilla), plus a little margin."""
    if plan.method == "vanilla":
        return plan.M + 8
    return plan.total_tokens + plan.M + plan.scratch + 8


def cache_capacity(prompt_len: int, plan: Plan) -> int:
    """The smallest KV-cache capacity (a multiple of 256) for a prompt of `prompt_len` tokens under `plan`."""
    need = max(bucket_length(prompt_len), prompt_len + plan.max_new_tokens + cache_slack(plan))
    return -(-need // 256) * 256


def _sample(logits, key, temperature: float, top_p: float):
    """The next token sampled from logits (temperature > 0; greedy decoding's forwards return their tokens:
    `forward(..., return_logits=False, greedy=True)`)."""
    return jax.random.categorical(key, process_logits(logits, temperature, top_p), axis=-1).astype(jnp.int32)


def _emit(plan: Plan, state_out, out_len, done, emitted, n):
    """Append n[b] of emitted[b] to the output, cut at EOS (kept) and at max_new_tokens. Returns (out, out_len, done, kept)."""
    B, M = emitted.shape
    live = ~done
    i = jnp.arange(M)[None]
    eos = jnp.asarray(plan.eos if plan.eos else (-1,), jnp.int32)
    is_eos = jnp.any(emitted[..., None] == eos, axis=-1) & (i < n[:, None])
    has_eos = jnp.any(is_eos, axis=1)
    first = jnp.argmax(is_eos, axis=1)
    keep = jnp.where(has_eos, jnp.minimum(n, first + 1), n)
    keep = jnp.minimum(keep, plan.max_new_tokens - out_len)
    keep = jnp.where(live, keep, 0)
    out = jax.vmap(lambda o, e, p: jax.lax.dynamic_update_slice(o, e, (p,)))(state_out, emitted, out_len)
    out = jnp.where(live[:, None], out, state_out)
    new_len = out_len + keep
    hit_eos = has_eos & (first < keep)
    new_done = done | (live & (hit_eos | (new_len >= plan.max_new_tokens)))
    return out, new_len, new_done, keep


# ----------------------------------------------------------------------------------------------- prefill
def _aux_layers(plan: Plan) -> tuple:
    """Target layers whose inputs the head reads (EAGLE-3), collected in the same target pass; () otherwise."""
    return eagle3.feature_layers(plan.tcfg) if plan.dcfg is not None and plan.dcfg.head_type == "eagle3" else ()


def _features(plan: Plan, out: llama.Output):
    """The draft head's target features: [B, T, 3D] layer inputs (EAGLE-3) or the final hidden [B, T, D]."""
    return out.aux if _aux_layers(plan) else out.hidden


@partial(jax.jit, static_argnames=("plan", "capacity", "mesh"))
def _prefill(tparams, dparams, plan: Plan, tokens, plen, key, *, capacity: int, mesh=None) -> State:
    B, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    tcache = llama.new_cache(plan.tcfg, B, capacity, tparams["embed"].dtype)
    greedy = plan.temperature <= 0.0  # greedy forwards return tokens only (no logits: the screened lm_head)
    out = llama.forward(tparams, plan.tcfg, tokens, pos, tcache, logit_index=(plen - 1)[:, None],
                        aux_layers=_aux_layers(plan), return_logits=not greedy, greedy=greedy)
    feats = _features(plan, out)
    tcache = with_length(out.cache, plen)
    key, sub = jax.random.split(key)
    first = out.greedy[:, 0] if greedy else _sample(out.logits[:, 0], sub, plan.temperature, plan.top_p)
    M = plan.M
    D = feats.shape[-1]
    feat_last = jnp.take_along_axis(feats, (plen - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    dcache = None
    if plan.dcfg is not None:  # the last pair (first, f_{plen-1}) stays pending for the first cycle's step 0
        dcache = drafting.fill_prefix(dparams, plan, tparams, tokens, feats, pos, plen, capacity)
    C = plan.max_new_tokens
    state = State(
        tcache=tcache, dcache=dcache, root=first,
        pend_tok=jnp.zeros((B, M), jnp.int32).at[:, 0].set(first),
        pend_feat=jnp.zeros((B, M, D), feats.dtype).at[:, 0].set(feat_last),
        pend_n=jnp.ones((B,), jnp.int32),
        out=jnp.zeros((B, plan.max_new_tokens + M), jnp.int32), out_len=jnp.zeros((B,), jnp.int32),
        done=jnp.zeros((B,), bool), key=key, cycle=jnp.zeros((), jnp.int32),
        acc_hist=jnp.zeros((C, B), jnp.int32), depth_hist=jnp.zeros((C, B), jnp.int32),
        checks=jnp.zeros((), jnp.int32), ctx=_prefill_ctx(plan, tokens, plen, first, capacity))
    out_buf, out_len, done, _ = _emit(plan, state.out, state.out_len, state.done, first[:, None].repeat(M, 1),
                                      jnp.ones((B,), jnp.int32))
    state = dataclasses.replace(state, out=out_buf, out_len=out_len, done=done)
    if mesh is not None:  # batch over "data", KV heads over "model"; the decode loops inherit these shardings
        state = sharding.constrain_state(state, mesh)
    return state


def _prefill_ctx(plan: Plan, tokens, plen, first, capacity: int):
    """The lookup context after the prefill: the prompt, then the first token at position plen."""
    B, T = tokens.shape
    if not plan.lookup:
        return jnp.zeros((B, 0), jnp.int32)
    ctx = jnp.zeros((B, capacity + plan.M), jnp.int32).at[:, :T].set(tokens)
    return ctx.at[jnp.arange(B), plen].set(first)


# ----------------------------------------------------------------------------------------------- vanilla
def _vanilla_step(tparams, plan: Plan, s: State) -> State:
    B = s.root.shape[0]
    L = s.tcache.length
    greedy = plan.temperature <= 0.0
    o = llama.forward(tparams, plan.tcfg, s.root[:, None], L[:, None], s.tcache, return_logits=not greedy,
                      greedy=greedy)
    key, sub = jax.random.split(s.key)
    nxt = o.greedy[:, 0] if greedy else _sample(o.logits[:, 0], sub, plan.temperature, plan.top_p)
    live = ~s.done
    M = plan.M
    out, out_len, done, keep = _emit(plan, s.out, s.out_len, s.done, nxt[:, None].repeat(M, 1), jnp.ones((B,), jnp.int32))
    tcache = with_length(o.cache, jnp.where(live, L + 1, L))
    return dataclasses.replace(s, tcache=tcache, root=jnp.where(live, nxt, s.root), out=out, out_len=out_len,
                               done=done, key=key, cycle=s.cycle + 1, acc_hist=s.acc_hist.at[s.cycle].set(keep))


_vanilla_step_jit = jax.jit(_vanilla_step, static_argnames=("plan",), donate_argnames=("s",))


def _unfinished(plan: Plan, s: State):
    return ~jnp.all(s.done) & (s.cycle < plan.max_new_tokens)


@partial(jax.jit, static_argnames=("plan",), donate_argnames=("s",))
def _vanilla_loop(tparams, plan: Plan, s: State) -> State:
    return jax.lax.while_loop(partial(_unfinished, plan), lambda s: _vanilla_step(tparams, plan, s), s)


# ----------------------------------------------------------------------------------------------- speculative
def _verify(tparams, plan: Plan, s: State, d: drafting.Draft):
    """One target forward over the tree built from the draft's pool; greedy or lossless-sampling acceptance."""
    L = s.tcache.length
    beam = d.beam
    if plan.lookup:  # context-lookup candidates join the head's pool before the rerank
        tok, ok = lookup_chain(s.ctx, L, plan.lookup, plan.lookup_ngram, LOOKUP_MAX_NGRAM)
        beam = add_lookup(beam, tok, ok, plan.lookup_logp, plan.top_k)
    tree = build_tree(s.root, beam, plan.total_tokens)
    greedy = plan.temperature <= 0.0
    o = llama.forward(tparams, plan.tcfg, tree.tokens, L[:, None] + tree.depth, s.tcache, attn_mask=tree.anc,
                      aux_layers=_aux_layers(plan), return_logits=not greedy, greedy=greedy)
    if greedy:
        acc = accept_greedy(tree, None, plan.M, pred=o.greedy)
        key = s.key
    else:
        key, sub = jax.random.split(s.key)
        acc = accept_sample(tree, o.logits, sub, plan.temperature, plan.top_p, plan.M)
    return o.cache, _features(plan, o), acc, key


def _commit(plan: Plan, s: State, tcache_new, hidden, acc, key, d: drafting.Draft, L=None, dlen=None) -> State:
    """Keep the accepted path's KV, emit its tokens, and queue its (token, feature) pairs for the next step 0.
    L: [B] the target cache's length before verification (default `s.tcache.length`); dlen: [B] the draft cache's
    length before the draft (default `s.dcache.length`)."""
    live = ~s.done
    L = s.tcache.length if L is None else L
    dlen = s.dcache.length if dlen is None else dlen
    tcache = commit(tcache_new, L, acc.path, acc.n)
    tcache = with_length(tcache, jnp.where(live, tcache.length, L))
    dcache = with_length(d.dcache, jnp.where(live, d.base, dlen))
    out, out_len, done, keep = _emit(plan, s.out, s.out_len, s.done, acc.emitted, acc.n)
    feat = jnp.take_along_axis(hidden, acc.path[:, :, None], axis=1)  # [B, M, D]
    root = jnp.take_along_axis(acc.emitted, (acc.n - 1)[:, None], axis=1)[:, 0]
    pick = lambda new, old: jnp.where(live.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    ctx = s.ctx
    if plan.lookup:  # the emitted tokens sit at positions L+1 .. L+n (the root, at L, is already there)
        ctx = pick(jax.vmap(lambda c, e, p: jax.lax.dynamic_update_slice(c, e, (p,)))(ctx, acc.emitted, L + 1), ctx)
    return dataclasses.replace(
        s, tcache=tcache, dcache=dcache, root=pick(root, s.root), pend_tok=pick(acc.emitted, s.pend_tok),
        pend_feat=pick(feat.astype(s.pend_feat.dtype), s.pend_feat), pend_n=pick(acc.n, s.pend_n),
        out=out, out_len=out_len, done=done, key=key, cycle=s.cycle + 1, acc_hist=s.acc_hist.at[s.cycle].set(keep),
        depth_hist=s.depth_hist.at[s.cycle].set(jnp.where(live, d.beam.depth, 0)), checks=s.checks + d.checks,
        ctx=ctx)


def _verify_commit(tparams, plan: Plan, s: State, d: drafting.Draft, dlen=None) -> State:
    tcache_new, hidden, acc, key = _verify(tparams, plan, s, d)
    return _commit(plan, s, tcache_new, hidden, acc, key, d, dlen=dlen)


def _cycle(tparams, dparams, plan: Plan, s: State, threshold) -> State:
    d = drafting.draft_in_program(tparams, dparams, plan, s.dcache, s.pend_tok, s.pend_feat, s.pend_n, threshold)
    return _verify_commit(tparams, plan, s, d)


_cycle_jit = jax.jit(_cycle, static_argnames=("plan",), donate_argnames=("s",))


# The phases as programs of their own (profile=True): the target cache travels apart from the rest of
# the state (`rest`: the state with tcache None) so that verification can take it donated and write the tree's
# K/V in place -- undonated, every cycle copied the whole cache (23.6 MB at 512 slots for SmolLM2) -- and the
# draft's cache reaches the commit donated too.
def _verify_phase(tparams, plan: Plan, rest: State, tcache: KVCache, d: drafting.Draft):
    tcache_new, hidden, acc, key = _verify(tparams, plan, dataclasses.replace(rest, tcache=tcache), d)
    return tcache_new, hidden, acc, key, tcache.length


def _commit_phase(plan: Plan, rest: State, L, tcache_new, hidden, acc, key, d: drafting.Draft, dcache) -> State:
    return _commit(plan, rest, tcache_new, hidden, acc, key, dataclasses.replace(d, dcache=dcache), L=L)


def _verify_commit_begin(tparams, dparams, plan: Plan, s: State, dlen, d: drafting.Draft, dcache, threshold):
    """sync="host": verify and commit a cycle and draft the next one up to its first check, in one program (the
    state and the draft's cache donated). The state comes and goes without its draft cache, which travels in the
    Draft (dlen: [B] its length before that draft, what the commit keeps for finished rows). Returns (state,
    dlen, the next Draft, its confidence [B])."""
    s = _verify_commit(tparams, plan, s, dataclasses.replace(d, dcache=dcache), dlen=dlen)
    d_next, conf = drafting.begin_host(tparams, dparams, plan, s.dcache, s.pend_tok, s.pend_feat, s.pend_n,
                                       threshold)
    return dataclasses.replace(s, dcache=None), s.dcache.length, d_next, conf


_verify_commit_begin_jit = jax.jit(_verify_commit_begin, static_argnames=("plan",), donate_argnames=("s", "dcache"))
_verify_jit = jax.jit(_verify_phase, static_argnames=("plan",), donate_argnames=("tcache",))
_commit_jit = jax.jit(_commit_phase, static_argnames=("plan",), donate_argnames=("rest", "tcache_new", "dcache"))


@partial(jax.jit, static_argnames=("plan",), donate_argnames=("s",))
def _spec_loop(tparams, dparams, plan: Plan, s: State, threshold) -> State:
    return jax.lax.while_loop(partial(_unfinished, plan), lambda s: _cycle(tparams, dparams, plan, s, threshold), s)


# ----------------------------------------------------------------------------------------------- public API
def make_plan(target, draft, *, method: str, sync: str, tree: TreeConfig, ddd: DDDConfig, temperature: float,
              top_p: float, max_new_tokens: int, policy=None) -> Plan:
    """Check the arguments of one decode and freeze them into a `Plan` (sync is normalised to "device" for
    methods other than DDD)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if sync not in SYNCS:
        raise ValueError(f"sync must be one of {SYNCS}, got {sync!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not (0.0 < top_p <= 1.0):
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got temperature={temperature}, top_p={top_p}")
    if method != "ddd":
        sync = "device"
    if policy is not None and sync == "device":
        raise ValueError("a DDD policy runs on the host: use method='ddd' with sync='host' or 'callback'")
    dcfg = None
    if method != "vanilla":
        if draft is None:
            raise ValueError(f"method={method!r} needs a draft head (load_draft / init_draft)")
        draft.config.check_target(target.config)
        dcfg = draft.config
        if dcfg.draft_vocab_size and tree.top_k > dcfg.draft_vocab_size:
            raise ValueError(f"top_k={tree.top_k} exceeds the draft vocabulary ({dcfg.draft_vocab_size} tokens)")
    if method == "ddd":
        check_tree_for_ddd(tree, ddd)
        max_depth, checks, policy = ddd.max_depth, tuple(ddd.check_steps), policy or threshold_policy
    else:
        max_depth, checks = tree.depth, ()
    return Plan(tcfg=target.config, dcfg=dcfg, method=method, sync=sync, top_k=tree.top_k,
                total_tokens=tree.total_tokens, max_depth=max_depth, check_steps=checks,
                temperature=float(temperature), top_p=float(top_p), max_new_tokens=int(max_new_tokens),
                eos=tuple(target.eos_token_ids), policy=policy, lookup=tree.lookup, lookup_ngram=tree.lookup_ngram,
                lookup_logp=float(tree.lookup_logp))


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
             policy=None, capacity: int | None = None, stream=None) -> GenerateResult:
    """Generate new tokens for `prompt_ids` (list[int], or a list of lists for a batch).

    method: "vanilla" (baseline), "eagle2" (fixed-depth EAGLE-2 tree), "ddd" (Dynamic Depth Decoding).
    tree / ddd: None = this backend's tuned settings for this target and head when `ddd-jax tune` saved some,
    else the paper's defaults (`ddd_jax.settings.resolve`); stats["settings"] says which were used and why, and
    the head's weight dtype (a float16 head -- `draft.astype(jnp.float16)` -- drafts at half the bytes on CPU).
    sync (ddd only): "host" | "callback" | "device" (see `ddd_jax.drafting`). loop: "device" (one jitted loop
    over the whole generation) or "host" (Python loop over cycles/tokens); default "device" except for
    sync="host", profile=True or stream. policy: host function for sync="host" or "callback"
    ((step, confidence, active, threshold) -> keep-drafting mask; default: DDD's threshold rule). It is part of
    the static plan, so each distinct policy compiles once. stream: callable(new_token_ids) invoked after each
    cycle (forces loop="host").
    """
    if method == "vanilla":
        tree, ddd, source = tree or TreeConfig(), ddd or DDDConfig(), None
    else:
        tree, ddd, source = settings.resolve(target, draft, tree, ddd)
    plan = make_plan(target, draft, method=method, sync=sync, tree=tree, ddd=ddd, temperature=temperature,
                     top_p=top_p, max_new_tokens=max_new_tokens, policy=policy)
    if loop is None:
        loop = "host" if (profile or stream is not None or plan.host_checks) else "device"
    if loop not in ("host", "device"):
        raise ValueError(f"loop must be 'host' or 'device', got {loop!r}")
    if plan.host_checks and loop == "device":
        raise ValueError("sync='host' reads the confidence on the host each check: it needs loop='host'")
    batched, toks, plen, capacity = _prepare_prompts(target, prompt_ids, plan, capacity)
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
    clock = _PhaseClock(profile)

    t0 = time.perf_counter()
    key = jax.random.PRNGKey(seed)
    if mesh is not None:  # replicated: a global array on every process of a multi-host mesh
        key = sharding.put(np.asarray(key), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    s = _prefill(tparams, dparams, plan, toks, plen, key, capacity=capacity, mesh=mesh)
    jax.block_until_ready(s)
    t1 = time.perf_counter()
    if plan.method == "vanilla":
        s = _run_vanilla(tparams, plan, s, loop, counter, stream)
    else:
        s = _run_spec(tparams, dparams, plan, s, threshold, loop, counter, clock, stream)
    jax.block_until_ready(s)
    t2 = time.perf_counter()
    if mesh is not None and jax.process_count() > 1:  # every process gets every sequence's results
        s = jax.tree.map(sharding.to_host, s)
    used = None if source is None else {"tree": tree.to_dict(), "source": source,
                                        **({"ddd": dataclasses.asdict(ddd)} if method == "ddd" else {}),
                                        "draft_dtype": draft.weight_dtype}
    return _result(target, plan, s, batched, counter, clock.times, t1 - t0, t2 - t1, used, n_rows)


class _PhaseClock:
    """Wall time per phase of a Python-loop cycle; blocks on each phase's output only when profiling."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.times = {"draft_s": 0.0, "verify_s": 0.0, "commit_s": 0.0}
        self._t = 0.0

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, phase: str, out) -> None:
        if self.enabled:
            jax.block_until_ready(out)
            now = time.perf_counter()
            self.times[phase + "_s"] += now - self._t
            self._t = now


def _run_vanilla(tparams, plan, s, loop, counter, stream):
    if loop == "device":
        return _vanilla_loop(tparams, plan, s)
    shown = 0
    while True:
        s = _vanilla_step_jit(tparams, plan, s)
        shown, finished = _poll(s, plan, counter, stream, shown)
        if finished:
            return s


def _progress(s: State, stream):
    """What a Python loop reads of the state each cycle: done flags and cycle count (and the output when
    streaming)."""
    return (s.done, s.cycle) if stream is None else (s.done, s.cycle, s.out, s.out_len)


def _finished(seen, plan: Plan, stream, shown: int):
    """(tokens shown, whether decoding is over) from `_progress` values read on the host."""
    done, cyc = seen[0], seen[1]
    if stream is not None:
        out, n = seen[2], seen[3]
        stream([int(t) for t in out[0, shown:int(n[0])]])
        shown = int(n[0])
    return shown, bool(done.all()) or int(cyc) >= plan.max_new_tokens


def _poll(s: State, plan: Plan, counter: SyncCounter, stream, shown: int):
    """The one per-cycle host sync of the Python loops: done flags (and new tokens when streaming)."""
    return _finished(counter.read(_progress(s, stream)), plan, stream, shown)


def _run_host_checks(tparams, dparams, plan, s, threshold, counter: SyncCounter, stream):
    """sync="host" without the phase clock: one program per check. The read of a cycle's first check also reads
    the done flags the previous cycle's commit left (one sync for both; when decoding is over, that last read is
    the loop's and the draft it came with is dropped), so the host syncs are the checks plus one."""
    shown = 0
    d, conf = drafting.begin_host_jit(tparams, dparams, plan, s.dcache, s.pend_tok, s.pend_feat, s.pend_n,
                                      threshold)
    dlen, s = s.dcache.length, dataclasses.replace(s, dcache=None)
    while True:
        conf, active, seen = counter.read((conf, d.beam.active, _progress(s, stream)))
        shown, finished = _finished(seen, plan, stream, shown)
        if finished:
            return dataclasses.replace(s, dcache=with_length(d.dcache, dlen))
        counter.count_draft()  # the read was this cycle's first check
        d = drafting.finish_from_host(tparams, dparams, plan, d, (conf, active), threshold, counter)
        s, dlen, d, conf = _verify_commit_begin_jit(tparams, dparams, plan, s, dlen,
                                                    dataclasses.replace(d, dcache=None), d.dcache, threshold)


def _run_spec(tparams, dparams, plan, s, threshold, loop, counter, clock: _PhaseClock, stream):
    if loop == "device" and not clock.enabled:
        return _spec_loop(tparams, dparams, plan, s, threshold)
    if plan.host_checks and not clock.enabled:
        return _run_host_checks(tparams, dparams, plan, s, threshold, counter, stream)
    shown = 0
    while True:
        if clock.enabled:  # the phases as programs of their own, each timed
            clock.start()
            d = drafting.draft_from_host(tparams, dparams, plan, s.dcache, s.pend_tok, s.pend_feat, s.pend_n,
                                         threshold, counter)
            clock.lap("draft", d)
            rest = dataclasses.replace(s, tcache=None)
            tc_new, hidden, acc, key, L = _verify_jit(tparams, plan, rest, s.tcache, d)
            clock.lap("verify", acc)
            s = _commit_jit(plan, rest, L, tc_new, hidden, acc, key, dataclasses.replace(d, dcache=None), d.dcache)
            clock.lap("commit", s)
        else:  # one fused jitted cycle per iteration
            s = _cycle_jit(tparams, dparams, plan, s, threshold)
        shown, finished = _poll(s, plan, counter, stream, shown)
        if finished:
            return s


def _result(target, plan: Plan, s: State, batched: bool, counter: SyncCounter, times, prefill_s, decode_s,
            used_settings, n_rows: int | None = None):
    out = np.asarray(s.out)
    out_len = np.asarray(s.out_len)
    cycles = int(np.asarray(s.cycle))
    # DDD checks: read by the host in sync="host"; inside jitted loops otherwise (an io_callback each in "callback")
    in_loop = int(np.asarray(s.checks))
    callbacks = in_loop if plan.method == "ddd" and plan.sync == "callback" else 0
    acc_hist = np.asarray(s.acc_hist)[:cycles]
    depth_hist = np.asarray(s.depth_hist)[:cycles]
    n_rows = out.shape[0] if n_rows is None else n_rows  # rows past n_rows pad the batch for the mesh
    toks = [[int(t) for t in out[b, : out_len[b]]] for b in range(n_rows)]
    stats = []
    for b in range(n_rows):
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
            "ddd_checks": counter.draft + in_loop, "draft_syncs": counter.draft + callbacks,
            "host_syncs": counter.total + callbacks,
            "prefill_s": prefill_s, "decode_s": decode_s, "total_s": prefill_s + decode_s,
            "tokens_per_s": (n_new - 1) / decode_s if decode_s > 0 and n_new > 1 else 0.0,
            "settings": used_settings, **times,
        }
        stats.append(st)
    texts = [target.decode(t) for t in toks]
    if batched:
        return GenerateResult(tokens=toks, text=texts, stats={"per_sequence": stats, **_merge(stats)})
    return GenerateResult(tokens=toks[0], text=texts[0], stats=stats[0])


def _merge(stats: list) -> dict:
    return {"new_tokens": sum(s["new_tokens"] for s in stats), "host_syncs": stats[0]["host_syncs"],
            "draft_syncs": stats[0]["draft_syncs"], "ddd_checks": stats[0]["ddd_checks"],
            "settings": stats[0]["settings"], "prefill_s": stats[0]["prefill_s"],
            "decode_s": stats[0]["decode_s"]}
