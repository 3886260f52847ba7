"""Functional collectives: out-of-place, traceable collective ops with an explicit wait.

Every collective is an operator of the `refimpl_c10d` library whose result is a fresh
tensor that is *not ready* until `wait_tensor` is called on it (FC-1..FC-5). In eager
mode the op starts the collective asynchronously through the one ProcessGroup method
upstream's kernel calls, with its options (so any ProcessGroup works, one written in
Python included, FC-34, FC-50) and records the pending work under the
result's storage (its base address) with a version number; `wait_tensor` waits and clears the entry
(FC-6..FC-8). The Python API wraps eager results in `AsyncCollectiveTensor`, which
waits on first use by any op except views (FC-9..FC-11), and under tracing emits the op
followed by its `wait_tensor` (FC-12). Groups can be named in every form upstream accepts
(FC-13..FC-16, FC-31); reductions, sizes and dims are checked before any communication,
by one check function per op that its eager and fake kernels both call (FC-3,
FC-17..FC-22, FC-27, FC-30). Optionally, every rank compares a fingerprint of each call
with its peers before communicating (FC-28); a peer that fails during a wait is named
(FC-29). Coalesced forms are lists of single ops (FC-26). Autograd formulas pair
all_gather with reduce_scatter (FC-23..FC-25, FC-32); no graph pass may drop an op (FC-33).
Lowered programs wait with `wait_tensor_`, in place (FC-35); an in-flight collective keeps
its inputs referenced until it is waited (FC-36). A group written in Python that leaves
a method to c10d's base class is served by the backend it registered, as c10d's method
serves it, without the GIL c10d's trampoline holds (FC-51). Point-to-point ops (`isend`,
`irecv`, `batch_p2p_ops`) name one peer by its group rank and are issued without blocking;
with checks on, each pair is compared at its wait and a pair that does not match is
named on both ranks instead of hanging (FC-52, FC-53).

Each op has one block below: its schema, its checks, its eager kernel, its fake kernel,
its autograd formula and its Python API, in that order.

torch 2.15's names (`all_gather_single`, ..., `wait_tensors`) sit beside the older ones
(FC-37).

Implements SPEC.md section "Functional collectives": FC-1 .. FC-53.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map_only

from refimpl._errors import expected_got, refuse, require_type

__all__ = [
    "AsyncCollectiveTensor", "all_reduce", "all_reduce_coalesced", "all_gather_tensor",
    "all_gather_tensor_autograd", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
    "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all_single_autograd",
    "broadcast", "wait_tensor", "wait_tensors", "all_gather_single", "reduce_scatter_single",
    "all_gather_single_coalesced", "reduce_scatter_single_coalesced", "isend", "irecv",
    "batch_p2p_ops", "resolve_group_name",
    "group_ranks", "group_size",
    "work_registry_size", "set_collective_checks", "collective_checks_enabled",
    "CollectiveMismatch", "PeerTimeout", "PeerFailure", "LIBRARY", "SCHEMAS",
]

LIBRARY = "refimpl_c10d"
_lib = torch.library.Library(LIBRARY, "DEF")
ops = getattr(torch.ops, LIBRARY)
SCHEMAS: dict[str, str] = {}  # op name -> schema, filled by `_define` (FC-1)


class CollectiveMismatch(ValueError):
    """The ranks of a group called a collective with different arguments (FC-28)."""


class PeerTimeout(RuntimeError):
    """A peer did not arrive within the bounded time (FC-28, FC-31)."""


class PeerFailure(RuntimeError):
    """The backend failed while a collective ran: a peer died or never came (FC-29)."""


# --------------------------------------------------------------------------------------
# Reductions (FC-17, FC-18, FC-24)
# --------------------------------------------------------------------------------------
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,  # avg = sum, then / size
    "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
}
_BITWISE = ("band", "bor", "bxor")
DIFFERENTIABLE_REDUCE_OPS = ("sum", "avg")  # reduce_scatter_tensor's (FC-24)
# all_reduce's: min and max too, their gradient going to the extremum's holders (FC-23)
_EXTREMA = ("min", "max")
DIFFERENTIABLE_ALL_REDUCE_OPS = DIFFERENTIABLE_REDUCE_OPS + _EXTREMA


def _floating(dtype: torch.dtype) -> bool:
    """Floating or complex: the dtypes avg and premul_sum take (FC-18)."""
    return dtype.is_floating_point or dtype.is_complex


def _check_reduce_op(reduce_op: str, dtype: torch.dtype) -> str:
    """Normalize a reduce op name and check it fits the dtype (FC-17, FC-18)."""
    if not isinstance(reduce_op, str) or reduce_op.lower() not in _REDUCE_OPS:
        refuse("reduce_op", f"one of {sorted(_REDUCE_OPS)} as a str (case-insensitive) or "
               f"a torch.distributed.ReduceOp",
               f"{reduce_op!r} of type {type(reduce_op).__name__}", "FC-17")
    op = reduce_op.lower()
    floating = _floating(dtype)
    if op == "avg" and not floating:
        refuse("reduce_op", "a floating dtype for 'avg'", dtype, "FC-18")
    if op in _BITWISE and floating:
        refuse("reduce_op", f"an integer or bool dtype for {op!r}", dtype, "FC-18")
    return op


# torch.distributed.ReduceOp values the Python API takes for a reduction of that name
# (FC-17): upstream's functional collectives take them from torch 2.15 on.
_REDUCE_OP_NAMES = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor",
}


def _reduction(reduce_op, tensors) -> tuple[object, object]:
    """What the Python API asks the op for, and the factor to multiply the inputs by first
    (None but for premul_sum): a `str` as it is; a `ReduceOp` by its name; a premul_sum
    `ReduceOp` (`torch.distributed._make_nccl_premul_sum(factor)`) as "sum" after the
    inputs are multiplied by its factor on this rank (FC-17, FC-18)."""
    kind = getattr(reduce_op, "op", reduce_op)  # a ReduceOp object, or a RedOpType
    if isinstance(reduce_op, str) or not isinstance(kind, dist.ReduceOp.RedOpType):
        return reduce_op, None  # _check_reduce_op refuses anything else but a str
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = _premul_factor(reduce_op)
        for t in tensors:
            if not _floating(t.dtype):
                refuse("reduce_op", "a floating dtype for premul_sum", t.dtype, "FC-18")
        return "sum", factor
    if kind not in _REDUCE_OP_NAMES:
        refuse("reduce_op", f"one of {sorted(set(_REDUCE_OP_NAMES.values()))} as a ReduceOp, "
               f"or premul_sum with a factor", kind, "FC-17")
    return _REDUCE_OP_NAMES[kind], None


def _premul_factor(reduce_op):
    """The factor of a premul_sum ReduceOp: a real number or a real one-element tensor.
    Read from its pickled state, `(op, factor)` on every release from 2.11 (a `factor`
    attribute came later); the bare `ReduceOp.PREMUL_SUM` pickles as a number."""
    state = reduce_op.__getstate__() if isinstance(reduce_op, dist.ReduceOp) else None
    factor = state[1] if isinstance(state, tuple) else None
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1 or not factor.dtype.is_floating_point:
            refuse("reduce_op", "a premul_sum factor of one floating element",
                   f"a {factor.dtype} tensor of shape {list(factor.shape)}", "FC-17")
        return factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        refuse("reduce_op", "premul_sum made by torch.distributed._make_nccl_premul_sum("
               "factor)", "ReduceOp.PREMUL_SUM without a factor", "FC-17")
    return factor


def _premultiplied(tensor: torch.Tensor, factor) -> torch.Tensor:
    """This rank's share of a premul_sum: its input times the factor, in its dtype."""
    return tensor if factor is None else (tensor * factor).to(tensor.dtype)


def _differentiable(what: str) -> tuple[str, ...]:
    return DIFFERENTIABLE_ALL_REDUCE_OPS if what == "all_reduce" else DIFFERENTIABLE_REDUCE_OPS


def _check_differentiable(reduce_op: str, what: str) -> str:
    op = reduce_op.lower()
    if op not in _differentiable(what):
        refuse("reduce_op", f"one of {_differentiable(what)}, the differentiable ones",
               f"{reduce_op!r}, with which {what} has no gradient", "FC-24", RuntimeError)
    return op


def _check_grad_before_issue(tensor: torch.Tensor, reduce_op: str, what: str) -> None:
    """The Python API refuses a non-differentiable reduction before communicating (FC-24)."""
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


# --------------------------------------------------------------------------------------
# Tensors (FC-4, FC-20, FC-30)
# --------------------------------------------------------------------------------------
def _check_has_data(tensor: torch.Tensor, arg: str) -> None:
    """An eager collective needs data to send: a meta tensor has none (FC-30).

    Tracing runs the fake kernels on FakeTensors (meta underneath), which are fine."""
    if tensor.device.type == "meta" and not isinstance(tensor, FakeTensor) \
            and not _are_we_tracing():
        refuse(arg, "a tensor with data (an eager collective sends it)",
               "a tensor on the meta device", "FC-30")


def _check_contiguous(tensor: torch.Tensor, arg: str, op: str) -> None:
    """The eager kernel of an in-place op writes through the backend into its argument.
    Fake kernels do not ask: lowering turns an in-place op on a non-contiguous view into
    a clone and a copy back (CL-4), so a traced graph may hold one (FC-3, FC-4)."""
    if not tensor.is_contiguous():
        refuse(arg, f"a contiguous tensor ({op} writes into its argument)",
               f"strides {list(tensor.stride())} for shape {list(tensor.shape)}", "FC-4")


