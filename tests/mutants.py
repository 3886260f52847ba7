"""Mutants: plausible one-line slips in refimpl, each breaking one SPEC rule (CF-6).

A mutant is a textual patch of one file of the checkout (Python or C): `old` must occur
exactly once in `path`, and is replaced by `new`. Each is the kind of slip a real
implementation makes at a rule's boundary (an off-by-one at a bound, a key computed
from the wrong property, a check or a synchronisation step left out) and names the rule
it breaks. `tests/test_mutants.py` applies each one to a copy of the checkout and runs
`python -m conformance --section <its section> --first <its catch> --first <its rule> -x
-n 0` there (the second tier; the first runs the mutants of `FIRST_TIER` against their
`catch` alone, `--case`): the conformance suite alone must fail every mutant, on a case
that fails (a run that crashes without a report does not count).

A slip that breaks its rule on some torch releases only (upstream changed underneath it)
names them (`torch="<2.15"`) and why it breaks nothing on the others (`unbroken_because`);
there its run is skipped with that reason.

One list per SPEC section, named by the section's prefix (`FC`, `CL`, `MEM`, ...), so that
each section's owner adds to its own list; `MUTANTS` gathers the lists of every section
SPEC.md has. Run one: `pytest -n 0 -m slow tests/test_mutants.py -k <name>`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from conformance.spec import sections

ROOT = Path(__file__).resolve().parent.parent
# What a copy of the checkout needs to run the conformance suite on its own.
COPIED = ["refimpl", "conformance", "kernels", "pyproject.toml", "conftest.py", "setup.py",
          "SPEC.md"]
# Kernel libraries built earlier (refimpl/_native.py): found by the hash of their source,
# so the copy reuses an unchanged kernel's library and compiles a mutated kernel afresh.
KERNEL_BUILDS = "build/refimpl-kernels"
# The operator catalogue: several sections' slips are a field of a row set wrong.
COMM_OPS = "refimpl/comm_ops.py"


@dataclass(frozen=True)
class Mutant:
    name: str  # unique, short, snake_case
    rule: str  # the SPEC ID it breaks, e.g. "FC-20"
    path: str  # file relative to the repository root
    old: str  # text that occurs exactly once in `path`
    new: str  # what replaces it: a one-line slip
    why: str = ""  # the plausible mistake, in words
    # The torch releases on which the slip breaks its rule ("<2.15"), and why not on the
    # others; None: every release. On the others the mutant is skipped with that reason.
    torch: str | None = None
    unbroken_because: str = ""
    # The conformance case that fails for it (its id in `python -m conformance --json`):
    # the first tier of the tests runs this case alone against the mutant; the second
    # tier puts it first, then runs every case of the section.
    catch: str = ""

    @property
    def section(self) -> str:
        return self.rule.rsplit("-", 1)[0]

    @property
    def first(self) -> list[str]:
        """What its run puts first: the case known to catch it, then its rule's cases."""
        return [self.catch, self.rule] if self.catch else [self.rule]

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
    """A copy of what the suite needs, kernel libraries and compiled Python included."""
    # Built libraries (*.so) are kept: refimpl/_native.py loads one only if it was built
    # from the very source the copy holds. So is Python's bytecode (__pycache__): copies
    # keep each source's time and size, which a .pyc is checked against, so only the
    # mutated file compiles again (compiling them all cost each run about a second).
    ignore = shutil.ignore_patterns("build", "*.egg-info")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)
    if (ROOT / KERNEL_BUILDS).is_dir():
        shutil.copytree(ROOT / KERNEL_BUILDS, dest / KERNEL_BUILDS,
                        ignore=shutil.ignore_patterns("*.tmp"))
    return dest


# --------------------------------------------------------------------------------------
# 1. Functional collectives (FC)
# --------------------------------------------------------------------------------------
F = "refimpl/functional_collectives.py"
FC = [
    Mutant("coalesced_avg_divides_the_last_member", "FC-26", F,
           "        finishes = [(lambda t=t: t.div_(pg.size())) if op == \"avg\" else None"
           "\n                    for t in members]",
           "        finishes = [(lambda: t.div_(pg.size())) if op == \"avg\" else None"
           "\n                    for t in members]",
           "a late-binding closure: every avg finish of one dtype divides the last member, so "
           "the others come back undivided (blind red team)",
           catch="test_eager_values[2-name-f32-all_reduce_coalesced:avg]"),
    Mutant("coalesced_all_reduce_dtypes_in_name_order", "FC-34", F,
           "    for members in by_dtype.values():",
           "    for _, members in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):",
           "the per-dtype allreduce_coalesced calls in the order of the dtypes' names, not of "
           "their first appearance: values unchanged, the calls a group sees reordered (blind "
           "red team)",
           catch="test_each_op_reaches_its_process_group_through_its_method"
                 "[all_reduce_coalesced_of_two_dtypes-2]"),
    Mutant("failed_peer_is_the_first_other_member", "FC-29", F,
           "    who = f\"the failed peer is rank {peers[0]}\" if len(peers) == 1 else \\",
           "    who = f\"the failed peer is rank {peers[0]}\" if peers else \\",
           "a larger group names its first other member as the failed peer, which gloo "
           "never said",
           catch="test_a_failed_peer_of_a_larger_group_is_named_among_the_candidates"),
    Mutant("failed_peer_candidates_by_group_rank", "FC-29", F,
           "    peers = [peer] if peer is not None else [r for r in ranks if r != me]",
           "    peers = [peer] if peer is not None else "
           "[i for i, r in enumerate(ranks) if r != me]",
           "the candidates named by their index in the group instead of their global rank",
           catch="test_a_failed_peer_of_a_larger_group_is_named_among_the_candidates"),
    Mutant("grad_check_case_sensitive", "FC-17", F,
           "    if op not in _differentiable(what):",
           "    if reduce_op not in _differentiable(what):",
           "The differentiability check (grad path only) compares the raw reduce_op string "
           "instead of its lowered form, so case-insensitivity holds on the no-grad path but not "
           "when the input requires grad. (red team)",
           catch="test_gradient[2-reduce_scatter_Avg]"),
    Mutant("bxor_missing_from_bitwise", "FC-18", F,
           "_BITWISE = (\"band\", \"bor\", \"bxor\")",
           "_BITWISE = (\"band\", \"bor\")",
           "The list of bitwise reductions forgets bxor, so bxor on a floating dtype is not "
           "refused by the shared check function. (red team)",
           catch="test_bad_input_is_refused[bxor_of_float]"),
    Mutant("all_gather_out_dtype_by_itemsize", "FC-20", F,
           "        if list(out.shape) != shape or out.dtype != tensor.dtype:",
           "        if list(out.shape) != shape or out.dtype.itemsize != tensor.dtype.itemsize:",
           "The out check compares the element size instead of the dtype, so an out of another "
           "dtype with the same width passes. (red team)",
           catch="test_bad_input_is_refused[out_dtype_of_the_same_width]"),
    Mutant("mismatch_names_group_rank", "FC-28", F,
           "                return (f\"ranks disagree on {field}: global rank {ranks[r]} passed \"",
           "                return (f\"ranks disagree on {field}: global rank {r} passed \"",
           "The mismatch report names the group rank index as if it were the global rank. (red "
           "team)",
           catch="test_a_mismatch_names_the_global_rank_that_differs"),
    Mutant("coalesced_reduce_scatter_avg_as_sum", "FC-43", F,
           "    return _start_reduce_scatter(\"reduce_scatter_tensor_coalesced\", list(tensors),\n"
           "                                 plans[0][0],",
           "    return _start_reduce_scatter(\"reduce_scatter_tensor_coalesced\", list(tensors),\n"
           "                                 plans[0][0].replace(\"avg\", \"sum\"),",
           "the coalesced reduce_scatter reduces avg as gloo's SUM and forgets the divide "
           "(no case reduced a coalesced collective by avg)",
           catch="test_eager_values[2-name-f32-reduce_scatter_coalesced:avg]"),
    Mutant("dropped_result_requiring_grad_not_finalized", "FC-8", F,
           "        wrapper = AsyncCollectiveTensor(tensor)\n    _finalize_wrapper(wrapper, "
           "tensor)",
           "        wrapper = AsyncCollectiveTensor(tensor)\n        _finalize_wrapper(wrapper, "
           "tensor)",
           "only results without grad get the finalizer: a result that requires grad, dropped "
           "unwaited, leaves its entry in the registry",
           catch="test_work_registry"),
    Mutant("row_of_ranks_taken_unsorted", "FC-15", F,
           "        return _group_of_ranks(tuple(sorted(mine[0])))",
           "        return _group_of_ranks(tuple(mine[0]))",
           "the caller's row is looked up in the order given: [2, 0] finds no group of "
           "[0, 2] and makes another",
           catch="test_rows_out_of_order_name_the_group_of_their_ranks_ascending"),
    Mutant("check_ignores_the_group_timeout", "FC-28", F,
           "    timeout_s = _peer_timeout_s(pg)\n", "    timeout_s = _peer_timeout_s()\n",
           "the check waits its own 30 s for a late peer of a group made with a 1.5 s "
           "timeout (the issue's find: a group made to fail in 15 s waited for 30 s)",
           catch="test_the_check_gives_up_with_a_shorter_group_timeout"),
    Mutant("mesh_dim_type_check_and", "FC-16", F,
           "    if isinstance(dim, bool) or not isinstance(dim, (int, str)):",
           "    if isinstance(dim, bool) and not isinstance(dim, (int, str)):",
           "`or` written `and`: False passes as mesh dim 0",
           catch="test_bad_input_is_refused[mesh_dim_bool]"),
    Mutant("dim_type_check_and", "FC-20", F,
           "    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:",
           "    if isinstance(dim, bool) and not isinstance(dim, int) or not -ndim <= dim < ndim:",
           "`or` written `and`: a bool (or a float) passes as a dim",
           catch="test_bad_input_is_refused[gather_dim_bool]"),
    Mutant("rank_type_check_and", "FC-15", F,
           "        if isinstance(r, bool) or not isinstance(r, int):",
           "        if isinstance(r, bool) and not isinstance(r, int):",
           "`or` written `and`: True passes as rank 1 in a rank list",
           catch="test_bad_input_is_refused[rank_is_bool]"),
    Mutant("all_gather_group_size_unchecked", "FC-19", F,
           "    if group_size != pg.size():\n",
           "    if group_size > pg.size():\n",
           "group_size compared with > instead of !=: a smaller group_size passes",
           catch="test_bad_input_is_refused[group_size_below]"),
    # The seven backends of the first mutation check, as one-line slips in the source.
    Mutant("all_reduce_in_place_on_its_input", "FC-2", F,
           "    out = tensor.clone(memory_format=torch.contiguous_format)\n"
           "    return _start_all_reduce(\"all_reduce\", out, op, pg, group_name)",
           "    out = tensor\n"
           "    return _start_all_reduce(\"all_reduce\", out, op, pg, group_name)",
           "the clone is forgotten: all_reduce reduces its input in place and returns it",
           catch="test_results_are_fresh_contiguous_tensors"),
    Mutant("async_tensor_never_waits", "FC-9", F,
           "        args = tree_map_only(AsyncCollectiveTensor, "
           "AsyncCollectiveTensor.trigger_wait, args)",
           "        args = tree_map_only(AsyncCollectiveTensor, lambda t: t.elem, args)",
           "a use of the result reads its buffer without waiting for the collective",
           catch="test_work_registry"),
    Mutant("all_gather_rearranges_along_the_wrong_dim", "FC-14", F,
           "lambda t: torch.cat(torch.chunk(t, n, dim=0), dim=dim))",
           "lambda t: torch.cat(torch.chunk(t, n, dim=dim), dim=0))",
           "gather_dim != 0: the chunk and cat dims are swapped, so ranks' pieces land out of "
           "group-rank order",
           catch="test_eager_values[2-name-f32-all_gather:1]"),
    Mutant("broadcast_src_read_as_global_rank", "FC-46", F,
           "        tensor, group=pg, group_src=src, async_op=True))",
           "        tensor, group=pg, src=src, async_op=True))",
           "src passed as torch.distributed.broadcast's global rank instead of a group rank",
           catch="test_eager_values[2-noncontig-f32-broadcast:0]"),
    Mutant("wait_tensor_does_not_wait", "FC-5", F,
           "def _wait_tensor(tensor: torch.Tensor) -> torch.Tensor:\n"
           "    _wait_and_clear(_work_key(tensor))\n",
           "def _wait_tensor(tensor: torch.Tensor) -> torch.Tensor:\n",
           "wait_tensor returns its argument without waiting for (or clearing) the collective",
           catch="test_async_collective_tensor"),
    Mutant("traced_result_without_its_wait", "FC-12", F,
           "    if _are_we_tracing():\n        return ops.wait_tensor(tensor)\n"
           "    if tensor.requires_grad",
           "    if _are_we_tracing():\n        return tensor\n    if tensor.requires_grad",
           "under tracing the API returns the collective's result without emitting its wait",
           catch="test_make_fx_graph"),
    # Slips at the boundaries of the other rules.
    Mutant("all_to_all_split_names_swapped", "FC-1", F,
           "\"(Tensor input, SymInt[] output_split_sizes, \"\n                             "
           "\"SymInt[] input_split_sizes, str group_name) -> Tensor\"",
           "\"(Tensor input, SymInt[] input_split_sizes, \"\n                             "
           "\"SymInt[] output_split_sizes, str group_name) -> Tensor\"",
           "the schema names the split lists in the other order (positions unchanged)",
           catch="test_op_schema[all_to_all_single]"),
    Mutant("all_reduce_result_keeps_input_strides", "FC-2", F,
           "    out = tensor.clone(memory_format=torch.contiguous_format)\n"
           "    return _start_all_reduce(",
           "    out = tensor.clone()\n    return _start_all_reduce(",
           "clone() preserves a non-contiguous input's strides: the result is not contiguous",
           catch="test_results_are_fresh_contiguous_tensors"),
    Mutant("fake_all_to_all_skips_split_checks", "FC-3", F,
           "    rows, _, _, _ = _check_all_to_all(tensor, output_split_sizes, input_split_sizes, "
           "group_name)\n    return tensor.new_empty",
           "    rows = sum(output_split_sizes) or tensor.shape[0]\n    return tensor.new_empty",
           "the fake kernel computes the shape but skips the eager kernel's split checks",
           catch="test_bad_arguments_fail_at_trace_time[all_to_all-input_splits_sum-make_fx]"),
    Mutant("fake_coalesced_checks_first_member_only", "FC-3", F,
           "    for t in tensors:\n        _check_all_reduce(t, reduce_op, group_name)\n"
           "    return [torch.empty_like",
           "    for t in tensors[:1]:\n        _check_all_reduce(t, reduce_op, group_name)\n"
           "    return [torch.empty_like",
           "the coalesced fake kernel checks only the first member",
           catch="test_bad_arguments_fail_at_trace_time[all_reduce_coalesced-second_bad-make_fx]"),
    Mutant("fake_reduce_scatter_keeps_input_shape", "FC-38", F,
           "    _, shape, _ = _check_reduce_scatter(tensor, reduce_op, group_size, group_name)\n"
           "    return tensor.new_empty(shape)",
           "    _, shape, _ = _check_reduce_scatter(tensor, reduce_op, group_size, group_name)\n"
           "    return torch.empty_like(tensor)",
           "the fake reduce_scatter returns the input's shape instead of dim 0 / group size",
           catch="test_fake_kernels_give_result_shapes[reduce_scatter_tensor]"),
    Mutant("in_place_contiguity_unchecked", "FC-4", F,
           "    _check_contiguous(tensor, \"input\", \"all_reduce_\")\n",
           "",
           "the eager all_reduce_ forgets that it writes through the backend into its argument",
           catch="test_bad_input_is_refused[all_reduce_in_place_not_contiguous]"),
    Mutant("registry_entry_kept_after_wait", "FC-6", F,
           "    if kept:\n        _work_registry[key] = kept\n    else:\n"
           "        del _work_registry[key]\n",
           "",
           "waiting leaves the entry in the registry",
           catch="test_work_registry"),
    Mutant("empty_result_registered", "FC-7", F,
           "    if key < 0 and not pending_if_empty:  # no storage address",
           "    if tensor.dim() == 0 and not pending_if_empty:  # no storage address",
           "'no storage' read as '0-d': zero-size results key the registry at address 0",
           catch="test_a_result_without_storage_completes_before_the_op_returns"),
    Mutant("finalizer_ignores_version", "FC-8", F,
           "        waiting = [e for e in entries if e[0] == version]\n"
           "        kept = [e for e in entries if e[0] != version]\n",
           "        waiting, kept = entries, []\n",
           "a stale finalizer waits and clears the newer result that reuses its address",
           catch="test_work_registry"),
    Mutant("transpose_waits", "FC-10", F,
           "    torch.ops.aten.transpose.int, torch.ops.aten.permute.default,",
           "    torch.ops.aten.permute.default,",
           "transpose is missing from the view list, so it waits",
           catch="test_view_ops_do_not_wait[transpose]"),
    Mutant("numpy_reads_before_waiting", "FC-11", F,
           "    def numpy(self):\n        return self.wait().numpy()",
           "    def numpy(self):\n        return self.elem.numpy()",
           ".numpy() reads the buffer without waiting",
           catch="test_work_registry"),
    Mutant("bad_group_type_is_value_error", "FC-13", F,
           "type(group).__name__, \"FC-13\", TypeError)",
           "type(group).__name__, \"FC-13\", ValueError)",
           "a group of the wrong type raises ValueError instead of TypeError",
           catch="test_bad_input_is_refused[bad_group_type]"),
    Mutant("rank_list_bound_off_by_one", "FC-15", F,
           "        if not 0 <= r < world:",
           "        if not 0 <= r <= world:",
           "a rank equal to the world size passes the rank-list check",
           catch="test_bad_input_is_refused[rank_is_world_size]"),
    Mutant("duplicate_ranks_unchecked", "FC-15", F,
           "    if len(set(ranks)) != len(ranks):",
           "    if len(set(ranks)) > len(ranks):",
           "the duplicate check compares the wrong way round and never fires",
           catch="test_bad_input_is_refused[duplicate_ranks]"),
    Mutant("two_d_mesh_without_dim_accepted", "FC-16", F,
           "        if mesh.ndim != 1:",
           "        if mesh.ndim > 2:",
           "an N-D mesh without a dim is taken as its dim 0 when N is 2",
           catch="test_bad_input_is_refused[mesh_2d_without_dim]"),
    Mutant("reduce_op_case_sensitive", "FC-42", F,
           "    if not isinstance(reduce_op, str) or reduce_op.lower() not in _REDUCE_OPS:",
           "    if not isinstance(reduce_op, str) or reduce_op not in _REDUCE_OPS:",
           "reduction names are matched case-sensitively",
           catch="test_eager_values[2-name-f32-all_reduce:MAX]"),
    Mutant("complex_counts_as_integer", "FC-18", F,
           "    return dtype.is_floating_point or dtype.is_complex",
           "    return dtype.is_floating_point",
           "complex dtypes are not counted as floating, so bitwise reductions pass on them",
           catch="test_inputs_at_the_edge_of_a_refusal_are_accepted[avg_of_complex]"),
    Mutant("reduce_scatter_avg_not_divided", "FC-43", F,
           "    finishes = [(lambda out=out: out.div_(pg.size())) if op == \"avg\" else None",
           "    finishes = [(lambda out=out: out.div_(pg.size())) if op == \"AVG\" else None",
           "the avg divide is keyed on the wrong spelling, so reduce_scatter avg returns the sum",
           catch="test_eager_values[2-name-f32-reduce_scatter:AVG:0]"),
    Mutant("negative_dim_bound_off_by_one", "FC-44", F,
           "not -ndim <= dim < ndim:",
           "not -ndim < dim < ndim:",
           "gather_dim / scatter_dim = -ndim is refused",
           catch="test_eager_values[2-name-f32-all_gather:-2]"),
    Mutant("out_dtype_unchecked", "FC-20", F,
           "        if list(out.shape) != shape or out.dtype != tensor.dtype:",
           "        if list(out.shape) != shape:",
           "all_gather_into_tensor_out's out of another dtype is accepted",
           catch="test_bad_input_is_refused[out_wrong_dtype]"),
    Mutant("split_count_checked_one_way", "FC-21", F,
           "    if len(splits) != group_size or any(s < 0 for s in splits) or sum(splits) != size:",
           "    if len(splits) > group_size or any(s < 0 for s in splits) or sum(splits) != size:",
           "a split list shorter than the group passes",
           catch="test_bad_input_is_refused[splits_count_below]"),
    Mutant("output_rows_from_input_splits", "FC-38", F,
           "    rows = sum(output_split_sizes) if len(output_split_sizes) else tensor.shape[0]\n"
           "    outs = _check_splits(",
           "    rows = sum(input_split_sizes) if len(input_split_sizes) else tensor.shape[0]\n"
           "    outs = _check_splits(",
           "the output's dim 0 is computed from the input splits",
           catch="test_fake_kernels_give_result_shapes[all_reduce]"),
    Mutant("fake_empty_splits_read_as_no_rows", "FC-49", F,
           "    rows, _, _, _ = _check_all_to_all(tensor, output_split_sizes, input_split_sizes, "
           "group_name)\n    return tensor.new_empty(",
           "    _check_all_to_all(tensor, output_split_sizes, input_split_sizes, group_name)\n"
           "    rows = sum(output_split_sizes)\n    return tensor.new_empty(",
           "upstream's reading: the fake kernel sizes dim 0 by the sum of an empty split list (0 "
           "rows), not as equal splits",
           catch="test_fake_kernels_give_result_shapes[all_to_all_single:empty]"),
    Mutant("src_bound_off_by_one", "FC-22", F,
           "not isinstance(src, int) or not 0 <= src < size:",
           "not isinstance(src, int) or not 0 <= src <= size:",
           "src equal to the group size passes",
           catch="test_bad_input_is_refused[src_is_group_size]"),
    Mutant("all_to_all_gradient_splits_not_swapped", "FC-23", F,
           "    g = ops.all_to_all_single(grad.contiguous(), ctx.input_split_sizes,\n"
           "                              ctx.output_split_sizes, ctx.group_name)",
           "    g = ops.all_to_all_single(grad.contiguous(), ctx.output_split_sizes,\n"
           "                              ctx.input_split_sizes, ctx.group_name)",
           "the backward all_to_all reuses the forward's splits instead of swapping them",
           catch="test_gradient[2-all_to_all_uneven]"),
    Mutant("broadcast_gradient_reaches_every_rank", "FC-23", F,
           "    return (g if is_src else torch.zeros_like(g)), None, None",
           "    return g, None, None",
           "every rank gets the summed gradient, not only src (upstream's behaviour)",
           catch="test_gradient[2-broadcast]"),
    Mutant("no_grad_refused_too", "FC-24", F,
           "    if tensor.requires_grad and torch.is_grad_enabled():\n"
           "        _check_differentiable",
           "    if tensor.requires_grad:\n        _check_differentiable",
           "a non-differentiable reduction is refused even under no_grad",
           catch="test_inputs_at_the_edge_of_a_refusal_are_accepted[product_under_no_grad]"),
    Mutant("coalesced_starts_before_checking", "FC-27", F,
           "    plans = [_check_all_reduce(t, reduce_op, group_name) for t in tensors]\n"
           "    for t in tensors:\n"
           "        _check_contiguous(t, \"inputs\", \"all_reduce_coalesced_\")\n",
           "    plans = [_check_all_reduce(t, reduce_op, group_name) for t in tensors]\n",
           "all_reduce_coalesced_ checks contiguity member by member as it starts them "
           "(here: not before starting any)",
           catch="test_bad_input_is_refused[coalesced_in_place_second_not_contiguous]"),
    Mutant("mismatch_check_skips_rank_one", "FC-28", F,
           "        for r, call in enumerate(calls[1:], start=1):",
           "        for r, call in enumerate(calls[2:], start=2):",
           "the fingerprint comparison starts one rank too late",
           catch="test_mismatched_calls_raise_on_every_rank[shapes]"),
    Mutant("split_check_compares_the_wrong_entries", "FC-28", F,
           "            expects, sends = receiver[\"output_split_sizes\"][j], "
           "sender[\"input_split_sizes\"][i]",
           "            expects, sends = receiver[\"output_split_sizes\"][i], "
           "sender[\"input_split_sizes\"][j]",
           "the all_to_all split check indexes by the wrong rank",
           catch="test_mismatched_calls_raise_on_every_rank[split_sizes]"),
    Mutant("peer_failure_not_named", "FC-29", F,
           "            except RuntimeError as exc:\n"
           "                raise _peer_failure(self.op, self.group_name, exc, self.peer) from exc",
           "            except RuntimeError:\n                raise",
           "a failed wait re-raises gloo's error as is",
           catch="test_a_failed_peer_is_named[dies]"),
    Mutant("meta_input_accepted", "FC-30", F,
           "    if tensor.device.type == \"meta\" and not isinstance(tensor, FakeTensor) \\",
           "    if tensor.device.type == \"fake\" and not isinstance(tensor, FakeTensor) \\",
           "the meta check tests for a device type that does not exist",
           catch="test_bad_input_is_refused[input_on_meta]"),
    Mutant("out_device_compared_by_index", "FC-30", F,
           "        if out.device != tensor.device:",
           "        if out.device.index != tensor.device.index:",
           "devices compared by index: cpu and meta both have none",
           catch="test_bad_input_is_refused[out_on_another_device]"),
    Mutant("group_agreement_skipped", "FC-31", F,
           "    request = _agree_on_group(ranks)\n", "    request = 1\n",
           "members create the group without first agreeing on the rank list",
           catch="test_disagreeing_rank_lists_end_in_an_error"),
    Mutant("all_to_all_autograd_splits_swapped", "FC-32", F,
           "    return all_to_all_single(self, output_split_sizes, input_split_sizes, group, tag)",
           "    return all_to_all_single(self, input_split_sizes, output_split_sizes, group, tag)",
           "the autograd form passes the split lists in the other order",
           catch="test_gradient[2-all_to_all_autograd]"),
    Mutant("overload_not_side_effectful", "FC-48", F,
           "    torch.fx.node.has_side_effect(packet.default)\n",
           "",
           "only the packet is registered; FX nodes hold the overload, which DCE then drops",
           catch="test_dead_code_elimination_keeps_collectives_and_waits[waited]"),
    Mutant("all_gather_through_the_backend_method", "FC-50", F,
           "    return _start_together(what, group_name, outs, lambda: "
           "pg.allgather_into_tensor_coalesced(\n"
           "        _real_views(outs), _real_views(ins), c10d.AllgatherOptions()),\n"
           "        reads=[(t,) for t in tensors])",
           "    if what == \"all_gather_into_tensor_out\":\n"
           "        return _start_together(what, group_name, outs, lambda: "
           "pg._allgather_base(\n"
           "            outs[0], ins[0], c10d.AllgatherOptions()), reads=[tensors])\n"
           "    return _start_together(what, group_name, outs, lambda: "
           "pg.allgather_into_tensor_coalesced(\n"
           "        _real_views(outs), _real_views(ins), c10d.AllgatherOptions()),\n"
           "        reads=[(t,) for t in tensors])",
           "the out= variant through the group's _allgather_base, as upstream's kernel: a "
           "Python group's override never receives it",
           catch="test_each_op_reaches_its_process_group_through_its_method"
                 "[all_gather_into_tensor_out-2]"),
    Mutant("all_gather_through_torch_distributed", "FC-34", F,
           "    return _start_together(what, group_name, outs, lambda: "
           "pg.allgather_into_tensor_coalesced(\n"
           "        _real_views(outs), _real_views(ins), c10d.AllgatherOptions()),\n"
           "        reads=[(t,) for t in tensors])",
           "    return [_start(what, group_name, o, lambda o=o, i=i: "
           "dist.all_gather_into_tensor(\n"
           "        o, i, group=pg, async_op=True), reads=(t,))\n"
           "        for o, i, t in zip(outs, ins, tensors)]",
           "refimpl's first way, through torch.distributed's function, which reaches "
           "_allgather_base: torchft's groups fail there",
           catch="test_each_op_reaches_its_process_group_through_its_method"
                 "[all_gather_into_tensor-2]"),
    Mutant("backend_broadcast_root_by_global_rank", "FC-51", F,
           "        opts.rootRank, opts.rootTensor = src, 0\n",
           "        opts.rootRank, opts.rootTensor = dist.get_global_rank(pg, src), 0\n",
           "the registered backend's broadcast told the root's global rank (as "
           "torch.distributed's src= takes it): on a subgroup, another rank or none",
           catch="test_ops_complete_on_a_python_group_that_leaves_them_to_its_backend"),
    Mutant("python_group_through_its_own_methods", "FC-51", F,
           "    if type(pg) is dist.ProcessGroup:\n        return None\n",
           "    if isinstance(pg, dist.ProcessGroup):\n        return None\n",
           "a group c10d made told from a Python one by isinstance, which every subclass "
           "passes: the group's own methods, through the trampoline, deadlock",
           catch="test_ops_complete_on_a_python_group_that_leaves_them_to_its_backend"),
    Mutant("override_sought_under_the_new_name_only", "FC-51", F,
           "           for name in _OVERRIDE_NAMES[method]):\n",
           "           for name in _OVERRIDE_NAMES[method][:1]):\n",
           "an override looked for under torch 2.13's new name only: a group overriding the "
           "older name (torchft's, the recording group) is served from its backend instead",
           catch="test_an_override_wins_over_the_backend_its_group_registered"
                 "[every_method_overridden-all_gather_into_tensor]"),
    Mutant("coalesced_gather_from_the_backend_for_the_first_member", "FC-51", F,
           "            for o, i in zip(_real_views(outs), _real_views(ins), strict=True)]),\n",
           "            for o, i in zip(_real_views(outs)[:1], _real_views(ins)[:1], "
           "strict=True)]),\n",
           "the registered backend's gather called for the first member only, as if the op "
           "had one pair",
           catch="test_ops_complete_on_a_python_group_that_leaves_them_to_its_backend"),
    Mutant("reduce_scatter_backend_drops_reduce_op", "FC-51", F,
           "backend._reduce_scatter_base(o, i, opts)",
           "backend._reduce_scatter_base(o, i, dist.ReduceScatterOptions())",
           "(red team, blind) fresh options for the backend's scatter instead of the ones "
           "carrying the reduce op: min, max and product sum there",
           catch="test_ops_complete_on_a_python_group_that_leaves_them_to_its_backend"),
    Mutant("all_reduce_backend_path_skips_avg_finish", "FC-51", F,
           "_real_views([tensor]), opts), finish)",
           "_real_views([tensor]), opts))",
           "(red team, blind) the backend's all_reduce registered without avg's divide: "
           "the sum comes back there",
           catch="test_ops_complete_on_a_python_group_that_leaves_them_to_its_backend"),
    Mutant("coalesced_all_reduce_checks_allreduce_override", "FC-51", F,
           '_backend_serving(pg, "allreduce_coalesced", members[0].device)',
           '_backend_serving(pg, "allreduce", members[0].device)',
           "(red team, blind) all_reduce_coalesced looks for an override of allreduce: a "
           "group overriding allreduce_coalesced alone is served from its backend",
           catch="test_an_override_wins_over_the_backend_its_group_registered"
                 "[half_overridden-all_reduce_coalesced]"),
    Mutant("all_gather_backend_path_skips_real_views", "FC-51", F,
           'for o, i in zip(_real_views(outs), _real_views(ins), strict=True)]),',
           'for o, i in zip(outs, ins, strict=True)]),',
           "(red team, blind) the backend's gather given complex tensors as they are, not "
           "as their real views",
           catch="test_ops_complete_on_a_python_group_that_leaves_them_to_its_backend"),
    Mutant("p2p_peer_as_its_global_rank", "FC-52", F,
           "lambda: getattr(serving, method)(buffers, peer, tag))",
           "lambda: getattr(serving, method)(buffers, dist.get_global_rank(pg, peer), tag))",
           "the peer handed to the group as a global rank (torch 2.12 and 2.13's wrappers "
           "did): on a subgroup another member, or none",
           catch="test_each_member_receives_what_its_peer_sent[subgroup]"),
    Mutant("p2p_send_completed_as_a_result_without_storage", "FC-52", F,
           "    return _register(result, pending, pending_if_empty=True)\n",
           "    return _register(result, pending)\n",
           "the send's token, which has no storage address, completed at once as FC-7 says "
           "of other results: it blocks until the peer receives, and a ring that sends "
           "first deadlocks",
           catch="test_each_member_receives_what_its_peer_sent[world]"),
    Mutant("p2p_send_token_of_the_default_dtype", "FC-52", F,
           "        result = tensor.new_empty(0)\n",
           "        result = torch.empty(0, device=tensor.device)\n",
           "the send's token made with the default dtype instead of the sent tensor's",
           catch="test_each_member_receives_what_its_peer_sent[world]"),
    Mutant("p2p_batch_member_completed_before_the_next", "FC-52", F,
           "    return [_start_p2p(op, t, peer, tag, pg, group_name)\n",
           "    return [_wait_tensor(_start_p2p(op, t, peer, tag, pg, group_name))\n",
           "each member of a batch completed before the next is issued: a batch that "
           "receives before it sends waits for a peer waiting for it",
           catch="test_each_member_receives_what_its_peer_sent[world]"),
    Mutant("p2p_receive_into_its_argument", "FC-53", F,
           "        result = torch.empty_like(tensor, memory_format=torch.contiguous_format)\n",
           "        result = tensor\n",
           "the receive written into its argument, as upstream's irecv does",
           catch="test_a_receive_leaves_its_argument_alone"),
    Mutant("p2p_peer_bound_off_by_one", "FC-53", F,
           "    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < size:",
           "    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer <= size:",
           "the group size taken for a rank: the send waits out the group's timeout for a "
           "rank that does not exist",
           catch="test_bad_point_to_point_arguments_are_refused_before_communicating"),
    Mutant("p2p_fake_receive_checks_nothing", "FC-53", F,
           "    _check_p2p(\"irecv\", tensor, src, tag, group_name)\n"
           "    return torch.empty_like(tensor, memory_format=torch.contiguous_format)\n",
           "    return torch.empty_like(tensor, memory_format=torch.contiguous_format)\n",
           "the fake kernel of irecv without the eager kernel's checks: a bad src traces",
           catch="test_bad_point_to_point_arguments_are_refused_before_communicating"),
    Mutant("p2p_pair_check_without_the_tag", "FC-53", F,
           '        for field in ("tag", "shape", "dtype"):',
           '        for field in ("shape", "dtype"):',
           "the pair compared by shape and dtype only: a tag that differs hangs until the "
           "group's timeout, and the error names no tag",
           catch="test_a_pair_that_does_not_match_is_named_on_both_ranks[tag]"),
    Mutant("p2p_sequence_shared_across_groups", "FC-52", F,
           "        key = (group_name, sender, receiver, op)\n",
           "        key = (sender, receiver, op)\n",
           "(red team, blind) the pair counter keyed without the group: two groups of the "
           "same pair used in different orders are compared out of step",
           catch="test_each_group_matches_its_own_sends_and_receives"),
    Mutant("p2p_empty_key_tensor_identity", "FC-52", F,
           "    return storage.data_ptr() or -storage._cdata\n",
           "    return storage.data_ptr() or -id(tensor)\n",
           "(red team, blind) a result without storage keyed by the tensor object, not its "
           "storage: a wait through a view finds no work",
           catch="test_a_result_without_storage_is_waited_through_a_view"),
    Mutant("p2p_check_after_backend_wait", "FC-53", F,
           "        if self.check is not None:\n"
           "            check, self.check = self.check, None\n"
           "            check()\n"
           "        if self.work is not None:\n",
           "        if self.check is not None:\n"
           "            check, self.check = self.check, None\n"
           "            self.work.wait()\n"
           "            check()\n"
           "        if self.work is not None:\n",
           "(red team, blind) the pair compared after the backend's wait: a pair that does "
           "not match hangs until the group's timeout instead of being named",
           catch="test_a_pair_that_does_not_match_is_named_on_both_ranks[tag]"),
    Mutant("all_gather_without_its_options", "FC-34", F,
           "        _real_views(outs), _real_views(ins), c10d.AllgatherOptions()),\n",
           "        _real_views(outs), _real_views(ins)),\n",
           "the gather's options left out (the binding has a default): a Python group whose "
           "method takes them as a required argument (torchft's) raises TypeError",
           catch="test_each_op_reaches_its_process_group_through_its_method"
                 "[all_gather_into_tensor-2]"),
    Mutant("shared_work_waited_at_every_result", "FC-26", F,
           "        if self.work is not None:\n            self.work.wait()\n"
           "            # The work holds every member's tensors: let go of it, so that a "
           "member waited\n"
           "            # is freed at its own wait, not at the last member's (MEM-5).\n"
           "            self.work = None\n",
           "        self.work.wait()\n",
           "a coalesced call's one work waited again at each member's wait: gloo copies every "
           "output again, undoing avg's divide of a member already waited",
           catch="test_eager_values[2-name-f32-reduce_scatter_coalesced:avg]"),
    Mutant("reduce_scatter_member_by_member", "FC-34", F,
           "    return _start_together(what, group_name, outs, lambda: "
           "pg.reduce_scatter_tensor_coalesced(\n"
           "        outs, ins, opts), finishes, reads=[(t,) for t in tensors])",
           "    return [_start_together(what, group_name, [o], lambda o=o, i=i: "
           "pg.reduce_scatter_tensor_coalesced(\n"
           "        [o], [i], opts), [f], reads=[(t,)])[0]\n"
           "        for o, i, f, t in zip(outs, ins, finishes, tensors)]",
           "a coalesced reduce_scatter as one call per member: the group sees N calls "
           "where upstream makes one",
           catch="test_each_op_reaches_its_process_group_through_its_method"
                 "[reduce_scatter_tensor_coalesced-2]"),
    Mutant("all_reduce_coalesced_member_by_member", "FC-34", F,
           "    _start_all_reduce_coalesced(\"all_reduce_coalesced_\", l"
           "ist(tensors), plans[0][0], pg,\n"
           "                                group_name)\n",
           "    for t, (op, _) in zip(tensors, plans, strict=True):\n"
           "        _start_all_reduce(\"all_reduce_coalesced_\", t, op, pg, group_name)\n",
           "the in-place coalesced all-reduce as one allreduce per member (refimpl's first "
           "way), not the group's allreduce_coalesced",
           catch="test_each_op_reaches_its_process_group_through_its_method"
                 "[all_reduce_coalesced_-2]"),
    Mutant("all_reduce_coalesced_of_every_dtype_in_one_call", "FC-34", F,
           "        by_dtype.setdefault(t.dtype, []).append(t)",
           "        by_dtype.setdefault(None, []).append(t)",
           "members of every dtype in one allreduce_coalesced: gloo refuses two dtypes",
           catch="test_each_op_reaches_its_process_group_through_its_method"
                 "[all_reduce_coalesced_of_two_dtypes-2]"),
    Mutant("rearranged_gather_completed_whenever_grad_is_on", "FC-40",
           "refimpl/functional_collectives.py",
           "(tensor.requires_grad and torch.is_grad_enabled())",
           "(tensor.requires_grad or torch.is_grad_enabled())",
           "`and` written `or`: an all_gather on dim 1 waits in the call, grad mode being on",
           catch="test_all_gather_on_another_dim_is_pending_too"),
    Mutant("check_timeout_of_zero_accepted", "FC-28", "refimpl/functional_collectives.py",
           "        if not timeout_s > 0:", "        if not timeout_s >= 0:",
           "the bound off by one: a check that may not wait at all is accepted",
           catch="test_set_collective_checks_takes_a_positive_timeout_and_uses_it"),
    Mutant("check_timeout_given_ignored", "FC-28", "refimpl/functional_collectives.py",
           "    if timeout_s is not None:\n        if not timeout_s > 0:",
           "    if timeout_s is None:\n        if not timeout_s > 0:",
           "`is not` written `is`: the timeout given to set_collective_checks is dropped",
           catch="test_set_collective_checks_takes_a_positive_timeout_and_uses_it"),
    Mutant("destroyed_group_of_ranks_reused", "FC-15", "refimpl/functional_collectives.py",
           "    if pg is None or pg not in c10d._world.pg_names:",
           "    if pg is None and pg not in c10d._world.pg_names:",
           "`or` written `and`: the group a rank list made earlier is used after it was "
           "destroyed",
           catch="test_rank_list_after_its_group_is_destroyed_gets_a_new_one"),
    Mutant("group_named_by_its_ranks_alone", "FC-15", "refimpl/functional_collectives.py",
           "-request-{request}\"",
           "\"",
           "the group made again after a destroy has the destroyed one's name and meets its "
           "peers on the destroyed one's store keys",
           catch="test_rank_list_after_its_group_is_destroyed_gets_a_new_one"),
    Mutant("group_request_not_counted", "FC-31", "refimpl/functional_collectives.py",
           "_group_requests.get((wanted, me), 0) + 1",
           "_group_requests.get((wanted, me), 0)",
           "the request counter never moves: a member's first request answers for its later "
           "ones",
           catch="test_a_member_that_does_not_ask_for_the_list_again_is_named"),
    Mutant("all_to_all_api_reads_rows_of_a_0d_input", "FC-21",
           "refimpl/functional_collectives.py",
           '    n = group_size(name)\n'
           '    _check_has_dims(self, "input", "all_to_all_single", "FC-21")\n',
           "    n = group_size(name)\n",
           "the API derives equal splits from dim 0 before the op checks it: a 0-d input "
           "fails with IndexError, naming no argument (as upstream does)",
           catch="test_bad_input_is_refused[all_to_all_of_0d_equal_splits]"),
    Mutant("last_request_recorded_under_rank_0", "FC-31", "refimpl/functional_collectives.py",
           'store.set(f"refimpl-fc/group-last/{me}", wanted)',
           'store.set("refimpl-fc/group-last/0", wanted)',
           "every member records the list it asked for under rank 0's key: the timeout "
           "names the members missing but not the list each of them asked for",
           catch="test_disagreeing_rank_lists_end_in_an_error"),
    Mutant("rank_rows_told_by_any_row", "FC-15", "refimpl/functional_collectives.py",
           "if group and all(isinstance(row, (list, tuple)) for row in group):",
           "if group and any(isinstance(row, (list, tuple)) for row in group):",
           "any for all: a list of a row and a rank is read as rows, and the rank's len() "
           "fails with a TypeError naming no argument",
           catch="test_bad_input_is_refused[rows_mixed_with_ranks]"),
    Mutant("wait_inplace_copies", "FC-35", F,
           "def _wait_tensor_inplace(tensor):\n    return _wait_tensor(tensor)",
           "def _wait_tensor_inplace(tensor):\n    return _wait_tensor(tensor).clone()",
           "the in-place wait copies like the traced one: every wait of a lowered program "
           "allocates (its plan came from the schema, and no case ran one and measured)",
           catch="test_lowered_waits_allocate_nothing_when_run"),
    Mutant("view_of_completed_passes_itself", "FC-10", F,
           "            return func(source.elem, *args[1:], **kwargs)",
           "            return func(source.elem, *args[:], **kwargs)",
           "[:] for [1:]: a view of a waited result passes the result itself as the view's "
           "first argument (only views of pending results were ever taken)",
           catch="test_view_ops_do_not_wait[view]"),
    Mutant("checks_switch_ignored", "FC-28", "refimpl/functional_collectives.py",
           '    _checks["enabled"] = enabled\n', "",
           "set_collective_checks(False) leaves the environment in charge: a late peer still "
           "times the check out",
           catch="test_set_collective_checks_false_switches_the_check_off_whatever_the_environment"),
    Mutant("in_place_coalesced_all_reduce_unchecked", "FC-28",
           "refimpl/functional_collectives.py",
           """    _agree("all_reduce_coalesced_", pg, group_name, shapes=_shapes(tensors),
           dtypes=_dtypes(tensors), reduce_op=str(reduce_op).lower())
""", "",
           "the in-place coalesced all_reduce communicates without the check its out-of-place "
           "twin makes: mismatched shapes reach gloo",
           catch="test_mismatched_calls_raise_on_every_rank[all_reduce_coalesced_-shapes]"),
    Mutant("work_keyed_by_data_ptr", "FC-6", F,
           "    return storage.data_ptr() or -storage._cdata\n",
           "    return tensor.data_ptr() or -storage._cdata\n",
           "the seed's key: a wait through a view at an offset finds no work and returns "
           "what the collective has not finished writing",
           catch="test_a_wait_through_a_view_at_an_offset_waits_the_collective"),
    Mutant("premul_sum_factor_dropped", "FC-17", F,
           "    return tensor if factor is None else (tensor * factor).to(tensor.dtype)\n",
           "    return tensor\n",
           "premul_sum taken as a plain sum: the factor never multiplies the input",
           catch="test_premul_sum_multiplies_each_rank_by_its_factor_then_sums[equal]"),
    Mutant("avg_value_reduced_as_sum", "FC-17", F,
           '    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg",',
           '    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "sum",',
           "ReduceOp.AVG mapped to sum, as refimpl's own table maps the name avg to c10d's SUM",
           catch="test_a_reduce_op_value_reduces_as_its_name[all_reduce-AVG]"),
    Mutant("premul_sum_of_integers_accepted", "FC-18", F,
           "            if not _floating(t.dtype):\n"
           "                refuse(\"reduce_op\", \"a floating dtype for premul_sum\", t.dtype, "
           "\"FC-18\")\n",
           "",
           "premul_sum's dtype check left out: an integer input is multiplied by a float "
           "factor and truncated",
           catch="test_bad_input_is_refused[premul_sum_of_integers]"),
    Mutant("wait_tensors_waits_the_first_only", "FC-37", F,
           "    return [wait_tensor(t) for t in tensors]",
           "    return [wait_tensor(tensors[0]), *tensors[1:]]",
           "the list's wait written for its first tensor, the others returned still "
           "pending (AsyncCollectiveTensors)",
           catch="test_the_2_15_names_give_what_the_older_names_give"),
    Mutant("extremum_ties_counted_on_this_rank_only", "FC-23", F,
           '    holders = _waited(ops.all_reduce(holds.to(torch.float32), "sum", ctx.group_name))',
           '    holders = holds.to(torch.float32)',
           "the holders of a min/max counted on the rank itself: a tie across ranks gives "
           "each holder the whole gradient",
           catch="test_min_and_max_gradients_go_to_the_extremum_shared_among_ties[2-max]"),
    Mutant("extremum_gradient_to_every_element", "FC-23", F,
           "    return torch.where(holds, (total / holders).to(total.dtype), 0)",
           "    return (total / holders).to(total.dtype)",
           "the min/max gradient given as sum's: every element gets its share, extremum "
           "or not",
           catch="test_min_and_max_gradients_go_to_the_extremum_shared_among_ties[2-max]"),
    Mutant("broadcast_grad_src_vs_global_rank", "FC-23", F,
           "    is_src = _process_group(ctx.group_name).rank() == ctx.src",
           "    is_src = dist.get_rank() == ctx.src",
           "broadcast's backward compares the global rank with src, which is a group rank "
           "(FC-46), so the summed gradient goes to the wrong rank, or to none, in a group "
           "that is not the default one. (red team)",
           catch="test_broadcast_gradient_goes_to_the_src_group_rank_of_a_subgroup[1_3-src0]"),
    Mutant("premul_dtype_checked_on_first_member_only", "FC-17", F,
           "        for t in tensors:\n            if not _floating(t.dtype):\n"
           "                refuse(\"reduce_op\", \"a floating dtype for premul_sum\", t.dtype, "
           "\"FC-18\")",
           "        if not _floating(tensors[0].dtype):\n"
           "            refuse(\"reduce_op\", \"a floating dtype for premul_sum\", "
           "tensors[0].dtype, \"FC-18\")",
           "The premul_sum dtype check assumes a coalesced list has one dtype and checks only "
           "its first member, so an integer member later in the list gets through. (red team)",
           catch="test_premul_sum_takes_floating_inputs_only_every_member_checked"
                 "[all_reduce_coalesced-f32_i64-number]"),
    Mutant("apply_env_never_drops_unset_vars", "FC-28", "refimpl/_rank_process.py",
           "    for key in [k for k in os.environ if k.startswith(FORWARDED_ENV_PREFIX)]:",
           "    for key in [k for k in env if k.startswith(FORWARDED_ENV_PREFIX)]:",
           "The loop meant to delete the worker's REFIMPL_* variables that the caller no longer "
           "has iterates the caller's dict instead, so nothing is ever dropped and a switch the "
           "caller turned off stays on in a reused worker. (red team)",
           catch="test_the_ranks_follow_the_callers_refimpl_variables_set_and_removed"),
    Mutant("extremum_nan_is_no_holder", "FC-23", F,
           "    holds = (x == y) | (x.isnan() & y.isnan())",
           "    holds = x == y",
           "Holders of the extremum are found by equality alone, and NaN != NaN, so "
           "when the min/max result is NaN no element holds it and the gradient is "
           "silently zero. (red team)",
           catch="test_min_and_max_gradients_of_nan_and_infinities[2-max-f64]"),
    Mutant("reduce_scatter_avg_grad_divides_by_world", "FC-47", F,
           "        g = g / ctx.group_size",
           "        g = g / dist.get_world_size()",
           "The avg scaling in reduce_scatter's backward uses the world size instead of "
           "the group's size, which is only right for the default group. (red team)",
           catch="test_reduce_scatter_avg_gradient_divides_by_the_subgroups_si"
                 "ze[1_3-f64]"),
    Mutant("apply_env_keeps_stale_values", "FC-28", "refimpl/_rank_process.py",
           "    os.environ.update(env)",
           "    for key, value in env.items(): os.environ.setdefault(key, value)",
           "The worker only adds the caller's REFIMPL_* variables it lacks and never "
           "overwrites one it already has, so a kept worker keeps the value from an "
           "earlier call after the caller changes it. (red team)",
           catch="test_the_ranks_follow_the_callers_refimpl_variables_set_and_removed"),
    Mutant("coalesced_list_taken_from_any_iterable", "FC-27", F,
           "    if not isinstance(tensors, (list, tuple)):\n        refuse(argument, "
           "\"a list of tensors\", type(tensors).__name__, rule, TypeError)\n",
           "",
           "the list argument of a coalesced op taken from anything iterable, so a bare "
           "tensor's rows become its members (red team, found in refimpl)",
           catch="test_a_list_argument_in_a_wrong_form_is_refused_by_name[all_"
                 "reduce_coalesced-tensor]"),
    Mutant("coalesced_empty_list_left_to_the_op", "FC-27", F,
           "    if not tensors:\n        refuse(argument, \"a list of at least one "
           "tensor\", \"an empty list\", rule)\n",
           "",
           "an empty list left to the op, whose dispatcher fails naming no argument "
           "(and wait_tensors([]) waits nothing) (red team, found in refimpl)",
           catch="test_a_list_argument_in_a_wrong_form_is_refused_by_name[all_"
                 "reduce_coalesced-empty_list]"),
    Mutant("premul_factor_dtype_unchecked", "FC-17", F,
           "        if factor.numel() != 1 or not factor.dtype.is_floating_point:",
           "        if factor.numel() != 1:",
           "Only the one-element part of the tensor-factor check is kept (the factor "
           "'is cast to the input's dtype anyway'), so a premul_sum made with an "
           "integer tensor factor is accepted instead of refused. (red team)",
           catch="test_bad_input_is_refused[premul_sum_integer_tensor_factor]"),
    Mutant("avg_dtype_check_reads_the_name_as_spelled", "FC-18",
           "refimpl/functional_collectives.py",
           '    if op == "avg" and not floating:',
           '    if reduce_op == "avg" and not floating:',
           "The dtype check tests the raw argument instead of the lower-cased name, so a "
           "reduction spelled in another case ('AVG', FC-42) skips FC-18's check. (red "
           "team)",
           catch="test_bad_input_is_refused[AVG_of_integers]"),
]

