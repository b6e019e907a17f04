"""The head-training recipe: self-distilled replies, an EAGLE-3 head (TTT), optionally an EAGLE-1/2 head, export,
held-out top-1 and acceptance, in one run that ends by itself before a deadline (`ddd-jax train-draft recipe`).

Stages, in order, each a named function with explicit inputs and outputs; `run_recipe` runs them, records each in
`DIR/recipe.json` as it starts and ends, and copies each stage's product to `export_dir` as soon as the stage
finishes (`export_dir.ExportDir`: at most 8 files, 16 MiB each, what a remote run hands back), so a run cut off
early still leaves what it finished:

    (a) regenerate   `regenerate_stage`: the target's own greedy replies to the held-out prompts, then to the
                     training prompts until `regen_until`; exported as `regen.npz` (token ids)
    (b) eagle3       `eagle3_stage`: an EAGLE-3 head with training-time test on this run's replies plus the inputs'
                     text (`cfg.data`), at most `eagle3.max_epochs` passes, held-out loss every `eval_every` steps,
                     the best exported as `<target>-eagle3.tar` each time it improves; `init` continues a head
    (c) eagle1       `eagle1_stage` (CPU only by default, `train_eagle1`): an EAGLE-1/2 head on the same replies
    (e) heldout      `heldout_stage`: top-1 agreement with the target on the held-out replies (per TTT step for
                     EAGLE-3: the fit's best held-out score; step 0 for EAGLE-1)
    (f) acceptance   `acceptance_stage` (CPU only by default, `acceptance`): τ over the MT-bench first turns at
                     EAGLE-2's default tree, DDD's paper settings and the shipped tuned trees, beside the shipped
                     head; on a GPU, `ddd-jax train-draft accept` measures τ afterwards on the CPU

Time: stage ends are fractions of the budget, which is the time left before `deadline` (wall time from process
start, `--deadline-s`), or `budget_s` from the start of stage (a) without one. A rerun with the same DIR skips the
stages recorded as done and restarts the others. Inputs: token ids only (`recipe_inputs`), so a machine without
the asset packages or a network can run it from one .npz. MT-bench never enters training.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddd_jax import io as dio

from .accept import acceptance_runs, device_info  # noqa: F401 (recipe.acceptance_runs: what its tests call)
from .eagle3_fit import Fit3Config
from .recipe_inputs import (INPUTS_FORMAT, PARTS, PROBE_TEXT, TEXT, check_inputs_for, load_inputs,  # noqa: F401
                            prepare_inputs, save_inputs)
from .train import FitConfig

RECIPE_FORMAT = "ddd-jax-recipe"
MODES = ("auto", "on", "off")
DATA = ("regen", "regen-first", "all")
SPARE_TO = ("regenerate", "epochs")


@dataclass(frozen=True)
class RecipeConfig:
    """Sizes of one recipe run. The defaults fit one H100/H200 in a 600 s remote run; `SMOKE` is the CPU check.
    The two fits' own configs are `eagle3` and `eagle1`; their `steps` are upper bounds (the time and
    `eagle3.max_epochs` decide)."""

    budget_s: float = 500.0  # wall time from the start of stage (a), when no deadline is given
    regen_until: float = 0.35  # stage ends, as fractions of the budget
    eagle3_until: float = 0.70  # when a later stage runs; else the fit may run until last_until
    eagle1_until: float = 0.82
    last_until: float = 0.97  # the last stage that runs ends here (the rest: held-out scores, final writes)
    train_eagle1: str = "auto"  # "auto": on the CPU only (on a GPU its share goes to the EAGLE-3 fit)
    acceptance: str = "auto"  # "auto": on the CPU only (GPU heads: `train-draft accept` afterwards, on the CPU)
    data: str = "regen-first"  # what the EAGLE-3 fit learns from: "regen" (the replies regenerated here and in
    # earlier runs), "regen-first" (those first in every epoch, then the inputs' ShareGPT conversations, labelled by
    # the target in the fit: a short fit learns from the replies alone, a long one goes on instead of repeating
    # them), "all" (both shuffled together)
    train_prompts: int = 0  # 0: every training prompt of the inputs (the time limit stops regeneration)
    holdout_prompts: int = 256
    regen_batch: int = 512  # rows of every regeneration batch (one compile per prompt bucket)
    regen_max_new: int = 256
    eagle3: Fit3Config = Fit3Config(steps=100_000, batch_size=8, seq_len=1024, ttt_steps=7, draft_vocab_size=8192,
                                    lr=5e-4, warmup=40, dtype="bfloat16", max_epochs=2.0)
    eval_every: int = 100  # EAGLE-3 held-out loss every N steps (the best is exported)
    eagle1: FitConfig = FitConfig(steps=100_000, batch_size=16, seq_len=1024, lr=5e-4, dtype="bfloat16")
    e1_max_tokens: int = 8_000_000  # replies' tokens featurised for EAGLE-1 (host memory: 1.2 KB a token)
    feature_batch: int = 64
    eval_batches: int = 8
    tau_prompts: int = 80
    tau_max_new: int = 128
    tau_batch: int = 80
    tau_labels: int = 0  # how many of stage (f)'s runs each head gets, most important first (0: all of them)
    probe_steps: int = 3
    compile_ahead: bool = True  # build (a)'s and (b)'s programs on background threads from the start (off: as met)
    spare_to: str = "regenerate"  # the time the EAGLE-3 fit's epoch cap leaves it unable to use (`FitPlan`):
    # "regenerate" (regeneration runs longer: more of the target's own replies) or "epochs" (no epoch cap)
    fit_overhead_s: float = 10.0  # what `FitPlan` predicts the fit spends outside its steps and held-out scores
    reference_head: str = "shipped"  # measured beside the new heads in (f): a head name or directory; "shipped":
    # the packaged "<target>-eagle" when there is one; "": none

    def __post_init__(self):
        if not 0 < self.regen_until < self.eagle3_until <= self.eagle1_until <= self.last_until <= 1:
            raise ValueError("RecipeConfig: need 0 < regen_until < eagle3_until <= eagle1_until <= last_until <= 1, "
                             f"got {self.regen_until}, {self.eagle3_until}, {self.eagle1_until}, {self.last_until}")
        if self.tau_labels < 0:
            raise ValueError(f"RecipeConfig.tau_labels must be >= 0 (0: every run), got {self.tau_labels}")
        if self.budget_s <= 0:
            raise ValueError(f"RecipeConfig.budget_s must be > 0, got {self.budget_s}")
        for name in ("train_eagle1", "acceptance"):
            if getattr(self, name) not in MODES:
                raise ValueError(f"RecipeConfig.{name} must be one of {MODES}, got {getattr(self, name)!r}")
        if self.spare_to not in SPARE_TO:
            raise ValueError(f"RecipeConfig.spare_to must be one of {SPARE_TO}, got {self.spare_to!r}")
        if self.data not in DATA:
            raise ValueError(f"RecipeConfig.data must be one of {DATA}, got {self.data!r}")
        if self.eagle3.warmup <= self.probe_steps + 1:
            raise ValueError(f"RecipeConfig: eagle3.warmup ({self.eagle3.warmup}) must exceed probe_steps + 1 "
                             f"({self.probe_steps + 1}): the probe's learning rates must not depend on the step count")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def runs(self, name: str, backend: str) -> bool:
        """Whether the optional stage `name` ("train_eagle1", "acceptance") runs on `backend`."""
        mode = getattr(self, name)
        return mode == "on" or (mode == "auto" and backend == "cpu")


SMOKE = RecipeConfig(budget_s=300.0, train_prompts=12, holdout_prompts=4, regen_batch=4, regen_max_new=24,
                     eagle3=Fit3Config(steps=4, batch_size=1, seq_len=128, ttt_steps=2, draft_vocab_size=512,
                                       warmup=8, max_epochs=0.0),
                     eval_every=2, eagle1=FitConfig(steps=4, batch_size=1, seq_len=128), e1_max_tokens=4096,
                     feature_batch=4, eval_batches=2, tau_prompts=2, tau_max_new=16, tau_batch=2, tau_labels=1,
                     probe_steps=2)


def with_overrides(cfg: RecipeConfig, assignments) -> RecipeConfig:
    """`cfg` with "field=value" assignments applied, dotted into the fits' configs ("eagle3.batch_size=16",
    "regen_max_new=128"). A value takes the type of the field it replaces; the configs' own checks run again."""

    def assign(obj, path: list[str], text: str, where: str):
        names = [f.name for f in dataclasses.fields(obj)]
        if path[0] not in names:
            raise ValueError(f"--set {where}: {type(obj).__name__} has no field {path[0]!r} (fields: "
                             f"{', '.join(names)})")
        old = getattr(obj, path[0])
        if len(path) > 1:
            if not dataclasses.is_dataclass(old):
                raise ValueError(f"--set {where}: {path[0]!r} is a {type(old).__name__}, not a config with fields")
            return dataclasses.replace(obj, **{path[0]: assign(old, path[1:], text, where)})
        if dataclasses.is_dataclass(old):
            raise ValueError(f"--set {where}: {path[0]!r} is a config; set one of its fields ({path[0]}.<field>=...)")
        try:
            if isinstance(old, bool):
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(text)
                value = text.lower() in ("true", "1")
            else:
                value = type(old)(text)
        except ValueError:
            raise ValueError(f"--set {where}: {text!r} is not a valid {type(old).__name__}") from None
        return dataclasses.replace(obj, **{path[0]: value})

    for a in assignments:
        key, eq, text = a.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--set {a!r}: expected FIELD=VALUE, e.g. eagle3.batch_size=16")
        cfg = assign(cfg, key.strip().split("."), text.strip(), a)
    return cfg


