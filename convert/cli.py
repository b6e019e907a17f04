"""`ddd-jax convert target|eagle SRC OUT` and `ddd-jax convert export-head HEAD --out DIR`: thin argparse front over
ddd_jax.checkpoints (loading.convert_target, eagle_official.convert_eagle_dir, export_official.save_official), with an
optional --check against the PyTorch reference (torch_ref)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

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

    x = sub.add_parser("export-head", help="a ddd-jax head -> the official EAGLE-1/2 or EAGLE-3 PyTorch layout",
                       description="Write a head in the official layout of its kind (SafeAILab/EAGLE's, which SGLang "
                                   "also reads): config.json, model.safetensors and a README.md model card.")
    x.add_argument("head", help="a packaged head name, a head directory or a .tar in our format")
    x.add_argument("--out", required=True, help="output directory (must not exist or be empty; written atomically)")
    x.add_argument("--layout", default=None, help="'eagle' (EAGLE-1/2) or 'eagle3' (EAGLE-3); default: the head's own")
    x.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16",
                   help="dtype of the exported weights (default float16)")
    x.add_argument("--target", default=None, help="the target the head drafts for (name or path; default: the "
                                                  "target the head's config names)")
    x.add_argument("--base-model", default=None, help="the model card's base_model (default: the target's hub name)")
    x.add_argument("--license", default=None, help="the model card's license (default: the target's, else 'other')")
    x.set_defaults(func=run_export_head)


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


def run_export_head(args: argparse.Namespace) -> int:
    import ddd_jax
    from ddd_jax.checkpoints.export_official import LAYOUTS, head_target, save_official
    if args.layout is not None and args.layout not in LAYOUTS:  # before loading anything
        raise ValueError(f"unknown layout {args.layout!r}; the official layouts are {sorted(LAYOUTS)}")
    target_name = args.target or head_target(args.head)
    if not target_name:
        raise ValueError(f"{args.head}: the head names no target; pass --target (a name or path)")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # before loading anything
        raise ValueError(f"{out} exists and is not an empty directory: choose a new output directory")
    try:
        target = ddd_jax.load_target(target_name, panels=False)  # row-major: only the embedding is read
    except (ValueError, FileNotFoundError) as e:
        if args.target:
            raise
        raise ValueError(f"the head names its target {target_name!r}, which does not load ({e}); pass --target "
                         "(a name or path)") from None
    draft = ddd_jax.load_draft(args.head, target)
    save_official(draft, out, layout=args.layout, dtype=args.dtype, base_model=args.base_model, license=args.license)
    print(f"wrote {out} ({draft.kind.title}, {args.dtype}, for {target_name})")
    return 0
