"""PyTorch references for `convert --check` and tests: EAGLE-1/2 and EAGLE-3 heads in the official state-dict layouts,
transformers targets.

Importing this module imports torch; the rest of ddd_jax never does except through here (and `hf.torch_bin_sources`).
The head mirrors EAGLE's `cnets1.py` `Model`: fc(cat(embed(tokens), features)) -> one LLaMA decoder layer
whose layer 0 has no input_layernorm; its `state_dict()` uses the official key names.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .hf import checkpoint_sources
from ..llama import output_embedding
from ..backends.cpu.quant import as_float, dequantize_tree


class _RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


class _Attention(nn.Module):
    def __init__(self, c, in_mult: int = 1):
        super().__init__()
        self.n, self.k, self.h = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.theta = c["rope_theta"]
        D = c["hidden_size"]
        qkv_bias = bool(c.get("qkv_bias", False))  # cnets1: q/k/v biases when the config has qkv_bias; EAGLE-3: q/k/v read 2D
        self.q_proj = nn.Linear(in_mult * D, self.n * self.h, bias=qkv_bias)
        self.k_proj = nn.Linear(in_mult * D, self.k * self.h, bias=qkv_bias)
        self.v_proj = nn.Linear(in_mult * D, self.k * self.h, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n * self.h, D, bias=False)
        # [H/2] float32 rope inverse frequencies: a plain attribute, so neither the state dict nor `.to(dtype)`
        # touches it (a scaled rope may overwrite it)
        self.inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.h, 2, dtype=torch.float32) / self.h))

    def forward(self, x, pos, past=None, mask=None):
        """x [B,T,D], pos [B,T]; past: (k, v) [B,K,S0,H] cached keys/values (rope applied) or None;
        mask: [B,T,S0+T] bool (True = may attend), default causal. Returns (out [B,T,D], (k, v) incl. past)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n, self.h).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.k, self.h).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.k, self.h).transpose(1, 2)
        ang = pos.float()[:, None, :, None] * self.inv_freq.to(pos.device)  # [B,1,T,H/2]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

        def rot(t):
            t1, t2 = t[..., : self.h // 2], t[..., self.h // 2:]
            return t * cos + torch.cat([-t2, t1], -1) * sin

        q, k = rot(q).to(x.dtype), rot(k).to(x.dtype)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        kv = (k, v)
        g = self.n // self.k
        kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        att = q @ kr.transpose(2, 3) / math.sqrt(self.h)
        if mask is None:
            S = kr.shape[2]
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)[None]
        att = att.masked_fill(~mask[:, None], torch.finfo(att.dtype).min)
        o = torch.softmax(att.float(), -1).to(v.dtype) @ vr
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n * self.h)), kv


class _MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        D, F = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(D, F, bias=False)
        self.up_proj = nn.Linear(D, F, bias=False)
        self.down_proj = nn.Linear(F, D, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer0(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.post_attention_layernorm = _RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x, pos, past=None, mask=None):
        a, kv = self.self_attn(x, pos, past, mask)
        x = x + a  # layer 0: no input_layernorm
        return x + self.mlp(self.post_attention_layernorm(x)), kv


def _norm_config(c: dict) -> dict:
    c = dict(c)
    c.setdefault("num_key_value_heads", c["num_attention_heads"])
    c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]  # as cnets1, whatever the config says
    c.setdefault("rms_norm_eps", 1e-6)
    c["rope_theta"] = c.get("rope_theta") or 10000.0
    return c


class TorchEagleHead(nn.Module):
    """EAGLE-1/2 head with the official state-dict names (embed_tokens, fc, layers.0.*); `qkv_bias` in the config
    adds q/k/v biases (EAGLE's heads for Qwen2 targets)."""

    def __init__(self, config: dict):
        super().__init__()
        c = _norm_config(config)
        self.config = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.fc = nn.Linear(2 * c["hidden_size"], c["hidden_size"], bias=c.get("bias", True))
        self.layers = nn.ModuleList([_Layer0(c)])

    def forward(self, features, tokens):
        """features [B,T,D] (feature_i), tokens [B,T] (token_{i+1}) -> next features [B,T,D]."""
        B, T, _ = features.shape
        pos = torch.arange(T, device=features.device)[None].expand(B, T)
        return self.step(features, tokens, pos)[0]

    def step(self, features, tokens, positions, past=None, mask=None):
        """One cached head forward (EAGLE's draft steps): features [B,T,D], tokens [B,T], positions [B,T];
        past: (k, v) [B,K,S0,H] from earlier calls or None; mask [B,T,S0+T] bool over past + new (default
        causal). Returns (next features [B,T,D], (k, v) [B,K,S0+T,H])."""
        e = self.embed_tokens(tokens).to(features.dtype)
        x = self.fc(torch.cat([e, features], -1))
        return self.layers[0](x, positions, past, mask)


