"""Conformance cases of SPEC section 3, Bucketing (BK).

Each case traces one user program on every gloo rank with the backend's own
functional-collectives API, applies the backend's bucketing pass to a second trace,
runs both graphs on real inputs and requires bit-identical outputs on every rank
(numeric), and the same merges on every rank (BK-6). Cases with goldens also compare
rank 0's comm trace (structural) and canonical graph (exact). Caps are given in bytes
over 2**20, exact in binary, so a cap is the exact byte count it names.
"""

from __future__ import annotations

import functools
import operator
import re

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline

from conformance import bucketing_programs, harness, oracle
from conformance.bucketing_programs import (
    BAD_ARGUMENTS,
    BAD_GRAPHS,
    WORLD,
    bad_arguments,
    bad_graph,
    conformance_case,
    deduplicated,
    log_records,
    padded_reduce_scatter,
    per_rank_caps_case,
    point_to_point_stage_alone,
    symbolic_candidates,
)

AG, RS, AR = "bucket_all_gather", "bucket_reduce_scatter", "bucket_all_reduce"
ROWS_2x2 = [[0, 2], [1, 3]]
# Rank 3 is index 2 of [0, 1, 3] (not rank % 3 = 0, nor rank // 3 = 1); rank 2 is alone.
ROWS_3_1 = [[0, 1, 3], [2]]
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
MiB = 2**20


def run_case(backend, world_size, program, pass_name, cap_mb=25, dtype=torch.float32,
             options=None, program_args=None, groups_alike=True, every_rank=False,
             again_cap_mb=None):
    """Rank 0's result (every rank's with `every_rank`); every rank's values checked, and
    with `groups_alike` (every rank's group of the same size) every rank's merges too.
    `again_cap_mb`: the pass runs a second time on its own result, with that cap.
    `program`: one of bucketing_programs' or of this file's LOCAL_PROGRAMS."""
    backend.require("functional_collectives")
    backend.require("bucketing", pass_name)
    results = harness.run(backend, _case_on_rank, world_size, program, pass_name, cap_mb,
                          dtype, options, program_args, again_cap_mb)
    for rank, result in enumerate(results):
        assert result["mismatch"] == "", f"rank {rank}: {result['mismatch']}"
        # BK-7: later passes (reorder, memory planning, lowering) read the sizes there.
        assert result["untrue_meta"] == "", f"rank {rank}: {result['untrue_meta']} [BK-7]"
    if groups_alike:
        # BK-6: every rank merges the same collectives (groups differ only by their ranks).
        traces = {re.sub(r"ranks\[[\d,]*\]", "G", r["comm_trace"]) for r in results}
        assert len(traces) == 1, f"ranks merged differently [BK-6]: {traces}"
        assert len({r["collectives"] for r in results}) == 1, "ranks merged differently"
    return results if every_rank else results[0]


def _case_on_rank(spec: str, program: str, *args) -> dict:
    """conformance_case, with this file's own programs (LOCAL_PROGRAMS) known too."""
    from conformance import bucketing_programs

    if program in LOCAL_PROGRAMS:
        bucketing_programs.PROGRAMS.setdefault(program, LOCAL_PROGRAMS[program])
    return conformance_case(spec, program, *args)


def byte_caps(*caps_bytes):
    """Caps of buckets 0, 1, ... in MiB from exact byte counts (the last one repeats)."""
    return tuple(c / MiB for c in caps_bytes)


@pytest.mark.spec("BK-7", "BK-8")
def test_all_gather_fsdp_params(backend):
    result = run_case(backend, 2, "fsdp_all_gather", AG, program_args={"rows": (3, 1, 2)})
    assert result["collectives"] == (3, 1)
    assert_expected_inline(result["comm_trace"], """\
all_gather_into_tensor_out out-of-place ranks[0,1] in=b0:f32[18]=view(b1=computed) out=b1:f32[36]
wait b1""")


@pytest.mark.spec("BK-7", "BK-8")
def test_all_gather_fsdp_params_canonical_graph(backend):
    result = run_case(backend, 2, "fsdp_all_gather", AG, program_args={"rows": (3, 1, 2)})
    assert_expected_inline(result["canonical"], """\
%0 = input : f32[3, 3]
%1 = input : f32[1, 3]
%2 = input : f32[2, 3]
%3 = aten.empty.memory_format([36], dtype=f32, device=device(cpu), pin_memory=False) : f32[36]
%4 = aten.slice.Tensor(%3, 0, 0, 18) : f32[18]
%5 = aten.view(%0, [-1]) : f32[9]
%6 = aten.view(%1, [-1]) : f32[3]
%7 = aten.view(%2, [-1]) : f32[6]
%8 = aten.cat([%5, %6, %7]) : f32[18]
%9 = aten.copy_(%4, %8) : f32[18]
%10 = funcol.all_gather_into_tensor_out(%9, 2, ranks[0,1], out=%3) : f32[36]
%11 = funcol.wait_tensor(%10) : f32[36]
%12 = aten.view(%11, [2, -1]) : f32[2, 18]
%13 = aten.split_with_sizes(%12, [9, 3, 6], 1) : (f32[2, 9], f32[2, 3], f32[2, 6])
%14 = getitem(%13, 0) : f32[2, 9]
%15 = getitem(%13, 1) : f32[2, 3]
%16 = getitem(%13, 2) : f32[2, 6]
%17 = aten.clone(%14, memory_format=torch.contiguous_format) : f32[2, 9]
%18 = aten._unsafe_view(%17, [6, 3]) : f32[6, 3]
%19 = aten.clone(%15, memory_format=torch.contiguous_format) : f32[2, 3]
%20 = aten._unsafe_view(%19, [2, 3]) : f32[2, 3]
%21 = aten.clone(%16, memory_format=torch.contiguous_format) : f32[2, 6]
%22 = aten._unsafe_view(%21, [4, 3]) : f32[4, 3]
%23 = aten.mul.Tensor(%18, 2) : f32[6, 3]
%24 = aten.add.Tensor(%23, 1) : f32[6, 3]
%25 = aten.mul.Tensor(%20, 2) : f32[2, 3]
%26 = aten.add.Tensor(%25, 1) : f32[2, 3]
%27 = aten.mul.Tensor(%22, 2) : f32[4, 3]
%28 = aten.add.Tensor(%27, 1) : f32[4, 3]
return [%24, %26, %28]""")


@pytest.mark.spec("BK-7")
def test_nodes_that_read_no_member_keep_their_place(backend):
    # Each gather is followed by its user (moves after the merged wait) and by compute on
    # its shard alone (stays where it was, before the merged collective).
    result = run_case(backend, 2, "fsdp_all_gather", AG,
                      program_args={"rows": (1, 2), "independent": True})
    assert_expected_inline(result["canonical"], """\
%0 = input : f32[1, 3]
%1 = input : f32[2, 3]
%2 = aten.mul.Tensor(%0, 5) : f32[1, 3]
%3 = aten.empty.memory_format([18], dtype=f32, device=device(cpu), pin_memory=False) : f32[18]
%4 = aten.slice.Tensor(%3, 0, 0, 9) : f32[9]
%5 = aten.view(%0, [-1]) : f32[3]
%6 = aten.view(%1, [-1]) : f32[6]
%7 = aten.cat([%5, %6]) : f32[9]
%8 = aten.copy_(%4, %7) : f32[9]
%9 = funcol.all_gather_into_tensor_out(%8, 2, ranks[0,1], out=%3) : f32[18]
%10 = funcol.wait_tensor(%9) : f32[18]
%11 = aten.view(%10, [2, -1]) : f32[2, 9]
%12 = aten.split_with_sizes(%11, [3, 6], 1) : (f32[2, 3], f32[2, 6])
%13 = getitem(%12, 0) : f32[2, 3]
%14 = getitem(%12, 1) : f32[2, 6]
%15 = aten.clone(%13, memory_format=torch.contiguous_format) : f32[2, 3]
%16 = aten._unsafe_view(%15, [2, 3]) : f32[2, 3]
%17 = aten.clone(%14, memory_format=torch.contiguous_format) : f32[2, 6]
%18 = aten._unsafe_view(%17, [4, 3]) : f32[4, 3]
%19 = aten.mul.Tensor(%16, 2) : f32[2, 3]
%20 = aten.add.Tensor(%19, 1) : f32[2, 3]
%21 = aten.mul.Tensor(%18, 2) : f32[4, 3]
%22 = aten.add.Tensor(%21, 1) : f32[4, 3]
%23 = aten.mul.Tensor(%1, 5) : f32[2, 3]
return [%20, %2, %22, %23]""")


@pytest.mark.spec("BK-9")
def test_all_gather_casts_batched(backend):
    result = run_case(backend, 2, "fsdp_all_gather", AG, dtype=torch.bfloat16,
                      program_args={"rows": (3, 1), "cast": True})
    assert result["collectives"] == (2, 1)
    # No cast is left in the graph: the bucket's one copy converts f32 to bf16.
    assert "_to_copy" not in result["canonical"]
    assert "convert_element_type" not in result["canonical"]


@pytest.mark.spec("BK-7", "BK-9")
def test_all_gather_casts_batched_canonical_graph(backend):
    result = run_case(backend, 2, "fsdp_all_gather", AG, dtype=torch.bfloat16,
                      program_args={"rows": (3, 1), "cast": True})
    assert_expected_inline(result["canonical"], """\
%0 = input : f32[3, 3]
%1 = input : f32[1, 3]
%2 = aten.empty.memory_format([24], dtype=bf16, device=device(cpu), pin_memory=False) : bf16[24]
%3 = aten.slice.Tensor(%2, 0, 0, 12) : bf16[12]
%4 = aten.view(%0, [-1]) : f32[9]
%5 = aten.view(%1, [-1]) : f32[3]
%6 = aten.cat([%4, %5]) : f32[12]
%7 = aten.copy_(%3, %6) : bf16[12]
%8 = funcol.all_gather_into_tensor_out(%7, 2, ranks[0,1], out=%2) : bf16[24]
%9 = funcol.wait_tensor(%8) : bf16[24]
%10 = aten.view(%9, [2, -1]) : bf16[2, 12]
%11 = aten.split_with_sizes(%10, [9, 3], 1) : (bf16[2, 9], bf16[2, 3])
%12 = getitem(%11, 0) : bf16[2, 9]
%13 = getitem(%11, 1) : bf16[2, 3]
%14 = aten.clone(%12, memory_format=torch.contiguous_format) : bf16[2, 9]
%15 = aten._unsafe_view(%14, [6, 3]) : bf16[6, 3]
%16 = aten.clone(%13, memory_format=torch.contiguous_format) : bf16[2, 3]
%17 = aten._unsafe_view(%16, [2, 3]) : bf16[2, 3]
%18 = aten.mul.Tensor(%15, 2) : bf16[6, 3]
%19 = aten.add.Tensor(%18, 1) : bf16[6, 3]
%20 = aten.mul.Tensor(%17, 2) : bf16[2, 3]
%21 = aten.add.Tensor(%20, 1) : bf16[2, 3]
return [%19, %21]""")


@pytest.mark.spec("BK-8", "BK-6")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_all_gather_noncontiguous_subgroups(backend, dtype):
    result = run_case(backend, 4, "fsdp_all_gather", AG, dtype=dtype,
                      program_args={"group": ROWS_2x2})
    assert result["collectives"] == (6, 1)


@pytest.mark.spec("BK-3")
def test_caps_are_asked_per_bucket_index(backend):
    # Gathered sizes on 2 ranks (bytes): 72 120 24 96 48 144. Caps: bucket 0 200 bytes,
    # bucket 1 130 bytes, then 10 kB: buckets [72, 120] [24, 96] [48, 144].
    result = run_case(backend, 2, "fsdp_all_gather", AG, cap_mb=byte_caps(200, 130, 10_000))
    assert result["collectives"] == (6, 3)
    assert result["asked"] == [0, 1, 2], "each bucket index asked once, as it opens"
    assert_expected_inline(result["comm_trace"], """\
all_gather_into_tensor_out out-of-place ranks[0,1] in=b0:f32[24]=view(b1=computed) out=b1:f32[48]
wait b1
all_gather_into_tensor_out out-of-place ranks[0,1] in=b2:f32[15]=view(b3=computed) out=b3:f32[30]
wait b3
all_gather_into_tensor_out out-of-place ranks[0,1] in=b4:f32[24]=view(b5=computed) out=b5:f32[48]
wait b5""")


