"""Rank-side helpers for the comm-lowering tests: trace, lower and run on real gloo ranks.

Graphs are traced inside each rank with fake values (make_fx does not communicate),
against the rank's real process groups, so group names are valid for execution.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

import refimpl.functional_collectives as fc
from conformance.lowering_programs import PROGRAMS, inputs_for
from refimpl.comm_lowering import CommLoweringConfig, comm_buffers, lower
from refimpl.symmetric_memory import enable_symm_mem_for_group, is_symm_mem_tensor

# Every program with the shapes it runs on; the world size divides every dim 0.
SHAPES = {
    "ar_graph_input": [(4,)], "ar_intermediate": [(4,)], "ar_intermediate_shared": [(4,)],
    "ar_inplace": [(4,)], "ar_coalesced": [(4,), (4, 3)], "all_gather": [(4, 2)],
    "reduce_scatter": [(8, 2)], "all_to_all": [(8, 2)],
    "all_gather_coalesced": [(4,), (4, 3)], "reduce_scatter_coalesced": [(8,), (4, 3)],
    "all_gather_out": [(4,)], "broadcast": [(4,)], "broadcast_inplace": [(4,)],
    "ar_small_intermediate": [(4, 5)], "ar_small_avg": [(4,)],
    "ar_small_graph_input": [(4,)], "ar_inplace_small": [(4, 5)],
}
ONE_SHOT = CommLoweringConfig(auto_select=True)


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value.clone() if isinstance(value, torch.Tensor) else value


def trace(program, inputs):
    return make_fx(program, tracing_mode="fake")(*inputs)


def every_program(config: CommLoweringConfig, symm_mem: bool) -> dict:
    """{program: (eager results, lowered results, one-shot kernels used)} on this rank."""
    if symm_mem:
        enable_symm_mem_for_group(dist.group.WORLD)
    out = {}
    for name, shapes in SHAPES.items():
        program = functools.partial(PROGRAMS[name], fc)
        inputs = inputs_for(dist.get_rank(), shapes, salt=len(name))
        lowered = lower(trace(program, inputs), config)
        one_shots = sum(1 for n in lowered.graph.nodes if "one_shot" in str(n.target))
        want = _plain(program(*[t.clone() for t in inputs]))
        got = _plain(lowered(*[t.clone() for t in inputs]))
        out[name] = (want, got, one_shots)
    return out


def _transposed_all_reduce_(x):
    y = x.t()
    fc.ops.wait_tensor(fc.ops.all_reduce_(y, "sum", "0"))
    return x


def non_contiguous_all_reduce_() -> tuple:
    """all_reduce_ on a transposed view of an input: (lowered result, this rank's input)."""
    x = inputs_for(dist.get_rank(), [(3, 2)])[0]
    gm = trace(_transposed_all_reduce_, [x])
    out = lower(gm)(x.clone())
    return out, x


def _transposed_broadcast_(x):
    y = x.t()
    fc.ops.wait_tensor(fc.ops.broadcast_(y, 1, "0"))
    return x


def non_contiguous_broadcast_() -> tuple:
    """broadcast_ from group rank 1 on a transposed view: (lowered result, this rank's input)."""
    x = inputs_for(dist.get_rank(), [(3, 2)])[0]
    out = lower(trace(_transposed_broadcast_, [x]))(x.clone())
    return out, x


def _comm_buffer_escapes(x):
    y = x * 3
    return fc.all_reduce(y, "sum", "0"), y


def persistent_comm_buffers() -> dict:
    """alloc_ids on this rank, and three calls of one lowered graph with comm buffers."""
    enable_symm_mem_for_group(dist.group.WORLD)
    x = inputs_for(dist.get_rank(), [(4, 5)])[0]
    program = functools.partial(PROGRAMS["ar_small_intermediate"], fc)
    first = lower(trace(program, [x]), ONE_SHOT)
    second = lower(trace(program, [x]), ONE_SHOT)
    results = [first(x), first(x), second(x)]
    escaping = lower(trace(_comm_buffer_escapes, [x]), ONE_SHOT)
    reduced, y = escaping(x)
    return {
        "ids": [b["alloc_id"] for b in comm_buffers(first)],
        "ids_again": [b["alloc_id"] for b in comm_buffers(second)],
        "results": results,
        "escaping": (reduced, y, is_symm_mem_tensor(y), escaping(x)[1]),
    }
