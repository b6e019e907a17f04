"""EAGLE-1/2 draft head: fc(concat(embed(token_{t+1}), feature_t)) -> one LLaMA decoder layer (no input norm).

Exactly the reference layout (EAGLE `model/cnets.py`): `fc` is Linear(2H -> H) with bias over
`cat((inputs_embeds, hidden_states), -1)` -- embedding first, feature second; decoder layer 0 has no
`input_layernorm`, keeps `post_attention_layernorm` and the SwiGLU MLP; there is no final norm. The
head's output is the predicted next *feature*; its logits come from the target's own lm_head (shared,
never copied): logits = lm_head(feature), without the final norm (the target's features are already normed).

Position convention: the pair (token_{i+1}, feature_i) sits at position i, as in EAGLE's training and
its `topK_genrate` (`len_posi`).

Draft params (nested dict; the target's embed / lm_head are passed separately, not stored):
    fc_w [2D, D]    fc_b [D] (if config.fc_bias)
    layers/{wq [1,D,N*H], wk, wv [1,D,K*H], wo [1,N*H,D], mlp_norm [1,D], w_gate, w_up [1,D,F], w_down [1,F,D]}
    plus the layer's family leaves when its config has them (`llama.layer_shapes`): bq [1,N*H], bk, bv [1,K*H]
    (qkv_bias / attention_bias), bo [1,D] (attention_bias), q_norm, k_norm [1,H] (qk_norm). The head of a Qwen2 target
    has q/k/v biases, that of a Qwen3 target per-head q/k norms and the target's head_dim (`DraftConfig.from_target`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from . import io as dio
from .cache import KVCache, init_cache
from .checkpoints.keytable import check_shapes
from . import eagle3, ops
from .config import DraftConfig, ModelConfig
from .layers import cache_mask, causal_mask, linear
from .layers import embed as embed_rows
from .llama import WEIGHT_AXES, axes_like, decoder_stack, layer_shapes, lm_head, output_embedding


def param_shapes(dcfg: DraftConfig) -> dict:
    if dcfg.head_type == "eagle3":
        return eagle3.param_shapes(dcfg)
    D = dcfg.hidden_size
    s = {"fc_w": (2 * D, D), "layers": layer_shapes(dcfg.layer_config(), 1, input_norm=False)}
    if dcfg.fc_bias:
        s["fc_b"] = (D,)
    if dcfg.draft_vocab_size:
        s["d2t"] = (dcfg.draft_vocab_size,)
    return s


DRAFT_AXES = {"fc_w": ("embed2", "embed"), "fc_b": ("embed",), "d2t": ("draft_vocab",), "lm_sub": ("draft_vocab", "embed")}


def param_axes(dcfg: DraftConfig) -> dict:
    """Logical axis names of every head weight, mirroring `param_shapes(dcfg)` (see `llama.param_axes`)."""
    names = {**WEIGHT_AXES, **DRAFT_AXES, **(eagle3.AXES if dcfg.head_type == "eagle3" else {})}
    return axes_like(param_shapes(dcfg), names)


def init_params(dcfg: DraftConfig, key, dtype=jnp.float32, std: float = 0.02) -> dict:
    if dcfg.head_type == "eagle3":
        return eagle3.init_params(dcfg, key, dtype, std)
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


def head_forward(dparams, dcfg: DraftConfig, embed, tokens, features, positions, cache: KVCache | None = None,
                 attn_mask=None, mask_start=None):
    """Run the head. tokens [B,T] (token_{i+1}), features [B,T,D] (feature_i), positions [B,T].

    embed: the target's embedding table [V, D]. attn_mask: [B, T, W] bool (default causal over the T new tokens).
    With a cache, K/V are written at slots cache.length + t, and the new tokens attend every slot before
    mask_start [B] (default cache.length) and the W slots from it as attn_mask allows (`layers.cache_mask`: a
    draft step's beam sees the prefix and its ancestors among the scratch slots). Returns (next_features [B,T,D],
    cache with K/V written and length unchanged).
    """
    if dcfg.head_type == "eagle3":  # features are the head's width here: see `project_features`
        return eagle3.head_forward(dparams, dcfg, embed, tokens, features, positions, cache, attn_mask, mask_start)
    tokens = jnp.asarray(tokens, jnp.int32)
    B, T = tokens.shape
    e = embed_rows(embed, tokens).astype(features.dtype)
    x = linear(jnp.concatenate([e, features], axis=-1), _weight(dparams["fc_w"], features.dtype))
    if "fc_b" in dparams:
        x = x + dparams["fc_b"].astype(features.dtype)
    kv_mask = cache_mask(causal_mask(B, T) if attn_mask is None else attn_mask, cache, mask_start)
    x, cache = decoder_stack(dparams["layers"], dcfg.layer_config(), x, positions, cache, kv_mask)
    return x, cache


def _weight(w, dtype):
    """A head weight for activations of `dtype` (`ops.as_stored`: packed and float16 weights stay as stored)."""
    return ops.as_stored(w, dtype)


def project_features(dparams, dcfg: DraftConfig, feats):
    """Target features -> what the head's layer reads as its hidden input: identity for EAGLE-1/2; EAGLE-3's fc
    over the three layers' features. Drafting applies it to target features only (never to the head's outputs)."""
    if dcfg.head_type == "eagle3":
        return eagle3.project_features(dparams, dcfg, feats)
    return feats


def draft_logits(dparams, tparams, tcfg: ModelConfig, h, dcfg: DraftConfig | None = None):
    """Draft log-probs over the draft vocabulary: [..., V] (full) or [..., V'] when the head has `d2t`
    (then `dparams["lm_sub"]` [V', D] holds the target's output embedding rows of those tokens; see
    `Draft.decode_params`). Renormalised over the draft vocabulary. EAGLE-3 heads (pass `dcfg`) use their own
    norm and lm_head."""
    if "final_norm" in dparams:
        if dcfg is None or dcfg.head_type != "eagle3":
            raise ValueError("draft_logits: an EAGLE-3 head's params need its DraftConfig (dcfg=...)")
        return jax.nn.log_softmax(eagle3.logits(dparams, dcfg, h), axis=-1)
    if "lm_sub" in dparams:
        logits = linear(h, dparams["lm_sub"], transposed=True)
    else:
        logits = lm_head(tparams, tcfg, h)
    return jax.nn.log_softmax(logits, axis=-1)


def with_draft_vocab(draft: "Draft", token_ids) -> "Draft":
    """The same head drafting only over `token_ids` (e.g. the most frequent target tokens of its training data)."""
    if draft.config.head_type == "eagle3":
        raise ValueError("with_draft_vocab: an EAGLE-3 head's draft vocabulary is fixed by its own lm_head")
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    V = draft.config.vocab_size
    if ids.size == 0 or ids.min() < 0 or ids.max() >= V or len(np.unique(ids)) != ids.size:
        raise ValueError(f"draft vocabulary must be distinct token ids in [0, {V}); got {ids.size} ids")
    cfg = dataclasses.replace(draft.config, draft_vocab_size=int(ids.size))
    params = {k: v for k, v in draft.params.items() if k != "d2t"}
    params["d2t"] = jnp.asarray(ids, jnp.int32)
    return Draft(cfg, params, draft.target)


def new_cache(dcfg: DraftConfig, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
    """An empty draft cache: k, v [1, B, K, S, H]."""
    return init_cache(1, batch, capacity, dcfg.num_key_value_heads, dcfg.head_dim, dtype)


@dataclass
class Draft:
    """A draft head bound to its target (whose embed/lm_head it shares)."""

    config: DraftConfig
    params: dict  # see the module docstring; `d2t` [V'] int32 when drafting over a reduced vocabulary
    target: object  # ddd_jax Target (has .config and .params)
    name: str | None = None  # what it was loaded as (a packaged name or a path): selects tuned settings
    # [V', D] the target's output-embedding rows of the draft vocabulary (derived from d2t once; never saved)
    lm_sub: jax.Array | None = field(init=False, default=None, repr=False)  # in the head's `weight_dtype`
    # decode_params with the head's matrices and lm_sub laid out as the target's weights are (`ops.pack_head`) for a
    # backend that packs them (never saved)
    packed: dict | None = field(init=False, default=None, repr=False)

    def __post_init__(self):
        self.config.check_target(self.target.config)
        check_shapes(self.params, param_shapes(self.config), "draft head")
        mesh = self.mesh
        if mesh is not None and ops.has_blocks(self.params):
            raise ValueError("a draft head stored as GGUF blocks cannot be sharded over a mesh yet")
        if mesh is not None:  # on the target's mesh, by the same rules as the target's weights
            from . import sharding
            self.params = sharding.place_params(self.params, param_axes(self.config), mesh)
        if "d2t" in self.params:
            _check_d2t(self.params["d2t"], self.config.vocab_size)
        if "d2t" in self.params and self.config.head_type == "eagle1":
            rows = embed_rows(output_embedding(self.target.params, self.target.config), self.params["d2t"])
            # in the head's own weight format (a float16 head reads float16 vocabulary rows, a q8_0 head q8_0 ones)
            wd = self.weight_dtype
            self.lm_sub = ops.quantize(rows, wd) if wd in ops.BLOCK_KINDS else rows.astype(wd)
            if mesh is not None:
                self.lm_sub = sharding.put(self.lm_sub, sharding.named(mesh, DRAFT_AXES["lm_sub"]))
        if self.config.head_type == "eagle1" and mesh is None:  # laid out as the target's weights are
            self.packed = ops.pack_head(self.params, self.lm_sub, self.target.params)

    @property
    def mesh(self):
        """The target's device mesh (None: one device)."""
        return getattr(self.target, "mesh", None)

    def astype(self, dtype) -> "Draft":
        """The same head with its floating-point weights stored in `dtype` (e.g. float16: on CPU the kernels read
        them at half the bytes and compute in float32; drafting stays lossless -- the target decides every token).
        dtype may also be a GGUF block kind of `ops.BLOCK_KINDS` ("q8_0", "q4_0", "q4_1"): the matrices (fc, the
        layer's products, the draft-vocabulary rows) quantized by gguf's reference quantizer, the rest as stored --
        fewer bytes a draft step, drafts a little different, outputs still exactly the target's."""
        if isinstance(dtype, str) and dtype in ops.BLOCK_KINDS:
            return self._quantized(dtype)
        if ops.has_blocks(self.params):
            raise ValueError(f"this head is stored as {self.weight_dtype} blocks; astype({dtype!r}) needs the float "
                             "head (load it again)")
        cast = lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a  # noqa: E731
        return dataclasses.replace(self, params=jax.tree.map(cast, self.params))

    def _quantized(self, kind: str) -> "Draft":
        if self.config.head_type == "eagle3":
            raise ValueError("astype: EAGLE-3 heads cannot be stored as GGUF blocks yet")
        if ops.has_blocks(self.params):
            raise ValueError(f"this head is already stored as {self.weight_dtype} blocks")
        params = dict(self.params)
        params["fc_w"] = ops.quantize(params["fc_w"], kind, transposed=True)  # x @ fc_w
        params["layers"] = {k: ops.quantize(v, kind, transposed=True) if v.ndim == 3 else v
                            for k, v in params["layers"].items()}  # [1, K, N] products; norms as stored
        return dataclasses.replace(self, params=params)

    @property
    def weight_dtype(self) -> str:
        """The dtype its floating-point weights are stored in ("float32", "float16", ...), or the GGUF block kind of
        its matrices ("q8_0", ...; see `astype`)."""
        leaves = jax.tree.leaves(self.params, is_leaf=ops.is_block)
        blocks = [a.kind for a in leaves if ops.is_block(a)]
        if blocks:
            return blocks[0]
        return next(str(a.dtype) for a in leaves if jnp.issubdtype(a.dtype, jnp.floating))

    def decode_params(self) -> dict:
        """Params as the decode loops use them: the head's params plus `lm_sub` for a reduced draft vocabulary --
        panel-major where the target's are (`packed`)."""
        if self.packed is not None:
            return self.packed
        return self.params if self.lm_sub is None else {**self.params, "lm_sub": self.lm_sub}

    def forward(self, tokens, features):
        """Causal, cache-free run over aligned pairs: tokens[:, j] is the token at position j+1 and
        features[:, j] the target feature at position j. Row j of the outputs predicts the feature at
        position j+1; its logits give the token at position j+2. Returns (next_features, logits)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        features = jnp.asarray(features)
        if tokens.ndim != 2 or features.ndim != 3 or features.shape[:2] != tokens.shape:
            raise ValueError(f"draft.forward: tokens must be [B,T] and features [B,T,D]; got {tokens.shape}, "
                             f"{features.shape}")
        if features.shape[-1] != self.config.feature_size:
            if self.config.head_type == "eagle3":
                raise ValueError(
                    f"draft.forward: an EAGLE-3 head takes target features [B,T,{self.config.feature_size}] "
                    f"(the residual stream entering target layers 2, L//2, L-3, concatenated); got width "
                    f"{features.shape[-1]}" + (" -- EAGLE-1/2 features (the final hidden state)?"
                                               if features.shape[-1] * 3 == self.config.feature_size else ""))
            raise ValueError(f"draft.forward: feature width {features.shape[-1]} != hidden_size "
                             f"{self.config.hidden_size}")
        return _forward_jit(self.params, self.config, self.target.params, self.target.config, tokens, features)


def _forward_impl(dparams, dcfg, tparams, tcfg, tokens, features):
    B, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h, _ = head_forward(dparams, dcfg, tparams["embed"], tokens, project_features(dparams, dcfg, features), pos)
    if dcfg.head_type == "eagle3":
        return h, eagle3.to_target_vocab(dparams, eagle3.logits(dparams, dcfg, h), tcfg.vocab_size)
    return h, lm_head(tparams, tcfg, h)


def _check_d2t(d2t, vocab_size: int) -> None:
    if isinstance(d2t, jax.core.Tracer):
        return
    ids = np.asarray(d2t)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"draft head: d2t maps draft ids to target ids in [{int(ids.min())}, {int(ids.max())}], "
                         f"outside the target vocabulary [0, {vocab_size})")


_forward_jit = jax.jit(_forward_impl, static_argnames=("dcfg", "tcfg"))


def init_draft(target, seed: int = 0, dtype=jnp.float32, **config_overrides) -> Draft:
    """A fresh random head for `target` (tests, training)."""
    dcfg = DraftConfig.from_target(target.config, target_name=getattr(target, "name", None), **config_overrides)
    # on a mesh, Draft places the head on the target's mesh (same values as unsharded: generated, then placed)
    return Draft(dcfg, init_params(dcfg, jax.random.PRNGKey(seed), dtype), target)
