"""Functional collectives: out-of-place, traceable collective ops with an explicit wait.

Every collective is an operator of the `refimpl_c10d` library whose result is a fresh
tensor that is *not ready* until `wait_tensor` is called on it (FC-1..FC-5). In eager
mode the op starts the collective asynchronously on the group's ProcessGroup and records
the pending work under the result's `data_ptr` with a version number; `wait_tensor`
waits and clears the entry (FC-6..FC-8). The Python API wraps eager results in
`AsyncCollectiveTensor`, which waits on first use by any op except views (FC-9..FC-11),
and under tracing emits the op followed by its `wait_tensor` (FC-12). Groups can be
named in every form upstream accepts (FC-13..FC-16); reductions, sizes and dims are
checked before any communication, so bad input raises instead of hanging
(FC-17..FC-22, FC-27). Coalesced forms are lists of single ops (FC-26). Autograd
formulas pair all_gather with reduce_scatter (FC-23..FC-25).

Implements SPEC.md section "Functional collectives": FC-1 .. FC-27.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._pytree import tree_map_only

__all__ = [
    "AsyncCollectiveTensor", "all_reduce", "all_reduce_coalesced", "all_gather_tensor",
    "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast", "wait_tensor",
    "resolve_group_name", "group_ranks", "group_size", "work_registry_size", "LIBRARY",
]

LIBRARY = "refimpl_c10d"

# --------------------------------------------------------------------------------------
# Operator schemas (FC-1). `group_name` is a plain `str`: upstream spells it `str` up to
# torch 2.12 and `Any` from 2.13; a string is what every version accepts.
# --------------------------------------------------------------------------------------
SCHEMAS = {
    "all_reduce": "(Tensor input, str reduce_op, str group_name) -> Tensor",
    "all_reduce_": "(Tensor(a!) input, str reduce_op, str group_name) -> Tensor(a!)",
    "all_reduce_coalesced": "(Tensor[] inputs, str reduce_op, str group_name) -> Tensor[]",
    "all_reduce_coalesced_":
        "(Tensor[](a!) inputs, str reduce_op, str group_name) -> Tensor[](a!)",
    "all_gather_into_tensor": "(Tensor input, int group_size, str group_name) -> Tensor",
    "all_gather_into_tensor_coalesced":
        "(Tensor[] inputs, int group_size, str group_name) -> Tensor[]",
    "all_gather_into_tensor_out":
        "(Tensor input, int group_size, str group_name, *, Tensor(a!) out) -> Tensor(a!)",
    "reduce_scatter_tensor":
        "(Tensor input, str reduce_op, int group_size, str group_name) -> Tensor",
    "reduce_scatter_tensor_coalesced":
        "(Tensor[] inputs, str reduce_op, int group_size, str group_name) -> Tensor[]",
    "all_to_all_single": "(Tensor input, SymInt[] output_split_sizes, "
                         "SymInt[] input_split_sizes, str group_name) -> Tensor",
    "broadcast": "(Tensor input, int src, str group_name) -> Tensor",
    "broadcast_": "(Tensor(a!) input, int src, str group_name) -> Tensor(a!)",
    "wait_tensor": "(Tensor tensor) -> Tensor",
}

_lib = torch.library.Library(LIBRARY, "DEF")
for _name, _schema in SCHEMAS.items():
    _lib.define(_name + _schema)
ops = getattr(torch.ops, LIBRARY)


# --------------------------------------------------------------------------------------
# Reductions (FC-17, FC-18)
# --------------------------------------------------------------------------------------
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,  # avg = sum, then / size
    "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
}
_BITWISE = ("band", "bor", "bxor")
DIFFERENTIABLE_REDUCE_OPS = ("sum", "avg")


def _check_reduce_op(reduce_op: str, dtype: torch.dtype) -> str:
    """Normalize a reduce op name and check it fits the dtype (FC-17, FC-18)."""
    if not isinstance(reduce_op, str) or reduce_op.lower() not in _REDUCE_OPS:
        raise ValueError(
            f"reduce_op: unknown reduction {reduce_op!r}; expected one of "
            f"{sorted(_REDUCE_OPS)} (case-insensitive) [FC-17]")
    op = reduce_op.lower()
    floating = dtype.is_floating_point or dtype.is_complex
    if op == "avg" and not floating:
        raise ValueError(f"reduce_op: 'avg' needs a floating dtype, got {dtype} [FC-18]")
    if op in _BITWISE and floating:
        raise ValueError(f"reduce_op: {op!r} needs an integer or bool dtype, got {dtype} [FC-18]")
    return op


# --------------------------------------------------------------------------------------
# Groups (FC-13 .. FC-16)
# --------------------------------------------------------------------------------------
# A group name, a ProcessGroup, ranks, rows of ranks, a DeviceMesh or (DeviceMesh, dim).
RankTypes = Any
_groups_by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _process_group(group_name: str) -> dist.ProcessGroup:
    if not isinstance(group_name, str):
        raise TypeError(f"group_name: expected a str, got {type(group_name).__name__} [FC-13]")
    try:
        return c10d._resolve_process_group(group_name)
    except Exception as exc:
        raise ValueError(f"group_name: no process group is registered as {group_name!r} "
                         f"[FC-13]") from exc


def group_ranks(group_name: str) -> list[int]:
    """Global ranks of a named group, in group-rank order (ascending, FC-14)."""
    return dist.get_process_group_ranks(_process_group(group_name))


def _check_rank_list(ranks, arg: str = "group") -> tuple[int, ...]:
    if not ranks:
        raise ValueError(f"{arg}: a rank list must not be empty [FC-15]")
    world = dist.get_world_size()
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"{arg}: ranks must be ints, got {r!r} [FC-15]")
        if not 0 <= r < world:
            raise ValueError(f"{arg}: rank {r} is outside the world of size {world} [FC-15]")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{arg}: duplicate ranks in {list(ranks)} [FC-15]")
    return tuple(sorted(ranks))


def _group_of_ranks(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """The group of exactly these global ranks: an existing one, else a new one (FC-15)."""
    if ranks == tuple(range(dist.get_world_size())):
        return c10d._get_default_group()
    pg = _groups_by_ranks.get(ranks)
    if pg is None or pg not in c10d._world.pg_names:
        pg = _existing_group_of(ranks) or _new_group_of(ranks)
        _groups_by_ranks[ranks] = pg
    return pg


def _existing_group_of(ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
    # A group of these ranks made elsewhere (a DeviceMesh, new_group) is reused: every
    # member has it, and a second group under the same hashed name would rendezvous on
    # the store keys of the first and hang.
    for pg, members in c10d._world.pg_group_ranks.items():
        if tuple(sorted(members)) == ranks:
            return pg
    return None


def _new_group_of(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    # Local synchronization: only the members call new_group, so a rank list names a
    # group without every other rank having to join in (FC-15).
    return dist.new_group(list(ranks), use_local_synchronization=True)


def _resolve_rank_lists(group) -> dist.ProcessGroup:
    me = dist.get_rank()
    if group and all(isinstance(row, (list, tuple)) for row in group):
        sizes = {len(row) for row in group}
        if len(sizes) != 1:
            raise ValueError(f"group: rows of a 2-D rank list must have equal sizes, got "
                             f"{[len(row) for row in group]} [FC-15]")
        _check_rank_list([r for row in group for r in row])
        mine = [row for row in group if me in row]
        if not mine:
            raise ValueError(f"group: rank {me} is in no row of {group} [FC-15]")
        return _group_of_ranks(tuple(sorted(mine[0])))
    ranks = _check_rank_list(list(group))
    if me not in ranks:
        raise ValueError(f"group: rank {me} is not in the rank list {list(group)} [FC-15]")
    return _group_of_ranks(ranks)


def _resolve_mesh(mesh, dim) -> dist.ProcessGroup:
    if dim is None:
        if mesh.ndim != 1:
            raise ValueError(f"group: a DeviceMesh of {mesh.ndim} dims needs a dim; pass "
                             f"(mesh, dim) [FC-16]")
        dim = 0
    if isinstance(dim, bool) or not isinstance(dim, (int, str)):
        raise ValueError(f"group: mesh dim must be an int or a dim name, got {dim!r} [FC-16]")
    return mesh.get_group(dim)


def resolve_group_name(group: RankTypes, tag: str = "") -> str:
    """The registered name of the ProcessGroup that `group` denotes (FC-13..FC-16).

    `group` may be a group name, a ProcessGroup, a list of global ranks, a 2-D list of
    ranks (equal rows; the caller's row is its group), a 1-D DeviceMesh, or
    `(DeviceMesh, dim)`. `tag` is accepted for upstream compatibility and ignored.
    """
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    if isinstance(group, list):
        # Lists are unhashable, and the compiler wants hashable constants.
        group = tuple(tuple(row) if isinstance(row, list) else row for row in group)
    return _resolve_group_name_constant(group)


# Under torch.compile the name is computed once, at trace time, and baked into the graph
# as a constant: group creation and the registry lookups are not traceable.
@torch.compiler.assume_constant_result
def _resolve_group_name_constant(group) -> str:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, str):
        _process_group(group)
        return group
    if isinstance(group, DeviceMesh):
        return _resolve_mesh(group, None).group_name
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return _resolve_mesh(*group).group_name
    if isinstance(group, tuple):
        return _resolve_rank_lists(group).group_name
    raise TypeError(
        f"group: expected a group name, ProcessGroup, rank list, 2-D rank list, DeviceMesh "
        f"or (DeviceMesh, dim), got {type(group).__name__} [FC-13]")


@torch.compiler.assume_constant_result
def group_size(group_name: str) -> int:
    """Number of ranks in a named group."""
    return _process_group(group_name).size()


def _group_size_of(group_name: str, group_size: int, arg: str = "group_size") -> dist.ProcessGroup:
    pg = _process_group(group_name)
    if group_size != pg.size():
        raise ValueError(f"{arg}: {group_size} does not match the size {pg.size()} of group "
                         f"{group_name!r} [FC-19]")
    return pg


# --------------------------------------------------------------------------------------
# Work registry (FC-6 .. FC-8)
# --------------------------------------------------------------------------------------
# data_ptr -> (version, work). The pointer is what survives the dispatcher (wrappers
# and views change tensor identity but not storage); the version tells a stale
# finalizer from the owner of a reused address.
_work_registry: dict[int, tuple[int, Any]] = {}
_versions = itertools.count()


class _Completion:
    """A started collective plus what must happen once it finished (e.g. avg's divide),
    and the tensors it reads in flight, referenced until it is waited (FC-29)."""

    __slots__ = ("work", "finish", "reads")

    def __init__(self, work, finish, reads=()):
        self.work, self.finish, self.reads = work, finish, reads

    def wait(self):
        self.work.wait()
        self.finish()
        return True


def _register_work(tensor: torch.Tensor, work) -> None:
    ptr = tensor.data_ptr()
    if ptr == 0:
        # A tensor without storage has no address to key the registry: complete now (FC-7).
        work.wait()
        return
    _work_registry[ptr] = (next(_versions), work)


def _wait_and_clear(ptr: int, version: int | None = None) -> None:
    entry = _work_registry.get(ptr)
    if entry is None or (version is not None and entry[0] != version):
        return
    # Clear before waiting, so a failed wait is not waited again by a finalizer.
    del _work_registry[ptr]
    entry[1].wait()


def work_registry_size() -> int:
    """How many results have started but not been waited (FC-6)."""
    return len(_work_registry)


def _finalize_wrapper(wrapper: torch.Tensor, tensor: torch.Tensor) -> None:
    entry = _work_registry.get(tensor.data_ptr())
    if entry is not None:
        # A result dropped unwaited still gets its collective completed (FC-8).
        weakref.finalize(wrapper, _wait_dropped, tensor.data_ptr(), entry[0])


def _wait_dropped(ptr: int, version: int) -> None:
    # Runs inside garbage collection, where an exception would only be printed and lost.
    try:
        _wait_and_clear(ptr, version)
    except Exception as exc:
        warnings.warn(f"refimpl: the collective of a result dropped unwaited failed: {exc} "
                      f"[FC-8]", RuntimeWarning, stacklevel=1)


# --------------------------------------------------------------------------------------
# Eager kernels (FC-2 .. FC-5, FC-19 .. FC-22)
# --------------------------------------------------------------------------------------
def _allreduce_opts(op: str):
    opts = dist.AllreduceOptions()
    opts.reduceOp = _REDUCE_OPS[op]
    return opts


def _start(tensor, work, op="sum", size=1, reads=()):
    """Register `work` as producing `tensor`; avg divides the sum once it is done (FC-18).

    `reads`: the input tensors the collective communicates, kept referenced until it is
    waited, whether or not the process group copied them (gloo's reduce_scatter does): an
    in-flight collective owns its buffers (FC-29, MEM-5)."""
    if op == "avg" or reads:
        work = _Completion(work, (lambda: tensor.div_(size)) if op == "avg" else _no_finish,
                           tuple(reads))
    _register_work(tensor, work)
    return tensor


def _no_finish():
    return None


def _all_reduce_(tensor, reduce_op, group_name):
    op = _check_reduce_op(reduce_op, tensor.dtype)
    pg = _process_group(group_name)
    if not tensor.is_contiguous():
        raise ValueError("input: all_reduce_ needs a contiguous tensor [FC-4]")
    return _start(tensor, pg.allreduce([tensor], _allreduce_opts(op)), op, pg.size())


def _all_reduce(tensor, reduce_op, group_name):
    _check_reduce_op(reduce_op, tensor.dtype)
    return _all_reduce_(tensor.clone(memory_format=torch.contiguous_format), reduce_op, group_name)


def _all_reduce_coalesced_(tensors, reduce_op, group_name):
    for t in tensors:
        _all_reduce_(t, reduce_op, group_name)
    return tensors


def _all_reduce_coalesced(tensors, reduce_op, group_name):
    for t in tensors:
        _check_reduce_op(reduce_op, t.dtype)
    return [_all_reduce(t, reduce_op, group_name) for t in tensors]


def _gathered_shape(shape, group_size):
    if len(shape) == 0:
        raise ValueError("input: all_gather needs at least one dim [FC-20]")
    return [shape[0] * group_size, *shape[1:]]


def _all_gather_into_tensor_out(tensor, group_size, group_name, *, out):
    pg = _group_size_of(group_name, group_size)
    expected = _gathered_shape(tensor.shape, group_size)
    if list(out.shape) != expected or out.dtype != tensor.dtype or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous {tensor.dtype} tensor of shape "
                         f"{expected}, got {out.dtype} {list(out.shape)} [FC-20]")
    return _start(out, pg._allgather_base(out, tensor.contiguous()), reads=(tensor,))


def _all_gather_into_tensor(tensor, group_size, group_name):
    _group_size_of(group_name, group_size)
    out = tensor.new_empty(_gathered_shape(tensor.shape, group_size))
    return _all_gather_into_tensor_out(tensor, group_size, group_name, out=out)


def _all_gather_into_tensor_coalesced(tensors, group_size, group_name):
    return [_all_gather_into_tensor(t, group_size, group_name) for t in tensors]


def _scattered_shape(shape, group_size):
    if len(shape) == 0 or shape[0] % group_size != 0:
        raise ValueError(f"input: reduce_scatter needs dim 0 divisible by the group size "
                         f"{group_size}, got shape {list(shape)} [FC-20]")
    return [shape[0] // group_size, *shape[1:]]


def _reduce_scatter_tensor(tensor, reduce_op, group_size, group_name):
    op = _check_reduce_op(reduce_op, tensor.dtype)
    pg = _group_size_of(group_name, group_size)
    out = tensor.new_empty(_scattered_shape(tensor.shape, group_size))
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = _REDUCE_OPS[op]
    return _start(out, pg._reduce_scatter_base(out, tensor.contiguous(), opts), op, group_size,
                  reads=(tensor,))


def _reduce_scatter_tensor_coalesced(tensors, reduce_op, group_size, group_name):
    for t in tensors:
        _check_reduce_op(reduce_op, t.dtype)
        _scattered_shape(t.shape, group_size)
    return [_reduce_scatter_tensor(t, reduce_op, group_size, group_name) for t in tensors]


def _check_splits(splits, size, group_size, arg):
    if len(splits) == 0:
        if size % group_size:
            raise ValueError(f"{arg}: empty splits need dim 0 ({size}) divisible by the group "
                             f"size {group_size} [FC-21]")
        return
    if len(splits) != group_size or any(s < 0 for s in splits) or sum(splits) != size:
        raise ValueError(f"{arg}: need {group_size} non-negative sizes summing to {size}, got "
                         f"{list(splits)} [FC-21]")


def _a2a_output_rows(tensor, output_split_sizes):
    if tensor.dim() == 0:
        raise ValueError("input: all_to_all_single needs at least one dim [FC-21]")
    return sum(output_split_sizes) if len(output_split_sizes) else tensor.shape[0]


def _all_to_all_single(tensor, output_split_sizes, input_split_sizes, group_name):
    pg = _process_group(group_name)
    n = pg.size()
    rows = _a2a_output_rows(tensor, output_split_sizes)
    _check_splits(input_split_sizes, tensor.shape[0], n, "input_split_sizes")
    _check_splits(output_split_sizes, rows, n, "output_split_sizes")
    out = tensor.new_empty([rows, *tensor.shape[1:]])
    work = pg.alltoall_base(out, tensor.contiguous(), list(output_split_sizes),
                            list(input_split_sizes), dist.AllToAllOptions())
    return _start(out, work, reads=(tensor,))


def _check_src(src, group_name) -> int:
    # `src` is a rank *within the group*, as upstream's c10d_functional kernels take it
    # (torch.distributed.broadcast takes a global rank instead).
    size = group_size(group_name)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < size:
        raise ValueError(f"src: {src!r} is not a group rank of group {group_name!r} of size "
                         f"{size} (src counts ranks within the group) [FC-22]")
    return src


def _broadcast_(tensor, src, group_name):
    pg = _process_group(group_name)
    opts = dist.BroadcastOptions()
    opts.rootRank = _check_src(src, group_name)
    if not tensor.is_contiguous():
        raise ValueError("input: broadcast_ needs a contiguous tensor [FC-4]")
    return _start(tensor, pg.broadcast([tensor], opts))


def _broadcast(tensor, src, group_name):
    _check_src(src, group_name)
    return _broadcast_(tensor.clone(memory_format=torch.contiguous_format), src, group_name)


def _wait_tensor(tensor):
    _wait_and_clear(tensor.data_ptr())
    return tensor


def _wait_tensor_op(tensor):
    # The op returns a copy, never its input (FC-5): functionalization treats a custom op's
    # result as a fresh tensor, and AOTAutograd refuses custom ops whose results alias
    # their inputs (an error under CI=1 in torch 2.13, announced as the future default).
    # Upstream's own namespace is exempt from that check; refimpl's is not.
    return _wait_tensor(tensor).clone()


# --------------------------------------------------------------------------------------
# wait_tensor_ (FC-28): the wait of lowered programs, completing its argument in place.
# Lowered graphs run as they are (AOTAutograd never re-traces them), so their wait may
# return its input, as upstream Inductor's wait kernel does; a wait then costs no memory
# (MEM-4). Traced programs keep the copying `wait_tensor` (FC-5).
# --------------------------------------------------------------------------------------
_lib.define("wait_tensor_(Tensor(a!) tensor) -> Tensor(a!)")


def _wait_tensor_inplace(tensor):
    return _wait_tensor(tensor)


for _key in ("CPU", "CUDA"):
    _lib.impl("wait_tensor_", _wait_tensor_inplace, _key)


@torch.library.register_fake(f"{LIBRARY}::wait_tensor_", lib=_lib)
def _(tensor):
    return tensor


_EAGER_KERNELS = {
    "all_reduce": _all_reduce, "all_reduce_": _all_reduce_,
    "all_reduce_coalesced": _all_reduce_coalesced,
    "all_reduce_coalesced_": _all_reduce_coalesced_,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "all_gather_into_tensor_coalesced": _all_gather_into_tensor_coalesced,
    "all_gather_into_tensor_out": _all_gather_into_tensor_out,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "reduce_scatter_tensor_coalesced": _reduce_scatter_tensor_coalesced,
    "all_to_all_single": _all_to_all_single,
    "broadcast": _broadcast, "broadcast_": _broadcast_,
    "wait_tensor": _wait_tensor_op,
}
for _name, _kernel in _EAGER_KERNELS.items():
    _lib.impl(_name, _kernel, "CPU")
    _lib.impl(_name, _kernel, "CUDA")


# --------------------------------------------------------------------------------------
# Fake kernels (FC-3): shapes only, with the same argument checks as eager.
# --------------------------------------------------------------------------------------
def _fake(name):
    return torch.library.register_fake(f"{LIBRARY}::{name}", lib=_lib)


@_fake("all_reduce")
def _(tensor, reduce_op, group_name):
    _check_reduce_op(reduce_op, tensor.dtype)
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


@_fake("all_reduce_")
def _(tensor, reduce_op, group_name):
    _check_reduce_op(reduce_op, tensor.dtype)
    return tensor


@_fake("all_reduce_coalesced")
def _(tensors, reduce_op, group_name):
    for t in tensors:
        _check_reduce_op(reduce_op, t.dtype)
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]


@_fake("all_reduce_coalesced_")
def _(tensors, reduce_op, group_name):
    for t in tensors:
        _check_reduce_op(reduce_op, t.dtype)
    return tensors


@_fake("all_gather_into_tensor")
def _(tensor, group_size, group_name):
    return tensor.new_empty(_gathered_shape(tensor.shape, group_size))


@_fake("all_gather_into_tensor_coalesced")
def _(tensors, group_size, group_name):
    return [t.new_empty(_gathered_shape(t.shape, group_size)) for t in tensors]


@_fake("all_gather_into_tensor_out")
def _(tensor, group_size, group_name, *, out):
    return out


@_fake("reduce_scatter_tensor")
def _(tensor, reduce_op, group_size, group_name):
    _check_reduce_op(reduce_op, tensor.dtype)
    return tensor.new_empty(_scattered_shape(tensor.shape, group_size))


@_fake("reduce_scatter_tensor_coalesced")
def _(tensors, reduce_op, group_size, group_name):
    for t in tensors:
        _check_reduce_op(reduce_op, t.dtype)
    return [t.new_empty(_scattered_shape(t.shape, group_size)) for t in tensors]


@_fake("all_to_all_single")
def _(tensor, output_split_sizes, input_split_sizes, group_name):
    rows = _a2a_output_rows(tensor, output_split_sizes)
    return tensor.new_empty([rows, *tensor.shape[1:]])


@_fake("broadcast")
def _(tensor, src, group_name):
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


@_fake("broadcast_")
def _(tensor, src, group_name):
    return tensor


@_fake("wait_tensor")
def _(tensor):
    return torch.empty_like(tensor)


# --------------------------------------------------------------------------------------
# Autograd (FC-23 .. FC-25). Backward collectives run on the same group and are waited
# at once: the autograd engine hands their results straight to the next node.
# --------------------------------------------------------------------------------------
def _check_differentiable(reduce_op: str, what: str) -> str:
    op = reduce_op.lower()
    if op not in DIFFERENTIABLE_REDUCE_OPS:
        raise RuntimeError(f"reduce_op: {what} with {reduce_op!r} has no gradient; only "
                           f"{DIFFERENTIABLE_REDUCE_OPS} are differentiable [FC-24]")
    return op


def _check_grad_before_issue(tensor: torch.Tensor, reduce_op: str, what: str) -> None:
    """The Python API refuses before communicating (FC-24, FC-27)."""
    if tensor.requires_grad and torch.is_grad_enabled():
        _check_differentiable(reduce_op, what)


def _setup_reduction(ctx, output, reduce_op, what):
    try:
        ctx.reduce_op = _check_differentiable(reduce_op, what)
    except RuntimeError:
        # A direct op call gets here after the collective started: finish it, so the
        # group stays in step, then refuse.
        _wait_tensor(output)
        raise


def _setup_all_reduce(ctx, inputs, output):
    _setup_reduction(ctx, output, inputs[1], "all_reduce")
    ctx.group_name = inputs[2]


def _backward_all_reduce(ctx, grad):
    # d(sum_j x_j)/dx_i = 1 on every rank, so the gradient is the sum of the gradients
    # of every rank's output; avg scales the same sum by 1/size.
    g = _waited(ops.all_reduce(grad.contiguous(), ctx.reduce_op, ctx.group_name))
    return g, None, None


def _setup_all_gather(ctx, inputs, output):
    ctx.group_size, ctx.group_name = inputs[1], inputs[2]


def _backward_all_gather(ctx, grad):
    g = ops.reduce_scatter_tensor(grad.contiguous(), "sum", ctx.group_size, ctx.group_name)
    return _waited(g), None, None


def _setup_reduce_scatter(ctx, inputs, output):
    _setup_reduction(ctx, output, inputs[1], "reduce_scatter_tensor")
    ctx.group_size, ctx.group_name = inputs[2], inputs[3]


def _backward_reduce_scatter(ctx, grad):
    g = _waited(ops.all_gather_into_tensor(grad.contiguous(), ctx.group_size,
                                           ctx.group_name))
    if ctx.reduce_op == "avg":
        g = g / ctx.group_size
    return g, None, None, None


def _setup_all_to_all(ctx, inputs, output):
    ctx.output_split_sizes, ctx.input_split_sizes, ctx.group_name = inputs[1:4]


def _backward_all_to_all(ctx, grad):
    # The transpose of an all-to-all is the all-to-all with the splits swapped.
    g = ops.all_to_all_single(grad.contiguous(), ctx.input_split_sizes,
                              ctx.output_split_sizes, ctx.group_name)
    return _waited(g), None, None, None


def _setup_broadcast(ctx, inputs, output):
    ctx.src, ctx.group_name = inputs[1], inputs[2]


def _backward_broadcast(ctx, grad):
    # Only src's value reached the outputs: src gets every rank's gradient, others none.
    g = _waited(ops.all_reduce(grad.contiguous(), "sum", ctx.group_name))
    is_src = _process_group(ctx.group_name).rank() == ctx.src
    return (g if is_src else torch.zeros_like(g)), None, None


def _backward_wait(ctx, grad):
    return grad


def _setup_nothing(ctx, inputs, output):
    return None


_AUTOGRAD = {
    "all_reduce": (_backward_all_reduce, _setup_all_reduce),
    "all_gather_into_tensor": (_backward_all_gather, _setup_all_gather),
    "reduce_scatter_tensor": (_backward_reduce_scatter, _setup_reduce_scatter),
    "all_to_all_single": (_backward_all_to_all, _setup_all_to_all),
    "broadcast": (_backward_broadcast, _setup_broadcast),
    "wait_tensor": (_backward_wait, _setup_nothing),
}
for _name, (_backward, _setup) in _AUTOGRAD.items():
    torch.library.register_autograd(f"{LIBRARY}::{_name}", _backward, setup_context=_setup,
                                    lib=_lib)


# --------------------------------------------------------------------------------------
# AsyncCollectiveTensor (FC-9 .. FC-11)
# --------------------------------------------------------------------------------------
_VIEW_OPS = frozenset({
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default, torch.ops.aten.t.default,
    torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
    torch.ops.aten.select.int, torch.ops.aten.slice.Tensor,
    torch.ops.aten.narrow.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.chunk.default, torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.default,
    torch.ops.aten.expand.default, torch.ops.aten.alias.default,
    torch.ops.aten.detach.default, torch.ops.aten.unbind.int,
    torch.ops.aten.as_strided.default, torch.ops.aten.flatten.using_ints,
})


class AsyncCollectiveTensor(torch.Tensor):
    """The eager result of a functional collective: waits on first use (FC-9).

    Any op on it other than a view waits for the collective and then runs on the plain
    result, which is what it returns. View ops return another AsyncCollectiveTensor that
    shares the pending collective and does not wait (FC-10). `.wait()` waits explicitly
    and returns the plain tensor (FC-11).
    """

    elem: torch.Tensor
    __slots__ = ("elem", "pending", "completed")
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor, pending: torch.Tensor | None = None):
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, layout=elem.layout, device=elem.device, requires_grad=False)
        r.elem = elem
        # `pending` is the tensor whose data_ptr keys the work: for a view, its base.
        r.pending = elem if pending is None else pending
        r.completed = False
        return r

    def __repr__(self, *, tensor_contents=None):
        return f"AsyncCollectiveTensor({self.trigger_wait()})"

    def trigger_wait(self) -> torch.Tensor:
        if not self.completed:
            _wait_and_clear(self.pending.data_ptr())
            self.completed = True
        return self.elem

    def wait(self) -> torch.Tensor:
        return self.trigger_wait()

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return AsyncCollectiveTensor(inner_tensors["elem"])

    def numpy(self):
        return self.wait().numpy()

    def tolist(self):
        return self.wait().tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEW_OPS:
            return cls._view(func, args, kwargs)
        args = tree_map_only(AsyncCollectiveTensor, AsyncCollectiveTensor.trigger_wait, args)
        kwargs = tree_map_only(AsyncCollectiveTensor, AsyncCollectiveTensor.trigger_wait, kwargs)
        return func(*args, **kwargs)

    @classmethod
    def _view(cls, func, args, kwargs):
        source = args[0]
        if source.completed:
            return func(source.elem, *args[1:], **kwargs)
        out = func(source.elem, *args[1:], **kwargs)
        return tree_map_only(torch.Tensor, lambda v: cls(v, source.pending), out)


class _WrapWithGrad(torch.autograd.Function):
    """Lets gradients flow from an AsyncCollectiveTensor back into the op's graph."""

    @staticmethod
    def forward(ctx, tensor):
        return AsyncCollectiveTensor(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _are_we_tracing() -> bool:
    """True under torch.compile, make_fx, FakeTensorMode or functionalization (FC-12)."""
    if torch.compiler.is_compiling():
        return True
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return True
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None:
        return True
    return torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)


def _waited(tensor: torch.Tensor) -> torch.Tensor:
    """The completed `tensor`: the op when tracing, so the graph shows the wait (FC-12);
    in eager `tensor` itself, with no copy (FC-5)."""
    return ops.wait_tensor(tensor) if _are_we_tracing() else _wait_tensor(tensor)


def _wrap(tensor: torch.Tensor) -> torch.Tensor:
    if _are_we_tracing():
        return ops.wait_tensor(tensor)
    if tensor.requires_grad and torch.is_grad_enabled():
        wrapper = _WrapWithGrad.apply(tensor)
    else:
        wrapper = AsyncCollectiveTensor(tensor)
    _finalize_wrapper(wrapper, tensor)
    return wrapper


def _then(tensor: torch.Tensor, shape, rearrange) -> torch.Tensor:
    """A result `rearrange(waited tensor)`: eager stays asynchronous, tracing is explicit."""
    if _are_we_tracing() or (tensor.requires_grad and torch.is_grad_enabled()):
        # Traced: the wait is explicit in the graph. Recording autograd: the rearranging
        # ops must be recorded too, so the result is completed here (FC-25).
        return rearrange(_waited(tensor))
    out = tensor.new_empty(shape)

    def finish():
        with torch.no_grad():
            out.copy_(rearrange(_wait_tensor(tensor)))

    _register_work(out, _Completion(_DONE, finish))
    return _wrap(out)


class _Done:
    def wait(self):
        return True


_DONE = _Done()


# --------------------------------------------------------------------------------------
# Python API, upstream's names (FC-12 .. FC-16, FC-20)
# --------------------------------------------------------------------------------------
def _dim(dim: int, ndim: int, arg: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"{arg}: {dim!r} is not a dim of a {ndim}-d tensor [FC-20]")
    return dim % ndim


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Wait for the collective that produces `tensor`; in eager, return `tensor` (FC-5)."""
    if isinstance(tensor, AsyncCollectiveTensor):
        return tensor.wait()
    return _waited(tensor)


def all_reduce(self: torch.Tensor, reduceOp: str, group: RankTypes, tag: str = ""):
    """Reduce `self` over `group`; every rank gets the result. The input is unchanged."""
    _check_grad_before_issue(self, reduceOp, "all_reduce")
    return _wrap(ops.all_reduce(self, reduceOp, resolve_group_name(group, tag)))


def all_gather_tensor(self: torch.Tensor, gather_dim: int, group: RankTypes, tag: str = ""):
    """Concatenate every rank's `self` along `gather_dim`, in group-rank order (FC-14)."""
    name = resolve_group_name(group, tag)
    n = group_size(name)
    dim = _dim(gather_dim, self.dim(), "gather_dim")
    gathered = ops.all_gather_into_tensor(self.contiguous(), n, name)
    if dim == 0:
        return _wrap(gathered)
    shape = list(self.shape)
    shape[dim] *= n
    return _then(gathered, shape, lambda t: torch.cat(torch.chunk(t, n, dim=0), dim=dim))


def _scatter_dim_to_front(self: torch.Tensor, scatter_dim: int, n: int) -> torch.Tensor:
    dim = _dim(scatter_dim, self.dim(), "scatter_dim")
    if self.shape[dim] % n:
        raise ValueError(f"scatter_dim: size {self.shape[dim]} of dim {dim} is not divisible "
                         f"by the group size {n} [FC-20]")
    if dim == 0:
        return self.contiguous()
    # Lay the chunks of `dim` one after another on dim 0, so that the reduce_scatter on
    # dim 0 hands rank i exactly chunk i of `dim`.
    return torch.cat(torch.chunk(self, n, dim=dim), dim=0)


def reduce_scatter_tensor(self: torch.Tensor, reduceOp: str, scatter_dim: int,
                          group: RankTypes, tag: str = ""):
    """Reduce over `group`, then give group rank i chunk i of `scatter_dim` (FC-14)."""
    name = resolve_group_name(group, tag)
    n = group_size(name)
    _check_reduce_op(reduceOp, self.dtype)
    _check_grad_before_issue(self, reduceOp, "reduce_scatter_tensor")
    return _wrap(ops.reduce_scatter_tensor(_scatter_dim_to_front(self, scatter_dim, n),
                                           reduceOp, n, name))


def all_to_all_single(self: torch.Tensor, output_split_sizes: list[int] | None,
                      input_split_sizes: list[int] | None, group: RankTypes, tag: str = ""):
    """Send split i of dim 0 to group rank i; receive split j from group rank j.

    A split list given as None means equal splits, which are written out explicitly.
    """
    name = resolve_group_name(group, tag)
    # Equal splits are written out, so a traced graph states every size it moves.
    n = group_size(name)
    if output_split_sizes is None or input_split_sizes is None:
        _check_splits([], self.shape[0] if self.dim() else 0, n, "input_split_sizes")
    equal = [self.shape[0] // n] * n if self.dim() else []
    outs = equal if output_split_sizes is None else list(output_split_sizes)
    ins = equal if input_split_sizes is None else list(input_split_sizes)
    return _wrap(ops.all_to_all_single(self, outs, ins, name))


def broadcast(self: torch.Tensor, src: int, group: RankTypes, tag: str = ""):
    """Every rank gets the value of group rank `src` (a rank within `group`, FC-22)."""
    return _wrap(ops.broadcast(self, src, resolve_group_name(group, tag)))


def all_reduce_coalesced(self: list[torch.Tensor], reduceOp: str, group: RankTypes,
                         tag: str = "") -> list[torch.Tensor]:
    """`all_reduce` of each tensor of the list, started together."""
    results = ops.all_reduce_coalesced(list(self), reduceOp, resolve_group_name(group, tag))
    return [_wrap(t) for t in results]


def all_gather_into_tensor_coalesced(self: list[torch.Tensor], group: RankTypes,
                                     tag: str = "") -> list[torch.Tensor]:
    """All-gather on dim 0 of each tensor of the list, started together."""
    name = resolve_group_name(group, tag)
    results = ops.all_gather_into_tensor_coalesced(
        [t.contiguous() for t in self], group_size(name), name)
    return [_wrap(t) for t in results]


def reduce_scatter_tensor_coalesced(inputs: list[torch.Tensor], reduceOp: str,
                                    scatter_dim: list[int], group: RankTypes,
                                    tag: str = "") -> list[torch.Tensor]:
    """`reduce_scatter_tensor` of each tensor along its own scatter dim, started together."""
    if len(scatter_dim) != len(inputs):
        raise ValueError(f"scatter_dim: need one dim per input ({len(inputs)}), got "
                         f"{len(scatter_dim)} [FC-20]")
    name = resolve_group_name(group, tag)
    n = group_size(name)
    fronted = [_scatter_dim_to_front(t, d, n) for t, d in zip(inputs, scatter_dim, strict=True)]
    return [_wrap(t) for t in ops.reduce_scatter_tensor_coalesced(fronted, reduceOp, n, name)]
