"""The wheel users install holds every module, data file and command, and they import and run from it alone.

Built offline from a copy of the source tree, installed into a throwaway venv, imported and run from there with the
source tree off sys.path."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path, PurePosixPath

import pytest

pytestmark = pytest.mark.slow  # builds the wheel (with the optional C++ kernel) and imports every module

REPO = Path(__file__).resolve().parent.parent
TOP_PACKAGES = ("ddd_jax", "convert", "train_draft")  # what pyproject's [tool.setuptools.packages.find] includes
# files inside the packages' folders that the wheel leaves out on purpose (documentation, not read at run time)
NOT_SHIPPED = {"train_draft/MODEL_CARD.md"}
# the data the code reads at run time (pyproject's package-data), each a glob under a package folder
DATA = {"shipped head": "ddd_jax/heads/**/*", "tuned settings": "ddd_jax/settings/*.json",
        "kernel source": "ddd_jax/backends/cpu/csrc/*.cc"}


def _not_source(folder: str, names: list[str]) -> set[str]:
    """What the copy of the tree leaves out: build leftovers anywhere; at the top, hidden entries (.git, .venv),
    venvs, and build and run outputs."""
    skip = {n for n in names if n == "__pycache__" or n.endswith((".egg-info", ".pyc"))
            or (n.startswith("_cpu_kernels") and n.endswith(".so"))}
    if Path(folder) == REPO:
        skip |= {n for n in names if n.startswith(".") or n in ("build", "dist", "runs", "data")
                 or (REPO / n / "pyvenv.cfg").exists()}
    return skip


def source_files(root: Path) -> tuple[set[str], set[str]]:
    """(module names, other files as relative posix paths) of the packages under `root`: every folder reached from a
    top package through folders holding an __init__.py."""
    modules, others = set(), set()
    for top in TOP_PACKAGES:
        for folder, dirs, files in os.walk(root / top):
            here = Path(folder)
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if "__init__.py" not in files:  # a data folder (heads/, csrc/)
                others |= {(here / f).relative_to(root).as_posix() for f in files}
                continue
            pkg = ".".join(here.relative_to(root).parts)
            modules.add(pkg)
            for f in files:
                if f.endswith(".py") and f != "__init__.py":
                    modules.add(f"{pkg}.{f[:-3]}")
                elif not f.endswith(".py") and not (f.startswith("_cpu_kernels") and f.endswith(".so")):
                    others.add((here / f).relative_to(root).as_posix())
    return modules, others


def wheel_files(names: list[str]) -> tuple[set[str], set[str]]:
    """(module names, other files) that a wheel's file list holds under the top packages."""
    modules, others = set(), set()
    for n in names:
        p = PurePosixPath(n)
        if p.parts[0] not in TOP_PACKAGES or n.endswith("/"):
            continue
        if p.suffix == ".py":
            modules.add(".".join(p.parent.parts) if p.name == "__init__.py" else ".".join(p.with_suffix("").parts))
        else:
            others.add(n)
    return modules, others


# Run by the installed venv's python, cwd outside the repository: walk and import every module of the top packages,
# check where each came from, and run two commands' --help through the command line's main.
_IMPORT_ALL = r"""
import contextlib, importlib, importlib.util, io, json, os, pkgutil, sys
install, repo, tops = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
inside = lambda p, d: os.path.realpath(p).startswith(os.path.realpath(d) + os.sep)
same = lambda a, b: os.path.realpath(a) == os.path.realpath(b)
on_path = [p for p in sys.path if any(same(os.path.join(p or ".", t), os.path.join(repo, t)) for t in tops)]
assert not on_path, f"the source tree is on sys.path: {on_path}"

def fail(name):
    raise RuntimeError(f"importing {name} failed")

walked = []
for top in tops:
    pkg = importlib.import_module(top)
    walked.append(top)
    for info in pkgutil.walk_packages(pkg.__path__, top + ".", onerror=fail):
        spec = importlib.util.find_spec(info.name)
        if not spec.origin.endswith(".py"):
            continue  # the CPU kernel library: loaded by ctypes, not a Python module
        importlib.import_module(info.name)
        walked.append(info.name)
elsewhere = {n: m.__file__ for n, m in sys.modules.items()
             if n.split(".")[0] in tops and not inside(m.__file__, install)}
assert not elsewhere, f"modules imported from outside the install: {elsewhere}"

from ddd_jax.backends.cpu import kernels
kernel_libs = []
if kernels.available() and os.path.exists("/proc/self/maps"):
    with open("/proc/self/maps") as f:
        kernel_libs = sorted({line.split()[-1] for line in f if "_cpu_kernels" in line})
    assert kernel_libs and all(inside(p, install) for p in kernel_libs), kernel_libs

from ddd_jax.cli import main
helps = {}
for cmd in ("calibrate", "generate"):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([cmd, "--help"])
        except SystemExit as e:
            assert e.code in (0, None), (cmd, e.code)
    helps[cmd] = out.getvalue()
print(json.dumps({"modules": walked, "kernel_libs": kernel_libs, "helps": helps}))
"""


