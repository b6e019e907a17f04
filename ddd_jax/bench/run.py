"""The speed/acceptance benchmark as library functions: method specs, one interleaved run, identity vs vanilla.

`run_benchmark(target, draft, prompts, methods, ...)` runs every method on the same prompts, methods interleaved
per prompt (order rotated from prompt to prompt) so machine noise hits all alike. Before a method is first
timed on a prompt-length bucket it is run once untimed (jit caches are keyed by the prompt bucket and the
cache capacity; one shared `capacity` keeps the decode loops to one compile per method), and that warm-up is
reported separately. A separate `profile=True` pass on a few prompts splits time into draft / verify / commit.
Under greedy decoding every method must reproduce vanilla's tokens; each mismatch is classified by the target's
top-2 logit margin at the first differing position (a float near-tie, or a real bug).

A prompt is a token-id list, a string (one user turn), or {"id": ..., "turns": [str | list[int], ...]}.
String turns go through the chat template (`target.encode_chat`); token-id turns are concatenated as
turn_1 + answer_1 + turn_2 ... (tokenizer-free test targets).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import ddd_jax
from ddd_jax.backends.cpu import kernels
from ddd_jax.config import DDDConfig, TreeConfig, check_tree_for_ddd
from ddd_jax.decode import bucket_length, cache_capacity, make_plan
from ddd_jax.measure.prompts import build_prompt  # one turn as token ids (also importable from here)
from ddd_jax.ops import describe_weights

# name -> (method, sync, loop). loop None = generate's default for that sync.
BASE_METHODS = {
    "vanilla": ("vanilla", "device", None),
    "eagle2": ("eagle2", "device", None),
    "eagle2-hostloop": ("eagle2", "device", "host"),
    "ddd-host": ("ddd", "host", None),
    "ddd-callback": ("ddd", "callback", None),
    "ddd-device": ("ddd", "device", None),
    "ddd-device-hostloop": ("ddd", "device", "host"),
}
DEFAULT_METHODS = ("vanilla", "eagle2", "ddd-host", "ddd-callback", "ddd-device")
REFERENCE = "vanilla"
# Override keys in a method spec "name[key=value,...]": tree (k, N, d; context lookup L, g, p) and DDD (S as 3/5/7,
# x, n; keep: how many of step 0's children a cycle stopped at step 0 still verifies, -1 all (`stop0_nodes`); the
# stop rule: rule=threshold|adaedl|gain, and AdaEDL's gamma).
TREE_KEYS = {"k": "top_k", "N": "total_tokens", "d": "depth", "L": "lookup", "g": "lookup_ngram", "p": "lookup_logp"}
DDD_KEYS = {"S": "check_steps", "x": "threshold", "n": "max_depth", "keep": "stop0_nodes", "rule": "rule",
            "gamma": "gamma"}
GAIN_NEEDS_CALIBRATION = (
    "rule=gain needs a GainModel, which only a calibration makes (`ddd-jax calibrate`, or ddd_jax.calibrate): the "
    "bench takes the gain rule from this device's calibrated defaults (where calibration picked it), which apply "
    "with --settings auto and no tree / DDD flag (--tree-top-k, --total-tokens, --depth, --ddd-checks, --ddd-threshold, --ddd-max-depth)")


@dataclass(frozen=True)
class MethodSpec:
    """One benchmarked configuration: a base method plus its tree / DDD settings."""

    label: str
    base: str
    method: str
    sync: str
    loop: str | None
    tree: TreeConfig
    ddd: DDDConfig

    @property
    def speculative(self) -> bool:
        return self.method != "vanilla"

    def generate_kwargs(self) -> dict:
        return dict(method=self.method, sync=self.sync, loop=self.loop, tree=self.tree, ddd=self.ddd)

    def profile_key(self) -> tuple:
        """Methods with equal keys give the same profile split (the loop choice does not matter there)."""
        return (self.method, self.sync if self.method == "ddd" else None, self.tree,
                self.ddd if self.method == "ddd" else None)

    def describe(self) -> dict:
        d = {"label": self.label, "base": self.base, "method": self.method, "sync": self.sync,
             "loop": self.loop or ("host" if self.sync == "host" and self.method == "ddd" else "device")}
        if self.speculative:
            d["tree"] = self.tree.to_dict()
        if self.method == "ddd":
            d["ddd"] = {"check_steps": list(self.ddd.check_steps), "threshold": self.ddd.threshold,
                        "max_depth": self.ddd.max_depth}
            if self.ddd.stop0_nodes != -1:
                d["ddd"]["stop0_nodes"] = self.ddd.stop0_nodes
            if self.ddd.rule != "threshold":
                d["ddd"]["rule"] = self.ddd.rule
            if self.ddd.rule == "adaedl":
                d["ddd"]["gamma"] = self.ddd.gamma
        return d


def method_label(base: str, tree: TreeConfig | None = None, ddd: DDDConfig | None = None) -> str:
    """Canonical spec string, e.g. 'eagle2[k=4,N=8,d=3]' or 'ddd-device[k=4,N=8,S=2/4,x=-0.3,n=6]' (AdaEDL's rule
    adds 'rule=adaedl,gamma=...'; the gain rule comes from the calibrated defaults it is parsed against)."""
    parts = []
    if tree is not None:
        parts += [f"k={tree.top_k}", f"N={tree.total_tokens}", f"d={tree.depth}"]
        if tree.lookup:
            parts += [f"L={tree.lookup}", f"g={tree.lookup_ngram}", f"p={tree.lookup_logp:g}"]
    if ddd is not None:
        parts = [p for p in parts if not p.startswith("d=")]
        parts += ["S=" + "/".join(str(s) for s in ddd.check_steps), f"x={ddd.threshold:g}", f"n={ddd.max_depth}"]
        if ddd.stop0_nodes != -1:
            parts.append(f"keep={ddd.stop0_nodes}")
        if ddd.rule == "adaedl":
            parts += ["rule=adaedl", f"gamma={ddd.gamma:g}"]
    return f"{base}[{','.join(parts)}]" if parts else base


def parse_method(text: str, tree: TreeConfig | None = None, ddd: DDDConfig | None = None) -> MethodSpec:
    """'ddd-device' or 'ddd-device[S=3/5/7,x=-0.5,n=9,k=4,N=16]' on top of the given tree / DDD settings.

    DDD's stop rule: 'rule=adaedl' with its own x (lambda) and optionally 'gamma' (AdaEDL, `ddd_jax.adaedl`),
    'rule=threshold' with its own x (the confidence rule, from another rule's defaults), 'rule=gain' only where
    `ddd` already is the gain rule (a calibration's GainModel: `GAIN_NEEDS_CALIBRATION`)."""
    tree = tree or TreeConfig()
    ddd = ddd or DDDConfig()
    m = re.fullmatch(r"\s*([A-Za-z0-9_-]+)\s*(?:\[(.*)\])?\s*", text)
    if not m or m.group(1) not in BASE_METHODS:
        raise ValueError(f"unknown method {text!r}; known: {', '.join(BASE_METHODS)} "
                         "(optionally with overrides, e.g. 'ddd-device[S=3/5/7,x=-0.5,n=9]' or 'eagle2[k=4,N=16,d=3]')")
    base = m.group(1)
    method, sync, loop = BASE_METHODS[base]
    tkw, dkw = {}, {}
    for item in filter(None, (s.strip() for s in (m.group(2) or "").split(","))):
        key, _, val = item.partition("=")
        key, val = key.strip(), val.strip()
        try:
            if key in TREE_KEYS:
                tkw[TREE_KEYS[key]] = float(val) if key == "p" else int(val)
            elif key in DDD_KEYS:
                dkw[DDD_KEYS[key]] = (tuple(int(s) for s in val.split("/")) if key == "S"
                                      else float(val) if key in ("x", "gamma") else val if key == "rule" else int(val))
            else:
                raise ValueError(f"unknown key {key!r}")
        except ValueError as e:
            raise ValueError(f"method {text!r}: bad override {item!r} ({e}); keys: k, N, d (tree), L, g, p "
                             "(context lookup), S (e.g. 3/5/7), x, n, keep, rule (threshold, adaedl, gain), gamma "
                             "(adaedl) (DDD)") from None
    if method == "vanilla" and (tkw or dkw):
        raise ValueError(f"method {text!r}: vanilla takes no overrides")
    if method == "eagle2" and dkw:
        raise ValueError(f"method {text!r}: S/x/n/keep/rule/gamma are DDD settings; eagle2 takes k, N, d (and L, g, p)")
    try:
        tree = replace(tree, **tkw) if tkw else tree
        ddd = _with_rule(ddd, dkw) if dkw else ddd
    except ValueError as e:
        raise ValueError(f"method {text!r}: {e}") from None
    if method == "ddd":
        try:
            check_tree_for_ddd(tree, ddd)
        except ValueError as e:
            raise ValueError(f"method {text!r}: {e}") from None
    return MethodSpec(label=re.sub(r"\s+", "", text), base=base, method=method, sync=sync, loop=loop, tree=tree,
                      ddd=ddd)


def _with_rule(ddd: DDDConfig, dkw: dict) -> DDDConfig:
    """`ddd` with a method spec's DDD overrides, a change of stop rule included (which needs its own x)."""
    rule = dkw.pop("rule", ddd.rule)
    if rule == "gain" and ddd.rule != "gain":
        raise ValueError(GAIN_NEEDS_CALIBRATION)
    if rule != ddd.rule:
        if "threshold" not in dkw:
            raise ValueError(f"rule={rule} compares its own signal with x: give x too (the defaults' x={ddd.threshold:g} "
                             f"belongs to rule {ddd.rule})")
        dkw = {"rule": rule, "gain": None, "gamma": None, **dkw}
    if "gamma" in dkw and dkw["gamma"] is not None and rule != "adaedl":
        raise ValueError(f"gamma belongs to rule=adaedl, not rule={rule}")
    return replace(ddd, **dkw)


def split_methods(text: str) -> list[str]:
    """Split a comma list at bracket depth 0: 'vanilla,ddd-device[S=3/5,x=-1]' -> ['vanilla', 'ddd-device[...]']."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [s.strip() for s in out if s.strip()]


def parse_methods(methods, tree: TreeConfig | None = None, ddd: DDDConfig | None = None) -> list[MethodSpec]:
    items = split_methods(methods) if isinstance(methods, str) else list(methods)
    specs = [m if isinstance(m, MethodSpec) else parse_method(m, tree, ddd) for m in items]
    if not specs:
        raise ValueError("no methods given")
    labels = [s.label for s in specs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"methods listed twice: {dup}")
    return specs


# ----------------------------------------------------------------------------------------------- prompts
def normalize_prompts(prompts) -> list[dict]:
    """-> [{"id", "category", "turns": [str | list[int], ...]}]."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            turns = p.get("turns")
            if not turns:
                raise ValueError(f"prompt {i}: a dict prompt needs a non-empty 'turns' list")
            out.append({"id": p.get("id", i), "category": p.get("category"), "turns": list(turns)})
        elif isinstance(p, str):
            out.append({"id": i, "category": None, "turns": [p]})
        elif isinstance(p, (list, tuple, np.ndarray)) and len(p) and not isinstance(p[0], str):
            out.append({"id": i, "category": None, "turns": [[int(t) for t in p]]})
        else:
            raise ValueError(f"prompt {i}: expected token ids, a string or a dict with 'turns', got {type(p).__name__}")
    if not out:
        raise ValueError("no prompts given")
    return out


def length_bound(target, prompt: dict, turn: int, max_new: int, chat: bool) -> int:
    """Upper estimate of a turn's prompt length before the earlier answers exist (for the shared capacity)."""
    turns = prompt["turns"]
    if turn == 0:
        return len(build_prompt(target, prompt, 0, [], chat))
    if not isinstance(turns[0], str):
        return sum(len(t) for t in turns[: turn + 1]) + turn * max_new
    # answers re-encoded from text: allow template overhead and a little re-tokenisation drift per answer
    skeleton = build_prompt(target, prompt, turn, [[] for _ in range(turn)], chat)
    return len(skeleton) + turn * (max_new + 16)


def required_capacity(target, draft, specs, prompt_lengths, max_new_tokens: int, temperature: float = 0.0,
                      top_p: float = 1.0) -> int:
    """One KV-cache capacity that fits every (spec, prompt): all runs then share one decode-loop compile."""
    P = max(prompt_lengths)
    return max(cache_capacity(P, make_plan(target, draft, method=s.method, sync=s.sync, tree=s.tree, ddd=s.ddd,
                                           temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens))
               for s in specs)


# ----------------------------------------------------------------------------------------------- environment
def environment() -> dict:
    import jaxlib
    dev = jax.devices()[0]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)), "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(), "cpu_affinity": affinity,
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(), "python": platform.python_version(),
        "date": ddd_jax.io.utc_now(),
        "command": " ".join(sys.argv), "git_commit": commit,
        # ddd_jax.backends.cpu.kernels in use (CPU backend), or XLA only (DDD_JAX_NO_KERNELS=1, not built, other backends)
        "cpu_kernels": jax.default_backend() == "cpu" and kernels.available(),
        "cpu_kernels_avx512": jax.default_backend() == "cpu" and kernels.avx512(),
        "cpu_kernels_l2_prefetch_rows": kernels.l2_prefetch_rows() if jax.default_backend() == "cpu" else None,
        "cpu_model": kernels.cpu_model(),
        # float32 products: HIGHEST (ddd_jax.backends.cpu.kernels.precision) unless a default matmul precision is set
        "matmul_precision": jax.config.jax_default_matmul_precision or "float32 products at HIGHEST",
        # JAX's persistent compilation cache (the command line's default): compile times then include cache loads
        "compile_cache": jax.config.jax_compilation_cache_dir,
    }


