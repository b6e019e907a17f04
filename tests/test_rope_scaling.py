"""Llama-3 rope scaling parity: a tiny random HF LlamaForCausalLM with llama3 rope scaling, run past its original
context, gives transformers' logits through load_target (both config.json spellings); dropping the scaling does not."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import write_tiny_hf_llama
from ddd_jax import load_target

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

# head_dim 16, theta 1e4: rope wavelengths 6.3, 21, 63, 199, ... -> one high-frequency pair (kept), one medium
# (smoothed) and six low (divided by factor) against original_max_position_embeddings=32.
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}
SEQ = 100  # > 3x the original context
TOKENS = np.random.RandomState(0).randint(0, 128, (1, SEQ)).astype(np.int32)


def torch_logits(model):
    with torch.no_grad():
        return model(torch.tensor(TOKENS, dtype=torch.long)).logits.float().numpy()


def our_logits(target):
    pos = np.arange(SEQ, dtype=np.int32)[None]
    return np.asarray(target.forward(jnp.asarray(TOKENS), jnp.asarray(pos)).logits, np.float32)


def edit_config(path, fn):
    p = path / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


def to_legacy(cfg):
    """transformers-4 spelling (what Llama-3 checkpoints on the hub carry): top-level rope_theta + rope_scaling."""
    rp = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rp.get("rope_theta", 10000.0)
    cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"} or dict(SCALING)


def drop_scaling(cfg):
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def scaled_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3-rope")
    # initializer_range 0.1 (not 0.02): logits of order 1, so ignoring the scaling moves them by ~2, not ~5e-3
    model = write_tiny_hf_llama(path, seed=5, max_position_embeddings=128, rope_scaling=dict(SCALING),
                                initializer_range=0.1)
    return model, path, torch_logits(model)


@pytest.mark.parametrize("spelling", ["saved", "legacy"])
def test_llama3_rope_scaling_matches_transformers(scaled_model, spelling, tmp_path):
    _, src, ref = scaled_model
    path = tmp_path / spelling
    path.mkdir()
    for f in src.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    if spelling == "legacy":
        edit_config(path, to_legacy)
    t = load_target(path)
    rs = t.config.rope_scaling_dict()
    assert rs.get("rope_type", rs.get("type")) == "llama3" and rs["factor"] == 8.0, rs
    assert rs["original_max_position_embeddings"] == 32
    np.testing.assert_allclose(our_logits(t), ref, atol=1e-4, rtol=1e-4)


def test_ignoring_the_scaling_would_be_caught(scaled_model, tmp_path):
    _, src, ref = scaled_model
    path = tmp_path / "unscaled"
    path.mkdir()
    for f in src.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    edit_config(path, drop_scaling)
    t = load_target(path)
    assert not t.config.rope_scaling_dict()
    assert np.abs(our_logits(t) - ref).max() > 1e-2
