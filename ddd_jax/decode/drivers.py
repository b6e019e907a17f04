"""The loops that run a decode after its prefill: one device loop (`cycle.spec_loop`, `cycle.vanilla_loop`), or
a Python loop over jitted cycles -- with host-synced DDD checks (sync="host"), with each phase timed
(profile=True), or streaming. The Python loops are generators that yield each cycle's new tokens and return the
final state; `api.generate` and `api.stream` consume them. Then `result` turns the state into a GenerateResult."""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from ..cache import with_length
from . import cycle as C
from . import drafting
from .drafting import SyncCounter
from .state import GenerateResult, Plan, State


class PhaseClock:
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


def run_vanilla(tparams, plan: Plan, s: State, loop: str, counter: SyncCounter, streaming: bool):
    """Vanilla decoding after the prefill; a generator yielding each step's new tokens (row 0, the prefill's token
    with the first) when streaming, returning the final state."""
    if loop == "device":
        return C.vanilla_loop(tparams, plan, s)
    shown = 0
    while True:
        s = C.vanilla_step_jit(tparams, plan, s)
        shown, new, finished = _poll(s, plan, counter, streaming, shown)
        if streaming:
            yield new
        if finished:
            return s


def _progress(s: State, streaming: bool):
    """What a Python loop reads of the state each cycle: done flags and cycle count (and the output when
    streaming)."""
    return (s.done, s.cycle, s.out, s.out_len) if streaming else (s.done, s.cycle)


def _finished(seen, plan: Plan, streaming: bool, shown: int):
    """(tokens shown, the new ones, whether decoding is over) from `_progress` values read on the host."""
    done, cyc = seen[0], seen[1]
    new = []
    if streaming:
        out, n = seen[2], seen[3]
        new = [int(t) for t in out[0, shown:int(n[0])]]
        shown = int(n[0])
    return shown, new, bool(done.all()) or int(cyc) >= plan.max_new_tokens


def _poll(s: State, plan: Plan, counter: SyncCounter, streaming: bool, shown: int):
    """The one per-cycle host sync of the Python loops: done flags (and new tokens when streaming)."""
    return _finished(counter.read(_progress(s, streaming)), plan, streaming, shown)


def run_host_checks(tparams, dparams, plan: Plan, s: State, threshold, counter: SyncCounter, streaming: bool):
    """sync="host" without the phase clock: one program per check. The read of a cycle's first check also reads
    the done flags the previous cycle's commit left (one sync for both; when decoding is over, that last read is
    the loop's and the draft it came with is dropped), so the host syncs are the checks plus one."""
    shown = 0
    d, conf = drafting.begin_host_jit(tparams, dparams, plan, s.dcache, s.pend_tok, s.pend_feat, s.pend_n,
                                      threshold)
    dlen, s = s.dcache.length, dataclasses.replace(s, dcache=None)
    while True:
        conf, active, seen = counter.read((conf, d.beam.active, _progress(s, streaming)))
        shown, new, finished = _finished(seen, plan, streaming, shown)
        if streaming:
            yield new
        if finished:
            return dataclasses.replace(s, dcache=with_length(d.dcache, dlen))
        counter.count_draft()  # the read was this cycle's first check
        d = drafting.finish_from_host(tparams, dparams, plan, d, (conf, active), threshold, counter)
        s, dlen, d, conf = C.verify_commit_begin_jit(tparams, dparams, plan, s, dlen,
                                                      dataclasses.replace(d, dcache=None), d.dcache, threshold)


def run_spec(tparams, dparams, plan: Plan, s: State, threshold, loop: str, counter: SyncCounter,
             clock: PhaseClock, streaming: bool):
    """Speculative decoding after the prefill (a generator, as `run_vanilla`)."""
    if loop == "device" and not clock.enabled:
        return C.spec_loop(tparams, dparams, plan, s, threshold)
    if plan.host_checks and not clock.enabled:
        return (yield from run_host_checks(tparams, dparams, plan, s, threshold, counter, streaming))
    shown = 0
    while True:
        if clock.enabled:  # the phases as programs of their own, each timed
            clock.start()
            d = drafting.draft_from_host(tparams, dparams, plan, s.dcache, s.pend_tok, s.pend_feat, s.pend_n,
                                         threshold, counter)
            clock.lap("draft", d)
            rest = dataclasses.replace(s, tcache=None)
            tc_new, verified, acc, key, L = C.verify_jit(tparams, plan, rest, s.tcache, d)
            clock.lap("verify", acc)
            s = C.commit_jit(plan, rest, L, tc_new, verified, acc, key, dataclasses.replace(d, dcache=None), d.dcache)
            clock.lap("commit", s)
        else:  # one fused jitted cycle per iteration
            s = C.cycle_jit(tparams, dparams, plan, s, threshold)
        shown, new, finished = _poll(s, plan, counter, streaming, shown)
        if streaming:
            yield new
        if finished:
            return s


def result(target, plan: Plan, s: State, batched: bool, counter: SyncCounter, times, prefill_s, decode_s,
            used_settings, n_rows: int | None = None):
    out = np.asarray(s.out)
    out_len = np.asarray(s.out_len)
    cycles = int(np.asarray(s.cycle))
    # DDD checks: read by the host in sync="host"; inside jitted loops otherwise (an io_callback each in "callback")
    in_loop = int(np.asarray(s.checks))
    callbacks = in_loop if plan.method == "ddd" and plan.sync == "callback" else 0
    acc_hist = np.asarray(s.acc_hist)[:cycles]
    depth_hist = np.asarray(s.depth_hist)[:cycles]
    rows_hist = np.asarray(s.rows_hist)[:cycles]
    need_hist = np.asarray(s.need_hist)[:cycles]
    n_rows = out.shape[0] if n_rows is None else n_rows  # rows past n_rows pad the batch for the mesh
    toks = [[int(t) for t in out[b, : out_len[b]]] for b in range(n_rows)]
    stats = []
    for b in range(n_rows):
        calls = acc_hist[:, b] > 0
        acc = [int(x) for x in acc_hist[calls, b]]
        dep = [int(x) for x in depth_hist[calls, b]] if plan.method != "vanilla" else []
        rows = [int(x) for x in rows_hist[calls, b]] if plan.method != "vanilla" else [1] * len(acc)
        need = [int(x) for x in need_hist[calls, b]] if plan.method != "vanilla" else [1] * len(acc)
        n_new = len(toks[b])
        st = {
            "method": plan.method, "sync": plan.sync if plan.method == "ddd" else None,
            "new_tokens": n_new, "target_calls": len(acc),
            "draft_steps": int(sum(d + 1 for d in dep)),
            "accepted_per_call": acc, "mean_accepted": float(np.mean(acc)) if acc else 0.0,
            "depth_per_call": dep, "mean_depth": float(np.mean(dep)) if dep else 0.0,
            "verified_per_call": rows, "mean_verified": float(np.mean(rows)) if rows else 0.0,
            "needed_per_call": need,
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
