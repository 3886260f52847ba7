"""Comm lowering (SPEC.md section 2): refusals, structure, persistent alloc_ids, numerics.

Structural tests trace on a fake process group of 2 in this process; numeric tests trace
and run inside real gloo ranks (2 and 4) and compare the lowered program with the eager
one, the one-shot path running through the CPU symmetric-memory backend.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import lowering_rank
import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

import refimpl.functional_collectives as fc
from conformance import oracle
from conformance.lowering_programs import PROGRAMS, inputs_for
from refimpl import _fx
from refimpl.comm_lowering import (
    COMM_BUFFER_META,
    NO_FUSE_META,
    CommBufferError,
    CommLoweringConfig,
    comm_buffer_refusal,
    comm_buffers,
    lower,
    realize_as_comm_buffer,
)
from refimpl.multiprocess import run_on_ranks
from refimpl.symmetric_memory import enable_symm_mem_for_group

ONE_SHOT = CommLoweringConfig(auto_select=True)
FORCE = CommLoweringConfig(force_one_shot_all_reduce=True)
ONE_SHOT_PROGRAMS = {"ar_intermediate", "ar_intermediate_shared", "ar_inplace",
                     "ar_small_intermediate", "ar_inplace_small"}


@pytest.fixture(scope="module")
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    elif dist.get_world_size() != 2:
        pytest.fail("these tests need a world of 2; another test left a process group of "
                    f"{dist.get_world_size()} initialized")
    enable_symm_mem_for_group("0")
    # A group without symmetric memory: same ranks, its own name.
    yield dist.new_group([0, 1]).group_name
    if created:
        dist.destroy_process_group()


def traced(name, *shapes, mode="fake"):
    program = functools.partial(PROGRAMS[name], fc)
    return make_fx(program, tracing_mode=mode)(*inputs_for(0, shapes or [(4,)]))


def targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def node_of(gm, target_text):
    return next(n for n in gm.graph.nodes if str(n.target) == target_text)


# ---- CL-1: the contract of lower -------------------------------------------------------
def test_cl1_lower_returns_a_new_module_and_leaves_its_input_alone(fake_world):
    gm = traced("ar_graph_input")
    before = gm.code
    lowered = lower(gm)
    assert lowered is not gm and gm.code == before
    assert "refimpl_c10d.all_reduce.default" in targets(gm)
    assert "refimpl_c10d.all_reduce_.default" in targets(lowered)


def test_cl1_the_lowered_program_is_called_straight_until_recompiled(fake_world):
    """lower() lets a call go straight to the generated code (refimpl._fx.call_straight);
    the conformance case of CL-1 checks that nn.Module's path still happens whenever
    something needs it. An error inside is raised as itself, and recompile() gives FX's
    call path back."""
    lowered = lower(traced("ar_graph_input"))
    assert type(lowered).__call__ is _fx._call_straight
    x = torch.arange(4.0)
    want = lowered.forward(x.clone())[0]
    assert torch.equal(lowered(x.clone())[0], want)
    with pytest.raises(RuntimeError) as raised:  # from the op, inside the generated code
        lowered("not a tensor")
    assert any(frame.name == "forward" for frame in raised.traceback)
    lowered.recompile()
    assert type(lowered).__call__ is not _fx._call_straight
    assert torch.equal(lowered(x.clone())[0], want)


def test_cl1_a_graph_without_refimpls_ops_lowers_in_a_fresh_interpreter():
    """refimpl's collective ops are registered by refimpl.functional_collectives; lowering
    a graph that holds none of them (no collective at all, as a torch.compile subgraph
    may) must not need them. A fresh interpreter: this one imported them long ago."""
    script = """
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from refimpl.comm_lowering import lower
import sys
lowered = lower(make_fx(lambda x: x * 2 + 1, tracing_mode="fake")(torch.ones(4)))
assert "refimpl.functional_collectives" not in sys.modules, "the test would prove nothing"
print(lowered(torch.ones(4)).tolist())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[3.0, 3.0, 3.0, 3.0]", done.stdout


