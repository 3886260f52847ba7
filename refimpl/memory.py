"""Memory planning: where every byte of an FX program lives, node by node.

`plan_memory(gm, order=None)` follows *buffers*, not node names. A node's result is
either a new buffer or a rename of one that exists: a view, an in-place op, an `out=` op
and a wait whose op returns its input are renames with no cost, and a buffer is freed
only after the last use of its last alias (MEM-2, MEM-3). refimpl's traced `wait_tensor`
returns a copy (FC-5), which is a buffer of its own (MEM-4). A collective keeps the
buffers it communicates alive until its wait (MEM-5). Graph inputs are the caller's
(counted, never freed), outputs live to the end, comm buffers are persistent (MEM-6..8).
At a node, its new buffers are allocated before the buffers it used last are freed
(MEM-9). The plan is one linear sweep over the order (MEM-10, MEM-11).

`verify_memory_lifecycle(gm, *args)` runs the graph node by node on real tensors,
watches every storage and raises `MemoryLifecycleError` at the first allocation or free
the plan did not predict, or a predicted one that did not happen (MEM-12).

`MemoryModel(gm)` is the analysis behind both: built once per graph, it plans any
order in linear time, and `MemoryModel.sweep()` places nodes one at a time for a
scheduler that needs the live bytes as it goes.

Implements SPEC.md section "Memory": MEM-1 .. MEM-12.
"""

from __future__ import annotations

import contextlib
import gc
import operator
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils._pytree import tree_leaves

from refimpl import comm_ops
from refimpl._errors import require_type
from refimpl._fx import is_subgraph, is_wait, node_args, size_hint

__all__ = [
    "Buffer", "MemoryEvent", "MemoryPlan", "MemoryModel", "MemorySweep", "plan_memory",
    "verify_memory_lifecycle", "MemoryLifecycleError", "INPUT", "INTERMEDIATE", "OUTPUT",
    "COMM_BUFFER",
]

# Buffer kinds (MEM-1).
INPUT, INTERMEDIATE, OUTPUT, COMM_BUFFER = "input", "intermediate", "output", "comm_buffer"


class MemoryLifecycleError(AssertionError):
    """A run allocated or freed a buffer other than where the plan said (MEM-12)."""


# --------------------------------------------------------------------------------------
# Node classification: collectives and waits (refimpl/comm_ops.py, read by every pass),
# and the renames a schema does not state.
# --------------------------------------------------------------------------------------
# What a communication op is (a collective, a wait, what it holds in flight: MEM-5, and
# whether it returns its argument unannotated: upstream's wait) is its row in
# refimpl/comm_ops.py. `_unsafe_view` is ATen's rename that a schema does not state: a
# view that exists to look like a fresh tensor (MEM-2, MEM-4).
UNSAFE_VIEW = ("aten", "_unsafe_view")


def is_collective(node: torch.fx.Node) -> bool:
    """A collective that is completed by a wait (not a wait itself)."""
    row = comm_ops.node_op(node)
    return row is not None and row.is_collective


def renames_unannotated(target) -> bool:
    """A result that is its first argument though the schema does not say so (MEM-2)."""
    row = comm_ops.find(target)
    return (row is not None and row.returns_argument) or _qualified(target) == UNSAFE_VIEW


def _qualified(target) -> tuple[str, str]:
    return target.namespace, target._schema.name.split("::", 1)[1]


_ALIASING: dict = {}


def _return_alias_sets(schema) -> list[set[str]]:
    """The alias set of each return; a list's element annotation (`Tensor(a)[]`) is not
    exposed by the Python schema object, so it is read from the schema's text."""
    texts = str(schema).split(") -> ", 1)[1].strip()
    if texts.startswith("(") and texts.endswith(")"):
        texts = texts[1:-1]
    texts = texts.split(", ") if schema.returns else []
    sets = []
    for r, text in zip(schema.returns, texts, strict=False):
        found = set(r.alias_info.before_set) if r.alias_info is not None else set()
        if not found and "(" in text:
            found = set(text.split("(", 1)[1].split(")", 1)[0].replace("!", "").split("|"))
        sets.append(found)
    return sets


