"""Lazy evaluation across frameworks: the same vanilla / EAGLE-2 / DDD decoding in JAX and in eager PyTorch, timed
side by side, with every host sync counted and the cost of one sync measured per framework (`ddd-jax lazy-eval`).

`run_lazy_eval(target, draft, prompts, ...)` runs every row -- JAX: vanilla, eagle2, ddd host / callback / device;
torch: vanilla, eagle2, ddd host / device -- on the same prompts, rows interleaved per prompt (order rotated from
prompt to prompt) after an untimed warm-up per row and prompt bucket (JAX compiles; torch allocates). A separate
profile pass on a few prompts splits time per target call into draft / verify (JAX: `profile=True`, blocking after
each phase; torch: eager phases, synchronised on CUDA). `sync_cost_us` is the cost of one device->host read of a
scalar right after a step of real work (a draft step's vocabulary projection + DDD's confidence), per framework
(`sync_cost`). `loop_cost` (JAX) prices the other half of a host-driven loop: DDD with device sync run as one
program per cycle from a Python loop, against the same cycles inside one on-device loop, on the profile prompts
(`loop_cost`).

The result (`lazy_eval.json`) is a contract read by other tools: `rows` (one per framework x method x sync, with
ROW_FIELDS) and `sync_cost_us` {"jax": us, "torch": us}; see `ROW_FIELDS`. `loop_cost` (a dict, or None) was
added beside them.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

FRAMEWORKS = ("jax", "torch")
DEVICES = ("cpu", "gpu")
# (method, sync) rows per framework; sync None where it does not apply
ROWS = {
    "jax": (("vanilla", None), ("eagle2", None), ("ddd", "host"), ("ddd", "callback"), ("ddd", "device")),
    "torch": (("vanilla", None), ("eagle2", None), ("ddd", "host"), ("ddd", "device")),
}
# The contract: every row carries at least these fields.
ROW_FIELDS = ("framework", "method", "sync", "tokens_per_s", "target_calls", "draft_syncs_per_call",
              "host_syncs_per_call", "draft_ms_per_call", "verify_ms_per_call", "identical_to_vanilla")
TORCH_EXTRA = "pip install 'ddd-jax[torch]'"


def row_label(framework: str, method: str, sync: str | None) -> str:
    return f"{framework}:{method}" + (f"-{sync}" if sync else "")


# ----------------------------------------------------------------------------------------------- checks
def check_request(frameworks, device: str) -> tuple:
    """Validate frameworks and device before anything is loaded or written; returns the frameworks as a tuple.

    Unknown names, a missing torch (names the extra to install) or a GPU asked for where there is none raise
    ValueError."""
    fws = tuple(f.strip() for f in (frameworks.split(",") if isinstance(frameworks, str) else frameworks)
                if f.strip())
    bad = [f for f in fws if f not in FRAMEWORKS]
    if bad or not fws:
        raise ValueError(f"unknown framework(s) {bad or fws!r}; choose from {', '.join(FRAMEWORKS)}")
    if len(set(fws)) != len(fws):
        raise ValueError(f"framework listed twice: {fws}")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose cpu or gpu")
    if "torch" in fws:
        torch_module().torch_device(device)
    if "jax" in fws:
        jax_device(device)
    return fws


def torch_module():
    """`ddd_jax.bench.torch_decoding`, or a ValueError naming the extra when torch / transformers are missing."""
    try:
        from ddd_jax.bench import torch_decoding
    except ModuleNotFoundError as e:
        raise ValueError(f"the torch rows need PyTorch and transformers ({e.name!r} is not installed): "
                         f"{TORCH_EXTRA}, or pass --frameworks jax") from None
    return torch_decoding


def jax_device(device: str):
    """The JAX device for 'cpu' | 'gpu' (ValueError when JAX has no GPU backend)."""
    import jax
    try:
        devs = jax.devices("cpu" if device == "cpu" else "gpu")
    except RuntimeError as e:
        raise ValueError(f"device {device!r}: JAX has no GPU backend here ({str(e).splitlines()[0]}); "
                         "install jax[cuda12] on a machine with a GPU") from None
    return devs[0]


# ----------------------------------------------------------------------------------------------- sync cost
def sync_work(target, draft) -> tuple:
    """The step both sync measurements run: (A [D, D], W [V', D]) -- a square weight and the rows the draft
    projects onto (the head's draft vocabulary, else the target's output embedding)."""
    from ddd_jax.llama import output_embedding
    from ddd_jax.ops import as_float
    D = target.config.hidden_size
    W = draft.lm_sub if draft is not None and draft.lm_sub is not None else as_float(
        output_embedding(target.params, target.config))
    A = np.asarray(draft.params["layers"]["wo"][0]) if draft is not None else np.eye(D, dtype=np.float32)
    return np.asarray(A, np.float32), np.asarray(W, np.float32)


def sync_cost(loop, steps: int = 10, rounds: int = 40) -> dict:
    """Cost of one device->host read of a scalar right after a step of real work.

    loop(read: bool, steps) runs `steps` chained steps, reading the step's scalar on the host after every step
    (read=True) or only once at the end (read=False), and returns its wall seconds. Each round runs both, back to
    back; the cost is the median over rounds of (with - without) / steps. Short blocks, paired and many, keep
    other processes' load (which varies slowly) out of the differences. Returns {"us" (the median), "p25_us",
    "p75_us", "step_us" (median per-step time without reads), "diffs_us" (every round), "steps", "rounds"}."""
    loop(True, 2), loop(False, 2)  # compile / warm-up
    diffs, base = [], []
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)  # alternate which goes first
        t = {read: loop(read, steps) for read in order}
        diffs.append(1e6 * (t[True] - t[False]) / steps)
        base.append(1e6 * t[False] / steps)
    q25, q50, q75 = (float(x) for x in np.percentile(diffs, [25, 50, 75]))
    return {"us": q50, "p25_us": q25, "p75_us": q75, "step_us": float(np.median(base)), "diffs_us": diffs,
            "steps": steps, "rounds": rounds}


def jax_sync_loop(work, device, k: int = 4):
    """The sync-cost step in JAX (one jitted call): h = tanh(x @ A); conf = logsumexp(topk(log_softmax(h @ W.T),
    k)) -- a draft step's vocabulary projection and DDD's confidence. Returns `loop` for `sync_cost`."""
    import jax
    import jax.numpy as jnp
    A = jax.device_put(jnp.asarray(work[0]), device)
    W = jax.device_put(jnp.asarray(work[1]), device)
    x0 = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (k, A.shape[0]), jnp.float32), device)

    @jax.jit
    def step(x, A, W):
        h = jnp.tanh(x @ A)
        s, _ = jax.lax.top_k(jax.nn.log_softmax(h @ W.T, axis=-1), k)
        return h, jax.nn.logsumexp(s)

    def loop(read: bool, steps: int) -> float:
        x = x0
        t0 = time.perf_counter()
        for _ in range(steps):
            x, conf = step(x, A, W)
            if read:
                float(conf)  # the device->host read
        float(x.sum())
        return time.perf_counter() - t0

    return loop


def torch_sync_loop(work, device, k: int = 4):
    """The same step in eager PyTorch (`.item()` is the read). Returns `loop` for `sync_cost`."""
    import torch
    dev = torch_module().torch_device(device) if isinstance(device, str) else device
    A, W = (torch.from_numpy(np.array(w, np.float32)).to(dev) for w in work)
    x0 = torch.randn(k, A.shape[0], generator=torch.Generator().manual_seed(0)).to(dev)

    def finish():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def loop(read: bool, steps: int) -> float:
        with torch.inference_mode():
            x = x0
            finish()
            t0 = time.perf_counter()
            for _ in range(steps):
                h = torch.tanh(x @ A)
                conf = torch.logsumexp(torch.topk(torch.log_softmax(h @ W.T, -1), k, -1).values.reshape(-1), 0)
                x = h
                if read:
                    conf.item()  # the device->host read
            x.sum().item()
            return time.perf_counter() - t0

    return loop


def loop_cost(decode, prompt_ids: list, rounds: int = 2) -> dict:
    """What driving decoding from the host costs beyond its reads: decode(ids, loop) -> a `generate` result of DDD
    with device sync, loop "host" (one jitted program per cycle and one read of the done flags) or "device" (the
    whole generation one jitted loop). Each prompt runs once untimed per loop (compiles), then `rounds` rounds,
    the two loops alternating which goes first. Returns {"host_loop_ms_per_call", "device_loop_ms_per_call",
    "ms_per_call" (their difference: a program boundary and a read per target call), "identical" (the same
    tokens), "prompts", "rounds"}."""
    loops = ("host", "device")
    ref = {}
    for i, ids in enumerate(prompt_ids):
        for lp in loops:
            ref[(i, lp)] = decode(ids, lp).tokens
    secs, calls = dict.fromkeys(loops, 0.0), dict.fromkeys(loops, 0)
    identical = all(ref[(i, "host")] == ref[(i, "device")] for i in range(len(prompt_ids)))
    for r in range(rounds):
        for i, ids in enumerate(prompt_ids):
            for lp in (loops if (r + i) % 2 == 0 else loops[::-1]):
                res = decode(ids, lp)
                secs[lp] += res.stats["decode_s"]
                calls[lp] += res.stats["target_calls"]
                identical = identical and res.tokens == ref[(i, lp)]
    ms = {lp: 1e3 * secs[lp] / calls[lp] if calls[lp] else None for lp in loops}
    diff = ms["host"] - ms["device"] if None not in ms.values() else None
    return {"host_loop_ms_per_call": ms["host"], "device_loop_ms_per_call": ms["device"], "ms_per_call": diff,
            "identical": identical, "prompts": len(prompt_ids), "rounds": rounds}


# ----------------------------------------------------------------------------------------------- the run
def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True)


def _environment(device: str, torch_models) -> dict:
    from .run import environment
    env = environment()
    env["loadavg_end"] = env.pop("loadavg")
    env["lazy_eval_device"] = device
    if torch_models is not None:
        import torch
        import transformers
        dev = torch_models.device
        env.update(torch=torch.__version__, transformers=transformers.__version__,
                   torch_threads=torch.get_num_threads(),
                   torch_device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                   torch_attn_implementation=torch_models.attn_implementation, torch_compile=torch_models.compiled)
    return env


def without_lookup(tree, ddd):
    """(tree, why): `tree` without context-lookup candidates, which only the JAX side has (tuned settings may add
    them), and with `total_tokens` capped at what DDD can draft without them -- so that both frameworks run one
    tree -- and a note saying so."""
    import dataclasses

    from ddd_jax.config import ddd_pool
    tree = dataclasses.replace(tree, lookup=0)
    n = min(tree.total_tokens, ddd_pool(tree, ddd) + 1)
    return dataclasses.replace(tree, total_tokens=n), f"lookup=0, total_tokens={n} (the torch counterpart has no " \
                                                      "context lookup)"


PARTIAL_NAME = "lazy_eval.partial.jsonl"  # the checkpoint `ddd-jax lazy-eval` keeps in --out


def run_lazy_eval(target, draft, prompts, *, tree=None, ddd=None, max_new_tokens: int = 64, device: str = "cpu",
                  frameworks=FRAMEWORKS, profile_prompts: int = 3, warmup: bool = True, progress: bool = True,
                  torch_compile: bool = False, torch_threads: int | None = None, sync_rounds: int = 40,
                  loop_rounds: int = 2, chat: bool = True, tie_tol: float = 1e-2,
                  target_name: str | None = None, draft_name: str | None = None, notes: dict | None = None,
                  checkpoint=None, resume: bool = True) -> dict:
    """Run vanilla, EAGLE-2 and DDD in JAX and PyTorch on `prompts` (see module docstring); returns the JSON dict.

    checkpoint / resume: as `bench.run.run_benchmark`'s -- each prompt's runs are appended to the file as soon as
    they are done, and a run of the same configuration resumes after the prompts a killed one finished (the sync
    costs, profiles and loop cost are measured again: they take seconds).

    prompts: as `bench.run.normalize_prompts` (token ids, strings, or {"id", "category", "turns"}); the first turn
    is used. loop_rounds: rounds of `loop_cost` on the profile prompts (JAX; 0, or no profile prompts: none).
    Keys: format, env, config, sync_cost_us, sync_cost, loop_cost (None without JAX or its prompts), rows,
    identity, records."""
    import jax

    from ddd_jax.measure.prompts import build_prompt

    from .run import normalize_prompts

    fws = check_request(frameworks, device)
    tree, ddd = _checked_configs(fws, draft, tree, ddd, max_new_tokens)
    prompts = normalize_prompts(prompts)
    jdev = jax_device(device) if "jax" in fws else None
    rows = [(fw, m, s) for fw in fws for m, s in ROWS[fw]]
    with jax.default_device(jdev or jax.devices("cpu")[0]):
        ids_list = [build_prompt(target, p, 0, [], chat) for p in prompts]
        td, tmodels = _torch_models(fws, target, draft, device, torch_compile, torch_threads)
        capacity = _jax_capacity(fws, target, draft, tree, ddd, ids_list, max_new_tokens)
        run = _runner(target, draft, tree, ddd, max_new_tokens, capacity, td, tmodels)
        costs = _sync_costs(fws, sync_work(target, draft), jdev, tmodels, tree.top_k, sync_rounds)
        records = []
        if checkpoint is not None:
            checkpoint = Path(checkpoint)
            records = _resume(checkpoint, resume, progress, prompts, kind="lazy-eval",
                              rows=[row_label(*r) for r in rows], device=device, max_new_tokens=max_new_tokens,
                              tree=tree.to_dict(), ddd=[list(ddd.check_steps), ddd.threshold, ddd.max_depth],
                              warmup=warmup, chat=chat, capacity=capacity, torch_compile=torch_compile,
                              target=target_name or target.name, draft=draft_name)
        _decode_prompts(run, rows, prompts, ids_list, records, warmup=warmup, checkpoint=checkpoint,
                        progress=progress, with_text=target.tokenizer is not None)
        profiles = _profiles(run, rows, ids_list[:profile_prompts], progress)
        loops = None
        if "jax" in fws and loop_rounds > 0 and profile_prompts > 0:
            loops = _jax_loop_cost(target, draft, tree, ddd, max_new_tokens, capacity, ids_list[:profile_prompts],
                                   loop_rounds)
        identity = _identity(target, records, fws, tie_tol)
    out_rows = [_summarize(row, records, profiles.get(row), identity, costs) for row in rows]
    config = {"target": target_name or target.name, "draft": draft_name or "(unnamed head)", "device": device,
              "frameworks": list(fws), "max_new_tokens": max_new_tokens, "prompts": len(prompts),
              "profile_prompts": min(profile_prompts, len(prompts)), "warmup": warmup, "chat": chat,
              "tree": {"top_k": tree.top_k, "total_tokens": tree.total_tokens, "depth": tree.depth},
              "ddd": {"check_steps": list(ddd.check_steps), "threshold": ddd.threshold, "max_depth": ddd.max_depth},
              "jax_capacity": capacity, "params_dtype": str(target.params["embed"].dtype), **(notes or {})}
    return _result(_environment(device, tmodels), config, costs, loops, out_rows, identity, records)


def _checked_configs(fws: tuple, draft, tree, ddd, max_new_tokens: int) -> tuple:
    """(tree, ddd) with the library defaults for None; refuses what the run cannot do before anything runs."""
    from ddd_jax.config import DDDConfig, TreeConfig
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if draft is None:
        raise ValueError("lazy-eval needs a draft head (EAGLE-2 and DDD rows)")
    tree, ddd = tree or TreeConfig(), ddd or DDDConfig()
    if "torch" in fws and tree.lookup:  # refused before anything runs (the torch side would refuse mid-run)
        raise ValueError(f"lazy-eval compares the frameworks on one tree, and the torch counterpart drafts from the "
                         f"head alone: TreeConfig(lookup={tree.lookup}) (context-lookup candidates) is JAX-only; "
                         "pass lookup=0 or frameworks=('jax',)")
    return tree, ddd


def _torch_models(fws: tuple, target, draft, device: str, compile: bool, threads: int | None) -> tuple:
    """(the torch decoding module, the target and head in torch), or (None, None) without torch among `fws`."""
    td = torch_module() if "torch" in fws else None
    if td and threads:  # process-wide, like the CLI it serves
        import torch
        torch.set_num_threads(threads)
    return td, (td.load_torch(target, draft, device, compile=compile) if td else None)


def _jax_capacity(fws: tuple, target, draft, tree, ddd, ids_list: list, max_new_tokens: int) -> int | None:
    """One KV-cache capacity for every JAX row and prompt (one decode-loop compile per row); None without JAX."""
    if "jax" not in fws:
        return None
    from .run import parse_methods, required_capacity
    specs = parse_methods(["vanilla", "eagle2", "ddd-host", "ddd-callback", "ddd-device"], tree, ddd)
    return required_capacity(target, draft, specs, [len(i) for i in ids_list], max_new_tokens)


def _runner(target, draft, tree, ddd, max_new_tokens: int, capacity, td, tmodels):
    """run(row, ids, profile=False) -> (generate result, wall seconds) of one row on one prompt."""
    def run(row, ids, profile=False):
        fw, method, sync = row
        kw = dict(max_new_tokens=max_new_tokens, method=method, sync=sync or "device", tree=tree, ddd=ddd,
                  profile=profile)
        t0 = time.perf_counter()
        if fw == "jax":
            import ddd_jax
            res = ddd_jax.generate(target, draft if method != "vanilla" else None, ids, capacity=capacity, **kw)
        else:
            res = td.generate(tmodels, ids, **kw)
        return res, time.perf_counter() - t0

    return run


def _sync_costs(fws: tuple, work, jdev, tmodels, k: int, rounds: int) -> dict:
    """{framework: `sync_cost`} of one read after a step of `work`."""
    costs = {}
    if "jax" in fws:
        costs["jax"] = sync_cost(jax_sync_loop(work, jdev, k), rounds=rounds)
    if tmodels is not None:
        costs["torch"] = sync_cost(torch_sync_loop(work, tmodels.device, k), rounds=rounds)
    return costs


def _resume(checkpoint: Path, resume: bool, progress: bool, prompts: list, **fields) -> list:
    """The records a killed run of the same configuration (`fields`, `prompts`) left in `checkpoint`; [] (and the
    checkpoint started over) when there are none."""
    from .run import open_partial, partial_header
    header = partial_header(**fields, prompts=prompts)
    records = [g["record"] for g in open_partial(checkpoint, header, resume)]
    if records and progress:
        print(f"lazy-eval: resuming after {len(records)} of {len(prompts)} prompts ({checkpoint})", file=sys.stderr)
    return records


def _decode_prompts(run, rows: list, prompts: list, ids_list: list, records: list, *, warmup: bool, checkpoint,
                    progress: bool, with_text: bool) -> None:
    """Every row on every prompt after the `records` already held, rows interleaved per prompt (order rotated),
    an untimed warm-up per row and prompt bucket; each prompt's record is appended to `records` (and to
    `checkpoint`)."""
    from ddd_jax.decode import bucket_length

    from .run import append_partial
    labels = [row_label(*r) for r in rows]
    warmed = {}
    bar = _progress(len(prompts) * len(rows), progress, "lazy-eval")
    if bar is not None and records:
        bar.update(len(records) * len(rows))
    try:
        for i, (p, ids) in enumerate(zip(prompts, ids_list)):
            if i < len(records):
                continue
            rec = {"id": p["id"], "category": p.get("category"), "turn": 1, "prompt_ids": ids, "runs": {}}
            order = rows[i % len(rows):] + rows[: i % len(rows)]  # rotate slot positions
            for row in order:
                key = (row, bucket_length(len(ids)) if row[0] == "jax" else 0)
                run_rec = {"order": order.index(row)}
                if warmup and key not in warmed:
                    _, warmed[key] = run(row, ids)
                    run_rec["warmup_s"] = warmed[key]
                res, wall = run(row, ids)
                run_rec.update(tokens=list(res.tokens), wall_s=wall, stats=_slim(res.stats))
                if with_text:
                    run_rec["text"] = res.text
                rec["runs"][row_label(*row)] = run_rec
                if bar is not None:
                    bar.update(1)
            rec["runs"] = {lb: rec["runs"][lb] for lb in labels}
            records.append(rec)
            if checkpoint is not None:
                append_partial(checkpoint, {"prompt": i, "record": rec})
    finally:
        if bar is not None:
            bar.close()


def _jax_loop_cost(target, draft, tree, ddd, max_new_tokens: int, capacity, prompt_ids: list, rounds: int) -> dict:
    """`loop_cost` of JAX's DDD with device sync on `prompt_ids`."""
    import ddd_jax

    def decode(ids, loop):
        return ddd_jax.generate(target, draft, ids, capacity=capacity, max_new_tokens=max_new_tokens,
                                method="ddd", sync="device", tree=tree, ddd=ddd, loop=loop)

    return loop_cost(decode, prompt_ids, rounds)