# --------------------------------------------------------------------------------------
# 2. Comm lowering (CL)
# --------------------------------------------------------------------------------------
_CL = "refimpl/comm_lowering.py"
CL = [
    Mutant("cl12_alloc_id_ignores_buffer_bytes", "CL-12", _CL,
           '    key = f"{namespace}/{fingerprint}/{index}/'
           '{val.dtype}{list(val.shape)}/{group_name}"\n',
           '    key = f"{namespace}/{fingerprint}/{index}/{group_name}"\n',
           "The alloc_id omits the buffer's size and dtype, so the same graph lowered under "
           'another threshold gives the same alloc_id to a buffer of other bytes at that '
           'index, and the persistent allocation is refused (SM-4). (red team)',
           catch="test_small_sum_all_reduce_goes_one_shot"),
    Mutant("cl13_in_place_result_escapes", "CL-13", _CL,
           '        sources = aliasing_of(node.target)\n'
           '        source = sources[0] if len(sources) == 1 else \\\n',
           '        if node.target._schema.is_mutable:\n'
           "            return False  # an in-place op's result is its own value\n"
           '        sources = aliasing_of(node.target)\n'
           '        source = sources[0] if len(sources) == 1 else \\\n',
           '_in_a_comm_buffer follows views and getitems but not in-place results, so a '
           'graph output that is an in-place result on a comm buffer (the copy_ of a one- '
           'shot all_reduce_, CL-14) is not cloned and escapes the graph, and the next '
           "call's allocation of that alloc_id is refused. (red team)",
           catch="test_a_view_of_a_comm_buffer_escapes_as_a_clone[ar_inplace_comm_buffer_escapes]"),
    Mutant("wait_in_place_though_written_later", "CL-20", _CL,
           "                    and not row.in_place\n"
           "                    and not {node, _base(node.args[0])} & written_later):",
           "                    and not row.in_place):",
           "every kept wait completes in place, also one whose result or argument a later "
           "node writes: the write reaches both (found by --fuzz)",
           catch=(
               "test_a_wait_whose_result_or_argument_is_written_later_keeps_its_values[ar_inplace_wait_result_written]")),
    Mutant("coalesced_kernel_from_refimpl_namespace", "CL-1", _CL,
           "        kernel = _ops_of(node).all_reduce_coalesced_.default",
           "        kernel = torch.ops.refimpl_c10d.all_reduce_coalesced_.default",
           "one path of several takes refimpl's kernel: upstream's coalesced all_reduce becomes "
           "refimpl_c10d.all_reduce_coalesced_, waited by upstream's wait",
           catch="test_a_graph_of_upstream_ops_is_lowered_to_upstream_kernels"),
    Mutant("force_one_shot_needs_auto_select", "CL-21", _CL,
           "        if not (self.config.auto_select or self.config.force_one_shot_all_reduce):",
           "        if not self.config.auto_select:",
           "Selection is gated on auto_select alone, so force_one_shot_all_reduce has no effect "
           "unless auto_select is also set; SPEC makes force_one_shot_all_reduce require "
           "one-shot (or a refusal) on its own. (red team)",
           catch="test_force_one_shot_alone_lowers_one_shot"),
    Mutant("coalesced_list_reads_counted_by_users", "CL-19", _CL,
           "_is_fresh_intermediate(inp) and _read_count(inp) == 1 and",
           "_is_fresh_intermediate(inp) and len(inp.users) == 1 and",
           "readers counted as the nodes that use a tensor, not the places that read it: "
           "all_reduce_coalesced([y, y]) reduces y in place twice (an outside red team's find)",
           catch="test_all_reduce_coalesced_of_one_tensor_twice_clones_it"),
    Mutant("out_overload_of_other_arguments", "CL-11", "refimpl/comm_lowering.py",
           '        if len(outs) == 1 and outs[0].name == "out" and rest == args:',
           '        if len(outs) == 1 and outs[0].name == "out":',
           "the first overload with an `out` is taken whatever its other arguments: "
           "x.sum() becomes sum.IntList_out, which reads its dtype as dims",
           catch="test_a_comm_buffer_producer_gets_the_out_overload_of_its_own_arguments"),
    Mutant("default_threshold_in_kilobytes", "CL-10", "refimpl/comm_lowering.py",
           "    one_shot_all_reduce_threshold_bytes: int = 128 * 1024",
           "    one_shot_all_reduce_threshold_bytes: int = 128 * 1000",
           "128 KB for 128 KiB: an input of exactly 128 KiB no longer goes one-shot under "
           "the default config (every case set the threshold itself)",
           catch="test_default_threshold_is_128_kib[at_128_kib]"),
    Mutant("default_threshold_doubled", "CL-10", "refimpl/comm_lowering.py",
           "    one_shot_all_reduce_threshold_bytes: int = 128 * 1024",
           "    one_shot_all_reduce_threshold_bytes: int = 256 * 1024",
           "another default threshold: an input just over 128 KiB goes one-shot",
           catch="test_default_threshold_is_128_kib[one_element_over]"),
    Mutant("prologue_source_written_by_every_listed_tensor_only", "CL-17", _CL,
           "if any(any(b is base for b in bases) for bases in",
           "if any(all(b is base for b in bases) for bases in",
           "any written as all: an op that writes a list (a _foreach_ op) holding the "
           "prologue's source and another tensor is not seen to write the source, and the "
           "prologue moves past it",
           catch=(
               "test_pointwise_chains_run_in_the_one_shot_kernel[ar_pointwise_source_written_by_a_foreach]")),
    Mutant("lowering_marks_no_fuse_by_default", "CL-2", _CL,
           "reorder_for_compute_comm_overlap: bool = False",
           "reorder_for_compute_comm_overlap: bool = True",
           "the config's default switched on: every clone of a plain lowering is marked "
           "not to fuse, as if a reorder pass followed",
           catch="test_clone_is_marked_no_fuse_only_under_overlap_reordering[default]"),
    Mutant("group_of_no_group_not_checked", "CL-16", _CL,
           '        group_ranks(args["group_name"])\n', "        pass\n",
           "lower does not look up each collective's group: a name of no group is refused "
           "only by the fake kernel it makes, an error that names neither gm nor the node",
           catch="test_lower_refuses_what_it_cannot_lower[group_name_of_no_group]"),
    Mutant("out_of_place_view_not_copied", "CL-6", _CL,
           "        node.args = (inputs, *node.args[1:])\n", "",
           "the contiguous copy of an out-of-place collective's view input is made but not "
           "passed: the kernel reads the view",
           catch="test_the_gather_op_reads_a_contiguous_copy_of_a_view"),
    # the straight call of a lowered module (refimpl/_fx.py): each check it may forget
    Mutant("straight_call_skips_forward_hooks", "CL-1", "refimpl/_fx.py",
           "self._forward_hooks or ", "",
           "the module's forward hooks not among the reasons to take nn.Module's path",
           catch="test_the_lowered_program_is_called_as_any_module"),
    Mutant("straight_call_skips_global_pre_hooks", "CL-1", "refimpl/_fx.py",
           "_nn._global_forward_pre_hooks\n            or ", "",
           "global forward pre-hooks forgotten (registered for every module, not this one)",
           catch="test_the_lowered_program_is_called_as_any_module"),
    Mutant("straight_call_skips_backward_pre_hooks", "CL-1", "refimpl/_fx.py",
           "self._backward_pre_hooks or ", "",
           "full backward pre-hooks forgotten: nn.Module's path installs them at the call",
           catch="test_the_lowered_program_is_called_as_any_module"),
    Mutant("straight_call_under_jit_trace", "CL-1", "refimpl/_fx.py",
           "_tracing_state()\n            or ", "",
           "torch.jit.trace not noticed: the traced graph loses the module's scope",
           catch="test_the_lowered_program_is_called_as_any_module"),
    Mutant("straight_call_past_module_compile", "CL-1", "refimpl/_fx.py",
           "self._compiled_call_impl is not None\n            or ", "",
           "Module.compile's compiled call skipped",
           catch="test_the_lowered_program_is_called_as_any_module"),
    Mutant("straight_call_past_a_patched_module_call", "CL-1", "refimpl/_fx.py",
           "torch.nn.Module.__call__ is not _MODULE_CALL or ", "",
           "an FX tracer that patched Module.__call__ traces through the module",
           catch="test_the_lowered_program_is_called_as_any_module"),
    Mutant("straight_call_unprofiled", "CL-1", "refimpl/_fx.py",
           "            or _profiling()):", "            ):",
           "the profiler's record of the module call lost",
           catch="test_the_lowered_program_is_called_as_any_module"),
    Mutant("one_shot_threshold_exclusive", "CL-10", _CL,
           "    if size > config.one_shot_all_reduce_threshold_bytes:\n",
           "    if size >= config.one_shot_all_reduce_threshold_bytes:\n",
           "the threshold compared with >= : an all_reduce of exactly the threshold misses",
           catch="test_one_shot_threshold_is_inclusive"),
    Mutant("one_shot_for_avg_too", "CL-10", _CL,
           '    if reduce_op.lower() != "sum":\n',
           '    if reduce_op.lower() not in ("sum", "avg"):\n',
           "avg taken for a sum the one-shot kernel can do",
           catch="test_one_shot_not_chosen[avg]"),
    Mutant("one_shot_symm_mem_of_default_group", "CL-10", _CL,
           "    if not _symm_mem_enabled(group_name):\n",
           '    if not _symm_mem_enabled("0"):\n',
           "symmetric memory looked up for the default group, not the collective's",
           catch="test_one_shot_not_chosen[no_symm_mem_on_group]"),
    Mutant("one_shot_any_floating_dtype", "CL-10", _CL,
           "    if val.dtype not in SUPPORTED_DTYPES:\n",
           "    if not val.dtype.is_floating_point:\n",
           "dtype support judged by 'floating', which lets float64 through",
           catch="test_one_shot_not_chosen[float64]"),
    Mutant("sends_of_an_in_place_result_not_followed", "CL-10", "refimpl/comm_lowering.py",
           "            if aliasing_of(user.target)[:1] == [0] and user.args and "
           "user.args[0] is current:\n",
           "            if aliasing_of(user.target)[:1] == [0] and user.args and "
           "user.args[0] is current \\\n                    and user.target.namespace == "
           "\"aten\":\n",
           "only ATen views followed to a send: an in-place all_reduce_'s result, which "
           "upstream's isend then sends, is taken for another tensor (the fuzzer's seed 2148 "
           "found the judge's model doing this)",
           catch="test_a_tensor_upstream_sends_is_no_one_shot_comm_buffer"
                 "[ar_in_place_of_a_tensor_upstream_sends]"),
    Mutant("one_shot_without_comm_buffer_check", "CL-10", _CL,
           "    return comm_buffer_refusal(inp) or _sent_by_upstream(inp)\n",
           "    return _sent_by_upstream(inp)\n",
           "the last condition (realizable as a comm buffer) left out",
           catch="test_one_shot_not_chosen[graph_input]"),
    Mutant("in_place_on_shared_intermediate", "CL-3", _CL,
           "_read_count(inp) == 1 and _is_contiguous(inp)",
           "_read_count(inp) >= 1 and _is_contiguous(inp)",
           "the only-reader condition weakened: a second reader sees the reduced values",
           catch="test_all_reduce_of_shared_intermediate_is_cloned"),
    Mutant("in_place_on_non_contiguous_intermediate", "CL-3", _CL,
           "_read_count(inp) == 1 and _is_contiguous(inp)",
           "_read_count(inp) == 1",
           "contiguity of the intermediate not checked",
           catch="test_all_reduce_of_non_contiguous_intermediate_is_cloned"),
    Mutant("broadcast_reinplaced", "CL-8", _CL,
           "        clone = self.build.contiguous_clone(inp, before=node)\n"
           "        kernel = _ops_of(node).broadcast_.default\n",
           "        clone = self.in_place_input(inp, node)\n"
           "        kernel = _ops_of(node).broadcast_.default\n",
           "broadcast re-inplaced like all_reduce",
           catch="test_broadcast_becomes_clone_plus_inplace"),
    Mutant("one_shot_wait_kept", "CL-9", _CL,
           "            self.skip_waits(node, result)\n",
           "",
           "the wait of a blocking one-shot kernel kept in the graph",
           catch="test_small_sum_all_reduce_goes_one_shot"),
    Mutant("one_shot_of_a_tensor_upstream_sends", "CL-10", _CL,
           "    return comm_buffer_refusal(inp) or _sent_by_upstream(inp)\n",
           "    return comm_buffer_refusal(inp)\n",
           "(found by the fuzzer) a tensor upstream's isend sends realized as the one-shot "
           "comm buffer: upstream keeps it alive, and the next call's allocation is refused",
           catch="test_a_tensor_upstream_sends_is_no_one_shot_comm_buffer"
                 "[ar_of_a_tensor_upstream_sends]"),
    Mutant("view_sent_by_a_batch_not_followed", "CL-10", _CL,
           "                pending.append(user)  # a view of it: sending that sends the buffer\n",
           "                pass\n",
           "only the tensor itself looked for among upstream's sends, not a view of it",
           catch="test_a_tensor_upstream_sends_is_no_one_shot_comm_buffer"
                 "[ar_of_a_view_upstream_batch_sends]"),
    Mutant("escaping_view_of_a_comm_buffer_kept", "CL-13", _CL,
           "            if isinstance(arg, torch.fx.Node) and _in_a_comm_buffer(arg):\n",
           "            if isinstance(arg, torch.fx.Node) and COMM_BUFFER_META in arg.meta:\n",
           "(found by the fuzzer) only an output that is the comm buffer itself is cloned: "
           "a view of it escapes, and the next call's persistent allocation is refused",
           catch="test_a_view_of_a_comm_buffer_escapes_as_a_clone"
                 "[ar_comm_buffer_escapes_as_a_view]"),
    Mutant("escaping_split_of_a_comm_buffer_kept", "CL-13", _CL,
           "        if node.target is operator.getitem:\n            node, index = node.args\n",
           "        if node.target is operator.getitem:\n            return False\n",
           "a piece of a split of a comm buffer (a getitem) taken for a value of its own",
           catch="test_a_view_of_a_comm_buffer_escapes_as_a_clone"
                 "[ar_comm_buffer_escapes_as_a_split]"),
    Mutant("alloc_id_takes_a_broadcast_root_for_a_peer", "CL-12", _CL,
           '        p2p = comm_ops.collective_family(node) == "point_to_point"\n',
           '        p2p = comm_ops.collective_family(node) in ("point_to_point", "broadcast")\n',
           "every argument named src written as an offset, a broadcast's root too: its "
           "offset differs between the ranks, and so do the alloc_ids",
           catch="test_alloc_ids_are_equal_on_every_rank_and_distinct_where_they_must_be"),
    Mutant("alloc_id_reads_a_batch_s_peers", "CL-12", _CL,
           '_PEERS = frozenset({"dst", "src", "peer_list"})',
           '_PEERS = frozenset({"dst", "src"})',
           "the fingerprint writes a single op's peer as an offset but reads a batch's "
           "peer_list as it is: a ring's batch gives every rank other alloc_ids",
           catch="test_alloc_ids_are_equal_on_every_rank_of_a_ring[2]"),
    Mutant("alloc_id_peer_not_an_offset", "CL-12", _CL,
           '    return f"+{(peers - me) % size}"',
           '    return f"+{peers % size}"',
           "a single op's peer written as the group rank it names, not its offset from this "
           "rank's: a ring's send differs between the ranks",
           catch="test_alloc_ids_are_equal_on_every_rank_of_a_ring[2]"),
    Mutant("alloc_id_without_namespace", "CL-12", _CL,
           'key = f"{namespace}/{fingerprint}/{index}/{val.dtype}{list(val.shape)}/{group_name}"',
           'key = f"{fingerprint}/{index}/{val.dtype}{list(val.shape)}/{group_name}"',
           "alloc_id_namespace not mixed into the id",
           catch="test_alloc_ids_are_equal_on_every_rank_and_distinct_where_they_must_be"),
    Mutant("alloc_id_of_the_rank", "CL-12", _CL,
           'key = f"{namespace}/{fingerprint}/{index}/{val.dtype}{list(val.shape)}/{group_name}"',
           'key = f"{namespace}/{fingerprint}/{index}/{torch.distributed.get_rank()}"',
           "a rank-dependent id: ranks rendezvous on different buffers",
           catch="test_alloc_ids_are_equal_on_every_rank_and_distinct_where_they_must_be"),
    Mutant("fingerprint_of_group_names", "CL-12", _CL,
           'name = groups.setdefault(name, f"group #{len(groups)}")',
           "name = name",
           "the graph's digest reads group names as they are: a sub group's name differs "
           "between the ranks of different rows, and so do the ids of a WORLD comm buffer "
           "in a graph that also uses the sub group (found by the fuzzer)",
           catch="test_alloc_ids_are_equal_on_every_rank_and_distinct_where_they_must_be"),
    Mutant("alloc_id_same_for_every_buffer", "CL-12", _CL,
           "        self.next_buffer += 1\n",
           "",
           "the buffer index never advances: every comm buffer of a graph shares one id",
           catch="test_alloc_ids_are_equal_on_every_rank_and_distinct_where_they_must_be"),
    Mutant("comm_buffer_escapes", "CL-13", _CL,
           "                return self.build.call(aten.clone.default, [arg], before=output)\n",
           "                return arg\n",
           "a comm buffer returned as the graph's output",
           catch="test_a_comm_buffer_output_escapes_as_a_clone"),
    Mutant("no_copy_back_to_view", "CL-4", _CL,
           "            _replace(wait, self.build.call(aten.copy_.default, [inp, done], "
           "before=wait))\n",
           "            _replace(wait, done)\n",
           "the in-place result never copied back into the non-contiguous target",
           catch="test_all_reduce_inplace_on_a_view_reduces_a_copy_and_copies_back"),
    Mutant("view_taken_for_a_fresh_intermediate", "CL-3", _CL,
           'node.target.namespace != "aten" or _returns_alias(node.target):',
           'node.target.namespace != "aten":',
           "an op returning an alias (a view) taken for a fresh intermediate",
           catch="test_one_shot_not_chosen[view]"),
    Mutant("alloc_id_without_the_buffer_size", "CL-12", _CL,
           'key = f"{namespace}/{fingerprint}/{index}/{val.dtype}{list(val.shape)}/{group_name}"',
           'key = f"{namespace}/{fingerprint}/{index}/{group_name}"',
           "the id leaves the buffer's size out: the same graph lowered under another "
           "threshold asks buffer 0's persistent allocation for other bytes (found by "
           "--fuzz, which lowers each program under several configs)",
           catch="test_one_graph_lowered_under_two_thresholds_runs_both"),
    Mutant("kernel_result_taken_for_fresh", "CL-3", _CL,
           'node.target.namespace != "aten" or _returns_alias(node.target):',
           "node.target.namespace in _fx.COLLECTIVE_NAMESPACES or _returns_alias(node.target):",
           "any op but a collective's makes a fresh intermediate: a later all_reduce of a "
           "one-shot kernel's result (its wait gone) reduces it in place, not a clone "
           "(found by --fuzz's lowering model)",
           catch="test_an_all_reduce_of_a_kernels_result_clones_it[ar_of_a_one_shot_result]"),
    Mutant("alloc_id_full_64_bits", "CL-12", _CL,
           'return int.from_bytes(raw[:8], "big") >> 1',
           'return int.from_bytes(raw[:8], "big")',
           "all 64 bits of the digest kept: half the ids fall outside [0, 2**63)",
           catch="test_alloc_ids_are_equal_on_every_rank_and_distinct_where_they_must_be"),
    Mutant("fingerprint_without_shapes", "CL-12", _CL,
           'shape = (f"{val.dtype}{list(val.shape)}"',
           'shape = (f"{val.dtype}"',
           "the graph digest leaves shapes out: graphs that differ in a shape share ids",
           catch="test_pointwise_chains_run_in_the_one_shot_kernel[ar_small_intermediate]"),
    Mutant("negative_threshold_accepted", "CL-16", _CL,
           "        if threshold < 0:\n",
           "        if threshold < 0 and self.auto_select:\n",
           "the threshold checked only when auto_select uses it",
           catch="test_config_refuses_a_negative_threshold_and_fields_of_another_type"),
    Mutant("config_types_checked_only_for_bools_as_ints", "CL-16", _CL,
           "    if not isinstance(value, expected) or (expected is int and",
           "    if not isinstance(value, expected) and (expected is int and",
           "`or` written `and`: a field of the wrong type passes unless it is a bool for an int",
           catch="test_config_refuses_a_negative_threshold_and_fields_of_another_type"),
    Mutant("zero_threshold_refused", "CL-16", _CL,
           "        if threshold < 0:\n",
           "        if threshold <= 0:\n",
           "a threshold of 0 bytes refused with the negative ones: the bound off by one",
           catch="test_config_refuses_a_negative_threshold_and_fields_of_another_type"),
    # CL-17: pointwise chains fused into the one-shot kernel
    Mutant("fusion_on_by_default", "CL-17", _CL,
           "    fuse_pointwise: bool = False\n", "    fuse_pointwise: bool = True\n",
           "the fusion switched on by default",
           catch="test_pointwise_fusion_is_off_by_default"),
    Mutant("prologue_through_a_shared_step", "CL-17", _CL,
           "        while len(current.users) == 1 and (step := pointwise_step(current))",
           "        while len(current.users) >= 1 and (step := pointwise_step(current))",
           "the prologue takes a step that another node reads too",
           catch="test_pointwise_chains_run_in_the_one_shot_kernel[ar_pointwise_shared_step]"),
    Mutant("epilogue_through_a_shared_result", "CL-17", _CL,
           "        while len(current.users) == 1:\n            user = next(",
           "        while len(current.users) >= 1:\n            user = next(",
           "the epilogue follows the first reader of a result that two nodes read",
           catch="test_pointwise_chains_run_in_the_one_shot_kernel[ar_pointwise_result_read_twice]"),
    Mutant("prologue_steps_in_reverse", "CL-17", _CL,
           "        return current, steps[::-1], chain\n",
           "        return current, steps, chain\n",
           "the prologue's steps kept in the order they were found, last first",
           catch="test_pointwise_chains_run_in_the_one_shot_kernel[ar_pointwise_chains]"),
    Mutant("step_with_keyword_arguments", "CL-17", _CL,
           "    if op is None or node.kwargs or len(node.args) != 2:",
           "    if op is None or len(node.args) != 2:",
           "alpha ignored: add(x, 1, alpha=2) taken as 'add 1.0'",
           catch="test_pointwise_chains_run_in_the_one_shot_kernel[ar_pointwise_alpha]"),
    Mutant("step_with_a_bool", "CL-17", _CL,
           "    if (not isinstance(tensor, torch.fx.Node) or isinstance(number, bool)\n",
           "    if (not isinstance(tensor, torch.fx.Node)\n",
           "a bool taken for a number",
           catch="test_pointwise_chains_run_in_the_one_shot_kernel[ar_pointwise_bool]"),
    Mutant("step_with_an_inexact_int", "CL-17", _CL,
           "            or (isinstance(number, int) and float(number) != number)):",
           "            or False):",
           "an int with no exact double sent through float(): rounded twice",
           catch="test_pointwise_chains_run_in_the_one_shot_kernel[ar_pointwise_inexact_int]"),
    Mutant("step_that_changes_the_dtype", "CL-17", _CL,
           "    if val.dtype != source.dtype or val.dtype not in POINTWISE_DTYPES \\",
           "    if val.dtype not in POINTWISE_DTYPES \\",
           "a step from int32 to float32 taken: the kernel reads an int tensor",
           catch="test_pointwise_chains_run_in_the_one_shot_kernel[ar_pointwise_other_dtype]"),
    Mutant("prologue_moved_past_a_write", "CL-17", _CL,
           "            if _written_between(current, anchor, source):\n                break\n",
           "",
           "the prologue moved to the all_reduce past an in-place write of its source",
           catch="test_pointwise_chains_run_in_the_one_shot_kernel[ar_pointwise_source_written]"),
    Mutant("fresh_test_reads_a_namespace_of_any_target", "CL-15", _CL,
           'node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload)',
           'node.op != "call_function" and not isinstance(node.target, torch._ops.OpOverload)',
           "`or` written `and`: a getitem's target is asked for its ATen namespace",
           catch="test_all_reduce_of_one_result_of_a_multi_output_op[plain]"),
    Mutant("view_taken_for_its_own_buffer", "CL-17", _CL,
           '    while (node.op == "call_function" and',
           '    while (node.op != "call_function" and',
           "the base of a view is the view itself: a write through a view of the source is missed",
           catch=(
               "test_pointwise_chains_run_in_the_one_shot_kernel[ar_pointwise_source_written_through_a_view]")),
    Mutant("any_alias_annotation_counts_as_a_write", "CL-17", _CL,
           "            if a.alias_info is not None and a.alias_info.is_write]",
           "            if a.alias_info is not None or a.alias_info.is_write]",
           "every in-place op taken to write the prologue's source: the prologue is not fused",
           catch=(
               "test_pointwise_chains_run_in_the_one_shot_kernel[ar_pointwise_other_buffer_written]")),
    Mutant("schema_of_no_op_read", "CL-17", _CL,
           "    if schema is None or not schema.is_mutable:\n        return []\n    bound = "
           "_fx.arguments(node, rule)",
           "    if schema is None and not schema.is_mutable:\n        return []\n    bound = "
           "_fx.arguments(node, rule)",
           "`or` written `and`: a getitem between the prologue and the all_reduce is asked "
           "for its schema",
           catch=(
               "test_pointwise_chains_run_in_the_one_shot_kernel[ar_pointwise_other_buffer_written]")),
    Mutant("coalesced_refuses_its_contiguous_members", "CL-5", _CL,
           "        bad = [inp.name for inp in node.args[0] if not _is_contiguous(inp)]",
           "        bad = [inp.name for inp in node.args[0] if _is_contiguous(inp)]",
           "the refusal's filter inverted: contiguous members are the ones refused",
           catch="test_all_reduce_coalesced_inplace_stays_in_place"),
    Mutant("step_of_any_dtype", "CL-17", _CL,
           "            or val.shape != source.shape:",
           "            and val.shape != source.shape:",
           "`or` written `and`: an int32 step taken into a float-only chain",
           catch="test_pointwise_chains_run_in_the_one_shot_kernel[ar_pointwise_int32]"),
    Mutant("lowered_without_the_code_generator", "CL-1", "refimpl/comm_lowering.py",
           "    graph = _fx.empty_graph_like(gm)\n    outputs =",
           "    graph = torch.fx.Graph()\n    outputs =",
           "the copy made bare, with FX's plain code generator: a program of a dict "
           "(make_fx's pytree code generator) takes flattened inputs and returns a list",
           catch="test_the_lowered_program_takes_and_returns_what_the_traced_one_does"),
    Mutant("catalogue_row_missing", "CL-5", COMM_OPS,
           '"all_reduce_coalesced", "all_reduce_coalesced_", "all_to_all_single",',
           '"all_reduce_coalesced", "all_to_all_single",',
           "an op of refimpl's library left out of the catalogue (a row deleted, or never "
           "written for a new op): a pass that meets it must say so, not default it",
           catch="test_all_reduce_coalesced_becomes_clones_plus_inplace"),
    Mutant("force_one_shot_reason_order", "CL-21", _CL,
           "    if not _symm_mem_enabled(group_name):\n        return f\"symmetric "
           "memory is not enabled for group {group_name!r}\"\n    if reduce_op.lower() "
           "!= \"sum\":\n        return f\"reduce_op is {reduce_op!r}; one-shot "
           "all-reduce only sums\"\n",
           "    if reduce_op.lower() != \"sum\":\n        return f\"reduce_op is "
           "{reduce_op!r}; one-shot all-reduce only sums\"\n    if not "
           "_symm_mem_enabled(group_name):\n        return f\"symmetric memory is not "
           "enabled for group {group_name!r}\"\n",
           "Running the cheap reduce-op check before the symmetric-memory check means "
           "the refusal no longer names the first CL-10 condition that fails. (red team)",
           catch="test_forced_one_shot_refusal_names_the_first_condition_that_"
                 "fails[symmetric_memory]"),
    Mutant("fused_buffer_index_not_advanced", "CL-12", _CL,
           "self.next_alloc_id(group_name, _val(inp)),",
           "_alloc_id(self.fingerprint, self.config.alloc_id_namespace, "
           "self.next_buffer, group_name, _val(inp)),",
           "Working out the id inline on the prologue path of the fused kernel forgets "
           "to advance the buffer index, so the next comm buffer reuses that index. "
           "(red team)",
           catch="test_a_fused_prologue_buffer_takes_the_next_alloc_id"),
    Mutant("falsy_config_read_as_default", "CL-1", _CL,
           "    config = CommLoweringConfig() if config is None else config",
           "    config = config or CommLoweringConfig()",
           "None and any falsy config read alike as 'take the default', so a config of "
           "another type that happens to be falsy ({} or 0) is lowered with the default "
           "instead of being refused (red team, found in refimpl)",
           catch="test_lower_refuses_what_it_cannot_lower[empty_config_of_anot"
                 "her_type]"),
    Mutant("out_of_place_list_checked_as_tuple", "CL-6", _CL,
           "if isinstance(first, (list, tuple)) \\",
           "if isinstance(first, tuple) \\",
           "FX stores a Tensor[] argument as an immutable_list, not a tuple, so a "
           "coalesced out-of-place collective's list is passed through whole and its "
           "non-contiguous members are never cloned. The single form is still handled. "
           "(red team)",
           catch="test_a_coalesced_op_reads_a_contiguous_copy_of_its_view_memb"
                 "er[all_gather]"),
    Mutant("fingerprint_group_order_not_recorded", "CL-12", _CL,
           "            name = groups.setdefault(name, f\"group #{len(groups)}\")",
           "            name = groups.get(name, f\"group #{len(groups)}\")",
           "Using get instead of setdefault means no group is ever recorded, so every "
           "group is spelled 'group #0'. Graphs that differ only in which group each op "
           "names get the same fingerprint, and therefore the same alloc_ids. (red team)",
           catch="test_alloc_ids_tell_apart_graphs_that_differ_only_in_a_group"),
    Mutant("prologue_write_check_from_input", "CL-17", _CL,
           "            if _written_between(current, anchor, source):",
           "            if _written_between(inp, anchor, source):",
           "The check for writes to the chain's starting tensor scans from the "
           "all_reduce's input, not from the chain's first step, so a write between an "
           "earlier step and the input goes unnoticed and the kernel reads the tensor "
           "after it was modified. (red team)",
           catch="test_a_write_between_the_prologues_steps_ends_it_there"),
    Mutant("sub_operands_swapped", "CL-17", _CL,
           "_COMMUTATIVE = (\"add\", \"mul\")",
           "_COMMUTATIVE = (\"add\", \"sub\", \"mul\")",
           "Lets the number come first for every step op ('a tensor and a number, in "
           "either order'), forgetting that sub does not commute: sub(2.0, x) is taken "
           "for the step 'sub 2.0', which computes x - 2. (red team)",
           catch="test_a_number_first_sub_is_no_step"),
    Mutant("producer_val_keeps_old_strides", "CL-1", _CL,
           "    node.meta[\"val\"] = buffer.meta[\"val\"]\n    "
           "node.meta[COMM_BUFFER_META] = buffer.meta[COMM_BUFFER_META]",
           "    node.meta[COMM_BUFFER_META] = buffer.meta[COMM_BUFFER_META]",
           "Rewrites the producer to its out= overload but keeps its traced fake value, "
           "forgetting that writing into the contiguous comm buffer changes the layout "
           "of its result whenever the traced result was not contiguous. (red team)",
           catch="test_a_realized_non_contiguous_producer_has_a_contiguous_meta_val"),
]