def aliasing_of(target) -> list[int | str | None]:
    """Per schema return: the index (or kwarg name) of the argument it renames, or None.

    From the schema's alias annotations (`Tensor(a)` views, `Tensor(a!)` in-place and
    `out=` results, `Tensor(a)[]` splits) and `renames_unannotated` (MEM-2)."""
    if target in _ALIASING:
        return _ALIASING[target]
    schema = target._schema
    result = []
    for alias_set in _return_alias_sets(schema):
        source = None
        for i, a in enumerate(schema.arguments):
            if alias_set and a.alias_info is not None and a.alias_info.before_set & alias_set:
                source = a.name if a.kwarg_only else i
                break
        result.append(source)
    if renames_unannotated(target):
        result = [0]
    _ALIASING[target] = result
    return result


def _collective_members(node: torch.fx.Node) -> list[tuple[list[torch.fx.Node], int]]:
    """Per member of a collective: (its tensor arguments, index of its result)."""
    listed = comm_ops.member_list_index(node.target)
    if listed is not None and listed < len(node.args):
        # coalesced: member i is tensor i of the list (batch_p2p_ops's is its fourth
        # argument) and result i
        return [([a], i) for i, a in enumerate(node_args(node.args[listed]))]
    first = node.args[0] if node.args else None
    return [(node_args(first) + node_args(node.kwargs.get("out")), 0)]


# --------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------
@dataclass(eq=False)
class Buffer:
    """One allocation: its bytes, where it is allocated and freed, and every alias."""

    index: int
    nbytes: int
    kind: str  # INPUT, INTERMEDIATE, OUTPUT or COMM_BUFFER
    alloc_node: torch.fx.Node
    aliases: list[torch.fx.Node] = field(default_factory=list)  # the allocating node first
    free_node: torch.fx.Node | None = None  # None: never freed by the graph

    @property
    def name(self) -> str:
        return self.alloc_node.name

    def __repr__(self):
        freed = self.free_node.name if self.free_node is not None else "never"
        return f"Buffer({self.name}, {self.nbytes} B, {self.kind}, freed at {freed})"


@dataclass(frozen=True)
class MemoryEvent:
    """`kind` ("alloc" or "free") of `buffer` at `node`."""

    kind: str
    buffer: Buffer
    node: torch.fx.Node

    def __repr__(self):
        return f"{self.kind} {self.buffer.name} ({self.buffer.nbytes} B) at {self.node.name}"


@dataclass
class MemoryPlan:
    """The buffers of one node order of a graph, and the live bytes along it (MEM-1)."""

    graph: torch.fx.Graph
    order: list[torch.fx.Node]  # every node: inputs first, then the order, output last
    buffers: list[Buffer]
    events: list[MemoryEvent]
    live_bytes: list[int]  # after each node of `order`, its frees done
    peak_bytes: int
    peak_node: torch.fx.Node | None
    model: MemoryModel = field(repr=False)

    def buffer_of(self, node: torch.fx.Node) -> list[Buffer]:
        """The buffers `node`'s tensors live in, in pytree order of its value."""
        return [self.buffers[b.index] for b in self.model.node_buffers.get(node, ())]

    def table(self, unit: int = 1) -> str:
        """One line per node that allocates or frees: `+size name`, `-size name`, then the
        live size; sizes in bytes divided by `unit` (2**20: MiB)."""
        def size(nbytes):
            return f"{nbytes / unit:g}" if unit != 1 else str(nbytes)

        by_node: dict[torch.fx.Node, list[str]] = {}
        for e in self.events:
            sign = "+" if e.kind == "alloc" else "-"
            by_node.setdefault(e.node, []).append(f"{sign}{size(e.buffer.nbytes)} "
                                                  f"{e.buffer.name}")
        lines = []
        for node, live in zip(self.order, self.live_bytes, strict=True):
            if node in by_node:
                lines.append(f"{node.name:24s} {' '.join(by_node[node]):44s} live {size(live)}")
        peak_at = self.peak_node.name if self.peak_node is not None else "-"
        lines.append(f"peak {size(self.peak_bytes)} at {peak_at}")
        return "\n".join(line.rstrip() for line in lines)


