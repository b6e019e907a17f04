"""Training curves (loss parts, top-1 accuracy, tau) from a fit run's metrics.jsonl, rendered to PNG."""
from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path) -> dict[str, list[dict]]:
    out = {"train": [], "eval": [], "tau": []}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out[r.get("split", "train")].append(r)
    return out


def plot_metrics(metrics_path, out_png) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = read_metrics(metrics_path)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    tr, ev, tau = m["train"], m["eval"], m["tau"]
    ax = axes[0]
    if tr:
        s = [r["step"] for r in tr]
        ax.plot(s, [r["loss"] for r in tr], label="train loss")
        ax.plot(s, [r["vloss"] for r in tr], label="train smooth-L1", alpha=0.7)
        ax.plot(s, [0.1 * r["ploss"] for r in tr], label="train 0.1*CE", alpha=0.7)
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="held-out loss")
    ax.set_xlabel("step"); ax.set_title("loss"); ax.legend(); ax.grid(alpha=0.3)
    ax = axes[1]
    if tr:
        ax.plot([r["step"] for r in tr], [r["acc"] for r in tr], label="train top-1")
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_acc"] for r in ev], "o-", label="held-out top-1")
    ax.set_xlabel("step"); ax.set_title("top-1 vs target argmax"); ax.legend(); ax.grid(alpha=0.3)
    ax = axes[2]
    if tau:
        ax.plot([r["step"] for r in tau], [r["tau"] for r in tau], "o-", label="tau (EAGLE-2)")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no tau measurements", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step"); ax.set_title("mean accepted tokens per target call"); ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
