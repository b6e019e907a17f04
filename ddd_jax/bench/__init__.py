"""Benchmarks and tuning for ddd-jax: MT-bench speed / acceptance runs, DDD sweeps, cost curves, settings search.

Installed as `ddd_jax.bench`. Library entry points (the CLI in `cli` is a thin front over these):
`run.run_benchmark`, `run.check_identity`, `tune.tune`, `mtbench.load_questions`,
`report` (JSON / Markdown), `plots` (PNG).
"""
