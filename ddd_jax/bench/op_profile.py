"""Where a decode loop's time goes, op by op: `ddd-jax bench --op-profile`.

Runs `generate` on a few prompts under `jax.profiler`, keeps the events of the compiled decode loop
(`vanilla_loop` / `spec_loop`: the whole generation after the prefill, one program), and sums each HLO op's time per
target call (a token for vanilla, a draft-verify-commit cycle for speculative methods). Each op is named with what the
compiled HLO says it is (the CPU kernel it calls, its output shape) and put in one of a few groups by that kernel and
by where it runs: ops inside the target's loop over its layers (a `while` whose known trip count is the target's
layer count, and whatever it calls: a DDD width switch runs one such loop per verify width, each in a fraction of the
calls) belong to the target's layers -- where the compiled module has no such loop, ops that run once per target
layer per call; products and
fusions whose output is the vocabulary are the target's lm_head (a head without a reduced draft vocabulary drafts
through that same projection, and counts there); products onto the draft vocabulary and the head's other products
are the draft; the rest (tree building, acceptance, the commit, the draft's glue) is "other".

The ops are timed by the profiler (each adds ~1 us of tracing), so read shares and differences between methods of
one run, not absolute speed: `ddd-jax bench` times the same loops untraced. CPU: the events of the XLA:CPU thunk
executor's threads; on a GPU, the device's kernel events (a GPU's launch gaps show as the difference between the
loop's wall time and its ops' sum).
"""
from __future__ import annotations

import collections
import glob
import importlib
import re
import tempfile
from pathlib import Path

import jax

import ddd_jax

