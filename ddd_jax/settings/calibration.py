"""Saved calibrations and acceptance profiles, read without measuring anything: what `settings.resolve` consults
before the shipped settings files. `ddd_jax.calibrate` measures and writes them."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
from pathlib import Path

from .. import io as dio
from ..config import DDDConfig, TreeConfig, check_tree_for_ddd

PROFILE_FORMAT = "ddd-jax-acceptance-profile"
CALIBRATION_FORMAT = "ddd-jax-calibration"
PROFILE_FILE = "profile.json"  # beside a head's config.json
# version 2: a profile holds each candidate's rows needed per cycle (`need_hist`), and a calibration prices each
# compiled verify width per batch size from it; older files are measured again, never read as if they had them
PROFILE_VERSION = 3  # 3: DDD candidates name stop0_nodes
CALIBRATION_VERSION = 4  # 4: median costs, the per-cycle fixed cost, the gain rule
POOLS_FILE = "pools.npz"  # beside a head's profile: its drafted pools, labelled (`measure.node_acceptance`)


def weight_storage(target) -> str | None:
    """The settings key of a target's weight storage: "blocks" when its matrices are GGUF blocks, None for float
    weights (row-major or panel-major arrays)."""
    from ..backends.cpu import quant
    return "blocks" if quant.has_blocks(getattr(target, "params", {})) else None


def device_key(target) -> dict:
    """What a calibration is for: backend, device (the CPU model on CPU), weight storage, target and head."""
    import jax
    backend = jax.default_backend()
    dev = jax.devices()[0]
    kind = cpu_model() if backend == "cpu" else getattr(dev, "device_kind", str(dev))
    from ..backends.cpu import quant
    int8 = quant.has_int8_blocks(getattr(target, "params", {}))  # integer products: their own cost curve
    return {"backend": backend, "device": kind, "storage": "blocks-int8" if int8 else weight_storage(target) or "float",
            "target": getattr(target, "name", None)}


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The CPU's model name (read once a process: `generate` keys its calibration lookup by it)."""
    from ..backends.cpu.kernels import cpu_model as from_proc
    return from_proc() or platform.processor() or platform.machine()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def calibration_path(target, draft) -> Path:
    """Where this device's calibration for target + head lives (it may not exist). A head stored in another dtype
    than float32 (`Draft.astype`: float16, q8_0, ...) drafts at another cost, so it has a calibration of its own."""
    from ..checkpoints.registry import cache_root
    key = {**device_key(target), "draft": head_id(draft)}
    dtype = getattr(draft, "weight_dtype", "float32")
    if dtype != "float32":  # (float32 heads keep the keys they always had)
        key["draft_dtype"] = dtype
    slug = _slug("-".join(str(key[k]) for k in ("backend", "storage", "target", "draft", "draft_dtype") if k in key))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return cache_root() / "calibration" / f"{slug}-{digest}.json"


def head_id(draft) -> str:
    """A head's name (what it was loaded as), or for an unnamed one "unnamed-" and a digest of its config. A head
    retrained in place keeps its key: recalibrate it (`ddd-jax calibrate --profile`)."""
    if getattr(draft, "name", None):
        return str(draft.name)
    return "unnamed-" + hashlib.sha256(json.dumps(draft.config.to_dict(), sort_keys=True).encode()).hexdigest()[:10]


def load_calibration(target, draft) -> dict | None:
    """This device's saved calibration for target + head, or None (never measures)."""
    p = calibration_path(target, draft)
    if not p.is_file():
        return None
    try:
        c = dio.read_json(p)
    except (ValueError, OSError):
        return None
    if c.get("format") != CALIBRATION_FORMAT or c.get("version") != CALIBRATION_VERSION:
        return None  # another format, or an older calibration (priced every cycle at the full tree): redo it
    return c


def profile_is_current(profile: dict | None) -> bool:
    """Whether a stored acceptance profile has what `calibration.predict` reads: this format version and, for every
    candidate, the rows its cycles needed (`need_hist`). An older profile is measured again, not misread."""
    return (profile is not None and int(profile.get("version", PROFILE_VERSION)) >= PROFILE_VERSION
            and all(e.get("need_hist") for e in profile.get("entries", ())))


