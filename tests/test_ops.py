"""The one door (`ddd_jax.ops`): every packed weight gives through it what its dense array gives (products, rows,
the output rows of an untied head, greedy tokens; the bitwise claims are tests/test_panels.py's and
tests/test_quant.py's), model code never names a backend, and the CPU backend imports nothing above it."""
from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddd_jax import ops
from ddd_jax.backends import Packed
from ddd_jax.backends.cpu import panels, quant
from ddd_jax.layers import greedy_token

ROOT = Path(__file__).resolve().parent.parent / "ddd_jax"


def _rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def test_packed_weights_give_the_dense_products_through_the_door():
    x, w = _rand(3, 64), _rand(64, 40, seed=1)
    dense = np.asarray(ops.matmul(x, w))
    pw = panels.pack(w)
    assert isinstance(pw, Packed)
    np.testing.assert_allclose(np.asarray(ops.matmul(x, pw)), dense, rtol=1e-5, atol=1e-5)
    rows = _rand(50, 64, seed=2)  # an embedding / tied output projection [V, D]
    prow = panels.pack(rows, rows=True, table=True)
    np.testing.assert_allclose(np.asarray(ops.matmul(x, prow, transposed=True)),
                               np.asarray(ops.matmul(x, rows, transposed=True)), rtol=1e-5, atol=1e-5)
    ids = jnp.asarray([[0, 7, 49]])
    np.testing.assert_array_equal(np.asarray(ops.take_rows(prow, ids)), np.asarray(ops.take_rows(rows, ids)))
    with pytest.raises(ValueError, match="layout does not match"):
        ops.matmul(x, pw, transposed=True)


def test_gguf_blocks_give_their_dequantized_weights_products():
    x, w = _rand(2, 64), _rand(64, 32, seed=3)
    bw = quant.quantize(w, "q8_0", transposed=True)  # x @ w, stored as output rows of blocks
    deq = np.asarray(bw.dequantize())
    assert bw.shape == (64, 32)  # the logical [K, N]
    np.testing.assert_allclose(np.asarray(ops.matmul(x, bw)), np.asarray(x) @ deq, rtol=1e-5, atol=1e-5)
    emb = quant.quantize(_rand(40, 64, seed=4), "q4_1")  # an embedding: rows are tokens
    ids = jnp.asarray([1, 5])
    np.testing.assert_array_equal(np.asarray(ops.take_rows(emb, ids)), np.asarray(emb.dequantize())[[1, 5]])
    lm_head = quant.quantize(_rand(64, 40, seed=5), "q8_0", transposed=True)  # untied [D, V]
    out_rows = ops.output_rows(lm_head)
    assert isinstance(out_rows, Packed) and out_rows.shape == (40, 64)


def test_greedy_head_in_one_pass_only_where_the_storage_allows():
    h, rows = _rand(4, 64), _rand(50, 64, seed=6)
    assert ops.greedy_head(h, rows, greedy_token) is None and ops.greedy_tokens(h, rows, greedy_token) is None
    both = ops.greedy_head(h, panels.pack(rows, rows=True), greedy_token)
    logits = ops.matmul(h, rows, transposed=True)
    np.testing.assert_array_equal(np.asarray(both[1]), np.asarray(greedy_token(logits)))


def test_float16_and_packed_weights_stay_as_stored():
    w16 = _rand(8, 8).astype(jnp.float16)
    assert ops.as_stored(w16, jnp.float32) is w16
    assert ops.as_stored(w16, jnp.bfloat16).dtype == jnp.bfloat16
    pw = panels.pack(_rand(8, 8))
    assert ops.as_stored(pw, jnp.bfloat16) is pw


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("rel", ["layers.py", "llama.py", "head_kinds.py", "eagle.py", "eagle1.py", "eagle3.py",
                                 "cache.py", "tree.py", "verify.py", "decode/state.py", "decode/drafting.py",
                                 "decode/cycle.py", "decode/drivers.py", "decode/api.py"])
def test_model_and_decode_code_never_import_a_backend(rel):
    bad = [m for m in _imports(ROOT / rel) if "backends" in m or m.split(".")[-1] in ("kernels", "panels", "quant")]
    assert not bad, f"{rel} imports {bad}: go through ddd_jax.ops"


def test_the_cpu_backend_imports_nothing_above_it():
    for f in (ROOT / "backends" / "cpu").glob("*.py"):
        above = [m for m in _imports(f) if m.startswith("..") and m not in ("..",)]
        assert not above, f"{f.name} imports {above}"