def _result(env: dict, config: dict, costs: dict, loops, rows: list, identity: dict, records: list) -> dict:
    """lazy_eval.json's content (the module docstring names its contract)."""
    return {
        "format": "ddd-jax-lazy-eval", "format_version": 1,
        "env": env,
        "config": config,
        "sync_cost_us": {fw: c["us"] for fw, c in costs.items()},
        "sync_cost": {"work": "h = tanh(x @ A); conf = logsumexp(topk(log_softmax(h @ W.T), k)) with A [D, D] and W "
                              "the draft's output rows [V', D]; cost = median over rounds of (time of `steps` steps reading "
                              "conf after every step - the same steps reading once at the end) / steps", **costs},
        "loop_cost": loops,
        "rows": rows,
        "identity": identity,
        "records": records,
    }


def _slim(stats: dict) -> dict:
    keep = ("new_tokens", "target_calls", "accepted_per_call", "depth_per_call", "ddd_checks", "draft_syncs",
            "host_syncs", "verify_syncs", "prefill_s", "decode_s", "draft_s", "verify_s", "commit_s")
    return {k: stats[k] for k in keep if k in stats}


def _profiles(run, rows, prompt_ids: list, progress: bool) -> dict:
    """Draft / verify / commit seconds per target call of each speculative row (profile pass, after a warm-up)."""
    spec = [r for r in rows if r[1] != "vanilla"]
    if not prompt_ids or not spec:
        return {}
    bar = _progress(len(spec) * (len(prompt_ids) + 1), progress, "profile")
    out = {}
    try:
        for row in spec:
            run(row, prompt_ids[0], profile=True)
            if bar is not None:
                bar.update(1)
            tot = {"draft_s": 0.0, "verify_s": 0.0, "commit_s": 0.0, "decode_s": 0.0, "target_calls": 0}
            for ids in prompt_ids:
                res, _ = run(row, ids, profile=True)
                for k in tot:
                    tot[k] += res.stats[k]
                if bar is not None:
                    bar.update(1)
            calls = max(tot["target_calls"], 1)
            out[row] = {"prompts": len(prompt_ids), **tot,
                        **{f"{k[:-2]}_ms_per_call": 1e3 * tot[k] / calls
                           for k in ("draft_s", "verify_s", "commit_s", "decode_s")}}
    finally:
        if bar is not None:
            bar.close()
    return out


