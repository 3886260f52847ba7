"""Scheduler reorder: the same program, its nodes in an order that overlaps comms with compute.

`reorder(gm, config)` returns a new GraphModule holding the same nodes in a new order. One
list scheduler places *blocks* one at a time (an FSDP block tagged by bucketing, BK-17; a
collective with its prologue, the casts and copies that only feed it; any other node
alone): a collective block as soon as its inputs allow (RO-10); a held-back collective
let go early when that hides more of it than it exposes (RO-14); a wait only when a
block that needs it comes next (RO-11); and among the compute blocks the one that stalls
the compute stream least on the timeline of `config.cost_model`, the simulator's, then
the one the earliest collective needs (RO-12).

Every order it returns keeps RO-3..RO-9: data dependencies, the order of every buffer's
versions (a wait completes its input's buffer, FC-5; a collective reads what it holds
until its wait, MEM-5), each group's issue order, barriers at the ops it does not
understand, blocks contiguous, the in-flight limit per (group, kind), and a bound on the
planned peak memory against the *original* order, which the result keeps in its `meta`.
Every decision derives from the graph, the original order and the config, never from
the order handed in, so reordering a reordered graph returns the same order (RO-2); the
ranks of the world first agree on every node's duration, so that cost models that
differ by rank still give one order of collectives (RO-16).
`check_order(gm, order, config)` says whether a hand-written order keeps those rules and
which one it breaks first (RO-15).

Cost: the analysis and the schedule are linear in the graph (a heap per candidate kind);
the memory test of a move is exact and O(log N), never a plan per candidate: it lives in
refimpl/reorder_memory.py (`MemoryBound`: a tree of what the continuation, the nodes
placed then the rest in original order, has live at each later position; MEM-10, RO-10).

Implements SPEC.md section "Scheduler reorder": RO-1 .. RO-16.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.fx

from refimpl import _fx, comm_ops
from refimpl._errors import InternalError, refuse, require, require_type
from refimpl._world import Agreement, real_world
from refimpl.bucketing import BLOCK_META
from refimpl.memory import MemoryModel, collector_paused
from refimpl.reorder_memory import MemoryBound
from refimpl.simulator import CostModel, _is_view, blocking_name

__all__ = ["ReorderConfig", "reorder", "check_order", "OrderError", "barrier_reason",
           "collective_kind", "ORIGINAL_ORDER", "KINDS"]

# gm.meta key of a reordered graph: the node names of its original order (RO-2).
ORIGINAL_ORDER = "refimpl_reorder_original"

# The kinds of collective for the in-flight limit (RO-8): the families of refimpl/comm_ops.py.
KINDS = comm_ops.COLLECTIVE_FAMILIES

# Prologue ops (RO-7): what only casts, copies, pads, concatenates, allocates or views.
PROLOGUE_OPS = frozenset({
    "_to_copy", "convert_element_type", "clone", "copy", "copy_", "cat", "constant_pad_nd",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
})
# Python functions of a graph that compute on sizes only (RO-6).
PURE_MODULES = ("_operator", "operator", "math")
INPUT_OPS = ("placeholder", "get_attr")


# --------------------------------------------------------------------------------------
# The config (RO-1)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReorderConfig:
    """How `reorder` schedules (RO-1).

    cost_model: the duration of every node (refimpl.simulator.CostModel, its H100 preset
        when None). Pinned durations make an order independent of any profile.
    memory_budget: the new order's planned peak may exceed the original order's by at
        most this fraction (RO-9); None (or `math.inf`) lifts the bound.
    max_in_flight: per collective kind ("all_gather", "reduce_scatter", "all_reduce",
        "all_to_all", "broadcast": the families of refimpl/comm_ops.py), how many of one
        group's collectives of that kind may be issued and not yet waited at any point
        (RO-8); kinds not named are unlimited. "point_to_point" is refused: a send held
        back behind a receive's wait deadlocks an exchange whose peers do the same.
    agree_across_ranks: every rank of the world decides from the same durations, the
        largest any of them estimated per node, so that ranks whose
        cost models differ (a profile per rank) still issue their collectives in one
        order (RO-16). False: this rank's cost model alone (give every rank the same one).
    """

    cost_model: CostModel | None = None
    memory_budget: float | None = 0.1
    max_in_flight: Mapping[str, int] = field(default_factory=dict)
    agree_across_ranks: bool = True

    def __post_init__(self):
        require_type(self.cost_model, (CostModel, type(None)), "cost_model",
                     "a refimpl.simulator.CostModel or None", "RO-1")
        budget = self.memory_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)):
                refuse("memory_budget", "a number >= 0 or None", repr(budget), "RO-1",
                       TypeError)
            require(not math.isnan(budget) and budget >= 0, "memory_budget",
                    "a number >= 0 or None", repr(budget), "RO-1")
        require_type(self.max_in_flight, Mapping, "max_in_flight",
                     "a mapping of collective kind to count", "RO-1")
        for kind, count in self.max_in_flight.items():
            require(kind in KINDS, "max_in_flight", f"a kind of {list(KINDS)}", repr(kind),
                    "RO-1")
            # Held behind a wait, a send or a receive never reaches the peer waiting for it
            # while that peer holds its own back the same way (RO-8).
            require(kind != "point_to_point", "max_in_flight",
                    "no limit on point_to_point (holding a send or a receive back behind a "
                    "wait deadlocks the peers of an exchange)", repr(kind), "RO-8")
            if isinstance(count, bool) or not isinstance(count, int):
                refuse(f"max_in_flight[{kind!r}]", "an int >= 1", repr(count), "RO-1", TypeError)
            require(count >= 1, f"max_in_flight[{kind!r}]", "an int >= 1", count, "RO-1")
        object.__setattr__(self, "max_in_flight", MappingProxyType(dict(self.max_in_flight)))
        require_type(self.agree_across_ranks, bool, "agree_across_ranks", "a bool", "RO-16")

    def memory_limit(self, original_peak: int) -> float:
        """The largest planned peak the new order may have (RO-9), in whole bytes."""
        if self.memory_budget is None or math.isinf(self.memory_budget):
            return math.inf
        return math.floor((1 + self.memory_budget) * original_peak)


# --------------------------------------------------------------------------------------
# What a node is (RO-5, RO-6, RO-7)
# --------------------------------------------------------------------------------------
def collective_kind(node: torch.fx.Node) -> str | None:
    """"all_gather", ... for a collective (not a wait) of any functional-collectives
    namespace: its family in refimpl/comm_ops.py (RO-8)."""
    return comm_ops.collective_family(node)


def _issues_on_group(node: torch.fx.Node) -> bool:
    """A collective or a blocking symmetric-memory kernel: it keeps its group's order."""
    return collective_kind(node) is not None or blocking_name(node) is not None