def _nbytes(value) -> int:
    return size_hint(value.untyped_storage().nbytes())  # MEM-1: a symbolic one too


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if value is None or isinstance(value, (int, float, bool, torch.SymInt)):
        return []
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def collector_paused():
    """Pause Python's cyclic garbage collector while a plan is built (MEM-10).

    A plan allocates tens of thousands of small objects next to a graph of hundreds of
    thousands; each time the collector runs it rescans the whole graph (measured: most of
    the time of `simulate` on 4,000 collectives). Nothing a plan allocates is cyclic
    garbage, so collecting can wait until it is done."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class MemoryModel:
    """The buffers of a graph and how its nodes use them; plans any order in O(N + E).

    Built once per graph (MEM-10): a scheduler that tries many orders keeps one model and
    calls `plan(order)`, or `sweep()` to place nodes one at a time.
    """

    def __init__(self, gm: torch.fx.GraphModule):
        require_type(gm, torch.fx.GraphModule, "gm", "a torch.fx.GraphModule", "MEM-1")
        self.gm = gm
        self.graph = gm.graph
        self.nodes = list(self.graph.nodes)
        self.buffers: list[Buffer] = []
        self.node_buffers: dict[torch.fx.Node, list[Buffer]] = {}
        self.allocs: dict[torch.fx.Node, tuple[int, ...]] = {}
        self.uses: dict[torch.fx.Node, tuple[int, ...]] = {}
        # Collectives: (buffer a wait completes, buffers held in flight until then) per member.
        self.in_flight: dict[torch.fx.Node, list[tuple[int, tuple[int, ...]]]] = {}
        self.completes: dict[torch.fx.Node, tuple[int, ...]] = {}  # wait -> its buffers
        with collector_paused():
            self._find_buffers()
            self._find_uses()
            self._find_collectives()

    # ---- analysis ---------------------------------------------------------------------
    def _find_buffers(self) -> None:
        inputs_by_storage: dict[int, Buffer] = {}
        for node in self.nodes:
            if node.op == "output":
                continue
            value = node.meta.get("val")
            if value is None:
                if node.users and not is_subgraph(self.gm, node):
                    raise ValueError(f"gm: node {node.name!r} has users but no meta['val']; "
                                     f"plan_memory needs a graph traced with fake values "
                                     f"(make_fx, torch.compile) [MEM-1]")
                continue
            if node.op in ("placeholder", "get_attr"):
                buffers = self._input_buffers(node, value, inputs_by_storage)
            elif node.target is operator.getitem:
                buffers = self._element_buffers(node)
            elif isinstance(node.target, torch._ops.OpOverload):
                buffers = self._op_buffers(node, value)
            else:  # a Python function (empty_strided_p2p, ...): its tensors are new
                buffers = [self._new_buffer(node, t) for t in _tensors(value)]
            for buffer in dict.fromkeys(buffers):
                if buffer.aliases[-1] is not node:
                    buffer.aliases.append(node)
            self.node_buffers[node] = buffers
            self.allocs[node] = tuple(b.index for b in dict.fromkeys(buffers)
                                      if b.alloc_node is node)
        output = self._output_node()
        if output is not None:
            for arg in node_args(output.args):
                for buffer in self.node_buffers.get(arg, ()):
                    if buffer.kind == INTERMEDIATE:
                        buffer.kind = OUTPUT

    def _new_buffer(self, node: torch.fx.Node, tensor: torch.Tensor) -> Buffer:
        buffer = Buffer(len(self.buffers), _nbytes(tensor), self._kind_of(node), node, [node])
        self.buffers.append(buffer)
        return buffer

    def _input_buffers(self, node, value, by_storage) -> list[Buffer]:
        """Inputs that share a storage (views of one tensor) are one buffer."""
        buffers = []
        for tensor in _tensors(value):
            key = tensor.untyped_storage()._cdata
            if key not in by_storage:
                by_storage[key] = self._new_buffer(node, tensor)
            buffers.append(by_storage[key])
        return buffers

    def _element_buffers(self, node) -> list[Buffer]:
        """`getitem(source, i)`: the buffers of element i of the source's value."""
        source, index = node.args[0], node.args[1]
        value = source.meta.get("val")
        if not isinstance(value, (list, tuple)) or not isinstance(index, int):
            return [self._new_buffer(node, t) for t in _tensors(node.meta.get("val"))]
        start = sum(len(_tensors(v)) for v in value[:index])
        return self.node_buffers.get(source, [])[start:start + len(_tensors(value[index]))]

    def _op_buffers(self, node, value) -> list[Buffer]:
        """Per schema return: a rename of the argument it aliases, else new buffers."""
        aliasing = aliasing_of(node.target)
        values = [value] if len(aliasing) == 1 else list(value)
        buffers = []
        for source, returned in zip(aliasing, values, strict=False):
            arg = None
            if source is not None:
                arg = node.args[source] if isinstance(source, int) and source < len(node.args) \
                    else node.kwargs.get(source if isinstance(source, str) else "")
            tensors = _tensors(returned)
            sources = [b for a in node_args(arg) for b in self.node_buffers.get(a, [])]
            if not sources:
                buffers.extend(self._new_buffer(node, t) for t in tensors)
            elif len(sources) == len(tensors):
                buffers.extend(sources)  # a list renames a list, element by element
            else:
                buffers.extend(sources[0] for _ in tensors)  # views of one buffer
        return buffers

    @staticmethod
    def _kind_of(node: torch.fx.Node) -> str:
        if node.op in ("placeholder", "get_attr"):
            return INPUT
        if "comm_buffer" in node.meta and "out" not in node.kwargs:
            return COMM_BUFFER
        return INTERMEDIATE

    def _output_node(self) -> torch.fx.Node | None:
        return self.nodes[-1] if self.nodes and self.nodes[-1].op == "output" else None

    def _find_uses(self) -> None:
        self.use_count = [0] * len(self.buffers)
        for node in self.nodes:
            used = []
            for arg in node.all_input_nodes:
                used.extend(b.index for b in self.node_buffers.get(arg, ()))
            used = tuple(dict.fromkeys(used))
            self.uses[node] = used
            for b in used:
                self.use_count[b] += 1
        self.pinned = [b.kind != INTERMEDIATE for b in self.buffers]

    def _find_collectives(self) -> None:
        for node in self.nodes:
            if is_wait(node):
                self.completes[node] = tuple(
                    b.index for a in node_args(node.args[:1])
                    for b in self.node_buffers.get(a, ()))
            elif is_collective(node):
                self.in_flight[node] = self._members(node)

    def _members(self, node) -> list[tuple[int, tuple[int, ...]]]:
        results = self.node_buffers.get(node, [])
        members = []
        for args, i in _collective_members(node):
            if i >= len(results):
                continue
            done = results[i].index
            result_only = comm_ops.member_in_flight(node, i) == "result"  # MEM-5
            held = [done] if result_only else \
                [b.index for a in args for b in self.node_buffers.get(a, ())] + [done]
            members.append((done, tuple(dict.fromkeys(held))))
        return members

    # ---- orders -----------------------------------------------------------------------
    def full_order(self, order=None) -> list[torch.fx.Node]:
        """Inputs first, then `order` (program order by default), the output last (MEM-11).

        Every node other than placeholders, get_attrs and the output must appear exactly
        once, after every node it reads."""
        inputs = [n for n in self.nodes if n.op in ("placeholder", "get_attr")]
        body = [n for n in self.nodes if n.op not in ("placeholder", "get_attr", "output")]
        tail = [n for n in self.nodes if n.op == "output"]
        if order is None:
            return inputs + body + tail
        given = [n for n in order if n.op not in ("placeholder", "get_attr", "output")]
        position: dict[torch.fx.Node, int] = {}
        for i, node in enumerate(given):
            if node.graph is not self.graph:
                raise ValueError(f"order: node {node.name!r} is not a node of gm [MEM-11]")
            if node in position:
                raise ValueError(f"order: node {node.name!r} appears twice [MEM-11]")
            position[node] = i
        missing = [n.name for n in body if n not in position]
        if missing:
            raise ValueError(f"order: misses nodes {missing[:5]} of gm [MEM-11]")
        for node in given:
            for arg in node.all_input_nodes:
                if arg in position and position[arg] > position[node]:
                    raise ValueError(f"order: node {node.name!r} comes before its input "
                                     f"{arg.name!r} [MEM-11]")
        return inputs + given + tail

    def plan(self, order=None) -> MemoryPlan:
        """The memory plan of `order` (program order by default)."""
        with collector_paused():
            return self._plan(order)

    def _plan(self, order) -> MemoryPlan:
        full = self.full_order(order)
        sweep = MemorySweep(self, record=True)
        live = []
        for node in full:
            sweep.place(node)
            live.append(sweep.live_bytes)
        buffers = [Buffer(b.index, b.nbytes, b.kind, b.alloc_node, list(b.aliases))
                   for b in self.buffers]
        for b in buffers:
            b.free_node = sweep.freed_at[b.index]
        events = [MemoryEvent(kind, buffers[b], node) for kind, b, node in sweep.events]
        return MemoryPlan(self.graph, full, buffers, events, live, sweep.peak_bytes,
                          sweep.peak_node, self)

    def sweep(self) -> MemorySweep:
        """An empty sweep: place nodes one by one (inputs first) and read the live bytes."""
        return MemorySweep(self)

    def alloc_bytes(self, node: torch.fx.Node) -> int:
        """Bytes `node` allocates: placing it next raises the live bytes by this first."""
        return sum(self.buffers[b].nbytes for b in self.allocs.get(node, ()))


