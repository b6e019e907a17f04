"""`ddd-jax train-draft accept`: τ of every head in a folder (head directories and `<name>.tar` files, e.g. what a
GPU recipe run handed back) beside a reference head, over the MT-bench first turns, resumable.

Each head is measured at the runs of the recipe's stage (f) (`acceptance_runs`: EAGLE-2's default tree, DDD at
the paper's settings, then the shipped tuned CPU and GPU trees), every output checked token for token
against vanilla decoding (`ddd_jax.measure.acceptance.measure_runs`). `OUT/accept.json` is rewritten atomically
after each result, with `OUT/accept.md` (one table row per head and run); a rerun with the same OUT keeps what was
measured with the same prompts and the same head files, and measures the rest. `acceptance_runs`,
`measure_acceptance`, `acceptance_result`, `reference_head` and `device_info` are what the recipe's stage (f)
shares.
"""
from __future__ import annotations

import dataclasses
import json
import platform
import time
from pathlib import Path

from ddd_jax import io as dio

ACCEPT_FORMAT = "ddd-jax-accept"
ACCEPT_VERSION = 1
JSON_FILE, MD_FILE = "accept.json", "accept.md"


def device_info() -> dict:
    """The device a measurement ran on: JAX's backend, device kind and count, the host CPU and JAX's version."""
    import jax
    from ddd_jax.settings.calibration import cpu_model
    dev = jax.devices()[0]
    cpu = cpu_model()
    return {"backend": jax.default_backend(), "device": getattr(dev, "device_kind", str(dev)),
            "device_count": jax.device_count(), "host_cpu": cpu or platform.processor(), "jax": jax.__version__}


def acceptance_runs(heads: dict, reference: dict | None = None, labels: int = 0) -> dict:
    """{label: run} of stage (f), most important first: for each head EAGLE-2's default tree, DDD at the paper's
    settings, then the shipped tuned CPU and GPU trees (EAGLE-2 and DDD); `labels` > 0 keeps that many of them. The
    `reference` head's default-tree run comes right after the new heads' (the comparison that decides what ships),
    its other runs last."""
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
    order = order[:labels or None]

    def runs(hs: dict) -> list:
        return [(f"{hname}/{label}", {"draft": draft, "method": method, "tree": tree, "ddd": ddd})
                for label, method, tree, ddd in order for hname, draft in hs.items()]

    new, ref = runs(heads), runs(reference or {})
    return dict(new[:len(heads)] + ref[:1] + new[len(heads):] + ref[1:])


def acceptance_result(run: dict, res: dict) -> dict:
    """One run's acceptance record: `measure_runs`' result without per-prompt lists, its settings, and for DDD the
    share of cycles that drafted past the first check step (`past_first_check`)."""
    out = {k: v for k, v in res.items() if k != "per_prompt"}
    out["settings"] = {"method": run["method"], "tree": run["tree"].to_dict(), "ddd": dataclasses.asdict(run["ddd"])}
    dh = res["depth_hist"]
    if run["method"] == "ddd" and dh:
        first = run["ddd"].check_steps[0]
        out["past_first_check"] = sum(v for k, v in dh.items() if int(k) > first) / sum(dh.values())
    return out


def measure_acceptance(target, runs: dict, prompts: list, measured: dict, *, max_new_tokens: int, batch_size: int,
                       deadline: float | None = None, on_update=None, progress: bool = True) -> dict:
    """τ of `runs` ({label: run}, `acceptance_runs`) over `prompts` (token-id lists), keeping the results
    `measured` already holds and measuring the others in order while `deadline` (a time.time() value) allows;
    `on_update(results)` sees the results first and after each new one. Returns {"results" ({label:
    `acceptance_result`}), "not_measured", "measured_now", "prompts", "max_new_tokens"}."""
    from ddd_jax.measure.acceptance import measure_runs
    results = {k: v for k, v in measured.items() if k in runs}
    now = []
    if on_update is not None:
        on_update(results)

    def keep(label, res):
        results[label] = acceptance_result(runs[label], res)
        now.append(label)
        if on_update is not None:
            on_update(results)

    todo = {k: r for k, r in runs.items() if k not in results}
    if todo:  # nothing left: not even the vanilla reference decode
        measure_runs(target, prompts, todo, max_new_tokens=max_new_tokens, batch_size=min(batch_size, len(prompts)),
                     progress=progress, on_result=keep, deadline=deadline)
    return {"results": {k: results[k] for k in runs if k in results},
            "not_measured": [k for k in runs if k not in results], "measured_now": now, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens}


