"""A third kind of draft head, defined here and registered with `ddd_jax.head_kinds`, decodes losslessly through
`generate` in every method and sync mode, and saves, loads and runs as the built-in kinds do: a new head kind is
one module, no library code touched."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddd_jax import DDDConfig, Draft, DraftConfig, Target, TreeConfig, generate, head_kinds, save_draft
from ddd_jax import eagle
from ddd_jax.checkpoints.ours import load_draft_dir
from spec_helpers import tiny_target


# ------------------------------------------------------------------------------------- the toy kind: "toy-mlp"
# It reads the residual stream entering the target's last layer (not the final hidden state), projects it through a
# two-layer MLP, drafts with an attention-free mixing layer over cat(embed(token), h) (its KV cache stays as it
# came), and scores its own small draft vocabulary with its own output matrix.
def toy_feature_layers(tcfg):
    return (tcfg.num_hidden_layers - 1,)


def toy_feature_size(dcfg):
    return dcfg.target_hidden_size or dcfg.hidden_size


def toy_check_config(dcfg):
    if not dcfg.draft_vocab_size:
        raise ValueError("a toy-mlp head needs draft_vocab_size")


def toy_param_shapes(dcfg):
    D, F, Vd = dcfg.hidden_size, dcfg.intermediate_size, dcfg.draft_vocab_size
    return {"proj_in": (toy_feature_size(dcfg), F), "proj_out": (F, D), "mix": (2 * D, D), "out": (D, Vd),
            "d2t": (Vd,)}


def toy_init_params(dcfg, key, dtype=jnp.float32, std=0.02):
    shapes = toy_param_shapes(dcfg)
    keys = jax.random.split(key, len(shapes))
    p = {name: (std * 10 * jax.random.normal(k, s, jnp.float32)).astype(dtype)
         for (name, s), k in zip(sorted(shapes.items()), keys) if name != "d2t"}
    # the draft vocabulary: every other target token, high ids first (a map that is not the identity)
    p["d2t"] = jnp.asarray(np.arange(dcfg.vocab_size)[::-2][: dcfg.draft_vocab_size].copy(), jnp.int32)
    return p


def toy_project_features(dparams, dcfg, feats):
    return jax.nn.gelu(feats @ dparams["proj_in"].astype(feats.dtype)) @ dparams["proj_out"].astype(feats.dtype)


def toy_head_forward(dparams, dcfg, embed, tokens, h, positions, cache=None, attn_mask=None, mask_start=None):
    e = jnp.take(embed, jnp.asarray(tokens, jnp.int32), axis=0).astype(h.dtype)
    return h + jnp.tanh(jnp.concatenate([e, h], axis=-1) @ dparams["mix"].astype(h.dtype)), cache


def toy_draft_logits(dparams, tparams, tcfg, h, dcfg):
    return jax.nn.log_softmax((h @ dparams["out"].astype(h.dtype)).astype(jnp.float32), axis=-1)


def toy_target_logits(dparams, tparams, tcfg, h, dcfg):
    sub = (h @ dparams["out"].astype(h.dtype)).astype(jnp.float32)
    return jnp.full(sub.shape[:-1] + (tcfg.vocab_size,), -jnp.inf, sub.dtype).at[..., dparams["d2t"]].set(sub)


TOY = head_kinds.register(head_kinds.HeadKind(
    name="toy-mlp", title="toy MLP", features="the residual stream entering the target's last layer",
    feature_layers=toy_feature_layers, feature_size=toy_feature_size, project_features=toy_project_features,
    head_forward=toy_head_forward, draft_logits=toy_draft_logits, target_logits=toy_target_logits,
    param_shapes=toy_param_shapes, init_params=toy_init_params, check_config=toy_check_config,
    axes={"proj_in": ("embed", "ffw"), "proj_out": ("ffw", "embed"), "mix": ("embed2", "embed"),
          "out": ("embed", "draft_vocab")}))


def target() -> Target:
    """The tiny random target without an EOS token: every decode runs its whole length."""
    t = tiny_target()
    return Target(t.name, dataclasses.replace(t.config, eos_token_id=()), t.params)


def toy_draft(seed: int = 0) -> Draft:
    return eagle.init_draft(target(), seed, head_type="toy-mlp", draft_vocab_size=32)


# ------------------------------------------------------------------------------------------------- the tests
def test_registered_and_described():
    d = toy_draft()
    assert "toy-mlp" in head_kinds.names() and head_kinds.names()[:2] == ("eagle1", "eagle3")
    assert d.kind is TOY and d.config.feature_size == 48
    assert eagle.feature_layers(d.config, d.target.config) == (1,)
    assert set(eagle.param_axes(d.config)) == set(toy_param_shapes(d.config))
    with pytest.raises(ValueError, match="needs draft_vocab_size"):
        DraftConfig.from_target(d.target.config, head_type="toy-mlp")
    with pytest.raises(ValueError, match="head_type must be one of.*toy-mlp"):
        DraftConfig.from_target(d.target.config, head_type="nonesuch")
    with pytest.raises(ValueError, match="fixed by its own lm_head"):
        eagle.with_draft_vocab(d, [1, 2, 3])
    with pytest.raises(ValueError, match="toy MLP heads cannot be stored as GGUF blocks"):
        d.astype("q8_0")


def test_forward_save_and_load(tmp_path):
    d = toy_draft(1)
    toks = np.arange(1, 7, dtype=np.int32)[None].repeat(2, 0)
    feats = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 48))
    h, lg = d.forward(toks, feats)
    assert h.shape == (2, 6, 48) and lg.shape == (2, 6, 96)
    ids = np.asarray(d.params["d2t"])
    assert np.isneginf(np.asarray(lg)[..., np.setdiff1d(np.arange(96), ids)]).all()
    with pytest.raises(ValueError, match="toy MLP head takes target features"):
        d.forward(toks, feats[..., :40])
    save_draft(d, tmp_path / "toy")
    back = load_draft_dir(tmp_path / "toy", d.target)
    assert back.config == d.config and back.config.head_type == "toy-mlp"
    np.testing.assert_array_equal(np.asarray(back.forward(toks, feats)[1]), np.asarray(lg))


TREE, DDD = TreeConfig(top_k=4, total_tokens=12, depth=3), DDDConfig(check_steps=(0, 2, 3), max_depth=5,
                                                                     threshold=-2.0)


@pytest.mark.parametrize("method, sync", [pytest.param(m, s, marks=pytest.mark.slow if s != "device" else ())
                                          for m in ("eagle2", "ddd") for s in ("host", "callback", "device")])
@pytest.mark.parametrize("batch", [False, True])
def test_generate_identical_to_vanilla(method, sync, batch):
    d = toy_draft(2)
    t = d.target
    ps = [[1, 2, 3, 4, 5], [7, 8, 9]] if batch else [4, 5, 6, 7]
    ref = generate(t, None, ps, max_new_tokens=16)
    r = generate(t, d, ps, max_new_tokens=16, method=method, sync=sync, tree=TREE, ddd=DDD)
    assert r.tokens == ref.tokens
    assert all(s["draft_steps"] > 0 for s in (r.stats["per_sequence"] if batch else [r.stats]))  # it drafted
