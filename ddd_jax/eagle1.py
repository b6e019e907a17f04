"""EAGLE-1/2 draft head (head kind "eagle1"): fc(concat(embed(token_{t+1}), feature_t)) -> one LLaMA decoder layer
(no input norm).

Exactly the reference layout (EAGLE `model/cnets.py`): `fc` is Linear(2H -> H) with bias over
`cat((inputs_embeds, hidden_states), -1)` -- embedding first, feature second; decoder layer 0 has no
`input_layernorm`, keeps `post_attention_layernorm` and the SwiGLU MLP; there is no final norm. The
head's output is the predicted next *feature*; its logits come from the target's own lm_head (shared,
never copied): logits = lm_head(feature), without the final norm (the target's features are already normed).
Its target features are the target's final hidden state.

Position convention: the pair (token_{i+1}, feature_i) sits at position i, as in EAGLE's training and
its `topK_genrate` (`len_posi`).

Params (nested dict; the target's embed / lm_head are passed separately, not stored):
    fc_w [2D, D]    fc_b [D] (if config.fc_bias)    d2t [V'] int32 (a reduced draft vocabulary: target ids)
    layers/{wq [1,D,N*H], wk, wv [1,D,K*H], wo [1,N*H,D], mlp_norm [1,D], w_gate, w_up [1,D,F], w_down [1,F,D]}
    plus the layer's family leaves when its config has them (`llama.layer_shapes`): bq [1,N*H], bk, bv [1,K*H]
    (qkv_bias / attention_bias), bo [1,D] (attention_bias), q_norm, k_norm [1,H] (qk_norm). The head of a Qwen2 target
    has q/k/v biases, that of a Qwen3 target per-head q/k norms and the target's head_dim (`DraftConfig.from_target`).
At decode time a head with `d2t` also reads `lm_sub` [V', D], the target's output-embedding rows of its vocabulary
(`vocab_rows`, derived by `eagle.Draft`, never saved).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import io as dio
from . import ops
from .cache import KVCache
from .config import DraftConfig, ModelConfig
from .head_kinds import HeadKind, register
from .layers import cache_mask, causal_mask, linear
from .layers import embed as embed_rows
from .llama import decoder_stack, layer_shapes, lm_head, output_embedding

# logical axes of the EAGLE-1/2-only weights (beside llama.WEIGHT_AXES / eagle.DRAFT_AXES; see ddd_jax.sharding)
AXES = {"fc_w": ("embed2", "embed"), "fc_b": ("embed",)}


def feature_layers(tcfg: ModelConfig) -> tuple:
    """() : the head reads the target's final hidden state (after its final norm)."""
    return ()


def feature_size(dcfg: DraftConfig) -> int:
    """The target's hidden size."""
    return dcfg.target_hidden_size or dcfg.hidden_size


def param_shapes(dcfg: DraftConfig) -> dict:
    D = dcfg.hidden_size
    s = {"fc_w": (2 * D, D), "layers": layer_shapes(dcfg.layer_config(), 1, input_norm=False)}
    if dcfg.fc_bias:
        s["fc_b"] = (D,)
    if dcfg.draft_vocab_size:
        s["d2t"] = (dcfg.draft_vocab_size,)
    return s


def init_params(dcfg: DraftConfig, key, dtype=jnp.float32, std: float = 0.02) -> dict:
    shapes = param_shapes(dcfg)
    flat = dio.flatten(shapes)
    keys = jax.random.split(key, len(flat))
    out = {}
    for (name, s), k in zip(sorted(flat.items()), keys):
        if name == "d2t":
            out[name] = jnp.arange(s[0], dtype=jnp.int32)
        elif "norm" in name:
            out[name] = jnp.ones(s, dtype)
        elif name == "fc_b":
            out[name] = jnp.zeros(s, dtype)
        else:
            out[name] = (std * jax.random.normal(k, s, jnp.float32)).astype(dtype)
    return dio.unflatten(out)


def project_features(dparams, dcfg: DraftConfig, feats):
    """The identity: the layer reads the target's final hidden state as it is."""
    return feats


def head_forward(dparams, dcfg: DraftConfig, embed, tokens, features, positions, cache: KVCache | None = None,
                 attn_mask=None, mask_start=None, attend=None):
    """The head over (token, feature) pairs: fc(cat(embed(token), feature)), then the decoder layer (see
    `eagle.head_forward` for shapes, cache, masks and `attend`). Returns (next_features [B,T,D], cache)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    B, T = tokens.shape
    e = embed_rows(embed, tokens).astype(features.dtype)
    x = linear(jnp.concatenate([e, features], axis=-1), _weight(dparams["fc_w"], features.dtype))
    if "fc_b" in dparams:
        x = x + dparams["fc_b"].astype(features.dtype)
    kv_mask = None if attend is not None else cache_mask(causal_mask(B, T) if attn_mask is None else attn_mask,
                                                         cache, mask_start)
    x, cache = decoder_stack(dparams["layers"], dcfg.layer_config(), x, positions, cache, kv_mask, attend=attend)
    return x, cache


def _weight(w, dtype):
    """A head weight for activations of `dtype` (`ops.as_stored`: packed and float16 weights stay as stored)."""
    return ops.as_stored(w, dtype)


def draft_logits(dparams, tparams, tcfg: ModelConfig, h, dcfg: DraftConfig | None = None):
    """Log-probs over the draft vocabulary through the target's lm_head: [..., V], or [..., V'] over `lm_sub`
    [V', D] when the head drafts over a reduced vocabulary."""
    if "lm_sub" in dparams:
        logits = linear(h, dparams["lm_sub"], transposed=True)
    else:
        logits = lm_head(tparams, tcfg, h)
    return jax.nn.log_softmax(logits, axis=-1)


def target_logits(dparams, tparams, tcfg: ModelConfig, h, dcfg: DraftConfig | None = None):
    """The target's lm_head over the head's output [..., V]."""
    return lm_head(tparams, tcfg, h)


def vocab_rows(params, target):
    """[V', D] the target's output-embedding rows of the draft vocabulary `params["d2t"]`."""
    return embed_rows(output_embedding(target.params, target.config), params["d2t"])


def quantize(params: dict, kind: str) -> dict:
    """The matrices (fc and the layer's products) as GGUF blocks of `kind`; norms and biases as stored."""
    params = dict(params)
    params["fc_w"] = ops.quantize(params["fc_w"], kind, transposed=True)  # x @ fc_w
    params["layers"] = {k: ops.quantize(v, kind, transposed=True) if v.ndim == 3 else v
                        for k, v in params["layers"].items()}  # [1, K, N] products; norms as stored
    return params


KIND = register(HeadKind(
    name="eagle1", title="EAGLE-1/2", features="the target's final hidden state",
    feature_layers=feature_layers, feature_size=feature_size, project_features=project_features,
    head_forward=head_forward, draft_logits=draft_logits, target_logits=target_logits,
    param_shapes=param_shapes, init_params=init_params, axes=AXES,
    vocab_rows=vocab_rows, pack=ops.pack_head, quantize=quantize))
