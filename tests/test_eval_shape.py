"""Real-size configs (LLaMA-2-7B, Vicuna-7B-v1.3 and their EAGLE heads; Qwen2.5-7B, Qwen3-8B, Qwen3-0.6B) through
jax.eval_shape: no memory allocated.

Parameter counts match the published numbers, the forwards trace at full size, and the HF / EAGLE key
tables accept the real checkpoints' tensor names and shapes (planned from shapes only, never read).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddd_jax import eagle, llama
from ddd_jax.cache import KVCache
from ddd_jax.config import DraftConfig, ModelConfig
from ddd_jax.checkpoints.eagle_official import EAGLE1_IGNORE, EAGLE1_RULES
from ddd_jax.checkpoints.hf import HF_IGNORE, HF_LLAMA_RULES
from ddd_jax.keytable import SourceTensor, flat_shapes, plan

# meta-llama/Llama-2-7b-hf config.json (the fields we read)
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
             "num_key_value_heads": 32, "rms_norm_eps": 1e-05, "vocab_size": 32000, "max_position_embeddings": 4096,
             "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "rope_theta": 10000.0}
# lmsys/vicuna-7b-v1.3 config.json (LLaMA-1 7B geometry)
VICUNA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32, "rms_norm_eps": 1e-06,
             "vocab_size": 32000, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
             "tie_word_embeddings": False}
# yuhuili/EAGLE-Vicuna-7B-v1.3 / EAGLE-llama2-chat-7B heads: one LLaMA layer of the target's geometry + fc(2H->H, bias)
HEAD_PARAMS_7B = 2 * 4096 * 4096 + 4096 + 4 * 4096 * 4096 + 3 * 4096 * 11008 + 4096  # 235,937,792 (~0.24B)


def abstract_count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("raw", [LLAMA2_7B, VICUNA_7B], ids=["llama2-7b", "vicuna-7b-v1.3"])
def test_7b_and_eagle_head_param_counts(raw):
    cfg = ModelConfig.from_hf_config(raw)
    params = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.PRNGKey(0), jnp.float16))
    assert abstract_count(params) == 6_738_415_616
    dcfg = DraftConfig.from_target(cfg)
    dparams = jax.eval_shape(lambda: eagle.init_params(dcfg, jax.random.PRNGKey(0), jnp.float16))
    assert abstract_count(dparams) == HEAD_PARAMS_7B == 235_937_792


def test_7b_forwards_trace_at_full_size():
    cfg = ModelConfig.from_hf_config(LLAMA2_7B)
    params = llama.abstract_params(cfg, jnp.float16)
    B, T, S = 1, 8, 64
    cache = jax.eval_shape(lambda: llama.new_cache(cfg, B, S, jnp.float16))
    tok = jax.ShapeDtypeStruct((B, T), jnp.int32)
    out = jax.eval_shape(lambda p, t, c: llama.forward(p, cfg, t, t, c), params, tok, cache)
    assert out.logits.shape == (B, T, 32000) and out.hidden.shape == (B, T, 4096)
    assert isinstance(out.cache, KVCache) and out.cache.k.shape == (32, B, 32, S, 128)  # head-major
    dcfg = DraftConfig.from_target(cfg)
    dparams = jax.eval_shape(lambda: eagle.init_params(dcfg, jax.random.PRNGKey(0), jnp.float16))
    feats = jax.ShapeDtypeStruct((B, T, 4096), jnp.float16)
    h, _ = jax.eval_shape(lambda dp, e, t, f: eagle.head_forward(dp, dcfg, e, t, f, t), dparams, params["embed"],
                          tok, feats)
    assert h.shape == (B, T, 4096)


def _never(name):
    def load():
        raise AssertionError(f"{name} must not be read while planning")
    return load


def test_key_tables_accept_real_7b_layouts():
    cfg = ModelConfig.from_hf_config(LLAMA2_7B)
    D, F, V, L = 4096, 11008, 32000, 32
    hf = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        hf.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                   p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D), p + "mlp.down_proj.weight": (D, F),
                   p + "self_attn.rotary_emb.inv_freq": (64,)})
        hf.update({p + f"self_attn.{x}_proj.weight": (D, D) for x in "qkvo"})
    slots = plan([SourceTensor(n, s, _never(n)) for n, s in hf.items()], HF_LLAMA_RULES,
                 flat_shapes(llama.param_shapes(cfg)), "llama2-7b", ignore=HF_IGNORE)
    assert len(slots) == 291  # 32 * 9 + embed + norm + lm_head; inv_freq ignored
    head = {"embed_tokens.weight": (V, D), "fc.weight": (D, 2 * D), "fc.bias": (D,),
            "layers.0.post_attention_layernorm.weight": (D,), "layers.0.mlp.gate_proj.weight": (F, D),
            "layers.0.mlp.up_proj.weight": (F, D), "layers.0.mlp.down_proj.weight": (D, F)}
    head.update({f"layers.0.self_attn.{x}_proj.weight": (D, D) for x in "qkvo"})
    dcfg = DraftConfig.from_target(cfg)
    slots = plan([SourceTensor(n, s, _never(n)) for n, s in head.items()], EAGLE1_RULES,
                 flat_shapes(eagle.param_shapes(dcfg)), "EAGLE-llama2-chat-7B", ignore=EAGLE1_IGNORE)
    assert sum(int(np.prod(s.src.shape)) for s in slots) == HEAD_PARAMS_7B


# Qwen/Qwen2.5-7B-Instruct and Qwen/Qwen3-8B config.json (the fields we read), Qwen/Qwen3-0.6B (tied, head_dim 128
# != 1024 / 16): published parameter counts 7,615,616,512 and 8,190,735,360; Qwen3-0.6B: 0.6B, 0.44B non-embedding.
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
             "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "vocab_size": 152064, "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
             "max_window_layers": 28, "use_sliding_window": False, "sliding_window": 131072, "hidden_act": "silu",
             "max_position_embeddings": 32768}
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False, "rope_theta": 1000000,
            "rms_norm_eps": 1e-06, "max_window_layers": 36, "use_sliding_window": False, "sliding_window": None,
            "attention_bias": False, "hidden_act": "silu", "max_position_embeddings": 40960}
QWEN3_06B = dict(QWEN3_8B, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, tie_word_embeddings=True, max_window_layers=28)


@pytest.mark.parametrize("raw,count", [(QWEN25_7B, 7_615_616_512), (QWEN3_8B, 8_190_735_360)],
                         ids=["qwen2.5-7b", "qwen3-8b"])
def test_qwen_param_counts_and_key_tables(raw, count):
    cfg = ModelConfig.from_hf_config(raw)
    params = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))
    assert abstract_count(params) == count
    D, F, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    NH, KH, H = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.head_dim
    hf = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        hf.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                   p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D), p + "mlp.down_proj.weight": (D, F),
                   p + "self_attn.q_proj.weight": (NH, D), p + "self_attn.k_proj.weight": (KH, D),
                   p + "self_attn.v_proj.weight": (KH, D), p + "self_attn.o_proj.weight": (D, NH)})
        if cfg.model_type == "qwen2":
            hf.update({p + "self_attn.q_proj.bias": (NH,), p + "self_attn.k_proj.bias": (KH,),
                       p + "self_attn.v_proj.bias": (KH,)})
        else:
            hf.update({p + "self_attn.q_norm.weight": (H,), p + "self_attn.k_norm.weight": (H,)})
    slots = plan([SourceTensor(n, s, _never(n)) for n, s in hf.items()], HF_LLAMA_RULES,
                 flat_shapes(llama.param_shapes(cfg)), raw["model_type"], ignore=HF_IGNORE)
    assert sum(int(np.prod(s.src.shape)) for s in slots) == count


def test_qwen3_small_traces_with_its_own_head_dim():
    cfg = ModelConfig.from_hf_config(QWEN3_06B)
    assert cfg.head_dim == 128 != cfg.hidden_size // cfg.num_attention_heads and cfg.qk_norm
    params = llama.abstract_params(cfg, jnp.bfloat16)
    total, embed = abstract_count(params), cfg.vocab_size * cfg.hidden_size
    assert round(total / 1e9, 1) == 0.6 and round((total - embed) / 1e9, 2) == 0.44
    B, T, S = 1, 8, 64
    cache = jax.eval_shape(lambda: llama.new_cache(cfg, B, S, jnp.bfloat16))
    tok = jax.ShapeDtypeStruct((B, T), jnp.int32)
    out = jax.eval_shape(lambda p, t, c: llama.forward(p, cfg, t, t, c), params, tok, cache)
    assert out.logits.shape == (B, T, 151936) and out.cache.k.shape == (28, B, 8, S, 128)
    dcfg = DraftConfig.from_target(cfg)  # its head keeps head_dim 128 and the q/k norms
    dparams = jax.eval_shape(lambda: eagle.init_params(dcfg, jax.random.PRNGKey(0), jnp.bfloat16))
    assert dparams["layers"]["wq"].shape == (1, 1024, 2048) and dparams["layers"]["q_norm"].shape == (1, 128)
    feats = jax.ShapeDtypeStruct((B, T, 1024), jnp.bfloat16)
    h, _ = jax.eval_shape(lambda dp, e, t, f: eagle.head_forward(dp, dcfg, e, t, f, t), dparams, params["embed"],
                          tok, feats)
    assert h.shape == (B, T, 1024)
