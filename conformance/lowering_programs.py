"""Programs of the comm-lowering cases, written once against any backend's collectives.

Each program is `program(fc, *inputs)` where `fc` is a backend's "functional_collectives"
namespace; it uses the default group "0" (WORLD, both under the fake process group and
under gloo). `numeric_check` runs on every rank: it runs the program eagerly (the
unoptimized reference) and the backend's lowered program on the same inputs and returns
both, so the test process can compare them (CL-15).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from conformance.oracle import rank_input
from conformance.true_meta import MetaChecker

WORLD = "0"


def ar_graph_input(fc, x):
    """all_reduce of a graph input that a later collective reads too."""
    a = fc.all_reduce(x, "sum", WORLD)
    g = fc.all_gather_tensor(x, 0, WORLD)
    return a, g


def ar_intermediate(fc, x):
    """all_reduce of an intermediate that nothing else reads."""
    return fc.all_reduce(x * 2, "sum", WORLD)


def ar_intermediate_shared(fc, x):
    """all_reduce of an intermediate that is read again afterwards."""
    y = x * 2
    return fc.all_reduce(y, "sum", WORLD) + y


def ar_inplace(fc, x):
    """all_reduce_ on a buffer the program owns."""
    y = x * 2
    fc.ops.wait_tensor(fc.ops.all_reduce_(y, "sum", WORLD))
    return y + 1


def ar_coalesced(fc, x, y):
    """all_reduce_coalesced of a graph input and an intermediate."""
    a, b = fc.all_reduce_coalesced([x, y * 2], "sum", WORLD)
    return a, b


def ar_coalesced_same_tensor_twice(fc, x):
    """all_reduce_coalesced naming one fresh intermediate twice: each place in the list
    reads it, so neither may reduce it in place (CL-3, CL-5)."""
    y = x * 1
    a, b = fc.all_reduce_coalesced([y, y], "sum", WORLD)
    return a, b


def ar_inplace_wait_result_written(fc, x):
    """all_reduce_ whose wait's result is then written in place, and whose argument is
    read after that: refimpl's wait returns a copy (FC-5), so the write reaches only it."""
    t = torch.relu(x)
    done = fc.ops.wait_tensor(fc.ops.all_reduce_(t, "sum", WORLD))
    done.add_(1)
    return torch.relu(t), done * 1


def ar_inplace_argument_written_after_wait(fc, x):
    """all_reduce_ whose argument is written in place after the wait, the wait's result
    read after that."""
    t = torch.relu(x)
    done = fc.ops.wait_tensor(fc.ops.all_reduce_(t, "sum", WORLD))
    t.mul_(3)
    return t * 1, done * 1


def ar_coalesced_inplace(fc, x, y):
    """all_reduce_coalesced_ on two contiguous buffers the program owns (CL-5: in place)."""
    a, b = x * 2, y + 1
    for done in fc.ops.all_reduce_coalesced_([a, b], "sum", WORLD):
        fc.ops.wait_tensor(done)
    return a + 1, b * 3


def ar_coalesced_waited_together(fc, x, y):
    """Upstream's all_reduce_coalesced of a graph input (read again after) and of an
    intermediate, waited by one `wait_tensors`, as torch 2.15 traces it (FC-35); upstream's
    ops whatever the backend's own API. `prepare` makes sure the running torch has it."""
    up = torch.ops._c10d_functional
    a, b = up.wait_tensors(up.all_reduce_coalesced([x, y * 2], "sum", WORLD))
    return a + x, b


def all_gather(fc, x):
    return fc.all_gather_tensor(x, 0, WORLD)


def reduce_scatter(fc, x):
    return fc.reduce_scatter_tensor(x, "sum", 0, WORLD)


def all_to_all(fc, x):
    return fc.all_to_all_single(x, None, None, WORLD)


