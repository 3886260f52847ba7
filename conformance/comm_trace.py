"""The comm trace: the backend-neutral, structural form of a program's communication.

One line per collective or wait, in program order:

    all_reduce_ in-place ranks[0,1] sum in=b0:f32[4]=copy(b1=input)
    wait b0
    all_gather_into_tensor out-of-place ranks[0,1] in=b1:f32[4] out=b2:f32[8]
    wait b2

Buffers are numbered `b0, b1, ...` in order of first appearance, so a line says which
buffer a collective reads and writes (the same id on both sides: in place) and which
buffer each wait completes, without any name that varies between runs or backends.

Where a buffer first appears as a collective's input, `=origin` says where it came from
(and, inside it, where the buffer it names came from, on that buffer's first appearance):
- `input`: a graph input (the caller's memory);
- `computed`: written by a compute op of the program, the collective reading the
  producer's own output (CL-3, CL-11);
- `copy(bN)`: a plain copy of buffer `bN`, or of a view into it (CL-2, CL-4, CL-6,
  CL-8 clones; a backend that copies straight from a strided input has no view to show);
- `view(bN)`: a view into buffer `bN` (BK-8's copy-in slot of the gathered buffer).
A buffer that an in-place or `out=` op writes is that op's argument's buffer. A buffer
first seen as a collective's output has no origin: the collective made it.

`comm_trace_of_graph` derives it from an FX graph; other backends (for example Inductor's
generated code) build the same `CommEvent` list with a `BufferLabels` of their own and
print it with `format_comm_trace`. Which ops communicate (every op of the op table's
namespaces) and which of them are waits it reads from SPEC's op table (conformance/ops.py).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx

from conformance import ops
from conformance.canonical import group_label, op_name, tensor_label

__all__ = ["CommEvent", "BufferLabels", "comm_trace_of_graph", "group_of_node",
           "reduce_op_of_node", "format_comm_trace", "is_comm_op"]


@dataclass
class CommEvent:
    op: str                      # e.g. "all_reduce_", "wait", "one_shot_all_reduce"
    group: str = ""              # "ranks[0,1]"
    inplace: bool = False
    inputs: list[str] = field(default_factory=list)    # "b0:f32[4]=input"
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
    """An op of the op table's namespaces, a row or left out (allocation functions such as
    empty_strided_p2p are not ops)."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace in ops.namespaces()


# An origin: ("input" | "computed", None) or ("copy" | "view", the source buffer's key).
Origin = tuple[str, object]


class BufferLabels:
    """Numbers buffers by first appearance and shows each input buffer's origin once.

    Keys are whatever a reader tracks buffers by (FX nodes, names in generated code);
    `origin_of(key)` says where a buffer came from.
    """

    def __init__(self, origin_of: Callable[[object], Origin]):
        self.ids: dict = {}
        self.next = 0
        self.shown: set[int] = set()
        self.origin_of = origin_of

    def id(self, key) -> int:
        if key not in self.ids:
            self.ids[key] = self.fresh()
        return self.ids[key]

    def fresh(self) -> int:
        """A new number for a buffer that has no key (a collective's list of outputs)."""
        self.next += 1
        return self.next - 1

    def alias(self, key, source) -> None:
        self.ids[key] = self.id(source)

    def label(self, key, tensor_text: str, as_input: bool = False) -> str:
        """`bN:dtype[shape]`, with `=origin` where an input buffer first appears."""
        number = self.id(key)
        text = f"b{number}:{tensor_text}"
        if as_input and number not in self.shown:
            self.shown.add(number)
            text += "=" + self.origin(key)
        self.shown.add(number)
        return text

    def origin(self, key) -> str:
        kind, source = self.origin_of(key)
        if source is None:
            return kind
        number = self.id(source)
        inner = f"b{number}"
        if number not in self.shown:
            self.shown.add(number)
            inner += "=" + self.origin(source)
        return f"{kind}({inner})"


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


