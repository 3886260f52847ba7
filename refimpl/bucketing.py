"""Bucketing: merge many small collectives of one kind into one collective per bucket.

An FX graph traced from functional collectives holds one collective + wait per tensor.
FSDP-style programs issue hundreds of small all_gathers (parameters) and reduce_scatters
(gradients); each pays a fixed latency. These passes group *candidates* (an out-of-place
collective whose only user is its wait) by a key (group, dtype, reduce op), fill buckets
in graph order up to a size cap given per bucket index, and replace each bucket of two
or more by one flat collective plus the copies that lay the tensors out and cut the
results back into the original shapes (BK-1..BK-6, BK-8..BK-13).

Decisions come from one forward pass: every node carries a bitset of the buckets whose
results reach it, and each open bucket knows which buckets it reaches, so "does this
candidate depend on the open bucket?" is one AND, and merging never creates a cycle,
even across keys (BK-4). The rewrite is one stable topological pass: the merged
collective sits where the bucket's last member was, and only nodes that depend on a
member's result move after its wait (BK-7); every node of a merged bucket is tagged with
its FSDP block (BK-17). Both passes cost O(N log N) in graph size. Candidates with bad
arguments are refused before anything is rewritten (BK-16). `deduplicate_waits` removes
the repeated waits of one value, so a collective waited twice becomes a candidate (BK-18).
`dedup_fsdp_reduce_scatter` turns a sum of two reduce_scatters' results into one
reduce_scatter of the summed inputs where that is the same sum (BK-26, BK-27).
`manual_overlap_bucketing` buckets by module plans instead of caps: each plan entry's
collectives of a key become one bucket (BK-28).

In a world of real ranks the ranks agree on each bucket's cap (the smallest among them), so
cap functions that differ by rank (a profile per rank) still make one set of buckets
(BK-24).

Implements SPEC.md section "Bucketing": BK-1 .. BK-29.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx

import refimpl.functional_collectives as fc
from refimpl import _fx, comm_ops
from refimpl._errors import InternalError, require, require_type
from refimpl._world import Agreement, real_world

__all__ = ["bucket_all_gather", "bucket_reduce_scatter", "bucket_all_reduce", "plan_buckets",
           "deduplicate_waits", "dedup_fsdp_reduce_scatter", "manual_overlap_bucketing",
           "module_fqns", "Bucket", "KINDS", "BLOCK_META"]

logger = logging.getLogger("refimpl.bucketing")

aten = torch.ops.aten
refimpl_ops = torch.ops.refimpl_c10d
MiB = 1024 * 1024
CapFn = Callable[[int], float]
# node.meta key of every node of a merged bucket: (block kind, block index) (BK-17).
BLOCK_META = "refimpl_block"

# Collectives are recognized in refimpl's namespaces and in upstream's, so one pass can be
# compared with upstream's on the same graphs (BK-1); merged collectives are refimpl's.
_WAITS = comm_ops.targets(family="wait", in_place=False)  # wait_tensor of either (BK-1)
_CASTS = frozenset({aten._to_copy.default, torch.ops.prims.convert_element_type.default})


# --------------------------------------------------------------------------------------
# Kinds of collective (BK-2, BK-3)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    name: str
    targets: frozenset
    reduces: bool  # whether the op takes a reduce_op (part of the key, BK-2)


def _plain(family: str) -> frozenset:
    """The out-of-place, one-tensor collectives of `family`, every namespace's (BK-1)."""
    return comm_ops.targets(family=family, completes="wait", in_place=False, coalesced=False,
                            out=False)


KINDS = {
    "all_gather": Kind("all_gather", _plain("all_gather"), False),
    "reduce_scatter": Kind("reduce_scatter", _plain("reduce_scatter"), True),
    "all_reduce": Kind("all_reduce", _plain("all_reduce"), True),
}


def _val(node: torch.fx.Node) -> torch.Tensor:
    """A candidate's (or its input's) fake value, of static shape (BK-1)."""
    val = _fx.fake_value(node, "BK-1")
    if not isinstance(val, torch._subclasses.FakeTensor):
        raise ValueError(f"gm: node {node.name!r} has no FakeTensor in meta['val']; trace "
                         f"the graph with make_fx(tracing_mode='fake') or torch.compile [BK-19]")
    if not all(isinstance(s, int) for s in val.shape):
        raise ValueError(f"gm: node {node.name!r} has symbolic shape {tuple(val.shape)}; "
                         f"bucketing needs static shapes [BK-19]")
    return val


@dataclass(frozen=True)
class _Call:
    """A candidate's checked arguments (BK-1, BK-16)."""

    input: torch.fx.Node
    group_name: str
    group_size: int
    ranks: tuple        # the group's global ranks, ascending (FC-14)
    reduce_op: str | None


def _is_candidate(node: torch.fx.Node, kind: Kind) -> bool:
    """An out-of-place collective of `kind` whose one and only user is its wait (BK-1)."""
    if node.op != "call_function" or node.target not in kind.targets:
        return False
    if len(node.users) != 1:
        return False
    (user,) = node.users
    return user.op == "call_function" and user.target in _WAITS and user.args[0] is node


class _Groups:
    """Group names resolved once per pass: name -> global ranks (BK-16)."""

    def __init__(self):
        self.ranks: dict[str, tuple] = {}

    def of(self, node: torch.fx.Node, name) -> tuple:
        if not isinstance(name, str):
            raise ValueError(f"gm: node {node.name!r} names its group by "
                             f"{type(name).__name__}, not a constant group name str [BK-19]")
        if name not in self.ranks:
            try:
                self.ranks[name] = tuple(fc.group_ranks(name))
            except ValueError:
                raise ValueError(f"gm: node {node.name!r}: group_name {name!r} names no "
                                 f"process group of this process [BK-16]") from None
        return self.ranks[name]


def _check_call(node: torch.fx.Node, kind: Kind, groups: _Groups) -> _Call:
    """A candidate's arguments, refused unless the op itself would accept them (BK-16)."""
    args = _fx.arguments(node, "BK-16")
    ranks = groups.of(node, args["group_name"])
    size = args.get("group_size", len(ranks))
    if size != len(ranks):
        raise ValueError(f"gm: node {node.name!r}: group_size {size!r} does not match the "
                         f"size {len(ranks)} of group {args['group_name']!r} [BK-16]")
    reduce_op = None
    if kind.reduces:
        reduce_op = args["reduce_op"]
        if not isinstance(reduce_op, str) or reduce_op.lower() not in _fx.REDUCE_OPS:
            raise ValueError(f"gm: node {node.name!r}: reduce_op {reduce_op!r} is not one of "
                             f"{list(_fx.REDUCE_OPS)} [BK-16]")
    inp = args["input"]
    if not isinstance(inp, torch.fx.Node):
        raise ValueError(f"gm: node {node.name!r}: input is {type(inp).__name__}, not a node "
                         f"of the graph [BK-16]")
    _val(node)  # the candidate's own value first, so a refusal names the candidate
    _val(inp)
    return _Call(inp, args["group_name"], size, ranks, reduce_op)