def head_dir(draft) -> Path | None:
    """The directory a head was loaded from (a packaged name or a path), when it has one."""
    from ..checkpoints.registry import HEADS_DIR, NAMED_DRAFTS
    name = getattr(draft, "name", None)
    if name is None:
        return None
    if name in NAMED_DRAFTS:
        return HEADS_DIR / NAMED_DRAFTS[name]
    p = Path(str(name))
    return p if (p / "config.json").is_file() else None


def _cached_profile_path(draft) -> Path:
    from ..checkpoints.registry import cache_root
    return cache_root() / "profiles" / f"{_slug(head_id(draft))}.json"


def _pools_paths(draft) -> list[Path]:
    """Where the head's pools may be: beside it, then in the cache beside its cached profile."""
    own = head_dir(draft)
    cached = _cached_profile_path(draft)
    return ([own / POOLS_FILE] if own else []) + [cached.with_name(f"{cached.stem}-{POOLS_FILE}")]


def _beside_head(draft, name: str, cached: Path) -> Path:
    """`name` in the head's own directory when it has one that is writable, else `cached`."""
    own = head_dir(draft) if draft is not None else None
    return own / name if own is not None and os.access(own, os.W_OK) else cached


def load_pools(draft) -> dict | None:
    """The head's recorded pools (`measure.node_acceptance.pool_records`) beside its profile, or None."""
    import numpy as np
    for p in _pools_paths(draft):
        if p.is_file():
            try:
                with np.load(p) as z:
                    rec = {k: z[k] for k in z.files}
            except (OSError, ValueError) as e:
                raise ValueError(f"{p}: not a readable pools file ({e}); delete it to measure it again") from e
            for k in ("top_k", "max_depth", "prompts"):
                rec[k] = int(rec[k])
            return rec
    return None


def save_pools(records: dict, draft) -> Path:
    """Write recorded pools beside the head (a writable head directory), else under $DDD_JAX_CACHE/profiles/."""
    import numpy as np
    path = _beside_head(draft, POOLS_FILE, _pools_paths(draft)[-1])
    with dio.atomic_file(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, **records)
    return path


def load_profile(draft) -> dict | None:
    """The head's stored acceptance profile: beside its config.json, else in $DDD_JAX_CACHE/profiles/."""
    for p in ([head_dir(draft) / PROFILE_FILE] if head_dir(draft) else []) + [_cached_profile_path(draft)]:
        if p.is_file():
            prof = dio.read_json(p)
            if prof.get("format") != PROFILE_FORMAT:
                raise ValueError(f"{p}: not an acceptance profile (format {prof.get('format')!r})")
            return prof
    return None


def save_profile(profile: dict, draft=None, path=None) -> Path:
    """Write a profile beside the head (a writable head directory), else under $DDD_JAX_CACHE/profiles/."""
    if path is None:
        path = _beside_head(draft, PROFILE_FILE, _cached_profile_path(draft))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dio.atomic_write_text(path, json.dumps(profile, indent=1) + "\n")
    return path


def calibrated_choice(target, draft, batch: int = 1):
    """(choice, size, calibration) from this device's saved calibration: the choice made for `size`, the smallest
    calibrated batch size not below `batch` (a larger batch verifies more rows a cycle, so its choice is the safe
    one), with choice None when `batch` exceeds every calibrated size (nobody measured what it costs); None without
    a calibration or with DDD_JAX_CALIBRATE=0 (which turns calibrations off)."""
    if os.environ.get("DDD_JAX_CALIBRATE") == "0":
        return None
    c = load_calibration(target, draft)
    if c is None:
        return None
    sizes = calibrated_sizes(c)
    above = [b for b in sizes if b >= batch]
    if not above:
        return None, max(sizes), c
    return c.get("by_batch", {}).get(str(above[0]), c), above[0], c


def calibrated_sizes(c: dict) -> list[int]:
    """The batch sizes a calibration measured, ascending."""
    return sorted(int(b) for b in c.get("by_batch", {})) or [int(c.get("batch", 1))]


METHOD_NAMES = {"eagle2": "EAGLE-2", "ddd": "DDD"}