def _written_argument(node: torch.fx.Node) -> torch.fx.Node | None:
    """The argument an in-place or `out=` op writes and returns (its buffer), if any."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    for i in _mutated_args(node.target):
        arg = schema.arguments[i]
        value = node.args[i] if i < len(node.args) and not arg.kwarg_only \
            else node.kwargs.get(arg.name)
        if isinstance(value, torch.fx.Node):
            return value
    return None


def _viewed(node: torch.fx.Node) -> torch.fx.Node | None:
    """The buffer `node` is a view of (a view op, getitem of a split), if it is one."""
    if node.op != "call_function" or is_comm_op(node.target):
        return None
    if node.target is operator.getitem:
        return node.args[0]
    schema = getattr(node.target, "_schema", None)
    returns_alias = (schema is not None and schema.returns
                     and schema.returns[0].alias_info is not None)
    if returns_alias and isinstance(node.args[0], torch.fx.Node):
        return node.args[0]
    return None


def _graph_origin(node: torch.fx.Node) -> Origin:
    """Where an FX value's buffer came from (see the module docstring)."""
    while not is_comm_op(node.target) and (written := _written_argument(node)) is not None:
        node = written  # an in-place or out= result: the buffer it wrote
    if node.op == "placeholder":
        return ("input", None)
    if node.op == "call_function" and node.target is torch.ops.aten.clone.default:
        source = node.args[0]
        while (base := _viewed(source)) is not None:
            source = base
        return ("copy", source)
    base = _viewed(node)
    return ("view", base) if base is not None else ("computed", None)


class _GraphBuffers(BufferLabels):
    """FX buffers: in-place and `out=` results are the buffer they write."""

    def __init__(self):
        super().__init__(_graph_origin)

    def id(self, key) -> int:
        if key not in self.ids and isinstance(key, torch.fx.Node):
            written = _written_argument(key) if not is_comm_op(key.target) else None
            if written is not None:
                self.ids[key] = self.id(written)
        return super().id(key)

    def node_label(self, node: torch.fx.Node, as_input: bool = False) -> str:
        return self.label(node, tensor_label(node.meta.get("val")), as_input)


def group_of_node(node: torch.fx.Node) -> str:
    schema = node.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == "group_name":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("group_name")
            return group_label(value)
    return ""


def reduce_op_of_node(node: torch.fx.Node) -> str:
    schema = node.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == "reduce_op" and i < len(node.args):
            return str(node.args[i])
    return ""


def comm_trace_of_graph(gm: torch.fx.GraphModule) -> list[CommEvent]:
    """The comm trace of an FX graph whose collectives are functional-collective ops."""
    buffers = _GraphBuffers()
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
        op = ops.find(node)
        if op is not None and op.is_wait and not op.coalesced:  # FC-5, FC-35
            (source,) = _tensor_nodes(node.args[0])
            buffers.alias(node, source)
            events.append(CommEvent("wait", inputs=[f"b{buffers.id(source)}"]))
            continue
        if op is not None and op.is_wait:  # torch 2.15's wait_tensors: a list, returned
            sources = _tensor_nodes(node.args[0])
            buffers.ids[node] = [buffers.id(source) for source in sources]
            # a wait line per tensor, as separate waits print: the trace stays neutral
            events.extend(CommEvent("wait", inputs=[f"b{i}"]) for i in buffers.ids[node])
            continue
        events.append(_collective_event(node, name, buffers))
    return events


def _collective_event(node, name, buffers: _GraphBuffers) -> CommEvent:
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
    event = CommEvent(name, group=group_of_node(node), inplace=bool(written) and not any(
        schema_args[i].kwarg_only for i in mutated), extra=reduce_op_of_node(node))
    event.inputs = [buffers.node_label(n, as_input=True) for n in inputs]
    if written:
        ids = [buffers.id(n) for n in written]
        buffers.ids[node] = ids if len(ids) > 1 else ids[0]
        event.outputs = [buffers.node_label(n) for n in written]
    else:
        vals = node.meta.get("val")
        if isinstance(vals, (list, tuple)):
            ids = [buffers.fresh() for _ in vals]
            event.outputs = [f"b{i}:{tensor_label(v)}" for i, v in zip(ids, vals, strict=True)]
            buffers.shown.update(ids)
            buffers.ids[node] = ids
        else:
            event.outputs = [buffers.node_label(node)]
    return event
