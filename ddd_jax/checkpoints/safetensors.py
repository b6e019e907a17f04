"""The one safetensors reader and writer: memory-mapped lazy reads, a streaming writer, nested-params save/load."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from .. import io as dio
from ..keytable import SourceTensor, np_dtype, resolve_dtype

_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_ST_CODES = {v: k for k, v in _ST_DTYPES.items()}


def safetensors_sources(path, offset: int = 0, size: int | None = None, where: str | None = None
                        ) -> list[SourceTensor]:
    """The tensors of one .safetensors file, memory-mapped (nothing is read until `.load()`).

    offset / size: the safetensors bytes lie at `offset` in `path`, `size` of them (default: to the end of the file),
    e.g. a member of an uncompressed tar; where: how errors name them (default `path`)."""
    path = Path(path)
    where = where or str(path)
    total = path.stat().st_size
    size = total - offset if size is None else size
    if size < 8 or offset + 8 > total:
        raise ValueError(f"{where}: not a safetensors file (too short)")
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(min(size, total - offset),))
    return safetensors_buffer_sources(mm, where, size)


def safetensors_buffer_sources(buf, where: str, size: int | None = None) -> list[SourceTensor]:
    """The tensors of safetensors bytes already in memory or mapped (`buf`: bytes or a uint8 array), as views into
    it; size: the bytes the container says they take (default len(buf)), so a cut copy is named as truncated."""
    buf = np.frombuffer(buf, np.uint8) if isinstance(buf, (bytes, bytearray, memoryview)) else buf
    size = len(buf) if size is None else size
    if size < 8 or len(buf) < 8:
        raise ValueError(f"{where}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", buf[:8].tobytes())
    if n > size - 8:
        raise ValueError(f"{where}: not a safetensors file (its header claims {n} bytes, the file has {size})")
    try:
        header = json.loads(buf[8:8 + n].tobytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not a safetensors file ({e})") from None
    start = 8 + n
    have = len(buf) - start  # bytes of tensor data there are
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{where}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dt = np_dtype(_ST_DTYPES[info["dtype"]])
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])
        need = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if e - b != need:
            raise ValueError(f"{where}: tensor {name!r} of shape {list(shape)} {dt} needs {need} bytes, its header "
                             f"gives it {e - b} (a corrupt file)")
        if e > have:
            raise ValueError(f"{where}: tensor {name!r} ends at byte {start + e} but the file has {len(buf)} bytes "
                             "(a truncated file: copy or download it again)")

        def load(b=b, e=e, dt=dt, shape=shape):
            return buf[start + b:start + e].view(dt).reshape(shape)

        out.append(SourceTensor(name, shape, load, dt))
    return out


def write_safetensors(tensors: dict, path, dtype=None, metadata: dict | None = None) -> None:
    """Write {name: array} to `path` in safetensors format, casting each tensor to `dtype` (if given)
    only when it is written: one tensor in memory at a time, so big checkpoints never double in RAM.
    Tensors are laid out widest dtype first (stable), so every tensor is aligned to its item size.
    Not atomic by itself: call inside `io.atomic_dir` / `io.atomic_file`."""
    dt = resolve_dtype(dtype)
    header, off, order = {}, 0, []
    dtypes = {name: dt if dt is not None else np.dtype(a.dtype) for name, a in tensors.items()}
    for name in sorted(tensors, key=lambda k: -dtypes[k].itemsize):
        a, t_dt = tensors[name], dtypes[name]
        if t_dt.name not in _ST_CODES:
            raise ValueError(f"cannot write tensor {name!r} of dtype {t_dt} to safetensors")
        n = int(np.prod(a.shape, dtype=np.int64)) * t_dt.itemsize
        header[name] = {"dtype": _ST_CODES[t_dt.name], "shape": [int(s) for s in a.shape], "data_offsets": [off, off + n]}
        order.append((name, t_dt, n))
        off += n
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, t_dt, n in order:
            a = np.ascontiguousarray(np.asarray(tensors[name]).astype(t_dt, copy=False))
            if a.nbytes != n:
                raise ValueError(f"tensor {name!r} changed size while writing")
            f.write(a.reshape(-1).view(np.uint8).data)
            del a


def save_safetensors(params: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """Write nested params as flat safetensors (keys joined with '.'); atomic."""
    with dio.atomic_file(path) as tmp:
        write_safetensors(dio.flatten(params), tmp, metadata=metadata)


def load_safetensors(path: str | os.PathLike) -> dict:
    """Nested params (numpy arrays, read into memory) from a flat safetensors file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no safetensors file at {path}")
    return dio.unflatten({s.name: np.array(s.load()) for s in safetensors_sources(path)})
