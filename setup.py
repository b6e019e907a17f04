"""Builds the optional CPU kernel library `ddd_jax/backends/cpu/_cpu_kernels*.so` (see ddd_jax/backends/cpu/kernels.py).

It is a plain shared library that `jax.ffi` loads (no Python module init), compiled with the system's C++
compiler against jaxlib's XLA FFI headers (jaxlib is a build requirement in pyproject.toml). When either is
missing or the compile fails, the install goes on without it and the package uses XLA's dot.
"""
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _ffi_include():
    try:
        import importlib.util
        spec = importlib.util.find_spec("jaxlib")
        if spec and spec.submodule_search_locations:
            for root in spec.submodule_search_locations:
                inc = os.path.join(root, "include")
                if os.path.exists(os.path.join(inc, "xla", "ffi", "api", "ffi.h")):
                    return inc
    except Exception:  # noqa: BLE001
        pass
    return None


class OptionalBuildExt(build_ext):
    """Never fails the install: a kernel that cannot be built leaves the XLA path."""

    def get_export_symbols(self, ext):  # not a Python module: no PyInit_ symbol to export
        return []

    def build_extension(self, ext):
        inc = _ffi_include()
        if inc is None:
            print("ddd_jax: jaxlib's FFI headers not found; skipping the CPU kernel (XLA's dot is used)",
                  file=sys.stderr)
            return
        ext.include_dirs.append(inc)
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            print(f"ddd_jax: building the CPU kernel failed ({e}); XLA's dot is used", file=sys.stderr)


kernels = Extension(
    "ddd_jax.backends.cpu._cpu_kernels",
    sources=["ddd_jax/backends/cpu/csrc/cpu_kernels.cc"],
    language="c++",
    # no -march flags: the kernels carry target("avx2,fma") themselves and the library checks the CPU at load;
    # experiments/kernel_ab.py compiles other revisions with these same flags (FLAGS there)
    extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off", "-Wno-attributes", "-Wno-return-type"],
    optional=True,
)

setup(ext_modules=[kernels], cmdclass={"build_ext": OptionalBuildExt})