# ----------------------------------------------------------------------------------------------- the run
def progress_bar(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True)


def _timed_generate(target, draft, ids, spec: MethodSpec, **kw):
    t0 = time.perf_counter()
    res = ddd_jax.generate(target, draft if spec.speculative else None, ids, **spec.generate_kwargs(), **kw)
    return res, time.perf_counter() - t0


PARTIAL_FORMAT = "ddd-jax-bench-partial"
PARTIAL_NAME = "bench.partial.jsonl"  # the checkpoint `ddd-jax bench` keeps in --out


def partial_header(**fields) -> dict:
    """What a checkpoint must match to be resumed: the methods, the decoding settings and the prompts (hashed)."""
    from ddd_jax.bench.report import jsonable
    prompts = fields.pop("prompts")
    digest = hashlib.sha256(json.dumps(jsonable(prompts), sort_keys=True).encode()).hexdigest()
    return jsonable({"format": PARTIAL_FORMAT, "format_version": 1, **fields, "prompts": len(prompts),
                      "prompts_sha256": digest})


def _read_partial(path: Path, header: dict, index: str = "prompt") -> list:
    """The lines a killed run finished, from its checkpoint: one header line, then one JSON object per unit of work
    in order, numbered by its `index` field (a bench: a prompt's records; a tune: a stage); [] when there is none.
    A checkpoint of another configuration is refused by name; a torn last line (the run killed while writing it)
    is dropped."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    if not lines:  # killed before its header was written
        return []
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError:
        head = None
    if head != header:
        changed = sorted(k for k in set(header) | set(head or {}) if (head or {}).get(k) != header.get(k))
        raise ValueError(f"{path} is the checkpoint of a different run (differs in: {', '.join(changed)}); "
                         "remove it, pass another --out, or start over (--no-resume, resume=False)")
    groups, kept = [], lines[:1]
    for n, line in enumerate(lines[1:], start=1):
        try:
            group = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) - 1:
                break  # torn last line
            raise ValueError(f"{path}: line {n + 1} is not JSON") from None
        if group.get(index) != n - 1:
            raise ValueError(f"{path}: line {n + 1} holds {index} {group.get(index)}, expected {n - 1}")
        groups.append(group)
        kept.append(line)
    if len(kept) < len(lines):  # drop the torn line before new work is appended
        from ddd_jax.io import atomic_write_text
        atomic_write_text(path, "\n".join(kept) + "\n")
    return groups


def open_partial(path: Path, header: dict, resume: bool = True, index: str = "prompt") -> list:
    """The groups a killed run of the same configuration left in its checkpoint (`_read_partial`; none without
    resume); where there are none, the file is started over with `header`."""
    groups = _read_partial(path, header, index) if resume else []
    if not groups:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(header) + "\n")
    return groups


def append_partial(path: Path, line: dict) -> None:
    from ddd_jax.bench.report import jsonable
    with open(path, "a") as f:
        f.write(json.dumps(jsonable(line)) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_benchmark(target, draft, prompts, methods=DEFAULT_METHODS, *, tree: TreeConfig | None = None,
                  ddd: DDDConfig | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
                  top_p: float = 1.0, seed: int = 0, repeat: int = 1, turns: int = 1, profile_prompts: int = 3,
                  warmup: bool = True, chat: bool = True, tie_tol: float = 1e-2, capacity: int | None = None,
                  progress: bool = True, draft_name: str | None = None, target_name: str | None = None,
                  notes: dict | None = None, checkpoint: str | Path | None = None, resume: bool = True) -> dict:
    """Benchmark `methods` on `prompts`; returns a JSON-able dict (see module docstring and report.py).

    checkpoint: a file that receives each prompt's records as soon as its turns are done; with resume (default) a
    run finds the prompts a killed run of the same configuration finished there and starts after them (their
    timings stay as measured: every method of a prompt runs in one process). The caller removes it once the
    result is written. resume=False starts the file over.

    Result keys: env, config, methods {label: {spec, summary, compile, profile}}, identity {label: ...},
    records [{id, turn, prompt_ids, runs {label: {tokens, repeats [stats], warmup_s, ...}}}]."""
    if repeat < 1 or turns < 1:
        raise ValueError(f"repeat and turns must be >= 1, got repeat={repeat}, turns={turns}")
    specs = parse_methods(methods, tree, ddd)
    if any(s.speculative for s in specs) and draft is None:
        raise ValueError("speculative methods need a draft head")
    prompts = normalize_prompts(prompts)
    labels = [s.label for s in specs]
    ref = REFERENCE if REFERENCE in labels else None
    gen_kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    if capacity is None:
        bounds = [length_bound(target, p, t, max_new_tokens, chat) for p in prompts
                  for t in range(min(turns, len(p["turns"])))]
        capacity = required_capacity(target, draft, specs, bounds, max_new_tokens, temperature, top_p)
    run = _Run(target=target, draft=draft, specs=specs, gen_kw=gen_kw, capacity=capacity, repeat=repeat,
               warmup=warmup, chat=chat)
    records, done = [], []
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        header = partial_header(kind="bench", methods=[s.describe() for s in specs], gen=gen_kw, repeat=repeat,
                                turns=turns, capacity=capacity, chat=chat, warmup=warmup,
                                target=target_name or target.name, draft=draft_name,
                                draft_dtype=None if draft is None else draft.weight_dtype, prompts=prompts)
        done = open_partial(checkpoint, header, resume)
        records = [r for g in done for r in g["records"]]
        if done and progress:
            print(f"bench: resuming after {len(done)} of {len(prompts)} prompts ({checkpoint})", file=sys.stderr)
    records = _run_prompts(run, prompts, turns, records, len(done), checkpoint, progress)

    profiles = run_profiles(target, draft, specs, records, profile_prompts, capacity, gen_kw, progress)
    identity = check_identity(target, records, labels, reference=ref, tie_tol=tie_tol, temperature=temperature)
    env = environment()
    env["loadavg_end"] = env.pop("loadavg")
    config = {
        "target": target_name or target.name,
        "draft": draft_name or ("(none)" if draft is None else "(unnamed head)"), "methods": labels,
        "reference": ref, **gen_kw, "repeat": repeat, "turns": turns, "prompts": len(prompts),
        "records": len(records), "capacity": capacity, "profile_prompts": min(profile_prompts, len(records)),
        "warmup": warmup, "chat": chat, "tie_tol": tie_tol, "params_dtype": str(target.params["embed"].dtype),
        "target_weights": describe_weights(target.params),
        "draft_dtype": None if draft is None else draft.weight_dtype, **(notes or {})}
    return {
        "format": "ddd-jax-bench", "format_version": 1, "env": env, "config": config,
        "methods": _method_results(specs, summarize(records, labels, ref), identity, profiles, run.warmed),
        "identity": identity,
        "records": records,
    }


@dataclass
class _Run:
    """What every timed run of one benchmark shares, and the warm-ups done so far: (label, bucket) -> info."""

    target: object
    draft: object
    specs: list
    gen_kw: dict
    capacity: int
    repeat: int
    warmup: bool
    chat: bool
    warmed: dict = field(default_factory=dict)
    bar: object = None


def _run_prompts(run: _Run, prompts: list, turns: int, records: list, start: int, checkpoint: Path | None,
                 progress: bool) -> list:
    """Every prompt's turns from prompt `start` on, after `records` (what a resumed checkpoint held), each prompt's
    records appended to the checkpoint as it ends. Returns all the records."""
    n_turns = [min(turns, len(p["turns"])) for p in prompts]
    per_turn = len(run.specs) * run.repeat
    run.bar = progress_bar(sum(n_turns) * per_turn, progress, "bench")
    if run.bar is not None and start:
        run.bar.update(sum(n_turns[:start]) * per_turn)
    records = list(records)
    try:
        for i in range(start, len(prompts)):
            answers = {s.label: [] for s in run.specs}
            new = [_run_turn(run, prompts[i], i, t, answers, len(records) + t) for t in range(n_turns[i])]
            records += new
            if checkpoint is not None:
                append_partial(checkpoint, {"prompt": i, "records": new})
    finally:
        if run.bar is not None:
            run.bar.close()
    return records


def _run_turn(run: _Run, p: dict, i: int, t: int, answers: dict, index: int) -> dict:
    """Turn `t` of prompt `i` (the `index`-th record) under every method, in an order rotated from turn to turn so
    that each method takes each slot; each method's answer joins `answers` for its next turn."""
    rec = {"id": p["id"], "category": p.get("category"), "turn": t + 1, "prompt_ids": None, "runs": {}}
    specs = run.specs
    order = specs[(i + t) % len(specs):] + specs[: (i + t) % len(specs)]  # rotate slot positions
    for spec in order:
        ids = build_prompt(run.target, p, t, answers[spec.label], run.chat)
        out = _run_method(run, spec, ids, index, order.index(spec))
        answers[spec.label].append(out["tokens"])
        rec["runs"][spec.label] = out
    # store the shared prompt once; a run keeps its own only where it differs (later turns)
    labels = [s.label for s in specs]
    rec["prompt_ids"] = rec["runs"][REFERENCE if REFERENCE in labels else labels[0]]["prompt_ids"]
    for out in rec["runs"].values():
        if out["prompt_ids"] == rec["prompt_ids"]:
            del out["prompt_ids"]
    rec["runs"] = {lb: rec["runs"][lb] for lb in labels}
    return rec


