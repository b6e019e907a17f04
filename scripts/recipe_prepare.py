"""What `scripts/gpu_recipe.sh prepare` reads from the records of earlier GPU runs (gpu-runs/<date>-<gpu>/):

    python scripts/recipe_prepare.py best-head gpu-runs      # the best head returned so far, or nothing
    python scripts/recipe_prepare.py check gpu-runs INPUTS.npz [LIMIT_S]   # warnings, on stderr

`best-head` prints the path of the `.tar` head among `RUNS/*/*.tar` with the highest held-out top-1 (TTT step 0)
that the `recipe.json` beside it records (`stages.heldout.heads[<name>].acc0`, else the EAGLE-3 fit's best,
`stages.eagle3.best.eval.acc0`), and its score; a head with no recorded score is never chosen. `check` predicts,
from the newest run that timed its fit (`plan.step_s`, `stages.eagle3.step_s`, else its seconds per step), the
EAGLE-3 fit's steps in a window of LIMIT_S seconds, and warns when they exceed the fit's epoch cap over the data
the inputs and the newest run's replies give: the recipe then gives the spare time to regeneration (`spare_to`).
Only the standard library is used (numpy for the inputs' size)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

MARGIN_S = 63  # recipe_call2.sh's margin and its own seconds before the recipe starts, about


def head_score(tar: Path) -> float | None:
    """Held-out top-1 at TTT step 0 of the head `tar`, as the recipe.json beside it records it."""
    rec_path = tar.parent / "recipe.json"
    if not rec_path.is_file():
        return None
    try:
        st = json.loads(rec_path.read_text()).get("stages", {})
    except ValueError:
        return None
    name = tar.name[:-len(".tar")]
    score = ((st.get("heldout") or {}).get("heads") or {}).get(name, {}).get("acc0")
    if score is None and name.endswith("-eagle3"):
        score = (((st.get("eagle3") or {}).get("best") or {}).get("eval") or {}).get("acc0")
    return None if score is None else float(score)


def best_head(runs: Path) -> tuple[Path, float] | None:
    scored = [(s, t) for t in sorted(Path(runs).glob("*/*.tar")) if (s := head_score(t)) is not None]
    return None if not scored else max(scored, key=lambda x: x[0])[::-1]


def newest_timing(runs: Path) -> tuple[dict, float] | None:
    """(recipe.json, seconds a fit step) of the newest run that fitted an EAGLE-3 head."""
    for rec_path in sorted(Path(runs).glob("*/recipe.json"), reverse=True):
        rec = json.loads(rec_path.read_text())
        e3 = rec.get("stages", {}).get("eagle3") or {}
        step_s = (rec.get("plan") or {}).get("step_s") or e3.get("step_s")
        if step_s is None and e3.get("steps"):
            step_s = e3["seconds"] / e3["steps"]
        if step_s:
            return rec, float(step_s)
    return None


def inputs_text_tokens(path: Path) -> int:
    import numpy as np
    with np.load(path, allow_pickle=False) as z:
        return int(json.loads(str(z["meta"])).get("text_tokens", 0)) if "meta" in z.files else 0


def check(runs: Path, inputs: Path, limit_s: float) -> list[str]:
    got = newest_timing(runs)
    if got is None:
        return []
    rec, step_s = got
    cfg = rec.get("config", {})
    e3 = cfg.get("eagle3", {})
    budget = limit_s - MARGIN_S
    share = (cfg.get("last_until", 0.97) - cfg.get("regen_until", 0.35)) * budget
    predicted = int(share / step_s)
    prev = rec.get("stages", {}).get("regenerate") or {}
    replies = max(0, prev.get("train_tokens", 0) - rec.get("inputs", {}).get("text_tokens", 0))
    tokens = inputs_text_tokens(inputs) + replies
    per_epoch = max(1, tokens // (e3.get("seq_len", 1024) * e3.get("batch_size", 8)))
    cap = int(e3.get("max_epochs", 2.0) * per_epoch) if e3.get("max_epochs", 2.0) else None
    if cap is not None and predicted > cap:
        return [f"the EAGLE-3 fit's predicted {predicted} steps ({step_s:.3f} s a step, {share:.0f} s of a "
                f"{limit_s:.0f} s window) exceed its epoch cap of {cap} ({e3.get('max_epochs', 2.0)} epochs of ~{tokens} tokens): "
                "regeneration will take the spare time (spare_to=regenerate); more text in the inputs, or "
                "RECIPE_EXTRA='--set spare_to=epochs', spends it on the fit instead"]
    return []


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "best-head":
        got = best_head(Path(argv[1]))
        if got is not None:
            print(f"{got[0]}\t{got[1]:.4f}")
        return 0
    if len(argv) >= 3 and argv[0] == "check":
        try:
            warnings = check(Path(argv[1]), Path(argv[2]), float(argv[3]) if len(argv) > 3 else 600.0)
        except Exception as e:  # noqa: BLE001 -- a prediction is advice; prepare goes on without it
            warnings = [f"no prediction of the fit's steps ({type(e).__name__}: {e})"]
        for w in warnings:
            print(f"prepare: warning: {w}", file=sys.stderr)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
