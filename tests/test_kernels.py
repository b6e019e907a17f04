"""The CPU kernels behind `layers.linear` / `layers.attention`: numerics against XLA, rows that are bit-identical
whatever the number of rows (the property that keeps greedy speculative decoding token-identical to vanilla),
a tree node equal bit for bit to decoding its path one token at a time, and the XLA fallback.

On the XLA path (no kernel) identity is only up to float rounding: XLA's row reductions (rms_norm's mean, the
attention einsums, its GEMMs) change their summation order with the number of rows (from 8 rows on for a
576-wide mean on this CPU), so a token verified in a tree can differ from vanilla in the last bits; token identity
then rests on the argmax having no near-tie (what test_spec checks on real prompts)."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddd_jax import layers, llama
from ddd_jax.backends.cpu import kernels
from ddd_jax.config import ModelConfig

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="CPU kernel library not built / not supported")

CFG = ModelConfig(vocab_size=101, hidden_size=72, intermediate_size=100, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=12, max_position_embeddings=256)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_the_kernel_library_is_built_where_it_can_run():
    """The install never fails on a kernel that does not compile (setup.py falls back to XLA, and `pip -q` hides
    the compiler's error), and every kernel test then skips. So on an x86-64 Linux machine with a C++ compiler and
    AVX2/FMA/F16C, a missing or unloadable library is a failure here, not a silent fallback."""
    import shutil
    if os.environ.get("DDD_JAX_NO_KERNELS", "") not in ("", "0") or os.environ.get("DDD_JAX_KERNELS_LIB"):
        pytest.skip("kernels disabled or replaced through the environment")
    if not sys.platform.startswith("linux") or not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("no x86-64 Linux CPU with AVX2/FMA/F16C")
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler: the install had nothing to build the kernel with")
    assert kernels._library_path() is not None, (
        "ddd_jax/_cpu_kernels*.so is missing: the kernel did not compile at install "
        "(`python setup.py build_ext --inplace` shows the compiler's error)")
    assert kernels.available(), "the kernel library is built but did not load (see the stderr line above)"


def _product(x, w, layer, trans):
    return jax.jit(lambda x, w, l: layers.linear(x, w, l, transposed=trans))(x, w, layer)


@needs_kernel
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("K,N", [(1, 1), (7, 5), (13, 29), (64, 24), (100, 37), (576, 192), (33, 200)])
def test_linear_matches_dot_and_rows_are_m_independent(trans, K, N):
    rng = np.random.default_rng(K * 1000 + N)
    w = jnp.asarray(rng.standard_normal((3, N, K) if trans else (3, K, N)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((17, K)), jnp.float32)
    alone = np.asarray(_product(x[:1], w, 2, trans))
    for M in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17):
        out = np.asarray(_product(x[:M], w, 2, trans))
        w64 = np.asarray(w[2], np.float64)
        ref = np.asarray(x[:M], np.float64) @ (w64.T if trans else w64)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.sqrt(K))
        assert np.array_equal(out[:1], alone), f"row 0 changed with M={M}"
        if M > 1:  # and every other row equals itself computed alone
            assert np.array_equal(out[M - 1], np.asarray(_product(x[M - 1:M], w, 2, trans))[0])


@needs_kernel
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("K,N", [(7, 5), (64, 24), (576, 192), (33, 200)])
def test_float16_weights_are_the_float32_product_of_the_widened_weights(trans, K, N):
    """float16 weights (weight-only storage) through the kernel: bit for bit the float32 kernel's product of the
    same weights widened to float32, for every M and both layouts, and rows still M-independent; the XLA path
    (kernels off) gives the same values to rounding."""
    rng = np.random.default_rng(K + 7 * N)
    w16 = jnp.asarray(rng.standard_normal((3, N, K) if trans else (3, K, N)), jnp.float16)
    w32 = w16.astype(jnp.float32)
    x = jnp.asarray(rng.standard_normal((17, K)), jnp.float32)
    assert kernels.usable(x, w16) and not kernels.usable(x.astype(jnp.float16), w16)
    for M in (1, 2, 3, 4, 5, 8, 17):
        got = np.asarray(_product(x[:M], w16, 2, trans))
        assert got.dtype == np.float32
        assert np.array_equal(got, np.asarray(_product(x[:M], w32, 2, trans))), f"M={M}"
        assert np.array_equal(got[M - 1], np.asarray(_product(x[M - 1:M], w16, 2, trans))[0])
    with kernels.enabled(False):
        xla = np.asarray(jax.jit(lambda x, w: layers.linear(x, w, 2, transposed=trans))(x, w16))
    np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-5 * np.sqrt(K))


@needs_kernel
@pytest.mark.parametrize("trans", [False, True])
def test_kernel_product_past_one_row_group(trans):
    """The kernel walks rows in groups of 128 (its accumulator tile); linear() sends at most MAX_ROWS to it."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((1, 30, 50)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((300, 50 if trans else 30)), jnp.float32)
    got = np.asarray(jax.jit(lambda x, w: kernels.product(x, w, 0, trans))(x, w))
    w64 = np.asarray(w[0], np.float64)
    np.testing.assert_allclose(got, np.asarray(x, np.float64) @ (w64.T if trans else w64), rtol=1e-5, atol=1e-5)
    assert np.array_equal(got[257], np.asarray(jax.jit(lambda x, w: kernels.product(x, w, 0, trans))(x[257:258], w))[0])


@needs_kernel
def test_linear_layer_index_in_scan_and_leading_dims():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((4, 20, 30)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, 20)), jnp.float32)

    def f(x, w):
        return jax.lax.scan(lambda c, i: (c, layers.linear(x, w, i)), 0, jnp.arange(4))[1]

    got = np.asarray(jax.jit(f)(x, w))  # [4, 2, 3, 30]
    ref = np.einsum("abk,lkn->labn", np.asarray(x, np.float64), np.asarray(w, np.float64))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_gradients_through_the_kernels_match_xla():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((5, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 16, 8)), jnp.float32)

    def loss(x, w):
        return jnp.sum(jnp.sin(layers.linear(x, w, 1)) + layers.linear(x, w[0].T, transposed=True))

    with kernels.enabled(True):
        g_k = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    with kernels.enabled(False):
        g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    for a, b in zip(g_k, g_x):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def _attention_inputs(seed, B=2, T=5, S=23, L=3, N=6, K=2, H=12):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((L, B, K, S, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((L, B, K, S, H)), jnp.float32)
    mask = rng.random((B, T, S)) < 0.6
    mask[0, 1] = False  # a fully masked row (XLA: uniform weights over all slots)
    return q, k, v, jnp.asarray(mask)


@needs_kernel
# (S, (T, N, K, H)); S = 150: rows sweep several slot blocks (kSlotBlock = 64)
@pytest.mark.parametrize("S,shape", [(23, (5, 6, 2, 12)), (150, (5, 6, 2, 12)), (150, (8, 9, 3, 64)),
                                     (23, (6, 20, 4, 32))])
def test_attention_matches_xla_and_rows_are_independent(S, shape):
    """Each row of a multi-row call is bitwise the row alone. With H a multiple of 16 and 3+ rows a chunk, AVX-512
    scores put 16 slots in the lanes of a vector (score_rows_lanes) where one row alone takes score8_heads512."""
    T, N, K, H = shape
    q, k, v, mask = _attention_inputs(0, S=S, T=T, N=N, K=K, H=H)
    att = jax.jit(lambda q, k, v, m, l: layers.attention(q, k, v, m, l))
    with kernels.enabled(True):
        got = np.asarray(att(q, k, v, mask, 1))
        rows = [np.asarray(jax.jit(lambda q, k, v, m, l: layers.attention(q, k, v, m, l))(
            q[:, t:t + 1], k, v, mask[:, t:t + 1], 1)) for t in range(q.shape[1])]
    with kernels.enabled(False):
        ref = np.asarray(jax.jit(lambda q, k, v, m, l: layers.attention(q, k, v, m, l))(q, k, v, mask, 1))
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)
    assert np.array_equal(got, np.concatenate(rows, axis=1))