# --------------------------------------------------------------------------------------
# 3. Bucketing (BK)
# --------------------------------------------------------------------------------------
_BK = "refimpl/bucketing.py"
BK = [
    Mutant("coalesced_option_left_unused", "BK-25", _BK,
           "            _MergeOptions(agree_across_ranks=agree_across_ranks, "
           "coalesced=coalesced),\n",
           "            _MergeOptions(agree_across_ranks=agree_across_ranks),\n",
           "the option checked and dropped: a coalesced bucket still copied into one buffer",
           catch="test_a_coalesced_bucket_is_one_coalesced_reduce_scatter[2-bf16]"),
    Mutant("coalesced_results_taken_in_one_place", "BK-25", _BK,
           "    for piece, inp in zip(pieces, bucket.inputs, strict=True):\n",
           "    for piece, inp in zip(pieces[:1] * len(pieces), bucket.inputs, strict=True):\n",
           "every member waits for the coalesced collective's first result (the wrong getitem "
           "for a member: shapes differ, values too)",
           catch="test_a_coalesced_bucket_is_one_coalesced_reduce_scatter[4-f32]"),
    Mutant("dedup_stops_after_its_first_merge", "BK-26", _BK,
           "        removed += _merge_summands(gm.graph, add)\n",
           "        if not removed:\n            removed += _merge_summands(gm.graph, add)\n",
           "one pair merged per call: a sum of three parts keeps two reduce_scatters",
           catch="test_summed_reduce_scatters_become_one_of_the_summed_inputs[2-bf16-3-avg]"),
    Mutant("dedup_avg_not_linear", "BK-26", _BK,
           '_LINEAR_REDUCE_OPS = ("sum", "avg")',
           '_LINEAR_REDUCE_OPS = ("sum",)',
           "avg taken for a nonlinear reduction: averaged parts are left unmerged",
           catch="test_summed_reduce_scatters_become_one_of_the_summed_inputs[2-bf16-3-avg]"),
    Mutant("dedup_counts_merges_not_removed_collectives", "BK-26", _BK,
           "        removed += _merge_summands(gm.graph, add)\n",
           "        removed += 2 * _merge_summands(gm.graph, add)\n",
           "the return counts both reduce_scatters of each merged pair, not the one removed",
           catch="test_summed_reduce_scatters_become_one_of_the_summed_inputs[2-f32-2-sum]"),
    Mutant("dedup_shapes_not_compared", "BK-27", _BK,
           "            and x.dtype == y.dtype and x.shape == y.shape)",
           "            and x.dtype == y.dtype)",
           "upstream's slip (finding 27): results that broadcast on dim 0 are merged",
           catch="test_a_sum_one_reduce_scatter_would_not_give_is_left_alone[shape_broadcasts]"),
    Mutant("dedup_alpha_ignored", "BK-27", _BK,
           '            and node.kwargs.get("alpha", 1) == 1)',
           "            )",
           "an add with alpha matched as a plain add, alpha dropped (upstream 2.13's slip)",
           catch="test_a_sum_one_reduce_scatter_would_not_give_is_left_alone[alpha]"),
    Mutant("dedup_reduce_ops_not_compared", "BK-27", _BK,
           "            and op_a == op_b and op_a in _LINEAR_REDUCE_OPS",
           "            and op_a in _LINEAR_REDUCE_OPS and op_b in _LINEAR_REDUCE_OPS",
           "each reduce op checked for linearity, not the two for equality: sum beside avg "
           "merged under the first's op",
           catch="test_a_sum_one_reduce_scatter_would_not_give_is_left_alone[sum_and_avg]"),
    Mutant("dedup_groups_compared_by_size", "BK-27", _BK,
           '    return (a["group_name"] == b["group_name"] and a["group_size"] == b["group_size"]',
           '    return (a["group_size"] == b["group_size"]',
           "two groups of one size taken for one group: rows of other ranks summed as this "
           "group's",
           catch="test_a_sum_one_reduce_scatter_would_not_give_is_left_alone[other_group]"),
    Mutant("dedup_max_taken_for_linear", "BK-27", _BK,
           "            and op_a == op_b and op_a in _LINEAR_REDUCE_OPS",
           "            and op_a == op_b",
           "any reduce op merged: max(a) + max(b) rewritten as max(a + b)",
           catch="test_a_sum_one_reduce_scatter_would_not_give_is_left_alone[max]"),
    Mutant("dedup_dtypes_not_compared", "BK-27", _BK,
           "            and x.dtype == y.dtype and x.shape == y.shape)",
           "            and x.shape == y.shape)",
           "parts of two dtypes merged: the narrower part is no longer reduced in its dtype",
           catch="test_a_sum_one_reduce_scatter_would_not_give_is_left_alone[other_dtype]"),
    Mutant("dedup_wait_read_again_merged", "BK-27", _BK,
           "    if not _is_single_wait(wait) or len(wait.users) != 1:\n",
           "    if not _is_single_wait(wait):\n",
           "a summand's wait read by another node too is merged (its reader loses its value)",
           catch="test_a_sum_one_reduce_scatter_would_not_give_is_left_alone[read_again]"),
    Mutant("module_plan_backward_stack_unread", "BK-28", _BK,
           '    stack = node.meta.get("nn_module_stack") or '
           'node.meta.get("fwd_nn_module_stack") or {}\n',
           '    stack = node.meta.get("nn_module_stack") or {}\n',
           "only Dynamo's forward stack read: a backward graph's reduce_scatters belong to no "
           "entry and stay unbucketed",
           catch="test_each_module_plan_entry_makes_one_bucket_of_each_kind"),
    Mutant("module_plan_list_entry_read_by_its_first_fqn", "BK-28", _BK,
           "                if any(fqn == e or fqn.startswith(e + \".\") for e in entry):\n",
           "                if fqn == entry[0] or fqn.startswith(entry[0] + \".\"):\n",
           "an entry that lists modules matched by its first: layers.2 joins no bucket",
           catch="test_each_module_plan_entry_makes_one_bucket_of_each_kind"),
    Mutant("module_plan_entry_left_out_of_the_key", "BK-28", _BK,
           '            key += (f"module plan entry {entry}",)\n',
           "            pass\n",
           "every entry's candidates of a key share one bucket: the plan's entries merged",
           catch="test_each_module_plan_entry_makes_one_bucket_of_each_kind"),
    Mutant("module_plan_root_kept_in_the_fqn", "BK-28", _BK,
           '    path = _ROOT.sub("", path).replace("._modules", "")\n',
           '    path = path.replace("._modules", "")\n',
           "Dynamo's root (L['self']) left in front of every FQN: no module matches a plan",
           catch="test_each_module_plan_entry_makes_one_bucket_of_each_kind"),
    Mutant("module_plan_all_reduces_left_out", "BK-28", _BK,
           '    for name in ("all_gather", "reduce_scatter", "all_reduce"):\n'
           '        planner = _Planner(KINDS[name], _Caps(lambda _index: _UNBOUNDED_MIB)',
           '    for name in ("all_gather", "reduce_scatter"):\n'
           '        planner = _Planner(KINDS[name], _Caps(lambda _index: _UNBOUNDED_MIB)',
           "plans bucket gathers and scatters only (upstream 2.13's pass)",
           catch="test_each_module_plan_entry_makes_one_bucket_of_each_kind"),
    Mutant("module_plan_overlap_checked_for_equal_fqns_only", "BK-29", _BK,
           '            if a == b or b.startswith(a + ".") or a.startswith(b + "."):\n',
           "            if a == b:\n",
           "only an FQN listed twice refused: \"layers\" beside \"layers.0\" is taken",
           catch="test_overlapping_module_plans_are_refused_naming_them[parent_first]"),
    Mutant('module_plan_fqn_prefix_without_its_dot', 'BK-28', _BK,
           'if any(fqn == e or fqn.startswith(e + ".") for e in entry):',
           'if any(fqn.startswith(e) for e in entry):',
           "an entry's FQN matched as a plain prefix: head2 joins the entry head (blind red team)",
           catch='test_each_module_plan_entry_makes_one_bucket_of_each_kind'),
    Mutant('module_plan_overlap_checked_one_way', 'BK-29', _BK,
           'if a == b or b.startswith(a + ".") or a.startswith(b + "."):',
           'if a == b or b.startswith(a + "."):',
           'overlap caught only when the parent comes first: layers.1 before layers '
           'taken (blind red team)',
           catch='test_overlapping_module_plans_are_refused_naming_them[child_first]'),
    Mutant('module_plan_siblings_taken_for_overlapping', 'BK-29', _BK,
           '            if a == b or b.startswith(a + ".") or a.startswith(b + "."):',
           '            if b.startswith(a) or a.startswith(b):',
           'overlap tested as a plain prefix: siblings head and head2 refused (blind red team)',
           catch='test_modules_whose_names_share_a_prefix_do_not_overlap'),
    Mutant("coalesced_members_not_padded", "BK-25", _BK,
           "    inputs = [_padded_input(b, inp, group_size) for inp in bucket.inputs]\n"
           "    results = tuple(",
           "    inputs = list(bucket.inputs)\n    results = tuple(",
           "the coalesced path hands each input over as it is: a dim 0 the group size does "
           "not divide is not padded (upstream's coalesced mode)",
           catch="test_a_coalesced_bucket_pads_what_the_group_size_does_not_divide"),
    Mutant("coalesced_results_unpadded_by_the_padded_rows", "BK-25", _BK,
           "        rows = _val(inp).shape[0]\n        outs.append(_unpad(b, out, rows, bucket) "
           "if rows % group_size else out)",
           "        rows = _val(inp).shape[0]\n        outs.append(out)",
           "a padded member's result is not cut back to this rank's real rows",
           catch="test_a_coalesced_bucket_pads_what_the_group_size_does_not_divide"),
    Mutant("bk24_only_own_plan_checked", "BK-24", _BK,
           '        if all(_used_agreed_caps(post, caps.agreed) for post in posts.values()):\n',
           '        if _used_agreed_caps(posts[agreement.me], caps.agreed):\n',
           "The implementer stops when this rank's own plan used agreed caps only, not every "
           "rank's: a rank whose groups settle sooner leaves the rounds while a rank of "
           'another group (a row of subgroups with a longer cap cascade) posts a next round '
           'and times out (PeerTimeout) instead of agreeing. (red team)',
           catch="test_rows_whose_agreement_takes_more_rounds_keep_the_others_in_step"),
    Mutant("bk24_absent_family_not_refused", "BK-24", _BK,
           '        seen = {r: posts[r]["sizes"].get(family) for r in _family_ranks(family)}\n',
           '        seen = {r: posts[r]["sizes"][family] for r in _family_ranks(family)\n'
           '                if family in posts[r]["sizes"]}\n',
           'Only ranks of the group that posted the family are compared, so a rank of the '
           'group holding none of its candidates is no longer refused: one rank merges '
           'buckets its peer never issues (no ValueError naming BK-24). (red team)',
           catch="test_a_rank_missing_a_key_its_group_holds_is_refused_on_every_rank"),
    Mutant("bk24_slot_agreed_before_group_posted", "BK-24", _BK,
           '            if all(_slot_text(slot) in post["own"] for post in group):\n'
           '                caps.agreed[slot] = min(post["own"][_slot_text(slot)] '
           'for post in group)\n',
           '            posted = [post["own"][_slot_text(slot)] for post in group\n'
           '                      if _slot_text(slot) in post["own"]]\n'
           '            if posted:\n'
           '                caps.agreed[slot] = min(posted)\n',
           'A slot is agreed as soon as any rank of its group posted a cap for it, not when '
           'every rank did: a rank that never opened that bucket is never asked its cap for '
           'it (BK-3) and its smaller cap is left out of the minimum, so the agreed cap '
           "isn't the group's smallest. (red team)",
           catch="test_ranks_with_their_own_caps_make_one_set_of_buckets[all_gather_caps_by_index]"),
    Mutant("bk3_cap_cached_per_index", "BK-3", _BK,
           '        if slot not in self.own:\n'
           '            self.own[slot] = _cap_bytes(self.cap_fn, slot[1])\n'
           '        return self.own[slot]\n',
           '        if slot[1] not in self.own:\n'
           '            self.own[slot[1]] = _cap_bytes(self.cap_fn, slot[1])\n'
           '        return self.own[slot[1]]\n',
           'The own-cap cache is keyed by the bucket index alone rather than by (family, '
           'index), so bucket_cap_mb_by_bucket_idx is asked once per index across all keys '
           'instead of once per bucket index of each key. (red team)',
           catch="test_bucket_indices_count_within_their_own_key[all_gather_dtype]"),
    Mutant("bk24_p2p_only_graph_agrees", "BK-24", _BK,
           '    return any(comm_ops.collective_family(n) not in (None, "point_to_point")\n'
           '               for n in gm.graph.nodes)\n',
           '    return any(comm_ops.collective_family(n) is not None\n'
           '               for n in gm.graph.nodes)\n',
           'Point-to-point ops are not excepted when deciding whether the world must agree, '
           'so a pipeline stage whose graph only sends/receives joins the store exchange and '
           'waits for ranks that never run it (PeerTimeout) instead of planning alone. (red '
           'team)',
           catch="test_a_stage_of_point_to_point_ops_alone_is_bucketed_without_waiting"),
    Mutant("candidate_whose_first_user_is_a_wait", "BK-1", _BK,
           "    if len(node.users) != 1:\n        return False\n    (user,) = node.users\n",
           "    if not node.users:\n        return False\n    user = next(iter(node.users))\n",
           "The 'only user is its wait' test is weakened to 'its first user is a wait', so a "
           "collective that also has other users (a second wait, a clone, the output) is taken "
           "as a candidate. (red team)",
           catch="test_a_collective_waited_twice_is_no_candidate"),
    Mutant("bucket_key_by_itemsize", "BK-20", _BK,
           "        key += (_val(node).dtype,)\n",
           "        key += (_val(node).dtype.itemsize,)\n",
           "the key holds the element size, not the dtype: float16 and bfloat16 (or float32 "
           "and int32) members share a bucket",
           catch="test_every_key_component_separates_buckets[same_size_dtype]"),
    Mutant("only_refimpl_waits_make_candidates", "BK-1", _BK,
           "_WAITS = comm_ops.targets(family=\"wait\", in_place=False)",
           "_WAITS = frozenset({torch.ops.refimpl_c10d.wait_tensor.default})",
           "a candidate's wait is looked for in refimpl's namespace only: collectives of "
           "upstream's _c10d_functional, waited by upstream's wait, are never merged",
           catch="test_collectives_of_upstreams_namespace_are_candidates[bucket_all_gather]"),
    Mutant("absorbed_casts_concatenated_as_the_first_source", "BK-9", _BK,
           "        cat = b.cat(flats, 0, _promoted(flats))\n        # copy_ converts",
           "        cat = b.cat(flats, 0, flats[0].meta[\"val\"].dtype)\n        # copy_ converts",
           "the concatenation of absorbed casts' sources takes the first source's dtype: "
           "sources of f32 and f64 give a concatenation whose meta says f32",
           catch="test_casts_from_sources_of_different_dtypes_are_absorbed"),
    Mutant("promotion_skips_the_first_member", "BK-9", "refimpl/bucketing.py",
           '    dtype = nodes[0].meta["val"].dtype\n    for n in nodes[1:]:',
           '    dtype = nodes[1].meta["val"].dtype\n    for n in nodes[1:]:',
           "the concatenation's dtype promoted from the second member on: an absorbed f32 "
           "cast source first and a kept bf16 cast after it give a bf16 meta to an f32 "
           "concatenation (no case put the wider source first)",
           catch="test_a_kept_cast_after_an_absorbed_one[out_of_place]"),
    Mutant("bucket_reaches_bucket_0_from_the_start", "BK-4", "refimpl/bucketing.py",
           "    reaches: int = 0", "    reaches: int = 1",
           "the reach bitset starts at 1 for 0: every bucket seems to reach bucket 0, so a "
           "candidate depending on bucket 0 of another key is left alone, and the count "
           "of collectives came out the same in the three-key case",
           catch="test_a_cycle_through_two_other_buckets_is_not_closed"),
    Mutant("log_candidates_without_left_alone", "BK-15", "refimpl/bucketing.py",
           "    candidates = sum(len(b.members) for b in planner.buckets) + planner.skipped",
           "    candidates = sum(len(b.members) for b in planner.buckets)",
           "the INFO line's candidates leave out those left alone (no case read its numbers)",
           catch="test_passes_log_under_refimpl_bucketing_only"),
    Mutant("mib_of_1025_kib", "BK-21", "refimpl/bucketing.py",
           "MiB = 1024 * 1024", "MiB = 1025 * 1024",
           "a MiB a KiB too large: caps given in exact bytes truncate back to the same "
           "count, so only a cap in a fraction of a MiB shows it",
           catch="test_a_cap_in_mib_counts_2_to_the_20_bytes[one_row_over]"),
    Mutant("padding_meta_keeps_the_first_dim", "BK-7", "refimpl/bucketing.py",
           "                  val=b.fake([rows, *val.shape[1:]], val.dtype))",
           "                  val=b.fake([rows, *val.shape[:]], val.dtype))",
           "[:] for [1:]: the padded input's meta val has the padded rows and then every "
           "dim of the input again",
           catch="test_padded_reduce_scatter_gives_each_rank_its_chunk[2]"),
    Mutant("reduce_scatter_member_strides_ignored", "BK-10", "refimpl/bucketing.py",
           '        if not inp.meta["val"].is_contiguous():\n'
           "            inp = b.call(aten.clone.default",
           "        if False:\n            inp = b.call(aten.clone.default",
           "a member's input laid out as [group size, -1] by a view whatever its strides: "
           "a transposed input fails, where the op would have read it in logical order",
           catch=(
               "test_ops_on_transposed_views_are_bucketed_in_their_logical_order[bucket_reduce_scatter]")),
    Mutant("static_size_checked_on_any_dim", "BK-19", "refimpl/bucketing.py",
           "if not all(isinstance(s, int) for s in val.shape):",
           "if not any(isinstance(s, int) for s in val.shape):",
           "any for all: a candidate with one symbolic dim beside a static one passes as "
           "static, and its byte size is a symbol",
           catch="test_a_candidate_of_symbolic_size_is_refused_naming_it[one_dim_symbolic]"),
    Mutant("second_pass_reuses_the_largest_index", "BK-17", _BK,
           "    return max(used) + 1 if used else 0\n", "    return max(used) if used else 0\n",
           "a later pass numbers its buckets from the largest index there, not after it",
           catch="test_a_second_pass_numbers_on_and_absorbs_the_blocks_it_merges"),
    Mutant("absorbed_blocks_keep_their_index", "BK-17", _BK,
           "    if not absorbed:\n        return\n", "    if absorbed:\n        return\n",
           "the check inverted: the blocks a new bucket merges keep their old index",
           catch="test_a_second_pass_numbers_on_and_absorbs_the_blocks_it_merges"),
    Mutant("cap_type_check_and", "BK-3", _BK,
           "if isinstance(cap, bool) or not isinstance(cap, (int, float)) or",
           "if isinstance(cap, bool) and not isinstance(cap, (int, float)) or",
           "`or` written `and`: a cap of True, or of a string, is not refused as no number",
           catch="test_bad_arguments_are_refused_naming_them[cap_true]"),
    Mutant("candidate_user_any_call", "BK-1", _BK,
           'return user.op == "call_function" and user.target in _WAITS and user.args[0] is node',
           'return user.op == "call_function" or user.target in _WAITS and user.args[0] is node',
           "`and` written `or`: a collective whose one user is any op counts as a candidate",
           catch="test_a_collective_whose_user_is_not_its_wait_is_no_candidate"),
    Mutant("candidate_user_any_reader", "BK-1", _BK,
           'return user.op == "call_function" and user.target in _WAITS and user.args[0] is node',
           'return user.op == "call_function" and user.target in _WAITS or user.args[0] is node',
           "`and` written `or`: a collective whose one user reads it first counts as a "
           "candidate, wait or not",
           catch="test_a_collective_whose_user_is_not_its_wait_is_no_candidate"),
    Mutant("cast_skipped_without_the_out_variant", "BK-9", _BK,
           '        if cat.meta["val"].dtype != dtype:\n',
           '        if cat.meta["val"].dtype == dtype:\n',
           "the out-of-place gather casts only what needs no cast: a bf16 bucket of f32 "
           "params is gathered in f32",
           catch="test_all_gather_without_the_out_variant_gathers_the_cast_concatenation"),
    Mutant("cap_exclusive", "BK-21", _BK,
           "bucket.size_bytes + size > bucket.cap_bytes:",
           "bucket.size_bytes + size >= bucket.cap_bytes:",
           "a bucket that would exactly fill its cap is closed",
           catch="test_a_bucket_that_exactly_fills_its_cap_keeps_its_last_member"),
    Mutant("cap_of_bucket_zero_for_all", "BK-3", _BK,
           "bucket = self._new_bucket(key, bucket.index + 1)",
           "bucket = self._new_bucket(key, bucket.index)",
           "the next bucket keeps index 0, so cap(0) is asked for every bucket",
           catch="test_caps_are_asked_per_bucket_index"),
    Mutant("size_is_the_output", "BK-21", _BK,
           "return max(out.numel() * out.element_size(), inp.numel() * inp.element_size())",
           "return out.numel() * out.element_size()",
           "a member counted by its output only (a reduce_scatter's input is larger)",
           catch="test_reduce_scatter_members_count_their_input_bytes[exactly_full]"),
    Mutant("key_without_dtype", "BK-20", _BK,
           "    if not mixed_dtypes:\n        key += (_val(node).dtype,)",
           "    if mixed_dtypes:\n        key += (_val(node).dtype,)",
           "the dtype left out of the key (condition inverted)",
           catch="test_every_key_component_separates_buckets[dtype]"),
    Mutant("key_without_reduce_op", "BK-20", _BK,
           "    if call.reduce_op is not None:\n",
           "    if call.reduce_op is None:\n",
           "the reduce op left out of the key (condition inverted)",
           catch="test_two_groups_interleaved[bucket_all_gather]"),
    Mutant("key_reduce_op_case_sensitive", "BK-20", _BK,
           "        key += (call.reduce_op.lower(),)",
           "        key += (call.reduce_op,)",
           "'SUM' and 'sum' taken for different reduce ops",
           catch="test_every_key_component_separates_buckets[reduce_op_rs]"),
    Mutant("key_by_group_size", "BK-20", _BK,
           "    key: tuple = (call.group_name,)",
           "    key: tuple = (call.group_size,)",
           "groups told apart by their size, not their name",
           catch="test_every_key_component_separates_buckets[group]"),
    Mutant("dependency_on_open_bucket_only", "BK-4", _BK,
           "upstream & (bucket.bit | bucket.reaches)",
           "upstream & bucket.bit",
           "dependency checked against the open bucket itself, not what reaches it",
           catch="test_a_merge_that_would_close_a_cycle_across_keys_is_not_made"),
    Mutant("reach_not_propagated", "BK-4", _BK,
           "                if (other.bit | other.reaches) & upstream:",
           "                if other.bit & upstream:",
           "only buckets feeding the node directly learn that they reach its bucket",
           catch="test_a_cycle_through_two_other_buckets_is_not_closed"),
    Mutant("bucket_at_its_first_member", "BK-7", _BK,
           "return position[unit.members[-1]] if isinstance(unit, Bucket)",
           "return position[unit.members[0]] if isinstance(unit, Bucket)",
           "the merged collective placed where the bucket's first member was",
           catch="test_nodes_that_read_no_member_keep_their_place"),
    Mutant("dtype_view_keeps_byte_count", "BK-7", _BK,
           "    shape[-1] = shape[-1] // dtype.itemsize\n",
           "",
           "the view of the gathered bytes as a member's dtype keeps the byte count as its "
           "last size in meta: values right, every later pass reads a size itemsize times "
           "too large",
           catch="test_all_gather_mixed_dtypes"),
    Mutant("slot_at_rank_modulo", "BK-8", _BK,
           "    return call.ranks.index(me)",
           "    return me % len(call.ranks)",
           "this rank's slot from rank % group size instead of its index in the group",
           catch="test_group_index_is_the_position_among_sorted_ranks[bucket_all_gather]"),
    Mutant("padding_one_row_too_many", "BK-10", _BK,
           "    return -(-rows // group_size) * group_size",
           "    return (rows // group_size + 1) * group_size",
           "a full extra row of padding, even when the group size divides dim 0",
           catch="test_zero_size_members_are_merged[reduce_scatter]"),
    Mutant("unpad_keeps_padding", "BK-23", _BK,
           "    keep = max(0, min(chunk, rows - start))",
           "    keep = max(0, min(chunk, rows))",
           "the last rank's chunk keeps the padding rows",
           catch="test_padded_reduce_scatter_gives_each_rank_its_chunk[2]"),
    Mutant("single_buckets_rewritten", "BK-5", _BK,
           "    buckets = [b for b in planner.buckets if len(b.members) > 1]\n    merged",
           "    buckets = [b for b in planner.buckets if len(b.members) >= 1]\n    merged",
           "a bucket of one is rewritten too",
           catch="test_a_member_larger_than_the_cap_sits_alone_between_buckets"),
    Mutant("cast_with_two_readers_absorbed", "BK-9", _BK,
           "node.target not in _CASTS or len(node.users) != 1:",
           "node.target not in _CASTS or len(node.users) < 1:",
           "a cast that something else reads is absorbed into the copy-in",
           catch="test_a_cast_with_another_reader_is_kept"),
    Mutant("unknown_reduce_op_accepted", "BK-16", _BK,
           "reduce_op.lower() not in _fx.REDUCE_OPS:",
           "reduce_op.lower() not in _fx.REDUCE_OPS + ('median',):",
           "the reduce op checked against a list that is too long",
           catch="test_bad_candidates_are_refused_naming_the_node[unknown_reduce_op]"),
    Mutant("group_size_unchecked", "BK-16", _BK,
           "    if size != len(ranks):\n",
           "    if size > len(ranks):\n",
           "group_size compared with > instead of !=",
           catch="test_bad_candidates_are_refused_naming_the_node[group_size_too_small]"),
    Mutant("repeated_wait_removed_despite_a_write", "BK-18", _BK,
           "        if earlier[1] is node or last_write > earlier[0]:",
           "        if earlier[1] is node:",
           "upstream's rule taken over: a repeated wait goes although a write after the first "
           "wait tells refimpl's copying waits apart",
           catch="test_a_wait_stays_where_a_write_tells_the_results_apart"),
    Mutant("writes_checked_after_the_later_wait", "BK-18", _BK,
           "        if earlier[1] is node or last_write > earlier[0]:",
           "        if earlier[1] is node or last_write > position:",
           "the writes looked for after the wait being removed, not after the first one: a "
           "write between the two is missed",
           catch="test_a_wait_stays_where_a_write_tells_the_results_apart"),
    Mutant("wait_of_a_wait_not_followed", "BK-18", _BK,
           "        while _is_single_wait(waited):  # a wait of a wait",
           "        while False and _is_single_wait(waited):  # a wait of a wait",
           "a wait of a wait keyed by the inner wait, not by the value waited for: chains "
           "stay",
           catch="test_a_chain_of_waits_collapses_onto_its_first"),
    Mutant("wait_block_not_opened", "BK-17", _BK,
           '        self.block = (f"{kind}_wait", index)',
           '        self.block = (kind, index)',
           "the wait and copy-outs tagged as the collective's block",
           catch="test_fsdp_blocks_are_tagged_in_program_order"),
    Mutant("cast_to_an_integer_absorbed", "BK-22", "refimpl/bucketing.py",
           "            and node.meta[\"val\"].dtype.is_floating_point)",
           "            or node.meta[\"val\"].dtype.is_floating_point)",
           "`and` written `or`: a cast from a float to int32 is taken into the bucket's copy",
           catch="test_a_cast_to_an_integer_dtype_is_kept"),
    Mutant("cast_from_an_integer_absorbed", "BK-22", "refimpl/bucketing.py",
           "    return (isinstance(src, torch.fx.Node) and "
           "src.meta[\"val\"].dtype.is_floating_point",
           "    return (isinstance(src, torch.fx.Node)",
           "only the cast's result dtype checked: a cast from int32 to bf16 is taken into the "
           "bucket's copy",
           catch="test_a_cast_from_an_integer_dtype_is_kept"),
    Mutant("wait_of_a_list_taken_for_a_candidates_wait", "BK-1", _BK,
           "user.target in _WAITS and user.args[0] is node",
           "user.target in _WAITS and node in user.all_input_nodes",
           "the wait found among the user's inputs, not as its argument: collectives "
           "waited together by one wait_tensors become candidates",
           catch="test_collectives_waited_together_are_no_candidates[bucket_all_gather]"),
    Mutant("cap_index_counts_all_keys", "BK-3", _BK,
           "bucket = self._new_bucket(key, bucket.index + 1)",
           "bucket = self._new_bucket(key, len(self.buckets))",
           "Numbers a new bucket by how many buckets the pass has opened so far, across "
           "keys, instead of counting within its own key. (red team)",
           catch="test_bucket_indices_count_within_their_own_key[all_gather_dtype]"),
    Mutant("dedup_waits_after_bucketing", "BK-18", "refimpl/compile.py",
           "    deduplicate_waits(gm, recompile=False)\n    bucket_all_gather(gm, cap, "
           "recompile=False)\n    bucket_reduce_scatter(gm, cap, recompile=False)\n",
           "    bucket_all_gather(gm, cap, recompile=False)\n    "
           "bucket_reduce_scatter(gm, cap, recompile=False)\n    deduplicate_waits(gm, "
           "recompile=False)\n",
           "Wait deduplication is done as a clean-up after bucketing rather than before "
           "it, so a collective that is waited twice still has two users when the "
           "bucketing pass checks it, and is not a candidate (BK-1). (red team)",
           catch="test_a_gather_waited_twice_is_bucketed_by_the_compile_backend"),
    Mutant("schemaless_call_not_a_write", "BK-18", _BK,
           "    return schema is None or schema.is_mutable",
           "    return schema is not None and schema.is_mutable",
           "Treats a call with no schema (a Python function or operator.*) as pure, "
           "when SPEC counts it as something that may write in place. (red team)",
           catch="test_a_wait_stays_where_a_call_without_a_schema_may_write[py"
                 "thon_function]"),
    Mutant("out_variant_is_candidate", "BK-1", _BK,
           "    return comm_ops.targets(family=family, completes=\"wait\", "
           "in_place=False, coalesced=False,\n                            out=False)",
           "    return comm_ops.targets(family=family, completes=\"wait\", "
           "in_place=False, coalesced=False)",
           "Treats all_gather_into_tensor_out (and reduce_scatter_tensor_out) as the "
           "out-of-place op with a caller-provided buffer, so it becomes a candidate. "
           "BK-1 names only the out-of-place forms, and a merged _out node's out buffer "
           "is never written. (red team)",
           catch="test_a_second_call_finds_no_candidate_in_merged_out_variants[f32]"),
    Mutant("all_gather_out_row_not_out", "BK-1", COMM_OPS,
           "    \"all_gather_into_tensor_out\": dict(_ALL_GATHER, out=True),",
           "    \"all_gather_into_tensor_out\": _ALL_GATHER,",
           "The out flag is dropped from the all_gather out row (while "
           "reduce_scatter_tensor_out keeps it), so by its fields "
           "all_gather_into_tensor_out reads as a plain out-of-place all_gather: a "
           "bucketing candidate (targets(family='all_gather', coalesced=False, "
           "out=False)) and lowered as 'out of place' instead of 'into out' (CL-6, "
           "CL-7). (red team)",
           catch="test_out_variants_read_only_by_their_wait_are_no_candidates["
                 "all_gather]"),
    Mutant("dependency_checked_after_cap", "BK-4", _BK,
           "        if bucket is not None and upstream & (bucket.bit | bucket.reaches):",
           "        if bucket is not None and bucket.size_bytes + size <= "
           "bucket.cap_bytes \\\n                and upstream & (bucket.bit | "
           "bucket.reaches):",
           "Asks whether a candidate depends on the open bucket only when it would fit, "
           "reasoning that an overflowing candidate opens the next bucket anyway. A "
           "dependent candidate that overflows then closes the bucket, when it should "
           "be left alone and the bucket kept open. (red team)",
           catch="test_a_dependent_candidate_too_large_for_the_bucket_leaves_i"
                 "t_open[all_gather]"),
    Mutant("one_byte_dtypes_not_viewed_back", "BK-12", _BK,
           "    if dtype == torch.uint8:\n        return node",
           "    if dtype.itemsize == 1:\n        return node",
           "Assumes a one-byte dtype needs no view back from the byte buffer, "
           "forgetting that int8, bool and float8 are not uint8. Their pieces come out "
           "as uint8 although meta['val'] says otherwise. (red team)",
           catch="test_mixed_dtypes_view_one_byte_dtypes_back[world]"),
    Mutant("block_numbered_by_plan_order", "BK-17", _BK,
           "        builder = _LayoutBuilder(graph, _val(unit.members[0]), (kind.name, "
           "block_index))\n        block_index += 1",
           "        builder = _LayoutBuilder(graph, _val(unit.members[0]),\n            "
           "                     (kind.name, block_index + buckets.index(unit)))",
           "Numbers each merged bucket's block by the order in which the planner opened "
           "the buckets (first member), not by the program order of the merged "
           "collectives (last member). (red team)",
           catch="test_blocks_are_numbered_by_where_the_merged_collective_stan"
                 "ds[all_gather_dtype]"),
    Mutant("may_write_by_written_return", "BK-18", _BK,
           "    return schema is None or schema.is_mutable",
           "    return schema is None or any(r.alias_info is not None and "
           "r.alias_info.is_write\n                                 for r in "
           "schema.returns)",
           "Decides that an op writes in place when it returns a written alias (as add_ "
           "and copy_ do) and misses in-place ops that return nothing, such as the "
           "_foreach_*_ family. (red team)",
           catch="test_a_wait_stays_where_an_op_returning_nothing_writes[foreach_add_]"),
    Mutant("convert_element_type_not_absorbed", "BK-9", _BK,
           "_CASTS = frozenset({aten._to_copy.default, "
           "torch.ops.prims.convert_element_type.default})",
           "_CASTS = frozenset({aten._to_copy.default})",
           "Knows casts as make_fx writes Tensor.to (_to_copy) and forgets the "
           "prims.convert_element_type form that decompositions produce. Those casts "
           "are never folded into the bucket's copy. (red team)",
           catch="test_casts_written_as_convert_element_type_are_absorbed[bf16]"),
    Mutant("a_method_call_counted_as_no_writer", "BK-18", "refimpl/bucketing.py",
           '    if node.op != "call_function":\n'
           "        return True",
           '    if node.op != "call_function":\n'
           "        return False",
           "Nodes that are not call_function (call_method, call_module) are treated like "
           "placeholders as never writing, instead of as calls whose schema is unknown and"
           " may write in place. (red team)",
           catch="test_a_wait_stays_where_a_call_without_a_schema_may_write[method_call]"),
    Mutant("caps_never_agreed", "BK-24", _BK,
           "    ranks = real_world() if agree_across_ranks and _issues_collectives(gm) else ()\n",
           "    ranks = ()\n",
           "each rank buckets by its own cap function: the option taken and left unused",
           catch="test_ranks_with_their_own_caps_make_one_set_of_buckets[all_gather_f32]"),
    Mutant("largest_cap_agreed", "BK-24", _BK,
           '                caps.agreed[slot] = min(post["own"][_slot_text(slot)] '
           'for post in group)\n',
           '                caps.agreed[slot] = max(post["own"][_slot_text(slot)] '
           'for post in group)\n',
           "the ranks agree on the largest cap: alike, but past the cap a rank set",
           catch="test_ranks_with_their_own_caps_make_one_set_of_buckets[reduce_scatter_bf16]"),
    Mutant("caps_agreed_over_the_world", "BK-24", _BK,
           "            group = [posts[r] for r in _family_ranks(slot[0])]\n",
           "            group = list(posts.values())\n",
           "a slot's cap is the smallest over the world, not over its group's ranks: a row "
           "takes another row's cap",
           catch="test_each_group_takes_the_smallest_caps_of_its_own_ranks"),
    Mutant("other_candidates_not_refused", "BK-24", _BK,
           "        _refuse_other_candidates(agreement, posts)\n",
           "",
           "ranks holding gathers of other shapes agree on caps slot by slot as if the "
           "candidates were one",
           catch="test_ranks_holding_other_candidates_are_refused_on_every_rank"),
    Mutant("one_round_of_agreement", "BK-24", _BK,
           "        if all(_used_agreed_caps(post, caps.agreed) for post in posts.values()):\n",
           "        if True:\n",
           "the ranks post their caps once and each keeps the plan of its own: a step left out",
           catch="test_ranks_with_their_own_caps_make_one_set_of_buckets[all_reduce_int32]"),
    Mutant("failure_kept_to_its_rank", "BK-24", _BK,
           '            agreement.round({"error": f"{type(exc).__name__}: {exc}"})\n',
           "",
           "a rank whose cap function raises leaves without a word: the others wait for its "
           "post until the timeout",
           catch="test_a_rank_whose_caps_fail_is_named_on_every_rank"),
    Mutant("caps_asked_each_round", "BK-3", _BK,
           "        if slot not in self.own:\n"
           "            self.own[slot] = _cap_bytes(self.cap_fn, slot[1])\n",
           "        self.own[slot] = _cap_bytes(self.cap_fn, slot[1])\n",
           "the cap function asked again in every round of the agreement, not once per slot",
           catch="test_ranks_with_their_own_caps_make_one_set_of_buckets[all_gather_f32]"),
]

