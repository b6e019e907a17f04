"""Losslessness as a property (hypothesis): every drawn EAGLE-2 tree (top_k, total_tokens, depth, context lookup),
DDD rule (check steps with or without a step-0 check, threshold, max depth, stop0_nodes), batch of prompts and sync
mode decodes exactly vanilla greedy's tokens, in JAX (`ddd_jax.generate`) and in the PyTorch counterpart
(`ddd_jax.bench.torch_decoding`, whose vanilla is JAX's vanilla too). Greedy only: sampling's losslessness is a
statement about distributions (tests/test_spec.py's chi-square test), not about equal tokens.

Every drawn configuration is a new static plan, so a JAX example costs a compile (about a second with a warm
compile cache, several without): the fast tests draw a few, the slow ones more. The torch counterpart runs
eagerly, so its examples are cheap. Draws are derandomized: every run tries the same configurations."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

import ddd_jax
from ddd_jax import DDDConfig, TreeConfig
from ddd_jax.config import check_tree_for_ddd
from ddd_jax.decode import SYNCS
from spec_helpers import first_mismatch_margin, fitted_draft, prompts, tiny_target

MAX_NEW = 14
NEAR_TIE = 1e-4  # a mismatch where vanilla's top-2 logits are this close is float noise, not a lossless defect
MAX_TOP_K, MAX_TOTAL, MAX_DDD_DEPTH, MAX_TREE_DEPTH = 4, 12, 5, 3
# the prompts the fitted head was trained on (it accepts long drafts there) beside drawn token rows
TRAIN = [tuple(map(int, p)) for p in prompts(64, seed=100, lo=2, hi=8)]
VOCAB = 96  # spec_helpers.TINY.vocab_size; token 95 is its EOS


def _settings(n: int) -> settings:
    """`n` derandomized examples, no deadline (a JAX example compiles), no explain phase (each of its variants
    would compile again); a failure is shrunk and printed with its reproduction."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=False,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------------------------------------- strategies
# threshold: a grid over the fitted head's confidences (the root's top-k mass spans about [-2.5, 0], the beam's
# after step 3 about -6), so DDD stops at different checks on different cycles; and the two rules' limits
THRESHOLDS = st.one_of(st.integers(-24, 2).map(lambda i: i / 4), st.sampled_from([-math.inf, math.inf]))


@st.composite
def ddd_rules(draw, top_k: int) -> DDDConfig:
    """A DDD rule: max depth 1..5, check steps in [0, max_depth) with a step-0 check half the time, a threshold,
    and stop0_nodes -1 (all), 0 (none) or 1..top_k."""
    max_depth = draw(st.integers(1, MAX_DDD_DEPTH))
    later = draw(st.sets(st.integers(1, max_depth - 1), max_size=3)) if max_depth > 1 else set()
    checks = ({0} if draw(st.booleans()) else set()) | later
    if not checks:
        checks = {draw(st.integers(0, max_depth - 1))}
    stop0 = draw(st.sampled_from([-1, 0, *range(1, top_k + 1)]))
    return DDDConfig(check_steps=tuple(sorted(checks)), threshold=draw(THRESHOLDS), max_depth=max_depth,
                     stop0_nodes=stop0)


@st.composite
def spec_configs(draw, lookup: bool = True, syncs=SYNCS, eagle2_min_depth: int = 0):
    """(method, sync, TreeConfig, DDDConfig | None): a valid speculative configuration (EAGLE-2 of depth at least
    `eagle2_min_depth`, or DDD in one of `syncs`), its tree at most MAX_TOTAL tokens; `lookup` draws
    context-lookup candidates too."""
    method = draw(st.sampled_from(["eagle2", "ddd"]))
    top_k = draw(st.integers(1, MAX_TOP_K))
    depth = draw(st.integers(eagle2_min_depth if method == "eagle2" else 0, MAX_TREE_DEPTH))
    look = draw(st.sampled_from([0, 2, 3])) if lookup else 0
    rule = draw(ddd_rules(top_k)) if method == "ddd" else None
    pool = top_k + depth * top_k ** 2 + look  # TreeConfig's own rule (its depth), and DDD's (its max depth)
    if rule is not None:
        pool = min(pool, top_k + rule.max_depth * top_k ** 2 + look)
    total = draw(st.integers(2, min(MAX_TOTAL, pool + 1)))
    tree = TreeConfig(top_k=top_k, total_tokens=total, depth=depth, lookup=look)
    if rule is not None:
        check_tree_for_ddd(tree, rule)  # the drawn tree fits the pool DDD can draft
    sync = draw(st.sampled_from(list(syncs))) if method == "ddd" else "device"
    return method, sync, tree, rule


