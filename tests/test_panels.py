"""Panel-major float32 weights (`ddd_jax.backends.cpu.panels`): the layout round-trips, the kernel's product is bitwise the
row-major kernel's (every row count, padded last panels; AVX-512 against AVX2 in
`test_kernels.test_avx512_and_avx2_products_are_bitwise_equal`), rows stay independent of the rows beside them,
gradients and the XLA fallback match, and `load_target` packs by default on CPU and unpacks wherever a float array
is wanted (saving, nnx modules)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddd_jax import layers
from ddd_jax.backends.cpu import kernels, panels, quant

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="CPU kernel library not built / not supported")

SHAPES = [(576, 576), (576, 192), (1536, 576), (13, 100), (100, 47), (64, 96), (7, 1)]  # (K, N); N % 48 != 0 pads


@pytest.mark.parametrize("width", panels.WIDTHS)
@pytest.mark.parametrize("K,N", SHAPES)
def test_pack_round_trip_and_logical_shape(K, N, width):
    w = jnp.asarray(np.random.default_rng(0).standard_normal((3, K, N)), jnp.float32)
    pw = panels.pack(w, width=width)
    P = -(-N // width)
    assert pw.data.shape == (3, P, K, width) and pw.shape == (3, K, N) and pw.ndim == 3 and pw.width == width
    np.testing.assert_array_equal(np.asarray(pw.unpack()), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(pw.data[:, -1, :, N - (P - 1) * width:]), 0.0)  # padding
    leaves, tree = jax.tree.flatten(pw)  # a pytree: jit and tree maps see its one array
    assert len(leaves) == 1 and jax.tree.unflatten(tree, leaves).n == N
    other = panels.pack(pw, width=sum(panels.WIDTHS) - width)  # repacked to the other width: the same matrix
    assert other.width != width and other.n == N
    np.testing.assert_array_equal(np.asarray(other.unpack()), np.asarray(w))


def test_default_width_and_the_environment(monkeypatch):
    """48 columns unless DDD_JAX_PANEL_WIDTH says 16; a width that is neither is refused by name."""
    monkeypatch.delenv("DDD_JAX_PANEL_WIDTH", raising=False)
    assert panels.default_width() == 48 and panels.pack(jnp.ones((4, 20))).data.shape == (1, 4, 48)
    monkeypatch.setenv("DDD_JAX_PANEL_WIDTH", "16")
    assert panels.default_width() == 16 and panels.pack(jnp.ones((4, 20))).data.shape == (2, 4, 16)
    assert panels.width_of({"a": jnp.ones(3), "b": [panels.pack(jnp.ones((4, 20)))]}) == 16
    assert panels.width_of({"a": jnp.ones(3)}) is None
    monkeypatch.setenv("DDD_JAX_PANEL_WIDTH", "32")
    with pytest.raises(ValueError, match="DDD_JAX_PANEL_WIDTH='32'"):
        panels.default_width()
    with pytest.raises(ValueError, match="width=24"):
        panels.pack(jnp.ones((4, 20)), width=24)


def test_pack_rejects_what_it_cannot_hold():
    with pytest.raises(ValueError, match="float32 \\(or float16\\) matrices"):
        panels.pack(jnp.zeros((4, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match="float32 \\(or float16\\) matrices"):
        panels.pack(jnp.zeros((8,), jnp.float32))
    with pytest.raises(ValueError, match="layout does not match"):
        layers.linear(jnp.ones((1, 8)), panels.pack(jnp.ones((8, 4))), transposed=True)
    with pytest.raises(ValueError, match="layout does not match"):
        layers.linear(jnp.ones((1, 4)), panels.pack(jnp.ones((8, 4)), rows=True))
    with pytest.raises(ValueError, match="rows-layout"):
        panels.pack(jnp.ones((8, 4))).take(jnp.array([1]))


def test_rows_layout_a_tied_embedding():
    """A tied embedding [V, D] packs as the panels of its transpose: lookups gather its rows back bit for bit,
    x @ E.T is the panel product (bitwise the row-major kernel's x @ (E.T)), `.T` flips the logical layout."""
    rng = np.random.default_rng(4)
    E = jnp.asarray(rng.standard_normal((100, 24)), jnp.float32)  # V = 100: a padded last panel
    pe = panels.pack(E, rows=True)
    assert pe.rows and pe.shape == (100, 24) and pe.T.shape == (24, 100) and not pe.T.rows
    np.testing.assert_array_equal(np.asarray(pe.unpack()), np.asarray(E))
    np.testing.assert_array_equal(np.asarray(pe.T.unpack()), np.asarray(E.T))
    ids = jnp.asarray([[0, 47, 48, 99], [5, 5, 96, 1]])
    np.testing.assert_array_equal(np.asarray(jax.jit(layers.embed)(pe, ids)), np.asarray(E[ids]))
    x = jnp.asarray(rng.standard_normal((2, 3, 24)), jnp.float32)
    out = jax.jit(lambda x, w: layers.linear(x, w, transposed=True))(x, pe)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.einsum("btd,vd->btv", x, E, precision="highest")),
                               rtol=1e-5, atol=1e-4)
    if kernels.available():
        np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(layers.linear)(x, E.T)))
    pt = panels.pack(E, rows=True, table=True)  # with the row-major lookup table: the same rows, the same product
    assert pt.table is not None and pt.nbytes == pe.nbytes + E.size * 4 and pt.T.table is None
    np.testing.assert_array_equal(np.asarray(pt.data), np.asarray(pe.data))
    np.testing.assert_array_equal(np.asarray(jax.jit(layers.embed)(pt, ids)), np.asarray(E[ids]))
    np.testing.assert_array_equal(np.asarray(pt.unpack()), np.asarray(E))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, w: layers.linear(x, w, transposed=True))(x, pt)),
                                  np.asarray(out))
    assert panels.pack(pe, rows=True, table=True).table is not None  # added to packed panels too
    flat, tree = jax.tree.flatten(pt)
    assert len(flat) == 2 and jax.tree.unflatten(tree, flat).table is pt.table
    with pytest.raises(ValueError, match="lookup table"):
        panels.pack(E, table=True)


