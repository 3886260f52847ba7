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
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline

from conformance import harness, oracle
from conformance.canonical import canonical_graph
from conformance.comm_trace import format_comm_trace
from conformance.lowering_programs import (
    OTHER_GROUP,
    PROGRAMS,
    alloc_ids,
    alloc_ids_on_rank,
    called_twice,
    inputs_for,
    lowered_in_turn_on_rank,
    lowered_values,
    numeric_check,
    prepare,
)

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
    prepare(name)
    events = ns.lowered_comm_trace(_program(backend, name), inputs_for(0, shapes),
                                   dict(options or {}))
    return format_comm_trace(events)


def lowered_text(backend, name, shapes, options=None) -> str | None:
    """Canonical text of the lowered graph, or None for backends without one."""
    ns = backend.require("lowering")
    if getattr(ns, "lowered_graph", None) is None:
        return None
    prepare(name)
    return canonical_graph(ns.lowered_graph(_program(backend, name), inputs_for(0, shapes),
                                            dict(options or {})))


def check_numerics(backend, name, shapes, options=None, world_size=2):
    results = harness.run(backend, numeric_check, world_size, name, shapes,
                          dict(options or {}))
    for rank, (want, got, untrue_meta) in enumerate(results):
        torch.testing.assert_close(got, want, msg=lambda m, r=rank: f"rank {r}: {m}")
        assert untrue_meta == "", f"rank {rank}: {untrue_meta} [CL-1]"


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


@pytest.mark.spec("CL-18", "CL-9", "CL-15")
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


@pytest.mark.spec("CL-19", "CL-18", "CL-9", "CL-15")
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


@pytest.mark.spec("CL-19", "CL-9", "CL-15", "FC-35")
def test_a_wait_of_a_list_stays_the_wait_of_the_lowered_coalesced_all_reduce(backend,
                                                                           fake_world):
    """torch 2.15 traces the wait of a coalesced collective as one `wait_tensors`. Lowered,
    the coalesced all_reduce runs in place on a copy of the graph input (read again after)
    and on the intermediate (CL-5); the one wait is kept and completes both (CL-9), its
    results read by the rest as before; the comm trace prints it as a wait of each."""
    shapes = [(4,), (2, 3)]
    assert_expected_inline(comm_trace(backend, "ar_coalesced_waited_together", shapes), """\
all_reduce_coalesced_ in-place ranks[0,1] sum in=b0:f32[4]=copy(b1=input),b2:f32[2, 3]=computed
wait b0
wait b2""")
    graph = lowered_text(backend, "ar_coalesced_waited_together", shapes)
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = input : f32[2, 3]
%2 = aten.mul.Tensor(%1, 2) : f32[2, 3]
%3 = aten.clone(%0, memory_format=torch.contiguous_format) : f32[4]
%4 = funcol.all_reduce_coalesced_([%3, %2], 'sum', ranks[0,1]) : (f32[4], f32[2, 3])
%5 = getitem(%4, 0) : f32[4]
%6 = getitem(%4, 1) : f32[2, 3]
%7 = funcol.wait_tensors([%5, %6]) : (f32[4], f32[2, 3])
%8 = getitem(%7, 0) : f32[4]
%9 = getitem(%7, 1) : f32[2, 3]
%10 = aten.add.Tensor(%8, %0) : f32[4]
return [%10, %9]""")
    check_numerics(backend, "ar_coalesced_waited_together", shapes)


@pytest.mark.spec("CL-19", "CL-3", "CL-15")
def test_all_reduce_coalesced_of_one_tensor_twice_clones_it(backend, fake_world):
    """`y` is the coalesced all_reduce's only user but appears twice in its list: reduced
    in place for both members, each rank would get the sum of sums (5.0 for 3.0)."""
    trace = comm_trace(backend, "ar_coalesced_same_tensor_twice", [(4,)])
    # One buffer per member, whatever each is a copy of (upstream computes y twice).
    members = re.findall(r"(?:^|,)(b\d+):", trace.splitlines()[0].split(" in=", 1)[1])
    assert len(members) == 2 and members[0] != members[1], trace
    graph = lowered_text(backend, "ar_coalesced_same_tensor_twice", [(4,)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = aten.mul.Tensor(%0, 1) : f32[4]
%2 = aten.clone(%1, memory_format=torch.contiguous_format) : f32[4]
%3 = aten.clone(%1, memory_format=torch.contiguous_format) : f32[4]
%4 = funcol.all_reduce_coalesced_([%2, %3], 'sum', ranks[0,1]) : (f32[4], f32[4])
%5 = getitem(%4, 0) : f32[4]
%6 = getitem(%4, 1) : f32[4]
%7 = funcol.wait_tensor_(%5) : f32[4]
%8 = funcol.wait_tensor_(%6) : f32[4]
return [%7, %8]""")
    check_numerics(backend, "ar_coalesced_same_tensor_twice", [(4,)])


@pytest.mark.spec("CL-20", "CL-15", "FC-5")
@pytest.mark.parametrize("program", ["ar_inplace_wait_result_written",
                                     "ar_inplace_argument_written_after_wait"])
def test_a_wait_whose_result_or_argument_is_written_later_keeps_its_values(backend,
                                                                          fake_world, program):
    """Found by `--fuzz`: lowered to complete in place, such a wait let the write reach
    both buffers (relu(sum + 1) where the traced program gives relu(sum))."""
    check_numerics(backend, program, [(4,)])


@pytest.mark.spec("CL-5", "CL-9", "CL-15")
def test_all_reduce_coalesced_inplace_stays_in_place(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "ar_coalesced_inplace", [(4,), (2, 3)]), """\
all_reduce_coalesced_ in-place ranks[0,1] sum in=b0:f32[4]=computed,b1:f32[2, 3]=computed
wait b0
wait b1""")
    graph = lowered_text(backend, "ar_coalesced_inplace", [(4,), (2, 3)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = input : f32[2, 3]
%2 = aten.mul.Tensor(%0, 2) : f32[4]
%3 = aten.add.Tensor(%1, 1) : f32[2, 3]
%4 = funcol.all_reduce_coalesced_([%2, %3], 'sum', ranks[0,1]) : (f32[4], f32[2, 3])
%5 = getitem(%4, 0) : f32[4]
%6 = getitem(%4, 1) : f32[2, 3]
%7 = funcol.wait_tensor_(%5) : f32[4]
%8 = funcol.wait_tensor_(%6) : f32[2, 3]
%9 = aten.add.Tensor(%5, 1) : f32[4]
%10 = aten.mul.Tensor(%6, 3) : f32[2, 3]
return [%9, %10]""")
    check_numerics(backend, "ar_coalesced_inplace", [(4,), (2, 3)])


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
def test_point_to_point_ops_are_left_as_traced(backend, fake_world):
    """isend, irecv and batch_p2p_ops (CL-6's `as traced`): neither cloned, reinplaced nor
    moved; their waits kept; the lowered ring computes what the traced one does."""
    if not hasattr(backend.require("functional_collectives").ops, "batch_p2p_ops"):
        pytest.skip(f"torch {torch.__version__} has no functional isend / irecv")
    assert_expected_inline(comm_trace(backend, "point_to_point", [(4,), (2, 3)]), """\
isend out-of-place ranks[0,1] in=b0:f32[4]=computed out=b1:f32[0]
irecv out-of-place ranks[0,1] in=b2:f32[4]=computed out=b3:f32[4]
batch_p2p_ops out-of-place ranks[0,1] in=b4:f32[2, 3]=computed,b5:f32[2, 3]=computed out=b6:f32[2, 3],b7:f32[0]
wait b1
wait b7
wait b3
wait b6""")  # noqa: E501
    graph = lowered_text(backend, "point_to_point", [(4,), (2, 3)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = input : f32[2, 3]
%2 = aten.mul.Tensor(%0, 2) : f32[4]
%3 = funcol.isend(%2, 1, 0, ranks[0,1]) : f32[0]
%4 = aten.zeros_like(%0, pin_memory=False) : f32[4]
%5 = funcol.irecv(%4, 1, 0, ranks[0,1]) : f32[4]
%6 = aten.zeros_like(%1, pin_memory=False) : f32[2, 3]
%7 = aten.add.Tensor(%1, 1) : f32[2, 3]
%8 = funcol.batch_p2p_ops(['irecv', 'isend'], [1, 1], [1, 1], [%6, %7], ranks[0,1]) : (f32[2, 3], f32[0])
%9 = getitem(%8, 0) : f32[2, 3]
%10 = getitem(%8, 1) : f32[0]
%11 = funcol.wait_tensor_(%3) : f32[0]
%12 = funcol.wait_tensor_(%10) : f32[0]
%13 = funcol.wait_tensor_(%5) : f32[4]
%14 = aten.add.Tensor(%13, 0) : f32[4]
%15 = funcol.wait_tensor_(%9) : f32[2, 3]
%16 = aten.add.Tensor(%15, 0) : f32[2, 3]
return [%14, %16]""")  # noqa: E501
    check_numerics(backend, "point_to_point", [(4,), (2, 3)])


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
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 9072673292006092717) : f32[4]
%2 = aten.mul.out(%0, 2, out=%1) : f32[4]
%3 = symm_mem.one_shot_all_reduce(%2, 'sum', ranks[0,1]) : f32[4]
%4 = aten.add.Tensor(%3, 1) : f32[4]
return %4""")  # noqa: E501
    check_numerics(backend, "ar_small_intermediate", [(4,)], ONE_SHOT)


@pytest.mark.spec("CL-21")
def test_force_one_shot_alone_lowers_one_shot(backend, fake_world):
    """`force_one_shot_all_reduce` needs no `auto_select`: on its own it lowers every
    all_reduce one-shot (or refuses, CL-10's other half)."""
    forced = {"force_one_shot_all_reduce": True, "enable_symm_mem_for": ["0"]}
    assert_expected_inline(comm_trace(backend, "ar_small_intermediate", [(4,)], forced), """\
one_shot_all_reduce out-of-place ranks[0,1] sum in=b0:f32[4]=computed out=b1:f32[4]""")


@pytest.mark.spec("CL-14", "CL-10", "CL-9", "CL-15")
def test_small_sum_all_reduce_inplace_goes_one_shot(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "ar_inplace_small", [(4,)], ONE_SHOT), """\
one_shot_all_reduce out-of-place ranks[0,1] sum in=b0:f32[4]=computed out=b1:f32[4]""")
    graph = lowered_text(backend, "ar_inplace_small", [(4,)], ONE_SHOT)
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 162779291597058115) : f32[4]
%2 = aten.mul.out(%0, 2, out=%1) : f32[4]
%3 = symm_mem.one_shot_all_reduce(%2, 'sum', ranks[0,1]) : f32[4]
%4 = aten.copy_(%2, %3) : f32[4]
%5 = aten.add.Tensor(%4, 1) : f32[4]
return %5""")  # noqa: E501
    check_numerics(backend, "ar_inplace_small", [(4,)], ONE_SHOT)


@pytest.mark.spec("CL-10", "CL-11", "CL-9", "CL-15")
def test_one_shot_threshold_is_inclusive(backend, fake_world):
    # The input has 16 bytes: a threshold of exactly 16 still goes one-shot.
    options = {**ONE_SHOT, "one_shot_all_reduce_threshold_bytes": 16}
    assert_expected_inline(comm_trace(backend, "ar_small_intermediate", [(4,)], options), """\
