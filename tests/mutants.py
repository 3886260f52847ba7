"""Mutants: plausible one-line slips in refimpl, each breaking one SPEC rule.

A mutant is a textual patch of one file of the checkout (Python or C): `old` must occur
exactly once in `path`, and is replaced by `new`. Each is the kind of slip a real
implementation makes at a rule's boundary (an off-by-one at a bound, a key computed
from the wrong property, a check or a synchronisation step left out) and names the rule
it breaks. `tests/test_mutants.py` applies each one to a copy of the checkout and runs
`python -m conformance --section <its section>` there: the conformance suite alone must
fail every mutant (CF-6).

Mutants are grouped by SPEC section, one list per section, so that each section's owner
adds to its own list.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a copy of the checkout needs to run the conformance suite on its own.
COPIED = ["refimpl", "conformance", "kernels", "pyproject.toml", "conftest.py", "setup.py"]


@dataclass(frozen=True)
class Mutant:
    name: str  # unique, short, snake_case
    rule: str  # the SPEC ID it breaks, e.g. "FC-20"
    path: str  # file relative to the repository root
    old: str  # text that occurs exactly once in `path`
    new: str  # what replaces it: a one-line slip
    why: str = ""  # the plausible mistake, in words

    @property
    def section(self) -> str:
        return self.rule.rsplit("-", 1)[0]

    def apply(self, root: Path) -> None:
        """Patch the copy of the checkout at `root` (refuses an ambiguous `old`)."""
        target = root / self.path
        text = target.read_text()
        count = text.count(self.old)
        if count != 1:
            raise ValueError(f"mutant {self.name}: {self.old!r} occurs {count} times in "
                             f"{self.path}, expected exactly once")
        target.write_text(text.replace(self.old, self.new))


def copy_checkout(dest: Path) -> Path:
    """A copy of what the suite needs, without build outputs or caches."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "build", "*.egg-info")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)
    return dest