def _run_method(run: _Run, spec: MethodSpec, ids: list, index: int, slot: int) -> dict:
    """One method on one prompt (the `index`-th record, the `slot`-th method to run): its first run on a prompt
    bucket untimed (the warm-up, which compiles), then `run.repeat` timed runs, the later ones checked against the
    first's tokens."""
    out = {"prompt_len": len(ids), "bucket": bucket_length(len(ids)), "order": slot}
    key = (spec.label, out["bucket"])
    kw = dict(capacity=run.capacity, **run.gen_kw)
    if run.warmup and key not in run.warmed:
        _, wall = _timed_generate(run.target, run.draft, ids, spec, **kw)
        run.warmed[key] = {"bucket": out["bucket"], "wall_s": wall, "record": index}
        out["warmup_s"] = wall
    reps = []
    for _ in range(run.repeat):
        res, wall = _timed_generate(run.target, run.draft, ids, spec, **kw)
        reps.append({**res.stats, "wall_s": wall, "tokens_match_first": None})
        if len(reps) == 1:
            out["tokens"] = list(res.tokens)
            if run.target.tokenizer is not None:
                out["text"] = res.text
        else:
            reps[-1]["tokens_match_first"] = list(res.tokens) == out["tokens"]
        if run.bar is not None:
            run.bar.update(1)
    if "warmup_s" in out:
        run.warmed[key]["compile_s_est"] = max(0.0, out["warmup_s"] - reps[0]["wall_s"])
    out["repeats"] = reps
    out["prompt_ids"] = ids
    return out


