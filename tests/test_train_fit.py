"""train_draft extraction shards, the EAGLE training loop (learning, bit-exact resume), export and the CLI wiring."""
from __future__ import annotations

import dataclasses

import json
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddd_jax import eagle, llama
from ddd_jax.config import ModelConfig
from ddd_jax.target import Target
from train_draft.extract import extract, load_features, shard_name
from train_draft.train import FitConfig, BatchPlan, fit, pack_rows

V = 64


def tiny_target(vocab=V, hidden=32, name="tiny", seed=0):
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    params = llama.init_params(cfg, jax.random.PRNGKey(seed), std=0.2)
    params["embed"] = params["embed"] * 5.0  # peaked next-token distributions: a clear argmax to learn
    return Target(name, cfg, params)


def shapes_of(tree):
    return jax.tree.map(lambda x: tuple(x.shape), tree)


def synthetic(n, length, seed=0):
    """Learnable sequences: x_{t+1} = (5 x_t + 3) mod V from a random start; the first 4 tokens do not count."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        x = [int(rng.integers(V))]
        for _ in range(length - 1):
            x.append((5 * x[-1] + 3) % V)
        m = np.ones(length, np.uint8)
        m[:4] = 0
        out.append({"id": f"s{i}", "ids": np.asarray(x, np.int32), "mask": m})
    return out


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def feats(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("feat")
    extract(target, synthetic(48, 40), lambda e: e, d, source={"kind": "synthetic"}, max_len=40, shard_size=16,
            buckets=(48,), progress=False)
    return load_features(d, target)


def test_extract_roundtrip_and_resume(target, tmp_path):
    exs = synthetic(5, 30, seed=1)
    exs[3] = dict(exs[3], ids=exs[3]["ids"][:9], mask=exs[3]["mask"][:9])  # mixed lengths, two buckets
    kw = dict(source={"kind": "synthetic"}, max_len=24, shard_size=2, buckets=(16, 32), progress=False)
    m = extract(target, exs, lambda e: e, tmp_path, **kw)
    assert m["complete"] and [s["n_seqs"] for s in m["shards"]] == [2, 2, 1]
    fs = load_features(tmp_path, target)
    assert fs.seq_ids == [e["id"] for e in exs]
    for k, e in enumerate(exs):
        a, b = fs.offsets[k], fs.offsets[k + 1]
        n = min(len(e["ids"]), 24)
        assert b - a == n
        np.testing.assert_array_equal(fs.ids[a:b], e["ids"][:n])
        np.testing.assert_array_equal(fs.mask[a:b], e["mask"][:n])
        ref = target.forward(jnp.asarray(e["ids"][None, :n]), jnp.arange(n)[None], return_logits=False).hidden[0]
        np.testing.assert_allclose(fs.features[a:b].astype(np.float32), np.asarray(ref), atol=2e-3, rtol=2e-3)
        assert fs.features.dtype == np.float16 and fs.ids.dtype == np.int32
    # interrupted run: shard 1 missing -> a rerun recomputes only it, identically
    before = (tmp_path / shard_name(0)).stat().st_mtime_ns
    saved = np.load(tmp_path / shard_name(1))["features"].copy()
    (tmp_path / shard_name(1)).unlink()
    calls = []
    m2 = extract(target, exs, lambda e: calls.append(e["id"]) or e, tmp_path, **kw)
    assert calls == ["s2", "s3"] and m2["complete"]
    assert (tmp_path / shard_name(0)).stat().st_mtime_ns == before
    np.testing.assert_array_equal(np.load(tmp_path / shard_name(1))["features"], saved)
    with pytest.raises(ValueError, match="different settings"):
        extract(target, exs, lambda e: e, tmp_path, **dict(kw, max_len=20))
    with pytest.raises(ValueError, match="not from this target"):
        load_features(tmp_path, tiny_target(vocab=80))


def test_pack_rows_and_batches_are_deterministic(feats):
    rows = pack_rows(np.array([5, 9, 3, 12, 1]), np.arange(5), seq_len=12, min_free=1)
    assert rows == [[(0, 5), (2, 3), (4, 1)], [(1, 9)], [(3, 12)]]
    cfg = FitConfig(batch_size=2, seq_len=80, accum=2, seed=3)
    p1, p2 = BatchPlan(feats, cfg), BatchPlan(feats, cfg)
    b1, b2 = p1.batch(p1.steps_per_epoch + 1), p2.batch(p2.steps_per_epoch + 1)
    for x, y in zip(b1, b2):
        np.testing.assert_array_equal(x, y)
    assert b1.tokens.shape == (2, 2, 80) and b1.feat_in.shape == (2, 2, 80, 32)
    # pairs: (token_{t+1}, feature_t) -> feature_{t+1}, within one packed sequence
    seg, pos = b1.segments[0, 0], b1.positions[0, 0]
    j = int(np.argmax((seg == 1) & (pos == 3)))
    np.testing.assert_array_equal(b1.feat_in[0, 0, j + 1], b1.feat_tgt[0, 0, j])


@pytest.mark.slow  # ~6.4 s (test-fast budget): test_export_load_forward_and_target_check fits in the fast lane
def test_fit_learns_synthetic_sequence(target, feats, tmp_path):
    cfg = FitConfig(steps=300, batch_size=2, seq_len=80, lr=3e-3, warmup=20, seed=0)
    r = fit(target, feats, tmp_path, cfg, eval_set=feats, ckpt_every=1000, log_every=20, eval_every=300,
            eval_batches=2, progress=False)
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [l for l in lines if "split" not in l]
    first, last = train[0], train[-1]
    assert last["vloss"] < 0.5 * first["vloss"] and last["loss"] < 0.7 * first["loss"], (first, last)
    assert last["acc"] > 0.85 and first["acc"] < 0.5, (first["acc"], last["acc"])
    assert r["last_eval"]["eval_acc"] > 0.85
    assert last["tokens_per_s"] > 0 and {"vloss", "ploss", "lr", "grad_norm"} <= set(last)


@pytest.mark.slow  # ~4 s
def test_resume_is_bit_exact(target, feats, tmp_path):
    cfg = FitConfig(steps=6, batch_size=2, seq_len=80, accum=2, lr=1e-3, warmup=2, seed=1)
    straight = fit(target, feats, tmp_path / "a", cfg, ckpt_every=100, progress=False)
    part = fit(target, feats, tmp_path / "b", cfg, ckpt_every=100, stop_after=3, progress=False)
    assert part["step"] == 3
    with pytest.raises(ValueError, match="already holds checkpoints"):
        fit(target, feats, tmp_path / "b", cfg, progress=False)
    resumed = fit(target, feats, tmp_path / "b", cfg, resume=True, ckpt_every=100, progress=False)
    assert resumed["step"] == 6
    chex.assert_trees_all_equal(straight["params"], resumed["params"])  # structure and every bit
    chex.assert_trees_all_equal(resumed["module"].to_params(), resumed["params"])
    assert shapes_of(resumed["params"]) == eagle.param_shapes(resumed["draft_config"])
    steps = [json.loads(l)["step"] for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))


@pytest.mark.slow  # ~4 s
def test_fit_takes_a_panel_major_target(target, feats, tmp_path):
    """`load_target` packs a float32 target's matrices as panels on CPU: fitting (and a target-last-layer init)
    over it is the same as over its row-major arrays."""
    from ddd_jax.backends.cpu import panels
    packed = dataclasses.replace(target, params=panels.pack_params(target.params))
    assert panels.has_panels(packed.params)
    cfg = FitConfig(steps=2, batch_size=2, seq_len=80, lr=1e-3, warmup=1, seed=2, init="target-last-layer")
    a = fit(target, feats, tmp_path / "a", cfg, progress=False)
    b = fit(packed, feats, tmp_path / "b", cfg, progress=False)
    chex.assert_trees_all_equal(a["params"], b["params"])


def test_export_load_forward_and_target_check(target, feats, tmp_path):
    from ddd_jax.checkpoints.ours import load_draft_dir
    from train_draft.export import export_run
    cfg = FitConfig(steps=2, batch_size=2, seq_len=80, init="target-last-layer")
    r = fit(target, feats, tmp_path / "run", cfg, progress=False)
    extra = export_run(tmp_path / "run", target, tmp_path / "head")
    assert extra["trained_for"] == "tiny" and extra["step"] == 2
    meta = json.loads((tmp_path / "head" / "config.json").read_text())
    assert meta["draft_config"]["target_name"] == "tiny"
    d = load_draft_dir(tmp_path / "head", target)
    ref = eagle.Draft(r["draft_config"], jax.tree.map(lambda x: jnp.asarray(x, jnp.float16).astype(jnp.float32),
                                                      r["params"]), target)
    tok = feats.ids[None, 1:17]
    f = jnp.asarray(feats.features[None, :16], jnp.float32)
    chex.assert_trees_all_equal(d.forward(tok, f), ref.forward(tok, f))
    from train_draft.train import _manager, init_head_params
    warm = init_head_params(r["draft_config"], target, FitConfig(init=f"head:{tmp_path / 'head'}"))
    chex.assert_trees_all_equal(warm, d.params)
    # a head with a reduced draft vocabulary warm-starts too: same weights, its d2t dropped (not trained)
    from train_draft.vocab import apply_draft_vocab
    extract(target, synthetic(4, 40), lambda e: e, tmp_path / "fv", source={"kind": "synthetic"}, max_len=40,
            shard_size=16, buckets=(48,), progress=False)
    apply_draft_vocab(tmp_path / "head", target, tmp_path / "fv", 16, tmp_path / "head_v")
    assert "d2t" in load_draft_dir(tmp_path / "head_v", target).params
    warm_v = init_head_params(r["draft_config"], target, FitConfig(init=f"head:{tmp_path / 'head_v'}"))
    chex.assert_trees_all_equal(warm_v, d.params)
    # a checkpoint of the former dict layout fails with a clear message, not an orbax structure error
    (tmp_path / "old").mkdir()
    shutil.copy(tmp_path / "run" / "fit.json", tmp_path / "old" / "fit.json")
    import orbax.checkpoint as ocp
    mgr = _manager(tmp_path / "old" / "checkpoints", 1)
    mgr.save(2, args=ocp.args.StandardSave({"params": r["params"], "step": jnp.asarray(2, jnp.int32)}), force=True)
    mgr.close()
    with pytest.raises(ValueError, match="former dict training state"):
        export_run(tmp_path / "old", target, tmp_path / "head3")
    with pytest.raises(ValueError, match="hidden_size"):
        load_draft_dir(tmp_path / "head", tiny_target(hidden=48))
    with pytest.raises(ValueError, match="vocab_size"):
        export_run(tmp_path / "run", tiny_target(vocab=80), tmp_path / "head2")


def test_cli_registers_train_draft(tmp_path):
    from ddd_jax.cli import build_parser
    from train_draft.plot import plot_metrics
    a = build_parser().parse_args(["train-draft", "fit", "--target", "t", "--features", "f", "--out", "o",
                                   "--steps", "5", "--init", "target-last-layer"])
    assert a.steps == 5 and a.init == "target-last-layer" and callable(a.func)
    for sub in ("extract", "export", "plot"):
        assert build_parser().parse_args(["train-draft", sub] + {
            "extract": ["--target", "t", "--out", "o"], "export": ["--run", "r", "--target", "t", "--out", "o"],
            "plot": ["--run", "r"]}[sub]).func
    m = tmp_path / "metrics.jsonl"
    m.write_text("\n".join(json.dumps(r) for r in [
        {"step": 1, "loss": 2.0, "vloss": 1.0, "ploss": 10.0, "acc": 0.1},
        {"step": 1, "split": "eval", "eval_loss": 2.1, "eval_acc": 0.1},
        {"step": 1, "split": "tau", "tau": 1.5}]) + "\n")
    assert plot_metrics(m, tmp_path / "c.png").stat().st_size > 1000


def objective_inputs(target, feats):
    """(dcfg, head params, embed, lm_w, the first micro-batch [B, L]) of a fresh head's objective."""
    from train_draft.train import frozen_target_arrays, init_head_params
    from ddd_jax.config import DraftConfig
    cfg = FitConfig(batch_size=2, seq_len=80)
    dcfg = DraftConfig.from_target(target.config)
    embed, lm_w = frozen_target_arrays(target)
    mb = jax.tree.map(lambda x: jnp.asarray(x[0]), BatchPlan(feats, cfg).batch(0))
    return dcfg, init_head_params(dcfg, target, cfg), embed, lm_w, mb


