"""Conformance section "end to end" (SPEC.md section 9, E2E).

One training step, sharded FSDP-style (conformance/e2e_programs.py), runs on 2 gloo
ranks eagerly and compiled with the backend's `compile_backend`. Every case checks, on
every rank and every step:
- values: the compiled losses and final parameter shards equal eager's, bit for bit for
  a backend that runs the program's ATen ops as they are (`exact`), within a relative
  1e-4 for one that fuses arithmetic (Inductor);
- collectives: how many the forward and the backward issued on the process group
  (counted by c10d's own sequence number), against counts derived here from the model's
  parameter sizes and the bucket cap alone.
Backends that keep their FX programs (refimpl) are also checked stage by stage: the
collectives of every compiled graph after every stage, from `debug_dir`'s canonical
texts and from the backend's own record.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import xml.etree.ElementTree as ET

import pytest
import torch

from conformance import harness
from conformance.e2e_programs import (
    Model,
    compare_on_rank,
    logged_compile,
    opaque_then_collective_on_rank,
    parameter_shapes,
)

WORLD_SIZE = 2
MiB = 1024 * 1024
TRANSFORMER = Model("transformer")
# Five [16, 16] float32 weights: every all_gather output and reduce_scatter input holds
# 16 * 16 * 4 = 1024 bytes (BK-3 counts the larger of input and output).
MLP = Model("mlp", dim=16, layers=5)
MEMBER_BYTES = 16 * 16 * 4
OFF = {"bucket_cap_mb": None, "lowering": None, "reorder": None}


def all_stages(backend) -> dict:
    """Every stage the backend implements, each with its default config."""
    stages = backend.require("compile_backend").stages
    return {"bucket_cap_mb": 25.0 if "bucketing" in stages else None,
            "lowering": {} if "lowering" in stages else None,
            "reorder": {} if "reorder" in stages else None}


def buckets(members: int, member_bytes: int, cap_mb: float | None) -> int:
    """Collectives left of `members` equal ones once merged under `cap_mb` (BK-3)."""
    if cap_mb is None:
        return members
    per_bucket = max(1, int(cap_mb * MiB) // member_bytes)
    return math.ceil(members / per_bucket)


def run(backend, model, steps, options, **kwargs) -> list[dict]:
    backend.require("functional_collectives")
    backend.require("compile_backend")
    return harness.run(backend, compare_on_rank, WORLD_SIZE, model, steps, options, **kwargs)


def check_values(backend, results) -> None:
    """Every rank's compiled losses and final shards against its eager ones (E2E-3)."""
    exact = backend.require("compile_backend").exact
    for rank, result in enumerate(results):
        eager, compiled = result["eager"], result["compiled"]
        want = torch.tensor([s.loss for s in eager["steps"]])
        got = torch.tensor([s.loss for s in compiled["steps"]])
        pairs = [("losses", want, got), *[(f"shard {i}", w, g) for i, (w, g) in enumerate(
            zip(eager["shards"], compiled["shards"], strict=True))]]
        for what, w, g in pairs:
            if exact:
                assert torch.equal(w, g), f"rank {rank}: {what}: compiled {g} != eager {w}"
            else:
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6,
                                           msg=f"rank {rank}: {what}")


def check_issued(results, forward: int, backward: int) -> None:
    """Collectives every compiled step issued on the process group (E2E-4)."""
    for rank, result in enumerate(results):
        issued = [(s.forward_collectives, s.backward_collectives)
                  for s in result["compiled"]["steps"]]
        assert issued == [(forward, backward)] * len(issued), \
            f"rank {rank}: (forward, backward) collectives per step {issued}, expected " \
            f"{(forward, backward)}"


# --------------------------------------------------------------------------------------
# The transformer, every stage off and every stage on
# --------------------------------------------------------------------------------------
# Every stage off or all on, each run once for the two cases that read it.
TRANSFORMER_STAGES = [pytest.param(s, marks=pytest.mark.xdist_group(f"e2e-transformer-{s}"))
                      for s in ("off", "all")]


@functools.cache
def _transformer_run(backend, stages) -> tuple[int, list[dict]]:
    """The transformer's 5 steps: all_gathers its forward issues, every rank's results."""
    options = OFF if stages == "off" else all_stages(backend)
    results = run(backend, TRANSFORMER, 5, options)
    shapes = parameter_shapes(TRANSFORMER).values()
    sizes = [4 * math.prod(s) for s in shapes]  # gathered bytes, even sizes: no padding
    cap = options["bucket_cap_mb"]
    assert cap is None or sum(sizes) <= cap * MiB  # the whole model fits one bucket
    return (len(sizes) if cap is None else 1), results


