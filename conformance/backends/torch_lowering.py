"""The "lowering" concept of the `torch` backend: Inductor's lowering, read from its code.

Upstream lowers collectives inside Inductor, so there is no lowered FX graph to show.
What the cases compare instead is the comm trace: `lowered_comm_trace` compiles the
program with `torch.compile(backend="inductor", fullgraph=True)` on CPU, captures the
generated wrapper code with `torch._inductor.utils.run_and_get_code`, and reads every
`torch.ops._c10d_functional.*` / `torch.ops.symm_mem.*` call of it, in order, into
`conformance.comm_trace.CommEvent`s. Buffer shapes and dtypes come from the
`empty_strided_cpu`, `assert_size_stride` (2.14: `assert_tensor_metadata`) and
`rand_strided` (graph inputs) lines of the same code. A buffer's origin
(conformance/comm_trace.py) comes from the code too: the names `call` unpacks from
`args` are graph inputs, `reinterpret_tensor` makes a view, and a buffer that a C++
kernel writes (an `out_ptr` parameter) is a copy of input `in_ptrI` when everything the
kernel stores there is a value loaded from `in_ptrI` and nothing else, and computed
otherwise (an `in_out_ptr` is always computed).

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

from conformance import ops
from conformance.backends import NotImplementedConcept
from conformance.canonical import group_label, tensor_label
from conformance.comm_trace import BufferLabels, CommEvent, Origin

_CONFIG_KEYS = {
    "auto_select": "_collective.auto_select",
    "one_shot_all_reduce_threshold_bytes": "_collective.one_shot_all_reduce_threshold_bytes",
    "reorder_for_compute_comm_overlap": "reorder_for_compute_comm_overlap",
}
# A call of an op; a communication op when its namespace is one of the op table's.
_CALL = re.compile(r"^(?:(\w+) = )?torch\.ops\.(\w+)\.(\w+)\.(\w+)\((.*)\)$")
_EMPTY = re.compile(r"^(\w+) = empty_strided_\w+\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)")
# torch 2.14 checks a fallback op's output with assert_tensor_metadata (size, stride, dtype).
_ASSERT = re.compile(r"^assert_(?:size_stride|tensor_metadata)\((\w+), \(([^)]*)\),")
_GETITEM = re.compile(r"^(\w+) = (\w+)\[(\d+)\]$")
_ALIAS = re.compile(r"^(\w+) = (\w+); del \w+\s*# reuse")
_RAND_ARG = re.compile(r"^\s*(\w+) = rand_strided\(\(([^)]*)\), \([^)]*\), device='\w+', "
                       r"dtype=torch\.(\w+)\)")
_REINTERPRET = re.compile(r"^(\w+) = reinterpret_tensor\((\w+), \(([^)]*)\),")
_INPUTS = re.compile(r"^([\w, ]+) = args$")
_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\(\[([^\]]*)\], r'''")
_KERNEL_CALL = re.compile(r"^(\w+)\(([\w, ]*)\)$")
_KERNEL_PARAM = re.compile(r"(?:const )?[\w:<>]+\* (\w+)")
_TMP_DEF = re.compile(r"auto (tmp\d+) = (.*);")
_STORE = re.compile(r"(tmp\d+)\.store\((\w+)|(\w+)\[.*\] = (tmp\d+);")
# A transposed copy goes through a local array: transpose_mxn<...>(in_ptrI + ..., n, tmpK, m)
_TRANSPOSE = re.compile(r"transpose_mxn<.*>\((in_ptr\d+)[^,]*, [^,]*, (tmp\d+),")


# refimpl's options that Inductor has no counterpart for: the cases that set them are not
# implemented by this backend (an unknown key is still refused, so a typo cannot pass).
_NOT_IN_INDUCTOR = {"force_one_shot_all_reduce": "Inductor has no option that forces every "
                    "all_reduce one-shot (it selects by size with auto_select)",
                    "fuse_pointwise": "upstream has no one-shot kernel that takes pointwise "
                    "steps (CL-17)"}


def _inductor_patches(options: dict) -> dict:
    for key in sorted(set(options) & set(_NOT_IN_INDUCTOR)):
        if options[key]:
            raise NotImplementedConcept(f"torch: lowering: {key}: {_NOT_IN_INDUCTOR[key]}")
    unknown = set(options) - set(_CONFIG_KEYS) - set(_NOT_IN_INDUCTOR) - {"enable_symm_mem_for"}
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


def _cpp_kernels(code_lines: list[str]) -> dict[str, list[tuple[str, str | None]]]:
    """Each C++ kernel's parameters in order: (name, the in_ptr it is a copy of, or None)."""
    kernels, name, body = {}, None, []
    for line in code_lines:
        if m := _KERNEL_DEF.match(line):
            name, body = m.group(1), []
        elif name is not None and line.startswith("'''"):
            kernels[name] = _kernel_parameters(body)
            name = None
        elif name is not None:
            body.append(line)
    return kernels


