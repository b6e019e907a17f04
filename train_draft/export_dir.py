"""What a remote run hands back: one folder of at most 8 files, each at most 16 MiB, 64 MiB in all, at most two
folders deep, written file by file as each stage finishes (`ExportDir`), and the compact regenerated-replies file
(`save_regen`, `load_regen`) that a later run can learn from again.

`regen.npz` (numpy, compressed) holds for each part P ("train", "holdout"): `P_ids` uint16 (prompt + reply of
every record, concatenated), `P_offsets` int64 [n + 1], `P_prompt_len` int32 [n], `P_finished` bool [n] and
`P_keys` (str) [n], plus `meta` (JSON: the target's name and vocabulary size). `load_regen` also reads the JSONL
files `train-draft regenerate` writes (`.jsonl` or `.jsonl.gz`), so every earlier run's replies can be reused.
"""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np

from ddd_jax import io as dio

MAX_FILES = 8
MAX_FILE_BYTES = 16 * 2 ** 20
MAX_TOTAL_BYTES = 64 * 2 ** 20
MAX_DEPTH = 2  # DIR/a/b/file
REGEN_FORMAT = "ddd-jax-regen"


def check_limits(root) -> dict:
    """{"files", "bytes", "largest", "problems": [...]} of the folder `root` against what a remote run returns."""
    root = Path(root)
    files = [p for p in root.rglob("*") if p.is_file()]
    problems = []
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files (at most {MAX_FILES})")
    for p in files:
        rel = p.relative_to(root)
        if p.stat().st_size > MAX_FILE_BYTES:
            problems.append(f"{rel}: {p.stat().st_size} bytes (at most {MAX_FILE_BYTES})")
        if len(rel.parts) - 1 > MAX_DEPTH:
            problems.append(f"{rel}: {len(rel.parts) - 1} folders deep (at most {MAX_DEPTH})")
    total = sum(p.stat().st_size for p in files)
    if total > MAX_TOTAL_BYTES:
        problems.append(f"{total} bytes in all (at most {MAX_TOTAL_BYTES})")
    largest = max((p.stat().st_size for p in files), default=0)
    return {"files": len(files), "bytes": total, "largest": largest, "problems": problems}