class MemorySweep:
    """Live bytes along an order built one node at a time (MEM-3, MEM-5, MEM-9).

    `place(node)` allocates the node's new buffers, then frees every buffer whose last
    use (over all its aliases) this was and that no collective holds in flight; a wait
    releases what its collective held. `live_bytes`, `peak_bytes` and `peak_node` are
    current after each call. The caller places inputs first and keeps the order valid
    (`MemoryModel.full_order` checks a whole one).
    """

    def __init__(self, model: MemoryModel, record: bool = False):
        self.model = model
        self.remaining = list(model.use_count)
        self.holds = [0] * len(model.buffers)
        self.pending: dict[int, list[tuple[int, ...]]] = {}  # completed buffer -> held sets
        self.freed_at: list[torch.fx.Node | None] = [None] * len(model.buffers)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_node: torch.fx.Node | None = None
        self.record = record
        self.events: list[tuple[str, int, torch.fx.Node]] = []

    def place(self, node: torch.fx.Node) -> None:
        allocated = self._allocate(node)  # a node's outputs before its frees (MEM-9)
        self._free(node, allocated)

    def peek_peak(self, nodes) -> int:
        """The most bytes live while `nodes` would be placed next, in order (each node's
        outputs counted before its frees, MEM-9), without placing them: what `place`
        would make `peak_bytes` reach, given the sweep's state now."""
        model = self.model
        remaining: dict[int, int] = {}
        holds: dict[int, int] = {}
        pending: dict[int, list] = {}  # added by `nodes`
        popped: set[int] = set()  # done buffers whose pending holds `nodes` completed
        freed: set[int] = set()
        live = peak = self.live_bytes
        for node in nodes:
            allocated = model.allocs.get(node, ())
            live += sum(model.buffers[b].nbytes for b in allocated)
            peak = max(peak, live)
            dying = [b for b in allocated if self.remaining[b] == 0]
            for b in model.uses.get(node, ()):
                remaining[b] = remaining.get(b, self.remaining[b]) - 1
                if remaining[b] == 0:
                    dying.append(b)
            for done, held in model.in_flight.get(node, ()):
                for b in held:
                    holds[b] = holds.get(b, self.holds[b]) + 1
                pending.setdefault(done, []).append(held)
            for done in model.completes.get(node, ()):
                sets = pending.pop(done, [])
                if done not in popped:
                    sets = self.pending.get(done, []) + sets
                    popped.add(done)
                for held in sets:
                    for b in held:
                        holds[b] = holds.get(b, self.holds[b]) - 1
                        dying.append(b)
            for b in dict.fromkeys(dying):
                if (remaining.get(b, self.remaining[b]) == 0 and holds.get(b, self.holds[b]) == 0
                        and not model.pinned[b] and self.freed_at[b] is None and b not in freed):
                    freed.add(b)
                    live -= model.buffers[b].nbytes
        return peak

    def _allocate(self, node: torch.fx.Node) -> tuple[int, ...]:
        allocated = self.model.allocs.get(node, ())
        for b in allocated:
            self.live_bytes += self.model.buffers[b].nbytes
            if self.record:
                self.events.append(("alloc", b, node))
        if self.peak_node is None or self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_node = self.live_bytes, node
        return allocated

    def _free(self, node: torch.fx.Node, allocated: tuple[int, ...]) -> None:
        """Free what `node` read last and no collective holds; a wait releases holds."""
        model = self.model
        dying = [b for b in allocated if self.remaining[b] == 0]  # read by nobody
        for b in model.uses.get(node, ()):
            self.remaining[b] -= 1
            if self.remaining[b] == 0:
                dying.append(b)
        for done, held in model.in_flight.get(node, ()):
            for b in held:
                self.holds[b] += 1
            self.pending.setdefault(done, []).append(held)
        for done in model.completes.get(node, ()):
            for held in self.pending.pop(done, ()):
                for b in held:
                    self.holds[b] -= 1
                    dying.append(b)
        for b in dict.fromkeys(dying):
            if (self.remaining[b] == 0 and self.holds[b] == 0 and not model.pinned[b]
                    and self.freed_at[b] is None):
                self.freed_at[b] = node
                self.live_bytes -= model.buffers[b].nbytes
                if self.record:
                    self.events.append(("free", b, node))