def head_meta(path) -> dict:
    """config.json's content of a head directory or head tar in our format."""
    path = Path(path)
    if path.is_file():
        from ddd_jax.checkpoints.ours import read_head_tar
        return read_head_tar(path)[0]
    return dio.read_json(path / "config.json")


def find_heads(heads_dir) -> dict:
    """{name: path} of the heads in `heads_dir`, sorted by name: directories in our head format (named by the
    directory) and `.tar` files (named by the file without ".tar", or with it where a directory has that name).
    Any other file or directory is ignored."""
    from ddd_jax.checkpoints.ours import HEAD_FORMAT
    d = Path(heads_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"--heads {d}: no such directory")
    out = {}
    for p in sorted(d.iterdir()):
        if p.name.startswith("."):
            continue  # temp files of a write in progress
        if p.is_dir() and (p / "config.json").is_file():
            try:
                if dio.read_json(p / "config.json").get("format") == HEAD_FORMAT:
                    out[p.name] = p
            except (OSError, ValueError):
                pass
    for p in sorted(d.glob("*.tar")):
        if p.is_file() and not p.name.startswith("."):
            out[p.name if p.stem in out else p.stem] = p
    return dict(sorted(out.items()))


def reference_head(target, name: str = "shipped") -> tuple[dict, dict]:
    """({"reference-<head>": Draft}, info) of the head the new ones are compared with in the same run (same prompts,
    device and settings). name: a packaged name, a head directory or .tar; "shipped": the packaged
    "<target>-eagle" when there is one; "": none. A reference that cannot load gives ({}, info with the reason):
    it costs the new heads nothing."""
    from ddd_jax import load_draft
    from ddd_jax.checkpoints import registry
    if not name:
        return {}, {"head": None, "reason": "no reference asked for"}
    if name == "shipped":
        shipped = f"{target.name}-eagle"
        if shipped not in registry.NAMED_DRAFTS:
            return {}, {"head": None, "reason": f"no packaged head {shipped!r}"}
        name = shipped
    try:
        draft = load_draft(name, target)
    except (OSError, ValueError, KeyError) as e:
        return {}, {"head": name, "reason": f"{type(e).__name__}: {e}"[:300]}
    info = {"head": name, "head_type": draft.config.head_type}
    try:
        info["step"] = head_meta(registry.named_draft_dir(name) if name in registry.NAMED_DRAFTS else name
                                 ).get("extra", {}).get("step")
    except (OSError, ValueError):
        pass
    label = Path(name).name.removesuffix(".tar")
    return {f"reference-{label}": draft}, info


def mtbench_prompts(target, limit: int | None = 80) -> list:
    """Token ids of the first `limit` MT-bench first turns, rendered as `ddd-jax bench` renders them."""
    from ddd_jax.measure.prompts import build_prompt, load_questions
    return [build_prompt(target, q, 0, []) for q in load_questions(limit=limit)]


def _stamp(path: Path) -> dict:
    """What tells a head file apart from a retrained one at the same path."""
    files = [path] if path.is_file() else [path / "config.json", path / "model.safetensors"]
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file()}


def load_heads(target, heads_dir) -> tuple[dict, dict, dict]:
    """({name: Draft}, {name: its path, head type, step and file stamp}, {name: why it did not load}) of the heads
    in `heads_dir` (`find_heads`); a head that does not load costs the others nothing."""
    from ddd_jax import load_draft
    heads, info, errors = {}, {}, {}
    for name, path in find_heads(heads_dir).items():
        try:
            heads[name] = load_draft(str(path), target)
        except (OSError, ValueError, KeyError) as e:
            errors[name] = f"{path}: {type(e).__name__}: {e}"[:400]
            continue
        meta = head_meta(path)
        info[name] = {"path": str(path), "head_type": heads[name].config.head_type,
                      "step": meta.get("extra", {}).get("step"), "stamp": _stamp(path)}
    return heads, info, errors


