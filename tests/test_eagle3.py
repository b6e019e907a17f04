"""EAGLE-3 heads: target aux features vs transformers, official checkpoints (both layouts) vs the torch reference,
the draft.forward contract, lossless generation (every method / sync mode, greedy and sampling), bad inputs."""
from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddd_jax import DDDConfig, ModelConfig, Target, TreeConfig, generate, init_draft, llama, load_draft
from ddd_jax import eagle3
from ddd_jax.eagle import Draft

torch = pytest.importorskip("torch")
from ddd_jax.checkpoints.torch_ref import (eagle3_head_check, random_eagle3_head,  # noqa: E402
                                           write_official_eagle3_head)

from conftest import write_tiny_hf_llama  # noqa: E402

LAYERS = 6  # feature layers (2, 3, 3): the L//2 == L-3 duplicate is exercised too


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf3") / "t"
    model = write_tiny_hf_llama(path, num_hidden_layers=LAYERS)
    from ddd_jax import load_target
    return model, load_target(path)


def head_cfg(t: Target, draft_vocab: int = 40, **kw) -> dict:
    c = t.config
    return dict(hidden_size=c.hidden_size, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
                rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=c.vocab_size, draft_vocab_size=draft_vocab, **kw)


def aux_features(t: Target, toks):
    T = toks.shape[1]
    return llama.forward(t.params, t.config, jnp.asarray(toks), jnp.broadcast_to(jnp.arange(T), toks.shape),
                         aux_layers=eagle3.feature_layers(t.config)).aux