@pytest.mark.spec("E2E-3", "E2E-4")
@pytest.mark.parametrize("stages", TRANSFORMER_STAGES)
def test_compiled_steps_match_eager_and_issue_the_forwards_collectives(backend, stages):
    """E2E-3's values, and E2E-4's collectives of the forward: its gathers, bucketed or as
    traced, then the logged loss's all_reduce. (The backward's count also needs E2E-2's
    partitioner, which keeps no forward collective there: the next case's.)"""
    gathers, results = _transformer_run(backend, stages)
    check_values(backend, results)
    for rank, result in enumerate(results):
        issued = [s.forward_collectives for s in result["compiled"]["steps"]]
        assert issued == [gathers + 1] * len(issued), \
            f"rank {rank}: forward collectives per step {issued}, expected {gathers + 1}"


@pytest.mark.spec("E2E-2", "E2E-3", "E2E-4")
@pytest.mark.parametrize("stages", TRANSFORMER_STAGES)
def test_transformer_training_matches_eager(backend, stages):
    gathers, results = _transformer_run(backend, stages)
    check_values(backend, results)
    # Forward: the gathers, then the logged loss's all_reduce; backward: the scatters.
    check_issued(results, gathers + 1, gathers)


# --------------------------------------------------------------------------------------
# bucket_cap_mb reaches both passes of every graph (E2E-2, E2E-4)
# --------------------------------------------------------------------------------------
CAPS = {
    "one_under_two": (2 * MEMBER_BYTES - 1) / MiB,  # every bucket holds one: no merge
    "two": 2 * MEMBER_BYTES / MiB,                  # exactly two members per bucket
    "all": 5 * MEMBER_BYTES / MiB,
}


@pytest.mark.spec("E2E-2", "E2E-4", "E2E-3")
@pytest.mark.parametrize("cap", sorted(CAPS))
def test_bucket_cap_reaches_forward_and_backward(backend, cap):
    options = {**OFF, "bucket_cap_mb": CAPS[cap]}
    results = run(backend, MLP, 3, options)
    check_values(backend, results)
    n = buckets(MLP.layers, MEMBER_BYTES, CAPS[cap])
    check_issued(results, n + 1, n)


# Five [256, 256] float32 weights of 256 KiB each, 1.25 MiB in all: more than a 1 MiB first
# bucket (DDP's habit) holds, so only a cap that is bucket_cap_mb for bucket 0 too merges
# them all into one.
WIDE_MLP = Model("mlp", dim=256, layers=5)
WIDE_MEMBER_BYTES = 256 * 256 * 4
WIDE_CAPS = {"default": 25.0, "exactly_all": 5 * WIDE_MEMBER_BYTES / MiB}


@pytest.mark.spec("E2E-2", "E2E-4", "E2E-3")
@pytest.mark.parametrize("cap", sorted(WIDE_CAPS))
def test_the_first_bucket_has_the_cap_of_every_other(backend, cap):
    """Bucket 0's cap is bucket_cap_mb like every other bucket's (E2E-2: whatever its
    index), in the forward's gathers and the backward's scatters alike: 5 members of 256
    KiB under 25 MiB or under exactly their 1.25 MiB are one bucket each way."""
    options = {**OFF, "bucket_cap_mb": WIDE_CAPS[cap]}
    results = run(backend, WIDE_MLP, 2, options)
    check_values(backend, results)
    n = buckets(WIDE_MLP.layers, WIDE_MEMBER_BYTES, WIDE_CAPS[cap])
    assert n == 1
    check_issued(results, n + 1, n)


@pytest.mark.spec("E2E-2", "E2E-4", "E2E-3")
def test_bucketing_alone_is_what_runs(backend):
    """Bucketing with lowering off: the bucketed program itself must run."""
    options = {**OFF, "bucket_cap_mb": CAPS["two"]}
    if "lowering" in backend.require("compile_backend").stages:
        options["lowering"] = None
    results = run(backend, MLP, 3, options)
    check_values(backend, results)
    n = buckets(MLP.layers, MEMBER_BYTES, CAPS["two"])
    check_issued(results, n + 1, n)


@pytest.mark.spec("E2E-2", "E2E-4", "E2E-3", "E2E-5")
def test_inference_graph_goes_through_the_stages(backend):
    """Under no_grad AOTAutograd hands over one inference graph: it is bucketed too."""
    results = run(backend, MLP, 2, {**all_stages(backend), "bucket_cap_mb": CAPS["two"]},
                  grad=False)
    check_values(backend, results)
    check_issued(results, buckets(MLP.layers, MEMBER_BYTES, CAPS["two"]) + 1, 0)
    for rank, result in enumerate(results):
        if result["stage_counts"] is not None:  # the record names it (E2E-5)
            assert list(result["stage_counts"]) == ["graph0_inference"], f"rank {rank}"


