"""Build and load refimpl's C kernels (`kernels/cpu/*.c`) as plain shared libraries.

The CUDA kernels (`kernels/cuda/*.cu`, `load_cuda_library`) are built the same way by
nvcc, on first use only: never by `pip install`, and never where no GPU uses them.

The kernels are plain C11 (no torch headers), loaded with ctypes. A library is found in
this order:

1. the one the package install built (`setup.py`, next to this file), if it was built
   from the very source this checkout holds (the build stamps a hash of the source in);
2. one compiled earlier into `build/refimpl-kernels/` of this checkout (or, when the
   checkout is read-only, the user's cache directory) under the source's hash;
3. otherwise it is compiled now into that place: into a temporary file first, then
   renamed, so that parallel test workers never see a half-written library.

A checkout that was never pip-installed therefore works too, and an edited kernel is
rebuilt on the next import instead of running stale code.

`build_torch_op_library` builds the one C++ file that registers op kernels with torch's
dispatcher (`kernels/cpu/*_ops.cpp`); its caller loads it when it is ready to. It
needs torch's headers, so it is built on first use (symmetric memory's first CPU
rendezvous, never at import) against the torch that is installed (never by `pip
install`, whose build environment has no torch), under a hash of its source, its flags
and that torch's version, into the user's cache first (a copy of the checkout finds it
there), one process at a time (a file lock). When it cannot be built, the caller keeps its Python
kernels. Most of such a build is parsing torch's headers: `build_torch_op_header` compiles
them once into a precompiled header, which every later build named by
`$REFIMPL_TORCH_OP_HEADER` includes first (the mutation tests build one library per C++
mutant: about 4 s of CPU each instead of 10); the library is the same either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import glob
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["load_kernel_library", "build_torch_op_library", "build_torch_op_header",
           "torch_op_digest", "source_hash",
           "compile_library", "stamped_hash", "CFLAGS", "CXXFLAGS", "load_cuda_library",
           "compile_cuda_library", "NVCC_FLAGS", "nvcc_flags", "nvcc_path"]

REPO_ROOT = Path(__file__).resolve().parent.parent
KERNEL_DIR = REPO_ROOT / "kernels" / "cpu"
PACKAGE_DIR = Path(__file__).resolve().parent
# -O3 vectorises the reductions (2-3x faster than -O2); vector lanes still add the ranks
# in rank order, and -ffp-contract=off forbids fused multiply-adds, so results stay
# bitwise those of the scalar loop (SM-15).
CFLAGS = ["-std=c11", "-O3", "-fPIC", "-shared", "-ffp-contract=off", "-Wall", "-Wextra"]
CUDA_KERNEL_DIR = REPO_ROOT / "kernels" / "cuda"
# Hopper machine code plus PTX that newer GPUs compile at load. No fused multiply-add, no
# flush to zero, IEEE division: the reductions give the CPU kernels' bits. Every warning of
# nvcc, of the host compiler and of ptxas (register spills, local memory) is an error.
NVCC_FLAGS = ["-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC",
              "-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90",
              "-fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true",
              "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror",
              "-Xptxas", "--warn-on-spills,--warn-on-local-memory-usage,--warning-as-error"]
_loaded: dict[str, ctypes.CDLL] = {}


def source_hash(source: Path, flags: list[str] = CFLAGS) -> str:
    """Hash of a kernel's source and its compile flags: the library's identity."""
    digest = hashlib.sha256(source.read_bytes())
    digest.update(" ".join(flags).encode())
    return digest.hexdigest()[:16]


def compile_library(source: Path, target: Path) -> Path:
    """Compile `source` into the shared library `target` atomically (temp file + rename)."""
    compiler = os.environ.get("CC", "gcc")
    return _build(source, target, lambda tmp: [
        compiler, *CFLAGS, f'-DREFIMPL_SOURCE_HASH="{source_hash(source)}"', "-o", tmp,
        str(source), "-lm"])


def nvcc_path() -> str | None:
    """The nvcc to use: $NVCC, else the one on PATH, else $CUDA_HOME's; None if there is none."""
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"), f"{cuda_home}/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def nvcc_flags() -> list[str]:
    """NVCC_FLAGS, then $REFIMPL_NVCC_EXTRA_FLAGS (say "-Xcompiler -Wno-error" where another
    host compiler warns); all of them are part of the library's hash."""
    return [*NVCC_FLAGS, *os.environ.get("REFIMPL_NVCC_EXTRA_FLAGS", "").split()]