def _has_registered_effect(target) -> bool:
    from torch.fx.node import _side_effectful_functions

    if target in _side_effectful_functions:
        return True
    try:
        from torch._higher_order_ops.effects import _get_effect
    except ImportError:  # torch without the effects registry
        return False
    return _get_effect(target) is not None


def barrier_reason(node: torch.fx.Node) -> str | None:
    """Why nothing may move across `node` (RO-6), or None when the pass understands it."""
    if node.op in ("call_module", "call_method"):
        return f"{node.op} runs code the pass cannot see"
    if node.op != "call_function":
        return None  # inputs and the output have fixed places anyway
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return "a higher-order op runs code the pass cannot see"
    if not isinstance(target, torch._ops.OpOverload):
        module, name = getattr(target, "__module__", None), getattr(target, "__name__", "")
        if target is operator.setitem:
            return "operator.setitem writes its argument"
        if module in PURE_MODULES or (module, name) in comm_ops.SYMMETRIC_ALLOCATORS or \
                (module == "torch" and name.startswith("sym_")):
            return None
        return f"the Python function {name or target!r} may do anything"
    namespace = target.namespace
    if comm_ops.node_op(node) is not None:
        return None  # modelled (upstream registers its wait as side-effectful for DCE)
    if _has_registered_effect(target):
        return f"{target} is registered as side-effectful"
    if namespace in ("aten", "prims"):
        return None
    if namespace in comm_ops.NAMESPACES + comm_ops.OTHER_COMMUNICATING_NAMESPACES:
        return f"{target} communicates in a way the pass does not model"
    if target._schema.is_mutable:
        return f"{target} writes an argument the pass cannot order"
    if not target._schema.returns:
        return f"{target} returns nothing: it exists for its side effects"
    return None