def _check_has_dims(tensor: torch.Tensor, arg: str, op: str, rule: str = "FC-20") -> None:
    if tensor.dim() == 0:
        refuse(arg, f"a tensor of at least one dim for {op}", "a 0-d tensor", rule)


def _dim(dim: int, ndim: int, arg: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        refuse(arg, f"a dim of a {ndim}-d tensor, an int with {-ndim} <= {arg} < {ndim}",
               repr(dim), "FC-20")
    return dim % ndim


# --------------------------------------------------------------------------------------
# Groups (FC-13 .. FC-16, FC-19, FC-31)
# --------------------------------------------------------------------------------------
# A group name, a ProcessGroup, ranks, rows of ranks, a DeviceMesh or (DeviceMesh, dim).
RankTypes = Any
_groups_by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _process_group(group_name: str) -> dist.ProcessGroup:
    require_type(group_name, str, "group_name", "a str", "FC-13")
    try:
        return c10d._resolve_process_group(group_name)
    except Exception as exc:
        raise ValueError(expected_got(
            "group_name", "the name of a registered process group",
            f"{group_name!r}, as which no process group is registered", "FC-13")) from exc


def group_ranks(group_name: str) -> list[int]:
    """Global ranks of a named group, in group-rank order (ascending, FC-14)."""
    return dist.get_process_group_ranks(_process_group(group_name))


def _check_group_size(group_name: str, group_size: int) -> dist.ProcessGroup:
    """The named group, whose size must be `group_size` (FC-19)."""
    pg = _process_group(group_name)
    if group_size != pg.size():
        refuse("group_size", f"the size {pg.size()} of group {group_name!r}", group_size,
               "FC-19")
    return pg


def _check_rank_list(ranks, arg: str = "group") -> tuple[int, ...]:
    if not ranks:
        refuse(arg, "a non-empty rank list", "an empty rank list", "FC-15")
    world = dist.get_world_size()
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int):
            refuse(arg, "ranks that are ints", repr(r), "FC-15", TypeError)
        if not 0 <= r < world:
            refuse(arg, f"ranks in 0..{world - 1}", f"rank {r}, outside the world of size {world}",
                   "FC-15")
    if len(set(ranks)) != len(ranks):
        refuse(arg, "distinct ranks", f"duplicate ranks in {list(ranks)}", "FC-15")
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
    # Local synchronization: only the members make the group, so a rank list names a
    # group without every other rank having to join in (FC-15). The members first agree
    # that they all asked for this list, so a disagreement ends in an error (FC-31).
    #
    # Not dist.new_group(ranks, use_local_synchronization=True): torch names such a group
    # by the hash of its ranks alone, and its backend meets its peers through store keys
    # under that name. Made again after the first was destroyed, the group would find the
    # destroyed one's addresses there and connect to closed sockets. A name of its own
    # for each request (the list and how often its members asked for it) keeps every
    # group's rendezvous apart; c10d has no public call that takes a name.
    request = _agree_on_group(ranks)
    default_pg = c10d._get_default_group()
    backend, store = c10d._world.pg_map[default_pg]
    pg, _ = c10d._new_process_group_helper(
        len(ranks), ranks.index(dist.get_rank()), list(ranks), backend, store,
        f"refimpl-ranks-{'-'.join(map(str, ranks))}-request-{request}",
        timeout=c10d._get_default_timeout(backend), device_id=default_pg.bound_device_id)
    c10d._world.pg_group_ranks[pg] = {rank: i for i, rank in enumerate(ranks)}
    return pg


_group_requests: dict[tuple[str, int], int] = {}


def _agree_on_group(ranks: tuple[int, ...]) -> int:
    """Every member of `ranks` must ask for the same list within the peer timeout (FC-31).

    Returns how many times this rank has asked for the list, the same on every member."""
    store, me = c10d._get_default_store(), dist.get_rank()
    wanted = ",".join(map(str, ranks))
    count = _group_requests[(wanted, me)] = _group_requests.get((wanted, me), 0) + 1
    store.set(f"refimpl-fc/group-last/{me}", wanted)
    keys = {r: f"refimpl-fc/group/{wanted}/{count}/{r}" for r in ranks}
    store.set(keys[me], "1")
    timeout_s = _peer_timeout_s(c10d._get_default_group())  # its store carries the requests
    missing = _missing_peers(store, keys, timeout_s)
    if missing:
        said = "; ".join(f"rank {r} last asked for {_asked(store, r)}" for r in missing)
        raise PeerTimeout(
            f"group: global rank {me} asked for the group of ranks {list(ranks)}, but "
            f"{_ranks_text(missing)} did not ask for it within {timeout_s:g} s ({said}); "
            f"every member must pass the same rank list [FC-31]")
    return count


def _asked(store, rank: int) -> str:
    text = _store_text(store, f"refimpl-fc/group-last/{rank}")
    return f"[{', '.join(text.split(','))}]" if text else "no rank list"


def _resolve_rank_lists(group) -> dist.ProcessGroup:
    me = dist.get_rank()
    if group and all(isinstance(row, (list, tuple)) for row in group):
        sizes = {len(row) for row in group}
        if len(sizes) != 1:
            refuse("group", "rows of a 2-D rank list of equal sizes",
                   f"rows of sizes {[len(row) for row in group]}", "FC-15")
        _check_rank_list([r for row in group for r in row])
        mine = [row for row in group if me in row]
        if not mine:
            refuse("group", f"a 2-D rank list with a row holding rank {me}",
                   f"{group}, where rank {me} is in no row", "FC-15")
        return _group_of_ranks(tuple(sorted(mine[0])))
    ranks = _check_rank_list(list(group))
    if me not in ranks:
        refuse("group", f"a rank list holding rank {me}",
               f"{list(group)}, where rank {me} is not in the rank list", "FC-15")
    return _group_of_ranks(ranks)


def _resolve_mesh(mesh, dim) -> dist.ProcessGroup:
    if dim is None:
        if mesh.ndim != 1:
            refuse("group", "a 1-D DeviceMesh, or (mesh, dim)",
                   f"a DeviceMesh of {mesh.ndim} dims without a dim", "FC-16")
        dim = 0
    if isinstance(dim, bool) or not isinstance(dim, (int, str)):
        refuse("group", "a mesh dim that is an int or a dim name", repr(dim), "FC-16")
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


def _assume_constant_result(fn):
    """`torch.compiler.assume_constant_result`, without importing torch._dynamo.

    The decorator imports torch._dynamo (1.4 s of CPU) only to set one attribute; every
    process that imports refimpl, each rank worker included, would pay it. The attribute
    is the one the decorator sets (tests/test_funcol_tracing.py checks it)."""
    fn._dynamo_marked_constant = True
    return fn


# Under torch.compile the name is computed once, at trace time, and baked into the graph
# as a constant: group creation and the registry lookups are not traceable.
@_assume_constant_result
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
    refuse("group", "a group name, ProcessGroup, rank list, 2-D rank list, DeviceMesh or "
           "(DeviceMesh, dim)", type(group).__name__, "FC-13", TypeError)


@_assume_constant_result
def group_size(group_name: str) -> int:
    """Number of ranks in a named group."""
    return _process_group(group_name).size()


# --------------------------------------------------------------------------------------
# Work registry (FC-6 .. FC-8) and peer failures (FC-29)
# --------------------------------------------------------------------------------------
# storage address -> [(version, pending), ...] in registration order. The storage is what
# survives the dispatcher (wrappers and views change tensor identity, and a view at an
# offset its data_ptr, but not its storage): a wait through any view of a result finds
# its work, as upstream's registry keyed by storage does (FC-6). Several results may
# share a storage (an in-place coalesced call on slices of one buffer): a wait completes
# them all. The version tells a stale finalizer from the owner of a reused address.
_work_registry: dict[int, list[tuple[int, Any]]] = {}
_versions = itertools.count()


class _Pending:
    """A started collective (`work`, None when already complete), what must happen once it
    finished (`finish`, e.g. avg's divide), what it was, to name it if it fails, and the
    input tensors it communicates (`reads`), referenced until it is waited (FC-36)."""

    __slots__ = ("work", "finish", "op", "group_name", "reads", "check", "peer")

    def __init__(self, work, finish, op: str, group_name: str, reads=(), *, check=None,
                 peer=None):
        self.work, self.finish, self.op, self.group_name = work, finish, op, group_name
        self.reads = reads
        self.check = check  # a point-to-point op's pair check, with checks on (FC-53)
        self.peer = peer  # a point-to-point op's peer, a global rank (FC-29)

    def wait(self) -> None:
        if self.check is not None:
            check, self.check = self.check, None
            check()
        if self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as exc:
                raise _peer_failure(self.op, self.group_name, exc, self.peer) from exc
        if self.finish is not None:
            self.finish()


def _peer_failure(op: str, group_name: str, exc: BaseException,
                  peer: int | None = None) -> PeerFailure:
    """The backend's error (gloo names neither op, group nor rank) in the caller's terms;
    `peer`: the one peer of a point-to-point op (a global rank)."""
    try:
        ranks = group_ranks(group_name)
    except (ValueError, RuntimeError):
        ranks = []
    me = dist.get_rank() if dist.is_initialized() else -1
    peers = [peer] if peer is not None else [r for r in ranks if r != me]
    # With one peer the failed rank is known; gloo does not say which of several it was.
    who = f"the failed peer is rank {peers[0]}" if len(peers) == 1 else \
        f"the failed peer is one of ranks {peers}"
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return PeerFailure(f"{op} on group {group_name!r} (global ranks {ranks}) failed on rank "
                       f"{me}: {who} ({reason}) [FC-29]")


