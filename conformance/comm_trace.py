"""The comm trace: the backend-neutral, structural form of a program's communication.

One line per collective or wait, in program order:

    all_gather_into_tensor out-of-place ranks[0,1] in=b0:f32[4] out=b1:f32[8]
    wait b1

Buffers are numbered `b0, b1, ...` in order of first appearance, so a line says which
buffer a collective reads and writes (the same id on both sides: in place) and which
buffer each wait completes, without any name that varies between runs or backends.
`comm_trace_of_graph` derives it from an FX graph; other backends (for example Inductor's
generated code) build the same `CommEvent` list and print it with `format_comm_trace`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from conformance.canonical import group_label, op_name, tensor_label

__all__ = ["CommEvent", "comm_trace_of_graph", "format_comm_trace", "is_comm_op"]

# Collective ops of every backend, as canonical.op_name folds their namespaces.
COMM_PREFIXES = ("funcol.", "symm_mem.")


@dataclass
class CommEvent:
    op: str                      # e.g. "all_reduce_", "wait", "one_shot_all_reduce"
    group: str = ""              # "ranks[0,1]"
    inplace: bool = False
    inputs: list[str] = field(default_factory=list)    # "b0:f32[4]"
    outputs: list[str] = field(default_factory=list)
    extra: str = ""              # e.g. the reduce op, "blocking"

    def line(self) -> str:
        if self.op == "wait":
            return "wait " + " ".join(self.inputs)
        mode = "in-place" if self.inplace else "out-of-place"
        parts = [self.op, mode]
        if self.group:
            parts.append(self.group)
        if self.extra:
            parts.append(self.extra)
        parts.append("in=" + ",".join(self.inputs))
        if not self.inplace:
            parts.append("out=" + ",".join(self.outputs))
        return " ".join(parts)


def format_comm_trace(events: list[CommEvent]) -> str:
    return "\n".join(e.line() for e in events)


def is_comm_op(target) -> bool:
    """A collective op (allocation functions such as empty_strided_p2p are not)."""
    return isinstance(target, torch._ops.OpOverload) and op_name(target).startswith(
        COMM_PREFIXES)


class _Buffers:
    """Numbers buffers by first appearance; aliases share their source's number."""

    def __init__(self):
        self.ids: dict[torch.fx.Node, int] = {}
        self.next = 0

    def of(self, node: torch.fx.Node) -> int:
        if node not in self.ids:
            self.ids[node] = self.next
            self.next += 1
        return self.ids[node]

    def alias(self, node: torch.fx.Node, source: torch.fx.Node) -> None:
        self.ids[node] = self.of(source)

    def label(self, node: torch.fx.Node, value=None) -> str:
        val = node.meta.get("val") if value is None else value
        return f"b{self.of(node)}:{tensor_label(val)}"


def _mutated_args(target) -> list[int]:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return []
    return [i for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def _tensor_nodes(arg) -> list[torch.fx.Node]:
    if isinstance(arg, torch.fx.Node):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [n for a in arg for n in _tensor_nodes(a)]
    return []


def _group_of(node: torch.fx.Node) -> str:
    schema = node.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == "group_name":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("group_name")
            return group_label(value)
    return ""


def _reduce_op_of(node: torch.fx.Node) -> str:
    schema = node.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == "reduce_op" and i < len(node.args):
            return str(node.args[i])
    return ""


def comm_trace_of_graph(gm: torch.fx.GraphModule) -> list[CommEvent]:
    """The comm trace of an FX graph whose collectives are functional-collective ops."""
    buffers = _Buffers()
    events: list[CommEvent] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            source = node.args[0]
            if source in buffers.ids and isinstance(buffers.ids[source], list):
                buffers.ids[node] = buffers.ids[source][node.args[1]]
            continue
        if not is_comm_op(node.target):
            continue
        name = op_name(node.target).split(".", 1)[1]
        if name in ("wait_tensor", "wait_tensor_"):  # copying or in place (FC-5, FC-28)
            (source,) = _tensor_nodes(node.args[0])
            buffers.alias(node, source)
            events.append(CommEvent("wait", inputs=[f"b{buffers.of(source)}"]))
            continue
        events.append(_collective_event(node, name, buffers))
    return events


def _collective_event(node, name, buffers) -> CommEvent:
    mutated = _mutated_args(node.target)
    schema_args = node.target._schema.arguments
    inputs, written = [], []
    for i, a in enumerate(schema_args):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
        nodes = _tensor_nodes(value)
        if i in mutated and a.kwarg_only:
            written.extend(nodes)  # an `out=` argument
        elif nodes:
            inputs.extend(nodes)
            if i in mutated:
                written.extend(nodes)
    event = CommEvent(name, group=_group_of(node), inplace=bool(written) and not any(
        schema_args[i].kwarg_only for i in mutated), extra=_reduce_op_of(node))
    event.inputs = [buffers.label(n) for n in inputs]
    if written:
        ids = [buffers.of(n) for n in written]
        buffers.ids[node] = ids if len(ids) > 1 else ids[0]
        event.outputs = [buffers.label(n) for n in written]
    else:
        vals = node.meta.get("val")
        if isinstance(vals, (list, tuple)):
            ids = []
            for v in vals:
                ids.append(buffers.next)
                event.outputs.append(f"b{buffers.next}:{tensor_label(v)}")
                buffers.next += 1
            buffers.ids[node] = ids
        else:
            event.outputs = [buffers.label(node)]
    return event
