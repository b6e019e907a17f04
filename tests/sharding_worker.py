"""Run by tests/test_sharding.py in a subprocess with 4 simulated CPU devices (XLA_FLAGS must be set before JAX
starts): single-device references vs sharded runs on several meshes; prints one JSON object of findings."""
from __future__ import annotations

import os

if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from ddd_jax import (DDDConfig, ModelConfig, Target, TreeConfig, generate, init_draft, llama, load_draft,  # noqa: E402
                     load_target, save_draft, sharding)
from ddd_jax.eagle import Draft, head_forward  # noqa: E402
from ddd_jax.checkpoints.ours import save_target  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# head counts, MLP hidden and vocabulary all divide 4
CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=8, max_position_embeddings=512, eos_token_id=(95,))
TREE = TreeConfig(top_k=2, total_tokens=5, depth=2)
DDD = DDDConfig(check_steps=(2, 3), threshold=-5.0, max_depth=4)
MAX_NEW = 10


def target(mesh=None):
    params = llama.init_params(CFG, jax.random.PRNGKey(0), std=0.25)
    params["layers"]["wo"] = params["layers"]["wo"] * 0.15
    return Target("tiny-shard", CFG, params, mesh=mesh)


def fitted_head(t, steps=60):
    """A head briefly fitted to the target's greedy continuations, so that some drafts get accepted."""
    rng = np.random.RandomState(1)
    ps = [list(rng.randint(0, 90, 4)) for _ in range(16)]
    res = generate(t, None, ps, max_new_tokens=12)
    seqs = np.asarray([(p + r + [0] * 16)[:16] for p, r in zip(ps, res.tokens)], np.int32)
    feats = llama.forward(t.params, CFG, seqs, np.broadcast_to(np.arange(16), seqs.shape)).hidden
    d = init_draft(t, 0)
    tp = t.params
    pos = jnp.broadcast_to(jnp.arange(15), seqs[:, 1:].shape)
    p_t = jax.nn.softmax(llama.lm_head(tp, CFG, feats[:, 1:]), -1)

    def loss(dp):
        h, _ = head_forward(dp, d.config, tp["embed"], seqs[:, 1:], feats[:, :-1], pos)
        return optax.huber_loss(h, feats[:, 1:]).mean() - (p_t * jax.nn.log_softmax(llama.lm_head(tp, CFG, h))).sum(-1).mean()

    opt = optax.adam(1e-2)

    @jax.jit
    def step(dp, st):
        g = jax.grad(loss)(dp)
        u, st = opt.update(g, st, dp)
        return optax.apply_updates(dp, u), st

    dp, st = d.params, opt.init(d.params)
    for _ in range(steps):
        dp, st = step(dp, st)
    return jax.tree.map(np.asarray, dp)


def run(t, dparams, prompts, method, sync):
    d = None if method == "vanilla" else Draft(init_draft(t, 0).config, dparams, t)
    r = generate(t, d, prompts, max_new_tokens=MAX_NEW, method=method, sync=sync, tree=TREE, ddd=DDD)
    return r.tokens, r.stats.get("per_sequence", [r.stats])


def main(spec):
    out = {"devices": jax.device_count()}
    rng = np.random.RandomState(0)
    prompts = [list(map(int, rng.randint(0, 90, n))) for n in (3, 17, 8)]  # 3 prompts: padded on data=2 and 4
    t1 = target()
    dparams = fitted_head(t1)
    modes = [tuple(m) for m in spec["modes"]]
    ref, acc = {}, {}
    for method, sync in modes:
        toks, st = run(t1, dparams, prompts, method, sync)
        ref[f"{method}-{sync}"] = toks
        acc[f"{method}-{sync}"] = max(max(s["accepted_per_call"] or [0]) for s in st)
    out["ref"], out["max_accepted"] = ref, acc
    out["same"] = {}
    for shape in spec["meshes"]:
        mesh = sharding.make_mesh(*shape)
        t = target(mesh)
        for method, sync in spec["mesh_modes"].get("x".join(map(str, shape)), modes):
            toks, _ = run(t, dparams, prompts, method, sync)
            out["same"][f"{shape[0]}x{shape[1]}/{method}-{sync}"] = toks == ref[f"{method}-{sync}"]
    if spec.get("checks"):
        out.update(checks(t1, dparams, prompts))
    print("RESULT " + json.dumps(out))


