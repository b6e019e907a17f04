"""`load_target` / `load_draft` / `convert_target`: tell what a name or path holds and hand it to that format's reader.

Targets: a known name (`registry.NAMED_TARGETS`, cached in our format), our target format, an HF directory
(Llama, Mistral, Qwen2, Qwen3: `hf.read_hf_config` dispatches on `model_type`), or a llama / qwen2 / qwen3
architecture .gguf file. Draft heads: a packaged name, our head format (a directory or one .tar), or an official
EAGLE-1/2 or EAGLE-3 PyTorch head directory (converted on the fly).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax.numpy as jnp

from ..backends.cpu import hugepages
from .. import io as dio
from ..backends.cpu import panels as P
from ..backends.cpu import quant
from ..eagle import Draft
from ..target import Target
from . import registry
from .eagle_official import convert_official_head
from .gguf import load_gguf_target
from .hf import load_hf_dir
from .ours import HEAD_FORMAT, TARGET_FORMAT, load_draft_dir, load_draft_tar, load_target_dir, save_target
from .registry import NAMED_TARGETS, named_source


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
    if fmt == TARGET_FORMAT:
        return "ours", path
    if fmt is not None:
        raise ValueError(f"{path} holds a {fmt!r} checkpoint, not a target (draft heads load with load_draft)")
    return "hf", path


def load_target(path_or_name, dtype=None, mesh=None, gguf_blocks: bool | str = False,
                panels: bool | int | None = None) -> Target:
    """Load a target.

    path_or_name: a known name ("smollm2-135m-instruct"), a directory in our format, an HF Llama / Mistral /
    Qwen2 / Qwen3 directory, or a llama / qwen2 / qwen3 architecture .gguf file. dtype: "float32" | "float16" | "bfloat16" (or a numpy/jax
    dtype); None keeps the stored dtype (float32 for GGUF). mesh: a `jax.sharding.Mesh` with axes ("data", "model")
    (`ddd_jax.sharding.make_mesh`): weights are sharded by `ddd_jax.sharding.RULES` (heads, MLP hidden and
    vocabulary over "model", the rest replicated) tensor by tensor while loading; `target.mesh` keeps it.
    gguf_blocks: (GGUF sources) keep the matrices stored as Q4_1 / Q8_0 / Q4_0 as those blocks (`ddd_jax.backends.cpu.quant`):
    the same float32 values and arithmetic, ~1/6 of the bytes a forward reads; the CPU kernel dequantizes them
    exactly. Matrices of other types (K-quants, float16) are dequantized to float32, with a warning naming them.
    gguf_blocks="int8": the same blocks, but the layer matrices multiply by integer dot products over activations
    quantized per 32 values to int8 (`quant.BlockPanels.int8`, llama.cpp's arithmetic): close to, not bitwise, the
    float32 products, and every row's result still independent of the number of rows (docs/cpu.md, "int8 blocks").
    panels: store the float32 layer matrices panel-major (`ddd_jax.backends.cpu.panels`: bitwise the same products, read as
    contiguous streams by the CPU kernel), and GGUF blocks too (`quant.BlockPanels`: bitwise the float32 panels'
    products of their dequantized values, so a GGUF target decodes the same tokens with or without gguf_blocks).
    None (default): when the CPU kernel runs here (CPU backend) and there is no mesh; True insists (an error where
    it cannot apply); False keeps row-major arrays; 16 or 48 insist with float panels of that many columns (default
    `panels.default_width()`, 48: see `ddd_jax.backends.cpu.panels` for when 16 pays).
    On Linux, the weights' large CPU buffers are then moved onto 2 MiB pages (`ddd_jax.backends.cpu.hugepages`; same values,
    fewer TLB misses per weight stream; `DDD_JAX_NO_HUGE_PAGES=1` skips it).
    """
    if not (panels is None or isinstance(panels, bool) or (isinstance(panels, int) and panels in P.WIDTHS)):
        raise ValueError(f"panels must be None, True, False, 16 or 48, not {panels!r}")
    if gguf_blocks not in (False, True, "int8"):
        raise ValueError(f"gguf_blocks must be False, True or 'int8', not {gguf_blocks!r}")
    int8 = gguf_blocks == "int8"
    if int8 and panels is False:
        raise ValueError("gguf_blocks='int8' multiplies quantized panels; panels=False does not apply")
    target = _with_panels(_load_target(path_or_name, dtype, mesh, bool(gguf_blocks)),
                          (True if panels is None else panels) if int8 else panels, int8)
    hugepages.collapse(target.params)
    return target


def _with_panels(target: Target, panels: bool | int | None, int8: bool = False) -> Target:
    """`target` with panel-major matrices where `panels` (load_target's argument) asks for them and they apply."""
    if panels is False:
        return target
    why = ("it is sharded over a mesh" if target.mesh is not None else
           "its weights are not float32" if jnp.dtype(target.params["embed"].dtype) != jnp.float32 else None)
    if why is not None:
        if panels:
            raise ValueError(f"panels={panels}: target {target.name!r} cannot be stored panel-major: {why}")
        return target
    if panels is None and not P.auto():
        return target
    # GGUF blocks (gguf_blocks=True) become quantized panels (`quant.BlockPanels`), float32 matrices float panels
    params = quant.pack_block_params(target.params, tied=target.config.tie_word_embeddings, int8=int8)
    width = None if panels is None or panels is True else int(panels)
    return dataclasses.replace(target, params=P.pack_params(params, width))


def _load_target(path_or_name, dtype, mesh, gguf_blocks: bool) -> Target:
    if mesh is not None:
        from ..sharding import check_mesh
        check_mesh(mesh)
    kind, path = resolve_source(path_or_name)
    if gguf_blocks:
        if kind not in ("named", "gguf"):
            raise ValueError(f"gguf_blocks=True needs a .gguf source (or a named GGUF target); {path} is a "
                             f"{kind!r} checkpoint")
        return load_gguf_target(path, dtype, name=str(path_or_name) if kind == "named" else None, mesh=mesh,
                                gguf_blocks=True)
    if kind == "named":
        return registry.load_named(str(path_or_name), path, dtype, mesh=mesh)
    if kind == "gguf":
        return load_gguf_target(path, dtype, mesh=mesh)
    if kind == "ours":
        return load_target_dir(path, dtype, mesh=mesh)
    return load_hf_dir(path, dtype, mesh=mesh)


def convert_target(src, out, dtype=None) -> Path:
    """Convert any target source (name, HF directory, .gguf, our format) to our format at `out`.

    Atomic (nothing is left at `out` on error) and host-memory lean: weights are converted into numpy
    buffers (one full copy) and streamed to disk one tensor at a time. Returns the written path.
    """
    kind, path = resolve_source(src)
    if kind == "hf":
        target = load_hf_dir(path, dtype, as_jax=False)
    elif kind == "gguf" or kind == "named":
        target = load_gguf_target(path, dtype, name=str(src) if kind == "named" else None, as_jax=False)
    else:
        target = load_target_dir(path, None)
    save_target(target, out, dtype=dtype)
    return Path(out)


def load_draft(path_or_name, target: Target, dtype=None) -> Draft:
    """A draft head bound to `target`.

    path_or_name: a packaged name ("smollm2-135m-instruct-eagle"), a directory in our head format
    (`save_draft`) or one `<name>.tar` of it (read in place, not extracted), or an official EAGLE-1/2 or EAGLE-3
    PyTorch head (config.json + pytorch_model.bin / model.safetensors), converted on the fly. dtype defaults to the
    target's parameter dtype.
    """
    s = str(path_or_name)
    dtype = dtype or target.params["embed"].dtype
    if s in registry.NAMED_DRAFTS:
        return dataclasses.replace(load_draft_dir(registry.named_draft_dir(s), target, dtype=dtype), name=s)
    path = Path(s).expanduser()
    if not path.exists():
        if "/" not in s and "\\" not in s:
            raise ValueError(f"unknown draft head name {s!r} (and no such path); known names: "
                             f"{sorted(registry.NAMED_DRAFTS)}")
        raise FileNotFoundError(f"no draft head at {path}")
    if path.is_file() and path.suffix == ".tar":
        return dataclasses.replace(load_draft_tar(path, target, dtype=dtype), name=s)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: a draft head is a directory with a config.json, or a .tar of our head "
                                "format")
    fmt = dio.read_json(path / "config.json").get("format")
    if fmt is not None and fmt != HEAD_FORMAT:
        raise ValueError(f"{path} holds a {fmt!r} checkpoint, not a draft head")
    d = load_draft_dir(path, target, dtype=dtype) if fmt == HEAD_FORMAT else convert_official_head(path, target,
                                                                                                     dtype=dtype)
    return dataclasses.replace(d, name=s)
