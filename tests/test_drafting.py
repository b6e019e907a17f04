"""The draft phase has no process-wide state: DDD policies travel in the static plan and checks are counted per
call, so concurrent decodes with different policies each get their own decisions and counts."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from ddd_jax import DDDConfig, TreeConfig, generate
from spec_helpers import fitted_draft, prompts, tiny_target

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


@pytest.mark.parametrize("sync", [pytest.param("host", marks=pytest.mark.slow), "callback"])  # host: slow lane (time)
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


def test_device_mode_counts_checks_without_syncs():
    target, draft = tiny_target(), fitted_draft()
    p = prompts(1, seed=3, lo=6, hi=7)[0]
    r = generate(target, draft, p, max_new_tokens=16, method="ddd", sync="device", tree=TREE, ddd=DDD)
    assert r.stats["draft_syncs"] == 0 and r.stats["host_syncs"] == 0
    assert r.stats["ddd_checks"] == sum(n_checks(x, DDD.check_steps) for x in r.stats["depth_per_call"]) > 0


def test_policy_needs_a_host_sync_mode():
    target, draft = tiny_target(), fitted_draft()
    with pytest.raises(ValueError, match="policy runs on the host"):
        generate(target, draft, [1, 2, 3], max_new_tokens=4, method="ddd", sync="device",
                 policy=lambda *a: np.ones(1, bool))
