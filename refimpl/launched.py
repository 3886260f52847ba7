"""Launched worlds: `run_on_ranks` on the processes torchrun started (SPEC CF-13).

refimpl's harness (refimpl/multiprocess.py) spawns its own worker processes on one
machine. A world started by `torchrun` (or any launcher that sets the `env://` variables
and `REFIMPL_LAUNCHED=1`) is used as it is instead: its machines, its devices and the
process group a vendor runs in production.

Every process of the world makes the same calls `run_on_ranks(fn, n, ...)` in the same
order (SPMD: the conformance suite runs the same cases on every rank). Ranks 0..n-1 each
hand `fn` to a worker process of their own for the world of n ranks, which the harness
would have spawned itself: it joins its n peers in a default process group on the chosen
backend (gloo, nccl, a name a user registered) through the launched world's store, on
this rank's device (`cuda`: the rank's local GPU), and is kept for the next call of that
size. The other ranks wait. Every rank posts its worker's reply to the store and reads
the others', so every rank returns the same list, or raises the same `RankError` for the
lowest rank that raised, or the same `RankTimeout` naming the ranks whose workers did not
answer; results come back as CPU tensors. As in the harness, a failed call restarts the
workers of its size, and `shutdown(n)` gives the next call fresh ones: a rank that
exits on purpose, a group left out of step, behave as they do on one machine. Each call
checks that every rank runs the same function on the same n: ranks started with different
options get an error naming the ranks, not a hang. The launched process itself joins no
process group (it stays free to trace with a fake one).

What a launched world cannot give raises `NotOnThisWorld` with the reason, before `fn`
runs anywhere: more ranks than the world has, or a world lost earlier (a launched process
that stopped answering). The conformance suite reports such a case `skipped`.

Implements SPEC.md CF-13 (section 7), for `run_on_ranks` and the runner alike.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import pickle
import sys
import time

from refimpl._rank_process import (
    PEER_GRACE_S,
    RankError,
    RankTimeout,
    check_device,
    chosen_device,
    chosen_process_group,
    context,
    forwarded_env,
    hand_over,
    local_device,
    main_without_fake_file,
    receive_reply,
    resolve_process_group,
    worker_main,
)

__all__ = ["LaunchedWorld", "NotOnThisWorld", "MismatchedRanks", "launched_by_env",
           "attach", "current", "joined", "resolve_process_group", "check_device"]

# How long a rank waits for its peers to reach the start of the run (options compared)
# and its end (rank 0's report written).
AGREE_TIMEOUT_S = 120.0
KEY_PREFIX = "refimpl-launched"


class NotOnThisWorld(RuntimeError):
    """What the launched world cannot run (the suite reports the case skipped).
    `needs_ranks`: the ranks the call asked for, when the world is too small for it."""

    def __init__(self, reason: str, needs_ranks: int | None = None):
        super().__init__(reason)
        self.needs_ranks = needs_ranks


class MismatchedRanks(ValueError):
    """The ranks of a launched world were started with different options, or stopped
    making the same calls in the same order."""


def launched_by_env() -> bool:
    """Whether this process is a rank of a world a launcher started: torchrun's
    variables, or `REFIMPL_LAUNCHED=1` with the env:// ones (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT). `REFIMPL_LAUNCHED=0` keeps refimpl's own workers."""
    flag = os.environ.get("REFIMPL_LAUNCHED")
    if flag == "0":
        return False
    if flag != "1" and "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise RuntimeError(f"a launched world needs the env:// variables; {missing} "
                           f"are not set [CF-13]")
    return True


# --------------------------------------------------------------------------------------
# The world
# --------------------------------------------------------------------------------------
class _LocalWorker:
    """This rank's worker process in the world of n ranks: refimpl's own worker
    (`_rank_process.worker_main`), joined to its n peers through the launched store."""

    def __init__(self, world: LaunchedWorld, n: int, generation: int):
        ctx = context()
        self.conn, child = ctx.Pipe()
        self.rank = world.rank
        self.proc = ctx.Process(
            target=worker_main,
            args=(world.rank, n, world.store_address, f"{KEY_PREFIX}/world-{n}-{generation}",
                  list(sys.path), child, (world.process_group_spec, world.device_spec,
                                          world.local_rank)),
            daemon=True, name=f"refimpl-rank{world.rank}-of-{n}")
        with main_without_fake_file():
            self.proc.start()
        child.close()

    def reply(self, wait_s: float) -> tuple | None:
        """The worker's reply, None when it has none within `wait_s` seconds."""
        if not self.conn.poll(wait_s):
            return None
        return receive_reply(self.conn, self.rank, self.proc)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        self.conn.close()


