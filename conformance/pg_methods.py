"""Which ProcessGroup method each functional-collective op reaches (SPEC FC-34, FC-50),
run on a rank over a group of conformance.recording_process_group, with every member's
values checked against a reference computed on the rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from conformance.funcol_cases import funcol_api, waited
from conformance.recording_process_group import register

# op -> (a call of it on `ops`: (ops, x, group name, group size) -> results,
#        the results it must give: (inputs of every member, this member's group rank))
CALLS = {
    "all_reduce": (lambda ops, x, g, n: [ops.all_reduce(x, "sum", g)],
                   lambda xs, me: [sum(xs)]),
    "all_reduce_": (lambda ops, x, g, n: [ops.all_reduce_(x.clone(), "sum", g)],
                    lambda xs, me: [sum(xs)]),
    "all_reduce_coalesced": (
        lambda ops, x, g, n: ops.all_reduce_coalesced([x, x * 2], "sum", g),
        lambda xs, me: [sum(xs), 2 * sum(xs)]),
    "all_reduce_coalesced_": (
        lambda ops, x, g, n: ops.all_reduce_coalesced_([x.clone(), x * 2], "sum", g),
        lambda xs, me: [sum(xs), 2 * sum(xs)]),
    "all_reduce_coalesced_of_two_dtypes": (  # float64 first: not the dtypes' name order
        lambda ops, x, g, n: ops.all_reduce_coalesced(
            [x.double() * 2, x, x * 3], "sum", g),
        lambda xs, me: [2 * sum(xs).double(), sum(xs), 3 * sum(xs)]),
    "all_gather_into_tensor": (
        lambda ops, x, g, n: [ops.all_gather_into_tensor(x, n, g)],
        lambda xs, me: [torch.cat(xs)]),
    "all_gather_into_tensor_coalesced": (
        lambda ops, x, g, n: ops.all_gather_into_tensor_coalesced([x, x * 2], n, g),
        lambda xs, me: [torch.cat(xs), 2 * torch.cat(xs)]),
    "all_gather_into_tensor_out": (
        lambda ops, x, g, n: [ops.all_gather_into_tensor_out(
            x, n, g, out=x.new_empty([x.shape[0] * n]))],
        lambda xs, me: [torch.cat(xs)]),
    "reduce_scatter_tensor": (
        lambda ops, x, g, n: [ops.reduce_scatter_tensor(x, "sum", n, g)],
        lambda xs, me: [sum(xs).chunk(len(xs))[me]]),
    "reduce_scatter_tensor_coalesced": (
        lambda ops, x, g, n: ops.reduce_scatter_tensor_coalesced([x, x * 2], "sum", n, g),
        lambda xs, me: [sum(xs).chunk(len(xs))[me], 2 * sum(xs).chunk(len(xs))[me]]),
    "all_to_all_single": (
        lambda ops, x, g, n: [ops.all_to_all_single(
            x, [x.shape[0] // n] * n, [x.shape[0] // n] * n, g)],
        lambda xs, me: [torch.cat([x.chunk(len(xs))[me] for x in xs])]),
    "broadcast": (lambda ops, x, g, n: [ops.broadcast(x, 0, g)],
                  lambda xs, me: [xs[0]]),
    "broadcast_": (lambda ops, x, g, n: [ops.broadcast_(x.clone(), 0, g)],
                   lambda xs, me: [xs[0]]),
    # The two members swap their inputs (FC-52): a send, then a receive, each rank.
    "isend_and_irecv": (
        lambda ops, x, g, n: [ops.isend(x, 1 - _group_rank(g), 0, g),
                              ops.irecv(torch.zeros_like(x), 1 - _group_rank(g), 0, g)],
        lambda xs, me: [xs[me].new_empty(0), xs[1 - me]]),
    "batch_p2p_ops": (
        lambda ops, x, g, n: ops.batch_p2p_ops(
            ["irecv", "isend"], [1 - _group_rank(g)] * 2, [0, 0], [torch.zeros_like(x), x], g),
        lambda xs, me: [xs[1 - me], xs[me].new_empty(0)]),
}


def _group_rank(group_name: str) -> int:
    return dist.distributed_c10d._resolve_process_group(group_name).rank()


def _members(world: int) -> list[int]:
    """The recording group: every rank of a world of 2; ranks [1, 2] of a larger one (a
    subgroup whose group ranks are not the global ranks; new_group sorts them)."""
    return list(range(world)) if world == 2 else [1, 2]


def _input(global_rank: int, n: int) -> torch.Tensor:
    return torch.arange(4.0 * n) + 10 * global_rank  # whole numbers: every sum exact


def methods_reached(spec: str, ops_to_run: list[str], kind: str = "no_backend") -> dict | None:
    """op -> (methods reached in order, the error if it failed or None, values right,
    the dtypes of each call's first argument); None on a rank outside the recording
    group. `kind`: which recording group (recording_process_group.KINDS)."""
    ops = funcol_api(spec).ops
    members = _members(dist.get_world_size())
    group = dist.new_group(members, backend=register(kind))
    if dist.get_rank() not in members:
        return None
    n, me = len(members), members.index(dist.get_rank())
    xs = [_input(r, n) for r in members]
    found = {}
    for op in ops_to_run:
        call, want = CALLS[op]
        group.calls.clear()
        group.dtypes.clear()
        try:
            got = [ops.wait_tensor(waited(t)) for t in call(ops, xs[me], group.group_name, n)]
            error = None
            right = len(got) == len(want(xs, me)) and all(
                torch.equal(a, b) for a, b in zip(got, want(xs, me), strict=False))
        except Exception as exc:  # what the op did is the verdict, reported per op
            error, right = f"{type(exc).__name__}: {exc}".splitlines()[0], False
        found[op] = (list(group.calls), error, right, list(group.dtypes))
    # No group of these ranks outlives the call: a later case's rank list [1, 2] must
    # find none (FC-31's check runs only for a group still to be made).
    dist.destroy_process_group(group)
    return found
