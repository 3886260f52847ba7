"""AsyncCollectiveTensor, the work registry, finalizers and errors, on gloo ranks.

refimpl-specific checks (registry internals, messages naming SPEC IDs, a 100k-op leak
test); the backend-neutral ones, gradients included, are conformance cases.
FC-2, FC-4..FC-11, FC-13, FC-15, FC-17..FC-22, FC-24, FC-27, FC-30.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

import refimpl.functional_collectives as fc
from refimpl.multiprocess import run_on_ranks

WORLD = "0"  # the default group's registered name


def _async_semantics():
    me = dist.get_rank()
    x = torch.full((4,), float(me + 1))
    facts = {}
    y = fc.all_reduce(x, "sum", WORLD)
    facts["type"] = type(y).__name__
    facts["pending_after_issue"] = fc.work_registry_size()
    v = y.view(2, 2)  # FC-10: views do not wait
    facts["view_type"] = type(v).__name__
    facts["pending_after_view"] = fc.work_registry_size()
    z = v + 0  # FC-9: first real use waits, the result is a plain tensor
    facts["use_type"] = type(z).__name__
    facts["pending_after_use"] = fc.work_registry_size()
    facts["value"] = z.flatten().tolist()
    facts["input_unchanged"] = x.tolist() == [float(me + 1)] * 4
    facts["no_shared_storage"] = y.elem.untyped_storage().data_ptr() != x.data_ptr()
    # FC-11: wait() gives the plain tensor; repr and tolist wait before reading.
    w = fc.all_reduce(x, "sum", WORLD)
    facts["wait_type"] = type(w.wait()).__name__
    facts["repr"] = repr(fc.all_reduce(x, "max", WORLD))
    facts["tolist"] = fc.all_reduce(x, "min", WORLD).tolist()
    # FC-5: eager wait_tensor returns its argument; waiting twice is a no-op; the op
    # returns a copy holding the completed value.
    raw = fc.ops.all_reduce(x, "sum", WORLD)
    facts["wait_returns_arg"] = fc.wait_tensor(raw) is raw
    fc.wait_tensor(raw)
    facts["wait_plain_tensor"] = fc.wait_tensor(x) is x
    raw = fc.ops.all_reduce(x, "sum", WORLD)
    copy = fc.ops.wait_tensor(raw)
    facts["op_wait_shares_storage"] = copy.untyped_storage().data_ptr() == raw.data_ptr()
    facts["op_wait_value"] = copy.tolist()
    facts["pending_end"] = fc.work_registry_size()
    return facts


def test_async_collective_tensor_waits_on_first_use_but_not_on_views():
    """FC-2, FC-5, FC-6, FC-9, FC-10, FC-11."""
    for rank, facts in enumerate(run_on_ranks(_async_semantics, 2)):
        assert facts["type"] == "AsyncCollectiveTensor"
        assert facts["pending_after_issue"] == 1
        assert facts["view_type"] == "AsyncCollectiveTensor"
        assert facts["pending_after_view"] == 1, f"rank {rank}: a view waited"
        assert facts["use_type"] == "Tensor"
        assert facts["pending_after_use"] == 0
        assert facts["value"] == [3.0] * 4
        assert facts["input_unchanged"] and facts["no_shared_storage"]
        assert facts["wait_type"] == "Tensor"
        assert facts["repr"] == "AsyncCollectiveTensor(tensor([2., 2., 2., 2.]))"
        assert facts["tolist"] == [1.0] * 4
        assert facts["wait_returns_arg"] and facts["wait_plain_tensor"]
        assert not facts["op_wait_shares_storage"] and facts["op_wait_value"] == [3.0] * 4
        assert facts["pending_end"] == 0


def _empty_and_finalizer():
    facts = {}
    empty = fc.all_reduce(torch.empty(0), "sum", WORLD)
    facts["empty_pending"] = fc.work_registry_size()  # FC-7: completed at once
    facts["empty_shape"] = list(empty.shape)
    # FC-8: drop unwaited results; the finalizer waits and clears them.
    for i in range(5):
        fc.all_reduce(torch.full((8,), float(i)), "sum", WORLD)
    gc.collect()
    facts["pending_after_drop"] = fc.work_registry_size()
    after = fc.all_reduce(torch.ones(3) * (dist.get_rank() + 1), "sum", WORLD).tolist()
    facts["following_collective"] = after
    return facts


def test_empty_results_complete_at_once_and_dropped_results_are_finalized():
    """FC-7, FC-8."""
    for facts in run_on_ranks(_empty_and_finalizer, 2):
        assert facts["empty_pending"] == 0
        assert facts["empty_shape"] == [0]
        assert facts["pending_after_drop"] == 0
        assert facts["following_collective"] == [3.0, 3.0, 3.0]


class _RecordingWork:
    def __init__(self):
        self.waited = 0

    def wait(self):
        self.waited += 1


def test_a_stale_finalizer_leaves_a_newer_entry_alone():
    """FC-8: the version tells the owner of a reused address from a stale finalizer."""
    ptr = 12345
    old, new = _RecordingWork(), _RecordingWork()
    fc._work_registry[ptr] = [(2, new)]  # the address now belongs to a newer result
    try:
        fc._wait_and_clear(ptr, 1)  # the old result's finalizer: its entry is gone
        assert fc._work_registry[ptr] == [(2, new)] and new.waited == 0 and old.waited == 0
        fc._work_registry[ptr].append((3, old))  # a second result over the same storage
        fc._wait_and_clear(ptr, 3)  # the finalizer of that one waits only its own
        assert fc._work_registry[ptr] == [(2, new)] and old.waited == 1 and new.waited == 0
        fc._wait_and_clear(ptr, 2)
        assert ptr not in fc._work_registry and new.waited == 1
    finally:
        fc._work_registry.pop(ptr, None)


def _leak(n_ops):
    import resource

    def rss_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    x = torch.ones(16)
    peaks = []
    for phase in range(2):
        for i in range(n_ops // 2):
            y = fc.all_reduce(x, "sum", WORLD)
            if i % 2:
                y.wait()  # half waited, half dropped to the finalizer
            del y
        gc.collect()
        peaks.append(rss_mb())
        if phase == 0:
            pending_mid = fc.work_registry_size()
    return pending_mid, fc.work_registry_size(), peaks


def test_100k_ops_leave_no_registry_entries_and_flat_memory():
    """FC-6, FC-8: 100,000 all_reduces, half of them dropped unwaited.

    A gloo group of one process: the same op, registry and finalizer path as on more
    ranks, without paying a network round trip per op (1.5 ms here on 2 ranks).
    """
    for pending_mid, pending_end, (first_half_mb, second_half_mb) in run_on_ranks(
            _leak, 1, 100_000, timeout=300):
        assert pending_mid == 0 and pending_end == 0
        assert second_half_mb - first_half_mb < 16, (first_half_mb, second_half_mb)


def _error_of(fn):
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _bad_inputs():
    me = dist.get_rank()
    x = torch.ones(4, 4)
    checks = {
        "unknown_op": lambda: fc.all_reduce(x, "median", WORLD),
        "avg_int": lambda: fc.all_reduce(torch.ones(2, dtype=torch.int64), "avg", WORLD),
        "band_float": lambda: fc.all_reduce(x, "band", WORLD),
        "indivisible": lambda: fc.reduce_scatter_tensor(torch.ones(3, 4), "sum", 0, WORLD),
        "indivisible_dim1": lambda: fc.reduce_scatter_tensor(torch.ones(4, 3), "sum", 1, WORLD),
        "bad_dim": lambda: fc.all_gather_tensor(x, 2, WORLD),
        "zero_dim": lambda: fc.all_gather_tensor(torch.tensor(1.0), 0, WORLD),
        "unequal_rows": lambda: fc.all_reduce(x, "sum", [[0, 1], [2]]),
        "duplicate": lambda: fc.all_reduce(x, "sum", [0, 0, 1]),
        "outside_world": lambda: fc.all_reduce(x, "sum", [0, 1, 7]),
        "not_member": lambda: fc.all_reduce(x, "sum", [1 - me]),
        "empty_list": lambda: fc.all_reduce(x, "sum", []),
        "unknown_name": lambda: fc.all_reduce(x, "sum", "no-such-group"),
        "bad_type": lambda: fc.all_reduce(x, "sum", 3.5),
        "group_size": lambda: fc.ops.all_gather_into_tensor(x, 3, WORLD),
        "out_shape": lambda: fc.ops.all_gather_into_tensor_out(x, 2, WORLD, out=torch.ones(4)),
        "splits_sum": lambda: fc.all_to_all_single(x, [2, 2], [1, 1], WORLD),
        "splits_count": lambda: fc.all_to_all_single(x, [4], [4], WORLD),
        "src": lambda: fc.broadcast(x, 2, WORLD),
        "scatter_dims": lambda: fc.reduce_scatter_tensor_coalesced([x], "sum", [0, 1], WORLD),
        "no_grad_op": lambda: fc.all_reduce(torch.ones(2, requires_grad=True), "product",
                                            WORLD),
        "reduce_op_none": lambda: fc.all_reduce(x, None, WORLD),
        "reduce_op_enum": lambda: fc.all_reduce(x, dist.ReduceOp.PREMUL_SUM, WORLD),
        "src_bool": lambda: fc.broadcast(x, True, WORLD),
        "meta_input": lambda: fc.all_reduce(torch.ones(2, device="meta"), "sum", WORLD),
        "out_device": lambda: fc.ops.all_gather_into_tensor_out(
            x, 2, WORLD, out=torch.empty(8, 4, device="meta")),
        "out_contiguous": lambda: fc.ops.all_gather_into_tensor_out(
            x, 2, WORLD, out=torch.empty(4, 8).t()),
        "in_place_contiguous": lambda: fc.ops.broadcast_(torch.ones(4, 2).t(), 0, WORLD),
        "coalesced_member": lambda: fc.ops.all_reduce_coalesced(
            [x, torch.ones(2, dtype=torch.int64)], "avg", WORLD),
        "wait_tensors_of_a_tensor": lambda: fc.wait_tensors(x),
        "wait_tensors_of_a_number": lambda: fc.wait_tensors([x, 2]),
    }
    errors = {name: _error_of(fn) for name, fn in checks.items()}
    # FC-27: nothing above communicated, so the group is still in step.
    errors["after"] = fc.all_reduce(torch.ones(1), "sum", WORLD).tolist()
    errors["pending"] = fc.work_registry_size()
    return errors


EXPECTED_ERRORS = {
    "unknown_op": ("ValueError", "reduce_op", "FC-17"),
    "avg_int": ("ValueError", "reduce_op", "FC-18"),
    "band_float": ("ValueError", "reduce_op", "FC-18"),
    "indivisible": ("ValueError", "scatter_dim", "FC-20"),
    "indivisible_dim1": ("ValueError", "scatter_dim", "FC-20"),
    "bad_dim": ("ValueError", "gather_dim", "FC-20"),
    "zero_dim": ("ValueError", "gather_dim", "FC-20"),
    "unequal_rows": ("ValueError", "group", "FC-15"),
    "duplicate": ("ValueError", "group", "FC-15"),
    "outside_world": ("ValueError", "group", "FC-15"),
    "not_member": ("ValueError", "group", "FC-15"),
    "empty_list": ("ValueError", "group", "FC-15"),
    "unknown_name": ("ValueError", "group_name", "FC-13"),
    "bad_type": ("TypeError", "group", "FC-13"),
    "group_size": ("ValueError", "group_size", "FC-19"),
    "out_shape": ("ValueError", "out", "FC-20"),
    "splits_sum": ("ValueError", "split_sizes", "FC-21"),
    "splits_count": ("ValueError", "split_sizes", "FC-21"),
    "src": ("ValueError", "src", "FC-22"),
    "scatter_dims": ("ValueError", "scatter_dim", "FC-20"),
    "no_grad_op": ("RuntimeError", "reduce_op", "FC-24"),
    "reduce_op_none": ("ValueError", "reduce_op", "FC-17"),
    "reduce_op_enum": ("ValueError", "reduce_op", "FC-17"),
    "src_bool": ("ValueError", "src", "FC-22"),
    "meta_input": ("ValueError", "input", "FC-30"),
    "out_device": ("ValueError", "out", "FC-30"),
    "out_contiguous": ("ValueError", "out", "FC-4"),
    "in_place_contiguous": ("ValueError", "input", "FC-4"),
    "coalesced_member": ("ValueError", "reduce_op", "FC-18"),
    "wait_tensors_of_a_tensor": ("TypeError", "tensors", "FC-37"),
    "wait_tensors_of_a_number": ("TypeError", "tensors", "FC-37"),
}


def test_bad_input_raises_naming_argument_and_rule_and_nothing_hangs():
    """FC-4, FC-13, FC-15, FC-17..FC-22, FC-24, FC-27, FC-30, FC-37."""
    for rank, errors in enumerate(run_on_ranks(_bad_inputs, 2)):
        for name, (exc_type, arg, rule) in EXPECTED_ERRORS.items():
            message = errors[name]
            assert message.startswith(exc_type + ":"), f"rank {rank} {name}: {message}"
            assert arg in message and f"[{rule}]" in message, f"rank {rank} {name}: {message}"
        assert errors["after"] == [2.0] and errors["pending"] == 0


def _rank_list_reuses_groups():
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # groups {0,2} and {1,3}
    groups_before = len(c10d._world.pg_names)
    mine = [0, 2] if dist.get_rank() % 2 == 0 else [1, 3]
    named = fc.resolve_group_name(mine)
    again = fc.resolve_group_name([[0, 2], [1, 3]])
    value = fc.all_reduce(torch.ones(1), "sum", [[0, 2], [1, 3]]).tolist()
    return (len(c10d._world.pg_names) - groups_before, named == again,
            fc.group_ranks(named) == mine, value)


def test_a_rank_list_reuses_the_group_of_those_ranks():
    """FC-15: a rank list names an existing group of its ranks rather than a new one."""
    assert run_on_ranks(_rank_list_reuses_groups, 4) == [(0, True, True, [2.0])] * 4


def test_an_integer_premul_sum_factor_is_refused_FC_17():
    """Checked before the group is resolved: no process group is needed to refuse it."""
    import pytest

    op = dist._make_nccl_premul_sum(torch.tensor([2]))
    with pytest.raises(ValueError, match=r"^reduce_op: expected a premul_sum factor of one "
                                         r"floating element, got a torch.int64 tensor of "
                                         r"shape \[1\] \[FC-17\]"):
        fc.all_reduce(torch.ones(2), op, "no-such-group")