def _method_results(specs: list, summaries: dict, identity: dict, profiles: dict, warmed: dict) -> dict:
    """The result's `methods`: each method's spec, summary (with its identity mismatches), compile time, profile."""
    out = {}
    for spec in specs:
        w = [v for (lb, _), v in warmed.items() if lb == spec.label]
        out[spec.label] = {
            "spec": spec.describe(),
            "summary": summaries[spec.label],
            "compile": {"warmups": w, "warmup_s": sum(x["wall_s"] for x in w),
                        "compile_s_est": sum(x.get("compile_s_est", 0.0) for x in w)},
            "profile": profiles.get(spec.profile_key()) if spec.speculative else None,
        }
        out[spec.label]["summary"]["mismatches"] = identity["methods"].get(spec.label, {}).get("mismatches")
    return out


def run_profiles(target, draft, specs, records, n_prompts: int, capacity: int, gen_kw: dict, progress: bool) -> dict:
    """profile=True pass (blocking after each phase) on the first n turn-1 prompts: draft/verify/commit split."""
    todo = {}
    for s in specs:
        if s.speculative and s.profile_key() not in todo:
            todo[s.profile_key()] = s
    recs = [r for r in records if r["turn"] == 1][:n_prompts]
    if not todo or not recs:
        return {}
    bar = progress_bar(len(todo) * (len(recs) + 1), progress, "profile")
    out = {}
    try:
        for key, spec in todo.items():
            _, warm = _timed_generate(target, draft, recs[0]["prompt_ids"], spec, capacity=capacity, profile=True,
                                      **gen_kw)
            if bar is not None:
                bar.update(1)
            tot = {"draft_s": 0.0, "verify_s": 0.0, "commit_s": 0.0, "decode_s": 0.0, "target_calls": 0,
                   "new_tokens": 0}
            for r in recs:
                res, _ = _timed_generate(target, draft, r["prompt_ids"], spec, capacity=capacity, profile=True,
                                         **gen_kw)
                for k in tot:
                    tot[k] += res.stats[k]
                if bar is not None:
                    bar.update(1)
            calls = max(tot["target_calls"], 1)
            phases = tot["draft_s"] + tot["verify_s"] + tot["commit_s"]
            out[key] = {
                "prompts": len(recs), "warmup_s": warm, **tot,
                **{f"{k[:-2]}_ms_per_call": 1e3 * tot[k] / calls for k in ("draft_s", "verify_s", "commit_s")},
                **{f"{k[:-2]}_frac": (tot[k] / phases if phases > 0 else 0.0) for k in ("draft_s", "verify_s", "commit_s")},
                "note": "profile=True blocks after each phase; use the split, not the absolute speed",
            }
    finally:
        if bar is not None:
            bar.close()
    return out


