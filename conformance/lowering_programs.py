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


def all_gather(fc, x):
    return fc.all_gather_tensor(x, 0, WORLD)


def reduce_scatter(fc, x):
    return fc.reduce_scatter_tensor(x, "sum", 0, WORLD)


def all_to_all(fc, x):
    return fc.all_to_all_single(x, None, None, WORLD)


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


def ar_small_avg(fc, x):
    return fc.all_reduce(x * 2, "avg", WORLD) + 1


def ar_small_graph_input(fc, x):
    return fc.all_reduce(x, "sum", WORLD) + 1


def ar_inplace_small(fc, x):
    """all_reduce_ of a small intermediate: one-shot, copied back into it."""
    y = x * 2
    fc.ops.wait_tensor(fc.ops.all_reduce_(y, "sum", WORLD))
    return y + 1


PROGRAMS = {f.__name__: f for f in [
    ar_graph_input, ar_intermediate, ar_intermediate_shared, ar_inplace, ar_coalesced,
    all_gather, reduce_scatter, all_to_all, all_gather_coalesced, reduce_scatter_coalesced,
    all_gather_out, broadcast, broadcast_inplace, ar_small_intermediate, ar_small_avg,
    ar_small_graph_input, ar_inplace_small,
]}


def inputs_for(rank: int, shapes, salt: int = 0) -> list[torch.Tensor]:
    return [rank_input(rank, shape, torch.float32, salt + i) for i, shape in enumerate(shapes)]


def _plain(value):
    """Results as plain tensors: an AsyncCollectiveTensor waits when cloned."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value.clone() if isinstance(value, torch.Tensor) else value


def numeric_check(spec: str, name: str, shapes, options) -> tuple:
    """On one rank: (eager reference, lowered program) results for the same inputs."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    ns = backend.require("lowering", "run_lowered")
    fc = backend.require("functional_collectives")
    program = functools.partial(PROGRAMS[name], fc)
    inputs = inputs_for(dist.get_rank(), shapes)
    want = _plain(program(*[t.clone() for t in inputs]))
    got = _plain(ns.run_lowered(program, [t.clone() for t in inputs], options))
    return want, got
