"""Conformance section "simulator" (SPEC.md section 8, SIM).

Costs are checked against the formulas of SPEC section 8, written out again in each case
with round numbers (a profile of alpha 10 us, beta 100 bytes/us, ...), never read from the
backend. Timelines are goldens under pinned costs, so they depend on nothing measured:
four orders of one program (two FSDP layers on a world of 4, a reduce_scatter on a
subgroup of 2), each event's stream, start and end, and the totals. Graphs are traced on
a fake process group of 4.
"""

from __future__ import annotations

import functools
import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch.fx.experimental.proxy_tensor import make_fx

from conformance import memory_programs as mp


@pytest.fixture
def world4():
    """A fake world of 4 and the name of its subgroup [0, 1]."""
    with mp.fake_world(4):
        yield dist.new_group([0, 1]).group_name


def sim(backend):
    return backend.require("simulator", "simulate", "CostModel", "HardwareProfile", "LinkCost")


def nodes_of(gm, fragment):
    return [n for n in gm.graph.nodes if fragment in str(n.target)]


# --------------------------------------------------------------------------------------
# Costs
# --------------------------------------------------------------------------------------
ALPHA = {2: 10.0, 4: 7.0}
FLOPS, BANDWIDTH = 100.0, 1000.0  # FLOP/us, bytes/us: small matmuls are compute-bound
BETA = {2: 100.0, 4: 50.0}


def _profile(ns, **overrides):
    fields = dict(name="round numbers", flops_per_us={"default": FLOPS, "bfloat16": 4000.0},
                  memory_bytes_per_us=BANDWIDTH,
                  links={n: ns.LinkCost(ALPHA[n], BETA[n]) for n in (2, 4)},
                  op_overhead_us=1.0)
    fields.update(overrides)
    return ns.HardwareProfile(**fields)


def ring(n, nbytes):
    return (n - 1) * ALPHA[n] + (n - 1) / n * nbytes / BETA[n]


@pytest.mark.spec("SIM-1", "SIM-2", "SIM-4")
def test_collective_costs(backend, world4):
    """Each collective on groups of 4 and 2: the alpha-beta ring formulas, waits free."""
    ns = sim(backend)
    gm = mp.traced_every_collective(world4)
    tl = ns.simulate(gm, ns.CostModel(_profile(ns)))
    durations = {e.node.name: e.end_us - e.start_us for e in tl.events
                 if e.stream != "compute"}
    x = 8 * 16 * 4  # bytes of the input
    want = []
    for n in (4, 2):
        want += [ring(n, x * n),                                 # all_gather: its result
                 ring(n, x),                                     # reduce_scatter: its input
                 2 * ring(n, x),                                 # all_reduce
                 ring(n, x),                                     # all_to_all
                 (n - 1) * ALPHA[n] + x / BETA[n]]               # broadcast: pipelined
    got = [durations[n.name] for n in gm.graph.nodes if n.name in durations]
    assert got == pytest.approx(want), (got, want)
    # Each collective is waited at once: its wait blocks exactly until it ends, at no cost.
    ends = {e.node: e.end_us for e in tl.events}
    for e in tl.events:
        if "wait_tensor" in str(e.node.target):
            assert e.end_us == pytest.approx(ends[e.node.args[0]])
    assert tl.comm_time_us == pytest.approx(sum(want))
    assert tl.exposed_comm_us == pytest.approx(sum(want))


@pytest.mark.spec("SIM-2")
def test_coalesced_and_in_place_collective_costs(backend, world4):
    """The coalesced and in-place forms move the bytes of every member: a coalesced
    reduce_scatter of 3,200 B on 2 ranks costs 10 + 1,600 / 100 = 26 us, not its latency.
    The in-place forms cost what their out-of-place ones do."""
    ns = sim(backend)
    ops = backend.require("functional_collectives").ops

    def program(x, y):
        outs = []
        for group, n in (("0", 4), (world4, 2)):
            outs += ops.all_gather_into_tensor_coalesced([x, y], n, group)
            outs += ops.reduce_scatter_tensor_coalesced([x, y], "sum", n, group)
            outs += ops.all_reduce_coalesced([x, y], "sum", group)
            outs += ops.all_reduce_coalesced_([x * 1, y * 1], "sum", group)
            outs.append(ops.all_reduce_(x * 1, "sum", group))
            outs.append(ops.broadcast_(y * 1, 0, group))
        return [ops.wait_tensor(t) for t in outs]

    inputs = [torch.randn(8, 16), torch.randn(12, 12)]  # 512 + 576 bytes
    gm = make_fx(program, tracing_mode="fake")(*inputs)
    tl = ns.simulate(gm, ns.CostModel(_profile(ns)))
    durations = [e.end_us - e.start_us for e in tl.events if e.stream != "compute"]
    x, both = 8 * 16 * 4, (8 * 16 + 12 * 12) * 4
    want = []
    for n in (4, 2):
        want += [ring(n, both * n),           # all_gather: its results
                 ring(n, both),               # reduce_scatter: its inputs
                 2 * ring(n, both),           # all_reduce, out of place and in place
                 2 * ring(n, both),
                 2 * ring(n, x),
                 (n - 1) * ALPHA[n] + 576 / BETA[n]]  # broadcast_: pipelined, as broadcast
    assert durations == pytest.approx(want), (durations, want)


@pytest.mark.spec("SIM-3", "SIM-4")
def test_compute_is_a_roofline(backend, world4):
    ns = sim(backend)

    def program(a, b, c, img, weight, h, k):
        m = a @ b                                   # 2*8*16*4 FLOPs
        s = m + 1                                   # memory-bound
        v = s.view(-1)                              # a view: free
        bf = h @ k                                  # bf16: its own peak
        conv = torch.nn.functional.conv2d(img, weight)  # flop_counter's formula
        e = torch.empty(3, 3)                       # allocates only
        return v, bf, conv, e, torch.addmm(c, a, b)

    inputs = [torch.randn(8, 16), torch.randn(16, 4), torch.randn(8, 4),
              torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3),
              torch.randn(8, 8, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16)]
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(program, tracing_mode="fake")(*inputs)
    tl = ns.simulate(gm, ns.CostModel(_profile(ns)))
    got = {e.node.target: e.end_us - e.start_us for e in tl.events
           if _dtype(e.node) != torch.bfloat16}
    aten = torch.ops.aten
    mm_bytes = (8 * 16 + 16 * 4 + 8 * 4) * 4
    assert got[aten.mm.default] == pytest.approx(
        1 + max(2 * 8 * 16 * 4 / FLOPS, mm_bytes / BANDWIDTH))       # compute-bound
    assert got[aten.add.Tensor] == pytest.approx(1 + 2 * 8 * 4 * 4 / BANDWIDTH)
    assert got[aten.view.default] == 0.0
    assert got[aten.empty.memory_format] == 0.0
    conv_flops = 2 * 1 * 3 * 3 * 3 * 2 * 3 * 3  # 2 N Cout Hout Wout Cin kh kw
    conv_bytes = (1 * 2 * 5 * 5 + 3 * 2 * 3 * 3 + 1 * 3 * 3 * 3) * 4
    assert got[aten.convolution.default] == pytest.approx(
        1 + max(conv_flops / FLOPS, conv_bytes / BANDWIDTH))
    bf_node = [n for n in nodes_of(gm, "aten.mm") if n.meta["val"].dtype == torch.bfloat16][0]
    bf = [e for e in tl.events if e.node is bf_node][0]
    assert bf.end_us - bf.start_us == pytest.approx(                 # memory-bound
        1 + max(2 * 8 * 8 * 8 / 4000, 3 * 8 * 8 * 2 / BANDWIDTH))
    addmm_bytes = (8 * 4 + 8 * 16 + 16 * 4 + 8 * 4) * 4
    assert got[aten.addmm.default] == pytest.approx(
        1 + max(2 * 8 * 16 * 4 / FLOPS, addmm_bytes / BANDWIDTH))


