"""Conformance: the functional collectives' argument forms across their neighbours (FC).

- Reductions given as `torch.distributed.ReduceOp` members and as premul_sum (FC-17, torch
  2.15's) on every dtype family (float64, float32, bfloat16, float16; int64, int32, uint8
  and bool where FC-18 allows the reduction) and on every form that takes one:
  `all_reduce`, `all_reduce_coalesced`, `reduce_scatter_tensor`, its autograd form and
  `reduce_scatter_tensor_coalesced`, with the gradients (FC-23, FC-24, FC-47); the
  in-place ops `all_reduce_` and `all_reduce_coalesced_` at op level, by every reduction
  name and given a `ReduceOp` (FC-17, FC-18, FC-39).
- The list argument of the coalesced forms and of `wait_tensors` in each wrong form: a
  tensor, an empty list, a list holding a non-tensor; and a tuple, which is a list
  (FC-26, FC-27, FC-37).
- Negative and extreme dims (-1, -ndim; ndim, -ndim - 1) on 1-, 2- and 3-d inputs on
  every form that takes a dim (FC-20, FC-44).

Each test function makes one run on a world of 2 ranks (cached); its parametrized cases
read their part of that run, on every rank. A rank records each call's outcome and goes
on, so a refusal, or an upstream error, never leaves the ranks out of step.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.distributed as dist

from conformance import oracle
from conformance.funcol_cases import funcol_api, waited
from conformance.harness import run

N = 2  # every case runs on a world of 2 ranks
RUN_TIMEOUT_S = 180

FLOATING = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16,
            "f16": torch.float16}
INTEGRAL = {"i64": torch.int64, "i32": torch.int32, "u8": torch.uint8, "bool": torch.bool}
DTYPES = {**FLOATING, **INTEGRAL}
FAMILIES = {"floating": list(FLOATING), "integral": list(INTEGRAL)}
MEMBERS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
BITWISE = ("BAND", "BOR", "BXOR")
REDUCING_FORMS = ["all_reduce", "all_reduce_coalesced", "reduce_scatter_tensor",
                  "reduce_scatter_tensor_autograd", "reduce_scatter_tensor_coalesced"]
COALESCED = ("all_reduce_coalesced", "reduce_scatter_tensor_coalesced")
SHAPE = (4, 2)


def _allowed(member: str, dtype_name: str) -> bool:
    """FC-18: avg of floating dtypes only, the bitwise reductions of the others only."""
    if dtype_name in FLOATING:
        return member not in BITWISE
    return member != "AVG"


def _input(rank: int, dtype_name: str, salt: int, shape=SHAPE) -> torch.Tensor:
    return oracle.rank_input(rank, shape, DTYPES[dtype_name], salt=salt)


def _outcome(fc, call):
    """(("ok", plain results) or (exception type, message), collectives the call left
    started: the work registry's growth, 0 where the backend exposes none)."""
    registry = fc.work_registry_size
    before = registry() if registry else 0
    started = None
    try:
        results = call()
        started = registry() - before if registry else 0
        results = results if isinstance(results, (list, tuple)) else [results]
        # An error the wait raises (upstream: the process group's) is the call's too.
        return ("ok", [waited(t).detach() for t in results]), started
    except Exception as exc:
        if started is None:
            started = registry() - before if registry else 0
        return (type(exc).__name__, str(exc)), started


def _in_step(fc) -> list:
    """An all_reduce after everything else: [2.0] on each rank when the group is in step."""
    return fc.all_reduce(torch.ones(1), "sum", dist.group.WORLD).wait().tolist()


def _names(message: str, word: str) -> bool:
    return re.search(rf"\b{re.escape(word.lower())}\b", message.lower()) is not None


def _equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def _calls_of(coalesced: bool, dtypes) -> list[tuple]:
    """The dtype lists of the calls on `dtypes`: one a dtype, for a coalesced form a list
    of two members of that dtype (gloo coalesces members of one dtype only)."""
    return [(d, d) if coalesced else (d,) for d in dtypes]


def _refused_last(member: str, dtype_name: str) -> tuple:
    """A coalesced list whose last member's dtype `member` does not take, after one of
    the other family that it takes: every member is checked before any starts (FC-27)."""
    other = "integral" if dtype_name in FLOATING else "floating"
    return (next(d for d in FAMILIES[other] if _allowed(member, d)), dtype_name)


def _reduce(fc, form, xs, op, world):
    """`form` of the Python API on the tensors `xs` (one for a single form)."""
    if form == "all_reduce":
        return [fc.all_reduce(xs[0], op, world)]
    if form == "reduce_scatter_tensor":
        return [fc.reduce_scatter_tensor(xs[0], op, 0, world)]
    if form == "reduce_scatter_tensor_autograd":
        return [fc.reduce_scatter_tensor_autograd(xs[0], op, 0, world)]
    if form == "all_reduce_coalesced":
        return fc.all_reduce_coalesced(xs, op, world)
    if form == "reduce_scatter_tensor_coalesced":
        return fc.reduce_scatter_tensor_coalesced(xs, op, [0] * len(xs), world)
    raise ValueError(form)


def _want(form: str, member: str, rank: int, dtypes, salt: int, factors=None):
    """What `form` gives group rank `rank` for members of `dtypes` (salt + position): the
    reduction `member` of every rank's input, or with `factors` the premul_sum."""
    wants = []
    for i, d in enumerate(dtypes):
        xs = [_input(r, d, salt + i) for r in range(N)]
        if factors is None:
            total = oracle.reduce(xs, member.lower())
        else:  # each rank's input times its factor, in its dtype; then their sum
            total = sum(_premultiplied(x, f).double() for x, f in zip(xs, factors,
                                                                       strict=True))
            total = total.to(DTYPES[d])
        wants.append(total if form.startswith("all_reduce") else
                     torch.chunk(total, N, dim=0)[rank])
    return wants


def _premultiplied(x: torch.Tensor, factor) -> torch.Tensor:
    factor = factor if not isinstance(factor, torch.Tensor) else factor.double()
    return (x.double() * factor).to(x.dtype)


def _check_refused(where, outcome, started, words, *, types=None):
    """A refusal: an exception (of `types`, when given) whose message names one of
    `words`, leaving nothing started (FC-27)."""
    assert outcome[0] != "ok", \
        f"{where}: accepted, giving {[t.tolist() for t in outcome[1]]}"
    exc_type, message = outcome
    if types is not None:
        assert exc_type in types, f"{where}: {exc_type}, not {' or '.join(types)}: {message}"
    assert any(_names(message, w) for w in words), \
        f"{where}: the message names none of {words}: {exc_type}: {message}"
    assert started == 0, f"{where}: the refused call left {started} collectives started " \
        f"[FC-27]"


# ==== (a) ReduceOp members on every dtype and every form ===================================
def _member_calls(fc, form, family, member, me, world):
    """[(dtypes, outcome, started)] of `form` with ReduceOp.<member> on each of `family`'s
    dtypes (coalesced: two members of it; one the member does not take placed last,
    after one of a dtype it takes)."""
    op = getattr(dist.ReduceOp, member)
    coalesced = form in COALESCED
    calls = [dts if not coalesced or _allowed(member, dts[0]) else
             _refused_last(member, dts[0]) for dts in _calls_of(coalesced, FAMILIES[family])]
    facts = []
    for dts in calls:
        xs = [_input(me, d, 100 + i) for i, d in enumerate(dts)]
        outcome, started = _outcome(fc, lambda xs=xs: _reduce(fc, form, xs, op, world))
        facts.append((dts, outcome, started))
    return facts


# The gradient cases: (api, member) and the rules each checks.
GRADIENT_CASES = {
    ("all_reduce", "SUM"): ("FC-17", "FC-23"), ("all_reduce", "AVG"): ("FC-17", "FC-23"),
    ("all_reduce", "MIN"): ("FC-17", "FC-23"), ("all_reduce", "MAX"): ("FC-17", "FC-23"),
    ("all_reduce", "PRODUCT"): ("FC-17", "FC-24"),
    ("reduce_scatter_tensor_autograd", "SUM"): ("FC-17", "FC-23", "FC-32"),
    ("reduce_scatter_tensor_autograd", "AVG"): ("FC-17", "FC-47", "FC-32"),
    ("reduce_scatter_tensor_autograd", "PRODUCT"): ("FC-17", "FC-24"),
    ("reduce_scatter_tensor_autograd", "MIN"): ("FC-17", "FC-24"),
    ("reduce_scatter_tensor_autograd", "MAX"): ("FC-17", "FC-24"),
}
_DIFFERENTIABLE = {"all_reduce": ("SUM", "AVG", "MIN", "MAX"),
                   "reduce_scatter_tensor_autograd": ("SUM", "AVG")}


def _out_rows(api: str) -> int:
    return SHAPE[0] if api == "all_reduce" else SHAPE[0] // N


def _gradient(fc, api, op, me, d, world, salt):
    """(stage, outcome): the gradient of rank `me`'s input of dtype `d` through `api`
    with `op`, weighted by this rank's `w`; stage "call" or "backward" for an error."""
    x = _input(me, d, salt).requires_grad_()
    w = _input(me, d, salt + 1, (_out_rows(api), SHAPE[1]))
    try:
        y = (fc.all_reduce(x, op, world) if api == "all_reduce" else
             getattr(fc, api)(x, op, 0, world))
    except Exception as exc:
        return "call", (type(exc).__name__, str(exc))
    try:
        (y * w).sum().backward()
    except Exception as exc:
        return "backward", (type(exc).__name__, str(exc))
    return "ok", (waited(y).detach(), x.grad)


def _reduce_op_run(spec):
    fc = funcol_api(spec)
    me, world = dist.get_rank(), dist.group.WORLD
    values = {(form, family, member): _member_calls(fc, form, family, member, me, world)
              for form in REDUCING_FORMS for family in FAMILIES for member in MEMBERS}
    registry = fc.work_registry_size
    gradients = {}
    for (api, member) in GRADIENT_CASES:
        for d in FLOATING:
            before = registry() if registry else 0
            stage, outcome = _gradient(fc, api, getattr(dist.ReduceOp, member), me, d,
                                       world, 200)
            gradients[(api, member, d)] = (stage, outcome,
                                           registry() - before if registry else 0)
    return values, gradients, _in_step(fc)


@functools.cache
def _reduce_op_results(backend):
    return run(backend, _reduce_op_run, N, timeout=RUN_TIMEOUT_S)


@pytest.mark.parametrize("form, family", [
    pytest.param(f, fam, marks=[pytest.mark.xdist_group("forms-reduce-op"),
                                pytest.mark.spec("FC-17", "FC-18", "FC-27")])
    for f in REDUCING_FORMS for fam in FAMILIES])
def test_a_reduce_op_member_reduces_as_its_name_on_every_dtype(backend, form, family):
    """Each of the eight `ReduceOp` members on each dtype of the family, one call a dtype
    (coalesced: two members of it): the reduction of that name, in the input's dtype, on
    every rank (FC-17). A member the dtype does not take (avg of an integer or bool, a
    bitwise one of a floating dtype) is refused naming the reduction, as the last member
    of a coalesced list too, with nothing started (FC-18, FC-27)."""
    backend.require("functional_collectives")
    for rank, (values, _, in_step) in enumerate(_reduce_op_results(backend)):
        for member in MEMBERS:
            for dts, outcome, started in values[(form, family, member)]:
                where = f"rank {rank} {form}(ReduceOp.{member}) of {list(dts)}"
                if all(_allowed(member, d) for d in dts):
                    assert outcome[0] == "ok", f"{where}: {outcome[0]}: {outcome[1]} [FC-17]"
                    want = _want(form, member, rank, dts, 100)
                    assert len(outcome[1]) == len(want), f"{where}: {len(outcome[1])} results"
                    for d, got, w in zip(dts, outcome[1], want, strict=True):
                        assert _equal(got, w), f"{where}: member {d}: {got.dtype} " \
                            f"{got.tolist()} != {w.dtype} {w.tolist()} [FC-17]"
                else:
                    _check_refused(f"{where} [FC-18]", outcome, started, [member.lower()])
        assert in_step == [2.0], f"rank {rank}: the group is out of step after the calls"


@pytest.mark.parametrize("api, member", [
    pytest.param(a, m, marks=[pytest.mark.xdist_group("forms-reduce-op"),
                              pytest.mark.spec(*rules)])
    for (a, m), rules in GRADIENT_CASES.items()])
def test_a_reduce_op_member_has_its_names_gradient_on_every_floating_dtype(backend, api,
                                                                           member):
    """The gradient through `all_reduce` and `reduce_scatter_tensor_autograd` given a
    `ReduceOp`, in float64, float32, bfloat16 and float16: sum → the summed output
    gradients (reduce_scatter: gathered), avg → the same over the group size, min / max →
    the summed gradients to the extremum's holders shared among ties (FC-23, FC-47). A
    member without a gradient (product; reduce_scatter's min and max) is refused naming
    `reduce_op` when the call is recorded, not at backward time, starting nothing (FC-24)."""
    backend.require("functional_collectives")
    outs = _reduce_op_results(backend)
    for rank, (_, gradients, in_step) in enumerate(outs):
        for d, dtype in FLOATING.items():
            stage, outcome, started = gradients[(api, member, d)]
            where = f"rank {rank} {api}(ReduceOp.{member}) of {d}"
            if member not in _DIFFERENTIABLE[api]:
                assert stage == "call", (
                    f"{where}: not refused when the call was recorded (stage {stage}: "
                    f"{outcome if stage != 'ok' else 'no error'}) [FC-24]")
                _check_refused(f"{where} [FC-24]", outcome, started, ["reduce_op"],
                               types=("RuntimeError",))
                continue
            assert stage == "ok", f"{where}: {stage}: {outcome[0]}: {outcome[1]}"
            _, grad = outcome
            want = _member_gradient(api, member, rank, d)
            assert grad is not None, f"{where}: no gradient reached the input"
            assert grad.dtype == dtype and torch.equal(grad, want), \
                f"{where}: gradient {grad.dtype} {grad.tolist()} != {want.tolist()}"
        assert in_step == [2.0], f"rank {rank}: the group is out of step after the calls"


def _member_gradient(api, member, rank, d):
    xs = [_input(r, d, 200).double() for r in range(N)]
    ws = [_input(r, d, 201, (_out_rows(api), SHAPE[1])).double() for r in range(N)]
    if api != "all_reduce":  # gathered output gradients, avg over the group size
        g = torch.cat(ws, dim=0)
        return (g / N if member == "AVG" else g).to(DTYPES[d])
    total = sum(ws)
    if member in ("SUM", "AVG"):
        return (total / N if member == "AVG" else total).to(DTYPES[d])
    y = oracle.reduce(xs, member.lower())
    holders = sum((x == y).double() for x in xs)
    return torch.where(xs[rank] == y, total / holders, 0.0).to(DTYPES[d])


# ==== (a) premul_sum on every dtype and every form =========================================
# Each kind of factor FC-17 takes, with rank r's factor (values exact in every dtype).
PREMUL_FACTORS = {"float": (0.5, 3.0), "tensor_f64": (0.25, 2.0), "tensor_0d_f32": (1.5, -0.5),
                  "tensor_f16": (-2.0, 0.5)}


def _factor(kind: str, rank: int):
    f = PREMUL_FACTORS[kind][rank]
    if kind == "tensor_f64":
        return torch.tensor([f], dtype=torch.float64)
    if kind == "tensor_0d_f32":
        return torch.tensor(f, dtype=torch.float32)
    if kind == "tensor_f16":
        return torch.tensor([f], dtype=torch.float16)
    return f


def _premul_calls(fc, form, family, me, world):
    """[(factor kind, dtypes, outcome, started)] of `form` with premul_sum: floating, every
    factor kind on each dtype (coalesced: two members of it); integral, each dtype
    (coalesced: placed last, after a float16 member), refused."""
    coalesced = form in COALESCED
    if family == "floating":
        calls = [(k, dts) for k in PREMUL_FACTORS for dts in _calls_of(coalesced, FLOATING)]
    else:
        calls = [("float", ("f16", d) if coalesced else (d,)) for d in INTEGRAL]
    facts = []
    for kind, dts in calls:
        op = dist._make_nccl_premul_sum(_factor(kind, me))
        xs = [_input(me, d, 300 + i) for i, d in enumerate(dts)]
        outcome, started = _outcome(fc, lambda xs=xs, op=op: _reduce(fc, form, xs, op, world))
        facts.append((kind, dts, outcome, started))
    return facts


PREMUL_GRADIENT_APIS = ["all_reduce", "reduce_scatter_tensor_autograd"]


def _premul_run(spec):
    fc = funcol_api(spec)
    me, world = dist.get_rank(), dist.group.WORLD
    values = {(form, family): _premul_calls(fc, form, family, me, world)
              for form in REDUCING_FORMS for family in FAMILIES}
    gradients = {}
    for api in PREMUL_GRADIENT_APIS:
        for d in FLOATING:
            op = dist._make_nccl_premul_sum(_factor("float", me))
            gradients[(api, d)] = _gradient(fc, api, op, me, d, world, 400)
    return values, gradients, _in_step(fc)


@functools.cache
def _premul_results(backend):
    return run(backend, _premul_run, N, timeout=RUN_TIMEOUT_S)


@pytest.mark.parametrize("form, family", [
    pytest.param(f, fam, marks=[pytest.mark.xdist_group("forms-premul"),
                                pytest.mark.spec(*(("FC-17",) if fam == "floating" else
                                                   ("FC-17", "FC-18", "FC-27")))])
    for f in REDUCING_FORMS for fam in FAMILIES])
def test_premul_sum_on_every_dtype_and_form(backend, form, family):
    """premul_sum with each kind of factor (a float; a one-element float64 or float16
    tensor; a 0-d float32 tensor), rank r's own: on float64, float32, bfloat16 and
    float16 (coalesced: two members of each) each rank's input times its factor in its
    dtype, summed (FC-17). An int64, int32, uint8 or bool input, alone or last in a
    coalesced list, is refused with a ValueError naming `reduce_op`, nothing started."""
    backend.require("functional_collectives")
    for rank, (values, _, in_step) in enumerate(_premul_results(backend)):
        for kind, dts, outcome, started in values[(form, family)]:
            where = f"rank {rank} {form}(premul_sum, {kind} factor) of {list(dts)}"
            if family == "integral":
                _check_refused(f"{where} [FC-17]", outcome, started, ["reduce_op"],
                               types=("ValueError",))
                continue
            assert outcome[0] == "ok", f"{where}: {outcome[0]}: {outcome[1]} [FC-17]"
            factors = [_factor(kind, r) for r in range(N)]
            want = _want(form, "SUM", rank, dts, 300, factors)
            for d, got, w in zip(dts, outcome[1], want, strict=True):
                assert _equal(got, w), \
                    f"{where}: member {d}: {got.dtype} {got.tolist()} != {w.tolist()} [FC-17]"
        assert in_step == [2.0], f"rank {rank}: the group is out of step after the calls"


@pytest.mark.spec("FC-17", "FC-47")
@pytest.mark.parametrize("api", [pytest.param(a, marks=pytest.mark.xdist_group("forms-premul"))
                                 for a in PREMUL_GRADIENT_APIS])
def test_premul_sum_gradient_on_every_floating_dtype(backend, api):
    """Rank r's factor differs (0.5, 3.0): the value is the factored sum, and rank r's
    gradient is its own factor times the gradient of sum, the summed output gradients
    (`all_reduce`) or the gathered ones (`reduce_scatter_tensor_autograd`), in float64,
    float32, bfloat16 and float16 (FC-47)."""
    backend.require("functional_collectives")
    factors = PREMUL_FACTORS["float"]
    for rank, (_, gradients, in_step) in enumerate(_premul_results(backend)):
        assert in_step == [2.0], f"rank {rank}: the group is out of step after the calls"
        for d, dtype in FLOATING.items():
            stage, outcome = gradients[(api, d)]
            where = f"rank {rank} {api}(premul_sum, factors {factors}) of {d}"
            assert stage == "ok", f"{where}: {stage}: {outcome[0]}: {outcome[1]}"
            value, grad = outcome
            xs = [_input(r, d, 400) for r in range(N)]
            total = sum(_premultiplied(x, f).double() for x, f in zip(xs, factors,
                                                                      strict=True))
            want = total.to(dtype) if api == "all_reduce" else \
                torch.chunk(total.to(dtype), N, dim=0)[rank]
            assert _equal(value, want), f"{where}: {value.tolist()} != {want.tolist()}"
            ws = [_input(r, d, 401, (_out_rows(api), SHAPE[1])).double() for r in range(N)]
            summed = sum(ws) if api == "all_reduce" else torch.cat(ws, dim=0)
            want_grad = (factors[rank] * summed).to(dtype)
            assert grad is not None, f"{where}: no gradient reached the input"
            assert grad.dtype == dtype and torch.equal(grad, want_grad), \
                f"{where}: gradient {grad.tolist()} != {want_grad.tolist()} (factor " \
                f"{factors[rank]} times the {'summed' if api == 'all_reduce' else 'gathered'}" \
                f" output gradients) [FC-47]"


# ==== (a) the in-place ops at op level: every name, refusals, ReduceOp objects ============
IN_PLACE_OPS = ["all_reduce_", "all_reduce_coalesced_"]


def _in_place_call(fc, op, ys, reduce_op, g):
    """The in-place op on the clones `ys`, waited: (whether it returned them, values)."""
    if op == "all_reduce_":
        r = fc.ops.all_reduce_(ys[0], reduce_op, g)
        fc.ops.wait_tensor(r)
        return [r.data_ptr() == ys[0].data_ptr()], [y.clone() for y in ys]
    rs = fc.ops.all_reduce_coalesced_(ys, reduce_op, g)
    for r in rs:
        fc.ops.wait_tensor(r)
    return [a.data_ptr() == b.data_ptr() for a, b in zip(rs, ys, strict=True)], \
        [y.clone() for y in ys]


def _in_place_attempt(fc, op, dts, reduce_op, g, me, salt):
    """(outcome, started, whether the arguments still hold their inputs)."""
    xs = [_input(me, d, salt + i) for i, d in enumerate(dts)]
    ys = [x.clone() for x in xs]
    registry = fc.work_registry_size
    before = registry() if registry else 0
    try:
        returned, values = _in_place_call(fc, op, ys, reduce_op, g)
    except Exception as exc:
        started = registry() - before if registry else 0
        unchanged = all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))
        return (type(exc).__name__, str(exc)), started, unchanged
    return ("ok", values, returned), 0, None


