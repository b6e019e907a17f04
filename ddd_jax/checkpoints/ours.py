"""Our own checkpoint formats: the target directory (also the named-model cache) and the EAGLE draft-head directory.

Target (`TARGET_FORMAT`), a directory:
    config.json            HF-style LlamaConfig fields + {"format": "ddd-jax-target", "format_version", "name"}
    model.safetensors      flat keys of `llama.param_shapes` ('.'-joined, e.g. "layers.wq")
    tokenizer.json         (optional) a `tokenizers` tokenizer
    tokenizer_config.json  (optional) {"chat_template": ..., "bos_token": ..., "eos_token": ...}
Draft head (`HEAD_FORMAT`), a directory:
    config.json            {"format": "ddd-jax-eagle-head", "format_version", "draft_config": {...}, "extra"?}
    model.safetensors      flat keys of `eagle.param_shapes` (the target's embed / lm_head are not stored; a
                           reduced draft vocabulary's `d2t` is one of them)
or the same two files as the members of one `<name>.tar` (`save_draft` to a path ending in ".tar"): one file to
copy. `load_draft_tar` reads an uncompressed tar's tensors in place, memory-mapped, without extracting it; a tar
written with `compress=True` is one xz stream (the bytes of bfloat16 weights shrink to ~0.7), read into memory.
All are written atomically: a directory or tar exists whole or not at all.
"""
from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import json
import lzma
import os
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath

import jax
import jax.numpy as jnp
import numpy as np

from .. import io as dio
from .. import llama
from ..backends.cpu import quant
from ..config import DraftConfig, ModelConfig
from ..eagle import Draft
from ..target import Target
from .hf import target_placer, read_tokenizer_files
from ..keytable import check_shapes, resolve_dtype
from .safetensors import (load_safetensors, safetensors_buffer_sources, safetensors_sources, save_safetensors,
                          write_safetensors)

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
        place = target_placer(cfg, mesh)
        params = dio.unflatten({k: place(k, s.load() if dt is None else np.asarray(s.load()).astype(dt))
                                for k, s in sources.items()})
    tok, template, special = read_tokenizer_files(path)
    return Target(name or raw.get("name") or path.name, cfg, params, tok, template, special, mesh=mesh)


# ---------------------------------------------------------------------------------------------------------
# Draft heads


HEAD_FILES = ("config.json", "model.safetensors")  # a head directory's files, a head tar's members


