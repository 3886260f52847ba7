"""Schedule simulator: what a node order of an FX program costs in time and memory.

A `CostModel` gives every node a duration in microseconds: collectives by an alpha-beta
model per group size (the algorithm refimpl/comm_ops.py names for the op), compute by a
roofline over a `HardwareProfile` (FLOPs counted from shapes, bytes read and written),
views, waits and bookkeeping nodes nothing; any node's duration can be pinned by name
(SIM-1..SIM-4). `simulate(gm, cost_model, order)` replays an order on one compute stream
and one comm stream per group: a collective is issued when the compute stream reaches
it, collectives of one group run one after another, and a wait blocks the compute stream
until its collective finished (SIM-5..SIM-8). The `Timeline` says how long the step
took, how much of the communication was exposed, and the peak memory of the same order
(refimpl.memory); it draws itself as a Chrome / Perfetto trace and as an SVG Gantt chart
(SIM-9, SIM-10).

Profiles: `H100_NVLINK_8` (published numbers, cited on the preset) and one measured on
this machine by `python -m refimpl.simulator calibrate` (SIM-11).

Implements SPEC.md section "Simulator": SIM-1 .. SIM-11.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

from refimpl import comm_ops
from refimpl._errors import require_type
from refimpl._fx import is_wait, size_hint
from refimpl.memory import MemoryModel, collector_paused, is_collective, renames_unannotated

__all__ = [
    "LinkCost", "HardwareProfile", "H100_NVLINK_8", "CostModel", "Simulator", "simulate",
    "Timeline", "TimelineEvent", "CollectiveTime", "COMPUTE_STREAM",
]

COMPUTE_STREAM = "compute"


# --------------------------------------------------------------------------------------
# Hardware profiles (SIM-11)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkCost:
    """Alpha-beta of a ring over one group size: latency per step, bus bandwidth."""

    alpha_us: float  # per ring step
    beta_bytes_per_us: float  # bus bandwidth (nccl-tests' busbw)


@dataclass(frozen=True)
class HardwareProfile:
    """What one device and its interconnect can do.

    flops_per_us: peak FLOP/us by dtype name ("float32", "bfloat16", ...); "default"
        for any other dtype.
    memory_bytes_per_us: memory bandwidth.
    links: LinkCost by group size; key 0 is used for sizes without their own entry.
    op_overhead_us: fixed cost of every compute node (kernel launch, Python dispatch).
    source: where the numbers come from.
    """

    name: str
    flops_per_us: dict[str, float]
    memory_bytes_per_us: float
    links: dict[int, LinkCost]
    op_overhead_us: float = 0.0
    source: str = ""

    def link(self, group_size: int) -> LinkCost:
        link = self.links.get(group_size, self.links.get(0))
        if link is None:
            raise ValueError(f"profile: {self.name!r} has no link cost for group size "
                             f"{group_size} and no default (key 0) [SIM-11]")
        return link

    def flops_rate(self, dtype: torch.dtype) -> float:
        name = str(dtype).replace("torch.", "")
        return self.flops_per_us.get(name, self.flops_per_us["default"])

    def to_json(self) -> str:
        data = asdict(self)
        data["links"] = {str(k): asdict(v) for k, v in self.links.items()}
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> HardwareProfile:
        data = json.loads(text)
        data["links"] = {int(k): LinkCost(**v) for k, v in data["links"].items()}
        return cls(**data)

    @classmethod
    def load(cls, path) -> HardwareProfile:
        return cls.from_json(Path(path).read_text())


# NVIDIA H100 SXM5, 8 GPUs on NVLink 4 (a DGX/HGX H100 node).
# - Dense peak FLOP/s: BF16/FP16 989 TFLOPS, TF32 494 TFLOPS, FP32 67 TFLOPS, FP8 1,979
#   TFLOPS (NVIDIA H100 Tensor Core GPU datasheet; its headline figures are with
#   sparsity, twice these). PyTorch's float32 matmul does not use TF32 by default.
# - HBM3 bandwidth 3.35 TB/s (same datasheet).
# - NVLink 4: 900 GB/s per GPU, both directions together (same datasheet): 450 GB/s per
#   direction is the ring's bus bandwidth at best.
# - Latency: NCCL's tuning model (src/graph/tuning.cc, ncclTunerConstantsDefaults): Ring /
#   Simple protocol 3.4 us per NVLink hop plus a base of 8.4 us per collective, folded
#   here into the per-step alpha of each group size: 3.4 + 8.4 / (n - 1).
def _h100_links() -> dict[int, LinkCost]:
    beta = 450e9 / 1e6
    links = {n: LinkCost(3.4 + 8.4 / (n - 1), beta) for n in (2, 4, 8)}
    links[0] = links[8]
    return links


H100_NVLINK_8 = HardwareProfile(
    name="H100 SXM5 x8, NVLink 4",
    flops_per_us={"bfloat16": 989e6, "float16": 989e6, "float8_e4m3fn": 1979e6,
                  "float8_e5m2": 1979e6, "float32": 67e6, "float64": 34e6, "default": 67e6},
    memory_bytes_per_us=3.35e6,
    links=_h100_links(),
    op_overhead_us=0.0,
    source="NVIDIA H100 Tensor Core GPU datasheet (dense FLOP/s, HBM3 3.35 TB/s, NVLink "
           "900 GB/s); NCCL src/graph/tuning.cc (ring/simple NVLink latency 3.4 us per hop, "
           "8.4 us base)",
)


# --------------------------------------------------------------------------------------
# The cost model (SIM-1 .. SIM-4)
# --------------------------------------------------------------------------------------
def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return size_hint(value.numel()) * value.element_size()  # symbolic: its example's
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _val(arg):
    """The value of an argument: a node's meta value, a list's values (the inputs of a
    coalesced collective) in their places, anything else as it is."""
    return torch.fx.node.map_arg(arg, lambda node: node.meta.get("val"))


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        return next((t for t in (_first_tensor(v) for v in value) if t is not None), None)
    return None


def _group_size_of(node: torch.fx.Node) -> int:
    """The size of a collective's group: its `group_size` argument or the registry's."""
    schema = node.target._schema
    values = {a.name: (node.args[i] if i < len(node.args) else node.kwargs.get(a.name))
              for i, a in enumerate(schema.arguments)}
    given, name = values.get("group_size"), values.get("group_name")
    registered = _registered_size(name)
    if isinstance(given, int) and not isinstance(given, bool):
        if registered is not None and registered != given:
            raise ValueError(f"gm: node {node.name!r} says group_size {given}, but its group "
                             f"{name!r} has {registered} ranks; its cost needs the real "
                             f"size [SIM-2]")
        return given
    if registered is None:
        raise ValueError(f"gm: node {node.name!r} names group {name!r}, which is not "
                         f"registered in this process; its size is needed for its cost "
                         f"[SIM-2]")
    return registered


def _registered_size(name) -> int | None:
    """The size of the process group registered under `name` here, None for none."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._resolve_process_group(name).size()
    except Exception:
        return None