@pytest.mark.spec("SIM-3", "SIM-4")
def test_batched_matmuls_views_and_an_input_read_twice(backend, world4):
    """bmm and baddbmm count 2 M K N FLOPs per batch; views of every kind are free; an
    input read twice moves its bytes once."""
    ns = sim(backend)

    def program(a, b, c, x):
        views = (x.t(), x.expand(2, 8, 4), x[0], x.unsqueeze(0),
                 torch.ops.aten._unsafe_view(x * 1, [32]))
        return torch.bmm(a, b), torch.baddbmm(c, a, b), x * x, views

    inputs = [torch.randn(2, 8, 16), torch.randn(2, 16, 4), torch.randn(2, 8, 4),
              torch.randn(8, 4)]
    gm = make_fx(program, tracing_mode="fake")(*inputs)
    tl = ns.simulate(gm, ns.CostModel(_profile(ns)))
    got = {e.node.name: e.end_us - e.start_us for e in tl.events}
    aten = torch.ops.aten
    flops = 2 * 2 * 8 * 16 * 4  # a batch of 2
    for target, moved in ((aten.bmm.default, 2 * 8 * 16 + 2 * 16 * 4 + 2 * 8 * 4),
                          (aten.baddbmm.default, 2 * 8 * 4 + 2 * 8 * 16 + 2 * 16 * 4
                           + 2 * 8 * 4)):
        node = nodes_of(gm, str(target))[0]
        assert got[node.name] == pytest.approx(1 + max(flops / FLOPS, moved * 4 / BANDWIDTH))
    square = [n for n in nodes_of(gm, "aten.mul.Tensor") if n.args[0] is n.args[1]][0]
    assert got[square.name] == pytest.approx(1 + (32 + 32) * 4 / BANDWIDTH)  # x once, out
    for fragment in ("aten.t", "aten.expand", "aten.select", "aten.unsqueeze",
                     "aten._unsafe_view"):
        node = nodes_of(gm, fragment)[0]
        assert got[node.name] == 0.0, (fragment, got[node.name])


@pytest.mark.spec("SIM-2", "SIM-5", "SIM-7")
def test_upstreams_blocking_one_shot_is_communication_too(backend, world4):
    """Upstream's `symm_mem.one_shot_all_reduce`, as refimpl's: a blocking kernel on its
    group's stream, costed as SIM-2's one-shot, all of it exposed."""
    ns = sim(backend)
    import refimpl.symmetric_memory  # noqa: F401  (defines refimpl_symm_mem)

    for namespace in (torch.ops.symm_mem, torch.ops.refimpl_symm_mem):
        def program(x, symm):
            return symm.one_shot_all_reduce(x, "sum", "0") + 1

        gm = make_fx(functools.partial(program, symm=namespace),
                     tracing_mode="fake")(torch.ones(8, 16))
        tl = ns.simulate(gm, ns.CostModel(_profile(ns)))
        kernel = [e for e in tl.events if "one_shot" in str(e.node.target)][0]
        want = ALPHA[4] + 3 * 512 / BETA[4]
        assert kernel.stream != "compute" and kernel.kind == "blocking", kernel
        assert kernel.end_us - kernel.start_us == pytest.approx(want)
        assert tl.comm_time_us == pytest.approx(want)
        assert tl.exposed_comm_us == pytest.approx(want) and tl.overlap == 0.0


@pytest.mark.spec("SIM-2", "SIM-7")
def test_a_two_shot_all_reduce_costs_twice_a_ring(backend, world4):
    """refimpl's and upstream's `two_shot_all_reduce_`: a blocking kernel costed twice
    `ring` of its bytes (a reduce-scatter and an all-gather), not as a one-shot."""
    ns = sim(backend)
    import refimpl.symmetric_memory  # noqa: F401  (defines refimpl_symm_mem)

    def program(x):
        return torch.ops.refimpl_symm_mem.two_shot_all_reduce_(x * 1, "sum", "0") + 1

    gm = make_fx(program, tracing_mode="fake")(torch.ones(8, 16))
    # Upstream's op (the same schema) has no fake kernel on a CPU build: swapped in.
    for namespace in (torch.ops.refimpl_symm_mem, torch.ops.symm_mem):
        for node in gm.graph.nodes:
            if "two_shot" in str(node.target):
                node.target = namespace.two_shot_all_reduce_.default
        tl = ns.simulate(gm, ns.CostModel(_profile(ns)))
        kernel = [e for e in tl.events if "two_shot" in str(e.node.target)][0]
        want = 2 * ring(4, 512)
        assert kernel.stream != "compute" and kernel.kind == "blocking", kernel
        assert kernel.end_us - kernel.start_us == pytest.approx(want), namespace


@pytest.mark.spec("SIM-2")
def test_point_to_point_ops_cost_one_transfer(backend, world4):
    """Upstream's isend and irecv: one peer, one transfer of the larger of their input and
    result, `alpha + B / beta` on the group's link, not a ring; each wait completes its op."""
    ns = sim(backend)
    p2p = torch.ops._c10d_functional
    if not hasattr(p2p, "isend"):
        pytest.skip(f"torch {torch.__version__} has no functional isend / irecv")

    def program(x):
        sent = p2p.isend(x * 1, 1, 0, "0")
        received = p2p.irecv(x * 2, 1, 0, "0")
        return p2p.wait_tensor(sent), p2p.wait_tensor(received)

    gm = make_fx(program, tracing_mode="fake")(torch.ones(8, 16))
    tl = ns.simulate(gm, ns.CostModel(_profile(ns)))
    durations = [e.end_us - e.start_us for e in tl.events if e.stream != "compute"]
    want = ALPHA[4] + 512 / BETA[4]
    assert durations == pytest.approx([want, want]), durations


@pytest.mark.spec("SIM-2")
def test_a_batch_of_point_to_point_ops_costs_its_members_bytes(backend, world4):
    """batch_p2p_ops of a send and a receive of 512 B each: one transfer of the larger of
    its members' bytes (its inputs, the fourth argument: 1024 B) and its results' (the
    received 512 B and the send's empty token), `alpha + B / beta`; its first arguments
    (the lists of ops, peers and tags) are no bytes."""
    ns = sim(backend)
    p2p = torch.ops._c10d_functional
    if not hasattr(p2p, "batch_p2p_ops"):
        pytest.skip(f"torch {torch.__version__} has no functional batch_p2p_ops")

    def program(x, y):
        sent, received = p2p.batch_p2p_ops(["isend", "irecv"], [1, 3], [0, 0],
                                           [x * 1, y * 2], "0")
        return p2p.wait_tensor(sent), p2p.wait_tensor(received)

    gm = make_fx(program, tracing_mode="fake")(torch.ones(8, 16), torch.ones(8, 16))
    tl = ns.simulate(gm, ns.CostModel(_profile(ns)))
    durations = [e.end_us - e.start_us for e in tl.events if e.stream != "compute"]
    want = ALPHA[4] + 1024 / BETA[4]
    assert durations == pytest.approx([want]), durations


def _gather_matmul_wait(backend):
    """`all_gather` on group "0", a matmul, the gather's wait, traced: the graph and its
    (gather, matmul, wait) nodes."""
    ops = backend.require("functional_collectives").ops

    def program(x, a, b):
        gathered = ops.all_gather_into_tensor(x, 4, "0")
        m = a @ b
        return ops.wait_tensor(gathered), m

    gm = make_fx(program, tracing_mode="fake")(torch.ones(4), torch.ones(4, 4),
                                                 torch.ones(4, 4))
    (ag,), (mm,), (wait,) = (nodes_of(gm, f) for f in ("all_gather", "aten.mm", "wait_tensor"))
    return gm, (ag, mm, wait)


@pytest.mark.spec("SIM-7", "SIM-8")
def test_a_wait_reached_late_still_takes_its_own_time(backend, world4):
    """The gather (10 us) ends under a matmul (30 us): its wait (2 us) then waits for
    nothing, but still runs its own 2 us: 30..32."""
    ns = sim(backend)
    gm, (ag, mm, wait) = _gather_matmul_wait(backend)
    tl = ns.simulate(gm, ns.CostModel(pinned={ag.name: 10.0, mm.name: 30.0, wait.name: 2.0}))
    by = {e.node: (e.start_us, e.end_us) for e in tl.events}
    assert by[wait] == pytest.approx((30.0, 32.0)), by[wait]
    assert tl.step_time_us == pytest.approx(32.0) and tl.exposed_comm_us == 0.0


