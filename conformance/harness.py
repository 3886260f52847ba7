"""Helpers for conformance cases: run a rank function against the selected backend.

A case's rank function receives the backend's spec string first and rebuilds the
backend in the worker with `backend_in_rank(spec)`; everything else is the
multi-process harness of refimpl (real processes, gloo, a real store). Cases run with
refimpl's cross-rank consistency check on (`REFIMPL_CHECK_COLLECTIVES=1`, FC-28), unless
the caller set that variable otherwise, and a peer that never comes is reported after
10 s (`REFIMPL_CHECK_TIMEOUT_S`); other backends ignore both.
"""

from __future__ import annotations

import os

from conformance.backends import NotImplementedConcept, get_backend
from refimpl._rank_process import chosen_device  # this run's --device (CF-13)
from refimpl.multiprocess import RankError, run_on_ranks, shutdown

__all__ = ["run", "backend_in_rank", "fresh_ranks", "NotImplementedConcept", "chosen_device",
           "needs_the_cpu"]

# run_on_ranks forwards REFIMPL_* variables to every rank with each task. Peers of a
# case reach each collective within milliseconds; 10 s bounds a wait for one that never
# comes (default 30 s).
os.environ.setdefault("REFIMPL_CHECK_COLLECTIVES", "1")
os.environ.setdefault("REFIMPL_CHECK_TIMEOUT_S", "10")


# World sizes the current case ran on (read by the report).
WORLD_SIZES_USED: set[int] = set()


def backend_in_rank(spec: str):
    return get_backend(spec)


def run(backend, fn, world_size: int, *args, restart_after: bool = False,
        tensors_on_the_cpu: bool = False, **kwargs) -> list:
    """`fn(backend.spec, *args)` on every rank; a rank's NotImplementedConcept is re-raised.

    `restart_after`: the case leaves its ranks out of step on purpose (a rank that skipped
    a collective, a group that failed), so the next case starts on fresh processes.
    `tensors_on_the_cpu`: a tensor `fn` makes without naming a device is on the CPU, whatever
    this run's --device (for cases that name the device of every tensor under test, as
    the SM cases do with their backend's device, and keep their references on the CPU)."""
    WORLD_SIZES_USED.add(world_size)
    if tensors_on_the_cpu:
        fn, args = _on_the_cpu, (fn, *args)
    try:
        return run_on_ranks(fn, world_size, backend.spec, *args, **kwargs)
    except RankError as err:
        if err.exc_type == "NotImplementedConcept":
            raise NotImplementedConcept(err.message) from None
        raise
    finally:
        if restart_after:
            fresh_ranks(world_size)


def symmetric_memory_device(sm, rank: int = 0):
    """The device a backend's symmetric memory allocates on for `rank`: its
    `device_for_rank`, else its `DEVICE` (cpu when it declares neither)."""
    import torch

    if hasattr(sm, "device_for_rank"):
        return sm.device_for_rank(rank)
    return torch.device(getattr(sm, "DEVICE", "cpu"))


def _on_the_cpu(spec, fn, *args, **kwargs):
    import torch

    with torch.device("cpu"):
        return fn(spec, *args, **kwargs)


def needs_the_cpu(what: str) -> None:
    """Skip the calling case, naming the CPU-only feature it needs (`what`), when this run
    makes its tensors on another device (CF-13)."""
    import pytest
    import torch

    device = chosen_device()
    if torch.device(device).type != "cpu":
        pytest.skip(f"needs the CPU: {what}; this run's --device is {device}")


def fresh_ranks(world_size: int) -> None:
    """Stop the ranks of this world size, so the next `run` starts new processes: for a
    case whose setting (a REFIMPL_* variable) is read once, when a module is imported."""
    shutdown(world_size)
