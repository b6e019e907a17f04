"""Integer products over GGUF blocks (`gguf_blocks="int8"`, `quant.BlockPanels.int8`): the kernel against a numpy
model of the same integer arithmetic, bitwise, for every variant this CPU runs; a row's outputs independent of the
other rows (a hypothesis property); closeness to the float32 product; greedy speculative decoding over an int8
target gives its vanilla tokens."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ddd_jax import Target, generate, llama
from ddd_jax.backends.cpu import kernels, quant

gguf = pytest.importorskip("gguf")
from quant_helpers import SMALL, blocks_of, blocks_target  # noqa: E402

KINDS = ("q4_1", "q4_0", "q8_0")
needs_kernel = pytest.mark.skipif(kernels.int8_variant() is None,
                                  reason="CPU kernel library (int8 blocks) not available")


# ----------------------------------------------------------------------------------------------- the numpy model
def model_quantize(x):
    """x [M, K] float32 -> (q [M, nb, 32] int64, d [M, nb] float32, s [M, nb] int64): per 32 values, d = amax / 127,
    q = clip(rint(x / d), -127, 127) computed as x * (1 / d) (rint: half to even)."""
    M, K = x.shape
    xb = x.reshape(M, K // 32, 32).astype(np.float32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int64)
    return q, d, q.sum(-1)


def model_blocks(rows, kind):
    """GGUF rows [N, nb * bytes] -> (integer quants [N, nb, 32] int64 (nibbles 0..15, or int8), d, m [N, nb])."""
    nbytes = quant.KINDS[kind][1]
    b = np.asarray(rows).reshape(rows.shape[0], -1, nbytes)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "q4_1" else np.zeros_like(d)
    if kind == "q8_0":
        q = b[..., 2:34].view(np.int8).astype(np.int64)
    else:
        qs = b[..., 4:20] if kind == "q4_1" else b[..., 2:18]
        q = np.concatenate([qs & 0x0F, qs >> 4], -1).astype(np.int64)
    return q, d, m


def model_product(x, rows, kind):
    """x [M, K] @ the GGUF rows [N, .] as the int8 kernel computes it: exact integer block sums, then per block
    acc = acc + float(isum) * (wd * d), for q4_1 also acc = acc + wm * (d * float(s)), blocks in order."""
    xq, xd, xs = model_quantize(np.asarray(x, np.float32))
    q, wd, wm = model_blocks(rows, kind)
    isum = np.einsum("mbk,nbk->mnb", xq, q)
    if kind == "q4_0":
        isum = isum - 8 * xs[:, None, :]
    ds = (xd * xs.astype(np.float32)).astype(np.float32)
    acc = np.zeros((x.shape[0], rows.shape[0]), np.float32)
    for b in range(q.shape[1]):
        t = wd[None, :, b] * xd[:, b, None]
        acc = acc + isum[:, :, b].astype(np.float32) * t
        if kind == "q4_1":
            acc = acc + wm[None, :, b] * ds[:, b, None]
    return acc


def int8_weight(kind, K, N, seed=0):
    """(GGUF rows [N, .], the same weight as int8 BlockPanels) of a random [K, N] float weight."""
    w = np.random.RandomState(seed).randn(N, K).astype(np.float32) * 0.3
    rows = blocks_of(w, kind)
    return rows, quant.pack_blocks(quant.BlockWeight(jax.numpy.asarray(rows), kind, transposed=True), int8=True)


def product(x, wp):
    return np.asarray(jax.jit(lambda a: wp.product(a))(jax.numpy.asarray(x, np.float32)))


def rows_of(M, K, seed):
    r = np.random.RandomState(seed)
    return (r.randn(M, K) * r.choice([0.01, 1.0, 30.0], (M, 1))).astype(np.float32)


# ----------------------------------------------------------------------------------------------- (a) bitwise model
@needs_kernel
@pytest.mark.parametrize("variant", kernels.INT8_VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_is_the_numpy_model_bitwise(kind, variant):
    if variant not in kernels.int8_variants():
        pytest.skip(f"this CPU (or build) lacks the {variant} variant; it has {kernels.int8_variants()}")
    before = kernels.int8_variant()
    kernels.set_int8_variant(variant)
    try:
        K, N = 96, 100  # three K blocks, three panels (the last partial)
        rows, wp = int8_weight(kind, K, N)
        x = rows_of(7, K, 1)
        x[2] = 0.0  # a zero row: d = 0
        x[3, :32] = 0.5  # a block of equal values: exact halves are not hit, amax is every element
        np.testing.assert_array_equal(product(x, wp), model_product(x, rows, kind))
    finally:
        kernels.set_int8_variant(before)


@pytest.mark.parametrize("kind", KINDS)
def test_xla_path_is_the_numpy_model(kind):
    """Off the kernel (other backends, no library), XLA computes the same arithmetic."""
    K, N = 64, 50
    rows, wp = int8_weight(kind, K, N, seed=3)
    x = rows_of(5, K, 4)
    with kernels.enabled(False):
        got = product(x, wp)
    np.testing.assert_allclose(got, model_product(x, rows, kind), rtol=2e-6, atol=1e-6)  # (XLA may fuse mul + add)


@pytest.mark.parametrize("kind", ["q4_1", pytest.param("q8_0", marks=pytest.mark.slow),  # ~3 s each: test-fast
                                  pytest.param("q4_0", marks=pytest.mark.slow)])     # keeps one kind
def test_int8_panels_hold_the_quants_quad_major_and_give_the_blocks_back(kind):
    """An int8 BlockPanels is the exact panels' bytes with each K block's quants quad-major: byte row j of column c
    at (j // 4, c, j % 4). Its blocks, its lookups and a switch of `int8` either way give the same GGUF bytes."""
    K, N = 64, 100  # two K blocks, a last panel of 4 columns
    rows, wp = int8_weight(kind, K, N, seed=7)
    exact = quant.pack_blocks(quant.BlockWeight(jax.numpy.asarray(rows), kind, transposed=True))
    hdr, nq = quant.panel_header(kind)
    a, b = np.asarray(exact.data), np.asarray(wp.data)
    assert a.shape == b.shape and wp.int8 and not exact.int8
    np.testing.assert_array_equal(b[..., :hdr], a[..., :hdr])  # the float16 scales (and mins) as they were
    quads = a[..., hdr:].reshape(*a.shape[:-1], nq // 4, 4, 48).swapaxes(-1, -2).reshape(*a.shape[:-1], -1)
    np.testing.assert_array_equal(b[..., hdr:], quads)
    j, c = np.meshgrid(np.arange(nq), np.arange(48), indexing="ij")
    np.testing.assert_array_equal(b[..., quant.quant_offset(kind, j, c, True)],
                                  a[..., quant.quant_offset(kind, j, c, False)])
    for w in (wp, quant.pack_blocks(exact, int8=True), wp.T.T):
        np.testing.assert_array_equal(np.asarray(w.blocks().blocks), rows)
    back = quant.pack_blocks(wp, int8=False)
    assert not back.int8
    np.testing.assert_array_equal(np.asarray(back.data), a)
    x = jax.numpy.asarray(rows_of(3, K, 2))  # gradients pass straight through the dequantized weight
    g = jax.grad(lambda x: jax.numpy.sum(jax.numpy.tanh(wp.product(x))))(x)
    dy = 1 - np.tanh(np.asarray(wp.product(x))) ** 2
    np.testing.assert_allclose(np.asarray(g), dy @ np.asarray(wp.dequantize()).T, rtol=1e-4, atol=1e-5)
    emb = quant.BlockWeight(jax.numpy.asarray(rows), kind)  # rows layout: lookups out of the panels themselves
    ids = jax.numpy.asarray([[0, 47, 48], [99, 5, 50]])
    np.testing.assert_array_equal(np.asarray(quant.pack_blocks(emb, int8=True).take(ids)),
                                  np.asarray(quant.take_rows(emb, ids)))


# ----------------------------------------------------------------------------------------------- (b) row invariance
@needs_kernel
@settings(max_examples=12, derandomize=True, deadline=None)
@given(kind=st.sampled_from(KINDS), M=st.integers(1, 64), data=st.data(), seed=st.integers(0, 2 ** 16))
def test_a_rows_outputs_do_not_depend_on_the_other_rows(kind, M, data, seed):
    pos = data.draw(st.integers(0, M - 1), label="pos")
    K, N = 64, 48 * 10 + 7  # enough work for several threads' column chunks from two rows on
    _, wp = int8_weight(kind, K, N, seed=seed % 4)
    x = rows_of(M, K, seed)
    alone = product(x[pos:pos + 1], wp)
    np.testing.assert_array_equal(product(x, wp)[pos:pos + 1], alone)


# ----------------------------------------------------------------------------------------------- grouped products
def stacked_int8(kind, K, N, layers, seed):
    """int8 BlockPanels of `layers` random [K, N] weights stacked on a leading L axis."""
    ws = [int8_weight(kind, K, N, seed=seed + i)[1] for i in range(layers)]
    return dataclasses.replace(ws[0], data=jax.numpy.stack([w.data for w in ws]))


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_kernel),
                                    pytest.param(False, marks=pytest.mark.slow)])  # XLA's path: ~3 s, make test
