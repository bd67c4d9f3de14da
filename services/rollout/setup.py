"""Builds the rollout's native decode kernels with the package (wheel, sdist or editable
install), so no process ever compiles at run time and every process of an install loads the
same libraries.

One shared library per CPU variant (`kernel_abi.VARIANTS`: x86-64-v3, and x86-64-v4 with
AVX-512), chosen at run time by `kernels.load` from the CPU's flags. Before compiling, the
ctypes declarations (`kernel_abi.SIGNATURES`) are checked against `csrc/kernels.h`: a
mismatch fails the build, compiler or not. The libraries themselves are optional: without a
working C compiler the package still installs, and the engine decodes with torch (it logs
and reports that path).
"""

from __future__ import annotations

import importlib.util
import os
import platform
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
ABI = HERE / "src" / "lorafleet_rollout" / "kernel_abi.py"
_spec = importlib.util.spec_from_file_location("_lorafleet_kernel_abi", ABI)
assert _spec is not None and _spec.loader is not None
abi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(abi)


class BuildKernels(build_ext):
    """build_ext that refuses a header disagreeing with the ctypes declarations first."""

    def run(self) -> None:
        try:
            abi.check_header(abi.HEADER.read_text())
        except ValueError as exc:
            raise SystemExit(f"lorafleet-rollout build: {exc}") from None
        super().run()

    def build_extension(self, ext: Extension) -> None:
        # Variants compile the same sources with different flags: separate object folders.
        shared = self.build_temp
        self.build_temp = os.path.join(shared, ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = shared


def _extensions() -> list[Extension]:
    extensions = []
    for variant, _flags, _cpu in abi.VARIANTS.get(platform.machine(), ()):
        digest = abi.sources_digest(variant)
        extensions.append(
            Extension(
                f"lorafleet_rollout.{abi.module_name(variant)}",
                sources=[str(p.relative_to(HERE)) for p in abi.SOURCES],
                # flags live in kernel_abi.py: a change there rebuilds too
                depends=[str(f.relative_to(HERE)) for f in (*abi.HEADERS, ABI)],
                extra_compile_args=list(abi.variant_flags(variant)),
                define_macros=[("LORAFLEET_KERNELS_DIGEST", f'"{digest}"')],
                libraries=["m"],
                optional=True,  # no compiler: install anyway, decode with torch
            )
        )
    return extensions


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildKernels})
