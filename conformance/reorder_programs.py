"""Programs of the reorder cases (SPEC section 4, RO), and what runs them on a rank.

Each program is `program(ops, ctx, *inputs)`, written against a functional-collectives op
namespace (`torch.ops.refimpl_c10d` or upstream's `torch.ops._c10d_functional`); `ctx`
names the world group ("0", WORLD under the fake process group and under gloo), its size,
and a second group `sub` (each rank's pair of `[[0, 1], [2, 3]]` on 4 ranks, a second group
of `[0, 1]` on 2). Input shapes follow the world size so that every all_gather returns 8
rows. `program_graph(name, ops)` traces one with make_fx on fake values and, for the
"bucketed" and "lowered" programs, applies refimpl's bucketing or lowering on top: those
are inputs of the cases, never their expectation.

`pinned_costs(gm)` pins every node's duration by a rule (a collective 30 us, a matmul
20 us, any other compute 1 us, views and waits 0), so that golden orders depend on no
profile. `CASES` lists the (program, config) pairs every case runs.

`record_` (op `refimpl_conformance::record_`) is the opaque side-effecting op: it appends
the sum of its argument to a log of the process and is a barrier (RO-6).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from conformance import ops
from conformance.oracle import rank_input, spread_input
from conformance.true_meta import MetaChecker

RECORDED: list[float] = []  # what record_ saw, in this process


@torch.library.custom_op("refimpl_conformance::record_", mutates_args=("x",))
def record_(x: torch.Tensor) -> None:
    """Side effect only: log x's sum (a barrier to the reorder pass, RO-6)."""
    RECORDED.append(float(x.sum()))


@torch.library.custom_op("refimpl_conformance::note", mutates_args=())
def note(x: torch.Tensor) -> None:
    """Writes nothing and returns nothing: it is there for its side effect (it logs x's
    sum), so it is a barrier too (RO-6)."""
    RECORDED.append(float(x.sum()))


@note.register_fake
def _(x):
    return None


@dataclass(frozen=True)
class Ctx:
    n: int  # world size
    world: str  # WORLD's group name
    sub: str  # the second group's name
    sub_n: int


_SUBGROUPS: dict = {}


def context() -> Ctx:
    """The groups of this process (a fake world of 4 in the case process, gloo in ranks);
    the second group is made once per default group, by every rank together."""
    world = dist.group.WORLD
    if world not in _SUBGROUPS:
        n = dist.get_world_size()
        rows = [[0, 1], [2, 3]] if n == 4 else [list(range(n))]
        _SUBGROUPS[world], _ = dist.new_subgroups_by_enumeration(rows)
    sub = _SUBGROUPS[world]
    return Ctx(world.size(), world.group_name, sub.group_name, sub.size())


def _wait(ops, t):
    return ops.wait_tensor(t)


def _gather(ops, ctx, x, group=None, n=None):
    return _wait(ops, ops.all_gather_into_tensor(x, n or ctx.n, group or ctx.world))


# --------------------------------------------------------------------------------------
# Programs
# --------------------------------------------------------------------------------------
def fsdp_forward(ops, ctx, x, *shards):
    """4 FSDP layers: each shard cast to bf16 (the prologue), gathered to [8, 8], used."""
    h = x
    for shard in shards:
        w = _gather(ops, ctx, shard.to(torch.bfloat16))
        h = torch.relu(h @ w.float())
    return h


def fsdp_forward_params(ops, ctx, x, *params):
    """4 FSDP layers of a weight and a bias each: bucketing's input (one bucket a layer)."""
    h = x
    for weight, bias in zip(params[::2], params[1::2], strict=True):
        w = _gather(ops, ctx, weight.to(torch.bfloat16)).float()
        b = _gather(ops, ctx, bias.to(torch.bfloat16)).float()
        h = torch.relu(h @ w + b)
    return h


def fsdp_backward(ops, ctx, g, *acts_and_weights):
    """The backward of 4 layers: each weight gradient reduce-scattered; the waits are
    only returned, so nothing in the graph needs them."""
    acts, weights = acts_and_weights[:4], acts_and_weights[4:]
    grads = []
    for act, weight in zip(reversed(acts), reversed(weights), strict=True):
        grad_w = act.t() @ g
        g = g @ weight.t()
        grads.append(_wait(ops, ops.reduce_scatter_tensor(grad_w, "sum", ctx.n, ctx.world)))
    return g, *grads


def mutated_buffer(ops, ctx, x, y):
    """all_reduce_ on a buffer read before it, read after its wait (through the buffer's
    own node: FC-5), then mutated and read again; a gather of `y`, which `y.mul_` may
    only change after the gather's wait (MEM-5), though nothing needs that wait."""
    buf = x * 2
    before = buf.sum()                                  # reads version 0
    done = _wait(ops, ops.all_reduce_(buf, "sum", ctx.world))
    gathered = _gather(ops, ctx, y)                     # reads y until its wait
    other = (y + 1) * 3                                 # independent
    after = buf * 3                                     # reads version 1 (after the wait)
    buf.add_(1)                                         # makes version 2
    y.mul_(2)                                           # makes y's version 1
    return before, done, gathered, other, after, buf * 4, y * 1


def shared_all_reduce(ops, ctx, x, y):
    """all_reduce of an intermediate read again later: lowering clones it (CL-2), and the
    clone is the collective's prologue."""
    a = x * 2
    b = (y + 1) * 3                                     # independent
    total = _wait(ops, ops.all_reduce(a, "sum", ctx.world))
    return total + a + b