def _bucket_key(node: torch.fx.Node, call: _Call, mixed_dtypes: bool) -> tuple:
    """Candidates share a bucket only if their keys are equal (BK-2)."""
    key: tuple = (call.group_name,)
    if call.reduce_op is not None:
        key += (call.reduce_op.lower(),)
    if not mixed_dtypes:
        key += (_val(node).dtype,)
    return key


def _size_bytes(node: torch.fx.Node, call: _Call) -> int:
    """What a member adds to its bucket: the larger of its input and output (BK-3)."""
    out = _val(node)
    inp = _val(call.input)
    return max(out.numel() * out.element_size(), inp.numel() * inp.element_size())


# --------------------------------------------------------------------------------------
# Planning (BK-2 .. BK-6)
# --------------------------------------------------------------------------------------
@dataclass(eq=False)
class Bucket:
    """One bucket: candidates of one key, in graph order, with its index within the key."""

    key: tuple
    index: int
    cap_bytes: int
    bit: int
    members: list = field(default_factory=list)
    calls: list = field(default_factory=list)  # each member's checked arguments (_Call)
    size_bytes: int = 0
    reaches: int = 0  # bitset of the buckets this bucket's results reach (while open)

    @property
    def inputs(self) -> list[torch.fx.Node]:
        return [call.input for call in self.calls]

    @property
    def call(self) -> _Call:
        """What every member shares: group, its size and ranks, reduce op (the key)."""
        return self.calls[0]


def _cap_bytes(cap_fn: CapFn, index: int) -> int:
    cap = cap_fn(index)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) \
            or cap <= 0:
        raise ValueError(f"bucket_cap_mb_by_bucket_idx: bucket {index} got cap {cap!r}; a "
                         f"cap must be a positive, finite number of MiB [BK-3]")
    return int(cap * MiB)


class _Caps:
    """The cap of each bucket slot (its key's family, its index within the key): this
    rank's own, asked once per slot (BK-3), or the smallest among the ranks of its group
    once they agreed on it (BK-24)."""

    def __init__(self, cap_fn: CapFn):
        self.cap_fn = cap_fn
        self.own: dict[tuple[str, int], int] = {}
        self.agreed: dict[tuple[str, int], int] = {}
        self.used: dict[tuple[str, int], int] = {}  # the cap each slot had in the last plan

    def __call__(self, slot: tuple[str, int]) -> int:
        cap = self.agreed[slot] if slot in self.agreed else self.mine(slot)
        self.used[slot] = cap
        return cap

    def mine(self, slot: tuple[str, int]) -> int:
        if slot not in self.own:
            self.own[slot] = _cap_bytes(self.cap_fn, slot[1])
        return self.own[slot]


class _Planner:
    """The single forward pass that decides the buckets of one kind (BK-3, BK-4)."""

    def __init__(self, kind: Kind, caps: _Caps, mixed_dtypes: bool, entry_of=None):
        self.kind, self.caps, self.mixed_dtypes = kind, caps, mixed_dtypes
        # With module plans (BK-28): node -> its plan entry, or None (no candidate then).
        self.entry_of = entry_of
        self.groups = _Groups()
        self.open: dict[tuple, Bucket] = {}
        self.families: dict[tuple, str] = {}  # key -> its family (_family)
        self.sizes: dict[str, list[int]] = {}  # family -> its candidates' sizes, in order
        self.buckets: list[Bucket] = []
        self.skipped = 0

    def plan(self, graph: torch.fx.Graph) -> list[Bucket]:
        reach: dict[torch.fx.Node, int] = {}  # node -> buckets whose results reach it
        for node in graph.nodes:
            mask = 0
            for inp in node.all_input_nodes:
                mask |= reach[inp]
            entry = self._entry(node)
            if entry is not False:
                bucket = self._admit(node, mask, entry)
                if bucket is not None:
                    mask |= bucket.bit
            reach[node] = mask
        return self.buckets

    def _entry(self, node: torch.fx.Node) -> int | None | bool:
        """False for no candidate (BK-1; with module plans, one outside every entry, BK-28);
        else the candidate's plan entry, None without plans. Asked once per node."""
        if not _is_candidate(node, self.kind):
            return False
        if self.entry_of is None:
            return None
        entry = self.entry_of(node)
        return False if entry is None else entry

    def _admit(self, node: torch.fx.Node, upstream: int, entry: int | None) -> Bucket | None:
        call = _check_call(node, self.kind, self.groups)
        key = _bucket_key(node, call, self.mixed_dtypes)
        if entry is not None:  # one bucket per plan entry and key (BK-28)
            key += (f"module plan entry {entry}",)
        size = _size_bytes(node, call)
        self.sizes.setdefault(self._family(key, call), []).append(size)
        bucket = self.open.get(key)
        if bucket is not None and upstream & (bucket.bit | bucket.reaches):
            # Merging would make the bucket wait for itself (BK-4).
            logger.debug("%s: %s depends on open bucket %d of %s; left alone",
                         self.kind.name, node.name, bucket.index, key)
            self.skipped += 1
            return None
        if bucket is not None and bucket.size_bytes + size > bucket.cap_bytes:
            logger.debug("%s: bucket %d of %s closed at %d bytes (cap %d, next %d)",
                         self.kind.name, bucket.index, key, bucket.size_bytes,
                         bucket.cap_bytes, size)
            bucket = self._new_bucket(key, bucket.index + 1)
        elif bucket is None:
            bucket = self._new_bucket(key, 0)
        bucket.members.append(node)
        bucket.calls.append(call)
        bucket.size_bytes += size
        if upstream:
            # New edges: every bucket feeding `node` now reaches this bucket; so does every
            # open bucket that reaches one of them. Only open buckets are asked later.
            gained = bucket.bit | bucket.reaches
            for other in self.open.values():
                if (other.bit | other.reaches) & upstream:
                    other.reaches |= gained
        return bucket

    def _family(self, key: tuple, call: _Call) -> str:
        """What names a key alike on every rank of its group: the group's global ranks
        and the rest of the key, then its place among this graph's keys that share them
        (two groups of the same ranks). Not the group name: a row of subgroups has
        another on each rank."""
        if key not in self.families:
            alike = f"ranks {list(call.ranks)} {' '.join(map(str, key[1:]))}".strip()
            place = sum(f.startswith(alike + " #") for f in self.families.values())
            self.families[key] = f"{alike} #{place}"
        return self.families[key]

    def _new_bucket(self, key: tuple, index: int) -> Bucket:
        bucket = Bucket(key, index, self.caps((self.families[key], index)),
                        1 << len(self.buckets))
        self.buckets.append(bucket)
        self.open[key] = bucket
        return bucket


def plan_buckets(gm: torch.fx.GraphModule, kind: str, bucket_cap_mb_by_bucket_idx: CapFn,
                 *, mixed_dtypes: bool = False, agree_across_ranks: bool = True
                 ) -> list[Bucket]:
    """The buckets (two or more candidates each) that the pass of `kind` would merge; in a
    world of real ranks every rank calls it on its graph, as the pass (BK-24)."""
    require(kind in KINDS, "kind", f"one of {sorted(KINDS)}", repr(kind), "BK-2")
    planner = _plan(gm, KINDS[kind], bucket_cap_mb_by_bucket_idx, mixed_dtypes,
                    agree_across_ranks)
    return [b for b in planner.buckets if len(b.members) > 1]