def plan_memory(gm: torch.fx.GraphModule, order=None) -> MemoryPlan:
    """Where every byte of `gm` lives along `order` (program order by default) (MEM-1)."""
    return MemoryModel(gm).plan(order)


# --------------------------------------------------------------------------------------
# The lifecycle verifier (MEM-12)
# --------------------------------------------------------------------------------------
# How long a predicted free of a buffer a collective held may trail its node: gloo's
# worker thread drops its reference to a finished collective (and so to the buffers it
# held) just after the wait returns. Any other storage dies with its last reference.
FREE_GRACE_S = 2.0
# After a wait, how long no storage may die before the next node runs, so that a free
# the plan puts one node late is not mistaken for the worker thread's lag.
SETTLE_S = 0.002


class _Watch:
    """One real storage, the buffer it realizes, and whether it died."""

    __slots__ = ("buffer", "nbytes", "dead", "persistent")

    def __init__(self, buffer: Buffer, nbytes: int, persistent: bool):
        self.buffer, self.nbytes, self.persistent = buffer, nbytes, persistent
        self.dead = False


class _Watcher:
    """Storages seen so far, by identity; deaths arrive through weakref.finalize."""

    def __init__(self):
        self.by_buffer: dict[int, _Watch] = {}
        self.by_storage: dict[int, _Watch] = {}  # storage _cdata -> live watch
        self.deaths: list[_Watch] = []
        self.lock = threading.Lock()

    def find(self, tensor: torch.Tensor) -> _Watch | None:
        watch = self.by_storage.get(tensor.untyped_storage()._cdata)
        return watch if watch is not None and not watch.dead else None

    def watch(self, tensor: torch.Tensor, buffer: Buffer) -> None:
        storage = tensor.untyped_storage()
        watch = _Watch(buffer, storage.nbytes(), _is_persistent(tensor))
        self.by_buffer[buffer.index] = watch
        self.by_storage[storage._cdata] = watch
        weakref.finalize(storage, self._died, watch)

    def _died(self, watch: _Watch) -> None:
        with self.lock:  # may run on a process-group worker thread
            watch.dead = True
            self.deaths.append(watch)

    def take_deaths(self) -> list[_Watch]:
        with self.lock:
            deaths, self.deaths = self.deaths, []
        return [w for w in deaths if not w.persistent]