# fsdp_all_gather on 2 ranks, f32, rows (3, 5, 1, 4, 2, 6): members of 72, 120, 24, 96,
# 48 and 144 bytes (the gathered output is the larger side, BK-3).
@pytest.mark.spec("BK-21")
def test_a_bucket_that_exactly_fills_its_cap_keeps_its_last_member(backend):
    # Cap 192 = 72 + 120: the bucket is exactly full; 24 opens bucket 1: 24 + 96 + 48 =
    # 168, and 144 more would pass the cap: 144 sits alone.
    result = run_case(backend, 2, "fsdp_all_gather", AG, cap_mb=byte_caps(192))
    assert result["collectives"] == (6, 3)
    assert_expected_inline(result["comm_trace"], """\
all_gather_into_tensor_out out-of-place ranks[0,1] in=b0:f32[24]=view(b1=computed) out=b1:f32[48]
wait b1
all_gather_into_tensor_out out-of-place ranks[0,1] in=b2:f32[21]=view(b3=computed) out=b3:f32[42]
wait b3
all_gather_into_tensor out-of-place ranks[0,1] in=b4:f32[6, 3]=input out=b5:f32[12, 3]
wait b5""")  # noqa: E501


@pytest.mark.spec("BK-21")
@pytest.mark.parametrize("rows, buckets", [((16384, 16384, 1), 2), ((16384, 16383, 1), 1)],
                         ids=["one_row_over", "exactly_full"])
def test_a_cap_in_mib_counts_2_to_the_20_bytes(backend, rows, buckets):
    # Cap 0.75 MiB = 786432 bytes; a row gathers to 24 bytes: 16384 + 16384 rows fill it
    # exactly and one row more opens bucket 1; one row fewer leaves room for it. (Caps in
    # exact bytes would hide a MiB of 1000 * 1024 or 1025 * 1024 bytes: a fraction of it
    # truncates back to the same count.)
    result = run_case(backend, 2, "fsdp_all_gather", AG, cap_mb=0.75,
                      program_args={"rows": rows})
    assert result["collectives"] == (3, buckets)


@pytest.mark.spec("BK-21")
def test_one_byte_over_the_cap_opens_the_next_bucket(backend):
    # Cap 191: 72 + 120 is one byte over, so 72 sits alone, 120 opens bucket 1 (with 24:
    # 144), 96 bucket 2 (with 48: 144), 144 bucket 3.
    result = run_case(backend, 2, "fsdp_all_gather", AG, cap_mb=byte_caps(191))
    assert result["collectives"] == (6, 4)
    assert_expected_inline(result["comm_trace"], """\
all_gather_into_tensor out-of-place ranks[0,1] in=b0:f32[3, 3]=input out=b1:f32[6, 3]
wait b1
all_gather_into_tensor_out out-of-place ranks[0,1] in=b2:f32[18]=view(b3=computed) out=b3:f32[36]
wait b3
all_gather_into_tensor_out out-of-place ranks[0,1] in=b4:f32[18]=view(b5=computed) out=b5:f32[36]
wait b5
all_gather_into_tensor out-of-place ranks[0,1] in=b6:f32[6, 3]=input out=b7:f32[12, 3]
wait b7""")  # noqa: E501


@pytest.mark.spec("BK-21", "BK-5")
def test_a_member_larger_than_the_cap_sits_alone_between_buckets(backend):
    # Cap 100, members 24, 48, 144, 24, 48: [24, 48] [144] [24, 48].
    result = run_case(backend, 2, "fsdp_all_gather", AG, cap_mb=byte_caps(100),
                      program_args={"rows": (1, 2, 6, 1, 2)})
    assert result["collectives"] == (5, 3)
    assert_expected_inline(result["comm_trace"], """\
all_gather_into_tensor_out out-of-place ranks[0,1] in=b0:f32[9]=view(b1=computed) out=b1:f32[18]
wait b1
all_gather_into_tensor out-of-place ranks[0,1] in=b2:f32[6, 3]=input out=b3:f32[12, 3]
wait b3
all_gather_into_tensor_out out-of-place ranks[0,1] in=b4:f32[9]=view(b5=computed) out=b5:f32[18]
wait b5""")  # noqa: E501


@pytest.mark.spec("BK-21")
@pytest.mark.parametrize("cap_bytes, buckets", [(64, (4, 2)), (63, (4, 3))],
                         ids=["exactly_full", "one_byte_over"])
def test_reduce_scatter_members_count_their_input_bytes(backend, cap_bytes, buckets):
    # fsdp_reduce_scatter on 2 ranks, f32, rows per rank (1, 3, 2, 1): inputs of 16, 48,
    # 32 and 16 bytes (twice their outputs). Cap 64: [16, 48] [32, 16]; cap 63: 16 + 48
    # is one byte over: [16] [48] [32, 16].
    result = run_case(backend, 2, "fsdp_reduce_scatter", RS, cap_mb=byte_caps(cap_bytes))
    assert result["collectives"] == buckets


@pytest.mark.spec("BK-21", "BK-8", "BK-10")
@pytest.mark.parametrize("pass_name, args", [
    (AG, {"rows": (2, 1, 0, 1, 0)}), (RS, {"rows_per_rank": (2, 1, 0, 1, 0)})],
    ids=["all_gather", "reduce_scatter"])
def test_zero_size_members_are_merged(backend, pass_name, args):
    # Members of 48, 24, 0, 24, 0 bytes (all_gather) or 32, 16, 0, 16, 0 (reduce_scatter),
    # cap 72 or 48: the first two fill bucket 0 exactly, and a member of 0 bytes still
    # fits: [48, 24, 0] [24, 0].
    program = "fsdp_all_gather" if pass_name == AG else "fsdp_reduce_scatter"
    cap = byte_caps(72 if pass_name == AG else 48)
    result = run_case(backend, 2, program, pass_name, cap_mb=cap, program_args=args)
    assert result["collectives"] == (5, 2)


@pytest.mark.spec("BK-21", "BK-5")
def test_nodes_above_the_cap_stay_alone(backend):
    result = run_case(backend, 2, "fsdp_all_gather", AG, cap_mb=1e-6)
    assert result["collectives"] == (6, 6)
    assert result["unchanged"], "a pass with nothing to merge changed the graph [BK-5]"


@pytest.mark.spec("BK-4", "BK-7")
def test_dependent_all_gathers(backend):
    result = run_case(backend, 2, "chain", AG)
    assert result["collectives"] == (5, 3)
    assert_expected_inline(result["comm_trace"], """\
all_gather_into_tensor_out out-of-place ranks[0,1] in=b0:f32[6]=view(b1=computed) out=b1:f32[12]
wait b1
all_gather_into_tensor out-of-place ranks[0,1] in=b2:f32[2]=computed out=b3:f32[4]
wait b3
all_gather_into_tensor out-of-place ranks[0,1] in=b4:f32[2]=computed out=b5:f32[4]
wait b5""")


@pytest.mark.spec("BK-2", "BK-6", "BK-20")
@pytest.mark.parametrize("pass_name", [AG, RS])
def test_two_groups_interleaved(backend, pass_name):
    result = run_case(backend, 4, "interleaved", pass_name)
    assert result["collectives"] == (12, 8)


@pytest.mark.spec("BK-1", "BK-7", "FC-52")
@pytest.mark.parametrize("pass_name, world, group, dtype", [
    (AG, 2, "world", F32), (RS, 2, "world", F32), (AR, 2, "world", F32),
    (AG, 4, ROWS_2x2, BF16)], ids=["bucket_all_gather-world_of_2_f32",
                                   "bucket_reduce_scatter-world_of_2_f32",
                                   "bucket_all_reduce-world_of_2_f32",
                                   "bucket_all_gather-strided_of_4_bf16"])
def test_point_to_point_ops_are_never_merged_and_keep_their_order(backend, pass_name, world,
                                                                   group, dtype):
    """Three collectives of the pass's kind around a ring's receive and send on one group
    (the world, or each rank's row of [[0, 2], [1, 3]]: group ranks are not global ranks):
    the three merge into one where the last stood; the receive and the send stay single
    ops, in their order, before it, on every rank, with the same values as unbucketed."""
    kind = {AG: "all_gather", RS: "reduce_scatter", AR: "all_reduce"}[pass_name]
    for rank, result in enumerate(run_case(
            backend, world, "pipeline_exchange", pass_name, dtype=dtype, every_rank=True,
            program_args={"kind": kind, "group": group})):
        assert result["collectives"] == (5, 3), f"rank {rank}: {result['collectives']}"
        issued = [line.split()[0] for line in result["comm_trace"].splitlines()
                  if not line.startswith("wait")]
        assert issued[:2] == ["irecv", "isend"] and len(issued) == 3, \
            f"rank {rank} issues {issued}:\n{result['comm_trace']}"


W, OTHER = "world", [[0, 1]]  # on 2 ranks: two groups of the same ranks
KEYS = {
    # name: (pass, members (group, dtype, reduce op), collectives after)
    "group": (AG, [(W, F32, "sum"), (OTHER, F32, "sum")] * 2, 2),
    "group_rs": (RS, [(W, F32, "sum"), (OTHER, F32, "sum")] * 2, 2),
    "group_ar": (AR, [(W, F32, "sum"), (OTHER, F32, "sum")] * 2, 2),
    "dtype": (AG, [(W, F32, "sum"), (W, BF16, "sum")] * 2, 2),
    "dtype_rs": (RS, [(W, F32, "sum"), (W, BF16, "sum")] * 2, 2),
    "dtype_ar": (AR, [(W, F32, "sum"), (W, F16, "sum")] * 2, 2),
    # Dtypes of one size are still two keys: float16 and bfloat16, float32 and int32.
    "same_size_dtype": (AG, [(W, F16, "sum"), (W, BF16, "sum"), (W, F32, "sum"),
                             (W, torch.int32, "sum")] * 2, 4),
    "same_size_dtype_rs": (RS, [(W, F16, "sum"), (W, BF16, "sum")] * 2, 2),
    "same_size_dtype_ar": (AR, [(W, BF16, "sum"), (W, F16, "sum")] * 2, 2),
    # "SUM" and "sum" are one reduce op (FC-17): one key.
    "reduce_op_rs": (RS, [(W, F32, op) for op in ("sum", "avg", "SUM", "max", "avg", "max")], 3),
    "reduce_op_ar": (AR, [(W, F32, op) for op in ("sum", "min", "SUM", "avg", "min", "avg")], 3),
}


@pytest.mark.spec("BK-2", "BK-20")
@pytest.mark.parametrize("name", list(KEYS))
def test_every_key_component_separates_buckets(backend, name):
    pass_name, members, after = KEYS[name]
    kind = {AG: "all_gather", RS: "reduce_scatter", AR: "all_reduce"}[pass_name]
    result = run_case(backend, 2, "keyed", pass_name,
                      program_args={"kind": kind, "members": members})
    assert result["collectives"] == (len(members), after)


def _key_of(member) -> tuple:
    """A member's key as BK-20 reads it: the group, the dtype, the reduce op in lower case
    (FC-17)."""
    group, dtype, reduce_op = member
    return str(group), dtype, reduce_op.lower()


@pytest.mark.spec("BK-20")
@pytest.mark.parametrize("name", list(KEYS))
def test_adjacent_candidates_of_different_keys_share_no_bucket(backend, name):
    """KEYS's members reordered so that each key's are adjacent in graph order (first
    key first): merged without BK-2's reach across other keys, one bucket per key."""
    pass_name, members, after = KEYS[name]
    order = list(dict.fromkeys(_key_of(m) for m in members))
    members = sorted(members, key=lambda m: order.index(_key_of(m)))
    kind = {AG: "all_gather", RS: "reduce_scatter", AR: "all_reduce"}[pass_name]
    result = run_case(backend, 2, "keyed", pass_name,
                      program_args={"kind": kind, "members": members})
    assert result["collectives"] == (len(members), after)


