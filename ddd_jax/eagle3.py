"""EAGLE-3 draft head (head kind "eagle3"): fc(3 target layers' features) -> one decoder layer over cat(norm(embed),
norm(hidden)) -> own norm and lm_head over a reduced draft vocabulary.

Conventions, all from SafeAILab/EAGLE (`eagle/model/cnets.py`, EAGLE-3 `Model` and `LlamaDecoderLayeremb`):

* Target features: the residual stream *entering* target layers 2, L//2 and L-3, concatenated in that order
  (`eagle/model/modeling_llama_kv.py` collects `all_hidden_states` before layers `idx == 2`, `L//2`, `L-3`;
  `ea_model.py` concatenates them); = transformers' `hidden_states[2], [L//2], [L-3]`. See `feature_layers`.
* `fc`: Linear(3*H_target -> H, no bias), applied to target features only (`Model.forward`:
  `if hidden_states.shape[-1] != inputs_embeds.shape[-1]: hidden_states = self.fc(hidden_states)`); the
  head's own outputs (H wide) are fed back without it. Here: `project_features`.
* The layer (`LlamaDecoderLayeremb.forward`): residual = h; q/k/v read
  cat(input_layernorm(embed(token)), hidden_norm(h)) (2H wide: `LlamaAttention.q_proj = Linear(2H, N*Hd)`);
  h = residual + o_proj(attn); h = h + mlp(post_attention_layernorm(h)). The layer output (no final norm)
  is the next step's hidden.
* Logits: `lm_head(norm(out))` over the draft vocabulary (`topK_genrate`); draft id i is target id
  i + d2t[i] (official offsets; our `d2t` stores the target ids themselves, converted at load).
* RoPE theta from the head's config, 10000 when absent (`LlamaAttention._init_rope`).

Params (nested dict; the target's embedding is shared unless the head's width differs from the target's):
    fc_w [3Ht, D]    final_norm [D]    lm_head [D, V']    d2t [V'] int32 target ids    (embed [V, D])
    layers/{emb_norm, hidden_norm, mlp_norm [1, D], wq [1, 2D, N*H], wk, wv [1, 2D, K*H], wo [1, N*H, D],
            w_gate, w_up [1, D, F], w_down [1, F, D]}
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import DraftConfig, ModelConfig
from .head_kinds import HeadKind, register
from .ops import precision
from .layers import cache_mask, causal_mask, rms_norm
from .layers import embed as embed_rows
from .llama import decoder_stack, layer_shapes


# logical axes of the EAGLE-3-only weights (beside llama.WEIGHT_AXES / eagle.DRAFT_AXES; see ddd_jax.sharding)
AXES = {"fc_w": ("embed2", "embed"), "emb_norm": ("embed",), "hidden_norm": ("embed",), "final_norm": ("embed",),
        "lm_head": ("embed", "draft_vocab")}


def feature_layers(tcfg: ModelConfig) -> tuple[int, int, int]:
    """The target layers whose *input* residual stream EAGLE-3 reads, low -> high: (2, L//2, L-3)."""
    L = tcfg.num_hidden_layers
    if L < 3:
        raise ValueError(f"an EAGLE-3 head reads target layers (2, L//2, L-3): the target needs at least 3 layers, "
                         f"it has {L}")
    return (2, L // 2, L - 3)


def feature_size(dcfg: DraftConfig) -> int:
    """3 x the target's hidden size: the three layers' inputs, concatenated."""
    return 3 * (dcfg.target_hidden_size or dcfg.hidden_size)


def check_config(dcfg: DraftConfig) -> None:
    if not dcfg.draft_vocab_size:
        raise ValueError("DraftConfig: an EAGLE-3 head needs draft_vocab_size (its lm_head's width)")


def param_shapes(dcfg: DraftConfig) -> dict:
    D = dcfg.hidden_size
    Ht = dcfg.target_hidden_size or D
    lay = layer_shapes(dcfg.layer_config(), 1, input_norm=False)
    N, K, H = dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim
    lay.update(wq=(1, 2 * D, N * H), wk=(1, 2 * D, K * H), wv=(1, 2 * D, K * H), emb_norm=(1, D), hidden_norm=(1, D))
    s = {"fc_w": (3 * Ht, D), "layers": lay, "final_norm": (D,), "lm_head": (D, dcfg.draft_vocab_size),
         "d2t": (dcfg.draft_vocab_size,)}
    if Ht != D:  # the head embeds tokens at its own width: it carries its own table
        s["embed"] = (dcfg.vocab_size, D)
    return s


def project_features(dparams, dcfg: DraftConfig, feats):
    """Target features [..., 3*Ht] -> the head's hidden [..., D] (fc, no bias)."""
    if feats.shape[-1] != dcfg.feature_size:
        raise ValueError(f"EAGLE-3 head: target features must be {dcfg.feature_size} wide (3 x target hidden "
                         f"{dcfg.feature_size // 3}: the inputs of layers 2, L//2, L-3), got {feats.shape[-1]}")
    w = dparams["fc_w"].astype(feats.dtype)
    return jnp.matmul(feats, w, precision=precision(feats, w))


def head_forward(dparams, dcfg: DraftConfig, embed, tokens, h, positions, cache=None, attn_mask=None,
                 mask_start=None, attend=None):
    """The layer over (token, hidden) pairs: tokens [B, T], h [B, T, D] (projected target features or the head's
    own earlier outputs), positions [B, T]. Cache and mask as `eagle.head_forward`; attend replaces the masked
    attention over the cache (`llama.decoder_stack`: training-time test's `layers.ttt_attention`). Returns
    (out [B,T,D], cache)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    B, T = tokens.shape
    table = dparams.get("embed", embed)
    e = embed_rows(table, tokens).astype(h.dtype)
    eps = dcfg.rms_norm_eps

    def qkv_input(x, p):  # LlamaDecoderLayeremb: cat((input_layernorm(emb), hidden_norm(h)), -1)
        return jnp.concatenate([rms_norm(e, p["emb_norm"], eps), rms_norm(x, p["hidden_norm"], eps)], axis=-1)

    kv_mask = None if attend is not None else cache_mask(causal_mask(B, T) if attn_mask is None else attn_mask,
                                                         cache, mask_start)
    return decoder_stack(dparams["layers"], dcfg.layer_config(), h, positions, cache, kv_mask, qkv_input=qkv_input,
                         attend=attend)


def logits(dparams, dcfg: DraftConfig, h):
    """Raw logits [..., V'] over the draft vocabulary: lm_head(norm(h)), float32."""
    hn = rms_norm(h, dparams["final_norm"], dcfg.rms_norm_eps)
    w = dparams["lm_head"].astype(hn.dtype)
    return jnp.einsum("...d,dv->...v", hn, w, precision=precision(hn, w), preferred_element_type=jnp.float32)


def draft_logits(dparams, tparams, tcfg: ModelConfig, h, dcfg: DraftConfig):
    """Log-probs [..., V'] over the draft vocabulary (the head's own norm and lm_head; the target's are not read)."""
    return jax.nn.log_softmax(logits(dparams, dcfg, h), axis=-1)


def target_logits(dparams, tparams, tcfg: ModelConfig, h, dcfg: DraftConfig):
    """Logits [..., V] over the target's vocabulary: the draft vocabulary's at their target ids, -inf elsewhere."""
    return to_target_vocab(dparams, logits(dparams, dcfg, h), tcfg.vocab_size)


def to_target_vocab(dparams, sub_logits, vocab_size: int):
    """Draft-vocabulary logits [..., V'] placed at their target ids in [..., V]; -inf elsewhere."""
    full = jnp.full(sub_logits.shape[:-1] + (vocab_size,), -jnp.inf, sub_logits.dtype)
    return full.at[..., dparams["d2t"]].set(sub_logits)


def init_params(dcfg: DraftConfig, key, dtype=jnp.float32, std: float = 0.02, d2t=None) -> dict:
    """Random head (norms 1); d2t defaults to the first draft_vocab_size target ids."""
    from . import io as dio
    flat = dio.flatten(param_shapes(dcfg))
    keys = jax.random.split(key, len(flat))
    out = {}
    for (name, s), k in zip(sorted(flat.items()), keys):
        if name == "d2t":
            out[name] = jnp.arange(s[0], dtype=jnp.int32) if d2t is None else jnp.asarray(d2t, jnp.int32)
        elif "norm" in name:
            out[name] = jnp.ones(s, dtype)
        else:
            out[name] = (std * jax.random.normal(k, s, jnp.float32)).astype(dtype)
    return dio.unflatten(out)


KIND = register(HeadKind(
    name="eagle3", title="EAGLE-3",
    features="the residual stream entering target layers 2, L//2, L-3, concatenated",
    feature_layers=feature_layers, feature_size=feature_size, project_features=project_features,
    head_forward=head_forward, draft_logits=draft_logits, target_logits=target_logits,
    param_shapes=param_shapes, init_params=init_params, axes=AXES, check_config=check_config))