def group_name_of(node: torch.fx.Node) -> str:
    schema = node.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == "group_name":
            return str(node.args[i] if i < len(node.args) else node.kwargs.get(a.name))
    return ""


def ring_us(link: LinkCost, n: int, nbytes: int) -> float:
    """One ring pass (all_gather, reduce_scatter): (n-1) alpha + (n-1)/n bytes / beta."""
    return (n - 1) * link.alpha_us + (n - 1) / n * nbytes / link.beta_bytes_per_us


def _output_bytes(node):
    return _tensor_bytes(node.meta.get("val"))


def _input_bytes(node):
    # A coalesced op's inputs are its list of members (batch_p2p_ops's fourth argument).
    listed = comm_ops.member_list_index(node.target)
    return _tensor_bytes(_val(node.args[0 if listed is None else listed]))


def _larger_bytes(node):
    return max(_input_bytes(node), _output_bytes(node))


# The algorithms a row of refimpl/comm_ops.py names (SIM-2): duration from (link, n, bytes).
ALGORITHMS = {
    "ring": ring_us,
    "twice_ring": lambda link, n, b: 2 * ring_us(link, n, b),  # reduce_scatter + all_gather
    "pipeline": lambda link, n, b: (n - 1) * link.alpha_us + b / link.beta_bytes_per_us,
    # SIM-7: every rank reads every peer's buffer once, after one signal round.
    "one_shot": lambda link, n, b: link.alpha_us + (n - 1) * b / link.beta_bytes_per_us,
    "direct": lambda link, n, b: link.alpha_us + b / link.beta_bytes_per_us,  # one peer
}
# The bytes a row names: its input's, its output's or the larger of the two (SIM-2).
COST_BYTES = {"input": _input_bytes, "output": _output_bytes, "larger": _larger_bytes}