def test_aux_matches_transformers_hidden_states(hf_target):
    model, t = hf_target
    toks = np.random.RandomState(0).randint(0, 128, (2, 9)).astype(np.int32)
    with torch.no_grad():
        hs = model(torch.from_numpy(toks).long(), output_hidden_states=True).hidden_states
    L = LAYERS
    ref = np.concatenate([hs[2].numpy(), hs[L // 2].numpy(), hs[L - 3].numpy()], -1)
    got = aux_features(t, toks)
    assert got.shape == (2, 9, 3 * 64)
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4)
    # with a cache (the verify path) the same features come out
    cache = llama.new_cache(t.config, 2, 32)
    o = llama.forward(t.params, t.config, toks, np.broadcast_to(np.arange(9), toks.shape), cache,
                      aux_layers=eagle3.feature_layers(t.config))
    np.testing.assert_allclose(np.asarray(o.aux), ref, atol=1e-4)


@pytest.mark.parametrize("fmt, layout", [("bin", "midlayer"), ("safetensors", "midlayer"), ("bin", "layers"),
                                         ("safetensors", "layers")])
def test_official_eagle3_head_matches_torch(hf_target, tmp_path, fmt, layout):
    _, t = hf_target
    head = random_eagle3_head(head_cfg(t), seed=1, embed=t.params["embed"])
    src = write_official_eagle3_head(head, tmp_path / "e3", fmt=fmt, layout=layout, with_embed=layout == "layers")
    d = load_draft(src, t)
    assert d.config.head_type == "eagle3" and d.config.draft_vocab_size == 40
    assert np.array_equal(np.asarray(d.params["d2t"]), head.target_ids().numpy())
    toks = np.random.RandomState(1).randint(0, 128, (1, 8)).astype(np.int32)
    feats = np.asarray(aux_features(t, toks))[:, :-1]
    diffs = eagle3_head_check(src, d, toks[:, 1:], feats)
    assert diffs["max_feature_diff"] < 1e-4 and diffs["max_logit_diff"] < 1e-4, diffs
    # the head's own output fed back (no fc), as later draft steps do: compare with torch directly
    h1, _ = d.forward(toks[:, 1:], feats)
    from ddd_jax.eagle import head_forward
    T = toks.shape[1] - 1
    h2, _ = head_forward(d.params, d.config, t.params["embed"], toks[:, 1:], h1, jnp.arange(T)[None])
    with torch.no_grad():
        ref2, _ = head(torch.from_numpy(np.array(h1)), torch.from_numpy(toks[:, 1:]).long())
    np.testing.assert_allclose(np.asarray(h2), ref2.numpy(), atol=1e-4)


def test_convert_eagle3_cli_check_and_round_trip(hf_target, tmp_path):
    from ddd_jax.cli import main
    _, t = hf_target
    head = random_eagle3_head(head_cfg(t), seed=2, embed=t.params["embed"])
    src = write_official_eagle3_head(head, tmp_path / "e3", fmt="bin")
    from ddd_jax.checkpoints.ours import save_target
    save_target(t, tmp_path / "tgt")
    out = tmp_path / "out"
    assert main(["convert", "eagle", str(src), str(out), "--target", str(tmp_path / "tgt"), "--check",
                 "--check-tol", "1e-4"]) == 0
    d1, d2 = load_draft(src, t), load_draft(out, t)
    assert d2.config == d1.config
    toks = np.arange(1, 8, dtype=np.int32)[None]
    f = aux_features(t, np.arange(0, 8, dtype=np.int32)[None])[:, :-1]
    np.testing.assert_allclose(np.asarray(d1.forward(toks, f)[1]), np.asarray(d2.forward(toks, f)[1]), atol=1e-6)


@functools.lru_cache(maxsize=None)
def tiny3(seed: int = 0) -> Target:
    """A tiny random target deep enough for EAGLE-3 (6 layers: features from layers 2, 3, 3)."""
    cfg = ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=1024,
                      eos_token_id=(95,))
    p = llama.init_params(cfg, jax.random.PRNGKey(seed), std=0.25)
    p["layers"]["wo"] = p["layers"]["wo"] * 0.15
    return Target(f"tiny3-{seed}", cfg, p)


def test_forward_contract():
    t = tiny3()
    ids = np.sort(np.random.RandomState(0).choice(96, 32, replace=False))
    d = init_draft(t, 0, head_type="eagle3", draft_vocab_size=32)
    d = Draft(d.config, {**d.params, "d2t": jnp.asarray(ids, jnp.int32)}, t)
    toks = np.arange(1, 7, dtype=np.int32)[None].repeat(2, 0)
    feats = jnp.ones((2, 6, 3 * 48))
    h, lg = d.forward(toks, feats)
    assert h.shape == (2, 6, 48) and lg.shape == (2, 6, 96)
    lg = np.asarray(lg)
    outside = np.setdiff1d(np.arange(96), ids)
    assert np.isneginf(lg[..., outside]).all() and np.isfinite(lg[..., ids]).all()
    with pytest.raises(ValueError, match="EAGLE-3 head takes target features.*EAGLE-1/2 features"):
        d.forward(toks, jnp.ones((2, 6, 48)))


def tree_ddd():
    return TreeConfig(top_k=4, total_tokens=12, depth=3), DDDConfig(check_steps=(2, 3), max_depth=5, threshold=-0.5)


@pytest.mark.parametrize("method, sync", [("eagle2", "device"), pytest.param("ddd", "host", marks=pytest.mark.slow),
                                          pytest.param("ddd", "callback", marks=pytest.mark.deep),  # ~12 s
                                          ("ddd", "device")])
def test_generate_identical_to_vanilla(method, sync):
    t = tiny3()
    d = init_draft(t, 1, head_type="eagle3", draft_vocab_size=64)
    ps = [[1, 2, 3, 4, 5], [7, 8, 9]]
    ref = generate(t, None, ps, max_new_tokens=16).tokens
    tree, ddd = tree_ddd()
    r = generate(t, d, ps, max_new_tokens=16, method=method, sync=sync, tree=tree, ddd=ddd)
    assert r.tokens == ref


def test_bad_inputs(hf_target, tmp_path):
    _, t = hf_target
    # a head for another target (hidden size)
    with pytest.raises(ValueError, match="hidden_size"):
        init_draft(t, 0, head_type="eagle3", draft_vocab_size=8, target_hidden_size=32)
    # too shallow a target
    with pytest.raises(ValueError, match="at least 3 layers"):
        init_draft(Target("s", dataclass_replace(tiny3().config, num_hidden_layers=2),
                          llama.init_params(dataclass_replace(tiny3().config, num_hidden_layers=2),
                                            jax.random.PRNGKey(0))), 0, head_type="eagle3", draft_vocab_size=8)
    def write(name, edit=None, cfg_edit=None, **kw):
        head = random_eagle3_head(head_cfg(t, **kw), seed=3, embed=t.params["embed"])
        src = write_official_eagle3_head(head, tmp_path / name, fmt="bin")
        if edit:
            sd = torch.load(src / "pytorch_model.bin", weights_only=True)
            edit(sd)
            torch.save(sd, src / "pytorch_model.bin")
        if cfg_edit:
            c = json.loads((src / "config.json").read_text())
            cfg_edit(c)
            (src / "config.json").write_text(json.dumps(c))
        return src
    cases = {
        "missing": (write("m", lambda sd: sd.pop("midlayer.hidden_norm.weight")), r"missing tensors.*hidden_norm"),
        "shape": (write("s", lambda sd: sd.__setitem__("fc.weight", torch.zeros(64, 64))),
                  r"misshaped tensors fc\.weight"),
        "d2t": (write("d", lambda sd: sd["d2t"].add_(1000)), r"d2t points outside the target vocabulary"),
        "vocab": (write("v", cfg_edit=lambda c: c.__setitem__("vocab_size", 100)), r"vocab_size=100"),
    }
    from ddd_jax.checkpoints.eagle_official import convert_eagle_dir
    for name, (src, match) in cases.items():
        with pytest.raises(ValueError, match=match):
            load_draft(src, t)
        out = tmp_path / f"out-{name}"
        with pytest.raises(ValueError, match=match):
            convert_eagle_dir(src, out, t)
        assert not out.exists()


def dataclass_replace(x, **kw):
    import dataclasses
    return dataclasses.replace(x, **kw)


def token_data(t: Target, n: int = 24, new: int = 36):
    """A FeatureSet of the target's own greedy continuations (ids and masks only: EAGLE-3 computes features)."""
    import dataclasses as dc
    from train_draft.extract import FeatureSet
    rng = np.random.RandomState(5)
    ps = [list(rng.randint(0, 90, rng.randint(2, 6))) for _ in range(n)]
    no_eos = Target(t.name, dc.replace(t.config, eos_token_id=()), t.params)
    res = generate(no_eos, None, ps, max_new_tokens=new)
    seqs = [np.asarray(p + r, np.int32) for p, r in zip(ps, res.tokens)]
    offs = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    ids = np.concatenate(seqs)
    return FeatureSet(ids, np.zeros((len(ids), 0), np.float16), np.ones(len(ids), np.uint8), offs,
                      [str(i) for i in range(n)], {"source": {"kind": "test"}})


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_ttt_attention_is_the_masked_attention_it_replaces(steps):
    """Training-time test's sparse attention (step 0's keys under the packed causal mask, then one key per later
    step at the query's own position) gives the values and gradients of full masked attention over all the
    unrolled steps' slots, on every row that may attend something (padding rows with nothing to attend differ:
    uniform over other slots, and the loss never reads them)."""
    from ddd_jax import layers
    rng = np.random.default_rng(steps)
    B, T, N, K, H, KT = 2, 7, 4, 2, 8, 4  # KT unrolled steps' slots in the cache
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, K, KT * T, H)), jnp.float32) for _ in range(2))
    seg = np.array([[1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 0, 0]])  # two packed sequences, then padding
    mask0 = np.tril(np.ones((T, T), bool))[None] & (seg[:, :, None] == seg[:, None, :]) & (seg > 0)[:, :, None]
    eye = np.broadcast_to(np.eye(T, dtype=bool), (B, T, T))
    full = np.concatenate([mask0] + [eye] * steps + [np.zeros((B, T, T), bool)] * (KT - 1 - steps), axis=-1)
    rows = full.any(-1)  # [B, T]

    def sparse(q, k, v):
        return layers.ttt_attention(q, k, v, jnp.asarray(mask0), steps)

    def dense(q, k, v):
        return layers.attention(q, k, v, jnp.asarray(full))

    np.testing.assert_allclose(np.asarray(sparse(q, k, v))[rows], np.asarray(dense(q, k, v))[rows], rtol=1e-5,
                               atol=1e-6)
    w = jnp.asarray(rng.standard_normal((B, T, N * H)), jnp.float32) * jnp.asarray(rows)[..., None]
    gs = jax.grad(lambda *a: jnp.sum(sparse(*a) * w), argnums=(0, 1, 2))(q, k, v)
    gd = jax.grad(lambda *a: jnp.sum(dense(*a) * w), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(gs, gd):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # time (test-fast budget); `make test` runs it
def test_ttt_training_loss_falls_and_resume_is_exact(tmp_path):
    from train_draft.eagle3_fit import Fit3Config, fit_eagle3
    t = tiny3()
    fs = token_data(t)
    cfg = Fit3Config(steps=16, batch_size=2, seq_len=96, ttt_steps=3, draft_vocab_size=48, lr=2e-2, warmup=2,
                     clip_norm=1.0, max_epochs=0.0)  # 16 steps are several passes over this data: no epoch cap
    full = fit_eagle3(t, fs, tmp_path / "a", cfg, log_every=1, ckpt_every=8, export_dir=tmp_path / "head")
    ms = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    # soft CE against a random tiny target is bounded below by its (high) entropy: the loss falls by little, the
    # step-0 top-1 agreement clearly rises
    assert np.mean([m["loss"] for m in ms[-4:]]) < np.mean([m["loss"] for m in ms[:2]]) - 0.1
    assert np.mean([m["acc0"] for m in ms[-4:]]) > 2 * np.mean([m["acc0"] for m in ms[:2]])
    fit_eagle3(t, fs, tmp_path / "b", cfg, log_every=1, ckpt_every=8, stop_after=8)
    res = fit_eagle3(t, fs, tmp_path / "b", cfg, log_every=1, ckpt_every=8, resume=True)
    assert res["step"] == 16
    for k in full["params"]:
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), full["params"][k], res["params"][k])
    # the exported head loads and drafts losslessly
    d = load_draft(tmp_path / "head", t)
    assert d.config.head_type == "eagle3" and d.config.draft_vocab_size == 48
    ps = [[1, 2, 3], [4, 5, 6, 7]]
    tree, ddd = tree_ddd()
    assert generate(t, d, ps, max_new_tokens=12, method="eagle2", tree=tree).tokens == \
        generate(t, None, ps, max_new_tokens=12).tokens


