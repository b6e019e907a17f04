"""The head-training recipe: self-distilled replies, an EAGLE-3 head (TTT), an EAGLE-1/2 head, export, held-out
top-1 and acceptance, in one run sized to a wall-time budget (`ddd-jax train-draft recipe`).

Stages, in order; each writes its result as soon as it finishes and records itself in `DIR/recipe.json`, so a
run cut off early still leaves what it finished:

    (a) regenerate   the target's own greedy replies to the training prompts (and to a few held-out ones),
                     decoded in large batches (`regen.regenerate`), until `regen_until` of the budget
    (b) eagle3       an EAGLE-3 head with training-time test, target features computed on the fly
                     (`eagle3_fit.fit_eagle3`, sized to end at `eagle3_until`), exported at once (d)
    (c) eagle1       with the time left, an EAGLE-1/2 head on the same replies (`train.fit` over final-normed
                     features computed in batches), with the same draft vocabulary size, exported at once (d)
    (d) export       each head as config + float16 safetensors + draft vocabulary under DIR/heads/<name>
    (e) heldout      top-1 agreement with the target on the held-out replies: per TTT step for EAGLE-3, step 0
                     for EAGLE-1
    (f) acceptance   τ over the MT-bench first turns (acceptance only, every output checked against vanilla) at
                     EAGLE-2's default tree, at DDD's paper settings (with its depth histogram) and at the
                     shipped tuned trees, most important first, while the budget lasts; the shipped head
                     (`reference_head`) is measured beside them, label by label

Inputs: token ids only (`prepare_inputs`: ShareGPT user turns, the short first turns first, then the longer ones
and the later turns with their conversation before them; the held-out first turns; the MT-bench first turns; all
rendered with the target's chat template), so a machine without the asset packages or a network can run it from
one .npz.
MT-bench never enters training (ShareGPT conversations that repeat an MT-bench turn are dropped, as in
`data.load_sharegpt`). A rerun with the same DIR skips the stages recorded as done and restarts the others.
"""
from __future__ import annotations

import dataclasses
import json
import platform
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddd_jax import io as dio

from .eagle3_fit import Fit3Config
from .train import FitConfig

INPUTS_FORMAT = "ddd-jax-recipe-inputs"
RECIPE_FORMAT = "ddd-jax-recipe"
PROBE_TEXT = "Hello! Compose a haiku about speculative decoding, then explain it in two sentences."
PARTS = ("train", "holdout", "mtbench")


@dataclass(frozen=True)
class RecipeConfig:
    """Sizes of one recipe run. The defaults fit one H100/H200 in 9 minutes (500 s of stages after loading the target
    and compiling its first programs); `SMOKE` is the CPU check. The two
    fits' own configs are `eagle3` and `eagle1`; their `steps` are upper bounds (the budget decides)."""

    budget_s: float = 500.0  # wall time from the start of stage (a); loading the target comes before it
    regen_until: float = 0.28  # stage ends, as fractions of the budget
    eagle3_until: float = 0.70
    eagle1_until: float = 0.82
    train_prompts: int = 0  # 0: every training prompt of the inputs (the time limit stops regeneration)
    holdout_prompts: int = 256
    regen_batch: int = 256
    regen_max_new: int = 256
    eagle3: Fit3Config = Fit3Config(steps=100_000, batch_size=8, seq_len=1024, ttt_steps=7, draft_vocab_size=8192,
                                    lr=5e-4, warmup=40, dtype="bfloat16")
    eagle1: FitConfig = FitConfig(steps=100_000, batch_size=16, seq_len=1024, lr=5e-4, dtype="bfloat16")
    e1_max_tokens: int = 8_000_000  # replies' tokens featurised for EAGLE-1 (host memory: 1.2 KB a token)
    feature_batch: int = 64
    eval_batches: int = 8
    tau_prompts: int = 80
    tau_max_new: int = 128
    tau_batch: int = 80
    probe_steps: int = 3
    reference_head: str = "shipped"  # measured beside the new heads in (f): a head name or directory; "shipped":
    # the packaged "<target>-eagle" when there is one; "": none

    def __post_init__(self):
        if not 0 < self.regen_until < self.eagle3_until <= self.eagle1_until <= 1:
            raise ValueError("RecipeConfig: need 0 < regen_until < eagle3_until <= eagle1_until <= 1, got "
                             f"{self.regen_until}, {self.eagle3_until}, {self.eagle1_until}")
        if self.budget_s <= 0:
            raise ValueError(f"RecipeConfig.budget_s must be > 0, got {self.budget_s}")
        if self.eagle3.warmup <= self.probe_steps + 1:
            raise ValueError(f"RecipeConfig: eagle3.warmup ({self.eagle3.warmup}) must exceed probe_steps + 1 "
                             f"({self.probe_steps + 1}): the probe's learning rates must not depend on the step count")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SMOKE = RecipeConfig(budget_s=300.0, train_prompts=12, holdout_prompts=4, regen_batch=4, regen_max_new=24,
                     eagle3=Fit3Config(steps=4, batch_size=1, seq_len=128, ttt_steps=2, draft_vocab_size=512,
                                       warmup=8),
                     eagle1=FitConfig(steps=4, batch_size=1, seq_len=128), e1_max_tokens=4096, feature_batch=4,
                     eval_batches=2, tau_prompts=2, tau_max_new=16, tau_batch=2, probe_steps=2)


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