# name: (pass, members of `keyed` on 2 ranks, bytes of a member of the first key). The
# first key's members a1, a2, a3 stand around one member b1 of another key (a dtype, a
# reduce op, a group): `keyed` gathers [4, 2] into 64 bytes of float32 (32 of bfloat16);
# a reduce_scatter's [4, 2] input and an all_reduce's are 32 bytes of float32.
CAP_INDEX_KEYS = {
    "all_gather_dtype": (AG, [(W, F32, "sum"), (W, BF16, "sum"), (W, F32, "sum"),
                              (W, F32, "sum")], 64),
    "reduce_scatter_op": (RS, [(W, F32, "sum"), (W, F32, "avg"), (W, F32, "sum"),
                               (W, F32, "sum")], 32),
    "all_reduce_group": (AR, [(W, F32, "sum"), (OTHER, F32, "sum"), (W, F32, "sum"),
                              (W, F32, "sum")], 32),
}


@pytest.mark.spec("BK-3")
@pytest.mark.parametrize("name", list(CAP_INDEX_KEYS))
def test_bucket_indices_count_within_their_own_key(backend, name):
    """a1 b1 a2 a3, caps of S bytes for bucket 0, 2S for bucket 1 and S from bucket 2 on
    (S: one member): a1 fills bucket 0 of its key, b1 opens bucket 0 of its own, a2
    opens bucket 1 of a1's key, whose 2S hold a3 too. The cap is asked for 0, 0, 1: b1's
    bucket is no bucket of a1's key, so a2's is not bucket 2 (whose S would leave a2 and
    a3 apart). On every rank."""
    pass_name, members, size = CAP_INDEX_KEYS[name]
    kind = {AG: "all_gather", RS: "reduce_scatter", AR: "all_reduce"}[pass_name]
    results = run_case(backend, 2, "keyed", pass_name, cap_mb=byte_caps(size, 2 * size, size),
                       program_args={"kind": kind, "members": members}, every_rank=True)
    for rank, result in enumerate(results):
        assert result["asked"] == [0, 0, 1], \
            f"rank {rank}: cap asked for bucket indices {result['asked']} [BK-3]"
        assert result["collectives"] == (4, 3), f"rank {rank}: {result['collectives']}"


# Every reduce op of FC-17 with dtypes it takes, float16 and bfloat16 included.
REDUCTIONS = [("sum", F16), ("avg", BF16), ("product", torch.int64), ("min", torch.float64),
              ("max", torch.int32), ("band", torch.int64), ("bor", torch.uint8),
              ("bxor", torch.int32)]


@pytest.mark.spec("BK-13", "BK-10", "BK-11")
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("pass_name", [RS, AR])
@pytest.mark.parametrize("reduce_op, dtype", REDUCTIONS, ids=[op for op, _ in REDUCTIONS])
def test_every_reduce_op_and_dtype_is_merged_exactly(backend, reduce_op, dtype, pass_name,
                                                     world_size):
    kind = "reduce_scatter" if pass_name == RS else "all_reduce"
    members = [(W, dtype, reduce_op)] * 3
    result = run_case(backend, world_size, "keyed", pass_name,
                      program_args={"kind": kind, "members": members})
    assert result["collectives"] == (3, 1)


@pytest.mark.spec("BK-4", "BK-7")
def test_a_merge_that_would_close_a_cycle_across_keys_is_not_made(backend):
    # a1 (world), b1 (other group), b2 <- a1, a2 <- b1: {b1, b2} merge, a2 stays alone.
    result = run_case(backend, 2, "cross_key_cycle", AG)
    assert result["collectives"] == (4, 3)
    assert_expected_inline(result["comm_trace"], """\
all_gather_into_tensor out-of-place ranks[0,1] in=b0:f32[2]=input out=b1:f32[4]
wait b1
all_gather_into_tensor_out out-of-place ranks[0,1] in=b2:f32[4]=view(b3=computed) out=b3:f32[8]
wait b3
all_gather_into_tensor out-of-place ranks[0,1] in=b4:f32[2]=computed out=b5:f32[4]
wait b5""")  # noqa: E501


@pytest.mark.spec("BK-4")
def test_a_cycle_through_two_other_buckets_is_not_closed(backend):
    # x1; {y1, y2 <- x1}; {z1 <- y1, z2}; x3 <- z2: x3 must not join x1 (X reaches Z
    # through Y's merge), so 6 collectives become 4.
    result = run_case(backend, 2, "three_key_chain", AG)
    assert result["collectives"] == (6, 4)
    # Which four: x1 alone, {y1, y2}, {z1, z2}, x3 alone (not y1 and y2 alone with {x1,
    # x3}, which also makes four); members of X have 2 elements, of Y 3, of Z 4.
    assert_expected_inline(result["comm_trace"], """\
all_gather_into_tensor out-of-place ranks[0,1] in=b0:f32[2]=input out=b1:f32[4]
wait b1
all_gather_into_tensor_out out-of-place ranks[0,1] in=b2:f32[6]=view(b3=computed) out=b3:f32[12]
wait b3
all_gather_into_tensor_out out-of-place ranks[0,1] in=b4:f32[8]=view(b5=computed) out=b5:f32[16]
wait b5
all_gather_into_tensor out-of-place ranks[0,1] in=b6:f32[2]=computed out=b7:f32[4]
wait b7""")  # noqa: E501


@pytest.mark.spec("BK-1")
@pytest.mark.parametrize("pass_name", [AG, RS, AR])
def test_collectives_of_upstreams_namespace_are_candidates(backend, pass_name):
    """Three collectives of upstream's `_c10d_functional`, called directly and waited by
    upstream's wait, whatever the backend's own API: one bucket."""
    kind = {AG: "all_gather", RS: "reduce_scatter", AR: "all_reduce"}[pass_name]
    result = run_case(backend, 2, "upstream_namespace", pass_name,
                      program_args={"kind": kind})
    assert result["collectives"] == (3, 1)


@pytest.mark.spec("BK-1", "FC-35")
@pytest.mark.parametrize("pass_name", [AG, RS, AR])
def test_collectives_waited_together_are_no_candidates(backend, pass_name):
    """torch 2.15 waits a coalesced collective's results with one `wait_tensors`: two
    upstream collectives waited so, two waited one by one. A collective whose user is a
    wait of a list is no candidate (BK-1: its wait is no `wait_tensor` of it alone): the
    last two make one bucket, the first two stay; the values bit for bit on every rank."""
    kind = {AG: "all_gather", RS: "reduce_scatter", AR: "all_reduce"}[pass_name]
    result = run_case(backend, 2, "upstream_waited_together", pass_name,
                      program_args={"kind": kind})
    assert result["collectives"] == (4, 3)
    if pass_name == AG:  # the comm trace prints the wait of a list as a wait of each
        assert_expected_inline(result["comm_trace"], """\
all_gather_into_tensor out-of-place ranks[0,1] in=b0:f32[4, 2]=input out=b1:f32[8, 2]
all_gather_into_tensor out-of-place ranks[0,1] in=b2:f32[4, 2]=input out=b3:f32[8, 2]
wait b1
wait b3
all_gather_into_tensor_out out-of-place ranks[0,1] in=b4:f32[16]=view(b5=computed) out=b5:f32[32]
wait b5""")  # noqa: E501


@pytest.mark.spec("BK-9", "BK-7")
def test_casts_from_sources_of_different_dtypes_are_absorbed(backend):
    """Members cast to bf16 from f32, f16 and f64: every cast absorbed, the concatenation
    in the promotion of the sources (f64), converted once; the values bit for bit."""
    result = run_case(backend, 2, "fsdp_all_gather", AG, dtype=BF16,
                      program_args={"rows": (3, 1, 2), "cast": True,
                                    "source": (F32, F16, torch.float64)})
    assert result["collectives"] == (3, 1)
    assert "_to_copy" not in result["canonical"], result["canonical"]
    assert "convert_element_type" not in result["canonical"], result["canonical"]


@pytest.mark.spec("BK-1")
def test_out_variant_collectives_are_no_candidates(backend):
    result = run_case(backend, 2, "with_out_variant", AG)
    assert result["collectives"] == (3, 2)


@pytest.mark.spec("BK-1")
def test_a_collective_whose_user_is_not_its_wait_is_no_candidate(backend):
    result = run_case(backend, 2, "waited_through_a_view", AG)
    assert result["collectives"] == (3, 2)


@pytest.mark.spec("BK-1")
def test_a_collective_waited_twice_is_no_candidate(backend):
    result = run_case(backend, 2, "waited_twice", AG)
    assert result["collectives"] == (3, 2)


@pytest.mark.spec("BK-8", "BK-9", "BK-6")
def test_all_gather_without_the_out_variant_gathers_the_cast_concatenation(backend):
    """Without `use_out_variant` the members' concatenation, cast to the bucket's dtype
    once, is gathered out of place; every rank's graph is the same."""
    result = run_case(backend, 2, "fsdp_all_gather", AG, dtype=BF16,
                      options={"use_out_variant": False},
                      program_args={"rows": (3, 1), "cast": True})
    assert result["collectives"] == (2, 1)
    assert_expected_inline(result["comm_trace"], """\
all_gather_into_tensor out-of-place ranks[0,1] in=b0:bf16[12]=computed out=b1:bf16[24]
wait b1""")


@pytest.mark.spec("BK-22")
def test_a_cast_to_an_integer_dtype_is_kept(backend):
    # f32 -> int32 is no floating-point cast: each member's cast stays, the bucket's copy
    # converts nothing.
    result = run_case(backend, 2, "fsdp_all_gather", AG, dtype=torch.int32,
                      program_args={"rows": (3, 1), "cast": True})
    assert result["collectives"] == (2, 1)
    assert result["canonical"].count("aten._to_copy(") == 2, result["canonical"]


@pytest.mark.spec("BK-22")
def test_a_cast_from_an_integer_dtype_is_kept(backend):
    # int32 -> bf16 converts no floating-point source: each member's cast stays.
    result = run_case(backend, 2, "fsdp_all_gather", AG, dtype=BF16,
                      program_args={"rows": (3, 1), "cast": True, "source": torch.int32})
    assert result["collectives"] == (2, 1)
    assert result["canonical"].count("aten._to_copy(") == 2, result["canonical"]


@pytest.mark.spec("BK-9")
def test_a_cast_with_another_reader_is_kept(backend):
    result = run_case(backend, 2, "fsdp_all_gather", AG, dtype=BF16,
                      program_args={"rows": (3, 1), "cast": True, "cast_read_again": True})
    assert result["collectives"] == (2, 1)


@pytest.mark.spec("BK-9", "BK-7")
@pytest.mark.parametrize("out_variant", [True, False], ids=["out_variant", "out_of_place"])
def test_a_kept_cast_after_an_absorbed_one(backend, out_variant):
    # The first member's cast is absorbed (its f32 source is concatenated), the last
    # one's is kept (bf16): the concatenation is f32, the promotion of every member, and
    # is converted to bf16 once, by the copy or before the out-of-place gather.
    result = run_case(backend, 2, "fsdp_all_gather", AG, dtype=BF16,
                      options={"use_out_variant": out_variant},
                      program_args={"rows": (3, 1), "cast": True, "cast_read_again": True,
                                    "read_again": 1})
    assert result["collectives"] == (2, 1)


@pytest.mark.spec("BK-8", "BK-10")
@pytest.mark.parametrize("pass_name", [AG, RS])
def test_group_index_is_the_position_among_sorted_ranks(backend, pass_name):
    program = "fsdp_all_gather" if pass_name == AG else "fsdp_reduce_scatter"
    results = run_case(backend, 4, program, pass_name, program_args={"group": ROWS_3_1},
                       groups_alike=False, every_rank=True)
    for rank, result in enumerate(results):
        assert result["collectives"][1] == 1
        if pass_name == AG:
            # The copy-in goes to this rank's slot of the gathered buffer (use_out_variant).
            group = next(sorted(row) for row in ROWS_3_1 if rank in row)
            ((offset, size),) = result["slots"]
            assert offset == group.index(rank) * size, (
                f"rank {rank}: copy-in at element {offset}, its slot is "
                f"{group.index(rank)} * {size} [BK-8]")


