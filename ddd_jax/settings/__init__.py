"""Tuned decoding settings per JAX backend: `ddd_jax/settings/<backend>.json`, written by `ddd-jax tune`.

File layout (one JSON object)::

    {"tree": {"top_k": 4, "total_tokens": 8, "depth": 3},   (optional: "lookup", "lookup_ngram", "lookup_logp")
     "ddd":  {"check_steps": [2, 4], "threshold": -0.6, "max_depth": 6},
     "draft_dtype": "float16",   (optional: the head's weight dtype the CLIs load it in, see `draft_dtype`)
     "meta": {"backend": "cpu", "device": "...", "target": "...", "draft": "...", "date": "...",
              "objective": "speedup vs vanilla", "eagle2_speedup": 1.3, "ddd_speedup": 1.4, ...}}

`load_settings()` returns that dict (None when no file exists for the backend); `to_configs()` turns it into
(`TreeConfig`, `DDDConfig`); `resolve()` is what `generate` does when it is not given a tree or DDD settings:
the tuned settings of this backend when they were tuned for this target and head (or name no pair), else the
paper's defaults -- and a sentence saying which and why (and, for settings tuned on another kind of device of
the same backend, on which: `other_device`). `$DDD_JAX_SETTINGS_DIR` overrides the directory.

Settings are also keyed by how the target stores its weights, since that moves the cost of verifying several tokens
(`weight_storage`): a target kept as GGUF blocks (`load_target(..., gguf_blocks=True)`) reads
`<backend>-blocks.json` (`ddd-jax tune --gguf-blocks` writes it; without one, `<backend>.json`), a float target
`<backend>.json`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .calibration import weight_storage  # noqa: F401 (part of this package's API)

SETTINGS_DIR = Path(__file__).parent
TREE_KEYS = ("top_k", "total_tokens", "depth")
TREE_OPTIONAL = ("lookup", "lookup_ngram", "lookup_logp")  # context-lookup candidates (TreeConfig), default off
DRAFT_DTYPES = ("float32", "float16", "bfloat16", "q8_0", "q4_0", "q4_1")  # the last: GGUF blocks (Draft.astype)
DDD_KEYS = ("check_steps", "threshold", "max_depth")


def settings_dir() -> Path:
    env = os.environ.get("DDD_JAX_SETTINGS_DIR")
    return Path(env) if env else SETTINGS_DIR


STORAGES = (None, "blocks")  # float weights (arrays or panels) / GGUF blocks


def settings_path(backend: str | None = None, storage: str | None = None) -> Path:
    if storage not in STORAGES:
        raise ValueError(f"weight storage must be one of {STORAGES}, got {storage!r}")
    if backend is None:
        import jax
        backend = jax.default_backend()
    return settings_dir() / (f"{backend}.json" if storage is None else f"{backend}-{storage}.json")


def validate(settings: dict) -> dict:
    """Check the keys and build the configs once (raises ValueError on anything malformed); returns settings."""
    if not isinstance(settings, dict) or "tree" not in settings or "ddd" not in settings:
        raise ValueError("settings must be a dict with 'tree' and 'ddd' entries")
    for part, keys, optional in (("tree", TREE_KEYS, TREE_OPTIONAL), ("ddd", DDD_KEYS, ())):
        got = set(settings[part])
        if not set(keys) <= got <= set(keys) | set(optional):
            more = f" (optionally {list(optional)})" if optional else ""
            raise ValueError(f"settings[{part!r}] must have exactly the keys {list(keys)}{more}, got {sorted(got)}")
    if settings.get("draft_dtype") not in (None, *DRAFT_DTYPES):
        raise ValueError(f"settings['draft_dtype'] must be one of {list(DRAFT_DTYPES)}, got {settings['draft_dtype']!r}")
    to_configs(settings)
    return settings


def load_settings(backend: str | None = None, path: str | os.PathLike | None = None,
                  storage: str | None = None) -> dict | None:
    """Tuned settings for `backend` (default: jax.default_backend()) and weight `storage`, or None if none were
    saved.

    Returns {"tree": {top_k, total_tokens, depth}, "ddd": {check_steps, threshold, max_depth}, "meta": {...}}.
    A file that exists but is malformed raises ValueError (never silently ignored)."""
    p = Path(path) if path is not None else settings_path(backend, storage)
    if not p.is_file():
        return None
    try:
        settings = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"settings file {p} is not valid JSON: {e}") from e
    try:
        return validate(settings)
    except (ValueError, TypeError) as e:
        raise ValueError(f"settings file {p}: {e}") from e


def save_settings(settings: dict, backend: str | None = None, path: str | os.PathLike | None = None,
                  storage: str | None = None) -> Path:
    """Validate and write settings atomically; returns the path written."""
    from ..io import atomic_write_text
    validate(settings)
    p = Path(path) if path is not None else settings_path(backend, storage)
    s = dict(settings)
    s["ddd"] = {**s["ddd"], "check_steps": [int(x) for x in s["ddd"]["check_steps"]]}
    atomic_write_text(p, json.dumps(s, indent=2) + "\n")
    os.chmod(p, 0o644)  # package data: readable by all (the atomic write's temp file is private)
    return p


def to_configs(settings: dict):
    """(TreeConfig, DDDConfig) from a settings dict."""
    from ..config import DDDConfig, TreeConfig, check_tree_for_ddd
    t, d = settings["tree"], settings["ddd"]
    extra = {k: (float(t[k]) if k == "lookup_logp" else int(t[k])) for k in TREE_OPTIONAL if k in t}
    tree = TreeConfig(top_k=int(t["top_k"]), total_tokens=int(t["total_tokens"]), depth=int(t["depth"]), **extra)
    ddd = DDDConfig(check_steps=tuple(int(x) for x in d["check_steps"]), threshold=float(d["threshold"]),
                    max_depth=int(d["max_depth"]))
    check_tree_for_ddd(tree, ddd)
    return tree, ddd


def tuned_for(target_name: str | None, draft_name: str | None, backend: str | None = None,
              storage: str | None = None):
    """(settings or None, reason): this backend's tuned settings for this weight storage if they fit this target/head
    pair.

    Settings whose meta names a target (or head) apply only to that target (head); settings naming none apply to
    every pair on the backend. Without a file for this storage, the float weights' file (saying so)."""
    s = load_settings(backend, storage=storage)
    where = settings_path(backend, storage)
    note = ""
    if s is None and storage is not None:
        s, missing = load_settings(backend), where
        where = settings_path(backend)
        note = f"; no {missing.name} for {storage} weights, so the float weights' settings"
    if s is None:
        return None, f"no tuned settings for this backend ({where})"
    meta = s.get("meta", {})
    for what, want, got in (("target", meta.get("target"), target_name), ("draft", meta.get("draft"), draft_name)):
        if want is not None and want != got:
            return None, f"{where} was tuned for {what} {want!r}, not {got!r}"
    pair = " + ".join(str(x) for x in (meta.get("target"), meta.get("draft")) if x) or "any target"
    return s, f"tuned for {pair} (settings file {where}{note}){other_device(meta, backend)}{slower_than_vanilla(meta)}"


