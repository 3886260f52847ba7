"""The "lowering" concept of the `torch` backend: Inductor's lowering, read from its code.

Upstream lowers collectives inside Inductor, so there is no lowered FX graph to show.
What the cases compare instead is the comm trace: `lowered_comm_trace` compiles the
program with `torch.compile(backend="inductor", fullgraph=True)` on CPU, captures the
generated wrapper code with `torch._inductor.utils.run_and_get_code`, and reads every
`torch.ops._c10d_functional.*` / `torch.ops.symm_mem.*` call of it, in order, into
`conformance.comm_trace.CommEvent`s. Buffer shapes and dtypes come from the
`empty_strided_cpu`, `assert_size_stride` and `rand_strided` (graph inputs) lines of
the same code.

Options (a dict, the same keys as refimpl's CommLoweringConfig) map onto
`torch._inductor.config`: `auto_select` and `one_shot_all_reduce_threshold_bytes` onto
`_collective.*`, `reorder_for_compute_comm_overlap` onto itself. `enable_symm_mem_for`
(group names) enables upstream symmetric memory for those groups first.
"""

from __future__ import annotations

import ast
import re
import types
import warnings

import torch

from conformance.canonical import group_label, tensor_label
from conformance.comm_trace import CommEvent

_CONFIG_KEYS = {
    "auto_select": "_collective.auto_select",
    "one_shot_all_reduce_threshold_bytes": "_collective.one_shot_all_reduce_threshold_bytes",
    "reorder_for_compute_comm_overlap": "reorder_for_compute_comm_overlap",
}
_CALL = re.compile(r"^(?:(\w+) = )?torch\.ops\.(_c10d_functional|symm_mem)\.(\w+)\.(\w+)\((.*)\)$")
_EMPTY = re.compile(r"^(\w+) = empty_strided_\w+\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)")
_ASSERT = re.compile(r"^assert_size_stride\((\w+), \(([^)]*)\),")
_GETITEM = re.compile(r"^(\w+) = (\w+)\[(\d+)\]$")
_ALIAS = re.compile(r"^(\w+) = (\w+); del \w+\s*# reuse")
_RAND_ARG = re.compile(r"^\s*(\w+) = rand_strided\(\(([^)]*)\), \([^)]*\), device='\w+', "
                       r"dtype=torch\.(\w+)\)")
_REINTERPRET = re.compile(r"^(\w+) = reinterpret_tensor\((\w+), \(([^)]*)\),")


def _inductor_patches(options: dict) -> dict:
    unknown = set(options) - set(_CONFIG_KEYS) - {"enable_symm_mem_for"}
    if unknown:
        raise ValueError(f"options: the torch backend does not know {sorted(unknown)}")
    return {_CONFIG_KEYS[k]: v for k, v in options.items() if k in _CONFIG_KEYS}


def _enable_symm_mem(options: dict) -> None:
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    for name in options.get("enable_symm_mem_for", ()):
        with warnings.catch_warnings():
            # 2.13 deprecates the call (groups need no enabling); older versions need it.
            warnings.simplefilter("ignore", FutureWarning)
            enable_symm_mem_for_group(name)


def _compile_and_run(fn, example_inputs, options):
    from torch._inductor.utils import run_and_get_code

    options = dict(options or {})
    _enable_symm_mem(options)
    torch._dynamo.reset()
    with torch._inductor.config.patch(_inductor_patches(options)):
        compiled = torch.compile(fn, backend="inductor", fullgraph=True)
        return run_and_get_code(compiled, *example_inputs)


def _shape(text: str) -> list[int]:
    return [int(s) for s in text.replace(" ", "").split(",") if s]


