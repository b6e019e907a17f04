"""One speculative cycle and its parts, as pure jitted functions over the decode `State`: prefill, the vanilla
step, verification of the drafted tree in one target forward, and the commit of the accepted path; and the
device loops (`lax.while_loop`) over them."""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from .. import eagle, llama, sharding
from ..cache import KVCache, commit, with_length
from ..tree import verify_rows
from ..verify import accept_greedy, accept_sample, process_logits
from . import drafting
from .state import Plan, State


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
    """Target layers whose inputs the head reads (EAGLE-3), collected in the same target pass; () when it reads the
    final hidden state (EAGLE-1/2), and for vanilla decoding."""
    return () if plan.dcfg is None else eagle.feature_layers(plan.dcfg, plan.tcfg)


def _features(plan: Plan, out: llama.Output):
    """The draft head's target features: the layer inputs [B, T, A*D] (EAGLE-3: A = 3) or the final hidden
    [B, T, D]."""
    return out.aux if _aux_layers(plan) else out.hidden


@partial(jax.jit, static_argnames=("plan", "capacity", "mesh"))
def prefill_state(tparams, dparams, plan: Plan, tokens, plen, key, *, capacity: int, mesh=None) -> State:
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
        rows_hist=jnp.zeros((C, B), jnp.int32), need_hist=jnp.zeros((C, B), jnp.int32),
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


vanilla_step_jit = jax.jit(_vanilla_step, static_argnames=("plan",), donate_argnames=("s",))


def _unfinished(plan: Plan, s: State):
    return ~jnp.all(s.done) & (s.cycle < plan.max_new_tokens)


@partial(jax.jit, static_argnames=("plan",), donate_argnames=("s",))
def vanilla_loop(tparams, plan: Plan, s: State) -> State:
    return jax.lax.while_loop(partial(_unfinished, plan), lambda s: _vanilla_step(tparams, plan, s), s)


# ----------------------------------------------------------------------------------------------- speculative
def _verify(tparams, plan: Plan, s: State, d: drafting.Draft):
    """One target forward over the tree built from the draft's pool; greedy or lossless-sampling acceptance.

    The forward's products run on only the rows the batch needs: the narrowest of `plan.verify_widths` that holds
    every live sequence's root and valid nodes (a tree's valid nodes come first, `tree.verify_rows`), chosen on
    the device with `lax.switch` on the CPU, where a row costs its FMAs (off the CPU the full width: XLA:GPU would
    read the switch's index on the host, and its launch-bound forward costs about the same at these widths). The
    switch sits around each layer's products (`llama.forward(rows=...)`), never around the KV cache, which a
    branch would have to copy whole. Rows past the width hold no valid node and are never read, so acceptance, the
    KV commit and sampling's draws are those of the full tree.

    Returns (the target cache with the verified rows' K/V past its length, the target features [B, M, D] along
    the accepted path, the `Accept`, the PRNG key, (the rows verified per sequence [B], the rows each sequence's
    own tree needed [B]))."""
    L = s.tcache.length
    tree = drafting.finished_tree(plan, d, s.root, s.ctx, L)
    greedy = plan.temperature <= 0.0
    N = plan.total_tokens
    if greedy:
        key, sub = s.key, None
    else:
        key, sub = jax.random.split(s.key)

    widths = plan.verify_widths
    need = verify_rows(tree)
    rows, W = None, jnp.full(L.shape, N, jnp.int32)
    if len(widths) > 1:  # the narrowest compiled width that holds every live sequence's tree (the last: N)
        pick = sum((jnp.max(jnp.where(s.done, 1, need)) > w).astype(jnp.int32) for w in widths[:-1])
        pick = jax.lax.platform_dependent(pick, cpu=lambda p: p, default=lambda p: jnp.full_like(p, len(widths) - 1))
        rows, W = (pick, widths), jnp.full(L.shape, jnp.asarray(widths, jnp.int32)[pick], jnp.int32)
    o = llama.forward(tparams, plan.tcfg, tree.tokens, L[:, None] + tree.depth, s.tcache, attn_mask=tree.anc,
                      aux_layers=_aux_layers(plan), return_logits=not greedy, greedy=greedy, rows=rows)
    if greedy:
        acc = accept_greedy(tree, None, plan.M, pred=o.greedy)
    else:
        acc = accept_sample(tree, o.logits, sub, plan.temperature, plan.top_p, plan.M, draws=N)
    feat = jnp.take_along_axis(_features(plan, o), acc.path[:, :, None], axis=1)  # [B, M, D]
    return o.cache, feat, acc, key, (W, need)


