"""What the official EAGLE head readers (EAGLE-1/2 and EAGLE-3) share: the head's config, and the check that its
embedding is the target's."""
from __future__ import annotations

import warnings

import numpy as np

from ..backends.cpu import quant
from ..config import DraftConfig, normalize_rope


def draft_config_from_official(raw: dict, what: str, target_name: str | None = None) -> DraftConfig:
    """DraftConfig from an official head's config.json (LlamaConfig fields + optional "bias")."""
    need = ["hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"]
    missing = [k for k in need if k not in raw]
    if missing:
        raise ValueError(f"{what}: config.json is missing {missing}")
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{what}: num_hidden_layers={raw['num_hidden_layers']}; only 1-layer EAGLE-1/2 heads "
                         "are supported")
    if raw.get("attention_bias"):
        raise ValueError(f"{what}: attention_bias=true (an o_proj bias) is not part of EAGLE-1/2 heads; only "
                         "qkv_bias (q/k/v biases) is supported")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"{what}: hidden_act={raw['hidden_act']!r} is not supported (the MLP is SwiGLU: 'silu')")
    heads = int(raw["num_attention_heads"])
    head_dim = int(raw["hidden_size"]) // heads  # EAGLE's cnets1 LlamaAttention: hidden_size // num_heads
    if raw.get("head_dim") and int(raw["head_dim"]) != head_dim:
        warnings.warn(f"{what}: config.json has head_dim={raw['head_dim']}, but EAGLE-1/2 heads (cnets1) use "
                      f"hidden_size / num_attention_heads = {head_dim}; using {head_dim}", stacklevel=3)
    rope_theta, rope_scaling = normalize_rope(raw)
    dcfg = DraftConfig(vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
                       intermediate_size=int(raw["intermediate_size"]), num_attention_heads=heads,
                       num_key_value_heads=int(raw.get("num_key_value_heads") or heads), head_dim=head_dim,
                       rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                       rope_theta=rope_theta, rope_scaling=rope_scaling, fc_bias=bool(raw.get("bias", True)),
                       target_name=target_name, qkv_bias=bool(raw.get("qkv_bias", False)))
    try:
        dcfg.layer_config()  # validates heads / rope scaling
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    return dcfg


def check_draft_ids(ids, vocab_size: int, what: str, name: str) -> np.ndarray:
    """A draft vocabulary read from a checkpoint (`name`: the tensor it came from) as int64 target ids: in [0, V) and
    distinct, else a ValueError naming `what`."""
    ids = np.asarray(ids).astype(np.int64).reshape(-1)
    if ids.size == 0:
        raise ValueError(f"{what}: {name} is empty")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{what}: {name} points outside the target vocabulary [0, {vocab_size}): draft ids map to "
                         f"target ids in [{int(ids.min())}, {int(ids.max())}]")
    if len(np.unique(ids)) != ids.size:
        raise ValueError(f"{what}: {name} maps two draft ids to the same target id")
    return ids


def compare_embedding(src_embed, target, what: str, mode: str = "warn", rtol: float = 1e-2) -> float:
    """Max |head embed - target embed| relative to max |target embed|; warn or raise beyond rtol."""
    if mode not in ("warn", "error", "ignore"):
        raise ValueError(f"embed_check must be 'warn', 'error' or 'ignore', got {mode!r}")
    te = target.params["embed"]
    if tuple(src_embed.shape) != tuple(te.shape):
        raise ValueError(f"{what}: embed_tokens.weight has shape {tuple(src_embed.shape)} but the target's "
                         f"embedding is {tuple(te.shape)} (head made for a different vocabulary/target?)")
    if mode == "ignore":
        return float("nan")
    te = np.asarray(quant.as_float(te))  # a panel-major or GGUF-block embedding: its float values
    diff, scale = 0.0, 0.0
    for i in range(0, te.shape[0], 8192):  # row chunks: no full float32 copies of a 7B embedding
        a = np.asarray(src_embed[i:i + 8192], np.float32)
        b = np.asarray(te[i:i + 8192], np.float32)
        diff, scale = max(diff, float(np.abs(a - b).max())), max(scale, float(np.abs(b).max()))
    rel = diff / max(scale, 1e-12)
    if rel > rtol:
        msg = (f"{what}: the head's embed_tokens differ from the target's embedding (max abs diff {diff:.3g}, "
               f"{rel:.2%} of max |embed|): was the head trained for this target?")
        if mode == "error":
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=3)
    return rel
