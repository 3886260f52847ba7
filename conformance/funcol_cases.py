"""Rank-side functional-collective cases: groups in every form, ops, backend-neutral.

Each case runs on every rank against a backend's functional-collectives namespace and
returns the plain result; the checking process rebuilds every rank's input and compares
with `conformance.oracle` (see `expected`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from conformance import oracle
from conformance.backends import get_backend
from conformance.oracle import rank_input

GROUP_FORMS = ("name", "pg", "ranks", "noncontig", "rows", "mesh", "mesh_dim", "mesh_dim_name")
_meshes: dict = {}


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, names)
    if key not in _meshes:
        _meshes[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _meshes[key]


def make_group(form: str):
    """(group argument, global ranks of the caller's group), or None if not a member."""
    world, me = dist.get_world_size(), dist.get_rank()
    everyone = list(range(world))
    if form == "name":
        return dist.group.WORLD.group_name, everyone
    if form == "pg":
        return dist.group.WORLD, everyone
    if form == "ranks":
        return list(reversed(everyone)), everyone  # order does not matter (FC-14, FC-15)
    if form == "noncontig":
        members = [1, 3] if world == 4 else [1]
        return (members, members) if me in members else None
    if form == "rows":
        rows = [[0, 2], [1, 3]] if world == 4 else [[0, 1]]
        return rows, next(r for r in rows if me in r)
    if form == "mesh":
        return _mesh((world,), ("x",)), everyone
    if form in ("mesh_dim", "mesh_dim_name"):
        # dim 0 ("dp") of a (2, world/2) mesh: ranks {0, 2} and {1, 3} on 4 ranks.
        mesh = _mesh((2, world // 2), ("dp", "tp"))
        members = [r for r in everyone if r % (world // 2) == me % (world // 2)]
        return (mesh, 0 if form == "mesh_dim" else "dp"), members
    raise ValueError(form)


GATHER_SHAPE = (2, 3)
SCATTER_SHAPE = (4, 4)


def recording_aot_backend(graphs: list):
    """A torch.compile backend that runs AOTAutograd and keeps its forward/backward graphs."""
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    return aot_autograd(fw_compiler=record, bw_compiler=record)


def funcol_api(spec: str):
    return get_backend(spec).require("functional_collectives")


def waited(t):
    """A backend's result as a plain tensor: an AsyncCollectiveTensor waited."""
    return t.wait() if hasattr(t, "wait") and type(t) is not torch.Tensor else t


def run_case(fc, case: str, x: torch.Tensor, group, members: list[int]):
    """Run one case on this rank. `case` is 'kind:arg:arg'."""
    kind, *params = case.split(":")
    n = len(members)
    if kind == "all_reduce":
        return waited(fc.all_reduce(x, params[0], group))
    if kind in ("all_gather", "all_gather_empty"):
        return waited(fc.all_gather_tensor(x, int(params[0]), group))
    if kind == "all_gather_autograd":
        return waited(fc.all_gather_tensor_autograd(x, int(params[0]), group))
    if kind == "reduce_scatter":
        return waited(fc.reduce_scatter_tensor(x, params[0], int(params[1]), group))
    if kind == "reduce_scatter_autograd":
        return waited(fc.reduce_scatter_tensor_autograd(x, params[0], int(params[1]), group))
    if kind in ("all_to_all", "all_to_all_autograd"):
        api = fc.all_to_all_single if kind == "all_to_all" else fc.all_to_all_single_autograd
        if params[0] == "equal":
            return waited(api(x, None, None, group))
        ins, outs = split_sizes(params[0], members.index(dist.get_rank()), n)
        return waited(api(x[: sum(ins)], outs, ins, group))
    if kind == "broadcast":
        return waited(fc.broadcast(x, int(params[0]) % n, group))
    if kind == "all_reduce_coalesced":
        return [waited(t) for t in fc.all_reduce_coalesced([x, x * 2], params[0], group)]
    if kind == "all_gather_coalesced":
        return [waited(t) for t in fc.all_gather_into_tensor_coalesced([x, x + 1], group)]
    if kind == "reduce_scatter_coalesced":
        outs = fc.reduce_scatter_tensor_coalesced([x, x * 3], params[0], [0, 1], group)
        return [waited(t) for t in outs]
    return _run_raw_op(fc, kind, params, x, group, n)


def _run_raw_op(fc, kind, params, x, group, n):
    """The in-place and `_out` ops, straight from the op namespace."""
    name = fc.resolve_group_name(group)
    if kind == "all_reduce_":
        y = x.clone()
        return fc.ops.wait_tensor(fc.ops.all_reduce_(y, params[0], name))
    if kind == "all_reduce_coalesced_":
        ys = [x.clone(), x * 2]
        fc.ops.all_reduce_coalesced_(ys, params[0], name)
        return [fc.ops.wait_tensor(y) for y in ys]
    if kind == "all_gather_out":
        out = x.new_empty([x.shape[0] * n, *x.shape[1:]])
        fc.ops.all_gather_into_tensor_out(x, n, name, out=out)
        return fc.ops.wait_tensor(out)
    if kind == "broadcast_":
        y = x.clone()
        return fc.ops.wait_tensor(fc.ops.broadcast_(y, int(params[0]) % n, name))
    raise ValueError(kind)


def rows_sent(pattern: str, i: int, j: int) -> int:
    """How many rows group rank i sends to group rank j.

    "uneven": asymmetric, with zero-size splits (rank i's input splits differ from its
    output splits, so a backend that swaps the two lists fails). "empty": group rank 0
    sends nothing at all and group rank 1 receives nothing (zero-size input and output).
    """
    if pattern == "uneven":
        return (i + 2 * j) % 3
    if pattern == "empty":
        return 0 if i == 0 or j == 1 else i + j
    raise ValueError(pattern)


def split_sizes(pattern: str, index: int, n: int) -> tuple[list[int], list[int]]:
    """(input splits, output splits) of group rank `index`."""
    ins = [rows_sent(pattern, index, j) for j in range(n)]
    outs = [rows_sent(pattern, j, index) for j in range(n)]
    return ins, outs


def input_for(case: str, rank: int, dtype) -> torch.Tensor:
    kind = case.split(":")[0]
    shape = GATHER_SHAPE if "gather" in kind else SCATTER_SHAPE
    if kind == "all_gather_empty":
        shape = (0, 3)
    if kind.startswith("all_to_all"):
        shape = (4, 4) if case.endswith("equal") else (16, 3)
    return rank_input(rank, shape, dtype, salt=hash_case(case))


def hash_case(case: str) -> int:
    return sum(ord(c) * (i + 1) for i, c in enumerate(case)) % 1000


def run_cases(spec: str, form: str, dtype, cases: list[str]):
    """All `cases` on one group form and dtype; None on ranks outside the group."""
    fc = funcol_api(spec)
    # The meshes create process groups; creating them first makes the group registry
    # the same whichever cases ran before in this worker (upstream's rank-list lookup
    # depends on it; see test_rank_list_creates_its_group).
    world = dist.get_world_size()
    _mesh((world,), ("x",))
    _mesh((2, world // 2), ("dp", "tp"))
    made = make_group(form)
    if made is None:
        return None
    group, members = made
    results = {}
    for case in cases:
        x = input_for(case, dist.get_rank(), dtype)
        before = x.clone()
        try:
            out = run_case(fc, case, x, group, members)
            results[case] = ("ok", out, torch.equal(x, before))
        except Exception as exc:  # reported per case by the test
            results[case] = ("err", f"{type(exc).__name__}: {exc}", True)
    pending = fc.work_registry_size() if fc.work_registry_size else None
    return members, results, pending


# --- the checking side -------------------------------------------------------------
FLOAT_REDUCTIONS = ["sum", "avg", "product", "min", "max"]
INT_REDUCTIONS = ["sum", "product", "min", "max", "band", "bor", "bxor"]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "i64": torch.int64}


def cases_for(dtype) -> list[str]:
    reductions = INT_REDUCTIONS if not dtype.is_floating_point else FLOAT_REDUCTIONS
    cases = [f"all_reduce:{op}" for op in reductions]
    # Reduction names are case-insensitive (FC-17).
    cases += ["all_reduce:MAX", f"reduce_scatter:{reductions[1].upper()}:0"]
    cases += [f"all_reduce_:{op}" for op in reductions[:2]]
    # Gather and scatter dims at both ends: 0, 1 = ndim - 1, -1 and -2 = -ndim (FC-20).
    cases += ["all_gather:0", "all_gather:1", "all_gather:-1", "all_gather:-2",
              "all_gather_out", "all_gather_empty:0"]
    cases += [f"reduce_scatter:{op}:{d}" for op in reductions[:2] for d in (0, 1, -1, -2)]
    cases += ["all_to_all:equal", "all_to_all:uneven", "all_to_all:empty"]
    # src at both ends: group rank 0 and group rank n - 1 (FC-22).
    cases += ["broadcast:0", "broadcast:1", "broadcast:-1", "broadcast_:1", "broadcast_:-1"]
    # The coalesced forms with a second reduction too (avg divides on this path as well).
    cases += ["all_reduce_coalesced:sum", f"all_reduce_coalesced:{reductions[1]}",
              "all_reduce_coalesced_:max", "all_gather_coalesced",
              f"reduce_scatter_coalesced:{reductions[0]}",
              f"reduce_scatter_coalesced:{reductions[1]}"]
    # The *_autograd forms give the values of the plain ones (FC-32).
    cases += ["all_gather_autograd:1", f"reduce_scatter_autograd:{reductions[0]}:1",
              "all_to_all_autograd:uneven"]
    return cases


def expected(case: str, members: list[int], index: int, dtype):
    """The oracle's result for group rank `index` of `members`."""
    xs = [input_for(case, r, dtype) for r in members]
    kind, *params = case.split(":")
    n = len(members)
    if kind in ("all_reduce", "all_reduce_"):
        return oracle.reduce(xs, params[0])
    if kind in ("all_gather", "all_gather_empty", "all_gather_autograd"):
        return oracle.all_gather(xs, int(params[0]))
    if kind == "all_gather_out":
        return oracle.all_gather(xs, 0)
    if kind in ("reduce_scatter", "reduce_scatter_autograd"):
        return oracle.reduce_scatter(xs, params[0], index, int(params[1]))
    if kind in ("all_to_all", "all_to_all_autograd"):
        if params[0] == "equal":
            return oracle.all_to_all_single(xs, index)
        ins = [[rows_sent(params[0], i, j) for j in range(n)] for i in range(n)]
        rows = [x[: sum(s)] for x, s in zip(xs, ins, strict=True)]
        return oracle.all_to_all_single(rows, index, ins)
    if kind in ("broadcast", "broadcast_"):
        return xs[int(params[0]) % n]
    if kind in ("all_reduce_coalesced", "all_reduce_coalesced_"):
        return [oracle.reduce(xs, params[0]), oracle.reduce([x * 2 for x in xs], params[0])]
    if kind == "all_gather_coalesced":
        return [oracle.all_gather(xs), oracle.all_gather([x + 1 for x in xs])]
    if kind == "reduce_scatter_coalesced":
        return [oracle.reduce_scatter(xs, params[0], index, 0),
                oracle.reduce_scatter([x * 3 for x in xs], params[0], index, 1)]
    raise ValueError(case)


def assert_same(got, want, where):
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
        return
    assert type(got) is torch.Tensor, f"{where}: got {type(got).__name__}"
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{where}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}")
    assert torch.equal(got, want), f"{where}: got\n{got}\nwant\n{want}"