def test_on_path_top1_counts_only_chains_whose_earlier_steps_were_right(target, feats):
    """`loss_sums(on_path=True)`: pcount{k} / pcorrect{k} are the loss positions whose chain hit at steps 0..k-1
    (and also at k), recomputed here from each step's own top-1 over the same unroll; free-running correct{k}
    counts every chain."""
    from train_draft import ttt
    from train_draft.train import loss_sums, metric_means, packed_mask
    dcfg, params, embed, _, mb = objective_inputs(target, feats)
    # a two-token "vocabulary": a fresh head's top-1 is right about half the time, so chains both hit and miss
    lm_w = jnp.asarray(np.random.default_rng(0).normal(size=(dcfg.hidden_size, 2)), jnp.float32)
    K = 3
    _, sums = loss_sums(params, dcfg, embed, lm_w, mb, None, 0.0, 0.1, jnp.float32, steps=K, on_path=True)
    seg, tgt_all = mb.segments, mb.feat_tgt.astype(jnp.float32)

    def record(k, g):
        tgt = ttt.shift(tgt_all, k)
        m = ttt.shift(mb.mask, k) * ((ttt.shift(seg, k) == seg) & (seg > 0))
        hit = jnp.argmax(g.astype(jnp.float32) @ lm_w, -1) == jnp.argmax(tgt @ lm_w, -1)
        return 0.0, {"hit": np.asarray(hit), "m": np.asarray(m)}

    _, per = ttt.unroll(params, dcfg, embed, mb.tokens, mb.feat_in.astype(jnp.float32), mb.positions,
                        packed_mask(seg), K, record, 0.8)
    for k in range(1, K):
        path = per[f"m{k}"] * np.prod([per[f"hit{j}"] for j in range(k)], axis=0)
        assert float(sums[f"pcount{k}"]) == pytest.approx(path.sum())
        assert float(sums[f"pcorrect{k}"]) == pytest.approx((path * per[f"hit{k}"]).sum())
        assert float(sums[f"correct{k}"]) == pytest.approx((per[f"m{k}"] * per[f"hit{k}"]).sum())
        assert 0 < path.sum() < per[f"m{k}"].sum()  # some chains missed earlier, some did not
    means = metric_means(sums)
    assert {"acc_path1", "acc_path2"} <= set(means) and "acc_path1" not in metric_means(
        loss_sums(params, dcfg, embed, lm_w, mb, None, 0.0, 0.1, jnp.float32, steps=K)[1])
    with pytest.raises(ValueError, match="on_path"):
        loss_sums(params, dcfg, embed, lm_w, mb, jax.random.PRNGKey(0), 0.0, 0.1, jnp.float32, 8, steps=K,
                  on_path=True)