def _work_key(tensor: torch.Tensor) -> int:
    """The registry's key of a tensor: its storage's base address (FC-6); for a storage
    without one (no bytes), minus the storage's identity, which only a point-to-point
    result is registered under (FC-7)."""
    storage = tensor.untyped_storage()
    return storage.data_ptr() or -storage._cdata


def _register(tensor: torch.Tensor, pending: _Pending, *, pending_if_empty=False):
    """Record `pending` under `tensor`'s storage (FC-6). A tensor without storage has no
    address to key the registry: its collective completes now (FC-7), but for a
    point-to-point op (`pending_if_empty`), which must not block before its peer comes:
    that one is keyed by its storage's identity (FC-52)."""
    key = _work_key(tensor)
    if key < 0 and not pending_if_empty:  # no storage address
        pending.wait()
        return tensor
    _work_registry.setdefault(key, []).append((next(_versions), pending))
    return tensor


def _start(op: str, group_name: str, result: torch.Tensor, communicate, finish=None,
           reads=()):
    """Run `communicate()` (a torch.distributed call with async_op=True) that produces
    `result`, and register it as pending (FC-6). `reads`: the inputs it communicates, kept
    referenced until it is waited whether or not the process group copied them (gloo's
    reduce_scatter does): an in-flight collective owns its buffers (FC-36, MEM-5)."""
    work = _communicate(op, group_name, communicate)
    return _register(result, _Pending(work, finish, op, group_name, tuple(reads)))


def _communicate(op: str, group_name: str, communicate):
    """The work `communicate()` starts; a peer already gone is named (FC-29), other errors
    are the caller's."""
    try:
        return communicate()
    except dist.DistError as exc:
        raise _peer_failure(op, group_name, exc) from exc


class _WaitOnce:
    """A work shared by several results, waited once: gloo's coalesced works copy every
    output again at each wait (upstream finding 4), which would undo a finish (avg's
    divide) already applied to another result."""

    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work

    def wait(self):
        if self.work is not None:
            self.work.wait()
            # The work holds every member's tensors: let go of it, so that a member waited
            # is freed at its own wait, not at the last member's (MEM-5).
            self.work = None


def _start_together(op: str, group_name: str, results: list, communicate, finishes=None,
                    reads=None) -> list:
    """`_start` of one process-group call that produces every tensor of `results` (a
    coalesced method, FC-34): each result is registered with the one work, and with its
    own member's inputs (`reads[i]`), held until it is waited (FC-36, MEM-5)."""
    work = _WaitOnce(_communicate(op, group_name, communicate))
    finishes = finishes or [None] * len(results)
    reads = reads or [()] * len(results)
    return [_register(r, _Pending(work, f, op, group_name, tuple(held)))
            for r, f, held in zip(results, finishes, reads, strict=True)]


def _real_views(tensors) -> list:
    """Complex tensors as their real views, as torch.distributed hands them to a group."""
    return [torch.view_as_real(t) if t.is_complex() else t for t in tensors]


# ---- A group written in Python that leaves a method to its backend (FC-51) -----------
# c10d's trampoline for a ProcessGroup subclassed in Python takes the GIL to look for the
# subclass's override and, finding none, keeps it through c10d's own method down into the
# backend's queue lock. gloo's worker drops each finished work while it holds that lock;
# dropping the last reference to a tensor whose Python object is gone takes the GIL: each
# then waits for the other, for ever (upstream finding 18; torch 2.11 to 2.15). c10d's own
# method hands the call to the backend the group registered for the tensors' device; so
# does refimpl, through the backend's binding, which lets the GIL go.
# The names under which c10d looks for a subclass's override of each method (the new
# name first, since torch 2.13).
_OVERRIDE_NAMES = {
    "allreduce": ("allreduce",),
    "allreduce_coalesced": ("allreduce_coalesced",),
    "allgather_into_tensor_coalesced": ("all_gather_single_coalesced",
                                        "allgather_into_tensor_coalesced"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_single_coalesced",
                                        "reduce_scatter_tensor_coalesced"),
    "alltoall_base": ("all_to_all_single", "alltoall_base"),
    "broadcast": ("broadcast",),
    "send": ("send",),
    "recv": ("recv",),
}


def _backend_serving(pg, method: str, device: torch.device):
    """The backend that serves `pg.<method>` on `device` when `pg` is written in Python and
    leaves `method` to c10d's base class (FC-51); None when the group's own method must be
    called: a group c10d made, an override, or no backend registered for `device` (the
    method then raises c10d's own error)."""
    if type(pg) is dist.ProcessGroup:
        return None
    base, cls = dist.ProcessGroup, type(pg)
    if any(getattr(cls, name, None) is not getattr(base, name, None)
           for name in _OVERRIDE_NAMES[method]):
        return None
    try:
        return pg._get_backend(device)
    except RuntimeError:
        return None


class _Works:
    """The works of one op call that a backend serves one member at a time (FC-51),
    waited in order."""

    __slots__ = ("works",)

    def __init__(self, works):
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def _wait_and_clear(key: int, version: int | None = None) -> None:
    """Wait every work registered under storage `key` (only the one of `version`, for a
    finalizer), in the order they started."""
    entries = _work_registry.get(key)
    if not entries:
        return
    if version is None:
        waiting, kept = entries, []
    else:
        waiting = [e for e in entries if e[0] == version]
        kept = [e for e in entries if e[0] != version]
    # Clear before waiting, so a failed wait is not waited again by a finalizer.
    if kept:
        _work_registry[key] = kept
    else:
        del _work_registry[key]
    for _, pending in waiting:
        pending.wait()


def work_registry_size() -> int:
    """How many results have started but not been waited (FC-6)."""
    return sum(len(entries) for entries in _work_registry.values())


def _finalize_wrapper(wrapper: torch.Tensor, tensor: torch.Tensor) -> None:
    key = _work_key(tensor)
    entries = _work_registry.get(key)
    if entries:
        # A result dropped unwaited still gets its collective completed (FC-8): the one
        # registered last under its storage, its own.
        weakref.finalize(wrapper, _wait_dropped, key, entries[-1][0])


def _wait_dropped(ptr: int, version: int) -> None:
    # Runs inside garbage collection, where an exception would only be printed and lost.
    try:
        _wait_and_clear(ptr, version)
    except Exception as exc:
        warnings.warn(f"refimpl: the collective of a result dropped unwaited failed: {exc} "
                      f"[FC-8]", RuntimeWarning, stacklevel=1)


def _wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    _wait_and_clear(_work_key(tensor))
    return tensor


# --------------------------------------------------------------------------------------
# Cross-rank consistency check (FC-28)
# --------------------------------------------------------------------------------------
# Off by default (a store round trip per collective); on with REFIMPL_CHECK_COLLECTIVES=1
# or set_collective_checks(True). The timeout bounds every wait for peers here and in
# group agreement (FC-31): REFIMPL_CHECK_TIMEOUT_S, or set_collective_checks's.
CHECK_ENV, CHECK_TIMEOUT_ENV = "REFIMPL_CHECK_COLLECTIVES", "REFIMPL_CHECK_TIMEOUT_S"
DEFAULT_CHECK_TIMEOUT_S = 30.0
_checks: dict[str, Any] = {"enabled": None, "timeout_s": None}  # None: follow the env
_sequences: dict[tuple[str, int], int] = {}  # (group name, group rank) -> calls so far
# The fields every rank must agree on, in the order a mismatch is reported.
_FINGERPRINT = ("op", "group", "shapes", "dtypes", "reduce_op", "group_size", "src")


def set_collective_checks(enabled: bool | None, timeout_s: float | None = None) -> None:
    """Switch the cross-rank check on or off in this process (None: follow the
    environment variable); `timeout_s` bounds how long a rank waits for its peers."""
    _checks["enabled"] = enabled
    if timeout_s is not None:
        if not timeout_s > 0:
            refuse("timeout_s", "a positive number of seconds", repr(timeout_s), "FC-28")
        _checks["timeout_s"] = float(timeout_s)


def collective_checks_enabled() -> bool:
    if _checks["enabled"] is not None:
        return _checks["enabled"]
    return os.environ.get(CHECK_ENV, "0") == "1"


def _peer_timeout_s(pg: dist.ProcessGroup | None = None) -> float:
    """How long a rank waits for its peers: the check's timeout, or the group's own when
    that is shorter (a group made to fail in 15 s is not waited for 30 s) (FC-28)."""
    if _checks["timeout_s"] is not None:
        check_s = _checks["timeout_s"]
    else:
        check_s = float(os.environ.get(CHECK_TIMEOUT_ENV, DEFAULT_CHECK_TIMEOUT_S))
    group_s = _group_timeout_s(pg) if pg is not None else None
    return check_s if group_s is None else min(check_s, group_s)


def _group_timeout_s(pg: dist.ProcessGroup) -> float | None:
    """The timeout `pg` was made with, where its backend tells (gloo and nccl do; a
    process group written in Python may not)."""
    for device in getattr(pg, "_device_types", None) or [torch.device("cpu")]:
        try:
            return pg._get_backend(device).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            continue
    return None


def _ranks_text(ranks: list[int]) -> str:
    return f"global rank {ranks[0]}" if len(ranks) == 1 else \
        f"global ranks {', '.join(map(str, ranks))}"


