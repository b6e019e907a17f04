"""Trees chosen for this device: `calibrate(target, draft)` (exported as `ddd_jax.calibrate`) times what a cycle
costs here, per batch size b -- the target forward at each width a tree is verified at, t_b(W), and a draft step
over a beam of k, d_b(k) -- and combines it with the head's acceptance profile (measured once on held-out prompts
and stored with the head: for each candidate tree and DDD rule, tokens per target call τ, the draft depth reached
and the rows each cycle needed, `need_hist`) into a predicted speed-up per candidate and batch size:

    E[cycle_b] = sum_W P_b(W) t_b(W) + d_b(k) (1 + E[max of b draft depths])
    speed-up   = τ · t_b(1) / E[cycle_b]                                  (vanilla: 1)

A cycle verifies the narrowest compiled width W (`decode.state.verify_widths`: 1, 2, 4, ... below N, then N) that
holds the root and valid nodes of every sequence of the batch, so with F(w) the profile's share of cycles needing
at most w rows, P_b(W_i) = F(W_i)^b - F(W_i-1)^b (sequences independent); the draft loop runs until every sequence
has stopped. A DDD stop at a step-0 check drafts nothing, so such a cycle costs t_b(1) + d_b(k).

It saves, per batch size, the best EAGLE-2 tree and DDD rule under `$DDD_JAX_CACHE/calibration/`, keyed by backend,
device (the CPU model on CPU), weight storage, target and head; `generate` without tree / ddd then uses them
(`settings.resolve`), and `stats["settings"]["source"]` says so (DDD_JAX_CALIBRATE=0 turns saved calibrations off,
and the command line's first-use calibration with them). Library calls never time anything on their own: only
`calibrate` does. When no candidate is predicted to beat vanilla at a batch size, the cheapest trees are saved and
the choice says vanilla (`recommended_method`, `vanilla_predicted_faster`); `generate`'s defaults for a method decode
as vanilla does at a batch size where none of that method's candidates is predicted to beat vanilla
(`settings.vanilla_fallback`).
"""
from __future__ import annotations

import dataclasses
import json
import time

from . import io as dio
from .config import DDDConfig, GainModel, TreeConfig, verify_widths
from .settings.calibration import (CALIBRATION_FORMAT, CALIBRATION_VERSION, PROFILE_FILE,  # noqa: F401 (re-exported)
                                   PROFILE_FORMAT, PROFILE_VERSION, calibrated_configs, calibration_path, device_key,
                                   head_id, load_calibration, load_pools, load_profile, profile_is_current, save_pools,
                                   save_profile)