def _chain_vs_tree(params, cfg, prefix, path_tokens, tree_tokens, tree_parent, path_nodes):
    """Logits of the tree nodes `path_nodes` (a root-to-leaf path) from one tree-masked forward, and of the same
    tokens decoded one at a time."""
    n = len(tree_tokens)
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):
        anc[i] |= anc[tree_parent[i]]
    depth = anc.sum(1) - 1
    fwd = jax.jit(lambda p, t, pos, c, m: llama.forward(p, cfg, t, pos, c, attn_mask=m))
    P = len(prefix)
    cache = llama.new_cache(cfg, 1, 64)
    c0 = fwd(params, np.array([prefix], np.int32), np.arange(P)[None], cache, np.tril(np.ones((1, P, P), bool))).cache
    tree = fwd(params, np.array([tree_tokens], np.int32), (P + depth)[None], c0, anc[None])
    seq, c = [], c0
    for j, tok in enumerate(path_tokens):
        o = fwd(params, np.array([[tok]], np.int32), np.array([[P + j]]), c, np.ones((1, 1, 1), bool))
        seq.append(np.asarray(o.logits[0, 0]))
        c = o.cache
    return np.asarray(tree.logits[0])[path_nodes], np.stack(seq)


# tree: root 0; children 1, 2; 1's children 3, 4; 2's child 5; 4's child 6. Path 0 -> 1 -> 4 -> 6.
TREE_TOKENS = [40, 41, 42, 43, 44, 45, 46]
TREE_PARENT = [0, 0, 0, 1, 1, 2, 4]
PATH = [0, 1, 4, 6]


