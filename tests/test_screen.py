"""The screened greedy lm_head (`kernels.greedy_screened`, `panels.screen_of`): an int8 copy of the output
projection screens the vocabulary (in bfloat16 arithmetic), every column that could still be a row's maximum is recomputed exactly, so the
token is the exact product's first maximum -- checked against `greedy_token` of the exact product on random and on
adversarial (near-tied) weights, non-finite rows, both panel widths and both layouts, the kernel's exact fallback
and XLA's path; and the bound is shown to matter (a zero bound gives wrong tokens on the same data)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ddd_jax import llama
from ddd_jax.backends.cpu import kernels, panels
from ddd_jax.config import ModelConfig
from ddd_jax.verify import greedy_token

needs_screen = pytest.mark.skipif(not kernels.screen(), reason="no AVX-512 BF16 here (the screen's fallback is "
                                  "the exact kernel, tested by test_panels)")


def _exact(x, pw):
    return np.asarray(greedy_token(kernels.product_panels(jnp.asarray(x), pw.data, pw.n)))


def _screened(x, pw, bound=None):
    f = jax.jit(lambda a, b: kernels.greedy_screened(a, pw.data, pw.n, pw.screen, b, greedy_token))
    return np.asarray(f(jnp.asarray(x), pw.screen_bound if bound is None else bound))


def _bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _int8(w, s=None):
    """The screen's copy of rows w [N, K]: (q int8 values as float, the scales s, w^ = s q), as `screen_of` makes it
    (s: its scales, max |w| / 127 to within an ulp)."""
    w = np.asarray(w, np.float32)
    s = (np.abs(w).max(axis=1) / np.float32(127.0)).astype(np.float32) if s is None else np.asarray(s, np.float32)
    q = np.clip(np.round(w / np.where(s > 0, s, 1)[:, None]), -127, 127)
    return q, s, (q * s[:, None]).astype(np.float64)


def _near_tied(rng, N, K, rel):
    """N rows, all one random row plus noise of relative size `rel` (an int8 step is ~1/127 of a row's largest)."""
    w0 = rng.standard_normal(K).astype(np.float32)
    return (w0[None] * (1 + rel * rng.standard_normal((N, K)))).astype(np.float32), w0


def test_screen_of_layout_and_bound_hold():
    """screen_of: [ceil(N / 48), ceil(K / 2), 96] int8 holding each row's q = round(w / s) (k in pairs, zeros past N
    and K), s = max |w| / 127, and bounds A, B with |x . w - x~ . w^| <= |x| A + |x - x~| B for float64 products
    (x~: x in bfloat16; the kernel adds its float32 summation errors on top)."""
    rng = np.random.default_rng(0)
    N, K = 101, 37
    w = rng.standard_normal((N, K)).astype(np.float32)
    w[4] = 0.0  # a zero row: scale 0, q 0
    scr, bound = panels.screen_of(w)
    assert scr.shape == (3, 19, 96) and scr.dtype == jnp.int8 and bound.shape == (3, N)
    qs = np.asarray(scr, np.float64).reshape(3, 19, 48, 2).transpose(0, 2, 1, 3).reshape(144, 38)
    A, B, S = np.asarray(bound, np.float64)
    np.testing.assert_allclose(S, np.abs(w).max(axis=1) / 127.0, rtol=1e-6)
    q, _, wh = _int8(w, S)
    np.testing.assert_array_equal(qs[:N, :K], q)
    assert not qs[N:].any() and not qs[:, K:].any()
    assert S[4] == 0 and not qs[4].any()
    x = rng.standard_normal((50, K))
    xt = _bf16(x).astype(np.float64)
    err = np.abs(x @ w.T.astype(np.float64) - xt @ wh.T)
    lim = np.linalg.norm(x, axis=1)[:, None] * A[None] + np.linalg.norm(x - xt, axis=1)[:, None] * B[None]
    assert (err <= lim).all()
    # x along a row's rounding error (x~ taken as x): Cauchy-Schwarz is nearly tight there
    d = w.astype(np.float64) - wh
    x = d * 2.0 ** 12
    err = np.abs(np.einsum("nk,nk->n", x, w.astype(np.float64)) - np.einsum("nk,nk->n", x, wh))
    nx = np.linalg.norm(x, axis=1)
    assert (err <= nx * A).all()
    assert (err >= 0.9 * nx * np.linalg.norm(d, axis=1)).all()  # the bound's term is needed
    nw = np.linalg.norm(w.astype(np.float64), axis=1)
    want_a = panels.screen_gamma(K) * nw + np.linalg.norm(d, axis=1)
    want_b = np.linalg.norm(wh, axis=1)
    assert (A >= want_a).all() and (B >= want_b).all()
    np.testing.assert_allclose(A, want_a, rtol=2e-3, atol=1e-7)  # inflated by 1e-3 for float32 sums
    np.testing.assert_allclose(B, want_b, rtol=2e-3)
    w[7, 2] = np.inf
    w[9, 0] = 3e7
    w[11] = 1e-39  # tiny: its squares and scale would underflow
    _, bound = panels.screen_of(w)
    assert np.isinf(np.asarray(bound)[0, [7, 9, 11]]).all() and np.isfinite(np.asarray(bound)[0, :7]).all()


@needs_screen
@pytest.mark.parametrize("rows,width", [(True, 48), (True, 16), (False, 48)])
def test_screened_tokens_are_the_exact_first_maximum(rows, width):
    """Random weights (padded last panel), 1 to 70 rows: the screened kernel's tokens are `greedy_token` of the
    exact panel product, for a tied embedding's rows layout and an untied [K, N] lm_head, either panel width."""
    rng = np.random.default_rng(1)
    N, K = 1000, 96
    w = rng.standard_normal((N, K)).astype(np.float32)
    pw = panels.pack(jnp.asarray(w if rows else w.T), rows=rows, width=width)
    pw = panels.with_screen(pw)
    for M in (1, 2, 3, 8, 9, 16, 17, 70):
        x = (3 * rng.standard_normal((M, K))).astype(np.float32)
        np.testing.assert_array_equal(_screened(x, pw), _exact(x, pw), err_msg=f"M={M}")
    x3 = jnp.asarray(rng.standard_normal((2, 3, K)), jnp.float32)  # leading dims kept
    ids = kernels.greedy_screened(x3, pw.data, pw.n, pw.screen, pw.screen_bound, greedy_token)
    assert ids.shape == (2, 3) and ids.dtype == jnp.int32


@needs_screen
def test_near_ties_are_recomputed_and_the_bound_matters():
    """Rows that differ below the int8 copy's resolution: the screen alone orders them wrongly, the screened kernel
    recomputes every candidate and answers the exact first maximum, exact ties included; with a zero bound (a
    broken certificate) the same kernel answers wrongly -- so this test can fail. Rows the copy holds exactly, where
    the whole error is x's rounding to bfloat16, need the bound's |x - x~| term. 5,000 near-tied rows (more
    candidates than the kernel takes) fall back to the exact kernel, with the same answer."""
    rng = np.random.default_rng(2)
    N, K = 600, 64
    w, w0 = _near_tied(rng, N, K, 2e-3)
    x = (w0 + 0.01 * rng.standard_normal((40, K))).astype(np.float32)
    top = int(np.argmax(x[0].astype(np.float64) @ w.T.astype(np.float64)))
    w[5 if top > 5 else N - 1] = w[top]  # an exact tie for row 0: the same weights, the same bits: the first wins
    pw = panels.with_screen(panels.pack(jnp.asarray(w), rows=True, table=True))
    exact = _exact(x, pw)
    assert exact[0] == min(5, top)
    naive = np.argmax(_bf16(x).astype(np.float64) @ _int8(w)[2].T, axis=1)
    assert (naive != exact).any(), "the data must fool the int8 screen alone"
    np.testing.assert_array_equal(_screened(x, pw), exact)
    zero = jnp.zeros_like(pw.screen_bound).at[2].set(pw.screen_bound[2])  # the scales kept, the bounds zero
    assert (_screened(x, pw, zero) != exact).any(), "a zero bound must be caught"
    # rows the copy holds exactly (integers up to 127: scale 1): a zero row (logit 0) and a row d with
    # x~ . d < 0 < x . d -- d along the sign of x - x~, then brought just below zero on x~ in integer steps -- and
    # rows far below; coordinate 0 of x is zero and holds d's 127
    x = rng.standard_normal((1, K)).astype(np.float32)
    x[0, 0] = 0.0
    xt = _bf16(x)[0].astype(np.float64)
    r = x[0].astype(np.float64) - xt
    d = np.where(r > 0, 100.0, -100.0)
    d[0] = 127.0
    target = -0.25 * (r @ d)
    for j in np.argsort(-np.abs(xt))[:-1]:  # the largest |x~| first, so the last steps are the finest
        d[j] = np.clip(d[j] + np.round((target - xt @ d) / xt[j]), -127, 127)
    rows = np.concatenate([np.zeros((1, K)), d[None], -np.linspace(0.1, 1, 50)[:, None] * xt]).astype(np.float32)
    assert np.array_equal(_int8(rows[:2])[2], rows[:2]), "rows 0 and 1 must be exact in the copy"
    assert xt @ d < 0 < x[0].astype(np.float64) @ d
    pw = panels.with_screen(panels.pack(jnp.asarray(rows), rows=True, table=True))
    assert _exact(x, pw)[0] == 1 and np.argmax(xt @ _int8(rows)[2].T) == 0
    np.testing.assert_array_equal(_screened(x, pw), [1])
    w, w0 = _near_tied(rng, 5000, K, 1e-5)
    pw = panels.with_screen(panels.pack(jnp.asarray(w), rows=True))
    x = (w0 + 0.01 * rng.standard_normal((3, K))).astype(np.float32)
    np.testing.assert_array_equal(_screened(x, pw), _exact(x, pw))


@pytest.mark.parametrize("path", ["kernel", "kernel-exact", "xla"])
def test_non_finite_and_huge_rows_and_every_path(path):
    """A NaN row gives N - 1 (as `greedy_token`), a column of inf weights and a row with |x| > 1e30 (the kernel's
    exact fallback) are answered exactly; the kernel with its screen off (`set_screen(False)`) and XLA's path (no
    kernel) give the same tokens."""
    if path != "xla" and not kernels.available():
        pytest.skip("CPU kernel library not built / not supported")
    rng = np.random.default_rng(3)
    N, K = 300, 48
    w = rng.standard_normal((N, K)).astype(np.float32)
    pw = panels.with_screen(panels.pack(jnp.asarray(w), rows=True, table=True))
    x = rng.standard_normal((4, K)).astype(np.float32)
    x[1, 7] = np.nan
    big = x.copy()
    big[2] *= 1e31 / np.linalg.norm(big[2])
    w_inf = w.copy()
    w_inf[123, 4] = np.inf
    pw_inf = panels.with_screen(panels.pack(jnp.asarray(w_inf), rows=True, table=True))
    try:
        if path == "kernel-exact":
            kernels.set_screen(False)
        with kernels.enabled(path != "xla"):
            for p, a in ((pw, x), (pw, big), (pw_inf, np.nan_to_num(x))):
                got = _screened(a, p)
                with kernels.enabled(False):
                    ref = np.asarray(greedy_token(jnp.asarray(a) @ p.unpack().T))
                np.testing.assert_array_equal(got, ref)
    finally:
        kernels.set_screen(True)
    assert _screened(x, pw)[1] == N - 1


@pytest.mark.parametrize("tie", [True, False])
def test_pack_params_screens_the_output_projection_where_it_runs(tie):
    """pack_params gives the output projection (tied embedding or untied lm_head) a screen when the kernel runs it
    (or screen=True), none with screen=False; the layers never get one."""
    cfg = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tie)
    params = llama.init_params(cfg, jax.random.key(0))
    key = "embed" if tie else "lm_head"
    p = panels.pack_params(params)
    assert (p[key].screen is not None) == kernels.screen()
    assert panels.pack_params(params, screen=True)[key].screen.shape == (3, 16, 96)
    assert panels.pack_params(params, screen=True)[key].screen_bound.shape == (3, 97)
    assert panels.pack_params(params, screen=False)[key].screen is None
    assert all(v.screen is None for v in p["layers"].values() if panels.is_panels(v))


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.slow  # ~15 s each
def test_greedy_forward_returns_tokens_only_and_generate_is_unchanged(tie):
    """forward(greedy=True, return_logits=False): Output.logits is None and Output.greedy is `greedy_token` of the
    full forward's logits; greedy decoding (vanilla and DDD) over a screened target gives the tokens of the same
    target without a screen and of its row-major params."""
    from ddd_jax import generate, init_draft
    from ddd_jax.target import Target
    cfg = ModelConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=tie)
    params = llama.init_params(cfg, jax.random.key(4))
    toks = jax.random.randint(jax.random.key(5), (2, 9), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    screened = panels.pack_params(params, screen=True)
    full = llama.forward(params, cfg, toks, pos)
    only = llama.forward(screened, cfg, toks, pos, return_logits=False, greedy=True)
    assert only.logits is None
    np.testing.assert_array_equal(np.asarray(only.greedy), np.asarray(greedy_token(full.logits)))
    prompt = [int(t) for t in toks[0]]
    outs = {}
    for name, p in (("row-major", params), ("screened", screened), ("exact", panels.pack_params(params, screen=False))):
        t = Target("tiny", cfg, p)
        draft = init_draft(t, seed=6)
        outs[name] = [generate(t, draft, prompt, max_new_tokens=24, method=m, sync="device").tokens
                      for m in ("vanilla", "ddd")]
    assert outs["screened"] == outs["exact"] == outs["row-major"]