@pytest.mark.spec("BK-12")
def test_all_gather_mixed_dtypes(backend):
    result = run_case(backend, 2, "mixed_dtypes", AG, dtype=None,
                      options={"mixed_dtypes": True})
    assert result["collectives"] == (5, 1)


@pytest.mark.spec("BK-10")
def test_reduce_scatter_fsdp_grads(backend):
    result = run_case(backend, 2, "fsdp_reduce_scatter", RS,
                      program_args={"rows_per_rank": (1, 3, 2)})
    assert result["collectives"] == (3, 1)
    assert_expected_inline(result["comm_trace"], """\
reduce_scatter_tensor out-of-place ranks[0,1] sum in=b0:f32[24]=view(b1=computed) out=b2:f32[12]
wait b2""")


@pytest.mark.spec("BK-7", "BK-10")
def test_reduce_scatter_fsdp_grads_canonical_graph(backend):
    result = run_case(backend, 2, "fsdp_reduce_scatter", RS,
                      program_args={"rows_per_rank": (1, 3, 2)})
    assert_expected_inline(result["canonical"], """\
%0 = input : f32[2, 2]
%1 = input : f32[6, 2]
%2 = input : f32[4, 2]
%3 = aten.mul.Tensor(%0, 3) : f32[2, 2]
%4 = aten.mul.Tensor(%1, 3) : f32[6, 2]
%5 = aten.mul.Tensor(%2, 3) : f32[4, 2]
%6 = aten.view(%3, [2, -1]) : f32[2, 2]
%7 = aten.view(%4, [2, -1]) : f32[2, 6]
%8 = aten.view(%5, [2, -1]) : f32[2, 4]
%9 = aten.cat([%6, %7, %8], 1) : f32[2, 12]
%10 = aten.view(%9, [24]) : f32[24]
%11 = funcol.reduce_scatter_tensor(%10, 'sum', 2, ranks[0,1]) : f32[12]
%12 = funcol.wait_tensor(%11) : f32[12]
%13 = aten.split_with_sizes(%12, [2, 6, 4]) : (f32[2], f32[6], f32[4])
%14 = getitem(%13, 0) : f32[2]
%15 = getitem(%13, 1) : f32[6]
%16 = getitem(%13, 2) : f32[4]
%17 = aten.view(%14, [1, 2]) : f32[1, 2]
%18 = aten.view(%15, [3, 2]) : f32[3, 2]
%19 = aten.view(%16, [2, 2]) : f32[2, 2]
%20 = aten.add.Tensor(%17, 1) : f32[1, 2]
%21 = aten.add.Tensor(%18, 1) : f32[3, 2]
%22 = aten.add.Tensor(%19, 1) : f32[2, 2]
return [%20, %21, %22]""")


@pytest.mark.spec("BK-10", "BK-13")
@pytest.mark.parametrize("dtype,reduce_op", [(torch.bfloat16, "avg"), (torch.float16, "avg"),
                                             (torch.float16, "sum")],
                         ids=["bf16-avg", "f16-avg", "f16-sum"])
def test_reduce_scatter_dtypes(backend, dtype, reduce_op):
    result = run_case(backend, 2, "fsdp_reduce_scatter", RS, dtype=dtype,
                      program_args={"reduce_op": reduce_op})
    assert result["collectives"] == (4, 1)


@pytest.mark.spec("BK-8", "BK-10", "BK-7")
@pytest.mark.parametrize("pass_name", [AG, RS])
def test_ops_on_transposed_views_are_bucketed_in_their_logical_order(backend, pass_name):
    """The ops (not the API, which copies first) on non-contiguous inputs: the bucket's
    copy-in reads each member's rows as the op would, whatever its strides."""
    result = run_case(backend, 2, "ops_on_transposed_views", pass_name)
    assert result["collectives"] == (4, 3)


@pytest.mark.spec("BK-10")
def test_reduce_scatter_noncontiguous_subgroups(backend):
    result = run_case(backend, 4, "fsdp_reduce_scatter", RS, program_args={"group": ROWS_2x2})
    assert result["collectives"] == (4, 1)


@pytest.mark.spec("BK-14")
@pytest.mark.parametrize("pass_name", [AG, RS])
def test_gather_and_scatter_dims_other_than_0(backend, pass_name):
    result = run_case(backend, 2, "other_dims", pass_name)
    assert result["collectives"] == (4, 3)


@pytest.mark.spec("BK-23")
@pytest.mark.parametrize("world_size", [2, 4])
def test_padded_reduce_scatter_gives_each_rank_its_chunk(backend, world_size):
    # dim 0 of 3, 5 and 4 rows: on 4 ranks, torch.chunk(3 rows, 4) has 3 chunks and rank 3
    # receives none; 4 rows need no padding.
    backend.require("functional_collectives")
    backend.require("bucketing", RS)
    _padded_chunks(backend, world_size, {})


def _padded_chunks(backend, world_size: int, options: dict) -> list[dict]:
    """padded_reduce_scatter's three members (3, 5 and 4 rows) bucketed with `options`:
    every rank's chunks checked against torch.chunk of the sum; every rank's results."""
    shapes = [(3, 2), (5,), (4, 1)]
    results = harness.run(backend, padded_reduce_scatter, world_size, shapes, options)
    for rank, result in enumerate(results):
        assert result["collectives"] == 1, f"rank {rank}: {result['collectives']}"
        for i, shape in enumerate(shapes):
            xs = [oracle.rank_input(r, shape, F32, salt=80 + i) for r in range(world_size)]
            chunks = torch.chunk(oracle.reduce(xs, "sum"), world_size)
            want = chunks[rank] if rank < len(chunks) else chunks[0][:0]
            got = result["got"][i]
            assert got.shape == want.shape and torch.equal(got, want), (rank, i, got, want)
    # BK-7 on rank 0, whose chunks are the full ones the graph's static meta states (a
    # later rank's last chunk is shorter, or empty).
    assert results[0]["untrue_meta"] == "", f"rank 0: {results[0]['untrue_meta']} [BK-7]"
    return results


@functools.cache
def _bad_graph_outcome(spec: str, name: str) -> tuple:
    from conformance.backends import get_backend

    return tuple(harness.run(get_backend(spec), bad_graph, 2, name))


@pytest.mark.spec("BK-19", "BK-16")
@pytest.mark.parametrize("name", list(BAD_GRAPHS))
def test_bad_candidates_are_refused_naming_the_node(backend, name):
    backend.require("functional_collectives")
    backend.require("bucketing")
    argument = BAD_GRAPHS[name][-1]
    for rank, (exc_type, message, node) in enumerate(_bad_graph_outcome(backend.spec, name)):
        assert exc_type == "ValueError", f"rank {rank}: {exc_type} {message}"
        for word in ("gm", node, argument):
            assert word in message, f"rank {rank}: {message!r} does not name {word!r}"


@pytest.mark.spec("BK-19")
@pytest.mark.parametrize("shape", [(4,), (4, 1)], ids=["every_dim_symbolic", "one_dim_symbolic"])
def test_a_candidate_of_symbolic_size_is_refused_naming_it(backend, shape):
    """A graph traced with symbolic sizes: every dim a symbol, or one symbol beside a
    static dim (the pass must look at every dim, not at any)."""
    backend.require("functional_collectives")
    backend.require("bucketing", "bucket_all_gather")
    for rank, (exc_type, message, node) in enumerate(
            harness.run(backend, symbolic_candidates, 2, shape)):
        assert exc_type == "ValueError", f"rank {rank}: {exc_type} {message}"
        for word in ("gm", node, "BK-19"):
            assert word in message, f"rank {rank}: {message!r} does not name {word!r}"


@functools.cache
def _bad_argument_outcomes(spec: str) -> tuple:
    from conformance.backends import get_backend

    return tuple(harness.run(get_backend(spec), bad_arguments, 2))


@pytest.mark.spec("BK-19", "BK-3", "BK-12", "BK-24", "BK-25")
@pytest.mark.parametrize("name", list(BAD_ARGUMENTS))
def test_bad_arguments_are_refused_naming_them(backend, name):
    backend.require("functional_collectives")
    backend.require("bucketing")
    _, error, argument = BAD_ARGUMENTS[name]
    for rank, outcomes in enumerate(_bad_argument_outcomes(backend.spec)):
        exc_type, message = outcomes[name]
        if exc_type == "not implemented":
            raise harness.NotImplementedConcept(message)
        assert exc_type == error, f"rank {rank}: {exc_type} {message}"
        assert argument in message, f"rank {rank}: {message!r} does not name {argument!r}"


@pytest.mark.spec("BK-15")
def test_passes_log_under_refimpl_bucketing_only(backend):
    backend.require("functional_collectives")
    records = harness.run(backend, log_records, 2)[0]
    assert records, "the passes logged nothing at DEBUG"
    assert {name for name, _, _ in records} == {"refimpl.bucketing"}
    assert any(level == "DEBUG" and "left alone" in msg for _, level, msg in records)
    # One INFO line per pass, its numbers in the order of BK-15: "chain" has 5 candidates,
    # 2 of them depending on the open bucket (BK-4); "fsdp_reduce_scatter" merges its 4.
    infos = [msg for _, level, msg in records if level == "INFO"]
    assert [[int(n) for n in re.findall(r"\d+", msg)] for msg in infos] == \
        [[5, 3, 1, 2], [4, 4, 1, 0]], f"INFO lines: {infos}"


@pytest.mark.spec("BK-17")
def test_fsdp_blocks_are_tagged_in_program_order(backend):
    # Members of 24 bytes, cap 48: two buckets of two.
    result = run_case(backend, 2, "fsdp_all_gather", AG, cap_mb=byte_caps(48),
                      program_args={"rows": (1, 1, 1, 1)})
    assert_expected_inline("\n".join(result["blocks"]), """\
all_gather 0: empty slice view view cat copy_ all_gather_into_tensor_out
all_gather_wait 0: wait_tensor view split_with_sizes getitem getitem clone _unsafe_view clone _unsafe_view
- 4
all_gather 1: empty slice view view cat copy_ all_gather_into_tensor_out
all_gather_wait 1: wait_tensor view split_with_sizes getitem getitem clone _unsafe_view clone _unsafe_view
- 4""")  # noqa: E501


# A second call merges the two buckets of the first into bucket 2 (numbered on from the
# largest index there); the rest of blocks 0 and 1 joins block 2 (BK-17).
@pytest.mark.spec("BK-17")
def test_a_second_pass_numbers_on_and_absorbs_the_blocks_it_merges(backend):
    result = run_case(backend, 2, "fsdp_reduce_scatter", RS, cap_mb=byte_caps(32),
                      program_args={"rows_per_rank": (1, 1, 1, 1)}, again_cap_mb=25)
    assert result["collectives"] == (4, 1)
    assert_expected_inline("\n".join(result["blocks"]), """\
- 2
reduce_scatter 2: view view cat view
- 2
reduce_scatter 2: view view cat view view view cat view reduce_scatter_tensor
reduce_scatter_wait 2: wait_tensor split_with_sizes getitem getitem view view split_with_sizes getitem getitem view view
- 2
reduce_scatter_wait 2: split_with_sizes getitem getitem view view
- 2""")  # noqa: E501


@pytest.mark.spec("BK-17")
def test_reduce_scatter_blocks_are_tagged(backend):
    result = run_case(backend, 2, "fsdp_reduce_scatter", RS, cap_mb=byte_caps(32),
                      program_args={"rows_per_rank": (1, 1, 1, 1)})
    assert_expected_inline("\n".join(result["blocks"]), """\
- 2
reduce_scatter 0: view view cat view reduce_scatter_tensor
reduce_scatter_wait 0: wait_tensor split_with_sizes getitem getitem view view
- 4
reduce_scatter 1: view view cat view reduce_scatter_tensor
reduce_scatter_wait 1: wait_tensor split_with_sizes getitem getitem view view
- 2""")