def two_groups(ops, ctx, a, b, c, d):
    """World and sub collectives: sub's may pass world's; world's keep their order, of
    whatever kind."""
    t = a * 2
    ga = _gather(ops, ctx, t)                           # world, input computed
    gb = _gather(ops, ctx, b, ctx.sub, ctx.sub_n)       # sub, input ready at the start
    gc = _gather(ops, ctx, c)                           # world, input ready at the start
    rd = _wait(ops, ops.reduce_scatter_tensor(d, "sum", ctx.n, ctx.world))  # world, ready
    return ga + 1, gb + 1, gc * 2, rd


def opaque_op(ops, ctx, x, s1, s2):
    """A side-effecting op nobody models: the first wait stays before it, the second
    collective after it, though data would let both move."""
    a = x * 2
    g1 = _gather(ops, ctx, s1)
    torch.ops.refimpl_conformance.record_(a)
    g2 = _gather(ops, ctx, s2)
    return g1 + 1, g2 + 1, a + 1


def two_barriers(ops, ctx, x, s1, s2, s3):
    """Three gathers between two opaque ops (one writes its argument, one returns
    nothing): every node stays on its side of each, though data would let the waits
    sink and the gathers rise past both."""
    a = x * 2
    g1 = _gather(ops, ctx, s1)
    torch.ops.refimpl_conformance.record_(a)
    g2 = _gather(ops, ctx, s2)
    torch.ops.refimpl_conformance.note(a + 1)
    g3 = _gather(ops, ctx, s3)
    return g1 + 1, g2 + 1, g3 + 1, a + 1


def side_effectful_aten(ops, ctx, x, s1, s2):
    """An ATen op registered as side-effectful (an assertion) between two gathers: a
    barrier though it is ATen and returns nothing a later node reads (RO-6)."""
    a = x * 2
    g1 = _gather(ops, ctx, s1)
    torch.ops.aten._assert_async.msg(a.sum() > -1e30, "a sum of -1e30 or less")
    g2 = _gather(ops, ctx, s2)
    return g1 + 1, g2 + 1, a + 1


def shared_prologue(ops, ctx, x, y):
    """One clone read by the all_reduces of two groups: a block of its own, in neither's
    prologue (RO-7); once it ran, the sub group's all_reduce, first in the program, is
    issued first."""
    a = x * 2
    c = y.clone()
    r1 = _wait(ops, ops.all_reduce(c, "sum", ctx.sub))
    b = a * 3
    r2 = _wait(ops, ops.all_reduce(c, "sum", ctx.world))
    return r1 + b, r2 + 1


def limit_per_group(ops, ctx, x, s1, s2, t1, t2):
    """Two gathers on each of two groups, with one all_gather in flight allowed: the limit
    counts per group (RO-8), so a world gather and a sub gather may be in flight at once."""
    h = x
    for s, t in ((s1, t1), (s2, t2)):
        gw = _gather(ops, ctx, s)
        gs = _gather(ops, ctx, t, ctx.sub, ctx.sub_n)
        h = h * 2 + gw.sum() + gs.sum()
    return h


def blocking_then_gather(ops, ctx, x, s):
    """A small all_reduce, lowered one-shot (a blocking kernel), then a gather of the same
    group whose input is ready at the start: it may not pass the kernel (RO-5)."""
    r = _wait(ops, ops.all_reduce(x * 2, "sum", ctx.world))
    g = _gather(ops, ctx, s)
    return r + 1, g * 2


def gather_then_blocking(ops, ctx, x, s):
    """A gather waited at once, then a small all_reduce lowered one-shot (a blocking
    kernel): the kernel is no barrier (RO-6), so the gather's wait may sink past it and
    the gather overlap the kernel; only their issue order is kept (RO-5)."""
    g = _gather(ops, ctx, s)
    r = _wait(ops, ops.all_reduce(x * 2, "sum", ctx.world))
    return r + 1, g * 2


def broadcasts_and_an_all_reduce(ops, ctx, x, s1, s2, s3):
    """Two broadcasts and an all_reduce of one group, each waited at once, compute
    between: with one broadcast in flight allowed, the broadcasts never overlap each
    other; the all_reduce is another kind (RO-8), which that limit does not count."""
    h = x
    for s in (s1, s2):
        h = h * 2 + _wait(ops, ops.broadcast(s * 1, 0, ctx.world)).sum()
    return h * 2 + _wait(ops, ops.all_reduce(s3 * 1, "sum", ctx.world)).sum()


def gathers_first(ops, ctx, x, s1, s2, s3):
    """Every gather issued before any wait: the original order itself has three
    all_gathers in flight (RO-9's exception when a limit is set)."""
    # `s * 1`: each gather gets a prologue of its own, which a pass may move with it
    pending = [ops.all_gather_into_tensor(s * 1, ctx.n, ctx.world) for s in (s1, s2, s3)]
    h = x
    for t in pending:
        h = h * _wait(ops, t)
    return h


def gathers_after_a_shared_wait(ops, ctx, x, s):
    """A sub-group gather's result read by a cast and by a world gather's prologue, while
    an earlier world gather is in flight and its wait is needed by no node (sunk, RO-11).
    Placing the shared wait for the cast makes the world gather a raise held back by the
    limit (RO-8, RO-10), not compute to fill in with past it."""
    t = (s * 2).to(torch.bfloat16)
    pending = ops.all_gather_into_tensor(t, ctx.n, ctx.world)
    w = _gather(ops, ctx, t, ctx.sub, ctx.sub_n)
    done = _wait(ops, pending)
    half = w.to(torch.float16)
    world = _gather(ops, ctx, w.to(torch.float32))
    return x * 2, done, half, world