def _agree(op: str, pg: dist.ProcessGroup, group_name: str, **call) -> None:
    """With checks on, every rank of the group compares its call with every peer's before
    communicating, and a mismatch raises on every rank alike (FC-28)."""
    if not collective_checks_enabled() or not _has_peers(pg):
        return
    me, size = pg.rank(), pg.size()
    seq = _sequences[(group_name, me)] = _sequences.get((group_name, me), 0) + 1
    store = c10d._get_default_store()
    keys = {r: f"refimpl-fc/check/{group_name}/{seq}/{r}" for r in range(size)}
    ranks = dist.get_process_group_ranks(pg)
    store.set(keys[me], json.dumps({"op": op, "group": ranks, **call}))
    timeout_s = _peer_timeout_s(pg)
    missing = _missing_peers(store, keys, timeout_s)
    if missing:
        raise PeerTimeout(
            f"{op}: global rank {ranks[me]} waited {timeout_s:g} s for "
            f"{_ranks_text([ranks[r] for r in missing])} of group {ranks} to reach "
            f"collective #{seq} of the group, in vain (is {CHECK_ENV}=1 set on every "
            f"rank?) [FC-28]")
    calls = [json.loads(v) for v in store.multi_get([keys[r] for r in range(size)])]
    if seq > 2:  # every peer has read call seq - 2: it posted seq - 1 after that
        store.delete_key(f"refimpl-fc/check/{group_name}/{seq - 2}/{me}")
    mismatch = _first_mismatch(calls, ranks) or _split_mismatch(calls, ranks)
    if mismatch:
        raise CollectiveMismatch(f"collective #{seq} of group {ranks}: {mismatch}; every rank "
                                 f"of the group must make the same call [FC-28]")


def _has_peers(pg: dist.ProcessGroup) -> bool:
    # The fake process group (tracing tests) pretends to have peers but has no store.
    return pg.size() > 1 and dist.get_backend(pg) != "fake"


def _first_mismatch(calls: list[dict], ranks: list[int]) -> str | None:
    for field in _FINGERPRINT:
        for r, call in enumerate(calls[1:], start=1):
            if call.get(field) != calls[0].get(field):
                return (f"ranks disagree on {field}: global rank {ranks[r]} passed "
                        f"{call.get(field)!r}, global rank {ranks[0]} passed "
                        f"{calls[0].get(field)!r}")
    return None


def _split_mismatch(calls: list[dict], ranks: list[int]) -> str | None:
    """all_to_all_single: what rank i expects from j is what j sends to i."""
    if "input_split_sizes" not in calls[0]:
        return None
    for i, receiver in enumerate(calls):
        for j, sender in enumerate(calls):
            expects, sends = receiver["output_split_sizes"][j], sender["input_split_sizes"][i]
            if expects != sends:
                return (f"ranks disagree on split sizes: global rank {ranks[i]} expects "
                        f"{expects} rows from global rank {ranks[j]} (output_split_sizes[{j}]), "
                        f"which sends it {sends} (input_split_sizes[{i}])")
    return None


def _missing_peers(store, keys: dict[int, str], timeout_s: float) -> list[int]:
    """The ranks whose key did not appear within `timeout_s` (bounded, never hangs)."""
    try:
        store.wait(list(keys.values()), datetime.timedelta(seconds=timeout_s))
        return []
    except RuntimeError:  # DistStoreError: the wait timed out
        return [r for r, key in keys.items() if not store.check([key])]


def _store_text(store, key: str) -> str:
    return store.get(key).decode() if store.check([key]) else ""


def _shapes(tensors) -> list[list[int]]:
    return [list(t.shape) for t in tensors]


def _dtypes(tensors) -> list[str]:
    return [str(t.dtype) for t in tensors]


# --------------------------------------------------------------------------------------
# AsyncCollectiveTensor (FC-9 .. FC-11) and how results reach the caller (FC-12, FC-25)
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
        # `pending` is the tensor whose storage keys the work: for a view, its base.
        r.pending = elem if pending is None else pending
        r.completed = False
        return r

    def __repr__(self, *, tensor_contents=None):
        return f"AsyncCollectiveTensor({self.trigger_wait()})"

    def trigger_wait(self) -> torch.Tensor:
        if not self.completed:
            _wait_and_clear(_work_key(self.pending))
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

    _register(out, _Pending(None, finish, "rearrange", ""))
    return _wrap(out)


# --------------------------------------------------------------------------------------
# Defining an op: schema (FC-1), eager kernel, fake kernel (FC-3), autograd (FC-23),
# side effects (FC-33). `group_name` is a plain `str`: upstream spells it `str` up to
# torch 2.12 and `Any` from 2.13; a string is what every version accepts.
# --------------------------------------------------------------------------------------
def _define(name: str, schema: str, *, eager, fake, backward=None, setup_context=None):
    SCHEMAS[name] = schema
    _lib.define(name + schema)
    _lib.impl(name, eager, "CPU")
    _lib.impl(name, eager, "CUDA")
    torch.library.register_fake(f"{LIBRARY}::{name}", fake, lib=_lib)
    if backward is not None:
        torch.library.register_autograd(f"{LIBRARY}::{name}", backward,
                                        setup_context=setup_context, lib=_lib)
    # No graph pass may delete a collective or a wait, used or not (FC-33).
    packet = getattr(ops, name)
    torch.fx.node.has_side_effect(packet)
    torch.fx.node.has_side_effect(packet.default)


def _no_context(ctx, inputs, output):
    return None


# Each op reaches its process group through the one method upstream's kernels call
# (FC-34): torch.distributed's all_reduce, all_to_all_single and broadcast call allreduce,
# alltoall_base and broadcast; the gathers, scatters and coalesced reductions call the
# group's coalesced methods directly, which a group written in Python implements (the
# functions torch.distributed has for them reach `_allgather_base`/`_reduce_scatter_base`,
# which such a group cannot override: torchft's groups fail there).


# --------------------------------------------------------------------------------------
# all_reduce, all_reduce_, all_reduce_coalesced, all_reduce_coalesced_
# --------------------------------------------------------------------------------------
def _check_all_reduce(tensor, reduce_op, group_name):
    """(normalized reduce op, group) after every check (FC-17, FC-18, FC-30)."""
    op = _check_reduce_op(reduce_op, tensor.dtype)
    pg = _process_group(group_name)
    _check_has_data(tensor, "input")
    return op, pg


def _start_all_reduce(what, tensor, op, pg, group_name):
    """All-reduce `tensor` (contiguous, owned) in place; avg divides the sum (FC-18)."""
    finish = (lambda: tensor.div_(pg.size())) if op == "avg" else None
    backend = _backend_serving(pg, "allreduce", tensor.device)
    if backend is None:
        return _start(what, group_name, tensor, lambda: dist.all_reduce(
            tensor, op=_REDUCE_OPS[op], group=pg, async_op=True), finish)
    if tensor.is_complex() and not c10d.supports_complex(_REDUCE_OPS[op]):
        # torch.distributed's own refusal, which the backend's call would skip.
        raise ValueError(f"all_reduce does not support {_REDUCE_OPS[op]} on complex tensors")
    opts = dist.AllreduceOptions()
    opts.reduceOp = _REDUCE_OPS[op]
    return _start(what, group_name, tensor, lambda: backend.allreduce(
        _real_views([tensor]), opts), finish)


def _start_all_reduce_coalesced(what, tensors, op, pg, group_name):
    """All-reduce `tensors` (contiguous, owned) in place through the group's
    `allreduce_coalesced`, once per dtype (a process group takes one dtype per call), in
    the order the dtypes first appear; avg divides each sum (FC-18, FC-34)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = _REDUCE_OPS[op]
    for members in by_dtype.values():
        finishes = [(lambda t=t: t.div_(pg.size())) if op == "avg" else None
                    for t in members]
        serves = _backend_serving(pg, "allreduce_coalesced", members[0].device) or pg
        _start_together(what, group_name, members, lambda members=members, serves=serves:
                        serves.allreduce_coalesced(_real_views(members), opts), finishes)
    return tensors


def _all_reduce(tensor, reduce_op, group_name):
    op, pg = _check_all_reduce(tensor, reduce_op, group_name)
    _agree("all_reduce", pg, group_name, shapes=_shapes([tensor]), dtypes=_dtypes([tensor]),
           reduce_op=op)
    out = tensor.clone(memory_format=torch.contiguous_format)
    return _start_all_reduce("all_reduce", out, op, pg, group_name)


def _all_reduce_fake(tensor, reduce_op, group_name):
    _check_all_reduce(tensor, reduce_op, group_name)
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _all_reduce_inplace(tensor, reduce_op, group_name):
    op, pg = _check_all_reduce(tensor, reduce_op, group_name)
    _check_contiguous(tensor, "input", "all_reduce_")
    _agree("all_reduce_", pg, group_name, shapes=_shapes([tensor]), dtypes=_dtypes([tensor]),
           reduce_op=op)
    return _start_all_reduce("all_reduce_", tensor, op, pg, group_name)


def _all_reduce_inplace_fake(tensor, reduce_op, group_name):
    _check_all_reduce(tensor, reduce_op, group_name)
    return tensor


def _all_reduce_coalesced(tensors, reduce_op, group_name):
    # Every member is checked before any starts: no partial work (FC-27).
    plans = [_check_all_reduce(t, reduce_op, group_name) for t in tensors]
    pg = _process_group(group_name)
    _agree("all_reduce_coalesced", pg, group_name, shapes=_shapes(tensors),
           dtypes=_dtypes(tensors), reduce_op=str(reduce_op).lower())
    outs = [t.clone(memory_format=torch.contiguous_format) for t in tensors]
    return _start_all_reduce_coalesced("all_reduce_coalesced", outs, plans[0][0], pg,
                                       group_name)


def _all_reduce_coalesced_fake(tensors, reduce_op, group_name):
    for t in tensors:
        _check_all_reduce(t, reduce_op, group_name)
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]


def _all_reduce_coalesced_inplace(tensors, reduce_op, group_name):
    plans = [_check_all_reduce(t, reduce_op, group_name) for t in tensors]
    for t in tensors:
        _check_contiguous(t, "inputs", "all_reduce_coalesced_")
    pg = _process_group(group_name)
    _agree("all_reduce_coalesced_", pg, group_name, shapes=_shapes(tensors),
           dtypes=_dtypes(tensors), reduce_op=str(reduce_op).lower())
    _start_all_reduce_coalesced("all_reduce_coalesced_", list(tensors), plans[0][0], pg,
                                group_name)
    return tensors


def _all_reduce_coalesced_inplace_fake(tensors, reduce_op, group_name):
    for t in tensors:
        _check_all_reduce(t, reduce_op, group_name)
    return tensors


def _setup_all_reduce(ctx, inputs, output):
    _setup_reduction(ctx, output, inputs[1], "all_reduce")
    ctx.group_name = inputs[2]
    if ctx.reduce_op in _EXTREMA:
        ctx.save_for_backward(inputs[0], output)


def _backward_all_reduce(ctx, grad):
    # d(sum_j x_j)/dx_i = 1 on every rank, so the gradient is the sum of the gradients
    # of every rank's output; avg scales the same sum by 1/size (FC-23).
    if ctx.reduce_op not in _EXTREMA:
        return _waited(ops.all_reduce(grad.contiguous(), ctx.reduce_op, ctx.group_name)), \
            None, None
    return _extremum_gradient(ctx, grad), None, None


def _extremum_gradient(ctx, grad):
    """min / max (FC-23): every rank's output is the extremum, so the summed gradient goes
    to the elements that hold it, split equally among the holders of every rank (ties);
    an element holds it when it equals the result, or both are NaN. The holders are
    counted in float32, exact where the gradient's dtype (f16, bf16) is not."""
    x, y = ctx.saved_tensors
    y = _waited(y)
    total = _waited(ops.all_reduce(grad.contiguous(), "sum", ctx.group_name))
    holds = (x == y) | (x.isnan() & y.isnan())
    holders = _waited(ops.all_reduce(holds.to(torch.float32), "sum", ctx.group_name))
    return torch.where(holds, (total / holders).to(total.dtype), 0)


