"""From model to program: a `torch.compile` backend that runs refimpl's stages end to end.

`torch.compile(step, backend=backend(CompileConfig(...)))` hands every graph that Dynamo
captures to AOTAutograd, which traces it into a forward and a backward graph of ATen ops
and functional collectives (an inference graph when nothing needs a gradient). Each of
those graphs then goes through the stages in a fixed order, each stage a pass of its own
module with its own config: bucketing (all_gathers, then reduce_scatters, every bucket
capped at `bucket_cap_mb`), comm lowering (`lowering`) and reorder (`reorder`). A stage
whose config is `None` is skipped. What runs is the last stage's FX program, eagerly, on
the real process group: nothing else compiles it (E2E-1..E2E-4).

`debug_dir` keeps, per rank and per compiled graph, the canonical text after every stage
that ran, and the memory plan and simulated timeline of the final program, so that a
reader can diff one stage against the next (E2E-5). Logging goes to `refimpl.compile` only (E2E-6).

Under `CI=1` (torch 2.13) AOTAutograd runs each program's first call under a check that
no custom op claiming to be functional returns an alias of its input. The program holds
refimpl_c10d's functional ops (fresh results; `wait_tensor` copies, FC-5), the in-place
kernels lowering chose (`all_reduce_`, `all_gather_into_tensor_out`: their schemas
declare the alias, which the check accepts) and one-shot kernels (fresh results), so it
passes the check in its strict form; every test runs under it.

A program that calls an aliasing collective fails naming the op or gives eager's values
(E2E-7); collectives keep their place against every barrier op of RO-6 (E2E-8).

Implements SPEC.md section "End to end": E2E-1 .. E2E-8.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx

from refimpl import comm_ops
from refimpl._errors import refuse, require, require_type
from refimpl.bucketing import bucket_all_gather, bucket_reduce_scatter, deduplicate_waits
from refimpl.comm_lowering import CommLoweringConfig, lower
from refimpl.memory import plan_memory
from refimpl.reorder import ReorderConfig, reorder
from refimpl.simulator import CostModel, simulate

__all__ = ["CompileConfig", "CompiledGraph", "RefimplBackend", "backend", "collective_counts",
           "STAGES"]

logger = logging.getLogger("refimpl.compile")

# The stages in the order they run; the number in a debug file's name is the index here.
STAGES = ("traced", "bucketed", "lowered", "reordered")


@dataclass(frozen=True)
class CompileConfig:
    """What the backend runs on every graph (E2E-1).

    bucket_cap_mb: the cap in MiB of every bucket of both bucketing passes (all_gather
        and reduce_scatter, BK-3); None: no bucketing.
    lowering: the CommLoweringConfig of the comm-lowering stage; None: no lowering (the
        traced, or bucketed, functional program runs as it is).
    reorder: the ReorderConfig of the reorder stage (RO); None: no reorder.
    debug_dir: a folder for the canonical text of every stage, the memory plan and the
        simulated timeline of every compiled graph (E2E-5); None: nothing is written.
    """

    bucket_cap_mb: float | None = 25.0
    lowering: CommLoweringConfig | None = CommLoweringConfig()
    reorder: ReorderConfig | None = ReorderConfig()
    debug_dir: str | os.PathLike | None = None

    def __post_init__(self):
        _check_cap(self.bucket_cap_mb)
        require_type(self.lowering, (CommLoweringConfig, type(None)), "lowering",
                     "a CommLoweringConfig or None", "E2E-1")
        require_type(self.reorder, (ReorderConfig, type(None)), "reorder",
                     "a ReorderConfig or None", "E2E-1")
        require_type(self.debug_dir, (str, os.PathLike, type(None)), "debug_dir",
                     "a path or None", "E2E-1")


def _check_cap(cap) -> None:
    """A bucket cap is None or a positive, finite number of MiB (E2E-1)."""
    if cap is None:
        return
    if isinstance(cap, bool) or not isinstance(cap, (int, float)):
        refuse("bucket_cap_mb", "a number of MiB or None", type(cap).__name__, "E2E-1",
               TypeError)
    require(math.isfinite(cap) and cap > 0, "bucket_cap_mb",
            "a positive, finite number of MiB", repr(cap), "E2E-1")


# --------------------------------------------------------------------------------------
# The stages (E2E-2). Each takes a GraphModule with fake values and returns the next one.
# --------------------------------------------------------------------------------------
def _bucket_stage(gm: torch.fx.GraphModule, cap_mb: float) -> torch.fx.GraphModule:
    """Repeated waits removed (BK-18: a collective waited twice becomes a candidate), then
    both bucketing passes, in place: all_gathers first, then reduce_scatters (BK).

    The code is regenerated once, after both passes: AOTAutograd's lazy GraphModules
    would do it at their first call, a make_fx graph would keep running its old code.
    """
    cap = lambda bucket_index: cap_mb
    deduplicate_waits(gm, recompile=False)
    bucket_all_gather(gm, cap, recompile=False)
    bucket_reduce_scatter(gm, cap, recompile=False)
    gm.recompile()
    return gm


def _lower_stage(gm: torch.fx.GraphModule, config: CommLoweringConfig) -> torch.fx.GraphModule:
    return lower(gm, config)


def _reorder_stage(gm: torch.fx.GraphModule, config: ReorderConfig) -> torch.fx.GraphModule:
    return reorder(gm, config)


def _stages(config: CompileConfig) -> list[tuple[str, object]]:
    """(stage, function of gm) for every stage the config switches on, in order."""
    stages = []
    if config.bucket_cap_mb is not None:
        stages.append(("bucketed", lambda gm: _bucket_stage(gm, config.bucket_cap_mb)))
    if config.lowering is not None:
        stages.append(("lowered", lambda gm: _lower_stage(gm, config.lowering)))
    if config.reorder is not None:
        stages.append(("reordered", lambda gm: _reorder_stage(gm, config.reorder)))
    return stages


# --------------------------------------------------------------------------------------
# What a compiled graph looks like at each stage
# --------------------------------------------------------------------------------------
def collective_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    """How many of each communicating op `gm` issues per run, by op name (no waits): the
    collectives and blocking kernels of the catalogue (refimpl/comm_ops.py), and the
    symmetric-memory kernels of upstream that it leaves out, which communicate too."""
    counts: Counter = Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        row = comm_ops.find(node.target)
        if row is not None and row.family != "wait":
            counts[row.name] += 1
        elif row is None and _upstream_symm_mem_kernel(node.target):
            counts[comm_ops.qualified_name(node.target)[1]] += 1
    return dict(sorted(counts.items()))


def _upstream_symm_mem_kernel(target) -> bool:
    return comm_ops.not_modelled(target) is not None and target.namespace == "symm_mem"


@dataclass
class CompiledGraph:
    """One graph AOTAutograd handed to the backend: its name, its collectives after every
    stage that ran, and the program that runs."""

    name: str  # "graph0_forward", "graph0_backward", "graph1_inference", ...
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # stage -> op -> count
    program: torch.fx.GraphModule | None = None
    seconds: float = 0.0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _DebugWriter:
    """The files of one compiled graph under debug_dir/rank<r>/<graph name>/ (E2E-5)."""

    def __init__(self, debug_dir, name: str):
        self.folder = Path(debug_dir) / f"rank{_rank()}" / name
        self.folder.mkdir(parents=True, exist_ok=True)

    def stage(self, stage: str, gm: torch.fx.GraphModule) -> None:
        from refimpl.canonical import canonical_graph

        path = self.folder / f"{STAGES.index(stage)}_{stage}.txt"
        path.write_text(canonical_graph(gm) + "\n")

    def program(self, gm: torch.fx.GraphModule) -> None:
        """The memory plan and the simulated timeline of the program that runs."""
        plan = plan_memory(gm)
        record = {"peak_bytes": plan.peak_bytes, "peak_node": str(plan.peak_node),
                  "live_bytes": list(plan.live_bytes),
                  "events": [str(e) for e in plan.events]}
        (self.folder / "memory_plan.json").write_text(json.dumps(record, indent=1))
        timeline = simulate(gm, CostModel())
        timeline.to_chrome_trace(str(self.folder / "timeline.json"))
        timeline.to_svg(str(self.folder / "timeline.svg"))


def _describe(counts: dict[str, dict[str, int]]) -> str:
    def one(c):
        return ", ".join(f"{n} {op}" for op, n in c.items()) or "no collectives"

    return "; ".join(f"{stage}: {one(c)}" for stage, c in counts.items())


# --------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------
# AOTAutograd's compiler arguments and the names their graphs get.
_AOT_COMPILERS = {"fw_compiler": "forward", "bw_compiler": "backward",
                  "inference_compiler": "inference"}


def _partition(joint_module, joint_inputs, **kwargs):
    """AOTAutograd's default partitioner, minus the forward's collectives it copies into
    the backward (E2E-2).

    The partitioner copies into the backward every forward node whose inputs the backward
    has, and keeps there what has side effects: every refimpl_c10d op does (FC-33), so a
    forward collective on a value the backward recomputes (a logged loss) would be issued
    twice per step. A collective, wait or blocking kernel (any op with a row in
    refimpl/comm_ops.py) the joint graph tagged as forward, and that nothing in the
    backward reads, is dropped from the backward: the forward issues it.
    """
    from torch._functorch.partitioners import default_partition

    forward, backward = default_partition(joint_module, joint_inputs, **kwargs)
    for node in reversed(list(backward.graph.nodes)):
        if (comm_ops.node_op(node) is not None and not node.users
                and node.meta.get("partitioner_tag") == "is_forward"):
            backward.graph.erase_node(node)
    backward.graph.eliminate_dead_code()  # what computed only their inputs
    backward.recompile()
    return forward, backward


class RefimplBackend:
    """A torch.compile backend: AOTAutograd, then refimpl's stages on every graph (E2E-2).

    `graphs` lists every graph compiled so far (forward, backward, inference), in the
    order AOTAutograd handed them over (a backward graph is compiled at its first use).
    """

    def __init__(self, config: CompileConfig):
        require_type(config, CompileConfig, "config", "a CompileConfig", "E2E-1")
        self.config = config
        self.graphs: list[CompiledGraph] = []
        self._dynamo_graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        index = self._dynamo_graphs
        self._dynamo_graphs += 1
        compilers = {arg: self._compiler(f"graph{index}_{kind}")
                     for arg, kind in _AOT_COMPILERS.items()}
        return aot_autograd(**compilers, partition_fn=_partition)(gm, example_inputs)

    def _compiler(self, name: str):
        from torch._functorch.aot_autograd import make_boxed_func

        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            return make_boxed_func(self.run_stages(gm, name))

        return compile_graph

    def run_stages(self, gm: torch.fx.GraphModule, name: str) -> torch.fx.GraphModule:
        """The program that runs for `gm`: every stage of the config, in order (E2E-2)."""
        start = time.perf_counter()
        record = CompiledGraph(name)
        writer = (_DebugWriter(self.config.debug_dir, name)
                  if self.config.debug_dir is not None else None)
        self._observe(record, writer, "traced", gm)
        for stage, run in _stages(self.config):
            gm = run(gm)
            self._observe(record, writer, stage, gm)
        if writer is not None:
            writer.program(gm)
        record.program, record.seconds = gm, time.perf_counter() - start
        self.graphs.append(record)
        logger.info("%s: %s (%.2f s)", name, _describe(record.counts), record.seconds)
        return gm

    @staticmethod
    def _observe(record: CompiledGraph, writer, stage: str, gm: torch.fx.GraphModule):
        record.counts[stage] = collective_counts(gm)
        if writer is not None:
            writer.stage(stage, gm)
        if logger.isEnabledFor(logging.DEBUG):
            from refimpl.canonical import canonical_graph

            logger.debug("%s after %s:\n%s", record.name, stage, canonical_graph(gm))


def backend(config: CompileConfig = CompileConfig()) -> RefimplBackend:
    """A torch.compile backend running refimpl's stages with `config` (E2E-1)."""
    return RefimplBackend(config)