@needs_kernel
def test_tree_node_is_bitwise_its_sequential_decode():
    params = llama.init_params(CFG, jax.random.PRNGKey(0), std=0.1)
    with kernels.enabled(True):
        tree, seq = _chain_vs_tree(params, CFG, [5, 17, 3, 99, 64], [TREE_TOKENS[i] for i in PATH], TREE_TOKENS,
                                   TREE_PARENT, PATH)
    assert np.array_equal(tree, seq)


def test_xla_path_tree_node_close_to_sequential_decode():
    params = llama.init_params(CFG, jax.random.PRNGKey(0), std=0.1)
    with kernels.enabled(False):
        tree, seq = _chain_vs_tree(params, CFG, [5, 17, 3, 99, 64], [TREE_TOKENS[i] for i in PATH], TREE_TOKENS,
                                   TREE_PARENT, PATH)
    np.testing.assert_allclose(tree, seq, atol=1e-5)


@pytest.mark.slow
@needs_kernel
@pytest.mark.deep  # the real SmolLM2 (~24 s; tiny shapes stay): make test-deep
def test_smollm2_rows_bitwise_m_independent_and_close_to_xla():
    import ddd_jax
    target = ddd_jax.load_target("smollm2-135m-instruct")
    cfg = target.config
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, cfg.vocab_size, (1, 40)).astype(np.int32)
    new = rng.integers(0, cfg.vocab_size, (1, 16)).astype(np.int32)

    def run():
        fwd = jax.jit(lambda p, t, pos, c, m: llama.forward(p, cfg, t, pos, c, attn_mask=m))
        c = fwd(target.params, prefix, np.arange(40)[None], llama.new_cache(cfg, 1, 64),
                layers.causal_mask(1, 40)).cache
        return {M: np.asarray(fwd(target.params, new[:, :M], 40 + np.arange(M)[None], c,
                                  layers.causal_mask(1, M)).logits[0]) for M in (1, 2, 8, 16)}

    with kernels.enabled(True):
        k = run()
    for M in (2, 8, 16):
        assert np.array_equal(k[M][0], k[1][0]), f"row 0 at M={M} differs from M=1"
        assert np.array_equal(k[M][1], k[2][1])
    with kernels.enabled(False):
        x = run()
    np.testing.assert_allclose(k[16], x[16], atol=2e-4)
    assert (k[16].argmax(-1) == x[16].argmax(-1)).all()


def _run_python(code: str, **env):
    e = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=600)