# ----------------------------------------------------------------------------------------------- summary
def summarize(records: list, labels: list, reference: str | None) -> dict:
    """Per-method aggregates over all records (median over repeats for times, repeat 0 for counts)."""
    out = {}
    for lb in labels:
        runs = [r["runs"][lb] for r in records]
        first = [run["repeats"][0] for run in runs]
        decode = [statistics.median(x["decode_s"] for x in run["repeats"]) for run in runs]
        prefill = [statistics.median(x["prefill_s"] for x in run["repeats"]) for run in runs]
        dec_tokens = [max(s["new_tokens"] - 1, 0) for s in first]  # the first new token comes from the prefill
        acc = [a for s in first for a in s["accepted_per_call"]]
        dep = [d for s in first for d in s["depth_per_call"]]
        rows = [r for s in first for r in s.get("verified_per_call", ())]  # records from before the stat: none
        calls = sum(s["target_calls"] for s in first)
        syncs = sum(s["host_syncs"] for s in first)
        dsyncs = sum(s["draft_syncs"] for s in first)
        total_decode = sum(decode)
        out[lb] = {
            "records": len(runs), "new_tokens": sum(s["new_tokens"] for s in first), "decode_tokens": sum(dec_tokens),
            "decode_s": total_decode, "prefill_s": sum(prefill),
            "tokens_per_s": sum(dec_tokens) / total_decode if total_decode > 0 else 0.0,
            "ms_per_token": 1e3 * total_decode / sum(dec_tokens) if sum(dec_tokens) else None,
            "target_calls": calls, "tau": sum(acc) / len(acc) if acc else 0.0,
            # rows the target verified per call (vanilla: 1; a speculative cycle: the verify width it ran at)
            "mean_verified": float(np.mean(rows)) if rows else None,
            "mean_depth": float(np.mean(dep)) if dep else None,
            "depth_hist": {str(k): v for k, v in sorted(Counter(dep).items())},
            "host_syncs": syncs, "host_syncs_per_call": syncs / calls if calls else 0.0,
            "draft_syncs": dsyncs, "draft_syncs_per_call": dsyncs / calls if calls else 0.0,
            "repeat_token_mismatch": sum(1 for run in runs for x in run["repeats"][1:] if x["tokens_match_first"] is False),
        }
    if reference is not None:
        ref = out[reference]
        ref_runs = [r["runs"][reference] for r in records]
        for lb in labels:
            s = out[lb]
            s["speedup"] = s["tokens_per_s"] / ref["tokens_per_s"] if ref["tokens_per_s"] > 0 else None
            per = []
            for r, rr in zip(records, ref_runs):
                run = r["runs"][lb]
                a = statistics.median(x["decode_s"] for x in run["repeats"])
                b = statistics.median(x["decode_s"] for x in rr["repeats"])
                na, nb = run["repeats"][0]["new_tokens"] - 1, rr["repeats"][0]["new_tokens"] - 1
                if a > 0 and b > 0 and na > 0 and nb > 0:
                    per.append((na / a) / (nb / b))
            s["per_prompt_speedup"] = ({"median": statistics.median(per), "min": min(per), "max": max(per)}
                                       if per else None)
    return out


