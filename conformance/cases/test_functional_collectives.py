"""Conformance: functional collectives (SPEC section 1, FC).

Eager values of every op against the single-process oracle (every group form, dtype and
world size 2 and 4, every rank), AsyncCollectiveTensor semantics, the observable work
registry, bad inputs refused in eager and at trace time, gradients, traced graphs as
canonical goldens shared by all backends, dead-code elimination, and errors between
ranks: mismatched calls, disagreeing rank lists, peers that die or never come.
"""

from __future__ import annotations

import datetime
import functools
import gc
import os
import time
import uuid
import weakref

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline

from conformance import funcol_cases, oracle, pg_methods
from conformance.canonical import canonical_graph
from conformance.funcol_cases import DTYPES, GROUP_FORMS, cases_for, funcol_api, waited
from conformance.harness import run
from refimpl.multiprocess import RankError

WORLD_SIZES = [2, 4]
VALUE_PARAMS = [(w, form, d, case) for w in WORLD_SIZES for form in GROUP_FORMS
                for d in DTYPES for case in cases_for(DTYPES[d])]
# refimpl's knobs for cases that make a peer miss on purpose (other backends ignore them).
SHORT_CHECK_TIMEOUT = {"REFIMPL_CHECK_TIMEOUT_S": "1"}


def _error(fn) -> tuple[str, str, bool]:
    """(exception type name, message, is a ValueError) of `fn()`, or 'no error'."""
    try:
        waited(fn())
    except Exception as exc:
        return type(exc).__name__, str(exc), isinstance(exc, ValueError)
    return "no error", "", False


# ---- FC-1: the op library's schemas ----------------------------------------------------
# Upstream `_c10d_functional`'s argument names, in order; "!" marks a mutated argument,
# "*" a keyword-only one.
SCHEMAS = {
    "all_reduce": ["input", "reduce_op", "group_name"],
    "all_reduce_": ["input!", "reduce_op", "group_name"],
    "all_reduce_coalesced": ["inputs", "reduce_op", "group_name"],
    "all_reduce_coalesced_": ["inputs!", "reduce_op", "group_name"],
    "all_gather_into_tensor": ["input", "group_size", "group_name"],
    "all_gather_into_tensor_coalesced": ["inputs", "group_size", "group_name"],
    "all_gather_into_tensor_out": ["input", "group_size", "group_name", "*out!"],
    "reduce_scatter_tensor": ["input", "reduce_op", "group_size", "group_name"],
    "reduce_scatter_tensor_coalesced": ["inputs", "reduce_op", "group_size", "group_name"],
    "all_to_all_single": ["input", "output_split_sizes", "input_split_sizes", "group_name"],
    "broadcast": ["input", "src", "group_name"],
    "broadcast_": ["input!", "src", "group_name"],
    "isend": ["tensor", "dst", "tag", "group_name"],
    "irecv": ["tensor", "src", "tag", "group_name"],
    "batch_p2p_ops": ["op_list", "peer_list", "tag_list", "tensors", "group_name"],
    "wait_tensor": ["tensor"],
}


def _arguments(schema) -> list[str]:
    def spelled(arg):
        mutated = arg.alias_info is not None and arg.alias_info.is_write
        return ("*" if arg.kwarg_only else "") + arg.name + ("!" if mutated else "")

    return [spelled(a) for a in schema.arguments]


@pytest.mark.spec("FC-1")
@pytest.mark.parametrize("op", list(SCHEMAS))
def test_op_schema(backend, op):
    fc = backend.require("functional_collectives")
    if not hasattr(fc.ops, op):
        pytest.skip(f"torch {torch.__version__} has no functional {op}")  # before 2.12
    schema = getattr(fc.ops, op).default._schema
    assert _arguments(schema) == SCHEMAS[op], f"{op}: {schema}"
    mutable = any(a.endswith("!") for a in SCHEMAS[op])
    assert schema.is_mutable == mutable, f"{op}: {schema}"


# ---- FC-2: results are fresh, contiguous, and leave the input alone --------------------
def _fresh_results(spec):
    fc = funcol_api(spec)
    me, n, world = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    name = fc.resolve_group_name(world)
    base = oracle.rank_input(me, (3, 2 * n), torch.float32, salt=11)
    x = base.t()  # non-contiguous, 2n x 3
    before = x.clone()
    results = {
        "all_reduce": fc.ops.all_reduce(x, "sum", name),
        "all_gather_into_tensor": fc.ops.all_gather_into_tensor(x, n, name),
        "reduce_scatter_tensor": fc.ops.reduce_scatter_tensor(x, "sum", n, name),
        # Explicit equal splits: what an empty list means is FC-49's (strict), not FC-2's.
        "all_to_all_single": fc.ops.all_to_all_single(x, [2] * n, [2] * n, name),
        "broadcast": fc.ops.broadcast(x, n - 1, name),
    }
    facts = {}
    for op, r in results.items():
        r = fc.ops.wait_tensor(r)
        facts[op] = (r.is_contiguous(),
                     r.untyped_storage().data_ptr() != base.untyped_storage().data_ptr(), r)
    return facts, torch.equal(x, before)


@pytest.mark.spec("FC-2")
def test_results_are_fresh_contiguous_tensors(backend):
    backend.require("functional_collectives")
    n = 2
    xs = [oracle.rank_input(r, (3, 2 * n), torch.float32, salt=11).t() for r in range(n)]
    want = {
        "all_reduce": oracle.reduce(xs, "sum"), "all_gather_into_tensor": oracle.all_gather(xs),
        "reduce_scatter_tensor": None,  # per rank, below
        "all_to_all_single": None,
        "broadcast": xs[n - 1],
    }
    for rank, (facts, input_unchanged) in enumerate(run(backend, _fresh_results, n)):
        assert input_unchanged, f"rank {rank}: an out-of-place op modified its input"
        want["reduce_scatter_tensor"] = oracle.reduce_scatter(xs, "sum", rank)
        want["all_to_all_single"] = oracle.all_to_all_single(xs, rank)
        for op, (contiguous, own_storage, value) in facts.items():
            assert contiguous, f"rank {rank} {op}: result is not contiguous"
            assert own_storage, f"rank {rank} {op}: result shares the input's storage"
            assert torch.equal(value, want[op]), f"rank {rank} {op}: {value} != {want[op]}"


# ---- FC-3: fake kernels: shapes, and the eager checks at trace time --------------------
def _fake_shapes(spec):
    from torch._subclasses.fake_tensor import FakeTensorMode

    fc = funcol_api(spec)
    n = dist.get_world_size()
    name = fc.resolve_group_name(dist.group.WORLD)
    shapes = {}
    with FakeTensorMode():
        x = torch.empty(2 * n, 3, dtype=torch.bfloat16)
        shapes["all_reduce"] = fc.ops.all_reduce(x, "sum", name)
        shapes["all_gather_into_tensor"] = fc.ops.all_gather_into_tensor(x, n, name)
        shapes["reduce_scatter_tensor"] = fc.ops.reduce_scatter_tensor(x, "sum", n, name)
        shapes["all_to_all_single:empty"] = fc.ops.all_to_all_single(x, [], [], name)
        outs = [2 * j + 2 for j in range(n)]  # rows received: more than the rows sent
        shapes["all_to_all_single:uneven"] = fc.ops.all_to_all_single(x, outs, [2] * n, name)
        shapes["broadcast"] = fc.ops.broadcast(x, 0, name)
        shapes["wait_tensor"] = fc.ops.wait_tensor(x)
        shapes["all_gather_into_tensor_coalesced"] = fc.ops.all_gather_into_tensor_coalesced(
            [x, x[:1]], n, name)[1]
        shapes["reduce_scatter_tensor_coalesced"] = fc.ops.reduce_scatter_tensor_coalesced(
            [x, x[:n]], "sum", n, name)[1]
    return {op: (str(t.dtype), list(t.shape)) for op, t in shapes.items()}


N, BF16 = 2, "torch.bfloat16"
FAKE_SHAPES = {
    "all_reduce": (BF16, [2 * N, 3]), "all_gather_into_tensor": (BF16, [2 * N * N, 3]),
    "reduce_scatter_tensor": (BF16, [2, 3]), "all_to_all_single:empty": (BF16, [2 * N, 3]),
    "all_to_all_single:uneven": (BF16, [sum(2 * j + 2 for j in range(N)), 3]),
    "broadcast": (BF16, [2 * N, 3]), "wait_tensor": (BF16, [2 * N, 3]),
    "all_gather_into_tensor_coalesced": (BF16, [N, 3]),
    "reduce_scatter_tensor_coalesced": (BF16, [1, 3]),
}


@functools.cache
def _fake_shape_results(backend):
    return run(backend, _fake_shapes, N)


def _fake_shape_rules(op):
    """An empty split list read as equal splits is FC-49 (strict): upstream's op reads it
    as 0 rows; the other shapes are upstream's contract (CF-14: a case has its rules' level)."""
    return ("FC-38", "FC-49") if op == "all_to_all_single:empty" else ("FC-38", "FC-45")


@pytest.mark.parametrize("op", [pytest.param(o, marks=[pytest.mark.xdist_group("fake-shapes"),
                                                       pytest.mark.spec(*_fake_shape_rules(o))])
                                for o in FAKE_SHAPES])
def test_fake_kernels_give_result_shapes(backend, op):
    backend.require("functional_collectives")
    for rank, shapes in enumerate(_fake_shape_results(backend)):
        assert shapes[op] == FAKE_SHAPES[op], f"rank {rank} {op}: {shapes[op]}"


# Each op traced with one bad argument: (rule, argument the error must name, call).
# `x` is 4 x 4 float32, `xi` int64, `n` the group size, `g` the group name.
TRACE_REFUSALS = {
    "all_reduce-unknown_reduce_op": ("FC-17", "reduce_op",
                                     lambda o, x, xi, n, g: o.all_reduce(x, "median", g)),
    "all_reduce-avg_of_int": ("FC-18", "reduce_op",
                              lambda o, x, xi, n, g: o.all_reduce(xi, "avg", g)),
    "all_reduce-band_of_float": ("FC-18", "reduce_op",
                                 lambda o, x, xi, n, g: o.all_reduce(x, "band", g)),
    "all_reduce-bxor_of_float": ("FC-18", "reduce_op",
                                 lambda o, x, xi, n, g: o.all_reduce(x, "bxor", g)),
    "all_reduce-unknown_group": ("FC-13", "group_name",
                                 lambda o, x, xi, n, g: o.all_reduce(x, "sum", "no-such-group")),
    "all_reduce_-avg_of_int": ("FC-18", "reduce_op",
                               lambda o, x, xi, n, g: o.all_reduce_(xi, "avg", g)),
    "all_reduce_coalesced-second_bad": (
        "FC-18", "reduce_op", lambda o, x, xi, n, g: o.all_reduce_coalesced([x, xi], "avg", g)),
    "all_reduce_coalesced_-second_bad": (
        "FC-18", "reduce_op", lambda o, x, xi, n, g: o.all_reduce_coalesced_([x, xi], "avg", g)),
    "all_gather-group_size_below": (
        "FC-19", "group_size", lambda o, x, xi, n, g: o.all_gather_into_tensor(x, n - 1, g)),
    "all_gather-group_size_above": (
        "FC-19", "group_size", lambda o, x, xi, n, g: o.all_gather_into_tensor(x, n + 1, g)),
    "all_gather-0d": ("FC-20", "input", lambda o, x, xi, n, g: o.all_gather_into_tensor(
        x[0, 0], n, g)),
    "all_gather_coalesced-group_size_below": (
        "FC-19", "group_size",
        lambda o, x, xi, n, g: o.all_gather_into_tensor_coalesced([x], n - 1, g)),
    "all_gather_out-shape": ("FC-20", "out", lambda o, x, xi, n, g: o.all_gather_into_tensor_out(
        x, n, g, out=x.new_empty(4 * n + 1, 4))),
    "all_gather_out-dtype": ("FC-20", "out", lambda o, x, xi, n, g: o.all_gather_into_tensor_out(
        x, n, g, out=xi.new_empty(4 * n, 4))),
    # int32 has float32's width: the dtype, not its size, must match
    "all_gather_out-dtype_of_the_same_width": (
        "FC-20", "out", lambda o, x, xi, n, g: o.all_gather_into_tensor_out(
            x, n, g, out=torch.empty(4 * n, 4, dtype=torch.int32))),
    "all_gather_out-device": ("FC-30", "out", lambda o, x, xi, n, g: o.all_gather_into_tensor_out(
        x, n, g, out=torch.empty(4 * n, 4, device="meta"))),
    "reduce_scatter-indivisible": (
        "FC-20", "input", lambda o, x, xi, n, g: o.reduce_scatter_tensor(x[:3], "sum", n, g)),
    "reduce_scatter-group_size_below": (
        "FC-19", "group_size", lambda o, x, xi, n, g: o.reduce_scatter_tensor(x, "sum", n - 1, g)),
    "reduce_scatter-unknown_reduce_op": (
        "FC-17", "reduce_op", lambda o, x, xi, n, g: o.reduce_scatter_tensor(x, "median", n, g)),
    "reduce_scatter-0d": (
        "FC-20", "input", lambda o, x, xi, n, g: o.reduce_scatter_tensor(x[0, 0], "sum", n, g)),
    "reduce_scatter_coalesced-second_indivisible": (
        "FC-20", "input",
        lambda o, x, xi, n, g: o.reduce_scatter_tensor_coalesced([x, x[:3]], "sum", n, g)),
    "all_to_all-input_splits_sum": (
        "FC-21", "input_split_sizes",
        lambda o, x, xi, n, g: o.all_to_all_single(x, [2] * n, [1] * n, g)),
    "all_to_all-input_splits_count": (
        "FC-21", "input_split_sizes",
        lambda o, x, xi, n, g: o.all_to_all_single(x, [2] * n, [4], g)),
    "all_to_all-input_split_negative": (
        "FC-21", "input_split_sizes",
        lambda o, x, xi, n, g: o.all_to_all_single(x, [2] * n, [-1, 5] + [0] * (n - 2), g)),
    "all_to_all-output_splits_count": (
        "FC-21", "output_split_sizes",
        lambda o, x, xi, n, g: o.all_to_all_single(x, [4], [2] * n, g)),
    "all_to_all-output_split_negative": (
        "FC-21", "output_split_sizes",
        lambda o, x, xi, n, g: o.all_to_all_single(x, [-1, 5] + [0] * (n - 2), [2] * n, g)),
    "all_to_all-empty_splits_indivisible": (
        "FC-21", "split", lambda o, x, xi, n, g: o.all_to_all_single(x[:3], [], [], g)),
    "all_to_all-0d": ("FC-21", "input", lambda o, x, xi, n, g: o.all_to_all_single(
        x[0, 0], [], [], g)),
    "broadcast-src_is_group_size": (
        "FC-22", "src", lambda o, x, xi, n, g: o.broadcast(x, n, g)),
    "broadcast-src_negative": ("FC-22", "src", lambda o, x, xi, n, g: o.broadcast(x, -1, g)),
    "broadcast_-src_is_group_size": (
        "FC-22", "src", lambda o, x, xi, n, g: o.broadcast_(x, n, g)),
}
TRACERS = ["make_fx", "FakeTensorMode"]


def _apply(call, ops, x, xi, *, n, g):
    return call(ops, x, xi, n, g)


def _trace_refusals(spec):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    fc = funcol_api(spec)
    n, g = dist.get_world_size(), fc.resolve_group_name(dist.group.WORLD)
    registry = fc.work_registry_size
    before = registry() if registry else None
    outcomes = {}
    for name, (_, _, call) in TRACE_REFUSALS.items():
        x, xi = torch.ones(4, 4), torch.ones(4, 4, dtype=torch.int64)
        traced = make_fx(functools.partial(_apply, call, fc.ops, n=n, g=g), tracing_mode="fake")
        outcomes[(name, "make_fx")] = _error(lambda: traced(x, xi))
        with FakeTensorMode():
            fx, fxi = torch.ones(4, 4), torch.ones(4, 4, dtype=torch.int64)
            outcomes[(name, "FakeTensorMode")] = _error(lambda: call(fc.ops, fx, fxi, n, g))
    started = registry() - before if registry else 0
    return outcomes, started


