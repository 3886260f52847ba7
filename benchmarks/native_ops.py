"""Refuse to time refimpl's symmetric-memory ops unless their C++ kernels are loaded.

A failed build of `kernels/cpu/symm_mem_ops.cpp` only warns (SM-18) and the ops then run
their Python kernels: every refimpl row of a benchmark would be slower without saying so.
Shared by `benchmarks/symm_mem.py` and `benchmarks/comm_lowering.py`.
"""

from __future__ import annotations

import sys


def require_native_ops(script: str) -> None:
    import refimpl.symmetric_memory as symm

    if symm.load_kernels()["ops"] != "native":
        sys.exit(f"{script}: refimpl's C++ op kernels are not loaded (see the warning "
                 "above); the ops would run their Python kernels")