FALLBACK = """
import jax, numpy as np
from ddd_jax import llama
from ddd_jax.backends.cpu import kernels
from ddd_jax.config import ModelConfig
cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
p = llama.init_params(cfg, jax.random.PRNGKey(0), std=0.1)
out = llama.forward(p, cfg, np.array([[1, 2, 3]]), np.arange(3)[None], llama.new_cache(cfg, 1, 8))
print("AVAILABLE", kernels.available(), "FINITE", bool(np.isfinite(np.asarray(out.logits)).all()))
"""


@pytest.mark.slow  # a subprocess (~3 s)
def test_disabled_by_env_uses_xla():
    r = _run_python(FALLBACK, DDD_JAX_NO_KERNELS="1")
    assert r.returncode == 0, r.stderr
    assert "AVAILABLE False FINITE True" in r.stdout


@pytest.mark.slow  # a subprocess (~3 s)
def test_missing_library_warns_once_and_uses_xla(tmp_path):
    r = _run_python(FALLBACK, DDD_JAX_KERNELS_LIB=str(tmp_path / "nope.so"))
    assert r.returncode == 0, r.stderr
    assert "AVAILABLE False FINITE True" in r.stdout
    assert r.stderr.count("ddd_jax: CPU kernel library") == 1


PATHS = """
import sys, jax, jax.numpy as jnp, numpy as np
from ddd_jax.backends.cpu import kernels
rng = np.random.default_rng(11)
out = {"avx512": np.array(kernels.avx512())}
for trans in (False, True):
    for K, N in ((576, 1536), (1536, 576), (576, 192), (33, 200), (100, 37)):
        w = jnp.asarray(rng.standard_normal((2, N, K) if trans else (2, K, N)), jnp.float32)
        for M in (3, 5, 8, 13, 64, 100):
            x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
            f = jax.jit(lambda x, w: kernels.product(x, w, 1, trans))
            out[f"{trans}-{K}-{N}-{M}"] = np.asarray(f(x, w))
            out[f"{trans}-{K}-{N}-{M}-f16"] = np.asarray(f(x, w.astype(jnp.float16)))
from ddd_jax.backends.cpu import quant
from ddd_jax.backends.cpu.quant import quantize
for kind in ("q4_1", "q8_0", "q4_0"):  # GGUF blocks: dequantized 16 wide, multiplied two weight rows a vector
    bw = quantize(jnp.asarray(rng.standard_normal((2, 576, 200)), jnp.float32), kind, transposed=True)
    for M in (1, 3, 5, 8, 13):
        x = jnp.asarray(rng.standard_normal((M, 576)), jnp.float32)
        out[f"{kind}-{M}"] = np.asarray(jax.jit(lambda x, b: kernels.product_blocks(x, b, kind, 1))(x, bw.blocks))
    bp = quant.pack_blocks(bw)  # the same blocks panel-major: dequantized in registers up to 24 rows, else into L2
    for M in (1, 2, 3, 8, 9, 16, 70):
        x = jnp.asarray(rng.standard_normal((M, 576)), jnp.float32)
        out[f"qpanels-{kind}-{M}"] = np.asarray(jax.jit(lambda x, d: kernels.product_qpanels(x, d, kind, 200, 1))(
            x, bp.data))
from ddd_jax import layers
for H, N, Kh in ((64, 9, 3), (24, 8, 2), (13, 4, 1), (64, 20, 4)):  # p @ V: 64 dims a vector sweep, 16 / 8 / tails
    for T, S in ((1, 40), (5, 150), (16, 300)):
        q = jnp.asarray(rng.standard_normal((2, T, N, H)), jnp.float32)
        k, v = (jnp.asarray(rng.standard_normal((2, 2, Kh, S, H)), jnp.float32) for _ in range(2))
        mask = jnp.asarray(rng.random((2, T, S)) < 0.7)
        out[f"att-{H}-{N}-{T}-{S}"] = np.asarray(jax.jit(lambda q, k, v, m: layers.attention(q, k, v, m, 1))(
            q, k, v, mask))
from ddd_jax.backends.cpu import panels  # panel-major weights, 48 columns (8 x 48 tiles on AVX-512, two 24-column halves on
# AVX2) and 16 (three-panel tiles below 9 rows, 16-row tiles from 9 on; AVX2: 16-column halves of its tiles)
for width in (48, 16):
    for K, N in ((576, 1536), (1536, 576), (576, 192), (33, 200), (100, 37)):
        w = jnp.asarray(rng.standard_normal((2, K, N)), jnp.float32)
        pw, ph = panels.pack(w, width=width), panels.pack(w.astype(jnp.float16), width=width)  # float16: a head's
        for M in (1, 2, 3, 5, 8, 9, 13, 16, 17, 64, 100):
            x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
            f = jax.jit(lambda x, d: kernels.product_panels(x, d, N, 1))
            out[f"panels{width}-{K}-{N}-{M}"] = np.asarray(f(x, pw.data))
            out[f"panels{width}-{K}-{N}-{M}-f16"] = np.asarray(f(x, ph.data))
np.savez(sys.argv[1], **out)
"""


