"""The packaged EAGLE head on the real SmolLM2 (slow): EAGLE-2 and DDD reproduce vanilla greedy exactly, and the
target accepts some of the head's drafts (more than one token per target call)."""
from __future__ import annotations

import pytest

from ddd_jax import DDDConfig, TreeConfig, generate

# small CPU trees (an earlier `ddd-jax tune` choice for this pair)
TREE = TreeConfig(top_k=2, total_tokens=8, depth=2)
DDD = DDDConfig(check_steps=(2, 4), threshold=-1.0, max_depth=6)


@pytest.mark.slow
def test_packaged_head_is_lossless_and_drafts_get_accepted(smollm2, smollm2_head):
    ids = smollm2.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    van = generate(smollm2, None, ids, max_new_tokens=40)
    for method in ("eagle2", "ddd"):
        r = generate(smollm2, smollm2_head, ids, max_new_tokens=40, method=method, tree=TREE, ddd=DDD)
        assert r.tokens == van.tokens, method
        assert max(r.stats["accepted_per_call"]) >= 2 and r.stats["mean_accepted"] > 1.0, (method, r.stats)
