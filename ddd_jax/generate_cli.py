"""`ddd-jax generate`: decode one prompt with vanilla, EAGLE-2 or DDD (any sync mode) and print text or JSON."""
from __future__ import annotations

import argparse
import json
import sys

from .settings import DRAFT_DTYPES

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_DRAFTS = {"smollm2-135m-instruct": "smollm2-135m-instruct-eagle"}


def add_tree_args(p: argparse.ArgumentParser) -> None:
    """Tree / DDD flags shared by generate and bench (None = tuned settings for this backend, else defaults)."""
    g = p.add_argument_group("tree and DDD settings")
    g.add_argument("--top-k", type=int, default=None, help="EAGLE-2 beam width / children per node (default 10)")
    g.add_argument("--total-tokens", type=int, default=None, help="verified tokens incl. the root (default 60)")
    g.add_argument("--depth", type=int, default=None, help="EAGLE-2 draft steps (default 5)")
    g.add_argument("--ddd-checks", type=str, default=None, help="DDD check steps, comma separated (default 5,7,9)")
    g.add_argument("--ddd-threshold", type=float, default=None, help="DDD confidence threshold x (default -0.3)")
    g.add_argument("--ddd-max-depth", type=int, default=None, help="DDD maximum draft steps n (default 11)")
    g.add_argument("--settings", choices=["auto", "none"], default="auto",
                   help="auto: start from the tuned settings file for this backend if one exists")


