"""Batched acceptance measurement equals single-prompt runs (τ, depths) and checks identity with vanilla."""
from __future__ import annotations

import pytest

from ddd_jax.measure.acceptance import measure_acceptance
from ddd_jax import DDDConfig, TreeConfig, generate
from spec_helpers import fitted_draft, prompts, tiny_target


@pytest.mark.slow  # four decode-loop compiles (batched and B=1, two methods); losslessness per mode is in test_spec
def test_batched_acceptance_matches_single_runs():
    target, draft = tiny_target(), fitted_draft()
    ps = prompts(64, seed=100, lo=2, hi=8)[:5]
    tree, ddd = TreeConfig(top_k=4, total_tokens=10, depth=3), DDDConfig(check_steps=(2, 3), threshold=-5.0, max_depth=5)
    res = measure_acceptance(target, draft, ps, tree=tree, ddd=ddd, max_new_tokens=24, batch_size=2, progress=False)
    for m in ("eagle2", "ddd"):
        assert res[m]["prompts"] == 5 and res[m]["identical"] == 5
        for p, rec in zip(ps, res[m]["per_prompt"]):
            single = generate(target, draft, p, max_new_tokens=24, method=m, tree=tree, ddd=ddd)
            assert rec["accepted_per_call"] == single.stats["accepted_per_call"]
            assert rec["depth_per_call"] == single.stats["depth_per_call"]
        assert res[m]["tau"] > 1.5
