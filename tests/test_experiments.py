"""The one-off harnesses of experiments/ (kernel_ab, attention_ab and its C++ harness, int8_emulation,
recipe_memory): bad input is refused, the harness built from this checkout runs the kernel, the fit steps' memory is
sized."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))


def test_kernel_ab_rejects_bad_input(tmp_path):
    import kernel_ab
    with pytest.raises(SystemExit, match="at least two builds"):
        kernel_ab.main(["HEAD"])
    with pytest.raises(SystemExit, match="must be integers"):
        kernel_ab.main(["HEAD", "HEAD", "--sizes", "1,x"])
    with pytest.raises(SystemExit, match="at most 512"):
        kernel_ab.main(["HEAD", "HEAD", "--sizes", "300", "--context", "256"])
    with pytest.raises(SystemExit, match="no library"):
        kernel_ab.build(str(tmp_path / "missing.so"), str(tmp_path))
    with pytest.raises(SystemExit, match="has no kernel source"):
        kernel_ab.build("no-such-revision-xyz", str(tmp_path))


def test_attention_ab_rejects_bad_input(tmp_path):
    import attention_ab
    with pytest.raises(SystemExit, match="at least two builds"):
        attention_ab.main(["HEAD"])
    with pytest.raises(SystemExit, match="must be integers"):
        attention_ab.main(["HEAD", "HEAD", "--sizes", "1,x"])
    with pytest.raises(SystemExit, match=r"in \[1, 256\]"):
        attention_ab.main(["HEAD", "HEAD", "--sizes", "0"])
    with pytest.raises(SystemExit, match="at least 1"):
        attention_ab.main(["HEAD", "HEAD", "--rounds", "0"])
    with pytest.raises(SystemExit, match="no kernel source"):
        attention_ab.build(str(tmp_path / "missing.cc"), str(tmp_path))
    with pytest.raises(SystemExit, match="has no kernel source"):
        attention_ab.build("no-such-revision-xyz", str(tmp_path))


@pytest.mark.deep  # builds and runs the C++ harness: make test-deep
def test_attention_harness_runs_the_kernel_and_its_bits_follow_the_rows(tmp_path):
    """The harness built from this checkout's kernels: both modes run, and the output's checksum is the same
    whatever the thread count (the chunking splits rows between threads; every row's bits are its own); "l2"
    attends one layer's keys and values, "stream" all 30 (the output is the last layer's)."""
    from ddd_jax.backends.cpu import kernels
    import attention_ab
    if not kernels.available():
        pytest.skip("CPU kernel library not built / not supported")
    exe = attention_ab.build(str(attention_ab.ROOT / "ddd_jax" / "backends" / "cpu" / "csrc" / "cpu_kernels.cc"), str(tmp_path))
    for mode in ("l2", "stream"):
        one, two = (attention_ab.run(exe, 7, mode, 2, threads) for threads in (1, 2))
        assert one["us"] > 0 and two["us"] > 0
        assert one["checksum"] == two["checksum"]
    assert attention_ab.run(exe, 7, "l2", 1, 1)["checksum"] != two["checksum"]  # other layers' keys and values


@pytest.mark.slow  # ~9 s
def test_recipe_memory_sizes_both_fit_steps_and_grows_with_the_batch():
    """The fit steps compile from abstract inputs alone, and what XLA holds for them grows with the batch."""
    import dataclasses
    import recipe_memory
    from test_eagle3 import tiny3
    from train_draft.eagle3_fit import Fit3Config
    from train_draft.train import FitConfig
    t = tiny3()
    e3 = Fit3Config(batch_size=1, seq_len=64, ttt_steps=3, draft_vocab_size=32)
    one, two = (recipe_memory.step_memory(t, dataclasses.replace(e3, batch_size=b)) for b in (1, 2))
    assert one["head"] == "eagle3" and one["ttt_steps"] == 3
    assert 0 < one["temp_bytes"] < two["temp_bytes"]
    e1 = recipe_memory.step_memory_eagle1(t, FitConfig(batch_size=2, seq_len=64))
    assert e1["head"] == "eagle" and e1["temp_bytes"] > 0


@pytest.mark.deep  # builds the kernels into the C++ harness (~70 s): make test-deep
def test_int8_emulation_checks_the_vnni_variants_against_avx2_and_catches_a_wrong_shift(tmp_path):
    """On any AVX2 CPU the harness runs the AVX-512 VNNI and AVX-VNNI tiles with emulated intrinsics: this checkout's
    kernels match the AVX2 variant bitwise, and a kernel whose AVX-512 tile shifts the high nibbles by 3 does not."""
    from ddd_jax.backends.cpu import kernels
    import int8_emulation
    if not kernels.available():
        pytest.skip("CPU kernel library not built / not supported")
    good = int8_emulation.run(int8_emulation.build(str(int8_emulation.KERNELS), str(tmp_path)))
    assert good["checks"] == 171 and good["mismatches"] == 0, good["stderr"]
    src = int8_emulation.KERNELS.read_text()
    tile = src.index("DDD_AVX512VNNI void i8_tile_avx512vnni")
    shift = src.index("_mm512_srli_epi16(raw, 4)", tile)
    bad = tmp_path / "bad" / "cpu_kernels.cc"
    bad.parent.mkdir()
    bad.write_text(src[:shift] + "_mm512_srli_epi16(raw, 3)" + src[shift + len("_mm512_srli_epi16(raw, 4)"):])
    wrong = int8_emulation.run(int8_emulation.build(str(bad), str(bad.parent)))
    assert wrong["mismatches"] > 0 and "variant 2" in wrong["stderr"] and "variant 1" not in wrong["stderr"]
