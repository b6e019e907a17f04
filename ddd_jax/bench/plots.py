"""PNG plots for bench / tune / cost-curve results (matplotlib, Agg backend; every function returns its path)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _title(result: dict) -> str:
    c, e = result["config"], result["env"]
    return f"{c['target']} / {c['draft']} on {e['backend']} ({e['device']}), {c['records']} prompt turns"


def plot_methods(result: dict, path) -> Path:
    """Speedup over vanilla and tau (tokens per target call) per method."""
    labels = list(result["methods"])
    sp = [result["methods"][lb]["summary"].get("speedup") or 0.0 for lb in labels]
    tau = [result["methods"][lb]["summary"]["tau"] for lb in labels]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(labels) + 4), 4))
    for ax, vals, name in ((axes[0], sp, "speedup vs vanilla"), (axes[1], tau, "tau (tokens / target call)")):
        bars = ax.bar(range(len(labels)), vals, color="tab:blue")
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(name)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        if name.startswith("speedup"):
            ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    fig.suptitle(_title(result), fontsize=9)
    return _save(fig, path)


def plot_depth_hist(result: dict, path) -> Path | None:
    """Histogram of draft depth (draft steps per cycle) per speculative method."""
    hists = {lb: m["summary"]["depth_hist"] for lb, m in result["methods"].items() if m["summary"]["depth_hist"]}
    if not hists:
        return None
    depths = sorted({int(d) for h in hists.values() for d in h})
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(depths) * len(hists) + 3), 4))
    w = 0.8 / len(hists)
    for i, (lb, h) in enumerate(hists.items()):
        tot = sum(h.values())
        ax.bar([d + (i - (len(hists) - 1) / 2) * w for d in depths], [h.get(str(d), 0) / tot for d in depths],
               width=w, label=lb)
    ax.set_xlabel("draft steps in the cycle")
    ax.set_ylabel("fraction of target calls")
    ax.set_xticks(depths)
    ax.legend(fontsize=7)
    ax.set_title(_title(result), fontsize=9)
    return _save(fig, path)


def plot_time_split(result: dict, path) -> Path | None:
    """Draft / verify / commit milliseconds per target call (from the profile pass)."""
    prof = {lb: m["profile"] for lb, m in result["methods"].items() if m.get("profile")}
    if not prof:
        return None
    labels = list(prof)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels) + 3), 4))
    bottom = [0.0] * len(labels)
    for part, color in (("draft", "tab:orange"), ("verify", "tab:blue"), ("commit", "tab:green")):
        vals = [prof[lb][f"{part}_ms_per_call"] for lb in labels]
        ax.bar(range(len(labels)), vals, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per target call (profile pass, blocking)")
    ax.legend()
    ax.set_title(_title(result), fontsize=9)
    return _save(fig, path)


def plot_ddd_sweep(result: dict, path) -> Path | None:
    """tau and speedup vs threshold x, one line per (check steps S, max depth n); None if < 2 DDD variants."""
    pts: dict = {}  # "S=.. n=.." -> {threshold: (tau, speedup)}; sync modes take the same decisions
    for lb, m in result["methods"].items():
        sp = m["spec"]
        if sp["method"] != "ddd":
            continue
        d = sp["ddd"]
        key = f"S={'/'.join(map(str, d['check_steps']))} n={d['max_depth']}"
        cur = pts.setdefault(key, {})
        if d["threshold"] not in cur or sp["sync"] == "device":  # prefer the device-sync timing
            cur[d["threshold"]] = (m["summary"]["tau"], m["summary"].get("speedup") or 0.0)
    if sum(len(v) for v in pts.values()) < 2:
        return None
    pts = {k: sorted((x,) + v for x, v in d.items()) for k, d in pts.items()}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, v in sorted(pts.items()):
        xs = [p[0] for p in v]
        axes[0].plot(xs, [p[1] for p in v], "o-", label=key)
        axes[1].plot(xs, [p[2] for p in v], "o-", label=key)
    for lb, m in result["methods"].items():  # EAGLE-2 reference lines
        if m["spec"]["method"] == "eagle2":
            axes[0].axhline(m["summary"]["tau"], ls="--", lw=0.8, color="gray")
            axes[1].axhline(m["summary"].get("speedup") or 0.0, ls="--", lw=0.8, color="gray")
    axes[0].set_title("tau vs DDD threshold x (dashed: EAGLE-2)")
    axes[1].set_title("speedup vs DDD threshold x (dashed: EAGLE-2)")
    for ax in axes:
        ax.set_xlabel("threshold x")
        ax.legend(fontsize=7)
    fig.suptitle(_title(result), fontsize=9)
    return _save(fig, path)


def bench_plots(result: dict, out_dir) -> list[Path]:
    out = Path(out_dir)
    paths = [plot_methods(result, out / "speedup_tau.png"), plot_depth_hist(result, out / "depth_hist.png"),
             plot_time_split(result, out / "time_split.png"), plot_ddd_sweep(result, out / "ddd_sweep.png")]
    return [p for p in paths if p is not None]


def plot_tune(result: dict, path) -> Path:
    """One panel per tuner stage: speedup (bars) and tau (line) per candidate value."""
    stages = result["stages"]
    fig, axes = plt.subplots(1, len(stages), figsize=(3.2 * len(stages) + 1, 3.8), squeeze=False)
    for ax, st in zip(axes[0], stages):
        vals = [str(r["value"]) for r in st["rows"]]
        colors = ["tab:red" if r["label"] == st["best"] else "tab:blue" for r in st["rows"]]
        ax.bar(vals, [r["speedup"] or 0.0 for r in st["rows"]], color=colors)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_title(st["stage"], fontsize=9)
        ax.set_ylabel("speedup", fontsize=8)
        ax2 = ax.twinx()
        ax2.plot(vals, [r["tau"] for r in st["rows"]], "k.-")
        ax2.set_ylabel("tau", fontsize=8)
    s = result["settings"]
    fig.suptitle(f"tune on {s['meta']['backend']} ({s['meta']['device']}): best tree {s['tree']}, "
                 f"ddd {s['ddd']}", fontsize=8)
    return _save(fig, path)


def plot_cost_curve(result: dict, path, total_tokens: int | None = None) -> Path:
    """Target forward ms (and draft step ms) vs tokens per call; relative cost on a second axis."""
    rows = result["rows"]
    n = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(n, [r["target_ms"] for r in rows], "o-", label="target forward (verify n tokens)")
    if rows and "draft_ms" in rows[0]:
        ax.plot(n, [r["draft_ms"] for r in rows], "s-", label="draft step (beam of n)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(n, [str(x) for x in n])
    ax.set_xlabel("tokens per call")
    ax.set_ylabel("ms (median)")
    if rows and rows[0].get("target_rel_1"):
        ax2 = ax.twinx()
        ax2.plot(n, [r["target_rel_1"] for r in rows], "k:", label="x one-token cost")
        ax2.set_ylabel("target cost / one-token cost (break-even tau)")
    if total_tokens:
        ax.axvline(total_tokens, color="tab:red", ls="--", lw=0.8, label=f"tuned total_tokens={total_tokens}")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(f"{result['target']}: context {result['context']}, cache {result['capacity']}", fontsize=9)
    return _save(fig, path)


def plot_lazy_split(result: dict, path) -> Path:
    """lazy-eval: time per target call split into draft / sync / verify / other (commit and loop), one stacked bar
    per framework x method x sync. Sync is an estimate (host syncs per call x the measured cost of one), taken out
    of the phase it happens in; draft / verify come from the profile pass, vanilla's verify from the timed runs."""
    from ddd_jax.io import atomic_file
    rows = result["rows"]
    cost = result["sync_cost_us"]
    parts = {"draft": [], "sync": [], "verify": [], "other (commit, loop)": []}
    for r in rows:
        c = cost.get(r["framework"], 0.0) / 1e3  # ms per sync
        syncs, dsync, vsync = r["host_syncs_per_call"], r["draft_syncs_per_call"], r.get("verify_syncs_per_call", 0.0)
        draft, verify = r["draft_ms_per_call"] or 0.0, r["verify_ms_per_call"] or 0.0
        total = r["ms_per_call"] if r["method"] == "vanilla" else (r.get("profile_ms_per_call") or draft + verify)
        total = total or 0.0
        parts["draft"].append(max(draft - dsync * c, 0.0))
        parts["sync"].append(syncs * c)
        parts["verify"].append(max(verify - vsync * c, 0.0))
        parts["other (commit, loop)"].append(max(total - draft - verify - (syncs - dsync - vsync) * c, 0.0))
    labels = [r["label"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(labels) + 3), 4.5))
    bottom = [0.0] * len(labels)
    for (name, vals), color in zip(parts.items(), ("tab:orange", "tab:red", "tab:blue", "tab:gray")):
        ax.bar(range(len(labels)), vals, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per target call")
    ax.legend(fontsize=8)
    c, e = result["config"], result["env"]
    costs = ", ".join(f"{fw} {v:.1f} µs" for fw, v in cost.items())
    ax.set_title(f"{c['target']} on {c['device']} ({e.get('device')}): time per cycle; one sync = {costs}",
                 fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path