# --------------------------------------------------------------------------------------
# 4. Scheduler reorder (RO)
# --------------------------------------------------------------------------------------
_RO = "refimpl/reorder.py"
_RO_MEMORY = "refimpl/reorder_memory.py"  # the exact memory test of a move (RO-10)
_WORLD = "refimpl/_world.py"  # the ranks' agreement, shared with bucketing (BK-24)
RO = [
    Mutant("ro16_blocking_kernel_not_agreed", "RO-16", _RO,
           '    if not any(_issues_on_group(node) and collective_kind(node) != "point_to_point"\n'
           '               for node in body):\n',
           '    if not any(collective_kind(node) not in (None, "point_to_point")\n'
           '               for node in body):\n',
           'Only collectives trigger the agreement and blocking symmetric-memory kernels are '
           'forgotten, so a lowered graph whose only communication is one-shot all-reduce '
           "kernels is reordered from each rank's own cost model, with no refusal of "
           'differing graphs. (red team)',
           catch="test_ranks_with_other_graphs_of_blocking_kernels_only_are_refused"),
    Mutant("agreed_durations_left_unused", "RO-16", _RO,
           "            self.duration = agreed_durations(gm, self.body, self.duration)\n",
           "            agreed_durations(gm, self.body, self.duration)\n",
           "the ranks exchange their durations and agree, but each still decides from its "
           "own: a step left out",
           catch="test_ranks_with_their_own_cost_models_issue_collectives_in_one_order[2]"),
    Mutant("agreement_among_this_rank_s_groups", "RO-16", _RO,
           "    return real_world()\n",
           "    import torch.distributed as dist\n"
           "    return tuple(sorted({r for node in body if _issues_on_group(node) for r in "
           "dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(str("
           "_fx.arguments(node, 'RO-16')['group_name'])))})) if real_world() else ()\n",
           "(found by the fuzzer) the ranks to agree with taken from this rank's own groups: "
           "rows that cross give each rank another set, and each waits for the wrong ranks",
           catch="test_ranks_of_crossing_rows_issue_collectives_in_one_order"),
    Mutant("agreement_compares_constants", "RO-16", _RO,
           "    graph = graph_fingerprint(gm, constants=False)\n",
           "    graph = graph_fingerprint(gm)\n",
           "the ranks' graphs compared with their constants: a bucketed gather's copy-in "
           "offset differs between the ranks (BK-8), so a bucketed program is refused",
           catch="test_reordered_values_are_the_original_ones"
                 "[fsdp_forward_bucketed-budget=inf-all_gather=1-2]"),
    Mutant("another_graph_not_refused", "RO-16", _WORLD,
           '        other = [r for r in self.ranks if posts[r]["graph"] != graph]\n',
           "        other = []\n",
           "ranks that reorder graphs of other shapes agree on durations node by node as if "
           "the graphs were one",
           catch="test_a_rank_that_reorders_another_graph_is_refused_on_every_rank"),
    Mutant("agreement_skipped_over_gloo", "RO-16", _WORLD,
           'dist.get_backend() == "fake":\n',
           'dist.get_backend() in ("fake", "gloo"):\n',
           "the exchange left out for a world it takes for one that only traces: gloo's",
           catch="test_ranks_with_their_own_cost_models_issue_collectives_in_one_order[2]"),
    Mutant("in_flight_limit_across_groups", "RO-8", _RO,
           "block.flight = (p.group[first], collective_kind(p.body[first]))",
           "block.flight = (\"every group\", collective_kind(p.body[first]))",
           "the in-flight limit counted per kind over all groups: a sub group's gather waits for "
           "the world's",
           catch="test_the_in_flight_limit_counts_per_group"),
    Mutant("blocking_kernels_keep_no_group_order", "RO-5", _RO,
           "    return collective_kind(node) is not None or blocking_name(node) is not None",
           "    return collective_kind(node) is not None",
           "only collectives keep their group's order: a gather is raised above the one-shot "
           "kernel of its group before it",
           catch="test_every_order_keeps_the_rules[blocking_then_gather-budget=inf-unlimited]"),
    Mutant("aten_ops_understood_before_effects_are_asked", "RO-6", _RO,
           "    if _has_registered_effect(target):\n        return f\"{target} is registered as "
           "side-effectful\"\n    if namespace in (\"aten\", \"prims\"):\n        return None\n",
           "    if namespace in (\"aten\", \"prims\"):\n        return None\n    if "
           "_has_registered_effect(target):\n        return f\"{target} is registered as "
           "side-effectful\"\n",
           "checks in the wrong order: every ATen op is taken as compute before its registered "
           "effect is asked, so an assertion is moved across",
           catch="test_every_order_keeps_the_rules[side_effectful_aten-budget=inf-unlimited]"),
    Mutant("setitem_treated_as_pure_operator", "RO-6", _RO,
           "        if target is operator.setitem:\n            return \"operator.setitem writes "
           "its argument\"\n",
           "",
           "Treats every function of the operator module as a pure size computation, forgetting "
           "the SPEC's exception for setitem, which writes its argument. (red team)",
           catch="test_every_order_keeps_the_rules[setitem_barrier-budget=inf-unlimited]"),
    Mutant("prologue_user_check_all_instead_of_any", "RO-7", _RO,
           "if any(self.pos.get(user) not in block for user in node.users):",
           "if all(self.pos.get(user) not in block for user in node.users):",
           "Takes a prologue op into a collective's block when some user is the collective, "
           "instead of requiring every user to be in the block. (red team)",
           catch="test_a_prologue_shared_by_two_collectives_is_a_block_of_its_own"),
    Mutant("original_order_from_meta_unchecked", "RO-2", "refimpl/reorder.py",
           "    return order if _valid_original(order) else nodes",
           "    return order",
           "the meta's order taken once it names every node, without checking that it "
           "respects every data edge",
           catch="test_a_meta_that_is_no_valid_order_is_ignored[reversed]"),
    Mutant("original_order_length_unchecked", "RO-2", "refimpl/reorder.py",
           "    if names is None or len(names) != len(nodes):",
           "    if names is None:",
           "the meta compared with gm's nodes as a set only: a name given twice passes",
           catch="test_a_meta_that_is_no_valid_order_is_ignored[a_name_twice]"),
    Mutant("raise_step_starts_as_placed", "RO-10", "refimpl/reorder.py",
           'queue, kept, placed = self.queues["collective"], [], False',
           'queue, kept, placed = self.queues["collective"], [], True',
           "the raise step's flag starts true: it claims a placement it never made, and "
           "the scheduler's loop would spin for ever (the loop's progress check ends it)",
           catch="test_every_order_keeps_the_rules[fsdp_forward-budget=inf-all_gather=1]"),
    Mutant("last_resort_takes_a_block_of_another_queue", "RO-8", "refimpl/reorder.py",
           "if not block.placed and block.queued == name and \\\n",
           "if not block.placed and block.queued != name and \\\n",
           "== for != : the forced move places a block queued elsewhere",
           catch="test_the_last_resort_places_a_ready_wait_when_a_broken_limit_holds_the_next_block"),
    Mutant("barrier_keeps_only_what_follows_the_previous_one", "RO-6", "refimpl/reorder.py",
           "            since = barriers[k - 1] if k else 0\n",
           "            since = barriers[k] if k else 0\n",
           "off by one barrier: the nodes between two barriers may move past the second",
           catch="test_every_barrier_holds_its_side"),
    Mutant("barrier_holds_nothing_after_it_but_the_last", "RO-6", "refimpl/reorder.py",
           "until = barriers[k + 1] if k + 1 < len(barriers) else len(self.body)",
           "until = barriers[k] if k + 1 < len(barriers) else len(self.body)",
           "off by one barrier: only the last barrier holds the nodes after it",
           catch="test_every_barrier_holds_its_side"),
    Mutant("op_returning_nothing_is_compute", "RO-6", "refimpl/reorder.py",
           "    if not target._schema.returns:\n", "    if target._schema.returns:\n",
           "the check inverted: an op that returns nothing is moved across",
           catch="test_every_barrier_holds_its_side"),
    Mutant("stalls_refreshed_only_after_their_end", "RO-12", "refimpl/reorder.py",
           "while stalling and stalling[0][0] <= self.clock:",
           "while stalling and stalling[0][0] < self.clock:",
           "a stalling block freed only once the clock is past its collective's end",
           catch="test_a_collective_that_ends_now_stalls_nothing"),
    Mutant("ro_wait_is_no_write", "RO-4", _RO,
           "                writes.update(model.completes[node])\n", "",
           "the wait only reads its argument: a reader of the in-place collective's buffer "
           "(which reads the collective's node, FC-5) is sunk past it, before the wait",
           catch="test_every_order_keeps_the_rules[mutated_buffer-budget=inf-unlimited]"),
    Mutant("ro_wait_ends_no_in_flight_read", "RO-4", _RO,
           "                reads.update(b for _, held in done for b in held)",
           "                reads.update(())",
           "a collective's input is read only at its issue: it is mutated while in flight",
           catch="test_every_order_keeps_the_rules[mutated_buffer-budget=inf-unlimited]"),
    Mutant("ro_mutation_before_reader", "RO-4", _RO,
           "                self.preds[i].update(readers)  # after every reader",
           "                self.preds[i].update(readers[:0])  # after every reader",
           "a write waits only for the write before it, not for that version's readers",
           catch="test_every_order_keeps_the_rules[mutated_buffer-budget=inf-unlimited]"),
    Mutant("ro_group_order_not_enforced", "RO-5", _RO,
           "                    self.preds[i].add(last[group])",
           "                    self.preds[i].discard(last[group])",
           "collectives of one group may pass each other (upstream's unsafe reorder)",
           catch="test_every_order_keeps_the_rules[mutated_buffer-budget=inf-unlimited]"),
    Mutant("ro_group_order_per_kind", "RO-5", _RO,
           'group = str(_fx.arguments(node, "RO-5")["group_name"])',
           'group = str(_fx.arguments(node, "RO-5")["group_name"]) + str(collective_kind(node))',
           "issue order kept per (group, kind), the in-flight key: a reduce_scatter passes "
           "an all_gather of its group",
           catch="test_every_order_keeps_the_rules[mutated_buffer-budget=inf-unlimited]"),
    Mutant("ro_custom_op_not_a_barrier", "RO-6", _RO,
           '    if namespace in ("aten", "prims"):\n',
           '    if namespace not in comm_ops.NAMESPACES + '
           'comm_ops.OTHER_COMMUNICATING_NAMESPACES:\n',
           "only ops of communicating namespaces are barriers: a side-effecting custom op "
           "is moved across",
           catch="test_every_order_keeps_the_rules[opaque_op-budget=inf-unlimited]"),
    Mutant("ro_prologue_left_behind", "RO-7", _RO,
           "                members = self._prologue(i, block_of) + [i]",
           "                members = [i]",
           "a collective raised without its cast / clone: it waits for its prologue",
           catch="test_every_order_keeps_the_rules[fsdp_forward-budget=inf-all_gather=1]"),
    Mutant("ro_tagged_blocks_ignored", "RO-7", _RO,
           "            tag = node.meta.get(BLOCK_META)",
           '            tag = node.meta.get("refimpl_bucket")',
           "blocks read from the wrong meta key: bucketing's blocks are torn apart",
           catch="test_every_order_keeps_the_rules[fsdp_forward_bucketed-budget=inf-all_gather=1]"),
    Mutant("ro_in_flight_off_by_one", "RO-8", _RO,
           "len(self.flying.get(block.flight, ())) < limit",
           "len(self.flying.get(block.flight, ())) <= limit",
           "the in-flight limit compared with <=: one collective more than the limit",
           catch="test_every_order_keeps_the_rules[fsdp_forward-budget=inf-all_gather=1]"),
    Mutant("raise_left_queued_as_compute", "RO-8", _RO,
           'user.queued in ("stall_free", "stalling") and \\',
           'user.queued in () and \\',
           "a collective queued as compute (its waits unplaced) stays there once another "
           "block's placement places its waits: the fill places it past the in-flight limit "
           "(found by the fuzzer)",
           catch=(
               "test_every_order_keeps_the_rules[gathers_after_a_shared_wait-budget=inf-all_gather=1]")),
    Mutant("fallback_only_to_the_block_at_c", "RO-12", _RO,
           "        for i in range(self.cur, self.n):\n"
           "            block = self.blocks[self.block_of[i]]",
           "        for i in range(self.cur, min(self.cur + 1, self.n)):\n"
           "            block = self.blocks[self.block_of[i]]",
           "a refused move falls back to the block of c only; when the original order "
           "spreads that block (a prologue early, its collective behind its group's), RO-9's "
           "exception places any block past the memory bound (found by the fuzzer)",
           catch="test_a_refused_fill_falls_back_to_the_first_ready_block_of_the_original_order"),
    Mutant("ro_memory_bound_strict", "RO-9", _RO_MEMORY,
           "            if change != PLACED and tree.max(lo, hi) + change > self.limit:",
           "            if change != PLACED and tree.max(lo, hi) + change >= self.limit:",
           "the memory bound compared with <: a move that reaches the limit exactly is "
           "refused",
           catch="test_the_exact_memory_test_at_its_limit[0.035]"),
    Mutant("ro_memory_bound_of_the_handed_in_order", "RO-9", _RO,
           "        original_peak = sweep.peak_bytes",
           "        original_peak = p.model.plan().peak_bytes",
           "the budget measured against the order handed in: a second pass spends it again",
           catch="test_reordering_again_keeps_the_order[fsdp_backward-budget=0.1-unlimited]"),
    Mutant("ro_stall_ignored", "RO-12", _RO,
           "        if stall_end <= self.clock:",
           "        if True:",
           "compute chosen by original position alone: a block that waits on a running "
           "collective stalls the stream while independent compute is ready",
           catch="test_mutated_buffer_keeps_its_versions"),
    Mutant("ro_ties_broken_by_name", "RO-12", _RO,
           "        return block.pos\n", "        return self.p.body[block.pos].name\n",
           "ties broken by node name instead of original position",
           catch="test_fsdp_forward_bucketed_blocks_stay_whole"),
    Mutant("bound_now_refuses_the_exact_limit", "RO-9", _RO_MEMORY,
           "        if peak_of_move > self.limit:",
           "        if peak_of_move >= self.limit:",
           "off by one at the bound: a raise that plans exactly the limit at its own "
           "placement is refused",
           catch="test_the_exact_memory_test_at_its_limit[0.035]"),
    Mutant("stall_of_the_earliest_wait", "RO-12", _RO,
           "        stall_end = max((w.finish_us for w in waits), default=0.0)",
           "        stall_end = min((w.finish_us for w in waits), default=0.0)",
           "a block that reads two waits stalls until the first collective ends, not the "
           "last",
           catch="test_the_later_of_two_waits_sets_the_stall"),
    Mutant("wait_ends_with_its_earliest_member", "RO-12", _RO,
           "        block.finish_us = max((self.finish.get(i, 0.0) for c in block.completes",
           "        block.finish_us = min((self.finish.get(i, 0.0) for c in block.completes",
           "a wait of a block with a prologue ends when the prologue does (a compute member "
           "has no end on the group's stream), not when the collective does",
           catch="test_the_later_of_two_waits_sets_the_stall"),
    Mutant("released_at_its_first_wait", "RO-8", _RO,
           "            if collective.waits_left == 0 and collective.placed:",
           "            if collective.waits_left == 0 or collective.placed:",
           "a collective of several results leaves the flight at its first wait: the next "
           "one is issued while its other results are still pending",
           catch="test_every_order_keeps_the_rules[coalesced_waits-budget=inf-all_gather=1]"),
    Mutant("prologue_of_one_level", "RO-7", _RO,
           "            block.add(j)\n            prologue.append(j)",
           "            prologue.append(j)",
           "a prologue node is not added to the block it joins: a cast feeding the view "
           "that feeds the collective is left out, and placed apart from it",
           catch="test_every_order_keeps_the_rules[cast_and_view-budget=inf-all_gather=1]"),
    Mutant("random_draws_reorder_freely", "RO-4", _RO,
           "                writes.add(RNG_STATE)\n",
           "                pass\n",
           "a seeded random op writes no random-number state: a ready draw moves above an "
           "earlier one that waits, and the two swap their values",
           catch="test_every_order_keeps_the_rules[random_draws-budget=inf-unlimited]"),
    Mutant("config_keeps_the_callers_mapping", "RO-1", _RO,
           "MappingProxyType(dict(self.max_in_flight))",
           "MappingProxyType(self.max_in_flight)",
           "a read-only view of the caller's dict, not of a copy: the caller's later "
           "changes reach the config",
           catch="test_config_is_frozen_and_keeps_its_own_limits"),
    Mutant("reordered_without_the_code_generator", "RO-1", _RO,
           "    graph = _fx.empty_graph_like(gm)\n    copies:",
           "    graph = torch.fx.Graph()\n    copies:",
           "the new graph made bare, with FX's plain code generator: a program of a dict "
           "(make_fx's pytree code generator) takes flattened inputs and returns a list",
           catch="test_the_reordered_program_takes_and_returns_what_the_traced_one_does"),
    Mutant("sym_functions_are_barriers", "RO-6", _RO,
           "        if module in PURE_MODULES or (module, name) in comm_ops.SYMMETRIC_ALLOCATORS "
           "or \\\n                (module == \"torch\" and name.startswith(\"sym_\")):",
           "        if module in PURE_MODULES or (module, name) in comm_ops.SYMMETRIC_ALLOCATORS:",
           "torch.sym_max and the other torch.sym_* functions of a symbolic size taken for "
           "unknown Python functions: barriers",
           catch="test_size_arithmetic_is_no_barrier[inf]"),
    Mutant("math_functions_are_barriers", "RO-6", _RO,
           'PURE_MODULES = ("_operator", "operator", "math")',
           'PURE_MODULES = ("_operator", "operator")',
           "math.floor of a symbolic size is a barrier",
           catch="test_size_arithmetic_is_no_barrier[inf]"),
    Mutant("operator_functions_are_barriers", "RO-6", _RO,
           'PURE_MODULES = ("_operator", "operator", "math")',
           'PURE_MODULES = ("operator", "math")',
           "the operator module's functions say `_operator` in __module__: operator.floordiv "
           "on a symbolic size is a barrier",
           catch="test_size_arithmetic_is_no_barrier[inf]"),
    Mutant("comm_ops_broadcast_family_all_reduce", "RO-8", COMM_OPS,
           '_BROADCAST = dict(family="broadcast", completes="wait",',
           '_BROADCAST = dict(family="all_reduce", completes="wait",',
           "broadcast's row copied from _ALL_REDUCE (both copy their input, FC-2) with "
           "only the algorithm changed: broadcast becomes RO-8's all_reduce kind "
           "(blind red team)",
           catch=(
               "test_every_order_keeps_the_rules[broadcasts_and_an_all_reduce-budget=inf-broadcast=1]")),
    Mutant("comm_ops_find_only_collective_namespaces", "RO-5", COMM_OPS,
           '    if key[0] not in NAMESPACES or key in NOT_MODELLED:',
           '    if key[0] not in COLLECTIVE_NAMESPACES or key in NOT_MODELLED:',
           "find filters on the functional-collective namespaces only, so the "
           "symmetric-memory kernels get no row and read as plain compute (blind red team)",
           catch="test_a_wait_sinks_past_a_blocking_kernel"),
    Mutant("wait_of_a_list_paired_with_its_first_collective", "RO-8", _RO,
           "                self.completes[i] = list(dict.fromkeys(c for c, _ in done))",
           "                self.completes[i] = list(dict.fromkeys(c for c, _ in done))[:1]",
           "a wait paired with one collective, as wait_tensor is: a wait_tensors of several "
           "collectives leaves all but the first in flight for the scheduler",
           catch="test_a_wait_of_a_list_completes_every_collective_it_lists[one]"),
    Mutant("alloc_live_to_end_double_count", "RO-10", _RO_MEMORY,
           "                    events.append((cur, k, self.bytes[b]))  "
           "# live from now, not from k",
           "                    events.append((cur, self.n, self.bytes[b]))  # live from now on",
           "a moved buffer counted live to the end, on top of the original order's own count "
           "of it: issue 30's double count again (blind red team)",
           catch="test_fsdp_backward_waits_kept_by_the_memory_bound"),
    Mutant("baseline_key_without_own_alloc", "RO-10", _RO,
           "            high.append(sweep.live_bytes + p.alloc[i])",
           "            high.append(sweep.live_bytes)",
           "a later position's key without its own allocations (MEM-9's peak inside a node "
           "forgotten): moves over the bound pass (blind red team)",
           catch="test_fsdp_backward_waits_kept_by_the_memory_bound"),
    Mutant("stall_free_key_position_before_need", "RO-12", _RO,
           "(block.need, self.tie(block), block.index))",
           "(self.tie(block), block.need, block.index))",
           "original position ahead of need on one of the two paths into the stall-free queue "
           "(blind red team)",
           catch="test_a_collective_that_ends_now_stalls_nothing"),
    Mutant("R_counts_B_itself", "RO-14", _RO,
           "        after = block.members[-1] + 1",
           "        after = block.members[0]",
           "R read as the compute from the fill on, the fill's own duration included (blind "
           "red team)",
           catch="test_a_held_back_gather_is_let_go_when_that_hides_more_of_it[gain]"),
    Mutant("check_order_peak_at_limit_refused", "RO-15", _RO,
           "    if plan.peak_bytes <= limit:",
           "    if plan.peak_bytes < limit:",
           "check_order off by one at RO-9's bound: a peak exactly at the limit reported "
           "(blind red team)",
           catch="test_check_order_passes_every_order_of_the_pass"),
    Mutant("continuation_frees_nothing_early", "RO-10", _RO_MEMORY,
           "            for b in self.released_by[k]:\n                if self.forever[b] or",
           "            for b in ():\n                if self.forever[b] or",
           "the exact test adds a move's allocations but not the frees it brings forward: a "
           "move that ends a buffer early is refused as if the buffer lived on",
           catch="test_fsdp_backward_waits_kept_by_the_memory_bound"),
    Mutant("only_the_conservative_memory_test", "RO-10", _RO,
           "        return self.bound.fits(peak, members, self.cur, cur, allocated)",
           "        return False",
           "the O(1) bound that counts a moved buffer twice kept as the whole test",
           catch="test_a_move_that_raises_no_peak_is_taken_under_a_budget_of_0"),
    Mutant("need_from_direct_users_only", "RO-12", _RO,
           "                                 user.pos if user.kind == COLLECTIVE else user.need)",
           "                                 user.pos if user.kind == COLLECTIVE else math.inf)",
           "a block's need read from its direct users: compute two steps from a collective "
           "needs nothing",
           catch="test_the_compute_a_collective_needs_runs_first"),
    Mutant("need_ignored_when_filling", "RO-12", _RO,
           "(block.need, self.tie(block), block.index))",
           "(0, self.tie(block), block.index))",
           "stall-free blocks filled in original order only, as before issue 30",
           catch="test_the_compute_a_collective_needs_runs_first"),
    Mutant("limit_let_go_on_a_tie", "RO-14", _RO,
           "            if gain > 0 and (best is None or (-gain, held.pos) < best[0]):",
           "            if gain >= 0 and (best is None or (-gain, held.pos) < best[0]):",
           "a held-back collective let go when that gains nothing",
           catch="test_a_held_back_gather_is_let_go_when_that_hides_more_of_it[tie]"),
    Mutant("gain_ignores_the_compute_before_use", "RO-14", _RO,
           "            rest = max(0.0, held.duration - self._compute_before_use(compute, held))",
           "            rest = held.duration",
           "the held-back collective taken to be needed right after the compute it would run "
           "under: a pipeline's waits are placed early, stalling, for gathers later compute "
           "would hide anyway",
           catch="test_a_pipeline_does_not_stall_to_let_a_gather_go"),
    Mutant("gain_not_capped_by_the_compute", "RO-14", _RO,
           "            gain = (rest - max(0.0, rest - compute.duration)) - (stall_now - "
           "stall_later)",
           "            gain = rest - (stall_now - stall_later)",
           "the whole rest of the held-back collective counted as hidden, however short the "
           "compute that would hide it",
           catch="test_a_held_back_gather_is_let_go_when_that_hides_more_of_it[tie]"),
    Mutant("check_order_barrier_reported_as_a_version", "RO-15", _RO,
           "    if barrier_reason(first) is not None or barrier_reason(then) is not None:\n"
           "        return \"RO-6\"",
           "    if False:\n        return \"RO-6\"",
           "check_order names a crossed barrier as a buffer-version edge (RO-4)",
           catch="test_check_order_names_the_rule_and_the_nodes[barrier_crossed]"),
    Mutant("budget_none_taken_as_zero", "RO-1", _RO,
           "        if self.memory_budget is None or math.isinf(self.memory_budget):",
           "        if math.isinf(self.memory_budget or 0.0):",
           "memory_budget=None read as a budget of 0, not as no bound",
           catch="test_the_exact_memory_test_at_its_limit[0.035]"),
    Mutant("budget_zero_means_unbounded", "RO-9", _RO,
           "        if self.memory_budget is None or math.isinf(self.memory_budget):",
           "        if not self.memory_budget or math.isinf(self.memory_budget):",
           "tests the budget for truthiness, so memory_budget=0 (allow no growth at all) is "
           "read like None and the memory bound disappears; RO-1 says only None or inf "
           "lifts it (red team)",
           catch="test_a_budget_of_0_raises_nothing_that_costs_memory[int]"),
    Mutant("check_order_baseline_is_handed_in_order", "RO-15", _RO,
           "    original = program.model.plan(program.body)",
           "    original = program.model.plan()",
           "check_order measures RO-9's reference peak with the order of the graph handed in "
           "instead of the original order of RO-2: a reordered graph gets a fresh budget "
           "(red team)",
           catch="test_check_order_measures_a_reordered_graph_against_its_original_order"),
    Mutant("tree_right_path_adds_left_pending", "RO-10", _RO_MEMORY,
           "                t[right] = (a if a > b else b) + d[right]",
           "                t[right] = (a if a > b else b) + d[left]",
           "copy-paste slip in MaxTree.add's recompute of the right end's ancestors: it adds "
           "the left ancestor's pending adds, so range maxima over the right subtree are "
           "wrong and the exact test accepts a raise that breaks RO-9's bound (red team)",
           catch="test_a_raise_after_a_fill_ahead_is_tested_exactly[bound_388]"),
    Mutant("not_modelled_op_raises", "RO-6", COMM_OPS,
           "    if key[0] not in NAMESPACES or key in NOT_MODELLED:",
           "    if key[0] not in NAMESPACES:",
           "find() drops the NOT_MODELLED test, so an op the op table deliberately "
           "leaves out (refimpl_symm_mem.barrier, upstream's CUDA-only symm_mem ops) "
           "raises NotModelled in reorder instead of being a barrier (RO-6) (red team)",
           catch="test_an_op_the_table_leaves_out_is_a_barrier[barrier]"),
    Mutant("adjacent_barriers_unordered", "RO-6", _RO,
           "            since = barriers[k - 1] if k else 0",
           "            since = barriers[k - 1] + 1 if k else 0",
           "a barrier's 'everything before it' range starts after the previous barrier, "
           "whose own range stops before this one: two barriers with nothing between "
           "them get no edge and may swap (RO-6) (red team)",
           catch="test_adjacent_barriers_keep_their_order[record_-note]"),
    Mutant("check_order_coalesced_done_at_first_wait", "RO-8", _RO,
           "if waits_left[c] == 0 and c in issued:",
           "if c in issued:",
           "check_order's in-flight count drops a coalesced collective at its first "
           "member's wait, not its last (RO-7), so a collective issued between the two "
           "waits passes RO-8's limit (red team)",
           catch="test_check_order_names_the_rule_and_the_nodes[over_the_limit"
                 "_until_the_last_wait]"),
    Mutant("memory_exception_whenever_limits_configured", "RO-9", _RO,
           "    if math.isinf(limit) or _first_limit_broken(program, "
           "list(range(len(program.body))),\n                                           "
           "     config) is not None:",
           "    if math.isinf(limit) or config.max_in_flight:",
           "check_order applies RO-9's exception whenever the config sets any in-flight "
           "limit, not only when the original order breaks one: every config with "
           "max_in_flight loses its memory bound (red team)",
           catch="test_check_order_keeps_the_memory_bound_under_limits_the_ori"
                 "ginal_order_keeps[all_gather=2]"),
    Mutant("refusal_cache_ignores_key_changes", "RO-10", _RO_MEMORY,
           "        return seen is not None and seen[0] == self.version and cur <= "
           "seen[1]",
           "        return seen is not None and cur <= seen[1]",
           "the memo of refused moves no longer checks that no move ahead changed the "
           "keys since: a raise stays refused after a fill ahead freed the memory that "
           "made it fail (RO-10) (red team)",
           catch="test_a_refused_raise_is_made_once_moves_ahead_free_memory[f32]"),
    Mutant("tree_max_drops_adds_above_meeting_node", "RO-10", _RO_MEMORY,
           "        best = left if left > right else right\n        lo >>= 1\n        "
           "while lo:\n            best += d[lo]\n            lo >>= 1\n        return "
           "best",
           "        best = left if left > right else right\n        return best",
           "MaxTree.max forgets the pending adds above the node where the query's two "
           "sides meet: after a wide range add the exact test reads keys low and takes "
           "a fill past RO-9's bound (RO-10) (red team)",
           catch="test_a_fill_after_a_wide_raise_is_tested_exactly[bound_162-f32]"),
    Mutant("max_in_flight_accepts_wait_family", "RO-1", _RO,
           "            require(kind in KINDS, \"max_in_flight\", f\"a kind of "
           "{list(KINDS)}\", repr(kind),",
           "            require(kind in comm_ops.FAMILIES, \"max_in_flight\", f\"a kind "
           "of {list(KINDS)}\", repr(kind),",
           "Validates max_in_flight's kinds against comm_ops' FAMILIES (the op table's "
           "Family column, which has 'wait' too) instead of the six collective kinds of "
           "RO-8, so a limit on 'wait', which no collective has, is accepted and then "
           "silently never applies. (red team)",
           catch="test_config_refuses_bad_fields[wait kind]"),
    Mutant("prologue_views_by_schema_only", "RO-7", _RO,
           "    return target._schema.name.split(\"::\", 1)[1] in PROLOGUE_OPS or "
           "_is_view(target)",
           "    schema = target._schema  # a view: every result a non-writing alias "
           "(RO-7)\n    return schema.name.split(\"::\", 1)[1] in PROLOGUE_OPS or "
           "(bool(schema.returns) and all(\n        r.alias_info is not None and not "
           "r.alias_info.is_write for r in schema.returns))",
           "Re-derives 'view' from the schema's alias annotations alone and forgets "
           "aten._unsafe_view, which RO-7 (like SIM-4, MEM-2) counts as a view though "
           "its schema does not say so, so a collective's prologue stops at an "
           "_unsafe_view (which make_fx emits for reshapes). (red team)",
           catch="test_an_unsafe_view_is_part_of_a_gathers_prologue[_unsafe_view]"),
    Mutant("moved_release_frees_before_remaining_release_key", "RO-9", _RO_MEMORY,
           "                lo = max(start, after + 1) if after is not None else start",
           "                lo = max(start, after) if after is not None else start",
           "When a move takes a buffer's last release ahead, the slip frees it from the "
           "remaining last release's own key on, as if the free came before that node's "
           "allocations, though MEM-9 allocates first and frees after, so that key "
           "still holds the buffer: the exact test underestimates there and accepts "
           "moves that break RO-9's bound. (red team)",
           catch="test_a_buffer_freed_by_a_move_is_live_at_its_remaining_reade"
                 "rs_key[f32]"),
    Mutant("batch_p2p_counted_as_all_to_all", "RO-8", COMM_OPS,
           "    \"batch_p2p_ops\": dict(_P2P, coalesced=True),",
           "    \"batch_p2p_ops\": dict(_ALL_TO_ALL, coalesced=True),",
           "batch_p2p_ops, a batch of sends and receives among peers, is taken for an "
           "all-to-all exchange, so it gets family all_to_all (RO-8's kind) and the "
           "ring algorithm, where the op table says point_to_point and direct. (red "
           "team)",
           catch="test_a_batch_of_point_to_point_ops_is_of_kind_point_to_point[world]"),
    Mutant("prologue_ops_of_aten_only", "RO-7", "refimpl/reorder.py",
           'target.namespace not in ("aten", "prims"):',
           'target.namespace != "aten":',
           "The prologue test accepts only ATen ops, forgetting the prims path that SPEC "
           "names (prims.convert_element_type, the cast FSDP puts before an all_gather, "
           "and prims views), so such a cast is a block of its own. (red team)",
           catch="test_a_prims_cast_is_part_of_a_gathers_prologue"),
    Mutant("check_order_names_the_first_check_not_the_first_position", "RO-15",
           "refimpl/reorder.py",
           "        at, rule, nodes, what = min(found, key=lambda v: v[0])",
           "        at, rule, nodes, what = found[0]",
           "check_order reports the first check that failed (edges before blocks before "
           "limits before memory) instead of the violation that comes first by position in"
           " `order`. (red team)",
           catch="test_check_order_names_the_first_violation_by_position"),
    Mutant("point_to_point_out_of_its_group_order", "RO-5", "refimpl/reorder.py",
           "    return collective_kind(node) is not None or blocking_name(node) is not None",
           "    return collective_kind(node) not in (None, \"point_to_point\") or "
           "blocking_name(node) is not None",
           "sends and receives taken for no collectives of their group (upstream dropped "
           "these edges, pytorch#189209): a gather raised above a receive deadlocks NCCL",
           catch="test_every_order_keeps_the_rules[pipeline_stage-budget=inf-unlimited]"),
    Mutant("point_to_point_limit_accepted", "RO-8", "refimpl/reorder.py",
           '            require(kind != "point_to_point", "max_in_flight",',
           '            require(kind != "point-to-point", "max_in_flight",',
           "the kind refused spelled with hyphens: a limit on point_to_point is taken, and a "
           "ring deadlocks under it",
           catch="test_a_limit_on_point_to_point_is_refused[alone]"),
]

