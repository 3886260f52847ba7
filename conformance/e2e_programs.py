"""End-to-end programs: a training step sharded FSDP-style, trained eagerly and compiled.

The models are written once against any backend's functional collectives (`fc`), so
every backend trains the same user code with its own API:

- `Model("transformer")`: a small decoder-only transformer (token embedding, pre-norm
  attention and MLP blocks, a final norm and an untied output head) on next-token
  prediction;
- `Model("mlp")`: `layers` square `[dim, dim]` weights with a tanh between them, so that
  every parameter has the same size and a bucket cap of k parameters is exact.

Parameters are sharded SimpleFSDP-style: each rank stores, per parameter, its chunk of the
parameter flattened and padded to a multiple of the world size. The forward gathers
each parameter where it is first used (`fc.all_gather_tensor`, then a view of the real
elements); autograd's gradient of that all_gather is a `reduce_scatter(sum)`, which
hands every rank the gradient of its own shard summed over the ranks. Each rank
backpropagates its local mean loss divided by the world size, so the shard gradients
are those of the global mean loss. The step also returns that global mean loss for
logging, all_reduced (sum) inside the step.

`train(fc, model, steps, compile_backend)` trains on this rank and reports, per step,
the logged loss and how many collectives the forward and the backward issued on the
group's ProcessGroup (its sequence number, counted by c10d itself: independent of any
graph the backend produced), and the final shards. Shared by tests/test_compile*.py,
conformance/cases/test_e2e.py, examples/fsdp_train.py and benchmarks/e2e.py.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

LEARNING_RATE = 0.2
MOMENTUM = 0.9


@dataclass(frozen=True)
class Model:
    """A model and its batch, per rank (small enough for a 2-core machine)."""

    kind: str = "transformer"  # "transformer" or "mlp"
    dim: int = 32
    layers: int = 2
    heads: int = 4
    vocab: int = 64
    seq: int = 16
    batch: int = 4


# --------------------------------------------------------------------------------------
# Parameters: names and shapes in the order the forward first uses them
# --------------------------------------------------------------------------------------
def parameter_shapes(model: Model) -> dict[str, tuple[int, ...]]:
    d = model.dim
    if model.kind == "mlp":
        return {f"w{i}": (d, d) for i in range(model.layers)}
    shapes = {"embed": (model.vocab, d)}
    for i in range(model.layers):
        shapes |= {f"h{i}.norm1": (d,), f"h{i}.qkv": (3 * d, d), f"h{i}.proj": (d, d),
                   f"h{i}.norm2": (d,), f"h{i}.up": (4 * d, d), f"h{i}.down": (d, 4 * d)}
    return shapes | {"norm": (d,), "head": (model.vocab, d)}


def initial_parameters(model: Model) -> dict[str, torch.Tensor]:
    """The full parameters, the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(1234)
    params = {}
    for name, shape in parameter_shapes(model).items():
        if len(shape) == 1:
            params[name] = torch.ones(shape)  # norm weights
        else:
            params[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
    return params


def batch(model: Model, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets) of one step (seeded by rank and step)."""
    gen = torch.Generator().manual_seed(100_003 * step + rank)
    if model.kind == "mlp":
        x = torch.randn(model.batch, model.dim, generator=gen)
        return x, torch.randn(model.batch, model.dim, generator=gen)
    tokens = torch.randint(0, model.vocab, (model.batch, model.seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# --------------------------------------------------------------------------------------
# The models, given `param(name)` -> the full parameter
# --------------------------------------------------------------------------------------
def transformer_loss(model: Model, param, tokens, targets):
    d, h = model.dim, model.heads
    b, t = tokens.shape
    x = F.embedding(tokens, param("embed"))
    for i in range(model.layers):
        y = F.layer_norm(x, (d,), param(f"h{i}.norm1"))
        q, k, v = F.linear(y, param(f"h{i}.qkv")).split(d, dim=-1)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(y.transpose(1, 2).reshape(b, t, d), param(f"h{i}.proj"))
        y = F.layer_norm(x, (d,), param(f"h{i}.norm2"))
        x = x + F.linear(F.gelu(F.linear(y, param(f"h{i}.up"))), param(f"h{i}.down"))
    logits = F.linear(F.layer_norm(x, (d,), param("norm")), param("head"))
    return F.cross_entropy(logits.reshape(-1, model.vocab), targets.reshape(-1))


def mlp_loss(model: Model, param, x, y):
    for i in range(model.layers):
        x = torch.tanh(F.linear(x, param(f"w{i}")))
    return F.mse_loss(x, y)


LOSSES = {"transformer": transformer_loss, "mlp": mlp_loss}


# --------------------------------------------------------------------------------------
# SimpleFSDP-style sharding
# --------------------------------------------------------------------------------------
def shard_of(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's chunk of `full`, flattened and zero-padded to a multiple of the world."""
    flat = full.reshape(-1)
    flat = F.pad(flat, (0, -flat.numel() % world_size))
    return flat.chunk(world_size)[rank].clone()


def gathered(fc, shard: torch.Tensor, shape, group) -> torch.Tensor:
    """The full parameter from every rank's shard: all_gather, then the real elements."""
    return fc.all_gather_tensor(shard, 0, group)[:math.prod(shape)].view(shape)


def sharded_step(fc, model: Model, group, world_size: int, shards, inputs, targets):
    """(loss to backpropagate, global mean loss for logging) of one step on this rank."""
    names = list(parameter_shapes(model).items())
    index = {name: i for i, (name, _) in enumerate(names)}
    param = lambda name: gathered(fc, shards[index[name]], names[index[name]][1], group)
    loss = LOSSES[model.kind](model, param, inputs, targets)
    logged = fc.all_reduce(loss.detach() / world_size, "sum", group)
    return loss / world_size, logged


# --------------------------------------------------------------------------------------
# Training on this rank
# --------------------------------------------------------------------------------------
def _issued(pg) -> int:
    """Collectives this rank has issued on `pg` so far (c10d's own sequence number). A
    group without sequence numbers (one written in Python, torchft's) cannot be counted:
    the E2E cases, which judge what each step issues (E2E-4), say so."""
    try:
        return pg._get_sequence_number_for_group()
    except RuntimeError as exc:
        if "does not yet support sequence numbers" not in str(exc):
            raise
        from conformance.backends import NotImplementedConcept

        raise NotImplementedConcept(
            f"process group {pg.getBackendName()!r} has no sequence numbers "
            f"(`_get_sequence_number_for_group`: {exc}), which the E2E cases count each "
            f"step's collectives by") from None


def _plain(t):
    return t.wait() if hasattr(t, "wait") and type(t) is not torch.Tensor else t


@dataclass
class StepRecord:
    loss: float
    forward_collectives: int
    backward_collectives: int
    seconds: float


def train(fc, model: Model, steps: int, compile_backend=None, *, group=None,
          grad: bool = True, on_step=None) -> dict:
    """Train `steps` steps on this rank, eagerly or compiled with `compile_backend`.

    Returns {"steps": [StepRecord], "shards": [final shard per parameter]}. With
    `grad=False` the step runs under no_grad (an inference graph) and nothing is updated.
    `on_step(step, record)` is called after every step (progress lines).
    """
    group = dist.group.WORLD if group is None else group
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    shards = [torch.nn.Parameter(shard_of(p, rank, world_size))
              for p in initial_parameters(model).values()]
    optimizer = torch.optim.SGD(shards, lr=LEARNING_RATE, momentum=MOMENTUM)
    step_fn = functools.partial(sharded_step, fc, model, group, world_size)
    if compile_backend is not None:
        torch._dynamo.reset()
        step_fn = torch.compile(step_fn, backend=compile_backend, fullgraph=True,
                                dynamic=False)
    records = []
    for step in range(steps):
        inputs, targets = batch(model, dist.get_rank(), step)
        start = time.perf_counter()
        before = _issued(group)
        with torch.set_grad_enabled(grad):
            scaled, logged = step_fn(shards, inputs, targets)
        forward = _issued(group) - before
        if grad:
            scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        loss = float(_plain(logged))
        record = StepRecord(loss, forward, _issued(group) - before - forward,
                            time.perf_counter() - start)
        records.append(record)
        if on_step is not None:
            on_step(step, record)
    return {"steps": records, "shards": [s.detach().clone() for s in shards]}


# --------------------------------------------------------------------------------------
# The conformance case on one rank
# --------------------------------------------------------------------------------------
def compare_on_rank(spec: str, model: Model, steps: int, options: dict, *,
                    grad: bool = True, symm_mem: bool = False) -> dict:
    """Train eagerly, then compiled with the backend's `compile_backend.make(options)`.

    Returns both runs' per-step records and final shards, and, for backends that keep
    them, the collectives of every compiled graph after every stage.
    """
    from conformance.backends import get_backend

    backend = get_backend(spec)
    fc = backend.require("functional_collectives")
    concept = backend.require("compile_backend")
    if symm_mem:
        sm = backend.require("symmetric_memory")
        sm.enable_symm_mem_for_group(dist.group.WORLD.group_name)
    compiled_backend = concept.make(options)
    eager = train(fc, model, steps, grad=grad)
    compiled = train(fc, model, steps, compiled_backend, grad=grad)
    counts = concept.stage_counts(compiled_backend) if concept.stage_counts else None
    return {"eager": eager, "compiled": compiled, "stage_counts": counts}


def logged_compile(spec: str, model: Model, steps: int, options: dict) -> dict:
    """Train compiled while a root handler keeps every log record at DEBUG (E2E-6).

    Returns the records of the backend's logger (`compile_backend.logger`) as (level,
    message) pairs, the handlers that logger had after compiling, its level, and the
    names of the compiled graphs (from `stage_counts`)."""
    import logging

    from conformance.backends import get_backend

    backend = get_backend(spec)
    fc = backend.require("functional_collectives")
    concept = backend.require("compile_backend", "logger")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.name == concept.logger:
                records.append((record.levelno, record.getMessage()))

    root, handler = logging.getLogger(), Keep(level=logging.DEBUG)
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        compiled_backend = concept.make(options)
        train(fc, model, steps, compiled_backend)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    logger = logging.getLogger(concept.logger)
    graphs = list(concept.stage_counts(compiled_backend)) if concept.stage_counts else None
    return {"records": records, "handlers": len(logger.handlers), "level": logger.level,
            "graphs": graphs}


# --------------------------------------------------------------------------------------
# A communication op no compiler understands (E2E-8)
# --------------------------------------------------------------------------------------
# The process group's collective count each call of the op found when it started.
OPAQUE_SEEN: list[int] = []


@functools.cache
def opaque_exchange_():
    """`conformance_probe::opaque_exchange_(Tensor(a!) x) -> ()`: all-reduces `x` in place
    with a blocking c10d call, as a vendor's or a library's own communication op (say, a
    blocking send or a barrier) would, and records how many collectives the process group
    had issued when it started. Its schema writes its argument: RO-6 makes it a barrier."""

    @torch.library.custom_op("conformance_probe::opaque_exchange_", mutates_args=("x",))
    def op(x: torch.Tensor) -> None:
        OPAQUE_SEEN.append(_issued(dist.group.WORLD))
        dist.all_reduce(x)

    return op


def opaque_then_collective_on_rank(spec: str, options: dict) -> dict:
    """One program, eagerly then compiled: an in-place opaque exchange, then an all_reduce
    that depends on nothing the exchange writes. Where each call of the opaque op found
    the group's collective count, counted from the call's start (E2E-8), and whether the
    compiled values are eager's."""
    from conformance.backends import get_backend

    backend = get_backend(spec)
    fc = backend.require("functional_collectives")
    concept = backend.require("compile_backend")
    group = fc.resolve_group_name(dist.group.WORLD)
    exchange = opaque_exchange_()

    def program(x, y):
        y2 = y @ y
        a = x * y2.sum()  # computed before the exchange, from what the all_reduce reads
        exchange(a)
        b = fc.ops.wait_tensor(fc.ops.all_reduce(y2, "sum", group))
        return a + 1, b + 1

    rank = dist.get_rank()
    x, y = torch.arange(4.0) + rank, torch.eye(8) * (rank + 1)
    seen, results = {}, {}
    torch._dynamo.reset()
    compiled = torch.compile(program, backend=concept.make(options), fullgraph=True)
    for name, run in (("eager", program), ("compiled", compiled)):
        for _ in range(2):  # the first compiled call compiles: the second call counts
            OPAQUE_SEEN.clear()
            start = _issued(dist.group.WORLD)
            results[name] = run(x.clone(), y.clone())
            seen[name] = [s - start for s in OPAQUE_SEEN]
    same = all(torch.allclose(e, c) for e, c in zip(results["eager"], results["compiled"],
                                                    strict=True))
    return {"eager": seen["eager"], "compiled": seen["compiled"], "same": same}


# --------------------------------------------------------------------------------------
# Module plans (BK-28): an nn.Module model, so that Dynamo records each node's module
# --------------------------------------------------------------------------------------
PLAN_BLOCKS = 3
DIM = 8


class ShardedLinear(torch.nn.Module):
    """A linear layer holding this rank's shard of its weight (SimpleFSDP's way): its
    forward gathers the weight, its backward reduce-scatters the weight's gradient."""

    def __init__(self, fc, group, full: torch.Tensor):
        super().__init__()
        self.fc, self.group, self.shape = fc, group, tuple(full.shape)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.shard = torch.nn.Parameter(shard_of(full, rank, size))

    def forward(self, x):
        return F.linear(x, gathered(self.fc, self.shard, self.shape, self.group))


class PlannedBlock(torch.nn.Module):
    """Two sharded linears and two all_reduces of statistics of their shards (sum): a
    block's collectives of each kind are independent of each other."""

    def __init__(self, fc, group, gen: torch.Generator):
        super().__init__()
        self.fc, self.group = fc, group
        self.up = ShardedLinear(fc, group, torch.randn(2 * DIM, DIM, generator=gen) / 3)
        self.down = ShardedLinear(fc, group, torch.randn(DIM, 2 * DIM, generator=gen) / 4)

    def forward(self, x):
        norms = [self.fc.all_reduce(linear.shard.detach().square().sum(), "sum", self.group)
                 for linear in (self.up, self.down)]
        return x + self.down(torch.tanh(self.up(x))) * (1 + 1e-3 * (norms[0] - norms[1]))


class PlannedModel(torch.nn.Module):
    """`layers.0` .. `layers.{PLAN_BLOCKS - 1}`, then `head` and `head2` (whose name starts
    with another module's: a plan of `head` does not hold it)."""

    def __init__(self, fc, group):
        super().__init__()
        gen = torch.Generator().manual_seed(4321)
        self.layers = torch.nn.ModuleList(PlannedBlock(fc, group, gen)
                                          for _ in range(PLAN_BLOCKS))
        self.head = ShardedLinear(fc, group, torch.randn(DIM, DIM, generator=gen) / 3)
        self.head2 = ShardedLinear(fc, group, torch.randn(DIM, DIM, generator=gen) / 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head2(torch.tanh(self.head(x)))


def planned_compiler(passes, plans, later=None):
    """A torch.compile backend: AOTAutograd, each graph through the backend's
    `manual_overlap_bucketing` with `plans` (None: left as traced), then through
    `later(gm) -> gm` if given, run as FX."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compile_graph(gm, _example_inputs):
        if plans is not None:
            gm = passes.manual_overlap_bucketing(gm, plans)
        if later is not None:
            gm = later(gm)
        return make_boxed_func(gm)

    return aot_autograd(fw_compiler=compile_graph, bw_compiler=compile_graph)


def module_plan_on_rank(spec: str, plans, steps: int = 2) -> dict:
    """On a rank: PlannedModel trained `steps` SGD steps compiled as traced, then with the
    backend's module-plan bucketing: per step the losses and the collectives each
    forward and backward issued (c10d's count), and the final shards."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    passes = backend.require("bucketing", "manual_overlap_bucketing")
    group = dist.group.WORLD
    runs = {}
    for name, plan in (("traced", None), ("planned", plans)):
        model = PlannedModel(fc, group)
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        torch._dynamo.reset()
        step = torch.compile(model, backend=planned_compiler(passes, plan), fullgraph=True,
                             dynamic=False)
        records = []
        for i in range(steps):
            x = batch(Model("mlp", dim=DIM), dist.get_rank(), i)[0]
            before = _issued(group)
            loss = _plain(step(x)).square().mean()
            forward = _issued(group) - before
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            records.append((loss.item(), forward, _issued(group) - before - forward))
        runs[name] = {"steps": records,
                      "shards": [p.detach().clone() for p in model.parameters()]}
    return runs


def module_plans_through_later_stages(spec: str, plans) -> dict:
    """On a rank: PlannedModel compiled as traced, then with the backend's module-plan
    bucketing followed by its lowering, its reorder (no memory bound), its memory plan
    and its simulated timeline (the compiler's stages, BK-28): one step each; whether the
    loss and gradients are alike bit for bit, and per planned graph the collectives it
    issues and those the timeline holds."""
    from conformance.bucketing_programs import later_stages
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    passes = backend.require("bucketing", "manual_overlap_bucketing")
    graphs = []

    def later(gm):
        gm, held = later_stages(backend, gm)
        graphs.append((held["issued"], held["simulated"]))
        return gm

    runs = []
    for plan, stages in ((None, None), (plans, later)):
        torch._dynamo.reset()
        model = PlannedModel(fc, dist.group.WORLD)
        step = torch.compile(model, backend=planned_compiler(passes, plan, stages),
                             fullgraph=True, dynamic=False)
        loss = _plain(step(batch(Model("mlp", dim=DIM), dist.get_rank(), 0)[0])).square().mean()
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    same = torch.equal(loss_a, loss_b) and all(
        torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    return {"same": same, "graphs": graphs}