one_shot_all_reduce out-of-place ranks[0,1] sum in=b0:f32[4]=computed out=b1:f32[4]""")
    check_numerics(backend, "ar_small_intermediate", [(4,)], options)


@pytest.mark.spec("CL-1", "CL-10")
@pytest.mark.parametrize("elements, one_shot", [(32768, True), (32769, False)],
                         ids=["at_128_kib", "one_element_over"])
def test_default_threshold_is_128_kib(backend, fake_world, elements, one_shot):
    # The config's default threshold (CL-1): a float32 input of exactly 128 KiB goes
    # one-shot, one element more does not.
    trace = comm_trace(backend, "ar_small_intermediate", [(elements,)], ONE_SHOT)
    assert ("one_shot" in trace) == one_shot, \
        f"{elements * 4} bytes under the default threshold of 128 KiB:\n{trace}"


@pytest.mark.spec("CL-11", "CL-15")
def test_a_comm_buffer_producer_gets_the_out_overload_of_its_own_arguments(backend,
                                                                           fake_world):
    # x.sum() is realized through sum.out (self, dtype), not through the first out=
    # overload of aten.sum (IntList_out takes dims): the value is the sum all-reduced.
    trace = comm_trace(backend, "ar_small_sum_of", [(4,)], ONE_SHOT)
    assert "one_shot" in trace, trace
    check_numerics(backend, "ar_small_sum_of", [(4,)], ONE_SHOT)


# Each condition of CL-10 failing alone: (program, options, the reduced buffer's origin:
# in place on the intermediate by CL-3, or a copy by CL-2).
NOT_ONE_SHOT = {
    "auto_select_off": ("ar_small_intermediate", {**ONE_SHOT, "auto_select": False},
                        "computed"),
    "one_byte_over_threshold": ("ar_small_intermediate",  # the input has 16 bytes
                                {**ONE_SHOT, "one_shot_all_reduce_threshold_bytes": 15},
                                "computed"),
    "avg": ("ar_small_avg", ONE_SHOT, "computed"),
    "max": ("ar_small_max", ONE_SHOT, "computed"),
    "float64": ("ar_small_f64", ONE_SHOT, "computed"),
    "no_symm_mem_on_group": ("ar_small_other_group", ONE_SHOT, "computed"),
    "graph_input": ("ar_small_graph_input", ONE_SHOT, "copy(b1=input)"),
    "view": ("ar_small_view", ONE_SHOT, "copy(b1=computed)"),
}


@pytest.mark.spec("CL-10", "CL-11", "CL-2", "CL-3", "CL-15")
@pytest.mark.parametrize("why", list(NOT_ONE_SHOT))
def test_one_shot_not_chosen(backend, fake_world, why):
    name, options, origin = NOT_ONE_SHOT[why]
    trace = comm_trace(backend, name, [(4,)], options)
    assert "one_shot" not in trace
    first = trace.splitlines()[0]
    assert re.fullmatch(rf"all_reduce_ in-place ranks\[0,1\] \w+ in=b0:f\d\d\[[\d, ]+\]="
                        rf"{re.escape(origin)}", first), trace
    assert trace.splitlines()[1] == "wait b0"
    check_numerics(backend, name, [(4,)], options)


@pytest.mark.spec("CL-15", "CL-3", "CL-10")
@pytest.mark.parametrize("options", [{}, ONE_SHOT], ids=["plain", "auto_select"])
def test_all_reduce_of_one_result_of_a_multi_output_op(backend, fake_world, options):
    # The reduced tensor is an FX getitem of `max.dim`'s pair, a node whose target is no
    # ATen op: whether it is reduced in place or cloned, lowering takes it.
    check_numerics(backend, "ar_of_one_result_of_two", [(3, 4)], options)


@pytest.mark.spec("CL-15", "CL-2", "CL-19", "CL-6")
@pytest.mark.parametrize("name, shapes", [("ar_graph_input", [(4,)]),
                                          ("ar_coalesced", [(4,), (2, 3)]),
                                          ("reduce_scatter_coalesced", [(8,), (4, 3)])])
def test_lowered_values_on_four_ranks(backend, name, shapes):
    backend.require("lowering", "run_lowered")
    check_numerics(backend, name, shapes, world_size=4)


@pytest.mark.spec("CL-15", "CL-8", "CL-10", "CL-14")
@pytest.mark.parametrize("name, options", [("broadcast", {}),
                                           ("ar_small_intermediate", ONE_SHOT),
                                           ("ar_inplace_small", ONE_SHOT)])
def test_more_lowered_values_on_four_ranks(backend, name, options):
    backend.require("lowering", "run_lowered")
    check_numerics(backend, name, [(4,)], options, world_size=4)


# ---- CL-3: only a contiguous intermediate with no other reader is reduced in place ------
@pytest.mark.spec("CL-3", "CL-2", "CL-15")
def test_all_reduce_of_intermediate_read_before_is_cloned(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "ar_intermediate_read_before", [(4,)]), """\
all_reduce_ in-place ranks[0,1] sum in=b0:f32[4]=copy(b1=computed)
wait b0""")
    check_numerics(backend, "ar_intermediate_read_before", [(4,)])


@pytest.mark.spec("CL-3", "CL-2", "CL-15")
def test_all_reduce_of_non_contiguous_intermediate_is_cloned(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "ar_non_contiguous_intermediate", [(2, 3)]),
                           """\