class _CodeReader:
    """Reads wrapper code into comm events; buffers numbered by first use in an event."""

    def __init__(self, lines: list[str], arg_lines: list[str]):
        self.meta: dict[str, tuple[torch.dtype, list[int]]] = {}
        self.ids: dict[str, int] = {}
        self.next = 0
        # The graph inputs, as the module's own `get_args` rebuilds them.
        for m in filter(None, map(_RAND_ARG.match, arg_lines)):
            self.meta[m.group(1)] = (getattr(torch, m.group(3)), _shape(m.group(2)))
        self.shapes = {m.group(1): _shape(m.group(2))
                       for m in map(_ASSERT.match, lines) if m}
        self.lines = lines

    def label(self, name: str) -> str:
        dtype, shape = self.meta.get(name, (torch.float32, self.shapes.get(name, [])))
        return f"b{self.id(name)}:{tensor_label(torch.empty(shape, dtype=dtype, device='meta'))}"

    def id(self, name: str) -> int:
        if name not in self.ids:
            self.ids[name] = self.next
            self.next += 1
        return self.ids[name]

    def events(self) -> list[CommEvent]:
        events = []
        for line in self.lines:
            self.track_buffers(line)
            call = _CALL.match(line)
            if call is not None:
                events.append(self.event(*call.groups()))
        return [e for e in events if e is not None]

    def track_buffers(self, line: str) -> None:
        if m := _EMPTY.match(line):
            self.meta[m.group(1)] = (getattr(torch, m.group(3)), _shape(m.group(2)))
        elif m := _ALIAS.match(line):
            self.meta[m.group(1)] = self.meta.get(m.group(2), (torch.float32, []))
        elif m := _REINTERPRET.match(line):
            dtype = self.meta.get(m.group(2), (torch.float32, []))[0]
            self.meta[m.group(1)] = (dtype, _shape(m.group(3)))
        elif m := _GETITEM.match(line):
            name, source, index = m.group(1), m.group(2), int(m.group(3))
            if isinstance(self.ids.get(source), list):
                self.ids[name] = self.ids[source][index]
                self.meta[name] = self.meta.get(f"{source}[{index}]", (torch.float32, []))

    def event(self, result, namespace, name, overload, arg_text) -> CommEvent:
        op = getattr(getattr(torch.ops, namespace), name)
        schema = getattr(op, overload)._schema
        call = ast.parse(f"f({arg_text})", mode="eval").body
        bound = {a.name: v for a, v in zip(schema.arguments, call.args, strict=False)}
        bound.update({k.arg: k.value for k in call.keywords})
        if name == "wait_tensor":
            return CommEvent("wait", inputs=[f"b{self.id(bound['tensor'].id)}"])
        return self.collective(result, name, schema, bound)

    def collective(self, result, name, schema, bound) -> CommEvent:
        inputs, written = [], []
        for a in schema.arguments:
            names = _names(bound.get(a.name))
            mutated = a.alias_info is not None and a.alias_info.is_write
            if mutated and a.kwarg_only:
                written.extend(names)
            elif names:
                inputs.extend(names)
                if mutated:
                    written.extend(names)
        extra = ""
        if "reduce_op" in bound:
            extra = ast.literal_eval(bound["reduce_op"])
        group = ""
        if "group_name" in bound:
            group = group_label(ast.literal_eval(bound["group_name"]))
        inplace = bool(written) and not any(a.kwarg_only and a.alias_info is not None
                                            for a in schema.arguments)
        event = CommEvent(name, group=group, inplace=inplace, extra=extra)
        event.inputs = [self.label(n) for n in inputs]
        if written:
            event.outputs = [self.label(n) for n in written]
        else:
            event.outputs = self.fresh_outputs(result, inputs, schema)
        return event

    def fresh_outputs(self, result, inputs, schema) -> list[str]:
        dtype = self.meta.get(inputs[0], (torch.float32, []))[0] if inputs else torch.float32
        if isinstance(schema.returns[0].type, torch.ListType):
            ids = []
            labels = []
            for i, source in enumerate(inputs):
                dtype = self.meta.get(source, (torch.float32, []))[0]
                shape = self._getitem_shape(result, i)
                ids.append(self.next)
                self.meta[f"{result}[{i}]"] = (dtype, shape)
                labels.append(f"b{self.next}:"
                              f"{tensor_label(torch.empty(shape, dtype=dtype, device='meta'))}")
                self.next += 1
            self.ids[result] = ids
            return labels
        self.meta[result] = (dtype, self.shapes.get(result, []))
        return [self.label(result)]

    def _getitem_shape(self, result, index) -> list[int]:
        for line in self.lines:
            m = _GETITEM.match(line)
            if m and m.group(2) == result and int(m.group(3)) == index:
                return self.shapes.get(m.group(1), [])
        return []


def _names(node) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [n for e in node.elts for n in _names(e)]
    return []


def _call_lines(code: str) -> list[str]:
    """The statements of the wrapper's `call` function, stripped, in order."""
    lines, inside = [], False
    for raw in code.splitlines():
        if re.match(r"\s*def call\(", raw):
            inside = True
            continue
        if inside:
            if raw.strip() and not raw.startswith("    "):
                break
            lines.append(raw.strip())
    return lines


def comm_trace_of_code(code: str) -> list[CommEvent]:
    """The comm trace of one Inductor wrapper module."""
    return _CodeReader(_call_lines(code), code.splitlines()).events()


def lowered_comm_trace(fn, example_inputs, options=None) -> list[CommEvent]:
    """Compile `fn` with Inductor (CPU) in this process and read its comm trace."""
    _, codes = _compile_and_run(fn, example_inputs, options)
    events = []
    for code in codes:
        events.extend(comm_trace_of_code(code))
    return events


def run_lowered(fn, example_inputs, options=None):
    """Run the Inductor-compiled program on real tensors (inside a rank)."""
    result, _ = _compile_and_run(fn, example_inputs, options)
    return result


def concept():
    return types.SimpleNamespace(lowered_comm_trace=lowered_comm_trace,
                                 run_lowered=run_lowered, comm_trace_of_code=comm_trace_of_code)