@functools.cache
def _trace_outcomes(backend):
    return run(backend, _trace_refusals, 2)


@pytest.mark.spec("FC-3", "FC-27")
@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group("trace"))
                                  for n in TRACE_REFUSALS])
def test_bad_arguments_fail_at_trace_time(backend, name, tracer):
    backend.require("functional_collectives")
    rule, arg, _ = TRACE_REFUSALS[name]
    for rank, (outcomes, started) in enumerate(_trace_outcomes(backend)):
        exc_type, message, is_value_error = outcomes[(name, tracer)]
        where = f"rank {rank} {name} under {tracer} [{rule}, FC-3]"
        assert exc_type != "no error", f"{where}: traced without error"
        assert is_value_error, f"{where}: {exc_type}, not a ValueError: {message}"
        assert arg in message, f"{where}: the message does not name {arg!r}: {message}"
        assert started == 0, f"{where}: tracing started {started} collectives"


# ---- FC-4: in-place ops write into their argument and return it ------------------------
def _in_place(spec):
    fc = funcol_api(spec)
    me, n = dist.get_rank(), dist.get_world_size()
    name = fc.resolve_group_name(dist.group.WORLD)
    x = oracle.rank_input(me, (2, 3), torch.float32, salt=17)
    facts = {}
    y = x.clone()
    r = fc.ops.all_reduce_(y, "sum", name)
    fc.ops.wait_tensor(r)
    facts["all_reduce_"] = (r.data_ptr() == y.data_ptr(), y)
    y = x.clone()
    r = fc.ops.broadcast_(y, n - 1, name)
    fc.ops.wait_tensor(r)
    facts["broadcast_"] = (r.data_ptr() == y.data_ptr(), y)
    out = x.new_empty(2 * n, 3)
    r = fc.ops.all_gather_into_tensor_out(x, n, name, out=out)
    fc.ops.wait_tensor(r)
    facts["all_gather_into_tensor_out"] = (r.data_ptr() == out.data_ptr(), out)
    ys = [x.clone(), x * 2]
    rs = fc.ops.all_reduce_coalesced_(ys, "max", name)
    for t in rs:
        fc.ops.wait_tensor(t)
    same = [a.data_ptr() for a in rs] == [b.data_ptr() for b in ys]
    facts["all_reduce_coalesced_"] = (same, torch.cat(ys))
    return facts


@pytest.mark.spec("FC-39")
def test_in_place_ops_write_into_their_argument(backend):
    backend.require("functional_collectives")
    n = 2
    xs = [oracle.rank_input(r, (2, 3), torch.float32, salt=17) for r in range(n)]
    want = {
        "all_reduce_": oracle.reduce(xs, "sum"), "broadcast_": xs[n - 1],
        "all_gather_into_tensor_out": oracle.all_gather(xs),
        "all_reduce_coalesced_": torch.cat([oracle.reduce(xs, "max"),
                                            oracle.reduce([x * 2 for x in xs], "max")]),
    }
    for rank, facts in enumerate(run(backend, _in_place, n)):
        for op, (returns_argument, value) in facts.items():
            assert returns_argument, f"rank {rank} {op}: did not return its mutated argument"
            assert torch.equal(value, want[op]), f"rank {rank} {op}: {value} != {want[op]}"


# ---- FC-5, FC-9..FC-11: AsyncCollectiveTensor -------------------------------------------
def _async_semantics(spec):
    fc = funcol_api(spec)
    x = torch.full((4,), float(dist.get_rank() + 1))
    y = fc.all_reduce(x, "sum", dist.group.WORLD)
    facts = {"async": isinstance(y, fc.AsyncCollectiveTensor)}
    v = y.view(2, 2)
    facts["view_async"] = isinstance(v, fc.AsyncCollectiveTensor)
    z = v + 0
    facts["use_plain"] = type(z) is torch.Tensor
    facts["value"] = z.flatten().tolist()
    facts["input_unchanged"] = x.tolist() == [float(dist.get_rank() + 1)] * 4
    w = fc.all_reduce(x, "max", dist.group.WORLD).wait()
    facts["wait_plain"] = type(w) is torch.Tensor
    facts["wait_value"] = w.tolist()
    facts["tolist"] = fc.all_reduce(x, "min", dist.group.WORLD).tolist()
    facts["numpy"] = fc.all_reduce(x, "sum", dist.group.WORLD).numpy().tolist()
    facts["repr_has_values"] = "2., 2., 2., 2." in repr(fc.all_reduce(x, "max",
                                                                          dist.group.WORLD))
    raw = fc.ops.all_reduce(x, "sum", dist.group.WORLD.group_name)
    facts["wait_returns_arg"] = fc.wait_tensor(raw) is raw
    facts["wait_twice"] = fc.wait_tensor(raw).tolist()
    facts["wait_nothing_pending"] = fc.wait_tensor(x) is x
    done = fc.ops.all_reduce(x, "sum", dist.group.WORLD.group_name)
    facts["op_wait_value"] = fc.ops.wait_tensor(done).tolist()
    return facts


@pytest.mark.spec("FC-5", "FC-9", "FC-10", "FC-11")
def test_async_collective_tensor(backend):
    backend.require("functional_collectives")
    for facts in run(backend, _async_semantics, 2):
        assert facts == {
            "async": True, "view_async": True, "use_plain": True, "value": [3.0] * 4,
            "input_unchanged": True, "wait_plain": True, "wait_value": [2.0] * 4,
            "tolist": [1.0] * 4, "numpy": [3.0] * 4, "repr_has_values": True,
            "wait_returns_arg": True, "wait_twice": [3.0] * 4, "wait_nothing_pending": True,
            "op_wait_value": [3.0] * 4}


def _gathered_on_dim_one(spec):
    fc = funcol_api(spec)
    registry = getattr(fc, "work_registry_size", None)
    x = torch.full((2, 1), float(dist.get_rank() + 1))
    before = registry() if registry else 0
    y = fc.all_gather_tensor(x, 1, dist.group.WORLD)
    pending = registry() > before if registry else True
    with torch.no_grad():  # an input that requires grad, under no_grad: nothing recorded
        g = fc.all_gather_tensor(x.clone().requires_grad_(), 1, dist.group.WORLD)
    facts = {"async": isinstance(y, fc.AsyncCollectiveTensor), "pending": pending,
             "no_grad_async": isinstance(g, fc.AsyncCollectiveTensor),
             "values": [waited(y).tolist(), waited(g).tolist()]}
    facts["drained"] = registry() == before if registry else True
    return facts


@pytest.mark.spec("FC-40", "FC-6", "FC-14")
def test_all_gather_on_another_dim_is_pending_too(backend):
    """Gathering on dim 1 rearranges the gathered rows: eagerly, only once waited."""
    backend.require("functional_collectives")
    for rank, facts in enumerate(run(backend, _gathered_on_dim_one, 2)):
        assert facts == {"async": True, "pending": True, "no_grad_async": True,
                         "values": [[[1.0, 2.0]] * 2] * 2, "drained": True}, \
            f"rank {rank}: {facts}"


# Every view op of FC-10, applied to a pending result of shape (2, 1, 3).
VIEWS = {
    "view": lambda y: y.view(6), "reshape": lambda y: y.reshape(3, 2),
    "transpose": lambda y: y.transpose(0, 2), "permute": lambda y: y.permute(2, 0, 1),
    "select": lambda y: y.select(0, 1), "slice": lambda y: y[1:],
    "split": lambda y: y.split(1), "chunk": lambda y: y.chunk(2),
    "narrow": lambda y: y.narrow(2, 1, 2), "squeeze": lambda y: y.squeeze(1),
    "unsqueeze": lambda y: y.unsqueeze(0), "expand": lambda y: y.expand(2, 4, 3),
    "as_strided": lambda y: y.as_strided((2,), (1,)), "flatten": lambda y: y.flatten(),
    "unbind": lambda y: y.unbind(0), "detach": lambda y: y.detach(),
    "alias": lambda y: torch.ops.aten.alias(y),
}


def _views(spec):
    fc = funcol_api(spec)
    me, registry = dist.get_rank(), fc.work_registry_size
    x = oracle.rank_input(me, (2, 1, 3), torch.float32, salt=23)
    facts = {}
    for name, view in VIEWS.items():
        y = fc.all_reduce(x, "sum", dist.group.WORLD)
        pending = registry() if registry else None
        v = view(y)
        parts = list(v) if isinstance(v, (list, tuple)) else [v]
        still_pending = registry() == pending if registry else True
        is_async = all(isinstance(p, fc.AsyncCollectiveTensor) for p in parts)
        values = [waited(p).clone() for p in parts]
        # The same view of the waited result: the view of a completed one is computed
        # on the plain result (FC-10 says nothing of its type).
        y.wait()
        after = view(y)
        after = [waited(p).clone() for p in (after if isinstance(after, (list, tuple))
                                              else [after])]
        facts[name] = (is_async, still_pending, values, after)
    return facts


@pytest.mark.spec("FC-10")
@pytest.mark.parametrize("view", [pytest.param(v, marks=pytest.mark.xdist_group("views"))
                                  for v in VIEWS])
def test_view_ops_do_not_wait(backend, view):
    backend.require("functional_collectives")
    xs = [oracle.rank_input(r, (2, 1, 3), torch.float32, salt=23) for r in range(2)]
    want = VIEWS[view](oracle.reduce(xs, "sum"))
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    for rank, facts in enumerate(_view_facts(backend)):
        is_async, still_pending, values, after = facts[view]
        assert is_async, f"rank {rank}: {view} of a pending result is not pending"
        assert still_pending, f"rank {rank}: {view} waited for the collective"
        assert all(torch.equal(g, w) for g, w in zip(values, want, strict=True)), \
            f"rank {rank}: {view}: {values} != {want}"
        assert all(torch.equal(g, w) for g, w in zip(after, want, strict=True)), \
            f"rank {rank}: {view} of the waited result: {after} != {want}"


@functools.cache
def _view_facts(backend):
    return run(backend, _views, 2)


# ---- FC-5, FC-6, FC-8, FC-26: the work registry ----------------------------------------
def _registry(spec):
    fc = funcol_api(spec)
    count, world = fc.work_registry_size, dist.group.WORLD
    name = fc.resolve_group_name(world)
    seen = {"start": count()}
    y = fc.all_reduce(torch.ones(4), "sum", world)
    seen["issued"] = count()
    y.view(4)
    seen["after_view"] = count()
    (y + 0).sum()
    seen["after_use"] = count()
    y.wait()
    seen["after_wait"] = count()
    raw = fc.ops.all_reduce(torch.ones(4), "sum", name)
    seen["raw_issued"] = count()
    fc.wait_tensor(raw)
    seen["after_wait_tensor"] = count()
    fc.wait_tensor(raw)
    seen["after_second_wait"] = count()
    r = fc.all_reduce(torch.ones(1), "sum", world)
    r.numpy()
    seen["after_numpy"] = count()  # .numpy() waited: r, still alive, has no entry left
    del r
    one = fc.all_reduce(torch.ones(1), "sum", world)  # one element: pending
    seen["one_element"] = count()
    del one
    for i in range(4):
        fc.all_reduce(torch.full((8,), float(i)), "sum", world)
    gc.collect()
    seen["dropped"] = count()
    # Results that require grad, of the plain and the autograd API, dropped alike.
    for i in range(2):
        fc.all_reduce(torch.full((8,), float(i), requires_grad=True), "sum", world)
        fc.all_gather_tensor_autograd(torch.ones(4, requires_grad=True), 0, world)
    gc.collect()
    seen["dropped_requiring_grad"] = count()
    # A stale finalizer leaves alone the newer result that reuses its address (FC-8).
    a = fc.all_reduce(torch.ones(4), "sum", world)
    plain = a.wait()
    fc.ops.all_reduce_(plain, "sum", name)  # a newer result at a's address
    del a
    gc.collect()
    seen["after_stale_finalizer"] = count()
    fc.wait_tensor(plain)
    seen["stale_value"] = plain.tolist()
    # Coalesced: one entry per member, all started before any is waited (FC-26).
    parts = fc.all_reduce_coalesced([torch.ones(2), torch.ones(3), torch.ones(4)], "sum", world)
    seen["coalesced_issued"] = count()
    parts[1].wait()
    seen["coalesced_one_waited"] = count()
    seen["coalesced_values"] = [p.tolist() for p in parts]
    seen["end"] = count()
    seen["next"] = fc.all_reduce(torch.ones(2), "sum", world).tolist()
    return seen


# The strict FC-7 (a result without storage) has a case of its own, so that this one is of
# its core rules' level (CF-14).
@pytest.mark.spec("FC-5", "FC-6", "FC-8", "FC-9", "FC-11", "FC-26")
def test_work_registry(backend):
    backend.require("functional_collectives", "work_registry_size")
    for seen in run(backend, _registry, 2):
        s = seen["start"]
        assert seen == {
            "start": s, "issued": s + 1, "after_view": s + 1, "after_use": s,
            "after_wait": s, "raw_issued": s + 1, "after_wait_tensor": s,
            "after_second_wait": s, "after_numpy": s, "one_element": s + 1,
            "dropped": s, "dropped_requiring_grad": s, "after_stale_finalizer": s + 1,
            "stale_value": [4.0] * 4,
            "coalesced_issued": s + 3, "coalesced_one_waited": s + 2,
            "coalesced_values": [[2.0] * 2, [2.0] * 3, [2.0] * 4], "end": s,
            "next": [2.0, 2.0]}


# ---- FC-7: a result without storage completes before the op returns --------------------
def _storageless(spec):
    fc = funcol_api(spec)
    count, world = fc.work_registry_size, dist.group.WORLD
    start = count()
    # Held, so that no finalizer hides an entry they left.
    empties = [fc.all_reduce(torch.empty(0), "sum", world),
               fc.all_gather_tensor(torch.empty(0, 3), 0, world)]
    seen = {"empty": count() - start}
    one = fc.all_reduce(torch.ones(1), "sum", world)  # one element: pending, counted
    seen["one_element"] = count() - start
    one.wait()
    seen["shapes"] = [list(waited(e).shape) for e in empties]
    seen["end"] = count() - start
    return seen


@pytest.mark.spec("FC-7")
def test_a_result_without_storage_completes_before_the_op_returns(backend):
    """Zero elements (`data_ptr()` 0) leave no entry in the registry, where one element
    does."""
    backend.require("functional_collectives", "work_registry_size")
    for rank, seen in enumerate(run(backend, _storageless, 2)):
        assert seen == {"empty": 0, "one_element": 1, "shapes": [[0], [0, 3]], "end": 0}, \
            f"rank {rank}: {seen} [FC-7]"


# ---- FC-36: a collective in flight keeps what it communicates -------------------------
def _inputs_held_in_flight(spec):
    """Each collective's inputs, dropped by the caller as soon as it is issued: alive
    until its result is waited? A coalesced member's until its own result is. `control`:
    a tensor no collective holds, dropped, dies (the probe sees a drop)."""
    fc = funcol_api(spec)
    ops, n, me = fc.ops, dist.get_world_size(), dist.get_rank()
    name = fc.resolve_group_name(dist.group.WORLD)
    alive = {}

    def probed(label):
        x = oracle.rank_input(me, (2 * n, 3), torch.float32, salt=60 + len(alive))
        alive[label] = True
        weakref.finalize(x.untyped_storage(), alive.__setitem__, label, False)
        return x

    def held(*labels):
        gc.collect()
        return [alive[label] for label in labels]

    probed("control")
    seen = {"control": held("control")}
    calls = {
        "all_gather_into_tensor": lambda x: ops.all_gather_into_tensor(x, n, name),
        "all_gather_into_tensor_out": lambda x: ops.all_gather_into_tensor_out(
            x, n, name, out=torch.empty(2 * n * n, 3)),
        "reduce_scatter_tensor": lambda x: ops.reduce_scatter_tensor(x, "sum", n, name),
        "all_to_all_single": lambda x: ops.all_to_all_single(x, [2] * n, [2] * n, name),
    }
    for op, call in calls.items():
        result = call(probed(op))
        seen[op] = held(op)
        fc.wait_tensor(result)
    for op in ("all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"):
        labels = [f"{op}[0]", f"{op}[1]"]
        xs = [probed(label) for label in labels]
        results = (ops.all_gather_into_tensor_coalesced(xs, n, name) if "gather" in op
                   else ops.reduce_scatter_tensor_coalesced(xs, "sum", n, name))
        del xs
        seen[op] = held(*labels)
        fc.wait_tensor(results[0])
        seen[f"{op}, [0] waited"] = held(labels[1])
        fc.wait_tensor(results[1])
    return seen


