"""The multi-process harness: results in rank order, failures and hangs named by rank."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from refimpl.multiprocess import RankError, RankTimeout, run_on_ranks


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), os.getpid()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_results_come_back_in_rank_order(world_size):
    results = run_on_ranks(_rank_and_sum, world_size)
    total = world_size * (world_size + 1) / 2
    assert [r[:3] for r in results] == [(r, world_size, total) for r in range(world_size)]
    assert len({r[3] for r in results}) == world_size, "each rank is its own process"


def test_worker_groups_are_reused():
    first = run_on_ranks(_rank_and_sum, 2)
    second = run_on_ranks(_rank_and_sum, 2)
    assert [r[3] for r in first] == [r[3] for r in second]


def _fail_on(bad_rank):
    if dist.get_rank() == bad_rank:
        raise KeyError(f"boom from {bad_rank}")
    return dist.get_rank()


def test_first_failing_rank_is_raised_with_its_traceback():
    with pytest.raises(RankError) as info:
        run_on_ranks(_fail_on, 3, 2)
    assert info.value.rank == 2
    assert info.value.exc_type == "KeyError"
    assert "boom from 2" in str(info.value)
    assert "_fail_on" in info.value.remote_traceback
    # The group was replaced; the next call works.
    assert run_on_ranks(_fail_on, 3, -1) == [0, 1, 2]


def _hang_on(bad_rank):
    if dist.get_rank() == bad_rank:
        time.sleep(3600)
    return dist.get_rank()


def test_hung_rank_is_killed_and_named():
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_on_ranks(_hang_on, 2, 1, timeout=3)
    assert info.value.ranks == [1]
    assert "rank(s) [1]" in str(info.value)
    assert time.monotonic() - start < 30
    assert run_on_ranks(_hang_on, 2, -1) == [0, 1]


def _exit_on(bad_rank):
    if dist.get_rank() == bad_rank:
        os._exit(3)
    return dist.get_rank()


def test_dead_rank_is_reported():
    with pytest.raises(RankError) as info:
        run_on_ranks(_exit_on, 2, 0, timeout=20)
    assert info.value.rank == 0
    assert "exited with code 3" in str(info.value)


def test_world_size_is_checked():
    with pytest.raises(ValueError, match="world_size"):
        run_on_ranks(_rank_and_sum, 9)


def test_world_size_bound_is_the_worker_process_limit():
    from refimpl.multiprocess import MAX_WORKER_PROCESSES

    with pytest.raises(ValueError, match=f"1..{MAX_WORKER_PROCESSES}"):
        run_on_ranks(_rank_and_sum, MAX_WORKER_PROCESSES + 1)


def _run_python(args, stdin=""):
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=120)


NOT_IMPORTABLE = """
from refimpl.multiprocess import run_on_ranks
def f():
    return 1
run_on_ranks(f, 2)
"""


@pytest.mark.parametrize("how", ["stdin", "-c"])
def test_a_function_workers_cannot_import_is_refused_at_once(how):
    proc = _run_python(["-"] if how == "stdin" else ["-c", NOT_IMPORTABLE],
                       stdin=NOT_IMPORTABLE if how == "stdin" else "")
    assert proc.returncode != 0
    assert "ValueError: fn: 'f' is defined in a main module that is not a file" in proc.stderr
    assert "cannot import it" in proc.stderr and "ProcessDied" not in proc.stderr


def test_an_importable_function_runs_from_stdin():
    """Workers re-import the caller's main module; '<stdin>' is none, and is skipped."""
    code = ("from refimpl.multiprocess import run_on_ranks\n"
            "import refimpl.functional_collectives as fc\n"
            "print(run_on_ranks(fc.work_registry_size, 2))\n")
    proc = _run_python(["-"], stdin=code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("[0, 0]")


def test_lambdas_and_local_functions_are_refused():
    def local():
        return 1

    for fn in (lambda: 1, local):
        with pytest.raises(ValueError, match="cannot import it"):
            run_on_ranks(fn, 1)


def _env_of_rank():
    return os.environ.get("REFIMPL_TEST_FORWARDED")


def test_refimpl_variables_follow_every_task(monkeypatch):
    monkeypatch.setenv("REFIMPL_TEST_FORWARDED", "yes")
    assert run_on_ranks(_env_of_rank, 2) == ["yes", "yes"]
    monkeypatch.delenv("REFIMPL_TEST_FORWARDED")
    assert run_on_ranks(_env_of_rank, 2) == [None, None]