# (label, method, tree, DDD rule): small trees for CPUs (where t(n) grows with n) up to EAGLE-2's paper tree
CANDIDATES = (
    ("eagle2-k1-n2-d0", "eagle2", TreeConfig(top_k=1, total_tokens=2, depth=0), DDDConfig()),
    ("eagle2-k2-n3-d1", "eagle2", TreeConfig(top_k=2, total_tokens=3, depth=1), DDDConfig()),
    ("eagle2-k4-n5-d1", "eagle2", TreeConfig(top_k=4, total_tokens=5, depth=1), DDDConfig()),
    ("eagle2-k4-n7-d2", "eagle2", TreeConfig(top_k=4, total_tokens=7, depth=2), DDDConfig()),
    ("eagle2-k4-n7-d2-lookup4", "eagle2", TreeConfig(top_k=4, total_tokens=7, depth=2, lookup=4), DDDConfig()),
    ("eagle2-k4-n8-d3", "eagle2", TreeConfig(top_k=4, total_tokens=8, depth=3), DDDConfig()),
    ("eagle2-k8-n16-d3", "eagle2", TreeConfig(top_k=8, total_tokens=16, depth=3), DDDConfig()),
    ("eagle2-k10-n32-d4", "eagle2", TreeConfig(top_k=10, total_tokens=32, depth=4), DDDConfig()),
    ("eagle2-k10-n60-d5", "eagle2", TreeConfig(), DDDConfig()),
    ("ddd-k4-n7-s0135-x-1-n6-lookup4", "ddd", TreeConfig(top_k=4, total_tokens=7, depth=2, lookup=4),
     DDDConfig(check_steps=(0, 1, 3, 5), threshold=-1.0, max_depth=6)),
    ("ddd-k4-n8-s135-x-0.5-n6", "ddd", TreeConfig(top_k=4, total_tokens=8, depth=2),
     DDDConfig(check_steps=(1, 3, 5), threshold=-0.5, max_depth=6)),
    ("ddd-k10-n60-paper", "ddd", TreeConfig(), DDDConfig()),
    # a check at step 0 at a few thresholds over small trees, keeping none of the root's children (stop0_nodes=0):
    # a cycle whose first beam is unconfident verifies the root (and any lookup chain) alone -- a vanilla step plus
    # the head's first call; and the tuned CPU rule both ways (keep: the children are verified, one row each)
    ("ddd-k2-n3-s0-x-0.3-n1-keep0", "ddd", TreeConfig(top_k=2, total_tokens=3, depth=1),
     DDDConfig(check_steps=(0,), threshold=-0.3, max_depth=1, stop0_nodes=0)),
    ("ddd-k2-n3-s0-x-1-n1-keep0", "ddd", TreeConfig(top_k=2, total_tokens=3, depth=1),
     DDDConfig(check_steps=(0,), threshold=-1.0, max_depth=1, stop0_nodes=0)),
    ("ddd-k4-n5-s01-x-0.5-n2-keep0", "ddd", TreeConfig(top_k=4, total_tokens=5, depth=1),
     DDDConfig(check_steps=(0, 1), threshold=-0.5, max_depth=2, stop0_nodes=0)),
    ("ddd-k4-n5-s01-x-1-n2-keep0", "ddd", TreeConfig(top_k=4, total_tokens=5, depth=1),
     DDDConfig(check_steps=(0, 1), threshold=-1.0, max_depth=2, stop0_nodes=0)),
    ("ddd-k4-n7-s0135-x-1-n6-lookup4-keep0", "ddd", TreeConfig(top_k=4, total_tokens=7, depth=2, lookup=4),
     DDDConfig(check_steps=(0, 1, 3, 5), threshold=-1.0, max_depth=6, stop0_nodes=0)),
    ("ddd-k4-n7-s0135-x-0.5-n6-lookup4", "ddd", TreeConfig(top_k=4, total_tokens=7, depth=2, lookup=4),
     DDDConfig(check_steps=(0, 1, 3, 5), threshold=-0.5, max_depth=6)),
    ("ddd-k4-n7-s0135-x-2-n6-lookup4", "ddd", TreeConfig(top_k=4, total_tokens=7, depth=2, lookup=4),
     DDDConfig(check_steps=(0, 1, 3, 5), threshold=-2.0, max_depth=6)),
)

# Held-out prompts for a profile measured at calibration time: general requests written for this purpose (not
# MT-bench, which the benchmarks use; not ShareGPT training data).
PROMPTS = (
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "Write a short email asking a colleague to move our meeting to Thursday afternoon.",
    "What are three good habits for writing maintainable Python code?",
    "Summarise the causes of the French Revolution in one paragraph.",
    "Give me a recipe for a quick vegetarian pasta dinner.",
    "How do vaccines train the immune system?",
    "Write a haiku about a city at night, then explain its imagery.",
    "List five tips for a first-time visitor to Tokyo.",
)


# ------------------------------------------------------------------------------------------ acceptance profile


def calibration_prompts(target) -> list | None:
    """`PROMPTS` as the target's chat renders them, or None for a target without a chat template."""
    if not getattr(target, "chat_template", None):
        return None
    return [target.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


def acceptance_profile(target, draft, prompt_ids: list | None = None, candidates=CANDIDATES,
                       max_new_tokens: int = 64, batch_size: int = 8, progress: bool = False) -> dict:
    """τ, drafted depth and rows needed per cycle (`need_hist` {rows: cycles}, each sequence's own: batch 1's) of
    each candidate over held-out prompts (acceptance only: batched, every output checked against vanilla).
    prompt_ids: token-id prompts (default: `PROMPTS`, chat-rendered)."""
    from .measure.acceptance import measure_runs
    if prompt_ids is None:
        prompt_ids = [target.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]  # (raises without a chat)
    runs = {}
    for label, method, tree, ddd in candidates:
        if draft.config.draft_vocab_size and tree.top_k > draft.config.draft_vocab_size:
            continue
        runs[label] = {"draft": draft, "method": method, "tree": tree, "ddd": ddd}
    res = measure_runs(target, prompt_ids, runs, max_new_tokens=max_new_tokens,
                       batch_size=min(batch_size, len(prompt_ids)), progress=progress)
    entries = []
    for (label, method, tree, ddd) in candidates:
        if label not in res:
            continue
        r = res[label]
        entries.append({"label": label, "method": method, "tree": tree.to_dict(),
                        "ddd": dataclasses.asdict(ddd) if method == "ddd" else None, "tau": r["tau"],
                        "mean_depth": r["mean_depth"], "depth_hist": r["depth_hist"],
                        "mean_needed": r["mean_needed"], "need_hist": r["need_hist"],
                        "identical": r["identical"], "prompts": r["prompts"]})
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "head": head_id(draft), "target": target.name,
            "prompts": len(prompt_ids), "max_new_tokens": max_new_tokens, "date": dio.utc_now(), "entries": entries}