# --------------------------------------------------------------------------------------
# 5. Memory (MEM)
# --------------------------------------------------------------------------------------
MEMORY = "refimpl/memory.py"
MEM = [
    Mutant("unread_node_without_a_value_refused", "MEM-1", MEMORY,
           "                if node.users and not is_subgraph(self.gm, node):",
           "                if not is_subgraph(self.gm, node):",
           "every node without meta['val'] refused, one nobody reads (an assertion) too (blind "
           "red team)",
           catch="test_an_unread_node_without_a_value_holds_no_buffer"),
    Mutant("shared_work_kept_after_its_wait", "MEM-5", F,
           "            self.work = None\n",
           "            pass\n",
           "a coalesced call's work kept after its wait: it holds every member's tensors, so "
           "a member waited is freed only at the last member's wait",
           catch="test_plan_matches_a_real_run"),
    Mutant("coalesced_reduce_scatter_holds_results_only", "MEM-5", COMM_OPS,
           '    "reduce_scatter_tensor_coalesced": dict(_REDUCE_SCATTER, coalesced=True),',
           '    "reduce_scatter_tensor_coalesced": dict(_REDUCE_SCATTER, coalesced=True, '
           'in_flight="result"),',
           "the coalesced reduce_scatter taken to copy its inputs at issue as the coalesced "
           "all_reduce does: its members' inputs are freed before their waits",
           catch="test_coalesced_reduce_scatter_members_are_held_until_their_own_wait"),
    Mutant("second_collective_on_buffer_forgets_first", "MEM-5", MEMORY,
           "            self.pending.setdefault(done, []).append(held)",
           "            self.pending[done] = [held]",
           "Assumes one in-flight collective per result buffer. A second collective writing into "
           "the same buffer before the wait overwrites the first one's held set, so the wait "
           "releases only the second one's holds and the first's inputs are held forever. SPEC: "
           "a wait completes every collective in flight whose result lives in its argument's "
           "buffer. (red team)",
           catch="test_a_wait_completes_every_collective_in_flight_on_its_buffer"),
    Mutant("output_view_base_not_pinned", "MEM-7", MEMORY,
           "                    if buffer.kind == INTERMEDIATE:",
           "                    if buffer.kind == INTERMEDIATE and buffer.alloc_node is arg:",
           "Marks a buffer as output only when the output node itself allocated it. An output "
           "that is a view, rename or in-place result of an intermediate leaves the base buffer "
           "INTERMEDIATE, and it is freed at its last reader, the output node. (red team)",
           catch="test_an_output_that_views_an_intermediate_keeps_its_buffer"),
    Mutant("inputs_keyed_by_tensor_not_storage", "MEM-2", MEMORY,
           "            key = tensor.untyped_storage()._cdata\n",
           "            key = id(tensor)\n",
           "graph inputs told apart by the tensor object, not its storage: two views of one "
           "storage are two buffers, its bytes counted twice",
           catch="test_a_constant_and_inputs_sharing_a_storage"),
    Mutant("get_attr_planned_as_an_intermediate", "MEM-6", MEMORY,
           "        if node.op in (\"placeholder\", \"get_attr\"):\n            return INPUT",
           "        if node.op == \"placeholder\":\n            return INPUT",
           "a get_attr constant is planned as an intermediate: freed at its last reader, "
           "though the module owns it",
           catch="test_a_constant_and_inputs_sharing_a_storage"),
    Mutant("value_checked_on_ops_only", "MEM-1", MEMORY,
           "                if node.users and not is_subgraph(self.gm, node):\n"
           "                    raise ValueError(f\"gm: node",
           "                if node.users and node.op == \"call_function\":\n"
           "                    raise ValueError(f\"gm: node",
           "only an op without a value is refused: an input without one is planned as "
           "nothing, and its readers read no buffer",
           catch="test_a_read_node_without_a_value_is_refused_naming_it[placeholder]"),
    Mutant("alias_source_any_annotated_argument", "MEM-2", "refimpl/memory.py",
           "if alias_set and a.alias_info is not None and a.alias_info.before_set & alias_set:",
           "if alias_set or a.alias_info is not None and a.alias_info.before_set & alias_set:",
           "and/or swapped: a result with an alias set renames the first argument, so an out= "
           "op renames its input instead of `out`",
           catch="test_an_out_variant_renames_its_out_argument"),
    Mutant("aliases_not_recorded", "MEM-1", "refimpl/memory.py",
           "                if buffer.aliases[-1] is not node:\n",
           "                if buffer.aliases[-1] is node:\n",
           "a buffer's aliases stop at the allocating node",
           catch="test_an_out_variant_renames_its_out_argument"),
    Mutant("autograd_wrappers_no_collectives", "MEM-5", COMM_OPS,
           'COLLECTIVE_NAMESPACES = ("refimpl_c10d", "_c10d_functional", '
           '"_c10d_functional_autograd")',
           'COLLECTIVE_NAMESPACES = ("refimpl_c10d", "_c10d_functional")',
           "upstream's differentiable wrappers left out of the collective namespaces: their "
           "inputs are freed at the collective, not held to the wait",
           catch="test_upstream_autograd_collective_holds_its_input"),
    Mutant("peak_node_last_of_a_tie", "MEM-1", MEMORY,
           "self.peak_node is None or self.live_bytes > self.peak_bytes:",
           "self.peak_node is None or self.live_bytes >= self.peak_bytes:",
           "the peak node updated on a tie: the last node at the peak, not the first",
           catch="test_dead_value"),
    Mutant("mem_free_after_first_alias", "MEM-3", MEMORY,
           "                used.extend(b.index for b in self.node_buffers.get(arg, ()))\n",
           "                used.extend(b.index for b in self.node_buffers.get(arg, ())\n"
           "                            if b.alloc_node is arg)\n",
           "only readers of the allocating node count: a buffer is freed after the last use "
           "of its first alias, not of its last",
           catch="test_all_gather_copy_out"),
    Mutant("mem_view_counted", "MEM-2", MEMORY,
           "                buffers.extend(sources[0] for _ in tensors)  # views of one buffer\n",
           "                buffers.extend(self._new_buffer(node, t) for t in tensors)\n",
           "a view is counted as a buffer of its own",
           catch="test_bucketed_fsdp_block"),
    Mutant("mem_collective_input_freed_before_wait", "MEM-5", MEMORY,
           "            held = [done] if result_only else \\\n",
           "            held = [done] if True else \\\n",
           "only a collective's result is held in flight: its input is freed at its last reader",
           catch="test_reduce_scatter_with_padding"),
    Mutant("mem_free_before_alloc", "MEM-9", MEMORY,
           "        allocated = self._allocate(node)  # a node's outputs before its frees (MEM-9)\n"
           "        self._free(node, allocated)\n",
           "        self._free(node, self.model.allocs.get(node, ()))\n"
           "        allocated = self._allocate(node)\n",
           "alloc/free order at a node flipped: a node's dying inputs are freed before its "
           "outputs are allocated",
           catch="test_all_gather_copy_out"),
    Mutant("mem_comm_buffer_freed", "MEM-8", MEMORY,
           "        self.pinned = [b.kind != INTERMEDIATE for b in self.buffers]\n",
           "        self.pinned = [b.kind in (INPUT, OUTPUT) for b in self.buffers]\n",
           "a comm buffer is freed at its last use like an intermediate",
           catch="test_comm_buffer_is_persistent"),
    Mutant("mem_input_freed", "MEM-6", MEMORY,
           "        self.pinned = [b.kind != INTERMEDIATE for b in self.buffers]\n",
           "        self.pinned = [b.kind in (OUTPUT, COMM_BUFFER) for b in self.buffers]\n",
           "graph inputs are freed at their last reader",
           catch="test_all_gather_copy_out"),
    Mutant("mem_output_freed", "MEM-7", MEMORY,
           "                    if buffer.kind == INTERMEDIATE:\n"
           "                        buffer.kind = OUTPUT\n",
           "                    if buffer.kind == INPUT:\n"
           "                        buffer.kind = OUTPUT\n",
           "outputs are not marked: a returned intermediate is freed at its last reader",
           catch="test_all_gather_copy_out"),
    Mutant("mem_wait_namespace", "MEM-4", COMM_OPS,
           '    rows["_c10d_functional", "wait_tensor"] = CommOp("_c10d_functional", '
           '"wait_tensor",',
           '    rows["refimpl_c10d", "wait_tensor"] = CommOp("refimpl_c10d", "wait_tensor",',
           "the rename table names refimpl's wait instead of upstream's: refimpl's copy is "
           "not counted and upstream's rename is",
           catch="test_all_gather_copy_out"),
    Mutant("mem_coalesced_holds_every_input", "MEM-5", MEMORY,
           "        return [([a], i) for i, a in enumerate(node_args(node.args[listed]))]\n",
           "        return [(node_args(node.args[listed]), i) "
           "for i, a in enumerate(node_args(node.args[listed]))]\n",
           "each member of a coalesced collective holds every member's input",
           catch="test_coalesced_members_are_held_until_their_own_wait"),
    Mutant("mem_batch_members_held_as_the_batch", "MEM-5", MEMORY,
           '            result_only = comm_ops.member_in_flight(node, i) == "result"  # MEM-5\n',
           '            result_only = comm_ops.node_op(node).in_flight == "result"  # MEM-5\n',
           "a batch of point-to-point ops held by its own row, not each member by its op's: "
           "an irecv member's template is held to its wait",
           catch="test_point_to_point_ops_hold_what_each_member_sends"),
    Mutant("comm_ops_every_member_as_the_first", "MEM-5", COMM_OPS,
           "    return ROWS[row.namespace, names[i]].in_flight\n",
           "    return ROWS[row.namespace, names[0]].in_flight\n",
           "every member of a batch held as its first member's op is (an irecv first: the "
           "isend member's input is let go at the batch)",
           catch="test_point_to_point_ops_hold_what_each_member_sends"),
    Mutant("mem_dead_value_kept", "MEM-3", MEMORY,
           "        dying = [b for b in allocated if self.remaining[b] == 0]  # read by nobody\n",
           "        dying = []\n",
           "a buffer nobody reads is never freed",
           catch="test_all_reduce_in_place_on_an_intermediate"),
    Mutant("mem_wait_completes_nothing", "MEM-5", MEMORY,
           "                    b.index for a in node_args(node.args[:1])\n",
           "                    b.index for a in node_args(node.args[1:])\n",
           "a wait's argument is looked up at the wrong index: nothing in flight is released",
           catch="test_all_gather_copy_out"),
    Mutant("mem_duplicate_in_order", "MEM-11", MEMORY,
           "            if node in position:\n",
           "            if node in position and node.op == \"placeholder\":\n",
           "a node listed twice in an order is not refused",
           catch="test_an_invalid_order_is_refused"),
    Mutant("mem_verifier_size", "MEM-12", MEMORY,
           "        if nbytes != buffer.nbytes:\n",
           "        if nbytes > buffer.nbytes:\n",
           "the verifier only refuses a storage larger than planned",
           catch="test_lifecycle_verifier"),
    Mutant("mem_verifier_unpredicted_free", "MEM-12", MEMORY,
           "        for b in expected - freed.keys():\n",
           "        for b in expected - freed.keys() - expected:\n",
           "the verifier does not check that a predicted free happened",
           catch="test_lifecycle_verifier"),
    Mutant("live_bytes_before_each_node", "MEM-1", MEMORY,
           "            sweep.place(node)\n            live.append(sweep.live_bytes)",
           "            live.append(sweep.live_bytes)\n            sweep.place(node)",
           "the live bytes recorded before each node instead of after it",
           catch="test_all_gather_copy_out"),
    Mutant("verifier_refuses_only_a_larger_peak", "MEM-12", MEMORY,
           "    if peak != plan.peak_bytes:",
           "    if peak > plan.peak_bytes:",
           "a plan that overstates the peak passes the verifier",
           catch="test_lifecycle_verifier"),
    Mutant("symbolic_size_by_its_old_helper", "MEM-1", "refimpl/_fx.py",
           '    hint = getattr(symbolic_shapes, "optimization_hint", None) or '
           'symbolic_shapes.hint_int',
           "    hint = symbolic_shapes.hint_int",
           "the helper of older torch called on every torch: gone since 2.13, so a graph "
           "traced with symbolic sizes cannot be planned (nor reordered)",
           catch="test_symbolic_sizes_count_as_in_the_example"),
    Mutant("comm_ops_all_reduce_coalesced_from_in_place_template", "MEM-5", COMM_OPS,
           '"all_reduce_coalesced": dict(_ALL_REDUCE, coalesced=True),',
           '"all_reduce_coalesced": dict(_ALL_REDUCE_, coalesced=True),',
           "the out-of-place coalesced all_reduce built from the in-place template of "
           "the next line: in place, holding its inputs until the waits (blind red team)",
           catch="test_coalesced_all_reduce_frees_its_inputs_at_issue"),
    Mutant("comm_ops_broadcast_holds_its_input", "MEM-5", COMM_OPS,
           '_BROADCAST = dict(family="broadcast", completes="wait", in_flight="result",',
           '_BROADCAST = dict(family="broadcast", completes="wait", in_flight="inputs",',
           "out-of-place broadcast given the in-flight set of the collectives that "
           "communicate their input (all_gather's), forgetting it copies its input (FC-2) "
           "(blind red team)",
           catch="test_all_to_all_holds_its_input_broadcast_does_not"),
    Mutant("wait_of_a_list_completes_its_first_tensor", "MEM-5", MEMORY,
           "                    b.index for a in node_args(node.args[:1])",
           "                    b.index for a in node_args(node.args[:1])[:1]",
           "a wait's argument read as one tensor: torch 2.15's wait_tensors completes only "
           "the first tensor of its list, the others stay in flight to the end",
           catch="test_a_wait_of_a_list_completes_every_member"),
    Mutant("wait_tensors_counted_as_a_copy", "MEM-2", COMM_OPS,
           '"_c10d_functional", "wait_tensors", **_WAIT, coalesced=True, returns_argument=True)',
           '"_c10d_functional", "wait_tensors", **_WAIT, coalesced=True)',
           "the row of 2.15's wait of a list modelled on refimpl's traced wait, which copies: "
           "its results planned as new buffers",
           catch="test_a_wait_of_a_list_completes_every_member"),
]