def point_to_point(fc, x, y):
    """A ring over the world, as a pipeline stage exchanges activations: each rank sends to
    the next and receives from the one before, alone (sends first) and in a batch
    (receives first); every result waited."""
    ops = fc.ops
    if not hasattr(ops, "batch_p2p_ops"):
        from conformance.backends import NotImplementedConcept

        raise NotImplementedConcept(f"torch {torch.__version__} has no functional isend")
    me, n = dist.get_rank(), dist.get_world_size()
    after, before = (me + 1) % n, (me - 1) % n
    sent = ops.isend(x * 2, after, 0, WORLD)
    received = ops.irecv(torch.zeros_like(x), before, 0, WORLD)
    batch = ops.batch_p2p_ops(["irecv", "isend"], [before, after], [1, 1],
                              [torch.zeros_like(y), y + 1], WORLD)
    ops.wait_tensor(sent)
    ops.wait_tensor(batch[1])
    return ops.wait_tensor(received) + 0, ops.wait_tensor(batch[0]) + 0


def all_gather_coalesced(fc, x, y):
    return tuple(fc.all_gather_into_tensor_coalesced([x, y], WORLD))


def reduce_scatter_coalesced(fc, x, y):
    return tuple(fc.reduce_scatter_tensor_coalesced([x, y], "sum", [0, 0], WORLD))


def all_gather_out(fc, x):
    out = x.new_empty([x.shape[0] * dist.get_world_size(), *x.shape[1:]])
    fc.ops.wait_tensor(fc.ops.all_gather_into_tensor_out(x, dist.get_world_size(), WORLD,
                                                          out=out))
    return out * 1


def broadcast(fc, x):
    return fc.broadcast(x + 1, 1, WORLD)


def broadcast_inplace(fc, x):
    y = x + 1
    fc.ops.wait_tensor(fc.ops.broadcast_(y, 1, WORLD))
    return y * 1


def ar_small_intermediate(fc, x):
    """The one-shot candidate: a small sum all_reduce of an intermediate."""
    return fc.all_reduce(x * 2, "sum", WORLD) + 1


def ar_of_a_one_shot_result(fc, x):
    """A second all_reduce of the first's result (a wait's: no fresh intermediate, so a
    clone, CL-3, even once the first is a one-shot kernel whose wait is gone, CL-9)."""
    return fc.all_reduce(fc.all_reduce(x * 2, "sum", WORLD), "sum", WORLD) + 1


def ar_of_a_fused_epilogue(fc, x):
    """A second all_reduce of the first's epilogue step `e`, its only reader: fused
    (CL-17), `e` is the kernel's result, which no ATen op computes: neither one-shot
    (CL-10, CL-11) nor reduced in place (CL-3)."""
    e = fc.all_reduce(x * 2, "sum", WORLD) * 3
    return fc.all_reduce(e, "sum", WORLD) + 1


def ar_small_avg(fc, x):
    return fc.all_reduce(x * 2, "avg", WORLD) + 1


def ar_small_graph_input(fc, x):
    return fc.all_reduce(x, "sum", WORLD) + 1


def ar_inplace_small(fc, x):
    """all_reduce_ of a small intermediate: one-shot, copied back into it."""
    y = x * 2
    fc.ops.wait_tensor(fc.ops.all_reduce_(y, "sum", WORLD))
    return y + 1


def ar_intermediate_read_before(fc, x):
    """all_reduce of an intermediate that another op read before it (CL-3: cloned)."""
    y = x * 2
    z = y + 1
    return fc.all_reduce(y, "sum", WORLD), z


def ar_non_contiguous_intermediate(fc, x):
    """all_reduce of a fresh but non-contiguous intermediate (CL-3: cloned)."""
    return fc.all_reduce(x.t() * 2, "sum", WORLD)


def ar_inplace_non_contiguous(fc, x):
    """all_reduce_ on a transposed view of an intermediate (CL-4: copy back at the wait)."""
    y = x * 2
    fc.ops.wait_tensor(fc.ops.all_reduce_(y.t(), "sum", WORLD))
    return y + 1