def accept_heads(target, heads_dir, out_dir, reference: str = "shipped", limit: int | None = 80,
                 max_new_tokens: int = 128, batch_size: int = 80, *, prompts: list | None = None,
                 labels=None, deadline: float | None = None, progress: bool = True) -> dict:
    """Measure τ of every head in `heads_dir` (`find_heads`) and of the `reference` head (`reference_head`) at the
    runs of `acceptance_runs` over the first `limit` MT-bench first turns (`prompts`: token-id lists instead),
    `max_new_tokens` each, `batch_size` sequences a batch, into `out_dir`/accept.json and accept.md (written after
    every result). labels: only these runs ("eagle2-default", "ddd-paper", "eagle2-cpu", ...). A rerun with the same
    `out_dir` keeps the results measured with the same prompts for the same head files. Returns accept.json's
    content; its "measured_now" lists what this call measured."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    given = prompts is not None
    prompts = [list(map(int, p)) for p in prompts] if given else mtbench_prompts(target, limit)
    if not prompts:
        raise ValueError("accept: no prompts to measure over")
    setup = {"target": target.name, "prompts": len(prompts), "prompt_source": "given" if given else "mt-bench turn 1",
             "max_new_tokens": max_new_tokens}
    heads, info, errors = load_heads(target, heads_dir)
    ref, ref_info = reference_head(target, reference)
    for name, d in ref.items():
        p = Path(ref_info["head"])
        info[name] = {"path": ref_info["head"], "head_type": d.config.head_type, "step": ref_info.get("step"),
                      "stamp": _stamp(p) if p.exists() else None}
    runs = acceptance_runs(heads, ref)
    if labels is not None:
        labels = set(labels)
        runs = {k: r for k, r in runs.items() if k.rsplit("/", 1)[1] in labels}

    old = dio.read_json(out / JSON_FILE) if (out / JSON_FILE).is_file() else {}
    measured = {}
    if old.get("format") == ACCEPT_FORMAT and old.get("setup") == setup:
        same = {h for h, i in info.items() if old.get("heads", {}).get(h, {}).get("stamp") == i.get("stamp")}
        measured = {k: v for k, v in old.get("results", {}).items() if k.rsplit("/", 1)[0] in same}
    record = {"format": ACCEPT_FORMAT, "version": ACCEPT_VERSION, "setup": setup, "heads_dir": str(heads_dir),
              "device": device_info(), "reference": ref_info, "heads": info, "errors": errors,
              "results": {}, "not_measured": list(runs), "measured_now": []}
    if old.get("format") == ACCEPT_FORMAT and old.get("setup") != setup:
        record["replaced"] = {"setup": old.get("setup"), "results": len(old.get("results", {}))}

    def write(results):
        record.update(results={k: results[k] for k in runs if k in results},
                      not_measured=[k for k in runs if k not in results], updated_utc=dio.utc_now())
        dio.atomic_write_text(out / JSON_FILE, json.dumps(record, indent=1) + "\n")
        dio.atomic_write_text(out / MD_FILE, markdown(record))

    t = time.time()
    r = measure_acceptance(target, runs, prompts, measured, max_new_tokens=max_new_tokens, batch_size=batch_size,
                           deadline=deadline, on_update=write, progress=progress)
    record["measured_now"] = r["measured_now"]
    record["elapsed_s"] = round(time.time() - t, 1)
    write(r["results"])
    return record


def markdown(record: dict) -> str:
    """accept.md: one row per head and run."""
    s = record["setup"]
    lines = [f"# τ of the heads in {record['heads_dir']}", "",
             f"Target {s['target']}, {s['prompts']} prompts ({s['prompt_source']}), {s['max_new_tokens']} new tokens, "
             f"greedy; τ = mean tokens a target call; device {record['device'].get('device')} "
             f"({record['device'].get('backend')}), {record.get('updated_utc', '')}.", "",
             "| head | label | τ | prompts | identical to vanilla | past first check |", "|---|---|---|---|---|---|"]
    for key, res in record["results"].items():
        head, label = key.rsplit("/", 1)
        past = res.get("past_first_check")
        lines.append(f"| {head} | {label} | {res['tau']:.3f} | {res['prompts']} | {res['identical']}/{res['prompts']}"
                     f" | {'' if past is None else f'{past:.1%}'} |")
    if record["not_measured"]:
        lines += ["", f"Not measured yet: {', '.join(record['not_measured'])}."]
    if record["errors"]:
        lines += ["", "Heads that did not load:"] + [f"- {h}: {e}" for h, e in record["errors"].items()]
    if record["reference"].get("reason"):
        lines += ["", f"Reference: none ({record['reference']['reason']})."]
    return "\n".join(lines) + "\n"