@pytest.mark.spec("FC-36")
def test_a_collective_in_flight_keeps_its_inputs_until_waited(backend):
    """So on every process group, gloo's reduce_scatter (which copies its input and lets
    it go) included."""
    backend.require("functional_collectives")
    coalesced = ["all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"]
    want = {"control": [False],
            **{op: [True] for op in ("all_gather_into_tensor", "all_gather_into_tensor_out",
                                     "reduce_scatter_tensor", "all_to_all_single")},
            **{op: [True, True] for op in coalesced},
            **{f"{op}, [0] waited": [True] for op in coalesced}}
    for rank, seen in enumerate(run(backend, _inputs_held_in_flight, 2)):
        assert seen == want, f"rank {rank}: inputs alive before their wait: {seen} [FC-36]"


def _rows_out_of_order(spec):
    """Rows [[2, 0], [3, 1]] of 4: each names the group of its ranks, ascending (FC-14)."""
    fc = funcol_api(spec)
    me = dist.get_rank()
    rows, row = [[2, 0], [3, 1]], [me % 2, me % 2 + 2]
    names = [fc.resolve_group_name(g) for g in (row, rows, [[0, 2], [1, 3]], rows)]
    x = oracle.rank_input(me, (2, 3), torch.float32, salt=41)
    values = {
        "all_gather": waited(fc.all_gather_tensor(x, 0, rows)),
        "reduce_scatter": waited(fc.reduce_scatter_tensor(x, "sum", 0, rows)),
        "all_to_all": waited(fc.all_to_all_single(x, [1, 1], [1, 1], rows)),
        "broadcast": waited(fc.broadcast(x, 1, rows)),
    }
    return names, values


@pytest.mark.spec("FC-14", "FC-15")
def test_rows_out_of_order_name_the_group_of_their_ranks_ascending(backend):
    """A row [2, 0] names the group a list [0, 2] named first, and within it global rank 0
    is group rank 0: gathered first, given chunk 0, sending split 0, the src of 0."""
    backend.require("functional_collectives")
    for rank, (names, values) in enumerate(run(backend, _rows_out_of_order, 4)):
        assert len(set(names)) == 1, f"rank {rank}: one group, several names: {names}"
        members = [rank % 2, rank % 2 + 2]
        xs = [oracle.rank_input(r, (2, 3), torch.float32, salt=41) for r in members]
        index = members.index(rank)
        want = {"all_gather": oracle.all_gather(xs, 0),
                "reduce_scatter": oracle.reduce_scatter(xs, "sum", index, 0),
                "all_to_all": oracle.all_to_all_single(xs, index, [[1, 1], [1, 1]]),
                "broadcast": xs[1]}
        for name, value in values.items():
            funcol_cases.assert_same(value, want[name], f"rank {rank} {name} [FC-14]")


# ---- FC-13..FC-22, FC-24, FC-27, FC-30: bad input is refused in eager -------------------
V, VT, VTR = (ValueError,), (ValueError, TypeError), (ValueError, TypeError, RuntimeError)
BAD_INPUTS = {
    # name: (SPEC rule, exception types accepted, words the message must contain)
    "unknown_reduce_op": ("FC-17", V, ["reduce_op"]),
    "reduce_op_none": ("FC-17", V, ["reduce_op"]),
    "reduce_op_int": ("FC-17", V, ["reduce_op"]),
    "premul_sum_without_factor": ("FC-17", V, ["reduce_op"]),
    "premul_sum_of_integers": ("FC-18", VTR, ["premul"]),
    "premul_sum_integer_tensor_factor": ("FC-17", V, ["reduce_op"]),
    "premul_sum_bool_tensor_factor": ("FC-17", V, ["reduce_op"]),
    "reduce_scatter_premul_sum_int32_factor": ("FC-17", V, ["reduce_op"]),
    "coalesced_premul_sum_integer_tensor_factor": ("FC-17", V, ["reduce_op"]),
    "avg_enum_of_integers": ("FC-18", VTR, ["avg"]),
    "band_enum_of_float": ("FC-18", VTR, ["band"]),
    "reduce_scatter_unknown_reduce_op": ("FC-17", V, ["reduce_op"]),
    "avg_of_integers": ("FC-18", VTR, ["avg"]),
    # The name is case-insensitive (FC-42) for the dtype check too.
    "AVG_of_integers": ("FC-18", VTR, ["avg"]),
    "Band_of_float": ("FC-18", VTR, ["band"]),
    "avg_of_bool": ("FC-18", VTR, ["avg"]),
    "reduce_scatter_avg_of_integers": ("FC-18", VTR, ["avg"]),
    "band_of_float": ("FC-18", VTR, ["band"]),
    "bxor_of_float": ("FC-18", VTR, ["bxor"]),
    "bor_of_bfloat16": ("FC-18", VTR, ["bor"]),
    "bxor_of_complex": ("FC-18", VTR, ["bxor"]),
    "indivisible_scatter_dim": ("FC-20", V, ["divisible"]),
    "indivisible_scatter_dim_1": ("FC-20", V, ["divisible"]),
    "indivisible_raw_reduce_scatter": ("FC-20", V, ["divisible"]),
    "gather_dim_is_ndim": ("FC-20", (ValueError, IndexError), ["gather_dim"]),
    "gather_dim_below_minus_ndim": ("FC-20", (ValueError, IndexError), ["gather_dim"]),
    "gather_dim_bool": ("FC-20", V, ["gather_dim"]),
    "scatter_dim_is_ndim": ("FC-20", (ValueError, IndexError), ["scatter_dim"]),
    "all_gather_of_0d": ("FC-20", V, ["dim"]),
    "raw_all_gather_of_0d": ("FC-20", V, ["dim"]),
    "raw_reduce_scatter_of_0d": ("FC-20", V, ["dim"]),
    "all_to_all_of_0d_equal_splits": ("FC-21", V, ["input", "dim"]),
    "unequal_rank_rows": ("FC-15", V, ["group", "size"]),
    "duplicate_ranks": ("FC-15", V, ["group", "duplicate"]),
    "rows_mixed_with_ranks": ("FC-15", VT, ["group", "FC-15"]),
    "rank_repeated_across_rows": ("FC-15", V, ["group", "duplicate"]),
    "rank_is_world_size": ("FC-15", V, ["group", "outside"]),
    "negative_rank": ("FC-15", V, ["group", "-1"]),
    "rank_is_bool": ("FC-15", (TypeError,), ["group", "True"]),
    "empty_rank_list": ("FC-15", V, ["group", "empty"]),
    "caller_not_in_rank_list": ("FC-15", V, ["group"]),
    "mesh_2d_without_dim": ("FC-16", V, ["group", "dim"]),
    "mesh_dim_bool": ("FC-16", V, ["group", "dim"]),
    "unknown_group_name": ("FC-13", V, ["no-such-group"]),
    "bad_group_type": ("FC-13", (TypeError,), ["group"]),
    "group_size_below": ("FC-19", V, ["group_size"]),
    "group_size_above": ("FC-19", V, ["group_size"]),
    "reduce_scatter_group_size_below": ("FC-19", V, ["group_size"]),
    "coalesced_group_size_below": ("FC-19", V, ["group_size"]),
    "input_splits_sum": ("FC-21", VTR, ["split"]),
    "splits_count_below": ("FC-21", VTR, ["split"]),
    "splits_count_above": ("FC-21", VTR, ["split"]),
    "negative_input_split": ("FC-21", VTR, ["input_split_sizes"]),
    "negative_output_split": ("FC-21", VTR, ["output_split_sizes"]),
    "empty_splits_indivisible": ("FC-21", VTR, ["split"]),
    "src_is_group_size": ("FC-22", V, ["src"]),
    "src_negative": ("FC-22", V, ["src"]),
    "src_bool": ("FC-22", V, ["src"]),
    "raw_src_is_group_size": ("FC-22", V, ["src"]),
    "out_wrong_shape": ("FC-20", V, ["out"]),
    "out_wrong_dtype": ("FC-20", V, ["out"]),
    "out_dtype_of_the_same_width": ("FC-20", V, ["out"]),
    "out_on_another_device": ("FC-30", V, ["out", "device"]),
    "out_not_contiguous": ("FC-4", V, ["out", "contiguous"]),
    "input_on_meta": ("FC-30", V, ["meta"]),
    "raw_input_on_meta": ("FC-30", V, ["meta"]),
    "reduce_scatter_on_meta": ("FC-30", V, ["meta"]),
    "all_to_all_on_meta": ("FC-30", V, ["meta"]),
    "broadcast_on_meta": ("FC-30", V, ["meta"]),
    "all_reduce_coalesced_on_meta": ("FC-30", V, ["meta"]),
    "all_reduce_in_place_not_contiguous": ("FC-4", V, ["contiguous"]),
    "broadcast_in_place_not_contiguous": ("FC-4", V, ["contiguous"]),
    "non_differentiable_reduction": ("FC-24", (RuntimeError,), ["product"]),
    "non_differentiable_reduce_scatter": ("FC-24", (RuntimeError,), ["product"]),
    "non_differentiable_raw_op": ("FC-24", (RuntimeError,), ["product"]),
    "coalesced_second_member_bad": ("FC-27", VTR, ["avg"]),
    "coalesced_in_place_second_member_bad": ("FC-27", VTR, ["avg"]),
    "coalesced_in_place_second_not_contiguous": ("FC-27", V, ["contiguous"]),
    "all_gather_coalesced_second_0d": ("FC-27", V, ["dim"]),
    "reduce_scatter_coalesced_second_indivisible": ("FC-27", V, ["divisible"]),
    "scatter_dims_count": ("FC-20", V, ["scatter_dim"]),
}


def _bad_call(fc, name):
    from torch.distributed.device_mesh import init_device_mesh

    me, n, world = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    g = fc.resolve_group_name(world)
    x, xi = torch.ones(4, 4), torch.ones(4, 4, dtype=torch.int64)
    grad = torch.ones(4, 4, requires_grad=True)
    calls = {
        "unknown_reduce_op": lambda: fc.all_reduce(x, "median", world),
        "reduce_op_none": lambda: fc.all_reduce(x, None, world),
        "reduce_op_int": lambda: fc.all_reduce(x, 0, world),
        "premul_sum_without_factor": lambda: fc.all_reduce(x, dist.ReduceOp.PREMUL_SUM, world),
        "premul_sum_of_integers": lambda: fc.all_reduce(xi, dist._make_nccl_premul_sum(2.0),
                                                        world),
        # A tensor factor is of one floating element; an integer or bool one is refused
        # even on floating inputs (FC-17), single and coalesced.
        "premul_sum_integer_tensor_factor": lambda: fc.all_reduce(
            x, dist._make_nccl_premul_sum(torch.tensor([2])), world),
        "premul_sum_bool_tensor_factor": lambda: fc.all_reduce(
            x.double(), dist._make_nccl_premul_sum(torch.tensor([True])), world),
        "reduce_scatter_premul_sum_int32_factor": lambda: fc.reduce_scatter_tensor(
            x.bfloat16(), dist._make_nccl_premul_sum(torch.tensor(2, dtype=torch.int32)), 0,
            world),
        "coalesced_premul_sum_integer_tensor_factor": lambda: fc.all_reduce_coalesced(
            [x, x.double()], dist._make_nccl_premul_sum(torch.tensor([3])), world),
        "avg_enum_of_integers": lambda: fc.all_reduce(xi, dist.ReduceOp.AVG, world),
        "band_enum_of_float": lambda: fc.all_reduce(x, dist.ReduceOp.BAND, world),
        "reduce_scatter_unknown_reduce_op": lambda: fc.reduce_scatter_tensor(x, "median", 0,
                                                                             world),
        "avg_of_integers": lambda: fc.all_reduce(xi, "avg", world),
        "AVG_of_integers": lambda: fc.all_reduce(xi, "AVG", world),
        "Band_of_float": lambda: fc.all_reduce(x, "Band", world),
        "avg_of_bool": lambda: fc.all_reduce(x > 0, "avg", world),
        "reduce_scatter_avg_of_integers": lambda: fc.reduce_scatter_tensor(xi, "avg", 0, world),
        "band_of_float": lambda: fc.all_reduce(x, "band", world),
        "bxor_of_float": lambda: fc.all_reduce(x, "bxor", world),
        "bor_of_bfloat16": lambda: fc.all_reduce(x.bfloat16(), "bor", world),
        "bxor_of_complex": lambda: fc.all_reduce(x.to(torch.complex64), "bxor", world),
        "indivisible_scatter_dim": lambda: fc.reduce_scatter_tensor(x[:3], "sum", 0, world),
        "indivisible_scatter_dim_1": lambda: fc.reduce_scatter_tensor(x[:, :3], "sum", 1, world),
        "indivisible_raw_reduce_scatter": lambda: fc.ops.reduce_scatter_tensor(
            x[:3].contiguous(), "sum", n, g),
        "gather_dim_is_ndim": lambda: fc.all_gather_tensor(x, 2, world),
        "gather_dim_below_minus_ndim": lambda: fc.all_gather_tensor(x, -3, world),
        "gather_dim_bool": lambda: fc.all_gather_tensor(x, True, world),  # no int, like src
        "scatter_dim_is_ndim": lambda: fc.reduce_scatter_tensor(x, "sum", 2, world),
        "all_gather_of_0d": lambda: fc.all_gather_tensor(torch.tensor(1.0), 0, world),
        "raw_all_gather_of_0d": lambda: fc.ops.all_gather_into_tensor(torch.tensor(1.0), n, g),
        "raw_reduce_scatter_of_0d": lambda: fc.ops.reduce_scatter_tensor(
            torch.tensor(1.0), "sum", n, g),
        "all_to_all_of_0d_equal_splits": lambda: fc.all_to_all_single(torch.tensor(1.0), None,
                                                                      None, world),
        "unequal_rank_rows": lambda: fc.all_reduce(x, "sum", [[0, 1], [2]]),
        "duplicate_ranks": lambda: fc.all_reduce(x, "sum", [0, 0, 1]),
        "rows_mixed_with_ranks": lambda: fc.all_reduce(x, "sum", [[0, 1], 2]),
        "rank_repeated_across_rows": lambda: fc.all_reduce(x, "sum", [[0, 1], [1, 0]]),
        "rank_is_world_size": lambda: fc.all_reduce(x, "sum", [*range(n - 1), n]),
        "negative_rank": lambda: fc.all_reduce(x, "sum", [-1, *range(n)]),
        "rank_is_bool": lambda: fc.all_reduce(x, "sum", [0, True, *range(2, n)]),
        "empty_rank_list": lambda: fc.all_reduce(x, "sum", []),
        "caller_not_in_rank_list": lambda: fc.all_reduce(x, "sum", [r for r in range(n)
                                                                    if r != me]),
        "mesh_2d_without_dim": lambda: fc.all_reduce(x, "sum", init_device_mesh("cpu", (n, 1))),
        "mesh_dim_bool": lambda: fc.all_reduce(x, "sum", (init_device_mesh("cpu", (n, 1)),
                                                          False)),
        "unknown_group_name": lambda: fc.all_reduce(x, "sum", "no-such-group"),
        "bad_group_type": lambda: fc.all_reduce(x, "sum", 2.5),
        "group_size_below": lambda: fc.ops.all_gather_into_tensor(x, n - 1, g),
        "group_size_above": lambda: fc.ops.all_gather_into_tensor(x, n + 1, g),
        "reduce_scatter_group_size_below": lambda: fc.ops.reduce_scatter_tensor(
            x, "sum", n - 1, g),
        "coalesced_group_size_below": lambda: fc.ops.all_gather_into_tensor_coalesced(
            [x], n - 1, g),
        "input_splits_sum": lambda: fc.all_to_all_single(x, [2] * n, [1] * n, world),
        "splits_count_below": lambda: fc.all_to_all_single(x, [4], [4], world),
        "splits_count_above": lambda: fc.all_to_all_single(x, [1] * 4 + [0], [1] * 4 + [0],
                                                           world),
        "negative_input_split": lambda: fc.all_to_all_single(
            x, [2] * n, [-1, 5] + [0] * (n - 2), world),
        "negative_output_split": lambda: fc.all_to_all_single(
            x, [-1, 5] + [0] * (n - 2), [2] * n, world),
        "empty_splits_indivisible": lambda: fc.all_to_all_single(x[:3], None, None, world),
        "src_is_group_size": lambda: fc.broadcast(x, n, world),
        "src_negative": lambda: fc.broadcast(x, -1, world),
        "src_bool": lambda: fc.broadcast(x, True, world),
        "raw_src_is_group_size": lambda: fc.ops.broadcast(x, n, g),
        "out_wrong_shape": lambda: fc.ops.all_gather_into_tensor_out(
            x, n, g, out=x.new_empty(4 * n + 1, 4)),
        "out_wrong_dtype": lambda: fc.ops.all_gather_into_tensor_out(
            x, n, g, out=xi.new_empty(4 * n, 4)),
        "out_dtype_of_the_same_width": lambda: fc.ops.all_gather_into_tensor_out(
            x, n, g, out=torch.empty(4 * n, 4, dtype=torch.int32)),
        "out_on_another_device": lambda: fc.ops.all_gather_into_tensor_out(
            x, n, g, out=torch.empty(4 * n, 4, device="meta")),
        "out_not_contiguous": lambda: fc.ops.all_gather_into_tensor_out(
            x, n, g, out=x.new_empty(4, 4 * n).t()),
        "input_on_meta": lambda: fc.all_reduce(torch.ones(4, device="meta"), "sum", world),
        "raw_input_on_meta": lambda: fc.ops.all_gather_into_tensor(
            torch.ones(4, device="meta"), n, g),
        "reduce_scatter_on_meta": lambda: fc.ops.reduce_scatter_tensor(
            torch.ones(4, device="meta"), "sum", n, g),
        "all_to_all_on_meta": lambda: fc.ops.all_to_all_single(
            torch.ones(4, device="meta"), [], [], g),
        "broadcast_on_meta": lambda: fc.ops.broadcast_(torch.ones(4, device="meta"), 0, g),
        "all_reduce_coalesced_on_meta": lambda: fc.ops.all_reduce_coalesced(
            [x, torch.ones(4, device="meta")], "sum", g),
        "all_reduce_in_place_not_contiguous": lambda: fc.ops.all_reduce_(
            torch.ones(4, 2).t(), "sum", g),
        "broadcast_in_place_not_contiguous": lambda: fc.ops.broadcast_(
            torch.ones(4, 2).t(), 0, g),
        "non_differentiable_reduction": lambda: fc.all_reduce(grad, "product", world) * 1,
        "non_differentiable_reduce_scatter": lambda: fc.reduce_scatter_tensor(
            grad, "product", 0, world) * 1,
        "non_differentiable_raw_op": lambda: fc.ops.all_reduce(grad, "product", g),
        "coalesced_second_member_bad": lambda: fc.ops.all_reduce_coalesced([x, xi], "avg", g),
        "coalesced_in_place_second_member_bad": lambda: fc.ops.all_reduce_coalesced_(
            [x.clone(), xi.clone()], "avg", g),
        "coalesced_in_place_second_not_contiguous": lambda: fc.ops.all_reduce_coalesced_(
            [x.clone(), x.clone()[:, :2].t()], "sum", g),
        "all_gather_coalesced_second_0d": lambda: fc.ops.all_gather_into_tensor_coalesced(
            [x, torch.tensor(1.0)], n, g),
        "reduce_scatter_coalesced_second_indivisible": lambda: (
            fc.ops.reduce_scatter_tensor_coalesced([x, x[:3].contiguous()], "sum", n, g)),
        "scatter_dims_count": lambda: fc.reduce_scatter_tensor_coalesced([x], "sum", [0, 1],
                                                                         world),
    }
    return calls[name]