@pytest.mark.spec("E2E-2", "E2E-4", "E2E-3", "CL-10")
def test_lowering_config_reaches_the_program(backend):
    """auto_select lowers the logged loss's all_reduce (a sum of a fresh scalar) to the
    one-shot kernel on symmetric memory: the forward issues one collective less on the
    process group, and the values stay eager's."""
    options = {**OFF, "bucket_cap_mb": CAPS["two"], "lowering": {"auto_select": True}}
    results = run(backend, MLP, 3, options, symm_mem=True)
    check_values(backend, results)
    n = buckets(MLP.layers, MEMBER_BYTES, CAPS["two"])
    check_issued(results, n, n)
    for rank, result in enumerate(results):  # the record counts the kernel (E2E-5)
        if result["stage_counts"] is not None:
            lowered = result["stage_counts"]["graph0_forward"]["lowered"]
            assert lowered.get("one_shot_all_reduce") == 1, f"rank {rank}: {lowered}"
            assert "all_reduce" not in lowered and "all_reduce_" not in lowered, \
                f"rank {rank}: {lowered}"


# --------------------------------------------------------------------------------------
# debug_dir and the record of every stage (E2E-5)
# --------------------------------------------------------------------------------------
FAMILIES = {"all_gather": r"all_gather_into_tensor\w*", "reduce_scatter": r"reduce_scatter\w*",
            "all_reduce": r"(?:one_shot_)?all_reduce_?"}


def families_in_text(text: str) -> dict[str, int]:
    """Collectives per family in a canonical text, by its lines alone."""
    counts = {}
    for family, pattern in FAMILIES.items():
        n = len(re.findall(rf"= (?:funcol|symm_mem)\.{pattern}\(", text))
        if n:
            counts[family] = n
    return counts


