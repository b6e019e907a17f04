"""Reduced draft vocabulary for a trained head: the most frequent next tokens of its training data (lossless at
decode time: the target verifies every drafted token)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ddd_jax import io as dio

from .extract import feature_dirs, read_manifest


def token_counts(feature_dir, vocab_size: int) -> np.ndarray:
    """Counts of the tokens the head must predict: loss-masked positions of every shard in `feature_dir` (one
    feature directory or a list of them)."""
    dirs = feature_dirs(feature_dir)
    counts = np.zeros(vocab_size, np.int64)
    for path in dirs:
        for e in read_manifest(path)["shards"]:
            with np.load(path / e["file"]) as z:
                ids, mask = z["ids"], z["mask"].astype(bool)
                counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    if counts.sum() == 0:
        raise ValueError(f"no loss-masked tokens in {', '.join(map(str, dirs))}")
    return counts


def frequent_tokens(counts: np.ndarray, size: int, always=()) -> np.ndarray:
    """The `size` most frequent token ids (ties by id), always including `always` (e.g. EOS)."""
    if not 0 < size <= len(counts):
        raise ValueError(f"draft vocabulary size must be in [1, {len(counts)}], got {size}")
    order = np.argsort(-counts, kind="stable")
    keep = list(dict.fromkeys([int(t) for t in always] + order.tolist()))[:size]
    return np.asarray(sorted(keep), np.int32)


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    """Fraction of training next-tokens inside the draft vocabulary."""
    return float(counts[ids].sum() / counts.sum())


def apply_draft_vocab(head_dir, target, feature_dir, size: int, out=None) -> dict:
    """Rewrite a head directory (atomically) with a `d2t` draft vocabulary of `size` tokens; returns a summary."""
    from ddd_jax.checkpoints.loading import load_draft
    from ddd_jax.checkpoints.ours import save_draft
    from ddd_jax.eagle import with_draft_vocab
    head_dir = Path(head_dir)
    meta = dio.read_json(head_dir / "config.json")
    draft = load_draft(str(head_dir), target)
    counts = token_counts(feature_dir, target.config.vocab_size)
    ids = frequent_tokens(counts, size, always=target.eos_token_ids)
    summary = {"draft_vocab_size": int(size), "train_coverage": coverage(counts, ids),
               "features": [str(p) for p in feature_dirs(feature_dir)]}
    extra = dict(meta.get("extra") or {})
    extra["draft_vocab"] = summary
    save_draft(with_draft_vocab(draft, ids), out or head_dir, dtype=np.float16, extra=extra)
    return summary