@pytest.mark.spec("BK-11")
def test_all_reduce(backend):
    result = run_case(backend, 2, "all_reduces", AR)
    assert result["collectives"] == (3, 1)
    assert_expected_inline(result["comm_trace"], """\
all_reduce out-of-place ranks[0,1] sum in=b0:f32[12]=computed out=b1:f32[12]
wait b1""")


# ---- BK-18: repeated waits ----------------------------------------------------------------
def _deduplicated(backend, program: str, world_size: int = 2) -> list[dict]:
    backend.require("functional_collectives")
    backend.require("bucketing", "deduplicate_waits")
    results = harness.run(backend, deduplicated, world_size, program)
    for rank, result in enumerate(results):
        assert result["mismatch"] == "", f"rank {rank}: {result['mismatch']} [BK-18]"
        assert result["collectives"][0] == result["collectives"][1], (rank, result)
        assert result["removed"] == result["waits"][0] - result["waits"][1], (rank, result)
    return results


@pytest.mark.spec("BK-18", "BK-1")
def test_a_second_wait_of_one_collective_is_removed(backend):
    """Three all_gathers, the middle one waited twice: its second wait goes, its users
    read the first; the others' waits stay. Every rank computes what it did before."""
    for rank, result in enumerate(_deduplicated(backend, "waited_twice")):
        assert result["waits"] == (4, 3), (rank, result)


@pytest.mark.spec("BK-18")
def test_a_chain_of_waits_collapses_onto_its_first(backend):
    for rank, result in enumerate(_deduplicated(backend, "chain_of_waits")):
        assert result["waits"] == (4, 1), (rank, result)


def _compiled_twice_waited_gather(spec: str) -> list[dict]:
    """On a rank, per dtype: an all_gather waited twice, then one of the same key waited
    once, compiled with bucketing alone (cap 25 MiB) and called twice: the collectives
    each call issued on the group (c10d's sequence number), whether the values are
    eager's bit for bit, and the record of its stages where the backend keeps one."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    concept = backend.require("compile_backend")
    group = fc.resolve_group_name(dist.group.WORLD)
    ops = fc.ops

    def step(p1, p2):
        a = ops.all_gather_into_tensor(p1, 2, group)
        x, y = ops.wait_tensor(a), ops.wait_tensor(a)
        z = ops.wait_tensor(ops.all_gather_into_tensor(p2, 2, group))
        return x + y, z

    outcomes = []
    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.int32)):
        inputs = [oracle.rank_input(dist.get_rank(), shape, dtype, salt=180 + 2 * i + j)
                  for j, shape in enumerate([(3, 2), (5,)])]
        want = [t.wait() if hasattr(t, "wait") else t for t in step(*inputs)]
        compiled = concept.make({"bucket_cap_mb": 25.0, "lowering": None, "reorder": None})
        torch._dynamo.reset()
        try:
            function = torch.compile(step, backend=compiled, fullgraph=True, dynamic=False)
            issued, same = [], True
            for _ in range(2):
                before = dist.group.WORLD._get_sequence_number_for_group()
                got = function(*inputs)
                issued.append(dist.group.WORLD._get_sequence_number_for_group() - before)
                same = same and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        finally:
            torch._dynamo.reset()
        counts = concept.stage_counts(compiled) if concept.stage_counts else None
        outcomes.append({"dtype": str(dtype), "issued": issued, "same": same,
                         "stage_counts": counts})
    return outcomes


@pytest.mark.spec("BK-18", "BK-1")
def test_a_gather_waited_twice_is_bucketed_by_the_compile_backend(backend):
    """Compiled, a collective waited twice is merged with the next one of its key: the
    compiler removes the repeated wait before it buckets (BK-18), so the collective's
    only user is a wait (BK-1). One all_gather a call on every rank, in float32,
    bfloat16 and int32, and eager's values."""
    backend.require("functional_collectives")
    backend.require("compile_backend")
    for rank, outcomes in enumerate(harness.run(backend, _compiled_twice_waited_gather, 2)):
        for outcome in outcomes:
            where = f"rank {rank} {outcome['dtype']}"
            assert outcome["same"], f"{where}: compiled values differ from eager's"
            assert outcome["issued"] == [1, 1], \
                f"{where}: all_gathers issued per call {outcome['issued']}, expected one " \
                f"bucket [BK-18]"
            if outcome["stage_counts"] is not None:
                (graph,) = outcome["stage_counts"].values()
                assert graph["bucketed"] == {"all_gather_into_tensor_out": 1}, \
                    f"{where}: {graph}"


@pytest.mark.spec("BK-18", "FC-5")
def test_a_wait_stays_where_a_write_tells_the_results_apart(backend):
    """The first wait's result is written in place before the second wait: the values
    every rank computes decide (a wait that returns a copy must stay; one that aliases
    its argument sees the write through both)."""
    _deduplicated(backend, "written_between_waits")


def _bump(t, k):
    """A Python function that writes its argument in place: FX knows no schema for it."""
    return t.add_(k)


SCHEMALESS_WRITERS = {"python_function": _bump, "operator_iadd": operator.iadd}


