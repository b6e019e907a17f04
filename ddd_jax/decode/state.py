"""What one decode is: the static `Plan` (from `make_plan`), the `State` the loops carry, cache capacity, and the
`GenerateResult` handed back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax

from ..cache import KVCache
from ..config import DDDConfig, DraftConfig, GainModel, ModelConfig, TreeConfig, check_tree_for_ddd
from ..config import verify_widths  # noqa: F401 (decode.state.verify_widths: where callers have found it)
from .drafting import threshold_policy

METHODS = ("vanilla", "eagle2", "ddd")
SYNCS = ("host", "callback", "device")
PROMPT_BUCKETS = (32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


@dataclass(frozen=True)
class Plan:
    """Everything static about one decode: hashable, passed to jit as a static argument."""

    tcfg: ModelConfig
    dcfg: DraftConfig | None
    method: str  # "vanilla" | "eagle2" | "ddd"
    sync: str  # DDD's stop decision: "host" | "callback" | "device" ("device" for eagle2 / vanilla)
    top_k: int
    total_tokens: int  # verified tokens per cycle: root + total_tokens - 1 drafted nodes
    max_depth: int  # maximum draft steps (EAGLE-2: tree.depth; DDD: ddd.max_depth)
    check_steps: tuple  # DDD check steps (empty for EAGLE-2)
    temperature: float
    top_p: float
    max_new_tokens: int
    eos: tuple
    policy: Callable | None = None  # DDD host policy (sync "host" / "callback"): see `drafting.Policy`
    lookup: int = 0  # context-lookup candidates per cycle (TreeConfig.lookup; 0 = off)
    lookup_ngram: int = 2
    lookup_logp: float = -0.4
    stop0_nodes: int = -1  # DDD: the root's children a cycle stopped at a step-0 check still verifies (-1: all)
    gain: GainModel | None = None  # DDD rule "gain": calibrated acceptance and costs (None: the threshold rule)
    adaedl_gamma: float | None = None  # DDD rule "adaedl": its gamma (None: another rule)

    @property
    def M(self) -> int:  # longest accepted path incl. root (= most tokens one cycle emits)
        return max(self.max_depth + 2, self.lookup + 1)

    @property
    def scratch(self) -> int:  # draft cache scratch slots for beam nodes
        return self.max_depth * self.top_k

    @property
    def host_checks(self) -> bool:  # DDD decisions taken by the host between jitted segments
        return self.method == "ddd" and self.sync == "host"

    @property
    def verify_widths(self) -> tuple:
        """The verify forward's compiled widths (rows per sequence): those of `verify_widths(total_tokens)` that a
        cycle can need. Each cycle takes the narrowest that holds every live sequence's tree (`cycle._verify`).
        Every tree keeps the root's top_k children unless DDD stops at a step-0 check with stop0_nodes >= 0, so
        narrower widths are never compiled (one width: no switch at all, the forward as before)."""
        kept = self.top_k
        if self.method == "ddd" and 0 in self.check_steps and self.stop0_nodes >= 0:
            kept = min(kept, self.stop0_nodes)
        if self.gain is not None:  # the gain rule may verify the root alone
            kept = 0
        least = 1 + min(self.total_tokens - 1, kept)
        ws = verify_widths(self.total_tokens)
        return tuple(w for w in ws if w >= min(v for v in ws if v >= least))


@jax.tree_util.register_dataclass
@dataclass
class State:
    tcache: KVCache
    dcache: KVCache | None
    root: jax.Array  # [B] int32 last emitted token (not yet in the target cache)
    pend_tok: jax.Array  # [B, M] int32 draft pairs to commit next cycle: token at position p+1 ...
    pend_feat: jax.Array  # [B, M, Df] ... and the target feature at position p (Df = dcfg.feature_size)
    pend_n: jax.Array  # [B] int32
    out: jax.Array  # [B, max_new_tokens + M] int32 emitted tokens
    out_len: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    key: jax.Array  # PRNG key
    cycle: jax.Array  # [] int32 target calls after the prefill
    acc_hist: jax.Array  # [C, B] int32 tokens emitted per target call
    depth_hist: jax.Array  # [C, B] int32 draft steps per cycle
    rows_hist: jax.Array  # [C, B] int32 rows per sequence in each cycle's verify forward (0: finished)
    need_hist: jax.Array  # [C, B] int32 rows each sequence's own tree needed: its root and valid nodes
    checks: jax.Array  # [] int32 DDD checks executed inside jitted draft loops
    ctx: jax.Array  # [B, S + M] int32 token at each position, prompt then emitted (lookup; [B, 0] when off)


@dataclass
class GenerateResult:
    tokens: list  # new tokens (list[int]; list of lists for a batch)
    text: str | list
    stats: dict = field(default_factory=dict)


def bucket_length(n: int) -> int:
    for b in PROMPT_BUCKETS:
        if n <= b:
            return b
    return -(-n // 2048) * 2048


def cache_slack(plan: Plan) -> int:
    """Cache slots a decode needs past prompt + max_new_tokens: one cycle's tree, its accepted path and the
    draft scratch (speculative), or one path (vanilla), plus a little margin."""
    if plan.method == "vanilla":
        return plan.M + 8
    return plan.total_tokens + plan.M + plan.scratch + 8


def cache_capacity(prompt_len: int, plan: Plan) -> int:
    """The smallest KV-cache capacity (a multiple of 256) for a prompt of `prompt_len` tokens under `plan`."""
    need = max(bucket_length(prompt_len), prompt_len + plan.max_new_tokens + cache_slack(plan))
    return -(-need // 256) * 256


def make_plan(target, draft, *, method: str, sync: str, tree: TreeConfig, ddd: DDDConfig, temperature: float,
              top_p: float, max_new_tokens: int, policy=None) -> Plan:
    """Check the arguments of one decode and freeze them into a `Plan` (sync is normalised to "device" for
    methods other than DDD)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if sync not in SYNCS:
        raise ValueError(f"sync must be one of {SYNCS}, got {sync!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not (0.0 < top_p <= 1.0):
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got temperature={temperature}, top_p={top_p}")
    if method != "ddd":
        sync = "device"
    if policy is not None and sync == "device":
        raise ValueError("a DDD policy runs on the host: use method='ddd' with sync='host' or 'callback'")
    dcfg = None
    if method != "vanilla":
        if draft is None:
            raise ValueError(f"method={method!r} needs a draft head (load_draft / init_draft)")
        draft.config.check_target(target.config)
        dcfg = draft.config
        if dcfg.draft_vocab_size and tree.top_k > dcfg.draft_vocab_size:
            raise ValueError(f"top_k={tree.top_k} exceeds the draft vocabulary ({dcfg.draft_vocab_size} tokens)")
    if method == "ddd":
        check_tree_for_ddd(tree, ddd)
        max_depth, checks, policy = ddd.max_depth, tuple(ddd.check_steps), policy or threshold_policy
    else:
        max_depth, checks = tree.depth, ()
    return Plan(tcfg=target.config, dcfg=dcfg, method=method, sync=sync, top_k=tree.top_k,
                total_tokens=tree.total_tokens, max_depth=max_depth, check_steps=checks,
                temperature=float(temperature), top_p=float(top_p), max_new_tokens=int(max_new_tokens),
                eos=tuple(target.eos_token_ids), policy=policy, lookup=tree.lookup, lookup_ngram=tree.lookup_ngram,
                lookup_logp=float(tree.lookup_logp), stop0_nodes=int(ddd.stop0_nodes) if method == "ddd" else -1,
                gain=ddd.gain if method == "ddd" else None,
                adaedl_gamma=ddd.gamma if method == "ddd" and ddd.rule == "adaedl" else None)


def vanilla_plan(target, max_new_tokens: int) -> Plan:
    """The plan of `generate(target, None, ..., max_new_tokens=max_new_tokens)`: greedy vanilla, default sync."""
    return make_plan(target, None, method="vanilla", sync="device", tree=TreeConfig(), ddd=DDDConfig(),
                     temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens)