def _is_persistent(tensor: torch.Tensor) -> bool:
    """A symmetric allocation with an alloc_id: its memory outlives its tensors (SM-4)."""
    symm = sys.modules.get("refimpl.symmetric_memory")
    if symm is None:  # never imported: no tensor can live in symmetric memory
        return False
    try:
        get_allocator = symm.get_allocator
        allocation = get_allocator(tensor.device.type).allocation_of(tensor)
    except (ValueError, AttributeError):
        return False
    return allocation is not None and allocation.alloc_id is not None


def _fail(message: str) -> None:
    raise MemoryLifecycleError(message + " [MEM-12]")


class _LifecycleRun:
    """One node-by-node run of a graph against its plan."""

    def __init__(self, gm, plan: MemoryPlan):
        self.gm, self.plan = gm, plan
        self.watcher = _Watcher()
        self.live = 0
        self.peak = 0
        self.frees_at: dict[torch.fx.Node, set[int]] = {}
        for b in plan.buffers:
            if b.free_node is not None:
                self.frees_at.setdefault(b.free_node, set()).add(b.index)
        # Buffers some collective communicates (MEM-5): only their deaths may lag.
        self.held = {b for members in plan.model.in_flight.values()
                     for _, held in members for b in held}

    def run(self, args) -> int:
        order = self.plan.order
        last_reader = {}
        for i, node in enumerate(order):
            for arg in node.all_input_nodes:
                last_reader[arg] = i
        interpreter = torch.fx.Interpreter(self.gm, garbage_collect_values=False)
        env = interpreter.env
        inputs = iter(args)
        for i, node in enumerate(order):
            if node.op == "placeholder":
                env[node] = next(inputs)
            elif node.op == "output":
                break
            else:
                env[node] = interpreter.run_node(node)
            self.observe_allocations(node, env[node])
            for arg in [a for a in node.all_input_nodes if last_reader.get(a) == i]:
                del env[arg]  # the program drops a value after its last reader
            if node not in last_reader and node.op != "placeholder":
                del env[node]
            self.observe_frees(node)
        self.check_every_allocation_happened()
        return self.peak

    def observe_allocations(self, node, value) -> None:
        planned = self.plan.buffer_of(node)
        tensors = _tensors(value)
        if len(tensors) != len(planned):
            _fail(f"node {node.name!r} produced {len(tensors)} tensors, the plan has "
                  f"{len(planned)}")
        for tensor, buffer in zip(tensors, planned, strict=True):
            seen = self.watcher.find(tensor)
            if buffer.alloc_node is node and seen is None:
                self.new_storage(node, tensor, buffer)
            elif buffer.alloc_node is node and seen.buffer is not buffer:
                _fail(f"buffer {buffer.name!r}: the plan allocates it at node {node.name!r}, "
                      f"but the run reused buffer {seen.buffer.name!r}")
            elif seen is None:
                _fail(f"node {node.name!r}: unpredicted allocation of "
                      f"{tensor.untyped_storage().nbytes()} bytes; the plan has it as an "
                      f"alias of buffer {buffer.name!r}")
            elif seen.buffer is not buffer:
                _fail(f"node {node.name!r}: its value lives in buffer {seen.buffer.name!r}, "
                      f"the plan says buffer {buffer.name!r}")
        self.peak = max(self.peak, self.live)

    def new_storage(self, node, tensor, buffer) -> None:
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes != buffer.nbytes:
            _fail(f"buffer {buffer.name!r} at node {node.name!r}: the plan counts "
                  f"{buffer.nbytes} bytes, its storage has {nbytes}")
        if buffer.index in self.watcher.by_buffer:
            _fail(f"buffer {buffer.name!r} was allocated twice (again at node {node.name!r})")
        if (buffer.kind == COMM_BUFFER) != _is_persistent(tensor):
            _fail(f"buffer {buffer.name!r}: the plan says kind {buffer.kind!r}, the run "
                  f"{'a' if _is_persistent(tensor) else 'no'} persistent comm buffer")
        self.watcher.watch(tensor, buffer)
        self.live += nbytes

    def observe_frees(self, node) -> None:
        expected = self.frees_at.get(node, set())
        freed = {w.buffer.index: w for w in self.watcher.take_deaths()}
        deadline = time.monotonic() + (FREE_GRACE_S if expected & self.held else 0.0)
        while not expected <= freed.keys() and time.monotonic() < deadline:
            time.sleep(0.0005)
            freed.update({w.buffer.index: w for w in self.watcher.take_deaths()})
        if is_wait(node):  # what the finished collective held may still be on its way
            freed.update({w.buffer.index: w for w in self.settle()})
        for b, watch in freed.items():
            if b not in expected:
                _fail(f"buffer {watch.buffer.name!r}: unpredicted free at node {node.name!r} "
                      f"(the plan frees it at "
                      f"{_name(self.plan.buffers[b].free_node)})")
            self.live -= watch.nbytes
        for b in expected - freed.keys():
            _fail(f"buffer {self.plan.buffers[b].name!r}: the plan frees it at node "
                  f"{node.name!r}, but it is still alive")

    def settle(self) -> list[_Watch]:
        """Deaths that arrive until none has for SETTLE_S (at most FREE_GRACE_S)."""
        deaths, quiet_since, deadline = [], time.monotonic(), time.monotonic() + FREE_GRACE_S
        while time.monotonic() - quiet_since < SETTLE_S and time.monotonic() < deadline:
            time.sleep(0.0002)
            more = self.watcher.take_deaths()
            if more:
                deaths += more
                quiet_since = time.monotonic()
        return deaths

    def check_every_allocation_happened(self) -> None:
        for b in self.plan.buffers:
            watch = self.watcher.by_buffer.get(b.index)
            if watch is None:
                _fail(f"buffer {b.name!r}: the plan allocates it at node {b.alloc_node.name!r}"
                      f", the run never did")


def _name(node) -> str:
    return repr(node.name) if node is not None else "no node (never)"


def verify_memory_lifecycle(gm: torch.fx.GraphModule, *args, plan: MemoryPlan | None = None,
                            order=None) -> int:
    """Run `gm` node by node on `args` and check every allocation and free against `plan`.

    The plan defaults to `plan_memory(gm, order)`. Raises MemoryLifecycleError naming the
    buffer and the node at the first allocation or free the plan did not predict, or a
    predicted one that did not happen. Returns the measured peak of live bytes, which
    equals `plan.peak_bytes` (MEM-12).
    """
    plan = plan if plan is not None else plan_memory(gm, order)
    if plan.graph is not gm.graph:
        raise ValueError("plan: it was made for another graph than gm's [MEM-12]")
    placeholders = [n for n in plan.order if n.op == "placeholder"]
    if len(args) != len(placeholders):
        raise ValueError(f"args: gm takes {len(placeholders)} inputs, got {len(args)} [MEM-12]")
    peak = _LifecycleRun(gm, plan).run(args)
    if peak != plan.peak_bytes:
        _fail(f"measured peak {peak} bytes, planned {plan.peak_bytes}")
    return peak

