"""How much device memory the recipe's EAGLE-3 fit step holds at its full size, from XLA's buffer assignment, without
running it: the training-time-test step (B x L packed tokens, K unrolled head steps, the frozen target's forward
inside) lowered with abstract inputs and compiled for this machine's backend. Run on the CPU, it sizes the step a
GPU loan would run before the loan is spent finding out (GPU buffer assignment differs in detail, not in scale).

    python experiments/recipe_memory.py [--target smollm2-135m-instruct] [--batch-size 8] [--seq-len 1024]
                                        [--ttt-steps 7] [--dtype bfloat16]

Prints one JSON line: the sizes and XLA's argument / output / temporary bytes, in GiB.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ddd_jax import eagle3, load_target  # noqa: E402
from train_draft.eagle3_fit import _trainable, eagle3_config, make_optimizer, make_step  # noqa: E402
from train_draft.recipe import RecipeConfig  # noqa: E402


def step_memory(target, cfg) -> dict:
    """XLA's memory analysis of one compiled EAGLE-3 fit step of `cfg` (a Fit3Config) over `target`."""
    dcfg = eagle3_config(target, cfg.draft_vocab_size)
    tx = make_optimizer(cfg)
    params = jax.eval_shape(lambda: _trainable(eagle3.init_params(dcfg, jax.random.PRNGKey(0), jnp.float32)))
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params), "step": jax.ShapeDtypeStruct((), jnp.int32)}
    tparams = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), target.params)
    B, L = cfg.batch_size, cfg.seq_len
    i32 = jax.ShapeDtypeStruct((B, L), jnp.int32)
    args = (state, jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((cfg.draft_vocab_size,), jnp.int32),
            tparams, i32, jax.ShapeDtypeStruct((B, L), jnp.float32), i32, i32)
    t0 = time.time()
    compiled = make_step(dcfg, cfg, target.config, tx).lower(*args).compile()
    m = compiled.memory_analysis()
    gib = 2.0 ** -30
    return {"batch_size": B, "seq_len": L, "ttt_steps": cfg.ttt_steps, "dtype": cfg.dtype,
            "draft_vocab_size": cfg.draft_vocab_size, "backend": jax.default_backend(),
            "compile_s": round(time.time() - t0, 1),
            "argument_gib": round(m.argument_size_in_bytes * gib, 2),
            "output_gib": round(m.output_size_in_bytes * gib, 2),
            "temp_gib": round(m.temp_size_in_bytes * gib, 2),
            "peak_gib_upper": round((m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes) * gib, 2)}


def main(argv=None) -> int:
    base = RecipeConfig().eagle3
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--batch-size", type=int, default=base.batch_size)
    ap.add_argument("--seq-len", type=int, default=base.seq_len)
    ap.add_argument("--ttt-steps", type=int, default=base.ttt_steps)
    ap.add_argument("--dtype", default=base.dtype)
    a = ap.parse_args(argv)
    os.environ.setdefault("DDD_JAX_NO_KERNELS", "1")  # the GPU run's path: XLA's products, no CPU kernels
    target = load_target(a.target, panels=False)
    cfg = dataclasses.replace(base, batch_size=a.batch_size, seq_len=a.seq_len, ttt_steps=a.ttt_steps, dtype=a.dtype)
    print(json.dumps({"target": target.name, **step_memory(target, cfg)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