def test_grouped_products_are_each_product_alone_bitwise(kernel):
    """`ops.matmuls` of one input and several int8 weights (q, k, v; gate, up) -- one kernel call, x quantized once,
    the threads sharing every weight's panels -- gives each weight's own product, bitwise, whatever the kinds and
    widths (a partial last panel), the stacked layer and the row count; and its gradient is the sum of theirs."""
    from ddd_jax import ops
    K = 96
    ws = (stacked_int8("q4_1", K, 100, 2, 0), stacked_int8("q8_0", K, 48, 2, 10), stacked_int8("q4_0", K, 7, 2, 20))
    with kernels.enabled(kernel):
        for M, layer in ((1, 0), (9, 1)):
            x = jax.numpy.asarray(rows_of(M, K, M))
            together = jax.jit(lambda x, i: ops.matmuls(x, ws, i))(x, layer)
            for w, got in zip(ws, together):
                alone = jax.jit(lambda x, i, w=w: ops.matmul(x, w, i))(x, layer)
                assert got.shape == alone.shape
                np.testing.assert_array_equal(np.asarray(got), np.asarray(alone))
        loss = lambda f: lambda x: sum(jax.numpy.sum(jax.numpy.tanh(o)) for o in f(x))  # noqa: E731
        g = jax.grad(loss(lambda x: ops.matmuls(x, ws, 1)))(x)
        g1 = jax.grad(loss(lambda x: [ops.matmul(x, w, 1) for w in ws]))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g1), rtol=1e-5, atol=1e-6)
    assert quant.int8_products(x, ws[:1]) is None  # one weight: the plain product
    assert quant.int8_products(x, (ws[0], quant.pack_blocks(ws[1], int8=False))) is None  # an exact weight: apart


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_kernel),
                                    pytest.param(False, marks=pytest.mark.slow)])