@pytest.mark.parametrize("temperature,top_p", [pytest.param(1.0, 1.0, marks=pytest.mark.deep), (1.5, 0.9)])
@pytest.mark.slow  # chi-square (~11 s)
def test_sampling_distribution_matches_target_eagle3(temperature, top_p):
    """tests/test_spec.py's chi-square check with an EAGLE-3 head whose draft vocabulary misses some tokens."""
    from scipy.stats import chi2

    from ddd_jax.verify import process_logits
    cfg = ModelConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64, eos_token_id=())
    target = Target("sample3", cfg, llama.init_params(cfg, jax.random.PRNGKey(3), std=0.5))
    d = init_draft(target, 4, head_type="eagle3", draft_vocab_size=4)
    draft = Draft(d.config, {**d.params, "d2t": jnp.asarray([0, 2, 3, 5], jnp.int32)}, target)
    prompt = [1, 2, 3]
    V = cfg.vocab_size
    seqs = np.array([[*prompt, a, b] for a in range(V) for b in range(V)], np.int32)
    lg = llama.forward(target.params, cfg, seqs, np.broadcast_to(np.arange(5), seqs.shape)).logits
    p = np.exp(np.asarray(process_logits(lg, temperature, top_p)))
    joint = np.einsum("a,ab,abc->bc", p[0, 2], p[::V, 3], p[:, 4].reshape(V, V, V)).reshape(-1)
    counts = np.zeros(V * V)
    tree = TreeConfig(top_k=3, total_tokens=8, depth=2)
    for seed in range(4):
        r = generate(target, draft, [prompt] * 1000, max_new_tokens=3, method="eagle2", tree=tree,
                     temperature=temperature, top_p=top_p, seed=seed)
        for t in r.tokens:
            counts[t[1] * V + t[2]] += 1
    n = counts.sum()
    keep = joint * n >= 5
    assert counts[~keep].sum() <= max(10, 0.01 * n)
    stat = (((counts[keep] - n * joint[keep]) ** 2) / (n * joint[keep])).sum()
    pval = chi2.sf(stat, keep.sum() - 1)
    assert pval > 1e-3, f"speculative sampling deviates from the target distribution (chi2={stat:.1f}, p={pval:.2g})"
    assert max(max(s["accepted_per_call"]) for s in r.stats["per_sequence"]) >= 2


