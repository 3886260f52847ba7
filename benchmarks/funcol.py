"""Eager overhead of a functional all_reduce + wait: refimpl against upstream, one run.

Runs on the fake process group (no communication), so what is timed is each library's
own Python and dispatch overhead: refimpl's `all_reduce(...).wait()`, upstream's
`torch.distributed._functional_collectives.all_reduce(...).wait()`, and a raw
`torch.distributed.all_reduce`. Prints microseconds per op and the ratios.

    python benchmarks/funcol.py [--iters 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def best_us(fn, iters: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    import torch.distributed._functional_collectives as upstream

    import refimpl.functional_collectives as refimpl

    x = torch.ones(16)
    group = dist.group.WORLD
    timings = {
        "raw dist.all_reduce": lambda: dist.all_reduce(x, group=group),
        "upstream all_reduce+wait": lambda: upstream.all_reduce(x, "sum", group).wait(),
        "refimpl all_reduce+wait": lambda: refimpl.all_reduce(x, "sum", group).wait(),
    }
    results = {name: best_us(fn, args.iters, args.repeats) for name, fn in timings.items()}
    print("# eager functional all_reduce + wait, fake process group of 8, 16 floats")
    print(f"# torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
          f"best of {args.repeats} x {args.iters}")
    for name, us in results.items():
        print(f"{name:28s} {us:8.1f} us")
    up, ours = results["upstream all_reduce+wait"], results["refimpl all_reduce+wait"]
    print(f"refimpl / upstream         {ours / up:8.2f}x  (target <= 1.00)")
    print(f"refimpl / raw              {ours / results['raw dist.all_reduce']:8.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