def test_int8_greedy_head_is_the_product_and_its_first_maximum(kernel):
    """An int8 output projection's greedy head (`ops.greedy_head`: one kernel call scanning each column chunk in
    cache) gives the product's logits bitwise and each row's first maximum, ties included (repeated columns)."""
    from ddd_jax import ops
    from ddd_jax.layers import greedy_token
    K, N = 64, 48 * 9 + 5
    w = np.random.RandomState(11).randn(N, K).astype(np.float32) * 0.3
    w[300] = w[7]  # a tie across chunks: the first index wins
    w[8] = w[7]    # and within one
    rows = blocks_of(w, "q8_0")
    emb = quant.pack_blocks(quant.BlockWeight(jax.numpy.asarray(rows), "q8_0"), int8=True)  # tied: output rows
    x = rows_of(6, K, 12)
    x[0] = 5 * w[7]  # row 0's maximum is the tied column 7 (= 8 = 300)
    with kernels.enabled(kernel):
        logits, ids = jax.jit(lambda h: ops.greedy_head(h, emb, greedy_token))(jax.numpy.asarray(x))
        alone = jax.jit(lambda h: ops.matmul(h, emb, transposed=True))(jax.numpy.asarray(x))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(alone))
    np.testing.assert_array_equal(np.asarray(ids), np.argmax(np.asarray(alone), axis=-1))
    assert int(ids[0]) == 7


# ----------------------------------------------------------------------------------------------- (c) closeness
@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_int8_product_is_close_to_the_float_product(kind):
    K, N = 128, 96
    rows, wp = int8_weight(kind, K, N, seed=5)
    x = rows_of(6, K, 6)
    exact = x @ np.asarray(quant.dequantize_blocks(rows, kind)).T
    got = product(x, wp)
    err = np.linalg.norm(got - exact, axis=1) / np.linalg.norm(exact, axis=1)
    assert err.max() < 1e-2, err  # int8 activations: ~1/254 of each block's largest value per element
    assert err.max() > 0  # (not the float path by mistake)