def blocking_name(node: torch.fx.Node) -> str | None:
    """The op name of a blocking symmetric-memory kernel: no wait, the compute stream
    waits for it (SIM-7); None for anything else."""
    row = comm_ops.node_op(node)
    return row.name if row is not None and row.is_blocking else None


# Matmuls counted from their shapes: FlopCounterMode costs ~250 us a node (SIM-3).
def _mm_flops(node):
    a, b = _val(node.args[0]), _val(node.args[1])
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def _addmm_flops(node):
    a, b = _val(node.args[1]), _val(node.args[2])
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def _bmm_flops(node):
    a, b = _val(node.args[0]), _val(node.args[1])
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


def _baddbmm_flops(node):
    a, b = _val(node.args[1]), _val(node.args[2])
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


aten = torch.ops.aten
SHAPE_FLOPS = {
    aten.mm.default: _mm_flops, aten.addmm.default: _addmm_flops,
    aten.bmm.default: _bmm_flops, aten.baddbmm.default: _baddbmm_flops,
}
# Ops that only allocate: nothing is read or written.
ALLOCATING_OPS = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


_VIEWS: dict = {}


def _is_view(target) -> bool:
    """Every result a non-writing alias, or a view whose schema does not say so (SIM-4)."""
    if target not in _VIEWS:
        schema = target._schema
        _VIEWS[target] = renames_unannotated(target) or (bool(schema.returns) and all(
                r.alias_info is not None and not r.alias_info.is_write for r in schema.returns))
    return _VIEWS[target]


class CostModel:
    """A duration in microseconds for every node of a graph (SIM-1).

    profile: a HardwareProfile (H100_NVLINK_8 by default).
    pinned: node name -> duration in us, used instead of the model for those nodes.
    estimate: a function of a node giving its duration in us, or None to leave it to the
        model; asked for every node not pinned. It reads the node (its op, arguments and
        `meta["val"]`), not its name, so one estimator serves a graph and its bucketed,
        lowered or reordered forms.
    """

    def __init__(self, profile: HardwareProfile | None = None,
                 pinned: dict[str, float] | None = None, estimate=None):
        self.profile = H100_NVLINK_8 if profile is None else profile
        require_type(self.profile, HardwareProfile, "profile", "a HardwareProfile", "SIM-1")
        self.pinned = dict(pinned or {})
        for name, us in self.pinned.items():
            if not _is_duration(us):
                raise ValueError(f"pinned: duration of {name!r} must be a finite number "
                                 f">= 0 us, got {us!r} [SIM-1]")
        if estimate is not None and not callable(estimate):
            raise TypeError(f"estimate: expected a function of a node, got "
                            f"{type(estimate).__name__} [SIM-1]")
        self.estimate = estimate

    def durations(self, gm: torch.fx.GraphModule) -> dict[torch.fx.Node, float]:
        names = {n.name for n in gm.graph.nodes}
        unknown = sorted(set(self.pinned) - names)
        if unknown:
            raise ValueError(f"pinned: {unknown[:5]} name no node of gm [SIM-1]")
        return {n: self.duration_us(n) for n in gm.graph.nodes}

    def duration_us(self, node: torch.fx.Node) -> float:
        if node.name in self.pinned:
            return float(self.pinned[node.name])
        if self.estimate is not None:
            us = self.estimate(node)
            if us is not None:
                if not _is_duration(us):
                    raise ValueError(f"estimate: returned {us!r} for node {node.name!r}; a "
                                     f"duration is a finite number >= 0 us, or None for "
                                     f"the model's [SIM-1]")
                return float(us)
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return 0.0  # inputs, outputs, getitem, Python functions (SIM-4)
        if is_wait(node) or _is_view(node.target):
            return 0.0
        row = comm_ops.node_op(node)
        if row is not None:
            return self.collective_us(node, row)
        return self.compute_us(node)

    def collective_us(self, node: torch.fx.Node, row: comm_ops.CommOp) -> float:
        """Alpha-beta of the op's algorithm over its group, for its bytes (SIM-2)."""
        n = _group_size_of(node)
        formula = ALGORITHMS[row.algorithm]
        return float(formula(self.profile.link(n), n, COST_BYTES[row.cost_bytes](node)
                             if row.cost_bytes else 0))

    def compute_us(self, node: torch.fx.Node) -> float:
        """Roofline: the slower of FLOPs over peak FLOP/s and bytes over bandwidth (SIM-3)."""
        if node.target._schema.name.split("::", 1)[1] in ALLOCATING_OPS:
            return 0.0
        out = node.meta.get("val")
        moved = _tensor_bytes(out) + sum(_tensor_bytes(a.meta.get("val"))
                                         for a in node.all_input_nodes)
        first = _first_tensor(out)
        flops = count_flops(node)
        rate = self.profile.flops_rate(first.dtype) if first is not None else math.inf
        return self.profile.op_overhead_us + max(flops / rate,
                                                 moved / self.profile.memory_bytes_per_us)