# every shape at both widths; in the fast lane four at 16 columns and two at 48, the rest in the slow one
FAST = {16: ((576, 576), (1536, 576), (100, 47), (7, 1)), 48: ((576, 576), (100, 47))}
WIDTH_SHAPES = [pytest.param(w, K, N, marks=[] if (K, N) in FAST[w] else pytest.mark.slow)
                for w in (16, 48) for K, N in SHAPES]


@needs_kernel
@pytest.mark.parametrize("width,K,N", WIDTH_SHAPES)
def test_product_is_bitwise_the_row_major_kernels(K, N, width):
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((2, K, N)), jnp.float32)
    pw = panels.pack(w, width=width)
    f_rows = jax.jit(lambda x, w: layers.linear(x, w, 1))
    f_pan = jax.jit(lambda x, d: kernels.product_panels(x, d, N, 1))
    for M in (1, 2, 3, 5, 8, 9, 12, 16, 17, 33, 64, 65, 86, 128):
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
        got = np.asarray(f_pan(x, pw.data))
        np.testing.assert_array_equal(got, np.asarray(f_rows(x, w)), err_msg=f"M={M}")
        if M > 1:  # a row's bits do not depend on the rows computed with it
            np.testing.assert_array_equal(np.asarray(f_pan(x[M // 2:M // 2 + 1], pw.data))[0], got[M // 2])
    x = jnp.asarray(rng.standard_normal((300, K)), jnp.float32)  # prefill: several 64-row passes, XLA to compare
    np.testing.assert_allclose(np.asarray(f_pan(x, pw.data)), np.asarray(x @ w[1]), rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_greedy_product_is_the_first_maximum_of_its_logits(use_kernel):
    """`kernels.greedy_panels` (the lm_head of greedy decoding): the logits are bitwise the panel product's, the
    tokens are `greedy_token` of them -- ties to the lowest index within a column chunk and across chunks, a row
    with a NaN gives N - 1 -- for 1 to 65 rows (several 64-row passes) and a padded last panel; and XLA's path
    (no kernel) answers the same."""
    from ddd_jax.verify import greedy_token
    if use_kernel and not kernels.available():
        pytest.skip("CPU kernel library not built / not supported")
    rng = np.random.default_rng(7)
    K, N = 40, 4810  # 101 panels, the last padded: several column chunks per thread
    w = rng.standard_normal((K, N)).astype(np.float32)
    for M in (1, 5, 7, 65):
        x = rng.standard_normal((M, K)).astype(np.float32)
        top = np.argmax(x @ w, axis=1)
        wt = w.copy()
        # exact ties: copy row 0's best column to an earlier and a later column (another chunk); the same weights
        # and the same fma order give the same bits, so the first copy must win
        wt[:, 17] = w[:, top[0]]
        wt[:, N - 3] = w[:, top[0]]
        if M > 2:
            x[2, 5] = np.nan  # a NaN row: every logit NaN -> N - 1
        pw = panels.pack(jnp.asarray(wt), rows=False)
        with kernels.enabled(use_kernel):
            logits, ids = jax.jit(lambda x, d: kernels.greedy_panels(x, d, N, greedy_token))(jnp.asarray(x), pw.data)
            ref = jax.jit(lambda x, d: kernels.product_panels(x, d, N))(jnp.asarray(x), pw.data)
        np.testing.assert_array_equal(np.asarray(logits), np.asarray(ref), err_msg=f"M={M}")
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(greedy_token(ref)), err_msg=f"M={M}")
        assert int(ids[0]) == 17
        if M > 2:
            assert int(ids[2]) == N - 1
    x3 = jnp.asarray(rng.standard_normal((2, 3, K)), jnp.float32)  # leading dims kept
    logits, ids = kernels.greedy_panels(x3, panels.pack(jnp.asarray(w)).data, N, greedy_token)
    assert logits.shape == (2, 3, N) and ids.shape == (2, 3) and ids.dtype == jnp.int32
    half = panels.pack(jnp.asarray(w, jnp.float16)).data  # float16 panels: the greedy kernel reads float32, so XLA
    logits, ids = jax.jit(lambda x, d: kernels.greedy_panels(x, d, N, greedy_token))(x3, half)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(greedy_token(logits)))


@needs_kernel
def test_float16_panels_are_bitwise_the_float16_row_major_kernels():
    """A float16 head's matrices as panels (`panels.pack_head`): the kernel widens each weight exactly as it reads
    it, in the row-major float16 kernel's order, so the products are the same bits; XLA (no kernel) agrees."""
    rng = np.random.default_rng(11)
    w = jnp.asarray(rng.standard_normal((1, 576, 200)), jnp.float16)  # a padded last panel
    pw = panels.pack(w)
    W = panels.default_width()
    assert pw.dtype == jnp.float16 and pw.data.shape == (1, -(-200 // W), 576, W)
    f_rows = jax.jit(lambda x, w: layers.linear(x, w, 0))
    f_pan = jax.jit(lambda x, p: layers.linear(x, p, 0))
    for M in (1, 4, 8, 9, 16, 70):
        x = jnp.asarray(rng.standard_normal((M, 576)), jnp.float32)
        got = np.asarray(f_pan(x, pw))
        np.testing.assert_array_equal(got, np.asarray(f_rows(x, w)), err_msg=f"M={M}")
        np.testing.assert_allclose(got, np.asarray(x @ w[0].astype(jnp.float32)), rtol=1e-4, atol=1e-3)
        with kernels.enabled(False):
            xla = np.asarray(jax.jit(lambda x, p: layers.linear(x, p, 0))(x, pw))
        np.testing.assert_allclose(xla, got, rtol=1e-5, atol=1e-4)


def test_xla_fallback_and_linear_dispatch():
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((2, 100, 47)), jnp.float32)
    pw = panels.pack(w)
    x = jnp.asarray(rng.standard_normal((4, 3, 100)), jnp.float32)  # leading dims kept
    ref = np.asarray(jnp.einsum("abk,kn->abn", x, w[0], precision="highest"))
    got = np.asarray(kernels._panels_xla(x.reshape(-1, 100), pw.data, jnp.int32(0), 47)).reshape(4, 3, 47)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    out = jax.jit(lambda x, p: layers.linear(x, p, 0))(x, pw)
    assert out.shape == (4, 3, 47)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-4)
    out1 = layers.linear(x[0], panels.pack(w[1]))  # an unstacked weight
    np.testing.assert_allclose(np.asarray(out1), np.asarray(x[0] @ w[1]), rtol=1e-5, atol=1e-4)


def test_gradients_match_the_row_major_weight():
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((2, 24, 50)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((5, 24)), jnp.float32)
    loss = lambda x, w: jnp.sum(jnp.sin(layers.linear(x, w, 1)))  # noqa: E731
    gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
    px, pw = jax.grad(loss, argnums=(0, 1))(x, panels.pack(w))
    np.testing.assert_allclose(np.asarray(px), np.asarray(gx), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pw.unpack()), np.asarray(gw), rtol=1e-5, atol=1e-5)


def test_pack_params_and_float_views():
    tied = panels.pack_params({"embed": jnp.ones((10, 4)), "layers": {}})
    assert panels.is_panels(tied["embed"]) and tied["embed"].rows  # the output projection of a tied model
    untied = panels.pack_params({"embed": jnp.ones((10, 4)), "lm_head": jnp.ones((4, 10)), "layers": {}})
    assert not panels.is_panels(untied["embed"]) and not untied["lm_head"].rows  # lookups only: stays row-major
    params = {"embed": jnp.ones((10, 4)), "lm_head": jnp.ones((4, 10)), "final_norm": jnp.ones((4,)),
              "layers": {"wq": jnp.ones((2, 4, 6)), "attn_norm": jnp.ones((2, 4)),
                         "w_up": jnp.ones((2, 4, 6), jnp.bfloat16)}}
    packed = panels.pack_params(params)
    assert panels.is_panels(packed["layers"]["wq"]) and panels.has_panels(packed)
    assert packed["layers"]["attn_norm"] is params["layers"]["attn_norm"]  # vectors stay as stored
    assert packed["layers"]["w_up"] is params["layers"]["w_up"]  # not float32: stays row-major
    assert packed["embed"] is params["embed"] and not panels.has_panels(params)
    for back in (panels.unpack_params(packed), quant.dequantize_tree(packed)):
        np.testing.assert_array_equal(np.asarray(back["layers"]["wq"]), np.asarray(params["layers"]["wq"]))
    assert quant.as_float(packed["layers"]["wq"]).shape == (2, 4, 6)
    assert quant.describe(panels.pack_params(params, screen=False)) == "float32 (panels)"
    assert quant.describe(panels.pack_params(params, width=16, screen=False)) == "float32 (16-column panels)"
    assert quant.describe(panels.pack_params(params, screen=True)) == "float32 (panels) + int8 screen"


@pytest.mark.slow  # ~8 s
def test_load_target_packs_on_cpu_and_is_bitwise_the_row_major_target(tiny_hf_llama, tmp_path):
    from conftest import PARITY_TOKENS, assert_same_target

    from ddd_jax import load_target
    from ddd_jax.checkpoints.ours import save_target
    _, path = tiny_hf_llama()
    rows = load_target(path, panels=False)
    assert not panels.has_panels(rows.params)
    pan = load_target(path, panels=True)
    assert panels.has_panels(pan.params) and pan.params["layers"]["wq"].shape == rows.params["layers"]["wq"].shape
    assert panels.has_panels(load_target(path).params) == panels.auto()
    tok = jnp.asarray(PARITY_TOKENS)
    pos = jnp.arange(tok.shape[1])[None]
    a, b = pan.forward(tok, pos).logits, rows.forward(tok, pos).logits
    from ddd_jax import llama
    from ddd_jax.verify import greedy_token
    g = jax.jit(lambda p, t, q: llama.forward(p, pan.config, t, q, greedy=True))(pan.params, tok, pos)
    np.testing.assert_array_equal(np.asarray(g.logits), np.asarray(a))  # greedy=True: the same logits, bitwise,
    np.testing.assert_array_equal(np.asarray(g.greedy), np.asarray(greedy_token(a)))  # and their greedy tokens
    if kernels.available():  # untied: every product is the kernel's x @ W in the same order, so bitwise
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    _, tied = tiny_hf_llama(tie=True, name="tied")  # tied: x @ E.T becomes a panel product (another sum order)
    pt, rt = load_target(tied, panels=True), load_target(tied, panels=False)
    assert pt.params["embed"].rows and pt.params["embed"].shape == rt.params["embed"].shape
    np.testing.assert_array_equal(np.asarray(pt.params["embed"].table), np.asarray(rt.params["embed"]))
    np.testing.assert_allclose(np.asarray(pt.forward(tok, pos).logits), np.asarray(rt.forward(tok, pos).logits),
                               rtol=1e-5, atol=1e-5)
    gt = llama.forward(pt.params, pt.config, tok, pos, greedy=True)  # the tied projection: the same greedy kernel
    np.testing.assert_array_equal(np.asarray(gt.greedy), np.asarray(greedy_token(pt.forward(tok, pos).logits)))
    save_target(pan, tmp_path / "saved")  # saved row-major, as every checkpoint is
    assert_same_target(rows, load_target(tmp_path / "saved", panels=False))
    module = pan.module()  # nnx modules hold row-major float arrays
    assert not panels.has_panels(module.to_params())
    with pytest.raises(ValueError, match="not float32"):
        load_target(path, dtype="bfloat16", panels=True)
    with pytest.raises(ValueError, match="panels must be"):
        load_target(path, panels="yes")
    with pytest.raises(ValueError, match="panels must be"):
        load_target(path, panels=32)
    p16 = load_target(path, panels=16)  # 16-column panels: the same logits, bit for bit
    assert p16.params["layers"]["wq"].width == 16 and pan.params["layers"]["wq"].width == panels.default_width()
    np.testing.assert_array_equal(np.asarray(p16.forward(tok, pos).logits), np.asarray(a))


@pytest.mark.slow  # ~11 s
def test_a_head_drafts_from_panels_where_its_target_has_them(tiny_hf_llama):
    """A head bound to a panel-major target carries its matrices and draft-vocabulary rows as panels for the decode
    loops (`Draft.packed`; its `params` stay row-major): the layer's products are bitwise the row-major kernel's,
    the draft logits equal up to the summation order of the vocabulary product, and decoding stays token-identical
    to vanilla."""
    from ddd_jax import DDDConfig, TreeConfig, generate, init_draft, load_target
    from ddd_jax.eagle import draft_logits, with_draft_vocab
    _, path = tiny_hf_llama()
    pan, rows = load_target(path, panels=True), load_target(path, panels=False)
    V = pan.config.vocab_size
    d = with_draft_vocab(init_draft(pan, 0).astype(jnp.float16), np.arange(0, V, 2))
    dp = d.decode_params()
    assert panels.is_panels(dp["layers"]["w_up"]) and panels.is_panels(dp["fc_w"]) and dp["lm_sub"].rows
    assert not panels.has_panels(d.params) and "d2t" in dp
    assert init_draft(rows, 0).packed is None  # a row-major target: the head stays row-major too
    bf = with_draft_vocab(init_draft(pan, 0).astype(jnp.bfloat16), np.arange(0, V, 2)).decode_params()
    assert not panels.is_panels(bf["lm_sub"]) and not panels.is_panels(bf["fc_w"])  # no bfloat16 panels
    h = jnp.asarray(np.random.default_rng(5).standard_normal((3, pan.config.hidden_size)), jnp.float32)
    unpacked = {**d.params, "lm_sub": d.lm_sub}
    np.testing.assert_allclose(np.asarray(draft_logits(dp, pan.params, pan.config, h)),
                               np.asarray(draft_logits(unpacked, pan.params, pan.config, h)), rtol=1e-5, atol=1e-5)
    tree, ddd = TreeConfig(top_k=2, total_tokens=4, depth=2), DDDConfig(check_steps=(1,), threshold=-0.3, max_depth=3)
    ids = [3, 17, 5, 9, 30, 2, 11]
    van = generate(pan, None, ids, 16)
    assert generate(pan, d, ids, 16, method="ddd", tree=tree, ddd=ddd).tokens == van.tokens
    p16 = load_target(path, panels=16)  # a head packs with its target's panel width
    d16 = with_draft_vocab(init_draft(p16, 0).astype(jnp.float16), np.arange(0, V, 2))
    assert {x.width for x in jax.tree.leaves(d16.decode_params(), is_leaf=panels.is_panels)
            if panels.is_panels(x)} == {16}
    assert generate(p16, d16, ids, 16, method="ddd", tree=tree, ddd=ddd).tokens == van.tokens


@needs_kernel
@pytest.mark.slow  # ~15 s: make test runs it
def test_a_gguf_block_head_drafts_from_quantized_panels(tiny_hf_llama):
    """A head stored as GGUF blocks (`Draft.astype("q8_0")`) bound to a panel-major target drafts from quantized
    panels (`quant.BlockPanels`: dequantized in registers by the panel kernel) instead of its row blocks: every
    matrix's product and the draft logits are bitwise those of its float32 twin (the dequantized values) drafting
    from float32 panels, its `params` stay row blocks, and decoding stays token-identical to vanilla."""
    from ddd_jax import DDDConfig, TreeConfig, generate, init_draft, load_target
    from ddd_jax.eagle import draft_logits, with_draft_vocab
    _, path = tiny_hf_llama()
    pan = load_target(path, panels=True)
    V, D = pan.config.vocab_size, pan.config.hidden_size
    q = with_draft_vocab(init_draft(pan, 0), np.arange(0, V, 2)).astype("q8_0")
    dq = q.decode_params()
    mats = {"fc_w": dq["fc_w"], **{k: v for k, v in dq["layers"].items() if isinstance(v, quant.BlockPanels)}}
    assert set(mats) == {"fc_w", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    assert all(isinstance(w, quant.BlockPanels) and w.kind == "q8_0" for w in mats.values())
    assert isinstance(dq["lm_sub"], quant.BlockPanels) and dq["lm_sub"].rows and "d2t" in dq
    assert quant.is_block(q.params["fc_w"]) and quant.is_block(q.lm_sub)  # the saved form stays row blocks
    rng = np.random.default_rng(11)
    for name, w in mats.items():
        twin = panels.pack(w.dequantize())
        layer = 0 if name != "fc_w" else None
        x = jnp.asarray(rng.standard_normal((5, w.shape[-2])), jnp.float32)
        np.testing.assert_array_equal(np.asarray(layers.linear(x, w, layer)), np.asarray(layers.linear(x, twin, layer)),
                                      err_msg=name)
    h = jnp.asarray(rng.standard_normal((3, D)), jnp.float32)
    twin_sub = panels.pack(q.lm_sub.dequantize(), rows=True)
    np.testing.assert_array_equal(np.asarray(draft_logits(dq, pan.params, pan.config, h)),
                                  np.asarray(draft_logits({"lm_sub": twin_sub}, pan.params, pan.config, h)))
    tree, ddd = TreeConfig(top_k=2, total_tokens=4, depth=2), DDDConfig(check_steps=(1,), threshold=-0.3, max_depth=3)
    ids = [3, 17, 5, 9, 30, 2, 11]
    assert generate(pan, q, ids, 16, method="ddd", tree=tree, ddd=ddd).tokens == generate(pan, None, ids, 16).tokens
