"""Benchmark reports: JSON files and Markdown tables for bench, tune and cost-curve results."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from ddd_jax.io import atomic_write_text


def _kernels(env: dict) -> str:
    """'CPU kernels, ' / 'CPU kernels (AVX-512[, L2 prefetch from n rows]), ' / '' for a run's environment record."""
    if not env.get("cpu_kernels"):
        return ""
    if not env.get("cpu_kernels_avx512"):
        return "CPU kernels, "
    rows = env.get("cpu_kernels_l2_prefetch_rows")
    if not rows:  # records written before the threshold was recorded
        return "CPU kernels (AVX-512), "
    return f"CPU kernels (AVX-512, L2 prefetch from {rows} row{'s' if rows != 1 else ''}), "


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json(obj: dict, path) -> Path:
    path = Path(path)
    atomic_write_text(path, json.dumps(jsonable(obj), indent=1) + "\n")
    os.chmod(path, 0o644)  # the temp file behind the atomic write is private
    return path


def cell(x, fmt="{:.2f}") -> str:
    """A table cell: `x` formatted, or "-" for None."""
    return "-" if x is None else fmt.format(x)


def markdown_table(header: list, rows: list) -> str:
    """A Markdown table of `rows` (lists of cells) under `header`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def bench_table(result: dict) -> str:
    """Markdown: one row per method (speed, acceptance, rows verified per call, depth, syncs, time split, compile,
    identity)."""
    cfg, env = result["config"], result["env"]
    dd = cfg.get("draft_dtype")
    dd = f" ({dd} weights)" if dd and dd != cfg.get("params_dtype") else ""
    tw = cfg.get("target_weights", "")
    tw = f" ({tw})" if tw.startswith("gguf") else ""
    head = (f"**ddd-jax bench** target `{cfg['target']}`{tw}, draft `{cfg['draft']}`{dd}; {cfg['records']} prompt turns, "
            f"max_new_tokens={cfg['max_new_tokens']}, temperature={cfg['temperature']}, repeat={cfg['repeat']}; "
            f"{env['backend']} ({env.get('cpu_model') or env['device']}, {env['cpu_count']} CPUs), "
            f"jax {env['jax']}, "
            f"{_kernels(env)}{env['date']}")
    rows = []
    sampling = result["config"]["temperature"] > 0
    for lb, m in result["methods"].items():
        s, p = m["summary"], m["profile"]
        split = "-" if not p else "/".join(f"{p[k]:.1f}" for k in ("draft_ms_per_call", "verify_ms_per_call",
                                                                  "commit_ms_per_call"))
        ident = result["identity"]["methods"].get(lb)
        if lb == result["identity"].get("reference"):
            ident_s = "ref"
        elif ident is None:
            ident_s = "-"
        elif sampling:
            ident_s = f"{ident['mismatches']} differ (sampling)"
        else:
            ident_s = f"{ident['mismatches']} ({ident['real_mismatches']} real)"
        rows.append([lb, cell(s["tokens_per_s"], "{:.1f}"), cell(s.get("speedup"), "{:.3f}x"), cell(s["tau"]),
                     cell(s.get("mean_verified")), s["target_calls"], cell(s["mean_depth"]),
                     cell(s["host_syncs_per_call"]), split,
                     cell(m["compile"]["compile_s_est"], "{:.1f}"), ident_s])
    table = markdown_table(["method", "tok/s", "speedup", "tau", "rows verified/call", "target calls",
                            "mean depth", "syncs/call", "draft/verify/commit ms/call", "compile s", "mismatches"], rows)
    notes = ["- tau: tokens accepted per target call (generate's mean_accepted); rows verified/call: the rows each "
             "target call verified (mean_verified); mean depth: draft steps per call (depth_per_call); speedup: "
             "decode tok/s over vanilla's"]
    if env.get("compile_cache"):
        notes.append(f"- compile s: JAX's persistent compilation cache is on ({env['compile_cache']}): a program an "
                     "earlier run compiled is loaded instead (DDD_JAX_COMPILE_CACHE=0 compiles everything)")
    for lb, ident in ({} if sampling else result["identity"]["methods"]).items():
        for d in ident["details"][:5]:
            kind = "near-tie" if d.get("near_tie") else "REAL" if "near_tie" in d else "differs"
            notes.append(f"- {lb}: prompt {d['id']} turn {d['turn']} first differs at token {d['position']} "
                         f"({d['ref_token']} vs {d['token']}; top-2 margin {cell(d.get('margin_top2'), '{:.2e}')}, "
                         f"gap {cell(d.get('gap'), '{:.2e}')}): {kind}")
    return "\n".join([head, "", table] + ([""] + notes if notes else []))


def depth_table(result: dict) -> str:
    rows = []
    for lb, m in result["methods"].items():
        h = m["summary"]["depth_hist"]
        if h:
            rows.append([lb, ", ".join(f"{k}:{v}" for k, v in h.items())])
    return markdown_table(["method", "draft depth histogram (depth:count)"], rows) if rows else ""


def tune_table(result: dict) -> str:
    rows = []
    for st in result["stages"]:
        for r in st["rows"]:
            rows.append([st["stage"], r["value"], r["label"], cell(r["speedup"], "{:.3f}x"), cell(r["tau"]),
                         cell(r["mean_depth"]), cell(r["compile_s_est"], "{:.1f}"),
                         "*" if r["label"] == st["best"] else ""])
    s = result["settings"]
    tail = (f"\nbest: tree {s['tree']}, ddd {s['ddd']} (EAGLE-2 {s['meta']['eagle2']['speedup']:.3f}x, "
            f"DDD {s['meta']['ddd']['speedup']:.3f}x in the final run; recommended: {s['meta']['recommended_method']})")
    return markdown_table(["stage", "value", "candidate", "speedup", "tau", "mean depth", "compile s", "best"],
                          rows) + tail


def cost_table(result: dict) -> str:
    def spread(r):  # t(n) / t(1) within each interleaved round: min-max
        v = r.get("target_rel_1_rounds")
        return f"{min(v):.2f}-{max(v):.2f}" if v else ""

    rows = [[r["tokens"], cell(r["target_ms"]), cell(r["target_rel_1"]), spread(r), cell(r.get("draft_ms"))]
            for r in result["rows"]]
    env = result.get("env") or {}
    extra = ""
    if env:
        load = env.get("loadavg")
        extra = (f"; {_kernels(env) or 'CPU kernels off, '}{env.get('cpu_model') or ''}"
                 + (f", load {load[0]:.1f}" if load else ""))
    weights = f" ({result['weights']})" if result.get("weights") else ""
    forward = f", forwards returning {result['forward']}" if result.get("forward") else ""
    inputs = {"decoded": ", verifying its own greedy tokens after a decoded context",
              "synthetic": ", verifying token ids 0..n-1 after a zero cache"}.get(result.get("inputs"), "")
    return (f"cost curve: target `{result['target']}`{weights}{forward}{inputs}, context {result['context']} in a "
            f"cache of {result['capacity']} slots{extra}\n"
            + markdown_table(["tokens", "target ms", "x one token (break-even tau)", "x one token, per round",
                      "draft step ms (beam of n)"], rows))
