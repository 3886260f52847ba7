"""Programs of the memory and simulator cases, and their backend-neutral text.

Each program is `program(ops, *inputs)`, written against a functional-collectives op
namespace (`torch.ops.refimpl_c10d` or upstream's `torch.ops._c10d_functional`) on the
default group "0" of 2 ranks (WORLD under the fake process group and under gloo).
`traced(name)` traces one with make_fx on fake values; three programs are built by a
refimpl pass on top (a bucketed FSDP block, a lowered one with comm buffers, a lowered
one with in-place waits): they are inputs of the cases, never their expectation.

`memory_text(plan)` prints a plan as the goldens show it, from the backend's events
alone: one line per node that allocates or frees (`+bytes %i` for the buffer first
allocated at node `%i`, `-bytes %i` when it is freed), with the live bytes after the
node, which the case sums itself, and the high-water mark (MEM-1, MEM-9).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from conformance.canonical import op_name
from conformance.oracle import rank_input

G = "0"  # WORLD: 2 ranks
aten = torch.ops.aten


@contextlib.contextmanager
def fake_world(world_size: int):
    """A fake process group of `world_size` in this process, for tracing (no
    communication), unless one exists already; then it must be of that size."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    elif dist.get_world_size() != world_size:
        raise RuntimeError(f"a process group of {dist.get_world_size()} ranks exists; this "
                           f"needs {world_size}")
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def _wait(ops, t):
    return ops.wait_tensor(t)


# --------------------------------------------------------------------------------------
# Programs: (function, input shapes). f32 throughout: 4 bytes an element.
# --------------------------------------------------------------------------------------
def all_gather_copy_out(ops, shard):
    """FSDP unshard: gather a flat shard of two params, copy each param out."""
    full = _wait(ops, ops.all_gather_into_tensor(shard, 2, G))   # f32[24]
    rows = full.view(2, 12)
    w1 = rows[:, :8].contiguous()                                 # f32[2, 8]
    w2 = rows[:, 8:].contiguous()                                 # f32[2, 4]
    return w1 * 2, w2 * 2


def reduce_scatter_padded(ops, grad):
    """A gradient of 3 rows padded to 4 for 2 ranks, reduce-scattered, cut to this rank's."""
    padded = torch.nn.functional.pad(grad, (0, 0, 0, 1))          # f32[4, 4]
    mine = _wait(ops, ops.reduce_scatter_tensor(padded, "sum", 2, G))  # f32[2, 4]
    return mine[:2] * 1


def all_reduce_inplace(ops, x):
    """all_reduce_ on an intermediate; the buffer is read after the wait."""
    y = x * 2
    _wait(ops, ops.all_reduce_(y, "sum", G))
    return y + 1


def mutated_views(ops, x):
    """The seed's case: two non-overlapping views of one buffer, both mutated."""
    buf = x * 1                                                   # f32[8]
    lo, hi = buf[:4], buf[4:]
    lo.add_(1)
    _wait(ops, ops.all_reduce_(hi, "sum", G))
    return lo * hi


def read_after_wait(ops, x):
    """The collective's own result is read after its wait (program order makes it valid)."""
    gathered = ops.all_gather_into_tensor(x, 2, G)                # f32[8]
    done = _wait(ops, gathered)
    return done + 1, gathered.sum()


def output_aliases_input(ops, x):
    """Outputs that are the input, a view of it, and a mutated view of it."""
    x.mul_(2)
    return x, x.view(2, 2), _wait(ops, ops.all_reduce(x, "sum", G))


def two_layers(ops, p1, p2, act):
    """Two FSDP layers: gather a param, use it; the order case raises the second gather."""
    w1 = _wait(ops, ops.all_gather_into_tensor(p1, 2, G)).view(4, 4)
    h = act @ w1
    w2 = _wait(ops, ops.all_gather_into_tensor(p2, 2, G)).view(4, 4)
    return h @ w2


def coalesced_members(ops, a, b):
    """all_gather_coalesced: each member's input is held until that member's wait."""
    ga, gb = ops.all_gather_into_tensor_coalesced([a * 1, b * 1], 2, G)
    first = _wait(ops, ga) + 1
    return first, _wait(ops, gb) + 1