def _in_place_run(spec):
    fc = funcol_api(spec)
    me = dist.get_rank()
    g = fc.resolve_group_name(dist.group.WORLD)
    names, refusals, objects = {}, {}, {}
    for op in IN_PLACE_OPS:
        for family in FAMILIES:
            lists = _calls_of(op == "all_reduce_coalesced_", FAMILIES[family])
            for member in MEMBERS:
                for dts in lists:
                    if _allowed(member, dts[0]):
                        names[(op, family, member, dts)] = _in_place_attempt(
                            fc, op, dts, member.lower(), g, me, 500)
                    objects[(op, family, member, dts)] = _in_place_attempt(
                        fc, op, dts, getattr(dist.ReduceOp, member), g, me, 600)
            if family == "floating":
                for dts in lists:
                    objects[(op, family, "premul_sum", dts)] = _in_place_attempt(
                        fc, op, dts, dist._make_nccl_premul_sum(_factor("float", me)), g, me,
                        600)
        # A reduction the dtype does not take: alone, or last after members that take it.
        for member in ("AVG", *BITWISE):
            for d in DTYPES:
                if _allowed(member, d):
                    continue
                dts = (d,) if op == "all_reduce_" else _refused_last(member, d)
                refusals[(op, member, dts)] = _in_place_attempt(fc, op, dts, member.lower(),
                                                                g, me, 700)
    return names, refusals, objects, _in_step(fc)