def _plan(gm: torch.fx.GraphModule, kind: Kind, cap_fn: CapFn, mixed_dtypes: bool,
          agree_across_ranks: bool) -> _Planner:
    """The planner that decided gm's buckets of `kind`: from this rank's caps, or, in a
    world of real ranks and a graph with collectives, from caps its ranks agreed on
    (BK-24)."""
    require_type(gm, torch.fx.GraphModule, "gm", "a torch.fx.GraphModule", "BK-19")
    if not callable(cap_fn):
        raise TypeError("bucket_cap_mb_by_bucket_idx: expected a callable bucket index -> "
                        "MiB [BK-3]")
    require_type(agree_across_ranks, bool, "agree_across_ranks", "a bool", "BK-24")
    ranks = real_world() if agree_across_ranks and _issues_collectives(gm) else ()
    if len(ranks) > 1:
        return _agreed_plan(gm, kind, _Caps(cap_fn), mixed_dtypes, ranks)
    planner = _Planner(kind, _Caps(cap_fn), mixed_dtypes)
    planner.plan(gm.graph)
    return planner


def _issues_collectives(gm: torch.fx.GraphModule) -> bool:
    """A graph any collective of which (but a point-to-point one, whose peer may be
    another pipeline stage) makes its rank take part in the world's agreement (BK-24):
    the same on every rank that runs one program, whatever its groups."""
    return any(comm_ops.collective_family(n) not in (None, "point_to_point")
               for n in gm.graph.nodes)


def _agreed_plan(gm: torch.fx.GraphModule, kind: Kind, caps: _Caps, mixed_dtypes: bool,
                 ranks: tuple[int, ...]) -> _Planner:
    """Plan until every rank's plan used the caps the ranks agreed on: per slot, the
    smallest among the ranks of its group (BK-24). Each round, every rank posts its
    candidates' sizes per family, its own cap of each slot its plan opened or another
    rank of the slot's group asked for, and the caps its plan used; a slot that every
    rank of its group posted is agreed. When every rank's plan used agreed caps only,
    every group's ranks hold one plan (one candidate sequence, one cap per slot). Smaller
    caps open more slots: a round per cascade, few in all."""
    agreement = Agreement(f"bucket_{kind.name}", ranks, "BK-24",
                          "ranks whose programs differ pass agree_across_ranks=False and "
                          "one cap function on every rank")
    asked: set[tuple[str, int]] = set()
    while True:
        planner = _Planner(kind, caps, mixed_dtypes)
        caps.used = {}
        try:
            planner.plan(gm.graph)
            own = {_slot_text(s): caps.mine(s) for s in sorted(asked | set(caps.used))
                   if s not in caps.agreed}
        except Exception as exc:  # every rank learns why this one cannot agree
            agreement.round({"error": f"{type(exc).__name__}: {exc}"})
            raise
        posts = agreement.round({"sizes": planner.sizes, "own": own,
                                 "used": {_slot_text(s): c for s, c in caps.used.items()}})
        _refuse_failed_ranks(agreement, posts)
        _refuse_other_candidates(agreement, posts)
        if all(_used_agreed_caps(post, caps.agreed) for post in posts.values()):
            return planner
        asked = {_slot(t) for post in posts.values() for t in post["own"]}
        for slot in asked:
            group = [posts[r] for r in _family_ranks(slot[0])]
            if all(_slot_text(slot) in post["own"] for post in group):
                caps.agreed[slot] = min(post["own"][_slot_text(slot)] for post in group)
        asked = {s for s in asked - set(caps.agreed) if agreement.me in _family_ranks(s[0])}


def _slot_text(slot: tuple[str, int]) -> str:
    return f"{slot[0]} bucket {slot[1]}"


def _slot(text: str) -> tuple[str, int]:
    family, index = text.rsplit(" bucket ", 1)
    return family, int(index)


def _family_ranks(family: str) -> list[int]:
    """The global ranks of a family's group: what `_family` wrote first."""
    return json.loads(family[len("ranks "):family.index("]") + 1])


def _used_agreed_caps(post: dict, agreed: dict[tuple[str, int], int]) -> bool:
    return all(agreed.get(_slot(t)) == cap for t, cap in post["used"].items())


def _refuse_failed_ranks(agreement: Agreement, posts: dict[int, dict]) -> None:
    failed = {r: post["error"] for r, post in posts.items() if "error" in post}
    if failed:
        rank, error = next(iter(failed.items()))
        raise ValueError(
            f"bucket_cap_mb_by_bucket_idx: {agreement.what}: global ranks {list(failed)} "
            f"could not plan (global rank {rank}: {error}); every rank refuses, as the "
            f"others cannot bucket alike without their caps [BK-24]")


def _refuse_other_candidates(agreement: Agreement, posts: dict[int, dict]) -> None:
    """ValueError on every rank when ranks of one group hold other candidates of a key
    (other sizes, or none): no cap makes their buckets one."""
    for family in sorted({f for post in posts.values() for f in post["sizes"]}):
        seen = {r: posts[r]["sizes"].get(family) for r in _family_ranks(family)}
        if len({repr(sizes) for sizes in seen.values()}) > 1:
            raise ValueError(
                f"gm: {agreement.what}: the ranks of one group hold other candidates of "
                f"{family} (sizes in bytes by global rank: {seen}): their buckets cannot "
                f"be made alike; {agreement.remedy} [BK-24]")


# --------------------------------------------------------------------------------------
# Building a bucket's layout nodes with cheap metadata. Fake-tensor dispatch costs ~0.3 ms
# per op on a small machine; shapes of these few ops are simple, so vals are made by hand
# (comm_lowering's builder, by contrast, runs each op's fake kernel).
# --------------------------------------------------------------------------------------
def _contiguous_strides(shape) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


_NODE_NAMES = {
    aten.view.default: "view", aten.reshape.default: "reshape", aten.cat.default: "cat",
    aten.split_with_sizes.default: "split_with_sizes", operator.getitem: "getitem",
    aten.clone.default: "clone", aten._unsafe_view.default: "_unsafe_view",
    aten.empty.memory_format: "empty", aten.slice.Tensor: "slice", aten.copy_.default: "copy_",
    aten._to_copy.default: "_to_copy", aten.view.dtype: "view_dtype",
    aten.constant_pad_nd.default: "constant_pad_nd",
}


def _node_name(target) -> str:
    """A created node's name: its op's (a collective's from its row, comm_ops)."""
    row = comm_ops.find(target)
    return row.name if row is not None else _NODE_NAMES.get(target, "bucketed")


