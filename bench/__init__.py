"""Benchmarks and tuning for ddd-jax: MT-bench speed / acceptance runs, DDD sweeps, cost curves, settings search.

Library entry points (the CLI in `bench.cli` is a thin front over these):
`bench.run.run_benchmark`, `bench.run.check_identity`, `bench.tune.tune`, `bench.cost.cost_curve`,
`bench.mtbench.load_questions`, `bench.report` (JSON / Markdown), `bench.plots` (PNG).
"""