@needs_kernel
@pytest.mark.skipif(not kernels.avx512(), reason="this CPU has no AVX-512: both runs would take the AVX2 path")
@pytest.mark.slow  # three subprocesses (~12 s); make test runs it
def test_avx512_and_avx2_products_are_bitwise_equal(tmp_path):
    """On AVX-512 CPUs x @ W of 3 to 85 rows (float32 and float16 weights), GGUF blocks (dequantized 16 wide;
    multiplied two weight rows a vector, any number of rows; panel-major, dequantized in registers), panel-major
    weights (float32 and float16, 48- and 16-column panels, every row count) and attention take 16-wide vectors: the
    same fma chains per element, so the same bits as the AVX2 path (DDD_JAX_NO_AVX512=1); skipped where the CPU has
    no AVX-512, as both runs would take AVX2. The AVX-512 path runs twice: with every weight block prefetched into
    L2 (DDD_JAX_L2_PREFETCH_ROWS=1, the AMD default) and into L1 below 64 rows (64): prefetching never changes a
    bit."""
    runs = {}
    for name, no512, l2 in (("avx2", "1", ""), ("avx512-l2", "0", "1"), ("avx512-l1", "0", "64")):
        path = tmp_path / f"{name}.npz"
        r = subprocess.run([sys.executable, "-c", PATHS, str(path)], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "DDD_JAX_NO_AVX512": no512, "DDD_JAX_L2_PREFETCH_ROWS": l2})
        assert r.returncode == 0, r.stderr
        runs[name] = dict(np.load(path))
    assert not runs["avx2"].pop("avx512")  # the switch turns the path off
    for name in ("avx512-l2", "avx512-l1"):
        runs[name].pop("avx512")
        for key, got in runs[name].items():
            assert np.array_equal(got, runs["avx2"][key]), f"{name} and AVX2 products differ at {key}"


def test_panel_tiles_chosen_by_timing_keep_the_bits(tmp_path, monkeypatch):
    """The AVX-512 and AVX2 tiles of a panel product give the same bits at every row count, so timing them and
    keeping the faster per row count (`choose_panel_tiles`, saved per CPU model) is speed only."""
    from ddd_jax.backends.cpu import kernels
    from ddd_jax.backends.cpu.layout import pack_array
    if not kernels.avx512():
        pytest.skip("no AVX-512 paths on this CPU")
    monkeypatch.setenv("DDD_JAX_CACHE", str(tmp_path))
    before = kernels.panel512_rows()
    rng = np.random.default_rng(1)
    K, N = 96, 100
    data = pack_array(jnp.asarray(rng.standard_normal((K, N), np.float32)), 48)
    f = jax.jit(lambda x, d: kernels.product_panels(x, d, N))
    try:
        for m in range(1, 11):
            x = jnp.asarray(rng.standard_normal((m, K), np.float32))
            kernels.set_panel512_rows(0)
            avx2 = np.asarray(f(x, data))
            kernels.set_panel512_rows(2 ** 64 - 1)
            np.testing.assert_array_equal(np.asarray(f(x, data)), avx2)
        got = kernels.choose_panel_tiles(rows=(1, 3), K=96, N=96, layers=2, rounds=1)
        assert got["path"].startswith(str(tmp_path)) and kernels.read_panel_tiles()["panel512_rows"] == \
            got["panel512_rows"] == kernels.panel512_rows()
    finally:
        kernels.set_panel512_rows(before)
