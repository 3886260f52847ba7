"""What bucketing must merge, read from SPEC.md alone (BK-1..BK-5, BK-7, BK-10).

`predict(gm, passes)` plans the buckets of each pass on a traced graph, as the rules say, and
returns what the bucketed graph must issue: every collective's signature (kind, group,
dtype, elements of its result) in program order, and the bucket indices each pass asks its
cap for. The fuzzer (conformance/fuzz/, BK stage) compares it with what a backend's
passes made of the same graph. It shares no code with refimpl.bucketing and reads the
graph its own way: a bucket is a contraction of its members (BK-4: once merged, a
bucket's results depend on all its members' inputs), and the rewrite is a stable
topological sort that puts each merged collective where its last member was (BK-7).
What each op is (its kind, its form) it reads from SPEC's op table (conformance/ops.py).

`diagnose(...)` names the rule a different result breaks, by finding the one reading
that explains it: merging only adjacent candidates (BK-2, upstream's), one cap for every
bucket (BK-3, upstream's), or no dependency check (BK-4).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

import torch.fx

from conformance import ops
from conformance.ops import is_wait, kind_of
from conformance.reorder_rules import group_of

MiB = 2**20
KINDS = ("all_gather", "reduce_scatter", "all_reduce")  # the passes' kinds (BK-1)


@dataclass(frozen=True)
class Reading:
    """How a pass is read: SPEC's (all False), or one of the known other readings."""

    adjacent_only: bool = False  # a candidate joins only right after its bucket's last member
    first_cap_for_all: bool = False  # cap(0) for every bucket, asked once per key
    no_dependency_check: bool = False  # BK-4 left out

    def rules(self) -> list[str]:
        return [rule for rule, on in (("BK-2", self.adjacent_only),
                                      ("BK-3", self.first_cap_for_all),
                                      ("BK-4", self.no_dependency_check)) if on]


@dataclass
class _Collective:
    kind: str
    group: str
    dtype: str
    numel: int | tuple  # elements of its result (a tuple for a coalesced one)
    key: tuple | None = None  # candidates only: (group, [reduce op,] dtype), BK-2
    size: int = 0  # candidates only: BK-3's bytes
    chunk: int = 0  # candidates only: elements a merged result holds for it (BK-8/10/11)
    nbytes: int = 0  # candidates only: bytes of its result (a merged gather of bytes, BK-12)
    wait: str | None = None

    def signature(self) -> tuple:
        return (self.kind, self.group, self.dtype, self.numel)


@dataclass
class _Bucket:
    key: tuple
    index: int
    cap: float
    members: list = field(default_factory=list)
    size: int = 0


@dataclass
class Prediction:
    signatures: list[tuple]  # every collective of the bucketed graph, in program order
    asks: dict[str, Counter]  # pass kind -> how often each bucket index is asked
    merged: dict[str, int]  # pass kind -> buckets of two or more members
    # pass kind -> BK-15's numbers: candidates, those merged, buckets, those left alone
    counts: dict[str, tuple[int, int, int, int]]
    candidates: dict[str, list[str]]  # pass kind -> its candidates' node names, in order


def argument_of(node: torch.fx.Node, name: str):
    """The argument `name` of `node`'s op (by its schema), positional or keyword; None if
    not given."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name)
    return None


def _val_numel(val):
    if isinstance(val, (list, tuple)):
        return tuple(v.numel() for v in val)
    return val.numel()


def _dtype(val) -> str:
    first = val[0] if isinstance(val, (list, tuple)) and val else val
    return str(getattr(first, "dtype", "?"))


def _signature(node: torch.fx.Node, label: dict[str, str]) -> tuple:
    """A collective's (kind, group as `label` names it, dtype, elements of its result)."""
    group = group_of(node)
    val = node.meta.get("val")
    return (kind_of(node), label.get(group, group), _dtype(val),
            _val_numel(val) if val is not None else None)


