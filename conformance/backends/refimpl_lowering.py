"""The "lowering" concept of the `refimpl` backend: refimpl.comm_lowering behind the
backend-neutral questions the conformance cases ask (see `concept()`)."""

from __future__ import annotations

import types

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from conformance.comm_trace import CommEvent, comm_trace_of_graph


def _config(options: dict | None):
    """CommLoweringConfig from the options; `enable_symm_mem_for` enables groups first."""
    from refimpl.comm_lowering import CommLoweringConfig

    options = dict(options or {})
    groups = options.pop("enable_symm_mem_for", ())
    if groups:
        from refimpl.symmetric_memory import enable_symm_mem_for_group

        for name in groups:
            enable_symm_mem_for_group(name)
    return CommLoweringConfig(**options)


def lowered_graph(fn, example_inputs, options=None) -> torch.fx.GraphModule:
    """Trace `fn` with fake values (no communication) and lower it."""
    from refimpl.comm_lowering import lower

    gm = make_fx(fn, tracing_mode="fake")(*example_inputs)
    return lower(gm, _config(options))


def lowered_comm_trace(fn, example_inputs, options=None) -> list[CommEvent]:
    return comm_trace_of_graph(lowered_graph(fn, example_inputs, options))


def run_lowered(fn, example_inputs, options=None):
    """Run the lowered program on real tensors (inside a rank: it communicates)."""
    return lowered_graph(fn, example_inputs, options)(*example_inputs)


def concept():
    from refimpl import comm_lowering

    return types.SimpleNamespace(
        lower=comm_lowering.lower, Config=comm_lowering.CommLoweringConfig,
        lowered_graph=lowered_graph, lowered_comm_trace=lowered_comm_trace,
        run_lowered=run_lowered)
