"""Shared pieces of the symmetric-memory tests: the /dev/shm leak check and references.

A segment counts as leaked (SM-12) when it is still present after a test and its creator
(the pid in its name) is one of this session's worker processes, before or after the
test: every rendezvous of the test has finished by then, so nothing of the test may be
left. Segments of other processes (another test run, another user, a run killed long
ago) are never judged: they are not this test's, and a busy machine must not fail it.
"""

from __future__ import annotations

import gc

import pytest
import torch

import refimpl.multiprocess as mp
import refimpl.symmetric_memory as sm


def worker_pids() -> set[int]:
    return {p.pid for group in mp._groups.values() for p in group.procs}


def segment_pid(name: str) -> int:
    return int(name[len(sm.SEGMENT_PREFIX):].split("-")[0])


def leaked(pids: set[int]) -> list[str]:
    """Segments whose creator is one of `pids`."""
    found = []
    for name in sm.leaked_segments():
        try:
            if segment_pid(name) in pids:
                found.append(name)
        except ValueError:  # not a name refimpl made
            continue
    return found


def rank_data(rank: int, dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    """Rank `rank`'s input, the same on every process that asks for it."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g) * 4).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)


def reference_all_reduce(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The specified result (SM-15): rank order, 16-bit floats accumulated in float32."""
    dtype = inputs[0].dtype
    wide = dtype in (torch.float16, torch.bfloat16)
    acc = inputs[0].float() if wide else inputs[0].clone()
    for x in inputs[1:]:
        x = x.float() if wide else x
        if op in ("sum", "avg"):
            acc = acc + x
        elif op == "max":
            acc = torch.maximum(acc, x)
        else:
            acc = torch.minimum(acc, x)
    if op == "avg":
        acc = acc / len(inputs)
    return acc.to(dtype)


@pytest.fixture(autouse=True)
def no_segment_left_behind():
    """Autouse in every module that imports it: no /dev/shm segment outlives a test (SM-12)."""
    before = worker_pids()
    yield
    gc.collect()
    assert leaked(before | worker_pids()) == [], "segments left in /dev/shm [SM-12]"
