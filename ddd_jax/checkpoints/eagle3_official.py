"""Official EAGLE-3 PyTorch heads (SafeAILab/EAGLE `eagle/model/cnets.py` `Model`) -> our EAGLE-3 draft params, via a
key table.

Official layout: `config.json` (LlamaConfig fields with num_hidden_layers=1, plus `draft_vocab_size` and optionally
`target_hidden_size`) + `pytorch_model.bin` or `model.safetensors` holding
    fc.weight [D, 3Ht]                         (no bias)
    midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight [D]
    midlayer.self_attn.{q,k,v}_proj.weight [*, 2D]   midlayer.self_attn.o_proj.weight [D, N*Hd]
    midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight [D]    lm_head.weight [V', D]
    d2t [V'] int64     offsets: draft id i is target id i + d2t[i]  (`topK_genrate`: `topk_index + self.d2t[...]`)
    t2d [V] bool       which target ids are in the draft vocabulary (checked against d2t, then dropped)
    embed_tokens.weight [V, D]  optional copy of the target's embedding: compared, then dropped (kept when the
                                head's width differs from the target's, i.e. `target_hidden_size` is set)
A variant (e.g. SpecForge/sglang exports) names the layer `layers.0.` instead of `midlayer.`; both go through the
same rules (the layer index group is optional).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import eagle
from .. import io as dio
from ..config import DraftConfig
from .official import check_draft_ids, compare_embedding, draft_config_from_official
from .hf import checkpoint_sources
from ..keytable import Rule, convert, flat_shapes, plan, resolve_dtype, source_dtype

_P = r"(?:midlayer|layers\.(0))\."  # the one decoder layer: `midlayer.` (EAGLE) or `layers.0.` (variant)
EAGLE3_RULES = (
    Rule(r"fc\.weight", "fc_w", transpose=True),
    Rule(_P + r"input_layernorm\.weight", "layers.emb_norm"),
    Rule(_P + r"hidden_norm\.weight", "layers.hidden_norm"),
    *(Rule(_P + f"self_attn\\.{n}_proj\\.weight", f"layers.w{n}", transpose=True) for n in "qkvo"),
    Rule(_P + r"post_attention_layernorm\.weight", "layers.mlp_norm"),
    *(Rule(_P + f"mlp\\.{n}_proj\\.weight", f"layers.w_{n}", transpose=True) for n in ("gate", "up", "down")),
    Rule(r"norm\.weight", "final_norm"),
    Rule(r"lm_head\.weight", "lm_head", transpose=True),
    Rule(r"d2t", "d2t", fn="d2t_offsets"),  # official offsets <-> our target ids (int: read apart from the floats)
    Rule(r"embed_tokens\.weight", "embed"),
)
EAGLE3_IGNORE = (r".*rotary_emb\.inv_freq", r"t2d")
EMBED_KEY = "embed_tokens.weight"


def ids_from_offsets(off):
    """Official d2t (draft id i is target id i + d2t[i]) -> the target ids themselves (our d2t)."""
    off = np.asarray(off)
    return np.arange(off.shape[0], dtype=np.int64) + off.astype(np.int64)


def offsets_from_ids(ids):
    """Our d2t (target ids) -> the official offsets, int64 as EAGLE's `torch.long` buffer."""
    ids = np.asarray(ids).astype(np.int64)
    return ids - np.arange(ids.shape[0], dtype=np.int64)


TRANSFORMS = {"d2t_offsets": ids_from_offsets}  # import direction (source -> ours)
INVERSE = {"d2t_offsets": offsets_from_ids}  # export direction (ours -> source): `keytable.export(inverse=...)`


def t2d_mask(ids, vocab_size: int) -> np.ndarray:
    """[V] bool: which target ids are in the draft vocabulary (EAGLE's `t2d` buffer), from our d2t."""
    mask = np.zeros(vocab_size, bool)
    mask[np.asarray(ids)] = True
    return mask


