"""`ddd-jax plan`: per-device memory of weights, KV caches and tree buffers on a ("data", "model") mesh, from shapes
alone (`jax.eval_shape`: nothing is allocated, no devices are needed).

Counted per device (shard shapes by `ddd_jax.sharding.RULES`; the batch is padded to a multiple of "data"):
    weights        target params + the EAGLE head (one decoder layer + fc) in --dtype
    kv_cache       target cache [L, B, K, S, H] x2 (k, v) + draft cache [1, B, K, S, H] x2, in --dtype
    tree_buffers   one verify forward over the tree of T = total_tokens nodes: logits [B, T, V] float32,
                   hidden [B, T, D] in --dtype, tree mask [B, T, S] bool, one layer's attention scores [B, N, T, S]
                   float32 (XLA may fuse some of these away: an upper estimate of the largest transient buffers)
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

BUILTIN = {  # the fields we read from the published config.json files
    "llama-2-7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
                   "num_key_value_heads": 32, "rms_norm_eps": 1e-05, "vocab_size": 32000,
                   "max_position_embeddings": 4096, "eos_token_id": 2, "tie_word_embeddings": False},
    "llama-2-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                    "num_hidden_layers": 80, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "vocab_size": 32000,
                    "max_position_embeddings": 4096, "eos_token_id": 2, "tie_word_embeddings": False},
    "llama-3.1-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                     "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "eos_token_id": [128001, 128008, 128009],
                     "rope_theta": 500000.0, "tie_word_embeddings": False,
                     "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
}
BUILTIN["llama-3.1-70b"] = {**BUILTIN["llama-3.1-8b"], "hidden_size": 8192, "intermediate_size": 28672,
                            "num_attention_heads": 64, "num_hidden_layers": 80}


def read_config(name_or_path):
    """A ModelConfig from a built-in name or a config.json path (or a directory holding one)."""
    from .config import ModelConfig
    s = str(name_or_path)
    if s.lower() in BUILTIN:
        return ModelConfig.from_hf_config(BUILTIN[s.lower()])
    p = Path(s).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"--target must be a config.json path or one of {sorted(BUILTIN)}, got {s!r}")
    return ModelConfig.from_hf_config(json.loads(p.read_text()))


def _bytes(shape, dtype, axes, mesh) -> int:
    from .sharding import shard_shape
    return int(np.prod(shard_shape(shape, axes, mesh), dtype=np.int64)) * np.dtype(dtype).itemsize


def memory_plan(cfg, mesh: tuple[int, int], batch: int, capacity: int, dtype="bfloat16", total_tokens: int = 60,
                draft: bool = True) -> dict:
    """Per-device bytes {"weights", "kv_cache", "tree_buffers", "total"} (+ a breakdown) of decoding `batch`
    prompts with `capacity` cache slots on a (data, model) mesh. Shapes come from `jax.eval_shape`."""
    import jax
    import jax.numpy as jnp

    from . import eagle, llama, sharding
    from .keytable import np_dtype
    from .config import DraftConfig
    from .io import flatten

    dt = np_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    sharding.check_divisible(cfg, mesh)
    B = batch + sharding.pad_batch(batch, mesh)
    key = jax.random.PRNGKey(0)
    tparams = jax.eval_shape(lambda: llama.init_params(cfg, key, dt))
    axes = flatten(llama.param_axes(cfg))
    out = {"target_weights": sum(_bytes(a.shape, a.dtype, axes[k], mesh) for k, a in flatten(tparams).items())}
    tcache = jax.eval_shape(lambda: llama.new_cache(cfg, B, capacity, dt))
    out["target_kv_cache"] = 2 * _bytes(tcache.k.shape, dt, sharding.CACHE_AXES, mesh)
    out["draft_weights"] = out["draft_kv_cache"] = 0
    if draft:
        dcfg = DraftConfig.from_target(cfg)
        dparams = jax.eval_shape(lambda: eagle.init_params(dcfg, key, dt))
        daxes = flatten(eagle.param_axes(dcfg))
        out["draft_weights"] = sum(_bytes(a.shape, a.dtype, daxes[k], mesh) for k, a in flatten(dparams).items())
        dcache = jax.eval_shape(lambda: eagle.new_cache(dcfg, B, capacity, dt))
        out["draft_kv_cache"] = 2 * _bytes(dcache.k.shape, dt, sharding.CACHE_AXES, mesh)
    T = total_tokens
    tok = jax.ShapeDtypeStruct((B, T), jnp.int32)
    fwd = jax.eval_shape(lambda p, t, c: llama.forward(p, cfg, t, t, c), tparams, tok, tcache)
    out["tree_logits"] = _bytes(fwd.logits.shape, fwd.logits.dtype, ("batch", "seq", "vocab"), mesh)
    out["tree_hidden"] = _bytes(fwd.hidden.shape, fwd.hidden.dtype, ("batch", "seq", "embed"), mesh)
    out["tree_mask"] = _bytes((B, T, capacity), np.bool_, ("batch", "seq", "seq"), mesh)
    out["tree_scores"] = _bytes((B, cfg.num_attention_heads, T, capacity), np.float32,
                                ("batch", "q_heads", "seq", "seq"), mesh)
    out["weights"] = out["target_weights"] + out["draft_weights"]
    out["kv_cache"] = out["target_kv_cache"] + out["draft_kv_cache"]
    out["tree_buffers"] = out["tree_logits"] + out["tree_hidden"] + out["tree_mask"] + out["tree_scores"]
    out["total"] = out["weights"] + out["kv_cache"] + out["tree_buffers"]
    out["padded_batch"] = B
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:9.3f} GiB"


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="per-device memory of weights, KV caches and tree buffers on a mesh (no allocation)")
    p.add_argument("--target", required=True, help=f"a config.json path (or its directory) or one of {sorted(BUILTIN)}")
    p.add_argument("--mesh", default="1x1", help="DATAxMODEL device mesh, e.g. 1x8 (default %(default)s)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--capacity", type=int, default=4096, help="KV cache slots per sequence (default %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--total-tokens", type=int, default=60, help="tree nodes verified per cycle (default %(default)s)")
    p.add_argument("--no-draft", action="store_true", help="vanilla decoding: no head, no draft cache")
    p.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from .sharding import parse_mesh
    mesh = parse_mesh(args.mesh)
    cfg = read_config(args.target)
    r = memory_plan(cfg, mesh, args.batch, args.capacity, args.dtype, args.total_tokens, draft=not args.no_draft)
    if args.json:
        print(json.dumps(r))
        return 0
    padded = f" (padded to {r['padded_batch']})" if r["padded_batch"] != args.batch else ""
    print(f"{args.target} on a {mesh[0]}x{mesh[1]} (data x model) mesh, batch {args.batch}{padded}, capacity "
          f"{args.capacity}, {args.dtype}; bytes per device:")
    rows = [("weights", "target_weights", "draft_weights"), ("kv_cache", "target_kv_cache", "draft_kv_cache"),
            ("tree_buffers", "tree_logits", "tree_hidden", "tree_mask", "tree_scores")]
    for name, *parts in rows:
        detail = ", ".join(f"{p} {r[p]:,}" for p in parts)
        print(f"  {name:<13}{r[name]:>16,} B {_gib(r[name])}   ({detail})")
    print(f"  {'total':<13}{r['total']:>16,} B {_gib(r['total'])}")
    return 0