@functools.cache
def _in_place_results(backend):
    return run(backend, _in_place_run, N, timeout=RUN_TIMEOUT_S)


def _in_place_want(member, rank, dts, salt, factors=None):
    return _want("all_reduce", member, rank, dts, salt, factors)


@pytest.mark.spec("FC-39", "FC-42", "FC-43")
@pytest.mark.parametrize("op, family", [
    pytest.param(o, f, marks=pytest.mark.xdist_group("forms-in-place"))
    for o in IN_PLACE_OPS for f in FAMILIES])
def test_in_place_ops_reduce_by_every_name_on_every_dtype(backend, op, family):
    """`all_reduce_` and `all_reduce_coalesced_` (two members of one dtype) called as ops
    with each reduction name (the names the Python API turns each `ReduceOp` member
    into) on every dtype of the family that takes it: each writes the reduction into its
    argument, in its dtype (avg: the sum over the group size), and returns it (FC-39,
    FC-42, FC-43)."""
    backend.require("functional_collectives")
    for rank, (names, _, _, in_step) in enumerate(_in_place_results(backend)):
        for (o, fam, member, dts), (outcome, _, _) in names.items():
            if (o, fam) != (op, family):
                continue
            where = f"rank {rank} {op}({member.lower()!r}) of {list(dts)}"
            assert outcome[0] == "ok", f"{where}: {outcome[0]}: {outcome[1]}"
            _, values, returned = outcome
            assert all(returned), f"{where}: did not return its mutated argument [FC-39]"
            for d, got, w in zip(dts, values, _in_place_want(member, rank, dts, 500),
                                 strict=True):
                assert _equal(got, w), f"{where}: member {d}: {got.tolist()} != {w.tolist()}"
        assert in_step == [2.0], f"rank {rank}: the group is out of step after the calls"


