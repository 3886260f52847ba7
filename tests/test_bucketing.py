"""Bucketing passes on real gloo ranks: values, plans, placement, options and errors.

Every numeric check traces a program on each rank, buckets a second trace, runs both
graphs on the same real inputs and requires bit-identical outputs (inputs are small
integers, so reductions are exact in every dtype). BK-1 .. BK-17.
"""

from __future__ import annotations

import functools

import bucketing_rank
import pytest
import torch

from refimpl.multiprocess import run_on_ranks

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
ROWS_2x2 = [[0, 2], [1, 3]]  # non-contiguous subgroups: ranks [0, 2] and [1, 3]
ROWS_2x4 = [[0, 2, 4, 6], [1, 3, 5, 7]]  # rank 6 is index 3 of its group (BK-8)
SPLIT_2x4 = [[0, 1, 6, 7], [2, 3, 4, 5]]  # rank 6 is index 2: neither rank nor rank // 2

AG, RS, AR = "bucket_all_gather", "bucket_reduce_scatter", "bucket_all_reduce"

# (name, SPEC IDs, world sizes, (program, pass, dtype, options, program args, cap in MiB))
NUMERIC = [
    ("ag_f32", "BK-8", (2, 4), ("fsdp_all_gather", AG, F32, None, None, 25)),
    ("ag_bf16", "BK-8", (2, 4), ("fsdp_all_gather", AG, BF16, None, None, 25)),
    ("ag_bf16_cast", "BK-9", (2, 4), ("fsdp_all_gather", AG, BF16, None, {"cast": True}, 25)),
    ("ag_functional", "BK-8", (2,),
     ("fsdp_all_gather", AG, BF16, {"use_out_variant": False}, {"cast": True}, 25)),
    ("ag_no_cast_batching", "BK-9", (2,),
     ("fsdp_all_gather", AG, BF16, {"batch_casts": False}, {"cast": True}, 25)),
    ("ag_noncontig", "BK-8", (4,), ("fsdp_all_gather", AG, F32, None, {"group": ROWS_2x2}, 25)),
    ("ag_noncontig_bf16_functional", "BK-8", (4,),
     ("fsdp_all_gather", AG, BF16, {"use_out_variant": False}, {"group": ROWS_2x2}, 25)),
    ("ag_noncontig_8", "BK-8", (8,),
     ("fsdp_all_gather", AG, BF16, None, {"group": ROWS_2x4}, 25)),
    ("ag_small_cap", "BK-3", (2,), ("fsdp_all_gather", AG, F32, None, None, 0.0001)),
    ("rs_f32", "BK-10", (2, 4), ("fsdp_reduce_scatter", RS, F32, None, None, 25)),
    ("rs_bf16_avg", "BK-10 BK-13", (2, 4),
     ("fsdp_reduce_scatter", RS, BF16, None, {"reduce_op": "avg"}, 25)),
    ("rs_f16_avg", "BK-13", (2,), ("fsdp_reduce_scatter", RS, F16, None, {"reduce_op": "avg"}, 25)),
    ("rs_i64_max", "BK-13", (2,),
     ("fsdp_reduce_scatter", RS, torch.int64, None, {"reduce_op": "max"}, 25)),
    ("rs_noncontig", "BK-10", (4,),
     ("fsdp_reduce_scatter", RS, BF16, None, {"group": ROWS_2x2}, 25)),
    ("rs_noncontig_8", "BK-10", (8,),
     ("fsdp_reduce_scatter", RS, F32, None, {"group": SPLIT_2x4}, 25)),
    ("interleaved_ag", "BK-2", (4,), ("interleaved", AG, F32, None, None, 25)),
    ("interleaved_rs", "BK-2", (4,), ("interleaved", RS, BF16, None, None, 25)),
    ("interleaved_ag_2", "BK-2", (2,),
     ("interleaved", AG, F32, None, {"groups": ("world", [[0, 1]])}, 25)),
    ("chain", "BK-4 BK-7", (2,), ("chain", AG, F32, None, None, 25)),
    ("mixed_dtypes", "BK-12", (2, 4), ("mixed_dtypes", AG, None, {"mixed_dtypes": True}, None, 25)),
    ("mixed_dtypes_functional", "BK-12", (2,),
     ("mixed_dtypes", AG, None, {"mixed_dtypes": True, "use_out_variant": False}, None, 25)),
    ("other_dims_ag", "BK-14", (2,), ("other_dims", AG, F32, None, None, 25)),
    ("other_dims_rs", "BK-14", (2, 4), ("other_dims", RS, BF16, None, None, 25)),
    ("all_reduce", "BK-11", (2,), ("all_reduces", AR, F32, None, None, 25)),
    ("all_reduce_avg_bf16", "BK-11", (2,),
     ("all_reduces", AR, BF16, None, {"reduce_op": "avg"}, 25)),
]

