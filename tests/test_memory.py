"""refimpl.memory (SPEC.md section 5): the verifier on real runs, wrong plans, random graphs.

The lifecycle verifier runs inside 2 gloo ranks, where collectives are real: every
conformance memory program (traced, bucketed, lowered, one-shot with a comm buffer) must
pass with the measured peak equal to the planned one; deliberately wrong plans must be
refused naming the buffer; and a hypothesis property over random programs (views,
in-place ops, collectives and waits, lowered or not, in random valid orders) checks that
the measured peak is the planned peak. API checks run on a fake process group.
"""

from __future__ import annotations

import memory_rank
import pytest
import torch
import torch.distributed as dist

from conformance import memory_programs as mp
from refimpl.memory import MemoryModel, plan_memory
from refimpl.multiprocess import run_on_ranks


@pytest.fixture(scope="module")
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    elif dist.get_world_size() != 2:
        pytest.fail(f"these tests need a world of 2, found {dist.get_world_size()}")
    yield
    if created:
        dist.destroy_process_group()


def test_verifier_passes_on_every_conformance_program():
    for rank, peaks in enumerate(run_on_ranks(memory_rank.verify_every_program, 2, mp.ALL)):
        assert len(peaks) == len(mp.ALL) + 1
        for name, (measured, planned) in peaks.items():
            assert measured == planned > 0, f"rank {rank}, {name}: {measured} != {planned}"


def test_verifier_refuses_wrong_plans_naming_the_buffer():
    for rank, results in enumerate(run_on_ranks(memory_rank.wrong_plans, 2)):
        assert len(results) == 5
        for what, buffer, error in results:
            assert error != "no error", f"rank {rank}: a plan with {what} passed"
            assert repr(buffer) in error and "[MEM-12]" in error, (what, error)


def test_measured_peak_is_planned_peak_on_random_graphs():
    ran = run_on_ranks(memory_rank.random_graphs, 2, 40, timeout=600)
    assert ran == [40, 40]


# --------------------------------------------------------------------------------------
# API, on a fake process group
# --------------------------------------------------------------------------------------
def test_refuses_what_is_not_a_graph_module():
    with pytest.raises(TypeError, match=r"gm: expected a torch.fx.GraphModule.*\[MEM-1\]"):
        plan_memory(torch.nn.Linear(2, 2))


def test_refuses_a_used_node_without_fake_value(fake_world):
    gm = mp.traced("dead_value")
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.users)
    del node.meta["val"]
    with pytest.raises(ValueError, match=rf"gm: node '{node.name}' has users but no.*\[MEM-1\]"):
        plan_memory(gm)


def test_orders_are_checked(fake_world):
    gm = mp.traced("two_layers")
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    other = mp.traced("dead_value")
    cases = {"comes before its input": list(reversed(body)), "misses nodes": body[1:],
             "appears twice": body + body[:1],
             "is not a node of gm": body + [next(n for n in other.graph.nodes
                                                  if n.op == "call_function")]}
    for message, order in cases.items():
        with pytest.raises(ValueError, match=rf"order: .*{message}.*\[MEM-11\]"):
            plan_memory(gm, order)
    with_inputs = list(gm.graph.nodes)  # placeholders and output may be given too
    assert [str(e) for e in plan_memory(gm, with_inputs).events] == \
        [str(e) for e in plan_memory(gm).events]


def test_sweep_places_nodes_one_by_one_as_plan_does(fake_world):
    gm = mp.bucketed_fsdp_block()
    model = MemoryModel(gm)
    plan = model.plan()
    sweep = model.sweep()
    live = []
    for node in plan.order:
        before = sweep.live_bytes
        sweep.place(node)
        live.append(sweep.live_bytes)
        assert sweep.peak_bytes >= before + model.alloc_bytes(node)
    assert live == plan.live_bytes
    assert (sweep.peak_bytes, sweep.peak_node) == (plan.peak_bytes, plan.peak_node)


def test_buffers_say_where_they_live(fake_world):
    gm = mp.traced("mutated_views")
    plan = plan_memory(gm)
    buf = next(b for b in plan.buffers if b.name == "mul")
    names = [n.name for n in buf.aliases]
    assert names[0] == "mul" and {"slice_1", "slice_2", "add_", "all_reduce_"} <= set(names)
    assert buf.free_node.name == "mul_1" and buf.kind == "intermediate"
    assert [b.kind for b in plan.buffers if b.alloc_node.op == "placeholder"] == ["input"]
    assert "peak" in plan.table() and "mul" in plan.table()
