"""A short CUDA symmetric-memory workload for compute-sanitizer (tests/gpu/run_on_device.sh).

Two ranks (processes on the GPU), every dtype and reduce op, one-shot (both forms) and
two-shot on sizes around the vector width, checked against the CPU kernels; then signals and
a barrier. Exits 0 when every result is right. Run by run_on_device.sh under
`compute-sanitizer --tool memcheck --target-processes all`: its error count is what matters.
"""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE), HERE]

import test_symm_mem_cuda as t  # noqa: E402

from refimpl.multiprocess import run_on_ranks  # noqa: E402


def main() -> int:
    seed, numels = 11, [1, 9, 4099]
    per_rank = run_on_ranks(t._all_reduces, 2, numels, seed, timeout=900)
    for case in range(len(per_rank[0])):
        name, op, numel = per_rank[0][case][:3]
        dtype = getattr(torch, name.split(".")[1])
        inputs = [t._rank_data(r, dtype, numel, seed) for r in range(2)]
        for rank in range(2):
            one, out, two = per_rank[rank][case][3:6]
            t._check_all_reduce(one, inputs, op, f"{name} {op} {numel} rank {rank}")
            t._check_all_reduce(out, [x.flip(0) for x in inputs], op, "out=")
            t._check_all_reduce(two, inputs, op, "two-shot")
    run_on_ranks(t._barriers, 2, 3, timeout=900)
    print(f"smoke: {len(per_rank[0])} all-reduce cases on 2 ranks, signals and barriers: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
