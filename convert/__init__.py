"""Checkpoint conversion front-ends (`ddd-jax convert ...`); the logic lives in ddd_jax.checkpoints."""