class _LayoutBuilder:
    """Creates one bucket's nodes at the graph's insertion point, fake values made by hand.

    Every node it creates is tagged with the bucket's FSDP block (BK-17): the kind of the
    bucket until the merged wait, the kind's `_wait` block from the wait on.
    """

    def __init__(self, graph: torch.fx.Graph, like: torch.Tensor, block: tuple[str, int]):
        self.graph = graph
        self.fake_mode = like.fake_mode
        self.device = like.device
        self.block = block

    def fake(self, shape, dtype, strides=None) -> torch.Tensor:
        shape = [int(s) for s in shape]
        strides = _contiguous_strides(shape) if strides is None else strides
        meta = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
        return torch._subclasses.FakeTensor(self.fake_mode, meta, self.device)

    def call(self, target, args, kwargs=None, val=None) -> torch.fx.Node:
        # Naming the node after its op saves FX deriving a name from the target, which
        # costs more than creating the node itself.
        name = _node_name(target)
        node = self.graph.create_node("call_function", target, tuple(args), kwargs or {},
                                      name=name)
        node.meta["val"] = val
        node.meta[BLOCK_META] = self.block
        self.last = node
        return node

    def flat(self, node: torch.fx.Node) -> torch.fx.Node:
        val = node.meta["val"]
        if val.dim() == 1 and val.is_contiguous():
            return node
        op = aten.view.default if val.is_contiguous() else aten.reshape.default
        return self.call(op, (node, [-1]), val=self.fake([val.numel()], val.dtype))

    def view(self, node: torch.fx.Node, shape, shown=None) -> torch.fx.Node:
        """A contiguous `node` seen as `shape` (`shown`: the shape as written, e.g. -1)."""
        val = node.meta["val"]
        return self.call(aten.view.default, (node, list(shown or shape)),
                         val=self.fake(shape, val.dtype))

    def cat(self, nodes, dim: int, dtype) -> torch.fx.Node:
        vals = [n.meta["val"] for n in nodes]
        shape = list(vals[0].shape)
        shape[dim] = sum(v.shape[dim] for v in vals)
        args = (list(nodes),) if dim == 0 else (list(nodes), dim)
        return self.call(aten.cat.default, args, val=self.fake(shape, dtype))

    def split(self, node: torch.fx.Node, sizes, dim: int) -> list[torch.fx.Node]:
        """Pieces of `node` along `dim` (views: they keep the parent's strides)."""
        val = node.meta["val"]
        strides = list(val.stride())
        pieces = []
        for size in sizes:
            shape = list(val.shape)
            shape[dim] = size
            pieces.append(self.fake(shape, val.dtype, strides))
        args = (node, list(sizes)) if dim == 0 else (node, list(sizes), dim)
        parts = self.call(aten.split_with_sizes.default, args, val=tuple(pieces))
        return [self.call(operator.getitem, (parts, i), val=v) for i, v in enumerate(pieces)]

    def wait(self, node: torch.fx.Node) -> torch.fx.Node:
        kind, index = self.block
        self.block = (f"{kind}_wait", index)  # the wait opens the bucket's wait block
        return self.call(refimpl_ops.wait_tensor.default, (node,), val=node.meta["val"])


# --------------------------------------------------------------------------------------
# Merged collectives (BK-8 .. BK-13)
# --------------------------------------------------------------------------------------
def _group_index(bucket: Bucket, needed_for: str, rule: str) -> int:
    """This rank's index in the bucket's group: its position among the group's sorted
    global ranks (rank 3 of [1, 3] is index 1), which `needed_for` depends on."""
    import torch.distributed as dist

    call = bucket.call
    me = dist.get_rank()
    if me not in call.ranks:
        raise ValueError(f"gm: node {bucket.members[-1].name!r}: {needed_for} needs this "
                         f"rank's index in group {call.group_name!r} (ranks "
                         f"{list(call.ranks)}), and rank {me} is not in it; run the pass on "
                         f"a rank of the group [{rule}]")
    return call.ranks.index(me)


def _absorbable_cast(node: torch.fx.Node) -> bool:
    """A floating-point cast whose only user is the all_gather it feeds: the bucket's copy
    can do it (BK-9)."""
    if node.op != "call_function" or node.target not in _CASTS or len(node.users) != 1:
        return False
    if node.target is aten._to_copy.default and set(node.kwargs) - {"dtype"}:
        return False
    src = node.args[0]
    return (isinstance(src, torch.fx.Node) and src.meta["val"].dtype.is_floating_point
            and node.meta["val"].dtype.is_floating_point)


@dataclass
class _MergeOptions:
    mixed_dtypes: bool = False
    use_out_variant: bool = True
    batch_casts: bool = True
    agree_across_ranks: bool = True
    coalesced: bool = False


def _absorbs_cast(inp: torch.fx.Node, opts: _MergeOptions) -> bool:
    """Whether the bucket's copy-in does the cast producing this all_gather input (BK-9)."""
    return opts.batch_casts and not opts.mixed_dtypes and _absorbable_cast(inp)


def _all_gather_sources(bucket: Bucket, opts: _MergeOptions) -> list[torch.fx.Node]:
    """What the copy-in reads: each member's input, or the source of its absorbed cast."""
    return [inp.args[0] if _absorbs_cast(inp, opts) else inp for inp in bucket.inputs]


def _merge_all_gather(b: _LayoutBuilder, bucket: Bucket, opts: _MergeOptions) -> list:
    group_size, name = bucket.call.group_size, bucket.call.group_name
    out_vals = [_val(ag) for ag in bucket.members]
    sources = _all_gather_sources(bucket, opts)
    if opts.mixed_dtypes:
        # One byte buffer holds every dtype; each piece is viewed back afterwards (BK-12).
        dtype = torch.uint8
        sizes = [s.meta["val"].numel() * s.meta["val"].element_size() for s in sources]
    else:
        dtype = out_vals[0].dtype
        sizes = [s.meta["val"].numel() for s in sources]
    total = sum(sizes)
    if opts.use_out_variant:
        index = _group_index(bucket, "the copy-in of an all_gather bucket (use_out_variant)",
                             "BK-8")
        buf = b.call(aten.empty.memory_format, ([group_size * total],),
                     {"dtype": dtype, "device": b.device, "pin_memory": False},
                     val=b.fake([group_size * total], dtype))
        slot = b.call(aten.slice.Tensor, (buf, 0, index * total, (index + 1) * total),
                      val=b.fake([total], dtype))
    flats = [b.flat(s) for s in sources]
    if opts.mixed_dtypes:
        flats = [_bytes_view(b, f) for f in flats]
    if opts.use_out_variant:
        cat = b.cat(flats, 0, _promoted(flats))
        # copy_ converts as it copies: the casts of the whole bucket are this one copy.
        filled = b.call(aten.copy_.default, (slot, cat), val=slot.meta["val"])
        gathered = b.call(refimpl_ops.all_gather_into_tensor_out.default,
                          (filled, group_size, name), {"out": buf}, val=buf.meta["val"])
    else:
        cat = b.cat(flats, 0, _promoted(flats))
        if cat.meta["val"].dtype != dtype:
            cat = b.call(aten._to_copy.default, (cat,), {"dtype": dtype},
                         val=b.fake([total], dtype))
        gathered = b.call(refimpl_ops.all_gather_into_tensor.default,
                          (cat, group_size, name), val=b.fake([group_size * total], dtype))
    waited = b.wait(gathered)
    rows = b.view(waited, [group_size, total], [group_size, -1])
    outs = []
    for piece, val in zip(b.split(rows, sizes, 1), out_vals, strict=True):
        copied = b.call(aten.clone.default, (piece,),
                        {"memory_format": torch.contiguous_format},
                        val=b.fake(piece.meta["val"].shape, dtype))
        if opts.mixed_dtypes:
            copied = _dtype_view(b, copied, val.dtype)
        outs.append(b.call(aten._unsafe_view.default, (copied, list(val.shape)),
                           val=b.fake(val.shape, val.dtype)))
    return outs