@pytest.mark.spec("SIM-7", "FC-35")
def test_a_wait_of_a_list_ends_after_every_collective_it_completes(backend, world4):
    """torch 2.15's wait of a list (`wait_tensors`): a gather on the world (10 us) and one
    on the subgroup (40 us) run on their own streams from 0; a matmul (30 us); then one
    wait (2 us) of both results. It waits for the later gather: 40..42, 10 us exposed (the
    first gather alone would end it at 32 with none exposed)."""
    from conformance.upstream_ops import wait_tensors

    ns = sim(backend)
    up = torch.ops._c10d_functional

    def program(x, a, b):
        on_world = up.all_gather_into_tensor(x, 4, "0")
        on_pair = up.all_gather_into_tensor(x * 1, 2, world4)
        m = a @ b
        return *wait_tensors()([on_world, on_pair]), m

    gm = make_fx(program, tracing_mode="fake")(torch.ones(4), torch.ones(4, 4),
                                                 torch.ones(4, 4))
    (world, pair), mm = nodes_of(gm, "all_gather"), nodes_of(gm, "aten.mm")[0]
    (wait,) = nodes_of(gm, "wait_tensors")
    tl = ns.simulate(gm, ns.CostModel(pinned={world.name: 10.0, pair.name: 40.0,
                                              mm.name: 30.0, wait.name: 2.0}))
    by = {e.node: (e.start_us, e.end_us) for e in tl.events}
    assert by[wait] == pytest.approx((30.0, 42.0)), by[wait]
    assert tl.exposed_comm_us == pytest.approx(10.0), tl.exposed_comm_us


@pytest.mark.spec("SIM-8")
def test_step_time_waits_for_every_stream(backend, world4):
    """A gather that no wait completes still runs to its end: the step ends with it. A
    program without communication hides all of it (overlap 1.0)."""
    ns = sim(backend)
    ops = backend.require("functional_collectives").ops
    gm = make_fx(lambda x: (ops.all_gather_into_tensor(x * 2, 4, "0"),),
                 tracing_mode="fake")(torch.ones(4))
    ag, mul = nodes_of(gm, "all_gather")[0], nodes_of(gm, "aten.mul")[0]
    tl = ns.simulate(gm, ns.CostModel(pinned={ag.name: 50.0, mul.name: 5.0}))
    assert tl.step_time_us == pytest.approx(55.0), tl.step_time_us
    assert tl.comm_time_us == pytest.approx(50.0) and tl.exposed_comm_us == 0.0
    compute_only = make_fx(lambda a, b: a @ b, tracing_mode="fake")(torch.ones(4, 4),
                                                                  torch.ones(4, 4))
    tl = ns.simulate(compute_only, ns.CostModel(_profile(ns)))
    assert (tl.comm_time_us, tl.exposed_comm_us, tl.overlap) == (0.0, 0.0, 1.0)


@pytest.mark.spec("SIM-2", "SIM-3")
def test_symbolic_sizes_cost_as_in_the_example(backend, world4):
    """Traced with dynamic shapes, every size is a symbolic expression: each node costs
    what it costs traced with the example's static sizes, as a float (a symbolic duration
    could not be compared or printed as time)."""
    ns = sim(backend)
    ops = backend.require("functional_collectives").ops

    def program(a, b, img, weight, shard):
        m = (a @ b) + 1
        conv = torch.nn.functional.conv2d(img, weight)
        full = ops.wait_tensor(ops.all_gather_into_tensor(shard * 2, 4, "0"))
        return m, conv, torch.addmm(m, a, b), full + full.shape[0]

    inputs = [torch.randn(8, 16), torch.randn(16, 4), torch.randn(1, 2, 5, 5),
              torch.randn(3, 2, 3, 3), torch.randn(6)]
    durations = {}
    for mode in ("fake", "symbolic"):
        gm = make_fx(program, tracing_mode=mode)(*inputs)
        tl = ns.simulate(gm, ns.CostModel(_profile(ns)))
        durations[mode] = [(str(e.node.target), e.end_us - e.start_us) for e in tl.events
                           if isinstance(e.node.meta.get("val"), torch.Tensor)]
        assert all(type(e.start_us) is float and type(e.end_us) is float for e in tl.events)
        assert type(tl.step_time_us) is float, tl.step_time_us
    static, symbolic = durations["fake"], durations["symbolic"]
    assert [t for t, _ in symbolic] == [t for t, _ in static]
    assert [d for _, d in symbolic] == pytest.approx([d for _, d in static]), symbolic


def _dtype(node):
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


@pytest.mark.spec("SIM-1")
def test_pinned_durations(backend, world4):
    ns = sim(backend)
    gm = mp.traced_layered(world4)
    mm = nodes_of(gm, "aten.mm")[0]
    ag = nodes_of(gm, "all_gather")[0]
    wait = nodes_of(gm, "wait_tensor")[0]
    tl = ns.simulate(gm, ns.CostModel(_profile(ns), pinned={mm.name: 123.0, ag.name: 7.5,
                                                             wait.name: 2.0}))
    by = {e.node: e for e in tl.events}
    assert by[mm].end_us - by[mm].start_us == 123.0
    assert by[ag].end_us - by[ag].start_us == 7.5
    assert by[wait].end_us == by[ag].end_us + 2.0  # blocked until the gather, then 2 us
    with pytest.raises(ValueError, match="pinned"):
        ns.simulate(gm, ns.CostModel(pinned={"no_such_node": 1.0}))
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="pinned"):
            ns.CostModel(pinned={mm.name: bad})
    # The boundary: a duration of 0 us is finite and >= 0, so it is taken.
    tl = ns.simulate(gm, ns.CostModel(_profile(ns), pinned={mm.name: 0}))
    assert [e.end_us - e.start_us for e in tl.events if e.node is mm] == [0]


@pytest.mark.spec("SIM-11")
def test_profiles(backend, world4):
    ns = sim(backend)
    profile = _profile(ns, links={0: ns.LinkCost(3.0, 30.0), 2: ns.LinkCost(10.0, 100.0)})
    assert profile.link(2).alpha_us == 10.0
    assert profile.link(4).alpha_us == 3.0  # no entry for 4: the default, key 0
    with pytest.raises(ValueError, match="profile"):
        _profile(ns, links={2: ns.LinkCost(1.0, 1.0)}).link(4)
    again = ns.HardwareProfile.from_json(profile.to_json())
    assert again == profile
    gm = mp.traced_layered(world4)
    default = ns.simulate(gm).step_time_us
    preset = ns.simulate(gm, ns.CostModel(ns.H100_NVLINK_8)).step_time_us
    assert default == preset > 0
    h100 = ns.H100_NVLINK_8
    assert h100.source and h100.link(8).beta_bytes_per_us > 0
    # Any other group size (a mesh dim of 3, 16 ranks) costs as the node's ring of 8.
    assert h100.link(3) == h100.link(16) == h100.link(8)
    assert h100.flops_rate(torch.bfloat16) > h100.flops_rate(torch.float32)


# --------------------------------------------------------------------------------------
# Timelines under pinned costs
# --------------------------------------------------------------------------------------
def _pins(gm):
    """mm 30 us each, the cast-free `grad * 2` 5 us, all_gathers 20 us, reduce_scatter 25."""
    pins = {}
    for n in gm.graph.nodes:
        target = str(n.target)
        if "aten.mm" in target:
            pins[n.name] = 30.0
        elif "aten.mul" in target:
            pins[n.name] = 5.0
        elif "all_gather" in target:
            pins[n.name] = 20.0
        elif "reduce_scatter" in target:
            pins[n.name] = 25.0
    return pins


