"""Target feature extraction into resumable on-disk shards: token ids, final-normed features (float16), loss masks.

Layout of an output directory::

    manifest.json          {"format": "ddd-jax-features", "target": ..., "shards": [...], "totals": {...}}
    shard_00000.npz        ids int32 [N], features float16 [N, D], mask uint8 [N], offsets int64 [S+1], seq_ids

A shard holds the (up to) `shard_size` sequences `items[i*shard_size:(i+1)*shard_size]`, flattened (no padding
on disk; `offsets` delimit sequences). Shards are written to a temp file and renamed, and the manifest is
rewritten after each one, so an interrupted run loses at most the shard in progress and a rerun with the same
arguments continues at the first missing shard. Sequences are run one at a time, padded at the end to the
smallest bucket length that fits (a causal model is unaffected by trailing pads), so there is one compile per
bucket.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ddd_jax import io as dio

FORMAT = "ddd-jax-features"
VERSION = 1


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.npz"


def bucket_for(n: int, buckets) -> int:
    for b in sorted(buckets):
        if n <= b:
            return b
    raise ValueError(f"sequence of {n} tokens exceeds the largest bucket {max(buckets)}")


def target_features(target, ids: np.ndarray, buckets) -> np.ndarray:
    """Final-normed target features [T, D] (float16) for one sequence, padded to a bucket for the forward."""
    import jax.numpy as jnp
    n = len(ids)
    L = bucket_for(n, buckets)
    tok = np.zeros((1, L), np.int32)
    tok[0, :n] = ids
    pos = np.arange(L, dtype=np.int32)[None]
    out = target.forward(jnp.asarray(tok), jnp.asarray(pos), return_logits=False)
    return np.asarray(out.hidden[0, :n].astype(jnp.float16))


def features_in_batches(target, seqs: list, buckets, batch_size: int = 32, progress: bool = False) -> np.ndarray:
    """Final-normed target features of many sequences, [sum(len), D] float16 in the order given: sequences grouped
    by length into batches of `batch_size` padded to a bucket (one compile per bucket; a short last batch is padded
    with empty rows), the same features as `target_features` one sequence at a time."""
    import jax.numpy as jnp
    order = sorted(range(len(seqs)), key=lambda k: len(seqs[k]))
    out: list = [None] * len(seqs)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(len(s) for s in seqs), unit="tok", unit_scale=True, desc="features", mininterval=5.0)
    for i in range(0, len(order), batch_size):
        group = order[i:i + batch_size]
        L = bucket_for(max(len(seqs[k]) for k in group), buckets)
        tok = np.zeros((batch_size, L), np.int32)
        for r, k in enumerate(group):
            tok[r, :len(seqs[k])] = seqs[k]
        pos = np.broadcast_to(np.arange(L, dtype=np.int32), tok.shape)
        hid = np.asarray(target.forward(jnp.asarray(tok), jnp.asarray(pos), return_logits=False).hidden
                         .astype(jnp.float16))
        for r, k in enumerate(group):
            out[k] = hid[r, :len(seqs[k])]
        if bar is not None:
            bar.update(sum(len(seqs[k]) for k in group))
    if bar is not None:
        bar.close()
    D = target.config.hidden_size
    return np.concatenate(out) if out else np.zeros((0, D), np.float16)


def _write_npz_atomic(path: Path, **arrays) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _shard_entry(path: Path, index: int) -> dict:
    with np.load(path) as z:
        offsets = z["offsets"]
        mask = z["mask"]
        n_loss = int(sum(mask[a + 1:b].sum() for a, b in zip(offsets[:-1], offsets[1:])))
        return {"file": path.name, "index": index, "n_seqs": int(len(offsets) - 1), "n_tokens": int(offsets[-1]),
                "n_loss_tokens": n_loss}


def _identity_keys(manifest: dict) -> dict:
    return {k: manifest.get(k) for k in ("format", "version", "target", "hidden_size", "vocab_size", "source",
                                         "max_len", "shard_size", "n_items", "buckets")}


def _write_shard(target, items: list, render, max_len: int, buckets, path: Path, bar=None,
                 batch_size: int = 1) -> None:
    """One shard of features: `items` rendered (those that render to None left out), cut to `max_len` tokens,
    through the target (`batch_size` sequences a forward, `features_in_batches`); written atomically to `path`."""
    ids_l, mask_l, seq_ids = [], [], []
    for item in items:
        ex = render(item)
        if ex is None:
            continue
        ids_l.append(np.asarray(ex["ids"][:max_len], np.int32))
        mask_l.append(np.asarray(ex["mask"][:max_len], np.uint8))
        seq_ids.append(str(ex["id"]))
    D = target.config.hidden_size
    if batch_size > 1:
        feats = features_in_batches(target, ids_l, buckets, batch_size)
    else:
        feats = np.concatenate([target_features(target, ids, buckets) for ids in ids_l]) if ids_l else None
    if bar is not None:
        bar.update(sum(len(x) for x in ids_l))
    lens = [len(x) for x in ids_l]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    _write_npz_atomic(path,
                      ids=np.concatenate(ids_l) if ids_l else np.zeros(0, np.int32),
                      features=feats if ids_l else np.zeros((0, D), np.float16),
                      mask=np.concatenate(mask_l) if mask_l else np.zeros(0, np.uint8),
                      offsets=offsets, seq_ids=np.asarray(seq_ids, dtype=str))


def extract(target, items: list, render, out_dir, *, source: dict, max_len: int, shard_size: int = 64,
            buckets=(256, 512, 1024), max_tokens: int | None = None, time_limit_s: float | None = None,
            progress: bool = True, batch_size: int = 1) -> dict:
    """Extract features for `items` (rendered lazily by `render(item) -> {"id","ids","mask"} | None`), `batch_size`
    sequences of similar length a target forward (the features do not depend on it).

    Stops after the shard that brings the total to `max_tokens`, or at the first shard boundary after
    `time_limit_s`. Returns the manifest. Rerunning with the same arguments resumes.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    buckets = sorted(int(b) for b in buckets)
    if max_len > buckets[-1]:
        raise ValueError(f"max_len={max_len} exceeds the largest bucket {buckets[-1]}")
    manifest = {"format": FORMAT, "version": VERSION, "target": target.name, "hidden_size": target.config.hidden_size,
                "vocab_size": target.config.vocab_size, "source": source, "max_len": int(max_len),
                "shard_size": int(shard_size), "n_items": len(items), "buckets": buckets, "shards": []}
    mpath = out_dir / "manifest.json"
    if mpath.exists():
        old = dio.read_json(mpath)
        if _identity_keys(old) != _identity_keys(manifest):
            diff = {k: (old.get(k), v) for k, v in _identity_keys(manifest).items() if old.get(k) != v}
            raise ValueError(f"{out_dir} holds features made with different settings {diff}; use another --out")
    n_shards = (len(items) + shard_size - 1) // shard_size
    entries = {}
    for i in range(n_shards):  # pick up every complete shard already on disk (manifest may lag by one)
        p = out_dir / shard_name(i)
        if p.exists():
            entries[i] = _shard_entry(p, i)

    def write_manifest():
        manifest["shards"] = [entries[i] for i in sorted(entries)]
        manifest["totals"] = {k: sum(e[k] for e in entries.values()) for k in ("n_seqs", "n_tokens", "n_loss_tokens")}
        manifest["complete"] = len(entries) == n_shards
        dio.atomic_write_text(mpath, json.dumps(manifest, indent=1))

    write_manifest()
    total = sum(e["n_tokens"] for e in entries.values())
    t0 = time.time()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=max_tokens, initial=total, unit="tok", unit_scale=True, desc=f"extract {out_dir.name}",
                   mininterval=5.0)
    try:
        for i in range(n_shards):
            if max_tokens is not None and total >= max_tokens:
                break
            if time_limit_s is not None and time.time() - t0 > time_limit_s:
                break
            if i in entries:
                continue
            _write_shard(target, items[i * shard_size:(i + 1) * shard_size], render, max_len, buckets,
                         out_dir / shard_name(i), bar, batch_size)
            entries[i] = _shard_entry(out_dir / shard_name(i), i)
            total += entries[i]["n_tokens"]
            write_manifest()
    finally:
        if bar is not None:
            bar.close()
    return manifest


