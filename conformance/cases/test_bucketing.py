"""Conformance cases of SPEC section 3, Bucketing (BK).

Each case traces one user program on every gloo rank with the backend's own
functional-collectives API, applies the backend's bucketing pass to a second trace,
runs both graphs on real inputs and requires bit-identical outputs (numeric). Cases
with goldens also compare rank 0's comm trace (structural) and canonical graph (exact).
"""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

from conformance import harness
from conformance.bucketing_programs import conformance_case

AG, RS, AR = "bucket_all_gather", "bucket_reduce_scatter", "bucket_all_reduce"
ROWS_2x2 = [[0, 2], [1, 3]]


def run_case(backend, world_size, program, pass_name, cap_mb=25, dtype=torch.float32,
             options=None, program_args=None) -> dict:
    backend.require("functional_collectives")
    backend.require("bucketing", pass_name)
    results = harness.run(backend, conformance_case, world_size, program, pass_name, cap_mb,
                          dtype, options, program_args)
    for rank, result in enumerate(results):
        assert result["mismatch"] == "", f"rank {rank}: {result['mismatch']}"
    return results[0]


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


@pytest.mark.spec("BK-8")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_all_gather_noncontiguous_subgroups(backend, dtype):
    result = run_case(backend, 4, "fsdp_all_gather", AG, dtype=dtype,
                      program_args={"group": ROWS_2x2})
    assert result["collectives"] == (6, 1)


@pytest.mark.spec("BK-3")
def test_caps_are_asked_per_bucket_index(backend):
    # Gathered sizes on 2 ranks (bytes): 72 120 24 96 48 144. Caps: bucket 0 200 bytes,
    # bucket 1 130 bytes, then 10 kB: buckets [72, 120] [24, 96] [48, 144].
    caps = (200 / 2**20, 130 / 2**20, 10_000 / 2**20)
    result = run_case(backend, 2, "fsdp_all_gather", AG, cap_mb=caps)
    assert result["collectives"] == (6, 3)
    assert_expected_inline(result["comm_trace"], """\
all_gather_into_tensor_out out-of-place ranks[0,1] in=b0:f32[24]=view(b1=computed) out=b1:f32[48]
wait b1
all_gather_into_tensor_out out-of-place ranks[0,1] in=b2:f32[15]=view(b3=computed) out=b3:f32[30]
wait b3
all_gather_into_tensor_out out-of-place ranks[0,1] in=b4:f32[24]=view(b5=computed) out=b5:f32[48]
wait b5""")


@pytest.mark.spec("BK-3", "BK-5")
def test_nodes_above_the_cap_stay_alone(backend):
    result = run_case(backend, 2, "fsdp_all_gather", AG, cap_mb=1e-6)
    assert result["collectives"] == (6, 6)


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


@pytest.mark.spec("BK-2")
@pytest.mark.parametrize("pass_name", [AG, RS])
def test_two_groups_interleaved(backend, pass_name):
    result = run_case(backend, 4, "interleaved", pass_name)
    assert result["collectives"] == (12, 8)


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


@pytest.mark.spec("BK-10")
def test_reduce_scatter_noncontiguous_subgroups(backend):
    result = run_case(backend, 4, "fsdp_reduce_scatter", RS, program_args={"group": ROWS_2x2})
    assert result["collectives"] == (4, 1)


@pytest.mark.spec("BK-14")
@pytest.mark.parametrize("pass_name", [AG, RS])
def test_gather_and_scatter_dims_other_than_0(backend, pass_name):
    result = run_case(backend, 2, "other_dims", pass_name)
    assert result["collectives"] == (4, 3)


@pytest.mark.spec("BK-11")
def test_all_reduce(backend):
    result = run_case(backend, 2, "all_reduces", AR)
    assert result["collectives"] == (3, 1)
    assert_expected_inline(result["comm_trace"], """\
all_reduce out-of-place ranks[0,1] sum in=b0:f32[12]=computed out=b1:f32[12]
wait b1""")
