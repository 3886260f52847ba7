"""Bucketing programs: user programs with many small collectives, traced and run on ranks.

Each program is written against a functional-collectives namespace (`fc`: refimpl's or
upstream's), so every backend traces the same user code with its own API. On a rank,
`trace_bucket_run` traces the program with make_fx (fake tensors: no communication),
applies the backend's bucketing pass to a second trace, runs both graphs on real inputs
over the rank's gloo group and reports whether every output matches bit for bit, with
the canonical text and comm trace of the bucketed graph, the cap indices the pass asked
for and the FSDP blocks it tagged. Inputs are small integers, so sums over ranks are
exact in every dtype and any mismatch is a real error. Graphs no program can trace (a
padded reduce_scatter, bad arguments) are built by hand with the backend's own ops.

Shared by tests/test_bucketing.py and conformance/cases/test_bucketing.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from conformance import ops
from conformance.canonical import canonical_graph, op_name
from conformance.comm_trace import (
    comm_trace_of_graph,
    format_comm_trace,
    group_of_node,
    is_comm_op,
    reduce_op_of_node,
)
from conformance.oracle import rank_input, spread_input
from conformance.true_meta import MetaChecker

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
def fsdp_all_gather(fc, dtype, rows=(3, 5, 1, 4, 2, 6), cast=False, group=WORLD,
                    cast_read_again=False, independent=False, source=torch.float32,
                    read_again=0):
    """Params of uneven dim 0 gathered one by one, each used by compute after its wait.

    `cast`: each shard, of dtype `source` (a tuple: shard i of source[i]), is cast to
    `dtype` first (FSDP's mixed precision); with `cast_read_again` the cast of shard
    `read_again` (the first) is
    also returned, so it has a second reader; with `independent`, compute that reads no
    gathered value follows each gather.
    """
    pg = group_of(group)
    me = dist.get_rank()
    sources = source if isinstance(source, tuple) else (source,) * len(rows)
    shards = [rank_input(me, (r, 3), sources[i] if cast else dtype, salt=i)
              for i, r in enumerate(rows)]

    def step(*shards):
        outs = []
        for i, shard in enumerate(shards):
            x = shard.to(dtype) if cast else shard
            full = fc.all_gather_tensor(x, 0, pg)
            outs.append(full * 2 + 1)
            if cast_read_again and i == read_again:
                outs.append(x)
            if independent:
                outs.append(shard * 5)
        return outs

    return step, shards


def fsdp_reduce_scatter(fc, dtype, rows_per_rank=(1, 3, 2, 1), reduce_op="sum", group=WORLD,
                        spread=False):
    """Gradients computed one after another, each reduce-scattered on dim 0; with
    `spread`, of values whose sums round differently in another order (spread_input)."""
    pg = group_of(group)
    n = pg.size()
    me = dist.get_rank()
    draw = spread_input if spread else rank_input
    grads = [draw(me, (r * n, 2), dtype, salt=10 + i) for i, r in enumerate(rows_per_rank)]

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


def all_reduces(fc, dtype, reduce_op="sum", group=WORLD, spread=False):
    """Three all_reduces of small tensors; with `spread`, as fsdp_reduce_scatter's."""
    pg = group_of(group)
    me = dist.get_rank()
    draw = spread_input if spread else rank_input
    xs = [draw(me, shape, dtype, 60 + i) for i, shape in enumerate([(3,), (2, 2), (5, 1)])]

    def step(*xs):
        return [fc.all_reduce(x + 1, reduce_op, pg) * 2 for x in xs]

    return step, xs


def keyed(fc, dtype, kind="all_gather", members=((WORLD, torch.float32, "sum"),) * 2):
    """One collective of `kind` per member `(group, dtype, reduce op)`, in this order, each
    result returned after its wait: which members share a key decides the buckets (BK-2)."""
    me = dist.get_rank()
    calls = [(group_of(g), dt, op) for g, dt, op in members]
    xs = [rank_input(me, (2 * pg.size(), 2), dt, salt=100 + i)
          for i, (pg, dt, _) in enumerate(calls)]

    def step(*xs):
        outs = []
        for x, (pg, _, op) in zip(xs, calls, strict=True):
            if kind == "all_gather":
                outs.append(fc.all_gather_tensor(x, 0, pg))
            elif kind == "reduce_scatter":
                outs.append(fc.reduce_scatter_tensor(x, op, 0, pg))
            else:
                outs.append(fc.all_reduce(x, op, pg))
        return outs

    return step, xs


def upstream_namespace(fc, dtype, kind="all_gather"):
    """Three collectives of upstream's `_c10d_functional` on the world, called directly
    (not through `fc`), each waited by upstream's wait (BK-1: candidates of any backend)."""
    ops = torch.ops._c10d_functional
    me, n = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name
    xs = [rank_input(me, (2 * n, 2), dtype, salt=130 + i) for i in range(3)]

    def step(*xs):
        if kind == "all_gather":
            outs = [ops.all_gather_into_tensor(x, n, name) for x in xs]
        elif kind == "reduce_scatter":
            outs = [ops.reduce_scatter_tensor(x, "sum", n, name) for x in xs]
        else:
            outs = [ops.all_reduce(x, "sum", name) for x in xs]
        return [ops.wait_tensor(out) for out in outs]

    return step, xs


def upstream_waited_together(fc, dtype, kind="all_gather"):
    """torch 2.15's trace of coalesced waits: upstream collectives on the world, the first
    two waited by one `wait_tensors` (a wait of a list, FC-35), the last two each by its
    own `wait_tensor`. Only the last two are candidates (BK-1): one bucket of two, the
    first two left as they are."""
    from conformance.upstream_ops import wait_tensors

    ops = torch.ops._c10d_functional
    me, n = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name
    xs = [rank_input(me, (2 * n, 2), dtype, salt=140 + i) for i in range(4)]

    def issue(x):
        if kind == "all_gather":
            return ops.all_gather_into_tensor(x, n, name)
        if kind == "reduce_scatter":
            return ops.reduce_scatter_tensor(x, "sum", n, name)
        return ops.all_reduce(x, "sum", name)

    def step(*xs):
        together = wait_tensors()([issue(xs[0]), issue(xs[1])])
        return [*together, *(ops.wait_tensor(issue(x)) for x in xs[2:])]

    return step, xs


def cross_key_cycle(fc, dtype, other=((0, 1),)):
    """Two keys whose members feed each other: merging both would make a cycle (BK-4).

    Order: a1 (world), b1 (group `other`, the same ranks), b2 <- a1, a2 <- b1. Merging
    {a1, a2} needs b1 first; merging {b1, b2} needs a1 first; only one merge can be done.
    """
    world, second = dist.group.WORLD, group_of(other)
    me = dist.get_rank()
    xs = [rank_input(me, (2,), dtype, salt=70 + i) for i in range(2)]

    def step(x, y):
        a1 = fc.all_gather_tensor(x, 0, world)
        b1 = fc.all_gather_tensor(y, 0, second)
        b2 = fc.all_gather_tensor(a1[:2] * 2, 0, second)
        a2 = fc.all_gather_tensor(b1[:2] + 1, 0, world)
        return a1, b1, b2, a2

    return step, xs


def three_key_chain(fc, dtype):
    """X reaches Z only through the merge of Y, and a second member of X depends on Z (BK-4).

    x1 (X); y1, y2 <- x1 (Y: merged, it waits for x1); z1 <- y1, z2 (Z: merged, it waits
    for Y); x3 <- z2 only. Merging x3 with x1 would close the cycle X -> Y -> Z -> X,
    which no single node's inputs show: the pass must know that X reaches Z.
    """
    x_group, y_group, z_group = dist.group.WORLD, group_of(((0, 1),)), group_of(((1, 0),))
    me = dist.get_rank()
    # Each key's members have their own size (X 2, Y 3, Z 4): the trace shows which merged.
    xs = [rank_input(me, (n,), dtype, salt=120 + i) for i, n in enumerate((2, 3, 4))]

    def step(a, b, c):
        x1 = fc.all_gather_tensor(a, 0, x_group)
        y1 = fc.all_gather_tensor(b, 0, y_group)
        y2 = fc.all_gather_tensor(x1[:3] + 1, 0, y_group)
        z1 = fc.all_gather_tensor(y1[:4] * 2, 0, z_group)
        z2 = fc.all_gather_tensor(c, 0, z_group)
        x3 = fc.all_gather_tensor(z2[:2] - 1, 0, x_group)
        return x1, y2, z1, x3

    return step, xs


def with_out_variant(fc, dtype, group=WORLD):
    """Two all_gathers around an `all_gather_into_tensor_out`, which is no candidate (BK-1)."""
    pg = group_of(group)
    me, n = dist.get_rank(), pg.size()
    xs = [rank_input(me, (2, 2), dtype, salt=110 + i) for i in range(3)]

    def step(a, b, c):
        first = fc.all_gather_tensor(a, 0, pg)
        out = b.new_empty((2 * n, 2))
        fc.ops.wait_tensor(fc.ops.all_gather_into_tensor_out(b, n, pg.group_name, out=out))
        return first, out * 1, fc.all_gather_tensor(c, 0, pg)

    return step, xs


def waited_through_a_view(fc, dtype, group=WORLD):
    """Two all_gathers around one whose only user is a view, which the wait then reads:
    no candidate (BK-1: its only user must be the wait)."""
    pg = group_of(group)
    me, n = dist.get_rank(), pg.size()
    xs = [rank_input(me, (2, 2), dtype, salt=120 + i) for i in range(3)]

    def step(a, b, c):
        first = fc.all_gather_tensor(a, 0, pg)
        viewed = fc.ops.all_gather_into_tensor(b, n, pg.group_name).view(2 * n, 2)
        return first, fc.ops.wait_tensor(viewed) * 1, fc.all_gather_tensor(c, 0, pg)

    return step, xs


def waited_twice(fc, dtype, group=WORLD):
    """Two all_gathers around one waited twice: its first user is a wait, but not its only
    one, so it is no candidate (BK-1)."""
    pg = group_of(group)
    me, n = dist.get_rank(), pg.size()
    xs = [rank_input(me, (2, 2), dtype, salt=140 + i) for i in range(3)]

    def step(a, b, c):
        first = fc.all_gather_tensor(a, 0, pg)
        twice = fc.ops.all_gather_into_tensor(b, n, pg.group_name)
        return (first, fc.ops.wait_tensor(twice) * 1, fc.ops.wait_tensor(twice) * 2,
                fc.all_gather_tensor(c, 0, pg))

    return step, xs


def chain_of_waits(fc, dtype, group=WORLD):
    """One all_gather waited three times: a wait of a wait of a wait, and once more
    directly; one wait serves them all (BK-18)."""
    pg = group_of(group)
    me, n = dist.get_rank(), pg.size()
    xs = [rank_input(me, (2, 2), dtype, salt=160)]

    def step(a):
        gathered = fc.ops.all_gather_into_tensor(a, n, pg.group_name)
        chained = fc.ops.wait_tensor(fc.ops.wait_tensor(fc.ops.wait_tensor(gathered)))
        return chained + 1, fc.ops.wait_tensor(gathered) * 3

    return step, xs


def written_between_waits(fc, dtype, group=WORLD):
    """The result of a first wait is written in place before a second wait of the same
    all_gather: with a wait that returns a copy the second result is not the first one
    (BK-18); a backend whose wait aliases its argument sees the write in both."""
    pg = group_of(group)
    me, n = dist.get_rank(), pg.size()
    xs = [rank_input(me, (2, 2), dtype, salt=170)]

    def step(a):
        gathered = fc.ops.all_gather_into_tensor(a, n, pg.group_name)
        first = fc.ops.wait_tensor(gathered)
        first.mul_(2)
        return first + 0, fc.ops.wait_tensor(gathered) + 0

    return step, xs


def ops_on_transposed_views(fc, dtype, group=WORLD):
    """The ops themselves (the API copies its input first, the ops do not) on transposed
    views: dim 0 of each input is a column of the tensor in memory."""
    pg = group_of(group)
    n = pg.size()
    me = dist.get_rank()
    name = fc.resolve_group_name(pg)
    xs = [rank_input(me, (2, 2 * n), dtype, 60 + i) for i in range(2)] + \
        [rank_input(me, (3, 2), dtype, 62 + i) for i in range(2)]

    def step(a, b, c, d):
        scattered = [fc.ops.wait_tensor(fc.ops.reduce_scatter_tensor(t.t(), "sum", n, name))
                     for t in (a, b)]
        gathered = [fc.ops.wait_tensor(fc.ops.all_gather_into_tensor(t.t(), n, name))
                    for t in (c, d)]
        return [t + 1 for t in scattered + gathered]

    return step, xs


def pipeline_exchange(fc, dtype, kind="all_gather", group=WORLD):
    """Three collectives of `kind` on one group before, between and after a pipeline
    exchange on it: each rank receives from the group rank before it and sends to the one
    after, both issued before either wait (a ring completes, FC-52), by the op namespace
    (`fc.ops`). The three merge into one bucket where the last stood (BK-7), past the send
    and the receive, which are no candidates (BK-1) and keep their order: every rank
    issues receive, send, bucket."""
    ops_ = fc.ops
    if not hasattr(ops_, "isend"):
        from conformance.backends import NotImplementedConcept

        raise NotImplementedConcept(f"torch {torch.__version__} has no functional isend")
    pg = group_of(group)
    n, me = pg.size(), dist.get_group_rank(pg, dist.get_rank())
    xs = [rank_input(dist.get_rank(), (2 * n, 3), dtype, salt=140 + i) for i in range(3)]

    def collective(x):
        if kind == "all_gather":
            return fc.all_gather_tensor(x, 0, pg)
        if kind == "reduce_scatter":
            return fc.reduce_scatter_tensor(x, "sum", 0, pg)
        return fc.all_reduce(x, "sum", pg)

    def step(a, b, c):
        first = collective(a)
        received = ops_.irecv(torch.empty_like(c), (me - 1) % n, 0, pg.group_name)
        second = collective(b)
        sent = ops_.isend(c * 2, (me + 1) % n, 0, pg.group_name)
        third = collective(c)
        got = ops_.wait_tensor(received)
        ops_.wait_tensor(sent)
        return first * 2, second + 1, third + got.sum(), got

    return step, xs


# How the last summand of `summed_reduce_scatters` differs from the others, if it does.
SUMMAND_CHANGES = ("shape_broadcasts", "other_group", "max", "sum_and_avg", "other_dtype",
                   "read_again", "alpha")


def summed_reduce_scatters(fc, dtype, count=2, reduce_op="sum", group=WORLD, rows=2,
                           change=None, nan=False):
    """A gradient of `count` uses (FSDP's sum of partial gradients): each part
    reduce-scattered on its own, the waited results summed left to right (BK-26). `rows`
    per rank of every part (0: empty parts); `nan` puts a NaN in the first part of rank 0.
    `change` (SUMMAND_CHANGES) makes the last part a sum that one reduce_scatter of the
    summed parts would not give (BK-27): results that broadcast on dim 0 (parts of shape
    (n,) before one of (n, n), n the group size: the summed parts would broadcast on
    another dim), a group of other
    ranks (rows [[0, 2], [1, 3]] of 4 against [[0, 1], [2, 3]]), reduce op max on every
    part, avg beside sum, another dtype, a wait read again, an add with alpha 2."""
    pg = group_of(group)
    other = group_of([[0, 2], [1, 3]]) if change == "other_group" else pg
    me, n = dist.get_rank(), pg.size()
    shapes = [(rows * n, 3)] * count
    if change == "shape_broadcasts":  # results of shapes (1,) and (1, n): (1, n) summed
        shapes = [(n,)] * (count - 1) + [(n, n)]
    parts = [rank_input(me, shape, dtype, salt=200 + i) for i, shape in enumerate(shapes)]
    if change == "shape_broadcasts":  # each element its own sum: no two alike by chance
        parts[0] = parts[0] + 8 * torch.arange(n).to(dtype)
    if change == "other_dtype":
        parts[-1] = parts[-1].to(torch.float64 if dtype != torch.float64 else torch.float32)
    if nan and me == 0 and parts[0].numel():
        parts[0][0, 0] = float("nan")
    last_op = {"max": "max", "sum_and_avg": "avg"}.get(change, reduce_op)
    op_of = ["max" if change == "max" else reduce_op] * (count - 1) + [last_op]
    group_of_part = [pg] * (count - 1) + [other]

    def step(*xs):
        results = [fc.reduce_scatter_tensor(x, op, 0, g)
                   for x, op, g in zip(xs, op_of, group_of_part, strict=True)]
        total = results[0]
        for result in results[1:]:
            total = torch.add(total, result, alpha=2) if change == "alpha" else total + result
        return (total, results[0] * 1) if change == "read_again" else (total,)

    return step, parts


PROGRAMS = {f.__name__: f for f in (fsdp_all_gather, fsdp_reduce_scatter, interleaved, chain,
                                    mixed_dtypes, other_dims, all_reduces, keyed,
                                    cross_key_cycle, three_key_chain, with_out_variant,
                                    waited_through_a_view, ops_on_transposed_views,
                                    upstream_namespace, upstream_waited_together,
                                    waited_twice, chain_of_waits, written_between_waits,
                                    pipeline_exchange, summed_reduce_scatters)}


# --------------------------------------------------------------------------------------
# Tracing, bucketing and running on a rank
# --------------------------------------------------------------------------------------
def trace(fn, inputs) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*inputs)


