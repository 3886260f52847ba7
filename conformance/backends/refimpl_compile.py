"""The "compile_backend" concept of the `refimpl` backend: refimpl.compile behind the
backend-neutral options the E2E cases give (see `concept()` and conformance/README.md)."""

from __future__ import annotations

import types


def make(options: dict):
    """A torch.compile backend for `options`: bucket_cap_mb (float or None), lowering (a
    dict of CommLoweringConfig fields, or None), reorder (a dict of ReorderConfig fields,
    or None), debug_dir (path or None). A value that is not a dict is handed to
    CompileConfig as it is (to check refusals)."""
    from refimpl.comm_lowering import CommLoweringConfig
    from refimpl.compile import CompileConfig, backend
    from refimpl.reorder import ReorderConfig

    options = dict(options)
    lowering = options.pop("lowering", {})
    if isinstance(lowering, dict):
        lowering = CommLoweringConfig(**lowering)
    reorder = options.pop("reorder", {})
    if isinstance(reorder, dict):
        reorder = ReorderConfig(**reorder)
    return backend(CompileConfig(lowering=lowering, reorder=reorder, **options))


def stage_counts(compiled) -> dict:
    """{graph name: {stage: {op: count}}} of every graph `compiled` (from make) compiled."""
    return {g.name: g.counts for g in compiled.graphs}


def backend_of(config):
    """`refimpl.compile.backend(config)` for any `config`, to check its refusals."""
    from refimpl.compile import backend

    return backend(config)


def concept():
    return types.SimpleNamespace(make=make, exact=True, stages=("bucketing", "lowering", "reorder"),
                                 stage_counts=stage_counts, logger="refimpl.compile",
                                 backend_of=backend_of)
