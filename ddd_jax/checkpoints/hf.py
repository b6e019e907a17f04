"""HF checkpoints (Llama, Mistral, Qwen2, Qwen3) -> our target: the key table and HF directories (safetensors,
sharded, pytorch .bin, tokenizer).

`HF_LLAMA_RULES` maps the state-dict names these architectures share (`LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`) onto `llama.param_shapes` keys through the key-table engine
(`keytable.plan` + `keytable.convert`). The config (`read_hf_config`, dispatching on `model_type`) decides which
family leaves are expected (q/k/v biases, o bias, q/k norms); a tensor the config does not expect, or one it
expects that is absent, fails the load. Every shape is checked before one tensor is read; tensors are then read
one at a time (memory-mapped safetensors, mmapped .bin).
"""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from .. import io as dio
from .. import llama
from ..config import ModelConfig
from ..target import Target
from ..keytable import Rule, SourceTensor, convert, flat_shapes, plan, resolve_dtype, source_dtype
from .safetensors import safetensors_sources


def llama_layer_rules(prefix: str, input_norm: bool = True) -> tuple:
    """Rules for HF-named decoder layers `<prefix>layers.N.*` (shared by targets and EAGLE heads)."""
    p = re.escape(prefix) + r"layers\.(\d+)\."
    rules = [Rule(p + r"input_layernorm\.weight", "layers.attn_norm")] if input_norm else []
    rules += [Rule(p + f"self_attn\\.{n}_proj\\.weight", f"layers.w{n}", transpose=True) for n in "qkvo"]
    # family leaves: used only where the config expects them (`plan` reports the others as unexpected)
    rules += [Rule(p + f"self_attn\\.{n}_proj\\.bias", f"layers.b{n}") for n in "qkvo"]
    rules += [Rule(p + f"self_attn\\.{n}_norm\\.weight", f"layers.{n}_norm") for n in "qk"]
    rules.append(Rule(p + r"post_attention_layernorm\.weight", "layers.mlp_norm"))
    rules += [Rule(p + f"mlp\\.{n}_proj\\.weight", f"layers.w_{n}", transpose=True) for n in ("gate", "up", "down")]
    return tuple(rules)


# HF `LlamaForCausalLM` state-dict names -> `llama.param_shapes` keys.
HF_LLAMA_RULES = (
    Rule(r"model\.embed_tokens\.weight", "embed"),
    *llama_layer_rules("model."),
    Rule(r"model\.norm\.weight", "final_norm"),
    Rule(r"lm_head\.weight", "lm_head", transpose=True),
)
# Known non-weight buffers that some checkpoints carry.
HF_IGNORE = (r".*rotary_emb\.inv_freq", r".*\.masked_bias", r".*\.attn\.bias")


# ---------------------------------------------------------------------------------------------------------
# Reading HF directories lazily


def torch_bin_sources(path) -> list[SourceTensor]:
    """The tensors of a pytorch_model*.bin (torch.load(weights_only=True), mmap when possible)."""
    import torch  # only on this path
    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) format cannot be mmapped
        sd = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(sd, dict):
        raise ValueError(f"{path}: expected a state dict, got {type(sd).__name__}")
    if "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]

    def to_np(t):
        t = t.detach()
        if t.dtype == torch.bfloat16:
            import ml_dtypes
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    out = []
    for name, t in sd.items():
        if not hasattr(t, "shape"):
            continue
        out.append(SourceTensor(name, tuple(t.shape), lambda t=t: to_np(t), None))
    return out


def checkpoint_sources(d: Path) -> list[SourceTensor]:
    """All weight tensors of an HF-style directory: model.safetensors, a sharded index, or pytorch .bin."""
    d = Path(d)
    for index_name, reader in (("model.safetensors.index.json", safetensors_sources),
                               ("pytorch_model.bin.index.json", torch_bin_sources)):
        index = d / index_name
        if index.is_file():
            wm = dio.read_json(index).get("weight_map")
            if not isinstance(wm, dict):
                raise ValueError(f"{index}: no weight_map")
            files = sorted(set(wm.values()))
            missing = [f for f in files if not (d / f).is_file()]
            if missing:
                raise FileNotFoundError(f"{index} names shard files that do not exist: {missing}")
            out = []
            for f in files:
                out.extend(reader(d / f))
            return out
    st = sorted(d.glob("*.safetensors"))
    if st:
        out = []
        for f in st:
            out.extend(safetensors_sources(f))
        return out
    bins = sorted(d.glob("pytorch_model*.bin")) or sorted(d.glob("*.bin"))
    if bins:
        out = []
        for f in bins:
            out.extend(torch_bin_sources(f))
        return out
    raise FileNotFoundError(
        f"{d}: no weights found (expected model.safetensors, a sharded model.safetensors.index.json, "
        f"or pytorch_model*.bin)")


