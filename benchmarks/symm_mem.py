"""Shared-memory all-reduce (one-shot, two-shot) against gloo's all_reduce, same ranks, one run.

For 2 and 4 ranks and float32 tensors of 1 KiB to 4 MiB, every rank times each
operation on its own; the table shows rank 0's median latency per op and the ratio
gloo / symmetric memory (higher is better for refimpl). The target (DESIGN.md) is one-shot
at least 50x faster than gloo up to 64 KiB on 2 ranks; with more ranks than cores the
kernels' waits back off, and one-shot must still beat gloo.

    python benchmarks/symm_mem.py [--worlds 2 4] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import refimpl.symmetric_memory as sm  # noqa: E402
from refimpl.multiprocess import run_on_ranks  # noqa: E402

SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]


def _median_us(step, iterations: int) -> float:
    for _ in range(max(3, iterations // 10)):  # warm up
        step()
    dist.barrier()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _bench_rank(sizes: list[int], quick: bool) -> list[tuple[int, float, float, float]]:
    group = dist.group.WORLD.group_name
    sm.enable_symm_mem_for_group(group)
    rows = []
    for nbytes in sizes:
        numel = nbytes // 4
        iterations = (50 if quick else 300) if nbytes <= 64 << 10 else (10 if quick else 40)
        plain = torch.zeros(numel)
        gloo = _median_us(lambda: dist.all_reduce(plain), iterations)
        buf = sm.empty(numel, dtype=torch.float32)
        buf.zero_()  # sums of zeros stay zero, however often two-shot reduces in place
        sm.rendezvous(buf, group)
        one_shot = _median_us(lambda: sm.ops.one_shot_all_reduce(buf, "sum", group), iterations)
        two_shot = _median_us(lambda: sm.ops.two_shot_all_reduce_(buf, "sum", group), iterations)
        rows.append((nbytes, gloo, one_shot, two_shot))
    return rows


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    args = parser.parse_args()
    print(f"# symmetric-memory all-reduce vs gloo: {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}\n")
    print("| ranks | size | gloo all_reduce (us) | one-shot (us) | gloo / one-shot "
          "| two-shot (us) | gloo / two-shot |")
    print("|---|---|---|---|---|---|---|")
    for world in args.worlds:
        rows = run_on_ranks(_bench_rank, world, SIZES, args.quick, timeout=600)[0]
        for nbytes, gloo, one, two in rows:
            print(f"| {world} | {_size(nbytes)} | {gloo:.1f} | {one:.1f} | {gloo / one:.1f}x "
                  f"| {two:.1f} | {gloo / two:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