# ----------------------------------------------------------------------------------------------- inputs


def prepare_inputs(target, *, max_prompt_len: int = 192, max_context_len: int = 512, holdout_percent: float = 2.0,
                   max_train: int = 0, seed: int = 0, sharegpt=None, questions=None, progress: bool = True) -> dict:
    """Token ids of the recipe's prompts: {"meta", "train", "holdout", "mtbench"}, each part [(key, ids)].

    train: first the first user turns of ShareGPT training conversations of at most `max_prompt_len` tokens, in the
    shuffled order of `seed`; then, shuffled together, the longer first turns and the later user turns with the
    conversation before them (`regen.later_turn_prompts`, keys "<id>#<k>"), of at most `max_context_len` tokens
    (0: first turns only). Regeneration takes them in this order, so a short run trains on the short first turns
    alone, and a fast device that has answered them all goes on with the rest.
    holdout: the held-out conversations' first turns of at most `max_prompt_len` tokens (ShareGPT's split by
    `data.is_holdout`; conversations repeating an MT-bench turn are dropped from both).
    mtbench: the MT-bench first turns as `ddd-jax bench` renders them. Everything is chat-rendered with the
    target's template, generation prompt appended."""
    from ddd_jax.bench.mtbench import load_questions
    from ddd_jax.bench.run import build_prompt

    from .data import load_sharegpt, shuffled
    from .regen import first_turn_prompts, later_turn_prompts
    if max_context_len and max_context_len < max_prompt_len:
        raise ValueError(f"max_context_len ({max_context_len}) must be 0 or at least max_prompt_len "
                         f"({max_prompt_len})")
    sg = load_sharegpt(sharegpt, holdout_percent=holdout_percent, exclude_mtbench=True)
    train_items = shuffled(sg.train, seed)
    if max_train:
        train_items = train_items[:max_train]
    say = (lambda msg: print(f"recipe inputs: {msg}", flush=True)) if progress else (lambda msg: None)
    say(f"tokenizing {len(train_items)} training and {len(sg.holdout)} held-out conversations")
    firsts, skipped_first = first_turn_prompts(target, train_items, max(max_prompt_len, max_context_len))
    short = [(k, ids) for k, ids in firsts if len(ids) <= max_prompt_len]
    long_first = [(k, ids) for k, ids in firsts if len(ids) > max_prompt_len]
    later, skipped_later = later_turn_prompts(target, train_items, max_context_len) if max_context_len else ([], 0)
    more = shuffled(long_first + later, seed + 1)
    holdout, skipped_hold = first_turn_prompts(target, shuffled(sg.holdout, seed), max_prompt_len)
    mtbench = [(str(q["id"]), build_prompt(target, q, 0, [])) for q in load_questions(questions)]
    parts = {"train": short + more, "holdout": holdout, "mtbench": mtbench}
    meta = {"format": INPUTS_FORMAT, "version": 1, "target": target.name, "vocab_size": target.config.vocab_size,
            "hidden_size": target.config.hidden_size, "probe_ids": target.encode(PROBE_TEXT),
            "max_prompt_len": max_prompt_len, "max_context_len": max_context_len, "holdout_percent": holdout_percent,
            "seed": seed, "sharegpt": sg.stats,
            "train_order": {"short_first_turns": len(short), "long_first_turns": len(long_first),
                            "later_turns": len(later)},
            "skipped_long": {"train_first_turns": skipped_first, "train_later_turns": skipped_later,
                             "holdout": skipped_hold},
            "counts": {k: len(parts[k]) for k in PARTS}}
    return {"meta": meta, **parts}


