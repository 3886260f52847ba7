"""The "reorder" concept of the `torch` backend: upstream's FX overlap scheduler.

`torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing` reorders an FX
graph of `_c10d_functional` collectives (it finds nothing to do in a graph without
upstream's `wait_tensor`). The adapter runs it on a copy of the graph (upstream rewrites
its argument in place) with the case's costs, so both backends schedule with the same
numbers:

- `config.cost_model` (refimpl.simulator's `CostModel`, the protocol's cost oracle) gives
  every node's duration; collectives reach upstream through `custom_runtime_estimation`
  and compute through its roofline `estimate_roofline_runtime_ms`, which needs triton on
  CPU and is replaced here for the call (`compute_estimator="analytical"`, so nothing is
  benchmarked and no rank talks to another);
- `memory_budget` becomes `max_memory_increase_ratio` (with no absolute cap; an infinite
  budget becomes a cap of 10^6 GB, as passing no limit at all fails in upstream 2.13);
- `max_in_flight` has no counterpart: upstream bounds the *bytes* in flight over every
  collective (`max_in_flight_gb`). The adapter passes the bytes of the largest collective
  of a limited kind times its count, which is the limit only when every collective has
  that size;
- no bucketing (`collective_bucketing=False`, `pre_bucketing_fsdp_collectives=False`): the
  concept is reordering.

`ReorderConfig` and `CostModel` are the protocol's data types (refimpl's), as the
simulator is the one cost model both backends are scored with (SPEC section 8).
"""

from __future__ import annotations

import inspect
import math
import types
from contextlib import contextmanager

import torch
import torch.fx

from conformance import ops


def copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule of a copy of `gm`'s graph (upstream rewrites the one it is given)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


@contextmanager
def roofline(durations_ms: dict):
    """Upstream's compute estimates replaced, for the call, by `durations_ms` (by node)."""
    from torch._inductor.fx_passes import overlap_scheduling as upstream

    # 2.12 on: compute through estimate_roofline_runtime_ms. torch 2.11 asks
    # custom_runtime_estimation for compute nodes too, but still logs the roofline's
    # estimate_runtime_analytical of every mm across ranks, which needs CUDA.
    names = [n for n in ("estimate_roofline_runtime_ms", "estimate_runtime_analytical")
             if hasattr(upstream, n)]
    saved = {n: getattr(upstream, n) for n in names}
    for name in names:
        setattr(upstream, name, lambda node: durations_ms.get(node, 0.0))
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(upstream, name, function)


def estimates(gm: torch.fx.GraphModule, cost_model) -> tuple[dict, dict]:
    """`cost_model`'s durations of `gm`'s nodes in ms (for `roofline`), and the arguments of
    upstream's scheduler that give it the collectives' (nothing benchmarked, no rank talks
    to another)."""
    durations_ms = {n: us / 1000 for n, us in cost_model.durations(gm).items()}
    return durations_ms, dict(
        custom_runtime_estimation=lambda node, size: durations_ms.get(node)
        if size is None else None,
        collective_estimator="analytical", compute_estimator="analytical")


def _in_flight_gb(gm: torch.fx.GraphModule, limits: dict) -> float:
    """Upstream's nearest knob to a count per kind: bytes (see the module docstring)."""
    from torch._inductor.comm_analysis import estimate_fx_collective_memory_footprint

    if not limits:
        return 5.0  # upstream's default
    largest = {}
    for node in gm.graph.nodes:
        kind = ops.kind_of(node)
        if kind in limits:
            size = estimate_fx_collective_memory_footprint(node)
            largest[kind] = max(largest.get(kind, 0), size)
    total = sum(largest[k] * limits[k] for k in largest) or 1
    return total / 1024**3


def reorder(gm: torch.fx.GraphModule, config) -> torch.fx.GraphModule:
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    from refimpl.reorder import ReorderConfig
    from refimpl.simulator import CostModel

    config = config if config is not None else ReorderConfig()
    gm = copy_graph(gm)
    durations_ms, estimated = estimates(gm, config.cost_model or CostModel())
    budget = math.inf if config.memory_budget is None else config.memory_budget
    options = dict(
        max_in_flight_gb=_in_flight_gb(gm, dict(config.max_in_flight)),
        **estimated,
        # no bound: a cap nothing reaches (with both limits None upstream fails, 2.13)
        max_memory_increase_gb=1e6 if math.isinf(budget) else None,
        max_memory_increase_ratio=None if math.isinf(budget) else budget,
        collective_bucketing=False, pre_bucketing_fsdp_collectives=False)
    # torch 2.11's pass has neither compute_estimator nor pre_bucketing_fsdp_collectives
    accepted = inspect.signature(schedule_overlap_bucketing).parameters
    with roofline(durations_ms):
        return schedule_overlap_bucketing(
            gm, **{k: v for k, v in options.items() if k in accepted})


def concept():
    from refimpl.reorder import ReorderConfig
    from refimpl.simulator import CostModel

    return types.SimpleNamespace(reorder=reorder, ReorderConfig=ReorderConfig,
                                 CostModel=CostModel)