def reduce_scatter_coalesced_members(ops, a, b):
    """reduce_scatter_coalesced: each member's input (gloo copies it) is held until that
    member's wait all the same (MEM-5, FC-36)."""
    ra, rb = ops.reduce_scatter_tensor_coalesced([a * 1, b * 1], "sum", 2, G)
    first = _wait(ops, ra) + 1
    return first, _wait(ops, rb) + 1


def waited_together(ops, a, b):
    """Upstream's coalesced all_gather waited by one `wait_tensors`, as torch 2.15 traces
    it (FC-35; upstream's ops whatever `ops` is): the wait completes both members, so both
    inputs are held until it (MEM-5); it returns the collective's results (a rename, MEM-2)."""
    from conformance.upstream_ops import wait_tensors

    up = torch.ops._c10d_functional
    ga, gb = wait_tensors()(up.all_gather_into_tensor_coalesced([a * 1, b * 1], 2, G))
    first = ga + 1
    return first, gb + 1


def all_reduce_coalesced_members(ops, a, b):
    """all_reduce_coalesced (out of place) copies every input at issue: only the copies,
    its results, are in flight; each input is free after the op (MEM-5, FC-2)."""
    ra, rb = ops.all_reduce_coalesced([a * 1, b * 1], "sum", G)
    first = _wait(ops, ra) + 1
    return first, _wait(ops, rb) + 1


def all_to_all_and_broadcast(ops, x):
    """all_to_all holds input and output in flight; broadcast copies its input at issue."""
    swapped = _wait(ops, ops.all_to_all_single(x * 1, [2, 2], [2, 2], G))
    sent = _wait(ops, ops.broadcast(swapped + 1, 0, G))
    return sent * 2


def dead_value(ops, x):
    """A node nobody reads is allocated and freed at once."""
    y = x + 1
    y * 3  # dead
    return _wait(ops, ops.all_reduce(y, "sum", G))


def out_variant(ops, x):
    """An `out=` op renames its `out`, a keyword argument, not its first one (MEM-2)."""
    buf = torch.empty(3, 4)
    torch.mul(x, 2, out=buf)  # aten.mul.out(x, 2, out=buf)
    summed = _wait(ops, ops.all_reduce(buf.t(), "sum", G))  # read through a view
    return summed + x.sum()