def broadcast_inplace_non_contiguous(fc, x):
    """broadcast_ on a transposed view of an intermediate (CL-4: copy back at the wait)."""
    y = x + 1
    fc.ops.wait_tensor(fc.ops.broadcast_(y.t(), 1, WORLD))
    return y * 1


def all_gather_non_contiguous(fc, x):
    return fc.all_gather_tensor(x.t(), 0, WORLD)


def reduce_scatter_non_contiguous(fc, x):
    return fc.reduce_scatter_tensor(x.t(), "sum", 0, WORLD)


# The ops themselves, unlike the API above, take a view as it is: the lowering copies it.
def all_gather_op_non_contiguous(fc, x):
    return fc.ops.wait_tensor(fc.ops.all_gather_into_tensor(x.t(), 2, WORLD))


def reduce_scatter_op_non_contiguous(fc, x):
    return fc.ops.wait_tensor(fc.ops.reduce_scatter_tensor(x.t(), "sum", 2, WORLD))


def ar_small_max(fc, x):
    return fc.all_reduce(x * 2, "max", WORLD) + 1


def ar_small_f64(fc, x):
    return fc.all_reduce(x.double() * 2, "sum", WORLD) + 1


def ar_small_view(fc, x):
    """The all_reduce reads a view: no comm buffer can be realized under it (CL-11)."""
    return fc.all_reduce((x * 2).view(-1, 2), "sum", WORLD) + 1


def ar_of_one_result_of_two(fc, x):
    """all_reduce of one result of a multi-output op (an FX `getitem`, not an ATen op)."""
    values, indices = torch.max(x, dim=0)
    return fc.all_reduce(values, "sum", WORLD) + 1, indices


# The name of a second group of every rank, whose symmetric memory is never enabled;
# made by `prepare` before the program is traced (a tracer cannot create groups).
OTHER_GROUP: dict = {}


def _make_other_group() -> None:
    if OTHER_GROUP.get("world") is not dist.group.WORLD:
        group = dist.new_group(list(range(dist.get_world_size())))
        OTHER_GROUP.update(world=dist.group.WORLD, name=group.group_name)


def ar_small_other_group(fc, x):
    """A one-shot candidate on a group without symmetric memory (CL-10)."""
    return fc.all_reduce(x * 2, "sum", OTHER_GROUP["name"]) + 1


def ar_two_small(fc, x):
    """Two one-shot all_reduces: two comm buffers in one graph (CL-12)."""
    a = fc.all_reduce(x * 2, "sum", WORLD)
    b = fc.all_reduce(x * 3, "sum", WORLD)
    return a + b


def ar_two_sizes(fc, x):
    """A 32-byte all_reduce, then a 16-byte one: under a threshold of 16 bytes the second
    is the graph's buffer 0, under 32 the first is (CL-12: ids differ with the size)."""
    a = fc.all_reduce(x.repeat(2) * 3, "sum", WORLD)
    b = fc.all_reduce(x * 2, "sum", WORLD)
    return a.sum() + b


def ar_comm_buffer_escapes(fc, x):
    """The comm buffer under a one-shot all_reduce is also a graph output (CL-13)."""
    y = x * 3
    return fc.all_reduce(y, "sum", WORLD), y


def ar_comm_buffer_escapes_as_a_view(fc, x):
    """The comm buffer under a one-shot all_reduce escapes through a view of it, an
    output the buffer itself is not (CL-13): found by the fuzzer."""
    y = x * 3
    return fc.all_reduce(y, "sum", WORLD), y.view(2, 2)


def ar_comm_buffer_escapes_as_a_split(fc, x):
    """... through the second piece of a split of it, a getitem of a view op (CL-13)."""
    y = x * 3
    return fc.all_reduce(y, "sum", WORLD), y.split(2)[1]


