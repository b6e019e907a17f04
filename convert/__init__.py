"""Checkpoint conversion front-ends (`ddd-jax convert ...`); the logic lives in ddd_jax.loading / ddd_jax.eagle_convert."""
