"""The draft phase has no process-wide state: DDD policies travel in the static plan and checks are counted per
call, so concurrent decodes with different policies each get their own decisions and counts."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from ddd_jax import DDDConfig, TreeConfig, generate
from spec_helpers import fitted_draft, jaxpr_eqns, prompts, tiny_target

TREE = TreeConfig(top_k=4, total_tokens=12, depth=3)
DDD = DDDConfig(check_steps=(2, 3, 4), threshold=-5.0, max_depth=6)


def stop_at(step_limit: int, log: list):
    """A host policy that keeps drafting up to `step_limit` and records every call it gets."""
    def policy(step, conf, active, threshold):
        log.append((threading.get_ident(), step))
        return active & (step < step_limit)
    return policy


def n_checks(depth: int, checks) -> int:
    return sum(1 for s in checks if s <= depth)


@pytest.mark.parametrize("sync", [pytest.param("host", marks=pytest.mark.slow),
                                  pytest.param("callback", marks=pytest.mark.deep)])  # ~10-20 s each: make test
# runs host, make test-deep callback
def test_concurrent_decodes_keep_their_own_policy_and_counts(sync):
    target, draft = tiny_target(), fitted_draft()
    p = prompts(1, seed=3, lo=6, hi=7)[0]
    logs = {"shallow": [], "deep": []}
    policies = {"shallow": stop_at(2, logs["shallow"]), "deep": stop_at(99, logs["deep"])}
    expect_depth = {"shallow": 2, "deep": 6}
    # single-threaded references (also compile both plans)
    ref = {name: generate(target, draft, p, max_new_tokens=16, method="ddd", sync=sync, tree=TREE, ddd=DDD,
                          policy=pol) for name, pol in policies.items()}
    for log in logs.values():
        log.clear()
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def run(name):
        try:
            barrier.wait()
            for _ in range(3):
                results.setdefault(name, []).append(generate(target, draft, p, max_new_tokens=16, method="ddd",
                                                             sync=sync, tree=TREE, ddd=DDD, policy=policies[name]))
        except Exception as e:  # noqa: BLE001 -- surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in policies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name, runs in results.items():
        for r in runs:
            d = r.stats["depth_per_call"]
            assert set(d) == {expect_depth[name]}, (name, d)
            assert r.tokens == ref[name].tokens
            checks = sum(n_checks(x, DDD.check_steps) for x in d)
            assert r.stats["draft_syncs"] == checks == ref[name].stats["draft_syncs"]
            assert r.stats["ddd_checks"] == checks
        # each policy saw only the checks of its own decodes
        steps = [s for _, s in logs[name]]
        assert len(steps) == sum(r.stats["draft_syncs"] for r in runs)
        assert set(steps) <= set(DDD.check_steps) and (expect_depth[name] == 2) == (set(steps) == {2})


@pytest.mark.slow  # ~17 s with the fitted head
def test_device_mode_counts_checks_without_syncs():
    target, draft = tiny_target(), fitted_draft()
    p = prompts(1, seed=3, lo=6, hi=7)[0]
    r = generate(target, draft, p, max_new_tokens=16, method="ddd", sync="device", tree=TREE, ddd=DDD)
    assert r.stats["draft_syncs"] == 0 and r.stats["host_syncs"] == 0
    assert r.stats["ddd_checks"] == sum(n_checks(x, DDD.check_steps) for x in r.stats["depth_per_call"]) > 0


@pytest.mark.slow  # ~20 s (two host-mode decodes, their programs compiled): make test runs it
def test_host_phases_take_the_caches_donated_and_read_computed_confidence(monkeypatch):
    """sync="host" runs one program per check: a cycle's verification and commit share a program with the next
    cycle's draft up to its first check, whose read also brings the done flags (host syncs = checks + 1). With the
    phase clock (profile=True) verification and commit are programs of their own. Either way the target cache and
    the draft's cache arrive donated (written in place: undonated, every cycle copied the whole target cache), and
    each read is of values a program computed (not a logsumexp run op by op on the host's side)."""
    import importlib

    import jax
    from ddd_jax.decode import drafting
    G = importlib.import_module("ddd_jax.decode.cycle")
    target, draft = tiny_target(), fitted_draft()
    p = prompts(1, seed=3, lo=6, hi=7)[0]
    donated, reads = [], []
    fused, verify, commit, read = G.verify_commit_begin_jit, G.verify_jit, G.commit_jit, drafting.SyncCounter.read
    conf = drafting.confidence

    def spy_fused(tparams, dparams, plan, s, dlen, d, dcache, threshold):
        tcache = s.tcache
        out = fused(tparams, dparams, plan, s, dlen, d, dcache, threshold)
        donated.append(("fused", tcache.k.is_deleted() and dcache.k.is_deleted()))
        return out

    def spy_verify(tparams, plan, rest, tcache, d):
        out = verify(tparams, plan, rest, tcache, d)
        donated.append(("verify", tcache.k.is_deleted()))
        return out

    def spy_commit(plan, rest, L, tc_new, hidden, acc, key, d, dcache):
        out = commit(plan, rest, L, tc_new, hidden, acc, key, d, dcache)
        donated.append(("commit", dcache.k.is_deleted()))
        return out

    def spy_read(self, x, draft=False):  # arrays a program returned, nothing left to compute
        reads.append((draft, all(isinstance(a, jax.Array) and a.is_fully_addressable for a in jax.tree.leaves(x))))
        return read(self, x, draft)

    def traced_only(beam):
        if not isinstance(beam.score, jax.core.Tracer):
            pytest.fail("confidence computed outside a program, op by op")
        return conf(beam)

    monkeypatch.setattr(G, "verify_commit_begin_jit", spy_fused)
    monkeypatch.setattr(G, "verify_jit", spy_verify)
    monkeypatch.setattr(G, "commit_jit", spy_commit)
    monkeypatch.setattr(drafting.SyncCounter, "read", spy_read)
    monkeypatch.setattr(drafting, "confidence", traced_only)
    ref = generate(target, None, p, max_new_tokens=12)
    for profile, programs in ((False, {"fused"}), (True, {"verify", "commit"})):
        donated.clear(), reads.clear()
        r = generate(target, draft, p, max_new_tokens=12, method="ddd", sync="host", tree=TREE, ddd=DDD,
                     profile=profile)
        st = r.stats
        assert r.tokens == ref.tokens
        assert donated and all(d for _, d in donated) and {k for k, _ in donated} == programs, (profile, donated)
        assert reads and all(ok for _, ok in reads) and len(reads) == st["host_syncs"]
        if profile:  # a read per check, then one of the done flags per cycle
            assert sum(d for d, _ in reads) == st["draft_syncs"] == st["ddd_checks"]
            assert st["host_syncs"] == st["draft_syncs"] + st["target_calls"]
        else:  # a cycle's first check reads the done flags too; the last read finds decoding over
            assert st["draft_syncs"] == st["ddd_checks"] == st["host_syncs"] - 1
            assert len(donated) == st["target_calls"]


@pytest.mark.parametrize("method,sync,profile", [("vanilla", "device", False), ("ddd", "device", False),
                                                  pytest.param("ddd", "host", False, marks=pytest.mark.slow),
                                                  pytest.param("ddd", "host", True, marks=pytest.mark.slow)])
def test_stream_delivers_every_token_once_in_order(method, sync, profile):
    """`stream` (which runs the Python loops) hands over each new token once, in order, by the end all of them --
    also where the host mode reads the done flags and the output with a cycle's first check."""
    target, draft = tiny_target(), fitted_draft()
    p = prompts(1, seed=5, lo=6, hi=7)[0]
    kw = dict(max_new_tokens=12, method=method, sync=sync, tree=TREE, ddd=DDD)
    d = None if method == "vanilla" else draft
    ref = generate(target, d, p, **kw)
    chunks = []
    r = generate(target, d, p, stream=chunks.append, profile=profile, **kw)
    assert [t for c in chunks for t in c] == r.tokens == ref.tokens
    assert len(chunks) >= r.stats["target_calls"] // 2 and sum(map(len, chunks)) == len(ref.tokens)


def test_policy_needs_a_host_sync_mode():
    target, draft = tiny_target(), fitted_draft()
    with pytest.raises(ValueError, match="policy runs on the host"):
        generate(target, draft, [1, 2, 3], max_new_tokens=4, method="ddd", sync="device",
                 policy=lambda *a: np.ones(1, bool))


def test_step0_on_fewer_rows_drafts_what_all_rows_draft():
    """Step 0 runs over the first 2 or 4 pending pairs when every sequence's fit there (`PREFIX_ROWS`): the same
    feature, log-probs and draft-cache rows as the forward over all M columns, for every pending count."""
    import jax
    import jax.numpy as jnp

    from ddd_jax.decode import drafting
    from ddd_jax.backends.cpu import kernels
    from ddd_jax.eagle import new_cache
    from ddd_jax.decode import make_plan
    target, draft = tiny_target(), fitted_draft()
    plan = make_plan(target, draft, method="ddd", sync="device", tree=TREE, ddd=DDD, temperature=0.0, top_p=1.0,
                     max_new_tokens=16)
    M, D, B = plan.M, target.config.hidden_size, 2
    assert M > max(drafting.PREFIX_ROWS)
    dparams, tparams = draft.decode_params(), target.params
    rng = np.random.default_rng(0)
    cache = new_cache(plan.dcfg, B, 64)
    cache = dataclasses.replace(cache, k=jnp.asarray(rng.standard_normal(cache.k.shape), cache.k.dtype),
                                v=jnp.asarray(rng.standard_normal(cache.v.shape), cache.v.dtype),
                                length=jnp.asarray([5, 9], jnp.int32))
    tok = jnp.asarray(rng.integers(0, target.config.vocab_size, (B, M)), jnp.int32)
    feat = jnp.asarray(rng.standard_normal((B, M, D)), jnp.float32)
    picked = jax.jit(lambda c, t, f, n: drafting.draft_prefix(dparams, plan, tparams, c, t, f, n))
    full = jax.jit(lambda c, t, f, n: drafting._prefix_forward(dparams, plan, tparams, c, t, f, n))
    same = np.testing.assert_array_equal if kernels.available() else (
        lambda a, b, err_msg: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=err_msg))
    for n in [(1, 2), (2, 2), (3, 1), (4, 4), (5, 2), (M, M)]:
        pend_n = jnp.asarray(n, jnp.int32)
        (ca, ha, la), (cb, hb, lb) = picked(cache, tok, feat, pend_n), full(cache, tok, feat, pend_n)
        np.testing.assert_array_equal(np.asarray(ca.length), np.asarray(cache.length) + np.asarray(n))
        np.testing.assert_array_equal(np.asarray(ca.length), np.asarray(cb.length))
        same(np.asarray(ha), np.asarray(hb), err_msg=str(n))
        same(np.asarray(la), np.asarray(lb), err_msg=str(n))
        for b in range(B):  # the committed rows of the draft cache (past them: scratch)
            end = int(ca.length[b])
            same(np.asarray(ca.k[:, b, :, :end]), np.asarray(cb.k[:, b, :, :end]), err_msg=f"{n} k {b}")
            same(np.asarray(ca.v[:, b, :, :end]), np.asarray(cb.v[:, b, :, :end]), err_msg=f"{n} v {b}")