@dataclass
class FeatureSet:
    """Extracted sequences, flattened: sequence k is ids[offsets[k]:offsets[k+1]] (and likewise features, mask)."""

    ids: np.ndarray  # [N] int32
    features: np.ndarray  # [N, D] float16
    mask: np.ndarray  # [N] uint8
    offsets: np.ndarray  # [S+1] int64
    seq_ids: list
    manifest: dict  # one directory: its manifest; several: {"format", "target", "source": {"kind": "several", ...}}
    parts: list = field(default_factory=list)  # [{"path", "source", "seqs": [first, end)}] per directory loaded

    @property
    def n_seqs(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])


def feature_dirs(path) -> list[Path]:
    """`path` as a list of feature directories: one path, or a list / tuple of them."""
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not paths:
        raise ValueError("no feature directory given")
    return [Path(p) for p in paths]


def read_manifest(path: Path, target=None) -> dict:
    """The manifest of feature directory `path`, checked to be ours (and from `target`'s sizes when given)."""
    if not (path / "manifest.json").is_file():
        raise FileNotFoundError(f"{path} is not a feature directory (no manifest.json; make one with "
                                "`ddd-jax train-draft extract`)")
    manifest = dio.read_json(path / "manifest.json")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} directory")
    if target is not None and (manifest["hidden_size"] != target.config.hidden_size
                               or manifest["vocab_size"] != target.config.vocab_size):
        raise ValueError(f"features in {path} were extracted from {manifest['target']!r} (hidden_size="
                         f"{manifest['hidden_size']}, vocab_size={manifest['vocab_size']}), not from this target")
    return manifest