def other_device(meta: dict, backend: str | None = None) -> str:
    """A note for `source` when settings for the running backend were tuned on another kind of device (e.g. a GPU
    file tuned on an H200, read on an A100: settings are keyed by backend, and the best tree follows the device's
    costs), else ""."""
    import jax
    tuned = meta.get("device")
    if not tuned or (backend is not None and backend != jax.default_backend()):
        return ""
    here = getattr(jax.devices()[0], "device_kind", None)
    if here is None or here == tuned:
        return ""
    return f"; tuned on {tuned}, this is {here}: `ddd-jax tune` re-tunes for it"


def slower_than_vanilla(meta: dict) -> str:
    """A warning for `source` when the tuner measured every speculative method slower than vanilla with these
    settings (e.g. GGUF blocks on a CPU, where one token is cheap and several are not), else ""."""
    speeds = {m: meta[m]["speedup"] for m in ("eagle2", "ddd") if isinstance(meta.get(m), dict)
              and isinstance(meta[m].get("speedup"), (int, float))}
    if not speeds or max(speeds.values()) >= 1.0:
        return ""
    said = ", ".join(f"{'EAGLE-2' if m == 'eagle2' else 'DDD'} {v:.2f}x" for m, v in speeds.items())
    return f"; the tuner measured {said} of vanilla with them: vanilla decoding is faster here"


def measured_slower(meta: dict, method: str | None = None) -> str | None:
    """Why settings whose tuning runs measured `method` (None: every speculative method) below vanilla decode as
    vanilla by default (e.g. "the tuner measured EAGLE-2 0.81x, DDD 0.92x of vanilla with them on cpu"), else
    None."""
    speeds = {m: meta[m]["speedup"] for m in ("eagle2", "ddd") if isinstance(meta.get(m), dict)
              and isinstance(meta[m].get("speedup"), (int, float))}
    slow = speeds.get(method) if method is not None else (max(speeds.values()) if speeds else None)
    if slow is None or slow >= 1.0:
        return None
    said = ", ".join(f"{'EAGLE-2' if m == 'eagle2' else 'DDD'} {v:.2f}x" for m, v in speeds.items())
    return f"the tuner measured {said} of vanilla with them" + (f" on {meta['device']}" if meta.get("device") else "")