def ar_inplace_comm_buffer_escapes(fc, x):
    """all_reduce_ in place on a small intermediate that is itself returned: the comm
    buffer escapes as the result of the in-place copy back (CL-14, CL-13): a red team's."""
    y = x * 3
    fc.ops.wait_tensor(fc.ops.all_reduce_(y, "sum", WORLD))
    return y, x + 1


# ---- CL-17: chains of add/sub/mul by a number around a one-shot all_reduce ----------------
def ar_pointwise_chains(fc, x):
    """A prologue and an epilogue of three steps each, all fusable."""
    return (fc.all_reduce(((x * 2) + 3) - 0.5, "sum", WORLD) * 1.5 - 1) * 4


def ar_pointwise_shared_step(fc, x):
    """The prologue stops below `y`, which the output reads too; the epilogue is whole."""
    y = x * 2
    return fc.all_reduce((y + 1) - 3, "sum", WORLD) * 3, y


def ar_pointwise_result_read_twice(fc, x):
    """No epilogue: the result has two readers."""
    r = fc.all_reduce(x * 2, "sum", WORLD)
    return r + 1, r


def ar_pointwise_epilogue_step_read_twice(fc, x):
    """The epilogue stops after `s`, which two nodes read."""
    s = fc.all_reduce(x * 2, "sum", WORLD) + 1
    return s * 2, s


def ar_pointwise_alpha(fc, x):
    """add with alpha is no step: nothing to fuse, the plain one-shot kernel."""
    return fc.all_reduce(torch.add(x, 1, alpha=2), "sum", WORLD)


def ar_pointwise_bool(fc, x):
    """A bool is no number: the prologue is not fused, the epilogue is."""
    return fc.all_reduce(x * True, "sum", WORLD) + 1


# 2**53 + 2**29 + 1 has no exact double: ATen casts it to float32 directly (2**53 + 2**30),
# through a double it would become 2**53.
INEXACT_INT = 2**53 + 2**29 + 1


def ar_pointwise_inexact_int(fc, x):
    return fc.all_reduce(x * INEXACT_INT, "sum", WORLD) + 1


def ar_pointwise_other_dtype(fc, x):
    """A step from int32 to float32 changes the dtype: no step."""
    return fc.all_reduce(x.to(torch.int32) * 2.5, "sum", WORLD)


def ar_pointwise_source_written(fc, x):
    """`x * 2` reads x before all_reduce_ writes it: the prologue cannot move past that."""
    y = x * 2
    done = fc.ops.wait_tensor(fc.ops.all_reduce_(x, "sum", WORLD))
    return fc.all_reduce(y, "sum", WORLD) + done


def ar_pointwise_source_written_through_a_view(fc, x):
    """`x * 2` reads x before `x[1:].add_` writes a view of it: no prologue."""
    y = x * 2
    x[1:].add_(1)
    return fc.all_reduce(y, "sum", WORLD) + x


def ar_pointwise_source_written_by_a_foreach(fc, x):
    """`x * 2` reads x before `_foreach_add_` writes a list that holds x and another
    tensor: no prologue."""
    z = x - 1
    y = x * 2
    torch._foreach_add_([z, x], 1.0)
    return fc.all_reduce(y, "sum", WORLD) + x + z


def ar_pointwise_other_buffer_written(fc, x):
    """An in-place op and a multi-output op (an FX `getitem`, no ATen op) between the
    prologue and the all_reduce write other buffers: the prologue is fused all the same."""
    z = x - 1
    y = x * 2
    z.mul_(3)
    top, _ = z.max(dim=0)
    return fc.all_reduce(y, "sum", WORLD) + z + top


def ar_pointwise_int32(fc, x):
    """int32 is one-shot but no step dtype: the plain kernel, no chain."""
    return fc.all_reduce(x.to(torch.int32) * 2, "sum", WORLD) + 1


def ar_small_sum_of(fc, x):
    """The one-shot candidate made by `aten.sum.default`: its out= overload is `sum.out`
    (self, dtype), not the first one with an `out` (`sum.IntList_out`, which takes dims)."""
    return fc.all_reduce(x.sum(), "sum", WORLD) + 1


