"""A source checkout on PYTHONPATH (not installed, no import hook) runs every `ddd-jax` command -- how a machine
without the package registry runs the recipe (scripts/gpu_recipe.sh). convert/ and train_draft/ are packages of
their own that import ddd_jax as any user would. The subprocess drops the editable install's finder, so only the
checkout is left to find them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

STRIP = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]; "


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", STRIP + code], env=env, capture_output=True, text=True, timeout=120,
                          cwd="/")


def test_checkout_imports_the_cli_packages_from_its_folders():
    r = _run("import ddd_jax.bench.mtbench as m, convert.cli as c, train_draft.recipe as t; "
             "print(m.__file__); print(c.__file__); print(t.__file__)")
    assert r.returncode == 0, r.stderr
    assert [Path(p) for p in r.stdout.split()] == [ROOT / "ddd_jax" / "bench" / "mtbench.py",
                                                   ROOT / "convert" / "cli.py", ROOT / "train_draft" / "recipe.py"]


def test_checkout_cli_has_every_command():
    r = _run("from ddd_jax.cli import build_parser; p = build_parser(); "
             "print(sorted(p._subparsers._group_actions[0].choices))")
    assert r.returncode == 0, r.stderr
    for cmd in ("bench", "convert", "generate", "lazy-eval", "train-draft", "tune"):
        assert f"'{cmd}'" in r.stdout, r.stdout


def test_the_library_does_not_import_the_cli_packages():
    r = _run("import sys, ddd_jax; ddd_jax.generate; print(sorted(m for m in sys.modules "
             "if m.split('.')[0] in ('convert', 'train_draft') or m.startswith('ddd_jax.bench')))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
