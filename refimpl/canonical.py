"""Canonical text of traced graphs: what goldens compare, identical across backends and runs.

A canonical graph prints one node a line, in order, renumbered `%0, %1, ...`, with
every collective's namespace folded to `funcol` (so `refimpl_c10d.all_reduce` and
`_c10d_functional.all_reduce` print alike) and every symmetric-memory op or function to
`symm_mem` (refimpl's and upstream's), every group name replaced by the global
ranks of its group (names are hashes or counters that vary between runs), and each
result's dtype and shape. Nothing in it depends on the backend, the run or the rank.

Implements SPEC.md CF-5 (section 7). It is refimpl's own output (the compile backend's
debug files, E2E-5) and the text the conformance goldens compare (`conformance.canonical`
re-exports it).
"""

from __future__ import annotations

import inspect

import torch
import torch.fx

from refimpl.comm_ops import COLLECTIVE_NAMESPACES, SYMM_MEM_NAMESPACES

# Python modules of symmetric memory (refimpl's and upstream's).
SYMM_MEM_MODULES = ("refimpl.symmetric_memory", "torch.distributed._symmetric_memory")

_DTYPE_NAMES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8",
}


def op_name(target) -> str:
    """`funcol.all_reduce` for any backend's collective, `aten.add.Tensor` for the rest."""
    return folded_op_name(target, COLLECTIVE_NAMESPACES, SYMM_MEM_NAMESPACES)


def folded_op_name(target, collective_namespaces, symm_mem_namespaces) -> str:
    """`op_name` with the namespaces that fold to `funcol` and `symm_mem` given: the
    conformance judge passes its own reading of them (conformance/canonical.py)."""
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        name = target._schema.name.split("::", 1)[1]
        overload = target._overloadname
        if ns in collective_namespaces:
            ns = "funcol"
        elif ns in symm_mem_namespaces:
            ns = "symm_mem"
        return f"{ns}.{name}" + ("" if overload == "default" else f".{overload}")
    if callable(target):
        module = getattr(target, "__module__", "") or ""
        if module in ("", "_operator", "operator", "builtins"):
            return target.__name__
        if module in SYMM_MEM_MODULES:
            return f"symm_mem.{target.__name__}"
        return f"{module.split('.')[-1]}.{target.__name__}"
    return str(target)


def group_label(group_name) -> str:
    """A group as its global ranks, e.g. `ranks[1,3]`; unknown names keep a placeholder."""
    import torch.distributed as dist

    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        ranks = dist.get_process_group_ranks(_resolve_process_group(str(group_name)))
    except Exception:
        return "group<unknown>"
    return "ranks[" + ",".join(str(r) for r in ranks) + "]"


def tensor_label(value) -> str:
    if isinstance(value, torch.Tensor):
        dtype = _DTYPE_NAMES.get(value.dtype, str(value.dtype).replace("torch.", ""))
        return f"{dtype}[{', '.join(str(s) for s in value.shape)}]"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(tensor_label(v) for v in value) + ")"
    return type(value).__name__ if value is not None else "none"


def _argument_names(target) -> list[str]:
    """The parameter names of an op (from its schema) or of a Python function; none for
    anything else (a call_method's name, a builtin without a signature)."""
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return [a.name for a in schema.arguments]
    try:
        return list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return []


def _format_arg(arg, names) -> str:
    if isinstance(arg, torch.fx.Node):
        return names[arg]
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_format_arg(a, names) for a in arg)
        return f"[{inner}]"
    if isinstance(arg, torch.dtype):
        return _DTYPE_NAMES.get(arg, str(arg))
    if isinstance(arg, torch.device):
        return f"device({arg.type})"
    return repr(arg)


def _node_args(node: torch.fx.Node, names) -> str:
    """Arguments in order; any argument named `group_name` prints as its group's ranks."""
    arg_names = _argument_names(node.target)
    parts = []
    for i, arg in enumerate(node.args):
        is_group = i < len(arg_names) and arg_names[i] == "group_name"
        parts.append(group_label(arg) if is_group else _format_arg(arg, names))
    for key, arg in node.kwargs.items():
        text = group_label(arg) if key == "group_name" else _format_arg(arg, names)
        parts.append(f"{key}={text}")
    return ", ".join(parts)


def canonical_graph(gm: torch.fx.GraphModule) -> str:
    """The canonical text of `gm` (see the module docstring)."""
    names: dict[torch.fx.Node, str] = {}
    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            names[node] = f"%{len(names)}"
            lines.append(f"{names[node]} = input : {tensor_label(node.meta.get('val'))}")
        elif node.op == "output":
            lines.append(f"return {_format_arg(node.args[0], names)}")
        elif node.op == "get_attr":
            names[node] = f"%{len(names)}"
            lines.append(f"{names[node]} = constant")
        else:
            names[node] = f"%{len(names)}"
            label = tensor_label(node.meta.get("val"))
            lines.append(f"{names[node]} = {op_name(node.target)}({_node_args(node, names)})"
                         f" : {label}")
    return "\n".join(lines)
