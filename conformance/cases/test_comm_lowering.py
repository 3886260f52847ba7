"""Conformance section "comm lowering" (SPEC.md section 2, CL).

Each case lowers one program (conformance/lowering_programs.py) and checks
- its comm trace against an inline golden: the lowered program's collectives and waits,
  in order, with buffer identities (any backend: refimpl from its lowered FX graph, torch
  from Inductor's wrapper code), traced on a fake process group of 2;
- for backends that give the lowered graph (`lowered_graph`), its canonical text;
- numerics: on 2 gloo ranks, the lowered program gives the values of the eager program.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline

from conformance import harness
from conformance.canonical import canonical_graph
from conformance.comm_trace import format_comm_trace
from conformance.lowering_programs import PROGRAMS, inputs_for, numeric_check

ONE_SHOT = {"auto_select": True, "enable_symm_mem_for": ["0"]}


@pytest.fixture
def fake_world():
    """A fake process group of 2 in this process for tracing, unless one exists already."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    if created:
        dist.destroy_process_group()


def _program(backend, name):
    return functools.partial(PROGRAMS[name], backend.require("functional_collectives"))


def comm_trace(backend, name, shapes, options=None) -> str:
    ns = backend.require("lowering", "lowered_comm_trace")
    events = ns.lowered_comm_trace(_program(backend, name), inputs_for(0, shapes),
                                   dict(options or {}))
    return format_comm_trace(events)


def lowered_text(backend, name, shapes, options=None) -> str | None:
    """Canonical text of the lowered graph, or None for backends without one."""
    ns = backend.require("lowering")
    if getattr(ns, "lowered_graph", None) is None:
        return None
    return canonical_graph(ns.lowered_graph(_program(backend, name), inputs_for(0, shapes),
                                            dict(options or {})))