def random_eagle_head(config: dict, seed: int = 0, embed: np.ndarray | None = None) -> TorchEagleHead:
    torch.manual_seed(seed)
    head = TorchEagleHead(config).float().eval()
    with torch.no_grad():
        for n, p in head.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n == "fc.bias":
                p.copy_(0.02 * torch.randn_like(p))
            elif p.ndim == 2:
                p.copy_(0.05 * torch.randn_like(p))
        if embed is not None:
            head.embed_tokens.weight.copy_(torch.from_numpy(np.array(embed, np.float32)))
    return head


def _official_config(c: dict, architecture: str, **more) -> dict:
    """The LlamaConfig-style config.json of a released EAGLE head (one decoder layer)."""
    cfg = {"architectures": [architecture], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
           "num_attention_heads": c["num_attention_heads"], "num_key_value_heads": c["num_key_value_heads"],
           "num_hidden_layers": 1, "rms_norm_eps": c["rms_norm_eps"], "rope_theta": c["rope_theta"],
           "vocab_size": c["vocab_size"], **more, "max_position_embeddings": 2048, "torch_dtype": "float32"}
    return cfg


def _write_official(path: Path, cfg: dict, sd: dict, fmt: str) -> Path:
    """config.json + pytorch_model.bin (fmt "bin") or model.safetensors, as released heads are stored."""
    if fmt not in ("bin", "safetensors"):
        raise ValueError(f"fmt must be 'bin' or 'safetensors', got {fmt!r}")
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    if fmt == "bin":
        torch.save(sd, path / "pytorch_model.bin")
    else:
        from safetensors.numpy import save_file
        save_file({k: v.numpy() for k, v in sd.items()}, str(path / "model.safetensors"))
    return path


