"""LLaMA-architecture target model: parameter layout, random init, and a pure forward with KV cache and tree masks.

Parameters are a plain nested dict of arrays (layers stacked on a leading L axis, scanned):
    embed        [V, D]
    layers/attn_norm [L, D]      layers/wq [L, D, N*H]   layers/wk [L, D, K*H]   layers/wv [L, D, K*H]
    layers/wo    [L, N*H, D]     layers/mlp_norm [L, D]  layers/w_gate [L, D, F] layers/w_up [L, D, F]
    layers/w_down [L, F, D]
  family switches (config flags; absent otherwise, so LLaMA checkpoints keep this exact layout):
    layers/bq [L, N*H]  layers/bk [L, K*H]  layers/bv [L, K*H]   q/k/v biases (qkv_bias: Qwen2; attention_bias)
    layers/bo [L, D]                                               o bias (attention_bias: Llama/Qwen3 option)
    layers/q_norm [L, H]  layers/k_norm [L, H]                     per-head RMSNorm of q, k before rope (Qwen3)
    final_norm   [D]
    lm_head      [D, V]          (absent when tie_word_embeddings: logits use embed.T)

A matrix may instead be a packed weight (`ops.Packed`: panel-major floats or GGUF blocks, laid out at load for
a backend): its `.shape` is the logical shape above, and `layers.linear` / `layers.embed` take it wherever they
take an array.

`hidden` in the output is the last decoder layer's output *after* the final norm, i.e. what HF's
`LlamaModel` returns as `last_hidden_state` and what EAGLE-1/2 heads consume as the target feature
(EAGLE's `ea_model.py` takes `outputs[0]` of the base `LlamaModel`, whose forward ends with `self.norm`).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import layers as L
from . import ops
from .cache import KVCache, check_cache, init_cache
from .config import ModelConfig
from .layers import greedy_token


class Output(NamedTuple):
    logits: jax.Array | None  # [B, T, V] float32 (or [B, R, V] with logit_index)
    hidden: jax.Array  # [B, T, D] final-normed features
    cache: KVCache | None
    aux: jax.Array | None = None  # [B, T, A*D] residual stream entering each of `aux_layers` (EAGLE-3 features)
    greedy: jax.Array | None = None  # [B, T] int32 (or [B, R]) greedy tokens of the logits (forward(greedy=True))


def layer_shapes(cfg: ModelConfig, n_layers: int, input_norm: bool = True) -> dict:
    D, F, N, K, H = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    s = {
        "wq": (n_layers, D, N * H), "wk": (n_layers, D, K * H), "wv": (n_layers, D, K * H),
        "wo": (n_layers, N * H, D), "mlp_norm": (n_layers, D),
        "w_gate": (n_layers, D, F), "w_up": (n_layers, D, F), "w_down": (n_layers, F, D),
    }
    if input_norm:
        s["attn_norm"] = (n_layers, D)
    if cfg.has_qkv_bias:
        s.update(bq=(n_layers, N * H), bk=(n_layers, K * H), bv=(n_layers, K * H))
    if cfg.attention_bias:
        s["bo"] = (n_layers, D)
    if cfg.qk_norm:
        s.update(q_norm=(n_layers, H), k_norm=(n_layers, H))
    return s


def param_shapes(cfg: ModelConfig) -> dict:
    """The one abstract description of every target weight: nested dict of shape tuples."""
    s = {"embed": (cfg.vocab_size, cfg.hidden_size),
         "layers": layer_shapes(cfg, cfg.num_hidden_layers),
         "final_norm": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        s["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return s


# Logical axes of every weight, by name (stacked layer weights get a leading "layers" axis). `ddd_jax.sharding`
# maps them to mesh axes with one rules table; a weight missing here is an error there, never silently replicated.
WEIGHT_AXES = {
    "embed": ("vocab", "embed"), "lm_head": ("embed", "vocab"), "final_norm": ("embed",),
    "attn_norm": ("embed",), "mlp_norm": ("embed",),
    "wq": ("embed", "q_heads"), "wk": ("embed", "kv_heads"), "wv": ("embed", "kv_heads"), "wo": ("q_heads", "embed"),
    "w_gate": ("embed", "ffw"), "w_up": ("embed", "ffw"), "w_down": ("ffw", "embed"),
    "bq": ("q_heads",), "bk": ("kv_heads",), "bv": ("kv_heads",), "bo": ("embed",),
    "q_norm": ("head_dim",), "k_norm": ("head_dim",),
}


def axes_like(shapes: dict, names: dict = WEIGHT_AXES) -> dict:
    """Logical axes mirroring a nested shape dict: leaves under "layers" get a leading "layers" axis."""
    def walk(tree, stacked):
        out = {}
        for k, v in tree.items():
            if isinstance(v, dict):
                out[k] = walk(v, stacked or k == "layers")
            else:
                ax = names.get(k)
                out[k] = None if ax is None else (("layers",) if stacked else ()) + tuple(ax)
        return out
    return walk(shapes, False)


def param_axes(cfg: ModelConfig) -> dict:
    """Logical axis names of every target weight, mirroring `param_shapes(cfg)` (None: no axes known)."""
    return axes_like(param_shapes(cfg))


def abstract_params(cfg: ModelConfig, dtype=jnp.float32) -> dict:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(cfg),
                        is_leaf=lambda x: isinstance(x, tuple))


def init_params(cfg: ModelConfig, key, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random weights (norm weights 1, others N(0, std)), for tests and fresh models."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    out = []
    for p, s, k in zip(paths, leaves, keys):
        if "norm" in p:
            out.append(jnp.ones(s, dtype))
        else:
            out.append((std * jax.random.normal(k, s, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def by_rows(rows, fn, *arrays):
    """`fn(*arrays)` computed on the first w rows (axis 1) of the [B, T, ...] arrays only and zero-padded back to T
    rows, w = widths[pick] for `rows` = (pick, widths): a traced index into a static ascending tuple of widths
    ending at T, chosen with `lax.switch` (one branch per width). Only the activations pass through the switch,
    never a cache, so no branch copies a buffer it would update. rows=None: `fn(*arrays)` over every row."""
    if rows is None:
        return fn(*arrays)
    pick, widths = rows
    T = arrays[0].shape[1]

    def at(w):
        def run(args):
            out = fn(*(a[:, :w] for a in args))
            return jax.tree.map(lambda o: jnp.pad(o, [(0, 0), (0, T - w)] + [(0, 0)] * (o.ndim - 2)), out)
        return run

    return jax.lax.switch(pick, [at(w) for w in widths], arrays)


def decoder_stack(lp: dict, cfg: ModelConfig, x, positions, cache: KVCache | None, kv_mask,
                  aux_layers: tuple = (), qkv_input=None, attend=None, rows=None):
    """Run stacked decoder layers.

    lp: stacked layer params (leading L axis); x: [B, T, D]; positions: [B, T].
    With a cache: new K/V are written at slots cache.length[b] + t and kv_mask is [B, T, S] over all
    slots (after the write). Without a cache: kv_mask is [B, T, T] over the new tokens.
    aux_layers (static): also return the residual stream *entering* these layers (HF `hidden_states[i]`),
    collected inside the scan. qkv_input: optional (x, p) -> what q/k/v read, replacing the input norm
    (EAGLE-3's layer: cat(norm(embed), hidden_norm(x)) while the residual stream stays x).
    attend: optional (q, k, v, i) -> [B, T, N*H], with a cache, replacing masked attention over layer i of the
    stacked caches k, v [L, B, K, S, H] (kv_mask then unused): the training-time test's sparse form,
    `layers.ttt_attention`. rows (with a cache): (pick, widths) -- each layer's products and norms run on the
    first widths[pick] rows only (`by_rows`; the other rows' K/V, attention and outputs are zeros or garbage the
    caller never reads), while the cache writes and attention keep all T rows outside the switch.
    Returns (x, cache with k/v written; length unchanged), plus aux [A, B, T, D] when aux_layers is given.
    """
    B, T, _ = x.shape
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inv = L.rope_inv_freq(cfg)
    eps = cfg.rms_norm_eps
    n_layers = lp["wq"].shape[0]

    # Matrix weights are read from the stacked lp by layer index (`L.linear`: no per-layer copy on the kernel
    # path); the scanned p carries the small per-layer vectors (norms).
    def qkv(x, p, i, positions=positions):
        h = L.rms_norm(x, p["attn_norm"], eps) if "attn_norm" in p else x
        h = h if qkv_input is None else qkv_input(x, p)
        q, k, v = L.linears(h, (lp["wq"], lp["wk"], lp["wv"]), i)
        if "bq" in p:  # family switch: q/k/v biases
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        t = x.shape[1]
        q, k, v = q.reshape(B, t, N, H), k.reshape(B, t, K, H), v.reshape(B, t, K, H)
        if "q_norm" in p:  # family switch: per-head RMSNorm before rope
            q, k = L.rms_norm(q, p["q_norm"], eps), L.rms_norm(k, p["k_norm"], eps)
        return L.apply_rope(q, positions, inv), L.apply_rope(k, positions, inv), v

    def rest(x, p, i, a):
        o = L.linear(a, lp["wo"], i)
        x = x + (o + p["bo"] if "bo" in p else o)
        h = L.rms_norm(x, p["mlp_norm"], eps)
        return x + L.mlp(h, lp["w_gate"], lp["w_up"], lp["w_down"], i)

    small = {k: v for k, v in lp.items() if v.ndim <= 2}  # [L, D] norms (and biases)
    layer_ids = jnp.arange(n_layers)

    def keep(aux, x, i):  # the stream entering layer i, into every aux slot that names layer i
        return tuple(jnp.where(i == j, x, a) for a, j in zip(aux, aux_layers))

    aux0 = tuple(jnp.zeros_like(x) for _ in aux_layers)
    if cache is None:
        def body(c, xs):
            x, aux = c
            p, i = xs
            aux = keep(aux, x, i)
            q, k, v = qkv(x, p, i)  # k, v [B, T, K, H] -> [B, K, T, H]
            a = L.attention(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), kv_mask)
            return (rest(x, p, i, a), aux), None
        (x, aux), _ = jax.lax.scan(body, (x, aux0), (small, layer_ids))
        return (x, None, jnp.stack(aux)) if aux_layers else (x, None)

    check_cache(cache, n_layers, K, H)
    b_idx = jnp.arange(B)[:, None]
    dst = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B, T] slots of the new tokens

    def body(carry, xs):
        x, kall, vall, aux = carry
        p, i = xs
        aux = keep(aux, x, i)
        q, k, v = by_rows(rows, lambda x, pos: qkv(x, p, i, pos), x, positions)
        # scatter straight into the carried [L, B, K, S, H] buffers, in place (the indexed view is [B, T, K, H]),
        # then attend over layer i
        at = (i, b_idx, slice(None), dst)
        kall = kall.at[at].set(k.astype(kall.dtype), mode="drop")
        vall = vall.at[at].set(v.astype(vall.dtype), mode="drop")
        a = L.attention(q, kall, vall, kv_mask, i) if attend is None else attend(q, kall, vall, i)
        x = by_rows(rows, lambda x, a: rest(x, p, i, a), x, a)
        return (x, kall, vall, aux), None

    (x, kall, vall, aux), _ = jax.lax.scan(body, (x, cache.k, cache.v, aux0), (small, layer_ids))
    new = dataclasses.replace(cache, k=kall, v=vall)
    return (x, new, jnp.stack(aux)) if aux_layers else (x, new)


def output_embedding(params, cfg: ModelConfig):
    """The output projection as [V, D] rows (the embedding when tied): the one place that knows about tying."""
    if cfg.tie_word_embeddings:
        return params["embed"]
    return ops.output_rows(params["lm_head"])


def lm_head(params, cfg: ModelConfig, hidden):
    """Logits [..., V] float32 of hidden [..., D]. (Reads lm_head [D, V] as stored: no transposed copy per call.)"""
    if cfg.tie_word_embeddings:
        return L.linear(hidden, params["embed"], transposed=True)
    return L.linear(hidden, params["lm_head"], f32=True)


def lm_head_greedy(params, cfg: ModelConfig, hidden):
    """(logits [..., V] float32, greedy tokens [...] int32): `lm_head` and `layers.greedy_token` of its logits, in one
    pass where the output projection's storage allows (`ops.greedy_head`: the same logits, bitwise)."""
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    both = ops.greedy_head(hidden, w, greedy_token)
    if both is not None:
        return both
    logits = lm_head(params, cfg, hidden)
    return logits, greedy_token(logits)


def greedy_tokens(params, cfg: ModelConfig, hidden):
    """Greedy tokens [...] int32 of hidden [..., D]: `layers.greedy_token(lm_head(...))`, without the logits where
    the output projection's storage has a cheaper way to the same tokens (`ops.greedy_tokens`)."""
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    toks = ops.greedy_tokens(hidden, w, greedy_token)
    return toks if toks is not None else lm_head_greedy(params, cfg, hidden)[1]


def forward(params, cfg: ModelConfig, tokens, positions, cache: KVCache | None = None, attn_mask=None,
            logit_index=None, return_logits: bool = True, aux_layers: tuple = (), greedy: bool = False,
            rows=None) -> Output:
    """Target forward.

    tokens, positions: [B, T] int32. attn_mask: [B, T, T] bool over the new tokens (default causal);
    with a cache, new tokens also see every committed slot (< cache.length). New K/V are written at
    slots [length, length+T) and length advances by T (use `cache.commit` to keep only a tree path).
    logit_index: optional [B, R] rows of the new tokens to compute logits for (e.g. the last real
    prompt token), saving the vocab projection elsewhere. Shapes are static; the caller guarantees
    length + T <= capacity (`generate` checks it on the host). aux_layers (static tuple of layer indices,
    e.g. `eagle3.feature_layers(cfg)`): Output.aux [B, T, A*D] holds the residual stream entering each of them
    (transformers' `hidden_states[i]`), concatenated in the given order, from this same pass. greedy (static): also
    Output.greedy, the greedy token of each logits row (`lm_head_greedy`; needs return_logits). rows (with a cache,
    without logit_index): (pick, widths), a traced index into a static tuple of widths ending at T -- the products,
    norms and output head run on the first widths[pick] rows only (`decoder_stack`, `by_rows`): what a row costs
    is its FMAs on the CPU, and the caller reads no later row (their K/V sit past what it commits).
    """
    if rows is not None and (cache is None or logit_index is not None):
        raise ValueError("forward(rows=...) needs a cache and no logit_index")
    tokens = jnp.asarray(tokens, jnp.int32)
    B, T = tokens.shape
    if attn_mask is None:
        attn_mask = L.causal_mask(B, T)
    x = L.embed(params["embed"], tokens)
    kv_mask = L.cache_mask(attn_mask, cache)
    if cfg.sliding_window is not None:  # family switch: every layer sees only the last sliding_window positions
        kv_pos = positions if cache is None else L.slot_positions(cache.length, cache.capacity, positions)
        kv_mask = kv_mask & L.sliding_window_mask(positions, kv_pos, cfg.sliding_window)
    aux = None
    if aux_layers:
        bad = [i for i in aux_layers if not 0 <= i < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"aux_layers {bad} outside the target's layers [0, {cfg.num_hidden_layers})")
        x, new_cache, aux = decoder_stack(params["layers"], cfg, x, positions, cache, kv_mask, aux_layers=aux_layers,
                                          rows=rows)
        aux = jnp.concatenate(list(aux), axis=-1)
    else:
        x, new_cache = decoder_stack(params["layers"], cfg, x, positions, cache, kv_mask, rows=rows)
    hidden = L.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    if new_cache is not None:
        new_cache = dataclasses.replace(new_cache, length=cache.length + T)
    logits = ids = None
    if return_logits or greedy:
        h = hidden if logit_index is None else jnp.take_along_axis(hidden, logit_index[..., None], axis=1)
        if not return_logits:
            ids = by_rows(rows, lambda h: greedy_tokens(params, cfg, h), h)
        else:
            logits, ids = by_rows(rows, lambda h: lm_head_greedy(params, cfg, h) if greedy
                                  else (lm_head(params, cfg, h), None), h)
    return Output(logits=logits, hidden=hidden, cache=new_cache, aux=aux, greedy=ids)


def new_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
    """An empty target cache: k, v [L, B, K, S, H]."""
    return init_cache(cfg.num_hidden_layers, batch, capacity, cfg.num_key_value_heads, cfg.head_dim, dtype)