# ----------------------------------------------------------------------------------------------- (d) decoding
@pytest.fixture(scope="module")
def int8_target():
    params = llama.init_params(SMALL, jax.random.PRNGKey(0), std=0.25)
    params["layers"]["wo"] = params["layers"]["wo"] * 0.15
    tb = blocks_target(Target("small", SMALL, params))
    return dataclasses.replace(tb, params=quant.pack_block_params(tb.params, tied=True, int8=True))


def test_int8_target_is_described_and_multiplies_by_integers(int8_target):
    assert quant.describe(int8_target.params) == "gguf blocks q4_1+q8_0 (panels) int8"
    assert quant.has_int8_blocks(int8_target.params)
    assert int8_target.params["embed"].int8  # the tied output projection multiplies by integers too
    assert int8_target.params["embed"].table is not None  # its lookups stay the exact rows
    assert int8_target.params["layers"]["wq"].T.int8


@pytest.mark.parametrize("method", [pytest.param("eagle2", marks=pytest.mark.slow), "ddd"])
def test_speculative_over_int8_blocks_equals_int8_vanilla(int8_target, method):
    """Verified trees (8 rows a sequence, 24 a call) against vanilla's 3 rows a call: the same tokens. (An untrained
    head: few drafts are accepted, but every tree is verified as one batch of rows.)"""
    from ddd_jax import init_draft
    from ddd_jax.config import TreeConfig
    from spec_helpers import prompts
    draft = init_draft(int8_target, seed=1)
    ps = prompts(3, seed=7, vocab=90)
    ref = generate(int8_target, None, ps, max_new_tokens=16)
    got = generate(int8_target, draft, ps, max_new_tokens=16, method=method, sync="device",
                   tree=TreeConfig(top_k=3, total_tokens=8, depth=3))
    assert got.tokens == ref.tokens


@needs_kernel
@pytest.mark.slow  # ~7 s
def test_a_block_head_over_an_int8_target_takes_integer_products(int8_target):
    """A head stored as GGUF blocks (`--draft-dtype q8_0`) bound to an int8 target multiplies every matrix -- fc, the
    layer's, the draft-vocabulary rows -- by the same integer products (each equal to the numpy model's), and DDD
    still decodes int8 vanilla's tokens. A float head keeps its float panels."""
    from ddd_jax import DDDConfig, init_draft
    from ddd_jax.config import TreeConfig
    from ddd_jax.eagle import with_draft_vocab
    from spec_helpers import prompts
    V = int8_target.config.vocab_size
    fl = with_draft_vocab(init_draft(int8_target, seed=1), np.arange(0, V, 2))
    q = fl.astype("q8_0")
    dq = q.decode_params()
    mats = {"fc_w": dq["fc_w"], "lm_sub": dq["lm_sub"],
            **{k: v for k, v in dq["layers"].items() if isinstance(v, quant.BlockPanels)}}
    assert set(mats) == {"fc_w", "lm_sub", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    assert all(w.int8 and w.kind == "q8_0" for w in mats.values())
    float_leaves = jax.tree.leaves(fl.decode_params(), is_leaf=quant.is_block)
    assert not any(isinstance(x, quant.BlockPanels) for x in float_leaves)
    rng = np.random.default_rng(3)
    w, rows = dq["fc_w"], np.asarray(q.params["fc_w"].blocks)  # [out, K] GGUF rows
    x = rng.standard_normal((5, w.shape[-2])).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(w.product(jax.numpy.asarray(x))), model_product(x, rows, "q8_0"))
    ps = prompts(2, seed=5, vocab=90)
    ddd = DDDConfig(check_steps=(1,), threshold=-0.3, max_depth=3)
    got = generate(int8_target, q, ps, max_new_tokens=12, method="ddd", sync="device",
                   tree=TreeConfig(top_k=2, total_tokens=5, depth=2), ddd=ddd)
    assert got.tokens == generate(int8_target, None, ps, max_new_tokens=12).tokens


# ----------------------------------------------------------------------------------------------- variants, flags
@needs_kernel
@pytest.mark.slow  # subprocesses (~5 s)
def test_the_variant_env_var_picks_or_refuses_clearly():
    import os
    import subprocess
    import sys
    code = "from ddd_jax.backends.cpu import kernels; print(kernels.int8_variant())"

    def run(value):
        env = {**os.environ, "DDD_JAX_INT8_VARIANT": value}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)

    for v in kernels.int8_variants():
        r = run(v)
        assert r.returncode == 0 and r.stdout.strip() == v, r.stderr
    lacking = [v for v in kernels.INT8_VARIANTS if v not in kernels.int8_variants()]
    for v in lacking[:1] + ["sse2"]:
        r = run(v)
        assert r.returncode != 0 and f"DDD_JAX_INT8_VARIANT={v}" in r.stderr.replace("'", ""), r.stderr
    with pytest.raises(ValueError, match="unknown int8 variant"):
        kernels.set_int8_variant("sse2")