@pytest.mark.spec("FC-18", "FC-27")
@pytest.mark.parametrize("op", [pytest.param(o, marks=pytest.mark.xdist_group("forms-in-place"))
                                for o in IN_PLACE_OPS])
def test_in_place_ops_refuse_a_reduction_their_dtype_does_not_take(backend, op):
    """avg of each integer and bool dtype, band / bor / bxor of each floating dtype, given
    to the in-place op (coalesced: after members that take it): refused naming the
    reduction on every rank, before anything starts, the argument left as it was."""
    backend.require("functional_collectives")
    for rank, (_, refusals, _, in_step) in enumerate(_in_place_results(backend)):
        for (o, member, dts), (outcome, started, unchanged) in refusals.items():
            if o != op:
                continue
            where = f"rank {rank} {op}({member.lower()!r}) of {list(dts)} [FC-18]"
            _check_refused(where, outcome, started, [member.lower()])
            assert unchanged, f"{where}: the refused call wrote into its argument [FC-27]"
        assert in_step == [2.0], f"rank {rank}: the group is out of step after the calls"


@pytest.mark.spec("FC-17", "FC-18", "FC-39")
@pytest.mark.parametrize("op, family", [
    pytest.param(o, f, marks=pytest.mark.xdist_group("forms-in-place"))
    for o in IN_PLACE_OPS for f in FAMILIES])