def waited_together(ops, ctx, x, s1, s2, g1, g2):
    """torch 2.15's trace of a coalesced wait (FC-35), upstream's ops whatever `ops` is: a
    coalesced all_gather of two shards and a reduce_scatter of a gradient, all three
    results waited by one `wait_tensors`, which only the end reads; compute that needs
    none of them; then a second reduce_scatter. The one wait completes both collectives
    (MEM-5): with one reduce_scatter in flight, the second is issued only after it (RO-8);
    unlimited, it is raised above it (RO-10)."""
    from conformance.upstream_ops import wait_tensors

    up = torch.ops._c10d_functional
    pending = [*up.all_gather_into_tensor_coalesced([s1, s2], ctx.n, ctx.world),
               up.reduce_scatter_tensor(g1, "sum", ctx.n, ctx.world)]
    first, second, third = wait_tensors()(pending)
    h = x * 2
    for _ in range(3):
        h = h + 1
    fourth = _wait(up, up.reduce_scatter_tensor(g2, "sum", ctx.n, ctx.world))
    return first + h.sum(), second + 1, third + 1, fourth + 1


def pipeline_stage(ops, ctx, x, w, s):
    """A pipeline stage with sharded weights: receive the activation from the rank before,
    gather the weight, send this rank's input on to the rank after (all issued before any
    wait: a ring completes), an independent matmul, then the waits and the layer. The
    receive, the gather and the send share the world group: every rank issues them in
    this order (RO-5; a gather raised above the receive on one rank deadlocks NCCL, whose
    group runs its operations in issue order)."""
    if not hasattr(ops, "isend"):
        from conformance.backends import NotImplementedConcept

        raise NotImplementedConcept(f"torch {torch.__version__} has no functional isend")
    me = dist.get_rank()  # the world's group ranks are its global ranks
    received = ops.irecv(torch.empty_like(x), (me - 1) % ctx.n, 0, ctx.world)
    gathered = ops.all_gather_into_tensor(w, ctx.n, ctx.world)
    sent = ops.isend(x * 2, (me + 1) % ctx.n, 0, ctx.world)
    m = s @ s.t()
    h = _wait(ops, received)
    y = torch.relu(h @ _wait(ops, gathered))
    _wait(ops, sent)
    return y, m


def two_groups_by_cost(ops, ctx, a, b, w1, w2):
    """A weight gathered on each group (world, then sub), each feeding a matmul whose
    result is all-reduced on the same group: which all_reduce goes first follows which
    gather ends first, that is the costs (RO-12), so ranks whose cost models differ
    order the two groups' all_reduces differently unless they agree (RO-16)."""
    return _two_groups(ops, (ctx.world, ctx.n), (ctx.sub, ctx.sub_n), a, b, w1, w2)


def _two_groups(ops, first, second, a, b, w1, w2):
    g = _wait(ops, ops.all_gather_into_tensor(w1, first[1], first[0]))
    h = _wait(ops, ops.all_gather_into_tensor(w2, second[1], second[0]))
    x = a @ g.view(-1, 4)[:4]
    y = b @ h.view(-1, 4)[:4]
    rx = _wait(ops, ops.all_reduce(x, "sum", first[0]))
    ry = _wait(ops, ops.all_reduce(y, "sum", second[0]))
    return rx + 1, ry + 1


def wait_then_matmul(ops, ctx, x, a, b):
    """One all_reduce, its wait, an independent matmul whose result the end reads;
    upstream's ops (whose wait returns its argument, MEM-2), whatever `ops` is. Sinking
    the wait below the matmul raises no planned peak: the matmul's result is live at the
    original order's peak already (issue 30's first program; RO-10's exact test)."""
    up = torch.ops._c10d_functional
    w = up.wait_tensor(up.all_reduce(x, "sum", ctx.world))
    return w + (a @ b).sum()


def gather_then_matmul(ops, ctx, x, a, b):
    """A gather (holding its input until its wait, MEM-5), its wait, then a matmul whose
    result is an output; upstream's ops. The original order peaks at the matmul; sinking
    the wait below it keeps the gather's input alive there too: on 4 ranks the planned
    peak goes from 232 B to 240 B, which a budget of 0.035 allows (limit 240 B) and one
    of 0.034 does not (limit 239 B) (RO-9, RO-10's exact test)."""
    up = torch.ops._c10d_functional
    g = up.wait_tensor(up.all_gather_into_tensor(x * 1, ctx.n, ctx.world))
    return g, a @ b


def compute_feeds_a_collective(ops, ctx, x, w0, w1, w2):
    """A matmul and relu, then a matmul and the all_reduce's input two steps from the
    relu, the all_reduce, its wait, a last matmul of both (issue 30's second program):
    running the all_reduce's input first issues it before the middle matmul, which then
    hides it (RO-12's need)."""
    r = torch.relu(x @ w0)
    m1 = r @ w1
    s = (r + 1) * 2
    w = _wait(ops, ops.all_reduce(s, "sum", ctx.world))
    return m1 @ w2 + w


def small_then_large(ops, ctx, x, small, large):
    """Gathers of a small and a large shard on one group, then a matmul that needs
    neither; their waits only at the end (issue 30's third program). With one all_gather
    in flight, placing the small one's wait first lets the large one run under the matmul
    (RO-14); the durations are the case's own (`Case.pins`)."""
    g1 = ops.all_gather_into_tensor(small, ctx.n, ctx.world)
    g2 = ops.all_gather_into_tensor(large, ctx.n, ctx.world)
    m = x @ x
    return _wait(ops, g1) + 1, _wait(ops, g2) + 1, m