_ROWS: dict = {}


def _row_group() -> str:
    """This rank's group of `[[0], [1], ...]`: one name per row, so the name differs between
    ranks (made once per process, by every rank together)."""
    world = dist.group.WORLD
    if world not in _ROWS:
        _ROWS[world], _ = dist.new_subgroups_by_enumeration(
            [[r] for r in range(dist.get_world_size())])
    return _ROWS[world].group_name


def ar_beside_a_row_group(fc, x):
    """A one-shot all_reduce on WORLD beside a gather on this rank's row group, whose name
    differs between the ranks: the comm buffer's alloc_id must not (CL-12)."""
    return fc.all_reduce(x * 2, "sum", WORLD), fc.all_gather_tensor(x, 0, _row_group())


def _ar_beside_a_ring(fc, x, step):
    ops = fc.ops
    if not hasattr(ops, "isend"):
        from conformance.backends import NotImplementedConcept

        raise NotImplementedConcept(f"torch {torch.__version__} has no functional isend")
    me, n = dist.get_rank(), dist.get_world_size()
    after, before = (me + step) % n, (me - step) % n
    sent = ops.isend(x * 3, after, 0, WORLD)
    received = ops.irecv(torch.empty_like(x), before, 0, WORLD)
    reduced = fc.all_reduce(x * 2, "sum", WORLD)
    got, token = ops.batch_p2p_ops(["irecv", "isend"], [before, after], [1, 1],
                                   [torch.empty_like(x), x + 1], WORLD)
    ops.wait_tensor(sent)
    ops.wait_tensor(token)
    return reduced, ops.wait_tensor(received) + ops.wait_tensor(got)


def _upstream_p2p():
    up = torch.ops._c10d_functional
    if not hasattr(up, "isend"):
        from conformance.backends import NotImplementedConcept

        raise NotImplementedConcept(f"torch {torch.__version__} has no functional isend")
    return up


def ar_of_a_tensor_upstream_sends(fc, x):
    """A small sum all_reduce of an intermediate that upstream's isend also sends to the
    other rank: no one-shot (CL-10: upstream's isend keeps what it sends alive, finding 25;
    a comm buffer there would outlive the call)."""
    up, peer = _upstream_p2p(), 1 - dist.get_rank()
    y = x * 3
    received = up.irecv(torch.empty_like(y), peer, 0, WORLD)
    sent = up.isend(y, peer, 0, WORLD)
    reduced = fc.all_reduce(y, "sum", WORLD)
    up.wait_tensor(sent)
    return reduced, up.wait_tensor(received) + 0


def ar_in_place_of_a_tensor_upstream_sends(fc, x):
    """all_reduce_ in place on a small intermediate, which upstream's isend then sends:
    the all_reduce_'s result is the intermediate itself (the trace sends that result), so
    the send sends it: no one-shot either (CL-10; the fuzzer's seed 2148 had it)."""
    up, peer = _upstream_p2p(), 1 - dist.get_rank()
    y = x * 3
    fc.ops.wait_tensor(fc.ops.all_reduce_(y, "sum", WORLD))
    received = up.irecv(torch.empty_like(y), peer, 0, WORLD)
    sent = up.isend(y, peer, 0, WORLD)
    up.wait_tensor(sent)
    return y + 0, up.wait_tensor(received) + 0


def ar_of_a_view_upstream_batch_sends(fc, x):
    """The same with a view of the intermediate sent as a batch's isend member."""
    up, peer = _upstream_p2p(), 1 - dist.get_rank()
    y = x * 3
    got, token = up.batch_p2p_ops(["irecv", "isend"], [peer, peer], [0, 0],
                                  [torch.empty(2, 2), y.view(2, 2)], WORLD)
    reduced = fc.all_reduce(y, "sum", WORLD)
    up.wait_tensor(token)
    return reduced, up.wait_tensor(got) + 0