def test_in_place_ops_given_a_reduce_op_object(backend, op, family):
    """A `ReduceOp` member, or a premul_sum (floating), handed to the in-place op itself:
    it either means what the Python API makes of it (written into the argument, which
    is returned) or is refused naming `reduce_op`, before anything starts, the argument
    left as it was (FC-17); one the dtype does not take is refused either way (FC-18)."""
    backend.require("functional_collectives")
    for rank, (_, _, objects, in_step) in enumerate(_in_place_results(backend)):
        for (o, fam, member, dts), (outcome, started, unchanged) in objects.items():
            if (o, fam) != (op, family):
                continue
            name = "premul_sum" if member == "premul_sum" else f"ReduceOp.{member}"
            where = f"rank {rank} {op}({name}) of {list(dts)}"
            taken = member == "premul_sum" or all(_allowed(member, d) for d in dts)
            if outcome[0] == "ok" and taken:
                _, values, returned = outcome
                assert all(returned), f"{where}: did not return its mutated argument [FC-39]"
                factors = [_factor("float", r) for r in range(N)] \
                    if member == "premul_sum" else None
                want = _in_place_want("SUM" if factors else member, rank, dts, 600, factors)
                for d, got, w in zip(dts, values, want, strict=True):
                    assert _equal(got, w), f"{where}: member {d}: {got.tolist()} != " \
                        f"{w.tolist()}, what the Python API makes of {name} [FC-17]"
                continue
            words = ["reduce_op"] if taken else ["reduce_op", member.lower()]
            _check_refused(f"{where} [FC-17]" if taken else f"{where} [FC-18]", outcome,
                           started, words)
            assert unchanged, f"{where}: the refused call wrote into its argument [FC-17]"
        assert in_step == [2.0], f"rank {rank}: the group is out of step after the calls"


