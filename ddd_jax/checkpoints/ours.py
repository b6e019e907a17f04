"""Our own checkpoint formats: the target directory (also the named-model cache) and the EAGLE draft-head directory.

Target (`TARGET_FORMAT`), a directory:
    config.json            HF-style LlamaConfig fields + {"format": "ddd-jax-target", "format_version", "name"}
    model.safetensors      flat keys of `llama.param_shapes` ('.'-joined, e.g. "layers.wq")
    tokenizer.json         (optional) a `tokenizers` tokenizer
    tokenizer_config.json  (optional) {"chat_template": ..., "bos_token": ..., "eos_token": ...}
Draft head (`HEAD_FORMAT`), a directory:
    config.json            {"format": "ddd-jax-eagle-head", "format_version", "draft_config": {...}, "extra"?}
    model.safetensors      flat keys of `eagle.param_shapes` (the target's embed / lm_head are not stored)
Both are written atomically: a directory exists whole or not at all.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .. import io as dio
from .. import llama
from ..backends.cpu import quant
from ..config import DraftConfig, ModelConfig
from ..eagle import Draft
from ..target import Target
from .hf import _placer, read_tokenizer_files
from .keytable import check_shapes, resolve_dtype
from .safetensors import load_safetensors, safetensors_sources, save_safetensors, write_safetensors

TARGET_FORMAT = "ddd-jax-target"
TARGET_FORMAT_VERSION = 1
HEAD_FORMAT = "ddd-jax-eagle-head"
HEAD_FORMAT_VERSION = 1


# ---------------------------------------------------------------------------------------------------------
# Targets


def save_target(target: Target, path, dtype=None, extra: dict | None = None) -> None:
    """Write `target` in our format, atomically (the directory exists whole or not at all)."""
    dt = resolve_dtype(dtype)
    with dio.atomic_dir(path) as tmp:
        cfg = target.config.to_hf_config()
        cfg.update({"format": TARGET_FORMAT, "format_version": TARGET_FORMAT_VERSION, "name": target.name})
        if extra:
            cfg.update(extra)
        flat = {k: quant.as_float(v) for k, v in dio.flatten(target.params).items()}  # GGUF blocks: saved as floats
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


def load_target_dir(path, dtype=None, name: str | None = None, mesh=None) -> Target:
    """A Target from a directory in our target format (dtype None keeps the stored dtype), sharded over `mesh`
    tensor by tensor when given."""
    path = Path(path)
    raw = dio.read_json(path / "config.json")
    if raw.get("format") != TARGET_FORMAT:
        raise ValueError(f"{path}/config.json is not a {TARGET_FORMAT} directory (format={raw.get('format')!r})")
    if raw.get("format_version", 1) > TARGET_FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {raw['format_version']} is newer than this ddd-jax understands")
    cfg = ModelConfig.from_hf_config(raw)
    st = path / "model.safetensors"
    if not st.is_file():
        raise FileNotFoundError(f"{path}: no model.safetensors")
    sources = {s.name: s for s in safetensors_sources(st)}  # memory-mapped: read one tensor at a time
    check_shapes(dio.unflatten(sources), llama.param_shapes(cfg), f"target {path}")
    dt = resolve_dtype(dtype)
    if mesh is None:
        params = dio.unflatten({k: jnp.asarray(s.load()) if dt is None else jnp.asarray(s.load()).astype(dt)
                                for k, s in sources.items()})
    else:  # each tensor cast on the host and sent straight to its shards
        place = _placer(cfg, mesh)
        params = dio.unflatten({k: place(k, s.load() if dt is None else np.asarray(s.load()).astype(dt))
                                for k, s in sources.items()})
    tok, template, special = read_tokenizer_files(path)
    return Target(name or raw.get("name") or path.name, cfg, params, tok, template, special, mesh=mesh)


# ---------------------------------------------------------------------------------------------------------
# Draft heads


def save_draft(draft: Draft, path, dtype=None, extra: dict | None = None) -> None:
    """Write our head format (config.json + model.safetensors) atomically: a directory that either exists whole or not at all."""
    params = quant.dequantize_tree(dict(draft.params))  # a head stored as GGUF blocks: saved as its float values
    if dtype is not None:
        params = {k: jax.tree.map(lambda x: np.asarray(x).astype(np.int32 if k == "d2t" else dtype), v)
                  for k, v in params.items()}
    with dio.atomic_dir(path) as tmp:
        cfg = {"format": HEAD_FORMAT, "format_version": HEAD_FORMAT_VERSION, "draft_config": draft.config.to_dict()}
        if extra:
            cfg["extra"] = extra
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        save_safetensors(jax.tree.map(np.asarray, params), tmp / "model.safetensors")


def load_draft_dir(path, target, dtype=None) -> Draft:
    """A Draft bound to `target` from a directory in our head format (dtype defaults to the target's)."""
    path = Path(path)
    meta = dio.read_json(path / "config.json")
    if meta.get("format") != HEAD_FORMAT:
        raise ValueError(f"{path}/config.json is not a {HEAD_FORMAT} head (format={meta.get('format')!r})")
    dcfg = DraftConfig.from_dict(meta["draft_config"])
    dcfg.check_target(target.config)
    params = load_safetensors(path / "model.safetensors")
    dtype = dtype or target.params["embed"].dtype
    params = {k: jax.tree.map(lambda x: jnp.asarray(x, jnp.int32 if k == "d2t" else dtype), v)
              for k, v in params.items()}
    return Draft(dcfg, params, target)