def save_draft(draft: Draft, path, dtype=None, extra: dict | None = None, compress: bool = False) -> None:
    """Write our head format (config.json + model.safetensors) atomically: a directory that either exists whole or
    not at all, or with `path` ending in ".tar" one tar file holding the same two files, uncompressed, or with
    `compress` one xz stream (for a head that must fit a size limit; `read_head_tar` reads either)."""
    params = quant.dequantize_tree(dict(draft.params))  # a head stored as GGUF blocks: saved as its float values
    if dtype is not None:
        params = {k: jax.tree.map(lambda x: np.asarray(x).astype(np.int32 if k == "d2t" else dtype), v)
                  for k, v in params.items()}
    cfg = {"format": HEAD_FORMAT, "format_version": HEAD_FORMAT_VERSION, "draft_config": draft.config.to_dict()}
    if extra:
        cfg["extra"] = extra
    params = jax.tree.map(np.asarray, params)
    if str(path).endswith(".tar"):
        with dio.atomic_file(path) as tmp, tempfile.TemporaryDirectory(dir=Path(tmp).parent,
                                                                       prefix=f".{Path(path).name}.") as d:
            (Path(d) / "config.json").write_text(json.dumps(cfg, indent=2))
            save_safetensors(params, Path(d) / "model.safetensors")
            with contextlib.ExitStack() as stack:
                if compress:  # 2-byte literals (lp=1, pb=1, lc=0): 4% smaller than the preset alone on 16-bit weights
                    f = stack.enter_context(lzma.LZMAFile(tmp, "wb", format=lzma.FORMAT_XZ, filters=[
                        {"id": lzma.FILTER_LZMA2, "preset": 6, "lc": 0, "lp": 1, "pb": 1}]))
                    tar = stack.enter_context(tarfile.open(fileobj=f, mode="w|", format=tarfile.PAX_FORMAT))
                else:
                    tar = stack.enter_context(tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT))
                for name in HEAD_FILES:
                    tar.add(Path(d) / name, arcname=name, filter=_plain_member)
        return
    if compress:
        raise ValueError(f"save_draft: compress=True needs a path ending in .tar, got {path}")
    with dio.atomic_dir(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        save_safetensors(params, tmp / "model.safetensors")


def _plain_member(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """A tar member readable by anyone, naming no user."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o644
    return info


def load_draft_dir(path, target, dtype=None) -> Draft:
    """A Draft bound to `target` from a directory in our head format (dtype defaults to the target's)."""
    path = Path(path)
    meta = dio.read_json(path / "config.json")
    return _draft_from(meta, lambda: load_safetensors(path / "model.safetensors"), str(path), f"{path}/config.json",
                       target, dtype)


def load_draft_tar(path, target, dtype=None) -> Draft:
    """A Draft bound to `target` from a `<name>.tar` in our head format (`save_draft(..., "<name>.tar")`). The
    tensors are memory-mapped from the tar itself (nothing is extracted); a truncated tar, one without config.json or
    model.safetensors, or one holding another format fails with an error naming the file."""
    path = Path(path)
    meta, sources = read_head_tar(path)
    return _draft_from(meta, lambda: dio.unflatten({s.name: np.array(s.load()) for s in sources}),
                       str(path), f"{path} (its config.json)", target, dtype)


def read_head_tar(path) -> tuple[dict, list]:
    """(config.json's content, model.safetensors' `SourceTensor`s) of a head tar: memory-mapped from an uncompressed
    tar, read into memory from a compressed one (xz, gzip or bz2). Members may sit at the top of the tar or in one
    folder ("head/config.json", as `tar cf head.tar head/` makes them)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no draft head tar at {path}")
    kind = _compressed(path)
    try:
        # a compressed tar is decompressed whole first: its stream's own check (CRC) catches a cut or damaged copy
        data = io.BytesIO({"gzip": gzip, "bz2": bz2, "xz": lzma}[kind].open(path).read()) if kind else None
        with tarfile.open(fileobj=data, mode="r:") if kind else tarfile.open(path, "r:") as tar:
            members = tar.getmembers()  # reads every header: a truncated tar fails here
            found = {want: _member(path, members, want) for want in HEAD_FILES}
            config = tar.extractfile(found["config.json"]).read()
            weights = tar.extractfile(found["model.safetensors"]).read() if kind else None
    except (tarfile.TarError, EOFError, lzma.LZMAError, zlib.error, OSError) as e:
        what = f"a {kind}-compressed tar" if kind else "a tar"
        raise ValueError(f"{path}: cannot read this draft head tar ({e}: a truncated or damaged copy of {what}, or "
                         "not a tar file)") from None
    try:
        meta = json.loads(config)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: its config.json is not JSON ({e})") from None
    st = found["model.safetensors"]
    where = f"{path} ({st.name})"
    if kind:
        if len(weights) != st.size:
            raise ValueError(f"{path}: model.safetensors holds {len(weights)} of its {st.size} bytes (a truncated "
                             "tar: copy it again)")
        return meta, safetensors_buffer_sources(weights, where)
    if st.offset_data + st.size > path.stat().st_size:  # a tar cut inside its last member's data
        raise ValueError(f"{path}: model.safetensors needs bytes up to {st.offset_data + st.size}, the file has "
                         f"{path.stat().st_size} (a truncated tar: copy it again)")
    return meta, safetensors_sources(path, offset=st.offset_data, size=st.size, where=where)


def _member(path: Path, members: list, want: str) -> tarfile.TarInfo:
    """The one regular-file member named `want` at the top of the tar or in one folder (clear errors otherwise)."""
    hits = [m for m in members if m.isreg() and PurePosixPath(m.name).name == want
            and len(PurePosixPath(m.name.removeprefix("./")).parts) <= 2]
    top = [m for m in hits if PurePosixPath(m.name.removeprefix("./")).parts == (want,)]
    if len(top) == 1 or len(hits) == 1:
        return (top or hits)[0]
    names = sorted(m.name for m in members)[:8]
    if not hits:
        raise ValueError(f"{path}: no {want} in this tar (a draft head tar holds {' and '.join(HEAD_FILES)}; it "
                         f"holds {names})")
    raise ValueError(f"{path}: several {want} in this tar ({sorted(m.name for m in hits)}): which head is it?")


def _compressed(path: Path) -> str | None:
    """"gzip", "bz2", "xz" when `path` starts like such a file, else None."""
    with open(path, "rb") as f:
        magic = f.read(6)
    for kind, sig in (("gzip", b"\x1f\x8b"), ("bz2", b"BZh"), ("xz", b"\xfd7zXZ\x00")):
        if magic.startswith(sig):
            return kind
    return None


def _draft_from(meta: dict, load_params, where: str, config_where: str, target, dtype) -> Draft:
    """A Draft from a head's config.json content and a loader of its params; errors name `where` (the head) or
    `config_where` (its config.json)."""
    if meta.get("format") != HEAD_FORMAT:
        raise ValueError(f"{config_where} is not a {HEAD_FORMAT} head (format={meta.get('format')!r})")
    dcfg = DraftConfig.from_dict(meta["draft_config"])
    try:
        dcfg.check_target(target.config)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    params = load_params()
    dtype = dtype or target.params["embed"].dtype
    params = {k: jax.tree.map(lambda x: jnp.asarray(x, jnp.int32 if k == "d2t" else dtype), v)
              for k, v in params.items()}
    return Draft(dcfg, params, target)