def _is_duration(us) -> bool:
    return (isinstance(us, (int, float)) and not isinstance(us, bool) and math.isfinite(us)
            and us >= 0)


def count_flops(node: torch.fx.Node) -> int:
    """FLOPs of an ATen node: matmuls from shapes, else torch.utils.flop_counter's formula."""
    by_shape = SHAPE_FLOPS.get(node.target)
    if by_shape is not None:
        return size_hint(by_shape(node))  # of symbolic shapes: the example's
    formula = flop_registry.get(node.target.overloadpacket)
    if formula is None:
        return 0
    args = torch.fx.node.map_arg(node.args, _val)
    kwargs = torch.fx.node.map_arg(node.kwargs, _val)
    return size_hint(formula(*args, **kwargs, out_val=node.meta.get("val")))


# --------------------------------------------------------------------------------------
# The simulation (SIM-5 .. SIM-8)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimelineEvent:
    node: torch.fx.Node
    stream: str  # COMPUTE_STREAM or "comm:<group name>"
    start_us: float
    end_us: float
    kind: str  # "compute", "collective", "wait" or "blocking"


@dataclass(frozen=True)
class CollectiveTime:
    """One collective (or blocking kernel) of a timeline and how much of it was hidden
    (SIM-8): `exposed_us` is the part of its run during which the compute stream stood
    waiting for communication (in a wait or a blocking kernel), `hidden_us` the rest."""

    node: torch.fx.Node
    stream: str
    start_us: float
    end_us: float
    hidden_us: float
    exposed_us: float

    @property
    def fully_exposed(self) -> bool:
        """It ran, and not one microsecond of it under compute."""
        return self.end_us > self.start_us and self.hidden_us <= 0.0