LOOPS = {"vanilla": "vanilla_loop"}  # every other method runs spec_loop
WRAPPERS = ("ThunkExecutor", "while", "conditional", "call", "ThreadpoolListener")
# Control flow whose event spans the ops it runs, which have events of their own: summing both counted a branch
# twice (a `lax.switch`'s conditional is named cond.N, which the event-name filter above does not catch).
WRAPPER_OPCODES = ("conditional", "while", "call")
_OP = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\([^)]*\)|\S+) (\S+?)\(")  # name = shape (or a tuple) opcode(
_TARGET = re.compile(r'custom_call_target="([\w.\-]+)"')


def hlo_ops(hlo_text: str) -> dict:
    """{op name: (kind, output shape)} of a compiled HLO module's text; kind is a custom call's target (the CPU
    kernel) or the HLO opcode."""
    ops = {}
    for line in hlo_text.splitlines():
        m = _OP.match(line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        t = _TARGET.search(line)
        ops[name] = (t.group(1) if t else opcode, re.sub(r"\{[^}]*\}", "", shape))
    return ops


_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")  # a computation's first line: "%name (params) -> ... {"
_BODY = re.compile(r"\bbody=%([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = re.compile(r"\b(?:body|condition|to_apply)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")


def layer_loop_ops(hlo_text: str, n_layers: int) -> set | None:
    """The names of the ops of a compiled HLO module's text that run inside a loop over the target's layers: the
    body of a `while` whose known trip count is `n_layers`, and every computation it calls (branches, calls, inner
    loops). None when the module has no such loop (then `group` falls back on how often an op runs)."""
    comp, ops_of, calls, layer_bodies = None, collections.defaultdict(list), collections.defaultdict(set), set()
    for line in hlo_text.splitlines():
        c = _COMPUTATION.match(line)
        if c and line.rstrip().endswith("{"):
            comp = c.group(1)
            continue
        m = _OP.match(line)
        if not m or comp is None:
            continue
        ops_of[comp].append(m.group(1))
        opcode = m.group(3)
        if opcode in WRAPPER_OPCODES:
            calls[comp].update(_CALLED.findall(line))
            for branches in _BRANCHES.findall(line):
                calls[comp].update(b.strip().lstrip("%") for b in branches.split(","))
            t, body = _TRIPS.search(line), _BODY.search(line)
            if opcode == "while" and t and body and int(t.group(1)) == n_layers:
                layer_bodies.add(body.group(1))
    if not layer_bodies:
        return None
    inside, todo = set(), list(layer_bodies)
    while todo:
        c = todo.pop()
        if c not in inside:
            inside.add(c)
            todo.extend(calls.get(c, ()))
    return {name for c in inside for name in ops_of.get(c, ())}


def leaf_times(events, ops: dict):
    """(total ns, runs) per op name of `events` ((op name, ns) pairs), leaving out the control-flow ops of `ops`
    (`hlo_ops`) whose events span their branches' or bodies' own events."""
    per_op, count = collections.Counter(), collections.Counter()
    for name, ns in events:
        if ops.get(name, ("",))[0] in WRAPPER_OPCODES:
            continue
        per_op[name] += ns
        count[name] += 1
    return per_op, count


def _dims(shape: str) -> list:  # of the (first) array in an HLO shape
    m = re.search(r"\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def group(kind: str, shape: str, per_call: float, n_layers: int, vocab: int, draft_vocab: int | None,
          has_draft: bool = True, in_layers: bool | None = None) -> str:
    """The group of one op (see the module docstring): by its kernel, its output's last dimension and whether it runs
    in the target's loop over its layers (`in_layers`, from `layer_loop_ops`; None: unknown, then an op that runs
    `n_layers` times a target call is taken for a layer's). Products with one output column are RMSNorms' sums of
    squares (`layers.rms_norm`)."""
    dims = _dims(shape)
    last = dims[-1] if dims else None
    # every output's last dimension: the greedy lm_heads return (logits, tokens) or (tokens, screened logits)
    lasts = [int(m.split(",")[-1]) for m in re.findall(r"\[([\d,]+)\]", shape)] or [last]
    product = (kind.startswith("ddd_linear") or kind == "dot") and any(n != 1 for n in lasts)
    if (product or kind == "fusion") and vocab in lasts:
        return "target lm_head"
    if in_layers is None:
        in_layers = abs(per_call - n_layers) < 0.5 or (per_call >= n_layers and per_call % n_layers < 0.5)
    if in_layers:
        if kind == "ddd_attention":
            return "target attention"
        return "target layer products" if product else "target layers, other ops"
    if has_draft and product and draft_vocab and last == draft_vocab:
        return "draft vocabulary products"
    if has_draft and (product or kind == "ddd_attention"):
        return "draft head"
    return "other (tree, acceptance, commit, draft glue)"


def _events(xplane: str, module: str):
    """(op name, duration ns) of every leaf op of `module` in a trace (device planes when there are any)."""
    pd = jax.profiler.ProfileData.from_file(xplane)
    planes = [p for p in pd.planes if p.name.startswith("/device:")] or [p for p in pd.planes if p.name == "/host:CPU"]
    for plane in planes:
        for line in plane.lines:
            if plane.name == "/host:CPU" and not line.name.startswith("tf_XLA"):
                continue
            for e in line.events:
                if e.name.startswith(WRAPPERS):
                    continue
                stats = dict((k, v) for k, v in e.stats if k in ("hlo_module", "hlo_op"))
                if stats.get("hlo_module") == module:
                    yield stats.get("hlo_op", e.name), e.duration_ns


def op_profile(target, draft, prompt_ids: list, method: str, sync: str = "device", max_new_tokens: int = 64,
               warmup: int = 1, trace_dir: str | None = None, **gen_kw) -> dict:
    """Profile one method's decode loop over `prompt_ids` (see the module docstring). Returns per-op and per-group
    ms per target call, the calls, the loop's traced wall time per call and the compiled module's name.

    gen_kw go to `generate`; pass one `capacity` that fits every prompt (`bench.run.required_capacity`, as
    `ddd-jax bench --op-profile` does): with each prompt's own, a prompt whose cache needs more slots than the
    warm-up's compiles the loop again, and the compile lands in the traced wall time (not in the ops)."""
    gen = importlib.import_module("ddd_jax.decode.cycle")  # the loops the drivers call
    loop = LOOPS.get(method, "spec_loop")
    captured = {}
    orig = getattr(gen, loop)

    def spy(*args):  # remember the loop's argument shapes, to compile the same program once more for its HLO
        if "args" not in captured:
            captured["args"] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
                                            if isinstance(a, jax.Array) else a, args)
        return orig(*args)

    kw = dict(max_new_tokens=max_new_tokens, method=method, **gen_kw)
    if method == "ddd":
        kw["sync"] = sync
    setattr(gen, loop, spy)
    try:
        for p in prompt_ids[:warmup]:
            ddd_jax.generate(target, draft, p, **kw)
        tdir = trace_dir or tempfile.mkdtemp(prefix="ddd_jax_op_profile_")
        calls, decode_s = 0, 0.0
        jax.profiler.start_trace(tdir)
        try:
            for p in prompt_ids:
                r = ddd_jax.generate(target, draft, p, **kw)
                calls += r.stats["target_calls"]
                decode_s += r.stats["decode_s"]
        finally:
            jax.profiler.stop_trace()
    finally:
        setattr(gen, loop, orig)
    if "args" not in captured:
        raise RuntimeError(f"op_profile: method {method!r} never ran the device loop {loop} (use sync='device' "
                           "or 'callback'; the host loop is many small programs)")
    args = captured["args"]
    plan = args[2] if loop == "spec_loop" else args[1]
    hlo = orig.lower(*args).compile().as_text()
    ops = hlo_ops(hlo)
    layer_ops = layer_loop_ops(hlo, target.config.num_hidden_layers)
    module = "jit_" + loop
    # (escaped: a method name such as eagle2[k=4,N=8,d=3] in the directory is not a pattern)
    found = sorted(glob.glob(str(Path(glob.escape(str(tdir))) / "**" / "*.xplane.pb"), recursive=True))
    if not found:
        raise RuntimeError(f"op_profile: no trace written under {tdir}")
    per_op, count = leaf_times(_events(found[-1], module), ops)
    if not per_op:
        raise RuntimeError(f"op_profile: the trace has no events of {module}")
    cfg = target.config
    dvocab = getattr(getattr(draft, "config", None), "draft_vocab_size", None) if draft is not None else None
    rows = []
    for name, ns in per_op.most_common():
        kind, shape = ops.get(name, (name.split(".")[0], "?"))
        per_call = count[name] / calls
        rows.append({"op": name, "kind": kind, "shape": shape, "per_call": per_call, "ms": ns / 1e6 / calls,
                     "group": group(kind, shape, per_call, cfg.num_hidden_layers, cfg.vocab_size, dvocab,
                                    draft is not None, None if layer_ops is None else name in layer_ops)})
    groups = collections.Counter()
    for r in rows:
        groups[r["group"]] += r["ms"]
    return {"method": method, "sync": sync if method == "ddd" else None, "module": module, "prompts": len(prompt_ids),
            "target_calls": calls, "traced_wall_ms_per_call": 1e3 * decode_s / calls,
            "ops_ms_per_call": sum(r["ms"] for r in rows), "groups": dict(groups.most_common()), "ops": rows,
            "total_tokens": getattr(plan, "total_tokens", None), "capacity": gen_kw.get("capacity"), "trace_dir": tdir}


def table(res: dict, top: int = 12) -> str:
    """Markdown: the groups, then the `top` ops, ms per target call."""
    what = "token" if res["method"] == "vanilla" else "cycle"
    lines = [f"**{res['method']}{'-' + res['sync'] if res['sync'] else ''}**: {res['target_calls']} target calls, "
             f"traced wall {res['traced_wall_ms_per_call']:.2f} ms per {what}, ops {res['ops_ms_per_call']:.2f} ms",
             "", f"| group | ms per {what} | share of ops |", "|---|---|---|"]
    tot = res["ops_ms_per_call"]
    for g, ms in res["groups"].items():
        lines.append(f"| {g} | {ms:.2f} | {100 * ms / tot:.1f}% |")
    lines += ["", f"| op | kernel / opcode | output | runs per {what} | ms per {what} | group |",
              "|---|---|---|---|---|---|"]
    for r in res["ops"][:top]:
        lines.append(f"| {r['op']} | {r['kind']} | {r['shape']} | {r['per_call']:.2f} | {r['ms']:.3f} | {r['group']} |")
    return "\n".join(lines)

