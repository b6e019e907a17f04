"""ddd-jax: lossless speculative decoding (EAGLE-2 trees, Dynamic Depth Decoding) in JAX."""