@dataclass
class Timeline:
    """One simulated run of an order (SIM-8)."""

    events: list[TimelineEvent]
    step_time_us: float
    comm_time_us: float
    exposed_comm_us: float
    overlap: float
    peak_bytes: int
    memory: object = field(repr=False, default=None)  # the MemoryPlan of the same order
    collectives: list[CollectiveTime] = field(repr=False, default_factory=list)

    @property
    def fully_exposed_count(self) -> int:
        """How many collectives ran with none of their time hidden."""
        return sum(c.fully_exposed for c in self.collectives)

    def streams(self) -> list[str]:
        names = [COMPUTE_STREAM]
        for e in self.events:
            if e.stream not in names:
                names.append(e.stream)
        return names

    def memory_counter(self) -> list[tuple[float, int]]:
        """(time, live bytes) after each node, at the node's end on its stream."""
        end = {e.node: e.end_us if e.kind != "collective" else e.start_us for e in self.events}
        points, last = [], 0.0
        for node, live in zip(self.memory.order, self.memory.live_bytes, strict=True):
            last = max(last, end.get(node, last))
            points.append((last, live))
        return points

    def to_chrome_trace(self, path) -> None:
        """Chrome / Perfetto trace-event JSON: a track per stream, memory as a counter."""
        tids = {s: i for i, s in enumerate(self.streams())}
        trace = [{"ph": "M", "pid": 0, "tid": tid, "name": "thread_name",
                  "args": {"name": stream}} for stream, tid in tids.items()]
        trace.append({"ph": "M", "pid": 0, "name": "process_name",
                      "args": {"name": "refimpl.simulator"}})
        for e in self.events:
            if e.end_us > e.start_us:
                trace.append({"ph": "X", "pid": 0, "tid": tids[e.stream], "name": e.node.name,
                              "cat": e.kind, "ts": e.start_us, "dur": e.end_us - e.start_us,
                              "args": {"op": str(e.node.target)}})
        for t, live in self.memory_counter():
            trace.append({"ph": "C", "pid": 0, "name": "memory", "ts": t,
                          "args": {"live_bytes": live}})
        Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"},
                                         indent=0))

    def to_svg(self, path, width: int = 900) -> None:
        """A Gantt chart of the streams and the memory curve, as a standalone SVG."""
        Path(path).write_text(_svg(self, width))