def _bad_input(spec, name):
    fc = funcol_api(spec)
    world, registry = dist.group.WORLD, fc.work_registry_size
    before = registry() if registry else 0
    exc_type, message, _ = _error(_bad_call(fc, name))
    started = registry() - before if registry else 0
    # FC-27: the group is still in step.
    after = fc.all_reduce(torch.ones(1), "sum", world).wait().tolist()
    return (exc_type, message), started, after


# Each bad input names its own rule (and FC-27, which every one checks), so that a case
# has the level of the rule it checks (CF-14).
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.spec(*dict.fromkeys((BAD_INPUTS[n][0], "FC-27"))))
    for n in BAD_INPUTS])
def test_bad_input_is_refused(backend, name):
    rule, types, words = BAD_INPUTS[name]
    backend.require("functional_collectives")
    # A refusal comes before any rank waits on a peer (a second or two on a loaded
    # machine); an implementation that lets the input through waits on its peer until
    # this deadline.
    for rank, ((exc_type, message), started, after) in enumerate(
            run(backend, _bad_input, 2, name, timeout=15)):
        where = f"rank {rank} {name} [{rule}]"
        assert exc_type in {t.__name__ for t in types}, f"{where}: {exc_type} {message}"
        for word in words:
            assert word.lower() in message.lower(), (
                f"{where}: message does not mention {word!r}: {message}")
        assert started == 0, f"{where}: the refused call left {started} started collectives"
        assert after == [2.0], f"{where}: a refused call left the group out of step [FC-27]"


# Inputs at the edge of a refusal that MUST be accepted: (rule, dtype, the call, oracle).
ACCEPTED = {
    "product_under_no_grad": ("FC-24", torch.float32, lambda fc, x, g: fc.all_reduce(
        x.clone().requires_grad_(), "product", g), lambda xs, r: oracle.reduce(xs, "product")),
    "product_without_grad": ("FC-24", torch.float32, lambda fc, x, g: fc.reduce_scatter_tensor(
        x, "product", 0, g), lambda xs, r: oracle.reduce_scatter(xs, "product", r)),
    "avg_of_complex": ("FC-18", torch.complex64, lambda fc, x, g: fc.all_reduce(x, "avg", g),
                       lambda xs, r: sum(xs) / len(xs)),
}


def _accepted(spec, name):
    fc = funcol_api(spec)
    _, dtype, call, _ = ACCEPTED[name]
    x = oracle.rank_input(dist.get_rank(), (4,), torch.float32, salt=29).to(dtype)
    with torch.no_grad():  # product_under_no_grad: no autograd graph is recorded
        return waited(call(fc, x, dist.group.WORLD))


@pytest.mark.spec("FC-18", "FC-24", "FC-43")
@pytest.mark.parametrize("name", list(ACCEPTED))
def test_inputs_at_the_edge_of_a_refusal_are_accepted(backend, name):
    backend.require("functional_collectives")
    rule, dtype, _, want = ACCEPTED[name]
    xs = [oracle.rank_input(r, (4,), torch.float32, salt=29).to(dtype) for r in range(2)]
    for rank, got in enumerate(run(backend, _accepted, 2, name)):
        assert torch.equal(got, want(xs, rank)), f"rank {rank} {name} [{rule}]: {got}"


# ---- FC-23, FC-25, FC-32: gradients ----------------------------------------------------
# Reduction names are case-insensitive with grad too (FC-17): "Avg", "SUM".
GRAD_OPS = ["all_gather", "reduce_scatter", "reduce_scatter_avg", "reduce_scatter_Avg",
            "all_reduce", "all_reduce_SUM", "all_reduce_avg", "all_to_all", "all_to_all_uneven",
            "broadcast",
            "all_gather_autograd", "reduce_scatter_autograd", "all_to_all_autograd"]


def _rows_in(op, rank, n):
    """Rows of rank `rank`'s input: all_to_all_uneven sends (i + 2j) % 3 rows to j."""
    if op in ("all_to_all_uneven", "all_to_all_autograd"):
        return sum(funcol_cases.split_sizes("uneven", rank, n)[0])
    return 4