def test_ce_subsampling_is_unbiased(target, feats):
    from train_draft.train import loss_sums
    dcfg, params, embed, lm_w, mb = objective_inputs(target, feats)
    f = jax.jit(lambda k, K: loss_sums(params, dcfg, embed, lm_w, mb, k, 0.0, 0.1, jnp.float32, K)[1],
                static_argnums=1)
    exact = f(jax.random.PRNGKey(0), 0)
    est = jax.vmap(lambda k: f(k, 16))(jax.random.split(jax.random.PRNGKey(1), 256))
    assert float(est["vloss"][0]) == pytest.approx(float(exact["vloss"]), rel=1e-5)
    assert float(est["ploss"].mean()) == pytest.approx(float(exact["ploss"]), rel=0.03)
    assert float(est["correct"].mean()) == pytest.approx(float(exact["correct"]), rel=0.1, abs=1.0)


@pytest.mark.slow  # ~10 s
def test_ttt_unroll_is_drafting_on_own_features(target):
    """Unrolled step k at position c (`ttt.unroll`) is the head run as drafting runs it: the pairs (x_{t+1}, f_t) of
    positions 0..c, then (x_{c+1+j}, h_{j-1}) at positions c+j, one causal sequence -- every step k and position c
    of two packed sequences, for both head kinds' shared loop."""
    from ddd_jax.config import DraftConfig
    from train_draft import ttt
    dcfg = DraftConfig.from_target(target.config)
    params = eagle.init_params(dcfg, jax.random.PRNGKey(3), std=0.2)
    embed = target.params["embed"]
    rng = np.random.default_rng(0)
    lens, K, D = (7, 9), 3, target.config.hidden_size
    L = sum(lens) + 2  # two padding slots
    toks = rng.integers(V, size=(1, L)).astype(np.int32)
    feats = rng.normal(size=(1, L, D)).astype(np.float32)
    seg = np.zeros((1, L), np.int32)
    pos = np.zeros((1, L), np.int32)
    c0 = 0
    for s, n in enumerate(lens):
        seg[0, c0:c0 + n], pos[0, c0:c0 + n] = s + 1, np.arange(n)
        c0 += n
    _, hs = ttt.unroll(params, dcfg, embed, jnp.asarray(toks), jnp.asarray(feats), jnp.asarray(pos),
                       ttt.packed_causal(jnp.asarray(seg)), K, lambda k, h: (0.0, {"h": h}), 0.8)
    c0 = 0
    for n in lens:
        for c in range(n - K + 1):  # positions whose K steps stay inside the sequence
            tok = list(toks[0, c0:c0 + c + 1])
            fin = list(feats[0, c0:c0 + c + 1])
            for k in range(K):
                T = len(tok)
                out, _ = eagle.head_forward(params, dcfg, embed, jnp.asarray([tok]), jnp.asarray([fin]),
                                            jnp.arange(T)[None])
                np.testing.assert_allclose(np.asarray(hs[f"h{k}"][0, c0 + c]), np.asarray(out[0, -1]),
                                           rtol=2e-5, atol=2e-5, err_msg=f"step {k}, position {c}")
                tok.append(toks[0, c0 + c + k + 1])
                fin.append(np.asarray(out[0, -1]))
        c0 += n