def _svg(tl: Timeline, width: int) -> str:
    streams = tl.streams()
    left, row, gap, mem_h = 120, 26, 6, 70
    span = max(tl.step_time_us, 1e-9)
    scale = (width - left - 10) / span
    top = 24
    height = top + len(streams) * (row + gap) + mem_h + 40
    colors = {"compute": "#4e79a7", "collective": "#f28e2b", "wait": "#e15759",
              "blocking": "#b07aa1"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="11">',
           f'<text x="4" y="14">step {tl.step_time_us:.1f} us, comm {tl.comm_time_us:.1f} us, '
           f'exposed {tl.exposed_comm_us:.1f} us, overlap {tl.overlap:.0%}, peak '
           f'{_human_bytes(tl.peak_bytes)}</text>']
    y_of = {s: top + i * (row + gap) for i, s in enumerate(streams)}
    for s, y in y_of.items():
        out.append(f'<text x="4" y="{y + row * 0.65:.1f}">{_escape(s)[:16]}</text>')
        out.append(f'<line x1="{left}" y1="{y + row}" x2="{width - 10}" y2="{y + row}" '
                   f'stroke="#ccc"/>')
    for e in tl.events:
        if e.end_us <= e.start_us:
            continue
        x, w = left + e.start_us * scale, max((e.end_us - e.start_us) * scale, 0.5)
        out.append(f'<rect x="{x:.1f}" y="{y_of[e.stream]}" width="{w:.1f}" height="{row}" '
                   f'fill="{colors[e.kind]}" stroke="#fff"><title>{_escape(e.node.name)} '
                   f'{e.start_us:.1f}-{e.end_us:.1f} us</title></rect>')
        if w > 7 * len(e.node.name) * 0.6:
            out.append(f'<text x="{x + 2:.1f}" y="{y_of[e.stream] + row * 0.65:.1f}" '
                       f'fill="#fff">{_escape(e.node.name)}</text>')
    base = top + len(streams) * (row + gap) + mem_h
    peak = max(tl.peak_bytes, 1)
    points = tl.memory_counter()
    path, previous = [], base
    for t, live in points:
        x, y = left + t * scale, base - live / peak * (mem_h - 10)
        path.append(f"{x:.1f},{previous:.1f} {x:.1f},{y:.1f}")
        previous = y
    out.append(f'<text x="4" y="{base - mem_h / 2:.1f}">memory</text>')
    out.append(f'<polyline fill="none" stroke="#59a14f" stroke-width="1.5" '
               f'points="{" ".join(path)}"/>')
    out.append(f'<text x="{left}" y="{base + 16}">0 us</text>')
    out.append(f'<text x="{width - 10}" y="{base + 16}" text-anchor="end">'
               f'{tl.step_time_us:.1f} us</text>')
    x = left + 60
    for kind, color in [*colors.items(), ("live bytes", "#59a14f")]:
        out.append(f'<rect x="{x}" y="{base + 7}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{x + 14}" y="{base + 16}">{kind}</text>')
        x += 14 + 7 * len(kind) + 16
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _human_bytes(nbytes: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Simulator:
    """A graph's durations and memory model, ready to simulate any order in O(N + E).

    Built once per (graph, cost model); `run(order)` simulates one order (SIM-5..SIM-8).
    """

    def __init__(self, gm: torch.fx.GraphModule, cost_model: CostModel | None = None):
        self.memory = MemoryModel(gm)
        self.cost_model = cost_model or CostModel()
        require_type(self.cost_model, CostModel, "cost_model", "a CostModel", "SIM-1")
        with collector_paused():
            self.duration = self.cost_model.durations(gm)
        self.stream = {n: "comm:" + group_name_of(n) for n in self.memory.nodes
                       if is_collective(n) or blocking_name(n) is not None}

    def run(self, order=None) -> Timeline:
        with collector_paused():
            return self._run(order)

    def _run(self, order) -> Timeline:
        full = self.memory.full_order(order)
        compute = 0.0  # when the compute stream is free
        stream_free: dict[str, float] = {}
        pending: dict[int, float] = {}  # buffer -> when the collectives writing it end
        events, comm, exposed = [], 0.0, 0.0
        stalls: list[tuple[float, float]] = []  # compute stream waiting for communication
        for node in full:
            if node.op in ("placeholder", "get_attr", "output"):
                continue
            d = self.duration[node]
            if node in self.stream and blocking_name(node) is None:
                stream = self.stream[node]
                start = max(compute, stream_free.get(stream, 0.0))  # issued, then queued
                stream_free[stream] = end = start + d
                for done, _held in self.memory.in_flight.get(node, ()):
                    pending[done] = max(pending.get(done, 0.0), end)
                events.append(TimelineEvent(node, stream, start, end, "collective"))
                comm += d
            elif node in self.stream:  # blocking: the compute stream waits for it
                stream = self.stream[node]
                start = max(compute, stream_free.get(stream, 0.0))
                stream_free[stream] = end = start + d
                events.append(TimelineEvent(node, stream, start, end, "blocking"))
                comm += d
                exposed += end - compute
                stalls.append((compute, end))
                compute = end
            elif is_wait(node):
                ready = max((pending.pop(b, 0.0) for b in self.memory.completes[node]),
                            default=0.0)
                start = compute
                exposed += max(0.0, ready - compute)
                if ready > compute:
                    stalls.append((compute, ready))
                compute = max(compute, ready) + d
                events.append(TimelineEvent(node, COMPUTE_STREAM, start, compute, "wait"))
            else:
                events.append(TimelineEvent(node, COMPUTE_STREAM, compute, compute + d,
                                            "compute"))
                compute += d
        step = max([compute, *stream_free.values()])
        overlap = (comm - exposed) / comm if comm > 0 else 1.0
        plan = self.memory.plan(full)
        return Timeline(events, step, comm, exposed, overlap, plan.peak_bytes, plan,
                        _collective_times(events, stalls))


def _collective_times(events: list[TimelineEvent], stalls: list[tuple[float, float]]
                      ) -> list[CollectiveTime]:
    """Per collective: its run intersected with the compute stream's stalls (SIM-8).
    Stalls are disjoint and in time order: each run finds its first by bisection."""
    starts = [lo for lo, _ in stalls]
    times = []
    for e in events:
        if e.kind not in ("collective", "blocking"):
            continue
        exposed = 0.0
        k = max(bisect.bisect_right(starts, e.start_us) - 1, 0)
        while k < len(stalls) and stalls[k][0] < e.end_us:
            exposed += max(0.0, min(e.end_us, stalls[k][1]) - max(e.start_us, stalls[k][0]))
            k += 1
        duration = e.end_us - e.start_us
        times.append(CollectiveTime(e.node, e.stream, e.start_us, e.end_us,
                                    duration - exposed, exposed))
    return times


def simulate(gm: torch.fx.GraphModule, cost_model: CostModel | None = None,
             order=None) -> Timeline:
    """Simulate `order` (program order by default) of `gm` under `cost_model` (SIM-5)."""
    return Simulator(gm, cost_model).run(order)


# --------------------------------------------------------------------------------------
# Calibration on this machine (SIM-11): python -m refimpl.simulator calibrate
# --------------------------------------------------------------------------------------
def _median_us(fn, repeat: int) -> float:
    import time

    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return sorted(times)[len(times) // 2]


def _measure_compute() -> dict:
    torch.set_num_threads(1)
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    mm_us = _median_us(lambda: torch.mm(a, b), 30)
    big, into = torch.randn(8 * 1024 * 1024), torch.empty(8 * 1024 * 1024)  # 32 MiB
    copy_us = _median_us(lambda: into.copy_(big), 10)  # no page faults: memory is mapped
    tiny = torch.ones(1)
    overhead_us = _median_us(lambda: torch.add(tiny, tiny), 2000)
    return {"flops_per_us": 2 * 384**3 / mm_us,
            "memory_bytes_per_us": 2 * big.numel() * 4 / copy_us,
            "op_overhead_us": overhead_us}


def _gloo_times(sizes: list[int], repeat: int) -> list[float]:
    """On a rank: median all_gather + wait time per input size (bytes), in us, each op
    started together on every rank (a barrier before it), as a step of a program is."""
    import time

    import refimpl.functional_collectives as fc

    ops, n = fc.ops, torch.distributed.get_world_size()
    times = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        samples = []
        for i in range(repeat + 2):
            torch.distributed.barrier()
            start = time.perf_counter()
            ops.wait_tensor(ops.all_gather_into_tensor(x, n, "0"))
            if i >= 2:  # two warm-up rounds
                samples.append((time.perf_counter() - start) * 1e6)
        times.append(sorted(samples)[len(samples) // 2])
    return times


def _fit_link(sizes: list[int], times: list[float], n: int) -> LinkCost:
    """Least squares of t = a + b * gathered bytes; alpha = a/(n-1), beta = (n-1)/n / b."""
    xs = [s * n for s in sizes]
    mean_x, mean_t = sum(xs) / len(xs), sum(times) / len(times)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, times, strict=True)) / \
        sum((x - mean_x) ** 2 for x in xs)
    intercept = mean_t - slope * mean_x
    return LinkCost(max(intercept, 0.0) / (n - 1), (n - 1) / n / max(slope, 1e-12))


def calibrate(world_sizes=(2,), repeat: int = 20) -> HardwareProfile:
    """Measure matmul, memory bandwidth, op overhead and gloo all_gather here (SIM-11)."""
    import platform

    from refimpl.multiprocess import run_on_ranks

    compute = _measure_compute()
    sizes = [4 * 1024, 64 * 1024, 512 * 1024, 2 * 1024 * 1024]
    links = {}
    for n in world_sizes:
        times = run_on_ranks(_gloo_times, n, sizes, repeat)
        links[n] = _fit_link(sizes, [max(t) for t in zip(*times, strict=True)], n)
    links[0] = links[world_sizes[0]]
    return HardwareProfile(
        name=f"this machine: {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} torch thread(s), gloo over loopback",
        flops_per_us={"default": compute["flops_per_us"]},
        memory_bytes_per_us=compute["memory_bytes_per_us"], links=links,
        op_overhead_us=compute["op_overhead_us"],
        source="python -m refimpl.simulator calibrate: float32 384x384 mm, 32 MiB copy_, "
               "1-element add, gloo all_gather of 4 KiB..2 MiB per rank after a barrier (median of "
               f"{repeat}, slowest rank)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m refimpl.simulator")
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="measure a HardwareProfile of this machine")
    cal.add_argument("--out", help="write the profile as JSON here (default: print it)")
    cal.add_argument("--world-sizes", default="2", help="gloo group sizes, e.g. 2,4")
    cal.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    sizes = tuple(int(s) for s in args.world_sizes.split(","))
    profile = calibrate(sizes, args.repeat)
    if args.out:
        Path(args.out).write_text(profile.to_json() + "\n")
    print(profile.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
