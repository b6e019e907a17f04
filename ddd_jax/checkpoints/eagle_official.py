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
and nothing else: EAGLE-2's `ea_model.py` loads them with `load_state_dict(strict=True)`. What is ddd-jax's own
lives in a side file, `ddd-jax/extensions.safetensors` (`EXTENSIONS_FILE`), which official loaders never open (they
read model.safetensors / pytorch_model.bin, and SGLang globs only the directory's own *.safetensors):
    draft_token_ids [V'] int64      a reduced draft vocabulary: the target ids the head drafts over (our `d2t`;
                                    SGLang's FR-Spec "hot" tokens). Absent: the whole target vocabulary.
Heads exported before the side file held draft_token_ids in model.safetensors; they still load.

The layer is EAGLE's own LLaMA layer whatever the config's `model_type` says: head_dim is hidden_size /
num_attention_heads (cnets1 ignores a `head_dim` field; so do we, with a warning when it differs), there are no
q/k norms, no o_proj bias and no sliding window. A head for a Qwen3 target with per-head q/k norms is an EAGLE-3
head (not supported) or one of ours (`DraftConfig.from_target` keeps the target's head_dim and norms).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from .. import eagle
from .. import io as dio
from .hf import checkpoint_sources, llama_layer_rules
from ..keytable import Rule, convert, flat_shapes, plan, resolve_dtype, source_dtype
from .official import check_draft_ids, compare_embedding, draft_config_from_official
from .ours import save_draft

EAGLE1_RULES = (
    Rule(r"fc\.weight", "fc_w", transpose=True),
    Rule(r"fc\.bias", "fc_b"),
    *llama_layer_rules("", input_norm=False),  # EAGLE-1/2 layer 0 has no input_layernorm
    Rule(r"draft_token_ids", "d2t"),  # ddd-jax's extension (int: read apart from the floats)
)
EMBED_KEY = "embed_tokens.weight"
DRAFT_IDS_KEY = "draft_token_ids"
EXTENSIONS = (DRAFT_IDS_KEY,)  # tensors official loaders do not know: written to EXTENSIONS_FILE, never beside theirs
EXTENSIONS_FILE = "ddd-jax/extensions.safetensors"  # relative to the head directory


def extension_sources(d: Path) -> list:
    """The tensors of `d`'s side file (`EXTENSIONS_FILE`), [] when it has none; only `EXTENSIONS` names may be in
    it."""
    path = Path(d) / EXTENSIONS_FILE
    if not path.is_file():
        return []
    from .safetensors import safetensors_sources
    out = safetensors_sources(path)
    unknown = sorted(s.name for s in out if s.name not in EXTENSIONS)
    if unknown:
        raise ValueError(f"{path}: unknown tensors {unknown} (ddd-jax's side file holds only {list(EXTENSIONS)})")
    return out
EAGLE1_IGNORE = (r".*rotary_emb\.inv_freq", r"embed_tokens\.weight")  # embed: compared, then dropped


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
    if not is_eagle3(names):
        sources = sources + extension_sources(src)  # ddd-jax's side file (draft_token_ids)
        names = [s.name for s in sources]
    if is_eagle3(names):  # midlayer / hidden_norm / d2t / t2d tensors
        return convert_official_eagle3(src, target, dtype, embed_check)
    dcfg = draft_config_from_official(raw, what, target_name=getattr(target, "name", None))
    ids_src = [s for s in sources if s.name == DRAFT_IDS_KEY]
    if len(ids_src) == 1 and len(ids_src[0].shape) == 1:  # a reduced draft vocabulary (misshaped: `plan` says so)
        dcfg = dataclasses.replace(dcfg, draft_vocab_size=int(ids_src[0].shape[0]))
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
    params = convert([s for s in slots if s.rule.key != "d2t"], {k: v for k, v in expected.items() if k != "d2t"}, dt)
    if "d2t" in expected:
        ids = np.asarray(ids_src[0].load())
        if ids.dtype.kind not in "iu":
            raise ValueError(f"{what}: {DRAFT_IDS_KEY} must hold integer token ids, got dtype {ids.dtype}")
        import jax.numpy as jnp
        params["d2t"] = jnp.asarray(check_draft_ids(ids, target.config.vocab_size, what, DRAFT_IDS_KEY), jnp.int32)
    return eagle.Draft(dcfg, params, target)


def convert_eagle_dir(src, out, target, dtype=None, embed_check: str = "warn") -> "eagle.Draft":
    """Convert an official head to our head format at `out` (atomic: nothing is written on error)."""
    draft = convert_official_head(src, target, dtype, embed_check)
    save_draft(draft, out, extra={"converted_from": str(Path(src).resolve()), "source_layout": draft.config.head_type})
    return draft