def _out_shape(op, rank, n):
    if op.startswith("all_gather"):
        return (4, 2 * n)
    if op.startswith("reduce_scatter"):
        return (4 // n, 2)
    if op in ("all_to_all_uneven", "all_to_all_autograd"):
        return (sum(funcol_cases.split_sizes("uneven", rank, n)[1]), 2)
    return (4, 2)


def _gradient(spec, op, salt):
    fc = funcol_api(spec)
    me, n, world = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    x = oracle.rank_input(me, (_rows_in(op, me, n), 2), torch.float64,
                          salt=salt).requires_grad_()
    w = oracle.rank_input(me, _out_shape(op, me, n), torch.float64, salt=salt + 1)
    ins, outs = funcol_cases.split_sizes("uneven", me, n)
    y = {
        "all_gather": lambda: fc.all_gather_tensor(x, 1, world),
        "all_gather_autograd": lambda: fc.all_gather_tensor_autograd(x, 1, world),
        "reduce_scatter": lambda: fc.reduce_scatter_tensor(x, "sum", 0, world),
        "reduce_scatter_autograd": lambda: fc.reduce_scatter_tensor_autograd(x, "sum", 0, world),
        "reduce_scatter_avg": lambda: fc.reduce_scatter_tensor(x, "avg", 0, world),
        "reduce_scatter_Avg": lambda: fc.reduce_scatter_tensor(x, "Avg", 0, world),
        "all_reduce": lambda: fc.all_reduce(x, "sum", world),
        "all_reduce_SUM": lambda: fc.all_reduce(x, "SUM", world),
        "all_reduce_avg": lambda: fc.all_reduce(x, "avg", world),
        "all_to_all": lambda: fc.all_to_all_single(x, None, None, world),
        "all_to_all_uneven": lambda: fc.all_to_all_single(x, outs, ins, world),
        "all_to_all_autograd": lambda: fc.all_to_all_single_autograd(x, outs, ins, world),
        "broadcast": lambda: fc.broadcast(x, 1, world),
    }[op]()
    (y * w).sum().backward()
    return x.grad


def _expected_grad(op, rank, n, salt):
    ws = [oracle.rank_input(r, _out_shape(op, r, n), torch.float64, salt=salt + 1)
          for r in range(n)]
    if op.startswith("all_gather"):
        return torch.chunk(torch.stack(ws).sum(0), n, dim=1)[rank]
    if op.startswith("reduce_scatter"):
        g = torch.cat(ws, dim=0)
        return g / n if op.lower().endswith("avg") else g
    if op.startswith("all_reduce"):
        total = torch.stack(ws).sum(0)
        return total / n if op.lower().endswith("avg") else total
    if op == "all_to_all":
        return oracle.all_to_all_single(ws, rank)
    if op in ("all_to_all_uneven", "all_to_all_autograd"):
        # The gradient goes back the way the rows came: rank j's output splits are what
        # it received, so they are what it sends back.
        outs = [funcol_cases.split_sizes("uneven", r, n)[1] for r in range(n)]
        return oracle.all_to_all_single(ws, rank, outs)
    total = torch.stack(ws).sum(0)
    return total if rank == 1 else torch.zeros_like(total)  # broadcast from group rank 1


# reduce_scatter(avg)'s gradient is FC-47's (an extension); every other op's is FC-23's.
@pytest.mark.parametrize("op", [
    pytest.param(op, marks=pytest.mark.spec("FC-47", "FC-25", "FC-32")
                 if op in ("reduce_scatter_avg", "reduce_scatter_Avg")
                 else pytest.mark.spec("FC-23", "FC-25", "FC-32"))
    for op in GRAD_OPS])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gradient(backend, op, world_size):
    backend.require("functional_collectives")
    for rank, grad in enumerate(run(backend, _gradient, world_size, op, 31)):
        want = _expected_grad(op, rank, world_size, 31)
        assert grad is not None, f"{op} rank {rank}: no gradient reached the input"
        assert torch.equal(grad, want), f"{op} rank {rank}: {grad} != {want}"


def _broadcast_gradient_in_a_subgroup(spec, members, src):
    """broadcast's gradient in the process group of the ranks `members` (not the default
    group), `src` a group rank; None on a rank outside the group."""
    fc = funcol_api(spec)
    me = dist.get_rank()
    group = dist.new_group(members)  # every rank of the world takes part, as upstream's
    if me not in members:
        return None
    x = oracle.rank_input(me, (4, 2), torch.float64, salt=67).requires_grad_()
    w = oracle.rank_input(me, (4, 2), torch.float64, salt=68)
    (fc.broadcast(x, src, group) * w).sum().backward()
    return x.grad


# A world of 4; group ranks are the members' global ranks in ascending order (FC-14), so
# in each group the src's global rank differs from `src` itself: [1, 3] with src 0 is
# global rank 1 and with src 1 global rank 3; [3, 0, 2] (out of order, not contiguous)
# with src 1 is global rank 2 and with src 2 global rank 3. (A ProcessGroup made by
# `new_group`, not a rank list: naming a new group by its ranks is FC-15's extension.)
@pytest.mark.spec("FC-23", "FC-46")
@pytest.mark.parametrize("members, src", [([1, 3], 0), ([1, 3], 1), ([3, 0, 2], 1),
                                          ([3, 0, 2], 2)],
                         ids=["1_3-src0", "1_3-src1", "3_0_2-src1", "3_0_2-src2"])
def test_broadcast_gradient_goes_to_the_src_group_rank_of_a_subgroup(backend, members, src):
    """broadcast → the sum of the members' output gradients on the member that is group
    rank `src` (a group rank, FC-46, not the global rank `src`), zeros on the others."""
    backend.require("functional_collectives")
    group = sorted(members)
    ws = [oracle.rank_input(r, (4, 2), torch.float64, salt=68) for r in group]
    total = torch.stack(ws).sum(0)
    for rank, grad in enumerate(run(backend, _broadcast_gradient_in_a_subgroup, 4, members,
                                    src)):
        if rank not in group:
            assert grad is None, f"rank {rank} is no member of {members}"
            continue
        want = total if rank == group[src] else torch.zeros_like(total)
        where = f"rank {rank} of group {members}, src {src} (global rank {group[src]})"
        assert grad is not None, f"{where}: no gradient reached the input"
        assert torch.equal(grad, want), f"{where}: {grad.tolist()} != {want.tolist()}"


def _reduce_scatter_avg_gradient_in_a_subgroup(spec, members, dtype, api, scatter_dim):
    """reduce_scatter_tensor(avg)'s gradient in the process group of the ranks `members`
    (not the default group); None on a rank outside the group."""
    fc = funcol_api(spec)
    me = dist.get_rank()
    group = dist.new_group(members)  # every rank of the world takes part, as upstream's
    if me not in members:
        return None
    x = oracle.rank_input(me, (6, 6), dtype, salt=71).requires_grad_()
    w = oracle.rank_input(me, (6 // len(members), 6) if scatter_dim == 0
                          else (6, 6 // len(members)), dtype, salt=72)
    y = getattr(fc, api)(x, "avg" if api == "reduce_scatter_tensor" else "AVG", scatter_dim,
                         group)
    (y * w).sum().backward()
    return x.grad


# A world of 4 and a group of 2 ([1, 3]) or 3 ([3, 0, 2]): avg's gradient divides by the
# group's size, not the world's (a divisor of 4 gives other values for either group).
@pytest.mark.spec("FC-47")
@pytest.mark.parametrize("members, dtype, api, scatter_dim", [
    ([1, 3], torch.float64, "reduce_scatter_tensor", 0),
    ([1, 3], torch.float32, "reduce_scatter_tensor_autograd", -1),
    ([1, 3], torch.bfloat16, "reduce_scatter_tensor", 0),
    ([3, 0, 2], torch.float64, "reduce_scatter_tensor", 0),
    ([3, 0, 2], torch.float32, "reduce_scatter_tensor", -1),
    ([3, 0, 2], torch.bfloat16, "reduce_scatter_tensor_autograd", 0),
], ids=["1_3-f64", "1_3-f32-autograd-dim_1", "1_3-bf16", "3_0_2-f64", "3_0_2-f32-dim_1",
        "3_0_2-bf16-autograd"])
def test_reduce_scatter_avg_gradient_divides_by_the_subgroups_size(backend, members, dtype,
                                                                  api, scatter_dim):
    """reduce_scatter_tensor(avg) in a group of k members of a world of 4: every member's
    gradient is the members' output gradients gathered (group rank order, along the
    scattered dim) divided by k, in the input's dtype; the others take no part."""
    backend.require("functional_collectives")
    group = sorted(members)
    k = len(group)
    shape = (6 // k, 6) if scatter_dim == 0 else (6, 6 // k)
    ws = [oracle.rank_input(r, shape, dtype, salt=72) for r in group]
    want = torch.cat(ws, dim=scatter_dim) / k
    for rank, grad in enumerate(run(backend, _reduce_scatter_avg_gradient_in_a_subgroup, 4,
                                    members, dtype, api, scatter_dim)):
        if rank not in group:
            assert grad is None, f"rank {rank} is no member of {members}"
            continue
        where = f"rank {rank} of group {members} ({api}, {dtype}, scatter_dim {scatter_dim})"
        assert grad is not None, f"{where}: no gradient reached the input"
        assert grad.dtype == dtype, f"{where}: gradient of dtype {grad.dtype}"
        assert torch.equal(grad, want), f"{where}: {grad.tolist()} != {want.tolist()} " \
            f"(the gathered output gradients / {k})"


# ---- FC-33: no graph pass deletes a collective or a wait -------------------------------
def _dead_code(spec, waited):
    from torch.fx.experimental.proxy_tensor import make_fx

    fc = funcol_api(spec)
    name = fc.resolve_group_name(dist.group.WORLD)

    def program(x):
        if waited:
            fc.all_reduce(x, "sum", dist.group.WORLD)  # waited in the graph, result unused
        else:
            fc.ops.all_reduce(x, "sum", name)  # never waited, result unused
        return x * 2

    gm = make_fx(program, tracing_mode="fake")(torch.ones(4))
    before = canonical_graph(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return before, canonical_graph(gm)


def _dead_code_of_packets(spec):
    """symbolic_trace records the ops' packets (`ops.all_reduce`), not their overloads."""
    fc = funcol_api(spec)
    name = fc.resolve_group_name(dist.group.WORLD)

    def program(x):
        fc.ops.wait_tensor(fc.ops.all_reduce(x, "sum", name))  # waited, result unused
        fc.ops.all_reduce(x, "sum", name)  # never waited, result unused
        return x * 2

    gm = torch.fx.symbolic_trace(program)
    ops = lambda: [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]  # noqa: E731
    before = ops()
    gm.graph.eliminate_dead_code()
    return before, ops()


# A waited collective is kept by upstream too (FC-48); an unwaited one only by FC-33.
@pytest.mark.parametrize("waited", [
    pytest.param(True, id="waited", marks=pytest.mark.spec("FC-48", "FC-12")),
    pytest.param(False, id="unwaited", marks=pytest.mark.spec("FC-33", "FC-12"))])
def test_dead_code_elimination_keeps_collectives_and_waits(backend, waited):
    backend.require("functional_collectives")
    for rank, (before, after) in enumerate(run(backend, _dead_code, 2, waited)):
        assert "funcol.all_reduce" in before, f"rank {rank}: nothing traced:\n{before}"
        assert after == before, f"rank {rank}: DCE changed the graph:\n{before}\n--\n{after}"


@pytest.mark.spec("FC-33")
def test_dead_code_elimination_keeps_the_ops_packets_too(backend):
    backend.require("functional_collectives")
    for rank, (before, after) in enumerate(run(backend, _dead_code_of_packets, 2)):
        assert sum("all_reduce" in t for t in before) == 2, f"rank {rank}: traced {before}"
        assert after == before, f"rank {rank}: DCE left {after} of {before}"


# ---- FC-34: any ProcessGroup, one written in Python included ---------------------------
def _on_threaded_process_group(spec):
    from torch.testing._internal.common_distributed import spawn_threads_and_init_comms

    fc, n, results = funcol_api(spec), 4, {}

    def body(_self):
        me, group = dist.get_rank(), dist.group.WORLD
        x = oracle.rank_input(me, (4, 4), torch.float32, salt=37)
        results[me] = [waited(fc.all_reduce(x, "sum", group)),
                       waited(fc.all_gather_tensor(x, 1, group)),
                       waited(fc.reduce_scatter_tensor(x, "sum", 1, group)),
                       waited(fc.all_to_all_single(x, None, None, group)),
                       waited(fc.broadcast(x, n - 1, group))]

    # Threads in this process, each a rank of upstream's ProcessLocalGroup.
    spawn_threads_and_init_comms(body, world_size=n)(None)
    return results


@pytest.mark.spec("FC-34")
def test_ops_run_on_a_process_group_written_in_python(backend):
    backend.require("functional_collectives")
    n = 4
    xs = [oracle.rank_input(r, (4, 4), torch.float32, salt=37) for r in range(n)]
    (results,) = run(backend, _on_threaded_process_group, 1)
    for rank in range(n):
        want = [oracle.reduce(xs, "sum"), oracle.all_gather(xs, 1),
                oracle.reduce_scatter(xs, "sum", rank, 1), oracle.all_to_all_single(xs, rank),
                xs[n - 1]]
        for i, (got, w) in enumerate(zip(results[rank], want, strict=True)):
            assert torch.equal(got, w), f"rank {rank} op {i}: {got} != {w}"


# ---- FC-34, FC-50: the process-group methods each op reaches -------------------------
# op -> the methods of torch.distributed.ProcessGroup it reaches, in order (SPEC's table)
METHODS_REACHED = {
    "all_reduce": ["allreduce"], "all_reduce_": ["allreduce"],
    "all_reduce_coalesced": ["allreduce_coalesced"],
    "all_reduce_coalesced_": ["allreduce_coalesced"],
    "all_reduce_coalesced_of_two_dtypes": ["allreduce_coalesced", "allreduce_coalesced"],
    "all_gather_into_tensor": ["allgather_into_tensor_coalesced"],
    "all_gather_into_tensor_coalesced": ["allgather_into_tensor_coalesced"],
    "all_gather_into_tensor_out": ["allgather_into_tensor_coalesced"],
    "reduce_scatter_tensor": ["reduce_scatter_tensor_coalesced"],
    "reduce_scatter_tensor_coalesced": ["reduce_scatter_tensor_coalesced"],
    "all_to_all_single": ["alltoall_base"],
    "broadcast": ["broadcast"], "broadcast_": ["broadcast"],
    "isend_and_irecv": ["send", "recv"], "batch_p2p_ops": ["recv", "send"],
}
# The dtypes of each call's tensors, where the order of the calls is the rule's: one
# allreduce_coalesced per dtype, in the order the dtypes first appear (FC-34).
METHOD_DTYPES = {"all_reduce_coalesced_of_two_dtypes": [["float64"], ["float32", "float32"]]}
METHOD_RULES = {"all_gather_into_tensor_out": ["FC-50"],
                "isend_and_irecv": ["FC-34", "FC-52"], "batch_p2p_ops": ["FC-34", "FC-52"],
                # members of two dtypes: one call per dtype, the results as single ops'
                "all_reduce_coalesced_of_two_dtypes": ["FC-34", "FC-26"]}


def _require_op_of(backend, call: str) -> None:
    """The backend's functional collectives, with the op of `call` (p2p: torch 2.12 on)."""
    fc = backend.require("functional_collectives")
    op = "batch_p2p_ops" if call == "isend_and_irecv" else call
    if call in ("isend_and_irecv", "batch_p2p_ops") and not hasattr(fc.ops, op):
        pytest.skip(f"torch {torch.__version__} has no functional {op}")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("op", [pytest.param(op, marks=pytest.mark.spec(*METHOD_RULES.get(
    op, ["FC-34"]))) for op in METHODS_REACHED])
def test_each_op_reaches_its_process_group_through_its_method(backend, world, op):
    """Over a subgroup of a group written in Python that records its calls and registers
    no device backend (conformance/recording_process_group.py): each op completes with the
    right values on every member, reaching exactly its methods. World 3 records on the
    subgroup [1, 2] (group ranks are not global ranks)."""
    _require_op_of(backend, op)
    for rank, found in enumerate(run(backend, pg_methods.methods_reached, world, [op])):
        if found is None:
            continue  # not a member of the recording group
        calls, error, values_right, dtypes = found[op]
        where = f"rank {rank}, world {world}: {op}"
        assert error is None, f"{where} failed: {error}"
        assert calls == METHODS_REACHED[op], f"{where} reached {calls}"
        if op in METHOD_DTYPES:
            assert dtypes == METHOD_DTYPES[op], f"{where}: calls of the dtypes {dtypes}"
        assert values_right, f"{where}: wrong values"


@pytest.mark.parametrize("op", [pytest.param(op, marks=pytest.mark.spec(*METHOD_RULES.get(
    op, ["FC-34"]), "FC-51")) for op in METHODS_REACHED])
@pytest.mark.parametrize("kind", ["every_method_overridden", "half_overridden"])
def test_an_override_wins_over_the_backend_its_group_registered(backend, kind, op):
    """The recording group of the case above, on the subgroup [1, 2] of 3 ranks, with a
    gloo backend registered for the CPU besides its overrides (of every method, or of half
    of them): each op reaches exactly its methods that the group overrides, the others
    are served by the backend (FC-51), with the right values."""
    from conformance.recording_process_group import LEFT_TO_THE_BACKEND

    _require_op_of(backend, op)
    left = LEFT_TO_THE_BACKEND if kind == "half_overridden" else ()
    want = [m for m in METHODS_REACHED[op] if m not in left]
    for rank, found in enumerate(run(backend, pg_methods.methods_reached, 3, [op], kind)):
        if found is None:
            continue  # not a member of the recording group
        calls, error, values_right, _ = found[op]
        where = f"rank {rank}, {kind}: {op}"
        assert error is None, f"{where} failed: {error}"
        assert calls == want, f"{where} reached {calls}"
        assert values_right, f"{where}: wrong values"


# ---- FC-51: a group written in Python that leaves its methods to its backend ---------
# Every (dtype, reduction) pair meets within 20 rounds; the way that deadlocks is seen at
# the first (the group records it), not left to deadlock (within 200 rounds of 3 ops).
BACKEND_ONLY_ROUNDS = 30
BACKEND_ONLY_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.int64]
# Five reductions against four dtypes: every pair meets within 20 rounds. avg on an
# integer dtype is refused (FC-17): those rounds take sum.
BACKEND_ONLY_REDUCTIONS = ["sum", "avg", "min", "max", "product"]


def _backend_only_round(fc, group, members, rank, i):
    """One round of every op on `group`, each result waited and let go at once (as a
    program does); the values of this rank's results against the oracle's. The dtype and
    the reduction change from round to round; complex tensors take every op that reads
    them as real views."""
    dtype = BACKEND_ONLY_DTYPES[i % len(BACKEND_ONLY_DTYPES)]
    op = BACKEND_ONLY_REDUCTIONS[i % len(BACKEND_ONLY_REDUCTIONS)]
    op = "sum" if op == "avg" and not dtype.is_floating_point else op
    n, me = len(members), members.index(rank)
    xs = [oracle.rank_input(r, (2 * n, 3), dtype, salt=i) for r in members]
    ys = [x * 2 for x in xs]
    x, y = xs[me], ys[me]
    zs = [oracle.rank_input(r, (2 * n,), torch.complex64, salt=i) for r in members]
    got = {
        f"all_reduce {op}": waited(fc.all_reduce(x, op, group)),
        "all_reduce of a 0-d tensor": waited(fc.all_reduce(x[0, 0], "sum", group)),
        "all_reduce of complex64": waited(fc.all_reduce(zs[me], "sum", group)),
        f"all_reduce_coalesced {op}": [waited(t) for t in fc.all_reduce_coalesced(
            [x, y], op, group)],
        "all_gather_tensor": waited(fc.all_gather_tensor(x, 0, group)),
        "all_gather_tensor of complex64": waited(fc.all_gather_tensor(zs[me], 0, group)),
        "all_gather_into_tensor_coalesced": [waited(t) for t in
                                             fc.all_gather_into_tensor_coalesced([x, y], group)],
        f"reduce_scatter_tensor {op}": waited(fc.reduce_scatter_tensor(x, op, 0, group)),
        f"reduce_scatter_tensor_coalesced {op}": [waited(t) for t in
                                                  fc.reduce_scatter_tensor_coalesced(
                                                      [x, y], op, [0, 0], group)],
        "all_to_all_single": waited(fc.all_to_all_single(x, None, None, group)),
        "all_to_all_single of complex64": waited(fc.all_to_all_single(zs[me], None, None,
                                                                      group)),
        "broadcast": waited(fc.broadcast(x, n - 1, group)),
        "broadcast of complex64": waited(fc.broadcast(zs[me], 1, group)),
    }
    want = {
        f"all_reduce {op}": oracle.reduce(xs, op),
        "all_reduce of a 0-d tensor": oracle.reduce([t[0, 0] for t in xs], "sum"),
        "all_reduce of complex64": torch.stack(zs).sum(0),
        f"all_reduce_coalesced {op}": [oracle.reduce(xs, op), oracle.reduce(ys, op)],
        "all_gather_tensor": oracle.all_gather(xs),
        "all_gather_tensor of complex64": oracle.all_gather(zs),
        "all_gather_into_tensor_coalesced": [oracle.all_gather(xs), oracle.all_gather(ys)],
        f"reduce_scatter_tensor {op}": oracle.reduce_scatter(xs, op, me),
        f"reduce_scatter_tensor_coalesced {op}": [oracle.reduce_scatter(xs, op, me),
                                                  oracle.reduce_scatter(ys, op, me)],
        "all_to_all_single": oracle.all_to_all_single(xs, me),
        "all_to_all_single of complex64": oracle.all_to_all_single(zs, me),
        "broadcast": xs[n - 1],
        "broadcast of complex64": zs[1],
    }
    wrong = []
    for name in got:
        try:
            funcol_cases.assert_same(got[name], want[name], f"round {i} ({dtype}): {name}")
        except AssertionError as exc:
            wrong.append(str(exc).splitlines()[0])
    return wrong


def _ops_on_a_backend_only_group(spec, members):
    """Every op, BACKEND_ONLY_ROUNDS times, on a group of `members` written in Python that
    leaves every collective to the gloo backend it registered (FC-51); this rank's wrong
    values (None off the group)."""
    from conformance import backend_process_group

    fc = funcol_api(spec)
    group = dist.new_group(members, backend=backend_process_group.register())
    rank = dist.get_rank()
    if rank not in members:
        return None
    wrong = []
    for i in range(BACKEND_ONLY_ROUNDS):
        wrong += _backend_only_round(fc, group, members, rank, i)
        reached = group.__dict__.get("base_methods_reached")
        if reached:  # the way that deadlocks: no need to wait for it to
            wrong.append(f"round {i}: reached the group's own methods {sorted(set(reached))}"
                         " (c10d's base class) instead of its backend's")
            break
    dist.destroy_process_group(group)
    return wrong


@pytest.mark.spec("FC-51")
def test_ops_complete_on_a_python_group_that_leaves_them_to_its_backend(backend):
    """A group written in Python that overrides no collective and registers gloo for the
    CPU (conformance/backend_process_group.py), on the subgroup [1, 2, 3] of 4 ranks (group
    ranks are not global ranks): every op, single and coalesced, over four dtype families,
    complex and 0-d tensors, 30 rounds, right on every member, without reaching the
    group's own methods (c10d's base class; the group sees them read). Through those
    (c10d's trampoline) the ranks deadlock, but only now and then, within a few hundred
    collectives: the read fails the case at once; a deadlock ends in the harness's timeout,
    naming the ranks that hung."""
    backend.require("functional_collectives")
    members = [1, 2, 3]
    results = run(backend, _ops_on_a_backend_only_group, 4, members, restart_after=True,
                  tensors_on_the_cpu=True, timeout=60)
    assert results[0] is None
    for rank in members:
        assert results[rank] == [], f"rank {rank}: {results[rank][:10]}"


# ---- FC-3, FC-12: traced graphs --------------------------------------------------------
def program(fc, x, group):
    a = fc.all_reduce(x, "sum", group)
    b = fc.all_gather_tensor(a * 2, 0, group)
    c = fc.reduce_scatter_tensor(b, "avg", 0, group)
    d = fc.all_to_all_single(c, None, None, group)
    e = fc.broadcast(d, 0, group)
    f = fc.all_gather_tensor(e, 1, group)
    return f.relu()


def _make_fx_text(spec):
    from torch.fx.experimental.proxy_tensor import make_fx

    fc = funcol_api(spec)
    gm = make_fx(lambda x: program(fc, x, dist.group.WORLD))(torch.ones(4, 4))
    return canonical_graph(gm)


@pytest.mark.spec("FC-38", "FC-12", "FC-45")
def test_make_fx_graph(backend):
    backend.require("functional_collectives")
    texts = run(backend, _make_fx_text, 2)
    assert texts[0] == texts[1], "graphs differ between ranks"
    assert_expected_inline(texts[0], """\
%0 = input : f32[4, 4]
%1 = funcol.all_reduce(%0, 'sum', ranks[0,1]) : f32[4, 4]
%2 = funcol.wait_tensor(%1) : f32[4, 4]
%3 = aten.mul.Tensor(%2, 2) : f32[4, 4]
%4 = funcol.all_gather_into_tensor(%3, 2, ranks[0,1]) : f32[8, 4]
%5 = funcol.wait_tensor(%4) : f32[8, 4]
%6 = funcol.reduce_scatter_tensor(%5, 'avg', 2, ranks[0,1]) : f32[4, 4]
%7 = funcol.wait_tensor(%6) : f32[4, 4]
%8 = funcol.all_to_all_single(%7, [2, 2], [2, 2], ranks[0,1]) : f32[4, 4]
%9 = funcol.wait_tensor(%8) : f32[4, 4]
%10 = funcol.broadcast(%9, 0, ranks[0,1]) : f32[4, 4]
%11 = funcol.wait_tensor(%10) : f32[4, 4]
%12 = funcol.all_gather_into_tensor(%11, 2, ranks[0,1]) : f32[8, 4]
%13 = funcol.wait_tensor(%12) : f32[8, 4]
%14 = aten.split.Tensor(%13, 4) : (f32[4, 4], f32[4, 4])
%15 = getitem(%14, 0) : f32[4, 4]
%16 = getitem(%14, 1) : f32[4, 4]
%17 = aten.cat([%15, %16], 1) : f32[4, 8]
%18 = aten.relu(%17) : f32[4, 8]
return %18""")


def _compiled_forward_text(spec):
    fc = funcol_api(spec)
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(lambda x: program(fc, x, dist.group.WORLD), fullgraph=True,
                             backend=funcol_cases.recording_aot_backend(graphs))
    x = torch.arange(16.0).view(4, 4) + dist.get_rank()
    same = torch.equal(compiled(x), program(fc, x, dist.group.WORLD))
    return canonical_graph(graphs[0]), same


@pytest.mark.spec("FC-12")
def test_compiled_fullgraph(backend):
    backend.require("functional_collectives")
    results = run(backend, _compiled_forward_text, 2)
    assert all(same for _, same in results), "compiled and eager results differ"
    assert results[0][0] == results[1][0], "graphs differ between ranks"
    assert_expected_inline(results[0][0], """\
%0 = input : f32[4, 4]
%1 = funcol.all_reduce(%0, 'sum', ranks[0,1]) : f32[4, 4]
%2 = funcol.wait_tensor(%1) : f32[4, 4]
%3 = aten.mul.Tensor(%2, 2) : f32[4, 4]
%4 = funcol.all_gather_into_tensor(%3, 2, ranks[0,1]) : f32[8, 4]
%5 = funcol.wait_tensor(%4) : f32[8, 4]
%6 = funcol.reduce_scatter_tensor(%5, 'avg', 2, ranks[0,1]) : f32[4, 4]
%7 = funcol.wait_tensor(%6) : f32[4, 4]
%8 = funcol.all_to_all_single(%7, [2, 2], [2, 2], ranks[0,1]) : f32[4, 4]
%9 = funcol.wait_tensor(%8) : f32[4, 4]
%10 = funcol.broadcast(%9, 0, ranks[0,1]) : f32[4, 4]
%11 = funcol.wait_tensor(%10) : f32[4, 4]
%12 = funcol.all_gather_into_tensor(%11, 2, ranks[0,1]) : f32[8, 4]
%13 = funcol.wait_tensor(%12) : f32[8, 4]
%14 = aten.split.Tensor(%13, 4) : (f32[4, 4], f32[4, 4])
%15 = getitem(%14, 0) : f32[4, 4]
%16 = getitem(%14, 1) : f32[4, 4]
%17 = aten.cat([%15, %16], 1) : f32[4, 8]
%18 = aten.relu(%17) : f32[4, 8]
return [%18]""")


# ---- FC-28: calls that differ between ranks --------------------------------------------
# name: (what the message must name besides the differing rank, the call, by rank)
MISMATCHES = {
    "shapes": ("shape", lambda fc, me, g: fc.all_reduce(torch.ones(2 + me), "sum", g)),
    "all_reduce_-shapes": ("shape", lambda fc, me, g: fc.ops.all_reduce_(
        torch.ones(2 + me), "sum", fc.resolve_group_name(g))),
    "all_reduce_coalesced-shapes": ("shape", lambda fc, me, g: fc.all_reduce_coalesced(
        [torch.ones(2), torch.ones(2 + me)], "sum", g)[1]),
    "all_reduce_coalesced_-shapes": ("shape", lambda fc, me, g: fc.ops.all_reduce_coalesced_(
        [torch.ones(2), torch.ones(2 + me)], "sum", fc.resolve_group_name(g))[1]),
    "all_gather-shapes": ("shape", lambda fc, me, g: fc.all_gather_tensor(
        torch.ones(2, 1 + me), 0, g)),
    "all_gather_out-shapes": ("shape", lambda fc, me, g: fc.ops.all_gather_into_tensor_out(
        torch.ones(2, 1 + me), 2, fc.resolve_group_name(g), out=torch.empty(4, 1 + me))),
    "all_gather_coalesced-shapes": ("shape", lambda fc, me, g: (
        fc.all_gather_into_tensor_coalesced([torch.ones(2, 1 + me)], g)[0])),
    "reduce_scatter-shapes": ("shape", lambda fc, me, g: fc.reduce_scatter_tensor(
        torch.ones(2, 1 + me), "sum", 0, g)),
    "reduce_scatter_coalesced-shapes": ("shape", lambda fc, me, g: (
        fc.reduce_scatter_tensor_coalesced([torch.ones(2, 1 + me)], "sum", [0], g)[0])),
    "all_to_all-trailing_shapes": ("shape", lambda fc, me, g: fc.all_to_all_single(
        torch.ones(2, 1 + me), None, None, g)),
    "broadcast-shapes": ("shape", lambda fc, me, g: fc.broadcast(torch.ones(2 + me), 0, g)),
    "broadcast_-src": ("src", lambda fc, me, g: fc.ops.broadcast_(
        torch.ones(2), me, fc.resolve_group_name(g))),
    "dtypes": ("dtype", lambda fc, me, g: fc.all_reduce(
        torch.ones(2, dtype=[torch.float32, torch.float64][me]), "sum", g)),
    "op": ("op", lambda fc, me, g: fc.all_reduce(torch.ones(2), "sum", g) if me == 0
           else fc.broadcast(torch.ones(2), 0, g)),
    "reduce_op": ("reduce_op", lambda fc, me, g: fc.all_reduce(torch.ones(2), ["sum", "max"][me],
                                                               g)),
    "src": ("src", lambda fc, me, g: fc.broadcast(torch.ones(2), me, g)),
    # Rank 0 expects 3 rows from rank 1, which sends it 2.
    "split_sizes": ("split", lambda fc, me, g: fc.all_to_all_single(
        torch.ones(4, 2), [[2, 3], [2, 2]][me], [2, 2], g)),
}


def _mismatch(spec, name):
    fc = funcol_api(spec)
    _, call = MISMATCHES[name]
    # A group with a short timeout: a backend without the check fails fast, not in 60 s.
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=5))
    outcome = _error(lambda: call(fc, dist.get_rank(), group))
    after = fc.all_reduce(torch.ones(1), "sum", group).wait().tolist()
    return outcome, after


@pytest.mark.spec("FC-28")
@pytest.mark.parametrize("name", list(MISMATCHES))
def test_mismatched_calls_raise_on_every_rank(backend, name):
    backend.require("functional_collectives")
    word, _ = MISMATCHES[name]
    for rank, ((exc_type, message, is_value_error), after) in enumerate(
            run(backend, _mismatch, 2, name, timeout=30)):
        where = f"rank {rank} {name} [FC-28]"
        assert is_value_error, f"{where}: {exc_type} {message}"
        assert word in message and "rank 1" in message, f"{where}: {message}"
        assert after == [2.0], f"{where}: the group is out of step after the refusal"


def _mismatch_in_a_subgroup(spec):
    fc = funcol_api(spec)
    group = dist.new_group([1, 3], timeout=datetime.timedelta(seconds=5))
    me = dist.get_rank()
    if me not in (1, 3):
        return None
    return _error(lambda: fc.all_reduce(torch.ones(me), "sum", group))


@pytest.mark.spec("FC-28")
def test_a_mismatch_names_the_global_rank_that_differs(backend):
    """Group [1, 3] of 4: group rank 1 is global rank 3, and the error says so."""
    backend.require("functional_collectives")
    # Fresh ranks after: a backend without the check leaves the group's connections out
    # of step, and a later rank list [1, 3] would find that group again.
    for rank, outcome in enumerate(run(backend, _mismatch_in_a_subgroup, 4, timeout=60,
                                       restart_after=True)):
        if outcome is None:
            continue
        exc_type, message, is_value_error = outcome
        assert is_value_error and "shape" in message and "rank 3" in message, \
            f"rank {rank}: {exc_type}: {message}"


def _leave_imports_together() -> None:
    """A barrier on the default group (its timeout is long): the group a case makes next
    with a timeout of a second or so is not judged on how long a fresh rank's imports
    took on a loaded machine."""
    dist.barrier()


def _late_peer(spec, check_timeout_s=SHORT_CHECK_TIMEOUT["REFIMPL_CHECK_TIMEOUT_S"],
               group_timeout_s=10.0):
    """Rank 1 never comes to rank 0's all_reduce: (rank 0's outcome, seconds it took)."""
    os.environ["REFIMPL_CHECK_TIMEOUT_S"] = check_timeout_s
    fc = funcol_api(spec)
    _leave_imports_together()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=group_timeout_s))
    if dist.get_rank() == 1:
        return None  # never comes to the collective
    start = time.monotonic()
    outcome = _error(lambda: fc.all_reduce(torch.ones(2), "sum", group))
    return outcome, time.monotonic() - start


@pytest.mark.spec("FC-28")
def test_a_peer_that_never_comes_is_named(backend):
    backend.require("functional_collectives")
    (exc_type, message, _), seconds = run(backend, _late_peer, 2, timeout=60)[0]
    assert exc_type != "no error" and "rank 1" in message, f"{exc_type}: {message}"
    assert seconds < 10, f"named after {seconds:.1f} s, not within the check's timeout"


@pytest.mark.spec("FC-28")
def test_the_check_gives_up_with_a_shorter_group_timeout(backend):
    """The check's timeout is 12 s, the group was made to fail in 1.5 s: rank 1 never
    comes, and rank 0 is told so, naming it, within 7 s. (12 s: far enough above the
    group's 1.5 s and a loaded machine's delays to tell the two apart, and short, since an
    implementation that waits out the check's own timeout pays it.)"""
    backend.require("functional_collectives")
    (exc_type, message, _), seconds = run(backend, _late_peer, 2, "12", 1.5, timeout=90,
                                          restart_after=True)[0]
    assert exc_type != "no error" and "rank 1" in message, f"{exc_type}: {message}"
    assert seconds < 7, f"named after {seconds:.1f} s, not within the group's 1.5 s"


def _timeout_set_in_process(spec):
    os.environ["REFIMPL_CHECK_TIMEOUT_S"] = "8"  # what set_collective_checks overrides
    fc = funcol_api(spec)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=10))
    refused = [_error(lambda t=t: fc.set_collective_checks(True, timeout_s=t))[:2]
               for t in (0, -1.0)]
    fc.set_collective_checks(True, timeout_s=0.5)
    if dist.get_rank() == 1:
        return refused, None  # never comes to the collective
    start = time.monotonic()
    outcome = _error(lambda: fc.all_reduce(torch.ones(2), "sum", group))
    return refused, (outcome, time.monotonic() - start)


