"""Frozen, hashable configuration dataclasses (HF field names) for targets, draft heads, trees and DDD."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from . import head_kinds


def _freeze(v: Any) -> Any:
    """Turn dicts/lists into hashable tuples so a config can be a static jit argument."""
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


def normalize_rope(d: dict) -> tuple[float, tuple | None]:
    """(rope_theta, frozen rope_scaling or None) from an HF config dict: rope_theta defaults to 10000; transformers 5
    nests both in `rope_parameters`; a "default" (or untyped) rope_scaling means none."""
    rs = d.get("rope_scaling")
    rope_theta = d.get("rope_theta")
    if rope_theta is None:  # transformers 5 nests it in rope_parameters
        rp = d.get("rope_parameters") or {}
        rope_theta = rp.get("rope_theta", 10000.0)
        if rs is None and rp.get("rope_type", "default") not in ("default", None):
            rs = {k: v for k, v in rp.items() if k != "rope_theta"}
    if rs is not None and rs.get("rope_type", rs.get("type")) in ("default", None):
        rs = None
    return float(rope_theta), _freeze(rs) if rs else None


@dataclass(frozen=True)
class Family:
    """What an HF `model_type` implies for the one decoder layer (`llama.decoder_stack`)."""

    architecture: str  # the HF `architectures` entry written back by `ModelConfig.to_hf_config`
    qkv_bias: bool = False  # q/k/v projection biases, always (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope, always (Qwen3)
    attention_bias: bool = False  # honours HF's `attention_bias` field (q/k/v/o biases: Llama, Qwen3)
    sliding: str | None = None  # how the config states a sliding window: "mistral" | "qwen" | None (no window)


# The supported HF model types. Everything else fails naming these.
FAMILIES = {
    "llama": Family("LlamaForCausalLM", attention_bias=True),
    "mistral": Family("MistralForCausalLM", sliding="mistral"),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, sliding="qwen"),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True, attention_bias=True, sliding="qwen"),
}
_ARCH_TO_TYPE = {f.architecture: t for t, f in FAMILIES.items()}


def _hf_sliding_window(d: dict, fam: Family, model_type: str, n_layers: int) -> int | None:
    """The one sliding window every layer uses (None = full attention), from HF's fields; mixed layers fail."""
    if fam.sliding is None:
        if d.get("sliding_window") is not None or d.get("use_sliding_window"):
            raise ValueError(f"config.json: sliding_window={d.get('sliding_window')!r} is set but model_type "
                             f"{model_type!r} has no sliding-window attention (transformers would ignore it)")
        return None
    if fam.sliding == "mistral":  # MistralConfig: one window for every layer (None = full attention)
        window = d.get("sliding_window")
        first_sliding = 0
    else:  # Qwen2/Qwen3Config: a window only with use_sliding_window, on layers >= max_window_layers
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
        first_sliding = d.get("max_window_layers", 28)
    types = d.get("layer_types")
    if types is None:
        types = ["sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                 for i in range(n_layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != n_layers:
        raise ValueError(f"config.json: layer_types {types!r} must name 'full_attention' or 'sliding_attention' "
                         f"for each of the {n_layers} layers")
    n_sliding = types.count("sliding_attention")
    if n_sliding == 0:
        return None
    if n_sliding != n_layers:
        raise ValueError(
            f"config.json: sliding-window attention on {n_sliding} of {n_layers} layers (layer_types / "
            f"max_window_layers={d.get('max_window_layers')!r}) is not supported; only a window on every layer "
            "or on none")
    if window is None:
        raise ValueError("config.json: layer_types ask for sliding_attention but sliding_window is null "
                         "(or use_sliding_window is false)")
    return int(window)


@dataclass(frozen=True)
class LayerConfig:
    """The decoder layer's fields, shared by targets (`ModelConfig`) and draft heads (`DraftConfig`); HF names.
    The family switches (see `FAMILIES`) change the one decoder layer, not copies of it."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF's rope_scaling dict, frozen to a sorted tuple of (key, value); only "llama3" is implemented.
    rope_scaling: tuple | None = None
    attention_bias: bool = False  # biases on the q, k, v and o projections (HF's `attention_bias`)
    qkv_bias: bool = False  # biases on the q, k, v projections only (Qwen2; EAGLE heads' `qkv_bias`)
    qk_norm: bool = False  # per-head RMSNorm of q and k (weights [H]) before rope (Qwen3's q_norm / k_norm)


LAYER_FIELDS = tuple(f.name for f in dataclasses.fields(LayerConfig))


@dataclass(frozen=True)
class ModelConfig(LayerConfig):
    """Decoder config for the LLaMA family of architectures (Llama, Mistral, Qwen2, Qwen3); field names follow HF
    (`LlamaConfig`, `Qwen3Config`, ...). The family differences are switches of the one decoder layer."""

    num_hidden_layers: int = field(kw_only=True)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    model_type: str = "llama"  # "llama" | "mistral" | "qwen2" | "qwen3" (see `FAMILIES`)
    sliding_window: int | None = None  # every layer attends to positions p - sliding_window < p' <= p only

    def __post_init__(self):
        if self.hidden_size <= 0 or self.vocab_size <= 0 or self.num_hidden_layers <= 0:
            raise ValueError(f"ModelConfig: sizes must be positive, got {self}")
        if self.model_type not in FAMILIES:
            raise ValueError(f"ModelConfig: model_type {self.model_type!r} is not supported "
                             f"(supported: {sorted(FAMILIES)})")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"ModelConfig: sliding_window must be positive or None, got {self.sliding_window}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling_dict().get("rope_type", self.rope_scaling_dict().get("type"))
            if kind not in ("llama3", "default", None):
                raise ValueError(f"ModelConfig: rope_scaling type {kind!r} is not supported (only 'llama3')")

    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling) if self.rope_scaling else {}

    @property
    def num_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def has_qkv_bias(self) -> bool:
        return self.qkv_bias or self.attention_bias

    @classmethod
    def from_hf_config(cls, d: dict) -> "ModelConfig":
        """Build from an HF `config.json` dict (Llama / Mistral / Qwen2 / Qwen3 fields), dispatching on `model_type`.

        Fields this code does not implement (another activation, MLP biases, sliding windows on only some layers,
        rope scaling other than llama3) fail naming the field; nothing is silently ignored."""
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"config.json is missing required fields {missing}")
        archs = d.get("architectures") or []
        model_type = d.get("model_type") or next((_ARCH_TO_TYPE[a] for a in archs if a in _ARCH_TO_TYPE), "llama")
        if model_type not in FAMILIES:
            raise ValueError(f"config.json: model_type {model_type!r} (architectures {archs}) is not supported "
                             f"(supported model types: {sorted(FAMILIES)})")
        fam = FAMILIES[model_type]
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config.json: hidden_act={act!r} is not supported (the MLP is SwiGLU: 'silu')")
        if d.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported (MLP projections have no bias)")
        if d.get("attention_bias") and not fam.attention_bias:
            raise ValueError(f"config.json: attention_bias=true is not used by model_type {model_type!r} "
                             "(transformers would ignore it)")
        for name, implied in (("qkv_bias", fam.qkv_bias), ("qk_norm", fam.qk_norm)):
            if name in d and bool(d[name]) != implied:
                raise ValueError(f"config.json: {name}={d[name]!r} contradicts model_type {model_type!r} "
                                 f"(which implies {name}={implied})")
        n_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        eos = d.get("eos_token_id")
        eos = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),))
        rope_theta, rope_scaling = normalize_rope(d)
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(n_heads),
            num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            model_type=model_type,
            attention_bias=bool(d.get("attention_bias", False)),
            qkv_bias=fam.qkv_bias,
            qk_norm=fam.qk_norm,
            sliding_window=_hf_sliding_window(d, fam, model_type, int(d["num_hidden_layers"])),
        )

    def to_hf_config(self) -> dict:
        """An HF `config.json` dict for this model (transformers builds the same model from it); fails for switch
        combinations no HF architecture has (e.g. qk_norm on a 'llama')."""
        fam = FAMILIES[self.model_type]
        bad = [f"{name}={getattr(self, name)}" for name, ok in (
            ("qkv_bias", self.qkv_bias == fam.qkv_bias), ("qk_norm", self.qk_norm == fam.qk_norm),
            ("attention_bias", fam.attention_bias or not self.attention_bias),
            ("sliding_window", fam.sliding is not None or self.sliding_window is None)) if not ok]
        if bad:
            raise ValueError(f"ModelConfig with model_type={self.model_type!r} and {', '.join(bad)} has no HF "
                             "equivalent")
        d = dataclasses.asdict(self)
        d["rope_scaling"] = self.rope_scaling_dict() or None
        d["eos_token_id"] = list(self.eos_token_id)
        d["architectures"] = [fam.architecture]
        d["hidden_act"] = "silu"
        if fam.sliding == "qwen":
            sliding = self.sliding_window is not None
            d.update(use_sliding_window=sliding, max_window_layers=0 if sliding else self.num_hidden_layers,
                     layer_types=["sliding_attention" if sliding else "full_attention"] * self.num_hidden_layers)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_hf_config(), indent=2)


HEAD_TYPES = tuple(head_kinds.BUILTIN)  # the built-in head kinds; `head_kinds.names()` adds those registered since


@dataclass(frozen=True)
class DraftConfig(LayerConfig):
    """A draft head: EAGLE-1/2 (``head_type="eagle1"``: fc(2H->H, bias) + one LLaMA decoder layer without input
    norm) or EAGLE-3 (``head_type="eagle3"``: fc(3H_target->H) on three target layers' features + one decoder
    layer attending over cat(norm(embed), norm(hidden)), own final norm and lm_head over a draft vocabulary;
    see `ddd_jax.eagle3`), or any kind registered in `ddd_jax.head_kinds` (`head_type` names it; what depends on the
    kind -- its features, its weights -- is the kind's).

    Records the target's vocab and hidden size so a head is never run against the wrong target.
    """

    fc_bias: bool = True
    target_name: str | None = None  # free text: what the head was trained for
    # The layer's family switches (LayerConfig) come from the target in `from_target`: a Qwen2 target's head has
    # q/k/v biases (as EAGLE's official Qwen2 heads: `qkv_bias`), a Qwen3 target's head per-head q/k norms and the
    # target's head_dim. A head never has a sliding window (EAGLE heads attend to everything).
    # Reduced draft vocabulary (lossless: the target still verifies every token). When set, the head's params
    # carry `d2t` [draft_vocab_size] target token ids and drafting scores only those tokens, which makes a
    # draft step far cheaper for small targets whose lm_head dominates. None = the full target vocabulary.
    draft_vocab_size: int | None = None
    head_type: str = "eagle1"  # the head's kind (`head_kinds`): "eagle1" (EAGLE-1/2) | "eagle3" | one registered
    # EAGLE-3: the target's hidden size when it differs from the head's own (official `target_hidden_size`)
    target_hidden_size: int | None = None

    def __post_init__(self):
        try:
            kind = head_kinds.get(self.head_type)
        except ValueError:
            names = head_kinds.names()
            raise ValueError(f"DraftConfig: head_type must be one of {names}, got {self.head_type!r}") from None
        kind.check_config(self)

    @property
    def feature_size(self) -> int:
        """Width of the target features the head consumes (its kind's `feature_size`): H_target (EAGLE-1/2) or
        3*H_target (EAGLE-3)."""
        return head_kinds.get(self.head_type).feature_size(self)

    @classmethod
    def from_target(cls, cfg: ModelConfig, target_name: str | None = None, **over) -> "DraftConfig":
        kw = {f: getattr(cfg, f) for f in LAYER_FIELDS}
        kw.update(target_name=target_name, **over)
        return cls(**kw)

    def check_target(self, cfg: ModelConfig) -> None:
        th = self.target_hidden_size or self.hidden_size
        if self.vocab_size != cfg.vocab_size or th != cfg.hidden_size:
            raise ValueError(
                f"draft head was built for vocab_size={self.vocab_size}, hidden_size={th} "
                f"but the target has vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}")
        head_kinds.get(self.head_type).feature_layers(cfg)  # raises for a target the kind cannot read

    def layer_config(self) -> ModelConfig:
        """The one decoder layer, described as a 1-layer ModelConfig (shared layer code)."""
        return ModelConfig(num_hidden_layers=1, **{f: getattr(self, f) for f in LAYER_FIELDS})

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"draft config has unknown fields {sorted(unknown)}")
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = _freeze(d["rope_scaling"])
        return cls(**d)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d


LOOKUP_MAX_NGRAM = 4  # longest context suffix a lookup tries to match (TreeConfig.lookup)


@dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2 dynamic tree settings.

    Conventions (used everywhere, DDD included):
      * draft *step 0* is the head forward over the newly committed prefix; it yields the top_k
        depth-1 candidates (the first beam).
      * draft *step j* (j = 1..depth) runs the head on the beam of depth-j nodes and yields
        top_k**2 depth-(j+1) candidates, of which the top_k by cumulative log-prob form the next beam.
      * ``depth`` counts steps 1..depth (EAGLE-2's `depth`; depth=5 means 6 head forwards), so the
        candidate pool holds top_k + depth * top_k**2 nodes and the deepest drafted node is at depth+1.
      * ``total_tokens`` counts the verified tokens: the root (the last emitted token) plus
        total_tokens - 1 drafted nodes.
      * ``lookup`` (0 = off) adds context-lookup candidates to the pool (prompt lookup decoding): the up to
        ``lookup`` tokens that followed the most recent earlier occurrence of the context's last n tokens
        (prompt and emitted tokens; n from `LOOKUP_MAX_NGRAM` down to ``lookup_ngram``, the longest match
        wins), a chain under the root -- or under the head's first-step candidate with the same token. Each
        lookup token adds ``lookup_logp`` to its chain's score, and the rerank weighs them against the head's
        cumulative log-probs, so the tree holds them only when they beat the head's nodes. Verification is
        unchanged, so decoding stays lossless.
    """

    top_k: int = 10
    total_tokens: int = 60
    depth: int = 5
    lookup: int = 0
    lookup_ngram: int = 2
    lookup_logp: float = -0.4

    def __post_init__(self):
        if not 1 <= self.top_k:
            raise ValueError(f"TreeConfig: top_k must be >= 1, got {self.top_k}")
        if self.depth < 0:
            raise ValueError(f"TreeConfig: depth must be >= 0, got {self.depth}")
        if self.total_tokens < 2:
            raise ValueError(f"TreeConfig: total_tokens must be >= 2 (root + one draft), got {self.total_tokens}")
        if self.lookup < 0:
            raise ValueError(f"TreeConfig: lookup must be >= 0 (0 = no context-lookup candidates), got {self.lookup}")
        if not 1 <= self.lookup_ngram <= LOOKUP_MAX_NGRAM:
            raise ValueError(f"TreeConfig: lookup_ngram must be in [1, {LOOKUP_MAX_NGRAM}], got {self.lookup_ngram}")
        if not (math.isfinite(self.lookup_logp) and self.lookup_logp <= 0):
            raise ValueError(f"TreeConfig: lookup_logp is a log-probability: finite and <= 0, got {self.lookup_logp}")
        if self.total_tokens - 1 > self.pool_size(self.depth) + self.lookup:
            raise ValueError(
                f"TreeConfig: total_tokens - 1 = {self.total_tokens - 1} drafted nodes exceed the candidate pool "
                f"top_k + depth*top_k**2 + lookup = {self.pool_size(self.depth) + self.lookup} (top_k={self.top_k}, "
                f"depth={self.depth}, lookup={self.lookup})")

    def to_dict(self) -> dict:
        """The settings as a dict, the lookup's only when it is on (what settings files and stats hold)."""
        d = {"top_k": self.top_k, "total_tokens": self.total_tokens, "depth": self.depth}
        if self.lookup:
            d.update(lookup=self.lookup, lookup_ngram=self.lookup_ngram, lookup_logp=self.lookup_logp)
        return d

    def pool_size(self, depth: int) -> int:
        """The head's candidates after `depth` expansion steps (lookup candidates come on top: when a lookup
        finds no match, its tree slots stay empty -- `Tree.valid` -- and are verified for nothing)."""
        return self.top_k + depth * self.top_k ** 2


DDD_RULES = ("threshold", "gain", "adaedl")


def verify_widths(total_tokens: int) -> tuple:
    """The widths a tree of `total_tokens` nodes is verified at (rows per sequence): the powers of two below
    total_tokens, then total_tokens (what a plan compiles; `calibration.predict` prices each)."""
    return tuple(w for w in (1, 2, 4, 8, 16, 32, 64, 128) if w < total_tokens) + (int(total_tokens),)


@dataclass(frozen=True)
class GainModel:
    """What the expected-gain DDD rule reads (`DDDConfig(rule="gain")`): the head's calibrated acceptance and this
    host's costs, as static tuples (a plan is hashable). `ddd_jax.calibrate` builds it
    (`measure.node_acceptance`).

    A node's calibrated probability of acceptance is accept[depth - 1][bin of its cumulative draft log-prob], the
    bins cut at `score_edges` (ascending; bin i holds scores in [edges[i-1], edges[i])); `cont[d - 1]`: the share of
    accepted depth-d beam nodes with an accepted child (what one more step adds). Costs in ms: `verify_ms[i]` one
    target forward at `widths[i]` rows (the plan's compiled verify widths), `draft_ms` one draft step over the
    beam, `fixed_ms` the rest of a cycle (tree, acceptance, commit). `rate`: the tokens per ms the decode is
    expected to reach (every extra step and row must earn at least that; 0: each cycle's own expected rate)."""

    score_edges: tuple[float, ...]  # [E]
    accept: tuple[tuple[float, ...], ...]  # [D][E + 1] P(accepted | depth, score bin)
    cont: tuple[float, ...]  # [D]
    widths: tuple[int, ...]  # [Wn] ascending, the last = total_tokens
    verify_ms: tuple[float, ...]  # [Wn]
    draft_ms: float
    fixed_ms: float
    rate: float = 0.0

    def __post_init__(self):
        f = lambda xs: tuple(float(x) for x in xs)  # noqa: E731  (lists from JSON -> hashable tuples)
        object.__setattr__(self, "score_edges", f(self.score_edges))
        object.__setattr__(self, "accept", tuple(f(r) for r in self.accept))
        object.__setattr__(self, "cont", f(self.cont))
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        object.__setattr__(self, "verify_ms", f(self.verify_ms))
        for name in ("draft_ms", "fixed_ms", "rate"):
            object.__setattr__(self, name, float(getattr(self, name)))
        E = len(self.score_edges)
        if list(self.score_edges) != sorted(self.score_edges):
            raise ValueError("GainModel: score_edges must be ascending")
        if not self.accept or any(len(r) != E + 1 for r in self.accept):
            raise ValueError(f"GainModel: accept must hold a row of {E + 1} bins per depth (score_edges has {E})")
        if any(not 0.0 <= x <= 1.0 for r in self.accept for x in r) or any(not 0.0 <= x <= 1.0 for x in self.cont):
            raise ValueError("GainModel: accept and cont are probabilities in [0, 1]")
        if len(self.cont) != len(self.accept):
            raise ValueError(f"GainModel: cont has {len(self.cont)} depths, accept {len(self.accept)}")
        if not self.widths or list(self.widths) != sorted(set(self.widths)) or len(self.verify_ms) != len(self.widths):
            raise ValueError("GainModel: widths must be ascending and distinct, with one verify_ms each")
        if min(self.verify_ms + (self.draft_ms, self.fixed_ms, self.rate)) < 0:
            raise ValueError("GainModel: costs and rate must be >= 0")

    def to_dict(self) -> dict:
        """The model as JSON-able lists (`GainModel(**d)` reads it back)."""
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        d["accept"] = [list(r) for r in self.accept]
        return d


@dataclass(frozen=True)
class DDDConfig:
    """Dynamic Depth Decoding: at each check step s in check_steps (step numbering as in TreeConfig),
    stop drafting if logsumexp(beam cumulative log-probs) < threshold; never draft past max_depth. A check at
    step 0 (an extension of the paper, whose checks start at step 5) looks at the root's top_k children before
    any expansion step, so an unconfident cycle verifies them without paying for a draft step. stop0_nodes: how
    many of those children (the best first) a cycle stopped at step 0 still verifies: -1 all of them; 0 none, so
    the cycle verifies its root alone (and any lookup chain) and costs a vanilla step plus the head's first call.

    rule="gain" (with `gain`, a `GainModel`) replaces the confidence by expected gain against this host's costs: at
    each check step a sequence keeps drafting while the tokens one more step is expected to add, at calibrated
    acceptance probabilities, are worth more than its draft time and the rows it adds (log of their ratio against
    `gain.rate`, compared with `threshold`: 0 breaks even), and each cycle verifies the width that maximises its
    expected tokens against its cost (docs/method.md). stop0_nodes does not apply: the width decides.

    rule="adaedl" (with `gamma` > 0, default 1) is AdaEDL's entropy stop (Agrawal et al. 2024, `ddd_jax.adaedl`): at
    each check step a sequence keeps drafting while 1 - sqrt(gamma * H) >= threshold (the paper's lambda), H the
    entropy in nats of the draft distribution its beam's best node was drawn from. The threshold stays fixed: the
    paper's lambda adaptation would need state across cycles."""

    check_steps: tuple[int, ...] = (5, 7, 9)
    threshold: float = -0.3
    max_depth: int = 11
    stop0_nodes: int = -1
    rule: str = "threshold"
    gain: GainModel | None = None
    gamma: float | None = None  # rule "adaedl" only (None there: 1.0)

    def __post_init__(self):
        cs = tuple(int(s) for s in self.check_steps)
        object.__setattr__(self, "check_steps", cs)
        if isinstance(self.gain, dict):
            object.__setattr__(self, "gain", GainModel(**self.gain))
        if not cs:
            raise ValueError("DDDConfig: check_steps must not be empty")
        if list(cs) != sorted(set(cs)):
            raise ValueError(f"DDDConfig: check_steps must be strictly increasing, got {cs}")
        if cs[0] < 0 or cs[-1] >= self.max_depth:
            raise ValueError(f"DDDConfig: check steps must lie in [0, max_depth) = [0, {self.max_depth}), got {cs}")
        if self.stop0_nodes < -1:
            raise ValueError(f"DDDConfig: stop0_nodes must be -1 (all) or >= 0, got {self.stop0_nodes}")
        if self.rule not in DDD_RULES:
            raise ValueError(f"DDDConfig: rule must be one of {DDD_RULES}, got {self.rule!r}")
        if (self.rule == "gain") != (self.gain is not None):
            raise ValueError("DDDConfig: rule='gain' needs gain= (a GainModel, from ddd_jax.calibrate), and only it")
        if self.rule == "gain" and self.stop0_nodes != -1:
            raise ValueError("DDDConfig: the gain rule chooses the verified width itself; leave stop0_nodes at -1")
        if self.rule == "adaedl":
            if self.gamma is None:
                object.__setattr__(self, "gamma", 1.0)
            object.__setattr__(self, "gamma", float(self.gamma))
            if not (math.isfinite(self.gamma) and self.gamma > 0):
                raise ValueError(f"DDDConfig: the adaedl rule's gamma must be finite and > 0, got {self.gamma}")
            if not math.isfinite(self.threshold):
                raise ValueError(f"DDDConfig: the adaedl rule's threshold (lambda) must be finite, got {self.threshold}")
        elif self.gamma is not None:
            raise ValueError(f"DDDConfig: gamma belongs to rule='adaedl', not rule={self.rule!r}")

    @property
    def min_depth(self) -> int:
        return self.check_steps[0]

    def to_dict(self) -> dict:
        """The rule as a dict (JSON): the threshold rule's fields, and `rule` with `gain` (the gain rule) or `gamma`
        (the adaedl rule)."""
        d = {"check_steps": list(self.check_steps), "threshold": self.threshold, "max_depth": self.max_depth,
             "stop0_nodes": self.stop0_nodes}
        if self.rule == "gain":
            d.update(rule=self.rule, gain=self.gain.to_dict())
        elif self.rule == "adaedl":
            d.update(rule=self.rule, gamma=self.gamma)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DDDConfig":
        return cls(**{**d, "check_steps": tuple(d["check_steps"])})


def ddd_pool(tree: TreeConfig, ddd: DDDConfig) -> int:
    """The candidate pool when DDD drafts to its maximum depth, context-lookup candidates included: a tree keeps at
    most this many nodes (`check_tree_for_ddd`). An earlier stop leaves fewer, and the cycle verifies just those
    (`cycle._verify`)."""
    return tree.pool_size(ddd.max_depth) + tree.lookup


def check_tree_for_ddd(tree: TreeConfig, ddd: DDDConfig) -> None:
    """The tree's `total_tokens - 1` drafted nodes must fit the candidate pool DDD can draft (`ddd_pool`), and a gain
    rule must price exactly the tree's verify widths and its depths. The one statement of this rule (generate,
    settings, bench and tune use it)."""
    if ddd.rule == "gain":
        if tree.lookup:
            raise ValueError("the gain rule prices the head's candidates only: use it with TreeConfig(lookup=0)")
        if ddd.gain.widths != verify_widths(tree.total_tokens):
            raise ValueError(f"the gain rule prices widths {ddd.gain.widths}, but total_tokens={tree.total_tokens} "
                             f"verifies at {verify_widths(tree.total_tokens)}: calibrate for this tree")
    pool = ddd_pool(tree, ddd)
    if tree.total_tokens - 1 > pool:
        raise ValueError(f"total_tokens - 1 = {tree.total_tokens - 1} exceeds the candidate pool DDD can draft by its "
                         f"max_depth {ddd.max_depth}: {pool} (top_k={tree.top_k}, lookup={tree.lookup})")
