"""One rank's process: the worker that refimpl's harness (multiprocess.py) and a launched
world (launched.py) both start, its errors, and the choices it is started with.

A worker joins a default process group of its world through a TCPStore (the harness's
on loopback, or the launched world's), on a process-group backend `torch.distributed`
knows (a registered one included) and a device, then runs pickled tasks `fn(*args)`
until told to stop, replying with the result (tensors moved to the CPU) or the error.
The caller's `REFIMPL_*` variables travel with every task (FC-28).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib
import multiprocessing
import os
import pickle
import sys
import threading
import traceback

# Environment variables that follow every task into the workers.
FORWARDED_ENV_PREFIX = "REFIMPL_"
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


# --------------------------------------------------------------------------------------
# Choices: a process group and a device every rank can serve (CF-13)
# --------------------------------------------------------------------------------------
def chosen_process_group() -> str:
    """The process group workers start with unless told: $REFIMPL_PROCESS_GROUP, else
    gloo (`--process-group` sets the variable)."""
    return os.environ.get("REFIMPL_PROCESS_GROUP") or "gloo"


def chosen_device() -> str:
    """Where rank functions make their tensors unless told: $REFIMPL_DEVICE, else cpu
    (`--device` sets the variable)."""
    return os.environ.get("REFIMPL_DEVICE") or "cpu"


def resolve_process_group(spec: str) -> str:
    """The backend name `torch.distributed` knows for `spec`: a name it has (`gloo`,
    `nccl`, one registered with `Backend.register_backend`), or `module:attr` of a
    function that registers one and returns its name (called here, once per process)."""
    import torch.distributed as dist

    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--process-group: expected a backend name or module:attr, got "
                         f"{spec!r} [CF-13]")
    name = spec
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            register = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--process-group {spec}: cannot import it ({exc}) "
                             f"[CF-13]") from None
        name = register()
        if not isinstance(name, str) or not name:
            raise ValueError(f"--process-group {spec}: the function must register a "
                             f"backend and return its name; it returned {name!r} [CF-13]")
    if name.lower() not in dist.Backend.backend_list:
        known = [b for b in dist.Backend.backend_list if b != "undefined"]
        raise ValueError(f"--process-group {spec}: torch.distributed has no backend named "
                         f"{name!r} (known: {', '.join(known)}; register one with "
                         f"torch.distributed.Backend.register_backend and pass "
                         f"module:attr of the function that does) [CF-13]")
    return name


def check_device(device: str, process_group: str) -> None:
    """Refuse, naming the option, a device this process cannot use or the process group
    cannot serve."""
    import torch
    import torch.distributed as dist

    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"--device {device}: not a device ({exc}) [CF-13]") from None
    if kind != "cpu":
        module = getattr(torch, kind, None)
        if module is None or not module.is_available() or module.device_count() == 0:
            raise ValueError(f"--device {device}: this machine has no {kind} device "
                             f"[CF-13]")
    served = dist.Backend.backend_capability.get(process_group.lower(), [])
    if kind not in served:
        raise ValueError(f"--device {device}: process group {process_group!r} serves "
                         f"{', '.join(served) or 'no device'}, not {kind} (choose "
                         f"--process-group accordingly) [CF-13]")
    available = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available,
                 "mpi": dist.is_mpi_available}.get(process_group.lower())
    if available is not None and not available():
        raise ValueError(f"--process-group {process_group}: this build of torch has no "
                         f"{process_group} [CF-13]")


def local_device(device: str, local_rank: int):
    """`cuda` means this rank's own device: cuda:(local rank mod the device count)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu" or dev.index is not None:
        return dev
    module = getattr(torch, dev.type)
    return torch.device(dev.type, local_rank % module.device_count())


def to_cpu(value):
    """`value` with every tensor in it (lists, tuples, dicts) moved to the CPU."""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, value)


@contextlib.contextmanager
def on_device(device):
    """Tensors a rank function makes land on `device` (the CPU: nothing to do)."""
    if device.type == "cpu":
        yield
        return
    with device:
        yield


