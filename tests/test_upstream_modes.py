"""refimpl's later stages take the graphs of upstream's 2.15 bucket modes (issue 47).

Upstream's coalesced bucketing (BK-25), its summed-reduce_scatter deduplication (BK-26)
and its module-plan bucketing (BK-28, through a compiled model, whose module stacks only
a trace gives) each rewrite a graph of upstream's functional collectives; refimpl's
lowering and reorder then run it, and its memory plan and timeline take it, on 2 gloo
ranks: the values stay the traced program's bit for bit. Second tier (a compiled model
and three traces on ranks: some 30 s on 2 cores).
"""

from __future__ import annotations

import bucketing_rank
import pytest

from refimpl.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode, issued", [
    ("coalesced", ["funcol.reduce_scatter_tensor_coalesced"]),
    ("dedup", ["funcol.reduce_scatter_tensor"])])
def test_a_graph_of_upstreams_mode_runs_through_refimpls_stages(mode, issued):
    for rank, result in enumerate(run_on_ranks(bucketing_rank.upstream_mode_through_refimpl,
                                               2, mode)):
        assert result["mismatch"] == "", f"rank {rank}: {result['mismatch']}"
        (ops,) = result["issued"]
        assert [op.split(" ")[0] for op in ops] == issued, f"rank {rank}: {ops}"


def test_upstreams_module_plans_run_through_refimpls_stages():
    plans = ["layers.0", ["layers.1", "layers.2"], "head"]
    for rank, result in enumerate(run_on_ranks(
            bucketing_rank.upstream_module_plans_through_refimpl, 2, plans)):
        assert result["same"], f"rank {rank}: values differ from the traced graphs'"
        # the plans were applied: upstream's bucketing leaves its own ops in the graph
        assert result["other_ops"], f"rank {rank}: upstream's pass bucketed nothing"
