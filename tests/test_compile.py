"""refimpl.compile end to end: training steps on 2 and 4 gloo ranks, debug_dir, logging,
configs (E2E-1 .. E2E-6). The backend-neutral cases are in conformance/cases/test_e2e.py.

Every training run uses the transformer of conformance/e2e_programs.py, 5 steps, eager
against compiled, under AOTAutograd's strict custom-op aliasing check (root conftest.py,
as CI=1 selects).
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
import torch.distributed as dist

from conformance.e2e_programs import Model, compare_on_rank, sharded_step
from refimpl.comm_lowering import CommLoweringConfig
from refimpl.compile import STAGES, CompileConfig, backend
from refimpl.multiprocess import run_on_ranks
from refimpl.reorder import ReorderConfig

TRANSFORMER = Model("transformer")
PARAMETERS = 15  # the transformer's 2 layers: embed, 6 per layer, norm, head
OFF = {"bucket_cap_mb": None, "lowering": None}
ALL = {"bucket_cap_mb": 25.0, "lowering": {}}
ONE_SHOT = {"bucket_cap_mb": 25.0, "lowering": {"auto_select": True}}


def _train(options, symm_mem=False, steps=5):
    import torch._functorch.config  # not loaded by `import torch` alone

    # The strict check on: conftest.py's environment variable turns it on from torch 2.13,
    # whose config reads it; torch 2.11 and 2.12 have the option but not the variable.
    torch._functorch.config.error_on_custom_op_aliasing = True
    return compare_on_rank("refimpl", TRANSFORMER, steps, options, symm_mem=symm_mem)


def _losses(run):
    return torch.tensor([s.loss for s in run["steps"]], dtype=torch.float64)


def _issued(run):
    return {(s.forward_collectives, s.backward_collectives) for s in run["steps"]}


@pytest.mark.parametrize("world_size,stages", [
    (2, "off"), (2, "one_shot"), pytest.param(4, "off", marks=pytest.mark.slow), (4, "all")])
def test_five_steps_give_eager_bits(world_size, stages):
    """E2E-3: losses and parameters bit for bit, every stage off and every stage on
    (with one-shot all-reduce of the logged loss on 2 ranks, where it adds like gloo)."""
    options = {"off": OFF, "all": ALL, "one_shot": ONE_SHOT}[stages]
    results = run_on_ranks(_train, world_size, options, stages == "one_shot", timeout=600)
    for rank, r in enumerate(results):
        assert torch.equal(_losses(r["eager"]), _losses(r["compiled"])), rank
        for want, got in zip(r["eager"]["shards"], r["compiled"]["shards"], strict=True):
            assert torch.equal(want, got), rank
        # E2E-4: eager gathers every parameter and all_reduces the loss; one bucket each
        # when bucketed; the one-shot loss reduction leaves the process group.
        expected = {"off": (PARAMETERS + 1, PARAMETERS), "all": (2, 1),
                    "one_shot": (1, 1)}[stages]
        assert _issued(r["compiled"]) == {expected}, (rank, _issued(r["compiled"]))
        assert _issued(r["eager"]) == {(PARAMETERS + 1, PARAMETERS)}


def test_one_shot_on_4_ranks_differs_only_in_the_logged_loss():
    """E2E-3: on 4 ranks the one-shot kernel adds the logged loss in rank order and gloo
    in its own, so only that logged value may differ, in its last bits; parameters,
    which never pass through it, stay bitwise."""
    for rank, r in enumerate(run_on_ranks(_train, 4, ONE_SHOT, True, timeout=600)):
        want, got = _losses(r["eager"]), _losses(r["compiled"])
        torch.testing.assert_close(got, want, rtol=4 * 2.0**-24, atol=0)
        for w, g in zip(r["eager"]["shards"], r["compiled"]["shards"], strict=True):
            assert torch.equal(w, g), rank


# --------------------------------------------------------------------------------------
# debug_dir (E2E-5)
# --------------------------------------------------------------------------------------
_COLLECTIVE_LINE = re.compile(r"= (?:funcol|symm_mem)\.(\w+)\(")


def _parsed_counts(text: str) -> dict[str, int]:
    """Collectives of a canonical text, read back from its lines (waits and comm-buffer
    allocations excluded)."""
    counts: dict[str, int] = {}
    for op in _COLLECTIVE_LINE.findall(text):
        if not op.startswith("wait_tensor") and op not in ("barrier", "empty_strided_p2p"):
            counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items()))


def _train_with_debug_dir(debug_dir):
    return compare_on_rank("refimpl", TRANSFORMER, 2, {**ONE_SHOT, "debug_dir": debug_dir},
                           symm_mem=True)


def test_debug_dir_texts_parse_back_to_the_collectives(tmp_path):
    """E2E-5: one folder per rank and graph, one text per stage; each text's collectives
    are the backend's record of that stage, and the last stage's are what ran."""
    results = run_on_ranks(_train_with_debug_dir, 2, str(tmp_path), timeout=600)
    for rank, r in enumerate(results):
        folder = tmp_path / f"rank{rank}"
        graphs = sorted(p.name for p in folder.iterdir())
        assert graphs == ["graph0_backward", "graph0_forward"]
        for graph in graphs:
            texts = sorted(p.name for p in (folder / graph).glob("*.txt"))
            assert texts == [f"{i}_{s}.txt" for i, s in enumerate(STAGES)]
            for i, stage in enumerate(STAGES):
                parsed = _parsed_counts((folder / graph / f"{i}_{stage}.txt").read_text())
                assert parsed == r["stage_counts"][graph][stage], (rank, graph, stage)
        forward = r["stage_counts"]["graph0_forward"]
        assert forward["traced"] == {"all_gather_into_tensor": PARAMETERS, "all_reduce": 1}
        assert forward["lowered"] == {"all_gather_into_tensor_out": 1,
                                      "one_shot_all_reduce": 1}
        backward = r["stage_counts"]["graph0_backward"]
        assert backward["traced"] == {"reduce_scatter_tensor": PARAMETERS}
        assert backward["lowered"] == {"reduce_scatter_tensor": 1}
        # What ran on the process group: the last stages' collectives but the one-shot.
        assert _issued(r["compiled"]) == {(1, 1)}


def test_debug_dir_has_the_memory_plan_and_the_timeline(tmp_path):
    """E2E-5: the final program's memory plan and simulated timeline, per graph."""
    run_on_ranks(_train_with_debug_dir, 2, str(tmp_path), timeout=600)
    for graph in ("graph0_forward", "graph0_backward"):
        folder = tmp_path / "rank0" / graph
        plan = json.loads((folder / "memory_plan.json").read_text())
        assert plan["peak_bytes"] > 0 and plan["live_bytes"]
        assert json.loads((folder / "timeline.json").read_text())
        assert (folder / "timeline.svg").read_text().lstrip().startswith(("<svg", "<?xml"))