# ---------------------------------------------------------------------------------------------------------
# HF LLaMA directory -> params, config, tokenizer, Target


def load_hf_params(d, cfg, dtype=None, as_jax: bool = True, mesh=None) -> dict:
    """Convert the weights of HF directory `d` to `llama.param_shapes(cfg)` params (sharded over `mesh`, tensor by
    tensor, when given)."""
    d = Path(d)
    sources = checkpoint_sources(d)
    dtype = resolve_dtype(dtype) or source_dtype(sources, "model.embed_tokens.weight")
    expected = flat_shapes(llama.param_shapes(cfg))
    ignore = HF_IGNORE + ((r"lm_head\.weight",) if cfg.tie_word_embeddings else ())
    rules = [r for r in HF_LLAMA_RULES if not (cfg.tie_word_embeddings and r.key == "lm_head")]
    what = f"HF checkpoint {d}"
    names = {s.name for s in sources}
    if not cfg.tie_word_embeddings and "lm_head.weight" not in names and "model.embed_tokens.weight" in names:
        raise ValueError(f"{what}: missing tensors ['lm_head'] (config.json has tie_word_embeddings=false but there "
                         "is no lm_head.weight)")
    slots = plan(sources, rules, expected, what, ignore=ignore)
    if cfg.tie_word_embeddings:
        check_tied_lm_head(sources, what)
    return convert(slots, expected, dtype, as_jax=as_jax, place=target_placer(cfg, mesh))


def target_placer(cfg, mesh):
    """The per-tensor placement of a target's weights on `mesh` (None: ordinary arrays)."""
    if mesh is None:
        return None
    from .. import sharding
    sharding.check_mesh(mesh)
    sharding.check_divisible(cfg, mesh)
    return sharding.placer(mesh, llama.param_axes(cfg))


def check_tied_lm_head(sources: list[SourceTensor], what: str) -> None:
    """With tie_word_embeddings=true a stored lm_head.weight is dropped; it must then equal the embedding."""
    import numpy as np
    by_name = {s.name: s for s in sources}
    head, emb = by_name.get("lm_head.weight"), by_name.get("model.embed_tokens.weight")
    if head is None or emb is None:
        return
    if tuple(head.shape) != tuple(emb.shape) or not np.array_equal(np.asarray(head.load()), np.asarray(emb.load())):
        raise ValueError(f"{what}: config.json has tie_word_embeddings=true but lm_head.weight differs from "
                         "model.embed_tokens.weight (set tie_word_embeddings=false to use it)")


def read_tokenizer_files(d) -> tuple[object | None, str | None, dict]:
    """(tokenizers.Tokenizer or None, chat template or None, special tokens) from an HF-style directory."""
    d = Path(d)
    tok = None
    if (d / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tc = dio.read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    template = tc.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()
    if template is None and (d / "chat_template.json").is_file():
        template = dio.read_json(d / "chat_template.json").get("chat_template")
    special = {}
    for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = tc.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            special[k] = v
    return tok, template, special


def read_hf_config(d):
    """ModelConfig from config.json (dispatching on `model_type`; unsupported ones fail naming the supported), with
    generation_config.json's eos ids merged in (e.g. Llama-3 <|eot_id|>)."""
    d = Path(d)
    raw = dio.read_json(d / "config.json")
    try:
        cfg = ModelConfig.from_hf_config(raw)
    except ValueError as e:
        raise ValueError(f"{d}/{e}" if str(e).startswith("config.json") else f"{d}/config.json: {e}") from None
    gen = d / "generation_config.json"
    if gen.is_file():
        g = dio.read_json(gen).get("eos_token_id")
        extra = [] if g is None else (list(g) if isinstance(g, (list, tuple)) else [g])
        eos = tuple(dict.fromkeys(list(cfg.eos_token_id) + [int(x) for x in extra]))
        cfg = replace(cfg, eos_token_id=eos)
    return raw, cfg


def load_hf_dir(path, dtype=None, name: str | None = None, as_jax: bool = True, mesh=None) -> Target:
    """A Target from an HF Llama / Mistral / Qwen2 / Qwen3 directory (config.json + safetensors / sharded / pytorch .bin weights)."""
    path = Path(path)
    _, cfg = read_hf_config(path)
    params = load_hf_params(path, cfg, dtype, as_jax=as_jax, mesh=mesh)
    tok, template, special = read_tokenizer_files(path)
    if tok is not None and special.get("eos_token") is not None:
        # make sure generation stops on the tokenizer's eos (e.g. an end-of-turn token) too
        eid = tok.token_to_id(special["eos_token"])
        if eid is not None and eid not in cfg.eos_token_id:
            cfg = replace(cfg, eos_token_id=tuple(cfg.eos_token_id) + (int(eid),))
    return Target(name or path.name, cfg, params, tok, template, special, mesh=mesh)