def _orders(gm):
    """The program order and three others of `layered`."""
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    ag1, ag2 = nodes_of(gm, "all_gather")
    w1, w2, wr = nodes_of(gm, "wait_tensor")
    mm1, mm2 = nodes_of(gm, "aten.mm")
    (mul,) = nodes_of(gm, "aten.mul")
    (rs,) = nodes_of(gm, "reduce_scatter")
    views = nodes_of(gm, "aten.view")

    def prefetch():  # the second gather issued as soon as the first is waited
        rest = [n for n in body if n is not ag2]
        return rest[:rest.index(w1) + 1] + [ag2] + rest[rest.index(w1) + 1:]

    everything_first = [mul, ag1, ag2, rs, w1, views[0], mm1, w2, views[1], mm2, wr]
    rs_first = [mul, rs, ag1, w1, views[0], mm1, ag2, w2, views[1], mm2, wr]
    return {"program": body, "prefetch": prefetch(), "collectives_first": everything_first,
            "reduce_scatter_first": rs_first}


def timeline(backend, gm, order):
    ns = sim(backend)
    tl = ns.simulate(gm, ns.CostModel(pinned=_pins(gm)), order)
    return mp.timeline_text(gm, tl)


@pytest.mark.spec("SIM-5", "SIM-6", "SIM-7", "SIM-8")
def test_timeline_program_order(backend, world4):
    """Every collective waited at once: all 65 us of communication exposed."""
    gm = mp.traced_layered(world4)
    assert_expected_inline(timeline(backend, gm, _orders(gm)["program"]), """\
%4 funcol.all_gather_into_tensor   comm ranks[0,1,2,3]     0.0   20.0
%5 funcol.wait_tensor              compute                 0.0   20.0
%6 aten.view                       compute                20.0   20.0
%7 aten.mm                         compute                20.0   50.0
%8 funcol.all_gather_into_tensor   comm ranks[0,1,2,3]    50.0   70.0
%9 funcol.wait_tensor              compute                50.0   70.0
%10 aten.view                      compute                70.0   70.0
%11 aten.mm                        compute                70.0  100.0
%12 aten.mul.Tensor                compute               100.0  105.0
%13 funcol.reduce_scatter_tensor   comm ranks[0,1]       105.0  130.0
%14 funcol.wait_tensor             compute               105.0  130.0
step 130.0 us, comm 65.0 us, exposed 65.0 us, overlap 0.000, peak 288 B""")


@pytest.mark.spec("SIM-5", "SIM-6", "SIM-7", "SIM-8")
def test_timeline_prefetch(backend, world4):
    """The second gather overlaps the first matmul."""
    gm = mp.traced_layered(world4)
    assert_expected_inline(timeline(backend, gm, _orders(gm)["prefetch"]), """\
%4 funcol.all_gather_into_tensor   comm ranks[0,1,2,3]     0.0   20.0
%5 funcol.wait_tensor              compute                 0.0   20.0
%8 funcol.all_gather_into_tensor   comm ranks[0,1,2,3]    20.0   40.0
%6 aten.view                       compute                20.0   20.0
%7 aten.mm                         compute                20.0   50.0
%9 funcol.wait_tensor              compute                50.0   50.0
%10 aten.view                      compute                50.0   50.0
%11 aten.mm                        compute                50.0   80.0
%12 aten.mul.Tensor                compute                80.0   85.0
%13 funcol.reduce_scatter_tensor   comm ranks[0,1]        85.0  110.0
%14 funcol.wait_tensor             compute                85.0  110.0
step 110.0 us, comm 65.0 us, exposed 45.0 us, overlap 0.308, peak 288 B""")


@pytest.mark.spec("SIM-6", "SIM-7", "SIM-8")
def test_timeline_collectives_first(backend, world4):
    """One group's gathers run one after another; the other group's scatter alongside."""
    gm = mp.traced_layered(world4)
    assert_expected_inline(timeline(backend, gm, _orders(gm)["collectives_first"]), """\
%12 aten.mul.Tensor                compute                 0.0    5.0
%4 funcol.all_gather_into_tensor   comm ranks[0,1,2,3]     5.0   25.0
%8 funcol.all_gather_into_tensor   comm ranks[0,1,2,3]    25.0   45.0
%13 funcol.reduce_scatter_tensor   comm ranks[0,1]         5.0   30.0
%5 funcol.wait_tensor              compute                 5.0   25.0
%6 aten.view                       compute                25.0   25.0
%7 aten.mm                         compute                25.0   55.0
%9 funcol.wait_tensor              compute                55.0   55.0
%10 aten.view                      compute                55.0   55.0
%11 aten.mm                        compute                55.0   85.0
%14 funcol.wait_tensor             compute                85.0   85.0
step 85.0 us, comm 65.0 us, exposed 20.0 us, overlap 0.692, peak 416 B""")


@pytest.mark.spec("SIM-6", "SIM-7", "SIM-8")
def test_timeline_reduce_scatter_first(backend, world4):
    """The subgroup's scatter runs while the world's first gather runs and is waited."""
    gm = mp.traced_layered(world4)
    assert_expected_inline(timeline(backend, gm, _orders(gm)["reduce_scatter_first"]), """\
%12 aten.mul.Tensor                compute                 0.0    5.0
%13 funcol.reduce_scatter_tensor   comm ranks[0,1]         5.0   30.0
%4 funcol.all_gather_into_tensor   comm ranks[0,1,2,3]     5.0   25.0
%5 funcol.wait_tensor              compute                 5.0   25.0
%6 aten.view                       compute                25.0   25.0
%7 aten.mm                         compute                25.0   55.0
%8 funcol.all_gather_into_tensor   comm ranks[0,1,2,3]    55.0   75.0
%9 funcol.wait_tensor              compute                55.0   75.0
%10 aten.view                      compute                75.0   75.0
%11 aten.mm                        compute                75.0  105.0
%14 funcol.wait_tensor             compute               105.0  105.0
step 105.0 us, comm 65.0 us, exposed 40.0 us, overlap 0.385, peak 384 B""")


@pytest.mark.spec("SIM-8", "MEM-10")
def test_timeline_peak_is_the_memory_plan_of_the_same_order(backend, world4):
    ns = sim(backend)
    memory = backend.require("memory", "plan_memory")
    gm = mp.traced_layered(world4)
    for order in _orders(gm).values():
        tl = ns.simulate(gm, ns.CostModel(pinned=_pins(gm)), order)
        assert tl.peak_bytes == memory.plan_memory(gm, order).peak_bytes


@pytest.mark.spec("SIM-5", "SIM-7")
def test_blocking_one_shot_all_reduce(backend):
    """A one-shot all-reduce has no wait: the compute stream waits for it."""
    with mp.fake_world(2):
        ns = sim(backend)
        gm = mp.lowered_one_shot()
        pins = {n.name: 10.0 for n in gm.graph.nodes if n.op == "call_function"}
        tl = ns.simulate(gm, ns.CostModel(pinned=pins))
        assert_expected_inline(mp.timeline_text(gm, tl), """\
%1 symm_mem.empty_strided_p2p      compute                 0.0   10.0
%2 aten.mul.out                    compute                10.0   20.0
%3 symm_mem.one_shot_all_reduce    comm ranks[0,1]        20.0   30.0
%4 aten.add.Tensor                 compute                30.0   40.0
step 40.0 us, comm 10.0 us, exposed 10.0 us, overlap 0.000, peak 64 B""")
        # Unpinned, its cost is SIM-2's: every rank reads the (n - 1) peers' 16 bytes.
        one_shot = nodes_of(gm, "one_shot_all_reduce")[0]
        del pins[one_shot.name]
        tl = ns.simulate(gm, ns.CostModel(_profile(ns), pinned=pins))
        got = [e.end_us - e.start_us for e in tl.events if e.node is one_shot]
        assert got == pytest.approx([ALPHA[2] + (2 - 1) * 16 / BETA[2]], rel=1e-9)


