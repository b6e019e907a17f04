"""Flax NNX module views of the target and the EAGLE head: `nnx.Param` leaves in the dict layout, pure forwards underneath.

A module holds exactly the arrays of the plain params dict (`llama.param_shapes` / `eagle.param_shapes`), each
wrapped in an `nnx.Param` (the head's `d2t` token ids in a `DraftVocab` variable, never trained), so
`nnx.to_pure_dict(nnx.state(m))` *is* the params dict and `__call__` is `llama.forward` / `eagle.head_forward`
over it: one implementation of every layer. Use modules to build, inspect and train (`nnx.Optimizer`); hot loops
(`generate`) keep passing the plain dicts into `jax.jit` (a `nnx.jit` call costs ~325 µs of Python per call here,
`jax.jit` over split state ~17 µs).

    target = LlamaModule(cfg, rngs=nnx.Rngs(0))               # or LlamaModule.from_params(cfg, params)
    head = EagleHeadModule(DraftConfig.from_target(cfg), rngs=nnx.Rngs(1))
    out = target(tokens, positions)                           # llama.Output(logits, hidden, cache)
    g, _ = head(target.embed[...], tokens[:, 1:], out.hidden[:, :-1], positions[:, :-1])
    params = head.to_params()                                 # plain nested dict, the same arrays
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from . import eagle, llama, ops
from .cache import KVCache
from .keytable import check_shapes


class DraftVocab(nnx.Variable):
    """`d2t` [V'] int32: target token ids of a reduced draft vocabulary. State, not a Param: never trained."""


def _wrap(tree: dict) -> dict:
    """Nested params dict -> the same nesting with each array in an `nnx.Param` (`d2t` in a `DraftVocab`)."""
    return {k: nnx.data(_wrap(v)) if isinstance(v, dict) else (DraftVocab(v) if k == "d2t" else nnx.Param(v))
            for k, v in tree.items()}


class _ParamsModule(nnx.Module):
    """Shared plumbing: one attribute per top-level key of the params dict; `to_params()` reads them back.
    Subclasses name the pure functions that describe and initialise their params."""

    _param_shapes = None  # config -> nested dict of shapes
    _init_params = None  # (config, key, dtype, std) -> params

    def __init__(self, config, params: dict | None = None, *, rngs: nnx.Rngs | None = None, dtype=jnp.float32,
                 std: float = 0.02):
        """Wrap `params` (arrays not copied), or draw random ones from `rngs.params()`."""
        self.config = config
        if params is None:
            if rngs is None:
                raise ValueError(f"{type(self).__name__}: pass params or rngs")
            params = type(self)._init_params(config, rngs.params(), dtype, std)
        check_shapes(params, type(self)._param_shapes(config), type(self).__name__)
        for k, v in _wrap(params).items():
            setattr(self, k, v)

    @classmethod
    def from_params(cls, config, params: dict):
        return cls(config, params)

    def to_params(self) -> dict:
        """The plain nested params dict (the module's arrays themselves, no copies)."""
        return nnx.to_pure_dict(nnx.state(self))


class LlamaModule(_ParamsModule):
    """The target model as an nnx module: state layout = `llama.param_shapes(config)`, `__call__` = `llama.forward`.
    `LlamaModule(config, params)` wraps a params dict; `LlamaModule(config, rngs=nnx.Rngs(0))` draws one."""

    _param_shapes = staticmethod(llama.param_shapes)
    _init_params = staticmethod(llama.init_params)

    @classmethod
    def from_target(cls, target) -> "LlamaModule":
        """A view of a `ddd_jax.Target`'s weights (shares its arrays; panel-major layer matrices, the CPU default,
        are unpacked into row-major copies: `load_target(..., panels=False)` shares them all)."""
        if ops.has_blocks(target.params):
            raise ValueError(f"target {target.name!r} keeps GGUF blocks (gguf_blocks=True): nnx modules hold float "
                             "arrays; load it without gguf_blocks to train or compose it as a module")
        return cls(target.config, ops.unpacked(target.params))

    def __call__(self, tokens, positions, cache: KVCache | None = None, attn_mask=None, logit_index=None,
                 return_logits: bool = True) -> llama.Output:
        """`llama.forward` over this module's params (see there for shapes)."""
        return llama.forward(self.to_params(), self.config, tokens, positions, cache, attn_mask, logit_index,
                             return_logits)


class EagleHeadModule(_ParamsModule):
    """A draft head (EAGLE-1/2, EAGLE-3 or any registered kind: `config.head_type`) as an nnx module: state layout
    = `eagle.param_shapes(config)`, `__call__` = `eagle.head_forward`. The target's embedding / lm_head are call
    arguments, never stored in the head."""

    _param_shapes = staticmethod(eagle.param_shapes)
    _init_params = staticmethod(eagle.init_params)

    @classmethod
    def from_draft(cls, draft) -> "EagleHeadModule":
        """A view of a `ddd_jax.Draft`'s head weights (shares its arrays; the target stays with the draft)."""
        if ops.has_blocks(draft.params):
            raise ValueError("this head is stored as GGUF blocks (Draft.astype('q8_0'...)): nnx modules hold float "
                             "arrays; use the float head to train or compose it as a module")
        return cls(draft.config, draft.params)

    def __call__(self, embed, tokens, features, positions, cache: KVCache | None = None, attn_mask=None,
                 mask_start=None):
        """`eagle.head_forward`: embed [V, D] is the target's embedding table (an array or a `LlamaModule`),
        tokens [B, T] (token_{i+1}), features [B, T, D] (feature_i), positions [B, T]; masks as there. Returns
        (next_features [B, T, D], cache)."""
        if isinstance(embed, LlamaModule):
            embed = embed.embed[...]
        return eagle.head_forward(self.to_params(), self.config, embed, tokens, features, positions, cache,
                                  attn_mask, mask_start)

    def forward(self, target: LlamaModule, tokens, features):
        """Causal, cache-free run over aligned pairs, like `Draft.forward` (features: the head's hidden input,
        `eagle.project_features` of the target's): returns (next_features [B, T, D], logits [B, T, V] over the
        target's vocabulary: the target's lm_head for EAGLE-1/2)."""
        B, T = jnp.shape(tokens)
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        h, _ = self(target, tokens, features, pos)
        return h, eagle.kind(self.config).target_logits(self.to_params(), target.to_params(), target.config, h,
                                                        self.config)


__all__ = ["LlamaModule", "EagleHeadModule", "DraftVocab"]
