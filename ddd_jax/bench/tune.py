"""Tuner: coordinate descent over EAGLE-2 tree settings, then DDD settings, on a small prompt subset.

Every stage is one `run_benchmark` call over the candidates plus vanilla (interleaved per prompt, warm-up
excluded) and is ranked by speedup over vanilla in that same run. All stages share one KV-cache capacity,
so a tree shape that recurs (the incumbent) is never compiled twice. Stages, in order:

1. EAGLE-2: total_tokens, then depth, then top_k (each stage varies one, keeping the best of the others); then,
   when the space has lookup lengths other than 0, the context-lookup chain (`TreeConfig.lookup`; its nodes
   compete with the head's for the same total_tokens), its score per token (`lookup_logp`, if a lookup won) and
   total_tokens once more (one fewer, one and two more: the chain may earn slots of its own).
2. DDD on the best tree: threshold x (one compile: x is a traced argument), then the check steps S
   (first check at EAGLE-2 depth + offset, then every `check_every` steps below max depth), then whether to
   check at step 0 too (before any expansion step; needs total_tokens - 1 <= top_k), then max depth n
   (EAGLE-2 depth + extra). DDD uses sync="device" here (all sync modes take the same decisions).
3. final: vanilla, the chosen EAGLE-2 and the chosen DDD in one run; their speedups go into the settings' meta
   (with `recommended_method`, the faster of the two).

A stage whose only candidate is the incumbent is skipped.

The result: settings {"tree", "ddd", "meta"} for `ddd_jax.settings.save_settings`, and every stage's table.
`tune` sequences the named steps: `search_capacity`, `search_tree`, `search_ddd` and the final run, all through one
`Stages` (the journal, its replay and the benches).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import jax

from ddd_jax.config import DDDConfig, TreeConfig, check_tree_for_ddd
from ddd_jax.settings import save_settings, weight_storage

from .run import MethodSpec, environment, method_label, normalize_prompts, parse_method, required_capacity, run_benchmark, \
    append_partial, length_bound, open_partial, partial_header


@dataclass(frozen=True)
class SearchSpace:
    """Candidate values. Defaults are small on purpose: each tree shape costs a compile (seconds on CPU)."""

    total_tokens: tuple = (4, 8, 16, 32)
    depth: tuple = (2, 3, 4, 6)
    top_k: tuple = (2, 4, 8)
    threshold: tuple = (-0.1, -0.3, -0.6, -1.0, -2.0)
    check_offsets: tuple = (-1, 0, 1)  # first DDD check step = EAGLE-2 depth + offset (>= 1)
    check_every: int = 2  # further checks every this many steps, below max depth
    max_depth_extra: tuple = (2, 4)  # DDD max depth = EAGLE-2 depth + extra
    step0: tuple = (False, True)  # also check at step 0 (the root's top_k, before any expansion step)
    lookup: tuple = (0,)  # context-lookup chain lengths (0 = none; a stage only when other values are given)
    lookup_logp: tuple = (-0.1, -0.4)  # score per lookup token (a stage only when a lookup was chosen)
    # the incumbent the coordinate descent starts from (default: the median of each grid)
    start_top_k: int | None = None
    start_total_tokens: int | None = None
    start_depth: int | None = None

    def __post_init__(self):
        if min(self.max_depth_extra) < 1:
            raise ValueError("SearchSpace: max_depth_extra values must be >= 1 (DDD needs a check below max depth)")
        if self.check_every < 1:
            raise ValueError("SearchSpace: check_every must be >= 1")
        for name in ("total_tokens", "depth", "top_k", "threshold", "check_offsets", "max_depth_extra", "step0",
                     "lookup", "lookup_logp"):
            if not getattr(self, name):
                raise ValueError(f"SearchSpace: {name} must not be empty")
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("top_k", "total_tokens", "depth"):
            if getattr(self, f"start_{name}") is None:
                grid = sorted(getattr(self, name))
                object.__setattr__(self, f"start_{name}", grid[(len(grid) - 1) // 2])

    def check_steps(self, depth: int, offset: int, max_depth: int, step0: bool = False) -> tuple | None:
        s0 = depth + offset
        if s0 < 1 or s0 >= max_depth:
            return None
        return (0,) * bool(step0) + tuple(range(s0, max_depth, self.check_every))

    def contains(self, settings: dict) -> bool:
        """Whether tuned settings lie in this space (the tuner's own invariant; used by tests)."""
        t, d = settings["tree"], settings["ddd"]
        top_k = set(self.top_k) | {self.start_top_k}
        total = set(self.total_tokens) | {self.start_total_tokens}
        depth = set(self.depth) | {self.start_depth}
        if t["top_k"] not in top_k or t["depth"] not in depth:
            return False
        lookup = t.get("lookup", 0)
        if lookup not in set(self.lookup) | {0}:
            return False
        if lookup and t.get("lookup_logp", -0.4) not in self.lookup_logp:
            return False
        if lookup:  # the stage after the lookup's moves total_tokens by -1 .. +2
            total = {n + e for n in total for e in (-1, 0, 1, 2)}
        if t["total_tokens"] not in total:
            return False
        extra = d["max_depth"] - t["depth"]
        if extra not in self.max_depth_extra or d["threshold"] not in self.threshold:
            return False
        return any(tuple(d["check_steps"]) == self.check_steps(t["depth"], o, d["max_depth"], z)
                   for o in self.check_offsets for z in self.step0)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def _valid_tree(top_k, total_tokens, depth, **lookup) -> TreeConfig | None:
    try:
        return TreeConfig(top_k=top_k, total_tokens=total_tokens, depth=depth, **lookup)
    except ValueError:
        return None


def _valid_ddd(tree: TreeConfig, check_steps, threshold, max_depth) -> DDDConfig | None:
    if not check_steps:
        return None
    try:
        d = DDDConfig(check_steps=check_steps, threshold=threshold, max_depth=max_depth)
        check_tree_for_ddd(tree, d)
    except ValueError:
        return None
    return d


JOURNAL_NAME = "tune.partial.jsonl"  # the stages a tune finished, in the checkpoint folder


def search_capacity(target, draft, space: SearchSpace, prompts: list, max_new_tokens: int, chat: bool) -> int:
    """One KV-cache capacity for every stage: the largest slack over the whole space (so the incumbent, which recurs
    in every stage, compiles once)."""
    all_specs = [parse_method("vanilla")]
    for k in set(space.top_k) | {space.start_top_k}:
        for n in set(space.total_tokens) | {space.start_total_tokens}:
            for dp in set(space.depth) | {space.start_depth}:
                L = max(space.lookup)  # the deepest accepted path and the largest tree the lookup stages try
                t = _valid_tree(k, n + 2, dp, lookup=L) if L else _valid_tree(k, n, dp)
                if t is None:
                    continue
                nmax = dp + max(space.max_depth_extra)
                dd = DDDConfig(check_steps=(nmax - 1,), threshold=-1.0, max_depth=nmax)
                all_specs += [parse_method("eagle2", t),
                              MethodSpec("capacity", "ddd-device", "ddd", "device", None, t, dd)]
    bounds = [length_bound(target, p, 0, max_new_tokens, chat) for p in prompts]
    return required_capacity(target, draft, all_specs, bounds, max_new_tokens)


class Stages:
    """The search's stages, run or replayed: `run(name, cands)` benches vanilla and the candidates
    ([(value, MethodSpec)]) in one interleaved run and returns (the best row, all rows). With a `journal` each
    finished stage is appended to it and the stage under way keeps its own bench checkpoint beside it; stages an
    earlier, killed run journaled (`done`) are replayed instead, after checking they are the same stage over the
    same candidates."""

    def __init__(self, bench, journal: Path | None, done: list, log):
        self.bench, self.journal, self.done, self.log = bench, journal, done, log
        self.stages: list[dict] = []

    def measure(self, name: str, cands: list, ckpt) -> dict:
        """One interleaved bench of vanilla and the candidates; the stage's record."""
        res = self.bench([parse_method("vanilla")] + [s for _, s in cands], ckpt)
        rows = []
        for value, spec in cands:
            s = res["methods"][spec.label]["summary"]
            rows.append({"value": value, "label": spec.label, "speedup": s["speedup"], "tau": s["tau"],
                         "tokens_per_s": s["tokens_per_s"], "mean_depth": s["mean_depth"],
                         "mismatches": s["mismatches"], "spec": spec.describe(),
                         "compile_s_est": res["methods"][spec.label]["compile"]["compile_s_est"]})
        return {"stage": name, "rows": rows, "best": max(rows, key=lambda r: r["speedup"] or 0.0)["label"],
                "vanilla_tokens_per_s": res["methods"]["vanilla"]["summary"]["tokens_per_s"],
                "identity_real_mismatches": res["identity"]["total_real_mismatches"]}

    def run(self, name: str, cands: list) -> tuple[dict, list]:
        i = len(self.stages)
        if i < len(self.done):
            st = self.done[i]
            was, now = [r["label"] for r in st["rows"]], [s.label for _, s in cands]
            if st["stage"] != name or was != now:
                raise ValueError(f"{self.journal}: stage {i + 1} is {st['stage']} over {was}, this search's is {name} "
                                 f"over {now}; start over (--no-resume, resume=False)")
        else:
            ckpt = None if self.journal is None else self.journal.parent / f"tune-stage{i + 1}.partial.jsonl"
            st = self.measure(name, cands, ckpt)
            if self.journal is not None:
                append_partial(self.journal, {"stage_index": i, "stage": st})
                ckpt.unlink(missing_ok=True)
        self.stages.append(st)
        best = next(r for r in st["rows"] if r["label"] == st["best"])
        if self.log:
            self.log(f"[tune] {name}: best {best['label']} speedup {best['speedup']:.3f} tau {best['tau']:.2f}"
                     + (" (journaled)" if i < len(self.done) else ""))
        return best, st["rows"]


def _tree_cands(cur: dict, param: str, values) -> list:
    """(value, EAGLE-2 spec) for each valid tree that differs from `cur` in `param` only (the incumbent included)."""
    cands = []
    for v in sorted(set(values) | {cur[param]}):
        t = _valid_tree(**{**cur, param: v})
        if t is not None:
            cands.append((v, parse_method(method_label("eagle2", t), t)))
    return cands


def search_tree(space: SearchSpace, stages: Stages) -> dict:
    """Step 1: the EAGLE-2 tree by coordinate descent (total_tokens, depth, top_k; then the lookup chain, its score
    and total_tokens again when a lookup won); returns the tree's fields."""
    cur = {"top_k": space.start_top_k, "total_tokens": space.start_total_tokens, "depth": space.start_depth}
    if _valid_tree(**cur) is None:
        raise ValueError(f"tune: the starting tree {cur} is not valid (total_tokens - 1 must fit top_k + "
                         "depth * top_k**2); change the grids or the start_* values")
    for param in ("total_tokens", "depth", "top_k"):
        cands = _tree_cands(cur, param, getattr(space, param))
        if len(cands) < 2:  # only the incumbent: nothing to learn
            continue
        best, _ = stages.run(f"eagle2:{param}", cands)
        cur = dict(best["spec"]["tree"])
    if len(set(space.lookup) | {0}) > 1:  # the lookup chain, competing with the head's nodes for the tree's slots
        cands = []
        for v in sorted(set(space.lookup) | {0}):
            kw = dict(lookup=v, lookup_logp=space.lookup_logp[0]) if v else {}
            t = _valid_tree(**cur, **kw)
            if t is not None:
                cands.append((v, parse_method(method_label("eagle2", t), t)))
        best, _ = stages.run("eagle2:lookup", cands)
        cur = dict(best["spec"]["tree"])
        if cur.get("lookup"):
            for param, values in (("lookup_logp", space.lookup_logp),
                                  ("total_tokens", tuple(cur["total_tokens"] + e for e in (-1, 1, 2)))):
                cands = _tree_cands(cur, param, values)
                if len(cands) < 2:
                    continue
                best, _ = stages.run(f"eagle2:lookup:{param}", cands)
                cur = dict(best["spec"]["tree"])
    return cur


def search_ddd(space: SearchSpace, tree: TreeConfig, stages: Stages) -> MethodSpec:
    """Step 2: DDD's rule on the tuned tree (threshold, first check offset, a step-0 check, max depth), each stage
    varying one of them; returns the winning DDD spec."""
    d0 = tree.depth
    pick = {"check_offsets": sorted(space.check_offsets, key=abs)[0], "step0": space.step0[0],
            "threshold": space.threshold[len(space.threshold) // 2], "max_depth_extra": space.max_depth_extra[0]}

    def spec(p: dict) -> MethodSpec | None:
        n = d0 + p["max_depth_extra"]
        dd = _valid_ddd(tree, space.check_steps(d0, p["check_offsets"], n, p["step0"]), p["threshold"], n)
        return None if dd is None else parse_method(method_label("ddd-device", tree, dd), tree, dd)

    if spec(pick) is None:
        ok = [(o, e, z) for o in space.check_offsets for e in space.max_depth_extra for z in space.step0
              if spec({**pick, "check_offsets": o, "max_depth_extra": e, "step0": z})]
        if not ok:
            raise ValueError(f"no DDD setting in the search space fits the tuned tree {tree}")
        pick.update(check_offsets=ok[0][0], max_depth_extra=ok[0][1], step0=ok[0][2])
    for param in ("threshold", "check_offsets", "step0", "max_depth_extra"):
        cands = [(v, s) for v in getattr(space, param) if (s := spec({**pick, param: v})) is not None]
        if len(cands) < 2:
            continue
        best, _ = stages.run(f"ddd:{param}", cands)
        pick[param] = best["value"]
    return spec(pick)


def tune(target, draft, prompts, space: SearchSpace | None = None, *, max_new_tokens: int = 64, repeat: int = 1,
         chat: bool = True, progress: bool = True, log=print, draft_name: str | None = None,
         checkpoint_dir=None, resume: bool = True) -> dict:
    """Search the space on `prompts` (a few); returns {"settings", "stages", "env", "config"}.

    checkpoint_dir: a folder where each finished stage is journaled (`JOURNAL_NAME`) and the stage under way keeps
    its bench checkpoint (`run_benchmark(checkpoint=...)`); with resume (default) a tune killed part way replays
    the journaled stages, since the descent's later candidates follow from them, and goes on from the prompt its
    last stage reached. A journal of another search (space, prompts, settings, models) is refused by name. The
    caller removes the journal once the result is written; resume=False starts over."""
    space = space or SearchSpace()
    prompts = normalize_prompts(prompts)
    if draft is None:
        raise ValueError("tuning needs a draft head")
    capacity = search_capacity(target, draft, space, prompts, max_new_tokens, chat)
    common = dict(max_new_tokens=max_new_tokens, repeat=repeat, chat=chat, capacity=capacity, profile_prompts=0,
                  progress=progress, draft_name=draft_name)
    journal, done = None, []
    if checkpoint_dir is not None:
        journal = Path(checkpoint_dir) / JOURNAL_NAME
        header = partial_header(kind="tune", space=space.to_dict(), max_new_tokens=max_new_tokens, repeat=repeat,
                                 chat=chat, capacity=capacity, target=target.name, draft=draft_name,
                                 draft_dtype=draft.weight_dtype, prompts=prompts)
        done = [g["stage"] for g in open_partial(journal, header, resume, index="stage_index")]
    stages = Stages(lambda specs, ckpt: run_benchmark(target, draft, prompts, specs, **common, checkpoint=ckpt,
                                                      resume=resume), journal, done, log)
    cur = search_tree(space, stages)
    tree = TreeConfig(**cur)
    dd = search_ddd(space, tree, stages)
    # step 3: the chosen EAGLE-2 and DDD settings side by side in one run (comparable numbers)
    winner, rows = stages.run("final", [("eagle2", parse_method(method_label("eagle2", tree), tree)), ("ddd", dd)])
    fin = {r["value"]: r for r in rows}
    env = environment()
    settings = {
        "tree": dict(cur), "ddd": {"check_steps": list(dd.ddd.check_steps), "threshold": dd.ddd.threshold,
                                   "max_depth": dd.ddd.max_depth},
        # the head's weight dtype these speeds were measured with (the CLIs load it so again)
        "draft_dtype": draft.weight_dtype,
        "meta": {"backend": env["backend"], "device": env["device"], "date": env["date"], "target": target.name,
                 "draft": draft_name, "objective": "decode speedup over vanilla (same run)",
                 "prompts": len(prompts), "max_new_tokens": max_new_tokens,
                 "eagle2": {"speedup": fin["eagle2"]["speedup"], "tau": fin["eagle2"]["tau"]},
                 "ddd": {"speedup": fin["ddd"]["speedup"], "tau": fin["ddd"]["tau"]},
                 "recommended_method": winner["value"],
                 "search_space": space.to_dict(), "jax": env["jax"],
                 "weight_storage": weight_storage(target) or "float"},
    }
    return {"format": "ddd-jax-tune", "settings": settings, "stages": stages.stages, "env": env,
            "config": {"capacity": capacity, "max_new_tokens": max_new_tokens, "repeat": repeat,
                       "prompts": len(prompts), "target": target.name, "draft": draft_name}}


def tune_and_save(target, draft, prompts, space: SearchSpace | None = None, backend: str | None = None,
                  path=None, **kw) -> tuple[dict, str]:
    """`tune`, then write the settings file for `backend` (default jax.default_backend())."""
    res = tune(target, draft, prompts, space, **kw)
    p = save_settings(res["settings"], backend=backend or jax.default_backend(), path=path,
                      storage=weight_storage(target))
    return res, str(p)