def run(cmd, **kw):
    cmd = [str(c) for c in cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    shown = " ".join(c if len(c) < 200 else "<script>" for c in cmd)
    assert r.returncode == 0, f"{shown} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
    return r


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(wheel, copied source root, venv, its python, its site-packages). The wheel is built offline from a copy of
    the tree, so no build/ or egg-info left in the repository can add or hide files, and installed into a venv whose
    only other path is the test venv's site-packages, added as a plain path: its .pth files, the editable install
    among them, never run."""
    # the build backend, without build isolation (offline): setuptools with its own bdist_wheel, and jaxlib's headers
    setuptools = tuple(int(x) for x in importlib.metadata.version("setuptools").split(".")[:2])
    assert setuptools >= (70, 1) or importlib.util.find_spec("wheel"), "building wheels needs setuptools>=70.1"
    assert importlib.util.find_spec("jaxlib"), "jaxlib (a build requirement) is missing"
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=_not_source)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", tmp / "dist", "."], cwd=src)
    (wheel,) = (tmp / "dist").glob("ddd_jax-*.whl")

    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False, symlinks=True)
    py = env_dir / "bin" / "python"
    purelib = run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    Path(purelib, "_test_deps.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel])
    return wheel, src, env_dir, py, Path(purelib)


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "DDD_JAX_KERNELS_LIB", "DDD_JAX_NO_KERNELS")}
    env["DDD_JAX_COMPILE_CACHE"] = "0"
    return env


def test_wheel_holds_every_module_and_data_file(built):
    wheel, src, *_ = built
    names = zipfile.ZipFile(wheel).namelist()
    w_modules, w_others = wheel_files(names)
    s_modules, s_others = source_files(src)
    assert w_modules == s_modules, (f"missing from the wheel: {sorted(s_modules - w_modules)}; "
                                    f"not in the source tree: {sorted(w_modules - s_modules)}")
    for what, pattern in DATA.items():
        expected = {p.relative_to(src).as_posix() for p in src.glob(pattern) if p.is_file()}
        assert expected, f"no {what} in the source tree ({pattern})"
        assert expected <= w_others, f"{what} missing from the wheel: {sorted(expected - w_others)}"
    head = "ddd_jax/heads/smollm2-135m-instruct-eagle/"
    assert {head + "config.json", head + "model.safetensors"} <= w_others
    # any other file beside the code is shipped too, or named in NOT_SHIPPED
    assert s_others - NOT_SHIPPED <= w_others, f"not in the wheel: {sorted(s_others - NOT_SHIPPED - w_others)}"
    # a new top-level package is a choice: add it to find's include (pyproject.toml) and TOP_PACKAGES
    tops = {p.parent.name for p in src.glob("*/__init__.py")}
    assert tops <= set(TOP_PACKAGES), f"packages the wheel leaves out: {sorted(tops - set(TOP_PACKAGES))}"
    assert not [n for n in names if n.split("/")[0] in ("tests", "experiments", "scripts")]


def test_installed_wheel_imports_every_module_off_the_source_tree(built, tmp_path):
    wheel, src, env_dir, py, purelib = built
    r = run([py, "-c", _IMPORT_ALL, purelib, REPO, ",".join(TOP_PACKAGES)], cwd=tmp_path, env=clean_env())
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(got["modules"]) == wheel_files(zipfile.ZipFile(wheel).namelist())[0]
    assert "ddd_jax.measure" in got["modules"]
    assert got["helps"]["calibrate"].startswith("usage: ddd-jax calibrate")
    assert got["helps"]["generate"].startswith("usage: ddd-jax generate")

    # the console script pip wrote, as a user runs it
    out = run([env_dir / "bin" / "ddd-jax", "calibrate", "--help"], cwd=tmp_path, env=clean_env()).stdout
    assert out.startswith("usage: ddd-jax calibrate")
