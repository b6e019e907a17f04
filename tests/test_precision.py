"""The precision of the XLA products: float32 means float32 (HIGHEST) unless the user set a default precision.

On GPUs JAX's default runs float32 products as TF32, and a forward of many tokens then rounds differently from a
forward of one, so speculative decoding left vanilla's tokens at near-ties (README: an H200 run). These tests read
the traced programs (every dot of the target, the EAGLE and EAGLE-3 heads, the XLA attention and
the XLA branch of the CPU kernels' products), so they hold on the CPU that CI has."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddd_jax import init_draft, llama
from ddd_jax.eagle import Draft
from ddd_jax.backends.cpu.kernels import precision

from spec_helpers import jaxpr_eqns, tiny_target  # noqa: E402

HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def dots(fn, *args) -> list[tuple[tuple[str, ...], object]]:
    """(operand dtypes, precision) of every dot_general in fn's program, sub-programs (scan, cond, jit) included."""
    return [(tuple(str(v.aval.dtype) for v in e.invars), e.params["precision"])
            for e in jaxpr_eqns(fn, *args) if e.primitive.name == "dot_general"]


def _decode_programs(target, draft):
    """A prefill, a 3-token verification-shaped forward over a cache, and a draft step."""
    B, T = 1, 5
    toks = jnp.arange(1, T + 1, dtype=jnp.int32)[None]
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    cache = llama.new_cache(target.config, B, 16, target.params["embed"].dtype)

    def target_fn(toks, pos, cache):
        out = target.forward(toks, pos, cache)
        return out.logits, out.hidden, target.forward(toks[:, :3], pos[:, :3] + T, out.cache).logits

    def draft_fn(toks, feats):
        return draft.forward(toks, feats)

    feats = jnp.ones((B, T, target.config.hidden_size), target.params["embed"].dtype)
    return dots(target_fn, toks, pos, cache) + dots(draft_fn, toks, feats)


def test_float32_products_are_highest():
    target = tiny_target(0)
    found = _decode_programs(target, init_draft(target, 0))
    f32 = [p for dt, p in found if dt == ("float32", "float32")]
    assert len(f32) >= 8  # q/k/v/o, gate/up/down, scores, p @ v, lm_head, the head's fc and layer
    assert all(p == HIGHEST for p in f32), [p for p in f32 if p != HIGHEST]


@pytest.mark.parametrize("default", ["tensorfloat32", "bfloat16", "highest"])
def test_a_default_precision_set_by_the_user_wins(default):
    target = tiny_target(0)
    with jax.default_matmul_precision(default):
        found = _decode_programs(target, init_draft(target, 0))
        assert precision(jnp.ones(2), jnp.ones(2)) is None
        (_, plain), = dots(jnp.dot, jnp.ones((2, 2)), jnp.ones((2, 2)))  # what JAX makes of that default
    assert found and all(p == plain for _, p in found), (plain, found)


def test_other_dtypes_keep_jax_default():
    target = tiny_target(0)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, target.params)
    bf = type(target)(target.name, target.config, params)
    found = dots(lambda t, p, c: bf.forward(t, p, c).logits, jnp.ones((1, 3), jnp.int32),
                 jnp.arange(3, dtype=jnp.int32)[None],
                 llama.new_cache(bf.config, 1, 8, jnp.bfloat16))
    bf16 = [p for dt, p in found if "bfloat16" in dt]
    assert bf16 and all(p is None for p in bf16)
    assert precision(jnp.ones(2, jnp.float32), jnp.ones(2, jnp.bfloat16)) is None
    assert precision(jnp.ones(2, jnp.float32), jnp.ones(2, jnp.float32)) == jax.lax.Precision.HIGHEST


def test_eagle3_products_are_highest():
    from test_eagle3 import tiny3
    t = tiny3()
    ids = np.sort(np.random.RandomState(0).choice(96, 32, replace=False))
    d = init_draft(t, 0, head_type="eagle3", draft_vocab_size=32)
    d = Draft(d.config, {**d.params, "d2t": jnp.asarray(ids, jnp.int32)}, t)
    found = dots(d.forward, jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4, 3 * 48)))
    f32 = [p for dt, p in found if dt == ("float32", "float32")]
    assert f32 and all(p == HIGHEST for p in f32)