# --------------------------------------------------------------------------------------
# The stages on a graph that is not AOTAutograd's (E2E-2), logging (E2E-6)
# --------------------------------------------------------------------------------------
def _make_fx_step_through_stages():
    """Bucketing alone on a make_fx graph (not a lazy GraphModule): its code must be the
    bucketed graph's, and running it issues one all_gather for all parameters."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import refimpl.functional_collectives as fc
    from conformance.e2e_programs import batch, initial_parameters, shard_of

    model = Model("mlp", dim=16, layers=3)
    shards = [shard_of(p, dist.get_rank(), 2) for p in initial_parameters(model).values()]
    inputs, targets = batch(model, dist.get_rank(), 0)
    step = lambda x, y, *shards: sharded_step(fc, model, dist.group.WORLD, 2, list(shards),
                                              x, y)
    args = (inputs, targets, *shards)
    gm = make_fx(step, tracing_mode="fake")(*args)
    want = [t.clone() for t in gm(*args)]  # eager waits through the op: plain tensors
    compiled = backend(CompileConfig(lowering=None))
    program = compiled.run_stages(gm, "graph0_forward")
    seq = dist.group.WORLD._get_sequence_number_for_group
    before = seq()
    got = program(*args)
    return (seq() - before, "all_gather_into_tensor_out" in program.code,
            all(torch.equal(w, g) for w, g in zip(want, got, strict=True)))


def test_stages_on_a_make_fx_graph_regenerate_its_code():
    for issued, bucketed_code, equal in run_on_ranks(_make_fx_step_through_stages, 2):
        assert (issued, bucketed_code, equal) == (2, True, True)


def _waited_twice_through_the_bucketed_stage():
    """A collective waited twice is no candidate (BK-1) until its second wait goes (BK-18):
    the bucketed stage removes it first, then merges all three all_gathers."""
    import refimpl.functional_collectives as fc
    from conformance.bucketing_programs import collective_count, trace, waited_twice

    step, inputs = waited_twice(fc, torch.float32)
    gm = trace(step, inputs)
    want = gm(*[t.clone() for t in inputs])
    program = backend(CompileConfig(lowering=None, reorder=None)).run_stages(gm, "graph0")
    got = program(*[t.clone() for t in inputs])
    return collective_count(program), all(torch.equal(w, g) for w, g in zip(want, got,
                                                                             strict=True))


def test_the_bucketed_stage_removes_repeated_waits_before_bucketing():
    for merged, equal in run_on_ranks(_waited_twice_through_the_bucketed_stage, 2):
        assert (merged, equal) == (1, True)


def _logged_records():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.name, record.levelno, record.getMessage()))

    handler = Keep(level=logging.DEBUG)
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.DEBUG)
    try:
        compare_on_rank("refimpl", Model("mlp", dim=16, layers=2), 1, ALL)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    return [r for r in records if r[0].startswith("refimpl.compile")], \
        logging.getLogger("refimpl.compile").handlers


def test_logging_goes_to_refimpl_compile():
    """E2E-6: one INFO line per compiled graph with its collectives after every stage;
    DEBUG lines carry each stage's canonical text; no handler of its own."""
    records, handlers = run_on_ranks(_logged_records, 2)[0]
    assert handlers == []
    assert {name for name, _, _ in records} == {"refimpl.compile"}
    info = [msg for _, level, msg in records if level == logging.INFO]
    assert len(info) == 2
    assert info[0].startswith("graph0_forward: traced: 2 all_gather_into_tensor, "
                              "1 all_reduce; bucketed: 1 all_gather_into_tensor_out, "
                              "1 all_reduce; lowered: 1 all_gather_into_tensor_out, "
                              "1 all_reduce_; reordered: 1 all_gather_into_tensor_out, "
                              "1 all_reduce_ ("), info[0]
    assert info[1].startswith("graph0_backward: traced: 2 reduce_scatter_tensor; "
                              "bucketed: 1 reduce_scatter_tensor; lowered: "
                              "1 reduce_scatter_tensor; reordered: 1 reduce_scatter_tensor ("),\
        info[1]
    debug = [msg for _, level, msg in records if level == logging.DEBUG]
    assert [m.split("\n", 1)[0] for m in debug] == [
        f"graph0_{kind} after {stage}:" for kind in ("forward", "backward")
        for stage in STAGES]


