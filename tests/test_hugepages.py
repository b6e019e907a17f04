"""Huge pages for weight buffers (ddd_jax.backends.cpu.hugepages): the aligned ranges, the opt-out, and the pages themselves."""
import jax.numpy as jnp
import numpy as np
import pytest

from ddd_jax.backends.cpu import hugepages as hp

MiB = 1 << 20


def test_aligned_range_is_the_whole_huge_pages_inside_the_buffer():
    assert hp.aligned_range(0, 8 * MiB) == (0, 8 * MiB)
    assert hp.aligned_range(1, 8 * MiB) == (2 * MiB, 8 * MiB)
    assert hp.aligned_range(2 * MiB - 64, 128) == (2 * MiB, 2 * MiB)  # empty: no whole page inside
    assert hp.aligned_range(3 * MiB, 5 * MiB) == (4 * MiB, 8 * MiB)


def test_opt_out_and_small_buffers_touch_nothing(monkeypatch):
    big = jnp.ones((3 * MiB,), jnp.float32)  # 12 MiB
    monkeypatch.setenv("DDD_JAX_NO_HUGE_PAGES", "1")
    r = hp.collapse({"w": big})
    assert (r.buffers, r.collapsed, r.bytes) == (0, 0, 0) and "DDD_JAX_NO_HUGE_PAGES" in r.skipped
    monkeypatch.delenv("DDD_JAX_NO_HUGE_PAGES")
    r = hp.collapse({"w": jnp.ones((1024,), jnp.float32), "n": np.ones(8 * MiB, np.uint8)})  # small; not a jax.Array
    assert (r.buffers, r.collapsed) == (0, 0) and r.skipped is not None


def test_collapse_puts_a_large_buffer_on_huge_pages_and_keeps_its_values():
    if hp.thp_mode() in (None, "never"):
        pytest.skip(f"transparent huge pages: {hp.thp_mode()}")
    x = jnp.arange(6 * MiB, dtype=jnp.float32)  # 24 MiB: at least 10 whole huge pages inside
    ptr = x.unsafe_buffer_pointer()
    r = hp.collapse({"a": x, "b": [x]})  # the same buffer twice counts once
    if r.error in ("EINVAL", "EPERM", "ENOSYS"):
        pytest.skip(f"MADV_COLLAPSE is not available here ({r.error})")
    assert (r.buffers, r.collapsed) == (1, 1), r
    lo, hi = hp.aligned_range(ptr, x.nbytes)
    assert r.bytes == hi - lo >= 10 * 2 * MiB
    # madvise split the mappings at lo and hi; earlier ones may have split the range too, and the mappings may
    # hold other huge pages beside it
    assert hp.huge_page_bytes(lo, hi) >= hi - lo
    np.testing.assert_array_equal(np.asarray(x), np.arange(6 * MiB, dtype=np.float32))