def load_features(path, target=None, max_shards: int | None = None) -> FeatureSet:
    """Load every shard listed in the manifest of `path` (optionally the first max_shards) into memory.

    `path` may be a list of feature directories (e.g. ShareGPT replies and self-distilled replies, extracted
    apart): their sequences are concatenated in that order (max_shards counts over all of them), and they must
    come from one target (same hidden size and vocabulary). `parts` says which sequences came from where."""
    dirs = feature_dirs(path)
    manifests = [read_manifest(d, target) for d in dirs]
    for d, m in zip(dirs[1:], manifests[1:]):
        if (m["hidden_size"], m["vocab_size"]) != (manifests[0]["hidden_size"], manifests[0]["vocab_size"]):
            raise ValueError(f"features in {d} (target {m['target']!r}) and {dirs[0]} (target "
                             f"{manifests[0]['target']!r}) come from different targets")
    ids, feats, masks, offs, sids, parts = [], [], [], [np.zeros(1, np.int64)], [], []
    base, left = 0, max_shards or None
    for d, manifest in zip(dirs, manifests):
        shards = manifest["shards"] if left is None else manifest["shards"][:left]
        first = len(sids)
        for e in shards:
            with np.load(d / e["file"]) as z:
                ids.append(z["ids"])
                feats.append(z["features"])
                masks.append(z["mask"])
                offs.append(z["offsets"][1:] + base)
                sids.extend(z["seq_ids"].tolist())
                base += int(z["offsets"][-1])
        parts.append({"path": str(d), "source": manifest.get("source"), "seqs": [first, len(sids)]})
        if left is not None:
            left -= len(shards)
    if not ids:
        raise ValueError(f"no feature shards in {', '.join(map(str, dirs))}")
    if len(dirs) == 1:
        manifest = manifests[0]
    else:
        m0 = manifests[0]
        manifest = {"format": FORMAT, "version": VERSION, "target": m0["target"], "hidden_size": m0["hidden_size"],
                    "vocab_size": m0["vocab_size"],
                    "source": {"kind": "several", "parts": [{"path": p["path"], "source": p["source"]} for p in parts]}}
    return FeatureSet(np.concatenate(ids), np.concatenate(feats), np.concatenate(masks), np.concatenate(offs), sids,
                      manifest, parts)
