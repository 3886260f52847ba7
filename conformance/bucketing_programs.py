"""Bucketing programs: user programs with many small collectives, traced and run on ranks.

Each program is written against a functional-collectives namespace (`fc`: refimpl's or
upstream's), so every backend traces the same user code with its own API. On a rank,
`trace_bucket_run` traces the program with make_fx (fake tensors: no communication),
applies the backend's bucketing pass to a second trace, runs both graphs on real inputs
over the rank's gloo group and reports whether every output matches bit for bit, with
the canonical text and comm trace of the bucketed graph. Inputs are small integers, so
sums over ranks are exact in every dtype and any mismatch is a real error.

Shared by tests/test_bucketing.py and conformance/cases/test_bucketing.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from conformance.canonical import canonical_graph
from conformance.comm_trace import comm_trace_of_graph, format_comm_trace, is_comm_op
from conformance.oracle import rank_input

WORLD = "world"
_subgroups: dict = {}


def group_of(spec):
    """A group spec -> ProcessGroup: "world", or rows of ranks covering the world.

    Rows are made once per process by every rank together (new_subgroups_by_enumeration),
    so they are groups of their own, distinct from any other group of the same ranks, and
    named by a counter rather than a hash of their ranks (a second group under one hashed
    name would rendezvous on the store keys of the first and hang).
    """
    if spec == WORLD:
        return dist.group.WORLD
    rows = tuple(tuple(r) for r in spec)
    if rows not in _subgroups:
        mine, _ = dist.new_subgroups_by_enumeration([list(r) for r in rows])
        _subgroups[rows] = mine
    return _subgroups[rows]


# --------------------------------------------------------------------------------------
# Programs. Each returns (function to trace, inputs for this rank).
# --------------------------------------------------------------------------------------
def fsdp_all_gather(fc, dtype, rows=(3, 5, 1, 4, 2, 6), cast=False, group=WORLD):
    """Params of uneven dim 0 gathered one by one, each used by compute after its wait."""
    pg = group_of(group)
    me = dist.get_rank()
    shards = [rank_input(me, (r, 3), torch.float32 if cast else dtype, salt=i)
              for i, r in enumerate(rows)]

    def step(*shards):
        outs = []
        for shard in shards:
            x = shard.to(dtype) if cast else shard
            full = fc.all_gather_tensor(x, 0, pg)
            outs.append(full * 2 + 1)
        return outs

    return step, shards


def fsdp_reduce_scatter(fc, dtype, rows_per_rank=(1, 3, 2, 1), reduce_op="sum", group=WORLD):
    """Gradients computed one after another, each reduce-scattered on dim 0."""
    pg = group_of(group)
    n = pg.size()
    me = dist.get_rank()
    grads = [rank_input(me, (r * n, 2), dtype, salt=10 + i) for i, r in enumerate(rows_per_rank)]

    def step(*grads):
        return [fc.reduce_scatter_tensor(g * 3, reduce_op, 0, pg) + 1 for g in grads]

    return step, grads


def interleaved(fc, dtype, groups=(WORLD, [[0, 2], [1, 3]]), count=3):
    """Two groups' all_gathers and reduce_scatters alternating."""
    pgs = [group_of(g) for g in groups]
    me = dist.get_rank()
    xs = [rank_input(me, (2, 2), dtype, salt=20 + i) for i in range(count * len(pgs))]

    def step(*xs):
        outs = []
        for i, x in enumerate(xs):
            pg = pgs[i % len(pgs)]
            outs.append(fc.all_gather_tensor(x, 0, pg) + 1)
            outs.append(fc.reduce_scatter_tensor(x.repeat(pg.size(), 1), "sum", 0, pg))
        return outs

    return step, xs


def chain(fc, dtype, group=WORLD):
    """all_gathers that feed each other, mixed with independent ones."""
    pg = group_of(group)
    n = pg.size()
    me = dist.get_rank()
    xs = [rank_input(me, (2,), dtype, salt=30 + i) for i in range(4)]

    def step(a, b, c, d):
        ga = fc.all_gather_tensor(a, 0, pg)                 # independent
        gb = fc.all_gather_tensor(b, 0, pg)                 # independent
        gc = fc.all_gather_tensor(ga[:2] + c, 0, pg)        # depends on ga
        gd = fc.all_gather_tensor(d, 0, pg)                 # independent
        ge = fc.all_gather_tensor(gc[: 2 * n].reshape(n, 2)[0] + gb[:2], 0, pg)
        return ga, gb, gc, gd, ge

    return step, xs