# ==== (b) the list argument of the coalesced forms and wait_tensors =======================
LIST_APIS = {  # api: the name of its list argument
    "all_reduce_coalesced": "self", "all_gather_into_tensor_coalesced": "self",
    "reduce_scatter_tensor_coalesced": "inputs", "wait_tensors": "tensors"}
WRONG_FORMS = {  # form: the error FC-27 asks for
    "tensor": "TypeError", "empty_list": "ValueError", "non_tensor_second": "TypeError",
    "none_first": "TypeError"}


def _list_call(fc, api, arg, world):
    if api == "all_reduce_coalesced":
        return fc.all_reduce_coalesced(arg, "sum", world)
    if api == "all_gather_into_tensor_coalesced":
        return fc.all_gather_into_tensor_coalesced(arg, world)
    if api == "reduce_scatter_tensor_coalesced":  # one dim a member it was meant to be
        dims = [0] if isinstance(arg, torch.Tensor) else [0] * len(arg)
        return fc.reduce_scatter_tensor_coalesced(arg, "sum", dims, world)
    return fc.wait_tensors(arg)


def _wrong_form(form, t):
    return {"tensor": t, "empty_list": [], "non_tensor_second": [t, 3.0],
            "none_first": [None, t]}[form]


def _list_forms_run(spec):
    fc = funcol_api(spec)
    me, world = dist.get_rank(), dist.group.WORLD
    x, y = _input(me, "f32", 800), _input(me, "f32", 801)
    refused, tuples = {}, {}
    for api in LIST_APIS:
        if getattr(fc, api, None) is None:
            continue
        for form in WRONG_FORMS:
            # wait_tensors gets a pending result: a refusal waits nothing.
            t = fc.all_reduce(x, "sum", world) if api == "wait_tensors" else x
            outcome, started = _outcome(fc, lambda t=t: _list_call(fc, api, _wrong_form(form, t),
                                                                   world))
            after = waited(t).clone() if api == "wait_tensors" else None
            refused[(api, form)] = (outcome, started, after)
        if api == "wait_tensors":  # pending results, as a list and as a tuple
            as_list = fc.wait_tensors([fc.all_reduce(x, "sum", world),
                                       fc.all_reduce(y, "sum", world)])
            pending = (fc.all_reduce(x, "sum", world), fc.all_reduce(y, "sum", world))
        else:
            as_list, pending = _list_call(fc, api, [x, y], world), (x, y)
        as_list = [waited(t) for t in as_list]
        try:
            got = _list_call(fc, api, pending, world)
            tuples[api] = ("ok", type(got).__name__, [waited(t).detach() for t in got]), as_list
        except Exception as exc:
            tuples[api] = (type(exc).__name__, str(exc)), as_list
            for t in pending:  # whatever a refused tuple left pending
                waited(t)
    return refused, tuples, _in_step(fc)


@functools.cache
def _list_form_results(backend):
    return run(backend, _list_forms_run, N, timeout=RUN_TIMEOUT_S)


def _list_api_rules(api, *rules):
    return (*rules, "FC-37") if api == "wait_tensors" else rules


@pytest.mark.parametrize("api, form", [
    pytest.param(a, f, marks=[pytest.mark.xdist_group("forms-lists"),
                              pytest.mark.spec(*_list_api_rules(a, "FC-27"))])
    for a in LIST_APIS for f in WRONG_FORMS])