def check_numerics(backend, name, shapes, options=None, world_size=2):
    results = harness.run(backend, numeric_check, world_size, name, shapes,
                          dict(options or {}))
    for rank, (want, got) in enumerate(results):
        torch.testing.assert_close(got, want, msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.spec("CL-1", "CL-2", "CL-9", "CL-15")
def test_all_reduce_of_graph_input_is_cloned(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "ar_graph_input", [(4,)]), """\
all_reduce_ in-place ranks[0,1] sum in=b0:f32[4]=copy(b1=input)
wait b0
all_gather_into_tensor out-of-place ranks[0,1] in=b1:f32[4] out=b2:f32[8]
wait b2""")
    graph = lowered_text(backend, "ar_graph_input", [(4,)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = aten.clone(%0, memory_format=torch.contiguous_format) : f32[4]
%2 = funcol.all_reduce_(%1, 'sum', ranks[0,1]) : f32[4]
%3 = funcol.wait_tensor_(%2) : f32[4]
%4 = funcol.all_gather_into_tensor(%0, 2, ranks[0,1]) : f32[8]
%5 = funcol.wait_tensor_(%4) : f32[8]
return [%3, %5]""")
    check_numerics(backend, "ar_graph_input", [(4,)])


@pytest.mark.spec("CL-3", "CL-9", "CL-15")
def test_all_reduce_of_unshared_intermediate_runs_in_place(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "ar_intermediate", [(4,)]), """\
all_reduce_ in-place ranks[0,1] sum in=b0:f32[4]=computed
wait b0""")
    graph = lowered_text(backend, "ar_intermediate", [(4,)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = aten.mul.Tensor(%0, 2) : f32[4]
%2 = funcol.all_reduce_(%1, 'sum', ranks[0,1]) : f32[4]
%3 = funcol.wait_tensor_(%2) : f32[4]
return %3""")
    check_numerics(backend, "ar_intermediate", [(4,)])


@pytest.mark.spec("CL-2", "CL-3", "CL-15")
def test_all_reduce_of_shared_intermediate_is_cloned(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "ar_intermediate_shared", [(4,)]), """\
all_reduce_ in-place ranks[0,1] sum in=b0:f32[4]=copy(b1=computed)
wait b0""")
    graph = lowered_text(backend, "ar_intermediate_shared", [(4,)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = aten.mul.Tensor(%0, 2) : f32[4]
%2 = aten.clone(%1, memory_format=torch.contiguous_format) : f32[4]
%3 = funcol.all_reduce_(%2, 'sum', ranks[0,1]) : f32[4]
%4 = funcol.wait_tensor_(%3) : f32[4]
%5 = aten.add.Tensor(%4, %1) : f32[4]
return %5""")
    check_numerics(backend, "ar_intermediate_shared", [(4,)])


@pytest.mark.spec("CL-4", "CL-9", "CL-15")
def test_all_reduce_inplace_stays_in_place(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "ar_inplace", [(4,)]), """\
all_reduce_ in-place ranks[0,1] sum in=b0:f32[4]=computed
wait b0""")
    graph = lowered_text(backend, "ar_inplace", [(4,)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = aten.mul.Tensor(%0, 2) : f32[4]
%2 = funcol.all_reduce_(%1, 'sum', ranks[0,1]) : f32[4]
%3 = funcol.wait_tensor_(%2) : f32[4]
%4 = aten.add.Tensor(%2, 1) : f32[4]
return %4""")
    check_numerics(backend, "ar_inplace", [(4,)])


@pytest.mark.spec("CL-5", "CL-3", "CL-9", "CL-15")
def test_all_reduce_coalesced_becomes_clones_plus_inplace(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "ar_coalesced", [(4,), (2, 3)]), """\
all_reduce_coalesced_ in-place ranks[0,1] sum in=b0:f32[4]=copy(b1=input),b2:f32[2, 3]=computed
wait b0
wait b2""")
    graph = lowered_text(backend, "ar_coalesced", [(4,), (2, 3)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = input : f32[2, 3]
%2 = aten.mul.Tensor(%1, 2) : f32[2, 3]
%3 = aten.clone(%0, memory_format=torch.contiguous_format) : f32[4]
%4 = funcol.all_reduce_coalesced_([%3, %2], 'sum', ranks[0,1]) : (f32[4], f32[2, 3])
%5 = getitem(%4, 0) : f32[4]
%6 = getitem(%4, 1) : f32[2, 3]
%7 = funcol.wait_tensor_(%5) : f32[4]
%8 = funcol.wait_tensor_(%6) : f32[2, 3]
return [%7, %8]""")
    check_numerics(backend, "ar_coalesced", [(4,), (2, 3)])


@pytest.mark.spec("CL-6", "CL-9", "CL-15")
def test_all_gather_is_out_of_place(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "all_gather", [(4, 2)]), """\
all_gather_into_tensor out-of-place ranks[0,1] in=b0:f32[4, 2]=input out=b1:f32[8, 2]
wait b1""")
    graph = lowered_text(backend, "all_gather", [(4, 2)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4, 2]
%1 = funcol.all_gather_into_tensor(%0, 2, ranks[0,1]) : f32[8, 2]
%2 = funcol.wait_tensor_(%1) : f32[8, 2]
return %2""")
    check_numerics(backend, "all_gather", [(4, 2)])


@pytest.mark.spec("CL-6", "CL-9", "CL-15")
def test_reduce_scatter_is_out_of_place(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "reduce_scatter", [(4, 2)]), """\
reduce_scatter_tensor out-of-place ranks[0,1] sum in=b0:f32[4, 2]=input out=b1:f32[2, 2]
wait b1""")
    graph = lowered_text(backend, "reduce_scatter", [(4, 2)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4, 2]
%1 = funcol.reduce_scatter_tensor(%0, 'sum', 2, ranks[0,1]) : f32[2, 2]
%2 = funcol.wait_tensor_(%1) : f32[2, 2]
return %2""")
    check_numerics(backend, "reduce_scatter", [(4, 2)])


@pytest.mark.spec("CL-6", "CL-9", "CL-15")
def test_all_to_all_single_is_out_of_place(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "all_to_all", [(4, 2)]), """\
all_to_all_single out-of-place ranks[0,1] in=b0:f32[4, 2]=input out=b1:f32[4, 2]
wait b1""")
    graph = lowered_text(backend, "all_to_all", [(4, 2)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4, 2]
%1 = funcol.all_to_all_single(%0, [2, 2], [2, 2], ranks[0,1]) : f32[4, 2]
%2 = funcol.wait_tensor_(%1) : f32[4, 2]
return %2""")
    check_numerics(backend, "all_to_all", [(4, 2)])


