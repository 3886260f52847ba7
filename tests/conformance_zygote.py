"""A Python with torch already imported that runs `python -m conformance` in forked children.

tests/test_mutants.py runs the conformance suite once per mutant, each time in a fresh
copy of the checkout. A fresh interpreter spends about 3 s of CPU importing torch and
pytest before the first case; on CI's 2 cores, times some hundred mutants, that is most
of the suite's budget. This process imports them once and forks a child per run: the
child imports refimpl and conformance from the mutant's copy (nothing of either is
imported here), so it runs the mutated code exactly as `python -m conformance` would.

Protocol, one JSON object per line: a request {"cwd", "args", "env", "stdout", "stderr",
"timeout_s"} on stdin; the reply {"returncode"} on stdout (-9 when the run was killed at
its timeout, with its whole process group).

A child ends with `os._exit` (it must not run the atexit handlers it inherited from this
process), which skips multiprocessing's clean-up: the `pymp-*` folder of the forkserver
that starts its rank workers would stay in the system's temp folder, one a run. So each
run gets a temp folder of its own (TMPDIR), removed once the child is gone: a run leaves
nothing behind.

The ranks' forkserver is started here too, once, and shared by every run (it imports
torch; each rank it forks imports refimpl from the run's copy): a run that starts its own
pays a fresh interpreter importing torch, which was two thirds of a first-tier mutant's
time. What it still holds once a run is over (ranks of a run killed at its timeout) is
killed then; what the ranks print goes to ranks.log in this process's folder.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback

# Loaded once, shared by every fork: torch and what the cases' tracing imports (make_fx
# imports torch._inductor and with it torch._dynamo, 1.3 s), and the test tools.
PRELOADED = ("torch", "torch.distributed", "torch.fx.experimental.proxy_tensor",
             "torch._dynamo", "torch._inductor", "torch._functorch.aot_autograd",
             "torch.distributed._functional_collectives",
             "torch.distributed._symmetric_memory", "torch.distributed.fsdp",
             "numpy", "pytest", "xdist", "expecttest", "hypothesis")
for _name in PRELOADED:
    try:
        __import__(_name)
    except ImportError:
        pass
# What is loaded now lives for good: frozen, the children's garbage collections skip it
# (and do not touch, so copy, its pages).
gc.freeze()

# The modules every rank worker's forkserver loads before it forks a rank: torch's of the
# list above (refimpl's own preload, torch and torch.distributed, among them), which the
# cases import on the ranks too; not the test tools.
FORKSERVER_PRELOAD = [name for name in PRELOADED if name.partition(".")[0] == "torch"]


def _start_shared_forkserver() -> int:
    """Start the multiprocessing forkserver here, once, and return its pid.

    Every run's rank workers come from a forkserver; a run that starts its own pays a fresh
    interpreter importing torch (about 1.5 s of CPU, a third of a mutant's run). A child
    forked from here inherits this one (its address and liveness pipe), so its ranks are
    forked from an interpreter that has imported torch and nothing of refimpl: each rank
    imports refimpl and conformance from the run's copy (the forkserver gives it the run's
    sys.path and cwd), and takes its REFIMPL_* variables with every task, as always."""
    import multiprocessing
    import multiprocessing.forkserver as forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    # Its ranks inherit its stdio: never this process's stdout, which is the protocol.
    saved = [os.dup(1), os.dup(2)]
    log = os.open("ranks.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for fd in (1, 2):
            os.dup2(log, fd)
        forkserver.ensure_running()
    finally:
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)
        os.close(log)
    return forkserver._forkserver._forkserver_pid


def _use_the_inherited_forkserver() -> None:
    """In a child: the inherited forkserver is its parent's child, so the liveness check
    (waitpid on its pid) would fail here; it lives as long as the zygote does."""
    import multiprocessing.forkserver as forkserver
    import multiprocessing.resource_tracker as resource_tracker

    forkserver._forkserver.ensure_running = resource_tracker.ensure_running


def _stop_leftover_ranks(server_pid: int) -> None:
    """Kill what the forkserver still has forked once a run is over: ranks of a run killed
    at its timeout (its process group does not hold them), or any that outlived it."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == server_pid:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _run_child(request: dict, temp: str) -> None:
    """In the forked child: become `python -m conformance ARGS` in `cwd`, with `temp` as
    its temp folder; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group, so a timeout kills its children too
        _use_the_inherited_forkserver()
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(handle, fd)
            os.close(handle)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["TMPDIR"] = temp
        tempfile.tempdir = temp  # this process read TMPDIR before the fork
        sys.path.insert(0, request["cwd"])  # what PYTHONPATH=cwd does for a fresh one
        sys.argv = ["conformance", *request["args"]]
        import runpy

        runpy.run_module("conformance", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -9
        time.sleep(0.05)


def main() -> None:
    server_pid = _start_shared_forkserver()
    for line in sys.stdin:
        request = json.loads(line)
        temp = tempfile.mkdtemp(prefix="run-")
        pid = os.fork()
        if pid == 0:
            _run_child(request, temp)
        try:
            os.setpgid(pid, pid)  # also here: a timeout may come before the child ran
        except OSError:
            pass
        code = _wait(pid, request["timeout_s"])
        _stop_leftover_ranks(server_pid)
        shutil.rmtree(temp, ignore_errors=True)
        sys.stdout.write(json.dumps({"returncode": code}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
