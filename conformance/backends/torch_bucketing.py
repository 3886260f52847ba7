"""The `bucketing` concept of the `torch` backend: `torch._inductor.fx_passes.bucketing`.

Upstream's passes take the same graph and cap callback. The options mapped are
`mixed_dtypes=True`, which is upstream's "custom_ops_multidtype" bucket mode for
all_gather, and `coalesced=True` for reduce_scatter, upstream's "coalesced" mode (BK-25);
any other refimpl option is reported as not implemented.

`deduplicate_waits` is 2.15's post-grad pass `deduplicate_wait_tensors` (BK-18), which
returns nothing: the adapter counts the waits it removed. Older releases have none.
`dedup_fsdp_reduce_scatter` is `fsdp.dedup_fsdp_reduce_scatter` (BK-26, the post-grad
pass of `config.dedup_reduce_scatters`), counted alike. `manual_overlap_bucketing` is
`overlap_manual_scheduling.manual_overlap_bucketing` (BK-28), as torchtitan calls it;
its scheduler's compute estimates are 0 (what 2.15 gives it; 2.13 asks triton for a GPU).

Upstream's passes leave users of an earlier member's wait before the merged wait and
rely on Inductor running `stable_topological_sort` right after them (post_grad.py);
the adapter does the same, so the graph it returns is the one Inductor goes on with.
"""

from __future__ import annotations

import types
import typing

import torch

from conformance import ops
from conformance.backends import NotImplementedConcept


def _refuse(options: dict, what: str) -> None:
    if options:
        raise NotImplementedConcept(f"torch: bucketing.{what} has no option {sorted(options)}")


def _wait_count(gm) -> int:
    return sum(1 for n in gm.graph.nodes if ops.is_wait(n))


def _sorted(gm) -> None:
    from torch._inductor.pattern_matcher import stable_topological_sort

    stable_topological_sort(gm.graph)
    gm.recompile()


def concept():
    from torch._inductor.fx_passes import bucketing as upstream

    def bucket_all_gather(gm, bucket_cap_mb_by_bucket_idx, *, mixed_dtypes=False, **options):
        _refuse(options, "bucket_all_gather")
        mode = "custom_ops_multidtype" if mixed_dtypes else "default"
        upstream.bucket_all_gather(gm, bucket_cap_mb_by_bucket_idx, mode=mode)
        _sorted(gm)

    def bucket_reduce_scatter(gm, bucket_cap_mb_by_bucket_idx, *, coalesced=False, **options):
        _refuse(options, "bucket_reduce_scatter")
        # BK-25: upstream's mode="coalesced", one coalesced reduce_scatter a bucket; a
        # value that is no bool goes to upstream as the mode it would be there
        mode = ("coalesced" if coalesced else "default") if isinstance(coalesced, bool) \
            else coalesced
        if mode == "coalesced" and \
                "coalesced" not in typing.get_args(getattr(upstream, "BucketMode", None)):
            raise NotImplementedConcept(
                f"torch {torch.__version__}: bucketing has no coalesced mode")
        upstream.bucket_reduce_scatter(gm, bucket_cap_mb_by_bucket_idx, mode=mode)
        _sorted(gm)

    def bucket_all_reduce(gm, bucket_cap_mb_by_bucket_idx, **options):
        _refuse(options, "bucket_all_reduce")
        upstream.bucket_all_reduce(gm, bucket_cap_mb_by_bucket_idx)
        _sorted(gm)

    passes = types.SimpleNamespace(bucket_all_gather=bucket_all_gather,
                                   bucket_reduce_scatter=bucket_reduce_scatter,
                                   bucket_all_reduce=bucket_all_reduce)
    dedup = getattr(upstream, "deduplicate_wait_tensors", None)  # torch 2.15 on
    if dedup is not None:
        def deduplicate_waits(gm, *, recompile=True):
            before = _wait_count(gm)
            dedup(gm.graph)
            if recompile:
                gm.recompile()
            return before - _wait_count(gm)

        passes.deduplicate_waits = deduplicate_waits
    passes.dedup_fsdp_reduce_scatter = _dedup_fsdp_reduce_scatter()
    passes.manual_overlap_bucketing = _manual_overlap_bucketing()
    return passes


def _manual_overlap_bucketing():
    """Upstream's `overlap_manual_scheduling.manual_overlap_bucketing` (BK-28) as it is
    (it buckets, then reorders); None where the release lacks it."""
    try:
        from torch._inductor.fx_passes.overlap_manual_scheduling import (
            manual_overlap_bucketing as upstream,
        )
    except ImportError:
        return None

    from conformance.backends.torch_reorder import roofline

    def manual_overlap_bucketing(gm, module_bucket_plans, **options):
        _refuse(options, "manual_overlap_bucketing")
        # The scheduler it builds on asks triton for a GPU's bandwidth on torch 2.13 (2.15
        # gives it estimates of 0 itself): estimates of 0 here too, nothing else changed.
        with roofline({}):
            return upstream(gm, module_bucket_plans)

    return manual_overlap_bucketing


def _dedup_fsdp_reduce_scatter():
    """Upstream's `fsdp.dedup_fsdp_reduce_scatter` (BK-26), which returns nothing: the
    adapter counts the reduce_scatters it removed. None where the release lacks it."""
    try:
        from torch._inductor.fx_passes.fsdp import dedup_fsdp_reduce_scatter as upstream
    except ImportError:
        return None

    from conformance.bucketing_programs import reduce_scatter_count as reduce_scatters

    def dedup_fsdp_reduce_scatter(gm, *, recompile=True):
        before = reduce_scatters(gm)
        upstream(gm)  # recompiles
        return before - reduce_scatters(gm)

    return dedup_fsdp_reduce_scatter