def _identity(target, records: list, fws: tuple, tie_tol: float) -> dict:
    """Token identity with each framework's own vanilla run, and torch vs JAX row by row (mismatches classified
    as float near-ties or real by `bench.run.check_identity`)."""
    from .run import check_identity
    out = {}
    for fw in fws:
        labels = [row_label(fw, m, s) for m, s in ROWS[fw]]
        out[fw] = check_identity(target, records, labels, reference=row_label(fw, "vanilla", None), tie_tol=tie_tol)
    if set(fws) == {"jax", "torch"}:
        out["torch_vs_jax"] = {}
        for m, s in ROWS["torch"]:
            lt, lj = row_label("torch", m, s), row_label("jax", m, s)
            res = check_identity(target, records, [lj, lt], reference=lj, tie_tol=tie_tol)["methods"][lt]
            same_tok = [r for r in records if r["runs"][lt]["tokens"] == r["runs"][lj]["tokens"]]
            res["same_depths"] = sum(r["runs"][lt]["stats"].get("depth_per_call") ==
                                     r["runs"][lj]["stats"].get("depth_per_call") for r in same_tok)
            res["same_tokens"] = len(same_tok)
            out["torch_vs_jax"][lt] = res
    return out


def _summarize(row, records: list, prof: dict | None, identity: dict, sync_cost: dict) -> dict:
    fw, method, sync = row
    lb = row_label(*row)
    st = [r["runs"][lb]["stats"] for r in records]
    decode = sum(s["decode_s"] for s in st)
    dec_tokens = sum(max(s["new_tokens"] - 1, 0) for s in st)
    calls = sum(s["target_calls"] for s in st)
    acc = [a for s in st for a in s["accepted_per_call"]]
    dep = [d for s in st for d in s.get("depth_per_call", [])]
    per = lambda key: sum(s.get(key, 0) for s in st) / calls if calls else 0.0  # noqa: E731
    ms_per_call = 1e3 * decode / calls if calls else None
    if method == "vanilla":  # one target forward per call, no draft
        draft_ms, verify_ms = 0.0, ms_per_call
    else:
        draft_ms = prof["draft_ms_per_call"] if prof else None
        verify_ms = prof["verify_ms_per_call"] if prof else None
    ident = identity[fw]["methods"].get(lb)
    mism = 0 if ident is None else ident["mismatches"]
    host_pc = per("host_syncs")
    out = {
        "framework": fw, "method": method, "sync": sync, "label": lb,
        "tokens_per_s": dec_tokens / decode if decode > 0 else 0.0,
        "target_calls": calls, "draft_syncs_per_call": per("draft_syncs"), "host_syncs_per_call": host_pc,
        "draft_ms_per_call": draft_ms, "verify_ms_per_call": verify_ms,
        "identical_to_vanilla": mism == 0,
        "mismatches_vs_vanilla": mism, "real_mismatches_vs_vanilla": 0 if ident is None else ident["real_mismatches"],
        "prompts": len(st), "new_tokens": sum(s["new_tokens"] for s in st), "decode_s": decode,
        "ms_per_call": ms_per_call, "tau": sum(acc) / len(acc) if acc else 0.0,
        "mean_depth": float(np.mean(dep)) if dep else None,
        "ddd_checks_per_call": per("ddd_checks"),
        "verify_syncs_per_call": per("verify_syncs") if fw == "torch" else 0.0,
        "sync_ms_per_call_est": host_pc * sync_cost[fw]["us"] / 1e3 if fw in sync_cost else None,
        "commit_ms_per_call": prof["commit_ms_per_call"] if prof else None,
        "profile_ms_per_call": prof["decode_ms_per_call"] if prof else None,
    }
    tvj = identity.get("torch_vs_jax", {}).get(lb)
    if tvj is not None:
        out.update(tokens_identical_to_jax=tvj["compared"] - tvj["mismatches"], jax_mismatch_near_ties=tvj["near_ties"],
                   jax_mismatch_real=tvj["real_mismatches"], depths_identical_to_jax=tvj["same_depths"])
    return out


