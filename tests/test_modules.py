"""Flax nnx module views: the dict layout as nnx state, exact parity with the pure forwards, round trips, training."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from ddd_jax import EagleHeadModule, LlamaModule, eagle, layers, llama
from ddd_jax import io as dio
from ddd_jax.config import DraftConfig, ModelConfig
from ddd_jax.eagle import Draft
from ddd_jax.modules import DraftVocab
from ddd_jax.target import Target

CFG = ModelConfig(vocab_size=40, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=6)
B, T = 2, 7


def shapes_of(tree):
    return jax.tree.map(lambda x: tuple(x.shape), tree)


def state_paths(module, *filters) -> set[str]:
    """'.'-joined paths of the module's nnx state (the keys `ddd_jax.io.flatten` gives the params dict)."""
    return {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(module, *filters))}


def inputs(seed=0, vocab=CFG.vocab_size):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    tokens = jax.random.randint(k1, (B, T), 0, vocab, jnp.int32)
    features = jax.random.normal(k2, (B, T, CFG.hidden_size))
    return tokens, features, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


@pytest.mark.parametrize("tie", [False, True])
def test_target_module_layout_roundtrip_and_forward(tie):
    cfg = ModelConfig(**{**CFG.__dict__, "tie_word_embeddings": tie})
    params = llama.init_params(cfg, jax.random.PRNGKey(1), std=0.2)
    m = LlamaModule.from_params(cfg, params)
    # nnx state paths == today's dict layout, every leaf an nnx.Param of the described shape
    assert state_paths(m) == set(dio.flatten(llama.param_shapes(cfg)))
    assert state_paths(m, nnx.Param) == state_paths(m)
    chex.assert_shape(m.layers["wq"][...], (2, 24, 4 * 6))
    assert shapes_of(m.to_params()) == llama.param_shapes(cfg)
    back = m.to_params()
    chex.assert_trees_all_equal_structs(back, params)
    chex.assert_trees_all_equal(back, params)
    assert all(a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))  # views, not copies

    tokens, _, pos = inputs()
    ref = llama.forward(params, cfg, tokens, pos)
    chex.assert_trees_all_equal(m(tokens, pos), ref)
    cache = llama.new_cache(cfg, B, 16)
    chex.assert_trees_all_equal(m(tokens, pos, cache=cache), llama.forward(params, cfg, tokens, pos, cache=cache))
    # jit over the split state (how hot loops should call it) matches too
    graphdef, state = nnx.split(m)
    jitted = jax.jit(lambda s, t, p: nnx.merge(graphdef, s)(t, p))(state, tokens, pos)
    chex.assert_trees_all_close(jitted, ref, atol=1e-5, rtol=1e-5)


def test_target_module_random_init():
    m = LlamaModule(CFG, rngs=nnx.Rngs(0))
    assert shapes_of(m.to_params()) == llama.param_shapes(CFG)
    chex.assert_trees_all_equal(m.final_norm[...], jnp.ones(CFG.hidden_size))
    assert float(jnp.std(m.embed[...])) == pytest.approx(0.02, rel=0.2)
    with pytest.raises(ValueError, match="missing tensors"):
        LlamaModule.from_params(CFG, {k: v for k, v in m.to_params().items() if k != "lm_head"})
    with pytest.raises(ValueError, match="params or rngs"):
        LlamaModule(CFG)


@pytest.mark.parametrize("draft_vocab", [None, 8])
def test_head_module_layout_roundtrip_and_forward(draft_vocab):
    dcfg = DraftConfig.from_target(CFG, draft_vocab_size=draft_vocab)
    params = eagle.init_params(dcfg, jax.random.PRNGKey(2), std=0.2)
    h = EagleHeadModule.from_params(dcfg, params)
    assert state_paths(h) == set(dio.flatten(eagle.param_shapes(dcfg)))
    assert state_paths(h, nnx.Param) == set(dio.flatten(eagle.param_shapes(dcfg))) - {"d2t"}
    if draft_vocab:
        assert isinstance(h.d2t, DraftVocab) and not isinstance(h.d2t, nnx.Param)
    chex.assert_shape(h.fc_w[...], (2 * CFG.hidden_size, CFG.hidden_size))
    chex.assert_shape(h.layers["wq"][...], (1, CFG.hidden_size, 4 * 6))
    chex.assert_trees_all_equal(h.to_params(), params)

    tmod = LlamaModule(CFG, rngs=nnx.Rngs(3))
    tokens, features, pos = inputs(4)
    ref = eagle.head_forward(params, dcfg, tmod.embed[...], tokens, features, pos)
    chex.assert_trees_all_equal(h(tmod.embed[...], tokens, features, pos), ref)
    chex.assert_trees_all_equal(h(tmod, tokens, features, pos), ref)
    cache = eagle.new_cache(dcfg, B, 16)
    mask = layers.causal_mask(B, T)  # [B, T, T]
    chex.assert_trees_all_equal(h(tmod, tokens, features, pos, cache=cache, attn_mask=mask),
                                eagle.head_forward(params, dcfg, tmod.embed[...], tokens, features, pos, cache, mask))
    # (features, logits) like Draft.forward (which is jitted: close, not bit-equal)
    draft = Draft(dcfg, params, Target("t", CFG, tmod.to_params()))
    chex.assert_trees_all_close(h.forward(tmod, tokens, features), draft.forward(tokens, features),
                                atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_equal(EagleHeadModule.from_draft(draft).to_params(), params)


def test_optimizer_step_updates_only_params_and_reduces_loss():
    dcfg = DraftConfig.from_target(CFG, draft_vocab_size=8)
    h = EagleHeadModule(dcfg, rngs=nnx.Rngs(5))
    embed = LlamaModule(CFG, rngs=nnx.Rngs(6)).embed[...]
    tokens, features, pos = inputs(7)
    goal = jnp.roll(features, -1, axis=1)  # toy batch: predict the next feature
    opt = nnx.Optimizer(h, optax.adam(1e-2), wrt=nnx.Param)

    def loss_fn(m):
        g, _ = m(embed, tokens, features, pos)
        return jnp.mean((g - goal) ** 2)

    before = h.to_params()
    loss0, grads = nnx.value_and_grad(loss_fn)(h)
    chex.assert_trees_all_equal_structs(grads, nnx.state(h, nnx.Param))
    opt.update(h, grads)
    after = h.to_params()
    assert int(opt.step[...]) == 1
    chex.assert_trees_all_equal(after["d2t"], before["d2t"])  # not a Param: untouched
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), {k: v for k, v in after.items() if k != "d2t"},
                           {k: v for k, v in before.items() if k != "d2t"})
    assert all(jax.tree.leaves(changed)), changed
    assert float(loss_fn(h)) < float(loss0)


def test_target_and_draft_module_views():
    from spec_helpers import fitted_draft, tiny_target
    target, draft = tiny_target(), fitted_draft()
    tm, dm = target.module(), EagleHeadModule.from_draft(draft)
    chex.assert_trees_all_equal(tm.to_params(), target.params)
    chex.assert_trees_all_equal(dm.to_params(), draft.params)
