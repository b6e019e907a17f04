"""`ddd-jax` command line: thin argparse front over library functions (generate, convert, train-draft, bench, tune, lazy-eval)."""
from __future__ import annotations

import argparse
import importlib
import sys

# (module, what it adds). Each module exposes add_parser(subparsers) registering `func(args) -> int`.
_COMMANDS = ["ddd_jax.generate_cli", "ddd_jax.plan_cli", "ddd_jax.convert.cli", "ddd_jax.train_draft.cli",
             "ddd_jax.bench.cli", "ddd_jax.bench.lazy_eval_cli"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddd-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in _COMMANDS:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and mod.startswith(e.name):
                continue  # optional command not present in this install
            raise
        m.add_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"ddd-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