@pytest.mark.parametrize("name, one_shot", [
    ("ar_graph_input", False), ("ar_coalesced", False), ("broadcast", False),
    ("ar_small_intermediate", True), ("ar_inplace_small", True)])
def test_cl1_lowering_a_lowered_graph_changes_nothing(fake_world, name, one_shot):
    """Kernels, clones and comm buffers are left as they are by a second lowering. (With
    auto_select, an explicit `all_reduce_` of a clone is itself a one-shot candidate, so
    a graph lowered without it may change when lowered again with it.)"""
    from conformance.canonical import canonical_graph

    config = ONE_SHOT if one_shot else CommLoweringConfig()
    shapes = [(4,), (2, 3)] if name == "ar_coalesced" else [(4,)]
    once = lower(traced(name, *shapes), config)
    assert canonical_graph(lower(once, config)) == canonical_graph(once)


def test_cl1_bad_arguments_are_refused(fake_world):
    with pytest.raises(TypeError, match=r"gm: .*\[CL-1\]"):
        lower(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"config: .*\[CL-1\]"):
        lower(traced("ar_intermediate"), {"auto_select": True})
    untyped = torch.fx.symbolic_trace(lambda x: fc.ops.all_reduce(x, "sum", "0"))
    with pytest.raises(ValueError, match=r"meta\['val'\].*\[CL-1\]"):
        lower(untyped)


# ---- CL-2..CL-8: the rules -------------------------------------------------------------
def test_cl2_clone_is_marked_not_to_fuse_only_under_overlap_reordering(fake_world):
    gm = traced("ar_graph_input")
    plain = node_of(lower(gm), "aten.clone.default")
    marked = node_of(lower(gm, CommLoweringConfig(reorder_for_compute_comm_overlap=True)),
                     "aten.clone.default")
    assert NO_FUSE_META not in plain.meta
    assert marked.meta[NO_FUSE_META] is True


def test_cl2_upstream_ops_are_lowered_in_their_own_namespace(fake_world):
    import torch.distributed._functional_collectives as ufc

    gm = make_fx(lambda x: ufc.all_reduce(x, "sum", "0") + 1, tracing_mode="fake")(
        torch.ones(4))
    lowered = lower(gm)
    assert targets(lowered)[:3] == ["aten.clone.default", "_c10d_functional.all_reduce_.default",
                                    "_c10d_functional.wait_tensor.default"]


def test_cl4_non_contiguous_inplace_target_reduces_a_copy_and_copies_back(fake_world):
    x = torch.ones(3, 2)
    gm = make_fx(lowering_rank._transposed_all_reduce_, tracing_mode="fake")(x)
    assert targets(lower(gm)) == [
        "aten.t.default", "aten.clone.default", "refimpl_c10d.all_reduce_.default",
        "refimpl_c10d.wait_tensor_.default", "aten.copy_.default"]


def test_cl4_non_contiguous_broadcast_target_copies_back(fake_world):
    gm = make_fx(lowering_rank._transposed_broadcast_, tracing_mode="fake")(torch.ones(3, 2))
    assert targets(lower(gm)) == [
        "aten.t.default", "aten.clone.default", "refimpl_c10d.broadcast_.default",
        "refimpl_c10d.wait_tensor_.default", "aten.copy_.default"]


def test_cl4_non_contiguous_inplace_target_without_wait_is_refused(fake_world):
    gm = make_fx(lambda x: fc.ops.all_reduce_(x.t(), "sum", "0"), tracing_mode="fake")(
        torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"non-contiguous .*needs its wait_tensor.*\[CL-4\]"):
        lower(gm)


def test_cl5_coalesced_inplace_on_non_contiguous_tensors_is_refused(fake_world):
    def program(x):
        return fc.ops.all_reduce_coalesced_([x, x.t()], "sum", "0")

    gm = make_fx(program, tracing_mode="fake")(torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"all_reduce_coalesced_ needs contiguous.*\[CL-5\]"):
        lower(gm)


