"""`ddd-jax` command line: thin argparse front over library functions (generate, convert, train-draft, bench, tune, lazy-eval)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

# (module, what it adds). Each module exposes add_parser(subparsers) registering `func(args) -> int`.
_COMMANDS = ["ddd_jax.generate_cli", "ddd_jax.calibrate_cli", "ddd_jax.plan_cli", "convert.cli", "train_draft.cli",
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


def compile_cache_dir(env=None, configured: str | None = None) -> Path | None:
    """Where the command line keeps JAX's persistent compilation cache, so that a second run loads its programs
    instead of compiling them. None when the user already chose one (`configured`: `jax.config.jax_compilation_cache_dir`, which
    JAX_COMPILATION_CACHE_DIR sets) or turned it off with DDD_JAX_COMPILE_CACHE=0; DDD_JAX_COMPILE_CACHE=DIR names
    the folder; by default $DDD_JAX_CACHE/xla (~/.cache/ddd_jax/xla). Library calls never turn it on."""
    env = os.environ if env is None else env
    if configured:
        return None
    choice = env.get("DDD_JAX_COMPILE_CACHE", "")
    if choice == "0":
        return None
    if choice:
        return Path(choice).expanduser()
    from .checkpoints.registry import cache_root
    return cache_root() / "xla"


def enable_compile_cache() -> Path | None:
    """Turn on JAX's persistent compilation cache at `compile_cache_dir()` for this process (before anything
    compiles: JAX decides once per process). Returns the folder, or None when it left the setting alone."""
    import jax
    path = compile_cache_dir(configured=jax.config.jax_compilation_cache_dir)
    if path is not None:
        jax.config.update("jax_compilation_cache_dir", str(path))
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # JAX's 1 s skips most of ours on CPU
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    enable_compile_cache()
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"ddd-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
