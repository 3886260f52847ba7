"""Symmetric memory when a peer dies: waits end at their timeout naming it, nothing leaks.

A rank kills itself with `os._exit` in the middle of a synchronisation. The survivors'
waits must end within their timeout with an error that names the dead rank (SM-11),
and no shared-memory segment may be left behind, not even the dead rank's own (SM-12).
Each survivor writes what it saw to a file before re-raising, since the harness
re-raises only one rank's error.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from symm_mem_helpers import no_segment_left_behind, segment_pid  # noqa: F401

import refimpl.symmetric_memory as sm
from refimpl.multiprocess import RankError, run_on_ranks

TIMEOUT_MS = 1500


def _record(directory: str, what: str, start: float, exc: BaseException) -> None:
    report = {"rank": dist.get_rank(), "what": what, "type": type(exc).__name__,
              "message": str(exc), "peer": getattr(exc, "peer", None),
              "elapsed_s": time.monotonic() - start}
    with open(os.path.join(directory, f"{dist.get_rank()}-{what}.json"), "w") as f:
        json.dump(report, f)


def _survive(directory: str, what: str, fn, *args, **kwargs) -> None:
    start = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        _record(directory, what, start, exc)
        return
    raise AssertionError(f"{what} returned although a peer is dead")


def _reports(directory) -> dict[tuple[int, str], dict]:
    reports = {}
    for path in directory.iterdir():
        if path.suffix == ".json":
            report = json.loads(path.read_text())
            reports[report["rank"], report["what"]] = report
    return reports


def _check_names_dead_peer(report: dict, dead: int, timeout_ms: int = TIMEOUT_MS):
    assert report["type"] == "SymmMemTimeout", report
    assert report["peer"] == dead, report
    assert f"rank {dead} " in report["message"] or f"[{dead}]" in report["message"], report
    assert "[SM-11]" in report["message"]
    # It waited for its timeout, and not forever (the harness would have killed it).
    assert report["elapsed_s"] >= 0.9 * timeout_ms / 1000, report


def _rendezvous_then_kill(dead: int):
    """A symmetric buffer every rank has mapped and passed a barrier on; then `dead` exits."""
    group = dist.group.WORLD.group_name
    sm.enable_symm_mem_for_group(group)
    t = sm.empty(16, dtype=torch.float32)
    h = sm.rendezvous(t, group)
    h.barrier(timeout_ms=20_000)
    if dist.get_rank() == dead:
        os._exit(3)
    return group, t, h


def _die_during_barrier(directory: str, dead: int):
    _, _, h = _rendezvous_then_kill(dead)
    _survive(directory, "barrier", h.barrier, channel=1, timeout_ms=TIMEOUT_MS)
    raise RuntimeError("survivor done")  # the group is broken: end the task as failed


def test_peer_dying_during_barrier_is_named_by_every_survivor_SM_11(tmp_path):
    with pytest.raises(RankError):
        run_on_ranks(_die_during_barrier, 3, str(tmp_path), 1)
    reports = _reports(tmp_path)
    assert sorted(reports) == [(0, "barrier"), (2, "barrier")]
    for report in reports.values():
        _check_names_dead_peer(report, dead=1)
        assert "barrier: rank 1 of group" in report["message"]


# Two waits in a row: together well inside the harness's grace for survivors
# (refimpl.multiprocess.PEER_GRACE_S, 3 s), which kills them mid-report otherwise.
TWO_WAITS_MS = 1000


def _die_during_wait_and_all_reduce(directory: str, dead: int):
    group, t, h = _rendezvous_then_kill(dead)
    _survive(directory, "wait_signal", h.wait_signal, dead, channel=2,
             timeout_ms=TWO_WAITS_MS)
    previous = sm.set_default_timeout(TWO_WAITS_MS)  # the ops take the module's timeout
    try:
        _survive(directory, "one_shot", torch.ops.refimpl_symm_mem.one_shot_all_reduce, t,
                 "sum", group)
    finally:
        sm.set_default_timeout(previous)
    raise RuntimeError("survivor done")


def test_peer_dying_during_wait_signal_and_all_reduce_is_named_SM_11(tmp_path):
    with pytest.raises(RankError):
        run_on_ranks(_die_during_wait_and_all_reduce, 2, str(tmp_path), 1)
    reports = _reports(tmp_path)
    assert sorted(reports) == [(0, "one_shot"), (0, "wait_signal")]
    for report in reports.values():
        _check_names_dead_peer(report, dead=1, timeout_ms=TWO_WAITS_MS)
    assert "wait_signal: rank 1 of group" in reports[0, "wait_signal"]["message"]
    assert "one_shot_all_reduce: rank 1 of group" in reports[0, "one_shot"]["message"]


def _die_inside_rendezvous(directory: str, dead: int):
    group = dist.group.WORLD.group_name
    sm.enable_symm_mem_for_group(group)
    t = sm.empty(16, dtype=torch.float32)
    if dist.get_rank() == dead:
        with open(os.path.join(directory, "dead.pid"), "w") as f:
            f.write(str(os.getpid()))

        def die(*args):  # runs after this rank published its segment, before unlinking it
            os._exit(3)

        sm.check_sizes = die  # CpuAllocator.rendezvous calls it by its module name
    _survive(directory, "rendezvous", sm.rendezvous, t, group, timeout_ms=TIMEOUT_MS)
    raise RuntimeError("survivor done")


def test_peer_dying_inside_rendezvous_leaves_no_segment_SM_11_SM_12(tmp_path):
    with pytest.raises(RankError):
        run_on_ranks(_die_inside_rendezvous, 4, str(tmp_path), 2)
    reports = _reports(tmp_path)
    assert sorted(reports) == [(0, "rendezvous"), (1, "rendezvous"), (3, "rendezvous")]
    for report in reports.values():
        _check_names_dead_peer(report, dead=2)
        assert re.search(r"rendezvous on group '[^']+': rank\(s\) \[2\] did not arrive",
                         report["message"]), report
    dead_pid = int((tmp_path / "dead.pid").read_text())
    assert [n for n in sm.leaked_segments() if segment_pid(n) == dead_pid] == [], (
        "the survivors unlink the segment the dead rank published [SM-12]")
