"""`ddd-jax convert target|eagle SRC OUT`: thin argparse front over ddd_jax.checkpoints (loading.convert_target,
eagle_official.convert_eagle_dir), with an optional --check against the PyTorch reference (torch_ref)."""
from __future__ import annotations

import argparse
import sys

DTYPES = ["float32", "float16", "bfloat16"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("convert", help="convert targets and EAGLE heads to ddd-jax checkpoints",
                              description=__doc__)
    sub = p.add_subparsers(dest="kind", required=True)

    t = sub.add_parser("target", help="HF dir (Llama/Mistral/Qwen2/Qwen3) / .gguf / known name -> our target format")
    t.add_argument("src", help="HF model directory, a .gguf file, or a known name (smollm2-135m-instruct)")
    t.add_argument("out", help="output directory (written atomically)")
    t.add_argument("--dtype", choices=DTYPES, default=None, help="parameter dtype (default: as stored; f32 for GGUF)")
    t.add_argument("--check", action="store_true", help="compare logits with transformers on a few tokens")
    t.add_argument("--check-tol", type=float, default=None, help="with --check: fail if the max logit diff exceeds this")
    t.set_defaults(func=run_target)

    e = sub.add_parser("eagle", help="official EAGLE-1/2 PyTorch head -> our head format")
    e.add_argument("src", help="directory with config.json + pytorch_model.bin or model.safetensors")
    e.add_argument("out", help="output directory (written atomically)")
    e.add_argument("--target", required=True, help="the target the head drafts for (name or path)")
    e.add_argument("--dtype", choices=DTYPES, default=None, help="parameter dtype (default: as stored)")
    e.add_argument("--embed-check", choices=["warn", "error", "ignore"], default="warn",
                   help="what to do when the head's embed_tokens differ from the target's embedding")
    e.add_argument("--check", action="store_true", help="compare with a torch reference head on a few tokens")
    e.add_argument("--check-tol", type=float, default=None, help="with --check: fail if the max logit diff exceeds this")
    e.set_defaults(func=run_eagle)


def _report(diffs: dict, tol) -> int:
    for k, v in diffs.items():
        print(f"  {k}: {v:.3g}")
    if tol is not None and diffs["max_logit_diff"] > tol:
        print(f"check FAILED: max logit diff {diffs['max_logit_diff']:.3g} > {tol}", file=sys.stderr)
        return 1
    return 0


def run_target(args: argparse.Namespace) -> int:
    from ddd_jax.checkpoints.loading import convert_target, load_target, resolve_source
    out = convert_target(args.src, args.out, dtype=args.dtype)
    print(f"wrote {out}")
    if not args.check:
        return 0
    kind, path = resolve_source(args.src)
    if kind == "ours":
        print("--check: the source is already in our format; there is no torch reference to compare with")
        return 0
    from ddd_jax.checkpoints.torch_ref import check_tokens, target_check
    target = load_target(out)
    print(f"check against transformers ({path}):")
    return _report(target_check(path, target, check_tokens(target)), args.check_tol)


def run_eagle(args: argparse.Namespace) -> int:
    from ddd_jax.checkpoints.eagle_official import convert_eagle_dir
    from ddd_jax.checkpoints.loading import load_target
    target = load_target(args.target)
    convert_eagle_dir(args.src, args.out, target, dtype=args.dtype, embed_check=args.embed_check)
    print(f"wrote {args.out}")
    if not args.check:
        return 0
    from ddd_jax.checkpoints.loading import load_draft
    from ddd_jax.checkpoints.torch_ref import check_head
    print("check against the torch reference head:")
    return _report(check_head(args.src, load_draft(args.out, target)), args.check_tol)