def _a_write_between_two_waits(spec: str, rows, salt: int, write) -> list[str]:
    """On a rank, per collective and dtype: `c = collective(x); w1 = wait(c); y = w1 * 3;
    w2 = wait(c)`, traced twice, `write(gm, mul)` making each trace write `w1` before the
    second wait; run before and after the backend's `deduplicate_waits`: where the outputs
    differ."""
    from conformance.bucketing_programs import compare, group_of, trace
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    bucketing = backend.require("bucketing", "deduplicate_waits")
    pg = group_of(rows)
    n, name = pg.size(), fc.resolve_group_name(pg)
    collectives = {
        "all_gather": lambda a: fc.ops.all_gather_into_tensor(a, n, name),
        "reduce_scatter": lambda a: fc.ops.reduce_scatter_tensor(a, "sum", n, name),
        "all_reduce": lambda a: fc.ops.all_reduce(a, "sum", name),
    }
    mismatches = []
    for kind, collective in collectives.items():
        for i, dtype in enumerate((F32, BF16, torch.int32)):
            x = oracle.rank_input(dist.get_rank(), (2 * n, 3), dtype, salt=salt + i)

            def step(collective, a):
                c = collective(a)
                first = fc.ops.wait_tensor(c)
                return first * 3, fc.ops.wait_tensor(c) + 0

            graphs = [trace(functools.partial(step, collective), [x]) for _ in range(2)]
            for gm in graphs:
                (mul,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
                write(gm, mul)
                gm.recompile()
            bucketing.deduplicate_waits(graphs[1])
            before, after = (gm(x.clone()) for gm in graphs)
            if mismatch := compare(before, after):
                mismatches.append(f"{kind} {dtype}: {mismatch}")
    return mismatches


def _written_by_a_call_without_schema(spec: str, writer: str, rows) -> list[str]:
    """On a rank, per collective and dtype: `c = collective(x); w1 = wait(c);
    y = writer(w1, 3); w2 = wait(c)`, traced (the writer stands in for `w1 * 3`), run
    before and after the backend's `deduplicate_waits`: where the outputs differ."""
    def retarget(gm, mul):
        if writer == "method_call":  # `w1.add_(3)`: a call_method node, no target to read
            mul.op, mul.target = "call_method", "add_"
        else:
            mul.target = SCHEMALESS_WRITERS[writer]

    return _a_write_between_two_waits(spec, rows, 200, retarget)


@pytest.mark.spec("BK-18")
@pytest.mark.parametrize("writer, world_size, rows", [
    ("python_function", 2, "world"), ("operator_iadd", 2, "world"), ("method_call", 2, "world"),
    ("python_function", 4, ROWS_3_1)], ids=["python_function", "operator_iadd", "method_call",
                                            "python_function_row_group"])
def test_a_wait_stays_where_a_call_without_a_schema_may_write(backend, writer, world_size,
                                                               rows):
    """A call whose target has no schema (a Python function, `operator.iadd`, a method
    call `w1.add_(3)`) may write a tensor in place: here it writes the first wait's result
    before the second wait of the same collective. Every rank computes what it did before
    the pass (a wait that returns a copy must stay), for an all_gather, a reduce_scatter
    and an all_reduce in float32, bfloat16 and int32, on the world and on groups of 3 and
    1 of 4 ranks."""
    backend.require("functional_collectives")
    backend.require("bucketing", "deduplicate_waits")
    results = harness.run(backend, _written_by_a_call_without_schema, world_size, writer, rows)
    for rank, mismatches in enumerate(results):
        assert mismatches == [], f"rank {rank}: {mismatches} [BK-18]"


# ---- Programs of this file's own cases (run_case knows them by name) ----------------------
def _issue(fc, kind: str, x, pg):
    """One waited collective of `kind` on dim 0 of `x` (reduce op sum)."""
    if kind == "all_gather":
        return fc.all_gather_tensor(x, 0, pg)
    if kind == "reduce_scatter":
        return fc.reduce_scatter_tensor(x, "sum", 0, pg)
    return fc.all_reduce(x, "sum", pg)


def dependent_over_the_cap(fc, dtype, kind="all_gather", group="world"):
    """A, then B computed from A's result, then C, independent: each candidate's size
    (BK-21) is 4, 6 and 2 units of n elements (n: the group's size)."""
    from conformance.bucketing_programs import group_of

    pg = group_of(group)
    n, me = pg.size(), dist.get_rank()
    per = 1 if kind == "all_gather" else n  # an all_gather's size is its output's
    xs = [oracle.rank_input(me, (k * per,), dtype, salt=230 + i) for i, k in enumerate((4, 6, 2))]

    def step(a, b, c):
        ga = _issue(fc, kind, a, pg)
        gb = _issue(fc, kind, b + ga[:1], pg)
        return ga, gb, _issue(fc, kind, c, pg)

    return step, xs


# float8 is left out: gloo gathers no float8 tensor, so the unmerged graph cannot run.
ONE_BYTE = (torch.int8, torch.bool, torch.uint8)


def one_byte_dtypes(fc, dtype, group="world", dtypes=(*ONE_BYTE, F32)):
    """all_gathers of one-byte dtypes (and a wider one) on one group (BK-12)."""
    from conformance.bucketing_programs import group_of

    pg = group_of(group)
    me = dist.get_rank()
    shapes = [(3,), (2, 2), (5,), (4,), (1, 3), (2,)]
    xs = []
    for i, dt in enumerate(dtypes):
        wide = oracle.rank_input(me, shapes[i % len(shapes)], F32, salt=240 + i)
        xs.append(wide > 0 if dt == torch.bool else wide.to(dt))

    def step(*xs):
        return [fc.all_gather_tensor(x, 0, pg) for x in xs]

    return step, xs


def cast_by_prims(fc, dtype, sources=(F32, F16), group="world"):
    """Shards cast to `dtype` by `prims.convert_element_type` (as decompositions write a
    cast), each then gathered and used (BK-9)."""
    from conformance.bucketing_programs import group_of

    pg = group_of(group)
    me = dist.get_rank()
    shards = [oracle.rank_input(me, (r, 3), src, salt=250 + i)
              for i, (r, src) in enumerate(zip((3, 1, 2), sources, strict=True))]

    def step(*shards):
        return [fc.all_gather_tensor(torch.ops.prims.convert_element_type(s, dtype), 0, pg)
                * 2 + 1 for s in shards]

    return step, shards


def out_variants_waited(fc, dtype, kind="all_gather", group="world"):
    """Three `*_out` collectives (`all_gather_into_tensor_out`, `reduce_scatter_tensor_out`:
    the backend's own where it has the op, else upstream's), each read only by its wait."""
    from conformance.bucketing_programs import group_of

    pg = group_of(group)
    n, me = pg.size(), dist.get_rank()
    op_name = "all_gather_into_tensor_out" if kind == "all_gather" else \
        "reduce_scatter_tensor_out"
    packet, wait = getattr(fc.ops, op_name, None), fc.ops.wait_tensor
    if packet is None:
        upstream = torch.ops._c10d_functional
        packet, wait, name = getattr(upstream, op_name), upstream.wait_tensor, pg.group_name
    else:
        name = fc.resolve_group_name(pg)
    xs = [oracle.rank_input(me, (2 * n, 2), dtype, salt=260 + i) for i in range(3)]

    def step(*xs):
        outs = []
        for x in xs:
            if kind == "all_gather":
                out = x.new_empty((2 * n * n, 2))
                issued = packet(x, n, name, out=out)
            else:
                out = x.new_empty((2, 2))
                issued = packet(x, "sum", n, name, out=out)
            outs.append(wait(issued))
        return outs

    return step, xs


LOCAL_PROGRAMS = {f.__name__: f for f in (dependent_over_the_cap, one_byte_dtypes, cast_by_prims,
                                          out_variants_waited)}


# ---- Red-team round 3 ----------------------------------------------------------------------
def _sizes_in(comm_trace: str) -> list[int]:
    """The element count of each collective's input, in trace order."""
    return [functools.reduce(operator.mul, (int(d) for d in dims.split(",") if d.strip()), 1)
            for dims in re.findall(r" in=b\d+:\w+\[([\d, ]*)\]", comm_trace)]


@pytest.mark.spec("BK-1", "BK-5")
@pytest.mark.parametrize("dtype, world_size, group", [(F32, 2, "world"), (BF16, 4, ROWS_2x2),
                                                      (torch.int32, 2, "world")],
                         ids=["f32", "bf16_subgroup", "int32"])
def test_a_second_call_finds_no_candidate_in_merged_out_variants(backend, dtype, world_size,
                                                                  group):
    """Four all_gathers merged two by two (cap: two members), by default into
    `all_gather_into_tensor_out`; a second call with room for all finds no candidate
    (BK-1: an `_out` collective is none) and merges nothing: two collectives stay."""
    member = 2 * 3 * dtype.itemsize  # a [1, 3] shard gathered on a group of 2
    results = run_case(backend, world_size, "fsdp_all_gather", AG, dtype=dtype,
                       cap_mb=byte_caps(2 * member), again_cap_mb=25, every_rank=True,
                       program_args={"rows": (1, 1, 1, 1), "group": group})
    for rank, result in enumerate(results):
        assert result["collectives"] == (4, 2), \
            f"rank {rank}: {result['collectives']} [BK-1]\n{result['comm_trace']}"


@pytest.mark.spec("BK-1", "BK-5")
@pytest.mark.parametrize("kind, pass_name, world_size, group", [
    ("all_gather", AG, 2, "world"), ("all_gather", AG, 4, ROWS_3_1),
    ("reduce_scatter", RS, 2, "world"), ("reduce_scatter", RS, 4, ROWS_3_1)],
    ids=["all_gather", "all_gather_row_group", "reduce_scatter", "reduce_scatter_row_group"])
def test_out_variants_read_only_by_their_wait_are_no_candidates(backend, kind, pass_name,
                                                                world_size, group):
    """Three `all_gather_into_tensor_out` (or `reduce_scatter_tensor_out`), each read only
    by its wait: no candidate (BK-1), so the pass leaves the graph unchanged (BK-5)."""
    results = run_case(backend, world_size, "out_variants_waited", pass_name,
                       program_args={"kind": kind, "group": group}, groups_alike=False,
                       every_rank=True)
    for rank, result in enumerate(results):
        assert result["collectives"] == (3, 3), f"rank {rank}: {result['collectives']} [BK-1]"
        assert result["unchanged"], f"rank {rank}: the graph changed [BK-5]"


@pytest.mark.spec("BK-4", "BK-21")
@pytest.mark.parametrize("pass_name, dtype, world_size, group", [
    (AG, F32, 2, "world"), (AG, BF16, 4, ROWS_2x2), (RS, F32, 2, "world"),
    (RS, torch.int32, 4, ROWS_2x2), (AR, BF16, 2, "world"), (AR, torch.int64, 2, "world")],
    ids=["all_gather", "all_gather_bf16_subgroup", "reduce_scatter",
         "reduce_scatter_int32_subgroup", "all_reduce_bf16", "all_reduce_int64"])
def test_a_dependent_candidate_too_large_for_the_bucket_leaves_it_open(backend, pass_name,
                                                                       dtype, world_size,
                                                                       group):
    """A (4 units), B from A's result (6), C (2), cap 8 units: B depends on A's open bucket
    and is left alone, however large (BK-4); the bucket stays open and C joins A (6
    units). Closing it at B would merge B and C (8 units: exactly the cap) and leave A
    alone. Each collective of the result reads 6 units, on every rank."""
    kind = {AG: "all_gather", RS: "reduce_scatter", AR: "all_reduce"}[pass_name]
    n = 2  # the group's size
    results = run_case(backend, world_size, "dependent_over_the_cap", pass_name, dtype=dtype,
                       cap_mb=byte_caps(8 * n * dtype.itemsize), every_rank=True,
                       program_args={"kind": kind, "group": group})
    unit = 1 if pass_name == AG else n  # an all_gather's input is 1/n of its size
    for rank, result in enumerate(results):
        assert result["collectives"] == (3, 2), f"rank {rank}: {result['collectives']}"
        sizes = _sizes_in(result["comm_trace"])
        assert sorted(sizes) == [6 * unit, 6 * unit], \
            f"rank {rank}: inputs of {sizes} elements; [A, C] merged and B alone read " \
            f"{6 * unit} each [BK-4]\n{result['comm_trace']}"


@pytest.mark.spec("BK-12")
@pytest.mark.parametrize("world_size, group", [(2, "world"), (4, ROWS_2x2)],
                         ids=["world", "subgroup"])
def test_mixed_dtypes_view_one_byte_dtypes_back(backend, world_size, group):
    """int8, bool, uint8 and float32 gathered in one byte bucket: each piece comes back
    as its own dtype (int8 -1, not uint8 255; bool, not uint8 0/1), values bit for bit,
    on every rank."""
    results = run_case(backend, world_size, "one_byte_dtypes", AG, dtype=None,
                       options={"mixed_dtypes": True}, program_args={"group": group},
                       every_rank=True)
    for rank, result in enumerate(results):
        assert result["collectives"] == (4, 1), f"rank {rank}: {result['collectives']}"


def _block_order(blocks: list[str], kind: str) -> list[int]:
    """The indices of `kind`'s tagged runs in graph order, each index once."""
    found = [int(m.group(1)) for line in blocks if (m := re.match(rf"{kind} (\d+):", line))]
    return list(dict.fromkeys(found))


# a1 b1 b2 a2 of two keys: b's bucket stands at b2, before a's at a2, though a's opened first.
BLOCK_ORDER_KEYS = {
    "all_gather_dtype": (AG, [(W, F32, "sum"), (W, BF16, "sum"), (W, BF16, "sum"),
                              (W, F32, "sum")]),
    "reduce_scatter_op": (RS, [(W, F32, "sum"), (W, F32, "max"), (W, F32, "max"),
                               (W, F32, "sum")]),
    "all_reduce_group": (AR, [(W, F32, "sum"), (OTHER, F32, "sum"), (OTHER, F32, "sum"),
                              (W, F32, "sum")]),
}


@pytest.mark.spec("BK-17")
@pytest.mark.parametrize("name", list(BLOCK_ORDER_KEYS))
def test_blocks_are_numbered_by_where_the_merged_collective_stands(backend, name):
    """a1 b1 b2 a2: b's bucket opens second but its collective stands first (at b2), so
    it is block 0 and a's block 1, for the collective's kind and for the `_wait` kind,
    on every rank."""
    pass_name, members = BLOCK_ORDER_KEYS[name]
    kind = {AG: "all_gather", RS: "reduce_scatter", AR: "all_reduce"}[pass_name]
    results = run_case(backend, 2, "keyed", pass_name, every_rank=True,
                       program_args={"kind": kind, "members": members})
    for rank, result in enumerate(results):
        assert result["collectives"] == (4, 2), f"rank {rank}: {result['collectives']}"
        for tag in (kind, f"{kind}_wait"):
            assert _block_order(result["blocks"], tag) == [0, 1], \
                f"rank {rank}: {tag} blocks in graph order " \
                f"{_block_order(result['blocks'], tag)} [BK-17]\n" + "\n".join(result["blocks"])


@pytest.mark.spec("BK-9")
@pytest.mark.parametrize("dtype, sources, out_variant", [
    (BF16, (F32, F16, torch.float64), True), (BF16, (F32, F32, F32), False),
    (F16, (F32, BF16, F32), True)], ids=["bf16", "bf16_out_of_place", "f16"])
def test_casts_written_as_convert_element_type_are_absorbed(backend, dtype, sources,
                                                            out_variant):
    """Casts as decompositions write them, `prims.convert_element_type`, each read only
    by its all_gather: absorbed like `_to_copy` (none is left in the graph), the values
    bit for bit on every rank."""
    results = run_case(backend, 2, "cast_by_prims", AG, dtype=dtype, every_rank=True,
                       options=None if out_variant else {"use_out_variant": False},
                       program_args={"sources": sources})
    for rank, result in enumerate(results):
        assert result["collectives"] == (3, 1), f"rank {rank}: {result['collectives']}"
        assert "convert_element_type" not in result["canonical"], \
            f"rank {rank}: a cast was left [BK-9]\n{result['canonical']}"


# Ops that write their (list) argument in place and return nothing.
RETURNING_NOTHING = {
    "foreach_add_": lambda w: ((torch.ops.aten._foreach_add_.Scalar, ([w], 1))),
    "foreach_zero_": lambda w: ((torch.ops.aten._foreach_zero_.default, ([w],))),
}


def _written_by_an_op_returning_nothing(spec: str, writer: str, rows) -> list[str]:
    """On a rank, per collective and dtype: `c = collective(x); w1 = wait(c);
    writer([w1]); y = w1 * 3; w2 = wait(c)`, run before and after the backend's
    `deduplicate_waits`: where the outputs differ."""
    def insert_the_writer(gm, mul):
        target, args = RETURNING_NOTHING[writer](mul.args[0])
        with gm.graph.inserting_before(mul):
            gm.graph.call_function(target, args)

    return _a_write_between_two_waits(spec, rows, 270, insert_the_writer)


@pytest.mark.spec("BK-18")
@pytest.mark.parametrize("writer, world_size, rows", [
    ("foreach_add_", 2, "world"), ("foreach_zero_", 2, "world"),
    ("foreach_add_", 4, ROWS_3_1)], ids=["foreach_add_", "foreach_zero_",
                                         "foreach_add_row_group"])
def test_a_wait_stays_where_an_op_returning_nothing_writes(backend, writer, world_size, rows):
    """An in-place op whose schema marks its argument written but returns nothing
    (`_foreach_add_`, `_foreach_zero_`) writes the first wait's result before the second
    wait of the same collective. Every rank computes what it did before the pass (a wait
    that returns a copy must stay: BK-18 counts the schema's write, not a written
    return), for an all_gather, a reduce_scatter and an all_reduce in
    float32, bfloat16 and int32, on the world and on groups of 3 and 1 of 4 ranks."""
    backend.require("functional_collectives")
    backend.require("bucketing", "deduplicate_waits")
    results = harness.run(backend, _written_by_an_op_returning_nothing, world_size, writer,
                          rows)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: {problems} [BK-18]"


# --------------------------------------------------------------------------------------
# BK-24: buckets alike on every rank of a group, whatever each rank's caps
# --------------------------------------------------------------------------------------
def _per_rank_caps(backend, world_size, program, pass_name, caps_by_rank, dtype,
                   program_args_by_rank=None, options=None) -> list[dict]:
    backend.require("functional_collectives")
    backend.require("bucketing", pass_name)
    return harness.run(backend, per_rank_caps_case, world_size, program, pass_name,
                       caps_by_rank, dtype, program_args_by_rank, options)


def _ran_alike(results: list[dict]) -> None:
    """Every rank bucketed, the ranks of every group issued one sequence, and the real
    run gave the original's values on every rank (BK-24)."""
    for rank, result in enumerate(results):
        assert "refused" not in result and "peers_refused" not in result, f"rank {rank}: {result}"
        assert "unmatched" not in result, \
            f"ranks bucketed differently (a real run hangs):\n{result['unmatched']}"
        assert result["mismatch"] == "", f"rank {rank}: {result['mismatch']}"


def _refused_on_every_rank(results: list[dict]) -> None:
    """Every rank's pass raised a ValueError naming BK-24."""
    for rank, result in enumerate(results):
        error, message = result.get("refused", ("no error", str(result)[:300]))
        assert error == "ValueError" and "BK-24" in message, f"rank {rank}: {error}: {message}"


# (pass, program, dtype, each rank's caps, collectives before and after): the smallest
# caps alone make the buckets (sizes in bytes: AG 72 120 | 24 96 48 | 144; RS bf16
# 8 24 | 16 8; AR int32 12 16 | 20), the largest would merge all in one.
ONE_SET_OF_BUCKETS = {
    "all_gather_f32": (AG, "fsdp_all_gather", torch.float32, (25, byte_caps(200)), (6, 3)),
    "reduce_scatter_bf16": (RS, "fsdp_reduce_scatter", torch.bfloat16, (byte_caps(32), 25),
                            (4, 2)),
    "all_reduce_int32": (AR, "all_reduces", torch.int32, (25, byte_caps(28)), (3, 2)),
    # caps by bucket index: rank 0's bucket 0 small, rank 1's later ones; rank 1 never
    # opens bucket 1 with its own caps, and its cap there still counts: 72 | 120 24 |
    # 96 48 | 144, not 72 | the rest
    "all_gather_caps_by_index": (AG, "fsdp_all_gather", torch.float32,
                                 ((72 / MiB, 25), (25, 150 / MiB)), (6, 4)),
    # the coalesced form (BK-25): float16 8 24 | 16 8, one coalesced collective a bucket
    "reduce_scatter_coalesced_f16": (RS, "fsdp_reduce_scatter", F16, (byte_caps(32), 25),
                                     (4, 2), {"coalesced": True}),
    # an empty member (0 bytes): float32 16 0 48 | 32 with the 64-byte caps of rank 1
    "reduce_scatter_empty_member_f32": (RS, "fsdp_reduce_scatter", F32, (25, byte_caps(64)),
                                        (4, 2), {}, {"rows_per_rank": (1, 0, 3, 2)}),
}


@pytest.mark.spec("BK-24", "BK-3")
@pytest.mark.parametrize("name", list(ONE_SET_OF_BUCKETS))
def test_ranks_with_their_own_caps_make_one_set_of_buckets(backend, name):
    """Each rank buckets with a cap function of its own (a profile per rank): both ranks
    make the buckets the smaller caps make, and the bucketed program runs to eager's
    values (never a hang: the ranks' issued collectives are compared before it runs)."""
    pass_name, program, dtype, caps, counts, *more = ONE_SET_OF_BUCKETS[name]
    options, program_args = (*more, {}, {})[:2]
    results = _per_rank_caps(backend, 2, program, pass_name, caps, dtype,
                             [program_args] * 2 if program_args else None, options)
    _ran_alike(results)
    for rank, result in enumerate(results):
        assert result["collectives"] == counts, \
            f"rank {rank}: {result['collectives']}, the smaller caps make {counts} [BK-24]"
        assert sorted(result["asked"]) == sorted(set(result["asked"])), \
            f"rank {rank}: cap asked for bucket indices {result['asked']}: once each [BK-3]"


@pytest.mark.spec("BK-24", "BK-6")
def test_each_group_takes_the_smallest_caps_of_its_own_ranks(backend):
    """interleaved on 4 ranks (world's gathers of 64 bytes, rows [[0, 2], [1, 3]]'s of 32):
    only rank 2 caps at 64 bytes. The world's gathers stay single on every rank, row
    [0, 2] merges two of its three, row [1, 3], whose ranks both cap at 25 MiB, all three:
    a group agrees among its own ranks (group rank is not global rank), and every group's
    ranks issue one sequence."""
    caps = (25, 25, byte_caps(64), 25)
    results = _per_rank_caps(backend, 4, "interleaved", AG, caps, torch.float32)
    _ran_alike(results)
    for rank, result in enumerate(results):
        row_gathers = 2 if rank in (0, 2) else 1
        assert result["collectives"] == (12, 3 + row_gathers + 6), \
            f"rank {rank}: {result['collectives']}; world's gathers single (rank 2's cap), " \
            f"its row's in {row_gathers} [BK-24]"


@pytest.mark.spec("BK-24")
def test_a_rank_whose_caps_fail_is_named_on_every_rank(backend):
    """Rank 1's cap function raises: rank 1 raises its error, rank 0 a ValueError naming
    global rank 1 and BK-24 (never a hang, never buckets made without rank 1's caps)."""
    results = _per_rank_caps(backend, 2, "fsdp_all_gather", AG, (25, "raise"), torch.float32)
    assert results[1].get("refused", ("",))[0] == "LookupError", f"rank 1: {results[1]}"
    error, message = results[0].get("refused", ("no error", str(results[0])[:300]))
    assert error == "ValueError" and "BK-24" in message and "[1]" in message, \
        f"rank 0: {error}: {message}"


@pytest.mark.spec("BK-24")
def test_ranks_holding_other_candidates_are_refused_on_every_rank(backend):
    """Rank 1's last parameter has 7 rows where rank 0's has 6: no caps make one set of
    buckets, so every rank refuses with a ValueError naming BK-24."""
    rows = ({"rows": (3, 5, 1, 4, 2, 6)}, {"rows": (3, 5, 1, 4, 2, 7)})
    results = _per_rank_caps(backend, 2, "fsdp_all_gather", AG, (25, 25), torch.float32,
                             rows)
    _refused_on_every_rank(results)


@pytest.mark.spec("BK-24")
def test_rows_whose_agreement_takes_more_rounds_keep_the_others_in_step(backend):
    """fsdp_all_gather on the rows [[0, 2], [1, 3]] of 4 ranks: only rank 2 caps at 200
    bytes. Row [0, 2] needs rounds to agree (72 120 | 24 96 48 | 144), row [1, 3], both at
    25 MiB, agrees at once (one bucket): the ranks of the quick row stay in the rounds
    until every rank's plan is settled, never leaving the others waiting."""
    caps = (25, 25, byte_caps(200), 25)
    results = _per_rank_caps(backend, 4, "fsdp_all_gather", AG, caps, torch.float32,
                             ({"group": ROWS_2x2},) * 4)
    _ran_alike(results)
    for rank, result in enumerate(results):
        want = (6, 3) if rank in (0, 2) else (6, 1)
        assert result["collectives"] == want, f"rank {rank}: {result['collectives']} [BK-24]"


@pytest.mark.spec("BK-24")
def test_a_rank_missing_a_key_its_group_holds_is_refused_on_every_rank(backend):
    """keyed on 2 ranks: rank 0 all-gathers two float32 tensors, rank 1 two float16 ones
    on the same group: each key is held by one rank of its group only, so no caps make
    the ranks' buckets meet, and every rank refuses with a ValueError naming BK-24."""
    members = ({"members": ((WORLD, torch.float32, "sum"),) * 2},
               {"members": ((WORLD, torch.float16, "sum"),) * 2})
    results = _per_rank_caps(backend, 2, "keyed", AG, (25, 25), torch.float32, members)
    _refused_on_every_rank(results)


@pytest.mark.spec("BK-24")
def test_a_stage_of_point_to_point_ops_alone_is_bucketed_without_waiting(backend):
    """Rank 0 alone buckets a pipeline stage that only sends (its peer compiles another
    graph, or none): point-to-point ops are no collectives of a group, so there is
    nothing to agree on, and the pass returns at once with the graph as it was (never a
    timeout waiting for ranks that do not come)."""
    backend.require("functional_collectives")
    backend.require("bucketing", AG)
    outcome = harness.run(backend, point_to_point_stage_alone, 2)[0]
    assert outcome == ("bucketed", 2), f"rank 0: {outcome} [BK-24]"


# --------------------------------------------------------------------------------------
# BK-10, BK-11: bit for bit, with values that tell a summation order
# --------------------------------------------------------------------------------------
@pytest.mark.spec("BK-10", "BK-11")
@pytest.mark.parametrize("pass_name, program", [(RS, "fsdp_reduce_scatter"),
                                                (AR, "all_reduces")], ids=["rs", "ar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_merged_reductions_keep_every_bit_on_two_ranks(backend, pass_name, program, dtype):
    """Inputs of magnitudes spread over seven decades (spread_input), where another
    order or another precision of a sum changes the bits (small integers add up exactly
    in any order): on 2 ranks each element of a merged reduce_scatter or all_reduce is
    one sum of two values, so the bucketed program gives the original's bits on every
    rank (a bucket reduced in another dtype, or through a scaled or padded copy that
    rounds, does not)."""
    results = run_case(backend, 2, program, pass_name, dtype=dtype,
                       program_args={"spread": True}, every_rank=True)
    for rank, result in enumerate(results):
        assert result["collectives"][1] == 1, f"rank {rank}: {result['collectives']}"


# --------------------------------------------------------------------------------------
# BK-25: the coalesced mode (upstream 2.15's mode="coalesced" for reduce_scatter)
# --------------------------------------------------------------------------------------
@pytest.mark.spec("BK-25", "BK-10")
@pytest.mark.parametrize("world_size, dtype", [(2, torch.bfloat16), (4, torch.float32)],
                         ids=["2-bf16", "4-f32"])
def test_a_coalesced_bucket_is_one_coalesced_reduce_scatter(backend, world_size, dtype):
    """fsdp_reduce_scatter's four gradients merged with `coalesced=True`: one
    reduce_scatter_tensor_coalesced of the members' own inputs, no copy into a bucket
    buffer, then a wait per member; the values are the original's bit for bit on every
    rank (each element keeps its offset in its own input, so even a backend whose sums
    follow offsets adds it as before)."""
    results = run_case(backend, world_size, "fsdp_reduce_scatter", RS, dtype=dtype,
                       options={"coalesced": True}, program_args={"spread": True},
                       every_rank=True)
    for rank, result in enumerate(results):
        issued = [line for line in result["comm_trace"].splitlines()
                  if not line.startswith("wait")]
        assert len(issued) == 1 and issued[0].startswith("reduce_scatter_tensor_coalesced"), \
            f"rank {rank}: issued {issued} [BK-25]"
        waits = [line for line in result["comm_trace"].splitlines() if line.startswith("wait")]
        assert len(waits) == 4, f"rank {rank}: {len(waits)} waits, one per member [BK-25]"
        assert not re.search(r"= (cat|view)\(", result["canonical"]), \
            f"rank {rank}: a copy into a bucket buffer [BK-25]:\n{result['canonical']}"


# --------------------------------------------------------------------------------------
# BK-26, BK-27: summed reduce_scatters (upstream's dedup_fsdp_reduce_scatter)
# --------------------------------------------------------------------------------------
I32, F64 = torch.int32, torch.float64
# (world, dtype, parts, reduce op, group, rows per rank, NaN): every dtype family, sum and
# avg, 2 to 4 parts, a subgroup whose group ranks are not global ranks, empty parts, a NaN.
SUMS_THAT_MERGE = {
    "2-f32-2-sum": (2, F32, 2, "sum", WORLD, 2, False),
    "2-bf16-3-avg": (2, BF16, 3, "avg", WORLD, 2, False),
    "4-i32-4-sum-rows": (4, I32, 4, "sum", ROWS_2x2, 1, False),
    "4-f64-2-avg": (4, F64, 2, "avg", WORLD, 3, False),
    "2-f16-2-sum-nan": (2, F16, 2, "sum", WORLD, 2, True),
    "2-f32-3-sum-empty": (2, F32, 3, "sum", WORLD, 0, False),
}


def _summed(backend, world_size, dtype, program_args) -> list[dict]:
    """Every rank's outcome of summed_once; its values checked on every rank."""
    from conformance.bucketing_programs import summed_once

    backend.require("functional_collectives")
    backend.require("bucketing", "dedup_fsdp_reduce_scatter")
    results = harness.run(backend, summed_once, world_size, dtype, program_args)
    for rank, result in enumerate(results):
        assert result["mismatch"] == "", f"rank {rank}: {result['mismatch']} [BK-26, BK-27]"
        before, after = result["reduce_scatters"]
        assert result["removed"] == before - after, f"rank {rank}: {result} [BK-26]"
    return results


@pytest.mark.spec("BK-26")
@pytest.mark.parametrize("name", list(SUMS_THAT_MERGE))
def test_summed_reduce_scatters_become_one_of_the_summed_inputs(backend, name):
    """A gradient summed from N parts, each reduce-scattered: after the pass every rank
    issues one reduce_scatter on the group (the parts added first) and computes the
    original's values bit for bit (small integers: exact in either order; NaN where NaN)."""
    world, dtype, count, reduce_op, group, rows, nan = SUMS_THAT_MERGE[name]
    args = {"count": count, "reduce_op": reduce_op, "group": group, "rows": rows, "nan": nan}
    for rank, result in enumerate(_summed(backend, world, dtype, args)):
        assert result["reduce_scatters"] == (count, 1), f"rank {rank}: {result} [BK-26]"
        issued = [op for ops_ in result["issued"].values() for op in ops_]
        assert len(issued) == 1 and \
            issued[0].startswith(f"funcol.reduce_scatter_tensor {reduce_op} "), \
            f"rank {rank}: issued {result['issued']} [BK-26]"


# Changes whose values alone tell a wrong merge, and those the count of collectives tells.
CHANGES_TOLD_BY_VALUES = ("shape_broadcasts", "other_group", "max", "sum_and_avg", "alpha")


@pytest.mark.spec("BK-27", "BK-26")
@pytest.mark.parametrize("change", list(bucketing_programs.SUMMAND_CHANGES))
def test_a_sum_one_reduce_scatter_would_not_give_is_left_alone(backend, change):
    """Two parts (three for shape_broadcasts) whose last one differs: inputs that
    broadcast on dim 0 (the sum adds this rank's one row of a part to every row of the
    other, where the summed input would add each row's own), a group of other ranks, max,
    avg beside sum, another dtype, a wait read again, an add with alpha 2. Every rank's
    values stay the original's; where one reduce_scatter would not give the sum, the
    reduce_scatters stay as they were (an add with alpha may merge with its alpha)."""
    world = 4 if change == "other_group" else 2
    args = {"count": 2, "change": change,
            "group": [[0, 1], [2, 3]] if change == "other_group" else WORLD}
    for rank, result in enumerate(_summed(backend, world, F32, args)):
        if change not in CHANGES_TOLD_BY_VALUES:
            before, after = result["reduce_scatters"]
            assert after == before, f"rank {rank}: {result} [BK-27]"


@pytest.mark.spec("BK-25", "BK-26", "CL-15", "RO-13", "MEM-1", "SIM-2")
@pytest.mark.parametrize("mode, world_size, dtype", [
    ("coalesced", 2, BF16), ("coalesced", 4, I32), ("dedup", 2, F32), ("dedup", 4, F64)])
def test_the_graph_of_each_mode_goes_through_every_later_stage(backend, mode, world_size,
                                                               dtype):
    """The graph a coalesced bucket makes (BK-25) and the one summed reduce_scatters make
    (BK-26), through the backend's lowering and then its reorder, as its compiler would
    run them: every rank computes the traced program's values bit for bit; the memory plan
    and the simulated timeline of the final graph hold every collective it issues."""
    from conformance.bucketing_programs import through_later_stages

    for name in ("functional_collectives", "reorder", "memory", "simulator"):
        backend.require(name)
    backend.require("lowering", "lower")
    results = harness.run(backend, through_later_stages, world_size, mode, dtype)
    for rank, result in enumerate(results):
        assert result["mismatch"] == "", f"rank {rank}: {result['mismatch']}"
        assert len(result["issued"]) == 1, f"rank {rank}: the mode's one collective: {result}"
        assert result["simulated"] == sorted(result["issued"]), f"rank {rank}: {result}"
        assert result["unplanned"] == [], f"rank {rank}: {result}"


# --------------------------------------------------------------------------------------
# BK-28: module plans (upstream's manual_overlap_bucketing), judged on a compiled model
# --------------------------------------------------------------------------------------
# layers.0 alone, layers.1 and layers.2 together, head alone; head2 outside the plan.
MODULE_PLANS = ["layers.0", ["layers.1", "layers.2"], "head"]


@pytest.mark.spec("BK-28", "BK-8", "BK-10", "BK-11", "E2E-3")
def test_each_module_plan_entry_makes_one_bucket_of_each_kind(backend):
    """A model of three blocks and two heads, each linear holding its shard of a weight
    (gathered in its forward, its gradient reduce-scattered), each block two all_reduces
    of 0-d statistics, compiled with AOTAutograd: with MODULE_PLANS every entry issues one
    all_gather and one all_reduce (of those it has) in the forward and one reduce_scatter
    in the backward, head2's collectives (a name that starts with the entry head's) stay
    as they were, and two SGD steps give the losses and shards of the graphs left as
    traced, bit for bit on both ranks."""
    from conformance.e2e_programs import module_plan_on_rank

    backend.require("functional_collectives")
    backend.require("bucketing", "manual_overlap_bucketing")
    for rank, runs in enumerate(harness.run(backend, module_plan_on_rank, 2, MODULE_PLANS)):
        traced, planned = runs["traced"], runs["planned"]
        for (loss, *_), (planned_loss, forward, backward) in zip(
                traced["steps"], planned["steps"], strict=True):
            assert planned_loss == loss, f"rank {rank}: loss {planned_loss} != {loss}"
            # forward: 2 blocks' entries x (all_gather + all_reduce), head's and head2's
            # all_gathers; backward: a reduce_scatter for each of the four
            assert (forward, backward) == (6, 4), \
                f"rank {rank}: issued {forward} forward, {backward} backward [BK-28]"
        assert traced["steps"][0][1:] == (14, 8), f"rank {rank}: {traced['steps']}"
        for i, (a, b) in enumerate(zip(traced["shards"], planned["shards"], strict=True)):
            assert torch.equal(a, b), f"rank {rank}: shard {i} differs after two steps"


def _plan_refusal(spec: str, plans) -> str:
    """On a rank: what the backend's manual_overlap_bucketing raised given `plans` on a
    compiled model's forward graph ('' if nothing)."""
    from conformance.e2e_programs import PlannedModel, planned_compiler
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    passes = backend.require("bucketing", "manual_overlap_bucketing")
    torch._dynamo.reset()
    model = torch.compile(PlannedModel(fc, dist.group.WORLD), fullgraph=True,
                          backend=planned_compiler(passes, plans))
    try:
        with torch.no_grad():
            model(torch.ones(2, 8))
    except Exception as exc:  # noqa: BLE001 - the refusal's type is the backend's
        return f"{type(exc).__name__}: {exc}"
    return ""


# Plans whose entries overlap, and the two FQNs each refusal names.
OVERLAPPING_PLANS = {
    "parent_first": (["layers", "layers.0"], ("'layers'", "'layers.0'")),
    "child_first": (["layers.1", ["head", "layers"]], ("'layers.1'", "'layers'")),
    "one_fqn_twice": (["head", ["layers.2", "head"]], ("'head'", "'head'")),
}


@pytest.mark.spec("BK-29", "BK-28")
@pytest.mark.parametrize("name", list(OVERLAPPING_PLANS))
def test_overlapping_module_plans_are_refused_naming_them(backend, name):
    """Entries that overlap (a module and one below it, in either order; one FQN in two
    entries): refused on every rank before anything is merged, naming
    module_bucket_plans, both FQNs and the rule."""
    plans, fqns = OVERLAPPING_PLANS[name]
    backend.require("functional_collectives")
    backend.require("bucketing", "manual_overlap_bucketing")
    for rank, error in enumerate(harness.run(backend, _plan_refusal, 2, plans)):
        assert all(word in error for word in ("module_bucket_plans", *fqns, "BK-29")), \
            f"rank {rank}: {error!r}"


@pytest.mark.spec("BK-29", "BK-28")
def test_modules_whose_names_share_a_prefix_do_not_overlap(backend):
    """`head` and `head2` are siblings: a plan of both is taken on every rank."""
    backend.require("functional_collectives")
    backend.require("bucketing", "manual_overlap_bucketing")
    for rank, error in enumerate(harness.run(backend, _plan_refusal, 2, ["head", "head2"])):
        assert error == "", f"rank {rank}: {error}"


# The coalesced mode across its neighbour classes: (world, program, dtype, program args).
COALESCED_CLASSES = {
    "rows_f16": (4, "fsdp_reduce_scatter", F16, {"group": ROWS_2x2}),
    "transposed_i32": (2, "ops_on_transposed_views", I32, {}),
    "empty_member_f64": (2, "fsdp_reduce_scatter", F64, {"rows_per_rank": (1, 0, 2)}),
}


@pytest.mark.spec("BK-25", "BK-10")
@pytest.mark.parametrize("name", list(COALESCED_CLASSES))
def test_a_coalesced_bucket_takes_every_member_as_it_is(backend, name):
    """coalesced=True on a subgroup whose group ranks are not global ranks (float16), on
    inputs that are transposed views (int32: the ops' own inputs, no copy first) and with
    an empty member (float64): one reduce_scatter_tensor_coalesced of the group's
    reduce_scatters, the values the original's on every rank."""
    world, program, dtype, args = COALESCED_CLASSES[name]
    results = run_case(backend, world, program, RS, dtype=dtype, options={"coalesced": True},
                       program_args=args, every_rank=True)
    for rank, result in enumerate(results):
        scatters = [line for line in result["comm_trace"].splitlines()
                    if line.startswith("reduce_scatter")]
        assert len(scatters) == 1 and scatters[0].startswith(
            "reduce_scatter_tensor_coalesced"), f"rank {rank}: {scatters} [BK-25]"


@pytest.mark.spec("BK-25", "BK-23")
def test_a_coalesced_bucket_pads_what_the_group_size_does_not_divide(backend):
    """padded_reduce_scatter's members on 4 ranks with coalesced=True: each padded alike
    (BK-23), one coalesced reduce_scatter, each rank's chunk of torch.chunk of the sum."""
    backend.require("functional_collectives")
    backend.require("bucketing", RS)
    for rank, result in enumerate(_padded_chunks(backend, 4, {"coalesced": True})):
        issued = [line for line in result["comm_trace"].splitlines()
                  if not line.startswith("wait")]
        assert len(issued) == 1 and issued[0].startswith("reduce_scatter_tensor_coalesced"), \
            f"rank {rank}: {issued} [BK-25]"



@pytest.mark.spec("BK-28", "CL-15", "RO-13", "MEM-1", "SIM-2")
def test_a_module_planned_graph_goes_through_every_later_stage(backend):
    """PlannedModel's forward and backward graphs bucketed by MODULE_PLANS, then through
    the backend's lowering, reorder, memory plan and timeline, as its compiler would run
    them: one step gives the loss and gradients of the graphs left as traced, bit for bit
    on both ranks, and each timeline holds every collective its graph issues."""
    from conformance.e2e_programs import module_plans_through_later_stages

    for name in ("functional_collectives", "reorder", "memory", "simulator"):
        backend.require(name)
    backend.require("bucketing", "manual_overlap_bucketing")
    backend.require("lowering", "lower")
    for rank, result in enumerate(harness.run(backend, module_plans_through_later_stages, 2,
                                              MODULE_PLANS)):
        assert result["same"], f"rank {rank}: values differ from the traced graphs'"
        assert len(result["graphs"]) == 2, f"rank {rank}: {result['graphs']}"
        for issued, simulated in result["graphs"]:
            assert issued and simulated == issued, f"rank {rank}: {issued} {simulated}"