def test_ttt_one_step_is_the_eagle_objective(target, feats):
    """ttt_steps=1 is EAGLE's teacher-forced loss: the head over the packed batch with its block-causal mask."""
    from train_draft.train import loss_sums, packed_mask, smooth_l1
    dcfg, params, embed, lm_w, mb = objective_inputs(target, feats)
    _, sums = loss_sums(params, dcfg, embed, lm_w, mb, None, 0.0, 0.1, jnp.float32)
    g, _ = eagle.head_forward(params, dcfg, embed, mb.tokens, mb.feat_in.astype(jnp.float32), mb.positions,
                              attn_mask=packed_mask(mb.segments))
    v = jnp.sum(mb.mask * jnp.mean(smooth_l1(g - mb.feat_tgt.astype(jnp.float32)), -1))
    assert float(sums["vloss"]) == pytest.approx(float(v), rel=1e-5)
    assert set(sums) == {"vloss", "ploss", "correct", "count"}


@pytest.mark.slow  # a fit (~16 s)
def test_ttt_fit_learns_later_steps_and_reports_them(target, feats, tmp_path):
    """--ttt-steps 3 trains steps 1-2 on the head's own features: their held-out top-1 (reported per step up to
    EVAL_STEPS, free-running) ends far above a teacher-forced fit's of the same length, and resume stays exact."""
    from train_draft.train import EVAL_STEPS
    runs = {}
    for K in (1, 3):
        cfg = FitConfig(steps=120, batch_size=2, seq_len=80, lr=3e-3, warmup=10, seed=0, ttt_steps=K)
        runs[K] = fit(target, feats, tmp_path / f"k{K}", cfg, eval_set=feats, ckpt_every=1000, log_every=20,
                      eval_every=120, eval_batches=2, progress=False)["last_eval"]
    assert {f"eval_acc{k}" for k in range(1, EVAL_STEPS)} <= set(runs[3]) and "eval_acc" in runs[3]
    assert {f"eval_acc_path{k}" for k in range(1, EVAL_STEPS)} <= set(runs[3])
    assert runs[3]["eval_acc2"] > runs[1]["eval_acc2"] + 0.03, (runs[1], runs[3])
    cfg = FitConfig(steps=4, batch_size=2, seq_len=80, lr=1e-3, warmup=2, seed=1, ttt_steps=2)
    straight = fit(target, feats, tmp_path / "a", cfg, ckpt_every=100, progress=False)
    fit(target, feats, tmp_path / "b", cfg, ckpt_every=100, stop_after=2, progress=False)
    resumed = fit(target, feats, tmp_path / "b", cfg, resume=True, ckpt_every=100, progress=False)
    chex.assert_trees_all_equal(straight["params"], resumed["params"])