def tree_and_ddd(args):
    """Build (TreeConfig, DDDConfig, source) from flags over tuned settings over defaults."""
    import dataclasses

    from .settings import base_configs
    tree, ddd, source = base_configs(args.target, args.draft or DEFAULT_DRAFTS.get(args.target),
                                     use_tuned=getattr(args, "settings", "none") == "auto",
                                     storage="blocks" if getattr(args, "gguf_blocks", False) else None)
    over = {k: v for k, v in (("top_k", args.top_k), ("total_tokens", args.total_tokens), ("depth", args.depth))
            if v is not None}
    tree = dataclasses.replace(tree, **over) if over else tree
    over = {}
    if args.ddd_checks is not None:
        try:
            over["check_steps"] = tuple(int(x) for x in args.ddd_checks.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--ddd-checks must be comma-separated integers, got {args.ddd_checks!r}") from None
    if args.ddd_threshold is not None:
        over["threshold"] = args.ddd_threshold
    if args.ddd_max_depth is not None:
        over["max_depth"] = args.ddd_max_depth
    ddd = dataclasses.replace(ddd, **over) if over else ddd
    tree_flags = any(getattr(args, k) is not None for k in ("top_k", "total_tokens", "depth"))
    ddd_flags = any(getattr(args, k) is not None for k in ("ddd_checks", "ddd_threshold", "ddd_max_depth"))
    if tree_flags or ddd_flags:
        source += " + command-line flags"
    # settings compose: flags for one part take the other part from the file when it fits, else the paper's
    from .config import DDDConfig, TreeConfig, check_tree_for_ddd
    try:
        check_tree_for_ddd(tree, ddd)
    except ValueError:
        if tree_flags and not ddd_flags:
            ddd, source = DDDConfig(), source + " (the paper's DDD rule: the tuned one does not fit this tree)"
        elif ddd_flags and not tree_flags:
            tree, source = TreeConfig(), source + " (the paper's tree: the tuned one does not fit this DDD rule)"
    return tree, ddd, source


def gguf_blocks_value(s: str):
    """--gguf-blocks' optional value: "int8" (integer products), or "exact" (the same as the bare flag)."""
    if s in ("int8", "exact"):
        return "int8" if s == "int8" else True
    raise argparse.ArgumentTypeError(f"--gguf-blocks takes int8 (or exact, the default), not {s!r}")


def add_gguf_blocks_arg(p, help: str) -> None:
    """`--gguf-blocks` (args.gguf_blocks True: the exact float32 products of the blocks) or `--gguf-blocks int8`
    (args.gguf_blocks "int8": integer products over int8 activations, llama.cpp's arithmetic); default False. The
    value goes to `load_target(..., gguf_blocks=...)` as it is."""
    p.add_argument("--gguf-blocks", nargs="?", const=True, default=False, type=gguf_blocks_value, metavar="int8",
                   help=help + "; '--gguf-blocks int8': the layer products by int8 integer dot products (close to, "
                               "not bitwise, the float32 products; docs/cpu.md)")


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with vanilla, EAGLE-2 or DDD decoding")
    p.add_argument("--target", default=DEFAULT_TARGET, help="target name or path (default %(default)s)")
    p.add_argument("--draft", default=None, help="draft head name or path (default: the packaged head for the target)")
    p.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default=None,
                   help="the head's weight dtype or GGUF block kind (default: the tuned settings' with --settings auto, "
                        "else as stored)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--method", choices=["vanilla", "eagle2", "ddd"], default="vanilla")
    p.add_argument("--sync", choices=["host", "callback", "device"], default="device", help="DDD sync mode")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", action="store_true",
                   help="also run vanilla decoding and report whether the tokens are identical and the speed ratio")
    p.add_argument("--compare-repeat", type=int, default=3,
                   help="with --compare: timed runs of each, alternating method and vanilla after one warm-up run "
                        "of each; the medians are reported (a noisy CPU's speed drifts between runs)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    add_gguf_blocks_arg(p, "(GGUF targets) keep the Q4_1 / Q8_0 / Q4_0 matrices as blocks: the same float32 values "
                           "and arithmetic, ~1/6 of the bytes per forward")
    p.add_argument("--no-panels", action="store_true",
                   help="keep the float32 layer matrices row-major (default on CPU: panel-major, bitwise the same "
                        "products, faster streams)")
    p.add_argument("--json", action="store_true", help="print one JSON object with tokens, text and stats")
    add_tree_args(p)
    from .sharding import add_mesh_args
    add_mesh_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from . import generate, load_draft, load_target
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.compare_repeat < 1:
        raise ValueError(f"--compare-repeat must be >= 1, got {args.compare_repeat}")
    tree, ddd, source = tree_and_ddd(args)
    from .sharding import mesh_from_args
    target = load_target(args.target, mesh=mesh_from_args(args), gguf_blocks=args.gguf_blocks,
                         panels=False if args.no_panels else None)
    draft = None
    if args.method != "vanilla" or args.compare:
        name = args.draft or DEFAULT_DRAFTS.get(args.target)
        if name is None and args.method != "vanilla":
            raise ValueError(f"--method {args.method} needs --draft (no packaged head for target {args.target!r})")
        from .settings import cli_draft
        draft = cli_draft(load_draft(name, target) if name else None, args.draft_dtype,
                          getattr(args, "settings", "none") == "auto", args.target, name,
                          storage="blocks" if args.gguf_blocks else None)
    automatic = False
    if args.method != "vanilla":  # this device's calibration, made at first use (`calibration.cli_configs`)
        from .calibration import TREE_FLAGS, cli_configs
        tree, ddd, source = cli_configs(args, target, draft, args.method) or (tree, ddd, source)
        # no tree / DDD flag: generate's own defaults (the same settings), which decode as vanilla where this
        # device's calibration or the tuned settings say nothing speculative beats it (`settings.vanilla_fallback`)
        automatic = (getattr(args, "settings", "none") == "auto"
                     and not any(getattr(args, k, None) is not None for k in TREE_FLAGS))
    ids = target.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else target.encode(args.prompt)
    kw = dict(max_new_tokens=args.max_new_tokens, tree=None if automatic else tree, ddd=None if automatic else ddd,
              temperature=args.temperature, top_p=args.top_p, seed=args.seed)

    stream = None
    if args.stream and not args.json:
        shown = []

        def print_new(new):
            shown.extend(new)
            sys.stdout.write(target.decode(shown)[len(target.decode(shown[: len(shown) - len(new)])):])
            sys.stdout.flush()
        stream = print_new

    # first call compiles; when comparing, one warm-up run of each, then --compare-repeat timed runs of each,
    # alternating, and the median run of each is reported (its stats; the speedup is the ratio of the medians)
    if args.compare:
        generate(target, draft, ids, method=args.method, sync=args.sync, **kw)
        generate(target, None, ids, **kw)
    runs, vans = [], []
    for r in range(args.compare_repeat if args.compare else 1):
        runs.append(generate(target, draft, ids, method=args.method, sync=args.sync,
                             stream=stream if r == 0 else None, **kw))
        if args.compare:
            vans.append(generate(target, None, ids, **kw))

    def per_token(g):  # decode seconds per token after the first (which the prefill produces)
        return g.stats["decode_s"] / max(len(g.tokens) - 1, 1)

    def median(gs):
        return sorted(gs, key=per_token)[(len(gs) - 1) // 2]

    res = median(runs)
    used = res.stats.get("settings") or {}
    if automatic and used:  # what generate resolved (the same settings; it may have decoded as vanilla)
        from .config import TreeConfig
        tree, ddd = TreeConfig(**used["tree"]), used.get("ddd") or ddd
        source = used["source"] + (f"; decoded as vanilla: {used['why']}" if used.get("why") else "")
    out = {"tokens": res.tokens, "text": res.text, "stats": res.stats,
           "settings": {"tree": tree.__dict__, "ddd": dict(getattr(ddd, "__dict__", ddd)), "source": source,
                        "decoded_as": used.get("decoded_as", args.method)}}
    if args.compare:
        van = median(vans)
        out["vanilla"] = {"identical": all(v.tokens == g.tokens for v, g in zip(vans, runs)),
                          "tokens_per_s": van.stats["tokens_per_s"],
                          "speedup": per_token(van) / max(per_token(res), 1e-9), "runs": len(runs),
                          "speedups": [per_token(v) / max(per_token(g), 1e-9) for v, g in zip(vans, runs)]}
    if args.json:
        print(json.dumps(out))
        return 0
    if not args.stream:
        print(res.text)
    else:
        print()
    st = res.stats
    line = (f"[{args.method}{'/' + args.sync if args.method == 'ddd' else ''}] {st['new_tokens']} tokens, "
            f"{st['tokens_per_s']:.1f} tok/s, target calls {st['target_calls']}")
    if args.method != "vanilla":
        line += (f", tau {st['mean_accepted']:.2f}, mean depth {st['mean_depth']:.2f}, "
                 f"host syncs {st['host_syncs']} (draft {st['draft_syncs']}), settings: {source}")
    print(line, file=sys.stderr)
    if args.compare:
        v = out["vanilla"]
        spread = (f" (median of {v['runs']} alternating runs: {min(v['speedups']):.2f}-{max(v['speedups']):.2f}x)"
                  if v["runs"] > 1 else "")
        print(f"[vanilla] {v['tokens_per_s']:.1f} tok/s; identical tokens: {v['identical']}; "
              f"speedup {v['speedup']:.2f}x{spread}", file=sys.stderr)
    return 0