@pytest.mark.spec("FC-28")
def test_set_collective_checks_takes_a_positive_timeout_and_uses_it(backend):
    backend.require("functional_collectives", "set_collective_checks")
    results = run(backend, _timeout_set_in_process, 2, timeout=60, restart_after=True)
    for rank, (refused, _) in enumerate(results):
        for exc_type, message in refused:
            assert exc_type == "ValueError" and "timeout_s" in message, \
                f"rank {rank}: a timeout of 0 or -1 s: {exc_type} {message}"
    (exc_type, message, _), seconds = results[0][1]
    assert exc_type != "no error" and "rank 1" in message, f"{exc_type}: {message}"
    assert seconds < 4, f"named after {seconds:.1f} s: the 0.5 s given was not used"


def _checks_switched_off(spec):
    os.environ["REFIMPL_CHECK_COLLECTIVES"] = "1"  # what set_collective_checks overrides
    fc = funcol_api(spec)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20))
    fc.set_collective_checks(False, timeout_s=0.5)
    if dist.get_rank() == 1:
        time.sleep(2.0)  # comes late: a check on rank 0 would give up after 0.5 s
    result = []
    outcome = _error(lambda: result.append(waited(fc.all_reduce(torch.ones(2), "sum",
                                                                group))))
    return outcome, [t.tolist() for t in result]


@pytest.mark.spec("FC-28")
def test_set_collective_checks_false_switches_the_check_off_whatever_the_environment(
        backend):
    """With `REFIMPL_CHECK_COLLECTIVES=1`, `set_collective_checks(False)` on every rank:
    rank 1 comes to the all_reduce 2 s late, rank 0 waits in the collective itself (no
    check gives up after its 0.5 s), and both get the sum."""
    backend.require("functional_collectives", "set_collective_checks")
    for rank, (outcome, result) in enumerate(run(backend, _checks_switched_off, 2, timeout=60,
                                                 restart_after=True)):
        assert outcome[0] == "no error", f"rank {rank}: {outcome[0]} {outcome[1]}"
        assert result == [[2.0, 2.0]], f"rank {rank}: {result}"


_CALLERS_VARIABLE = "REFIMPL_CONFORMANCE_FORWARDED"  # no switch of refimpl's: read here only


def _forwarded_variables(spec):
    """What this rank sees of the caller's REFIMPL_* variables, and whether the check is
    on where the backend says (refimpl's `collective_checks_enabled`; None elsewhere)."""
    fc = funcol_api(spec)
    enabled = getattr(fc, "collective_checks_enabled", None)
    return (os.environ.get("REFIMPL_CHECK_COLLECTIVES"), os.environ.get(_CALLERS_VARIABLE),
            enabled() if enabled else None)


