"""The draft phase of a speculative cycle: step 0, EAGLE-2 beam expansion, and when to stop (fixed depth, or DDD
in its three sync modes), with every host sync counted. a cycle asks this module for a beam; nothing else
decides when drafting stops. The cycle takes the finished tree from `finished_tree`.

Step numbering (see `TreeConfig`): step 0 runs the head over the newly committed pairs and gives the first beam;
step j >= 1 expands the depth-j beam. A DDD check at step s happens after step s and looks at the beam that step
produced: drafting stops for a sequence whose confidence `logsumexp(beam scores)` -- or its rule's signal
(`stop_signal`) -- is below the threshold. A check at step 0 therefore decides whether the first beam (the root's
top_k children) is expanded at all.

How the decision is taken (``plan.sync``, DDD only; EAGLE-2 never checks):

* ``host``     -- the paper's shape: the steps between checks are separate jitted `while_loop` segments and the
                  host reads the confidence at each check (`SyncCounter.read`) and applies the plan's policy,
                  breaking lazy evaluation.
* ``callback`` -- one jitted loop; each check calls the plan's host policy through `io_callback`.
* ``device``   -- one jitted loop; `confidence >= threshold` is taken with `jnp.where`, no host sync.

All three take the same decisions on the same inputs. The callback policy is part of the static `Plan` (a
function is a valid static jit argument), and checks executed inside jitted loops are counted on device in the
returned `Draft.checks`, so concurrent `generate` calls share no state.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from .. import adaedl, gain
from ..cache import KVCache, with_length
from ..config import LOOKUP_MAX_NGRAM
from ..eagle import draft_logits, head_forward, new_cache, project_features, vocab_map
from ..tree import Beam, Tree, add_lookup, build_tree, confidence, expand, first_beam, lookup_chain

# (step, confidence [B], active [B], threshold) -> keep drafting [B] bool. Runs on the host (sync="callback").
Policy = Callable[[int, np.ndarray, np.ndarray, float], np.ndarray]


def threshold_policy(step: int, conf: np.ndarray, active: np.ndarray, threshold: float) -> np.ndarray:
    """DDD's rule: keep drafting while the beam's confidence is at least the threshold."""
    return active & (conf >= threshold)


class SyncCounter:
    """Every device->host read of a Python decode loop goes through here, so sync statistics are exact.
    One per `generate` call (never shared)."""

    def __init__(self):
        self.total = 0
        self.draft = 0

    def read(self, x, draft: bool = False):
        """One device->host transfer of a pytree of arrays (counted once)."""
        self.total += 1
        self.draft += int(draft)
        if all(getattr(a, "is_fully_addressable", True) for a in jax.tree.leaves(x)):
            return jax.tree.map(np.asarray, jax.device_get(x))
        from ..sharding import to_host  # arrays sharded over several processes: the whole value on each
        return jax.tree.map(to_host, x)

    def count_draft(self):
        """Count the last read as a draft sync too: a read that turned out to serve a DDD check (sync="host" reads
        a cycle's first check with the loop's done flags)."""
        self.draft += 1


@jax.tree_util.register_dataclass
@dataclass
class Draft:
    """What the draft phase hands to verification."""

    dcache: KVCache  # draft cache: prefix extended by the committed pairs; beam K/V in the scratch past `base`
    base: jax.Array  # [B] int32 first scratch slot (= draft prefix length after step 0)
    beam: Beam  # final beam and the candidate pool the tree is built from
    checks: jax.Array  # [] int32 DDD checks executed inside jitted loops (sync="callback": one io_callback each)


# ----------------------------------------------------------------------------------------------- head steps
def fill_prefix(dparams, plan, tparams, tokens, hidden, positions, length, capacity: int) -> KVCache:
    """Prefill of the draft cache: pairs (x_{i+1}, f_i) for i < length-1 (the last pair stays pending for the
    first cycle's step 0). tokens, positions [B, T]; hidden [B, T, D] target features. Returns the draft cache."""
    B = tokens.shape[0]
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    dcache = new_cache(plan.dcfg, B, capacity, tparams["embed"].dtype)
    hidden = project_features(dparams, plan.dcfg, hidden)  # EAGLE-3: fc over the 3 layers' features
    _, dcache = head_forward(dparams, plan.dcfg, tparams["embed"], shifted, hidden, positions, dcache)
    return with_length(dcache, length - 1)


PREFIX_ROWS = (2, 4)  # narrower step-0 forwards taken when every sequence's pending pairs fit (see draft_prefix)


def draft_prefix(dparams, plan, tparams, dcache: KVCache, pend_tok, pend_feat, pend_n):
    """Step 0: run the head over the newly committed pairs (pend_n[b] of M), extend the draft prefix.

    The M columns are padding past pend_n; a cycle usually commits one to three pairs, so on the CPU step 0 runs
    over the first 2 or 4 columns when every sequence's pairs fit there (`PREFIX_ROWS`, one `lax.switch`), else all
    M (other backends: all M, no branch).
    Only the pending pairs' rows are read back and the draft cache keeps only them (length += pend_n), so the
    width changes no draft: on the CPU kernels a row's bits do not depend on the other rows (elsewhere XLA's
    reductions may round differently at another width: the draft, never the output, can change).

    Returns (dcache with length += pend_n, h0 [B, D] output at the last real pair, logp0 [B, V'])."""
    M = pend_tok.shape[1]
    widths = [m for m in PREFIX_ROWS if m < M] + [M]
    if len(widths) == 1:
        return _prefix_forward(dparams, plan, tparams, dcache, pend_tok, pend_feat, pend_n)
    need = jnp.max(pend_n)
    pick = sum((need > m).astype(jnp.int32) for m in widths[:-1])

    def width(m):
        return lambda dc, tok, feat, n: _prefix_forward(dparams, plan, tparams, dc, tok[:, :m], feat[:, :m], n)

    # off the CPU all M columns: XLA:GPU would read the switch's index on the host (ConditionalThunk), and a
    # launch-bound forward costs about the same at any of these widths
    return jax.lax.platform_dependent(dcache, pend_tok, pend_feat, pend_n,
                                      cpu=lambda *a: jax.lax.switch(pick, [width(m) for m in widths], *a),
                                      default=width(M))


def _prefix_forward(dparams, plan, tparams, dcache: KVCache, pend_tok, pend_feat, pend_n):
    M = pend_tok.shape[1]
    pos = dcache.length[:, None] + jnp.arange(M, dtype=jnp.int32)[None]
    feat = project_features(dparams, plan.dcfg, pend_feat)  # EAGLE-3: fc; beam features stay D wide
    h, dc = head_forward(dparams, plan.dcfg, tparams["embed"], pend_tok, feat, pos, dcache)
    last = jnp.take_along_axis(h, (pend_n - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    return with_length(dc, dcache.length + pend_n), last, draft_logits(dparams, tparams, plan.tcfg, last, plan.dcfg)


def step_outputs(dparams, plan, tparams, dcache: KVCache, base, beam: Beam):
    """The head on the beam (each node sees the prefix [0, base) and its ancestors in the scratch area
    [base, base + max_depth*k)): (dcache, h [B, k, D] the beam nodes' predicted features, logp [B, k, V'] their
    children's log-probs)."""
    k = plan.top_k
    B = beam.tok.shape[0]
    pos = jnp.broadcast_to((base + beam.step)[:, None], (B, k)).astype(jnp.int32)
    view = with_length(dcache, base + beam.step * k)  # the beam's K/V go to the next k scratch slots
    h, dc = head_forward(dparams, plan.dcfg, tparams["embed"], beam.tok, beam.feat, pos, view,
                         attn_mask=beam.anc, mask_start=base)
    return with_length(dc, dcache.length), h, draft_logits(dparams, tparams, plan.tcfg, h, plan.dcfg)


def draft_step(dparams, plan, tparams, dcache: KVCache, base, beam: Beam) -> tuple[KVCache, Beam]:
    """One expansion step: `step_outputs`, then `tree.expand`."""
    dc, h, logp = step_outputs(dparams, plan, tparams, dcache, base, beam)
    return dc, expand(beam, h, logp, plan.top_k, plan.max_depth, vocab_map(dparams, plan.dcfg))


# ----------------------------------------------------------------------------------------------- stop decisions
def _ask_policy(policy: Policy, step, conf, active, threshold):
    keep = policy(int(step), np.asarray(conf), np.asarray(active), float(threshold))
    return np.asarray(keep, dtype=bool).reshape(np.shape(active))


def _decides_in_loop(plan, decide: bool) -> bool:
    """Whether DDD's decisions are taken inside the traced program (sync "device" / "callback")."""
    return decide and plan.method == "ddd" and plan.sync != "host"


def _check_after_step(plan, beam: Beam, threshold) -> tuple[Beam, jax.Array]:
    """After step `beam.step` (step 0 included): if it is a check step, DDD's decision (traced). Returns the beam
    with its new `active` and 1 if a check was executed, else 0.

    sync="device" computes the decision every step and selects it (`jnp.where`, a few flops over k scores) rather
    than branching: XLA:GPU reads a `lax.cond` predicate on the host and waits for the stream each time
    (ConditionalThunk), which would put a host sync back into every draft step. "callback" branches, so the host
    policy is called at check steps only."""
    is_check = jnp.any(beam.step == jnp.asarray(plan.check_steps or (-1,), jnp.int32))
    if plan.sync == "device":
        act = jnp.where(is_check, _decide(plan, beam, threshold), beam.active)
    else:
        act = jax.lax.cond(is_check, lambda: _decide(plan, beam, threshold), lambda: beam.active)
    return dataclasses.replace(beam, active=act), is_check.astype(jnp.int32)


def stop_signal(plan, beam: Beam):
    """[B] what a DDD check compares with the threshold: the beam's confidence (the paper's rule), the gain rule's
    log-margin of what one more step adds against what it costs (`gain.step_signal`), or AdaEDL's acceptance lower
    bound of the beam's best node (`adaedl.stop_signal`)."""
    if plan.gain is not None:
        return gain.step_signal(plan.gain, beam, plan.total_tokens, plan.max_depth)
    if plan.adaedl_gamma is not None:
        return adaedl.stop_signal(beam, plan.adaedl_gamma)
    return confidence(beam)


def _decide(plan, beam: Beam, threshold):
    """DDD's decision after a check step, on device or through the host policy (traced)."""
    conf = stop_signal(plan, beam)
    if plan.sync == "device":
        return beam.active & (conf >= threshold)
    return io_callback(partial(_ask_policy, plan.policy), jax.ShapeDtypeStruct(beam.active.shape, jnp.bool_),
                       beam.step, conf, beam.active, threshold, ordered=False)


def run_steps(dparams, plan, tparams, dcache: KVCache, base, beam: Beam, end_step, threshold, *,
              decide: bool, start_step: int | None = None) -> tuple[KVCache, Beam, jax.Array]:
    """Draft steps until `end_step` or until no sequence is active, as one `lax.while_loop`.

    decide=True takes DDD's decisions inside the loop (sync "device" or "callback"); decide=False runs plain
    steps (EAGLE-2, and the segments between host checks). Returns (dcache, beam, checks executed).

    Without decisions in the loop no sequence stops, so when the caller knows the beam's step statically
    (`start_step`, with some sequence active) the steps run as a loop of static length instead: the same steps,
    and on XLA:GPU no host read of the loop condition per step (WhileThunk copies it to the host and waits for the
    stream when the trip count is unknown)."""
    if plan.max_depth == 0:  # EAGLE-2 with depth 0: step 0's beam is the whole pool (no scratch to trace into)
        return dcache, beam, jnp.zeros((), jnp.int32)
    in_loop = _decides_in_loop(plan, decide)
    if start_step is not None and not in_loop:
        def step(_, c):
            return draft_step(dparams, plan, tparams, c[0], base, c[1])

        dcache, beam = jax.lax.fori_loop(start_step, end_step, step, (dcache, beam))
        return dcache, beam, jnp.zeros((), jnp.int32)

    def cond(c):
        _, b, _ = c
        return (b.step < end_step) & jnp.any(b.active)

    def body(c):
        dc, b, n = c
        dc, b = draft_step(dparams, plan, tparams, dc, base, b)
        if in_loop:
            b, checked = _check_after_step(plan, b, threshold)
            n = n + checked
        return dc, b, n

    return jax.lax.while_loop(cond, body, (dcache, beam, jnp.zeros((), jnp.int32)))


# ----------------------------------------------------------------------------------------------- the phase
def begin(tparams, dparams, plan, dcache: KVCache, pend_tok, pend_feat, pend_n, threshold, *, end_step: int,
          decide: bool = True) -> Draft:
    """Step 0, the first beam, and steps up to `end_step` (traceable)."""
    dcache, h0, logp0 = draft_prefix(dparams, plan, tparams, dcache, pend_tok, pend_feat, pend_n)
    base = dcache.length
    beam = first_beam(logp0, h0, plan.top_k, plan.max_depth, vocab_map(dparams, plan.dcfg),
                      entropy=plan.adaedl_gamma is not None)  # the adaedl rule reads the draft entropies
    checked = jnp.zeros((), jnp.int32)
    if _decides_in_loop(plan, decide) and 0 in plan.check_steps:
        # a check at step 0 looks at the first beam (the root's top_k): expand it only if the head is confident
        beam, checked = _check_after_step(plan, beam, threshold)
    dcache, beam, checks = run_steps(dparams, plan, tparams, dcache, base, beam, end_step, threshold, decide=decide,
                                     start_step=0)
    return Draft(dcache=dcache, base=base, beam=beam, checks=checks + checked)


def draft_in_program(tparams, dparams, plan, dcache, pend_tok, pend_feat, pend_n, threshold) -> Draft:
    """The whole draft phase inside one traced program (EAGLE-2; DDD with sync "device" or "callback")."""
    return begin(tparams, dparams, plan, dcache, pend_tok, pend_feat, pend_n, threshold, end_step=plan.max_depth)


_begin_jit = jax.jit(begin, static_argnames=("plan", "end_step", "decide"))


# sync="host": each program returns the beam's confidence with it, so a check is one device->host read of values
# already computed (as the paper's `.item()`), not a logsumexp run op by op outside jit (each primitive its own
# dispatch; docs/lazy-eval.md)
def begin_host(tparams, dparams, plan, dcache, pend_tok, pend_feat, pend_n, threshold) -> tuple[Draft, jax.Array]:
    """sync="host": the draft up to its first check step, and that beam's confidence [B] (traceable; `generate`
    runs it in one program with the previous cycle's verification)."""
    d = begin(tparams, dparams, plan, dcache, pend_tok, pend_feat, pend_n, threshold, end_step=plan.check_steps[0],
              decide=False)
    return d, stop_signal(plan, d.beam)


# the named boundary of the first cycle's draft under sync="host" (later cycles run begin_host inside
# cycle._verify_commit_begin), and of `draft_from_host`
begin_host_jit = jax.jit(begin_host, static_argnames=("plan",))


@partial(jax.jit, static_argnames=("plan", "start_step", "end_step"), donate_argnames=("dcache", "beam"))
def _segment_jit(tparams, dparams, plan, dcache, base, beam, *, start_step: int, end_step: int):
    dcache, beam, _ = run_steps(dparams, plan, tparams, dcache, base, beam, end_step, jnp.float32(0), decide=False,
                                start_step=start_step)
    return dcache, beam, stop_signal(plan, beam)


def finish_from_host(tparams, dparams, plan, d: Draft, first, threshold, counter: SyncCounter) -> Draft:
    """sync="host" from the first check on: the host applies the plan's policy to `first` -- the first check's
    (confidence, active), already read -- and then runs a segment up to each next check and reads its confidence
    (one counted sync a check) until the policy stops every sequence or the last step is drafted."""
    steps = plan.check_steps
    dcache, beam = d.dcache, d.beam
    conf, active = first
    for i, step in enumerate(steps):
        if i > 0:
            conf, active = counter.read((conf, beam.active), draft=True)
        keep = _ask_policy(plan.policy, step, conf, active, threshold)
        beam = dataclasses.replace(beam, active=jnp.asarray(keep))
        if not keep.any():
            break
        end = steps[i + 1] if i + 1 < len(steps) else plan.max_depth
        dcache, beam, conf = _segment_jit(tparams, dparams, plan, dcache, d.base, beam, start_step=step,
                                          end_step=end)
    return Draft(dcache=dcache, base=d.base, beam=beam, checks=d.checks)


def draft_from_host(tparams, dparams, plan, dcache, pend_tok, pend_feat, pend_n, threshold,
                    counter: SyncCounter) -> Draft:
    """The draft phase driven from a Python loop: one jitted program, or for DDD sync="host" the paper's shape --
    a segment up to each check step, a counted host read of the confidence, and the host's decision."""
    if not plan.host_checks:
        return _begin_jit(tparams, dparams, plan, dcache, pend_tok, pend_feat, pend_n, threshold,
                          end_step=plan.max_depth)
    d, conf = begin_host_jit(tparams, dparams, plan, dcache, pend_tok, pend_feat, pend_n, threshold)
    return finish_from_host(tparams, dparams, plan, d, counter.read((conf, d.beam.active), draft=True), threshold,
                            counter)


def finished_tree(plan, d: Draft, root, ctx, length) -> Tree:
    """The tree a cycle verifies: the draft's candidate pool, plus the context-lookup candidates when the plan has
    them (`tree.lookup_chain` over `ctx`, the tokens at each position; length [B]: the root's position), reranked
    into `plan.total_tokens` nodes under `root` [B]. A sequence DDD stopped at a step-0 check keeps the best
    `plan.stop0_nodes` of the root's children (`DDDConfig.stop0_nodes`; 0: its cycle verifies the root and any
    lookup chain only)."""
    beam = d.beam
    k, keep = plan.top_k, plan.stop0_nodes
    if plan.method == "ddd" and 0 in plan.check_steps and 0 <= keep < k:  # stopped at the step-0 check: the
        # best `keep` of the root's children stay (pool[0:k] holds them best first)
        stop0 = ((beam.depth == 0) & ~beam.active)[:, None] & (jnp.arange(k) >= keep)[None]
        beam = dataclasses.replace(beam, pool_score=beam.pool_score.at[:, :k].set(
            jnp.where(stop0, -jnp.inf, beam.pool_score[:, :k])))
    if plan.gain is not None:  # the gain rule's width: each sequence keeps the nodes its best width verifies
        beam = gain.keep_best_width(plan.gain, beam, plan.total_tokens, plan.max_depth)
    if plan.lookup:  # context-lookup candidates join the head's pool before the rerank
        tok, ok = lookup_chain(ctx, length, plan.lookup, plan.lookup_ngram, LOOKUP_MAX_NGRAM)
        beam = add_lookup(beam, tok, ok, plan.lookup_logp, plan.top_k)
    return build_tree(root, beam, plan.total_tokens)
