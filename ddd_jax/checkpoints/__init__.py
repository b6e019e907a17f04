"""Checkpoint formats: key tables, safetensors, HF / GGUF targets, official EAGLE heads, our formats, named assets.

Deliberately empty: import the module you need (`ddd_jax.checkpoints.loading` for `load_target` / `load_draft`).
"""