def test_a_list_argument_in_a_wrong_form_is_refused_by_name(backend, api, form):
    """A coalesced form (or `wait_tensors`) given a tensor instead of the list (whose rows
    would be read as members), an empty list, a list whose second item is a float, or
    whose first is None: refused on every rank with a TypeError (a ValueError for the
    empty list) naming the argument and the rule, before any member starts
    (`wait_tensors`: waits; its pending argument stays pending), the group in step."""
    backend.require("functional_collectives", api)
    arg, want_type = LIST_APIS[api], WRONG_FORMS[form]
    rules = ["FC-27", "FC-37"] if api == "wait_tensors" else ["FC-27"]
    x0, x1 = _input(0, "f32", 800), _input(1, "f32", 800)
    for rank, (refused, _, in_step) in enumerate(_list_form_results(backend)):
        outcome, started, after = refused[(api, form)]
        where = f"rank {rank} {api}({form.replace('_', ' ')})"
        if outcome[0] == "ok":
            pytest.fail(f"{where}: accepted, giving {len(outcome[1])} results of shapes "
                        f"{[list(t.shape) for t in outcome[1]]} [FC-27]")
        exc_type, message = outcome
        assert exc_type == want_type, f"{where}: {exc_type}, not {want_type}: {message}"
        assert _names(message, arg), f"{where}: the message does not name {arg!r}: {message}"
        assert any(r in message for r in rules), \
            f"{where}: the message names no rule ({' or '.join(rules)}): {message}"
        assert started == 0, f"{where}: the refused call changed the work registry by " \
            f"{started} [FC-27]"
        if after is not None:
            assert torch.equal(after, x0 + x1), f"{where}: the pending result waited " \
                f"after the refusal holds {after.tolist()}"
        assert in_step == [2.0], f"rank {rank}: the group is out of step after the calls"


@pytest.mark.parametrize("api", [
    pytest.param(a, marks=[pytest.mark.xdist_group("forms-lists"),
                           pytest.mark.spec(*_list_api_rules(a, "FC-26"))])
    for a in LIST_APIS])
def test_a_tuple_is_taken_as_the_list_of_its_tensors(backend, api):
    """A tuple where the list goes: the same results as the list, returned as a list."""
    backend.require("functional_collectives", api)
    for rank, (_, tuples, _) in enumerate(_list_form_results(backend)):
        outcome, as_list = tuples[api]
        where = f"rank {rank} {api}(a tuple of two)"
        assert outcome[0] == "ok", f"{where}: {outcome[0]}: {outcome[1]} [FC-26]"
        _, kind, results = outcome
        assert len(results) == len(as_list) == 2, f"{where}: {len(results)} results"
        for i, (got, want) in enumerate(zip(results, as_list, strict=True)):
            assert _equal(got, want), f"{where}: result {i}: {got.tolist()} != " \
                f"{want.tolist()} (the list's)"
        assert kind == "list", f"{where}: returns a {kind}, not a list"


# ==== (c) negative and extreme dims ======================================================
DIM_APIS = ["all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor",
            "reduce_scatter_tensor_autograd", "reduce_scatter_tensor_coalesced"]
# Inputs of 1, 2 and 3 dims: gathered ones with dim 0 of size 2 and of size 1 (whose
# gathered chunks upstream rearranges by a view), scattered ones with every dim divisible
# by the group size.
GATHER_SHAPES = {1: [(3,), (1,)], 2: [(2, 3), (1, 3)], 3: [(2, 2, 3), (1, 2, 3)]}
SCATTER_SHAPES = {1: [(4,)], 2: [(2, 4)], 3: [(2, 4, 2)]}
BAD_DIMS = {"ndim": lambda k: k, "minus_ndim_minus_1": lambda k: -k - 1}


def _dim_arg(api: str) -> str:
    return "gather_dim" if "gather" in api else "scatter_dim"


def _dim_shapes(api: str, ndim: int) -> list[tuple]:
    return (GATHER_SHAPES if "gather" in api else SCATTER_SHAPES)[ndim]


def _dim_inputs(shape, rank):
    return [oracle.rank_input(rank, shape, torch.float32, salt=900 + i) for i in range(2)]


def _dim_call(fc, api, xs, dim, world):
    if api == "reduce_scatter_tensor_coalesced":  # dim: each member's
        return fc.reduce_scatter_tensor_coalesced(xs, "sum", list(dim), world)
    if "gather" in api:
        return [getattr(fc, api)(xs[0], dim, world)]
    return [getattr(fc, api)(xs[0], "sum", dim, world)]


def _dims_run(spec):
    fc = funcol_api(spec)
    me, world = dist.get_rank(), dist.group.WORLD
    valid, bad = {}, {}
    for api in DIM_APIS:
        for ndim in (1, 2, 3):
            for shape, dim in [(s, d) for s in _dim_shapes(api, ndim) for d in range(-ndim, ndim)]:
                xs = _dim_inputs(shape, me)
                if api.endswith("_autograd"):
                    xs[0].requires_grad_()
                d = (dim, dim) if api == "reduce_scatter_tensor_coalesced" else dim
                outcome, _ = _outcome(fc, lambda xs=xs, d=d: _dim_call(fc, api, xs, d, world))
                grad = None
                if api.endswith("_autograd") and outcome[0] == "ok":
                    w = oracle.rank_input(me, outcome[1][0].shape, torch.float32, salt=950)
                    try:
                        y = _dim_call(fc, api, xs, dim, world)[0]
                        (y * w).sum().backward()
                        grad = xs[0].grad
                    except Exception as exc:
                        grad = f"{type(exc).__name__}: {exc}"
                valid[(api, shape, dim)] = (outcome, grad)
            for kind, bad_dim in BAD_DIMS.items():
                xs = _dim_inputs(_dim_shapes(api, ndim)[0], me)
                d = (0, bad_dim(ndim)) if api == "reduce_scatter_tensor_coalesced" else \
                    bad_dim(ndim)
                bad[(api, kind, ndim)] = _outcome(fc, lambda xs=xs, d=d: _dim_call(fc, api, xs,
                                                                                   d, world))
    return valid, bad, _in_step(fc)