class ExportDir:
    """A folder filled as a run goes: every write is atomic (temp file, then rename), and a write that would break
    the return limits is refused with a reason (recorded by the caller) instead of making the whole folder fail to
    come back. Names are flat (no subfolders)."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def _room(self, name: str, size: int) -> str | None:
        """Why a file `name` of `size` bytes may not be written, or None."""
        others = [p for p in self.path.iterdir() if p.is_file() and p.name != name and not p.name.startswith(".")]
        if size > MAX_FILE_BYTES:
            return f"{name}: {size} bytes, over {MAX_FILE_BYTES} a file"
        if len(others) + 1 > MAX_FILES:
            return f"{name}: would be file {len(others) + 1}, over {MAX_FILES}"
        if sum(p.stat().st_size for p in others) + size > MAX_TOTAL_BYTES:
            return f"{name}: would bring the folder over {MAX_TOTAL_BYTES} bytes"
        return None

    def put_file(self, name: str, src) -> str | None:
        """Copy the file `src` in as `name`; returns None, or why it was not written."""
        src = Path(src)
        why = self._room(name, src.stat().st_size)
        if why is None:
            with dio.atomic_file(self.path / name) as tmp:
                shutil.copyfile(src, tmp)
        return why

    def put_bytes(self, name: str, data: bytes) -> str | None:
        why = self._room(name, len(data))
        if why is None:
            with dio.atomic_file(self.path / name) as tmp:
                Path(tmp).write_bytes(data)
        return why

    def put_json(self, name: str, obj) -> str | None:
        return self.put_bytes(name, json.dumps(obj, indent=1).encode())

    def put_gzip(self, name: str, src) -> str | None:
        """`src` gzipped as `name` (e.g. a metrics.jsonl as metrics.jsonl.gz)."""
        return self.put_bytes(name, gzip.compress(Path(src).read_bytes(), compresslevel=6))

    def names(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir() if p.is_file() and not p.name.startswith("."))


# ----------------------------------------------------------------------------------------- regenerated replies


def regen_arrays(parts: dict, meta: dict) -> dict:
    """The arrays of regen.npz for {part: [record]} (records as `regen.regenerate` writes them)."""
    arrays = {"meta": np.asarray(json.dumps({"format": REGEN_FORMAT, "version": 1, **meta}))}
    for part, recs in parts.items():
        if any(max(r["ids"], default=0) >= 65536 for r in recs):
            raise ValueError("regenerated ids do not fit uint16")
        seqs = [np.asarray(r["ids"], np.uint16) for r in recs]
        arrays[f"{part}_ids"] = np.concatenate(seqs) if seqs else np.zeros(0, np.uint16)
        arrays[f"{part}_offsets"] = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
        arrays[f"{part}_prompt_len"] = np.asarray([r["prompt_len"] for r in recs], np.int32)
        arrays[f"{part}_finished"] = np.asarray([bool(r.get("finished", False)) for r in recs], bool)
        arrays[f"{part}_keys"] = np.asarray([str(r["id"]) for r in recs], dtype=str)
    return arrays


def save_regen(parts: dict, path, meta: dict) -> Path:
    """Write {part: [record]} as one compressed regen.npz, atomically."""
    path = Path(path)
    with dio.atomic_file(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **regen_arrays(parts, meta))
    return path


def regen_bytes(parts: dict, meta: dict) -> bytes:
    import io
    buf = io.BytesIO()
    np.savez_compressed(buf, **regen_arrays(parts, meta))
    return buf.getvalue()


def load_regen(path) -> dict:
    """{part: [record]} from a regen.npz, or {"train" or the file's part: [record]} from a `.jsonl` / `.jsonl.gz`
    of `train-draft regenerate` (part "holdout" when the name says so, else "train"). Errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"regenerated replies {path} do not exist")
    name = path.name
    if name.endswith(".npz"):
        try:
            with np.load(path, allow_pickle=False) as z:
                data = {k: z[k] for k in z.files}
            meta = json.loads(str(data["meta"]))
        except Exception as e:  # noqa: BLE001 -- zipfile / numpy / json errors of a truncated or foreign file
            raise ValueError(f"{path}: not a readable regen.npz ({type(e).__name__}: {e})") from e
        if meta.get("format") != REGEN_FORMAT:
            raise ValueError(f"{path}: format {meta.get('format')!r}, expected {REGEN_FORMAT!r}")
        out = {}
        for part in sorted({k.rsplit("_", 1)[0] for k in data if k.endswith("_offsets")}):
            ids, offs = data[f"{part}_ids"], data[f"{part}_offsets"]
            keys, plen, fin = data[f"{part}_keys"], data[f"{part}_prompt_len"], data[f"{part}_finished"]
            if len(offs) != len(keys) + 1 or offs[-1] != len(ids):
                raise ValueError(f"{path}: the {part} offsets do not delimit {len(keys)} records in {len(ids)} ids")
            out[part] = [{"id": str(k), "prompt_len": int(p), "ids": ids[a:b].astype(np.int32).tolist(),
                          "finished": bool(f)} for k, p, f, a, b in zip(keys, plen, fin, offs[:-1], offs[1:])]
        return out
    if name.endswith(".jsonl") or name.endswith(".jsonl.gz"):
        opener = gzip.open if name.endswith(".gz") else open
        try:
            with opener(path, "rt", encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, EOFError) as e:
            raise ValueError(f"{path}: not readable ({type(e).__name__}: {e})") from e
        recs = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):  # a torn last line of an interrupted run
                    break
                raise ValueError(f"{path}:{n}: not a JSON record") from None
            if not {"id", "prompt_len", "ids"} <= r.keys() or not 0 < r["prompt_len"] <= len(r["ids"]):
                raise ValueError(f"{path}:{n}: malformed record {line[:120]}")
            recs.append(r)
        return {"holdout" if "holdout" in name else "train": recs}
    raise ValueError(f"{path}: regenerated replies are a regen.npz or a .jsonl / .jsonl.gz file")