def calibrated_vanilla(target, draft, batch: int = 1, method: str = "ddd") -> str | None:
    """Why this device's calibration says `method` decodes a batch of `batch` fastest as vanilla does, else None:
    no speculative candidate is predicted to beat vanilla at that batch size, or none of `method`'s (the other
    method's best is then named)."""
    got = calibrated_choice(target, draft, batch)
    if got is None:
        return None
    choice, size, c = got
    where = f"at batch {batch} on {c['key']['device']}"
    if choice is None:
        return (f"batch {batch} is larger than every batch size calibrated on {c['key']['device']} "
                f"({', '.join(map(str, calibrated_sizes(c)))}), so what its cycles cost was never measured: "
                f"`ddd-jax calibrate --batch-sizes {','.join(map(str, calibrated_sizes(c) + [batch]))}` measures it")
    at = "" if size == batch else f", calibrated at batch {size}"
    if choice.get("recommended_method") == "vanilla":
        best = choice.get("best_overall")  # (label, predicted speed-up) of the best candidate
        said = f" (best: {best[0]} {best[1]:.2f}x{at})" if best else (f" ({at[2:]})" if at else "")
        return f"no speculative setting is predicted to beat vanilla {where}{said}"
    mine = (choice.get("predicted_best") or {}).get(method)
    if mine is None or mine[1] >= 1.0:
        return None
    other = {m: b for m, b in choice["predicted_best"].items() if m != method and b}
    also = "".join(f"; {METHOD_NAMES.get(m, m)}'s {b[0]} {b[1]:.2f}x" for m, b in other.items())
    return (f"no {METHOD_NAMES.get(method, method)} setting is predicted to beat vanilla {where} (best: {mine[0]} "
            f"{mine[1]:.2f}x{at}{also})")


def calibrated_configs(target, draft, method: str = "ddd", batch: int = 1):
    """(TreeConfig, DDDConfig, source) from this device's saved calibration, or None (also with DDD_JAX_CALIBRATE=0,
    which turns calibrations off). For method "ddd" the tree is the one DDD's rule was profiled with; `batch`: the
    choice calibrated for the smallest batch size not below it (past them all: the largest one's, which `generate`'s
    defaults do not use -- `calibrated_vanilla` says why)."""
    got = calibrated_choice(target, draft, batch)
    if got is None:
        return None
    choice, size, c = got
    if choice is None:  # past every calibrated size: the largest one's settings for calls that name a tree or rule
        choice = c.get("by_batch", {}).get(str(size), c)
    sizes = c.get("by_batch", {}) or [size]
    try:  # a file written by a version whose configs had other fields is not used (a calibration redoes it)
        tree = TreeConfig(**(choice["ddd_tree"] if method == "ddd" else choice["tree"]))
        ddd = DDDConfig.from_dict(choice["ddd"])
        if method == "ddd":  # EAGLE-2 reads no DDD rule (the one returned is DDD's, with its own tree)
            check_tree_for_ddd(tree, ddd)
    except (TypeError, ValueError, KeyError):
        return None
    note = "; vanilla is predicted to be as fast here" if choice.get("vanilla_predicted_faster") else ""
    at = f", batch {size}" if len(sizes) > 1 else ""
    return tree, ddd, f"calibrated on {c['key']['device']} ({c['date']}{at}, {calibration_path(target, draft)}){note}"


def calibrated_rule(target, draft, rule: str = "gain", batch: int = 1):
    """(TreeConfig, DDDConfig, label) of the DDD candidate of `rule` ("gain", "threshold", ...) that this device's
    calibration predicted best at `batch` (its choice for that batch, `calibrated_choice`), or None -- for research
    runs that name a rule calibration did not pick."""
    got = calibrated_choice(target, draft, batch)
    if got is None or got[0] is None:
        return None
    preds = [p for p in got[0].get("predictions", ()) if p.get("method") == "ddd" and p.get("ddd")
             and p["ddd"].get("rule", "threshold") == rule]
    if not preds:
        return None
    best = max(preds, key=lambda p: p["predicted_speedup"])
    try:
        return TreeConfig(**best["tree"]), DDDConfig.from_dict(best["ddd"]), best["label"]
    except (TypeError, ValueError, KeyError):
        return None