def refused_fill_behind_a_spread_block(ops, ctx, x, a, h_in):
    """The original order's first block is a cast whose gather waits for an all_reduce
    of its group (RO-5), so that block is not ready; RO-12 fills with the all_reduce's
    input `a.relu()` (the collective needs it), which, placed first, would be live beside
    the large intermediate `h` of the original order's peak and break the bound. Refused,
    the move falls back to the original order's next ready block, `h` (RO-12), never to
    any block past the bound. Upstream's ops."""
    up = torch.ops._c10d_functional
    t = x.to(torch.bfloat16)
    h = h_in * 2
    total = h.sum()
    y = torch.relu(a)
    r = up.wait_tensor(up.all_reduce(y, "sum", ctx.world))
    g = up.wait_tensor(up.all_gather_into_tensor(t, ctx.n, ctx.world))
    return r + total, g


def limit_broken_before_a_refused_raise(ops, ctx, s1, s2, z):
    """Two gathers issued back to back (the original order breaks a limit of one, RO-8),
    then their waits, a sum needing both, and a large all_reduce. With one all_gather in
    flight the second gather is held back; nothing but the all_reduce is ready, and
    raising it is refused by the memory test. The original order's next block being
    the held gather, RO-12's last resort places a ready block in the order of RO-10
    (the all_reduce), then RO-11, then RO-12, whatever the bound (RO-9's exception);
    a schedule that finds none is stuck. Upstream's ops."""
    up = torch.ops._c10d_functional
    a = up.all_gather_into_tensor(s1, ctx.n, ctx.world)
    b = up.all_gather_into_tensor(s2, ctx.n, ctx.world)
    total = (up.wait_tensor(a) + up.wait_tensor(b)).sum()
    return up.wait_tensor(up.all_reduce(z, "sum", ctx.world)) + total


def prologue_behind_its_group(ops, ctx, x):
    """The view that is the second sub-group all_reduce's prologue (RO-7) comes early in
    program order, so its block is the original order's next one while the first
    all_reduce of its group (RO-5) is not placed yet; a coalesced all_reduce raised at
    the start makes the memory test (RO-9's estimate) refuse the fill that would place
    that first all_reduce's input. The original order's next ready block must then be
    placed, not any block: a gather whose result lives to the end would be raised over
    the memory bound. On upstream's ops, whose waits copy nothing (found by --fuzz)."""
    ops = torch.ops._c10d_functional
    t = x.to(torch.bfloat16)
    first = ops.all_gather_into_tensor(t, ctx.n, ctx.world)
    v = x.view(-1)
    y = torch.relu(x)
    c1, c2 = ops.all_reduce_coalesced([t, t], "sum", ctx.sub)
    r1 = _wait(ops, ops.all_reduce(y, "sum", ctx.sub))
    r2 = _wait(ops, ops.all_reduce(v, "sum", ctx.sub))
    d1, d2 = ops.all_reduce_coalesced([r1, r2], "sum", ctx.sub)
    z = y * 2
    late = ops.all_gather_into_tensor(t, ctx.n, ctx.world)
    late1, late2 = _wait(ops, late), _wait(ops, late)
    e2 = _wait(ops, d2)
    z.add_(1)
    u = t * -1
    return (z, late1, late2, e2, u, _wait(ops, first), _wait(ops, c1), _wait(ops, c2),
            _wait(ops, d1))


def memory_bound(ops, ctx, x, s1, s2):
    """A large intermediate sets the peak; raising a gather across it costs its bytes."""
    big = x * 2                                         # the peak is while it lives
    small = big.sum()
    g1 = _gather(ops, ctx, s1)
    g2 = _gather(ops, ctx, s2)
    return g1 + small, g2 + small


def bound_at_the_raise(ops, ctx, x):
    """The gather's input is computed while a large intermediate lives, whose last use
    writes it in place (allocating nothing): raised above that write, the gather's output
    is planned at the very moment the peak is, and nowhere later."""
    big = x * 2
    part = big[:_rows(ctx)] * 1
    big.add_(1)
    return _gather(ops, ctx, part) + 1


def stall_tie(ops, ctx, x, w, y):
    """A collective (30 us pinned) issued first; 30 us of compute (a matmul and ten 1-us
    ops); then the reader of the collective's result, then independent compute. When the
    compute is done the collective has ended exactly now: its reader stalls nothing and
    goes first by position (RO-12's "ended by now" includes now)."""
    reduced = _wait(ops, ops.all_reduce(x, "sum", ctx.world))
    h = w @ w
    for _ in range(10):
        h = h + 1
    return reduced * 2, h, y * 3


def two_waits(ops, ctx, x, w, y):
    """Two all_reduces: the first issued at once (30 us pinned, it ends at 30), the second
    on a 20 us matmul's result, through a clone (its prologue: a block of two members), so
    it runs after the first on the group's stream and ends at 60. `both` reads both
    results, `one` only the first: `both` would stall the compute stream until 60, the
    later of its waits' ends, and `one` until 30, so `one` goes first though `both`
    precedes it (RO-12). The second wait's end is its collective's, not its prologue's."""
    first = ops.all_reduce(x, "sum", ctx.world)
    h = w @ w
    second = ops.all_reduce(h.sum(0).clone(), "sum", ctx.world)
    a, b = _wait(ops, first), _wait(ops, second)
    both = a + b
    one = a * 2
    return both, one, y * 3


