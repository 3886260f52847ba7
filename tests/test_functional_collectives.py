"""Values of every functional collective on real gloo ranks against a single-process oracle.

FC-1, FC-2, FC-4, FC-13..FC-18, FC-20, FC-21, FC-22, FC-26: every op and API function,
every group form (non-contiguous subgroups included), float32 / bfloat16 / int64 where
the reduction allows, world sizes 2 and 4.
"""

from __future__ import annotations

import functools

import funcol_rank
import pytest
import torch

from conformance import oracle
from refimpl.multiprocess import run_on_ranks

FLOAT_REDUCTIONS = ["sum", "avg", "product", "min", "max"]
INT_REDUCTIONS = ["sum", "product", "min", "max", "band", "bor", "bxor"]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "i64": torch.int64}


def cases_for(dtype) -> list[str]:
    reductions = INT_REDUCTIONS if not dtype.is_floating_point else FLOAT_REDUCTIONS
    cases = [f"all_reduce:{op}" for op in reductions]
    cases += [f"all_reduce_:{op}" for op in reductions[:2]]
    cases += ["all_gather:0", "all_gather:1", "all_gather:-1", "all_gather_out"]
    cases += [f"reduce_scatter:{op}:{d}" for op in reductions[:2] for d in (0, 1, -1)]
    cases += ["all_to_all:equal", "all_to_all:uneven", "broadcast:0", "broadcast:1",
              "broadcast_:1"]
    cases += ["all_reduce_coalesced:sum", "all_reduce_coalesced_:max",
              "all_gather_coalesced", f"reduce_scatter_coalesced:{reductions[0]}"]
    return cases


@functools.cache
def results_of(world_size: int, form: str, dtype_name: str):
    dtype = DTYPES[dtype_name]
    return run_on_ranks(funcol_rank.run_cases, world_size, form, dtype, cases_for(dtype))


def expected(case: str, members: list[int], index: int, dtype):
    """The oracle's result for group rank `index` of `members`."""
    xs = [funcol_rank.input_for(case, r, dtype) for r in members]
    kind, *params = case.split(":")
    n = len(members)
    if kind in ("all_reduce", "all_reduce_"):
        return oracle.reduce(xs, params[0])
    if kind == "all_gather":
        return oracle.all_gather(xs, int(params[0]))
    if kind == "all_gather_out":
        return oracle.all_gather(xs, 0)
    if kind == "reduce_scatter":
        return oracle.reduce_scatter(xs, params[0], index, int(params[1]))
    if kind == "all_to_all":
        if params[0] == "equal":
            return oracle.all_to_all_single(xs, index)
        ins = [funcol_rank.uneven_splits(i, n)[0] for i in range(n)]
        rows = [x.reshape(-1, 1)[: sum(s)] for x, s in zip(xs, ins, strict=True)]
        return oracle.all_to_all_single(rows, index, ins)
    if kind in ("broadcast", "broadcast_"):
        return xs[int(params[0]) % n]
    if kind in ("all_reduce_coalesced", "all_reduce_coalesced_"):
        return [oracle.reduce(xs, params[0]), oracle.reduce([x * 2 for x in xs], params[0])]
    if kind == "all_gather_coalesced":
        return [oracle.all_gather(xs), oracle.all_gather([x + 1 for x in xs])]
    if kind == "reduce_scatter_coalesced":
        return [oracle.reduce_scatter(xs, params[0], index, 0),
                oracle.reduce_scatter([x * 3 for x in xs], params[0], index, 1)]
    raise ValueError(case)


def _assert_same(got, want, where):
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
        return
    assert type(got) is torch.Tensor, f"{where}: got {type(got).__name__}"
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{where}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}")
    assert torch.equal(got, want), f"{where}: got\n{got}\nwant\n{want}"


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("form", funcol_rank.GROUP_FORMS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_op_matches_the_oracle(world_size, form, dtype_name):
    dtype = DTYPES[dtype_name]
    for rank, result in enumerate(results_of(world_size, form, dtype_name)):
        if result is None:
            continue
        members, by_case, pending = result
        assert pending == 0, f"rank {rank}: {pending} results left unwaited [FC-6]"
        index = members.index(rank)
        for case in cases_for(dtype):
            status, got, input_unchanged = by_case[case]
            where = f"rank {rank} {case} ({form}, {dtype_name}, world {world_size})"
            assert status == "ok", f"{where}: {got}"
            assert input_unchanged, f"{where}: the input was modified [FC-2]"
            _assert_same(got, expected(case, members, index, dtype), where)


def test_non_member_ranks_sit_out_a_subgroup():
    results = results_of(4, "noncontig", "f32")
    assert results[0] is None and results[2] is None
    assert results[1][0] == [1, 3] and results[3][0] == [1, 3]