PROMPT = st.one_of(st.sampled_from(TRAIN), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20).map(tuple))
BATCHES = st.lists(PROMPT, min_size=1, max_size=3)


# ---------------------------------------------------------------------------------------------------- checks
def _repro(method, sync, tree, ddd, ps, framework="jax") -> str:
    batch = list(map(list, ps)) if len(ps) > 1 else list(ps[0])
    if framework == "jax":
        call = (f"ddd_jax.generate(tiny_target(), fitted_draft(), {batch}, max_new_tokens={MAX_NEW}, "
                f"method={method!r}, sync={sync!r}, tree={tree!r}, ddd={ddd!r})")
    else:
        call = (f"torch_decoding.generate(torch_decoding.load_torch(tiny_target(), fitted_draft()), {batch}, "
                f"{MAX_NEW}, method={method!r}, sync={sync!r}, tree={tree!r}, ddd={ddd!r})")
    return f"reproduce (tests/spec_helpers.py): {call}"


def assert_vanilla(target, ps, ref, got, what: str) -> None:
    """Each of `got` is its vanilla `ref`, except at a float near-tie of vanilla's top-2 logits."""
    for p, r, g in zip(ps, ref, got):
        m = first_mismatch_margin(target, list(p), r, g)
        if m is not None:
            i, margin = m
            assert margin < NEAR_TIE, (f"{what}: differs from vanilla at new token {i} (top-2 margin {margin:.3g})\n"
                                       f"  prompt  {list(p)}\n  vanilla {r}\n  got     {g}")


class Seen:
    """What the drawn decodes did, for coverage checks after a property's run."""

    def __init__(self):
        self.depths, self.step0_stops, self.kinds = set(), 0, []

    def add(self, method, sync, ps, tree, ddd, depth_lists):
        self.kinds.append((method, sync, len(ps), tree, ddd))
        for d in depth_lists:
            self.depths.update(d)
            if method == "ddd" and 0 in ddd.check_steps:
                self.step0_stops += d.count(0)

    def assert_covered(self, syncs, depths: int, batch: int = 1) -> None:
        """The draws reached every DDD sync mode and EAGLE-2 and every batch size up to `batch`, some cycle stopped
        at a step-0 check, and cycles drafted to at least `depths` different depths (the draws are derandomized:
        what one run covers, every run covers)."""
        assert {k[2] for k in self.kinds} >= set(range(1, batch + 1)), sorted({k[2] for k in self.kinds})
        kinds = {(m, s) for m, s, *_ in self.kinds}
        want = {("eagle2", "device")} | {("ddd", s) for s in syncs}
        assert kinds >= want, f"draws missed {sorted(want - kinds)}"
        assert self.step0_stops > 0 and len(self.depths) >= depths, (self.step0_stops, sorted(self.depths))


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(), fitted_draft()


@pytest.fixture(scope="module")
def vanilla(tiny):
    """JAX vanilla's tokens of a batch of prompts (the speculative call's batch: the same shapes), memoized."""
    target, _ = tiny
    memo = {}

    def get(ps: tuple) -> list:
        if ps not in memo:
            res = ddd_jax.generate(target, None, [list(p) for p in ps], max_new_tokens=MAX_NEW)
            memo[ps] = res.tokens
        return memo[ps]
    return get


# ------------------------------------------------------------------------------------------------------- JAX
def _jax_property(target, draft, vanilla, seen: Seen, n: int):
    @_settings(n)
    @given(cfg=spec_configs(), ps=BATCHES)
    def prop(cfg, ps):
        method, sync, tree, ddd = cfg
        ps = tuple(ps)
        note(_repro(method, sync, tree, ddd, ps))
        batch = [list(p) for p in ps] if len(ps) > 1 else list(ps[0])
        res = ddd_jax.generate(target, draft, batch, max_new_tokens=MAX_NEW, method=method, sync=sync, tree=tree,
                               ddd=ddd)
        got = res.tokens if len(ps) > 1 else [res.tokens]
        assert_vanilla(target, ps, vanilla(ps), got, f"jax {method}/{sync} {tree} {ddd}")
        per = res.stats["per_sequence"] if len(ps) > 1 else [res.stats]
        most = max((ddd.max_depth if ddd else tree.depth) + 2, tree.lookup + 1)  # one cycle's longest path
        for st_, toks in zip(per, got):
            assert sum(st_["accepted_per_call"]) == len(toks) - 1  # the first token comes from the prefill
            assert max(st_["accepted_per_call"], default=1) <= most
        seen.add(method, sync, ps, tree, ddd, [s["depth_per_call"] for s in per])
    prop()


