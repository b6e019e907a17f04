"""Round-trip parity: tiny random HF LlamaForCausalLM -> save_pretrained -> load_target -> logits equal torch's."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_same_target, our_logits, torch_logits
from ddd_jax import io as dio
from ddd_jax.checkpoints.loading import load_target
from ddd_jax.checkpoints.ours import save_target

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")



@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_safetensors_parity(tiny_hf_llama, tie, seed):
    model, path = tiny_hf_llama(tie=tie, seed=seed)
    t = load_target(path)
    assert t.config.tie_word_embeddings == tie and ("lm_head" in t.params) == (not tie)
    assert t.config.num_key_value_heads == 2 and t.params["embed"].dtype == jnp.float32
    np.testing.assert_allclose(our_logits(t), torch_logits(model), atol=1e-4, rtol=1e-4)


def test_sharded_safetensors_parity(tiny_hf_llama):
    model, path = tiny_hf_llama(seed=2, save_kw={"max_shard_size": "40KB"})
    assert (path / "model.safetensors.index.json").is_file()
    assert len(set(dio.read_json(path / "model.safetensors.index.json")["weight_map"].values())) > 1
    np.testing.assert_allclose(our_logits(load_target(path)), torch_logits(model), atol=1e-4, rtol=1e-4)


def _to_bin(model, path, shards: int = 1):
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    names = list(sd)
    if shards == 1:
        torch.save(sd, path / "pytorch_model.bin")
        return
    weight_map = {}
    for i in range(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: sd[k] for k in names[i::shards]}
        torch.save(part, path / fname)
        weight_map.update({k: fname for k in part})
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 2])
def test_bin_parity(tiny_hf_llama, shards):
    model, path = tiny_hf_llama(tie=shards == 2, seed=3)
    _to_bin(model, path, shards)
    np.testing.assert_allclose(our_logits(load_target(path)), torch_logits(model), atol=1e-4, rtol=1e-4)


def test_our_format_round_trip_and_dtype(tiny_hf_llama, tmp_path):
    model, path = tiny_hf_llama(seed=4)
    t = load_target(path)
    save_target(t, tmp_path / "ours")
    cfg = dio.read_json(tmp_path / "ours" / "config.json")
    assert cfg["format"] == "ddd-jax-target"
    t2 = load_target(tmp_path / "ours")
    assert_same_target(t, t2)
    t16 = load_target(path, dtype="bfloat16")
    assert t16.params["layers"]["wq"].dtype == jnp.bfloat16
    save_target(t, tmp_path / "ours16", dtype="float16")
    assert load_target(tmp_path / "ours16").params["embed"].dtype == jnp.float16


def test_hf_tokenizer_and_chat_template(tiny_hf_llama):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ddd_jax.chat import render_chat
    model, path = tiny_hf_llama(seed=5)
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<eot>", "hello", "world", "user", "assistant"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <eot> {% endfor %}"
                "{% if add_generation_prompt %}assistant {% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<s>", "eos_token": {"content": "<eot>"}}))
    t = load_target(path)
    assert t.chat_template == template and t.special_tokens["eos_token"] == "<eot>"
    assert 3 in t.eos_token_ids and 2 in t.eos_token_ids  # config eos plus the tokenizer's end-of-turn
    text = render_chat(t, [{"role": "user", "content": "hello world"}])
    assert text == "<s>user hello world <eot> assistant "
    assert t.encode("hello world") == [4, 5]