def test_cl6_out_of_place_kernel_gets_a_contiguous_input(fake_world):
    gm = make_fx(lambda x: fc.ops.wait_tensor(fc.ops.all_gather_into_tensor(x.t(), 2, "0")),
                 tracing_mode="fake")(torch.ones(3, 2))
    lowered = lower(gm)
    assert targets(lowered)[:3] == ["aten.t.default", "aten.clone.default",
                                    "refimpl_c10d.all_gather_into_tensor.default"]
    clone = node_of(lowered, "aten.clone.default")
    assert clone.meta["val"].is_contiguous()


# ---- CL-9..CL-11: one-shot selection and comm buffers ----------------------------------
def test_cl9_wait_of_one_shot_all_reduce_is_skipped(fake_world):
    lowered = lower(traced("ar_small_intermediate"), ONE_SHOT)
    assert "refimpl_symm_mem.one_shot_all_reduce.default" in targets(lowered)
    assert not any("wait_tensor" in t for t in targets(lowered))


def test_cl10_not_chosen_without_auto_select_or_symm_mem(fake_world):
    assert "refimpl_c10d.all_reduce_.default" in targets(lower(traced("ar_small_intermediate")))

    def on_group(x):
        return fc.all_reduce(x * 2, "sum", fake_world)

    gm = make_fx(on_group, tracing_mode="fake")(torch.ones(4))
    assert "refimpl_c10d.all_reduce_.default" in targets(lower(gm, ONE_SHOT))


@pytest.mark.parametrize("case, reason", [
    ("avg", r"reduce_op is 'avg'; one-shot all-reduce only sums"),
    ("threshold", r"has 16 bytes, over one_shot_all_reduce_threshold_bytes = 8"),
    ("graph_input", r"is a graph input"),
    ("no_symm_mem", r"symmetric memory is not enabled for group"),
    ("dtype", r"has dtype torch.float64, which the one-shot kernel does not support"),
])
def test_cl21_forced_one_shot_is_refused_with_the_reason(fake_world, case, reason):
    config = FORCE
    if case == "avg":
        gm = traced("ar_small_avg")
    elif case == "threshold":
        gm = traced("ar_small_intermediate")
        config = CommLoweringConfig(force_one_shot_all_reduce=True,
                                    one_shot_all_reduce_threshold_bytes=8)
    elif case == "graph_input":
        gm = traced("ar_small_graph_input")
    elif case == "dtype":
        gm = make_fx(lambda x: fc.all_reduce(x * 2, "sum", "0"), tracing_mode="fake")(
            torch.ones(4, dtype=torch.float64))
        assert "refimpl_c10d.all_reduce_.default" in targets(lower(gm, ONE_SHOT))
    else:
        gm = make_fx(lambda x: fc.all_reduce(x * 2, "sum", fake_world), tracing_mode="fake")(
            torch.ones(4))
    with pytest.raises(CommBufferError, match=reason + r".*\[CL-21\]"):
        lower(gm, config)


def test_cl10_forced_one_shot_lowers_what_it_can(fake_world):
    lowered = lower(traced("ar_small_intermediate"), FORCE)
    assert "refimpl_symm_mem.one_shot_all_reduce.default" in targets(lowered)


def _producer(gm, name_part):
    return next(n for n in gm.graph.nodes if name_part in n.name)