def families_in_record(ops: dict[str, int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op, n in ops.items():
        family = next(f for f, p in FAMILIES.items() if re.fullmatch(p, op))
        counts[family] = counts.get(family, 0) + n
    return counts


def dead_nodes(text: str) -> list[str]:
    """The lines of a canonical text whose value no later line reads."""
    lines = text.splitlines()
    return [line for i, line in enumerate(lines)
            if (m := re.match(r"(%\d+) = ", line))
            and not any(re.search(rf"{m.group(1)}\b", later) for later in lines[i + 1:])]


def check_program_files(folder, program: str, where: str) -> None:
    """The memory plan and the timeline debug_dir holds for a graph describe its program,
    whose canonical text is `program` (E2E-5, MEM-1, SIM-9, SIM-10): a live byte count
    after every node (its output included), in the plan and as the trace's memory counter
    alike; one complete event per collective on a stream of its own; an SVG with a
    rectangle per event."""
    nodes = len(program.splitlines())  # one line per node, `return` the last
    collectives = sum(families_in_text(program).values())
    plan = json.loads((folder / "memory_plan.json").read_text())
    assert set(plan) >= {"peak_bytes", "peak_node", "live_bytes", "events"}, f"{where}: {plan}"
    live = plan["live_bytes"]
    assert len(live) == nodes, f"{where}: {len(live)} live byte counts for {nodes} nodes"
    assert plan["peak_bytes"] >= max(live) > 0, f"{where}: peak {plan['peak_bytes']}"
    assert plan["events"] and isinstance(plan["peak_node"], str), f"{where}: {plan}"
    trace = json.loads((folder / "timeline.json").read_text())["traceEvents"]
    counter = [e["args"]["live_bytes"] for e in trace if e["ph"] == "C"]
    assert counter == live, f"{where}: the trace's memory counter is not the plan's"
    spans = [e for e in trace if e["ph"] == "X"]
    compute_thread = next(e["tid"] for e in trace
                          if e["ph"] == "M" and e["args"].get("name") == "compute")
    on_comm = [e for e in spans if e["tid"] != compute_thread]
    assert len(on_comm) == collectives, \
        f"{where}: {len(on_comm)} events on comm streams for {collectives} collectives"
    svg = ET.fromstring((folder / "timeline.svg").read_text())
    assert svg.tag.endswith("svg"), f"{where}: {svg.tag}"
    titled = [r for r in svg.iter() if r.tag.endswith("rect")
              and any(c.tag.endswith("title") for c in r)]
    assert len(titled) == len(spans), f"{where}: {len(titled)} rectangles, {len(spans)} events"


@pytest.mark.spec("E2E-5", "E2E-2", "E2E-4")
def test_debug_dir_has_every_stage_of_every_graph(backend, tmp_path):
    options = {**all_stages(backend), "bucket_cap_mb": CAPS["two"],
               "debug_dir": str(tmp_path)}
    results = run(backend, MLP, 2, options)
    check_values(backend, results)
    n = buckets(MLP.layers, MEMBER_BYTES, CAPS["two"])
    check_issued(results, n + 1, n)
    want = {  # per graph and stage: collectives by family (reorder moves, never merges)
        "graph0_forward": {"traced": {"all_gather": 5, "all_reduce": 1},
                           "bucketed": {"all_gather": n, "all_reduce": 1},
                           "lowered": {"all_gather": n, "all_reduce": 1},
                           "reordered": {"all_gather": n, "all_reduce": 1}},
        "graph0_backward": {"traced": {"reduce_scatter": 5},
                            "bucketed": {"reduce_scatter": n},
                            "lowered": {"reduce_scatter": n},
                            "reordered": {"reduce_scatter": n}},
    }
    if options["reorder"] is None:
        for stages in want.values():
            del stages["reordered"]
    for rank, result in enumerate(results):
        folder = tmp_path / f"rank{rank}"
        assert sorted(p.name for p in folder.iterdir()) == sorted(want), f"rank {rank}"
        for graph, stages in want.items():
            texts = sorted(p.name for p in (folder / graph).glob("*.txt"))
            assert texts == [f"{i}_{stage}.txt" for i, stage in enumerate(stages)], \
                f"rank {rank} {graph}: {texts}"
            for index, (stage, counts) in enumerate(stages.items()):
                text = (folder / graph / f"{index}_{stage}.txt").read_text()
                assert families_in_text(text) == counts, f"rank {rank} {graph} {stage}"
                if result["stage_counts"] is not None:
                    recorded = families_in_record(result["stage_counts"][graph][stage])
                    assert recorded == counts, f"rank {rank} {graph} {stage}: record"
            assert not dead_nodes((folder / graph / "0_traced.txt").read_text()), \
                f"rank {rank} {graph}: traced nodes nothing reads"
            last = list(stages)[-1]
            program = (folder / graph / f"{len(stages) - 1}_{last}.txt").read_text()
            check_program_files(folder / graph, program, f"rank {rank} {graph}")
        # In place: the lowered forward reduces the loss in its own buffer (CL-3).
        lowered = (folder / "graph0_forward" / "2_lowered.txt").read_text()
        assert "funcol.all_reduce_(" in lowered and "funcol.all_reduce(" not in lowered
        if "reordered" in want["graph0_forward"]:  # the same lines, in a new order (RO-2)
            reordered = (folder / "graph0_forward" / "3_reordered.txt").read_text()
            assert len(reordered.splitlines()) == len(lowered.splitlines()), f"rank {rank}"


@pytest.mark.spec("E2E-5", "E2E-2")
def test_stages_switched_off_write_no_text(backend, tmp_path):
    results = run(backend, MLP, 1, {**OFF, "debug_dir": str(tmp_path)})
    check_values(backend, results)
    for rank in range(WORLD_SIZE):
        for graph in ("graph0_forward", "graph0_backward"):
            texts = sorted(p.name for p in (tmp_path / f"rank{rank}" / graph).glob("*.txt"))
            assert texts == ["0_traced.txt"], f"rank {rank} {graph}: {texts}"


@pytest.mark.spec("E2E-5")
def test_a_stage_switched_off_leaves_the_others_their_numbers(backend, tmp_path):
    """Bucketing off, lowering and reorder on: the texts are 0_traced, 2_lowered and
    3_reordered, so that a file's name says its stage whatever else ran."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is left in this process by another case")
    concept = backend.require("compile_backend")
    if not {"lowering", "reorder"} <= set(concept.stages):
        pytest.skip("the backend has no separate lowering and reorder stages")
    compiled = concept.make({"bucket_cap_mb": None, "lowering": {}, "reorder": {},
                             "debug_dir": str(tmp_path)})
    torch._dynamo.reset()
    try:
        assert torch.compile(lambda x: x * 2 + 1, backend=compiled)(
            torch.arange(4.0)).tolist() == [1.0, 3.0, 5.0, 7.0]
    finally:
        torch._dynamo.reset()
    texts = sorted(p.name for p in (tmp_path / "rank0" / "graph0_inference").glob("*.txt"))
    assert texts == ["0_traced.txt", "2_lowered.txt", "3_reordered.txt"], texts


@pytest.mark.spec("E2E-5")
def test_graphs_are_numbered_by_the_graphs_dynamo_handed_over(backend, tmp_path):
    """A training step compiled, run forward and backward (graph 0: its forward and its
    backward), then called on another shape, which Dynamo compiles as a second graph: its
    folders are graph1_forward and graph1_backward (`i` counts Dynamo's graphs, not the
    forward and backward graphs compiled so far)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is left in this process by another case")
    concept = backend.require("compile_backend")
    compiled = concept.make({"bucket_cap_mb": None, "debug_dir": str(tmp_path)})
    step = torch.compile(lambda x, w: (x * w).sum(), backend=compiled, dynamic=False)
    torch._dynamo.reset()
    try:
        for n in (4, 5):  # a new shape: a second Dynamo graph
            w = torch.ones(n, requires_grad=True)
            step(torch.arange(float(n)), w).backward()
            assert w.grad.tolist() == [float(i) for i in range(n)]
    finally:
        torch._dynamo.reset()
    folders = sorted(p.name for p in (tmp_path / "rank0").iterdir())
    assert folders == ["graph0_backward", "graph0_forward", "graph1_backward",
                       "graph1_forward"], folders


@pytest.mark.spec("E2E-2", "E2E-5")
def test_stages_run_in_order_and_all_reduces_are_not_bucketed(backend):
    """Two all_reduces under a cap that would hold both: bucketing leaves them as they
    are (only all_gathers and reduce_scatters are bucketed), and the record names the
    stages in the order they ran: traced, bucketed, lowered, reordered."""
    from conformance import memory_programs as mp

    concept = backend.require("compile_backend", "stage_counts")
    fc = backend.require("functional_collectives")

    def step(x, y):
        return fc.all_reduce(x, "sum", "0") + fc.all_reduce(y * 2, "sum", "0")

    torch._dynamo.reset()
    try:
        with mp.fake_world(2):  # traced and compiled here, never run on peers
            compiled = concept.make({"bucket_cap_mb": 25.0, "lowering": {}, "reorder": {}})
            torch.compile(step, backend=compiled, fullgraph=True)(torch.ones(4), torch.ones(4))
    finally:
        torch._dynamo.reset()
    counts = concept.stage_counts(compiled)
    assert list(counts) == ["graph0_inference"], counts
    stages = counts["graph0_inference"]
    assert list(stages) == ["traced", "bucketed", "lowered", "reordered"], stages
    assert families_in_record(stages["bucketed"]) == {"all_reduce": 2}, stages


def _order_sensitive_step(fc):
    """A step on which every two adjacent steps of E2E-2's order (BK-18's wait
    deduplication, the all_gather pass, the reduce_scatter pass, lowering, reorder), run
    the other way round, give another program:
    - dedup / all_gather: `a` is waited twice, so it is a candidate (BK-1) and merges with
      `b` only once the repeated wait is gone;
    - all_gather / reduce_scatter: ag2 reads rs1 and rs2 reads ag1. Gathers first, ag1
      and ag2 merge, rs2 then depends on rs1 through the merged gather and stays alone;
      scatters first, rs1 and rs2 merge and ag2 stays alone (BK-4);
    - reduce_scatter / lowering: lowering makes every wait `wait_tensor_` (CL-20), and a
      collective waited so is no candidate (BK-1): r1 and r2 merge only before lowering;
    - lowering / reorder: the lowered waits copy nothing (CL-20), so the program's peak
      (MEM-1) is lower and RO-9's budget keeps the merged reduce_scatter after the merged
      bf16 gather's wait; before lowering it is raised above that wait."""
    ops, group = fc.ops, "0"

    def step(p1, g1, p2, p3, g2, g3):
        w1 = ops.wait_tensor(ops.all_gather_into_tensor(p1, 2, group))
        w2 = ops.wait_tensor(ops.reduce_scatter_tensor(g1, "sum", 2, group))
        w3 = ops.wait_tensor(ops.all_gather_into_tensor(w2, 2, group))   # ag2 <- rs1
        w4 = ops.wait_tensor(ops.reduce_scatter_tensor(w1, "sum", 2, group))  # rs2 <- ag1
        a = ops.all_gather_into_tensor(p2, 2, group)
        twice = ops.wait_tensor(a) + ops.wait_tensor(a)
        b = ops.wait_tensor(ops.all_gather_into_tensor(p3, 2, group))
        r1 = ops.wait_tensor(ops.reduce_scatter_tensor(g2, "avg", 2, group))
        r2 = ops.wait_tensor(ops.reduce_scatter_tensor(g3, "avg", 2, group))
        return w3, w4, twice, b, r1, r2

    f32, bf16 = torch.float32, torch.bfloat16
    inputs = [torch.ones(4), torch.ones(8), torch.ones(4, dtype=bf16),
              torch.ones(4, dtype=bf16), torch.ones(8, dtype=f32), torch.ones(8)]
    return step, inputs


@pytest.mark.spec("E2E-2", "E2E-5")
def test_every_stage_runs_on_the_program_of_the_stage_before(backend, tmp_path):
    """One graph compiled with every stage on: the text after each stage (debug_dir) is
    that of the backend's own passes run in E2E-2's order on the traced graph, each once:
    deduplicate_waits, bucket_all_gather, bucket_reduce_scatter (bucketed), lower
    (lowered), reorder (reordered). The graph is one on which every adjacent pair of
    those steps, swapped, gives another program (checked here too)."""
    import copy

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from conformance import memory_programs as mp
    from conformance.canonical import canonical_graph

    concept = backend.require("compile_backend", "stage_counts")
    bucketing = backend.require("bucketing", "deduplicate_waits", "bucket_all_gather",
                                "bucket_reduce_scatter")
    lowering = backend.require("lowering", "lower", "Config")
    reordering = backend.require("reorder", "reorder", "ReorderConfig")
    fc = backend.require("functional_collectives")
    step, inputs = _order_sensitive_step(fc)
    cap = 25.0
    passes = {
        "dedup": lambda gm: (bucketing.deduplicate_waits(gm), gm)[1],
        "all_gather": lambda gm: (bucketing.bucket_all_gather(gm, lambda i: cap), gm)[1],
        "reduce_scatter": lambda gm: (bucketing.bucket_reduce_scatter(gm, lambda i: cap),
                                      gm)[1],
        "lower": lambda gm: lowering.lower(gm, lowering.Config()),
        "reorder": lambda gm: reordering.reorder(gm, reordering.ReorderConfig()),
    }
    order = list(passes)
    stage_ends = {"bucketed": 3, "lowered": 4, "reordered": 5}  # steps each stage has run

    traced = []

    def keep(gm, example_inputs):
        traced.append(gm)
        return make_boxed_func(gm)

    torch._dynamo.reset()
    try:
        with mp.fake_world(2):  # traced and compiled here, never run on peers
            torch.compile(step, backend=aot_autograd(fw_compiler=keep, inference_compiler=keep),
                          fullgraph=True)(*inputs)
            torch._dynamo.reset()
            compiled = concept.make({"bucket_cap_mb": cap, "lowering": {}, "reorder": {},
                                     "debug_dir": str(tmp_path)})
            torch.compile(step, backend=compiled, fullgraph=True)(*inputs)

            def run(steps) -> str:
                gm = copy.deepcopy(traced[0])
                for name in steps:
                    gm = passes[name](gm)
                return canonical_graph(gm)

            want = {stage: run(order[:end]) for stage, end in stage_ends.items()}
            swapped = {}
            for i in range(len(order) - 1):
                other = [*order[:i], order[i + 1], order[i], *order[i + 2:]]
                swapped[f"{order[i]} after {order[i + 1]}"] = run(other)
    finally:
        torch._dynamo.reset()
    same = [pair for pair, text in swapped.items() if text == want["reordered"]]
    assert not same, f"the case's graph no longer tells these steps' order apart: {same}"
    counts = concept.stage_counts(compiled)
    assert list(counts) == ["graph0_inference"], counts
    # ag1 + ag2 and a + b merge (two all_gather buckets); rs1 and rs2 stay apart, r1 + r2
    # merge (three reduce_scatters), in every stage after bucketing.
    bucketed = {"all_gather_into_tensor_out": 2, "reduce_scatter_tensor": 3}
    for stage in stage_ends:
        assert counts["graph0_inference"][stage] == bucketed, \
            f"{stage}: {counts['graph0_inference'][stage]}"
    folder = tmp_path / "rank0" / "graph0_inference"
    for index, (stage, text) in enumerate(want.items(), start=1):
        got = (folder / f"{index}_{stage}.txt").read_text().rstrip("\n")
        assert got == text, f"{stage}: the backend's program is not its passes' in " \
                            f"E2E-2's order:\n{got}\n--- expected ---\n{text}"


@pytest.mark.spec("E2E-5")
def test_debug_dir_without_a_process_group_is_rank0(backend, tmp_path):
    """Compiled in this process, where no process group exists: `rank0`, as for rank 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is left in this process by another case")
    compiled = backend.require("compile_backend").make({**OFF, "debug_dir": str(tmp_path)})
    torch._dynamo.reset()
    try:
        got = torch.compile(lambda x: x * 2 + 1, backend=compiled)(torch.arange(4.0))
    finally:
        torch._dynamo.reset()
    assert got.tolist() == [1.0, 3.0, 5.0, 7.0]
    assert [p.name for p in tmp_path.iterdir()] == ["rank0"]
    graphs = sorted(p.name for p in (tmp_path / "rank0").iterdir())
    assert graphs == ["graph0_inference"], graphs
    assert (tmp_path / "rank0" / "graph0_inference" / "0_traced.txt").read_text()


@pytest.mark.spec("E2E-5")
def test_graphs_of_one_backend_are_numbered_in_the_order_dynamo_hands_them_over(
        backend, tmp_path):
    """A graph break splits a function into two graphs Dynamo hands the same backend
    object one after the other: `graph0_inference`, then `graph1_inference`; a second
    call compiles nothing new."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is left in this process by another case")
    compiled = backend.require("compile_backend").make({**OFF, "debug_dir": str(tmp_path)})

    def split(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    torch._dynamo.reset()
    try:
        function = torch.compile(split, backend=compiled)
        got = [function(torch.arange(4.0)).tolist() for _ in range(2)]
    finally:
        torch._dynamo.reset()
    assert got == [[1.0, 3.0, 5.0, 7.0]] * 2
    graphs = sorted(p.name for p in (tmp_path / "rank0").iterdir())
    assert graphs == ["graph0_inference", "graph1_inference"], graphs
    first, second = ((tmp_path / "rank0" / g / "0_traced.txt").read_text() for g in graphs)
    assert "aten.mul" in first and "aten.add" not in first, first
    assert "aten.add" in second and "aten.mul" not in second, second


# --------------------------------------------------------------------------------------
# Configs (E2E-1)
# --------------------------------------------------------------------------------------
BAD_OPTIONS = {
    "cap_zero": ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb"),
    "cap_negative": ({"bucket_cap_mb": -1.0}, ValueError, "bucket_cap_mb"),
    "cap_infinite": ({"bucket_cap_mb": float("inf")}, ValueError, "bucket_cap_mb"),
    "cap_nan": ({"bucket_cap_mb": float("nan")}, ValueError, "bucket_cap_mb"),
    "cap_bool": ({"bucket_cap_mb": True}, TypeError, "bucket_cap_mb"),
    "cap_str": ({"bucket_cap_mb": "25"}, TypeError, "bucket_cap_mb"),
    "lowering_str": ({"lowering": "fast"}, TypeError, "lowering"),
    "reorder_str": ({"reorder": "fast"}, TypeError, "reorder"),
    "debug_dir_int": ({"debug_dir": 3}, TypeError, "debug_dir"),
}


@pytest.mark.spec("E2E-1")
@pytest.mark.parametrize("bad", sorted(BAD_OPTIONS))
def test_bad_config_is_refused(backend, bad):
    options, error, argument = BAD_OPTIONS[bad]
    concept = backend.require("compile_backend")
    with pytest.raises(error, match=rf"^{argument}: .*\[E2E-1\]"):
        concept.make(options)


@pytest.mark.spec("E2E-1")
@pytest.mark.parametrize("config", [None, {}, "default"], ids=["none", "dict", "str"])
def test_the_backend_takes_a_compile_config_only(backend, config):
    """`backend(config)` of anything but a CompileConfig, None included (only an omitted
    config means the default), is a TypeError naming config."""
    concept = backend.require("compile_backend", "backend_of")
    with pytest.raises(TypeError, match=r"^config: .*\[E2E-1\]"):
        concept.backend_of(config)


class _Folder(os.PathLike):
    """A path-like object that is no pathlib.Path (a user's own path type)."""

    def __init__(self, path):
        self.path = str(path)

    def __fspath__(self):
        return self.path


@pytest.mark.spec("E2E-1", "E2E-5")
def test_debug_dir_may_be_any_path_like(backend, tmp_path):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is left in this process by another case")
    compiled = backend.require("compile_backend").make(
        {**OFF, "debug_dir": _Folder(tmp_path / "debug")})
    torch._dynamo.reset()
    try:
        assert torch.compile(lambda x: x * 2, backend=compiled)(torch.ones(2)).tolist() == \
            [2.0, 2.0]
    finally:
        torch._dynamo.reset()
    assert (tmp_path / "debug" / "rank0" / "graph0_inference" / "0_traced.txt").is_file()


@pytest.mark.spec("E2E-1")
def test_smallest_cap_is_accepted(backend):
    """Any positive cap is valid, even one smaller than every collective (BK-3)."""
    backend.require("compile_backend").make({"bucket_cap_mb": 1e-9})


# --------------------------------------------------------------------------------------
# Logging (E2E-6)
# --------------------------------------------------------------------------------------
@pytest.mark.spec("E2E-6")
def test_one_info_line_per_compiled_graph_and_the_text_of_every_stage_at_debug(backend):
    """Under a root handler at DEBUG, one compiled training step logs, through the
    backend's logger and on every rank: one INFO line per compiled graph naming it and
    every stage that ran with its collectives, and at DEBUG one record per graph and stage
    holding that stage's canonical text; the backend adds no handler and sets no level."""
    backend.require("compile_backend", "logger")
    options = {"bucket_cap_mb": 25.0, "lowering": {}, "reorder": None}
    model = Model("mlp", dim=16, layers=2)
    stages = ["traced", "bucketed", "lowered"]
    for rank, result in enumerate(harness.run(backend, logged_compile, WORLD_SIZE, model, 1,
                                              options)):
        assert (result["handlers"], result["level"]) == (0, 0), \
            f"rank {rank}: the backend configured its logger: {result}"
        graphs = result["graphs"]
        assert graphs == ["graph0_forward", "graph0_backward"], f"rank {rank}: {graphs}"
        info = [m for level, m in result["records"] if level == 20]
        assert len(info) == len(graphs), f"rank {rank}: INFO lines {info}"
        for graph, line in zip(graphs, info, strict=True):
            assert line.startswith(graph + ":"), f"rank {rank}: {line!r}"
            assert all(f"{stage}:" in line for stage in stages), f"rank {rank}: {line!r}"
        assert "all_gather_into_tensor_out" in info[0].split("bucketed:")[1], info[0]
        debug = [m for level, m in result["records"] if level == 10]
        assert len(debug) == len(graphs) * len(stages), f"rank {rank}: {len(debug)} DEBUG"
        for message, (graph, stage) in zip(debug, [(g, s) for g in graphs for s in stages],
                                           strict=True):
            head, _, text = message.partition("\n")
            assert graph in head and stage in head, f"rank {rank}: {head!r}"
            assert "return" in text and ("funcol." in text or "refimpl" in text), \
                f"rank {rank}: the DEBUG record of {graph} {stage} holds no graph text"


def _aliasing_collectives_compiled(spec: str) -> list:
    """Each program with an in-place or out= collective, compiled with every stage on:
    ("refused", whether the error names the op) or ("ran", whether eager's values came)."""
    import torch.distributed as dist

    from conformance.backends import get_backend

    backend = get_backend(spec)
    fc = backend.require("functional_collectives")
    concept = backend.require("compile_backend")
    group = fc.resolve_group_name(dist.group.WORLD)
    programs = {
        "all_reduce_": lambda x: fc.ops.wait_tensor(fc.ops.all_reduce_(x * 2, "sum", group)) + 1,
        "all_gather_into_tensor_out": lambda x: fc.ops.wait_tensor(
            fc.ops.all_gather_into_tensor_out(x * 2, WORLD_SIZE, group,
                                              out=x.new_empty([2 * WORLD_SIZE]))) + 1,
    }
    outcomes = []
    for op, program in programs.items():
        x = torch.tensor([1.0, 2.0]) + dist.get_rank()
        want = program(x.clone())
        torch._dynamo.reset()
        compiled = torch.compile(program, backend=concept.make(all_stages(backend)))
        try:
            got = compiled(x.clone())
        except Exception as exc:  # torch.compile wraps the backend's error in its own class
            outcomes.append((op, "refused", op in str(exc)))
        else:
            outcomes.append((op, "ran", torch.equal(got, want)))
    return outcomes


@pytest.mark.spec("E2E-7")
def test_an_in_place_or_out_collective_is_refused_naming_it_or_computed_right(backend):
    """AOTAutograd cannot functionalize a custom op that returns an alias of its argument
    (upstream's `_c10d_functional.all_reduce_` neither): compiling `all_reduce_` or
    `all_gather_into_tensor_out` fails naming the op, or gives eager's values; never a
    wrong value, on every rank."""
    backend.require("functional_collectives")
    backend.require("compile_backend")
    for rank, outcomes in enumerate(harness.run(backend, _aliasing_collectives_compiled,
                                                WORLD_SIZE)):
        for op, what, right in outcomes:
            assert right, (f"rank {rank}: {op} " + ("was refused without naming it"
                                                     if what == "refused" else
                                                     "compiled to a wrong value"))


def _subgraph_program_compiled(spec: str) -> tuple[bool, float]:
    """flex_attention with a score_mod (a submodule the graph reads with get_attr), then an
    all_reduce of its result, under no_grad (flex_attention has no backward on a CPU):
    (whether the compiled values are eager's bits, the largest difference)."""
    import torch.distributed as dist
    from torch.nn.attention.flex_attention import flex_attention

    from conformance.backends import get_backend

    backend = get_backend(spec)
    fc = backend.require("functional_collectives")
    concept = backend.require("compile_backend")
    group = fc.resolve_group_name(dist.group.WORLD)

    def relative(score, batch, head, q, k):
        return score + (q - k) / 8

    def program(x):
        # query, key and value in buffers of their own (Inductor 2.11's CPU lowering of
        # flex_attention refuses one buffer for the three)
        attended = flex_attention(x, x * 0.5, x + 1, score_mod=relative)
        return fc.ops.wait_tensor(fc.ops.all_reduce(attended.sum(dim=-1), "sum", group))

    x = torch.randn(1, 2, 128, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    torch._dynamo.reset()
    with torch.no_grad():
        want = program(x)
        got = torch.compile(program, backend=concept.make(all_stages(backend)))(x)
    return torch.equal(got, want), (got - want).abs().max().item()


@pytest.mark.spec("E2E-3")
def test_a_higher_order_ops_subgraph_compiles_to_eagers_values(backend):
    """A graph that holds code as well as tensors: flex_attention's score_mod is a
    submodule read by get_attr, with no meta['val']. Compiled with every stage on, it runs
    and gives eager's values on every rank (bit for bit on a backend that runs the traced
    ATen ops as they are). torchtitan's llama3 found refimpl's reorder and memory plan
    refusing such graphs."""
    exact = backend.require("compile_backend").exact
    backend.require("functional_collectives")
    for rank, (same, largest) in enumerate(harness.run(backend, _subgraph_program_compiled,
                                                       WORLD_SIZE)):
        if exact:
            assert same, f"rank {rank}: compiled differs from eager by up to {largest}"
        else:
            assert largest <= 1e-4, f"rank {rank}: compiled differs from eager by {largest}"


@pytest.mark.spec("E2E-8", "RO-6")
def test_a_collective_stays_behind_an_opaque_communication_op(backend):
    """An in-place communication op no compiler knows, then an all_reduce of a value
    computed before it: compiled with every stage on, the op still runs before the
    all_reduce is issued, as eagerly, on every rank; the values are eager's."""
    backend.require("functional_collectives")
    backend.require("compile_backend")
    options = all_stages(backend)
    if options["reorder"] is not None:  # room to move: only the barrier may hold it back
        options["reorder"] = {"memory_budget": 10.0}
    for rank, result in enumerate(harness.run(backend, opaque_then_collective_on_rank,
                                              WORLD_SIZE, options)):
        assert result["eager"] == [0], f"rank {rank}: eager {result['eager']}"
        assert result["compiled"] == result["eager"], (
            f"rank {rank}: the opaque op found {result['compiled']} collectives of the "
            f"call already issued, eagerly {result['eager']}: a collective moved above it "
            f"[E2E-8]")
        assert result["same"], f"rank {rank}: compiled values differ from eager's"
