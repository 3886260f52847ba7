"""The "compile_backend" concept of the `torch` backend: Inductor (`compile_fx`).

Options map to Inductor's config: `bucket_cap_mb` switches on its FX bucketing of
all_gathers and reduce_scatters (`bucket_all_gathers_fx="all"`,
`bucket_reduce_scatters_fx="all"`) with that cap for every bucket; `lowering=None`
cannot switch off Inductor's own lowering of collectives, which does not change values
or the collectives issued, so it is accepted; lowering options (one-shot all-reduce
needs CUDA symmetric memory upstream), a reorder stage and `debug_dir` are not
implemented. Inductor fuses and reorders arithmetic, so its values are not bit for bit
those of eager (`exact=False`).
"""

from __future__ import annotations

import functools
import types

from conformance.backends import NotImplementedConcept


def _cap(cap_mb, bucket_index):
    return cap_mb


def make(options: dict):
    from torch._inductor.compile_fx import compile_fx

    options = dict(options)
    cap_mb = options.pop("bucket_cap_mb", 25.0)
    lowering = options.pop("lowering", {})
    if lowering:
        raise NotImplementedConcept(f"torch: compile_backend: Inductor has no lowering "
                                    f"options {lowering!r} on CPU")
    asked = sorted(k for k, v in options.items() if v is not None)
    if asked:
        raise NotImplementedConcept(f"torch: compile_backend: no option {asked}")
    patches = {}
    if cap_mb is not None:
        determinator = functools.partial(_cap, cap_mb)
        patches = {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all",
                   "bucket_all_gathers_fx_bucket_size_determinator": determinator,
                   "bucket_reduce_scatters_fx_bucket_size_determinator": determinator}
    return functools.partial(_inductor, compile_fx, patches)


def _inductor(compile_fx, patches, gm, example_inputs):
    return compile_fx(gm, example_inputs, config_patches=patches)


def concept():
    return types.SimpleNamespace(make=make, exact=False, stages=("bucketing", "lowering"),
                                 stage_counts=None, logger=None)