def _kernel_parameters(body: list[str]) -> list[tuple[str, str | None]]:
    """What each output parameter of one kernel holds: a copy of which in_ptr, if any."""
    signature = " ".join(body[:body.index("{")] if "{" in body else body[:1])
    params = _KERNEL_PARAM.findall(signature)
    loaded: dict[str, str | None] = {}      # tmp -> the in_ptr it is a plain load of
    arrays: dict[str, str] = {}              # local array -> the in_ptr copied into it
    copied: dict[str, set] = {p: set() for p in params}
    for line in body:
        if m := _TRANSPOSE.search(line):
            arrays[m.group(2)] = m.group(1)
        if m := _TMP_DEF.search(line):
            # A plain load reads one in_ptr (or one array holding a copy of it), nothing else.
            pointers = set(re.findall(r"in_ptr\d+", m.group(2)))
            pointers |= {arrays.get(t, t) for t in re.findall(r"tmp\d+", m.group(2))}
            plain = len(pointers) == 1 and next(iter(pointers)).startswith("in_ptr")
            loaded[m.group(1)] = pointers.pop() if plain else None
        for m in _STORE.finditer(line):
            tmp, ptr = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            if ptr in copied:
                copied[ptr].add(loaded.get(tmp))
    return [(p, next(iter(copied[p])) if len(copied[p]) == 1 and p.startswith("out_ptr")
             else None) for p in params]


class _CodeReader:
    """Reads wrapper code into comm events; buffers numbered by first use in an event."""

    def __init__(self, lines: list[str], code_lines: list[str]):
        self.meta: dict[str, tuple[torch.dtype, list[int]]] = {}
        self.origins: dict[str, Origin] = {}
        self.buffers = BufferLabels(lambda name: self.origins.get(name, ("computed", None)))
        # The graph inputs, as the module's own `get_args` rebuilds them.
        for m in filter(None, map(_RAND_ARG.match, code_lines)):
            self.meta[m.group(1)] = (getattr(torch, m.group(3)), _shape(m.group(2)))
        self.shapes = {m.group(1): _shape(m.group(2))
                       for m in map(_ASSERT.match, lines) if m}
        self.kernels = _cpp_kernels(code_lines)
        self.lines = lines

    @property
    def ids(self) -> dict:
        return self.buffers.ids

    def label(self, name: str, as_input: bool = False) -> str:
        dtype, shape = self.meta.get(name, (torch.float32, self.shapes.get(name, [])))
        text = tensor_label(torch.empty(shape, dtype=dtype, device="meta"))
        return self.buffers.label(name, text, as_input)

    def id(self, name: str) -> int:
        return self.buffers.id(name)

    def kernel_call(self, kernel: str, names: list[str]) -> None:
        """A C++ kernel writes its out_ptr and in_out_ptr arguments: copies, or computed."""
        params = self.kernels[kernel]
        argument = {param: name for (param, _), name in zip(params, names, strict=True)}
        for (param, copy_of), name in zip(params, names, strict=True):
            if "out_ptr" in param:
                self.origins[name] = (("copy", argument[copy_of]) if copy_of is not None
                                      else ("computed", None))

    def events(self) -> list[CommEvent]:
        events = []
        for line in self.lines:
            self.track_buffers(line)
            call = _CALL.match(line)
            if call is not None and call.group(2) in ops.namespaces():
                found = self.event(*call.groups())
                events.extend(found if isinstance(found, list) else [found])
        return [e for e in events if e is not None]

    def track_buffers(self, line: str) -> None:
        if m := _EMPTY.match(line):
            self.meta[m.group(1)] = (getattr(torch, m.group(3)), _shape(m.group(2)))
        elif m := _INPUTS.match(line):
            for name in filter(None, (n.strip() for n in m.group(1).split(","))):
                self.origins[name] = ("input", None)
        elif m := _ALIAS.match(line):
            # Storage reuse: a new buffer in a dead one's memory; its writer says what it is.
            self.meta[m.group(1)] = self.meta.get(m.group(2), (torch.float32, []))
        elif m := _REINTERPRET.match(line):
            dtype = self.meta.get(m.group(2), (torch.float32, []))[0]
            self.meta[m.group(1)] = (dtype, _shape(m.group(3)))
            self.origins[m.group(1)] = ("view", m.group(2))
        elif (m := _KERNEL_CALL.match(line)) and m.group(1) in self.kernels:
            self.kernel_call(m.group(1), [n.strip() for n in m.group(2).split(",")])
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
        row = ops.find(op)  # the packet: its row, or None for an op the table leaves out
        if row is not None and row.is_wait and not row.coalesced:
            return CommEvent("wait", inputs=[f"b{self.id(bound['tensor'].id)}"])
        if row is not None and row.is_wait:  # torch 2.15's wait_tensors: a list, returned
            ids = [self.id(n) for n in _names(bound["tensors"])]
            self.ids[result] = ids
            # a wait line per tensor, as separate waits print: the trace stays neutral
            return [CommEvent("wait", inputs=[f"b{i}"]) for i in ids]
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
        event.inputs = [self.label(n, as_input=True) for n in inputs]
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
                ids.append(self.buffers.fresh())
                self.meta[f"{result}[{i}]"] = (dtype, shape)
                labels.append(f"b{ids[-1]}:"
                              f"{tensor_label(torch.empty(shape, dtype=dtype, device='meta'))}")
            self.buffers.shown.update(ids)
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