@functools.cache
def _dim_results(backend):
    return run(backend, _dims_run, N, timeout=RUN_TIMEOUT_S)


def _dim_want(api, shape, dim, rank):
    """The oracle's results of `api` on `dim` for group rank `rank`, and for an autograd
    form the gradient of rank `rank`'s input."""
    inputs = [_dim_inputs(shape, r) for r in range(N)]
    grad = None
    if "gather" in api:
        want = [oracle.all_gather([xs[0] for xs in inputs], dim)]
        if api.endswith("_autograd"):  # the sum of every rank's chunk `rank` of w
            ws = [oracle.rank_input(r, want[0].shape, torch.float32, salt=950)
                  for r in range(N)]
            grad = sum(torch.chunk(w, N, dim=dim)[rank] for w in ws)
    else:
        members = range(2) if api == "reduce_scatter_tensor_coalesced" else range(1)
        want = [oracle.reduce_scatter([xs[i] for xs in inputs], "sum", rank, dim)
                for i in members]
        if api.endswith("_autograd"):  # every rank's w, gathered along the dim
            ws = [oracle.rank_input(r, want[0].shape, torch.float32, salt=950)
                  for r in range(N)]
            grad = torch.cat(ws, dim=dim)
    return want, grad


def _dim_rules(api):
    if api.endswith("_autograd"):
        return ("FC-44", "FC-32", "FC-23")
    return ("FC-44", "FC-26") if api.endswith("_coalesced") else ("FC-44", "FC-14")


@pytest.mark.parametrize("api, ndim", [
    pytest.param(a, k, marks=[pytest.mark.xdist_group("forms-dims"),
                              pytest.mark.spec(*_dim_rules(a))])
    for a in DIM_APIS for k in (1, 2, 3)])
def test_every_dim_of_the_input_negative_ones_included(backend, api, ndim):
    """Each dim of a 1-, 2- or 3-d input (gathered: of dim 0 of size 2 and of size 1),
    from -ndim to ndim - 1: the oracle's gather or scatter along it, a negative dim
    giving exactly its positive dim's result (-1 the last, -ndim dim 0), on every rank;
    the autograd forms' gradients too (FC-44, FC-32; `reduce_scatter_tensor_coalesced`:
    both members on that dim, FC-26)."""
    backend.require("functional_collectives", api)
    for rank, (valid, _, in_step) in enumerate(_dim_results(backend)):
        for shape, dim in [(s, d) for s in _dim_shapes(api, ndim) for d in range(-ndim, ndim)]:
            outcome, grad = valid[(api, shape, dim)]
            where = f"rank {rank} {api}({_dim_arg(api)}={dim}) of an input of shape " \
                f"{list(shape)}"
            assert outcome[0] == "ok", f"{where}: {outcome[0]}: {outcome[1]} [FC-44]"
            want, want_grad = _dim_want(api, shape, dim, rank)
            for got, w in zip(outcome[1], want, strict=True):
                assert _equal(got, w), f"{where}: {list(got.shape)} {got.tolist()} != " \
                    f"{list(w.shape)} {w.tolist()}"
            positive = valid[(api, shape, dim + ndim)][0] if dim < 0 else None
            if positive is not None and positive[0] == "ok":
                assert all(_equal(a, b) for a, b in zip(outcome[1], positive[1], strict=True)
                           ), f"{where}: not the result of dim {dim + ndim} [FC-44]"
            if want_grad is not None:
                assert isinstance(grad, torch.Tensor), f"{where}: gradient: {grad}"
                assert _equal(grad, want_grad), f"{where}: gradient {grad.tolist()} != " \
                    f"{want_grad.tolist()} [FC-23]"
        assert in_step == [2.0], f"rank {rank}: the group is out of step after the calls"


@pytest.mark.spec("FC-20", "FC-27")
@pytest.mark.parametrize("api, bad", [
    pytest.param(a, b, marks=pytest.mark.xdist_group("forms-dims"))
    for a in DIM_APIS for b in BAD_DIMS])
def test_a_dim_outside_the_input_is_refused_by_name(backend, api, bad):
    """ndim, and -ndim - 1, on 1-, 2- and 3-d inputs (coalesced: the second member's
    dim): refused on every rank naming the dim's argument, before anything starts."""
    backend.require("functional_collectives", api)
    arg = _dim_arg(api)
    for rank, (_, refusals, in_step) in enumerate(_dim_results(backend)):
        for ndim in (1, 2, 3):
            outcome, started = refusals[(api, bad, ndim)]
            where = f"rank {rank} {api}({arg}={BAD_DIMS[bad](ndim)}) of a {ndim}-d input " \
                f"[FC-20]"
            _check_refused(where, outcome, started, [arg], types=("ValueError", "IndexError"))
        assert in_step == [2.0], f"rank {rank}: the group is out of step after the calls"
