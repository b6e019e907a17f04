"""Kinds of draft head: everything the decode loop, `Draft` and the trainers need from a head, as one `HeadKind` of
pure functions per kind, registered by name.

A head's kind is its config's `DraftConfig.head_type` (saved in every head's config.json); `get(name)` gives the
kind. Every caller resolves it from the static config while tracing (`eagle.kind(dcfg)`), so a kind adds no Python
dispatch to a decode step: the programs are those of the kind's functions. Built in: "eagle1" (EAGLE-1/2,
`ddd_jax.eagle1`) and "eagle3" (EAGLE-3, `ddd_jax.eagle3`); each registers itself when its module is imported, and
`get` imports them on first use. A new kind is one module: its functions, then `register(HeadKind(...))`; then
`init_draft(target, head_type=name)`, `Draft`, `save_draft` / `load_draft` and `generate` take it as they are.

What a kind says (shapes: B batch, T tokens, D the head's width, Df its target features' width, V the target's
vocabulary, V' the draft vocabulary):

* the target features it reads: `feature_layers(tcfg)` -- the target layers whose *input* residual stream it
  reads, concatenated low to high (`llama.forward(aux_layers=...)`), or () for the final hidden state; it raises
  for a target it cannot read. `feature_size(dcfg)` is their width Df, and `project_features(dparams, dcfg, feats
  [..., Df]) -> [..., D]` what the head's layer reads of them (applied to target features only, never to the
  head's own outputs, which drafting feeds back as they are);
* one draft step: `head_forward(dparams, dcfg, embed, tokens [B, T], h [B, T, D], positions [B, T], cache=None,
  attn_mask=None, mask_start=None, attend=None) -> (next h [B, T, D], cache)` (masks, cache and `attend`, the
  training-time test's attention, as `eagle.head_forward`; a kind that is never trained with `train_draft.ttt` may
  leave `attend` out);
  `draft_logits(dparams, tparams, tcfg, h, dcfg)`: log-probs [..., V'] over its draft vocabulary;
  `target_logits(...)`: logits [..., V] over the target's vocabulary (`Draft.forward`); `d2t(dparams)`: the
  vocabulary map, [V'] int32 target ids of the draft ids, or None for the whole target vocabulary;
* its weights: `param_shapes(dcfg)` (the one description that init, loading, saving and sharding read),
  `init_params(dcfg, key, dtype, std)`, `axes` (logical axes of its own weight names, beside `llama.WEIGHT_AXES`
  and `eagle.DRAFT_AXES`), `check_config(dcfg)`; optional `vocab_rows` (a head scoring drafts with the target's own
  lm_head: the rows of a reduced vocabulary, `Draft.lm_sub`; `with_draft_vocab` needs it), `pack` (decode params
  laid out as the target's on a backend that packs them) and `quantize` (`Draft.astype("q8_0")`).

Loading: our head format (`checkpoints/ours.py`) is the config and `param_shapes`' flat keys, the same for every
kind. Official PyTorch heads are converted by key tables in `checkpoints/`: EAGLE-1/2 in `eagle_official.py`,
EAGLE-3 (recognised by its tensor names) in `eagle3_official.py`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Mapping

BUILTIN = {"eagle1": "ddd_jax.eagle1", "eagle3": "ddd_jax.eagle3"}  # name -> the module that registers it


def _no_check(dcfg) -> None:
    return None


def _d2t_param(dparams):
    return dparams.get("d2t")


@dataclass(frozen=True)
class HeadKind:
    """One kind of draft head (see the module docstring for each function's contract)."""

    name: str  # DraftConfig.head_type: the registry key
    title: str  # how messages name it ("EAGLE-1/2")
    features: str  # what its target features are, for messages ("the target's final hidden state")
    # the target features it reads
    feature_layers: Callable  # (tcfg) -> tuple[int, ...]; () = the final hidden state
    feature_size: Callable  # (dcfg) -> Df
    project_features: Callable  # (dparams, dcfg, feats [..., Df]) -> [..., D]
    # one draft step
    head_forward: Callable  # (dparams, dcfg, embed, tokens, h, positions, cache, attn_mask, mask_start, attend=None)
    #                         -> (h, cache)
    draft_logits: Callable  # (dparams, tparams, tcfg, h, dcfg) -> log-probs [..., V']
    target_logits: Callable  # (dparams, tparams, tcfg, h, dcfg) -> logits [..., V]
    # its weights
    param_shapes: Callable  # (dcfg) -> nested dict of shapes
    init_params: Callable  # (dcfg, key, dtype, std) -> params
    axes: Mapping = field(default_factory=dict)  # weight name -> logical axes
    check_config: Callable = _no_check  # (dcfg) -> None; raises ValueError
    d2t: Callable = _d2t_param  # (dparams) -> [V'] int32 target ids | None
    vocab_rows: Callable | None = None  # (params, target) -> [V', D] output-embedding rows of params["d2t"]
    pack: Callable | None = None  # (params, lm_sub, tparams) -> packed decode params | None
    quantize: Callable | None = None  # (params, block kind) -> params with GGUF-block matrices


_KINDS: dict[str, HeadKind] = {}


def register(kind: HeadKind) -> HeadKind:
    """Make `kind` available as `DraftConfig(head_type=kind.name)`; registering a name again replaces it."""
    _KINDS[kind.name] = kind
    return kind


def _load_builtins() -> None:
    for name, module in BUILTIN.items():
        if name not in _KINDS:
            importlib.import_module(module)


def get(name: str) -> HeadKind:
    """The kind registered as `name`; ValueError when there is none."""
    kind = _KINDS.get(name)
    if kind is None:
        _load_builtins()
        kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown head kind {name!r}; registered: {names()}")
    return kind


def names() -> tuple[str, ...]:
    """The registered kinds' names, the built-in ones first."""
    _load_builtins()
    return tuple([n for n in BUILTIN if n in _KINDS] + [n for n in _KINDS if n not in BUILTIN])


def require(dcfg, name: str, what: str) -> None:
    """Raise ValueError unless `dcfg` describes a head of kind `name` (`what` begins the message)."""
    if dcfg.head_type != name:
        raise ValueError(f"{what}: an {get(name).title} head is needed, this one is {dcfg.head_type}")