# What each case must merge to: collectives (before, after).
EXPECTED_COUNTS = {
    "ag_f32": (6, 1), "ag_bf16": (6, 1), "ag_bf16_cast": (6, 1), "ag_functional": (6, 1),
    "ag_no_cast_batching": (6, 1), "ag_noncontig": (6, 1), "ag_noncontig_bf16_functional": (6, 1),
    "ag_noncontig_8": (6, 1), "rs_noncontig_8": (4, 1),
    "ag_small_cap": (6, 6), "rs_f32": (4, 1), "rs_bf16_avg": (4, 1), "rs_f16_avg": (4, 1),
    "rs_i64_max": (4, 1), "rs_noncontig": (4, 1), "interleaved_ag": (12, 8),
    "interleaved_rs": (12, 8), "interleaved_ag_2": (12, 8), "chain": (5, 3),
    "mixed_dtypes": (5, 1), "mixed_dtypes_functional": (5, 1), "other_dims_ag": (4, 3),
    "other_dims_rs": (4, 3), "all_reduce": (3, 1), "all_reduce_avg_bf16": (3, 1),
}


@functools.cache
def numeric_results(world_size: int) -> dict:
    """All numeric cases of one world size, in one call to the ranks."""
    names = [name for name, _, sizes, _ in NUMERIC if world_size in sizes]
    cases = [case for name, _, sizes, case in NUMERIC if world_size in sizes]
    per_rank = run_on_ranks(bucketing_rank.numeric_cases, world_size, cases)
    return {name: [results[i] for results in per_rank] for i, name in enumerate(names)}


# 4 and 8 ranks on 2 cores take some 10 and 15 s to start and run: the second tier's (the
# conformance cases of BK-8..BK-14 run 4 ranks in the first).
@pytest.mark.parametrize("name,ids,world_size", [
    pytest.param(name, ids, ws, id=f"{name}-{ws}ranks-{ids.replace(' ', '_')}",
                 marks=[pytest.mark.slow] if ws > 2 else [])
    for name, ids, sizes, _ in NUMERIC for ws in sizes])
def test_bucketed_graph_gives_the_same_values(name, ids, world_size):
    """BK-8..BK-14: every rank's bucketed graph returns bit-identical outputs."""
    for rank, (mismatch, counts) in enumerate(numeric_results(world_size)[name]):
        assert mismatch == "", f"rank {rank}: {mismatch} [{ids}]"
        assert counts == EXPECTED_COUNTS[name], f"rank {rank}: collectives {counts} [{ids}]"


def test_bk1_upstream_graphs_are_accepted_and_emit_refimpl_ops():
    """BK-1: a graph of `_c10d_functional` ops is bucketed; the merged ops are refimpl's."""
    for result in run_on_ranks(bucketing_rank.upstream_graph_bucketed_by_refimpl, 2,
                               AG, "fsdp_all_gather", F32):
        assert result["mismatch"] == ""
        assert result["collectives"] == (6, 1)
        assert "refimpl_c10d" in result["namespaces"]
        assert "_c10d_functional" not in result["namespaces"]


