"""A source checkout on PYTHONPATH, not installed: `ddd_jax.bench`, `ddd_jax.convert` and `ddd_jax.train_draft`
from the folders beside `ddd_jax/`, as the install's package-dir mapping gives them (pyproject.toml).

The finder sits at the end of `sys.meta_path`, so an install (editable or not) is always found first; it answers
only for those three names and only where the folder exists, and their submodules are then found the usual way
(the package's `__path__` is the folder)."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

MAPPED = ("bench", "convert", "train_draft")  # pyproject.toml [tool.setuptools.package-dir]
ROOT = Path(__file__).resolve().parent.parent


class CheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        pkg, _, name = fullname.partition(".")
        if pkg != __package__ or name not in MAPPED:
            return None
        init = ROOT / name / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


def install() -> None:
    """Append the finder once, where this is a checkout (pyproject.toml and a mapped folder beside the package)."""
    if any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
        return
    if (ROOT / "pyproject.toml").is_file() and any((ROOT / n / "__init__.py").is_file() for n in MAPPED):
        sys.meta_path.append(CheckoutFinder())