# --------------------------------------------------------------------------------------
# The worker
# --------------------------------------------------------------------------------------
def worker_main(rank, world_size, store_address, prefix, sys_path, conn, setting):
    """Body of one rank: join the process group, then run tasks until told to stop.

    `store_address`: (host, port) of the TCPStore the group meets at; `setting`: (process
    group, device, local rank)."""
    sys.path[:] = sys_path
    # The harness starts ranks as daemonic processes (they end with their parent), which
    # multiprocessing forbids to start processes of their own; a process group may need
    # to (torchft's ProcessGroupBabyGloo runs gloo in a child). Only the rank's own view
    # changes: its parent still ends it.
    multiprocessing.current_process()._config["daemon"] = False
    # A rank that crashes in native code (a signal, glibc's abort on a corrupt heap) says
    # where every thread was on its stderr, which the caller's log keeps.
    faulthandler.enable(all_threads=True)
    host, port = store_address
    if host == "127.0.0.1":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    process_group, device, local_rank = setting
    name = resolve_process_group(process_group)  # registers a module:attr one
    device = local_device(device, local_rank)
    if device.type != "cpu":
        getattr(torch, device.type).set_device(device)
    store = dist.TCPStore(host, port, is_master=False,
                          timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        dist.init_process_group(
            name, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
    except Exception as exc:  # a vendor's group that cannot start: say so, do not vanish
        _answer_once_and_leave(conn, pickle.dumps((
            "err", type(exc).__name__,
            f"--process-group {process_group}: the process group did not start on rank "
            f"{rank} of {world_size}: {exc} [CF-13]", traceback.format_exc())))
        return
    while True:
        task = conn.recv_bytes()
        if not task:
            break
        conn.send_bytes(_run_task(task, device))
    dist.destroy_process_group()


def _answer_once_and_leave(conn, reply: bytes) -> None:
    """Give the first task `reply` instead of running it (the caller's error names the
    cause, not a rank that died), then leave."""
    with contextlib.suppress(EOFError, OSError):
        if conn.recv_bytes():
            conn.send_bytes(reply)


def _run_task(task: bytes, device) -> bytes:
    try:
        env, fn, args, kwargs = pickle.loads(task)
        _apply_env(env)
        with on_device(device):
            result = fn(*args, **kwargs)
        return pickle.dumps(("ok", to_cpu(result)))
    except BaseException as exc:  # report everything, the caller decides
        return pickle.dumps(("err", type(exc).__name__, str(exc), traceback.format_exc()))


def hand_over(conn, task: bytes) -> None:
    """Send `task` to a worker without holding up the caller. A task larger than the
    socket's buffer waits until the worker reads it, and a worker reads only once its
    process group has formed: one whose peer cannot start it waits out the group's
    rendezvous (PG_TIMEOUT_S). The call's own deadline, not the send, must bound that wait
    (CF-13); the caller then counts a worker that never took its task as not answering. A
    send to a worker stopped meanwhile is dropped: its missing reply says so."""
    def send():
        # A connection closed under the send raises OSError, or TypeError once its handle
        # is gone (multiprocessing writes to `None`).
        with contextlib.suppress(OSError, ValueError, TypeError):
            conn.send_bytes(task)

    threading.Thread(target=send, name="refimpl-hand-over", daemon=True).start()


def receive_reply(conn, rank: int, proc) -> tuple:
    """The reply a worker sent through `conn`; a worker that died before it answered
    gives ("err", "ProcessDied", ...) naming its rank and exit code."""
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        proc.join(1.0)
        return ("err", "ProcessDied", f"rank {rank} exited with code {proc.exitcode}", "")


def forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIX)}


def _apply_env(env: dict[str, str]) -> None:
    """The caller's REFIMPL_* variables, exactly: set those it has, drop the others."""
    for key in [k for k in os.environ if k.startswith(FORWARDED_ENV_PREFIX)]:
        if key not in env:
            del os.environ[key]
    os.environ.update(env)


_context_cache = None


def main_is_a_file() -> bool:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return path is not None and os.path.isfile(path)


@contextlib.contextmanager
def main_without_fake_file():
    """Workers re-import the caller's main module from its `__file__`; under `python -`
    that is '<stdin>', which does not exist and kills every worker at start."""
    main = sys.modules.get("__main__")
    fake = getattr(main, "__file__", None) is not None and not main_is_a_file()
    saved = main.__file__ if fake else None
    if fake:
        del main.__file__
    try:
        yield
    finally:
        if fake:
            main.__file__ = saved


def context():
    """A forkserver context with torch preloaded: fast, and safe to start from threads."""
    global _context_cache
    if _context_cache is None:
        _context_cache = multiprocessing.get_context("forkserver")
        _context_cache.set_forkserver_preload(["torch", "torch.distributed"])
    return _context_cache