_define("all_reduce", "(Tensor input, str reduce_op, str group_name) -> Tensor",
        eager=_all_reduce, fake=_all_reduce_fake,
        backward=_backward_all_reduce, setup_context=_setup_all_reduce)
_define("all_reduce_", "(Tensor(a!) input, str reduce_op, str group_name) -> Tensor(a!)",
        eager=_all_reduce_inplace, fake=_all_reduce_inplace_fake)
_define("all_reduce_coalesced", "(Tensor[] inputs, str reduce_op, str group_name) -> Tensor[]",
        eager=_all_reduce_coalesced, fake=_all_reduce_coalesced_fake)
_define("all_reduce_coalesced_",
        "(Tensor[](a!) inputs, str reduce_op, str group_name) -> Tensor[](a!)",
        eager=_all_reduce_coalesced_inplace, fake=_all_reduce_coalesced_inplace_fake)


def _tensor_list(tensors, argument: str, rule: str = "FC-27") -> list[torch.Tensor]:
    """The members of a list argument: a list (or tuple) of tensors, not empty (FC-27).
    Checked before anything starts, on every rank alike."""
    # A tensor is iterable too: reading its rows as the members would be a silent wrong
    # answer, so only a list or a tuple is one.
    if not isinstance(tensors, (list, tuple)):
        refuse(argument, "a list of tensors", type(tensors).__name__, rule, TypeError)
    if not tensors:
        refuse(argument, "a list of at least one tensor", "an empty list", rule)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            refuse(argument, "a list of tensors", f"{type(t).__name__} at index {i}", rule,
                   TypeError)
    return list(tensors)


def all_reduce(self: torch.Tensor, reduceOp, group: RankTypes, tag: str = ""):
    """Reduce `self` over `group`; every rank gets the result. The input is unchanged.
    `reduceOp`: a name, or a `torch.distributed.ReduceOp` (FC-17)."""
    reduceOp, factor = _reduction(reduceOp, [self])
    _check_reduce_op(reduceOp, self.dtype)
    _check_grad_before_issue(self, reduceOp, "all_reduce")
    name = resolve_group_name(group, tag)
    return _wrap(ops.all_reduce(_premultiplied(self, factor), reduceOp, name))


def all_reduce_coalesced(self: list[torch.Tensor], reduceOp, group: RankTypes,
                         tag: str = "") -> list[torch.Tensor]:
    """`all_reduce` of each tensor of the list, started together (FC-26)."""
    self = _tensor_list(self, "self")
    reduceOp, factor = _reduction(reduceOp, self)
    for t in self:
        _check_reduce_op(reduceOp, t.dtype)
    name = resolve_group_name(group, tag)
    results = ops.all_reduce_coalesced([_premultiplied(t, factor) for t in self], reduceOp,
                                       name)
    return [_wrap(t) for t in results]


# --------------------------------------------------------------------------------------
# all_gather_into_tensor, all_gather_into_tensor_out, all_gather_into_tensor_coalesced
# --------------------------------------------------------------------------------------
def _check_all_gather(tensor, group_size, group_name, out=None):
    """(gathered shape, group) after every check (FC-19, FC-20, FC-30)."""
    pg = _check_group_size(group_name, group_size)
    _check_has_data(tensor, "input")
    _check_has_dims(tensor, "input", "all_gather_into_tensor")
    shape = [tensor.shape[0] * group_size, *tensor.shape[1:]]
    if out is not None:
        if out.device != tensor.device:
            refuse("out", f"a tensor on the input's device {tensor.device}", out.device,
                   "FC-30")
        if list(out.shape) != shape or out.dtype != tensor.dtype:
            refuse("out", f"a {tensor.dtype} tensor of shape {shape}",
                   f"{out.dtype} {list(out.shape)}", "FC-20")
    return shape, pg


def _start_all_gather(what, tensors, outs, pg, group_name) -> list:
    """Gather every tensor of `tensors` into its `outs` through the group's
    `allgather_into_tensor_coalesced`, one call for them all (FC-34, FC-50)."""
    ins = [t.contiguous() for t in tensors]
    backend = _backend_serving(pg, "allgather_into_tensor_coalesced", outs[0].device)
    if backend is not None:  # its binding has no coalesced gather: one call per member
        return _start_together(what, group_name, outs, lambda: _Works([
            backend._allgather_base(o, i, c10d.AllgatherOptions())
            for o, i in zip(_real_views(outs), _real_views(ins), strict=True)]),
            reads=[(t,) for t in tensors])
    # The options are passed, as upstream's kernel does: a Python group may require them.
    return _start_together(what, group_name, outs, lambda: pg.allgather_into_tensor_coalesced(
        _real_views(outs), _real_views(ins), c10d.AllgatherOptions()),
        reads=[(t,) for t in tensors])


def _all_gather_into_tensor(tensor, group_size, group_name):
    shape, pg = _check_all_gather(tensor, group_size, group_name)
    _agree("all_gather_into_tensor", pg, group_name, shapes=_shapes([tensor]),
           dtypes=_dtypes([tensor]), group_size=group_size)
    return _start_all_gather("all_gather_into_tensor", [tensor], [tensor.new_empty(shape)],
                             pg, group_name)[0]


def _all_gather_into_tensor_fake(tensor, group_size, group_name):
    shape, _ = _check_all_gather(tensor, group_size, group_name)
    return tensor.new_empty(shape)


def _all_gather_into_tensor_out(tensor, group_size, group_name, *, out):
    _, pg = _check_all_gather(tensor, group_size, group_name, out)
    _check_contiguous(out, "out", "all_gather_into_tensor_out")
    _agree("all_gather_into_tensor_out", pg, group_name, shapes=_shapes([tensor]),
           dtypes=_dtypes([tensor]), group_size=group_size)
    return _start_all_gather("all_gather_into_tensor_out", [tensor], [out], pg, group_name)[0]


def _all_gather_into_tensor_out_fake(tensor, group_size, group_name, *, out):
    _check_all_gather(tensor, group_size, group_name, out)
    return out


def _all_gather_into_tensor_coalesced(tensors, group_size, group_name):
    shapes = [_check_all_gather(t, group_size, group_name)[0] for t in tensors]
    pg = _process_group(group_name)
    _agree("all_gather_into_tensor_coalesced", pg, group_name, shapes=_shapes(tensors),
           dtypes=_dtypes(tensors), group_size=group_size)
    return _start_all_gather("all_gather_into_tensor_coalesced", list(tensors),
                             [t.new_empty(shape) for t, shape in zip(tensors, shapes,
                                                                     strict=True)],
                             pg, group_name)


def _all_gather_into_tensor_coalesced_fake(tensors, group_size, group_name):
    return [t.new_empty(_check_all_gather(t, group_size, group_name)[0]) for t in tensors]


def _setup_all_gather(ctx, inputs, output):
    ctx.group_size, ctx.group_name = inputs[1], inputs[2]


def _backward_all_gather(ctx, grad):
    # Rank i's input went to rows i of every rank's output: it gets the sum of those rows.
    g = ops.reduce_scatter_tensor(grad.contiguous(), "sum", ctx.group_size, ctx.group_name)
    return _waited(g), None, None


_define("all_gather_into_tensor", "(Tensor input, int group_size, str group_name) -> Tensor",
        eager=_all_gather_into_tensor, fake=_all_gather_into_tensor_fake,
        backward=_backward_all_gather, setup_context=_setup_all_gather)