def collective_count(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and is_comm_op(n.target)
               and not ops.is_wait(n))


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def _equal(x: torch.Tensor, y: torch.Tensor, nans_alike: bool) -> bool:
    if not nans_alike or not x.is_floating_point():
        return torch.equal(x, y)
    return torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(0.0),
                                                              y.nan_to_num(0.0))


def compare(before, after, *, nans_alike: bool = False) -> str:
    """'' if every output is bit-identical (with `nans_alike`, NaNs where NaNs were), else
    where they differ."""
    a, b = _flat(before), _flat(after)
    if len(a) != len(b):
        return f"{len(a)} outputs before, {len(b)} after"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.dtype != y.dtype or x.shape != y.shape or not _equal(x, y, nans_alike):
            return f"output {i}: {x.dtype}{list(x.shape)} {x.tolist()} != " \
                   f"{y.dtype}{list(y.shape)} {y.tolist()}"
    return ""


def cap_fn(cap_mb, asked: list | None = None):
    """A cap callback from a number (every bucket) or a tuple (bucket i, the last repeats);
    each index asked for is appended to `asked`."""
    if callable(cap_mb):
        return cap_mb

    def cap(i):
        if asked is not None:
            asked.append(i)
        if isinstance(cap_mb, tuple):
            return cap_mb[min(i, len(cap_mb) - 1)]
        return cap_mb

    return cap