def _is_prologue_op(node: torch.fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    return target._schema.name.split("::", 1)[1] in PROLOGUE_OPS or _is_view(target)


# --------------------------------------------------------------------------------------
# Ranks that decide alike (RO-16)
# --------------------------------------------------------------------------------------
def agreed_durations(gm: torch.fx.GraphModule, body: list, durations: list[float]
                     ) -> list[float]:
    """The durations every rank of the world decides from: each node's largest estimate
    among them (RO-16). Ranks whose cost models differ would
    otherwise order the collectives of different groups differently (RO-12 follows the
    estimates; RO-5 keeps only each group's own order), which NCCL, needing one order
    across communicators, does not survive. Unchanged outside a world of real ranks."""
    ranks = _ranks_to_agree_with(body)
    if len(ranks) < 2:
        return durations
    from refimpl.comm_lowering import graph_fingerprint

    agreement = Agreement("reorder", ranks, "RO-16",
                          "ranks that compile different graphs (a pipeline's stages) pass "
                          "agree_across_ranks=False and one cost model on every rank")
    graph = graph_fingerprint(gm, constants=False)
    posted = agreement.round({"graph": graph, "durations": durations})
    agreement.refuse_other_graphs(posted, graph, "reorder")
    return [max(posted[r]["durations"][i] for r in ranks) for i in range(len(durations))]


def _ranks_to_agree_with(body: list) -> tuple[int, ...]:
    """Every global rank of the world (_world.real_world) when the graph issues a
    collective (but a point-to-point one, whose peer may be another pipeline stage with
    another graph) or a blocking kernel."""
    if not any(_issues_on_group(node) and collective_kind(node) != "point_to_point"
               for node in body):
        return ()
    return real_world()


# --------------------------------------------------------------------------------------
# The program in its original order: dependencies and blocks (RO-2 .. RO-7)
# --------------------------------------------------------------------------------------
RNG_STATE = -1  # the buffer every seeded random op writes (RO-4)


def _valid_original(order: list[torch.fx.Node]) -> bool:
    seen: set[torch.fx.Node] = set()
    for node in order:
        if any(arg not in seen for arg in node.all_input_nodes):
            return False
        seen.add(node)
    return order[-1].op == "output" if order else True


def original_order(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Every node of `gm` in its original order (RO-2): the order named by
    `gm.meta[ORIGINAL_ORDER]` if it names exactly gm's nodes in a valid order, else gm's."""
    nodes = list(gm.graph.nodes)
    names = gm.meta.get(ORIGINAL_ORDER)
    if names is None or len(names) != len(nodes):
        return nodes
    by_name = {n.name: n for n in nodes}
    if set(names) != by_name.keys():
        return nodes
    order = [by_name[name] for name in names]
    return order if _valid_original(order) else nodes


class _Program:
    """What the scheduler reads of a graph, every node numbered by its original position."""

    def __init__(self, gm: torch.fx.GraphModule, config: ReorderConfig):
        for node in gm.graph.nodes:
            if node.users and not _fx.is_subgraph(gm, node):
                _fx.fake_value(node, "RO-1")
        self.gm = gm
        order = original_order(gm)
        self.inputs = [n for n in order if n.op in INPUT_OPS]
        self.output = [n for n in order if n.op == "output"]
        self.body = [n for n in order if n.op not in INPUT_OPS and n.op != "output"]
        self.pos = {n: i for i, n in enumerate(self.body)}
        self.model = MemoryModel(gm)
        cost_model = config.cost_model or CostModel()
        duration = cost_model.durations(gm)
        self.duration = [duration[n] for n in self.body]
        if config.agree_across_ranks:
            self.duration = agreed_durations(gm, self.body, self.duration)
        self.alloc = [self.model.alloc_bytes(n) for n in self.body]
        self.preds: list[set[int]] = [set() for _ in self.body]
        self.group: dict[int, str] = {}  # collectives and blocking kernels -> group name
        self.completes: dict[int, list[int]] = {}  # wait -> the collectives it completes
        self.in_flight = {self.pos[n] for n in self.model.in_flight if n in self.pos}
        self._data_dependencies()
        self._pair_waits_and_versions()
        self._group_order()
        self._barriers()

    # RO-3
    def _data_dependencies(self) -> None:
        for i, node in enumerate(self.body):
            self.preds[i].update(self.pos[a] for a in node.all_input_nodes if a in self.pos)

    # RO-4: per buffer, every access follows as many writes as in the original order.
    def _pair_waits_and_versions(self) -> None:
        model = self.model
        pending: dict[int, list[tuple[int, tuple[int, ...]]]] = {}  # buffer -> (coll, held)
        accesses: dict[int, list[tuple[int, bool]]] = {}
        for i, node in enumerate(self.body):
            reads = set(model.uses.get(node, ()))
            writes = set(self._written_buffers(node))
            for done, held in model.in_flight.get(node, ()):
                pending.setdefault(done, []).append((i, held))
            if node in model.completes:  # a wait: it completes its input's buffer (FC-5) ...
                done = [entry for b in model.completes[node] for entry in pending.pop(b, [])]
                self.completes[i] = list(dict.fromkeys(c for c, _ in done))
                writes.update(model.completes[node])
                reads.update(b for _, held in done for b in held)  # ... and ends their reads
            if isinstance(node.target, torch._ops.OpOverload) and \
                    torch.Tag.nondeterministic_seeded in node.target.tags:
                writes.add(RNG_STATE)
            for b in reads | writes:
                accesses.setdefault(b, []).append((i, b in writes))
        for trail in accesses.values():
            self._version_edges(trail)

    def _written_buffers(self, node: torch.fx.Node) -> list[int]:
        """Buffers of the arguments the op's schema marks as written (`Tensor(a!)`)."""
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
            return []
        bound = _fx.arguments(node, "RO-4")
        written = []
        for argument in target._schema.arguments:
            if argument.alias_info is not None and argument.alias_info.is_write:
                for arg in _fx.node_args(bound.get(argument.name)):
                    written += [b.index for b in self.model.node_buffers.get(arg, ())]
        return written

    def _version_edges(self, trail: list[tuple[int, bool]]) -> None:
        last_write, readers = None, []
        for i, writes in trail:
            if last_write is not None:
                self.preds[i].add(last_write)  # after the write that made its version
            if writes:
                self.preds[i].update(readers)  # after every reader of the version it ends
                last_write, readers = i, []
            else:
                readers.append(i)

    # RO-5
    def _group_order(self) -> None:
        last: dict[str, int] = {}
        for i, node in enumerate(self.body):
            if _issues_on_group(node):
                group = str(_fx.arguments(node, "RO-5")["group_name"])
                self.group[i] = group
                if group in last:
                    self.preds[i].add(last[group])
                last[group] = i

    # RO-6: a barrier follows every node before it and precedes every node after it.
    def _barriers(self) -> None:
        barriers = [i for i, node in enumerate(self.body) if barrier_reason(node) is not None]
        for k, b in enumerate(barriers):
            since = barriers[k - 1] if k else 0
            self.preds[b].update(range(since, b))
            until = barriers[k + 1] if k + 1 < len(barriers) else len(self.body)
            for j in range(b + 1, until):
                self.preds[j].add(b)

    # RO-7
    def blocks(self) -> list[list[int]]:
        """Tagged blocks, each untagged collective with its prologue, every other node alone."""
        block_of: list[int | None] = [None] * len(self.body)
        blocks: list[list[int]] = []
        tagged: dict[tuple, list[int]] = {}
        for i, node in enumerate(self.body):
            tag = node.meta.get(BLOCK_META)
            if tag is not None:
                tagged.setdefault(tuple(tag), []).append(i)
        for members in tagged.values():
            between = self._outside_between(members)
            if between is not None:
                names = [self.body[i].name for i in sorted(members)]
                raise ValueError(f"gm: block {names} cannot be placed as one unit: node "
                                 f"{between!r} outside it depends on it and feeds it [RO-7]")
            self._claim(blocks, block_of, members)
        for i in reversed(range(len(self.body))):
            if block_of[i] is None and collective_kind(self.body[i]) is not None:
                members = self._prologue(i, block_of) + [i]
                if self._outside_between(members) is not None:  # held by RO-4: no prologue
                    members = [i]
                self._claim(blocks, block_of, members)
        for i in range(len(self.body)):
            if block_of[i] is None:
                self._claim(blocks, block_of, [i])
        return blocks

    def _outside_between(self, members: list[int]) -> str | None:
        """A node outside `members` that depends on one of them and feeds one, which makes
        placing them as a unit impossible (RO-7); None when there is none. Such a node lies
        between their first and last position, so only that range is searched."""
        inside, lo, hi = set(members), min(members), max(members)
        after_block: set[int] = set()  # outside nodes in the range that depend on the block
        for j in range(lo, hi + 1):
            reached = [p for p in self.preds[j] if p in inside or p in after_block]
            if j not in inside and reached:
                after_block.add(j)
            elif j in inside and any(p in after_block for p in reached):
                return next(self.body[p].name for p in reached if p in after_block)
        return None

    @staticmethod
    def _claim(blocks, block_of, members) -> None:
        for i in members:
            block_of[i] = len(blocks)
        blocks.append(sorted(members))

    def _prologue(self, i: int, block_of) -> list[int]:
        """The prologue ops whose every user is collective `i` or in its prologue (RO-7).

        Visited from the latest position down, so a node's users are decided before it."""
        block, prologue = {i}, []
        heap = [-self.pos[a] for a in self.body[i].all_input_nodes if a in self.pos]
        heapq.heapify(heap)
        while heap:
            j = -heapq.heappop(heap)
            node = self.body[j]
            if j in block or block_of[j] is not None or not _is_prologue_op(node):
                continue
            if any(self.pos.get(user) not in block for user in node.users):
                continue
            block.add(j)
            prologue.append(j)
            for a in node.all_input_nodes:
                if a in self.pos:
                    heapq.heappush(heap, -self.pos[a])
        return prologue


# --------------------------------------------------------------------------------------
# The scheduler (RO-8 .. RO-12)
# --------------------------------------------------------------------------------------
COLLECTIVE, WAIT, COMPUTE = "collective", "wait", "compute"


@dataclass(eq=False, slots=True)  # thousands of them: no dict each
class _Block:
    index: int
    members: list[int]  # original positions, ascending
    kind: str  # COLLECTIVE, WAIT or COMPUTE
    flight: tuple[str, str] | None = None  # (group, kind) of a collective block (RO-8)
    deps: set = field(default_factory=set)  # indices of blocks it needs
    users: list = field(default_factory=list)
    wait_deps: list = field(default_factory=list)
    unplaced: int = 0  # deps not placed
    unplaced_non_wait: int = 0
    unready_waits: int = 0  # wait deps neither placed nor ready
    waits_left: int = 0  # a collective block: wait blocks that complete it, not placed
    completes: list = field(default_factory=list)  # a wait block: the collective blocks
    placed: bool = False
    queued: str | None = None  # which queue holds its live entry
    finish_us: float = 0.0  # a wait block: when its collectives end
    completed_by: list = field(default_factory=list)  # a collective block: its wait blocks
    need: float = math.inf  # the first collective block that depends on it (RO-12)
    duration: float = 0.0

    @property
    def pos(self) -> int:
        return self.members[0]


class _Scheduler:
    """One list schedule of a program's blocks; `run()` returns the new body order."""

    def __init__(self, program: _Program, config: ReorderConfig):
        self.p = program
        self.config = config
        self.n = len(program.body)
        self._build_blocks()
        self._memory_baseline()
        self.sweep = program.model.sweep()
        for node in program.inputs:
            self.sweep.place(node)
        self.placed = [False] * self.n
        self.cur = 0  # first original position not placed
        self.ahead = 0  # bytes allocated by placed nodes after `cur` (RO-9)
        self.clock = 0.0  # the compute stream, as SIM-5..SIM-7 replay the order
        self.stream_free: dict[str, float] = {}
        self.finish: dict[int, float] = {}  # collective position -> its end
        # (group, kind) -> the collective blocks issued and not completed (RO-8)
        self.flying: dict[tuple[str, str], list[_Block]] = {}
        self.order: list[int] = []
        self.queues = {"collective": [], "stall_free": [], "stalling": [], "waits": []}
        self.blocked: dict[tuple[str, str], list] = {}
        self.done = 0

    # ---- setup ------------------------------------------------------------------------
    def _build_blocks(self) -> None:
        p = self.p
        self.blocks = []
        self.block_of = [0] * self.n
        for members in p.blocks():
            block = _Block(len(self.blocks), members, self._kind_of(members))
            for i in members:
                self.block_of[i] = block.index
            if block.kind == COLLECTIVE:
                first = next(i for i in members if i in p.in_flight)
                block.flight = (p.group[first], collective_kind(p.body[first]))
            self.blocks.append(block)
        completed_by: dict[int, set[int]] = {}
        for wait, collectives in p.completes.items():
            for c in collectives:
                completed_by.setdefault(self.block_of[c], set()).add(self.block_of[wait])
        for block in self.blocks:
            for i in block.members:
                block.deps.update(self.block_of[j] for j in p.preds[i])
            block.deps.discard(block.index)
            block.duration = sum(p.duration[i] for i in block.members)
            if block.kind == COLLECTIVE:
                block.completed_by = sorted(completed_by.get(block.index, ()))
                block.waits_left = len(block.completed_by)
            if block.kind == WAIT:
                block.completes = sorted({self.block_of[c] for i in block.members
                                          for c in p.completes.get(i, ())})
        for block in self.blocks:
            for d in sorted(block.deps):
                dep = self.blocks[d]
                dep.users.append(block)
                block.unplaced += 1
                if dep.kind == WAIT:
                    block.wait_deps.append(dep)
                    block.unready_waits += 1
                else:
                    block.unplaced_non_wait += 1
        self._needs()
        self._first_uses()

    def _first_uses(self) -> None:
        """For RO-14: the compute durations before each original position, and per
        collective block the first position that uses its results through its waits."""
        p, total = self.p, 0.0
        self.compute_before = [0.0] * (self.n + 1)
        for i in range(self.n):
            if i not in p.group and i not in p.completes:  # compute, not comm or a wait
                total += p.duration[i]
            self.compute_before[i + 1] = total
        self.first_use: dict[int, int] = {}
        for block in self.blocks:
            if block.kind != COLLECTIVE:
                continue
            users = [u.members[0] for w in block.completed_by
                     for u in self.blocks[w].users if u.kind != WAIT]
            if users:
                self.first_use[block.index] = min(users)

    def _needs(self) -> None:
        """Each block's `need`: the original position of the first collective block that
        depends on it, directly or not (RO-12), from the users back (Kahn's order)."""
        left = {b.index: len(b.users) for b in self.blocks}
        ready = [b for b in self.blocks if not b.users]
        while ready:
            block = ready.pop()
            for user in block.users:
                block.need = min(block.need,
                                 user.pos if user.kind == COLLECTIVE else user.need)
            for dep in block.deps:
                left[dep] -= 1
                if left[dep] == 0:
                    ready.append(self.blocks[dep])

    def _kind_of(self, members: list[int]) -> str:
        if any(i in self.p.in_flight for i in members):
            return COLLECTIVE
        if any(i in self.p.completes for i in members):
            return WAIT
        return COMPUTE

    def _memory_baseline(self) -> None:
        """The original order's peak and, per position, the most that can be live from
        there on if the rest follows the original order (RO-9)."""
        p = self.p
        sweep = p.model.sweep()
        for node in p.inputs:
            sweep.place(node)
        high = []
        for i, node in enumerate(p.body):
            high.append(sweep.live_bytes + p.alloc[i])
            sweep.place(node)
        original_peak = sweep.peak_bytes
        self.limit = self.config.memory_limit(original_peak)
        self.later_high = [0] * (self.n + 1)
        for i in reversed(range(self.n)):
            self.later_high[i] = max(high[i], self.later_high[i + 1])
        self.bound = None if math.isinf(self.limit) else \
            MemoryBound(p.model, p.body, p.output, high, self.limit)

    # ---- the loop ---------------------------------------------------------------------
    def run(self) -> list[int]:
        for block in self.blocks:
            if block.unplaced == 0:
                self._ready(block)
        while self.done < len(self.blocks):
            self._refresh_stalls()
            placed_before = len(self.order)
            if not (self._raise_collective() or self._free_a_limit() or self._fill()
                    or self._follow_original() or self._last_resort()):
                self._stuck()
            if len(self.order) == placed_before:  # every step that succeeds places a node
                raise InternalError("reorder: a step claimed progress but placed nothing "
                                     "(a bug: the loop would never end)")
        return self.order

    def _raise_collective(self) -> bool:
        """RO-10: the collective block of smallest original position that RO-8 and RO-9
        allow, placed now."""
        queue, kept, placed = self.queues["collective"], [], False
        while queue and not placed:
            _, index = heapq.heappop(queue)
            block = self.blocks[index]
            if block.placed or block.queued != "collective":
                continue
            if not self._flight_allows(block):
                self._block_on_flight(block)
            elif self._fits(block.members):
                self._place(block)
                placed = True
            else:
                kept.append((self.tie(block), index))
        for entry in kept:
            heapq.heappush(queue, entry)
        return placed

    def _free_a_limit(self) -> bool:
        """RO-14: a collective RO-8 holds back is let go early when that hides more of it
        than it exposes. The waits that complete the in-flight collective of its
        (group, kind) that ends first are placed now, before the compute B that RO-12
        would place, when the exposure of the held-back collective C that B would hide
        is more than the stall the waits add placed now rather than after B:
        `max(0, d_C - R) - max(0, d_C - R - d_B) > stall_now - stall_after_B`, where R
        is the compute the original order runs after B and before C's result is first
        used (the rest of C that compute would hide anyway). The largest gain first,
        ties by C's original position; RO-10 then raises C."""
        if not self.blocked:
            return False
        compute = self._best_compute()
        if compute is None:
            return False
        best = None
        for flight in sorted(self.blocked):
            held = self._first_blocked(flight)
            waits = self._waits_that_free(flight) if held is not None else None
            if waits is None:
                continue
            end = max(w.finish_us for w in waits)
            stall_now = max(0.0, end - self.clock)
            stall_later = max(0.0, end - self.clock - compute.duration)
            rest = max(0.0, held.duration - self._compute_before_use(compute, held))
            gain = (rest - max(0.0, rest - compute.duration)) - (stall_now - stall_later)
            if gain > 0 and (best is None or (-gain, held.pos) < best[0]):
                best = ((-gain, held.pos), waits)
        if best is None:
            return False
        waits = best[1]
        if not self._fits([i for w in waits for i in w.members]):
            return False
        for wait in waits:
            self._place(wait)
        return True

    def _compute_before_use(self, block: _Block, collective: _Block) -> float:
        """The compute durations the original order runs after `block` and before the
        first node that uses a result of `collective` through its waits (RO-14's R)."""
        first_use = self.first_use.get(collective.index)
        if first_use is None:
            return 0.0
        after = block.members[-1] + 1
        return max(0.0, self.compute_before[first_use] - self.compute_before[after])

    def _first_blocked(self, flight) -> _Block | None:
        queue = self.blocked[flight]
        while queue and (self.blocks[queue[0][1]].placed
                         or self.blocks[queue[0][1]].queued != "blocked"):
            heapq.heappop(queue)
        return self.blocks[queue[0][1]] if queue else None

    def _waits_that_free(self, flight) -> list[_Block] | None:
        """The wait blocks, all ready, that complete the in-flight collective of `flight`
        whose waits end first (ties by position); None when none has them all ready."""
        best = None
        for collective in self.flying.get(flight, ()):
            waits = [self.blocks[w] for w in collective.completed_by
                     if not self.blocks[w].placed]
            if not waits or any(w.queued != "waits" for w in waits):
                continue
            key = (max(w.finish_us for w in waits), collective.pos)
            if best is None or key < best[0]:
                best = (key, sorted(waits, key=lambda w: w.pos))
        return best[1] if best is not None else None

    def _fill(self) -> bool:
        """RO-11, RO-12: the compute block that stalls least (then the earliest); its waits
        are placed first, right before it."""
        block = self._best_compute()
        if block is None:
            return False
        waits = sorted((w for w in block.wait_deps if not w.placed), key=lambda w: w.pos)
        if not self._fits([i for w in waits for i in w.members] + block.members):
            return False  # (tested in the order of placing: the waits first)
        # A collective whose waits these are is then raised under RO-8 (RO-10): _place
        # re-enqueues it once its last wait is placed.
        for wait in waits:
            self._place(wait)
        if not waits:
            self._place(block)
        return True

    def _follow_original(self) -> bool:
        """A move RO-9 refuses falls back to the original order: its next block, or, when
        that one is not ready (a block the original order spreads, a prologue of RO-7
        whose collective waits for an earlier one of its group, RO-5), the ready block
        that starts first in it. Only a collective RO-8 holds back is skipped."""
        for i in range(self.cur, self.n):
            block = self.blocks[self.block_of[i]]
            if block.placed or block.unplaced > 0 or i != block.members[0]:
                continue
            if block.kind == COLLECTIVE and not self._flight_allows(block):
                return False
            self._place(block)
            return True
        return False

    def _last_resort(self) -> bool:
        """Only when the original order itself breaks the in-flight limit (RO-9's exception):
        any block that can be placed, ignoring the memory bound."""
        for name in ("collective", "waits"):
            for _, index in sorted(self.queues[name]):
                block = self.blocks[index]
                if not block.placed and block.queued == name and \
                        (block.kind != COLLECTIVE or self._flight_allows(block)):
                    self._place(block)
                    return True
        block = self._best_compute()
        if block is None:
            return False
        waits = [w for w in block.wait_deps if not w.placed]
        for wait in sorted(waits, key=lambda w: w.pos):
            self._place(wait)  # a collective's last wait re-enqueues it (_place)
        if not waits:
            self._place(block)
        return True

    def _stuck(self):
        blocked = [b for queue in self.blocked.values() for _, i in queue
                   if not (b := self.blocks[i]).placed]
        if blocked:
            node = self.p.body[blocked[0].members[-1]]
            group, kind = blocked[0].flight
            raise ValueError(f"config: max_in_flight[{kind!r}] = "
                             f"{self.config.max_in_flight[kind]} cannot be met: collective "
                             f"{node.name!r} of group {group!r} waits for one that is never "
                             f"completed before it [RO-8]")
        left = next(b for b in self.blocks if not b.placed)
        raise InternalError(f"reorder: no block can be placed, {left.members} waits on a "
                             f"cycle (a bug: the original order satisfies every rule)")

    # ---- candidates -------------------------------------------------------------------
    def tie(self, block: _Block) -> int:
        """What breaks ties between blocks in every queue: the original position (RO-2)."""
        return block.pos

    def _best_compute(self) -> _Block | None:
        for name in ("stall_free", "stalling"):
            queue = self.queues[name]
            while queue:
                block = self.blocks[queue[0][-1]]
                if block.placed or block.queued != name:
                    heapq.heappop(queue)
                    continue
                return block
        return None

    def _refresh_stalls(self) -> None:
        """Blocks whose waits' collectives have ended by now no longer stall (RO-12)."""
        stalling = self.queues["stalling"]
        while stalling and stalling[0][0] <= self.clock:
            _, need, tie, index = heapq.heappop(stalling)
            block = self.blocks[index]
            if not block.placed and block.queued == "stalling":
                block.queued = "stall_free"
                heapq.heappush(self.queues["stall_free"], (need, tie, index))

    def _enqueue(self, block: _Block) -> None:
        """A block whose non-wait deps are placed and whose wait deps can be placed."""
        waits = [w for w in block.wait_deps if not w.placed]
        if block.kind == COLLECTIVE and not waits:
            if self._flight_allows(block):
                block.queued = "collective"
                heapq.heappush(self.queues["collective"], (self.tie(block), block.index))
            else:
                self._block_on_flight(block)
            return
        stall_end = max((w.finish_us for w in waits), default=0.0)
        if stall_end <= self.clock:
            block.queued = "stall_free"
            heapq.heappush(self.queues["stall_free"], (block.need, self.tie(block), block.index))
        else:
            block.queued = "stalling"
            heapq.heappush(self.queues["stalling"],
                           (stall_end, block.need, self.tie(block), block.index))

    def _ready(self, block: _Block) -> None:
        """Every dep of `block` is placed."""
        if block.kind != WAIT:
            if block.unready_waits == 0 and block.queued is None:
                self._enqueue(block)
            return
        block.finish_us = max((self.finish.get(i, 0.0) for c in block.completes
                               for i in self.blocks[c].members), default=0.0)
        block.queued = "waits"
        heapq.heappush(self.queues["waits"], (self.tie(block), block.index))
        for user in block.users:
            user.unready_waits -= 1
            if user.unplaced_non_wait == 0 and user.unready_waits == 0 and user.kind != WAIT:
                self._enqueue(user)

    # ---- RO-8 -------------------------------------------------------------------------
    def _flight_allows(self, block: _Block) -> bool:
        group, kind = block.flight
        limit = self.config.max_in_flight.get(kind)
        return limit is None or len(self.flying.get(block.flight, ())) < limit

    def _block_on_flight(self, block: _Block) -> None:
        block.queued = "blocked"
        heapq.heappush(self.blocked.setdefault(block.flight, []), (self.tie(block), block.index))

    def _release(self, flight: tuple[str, str]) -> None:
        queue = self.blocked.get(flight, [])
        while queue:
            _, index = heapq.heappop(queue)
            block = self.blocks[index]
            if not block.placed and block.queued == "blocked":
                block.queued = None
                self._enqueue(block)
                return

    # ---- RO-9 -------------------------------------------------------------------------
    def _fits(self, members: list[int]) -> bool:
        """Whether placing `members` now keeps the memory bound (RO-9, RO-10's test):
        the planned peak of placing them now and the rest in original order.

        First a bound that costs O(1) and never underestimates: the live bytes plus
        everything they allocate, and each later position's original live bytes plus
        everything placed ahead of it. Only when that refuses, the exact test
        (`refimpl.reorder_memory.MemoryBound`), so a move that raises no planned peak is
        never refused.
        """
        if self.bound is None:
            return True
        moving = set(members)
        cur, ahead = self.cur, self.ahead
        if cur in moving:
            cur += 1
            while cur < self.n and (self.placed[cur] or cur in moving):
                if self.placed[cur]:
                    ahead -= self.p.alloc[cur]
                cur += 1
        alloc = self.p.alloc
        ahead += sum(alloc[i] for i in moving if i > cur)
        allocated = sum(alloc[i] for i in members)
        most_now = self.sweep.live_bytes + allocated
        if most_now <= self.limit and self.later_high[cur] + ahead <= self.limit:
            return True
        if self.bound.refused_before(members, self.cur):
            return False
        peak = most_now if most_now <= self.limit else \
            self.sweep.peek_peak([self.p.body[i] for i in members])
        return self.bound.fits(peak, members, self.cur, cur, allocated)

    # ---- placing ----------------------------------------------------------------------
    def _place(self, block: _Block) -> None:
        block.placed, block.queued = True, None
        self.done += 1
        if self.bound is not None:
            self.bound.place(block.members, self.cur)
        for i in block.members:
            self.placed[i] = True
            self.order.append(i)
            self.sweep.place(self.p.body[i])
            self._advance_clock(i)
            if i > self.cur:
                self.ahead += self.p.alloc[i]
        if self.cur < self.n and self.placed[self.cur]:
            self.cur += 1
            while self.cur < self.n and self.placed[self.cur]:
                self.ahead -= self.p.alloc[self.cur]
                self.cur += 1
        if block.kind == COLLECTIVE:  # one no wait completes stays in flight (MEM-5)
            self.flying.setdefault(block.flight, []).append(block)
        for c in block.completes:
            collective = self.blocks[c]
            collective.waits_left -= 1
            if collective.waits_left == 0 and collective.placed:
                self.flying[collective.flight].remove(collective)
                self._release(collective.flight)
        for user in block.users:
            user.unplaced -= 1
            if block.kind != WAIT:
                user.unplaced_non_wait -= 1
            if user.unplaced == 0 and user.kind == WAIT:
                self._ready(user)
            elif user.kind != WAIT and user.unplaced_non_wait == 0 and \
                    user.unready_waits == 0 and user.queued is None:
                self._enqueue(user)
            elif block.kind == WAIT and user.kind == COLLECTIVE and \
                    user.queued in ("stall_free", "stalling") and \
                    all(w.placed for w in user.wait_deps):
                # Its waits were placed for another block: now it is raised, under RO-8
                # (RO-10), not filled in as compute past the in-flight limit.
                user.queued = None
                self._enqueue(user)

    def _advance_clock(self, i: int) -> None:
        """The compute stream and the group streams as SIM-5..SIM-7 replay the order."""
        d = self.p.duration[i]
        if i in self.p.group:
            group = self.p.group[i]
            start = max(self.clock, self.stream_free.get(group, 0.0))
            self.stream_free[group] = end = start + d
            if i in self.p.in_flight:
                self.finish[i] = end
            else:  # a blocking kernel: the compute stream waits for it
                self.clock = end
        elif i in self.p.completes:
            ends = [self.finish.get(c, 0.0) for c in self.p.completes[i]]
            self.clock = max([self.clock, *ends]) + d
        else:
            self.clock += d


# --------------------------------------------------------------------------------------
# The pass (RO-1, RO-2)
# --------------------------------------------------------------------------------------
def reorder(gm: torch.fx.GraphModule, config: ReorderConfig | None = None
            ) -> torch.fx.GraphModule:
    """`gm`'s nodes in a new order that overlaps its collectives with compute (RO-1).

    Returns a new GraphModule (`gm` is untouched) whose `meta[ORIGINAL_ORDER]` names the
    nodes of the original order, which a later reorder reads (RO-2). `config` defaults to
    `ReorderConfig()`.
    """
    require_type(gm, torch.fx.GraphModule, "gm", "a torch.fx.GraphModule", "RO-1")
    config = ReorderConfig() if config is None else config
    require_type(config, ReorderConfig, "config", "a ReorderConfig", "RO-1")
    # As a memory plan (MEM-10): the pass makes tens of thousands of objects beside a
    # graph of hundreds of thousands, none of them garbage before it returns; the
    # collector would rescan the graph for nothing.
    with collector_paused():
        program = _Program(gm, config)
        body = [program.body[i] for i in _Scheduler(program, config).run()]
        result = _rebuilt(gm, program.inputs + body + program.output,
                          [n.name for n in program.inputs + program.body + program.output])
        # Freed here rather than scanned by the collection that resuming the collector
        # starts (the pass's objects would be young garbage to it).
        del program, body
    return result


def _rebuilt(gm: torch.fx.GraphModule, order: list[torch.fx.Node],
             original: list[str]) -> torch.fx.GraphModule:
    """A new GraphModule of copies of `gm`'s nodes, in `order`, names and meta kept."""
    graph = _fx.empty_graph_like(gm)
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in order:
        copies[node] = graph.node_copy(node, copies.__getitem__)
    result = torch.fx.GraphModule(gm, graph, gm.__class__.__name__)
    result.meta = dict(gm.meta)
    result.meta[ORIGINAL_ORDER] = tuple(original)
    return result


# --------------------------------------------------------------------------------------
# Checking a hand-written order (RO-3 .. RO-9)
# --------------------------------------------------------------------------------------
class OrderError(ValueError):
    """An order that breaks a rule of SPEC section 4: `rule` is its ID, `nodes` the nodes
    of the first violation (in the order given)."""

    def __init__(self, rule: str, nodes, message: str):
        super().__init__(message)
        self.rule, self.nodes = rule, tuple(nodes)


def check_order(gm: torch.fx.GraphModule, order, config: ReorderConfig | None = None) -> None:
    """Raise `OrderError` naming the rule and the nodes of the first violation of
    RO-3..RO-9 in `order`, an order of `gm`'s nodes (nodes or their names; inputs and
    the output may be left out), judged against `gm`'s original order (RO-2) and
    `config` (its memory budget and in-flight limits). Returns None for a legal order.

    This is refimpl's own check, for users writing an order by hand; the conformance
    suite judges orders with a validator of its own (conformance/reorder_rules.py).
    """
    require_type(gm, torch.fx.GraphModule, "gm", "a torch.fx.GraphModule", "RO-1")
    config = ReorderConfig() if config is None else config
    require_type(config, ReorderConfig, "config", "a ReorderConfig", "RO-1")
    with collector_paused():
        program = _Program(gm, config)
        new = _body_order(program, order)
        edge = _first_edge_broken(program, new)
        found = [v for v in (edge, _first_block_apart(program, new),
                             _first_limit_broken(program, new, config),
                             # a plan needs an order that reads nothing before it is made
                             None if edge is not None else _memory_broken(program, new, config))
                 if v is not None]
    if found:
        at, rule, nodes, what = min(found, key=lambda v: v[0])
        names = [n.name for n in nodes]
        raise OrderError(rule, nodes, f"order: {what} (nodes {names}) [{rule}]")


def _body_order(program: _Program, order) -> list[int]:
    """`order` as original positions of the body's nodes, each exactly once (RO-3)."""
    try:
        items = list(order)
    except TypeError:
        raise TypeError(f"order: expected a sequence of gm's nodes or names, got "
                        f"{type(order).__name__} [RO-3]") from None
    by_name = {n.name: n for n in program.gm.graph.nodes}
    nodes = []
    for item in items:
        node = by_name.get(item) if isinstance(item, str) else item
        if not isinstance(node, torch.fx.Node) or by_name.get(node.name) is not node:
            raise ValueError(f"order: {item!r} is no node of gm [RO-3]")
        nodes.append(node)
    inputs = [n for n in nodes if n.op in INPUT_OPS]
    if inputs and (inputs != program.inputs[:len(inputs)] or nodes[:len(inputs)] != inputs):
        raise OrderError("RO-3", inputs, "order: RO-3: the inputs must come first, in "
                         f"their order (nodes {[n.name for n in inputs]}) [RO-3]")
    if any(n.op == "output" for n in nodes[:-1]):
        raise OrderError("RO-3", program.output, "order: RO-3: the output must come last "
                         f"(nodes {[n.name for n in program.output]}) [RO-3]")
    positions = [program.pos[n] for n in nodes if n in program.pos]
    if len(set(positions)) != len(positions) or len(positions) != len(program.body):
        twice = sorted({program.body[i].name for i in positions if positions.count(i) > 1})
        missing = sorted(n.name for n in program.body if n not in set(nodes))
        raise ValueError(f"order: must hold every node of gm once; twice {twice[:5]}, "
                         f"missing {missing[:5]} [RO-3]")
    return positions


def _edge_rule(program: _Program, before: int, after: int) -> str:
    """Which rule an edge of the program's dependencies stands for (RO-3 .. RO-6)."""
    first, then = program.body[before], program.body[after]
    if first in then.all_input_nodes:
        return "RO-3"
    if program.group.get(before) is not None and \
            program.group.get(before) == program.group.get(after):
        return "RO-5"
    if barrier_reason(first) is not None or barrier_reason(then) is not None:
        return "RO-6"
    return "RO-4"


_WHAT = {"RO-3": "reads the result of", "RO-4": "comes before a version it must follow:",
         "RO-5": "is issued on its group before", "RO-6": "crosses the barrier"}


def _first_edge_broken(program: _Program, new: list[int]):
    at = {i: k for k, i in enumerate(new)}
    for k, i in enumerate(new):
        late = [p for p in program.preds[i] if at[p] > k]
        if late:
            p = min(late, key=at.__getitem__)
            rule = _edge_rule(program, p, i)
            node, other = program.body[i], program.body[p]
            return (k, rule, [node, other], f"{rule}: {node.name!r} {_WHAT[rule]} "
                    f"{other.name!r}, placed after it")
    return None


def _first_block_apart(program: _Program, new: list[int]):
    at = {i: k for k, i in enumerate(new)}
    worst = None
    for members in program.blocks():
        if len(members) < 2:
            continue
        places = [at[i] for i in members]
        if places != list(range(places[0], places[0] + len(places))):
            k = next(at[i] for i, want in zip(members, range(places[0], places[0] + len(members)),
                                              strict=True) if at[i] != want)
            nodes = [program.body[i] for i in members]
            found = (k, "RO-7", nodes, f"RO-7: block {[n.name for n in nodes]} is not "
                     f"consecutive, in its original order")
            worst = found if worst is None or found[0] < worst[0] else worst
    return worst


def _first_limit_broken(program: _Program, new: list[int], config: ReorderConfig):
    limits = config.max_in_flight
    if not limits:
        return None
    waits_left: dict[int, int] = {}
    for collectives in program.completes.values():
        for c in collectives:
            waits_left[c] = waits_left.get(c, 0) + 1
    flying: dict[tuple, int] = {}
    issued: set[int] = set()
    for k, i in enumerate(new):
        node = program.body[i]
        kind = collective_kind(node)
        if i in program.in_flight and kind in limits:
            flight = (program.group[i], kind)
            issued.add(i)
            flying[flight] = flying.get(flight, 0) + 1
            if flying[flight] > limits[kind]:
                return (k, "RO-8", [node], f"RO-8: {node.name!r} is issued with "
                        f"{flying[flight] - 1} {kind} of group {flight[0]!r} in flight "
                        f"(max_in_flight[{kind!r}] = {limits[kind]})")
        for c in program.completes.get(i, ()):
            waits_left[c] -= 1
            c_kind = collective_kind(program.body[c])
            if waits_left[c] == 0 and c in issued:  # (a wait before its collective
                flying[(program.group[c], c_kind)] -= 1  # breaks RO-3, found there)
    return None


def _memory_broken(program: _Program, new: list[int], config: ReorderConfig):
    original = program.model.plan(program.body)
    limit = config.memory_limit(original.peak_bytes)
    if math.isinf(limit) or _first_limit_broken(program, list(range(len(program.body))),
                                                config) is not None:
        return None  # no bound, or RO-9's exception: the original order breaks a limit
    plan = program.model.plan([program.body[i] for i in new])
    if plan.peak_bytes <= limit:
        return None
    node = plan.peak_node
    k = new.index(program.pos[node]) if node in program.pos else len(new)
    return (k, "RO-9", [node], f"RO-9: the planned peak {plan.peak_bytes} B (at "
            f"{node.name!r}) is more than {limit} B, (1 + memory_budget) times the "
            f"original order's {original.peak_bytes} B")
