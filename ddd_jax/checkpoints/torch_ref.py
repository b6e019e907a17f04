"""PyTorch references for `convert --check` and tests: an EAGLE-1/2 head in the official state-dict layout, transformers targets.

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
    def __init__(self, c):
        super().__init__()
        self.n, self.k, self.h = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.theta = c["rope_theta"]
        D = c["hidden_size"]
        self.q_proj = nn.Linear(D, self.n * self.h, bias=False)
        self.k_proj = nn.Linear(D, self.k * self.h, bias=False)
        self.v_proj = nn.Linear(D, self.k * self.h, bias=False)
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
    c.setdefault("head_dim", c["hidden_size"] // c["num_attention_heads"])
    c["head_dim"] = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    c.setdefault("rms_norm_eps", 1e-6)
    c["rope_theta"] = c.get("rope_theta") or 10000.0
    return c


class TorchEagleHead(nn.Module):
    """EAGLE-1/2 head with the official state-dict names (embed_tokens, fc, layers.0.*)."""

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


def write_official_eagle_head(head: TorchEagleHead, path, fmt: str = "bin", extra_config: dict | None = None) -> Path:
    """Write `head` the way EAGLE's released heads look: config.json (LlamaConfig, num_hidden_layers=1,
    "bias" only when False) + pytorch_model.bin or model.safetensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = head.config
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
           "num_attention_heads": c["num_attention_heads"], "num_key_value_heads": c["num_key_value_heads"],
           "num_hidden_layers": 1, "rms_norm_eps": c["rms_norm_eps"], "rope_theta": c["rope_theta"],
           "vocab_size": c["vocab_size"], "max_position_embeddings": 2048, "torch_dtype": "float32"}
    if not c.get("bias", True):
        cfg["bias"] = False
    cfg.update(extra_config or {})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    sd = {k: v.detach().clone().contiguous() for k, v in head.state_dict().items()}
    if fmt == "bin":
        torch.save(sd, path / "pytorch_model.bin")
    elif fmt == "safetensors":
        from safetensors.numpy import save_file
        save_file({k: v.numpy() for k, v in sd.items()}, str(path / "model.safetensors"))
    else:
        raise ValueError(f"fmt must be 'bin' or 'safetensors', got {fmt!r}")
    return path


def load_official_head(src, dtype=torch.float32) -> TorchEagleHead:
    """The torch reference head from an official EAGLE-1/2 directory (for --check)."""
    src = Path(src)
    cfg = json.loads((src / "config.json").read_text())
    head = TorchEagleHead(cfg)
    sd = {s.name: torch.from_numpy(np.array(s.load(), np.float32)) for s in checkpoint_sources(src)}
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if "embed_tokens.weight" not in sd:
        sd["embed_tokens.weight"] = head.embed_tokens.weight.detach()
    head.load_state_dict(sd, strict=True)
    return head.to(dtype).eval()


def head_check(src, draft, tokens, features) -> dict:
    """Run the official head at `src` (torch) and our `draft` on the same inputs; max abs differences.

    tokens [1,T], features [1,T,D] (the target's features). The torch head uses the *target's* embedding
    (as EAGLE does at run time), so only the head's own weights are compared.
    """
    head = load_official_head(src)
    tp = draft.target.params
    with torch.no_grad():
        head.embed_tokens.weight.copy_(torch.from_numpy(np.array(tp["embed"], np.float32)))
        ref = head(torch.from_numpy(np.array(features, np.float32)), torch.from_numpy(np.array(tokens)).long())
        w = np.asarray(output_embedding(tp, draft.target.config), np.float32)
        ref_logits = ref @ torch.from_numpy(w).T
    feats, logits = draft.forward(tokens, features)
    return {"max_feature_diff": float(np.abs(np.asarray(feats, np.float32) - ref.numpy()).max()),
            "max_logit_diff": float(np.abs(np.asarray(logits, np.float32) - ref_logits.numpy()).max())}


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


def check_head(src, draft) -> dict:
    """Max differences between the torch reference head at `src` and `draft` on target features of a few tokens."""
    import jax.numpy as jnp
    target = draft.target
    toks = check_tokens(target)
    T = toks.shape[1]
    feats = target.forward(jnp.asarray(toks), jnp.broadcast_to(jnp.arange(T), toks.shape), return_logits=False).hidden
    feats = np.asarray(feats, np.float32)[:, :-1]
    return head_check(src, draft, toks[:, 1:], feats)
