"""Speculative decoding: every method x sync mode is token-identical to vanilla greedy; DDD decisions and sync
counts; tree builder vs a brute-force EAGLE-2 reference; lossless sampling (chi-square)."""
from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddd_jax import DDDConfig, ModelConfig, Target, TreeConfig, generate, init_draft, llama
from ddd_jax.tree import build_tree, expand, first_beam
from spec_helpers import first_mismatch_margin, fitted_draft, prompts, tiny_target

NEAR_TIE = 1e-4
MODES = [("eagle2", "device"), ("ddd", "host"), ("ddd", "callback"), ("ddd", "device")]
# the tiny target's distributions are flat (beam confidence after step 2 is around -4.3, after step 3 around
# -5.8), so this threshold makes DDD stop at different checks on different cycles
SMALL_DDD = DDDConfig(check_steps=(2, 3), threshold=-5.0, max_depth=5)
TREES = {"k10-n60": TreeConfig(top_k=10, total_tokens=60, depth=5),
         "k4-n12": TreeConfig(top_k=4, total_tokens=12, depth=3),
         "k1-n3": TreeConfig(top_k=1, total_tokens=3, depth=2)}
# Every (method, sync, tree) is its own XLA compile (seconds each on CPU). `make test-fast` runs three of them
# (FAST_BATCHED); `make test` the rest and B=1, but for the widest tree in callback mode and under
# EAGLE-2, and callback mode's smallest tree and B=1, which `make test-deep` adds (DEEP_CASES).
FAST_BATCHED = {("eagle2", "device", "k4-n12"), ("ddd", "host", "k1-n3"), ("ddd", "device", "k4-n12")}
DEEP_CASES = {("eagle2", "device", "k10-n60"), ("ddd", "callback", "k10-n60"), ("ddd", "callback", "k1-n3"),
              ("ddd", "callback", "B=1")}


def fast_if(fast: bool, deep: bool = False):
    return pytest.mark.deep if deep else () if fast else pytest.mark.slow


def train_prompts(n, offset=0):
    # the fitted head saw continuations of these prompts, so acceptance is high and deep paths get exercised
    return prompts(64, seed=100, lo=2, hi=8)[offset: offset + n]


