"""Our draft heads in the official PyTorch layouts, for SafeAILab/EAGLE's and SGLang's own loaders: `save_official`.

The tensors come from the import key tables run backwards (`keytable.export` over `eagle_official.EAGLE1_RULES` /
`eagle3_official.EAGLE3_RULES`): every rule is written once, and a parameter no rule exports fails the export,
named. Layouts, each one directory written atomically (it exists whole or not at all):

* "eagle" (EAGLE-1/2 heads): EAGLE's `eagle/model/cnets1.py` `Model`, built by `ea_model.py` (`use_eagle3=False`);
  the files are laid out as EAGLE's released EAGLE-1/2 heads are (SGLang's `LlamaForCausalLMEagle` holds the same
  tensors under "model.").
      config.json        LlamaConfig fields (`configs.EConfig`), num_hidden_layers=1, architectures LlamaForCausalLM;
                         "bias": false only for a head without an fc bias, "qkv_bias": true only with q/k/v biases
                         (as EAGLE's released heads)
      model.safetensors  fc.{weight,bias}, layers.0.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
                         post_attention_layernorm}.weight (+ q/k/v biases), embed_tokens.weight (the target's
                         embedding: cnets1 has the parameter, and EAGLE-2's `ea_model.py` loads with
                         `strict=True`): exactly the official model's tensors, nothing of ours
      ddd-jax/extensions.safetensors   ddd-jax's own tensors, which official loaders never open: `draft_token_ids`
                         [V'] int64 for a reduced draft vocabulary (`load_draft` reads it back)
* "eagle3" (EAGLE-3 heads): EAGLE's `eagle/model/cnets.py` `Model` (`use_eagle3=True`) and SGLang's
  `LlamaForCausalLMEagle3` (`python/sglang/srt/models/llama_eagle3.py`).
      config.json        the same LlamaConfig fields, architectures LlamaForCausalLMEagle3, draft_vocab_size, and
                         target_hidden_size always (EAGLE then takes embed_tokens.weight from this file instead of
                         reading the target's sharded checkpoint index; SGLang still shares the target's embedding
                         when the widths agree)
      model.safetensors  fc.weight, midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight,
                         midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
                         norm.weight, lm_head.weight [V', D], d2t [V'] int64 offsets (target id = draft id + d2t),
                         t2d [V] bool, embed_tokens.weight [V, D]
Both also get README.md: a model card with the hub's metadata block and the head's own card (training data, steps,
held-out accuracy, its acceptance profile's τ) when the head has one.
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .. import io as dio
from ..backends.cpu import quant
from ..keytable import export, resolve_dtype
from .eagle3_official import EAGLE3_RULES, INVERSE as EAGLE3_INVERSE, t2d_mask
from .eagle_official import DRAFT_IDS_KEY, EAGLE1_RULES, EMBED_KEY, EXTENSIONS, EXTENSIONS_FILE

EXPORT_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class Layout:
    """One official layout: the head kind it holds, the key table that names its tensors, its config fields."""

    name: str  # "eagle" | "eagle3": what `save_official(layout=...)` and `--layout` take
    head_type: str  # the `DraftConfig.head_type` it holds
    title: str
    architecture: str  # config.json "architectures"
    rules: tuple  # the import key table, run backwards
    inverse: dict = field(default_factory=dict)  # inverses of the rules' transforms
    problems: Callable = None  # (dcfg) -> [what this layout cannot hold]
    config: Callable = None  # (dcfg) -> the layout's own config.json fields


def _layer_problems(dcfg, layer: str) -> list[str]:
    """What EAGLE's one-layer LLaMA attention cannot hold (it computes head_dim = hidden_size / num_attention_heads
    and has no o_proj bias nor q/k norms)."""
    out = []
    if dcfg.hidden_size % dcfg.num_attention_heads or dcfg.head_dim != dcfg.hidden_size // dcfg.num_attention_heads:
        out.append(f"head_dim={dcfg.head_dim} with hidden_size={dcfg.hidden_size} and {dcfg.num_attention_heads} "
                   f"heads ({layer} takes head_dim = hidden_size / num_attention_heads)")
    if dcfg.attention_bias:
        out.append(f"an o_proj bias (attention_bias; {layer} has none)")
    if dcfg.qk_norm:
        out.append(f"per-head q/k norms (qk_norm; {layer} has none)")
    return out


def _eagle_problems(dcfg) -> list[str]:
    return _layer_problems(dcfg, "EAGLE's cnets1 LlamaAttention")


def _eagle3_problems(dcfg) -> list[str]:
    out = _layer_problems(dcfg, "EAGLE's cnets LlamaAttention")
    if dcfg.qkv_bias:
        out.append("q/k/v biases (qkv_bias; EAGLE-3's layer has none)")
    return out


def _eagle_config(dcfg) -> dict:
    cfg = {}
    if not dcfg.fc_bias:  # ea_model.py reads "bias" (default true); released heads write it only when false
        cfg["bias"] = False
    if dcfg.qkv_bias:  # cnets1: `bias=config.qkv_bias` when the config has it
        cfg["qkv_bias"] = True
    return cfg


def _eagle3_config(dcfg) -> dict:
    return {"draft_vocab_size": int(dcfg.draft_vocab_size),
            "target_hidden_size": int(dcfg.target_hidden_size or dcfg.hidden_size)}


LAYOUTS = {
    "eagle": Layout("eagle", "eagle1", "EAGLE-1/2", "LlamaForCausalLM", EAGLE1_RULES,
                    problems=_eagle_problems, config=_eagle_config),
    "eagle3": Layout("eagle3", "eagle3", "EAGLE-3", "LlamaForCausalLMEagle3", EAGLE3_RULES, EAGLE3_INVERSE,
                     problems=_eagle3_problems, config=_eagle3_config),
}


def layout_for(draft, layout: str | None = None) -> Layout:
    """The official layout `layout` names (None: the one of the head's kind), checked against the head's kind."""
    kind = draft.config.head_type
    if layout is None:
        hits = [lo for lo in LAYOUTS.values() if lo.head_type == kind]
        if not hits:
            raise ValueError(f"{draft.kind.title} heads (head_type {kind!r}) have no official layout; the official "
                             f"layouts are {_layout_list()}")
        return hits[0]
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; the official layouts are {_layout_list()}")
    lo = LAYOUTS[layout]
    if lo.head_type != kind:
        raise ValueError(f"layout {layout!r} holds {lo.title} heads, but this is an {draft.kind.title} head "
                         f"(head_type {kind!r}); " + _layout_hint(kind))
    return lo


def _layout_list() -> str:
    return ", ".join(f"{n!r} ({lo.title})" for n, lo in LAYOUTS.items())


def _layout_hint(kind: str) -> str:
    hits = [n for n, lo in LAYOUTS.items() if lo.head_type == kind]
    return f"its layout is {hits[0]!r}" if hits else "its kind has no official layout"


def official_config(draft, layout: Layout, dtype: str) -> dict:
    """config.json of the exported head: the LlamaConfig fields EAGLE's `EConfig` / cnets and SGLang read."""
    dcfg, tcfg = draft.config, draft.target.config
    rope = dcfg.layer_config().rope_scaling_dict() or None
    cfg = {"architectures": [layout.architecture], "model_type": "llama", "hidden_act": "silu",
           "vocab_size": dcfg.vocab_size, "hidden_size": dcfg.hidden_size,
           "intermediate_size": dcfg.intermediate_size, "num_hidden_layers": 1,
           "num_attention_heads": dcfg.num_attention_heads, "num_key_value_heads": dcfg.num_key_value_heads,
           "head_dim": dcfg.head_dim, "rms_norm_eps": dcfg.rms_norm_eps, "rope_theta": dcfg.rope_theta,
           "rope_scaling": rope, "max_position_embeddings": tcfg.max_position_embeddings, "pretraining_tp": 1,
           "pad_token_id": None, "tie_word_embeddings": False, "attention_bias": False,
           **layout.config(dcfg), "torch_dtype": dtype}
    return cfg


def official_tensors(draft, layout: Layout, dtype: str) -> dict:
    """{official name: numpy array} of the exported head: floats in `dtype`, ids int64, t2d bool."""
    dt = resolve_dtype(dtype)
    what = f"exporting the {layout.title} head to the {layout.name!r} layout"
    params = {k: _host(v) for k, v in quant.dequantize_tree(dict(draft.params)).items()}
    named = export(params, layout.rules, what, inverse=layout.inverse)
    out = {}
    for name, a in named.items():
        a = np.asarray(a)
        out[name] = a.astype(np.int64) if a.dtype.kind in "iu" else np.ascontiguousarray(a.astype(dt))
    if EMBED_KEY not in out:  # the target's embedding, which the head shares
        out[EMBED_KEY] = np.asarray(quant.as_float(draft.target.params["embed"])).astype(dt)
    if layout.name == "eagle3":
        out["t2d"] = t2d_mask(np.asarray(draft.params["d2t"]), draft.config.vocab_size)
    return out


def _host(tree):
    import jax
    return jax.tree.map(np.asarray, tree)


def save_official(draft, path, layout: str | None = None, dtype: str = "float16", card: dict | None = None,
                  base_model: str | None = None, license: str | None = None) -> Path:
    """Write `draft` in the official PyTorch layout of its kind (see the module docstring): config.json,
    model.safetensors and a README.md model card, into `path` atomically (a temp dir renamed into place; on any
    error nothing is left). `path` must not exist or be an empty directory.

    layout: "eagle" (EAGLE-1/2) or "eagle3" (EAGLE-3); None takes the head's own. dtype: "float16" (default),
    "bfloat16" or "float32". card: the head's own card ({"extra": config.json's extra, "profile": its acceptance
    profile}); None reads it from where the head was loaded (`draft.name`), {} writes none. base_model / license:
    the card's hub metadata (default: the target's hub model and its license when ddd-jax knows them).
    """
    lo = layout_for(draft, layout)
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not an empty directory: choose a new output directory")
    problems = lo.problems(draft.config)
    if problems:
        raise ValueError(f"this {lo.title} head cannot be written in the {lo.name!r} layout: it has "
                         + "; ".join(problems))
    if draft.config.rope_scaling:
        warnings.warn(f"the head's rope_scaling {draft.config.layer_config().rope_scaling_dict()} is written as it is: "
                      "SGLang reads it, EAGLE's own EConfig accepts only 'linear' / 'dynamic' scaling", stacklevel=2)
    cfg = official_config(draft, lo, dtype)
    tensors = official_tensors(draft, lo, dtype)
    side = {k: tensors.pop(k) for k in EXTENSIONS if k in tensors}  # ours: never where official loaders look
    if card is None:
        card = head_card(draft)
    readme = model_card(draft, lo, dtype, cfg, tensors, card, base_model, license, side)
    with dio.atomic_dir(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        from .safetensors import write_safetensors
        write_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        if side:
            (tmp / EXTENSIONS_FILE).parent.mkdir()
            write_safetensors(side, tmp / EXTENSIONS_FILE, metadata={"format": "ddd-jax-extensions"})
        (tmp / "README.md").write_text(readme)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)
    return path


# ---------------------------------------------------------------------------------------------------------
# The head's own card and the model card


def head_meta(path_or_name) -> dict | None:
    """config.json's content of a head in our format (a packaged name, a directory or a .tar), else None."""
    from . import registry
    from .ours import HEAD_FORMAT, read_head_tar
    s = str(path_or_name)
    try:
        if s in registry.NAMED_DRAFTS:
            meta = dio.read_json(registry.named_draft_dir(s) / "config.json")
        elif Path(s).is_file() and s.endswith(".tar"):
            meta = read_head_tar(Path(s))[0]
        elif (Path(s) / "config.json").is_file():
            meta = dio.read_json(Path(s) / "config.json")
        else:
            return None
    except (OSError, ValueError):
        return None
    return meta if meta.get("format") == HEAD_FORMAT else None


def head_target(path_or_name) -> str | None:
    """The target a head in our format names as its own (`draft_config.target_name`, else `extra.trained_for`)."""
    meta = head_meta(path_or_name) or {}
    return (meta.get("draft_config") or {}).get("target_name") or (meta.get("extra") or {}).get("trained_for")


def head_card(draft) -> dict:
    """{"extra": its config.json's extra, "profile": its acceptance profile} for a head loaded from our format
    (found by `draft.name`); {} when there is neither."""
    card = {}
    meta = head_meta(draft.name) if draft.name else None
    if meta and meta.get("extra"):
        card["extra"] = meta["extra"]
    prof = _profile_beside(draft.name) if draft.name else None
    if prof:
        card["profile"] = prof
    return card


PROFILE_FILE = "profile.json"  # as `settings.calibration` (above this layer) names a head's acceptance profile


def _profile_beside(path_or_name) -> dict | None:
    """The acceptance profile stored beside a head directory (a packaged name or a path), if any."""
    from . import registry
    s = str(path_or_name)
    d = registry.HEADS_DIR / registry.NAMED_DRAFTS[s] if s in registry.NAMED_DRAFTS else Path(s)
    try:
        prof = dio.read_json(d / PROFILE_FILE) if (d / PROFILE_FILE).is_file() else None
    except (OSError, ValueError):
        return None
    return prof if isinstance(prof, dict) and prof.get("format") == "ddd-jax-acceptance-profile" else None


def model_card(draft, layout: Layout, dtype: str, cfg: dict, tensors: dict, card: dict, base_model=None,
               license=None, side: dict | None = None) -> str:
    """README.md of an exported head: the hub's metadata block, the files, how to load it, the head's own card."""
    from .registry import HUB_TARGETS
    dcfg = draft.config
    tname = dcfg.target_name or getattr(draft.target, "name", None) or "the target"
    hub = HUB_TARGETS.get(tname, {})
    base_model = base_model or hub.get("base_model") or tname
    license = license or hub.get("license") or "other"
    name = Path(str(draft.name)).name if draft.name else f"{tname}-{layout.name}"
    tags = ["speculative-decoding", "eagle" if layout.name == "eagle" else "eagle3", "ddd-jax"]
    lines = ["---", f"base_model: {base_model}", "library_name: ddd-jax", f"license: {license}", "tags:",
             *[f"- {t}" for t in tags], "---", "",
             f"# {name} ({layout.title}, official layout)", "",
             f"An {layout.title} draft head for `{tname}` (vocabulary {dcfg.vocab_size}, hidden size "
             f"{dcfg.target_hidden_size or dcfg.hidden_size}), written by ddd-jax in the official layout of "
             f"SafeAILab/EAGLE ({'`eagle/model/cnets1.py`' if layout.name == 'eagle' else '`eagle/model/cnets.py`'})"
             f", {dtype}. It drafts tokens for lossless speculative decoding: the target verifies every one.", "",
             "## Files", "",
             "| file | holds |", "|---|---|",
             f"| `config.json` | LlamaConfig fields, one decoder layer, architectures `{layout.architecture}` |",
             "| `model.safetensors` | the tensors below: exactly the official model's |",
             *([f"| `{EXTENSIONS_FILE}` | ddd-jax's own tensors (below), which official loaders never open |"]
               if side else []),
             "| `README.md` | this card |", "",
             "| tensor | file | shape | dtype |", "|---|---|---|---|",
             *[f"| `{k}` | model.safetensors | {list(v.shape)} | {v.dtype} |" for k, v in sorted(tensors.items())],
             *[f"| `{k}` | {EXTENSIONS_FILE} | {list(v.shape)} | {v.dtype} |" for k, v in sorted((side or {}).items())],
             ""]
    notes = [f"`{EMBED_KEY}` is the head's own embedding (narrower than the target's)." if "embed" in draft.params
             else f"`{EMBED_KEY}` is a copy of the target's embedding (the head shares it)."]
    if layout.name == "eagle" and DRAFT_IDS_KEY in (side or {}):
        notes.append(f"`{DRAFT_IDS_KEY}` (in `{EXTENSIONS_FILE}`) is ddd-jax's own: the {dcfg.draft_vocab_size} "
                     "target token ids this head drafts over (a reduced draft vocabulary). ddd-jax reads it back and "
                     "restricts the draft to those tokens; SafeAILab/EAGLE's code (which loads model.safetensors "
                     "with `strict=True`) and SGLang never open the side file and draft over the whole vocabulary. "
                     "Both are lossless: the target verifies every drafted token, so only the acceptance rate can "
                     "differ. For SGLang's FR-Spec the same ids are a hot-token map (`--speculative-token-map`).")
    if layout.name == "eagle3":
        notes.append("`d2t` holds EAGLE's offsets (target id = draft id + d2t[draft id]) and `t2d` marks the target "
                     "ids of the draft vocabulary. `target_hidden_size` is written even when it equals "
                     "`hidden_size`, so EAGLE's loader takes `embed_tokens.weight` from this file.")
    if layout.name == "eagle" and not dcfg.fc_bias:
        notes.append("`fc` has no bias (`\"bias\": false`); SGLang's `LlamaForCausalLMEagle` always builds one.")
    if dcfg.rope_scaling:
        notes.append("`rope_scaling` is the target's; EAGLE's own `EConfig` accepts only linear / dynamic scaling.")
    lines += [*[f"- {n}" for n in notes], "", "## Loading", "",
              "```python", "# ddd-jax (JAX)", "import ddd_jax",
              f"target = ddd_jax.load_target({json.dumps(tname)})",
              "draft = ddd_jax.load_draft(\"<this directory>\", target)", "```", ""]
    if layout.name == "eagle":
        lines += ["```python", "# SafeAILab/EAGLE", "from eagle.model.ea_model import EaModel",
                  "model = EaModel.from_pretrained(use_eagle3=False, base_model_path=\"<target>\", "
                  "ea_model_path=\"<this directory>\")", "```", ""]
    else:
        lines += ["```python", "# SafeAILab/EAGLE", "from eagle.model.ea_model import EaModel",
                  "model = EaModel.from_pretrained(use_eagle3=True, base_model_path=\"<target>\", "
                  "ea_model_path=\"<this directory>\")", "```", "",
                  "```bash", "# SGLang", "python -m sglang.launch_server --model <target> --speculative-algorithm "
                  "EAGLE3 --speculative-draft-model-path <this directory>", "```", ""]
    lines += _card_sections(card)
    return "\n".join(lines).rstrip() + "\n"


def _card_sections(card: dict) -> list[str]:
    """The head's own card: training (data, steps, held-out top-1) and its acceptance profile's τ table."""
    out = []
    extra = card.get("extra") or {}
    rows = []
    data = extra.get("data")
    if isinstance(data, dict):
        rows.append(("data", ", ".join(f"{k} {v}" for k, v in data.items() if k != "path")))
    elif data:
        rows.append(("data", str(data)))
    fit = extra.get("fit_config") if isinstance(extra.get("fit_config"), dict) else {}
    if extra.get("step") is not None:
        rows.append(("steps", str(extra["step"])))
    for k in ("batch_size", "seq_len", "lr"):
        if fit.get(k) is not None:
            rows.append((k.replace("_", " "), str(fit[k])))
    for k in ("train_seqs", "train_tokens"):
        if extra.get(k) is not None:
            rows.append((k.replace("_", " "), str(extra[k])))
    ev = extra.get("eval_metrics") if isinstance(extra.get("eval_metrics"), dict) else {}
    if ev.get("eval_acc") is not None:
        rows.append(("held-out top-1", f"{ev['eval_acc']:.3f}"))
    vocab = extra.get("draft_vocab") if isinstance(extra.get("draft_vocab"), dict) else {}
    if vocab.get("draft_vocab_size"):
        cov = vocab.get("train_coverage")
        rows.append(("draft vocabulary", f"{vocab['draft_vocab_size']} tokens"
                     + (f" ({cov:.1%} of the training tokens)" if isinstance(cov, float) else "")))
    if extra.get("converted_from"):
        rows.append(("converted from", f"an official {extra.get('source_layout', '')} head".replace("  ", " ")))
    if rows:
        out += ["## Training", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], ""]
    prof = card.get("profile") or {}
    entries = [e for e in prof.get("entries", []) if e.get("tau") is not None]
    if entries:
        out += ["## Acceptance (τ)", "",
                f"Mean accepted tokens per target call (τ) in the head's acceptance profile, measured by ddd-jax over "
                f"{prof.get('prompts')} held-out chat prompts, {prof.get('max_new_tokens')} new tokens each, greedy "
                f"({str(prof.get('date') or '')[:10]}); a label's `lookup` adds context-lookup candidates.", "",
                "| setting | method | top_k | total_tokens | depth | DDD rule | τ |", "|---|---|---|---|---|---|---|"]
        for e in entries:
            t, d = e.get("tree") or {}, e.get("ddd") or {}
            rule = (f"S={tuple(d.get('check_steps', ()))}, x={d.get('threshold')}, n={d.get('max_depth')}"
                    if d else "")
            out.append(f"| {e.get('label')} | {e.get('method')} | {t.get('top_k')} | {t.get('total_tokens')} | "
                       f"{t.get('depth')} | {rule} | {e['tau']:.2f} |")
        out.append("")
    return out