def block_runs(gm: torch.fx.GraphModule) -> list[str]:
    """Consecutive nodes by their `refimpl_block` tag (BK-17): `kind index: op op ...`,
    untagged nodes as `- count`."""
    runs: list[tuple[object, list[str]]] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        tag = node.meta.get("refimpl_block")
        if not runs or runs[-1][0] != tag:
            runs.append((tag, []))
        name = op_name(node.target).split(".") if node.op == "call_function" else [node.op]
        runs[-1][1].append(name[min(1, len(name) - 1)])  # aten.empty.memory_format: empty
    return [f"{tag[0]} {tag[1]}: {' '.join(ops)}" if tag else f"- {len(ops)}"
            for tag, ops in runs]


def conformance_case(spec: str, program: str, pass_name: str, cap_mb, dtype,
                     options: dict | None = None, program_args: dict | None = None,
                     again_cap_mb=None) -> dict:
    """A conformance case on one rank: the backend's own API traces, its pass buckets."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    bucketing = backend.require("bucketing", pass_name)
    return trace_bucket_run(fc, bucketing, program, pass_name, cap_mb, dtype, options,
                            program_args, again_cap_mb)


def trace_bucket_run(fc, bucketing, program: str, pass_name: str, cap_mb, dtype,
                     options: dict | None = None, program_args: dict | None = None,
                     again_cap_mb=None) -> dict:
    """On a rank: trace `program`, bucket a copy, run both for real; report the outcome.
    With `again_cap_mb` the pass runs a second time on its own result, with that cap."""
    traced = _trace_and_bucket(fc, bucketing, program, pass_name, cap_mb, dtype, options,
                               program_args, again_cap_mb)
    return _run_and_report(*traced)


def _trace_and_bucket(fc, bucketing, program: str, pass_name: str, cap_mb, dtype,
                      options: dict | None = None, program_args: dict | None = None,
                      again_cap_mb=None) -> tuple:
    fn, inputs = PROGRAMS[program](fc, dtype, **(program_args or {}))
    original = trace(fn, inputs)
    bucketed = trace(fn, inputs)
    asked: list[int] = []
    getattr(bucketing, pass_name)(bucketed, cap_fn(cap_mb, asked), **(options or {}))
    if again_cap_mb is not None:
        getattr(bucketing, pass_name)(bucketed, cap_fn(again_cap_mb), **(options or {}))
    return original, bucketed, inputs, asked


def _run_and_report(original, bucketed, inputs, asked) -> dict:
    before = original(*[t.clone() for t in inputs])
    recorder = _SlotRecorder(bucketed)
    after = recorder.run(*[t.clone() for t in inputs])
    return {
        "mismatch": compare(before, after),
        "collectives": (collective_count(original), collective_count(bucketed)),
        "canonical": canonical_graph(bucketed),
        "unchanged": canonical_graph(bucketed) == canonical_graph(original),
        "comm_trace": format_comm_trace(comm_trace_of_graph(bucketed)),
        "asked": asked,
        "blocks": block_runs(bucketed),
        "slots": recorder.slots,
        "untrue_meta": recorder.report(),
    }


def issued_by_group(gm: torch.fx.GraphModule) -> dict[str, list[str]]:
    """Each group's collectives in the order the graph issues them, as every rank of the
    group must issue them to meet: op, reduce op, each tensor's dtype and shape."""
    issued: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not is_comm_op(node.target) or ops.is_wait(node):
            continue
        group = group_of_node(node)
        tensors = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
        shapes = [f"{t.dtype}{list(t.shape)}" for t in torch.utils._pytree.tree_leaves(tensors)
                  if isinstance(t, torch.Tensor)]
        issued.setdefault(group, []).append(
            " ".join([op_name(node.target), reduce_op_of_node(node), *shapes]))
    return issued