# ------------------------------------------------------------------------------------------ prediction


def width_probs(need_hist: dict, widths, batch: int = 1) -> dict:
    """{W: P(a cycle of `batch` sequences verifies at width W)} for the compiled `widths` (ascending): the narrowest
    that holds the most rows any of the sequences needs, each drawn independently from `need_hist` {rows: cycles}
    -- P(W_i) = F(W_i)^b - F(W_i-1)^b, F the histogram's cumulative share (needs past the last width count at
    it)."""
    counts = {int(k): int(v) for k, v in need_hist.items()}
    total = sum(counts.values())
    if total <= 0:
        raise ValueError("width_probs: an empty need histogram")
    out, below = {}, 0.0
    for i, w in enumerate(widths):
        F = 1.0 if i == len(widths) - 1 else sum(c for r, c in counts.items() if r <= w) / total
        out[int(w)] = F ** batch - below
        below = F ** batch
    return out


def expected_max(hist: dict, batch: int = 1) -> float:
    """E[the largest of `batch` independent draws] from a histogram {value: count} (batch 1: its mean)."""
    counts = sorted((int(k), int(v)) for k, v in hist.items())
    total = sum(v for _, v in counts)
    if total <= 0:
        raise ValueError("expected_max: an empty histogram")
    out, below, cum = 0.0, 0.0, 0
    for value, c in counts:
        cum += c
        G = (cum / total) ** batch
        out += value * (G - below)
        below = G
    return out


def predict(profile: dict, costs: dict, batch: int = 1) -> list[dict]:
    """Predicted speed-up over vanilla of each profiled candidate for `batch` sequences decoded together, from
    `costs` = {"target_ms": {n: ms}, "draft_ms": {k: ms}, "fixed_ms": ms} measured at that batch size
    (`measure_costs`, `in_loop`), as the module docstring says: the verify forward priced at each compiled
    width with the probability that the batch's widest tree needs it (`width_probs` over the entry's `need_hist`),
    plus step 0 and the draft steps the batch's deepest sequence runs (`expected_max` over its `depth_hist`; its
    `mean_depth` without one), plus the cycle's fixed cost. An entry without
    `need_hist` (a profile measured before version 2) is an error: measure the profile again."""
    t, d = _interp(costs["target_ms"]), _interp(costs["draft_ms"])
    t1, fixed = t(1), float(costs.get("fixed_ms", 0.0))
    out = []
    for e in profile["entries"]:
        tree = e["tree"]
        if not e.get("need_hist"):
            raise ValueError(f"acceptance profile entry {e.get('label')!r} has no need_hist (rows needed per cycle; "
                             f"profiles before version {PROFILE_VERSION}): measure it again (`ddd-jax calibrate "
                             "--profile`)")
        probs = width_probs(e["need_hist"], verify_widths(tree["total_tokens"]), batch)
        verify = sum(p * t(w) for w, p in probs.items())
        steps = 1 + (expected_max(e["depth_hist"], batch) if e.get("depth_hist") else e["mean_depth"])
        draft = d(tree["top_k"]) * steps
        cycle = verify + draft + fixed
        out.append({**{k: e[k] for k in ("label", "method", "tree", "ddd", "tau", "mean_depth")},
                    "batch": batch, "width_probs": {w: round(p, 6) for w, p in probs.items()},
                    "mean_width": sum(w * p for w, p in probs.items()), "draft_steps": steps,
                    "verify_ms": verify, "draft_ms": draft, "fixed_ms": fixed, "cycle_ms": cycle,
                    "predicted_speedup": e["tau"] * t1 / cycle})
    return out


