"""torchtitan's compile passes (torchtitan 0.3.0, a client nobody here wrote), judged as a
backend with `--backend` (conformance/README.md, "Judging your implementation";
benchmarks/results/clients.md holds the verdicts).

    pip install -e '.[clients]'
    python -m conformance --section RO --section E2E \\
        --backend conformance.backends.torchtitan_backend:backend

torchtitan's graph trainer (`torchtitan.experiments.graph_trainer`) compiles with
upstream's collectives and passes of its own over their FX graphs:

- `reorder`: `fsdp_passes.autobucketing_reordering_pass`, the pass its JIT mode runs on the
  forward and backward graphs (`passes=["auto_bucketing"]`): upstream's overlap scheduler
  with collective bucketing switched on, so it buckets as it reorders;
- `compile_backend`: the backend `jit_backend.get_compile_backend_with_passes` returns for
  `GraphTrainerCompileConfig(backend="aot_eager", passes=["auto_bucketing"])`, that pass on
  both graphs of AOTAutograd's `aot_eager` (no Inductor: values are eager's arithmetic);
- `functional_collectives`: upstream's (torchtitan adds none; the FC section judges torch).

What cannot be judged here, each `not implemented` with its reason: bucketing alone
(torchtitan buckets only inside the scheduler above, or by module plans
(`transformer_block_bucketing`, `FSDPParamOrderBucketer`) that need the module names of its
own tracer), lowering, symmetric memory, memory planning, the simulator.

The one change for a CPU: upstream's scheduler estimates compute with a roofline that asks
a GPU for its memory bandwidth (`get_gpu_dram_gbps` through triton, which fails without a
GPU driver). For the call, as the `torch` backend's reorder adapter does, compute and
collective durations come from refimpl.simulator's `CostModel` (the case's, for `reorder`;
the default one inside `compile_backend`). Nothing of torchtitan's pass is changed.
"""

from __future__ import annotations

import inspect
import types

from conformance.backends import Backend, NotImplementedConcept
from conformance.backends.torch_backend import backend as torch_backend
from conformance.backends.torch_reorder import copy_graph, estimates, roofline

TORCHTITAN_PASS = "torchtitan.experiments.graph_trainer.fsdp_passes"


def _fsdp_passes():
    import importlib

    try:
        return importlib.import_module(TORCHTITAN_PASS)
    except ImportError as exc:
        raise NotImplementedConcept(f"torchtitan: {exc} (pip install -e '.[clients]')") \
            from None


_cost_model = None  # the durations the scheduler is given (None: CostModel())


def fsdp_passes_on_a_cpu():
    """torchtitan's pass module, its call of upstream's scheduler given the durations of
    `_cost_model` for every node (compute through the roofline, collectives through
    `custom_runtime_estimation`). Installed once per process and left in place: AOTAutograd
    compiles the backward graph at the first backward, after the backend returned."""
    passes = _fsdp_passes()
    if getattr(passes.schedule_overlap_bucketing, "refimpl_cpu_estimates", False):
        return passes
    upstream = passes.schedule_overlap_bucketing
    accepted = inspect.signature(upstream).parameters

    def scheduled(gm, **kwargs):
        from refimpl.simulator import CostModel

        durations_ms, estimated = estimates(gm, _cost_model or CostModel())
        kwargs = {**{k: v for k, v in estimated.items() if k in accepted}, **kwargs}
        with roofline(durations_ms):
            return upstream(gm, **kwargs)

    scheduled.refimpl_cpu_estimates = True
    passes.schedule_overlap_bucketing = scheduled
    return passes


# ---- reorder ----------------------------------------------------------------------------
def reorder(gm, config):
    """torchtitan's auto-bucketing pass on a copy of `gm`. Its only knob is the graph:
    the config's memory budget and in-flight limits have no counterpart in it."""
    from refimpl.reorder import ReorderConfig
    from refimpl.simulator import CostModel

    config = config if config is not None else ReorderConfig()
    asked = (["max_in_flight"] if config.max_in_flight else []) + \
        (["memory_budget"] if config.memory_budget is not None else [])
    if asked:
        raise NotImplementedConcept(f"torchtitan: its auto-bucketing pass has no {asked}")
    global _cost_model
    gm = copy_graph(gm)
    passes = fsdp_passes_on_a_cpu()
    _cost_model = config.cost_model or CostModel()
    try:
        return passes.autobucketing_reordering_pass(gm)
    finally:
        _cost_model = None


def _reorder_concept():
    from refimpl.reorder import ReorderConfig
    from refimpl.simulator import CostModel

    return types.SimpleNamespace(reorder=reorder, ReorderConfig=ReorderConfig,
                                 CostModel=CostModel)


# ---- compile_backend --------------------------------------------------------------------
def make(options: dict):
    """torchtitan's JIT backend (aot_eager + auto_bucketing). Its pass buckets and reorders
    together, sized by upstream's scheduler: it cannot be switched off, takes no bucket cap
    (the default 25 MB is read as "the backend's own bucketing") and no reorder options;
    it has no lowering and no debug output. Asking for any of these is not implemented."""
    options = dict(options)
    cap, reorder = options.pop("bucket_cap_mb", None), options.pop("reorder", None)
    if cap is None or reorder is None:
        raise NotImplementedConcept("torchtitan: compile_backend: its auto-bucketing pass "
                                    "buckets and reorders together and cannot be switched "
                                    "off")
    if cap != 25.0:
        raise NotImplementedConcept(f"torchtitan: compile_backend: no bucket cap (asked "
                                    f"{cap!r} MB); its scheduler sizes buckets itself")
    if reorder != {}:
        raise NotImplementedConcept(f"torchtitan: compile_backend: no reorder options "
                                    f"(asked {reorder!r})")
    asked = sorted(k for k, v in options.items() if v is not None)
    if asked:
        raise NotImplementedConcept(f"torchtitan: compile_backend: no option {asked}")
    fsdp_passes_on_a_cpu()
    return _compile


def _compile(gm, example_inputs):
    from torchtitan.experiments.graph_trainer.configs import GraphTrainerCompileConfig
    from torchtitan.experiments.graph_trainer.jit_backend import (
        get_compile_backend_with_passes,
    )

    config = GraphTrainerCompileConfig(backend="aot_eager", passes=["auto_bucketing"])
    return get_compile_backend_with_passes(config, None)(gm, example_inputs)


def _compile_concept():
    return types.SimpleNamespace(make=make, exact=True, stages=("bucketing", "reorder"),
                                 stage_counts=None, logger=None)


def _make() -> Backend:
    return Backend("torchtitan", {
        "functional_collectives": torch_backend.require("functional_collectives"),
        "bucketing": None,
        "lowering": None,
        "reorder": _reorder_concept(),
        "memory": None,
        "simulator": None,
        "symmetric_memory": None,
        "compile_backend": _compile_concept(),
    }, notes={"bucketing": "torchtitan buckets inside its overlap scheduler (reorder) or by "
                           "module plans that need its own tracer's module names",
              "lowering": "torchtitan has no lowering of collectives",
              "memory": "torchtitan plans no memory of its own",
              "simulator": "torchtitan has no simulator",
              "symmetric_memory": "torchtitan has no symmetric memory"})


backend = _make()