_define("all_gather_into_tensor_coalesced",
        "(Tensor[] inputs, int group_size, str group_name) -> Tensor[]",
        eager=_all_gather_into_tensor_coalesced, fake=_all_gather_into_tensor_coalesced_fake)
_define("all_gather_into_tensor_out",
        "(Tensor input, int group_size, str group_name, *, Tensor(a!) out) -> Tensor(a!)",
        eager=_all_gather_into_tensor_out, fake=_all_gather_into_tensor_out_fake)


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


def all_gather_tensor_autograd(self: torch.Tensor, gather_dim: int, group: RankTypes,
                               tag: str = ""):
    """`all_gather_tensor`, whose op always carries its gradient (FC-32)."""
    return all_gather_tensor(self, gather_dim, group, tag)


def all_gather_into_tensor_coalesced(self: list[torch.Tensor], group: RankTypes,
                                     tag: str = "") -> list[torch.Tensor]:
    """All-gather on dim 0 of each tensor of the list, started together (FC-26)."""
    self = _tensor_list(self, "self")
    name = resolve_group_name(group, tag)
    results = ops.all_gather_into_tensor_coalesced(
        [t.contiguous() for t in self], group_size(name), name)
    return [_wrap(t) for t in results]


# --------------------------------------------------------------------------------------
# reduce_scatter_tensor, reduce_scatter_tensor_coalesced
# --------------------------------------------------------------------------------------
def _check_reduce_scatter(tensor, reduce_op, group_size, group_name):
    """(reduce op, scattered shape, group) after every check (FC-17..FC-20, FC-30)."""
    op = _check_reduce_op(reduce_op, tensor.dtype)
    pg = _check_group_size(group_name, group_size)
    _check_has_data(tensor, "input")
    _check_has_dims(tensor, "input", "reduce_scatter_tensor")
    if tensor.shape[0] % group_size:
        refuse("input", f"dim 0 divisible by the group size {group_size} for "
               "reduce_scatter_tensor", f"shape {list(tensor.shape)}", "FC-20")
    return op, [tensor.shape[0] // group_size, *tensor.shape[1:]], pg


def _start_reduce_scatter(what, tensors, op, shapes, pg, group_name) -> list:
    """Reduce-scatter every tensor of `tensors` through the group's
    `reduce_scatter_tensor_coalesced`, one call for them all; avg divides each result
    (FC-18, FC-34)."""
    outs = [t.new_empty(shape) for t, shape in zip(tensors, shapes, strict=True)]
    ins = [t.contiguous() for t in tensors]
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = _REDUCE_OPS[op]
    finishes = [(lambda out=out: out.div_(pg.size())) if op == "avg" else None
                for out in outs]
    backend = _backend_serving(pg, "reduce_scatter_tensor_coalesced", outs[0].device)
    if backend is not None:  # its binding has no coalesced scatter: one call per member
        return _start_together(what, group_name, outs, lambda: _Works([
            backend._reduce_scatter_base(o, i, opts) for o, i in zip(outs, ins, strict=True)]),
            finishes, reads=[(t,) for t in tensors])
    return _start_together(what, group_name, outs, lambda: pg.reduce_scatter_tensor_coalesced(
        outs, ins, opts), finishes, reads=[(t,) for t in tensors])


def _reduce_scatter_tensor(tensor, reduce_op, group_size, group_name):
    op, shape, pg = _check_reduce_scatter(tensor, reduce_op, group_size, group_name)
    _agree("reduce_scatter_tensor", pg, group_name, shapes=_shapes([tensor]),
           dtypes=_dtypes([tensor]), reduce_op=op, group_size=group_size)
    return _start_reduce_scatter("reduce_scatter_tensor", [tensor], op, [shape], pg,
                                 group_name)[0]


def _reduce_scatter_tensor_fake(tensor, reduce_op, group_size, group_name):
    _, shape, _ = _check_reduce_scatter(tensor, reduce_op, group_size, group_name)
    return tensor.new_empty(shape)


def _reduce_scatter_tensor_coalesced(tensors, reduce_op, group_size, group_name):
    plans = [_check_reduce_scatter(t, reduce_op, group_size, group_name) for t in tensors]
    pg = _process_group(group_name)
    _agree("reduce_scatter_tensor_coalesced", pg, group_name, shapes=_shapes(tensors),
           dtypes=_dtypes(tensors), reduce_op=str(reduce_op).lower(), group_size=group_size)
    return _start_reduce_scatter("reduce_scatter_tensor_coalesced", list(tensors),
                                 plans[0][0], [shape for _, shape, _ in plans], pg,
                                 group_name)


def _reduce_scatter_tensor_coalesced_fake(tensors, reduce_op, group_size, group_name):
    return [t.new_empty(_check_reduce_scatter(t, reduce_op, group_size, group_name)[1])
            for t in tensors]


def _setup_reduce_scatter(ctx, inputs, output):
    _setup_reduction(ctx, output, inputs[1], "reduce_scatter_tensor")
    ctx.group_size, ctx.group_name = inputs[2], inputs[3]


def _backward_reduce_scatter(ctx, grad):
    # Every rank's input reached chunk i of the sum, held by rank i: gather the chunks.
    g = _waited(ops.all_gather_into_tensor(grad.contiguous(), ctx.group_size,
                                           ctx.group_name))
    if ctx.reduce_op == "avg":
        g = g / ctx.group_size
    return g, None, None, None


_define("reduce_scatter_tensor",
        "(Tensor input, str reduce_op, int group_size, str group_name) -> Tensor",
        eager=_reduce_scatter_tensor, fake=_reduce_scatter_tensor_fake,
        backward=_backward_reduce_scatter, setup_context=_setup_reduce_scatter)
_define("reduce_scatter_tensor_coalesced",
        "(Tensor[] inputs, str reduce_op, int group_size, str group_name) -> Tensor[]",
        eager=_reduce_scatter_tensor_coalesced, fake=_reduce_scatter_tensor_coalesced_fake)


def _scatter_dim_to_front(self: torch.Tensor, scatter_dim: int, n: int) -> torch.Tensor:
    dim = _dim(scatter_dim, self.dim(), "scatter_dim")
    if self.shape[dim] % n:
        refuse("scatter_dim", f"a dim whose size is divisible by the group size {n}",
               f"dim {dim} of size {self.shape[dim]}", "FC-20")
    if dim == 0:
        return self.contiguous()
    # Lay the chunks of `dim` one after another on dim 0, so that the reduce_scatter on
    # dim 0 hands rank i exactly chunk i of `dim`.
    return torch.cat(torch.chunk(self, n, dim=dim), dim=0)


def reduce_scatter_tensor(self: torch.Tensor, reduceOp, scatter_dim: int,
                          group: RankTypes, tag: str = ""):
    """Reduce over `group`, then give group rank i chunk i of `scatter_dim` (FC-14).
    `reduceOp`: a name, or a `torch.distributed.ReduceOp` (FC-17)."""
    reduceOp, factor = _reduction(reduceOp, [self])
    _check_reduce_op(reduceOp, self.dtype)
    name = resolve_group_name(group, tag)
    n = group_size(name)
    _check_grad_before_issue(self, reduceOp, "reduce_scatter_tensor")
    fronted = _scatter_dim_to_front(_premultiplied(self, factor), scatter_dim, n)
    return _wrap(ops.reduce_scatter_tensor(fronted, reduceOp, n, name))


def reduce_scatter_tensor_autograd(self: torch.Tensor, reduceOp, scatter_dim: int,
                                   group: RankTypes, tag: str = ""):
    """`reduce_scatter_tensor`, whose op always carries its gradient (FC-32)."""
    return reduce_scatter_tensor(self, reduceOp, scatter_dim, group, tag)


def reduce_scatter_tensor_coalesced(inputs: list[torch.Tensor], reduceOp,
                                    scatter_dim: list[int], group: RankTypes,
                                    tag: str = "") -> list[torch.Tensor]:
    """`reduce_scatter_tensor` of each tensor along its own scatter dim, started together."""
    inputs = _tensor_list(inputs, "inputs")
    if len(scatter_dim) != len(inputs):
        refuse("scatter_dim", f"one dim per input ({len(inputs)})", f"{len(scatter_dim)} dims",
               "FC-20")
    reduceOp, factor = _reduction(reduceOp, inputs)
    for t in inputs:
        _check_reduce_op(reduceOp, t.dtype)
    name = resolve_group_name(group, tag)
    n = group_size(name)
    fronted = [_scatter_dim_to_front(_premultiplied(t, factor), d, n)
               for t, d in zip(inputs, scatter_dim, strict=True)]
    return [_wrap(t) for t in ops.reduce_scatter_tensor_coalesced(fronted, reduceOp, n, name)]


# --------------------------------------------------------------------------------------
# all_to_all_single
# --------------------------------------------------------------------------------------
def _check_splits(splits, size: int, group_size: int, arg: str) -> list[int]:
    """The explicit split sizes: `splits`, or equal ones when it is empty (FC-21)."""
    if len(splits) == 0:
        if size % group_size:
            refuse(arg, f"dim 0 divisible by the group size {group_size} for empty splits",
                   f"dim 0 of size {size}", "FC-21")
        return [size // group_size] * group_size
    if len(splits) != group_size or any(s < 0 for s in splits) or sum(splits) != size:
        refuse(arg, f"{group_size} non-negative sizes summing to {size}", list(splits),
               "FC-21")
    return list(splits)


def _check_all_to_all(tensor, output_split_sizes, input_split_sizes, group_name):
    """(output rows, explicit input splits, explicit output splits, group) (FC-21, FC-30)."""
    pg = _process_group(group_name)
    n = pg.size()
    _check_has_data(tensor, "input")
    _check_has_dims(tensor, "input", "all_to_all_single", "FC-21")
    ins = _check_splits(input_split_sizes, tensor.shape[0], n, "input_split_sizes")
    rows = sum(output_split_sizes) if len(output_split_sizes) else tensor.shape[0]
    outs = _check_splits(output_split_sizes, rows, n, "output_split_sizes")
    return rows, ins, outs, pg


def _all_to_all_single(tensor, output_split_sizes, input_split_sizes, group_name):
    rows, ins, outs, pg = _check_all_to_all(tensor, output_split_sizes, input_split_sizes,
                                            group_name)
    # Rows may differ between ranks; the trailing dims and the splits must fit (FC-28).
    _agree("all_to_all_single", pg, group_name, shapes=[list(tensor.shape[1:])],
           dtypes=_dtypes([tensor]), input_split_sizes=ins, output_split_sizes=outs)
    out = tensor.new_empty([rows, *tensor.shape[1:]])
    backend = _backend_serving(pg, "alltoall_base", tensor.device)
    if backend is not None:
        return _start("all_to_all_single", group_name, out, lambda: backend.alltoall_base(
            *_real_views([out, tensor.contiguous()]), outs, ins, c10d.AllToAllOptions()),
            reads=(tensor,))
    return _start("all_to_all_single", group_name, out, lambda: dist.all_to_all_single(
        out, tensor.contiguous(), outs, ins, group=pg, async_op=True), reads=(tensor,))


def _all_to_all_single_fake(tensor, output_split_sizes, input_split_sizes, group_name):
    rows, _, _, _ = _check_all_to_all(tensor, output_split_sizes, input_split_sizes, group_name)
    return tensor.new_empty([rows, *tensor.shape[1:]])


def _setup_all_to_all(ctx, inputs, output):
    ctx.output_split_sizes, ctx.input_split_sizes, ctx.group_name = inputs[1:4]


def _backward_all_to_all(ctx, grad):
    # The transpose of an all-to-all is the all-to-all with the splits swapped (FC-23).
    g = ops.all_to_all_single(grad.contiguous(), ctx.input_split_sizes,
                              ctx.output_split_sizes, ctx.group_name)
    return _waited(g), None, None, None


_define("all_to_all_single", "(Tensor input, SymInt[] output_split_sizes, "
                             "SymInt[] input_split_sizes, str group_name) -> Tensor",
        eager=_all_to_all_single, fake=_all_to_all_single_fake,
        backward=_backward_all_to_all, setup_context=_setup_all_to_all)


def all_to_all_single(self: torch.Tensor, output_split_sizes: list[int] | None,
                      input_split_sizes: list[int] | None, group: RankTypes, tag: str = ""):
    """Send split i of dim 0 to group rank i; receive split j from group rank j.

    A split list given as None means equal splits, which are written out explicitly, so
    a traced graph states every size it moves (FC-21).
    """
    name = resolve_group_name(group, tag)
    n = group_size(name)
    _check_has_dims(self, "input", "all_to_all_single", "FC-21")
    rows = self.shape[0]
    ins = _check_splits([], rows, n, "input_split_sizes") if input_split_sizes is None \
        else list(input_split_sizes)
    outs = _check_splits([], rows, n, "output_split_sizes") if output_split_sizes is None \
        else list(output_split_sizes)
    return _wrap(ops.all_to_all_single(self, outs, ins, name))


def all_to_all_single_autograd(self: torch.Tensor, output_split_sizes: list[int] | None,
                               input_split_sizes: list[int] | None, group: RankTypes,
                               tag: str = ""):
    """`all_to_all_single`, whose op always carries its gradient (FC-32)."""
    return all_to_all_single(self, output_split_sizes, input_split_sizes, group, tag)


# --------------------------------------------------------------------------------------
# broadcast, broadcast_
# --------------------------------------------------------------------------------------
def _check_src(src, size: int, group_name: str) -> int:
    # `src` is a rank *within the group*, as upstream's c10d_functional kernels take it
    # (torch.distributed.broadcast takes a global rank instead).
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < size:
        refuse("src", f"a group rank of group {group_name!r} of size {size}: an int, "
               f"0 <= src < {size} (src counts ranks within the group)", repr(src), "FC-22")
    return src


def _check_broadcast(tensor, src, group_name):
    """The group, after every check (FC-22, FC-30)."""
    pg = _process_group(group_name)
    _check_src(src, pg.size(), group_name)
    _check_has_data(tensor, "input")
    return pg


def _start_broadcast(what, tensor, src, pg, group_name):
    backend = _backend_serving(pg, "broadcast", tensor.device)
    if backend is not None:
        opts = c10d.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return _start(what, group_name, tensor, lambda: backend.broadcast(
            _real_views([tensor]), opts))
    return _start(what, group_name, tensor, lambda: dist.broadcast(
        tensor, group=pg, group_src=src, async_op=True))


def _broadcast(tensor, src, group_name):
    pg = _check_broadcast(tensor, src, group_name)
    _agree("broadcast", pg, group_name, shapes=_shapes([tensor]), dtypes=_dtypes([tensor]),
           src=src)
    out = tensor.clone(memory_format=torch.contiguous_format)
    return _start_broadcast("broadcast", out, src, pg, group_name)


def _broadcast_fake(tensor, src, group_name):
    _check_broadcast(tensor, src, group_name)
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _broadcast_inplace(tensor, src, group_name):
    pg = _check_broadcast(tensor, src, group_name)
    _check_contiguous(tensor, "input", "broadcast_")
    _agree("broadcast_", pg, group_name, shapes=_shapes([tensor]), dtypes=_dtypes([tensor]),
           src=src)
    return _start_broadcast("broadcast_", tensor, src, pg, group_name)


def _broadcast_inplace_fake(tensor, src, group_name):
    _check_broadcast(tensor, src, group_name)
    return tensor


def _setup_broadcast(ctx, inputs, output):
    ctx.src, ctx.group_name = inputs[1], inputs[2]


def _backward_broadcast(ctx, grad):
    # Only src's value reached the outputs: src gets every rank's gradient, others none.
    g = _waited(ops.all_reduce(grad.contiguous(), "sum", ctx.group_name))
    is_src = _process_group(ctx.group_name).rank() == ctx.src
    return (g if is_src else torch.zeros_like(g)), None, None


_define("broadcast", "(Tensor input, int src, str group_name) -> Tensor",
        eager=_broadcast, fake=_broadcast_fake,
        backward=_backward_broadcast, setup_context=_setup_broadcast)
_define("broadcast_", "(Tensor(a!) input, int src, str group_name) -> Tensor(a!)",
        eager=_broadcast_inplace, fake=_broadcast_inplace_fake)


def broadcast(self: torch.Tensor, src: int, group: RankTypes, tag: str = ""):
    """Every rank gets the value of group rank `src` (a rank within `group`, FC-22)."""
    name = resolve_group_name(group, tag)
    # The op's `int src` would turn a bool into 0 or 1: refuse it here (FC-22).
    _check_src(src, group_size(name), name)
    return _wrap(ops.broadcast(self, src, name))


# --------------------------------------------------------------------------------------
# isend, irecv, batch_p2p_ops (FC-52, FC-53): one peer each, a group rank as broadcast's
# src. A send and a receive are both issued before either blocks, so a program may issue
# its sends before its receives or after them.
# --------------------------------------------------------------------------------------
_P2P_OPS = ("isend", "irecv")
# (group, sender, receiver, op) -> ops posted so far: the n-th send from a to b matches
# b's n-th receive from a, and the two name one tag (FC-52; NCCL ignores tags).
_p2p_sequences: dict[tuple[str, int, int, str], int] = {}


def _check_peer(peer, size: int, group_name: str, arg: str) -> int:
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < size:
        refuse(arg, f"a group rank of group {group_name!r} of size {size}: an int, "
               f"0 <= {arg} < {size} ({arg} counts ranks within the group)", repr(peer),
               "FC-53")
    return peer


def _check_tag(tag, arg: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int):
        refuse(arg, "an int", repr(tag), "FC-53", TypeError)
    return tag


def _check_p2p(op: str, tensor, peer, tag, group_name):
    """The group, after every check of one send or receive (FC-53, FC-30)."""
    pg = _process_group(group_name)
    _check_member(op, tensor, peer, tag, pg, group_name)
    return pg


def _check_member(op: str, tensor, peer, tag, pg, group_name, index: str = "") -> None:
    """The checks of one send or receive on `pg`; `index` ("[i]") names a batch's member
    by its lists' arguments."""
    peer_arg = ("peer_list" if index else "dst" if op == "isend" else "src") + index
    _check_peer(peer, pg.size(), group_name, peer_arg)
    _check_tag(tag, ("tag_list" if index else "tag") + index)
    _check_has_data(tensor, ("tensors" if index else "tensor") + index)


def _check_batch(op_list, peer_list, tag_list, tensors, group_name):
    """The group, after every check of a batch, each member's as its single op's."""
    tensors = _tensor_list(tensors, "tensors", "FC-53")
    for arg, values in (("op_list", op_list), ("peer_list", peer_list),
                        ("tag_list", tag_list)):
        if not isinstance(values, (list, tuple)) or len(values) != len(tensors):
            refuse(arg, f"a list of {len(tensors)} entries, one per tensor",
                   _length_text(values), "FC-53")
    for i, op in enumerate(op_list):
        if op not in _P2P_OPS:
            refuse(f"op_list[{i}]", "'isend' or 'irecv'", repr(op), "FC-53")
    pg = _process_group(group_name)
    for i, (op, peer, tag, t) in enumerate(zip(op_list, peer_list, tag_list, tensors,
                                               strict=True)):
        _check_member(op, t, peer, tag, pg, group_name, f"[{i}]")
    return pg


def _length_text(values) -> str:
    if isinstance(values, (list, tuple)):
        return f"{len(values)} entries"
    return type(values).__name__


class _PairCheck:
    """With checks on (FC-28), one send or receive as its rank posted it, verified against
    its peer's at the wait: by then both have issued theirs, in whatever order (FC-53)."""

    __slots__ = ("op", "pg", "group_name", "peer", "tag", "n", "base", "mine")

    def __init__(self, op, pg, group_name, peer, tag, tensor):
        me = pg.rank()
        sender, receiver = (me, peer) if op == "isend" else (peer, me)
        key = (group_name, sender, receiver, op)
        self.n = _p2p_sequences[key] = _p2p_sequences.get(key, 0) + 1
        self.op, self.pg, self.group_name, self.peer, self.tag = op, pg, group_name, peer, tag
        self.base = f"refimpl-fc/p2p/{group_name}/{sender}-{receiver}/{self.n}"
        self.mine = {"tag": tag, "shape": list(tensor.shape), "dtype": str(tensor.dtype)}
        c10d._get_default_store().set(f"{self.base}/{op}", json.dumps(self.mine))

    def verify(self) -> None:
        store = c10d._get_default_store()
        other = "irecv" if self.op == "isend" else "isend"
        key = f"{self.base}/{other}"
        ranks = dist.get_process_group_ranks(self.pg)
        me, peer = ranks[self.pg.rank()], ranks[self.peer]
        what = (f"{self.op} #{self.n} {'to' if self.op == 'isend' else 'from'} global rank "
                f"{peer} (tag {self.tag}) on group {ranks}")
        timeout_s = _peer_timeout_s(self.pg)
        if _missing_peers(store, {self.peer: key}, timeout_s):
            matching = f"{other} {'from' if other == 'irecv' else 'to'} global rank {me}"
            raise PeerTimeout(
                f"{what}: global rank {me} waited {timeout_s:g} s for global rank {peer} to "
                f"post its {matching} #{self.n}, in vain: a pair that does not match would "
                f"hang [FC-53]")
        theirs = json.loads(store.get(key))
        store.delete_key(key)  # read by this rank only
        for field in ("tag", "shape", "dtype"):
            if theirs[field] != self.mine[field]:
                raise CollectiveMismatch(
                    f"{what}: the pair disagrees on {field}: global rank {peer} passed "
                    f"{theirs[field]!r}, global rank {me} passed {self.mine[field]!r}; a "
                    f"receive must take what its send sends [FC-53]")


def _start_p2p(op: str, tensor, peer: int, tag: int, pg, group_name: str) -> torch.Tensor:
    """Issue one send (the result: a token of no elements) or receive (the result: a fresh
    tensor the value arrives in); pending until waited (FC-52)."""
    check = _PairCheck(op, pg, group_name, peer, tag, tensor) \
        if collective_checks_enabled() and _has_peers(pg) else None
    if op == "isend":
        sent = tensor.contiguous()
        result = tensor.new_empty(0)
        method, buffers, reads = "send", [sent], (sent,)
    else:
        result = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        method, buffers, reads = "recv", [result], ()
    serving = _backend_serving(pg, method, tensor.device) or pg
    what = f"{op} {'to' if op == 'isend' else 'from'} group rank {peer}"
    work = _communicate(what, group_name, lambda: getattr(serving, method)(buffers, peer, tag))
    pending = _Pending(work, None, what, group_name, reads,
                       check=check.verify if check else None,
                       peer=dist.get_process_group_ranks(pg)[peer])
    return _register(result, pending, pending_if_empty=True)


def _isend(tensor, dst, tag, group_name):
    pg = _check_p2p("isend", tensor, dst, tag, group_name)
    return _start_p2p("isend", tensor, dst, tag, pg, group_name)


def _isend_fake(tensor, dst, tag, group_name):
    _check_p2p("isend", tensor, dst, tag, group_name)
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _irecv(tensor, src, tag, group_name):
    pg = _check_p2p("irecv", tensor, src, tag, group_name)
    return _start_p2p("irecv", tensor, src, tag, pg, group_name)


def _irecv_fake(tensor, src, tag, group_name):
    _check_p2p("irecv", tensor, src, tag, group_name)
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _batch_p2p_ops(op_list, peer_list, tag_list, tensors, group_name):
    pg = _check_batch(op_list, peer_list, tag_list, tensors, group_name)
    # Every member is issued before any is waited: a batch never blocks on its order.
    return [_start_p2p(op, t, peer, tag, pg, group_name)
            for op, peer, tag, t in zip(op_list, peer_list, tag_list, tensors, strict=True)]


def _batch_p2p_ops_fake(op_list, peer_list, tag_list, tensors, group_name):
    _check_batch(op_list, peer_list, tag_list, tensors, group_name)
    return [t.new_empty(0) if op == "isend" else
            torch.empty_like(t, memory_format=torch.contiguous_format)
            for op, t in zip(op_list, tensors, strict=True)]


_define("isend", "(Tensor tensor, int dst, int tag, str group_name) -> Tensor",
        eager=_isend, fake=_isend_fake)
_define("irecv", "(Tensor tensor, int src, int tag, str group_name) -> Tensor",
        eager=_irecv, fake=_irecv_fake)
_define("batch_p2p_ops", "(str[] op_list, int[] peer_list, int[] tag_list, Tensor[] tensors, "
        "str group_name) -> Tensor[]", eager=_batch_p2p_ops, fake=_batch_p2p_ops_fake)


def isend(self: torch.Tensor, dst: int, group: RankTypes, tag: int = 0):
    """Send `self` to group rank `dst` of `group` (a rank within the group, FC-52); the
    result, a tensor of no elements, completes the send when waited."""
    name = resolve_group_name(group)
    # The op's `int dst` would turn a bool into 0 or 1: refuse it here (FC-53).
    _check_peer(dst, group_size(name), name, "dst")
    return _wrap(ops.isend(self, dst, _check_tag(tag, "tag"), name))


def irecv(self: torch.Tensor, src: int, group: RankTypes, tag: int = 0):
    """Receive from group rank `src` of `group` a tensor of `self`'s shape and dtype (FC-52);
    `self` is not written."""
    name = resolve_group_name(group)
    _check_peer(src, group_size(name), name, "src")
    return _wrap(ops.irecv(self, src, _check_tag(tag, "tag"), name))


def batch_p2p_ops(op_list: list[str], peer_list: list[int], tag_list: list[int],
                  tensors: list[torch.Tensor], group: RankTypes):
    """Every send and receive of the lists issued together, member i as the single op
    `op_list[i]` with `peer_list[i]`, `tag_list[i]` and `tensors[i]` (FC-52)."""
    name = resolve_group_name(group)
    # The op's `int[]` lists would turn a bool into 0 or 1: refuse it here (FC-53).
    _check_batch(op_list, peer_list, tag_list, tensors, name)
    return [_wrap(t) for t in ops.batch_p2p_ops(list(op_list), list(peer_list),
                                                 list(tag_list), tensors, name)]


# --------------------------------------------------------------------------------------
# wait_tensor
# --------------------------------------------------------------------------------------
def _wait_tensor_op(tensor):
    # The op returns a copy, never its input (FC-5): functionalization treats a custom op's
    # result as a fresh tensor, and AOTAutograd refuses custom ops whose results alias
    # their inputs (an error under CI=1 in torch 2.13, announced as the future default).
    # Upstream's own namespace is exempt from that check; refimpl's is not.
    return _wait_tensor(tensor).clone()


def _wait_tensor_fake(tensor):
    return torch.empty_like(tensor)


def _backward_wait(ctx, grad):
    return grad


_define("wait_tensor", "(Tensor tensor) -> Tensor", eager=_wait_tensor_op,
        fake=_wait_tensor_fake, backward=_backward_wait, setup_context=_no_context)


# --------------------------------------------------------------------------------------
# wait_tensor_ (FC-35): the wait of lowered programs, completing its argument in place.
# Lowered graphs run as they are (AOTAutograd never re-traces them), so their wait may
# return its input, as upstream Inductor's wait kernel does; a wait then costs no memory
# (MEM-4). Traced programs keep the copying `wait_tensor` (FC-5).
# --------------------------------------------------------------------------------------
def _wait_tensor_inplace(tensor):
    return _wait_tensor(tensor)


def _wait_tensor_inplace_fake(tensor):
    return tensor


_define("wait_tensor_", "(Tensor(a!) tensor) -> Tensor(a!)", eager=_wait_tensor_inplace,
        fake=_wait_tensor_inplace_fake)


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Wait for the collective that produces `tensor`; in eager, return `tensor` (FC-5)."""
    if isinstance(tensor, AsyncCollectiveTensor):
        return tensor.wait()
    return _waited(tensor)


def wait_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Wait for each tensor of a list, in order, as `wait_tensor` does (FC-37)."""
    tensors = _tensor_list(tensors, "tensors", "FC-37")
    return [wait_tensor(t) for t in tensors]


# torch 2.15's names of the gathers and scatters of one tensor a rank (FC-37); the names
# before them stay, the same functions (upstream's now warn that they are deprecated).
all_gather_single = all_gather_tensor
reduce_scatter_single = reduce_scatter_tensor
all_gather_single_coalesced = all_gather_into_tensor_coalesced
reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