def ar_beside_a_broadcast(fc, x):
    """A one-shot all_reduce on WORLD beside a broadcast from group rank 0, whose `src`
    (named as a receive's peer is) is the same on every rank: so is the alloc_id (CL-12)."""
    return fc.all_reduce(x * 2, "sum", WORLD), fc.broadcast(x + 1, 0, WORLD)


def ar_beside_a_ring(fc, x):
    """A one-shot all_reduce on WORLD beside a ring's send to the rank after and receive
    from the one before, single and in a batch: the peers differ between the ranks, the
    comm buffer's alloc_id must not (CL-12)."""
    return _ar_beside_a_ring(fc, x, 1)


def ar_beside_a_reversed_ring(fc, x):
    """The ring of ar_beside_a_ring the other way round: on more than 2 ranks another
    graph on every rank, so other alloc_ids (CL-12)."""
    return _ar_beside_a_ring(fc, x, -1)


PROGRAMS = {f.__name__: f for f in [
    ar_beside_a_row_group, ar_beside_a_ring, ar_beside_a_reversed_ring, ar_beside_a_broadcast,
    ar_of_a_tensor_upstream_sends, ar_in_place_of_a_tensor_upstream_sends,
    ar_of_a_view_upstream_batch_sends,
    ar_graph_input, ar_intermediate, ar_intermediate_shared, ar_inplace, ar_coalesced,
    ar_coalesced_inplace, ar_coalesced_waited_together, ar_coalesced_same_tensor_twice,
    ar_inplace_wait_result_written, ar_inplace_argument_written_after_wait,
    all_gather, reduce_scatter, all_to_all, point_to_point, all_gather_coalesced,
    reduce_scatter_coalesced,
    all_gather_op_non_contiguous, reduce_scatter_op_non_contiguous,
    all_gather_out, broadcast, broadcast_inplace, ar_small_intermediate, ar_small_avg,
    ar_small_graph_input, ar_inplace_small, ar_intermediate_read_before,
    ar_non_contiguous_intermediate, ar_inplace_non_contiguous,
    broadcast_inplace_non_contiguous, all_gather_non_contiguous,
    reduce_scatter_non_contiguous, ar_small_max, ar_small_f64, ar_small_view,
    ar_of_one_result_of_two, ar_small_other_group, ar_two_small, ar_comm_buffer_escapes,
    ar_comm_buffer_escapes_as_a_view, ar_comm_buffer_escapes_as_a_split,
    ar_inplace_comm_buffer_escapes,
    ar_pointwise_chains, ar_pointwise_shared_step, ar_pointwise_result_read_twice,
    ar_pointwise_epilogue_step_read_twice, ar_pointwise_alpha, ar_pointwise_bool,
    ar_pointwise_inexact_int, ar_pointwise_other_dtype, ar_pointwise_source_written,
    ar_pointwise_source_written_through_a_view, ar_pointwise_source_written_by_a_foreach,
    ar_pointwise_other_buffer_written,
    ar_pointwise_int32, ar_small_sum_of, ar_of_a_one_shot_result, ar_of_a_fused_epilogue,
    ar_two_sizes,
]}


def _wait_tensors_op() -> None:
    from conformance.upstream_ops import wait_tensors

    wait_tensors()


_PREPARE = {"ar_small_other_group": _make_other_group,
            "ar_coalesced_waited_together": _wait_tensors_op}


def prepare(name: str) -> None:
    """What program `name` needs before it is traced, on every rank alike (a group)."""
    if name in _PREPARE:
        _PREPARE[name]()


def inputs_for(rank: int, shapes, salt: int = 0) -> list[torch.Tensor]:
    return [rank_input(rank, shape, torch.float32, salt + i) for i, shape in enumerate(shapes)]