@torch.library.custom_op("refimpl_lowering_test::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_double.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.parametrize("case, reason", [
    ("graph_input", r"'x_1' is a graph input: its memory is allocated by the caller"),
    ("view", r"returns a view or alias of another buffer"),
    ("no_out", r"aten._to_copy.default, which has no out= overload"),
    ("not_aten", r"refimpl_lowering_test.double.default, which is not an ATen op"),
    ("symbolic", r"has a symbolic size"),
])
def test_cl11_buffers_that_cannot_be_comm_buffers_are_refused(fake_world, case, reason):
    programs = {
        "graph_input": lambda x: x + 1,
        "view": lambda x: (x + 1).view(2, 2),
        # _to_copy.out exists, but without dtype: not the same arguments (CL-11)
        "no_out": lambda x: x.to(torch.float64),
        "not_aten": lambda x: _double(x),
        "symbolic": lambda x: x + 1,
    }
    mode = "symbolic" if case == "symbolic" else "fake"
    gm = make_fx(programs[case], tracing_mode=mode)(torch.ones(4))
    node = {"graph_input": lambda: _producer(gm, "x_1"), "view": lambda: _producer(gm, "view"),
            "no_out": lambda: _producer(gm, "_to_copy"),
            "not_aten": lambda: _producer(gm, "double"),
            "symbolic": lambda: _producer(gm, "add")}[case]()
    assert comm_buffer_refusal(node) is not None
    with pytest.raises(CommBufferError, match=reason + r".*\[CL-11\]"):
        realize_as_comm_buffer(node, "0", alloc_id=1)


def test_cl11_producer_writes_straight_into_the_comm_buffer(fake_world):
    lowered = lower(traced("ar_small_intermediate"), ONE_SHOT)
    nodes = [n for n in lowered.graph.nodes if n.op == "call_function"]
    alloc, producer, one_shot = nodes[:3]
    assert alloc.target.__name__ == "empty_strided_p2p"
    assert producer.target is torch.ops.aten.mul.out and producer.kwargs["out"] is alloc
    assert one_shot.args[0] is producer
    assert alloc.meta[COMM_BUFFER_META] == {"group_name": "0", "alloc_id": alloc.args[5],
                                            "type": "symm_mem"}


# ---- CL-12, CL-13: persistent allocation -----------------------------------------------
def alloc_ids(gm, config=ONE_SHOT):
    return [b["alloc_id"] for b in comm_buffers(lower(gm, config))]


def test_cl12_alloc_ids_are_stable_across_compiles_and_distinct_within_a_graph(fake_world):
    def two(x):
        a = fc.all_reduce(x * 2, "sum", "0")
        b = fc.all_reduce(x * 3, "sum", "0")
        return a + b

    first = alloc_ids(make_fx(two, tracing_mode="fake")(torch.ones(4)))
    second = alloc_ids(make_fx(two, tracing_mode="fake")(torch.ones(4)))
    assert len(first) == 2 and len(set(first)) == 2
    assert first == second
    assert all(isinstance(i, int) and 0 <= i < 2**63 for i in first)
    other = alloc_ids(make_fx(two, tracing_mode="fake")(torch.ones(4)),
                      CommLoweringConfig(auto_select=True, alloc_id_namespace="layer1"))
    assert not set(other) & set(first)


@pytest.mark.filterwarnings("ignore:refimpl_c10d..wait_tensor:UserWarning")
def test_cl12_forward_and_backward_graphs_get_different_alloc_ids(fake_world):
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function

    graphs = []

    def capture(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm)

    def f(x):
        y = fc.all_reduce(x * 2, "sum", "0")
        return (y * y).sum()

    aot_function(f, fw_compiler=capture, bw_compiler=capture)(
        torch.ones(4, requires_grad=True)).backward()
    forward, backward = graphs
    fw_ids, bw_ids = alloc_ids(forward), alloc_ids(backward)
    assert len(fw_ids) == 1 and len(bw_ids) == 1
    assert fw_ids != bw_ids


def test_cl13_comm_buffers_are_marked_and_never_escape_the_graph(fake_world):
    lowered = lower(make_fx(lowering_rank._comm_buffer_escapes, tracing_mode="fake")(
        torch.ones(4)), ONE_SHOT)
    marked = [n for n in lowered.graph.nodes if COMM_BUFFER_META in n.meta]
    assert len(marked) == 2  # the allocation and the producer writing into it
    output = next(n for n in lowered.graph.nodes if n.op == "output")
    returned = output.args[0][1]
    assert COMM_BUFFER_META not in returned.meta
    assert returned.target is torch.ops.aten.clone.default


