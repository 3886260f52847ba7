"""The operator catalogue: what every communication op is, in one place, for every pass.

One frozen row (`CommOp`) per operator of refimpl's `refimpl_c10d` and `refimpl_symm_mem`
libraries and of upstream's `_c10d_functional`, `_c10d_functional_autograd` and
`symm_mem` namespaces: its family, how it completes, whether it works in place, what it
holds in flight until its wait (MEM-5), and the bytes and algorithm the cost model
charges (SIM-2). Bucketing, lowering, reorder, memory, the simulator and the compile
backend key their behaviour by these fields, never by op names. An op of these
namespaces that refimpl deliberately leaves out is in `NOT_MODELLED` with the reason (and
what the passes do with it); an op with neither is an error wherever a pass meets it, and
`tests/test_comm_ops.py` fails, naming it, for every op the running torch registers
without one: an op is never given a default silently.

These rows are SPEC.md's op table (its appendix) written as code: SPEC is normative, and
`tests/test_ops_table.py` fails for a field of a row here that differs from the table's,
for a reason of `NOT_MODELLED` that differs from its ops left out, and for an op on one
side only. The conformance judge reads the table (`conformance/ops.py`), never these rows,
on purpose: a judge that read them could not fail them.

## Adding an operator end to end
1. Its row in SPEC.md's op table (or its reason among the ops left out), and the same row
   here (or its `NOT_MODELLED` reason); `pytest tests/test_comm_ops.py
   tests/test_ops_table.py`.
2. The SPEC.md rule that says what the op does (its section's prefix: FC, SM, ...).
3. For a refimpl op, its block in the concept module (`functional_collectives.py` or
   `symmetric_memory.py`: schema, checks, eager and fake kernel together).
4. A conformance case naming the rule (`conformance/cases/test_<section>.py`); the judge
   learns the op from the table (a column it has not met needs its question in
   `conformance/ops.py`).
5. A mutant in `tests/mutants.py` that breaks the rule (a field of the row set wrong
   will do), caught by the case: `pytest tests/test_mutants.py -k <name>`.

Implements SPEC.md FC-1, MEM-5, SIM-2, SIM-7, RO-6, RO-8 (the facts they rest on).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["CommOp", "ROWS", "NOT_MODELLED", "NotModelled", "COLLECTIVE_NAMESPACES",
           "SYMM_MEM_NAMESPACES", "NAMESPACES", "FAMILIES", "comm_op", "find", "is_wait",
           "collective_family", "targets", "not_modelled", "qualified_name"]

# Namespaces whose ops are functional collectives (issued, then completed by a wait),
# refimpl's first.
COLLECTIVE_NAMESPACES = ("refimpl_c10d", "_c10d_functional", "_c10d_functional_autograd")
# Namespaces of symmetric-memory ops (blocking kernels, refimpl's and upstream's).
SYMM_MEM_NAMESPACES = ("refimpl_symm_mem", "symm_mem")
NAMESPACES = COLLECTIVE_NAMESPACES + SYMM_MEM_NAMESPACES
# Namespaces that communicate outside this catalogue: c10d's process-group ops, which a
# traced graph holds only as opaque calls (reorder keeps them barriers, RO-6).
OTHER_COMMUNICATING_NAMESPACES = ("c10d",)
# Python functions that allocate symmetric memory without communicating (RO-6).
SYMMETRIC_ALLOCATORS = (("refimpl.symmetric_memory", "empty_strided_p2p"),
                        ("torch.distributed._symmetric_memory", "empty_strided_p2p"))

# What an op does; the collective families are also reorder's kinds (RO-8).
COLLECTIVE_FAMILIES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
                       "point_to_point")
FAMILIES = COLLECTIVE_FAMILIES + ("wait",)


@dataclass(frozen=True)
class CommOp:
    """What one communication op is. Every field is read by some pass; none is a name."""

    namespace: str
    name: str  # the schema name without its namespace: "all_reduce_"
    family: str  # one of FAMILIES
    # "wait": issued here and completed by a wait op (FC-1); "blocking": done when it
    # returns (SM-13, SIM-7); "completes": a wait, which completes others.
    completes: str
    in_place: bool = False  # writes its input (each input of a list) and returns it
    coalesced: bool = False  # a list of tensors, one member per tensor
    out: bool = False  # writes an `out` argument and returns it
    # What it holds in flight until its wait (MEM-5): "inputs" (its tensor arguments and
    # results), "result" (it copied its input when issued: FC-2, CL-2) or "per member"
    # (each member as the row of the op it is: member_in_flight); "" when nothing.
    in_flight: str = ""
    # The cost model (SIM-2): the bytes it moves ("input", "output" or "larger" of the
    # two) and the algorithm charged for them ("ring", "twice_ring", "pipeline",
    # "one_shot", "direct"); "" for what costs nothing (a wait).
    cost_bytes: str = ""
    algorithm: str = ""
    # It returns its argument although its schema says `-> Tensor` (MEM-2): upstream's
    # wait_tensor. refimpl's returns a copy (FC-5), its wait_tensor_ says `Tensor(a!)`.
    returns_argument: bool = False

    @property
    def qualified(self) -> str:
        return f"{self.namespace}::{self.name}"

    @property
    def is_collective(self) -> bool:
        """Issued now, completed by a wait (FC-1): what holds buffers in flight (MEM-5)."""
        return self.completes == "wait"

    @property
    def is_blocking(self) -> bool:
        """A symmetric-memory kernel that is done when it returns (SIM-7, RO-5)."""
        return self.completes == "blocking"


# --------------------------------------------------------------------------------------
# The rows
# --------------------------------------------------------------------------------------
_ALL_GATHER = dict(family="all_gather", completes="wait", in_flight="inputs",
                   cost_bytes="output", algorithm="ring")
_REDUCE_SCATTER = dict(family="reduce_scatter", completes="wait", in_flight="inputs",
                       cost_bytes="input", algorithm="ring")
# An all_reduce is a reduce_scatter plus an all_gather; out of place it reduces a copy.
_ALL_REDUCE = dict(family="all_reduce", completes="wait", in_flight="result",
                   cost_bytes="input", algorithm="twice_ring")
_ALL_REDUCE_ = dict(_ALL_REDUCE, in_place=True, in_flight="inputs")
_ALL_TO_ALL = dict(family="all_to_all", completes="wait", in_flight="inputs",
                   cost_bytes="larger", algorithm="ring")
_BROADCAST = dict(family="broadcast", completes="wait", in_flight="result",
                  cost_bytes="input", algorithm="pipeline")
_BROADCAST_ = dict(_BROADCAST, in_place=True, in_flight="inputs")
_P2P = dict(family="point_to_point", completes="wait", in_flight="inputs",
            cost_bytes="larger", algorithm="direct")
_WAIT = dict(family="wait", completes="completes")
_ONE_SHOT = dict(family="all_reduce", completes="blocking", cost_bytes="input",
                 algorithm="one_shot")

# The functional collectives: refimpl's schemas are upstream's (FC-1), so one list
# serves every namespace that has the op.
_FUNCTIONAL = {
    "all_gather_into_tensor": _ALL_GATHER,
    "all_gather_into_tensor_coalesced": dict(_ALL_GATHER, coalesced=True),
    "all_gather_into_tensor_out": dict(_ALL_GATHER, out=True),
    "reduce_scatter_tensor": _REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced": dict(_REDUCE_SCATTER, coalesced=True),
    "reduce_scatter_tensor_out": dict(_REDUCE_SCATTER, out=True),
    "all_reduce": _ALL_REDUCE,
    "all_reduce_": _ALL_REDUCE_,
    "all_reduce_coalesced": dict(_ALL_REDUCE, coalesced=True),
    "all_reduce_coalesced_": dict(_ALL_REDUCE_, coalesced=True),
    "all_to_all_single": _ALL_TO_ALL,
    "broadcast": _BROADCAST,
    "broadcast_": _BROADCAST_,
    "isend": _P2P,
    "irecv": _P2P,
    "batch_p2p_ops": dict(_P2P, coalesced=True),
    "wait_tensor": _WAIT,
}
_FUNCTIONAL_OF = {
    "refimpl_c10d": ("all_gather_into_tensor", "all_gather_into_tensor_coalesced",
                     "all_gather_into_tensor_out", "reduce_scatter_tensor",
                     "reduce_scatter_tensor_coalesced", "all_reduce", "all_reduce_",
                     "all_reduce_coalesced", "all_reduce_coalesced_", "all_to_all_single",
                     "broadcast", "broadcast_", "isend", "irecv", "batch_p2p_ops",
                     "wait_tensor"),
    "_c10d_functional": tuple(_FUNCTIONAL),
    # The differentiable wrappers upstream traces when a gradient flows (FC-1).
    "_c10d_functional_autograd": ("all_gather_into_tensor", "reduce_scatter_tensor",
                                  "all_to_all_single"),
}
# The blocking symmetric-memory kernels (SM-13, SM-15, SM-16, SM-24).
_SYMMETRIC = {
    "one_shot_all_reduce": _ONE_SHOT,
    "one_shot_all_reduce_out": dict(_ONE_SHOT, out=True),
    "one_shot_all_reduce_pointwise": _ONE_SHOT,
    "two_shot_all_reduce_": dict(_ONE_SHOT, in_place=True, algorithm="twice_ring"),
}
_SYMMETRIC_OF = {
    "refimpl_symm_mem": tuple(_SYMMETRIC),
    "symm_mem": ("one_shot_all_reduce", "one_shot_all_reduce_out", "two_shot_all_reduce_"),
}


def _rows() -> dict[tuple[str, str], CommOp]:
    rows = {}
    for table, of in ((_FUNCTIONAL, _FUNCTIONAL_OF), (_SYMMETRIC, _SYMMETRIC_OF)):
        for namespace, names in of.items():
            for name in names:
                rows[namespace, name] = CommOp(namespace, name, **table[name])
    # refimpl's in-place wait (FC-35), and upstream's wait, which returns its argument.
    # refimpl's irecv reads only its argument's shape and dtype: its result is the
    # buffer it receives into (FC-53), the one thing it holds in flight (MEM-5).
    rows["refimpl_c10d", "irecv"] = CommOp("refimpl_c10d", "irecv",
                                           **dict(_P2P, in_flight="result"))
    # A batch of them holds each member as its own op does (irecv's its result only).
    rows["refimpl_c10d", "batch_p2p_ops"] = CommOp(
        "refimpl_c10d", "batch_p2p_ops", **dict(_P2P, coalesced=True, in_flight="per member"))
    rows["refimpl_c10d", "wait_tensor_"] = CommOp("refimpl_c10d", "wait_tensor_", **_WAIT,
                                                  in_place=True)
    rows["_c10d_functional", "wait_tensor"] = CommOp("_c10d_functional", "wait_tensor",
                                                     **_WAIT, returns_argument=True)
    # torch 2.15: one wait for every tensor of a list (a coalesced collective's results),
    # returning them.
    rows["_c10d_functional", "wait_tensors"] = CommOp(
        "_c10d_functional", "wait_tensors", **_WAIT, coalesced=True, returns_argument=True)
    return rows


ROWS: dict[tuple[str, str], CommOp] = _rows()

# --------------------------------------------------------------------------------------
# What the project leaves out, and why
# --------------------------------------------------------------------------------------
_OPAQUE = ("a CUDA-only device op of upstream's symmetric memory that no refimpl pass emits "
           "or models: reorder keeps it a barrier (RO-6), memory reads its schema, the "
           "simulator costs it as compute")
_INTERNAL = ("refimpl's internal op: the C++ CPU kernels hand the calls they do not run "
             "themselves, and the statuses they cannot explain, to Python under this name "
             "(SM-18); never in a graph")
_UPSTREAM_SYMM = (
    "_async_input_mm", "_barrier", "_low_contention_all_gather",
    "_low_contention_all_gather_ce_multicast", "_low_contention_all_gather_ce_multicast_out",
    "_low_contention_reduce_scatter", "_rendezvous", "all_to_all_vdev", "all_to_all_vdev_2d",
    "all_to_all_vdev_2d_offset", "fused_all_gather_matmul", "fused_all_gather_scaled_matmul",
    "fused_matmul_reduce_scatter", "fused_scaled_matmul_reduce_scatter", "get_remote_tensors",
    "memcpy_to_multicast_", "memset32_", "multi_root_tile_reduce", "multimem_all_gather_out",
    "multimem_all_reduce_", "multimem_one_shot_all_reduce", "multimem_one_shot_all_reduce_out",
    "multimem_one_shot_reduce_out", "nccl_all_to_all_nd", "nccl_get", "nccl_get_out",
    "nccl_put", "nccl_put_signal", "nccl_put_with_signal", "nccl_reduce_scatter_offset",
    "nccl_wait_for_signal", "nccl_wait_signal", "nvshmem_all_to_all", "nvshmem_broadcast",
    "nvshmem_get", "nvshmem_get_out", "nvshmem_put", "nvshmem_put_with_signal",
    "nvshmem_wait_for_signal", "one_shot_all_reduce_copy", "one_shot_all_reduce_copy_out",
    "reduce_scatter_out", "stream_write_value32_", "tile_reduce", "two_shot_all_reduce_out",
)
NOT_MODELLED: dict[tuple[str, str], str] = {
    ("_c10d_functional", "_wrap_tensor_autograd"):
        "upstream's eager autograd wrapper of an in-flight tensor: never in a traced graph",
    ("refimpl_symm_mem", "barrier"):
        "a synchronisation of the ranks that moves no data (SM-17), which no pass emits: "
        "reorder keeps it a barrier (RO-6), the simulator costs it as compute (SIM-3)",
    **{("refimpl_symm_mem", f"_python_{name}"): _INTERNAL
       for name in ("one_shot_all_reduce", "one_shot_all_reduce_out", "two_shot_all_reduce_",
                    "one_shot_all_reduce_pointwise", "raise_status")},
    **{("symm_mem", name): _OPAQUE for name in _UPSTREAM_SYMM},
}


class NotModelled(LookupError):
    """An op of a catalogued namespace without a row: the message names it (and why)."""


# --------------------------------------------------------------------------------------
# Lookups
# --------------------------------------------------------------------------------------
def qualified_name(target) -> tuple[str, str] | None:
    """(namespace, schema name) of an op, overload or packet; None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace, target._schema.name.split("::", 1)[1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, name = target._qualified_op_name.split("::", 1)
        return namespace, name
    return None


def comm_op(target) -> CommOp:
    """The row of an op, overload or packet; NotModelled, naming it, when it has none."""
    key = qualified_name(target)
    row = ROWS.get(key) if key is not None else None
    if row is None:
        label = "::".join(key) if key is not None else repr(target)
        why = NOT_MODELLED.get(key)
        raise NotModelled(f"{label}: refimpl/comm_ops.py has no row for it"
                          + (f" (not modelled: {why})" if why else
                             "; add one, or its reason to NOT_MODELLED"))
    return row


def not_modelled(target) -> str | None:
    """The reason an op of a catalogued namespace is left out, or None."""
    key = qualified_name(target)
    return NOT_MODELLED.get(key) if key is not None else None


# id(op) -> (op, its row): every pass asks for the row of every node several times, and
# an OpOverload hashes in Python. The entry holds its op, so the id is never reused.
_FOUND: dict[int, tuple[torch._ops.OpOverload, CommOp | None]] = {}


def find(target) -> CommOp | None:
    """The row of a graph node's target; None for what is not a communication op of the
    catalogue (ATen, Python functions) and for an op deliberately not modelled. An op of
    a catalogued namespace with neither a row nor a reason raises NotModelled."""
    hit = _FOUND.get(id(target))
    if hit is not None and hit[0] is target:
        return hit[1]
    if not isinstance(target, torch._ops.OpOverload):
        return None
    row = _find(target)
    _FOUND[id(target)] = (target, row)
    return row


def forget_rows() -> None:
    """Drop what `find` remembers (after a test edits ROWS or NOT_MODELLED)."""
    _FOUND.clear()
    _find.cache_clear()


@functools.cache  # op overloads only: a cache of every Python callable would keep them
def _find(target: torch._ops.OpOverload) -> CommOp | None:
    key = qualified_name(target)
    if key[0] not in NAMESPACES or key in NOT_MODELLED:
        return None
    return comm_op(target)


def node_op(node: torch.fx.Node) -> CommOp | None:
    """The row of a node's target (`find`), None for a node that calls no op."""
    return find(node.target) if node.op == "call_function" else None


def is_wait(node: torch.fx.Node) -> bool:
    """A wait of any namespace, refimpl's in-place `wait_tensor_` (FC-35) included."""
    row = node_op(node)
    return row is not None and row.family == "wait"


def collective_family(node: torch.fx.Node) -> str | None:
    """The family of a collective completed by a wait (RO-8's kind), else None."""
    row = node_op(node)
    return row.family if row is not None and row.is_collective else None


@functools.cache  # read per collective node by memory and the simulator
def member_list_index(target) -> int | None:
    """The position of a coalesced op's list of member tensors: its first `Tensor[]`
    argument (3 for batch_p2p_ops, after its lists of ops, peers and tags; 0 for the
    others); None for an op without one."""
    for i, argument in enumerate(target._schema.arguments):
        if str(argument.type) == "List[Tensor]":
            return i
    return None


def member_in_flight(node, i: int) -> str:
    """What member `i` of a collective's node holds until its wait (MEM-5): its row's
    `in_flight`, or for "per member" that of the row of the op member `i` is, named by
    the schema's first `str[]` argument (batch_p2p_ops's op_list), in the same namespace."""
    row = node_op(node)
    if row.in_flight != "per member":
        return row.in_flight
    names = node.args[_op_list_index(node.target)]
    return ROWS[row.namespace, names[i]].in_flight


@functools.cache
def _op_list_index(target) -> int:
    return next(i for i, argument in enumerate(target._schema.arguments)
                if str(argument.type) == "List[str]")


def targets(**fields) -> frozenset:
    """The `.default` overloads, in every namespace the running torch has, of the rows
    whose fields equal `fields` (say `family="all_gather", coalesced=False, out=False`)."""
    found = set()
    for (namespace, name), row in ROWS.items():
        if all(getattr(row, key) == value for key, value in fields.items()):
            packet = getattr(getattr(torch.ops, namespace), name, None)
            if packet is not None:
                found.add(packet.default)
    return frozenset(found)