def compile_cuda_library(source: Path, target: Path) -> Path:
    """nvcc-compile `source` (a kernels/cuda/*.cu) into the shared library `target` atomically."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError(f"compiling {source} needs nvcc: none on PATH, in $NVCC or $CUDA_HOME")
    flags = nvcc_flags()
    define = f'-DREFIMPL_SOURCE_HASH="{source_hash(source, flags)}"'
    return _build(source, target, lambda tmp: [nvcc, *flags, define, "-o", tmp, str(source)])


def _build(source: Path, target: Path, command) -> Path:
    """Run `command(temporary path)`, then rename its output to `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = command(tmp)
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source} failed ({' '.join(cmd)}):\n{result.stderr}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _cache_dirs() -> list[Path]:
    user_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return [REPO_ROOT / "build" / "refimpl-kernels", user_cache / "refimpl-kernels"]


def stamped_hash(lib: ctypes.CDLL) -> str | None:
    try:
        fn = lib.rsm_source_hash
    except AttributeError:
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode()


def _installed_library(name: str, wanted_hash: str | None) -> ctypes.CDLL | None:
    """The library the package install put next to this file, if it is current."""
    for path in sorted(glob.glob(str(PACKAGE_DIR / f"_{name}*.so"))):
        lib = ctypes.CDLL(path)
        if wanted_hash is None or stamped_hash(lib) == wanted_hash:
            return lib
    return None


def _compiled_library(source: Path, name: str, digest: str,
                      compile=compile_library) -> ctypes.CDLL:
    errors = []
    for directory in _cache_dirs():
        target = directory / f"lib{name}-{digest}.so"
        if not target.exists():
            try:
                compile(source, target)
            except OSError as exc:  # read-only checkout: try the next place
                errors.append(f"{directory}: {exc}")
                continue
        return ctypes.CDLL(str(target))
    raise RuntimeError(f"cannot build kernel library {name!r}: " + "; ".join(errors))


def load_kernel_library(name: str) -> ctypes.CDLL:
    """Load the C library built from `kernels/cpu/<name>.c` (building it if needed)."""
    if name in _loaded:
        return _loaded[name]
    source = KERNEL_DIR / f"{name}.c"
    if source.exists():
        digest = source_hash(source)
        lib = _installed_library(name, digest) or _compiled_library(source, name, digest)
    else:  # an installed package without its sources: only the built library exists
        lib = _installed_library(name, None)
        if lib is None:
            raise RuntimeError(f"kernel library {name!r}: neither {source} nor a built "
                               f"library in {PACKAGE_DIR} exists; reinstall refimpl")
    _loaded[name] = lib
    return lib


# ---- C++ op kernels against the installed torch
# torch 2.14 needs C++20; no fused multiply-add, so the pointwise steps of SM-24 round as
# ATen's ops do.
CXXFLAGS = ["-std=c++20", "-O3", "-fPIC", "-shared", "-w", "-ffp-contract=off"]


def _torch_build():
    """Compiler flags and identity of the installed torch's C++ side."""
    import torch

    root = Path(torch.__file__).resolve().parent
    include = root / "include"
    flags = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}"]
    libs = [f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}", "-lc10", "-ltorch_cpu"]
    identity = f"{torch.__version__} {torch.version.git_version}"
    return flags, libs, identity


@contextlib.contextmanager
def _locked(directory: Path):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _compile_into(source: Path, target: Path, command) -> None:
    """Run the C++ compiler's `command(temporary path)`, then rename its output to
    `target`: a parallel reader never sees a half-written file."""
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = [os.environ.get("CXX", "g++"), *command(tmp)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source} failed ({' '.join(cmd)}):\n"
                               f"{result.stderr[-3000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _compile_cxx(source: Path, target: Path, flags: list[str], libs: list[str]) -> None:
    _compile_into(source, target, lambda tmp: [*CXXFLAGS, *flags, *_precompiled_header(),
                                               "-o", tmp, str(source), *libs])


# The #include lines of a C++ kernel source that name torch's own headers (ATen, c10, torch).
_TORCH_INCLUDE = re.compile(r"^#include <(?:ATen|c10|torch)/[^>]+>$", re.MULTILINE)
TORCH_OP_HEADER_VARIABLE = "REFIMPL_TORCH_OP_HEADER"


def _precompiled_header() -> list[str]:
    """`-include HEADER` when $REFIMPL_TORCH_OP_HEADER names a header that was
    precompiled (g++ finds HEADER.gch beside it, and falls back to the header itself when
    that does not fit the flags: the library is the same either way)."""
    header = os.environ.get(TORCH_OP_HEADER_VARIABLE)
    if not header or not Path(header + ".gch").exists():
        return []
    return ["-include", header]


def build_torch_op_header(name: str) -> Path:
    """Precompile the torch headers that `kernels/cpu/<name>.cpp` includes, against the
    installed torch and with the flags of its library, into the user's cache (once per
    headers, flags and torch; a file lock); returns the header's path, for
    $REFIMPL_TORCH_OP_HEADER."""
    flags, _, identity = _torch_build()
    text = "\n".join(_TORCH_INCLUDE.findall(_cxx_source(name).read_text())) + "\n"
    digest = hashlib.sha256(text.encode())
    digest.update(" ".join(CXXFLAGS + flags + [identity]).encode())
    directory = _cache_dirs()[-1]
    header = directory / f"{name}-headers-{digest.hexdigest()[:16]}.h"
    compiled = Path(str(header) + ".gch")
    # The library's flags but -shared: g++ ignores a header whose flags differ from those
    # of the compile that includes it.
    header_flags = [f for f in CXXFLAGS if f != "-shared"] + flags
    if not compiled.exists():
        with _locked(directory):
            if not compiled.exists():
                header.write_text(text)
                _compile_into(header, compiled, lambda tmp: [
                    *header_flags, "-x", "c++-header", "-o", tmp, str(header)])
    return header


def _cxx_source(name: str) -> Path:
    """The checkout's `kernels/cpu/<name>.cpp`, or the copy a package install put here."""
    source = KERNEL_DIR / f"{name}.cpp"
    return source if source.exists() else PACKAGE_DIR / f"{name}.cpp"


def torch_op_digest(name: str) -> str:
    """The identity of `kernels/cpu/<name>.cpp` built against the installed torch."""
    flags, libs, identity = _torch_build()
    digest = hashlib.sha256(_cxx_source(name).read_bytes())
    digest.update(" ".join(CXXFLAGS + flags + libs + [identity]).encode())
    return digest.hexdigest()[:16]


def build_torch_op_library(name: str) -> Path:
    """Build `kernels/cpu/<name>.cpp` (once per source and torch) without loading it;
    returns its path. Raises when it cannot be built."""
    source = _cxx_source(name)
    flags, libs, _ = _torch_build()
    filename = f"lib{name}-{torch_op_digest(name)}.so"
    errors = []
    for directory in reversed(_cache_dirs()):  # the user's cache first: copies share it
        target = directory / filename
        try:
            if not target.exists():
                with _locked(directory):
                    if not target.exists():
                        _compile_cxx(source, target, flags, libs)
        except OSError as exc:  # a read-only place: try the next one
            errors.append(f"{directory}: {exc}")
            continue
        return target
    raise RuntimeError(f"cannot build op library {name!r}: " + "; ".join(errors))


def load_cuda_library(name: str) -> ctypes.CDLL:
    """Load the library nvcc builds from `kernels/cuda/<name>.cu` (building it if needed).

    Only the checkout's source is used, under the hash of the source and nvcc_flags(), in
    the places a C library is built; loading it needs no GPU, calling into it does.
    """
    key = f"cuda:{name}"
    if key not in _loaded:
        source = CUDA_KERNEL_DIR / f"{name}.cu"
        digest = source_hash(source, nvcc_flags())
        _loaded[key] = _compiled_library(source, f"{name}_cuda", digest, compile_cuda_library)
    return _loaded[key]