def test_bk1_bk3_bk12_bad_input_is_refused_with_the_rule():
    """BK-1, BK-3, BK-12: bad input raises, naming the argument and the rule."""
    messages = run_on_ranks(bucketing_rank.errors, 2)[0]
    expect = {
        "not_gm": ("TypeError", "gm:", "BK-1"),
        "cap_not_callable": ("TypeError", "bucket_cap_mb_by_bucket_idx", "BK-3"),
        "cap_negative": ("ValueError", "bucket_cap_mb_by_bucket_idx", "BK-3"),
        "cap_nan": ("ValueError", "bucket_cap_mb_by_bucket_idx", "BK-3"),
        "no_meta": ("ValueError", "meta['val']", "BK-1"),
        "mixed_rs": ("ValueError", "mixed_dtypes", "BK-12"),
        "mixed_ar": ("ValueError", "mixed_dtypes", "BK-12"),
        "kind": ("ValueError", "kind", "BK-2"),
    }
    for case, words in expect.items():
        for word in words:
            assert word in messages[case], f"{case}: {messages[case]!r} lacks {word!r}"


def test_bk2_buckets_never_mix_keys():
    """BK-2: each bucket holds one group and dtype (all_gather), or one group, op and dtype."""
    for kind, program, args in [("all_gather", "interleaved", None),
                                ("reduce_scatter", "interleaved", None),
                                ("all_gather", "mixed_dtypes", None)]:
        plan = run_on_ranks(bucketing_rank.plan_of, 4, program, kind, 25, F32, args)[0]
        assert plan["names"], f"{kind} {program}: nothing bucketed"
        for keys in plan["keys"]:
            assert len(set(map(tuple, keys))) == 1, f"{kind} {program}: mixed keys {keys}"
    # Two groups: two buckets, never one.
    plan = run_on_ranks(bucketing_rank.plan_of, 4, "interleaved", "all_gather", 25)[0]
    assert len(plan["names"]) == 2 and all(len(b) == 3 for b in plan["names"])
    # The mixed_dtypes option drops the dtype from the key: one bucket of five.
    mixed = run_on_ranks(bucketing_rank.plan_of, 2, "mixed_dtypes", "all_gather", 25, F32,
                         None, True)[0]
    assert [len(b) for b in mixed["names"]] == [5]


def test_bk3_caps_close_buckets_and_are_asked_per_bucket_index():
    """BK-3: a bucket closes before the node that would pass its cap; cap(i) per index."""
    # fsdp_all_gather on 2 ranks, f32: gathered sizes (rows * 2 ranks * 3 * 4 bytes).
    sizes = [r * 2 * 3 * 4 for r in (3, 5, 1, 4, 2, 6)]       # 72 120 24 96 48 144
    caps_bytes = {0: 200, 1: 130, 2: 10_000}
    plan = run_on_ranks(bucketing_rank.plan_of, 2, "fsdp_all_gather", "all_gather",
                        lambda_caps(caps_bytes))[0]
    flat = [s for b in plan["sizes"] for s in b]
    assert set(flat) <= set(sizes)
    # Bucket 0 (cap 200): 72+120 = 192, next would pass. Bucket 1 (cap 130): 24+96 = 120.
    # Bucket 2: 48+144.
    assert plan["sizes"] == [[72, 120], [24, 96], [48, 144]]
    assert plan["asked"] == [0, 1, 2]
    for index, bucket in enumerate(plan["sizes"]):
        assert sum(bucket) <= caps_bytes[index]


def lambda_caps(caps_bytes):
    return functools.partial(_cap_of, caps_bytes)


def _cap_of(caps_bytes, index):
    return caps_bytes[index] / (1024 * 1024)


def test_bk3_a_node_larger_than_the_cap_sits_alone():
    """BK-3, BK-5: with a cap below every node, each bucket holds one node: nothing merges."""
    plan = run_on_ranks(bucketing_rank.plan_of, 2, "fsdp_all_gather", "all_gather", 1e-6)[0]
    assert plan["names"] == []
    assert plan["asked"] == [0, 1, 2, 3, 4, 5]