def mixed_dtypes(fc, dtype, group=WORLD):
    """all_gathers of several dtypes on one group."""
    pg = group_of(group)
    me = dist.get_rank()
    xs = [rank_input(me, (3, 2), torch.float32, 40), rank_input(me, (2,), torch.bfloat16, 41),
          rank_input(me, (5,), torch.float16, 42), rank_input(me, (1, 3), torch.int64, 43),
          rank_input(me, (4,), torch.float32, 44)]

    def step(*xs):
        return [fc.all_gather_tensor(x, 0, pg) for x in xs]

    return step, xs


def other_dims(fc, dtype, group=WORLD):
    """Gathers and scatters on dims 1 and -1: the graph's collectives are still dim 0."""
    pg = group_of(group)
    n = pg.size()
    me = dist.get_rank()
    xs = [rank_input(me, (2, 3), dtype, 50), rank_input(me, (3, 2 * n), dtype, 51),
          rank_input(me, (2, 4), dtype, 52), rank_input(me, (2, 3 * n), dtype, 53)]

    def step(a, b, c, d):
        return (fc.all_gather_tensor(a, 1, pg), fc.reduce_scatter_tensor(b, "sum", 1, pg),
                fc.all_gather_tensor(c, -1, pg), fc.reduce_scatter_tensor(d, "sum", -1, pg))

    return step, xs


def all_reduces(fc, dtype, reduce_op="sum", group=WORLD):
    pg = group_of(group)
    me = dist.get_rank()
    xs = [rank_input(me, shape, dtype, 60 + i) for i, shape in enumerate([(3,), (2, 2), (5, 1)])]

    def step(*xs):
        return [fc.all_reduce(x + 1, reduce_op, pg) * 2 for x in xs]

    return step, xs


PROGRAMS = {f.__name__: f for f in (fsdp_all_gather, fsdp_reduce_scatter, interleaved, chain,
                                    mixed_dtypes, other_dims, all_reduces)}


# --------------------------------------------------------------------------------------
# Tracing, bucketing and running on a rank
# --------------------------------------------------------------------------------------
def trace(fn, inputs) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*inputs)


def collective_count(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and is_comm_op(n.target)
               and "wait_tensor" not in str(n.target))


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def compare(before, after) -> str:
    """'' if every output is bit-identical, else where they differ."""
    a, b = _flat(before), _flat(after)
    if len(a) != len(b):
        return f"{len(a)} outputs before, {len(b)} after"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            return f"output {i}: {x.dtype}{list(x.shape)} {x.tolist()} != " \
                   f"{y.dtype}{list(y.shape)} {y.tolist()}"
    return ""


def cap_fn(cap_mb):
    """A cap callback from a number (every bucket) or a tuple (bucket i, the last repeats)."""
    if callable(cap_mb):
        return cap_mb
    if isinstance(cap_mb, tuple):
        return lambda i: cap_mb[min(i, len(cap_mb) - 1)]
    return lambda i: cap_mb


def conformance_case(spec: str, program: str, pass_name: str, cap_mb, dtype,
                     options: dict | None = None, program_args: dict | None = None) -> dict:
    """A conformance case on one rank: the backend's own API traces, its pass buckets."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    bucketing = backend.require("bucketing", pass_name)
    return trace_bucket_run(fc, bucketing, program, pass_name, cap_mb, dtype, options,
                            program_args)


def trace_bucket_run(fc, bucketing, program: str, pass_name: str, cap_mb, dtype,
                     options: dict | None = None, program_args: dict | None = None) -> dict:
    """On a rank: trace `program`, bucket a copy, run both for real; report the outcome."""
    fn, inputs = PROGRAMS[program](fc, dtype, **(program_args or {}))
    original = trace(fn, inputs)
    bucketed = trace(fn, inputs)
    caps = cap_fn(cap_mb)
    getattr(bucketing, pass_name)(bucketed, caps, **(options or {}))
    before = original(*inputs)
    after = bucketed(*inputs)
    return {
        "mismatch": compare(before, after),
        "collectives": (collective_count(original), collective_count(bucketed)),
        "canonical": canonical_graph(bucketed),
        "comm_trace": format_comm_trace(comm_trace_of_graph(bucketed)),
    }