def unmatched_issues(every: list[dict[str, list[str]]]) -> str:
    """"" when the ranks of every group issue one sequence of collectives (`every`: each
    rank's issued_by_group), else where they differ (ranks that bucketed differently: a
    real run would hang, or fail in the backend)."""
    found = []
    for group in sorted({g for issued in every for g in issued}):
        if not group.startswith("ranks["):  # a group the rank cannot resolve
            continue
        ranks = [int(r) for r in group[len("ranks["):-1].split(",")]
        sequences = {r: every[r].get(group, []) for r in ranks}
        if len({repr(seq) for seq in sequences.values()}) > 1:
            found.append(f"group {group}: " + "; ".join(
                f"rank {r} issues {seq}" for r, seq in sequences.items()))
    return "\n".join(found)


def per_rank_caps_case(spec: str, program: str, pass_name: str, caps_by_rank, dtype,
                       program_args_by_rank=None, options: dict | None = None) -> dict:
    """On a rank: `program` bucketed with this rank's own caps (caps_by_rank[rank] in MiB,
    a tuple as cap_fn's, or "raise": a cap function that raises), run for real only when
    every rank bucketed and every group's ranks issue one sequence (BK-24). Else
    {"refused": (error type, message)} where the backend's pass raised, {"unmatched": ...}
    or {"peers_refused": ranks} elsewhere (nothing runs: it would hang)."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    bucketing = backend.require("bucketing", pass_name)
    me = dist.get_rank()
    caps = caps_by_rank[me]
    if caps == "raise":
        def caps(index):
            raise LookupError(f"no profile of global rank {me} for bucket {index}")
    program_args = program_args_by_rank[me] if program_args_by_rank else None
    try:
        traced, refused = _trace_and_bucket(fc, bucketing, program, pass_name, caps, dtype,
                                            options, program_args=program_args), None
    except Exception as exc:  # a refusal is a verdict, reported with its type
        traced, refused = None, (type(exc).__name__, str(exc))
    every: list = [None] * dist.get_world_size()  # every rank comes, even one that raised
    dist.all_gather_object(every, None if refused else issued_by_group(traced[1]))
    if refused:
        return {"refused": refused}
    if None in every:
        return {"peers_refused": [r for r, issued in enumerate(every) if issued is None]}
    unmatched = unmatched_issues(every)
    if unmatched:
        return {"unmatched": unmatched, "asked": traced[3]}
    return {**_run_and_report(*traced), "issued": every[me]}


def point_to_point_stage_alone(spec: str) -> tuple:
    """On a rank: rank 0 alone buckets a pipeline stage's graph that only sends (its peer
    compiles another graph, or none): ("bucketed", collectives after) or the error it
    raised; the other ranks do nothing. No collective of a group is in it, so nothing
    is there to agree on with other ranks (BK-24)."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    bucketing = backend.require("bucketing", "bucket_all_gather")
    if dist.get_rank() != 0:
        return ("idle",)
    if not hasattr(fc.ops, "isend"):
        from conformance.backends import NotImplementedConcept

        raise NotImplementedConcept(f"torch {torch.__version__} has no functional isend")
    world = dist.group.WORLD.group_name

    def stage(a, b):
        first = fc.ops.isend(a * 2, 1, 0, world)
        second = fc.ops.isend(b + 1, 1, 1, world)
        return fc.ops.wait_tensor(first), fc.ops.wait_tensor(second)

    gm = trace(stage, [torch.ones(4), torch.ones(4)])
    try:
        bucketing.bucket_all_gather(gm, cap_fn(25))
    except Exception as exc:  # the case judges it
        return (type(exc).__name__, str(exc))
    return ("bucketed", collective_count(gm))