# ----------------------------------------------------------------------------------------------- identity
def first_difference(a: list, b: list) -> int | None:
    """First index where token lists differ (a length difference counts at the shorter length), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logits_at(target, ids: list) -> np.ndarray:
    """Target logits for the token after `ids` (one cache-free forward, padded to a prompt bucket)."""
    T = bucket_length(len(ids))
    toks = np.zeros((1, T), np.int32)
    toks[0, : len(ids)] = ids
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    out = target.forward(jnp.asarray(toks), pos, logit_index=jnp.asarray([[len(ids) - 1]], jnp.int32))
    return np.asarray(out.logits[0, 0], np.float64)


def check_identity(target, records: list, labels: list, reference: str | None = REFERENCE, tie_tol: float = 1e-2,
                   temperature: float = 0.0) -> dict:
    """Count prompts whose tokens differ from the reference method's; classify each greedy mismatch.

    At the first differing position i the target's logits after prompt + reference[:i] are computed once more:
    `margin_top2` = top1 - top2 logit, `gap` = top1 - logit of the method's token. A mismatch is a float
    near-tie when gap <= tie_tol (the method picked an almost-equal alternative), otherwise it is real (a bug)."""
    if reference is None:
        return {"reference": None, "mode": "skipped (no vanilla run)", "methods": {}}
    greedy = temperature <= 0.0
    out = {"reference": reference, "tie_tol": tie_tol,
           "mode": "greedy: must be token-identical" if greedy else
                   "sampling: equal in distribution only; differences are expected and not analysed",
           "methods": {}}
    for lb in labels:
        if lb == reference:
            continue
        m = {"compared": 0, "mismatches": 0, "near_ties": 0, "real_mismatches": 0, "skipped_prompt_differs": 0,
             "details": []}
        for ri, rec in enumerate(records):
            ref_run, run = rec["runs"][reference], rec["runs"][lb]
            ref_prompt = ref_run.get("prompt_ids", rec["prompt_ids"])
            prompt = run.get("prompt_ids", rec["prompt_ids"])
            if prompt != ref_prompt:  # a later turn after different earlier answers
                m["skipped_prompt_differs"] += 1
                continue
            m["compared"] += 1
            i = first_difference(ref_run["tokens"], run["tokens"])
            if i is None:
                continue
            m["mismatches"] += 1
            d = {"record": ri, "id": rec["id"], "turn": rec["turn"], "position": i,
                 "ref_token": ref_run["tokens"][i] if i < len(ref_run["tokens"]) else None,
                 "token": run["tokens"][i] if i < len(run["tokens"]) else None}
            if greedy:
                lg = logits_at(target, list(prompt) + list(ref_run["tokens"][:i]))
                top = np.argsort(-lg)[:2]
                d.update(top1=int(top[0]), top2=int(top[1]), margin_top2=float(lg[top[0]] - lg[top[1]]))
                d["gap"] = float(lg[top[0]] - lg[d["token"]]) if d["token"] is not None else None
                d["near_tie"] = d["gap"] is not None and d["gap"] <= tie_tol
                m["near_ties" if d["near_tie"] else "real_mismatches"] += 1
            m["details"].append(d)
        out["methods"][lb] = m
    out["total_real_mismatches"] = sum(m["real_mismatches"] for m in out["methods"].values())
    return out
