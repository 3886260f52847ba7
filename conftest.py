# Tests and conformance cases import this checkout's packages first, whatever is installed
# (worker processes inherit sys.path from the process that starts them).
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# AOTAutograd refuses custom ops whose results alias their inputs when CI is set and only
# warns otherwise (torch 2.13); every run takes the strict form, as CI and future torch do.
os.environ["TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING"] = "1"
# Every rank of every test compares each eager collective call with its peers (FC-28);
# refimpl.multiprocess forwards REFIMPL_* variables to the worker processes.
os.environ.setdefault("REFIMPL_CHECK_COLLECTIVES", "1")


def pytest_xdist_auto_num_workers(config):
    """`pytest -n auto`: one worker more than the cores. Most of the suite's wall time is
    mutant runs and rank processes waiting on their peers (a mutant is often caught by a
    timeout), not CPU: with one worker per core, CI's 2 cores were busy a quarter of the
    run. Measured on a fresh clone here: 2 workers 1016 s, 3 workers 925 s, 4 workers 957 s."""
    return (os.cpu_count() or 1) + 1


# The longest tests start first, so that no worker is left with one of them at the end
# while the others idle: a torchrun launch (about a minute), then the mutant runs (a few
# seconds each, a hundred of them), then the rest in the order collected.
FIRST = ("tests/test_launched.py", "tests/test_mutants.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        where = item.nodeid.split("::", 1)[0]
        return FIRST.index(where) if where in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: the collected order within each group