@pytest.mark.spec("SIM-2")
def test_all_to_all_costs_the_larger_of_its_input_and_result(backend):
    """Uneven splits: 4 elements sent, 6 received (and the other way round)."""
    with mp.fake_world(2):
        ns = sim(backend)
        ops = mp.refimpl_ops()
        for send, receive in (([1, 3], [2, 4]), ([2, 4], [1, 3])):
            def program(x, send, receive):
                return ops.wait_tensor(ops.all_to_all_single(x, receive, send, mp.G))

            gm = make_fx(functools.partial(program, send=send, receive=receive),
                         tracing_mode="fake")(torch.ones(sum(send)))
            tl = ns.simulate(gm, ns.CostModel(_profile(ns)))
            node = nodes_of(gm, "all_to_all_single")[0]
            got = [e.end_us - e.start_us for e in tl.events if e.node is node]
            assert got == pytest.approx([ring(2, 4 * 6)], rel=1e-9), (send, receive, got)


@pytest.mark.spec("SIM-5", "MEM-11")
def test_an_invalid_order_is_refused(backend, world4):
    ns = sim(backend)
    gm = mp.traced_layered(world4)
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    for bad in (list(reversed(body)), body[1:], body + body[:1]):
        with pytest.raises(ValueError, match="order"):
            ns.simulate(gm, ns.CostModel(pinned=_pins(gm)), bad)