@pytest.mark.spec("FC-28")
def test_the_ranks_follow_the_callers_refimpl_variables_set_and_removed(backend,
                                                                        monkeypatch):
    """The harness gives every rank the caller's REFIMPL_* variables at each call, exactly:
    set in the caller, the ranks have them (the check is on); changed in the caller, the
    same ranks, reused, have the new values (the check off, then on again); removed from
    the caller, they have them no more (the check is off). Under torchrun too (CF-13)."""
    backend.require("functional_collectives")
    steps = [("1", "the caller's", "set"), ("0", "the caller's, changed", "changed"),
             ("1", "the caller's, changed again", "changed"), (None, None, "removed")]
    for check_in_caller, mine_in_caller, what in steps:
        for name, value in [("REFIMPL_CHECK_COLLECTIVES", check_in_caller),
                            (_CALLERS_VARIABLE, mine_in_caller)]:
            if value is None:
                monkeypatch.delenv(name)
            else:
                monkeypatch.setenv(name, value)
        on = check_in_caller == "1"
        for rank, (check, mine, enabled) in enumerate(run(backend, _forwarded_variables, 2)):
            assert (check, mine) == (check_in_caller, mine_in_caller), \
                f"rank {rank}: the caller's variables {what}: {check_in_caller!r}, " \
                f"{mine_in_caller!r}; the rank has {check!r}, {mine!r}"
            assert enabled in (None, on), \
                f"rank {rank}: the check is {'off' if on else 'still on'} ({what})"


# ---- FC-29: a peer that dies or never comes during the collective ----------------------
def _connected_and_in_step(fc, group) -> None:
    """One collective on `group` first: every connection is made and every first call's
    work done, so that what fails next is the peer, not a connection or a slow start."""
    fc.all_reduce(torch.ones(1), "sum", group).wait()


def _entering(token: str, rank: int) -> None:
    """Say through the store that `rank` is about to wait in the collective."""
    dist.distributed_c10d._get_default_store().set(f"{token}/entering/{rank}", "1")


def _die_once_entered(token: str, ranks: list[int]) -> None:
    """Exit once every rank of `ranks` is about to wait in the collective, and a moment
    more, however loaded the machine (a fixed sleep lost that race beside 8 processes on
    2 cores: the peers met a rank already gone, on connecting rather than in the op)."""
    dist.distributed_c10d._get_default_store().wait(
        [f"{token}/entering/{r}" for r in ranks], datetime.timedelta(seconds=60))
    time.sleep(0.3)  # they are waiting in the collective by now
    os._exit(0)


def _peer_dies(spec, dies, token):
    os.environ["REFIMPL_CHECK_COLLECTIVES"] = "0"  # the failure is the backend's, not a check's
    fc = funcol_api(spec)
    _leave_imports_together()
    # A peer that never comes is seen when the group's 1 s runs out; one that dies, at
    # once (its connections close), so its group has 5 s: the first collective must not
    # time out under load.
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=5 if dies else 1))
    if dist.get_rank() == 1:
        if dies:
            _connected_and_in_step(fc, group)
            _die_once_entered(token, [0])
        return None
    if dies:
        _connected_and_in_step(fc, group)
        _entering(token, 0)
    fc.all_reduce(torch.ones(1000), "sum", group).wait()
    return "no error"


@pytest.mark.spec("FC-29")
@pytest.mark.parametrize("dies", [True, False], ids=["dies", "never_comes"])
def test_a_failed_peer_is_named(backend, dies):
    backend.require("functional_collectives")
    with pytest.raises(RankError) as info:
        run(backend, _peer_dies, 2, dies, uuid.uuid4().hex, timeout=60)
    err = info.value
    assert err.rank == 0, f"rank 0 should report the failure: {err}"
    for word in ("all_reduce", "[0, 1]", "rank 1"):
        assert word in err.message, f"the error does not name {word!r}: {err.message}"


def _member_dies(spec, token):
    os.environ["REFIMPL_CHECK_COLLECTIVES"] = "0"  # the failure is the backend's, not a check's
    fc = funcol_api(spec)
    _leave_imports_together()
    # 5 s: the first collective must not time out under load; the dying rank's
    # connections close at once, so the failure does not wait for it.
    group = dist.new_group([1, 2, 3], timeout=datetime.timedelta(seconds=5))
    rank = dist.get_rank()
    if rank == 0:
        return None  # not a member
    _connected_and_in_step(fc, group)
    if rank == 3:
        _die_once_entered(token, [1, 2])
    _entering(token, rank)
    fc.all_reduce(torch.ones(1000), "sum", group).wait()
    return "no error"


@pytest.mark.spec("FC-29")
def test_a_failed_peer_of_a_larger_group_is_named_among_the_candidates(backend):
    """Group [1, 2, 3] of a world of 4, rank 3 dies in the collective: the lowest rank that
    reports it (1) names the op, the group's global ranks, itself, and the peer that failed
    as one of the two other members, by global rank (not group rank: [1, 2]), and no single
    rank as the failed one (gloo does not say which)."""
    backend.require("functional_collectives")
    with pytest.raises(RankError) as info:
        run(backend, _member_dies, 4, uuid.uuid4().hex, timeout=60)
    err = info.value
    assert err.rank == 1, f"rank 1 should report the failure: {err}"
    for words in ("all_reduce", "[1, 2, 3]", "rank 1", "one of ranks [2, 3]"):
        assert words in err.message, f"the error does not name {words!r}: {err.message}"
    assert "rank 3 " not in err.message and "rank 2 " not in err.message, err.message


# ---- FC-31: rank lists that disagree between ranks -------------------------------------
def _disagreeing_rank_lists(spec):
    # Each rank waits out the whole check (no member ever asks for its list): 3 s, so a
    # peer delayed by a loaded machine has still said what it asked for by then.
    os.environ["REFIMPL_CHECK_TIMEOUT_S"] = "3"
    fc = funcol_api(spec)
    me = dist.get_rank()
    mine = [me, (me + 1) % 3]  # [0, 1], [1, 2], [2, 0]
    dist.barrier()  # ranks start the call together, whatever their imports cost
    start = time.monotonic()
    outcome = _error(lambda: fc.all_reduce(torch.ones(1), "sum", mine))
    return outcome, time.monotonic() - start


@pytest.mark.spec("FC-31", "FC-15")
def test_disagreeing_rank_lists_end_in_an_error(backend):
    backend.require("functional_collectives")
    # Each rank takes the check's 3 s and a little more; an implementation that makes the
    # groups without agreeing hangs in the collective until this deadline.
    results = run(backend, _disagreeing_rank_lists, 3, timeout=12, restart_after=True)
    for rank, ((exc_type, message, _), seconds) in enumerate(results):
        mine, other = [rank, (rank + 1) % 3], (rank + 1) % 3
        where = f"rank {rank}"
        assert exc_type != "no error", f"{where}: no error"
        assert str(sorted(mine)) in message and f"rank {other}" in message, \
            f"{where}: the message names neither its list nor rank {other}: {message}"
        theirs = sorted([other, (other + 1) % 3])
        assert str(theirs) in message, \
            f"{where}: the message does not name the list rank {other} asked for, {theirs}: " \
            f"{message}"
        assert seconds < 10, f"{where}: took {seconds:.1f} s"


# ---- Values (FC-1, FC-2, FC-4, FC-13..FC-22, FC-26, FC-32) -----------------------------
@functools.cache
def _values(backend, world_size, form, dtype_name):
    dtype = DTYPES[dtype_name]
    return run(backend, funcol_cases.run_cases, world_size, form, dtype, cases_for(dtype))


def _value_rules(form, case):
    """The rules a value case checks: upstream's (core) for every group form, and the
    extension's too for the forms only refimpl has (a 2-D rank list, a mesh dim by name),
    the strict FC-7 for a result without storage (CF-14: a case has its rules' level)."""
    rules = ["FC-1", "FC-2", "FC-39", "FC-5", "FC-41", "FC-14", "FC-42", "FC-43", "FC-44",
             "FC-45", "FC-46", "FC-26", "FC-32", "CF-9"]
    rules += {"rows": ["FC-15"], "mesh_dim_name": ["FC-16"]}.get(form, [])
    return rules + (["FC-7"] if case.startswith("all_gather_empty") else [])


@pytest.mark.parametrize("world_size,form,dtype_name,case", [
    pytest.param(*p, id="-".join(map(str, p)),
                 marks=[pytest.mark.xdist_group(f"values-{p[0]}-{p[1]}-{p[2]}"),
                        pytest.mark.spec(*_value_rules(p[1], p[3]))])
    for p in VALUE_PARAMS])
def test_eager_values(backend, world_size, form, dtype_name, case):
    backend.require("functional_collectives")
    dtype = DTYPES[dtype_name]
    for rank, result in enumerate(_values(backend, world_size, form, dtype_name)):
        if result is None:
            continue  # not a member of this group
        members, by_case, _ = result
        status, got, input_unchanged = by_case[case]
        where = f"rank {rank} {case} ({form}, {dtype_name}, world {world_size})"
        assert status == "ok", f"{where}: {got}"
        assert input_unchanged, f"{where}: the input was modified [FC-2]"
        want = funcol_cases.expected(case, members, members.index(rank), dtype)
        funcol_cases.assert_same(got, want, where)


def _fresh_rank_list(spec):
    fc = funcol_api(spec)
    if dist.get_rank() == 1:
        return None
    # No group of ranks {0, 2} exists in a world of 3 until this call names it.
    return fc.all_reduce(torch.full((2,), float(dist.get_rank())), "sum", [2, 0]).tolist()


@pytest.mark.spec("FC-15")
def test_rank_list_creates_its_group(backend):
    backend.require("functional_collectives")
    assert run(backend, _fresh_rank_list, 3) == [[2.0, 2.0], None, [2.0, 2.0]]


def _destroy_groups_of(members: list[int]) -> list[str]:
    """Destroy whichever groups of exactly `members` (the default group aside) exist;
    their names."""
    from torch.distributed import distributed_c10d as c10d

    groups = [pg for pg, ranks in c10d._world.pg_group_ranks.items()
              if pg is not c10d._get_default_group() and sorted(ranks) == members]
    names = [pg.group_name for pg in groups]
    for pg in groups:
        dist.destroy_process_group(pg)
    return names


def _rank_list_after_its_group_is_destroyed(spec, rounds):
    fc = funcol_api(spec)
    if dist.get_rank() == 1:
        return None
    results = []
    for round_ in range(rounds):
        value = float(dist.get_rank() + round_)
        results.append((fc.all_reduce(torch.full((2,), value), "sum", [0, 2]).tolist(),
                        _destroy_groups_of([0, 2])))
    return results


@pytest.mark.spec("FC-15")
def test_rank_list_after_its_group_is_destroyed_gets_a_new_one(backend):
    """Three times: a collective on [0, 2], then its group destroyed. Each new group meets
    its members afresh, under a name no destroyed group had: nothing of a destroyed one's
    rendezvous (its peers' addresses in the store, its collectives' count) is read again.
    Made under the destroyed one's name, a group now and then hangs or loses its
    connection (in about half of the runs of ten rounds here); its name shows the slip
    every time."""
    backend.require("functional_collectives")
    rounds = 3
    results = run(backend, _rank_list_after_its_group_is_destroyed, 3, rounds,
                  restart_after=True, timeout=30)
    assert results[1] is None
    for rank in (0, 2):
        names_before = set()
        for round_, (total, destroyed) in enumerate(results[rank]):
            expected = float(2 + 2 * round_)
            assert total == [expected, expected], f"rank {rank}, round {round_}: {total}"
            assert destroyed, f"rank {rank}, round {round_}: no group of [0, 2] to destroy"
            # The name keys the group's rendezvous in the store (and names it in traced
            # programs): a name a destroyed group had leads to that group's leftovers.
            reused = names_before.intersection(destroyed)
            assert not reused, (f"rank {rank}, round {round_}: the new group of [0, 2] has "
                                f"the name of a destroyed one, {sorted(reused)}")
            names_before.update(destroyed)


def _member_that_does_not_ask_again(spec):
    fc = funcol_api(spec)
    me = dist.get_rank()
    if me == 1:
        return None
    fc.all_reduce(torch.ones(1), "sum", [0, 2]).tolist()  # agreed: the default check time
    _destroy_groups_of([0, 2])
    if me == 2:
        return None  # asks for [0, 2] once, not twice
    # Only the request that must fail waits 1 s (a short window on the first, agreeing,
    # one failed under load: a fresh rank's imports took longer than that).
    os.environ.update(SHORT_CHECK_TIMEOUT)
    start = time.monotonic()
    outcome = _error(lambda: fc.all_reduce(torch.ones(1), "sum", [0, 2]))
    return outcome, time.monotonic() - start


@pytest.mark.spec("FC-31", "FC-15")
def test_a_member_that_does_not_ask_for_the_list_again_is_named(backend):
    """Agreeing on a rank list the second time needs the members' second requests: the
    first ones do not stand in for them."""
    backend.require("functional_collectives")
    # The ranks take about 2 s (the failing request's window is 1 s), a loaded machine a
    # few more; an implementation that creates the group without the agreement hangs in
    # the collective, and is told so when this deadline passes.
    results = run(backend, _member_that_does_not_ask_again, 3, timeout=12, restart_after=True)
    (exc_type, message, _), seconds = results[0]
    assert exc_type != "no error", "rank 0: no error"
    assert "[0, 2]" in message and "rank 2" in message, f"rank 0: {message}"
    # The agreement's error, not a later one (a collective on a group made without it).
    assert "[FC-31]" in message, f"rank 0: not the group agreement's error: {message}"
    assert seconds < 10, f"rank 0: took {seconds:.1f} s"


# torch 2.15's names (FC-37): each gives what its older name gives, on every rank.
def _single_names(spec):
    fc = funcol_api(spec)
    group, me = dist.group.WORLD, dist.get_rank()
    x = oracle.rank_input(me, (2, 3), torch.float32, salt=37)
    y = oracle.rank_input(me, (4, 1), torch.float32, salt=38)
    pairs = {
        "all_gather": lambda f: [f.all_gather_single(x, 0, group)] if f else
        [fc.all_gather_tensor(x, 0, group)],
        "reduce_scatter": lambda f: [f.reduce_scatter_single(x, "sum", 0, group)] if f else
        [fc.reduce_scatter_tensor(x, "sum", 0, group)],
        "all_gather_coalesced": lambda f: f.all_gather_single_coalesced([x, y], group) if f
        else fc.all_gather_into_tensor_coalesced([x, y], group),
        "reduce_scatter_coalesced": lambda f: f.reduce_scatter_single_coalesced(
            [x, y], "sum", [0, 0], group) if f else
        fc.reduce_scatter_tensor_coalesced([x, y], "sum", [0, 0], group),
    }
    facts = {}
    for name, call in pairs.items():
        new = [waited(t).tolist() for t in call(fc)]
        old = [waited(t).tolist() for t in call(None)]
        facts[name] = new == old and bool(new)
    pending = [fc.all_reduce(x, "sum", group), fc.all_reduce(y * 3, "sum", group)]
    done = fc.wait_tensors(pending)
    want = [waited(fc.all_reduce(x, "sum", group)).tolist(),
            waited(fc.all_reduce(y * 3, "sum", group)).tolist()]
    facts["wait_tensors"] = [waited(t).tolist() for t in done] == want
    facts["all_waited"] = not any(isinstance(t, fc.AsyncCollectiveTensor) for t in done)
    return facts


@pytest.mark.spec("FC-37")
def test_the_2_15_names_give_what_the_older_names_give(backend):
    backend.require("functional_collectives", "all_gather_single", "reduce_scatter_single",
                    "all_gather_single_coalesced", "reduce_scatter_single_coalesced",
                    "wait_tensors")
    want = {"all_gather": True, "reduce_scatter": True, "all_gather_coalesced": True,
            "reduce_scatter_coalesced": True, "wait_tensors": True, "all_waited": True}
    for rank, facts in enumerate(run(backend, _single_names, 2)):
        assert facts == want, f"rank {rank}: {facts}"


