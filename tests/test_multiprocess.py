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
