"""How much device memory the recipe's fit steps hold at their full size, from XLA's buffer assignment, without
running them: the EAGLE-3 training-time-test step (B x L packed tokens, K unrolled head steps, the frozen target's
forward inside) and the EAGLE-1/2 step (precomputed features), lowered with abstract inputs and compiled for this
machine's backend. Run on the CPU, it sizes the steps a GPU loan would run before the loan is spent finding out
(GPU buffer assignment differs in detail, not in scale).

    python experiments/recipe_memory.py [--target smollm2-135m-instruct] [--head eagle3|eagle] [--batch-size B]
                                        [--seq-len L] [--ttt-steps 7] [--dtype bfloat16]

Prints one JSON line: the sizes and XLA's argument / output / temporary bytes, in GiB (defaults: the recipe's).
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
from ddd_jax.config import DraftConfig  # noqa: E402
from train_draft import train  # noqa: E402
from train_draft.eagle3_fit import _trainable, eagle3_config, make_optimizer, make_step  # noqa: E402
from train_draft.recipe import RecipeConfig  # noqa: E402

GIB = 2.0 ** -30


def _report(compiled, t0: float, **sizes) -> dict:
    m = compiled.memory_analysis()
    return {**sizes, "backend": jax.default_backend(), "compile_s": round(time.time() - t0, 1),
            "argument_gib": round(m.argument_size_in_bytes * GIB, 2),
            "output_gib": round(m.output_size_in_bytes * GIB, 2),
            "temp_gib": round(m.temp_size_in_bytes * GIB, 2), "temp_bytes": int(m.temp_size_in_bytes),
            "peak_gib_upper": round((m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes) * GIB,
                                    2)}


def step_memory(target, cfg) -> dict:
    """XLA's memory analysis of one compiled EAGLE-3 fit step of `cfg` (a Fit3Config) over `target`."""
    dcfg = eagle3_config(target, cfg.draft_vocab_size)
    tx = make_optimizer(cfg)
    params = jax.eval_shape(lambda: _trainable(eagle3.init_params(dcfg, jax.random.PRNGKey(0), jnp.float32)))
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params),
             "step": jax.ShapeDtypeStruct((), jnp.int32)}
    tparams = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), target.params)
    B, L = cfg.batch_size, cfg.seq_len
    i32 = jax.ShapeDtypeStruct((B, L), jnp.int32)
    args = (state, jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((cfg.draft_vocab_size,), jnp.int32),
            tparams, i32, jax.ShapeDtypeStruct((B, L), jnp.float32), i32, i32)
    t0 = time.time()
    compiled = make_step(dcfg, cfg, target.config, tx).lower(*args).compile()
    return _report(compiled, t0, head="eagle3", batch_size=B, seq_len=L, ttt_steps=cfg.ttt_steps, dtype=cfg.dtype,
                   draft_vocab_size=cfg.draft_vocab_size)


def step_memory_eagle1(target, cfg) -> dict:
    """XLA's memory analysis of one compiled EAGLE-1/2 fit step of `cfg` (a FitConfig) over `target`."""
    dcfg = DraftConfig.from_target(target.config, target_name=target.name)
    graphdef, state = train.abstract_train_state(dcfg, cfg)
    leaves, treedef = jax.tree.flatten(state)
    A, B, L, D = cfg.accum, cfg.batch_size, cfg.seq_len, target.config.hidden_size
    V = target.config.vocab_size

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype)

    batch = train.Batch(tokens=sds((A, B, L), jnp.int32), feat_in=sds((A, B, L, D), jnp.float16),
                        feat_tgt=sds((A, B, L, D), jnp.float16), mask=sds((A, B, L), jnp.float32),
                        positions=sds((A, B, L), jnp.int32), segments=sds((A, B, L), jnp.int32))
    t0 = time.time()
    step = train.make_train_step(graphdef, treedef, dcfg, cfg)
    compiled = step.lower(leaves, sds((V, D), jnp.float32), sds((D, V), jnp.float32), batch,
                          jax.eval_shape(lambda: jax.random.PRNGKey(0))).compile()
    return _report(compiled, t0, head="eagle", batch_size=B, seq_len=L, accum=A, dtype=cfg.dtype,
                   ce_positions=cfg.ce_positions)


def main(argv=None) -> int:
    rc = RecipeConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--head", choices=("eagle3", "eagle"), default="eagle3")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--ttt-steps", type=int, default=rc.eagle3.ttt_steps)
    ap.add_argument("--dtype")
    a = ap.parse_args(argv)
    os.environ.setdefault("DDD_JAX_NO_KERNELS", "1")  # the GPU run's path: XLA's products, no CPU kernels
    target = load_target(a.target, panels=False)
    base = rc.eagle3 if a.head == "eagle3" else rc.eagle1
    cfg = dataclasses.replace(base, batch_size=a.batch_size or base.batch_size, seq_len=a.seq_len or base.seq_len,
                              dtype=a.dtype or base.dtype)
    if a.head == "eagle3":
        res = step_memory(target, dataclasses.replace(cfg, ttt_steps=a.ttt_steps))
    else:
        res = step_memory_eagle1(target, cfg)
    print(json.dumps({"target": target.name, **res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
