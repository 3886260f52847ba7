"""Rank functions of tests/test_reorder.py: they run inside gloo ranks (refimpl.multiprocess).

- `verify_every_reordered_program`: the memory lifecycle verifier (MEM-12) on every
  reordered conformance program: the planned memory of the new order is what a run of it
  allocates and frees, node by node.
- `orders`: the node order each rank gets for every conformance case (RO-2: the same on
  every rank, though the ranks' pair groups have different names).
"""

from __future__ import annotations

import torch.distributed as dist

from conformance import reorder_programs as rp
from refimpl.memory import plan_memory, verify_memory_lifecycle
from refimpl.reorder import ReorderConfig, reorder
from refimpl.simulator import CostModel


def _reordered(case: rp.Case, rank: int):
    gm = rp.program_graph(case.program, rank=rank)
    config = ReorderConfig(cost_model=CostModel(pinned=rp.pinned_costs(gm)),
                           memory_budget=case.memory_budget,
                           max_in_flight=dict(case.max_in_flight))
    return gm, reorder(gm, config)


def verify_every_reordered_program(cases) -> dict[str, tuple[int, int]]:
    """(measured peak, planned peak) of every case's reordered program on this rank."""
    rank, ctx = dist.get_rank(), rp.context()
    peaks = {}
    for case in cases:
        _, new = _reordered(case, rank)
        plan = plan_memory(new)
        inputs = rp.inputs_for(case.program, ctx, rank)
        peaks[case.id] = (verify_memory_lifecycle(new, *inputs, plan=plan), plan.peak_bytes)
    return peaks


def orders(cases) -> dict[str, list[str]]:
    rank = dist.get_rank()
    return {case.id: [n.name for n in _reordered(case, rank)[1].graph.nodes] for case in cases}
