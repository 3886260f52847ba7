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
GPU); results come back on the CPU. Under torchrun (refimpl/launched.py) the launched
processes are the ranks and no worker is spawned.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import time
import traceback

__all__ = ["RankError", "RankTimeout", "run_on_ranks", "shutdown", "shutdown_all",
           "MAX_WORKER_PROCESSES"]

# How many worker processes (ranks) one call may start on this machine.
MAX_WORKER_PROCESSES = 8
# Environment variables that follow every task into the workers.
FORWARDED_ENV_PREFIX = "REFIMPL_"
DEFAULT_TIMEOUT_S = 120.0
# After one rank fails, its peers are usually blocked in a collective that will never
# complete; give them this long to report their own errors before the group is killed.
PEER_GRACE_S = 3.0
# The process group's own timeout: a collective that never completes raises after this.
PG_TIMEOUT_S = 60.0


class RankError(RuntimeError):
    """A rank raised; `rank` and `remote_traceback` say where and how."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str):
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        super().__init__(
            f"rank {rank} raised {exc_type}: {message}\n"
            f"--- traceback on rank {rank} ---\n{remote_traceback}"
        )


class RankTimeout(RuntimeError):
    """Ranks did not answer in time; `ranks` lists the ones that hung."""

    def __init__(self, ranks: list[int], timeout_s: float, world_size: int):
        self.ranks = ranks
        super().__init__(
            f"rank(s) {ranks} of world size {world_size} did not finish within "
            f"{timeout_s:.0f} s and were killed"
        )


def _worker_main(rank, world_size, store_address, prefix, sys_path, conn, setting):
    """Body of one rank: join the process group, then run tasks until told to stop.

    `store_address`: (host, port) of the TCPStore the group meets at; `setting`: (process
    group, device, local rank)."""
    sys.path[:] = sys_path
    host, port = store_address
    if host == "127.0.0.1":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from refimpl import launched

    torch.set_num_threads(1)
    process_group, device, local_rank = setting
    name = launched.resolve_process_group(process_group)  # registers a module:attr one
    device = launched.local_device(device, local_rank)
    if device.type != "cpu":
        getattr(torch, device.type).set_device(device)
    store = dist.TCPStore(host, port, is_master=False,
                          timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    dist.init_process_group(
        name, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    while True:
        task = conn.recv_bytes()
        if not task:
            break
        conn.send_bytes(_run_task(task, device))
    dist.destroy_process_group()


def _run_task(task: bytes, device) -> bytes:
    from refimpl import launched

    try:
        env, fn, args, kwargs = pickle.loads(task)
        _apply_env(env)
        with launched.on_device(device):
            result = fn(*args, **kwargs)
        return pickle.dumps(("ok", launched.to_cpu(result)))
    except BaseException as exc:  # report everything, the caller decides
        return pickle.dumps(("err", type(exc).__name__, str(exc), traceback.format_exc()))


def _setting() -> tuple[str, str]:
    """(process group, device) the workers are started with: the caller's choice now."""
    return (os.environ.get("REFIMPL_PROCESS_GROUP") or "gloo",
            os.environ.get("REFIMPL_DEVICE") or "cpu")


def _forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIX)}


def _apply_env(env: dict[str, str]) -> None:
    """The caller's REFIMPL_* variables, exactly: set those it has, drop the others."""
    for key in [k for k in os.environ if k.startswith(FORWARDED_ENV_PREFIX)]:
        if key not in env:
            del os.environ[key]
    os.environ.update(env)


class _WorkerGroup:
    """`world_size` live worker processes sharing one gloo default group."""

    _generation = 0

    def __init__(self, world_size: int):
        import torch.distributed as dist

        from refimpl import launched

        _WorkerGroup._generation += 1
        self.world_size = world_size
        self.setting = _setting()
        # A bad choice is refused here, once, naming the option (not by every worker).
        launched.check_device(self.setting[1],
                              launched.resolve_process_group(self.setting[0]))
        self.store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                                   wait_for_workers=False)
        prefix = f"refimpl-harness-{os.getpid()}-{_WorkerGroup._generation}"
        ctx = _context()
        self.conns, self.procs = [], []
        with _main_without_fake_file():
            self._start_workers(ctx, prefix)

    def _start_workers(self, ctx, prefix: str) -> None:
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
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
        task = pickle.dumps((_forwarded_env(), fn, args, kwargs))
        for conn in self.conns:
            conn.send_bytes(task)
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
                replies[rank] = self._receive(rank, conn)
                if replies[rank][0] == "err":
                    deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
        return replies

    def _receive(self, rank: int, conn) -> tuple:
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self.procs[rank].join(1.0)
            code = self.procs[rank].exitcode
            return ("err", "ProcessDied", f"rank {rank} exited with code {code}", "")

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


_context_cache = None


def _main_is_a_file() -> bool:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return path is not None and os.path.isfile(path)


@contextlib.contextmanager
def _main_without_fake_file():
    """Workers re-import the caller's main module from its `__file__`; under `python -`
    that is '<stdin>', which does not exist and kills every worker at start."""
    main = sys.modules.get("__main__")
    fake = getattr(main, "__file__", None) is not None and not _main_is_a_file()
    saved = main.__file__ if fake else None
    if fake:
        del main.__file__
    try:
        yield
    finally:
        if fake:
            main.__file__ = saved


def _check_importable(fn) -> None:
    """Workers find `fn` by module and name: refuse at once what they cannot import."""
    qualname = getattr(fn, "__qualname__", "")
    where = None
    if getattr(fn, "__module__", None) == "__main__" and not _main_is_a_file():
        where = "in a main module that is not a file (<stdin>, -c or the REPL)"
    elif "<locals>" in qualname or "<lambda>" in qualname:
        where = "inside a function or as a lambda"
    if where:
        raise ValueError(
            f"fn: {qualname or fn!r} is defined {where}, so the worker processes cannot "
            f"import it; define it at module level in a module file (run_on_ranks sends "
            f"functions by module and name)")


def _context():
    """A forkserver context with torch preloaded: fast, and safe to start from threads."""
    global _context_cache
    if _context_cache is None:
        _context_cache = multiprocessing.get_context("forkserver")
        _context_cache.set_forkserver_preload(["torch", "torch.distributed"])
    return _context_cache


_groups: dict[int, _WorkerGroup] = {}


def run_on_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
    """Call `fn(*args, **kwargs)` on ranks 0..world_size-1; return their results in order.

    Raises `RankError` for the lowest rank that raised, `RankTimeout` naming the ranks
    that did not answer within `timeout` seconds (they are killed).
    """
    from refimpl import launched

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
    from refimpl import launched

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