class LaunchedWorld:
    """The launched processes and their store; per world size n, one worker process on
    each of ranks 0..n-1, started on first use and kept (refimpl's harness keeps one group
    of workers per world size the same way)."""

    def __init__(self):
        import torch.distributed as dist

        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        timeout = datetime.timedelta(seconds=AGREE_TIMEOUT_S)
        # The store env:// names (torchrun's agent hosts it, or rank 0 does); the workers
        # meet there too, as clients.
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        self.store_address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        self.store = dist.PrefixStore(KEY_PREFIX, store)
        self.store.set_timeout(timeout)
        self.calls = 0
        self.workers: dict[int, _LocalWorker] = {}
        self.generations: dict[int, int] = {}  # world size -> groups started (alike on all)
        self.lost: str | None = None  # why the world can run nothing more

    def choose(self, process_group: str, device: str) -> None:
        """The process group and device of every worker, checked here first (a bad one
        raises ValueError naming the option)."""
        self.process_group_spec, self.device_spec = process_group, device
        self.process_group = resolve_process_group(process_group)
        check_device(device, self.process_group)
        self.device = local_device(device, self.local_rank)

    # ---- exchanges through the store --------------------------------------------------
    def _gather(self, tag: str, payload: bytes, timeout_s: float) -> list[bytes | None]:
        """Post `payload` as this rank's under `tag`; every rank's, None for a rank that
        did not post within `timeout_s`."""
        self.store.set(f"{tag}/{self.rank}", payload)
        deadline = time.monotonic() + timeout_s
        got: list[bytes | None] = [None] * self.world_size
        for r in range(self.world_size):
            key = f"{tag}/{r}"
            left = deadline - time.monotonic()
            try:
                self.store.wait([key], datetime.timedelta(seconds=max(left, 0.001)))
            except Exception:  # a store timeout: named by the caller, with every late rank
                continue
            got[r] = self.store.get(key)
        return got

    def agree(self, options: dict) -> None:
        """Raise `MismatchedRanks` on every rank, naming the option and the ranks, unless
        every rank was started with the same `options` (JSON values)."""
        mine = json.dumps(options, sort_keys=True, default=str).encode()
        self.calls += 1
        posted = self._gather(f"agree/{self.calls}", mine, AGREE_TIMEOUT_S)
        late = [r for r, p in enumerate(posted) if p is None]
        if late:
            self.lost = f"rank(s) {late} never reached the start of the run"
            raise MismatchedRanks(f"launched world: rank(s) {late} of {self.world_size} "
                                  f"did not start the run within {AGREE_TIMEOUT_S:.0f} s "
                                  f"[CF-13]")
        theirs = [json.loads(p) for p in posted]
        for key in sorted(set().union(*theirs)):
            values = [t.get(key) for t in theirs]
            if any(v != values[0] for v in values):
                ranks = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
                raise MismatchedRanks(f"{key}: every rank of a launched world must be "
                                      f"started with the same value; got {ranks} [CF-13]")

    def finish(self) -> None:
        """Wait until every rank got here (its work done, its report written)."""
        self.calls += 1
        self._gather(f"finish/{self.calls}", b"1", AGREE_TIMEOUT_S)

    # ---- one call ---------------------------------------------------------------------
    def run(self, fn, n: int, args, kwargs, timeout_s: float) -> list:
        if self.lost:
            raise NotOnThisWorld(f"the launched world was lost earlier: {self.lost}")
        if n > self.world_size:
            raise NotOnThisWorld(f"needs {n} ranks; the launched world has "
                                 f"{self.world_size}", needs_ranks=n)
        self.calls += 1
        tag = f"call/{self.calls}"
        self._forget(self.calls - 2)  # every rank has read those: it posted a later one
        label = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        # Every rank hands its task over at once, as the harness sends all of its own: a
        # case whose peers must meet within a second is not judged on how far apart the
        # ranks' own processes ran before the call.
        started = self._gather(f"{tag}/start", b"", timeout_s)
        late = [r for r, p in enumerate(started) if p is None]
        if late:
            self.lost = f"rank(s) {late} did not reach {label}"
            raise RankTimeout(late, timeout_s, self.world_size)
        reply = self._run_locally(fn, n, args, kwargs, timeout_s, tag) if self.rank < n \
            else ("idle",)
        # Every rank's own wait is bounded by timeout_s; a rank later than that is lost.
        posted = self._gather(tag, pickle.dumps((label, n, reply)), timeout_s + 30.0)
        late = [r for r, p in enumerate(posted) if p is None]
        if late:
            self.lost = f"rank(s) {late} did not answer {label}"
            raise RankTimeout(late, timeout_s, self.world_size)
        replies = [pickle.loads(p) for p in posted]
        for r, (their_label, their_n, _) in enumerate(replies):
            if (their_label, their_n) != (label, n):
                self.lost = "its ranks stopped making the same calls"
                raise MismatchedRanks(
                    f"launched world: rank {r} ran {their_label} on {their_n} ranks where "
                    f"rank {self.rank} ran {label} on {n}: the ranks do not run the same "
                    f"cases in the same order (start every rank with the same options) "
                    f"[CF-13]")
        hung = [r for r, (_, _, rep) in enumerate(replies) if rep[0] == "timeout"]
        errors = [(r, rep) for r, (_, _, rep) in enumerate(replies) if rep[0] == "err"]
        if errors or hung:
            # A failed collective can leave the group's ranks out of step: start afresh.
            self.restart(n)
        if errors:
            rank, (_, exc_type, message, tb) = errors[0]
            raise RankError(rank, exc_type, message, tb)
        if hung:
            raise RankTimeout(hung, timeout_s, n)
        return [rep[1] for _, _, rep in replies[:n]]

    def _run_locally(self, fn, n, args, kwargs, timeout_s, tag) -> tuple:
        """This rank's reply: its worker's, ("timeout",) after `timeout_s`, or sooner once
        a peer failed and this one has had PEER_GRACE_S to report its own error."""
        worker = self.workers.get(n)
        if worker is None or not worker.proc.is_alive():
            if worker is not None:
                worker.stop()
            self.generations[n] = self.generations.get(n, 0) + 1
            worker = self.workers[n] = _LocalWorker(self, n, self.generations[n])
        # A worker that died takes no task: its reply is then the end of its connection
        # (receive_reply: "ProcessDied").
        hand_over(worker.conn, pickle.dumps((forwarded_env(), fn, args, kwargs)))
        deadline = time.monotonic() + timeout_s
        failed = f"{tag}/failed"
        while True:
            reply = worker.reply(min(0.1, max(deadline - time.monotonic(), 0)))
            if reply is not None:
                if reply[0] == "err":
                    self.store.set(failed, str(self.rank))
                return reply
            if time.monotonic() >= deadline:
                return ("timeout",)
            if self.store.check([failed]):
                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)

    def restart(self, n: int) -> None:
        """Stop this rank's worker of the world of n; the next call starts a fresh one
        (every rank does this at the same call)."""
        worker = self.workers.pop(n, None)
        if worker is not None:
            worker.stop()

    def _forget(self, call: int) -> None:
        if call > 0:
            with contextlib.suppress(Exception):  # a store without delete_key keeps it
                self.store.delete_key(f"call/{call}/{self.rank}")
                self.store.delete_key(f"call/{call}/start/{self.rank}")

    def close(self) -> None:
        for n in list(self.workers):
            worker = self.workers.pop(n)
            with contextlib.suppress(Exception):
                worker.conn.send_bytes(b"")  # a worker's signal to leave its group
                worker.proc.join(5.0)
            worker.stop()


_world: LaunchedWorld | None = None


def attach(process_group: str | None = None, device: str | None = None) -> LaunchedWorld:
    """The launched world of this process, joined on first use with `process_group` and
    `device` (default: $REFIMPL_PROCESS_GROUP, else gloo; $REFIMPL_DEVICE, else cpu)."""
    global _world
    process_group = process_group or chosen_process_group()
    device = device or chosen_device()
    if _world is None:
        _world = LaunchedWorld()  # the store first: a refusal below can still wait for
        atexit.register(_world.close)  # every rank to have said it (`joined`)
        _world.choose(process_group, device)
    return _world


def joined() -> LaunchedWorld | None:
    """The world this process joined, even if choosing its options failed."""
    return _world


def current() -> LaunchedWorld | None:
    """The launched world `run_on_ranks` runs on, None outside one."""
    if _world is not None:
        return _world
    return attach() if launched_by_env() else None