def test_bk4_a_dependent_node_never_joins_the_bucket_it_depends_on():
    """BK-4: in `chain`, gc depends on ga and ge on gb: only ga, gb, gd merge."""
    plan = run_on_ranks(bucketing_rank.plan_of, 2, "chain", "all_gather", 25)[0]
    assert len(plan["names"]) == 1 and len(plan["names"][0]) == 3




def test_bk5_nothing_to_merge_leaves_the_graph_unchanged():
    """BK-5: a graph whose buckets all have one node is not rewritten."""
    result = run_on_ranks(bucketing_rank.bucketed_text, 2, "fsdp_all_gather", AG, F32, None,
                          None, 1e-6)[0]
    assert result["unchanged"]


def test_bk6_decisions_are_the_same_on_every_rank():
    """BK-6: on non-contiguous subgroups every rank merges the same way (functional form)."""
    results = run_on_ranks(bucketing_rank.bucketed_text, 4, "interleaved", AG, F32,
                           {"use_out_variant": False})
    structure = [r["canonical"].replace("ranks[0,2]", "G").replace("ranks[1,3]", "G")
                 for r in results]
    assert len(set(structure)) == 1


def test_bk7_bk8_bk9_merged_all_gather_graph():
    """BK-7..BK-9: copy-in at the group index, one gather, one wait, casts in one copy."""
    text = run_on_ranks(bucketing_rank.bucketed_text, 4, "fsdp_all_gather", AG, BF16, None,
                        {"cast": True, "rows": (3, 1), "group": ROWS_2x2})[3]["canonical"]
    # Rank 3 is index 1 of group [1, 3]: its slot is elements [12, 24) of the 24 gathered.
    assert text == """\
%0 = input : f32[3, 3]
%1 = input : f32[1, 3]
%2 = aten.empty.memory_format([24], dtype=bf16, device=device(cpu), pin_memory=False) : bf16[24]
%3 = aten.slice.Tensor(%2, 0, 12, 24) : bf16[12]
%4 = aten.view(%0, [-1]) : f32[9]
%5 = aten.view(%1, [-1]) : f32[3]
%6 = aten.cat([%4, %5]) : f32[12]
%7 = aten.copy_(%3, %6) : bf16[12]
%8 = funcol.all_gather_into_tensor_out(%7, 2, ranks[1,3], out=%2) : bf16[24]
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
return [%19, %21]"""


def test_bk17_blocks_number_on_across_passes_and_cover_all_reduce():
    """BK-17: a second pass numbers its buckets on; all_reduce buckets are blocks too."""
    result = run_on_ranks(bucketing_rank.block_tags_after_two_passes, 2)[1]
    assert [run.split(":")[0] for run in result["first"]] == [
        "all_gather 0", "all_gather_wait 0", "- 4", "all_gather 1", "all_gather_wait 1", "- 4"]
    # The first pass's blocks joined the block that merged their collectives.
    assert [run.split(":")[0] for run in result["second"]] == [
        "all_gather 2", "all_gather_wait 2", "- 4", "all_gather_wait 2", "- 4"]
    assert [run.split(":")[0] for run in result["all_reduce"]] == [
        "- 3", "all_reduce 0", "all_reduce_wait 0", "- 3"]


def test_bk16_arguments_given_by_keyword_are_read_by_name():
    for result in run_on_ranks(bucketing_rank.keyword_arguments, 2):
        assert result == {"mismatch": "", "collectives": 1}


def test_bk18_deduplicate_waits_refuses_anything_but_a_graph_module():
    from refimpl.bucketing import deduplicate_waits

    with pytest.raises(TypeError, match=r"^gm: expected a torch.fx.GraphModule, got str "
                                        r"\[BK-18\]"):
        deduplicate_waits("graph")