def check_identical(target, ps, ref, got, what):
    near = []
    for p, r, g in zip(ps, ref, got):
        m = first_mismatch_margin(target, p, r, g)
        if m is None:
            continue
        i, margin = m
        assert margin < NEAR_TIE, f"{what}: output differs from vanilla at token {i} with a clear margin {margin:.3g}"
        near.append((i, margin))
    if near:
        warnings.warn(f"{what}: {len(near)} float near-tie mismatches {near}")
    assert len(near) <= max(1, len(ps) // 10), f"{what}: too many near-tie mismatches {near}"


@pytest.fixture(scope="module")
def setup():
    target = tiny_target()
    draft = fitted_draft()
    ps = train_prompts(24) + prompts(4, seed=7, lo=20, hi=40)  # plus a few long unseen prompts
    ref = generate(target, None, ps, max_new_tokens=32)
    return target, draft, ps, ref


@pytest.mark.parametrize("method,sync,tree", [
    pytest.param(m, s, tree, id=f"{m}-{s}-{tid}", marks=fast_if((m, s, tid) in FAST_BATCHED,
                                                                (m, s, tid) in DEEP_CASES))
    for m, s in MODES for tid, tree in TREES.items()])
def test_token_identical_batched(setup, tree, method, sync):
    target, draft, ps, ref = setup
    ddd = SMALL_DDD if tree.top_k > 1 else DDDConfig(check_steps=(2,), threshold=-4.3, max_depth=3)
    res = generate(target, draft, ps, max_new_tokens=32, method=method, sync=sync, tree=tree, ddd=ddd)
    check_identical(target, ps, ref.tokens, res.tokens, f"{method}/{sync}/{tree}")
    taus = [s["mean_accepted"] for s in res.stats["per_sequence"]]
    if tree.top_k > 1:
        assert np.mean(taus) > 1.5, f"fitted head should accept drafts, got mean tau {np.mean(taus):.2f}"
    for st, toks in zip(res.stats["per_sequence"], res.tokens):
        assert sum(st["accepted_per_call"]) == len(toks) - 1  # first token comes from the prefill
        assert max(st["accepted_per_call"], default=1) <= (ddd.max_depth if method == "ddd" else tree.depth) + 2


@pytest.mark.parametrize("method,sync", [pytest.param(m, s, marks=pytest.mark.deep if (m, s, "B=1") in DEEP_CASES
                                                         else pytest.mark.slow)
                                         for m, s in MODES])
def test_token_identical_batch1(setup, method, sync):
    target, draft, ps, ref = setup
    tree = TreeConfig(top_k=4, total_tokens=12, depth=3)
    for i in (0, 3, 25):
        r = generate(target, draft, ps[i], max_new_tokens=32, method=method, sync=sync, tree=tree, ddd=SMALL_DDD)
        check_identical(target, [ps[i]], [ref.tokens[i]], [r.tokens], f"B=1 {method}/{sync}")


@pytest.mark.parametrize("method,sync", [("eagle2", "device"), pytest.param("ddd", "host", marks=pytest.mark.slow)])
def test_reduced_draft_vocabulary_is_lossless(setup, method, sync):
    from ddd_jax.eagle import with_draft_vocab
    target, draft, ps, ref = setup
    # the draft may only propose the 48 tokens it sees most in the reference continuations
    counts = np.bincount(np.concatenate([np.asarray(t, int) for t in ref.tokens]), minlength=96)
    small = with_draft_vocab(draft, np.argsort(-counts, kind="stable")[:48])
    tree = TreeConfig(top_k=4, total_tokens=12, depth=3)
    res = generate(target, small, ps, max_new_tokens=32, method=method, sync=sync, tree=tree, ddd=SMALL_DDD)
    check_identical(target, ps, ref.tokens, res.tokens, f"reduced vocab {method}/{sync}")
    assert np.mean([s["mean_accepted"] for s in res.stats["per_sequence"]]) > 1.5
    drafted = set(np.asarray(small.params["d2t"]).tolist())
    with pytest.raises(ValueError, match="draft vocabulary"):
        generate(target, with_draft_vocab(draft, [1, 2]), ps[0], method="eagle2", tree=tree)
    with pytest.raises(ValueError, match="distinct"):
        with_draft_vocab(draft, [1, 1])
    assert len(drafted) == 48


@pytest.mark.slow  # ~5 s
def test_float16_head_is_lossless_and_drafts_like_float32(setup):
    """A head stored in float16 (weights only: float32 activations, the kernels widen the weights as they read them)
    is still token-identical to vanilla and accepts about as much as the float32 head; its draft-vocabulary rows
    are float16 too."""
    from ddd_jax.eagle import with_draft_vocab
    target, draft, ps, ref = setup
    counts = np.bincount(np.concatenate([np.asarray(t, int) for t in ref.tokens]), minlength=96)
    small = with_draft_vocab(draft, np.argsort(-counts, kind="stable")[:64])
    half = small.astype(jnp.float16)
    assert half.params["fc_w"].dtype == jnp.float16 and half.lm_sub.dtype == jnp.float16
    assert half.params["d2t"].dtype == jnp.int32 and small.lm_sub.dtype == jnp.float32
    tree = TreeConfig(top_k=4, total_tokens=12, depth=3)
    taus = {}
    for name, d in (("f32", small), ("f16", half)):
        res = generate(target, d, ps, max_new_tokens=32, method="ddd", tree=tree, ddd=SMALL_DDD)
        check_identical(target, ps, ref.tokens, res.tokens, f"{name} head")
        taus[name] = np.mean([s["mean_accepted"] for s in res.stats["per_sequence"]])
    assert taus["f16"] > 1.5 and abs(taus["f16"] - taus["f32"]) < 0.1, taus


def n_checks(depth, checks):
    return sum(1 for s in checks if s <= depth)


@pytest.mark.slow  # four thresholds x three sync modes (~15 s each)
@pytest.mark.parametrize("threshold", [math.inf, -4.5, -6.0, -math.inf])
def test_ddd_modes_agree_and_count_syncs(setup, threshold):
    target, draft, ps, _ = setup
    tree = TreeConfig(top_k=4, total_tokens=12, depth=3)
    ddd = DDDConfig(check_steps=(2, 3, 4), threshold=threshold, max_depth=6)
    seen = set()
    for p in ps[:4]:
        runs = {sync: generate(target, draft, p, max_new_tokens=24, method="ddd", sync=sync, tree=tree, ddd=ddd)
                for sync in ("host", "callback", "device")}
        depths = {k: r.stats["depth_per_call"] for k, r in runs.items()}
        assert depths["host"] == depths["callback"] == depths["device"], depths
        assert runs["host"].tokens == runs["callback"].tokens == runs["device"].tokens
        d = depths["host"]
        seen.update(d)
        checks = sum(n_checks(x, ddd.check_steps) for x in d)
        assert runs["host"].stats["draft_syncs"] == checks
        assert runs["host"].stats["host_syncs"] == checks + 1  # the done flags come with each first check's read
        assert runs["callback"].stats["draft_syncs"] == checks
        assert runs["device"].stats["draft_syncs"] == 0 and runs["device"].stats["host_syncs"] == 0
        if threshold == math.inf:
            assert set(d) == {2}
        if threshold == -math.inf:
            assert set(d) == {6}
        assert set(d) <= {2, 3, 4, 6}
    if math.isfinite(threshold):
        assert len(seen) >= 2, f"expected DDD to stop at different checks, saw depths {seen}"


@pytest.mark.slow  # ~20 s: several trees and checks
def test_step0_check_and_depth0_tree(setup):
    """A DDD check at step 0 looks at the root's top_k before any expansion step: the three sync modes take the
    same decisions, a cycle it stops verifies only step 0's candidates (depth 0; with stop0_nodes=0 the root alone,
    one row), and every output is vanilla's. EAGLE-2 with depth 0 (no expansion step) is lossless too."""
    target, draft, ps, ref = setup
    tree = TreeConfig(top_k=4, total_tokens=4, depth=2)
    # the tiny head's root confidence (log of its top-4 mass) spans roughly [-2.5, 0]: some cycles stop at step 0
    ddd = DDDConfig(check_steps=(0, 2), threshold=-0.7, max_depth=4)
    sub = ps[:6]
    seen = set()
    for p, r in zip(sub, ref.tokens[:6]):
        runs = {sync: generate(target, draft, p, max_new_tokens=32, method="ddd", sync=sync, tree=tree, ddd=ddd)
                for sync in ("host", "callback", "device")}
        depths = {k: x.stats["depth_per_call"] for k, x in runs.items()}
        assert depths["host"] == depths["callback"] == depths["device"], depths
        for k, x in runs.items():
            check_identical(target, [p], [r], [x.tokens], f"step-0 check, {k}")
        d = depths["host"]
        seen.update(d)
        checks = sum(n_checks(x, ddd.check_steps) for x in d)
        assert runs["host"].stats["draft_syncs"] == checks == runs["callback"].stats["draft_syncs"]
        assert runs["device"].stats["ddd_checks"] == checks
        assert set(d) <= {0, 2, 4}
        for acc, dep in zip(runs["device"].stats["accepted_per_call"], d):
            assert acc <= dep + 2
        # stop0_nodes=0: a cycle stopped at step 0 drafts nothing, so it verifies and emits one token
        none = generate(target, draft, p, max_new_tokens=32, method="ddd", sync="device", tree=tree,
                        ddd=dataclasses.replace(ddd, stop0_nodes=0))
        check_identical(target, [p], [r], [none.tokens], "step-0 check keeping no node")
        nd = none.stats["depth_per_call"]
        assert set(nd) <= {0, 2, 4}
        for acc, dep, rows in zip(none.stats["accepted_per_call"], nd, none.stats["verified_per_call"]):
            assert dep > 0 or (acc, rows) == (1, 1)
    assert 0 in seen and len(seen) >= 2, f"expected some cycles to stop at step 0 and some to go on, saw {seen}"
    e0 = generate(target, draft, sub, max_new_tokens=32, method="eagle2", tree=TreeConfig(top_k=4, total_tokens=4,
                                                                                          depth=0))
    check_identical(target, sub, ref.tokens[:6], e0.tokens, "eagle2 depth 0")
    assert all(set(s["depth_per_call"]) == {0} for s in e0.stats["per_sequence"])
    assert max(max(s["accepted_per_call"]) for s in e0.stats["per_sequence"]) == 2  # root + one drafted token
    with pytest.raises(ValueError, match="pool DDD can draft"):  # the tree must fit what DDD can draft at most
        generate(target, draft, sub[0], method="ddd", tree=TreeConfig(top_k=1, total_tokens=5, depth=4),
                 ddd=DDDConfig(check_steps=(0, 1), threshold=-0.7, max_depth=2))


@pytest.mark.slow  # a compile per max_new_tokens and method; test_exact.py checks _emit's EOS / max-new cuts fast
def test_max_new_tokens_exact_and_eos(setup):
    target, draft, ps, _ = setup
    tree = TreeConfig(top_k=4, total_tokens=12, depth=3)
    # 1: the prefill's token only; 2: the first cycle's path cut to one token (longer cuts: every identity test,
    # whose outputs must have vanilla's exact length)
    for n in (1, 2):
        v = generate(target, None, ps[1], max_new_tokens=n)
        for method in ("eagle2", "ddd"):
            r = generate(target, draft, ps[1], max_new_tokens=n, method=method, tree=tree, ddd=SMALL_DDD)
            assert r.tokens == v.tokens
            assert len(r.tokens) == n or r.tokens[-1] in target.eos_token_ids
    # a prompt whose vanilla continuation hits EOS: speculative output stops at the same place
    eos = target.eos_token_ids[0]
    ref = generate(target, None, ps, max_new_tokens=32)
    hits = [i for i, t in enumerate(ref.tokens) if eos in t]
    assert hits, "test setup: expected some continuation to produce EOS"
    for i in hits[:3]:
        r = generate(target, draft, ps[i], max_new_tokens=32, method="eagle2", tree=tree)
        assert r.tokens == ref.tokens[i] and r.tokens[-1] == eos


def test_bad_input(setup):
    target, draft, ps, _ = setup
    with pytest.raises(ValueError, match="capacity"):
        generate(target, None, ps[0], max_new_tokens=32, capacity=16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(target, None, list(range(50)) * 20, max_new_tokens=100)
    with pytest.raises(ValueError, match="method"):
        generate(target, draft, ps[0], method="medusa")
    with pytest.raises(ValueError, match="draft head"):
        generate(target, None, ps[0], method="eagle2")
    with pytest.raises(ValueError, match="vocabulary"):
        generate(target, None, [1, 2, 10_000])
    with pytest.raises(ValueError, match="pool"):
        TreeConfig(top_k=2, total_tokens=40, depth=2)
    with pytest.raises(ValueError, match="check steps"):
        DDDConfig(check_steps=(5, 12), max_depth=11)
    with pytest.raises(ValueError, match="check steps"):
        DDDConfig(check_steps=(-1, 3), max_depth=11)


# ----------------------------------------------------------------------------------- tree vs brute force
def _logp_table(V, seed):
    cache = {}

    def f(path):
        if path not in cache:
            rng = np.random.RandomState(abs(hash((seed,) + path)) % (2 ** 31))
            x = rng.randn(V) * 2.0
            cache[path] = x - np.log(np.exp(x).sum())
        return cache[path]
    return f


def _reference_tree(f, k, depth, n):
    """EAGLE-2's expansion and rerank, written directly from the reference algorithm with Python lists."""
    lp = f(())
    top = np.argsort(-lp, kind="stable")[:k]
    beam = [((int(t),), lp[t]) for t in top]
    pool = list(beam)
    for _ in range(depth):
        children = []
        for path, score in beam:
            lq = f(path)
            for t in np.argsort(-lq, kind="stable")[:k]:
                children.append((path + (int(t),), score + lq[t]))
        pool += children
        order = sorted(range(len(children)), key=lambda i: -children[i][1])
        beam = [children[i] for i in order[:k]]
    order = sorted(range(len(pool)), key=lambda i: -pool[i][1])[: n - 1]
    return {pool[i][0] for i in order}


# jitted as generate runs them (2-3x cheaper here than op-by-op dispatch)
first_beam_jit = jax.jit(first_beam, static_argnums=(2, 3))
expand_jit = jax.jit(expand, static_argnums=(3, 4))
build_tree_jit = jax.jit(build_tree, static_argnums=2)


@pytest.mark.parametrize("k,depth,n", [(3, 3, 10), (4, 2, 20), (2, 5, 12), (10, 5, 60)])
def test_tree_builder_matches_reference(k, depth, n):
    V = 16
    for seed in range(3):
        f = _logp_table(V, seed)
        ref = _reference_tree(f, k, depth, n)

        def path_of(beam, b, pool_index):
            out = []
            q = int(pool_index)
            while q >= 0:
                out.append(int(beam.pool_tok[b, q]))
                q = int(beam.pool_parent[b, q])
            return tuple(reversed(out))

        lp0 = jnp.asarray(f(()))[None]
        beam = first_beam_jit(lp0, jnp.zeros((1, 4)), k, depth)
        for _ in range(depth):
            lps = np.stack([f(path_of(beam, 0, q)) for q in np.asarray(beam.pool_idx[0])])[None]
            beam = expand_jit(beam, jnp.zeros((1, k, 4)), jnp.asarray(lps, jnp.float32), k, depth)
        tree = build_tree_jit(jnp.asarray([99]), beam, n)
        toks, parent, anc, dep = (np.asarray(x[0]) for x in (tree.tokens, tree.parent, tree.anc, tree.depth))
        assert toks[0] == 99 and bool(np.asarray(tree.valid).all())
        paths = []
        for i in range(1, n):  # path of each node from parents
            p, j = [], i
            while j != 0:
                p.append(int(toks[j]))
                assert parent[j] < j, "parents must precede children"
                j = int(parent[j])
            paths.append(tuple(reversed(p)))
        assert set(paths) == ref
        # ancestor mask equals brute force from the parents, positions = depth
        for i in range(n):
            want = np.zeros(n, bool)
            j = i
            while True:
                want[j] = True
                if j == 0:
                    break
                j = int(parent[j])
            assert (anc[i] == want).all()
            assert dep[i] == want.sum() - 1


# ----------------------------------------------------------------------------------- lossless sampling
@pytest.mark.slow  # chi-square over thousands of draws (~10 s)
@pytest.mark.parametrize("temperature,top_p", [pytest.param(1.0, 1.0, marks=pytest.mark.deep),
                                               (1.5, 0.9)])  # (1.5, 0.9): nucleus cuts tokens
def test_sampling_distribution_matches_target(temperature, top_p):
    from scipy.stats import chi2

    from ddd_jax.verify import process_logits
    cfg = ModelConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64, eos_token_id=())
    target = Target("sample", cfg, llama.init_params(cfg, jax.random.PRNGKey(3), std=0.5))
    draft = init_draft(target, 4)
    prompt = [1, 2, 3]
    V = cfg.vocab_size
    # exact joint of the 2nd and 3rd new tokens (both produced by tree verification; the 1st comes from prefill)
    seqs = np.array([[*prompt, a, b] for a in range(V) for b in range(V)], np.int32)
    lg = llama.forward(target.params, cfg, seqs, np.broadcast_to(np.arange(5), seqs.shape)).logits
    p = np.exp(np.asarray(process_logits(lg, temperature, top_p)))  # [V*V, 5, V]
    p1 = p[0, 2]  # after the prompt
    p2 = p[::V, 3]  # [V(a), V] after prompt+a
    p3 = p[:, 4].reshape(V, V, V)  # after prompt+a+b
    joint = np.einsum("a,ab,abc->bc", p1, p2, p3).reshape(-1)
    counts = np.zeros(V * V)
    B = 1000
    tree = TreeConfig(top_k=3, total_tokens=8, depth=2)
    for seed in range(4):
        r = generate(target, draft, [prompt] * B, max_new_tokens=3, method="eagle2", tree=tree,
                     temperature=temperature, top_p=top_p, seed=seed)
        for t in r.tokens:
            counts[t[1] * V + t[2]] += 1
    n = counts.sum()
    keep = joint * n >= 5
    assert counts[~keep].sum() <= max(10, 0.01 * n)  # (near-)impossible cells stay (near-)empty
    stat = (((counts[keep] - n * joint[keep]) ** 2) / (n * joint[keep])).sum()
    pval = chi2.sf(stat, keep.sum() - 1)
    assert pval > 1e-3, f"speculative sampling deviates from the target distribution (chi2={stat:.1f}, p={pval:.2g})"
    # and the tree really accepted several tokens per call sometimes (the test exercises acceptance)
    assert max(max(s["accepted_per_call"]) for s in r.stats["per_sequence"]) >= 2