@pytest.mark.parametrize("argv,value", [([], False), (["--gguf-blocks"], True), (["--gguf-blocks", "int8"], "int8"),
                                        (["--gguf-blocks", "exact"], True)])
def test_every_gguf_blocks_flag_takes_int8(argv, value):
    from ddd_jax.cli import build_parser
    parser = build_parser()
    for cmd in (["generate", "--prompt", "hi"], ["calibrate"], ["bench"], ["tune"], ["peers"]):
        assert parser.parse_args(cmd + argv).gguf_blocks == value, cmd
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "hi", "--gguf-blocks", "int4"])


def test_load_target_checks_gguf_blocks(tmp_path):
    from ddd_jax import load_target
    with pytest.raises(ValueError, match="gguf_blocks must be"):
        load_target("smollm2-135m-instruct", gguf_blocks="int4")
    with pytest.raises(ValueError, match="panels=False"):
        load_target("smollm2-135m-instruct", gguf_blocks="int8", panels=False)


def test_a_gguf_loads_as_int8_blocks_close_to_its_exact_load(tmp_path):
    """`load_target(gguf, gguf_blocks="int8")`: the layer matrices of every kind and the tied output projection
    multiply by integers, and the logits stay close to the exact blocks' (which are the float32 load's)."""
    import warnings
    from gguf.quants import quantize as gguf_quantize
    from ddd_jax import load_target
    from gguf_helpers import finish, gguf_writer, permute
    c, params = SMALL, llama.init_params(SMALL, jax.random.PRNGKey(2), std=0.25)
    types = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q4_1",
             "ffn_up": "Q4_0", "ffn_down": "Q8_0"}
    w = gguf_writer(tmp_path / "q.gguf", "llama", c, c.head_dim)

    def add(name, rows, t):
        if t == "F32":
            return w.add_tensor(name, np.ascontiguousarray(rows, np.float32))
        qt = gguf.GGMLQuantizationType[t]
        w.add_tensor(name, gguf_quantize(np.ascontiguousarray(rows, np.float32), qt), raw_dtype=qt)

    lp = params["layers"]
    add("token_embd.weight", np.asarray(params["embed"]), "Q8_0")
    add("output_norm.weight", np.asarray(params["final_norm"]), "F32")
    for i in range(c.num_hidden_layers):
        for ours, part in (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"), ("wo", "attn_output"),
                           ("w_gate", "ffn_gate"), ("w_up", "ffn_up"), ("w_down", "ffn_down")):
            rows = np.asarray(lp[ours][i]).T
            rows = permute(rows, c.num_attention_heads) if part == "attn_q" else rows
            rows = permute(rows, c.num_key_value_heads) if part == "attn_k" else rows
            add(f"blk.{i}.{part}.weight", rows, types[part])
        add(f"blk.{i}.attn_norm.weight", np.asarray(lp["attn_norm"][i]), "F32")
        add(f"blk.{i}.ffn_norm.weight", np.asarray(lp["mlp_norm"][i]), "F32")
    f = finish(w, tmp_path / "q.gguf")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tokenizer")  # a weights-only GGUF
        exact, int8 = load_target(f, gguf_blocks=True), load_target(f, gguf_blocks="int8")
    lq = int8.params["layers"]
    assert all(isinstance(lq[k], quant.BlockPanels) and lq[k].int8 for k in ("wq", "wk", "wv", "wo", "w_gate",
                                                                             "w_up", "w_down"))
    assert {lq[k].kind for k in ("wq", "wk", "wv")} == {"q4_0", "q4_1", "q8_0"}
    assert not exact.params["layers"]["wq"].int8 and not exact.params["embed"].int8 and int8.params["embed"].int8
    toks = np.random.RandomState(1).randint(0, 90, (1, 9)).astype(np.int32)
    pos = np.arange(9)[None]
    a, b = np.asarray(exact.forward(toks, pos).logits), np.asarray(int8.forward(toks, pos).logits)
    assert 0 < np.linalg.norm(b - a) / np.linalg.norm(a) < 3e-2