# --------------------------------------------------------------------------------------
# 1. Functional collectives (FC)
# --------------------------------------------------------------------------------------
F = "refimpl/functional_collectives.py"
FC = [
    Mutant("all_gather_group_size_unchecked", "FC-19", F,
           "    if group_size != pg.size():\n",
           "    if group_size > pg.size():\n",
           "group_size compared with > instead of !=: a smaller group_size passes"),
    # The seven backends of the first mutation check, as one-line slips in the source.
    Mutant("all_reduce_in_place_on_its_input", "FC-2", F,
           "    out = tensor.clone(memory_format=torch.contiguous_format)\n"
           "    return _start_all_reduce(\"all_reduce\", out, op, pg, group_name)",
           "    out = tensor\n"
           "    return _start_all_reduce(\"all_reduce\", out, op, pg, group_name)",
           "the clone is forgotten: all_reduce reduces its input in place and returns it"),
    Mutant("async_tensor_never_waits", "FC-9", F,
           "        args = tree_map_only(AsyncCollectiveTensor, "
           "AsyncCollectiveTensor.trigger_wait, args)",
           "        args = tree_map_only(AsyncCollectiveTensor, lambda t: t.elem, args)",
           "a use of the result reads its buffer without waiting for the collective"),
    Mutant("all_gather_rearranges_along_the_wrong_dim", "FC-14", F,
           "lambda t: torch.cat(torch.chunk(t, n, dim=0), dim=dim))",
           "lambda t: torch.cat(torch.chunk(t, n, dim=dim), dim=0))",
           "gather_dim != 0: the chunk and cat dims are swapped, so ranks' pieces land out of "
           "group-rank order"),
    Mutant("broadcast_src_read_as_global_rank", "FC-22", F,
           "        tensor, group=pg, group_src=src, async_op=True))",
           "        tensor, group=pg, src=src, async_op=True))",
           "src passed as torch.distributed.broadcast's global rank instead of a group rank"),
    Mutant("wait_tensor_does_not_wait", "FC-5", F,
           "def _wait_tensor(tensor: torch.Tensor) -> torch.Tensor:\n"
           "    _wait_and_clear(tensor.data_ptr())\n",
           "def _wait_tensor(tensor: torch.Tensor) -> torch.Tensor:\n",
           "wait_tensor returns its argument without waiting for (or clearing) the collective"),
    Mutant("traced_result_without_its_wait", "FC-12", F,
           "    if _are_we_tracing():\n        return ops.wait_tensor(tensor)\n"
           "    if tensor.requires_grad",
           "    if _are_we_tracing():\n        return tensor\n    if tensor.requires_grad",
           "under tracing the API returns the collective's result without emitting its wait"),
    # Slips at the boundaries of the other rules.
    Mutant("all_to_all_split_names_swapped", "FC-1", F,
           "\"(Tensor input, SymInt[] output_split_sizes, \"\n                             "
           "\"SymInt[] input_split_sizes, str group_name) -> Tensor\"",
           "\"(Tensor input, SymInt[] input_split_sizes, \"\n                             "
           "\"SymInt[] output_split_sizes, str group_name) -> Tensor\"",
           "the schema names the split lists in the other order (positions unchanged)"),
    Mutant("all_reduce_result_keeps_input_strides", "FC-2", F,
           "    out = tensor.clone(memory_format=torch.contiguous_format)\n"
           "    return _start_all_reduce(",
           "    out = tensor.clone()\n    return _start_all_reduce(",
           "clone() preserves a non-contiguous input's strides: the result is not contiguous"),
    Mutant("fake_all_to_all_skips_split_checks", "FC-3", F,
           "    rows, _, _, _ = _check_all_to_all(tensor, output_split_sizes, input_split_sizes, "
           "group_name)\n    return tensor.new_empty",
           "    rows = sum(output_split_sizes) or tensor.shape[0]\n    return tensor.new_empty",
           "the fake kernel computes the shape but skips the eager kernel's split checks"),
    Mutant("fake_coalesced_checks_first_member_only", "FC-3", F,
           "    for t in tensors:\n        _check_all_reduce(t, reduce_op, group_name)\n"
           "    return [torch.empty_like",
           "    for t in tensors[:1]:\n        _check_all_reduce(t, reduce_op, group_name)\n"
           "    return [torch.empty_like",
           "the coalesced fake kernel checks only the first member"),
    Mutant("fake_reduce_scatter_keeps_input_shape", "FC-3", F,
           "    _, shape, _ = _check_reduce_scatter(tensor, reduce_op, group_size, group_name)\n"
           "    return tensor.new_empty(shape)",
           "    _, shape, _ = _check_reduce_scatter(tensor, reduce_op, group_size, group_name)\n"
           "    return torch.empty_like(tensor)",
           "the fake reduce_scatter returns the input's shape instead of dim 0 / group size"),
    Mutant("in_place_contiguity_unchecked", "FC-4", F,
           "    _check_contiguous(tensor, \"input\", \"all_reduce_\")\n",
           "",
           "the eager all_reduce_ forgets that it writes through the backend into its argument"),
    Mutant("registry_entry_kept_after_wait", "FC-6", F,
           "    del _work_registry[ptr]\n    entry[1].wait()",
           "    entry[1].wait()",
           "waiting leaves the entry in the registry"),
    Mutant("empty_result_registered", "FC-7", F,
           "    if ptr == 0:\n        # A tensor without storage",
           "    if tensor.dim() == 0:\n        # A tensor without storage",
           "'no storage' read as '0-d': zero-size results key the registry at address 0"),
    Mutant("finalizer_ignores_version", "FC-8", F,
           "    if entry is None or (version is not None and entry[0] != version):",
           "    if entry is None:",
           "a stale finalizer waits and clears the newer result that reuses its address"),
    Mutant("transpose_waits", "FC-10", F,
           "    torch.ops.aten.transpose.int, torch.ops.aten.permute.default,",
           "    torch.ops.aten.permute.default,",
           "transpose is missing from the view list, so it waits"),
    Mutant("numpy_reads_before_waiting", "FC-11", F,
           "    def numpy(self):\n        return self.wait().numpy()",
           "    def numpy(self):\n        return self.elem.numpy()",
           ".numpy() reads the buffer without waiting"),
    Mutant("bad_group_type_is_value_error", "FC-13", F,
           "    raise TypeError(\n        f\"group: expected a group name",
           "    raise ValueError(\n        f\"group: expected a group name",
           "a group of the wrong type raises ValueError instead of TypeError"),
    Mutant("rank_list_bound_off_by_one", "FC-15", F,
           "        if not 0 <= r < world:",
           "        if not 0 <= r <= world:",
           "a rank equal to the world size passes the rank-list check"),
    Mutant("duplicate_ranks_unchecked", "FC-15", F,
           "    if len(set(ranks)) != len(ranks):",
           "    if len(set(ranks)) > len(ranks):",
           "the duplicate check compares the wrong way round and never fires"),
    Mutant("two_d_mesh_without_dim_accepted", "FC-16", F,
           "        if mesh.ndim != 1:",
           "        if mesh.ndim > 2:",
           "an N-D mesh without a dim is taken as its dim 0 when N is 2"),
    Mutant("reduce_op_case_sensitive", "FC-17", F,
           "    if not isinstance(reduce_op, str) or reduce_op.lower() not in _REDUCE_OPS:",
           "    if not isinstance(reduce_op, str) or reduce_op not in _REDUCE_OPS:",
           "reduction names are matched case-sensitively"),
    Mutant("complex_counts_as_integer", "FC-18", F,
           "    floating = dtype.is_floating_point or dtype.is_complex",
           "    floating = dtype.is_floating_point",
           "complex dtypes are not counted as floating, so bitwise reductions pass on them"),
    Mutant("reduce_scatter_avg_not_divided", "FC-18", F,
           "    finish = (lambda: out.div_(pg.size())) if op == \"avg\" else None",
           "    finish = (lambda: out.div_(pg.size())) if op == \"AVG\" else None",
           "the avg divide is keyed on the wrong spelling, so reduce_scatter avg returns the sum"),
    Mutant("negative_dim_bound_off_by_one", "FC-20", F,
           "not -ndim <= dim < ndim:",
           "not -ndim < dim < ndim:",
           "gather_dim / scatter_dim = -ndim is refused"),
    Mutant("out_dtype_unchecked", "FC-20", F,
           "        if list(out.shape) != shape or out.dtype != tensor.dtype:",
           "        if list(out.shape) != shape:",
           "all_gather_into_tensor_out's out of another dtype is accepted"),
    Mutant("split_count_checked_one_way", "FC-21", F,
           "    if len(splits) != group_size or any(s < 0 for s in splits) or sum(splits) != size:",
           "    if len(splits) > group_size or any(s < 0 for s in splits) or sum(splits) != size:",
           "a split list shorter than the group passes"),
    Mutant("output_rows_from_input_splits", "FC-21", F,
           "    rows = sum(output_split_sizes) if len(output_split_sizes) else tensor.shape[0]\n"
           "    outs = _check_splits(",
           "    rows = sum(input_split_sizes) if len(input_split_sizes) else tensor.shape[0]\n"
           "    outs = _check_splits(",
           "the output's dim 0 is computed from the input splits"),
    Mutant("src_bound_off_by_one", "FC-22", F,
           "not isinstance(src, int) or not 0 <= src < size:",
           "not isinstance(src, int) or not 0 <= src <= size:",
           "src equal to the group size passes"),
    Mutant("all_to_all_gradient_splits_not_swapped", "FC-23", F,
           "    g = ops.all_to_all_single(grad.contiguous(), ctx.input_split_sizes,\n"
           "                              ctx.output_split_sizes, ctx.group_name)",
           "    g = ops.all_to_all_single(grad.contiguous(), ctx.output_split_sizes,\n"
           "                              ctx.input_split_sizes, ctx.group_name)",
           "the backward all_to_all reuses the forward's splits instead of swapping them"),
    Mutant("broadcast_gradient_reaches_every_rank", "FC-23", F,
           "    return (g if is_src else torch.zeros_like(g)), None, None",
           "    return g, None, None",
           "every rank gets the summed gradient, not only src (upstream's behaviour)"),
    Mutant("no_grad_refused_too", "FC-24", F,
           "    if tensor.requires_grad and torch.is_grad_enabled():\n"
           "        _check_differentiable",
           "    if tensor.requires_grad:\n        _check_differentiable",
           "a non-differentiable reduction is refused even under no_grad"),
    Mutant("coalesced_starts_before_checking", "FC-27", F,
           "    plans = [_check_all_reduce(t, reduce_op, group_name) for t in tensors]\n"
           "    for t in tensors:\n"
           "        _check_contiguous(t, \"inputs\", \"all_reduce_coalesced_\")\n",
           "    plans = [_check_all_reduce(t, reduce_op, group_name) for t in tensors]\n",
           "all_reduce_coalesced_ checks contiguity member by member as it starts them "
           "(here: not before starting any)"),
    Mutant("mismatch_check_skips_rank_one", "FC-28", F,
           "        for r, call in enumerate(calls[1:], start=1):",
           "        for r, call in enumerate(calls[2:], start=2):",
           "the fingerprint comparison starts one rank too late"),
    Mutant("split_check_compares_the_wrong_entries", "FC-28", F,
           "            expects, sends = receiver[\"output_split_sizes\"][j], "
           "sender[\"input_split_sizes\"][i]",
           "            expects, sends = receiver[\"output_split_sizes\"][i], "
           "sender[\"input_split_sizes\"][j]",
           "the all_to_all split check indexes by the wrong rank"),
    Mutant("peer_failure_not_named", "FC-29", F,
           "            except RuntimeError as exc:\n"
           "                raise _peer_failure(self.op, self.group_name, exc) from exc",
           "            except RuntimeError:\n                raise",
           "a failed wait re-raises gloo's error as is"),
    Mutant("meta_input_accepted", "FC-30", F,
           "    if tensor.device.type == \"meta\" and not isinstance(tensor, FakeTensor) \\",
           "    if tensor.device.type == \"fake\" and not isinstance(tensor, FakeTensor) \\",
           "the meta check tests for a device type that does not exist"),
    Mutant("out_device_compared_by_index", "FC-30", F,
           "        if out.device != tensor.device:",
           "        if out.device.index != tensor.device.index:",
           "devices compared by index: cpu and meta both have none"),
    Mutant("group_agreement_skipped", "FC-31", F,
           "    _agree_on_group(ranks)\n    return dist.new_group",
           "    return dist.new_group",
           "members create the group without first agreeing on the rank list"),
    Mutant("all_to_all_autograd_splits_swapped", "FC-32", F,
           "    return all_to_all_single(self, output_split_sizes, input_split_sizes, group, tag)",
           "    return all_to_all_single(self, input_split_sizes, output_split_sizes, group, tag)",
           "the autograd form passes the split lists in the other order"),
    Mutant("overload_not_side_effectful", "FC-33", F,
           "    torch.fx.node.has_side_effect(packet.default)\n",
           "",
           "only the packet is registered; FX nodes hold the overload, which DCE then drops"),
    Mutant("all_gather_through_the_backend_method", "FC-34", F,
           "    return _start(what, group_name, out, lambda: _dist_all_gather(\n"
           "        out, tensor.contiguous(), group=pg, async_op=True))",
           "    return _start(what, group_name, out, lambda: pg._allgather_base(\n"
           "        out, tensor.contiguous()))",
           "the ProcessGroup's private _allgather_base, which a Python ProcessGroup lacks"),
]

# --------------------------------------------------------------------------------------
# 2. Comm lowering (CL)
# --------------------------------------------------------------------------------------
CL: list[Mutant] = []

# --------------------------------------------------------------------------------------
# 3. Bucketing (BK)
# --------------------------------------------------------------------------------------
BK: list[Mutant] = []

# --------------------------------------------------------------------------------------
# 6. Symmetric memory (SM), C kernels included
# --------------------------------------------------------------------------------------
SM: list[Mutant] = []

MUTANTS: list[Mutant] = [*FC, *CL, *BK, *SM]