def symbolic_halves(ops, x):
    """Sizes computed from x's length: traced with symbolic sizes (`traced(...,
    tracing_mode="symbolic")`), each byte size counts as its value in the example."""
    half = x[: x.shape[0] // 2] * 2
    return _wait(ops, ops.all_reduce(half, "sum", G)) + x.sum()


def point_to_point(ops, x, y):
    """Each of 2 ranks sends to the other and receives from it, alone and in a batch
    (FC-52). isend holds its input and its token (no elements) until its wait; irecv holds
    only its result: its argument is a template it never writes (FC-53), free at the op;
    batch_p2p_ops holds member i (its input i, from its fourth argument, and result i)
    until result i's wait (MEM-5)."""
    peer = 1 - dist.get_rank()
    sent = ops.isend(x * 2, peer, 0, G)
    received = _wait(ops, ops.irecv(torch.empty_like(x), peer, 0, G)) + 1
    _wait(ops, sent)
    got, token = ops.batch_p2p_ops(["irecv", "isend"], [peer, peer], [1, 1],
                                   [torch.empty_like(y), y * 3], G)
    first = _wait(ops, got) + 1
    _wait(ops, token)
    return received, first


PROGRAMS = {
    "all_gather_copy_out": (all_gather_copy_out, [(12,)]),
    "out_variant": (out_variant, [(3, 4)]),
    "reduce_scatter_padded": (reduce_scatter_padded, [(3, 4)]),
    "all_reduce_inplace": (all_reduce_inplace, [(4,)]),
    "mutated_views": (mutated_views, [(8,)]),
    "read_after_wait": (read_after_wait, [(4,)]),
    "output_aliases_input": (output_aliases_input, [(4,)]),
    "two_layers": (two_layers, [(8,), (8,), (2, 4)]),
    "coalesced_members": (coalesced_members, [(2,), (3,)]),
    "reduce_scatter_coalesced_members": (reduce_scatter_coalesced_members, [(4,), (6,)]),
    "all_reduce_coalesced_members": (all_reduce_coalesced_members, [(4,), (6,)]),
    "waited_together": (waited_together, [(2,), (3,)]),
    "all_to_all_and_broadcast": (all_to_all_and_broadcast, [(4,)]),
    "dead_value": (dead_value, [(4,)]),
    "symbolic_halves": (symbolic_halves, [(6,)]),
    "point_to_point": (point_to_point, [(4,), (2, 3)]),
}


def inputs_for(name: str, rank: int = 0) -> list[torch.Tensor]:
    _, shapes = PROGRAMS[name]
    return [rank_input(rank, s, torch.float32, salt=i) for i, s in enumerate(shapes)]


def refimpl_ops():
    import refimpl.functional_collectives  # noqa: F401  (registers refimpl_c10d)

    return torch.ops.refimpl_c10d


def traced(name: str, ops=None, rank: int = 0, tracing_mode: str = "fake"
           ) -> torch.fx.GraphModule:
    """make_fx of a program on fake values (needs a default group of 2, fake or real)."""
    fn, _ = PROGRAMS[name]
    ops = ops if ops is not None else refimpl_ops()
    return make_fx(lambda *xs: fn(ops, *xs), tracing_mode=tracing_mode)(
        *inputs_for(name, rank))


# --------------------------------------------------------------------------------------
# Programs built by a refimpl pass on a traced one (inputs of the cases).
# --------------------------------------------------------------------------------------
def fsdp_block(ops, a, b, w):
    """Two params cast to bf16 and gathered, each used by a matmul: bucketing's input."""
    outs = []
    for shard in (a, b):
        full = _wait(ops, ops.all_gather_into_tensor(shard.to(torch.bfloat16), 2, G))
        outs.append(full.float() @ w)
    return outs


def bucketed_fsdp_block(rank: int = 0) -> torch.fx.GraphModule:
    """fsdp_block with its two all_gathers merged into one bucket (BK-8, BK-9)."""
    from refimpl.bucketing import bucket_all_gather

    inputs = [rank_input(rank, s, torch.float32, salt=i)
              for i, s in enumerate([(2, 4), (3, 4), (4, 4)])]
    ops = refimpl_ops()
    gm = make_fx(lambda *xs: fsdp_block(ops, *xs), tracing_mode="fake")(*inputs)
    bucket_all_gather(gm, lambda i: 1.0)
    return gm


def small_all_reduce(ops, x):
    return _wait(ops, ops.all_reduce(x * 2, "sum", G)) + 1


def lowered_one_shot(rank: int = 0) -> torch.fx.GraphModule:
    """small_all_reduce lowered one-shot: its input is produced into a comm buffer (CL-11)."""
    from refimpl.comm_lowering import CommLoweringConfig, lower
    from refimpl.symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(G)
    ops = refimpl_ops()
    x = rank_input(rank, (4,), torch.float32)
    gm = make_fx(lambda x: small_all_reduce(ops, x), tracing_mode="fake")(x)
    return lower(gm, CommLoweringConfig(auto_select=True))


def lowered_waits(rank: int = 0) -> torch.fx.GraphModule:
    """all_gather_copy_out lowered: its wait completes in place (FC-35)."""
    from refimpl.comm_lowering import lower

    return lower(traced("all_gather_copy_out", rank=rank))


BUILT = {"bucketed_fsdp_block": bucketed_fsdp_block, "lowered_one_shot": lowered_one_shot,
         "lowered_waits": lowered_waits}
BUILT_INPUT_SHAPES = {"bucketed_fsdp_block": [(2, 4), (3, 4), (4, 4)],
                      "lowered_one_shot": [(4,)], "lowered_waits": [(12,)]}


def program_graph(name: str, rank: int = 0) -> torch.fx.GraphModule:
    return BUILT[name](rank) if name in BUILT else traced(name, rank=rank)


def program_inputs(name: str, rank: int = 0) -> list[torch.Tensor]:
    if name in BUILT:
        return [rank_input(rank, s, torch.float32, salt=i)
                for i, s in enumerate(BUILT_INPUT_SHAPES[name])]
    return inputs_for(name, rank)


ALL = [*PROGRAMS, *BUILT]


# --------------------------------------------------------------------------------------
# Text of a plan, from its events alone
# --------------------------------------------------------------------------------------
def node_labels(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """`%i op` for every node, numbered in graph order (placeholders print `input`)."""
    labels = {}
    for i, node in enumerate(gm.graph.nodes):
        what = "input" if node.op == "placeholder" else node.op if node.op != \
            "call_function" else op_name(node.target)
        labels[node] = f"%{i} {what}"
    return labels


def live_after_each_node(plan) -> list[int]:
    """The live bytes after each node of `plan.order`, summed from the plan's own events
    (what MEM-1's `live_bytes` must hold)."""
    change: dict[torch.fx.Node, int] = {}
    for e in plan.events:
        sign = 1 if e.kind == "alloc" else -1
        change[e.node] = change.get(e.node, 0) + sign * e.buffer.nbytes
    live, lives = 0, []
    for node in plan.order:
        live += change.get(node, 0)
        lives.append(live)
    return lives


def memory_text(gm: torch.fx.GraphModule, plan) -> str:
    """Golden form of a plan: per node its events, then the live bytes; the high-water."""
    labels = node_labels(gm)
    number = {n: label.split()[0] for n, label in labels.items()}
    rows: list[tuple[torch.fx.Node, list[str]]] = []
    live = high = 0
    high_at = "-"
    lives = []
    for e in plan.events:
        if not rows or rows[-1][0] is not e.node:
            rows.append((e.node, []))
            lives.append(live)
        if e.kind == "alloc":
            live += e.buffer.nbytes
            if live > high:
                high, high_at = live, number[e.node]
        else:
            live -= e.buffer.nbytes
        rows[-1][1].append(f"{'+' if e.kind == 'alloc' else '-'}{e.buffer.nbytes} "
                           f"{number[e.buffer.alloc_node]}")
        lives[-1] = live
    lines = [f"{labels[node]:34s} {' '.join(events):28s} live {lv}"
             for (node, events), lv in zip(rows, lives, strict=True)]
    lines.append(f"high-water {high} at {high_at}")
    return "\n".join(line.rstrip() for line in lines)


# --------------------------------------------------------------------------------------
# A real run, measured (independent of any backend's planner)
# --------------------------------------------------------------------------------------
FREE_GRACE_S = 1.0  # gloo's worker thread lets go of a finished collective just after


def _run_node(node, env):
    args = torch.fx.node.map_arg(node.args, env.__getitem__)
    kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
    return node.target(*args, **kwargs)


def _tensor_leaves(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensor_leaves(v)]
    return []


class _Storages:
    """Every storage seen, by identity, with the node that first produced it."""

    def __init__(self):
        self.owner: dict[int, list] = {}  # storage _cdata -> [node name, bytes, dead]
        self.deaths: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def new_ones(self, node, value) -> list[tuple[str, int]]:
        new = []
        for tensor in _tensor_leaves(value):
            storage = tensor.untyped_storage()
            record = self.owner.get(storage._cdata)
            if record is not None and not record[2]:
                continue
            record = self.owner[storage._cdata] = [node.name, storage.nbytes(), False]
            weakref.finalize(storage, self._died, record)
            new.append((node.name, storage.nbytes()))
        return new

    def _died(self, record) -> None:
        with self.lock:
            record[2] = True
            self.deaths.append((record[0], record[1]))

    def take_deaths(self) -> list[tuple[str, int]]:
        with self.lock:
            deaths, self.deaths = self.deaths, []
        return deaths


def measure_run(gm: torch.fx.GraphModule, inputs, plan) -> list[str]:
    """Run `gm` node by node (each value dropped after its last reader, as FX's code
    does) and compare the storages each node creates and the ones that die after it
    with `plan`'s events at that node. Returns the differences, one line each."""
    planned: dict[str, tuple[list, list]] = {}
    for e in plan.events:
        entry = planned.setdefault(e.node.name, ([], []))
        entry[0 if e.kind == "alloc" else 1].append((e.buffer.alloc_node.name,
                                                     e.buffer.nbytes))
    nodes = list(gm.graph.nodes)
    last_reader = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last_reader[arg] = i
    storages, env, feed, mismatches = _Storages(), {}, iter(inputs), []
    for i, node in enumerate(nodes):
        if node.op == "output":  # what it returns is the caller's: nothing allocated or freed
            want_allocs, want_frees = planned.get(node.name, ([], []))
            if want_allocs or want_frees:
                mismatches.append(f"MEM-7: node {node.name}: ran +[] -[], planned "
                                  f"+{want_allocs} -{want_frees}")
            break
        env[node] = next(feed) if node.op == "placeholder" else _run_node(node, env)
        allocated = storages.new_ones(node, env[node])
        for arg in node.all_input_nodes:
            if last_reader[arg] == i:
                del env[arg]
        if node not in last_reader and node.op != "placeholder":
            del env[node]
        want_allocs, want_frees = planned.get(node.name, ([], []))
        freed = storages.take_deaths()
        deadline = time.monotonic() + FREE_GRACE_S
        while any(f not in freed for f in want_frees) and time.monotonic() < deadline:
            time.sleep(0.0005)
            freed += storages.take_deaths()
        if sorted(allocated) != sorted(want_allocs) or sorted(freed) != sorted(want_frees):
            rule = _rule_broken(node, gm, allocated, want_allocs, freed, want_frees)
            mismatches.append(f"{rule}: node {node.name}: ran +{allocated} "
                              f"-{freed}, planned +{want_allocs} -{want_frees}")
    return mismatches


def _rule_broken(node, gm, allocated, want_allocs, freed, want_frees) -> str:
    """The rule a difference at `node` breaks, as this judge reads it: an allocation that
    differs, MEM-4 at a wait (a copy or a rename) and MEM-2 elsewhere; a free that differs,
    MEM-6 for a graph input, MEM-5 at a collective (an input freed while in flight),
    MEM-3 otherwise (freed at another reader, or never)."""
    from conformance.ops import is_wait, kind_of

    if sorted(allocated) != sorted(want_allocs):
        return "MEM-4" if is_wait(node) else "MEM-2"
    inputs = {n.name for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")}
    differing = set(freed) ^ set(want_frees)
    if any(name in inputs for name, _ in differing):
        return "MEM-6"
    return "MEM-5" if kind_of(node) is not None else "MEM-3"


def measure_programs(spec: str, names: list[str]) -> list[str]:
    """On a rank: trace each program with the backend's ops, plan it, run it, compare."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    ops = backend.require("functional_collectives").ops
    memory = backend.require("memory", "plan_memory")
    rank = dist.get_rank()
    mismatches = []
    for name in names:
        gm = traced(name, ops=ops, rank=rank)
        found = measure_run(gm, inputs_for(name, rank), memory.plan_memory(gm))
        mismatches += [f"{name}: {m}" for m in found]
    return mismatches


def measure_lowered_waits(spec: str) -> list[str]:
    """On a rank: the lowered program of `lowered_waits` run for real against the
    backend's plan of it: its waits complete in place, so they allocate nothing (FC-35)."""
    from conformance.harness import backend_in_rank

    memory = backend_in_rank(spec).require("memory", "plan_memory")
    rank = dist.get_rank()
    gm = program_graph("lowered_waits", rank)
    return measure_run(gm, program_inputs("lowered_waits", rank), memory.plan_memory(gm))


# --------------------------------------------------------------------------------------
# Simulator programs: a world of 4 ("0") and a subgroup of 2 whose name is passed in
# --------------------------------------------------------------------------------------
G4 = "0"


def layered(ops, p1, p2, x, grad, *, sub):
    """Two FSDP layers on the world, then a gradient reduce-scattered on a subgroup."""
    w1 = _wait(ops, ops.all_gather_into_tensor(p1, 4, G4)).view(4, 4)
    h = x @ w1
    w2 = _wait(ops, ops.all_gather_into_tensor(p2, 4, G4)).view(4, 4)
    y = h @ w2
    r = _wait(ops, ops.reduce_scatter_tensor(grad * 2, "sum", 2, sub))
    return y, r


LAYERED_SHAPES = [(4,), (4,), (2, 4), (4, 4)]


def traced_layered(sub: str, ops=None) -> torch.fx.GraphModule:
    ops = ops if ops is not None else refimpl_ops()
    inputs = [rank_input(0, s, torch.float32, salt=i) for i, s in enumerate(LAYERED_SHAPES)]
    return make_fx(lambda *xs: layered(ops, *xs, sub=sub), tracing_mode="fake")(*inputs)


def every_collective(ops, x, *, sub):
    """One of each collective on the world (4) and on the subgroup (2)."""
    outs = []
    for group, n in ((G4, 4), (sub, 2)):
        outs.append(_wait(ops, ops.all_gather_into_tensor(x, n, group)))
        outs.append(_wait(ops, ops.reduce_scatter_tensor(x, "sum", n, group)))
        outs.append(_wait(ops, ops.all_reduce(x, "sum", group)))
        outs.append(_wait(ops, ops.all_to_all_single(x, [], [], group)))
        outs.append(_wait(ops, ops.broadcast(x, 0, group)))
    return outs


def traced_every_collective(sub: str, ops=None) -> torch.fx.GraphModule:
    ops = ops if ops is not None else refimpl_ops()
    x = rank_input(0, (8, 16), torch.float32)
    return make_fx(lambda x: every_collective(ops, x, sub=sub), tracing_mode="fake")(x)


def timeline_text(gm: torch.fx.GraphModule, timeline) -> str:
    """Golden form of a timeline: each event's stream, start and end, then the totals."""
    from conformance.canonical import group_label

    labels = node_labels(gm)
    lines = []
    for e in timeline.events:
        stream = e.stream if e.stream == "compute" else \
            "comm " + group_label(e.stream.split(":", 1)[1])
        lines.append(f"{labels[e.node]:34s} {stream:20s} {e.start_us:6.1f} {e.end_us:6.1f}")
    lines.append(f"step {timeline.step_time_us:.1f} us, comm {timeline.comm_time_us:.1f} us, "
                 f"exposed {timeline.exposed_comm_us:.1f} us, overlap {timeline.overlap:.3f}, "
                 f"peak {timeline.peak_bytes} B")
    return "\n".join(line.rstrip() for line in lines)


def verify_with_backend(spec: str, names: list[str]) -> list[str]:
    """On a rank: the backend's lifecycle verifier passes on each program's plan and
    refuses each doctored copy of it (WRONG), naming the buffer it broke."""
    from conformance.harness import backend_in_rank

    memory = backend_in_rank(spec).require("memory", "plan_memory", "verify_memory_lifecycle")
    rank, problems = dist.get_rank(), []
    for name in names:
        gm = traced(name, rank=rank)
        plan = memory.plan_memory(gm)
        measured = memory.verify_memory_lifecycle(gm, *inputs_for(name, rank), plan=plan)
        if measured != plan.peak_bytes:
            problems.append(f"{name}: measured peak {measured}, planned {plan.peak_bytes}")
        wrong = memory.plan_memory(gm)
        wrong.peak_bytes += 1  # every event right, the peak one byte off
        try:
            memory.verify_memory_lifecycle(gm, *inputs_for(name, rank), plan=wrong)
            problems.append(f"{name}: a plan whose peak is one byte more than measured "
                            f"passed")
        except Exception:  # the backend's own error class
            pass
        # A buffer freed by compute: its death is synchronous, unlike one a process
        # group's worker thread lets go of just after a wait (MEM-12's grace).
        freed = [b for b in plan.buffers if b.free_node is not None
                 and "wait" not in str(b.free_node.target)]
        if not freed or name in STOPS_BETWEEN_PAIRS:
            continue
        for what, doctor in WRONG.items():
            wrong = memory.plan_memory(gm)
            target = next(b for b in wrong.buffers if b.alloc_node is freed[0].alloc_node)
            broken = doctor(wrong, target)
            try:
                memory.verify_memory_lifecycle(gm, *inputs_for(name, rank), plan=wrong)
                problems.append(f"{name}: a plan with {what} ({broken.alloc_node.name!r}) "
                                f"passed")
            except Exception as exc:  # the backend's own error class
                if repr(broken.alloc_node.name) not in str(exc):
                    problems.append(f"{name}: the error does not name buffer "
                                    f"{broken.alloc_node.name!r}: {exc}")
    return problems


# Doctored plans: each breaks one buffer of the plan and returns it.
def _free_later(plan, freed):
    freed.free_node = plan.order[plan.order.index(freed.free_node) + 1]
    return freed


def _one_byte_more(plan, freed):
    freed.nbytes += 1
    return freed


def _output_freed(plan, freed):
    output = next(b for b in plan.buffers if b.kind == "output")
    output.free_node = plan.order[-2]  # its storage lives on: the free never happens
    return output


# A doctored run stops where the verifier finds the broken buffer, which in these programs
# can fall between a send and its receive: the send left over would meet the next run's
# receive, as gloo pairs them in issue order. Their plans are verified undoctored only.
STOPS_BETWEEN_PAIRS = frozenset({"point_to_point"})
WRONG = {"a free one node late": _free_later, "a buffer one byte larger": _one_byte_more,
         "an output freed": _output_freed}
