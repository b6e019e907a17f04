"""The CPU backend behind `ddd_jax.ops`: FFI kernels (`kernels`, C++ in csrc/), panel-major float weights
(`panels`), GGUF blocks kept as weights (`quant`), huge pages for weight buffers (`hugepages`), and `pack`, the
one place where a loaded model's weights are laid out for these kernels."""