@pytest.mark.slow  # 12 drawn decodes (~45 s)
def test_jax_decodes_vanilla_tokens_for_drawn_configs(tiny, vanilla):
    target, draft = tiny
    seen = Seen()
    _jax_property(target, draft, vanilla, seen, n=12)
    seen.assert_covered(syncs=SYNCS, depths=3, batch=3)


@pytest.mark.deep  # more draws of the same property: make test-deep
def test_jax_decodes_vanilla_tokens_for_drawn_configs_more(tiny, vanilla):
    target, draft = tiny
    seen = Seen()
    _jax_property(target, draft, vanilla, seen, n=45)
    seen.assert_covered(syncs=SYNCS, depths=4, batch=3)


# ----------------------------------------------------------------------------------------------------- torch
@pytest.fixture(scope="module")
def torch_models(tiny):
    """(torch_decoding, its models of the tiny target and head), with torch on one thread meanwhile: the tiny
    model's ops gain nothing from more, and threads that wait for a busy core make each decode ~30x slower."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ddd_jax.bench import torch_decoding as td
    target, draft = tiny
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield td, td.load_torch(target, draft)
    torch.set_num_threads(threads)


# the torch counterpart's EAGLE-2 fails at depth 0 with top_k > 1 (its draft scratch has max_depth * top_k = 0
# slots): drawn from depth 1 until test_torch_eagle2_depth0 passes
TORCH_EAGLE2_MIN_DEPTH = 0


def _torch_property(target, td, models, vanilla, seen: Seen, n: int):
    @_settings(n)
    @given(cfg=spec_configs(lookup=False, syncs=td.SYNCS, eagle2_min_depth=TORCH_EAGLE2_MIN_DEPTH), p=PROMPT)
    def prop(cfg, p):
        method, sync, tree, ddd = cfg
        note(_repro(method, sync, tree, ddd, (p,), framework="torch"))
        ref = vanilla((p,))
        assert_vanilla(target, [p], ref, [td.generate(models, list(p), MAX_NEW).tokens], "torch vanilla")
        res = td.generate(models, list(p), MAX_NEW, method=method, sync=sync, tree=tree, ddd=ddd)
        assert_vanilla(target, [p], ref, [res.tokens], f"torch {method}/{sync} {tree} {ddd}")
        assert sum(res.stats["accepted_per_call"]) == len(res.tokens) - 1
        seen.add(method, sync, (p,), tree, ddd, [res.stats["depth_per_call"]])
    prop()


@pytest.mark.slow  # 100 drawn torch decodes
def test_torch_decodes_vanilla_tokens_for_drawn_configs(tiny, torch_models, vanilla):
    td, models = torch_models
    seen = Seen()
    _torch_property(tiny[0], td, models, vanilla, seen, n=100)
    seen.assert_covered(syncs=td.SYNCS, depths=4)


@pytest.mark.deep  # more draws of the same property: make test-deep
def test_torch_decodes_vanilla_tokens_for_drawn_configs_more(tiny, torch_models, vanilla):
    td, models = torch_models
    seen = Seen()
    _torch_property(tiny[0], td, models, vanilla, seen, n=600)
    seen.assert_covered(syncs=td.SYNCS, depths=5)


def test_torch_eagle2_depth0(tiny, torch_models, vanilla):
    """EAGLE-2 with no expansion step (JAX: tests/test_spec.py's depth-0 tree) in the torch counterpart (its scratch
    of 0 slots once failed to build)."""
    td, models = torch_models
    p = TRAIN[0]
    res = td.generate(models, list(p), MAX_NEW, method="eagle2", tree=TreeConfig(top_k=2, total_tokens=3, depth=0))
    assert_vanilla(tiny[0], [p], vanilla((p,)), [res.tokens], "torch eagle2 depth 0")