# ----------------------------------------------------------------------------------------------- the run


def process_start() -> float:
    """When this process started (time.time() scale): from /proc on Linux, else when this module was imported."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, field 22: clock ticks after boot
        import os
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


_IMPORTED = time.time()


class Record:
    """DIR/recipe.json, rewritten atomically whenever a stage starts or ends (and copied to the export folder)."""

    def __init__(self, out: Path, header: dict, export=None):
        self.path = out / "recipe.json"
        self.export = export
        old = dio.read_json(self.path) if self.path.is_file() else {}
        self.data = {**header, "stages": old.get("stages", {})}
        self.write()

    def done(self, name: str) -> dict | None:
        st = self.data["stages"].get(name)
        return st if st and st.get("status") == "done" else None

    def set(self, name: str, **fields) -> None:
        self.data["stages"][name] = {**self.data["stages"].get(name, {}), **fields}
        self.write()

    def start(self, name: str) -> None:
        """A stage (re)starts: what an earlier attempt recorded (its error) goes."""
        self.data["stages"][name] = {"status": "running", "started_utc": dio.utc_now()}
        self.write()

    def write(self) -> None:
        text = json.dumps(self.data, indent=1)
        dio.atomic_write_text(self.path, text)
        if self.export is not None:
            self.export.put_bytes("recipe.json", text.encode())


class Clock:
    """The run's stage ends: fractions of the budget after `t0`, never past the deadline."""

    def __init__(self, cfg: RecipeConfig, deadline: float | None, t0: float | None = None):
        self.t0 = time.time() if t0 is None else t0
        self.budget = cfg.budget_s if deadline is None else max(0.0, deadline - self.t0)
        self.end = self.t0 + self.budget

    def at(self, frac: float) -> float:
        return self.t0 + frac * self.budget

    def left(self, frac: float) -> float:
        return max(0.0, self.at(frac) - time.time())