class _Graph:
    """The graph as the model sees it: items in program order, each with its inputs."""

    def __init__(self, gm: torch.fx.GraphModule, label: dict[str, str]):
        self.order: list[str] = []
        self.inputs: dict[str, set[str]] = {}
        self.collectives: dict[str, _Collective] = {}
        for node in gm.graph.nodes:
            self.order.append(node.name)
            self.inputs[node.name] = {n.name for n in node.all_input_nodes}
            if kind_of(node) is not None:
                self.collectives[node.name] = coll = _Collective(*_signature(node, label))
                self._as_candidate(node, coll, list(node.users))

    def _as_candidate(self, node, coll: _Collective, users) -> None:
        """BK-1: the out-of-place op of its kind (a plain row of the op table: not in place,
        coalesced or `out`) whose one user is its wait."""
        op = ops.row(node)
        if coll.kind not in KINDS or op.in_place or op.coalesced or op.out or len(users) != 1:
            return
        (wait,) = users
        if not is_wait(wait) or wait.args[0] is not node:
            return
        inp = argument_of(node, "input").meta["val"]
        out = node.meta["val"]
        group_size = argument_of(node, "group_size")
        reduce_op = argument_of(node, "reduce_op")
        coll.key = (coll.group, *([reduce_op.lower()] if reduce_op else []), coll.dtype)
        coll.size = max(inp.numel() * inp.element_size(), out.numel() * out.element_size())
        if coll.kind == "reduce_scatter":  # padded to a multiple of the group size (BK-10)
            rows = inp.shape[0] if inp.dim() else 1
            coll.chunk = math.ceil(rows / group_size) * (inp.numel() // max(rows, 1))
        else:
            coll.chunk = out.numel()
        coll.nbytes = out.numel() * out.element_size()
        coll.wait = wait.name

    def users(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {name: [] for name in self.order}
        for name in self.order:
            for inp in self.inputs[name]:
                found[inp].append(name)
        return found

    def merge(self, kind: str, buckets: list[_Bucket], as_bytes: bool) -> None:
        """BK-7: each bucket of two or more becomes one collective (with its wait) where
        its last member was; a node that reads a member's result follows it, every other
        node keeps its order (a stable topological sort keyed by position)."""
        position = {name: i for i, name in enumerate(self.order)}
        replaced: dict[str, str] = {}
        for i, bucket in enumerate(b for b in buckets if len(b.members) > 1):
            unit = f"<{kind} bucket {i}>"
            members = [self.collectives.pop(m) for m in bucket.members]
            first = members[0]
            self.collectives[unit] = _Collective(kind, first.group, first.dtype,
                                                 sum(m.chunk for m in members)) if not as_bytes \
                else _Collective(kind, first.group, "torch.uint8", sum(m.nbytes for m in members))
            self.inputs[unit] = set().union(*(self.inputs.pop(m) for m in bucket.members))
            for m, coll in zip(bucket.members, members, strict=True):
                self.inputs.pop(coll.wait)
                replaced[m] = replaced[coll.wait] = unit
            position[unit] = position[bucket.members[-1]]
        if not replaced:
            return
        for name, inputs in self.inputs.items():
            self.inputs[name] = {replaced.get(i, i) for i in inputs}
        self.order = _stable_topological_sort(list(self.inputs), self.inputs, position)


class Cycle(AssertionError):
    """The merged graph has a cycle: never under SPEC's reading (BK-4), possible under one
    without the dependency check."""


def _stable_topological_sort(names, inputs, position) -> list[str]:
    waiting = {name: len(inputs[name]) for name in names}
    users: dict[str, list[str]] = {name: [] for name in names}
    for name in names:
        for inp in inputs[name]:
            users[inp].append(name)
    ready = [(position[n], n) for n in names if not waiting[n]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, name = heapq.heappop(ready)
        order.append(name)
        for user in users[name]:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, (position[user], user))
    if len(order) != len(names):
        raise Cycle("bucket model: the merged graph has a cycle (BK-4)")
    return order


def _plan(graph: _Graph, kind: str, cap_fn, reading: Reading, asks: Counter,
          as_bytes: bool) -> tuple[list[_Bucket], int]:
    """BK-2..BK-4: candidates of one key in graph order, each bucket asked its cap as it
    opens; a candidate that depends on its key's open bucket is left alone. Returns the
    buckets and how many were left alone. `as_bytes`: BK-12, the key without the dtype."""
    users = graph.users()
    opened: dict[tuple, _Bucket] = {}
    buckets: list[_Bucket] = []
    bucket_of: dict[str, _Bucket] = {}
    last_candidate = None
    first_cap: dict[tuple, float] = {}
    left_alone = 0

    def open_bucket(key, index) -> _Bucket:
        if reading.first_cap_for_all:
            if key not in first_cap:
                asks[0] += 1
                first_cap[key] = cap_fn(0)
            cap = first_cap[key]
        else:
            asks[index] += 1
            cap = cap_fn(index)
        bucket = _Bucket(key, index, cap * MiB)
        opened[key] = bucket
        buckets.append(bucket)
        return bucket

    for name in graph.order:
        coll = graph.collectives.get(name)
        if coll is None or coll.kind != kind or coll.key is None:
            continue
        key = coll.key[:-1] if as_bytes else coll.key
        bucket = opened.get(key)
        if bucket is not None and not reading.no_dependency_check and \
                _reaches(bucket, graph.inputs[name], users, bucket_of):
            last_candidate = name
            left_alone += 1
            continue
        if bucket is not None and reading.adjacent_only and \
                (last_candidate is None or bucket_of.get(last_candidate) is not bucket):
            bucket = open_bucket(key, bucket.index + 1)
        elif bucket is not None and bucket.size + coll.size > bucket.cap:
            bucket = open_bucket(key, bucket.index + 1)
        elif bucket is None:
            bucket = open_bucket(key, 0)
        bucket.members.append(name)
        bucket.size += coll.size
        bucket_of[name] = bucket
        last_candidate = name
    return buckets, left_alone


def _reaches(bucket: _Bucket, targets: set[str], users, bucket_of) -> bool:
    """Whether a path leads from `bucket` to any of `targets`, every bucket contracted: a
    path into one member of a bucket leaves from all its members' results (BK-4)."""
    seen = set(bucket.members)
    todo = list(bucket.members)
    while todo:
        name = todo.pop()
        if name in targets:
            return True
        for user in users[name]:
            others = bucket_of[user].members if user in bucket_of else (user,)
            for other in others:
                if other not in seen:
                    seen.add(other)
                    todo.append(other)
    return False


def predict(gm: torch.fx.GraphModule, passes, label: dict[str, str],
            reading: Reading = Reading(), mixed_dtypes: bool = False) -> Prediction:
    """`passes`: (kind, cap_fn) in the order the passes run; `mixed_dtypes` as given to
    the all_gather pass (BK-12)."""
    graph = _Graph(gm, label)
    candidates = {kind: [n for n in graph.order if n in graph.collectives and
                         graph.collectives[n].key is not None and
                         graph.collectives[n].kind == kind] for kind in KINDS}
    asks: dict[str, Counter] = {}
    merged: dict[str, int] = {}
    counts: dict[str, tuple[int, int, int, int]] = {}
    for kind, cap_fn in passes:
        asks[kind] = Counter()
        as_bytes = mixed_dtypes and kind == "all_gather"
        buckets, left_alone = _plan(graph, kind, cap_fn, reading, asks[kind], as_bytes)
        kept = [b for b in buckets if len(b.members) > 1]
        merged[kind] = len(kept)
        counts[kind] = (sum(len(b.members) for b in buckets) + left_alone,
                        sum(len(b.members) for b in kept), len(kept), left_alone)
        graph.merge(kind, buckets, as_bytes)
    signatures = [graph.collectives[n].signature() for n in graph.order
                  if n in graph.collectives]
    return Prediction(signatures, asks, merged, counts, candidates)


def observed(gm: torch.fx.GraphModule, label: dict[str, str]) -> list[tuple]:
    """The collectives a bucketed graph issues, in program order, as `predict` writes them."""
    return [_signature(node, label) for node in gm.graph.nodes if kind_of(node) is not None]


def diagnose(gm, passes, label, got: list[tuple], mixed_dtypes: bool = False) -> list[str]:
    """The rules a bucketed graph whose collectives differ from SPEC's buckets breaks: those
    of the first other reading (fewest changes first) that gives its collectives."""
    flags = list(itertools.product((False, True), repeat=3))
    for adjacent, first_cap, no_deps in sorted(flags, key=sum)[1:]:
        reading = Reading(adjacent, first_cap, no_deps)
        try:
            signatures = predict(gm, passes, label, reading, mixed_dtypes).signatures
        except Cycle:  # no graph a pass returns reads so
            continue
        if Counter(signatures) == Counter(got):
            return reading.rules()
    return []