def _interp(ms: dict):
    """Linear interpolation of a cost curve given at a few sizes (clamped outside)."""
    pts = sorted((int(k), float(v)) for k, v in ms.items())

    def f(n):
        if n <= pts[0][0]:
            return pts[0][1]
        for (a, ya), (b, yb) in zip(pts, pts[1:]):
            if n <= b:
                return ya + (yb - ya) * (n - a) / (b - a)
        return pts[-1][1]
    return f


def measure_costs(target, draft, sizes, beams, repeat: int = 5, progress: bool = False, batch: int = 1) -> dict:
    """t(n) for n in `sizes` (and 1) and a draft step over a beam of k for k in `beams`, in ms, for `batch` sequences
    verified together (`measure.cost.cost_curve`, interleaved rounds). `calibrate` passes every compiled verify width
    of the profiled trees (`verify_widths`). Each cost is the median of the rounds: one slowed or lucky round
    never decides (the fastest round read t(1) 10.5 ms against a median of 15.8 ms on one host, and every wider
    width then looked 30-60% dearer than it is); the fastest rounds are kept beside them."""
    from .measure.cost import cost_curve
    ns = sorted({1, *sizes, *beams})
    cc = cost_curve(target, draft, sizes=tuple(ns), repeat=repeat, progress=progress, batch=batch)
    rows = {r["tokens"]: r for r in cc["rows"]}
    return {"target_ms": {n: rows[n]["target_ms"] for n in ns}, "draft_ms": {k: rows[k]["draft_ms"] for k in ns},
            "target_ms_min": {n: rows[n]["target_ms_min"] for n in ns},
            "draft_ms_min": {k: rows[k]["draft_ms_min"] for k in ns}, "context": cc["context"], "repeat": repeat,
            "estimate": "median of interleaved rounds"}


