"""Reduced draft vocabulary from training features: most frequent loss-masked tokens, EOS always kept, coverage,
and a head rewritten with `d2t` that still decodes exactly like vanilla."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ddd_jax import TreeConfig, generate, init_draft, load_draft, save_draft
from spec_helpers import tiny_target
from train_draft.vocab import apply_draft_vocab, coverage, frequent_tokens, token_counts


def write_features(path, ids, mask):
    path.mkdir()
    np.savez(path / "shard_00000.npz", ids=np.asarray(ids, np.int32), mask=np.asarray(mask, np.uint8))
    (path / "manifest.json").write_text(json.dumps({"format": "ddd-jax-features", "shards": [{"file": "shard_00000.npz"}]}))


def test_frequent_tokens_and_coverage(tmp_path):
    write_features(tmp_path / "f", [5, 5, 5, 7, 7, 9, 3, 3, 3, 3], [1, 1, 1, 1, 1, 1, 0, 0, 0, 0])
    counts = token_counts(tmp_path / "f", 12)
    assert counts[5] == 3 and counts[3] == 0  # unmasked tokens do not count
    ids = frequent_tokens(counts, 2, always=(11,))
    assert ids.tolist() == [5, 11]
    assert coverage(counts, frequent_tokens(counts, 2)) == pytest.approx(5 / 6)
    with pytest.raises(ValueError, match="size"):
        frequent_tokens(counts, 0)


@pytest.mark.slow  # ~5 s
def test_apply_draft_vocab_round_trip_and_lossless(tmp_path):
    target = tiny_target()
    rng = np.random.RandomState(0)
    write_features(tmp_path / "f", rng.randint(0, 60, 500), np.ones(500))
    save_draft(init_draft(target, 0), tmp_path / "head")
    summary = apply_draft_vocab(tmp_path / "head", target, tmp_path / "f", 40)
    assert summary["draft_vocab_size"] == 40 and 0 < summary["train_coverage"] <= 1
    head = load_draft(str(tmp_path / "head"), target)
    assert head.config.draft_vocab_size == 40 and target.eos_token_ids[0] in np.asarray(head.params["d2t"])
    tree = TreeConfig(top_k=3, total_tokens=6, depth=2)
    ref = generate(target, None, [1, 2, 3, 4], max_new_tokens=16)
    out = generate(target, head, [1, 2, 3, 4], max_new_tokens=16, method="eagle2", tree=tree)
    assert out.tokens == ref.tokens
