"""Decode timings of a model shape without its weights: an HF-style `config.json` with random float32 weights and an
untrained head (acceptance ~0, so every speculative cycle drafts the full depth, verifies the whole tree and commits
one token). For a machine the weights cannot reach in time -- e.g. a short GPU loan: SmolLM2's converted
`config.json` is 1 KB where its GGUF is 98 MB.

    python experiments/random_probe.py ~/.cache/ddd_jax/smollm2-135m-instruct/config.json [REPEAT]

Prints, for vanilla, EAGLE-2, DDD device and DDD host at the paper's defaults (200-token random prompt, 64 new
tokens): the first call (compiles), the fastest of two steady calls, the target calls; then `cost_curve` with
synthetic inputs at 1, 2, 8, 16 and 64 tokens (REPEAT rounds, default 5). README, "On a GPU", second loan. On CPU
the weights stay row-major (`load_target` packs panels; this does not), so CPU timings here are not the package's.
"""
import json
import sys
import time
from pathlib import Path

T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def main(config_path: str, repeat: int = 5) -> None:
    import jax

    sys.path.insert(0, str(Path(__file__).parent.parent))
    from ddd_jax import llama
    from ddd_jax.config import ModelConfig
    from ddd_jax.decode import generate
    from ddd_jax.eagle import init_draft
    from ddd_jax.measure.cost import cost_curve
    from ddd_jax.target import Target

    log("jax", jax.__version__, jax.devices())
    cfg = ModelConfig.from_hf_config(json.loads(Path(config_path).read_text()))
    target = Target("random", cfg, llama.init_params(cfg, jax.random.PRNGKey(0)))
    draft = init_draft(target, 0)
    jax.block_until_ready(target.params)
    log("params ready")
    prompt = [int(i) for i in jax.random.randint(jax.random.PRNGKey(1), (200,), 3, cfg.vocab_size)]
    for method, kw in [("vanilla", {}), ("eagle2", {}), ("ddd", dict(sync="device")), ("ddd", dict(sync="host"))]:
        name = method + ("-" + kw["sync"] if kw else "")
        s = time.perf_counter()
        r = generate(target, draft, prompt, 64, method=method, **kw)
        first = time.perf_counter() - s
        steady = []
        for _ in range(2):
            s = time.perf_counter()
            r = generate(target, draft, prompt, 64, method=method, **kw)
            steady.append(time.perf_counter() - s)
        log(f"{name}: first call {first:.1f}s; steady {min(steady) * 1e3:.1f} ms for {len(r.tokens)} tokens; "
            f"target calls {r.stats.get('target_calls')}")
    log("cost curve")
    cc = cost_curve(target, draft, sizes=(1, 2, 8, 16, 64), repeat=repeat, inputs="synthetic")
    for row in cc["rows"]:
        log({k: v for k, v in row.items() if not isinstance(v, list)})


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