# --------------------------------------------------------------------------------------
# Configs (E2E-1)
# --------------------------------------------------------------------------------------
def test_default_config():
    config = CompileConfig()
    assert (config.bucket_cap_mb, config.lowering, config.reorder, config.debug_dir) == \
        (25.0, CommLoweringConfig(), ReorderConfig(), None)
    assert backend().config == config


@pytest.mark.parametrize("kwargs,error,argument", [
    ({"reorder": object()}, TypeError, "reorder"),
    ({"reorder": {"memory_budget": 0.1}}, TypeError, "reorder"),
    ({"lowering": {"auto_select": True}}, TypeError, "lowering"),
    ({"bucket_cap_mb": 0.0}, ValueError, "bucket_cap_mb"),
    ({"bucket_cap_mb": False}, TypeError, "bucket_cap_mb"),
    ({"debug_dir": b"bytes"}, TypeError, "debug_dir"),
])
def test_bad_configs_name_their_field(kwargs, error, argument):
    with pytest.raises(error, match=rf"^{argument}: .*\[E2E-1\]"):
        CompileConfig(**kwargs)


def test_backend_refuses_anything_but_a_compile_config():
    with pytest.raises(TypeError, match=r"^config: expected a CompileConfig, got dict"):
        backend({"bucket_cap_mb": 1.0})
    with pytest.raises(TypeError, match=r"^config: "):
        backend(None)


@pytest.mark.slow  # second tier: Inductor compiles the model (about 20 s on 2 busy cores)
def test_the_example_trains_and_prints_the_losses_side_by_side():
    """examples/fsdp_train.py, without Inductor (its compile takes ~30 s on 2 cores)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "examples/fsdp_train.py", "--ranks", "2",
                           "--steps", "2", "--no-inductor"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("[refimpl ] step") for line in lines) == 2
    assert "refimpl: losses and parameters equal eager's bit for bit" in lines


def _attention_then_all_reduce():
    from torch.distributed import _functional_collectives as fc
    from torch.nn.attention.flex_attention import flex_attention

    def relative(score, batch, head, q, k):  # a score_mod: flex_attention's subgraph
        return score + (q - k) / 8

    def program(x):
        attended = flex_attention(x, x, x, score_mod=relative)
        return fc.wait_tensor(fc.all_reduce(attended.sum(dim=-1), "sum", dist.group.WORLD))

    x = torch.randn(1, 2, 128, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    with torch.no_grad():  # flex_attention has no backward on a CPU
        eager = program(x)
        compiled = torch.compile(program, backend=backend(CompileConfig(
            bucket_cap_mb=25.0, lowering=CommLoweringConfig(), reorder=ReorderConfig())))(x)
    return torch.equal(eager, compiled)


def test_a_higher_order_ops_subgraph_goes_through_every_stage():
    """flex_attention's score_mod is a submodule the graph reads with get_attr: code, with
    no meta['val']. Every stage takes it (reorder and the memory plan refused the graph
    until torchtitan's llama3 showed it, issue 45), and the values are eager's bits."""
    assert run_on_ranks(_attention_then_all_reduce, 2) == [True, True]