def test_cl12_cl13_persistent_buffers_on_two_ranks():
    ranks = run_on_ranks(lowering_rank.persistent_comm_buffers, 2)
    assert ranks[0]["ids"] == ranks[1]["ids"] == ranks[0]["ids_again"]
    x = [inputs_for(r, [(4, 5)])[0] for r in range(2)]
    want = oracle.reduce([t * 2 for t in x], "sum") + 1
    y = [t * 3 for t in x]
    for result in ranks:
        for value in result["results"]:
            torch.testing.assert_close(value, want)
        reduced, escaped, escaped_is_symm, again = result["escaping"]
        torch.testing.assert_close(reduced, oracle.reduce(y, "sum"))
        assert escaped_is_symm is False
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(result["escaping"][1], y[rank])
        torch.testing.assert_close(result["escaping"][3], y[rank])


# ---- CL-15: the same values as before lowering -----------------------------------------
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("one_shot", [False, True], ids=["default", "one_shot"])
def test_cl15_lowered_programs_compute_what_the_eager_ones_do(world_size, one_shot):
    config = ONE_SHOT if one_shot else CommLoweringConfig()
    ranks = run_on_ranks(lowering_rank.every_program, world_size, config, one_shot)
    for rank, results in enumerate(ranks):
        for name, (want, got, _) in results.items():
            torch.testing.assert_close(got, want, msg=lambda m, n=name, r=rank: f"{n} r{r}: {m}")
        went_one_shot = {name for name, r in results.items() if r[2]}
        # Small sum all_reduces of intermediates; not graph inputs, avg or coalesced ops.
        assert went_one_shot == (ONE_SHOT_PROGRAMS if one_shot else set())


def test_cl4_non_contiguous_broadcast_on_two_ranks():
    ranks = run_on_ranks(lowering_rank.non_contiguous_broadcast_, 2)
    src_input = ranks[1][1]
    for out, _ in ranks:
        torch.testing.assert_close(out, src_input)


def test_cl4_non_contiguous_inplace_on_two_ranks():
    ranks = run_on_ranks(lowering_rank.non_contiguous_all_reduce_, 2)
    xs = [x for _, x in ranks]
    for out, _ in ranks:
        torch.testing.assert_close(out, oracle.reduce(xs, "sum"))


# ---- CL-16: bad input ------------------------------------------------------------------
@pytest.mark.parametrize("field, value, error", [
    ("one_shot_all_reduce_threshold_bytes", -1, ValueError),
    ("one_shot_all_reduce_threshold_bytes", True, TypeError),
    ("one_shot_all_reduce_threshold_bytes", 1.5, TypeError),
    ("auto_select", 1, TypeError),
    ("force_one_shot_all_reduce", "yes", TypeError),
    ("reorder_for_compute_comm_overlap", None, TypeError),
    ("alloc_id_namespace", 3, TypeError),
])
def test_cl16_bad_config_fields_are_refused_when_the_config_is_made(field, value, error):
    with pytest.raises(error, match=rf"{field}: .*\[CL-16\]"):
        CommLoweringConfig(**{field: value})
    assert CommLoweringConfig(one_shot_all_reduce_threshold_bytes=0)  # 0 is a byte count


def test_cl16_a_collective_on_an_unknown_group_is_refused(fake_world):
    gm = traced("ar_small_intermediate")
    node = next(n for n in gm.graph.nodes if "all_reduce" in str(n.target))
    node.args = (node.args[0], node.args[1], "no-such-group")
    with pytest.raises(ValueError, match=rf"gm: node '{node.name}'.*group_name 'no-such-group'"
                                         r".*\[CL-16\]"):
        lower(gm)


def test_cl16_a_collective_missing_an_argument_is_refused(fake_world):
    gm = traced("ar_small_intermediate")
    node = next(n for n in gm.graph.nodes if "all_reduce" in str(n.target))
    node.args = node.args[:2]
    with pytest.raises(ValueError, match=rf"gm: node '{node.name}'.*'group_name' \[CL-16\]"):
        lower(gm)
