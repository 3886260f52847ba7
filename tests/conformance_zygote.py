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


def _run_child(request: dict, temp: str) -> None:
    """In the forked child: become `python -m conformance ARGS` in `cwd`, with `temp` as
    its temp folder; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group, so a timeout kills its rank workers too
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
        shutil.rmtree(temp, ignore_errors=True)
        sys.stdout.write(json.dumps({"returncode": code}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