# ----------------------------------------------------------------------------------------------- reports
def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(result: dict) -> str:
    """The Markdown table of a lazy-eval result (one row per framework x method x sync) and the sync costs."""
    from .report import markdown_table
    c, e = result["config"], result["env"]
    head = (f"**ddd-jax lazy-eval** target `{c['target']}`, draft `{c['draft']}`; {c['prompts']} prompts, "
            f"max_new_tokens={c['max_new_tokens']}, tree k={c['tree']['top_k']} N={c['tree']['total_tokens']} "
            f"d={c['tree']['depth']}, DDD S={'/'.join(map(str, c['ddd']['check_steps']))} x={c['ddd']['threshold']:g} "
            f"n={c['ddd']['max_depth']}; device {c['device']} ({e.get('device')}, {e.get('cpu_count')} CPUs), "
            f"jax {e.get('jax')}" + (f", torch {e['torch']}" if "torch" in e else "") + f", {e.get('date')}")
    n = c["prompts"]
    rows = []
    for r in result["rows"]:
        same_jax = "-" if "tokens_identical_to_jax" not in r else f"{r['tokens_identical_to_jax']}/{n}"
        same_dep = "-" if "depths_identical_to_jax" not in r or r["method"] == "vanilla" \
            else f"{r['depths_identical_to_jax']}/{r['tokens_identical_to_jax']}"
        rows.append([r["framework"], r["method"], r["sync"] or "-", _f(r["tokens_per_s"], "{:.1f}"), r["target_calls"],
                     _f(r["tau"]), _f(r["mean_depth"]), _f(r["draft_syncs_per_call"]), _f(r["host_syncs_per_call"]),
                     _f(r["draft_ms_per_call"], "{:.1f}"), _f(r["verify_ms_per_call"], "{:.1f}"),
                     "yes" if r["identical_to_vanilla"] else f"no ({r['mismatches_vs_vanilla']})", same_jax, same_dep])
    table = markdown_table(["framework", "method", "sync", "tok/s", "target calls", "τ", "mean depth",
                            "draft syncs/call", "host syncs/call", "draft ms/call", "verify ms/call",
                            "identical to vanilla", "same tokens as JAX", "same depths as JAX"], rows)
    costs = ", ".join(f"{fw} {v['us']:.0f} µs (quartiles {v['p25_us']:.0f} .. {v['p75_us']:.0f} µs; step of work "
                      f"{v['step_us']:.0f} µs)" for fw, v in result["sync_cost"].items() if isinstance(v, dict))
    lines = [head, "", table, "", f"cost of one device->host sync of a scalar after a step of work: {costs}"]
    lc = result.get("loop_cost")
    if lc and lc.get("ms_per_call") is not None:
        lines.append(f"jax, DDD device sync from a Python loop (one program and one read a cycle) against its "
                     f"on-device loop: {lc['host_loop_ms_per_call']:.2f} against "
                     f"{lc['device_loop_ms_per_call']:.2f} ms a target call ({lc['ms_per_call']:+.2f} ms; first "
                     f"{lc['prompts']} prompts, {lc['rounds']} rounds" + ("" if lc["identical"] else "; TOKENS DIFFER")
                     + ")")
    lines.append(f"draft/verify ms per call: profile pass (first {c['profile_prompts']} prompts); vanilla: one target "
                 "forward per call")
    return "\n".join(lines)


def write_outputs(result: dict, out_dir) -> list[Path]:
    """lazy_eval.json, lazy_eval.md and time_split.png in out_dir, each written atomically."""
    from ddd_jax.io import atomic_write_text

    from . import plots, report
    out = Path(out_dir)
    paths = [report.write_json(result, out / "lazy_eval.json")]
    md = out / "lazy_eval.md"
    atomic_write_text(md, markdown(result) + "\n")
    paths.append(md)
    paths.append(plots.plot_lazy_split(result, out / "time_split.png"))
    return paths