def is_eagle3(names) -> bool:
    """Whether a checkpoint's tensor names are EAGLE-3's (midlayer / hidden_norm / d2t / t2d)."""
    return any(n.startswith("midlayer.") or n in ("d2t", "t2d") or n.endswith("hidden_norm.weight") for n in names)


def eagle3_config_from_official(raw: dict, what: str, target_name: str | None = None) -> DraftConfig:
    """DraftConfig(head_type="eagle3") from an official EAGLE-3 config.json."""
    base = draft_config_from_official({k: v for k, v in raw.items() if k != "bias"}, what, target_name)
    V = base.vocab_size
    dv = int(raw.get("draft_vocab_size") or V)
    if not 0 < dv <= V:
        raise ValueError(f"{what}: draft_vocab_size={dv} must lie in (0, vocab_size={V}]")
    th = raw.get("target_hidden_size")
    th = int(th) if th and int(th) != base.hidden_size else None
    return DraftConfig(**{**base.to_dict(), "rope_scaling": base.rope_scaling, "fc_bias": False,
                          "head_type": "eagle3", "draft_vocab_size": dv, "target_hidden_size": th})


def convert_official_eagle3(src, target, dtype=None, embed_check: str = "warn") -> "eagle.Draft":
    """An official EAGLE-3 head directory -> our `eagle.Draft` (head_type "eagle3") bound to `target`."""
    src = Path(src)
    what = f"EAGLE-3 head {src}"
    raw = dio.read_json(src / "config.json")
    dcfg = eagle3_config_from_official(raw, what, target_name=getattr(target, "name", None))
    sources = checkpoint_sources(src)
    by_name = {s.name: s for s in sources}
    embed = by_name.get(EMBED_KEY)
    if embed is not None and embed.shape[0] != target.config.vocab_size:
        raise ValueError(f"{what}: embed_tokens.weight has shape {tuple(embed.shape)} but the target's vocabulary "
                         f"has {target.config.vocab_size} tokens (head made for a different target?)")
    try:
        dcfg.check_target(target.config)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    expected = flat_shapes(eagle.param_shapes(dcfg))
    keep_embed = "embed" in expected
    ignore = EAGLE3_IGNORE if keep_embed else EAGLE3_IGNORE + (r"embed_tokens\.weight",)
    slots = plan(sources, [r for r in EAGLE3_RULES if r.key in expected], expected, what, ignore=ignore)
    t2d = by_name.get("t2d")
    if t2d is not None and tuple(t2d.shape) != (dcfg.vocab_size,):
        raise ValueError(f"{what}: misshaped tensors t2d: got {tuple(t2d.shape)}, expected ({dcfg.vocab_size},)")
    # d2t: official offsets -> our target ids (int32; never through the float buffers)
    d2t_slot = next(s for s in slots if s.rule.key == "d2t")
    off = np.asarray(d2t_slot.src.load())
    if off.dtype.kind not in "iu":
        raise ValueError(f"{what}: d2t must hold integer offsets, got dtype {off.dtype}")
    ids = check_draft_ids(TRANSFORMS[d2t_slot.rule.fn](off), target.config.vocab_size, what, "d2t")
    if t2d is not None:
        mask = np.asarray(t2d.load()).astype(bool)
        if mask.sum() != ids.size or not mask[ids].all():
            raise ValueError(f"{what}: t2d disagrees with d2t (t2d marks {int(mask.sum())} target ids, d2t maps "
                             f"{ids.size})")
    if embed is not None and not keep_embed:
        compare_embedding(embed.load(), target, what, embed_check)
    dt = resolve_dtype(dtype) or source_dtype(sources, "fc.weight")
    params = convert([s for s in slots if s.rule.key != "d2t"],
                     {k: v for k, v in expected.items() if k != "d2t"}, dt)
    import jax.numpy as jnp
    params["d2t"] = jnp.asarray(ids, jnp.int32)
    return eagle.Draft(dcfg, params, target)