# all_reduce(min / max)'s gradient (FC-23): the summed output gradient goes to the holders
# of the extremum, split equally among ties across ranks. Rank r's input: element 0 is r
# (max held by the last rank alone, min by rank 0), element 1 is 5 on every rank (a tie of
# all), element 2 is 7 on ranks 0 and 1, 0 elsewhere (a tie of two for max), element 3
# is -r.
def _extremum_gradient(spec, op):
    fc = funcol_api(spec)
    me = dist.get_rank()
    x = torch.tensor([float(me), 5.0, 7.0 if me < 2 else 0.0, float(-me)],
                     dtype=torch.float64, requires_grad=True)
    w = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64) * (me + 1)
    (fc.all_reduce(x, op, dist.group.WORLD) * w).sum().backward()
    return x.grad


@pytest.mark.spec("FC-23", "FC-24")
@pytest.mark.parametrize("op", ["max", "min", "MAX"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_min_and_max_gradients_go_to_the_extremum_shared_among_ties(backend, op, world_size):
    backend.require("functional_collectives")
    n = world_size
    total = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64) * sum(range(1, n + 1))
    for rank, grad in enumerate(run(backend, _extremum_gradient, n, op)):
        x = [float(rank), 5.0, 7.0 if rank < 2 else 0.0, float(-rank)]
        xs = [[float(r), 5.0, 7.0 if r < 2 else 0.0, float(-r)] for r in range(n)]
        pick = max if op.lower() == "max" else min
        want = []
        for i in range(4):
            extremum = pick(row[i] for row in xs)
            holders = sum(row[i] == extremum for row in xs)
            want.append(float(total[i]) / holders if x[i] == extremum else 0.0)
        assert grad is not None, f"{op} rank {rank}: no gradient reached the input"
        assert grad.tolist() == want, f"{op} rank {rank}: {grad.tolist()} != {want}"


# NaN, infinities and signed zeros (FC-23): an element holds the extremum when it equals the
# result or both are NaN, so a NaN result goes to the NaN elements, shared among them like
# any tie (as torch.max's own gradient does). Rank r's input (world 2 or 3): element 0 is
# NaN on every rank; element 1 is +inf on ranks 0 and n-1, 1 elsewhere; element 2 is -inf on
# rank 1 only, 0.5 elsewhere; element 3 is 0.0 on even ranks, -0.0 on odd ones (equal: a
# tie of all); elements 4 and 5 are NaN on rank 1, rank 0 only, finite elsewhere: whether
# the backend's min / max returns that NaN is not FC-23's, so their gradient is judged
# against the result each rank got.
_NAN, _INF = float("nan"), float("inf")


def _special_row(rank: int, n: int) -> list[float]:
    return [_NAN, _INF if rank in (0, n - 1) else 1.0, -_INF if rank == 1 else 0.5,
            0.0 if rank % 2 == 0 else -0.0, _NAN if rank == 1 else 2.0 + rank,
            _NAN if rank == 0 else 2.0 - rank]


def _special_weights(rank: int) -> list[float]:
    return [float(i + 1) * (rank + 1) for i in range(6)]


def _extremum_gradient_of_special_values(spec, op, dtype):
    fc = funcol_api(spec)
    me, n = dist.get_rank(), dist.get_world_size()
    x = torch.tensor(_special_row(me, n), dtype=dtype, requires_grad=True)
    w = torch.tensor(_special_weights(me), dtype=dtype)
    y = fc.all_reduce(x, op, dist.group.WORLD)
    (y * w).sum().backward()
    return waited(y).detach().to(torch.float64), x.grad


def _holds(x: float, y: float) -> bool:
    return x == y or (x != x and y != y)


@pytest.mark.spec("FC-23")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["f64", "f32", "bf16"])
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_min_and_max_gradients_of_nan_and_infinities(backend, op, dtype, world_size):
    """A NaN extremum is held by the NaN elements (the gradient does not vanish), an
    infinite one by the infinite elements, 0.0 and -0.0 tie; on every rank, in float64,
    float32 and bfloat16 (every expected value is exact in bfloat16)."""
    backend.require("functional_collectives")
    n = world_size
    rows = [_special_row(r, n) for r in range(n)]
    total = [sum(_special_weights(r)[i] for r in range(n)) for i in range(6)]
    pick = max if op == "max" else min
    outs = run(backend, _extremum_gradient_of_special_values, n, op, dtype)
    results = [y.tolist() for y, _ in outs]
    # Elements 0..3 have one extremum whatever the backend does with a NaN.
    want = [_NAN, pick(row[1] for row in rows), pick(row[2] for row in rows), 0.0]
    for rank, y in enumerate(results):
        assert all(_holds(a, b) for a, b in zip(y[:4], want, strict=True)), \
            f"{op} {dtype} rank {rank}: result {y[:4]} != {want}"
    holders = [sum(_holds(rows[r][i], results[r][i]) for r in range(n)) for i in range(6)]
    for rank, (_, grad) in enumerate(outs):
        assert grad is not None, f"{op} {dtype} rank {rank}: no gradient reached the input"
        assert grad.dtype == dtype, f"{op} rank {rank}: gradient of dtype {grad.dtype}"
        want = [total[i] / holders[i] if _holds(rows[rank][i], results[rank][i]) else 0.0
                for i in range(6)]
        got = grad.to(torch.float64).tolist()
        assert got == want, f"{op} {dtype} rank {rank} of {n} (inputs {rows[rank]}, " \
            f"result {results[rank]}): gradient {got} != {want}"


# ---- FC-17, FC-23: reductions given as torch.distributed.ReduceOp (upstream 2.15) ---------
_ENUMS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def _reduce_op_values(spec, api, name):
    """`api` with ReduceOp.<name> and with its str name, on every rank."""
    fc = funcol_api(spec)
    world = dist.group.WORLD
    dtype = torch.int64 if name in ("BAND", "BOR", "BXOR") else torch.float32
    x = oracle.rank_input(dist.get_rank(), (4, 2), torch.float32, salt=47).mul(8).to(dtype)
    call = {
        "all_reduce": lambda op: [fc.all_reduce(x, op, world)],
        "reduce_scatter": lambda op: [fc.reduce_scatter_tensor(x, op, 0, world)],
        "all_reduce_coalesced": lambda op: fc.all_reduce_coalesced([x, x * 2], op, world),
    }[api]
    return ([waited(t) for t in call(getattr(dist.ReduceOp, name))],
            [waited(t) for t in call(name.lower())])


@pytest.mark.spec("FC-17")
@pytest.mark.parametrize("api, name", [("all_reduce", n) for n in _ENUMS]
                         + [("reduce_scatter", "AVG"), ("all_reduce_coalesced", "AVG")],
                         ids=lambda v: v)
def test_a_reduce_op_value_reduces_as_its_name(backend, api, name):
    backend.require("functional_collectives")
    for rank, (by_value, by_name) in enumerate(run(backend, _reduce_op_values, 2, api, name)):
        assert len(by_value) == len(by_name), rank
        for got, want in zip(by_value, by_name, strict=True):
            assert torch.equal(got, want), f"rank {rank} {api} ReduceOp.{name}: " \
                f"{got.tolist()} != {want.tolist()} (the name gives)"


def _premul_sum(spec, factors, kind):
    """The premul_sum of every rank's input, rank r's factor `factors[r]` (a number, or a
    one-element tensor with kind "tensor"), and the gradient of rank r's input."""
    fc = funcol_api(spec)
    me, world = dist.get_rank(), dist.group.WORLD
    factor = factors[me] if kind == "number" else torch.tensor([factors[me]],
                                                               dtype=torch.float64)
    op = dist._make_nccl_premul_sum(factor)
    x = oracle.rank_input(me, (4, 2), torch.float64, salt=53).requires_grad_()
    w = oracle.rank_input(me, (4, 2), torch.float64, salt=54)
    reduced = fc.all_reduce(x, op, world)
    (reduced * w).sum().backward()
    scattered = fc.reduce_scatter_tensor(x.detach(), op, 0, world)
    return waited(reduced).detach(), waited(scattered), x.grad


@pytest.mark.spec("FC-17", "FC-47")
@pytest.mark.parametrize("factors, kind", [((0.5, 0.5), "number"), ((0.5, 3.0), "number"),
                                           ((0.25, 2.0), "tensor")],
                         ids=["equal", "per_rank", "tensor_per_rank"])
def test_premul_sum_multiplies_each_rank_by_its_factor_then_sums(backend, factors, kind):
    """Every rank's input times its own factor, summed; rank r's gradient is its factor
    times the summed output gradient (with equal factors, upstream's gradient too)."""
    backend.require("functional_collectives")
    n = 2
    xs = [oracle.rank_input(r, (4, 2), torch.float64, salt=53) for r in range(n)]
    ws = [oracle.rank_input(r, (4, 2), torch.float64, salt=54) for r in range(n)]
    total = sum(x * f for x, f in zip(xs, factors, strict=True))
    for rank, (reduced, scattered, grad) in enumerate(run(backend, _premul_sum, n, factors,
                                                          kind)):
        where = f"rank {rank} factors {factors}"
        assert torch.equal(reduced, total), f"{where}: {reduced.tolist()} [FC-17]"
        assert torch.equal(scattered, total[2 * rank:2 * rank + 2]), f"{where} reduce_scatter"
        assert grad is not None, f"{where}: no gradient reached the input"
        assert torch.equal(grad, factors[rank] * sum(ws)), f"{where}: {grad.tolist()} [FC-23]"


_PREMUL_DTYPES = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16,
                  "i64": torch.int64, "i32": torch.int32, "bool": torch.bool}
_PREMUL_FACTORS = (0.5, 2.0)  # rank r's factor: exact in every floating dtype


def _premul_input(rank, dtype_name, i):
    return oracle.rank_input(rank, (4, 2), _PREMUL_DTYPES[dtype_name], salt=71 + i)


def _premul_sum_of_dtypes(spec, api, dtypes, kind):
    """`api` with a premul_sum (this rank's factor a number or a one-element float64
    tensor) on inputs of `dtypes`, one per member of a coalesced list: (outcome, collectives
    a refused call left started, an all_reduce after it)."""
    fc = funcol_api(spec)
    me, world = dist.get_rank(), dist.group.WORLD
    factor = _PREMUL_FACTORS[me]
    op = dist._make_nccl_premul_sum(factor if kind == "number" else
                                    torch.tensor([factor], dtype=torch.float64))
    xs = [_premul_input(me, d, i) for i, d in enumerate(dtypes)]
    call = {
        "all_reduce": lambda: [fc.all_reduce(xs[0], op, world)],
        "reduce_scatter": lambda: [fc.reduce_scatter_tensor(xs[0], op, 0, world)],
        "all_reduce_coalesced": lambda: fc.all_reduce_coalesced(xs, op, world),
        "reduce_scatter_coalesced": lambda: fc.reduce_scatter_tensor_coalesced(
            xs, op, [0] * len(xs), world),
    }[api]
    registry = fc.work_registry_size
    before = registry() if registry else 0
    try:
        outcome = ("ok", [waited(t) for t in call()])
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc), isinstance(exc, ValueError))
    started = registry() - before if registry else 0
    after = fc.all_reduce(torch.ones(1), "sum", world).wait().tolist()
    return outcome, started, after


# (api, the inputs' dtypes, the factor's kind): refused when any input is not floating,
# the first member of a coalesced list or a later one.
_PREMUL_CALLS = [
    ("all_reduce", ("f64",), "number"), ("all_reduce", ("f32",), "tensor"),
    ("all_reduce", ("bf16",), "number"), ("all_reduce", ("i64",), "number"),
    ("reduce_scatter", ("bf16",), "tensor"), ("reduce_scatter", ("i32",), "number"),
    ("all_reduce_coalesced", ("f64", "f32", "bf16"), "number"),
    ("all_reduce_coalesced", ("f32", "i64"), "number"),
    ("all_reduce_coalesced", ("i64", "f32"), "number"),
    ("all_reduce_coalesced", ("bf16", "f64", "bool"), "tensor"),
    ("reduce_scatter_coalesced", ("f32", "bf16", "f64"), "tensor"),
    ("reduce_scatter_coalesced", ("bf16", "f64", "i32"), "tensor"),
]


def _premul_refused(dtypes):
    return any(not _PREMUL_DTYPES[d].is_floating_point for d in dtypes)


@pytest.mark.parametrize("api, dtypes, kind", [
    pytest.param(*p, id=f"{p[0]}-{'_'.join(p[1])}-{p[2]}",
                 marks=pytest.mark.spec(*(["FC-17", "FC-27"] if _premul_refused(p[1])
                                          else ["FC-17"])))
    for p in _PREMUL_CALLS])
def test_premul_sum_takes_floating_inputs_only_every_member_checked(backend, api, dtypes,
                                                                    kind):
    """A premul_sum on float64, float32 and bfloat16 inputs, single and coalesced (dtypes
    mixed in one list): each member is the sum of every rank's input times its factor, in
    its dtype. An integer or bool input, first in a coalesced list or not, is refused on
    every rank with a ValueError naming reduce_op, before any member starts (FC-27)."""
    backend.require("functional_collectives")
    n = 2
    refused = _premul_refused(dtypes)
    for rank, (outcome, started, after) in enumerate(run(backend, _premul_sum_of_dtypes, n,
                                                         api, dtypes, kind)):
        where = f"rank {rank} {api} of {list(dtypes)} ({kind} factor)"
        if refused:
            assert outcome[0] != "ok", \
                f"{where}: accepted, giving {[t.tolist() for t in outcome[1]]} [FC-17]"
            exc_type, message, is_value_error = outcome
            assert is_value_error and "reduce_op" in message, \
                f"{where}: {exc_type} {message} [FC-17]"
            assert started == 0, f"{where}: the refused call left {started} started [FC-27]"
        else:
            assert outcome[0] == "ok", f"{where}: {outcome[0]} {outcome[1]}"
            for i, (d, got) in enumerate(zip(dtypes, outcome[1], strict=True)):
                total = sum(_premul_input(r, d, i).double() * _PREMUL_FACTORS[r]
                            for r in range(n)).to(_PREMUL_DTYPES[d])
                want = total if api.startswith("all_reduce") else total[2 * rank:2 * rank + 2]
                assert got.dtype == want.dtype and torch.equal(got, want), \
                    f"{where}: member {i} ({d}): {got.tolist()} != {want.tolist()} [FC-17]"
        assert after == [2.0], f"{where}: the group is out of step after the call"


# ---- FC-6: work is keyed by the result's storage -------------------------------------------
def _wait_through_an_offset_view(spec):
    """An all_reduce's raw result waited only through a view at an offset: the wait must
    find the collective's work (the view's data_ptr is not the result's)."""
    fc = funcol_api(spec)
    me, world = dist.get_rank(), dist.group.WORLD
    g = fc.resolve_group_name(world)
    registry = fc.work_registry_size
    x = oracle.rank_input(me, (4096,), torch.float32, salt=59)
    before = registry() if registry else None
    result = fc.ops.all_reduce(x, "sum", g)
    tail = result[1024:]
    waited_tail = fc.ops.wait_tensor(tail)
    after = registry() if registry else None
    values = waited_tail.clone()
    fc.ops.wait_tensor(result)  # whatever a wrong registry left pending
    return before, after, values


@pytest.mark.spec("FC-6", "FC-5")
def test_a_wait_through_a_view_at_an_offset_waits_the_collective(backend):
    backend.require("functional_collectives")
    n = 2
    xs = [oracle.rank_input(r, (4096,), torch.float32, salt=59) for r in range(n)]
    want = oracle.reduce(xs, "sum")[1024:]
    for rank, (before, after, values) in enumerate(run(backend, _wait_through_an_offset_view,
                                                       n)):
        if before is not None:
            assert after == before, (f"rank {rank}: {after - before} collectives still "
                                     f"pending after a wait of their result's view [FC-6]")
        assert torch.equal(values, want), f"rank {rank}: the view read unfinished data"
