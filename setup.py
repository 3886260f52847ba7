"""Build step of the package: compile the C kernels in kernels/cpu/ (see refimpl/_native.py).

All metadata lives in pyproject.toml. The kernels are plain C libraries loaded with
ctypes, not Python extension modules; setuptools' extension machinery is used only so
that `pip install` (editable or not) builds them into the package with the same compiler
flags and source-hash stamp that refimpl/_native.py uses when it builds them itself.
The C++ op kernels (`kernels/cpu/*_ops.cpp`) need the headers of the torch they run
with, which pip's isolated build environment does not have: they are built on first
import; a non-editable install carries their source for that.
"""

import importlib.util
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _native():
    # Loaded by path: importing the `refimpl` package would need torch at build time.
    path = ROOT / "refimpl" / "_native.py"
    spec = importlib.util.spec_from_file_location("_refimpl_native", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildKernels(build_ext):
    def build_extension(self, ext):
        target = Path(self.get_ext_fullpath(ext.name))
        _native().compile_library(ROOT / ext.sources[0], target)
        if not self.inplace:  # an installed package has no kernels/ folder beside it
            for source in (ROOT / "kernels" / "cpu").glob("*_ops.cpp"):
                shutil.copy(source, target.parent / source.name)


setup(
    ext_modules=[Extension("refimpl._symm_mem", sources=["kernels/cpu/symm_mem.c"])],
    cmdclass={"build_ext": BuildKernels},
)
