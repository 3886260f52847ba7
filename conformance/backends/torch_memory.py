"""The "memory" concept of the `torch` backend: upstream's FX memory estimator.

`torch._inductor.fx_passes.memory_estimator.MemoryTracker` is what upstream's overlap
scheduler plans peak memory with. It follows storages (`meta["val"]`'s untyped
storage), allocates a node's fresh storages, then frees the storages whose last use it
was, unless the allocating node's name starts with "primals" (graph inputs of
AOTAutograd's forward). It ignores CPU storages by default: this adapter passes a
device filter that keeps every device, so that the cases (CPU tensors) see anything.
Its events are rebuilt per node from the tracker's live storages, in the shape the
cases read (`events` of `kind`, `node`, `buffer.alloc_node`, `buffer.nbytes`); the live
bytes after each node are the tracker's own count (`get_current_memory_bytes`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch.fx


@dataclass(eq=False)
class _Buffer:
    alloc_node: torch.fx.Node
    nbytes: int
    kind: str
    free_node: torch.fx.Node | None = None
    aliases: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.alloc_node.name


@dataclass(frozen=True)
class _Event:
    kind: str
    buffer: _Buffer
    node: torch.fx.Node


def plan_memory(gm: torch.fx.GraphModule, order=None):
    """Upstream's MemoryTracker over `order` (program order by default), CPU kept."""
    from torch._inductor.fx_passes.memory_estimator import MemoryTracker

    tracker = MemoryTracker(gm.graph, device_filter=lambda device: True)
    alias = tracker.alias_tracker
    nodes = list(gm.graph.nodes)
    body = [n for n in (order if order is not None else nodes)
            if n.op not in ("placeholder", "get_attr", "output")]
    outputs = set()
    for n in nodes:
        if n.op == "output":
            outputs = set(alias.get_storage_uses(n))
    buffers: dict = {}
    events: list[_Event] = []

    def buffer(key):
        if key not in buffers:
            node = alias.storage_to_allocator[key]
            kind = "input" if node.op in ("placeholder", "get_attr") else \
                "output" if key in outputs else "intermediate"
            buffers[key] = _Buffer(node, tracker._get_storage_size(key), kind)
        return buffers[key]

    inputs = [n for n in nodes if n.op in ("placeholder", "get_attr")]
    live_bytes, live = [], 0
    for node in inputs:  # the tracker counts inputs when it is built
        for key in alias.get_fresh_allocations(node):
            events.append(_Event("alloc", buffer(key), node))
            live += buffer(key).nbytes
        live_bytes.append(live)
    peak = tracker.get_current_memory_bytes()
    peak_node = None
    for node in body:
        before = set(tracker.current_live_storages)
        fresh = [k for k in alias.get_fresh_allocations(node) if k not in before]
        tracker.schedule_node(node)
        after = set(tracker.current_live_storages)
        events += [_Event("alloc", buffer(k), node) for k in fresh]
        freed = [k for k in list(before) + fresh if k not in after]
        for k in freed:
            buffer(k).free_node = node
        events += [_Event("free", buffer(k), node) for k in freed]
        high = tracker.get_current_memory_bytes() + sum(buffer(k).nbytes for k in freed)
        if high > peak:
            peak, peak_node = high, node
        live_bytes.append(tracker.get_current_memory_bytes())
    output = [n for n in nodes if n.op == "output"]
    return types.SimpleNamespace(events=events, peak_bytes=tracker.peak_memory,
                                 peak_node=peak_node, buffers=list(buffers.values()),
                                 order=inputs + body + output,
                                 live_bytes=live_bytes + live_bytes[-1:] * len(output))


def concept():
    return types.SimpleNamespace(plan_memory=plan_memory, verify_memory_lifecycle=None)