@pytest.mark.slow  # the real SmolLM2 (the marker's rule)
@pytest.mark.deep  # the real SmolLM2 (~33 s): make test-deep
def test_smollm2_eagle3_token_identical(smollm2_gguf):
    """The real target: an (untrained) EAGLE-3 head reads SmolLM2's layers 2, 15, 27 and stays lossless."""
    from ddd_jax import load_target
    t = load_target(smollm2_gguf)
    assert eagle3.feature_layers(t.config) == (2, 15, 27)
    d = init_draft(t, 0, head_type="eagle3", draft_vocab_size=2048)
    ids = t.encode("The capital of France is")
    ref = generate(t, None, ids, max_new_tokens=24).tokens
    tree = TreeConfig(top_k=4, total_tokens=16, depth=3)
    assert generate(t, d, ids, max_new_tokens=24, method="eagle2", tree=tree).tokens == ref
    assert generate(t, d, ids, max_new_tokens=24, method="ddd", sync="device", tree=tree,
                    ddd=DDDConfig(check_steps=(2,), max_depth=4)).tokens == ref


@pytest.mark.slow  # a fit through the CLI (~11 s)
def test_train_draft_cli_eagle3(tmp_path):
    """`ddd-jax train-draft fit --head-type eagle3` on extracted shards (only their ids and masks are read)."""
    from ddd_jax.checkpoints.ours import save_target
    from ddd_jax.cli import main
    from train_draft.extract import extract
    t = tiny3()
    save_target(t, tmp_path / "tgt")
    rng = np.random.default_rng(0)
    exs = [{"id": f"s{i}", "ids": rng.integers(0, 90, 30).astype(np.int32), "mask": np.ones(30, np.uint8)}
           for i in range(8)]
    extract(t, exs, lambda e: e, tmp_path / "feat", source={"kind": "synthetic"}, max_len=30, shard_size=4,
            buckets=(32,), progress=False)
    args = ["train-draft", "fit", "--target", str(tmp_path / "tgt"), "--features", str(tmp_path / "feat"),
            "--out", str(tmp_path / "run"), "--head-type", "eagle3", "--ttt-steps", "2", "--draft-vocab-size", "32",
            "--steps", "2", "--batch-size", "1", "--seq-len", "64", "--export-dir", str(tmp_path / "head")]
    assert main(args) == 0
    d = load_draft(tmp_path / "head", t)
    assert d.config.head_type == "eagle3" and d.config.draft_vocab_size == 32
