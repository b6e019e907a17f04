"""A source checkout on PYTHONPATH (not installed) runs every `ddd-jax` command: ddd_jax.bench / .convert /
.train_draft come from the folders beside ddd_jax/ (ddd_jax/_checkout.py), as the install's package-dir mapping
gives them. The subprocess drops the editable install's finder, so only the checkout is left to find them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

STRIP = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]; "


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", STRIP + code], env=env, capture_output=True, text=True, timeout=120)


def test_checkout_maps_the_cli_packages():
    r = _run("import ddd_jax.bench.mtbench as m, ddd_jax.convert.cli as c, ddd_jax.train_draft.cli as t; "
             "print(m.__file__); print(c.__file__); print(t.__file__)")
    assert r.returncode == 0, r.stderr
    assert [Path(p) for p in r.stdout.split()] == [ROOT / "bench" / "mtbench.py", ROOT / "convert" / "cli.py",
                                                   ROOT / "train_draft" / "cli.py"]


def test_checkout_cli_has_every_command():
    r = _run("from ddd_jax.cli import build_parser; p = build_parser(); "
             "print(sorted(p._subparsers._group_actions[0].choices))")
    assert r.returncode == 0, r.stderr
    for cmd in ("bench", "convert", "generate", "lazy-eval", "train-draft", "tune"):
        assert f"'{cmd}'" in r.stdout, r.stdout


def test_the_finder_answers_only_for_the_mapped_names():
    from ddd_jax._checkout import CheckoutFinder
    f = CheckoutFinder()
    assert Path(f.find_spec("ddd_jax.bench").origin) == ROOT / "bench" / "__init__.py"
    assert f.find_spec("ddd_jax.tests") is None and f.find_spec("bench") is None and f.find_spec("ddd_jax") is None
