"""Rank functions of tests/test_memory.py: they run inside gloo ranks (refimpl.multiprocess).

- `verify_every_program`: the lifecycle verifier on every conformance memory program.
- `wrong_plans`: deliberately wrong plans, each of which the verifier must refuse.
- `random_graphs`: a hypothesis property over random programs (views, in-place ops,
  collectives, waits, lowered or not, in a random valid order): the measured peak is
  the planned one. Every rank draws the same examples (derandomized), so the ranks issue
  the same collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from conformance import memory_programs as mp
from refimpl.memory import MemoryLifecycleError, plan_memory, verify_memory_lifecycle


def verify_every_program(names) -> dict[str, tuple[int, int]]:
    """(measured peak, planned peak) of every program, traced and built on this rank."""
    from refimpl.symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(mp.G)
    rank = dist.get_rank()
    peaks = {}
    for name in names:
        gm = mp.program_graph(name, rank)
        plan = plan_memory(gm)
        peaks[name] = (verify_memory_lifecycle(gm, *mp.program_inputs(name, rank), plan=plan),
                       plan.peak_bytes)
    upstream = mp.traced("all_gather_copy_out", ops=torch.ops._c10d_functional, rank=rank)
    peaks["upstream all_gather_copy_out"] = (
        verify_memory_lifecycle(upstream, *mp.inputs_for("all_gather_copy_out", rank)),
        plan_memory(upstream).peak_bytes)
    return peaks


def _later(plan, node):
    order = plan.order
    return order[order.index(node) + 1]


def _earlier(plan, node):
    order = plan.order
    return order[order.index(node) - 1]


def wrong_plans() -> list[tuple[str, str, str]]:
    """(what was broken, the buffer's name, the error) for each doctored plan."""
    rank = dist.get_rank()
    results = []
    doctors = {
        "free one node later": lambda p, b: setattr(b, "free_node", _later(p, b.free_node)),
        "free one node earlier": lambda p, b: setattr(b, "free_node", _earlier(p, b.free_node)),
        "never freed": lambda p, b: setattr(b, "free_node", None),
        "four bytes more": lambda p, b: setattr(b, "nbytes", b.nbytes + 4),
        "kind comm_buffer": lambda p, b: setattr(b, "kind", "comm_buffer"),
    }
    for what, doctor in doctors.items():
        gm = mp.traced("all_gather_copy_out", rank=rank)
        plan = plan_memory(gm)
        target = next(b for b in plan.buffers if b.name == "all_gather_into_tensor")
        doctor(plan, target)
        try:
            verify_memory_lifecycle(gm, *mp.inputs_for("all_gather_copy_out", rank), plan=plan)
        except MemoryLifecycleError as exc:
            results.append((what, target.name, str(exc)))
        else:
            results.append((what, target.name, "no error"))
    return results


# --------------------------------------------------------------------------------------
# Random programs
# --------------------------------------------------------------------------------------
KINDS = ["new", "view", "strided", "inplace", "dead", "all_gather", "all_reduce_",
         "all_reduce", "reduce_scatter", "wait", "wait", "output"]


@st.composite
def programs(draw):
    """A list of steps over a pool of values; each operand index is drawn in range.

    Pooled values are (numel, contiguous, base): an all_reduce_ is never issued on a base
    with one already in flight (refimpl keys pending work by address, FC-6, so a second
    one would leave the first to finish whenever gloo gets to it)."""
    steps, pool, pending, busy = [], [(8, True, 0)], [], set()
    for kind in draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=14)):
        i = draw(st.integers(0, len(pool) - 1))
        numel, contiguous, base = pool[i]
        if kind == "new":
            pool.append((numel, True, len(pool)))
        elif kind == "view":
            pool.append((numel, contiguous, base))
        elif kind == "strided":
            if numel < 2:
                continue
            pool.append((numel // 2, False, base))
        elif kind == "all_gather":
            pending.append((numel * 2, None))
        elif kind == "all_reduce":
            pending.append((numel, None))
        elif kind == "all_reduce_":
            if not contiguous or base in busy:
                continue
            busy.add(base)
            pending.append((numel, base))
        elif kind == "reduce_scatter":
            if numel % 2:
                continue
            pending.append((numel // 2, None))
        elif kind == "wait":
            if not pending:
                continue
            i = draw(st.integers(0, len(pending) - 1))
            numel, done = pending.pop(i)
            busy.discard(done)
            pool.append((numel, True, len(pool)))
        steps.append((kind, i))
    lowered = draw(st.booleans())
    return steps, lowered


def run_steps(ops, steps, x):
    """The program the steps describe, on input x (f32[8])."""
    pool, pending, outputs = [x], [], []
    for kind, i in steps:
        if kind == "wait":
            pool.append(ops.wait_tensor(pending.pop(i)))
            continue
        v = pool[i]
        if kind == "new":
            pool.append(v * 2)
        elif kind == "view":
            pool.append(v.view(-1))
        elif kind == "strided":
            pool.append(v[::2])
        elif kind == "inplace":
            v.add_(1)
        elif kind == "dead":
            v + 1
        elif kind == "all_gather":
            pending.append(ops.all_gather_into_tensor(v, 2, mp.G))
        elif kind == "all_reduce_":
            pending.append(ops.all_reduce_(v, "sum", mp.G))
        elif kind == "all_reduce":
            pending.append(ops.all_reduce(v, "sum", mp.G))
        elif kind == "reduce_scatter":
            pending.append(ops.reduce_scatter_tensor(v, "sum", 2, mp.G))
        elif kind == "output":
            outputs.append(v)
    outputs += [ops.wait_tensor(p) for p in pending]  # every collective is waited
    return outputs or [pool[-1]]


@st.composite
def orders(draw, gm):
    """A random valid order of gm's nodes: any ready node next."""
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    waiting = {n: len([a for a in n.all_input_nodes if a.op != "placeholder"]) for n in body}
    ready = [n for n in body if waiting[n] == 0]
    order = []
    while ready:
        node = ready.pop(draw(st.integers(0, len(ready) - 1)))
        order.append(node)
        for user in node.users:
            if user in waiting:
                waiting[user] -= 1
                if waiting[user] == 0:
                    ready.append(user)
    return order


def random_graphs(max_examples: int) -> int:
    """The property, run on this rank; returns how many examples ran."""
    from refimpl.comm_lowering import lower

    ops = mp.refimpl_ops()
    ran = []

    @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(programs(), st.data())
    def measured_peak_is_planned_peak(program, data):
        steps, lowered = program
        x = torch.arange(8.0) + dist.get_rank()
        gm = make_fx(lambda x: run_steps(ops, steps, x), tracing_mode="fake")(x)
        if lowered:
            gm = lower(gm)
        order = data.draw(orders(gm))
        plan = plan_memory(gm, order)
        assert verify_memory_lifecycle(gm, x.clone(), plan=plan) == plan.peak_bytes
        ran.append(1)

    measured_peak_is_planned_peak()
    return len(ran)