def _plain(value):
    """Results as plain tensors: an AsyncCollectiveTensor waits when cloned."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value.clone() if isinstance(value, torch.Tensor) else value


def numeric_check(spec: str, name: str, shapes, options) -> tuple:
    """On one rank: (eager reference, lowered program) results for the same inputs, and
    the lowered graph's nodes whose meta val is not what they computed (CL-1; '' for a
    backend that gives no graph, `lowered_graph`)."""
    from conformance.harness import backend_in_rank

    prepare(name)
    backend = backend_in_rank(spec)
    ns = backend.require("lowering", "run_lowered")
    fc = backend.require("functional_collectives")
    program = functools.partial(PROGRAMS[name], fc)
    inputs = inputs_for(dist.get_rank(), shapes)
    want = _plain(program(*[t.clone() for t in inputs]))
    if getattr(ns, "lowered_graph", None) is None:
        return want, _plain(ns.run_lowered(program, [t.clone() for t in inputs], options)), ""
    checker = MetaChecker(ns.lowered_graph(program, [t.clone() for t in inputs], options))
    return want, _plain(checker.call(*[t.clone() for t in inputs])), checker.report()


def lowered_values(spec: str, name: str, shapes, options):
    """On one rank: the lowered program's results alone, for programs that cannot run
    eagerly (an in-place collective on a non-contiguous view, FC-4)."""
    from conformance.harness import backend_in_rank

    prepare(name)
    backend = backend_in_rank(spec)
    ns = backend.require("lowering", "run_lowered")
    program = functools.partial(PROGRAMS[name], backend.require("functional_collectives"))
    return _plain(ns.run_lowered(program, inputs_for(dist.get_rank(), shapes), options))


def called_twice(spec: str, name: str, shapes, options) -> tuple:
    """On one rank: (eager results, the lowered graph's results of two calls, the first
    call's kept alive during the second) (CL-13, SM-4)."""
    from conformance.harness import backend_in_rank

    prepare(name)
    backend = backend_in_rank(spec)
    ns = backend.require("lowering", "lowered_graph")
    program = functools.partial(PROGRAMS[name], backend.require("functional_collectives"))
    inputs = inputs_for(dist.get_rank(), shapes)
    want = _plain(program(*[t.clone() for t in inputs]))
    lowered = ns.lowered_graph(program, inputs, options)
    first = lowered(*[t.clone() for t in inputs])
    second = lowered(*[t.clone() for t in inputs])
    return want, _plain(first), _plain(second)


def alloc_ids(gm) -> list[int]:
    """The alloc_id of every comm buffer a lowered graph allocates, in order (CL-12)."""
    from conformance.canonical import op_name

    return [n.args[5] for n in gm.graph.nodes if n.op == "call_function"
            and op_name(n.target) == "symm_mem.empty_strided_p2p"]


def alloc_ids_on_rank(spec: str, lowerings) -> list[list[int]]:
    """On one rank: the alloc_ids of each `(program, options, input shape)` lowering."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    ns = backend.require("lowering", "lowered_graph")
    fc = backend.require("functional_collectives")
    return [alloc_ids(ns.lowered_graph(functools.partial(PROGRAMS[name], fc),
                                       inputs_for(dist.get_rank(), [shape]), options))
            for name, options, shape in lowerings]


def lowered_in_turn_on_rank(spec: str, name: str, configs) -> list:
    """On one rank: program `name` lowered under each config in turn, each lowering run
    right after it in this one process (persistent allocations outlive a call, SM-4):
    eager's values, then each lowering's (an exception's text where one raised)."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    ns = backend.require("lowering", "lowered_graph")
    fc = backend.require("functional_collectives")
    fn = functools.partial(PROGRAMS[name], fc)
    xs = inputs_for(dist.get_rank(), [(4,)])
    results = [fn(*[x.clone() for x in xs])]
    for config in configs:
        try:
            results.append(ns.lowered_graph(fn, [x.clone() for x in xs], dict(config))(*xs))
        except Exception as exc:  # reported, and the case fails naming it
            results.append(f"{type(exc).__name__}: {exc}")
    return results
