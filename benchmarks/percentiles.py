"""p50 / p90 of a collective step on every rank of a torch.distributed group.

Shared by `benchmarks/symm_mem.py` and `benchmarks/deepspeed_peer.py` (which runs in
DeepSpeed's own virtual environment, so this module needs nothing but torch).
"""

from __future__ import annotations

import time

import torch.distributed as dist

WARM_UP_S = 0.05


def percentiles_us(step, n: int) -> tuple[float, float]:
    """Median and 90th percentile of `n` calls of `step` (microseconds).

    Warms up for about WARM_UP_S, the same number of steps on every rank (rank 0 picks
    it): after a gloo barrier the scheduler often wakes both ranks on one core and takes
    milliseconds to move one away; ranks on their own cores, as in a running program,
    are what is measured."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(20):
        step()
    per_step = (time.perf_counter() - start) / 20
    count = [max(n // 10, int(WARM_UP_S / per_step))]
    dist.broadcast_object_list(count, src=0)
    for _ in range(count[0]):
        step()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.9)] * 1e6
