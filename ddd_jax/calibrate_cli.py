"""`ddd-jax calibrate`: time this device's cycle costs, combine them with the head's acceptance profile and save the
best EAGLE-2 tree and DDD rule for it per batch size, or vanilla where nothing beats it (`ddd_jax.calibrate`); and
the first-use calibration of the other commands."""
from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="pick the EAGLE-2 tree and DDD rule (or vanilla) for this device and each "
                                         "batch size (about a minute)")
    p.add_argument("--target", default="smollm2-135m-instruct", help="target name or path")
    p.add_argument("--draft", default=None, help="head name or path (default: the target's packaged head)")
    p.add_argument("--draft-dtype", default=None, help="the head's weight dtype (default: the tuned settings')")
    from .generate_cli import add_gguf_blocks_arg
    add_gguf_blocks_arg(p, "calibrate the target kept as GGUF blocks")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds of the cost curve (median)")
    p.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes to calibrate (default 1; e.g. "
                                                      "1,4,8,16: a batch verifies batch x N rows, so it picks smaller "
                                                      "trees)")
    p.add_argument("--profile", action="store_true",
                   help="measure the head's acceptance profile again (stored with the head) before calibrating")
    p.add_argument("--json", action="store_true", help="print the whole calibration as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from . import load_draft, load_target
    from .calibration import acceptance_profile, calibrate, save_profile
    from .generate_cli import DEFAULT_DRAFTS
    from .settings import cli_draft
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    try:
        batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}") from None
    if not batches or min(batches) < 1:
        raise ValueError(f"--batch-sizes must be integers >= 1, got {args.batch_sizes!r}")
    target = load_target(args.target, gguf_blocks=args.gguf_blocks)
    name = args.draft or DEFAULT_DRAFTS.get(args.target)
    if name is None:
        raise ValueError(f"calibrate needs --draft (no packaged head for target {args.target!r})")
    draft = cli_draft(load_draft(name, target), args.draft_dtype, True, args.target, name,
                      storage="blocks" if args.gguf_blocks else None)
    if args.profile:
        print(f"calibrate: measuring {name}'s acceptance profile", file=sys.stderr, flush=True)
        save_profile(acceptance_profile(target, draft, progress=True), draft)
    c = calibrate(target, draft, repeat=args.repeat, batch_sizes=batches, progress=True)
    print(json.dumps(c, indent=1) if args.json else summary(c))
    return 0


def summary(c: dict, top: int = 4) -> str:
    """The calibration per batch size: the choice, t(1), and the best predictions (τ, mean verify width, cycle, and
    the checked speed-up of those decoded beside vanilla)."""
    lines = [f"calibrated {c['key']['target']} + {c['key']['draft']} on {c['key']['device']} "
             f"({c['key']['backend']}, {c['key']['storage']} weights) in {c['seconds']} s -> {c.get('path', '')}"]
    for b, ch in c["by_batch"].items():
        t = ch["costs"]["target_ms"]
        label, x = ch.get("best_overall") or max((v for v in ch["best"].values() if v), key=lambda v: v[1])
        if ch["recommended_method"] == "vanilla":
            said = f"vanilla: no speculative setting is predicted to beat it (best: {label} {x:.2f}x)"
        else:
            how = "checked" if ch.get("chosen_by") == "checked" else "predicted"
            said = f"{ch['recommended_method']} ({label}, {how} {x:.2f}x)"
        per = ch.get("predicted_best") or ch["best"]
        defaults = ", ".join(f"{m} -> {'vanilla' if v[1] < 1.0 else m} (its best: {v[0]} {v[1]:.2f}x)"
                             for m, v in per.items() if v)
        lines.append(f"  batch {b}: t(1) = {t[min(t, key=int)]:.1f} ms; recommended {said}; "
                     f"generate's defaults: {defaults}")
        for p in ch["predictions"][:top]:
            checked = f"  checked {p['checked_speedup']:.2f}x" if "checked_speedup" in p else ""
            lines.append(f"    {p['label']:<34} tau {p['tau']:.2f}  mean width {p['mean_width']:.2f}  "
                         f"cycle {p['cycle_ms']:.1f} ms  predicted {p['predicted_speedup']:.2f}x{checked}")
    return "\n".join(lines)