def _commit(plan: Plan, s: State, tcache_new, feat, acc, key, d: drafting.Draft, rows, L=None, dlen=None) -> State:
    """Keep the accepted path's KV, emit its tokens, and queue its (token, feature) pairs for the next step 0.
    feat: [B, M, D] the target features along the accepted path; rows: ([B] rows each sequence verified, [B] rows
    its own tree needed).
    L: [B] the target cache's length before verification (default `s.tcache.length`); dlen: [B] the draft cache's
    length before the draft (default `s.dcache.length`)."""
    live = ~s.done
    L = s.tcache.length if L is None else L
    dlen = s.dcache.length if dlen is None else dlen
    tcache = commit(tcache_new, L, acc.path, acc.n)
    tcache = with_length(tcache, jnp.where(live, tcache.length, L))
    dcache = with_length(d.dcache, jnp.where(live, d.base, dlen))
    out, out_len, done, keep = _emit(plan, s.out, s.out_len, s.done, acc.emitted, acc.n)
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
        rows_hist=s.rows_hist.at[s.cycle].set(jnp.where(live, rows[0], 0)),
        need_hist=s.need_hist.at[s.cycle].set(jnp.where(live, rows[1], 0)),
        ctx=ctx)


def _verify_commit(tparams, plan: Plan, s: State, d: drafting.Draft, dlen=None) -> State:
    tcache_new, feat, acc, key, rows = _verify(tparams, plan, s, d)
    return _commit(plan, s, tcache_new, feat, acc, key, d, rows, dlen=dlen)


def _cycle(tparams, dparams, plan: Plan, s: State, threshold) -> State:
    d = drafting.draft_in_program(tparams, dparams, plan, s.dcache, s.pend_tok, s.pend_feat, s.pend_n, threshold)
    return _verify_commit(tparams, plan, s, d)


cycle_jit = jax.jit(_cycle, static_argnames=("plan",), donate_argnames=("s",))


# The phases as programs of their own (profile=True): the target cache travels apart from the rest of
# the state (`rest`: the state with tcache None) so that verification can take it donated and write the tree's
# K/V in place -- undonated, every cycle copied the whole cache (23.6 MB at 512 slots for SmolLM2) -- and the
# draft's cache reaches the commit donated too.
def _verify_phase(tparams, plan: Plan, rest: State, tcache: KVCache, d: drafting.Draft):
    tcache_new, feat, acc, key, rows = _verify(tparams, plan, dataclasses.replace(rest, tcache=tcache), d)
    return tcache_new, (feat, rows), acc, key, tcache.length


def _commit_phase(plan: Plan, rest: State, L, tcache_new, verified, acc, key, d: drafting.Draft, dcache) -> State:
    feat, rows = verified
    return _commit(plan, rest, tcache_new, feat, acc, key, dataclasses.replace(d, dcache=dcache), rows, L=L)


def _verify_commit_begin(tparams, dparams, plan: Plan, s: State, dlen, d: drafting.Draft, dcache, threshold):
    """sync="host": verify and commit a cycle and draft the next one up to its first check, in one program (the
    state and the draft's cache donated). The state comes and goes without its draft cache, which travels in the
    Draft (dlen: [B] its length before that draft, what the commit keeps for finished rows). Returns (state,
    dlen, the next Draft, its confidence [B])."""
    s = _verify_commit(tparams, plan, s, dataclasses.replace(d, dcache=dcache), dlen=dlen)
    d_next, conf = drafting.begin_host(tparams, dparams, plan, s.dcache, s.pend_tok, s.pend_feat, s.pend_n,
                                       threshold)
    return dataclasses.replace(s, dcache=None), s.dcache.length, d_next, conf


verify_commit_begin_jit = jax.jit(_verify_commit_begin, static_argnames=("plan",), donate_argnames=("s", "dcache"))
verify_jit = jax.jit(_verify_phase, static_argnames=("plan",), donate_argnames=("tcache",))
commit_jit = jax.jit(_commit_phase, static_argnames=("plan",), donate_argnames=("rest", "tcache_new", "dcache"))


@partial(jax.jit, static_argnames=("plan",), donate_argnames=("s",))
def spec_loop(tparams, dparams, plan: Plan, s: State, threshold) -> State:
    return jax.lax.while_loop(partial(_unfinished, plan), lambda s: _cycle(tparams, dparams, plan, s, threshold), s)
