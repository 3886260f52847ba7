"""Errors between ranks, on real gloo ranks: refimpl's exception classes and messages.

The backend-neutral behaviour is checked by the conformance cases; here: the exact
error classes, that messages name the differing rank, the field and the rule, that the
cross-rank check is off unless switched on, and that nothing waits without a bound.
FC-27, FC-28, FC-29, FC-31.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import refimpl.functional_collectives as fc
import refimpl.multiprocess as mp
from refimpl.multiprocess import RankError, run_on_ranks


def _outcome(call):
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def _mismatched_shapes():
    me = dist.get_rank()
    outcome = _outcome(lambda: fc.all_reduce(torch.ones(2 + (me == 2)), "sum", "0").wait())
    # Nobody started the collective: the group is in step and the registry is empty.
    return outcome, fc.all_reduce(torch.ones(1), "sum", "0").tolist(), fc.work_registry_size()


def test_mismatch_raises_on_every_rank_naming_the_rank_and_the_field():
    """FC-28: rank 2 of 3 passes another shape; all three ranks raise the same error."""
    results = run_on_ranks(_mismatched_shapes, 3, timeout=60)
    messages = {message for (_, message), _, _ in results}
    assert len(messages) == 1, messages
    for (exc_type, message), after, pending in results:
        assert exc_type == "CollectiveMismatch"
        assert "shapes" in message and "global rank 2 passed [[3]]" in message, message
        assert "global rank 0 passed [[2]]" in message and "[FC-28]" in message, message
        assert after == [3.0] and pending == 0


def _a2a_splits_disagree():
    me = dist.get_rank()
    outs = [[2, 2], [1, 2]][me]  # rank 1 expects 1 row from rank 0, which sends it 2
    return _outcome(lambda: fc.all_to_all_single(torch.ones(4, 1), outs, [2, 2], "0"))


def test_mismatched_all_to_all_splits_name_both_ranks():
    """FC-28: what rank i expects from rank j must be what j sends to i."""
    for exc_type, message in run_on_ranks(_a2a_splits_disagree, 2, timeout=60):
        assert exc_type == "CollectiveMismatch", message
        assert ("global rank 1 expects 1 rows from global rank 0 (output_split_sizes[0]), "
                "which sends it 2 (input_split_sizes[1])") in message, message


def _checks_state():
    return fc.collective_checks_enabled()


def test_the_check_is_off_unless_switched_on(monkeypatch):
    """FC-28: REFIMPL_CHECK_COLLECTIVES=1 switches it on in every rank; unset, it is off."""
    assert run_on_ranks(_checks_state, 2) == [True, True]  # the test run sets it
    monkeypatch.delenv("REFIMPL_CHECK_COLLECTIVES")
    assert run_on_ranks(_checks_state, 2) == [False, False]


def _switch():
    fc.set_collective_checks(False)
    off = fc.collective_checks_enabled()
    fc.set_collective_checks(None)  # back to the environment variable
    return off, fc.collective_checks_enabled()


def test_the_python_switch_overrides_the_environment():
    """FC-28."""
    assert run_on_ranks(_switch, 1) == [(False, True)]


def test_the_peer_timeout_must_be_positive():
    """FC-28: `timeout_s` of 0 or below is refused naming it; the smallest positive is
    kept; None leaves the timeout as it was."""
    saved, before = dict(fc._checks), fc._peer_timeout_s()
    try:
        for bad in (0, 0.0, -1, float("nan")):
            with pytest.raises(ValueError, match=r"timeout_s.*\[FC-28\]"):
                fc.set_collective_checks(None, timeout_s=bad)
            assert fc._peer_timeout_s() == before
        fc.set_collective_checks(None, timeout_s=1e-3)
        assert fc._peer_timeout_s() == 1e-3
        fc.set_collective_checks(None)
        assert fc._peer_timeout_s() == 1e-3
    finally:
        fc._checks.update(saved)  # this process's switch and timeout as they were


def _late_peer():
    fc.set_collective_checks(True, timeout_s=1)
    if dist.get_rank() == 1:
        time.sleep(5)  # arrives long after rank 0 gave up
        return None
    start = time.monotonic()
    outcome = _outcome(lambda: fc.all_reduce(torch.ones(1), "sum", "0"))
    return outcome, time.monotonic() - start


def test_a_peer_that_never_arrives_is_named_within_the_timeout():
    """FC-28: the check itself never hangs."""
    try:
        (exc_type, message), seconds = run_on_ranks(_late_peer, 2, timeout=60)[0]
    finally:
        mp.shutdown(2)  # rank 1 skipped a collective on purpose
    assert exc_type == "PeerTimeout", message
    assert "waited 1 s for global rank 1 of group [0, 1]" in message and "[FC-28]" in message
    assert seconds < 5


def _rank_lists_disagree():
    # Every rank posts its request right after the barrier and reads its peer's after the
    # timeout: 5 s leaves room for a loaded machine (a rank late to post would be reported
    # as having asked for nothing).
    fc.set_collective_checks(None, timeout_s=5)
    dist.barrier()
    me = dist.get_rank()
    return _outcome(lambda: fc.all_reduce(torch.ones(1), "sum", [me, (me + 1) % 3]))


def test_disagreeing_rank_lists_name_every_rank_involved():
    """FC-31: [0, 1], [1, 2], [2, 0] on 3 ranks end in an error on each, within bounds."""
    start = time.monotonic()
    try:
        results = run_on_ranks(_rank_lists_disagree, 3, timeout=60)
    finally:
        mp.shutdown(3)  # the ranks' group requests are out of step on purpose
    assert time.monotonic() - start < 30
    wanted = {0: ([0, 1], 1, [1, 2]), 1: ([1, 2], 2, [0, 2]), 2: ([0, 2], 0, [0, 1])}
    for rank, (exc_type, message) in enumerate(results):
        mine, other, theirs = wanted[rank]
        assert exc_type == "PeerTimeout", message
        assert f"global rank {rank} asked for the group of ranks {mine}" in message, message
        assert f"rank {other} last asked for {theirs}" in message, message
        assert "[FC-31]" in message


def _peer_dies():
    fc.set_collective_checks(False)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    if dist.get_rank() == 1:
        time.sleep(0.3)
        os._exit(0)
    fc.all_reduce(torch.ones(1000), "sum", group).wait()


def test_a_peer_dying_in_a_wait_is_named():
    """FC-29: gloo's 'Connection closed by peer' becomes PeerFailure naming op, group, rank."""
    with pytest.raises(RankError) as info:
        run_on_ranks(_peer_dies, 2, timeout=60)
    err = info.value
    assert err.rank == 0 and err.exc_type == "PeerFailure", err
    assert "all_reduce on group" in err.message and "(global ranks [0, 1])" in err.message
    assert "the failed peer is rank 1" in err.message and "[FC-29]" in err.message


def _coalesced_bad_member():
    x, xi = torch.ones(4), torch.ones(4, dtype=torch.int64)
    outcome = _outcome(lambda: fc.ops.all_reduce_coalesced_([x, xi], "avg", "0"))
    return outcome, fc.work_registry_size(), x.tolist()


def test_a_coalesced_op_starts_nothing_when_a_member_is_bad():
    """FC-27: every member is checked before any starts."""
    for (exc_type, message), pending, first in run_on_ranks(_coalesced_bad_member, 2):
        assert exc_type == "ValueError" and "[FC-18]" in message, message
        assert pending == 0 and first == [1.0] * 4