# --------------------------------------------------------------------------------------
# 6. Symmetric memory (SM), C kernels included
# --------------------------------------------------------------------------------------
SM = [
    Mutant("rendezvous_keyed_by_size", "SM-5", "refimpl/symmetric_memory.py",
           '        key = f"rdzv{info.rendezvous_count}"\n',
           '        key = f"rdzv{alloc.nbytes}"\n',
           "the store keys of a rendezvous named by the allocation's size, not by the "
           "group's count of rendezvous: a later rendezvous of a buffer of the same size "
           "meets the records of the first (the wrong identity for a key)",
           catch="test_the_nth_rendezvous_maps_every_peers_nth_allocation[2]"),
    Mutant("put_signal_marks_the_destination_s_slot", "SM-9", "refimpl/symmetric_memory.py",
           "        return self._c.rsm_put_signal(self.signal_pad_ptrs[dst_rank], self.rank, ",
           "        return self._c.rsm_put_signal(self.signal_pad_ptrs[dst_rank], dst_rank, ",
           "a signal set in the destination's own slot of its pad, not in the sender's: the "
           "destination waits on the sender's slot, which never fills",
           catch="test_signals_order_every_write_of_a_ring_handshake[4]"),
    Mutant("rendezvous_keys_numbered_per_process", "SM-12", "refimpl/symmetric_memory.py",
           "        info.rendezvous_count += 1\n        key = f\"rdzv{info.rendezvous_count}\"",
           "        info.rendezvous_count += 1\n"
           "        key = f\"rdzv{sum(g.rendezvous_count for g in _groups.values())}\"",
           "the store keys of a rendezvous numbered by every rendezvous this process did, of "
           "any group (upstream's StoreExchange, pytorch/pytorch#196082): a subgroup's "
           "rendezvous puts its members out of step with the ranks left out, and the next "
           "rendezvous of a larger group hangs",
           catch="test_a_subgroups_rendezvous_leaves_a_later_groups_rendezvous_in_step"),
    Mutant("stale_handle_serves_another_group", "SM-14", "refimpl/symmetric_memory.py",
           "    if alloc is None or alloc.handle is None or alloc.handle.group_name != group_name:",
           "    if alloc is None or alloc.handle is None:",
           "a tensor already rendezvoused keeps its handle for an op naming another group: the "
           "op reduces over the first group's peers instead of refusing group_name (blind red "
           "team)",
           catch="test_op_arguments_are_refused_on_every_rank_before_any_wait"),
    Mutant("op_rendezvous_on_the_whole_world", "SM-15", "refimpl/symmetric_memory.py",
           "        _check_group_of(alloc, group_name, where, arg)\n"
           "        rendezvous(input, group_name)\n",
           "        _check_group_of(alloc, group_name, where, arg)\n"
           "        rendezvous(input, dist.group.WORLD.group_name)\n",
           "an op's first call meets its peers on the whole world, not the group it names "
           "(as DeepSpeed's inference_all_reduce does): a subgroup waits for a rank outside it",
           catch="test_a_subgroups_all_reduce_sums_its_members_only"),
    Mutant("f16_overflow_past_the_largest_half", "SM-15", "kernels/cpu/symm_mem.c",
           "  if (u >= (127u + 16) << 23) { /* overflow, inf or NaN */",
           "  if (u > 0x477fe000u) { /* past 65504, the largest half: inf or NaN */",
           "float16 overflow taken to start past the largest half, 65504, not at the "
           "midpoint 65520: a float32 sum in (65504, 65520) gives inf where torch's "
           "round-to-nearest gives 65504",
           catch="test_16_bit_sums_at_the_edge_of_the_range_round_as_torch_does[2]"),
    Mutant("sleeper_woken_by_a_private_futex_wake", "SM-11", "kernels/cpu/symm_mem.c",
           "(uint32_t *)slot, FUTEX_WAKE, INT_MAX",
           "(uint32_t *)slot, FUTEX_WAKE_PRIVATE, INT_MAX",
           "the usual process-private futex wake on a slot shared between processes: it "
           "wakes no sleeper of another rank, which returns only at the end of its 50 ms "
           "sleep",
           catch="test_a_sleeping_wait_is_woken_by_the_signal_not_by_its_own_timer"),
    Mutant("native_pointwise_numel_not_shape", "SM-24", "kernels/cpu/symm_mem_ops.cpp",
           "input.sizes() != buffer.sizes()) {",
           "input.numel() != buffer.numel()) {",
           "the C++ fast path compares local_input's element count with symm_buffer's, "
           "not its shape: a (2, 2) local_input for a (4,) buffer runs instead of being "
           "refused naming local_input",
           catch="test_a_matching_numel_of_another_shape_or_dtype_is_refused_by_every_kernel"),
    Mutant("failed_rendezvous_forgets_peer_names", "SM-12", "refimpl/symmetric_memory.py",
           "            published = [r[\"name\"] for r in records]\n",
           "",
           "the names read from the peers' records are never remembered: a failed "
           "rendezvous unlinks only its own, and a peer stopped or killed after it "
           "published leaves its segment in /dev/shm",
           catch="test_a_failed_rendezvous_unlinks_the_names_of_a_stopped_peer[unequal_sizes]"),
    Mutant("rendezvous_sizes_checked_against_rank0_only", "SM-5", "refimpl/symmetric_memory.py",
           "            check_sizes(records, alloc.nbytes, info.rank)",
           "            check_sizes(records[:1], alloc.nbytes, info.rank)",
           "Each rank compares its allocation size with rank 0's only (the 'reference' rank), so "
           "rank 0 itself never sees a mismatch: the ValueError is raised on the other ranks but "
           "not on every rank. (red team)",
           catch="test_rendezvous_of_unequal_sizes_fails_on_every_rank_naming_both"),
    Mutant("default_timeout_not_given_to_the_native_ops", "SM-11",
           "refimpl/symmetric_memory.py",
           "        _native_ops.rsm_ops_set_timeout(timeout_ms * 1_000_000)\n",
           "        pass\n",
           "set_default_timeout changes the Python path's waits only: the C++ op kernels keep "
           "the timeout of the moment they were loaded",
           catch="test_an_op_waits_as_long_as_the_default_timeout_set_last[one_shot_all_reduce]"),
    Mutant("registered_group_not_enabled_implicitly", "SM-2", "refimpl/symmetric_memory.py",
           "        enable_symm_mem_for_group(group_name)  # a registered ProcessGroup needs "
           "no setup\n",
           "        pass\n",
           "a rendezvous on a ProcessGroup never enabled by name fails: upstream and SPEC "
           "enable it implicitly",
           catch="test_a_rendezvous_on_a_registered_group_enables_it"),
    Mutant("naming_directory_left_open", "SM-12", "refimpl/symmetric_memory.py",
           "        os.close(proc_fds)\n", "        pass\n",
           "the /proc/self/fd directory opened to name each segment is never closed: a "
           "descriptor leaks per allocation",
           catch="test_rendezvous_of_dropped_allocations_leaves_no_descriptor_open"),
    Mutant("timeout_type_check_and", "SM-11", "refimpl/symmetric_memory.py",
           "if not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or timeout_ms < 0:",
           "if not isinstance(timeout_ms, int) and isinstance(timeout_ms, bool) or timeout_ms < 0:",
           "`or` written `and`: a float or a bool passes as a timeout",
           catch="test_arguments_of_the_wrong_type_are_refused_naming_them"),
    Mutant("index_type_check_and", "SM-9", "refimpl/symmetric_memory.py",
           "if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:",
           "if not isinstance(value, int) and isinstance(value, bool) or not 0 <= value < limit:",
           "`or` written `and`: True passes as a rank or a channel",
           catch="test_arguments_of_the_wrong_type_are_refused_naming_them"),
    Mutant("view_sizes_type_check_and", "SM-8", "refimpl/symmetric_memory.py",
           "        if any(not isinstance(s, int) or s < 0 for s in sizes):",
           "        if any(not isinstance(s, int) and s < 0 for s in sizes):",
           "`or` written `and`: a float passes as a view size",
           catch="test_arguments_of_the_wrong_type_are_refused_naming_them"),
    Mutant("size_type_check_and", "SM-3", "refimpl/symmetric_memory.py",
           "if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in size):",
           "if any(not isinstance(s, int) and isinstance(s, bool) or s < 0 for s in size):",
           "`or` written `and`: a float or a bool passes as a size",
           catch="test_arguments_of_the_wrong_type_are_refused_naming_them"),
    Mutant("alloc_id_type_check_and", "SM-4", "refimpl/symmetric_memory.py",
           "(not isinstance(alloc_id, int) or isinstance(alloc_id, bool)):",
           "(not isinstance(alloc_id, int) and isinstance(alloc_id, bool)):",
           "`or` written `and`: True passes as an alloc_id",
           catch="test_arguments_of_the_wrong_type_are_refused_naming_them"),
    Mutant("stride_zero_refused", "SM-3", "refimpl/symmetric_memory.py",
           "any(not isinstance(s, int) or s < 0 for s in stride)",
           "any(not isinstance(s, int) or s <= 0 for s in stride)",
           "strides checked as positive: a broadcast row (stride 0) is refused",
           catch="test_allocation_arguments_are_refused_naming_them"),
    Mutant("empty_takes_no_size_sequence", "SM-3", "refimpl/symmetric_memory.py",
           "    if len(size) == 1 and isinstance(size[0], Sequence):\n",
           "    if len(size) > 1 and isinstance(size[0], Sequence):\n",
           "empty((2, 3)) not unpacked as torch.empty does",
           catch="test_allocation_arguments_are_refused_naming_them"),
    Mutant("rendezvous_group_check_inverted", "SM-5", "refimpl/symmetric_memory.py",
           "alloc.group_name is not None and alloc.group_name != group_name:",
           "alloc.group_name is not None and alloc.group_name == group_name:",
           "the group check of rendezvous inverted: the tensor's own group is refused",
           catch="test_rendezvous_takes_the_group_the_tensor_was_allocated_for"),
    Mutant("whole_signal_pad_refused", "SM-8", "refimpl/symmetric_memory.py",
           "not 0 <= storage_offset <= elements:", "not 0 < storage_offset <= elements:",
           "the default view of the pad (offset 0, no sizes) refused: the bound off by one",
           catch="test_buffer_and_signal_pad_views_end_exactly_at_their_bounds"),
    Mutant("all_reduce_refuses_a_group_of_one", "SM-2", "kernels/cpu/symm_mem.c",
           "if (g->world < 1 || g->world > MAX_WORLD", "if (g->world <= 1 || g->world > MAX_WORLD",
           "the all-reduce's group check off by one: a group of one rank, which SM-2 allows, "
           "is refused",
           catch="test_all_reduces_at_the_smallest_group_and_sizes[one_rank]"),
    Mutant("reduce_refuses_a_group_of_one", "SM-15", "kernels/cpu/symm_mem.c",
           "if (nsrc < 1 || numel < 0 ||", "if (nsrc <= 1 || numel < 0 ||",
           "the reduction's argument check off by one: a group of one rank is refused",
           catch="test_all_reduces_at_the_smallest_group_and_sizes[one_rank]"),
    # C kernels
    Mutant("one_shot_second_barrier_left_out", "SM-15", "kernels/cpu/symm_mem.c",
           "  rsm_reduce(out, srcs, g->world, numel, dtype, op);\n"
           "  return barrier_until(g, channel, deadline);",
           "  rsm_reduce(out, srcs, g->world, numel, dtype, op);\n  return RSM_OK;",
           "one-shot returns after its own reduction: a peer may still read the input",
           catch="test_one_shot_and_two_shot_sum_are_bitwise_the_rank_order_reference[float32-2]"),
    Mutant("barrier_puts_into_the_peers_own_slot", "SM-10", "kernels/cpu/symm_mem.c",
           "put(slot_of(g->pads[peer], world, channel, rank)",
           "put(slot_of(g->pads[peer], world, channel, peer)",
           "the slot index of a put taken from the receiver instead of the sender",
           catch="test_rendezvous_gives_one_handle_over_every_peers_buffer[2]"),
    Mutant("reduction_in_reverse_rank_order", "SM-15", "kernels/cpu/symm_mem.c",
           "for (int r = 0; r < g->world; r++) srcs[r] = (char *)g->bufs[r] + offset;",
           "for (int r = 0; r < g->world; r++) srcs[r] = (char *)g->bufs[g->world - 1 - r] "
           "+ offset;",
           "ranks reduced last to first: other rounding, ranks may disagree with the spec",
           catch="test_one_shot_and_two_shot_sum_are_bitwise_the_rank_order_reference[float32-3]"),
    Mutant("two_shot_chunk_rounded_down", "SM-16", "kernels/cpu/symm_mem.c",
           "int64_t chunk = (numel + g->world - 1) / g->world;",
           "int64_t chunk = numel / g->world;",
           "floor instead of ceil: the elements past world * chunk are never reduced",
           catch="test_one_shot_and_two_shot_sum_are_bitwise_the_rank_order_reference[float32-2]"),
    Mutant("timeout_reported_as_success", "SM-11", "kernels/cpu/symm_mem.c",
           "return try_transition(slot, ready, ready_with_sleeper, next, order) ? 0 : 1;",
           "return try_transition(slot, ready, ready_with_sleeper, next, order) ? 1 : 0;",
           "the status of the last try after the deadline inverted",
           catch="test_a_wait_times_out_naming_the_peer"),
    Mutant("pair_avg_divides_by_one", "SM-15", "kernels/cpu/symm_mem.c",
           "out[i] = STORE(ADD(LOAD(a[i]), LOAD(b[i])) / (ACC_T)2);",
           "out[i] = STORE(ADD(LOAD(a[i]), LOAD(b[i])) / (ACC_T)1);",
           "a group of two's avg is its sum",
           catch="test_every_dtype_and_reduce_op_in_rank_order_on_every_rank[2]"),
    Mutant("pair_sum_reads_its_own_input_twice", "SM-15", "kernels/cpu/symm_mem.c",
           "out[i] = STORE(ADD(LOAD(a[i]), LOAD(b[i])));",
           "out[i] = STORE(ADD(LOAD(a[i]), LOAD(a[i])));",
           "the one-pass sum of two ranks reads the first rank's input twice",
           catch="test_one_shot_and_two_shot_sum_are_bitwise_the_rank_order_reference[float32-2]"),
    Mutant("pair_path_taken_by_larger_groups", "SM-15", "kernels/cpu/symm_mem.c",
           "    if (nsrc == 2) {", "    if (nsrc >= 2) {",
           "groups of three or more take the two-source pass: later ranks are dropped",
           catch="test_one_shot_and_two_shot_sum_are_bitwise_the_rank_order_reference[float32-3]"),
    Mutant("avg_divides_by_one_rank_less", "SM-15", "kernels/cpu/symm_mem.c",
           "acc[i] = acc[i] / (ACC_T)nsrc;", "acc[i] = acc[i] / (ACC_T)(nsrc - 1);",
           "avg divides by the number of additions instead of the number of ranks",
           catch="test_every_dtype_and_reduce_op_in_rank_order_on_every_rank[3]"),
    Mutant("max_drops_a_later_ranks_nan", "SM-15", "kernels/cpu/symm_mem.c",
           "#define FMAX(a, b) (isnan(a) ? (a) : (isnan(b) ? (b) : ((b) > (a) ? (b) : (a))))",
           "#define FMAX(a, b) (isnan(a) ? (a) : ((b) > (a) ? (b) : (a)))",
           "NaN propagates only from the accumulator, not from a later rank's input",
           catch="test_every_dtype_and_reduce_op_in_rank_order_on_every_rank[3]"),
    Mutant("call_check_skips_the_last_rank", "SM-20", "kernels/cpu/symm_mem.c",
           "for (int r = 1; r < g->world; r++) {\n    const int64_t *d = g->descs[r];",
           "for (int r = 1; r < g->world - 1; r++) {\n    const int64_t *d = g->descs[r];",
           "off by one: the last rank's call is never compared",
           catch="test_a_call_that_differs_between_ranks_fails_on_every_rank_naming_the_rank"),
    Mutant("barrier_waits_for_one_peer_less", "SM-10", "kernels/cpu/symm_mem.c",
           "  for (int i = 1; i < world; i++) {\n    int peer = (rank + i) % world;\n"
           "    if (take(",
           "  for (int i = 1; i < world - 1; i++) {\n    int peer = (rank + i) % world;\n"
           "    if (take(",
           "the barrier's wait loop stops one peer short",
           catch="test_rendezvous_gives_one_handle_over_every_peers_buffer[2]"),
    # C++ op kernels
    Mutant("native_sub_step_adds", "SM-24", "kernels/cpu/symm_mem_ops.cpp",
           "map_elements(source, target, numel, [c](float x) { return x - c; });",
           "map_elements(source, target, numel, [c](float x) { return x + c; });",
           "sub computed as add",
           catch="test_pointwise_steps_are_bitwise_the_aten_ops_on_every_rank"),
    Mutant("native_add_number_not_rounded_to_the_dtype", "SM-24",
           "kernels/cpu/symm_mem_ops.cpp",
           "    float c = step.op == 'm' ? step.number : static_cast<float>(static_cast<T>("
           "step.number));\n",
           "    float c = step.number;\n",
           "the number of add taken as a float, where ATen's add rounds it to bfloat16 first",
           catch="test_pointwise_steps_are_bitwise_the_aten_ops_on_every_rank"),
    Mutant("native_steps_all_read_the_input", "SM-24", "kernels/cpu/symm_mem_ops.cpp",
           "    source = target;  // the next step reads what this one wrote\n", "",
           "every step reads the input: only the last one counts",
           catch="test_pointwise_steps_are_bitwise_the_aten_ops_on_every_rank"),
    Mutant("native_hex_numbers_accepted", "SM-24", "kernels/cpu/symm_mem_ops.cpp",
           '  if (!named && number.find_first_not_of("0123456789.eE+-") != std::string::npos)'
           ' return false;\n', "",
           "strtod reads hex ('0x10'), which Python's float refuses: the fast path accepts "
           "what Python refuses",
           catch="test_pointwise_arguments_are_refused_on_every_rank_before_any_wait"),
    Mutant("native_overlapping_local_input", "SM-24", "kernels/cpu/symm_mem_ops.cpp",
           "  if (input.storage().data() == buffer.storage().data() &&\n"
           "      input.data_ptr() != buffer.data_ptr()) {\n",
           "  if (false) {\n",
           "a local input inside the buffer's allocation taken by the fast path",
           catch="test_pointwise_arguments_are_refused_on_every_rank_before_any_wait"),
    Mutant("python_steps_read_the_input", "SM-24", "refimpl/symmetric_memory.py",
           "        POINTWISE_STEPS[op].out(target, value, out=target)\n",
           "        POINTWISE_STEPS[op].out(source, value, out=target)\n",
           "the Python kernel's later steps read the input again",
           catch="test_pointwise_steps_are_bitwise_the_aten_ops_on_every_rank"),
    Mutant("pointwise_fake_kernel_checks_nothing", "SM-24", "refimpl/symmetric_memory.py",
           "    _check_pointwise(symm_buffer, local_input, reduce_op, prologue, epilogue,\n"
           "                     \"one_shot_all_reduce_pointwise\", real=False)\n", "",
           "the fake kernel only shapes the result: a bad step passes tracing",
           catch="test_pointwise_schema_and_fake_kernel"),
    Mutant("python_two_spaces_accepted", "SM-24", "refimpl/symmetric_memory.py",
           "value is None or number != number.strip():",
           "value is None:",
           "'mul  2.0' accepted: float() strips the extra space",
           catch="test_pointwise_arguments_are_refused_on_every_rank_before_any_wait"),
    Mutant("native_serves_under_another_allocator", "SM-1", "kernels/cpu/symm_mem_ops.cpp",
           "if (!enabled || !input.is_contiguous() || one_shot_fn == nullptr) return false;",
           "if (!input.is_contiguous() || one_shot_fn == nullptr) return false;",
           "the fast path keeps serving refimpl's allocations after another allocator was "
           "registered for cpu: the ops no longer ask the registered one",
           catch="test_functions_and_ops_use_the_allocator_registered_now"),
    Mutant("native_group_name_unchecked", "SM-14", "kernels/cpu/symm_mem_ops.cpp",
           "if (it == table.end() || it->second.group_name != group_name) return false;",
           "if (it == table.end()) return false;",
           "an allocation found by its address alone: a call naming another group of the "
           "same ranks reduces over the allocation's group",
           catch="test_op_arguments_are_refused_on_every_rank_before_any_wait"),
    Mutant("native_result_recycled_while_held", "SM-15", "kernels/cpu/symm_mem_ops.cpp",
           "if (!last || last.use_count() != 1 ||", "if (!last || last.use_count() > 2 ||",
           "the recycling check counts the caller's hold as the cache's: a held result is "
           "overwritten by the next call",
           catch="test_every_result_is_a_new_tensor_while_earlier_ones_are_held"),
    Mutant("native_out_status_ignored", "SM-20", "kernels/cpu/symm_mem_ops.cpp",
           '  if (status != 0) {\n    raise_status(input, group_name, "one_shot_all_reduce_out", '
           'status, *call.peer);\n  }', "  (void)status;",
           "the out= kernel drops the C kernel's status: a mismatched call returns garbage",
           catch="test_a_call_that_differs_between_ranks_fails_on_every_rank_naming_the_rank"),
    Mutant("native_pointwise_status_ignored", "SM-20", "kernels/cpu/symm_mem_ops.cpp",
           '  if (status != 0) {\n    raise_status(buffer, group_name, '
           '"one_shot_all_reduce_pointwise", status, *call.peer);\n  }', "  (void)status;",
           "the pointwise kernel drops the C kernel's status",
           catch="test_a_call_that_differs_between_ranks_fails_on_every_rank_naming_the_rank"),
    Mutant("native_strided_out_accepted", "SM-14", "kernels/cpu/symm_mem_ops.cpp",
           "bool plain = out.is_contiguous() && out.device().is_cpu() &&",
           "bool plain = out.device().is_cpu() &&",
           "the fast path writes a strided out as if it were contiguous",
           catch="test_op_arguments_are_refused_on_every_rank_before_any_wait"),
    Mutant("native_step_without_a_number", "SM-24", "kernels/cpu/symm_mem_ops.cpp",
           "if (end - begin < 5 || text[begin + 3] != ' ') return false;",
           "if (end - begin < 4 || text[begin + 3] != ' ') return false;",
           "one character short at the bound: 'add ' parses as add 0",
           catch="test_pointwise_arguments_are_refused_on_every_rank_before_any_wait"),
    Mutant("native_number_prefix_accepted", "SM-24", "kernels/cpu/symm_mem_ops.cpp",
           "if (number[0] == ' ' || stop != number.c_str() + number.size()) return false;",
           "if (number[0] == ' ') return false;",
           "strtod's stop unchecked: 'mul 1.5.5' reads as mul 1.5",
           catch="test_pointwise_arguments_are_refused_on_every_rank_before_any_wait"),
    Mutant("native_chain_cache_by_length", "SM-24", "kernels/cpu/symm_mem_ops.cpp",
           "  if (view == cached) return true;",
           "  if (view.size() == cached.size() && !cached.empty()) return true;",
           "the parsed chain reused for any text of the same length",
           catch="test_pointwise_steps_are_bitwise_the_aten_ops_on_every_rank"),
    Mutant("native_avg_accepted_for_integers", "SM-14", "kernels/cpu/symm_mem_ops.cpp",
           'if (op == "avg") return dtype <= 2 ? 1 : -1;', 'if (op == "avg") return 1;',
           "the fast path forgets that avg needs a floating dtype",
           catch="test_op_arguments_are_refused_on_every_rank_before_any_wait"),
    # Python
    Mutant("buffer_view_one_element_past_the_end", "SM-8", "refimpl/symmetric_memory.py",
           "        if end > limit:\n", "        if end > limit + element:\n",
           "the bound compares the end with one element of slack",
           catch="test_buffer_and_signal_pad_views_end_exactly_at_their_bounds"),
    Mutant("one_channel_too_many", "SM-9", "refimpl/symmetric_memory.py",
           "self.channels = SIGNAL_PAD_SIZE // (4 * world_size)",
           "self.channels = SIGNAL_PAD_SIZE // (4 * world_size) + 1",
           "the channel count rounded up: the last channel's slots lie past the pad",
           catch="test_every_channel_up_to_the_last_works_and_one_more_is_refused[2]"),
    Mutant("world_size_of_64_refused", "SM-2", "refimpl/symmetric_memory.py",
           "not 1 <= world_size <= MAX_WORLD_SIZE", "not 1 <= world_size < MAX_WORLD_SIZE",
           "< for <= at the world size bound",
           catch="test_group_info_bounds"),
    Mutant("a_live_view_of_a_persistent_allocation_not_counted", "SM-4",
           "refimpl/symmetric_memory.py",
           "held_past_grace(lambda: _storage_users(alloc.storage), 1)",
           "held_past_grace(lambda: _storage_users(alloc.storage), 2)",
           "the allocator's own tensor counted twice: one live holder goes unnoticed",
           catch="test_persistent_allocation_boundaries_and_its_three_refusals"),
    Mutant("reissued_live_view_not_counted", "SM-4", "refimpl/symmetric_memory.py",
           "if held_past_grace(use_count, 2):", "if held_past_grace(use_count, 3):",
           "a repeated request counts the allocator's tensor twice: one live holder passes",
           catch="test_persistent_allocation_returns_the_same_memory_once_free"),
    Mutant("reissue_skips_the_alive_check", "SM-4", "refimpl/symmetric_memory.py",
           "            if held_past_grace(use_count, 2):  # more users than the storage "
           "object and the owner\n"
           "                check_persistent(alloc, True, alloc.nbytes, alloc.group_name, "
           "alloc_id)\n", "",
           "the repeated request is a bare lookup: a live allocation is handed out twice",
           catch="test_persistent_allocation_returns_the_same_memory_once_free"),
    Mutant("a_finished_collectives_worker_counted_as_a_live_holder", "SM-4",
           "refimpl/symmetric_memory.py",
           "RELEASE_GRACE_S = 1.0", "RELEASE_GRACE_S = 0.0",
           "the users read once: the reference gloo's worker thread drops just after a wait "
           "returns is taken for a live holder, and the next call's request is refused "
           "(found by CI's second-tier fuzz run, CL seed 1035)",
           catch="test_a_view_another_thread_lets_go_of_at_once_is_no_live_holder"),
    Mutant("default_timeout_of_zero_accepted", "SM-11", "refimpl/symmetric_memory.py",
           "isinstance(timeout_ms, bool) or timeout_ms <= 0:",
           "isinstance(timeout_ms, bool) or timeout_ms < 0:",
           "< for <= at the bound: a default of 0 ms, which every wait then exceeds at once",
           catch="test_the_default_timeout_is_a_positive_int"),
    Mutant("default_timeout_of_true_accepted", "SM-11", "refimpl/symmetric_memory.py",
           "isinstance(timeout_ms, bool) or timeout_ms <= 0:", "timeout_ms <= 0:",
           "True taken as 1 ms",
           catch="test_the_default_timeout_is_a_positive_int"),
    Mutant("dropped_allocation_keeps_its_file", "SM-12", "refimpl/symmetric_memory.py",
           "        if alloc.fd is not None:\n            os.close(alloc.fd)\n",
           "        if alloc.fd is None:\n            os.close(alloc.fd)\n",
           "the check inverted: a dropped allocation's descriptor stays open (a process runs "
           "out of files)",
           catch="test_a_dropped_allocation_closes_its_file"),
    Mutant("reissue_ignores_a_direct_grant", "SM-4", "refimpl/symmetric_memory.py",
           "if alloc.layout is not layout:", "if False:",
           "a repeated request hands out the kept tensor of whatever layout was granted last",
           catch="test_functions_and_ops_use_the_allocator_registered_now"),
    Mutant("rendezvous_timeout_names_the_ranks_that_came", "SM-11",
           "refimpl/symmetric_memory.py",
           "if not info.store.check([k])]", "if info.store.check([k])]",
           "the missing ranks computed from the keys that are there",
           catch="test_a_rendezvous_times_out_naming_the_rank_that_never_came[one_never_comes]"),
    Mutant("repeated_request_on_another_device", "SM-1", "refimpl/symmetric_memory.py",
           "and granted[3] == device and", "and granted[3] != device and",
           "the remembered request's device compared the wrong way: a request for a device "
           "type without an allocator gets the remembered tensor",
           catch="test_persistent_allocation_boundaries_and_its_three_refusals"),
    Mutant("is_symm_mem_tensor_without_an_allocator", "SM-6", "refimpl/symmetric_memory.py",
           "return allocator is not None and allocator.allocation_of(tensor) is not None",
           "return allocator.allocation_of(tensor) is not None",
           "a tensor on a device type without an allocator raises instead of being no "
           "symmetric tensor",
           catch="test_is_symm_mem_tensor_knows_its_allocations_and_nothing_else"),
    Mutant("pointwise_steps_takes_a_bool", "SM-24", "refimpl/symmetric_memory.py",
           "if isinstance(number, bool) or not isinstance(number, (int, float)):",
           "if not isinstance(number, (int, float)):",
           "True accepted as the number 1",
           catch="test_pointwise_arguments_are_refused_on_every_rank_before_any_wait"),
    Mutant("python_kernel_skips_the_plain_copy", "SM-24", "refimpl/symmetric_memory.py",
           "if source.data_ptr() != target.data_ptr():",
           "if source.data_ptr() == target.data_ptr():",
           "the Python kernel's copy without steps inverted: the buffer keeps old data",
           catch="test_pointwise_steps_are_bitwise_the_aten_ops_on_every_rank"),
    Mutant("op_group_named_as_rendezvous_names_it", "SM-14", "refimpl/symmetric_memory.py",
           "        _check_group_of(alloc, group_name, where, arg)\n", "",
           "an op given another group is refused by rendezvous, naming its `group`, not the "
           "op's `group_name`",
           catch="test_op_arguments_are_refused_on_every_rank_before_any_wait"),
    Mutant("registry_keeps_earlier_grants", "SM-1", "refimpl/symmetric_memory.py",
           "    _granted.clear()  # requests granted by the allocator this one replaces\n", "",
           "a repeated persistent request is granted again by the allocator that was "
           "replaced",
           catch="test_functions_and_ops_use_the_allocator_registered_now"),
    Mutant("repeated_request_ignores_the_group", "SM-4", "refimpl/symmetric_memory.py",
           " and granted[4] == group_name):", "):",
           "the repeat check compares the layout and device, not the group",
           catch="test_persistent_allocation_boundaries_and_its_three_refusals"),
    Mutant("persistent_layout_ignores_the_dtype", "SM-3", "refimpl/symmetric_memory.py",
           "layout = (size, stride, dtype)", "layout = (size, stride)",
           "a request of another dtype and the same shape gets the previous dtype's tensor",
           catch="test_persistent_allocation_boundaries_and_its_three_refusals"),
    Mutant("persistent_reuse_skips_the_byte_size_check", "SM-4", "refimpl/symmetric_memory.py",
           "nbytes = alloc.nbytes if same else storage_elements(size, stride) * dtype.itemsize",
           "nbytes = alloc.nbytes",
           "the kept byte size compared with itself: a request of another size passes",
           catch="test_persistent_allocation_boundaries_and_its_three_refusals"),
    Mutant("barrier_timeout_not_fail_stop", "SM-19", "refimpl/symmetric_memory.py",
           'if what not in ("put_signal", "wait_signal"):',
           'if what not in ("put_signal", "wait_signal", "barrier"):',
           "a barrier that timed out leaves the handle usable, its stale signals with it",
           catch="test_a_barrier_that_timed_out_makes_the_handle_fail_stop"),
    Mutant("largest_alloc_id_refused", "SM-4", "refimpl/symmetric_memory.py",
           "not 0 <= alloc_id <= MAX_ALLOC_ID", "not 0 <= alloc_id < MAX_ALLOC_ID",
           "< for <= at the alloc_id bound",
           catch="test_persistent_allocation_boundaries_and_its_three_refusals"),
    Mutant("pad_offset_past_the_end_reported_as_sizes", "SM-8", "refimpl/symmetric_memory.py",
           "not 0 <= storage_offset <= elements:", "not 0 <= storage_offset <= elements + 1:",
           "the offset bound one element late: the error names sizes, not the offset",
           catch="test_buffer_and_signal_pad_views_end_exactly_at_their_bounds"),
    Mutant("empty_checks_size_after_strides", "SM-3", "refimpl/symmetric_memory.py",
           "    size, _ = _check_shape(size, None)  # before the strides are derived from it\n",
           "",
           "the size check left to empty_strided_p2p, after the strides failed on it",
           catch="test_allocation_arguments_are_refused_naming_them"),
    Mutant("python_two_shot_status_ignored", "SM-20", "refimpl/symmetric_memory.py",
           '''    if status:
        handle._check(status, peer, "two_shot_all_reduce_", OP_CHANNEL, timeout)
''', "",
           "the Python two-shot kernel (a call the C++ kernel hands over: the first on an "
           "allocation) drops the kernel's status: a mismatch between ranks returns "
           "whatever the buffer holds",
           catch="test_a_call_that_differs_between_ranks_fails_on_every_rank_naming_the_rank"),
    Mutant("kernel_query_loads_the_op_kernels", "SM-18", "refimpl/symmetric_memory.py",
           '''    source = _native.KERNEL_DIR / "symm_mem.c"
    loaded = c_kernels() if c_kernels.cache_info().currsize else None
''', '''    _load_native_ops_once()
    source = _native.KERNEL_DIR / "symm_mem.c"
    loaded = c_kernels()
''',
           "asking which kernels serve the ops loads them: a program that asks before its "
           "first rendezvous builds and loads both libraries as if at import",
           catch="test_the_kernels_in_use_are_built_from_this_source"),
    Mutant("first_rendezvous_leaves_the_op_kernels_unloaded", "SM-18",
           "refimpl/symmetric_memory.py",
           "        _load_native_ops_once()\n        if _native_ops is not None:",
           "        if _native_ops is not None:",
           "the CPU rendezvous registers its allocation only with C++ kernels already "
           "loaded, and nothing loads them: the Python kernels serve every call for good",
           catch="test_the_kernels_in_use_are_built_from_this_source"),
    Mutant("python_kernels_switch_ignored", "SM-18", "refimpl/symmetric_memory.py",
           '''    if os.environ.get("REFIMPL_SYMM_MEM_NATIVE_OPS", "1") == "0":
        return None
''', "",
           "REFIMPL_SYMM_MEM_NATIVE_OPS=0 not read: the Python kernels, which serve CPU "
           "wherever the C++ ones cannot be built, never run a whole call in any check",
           catch="test_the_python_kernels_serve_cpu_with_the_same_results"),
    Mutant("view_sizes_checked_on_all_dims_at_once", "SM-8", "refimpl/symmetric_memory.py",
           "if any(not isinstance(s, int) or s < 0 for s in sizes):",
           "if all(not isinstance(s, int) or s < 0 for s in sizes):",
           "all for any: a view's sizes are refused only when every one is bad",
           catch="test_buffer_and_signal_pad_views_end_exactly_at_their_bounds"),
    Mutant("strides_checked_on_all_dims_at_once", "SM-3", "refimpl/symmetric_memory.py",
           "if len(stride) != len(size) or any(not isinstance(s, int) or s < 0 for s in stride):",
           "if len(stride) != len(size) or all(not isinstance(s, int) or s < 0 for s in stride):",
           "all for any: one negative stride beside a good one passes",
           catch="test_allocation_arguments_are_refused_naming_them"),
    Mutant("empty_only_when_every_dim_is_0", "SM-3", "refimpl/symmetric_memory.py",
           "    if any(s == 0 for s in size):\n        return 0\n",
           "    if all(s == 0 for s in size):\n        return 0\n",
           "all for any: a (4, 0) tensor spans its other dims' elements of storage",
           catch="test_allocation_arguments_are_refused_naming_them"),
    Mutant("rendezvous_names_the_highest_missing_rank", "SM-11", "refimpl/symmetric_memory.py",
           "missing[0] if missing else -1) from None",
           "missing[-1] if missing else -1) from None",
           "[-1] for [0]: of two ranks that never came, the timeout's peer is the higher",
           catch="test_a_rendezvous_times_out_naming_the_rank_that_never_came[two_never_come]"),
    Mutant("persistent_owner_made_in_the_callers_mode", "SM-4", "refimpl/symmetric_memory.py",
           "        with torch.inference_mode(False):  # it outlives the call: autograd may "
           "see it later",
           "        if True:  # it outlives the call: autograd may see it later",
           "the tensor over a persistent allocation made in whatever mode the first caller "
           "ran: made under inference mode, it is an inference tensor for every later "
           "request, which autograd refuses to save",
           catch="test_a_persistent_allocation_first_made_in_inference_mode_serves_autograd_later"),
    Mutant("grant_keyed_by_the_callers_lists", "SM-4", "refimpl/symmetric_memory.py",
           "    size = tuple(size)\n", "",
           "the sizes kept as the caller gave them: the last grant remembers the caller's "
           "list, which the caller changes in place, and the next request by it is waved "
           "through with the old layout",
           catch="test_persistent_allocation_boundaries_and_its_three_refusals"),
    Mutant("native_offset_from_data_ptr", "SM-20", "kernels/cpu/symm_mem_ops.cpp",
           "  call.offset = input.storage_offset() * static_cast<int64_t>(input.element_size());",
           "  call.offset = static_cast<int64_t>(reinterpret_cast<uintptr_t>(input.data_ptr()) - "
           "storage);",
           "the byte offset from data_ptr(), which is null for a tensor without elements: "
           "empty calls at different offsets look alike (found by the first GPU run)",
           catch="test_a_call_that_differs_between_ranks_fails_on_every_rank_naming_the_rank"),
    Mutant("python_offset_from_data_ptr", "SM-20", "refimpl/symmetric_memory.py",
           "    return handle, _byte_offset(input, alloc.base)",
           "    return handle, input.data_ptr() - alloc.base",
           "the Python kernels' byte offset from data_ptr(), 0 for a tensor without elements "
           "(the CUDA kernels then refused every empty call; found by the first GPU run)",
           catch="test_the_python_kernels_serve_cpu_with_the_same_results"),
    Mutant("enable_group_uses_global_rank", "SM-2", "refimpl/symmetric_memory.py",
           "    set_group_info(group_name, pg.rank(), pg.size(), store)",
           "    set_group_info(group_name, dist.get_rank(), pg.size(), store)",
           "takes the process's global rank where the group rank belongs; the two agree on "
           "WORLD, so only subgroups show it (red team)",
           catch="test_a_subgroup_is_enabled_with_each_members_rank_in_it[process_group]"),
    Mutant("rendezvous_cached_handle_group_check_needs_alloc_group", "SM-5",
           "refimpl/symmetric_memory.py",
           "        if alloc.handle.group_name != group_name:",
           "        if alloc.group_name is not None and alloc.handle.group_name != "
           "group_name:",
           "The check of a cached handle against the requested group runs only for "
           "tensors allocated with a group, so a group-less allocation rendezvoused for "
           "group 'a' is silently returned as its handle when rendezvous is called for "
           "group 'b'. (red team)",
           catch="test_a_tensor_allocated_without_a_group_keeps_the_group_of_i"
                 "ts_rendezvous"),
    Mutant("barrier_op_ignores_timeout", "SM-11", "refimpl/symmetric_memory.py",
           "    handle.barrier(channel, timeout_ms)",
           "    handle.barrier(channel)",
           "The barrier op drops its timeout_ms argument and always waits the module "
           "default, while the handle's barrier method honours the timeout; every wait "
           "must end by its own timeout. (red team)",
           catch="test_the_barrier_op_ends_by_its_own_timeout"),
    Mutant("python_kernels_withdrawn_before_build", "SM-18", "refimpl/symmetric_memory.py",
           "        _native_ops_path = build_torch_op_library(\"symm_mem_ops\")\n       "
           " _python_cpu_kernels.withdraw()",
           "        _python_cpu_kernels.withdraw()\n        _native_ops_path = "
           "build_torch_op_library(\"symm_mem_ops\")",
           "Checks in the wrong order: the Python CPU kernels are withdrawn before the "
           "C++ build is attempted, and only a failed load (not a failed build) "
           "restores them, so where the C++ kernels cannot be built the ops have no CPU "
           "kernel at all. (red team)",
           catch="test_the_python_kernels_serve_cpu_where_the_cxx_kernels_cann"
                 "ot_be_built"),
    Mutant("backend_imported_without_device", "SM-1", "refimpl/symmetric_memory.py",
           "    if allocator is None and device_type in BACKEND_MODULES and "
           "_device_present(device_type):",
           "    if allocator is None and device_type in BACKEND_MODULES:",
           "The lazy backend import forgets the check that torch sees such a device, so "
           "asking for 'cuda' on a machine without a GPU imports the CUDA backend "
           "(SM-21: nothing of it may be imported there) instead of just refusing. (red "
           "team)",
           catch="test_a_device_type_torch_does_not_see_imports_no_backend"),
    Mutant("contiguity_checked_on_fast_path_only", "SM-14", "refimpl/symmetric_memory.py",
           "    if not input.is_contiguous():",
           "    elif not input.is_contiguous():",
           "Only one path makes the step: the contiguity check hangs off the fast-path "
           "branch, so an input whose (reduce_op, dtype) pair went through the "
           "explaining slow path (say a reduce_op written in upper case) is never "
           "checked for contiguity. (red team)",
           catch="test_op_arguments_are_refused_on_every_rank_before_any_wait"),
    Mutant("empty_chain_needs_floating_dtype", "SM-24", "refimpl/symmetric_memory.py",
           "    if parsed and dtype not in POINTWISE_DTYPES:",
           "    if dtype not in POINTWISE_DTYPES:",
           "The floating-dtype requirement of steps is applied to every chain, the "
           "empty one included, though only a chain that has steps needs "
           "float32/bfloat16/float16. (red team)",
           catch="test_pointwise_arguments_are_refused_on_every_rank_before_any_wait"),
    Mutant("op_timeout_default_read_at_import", "SM-11", "refimpl/symmetric_memory.py",
           "def _one_shot_on(handle, offset, numel, codes, out, where):\n    timeout = "
           "_default_timeout_ms",
           "def _one_shot_on(handle, offset, numel, codes, out, where, "
           "timeout=_default_timeout_ms):",
           "The module default is captured as a parameter default when the module is "
           "imported, so set_default_timeout no longer reaches the one-shot ops' Python "
           "kernels (two-shot and barrier still read it at call time). (red team)",
           catch="test_the_python_kernels_wait_as_long_as_the_default_timeout_"
                 "set_last[one_shot_all_reduce]"),
    Mutant("allocation_released_with_first_tensor", "SM-6", "refimpl/symmetric_memory.py",
           "        weakref.finalize(view, self._release, alloc)  # the last tensor "
           "over it died\n        self._live[alloc.base] = alloc\n        return "
           "torch.frombuffer(view, dtype=torch.uint8).view(dtype).as_strided(size, "
           "stride)",
           "        self._live[alloc.base] = alloc\n        tensor = "
           "torch.frombuffer(view, dtype=torch.uint8).view(dtype).as_strided(size, "
           "stride)\n        weakref.finalize(tensor, self._release, alloc)  # the last "
           "tensor over it died\n        return tensor",
           "Wrong object for the lifetime: the release is tied to the tensor handed out "
           "instead of the buffer its storage holds, so when that tensor dies while a "
           "view of it lives, the allocation is forgotten (and its fd closed). (red "
           "team)",
           catch="test_is_symm_mem_tensor_knows_its_allocations_and_nothing_else"),
    Mutant("fail_stop_only_after_a_barrier", "SM-19", "refimpl/symmetric_memory.py",
           '        if what not in ("put_signal", "wait_signal"):',
           '        if what == "barrier":',
           "Fail-stop is wired to the barrier only; the all-reduce ops, whose kernels also"
           " run barriers and can time out after signalling some peers, are forgotten. "
           "(red team)",
           catch="test_an_all_reduce_that_timed_out_makes_the_handle_fail_stop["
                 "one_shot_all_reduce]"),
]

