"""Export a trained head from a `fit` run directory (orbax checkpoint) to our head format (float16, head only)."""
from __future__ import annotations

from pathlib import Path

import jax

from .train import abstract_train_state, export_extra, load_fit_dir, restore_state, save_head, state_params


def export_run(run_dir, target, out, step: int | None = None) -> dict:
    """Restore the (latest or given) checkpoint of `run_dir` and write `out`/{config.json, model.safetensors}.

    Fails clearly if `target` is not the model the head was trained for (vocab / hidden size differ).
    Returns the provenance written into config.json["extra"].
    """
    dcfg, cfg, meta = load_fit_dir(run_dir)
    dcfg.check_target(target.config)
    state, step = restore_state(Path(run_dir) / "checkpoints", abstract_train_state(dcfg, cfg)[1], step)
    last_train, last_eval = _last_metrics(Path(run_dir) / "metrics.jsonl", step)
    extra = export_extra(meta, step, last_train, last_eval)
    save_head(target, dcfg, jax.device_get(state_params(state)), out, extra=extra)
    return extra


def _last_metrics(path: Path, upto: int):
    import json
    train = ev = None
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("step", 0) > upto:
                continue
            if r.get("split") == "eval":
                ev = r
            elif "split" not in r:
                train = r
    return train, ev