def _stage(rec: Record, name: str, fn, *args, fatal: bool = False, **kwargs):
    """Run one stage, recording its status, seconds and result (or its error)."""
    t = time.time()
    rec.start(name)
    try:
        result = fn(*args, **kwargs) or {}
    except Exception as e:  # noqa: BLE001 -- recorded; later stages may still run
        rec.set(name, status="failed", seconds=round(time.time() - t, 1), error=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc()[-3000:])
        if fatal:
            raise
        return None
    rec.set(name, status="done", seconds=round(time.time() - t, 1), **result)
    return result


def token_set(records: list, max_len: int, text: list = ()):
    """FeatureSet of the regenerated records' ids and loss masks (replies count), then of the `text` entries
    ((key, ids, mask)), no features."""
    from .extract import FeatureSet
    from .regen import example_from_record
    exs = [e for e in (example_from_record(r, max_len) for r in records) if e is not None]
    for key, ids, mask in text:
        ids, mask = np.asarray(ids[:max_len], np.int32), np.asarray(mask[:max_len], np.uint8)
        if len(ids) >= 2 and mask[1:].sum() > 0:
            exs.append({"id": key, "ids": ids, "mask": mask})
    if not exs:
        raise ValueError("no regenerated reply to train on")
    offs = np.concatenate([[0], np.cumsum([len(e["ids"]) for e in exs])]).astype(np.int64)
    return FeatureSet(np.concatenate([e["ids"] for e in exs]), None, np.concatenate([e["mask"] for e in exs]),
                      offs, [e["id"] for e in exs], {"source": {"kind": "regenerated"}})


def fit_text(inputs: dict, data: str) -> list:
    """The inputs' text entries the EAGLE-3 fit learns from with `RecipeConfig.data`: earlier runs' replies first,
    then (unless "regen") ShareGPT's conversations."""
    text = inputs.get(TEXT, [])
    return [e for e in text if e[0].startswith("regen:")] + ([] if data == "regen" else
                                                             [e for e in text if not e[0].startswith("regen:")])


def text_tokens(inputs: dict, data: str, max_len: int) -> int:
    """Tokens of the inputs' text the EAGLE-3 fit learns from (`fit_text`), each entry cut to `max_len`."""
    return sum(min(len(ids), max_len) for _, ids, _ in fit_text(inputs, data))


def fit_groups(fs, data: str):
    """`fit_eagle3`'s groups for "regen-first": 0 for the target's own replies, 1 for ShareGPT's text; else None."""
    if data != "regen-first":
        return None
    return np.asarray([int(str(k).startswith("sharegpt:")) for k in fs.seq_ids], np.int32)