class _SlotRecorder(MetaChecker):
    """Runs a graph and records where each `all_gather_into_tensor_out` reads its input
    within `out`: (offset in elements, elements), this rank's slot (BK-8); and each node
    whose `meta["val"]` is not what it computed (BK-7)."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.slots: list[tuple[int, int]] = []

    def call_function(self, target, args, kwargs):
        row = ops.find(target)
        if row is not None and row.kind == "all_gather" and row.out:
            inp, out = args[0], kwargs["out"]
            offset = (inp.data_ptr() - out.data_ptr()) // max(inp.element_size(), 1)
            self.slots.append((offset, inp.numel()))
        return super().call_function(target, args, kwargs)


# --------------------------------------------------------------------------------------
# Hand-built graphs: what no traced program holds
# --------------------------------------------------------------------------------------
def _graph_of_calls(fc, calls, mode) -> torch.fx.GraphModule:
    """A graph of `(op name, input shape, output shape, args after the input)` calls on
    placeholders, each followed by its wait, returning every wait."""
    graph = torch.fx.Graph()
    outs = []
    for i, (name, in_shape, out_shape, rest) in enumerate(calls):
        x = graph.placeholder(f"x{i}")
        x.meta["val"] = mode.from_tensor(torch.empty(in_shape))
        node = graph.call_function(getattr(fc.ops, name).default, (x, *rest))
        node.meta["val"] = mode.from_tensor(torch.empty(out_shape))
        wait = graph.call_function(fc.ops.wait_tensor.default, (node,))
        wait.meta["val"] = node.meta["val"]
        outs.append(wait)
    graph.output(outs)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def padded_reduce_scatter(spec: str, shapes, options: dict | None = None) -> dict:
    """On a rank: reduce_scatters whose dim 0 does not divide by the group size, bucketed.

    No traced program holds one (the op refuses it, FC-20), so the graph is built by hand
    with FSDP's meaning: rank i receives chunk i of torch.chunk(sum, group size) (BK-10).
    """
    from torch._subclasses import FakeTensorMode

    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    bucketing = backend.require("bucketing", "bucket_reduce_scatter")
    n, me, name = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    calls = [("reduce_scatter_tensor", shape, (-(-shape[0] // n), *shape[1:]), ("sum", n, name))
             for shape in shapes]
    gm = _graph_of_calls(fc, calls, FakeTensorMode())
    bucketing.bucket_reduce_scatter(gm, cap_fn(25), **(options or {}))
    inputs = [rank_input(me, s, torch.float32, salt=80 + i) for i, s in enumerate(shapes)]
    checker = MetaChecker(gm)
    got = [t.clone() for t in checker.run(*inputs)]
    return {"got": got, "collectives": collective_count(gm), "untrue_meta": checker.report(),
            "comm_trace": format_comm_trace(comm_trace_of_graph(gm))}


W = "WORLD"  # stands for the default group's name, known only on the rank
BAD_GRAPHS = {
    # name: (op, input shape, output shape, good args, bad args (after the input), the
    # argument the error must name)
    "unknown_reduce_op": ("reduce_scatter_tensor", (4,), (2,), ("sum", 2, W),
                          ("median", 2, W), "reduce_op"),
    "group_size_too_large": ("all_gather_into_tensor", (4,), (12,), (2, W), (3, W),
                             "group_size"),
    "group_size_too_small": ("all_gather_into_tensor", (4,), (4,), (2, W), (1, W),
                             "group_size"),
    "missing_argument": ("all_gather_into_tensor", (4,), (8,), (2, W), (2,), "group_name"),
    "unknown_group": ("all_reduce", (4,), (4,), ("sum", W), ("sum", "no-such-group"),
                      "group_name"),
    "no_fake_value": ("all_gather_into_tensor", (4,), (8,), (2, W), (2, W), "meta['val']"),
}
def bad_graph(spec: str, name: str) -> tuple[str, str, str]:
    """On a rank: bucket two candidates of which the second is bad (BK-1, BK-16);
    (exception type, message, the bad node's name), or ("no error", "", ...)."""
    from torch._subclasses import FakeTensorMode

    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    op, in_shape, out_shape, good, bad, _ = BAD_GRAPHS[name]
    bucket = "bucket_" + ops.row(getattr(fc.ops, op)).family  # the pass of its kind
    bucketing = backend.require("bucketing", bucket)
    world = dist.group.WORLD.group_name
    calls = [(op, in_shape, out_shape, tuple(world if a == W else a for a in args))
             for args in (good, bad)]
    gm = _graph_of_calls(fc, calls, FakeTensorMode())
    bad = [n for n in gm.graph.nodes if n.op == "call_function"][2]
    if name == "no_fake_value":
        del bad.meta["val"]
    try:
        getattr(bucketing, bucket)(gm, cap_fn(25))
    except Exception as exc:  # the case judges the type and the message
        return type(exc).__name__, str(exc), bad.name
    return "no error", "", bad.name


def symbolic_candidates(spec: str, shape: tuple) -> tuple[str, str, str]:
    """On a rank: bucket two all_gathers of a graph traced with symbolic sizes (dims of
    size 1 stay static, so `(4, 1)` gives a shape of one symbol and one int); (exception
    type, message, the first candidate's name), or ("no error", "", ...) (BK-1)."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    bucketing = backend.require("bucketing", "bucket_all_gather")
    name, size = fc.resolve_group_name(dist.group.WORLD), dist.get_world_size()

    def two_gathers(a, b):
        return [fc.ops.wait_tensor(fc.ops.all_gather_into_tensor(t, size, name))
                for t in (a, b)]

    gm = make_fx(two_gathers, tracing_mode="symbolic")(torch.ones(shape), torch.ones(shape))
    first = next(n for n in gm.graph.nodes if "all_gather" in str(n.target))
    try:
        bucketing.bucket_all_gather(gm, cap_fn(25))
    except Exception as exc:  # the case judges the type and the message
        return type(exc).__name__, str(exc), first.name
    return "no error", "", first.name


BAD_ARGUMENTS = {
    # name: (pass, the error, the argument it must name)
    "not_a_graph_module": ("bucket_all_gather", "TypeError", "gm"),
    "cap_not_callable": ("bucket_all_gather", "TypeError", "bucket_cap_mb_by_bucket_idx"),
    "cap_zero": ("bucket_all_gather", "ValueError", "bucket_cap_mb_by_bucket_idx"),
    "cap_nan": ("bucket_reduce_scatter", "ValueError", "bucket_cap_mb_by_bucket_idx"),
    "cap_true": ("bucket_all_gather", "ValueError", "bucket_cap_mb_by_bucket_idx"),
    "cap_string": ("bucket_all_reduce", "ValueError", "bucket_cap_mb_by_bucket_idx"),
    "mixed_dtypes_reduce_scatter": ("bucket_reduce_scatter", "ValueError", "mixed_dtypes"),
    "mixed_dtypes_all_reduce": ("bucket_all_reduce", "ValueError", "mixed_dtypes"),
    "agreement_not_a_bool": ("bucket_all_reduce", "TypeError", "agree_across_ranks"),
    "coalesced_not_a_bool": ("bucket_reduce_scatter", "TypeError", "coalesced"),
}


def bad_arguments(spec: str) -> dict:
    """On a rank: {name: (exception type, message)} of each call of BAD_ARGUMENTS."""
    from conformance.harness import NotImplementedConcept, backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    bucketing = backend.require("bucketing")
    calls = {
        "not_a_graph_module": lambda gm: (torch.nn.Linear(2, 2), cap_fn(25)),
        "cap_not_callable": lambda gm: (gm, 25),
        "cap_zero": lambda gm: (gm, cap_fn(0)),
        "cap_nan": lambda gm: (gm, cap_fn(float("nan"))),
        "cap_true": lambda gm: (gm, cap_fn(True)),  # a bool is no number of MiB
        "cap_string": lambda gm: (gm, cap_fn("25")),
        "mixed_dtypes_reduce_scatter": lambda gm: (gm, cap_fn(25)),
        "mixed_dtypes_all_reduce": lambda gm: (gm, cap_fn(25)),
        "agreement_not_a_bool": lambda gm: (gm, cap_fn(25)),
        "coalesced_not_a_bool": lambda gm: (gm, cap_fn(25)),
    }
    outcomes = {}
    for name, (pass_name, _, _) in BAD_ARGUMENTS.items():
        program = "fsdp_reduce_scatter" if "reduce" in pass_name else "fsdp_all_gather"
        if pass_name == "bucket_all_reduce":
            program = "all_reduces"
        fn, inputs = PROGRAMS[program](fc, torch.float32)
        options = {"mixed_dtypes": True} if name.startswith("mixed") else {}
        if name == "agreement_not_a_bool":  # a name where a bool belongs (BK-24)
            options = {"agree_across_ranks": "yes"}
        if name == "coalesced_not_a_bool":  # BK-25
            options = {"coalesced": "yes"}
        try:
            getattr(bucketing, pass_name)(*calls[name](trace(fn, inputs)), **options)
            outcomes[name] = ("no error", "")
        except NotImplementedConcept as exc:
            outcomes[name] = ("not implemented", str(exc))
        except Exception as exc:  # the case judges the type and the message
            outcomes[name] = (type(exc).__name__, str(exc))
    return outcomes


def wait_count(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if ops.is_wait(n))


def _pass_on_a_copy(spec: str, pass_name: str, make_program) -> tuple:
    """On a rank: `make_program(fc)`'s program traced twice, the backend's bucketing pass
    `pass_name` run on the second trace; (original, rewritten, what the pass returned,
    the original's outputs, the rewritten's), both run for real on clones of the inputs."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    passes = backend.require("bucketing", pass_name)
    fn, inputs = make_program(fc)
    original, rewritten = trace(fn, inputs), trace(fn, inputs)
    returned = getattr(passes, pass_name)(rewritten)
    return (original, rewritten, returned, original(*[t.clone() for t in inputs]),
            rewritten(*[t.clone() for t in inputs]))


def deduplicated(spec: str, program: str) -> dict:
    """On a rank: trace `program`, run the backend's `deduplicate_waits` on a copy, run
    both for real (BK-18)."""
    original, deduped, removed, before, after = _pass_on_a_copy(
        spec, "deduplicate_waits", lambda fc: PROGRAMS[program](fc, torch.float32))
    return {"mismatch": compare(before, after), "removed": removed,
            "waits": (wait_count(original), wait_count(deduped)),
            "collectives": (collective_count(original), collective_count(deduped))}


def reduce_scatter_count(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes
               if n.op == "call_function" and op_name(n.target).split(".")[1:2] == [
                   "reduce_scatter_tensor"])


def summed_once(spec: str, dtype, program_args: dict) -> dict:
    """On a rank: trace `summed_reduce_scatters`, run the backend's
    `dedup_fsdp_reduce_scatter` on a copy, run both for real (BK-26, BK-27): whether the
    values are bit for bit the original's (NaN where NaN), the reduce_scatters before and
    after, what the pass returned and the collectives each group issues after it."""
    original, summed, removed, before, after = _pass_on_a_copy(
        spec, "dedup_fsdp_reduce_scatter",
        lambda fc: summed_reduce_scatters(fc, dtype, **program_args))
    return {"mismatch": compare(before, after, nans_alike=True), "removed": removed,
            "reduce_scatters": (reduce_scatter_count(original), reduce_scatter_count(summed)),
            "issued": issued_by_group(summed)}


# The graphs of 2.15's modes (BK-25, BK-26): a program and the pass that makes the mode's
# graph of it, on the backend's bucketing concept.
MODES = {
    "coalesced": ("fsdp_reduce_scatter", {},
                  lambda passes, gm: passes.bucket_reduce_scatter(gm, cap_fn(25), coalesced=True)),
    "dedup": ("summed_reduce_scatters", {"count": 3},
              lambda passes, gm: passes.dedup_fsdp_reduce_scatter(gm)),
}


def later_stages(backend, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, dict]:
    """`gm` through the backend's lowering (its default config), then its reorder (no
    memory bound), as its compiler runs them; and what the final graph's memory plan and
    simulated timeline hold of the collectives it issues: (final graph, {"issued",
    "simulated", "unplanned": issued collectives the plan allocates nothing at})."""
    lowering = backend.require("lowering", "lower")
    reorder = backend.require("reorder")
    memory, simulator = backend.require("memory"), backend.require("simulator")
    gm = reorder.reorder(lowering.lower(gm, lowering.Config()),
                         reorder.ReorderConfig(memory_budget=None))
    issued = sorted(n.name for n in gm.graph.nodes if n.op == "call_function"
                    and is_comm_op(n.target) and not ops.is_wait(n))
    allocated = {e.buffer.alloc_node.name for e in memory.plan_memory(gm).events
                 if e.kind == "alloc"}
    simulated = sorted(c.node.name for c in simulator.simulate(gm).collectives)
    return gm, {"issued": issued, "simulated": simulated,
                "unplanned": sorted(set(issued) - allocated)}


def through_later_stages(spec: str, mode: str, dtype) -> dict:
    """On a rank: the mode's graph through the backend's later stages (later_stages), run
    for real against the traced program."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    passes = backend.require("bucketing", "dedup_fsdp_reduce_scatter" if mode == "dedup"
                             else "bucket_reduce_scatter")
    program, args, make_mode = MODES[mode]
    fn, inputs = PROGRAMS[program](fc, dtype, **args)
    original, gm = trace(fn, inputs), trace(fn, inputs)
    make_mode(passes, gm)
    gm, held = later_stages(backend, gm)
    before = original(*[t.clone() for t in inputs])
    after = gm(*[t.clone() for t in inputs])
    return {"mismatch": compare(before, after), **held}


def log_records(spec: str) -> list:
    """On a rank: (logger, level, message) of everything logged while two passes run (BK-15)."""
    import logging

    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    bucketing = backend.require("bucketing", "bucket_all_gather", "bucket_reduce_scatter")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.name, record.levelname, record.getMessage()))

    handler = Keep(level=logging.DEBUG)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        trace_bucket_run(fc, bucketing, "chain", "bucket_all_gather", 25, torch.float32)
        trace_bucket_run(fc, bucketing, "fsdp_reduce_scatter", "bucket_reduce_scatter", 25,
                         torch.float32)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    return [r for r in records if "bucket" in r[0] or "bucket" in r[2]]