all_reduce_ in-place ranks[0,1] sum in=b0:f32[3, 2]=copy(b1=computed)
wait b0""")
    check_numerics(backend, "ar_non_contiguous_intermediate", [(2, 3)])


# ---- CL-4, CL-6: non-contiguous inputs --------------------------------------------------
def check_against_oracle(backend, name, shapes, want):
    """For programs that cannot run eagerly (FC-4 refuses an in-place collective on a
    view): every rank's lowered result against what the program means."""
    for rank, got in enumerate(harness.run(backend, lowered_values, 2, name, shapes, {})):
        torch.testing.assert_close(got, want, msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.spec("CL-4", "CL-9", "CL-15")
def test_all_reduce_inplace_on_a_view_reduces_a_copy_and_copies_back(backend, fake_world):
    name = "ar_inplace_non_contiguous"
    assert_expected_inline(comm_trace(backend, name, [(2, 3)]), """\
all_reduce_ in-place ranks[0,1] sum in=b0:f32[3, 2]=copy(b1=computed)
wait b0""")
    graph = lowered_text(backend, name, [(2, 3)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[2, 3]
%1 = aten.mul.Tensor(%0, 2) : f32[2, 3]
%2 = aten.t(%1) : f32[3, 2]
%3 = aten.clone(%2, memory_format=torch.contiguous_format) : f32[3, 2]
%4 = funcol.all_reduce_(%3, 'sum', ranks[0,1]) : f32[3, 2]
%5 = funcol.wait_tensor_(%4) : f32[3, 2]
%6 = aten.copy_(%2, %5) : f32[3, 2]
%7 = aten.add.Tensor(%1, 1) : f32[2, 3]
return %7""")
    xs = [inputs_for(r, [(2, 3)])[0] for r in range(2)]
    check_against_oracle(backend, name, [(2, 3)], oracle.reduce([x * 2 for x in xs], "sum") + 1)


@pytest.mark.spec("CL-4", "CL-9", "CL-15")
def test_broadcast_inplace_on_a_view_copies_back(backend, fake_world):
    name = "broadcast_inplace_non_contiguous"
    assert_expected_inline(comm_trace(backend, name, [(2, 3)]), """\
broadcast_ in-place ranks[0,1] in=b0:f32[3, 2]=copy(b1=computed)
wait b0""")
    graph = lowered_text(backend, name, [(2, 3)])
    if graph is not None:
        assert_expected_inline(graph, """\
%0 = input : f32[2, 3]
%1 = aten.add.Tensor(%0, 1) : f32[2, 3]
%2 = aten.t(%1) : f32[3, 2]
%3 = aten.clone(%2, memory_format=torch.contiguous_format) : f32[3, 2]
%4 = funcol.broadcast_(%3, 1, ranks[0,1]) : f32[3, 2]
%5 = funcol.wait_tensor_(%4) : f32[3, 2]
%6 = aten.copy_(%2, %5) : f32[3, 2]
%7 = aten.mul.Tensor(%1, 1) : f32[2, 3]
return %7""")
    xs = [inputs_for(r, [(2, 3)])[0] for r in range(2)]
    check_against_oracle(backend, name, [(2, 3)], xs[1] + 1)  # from group rank 1


@pytest.mark.spec("CL-6", "CL-9", "CL-15")
def test_all_gather_reads_a_contiguous_copy_of_a_view(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "all_gather_non_contiguous", [(2, 4)]), """\
all_gather_into_tensor out-of-place ranks[0,1] in=b0:f32[4, 2]=copy(b1=input) out=b2:f32[8, 2]
wait b2""")
    check_numerics(backend, "all_gather_non_contiguous", [(2, 4)])


@pytest.mark.spec("CL-6", "CL-9", "CL-15")
def test_reduce_scatter_reads_a_contiguous_copy_of_a_view(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "reduce_scatter_non_contiguous", [(2, 4)]), """\
reduce_scatter_tensor out-of-place ranks[0,1] sum in=b0:f32[4, 2]=copy(b1=input) out=b2:f32[2, 2]
wait b2""")
    check_numerics(backend, "reduce_scatter_non_contiguous", [(2, 4)])


@pytest.mark.spec("CL-6", "CL-9", "CL-15")
def test_the_gather_op_reads_a_contiguous_copy_of_a_view(backend, fake_world):
    """The op called on a transposed view (the API copies it before; the op does not)."""
    assert_expected_inline(comm_trace(backend, "all_gather_op_non_contiguous", [(2, 4)]), """\
all_gather_into_tensor out-of-place ranks[0,1] in=b0:f32[4, 2]=copy(b1=input) out=b2:f32[8, 2]
wait b2""")
    check_numerics(backend, "all_gather_op_non_contiguous", [(2, 4)])


@pytest.mark.spec("CL-6", "CL-9", "CL-15")
def test_the_scatter_op_reads_a_contiguous_copy_of_a_view(backend, fake_world):
    assert_expected_inline(comm_trace(backend, "reduce_scatter_op_non_contiguous", [(2, 4)]),
                           """\
reduce_scatter_tensor out-of-place ranks[0,1] sum in=b0:f32[4, 2]=copy(b1=input) out=b2:f32[2, 2]
wait b2""")
    check_numerics(backend, "reduce_scatter_op_non_contiguous", [(2, 4)])


# The coalesced out-of-place ops on a list with one transposed member (first or second):
# FX keeps the list argument as an immutable_list, not a tuple, and each member is copied
# or passed as it is on its own (CL-6).
COALESCED_VIEWS = {
    "all_gather": lambda ops, xs: ops.all_gather_into_tensor_coalesced(xs, 2, "0"),
    "reduce_scatter": lambda ops, xs: ops.reduce_scatter_tensor_coalesced(xs, "sum", 2, "0"),
}
COALESCED_VIEW_DTYPES = (torch.float32, torch.bfloat16, torch.int32)


def _coalesced_with_a_view(fc, kind, view_at):
    """`kind`'s coalesced op on [a.t(), b] (view_at 0) or [b, a.t()] (view_at 1), waited."""
    def program(a, b):
        members = [a.t(), b] if view_at == 0 else [b, a.t()]
        return [fc.ops.wait_tensor(t) for t in COALESCED_VIEWS[kind](fc.ops, members)]

    return program


def _coalesced_view_inputs(rank, dtype):
    return [oracle.rank_input(rank, shape, dtype, salt=190 + i)
            for i, shape in enumerate([(2, 4), (4,)])]


def _coalesced_views_on_rank(spec: str, kind: str) -> list:
    """On one rank: (eager, lowered) results of `kind` per dtype and view position."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    ns = backend.require("lowering", "run_lowered")
    fc = backend.require("functional_collectives")
    results = []
    for dtype in COALESCED_VIEW_DTYPES:
        for view_at in (0, 1):
            program = _coalesced_with_a_view(fc, kind, view_at)
            inputs = _coalesced_view_inputs(dist.get_rank(), dtype)
            want = [t.clone() for t in program(*[t.clone() for t in inputs])]
            got = [t.clone() for t in ns.run_lowered(program, [t.clone() for t in inputs])]
            results.append((str(dtype), view_at, want, got))
    return results


@pytest.mark.spec("CL-6", "CL-15")
@pytest.mark.parametrize("kind", list(COALESCED_VIEWS))
def test_a_coalesced_op_reads_a_contiguous_copy_of_its_view_member(backend, fake_world, kind):
    """Each member of a coalesced out-of-place collective's list is one input: the
    transposed one is read through a contiguous copy, the contiguous one as it is, in
    float32, bfloat16 and int32, whichever place of the list the view holds; every rank's
    values are the eager program's."""
    ns = backend.require("lowering", "lowered_comm_trace")
    fc = backend.require("functional_collectives")
    for dtype in COALESCED_VIEW_DTYPES:
        for view_at in (0, 1):
            events = ns.lowered_comm_trace(_coalesced_with_a_view(fc, kind, view_at),
                                           _coalesced_view_inputs(0, dtype), {})
            (collective,) = [e for e in events if e.op != "wait"]
            origins = [i.split("=", 1)[1] for i in collective.inputs]
            assert len(origins) == 2 and origins[1 - view_at] == "input" \
                and re.fullmatch(r"copy\(b\d+=input\)", origins[view_at]), \
                f"{kind} {dtype}, view at {view_at}: {format_comm_trace(events)}\n" \
                f"the transposed member must be read through a contiguous copy [CL-6]"
    for rank, results in enumerate(harness.run(backend, _coalesced_views_on_rank, 2, kind)):
        for dtype, view_at, want, got in results:
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, r=rank, d=dtype,
                                       v=view_at: f"rank {r} {d} view at {v}: {m}")


# ---- CL-12, CL-13: persistent comm buffers ----------------------------------------------
@pytest.mark.spec("CL-12")
def test_alloc_ids_are_equal_on_every_rank_and_distinct_where_they_must_be(backend):
    backend.require("lowering", "lowered_graph")
    lowerings = [("ar_two_small", ONE_SHOT, (4,)), ("ar_two_small", ONE_SHOT, (4,)),
                 ("ar_two_small", {**ONE_SHOT, "alloc_id_namespace": "layer1"}, (4,)),
                 ("ar_small_intermediate", ONE_SHOT, (4,)), ("ar_inplace_small", ONE_SHOT, (4,)),
                 ("ar_two_small", ONE_SHOT, (6,)),
                 # a group whose name differs between the ranks, in the graph too
                 ("ar_beside_a_row_group", ONE_SHOT, (4,)),
                 # a broadcast's root (`src`, as a receive names its peer): one on every rank
                 ("ar_beside_a_broadcast", ONE_SHOT, (4,))]
    ranks = harness.run(backend, alloc_ids_on_rank, 2, lowerings)
    assert ranks[0] == ranks[1], f"alloc_ids differ between ranks: {ranks}"
    two, again, namespaced, one, other_graph, other_shape, beside, broadcast = ranks[0]
    assert len(beside) == 1 and len(broadcast) == 1
    assert len(two) == 2 and len(set(two)) == 2, f"buffers of one graph share an id: {two}"
    assert again == two, "lowering the same graph again changed its alloc_ids"
    assert not set(namespaced) & set(two), "alloc_id_namespace did not change the ids"
    assert len(one) == 1 and len(other_graph) == 1
    assert not set(one) & set(two) and one != other_graph, "two graphs share an alloc_id"
    assert not set(other_shape) & set(two), "graphs that differ in a shape share an alloc_id"
    assert all(isinstance(i, int) and 0 <= i < 2**63 for ids in ranks[0] for i in ids)


@pytest.mark.spec("CL-12", "SM-4", "CL-15")
def test_one_graph_lowered_under_two_thresholds_runs_both(backend):
    """Which all_reduce's input is the graph's comm buffer 0 depends on the threshold:
    under 16 bytes the 16-byte one, under 32 the 32-byte one. Lowered both ways in one
    process and each run, the second must not ask buffer 0's persistent allocation for
    other bytes."""
    backend.require("lowering", "lowered_graph")
    configs = [{**ONE_SHOT, "one_shot_all_reduce_threshold_bytes": t} for t in (16, 32)]
    for rank, (want, *got) in enumerate(harness.run(
            backend, lowered_in_turn_on_rank, 2, "ar_two_sizes", configs)):
        for threshold, result in zip((16, 32), got, strict=True):
            assert not isinstance(result, str), f"rank {rank}, threshold {threshold}: {result}"
            torch.testing.assert_close(result, want, rtol=0, atol=0)


@pytest.mark.spec("CL-12", "FC-52")
@pytest.mark.parametrize("world", [2, 4])
def test_alloc_ids_are_equal_on_every_rank_of_a_ring(backend, world):
    """A one-shot all_reduce beside a ring's send and receive, whose peers (group ranks)
    differ between the ranks: its comm buffer's alloc_id is the same on every rank; on 4
    ranks the ring the other way round is another graph, with another alloc_id."""
    backend.require("lowering", "lowered_graph")
    lowerings = [("ar_beside_a_ring", ONE_SHOT, (4,)),
                 ("ar_beside_a_reversed_ring", ONE_SHOT, (4,))]
    ranks = harness.run(backend, alloc_ids_on_rank, world, lowerings)
    for rank, ids in enumerate(ranks):
        assert ids == ranks[0], f"alloc_ids differ between ranks 0 and {rank}: {ranks}"
    forward, backward = ranks[0]
    assert len(forward) == 1 and len(backward) == 1, ranks[0]
    assert (forward == backward) == (world == 2), \
        f"world {world}: the two rings {'share' if forward == backward else 'differ in'} " \
        f"alloc_ids {forward}, {backward}"


def _alloc_ids_by_gather_group_on_rank(spec: str) -> dict:
    """On one rank: {(gather's group, dtype): alloc_ids} of `all_reduce(x * 2, WORLD)`
    (one-shot: comm buffer 0) beside an all_gather of `x` on WORLD itself, on another
    group of the same ranks, or on this rank's row of [[0], [1]] (a name that differs
    between the ranks), the gather after the all_reduce or before it (CL-12)."""
    from conformance.bucketing_programs import group_of
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    ns = backend.require("lowering", "lowered_graph")
    fc = backend.require("functional_collectives")
    prepare("ar_small_other_group")  # OTHER_GROUP: a second group of the world's ranks
    groups = {"world": "0", "other": OTHER_GROUP["name"],
              "row": fc.resolve_group_name(group_of([[0], [1]]))}

    def program(group, gather_first, x):
        if gather_first:
            gathered = fc.all_gather_tensor(x, 0, group)
            return fc.all_reduce(x * 2, "sum", "0"), gathered
        return fc.all_reduce(x * 2, "sum", "0"), fc.all_gather_tensor(x, 0, group)

    ids = {}
    for name, group in groups.items():
        for gather_first in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                x = oracle.rank_input(dist.get_rank(), (4,), dtype, salt=210)
                gm = ns.lowered_graph(functools.partial(program, group, gather_first), [x],
                                      ONE_SHOT)
                ids[name, gather_first, str(dtype)] = alloc_ids(gm)
    return ids


@pytest.mark.spec("CL-12")
def test_alloc_ids_tell_apart_graphs_that_differ_only_in_a_group(backend):
    """Graphs that differ only in which group an op names (WORLD twice, or WORLD then
    another group of the same ranks, or then a row group whose name differs between the
    ranks) are different graphs: comm buffer 0, on WORLD in each, gets an id of its own
    in each, the same on every rank, in float32 and bfloat16, with the other group's op
    first or last."""
    backend.require("lowering", "lowered_graph")
    ranks = harness.run(backend, _alloc_ids_by_gather_group_on_rank, 2)
    assert ranks[0] == ranks[1], f"alloc_ids differ between ranks [CL-12]: {ranks}"
    for rank, ids in enumerate(ranks):
        assert all(len(got) == 1 for got in ids.values()), f"rank {rank}: {ids}"
        for gather_first in (False, True):
            for dtype in ("torch.float32", "torch.bfloat16"):
                got = {name: ids[name, gather_first, dtype][0]
                       for name in ("world", "other", "row")}
                assert len(set(got.values())) == 3, \
                    f"rank {rank} {dtype}, gather first {gather_first}: graphs that name " \
                    f"other groups share alloc_ids {got} [CL-12]"


@pytest.mark.spec("CL-12")
def test_alloc_ids_depend_on_the_graph_not_the_process(backend, fake_world):
    ns = backend.require("lowering", "lowered_graph")
    fc = backend.require("functional_collectives")
    ids = alloc_ids(ns.lowered_graph(functools.partial(PROGRAMS["ar_two_small"], fc),
                                     inputs_for(0, [(4,)]), ONE_SHOT))
    # The same graph lowered on gloo ranks (the case above) and here: the same ids.
    ranks = harness.run(backend, alloc_ids_on_rank, 2, [("ar_two_small", ONE_SHOT, (4,))])
    assert ranks[0][0] == ids


# Two one-shot all_reduces of one shape in one graph, lowered with fuse_pointwise: the
# buffer of a prologue (`x * 2`, CL-17: a new comm buffer) and that of an input realized
# in place (`x * x` is no step, CL-11), in every order.
FUSED_PAIRS = {
    "prologue_prologue": (lambda x: x * 2, lambda x: x * 3),
    "prologue_realized": (lambda x: x * 2, lambda x: x * x),
    "realized_prologue": (lambda x: x * x, lambda x: x * 2),
}


def _fused_alloc_ids_on_rank(spec: str) -> dict:
    """On one rank: {(pair, dtype): alloc_ids of its lowered graph} (CL-12)."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    ns = backend.require("lowering", "lowered_graph")
    fc = backend.require("functional_collectives")
    ids = {}
    def pair(first, second):
        return lambda x: fc.all_reduce(first(x), "sum", "0") + fc.all_reduce(second(x),
                                                                              "sum", "0")

    for name, (first, second) in FUSED_PAIRS.items():
        for dtype in (torch.float32, torch.bfloat16):
            x = oracle.rank_input(dist.get_rank(), (4,), dtype, salt=170)
            ids[name, str(dtype)] = alloc_ids(ns.lowered_graph(pair(first, second), [x],
                                                               dict(FUSE)))
    return ids


@pytest.mark.spec("CL-12")
def test_a_fused_prologue_buffer_takes_the_next_alloc_id(backend):
    """The comm buffer a fused prologue writes takes the graph's next buffer index like
    any other (CL-17: "with the next alloc_id"): two buffers of one shape, dtype and
    group in one graph get two ids, the same on every rank."""
    backend.require("lowering", "lowered_graph")
    ranks = harness.run(backend, _fused_alloc_ids_on_rank, 2)
    for rank, ids in enumerate(ranks):
        for (name, dtype), got in ids.items():
            assert len(got) == 2 and len(set(got)) == 2, \
                f"rank {rank}: {name} {dtype}: alloc_ids {got}, two distinct expected [CL-12]"
    assert ranks[0] == ranks[1], f"alloc_ids differ between ranks [CL-12]: {ranks}"


def two_calls_give_eagers_values(backend, program: str) -> None:
    """On 2 ranks, `program` lowered under ONE_SHOT and called twice, the first call's
    outputs alive during the second (a comm buffer reused, CL-13, SM-4): both give eager's
    values on every rank."""
    for rank, (want, first, second) in enumerate(harness.run(
            backend, called_twice, 2, program, [(4,)], ONE_SHOT)):
        torch.testing.assert_close(first, want, msg=lambda m, r=rank: f"rank {r}: {m}")
        torch.testing.assert_close(second, want, msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.spec("CL-13", "CL-11", "CL-15")
def test_a_comm_buffer_output_escapes_as_a_clone(backend, fake_world):
    ns = backend.require("lowering", "lowered_graph")
    graph = lowered_text(backend, "ar_comm_buffer_escapes", [(4,)], ONE_SHOT)
    assert_expected_inline(graph, """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 1998019483308672682) : f32[4]
%2 = aten.mul.out(%0, 3, out=%1) : f32[4]
%3 = symm_mem.one_shot_all_reduce(%2, 'sum', ranks[0,1]) : f32[4]
%4 = aten.clone(%2) : f32[4]
return [%3, %4]""")  # noqa: E501
    gm = ns.lowered_graph(functools.partial(PROGRAMS["ar_comm_buffer_escapes"],
                                            backend.require("functional_collectives")),
                          inputs_for(0, [(4,)]), ONE_SHOT)
    for node in gm.graph.nodes:
        if node.op == "call_function" and "empty_strided_p2p" in str(node.target):
            assert node.meta.get("comm_buffer", {}).get("type") == "symm_mem"
    # Two calls, the first one's outputs alive: the second reuses the same comm buffer.
    two_calls_give_eagers_values(backend, "ar_comm_buffer_escapes")


@pytest.mark.spec("CL-13", "CL-15")
@pytest.mark.parametrize("program", ["ar_comm_buffer_escapes_as_a_view",
                                     "ar_comm_buffer_escapes_as_a_split",
                                     "ar_inplace_comm_buffer_escapes"])
def test_a_view_of_a_comm_buffer_escapes_as_a_clone(backend, program):
    """An output that is a view of the comm buffer under a one-shot all_reduce (a view op,
    a piece of a split, the in-place copy back of an all_reduce_) holds the buffer as much
    as the buffer itself: it is returned as an ordinary clone, so two calls, the first
    one's outputs alive, both run and give eager's values on every rank."""
    backend.require("lowering", "lowered_graph")
    two_calls_give_eagers_values(backend, program)


def _kernels_on_rank(spec: str, name: str) -> list[str]:
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    gm = backend.require("lowering", "lowered_graph").lowered_graph(
        functools.partial(PROGRAMS[name], backend.require("functional_collectives")),
        inputs_for(dist.get_rank(), [(4,)]), dict(ONE_SHOT))
    return [str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and "all_reduce" in str(n.target)]


@pytest.mark.spec("CL-10", "CL-13", "FC-52")
@pytest.mark.parametrize("program", ["ar_of_a_tensor_upstream_sends",
                                     "ar_in_place_of_a_tensor_upstream_sends",
                                     "ar_of_a_view_upstream_batch_sends"])
def test_a_tensor_upstream_sends_is_no_one_shot_comm_buffer(backend, program):
    """A small sum all_reduce of an intermediate that upstream's isend also sends (itself,
    after an in-place all_reduce_ of it, or a view of it as a batch's member): upstream's
    send keeps the tensor alive after its
    wait (finding 25), so it is no comm buffer: the all_reduce is not one-shot, and two
    calls, the first one's outputs alive, give eager's values on every rank."""
    backend.require("lowering", "lowered_graph")
    for rank, kernels in enumerate(harness.run(backend, _kernels_on_rank, 2, program)):
        assert kernels and not any("one_shot" in k for k in kernels), \
            f"rank {rank}: {kernels} [CL-10]"
    two_calls_give_eagers_values(backend, program)


# ---- CL-1, CL-2: the pass's contract and the no_fuse mark -------------------------------
@pytest.mark.spec("CL-1")
def test_lower_returns_a_new_graph_and_leaves_its_input_alone(backend, fake_world):
    ns = backend.require("lowering", "lower", "Config")
    fc = backend.require("functional_collectives")
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(functools.partial(PROGRAMS["ar_graph_input"], fc), tracing_mode="fake")(
        *inputs_for(0, [(4,)]))
    before = canonical_graph(gm)
    lowered = ns.lower(gm, ns.Config())
    assert lowered is not gm and canonical_graph(gm) == before, "lower changed its input"
    assert canonical_graph(lowered) != before
    missing = [n.name for n in lowered.graph.nodes
               if n.op == "call_function" and "val" not in n.meta]
    assert not missing, f"nodes without meta['val']: {missing}"


@pytest.mark.spec("CL-1")
def test_the_lowered_program_takes_and_returns_what_the_traced_one_does(backend, fake_world):
    """make_fx of a function of a dict gives a program that takes the dict and returns one
    (its code generator holds both structures): so does the lowered program."""
    ns = backend.require("lowering", "lower", "Config")
    fc = backend.require("functional_collectives")
    from torch.fx.experimental.proxy_tensor import make_fx

    def program(d):
        return {"reduced": fc.all_reduce(d["x"] * 2, "sum", "0"), "next": d["y"] + 1}

    inputs = {"x": oracle.rank_input(0, (4,)), "y": oracle.rank_input(0, (3,), salt=1)}
    gm = make_fx(program, tracing_mode="fake")(inputs)
    want = gm(inputs)
    got = ns.lower(gm, ns.Config())(inputs)
    assert isinstance(got, dict) and got.keys() == want.keys(), got
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


def _each_hook_runs(lowered, x) -> dict[str, object]:
    """For each kind of forward hook, registered alone: the result of one call (each hook
    edits the arguments or the result, so an edit that was not used shows)."""
    from torch.nn.modules import module as nn_module

    def zeros(module, args):
        return (args[0] * 0,)

    def plus_ten(module, args, out):
        return (out[0] + 10,)

    kinds = {"pre": lambda: lowered.register_forward_pre_hook(zeros),
             "post": lambda: lowered.register_forward_hook(plus_ten),
             "global pre": lambda: nn_module.register_module_forward_pre_hook(zeros),
             "global post": lambda: nn_module.register_module_forward_hook(plus_ten)}
    got = {}
    for kind, register in kinds.items():
        handle = register()
        try:
            got[kind] = lowered(x.clone())[0].tolist()
        finally:  # a global hook left behind would run in every later case of this worker
            handle.remove()
    return got


def _each_backward_hook_runs(lowered, x) -> list[str]:
    """Which backward hooks ran, each of the four kinds registered alone for a backward."""
    from torch.nn.modules import module as nn_module

    seen = []
    kinds = {
        "pre": lambda: lowered.register_full_backward_pre_hook(
            lambda m, go: seen.append("pre")),
        "module": lambda: lowered.register_full_backward_hook(
            lambda m, gi, go: seen.append("module")),
        "global pre": lambda: nn_module.register_module_full_backward_pre_hook(
            lambda m, go: seen.append("global pre")),
        "global": lambda: nn_module.register_module_full_backward_hook(
            lambda m, gi, go: seen.append("global")),
    }
    for register in kinds.values():
        handle = register()
        try:
            lowered(x.clone().requires_grad_()).sum().backward()
        finally:
            handle.remove()
    return seen


@pytest.mark.spec("CL-1")
def test_the_lowered_program_is_called_as_any_module(backend, fake_world):
    """Whatever shortcut a backend's lowered module takes to its code, nn.Module's call
    path still happens when something needs it: forward hooks of every kind (their edits
    used), backward hooks of every kind, `torch.jit.trace` (the module's scope),
    `Module.compile`, an FX tracer keeping the module as a leaf (it patches
    `Module.__call__`), the profiler's record of the module call."""
    ns = backend.require("lowering", "lower", "Config")
    fc = backend.require("functional_collectives")
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.arange(4.0)
    gm = make_fx(functools.partial(PROGRAMS["ar_graph_input"], fc), tracing_mode="fake")(x)
    lowered = ns.lower(gm, ns.Config())
    plain_result = lowered(x.clone())[0].tolist()  # the fake group's all_reduce: x
    assert _each_hook_runs(lowered, x) == {"pre": [0.0] * 4, "post": [10.0, 11.0, 12.0, 13.0],
                                           "global pre": [0.0] * 4,
                                           "global post": [10.0, 11.0, 12.0, 13.0]}
    assert lowered(x.clone())[0].tolist() == plain_result  # no hook left behind

    plain = ns.lower(make_fx(lambda t: t * 3, tracing_mode="fake")(x), ns.Config())
    assert _each_backward_hook_runs(plain, x) == ["pre", "module", "global pre", "global"]

    class Parent(torch.nn.Module):
        def __init__(self, program):
            super().__init__()
            self.program = program

        def forward(self, x):
            return self.program(x)

    with warnings.catch_warnings():  # torch.jit.trace is deprecated, and still used
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(Parent(plain), x)  # it records the module's scope
    scopes = {node.scopeName() for node in traced.inlined_graph.nodes()}
    assert "__module.program" in scopes, scopes

    compiled_graphs = []

    def counting_backend(graph, example_inputs):
        compiled_graphs.append(graph)
        return graph.forward

    lowered.compile(backend=counting_backend)
    try:
        lowered(x.clone())
    finally:
        lowered._compiled_call_impl = None  # what Module.compile set, undone
    assert compiled_graphs, "Module.compile's function was not called"

    class KeepsTheProgram(torch.fx.Tracer):
        def is_leaf_module(self, module, qualified_name):
            return module is lowered or super().is_leaf_module(module, qualified_name)

    graph = KeepsTheProgram().trace(Parent(lowered))
    assert [n.target for n in graph.nodes if n.op == "call_module"] == ["program"]

    # The profiler records module calls where its Python tracer runs (not in every build:
    # torch 2.11's CUDA wheel on a CPU host records none): as it does a plain module's.
    assert _profiled_module_call(lowered, x) == _profiled_module_call(torch.nn.Identity(), x)


def _profiled_module_call(module, x) -> bool:
    with torch.profiler.profile(with_stack=True) as prof:
        module(x.clone())
    return any(event.name.startswith("nn.Module:") for event in prof.events())


@pytest.mark.spec("CL-2")
@pytest.mark.parametrize("reorder", [None, False, True],
                         ids=["default", "plain", "reorder_for_overlap"])
def test_clone_is_marked_no_fuse_only_under_overlap_reordering(backend, fake_world, reorder):
    """None: the config's default, which CL-1 says is off."""
    ns = backend.require("lowering", "lowered_graph")
    fc = backend.require("functional_collectives")
    options = {} if reorder is None else {"reorder_for_compute_comm_overlap": reorder}
    gm = ns.lowered_graph(functools.partial(PROGRAMS["ar_graph_input"], fc),
                          inputs_for(0, [(4,)]), options)
    (clone,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert clone.meta.get("no_fuse", False) is bool(reorder)


# ---- What lower MUST refuse --------------------------------------------------------------
def _traced(backend, program, *inputs):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(program, tracing_mode="fake")(*inputs)


@pytest.mark.spec("CL-1", "CL-9")
def test_a_graph_of_upstream_ops_is_lowered_to_upstream_kernels(backend, fake_world):
    """Upstream's `_c10d_functional` all_reduce, coalesced all_reduce and broadcast lower to
    upstream's in-place kernels, waited by upstream's wait: no op of another namespace."""
    ns = backend.require("lowering", "lower", "Config")
    up = torch.ops._c10d_functional

    def program(x, y):
        a = up.all_reduce(x * 2, "sum", "0")
        b, c = up.all_reduce_coalesced([x + 1, y * 3], "sum", "0")
        d = up.broadcast(y + 1, 0, "0")
        return [up.wait_tensor(t) for t in (a, b, c, d)]

    gm = ns.lower(_traced(backend, program, torch.ones(4), torch.ones(2, 3)), ns.Config())
    assert isinstance(gm, torch.fx.GraphModule), f"lower returned {type(gm).__name__}"
    comm = [n.target for n in gm.graph.nodes if n.op == "call_function"
            and getattr(n.target, "namespace", "aten") not in ("aten", "prims")]
    assert comm and all(t.namespace == "_c10d_functional" for t in comm), comm
    names = sorted({t._schema.name.split("::")[1] for t in comm})
    assert names == ["all_reduce_", "all_reduce_coalesced_", "broadcast_", "wait_tensor"], names


def _refusals(backend):
    """name: (a call of lower, the error, a word its message must hold, or words)."""
    ns = backend.require("lowering", "lower", "Config")
    fc = backend.require("functional_collectives")
    x = torch.ones(3, 2)
    untyped = torch.fx.symbolic_trace(lambda t: fc.ops.all_reduce(t, "sum", "0"))
    no_wait = _traced(backend, lambda t: fc.ops.all_reduce_(t.t(), "sum", "0"), x)
    coalesced = _traced(backend, lambda t: fc.ops.all_reduce_coalesced_([t, t.t()], "sum", "0"),
                        torch.ones(2, 2))
    program = functools.partial(PROGRAMS["ar_small_graph_input"], fc)
    graph_input = _traced(backend, program, torch.ones(4))
    forced = {**ONE_SHOT, "force_one_shot_all_reduce": True}

    def doctored(edit):
        """`all_reduce(t * 2)`, traced, with `edit` applied to its all_reduce node."""
        def all_reduce_of_double(t):
            return fc.ops.wait_tensor(fc.ops.all_reduce(t * 2, "sum", "0"))

        gm = _traced(backend, all_reduce_of_double, x)
        edit(next(n for n in gm.graph.nodes if n.op == "call_function" and len(n.args) == 3))
        return gm

    # A graph traced elsewhere (on other groups, say); a pass before lower that made nodes
    # without meta val: the collective, its input.
    unknown_group = doctored(lambda n: setattr(n, "args", (*n.args[:2], "no-such-group")))
    valueless = {"collective": doctored(lambda n: n.meta.pop("val")),
                 "input": doctored(lambda n: n.args[0].meta.pop("val"))}
    return {
        "not_a_graph_module": (lambda: ns.lower(torch.nn.Linear(2, 2), ns.Config()),
                               TypeError, "gm"),
        "config_of_another_type": (lambda: ns.lower(graph_input, {"auto_select": True}),
                                   TypeError, "config"),
        # Only None means the default config: a falsy one of another type is refused too.
        "empty_config_of_another_type": (lambda: ns.lower(graph_input, {}), TypeError,
                                         "config"),
        "no_fake_values": (lambda: ns.lower(untyped, ns.Config()), ValueError, "meta['val']"),
        "in_place_on_a_view_without_wait": (lambda: ns.lower(no_wait, ns.Config()),
                                            ValueError, "wait"),
        "coalesced_in_place_on_a_view": (lambda: ns.lower(coalesced, ns.Config()),
                                         ValueError, "contiguous"),
        "forced_one_shot_of_a_graph_input": (
            lambda: ns.lowered_graph(program, [torch.ones(4)], forced), ValueError,
            "graph input"),
        # Refused by lower itself, naming gm and the node, not by a kernel it made (CL-16).
        "group_name_of_no_group": (lambda: ns.lower(unknown_group, ns.Config()), ValueError,
                                   ("gm", "all_reduce", "group_name", "'no-such-group'")),
        "collective_without_meta_val": (
            lambda: ns.lower(valueless["collective"], ns.Config()), ValueError,
            ("gm", "all_reduce", "meta['val']")),
        "collective_input_without_meta_val": (
            lambda: ns.lower(valueless["input"], ns.Config()), ValueError,
            ("gm", "mul", "meta['val']")),
    }


REFUSALS = ["not_a_graph_module", "config_of_another_type", "empty_config_of_another_type",
            "no_fake_values",
            "in_place_on_a_view_without_wait", "coalesced_in_place_on_a_view",
            "forced_one_shot_of_a_graph_input", "group_name_of_no_group",
            "collective_without_meta_val", "collective_input_without_meta_val"]


@pytest.mark.spec("CL-1", "CL-4", "CL-5", "CL-21", "CL-16")
@pytest.mark.parametrize("name", REFUSALS)
def test_lower_refuses_what_it_cannot_lower(backend, fake_world, name):
    call, error, words = _refusals(backend)[name]
    with pytest.raises(error) as info:
        call()
    for word in (words,) if isinstance(words, str) else words:
        assert word in str(info.value), f"{name}: {info.value} does not say {word!r}"


# CL-21: a forced all_reduce of a graph input x (never a comm buffer, CL-11) on which the
# conditions of CL-10 from the named one on all fail: (group, reduce op, dtype, threshold)
# and the word the refusal must say. float64 is no dtype of the one-shot kernel (SM-14);
# a threshold of 0 bytes is under any x. Each row lets one more condition hold.
FIRST_FAILING_CONDITION = {
    "symmetric_memory": ("other", "max", torch.float64, 0, "symmetric memory"),
    "reduce_op": ("0", "max", torch.float64, 0, "reduce_op"),
    "dtype": ("0", "sum", torch.float64, 0, "dtype"),
    "threshold": ("0", "sum", torch.float32, 0, "one_shot_all_reduce_threshold_bytes"),
    "comm_buffer": ("0", "sum", torch.float32, 128 * 1024, "graph input"),
}


@pytest.mark.spec("CL-21")
@pytest.mark.parametrize("condition", list(FIRST_FAILING_CONDITION))
def test_forced_one_shot_refusal_names_the_first_condition_that_fails(backend, fake_world,
                                                                      condition):
    """`force_one_shot_all_reduce` on an all_reduce that fails `condition` and every
    condition of CL-10 after it: a CommBufferError (a ValueError) that names `condition`,
    and none of the later ones, whatever is cheaper to check first."""
    from conformance.lowering_programs import OTHER_GROUP

    ns = backend.require("lowering", "lowered_graph")
    fc = backend.require("functional_collectives")
    prepare("ar_small_other_group")  # a group of every rank without symmetric memory
    group, reduce_op, dtype, threshold, _ = FIRST_FAILING_CONDITION[condition]
    group = OTHER_GROUP["name"] if group == "other" else group

    def program(x):
        return fc.ops.wait_tensor(fc.ops.all_reduce(x, reduce_op, group))

    options = {"force_one_shot_all_reduce": True, "enable_symm_mem_for": ["0"],
               "one_shot_all_reduce_threshold_bytes": threshold}
    with pytest.raises(ValueError) as info:
        ns.lowered_graph(program, [torch.ones(4, dtype=dtype)], options)
    assert type(info.value).__name__ == "CommBufferError", repr(info.value)
    message = str(info.value)
    words = [w for *_, w in FIRST_FAILING_CONDITION.values()]
    said = [w for w in words if w in message]
    assert said == [FIRST_FAILING_CONDITION[condition][-1]], \
        f"{condition}: the refusal names {said}, expected the first failing condition " \
        f"alone [CL-21]: {message}"


# ---- CL-16: bad input -------------------------------------------------------------------
@pytest.mark.spec("CL-16")
def test_config_refuses_a_negative_threshold_and_fields_of_another_type(backend, fake_world):
    options = {"one_shot_all_reduce_threshold_bytes": -1}
    with pytest.raises(ValueError, match="one_shot_all_reduce_threshold_bytes"):
        comm_trace(backend, "ar_small_intermediate", [(4,)], options)
    for options, field in (({"one_shot_all_reduce_threshold_bytes": True},
                             "one_shot_all_reduce_threshold_bytes"),  # a bool is no count
                            ({"one_shot_all_reduce_threshold_bytes": 1.5},
                             "one_shot_all_reduce_threshold_bytes"),
                            ({"auto_select": 1}, "auto_select"),
                            ({"force_one_shot_all_reduce": "yes"}, "force_one_shot_all_reduce"),
                            ({"alloc_id_namespace": 7}, "alloc_id_namespace"),
                            ({"fuse_pointwise": 1}, "fuse_pointwise")):
        with pytest.raises(TypeError, match=f"^{field}: "):
            comm_trace(backend, "ar_small_intermediate", [(4,)], options)
    # The boundary: 0 is a byte count and is accepted (16 bytes are then over it).
    trace = comm_trace(backend, "ar_small_intermediate", [(4,)],
                       {**ONE_SHOT, "one_shot_all_reduce_threshold_bytes": 0})
    assert "all_reduce" in trace and "one_shot" not in trace, trace


# ---- CL-17: chains of add/sub/mul by a number fused into the one-shot kernel -------------
FUSE = {**ONE_SHOT, "fuse_pointwise": True}
# CL-17: program -> (why, its lowered graph with fuse_pointwise on).
FUSED_GRAPHS = {
    "ar_small_intermediate": ("both chains of one step", """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 9072673292006092717) : f32[4]
%2 = symm_mem.one_shot_all_reduce_pointwise(%1, %0, 'sum', ranks[0,1], 'mul 2.0', 'add 1.0') : f32[4]
return %2"""),  # noqa: E501
    "ar_pointwise_chains": ("three steps on each side, in program order", """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 5914585356161537873) : f32[4]
%2 = symm_mem.one_shot_all_reduce_pointwise(%1, %0, 'sum', ranks[0,1], 'mul 2.0; add 3.0; sub 0.5', 'mul 1.5; sub 1.0; mul 4.0') : f32[4]
return %2"""),  # noqa: E501
    "ar_pointwise_shared_step": ("the prologue stops below y, which the output reads too", """\
%0 = input : f32[4]
%1 = aten.mul.Tensor(%0, 2) : f32[4]
%2 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 2595278643169145358) : f32[4]
%3 = symm_mem.one_shot_all_reduce_pointwise(%2, %1, 'sum', ranks[0,1], 'add 1.0; sub 3.0', 'mul 3.0') : f32[4]
return [%3, %1]"""),  # noqa: E501
    "ar_pointwise_result_read_twice": ("no epilogue: the result has two readers", """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 8571540438403909371) : f32[4]
%2 = symm_mem.one_shot_all_reduce_pointwise(%1, %0, 'sum', ranks[0,1], 'mul 2.0', '') : f32[4]
%3 = aten.add.Tensor(%2, 1) : f32[4]
return [%3, %2]"""),  # noqa: E501
    "ar_pointwise_epilogue_step_read_twice": ("the epilogue stops after the step two nodes read", """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 2424838760672571375) : f32[4]
%2 = symm_mem.one_shot_all_reduce_pointwise(%1, %0, 'sum', ranks[0,1], 'mul 2.0', 'add 1.0') : f32[4]
%3 = aten.mul.Tensor(%2, 2) : f32[4]
return [%3, %2]"""),  # noqa: E501
    "ar_pointwise_alpha": ("add with alpha is no step: the plain kernel", """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 5023750700483967070) : f32[4]
%2 = aten.add.out(%0, 1, alpha=2, out=%1) : f32[4]
%3 = symm_mem.one_shot_all_reduce(%2, 'sum', ranks[0,1]) : f32[4]
return %3"""),  # noqa: E501
    "ar_pointwise_bool": ("a bool is no number: the input is realized by CL-11 and passed twice", """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 8645544828548768166) : f32[4]
%2 = aten.mul.out(%0, True, out=%1) : f32[4]
%3 = symm_mem.one_shot_all_reduce_pointwise(%2, %2, 'sum', ranks[0,1], '', 'add 1.0') : f32[4]
return %3"""),  # noqa: E501
    "ar_pointwise_inexact_int": ("an int with no exact double is no number", """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 1197224582167497163) : f32[4]
%2 = aten.mul.out(%0, 9007199791611905, out=%1) : f32[4]
%3 = symm_mem.one_shot_all_reduce_pointwise(%2, %2, 'sum', ranks[0,1], '', 'add 1.0') : f32[4]
return %3"""),  # noqa: E501
    "ar_pointwise_other_dtype": ("a step from int32 to float32 is no step", """\
%0 = input : f32[4]
%1 = aten._to_copy(%0, dtype=i32) : i32[4]
%2 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 5924511190901180903) : f32[4]
%3 = aten.mul.out(%1, 2.5, out=%2) : f32[4]
%4 = symm_mem.one_shot_all_reduce(%3, 'sum', ranks[0,1]) : f32[4]
return %4"""),  # noqa: E501
    "ar_pointwise_source_written": ("all_reduce_ writes x between x * 2 and the all_reduce", """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 5070522092724294197) : f32[4]
%2 = aten.mul.out(%0, 2, out=%1) : f32[4]
%3 = funcol.all_reduce_(%0, 'sum', ranks[0,1]) : f32[4]
%4 = funcol.wait_tensor_(%3) : f32[4]
%5 = symm_mem.one_shot_all_reduce(%2, 'sum', ranks[0,1]) : f32[4]
%6 = aten.add.Tensor(%5, %4) : f32[4]
return %6"""),  # noqa: E501
    "ar_pointwise_source_written_through_a_view": ("add_ writes a view of x between x * 2 and the all_reduce", """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 6169125877406690031) : f32[4]
%2 = aten.mul.out(%0, 2, out=%1) : f32[4]
%3 = aten.slice.Tensor(%0, 0, 1, 9223372036854775807) : f32[3]
%4 = aten.add_.Tensor(%3, 1) : f32[3]
%5 = symm_mem.one_shot_all_reduce(%2, 'sum', ranks[0,1]) : f32[4]
%6 = aten.add.Tensor(%5, %0) : f32[4]
return %6"""),  # noqa: E501
    "ar_pointwise_source_written_by_a_foreach": ("_foreach_add_ writes a list holding x between x * 2 and the all_reduce", """\
%0 = input : f32[4]
%1 = aten.sub.Tensor(%0, 1) : f32[4]
%2 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 3496742069311660229) : f32[4]
%3 = aten.mul.out(%0, 2, out=%2) : f32[4]
%4 = aten._foreach_add_.Scalar([%1, %0], 1.0) : none
%5 = symm_mem.one_shot_all_reduce(%3, 'sum', ranks[0,1]) : f32[4]
%6 = aten.add.Tensor(%5, %0) : f32[4]
%7 = aten.add.Tensor(%6, %1) : f32[4]
return %7"""),  # noqa: E501
    "ar_pointwise_other_buffer_written": ("an in-place op and a getitem on other buffers do not stop the prologue", """\
%0 = input : f32[4]
%1 = aten.sub.Tensor(%0, 1) : f32[4]
%2 = aten.mul_.Tensor(%1, 3) : f32[4]
%3 = aten.max.dim(%2, 0) : (f32[], i64[])
%4 = getitem(%3, 0) : f32[]
%5 = getitem(%3, 1) : i64[]
%6 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 222475126193278952) : f32[4]
%7 = symm_mem.one_shot_all_reduce_pointwise(%6, %0, 'sum', ranks[0,1], 'mul 2.0', '') : f32[4]
%8 = aten.add.Tensor(%7, %2) : f32[4]
%9 = aten.add.Tensor(%8, %4) : f32[4]
return %9"""),  # noqa: E501
    "ar_pointwise_int32": ("int32 is no step dtype: the plain kernel", """\
%0 = input : f32[4]
%1 = aten._to_copy(%0, dtype=i32) : i32[4]
%2 = symm_mem.empty_strided_p2p([4], [1], i32, device(cpu), ranks[0,1], 604300565572001164) : i32[4]
%3 = aten.mul.out(%1, 2, out=%2) : i32[4]
%4 = symm_mem.one_shot_all_reduce(%3, 'sum', ranks[0,1]) : i32[4]
%5 = aten.add.Tensor(%4, 1) : i32[4]
return %5"""),  # noqa: E501
}


# CL-3 on what an earlier one-shot left: its result (the wait's, CL-9) or its fused
# epilogue's (CL-17) is no fresh intermediate, so a later all_reduce of it is cloned (and
# not lowered one-shot: nothing can be realized as a comm buffer there).
RESULTS_OF_KERNELS = {
    "ar_of_a_one_shot_result": ("ONE_SHOT", """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 8518558089142218972) : f32[4]
%2 = aten.mul.out(%0, 2, out=%1) : f32[4]
%3 = symm_mem.one_shot_all_reduce(%2, 'sum', ranks[0,1]) : f32[4]
%4 = aten.clone(%3, memory_format=torch.contiguous_format) : f32[4]
%5 = funcol.all_reduce_(%4, 'sum', ranks[0,1]) : f32[4]
%6 = funcol.wait_tensor_(%5) : f32[4]
%7 = aten.add.Tensor(%6, 1) : f32[4]
return %7"""),  # noqa: E501
    "ar_of_a_fused_epilogue": ("FUSE", """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 8061226578875881149) : f32[4]
%2 = symm_mem.one_shot_all_reduce_pointwise(%1, %0, 'sum', ranks[0,1], 'mul 2.0', 'mul 3.0') : f32[4]
%3 = aten.clone(%2, memory_format=torch.contiguous_format) : f32[4]
%4 = funcol.all_reduce_(%3, 'sum', ranks[0,1]) : f32[4]
%5 = funcol.wait_tensor_(%4) : f32[4]
%6 = aten.add.Tensor(%5, 1) : f32[4]
return %6"""),  # noqa: E501
}


@pytest.mark.spec("CL-3", "CL-10", "CL-17", "CL-15")
@pytest.mark.parametrize("name", list(RESULTS_OF_KERNELS))
def test_an_all_reduce_of_a_kernels_result_clones_it(backend, fake_world, name):
    options, golden = RESULTS_OF_KERNELS[name]
    options = {"ONE_SHOT": ONE_SHOT, "FUSE": FUSE}[options]
    backend.require("lowering", "lowered_graph", "Config")
    assert lowered_text(backend, name, [(4,)], options) == golden
    check_bitwise(backend, name, options)


def check_bitwise(backend, name, options, world_size=2):
    """CL-15 to the bit: on 2 ranks gloo's sum and the one-shot's agree exactly (a + b is
    b + a), so the lowered program must give the eager program's very bits."""
    results = harness.run(backend, numeric_check, world_size, name, [(4,)], dict(options))
    for rank, (want, got, untrue_meta) in enumerate(results):
        torch.testing.assert_close(got, want, rtol=0, atol=0,
                                   msg=lambda m, r=rank: f"rank {r}: {m}")
        assert untrue_meta == "", f"rank {rank}: {untrue_meta} [CL-1]"


@pytest.mark.spec("CL-17", "CL-15", "CL-11", "CL-12")
@pytest.mark.parametrize("name", list(FUSED_GRAPHS))
def test_pointwise_chains_run_in_the_one_shot_kernel(backend, fake_world, name):
    why, golden = FUSED_GRAPHS[name]
    backend.require("lowering", "lowered_graph", "Config")
    prepare(name)
    graph = lowered_text(backend, name, [(4,)], FUSE)
    assert graph == golden, f"{name} ({why}):\n{graph}"
    check_bitwise(backend, name, FUSE)


@pytest.mark.spec("CL-17", "CL-1")
def test_pointwise_fusion_is_off_by_default(backend, fake_world):
    config = backend.require("lowering", "lowered_graph", "Config").Config
    assert config().fuse_pointwise is False
    assert_expected_inline(lowered_text(backend, "ar_small_intermediate", [(4,)], ONE_SHOT), """\
%0 = input : f32[4]
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), ranks[0,1], 9072673292006092717) : f32[4]
%2 = aten.mul.out(%0, 2, out=%1) : f32[4]
%3 = symm_mem.one_shot_all_reduce(%2, 'sum', ranks[0,1]) : f32[4]
%4 = aten.add.Tensor(%3, 1) : f32[4]
return %4""")  # noqa: E501


@pytest.mark.spec("CL-17", "CL-15")
def test_fused_values_on_four_ranks(backend):
    backend.require("lowering", "run_lowered", "Config")
    check_numerics(backend, "ar_pointwise_chains", [(4,)], FUSE, world_size=4)


# CL-17: a write to the chain's starting tensor between the prologue's steps, not after
# its last one: `y = x * 2; <write x>; z = y + 1; all_reduce(z)`. The prologue is `add 1.0`
# from y; `x * 2` stays outside, read before the write.
WRITES_BETWEEN_STEPS = {
    "add_": lambda fc, x: x.add_(1),
    "view_add_": lambda fc, x: x[1:].add_(1),
    "foreach_add_": lambda fc, x: torch._foreach_add_([x], 1.0),
    "all_reduce_": lambda fc, x: fc.ops.wait_tensor(fc.ops.all_reduce_(x, "sum", "0")),
}


def _written_between_steps(fc, write, x):
    y = x * 2
    WRITES_BETWEEN_STEPS[write](fc, x)
    z = y + 1
    return fc.all_reduce(z, "sum", "0"), x + 0


def _written_between_steps_on_rank(spec: str) -> list:
    """On one rank, per write and dtype: the fused kernel's (source, prologue, epilogue)
    of the lowered graph, eager's results and the lowered graph's."""
    from conformance.canonical import op_name
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    ns = backend.require("lowering", "lowered_graph", "Config")
    fc = backend.require("functional_collectives")
    results = []
    for write in WRITES_BETWEEN_STEPS:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            program = functools.partial(_written_between_steps, fc, write)
            x = oracle.rank_input(dist.get_rank(), (4,), dtype, salt=220)
            gm = ns.lowered_graph(program, [x.clone()], FUSE)
            fused = []
            for n in gm.graph.nodes:
                if n.op == "call_function" \
                        and op_name(n.target) == "symm_mem.one_shot_all_reduce_pointwise":
                    source = n.args[1]
                    fused.append((source.op, op_name(source.target)
                                  if source.op == "call_function" else "", *n.args[4:]))
            want = [t.clone() for t in program(x.clone())]
            got = [t.clone() for t in gm(x.clone())]
            results.append((write, str(dtype), fused, want, got))
    return results


@pytest.mark.spec("CL-17", "CL-15")
def test_a_write_between_the_prologues_steps_ends_it_there(backend):
    """The starting tensor x of `x * 2` is written (in place, through a view, by a
    foreach, by an in-place all_reduce) after `x * 2` but before `+ 1`, the last step:
    the prologue is `add 1.0` alone, starting from `x * 2`, whose reading of x comes
    before the write; every rank's values are eager's bit for bit, in float32, bfloat16
    and float16."""
    backend.require("lowering", "lowered_graph", "Config")
    for rank, results in enumerate(harness.run(backend, _written_between_steps_on_rank, 2)):
        for write, dtype, fused, want, got in results:
            where = f"rank {rank} {write} {dtype}"
            assert fused == [("call_function", "aten.mul.Tensor", "add 1.0", "")], \
                f"{where}: fused kernels (source, prologue, epilogue) {fused}, expected " \
                f"the prologue 'add 1.0' from x * 2 [CL-17]"
            torch.testing.assert_close(got, want, rtol=0, atol=0,
                                       msg=lambda m, w=where: f"{w}: {m}")


# CL-17: sub does not commute. `2.0 - y` (aten.sub.Tensor(2.0, y), the number first) is no
# step: before the all_reduce it is the input, realized as a comm buffer (no chain: CL-10);
# after it, it ends the epilogue before it. add and mul may take the number first.
NUMBER_FIRST = {
    "sub_before": (lambda fc, x: fc.all_reduce(torch.ops.aten.sub.Tensor(2.0, x * 3), "sum",
                                               "0"), []),  # CL-10 unchanged
    "sub_after": (lambda fc, x: torch.ops.aten.sub.Tensor(
        2.0, fc.all_reduce(x * 3, "sum", "0")), [("mul 3.0", "")]),
    "add_before": (lambda fc, x: fc.all_reduce(torch.ops.aten.add.Tensor(2.0, x * 3), "sum",
                                               "0"), [("mul 3.0; add 2.0", "")]),
    "mul_after": (lambda fc, x: torch.ops.aten.mul.Tensor(
        2.0, fc.all_reduce(x * 3, "sum", "0")), [("mul 3.0", "mul 2.0")]),
}


def _number_first_on_rank(spec: str) -> list:
    """On one rank, per program and dtype: the fused kernels' (prologue, epilogue), eager's
    result and the lowered graph's."""
    from conformance.canonical import op_name
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    ns = backend.require("lowering", "lowered_graph", "Config")
    fc = backend.require("functional_collectives")
    results = []
    for name, (program, _) in NUMBER_FIRST.items():
        for dtype in (torch.float32, torch.bfloat16):
            x = oracle.rank_input(dist.get_rank(), (4,), dtype, salt=221)
            fn = functools.partial(program, fc)
            gm = ns.lowered_graph(fn, [x.clone()], FUSE)
            fused = [tuple(n.args[4:]) for n in gm.graph.nodes if n.op == "call_function"
                     and op_name(n.target) == "symm_mem.one_shot_all_reduce_pointwise"]
            want = fn(x.clone()).clone()
            results.append((name, str(dtype), fused, want, gm(x.clone()).clone()))
    return results


@pytest.mark.spec("CL-17", "CL-15")
def test_a_number_first_sub_is_no_step(backend):
    """`2.0 - y` before the all_reduce is no prologue step (the kernel would compute
    y - 2.0), nor after it an epilogue step; `2.0 + y` and `2.0 * y` are. Every rank's
    values are eager's bit for bit, in float32 and bfloat16."""
    backend.require("lowering", "lowered_graph", "Config")
    for rank, results in enumerate(harness.run(backend, _number_first_on_rank, 2)):
        for name, dtype, fused, want, got in results:
            where = f"rank {rank} {name} {dtype}"
            assert fused == NUMBER_FIRST[name][1], \
                f"{where}: fused kernels (prologue, epilogue) {fused} [CL-17]"
            torch.testing.assert_close(got, want, rtol=0, atol=0,
                                       msg=lambda m, w=where: f"{w}: {m} [CL-17, CL-15]")


# CL-1, CL-11: a producer rewritten to write into a (contiguous) comm buffer computes a
# contiguous result, whatever layout it had traced (`x.t() * 2` follows x.t()'s strides);
# its meta val says so, for the passes after lowering that read it.
def _realized_non_contiguous(fc, x):
    y = x.t() * 2
    return fc.all_reduce(y, "sum", "0") + 1, y.sum(0)


def _realized_non_contiguous_on_rank(spec: str) -> list:
    from conformance.harness import backend_in_rank
    from conformance.true_meta import MetaChecker

    backend = backend_in_rank(spec)
    ns = backend.require("lowering", "lowered_graph", "Config")
    fc = backend.require("functional_collectives")
    results = []
    for options in (ONE_SHOT, FUSE):
        for dtype in (torch.float32, torch.bfloat16):
            x = oracle.rank_input(dist.get_rank(), (2, 3), dtype, salt=222)
            fn = functools.partial(_realized_non_contiguous, fc)
            want = [t.clone() for t in fn(x.clone())]
            checker = MetaChecker(ns.lowered_graph(fn, [x.clone()], dict(options)))
            got = [t.clone() for t in checker.call(x.clone())]
            results.append((str(options.get("fuse_pointwise", False)), str(dtype), want, got,
                            checker.report()))
    return results


@pytest.mark.spec("CL-1", "CL-11", "CL-15")
def test_a_realized_non_contiguous_producer_has_a_contiguous_meta_val(backend):
    """all_reduce of `x.t() * 2` (traced strides (1, 3)) lowered one-shot, with and
    without fuse_pointwise: every node's meta val is the layout it computes (the producer
    now writes a contiguous comm buffer), and every rank's values are eager's."""
    backend.require("lowering", "lowered_graph", "Config")
    for rank, results in enumerate(harness.run(backend, _realized_non_contiguous_on_rank, 2)):
        for fused, dtype, want, got, untrue in results:
            where = f"rank {rank} fuse_pointwise={fused} {dtype}"
            assert untrue == "", f"{where}: {untrue} [CL-1]"
            torch.testing.assert_close(got, want, rtol=0, atol=0,
                                       msg=lambda m, w=where: f"{w}: {m} [CL-15]")