def _primitives(fn, *args) -> list[str]:
    """Names of every primitive in fn's program; a platform_dependent choice, a cond resolved when lowering, is
    named apart."""
    return ["platform_cond" if e.primitive.name == "cond" and e.params.get("branches_platforms") is not None
            else e.primitive.name for e in jaxpr_eqns(fn, *args)]


@pytest.mark.parametrize("method,sync", [("eagle2", "device"), ("ddd", "device"), ("ddd", "callback")])
def test_draft_program_branches_and_loops(method, sync):
    """What XLA:GPU would read back to the host inside the draft phase (a `while` of unknown length reads its
    condition every step, a `cond` its predicate): EAGLE-2's steps are one loop of static length (a `scan`, no
    `while`); DDD's device mode adds no branch to it (its decision is selected, not branched on) and keeps the
    one `while` that lets it stop early; the callback mode branches at checks, to call the host only there."""
    import jax.numpy as jnp

    from ddd_jax.decode import drafting
    from ddd_jax.eagle import new_cache
    from ddd_jax.decode import make_plan
    target, draft = tiny_target(), fitted_draft()
    plan = make_plan(target, draft, method=method, sync=sync, tree=TREE, ddd=DDD, temperature=0.0, top_p=1.0,
                     max_new_tokens=16)
    B, M, D = 1, plan.M, target.config.hidden_size
    dparams, tparams = draft.decode_params(), target.params
    args = (new_cache(plan.dcfg, B, 64), jnp.zeros((B, M), jnp.int32), jnp.zeros((B, M, D), jnp.float32),
            jnp.ones((B,), jnp.int32), jnp.float32(-0.3))
    names = _primitives(lambda *a: drafting.draft_in_program(tparams, dparams, plan, *a), *args)
    prefix = _primitives(lambda c, t, f, n: drafting.draft_prefix(dparams, plan, tparams, c, t, f, n), *args[:4])
    extra_conds = names.count("cond") - prefix.count("cond")  # step 0's width switch is one cond
    if method == "eagle2":
        assert names.count("while") == prefix.count("while") and names.count("scan") > prefix.count("scan")
        assert extra_conds == 0
    else:
        assert names.count("while") == prefix.count("while") + 1
        assert extra_conds == (0 if sync == "device" else 1)