def checks(t1, dparams, prompts):
    """Placement (weights, head, caches), loading onto a mesh, same-seed init, and bad inputs."""
    from ddd_jax.decode import make_plan
    from ddd_jax.decode.api import _prepare_prompts
    from ddd_jax.decode.cycle import prefill_state
    res = {}
    mesh = sharding.make_mesh(2, 2)
    t = target(mesh)
    res["target_shards"] = {k: [list(g), list(s), str(p)] for k, (g, s, p) in sharding.describe(t.params).items()}
    d_sharded, d_one = init_draft(t, 3), init_draft(t1, 3)
    res["draft_shards"] = {k: [list(g), list(s), str(p)] for k, (g, s, p) in sharding.describe(d_sharded.params).items()}
    res["init_same_values"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                                  zip(jax.tree.leaves(d_sharded.params), jax.tree.leaves(d_one.params)))
    res["n_devices_per_weight"] = len(t.params["layers"]["wq"].sharding.device_set)
    # the decode state: caches over batch and KV heads
    d = Draft(d_one.config, dparams, t)
    plan = make_plan(t, d, method="eagle2", sync="device", tree=TREE, ddd=DDD, temperature=0.0, top_p=1.0,
                     max_new_tokens=MAX_NEW)
    _, toks, plen, cap = _prepare_prompts(t, prompts + [prompts[-1]], plan, None)
    toks = jax.device_put(toks, sharding.batch_sharding(mesh, 2))
    plen = jax.device_put(plen, sharding.batch_sharding(mesh, 1))
    s = prefill_state(t.params, d.decode_params(), plan, toks, plen, jax.random.PRNGKey(0), capacity=cap, mesh=mesh)
    res["tcache_spec"] = str(s.tcache.k.sharding.spec)
    res["dcache_spec"] = str(s.dcache.k.sharding.spec)
    res["tcache_shard"] = list(s.tcache.k.addressable_shards[0].data.shape)
    res["tcache_shape"] = list(s.tcache.k.shape)
    # loading onto a mesh: our target format and head format
    with tempfile.TemporaryDirectory() as tmp:
        save_target(t1, f"{tmp}/t")
        save_draft(d_one, f"{tmp}/d")
        lt = load_target(f"{tmp}/t", mesh=mesh)
        ld = load_draft(f"{tmp}/d", lt)
        res["loaded_mesh"] = lt.mesh is mesh and ld.mesh is mesh
        res["loaded_specs"] = [str(lt.params["embed"].sharding.spec), str(ld.params["layers"]["w_up"].sharding.spec)]
        res["loaded_same_values"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                                        zip(jax.tree.leaves(lt.params), jax.tree.leaves(t1.params)))
    # an HF directory (transformers' save_pretrained), converted tensor by tensor straight onto the mesh
    try:
        from conftest import write_tiny_hf_llama

        from ddd_jax.backends.cpu.panels import unpack_params
        with tempfile.TemporaryDirectory() as tmp:
            write_tiny_hf_llama(f"{tmp}/hf")
            one, sh = load_target(f"{tmp}/hf"), load_target(f"{tmp}/hf", mesh=mesh)
            res["hf_loaded"] = {"same_values": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                                                   zip(jax.tree.leaves(unpack_params(one.params)),
                                                       jax.tree.leaves(sh.params))),
                                "wk_shard": list(sh.params["layers"]["wk"].addressable_shards[0].data.shape),
                                "wk_shape": list(sh.params["layers"]["wk"].shape)}
    except BaseException as e:  # torch / transformers absent: pytest.importorskip raises Skipped
        res["hf_loaded"] = f"skipped: {type(e).__name__}: {e}"
    # bad inputs
    errs = {}
    from jax.sharding import Mesh
    try:
        target(Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("x", "y")))
    except ValueError as e:
        errs["axes"] = str(e)
    try:
        import dataclasses
        bad = dataclasses.replace(CFG, num_key_value_heads=2)
        Target("bad", bad, llama.init_params(bad, jax.random.PRNGKey(0)), mesh=sharding.make_mesh(1, 4))
    except ValueError as e:
        errs["heads"] = str(e)
    res["errors"] = errs
    return res


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
