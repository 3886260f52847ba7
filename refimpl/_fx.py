"""FX helpers shared by refimpl's graph passes (bucketing, lowering, and those after them).

What a pass needs to read a traced graph of functional collectives: a collective's name
(what each op *is* lives in refimpl/comm_ops.py), its arguments by schema name, and its
fake value, with errors that name the graph argument, the node and the rule of the pass
that needed it.

Private to refimpl: the passes' SPEC rules say what they accept (BK-1, CL-1).
"""

from __future__ import annotations

import torch
import torch.fx

from refimpl.comm_ops import COLLECTIVE_NAMESPACES, is_wait, node_op

__all__ = ["COLLECTIVE_NAMESPACES", "REDUCE_OPS", "collective_name", "is_wait", "arguments",
           "fake_value", "size_hint", "empty_graph_like"]

# The reductions a collective takes (FC-17), lower case.
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")


def collective_name(node: torch.fx.Node) -> str | None:
    """`all_reduce` for a node calling a functional collective (or wait) of any namespace,
    else None: for messages and node names; passes key behaviour by its row (comm_ops)."""
    row = node_op(node)
    return row.name if row is not None and row.namespace in COLLECTIVE_NAMESPACES else None


def arguments(node: torch.fx.Node, rule: str) -> dict:
    """A call's arguments by their schema names, defaults filled in.

    A required argument that the node lacks raises ValueError naming `gm`, the node, the
    argument and `rule` (a hand-built graph can hold such a node; a traced one cannot).
    """
    bound = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            raise ValueError(f"gm: node {node.name!r} ({node.target}) lacks its argument "
                             f"{arg.name!r} [{rule}]")
    return bound


def is_subgraph(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """A get_attr of a submodule: the code of a higher-order op (flex_attention's score_mod,
    cond's branches), which holds no tensor and has no meta['val']."""
    if node.op != "get_attr":
        return False
    try:
        gm.get_submodule(node.target)  # raises for a parameter or buffer
    except AttributeError:
        return False
    return True


def fake_value(node: torch.fx.Node, rule: str):
    """`node.meta["val"]`, or a ValueError naming `gm`, the node and the pass's `rule`."""
    if "val" not in node.meta:
        raise ValueError(f"gm: node {node.name!r} has no meta['val']; trace the graph with "
                         f"fake values (make_fx(tracing_mode='fake'), torch.compile) [{rule}]")
    return node.meta["val"]


def empty_graph_like(gm: torch.fx.GraphModule) -> torch.fx.Graph:
    """An empty graph for a pass's new copy of `gm`, with its tracer class and its code
    generator: the latter holds the calling convention (make_fx of a function of a dict
    gives a pytree code generator, which takes and returns the dict), which a pass's
    result keeps (CL-1, RO-1)."""
    graph = torch.fx.Graph(tracer_cls=gm.graph._tracer_cls)
    graph._codegen = gm.graph._codegen
    return graph


def size_hint(size) -> int:
    """An int for a size that may be symbolic (a graph traced with dynamic shapes): its
    value in the traced example; a data-dependent (unbacked) size as the shape environment
    estimates it, as Inductor's does. Reads the hint only: adds no guard."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    from torch.fx.experimental import symbolic_shapes

    # torch 2.13 renamed hint_int (which took the same arguments) optimization_hint
    hint = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.hint_int
    return int(hint(size))


def node_args(arg) -> list[torch.fx.Node]:
    """The nodes in an argument: itself, or those of its (nested) lists, tuples, dicts."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(arg, found.append)
    return found


# ---- the call of a program a pass returns --------------------------------------------
# A GraphModule call goes through FX's error-message wrapper and nn.Module's call path
# before its generated `forward`: about 1.5 us, as much as a one-shot all-reduce of 4 KiB
# (benchmarks/results/symm_mem.md). `call_straight` lets a program skip them while
# nothing needs them: no hook, no `Module.compile`, no tracer patching `Module.__call__`,
# no profiler.
_MODULE_CALL = torch.nn.Module.__call__
_nn = torch.nn.modules.module
_tracing_state = torch._C._get_tracing_state  # torch.jit.trace is running
_profiling = torch._C._autograd._profiler_enabled  # the profiler records module calls


def _call_straight(self, *args, **kwargs):
    # One condition, inline: this check is most of what the call costs.
    if (self._forward_hooks or self._forward_pre_hooks or self._backward_hooks
            or self._backward_pre_hooks or self._compiled_call_impl is not None
            or _nn._global_forward_hooks or _nn._global_forward_pre_hooks
            or _nn._global_backward_hooks or _nn._global_backward_pre_hooks
            or torch.nn.Module.__call__ is not _MODULE_CALL or _tracing_state()
            or _profiling()):
        return self._wrapped_call(self, *args, **kwargs)  # FX's path, set by recompile()
    return self.forward(*args, **kwargs)


def call_straight(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Make calls of `gm` run its generated code directly whenever nn.Module's call path
    would do nothing but reach it. Hooks, `gm.compile()`, tracers and the profiler see
    the usual path; an error raised inside is the same exception, without FX's note on
    stderr that repeats the generated line (the traceback shows it). `gm.recompile()`
    (which pickling calls) undoes this."""
    cls = type(gm)  # FX gives every GraphModule a class of its own
    if cls is torch.fx.GraphModule or "_wrapped_call" not in vars(cls):
        raise TypeError("gm: call_straight needs a recompiled GraphModule of its own class")
    cls.__call__ = _call_straight
    return gm