def _with_features(target, fs, cfg: RecipeConfig, max_tokens: int | None, progress: bool):
    """The first sequences of `fs` up to `max_tokens`, with final-normed target features."""
    from .extract import FeatureSet, features_in_batches
    n = len(fs.offsets) - 1
    if max_tokens is not None:
        n = max(1, int(np.searchsorted(fs.offsets, max_tokens, side="right")) - 1)
    end = int(fs.offsets[n])
    seqs = [fs.ids[fs.offsets[k]:fs.offsets[k + 1]] for k in range(n)]
    longest = int(max(len(s) for s in seqs))
    buckets = sorted({128, 256, 512, 1024, 2048, -(-longest // 128) * 128})
    feats = features_in_batches(target, seqs, buckets, cfg.feature_batch, progress=progress)
    return FeatureSet(fs.ids[:end], feats, fs.mask[:end], fs.offsets[:n + 1], fs.seq_ids[:n], fs.manifest)


def _fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    return path


# ---------------------------------------------------------------------------------------------- the stages


def regenerate_stage(target, inputs: dict, cfg: RecipeConfig, regen_dir: Path, time_limit_s: float,
                     progress: bool, stop=None) -> dict:
    """(a) The target's replies: the held-out prompts first (few), then the training prompts until `time_limit_s`
    after the stage starts or until `stop(done)` (`FitPlan.stop_regen`) says so, at least one batch of them (later
    stages need training data). Every batch has `cfg.regen_batch` rows, over one plan of prompt buckets and cache
    capacity for both parts."""
    from .regen import compile_plan, regen_plan, regenerate
    t = time.time()
    parts = {"holdout": inputs["holdout"][:cfg.holdout_prompts] if cfg.holdout_prompts else inputs["holdout"],
             "train": inputs["train"][:cfg.train_prompts] if cfg.train_prompts else inputs["train"]}
    plan = regen_plan(target, list(parts.values()), cfg.regen_batch, cfg.regen_max_new)
    warm = compile_plan(target, plan, cfg.regen_max_new) if cfg.compile_ahead else {}  # all at once, other threads
    out = {}
    for part, prompts in parts.items():
        limit = max(0.0, time_limit_s - (time.time() - t)) if part == "train" else None
        out[part] = regenerate(target, prompts, regen_dir / f"{part}.jsonl", max_new_tokens=cfg.regen_max_new,
                               time_limit_s=limit, min_batches=int(part == "train"), progress=progress, warm=warm,
                               stop=stop if part == "train" else None, **plan)
    new = sum(r["new_reply_tokens"] for r in out.values())
    seconds = time.time() - t
    built = {str(k): f.result() for k, f in warm.items() if f.done() and f.exception() is None}
    return {**out, "compiles": sum(r["compiles"] for r in out.values()),
            "programs": sum(r["programs"] for r in out.values()), "compiled_ahead_s": built, "new_reply_tokens": new,
            "new_tokens_per_s": round(new / max(seconds, 1e-9), 1), "rows": plan["batch_size"],
            "buckets": list(plan["buckets"]), "capacity": plan["capacity"]}


def eagle3_stage(target, train, held, cfg: RecipeConfig, run_dir: Path, head_dir: Path, budget_s: float,
                 init: dict | None, on_best, progress: bool, ahead=None, stop=None) -> dict:
    """(b) The EAGLE-3 fit, sized to `budget_s` and to `cfg.eagle3.max_epochs` (none with `spare_to="epochs"`),
    held-out loss every `cfg.eval_every` steps; the best head is written to `head_dir` at the end and passed to
    `on_best` as it comes. One clock: a retry with half the batch (`halving_batch`) gets what is left of `budget_s`.
    ahead: `compile_ahead`'s future (its programs are used when they were built for the fit's shapes); stop: ends the
    fit before its next step when it returns true. No optimizer state is saved (the recipe never resumes a fit)."""
    from .eagle3_fit import fit_eagle3
    end = time.time() + budget_s
    fit_cfg = cfg.eagle3 if cfg.spare_to == "regenerate" else dataclasses.replace(cfg.eagle3, max_epochs=0.0)
    r, _, retries = halving_batch(lambda fc: fit_eagle3(
        target, train, _fresh(run_dir), fc, time_budget_s=max(1.0, end - time.time()), probe_steps=cfg.probe_steps,
        ckpt_every=None, log_every=10, export_dir=head_dir, progress=progress, init=init, eval_set=held,
        eval_every=cfg.eval_every, eval_max_batches=cfg.eval_batches, on_best=on_best,
        groups=fit_groups(train, cfg.data), ahead=ahead, stop=stop), fit_cfg)
    sized = r["sized_to_budget"] or {}
    return {"steps": r["step"], "epochs": r["epochs"], "fit_config": r["fit_config"].to_dict(), "ahead": r["ahead"],
            "train_tokens": train.n_tokens, "train_loss_tokens": int(train.mask.sum()),
            "epoch_cap_steps": r["epoch_cap"]["steps"], "step_s": sized.get("probe_s_per_step"),
            "fit_s": r["seconds"], "last_metrics": r["last_metrics"], "best": r["best"], "init": init is not None,
            "head": str(head_dir), "export": _head_files(head_dir), "batch_retries": retries}


def heldout_stage(target, heads: dict, held, cfg: RecipeConfig, fit3: dict | None) -> dict:
    """(e) Held-out top-1 per head: EAGLE-3's is the fit's best held-out score (per TTT step, in the fit's dtype)
    when the fit scored one, else measured here in float32; EAGLE-1/2's at step 0."""
    scores = {"eagle1": lambda draft: _eval_eagle1(target, draft, held, cfg),  # each head kind's held-out score
              "eagle3": lambda draft: _heldout_eagle3(target, draft, held, cfg, fit3)}
    return {"heads": {name: scores[draft.config.head_type](draft) for name, draft in heads.items()}}


def _heldout_eagle3(target, draft, held, cfg: RecipeConfig, fit3: dict | None) -> dict:
    """An EAGLE-3 head's held-out top-1 per TTT step: the fit's best when it scored one, else measured in float32."""
    import jax

    from . import eagle3_fit
    if fit3 and fit3.get("best"):
        return {**fit3["best"]["eval"], "step": fit3["best"]["step"], "dtype": cfg.eagle3.dtype}
    p = jax.tree.map(lambda x: np.asarray(x, np.float32) if x.dtype.kind == "f" else np.asarray(x), draft.params)
    return eagle3_fit.evaluate(target, p, held, dataclasses.replace(cfg.eagle3, dtype="float32"), cfg.eval_batches)


def acceptance_stage(target, runs: dict, prompts: list, cfg: RecipeConfig, measured: dict, deadline: float,
                     on_update, progress: bool) -> dict:
    """(f) τ of `runs` ({label: run}, `acceptance_runs`) over `prompts`, keeping what `measured` already holds
    (`accept.measure_acceptance`); `on_update(results)` sees the results after each run."""
    from .accept import measure_acceptance
    return measure_acceptance(target, runs, prompts, measured, max_new_tokens=cfg.tau_max_new,
                              batch_size=cfg.tau_batch, deadline=deadline, on_update=on_update, progress=progress)


# ------------------------------------------------------------------------------------------- the fit's plan


class FitPlan:
    """How the run shares its time between regeneration and the EAGLE-3 fit, so the GPU is never idle.

    Once the fit's programs are built (`eagle3_fit.compile_ahead`, on another thread while (a) runs), `measure`
    times its step on this device (`eagle3_fit.measure_step`). From then on, before every batch of training
    prompts, `stop_regen` predicts the steps the fit's share of the budget and its epoch cap allow over the data
    so far: a fit that its epoch cap would stop early cannot use the rest of its share, so regeneration goes on past
    `regen_until` (more replies: more rows for the fit, and the target's own replies teach most per token, see
    docs/training.md) until the rest of the share is what the fit can use. `cfg.spare_to="epochs"` instead keeps
    regeneration to its share and lifts the fit's epoch cap. Without a measurement (no programs built ahead, or
    not yet built), regeneration ends at `regen_until`. recipe.json's `plan` records the prediction;
    `stages.eagle3` what happened."""

    def __init__(self, cfg: RecipeConfig, clock: Clock, fit_end: float, text_tokens: int, ahead=None, reserve=None):
        self.cfg, self.clock, self.fit_end, self.ahead = cfg, clock, fit_end, ahead
        self.reserve = reserve or (lambda: 0.0)  # seconds kept after the fit (the head writer's)
        self.tokens0 = text_tokens  # training tokens the fit has before this run's replies
        self.timing: dict | None = None
        self.record: dict = {"spare_to": cfg.spare_to, "step_s": None}

    def measure(self, target, n_vocab: int) -> None:
        """Time the fit's step once its programs are ready (a no-op before, and after the first time)."""
        if self.timing is not None or self.ahead is None or not self.ahead.done() or self.ahead.exception():
            return
        from .eagle3_fit import measure_step
        t = time.time()
        self.timing = measure_step(target, self.cfg.eagle3, self.ahead.result(), n_vocab)
        self.record.update(step_s=round(self.timing["step_s"], 4), eval_batch_s=round(self.timing["eval_batch_s"], 4),
                           measured_at_s=round(t - self.clock.t0, 1), measure_s=round(time.time() - t, 2))

    def fit_seconds(self, steps: int) -> float:
        """Predicted seconds of a fit of `steps` steps: its steps, its held-out scores, its fixed costs."""
        evals = steps // max(self.cfg.eval_every, 1) + 1
        return (self.cfg.fit_overhead_s + steps * self.timing["step_s"]
                + evals * self.cfg.eval_batches * self.timing["eval_batch_s"])

    def predict(self, tokens: int, steps_per_epoch: int | None = None, now: float | None = None) -> dict:
        """The fit's steps over `tokens` training tokens (rows estimated from them unless `steps_per_epoch`), if it
        started at `now`: {"steps", "epoch_cap_steps", "share_s", "limited_by"}."""
        e3 = self.cfg.eagle3
        now = time.time() if now is None else now
        spe = max(1, tokens // (e3.seq_len * e3.batch_size)) if steps_per_epoch is None else steps_per_epoch
        cap = min(e3.steps, int(e3.max_epochs * spe)) if e3.max_epochs and self.cfg.spare_to == "regenerate" \
            else e3.steps
        share = max(0.0, self.fit_end - self.reserve() - now)
        fits = int(max(0.0, share - self.fit_seconds(0)) / max(self.timing["step_s"], 1e-9))
        return {"steps": min(cap, fits), "epoch_cap_steps": cap, "share_s": round(share, 1),
                "limited_by": "epoch cap" if cap < fits else "time"}

    def stop_regen(self, target, n_vocab: int, done: dict, now: float | None = None) -> bool:
        """Whether regeneration's training part should stop before its next batch (`regen.regenerate(stop=...)`)."""
        self.measure(target, n_vocab)
        now = time.time() if now is None else now
        if now < self.clock.at(self.cfg.regen_until):
            return False
        stop = self.timing is None or self.cfg.spare_to != "regenerate"
        if not stop:
            p = self.predict(self.tokens0 + done["new_ids"], now=now)
            stop = p["limited_by"] == "time" or self.fit_seconds(p["steps"]) >= p["share_s"]
        if stop:
            self.record.update(regen_ended_s=round(now - self.clock.t0, 1),
                               regen_past_share_s=round(now - self.clock.at(self.cfg.regen_until), 1))
        return stop


# ------------------------------------------------------------------------------------------------ the driver


@dataclass
class _Run:
    """One recipe run's shared parts (`run_recipe`'s steps read and update it)."""

    target: object
    inputs: dict
    cfg: RecipeConfig
    out: Path
    clock: Clock
    rec: Record
    backend: str
    progress: bool
    init_draft: object = None
    n_vocab3: int = 0  # the EAGLE-3 head's draft vocabulary
    export: object = None  # ExportDir, or None
    writer: object = None  # HeadWriter, or None

    @property
    def exported(self) -> dict:
        return self.rec.data.setdefault("exported", {})

    def put(self, name: str, why: str | None) -> None:
        """Record what reached the export folder, or why not."""
        self.exported[name] = "written" if why is None else f"not written: {why}"
        self.rec.write()

    def record_heads(self, done: dict) -> None:
        """Record what the head writer finished: <name>.tar written (in which form) or not."""
        for name, (why, form) in done.items():
            self.exported[f"{name}.tar"] = f"written ({form})" if why is None else f"not written: {why}"
        if done:
            self.rec.write()

    def export_head(self, name: str, draft, extra=None) -> None:
        """One <name>.tar in the export folder, written off this thread."""
        if self.writer is not None:
            self.record_heads(self.writer.submit(name, draft, extra))

    def write_reserve(self) -> float:
        """Seconds kept after the fit for the head writer: a write under way and the last best's (the longest write
        so far, twice), at least 2% of the budget."""
        w = self.writer.expected_s() if self.writer is not None else None
        return max(0.02 * self.clock.budget, 0.0 if w is None else 2 * w + 1.0)

    def flush_heads(self, exit_margin_s: float = 2.0) -> None:
        """Wait for the head writer, but never past the deadline (less `exit_margin_s`); heads it did not finish
        are recorded as not written."""
        if self.writer is None:
            return
        self.record_heads(self.writer.flush(max(0.0, self.clock.end - time.time() - exit_margin_s)))
        late = self.writer.pending()
        if late:
            self.writer.close()
            self.record_heads({n: (f"the deadline came first (a write takes ~{self.writer.expected_s() or 0:.0f} s)",
                                   None) for n in late})


def _open_run(target, inputs: dict, out_dir, cfg: RecipeConfig, smoke: bool, export_dir, deadline, init,
              progress: bool) -> _Run:
    """Check the inputs and the --init head, start the clock, the export folder, its head writer (timing a write
    of the head's shapes at once) and recipe.json."""
    import jax

    from ddd_jax import eagle, eagle3, head_kinds, load_draft

    from .eagle3_fit import eagle3_config
    from .export_dir import ExportDir, HeadWriter, check_head_fits
    check_inputs_for(target, inputs)
    for part in ("train", "holdout", "mtbench"):
        if not inputs[part]:
            raise ValueError(f"recipe inputs hold no {part} prompt")
    init_draft = None
    if init is not None:
        init_draft = load_draft(str(init), target)
        head_kinds.require(init_draft.config, "eagle3", f"--init {init}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clock = Clock(cfg, deadline)
    n_vocab3 = (len(init_draft.params["d2t"]) if init_draft is not None
                else min(cfg.eagle3.draft_vocab_size, target.config.vocab_size))
    export, writer, head_forms = None, None, {}
    if export_dir is not None:  # before the window is spent: the EAGLE-3 head must fit a returned file
        dcfg = eagle3_config(target, n_vocab3)
        head_forms[f"{target.name}-eagle3.tar"] = check_head_fits(dcfg, f"recipe --export-dir {export_dir}")["form"]
        export = ExportDir(export_dir)
        writer = HeadWriter(export, out)
        params = jax.tree.map(np.asarray, eagle3.init_params(dcfg, jax.random.PRNGKey(0), np.float32))
        writer.time_write(eagle.Draft(dcfg, {**params, "d2t": np.arange(n_vocab3, dtype=np.int32)}, target))
    rec = Record(out, {"format": RECIPE_FORMAT, "version": 3, "smoke": smoke, "config": cfg.to_dict(),
                       "device": device_info(), "target": target.name,
                       "inputs": {**inputs["meta"]["counts"], "train_order": inputs["meta"].get("train_order"),
                                  "text_tokens": inputs["meta"].get("text_tokens", 0)},
                       "deadline_s": None if deadline is None else round(deadline - process_start(), 1),
                       "budget_s": round(clock.budget, 1), "init": None if init is None else str(init),
                       "export_dir": None if export_dir is None else str(export_dir), "head_forms": head_forms,
                       "started_utc": dio.utc_now()}, export)
    return _Run(target, inputs, cfg, out, clock, rec, jax.default_backend(), progress, init_draft, n_vocab3,
                export, writer)


def _fit_end(run: _Run) -> float:
    """When the EAGLE-3 fit's share ends: `eagle3_until`, or `last_until` when no later stage runs."""
    later = run.cfg.runs("train_eagle1", run.backend) or run.cfg.runs("acceptance", run.backend)
    return run.clock.at(run.cfg.eagle3_until if later else run.cfg.last_until)


def _regenerate(run: _Run, plan: FitPlan) -> tuple:
    """(a) and its export; the training and held-out token sets the fits learn from and are scored on."""
    from .export_dir import regen_bytes
    from .regen import load_records
    cfg, regen_dir = run.cfg, run.out / "regen"
    if not run.rec.done("regenerate"):
        stop = lambda done: plan.stop_regen(run.target, run.n_vocab3, done)  # noqa: E731
        _stage(run.rec, "regenerate", regenerate_stage, run.target, run.inputs, cfg, regen_dir,
               max(0.0, plan.fit_end - time.time()), run.progress, stop, fatal=True)
    recs = {p: load_records(regen_dir / f"{p}.jsonl") for p in ("train", "holdout")}
    if run.export is not None:
        run.put("regen.npz", run.export.put_bytes("regen.npz", regen_bytes(recs, {"target": run.target.name})))
    max_len = max(len(p) for _, p in run.inputs["train"] + run.inputs["holdout"]) + cfg.regen_max_new + 1
    text = fit_text(run.inputs, cfg.data)
    train, held = token_set(recs["train"], max_len, text), token_set(recs["holdout"], max_len)
    run.rec.set("regenerate", train_tokens=train.n_tokens, train_loss_tokens=int(train.mask.sum()),
                text_entries=len(text), holdout_tokens=held.n_tokens)
    return train, held


def _eagle3(run: _Run, plan: FitPlan, train, held, ahead) -> None:
    """(b), sized by the plan's prediction, its best head exported as it improves; the head writer keeps its
    reserve before the fit's share ends (`write_reserve`, also while the fit runs)."""
    from ddd_jax import eagle

    from .eagle3_fit import RowPlan, eagle3_config
    name = f"{run.target.name}-eagle3"
    plan.measure(run.target, run.n_vocab3)  # a run whose regeneration ended before the programs were built
    if plan.timing is not None:
        try:
            spe = RowPlan(train, run.cfg.eagle3, fit_groups(train, run.cfg.data)).steps_per_epoch
        except ValueError:  # fewer rows than a step: the fit halves its batch (`halving_batch`)
            spe = None
        plan.record.update(predicted=plan.predict(train.n_tokens, spe))

    def best3(params, step, metrics):
        run.export_head(name, eagle.Draft(eagle3_config(run.target, len(params["d2t"])), params, run.target),
                        {"trained_for": run.target.name, "step": step, "heldout": metrics})

    ends = lambda: plan.fit_end - run.write_reserve()  # noqa: E731
    init = None if run.init_draft is None else dict(run.init_draft.params)
    _stage(run.rec, "eagle3", eagle3_stage, run.target, train, held, run.cfg, run.out / "eagle3",
           run.out / "heads" / name, max(1.0, ends() - time.time()), init, best3, run.progress, ahead,
           stop=lambda: time.time() > ends())
    if (plan.record.get("predicted") or {}).get("steps") is not None and run.rec.done("eagle3"):
        run.rec.set("eagle3", predicted_steps=plan.record["predicted"]["steps"])
    run.flush_heads()
    if run.export is not None and (run.out / "eagle3" / "metrics.jsonl").is_file():
        run.put("eagle3-metrics.jsonl.gz",
                run.export.put_gzip("eagle3-metrics.jsonl.gz", run.out / "eagle3" / "metrics.jsonl"))


def _eagle1(run: _Run, train) -> None:
    """(c), when it runs on this backend and time is left before its end."""
    cfg, rec = run.cfg, run.rec
    e1_until = cfg.eagle1_until if cfg.runs("acceptance", run.backend) else cfg.last_until
    if not cfg.runs("train_eagle1", run.backend):
        rec.set("eagle1", status="skipped", reason=f"train_eagle1={cfg.train_eagle1} on {run.backend}")
    elif not rec.done("eagle1") and run.clock.left(e1_until) > 0:
        _stage(rec, "eagle1", eagle1_stage, run.target, train, cfg, run.out, run.out / "heads" /
               f"{run.target.name}-eagle", run.clock.left(e1_until), run.progress)
    elif not rec.done("eagle1"):
        rec.set("eagle1", status="skipped", reason="no time left in the budget")


def _heads(run: _Run) -> dict:
    """(d) The heads the fits finished, loaded; EAGLE-1/2's exported (EAGLE-3's was as it improved)."""
    from ddd_jax import load_draft
    heads, heads_dir = {}, run.out / "heads"
    for name, stage in ((f"{run.target.name}-eagle3", "eagle3"), (f"{run.target.name}-eagle", "eagle1")):
        if run.rec.done(stage):
            heads[name] = load_draft(str(heads_dir / name), run.target)
            if stage == "eagle1":
                run.export_head(name, heads[name])
    run.flush_heads()
    run.rec.set("export", status="done" if heads else "failed", heads={n: _head_files(heads_dir / n) for n in heads})
    return heads


def _acceptance(run: _Run, heads: dict) -> None:
    """(f) τ over the MT-bench first turns, while the budget lasts (what earlier runs measured is kept)."""
    cfg, rec = run.cfg, run.rec
    if not cfg.runs("acceptance", run.backend):
        rec.set("acceptance", status="skipped", reason=f"acceptance={cfg.acceptance} on {run.backend}: measure τ "
                                                       "with `ddd-jax train-draft accept` on the CPU")
        return
    if not heads:
        return
    from .accept import reference_head
    reference, rec.data["reference"] = reference_head(run.target, cfg.reference_head)
    runs = acceptance_runs(heads, reference, cfg.tau_labels)
    measured = (rec.done("acceptance") or {}).get("results", {})
    if any(k not in measured for k in runs):
        prompts = [ids for _, ids in run.inputs["mtbench"][:cfg.tau_prompts]]
        _stage(rec, "acceptance", acceptance_stage, run.target, runs, prompts, cfg, measured, run.clock.end,
               lambda results: rec.set("acceptance", results=results), run.progress)


def run_recipe(target, inputs: dict, out_dir, cfg: RecipeConfig = RecipeConfig(), *, smoke: bool = False,
               progress: bool = True, export_dir=None, deadline: float | None = None, init=None) -> dict:
    """Run stages (a)-(f) into `out_dir`, each stage's product copied to `export_dir` as it finishes; returns
    recipe.json's content. deadline: a time.time() value the whole run ends before (the stages are fractions of
    the time left to it); None: `cfg.budget_s` from now. init: an EAGLE-3 head (name, directory or .tar) the fit
    continues from."""
    from .eagle3_fit import compile_ahead
    run = _open_run(target, inputs, out_dir, cfg, smoke, export_dir, deadline, init, progress)
    ahead = None  # the fit's programs compile on a background thread while (a) runs
    if cfg.compile_ahead and not run.rec.done("eagle3"):
        ahead = compile_ahead(target, cfg.eagle3, run.n_vocab3)
    plan = FitPlan(cfg, run.clock, _fit_end(run), text_tokens(inputs, cfg.data, cfg.eagle3.seq_len), ahead,
                   run.write_reserve)
    run.rec.data["plan"] = plan.record
    train, held = _regenerate(run, plan)
    if not run.rec.done("eagle3"):
        _eagle3(run, plan, train, held, ahead)
    _eagle1(run, train)
    heads = _heads(run)
    # (e) held-out top-1; a rerun measures again when a head came after the last measurement
    if heads and set((run.rec.done("heldout") or {}).get("heads", {})) != set(heads):
        _stage(run.rec, "heldout", heldout_stage, target, heads, held, cfg, run.rec.done("eagle3"))
    _acceptance(run, heads)
    run.rec.data["total_s"] = round(time.time() - run.clock.t0, 1)
    run.rec.data["finished_utc"] = dio.utc_now()
    run.rec.write()
    return run.rec.data


def halving_batch(run, cfg):
    """(run(cfg), the cfg it ran with, retries): when a step's packed rows do not fit -- a device out of memory, or
    fewer packed rows of data than one step takes (a short regeneration) -- run again with half the rows a step,
    while there is a row to halve; any other error, or one row still too many, is raised."""
    retries = []
    while True:
        try:
            return run(cfg), cfg, retries
        except Exception as e:  # noqa: BLE001 -- XLA reports OOM as a runtime error naming RESOURCE_EXHAUSTED
            msg = str(e)
            if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower():
                reason = "out of memory"
            elif "not enough data for one step" in msg:
                reason = "not enough data"
            else:
                raise
            if cfg.batch_size == 1:
                raise
            retries.append({"batch_size": cfg.batch_size, "reason": reason, "error": msg[:300]})
            cfg = dataclasses.replace(cfg, batch_size=cfg.batch_size // 2)


def _head_files(path: Path) -> dict:
    return {p.name: p.stat().st_size for p in sorted(Path(path).iterdir())} if Path(path).is_dir() else {}


def eagle1_stage(target, train, cfg: RecipeConfig, out: Path, head_dir: Path, budget: float, progress: bool) -> dict:
    """(c) The EAGLE-1/2 fit on the same replies, over their target features: a short probe fit sizes the run to
    `budget` seconds."""
    from ddd_jax import eagle
    from ddd_jax.checkpoints.ours import save_draft

    from .train import fit
    from .vocab import coverage, frequent_tokens
    t = time.time()
    fs = _with_features(target, train, cfg, cfg.e1_max_tokens, progress)
    probe, base, retries = halving_batch(
        lambda fc: fit(target, fs, _fresh(out / "eagle1-probe"), fc, ckpt_every=10 ** 9, log_every=1, eval_every=0,
                       progress=False),
        dataclasses.replace(cfg.eagle1, steps=cfg.probe_steps + 1, warmup=1))
    ms = [json.loads(x) for x in (out / "eagle1-probe" / "metrics.jsonl").read_text().splitlines()]
    per_step = (ms[-1]["elapsed_s"] - ms[0]["elapsed_s"]) / max(len(ms) - 1, 1)
    shutil.rmtree(out / "eagle1-probe")
    del probe
    remaining = budget - (time.time() - t)
    steps = int(max(1, min(cfg.eagle1.steps, remaining * 0.85 / max(per_step, 1e-6))))
    fcfg = dataclasses.replace(base, steps=steps, warmup=max(1, min(100, steps // 20)))
    r = fit(target, fs, _fresh(out / "eagle1"), fcfg, ckpt_every=10 ** 9, log_every=10, eval_every=0,
            progress=progress, time_limit_s=max(1.0, budget - (time.time() - t)))
    counts = np.bincount(fs.ids[fs.mask.astype(bool)], minlength=target.config.vocab_size)[:target.config.vocab_size]
    vocab = frequent_tokens(counts, min(cfg.eagle3.draft_vocab_size, target.config.vocab_size),
                            always=target.eos_token_ids)
    draft = eagle.with_draft_vocab(eagle.Draft(r["draft_config"], r["params"], target), vocab)
    extra = {"trained_for": target.name, "step": r["step"], "fit_config": fcfg.to_dict(),
             "train_tokens": fs.n_tokens, "train_metrics": r["last_metrics"],
             "draft_vocab": {"draft_vocab_size": len(vocab), "train_coverage": coverage(counts, vocab)}}
    save_draft(draft, head_dir, dtype=np.float16, extra=extra)
    return {"steps": r["step"], "fit_config": fcfg.to_dict(), "features_tokens": fs.n_tokens,
            "probe_s_per_step": per_step, "last_metrics": r["last_metrics"], "head": str(head_dir),
            "export": _head_files(head_dir), "batch_retries": retries}


def _eval_eagle1(target, draft, held, cfg: RecipeConfig) -> dict:
    """Held-out step-0 top-1 (and losses) of an EAGLE-1/2 head with the target's features."""
    import jax
    import jax.numpy as jnp

    from .train import eval_rows, frozen_target_arrays, make_eval_step, metric_means
    fs = _with_features(target, held, cfg, None, False)
    fcfg = dataclasses.replace(cfg.eagle1, dtype="float32")
    embed, lm_w = frozen_target_arrays(target)
    params = {k: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), v) for k, v in draft.params.items()
              if k != "d2t"}
    ev = make_eval_step(draft.config, fcfg)
    tot = None
    for b in eval_rows(fs, fcfg, cfg.eval_batches):
        s = ev(params, embed, lm_w, b)
        tot = s if tot is None else jax.tree.map(jnp.add, tot, s)
    r = {k: float(v) for k, v in metric_means(jax.device_get(tot)).items()}
    return {"acc0": r["acc"], "vloss": r["vloss"], "ploss": r["ploss"], "tokens": int(r["count"])}
