"""Official EAGLE-1/2 PyTorch heads (SafeAILab/EAGLE `cnets1.py` layout) -> our draft params, via a key table
(EAGLE-3 heads are recognised by their tensor names and handed to `eagle3_official`).

Official layout: `config.json` (a LlamaConfig with num_hidden_layers=1; `"bias": false` means fc has no
bias, absent means it has one; `"qkv_bias": true` -- EAGLE's heads for Qwen2 targets -- gives q/k/v projection
biases) + `pytorch_model.bin` or `model.safetensors` holding
    embed_tokens.weight [V, D]      a frozen copy of the target's embedding: compared, then dropped
    fc.weight [D, 2D]  fc.bias [D]  over cat(embed, feature)
    layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
    layers.0.post_attention_layernorm.weight      (no input_layernorm on layer 0)
    layers.0.self_attn.{q,k,v}_proj.bias          (only with "qkv_bias": true)

The layer is EAGLE's own LLaMA layer whatever the config's `model_type` says: head_dim is hidden_size /
num_attention_heads (cnets1 ignores a `head_dim` field; so do we, with a warning when it differs), there are no
q/k norms, no o_proj bias and no sliding window. A head for a Qwen3 target with per-head q/k norms is an EAGLE-3
head (not supported) or one of ours (`DraftConfig.from_target` keeps the target's head_dim and norms).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from .. import eagle, quant
from .. import io as dio
from ..config import DraftConfig, normalize_rope
from .hf import checkpoint_sources, llama_layer_rules
from .keytable import Rule, convert, flat_shapes, plan, resolve_dtype, source_dtype
from .ours import save_draft

EAGLE1_RULES = (
    Rule(r"fc\.weight", "fc_w", transpose=True),
    Rule(r"fc\.bias", "fc_b"),
    *llama_layer_rules("", input_norm=False),  # EAGLE-1/2 layer 0 has no input_layernorm
)
EMBED_KEY = "embed_tokens.weight"
EAGLE1_IGNORE = (r".*rotary_emb\.inv_freq", r"embed_tokens\.weight")  # embed: compared, then dropped


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


def convert_official_head(src, target, dtype=None, embed_check: str = "warn") -> "eagle.Draft":
    """An official EAGLE-1/2 PyTorch head directory -> our `eagle.Draft` bound to `target` (in memory)."""
    src = Path(src)
    what = f"EAGLE head {src}"
    if not src.exists():
        raise FileNotFoundError(f"no EAGLE head at {src}")
    raw = dio.read_json(src / "config.json")
    sources = checkpoint_sources(src)
    names = [s.name for s in sources]
    from .eagle3_official import convert_official_eagle3, is_eagle3
    if is_eagle3(names):  # midlayer / hidden_norm / d2t / t2d tensors
        return convert_official_eagle3(src, target, dtype, embed_check)
    dcfg = draft_config_from_official(raw, what, target_name=getattr(target, "name", None))
    embed = [s for s in sources if s.name == EMBED_KEY]
    if len(embed) > 1:
        raise ValueError(f"{what}: duplicate tensors ['{EMBED_KEY}']")
    # vocab / width against the target first: the clearest error for a head made for another model
    if embed and tuple(embed[0].shape) != tuple(target.params["embed"].shape):
        raise ValueError(f"{what}: embed_tokens.weight has shape {tuple(embed[0].shape)} but the target's "
                         f"embedding is {tuple(target.params['embed'].shape)} (head made for a different target?)")
    dcfg.check_target(target.config)
    if raw.get("bias", True) is False and "fc.bias" in names:
        raise ValueError(f"{what}: config.json says bias=false but the checkpoint has fc.bias")
    expected = flat_shapes(eagle.param_shapes(dcfg))
    rules = [r for r in EAGLE1_RULES if r.key in expected]
    try:
        slots = plan(sources, rules, expected, what, ignore=EAGLE1_IGNORE)
    except ValueError as e:
        if "fc_b" in str(e) and "missing" in str(e):
            raise ValueError(f"{e} (config.json has no \"bias\": false, so fc must have a bias)") from None
        raise
    if embed:
        compare_embedding(embed[0].load(), target, what, embed_check)
    dt = resolve_dtype(dtype) or source_dtype(sources, "fc.weight")
    params = convert(slots, expected, dt)
    return eagle.Draft(dcfg, params, target)


def convert_eagle_dir(src, out, target, dtype=None, embed_check: str = "warn") -> "eagle.Draft":
    """Convert an official head to our head format at `out` (atomic: nothing is written on error)."""
    draft = convert_official_head(src, target, dtype, embed_check)
    save_draft(draft, out, extra={"converted_from": str(Path(src).resolve()), "source_layout": draft.config.head_type})
    return draft
