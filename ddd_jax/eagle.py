"""The draft head, whatever its kind: `Draft` (a head's config and params bound to its target), `init_draft`, and
the functions the decode loop and the trainers call -- each the function of the head's kind (`head_kinds`, looked up
by `DraftConfig.head_type` from the static config while tracing, so the programs are the kind's own).

Kinds: EAGLE-1/2 (`eagle1`, "eagle1": the target's final hidden state, the target's lm_head) and EAGLE-3 (`eagle3`,
"eagle3": three target layers' inputs, its own lm_head over a draft vocabulary); a new kind registers itself with
`head_kinds.register`. A head's params are its kind's `param_shapes`; the target's embed / lm_head are passed
separately, never stored (an EAGLE-3 head narrower than its target carries its own embedding).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from .cache import KVCache, init_cache
from .keytable import check_shapes
from . import head_kinds, ops
from .config import DraftConfig, ModelConfig
from .head_kinds import HeadKind
from .llama import WEIGHT_AXES, axes_like


def kind(dcfg: DraftConfig) -> HeadKind:
    """The kind of head `dcfg` describes (`head_kinds.get(dcfg.head_type)`)."""
    return head_kinds.get(dcfg.head_type)


def param_shapes(dcfg: DraftConfig) -> dict:
    """Every head weight's shape (nested dict): the kind's one description."""
    return kind(dcfg).param_shapes(dcfg)


# logical axes of the weights most kinds share (beside llama.WEIGHT_AXES and each kind's `axes`; see ddd_jax.sharding)
DRAFT_AXES = {"fc_w": ("embed2", "embed"), "fc_b": ("embed",), "d2t": ("draft_vocab",), "lm_sub": ("draft_vocab", "embed")}


def param_axes(dcfg: DraftConfig) -> dict:
    """Logical axis names of every head weight, mirroring `param_shapes(dcfg)` (see `llama.param_axes`)."""
    names = {**WEIGHT_AXES, **DRAFT_AXES, **kind(dcfg).axes}
    return axes_like(param_shapes(dcfg), names)


def init_params(dcfg: DraftConfig, key, dtype=jnp.float32, std: float = 0.02) -> dict:
    """A random head: normal(0, std) matrices, unit norms, zero biases (the kind's `init_params`)."""
    return kind(dcfg).init_params(dcfg, key, dtype, std)


def feature_layers(dcfg: DraftConfig, tcfg: ModelConfig) -> tuple:
    """The target layers whose inputs the head reads (`llama.forward(aux_layers=...)`: its features are then
    `Output.aux`); () when it reads the target's final hidden state (`Output.hidden`)."""
    return kind(dcfg).feature_layers(tcfg)


def head_forward(dparams, dcfg: DraftConfig, embed, tokens, features, positions, cache: KVCache | None = None,
                 attn_mask=None, mask_start=None, attend=None):
    """Run the head. tokens [B,T] (token_{i+1}), features [B,T,D] (feature_i: `project_features` of the target's,
    or the head's own outputs), positions [B,T].

    embed: the target's embedding table [V, D]. attn_mask: [B, T, W] bool (default causal over the T new tokens).
    With a cache, K/V are written at slots cache.length + t, and the new tokens attend every slot before
    mask_start [B] (default cache.length) and the W slots from it as attn_mask allows (`layers.cache_mask`: a
    draft step's beam sees the prefix and its ancestors among the scratch slots). Returns (next_features [B,T,D],
    cache with K/V written and length unchanged). attend: (q, k, v, layer) -> [B, T, N*H] replaces the masked
    attention over the cache (training-time test's `layers.ttt_attention`, `train_draft.ttt`).
    """
    more = {} if attend is None else {"attend": attend}  # a kind without training-time test need not take it
    return kind(dcfg).head_forward(dparams, dcfg, embed, tokens, features, positions, cache, attn_mask, mask_start,
                                   **more)


def project_features(dparams, dcfg: DraftConfig, feats):
    """Target features -> what the head's layer reads as its hidden input: identity for EAGLE-1/2; EAGLE-3's fc
    over the three layers' features. Drafting applies it to target features only (never to the head's outputs)."""
    return kind(dcfg).project_features(dparams, dcfg, feats)


def draft_logits(dparams, tparams, tcfg: ModelConfig, h, dcfg: DraftConfig | None = None):
    """Draft log-probs over the draft vocabulary: [..., V] (full) or [..., V'] when the head has `d2t`
    (then `dparams["lm_sub"]` [V', D] holds the target's output embedding rows of those tokens; see
    `Draft.decode_params`). Renormalised over the draft vocabulary. Heads with their own lm_head (EAGLE-3) need
    `dcfg`; without it the head is taken for EAGLE-1/2."""
    if dcfg is None:
        if "final_norm" in dparams:
            raise ValueError("draft_logits: an EAGLE-3 head's params need its DraftConfig (dcfg=...)")
        return head_kinds.get("eagle1").draft_logits(dparams, tparams, tcfg, h, dcfg)
    return kind(dcfg).draft_logits(dparams, tparams, tcfg, h, dcfg)


def vocab_map(dparams, dcfg: DraftConfig):
    """[V'] int32: the target token id of each draft id, or None when the head drafts over the whole vocabulary."""
    return kind(dcfg).d2t(dparams)


def with_draft_vocab(draft: "Draft", token_ids) -> "Draft":
    """The same head drafting only over `token_ids` (e.g. the most frequent target tokens of its training data)."""
    k = kind(draft.config)
    if k.vocab_rows is None:
        raise ValueError(f"with_draft_vocab: an {k.title} head's draft vocabulary is fixed by its own lm_head")
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
        k = self.kind
        if "d2t" in self.params and k.vocab_rows is not None:  # scored with the target's own output embedding
            rows = k.vocab_rows(self.params, self.target)
            # in the head's own weight format (a float16 head reads float16 vocabulary rows, a q8_0 head q8_0 ones)
            wd = self.weight_dtype
            self.lm_sub = ops.quantize(rows, wd) if wd in ops.BLOCK_KINDS else rows.astype(wd)
            if mesh is not None:
                self.lm_sub = sharding.put(self.lm_sub, sharding.named(mesh, DRAFT_AXES["lm_sub"]))
        if k.pack is not None and mesh is None:  # laid out as the target's weights are
            self.packed = k.pack(self.params, self.lm_sub, self.target.params)

    @property
    def kind(self) -> HeadKind:
        """The kind of head this is (`head_kinds`, by `config.head_type`)."""
        return kind(self.config)

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

    def _quantized(self, block: str) -> "Draft":
        if self.kind.quantize is None:
            raise ValueError(f"astype: {self.kind.title} heads cannot be stored as GGUF blocks yet")
        if ops.has_blocks(self.params):
            raise ValueError(f"this head is already stored as {self.weight_dtype} blocks")
        return dataclasses.replace(self, params=self.kind.quantize(self.params, block))

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
            raise ValueError(_feature_error(self.config, features.shape[-1]))
        return _forward_jit(self.params, self.config, self.target.params, self.target.config, tokens, features)


def _forward_impl(dparams, dcfg, tparams, tcfg, tokens, features):
    B, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h, _ = head_forward(dparams, dcfg, tparams["embed"], tokens, project_features(dparams, dcfg, features), pos)
    return h, kind(dcfg).target_logits(dparams, tparams, tcfg, h, dcfg)


def _feature_error(dcfg: DraftConfig, width: int) -> str:
    """What `Draft.forward` says of features `width` wide, naming the kinds whose features have that width."""
    k = kind(dcfg)
    msg = f"draft.forward: an {k.title} head takes target features [B,T,{dcfg.feature_size}] ({k.features}); got " \
          f"width {width}"
    others = []
    for name in head_kinds.names():
        other = head_kinds.get(name)
        try:
            fits = other is not k and other.feature_size(dcfg) == width
        except Exception:  # a kind that cannot describe this config
            fits = False
        if fits:
            others.append(f"{other.title} features ({other.features})")
    return msg + (f" -- {' or '.join(others)}?" if others else "")


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
