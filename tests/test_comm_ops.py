"""The operator catalogue (refimpl/comm_ops.py): complete for the running torch, and true.

- Every op registered in a catalogued namespace (refimpl's `refimpl_c10d` and
  `refimpl_symm_mem`, upstream's `_c10d_functional`, `_c10d_functional_autograd` and
  `symm_mem`) has a row or a `NOT_MODELLED` reason: an op torch adds fails here, by name.
- Every row agrees with its op's schema where the schema can say (in place, `out=`, a
  list of tensors, a result), and names a family and a cost the passes know.
- A pass that meets an op without a row raises, naming it (never a silent default).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx

import refimpl.functional_collectives  # noqa: F401  (registers refimpl_c10d)
import refimpl.symmetric_memory  # noqa: F401  (registers refimpl_symm_mem)
from refimpl import comm_ops
from refimpl.simulator import ALGORITHMS, COST_BYTES


def _registered() -> list[tuple[str, str]]:
    """(namespace, op name) of every op the running torch registers in the catalogue's
    namespaces, after importing what registers them (upstream's Python modules too)."""
    import torch.distributed._functional_collectives  # noqa: F401
    import torch.distributed._symmetric_memory  # noqa: F401

    found = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, name = qualified.split("::", 1)
        if namespace in comm_ops.NAMESPACES:
            found.add((namespace, name.split(".", 1)[0]))
    return sorted(found)


def missing_rows(rows=None, not_modelled=None) -> list[str]:
    """The registered ops with neither a row nor a reason, as `namespace::name`."""
    rows = comm_ops.ROWS if rows is None else rows
    not_modelled = comm_ops.NOT_MODELLED if not_modelled is None else not_modelled
    return [f"{ns}::{name}" for ns, name in _registered()
            if (ns, name) not in rows and (ns, name) not in not_modelled]


def test_every_registered_op_has_a_row_or_a_reason():
    missing = missing_rows()
    assert not missing, (f"ops of the running torch {torch.__version__} with neither a row "
                         f"of refimpl/comm_ops.py nor a NOT_MODELLED reason: {missing}")


def test_an_op_added_without_a_row_is_named():
    """The check fails, naming the op, when a row is gone (what a new op looks like)."""
    key = ("_c10d_functional", "all_reduce_coalesced")
    rows = {k: v for k, v in comm_ops.ROWS.items() if k != key}
    assert missing_rows(rows=rows) == ["_c10d_functional::all_reduce_coalesced"]


def test_rows_and_reasons_do_not_overlap_and_reasons_are_words():
    assert not set(comm_ops.ROWS) & set(comm_ops.NOT_MODELLED)
    assert all(len(reason.split()) >= 5 for reason in comm_ops.NOT_MODELLED.values())
    assert all(row.namespace in comm_ops.NAMESPACES for row in comm_ops.ROWS.values())


def _schema(row):
    packet = getattr(getattr(torch.ops, row.namespace), row.name, None)
    return packet.default._schema if packet is not None else None


@pytest.mark.parametrize("key", sorted(comm_ops.ROWS), ids="::".join)
def test_a_row_agrees_with_its_schema(key):
    row = comm_ops.ROWS[key]
    assert row.family in comm_ops.FAMILIES
    assert row.completes in ("wait", "completes", "blocking")
    assert row.algorithm in ALGORITHMS or (row.family == "wait" and not row.algorithm)
    assert row.cost_bytes in COST_BYTES or row.family == "wait"
    assert row.in_flight in (("inputs", "result", "per member") if row.is_collective
                             else ("",))
    schema = _schema(row)
    if schema is None:
        pytest.skip(f"{row.qualified} is not registered in torch {torch.__version__}")
    arguments = schema.arguments
    first_written = arguments[0].alias_info is not None and arguments[0].alias_info.is_write
    # In place: it writes its first argument and returns it (a wait_tensor_ included).
    if row.in_place:
        assert first_written and schema.returns, schema
    # `out`: keyword-only in refimpl's schemas, positional in upstream's symm_mem ones.
    assert row.out == any(a.name == "out" and a.alias_info is not None
                          and a.alias_info.is_write for a in arguments), schema
    assert row.coalesced == str(arguments[0].type).startswith(("Tensor[]", "List[Tensor]",
                                                               "str[]", "List[str]")), schema
    if row.is_collective or row.family == "wait":
        assert len(schema.returns) == 1, schema  # what its wait completes


def test_lookups_take_an_overload_or_a_packet_and_refuse_by_name():
    packet = torch.ops.refimpl_c10d.all_reduce
    assert comm_ops.comm_op(packet) is comm_ops.comm_op(packet.default)
    assert comm_ops.comm_op(packet).family == "all_reduce"
    with pytest.raises(comm_ops.NotModelled, match=r"symm_mem::tile_reduce.*not modelled"):
        comm_ops.comm_op(torch.ops.symm_mem.tile_reduce.default)
    with pytest.raises(comm_ops.NotModelled, match=r"aten::add: .*add one"):
        comm_ops.comm_op(torch.ops.aten.add.Tensor)
    assert comm_ops.find(torch.ops.aten.add.Tensor) is None
    assert comm_ops.find(torch.ops.symm_mem.tile_reduce.default) is None  # left out, on purpose


def test_a_pass_meeting_an_op_without_a_row_names_it(monkeypatch):
    """Memory planning of a graph whose collective lost its row raises, naming the op."""
    from refimpl.memory import is_collective

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    key = ("_c10d_functional", "all_reduce")
    monkeypatch.delitem(comm_ops.ROWS, key)
    comm_ops.forget_rows()
    try:
        with pytest.raises(comm_ops.NotModelled, match="_c10d_functional::all_reduce"):
            is_collective(node)
    finally:
        monkeypatch.undo()
        comm_ops.forget_rows()
    assert is_collective(node)


def test_targets_select_by_fields_across_namespaces():
    plain = comm_ops.targets(family="all_gather", in_place=False, coalesced=False, out=False)
    assert torch.ops.refimpl_c10d.all_gather_into_tensor.default in plain
    assert torch.ops._c10d_functional.all_gather_into_tensor.default in plain
    assert torch.ops._c10d_functional_autograd.all_gather_into_tensor.default in plain
    assert torch.ops.refimpl_c10d.all_gather_into_tensor_out.default not in plain


def test_a_wait_of_a_list_plans_and_costs_as_its_separate_waits():
    """Upstream 2.15's `wait_tensors([r0, r1])` is read as `wait_tensor(r0)`,
    `wait_tensor(r1)` by the passes: the same memory plan (MEM-5) and timeline (SIM-8).
    (Before 2.15, the conformance suite's stand-in of the op.)"""
    import functools

    from torch.fx.experimental.proxy_tensor import make_fx

    from conformance.upstream_ops import wait_tensors
    from refimpl.memory import plan_memory
    from refimpl.simulator import simulate

    wait_tensors()
    ops = torch.ops._c10d_functional

    def program(a, b, *, together):
        r0, r1 = ops.all_gather_into_tensor_coalesced([a * 1, b * 1], 2, "0")
        w0, w1 = ops.wait_tensors([r0, r1]) if together else \
            (ops.wait_tensor(r0), ops.wait_tensor(r1))
        return w0 + 1, w1 * 2

    inputs = (torch.ones(4), torch.ones(2, 3))
    plans, steps = [], []
    for together in (True, False):
        gm = make_fx(functools.partial(program, together=together),
                     tracing_mode="fake")(*inputs)
        assert ("wait_tensors" in str(gm.graph)) == together
        plans.append(plan_memory(gm).peak_bytes)
        steps.append(simulate(gm).step_time_us)
    assert plans[0] == plans[1] and steps[0] == pytest.approx(steps[1]), (plans, steps)
