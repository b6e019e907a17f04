"""Run by tests/test_sharding.py in a subprocess with 4 simulated CPU devices: `fit` data-parallel on a (4, 1) and a
(2, 2) mesh vs one device; prints the per-step losses as one JSON object."""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_train_fit import synthetic, tiny_target  # noqa: E402

from ddd_jax.sharding import make_mesh  # noqa: E402
from train_draft.extract import extract, load_features  # noqa: E402
from train_draft.train import FitConfig, fit  # noqa: E402


def main():
    target = tiny_target()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        extract(target, synthetic(16, 40), lambda e: e, f"{tmp}/f", source={"kind": "synthetic"}, max_len=40,
                shard_size=16, buckets=(48,), progress=False)
        feats = load_features(f"{tmp}/f", target)
        cfg = FitConfig(steps=4, batch_size=4, seq_len=80, accum=2, lr=3e-3, warmup=1, seed=0)
        for name, mesh in (("one", None), ("4x1", make_mesh(4, 1)), ("2x2", make_mesh(2, 2))):
            r = fit(target, feats, f"{tmp}/{name}", cfg, ckpt_every=1000, log_every=1, progress=False, mesh=mesh)
            lines = [json.loads(x) for x in open(f"{tmp}/{name}/metrics.jsonl")]
            out[name] = {"loss": [x["loss"] for x in lines], "params": [float(np.asarray(p).sum()) for p in
                                                                        jax.tree.leaves(r["params"])]}
        try:
            fit(target, feats, f"{tmp}/bad", FitConfig(steps=1, batch_size=3, seq_len=80), mesh=make_mesh(2, 2),
                progress=False)
        except ValueError as e:
            out["error"] = str(e)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
