"""refimpl.reorder (SPEC.md section 4): the validator can fail, barriers, real runs.

- The order validator of the conformance cases (conformance/reorder_rules.py) refuses a
  doctored order for every rule it checks, naming the rule: it is not a check that
  cannot fail.
- What the pass treats as a barrier (RO-6), seeded random ops keeping their order
  (RO-4), an original order kept in `meta` that no longer fits the graph (RO-2), an
  original order that itself breaks the in-flight limit (RO-8, RO-9's exception).
- On gloo ranks: the memory lifecycle verifier passes on every reordered conformance
  program (its plan is what the run allocates and frees), and every rank gets the same
  order (RO-2).
- The reordered conformance programs expose less communication on the simulator.
"""

from __future__ import annotations

import math
import operator

import pytest
import reorder_rank
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from conformance import reorder_programs as rp
from conformance.memory_programs import fake_world
from conformance.reorder_rules import order_violations
from refimpl.multiprocess import run_on_ranks
from refimpl.reorder import ORIGINAL_ORDER, ReorderConfig, barrier_reason, reorder
from refimpl.simulator import CostModel, simulate


@pytest.fixture(scope="module")
def world4():
    with fake_world(4):
        yield


def in_order(gm: torch.fx.GraphModule, names: list[str]) -> torch.fx.GraphModule:
    """A copy of `gm` with its nodes relinked in the order `names` gives (a doctored
    order, possibly not even topological)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    by_name = {n.name: n for n in graph.nodes}
    cursor = by_name[names[0]]
    for name in names[1:]:
        cursor.append(by_name[name])
        cursor = by_name[name]
    return torch.fx.GraphModule(gm, graph)


def names_of(gm) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def moved(names: list[str], name: str, before: str) -> list[str]:
    """`names` with `name` moved to just before `before`."""
    rest = [n for n in names if n != name]
    rest.insert(rest.index(before), name)
    return rest


def config_for(gm, budget=math.inf, **limits) -> ReorderConfig:
    return ReorderConfig(cost_model=CostModel(pinned=rp.pinned_costs(gm)),
                         memory_budget=budget, max_in_flight=limits)


# --------------------------------------------------------------------------------------
# The validator fails, one rule at a time
# --------------------------------------------------------------------------------------
def test_validator_passes_the_original_order(world4):
    # prologue_behind_its_group's own order spreads a block on purpose (a view early, its
    # all_reduce late): RO-7 holds a new order to contiguity, the original breaks only it
    spread = {"prologue_behind_its_group": ["RO-7: block ['all_reduce_1', 'view'] is not "
                                            "contiguous"],
              "refused_fill_behind_a_spread_block": [
                  "RO-7: block ['_to_copy', 'all_gather_into_tensor'] is not contiguous"]}
    for name in rp.PROGRAMS:
        gm = rp.program_graph(name)
        assert order_violations(gm, in_order(gm, names_of(gm))) == spread.get(name, []), name


@pytest.mark.parametrize("program, name, before, rule", [
    ("two_groups", "mul", "arg0_1", "RO-3"),                         # before its input
    ("mutated_buffer", "sum_1", "wait_tensor", "RO-4"),              # reads version 1
    ("mutated_buffer", "mul_2", "wait_tensor", "RO-4"),              # FC-5: before the wait
    ("mutated_buffer", "add_", "mul_2", "RO-4"),                     # before version 1's reader
    ("mutated_buffer", "mul_", "wait_tensor_1", "RO-4"),             # mutates while in flight
    ("two_groups", "all_gather_into_tensor_2", "mul", "RO-5"),       # passes its group's first
    ("two_groups", "reduce_scatter_tensor", "mul", "RO-5"),          # another kind, same group
    ("opaque_op", "all_gather_into_tensor_1", "record_", "RO-6"),    # across the barrier
    ("fsdp_forward", "_to_copy_2", "_to_copy", "RO-7"),             # the cast without its gather
])
def test_validator_names_the_rule_a_doctored_order_breaks(world4, program, name, before, rule):
    gm = rp.program_graph(program)
    names = moved(names_of(gm), name, before)
    problems = order_violations(gm, in_order(gm, names))
    assert problems and all(p.startswith(rule) for p in problems), problems


def test_validator_counts_collectives_in_flight(world4):
    gm = rp.program_graph("fsdp_forward")
    names = moved(moved(names_of(gm), "_to_copy_2", "wait_tensor"),
                  "all_gather_into_tensor_1", "wait_tensor")
    new = in_order(gm, names)
    assert order_violations(gm, new, math.inf, {"all_gather": 2}) == []
    problems = order_violations(gm, new, math.inf, {"all_gather": 1})
    assert [p[:5] for p in problems] == ["RO-8:"], problems


def test_validator_bounds_the_planned_peak(world4):
    gm = rp.program_graph("memory_bound")  # 500 B; the raised gather plans 532 B
    new = in_order(gm, moved(names_of(gm), "all_gather_into_tensor", "mul"))
    assert order_violations(gm, new, 0.065) == []
    assert [p[:5] for p in order_violations(gm, new, 0.05)] == ["RO-9:"]


def test_validator_wants_the_same_nodes(world4):
    gm = rp.program_graph("two_groups")
    other = rp.program_graph("opaque_op")
    assert order_violations(gm, other)[0].startswith("RO-3: nodes differ")


# --------------------------------------------------------------------------------------
# Barriers and hidden state (RO-4, RO-6)
# --------------------------------------------------------------------------------------
class _Scale(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_barrier_reasons_follow_the_rule(world4):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    nodes = {
        "aten": graph.call_function(torch.ops.aten.mul.Tensor, (x, 2)),
        "aten in place": graph.call_function(torch.ops.aten.add_.Tensor, (x, 1)),
        "assert": graph.call_function(torch.ops.aten._assert_scalar.default, (True, "m")),
        "getitem": graph.call_function(operator.getitem, (x, 0)),
        "setitem": graph.call_function(operator.setitem, (x, 0, 1)),
        "python": graph.call_function(print, (x,)),
        "module": graph.call_module("scale", (x,)),
        "method": graph.call_method("add", (x, 1)),
        "opaque op": graph.call_function(torch.ops.refimpl_conformance.record_.default, (x,)),
        "c10d": graph.call_function(torch.ops.c10d.barrier.default, ()),
        "collective": graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (x,)),
    }
    graph.output(x)
    torch.fx.GraphModule({"scale": _Scale()}, graph)
    reasons = {k: barrier_reason(n) for k, n in nodes.items()}
    assert [k for k, why in reasons.items() if why is None] == \
        ["aten", "aten in place", "getitem", "collective"], reasons
    assert "side-effectful" in reasons["assert"] and "setitem" in reasons["setitem"]
    assert "writes an argument" in reasons["opaque op"] and "print" in reasons["python"]


def test_seeded_random_ops_keep_their_order(world4):
    ops = rp.refimpl_ops()

    def fn(x):
        g = ops.wait_tensor(ops.all_gather_into_tensor(x, 4, "0"))
        a = torch.rand_like(x)
        b = torch.rand_like(x)
        return g, a, b

    gm = make_fx(fn, tracing_mode="fake")(torch.ones(2))
    first = names_of(gm).index("rand_like")
    pinned = {"rand_like": 30.0, "rand_like_1": 0.0}
    new = reorder(gm, ReorderConfig(cost_model=CostModel(pinned={**rp.pinned_costs(gm),
                                                                  **pinned})))
    assert names_of(new).index("rand_like") < names_of(new).index("rand_like_1")
    assert first < names_of(gm).index("rand_like_1")


# --------------------------------------------------------------------------------------
# The original order (RO-2) and an original order that breaks the limit (RO-8, RO-9)
# --------------------------------------------------------------------------------------
def test_a_stale_original_order_is_ignored(world4):
    gm = rp.program_graph("two_groups")
    gm.meta[ORIGINAL_ORDER] = ("arg0_1", "nothing")
    new = reorder(gm, config_for(gm))
    assert new.meta[ORIGINAL_ORDER] == tuple(names_of(gm))
    backwards = tuple(reversed(names_of(gm)))
    gm.meta[ORIGINAL_ORDER] = backwards  # names every node, but in no valid order
    assert reorder(gm, config_for(gm)).meta[ORIGINAL_ORDER] == tuple(names_of(gm))


def test_an_original_order_over_the_limit_is_brought_under_it(world4):
    gm = rp.program_graph("fsdp_forward")
    names = names_of(gm)
    for cast, gather in (("_to_copy_2", "all_gather_into_tensor_1"),
                         ("_to_copy_4", "all_gather_into_tensor_2")):
        names = moved(moved(names, cast, "wait_tensor"), gather, "wait_tensor")
    crowded = in_order(gm, names)  # three all_gathers in flight at the first wait
    new = reorder(crowded, config_for(crowded, 0.1, all_gather=1))
    assert order_violations(crowded, new, math.inf, {"all_gather": 1}) == []


def test_reordered_programs_expose_less_communication(world4):
    for case in rp.CASES:
        gm = rp.program_graph(case.program)
        config = config_for(gm, case.memory_budget, **dict(case.max_in_flight))
        before = simulate(gm, config.cost_model).exposed_comm_us
        after = simulate(reorder(gm, config), config.cost_model).exposed_comm_us
        assert after <= before, case.id
        if case.program in ("fsdp_forward", "fsdp_backward", "two_groups") and \
                math.isinf(case.memory_budget):
            assert after < before, case.id


# --------------------------------------------------------------------------------------
# On gloo ranks
# --------------------------------------------------------------------------------------
def test_lifecycle_verifier_passes_on_every_reordered_program():
    for rank, peaks in enumerate(run_on_ranks(reorder_rank.verify_every_reordered_program, 2,
                                              rp.CASES)):
        assert len(peaks) == len(rp.CASES)
        for case, (measured, planned) in peaks.items():
            assert measured == planned > 0, f"rank {rank}, {case}: {measured} != {planned}"


def test_every_rank_gets_the_same_order():
    """On 4 ranks the pair groups of ranks 0-1 and 2-3 differ in name, not in order."""
    orders = run_on_ranks(reorder_rank.orders, 4, rp.CASES)
    assert all(o == orders[0] for o in orders[1:])


def test_the_memory_tree_adds_and_finds_as_a_list_does():
    """refimpl.reorder_memory's range-add / range-max tree (RO-10's exact test) against a
    plain list: every range max and the last position above a bound, after random adds."""
    import random

    from refimpl.reorder_memory import PLACED, MaxTree

    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 130)  # trees of 1 to 8 levels
        values = [rng.randint(0, 50) for _ in range(n)]
        tree = MaxTree(list(values))
        for _ in range(25):
            lo, hi, add = rng.randint(0, n), rng.randint(0, n), rng.randint(-10, 10)
            lo, hi = min(lo, hi), max(lo, hi)
            tree.add(lo, hi, add)
            values[lo:hi] = [v + add for v in values[lo:hi]]
            a, b, bound = rng.randint(0, n), rng.randint(0, n), rng.randint(0, 60)
            a, b = min(a, b), max(a, b)
            assert tree.max(a, b) == (max(values[a:b]) if b > a else PLACED)
            assert tree.last_above(a, b, bound) == max(
                (i for i in range(a, b) if values[i] > bound), default=a - 1)