# --------------------------------------------------------------------------------------
# 8. Simulator (SIM)
# --------------------------------------------------------------------------------------
SIMULATOR = "refimpl/simulator.py"
SIM = [
    Mutant("batched_matmul_flops_without_the_batch", "SIM-3", SIMULATOR,
           "    a, b = _val(node.args[1]), _val(node.args[2])\n    return 2 * a.shape[0] * "
           "a.shape[1] * a.shape[2] * b.shape[2]",
           "    a, b = _val(node.args[1]), _val(node.args[2])\n    return 2 * a.shape[1] * "
           "a.shape[2] * b.shape[2]",
           "baddbmm's FLOPs copied from addmm's: the batch left out (no case costed a batched "
           "matmul)",
           catch="test_batched_matmuls_views_and_an_input_read_twice"),
    Mutant("unannotated_views_cost_compute", "SIM-4", SIMULATOR,
           "renames_unannotated(target) or (bool(schema.returns)",
           "() or (bool(schema.returns)",
           "views told by their schema only: aten._unsafe_view, whose schema says no alias, "
           "costs a roofline",
           catch="test_batched_matmuls_views_and_an_input_read_twice"),
    Mutant("an_input_read_twice_moves_twice", "SIM-3", SIMULATOR,
           "                                         for a in node.all_input_nodes)",
           "                                         for a in node.args "
           "if isinstance(a, torch.fx.Node))",
           "bytes counted per argument, not per distinct input: x * x reads x's bytes twice",
           catch="test_batched_matmuls_views_and_an_input_read_twice"),
    Mutant("no_communication_is_no_overlap", "SIM-8", SIMULATOR,
           "overlap = (comm - exposed) / comm if comm > 0 else 1.0",
           "overlap = (comm - exposed) / comm if comm > 0 else 0.0",
           "a program without communication reports 0 overlap instead of 1.0 (nothing to hide)",
           catch="test_step_time_waits_for_every_stream"),
    Mutant("broadcast_inplace_costed_as_ring", "SIM-2", COMM_OPS,
           '_BROADCAST_ = dict(_BROADCAST, in_place=True, in_flight="inputs")',
           '_BROADCAST_ = dict(_BROADCAST, in_place=True, in_flight="inputs", algorithm="ring")',
           "The in-place broadcast_ entry is copied from the ring rows, so only the out-of-place "
           "broadcast gets the pipelined (n-1) alpha + B / beta; broadcast_ gets (n-1) alpha + "
           "(n-1)/n B / beta. (red team)",
           catch="test_coalesced_and_in_place_collective_costs"),
    Mutant("upstream_symm_mem_not_blocking", "SIM-7", COMM_OPS,
           "SYMM_MEM_NAMESPACES = (\"refimpl_symm_mem\", \"symm_mem\")",
           "SYMM_MEM_NAMESPACES = (\"refimpl_symm_mem\",)",
           "Only refimpl's symmetric-memory namespace is recognised as blocking kernels; "
           "upstream's torch.ops.symm_mem.one_shot_all_reduce falls through to the compute "
           "roofline on the compute stream. (red team)",
           catch="test_upstreams_blocking_one_shot_is_communication_too"),
    Mutant("wait_duration_hidden_in_waiting", "SIM-7", SIMULATOR,
           "                compute = max(compute, ready) + d",
           "                compute = max(compute, ready + d)",
           "The wait's own duration is added to the collective's end instead of to the later of "
           "arrival and that end, so a wait reached after its collective finished costs nothing. "
           "(red team)",
           catch="test_a_wait_reached_late_still_takes_its_own_time"),
    Mutant("step_time_ignores_comm_streams", "SIM-8", SIMULATOR,
           "        step = max([compute, *stream_free.values()])",
           "        step = compute",
           "Step time is taken as the compute stream's end only, forgetting collectives that no "
           "wait completes and that are still running on a comm stream. (red team)",
           catch="test_step_time_waits_for_every_stream"),
    Mutant("coalesced_inputs_read_as_no_bytes", "SIM-2", SIMULATOR,
           "    return torch.fx.node.map_arg(arg, lambda node: node.meta.get(\"val\"))",
           "    return arg.meta.get(\"val\") if isinstance(arg, torch.fx.Node) else arg",
           "a list argument's values not looked up: a coalesced reduce_scatter or "
           "all_reduce moves no bytes and costs its latency alone (an outside red team's "
           "find)",
           catch="test_coalesced_and_in_place_collective_costs"),
    Mutant("one_shot_reads_every_buffer_over_the_link", "SIM-2", "refimpl/simulator.py",
           '    "one_shot": lambda link, n, b: link.alpha_us + (n - 1) * b / '
           'link.beta_bytes_per_us,',
           '    "one_shot": lambda link, n, b: link.alpha_us + n * b / link.beta_bytes_per_us,',
           "the one-shot's own buffer counted as read over the link",
           catch="test_blocking_one_shot_all_reduce"),
    Mutant("all_to_all_costs_the_smaller_side", "SIM-2", "refimpl/simulator.py",
           "return max(_input_bytes(node), _output_bytes(node))",
           "return min(_input_bytes(node), _output_bytes(node))",
           "max for min: uneven splits cost the side that moves less",
           catch="test_all_to_all_costs_the_larger_of_its_input_and_result"),
    Mutant("pinned_zero_refused", "SIM-1", "refimpl/simulator.py",
           "            and us >= 0)", "            and us > 0)",
           "a pinned duration of 0 us refused: the bound off by one",
           catch="test_pinned_durations"),
    Mutant("sim_ring_steps", "SIM-2", SIMULATOR,
           "    return (n - 1) * link.alpha_us + (n - 1) / n * nbytes / link.beta_bytes_per_us\n",
           "    return n * link.alpha_us + (n - 1) / n * nbytes / link.beta_bytes_per_us\n",
           "ring latency off by one: n steps instead of n-1",
           catch="test_collective_costs"),
    Mutant("sim_ring_bytes", "SIM-2", SIMULATOR,
           "    return (n - 1) * link.alpha_us + (n - 1) / n * nbytes / link.beta_bytes_per_us\n",
           "    return (n - 1) * link.alpha_us + nbytes / link.beta_bytes_per_us\n",
           "ring bandwidth term without the (n-1)/n factor",
           catch="test_collective_costs"),
    Mutant("sim_all_reduce_one_ring", "SIM-2", COMM_OPS,
           '    "all_reduce": _ALL_REDUCE,\n',
           '    "all_reduce": dict(_ALL_REDUCE, algorithm="ring"),\n',
           "all_reduce costed as one ring pass instead of a reduce-scatter plus an all-gather",
           catch="test_collective_costs"),
    Mutant("sim_wait_not_blocking", "SIM-7", SIMULATOR,
           "                compute = max(compute, ready) + d\n",
           "                compute = compute + d\n",
           "a wait does not block the compute stream",
           catch="test_timeline_program_order"),
    Mutant("sim_one_comm_stream", "SIM-6", SIMULATOR,
           "                start = max(compute, stream_free.get(stream, 0.0))"
           "  # issued, then queued\n",
           "                start = max(compute, *stream_free.values())  # issued, then queued\n",
           "one comm stream for all groups: a collective waits for every group's previous one",
           catch="test_timeline_program_order"),
    Mutant("sim_group_not_serialized", "SIM-6", SIMULATOR,
           "                start = max(compute, stream_free.get(stream, 0.0))"
           "  # issued, then queued\n",
           "                start = compute  # issued, then queued\n",
           "collectives of one group run concurrently",
           catch="test_timeline_collectives_first"),
    Mutant("sim_view_costs", "SIM-4", SIMULATOR,
           "        if is_wait(node) or _is_view(node.target):\n",
           "        if is_wait(node):\n",
           "views are costed as compute (bytes moved)",
           catch="test_compute_is_a_roofline"),
    Mutant("sim_pinned_typo_accepted", "SIM-1", SIMULATOR,
           "        unknown = sorted(set(self.pinned) - names)\n",
           "        unknown = sorted(set(self.pinned) - names - set(self.pinned))\n",
           "a pinned name that names no node is silently ignored",
           catch="test_pinned_durations"),
    Mutant("sim_overlap_inverted", "SIM-8", SIMULATOR,
           "        overlap = (comm - exposed) / comm if comm > 0 else 1.0\n",
           "        overlap = exposed / comm if comm > 0 else 1.0\n",
           "overlap reports the exposed fraction instead of the hidden one",
           catch="test_timeline_program_order"),
    Mutant("sim_mm_flops_halved", "SIM-3", SIMULATOR,
           "    a, b = _val(node.args[0]), _val(node.args[1])\n"
           "    return 2 * a.shape[0] * a.shape[1] * b.shape[1]\n",
           "    a, b = _val(node.args[0]), _val(node.args[1])\n"
           "    return a.shape[0] * a.shape[1] * b.shape[1]\n",
           "a multiply-add counted as one FLOP",
           catch="test_compute_is_a_roofline"),
    Mutant("sim_roofline_sum", "SIM-3", SIMULATOR,
           "        return self.profile.op_overhead_us + max(flops / rate,\n",
           "        return self.profile.op_overhead_us + flops / rate + max(0,\n",
           "compute and memory time added instead of the slower of the two",
           catch="test_compute_is_a_roofline"),
    Mutant("sim_blocking_not_exposed", "SIM-7", SIMULATOR,
           "                exposed += end - compute\n",
           "                exposed += 0.0\n",
           "a blocking one-shot all-reduce is not counted as exposed communication",
           catch="test_blocking_one_shot_all_reduce"),
    Mutant("sim_peak_of_program_order", "SIM-8", SIMULATOR,
           "        plan = self.memory.plan(full)\n",
           "        plan = self.memory.plan()\n",
           "peak memory of the program order, not of the simulated one",
           catch="test_timeline_collectives_first"),
    Mutant("sim_trace_duration", "SIM-9", SIMULATOR,
           '"ts": e.start_us, "dur": e.end_us - e.start_us,',
           '"ts": e.start_us, "dur": e.end_us,',
           "the trace's duration is the event's end time",
           catch="test_chrome_trace"),
    Mutant("h100_without_default_link", "SIM-11", SIMULATOR,
           "    links[0] = links[8]\n", "",
           "the H100 profile has links for 2, 4 and 8 only: a group of 3 or 16 cannot be "
           "costed",
           catch="test_profiles"),
    Mutant("svg_memory_line_not_moved", "SIM-10", SIMULATOR,
           "        x, y = left + t * scale, base - live / peak * (mem_h - 10)\n", "",
           "the memory line's vertices keep the coordinates last drawn: a line that neither "
           "goes forward nor rises",
           catch="test_svg"),
    Mutant("sim_link_default_first", "SIM-11", SIMULATOR,
           "        link = self.links.get(group_size, self.links.get(0))\n",
           "        link = self.links.get(0, self.links.get(group_size))\n",
           "the default link shadows a group size's own",
           catch="test_profiles"),
    Mutant("symbolic_bytes_left_symbolic", "SIM-3", SIMULATOR,
           "        return size_hint(value.numel()) * value.element_size()",
           "        return value.numel() * value.element_size()",
           "a tensor's bytes taken as they are: of a graph traced with dynamic shapes, a "
           "symbolic expression, and so is every duration and time after it",
           catch="test_symbolic_sizes_cost_as_in_the_example"),
    Mutant("symbolic_matmul_flops_left_symbolic", "SIM-3", SIMULATOR,
           "        return size_hint(by_shape(node))  # of symbolic shapes: the example's",
           "        return by_shape(node)",
           "a matmul's FLOPs from symbolic shapes left symbolic",
           catch="test_symbolic_sizes_cost_as_in_the_example"),
    Mutant("comm_ops_reduce_scatter_costed_on_output", "SIM-2", COMM_OPS,
           '_REDUCE_SCATTER = dict(family="reduce_scatter", completes="wait", '
           'in_flight="inputs",\n                       cost_bytes="input"',
           '_REDUCE_SCATTER = dict(family="reduce_scatter", completes="wait", '
           'in_flight="inputs",\n                       cost_bytes="output"',
           "reduce_scatter's row copied from all_gather's, keeping cost_bytes=\"output\": "
           "the ring charged on the 1/n result instead of the input (blind red team)",
           catch="test_collective_costs"),
    Mutant("comm_ops_two_shot_costed_one_shot", "SIM-2", COMM_OPS,
           '"two_shot_all_reduce_": dict(_ONE_SHOT, in_place=True, algorithm="twice_ring"),',
           '"two_shot_all_reduce_": dict(_ONE_SHOT, in_place=True),',
           "two-shot derived from the one-shot row without overriding its algorithm: "
           "charged alpha + (n-1) B / beta instead of twice the ring (blind red team)",
           catch="test_a_two_shot_all_reduce_costs_twice_a_ring"),
    Mutant("comm_ops_one_shot_completed_by_a_wait", "SIM-7", COMM_OPS,
           '_ONE_SHOT = dict(family="all_reduce", completes="blocking", cost_bytes="input",',
           '_ONE_SHOT = dict(family="all_reduce", completes="wait", cost_bytes="input",',
           "the one-shot row written from the all_reduce template, keeping "
           "completes=\"wait\": a blocking kernel treated as an issued collective "
           "(blind red team)",
           catch="test_upstreams_blocking_one_shot_is_communication_too"),
    Mutant("p2p_costed_as_a_ring", "SIM-2", COMM_OPS,
           '    "isend": _P2P,\n',
           '    "isend": dict(_P2P, algorithm="ring"),\n',
           "isend given the default every other collective has, a ring over the group, "
           "though it moves its bytes to one peer once",
           catch="test_point_to_point_ops_cost_one_transfer"),
    Mutant("estimate_zero_falls_back_to_model", "SIM-1", SIMULATOR,
           "            if us is not None:",
           "            if us:",
           "a truthiness test for None: an estimate of 0 us handed back to the model (blind "
           "red team)",
           catch="test_an_estimator_gives_durations_by_node_pinned_names_first"),
    Mutant("group_size_only_oversize_refused", "SIM-2", SIMULATOR,
           "        if registered is not None and registered != given:",
           "        if registered is not None and registered < given:",
           "only a group_size larger than the group refused: 1 on a group of 4 makes the "
           "collective free (blind red team)",
           catch="test_a_group_size_that_is_not_the_groups_is_refused[1]"),
    Mutant("collective_times_miss_enclosing_stall", "SIM-8", SIMULATOR,
           "        k = max(bisect.bisect_right(starts, e.start_us) - 1, 0)",
           "        k = bisect.bisect_left(starts, e.start_us)",
           "the stalls searched from the first that starts at or after the collective: one "
           "already going when it starts is missed (blind red team)",
           catch="test_a_collective_queued_behind_another_is_exposed_by_a_stall_begun_before_it"),
    Mutant("estimate_asked_before_pinned", "SIM-1", SIMULATOR,
           "        if node.name in self.pinned:\n"
           "            return float(self.pinned[node.name])\n"
           "        if self.estimate is not None:",
           "        if self.estimate is not None and self.estimate(node) is None:\n"
           "            pass\n        elif self.estimate is not None:",
           "the estimator asked first, so a pinned name no longer wins over it",
           catch="test_an_estimator_gives_durations_by_node_pinned_names_first"),
    Mutant("estimate_not_checked", "SIM-1", SIMULATOR,
           "                if not _is_duration(us):\n"
           "                    raise ValueError(f\"estimate:",
           "                if False:\n                    raise ValueError(f\"estimate:",
           "whatever the estimator returns is taken as a duration: NaN, -1, a string",
           catch="test_an_estimate_that_is_no_duration_is_refused_naming_the_node[-1.0]"),
    Mutant("group_size_argument_trusted", "SIM-2", SIMULATOR,
           "        if registered is not None and registered != given:",
           "        if False and registered is not None and registered != given:",
           "the op's group_size taken as the group's size (a group_size of 1 costs nothing)",
           catch="test_a_group_size_that_is_not_the_groups_is_refused[1]"),
    Mutant("fully_exposed_when_any_part_is", "SIM-8", SIMULATOR,
           "        return self.end_us > self.start_us and self.hidden_us <= 0.0",
           "        return self.end_us > self.start_us and self.exposed_us > 0.0",
           "a collective counted fully exposed as soon as any of it was",
           catch="test_each_collective_reports_its_hidden_and_exposed_time"),
    Mutant("exposure_counted_from_the_wait_not_the_run", "SIM-8", SIMULATOR,
           "min(e.end_us, stalls[k][1]) - max(e.start_us, stalls[k][0]))",
           "stalls[k][1] - stalls[k][0])",
           "a stall counted whole for every collective it meets, not the part during its run",
           catch="test_each_collective_reports_its_hidden_and_exposed_time"),
    Mutant("blocking_ignores_busy_stream", "SIM-7", SIMULATOR,
           "elif node in self.stream:  # blocking: the compute stream waits for it\n"
           "                stream = self.stream[node]\n"
           "                start = max(compute, stream_free.get(stream, 0.0))",
           "elif node in self.stream:  # blocking: the compute stream waits for it\n"
           "                stream = self.stream[node]\n"
           "                start = compute",
           "Treats a blocking symmetric-memory kernel as running the moment the compute stream "
           "reaches it (it is synchronous, after all), forgetting it runs on its group's comm "
           "stream and must queue behind the group's still-running collective. (red team)",
           catch="test_a_blocking_kernel_queues_behind_its_groups_running_collective"
                 "[symm_mem.one_shot_all_reduce-30.0]"),
    Mutant("blocking_exposed_only_own_run", "SIM-8", SIMULATOR,
           "exposed += end - compute",
           "exposed += end - start",
           "Counts as exposed only the blocking kernel's own run, not the time the compute "
           "stream stands waiting while it is queued behind the group's previous collective, "
           "though the compute stream is waiting for communication the whole time. (red team)",
           catch="test_a_blocking_kernel_queues_behind_its_groups_running_collective"
                 "[symm_mem.one_shot_all_reduce-30.0]"),
    Mutant("blocking_stall_from_kernel_start", "SIM-8", SIMULATOR,
           "stalls.append((compute, end))",
           "stalls.append((start, end))",
           "Records the compute stream's stall for a blocking kernel as the kernel's own run "
           "rather than from when the compute stream reached it, so the collective it queued "
           "behind is credited as hidden although compute stood waiting during it. (red team)",
           catch="test_a_blocking_kernel_queues_behind_its_groups_running_collective"
                 "[symm_mem.one_shot_all_reduce-30.0]"),
    Mutant("pending_last_writer_wins", "SIM-7", SIMULATOR,
           "pending[done] = max(pending.get(done, 0.0), end)",
           "pending[done] = end",
           "Keeps only the end of the last collective issued on a buffer, so a wait that "
           "completes several in-flight collectives on one buffer (MEM-5's pairing) waits for "
           "the last-issued one rather than for the latest-ending one. (red team)",
           catch="test_one_wait_completes_two_in_place_collectives_on_one_buffer"
                 "[longer_first-refimpl]"),
    Mutant("point_to_point_blocking", "SIM-6", COMM_OPS,
           "_P2P = dict(family=\"point_to_point\", completes=\"wait\", in_flight=\"inputs\",",
           "_P2P = dict(family=\"point_to_point\", completes=\"blocking\", in_flight=\"inputs\",",
           "Point-to-point sends are taken to be synchronous and their completion is marked "
           "'blocking', so isend, irecv and batch_p2p_ops are no longer collectives completed "
           "by their wait (appendix Completion column): they do not overlap compute, hold "
           "nothing in flight, and have no RO-8 kind. (red team)",
           catch="test_a_point_to_point_op_overlaps_compute_until_its_wait[isend]"),
    Mutant("falsy_profile_read_as_default", "SIM-1", SIMULATOR,
           "        self.profile = H100_NVLINK_8 if profile is None else profile",
           "        self.profile = profile or H100_NVLINK_8",
           "None and any falsy profile read alike as 'take the default', so "
           "CostModel(0) or CostModel('') costs with the H100 profile instead of being "
           "refused (red team, found in refimpl)",
           catch="test_a_profile_that_is_not_one_is_refused[0]"),
    Mutant("tensor_bytes_from_storage", "SIM-3", SIMULATOR,
           "        return size_hint(value.numel()) * value.element_size()  # symbolic: "
           "its example's",
           "        return size_hint(value.untyped_storage().nbytes())  # symbolic: its "
           "example's",
           "Counts a tensor's bytes as its storage's (the memory plan's measure, MEM-1) "
           "rather than elements times element size (SIM-3), so a view of part of a "
           "large tensor is charged for the whole storage, in the roofline and in a "
           "collective's bytes. (red team)",
           catch="test_a_view_of_part_of_a_tensor_moves_its_own_bytes[f32]"),
    Mutant("no_return_op_is_a_view", "SIM-4", SIMULATOR,
           "        _VIEWS[target] = renames_unannotated(target) or "
           "(bool(schema.returns) and all(",
           "        _VIEWS[target] = renames_unannotated(target) or (all(",
           "Forgets that all() over no returns is True, so an op that returns nothing "
           "(an in-place foreach op, an assert) counts as 'every result a non-writing "
           "alias' and costs nothing like a view (SIM-4 frees only ops whose every "
           "result is such an alias). (red team)",
           catch="test_an_op_that_returns_nothing_is_no_view[f32]"),
    Mutant("zero_length_collective_fully_exposed", "SIM-8", SIMULATOR,
           "        return self.end_us > self.start_us and self.hidden_us <= 0.0",
           "        return self.hidden_us <= 0.0",
           "Drops the 'it ran' half of fully_exposed, so a collective of zero duration "
           "(pinned 0, or of zero bytes on a zero-alpha link), with nothing hidden "
           "because nothing ran, counts as fully exposed. (red team)",
           catch="test_a_collective_that_takes_no_time_is_not_fully_exposed[world]"),
    Mutant("coalesced_input_bytes_of_the_first_argument", "SIM-2", "refimpl/simulator.py",
           "    return _tensor_bytes(_val(node.args[0 if listed is None else listed]))",
           "    return _tensor_bytes(_val(node.args[0]))",
           "a coalesced op's inputs read from its first argument, as every op but "
           "batch_p2p_ops has them: its list of op names costs no bytes",
           catch="test_a_batch_of_point_to_point_ops_costs_its_members_bytes"),
]