def coalesced_waits(ops, ctx, x, s1, s2, s3):
    """A coalesced all_gather of two shards, its results read apart (the first at once,
    the second after some compute), then a third gather. With one all_gather in flight,
    the third is issued only after the coalesced gather's second wait: a collective of
    several results is in flight until its last wait (RO-8)."""
    first, second = ops.all_gather_into_tensor_coalesced([s1, s2], ctx.n, ctx.world)
    a = _wait(ops, first) + 1
    h = x * 2
    for _ in range(5):
        h = h + 1
    b = _wait(ops, second) + h.sum()
    return a, b, _gather(ops, ctx, s3) + 1


def cast_and_view(ops, ctx, x, s1, s2):
    """Each gather's input is a bf16 cast, then a view: both are the gather's prologue
    (RO-7's largest set: the cast's only user, the view, is in it). With one all_gather
    in flight the second block waits for the first wait, and is placed whole."""
    g1 = _gather(ops, ctx, s1.to(torch.bfloat16).view(_rows(ctx), 1))
    h = x * 2
    for _ in range(3):
        h = h + 1
    g2 = _gather(ops, ctx, s2.to(torch.bfloat16).view(_rows(ctx), 1))
    return g1 + 1, h, g2 + 1


def random_draws(ops, ctx, x, y):
    """Two random draws, each writing the random-number state (RO-4): the first reads an
    all_reduce's result (30 us pinned, so it would stall), the second reads nothing. The
    second stays after the first, though it is ready first: draws keep their order, and
    so their values (each run starts from the same seed)."""
    reduced = _wait(ops, ops.all_reduce(x, "sum", ctx.world))
    first = torch.rand_like(reduced)
    second = torch.rand(4)
    return reduced + first, second * y


