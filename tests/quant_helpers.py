"""Tiny targets kept as GGUF blocks, quantized by gguf's own reference quantizer (tests of `ddd_jax.backends.cpu.quant`)."""
from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
from gguf.quants import quantize

from ddd_jax import ModelConfig, Target
from ddd_jax.backends.cpu import quant

QTYPE = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0,
         "q4_0": gguf.GGMLQuantizationType.Q4_0}
# spec_helpers.TINY with widths that are whole blocks of 32 (a tied embedding, as SmolLM2's)
SMALL = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, eos_token_id=(95,),
                    tie_word_embeddings=True)


def blocks_of(rows: np.ndarray, kind: str) -> np.ndarray:
    """[..., R, K] float32 -> [..., R, K/32 * bytes] uint8, quantized by gguf's own reference quantizer."""
    return np.asarray(quantize(np.ascontiguousarray(rows, np.float32), QTYPE[kind]))


def blocks_target(float_target: Target) -> Target:
    """The float target's matrices quantized (Q4_1 layers, Q8_0 embedding) and kept as blocks."""
    p = float_target.params
    layers = dict(p["layers"])
    for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        rows = np.asarray(layers[k]).swapaxes(-1, -2)  # [L, out, in]
        layers[k] = quant.BlockWeight(jnp.asarray(blocks_of(rows, "q4_1")), "q4_1", transposed=True)
    out = {"embed": quant.BlockWeight(jnp.asarray(blocks_of(np.asarray(p["embed"]), "q8_0")), "q8_0"),
           "layers": layers, "final_norm": p["final_norm"]}
    if "lm_head" in p:  # untied: [D, V] logical, stored as V rows
        out["lm_head"] = quant.BlockWeight(jnp.asarray(blocks_of(np.asarray(p["lm_head"]).T, "q8_0")), "q8_0",
                                           transposed=True)
    return Target(float_target.name + "-blocks", float_target.config, out)