# --------------------------------------------------------------------------------------
# 9. End to end (E2E): refimpl/compile.py
# --------------------------------------------------------------------------------------
E2E = [
    Mutant("reorder_wants_a_value_of_a_subgraph", "E2E-3", "refimpl/reorder.py",
           '            if node.users and not _fx.is_subgraph(gm, node):\n',
           '            if node.users:\n',
           "the reorder stage asks every used node for its fake value, a higher-order op's "
           "subgraph (flex_attention's score_mod, a get_attr of a submodule) too: a graph "
           "that holds code is refused (found by torchtitan's llama3, issue 45)",
           catch="test_a_higher_order_ops_subgraph_compiles_to_eagers_values"),
    Mutant("memory_plan_wants_a_value_of_a_subgraph", "E2E-3", MEMORY,
           "                if node.users and not is_subgraph(self.gm, node):\n",
           "                if node.users:\n",
           "the memory plan, on one path of two: it refuses a higher-order op's subgraph "
           "for lacking meta['val'] where the reorder stage takes it",
           catch="test_a_higher_order_ops_subgraph_compiles_to_eagers_values"),
    Mutant("compiled_collective_hoisted_over_an_opaque_op", "E2E-8", "refimpl/reorder.py",
           "        return \"a higher-order op runs code the pass cannot see\"\n",
           "        return None\n",
           "a higher-order op (AOTAutograd's auto_functionalized around a mutating custom "
           "op) taken for compute: the compiled program issues a collective before the "
           "opaque communication op that precedes it, as Inductor does",
           catch="test_a_collective_stays_behind_an_opaque_communication_op"),
    Mutant("one_shot_kernels_not_counted", "E2E-5", "refimpl/compile.py",
           'if row is not None and row.family != "wait":',
           'if row is not None and row.is_collective:',
           "the stage counts look at the functional-collective namespaces only: a one-shot "
           "kernel on symmetric memory is not recorded",
           catch="test_lowering_config_reaches_the_program"),
    Mutant("stage_files_numbered_by_the_stages_that_ran", "E2E-5", "refimpl/compile.py",
           "        path = self.folder / f\"{STAGES.index(stage)}_{stage}.txt\"",
           "        path = self.folder / f\"{len(list(self.folder.glob('*_*.txt')))}_{stage}.txt\"",
           "files numbered by how many stages ran: with bucketing off, the lowered text is "
           "1_lowered.txt",
           catch="test_a_stage_switched_off_leaves_the_others_their_numbers"),
    Mutant("all_reduces_bucketed_too", "E2E-2", "refimpl/compile.py",
           "    bucket_reduce_scatter(gm, cap, recompile=False)\n",
           "    bucket_reduce_scatter(gm, cap, recompile=False)\n    "
           "__import__('refimpl.bucketing').bucketing.bucket_all_reduce(gm, cap, "
           "recompile=False)\n",
           "the backend buckets all_reduces as well, which E2E-2 says it does not",
           catch="test_stages_run_in_order_and_all_reduces_are_not_bucketed"),
    Mutant("stages_out_of_order", "E2E-2", "refimpl/compile.py",
           "    if config.lowering is not None:\n        stages.append((\"lowered\", lambda gm: "
           "_lower_stage(gm, config.lowering)))\n    if config.reorder is not None:\n        "
           "stages.append((\"reordered\", lambda gm: _reorder_stage(gm, config.reorder)))\n",
           "    if config.reorder is not None:\n        stages.append((\"reordered\", lambda gm: "
           "_reorder_stage(gm, config.reorder)))\n    if config.lowering is not None:\n        "
           "stages.append((\"lowered\", lambda gm: _lower_stage(gm, config.lowering)))\n",
           "reorder before lowering",
           catch="test_stages_run_in_order_and_all_reduces_are_not_bucketed"),
    Mutant("debug_dir_concrete_path_only", "E2E-1", "refimpl/compile.py",
           "(str, os.PathLike, type(None)), \"debug_dir\"",
           "(str, Path, type(None)), \"debug_dir\"",
           "Accepts pathlib.Path instead of the os.PathLike protocol, so any other path-like "
           "object (anything with __fspath__) is rejected. (red team)",
           catch="test_debug_dir_may_be_any_path_like"),
    Mutant("backend_none_takes_default", "E2E-1", "refimpl/compile.py",
           "    return RefimplBackend(config)",
           "    return RefimplBackend(config if config is not None else CompileConfig())",
           "backend() treats an explicit None like an omitted argument and quietly uses the "
           "default config instead of rejecting it. (red team)",
           catch="test_the_backend_takes_a_compile_config_only[none]"),
    Mutant("e2e_cap_from_the_default_config", "E2E-2", "refimpl/compile.py",
           "lambda gm: _bucket_stage(gm, config.bucket_cap_mb)",
           "lambda gm: _bucket_stage(gm, CompileConfig.bucket_cap_mb)",
           "the bucketing stage reads the default cap instead of the config's",
           catch="test_bucket_cap_reaches_forward_and_backward[one_under_two]"),
    Mutant("e2e_reduce_scatters_not_bucketed", "E2E-2", "refimpl/compile.py",
           "    bucket_reduce_scatter(gm, cap, recompile=False)\n", "",
           "the reduce_scatter pass left out: backward graphs keep one collective per "
           "gradient",
           catch="test_transformer_training_matches_eager[all]"),
    Mutant("e2e_inference_graph_named_forward", "E2E-5", "refimpl/compile.py",
           '"inference_compiler": "inference"', '"inference_compiler": "forward"',
           "the inference compiler copied from the forward's line: inference graphs are "
           "recorded and written as forward graphs",
           catch="test_inference_graph_goes_through_the_stages"),
    Mutant("e2e_lowering_config_dropped", "E2E-2", "refimpl/compile.py",
           "lambda gm: _lower_stage(gm, config.lowering)",
           "lambda gm: _lower_stage(gm, CommLoweringConfig())",
           "the lowering stage runs with the default CommLoweringConfig, not the config's",
           catch="test_lowering_config_reaches_the_program"),
    Mutant("e2e_debug_text_before_its_stage", "E2E-5", "refimpl/compile.py",
           "            gm = run(gm)\n            self._observe(record, writer, stage, gm)\n",
           "            self._observe(record, writer, stage, gm)\n            gm = run(gm)\n",
           "a stage's text is written before the stage ran: every file shows the stage "
           "before",
           catch="test_debug_dir_has_every_stage_of_every_graph"),
    Mutant("e2e_waits_counted_as_collectives", "E2E-5", "refimpl/compile.py",
           'if row is not None and row.family != "wait":',
           'if row is not None:',
           "the record of a graph's collectives counts its waits too",
           catch="test_debug_dir_has_every_stage_of_every_graph"),
    Mutant("e2e_bool_cap_accepted", "E2E-1", "refimpl/compile.py",
           "if isinstance(cap, bool) or not isinstance(cap, (int, float)):",
           "if not isinstance(cap, (int, float)):",
           "bool is an int: bucket_cap_mb=True passes as a cap of 1 MiB",
           catch="test_bad_config_is_refused[cap_bool]"),
    Mutant("e2e_forward_collectives_kept_in_backward", "E2E-2", "refimpl/compile.py",
           "aot_autograd(**compilers, partition_fn=_partition)", "aot_autograd(**compilers)",
           "the default partitioner alone: the backward re-issues the forward's collectives "
           "whose inputs it can recompute (every refimpl op has side effects, FC-33)",
           catch="test_transformer_training_matches_eager[off]"),
    Mutant("e2e_logger_of_the_package", "E2E-6", "refimpl/compile.py",
           'logger = logging.getLogger("refimpl.compile")', 'logger = logging.getLogger("refimpl")',
           "the package's logger instead of refimpl.compile: a user who filters "
           "refimpl.compile sees nothing",
           catch="test_one_info_line_per_compiled_graph_and_the_text_of_every_stage_at_debug"),
    Mutant("e2e_debug_text_at_info", "E2E-6", "refimpl/compile.py",
           'logger.debug("%s after %s:\\n%s"', 'logger.info("%s after %s:\\n%s"',
           "every stage's canonical text logged at INFO: one INFO line per graph no more",
           catch="test_one_info_line_per_compiled_graph_and_the_text_of_every_stage_at_debug"),
    Mutant("e2e_zero_cap_accepted", "E2E-1", "refimpl/compile.py",
           "require(math.isfinite(cap) and cap > 0,", "require(math.isfinite(cap) and cap >= 0,",
           "a cap of 0 MiB accepted: every bucket would close before its first member",
           catch="test_bad_config_is_refused[cap_zero]"),
    Mutant("e2e_rank_asked_without_a_group", "E2E-5", "refimpl/compile.py",
           "dist.is_available() and dist.is_initialized() else 0",
           "dist.is_available() or dist.is_initialized() else 0",
           "`and` written `or`: the rank asked of a process group that does not exist",
           catch="test_debug_dir_without_a_process_group_is_rank0"),
    Mutant("e2e_memory_plan_not_written", "E2E-5", "refimpl/compile.py",
           '(self.folder / "memory_plan.json").write_text(json.dumps(record, indent=1))',
           "pass",
           "the program's memory plan computed but never written to debug_dir",
           catch="test_debug_dir_has_every_stage_of_every_graph"),
    Mutant("e2e_chrome_trace_not_written", "E2E-5", "refimpl/compile.py",
           'timeline.to_chrome_trace(str(self.folder / "timeline.json"))', "pass",
           "the simulated timeline drawn as SVG only: no trace to open in Perfetto",
           catch="test_debug_dir_has_every_stage_of_every_graph"),
    Mutant("e2e_svg_not_written", "E2E-5", "refimpl/compile.py",
           'timeline.to_svg(str(self.folder / "timeline.svg"))', "pass",
           "the simulated timeline written as a trace only: no picture",
           catch="test_debug_dir_has_every_stage_of_every_graph"),
    Mutant("e2e_plan_of_the_traced_graph", "E2E-5", "refimpl/compile.py",
           """        self._observe(record, writer, "traced", gm)
        for stage, run in _stages(self.config):
            gm = run(gm)
            self._observe(record, writer, stage, gm)
        if writer is not None:
            writer.program(gm)
""",
           """        self._observe(record, writer, "traced", gm)
        if writer is not None:
            writer.program(gm)
        for stage, run in _stages(self.config):
            gm = run(gm)
            self._observe(record, writer, stage, gm)
""",
           "the memory plan and timeline of the graph as traced, not of the program that "
           "runs: bucketing and lowering change both",
           catch="test_debug_dir_has_every_stage_of_every_graph"),
    Mutant("e2e_backward_dead_code_kept", "E2E-2", "refimpl/compile.py",
           "    backward.graph.eliminate_dead_code()  # what computed only their inputs\n",
           "",
           "the forward's collectives dropped from the backward, but what computed their "
           "inputs (the logged loss's division) still runs there for nothing",
           catch="test_debug_dir_has_every_stage_of_every_graph"),
    Mutant("e2e_graphs_not_counted", "E2E-5", "refimpl/compile.py",
           "        self._dynamo_graphs += 1\n", "",
           "every graph Dynamo hands over is graph0: a graph break's second graph writes "
           "over the first one's debug files",
           catch="test_graphs_of_one_backend_are_numbered_in_the_order_dynamo_hands_them_over"),
    Mutant("rs_bucketed_before_ag", "E2E-2", "refimpl/compile.py",
           "    bucket_all_gather(gm, cap, recompile=False)\n    "
           "bucket_reduce_scatter(gm, cap, recompile=False)\n",
           "    bucket_reduce_scatter(gm, cap, recompile=False)\n    "
           "bucket_all_gather(gm, cap, recompile=False)\n",
           "The two bucketing passes are treated as independent (they touch different "
           "ops), so their order is swapped, but BK-4's dependency test runs on the "
           "graph the first pass already rewrote, so the first pass's merge decides "
           "what the second may merge. (red team)",
           catch="test_every_stage_runs_on_the_program_of_the_stage_before"),
    Mutant("e2e_rs_after_lowering", "E2E-2", "refimpl/compile.py",
           "    bucket_reduce_scatter(gm, cap, recompile=False)\n    gm.recompile()\n   "
           " return gm\n\n\ndef _lower_stage(gm: torch.fx.GraphModule, config: "
           "CommLoweringConfig) -> torch.fx.GraphModule:\n    return lower(gm, config)\n",
           "    gm.recompile()\n    return gm\n\n\ndef _lower_stage(gm: "
           "torch.fx.GraphModule, config: CommLoweringConfig) -> torch.fx.GraphModule:\n"
           "    gm = lower(gm, config)\n    bucket_reduce_scatter(gm, lambda i: 25.0)\n "
           "   return gm\n",
           "the reduce_scatter pass moved after lowering: its candidates are then "
           "waited by wait_tensor_ (CL-20), no candidates (BK-1), so nothing merges",
           catch="test_every_stage_runs_on_the_program_of_the_stage_before"),
    Mutant("e2e_reorder_before_lowering_labels_kept", "E2E-2", "refimpl/compile.py",
           "    return lower(gm, config)\n\n\ndef _reorder_stage(gm: "
           "torch.fx.GraphModule, config: ReorderConfig) -> torch.fx.GraphModule:\n    "
           "return reorder(gm, config)\n",
           "    return lower(reorder(gm, ReorderConfig()), config)\n\n\ndef "
           "_reorder_stage(gm: torch.fx.GraphModule, config: ReorderConfig) -> "
           "torch.fx.GraphModule:\n    return gm\n",
           "reorder run inside the lowering stage before lower, the stage names kept: "
           "the reorder's memory bound (RO-9) reads the unlowered program's peak",
           catch="test_every_stage_runs_on_the_program_of_the_stage_before"),
    Mutant("e2e_bucketing_after_lowering", "E2E-2", "refimpl/compile.py",
           "    stages = []\n    if config.bucket_cap_mb is not None:\n        "
           "stages.append((\"bucketed\", lambda gm: _bucket_stage(gm, "
           "config.bucket_cap_mb)))\n    if config.lowering is not None:\n        "
           "stages.append((\"lowered\", lambda gm: _lower_stage(gm, config.lowering)))\n",
           "    stages = []\n    if config.lowering is not None:\n        "
           "stages.append((\"lowered\", lambda gm: _lower_stage(gm, config.lowering)))\n"
           "    if config.bucket_cap_mb is not None:\n        "
           "stages.append((\"bucketed\", lambda gm: _bucket_stage(gm, "
           "config.bucket_cap_mb)))\n",
           "the bucketing stage run after lowering: lowered waits are wait_tensor_, so "
           "no collective is a candidate (BK-1)",
           catch="test_every_stage_runs_on_the_program_of_the_stage_before"),
    Mutant("first_bucket_small_like_ddp", "E2E-2", "refimpl/compile.py",
           "    cap = lambda bucket_index: cap_mb",
           "    cap = lambda bucket_index: min(cap_mb, 1.0) if bucket_index == 0 else "
           "cap_mb",
           "Copies DDP's small first bucket (1 MiB, so the first collective starts "
           "early) into the cap callable, but E2E-2 says every bucket's cap, whatever "
           "its index, is bucket_cap_mb, and E2E-4's count ceil(P/k) assumes this. (red "
           "team)",
           catch="test_the_first_bucket_has_the_cap_of_every_other[default]"),
    Mutant("graph_index_counts_compiled_graphs", "E2E-5", "refimpl/compile.py",
           "        index = self._dynamo_graphs\n",
           "        index = len(self.graphs)\n",
           "The implementer numbers a Dynamo graph by how many graphs the backend has "
           "recorded so far, confusing AOTAutograd's compiled graphs (forward, backward, "
           "inference) with the graphs Dynamo handed over. (red team)",
           catch="test_graphs_are_numbered_by_the_graphs_dynamo_handed_over"),
]


def section_lists() -> dict[str, list[Mutant]]:
    """{prefix: that section's list above}, for every section of SPEC.md, in its order."""
    return {prefix: globals().get(prefix, []) for prefix in sections()}


MUTANTS: list[Mutant] = [m for section in section_lists().values() for m in section]


# The first tier (`pytest -n auto`, README.md) cannot run every mutant in its 8 minutes on
# 2 cores: it runs these, one mutant of every SPEC rule that has one, each against its
# catching case alone; the second tier (`pytest -m slow`) runs every mutant against its
# whole section. Chosen once by what a run costs (no kernel build, no rank processes, a
# quick catching case, where the rule has such a mutant), then fixed: a new rule's first
# mutant joins it (a test checks every rule is here).
FIRST_TIER: frozenset[str] = frozenset({
    "dedup_avg_not_linear", "dedup_shapes_not_compared", "module_plan_backward_stack_unread",
    "module_plan_overlap_checked_for_equal_fqns_only",
    "reorder_wants_a_value_of_a_subgraph", "agreed_durations_left_unused",
    "backend_broadcast_root_by_global_rank",
    "fake_empty_splits_read_as_no_rows", "reduce_scatter_avg_grad_divides_by_world",
    "one_byte_dtypes_not_viewed_back",
    "cast_to_an_integer_absorbed", "absorbed_casts_concatenated_as_the_first_source",
    "candidate_whose_first_user_is_a_wait", "reduce_scatter_member_strides_ignored",
    "mib_of_1025_kib", "default_threshold_in_kilobytes",
    "coalesced_list_reads_counted_by_users", "one_shot_wait_kept", "grad_check_case_sensitive",
    "bxor_missing_from_bitwise", "all_gather_out_dtype_by_itemsize", "src_bound_off_by_one",
    "fake_reduce_scatter_keeps_input_shape", "async_tensor_never_waits",
    "dropped_result_requiring_grad_not_finalized", "mesh_dim_type_check_and",
    "rank_type_check_and", "all_gather_group_size_unchecked",
    "all_reduce_in_place_on_its_input", "all_gather_rearranges_along_the_wrong_dim",
    "broadcast_src_read_as_global_rank", "wait_tensor_does_not_wait",
    "traced_result_without_its_wait", "all_to_all_split_names_swapped",
    "fake_all_to_all_skips_split_checks", "in_place_contiguity_unchecked",
    "empty_result_registered", "transpose_waits", "numpy_reads_before_waiting",
    "bad_group_type_is_value_error", "reduce_op_case_sensitive",
    "reduce_scatter_avg_not_divided", "negative_dim_bound_off_by_one",
    "split_count_checked_one_way", "all_to_all_gradient_splits_not_swapped",
    "no_grad_refused_too", "coalesced_starts_before_checking", "mismatch_check_skips_rank_one",
    "p2p_send_token_of_the_default_dtype", "p2p_receive_into_its_argument",
    "peer_failure_not_named", "meta_input_accepted", "all_to_all_autograd_splits_swapped",
    "overload_not_side_effectful", "all_gather_through_the_backend_method",
    "all_gather_through_torch_distributed", "shared_work_waited_at_every_result",
    "rearranged_gather_completed_whenever_grad_is_on", "group_request_not_counted",
    "wait_inplace_copies", "work_keyed_by_data_ptr", "wait_tensors_waits_the_first_only",
    "wait_in_place_though_written_later", "force_one_shot_needs_auto_select",
    "out_overload_of_other_arguments", "lowering_marks_no_fuse_by_default",
    "group_of_no_group_not_checked", "out_of_place_view_not_copied",
    "in_place_on_shared_intermediate", "broadcast_reinplaced", "comm_buffer_escapes",
    "no_copy_back_to_view", "alloc_id_without_the_buffer_size", "fusion_on_by_default",
    "fresh_test_reads_a_namespace_of_any_target", "lowered_without_the_code_generator",
    "catalogue_row_missing", "bucket_reaches_bucket_0_from_the_start",
    "log_candidates_without_left_alone", "padding_meta_keeps_the_first_dim",
    "static_size_checked_on_any_dim", "cap_type_check_and", "key_by_group_size",
    "slot_at_rank_modulo", "unpad_keeps_padding", "single_buckets_rewritten",
    "caps_never_agreed", "coalesced_option_left_unused",
    "unknown_reduce_op_accepted", "wait_of_a_wait_not_followed", "wait_block_not_opened",
    "cast_from_an_integer_absorbed", "prologue_user_check_all_instead_of_any",
    "original_order_from_meta_unchecked", "last_resort_takes_a_block_of_another_queue",
    "barrier_keeps_only_what_follows_the_previous_one", "ro_wait_is_no_write",
    "ro_memory_bound_strict", "stall_of_the_earliest_wait", "config_keeps_the_callers_mapping",
    "comm_ops_find_only_collective_namespaces", "only_the_conservative_memory_test",
    "limit_let_go_on_a_tie", "check_order_barrier_reported_as_a_version",
    "second_collective_on_buffer_forgets_first", "output_view_base_not_pinned",
    "inputs_keyed_by_tensor_not_storage", "get_attr_planned_as_an_intermediate",
    "value_checked_on_ops_only", "mem_free_before_alloc", "mem_comm_buffer_freed",
    "mem_wait_namespace", "mem_dead_value_kept", "mem_duplicate_in_order", "mem_verifier_size",
    "f16_overflow_past_the_largest_half", "view_sizes_type_check_and", "stride_zero_refused",
    "rendezvous_group_check_inverted", "barrier_puts_into_the_peers_own_slot",
    "two_shot_chunk_rounded_down", "pointwise_fake_kernel_checks_nothing",
    "one_channel_too_many", "world_size_of_64_refused", "reissued_live_view_not_counted",
    "default_timeout_of_zero_accepted", "dropped_allocation_keeps_its_file",
    "repeated_request_on_another_device", "is_symm_mem_tensor_without_an_allocator",
    "op_group_named_as_rendezvous_names_it", "barrier_timeout_not_fail_stop",
    "python_two_shot_status_ignored", "python_kernels_switch_ignored",
    "batched_matmul_flops_without_the_batch", "unannotated_views_cost_compute",
    "no_communication_is_no_overlap", "wait_duration_hidden_in_waiting", "sim_one_comm_stream",
    "sim_trace_duration", "h100_without_default_link", "svg_memory_line_not_moved",
    "comm_ops_two_shot_costed_one_shot", "estimate_not_checked",
    "compiled_collective_hoisted_over_an_opaque_op", "all_reduces_bucketed_too",
    "backend_none_takes_default", "e2e_logger_of_the_package",
    "e2e_rank_asked_without_a_group",
})


# --------------------------------------------------------------------------------------
# CUDA mutants: slips in kernels/cuda/symm_mem.cu that only a GPU can show. Not in MUTANTS
# (CI has no GPU): tests/gpu/test_cuda_mutants.py runs each against the SM section with
# --device cuda, its catching case first (its `catch`).
# --------------------------------------------------------------------------------------
_CU = "kernels/cuda/symm_mem.cu"
CUDA_MUTANTS: list[Mutant] = [
    Mutant("cuda_one_shot_last_barrier_left_out", "SM-15", _CU,
           "  barrier_block(c.pads, c.rank, c.world, c.channel, c.state, c.report, deadline);\n"
           "  if (threadIdx.x == 0) {  // every other block is past",
           "  if (threadIdx.x == 0) {  // every other block is past",
           "one-shot returns after its own reduction: a peer may still read the input, and "
           "the next call's descriptor may overwrite this one's before a peer checked it",
           catch="test_one_shot_returns_only_after_every_peer_read_its_input"),
    Mutant("cuda_16_bit_accumulation", "SM-23", _CU,
           "    for (int k = 0; k < N; k++) acc[k] = combine<OP>(acc[k], D::load(x.lane[k]));",
           "    for (int k = 0; k < N; k++) "
           "acc[k] = D::load(D::store(combine<OP>(acc[k], D::load(x.lane[k]))));",
           "the vector path rounds to the 16-bit dtype after every rank instead of "
           "accumulating in float32 and rounding once",
           catch="test_cuda_all_reduces_are_bitwise_the_rank_order_fold[3]"),
    Mutant("cuda_signal_slot_not_cleared", "SM-9", _CU,
           "  store_relaxed_sys(slot, EMPTY);",
           "  store_relaxed_sys(slot, FULL);",
           "a wait stores back what it read (the put's line copied): the slot is never "
           "cleared, so the next put waits for ever",
           catch="test_signals_carry_writes_per_channel_and_leave_pads_zero"),
    Mutant("cuda_kernels_on_the_default_stream", "SM-22", "refimpl/_symm_mem_cuda.py",
           "        return torch._C._cuda_getCurrentRawStream(self.device.index)",
           "        return torch.cuda.default_stream(self.device).cuda_stream",
           "the kernels go to the device's default stream, not the caller's current stream: "
           "they do not wait for the work queued there",
           catch="test_cuda_ops_run_after_the_current_streams_work_and_finish_before_returning"),
    Mutant("cuda_two_shot_runs_its_last_barrier_when_calls_differ", "SM-20", _CU,
           "    launch_barrier(ctx, s, channel, t, BARRIER_IF_CALLS_AGREE);",
           "    launch_barrier(ctx, s, channel, t, BARRIER_NEXT);",
           "a refused two-shot runs one barrier more than a refused one-shot: ranks that "
           "called different algorithms fall out of step (found by the first GPU run)",
           catch="test_a_call_that_differs_between_ranks_fails_on_every_rank_naming_the_rank"),
    Mutant("cuda_call_check_ignores_the_offset", "SM-20", _CU,
           "    if (call[0] == first[0] && call[1] == first[1] && call[2] == first[2]) continue;",
           "    if (call[0] == first[0] && call[2] == first[2]) continue;",
           "the cross-rank check compares numel and kind but not the byte offset",
           catch="test_a_call_that_differs_between_ranks_fails_on_every_rank_naming_the_rank"),
]


# --------------------------------------------------------------------------------------
# Equivalents: slips a red team wrote that no implementation-independent case can fail,
# each with why, so that the next red team does not write them again. Same fields as a
# Mutant; never run by tests/test_mutants.py, only checked to still apply.
# --------------------------------------------------------------------------------------
EQUIVALENTS: list[Mutant] = [
    Mutant("side_effect_only_on_overload", "FC-33", F,
           "    packet = getattr(ops, name)\n    torch.fx.node.has_side_effect(packet)\n",
           "    packet = getattr(ops, name)\n",
           "equivalent on torch 2.13: FX's dead-code elimination asks whether a packet has "
           "side effects through its overloads, so the packet's own mark changes nothing "
           "(test_dead_code_elimination_keeps_the_ops_packets_too passes with it); "
           "a torch that stops looking through packets would make it observable"),
    Mutant("comm_ops_reduce_scatter_coalesced_not_coalesced", "BK-1", COMM_OPS,
           '"reduce_scatter_tensor_coalesced": dict(_REDUCE_SCATTER, coalesced=True),',
           '"reduce_scatter_tensor_coalesced": _REDUCE_SCATTER,',
           "equivalent (blind red team): the row's `coalesced` is read by bucketing's "
           "candidate targets and by lowering's all_reduce/broadcast rules only; the "
           "coalesced reduce_scatter then joins bucket_reduce_scatter's targets, but its "
           "users are `getitem`s, never its wait, so BK-1's one-user-its-wait test still "
           "refuses it; costs and in-flight members are read from its list arguments"),
]


# --------------------------------------------------------------------------------------
# Harness mutants: slips in the machinery of CF-13 (refimpl/launched.py, _rank_process.py,
# multiprocess.py), which no conformance section runs: each is caught by a test of
# tests/ (its `catch`, a pytest node id), which tests/test_mutants.py runs against the
# mutant in the second tier. Not in MUTANTS. The red team's CF-13 survivors (issue 46).
# --------------------------------------------------------------------------------------
HARNESS_MUTANTS: list[Mutant] = [
    Mutant('gather_stops_at_first_late_rank', "CF-13", 'refimpl/launched.py',
           '            except Exception:  # a store timeout: named by the caller, with every '
           'late rank\n'
           '                continue\n',
           '            except Exception:  # a store timeout: named by the caller, with every '
           'late rank\n'
           '                break\n',
           'Reasoning that once one key timed out the deadline is spent, the author leaves the '
           'gather loop, so every rank after the first late one is counted as late too, even '
           'though it posted, and the timeout names ranks that kept making the calls. (red team)',
           catch='tests/test_launched_units.py::test_a_gather_names_exactly_the_ranks_that_did_n'
                 'ot_post_within_its_timeout'),
    Mutant('call_mismatch_compares_label_only', "CF-13", 'refimpl/launched.py',
           '            if (their_label, their_n) != (label, n):',
           '            if their_label != label:',
           "The cross-rank call check compares the function's name but forgets the world size, "
           'so ranks that call the same function on different n are not named as out of step. '
           '(red team)',
           catch='tests/test_launched_units.py::test_ranks_that_call_one_function_on_different_s'
                 'izes_are_named_out_of_step'),
    Mutant('hung_call_keeps_workers', "CF-13", 'refimpl/launched.py',
           '        if errors or hung:',
           '        if errors:',
           'Only a call in which a rank raised restarts the workers; a call that timed out '
           'leaves the still-busy worker in place, so the next call of that size is answered '
           "late or with the previous task's stale reply. (red team)",
           catch='tests/test_launched_units.py::test_a_call_that_timed_out_restarts_the_workers_'
                 'of_its_size'),
    Mutant('cpu_device_assumed_served', "CF-13", 'refimpl/_rank_process.py',
           '    if kind not in served:',
           '    if kind != "cpu" and kind not in served:',
           "Assuming every process group can move CPU tensors, the author checks the backend's "
           'capability only for accelerator devices, so a process group that cannot serve the '
           'CPU is accepted with --device cpu. (red team)',
           catch='tests/test_launched_units.py::test_a_process_group_that_cannot_serve_the_cpu_i'
                 's_refused_for_it'),
    Mutant('harness_reuses_group_after_device_change', "CF-13", 'refimpl/multiprocess.py',
           '    if group is not None and group.setting != _setting():',
           '    if group is not None and group.setting[0] != _setting()[0]:',
           'Seeing the process group as what the workers are made for, the author restarts a '
           'kept worker group only when the process group changes, so a new --device '
           "(REFIMPL_DEVICE) is neither checked nor used by refimpl's own workers. (red team)",
           catch='tests/test_launched_units.py::test_the_harness_checks_and_restarts_its_workers'
                 '_for_a_new_device'),
    Mutant('harness_timeout_checked_before_errors', "CF-13", 'refimpl/multiprocess.py',
           '        if errors:\n'
           '            rank, (_, exc_type, message, tb) = min(errors)',
           '        if errors and len(replies) == self.world_size:\n'
           '            rank, (_, exc_type, message, tb) = min(errors)',
           'The own-workers harness reports the peers left blocked after the grace period as a '
           'timeout before looking at the rank that failed, so a process group that fails to '
           'start on one rank shows up as a hung peer instead of its own error. (red team)',
           catch='tests/test_launched_units.py::test_the_harness_names_a_process_group_that_fail'
                 'ed_to_start_on_one_rank[RuntimeError]'),
    Mutant('process_group_missing_attr_escapes', "CF-13", 'refimpl/_rank_process.py',
           '        except (ImportError, AttributeError) as exc:',
           '        except ImportError as exc:',
           "Only a module that can't be imported is turned into the option's error; a module "
           'that lacks the attribute raises a bare AttributeError naming neither '
           '--process-group nor CF-13. (red team)',
           catch='tests/test_launched_units.py::test_a_process_group_module_without_the_attribut'
                 'e_is_the_options_error'),
    Mutant('launched_path_capped_at_local_max', "CF-13", 'refimpl/multiprocess.py',
           '        if not isinstance(world_size, int) or isinstance(world_size, bool) or '
           'world_size < 1:',
           '        if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 '
           '<= world_size <= MAX_WORKER_PROCESSES:',
           'The one-machine limit of 8 worker processes is also applied to a launched world, so '
           'a too-large case gets a ValueError instead of NotOnThisWorld (skipped). (red team)',
           catch='tests/test_launched_units.py::test_a_launched_world_runs_a_call_of_its_own_siz'
                 'e_and_skips_a_larger_one'),
    Mutant('launched_rank_prefers_own_error', "CF-13", 'refimpl/launched.py',
           '            rank, (_, exc_type, message, tb) = errors[0]',
           '            rank, (_, exc_type, message, tb) = next(\n'
           '                (e for e in errors if e[0] == self.rank), errors[0])',
           "Thinking a rank's own error is the most useful one to show, each launched rank "
           "re-raises its own worker's error when it has one, so ranks raise different "
           "RankErrors instead of the lowest failing rank's. (red team)",
           catch='tests/test_launched_units.py::test_every_launched_rank_raises_the_lowest_faili'
                 'ng_ranks_error'),
    Mutant('reply_gather_without_margin', "CF-13", 'refimpl/launched.py',
           '        posted = self._gather(tag, pickle.dumps((label, n, reply)), timeout_s + '
           '30.0)',
           '        posted = self._gather(tag, pickle.dumps((label, n, reply)), timeout_s)',
           "The reply exchange waits only timeout_s, though a worker rank's own wait starts "
           'later (after it spawns or hands over to its worker): an idle rank stops waiting '
           "before that rank posts its 'timeout' reply and calls the world lost. (red team)",
           catch='tests/test_launched_units.py::test_an_idle_rank_waits_for_a_late_workers_timeo'
                 'ut_reply'),
    Mutant('worker_store_prefix_without_generation', "CF-13", 'refimpl/launched.py',
           'f"{KEY_PREFIX}/world-{n}-{generation}"',
           'f"{KEY_PREFIX}/world-{n}"',
           "Assuming a worker group's store keys go away with it, the author keys the workers' "
           "meeting place only by world size, so fresh workers join under the dead group's "
           'prefix and read its stale keys. (red team)',
           catch='tests/test_launched_units.py::test_fresh_workers_after_shutdown_meet_afresh_on'
                 '_every_rank'),
    Mutant('to_cpu_top_level_only', "CF-13", 'refimpl/_rank_process.py',
           '    return tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, value)',
           '    return value.cpu() if isinstance(value, torch.Tensor) else value',
           'Only a result that is itself a tensor is moved to the CPU; tensors inside a '
           "returned list, tuple or dict stay on the rank's device. (red team)",
           catch='tests/test_launched_units.py::test_results_come_back_on_the_cpu_however_nested'),
    Mutant('finish_waits_on_rank0_only', "CF-13", 'refimpl/launched.py',
           '        self._gather(f"finish/{self.calls}", b"1", AGREE_TIMEOUT_S)',
           '        self._gather(f"finish/{self.calls}", b"1", AGREE_TIMEOUT_S if self.rank == '
           '0 else 0.0)',
           'Reasoning that only rank 0 must outlive its peers, only rank 0 waits at the end; '
           'the other ranks post and leave at once, before rank 0 has written its report. (red '
           'team)',
           catch='tests/test_launched_units.py::test_no_rank_finishes_before_every_rank_has_reac'
                 'hed_the_end'),
    Mutant('launched_world_size_bound_exclusive', "CF-13", 'refimpl/launched.py',
           '        if n > self.world_size:',
           '        if n >= self.world_size:',
           'An off-by-one in the size check refuses a call that needs exactly as many ranks as '
           'the world has. (red team)',
           catch='tests/test_launched_units.py::test_a_launched_world_runs_a_call_of_its_own_siz'
                 'e_and_skips_a_larger_one'),
    Mutant('peer_failed_flag_keyed_by_size', "CF-13", 'refimpl/launched.py',
           '        failed = f"{tag}/failed"',
           '        failed = f"world-{n}/failed"',
           "The 'a peer failed' flag is keyed by world size rather than by call, so once any "
           "call of that size failed every later call's ranks cut their wait to PEER_GRACE_S. "
           '(red team)',
           catch='tests/test_launched_units.py::test_a_failed_call_does_not_cut_the_wait_of_the_'
                 'next_call'),
    Mutant('registered_backend_name_case_sensitive', "CF-13", 'refimpl/_rank_process.py',
           '    if name.lower() not in dist.Backend.backend_list:',
           '    if name not in dist.Backend.backend_list:',
           'Backend.register_backend stores names lower-cased, so comparing the returned name '
           'as spelled refuses a registered process group whose name has capitals. (red team)',
           catch='tests/test_launched_units.py::test_a_registered_process_group_named_with_capit'
                 'als_is_accepted'),
    Mutant('forget_previous_call_keys', "CF-13", 'refimpl/launched.py',
           '        self._forget(self.calls - 2)',
           '        self._forget(self.calls - 1)',
           'Store keys of the previous call are deleted as soon as this rank starts the next '
           "one, but a peer that posted its reply may not yet have read this rank's. (red team)",
           catch='tests/test_launched_units.py::test_a_rank_slow_to_read_its_peers_replies_still'
                 '_finds_them'),
    Mutant('shutdown_ignores_launched_world', "CF-13", 'refimpl/multiprocess.py',
           '        world.restart(world_size)\n'
           '        return\n',
           '        return\n',
           "shutdown(n) treats worker restarts as the launched world's own business and does "
           'nothing there, so a case that asks for fresh workers keeps the old ones under '
           'torchrun. (red team)',
           catch='tests/test_launched_units.py::test_fresh_workers_after_shutdown_meet_afresh_on'
                 '_every_rank'),
    Mutant('loopback_ifname_forced_everywhere', "CF-13", 'refimpl/_rank_process.py',
           '    if host == "127.0.0.1":\n'
           '        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")',
           '    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")',
           "Pinning gloo to the loopback interface is right for the harness's own store on "
           '127.0.0.1 but is applied to launched workers too, whose peers may sit on other '
           'machines. (red team)',
           catch='tests/test_launched_units.py::test_a_launched_worker_is_not_pinned_to_loopback'),
    Mutant('gather_blocks_on_store_get', "CF-13", 'refimpl/launched.py',
           '                self.store.wait([key], datetime.timedelta(seconds=max(left, 0.001)))',
           '                self.store.get(key)',
           "store.get also blocks until the key exists, but under the store's own timeout "
           "(AGREE_TIMEOUT_S, 120 s) rather than the call's deadline, so a rank that stopped "
           'making the calls is waited for 120 s per missing key. (red team)',
           catch='tests/test_launched_units.py::test_a_gather_names_exactly_the_ranks_that_did_n'
                 'ot_post_within_its_timeout'),
    Mutant('peer_grace_extends_deadline', "CF-13", 'refimpl/launched.py',
           '                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)',
           '                deadline = time.monotonic() + PEER_GRACE_S',
           'Without the min, every poll while the failed flag is set pushes the deadline 3 s '
           'ahead, so a rank whose worker stays blocked after a peer failed never gives up. '
           '(red team)',
           catch='tests/test_launched_units.py::test_a_rank_blocked_after_its_peer_failed_gives_'
                 'up_after_the_grace'),
    Mutant('pg_start_error_names_local_rank', "CF-13", 'refimpl/_rank_process.py',
           '            f"{rank} of {world_size}: {exc} [CF-13]"',
           '            f"{local_rank} of {world_size}: {exc} [CF-13]"',
           "The process-group start failure names the worker's local rank (its device index) "
           'instead of its rank in the world, which only coincide on one machine. (red team)',
           catch='tests/test_launched_units.py::test_a_process_group_that_fails_to_start_names_t'
                 'he_rank_in_the_world'),
    # Round 4's survivors (red team) and the hand-over of a large task (a bug the red
    # team's helper found: the send blocked past the call's timeout).
    Mutant("launched_only_on_explicit_flag", "CF-13", "refimpl/launched.py",
           'if flag != "1" and "TORCHELASTIC_RUN_ID" not in os.environ:',
           'if flag != "1":',
           "Launched mode keyed on refimpl's own REFIMPL_LAUNCHED=1 only: a plain torchrun "
           "(TORCHELASTIC_RUN_ID set) spawns a one-machine harness on every rank. (red team)",
           catch="tests/test_launched_units.py::test_a_launched_world_is_recognised_by_"
                 "torchruns_variables_or_the_flag[torchrun]"),
    Mutant("pg_start_error_only_runtimeerror", "CF-13", "refimpl/_rank_process.py",
           "    except Exception as exc:  # a vendor's group that cannot start: say so, do not "
           "vanish",
           "    except RuntimeError as exc:  # a vendor's group that cannot start: say so, do "
           "not vanish",
           "A process group that fails to start is expected to raise torch's RuntimeError; a "
           "creator raising anything else kills the worker, reported as a rank that died. "
           "(red team)",
           catch="tests/test_launched_units.py::test_the_harness_names_a_process_group_that_"
                 "failed_to_start_on_one_rank[ValueError]"),
    Mutant("harness_hand_over_blocks", "CF-13", "refimpl/multiprocess.py",
           "            hand_over(conn, task)\n",
           "            conn.send_bytes(task)\n",
           "the task sent in the caller's thread: one larger than the socket's buffer blocks "
           "until the worker's process group has formed, past the call's timeout",
           catch="tests/test_launched_units.py::test_the_harness_hands_a_large_task_over_"
                 "within_the_calls_timeout"),
    Mutant("launched_hand_over_blocks", "CF-13", "refimpl/launched.py",
           "        hand_over(worker.conn, pickle.dumps((forwarded_env(), fn, args, kwargs)))\n",
           "        worker.conn.send_bytes(pickle.dumps((forwarded_env(), fn, args, kwargs)))\n",
           "a launched rank sends the task in its own thread: a large one blocks past the "
           "call's timeout, and the ranks disagree (one raises the peer's error, the other "
           "calls the world lost)",
           catch="tests/test_launched_units.py::test_a_launched_rank_hands_a_large_task_over_"
                 "within_the_calls_timeout"),
]