@pytest.mark.spec("CL-6", "CL-9", "CL-15")
def test_coalesced_all_gather_is_out_of_place(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "all_gather_coalesced", [(4,), (2, 3)]), """\
all_gather_into_tensor_coalesced out-of-place ranks[0,1] in=b0:f32[4]=input,b1:f32[2, 3]=input out=b2:f32[8],b3:f32[4, 3]
wait b2
wait b3""")  # noqa: E501
    graph = lowered_text(backend, "all_gather_coalesced", [(4,), (2, 3)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = input : f32[2, 3]
%2 = funcol.all_gather_into_tensor_coalesced([%0, %1], 2, ranks[0,1]) : (f32[8], f32[4, 3])
%3 = getitem(%2, 0) : f32[8]
%4 = getitem(%2, 1) : f32[4, 3]
%5 = funcol.wait_tensor_(%3) : f32[8]
%6 = funcol.wait_tensor_(%4) : f32[4, 3]
return [%5, %6]""")
    check_numerics(backend, "all_gather_coalesced", [(4,), (2, 3)])


@pytest.mark.spec("CL-6", "CL-9", "CL-15")
def test_coalesced_reduce_scatter_is_out_of_place(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "reduce_scatter_coalesced", [(4,), (2, 3)]),
                           """\
reduce_scatter_tensor_coalesced out-of-place ranks[0,1] sum in=b0:f32[4]=input,b1:f32[2, 3]=input out=b2:f32[2],b3:f32[1, 3]
wait b2
wait b3""")  # noqa: E501
    graph = lowered_text(backend, "reduce_scatter_coalesced", [(4,), (2, 3)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = input : f32[2, 3]
%2 = funcol.reduce_scatter_tensor_coalesced([%0, %1], 'sum', 2, ranks[0,1]) : (f32[2], f32[1, 3])
%3 = getitem(%2, 0) : f32[2]
%4 = getitem(%2, 1) : f32[1, 3]
%5 = funcol.wait_tensor_(%3) : f32[2]
%6 = funcol.wait_tensor_(%4) : f32[1, 3]
return [%5, %6]""")
    check_numerics(backend, "reduce_scatter_coalesced", [(4,), (2, 3)])


@pytest.mark.spec("CL-7", "CL-9", "CL-15")
def test_all_gather_out_writes_into_out(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "all_gather_out", [(4,)]), """\
all_gather_into_tensor_out out-of-place ranks[0,1] in=b0:f32[4]=input out=b1:f32[8]
wait b1""")
    graph = lowered_text(backend, "all_gather_out", [(4,)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = aten.new_empty(%0, [8], pin_memory=False) : f32[8]
%2 = funcol.all_gather_into_tensor_out(%0, 2, ranks[0,1], out=%1) : f32[8]
%3 = funcol.wait_tensor_(%2) : f32[8]
%4 = aten.mul.Tensor(%2, 1) : f32[8]
return %4""")
    check_numerics(backend, "all_gather_out", [(4,)])


@pytest.mark.spec("CL-8", "CL-9", "CL-15")
def test_broadcast_becomes_clone_plus_inplace(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "broadcast", [(4,)]), """\
broadcast_ in-place ranks[0,1] in=b0:f32[4]=copy(b1=computed)
wait b0""")
    graph = lowered_text(backend, "broadcast", [(4,)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = aten.add.Tensor(%0, 1) : f32[4]
%2 = aten.clone(%1, memory_format=torch.contiguous_format) : f32[4]
%3 = funcol.broadcast_(%2, 1, ranks[0,1]) : f32[4]
%4 = funcol.wait_tensor_(%3) : f32[4]
return %4""")
    check_numerics(backend, "broadcast", [(4,)])


@pytest.mark.spec("CL-8", "CL-9", "CL-15")
def test_broadcast_inplace_stays_in_place(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "broadcast_inplace", [(4,)]), """\
broadcast_ in-place ranks[0,1] in=b0:f32[4]=computed
wait b0""")
    graph = lowered_text(backend, "broadcast_inplace", [(4,)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = aten.add.Tensor(%0, 1) : f32[4]
%2 = funcol.broadcast_(%1, 1, ranks[0,1]) : f32[4]
%3 = funcol.wait_tensor_(%2) : f32[4]
%4 = aten.mul.Tensor(%2, 1) : f32[4]
return %4""")
    check_numerics(backend, "broadcast_inplace", [(4,)])


# ---- one-shot all-reduce (CL-10 .. CL-14) -----------------------------------------------
@pytest.mark.spec("CL-10", "CL-11", "CL-9", "CL-15")
def test_small_sum_all_reduce_goes_one_shot(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "ar_small_intermediate", [(4,)], ONE_SHOT), """\
one_shot_all_reduce out-of-place ranks[0,1] sum in=b0:f32[4]=computed out=b1:f32[4]""")
    graph = lowered_text(backend, "ar_small_intermediate", [(4,)], ONE_SHOT)
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 3904172608337711648) : f32[4]
%2 = aten.mul.out(%0, 2, out=%1) : f32[4]
%3 = symm_mem.one_shot_all_reduce(%2, 'sum', ranks[0,1]) : f32[4]
%4 = aten.add.Tensor(%3, 1) : f32[4]
return %4""")  # noqa: E501
    check_numerics(backend, "ar_small_intermediate", [(4,)], ONE_SHOT)


@pytest.mark.spec("CL-14", "CL-10", "CL-9", "CL-15")
def test_small_sum_all_reduce_inplace_goes_one_shot(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "ar_inplace_small", [(4,)], ONE_SHOT), """\
one_shot_all_reduce out-of-place ranks[0,1] sum in=b0:f32[4]=computed out=b1:f32[4]""")
    graph = lowered_text(backend, "ar_inplace_small", [(4,)], ONE_SHOT)
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 7177605198679136942) : f32[4]
%2 = aten.mul.out(%0, 2, out=%1) : f32[4]
%3 = symm_mem.one_shot_all_reduce(%2, 'sum', ranks[0,1]) : f32[4]
%4 = aten.copy_(%2, %3) : f32[4]
%5 = aten.add.Tensor(%4, 1) : f32[4]
return %5""")  # noqa: E501
    check_numerics(backend, "ar_inplace_small", [(4,)], ONE_SHOT)


@pytest.mark.spec("CL-10")
@pytest.mark.parametrize("why", ["auto_select_off", "over_threshold", "avg", "graph_input"])
def test_one_shot_not_chosen(backend, fake_world, why):
    name, options = "ar_small_intermediate", dict(ONE_SHOT)
    if why == "auto_select_off":
        options["auto_select"] = False
    elif why == "over_threshold":
        options["one_shot_all_reduce_threshold_bytes"] = 15  # the input has 16 bytes
    elif why == "avg":
        name = "ar_small_avg"
    else:
        name = "ar_small_graph_input"
    trace = comm_trace(backend, name, [(4,)], options)
    assert "one_shot" not in trace
    assert trace.splitlines()[0].startswith("all_reduce_ in-place ranks[0,1]")
    assert trace.splitlines()[1] == "wait b0"
    check_numerics(backend, name, [(4,)], options)


@pytest.mark.spec("CL-15", "CL-2", "CL-5", "CL-6")
@pytest.mark.parametrize("name, shapes", [("ar_graph_input", [(4,)]),
                                          ("ar_coalesced", [(4,), (2, 3)]),
                                          ("reduce_scatter_coalesced", [(8,), (4, 3)])])
def test_lowered_values_on_four_ranks(backend, name, shapes):
    backend.require("lowering", "run_lowered")
    check_numerics(backend, name, shapes, world_size=4)