def vanilla_fallback(target, draft, method: str = "ddd", batch: int = 1, backend: str | None = None) -> str | None:
    """Why the defaults decode a batch of `batch` sequences as vanilla does under `method`, or None: what
    `generate` without tree, ddd or policy consults after `resolve`. The settings `resolve` takes decide: this
    device's calibration when it is used (`calibration.calibrated_vanilla`: no candidate of `method` -- or of any
    method -- is predicted to beat vanilla at this batch size), else the tuned settings file for this pair when its
    tuning runs measured `method` below vanilla (`measured_slower`); the paper's defaults never fall back."""
    if draft is None or method == "vanilla":
        return None
    if backend is None:
        from .calibration import calibrated_configs, calibrated_vanilla
        if calibrated_configs(target, draft, method, batch) is not None:  # the calibration is what resolve uses
            return calibrated_vanilla(target, draft, batch, method)
    s, _ = tuned_for(getattr(target, "name", None), getattr(draft, "name", None), backend, weight_storage(target))
    if s is None:
        return None
    return measured_slower(s.get("meta", {}), method)  # `source` names the file


def draft_dtype(target_name: str | None, draft_name: str | None, backend: str | None = None,
                storage: str | None = None) -> str | None:
    """The weight dtype this backend's tuned settings load this head in (e.g. "float16" on CPU, where the kernels
    read a float16 head at half the bytes), or None: as stored. Applied by the CLIs (`--settings auto`); in the
    library it is explicit -- `load_draft(..., dtype=...)` or `Draft.astype`."""
    s, _ = tuned_for(target_name, draft_name, backend, storage)
    return None if s is None else s.get("draft_dtype")


def cli_draft(draft, explicit: str | None, use_tuned: bool, target_name: str | None, draft_name: str | None,
              storage: str | None = None):
    """A CLI's head in the dtype it asked for (`--draft-dtype`), else with `--settings auto` the tuned one."""
    dtype = explicit or (draft_dtype(target_name, draft_name, storage=storage) if use_tuned else None)
    return draft.astype(dtype) if (draft is not None and dtype) else draft


def base_configs(target_name: str | None, draft_name: str | None, use_tuned: bool = True, backend=None,
                 storage: str | None = None):
    """(TreeConfig, DDDConfig, source) before any explicit setting: tuned for this pair (and weight storage), else
    the paper's."""
    from ..config import DDDConfig, TreeConfig
    if not use_tuned:
        return TreeConfig(), DDDConfig(), "paper defaults"
    s, why = tuned_for(target_name, draft_name, backend, storage)
    if s is None:
        return TreeConfig(), DDDConfig(), f"paper defaults: {why}"
    return (*to_configs(s), why)


def resolve(target, draft, tree=None, ddd=None, backend: str | None = None, method: str = "ddd", batch: int = 1):
    """(TreeConfig, DDDConfig, source): explicit configs win; what is missing comes from this device's calibration
    for this target and head (`ddd_jax.calibrate`) when one was saved, else the tuned settings of this backend, this
    target's weight storage (`weight_storage`) and this target/head pair when they exist, else from the paper's
    defaults (EAGLE-2: top_k 10, 60 tokens, depth 5; DDD: S={5,7,9}, x=-0.3, n=11). `source` says
    which, and why.

    Settings compose: a method other than "ddd" never consults a DDD rule (the one returned is unused). For "ddd",
    an explicit tree takes the tuned DDD rule when it fits that tree (`check_tree_for_ddd`), else the paper's; an
    explicit rule takes the tuned tree when it fits, else the paper's; a conflict left after that is an error
    naming both sources. batch: the sequences decoded together (a calibration may hold a choice per batch size)."""
    from ..config import DDDConfig, TreeConfig, check_tree_for_ddd
    if tree is not None and ddd is not None:
        return tree, ddd, "explicit"
    cal = None
    if backend is None and draft is not None:  # this device's calibration (`ddd_jax.calibrate`), when one was saved
        from .calibration import calibrated_configs
        cal = calibrated_configs(target, draft, method, batch)
    if cal is not None:
        base_tree, base_ddd, source = cal
    else:
        base_tree, base_ddd, source = base_configs(getattr(target, "name", None), getattr(draft, "name", None),
                                                   backend=backend, storage=weight_storage(target))
    if method != "ddd":
        if tree is not None:
            return tree, ddd or base_ddd, f"explicit tree ({method} uses no DDD rule)"
        return base_tree, ddd or base_ddd, source
    if tree is None and ddd is None:
        return base_tree, base_ddd, source

    def first_fit(pairs, what: str, other: str):
        """The first (tree, rule, source) of `pairs` that passes `check_tree_for_ddd`, else an error naming both."""
        for t, d, why in pairs:
            try:
                check_tree_for_ddd(t, d)
                return t, d, f"explicit {what}, the {other} from {why}"
            except ValueError as e:
                err = e
        raise ValueError(f"{err}: the explicit {what} fits neither the {other} from {source} nor the paper's; pass "
                         f"both tree= and ddd=") from None

    if tree is not None:
        return first_fit([(tree, base_ddd, source), (tree, DDDConfig(), "paper defaults")], "tree", "DDD rule")
    return first_fit([(base_tree, ddd, source), (TreeConfig(), ddd, "paper defaults")], "ddd", "tree")
