"""Run one Python function on N ranks: real processes over gloo with a real c10d store.

This is the multi-process harness that the tests and the conformance suite stand on.
`run_on_ranks(fn, world_size, *args)` calls `fn(*args)` once on every rank of a group
of worker processes whose default process group is gloo over a TCPStore on loopback,
and returns the list of results in rank order. The first rank to raise is re-raised in
the caller as `RankError` with its rank and remote traceback; a rank that does not
answer within the timeout is killed and reported as `RankTimeout`, naming it.

Worker groups are started once per world size and reused, since starting a process
that imports torch costs seconds on a small machine. A group whose ranks failed or hung
is torn down, and the next call starts a fresh one. Functions and arguments travel by
pickle, so `fn` must be importable by the workers: defined at module level in a module
file, not in `<stdin>`, `-c` or the REPL (refused at once, saying so). Environment
variables named `REFIMPL_*` travel with every task, so a switch such as
`REFIMPL_CHECK_COLLECTIVES=1` set in the caller holds on every rank (FC-28).

The process group backend is `$REFIMPL_PROCESS_GROUP` (default gloo; a name
`torch.distributed` knows, or `module:attr` of a function that registers one) and the
tensors a rank makes land on `$REFIMPL_DEVICE` (default cpu; `cuda` is each rank's own
GPU); results come back on the CPU. Under torchrun (refimpl/launched.py) ranks 0..n-1
of the launched world each start the worker of their rank, which meet through the
launched store. A worker's body and errors are refimpl/_rank_process.py's.
"""

from __future__ import annotations

import atexit
import multiprocessing.connection
import os
import pickle
import sys
import time

from refimpl import launched
from refimpl._rank_process import (
    PEER_GRACE_S,
    PG_TIMEOUT_S,
    RankError,
    RankTimeout,
    check_device,
    chosen_device,
    chosen_process_group,
    context,
    forwarded_env,
    hand_over,
    main_is_a_file,
    main_without_fake_file,
    receive_reply,
    resolve_process_group,
    worker_main,
)

__all__ = ["RankError", "RankTimeout", "run_on_ranks", "shutdown", "shutdown_all",
           "MAX_WORKER_PROCESSES", "PEER_GRACE_S", "PG_TIMEOUT_S"]

# How many worker processes (ranks) one call may start on this machine.
MAX_WORKER_PROCESSES = 8
DEFAULT_TIMEOUT_S = 120.0
# (PEER_GRACE_S and PG_TIMEOUT_S, from _rank_process: how long peers of a failed rank
# get to report, and the process group's own timeout.)


def _setting() -> tuple[str, str]:
    """(process group, device) the workers are started with: the caller's choice now."""
    return chosen_process_group(), chosen_device()


class _WorkerGroup:
    """`world_size` live worker processes sharing one default group."""

    _generation = 0

    def __init__(self, world_size: int):
        import torch.distributed as dist

        _WorkerGroup._generation += 1
        self.world_size = world_size
        self.setting = _setting()
        # A bad choice is refused here, once, naming the option (not by every worker).
        check_device(self.setting[1], resolve_process_group(self.setting[0]))
        self.store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                                   wait_for_workers=False)
        prefix = f"refimpl-harness-{os.getpid()}-{_WorkerGroup._generation}"
        ctx = context()
        self.conns, self.procs = [], []
        with main_without_fake_file():
            self._start_workers(ctx, prefix)

    def _start_workers(self, ctx, prefix: str) -> None:
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(rank, self.world_size, ("127.0.0.1", self.store.port), prefix,
                      list(sys.path), child_end, (*self.setting, rank)),
                daemon=True, name=f"refimpl-rank{rank}",
            )
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, args, kwargs, timeout_s: float) -> list:
        task = pickle.dumps((forwarded_env(), fn, args, kwargs))
        for conn in self.conns:
            hand_over(conn, task)
        replies = self._collect(timeout_s)
        errors = [(r, rep) for r, rep in replies.items() if rep[0] == "err"]
        if errors:
            rank, (_, exc_type, message, tb) = min(errors)
            raise RankError(rank, exc_type, message, tb)
        missing = [r for r in range(self.world_size) if r not in replies]
        if missing:
            raise RankTimeout(missing, timeout_s, self.world_size)
        return [replies[r][1] for r in range(self.world_size)]

    def _collect(self, timeout_s: float) -> dict:
        """Gather one reply per rank; stop early once a rank failed and peers stall."""
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        pending = dict(enumerate(self.conns))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = multiprocessing.connection.wait(list(pending.values()), remaining)
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                del pending[rank]
                replies[rank] = receive_reply(conn, rank, self.procs[rank])
                if replies[rank][0] == "err":
                    deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
        return replies

    def shutdown(self, graceful: bool = True):
        if graceful and self.alive():
            for conn in self.conns:
                try:
                    conn.send_bytes(b"")
                except OSError:
                    pass
            for proc in self.procs:
                proc.join(5.0)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self.conns:
            conn.close()


def _check_importable(fn) -> None:
    """Workers find `fn` by module and name: refuse at once what they cannot import."""
    qualname = getattr(fn, "__qualname__", "")
    where = None
    if getattr(fn, "__module__", None) == "__main__" and not main_is_a_file():
        where = "in a main module that is not a file (<stdin>, -c or the REPL)"
    elif "<locals>" in qualname or "<lambda>" in qualname:
        where = "inside a function or as a lambda"
    if where:
        raise ValueError(
            f"fn: {qualname or fn!r} is defined {where}, so the worker processes cannot "
            f"import it; define it at module level in a module file (run_on_ranks sends "
            f"functions by module and name)")


_groups: dict[int, _WorkerGroup] = {}


def run_on_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
    """Call `fn(*args, **kwargs)` on ranks 0..world_size-1; return their results in order.

    Raises `RankError` for the lowest rank that raised, `RankTimeout` naming the ranks
    that did not answer within `timeout` seconds (they are killed).
    """
    world = launched.current()
    if world is not None:  # the ranks torchrun started (refimpl/launched.py)
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        return world.run(fn, world_size, args, kwargs, timeout)
    if not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORKER_PROCESSES:
        raise ValueError(f"world_size must be an int in 1..{MAX_WORKER_PROCESSES}, got "
                         f"{world_size!r}")
    _check_importable(fn)
    group = _groups.get(world_size)
    if group is not None and group.setting != _setting():  # started for another choice
        shutdown(world_size)
        group = None
    if group is None or not group.alive():
        if group is not None:
            group.shutdown(graceful=False)
        group = _groups[world_size] = _WorkerGroup(world_size)
    try:
        return group.run(fn, args, kwargs, timeout)
    except (RankError, RankTimeout):
        # A failed collective can leave the group's ranks out of step: start afresh.
        del _groups[world_size]
        group.shutdown(graceful=False)
        raise


def shutdown(world_size: int) -> None:
    """Stop the worker group of this size, if any; the next call starts a fresh one (for
    callers that left its ranks out of step on purpose). In a launched world every rank
    calls it alike and stops its own worker of that size."""
    world = launched.current()
    if world is not None:
        world.restart(world_size)
        return
    group = _groups.pop(world_size, None)
    if group is not None:
        group.shutdown(graceful=False)


def shutdown_all():
    """Stop every worker group (called at exit)."""
    for world_size in list(_groups):
        _groups.pop(world_size).shutdown()


atexit.register(shutdown_all)