def alternating_medians(runs: dict, measure, rounds: int) -> dict:
    """{name: the median of `measure(arg)` over `rounds`} for runs {name: arg}: one warm-up of each first (its
    compiles), then rounds in which every run takes its turn, so a drift of the machine reaches them all alike."""
    for arg in runs.values():
        measure(arg)
    got = {k: [] for k in runs}
    for _ in range(rounds):
        for k, arg in runs.items():
            got[k].append(measure(arg))
    return {k: sorted(v)[len(v) // 2] for k, v in got.items()}


# two EAGLE-2 trees that verify the same width (every cycle alike) and differ only in draft steps: their real
# decodes price a draft step inside the loop, and with it what else a cycle costs
LOOP_TREES = (TreeConfig(top_k=4, total_tokens=5, depth=1), TreeConfig(top_k=4, total_tokens=5, depth=3))


def measure_loop(target, draft, costs: dict, batch: int = 1, rounds: int = 3, max_new_tokens: int = 48) -> dict:
    """What the cost curve's calls cost inside the decode loop, where no call pays its own dispatch. Real decodes of
    `batch` copies of the cost curve's prompt -- vanilla and EAGLE-2 over both `LOOP_TREES`, alternating (one
    warm-up each, then `rounds` each; medians of ms per cycle):

    * "scale" = a vanilla step / the curve's t_b(1): the verify forward's width costs are the curve's times this;
    * "draft_ms" = (the deeper tree's cycle - the shallower's) / their difference in steps: one draft step over a
      beam of 4 (the curve's per-call figure is mostly dispatch for a one-layer head);
    * "fixed_ms" = the shallower tree's cycle - scale * t_b(N) - its steps * draft_ms, at least 0: building the
      tree, acceptance, the commit."""
    from .decode import generate
    from .measure.cost import cost_prompt_ids
    ids = cost_prompt_ids(target)
    t = _interp(costs["target_ms"])
    shallow, deep = LOOP_TREES

    def per_cycle(tree) -> float:
        st = generate(target, draft if tree else None, [ids] * batch, max_new_tokens=max_new_tokens,
                      method="eagle2" if tree else "vanilla", tree=tree or TreeConfig(), ddd=DDDConfig()).stats
        return 1e3 * st["decode_s"] / max(st["per_sequence"][0]["target_calls"], 1)

    med = alternating_medians({"vanilla": None, "shallow": shallow, "deep": deep}, per_cycle, rounds)
    scale = med["vanilla"] / t(1)
    step = max(0.0, (med["deep"] - med["shallow"]) / (deep.depth - shallow.depth))
    fixed = med["shallow"] - scale * t(shallow.total_tokens) - (1 + shallow.depth) * step
    return {"scale": scale, "draft_ms": step, "draft_k": shallow.top_k, "fixed_ms": max(0.0, fixed),
            "cycle_ms": med, "rounds": rounds, "trees": [x.to_dict() for x in LOOP_TREES]}


def in_loop(costs: dict, loop: dict) -> dict:
    """The costs `predict` and the gain rule read: the curve's verify forwards at the loop's scale, its draft steps
    brought to the loop's step over a beam of `draft_k` (other beams in the curve's proportion), and the fixed cost
    (the curve's own figures kept as "curve_target_ms" / "curve_draft_ms")."""
    a = float(loop["scale"])
    d = _interp(costs["draft_ms"])
    b = float(loop["draft_ms"]) / max(d(loop["draft_k"]), 1e-9)
    return {**costs, "target_ms": {n: a * v for n, v in costs["target_ms"].items()},
            "draft_ms": {k: b * v for k, v in costs["draft_ms"].items()}, "fixed_ms": float(loop["fixed_ms"]),
            "curve_target_ms": costs["target_ms"], "curve_draft_ms": costs["draft_ms"], "loop": loop}


# ------------------------------------------------------------------------------------------ the gain rule
# the trees the expected-gain DDD rule is calibrated over (top_k, total_tokens); it drafts up to GAIN_DEPTH steps and
# decides after each (the recorded pools are top_k 4, GAIN_DEPTH steps: `pools_for`)
GAIN_TREES = ((4, 5), (4, 8), (4, 16))
GAIN_DEPTH = 6


def pools_for(target, draft, prompt_ids: list | None = None, progress: bool = False) -> tuple[dict | None, bool]:
    """(the head's recorded pools, measured now): stored beside its profile, else measured (seconds) on `prompt_ids`
    (default: `PROMPTS`, chat-rendered) and stored (`measure.node_acceptance.pool_records`); (None, False) for a
    target that renders no chat and no prompts given."""
    from .measure.node_acceptance import pool_records
    rec = load_pools(draft)
    if rec is not None and rec["top_k"] == GAIN_TREES[0][0] and rec["max_depth"] == GAIN_DEPTH:
        return rec, False
    prompt_ids = prompt_ids or calibration_prompts(target)
    if prompt_ids is None:
        return None, False
    rec = pool_records(target, draft, prompt_ids, top_k=GAIN_TREES[0][0], max_depth=GAIN_DEPTH, progress=progress)
    save_pools(rec, draft)
    return rec, True


def gain_model(table: dict, costs: dict, total_tokens: int, top_k: int, rate: float = 0.0) -> GainModel:
    """The gain rule's inputs for a tree of `total_tokens` from a node table (`node_acceptance.acceptance_table`)
    and one batch size's costs."""
    t, d = _interp(costs["target_ms"]), _interp(costs["draft_ms"])
    ws = verify_widths(total_tokens)
    return GainModel(table["edges"], table["accept"], table["cont"], ws, [t(w) for w in ws], d(top_k),
                     float(costs.get("fixed_ms", 0.0)), rate)


def gain_entries(pools: dict, costs: dict, rounds: int = 4) -> list[dict]:
    """Profile entries of the gain rule over `GAIN_TREES` at these costs, replayed over the recorded pools (which
    reproduce a decode's depths and widths: `node_acceptance.Replay`). Its rate -- the tokens per ms every extra
    step and row must earn -- is the replayed decode's own, found by iterating from the cycle's own ratio."""
    from .measure.node_acceptance import Replay, acceptance_table
    table = acceptance_table(pools)
    out = []
    for k, n in GAIN_TREES:
        if k != pools["top_k"]:
            continue
        replay = Replay(pools, table, costs | {"draft_ms": _interp(costs["draft_ms"])(k)}, verify_widths(n))
        rate, r = 0.0, None
        for _ in range(rounds):
            r = replay.gain(n, GAIN_DEPTH, 0.0, rate or None)
            rate = r["speedup"] / replay.t1
        r = replay.gain(n, GAIN_DEPTH, 0.0, rate)
        ddd = DDDConfig(check_steps=tuple(range(GAIN_DEPTH)), threshold=0.0, max_depth=GAIN_DEPTH, rule="gain",
                        gain=gain_model(table, costs, n, k, rate))
        out.append({"label": f"ddd-gain-k{k}-n{n}-n{GAIN_DEPTH}", "method": "ddd",
                    "tree": TreeConfig(top_k=k, total_tokens=n, depth=2).to_dict(), "ddd": ddd.to_dict(),
                    "tau": r["tau"], "mean_depth": r["mean_depth"], "depth_hist": r["depth_hist"],
                    "need_hist": r["need_hist"], "replayed": True})
    return out


def shortlist(preds: list[dict], n: int) -> list[dict]:
    """The `n` candidates with the best predicted speed-up, and the best of each method among them."""
    ranked = sorted(preds, key=lambda p: -p["predicted_speedup"])
    out = ranked[:n]
    for m in ("eagle2", "ddd"):
        best = next((p for p in ranked if p["method"] == m), None)
        if best is not None and best not in out:
            out.append(best)
    return out


def measure_cycles(target, draft, entries: list[dict], prompt_ids: list, batch: int = 1, rounds: int = 2,
                   max_new_tokens: int = 48) -> dict:
    """What a cycle of each entry (a prediction: "method", "tree", "ddd") costs in real decodes of `prompt_ids` in
    batches of `batch` (cycled to fill one), with vanilla's step: {"vanilla": ms, label: ms}, medians over `rounds`
    in which vanilla and the entries alternate (after one warm-up of each). A cycle of a batch is one target call of
    its longest-running sequence."""
    from .decode import generate
    rows = [prompt_ids[i % len(prompt_ids)] for i in range(max(batch, len(prompt_ids)))]
    groups = [rows[i:i + batch] for i in range(0, len(rows) - batch + 1, batch)]

    def per_cycle(e) -> float:
        kw = {} if e is None else {"method": e["method"], "tree": TreeConfig(**e["tree"]),
                                   "ddd": DDDConfig.from_dict(e["ddd"]) if e.get("ddd") else DDDConfig()}
        secs = calls = 0
        for g in groups:
            st = generate(target, draft if e else None, g, max_new_tokens=max_new_tokens, **kw).stats
            secs += st["decode_s"]
            calls += max(s["target_calls"] for s in st["per_sequence"])
        return 1e3 * secs / max(calls, 1)

    return alternating_medians({"vanilla": None, **{e["label"]: e for e in entries}}, per_cycle, rounds)


def pick(preds: list[dict]) -> dict:
    """The EAGLE-2 tree and DDD rule with the best speed-up -- checked where candidates were checked (the profile's
    τ over the cycle each plan costs in real decodes, `measure_cycles` over a `shortlist`; only those compete
    then), else predicted -- or, when none beats vanilla, the choice "vanilla" (`recommended_method`; `generate`'s
    defaults then decode as vanilla does) with the cheapest cycle of each method saved for explicit calls that
    leave the tree or the rule out. `best_overall`: the best
    candidate and its speed-up either way; `predicted_best`: each method's (a method whose best is below 1 decodes
    as vanilla by default, `settings.calibration.calibrated_vanilla`)."""
    measured = [p for p in preds if "checked_speedup" in p]
    key = "checked_speedup" if measured else "predicted_speedup"
    pool = measured or preds
    best = {m: max((p for p in pool if p["method"] == m), key=lambda p: p[key], default=None)
            for m in ("eagle2", "ddd")}
    said = {m: (p["label"], round(p[key], 3)) if p else None for m, p in best.items()}
    top = max((p for p in best.values() if p), key=lambda p: p[key])
    slower = top[key] < 1.0
    if slower:
        best = {m: min((p for p in preds if p["method"] == m), key=lambda p: p["cycle_ms"], default=None)
                for m in ("eagle2", "ddd")}
    tree_pick, ddd_pick = best["eagle2"] or best["ddd"], best["ddd"]
    tree = TreeConfig(**tree_pick["tree"])
    ddd = DDDConfig.from_dict(ddd_pick["ddd"]) if ddd_pick else DDDConfig()
    return {"tree": tree.to_dict(), "ddd": ddd.to_dict(),
            "ddd_tree": (TreeConfig(**ddd_pick["tree"]) if ddd_pick else tree).to_dict(),
            "recommended_method": "vanilla" if slower else top["method"], "vanilla_predicted_faster": slower,
            "best": {m: (p["label"], round(p.get(key, p["predicted_speedup"]), 3)) if p else None
                     for m, p in best.items()},
            "best_overall": (top["label"], round(top[key], 3)), "predicted_best": said,
            "chosen_by": "checked" if measured else "predicted",
            "predictions": sorted(preds, key=lambda p: -p["predicted_speedup"])}


def profile_for(target, draft, profile: dict | None, progress: bool = False) -> tuple[dict, bool | list]:
    """(the head's acceptance profile, what was measured now): `profile` when given (it must be current), else the
    stored one with any candidates added since measured and stored beside it, else all of it measured now."""
    if profile is not None:
        if not profile_is_current(profile):
            raise ValueError(f"calibrate: the profile given lacks the rows each cycle needed (`need_hist`, format "
                             f"version {PROFILE_VERSION}): measure it again with acceptance_profile")
        return profile, False
    profile, measured = load_profile(draft), False
    if not profile_is_current(profile):  # none, or measured before need histograms: all of it again
        if progress and profile is not None:
            import sys
            print(f"calibrate: the stored acceptance profile is format version {profile.get('version', 1)}; "
                  f"measuring it again (version {PROFILE_VERSION} adds the rows each cycle needs)",
                  file=sys.stderr, flush=True)
        profile, measured = acceptance_profile(target, draft, progress=progress), True
    else:  # candidates added since the profile was measured: measure those alone and keep them with the rest
        have = {e["label"] for e in profile["entries"]}
        missing = [c for c in CANDIDATES if c[0] not in have]
        if missing:
            more = acceptance_profile(target, draft, candidates=missing, progress=progress)
            profile = {**profile, "entries": profile["entries"] + more["entries"]}
            measured = [c[0] for c in missing]
    if measured:
        save_profile(profile, draft)
    return profile, measured


def check(target, draft, short: list[dict], prompt_ids: list, batch: int) -> None:
    """Give each shortlisted prediction its `checked_speedup`: the profile's τ (more prompts) over the cycle its plan
    costs in real decodes beside vanilla's step (`measure_cycles`)."""
    got = measure_cycles(target, draft, short, prompt_ids, batch=batch)
    for p in short:
        p.update(checked_cycle_ms=got[p["label"]], checked_vanilla_ms=got["vanilla"],
                 checked_speedup=p["tau"] * got["vanilla"] / got[p["label"]])


def calibrate(target, draft, *, profile: dict | None = None, save: bool = True, repeat: int = 5,
              batch_sizes=(1,), progress: bool = False, gain: bool = True, prompt_ids: list | None = None,
              measure: int = 4) -> dict:
    """Measure this device's costs, predict every profiled candidate's speed-up and pick the best EAGLE-2 tree and
    DDD rule, or vanilla (see the module docstring), for each batch size in `batch_sizes` (a batch verifies batch x
    W rows a cycle, W its widest tree's width, so bigger batches pick smaller trees, or vanilla; `generate` uses the
    smallest calibrated batch size not below its own, and decodes a larger batch as vanilla). The head's profile is
    `profile` (version 2: with need histograms), else the stored one when it is current (`profile_is_current`), else
    measured now on `PROMPTS` and stored with the head. With `gain`, the expected-gain DDD rule joins the candidates
    at each batch size, built from these costs and the head's recorded pools (`pools_for`) and predicted by replaying
    them (`gain_entries`; `prompt_ids`: the prompts pools are recorded on when the head has none, default the chat-
    rendered `PROMPTS`). Costs are medians of interleaved rounds (`measure_costs`), brought to what they cost inside
    the decode loop, with each cycle's fixed cost, by real decodes (`measure_loop`, `in_loop`). A model misses
    what a plan's own shape costs (its tree's size, its pool, its width switch), so the `measure` best-predicted
    candidates (and each method's best) are then decoded on two of the prompts beside vanilla, and the choice is
    made among them by their profile τ over the cycle time measured there (`checked_speedup`; `measure=0`: by
    prediction alone). Returns the calibration (saved under $DDD_JAX_CACHE unless save=False); its top-level
    choice is the smallest batch size's."""
    t0 = time.time()
    batch_sizes = sorted({int(b) for b in batch_sizes})
    if not batch_sizes or batch_sizes[0] < 1:
        raise ValueError(f"calibrate: batch sizes must be >= 1, got {batch_sizes}")
    profile, measured_profile = profile_for(target, draft, profile, progress)
    entries = [e for e in profile["entries"]
               if not (draft.config.draft_vocab_size and e["tree"]["top_k"] > draft.config.draft_vocab_size)]
    if not entries:
        raise ValueError("calibrate: the head's acceptance profile holds no candidate this head can draft")
    from .ops import choose_kernel_variants
    variants = choose_kernel_variants()  # once per CPU model (seconds): the faster exact tiles per row count
    pools = pools_measured = None
    vocab = draft.config.draft_vocab_size
    if gain and (not vocab or vocab >= GAIN_TREES[0][0]):
        pools, pools_measured = pools_for(target, draft, prompt_ids, progress=progress)
    check_ids = (prompt_ids or calibration_prompts(target) or [])[:2]
    by_batch = {}
    trees = [e["tree"] for e in entries] + [{"top_k": k, "total_tokens": n} for k, n in GAIN_TREES]
    widths = {w for t in trees for w in verify_widths(t["total_tokens"])}
    for b in batch_sizes:
        costs = measure_costs(target, draft, sizes=widths, beams={t["top_k"] for t in trees}, repeat=repeat,
                              progress=progress, batch=b)
        costs = in_loop(costs, measure_loop(target, draft, costs, batch=b))
        more = gain_entries(pools, costs) if pools is not None else []
        preds = predict({**profile, "entries": entries + more}, costs, batch=b)
        if measure and check_ids:
            check(target, draft, shortlist(preds, measure), check_ids, b)
        by_batch[str(b)] = {"costs": costs, **pick(preds)}
    out = {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION,
           "key": {**device_key(target), "draft": head_id(draft)},
           "date": dio.utc_now(), "seconds": round(time.time() - t0, 1), "profile_measured_now": measured_profile,
           "pools_measured_now": pools_measured,
           "profile": {k: profile.get(k) for k in ("head", "prompts", "max_new_tokens", "date")},
           "kernel_variants": None if variants is None else {k: variants.get(k) for k in ("avx2_rows", "path")},
           **by_batch[str(batch_sizes[0])], "batch": batch_sizes[0], "by_batch": by_batch}
    if save:
        p = calibration_path(target, draft)
        p.parent.mkdir(parents=True, exist_ok=True)
        dio.atomic_write_text(p, json.dumps(out, indent=1) + "\n")
        out["path"] = str(p)
    return out


# the command lines' tree / DDD flags (generate's --top-k, bench's --tree-top-k): any of them set means no calibration
TREE_FLAGS = ("top_k", "tree_top_k", "total_tokens", "depth", "ddd_checks", "ddd_threshold", "ddd_max_depth")


def cli_configs(args, target, draft, method: str):
    """A command line's (TreeConfig, DDDConfig, source) from this device's calibration, or None where its settings
    are not automatic, a tree / DDD flag was given, there is no head, or DDD_JAX_CALIBRATE=0. At first use on this
    device (no calibration saved yet) it calibrates, printing one line saying so."""
    import os
    import sys
    if (draft is None or getattr(args, "settings", "auto") != "auto" or os.environ.get("DDD_JAX_CALIBRATE") == "0"
            or any(getattr(args, k, None) is not None for k in TREE_FLAGS)):
        return None
    if load_calibration(target, draft) is None:
        c = calibrate(target, draft)
        print(f"ddd-jax: calibrated this device for {c['key']['target']} + {c['key']['draft']} in {c['seconds']} s "
              f"(recommended {c['recommended_method']}; `ddd-jax calibrate` redoes it) -> {c['path']}",
              file=sys.stderr, flush=True)
    return calibrated_configs(target, draft, method)