def _promoted(nodes) -> torch.dtype:
    dtype = nodes[0].meta["val"].dtype
    for n in nodes[1:]:
        dtype = torch.promote_types(dtype, n.meta["val"].dtype)
    return dtype


def _bytes_view(b: _LayoutBuilder, flat: torch.fx.Node) -> torch.fx.Node:
    val = flat.meta["val"]
    if val.dtype == torch.uint8:
        return flat
    return b.call(aten.view.dtype, (flat, torch.uint8),
                  val=b.fake([val.numel() * val.element_size()], torch.uint8))


def _dtype_view(b: _LayoutBuilder, node: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    val = node.meta["val"]
    if dtype == torch.uint8:
        return node
    shape = list(val.shape)
    shape[-1] = shape[-1] // dtype.itemsize
    return b.call(aten.view.dtype, (node, dtype), val=b.fake(shape, dtype))


def _padded_rows(rows: int, group_size: int) -> int:
    return -(-rows // group_size) * group_size


def _padded_input(b: _LayoutBuilder, inp: torch.fx.Node, group_size: int) -> torch.fx.Node:
    """`inp` with dim 0 padded to a multiple of the group size, so every rank's chunk
    lines up (BK-23); `inp` itself where it needs none."""
    val = _val(inp)
    rows = _padded_rows(val.shape[0], group_size)
    if rows == val.shape[0]:
        return inp
    pad = [0, 0] * (val.dim() - 1) + [0, rows - val.shape[0]]
    return b.call(aten.constant_pad_nd.default, (inp, pad, 0.0),
                  val=b.fake([rows, *val.shape[1:]], val.dtype))


def _merge_reduce_scatter(b: _LayoutBuilder, bucket: Bucket, opts: _MergeOptions) -> list:
    if opts.coalesced:
        return _merge_reduce_scatter_coalesced(b, bucket)
    call = bucket.call
    reduce_op, group_size, name = call.reduce_op, call.group_size, call.group_name
    dtype = _val(bucket.members[0]).dtype
    laid_out, sizes, shapes, real_rows = [], [], [], []
    for inp in bucket.inputs:
        val = _val(inp)
        rows = _padded_rows(val.shape[0], group_size)
        inp = _padded_input(b, inp, group_size)
        if not inp.meta["val"].is_contiguous():
            inp = b.call(aten.clone.default, (inp,), {"memory_format": torch.contiguous_format},
                         val=b.fake(inp.meta["val"].shape, val.dtype))
        per_rank = rows * math.prod(val.shape[1:]) // group_size
        # Row i of [group_size, per_rank] is the chunk that group rank i receives.
        laid_out.append(b.view(inp, [group_size, per_rank], [group_size, -1]))
        sizes.append(per_rank)
        shapes.append([rows // group_size, *val.shape[1:]])
        real_rows.append(val.shape[0])
    total = sum(sizes)
    chunk_cat = b.cat(laid_out, 1, dtype)
    flat = b.view(chunk_cat, [group_size * total])
    scattered = b.call(refimpl_ops.reduce_scatter_tensor.default,
                       (flat, reduce_op, group_size, name), val=b.fake([total], dtype))
    waited = b.wait(scattered)
    outs = []
    for piece, shape, rows in zip(b.split(waited, sizes, 0), shapes, real_rows, strict=True):
        out = b.view(piece, shape)
        if rows % group_size:
            out = _unpad(b, out, rows, bucket)
        outs.append(out)
    return outs


def _merge_reduce_scatter_coalesced(b: _LayoutBuilder, bucket: Bucket) -> list:
    """One `reduce_scatter_tensor_coalesced` of the members' own inputs (no copy into a
    bucket buffer), then a getitem and a wait per member (BK-25): upstream 2.15's
    "coalesced" mode. An input whose dim 0 the group size does not divide is padded and
    its chunk cut as in BK-23."""
    call = bucket.call
    group_size = call.group_size
    inputs = [_padded_input(b, inp, group_size) for inp in bucket.inputs]
    results = tuple(b.fake([_val(i).shape[0] // group_size, *_val(i).shape[1:]], _val(i).dtype)
                    for i in inputs)
    scattered = b.call(refimpl_ops.reduce_scatter_tensor_coalesced.default,
                       (inputs, call.reduce_op, group_size, call.group_name), val=results)
    pieces = [b.call(operator.getitem, (scattered, i), val=v) for i, v in enumerate(results)]
    outs = []
    for piece, inp in zip(pieces, bucket.inputs, strict=True):
        out = b.wait(piece)
        rows = _val(inp).shape[0]
        outs.append(_unpad(b, out, rows, bucket) if rows % group_size else out)
    return outs


def _unpad(b: _LayoutBuilder, out: torch.fx.Node, rows: int, bucket: Bucket):
    """This rank's chunk of a padded input: the rows of its index that are real data."""
    chunk = out.meta["val"].shape[0]
    start = _group_index(bucket, "cutting a padded reduce_scatter input's chunk",
                         "BK-10") * chunk
    keep = max(0, min(chunk, rows - start))
    shape = [keep, *out.meta["val"].shape[1:]]
    return b.call(aten.slice.Tensor, (out, 0, 0, keep),
                  val=b.fake(shape, out.meta["val"].dtype, list(out.meta["val"].stride())))


def _merge_all_reduce(b: _LayoutBuilder, bucket: Bucket, opts: _MergeOptions) -> list:
    reduce_op, name = bucket.call.reduce_op, bucket.call.group_name
    dtype = _val(bucket.members[0]).dtype
    flats = [b.flat(inp) for inp in bucket.inputs]
    sizes = [f.meta["val"].numel() for f in flats]
    cat = b.cat(flats, 0, dtype)
    reduced = b.call(refimpl_ops.all_reduce.default, (cat, reduce_op, name),
                     val=b.fake([sum(sizes)], dtype))
    waited = b.wait(reduced)
    return [b.view(piece, list(_val(ar).shape))
            for piece, ar in zip(b.split(waited, sizes, 0), bucket.members, strict=True)]


_MERGERS = {"all_gather": _merge_all_gather, "reduce_scatter": _merge_reduce_scatter,
            "all_reduce": _merge_all_reduce}


# --------------------------------------------------------------------------------------
# Rewriting: one stable topological pass, in place (BK-7)
# --------------------------------------------------------------------------------------
def _stable_order(nodes: list, kind: Kind, buckets: list[Bucket], opts: _MergeOptions) -> list:
    """Plain nodes and buckets in the topological order closest to the original one.

    A bucket stands where its last member was. Kahn's algorithm always takes the ready unit
    of smallest original position, so a node moves only if it waits for a bucket: then it
    comes right after the merged wait, still in its original order among the moved ones.
    """
    position = {n: i for i, n in enumerate(nodes)}
    unit_of: dict[torch.fx.Node, object] = {n: n for n in nodes}
    bucket_inputs: dict[Bucket, list[torch.fx.Node]] = {}
    for bucket in buckets:
        sources = (_all_gather_sources(bucket, opts) if kind.name == "all_gather"
                   else bucket.inputs)
        for member, inp, source in zip(bucket.members, bucket.inputs, sources, strict=True):
            unit_of[member] = unit_of[next(iter(member.users))] = bucket
            if source is not inp:
                unit_of[inp] = bucket  # the absorbed cast
        bucket_inputs[bucket] = sources

    def priority(unit) -> int:
        return position[unit.members[-1]] if isinstance(unit, Bucket) else position[unit]

    units = list(dict.fromkeys(unit_of[n] for n in nodes))
    waiting_on: dict[object, int] = {}
    dependents: dict[object, list] = {u: [] for u in units}
    for unit in units:
        inputs = bucket_inputs[unit] if isinstance(unit, Bucket) else unit.all_input_nodes
        deps = {unit_of[i] for i in inputs} - {unit}
        waiting_on[unit] = len(deps)
        for dep in deps:
            dependents[dep].append(unit)
    index_of = {u: i for i, u in enumerate(units)}
    ready = [(priority(u), i) for i, u in enumerate(units) if waiting_on[u] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, index = heapq.heappop(ready)
        unit = units[index]
        order.append(unit)
        for user in dependents[unit]:
            waiting_on[user] -= 1
            if waiting_on[user] == 0:
                heapq.heappush(ready, (priority(user), index_of[user]))
    if len(order) != len(units):
        raise InternalError("bucketing: the merged graph would have a cycle [BK-4]")
    return order


def _rewrite(gm: torch.fx.GraphModule, kind: Kind, buckets: list[Bucket],
             opts: _MergeOptions, recompile: bool) -> None:
    """Relink the graph's nodes in the stable order, building each bucket in its place."""
    graph = gm.graph
    order = _stable_order(list(graph.nodes), kind, buckets, opts)
    block_index = _first_free_block_index(graph, kind.name)
    absorbed: dict[int, int] = {}  # block of an earlier pass -> the block that merged it
    dead: list[torch.fx.Node] = []
    replacement: dict[torch.fx.Node, torch.fx.Node] = {}  # old wait -> member's new output
    cursor = None
    for unit in order:
        if isinstance(unit, torch.fx.Node):
            if cursor is not None and cursor.next is not unit:
                cursor.append(unit)  # moves `unit` right after `cursor`
            cursor = unit
            continue
        # One builder per bucket: its device and fake mode, its block (BK-17).
        builder = _LayoutBuilder(graph, _val(unit.members[0]), (kind.name, block_index))
        block_index += 1
        with graph.inserting_before(cursor.next):
            outs = _MERGERS[kind.name](builder, unit, opts)
        for member, inp, out in zip(unit.members, unit.inputs, outs, strict=True):
            if BLOCK_META in member.meta:
                absorbed[member.meta[BLOCK_META][1]] = builder.block[1]
            wait = next(iter(member.users))
            replacement[wait] = out
            dead += [wait, member]
            if kind.name == "all_gather" and _absorbs_cast(inp, opts):
                dead.append(inp)
        cursor = builder.last
    _replace_uses(replacement)
    for node in dead:
        graph.erase_node(node)
    _retag(graph, kind.name, absorbed)
    graph.lint()
    if recompile:
        gm.recompile()


def _first_free_block_index(graph: torch.fx.Graph, kind: str) -> int:
    """Blocks of `kind` are numbered on from those an earlier pass left in the graph."""
    used = [n.meta[BLOCK_META][1] for n in graph.nodes
            if n.meta.get(BLOCK_META, ("", 0))[0] == kind]
    return max(used) + 1 if used else 0


def _retag(graph: torch.fx.Graph, kind: str, absorbed: dict[int, int]) -> None:
    """The rest of a block whose collective a new bucket merged joins the new block."""
    if not absorbed:
        return
    for node in graph.nodes:
        tag = node.meta.get(BLOCK_META)
        if tag is not None and tag[0] in (kind, f"{kind}_wait") and tag[1] in absorbed:
            node.meta[BLOCK_META] = (tag[0], absorbed[tag[1]])


def _replace_uses(replacement: dict[torch.fx.Node, torch.fx.Node]) -> None:
    """Point every user of an old wait at its new output, rewriting each user once.

    (`replace_all_uses_with` rescans a user's whole argument list per replaced node, which
    is quadratic for a user such as the output node that takes every wait.)
    """
    users = dict.fromkeys(u for old in replacement for u in old.users)
    swap = lambda n: replacement.get(n, n)
    for user in users:
        user.args = torch.fx.node.map_arg(user.args, swap)
        user.kwargs = torch.fx.node.map_arg(user.kwargs, swap)


def _bucket(gm: torch.fx.GraphModule, kind: Kind, cap_fn: CapFn, opts: _MergeOptions,
            recompile: bool) -> None:
    planner = _plan(gm, kind, cap_fn, opts.mixed_dtypes, opts.agree_across_ranks)
    buckets = [b for b in planner.buckets if len(b.members) > 1]
    merged = sum(len(b.members) for b in buckets)
    candidates = sum(len(b.members) for b in planner.buckets) + planner.skipped
    logger.info("%s: %d candidates, %d merged into %d buckets, %d left alone as dependent",
                kind.name, candidates, merged, len(buckets), planner.skipped)
    for bucket in buckets:
        logger.debug("%s: bucket %d of %s: %d members, %d bytes (cap %d)", kind.name,
                     bucket.index, bucket.key, len(bucket.members), bucket.size_bytes,
                     bucket.cap_bytes)
    if buckets:
        _rewrite(gm, kind, buckets, opts, recompile)


# --------------------------------------------------------------------------------------
# Public passes
# --------------------------------------------------------------------------------------
def bucket_all_gather(gm: torch.fx.GraphModule, bucket_cap_mb_by_bucket_idx: CapFn, *,
                      mixed_dtypes: bool = False, use_out_variant: bool = True,
                      batch_casts: bool = True, agree_across_ranks: bool = True,
                      recompile: bool = True) -> None:
    """Merge all_gathers of one (group, dtype) into buckets, in place (BK-1..BK-9, BK-12).

    `bucket_cap_mb_by_bucket_idx(i)` is the cap in MiB of the i-th bucket of a key.
    `mixed_dtypes` lets one bucket hold several dtypes through a byte view (BK-12).
    `use_out_variant` copies the inputs into this rank's slot of the gathered buffer and
    gathers in place (FSDP's layout; needs the process group), else concatenates and
    gathers out of place (BK-8). `batch_casts` folds the casts feeding the gathers into
    the bucket's one copy (BK-9). `agree_across_ranks`: in a world of real ranks, every
    rank plans from the smallest cap among the ranks for each bucket, so all make the
    same buckets whatever their cap functions say (BK-24); False for ranks whose graphs
    differ (each then needs a cap function giving what the others' give).
    `recompile=False` leaves regenerating gm's code to the caller (one `gm.recompile()`
    after several passes); the graph itself is complete.
    """
    _bucket(gm, KINDS["all_gather"], bucket_cap_mb_by_bucket_idx,
            _MergeOptions(mixed_dtypes, use_out_variant, batch_casts, agree_across_ranks),
            recompile)


def _refuse_mixed(mixed_dtypes: bool, what: str) -> None:
    if mixed_dtypes:
        raise ValueError(f"mixed_dtypes: a {what} reduces values, and a byte view of several "
                         f"dtypes cannot be reduced; only all_gather buckets mix dtypes [BK-12]")


def bucket_reduce_scatter(gm: torch.fx.GraphModule, bucket_cap_mb_by_bucket_idx: CapFn, *,
                          mixed_dtypes: bool = False, agree_across_ranks: bool = True,
                          coalesced: bool = False, recompile: bool = True) -> None:
    """Merge reduce_scatters of one (group, reduce op, dtype), in place (BK-1..BK-7, BK-10);
    `agree_across_ranks` as bucket_all_gather's (BK-24). `coalesced` makes a bucket one
    `reduce_scatter_tensor_coalesced` of the members' own inputs, a getitem and a wait
    each, instead of one reduce_scatter of a chunk-cat copy (BK-25)."""
    _refuse_mixed(mixed_dtypes, "reduce_scatter")
    require_type(coalesced, bool, "coalesced", "a bool", "BK-25")
    _bucket(gm, KINDS["reduce_scatter"], bucket_cap_mb_by_bucket_idx,
            _MergeOptions(agree_across_ranks=agree_across_ranks, coalesced=coalesced),
            recompile)


def bucket_all_reduce(gm: torch.fx.GraphModule, bucket_cap_mb_by_bucket_idx: CapFn, *,
                      mixed_dtypes: bool = False, agree_across_ranks: bool = True,
                      recompile: bool = True) -> None:
    """Merge all_reduces of one (group, reduce op, dtype), in place (BK-1..BK-7, BK-11);
    `agree_across_ranks` as bucket_all_gather's (BK-24)."""
    _refuse_mixed(mixed_dtypes, "all_reduce")
    _bucket(gm, KINDS["all_reduce"], bucket_cap_mb_by_bucket_idx,
            _MergeOptions(agree_across_ranks=agree_across_ranks), recompile)


# --------------------------------------------------------------------------------------
# Repeated waits (BK-18)
# --------------------------------------------------------------------------------------
# Waits of one tensor: refimpl's and upstream's wait_tensor (not the list form, nor
# refimpl's in-place wait_tensor_).
_SINGLE_WAITS = comm_ops.targets(family="wait", in_place=False, coalesced=False)


def _is_single_wait(node) -> bool:
    return (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target in _SINGLE_WAITS)


def _may_write(node: torch.fx.Node) -> bool:
    """Whether `node` may write a tensor in place: an op whose schema marks an argument
    written (`is_mutable`), or anything whose schema is unknown (a Python function, a
    method, a module, a higher-order op)."""
    if node.op in ("placeholder", "output", "get_attr"):
        return False
    if node.op != "call_function":
        return True
    if node.target is operator.getitem:
        return False
    schema = getattr(node.target, "_schema", None)
    return schema is None or schema.is_mutable


def deduplicate_waits(gm: torch.fx.GraphModule, *, recompile: bool = True) -> int:
    """Remove the waits that wait for nothing, in place; returns how many (BK-18).

    A wait is redundant when an earlier wait already waited for the same value: the same
    argument, or the result of that wait (a wait of a wait). Its users then read the
    earlier wait. A wait stays when any node after the earlier wait may write a tensor in
    place: refimpl's wait returns a copy (FC-5), so a write could tell the two results
    apart, and a collective that writes its argument makes it pending again.
    """
    require_type(gm, torch.fx.GraphModule, "gm", "a torch.fx.GraphModule", "BK-18")
    nodes = list(gm.graph.nodes)
    last_write = max((i for i, n in enumerate(nodes) if _may_write(n)), default=-1)
    first_wait: dict[torch.fx.Node, tuple[int, torch.fx.Node]] = {}  # value: (at, wait)
    removed = 0
    for position, node in enumerate(nodes):
        if not _is_single_wait(node):
            continue
        waited = node.args[0]
        while _is_single_wait(waited):  # a wait of a wait waits for the first one's value
            waited = waited.args[0]
        earlier = first_wait.setdefault(waited, (position, node))
        if earlier[1] is node or last_write > earlier[0]:
            continue
        node.replace_all_uses_with(earlier[1])
        gm.graph.erase_node(node)
        removed += 1
    if removed:
        logger.debug("deduplicate_waits: removed %d repeated waits", removed)
        if recompile:
            gm.recompile()
    return removed


# --------------------------------------------------------------------------------------
# Summed reduce_scatters (BK-26, BK-27)
# --------------------------------------------------------------------------------------
# Reductions for which RS(a) + RS(b) == RS(a + b) elementwise in exact arithmetic.
_LINEAR_REDUCE_OPS = ("sum", "avg")


def _summed_reduce_scatter(wait) -> tuple[torch.fx.Node, dict] | None:
    """The reduce_scatter a summand waits for, and its arguments, if the pair (collective,
    wait) is read by the sum alone (BK-26)."""
    if not _is_single_wait(wait) or len(wait.users) != 1:
        return None
    collective = wait.args[0]
    if not (isinstance(collective, torch.fx.Node)
            and _is_candidate(collective, KINDS["reduce_scatter"])):
        return None
    return collective, _fx.arguments(collective, "BK-26")


def _same_sum(a: dict, b: dict) -> bool:
    """Whether RS(x) + RS(y) == RS(x + y) for these two calls: one group, one linear
    reduce op, inputs of one dtype and shape (BK-26; a shape that broadcasts reads another
    rank's rows, BK-27)."""
    if not all(isinstance(call["input"], torch.fx.Node) for call in (a, b)):
        return False
    op_a, op_b = (str(call["reduce_op"]).lower() for call in (a, b))
    x, y = _val(a["input"]), _val(b["input"])
    return (a["group_name"] == b["group_name"] and a["group_size"] == b["group_size"]
            and op_a == op_b and op_a in _LINEAR_REDUCE_OPS
            and x.dtype == y.dtype and x.shape == y.shape)


def _plain_add(node: torch.fx.Node) -> bool:
    """`aten.add.Tensor(x, y)` of two nodes, alpha 1 (BK-26)."""
    return (node.op == "call_function" and node.target is aten.add.Tensor
            and len(node.args) == 2 and all(isinstance(a, torch.fx.Node) for a in node.args)
            and node.kwargs.get("alpha", 1) == 1)


def _merge_summands(graph: torch.fx.Graph, add: torch.fx.Node) -> bool:
    """Rewrite add(wait(RS(a)), wait(RS(b))) as wait(RS(a + b)) at the add, if it is the
    same sum (BK-26, BK-27); whether it did."""
    if not _plain_add(add):
        return False
    summands = [_summed_reduce_scatter(w) for w in add.args]
    if None in summands or summands[0][0] is summands[1][0]:
        return False
    (first, a), (second, b) = summands
    if not _same_sum(a, b):
        return False
    x, y = a["input"], b["input"]
    with graph.inserting_before(add):
        combined = graph.call_function(aten.add.Tensor, (x, y))
        with _val(x).fake_mode:
            combined.meta["val"] = _val(x) + _val(y)
        collective = graph.call_function(
            first.target, (combined,) + tuple(first.args[1:]), dict(first.kwargs))
        collective.meta["val"] = first.meta["val"]
        wait = graph.call_function(add.args[0].target, (collective,))
        wait.meta["val"] = add.args[0].meta["val"]
    add.replace_all_uses_with(wait)
    for node in (add, *add.args, first, second):  # the sum, the waits, the collectives
        graph.erase_node(node)
    return True


def dedup_fsdp_reduce_scatter(gm: torch.fx.GraphModule, *, recompile: bool = True) -> int:
    """Replace each sum of two reduce_scatters' results by one reduce_scatter of the summed
    inputs, in place, until none is left; returns how many reduce_scatters it removed
    (BK-26). Only where the sum is the same in exact arithmetic (BK-27): one group, reduce
    op sum or avg, inputs of one dtype and one shape, each collective and wait read by the
    sum alone. A tree of N summed reduce_scatters becomes one. The sum is then rounded
    before the reduction rather than after: not bit for bit in a floating dtype."""
    require_type(gm, torch.fx.GraphModule, "gm", "a torch.fx.GraphModule", "BK-26")
    removed = 0
    for add in list(gm.graph.nodes):  # a merged pair's wait is read by the next add on
        removed += _merge_summands(gm.graph, add)
    if removed:
        logger.debug("dedup_fsdp_reduce_scatter: removed %d reduce_scatters", removed)
        if recompile:
            gm.recompile()
    return removed


# --------------------------------------------------------------------------------------
# Module plans (BK-28)
# --------------------------------------------------------------------------------------
# A root module's name in Dynamo's module stacks: L['self'] (the argument's name).
_ROOT = re.compile(r"^L\[['\"][^'\"]*['\"]\]\.?")
_ACCESSOR = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")
# A cap no bucket of a plan entry reaches: an entry's collectives are one bucket (BK-28).
_UNBOUNDED_MIB = float(2**40)


def _clean_fqn(path: str) -> str:
    """Dynamo's path of a module ("L['self'].layers[0]._modules['attn']") as its FQN
    ("layers.0.attn")."""
    path = _ROOT.sub("", path).replace("._modules", "")
    return _ACCESSOR.sub(r".\1", path).strip(".").replace("..", ".")


def module_fqns(node: torch.fx.Node) -> list[str]:
    """The FQNs of the modules whose forward computed `node`, outermost first: Dynamo's
    `nn_module_stack`, or, in a backward graph, the `fwd_nn_module_stack` AOTAutograd
    copies from the forward node it differentiates (BK-28)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    return [_clean_fqn(path) for path, _type in stack.values()]


def _plan_entries(module_bucket_plans) -> list[tuple[str, ...]]:
    """The plan's entries as tuples of FQNs, refused unless they are disjoint (BK-29)."""
    if not isinstance(module_bucket_plans, (list, tuple)):
        raise TypeError(f"module_bucket_plans: expected a list of module FQNs or of lists "
                        f"of them, got {type(module_bucket_plans).__name__} [BK-29]")
    entries = [(e,) if isinstance(e, str) else tuple(e) for e in module_bucket_plans]
    fqns = [fqn for entry in entries for fqn in entry]
    if not all(isinstance(fqn, str) and fqn for fqn in fqns) or not all(entries):
        raise TypeError("module_bucket_plans: every entry is a module FQN (a non-empty str) "
                        "or a non-empty list of them [BK-29]")
    for i, a in enumerate(fqns):
        for b in fqns[i + 1:]:
            if a == b or b.startswith(a + ".") or a.startswith(b + "."):
                raise ValueError(f"module_bucket_plans: {a!r} and {b!r} overlap; a node "
                                 f"belongs to one entry at most [BK-29]")
    return entries


def _entry_finder(entries: list[tuple[str, ...]], module_stack_fn):
    """node -> the index of the plan entry holding one of its modules, or None."""
    def entry_of(node: torch.fx.Node) -> int | None:
        for fqn in module_stack_fn(node):
            for index, entry in enumerate(entries):
                if any(fqn == e or fqn.startswith(e + ".") for e in entry):
                    return index
        return None

    return entry_of


def manual_overlap_bucketing(gm: torch.fx.GraphModule, module_bucket_plans, *,
                             module_stack_fn=None, recompile: bool = True
                             ) -> torch.fx.GraphModule:
    """Bucket by module plans, in place; returns `gm` (BK-28).

    `module_bucket_plans` lists entries, each a module FQN ("layers.0") or a list of them
    (["layers.0", "layers.1"]): every candidate (BK-1) of a kind computed inside an
    entry's modules (or modules below them) joins that entry's one bucket of its key,
    whatever its size; a candidate dependent on the open bucket is left alone (BK-4), as
    is every candidate outside the plan. all_gathers, then reduce_scatters, then
    all_reduces. `module_stack_fn(node)` gives a node's module FQNs (default: Dynamo's
    module stack, module_fqns). Where the merged collectives then run is the reorder
    stage's choice (upstream's pass of this name also reorders them)."""
    require_type(gm, torch.fx.GraphModule, "gm", "a torch.fx.GraphModule", "BK-28")
    entries = _plan_entries(module_bucket_plans)
    if module_stack_fn is not None and not callable(module_stack_fn):
        raise TypeError("module_stack_fn: expected a callable node -> module FQNs [BK-28]")
    entry_of = _entry_finder(entries, module_stack_fn or module_fqns)
    for name in ("all_gather", "reduce_scatter", "all_reduce"):
        planner = _Planner(KINDS[name], _Caps(lambda _index: _UNBOUNDED_MIB), False, entry_of)
        planner.plan(gm.graph)
        buckets = [b for b in planner.buckets if len(b.members) > 1]
        logger.info("%s: module plans: %d buckets of %d candidates", name, len(buckets),
                    sum(len(b.members) for b in buckets))
        if buckets:
            _rewrite(gm, KINDS[name], buckets, _MergeOptions(agree_across_ranks=False),
                     recompile=False)
    if recompile:
        gm.recompile()
    return gm
