"""Conformance: functional collectives (SPEC section 1, FC).

Eager values of every op against the single-process oracle (every group form, dtype and
world size 2 and 4), AsyncCollectiveTensor semantics, the observable work registry,
bad inputs, gradients, and traced graphs as canonical goldens shared by all backends.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline

from conformance import funcol_cases, oracle
from conformance.canonical import canonical_graph
from conformance.funcol_cases import DTYPES, GROUP_FORMS, cases_for, funcol_api
from conformance.harness import run

WORLD_SIZES = [2, 4]
VALUE_PARAMS = [(w, form, d, case) for w in WORLD_SIZES for form in GROUP_FORMS
                for d in DTYPES for case in cases_for(DTYPES[d])]


@functools.cache
def _values(backend, world_size, form, dtype_name):
    dtype = DTYPES[dtype_name]
    return run(backend, funcol_cases.run_cases, world_size, form, dtype, cases_for(dtype))


@pytest.mark.spec("FC-1", "FC-2", "FC-4", "FC-5", "FC-13", "FC-14", "FC-15", "FC-16", "FC-17",
                  "FC-18", "FC-20", "FC-21", "FC-22", "FC-26", "CF-9")
@pytest.mark.parametrize("world_size,form,dtype_name,case", [
    pytest.param(*p, id="-".join(map(str, p)),
                 marks=pytest.mark.xdist_group(f"values-{p[0]}-{p[1]}-{p[2]}"))
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
    facts["repr_has_values"] = "2., 2., 2., 2." in repr(fc.all_reduce(x, "max",
                                                                          dist.group.WORLD))
    raw = fc.ops.all_reduce(x, "sum", dist.group.WORLD.group_name)
    facts["wait_returns_arg"] = fc.wait_tensor(raw) is raw
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
            "tolist": [1.0] * 4, "repr_has_values": True, "wait_returns_arg": True,
            "op_wait_value": [3.0] * 4}


def _registry(spec):
    fc = funcol_api(spec)
    count = fc.work_registry_size
    seen = {"start": count()}
    y = fc.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
    seen["issued"] = count()
    y.view(4)
    seen["after_view"] = count()
    y.wait()
    seen["after_wait"] = count()
    raw = fc.ops.all_reduce(torch.ones(4), "sum", dist.group.WORLD.group_name)
    seen["raw_issued"] = count()
    fc.wait_tensor(raw)
    seen["after_wait_tensor"] = count()
    fc.all_reduce(torch.empty(0), "sum", dist.group.WORLD)
    seen["empty"] = count()
    for i in range(4):
        fc.all_reduce(torch.full((8,), float(i)), "sum", dist.group.WORLD)
    gc.collect()
    seen["dropped"] = count()
    seen["next"] = fc.all_reduce(torch.ones(2), "sum", dist.group.WORLD).tolist()
    return seen


@pytest.mark.spec("FC-5", "FC-6", "FC-7", "FC-8")
def test_work_registry(backend):
    backend.require("functional_collectives", "work_registry_size")
    for seen in run(backend, _registry, 2):
        start = seen["start"]
        assert seen == {"start": start, "issued": start + 1, "after_view": start + 1,
                        "after_wait": start, "raw_issued": start + 1,
                        "after_wait_tensor": start, "empty": start, "dropped": start,
                        "next": [2.0, 2.0]}


BAD_INPUTS = {
    # name: (SPEC rule, exception types accepted, word the message must contain)
    "unknown_reduce_op": ("FC-17", (ValueError,), "median"),
    "avg_of_integers": ("FC-18", (ValueError, TypeError, RuntimeError), "avg"),
    "indivisible_scatter_dim": ("FC-20", (ValueError,), "divisible"),
    "gather_dim_out_of_range": ("FC-20", (ValueError, IndexError), "dim"),
    "unequal_rank_rows": ("FC-15", (ValueError,), "size"),
    "duplicate_ranks": ("FC-15", (ValueError,), "duplicate"),
    "unknown_group_name": ("FC-13", (ValueError,), "no-such-group"),
    "bad_group_type": ("FC-13", (TypeError, ValueError), "group"),
    "mismatched_group_size": ("FC-19", (ValueError, RuntimeError), "size"),
    "bad_split_sizes": ("FC-21", (ValueError, RuntimeError), "split"),
    "non_differentiable_reduction": ("FC-24", (RuntimeError,), "max"),
}


def _bad_input(spec, name):
    fc = funcol_api(spec)
    world = dist.group.WORLD
    x = torch.ones(4, 4)
    attempts = {
        "unknown_reduce_op": lambda: fc.all_reduce(x, "median", world),
        "avg_of_integers": lambda: fc.all_reduce(torch.ones(2, dtype=torch.int64), "avg", world),
        "indivisible_scatter_dim": lambda: fc.reduce_scatter_tensor(torch.ones(3, 4), "sum", 0,
                                                                    world),
        "gather_dim_out_of_range": lambda: fc.all_gather_tensor(x, 5, world),
        "unequal_rank_rows": lambda: fc.all_reduce(x, "sum", [[0, 1], [2]]),
        "duplicate_ranks": lambda: fc.all_reduce(x, "sum", [0, 0, 1]),
        "unknown_group_name": lambda: fc.all_reduce(x, "sum", "no-such-group"),
        "bad_group_type": lambda: fc.all_reduce(x, "sum", 2.5),
        "mismatched_group_size": lambda: fc.ops.all_gather_into_tensor(x, 3, world.group_name),
        "bad_split_sizes": lambda: fc.all_to_all_single(x, [2, 2], [1, 1], world),
        "non_differentiable_reduction": lambda: fc.all_reduce(
            torch.ones(2, requires_grad=True), "max", world) * 1,
    }
    try:
        result = attempts[name]()
        if hasattr(result, "wait"):
            result.wait()
        outcome = ("no error", "")
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    # FC-27: the group is still in step.
    after = fc.all_reduce(torch.ones(1), "sum", world).wait().tolist()
    return outcome, after


@pytest.mark.spec("FC-13", "FC-15", "FC-17", "FC-18", "FC-19", "FC-20", "FC-21", "FC-24", "FC-27")
@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_refused(backend, name):
    rule, types, word = BAD_INPUTS[name]
    backend.require("functional_collectives")
    for (exc_type, message), after in run(backend, _bad_input, 2, name, timeout=60):
        assert exc_type in {t.__name__ for t in types}, f"{name} [{rule}]: {exc_type} {message}"
        assert word.lower() in message.lower(), (
            f"{name} [{rule}]: message does not mention {word!r}: {message}")
        assert after == [2.0], "FC-27: a refused call left the group out of step"


GRAD_OPS = ["all_gather", "reduce_scatter", "reduce_scatter_avg", "all_reduce",
            "all_reduce_avg", "all_to_all", "broadcast"]


def _out_shape(op, n):
    if op == "all_gather":
        return (4, 2 * n)
    return (4 // n, 2) if op.startswith("reduce_scatter") else (4, 2)


def _gradient(spec, op, salt):
    fc = funcol_api(spec)
    me, n, world = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    x = oracle.rank_input(me, (4, 2), torch.float64, salt=salt).requires_grad_()
    w = oracle.rank_input(me, _out_shape(op, n), torch.float64, salt=salt + 1)
    y = {
        "all_gather": lambda: fc.all_gather_tensor(x, 1, world),
        "reduce_scatter": lambda: fc.reduce_scatter_tensor(x, "sum", 0, world),
        "reduce_scatter_avg": lambda: fc.reduce_scatter_tensor(x, "avg", 0, world),
        "all_reduce": lambda: fc.all_reduce(x, "sum", world),
        "all_reduce_avg": lambda: fc.all_reduce(x, "avg", world),
        "all_to_all": lambda: fc.all_to_all_single(x, None, None, world),
        "broadcast": lambda: fc.broadcast(x, 1, world),
    }[op]()
    (y * w).sum().backward()
    return x.grad


def _expected_grad(op, rank, n, salt):
    ws = [oracle.rank_input(r, _out_shape(op, n), torch.float64, salt=salt + 1)
          for r in range(n)]
    total = torch.stack(ws).sum(0)
    if op == "all_gather":
        return torch.chunk(total, n, dim=1)[rank]
    if op.startswith("reduce_scatter"):
        g = torch.cat(ws, dim=0)
        return g / n if op.endswith("avg") else g
    if op.startswith("all_reduce"):
        return total / n if op.endswith("avg") else total
    if op == "all_to_all":
        return oracle.all_to_all_single(ws, rank)
    return total if rank == 1 else torch.zeros_like(total)  # broadcast from group rank 1


@pytest.mark.spec("FC-23", "FC-25")
@pytest.mark.parametrize("op", GRAD_OPS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gradient(backend, op, world_size):
    backend.require("functional_collectives")
    for rank, grad in enumerate(run(backend, _gradient, world_size, op, 31)):
        want = _expected_grad(op, rank, world_size, 31)
        assert grad is not None, f"{op} rank {rank}: no gradient reached the input"
        assert torch.equal(grad, want), f"{op} rank {rank}: {grad} != {want}"


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


@pytest.mark.spec("FC-3", "FC-12")
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