def write_official_eagle_head(head: TorchEagleHead, path, fmt: str = "bin", extra_config: dict | None = None) -> Path:
    """Write `head` the way EAGLE's released heads look: config.json (LlamaConfig, num_hidden_layers=1,
    "bias" only when False) + pytorch_model.bin or model.safetensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = head.config
    cfg = _official_config(c, "LlamaForCausalLM")
    if not c.get("bias", True):
        cfg["bias"] = False
    if c.get("qkv_bias"):
        cfg["qkv_bias"] = True
    cfg.update(extra_config or {})
    sd = {k: v.detach().clone().contiguous() for k, v in head.state_dict().items()}
    return _write_official(path, cfg, sd, fmt)


def load_official_head(src, dtype=torch.float32) -> TorchEagleHead:
    """The torch reference head from an official EAGLE-1/2 directory (for --check)."""
    src = Path(src)
    cfg = json.loads((src / "config.json").read_text())
    head = TorchEagleHead(cfg)
    # what EAGLE-2's `ea_model.py` does: every tensor of the checkpoint (model.safetensors / pytorch_model.bin; never
    # ddd-jax's side file) into the official Model with `load_state_dict(strict=True)` -- an unknown or a missing
    # tensor fails the load (released heads' non-persistent rotary buffers aside)
    sd = {s.name: torch.from_numpy(np.array(s.load(), np.float32)) for s in checkpoint_sources(src)
          if not s.name.endswith("rotary_emb.inv_freq")}
    head.load_state_dict(sd, strict=True)
    return head.to(dtype).eval()


def head_check(src, draft, tokens, features) -> dict:
    """Run the official head at `src` (torch) and our `draft` on the same inputs; max abs differences.

    tokens [1,T], features [1,T,D] (the target's features). The torch head uses the *target's* embedding
    (as EAGLE does at run time), so only the head's own weights are compared.
    """
    head = load_official_head(src)
    tp = dequantize_tree(draft.target.params)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(torch.from_numpy(np.array(tp["embed"], np.float32)))
        ref = head(torch.from_numpy(np.array(features, np.float32)), torch.from_numpy(np.array(tokens)).long())
        w = np.asarray(output_embedding(tp, draft.target.config), np.float32)
        ref_logits = ref @ torch.from_numpy(w).T
    feats, logits = draft.forward(tokens, features)
    return {"max_feature_diff": float(np.abs(np.asarray(feats, np.float32) - ref.numpy()).max()),
            "max_logit_diff": float(np.abs(np.asarray(logits, np.float32) - ref_logits.numpy()).max())}


class _Eagle3Layer(nn.Module):
    """EAGLE `cnets.py` `LlamaDecoderLayeremb`: q/k/v over cat(input_layernorm(emb), hidden_norm(h)); residual h."""

    def __init__(self, c):
        super().__init__()
        D, eps = c["hidden_size"], c["rms_norm_eps"]
        self.self_attn = _Attention(c, in_mult=2)
        self.mlp = _MLP(c)
        self.hidden_norm = _RMSNorm(D, eps)
        self.input_layernorm = _RMSNorm(D, eps)
        self.post_attention_layernorm = _RMSNorm(D, eps)

    def forward(self, emb, h, pos):
        a, _ = self.self_attn(torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], -1), pos)  # (out, new kv)
        x = h + a
        return x + self.mlp(self.post_attention_layernorm(x))


class TorchEagle3Head(nn.Module):
    """EAGLE-3 head with the official state-dict names (EAGLE `cnets.py` `Model`: embed_tokens, fc (no bias),
    midlayer.*, norm, lm_head [V', D], d2t offset and t2d mask buffers). layer_prefix="layers.0." gives the
    variant naming (`state_dict_official`)."""

    def __init__(self, config: dict):
        super().__init__()
        c = _norm_config(config)
        self.config = c
        D, V = c["hidden_size"], c["vocab_size"]
        Vd = c.get("draft_vocab_size") or V
        self.embed_tokens = nn.Embedding(V, D)
        self.fc = nn.Linear(3 * (c.get("target_hidden_size") or D), D, bias=False)
        self.midlayer = _Eagle3Layer(c)
        self.norm = _RMSNorm(D, c["rms_norm_eps"])
        self.lm_head = nn.Linear(D, Vd, bias=False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))

    def forward(self, hidden, tokens):
        """hidden [B,T,3Ht] target features (or [B,T,D] own outputs: no fc, as `Model.forward`), tokens [B,T] ->
        (next hidden [B,T,D], draft-vocabulary logits [B,T,V'])."""
        B, T = tokens.shape
        emb = self.embed_tokens(tokens).to(hidden.dtype)
        if hidden.shape[-1] != emb.shape[-1]:
            hidden = self.fc(hidden)
        out = self.midlayer(emb, hidden, torch.arange(T)[None].expand(B, T))
        return out, self.lm_head(self.norm(out))

    def target_ids(self) -> torch.Tensor:
        return torch.arange(self.d2t.shape[0]) + self.d2t


def random_eagle3_head(config: dict, seed: int = 0, embed: np.ndarray | None = None, draft_ids=None) -> TorchEagle3Head:
    """A random EAGLE-3 head; draft_ids (sorted target ids, default a random subset) fill d2t/t2d as EAGLE does."""
    torch.manual_seed(seed)
    head = TorchEagle3Head(config).float().eval()
    with torch.no_grad():
        for n, p in head.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in n else 0.05 * torch.randn_like(p))
        if embed is not None:
            head.embed_tokens.weight.copy_(torch.from_numpy(np.array(embed, np.float32)))
        V, Vd = head.t2d.shape[0], head.d2t.shape[0]
        if draft_ids is None:
            draft_ids = np.sort(np.random.default_rng(seed).choice(V, Vd, replace=False))
        ids = torch.as_tensor(np.asarray(draft_ids), dtype=torch.long)
        head.d2t.copy_(ids - torch.arange(Vd))  # EAGLE's offsets: target id = draft id + d2t[draft id]
        head.t2d.zero_()
        head.t2d[ids] = True
    return head


def write_official_eagle3_head(head: TorchEagle3Head, path, fmt: str = "bin", layout: str = "midlayer",
                               with_embed: bool = True, extra_config: dict | None = None) -> Path:
    """Write `head` as EAGLE-3 releases look: config.json (LlamaConfig + draft_vocab_size) + weights.
    layout "midlayer" (EAGLE's names) or "layers" (the `layers.0.` variant); with_embed keeps embed_tokens."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = head.config
    cfg = _official_config(c, "LlamaForCausalLMEagle3", draft_vocab_size=head.d2t.shape[0])
    if c.get("target_hidden_size"):
        cfg["target_hidden_size"] = c["target_hidden_size"]
    cfg.update(extra_config or {})
    sd = {}
    for k, v in head.state_dict().items():
        if k == "embed_tokens.weight" and not with_embed:
            continue
        if layout == "layers" and k.startswith("midlayer."):
            k = "layers.0." + k[len("midlayer."):]
        sd[k] = v.detach().clone().contiguous()
    return _write_official(path, cfg, sd, fmt)


def load_official_eagle3_head(src, dtype=torch.float32) -> TorchEagle3Head:
    """The torch reference EAGLE-3 head from an official directory (either layout; for --check)."""
    src = Path(src)
    head = TorchEagle3Head(json.loads((src / "config.json").read_text()))
    sd = {}
    for s in checkpoint_sources(src):
        if s.name.endswith("rotary_emb.inv_freq"):
            continue
        x = np.asarray(s.load())
        t = torch.from_numpy(np.array(x, np.float32 if x.dtype.kind == "f" or x.dtype.name == "bfloat16" else x.dtype))
        sd["midlayer." + s.name[len("layers.0."):] if s.name.startswith("layers.0.") else s.name] = t
    sd.setdefault("embed_tokens.weight", head.embed_tokens.weight.detach())
    head.load_state_dict(sd, strict=True)
    return head.to(dtype).eval()


def eagle3_head_check(src, draft, tokens, features) -> dict:
    """Official EAGLE-3 head at `src` (torch) vs our `draft` on target features [1,T,3Ht]: max abs differences of
    the next hidden and of the logits (draft-vocabulary logits placed at their target ids)."""
    head = load_official_eagle3_head(src)
    D = head.config["hidden_size"]
    with torch.no_grad():
        if head.embed_tokens.weight.shape[1] == draft.target.config.hidden_size and "embed" not in draft.params:
            head.embed_tokens.weight.copy_(torch.from_numpy(np.array(as_float(draft.target.params["embed"]), np.float32)))
        ref, ref_sub = head(torch.from_numpy(np.array(features, np.float32)), torch.from_numpy(np.array(tokens)).long())
    ids = head.target_ids().numpy()
    feats, logits = draft.forward(tokens, features)
    logits = np.asarray(logits, np.float32)
    assert feats.shape[-1] == D
    diff = float(np.abs(logits[..., ids] - ref_sub.numpy()).max())
    if not np.isneginf(np.delete(logits, ids, axis=-1)).all():  # ids outside the draft vocabulary must be -inf
        diff = float("inf")
    return {"max_feature_diff": float(np.abs(np.asarray(feats, np.float32) - ref.numpy()).max()),
            "max_logit_diff": diff}


def target_check(src, target, tokens) -> dict:
    """transformers' logits for the checkpoint at `src` (HF dir or .gguf) vs `target.forward`: max abs diff."""
    import transformers
    src = Path(src)
    if src.is_file() and src.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                                  dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        ref = model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()
    import jax.numpy as jnp
    T = tokens.shape[1]
    got = np.asarray(target.forward(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(T), tokens.shape)).logits,
                     np.float32)
    return {"max_logit_diff": float(np.abs(got - ref).max()),
            "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean())}


def check_tokens(target, n: int = 12) -> np.ndarray:
    """A few token ids for --check runs: a short English sentence when there is a tokenizer."""
    if target.tokenizer is not None:
        ids = target.encode("The quick brown fox jumps over the lazy dog, then naps in the sun.")[:n]
        if ids:
            return np.asarray([ids], np.int32)
    rng = np.random.default_rng(0)
    return rng.integers(0, target.config.vocab_size, (1, n), dtype=np.int32)


# the torch reference check of each head kind with an official PyTorch layout: (src, draft, tokens, features) -> diffs
HEAD_CHECKS = {"eagle1": head_check, "eagle3": eagle3_head_check}


def check_head(src, draft) -> dict:
    """Max differences between the torch reference head at `src` and `draft` on target features of a few tokens."""
    import jax.numpy as jnp
    from .. import eagle, llama
    check = HEAD_CHECKS.get(draft.config.head_type)
    if check is None:
        raise ValueError(f"no PyTorch reference for {draft.kind.title} heads")
    target = draft.target
    toks = check_tokens(target)
    T = toks.shape[1]
    pos = jnp.broadcast_to(jnp.arange(T), toks.shape)
    layers = eagle.feature_layers(draft.config, target.config)
    if layers:
        feats = llama.forward(target.params, target.config, jnp.asarray(toks), pos, return_logits=False,
                              aux_layers=layers).aux
    else:
        feats = target.forward(jnp.asarray(toks), pos, return_logits=False).hidden
    return check(src, draft, toks[:, 1:], np.asarray(feats, np.float32)[:, :-1])