def size_arithmetic(ops, ctx, x, s):
    """Sizes computed from `x`'s symbolic length (traced by `symbolic_graph`): ATen's
    `sym_size`, `operator.floordiv` and `truediv`, `torch.sym_max`, `math.floor`, all
    between compute and a gather. The pass understands them (RO-6): none is a barrier."""
    a = x * 2
    n = x.shape[0]
    half = torch.sym_max(n // 2, 1)
    third = math.floor(n / 3)
    b = a[:half].sum() + a[:third].sum()
    return _gather(ops, ctx, s) + b


def symbolic_graph(ops) -> torch.fx.GraphModule:
    """`size_arithmetic` traced by make_fx with symbolic sizes (x of 6, s of 2 examples)."""
    ctx = context()
    return make_fx(lambda x, s: size_arithmetic(ops, ctx, x, s), tracing_mode="symbolic")(
        rank_input(0, (6,)), rank_input(0, (_rows(ctx),), salt=1))


def _rows(ctx) -> int:
    return 8 // ctx.n


def _shapes(name: str, ctx: Ctx) -> list[tuple]:
    r = _rows(ctx)
    return {
        "fsdp_forward": [(4, 8)] + [(r, 8)] * 4,
        "fsdp_forward_bucketed": [(4, 8)] + [(r, 8), (r,)] * 4,
        "fsdp_backward": [(4, 8)] + [(4, 8)] * 4 + [(8, 8)] * 4,
        "mutated_buffer": [(4,), (4,)],
        "lowered_all_reduce": [(4,), (4,)],
        "two_groups": [(2,), (2,), (2,), (2 * ctx.n,)],
        "opaque_op": [(4,), (r,), (r,)],
        "two_barriers": [(4,), (r,), (r,), (r,)],
        "gathers_first": [(8,), (r,), (r,), (r,)],
        "memory_bound": [(60,), (r,), (r,)],  # on 4 ranks: peak 500 B, a gather 32 B
        "bound_at_the_raise": [(60,)],  # on 4 ranks: peak 488 B, a gather 32 B
        "stall_tie": [(4,), (2, 2), (4,)],
        "two_waits": [(2,), (2, 2), (2,)],
        "coalesced_waits": [(4,), (r,), (r,), (r,)],
        "cast_and_view": [(4,), (r,), (r,)],
        "random_draws": [(4,), (4,)],
        "side_effectful_aten": [(4,), (r,), (r,)],
        "setitem_barrier": [(4,), (r,), (r,)],
        "shared_prologue": [(4,), (4,)],
        "limit_per_group": [(4,), (r,), (r,), (8 // ctx.sub_n,), (8 // ctx.sub_n,)],
        "blocking_then_gather": [(4,), (r,)],
        "gather_then_blocking": [(4,), (r,)],
        "broadcasts_and_an_all_reduce": [(4,), (4,), (4,), (4,)],
        "gathers_after_a_shared_wait": [(4,), (r,)],
        "prologue_behind_its_group": [(2, 4)],
        "waited_together": [(4,), (r,), (r,), (8,), (8,)],
        "wait_then_matmul": [(4,), (4, 4), (4, 4)],
        "gather_then_matmul": [(r,), (4, 4), (4, 4)],
        "compute_feeds_a_collective": [(4, 4)] * 4,
        "small_then_large": [(4, 4), (r,), (4 * r,)],
        "refused_fill_behind_a_spread_block": [(2,), (30,), (100,)],
        "limit_broken_before_a_refused_raise": [(4 * r,), (4 * r,), (48,)],
        "pipeline_stage": [(4, 8), (r, 8), (4, 4)],
        "two_groups_by_cost": [(4, 4), (4, 4), (4, 4), (4, 4)],
    }[name]


FUNCTIONS = {
    "fsdp_forward": fsdp_forward, "fsdp_forward_bucketed": fsdp_forward_params,
    "fsdp_backward": fsdp_backward, "mutated_buffer": mutated_buffer,
    "lowered_all_reduce": shared_all_reduce, "two_groups": two_groups,
    "opaque_op": opaque_op, "two_barriers": two_barriers, "gathers_first": gathers_first,
    "memory_bound": memory_bound, "stall_tie": stall_tie,
    "bound_at_the_raise": bound_at_the_raise, "two_waits": two_waits,
    "coalesced_waits": coalesced_waits, "cast_and_view": cast_and_view,
    "random_draws": random_draws, "side_effectful_aten": side_effectful_aten,
    "setitem_barrier": opaque_op, "shared_prologue": shared_prologue,
    "limit_per_group": limit_per_group, "blocking_then_gather": blocking_then_gather,
    "gather_then_blocking": gather_then_blocking,
    "broadcasts_and_an_all_reduce": broadcasts_and_an_all_reduce,
    "gathers_after_a_shared_wait": gathers_after_a_shared_wait,
    "prologue_behind_its_group": prologue_behind_its_group,
    "waited_together": waited_together,
    "wait_then_matmul": wait_then_matmul,
    "gather_then_matmul": gather_then_matmul,
    "compute_feeds_a_collective": compute_feeds_a_collective,
    "small_then_large": small_then_large,
    "refused_fill_behind_a_spread_block": refused_fill_behind_a_spread_block,
    "limit_broken_before_a_refused_raise": limit_broken_before_a_refused_raise,
    "pipeline_stage": pipeline_stage,
    "two_groups_by_cost": two_groups_by_cost,
}
PROGRAMS = list(FUNCTIONS)


def inputs_for(name: str, ctx: Ctx, rank: int = 0) -> list[torch.Tensor]:
    """Values whose sums round differently in another order (spread_input): RO-13's bit
    for bit then tells a reordered accumulation, which small integers add up exactly."""
    return [spread_input(rank, s, torch.float32, salt=i)
            for i, s in enumerate(_shapes(name, ctx))]


def refimpl_ops():
    import refimpl.functional_collectives  # noqa: F401  (registers refimpl_c10d)

    return torch.ops.refimpl_c10d


def traced(name: str, ops=None, rank: int = 0) -> torch.fx.GraphModule:
    """make_fx of a program on fake values (needs a default group, fake or real)."""
    ctx = context()
    fn = FUNCTIONS[name]
    ops = ops if ops is not None else refimpl_ops()
    return make_fx(lambda *xs: fn(ops, ctx, *xs), tracing_mode="fake")(
        *inputs_for(name, ctx, rank))


def program_graph(name: str, ops=None, rank: int = 0) -> torch.fx.GraphModule:
    """The traced program, bucketed (one bucket a layer) or lowered where its name says."""
    gm = traced(name, ops, rank)
    if name == "fsdp_forward_bucketed":
        from refimpl.bucketing import bucket_all_gather

        layer_bytes = 2 * (8 * 8 + 8)  # bf16 weight and bias, gathered
        bucket_all_gather(gm, lambda i: layer_bytes / 2**20)
    elif name == "lowered_all_reduce":
        from refimpl.comm_lowering import lower

        gm = lower(gm)
    elif name in ("blocking_then_gather", "gather_then_blocking"):
        from refimpl.comm_lowering import CommLoweringConfig, lower
        from refimpl.symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(context().world)
        gm = lower(gm, CommLoweringConfig(auto_select=True))
    elif name == "setitem_barrier":
        # opaque_op with its barrier made `operator.setitem(a, 0, 1.0)`: a Python function
        # the pass understands but for this one, which writes its argument (RO-6)
        record = next(n for n in gm.graph.nodes
                      if n.target is torch.ops.refimpl_conformance.record_.default)
        record.target, record.args = operator.setitem, (record.args[0], 0, 1.0)
        gm.recompile()
    return gm


# --------------------------------------------------------------------------------------
# Costs and configs
# --------------------------------------------------------------------------------------
COLLECTIVE_US, MATMUL_US, COMPUTE_US = 30.0, 20.0, 1.0
# The families pinned as communication (collectives and blocking kernels, by the op
# table); a broadcast, an all_to_all or point to point costs as compute here.
PINNED_FAMILIES = ("all_gather", "reduce_scatter", "all_reduce")
FREE = ("view", "_unsafe_view", "t", "slice", "split_with_sizes", "getitem", "empty",
        "permute", "transpose")


def pinned_costs(gm: torch.fx.GraphModule) -> dict[str, float]:
    """Every node's duration by a rule: collectives, matmuls, other compute, free ones
    (waits among them)."""
    pinned = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        op = ops.find(node)
        if op is not None and op.family in PINNED_FAMILIES:
            pinned[node.name] = COLLECTIVE_US
        elif name in ("mm", "addmm"):
            pinned[node.name] = MATMUL_US
        elif name in FREE or (op is not None and op.is_wait):
            pinned[node.name] = 0.0
        else:
            pinned[node.name] = COMPUTE_US
    return pinned


@dataclass(frozen=True)
class Case:
    """One (program, config) pair: memory_budget and max_in_flight as the config takes them."""

    program: str
    memory_budget: float | None = 0.1
    max_in_flight: tuple = ()  # ((kind, count), ...)
    pins: tuple = ()  # ((node name, us), ...): durations instead of pinned_costs' rule

    @property
    def id(self) -> str:
        limit = ",".join(f"{k}={v}" for k, v in self.max_in_flight) or "unlimited"
        budget = "none" if self.memory_budget is None else f"{self.memory_budget:g}"
        pins = "".join(f"-{name}={us:g}" for name, us in self.pins)
        return f"{self.program}-budget={budget}-{limit}{pins}"


ONE_ALL_GATHER = (("all_gather", 1),)
# small_then_large's gathers and matmul (RO-14): issue 30's 1, 8 and 8 units, where
# letting the large gather go gains 7 us; and 4, 8 and 2, where the matmul hides 2 us of
# either and the small gather's wait stalls 2 us more placed first: a gain of 0 (a tie:
# the matmul first).
SMALL_THEN_LARGE = (("all_gather_into_tensor", 1.0), ("all_gather_into_tensor_1", 8.0),
                    ("mm", 8.0))
SMALL_THEN_LARGE_TIE = (("all_gather_into_tensor", 4.0), ("all_gather_into_tensor_1", 8.0),
                        ("mm", 2.0))
# fsdp_forward with each layer's matmul as long as a gather (30 us): a pipeline, where the
# next layer's compute hides a gather let go late anyway (RO-14's R): no wait is placed
# early to let one go.
EVEN_PIPELINE = (("mm", 30.0), ("mm_1", 30.0), ("mm_2", 30.0), ("mm_3", 30.0))
CASES = [
    Case("fsdp_forward", math.inf),
    Case("fsdp_forward", math.inf, ONE_ALL_GATHER),
    Case("fsdp_forward", math.inf, (("all_gather", 2),)),
    Case("fsdp_forward", 0.1, ONE_ALL_GATHER),
    Case("fsdp_forward_bucketed", math.inf, ONE_ALL_GATHER),
    Case("fsdp_backward", math.inf),
    Case("fsdp_backward", 0.1),
    Case("mutated_buffer", math.inf),
    Case("lowered_all_reduce", math.inf),
    Case("two_groups", math.inf),
    Case("opaque_op", math.inf),
    Case("two_barriers", math.inf),
    Case("gathers_first", 0.0, ONE_ALL_GATHER),
    Case("memory_bound", 0.065),  # on 4 ranks: 532 B may be planned, 500 + 32 (RO-9)
    Case("memory_bound", 0.05),
    Case("stall_tie", math.inf),
    Case("two_waits", math.inf),
    Case("coalesced_waits", math.inf, ONE_ALL_GATHER),
    Case("cast_and_view", math.inf, ONE_ALL_GATHER),
    Case("random_draws", math.inf),
    Case("side_effectful_aten", math.inf),
    Case("setitem_barrier", math.inf),
    Case("shared_prologue", math.inf),
    Case("limit_per_group", math.inf, ONE_ALL_GATHER),
    Case("blocking_then_gather", math.inf),
    Case("gather_then_blocking", math.inf),
    Case("broadcasts_and_an_all_reduce", math.inf, (("broadcast", 1),)),
    Case("gathers_after_a_shared_wait", math.inf, ONE_ALL_GATHER),
    Case("prologue_behind_its_group", 0.1),
    Case("waited_together", math.inf),
    Case("waited_together", math.inf, (("reduce_scatter", 1),)),
    Case("wait_then_matmul", 0.0),
    Case("wait_then_matmul", None),
    Case("gather_then_matmul", 0.035),
    Case("gather_then_matmul", 0.034),
    Case("gather_then_matmul", None),
    Case("compute_feeds_a_collective", 0.1),
    Case("small_then_large", math.inf, ONE_ALL_GATHER, SMALL_THEN_LARGE),
    Case("small_then_large", math.inf, ONE_ALL_GATHER, SMALL_THEN_LARGE_TIE),
    Case("fsdp_forward", math.inf, ONE_ALL_GATHER, EVEN_PIPELINE),
    Case("refused_fill_behind_a_spread_block", 0.1),
    Case("limit_broken_before_a_refused_raise", 0.1, ONE_ALL_GATHER),
    Case("pipeline_stage", math.inf),
    Case("pipeline_stage", math.inf, ONE_ALL_GATHER),
]


def config_for(ns, gm: torch.fx.GraphModule, case: Case):
    """The backend's ReorderConfig of `case`, with every node of `gm` pinned."""
    return ns.ReorderConfig(cost_model=ns.CostModel(pinned={**pinned_costs(gm),
                                                           **dict(case.pins)}),
                            memory_budget=case.memory_budget,
                            max_in_flight=dict(case.max_in_flight))


# --------------------------------------------------------------------------------------
# On a rank: the reordered program computes what the original does (RO-13)
# --------------------------------------------------------------------------------------
def flat_tensors(out) -> list[torch.Tensor]:
    """The tensors of a program's output (a tensor, a list or tuple, a dict), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):  # a program may return a dict (make_fx's pytree output)
        return [t for o in out.values() for t in flat_tensors(o)]
    return [t for o in out for t in flat_tensors(o)]


def run_graph(gm, inputs, checker: MetaChecker | None = None
         ) -> tuple[list[torch.Tensor], list[float]]:
    """`gm`'s outputs and recorded side effects; run by `checker` (its meta checked) if
    given."""
    RECORDED.clear()
    torch.manual_seed(0)  # random draws compare between orders (RO-4)
    out = (gm if checker is None else checker.call)(*[x.clone() for x in inputs])
    return flat_tensors(out), list(RECORDED)


def differences(before, after) -> str:
    """'' when outputs (and recorded side effects) are bit-identical, else where not."""
    (a, log_a), (b, log_b) = before, after
    if log_a != log_b:
        return f"record_ saw {log_a} in the original order, {log_b} reordered"
    if len(a) != len(b):
        return f"{len(a)} outputs before, {len(b)} after"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            return f"output {i}: {x.tolist()} != {y.tolist()}"
    return ""


def values_on_rank(spec: str, cases: list[Case]) -> dict[str, str]:
    """On a rank: every case's program, traced with the backend's ops, reordered by the
    backend, run beside the original on the same inputs; {case id: difference}."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    ops = backend.require("functional_collectives").ops
    ns = backend.require("reorder", "reorder", "ReorderConfig", "CostModel")
    rank, ctx = dist.get_rank(), context()
    found = {}
    for case in cases:
        gm = program_graph(case.program, ops, rank)
        inputs = inputs_for(case.program, ctx, rank)
        new = ns.reorder(gm, config_for(ns, gm, case))
        checker = MetaChecker(new)
        found[case.id] = differences(run_graph(gm, inputs), run_graph(new, inputs, checker))
        if checker.untrue and not found[case.id]:
            found[case.id] = f"untrue meta val: {checker.report()}"
    return found


# --------------------------------------------------------------------------------------
# On a rank: a cost model of its own (RO-16)
# --------------------------------------------------------------------------------------
# two_groups_by_cost's gathers (world's, sub's) in us per rank, as profiles measured per
# rank may say: alone, ranks 0 and 3 take world's for the slow one, ranks 1 and 2 sub's.
# Rank 3 alone decides the largest of all four (world's): the largest among any three
# ranks without it (sub's, over ranks 0, 1 and 2) orders the other way, so ranks that
# agree with fewer than all (their own groups' ranks on crossing rows) disagree.
RANK_GATHER_US = ((50.0, 10.0), (10.0, 70.0), (10.0, 50.0), (90.0, 10.0))


def collective_order_on_rank(spec: str, same_graph: bool = True,
                             crossing_rows: bool = False) -> tuple:
    """On a rank: two_groups_by_cost reordered with this rank's own cost model
    (RANK_GATHER_US); ("order", [(kind, "world" or "sub") of each collective in the new
    order]) or, if the backend refused, ("refused", its error's type, its message). With
    `same_graph` False the odd ranks trace it with a first input of other rows: another
    graph. With `crossing_rows` (4 ranks) its first group is this rank's row of [[0, 2],
    [1, 3]] instead of the world ("world" in the order all the same): no group holds
    every rank, and the rows of two ranks differ."""
    from conformance.harness import backend_in_rank
    from conformance.reorder_rules import group_of

    backend = backend_in_rank(spec)
    fc_ops = backend.require("functional_collectives").ops
    ns = backend.require("reorder", "reorder", "ReorderConfig", "CostModel")
    rank, ctx = dist.get_rank(), context()
    inputs = inputs_for("two_groups_by_cost", ctx, rank)
    if not same_graph and rank % 2:
        inputs[0] = inputs[0][:2].clone()
    first = (ctx.world, ctx.n)
    if crossing_rows:
        from conformance.bucketing_programs import group_of as made_group

        strided = made_group([[0, 2], [1, 3]])
        first = (strided.group_name, strided.size())
    gm = make_fx(lambda *xs: _two_groups(fc_ops, first, (ctx.sub, ctx.sub_n), *xs),
                 tracing_mode="fake")(*inputs)
    pins = pinned_costs(gm)
    gathers = [n.name for n in gm.graph.nodes if ops.kind_of(n) == "all_gather"]
    for name, us in zip(gathers, RANK_GATHER_US[rank], strict=True):
        pins[name] = us
    config = ns.ReorderConfig(cost_model=ns.CostModel(pinned=pins), memory_budget=math.inf)
    try:
        new = ns.reorder(gm, config)
    except Exception as exc:  # a refusal is a verdict, reported with its type
        return ("refused", type(exc).__name__, str(exc))
    labels = {first[0]: "world", ctx.sub: "sub"}
    return ("order", [(ops.kind_of(n), labels.get(group_of(n), group_of(n)))
                      for n in new.graph.nodes if ops.kind_of(n) is not None])


def reorder_of_another_blocking_graph_on_rank(spec: str) -> tuple:
    """On a rank: a small sum all_reduce lowered one-shot by refimpl (a graph whose only
    communication is a blocking kernel), of 4 elements on even ranks and 2 on odd ones
    (another graph), reordered by the backend with every default: ("refused", its
    error's type, its message) or ("reordered",)."""
    from conformance.harness import backend_in_rank
    from refimpl.comm_lowering import CommLoweringConfig, lower
    from refimpl.symmetric_memory import enable_symm_mem_for_group

    backend = backend_in_rank(spec)
    ns = backend.require("reorder", "reorder", "ReorderConfig")
    rank, ctx = dist.get_rank(), context()
    fc_ops = refimpl_ops()
    x = rank_input(rank, (4,) if rank % 2 == 0 else (2,), torch.float32)
    gm = make_fx(lambda t: _wait(fc_ops, fc_ops.all_reduce(t * 2, "sum", ctx.world)) + 1,
                 tracing_mode="fake")(x)
    enable_symm_mem_for_group(ctx.world)
    gm = lower(gm, CommLoweringConfig(auto_select=True))
    assert any(ops.is_blocking(n) for n in gm.graph.nodes), "no blocking kernel"
    try:
        ns.reorder(gm, ns.ReorderConfig())
    except Exception as exc:  # a refusal is a verdict, reported with its type
        return ("refused", type(exc).__name__, str(exc))
    return ("reordered",)