def save_inputs(inputs: dict, path) -> Path:
    """Write `prepare_inputs`' result as one .npz (uint16 ids, int64 offsets), atomically."""
    path = Path(path)
    if inputs["meta"]["vocab_size"] > 65536:
        raise ValueError(f"vocabulary of {inputs['meta']['vocab_size']} tokens does not fit uint16 ids")
    arrays = {"meta": np.asarray(json.dumps(inputs["meta"]))}
    for name in PARTS:
        seqs = [np.asarray(ids, np.uint16) for _, ids in inputs[name]]
        arrays[f"{name}_ids"] = np.concatenate(seqs) if seqs else np.zeros(0, np.uint16)
        arrays[f"{name}_offsets"] = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
        arrays[f"{name}_keys"] = np.asarray([k for k, _ in inputs[name]], dtype=str)
    path.parent.mkdir(parents=True, exist_ok=True)
    with dio.atomic_file(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
    return path


def load_inputs(path) -> dict:
    """Read `save_inputs`' file, checking it is whole and ours (errors name the file and the problem)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe inputs {path} do not exist (make them with `ddd-jax train-draft "
                                "recipe-inputs --out FILE`)")
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except Exception as e:  # zipfile / numpy errors for truncated or foreign files
        raise ValueError(f"recipe inputs {path}: not a readable .npz ({type(e).__name__}: {e})") from e
    try:
        meta = json.loads(str(data["meta"]))
    except (KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"recipe inputs {path}: no valid 'meta' record") from e
    if meta.get("format") != INPUTS_FORMAT:
        raise ValueError(f"recipe inputs {path}: format {meta.get('format')!r}, expected {INPUTS_FORMAT!r}")
    out = {"meta": meta}
    for name in PARTS:
        try:
            ids, offs, keys = data[f"{name}_ids"], data[f"{name}_offsets"], data[f"{name}_keys"]
        except KeyError as e:
            raise ValueError(f"recipe inputs {path}: missing array {e.args[0]!r}") from e
        if len(offs) != len(keys) + 1 or offs[0] != 0 or offs[-1] != len(ids) or np.any(np.diff(offs) <= 0):
            raise ValueError(f"recipe inputs {path}: the {name} offsets do not delimit {len(keys)} non-empty prompts "
                             f"in {len(ids)} ids")
        out[name] = [(str(k), ids[a:b].astype(np.int32).tolist()) for k, a, b in zip(keys, offs[:-1], offs[1:])]
    return out


def check_inputs_for(target, inputs: dict, where: str = "recipe inputs") -> None:
    """The inputs must come from this target's tokenizer and vocabulary."""
    m = inputs["meta"]
    if (m["vocab_size"], m["hidden_size"]) != (target.config.vocab_size, target.config.hidden_size):
        raise ValueError(f"{where} were made for {m['target']!r} (vocab_size={m['vocab_size']}, hidden_size="
                         f"{m['hidden_size']}), not for this target (vocab_size={target.config.vocab_size}, "
                         f"hidden_size={target.config.hidden_size})")
    if target.tokenizer is not None and target.encode(PROBE_TEXT) != m["probe_ids"]:
        raise ValueError(f"{where}: this target's tokenizer encodes a probe text differently from {m['target']!r}'s")


# ----------------------------------------------------------------------------------------------- the run


def device_info() -> dict:
    import jax
    from ddd_jax.backends.cpu.kernels import cpu_model
    dev = jax.devices()[0]
    cpu = cpu_model()
    return {"backend": jax.default_backend(), "device": getattr(dev, "device_kind", str(dev)),
            "device_count": jax.device_count(), "host_cpu": cpu or platform.processor(), "jax": jax.__version__}


class Record:
    """DIR/recipe.json, rewritten atomically whenever a stage starts or ends."""

    def __init__(self, out: Path, header: dict):
        self.path = out / "recipe.json"
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
        dio.atomic_write_text(self.path, json.dumps(self.data, indent=1))


def _token_set(records: list, max_len: int):
    """FeatureSet of the regenerated records' ids and loss masks (replies count), no features."""
    from .extract import FeatureSet
    from .regen import example_from_record
    exs = [e for e in (example_from_record(r, max_len) for r in records) if e is not None]
    if not exs:
        raise ValueError("no regenerated reply to train on")
    offs = np.concatenate([[0], np.cumsum([len(e["ids"]) for e in exs])]).astype(np.int64)
    return FeatureSet(np.concatenate([e["ids"] for e in exs]), None, np.concatenate([e["mask"] for e in exs]),
                      offs, [e["id"] for e in exs], {"source": {"kind": "regenerated"}})


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


def _stage(rec: Record, name: str, fn, *, fatal: bool = False):
    """Run one stage, recording its status, seconds and result (or its error)."""
    t = time.time()
    rec.start(name)
    try:
        result = fn() or {}
    except Exception as e:  # noqa: BLE001 -- recorded; later stages may still run
        rec.set(name, status="failed", seconds=round(time.time() - t, 1), error=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc()[-3000:])
        if fatal:
            raise
        return None
    rec.set(name, status="done", seconds=round(time.time() - t, 1), **result)
    return result


def acceptance_runs(heads: dict, reference: dict | None = None) -> dict:
    """{label: run} of stage (f), most important first: for each head EAGLE-2's default tree, DDD at the paper's
    settings, then the shipped tuned CPU and GPU trees (EAGLE-2 and DDD). The `reference` head's default-tree run
    comes right after the new heads' (the comparison that decides what ships), its other runs last."""
    from ddd_jax.config import DDDConfig, TreeConfig
    from ddd_jax.settings import load_settings, settings_dir, to_configs
    tuned = {}
    for backend in ("cpu", "gpu"):
        s = load_settings(path=settings_dir() / f"{backend}.json")
        if s is not None:
            tuned[backend] = to_configs(s)
    order = [("eagle2-default", "eagle2", TreeConfig(), DDDConfig()),
             ("ddd-paper", "ddd", TreeConfig(), DDDConfig())]
    for backend, (tree, ddd) in tuned.items():
        order += [(f"eagle2-{backend}", "eagle2", tree, ddd), (f"ddd-{backend}", "ddd", tree, ddd)]
    def runs(hs: dict) -> list:
        return [(f"{hname}/{label}", {"draft": draft, "method": method, "tree": tree, "ddd": ddd})
                for label, method, tree, ddd in order for hname, draft in hs.items()]

    new, ref = runs(heads), runs(reference or {})
    return dict(new[:len(heads)] + ref[:1] + new[len(heads):] + ref[1:])


def run_recipe(target, inputs: dict, out_dir, cfg: RecipeConfig = RecipeConfig(), *, smoke: bool = False,
               progress: bool = True) -> dict:
    """Run stages (a)-(f) into `out_dir` within `cfg.budget_s`; returns recipe.json's content."""
    import jax

    from ddd_jax import load_draft

    from . import eagle3_fit
    from .regen import load_records, regenerate
    check_inputs_for(target, inputs)
    for part in ("train", "holdout", "mtbench"):
        if not inputs[part]:
            raise ValueError(f"recipe inputs hold no {part} prompt")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    at = lambda frac: t0 + frac * cfg.budget_s  # noqa: E731
    left = lambda until: max(0.0, until - time.time())  # noqa: E731
    rec = Record(out, {"format": RECIPE_FORMAT, "version": 1, "smoke": smoke, "config": cfg.to_dict(),
                       "device": device_info(), "target": target.name,
                       "inputs": {**inputs["meta"]["counts"], "train_order": inputs["meta"].get("train_order")},
                       "started_utc": dio.utc_now()})
    e3_name, e1_name = f"{target.name}-eagle3", f"{target.name}-eagle"
    heads_dir = out / "heads"
    max_len = max(len(p) for _, p in inputs["train"] + inputs["holdout"]) + cfg.regen_max_new + 1

    # (a) the target's own replies: the held-out ones first (few), then the training ones until the deadline, at
    # least one batch of them even when the held-out ones took the whole share (later stages need training data)
    def regen():
        r = {}
        for part, n, path in (("holdout", cfg.holdout_prompts, out / "regen" / "holdout.jsonl"),
                              ("train", cfg.train_prompts, out / "regen" / "train.jsonl")):
            prompts = inputs[part][:n] if n else inputs[part]
            limit = left(at(cfg.regen_until)) if part == "train" else None
            r[part] = regenerate(target, prompts, path, max_new_tokens=cfg.regen_max_new,
                                 batch_size=min(cfg.regen_batch, len(prompts)), time_limit_s=limit,
                                 min_batches=1 if part == "train" else 0, progress=progress)
            r[part]["gen_tokens_per_s"] = round(r[part]["new_reply_tokens"] / max(r[part]["seconds"], 1e-9), 1)
        return r

    if not rec.done("regenerate"):
        _stage(rec, "regenerate", regen, fatal=True)
    train = _token_set(load_records(out / "regen" / "train.jsonl"), max_len)
    held = _token_set(load_records(out / "regen" / "holdout.jsonl"), max_len)
    rec.set("regenerate", train_tokens=train.n_tokens, train_loss_tokens=int(train.mask.sum()),
            holdout_tokens=held.n_tokens)

    # (b) + (d) EAGLE-3 with training-time test
    f3 = cfg.eagle3

    def fit3():
        r, _, retries = halving_batch(lambda fc: eagle3_fit.fit_eagle3(
            target, train, _fresh(out / "eagle3"), fc, time_budget_s=left(at(cfg.eagle3_until)),
            probe_steps=cfg.probe_steps, ckpt_every=10 ** 9, log_every=10, export_dir=heads_dir / e3_name,
            progress=progress), f3)
        return {"steps": r["step"], "fit_config": r["fit_config"].to_dict(), "last_metrics": r["last_metrics"],
                "head": str(heads_dir / e3_name), "export": _head_files(heads_dir / e3_name),
                "batch_retries": retries}

    if not rec.done("eagle3"):
        _stage(rec, "eagle3", fit3)

    # (c) + (d) EAGLE-1/2 on the same replies
    def fit1():
        return _fit_eagle1(target, train, out, heads_dir / e1_name, cfg, left(at(cfg.eagle1_until)), progress)

    if not rec.done("eagle1") and left(at(cfg.eagle1_until)) > 0:
        _stage(rec, "eagle1", fit1)
    elif not rec.done("eagle1"):
        rec.set("eagle1", status="skipped", reason="no time left in the budget")

    heads = {}
    for name, stage in ((e3_name, "eagle3"), (e1_name, "eagle1")):
        if rec.done(stage):
            heads[name] = load_draft(str(heads_dir / name), target)
    rec.set("export", status="done" if heads else "failed",
            heads={n: _head_files(heads_dir / n) for n in heads})

    # (e) held-out top-1
    def heldout():
        r = {}
        if e3_name in heads:
            p = jax.tree.map(lambda x: np.asarray(x, np.float32) if x.dtype.kind == "f" else np.asarray(x),
                             heads[e3_name].params)
            r[e3_name] = eagle3_fit.evaluate(target, p, held, dataclasses.replace(f3, dtype="float32"),
                                             cfg.eval_batches)
        if e1_name in heads:
            r[e1_name] = _eval_eagle1(target, heads[e1_name], held, cfg)
        return {"heads": r}

    # a rerun measures again when a head came after the last measurement (a fit that failed before succeeded now)
    if heads and set((rec.done("heldout") or {}).get("heads", {})) != set(heads):
        _stage(rec, "heldout", heldout)

    # (f) acceptance over the MT-bench first turns, while the budget lasts
    def acceptance():
        from ddd_jax.bench.acceptance import measure_runs
        prompts = [ids for _, ids in inputs["mtbench"][:cfg.tau_prompts]]
        results = dict(measured)  # a rerun keeps what was measured and measures the rest
        rec.set("acceptance", results=results)

        def keep(label, res):
            results[label] = {k: v for k, v in res.items() if k != "per_prompt"}
            results[label]["settings"] = {"method": runs[label]["method"], "tree": runs[label]["tree"].to_dict(),
                                          "ddd": dataclasses.asdict(runs[label]["ddd"])}
            dh = res["depth_hist"]
            if runs[label]["method"] == "ddd" and dh:
                first = runs[label]["ddd"].check_steps[0]
                results[label]["past_first_check"] = sum(v for k, v in dh.items() if k > first) / sum(dh.values())
            rec.set("acceptance", results=results)

        todo = {k: r for k, r in runs.items() if k not in results}
        measure_runs(target, prompts, todo, max_new_tokens=cfg.tau_max_new, batch_size=min(cfg.tau_batch, len(prompts)),
                     progress=progress, on_result=keep, deadline=t0 + cfg.budget_s)
        remaining = [k for k in runs if k not in results]
        return {"results": results, "not_measured": list(remaining), "prompts": len(prompts),
                "max_new_tokens": cfg.tau_max_new}

    reference = _reference_head(rec, target, cfg.reference_head, e1_name) if heads else {}
    runs = acceptance_runs(heads, reference)
    measured = (rec.done("acceptance") or {}).get("results", {})
    if heads and any(k not in measured for k in runs):
        _stage(rec, "acceptance", acceptance)
    rec.data["total_s"] = round(time.time() - t0, 1)
    rec.data["finished_utc"] = dio.utc_now()
    rec.write()
    return rec.data


def _reference_head(rec: Record, target, name: str, shipped: str) -> dict:
    """{"reference-<name>": Draft} for stage (f), so a new head is compared with the one it would replace in the
    same run (same prompts, device and settings); recorded under "reference" in recipe.json."""
    from ddd_jax import load_draft
    from ddd_jax.checkpoints import registry
    if not name:
        return {}
    if name == "shipped":
        if shipped not in registry.NAMED_DRAFTS:
            rec.data["reference"] = {"head": None, "reason": f"no packaged head {shipped!r}"}
            return {}
        name = shipped
    try:
        draft = load_draft(name, target)
    except (OSError, ValueError, KeyError) as e:  # a reference that cannot load costs the new heads nothing
        rec.data["reference"] = {"head": name, "reason": f"{type(e).__name__}: {e}"[:300]}
        return {}
    info = {"head": name, "head_type": draft.config.head_type}
    cfg_path = registry.named_draft_dir(name) / "config.json" if name in registry.NAMED_DRAFTS else \
        Path(name) / "config.json"
    if cfg_path.is_file():
        info["step"] = dio.read_json(cfg_path).get("extra", {}).get("step")
    rec.data["reference"] = info
    return {f"reference-{Path(name).name}": draft}


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


def _fit_eagle1(target, train, out: Path, head_dir: Path, cfg: RecipeConfig, budget: float, progress: bool) -> dict:
    """EAGLE-1/2 objective over features of the replies: a short probe fit sizes the run to `budget` seconds."""
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

    from .train import _finish, eval_rows, frozen_target_arrays, make_eval_step
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
    r = {k: float(v) for k, v in _finish(jax.device_get(tot)).items()}
    return {"acc0": r["acc"], "vloss": r["vloss"], "ploss": r["ploss"], "tokens": int(r["count"])}
