"""What a remote run hands back: one folder of at most 8 files, each at most 16 MiB, 64 MiB in all, at most two
folders deep, written file by file as each stage finishes (`ExportDir`); its heads, each one `.tar` in the first
form that fits a file (`write_head_tar`), written off the training loop's thread (`HeadWriter`); and the compact
regenerated-replies file (`save_regen`, `load_regen`) that a later run can learn from again.

`regen.npz` (numpy, compressed) holds for each part P ("train", "holdout"): `P_ids` uint16 (prompt + reply of
every record, concatenated), `P_offsets` int64 [n + 1], `P_prompt_len` int32 [n], `P_finished` bool [n] and
`P_keys` (str) [n], plus `meta` (JSON: the target's name and vocabulary size). `load_regen` also reads the JSONL
files `train-draft regenerate` writes (`.jsonl` or `.jsonl.gz`), so every earlier run's replies can be reused.
"""
from __future__ import annotations

import gzip
import json
import shutil
import threading
import time
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


# ----------------------------------------------------------------------------------------------------- heads

# (dtype, xz-compressed) in the order tried: float16 as it is while it fits a file; else bfloat16 (the fits'
# arithmetic: their held-out scores were measured at it) in one xz stream, ~0.7 of its bytes (0.71 on the shipped
# SmolLM2 head's weights). SmolLM2's EAGLE-3 head with an 8k draft vocabulary is 19.7 MB in 16 bits: it needs the
# second form.
HEAD_FORMS = (("float16", False), ("bfloat16", True))
XZ_RATIO_BOUND = 0.8  # what `check_head_fits` assumes of the compressed form (measured 0.68-0.71)


def _form_name(dtype: str, xz: bool) -> str:
    return dtype + ("+xz" if xz else "")


def head_bytes(dcfg, itemsize: int = 2) -> int:
    """The bytes of a head's weights at `itemsize` bytes a weight (d2t at 4)."""
    from ddd_jax import eagle
    n = {k: int(np.prod(v)) for k, v in dio.flatten(eagle.param_shapes(dcfg)).items()}
    return sum(v * (4 if k == "d2t" else itemsize) for k, v in n.items())


def check_head_fits(dcfg, what: str, limit: int = MAX_FILE_BYTES) -> dict:
    """Before a run spends its window: fail when even the compressed form of the head `dcfg` would likely pass
    `limit`; else {"float16_bytes", "form"}, the form it will be written in."""
    b = head_bytes(dcfg)
    if b <= limit:
        return {"float16_bytes": b, "form": _form_name(*HEAD_FORMS[0])}
    if b * XZ_RATIO_BOUND > limit:
        raise ValueError(f"{what}: the head's weights take {b} bytes in 16 bits, ~{int(b * XZ_RATIO_BOUND)} "
                         f"compressed, over the {limit} bytes a returned file may hold (draft_vocab_size="
                         f"{dcfg.draft_vocab_size}: a smaller draft vocabulary shrinks its lm_head)")
    return {"float16_bytes": b, "form": _form_name(*HEAD_FORMS[1])}


def write_head_tar(draft, path, extra: dict | None = None, limit: int = MAX_FILE_BYTES) -> str:
    """Write `draft` to the `.tar` `path` in the first of `HEAD_FORMS` that is at most `limit` bytes; returns the
    form ("float16", "bfloat16+xz"). Raises ValueError (naming the sizes) when none fits; `path` is then absent."""
    import ml_dtypes

    from ddd_jax.checkpoints.ours import save_draft
    path, sizes = Path(path), []
    for dtype, xz in HEAD_FORMS:
        save_draft(draft, path, dtype=np.float16 if dtype == "float16" else ml_dtypes.bfloat16, extra=extra,
                   compress=xz)
        size = path.stat().st_size
        if size <= limit:
            return _form_name(dtype, xz)
        sizes.append(f"{_form_name(dtype, xz)} {size}")
    path.unlink()
    raise ValueError(f"{path.name}: {', '.join(sizes)} bytes, over {limit} a file")


class HeadWriter:
    """Writes heads into an `ExportDir` on one background thread, so a fit that finds a new best every few seconds
    does not wait for a head's compression (xz releases the GIL; the heads come as host numpy arrays). A head
    submitted under a name replaces one of that name still waiting. `poll()` and `flush()` run on the caller's
    thread and return what was written since: {name: (why not | None, form | None)}.

    Time: `time_write(draft)` writes a head of the final one's shapes to scratch only, so `expected_s()` (the
    longest write so far) is known before a fit starts; `flush(timeout)` gives up at its timeout, and `close()`
    lets no write reach the export folder afterwards (a process that exits then leaves no half-copied file)."""

    def __init__(self, export: ExportDir, scratch):
        self.export, self.scratch = export, Path(scratch)
        self._cv = threading.Condition()
        self._todo: dict = {}
        self._done: dict = {}
        self._busy, self._current, self._closed = False, None, False
        self.write_s: list = []  # seconds of every write so far (timing writes included)
        self._thread = threading.Thread(target=self._loop, name="head-writer", daemon=True)
        self._thread.start()

    def submit(self, name: str, draft, extra: dict | None = None) -> dict:
        with self._cv:
            self._todo[name] = (draft, extra, True)
            self._cv.notify_all()
        return self.poll()

    def time_write(self, draft) -> None:
        """Write `draft` as a head would be written, to scratch only: its seconds join `write_s`."""
        with self._cv:
            self._todo[".timing"] = (draft, None, False)
            self._cv.notify_all()

    def expected_s(self) -> float | None:
        """The longest write so far (None before the first ends)."""
        with self._cv:
            return max(self.write_s) if self.write_s else None

    def pending(self) -> list[str]:
        """The heads submitted and not yet written (the one being written included)."""
        with self._cv:
            names = [*self._todo, *([self._current] if self._busy else [])]
            return [n for n in names if not n.startswith(".")]

    def poll(self) -> dict:
        with self._cv:
            done, self._done = self._done, {}
        return done

    def flush(self, timeout: float | None = None) -> dict:
        """Wait (up to `timeout` s) until every submitted head is written or refused."""
        with self._cv:
            self._cv.wait_for(lambda: not self.pending(), timeout)
        return self.poll()

    def close(self) -> None:
        """No write reaches the export folder after this (one being copied in finishes first: milliseconds)."""
        with self._cv:
            self._closed = True
            self._todo.clear()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._todo)
                name = self._current = next(iter(self._todo))
                draft, extra, export = self._todo.pop(name)
                self._busy = True
            t0 = time.time()
            result = self._write(name, draft, extra, export)
            with self._cv:
                self.write_s.append(time.time() - t0)
                if export:
                    self._done[name] = result
                self._busy = False
                self._cv.notify_all()

    def _write(self, name: str, draft, extra, export: bool) -> tuple:
        tmp = self.scratch / f".{name.lstrip('.')}.tar"
        try:
            form = write_head_tar(draft, tmp, extra)
            if not export:
                return None, form
            with self._cv:  # close() waits for a copy under way, and none starts after it
                if self._closed:
                    return "the run's deadline came first", form
                return self.export.put_file(f"{name}.tar", tmp), form
        except ValueError as e:  # no form fits
            return str(e), None
        except Exception as e:  # noqa: BLE001 -- reported to the caller, never lost on this thread
            return f"{type(e).__name__}: {e}", None
        finally:
            tmp.unlink(missing_ok=True)


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
