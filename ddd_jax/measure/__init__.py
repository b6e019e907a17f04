"""What calibration, the settings it saves and the benchmarks all measure, below each of them.

`cost.cost_curve`: this device's seconds for a verify forward per width and batch and for a draft step (on the
target's own decoded tokens); `acceptance.measure_runs`: τ, DDD's depths and the verified widths of decoding
runs over many prompts, batched and checked token for token against vanilla; `node_acceptance`: every drafted node
labelled from vanilla's replies (the gain rule's calibration table, and a replay of any stop rule over them);
`prompts`: MT-bench's questions and how a turn is rendered. No timing of whole generations here: that is
`ddd_jax.bench`.
"""