# --------------------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------------------
@pytest.mark.spec("SIM-9")
def test_chrome_trace(backend, world4, tmp_path):
    ns = sim(backend)
    gm = mp.traced_layered(world4)
    tl = ns.simulate(gm, ns.CostModel(pinned=_pins(gm)), _orders(gm)["collectives_first"])
    path = tmp_path / "trace.json"
    tl.to_chrome_trace(path)
    trace = json.loads(path.read_text())["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in trace
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(threads.values()) == sorted({e.stream for e in tl.events})
    spans = sorted((threads[e["tid"]], e["name"], e["ts"], e["ts"] + e["dur"])
                   for e in trace if e["ph"] == "X")
    want = sorted((e.stream, e.node.name, e.start_us, e.end_us) for e in tl.events
                  if e.end_us > e.start_us)
    assert [s[:2] for s in spans] == [w[:2] for w in want]
    assert all(a[2:] == pytest.approx(b[2:]) for a, b in zip(spans, want, strict=True))
    memory = [e for e in trace if e["ph"] == "C" and e["name"] == "memory"]
    assert max(e["args"]["live_bytes"] for e in memory) <= tl.peak_bytes
    assert memory and all(e["args"]["live_bytes"] >= 0 for e in memory)


@pytest.mark.spec("SIM-10")
def test_svg(backend, world4, tmp_path):
    ns = sim(backend)
    gm = mp.traced_layered(world4)
    tl = ns.simulate(gm, ns.CostModel(pinned=_pins(gm)), _orders(gm)["prefetch"])
    path = tmp_path / "timeline.svg"
    tl.to_svg(path)
    root = ET.parse(path).getroot()
    svg = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{svg}svg"
    titles = [t.text for t in root.iter(f"{svg}title")]
    drawn = {e.node.name for e in tl.events if e.end_us > e.start_us}
    assert {t.split()[0] for t in titles} == drawn
    (line,) = [el for el in root.iter(f"{svg}polyline")]
    # The live bytes over time: the line goes forward and rises and falls as they do.
    xs, ys = zip(*[map(float, p.split(",")) for p in line.get("points").split()], strict=True)
    assert list(xs) == sorted(xs) and len(set(xs)) > 1, xs
    tl.to_chrome_trace(tmp_path / "trace.json")  # its memory counter: the live bytes (SIM-9)
    lives = {e["args"]["live_bytes"] for e in json.loads((tmp_path / "trace.json").read_text())
             ["traceEvents"] if e["ph"] == "C"}
    assert len(lives) > 1 and len(set(ys)) >= len(lives), (ys, lives)


# --------------------------------------------------------------------------------------
# Issue 30: per-collective times, a per-node estimator, a group_size that is not the group's
# --------------------------------------------------------------------------------------
@pytest.mark.spec("SIM-8", "SIM-7")
def test_each_collective_reports_its_hidden_and_exposed_time(backend, world4):
    """Three gathers: the first (10 us) half under a matmul (4 us), then waited: 6 us
    exposed, 4 hidden; the second (8 us) waited at once: fully exposed; the third (5 us)
    exactly under a matmul of 5 us: all hidden, not exposed. One fully exposed."""
    ns = sim(backend)
    ops = backend.require("functional_collectives").ops

    def program(x, y, z, a, b):
        g1 = ops.all_gather_into_tensor(x, 4, "0")
        m = a @ b
        w1 = ops.wait_tensor(g1)
        w2 = ops.wait_tensor(ops.all_gather_into_tensor(y, 4, "0"))
        g3 = ops.all_gather_into_tensor(z, 4, "0")
        m2 = m @ b
        return w1, w2, ops.wait_tensor(g3), m2

    gm = make_fx(program, tracing_mode="fake")(*[torch.ones(2)] * 3, torch.ones(4, 4),
                                                 torch.ones(4, 4))
    g1, g2, g3 = nodes_of(gm, "all_gather")
    mm, mm2 = nodes_of(gm, "aten.mm")
    pinned = {g1.name: 10.0, mm.name: 4.0, g2.name: 8.0, g3.name: 5.0, mm2.name: 5.0}
    tl = ns.simulate(gm, ns.CostModel(pinned=pinned))
    got = {c.node.name: (c.start_us, c.end_us, c.hidden_us, c.exposed_us, c.fully_exposed)
           for c in tl.collectives}
    assert got == {g1.name: (0.0, 10.0, 4.0, 6.0, False), g2.name: (10.0, 18.0, 0.0, 8.0, True),
                   g3.name: (18.0, 23.0, 5.0, 0.0, False)}, got
    assert tl.fully_exposed_count == 1 and tl.exposed_comm_us == pytest.approx(14.0)
    assert [c.node for c in tl.collectives] == [g1, g2, g3]  # in order


@pytest.mark.spec("SIM-1")
def test_an_estimator_gives_durations_by_node_pinned_names_first(backend, world4):
    """`estimate` gives every matmul 7 us (0 is a duration too) and leaves the gather to
    the model (None); a pinned name still wins over it."""
    ns = sim(backend)
    ops = backend.require("functional_collectives").ops

    def program(x, a, b):
        full = ops.wait_tensor(ops.all_gather_into_tensor(x, 4, "0"))
        return (a @ b) @ b, full * 2

    gm = make_fx(program, tracing_mode="fake")(torch.ones(8), torch.ones(4, 4),
                                                 torch.ones(4, 4))
    mm, mm2 = nodes_of(gm, "aten.mm")
    (mul,) = nodes_of(gm, "aten.mul")

    def estimate(node):
        if node.target is torch.ops.aten.mm.default:
            return 7.0
        return 0 if node.target is torch.ops.aten.mul.Tensor else None

    tl = ns.simulate(gm, ns.CostModel(_profile(ns), pinned={mm2.name: 3.0}, estimate=estimate))
    durations = {e.node.name: e.end_us - e.start_us for e in tl.events}
    (ag,) = nodes_of(gm, "all_gather")
    assert (durations[mm.name], durations[mm2.name], durations[mul.name]) == (7.0, 3.0, 0.0)
    assert durations[ag.name] == pytest.approx(ring(4, 8 * 4 * 4)), durations


@pytest.mark.spec("SIM-1")
@pytest.mark.parametrize("returned", [-1.0, math.nan, math.inf, "7", True])
def test_an_estimate_that_is_no_duration_is_refused_naming_the_node(backend, world4, returned):
    ns = sim(backend)
    gm = make_fx(lambda a: a @ a, tracing_mode="fake")(torch.ones(4, 4))
    (mm,) = nodes_of(gm, "aten.mm")
    with pytest.raises(ValueError, match=rf"estimate.*{mm.name}.*\[SIM-1\]"):
        ns.simulate(gm, ns.CostModel(estimate=lambda node: returned if node is mm else None))


@pytest.mark.spec("SIM-1")
def test_an_estimate_that_is_not_callable_is_refused(backend):
    ns = sim(backend)
    with pytest.raises(TypeError, match=r"estimate.*\[SIM-1\]"):
        ns.CostModel(estimate={"mm": 7.0})


@pytest.mark.spec("SIM-1")
@pytest.mark.parametrize("profile", [0, "", {}, "H100_NVLINK_8"], ids=repr)
def test_a_profile_that_is_not_one_is_refused(backend, profile):
    """Only None means the default profile: a falsy value of another type is refused too,
    not read as "no profile"."""
    ns = sim(backend)
    with pytest.raises(TypeError, match=r"profile.*\[SIM-1\]"):
        ns.CostModel(profile)


@pytest.mark.spec("SIM-2")
@pytest.mark.parametrize("group_size", [1, 2, 8])
def test_a_group_size_that_is_not_the_groups_is_refused(backend, world4, group_size):
    """A gather on the world of 4 whose `group_size` says otherwise is refused naming the
    node and both sizes (a `group_size` of 1 would make it free); 4 costs the ring of 4."""
    ns = sim(backend)
    ops = backend.require("functional_collectives").ops
    gm = make_fx(lambda x: ops.wait_tensor(ops.all_gather_into_tensor(x, 4, "0")),
                 tracing_mode="fake")(torch.ones(8))
    (ag,) = nodes_of(gm, "all_gather")
    cost = ns.CostModel(_profile(ns))
    tl = ns.simulate(gm, cost)
    assert [e.end_us - e.start_us for e in tl.events if e.node is ag] == \
        pytest.approx([ring(4, 8 * 4 * 4)])
    ag.args = (ag.args[0], group_size, *ag.args[2:])
    said = rf"{ag.name}.*group_size {group_size}.*4 ranks.*\[SIM-2\]"
    with pytest.raises(ValueError, match=said):
        ns.simulate(gm, cost)


@pytest.mark.spec("SIM-8")
def test_a_collective_queued_behind_another_is_exposed_by_a_stall_begun_before_it(backend,
                                                                                 world4):
    """Two gathers of 10 us issued back to back on one group, the second waited at once:
    the compute stream stands from 0 to 20 us. The first runs 0..10, the second, queued
    behind it, 10..20, inside that one stall: both fully exposed."""
    ns = sim(backend)
    ops = backend.require("functional_collectives").ops

    def program(x, y):
        first = ops.all_gather_into_tensor(x, 4, "0")
        second = ops.wait_tensor(ops.all_gather_into_tensor(y, 4, "0"))
        return second, ops.wait_tensor(first)

    gm = make_fx(program, tracing_mode="fake")(torch.ones(2), torch.ones(2))
    g1, g2 = nodes_of(gm, "all_gather")
    tl = ns.simulate(gm, ns.CostModel(pinned={g1.name: 10.0, g2.name: 10.0}))
    got = {c.node.name: (c.start_us, c.end_us, c.exposed_us, c.fully_exposed)
           for c in tl.collectives}
    assert got == {g1.name: (0.0, 10.0, 10.0, True), g2.name: (10.0, 20.0, 10.0, True)}, got
    assert tl.fully_exposed_count == 2


# --------------------------------------------------------------------------------------
# Blocking kernels and waits, every time hand-computed (SIM-6..SIM-8). Every node is
# pinned (0 us unless the case says otherwise), so each number below is exact.
# --------------------------------------------------------------------------------------
def _pinned(gm, **by_name):
    """Every call_function node 0 us, then the given nodes' durations (by node name)."""
    pins = {n.name: 0.0 for n in gm.graph.nodes if n.op == "call_function"}
    pins.update(by_name)
    return pins


def _times(tl):
    """Each event's (stream, start, end) and each collective's (start, end, exposed,
    hidden, fully exposed), by node name; then the step's totals."""
    events = {e.node.name: (e.stream, e.start_us, e.end_us) for e in tl.events}
    collectives = {c.node.name: (c.start_us, c.end_us, c.exposed_us, c.hidden_us,
                                 c.fully_exposed) for c in tl.collectives}
    totals = (tl.step_time_us, tl.comm_time_us, tl.exposed_comm_us, tl.fully_exposed_count)
    return events, collectives, totals


def _blocking_kernel(name):
    """A blocking kernel `f(t, group)`: upstream's or refimpl's one-shot all-reduce, or
    refimpl's two-shot all-reduce (in place on its argument)."""
    import refimpl.symmetric_memory  # noqa: F401  (defines refimpl_symm_mem)

    namespace, op = name.split(".")
    kernel = getattr(getattr(torch.ops, namespace), op)
    if op == "two_shot_all_reduce_":
        return lambda t, group: kernel(t * 1, "sum", group)
    return lambda t, group: kernel(t, "sum", group)


BLOCKING_KERNELS = ["symm_mem.one_shot_all_reduce", "refimpl_symm_mem.one_shot_all_reduce",
                    "refimpl_symm_mem.two_shot_all_reduce_"]


def _gather_matmul_blocking_wait(backend, kernel):
    """`all_gather` on group "0", a matmul, the blocking `kernel` on "0", the gather's
    wait, traced: the graph and its (gather, matmul, kernel, wait) nodes."""
    ops = backend.require("functional_collectives").ops
    blocking = _blocking_kernel(kernel)

    def program(x, y, a, b):
        gathered = ops.all_gather_into_tensor(x, 4, "0")
        m = a @ b
        reduced = blocking(y, "0")
        return ops.wait_tensor(gathered), reduced, m

    gm = make_fx(program, tracing_mode="fake")(torch.ones(4), torch.ones(8),
                                                 torch.ones(4, 4), torch.ones(4, 4))
    (ag,), (mm,) = nodes_of(gm, "all_gather"), nodes_of(gm, "aten.mm")
    (kern,), (wait,) = nodes_of(gm, "shot_all_reduce"), nodes_of(gm, "wait_tensor")
    return gm, (ag, mm, kern, wait)


@pytest.mark.spec("SIM-6", "SIM-7", "SIM-8")
@pytest.mark.parametrize("lead", [0.0, 30.0])
@pytest.mark.parametrize("kernel", BLOCKING_KERNELS)
def test_a_blocking_kernel_queues_behind_its_groups_running_collective(backend, world4,
                                                                       kernel, lead):
    """A gather on group "0" (100 us) is issued at 0; a matmul (`lead` us) runs; then a
    blocking kernel (10 us) on the same group "0"; then the gather's wait (0 us).

    By hand, lead 30: the gather runs 0..100 on comm:0; the matmul 0..30; the compute
    stream reaches the kernel at 30, but comm:0 is busy until 100, so the kernel runs
    100..110 and the compute stream stands waiting 30..110 (80 us exposed, its queueing
    included); the wait, at 110, finds the gather done: 110..110. Step 110, comm 110,
    exposed 80. Per collective: the gather 0..100 is exposed for 30..100 = 70 us, hidden
    30; the kernel 100..110 exposed 10, fully exposed. One fully exposed.
    Lead 0: the compute stream waits 0..110: exposed 110; the gather fully exposed
    (100 exposed, 0 hidden), the kernel too: two fully exposed.
    (Run at once at 30, the kernel would end at 40 and the wait stand 40..100; exposing
    only the kernel's own run would give 10 us; a stall counted from the kernel's start,
    100..110, would leave the gather all hidden.)"""
    ns = sim(backend)
    gm, (ag, mm, kern, wait) = _gather_matmul_blocking_wait(backend, kernel)
    tl = ns.simulate(gm, ns.CostModel(pinned=_pinned(gm, **{ag.name: 100.0, mm.name: lead,
                                                            kern.name: 10.0})))
    events, collectives, totals = _times(tl)
    assert (events[ag.name], events[mm.name], events[kern.name], events[wait.name]) == (
        ("comm:0", 0.0, 100.0), ("compute", 0.0, lead), ("comm:0", 100.0, 110.0),
        ("compute", 110.0, 110.0)), events
    assert [e.kind for e in tl.events if e.node is kern] == ["blocking"]
    exposed_ag = 100.0 - lead
    assert collectives == {ag.name: (0.0, 100.0, exposed_ag, lead, lead == 0.0),
                           kern.name: (100.0, 110.0, 10.0, 0.0, True)}, collectives
    assert totals == (110.0, 110.0, 110.0 - lead, 2 if lead == 0.0 else 1), totals
    assert tl.overlap == pytest.approx(lead / 110.0)


@pytest.mark.spec("SIM-6", "SIM-7", "SIM-8")
@pytest.mark.parametrize("kernel", BLOCKING_KERNELS)
def test_a_blocking_kernel_on_an_idle_stream_runs_when_reached(backend, world4, kernel):
    """A gather on group "0" (20 us) issued at 0 and not yet waited; a matmul (30 us);
    a blocking kernel (10 us) on "0"; then the gather's wait (0 us).

    By hand: the gather runs 0..20, under the matmul 0..30; comm:0 is idle when the
    compute stream reaches the kernel at 30, so it runs 30..40 at once (not from 20, when
    the stream fell idle), the compute stream waiting 30..40; the wait, at 40, finds the
    gather done: 40..40. Step 40, comm 30, exposed 10. The gather all hidden (0 exposed,
    20 hidden), the kernel fully exposed (10, 0). One fully exposed."""
    ns = sim(backend)
    gm, (ag, mm, kern, wait) = _gather_matmul_blocking_wait(backend, kernel)
    tl = ns.simulate(gm, ns.CostModel(pinned=_pinned(gm, **{ag.name: 20.0, mm.name: 30.0,
                                                            kern.name: 10.0})))
    events, collectives, totals = _times(tl)
    assert (events[ag.name], events[mm.name], events[kern.name], events[wait.name]) == (
        ("comm:0", 0.0, 20.0), ("compute", 0.0, 30.0), ("comm:0", 30.0, 40.0),
        ("compute", 40.0, 40.0)), events
    assert collectives == {ag.name: (0.0, 20.0, 0.0, 20.0, False),
                           kern.name: (30.0, 40.0, 10.0, 0.0, True)}, collectives
    assert totals == (40.0, 30.0, 10.0, 1), totals
    assert tl.overlap == pytest.approx(20.0 / 30.0)


@pytest.mark.spec("SIM-6", "SIM-7", "SIM-8")
@pytest.mark.parametrize("kernel", BLOCKING_KERNELS)
def test_a_blocking_kernel_does_not_queue_behind_another_groups_collective(backend, world4,
                                                                          kernel):
    """A gather on the subgroup [0, 1] (100 us) issued at 0; a blocking kernel (10 us) on
    the world's group "0"; a matmul (30 us); then the gather's wait (0 us).

    By hand: one comm stream per group (SIM-6), so the kernel does not queue behind the
    subgroup's gather: the gather runs 0..100 on its stream, the kernel 0..10 on comm:0,
    the compute stream waiting 0..10; the matmul 10..40; the wait 40..100. Step 100, comm
    110, exposed 10 + 60 = 70. The gather is exposed by both stalls, 0..10 (the kernel's)
    and 40..100 (its wait's): 70 exposed, 30 hidden (under the matmul), not fully
    exposed; the kernel 10 exposed, fully. One fully exposed."""
    ns = sim(backend)
    ops = backend.require("functional_collectives").ops
    blocking = _blocking_kernel(kernel)

    def program(x, y, a, b):
        gathered = ops.all_gather_into_tensor(x, 2, world4)
        reduced = blocking(y, "0")
        m = a @ b
        return ops.wait_tensor(gathered), reduced, m

    gm = make_fx(program, tracing_mode="fake")(torch.ones(4), torch.ones(8),
                                                 torch.ones(4, 4), torch.ones(4, 4))
    (ag,), (mm,) = nodes_of(gm, "all_gather"), nodes_of(gm, "aten.mm")
    (kern,), (wait,) = nodes_of(gm, "shot_all_reduce"), nodes_of(gm, "wait_tensor")
    tl = ns.simulate(gm, ns.CostModel(pinned=_pinned(gm, **{ag.name: 100.0, mm.name: 30.0,
                                                            kern.name: 10.0})))
    events, collectives, totals = _times(tl)
    assert (events[ag.name], events[kern.name], events[mm.name], events[wait.name]) == (
        (f"comm:{world4}", 0.0, 100.0), ("comm:0", 0.0, 10.0), ("compute", 10.0, 40.0),
        ("compute", 40.0, 100.0)), events
    assert collectives == {ag.name: (0.0, 100.0, 70.0, 30.0, False),
                           kern.name: (0.0, 10.0, 10.0, 0.0, True)}, collectives
    assert totals == (100.0, 110.0, 70.0, 1), totals
    assert tl.overlap == pytest.approx(40.0 / 110.0)


@pytest.mark.spec("SIM-7", "SIM-8")
@pytest.mark.parametrize("lead", [30.0, 100.0, 150.0])
def test_a_wait_reached_early_or_late(backend, world4, lead):
    """A gather (100 us) on group "0" issued at 0; a matmul (`lead` us); then its wait,
    pinned 5 us.

    By hand: the wait starts when the compute stream reaches it, at `lead`, and ends 5 us
    after the later of that and the gather's end (100).
    Early, lead 30: the wait runs 30..105, standing 30..100: 70 exposed; the gather 70
    exposed, 30 hidden. Step 105, overlap 0.3.
    Exactly at the end, lead 100: the wait runs 100..105, nothing exposed; the gather all
    hidden. Step 105, overlap 1.0.
    Late, lead 150: the wait still takes its own 5 us, 150..155; nothing exposed. Step 155.
    None fully exposed; comm 100 in all."""
    ns = sim(backend)
    gm, (ag, mm, wait) = _gather_matmul_wait(backend)
    tl = ns.simulate(gm, ns.CostModel(pinned=_pinned(gm, **{ag.name: 100.0, mm.name: lead,
                                                            wait.name: 5.0})))
    events, collectives, totals = _times(tl)
    exposed = max(0.0, 100.0 - lead)
    end = max(lead, 100.0) + 5.0
    assert (events[ag.name], events[mm.name], events[wait.name]) == (
        ("comm:0", 0.0, 100.0), ("compute", 0.0, lead), ("compute", lead, end)), events
    assert collectives == {ag.name: (0.0, 100.0, exposed, 100.0 - exposed, False)}
    assert totals == (end, 100.0, exposed, 0), totals
    assert tl.overlap == pytest.approx(1.0 - exposed / 100.0)


IN_PLACE_PAIRS = {
    # (first group, its duration, second group, its duration): by hand, below.
    "longer_first": ("0", 100.0, "pair", 10.0),
    "shorter_first": ("0", 10.0, "pair", 100.0),
    "one_group": ("0", 100.0, "0", 10.0),
}


@pytest.mark.spec("SIM-6", "SIM-7", "SIM-8", "MEM-5")
@pytest.mark.parametrize("namespace", ["refimpl", "upstream"])
@pytest.mark.parametrize("pair", list(IN_PLACE_PAIRS))
def test_one_wait_completes_two_in_place_collectives_on_one_buffer(backend, world4, pair,
                                                                  namespace):
    """`t = x * 1` (0 us); `a = all_reduce_(t)` on one group, then `b = all_reduce_(a)`
    (the same buffer) on another, or the same; then one wait of `b`, which completes both
    (MEM-5's pairing: both write the buffer it waits for). Both are issued at 0.

    By hand. longer_first (a: 100 us on "0", b: 10 us on the subgroup): a runs 0..100, b
    0..10 on its own stream; the wait stands 0..100 for the later-ending a, though b was
    issued last. shorter_first (a 10 us, b 100 us): a 0..10, b 0..100, the wait 0..100.
    Both: step 100, comm 110, exposed 100; a and b both fully exposed (one wait exposes
    both streams). one_group (a 100 us, b 10 us, both on "0"): b queues, 100..110; the
    wait 0..110: step 110, comm 110, exposed 110, both fully exposed."""
    ns = sim(backend)
    if namespace == "refimpl":
        ops = backend.require("functional_collectives").ops
    else:
        ops = torch.ops._c10d_functional
    first, d_first, second, d_second = IN_PLACE_PAIRS[pair]
    groups = {"0": "0", "pair": world4}

    def program(x):
        a = ops.all_reduce_(x * 1, "sum", groups[first])
        b = ops.all_reduce_(a, "sum", groups[second])
        return ops.wait_tensor(b)

    gm = make_fx(program, tracing_mode="fake")(torch.ones(8))
    (a, b), (wait,) = nodes_of(gm, "all_reduce_"), nodes_of(gm, "wait_tensor")
    tl = ns.simulate(gm, ns.CostModel(pinned=_pinned(gm, **{a.name: d_first,
                                                            b.name: d_second})))
    events, collectives, totals = _times(tl)
    b_start = d_first if first == second else 0.0
    end = max(d_first, b_start + d_second)
    assert (events[a.name], events[b.name], events[wait.name]) == (
        (f"comm:{groups[first]}", 0.0, d_first),
        (f"comm:{groups[second]}", b_start, b_start + d_second),
        ("compute", 0.0, end)), events
    assert collectives == {a.name: (0.0, d_first, d_first, 0.0, True),
                           b.name: (b_start, b_start + d_second, d_second, 0.0, True)}
    assert totals == (end, 110.0, end, 2), totals


@pytest.mark.spec("SIM-6", "SIM-7", "SIM-8")
@pytest.mark.parametrize("op", ["isend", "irecv"])
def test_a_point_to_point_op_overlaps_compute_until_its_wait(backend, world4, op):
    """Upstream's isend and irecv are collectives completed by a wait (the op table's
    Completion `wait`), not blocking kernels: issued at 0 (40 us) on comm:0, a matmul
    (30 us) runs alongside, 0..30; the wait stands 30..40.

    By hand: step 40 (not 70, as if the compute stream waited for it), comm 40, exposed
    10, overlap 0.75; the op 10 exposed, 30 hidden, not fully exposed; its event's kind
    "collective"."""
    ns = sim(backend)
    p2p = torch.ops._c10d_functional
    if not hasattr(p2p, op):
        pytest.skip(f"torch {torch.__version__} has no functional {op}")

    def program(x, a, b):
        sent = getattr(p2p, op)(x, 1, 0, "0")
        m = a @ b
        return p2p.wait_tensor(sent), m

    gm = make_fx(program, tracing_mode="fake")(torch.ones(8), torch.ones(4, 4),
                                                 torch.ones(4, 4))
    (comm,), (mm,), (wait,) = (nodes_of(gm, f) for f in (op, "aten.mm", "wait_tensor"))
    tl = ns.simulate(gm, ns.CostModel(pinned=_pinned(gm, **{comm.name: 40.0,
                                                            mm.name: 30.0})))
    events, collectives, totals = _times(tl)
    assert (events[comm.name], events[mm.name], events[wait.name]) == (
        ("comm:0", 0.0, 40.0), ("compute", 0.0, 30.0), ("compute", 30.0, 40.0)), events
    assert [e.kind for e in tl.events if e.node is comm] == ["collective"]
    assert collectives == {comm.name: (0.0, 40.0, 10.0, 30.0, False)}, collectives
    assert totals == (40.0, 40.0, 10.0, 0), totals
    assert tl.overlap == pytest.approx(0.75)


# --------------------------------------------------------------------------------------
# Bytes, free ops and zero-length collectives at their boundaries (SIM-3, SIM-4, SIM-8)
# --------------------------------------------------------------------------------------
@pytest.mark.spec("SIM-3", "SIM-2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int32],
                         ids=["f32", "bf16", "f64", "i32"])
def test_a_view_of_part_of_a_tensor_moves_its_own_bytes(backend, world4, dtype):
    """`v = x[0:2]` of an input `x` of 1024 elements; `a = v + 1`; `all_reduce(v)` on the
    world of 4. Bytes are elements times element size (SIM-3), not the storage's.

    By hand (element size s): the add moves v and a, 2 s + 2 s = 4 s bytes, and costs
    1 + 4 s / 1000 us (not 1 + (1024 s + 2 s) / 1000, the storage's); the all_reduce costs
    2 ring(4, 2 s) (not 2 ring(4, 1024 s)); the slice, a view, 0."""
    ns = sim(backend)
    ops = backend.require("functional_collectives").ops

    def program(x):
        v = x[0:2]
        return v + 1, ops.wait_tensor(ops.all_reduce(v, "sum", "0"))

    gm = make_fx(program, tracing_mode="fake")(torch.ones(1024, dtype=dtype))
    tl = ns.simulate(gm, ns.CostModel(_profile(ns)))
    durations = {e.node.name: e.end_us - e.start_us for e in tl.events}
    s = torch.empty((), dtype=dtype).element_size()
    (add,), (ar,), (sl,) = (nodes_of(gm, f) for f in ("aten.add", "all_reduce", "aten.slice"))
    assert durations[add.name] == pytest.approx(1 + 4 * s / BANDWIDTH), durations
    assert durations[ar.name] == pytest.approx(2 * ring(4, 2 * s)), durations
    assert durations[sl.name] == 0.0


@pytest.mark.spec("SIM-4", "SIM-3")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_an_op_that_returns_nothing_is_no_view(backend, world4, dtype):
    """`aten._foreach_add_.Scalar([a, b], 1.0)` returns nothing (its schema's returns are
    empty): not a view (SIM-4: every result a non-writing alias needs a result), so a
    roofline of what it reads (SIM-3; no FLOP formula).

    By hand: a and b of 64 elements of size s: 1 + 2 * 64 s / 1000 us (f32: 1.512 us,
    bf16: 1.256 us), not 0."""
    ns = sim(backend)

    def program(a, b):
        torch.ops.aten._foreach_add_.Scalar([a, b], 1.0)
        return a * 1, b * 1

    gm = make_fx(program, tracing_mode="fake")(torch.ones(64, dtype=dtype),
                                                 torch.ones(64, dtype=dtype))
    (foreach,) = nodes_of(gm, "_foreach_add_")
    assert foreach.target._schema.returns == []
    tl = ns.simulate(gm, ns.CostModel(_profile(ns)))
    durations = {e.node.name: e.end_us - e.start_us for e in tl.events}
    s = torch.empty((), dtype=dtype).element_size()
    assert durations[foreach.name] == pytest.approx(1 + 2 * 64 * s / BANDWIDTH), durations


@pytest.mark.spec("SIM-8")
@pytest.mark.parametrize("group", ["world", "sub"])
def test_a_collective_that_takes_no_time_is_not_fully_exposed(backend, world4, group):
    """`ar0 = all_reduce(x)` pinned 0 us, waited at once; `ar1 = all_reduce(y)` pinned
    5 us, waited at once; every other node 0 us. On the world or on the subgroup [0, 1].

    By hand: ar0 runs 0..0, hidden 0, exposed 0: it did not run, so not fully exposed
    (SIM-8: it ran, and hidden_us is 0); ar1 runs 0..5, exposed 5, hidden 0: fully
    exposed. Step 5, comm 5, exposed 5, fully_exposed_count 1."""
    ns = sim(backend)
    ops = backend.require("functional_collectives").ops
    name = "0" if group == "world" else world4

    def program(x, y):
        w0 = ops.wait_tensor(ops.all_reduce(x, "sum", name))
        return w0, ops.wait_tensor(ops.all_reduce(y, "sum", name))

    gm = make_fx(program, tracing_mode="fake")(torch.ones(8), torch.ones(8))
    ar0, ar1 = nodes_of(gm, "all_reduce")
    tl = ns.simulate(gm, ns.CostModel(pinned=_pinned(gm, **{ar0.name: 0.0, ar1.name: 5.0})))
    _, collectives, totals = _times(tl)
    assert collectives == {ar0.name: (0.0, 0.0, 0.0, 0.0, False),
                           ar1.name: (0.0, 5.0, 5.0, 0.0, True)}, collectives
    assert totals == (5.0, 5.0, 5.0, 1), totals
