"""Generated-program conformance (`python -m conformance --fuzz N`): hypothesis draws programs.

A *program* is a list of statements (`Stmt`) that renders to Python source
`def program(ops, *inputs): ...`, written against a functional-collectives op namespace
(`ops`: the backend's `functional_collectives.ops`) and a table `G` of group names. The
generator (`_Builder`) writes FSDP- and TP-like sequences: collectives of several groups
(WORLD and subgroups: a non-contiguous `[[0, 2], [1, 3]]` of 4 ranks, or on 2 ranks a
second group of the same ranks), plain, coalesced, in place (`all_reduce_`) and into an
`out=` buffer, each waited somewhere later; casts to bf16 or f16 before an all_gather, views,
compute of several shapes and dtypes, in-place ops and `out=` ops on buffers after their
wait, one-shot candidates with chains of pointwise steps around them (CL-10, CL-17), and
`refimpl_conformance::record_` (conformance/reorder_programs.py) as a barrier.
Every value is a small integer and the generator keeps each one below the size its dtype
holds exactly (a bound per value), so every reduction is exact in any order (CF-9) and any
difference is a real error. Stage options are drawn with the program (`_options`).

Each program is checked per stage on real gloo ranks (2, or 4 for a program of 4-rank
groups), by a module-level rank function that takes the program's source
(`bucketing_on_rank`, `lowering_on_rank`, `reorder_on_rank`, `memory_on_rank`); the
expectations come from the unoptimized program and from the judges of this package
(true_meta, bucket_model, lowering_model, reorder_rules, memory_programs.measure_run),
never from refimpl's passes.

Program `i` of `--seed S` is the program of seed `S + i`: the first example hypothesis
draws with that seed after the simplest one (which is the same for every seed). A stage
that fails is shrunk by hypothesis (a bounded number of reruns, `SHRINK_RUNS`) and its
record carries the shrunk program's source, its stage options and the command that
reruns it (`--fuzz 1 --seed S+i --section X`). Rank processes are started and warmed
before a stage is timed, and a stage run past its time limit is tried once more on fresh
ranks: on a machine other jobs load, starting them can take that long.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.reporting import with_reporter
from torch.fx.experimental.proxy_tensor import make_fx

from conformance import bucket_model, lowering_model
from conformance import lowering_programs as lp
from conformance import reorder_programs as rp
from conformance.backends import NotImplementedConcept
from conformance.oracle import rank_input
from conformance.spec import section_title

# --------------------------------------------------------------------------------------
# The vocabulary: groups, dtypes, shapes, stages
# --------------------------------------------------------------------------------------
# Groups per world size: None is WORLD; rows cover the world, each rank in one row.
GROUPS = {
    2: {"world": None, "twin": ((0, 1),)},
    4: {"world": None, "strided": ((0, 2), (1, 3)), "pairs": ((0, 1), (2, 3))},
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16,
          "f64": torch.float64, "i32": torch.int32}
# Integers up to this size are exact in the dtype (24, 8, 11 and 53 bits of significand;
# int32 kept well inside its range). f64 and i32 values come from the one-shot step's
# casts (CL-10's dtypes, SM-14): inputs are floats of the first three.
EXACT = {"f32": 2**24, "bf16": 2**8, "f16": 2**11, "f64": 2**53, "i32": 2**30}
INPUT_BOUND = 3  # oracle.rank_input draws integers in [-3, 3]
INPUT_SHAPES = ((4,), (2, 4), (4, 4), (8, 2), (4, 8), (3, 4), (1, 4), (8,), (6, 2), (16, 8))
REDUCE_OPS = ("sum", "sum", "max")  # repeated: drawn more often
# Collective kinds by weight: bucketing candidates (out of place) most often.
KINDS = ("all_gather", "all_gather", "all_gather", "reduce_scatter", "reduce_scatter",
         "all_reduce", "all_reduce", "all_gather_out", "all_reduce_")
# Members gather 32 B to 1 KiB: caps merge all, some, or none (shrinks to merging all).
CAP_BYTES = (2**20, 4096, 1024, 256, 64)
BUCKET_PASSES = ("bucket_all_gather", "bucket_reduce_scatter", "bucket_all_reduce")
# How each collective is written: {h} its handles, {x} its input (a list, coalesced),
# {c} "_coalesced" or "", {op} the reduce op, {out} the buffer of the out= variant.
ISSUE = {
    "all_gather": "{h} = ops.all_gather_into_tensor{c}({x}, {n}, {g})",
    "all_gather_out": "{h} = ops.all_gather_into_tensor_out({x}, {n}, {g}, out={out})",
    "reduce_scatter": "{h} = ops.reduce_scatter_tensor{c}({x}, {op!r}, {n}, {g})",
    "all_reduce": "{h} = ops.all_reduce{c}({x}, {op!r}, {g})",
    "all_reduce_": "{h} = ops.all_reduce_({x}, {op!r}, {g})",
}
MAX_STEPS = 14
DEFAULT_ONE_SHOT_BYTES = 128 * 1024  # CommLoweringConfig's threshold (CL-1)
SHRINK_RUNS = 100  # stage runs a failure may spend on shrinking; then it reports
STAGE_TIMEOUT_S = 60.0  # a program's stage takes under a second when warm
START_TIMEOUT_S = 300.0  # starting rank processes, on a machine other jobs load


@dataclass(frozen=True)
class Stage:
    concept: str
    attrs: tuple[str, ...]  # what the stage needs of the concept's namespace
    spec_ids: tuple[str, ...]


STAGES = {
    "BK": Stage("bucketing", ("bucket_all_gather", "bucket_reduce_scatter"),
                ("BK-2", "BK-3", "BK-4", "BK-5", "BK-6", "BK-7", "BK-8", "BK-10", "BK-11",
                 "BK-15", "BK-16", "BK-17")),
    "CL": Stage("lowering", ("run_lowered",), ("CL-15", "CL-1")),
    "RO": Stage("reorder", ("reorder", "ReorderConfig", "CostModel"),
                ("RO-3", "RO-4", "RO-5", "RO-6", "RO-7", "RO-8", "RO-9", "RO-13", "RO-1",
                 "RO-2")),
    "MEM": Stage("memory", ("plan_memory",), ("MEM-1", "MEM-2", "MEM-3", "MEM-5", "MEM-9")),
    # torch.compile of each program: seconds, not a fraction of one; only when named.
    "E2E": Stage("compile_backend", ("make",), ("E2E-3", "E2E-7")),
}
DEFAULT_STAGES = ("BK", "CL", "RO", "MEM")


# --------------------------------------------------------------------------------------
# Programs
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stmt:
    op: str  # the generator's name for it (one method of _Builder each)
    lines: tuple[str, ...]  # its source, one line each


UPSTREAM_OPS = "ops = torch.ops._c10d_functional"  # the line of a program on upstream's ops


@dataclass(frozen=True)
class Program:
    world_size: int
    inputs: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) of inputs[i]
    stmts: tuple[Stmt, ...]
    outputs: tuple[str, ...]
    barrier_in_flight: bool  # a record_ runs while a collective is in flight
    # Upstream's op namespace instead of the backend's (the passes read both, BK-1), and
    # the outputs as a dict (a pytree a pass's code generator must keep): drawn last, so
    # that the statements of a seed's program do not depend on them.
    upstream_ops: bool = False
    dict_outputs: bool = False
    # Each bucketing candidate's (pass, key, bytes), in program order (BK-2, BK-3): the caps
    # are drawn at their bounds from it.
    candidates: tuple[tuple[str, tuple, int], ...] = ()
    # The bytes of each sum all_reduce on WORLD: the one-shot threshold is drawn at them.
    one_shot_bytes: tuple[int, ...] = ()

    def source(self) -> str:
        names = [f"x{i}" for i in range(len(self.inputs))]
        body = [line for s in self.stmts for line in s.lines]
        ops = [f"    {UPSTREAM_OPS}"] if self.upstream_ops else []
        if self.dict_outputs:
            first, rest = self.outputs[0], self.outputs[1:]
            result = f"{{'first': {first}, 'rest': [{', '.join(rest)}]}}"
        else:
            result = f"[{', '.join(self.outputs)}]"
        return "\n".join([*self.header(), "def program(ops, *inputs):",
                          f"    {', '.join(names)}, = inputs", *ops,
                          *[f"    {line}" for line in body],
                          f"    return {result}", ""])

    def header(self) -> list[str]:
        """Comments that make the source a reproducer: what `G` and `inputs` are."""
        groups = "; ".join(f"G[{k!r}]: " + ("WORLD" if rows is None else
                                             f"this rank's row of {[list(r) for r in rows]}")
                           for k, rows in GROUPS[self.world_size].items())
        inputs = ", ".join(f"x{i} {dt}{list(shape)}" for i, (shape, dt) in enumerate(self.inputs))
        return [f"# {self.world_size} gloo ranks; group names: {groups}",
                "# inputs[i] = conformance.oracle.rank_input(rank, shape, dtype, salt=i): "
                + inputs]


@dataclass
class Value:
    """A tensor the program holds, as the generator knows it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bound: int  # the largest magnitude it can hold
    buffer: int  # the storage it lives in (a view shares its base's)
    contiguous: bool
    owner: bool  # the buffer's first value, not a view of it


@dataclass
class Pending:
    """A collective issued and not yet waited: `handle` is read by its wait only."""

    handle: str
    result: Value  # what its wait returns (the name is given at the wait)
    kind: str
    writes: int | None  # the buffer it writes in place until the wait (all_reduce_, out=)
    coalesced: bool = False  # one output of a coalesced collective


def _numel(shape) -> int:
    return math.prod(shape)


def _factorings(numel: int) -> list[tuple[int, ...]]:
    return [(numel,)] + [(a, numel // a) for a in range(2, numel) if numel % a == 0]


class _Builder:
    """Draws a program statement by statement, keeping every rule the program needs to be
    a valid SPMD program of exact values:
    - a collective's result is read only after its wait; a buffer an in-place collective
      (all_reduce_, an out= all_gather) writes is read only after its wait;
    - an in-place write (add_, mul_, all_reduce_) goes to a buffer of the program that
      nothing has read yet (a collective's input included): the graph passes reorder along
      data edges (BK-7 assumes a functional graph), so a reader must not race a writer;
    - every value stays below `EXACT[dtype]`, sums over a group included."""

    def __init__(self, draw, world_size: int, inputs):
        self.draw = draw
        self.groups = {k: world_size if rows is None else len(rows[0])
                       for k, rows in GROUPS[world_size].items()}
        self.stmts: list[Stmt] = []
        self.values: list[Value] = []
        self.pending: list[Pending] = []
        self.read: set[int] = set()
        self.busy: set[int] = set()
        self.unread: dict[str, Value] = {}
        self.count = 0
        self.buffers = 0
        self.barrier_in_flight = False
        self.candidates: list[tuple[str, tuple, int]] = []
        self.one_shot_bytes: list[int] = []  # WORLD's sum all_reduces: CL-10's bound
        self.communicated: list[str] = []  # values given to an out-of-place collective
        for i, (shape, dtype) in enumerate(inputs):
            self.values.append(Value(f"x{i}", shape, dtype, INPUT_BOUND, self._buffer(), True,
                                     True))
        self.inputs = {v.buffer for v in self.values}

    # ---- bookkeeping -------------------------------------------------------------------
    def _name(self, prefix="t") -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def _buffer(self) -> int:
        self.buffers += 1
        return self.buffers

    def _emit(self, op: str, *lines: str) -> None:
        self.stmts.append(Stmt(op, lines))

    def _new(self, like: Value, **changes) -> Value:
        """A value in a new buffer (unless `buffer` is given), unread."""
        fields = {"name": self._name(), "shape": like.shape, "dtype": like.dtype,
                  "bound": like.bound, "contiguous": True, "owner": True, **changes}
        fields.setdefault("buffer", None)
        fields["buffer"] = fields["buffer"] or self._buffer()
        value = Value(**fields)
        self.values.append(value)
        self.unread[value.name] = value
        return value

    def _use(self, *values: Value) -> None:
        for v in values:
            self.read.add(v.buffer)
            self.unread.pop(v.name, None)

    def _readable(self, keep=lambda v: True) -> list[Value]:
        """Values that may be read now, the latest first (hypothesis shrinks picks to 0)."""
        return [v for v in reversed(self.values) if v.buffer not in self.busy and keep(v)]

    def _pick(self, values: list):
        return values[self.draw(st.integers(0, len(values) - 1))]

    def _writable(self, v: Value) -> bool:
        return v.buffer not in self.inputs and v.buffer not in self.read

    # ---- steps -------------------------------------------------------------------------
    def step(self) -> None:
        kinds = ["compute", "collective", "compute", "fsdp", "tp", "record", "burst", "burst",
                 "chain", "cross", "one_shot", "one_shot"]
        if self.pending:
            kinds += ["wait", "wait"]
        getattr(self, "_" + self.draw(st.sampled_from(kinds)))()

    def finish(self, world_size: int, inputs) -> Program:
        """Wait every collective still in flight; return what nothing read."""
        while self.pending:
            self._wait_for(self.pending[0])
        outputs = tuple(self.unread) or (self.values[-1].name,)
        return Program(world_size, tuple(inputs), tuple(self.stmts), outputs,
                       self.barrier_in_flight, candidates=tuple(self.candidates),
                       one_shot_bytes=tuple(self.one_shot_bytes))

    def _compute(self) -> None:
        a = self._pick(self._readable())
        ops = [op for op, ok in (
            ("mul", True), ("relu", True), ("add", bool(self._addends(a))),
            # an int32 sum is an int64 (a dtype the vocabulary leaves out)
            ("sum", a.bound * a.shape[0] <= EXACT[a.dtype] and a.dtype != "i32"),
            ("mm", bool(self._factors(a))),
            ("cast", a.bound <= EXACT["bf16" if a.dtype == "f32" else "f32"]), ("view", True),
            ("t", len(a.shape) == 2), ("mul_out", True), ("inplace", self._writable(a)))
            if ok]
        getattr(self, "_" + self.draw(st.sampled_from(ops)))(a)

    def _scale(self, a: Value) -> int:
        return self.draw(st.sampled_from([k for k in (2, -1, 3) if a.bound * abs(k)
                                          <= EXACT[a.dtype]] or [-1]))

    def _mul(self, a: Value) -> Value:
        k = self._scale(a)
        self._use(a)
        out = self._new(a, bound=a.bound * abs(k), contiguous=a.contiguous)
        self._emit("mul", f"{out.name} = {a.name} * {k}")
        return out

    def _relu(self, a: Value) -> Value:
        self._use(a)
        out = self._new(a, contiguous=a.contiguous)
        self._emit("relu", f"{out.name} = torch.relu({a.name})")
        return out

    def _addends(self, a: Value) -> list[Value]:
        # Operands of one layout: the result then has it too (a 2-D value is either
        # row-major or transposed; `contiguous` says which, exactly).
        return self._readable(lambda b: b.shape == a.shape and b.dtype == a.dtype and
                              b.contiguous == a.contiguous and
                              a.bound + b.bound <= EXACT[a.dtype])

    def _add(self, a: Value) -> Value:
        b = self._pick(self._addends(a))
        self._use(a, b)
        out = self._new(a, bound=a.bound + b.bound, contiguous=a.contiguous)
        self._emit("add", f"{out.name} = {a.name} + {b.name}")
        return out

    def _sum(self, a: Value) -> Value:
        self._use(a)
        out = self._new(a, shape=(1, *a.shape[1:]), bound=a.bound * a.shape[0])
        self._emit("sum", f"{out.name} = {a.name}.sum(0, keepdim=True)")
        return out

    def _factors(self, a: Value) -> list[Value]:
        if len(a.shape) != 2 or a.dtype != "f32":
            return []
        return self._readable(lambda b: len(b.shape) == 2 and b.dtype == "f32" and
                              b.shape[0] == a.shape[1] and
                              a.bound * b.bound * a.shape[1] <= EXACT["f32"])

    def _mm(self, a: Value) -> Value:
        b = self._pick(self._factors(a))
        self._use(a, b)
        out = self._new(a, shape=(a.shape[0], b.shape[1]), bound=a.bound * b.bound * a.shape[1])
        self._emit("mm", f"{out.name} = {a.name} @ {b.name}")
        return out

    def _cast(self, a: Value, dtype: str | None = None) -> Value:
        # Both 16-bit floats: of one size, different keys (BK-2).
        dtype = dtype or (self.draw(st.sampled_from(["bf16", "f16"])) if a.dtype == "f32"
                          else "f32")
        self._use(a)
        out = self._new(a, dtype=dtype, contiguous=a.contiguous)
        self._emit("cast", f"{out.name} = {a.name}.to({DTYPES[dtype]})")
        return out

    def _view(self, a: Value) -> Value:
        """`view` of a contiguous value (an alias), `reshape` of another (a copy)."""
        shape = self._pick([s for s in _factorings(_numel(a.shape)) if s != a.shape]
                           or [a.shape])
        if a.contiguous:
            out = self._new(a, shape=shape, buffer=a.buffer, owner=False)
            self._emit("view", f"{out.name} = {a.name}.view({list(shape)})")
        else:
            self._use(a)
            out = self._new(a, shape=shape)
            self._emit("reshape", f"{out.name} = {a.name}.reshape({list(shape)})")
        return out

    def _t(self, a: Value) -> Value:
        out = self._new(a, shape=a.shape[::-1], buffer=a.buffer, owner=False,
                        contiguous=not a.contiguous or min(a.shape) == 1)
        self._emit("t", f"{out.name} = {a.name}.t()")
        return out

    def _mul_out(self, a: Value) -> Value:
        k = self._scale(a)
        self._use(a)
        out = self._new(a, bound=a.bound * abs(k))
        self._emit("mul_out", f"{out.name} = torch.empty({list(a.shape)}, "
                              f"dtype={DTYPES[a.dtype]})",
                   f"torch.mul({a.name}, {k}, out={out.name})")
        return out

    def _inplace(self, a: Value) -> None:
        """add_ or mul_ on a buffer of the program nothing has read (after its wait, for a
        collective's result): every alias of it now holds the new values."""
        op = self.draw(st.sampled_from(["add_", "mul_"]))
        k = 1 if op == "add_" else self._scale(a)
        bound = a.bound + 1 if op == "add_" else a.bound * abs(k)
        if bound > EXACT[a.dtype]:
            op, k, bound = "mul_", -1, a.bound
        for v in self.values:
            if v.buffer == a.buffer:
                v.bound = max(v.bound, bound)
        self.unread[a.name] = a
        self._emit(op, f"{a.name}.{op}({k})")

    def _record(self) -> None:
        """The opaque side effect: a barrier to the reorder pass (RO-6)."""
        values = self._readable(lambda v: v.buffer not in self.inputs)
        if not values:
            return self._compute()
        a = self._pick(values)
        self._use(a)
        self.barrier_in_flight |= bool(self.pending)
        self._emit("record", f"torch.ops.refimpl_conformance.record_({a.name})")

    # ---- collectives -------------------------------------------------------------------
    def _collective(self, a: Value | None = None, kinds=None, reduce_ops=REDUCE_OPS,
                    group: str | None = None) -> None:
        group = group or self.draw(st.sampled_from(["world", *self.groups]))  # WORLD: 2x
        n = self.groups[group]
        reduce_op = self.draw(st.sampled_from(reduce_ops))
        grow = n if reduce_op == "sum" else 1
        eligible = {
            "all_gather": lambda v: True,
            "all_gather_out": lambda v: True,
            "reduce_scatter": lambda v: v.shape[0] % n == 0 and v.bound * grow <= EXACT[v.dtype],
            "all_reduce": lambda v: v.bound * grow <= EXACT[v.dtype],
            "all_reduce_": lambda v: (v.owner and v.contiguous and self._writable(v) and
                                      v.bound * grow <= EXACT[v.dtype]),
        }
        candidates = [a] if a is not None else self._readable()
        kinds = [k for k in (kinds or KINDS) if any(eligible[k](v) for v in candidates)]
        if not kinds:
            return self._compute()
        kind = self.draw(st.sampled_from(kinds))
        x = self._pick([v for v in candidates if eligible[kind](v)])
        coalesce = kind in ("all_gather", "reduce_scatter", "all_reduce") and \
            a is None and self.draw(st.integers(0, 3)) == 3
        ys = [self._pick([v for v in candidates if v.dtype == x.dtype and eligible[kind](v)])
              ] if coalesce else []
        issued = self._issue(kind, [x, *ys], group, n, reduce_op, grow)
        if self.draw(st.booleans()):  # waited at once; else some later step waits
            for p in issued:
                self._wait_for(p)

    def _issue(self, kind, xs, group, n, reduce_op, grow) -> list[Pending]:
        """Emit the collective (coalesced for two inputs); its results wait in `pending`."""
        results = [self._result(kind, x, n, grow) for x in xs]
        if len(xs) == 1 and kind in ("all_gather", "reduce_scatter", "all_reduce"):
            itemsize = DTYPES[xs[0].dtype].itemsize
            in_bytes, out_bytes = (_numel(v.shape) * itemsize for v in (xs[0], results[0]))
            key = (group, *([reduce_op] if kind != "all_gather" else []), xs[0].dtype)
            self.candidates.append((f"bucket_{kind}", key, max(in_bytes, out_bytes)))
            if kind == "all_reduce" and group == "world" and reduce_op == "sum":
                self.one_shot_bytes.append(in_bytes)
        handles = [self._name("h") for _ in xs]
        lines = []
        out = self._name("t") if kind == "all_gather_out" else None
        if out is not None:  # the buffer it gathers into
            lines.append(f"{out} = {xs[0].name}.new_empty({list(results[0].shape)})")
        names = [x.name for x in xs]
        lines.append(ISSUE[kind].format(
            h=", ".join(handles), c="_coalesced" if len(xs) > 1 else "", n=n, g=f"G[{group!r}]",
            x=f"[{', '.join(names)}]" if len(xs) > 1 else names[0], op=reduce_op, out=out))
        self._emit(kind + ("_coalesced" if len(xs) > 1 else ""), *lines)
        writes = None  # the buffer it writes in place until its wait
        if kind == "all_reduce_":
            writes = results[0].buffer = xs[0].buffer
            results[0].owner = False
            for v in self.values:  # every alias of the buffer holds the sum after the wait
                if v.buffer == writes:
                    v.bound = max(v.bound, results[0].bound)
            self.unread.pop(xs[0].name, None)
        else:
            self._use(*xs)  # held until the wait: nothing may write them afterwards
            self.communicated += [x.name for x in xs]
            writes = results[0].buffer if out is not None else None
        if writes is not None:
            self.busy.add(writes)
        issued = [Pending(h, r, kind, writes, len(xs) > 1)
                  for h, r in zip(handles, results, strict=True)]
        self.pending += issued
        return issued

    def _result(self, kind: str, x: Value, n: int, grow: int) -> Value:
        """What the wait of `kind` on `x` returns (named at the wait)."""
        rows = {"all_gather": n * x.shape[0], "all_gather_out": n * x.shape[0],
                "reduce_scatter": x.shape[0] // n}.get(kind, x.shape[0])
        bound = x.bound if kind.startswith("all_gather") else x.bound * grow
        return Value("", (rows, *x.shape[1:]), x.dtype, bound, self._buffer(), True, True)

    def _wait(self) -> None:
        self._wait_for(self._pick(self.pending[::-1]))  # shrinks to the oldest

    def _wait_for(self, p: Pending) -> Value:
        self.pending.remove(p)
        self.busy.discard(p.writes)
        if p.kind != "all_reduce_":
            out = self._new(p.result, buffer=p.result.buffer, owner=p.result.owner)
        else:
            # The wait op's result is a copy of the buffer (refimpl, FC-5) or the buffer
            # itself (upstream): backend-defined, and lowered (CL-9) an alias even for
            # refimpl. Neither is written again, so every reading means the same.
            out = self._new(p.result, owner=False)
            self.read.update((p.writes, out.buffer))
        self._emit("wait", f"{out.name} = ops.wait_tensor({p.handle})")
        if p.coalesced:
            # Not written in place: upstream's wait of a coalesced reduce_scatter's other
            # output writes this one again (upstream_findings.md, section 4), so an
            # order that moves that wait below the write would change a value.
            self.read.add(out.buffer)
        if p.kind != "all_reduce_" and self.draw(st.integers(0, 7)) == 7:
            # Waited twice: the collective has two users, so bucketing must leave it (BK-1).
            # A copy (refimpl) or the same tensor (upstream): neither is written again.
            again = self._new(p.result, buffer=out.buffer, owner=False)
            self.read.add(out.buffer)
            self._emit("wait", f"{again.name} = ops.wait_tensor({p.handle})")
        return out

    # ---- FSDP and TP shapes ------------------------------------------------------------
    def _cross(self) -> None:
        """all_gathers of two or three keys (group, dtype) that make a candidate depend on
        its key's open bucket only through other buckets (BK-4): key 1's gather feeds key
        2's (and on to the last key's), whose bucket already holds an independent gather
        `other`; a second gather of key 1 reads `other`'s result, so merging it into key 1's
        bucket would close a cycle through the others."""
        values = self._readable(lambda v: v.bound <= EXACT["bf16"])
        if not values:
            return self._compute()
        combos = [(g, d) for g in ["world", *self.groups] for d in ("f32", "bf16", "f16")]
        keys = self.draw(st.permutations(combos))[:self.draw(st.integers(2, 3))]

        def gather(v: Value, key, wait: bool):
            group, dtype = key
            v = v if v.dtype == dtype else self._cast(v, dtype)
            n = self.groups[group]
            (pending,) = self._issue("all_gather", [v], group, n, "sum", n)
            return self._wait_for(pending) if wait else pending

        other = gather(self._pick(values), keys[-1], wait=False)
        result = gather(self._pick(values), keys[0], wait=True)
        for key in keys[1:-1]:
            result = gather(result, key, wait=True)
        last = gather(result, keys[-1], wait=False)
        gather(self._wait_for(other), keys[0], wait=True)
        self._wait_for(last)

    def _chain(self) -> None:
        """Collectives of two keys (two groups, or two dtypes of all_gather), each reading
        the last one's result: a candidate that depends on its key's open bucket through a
        bucket of the other key must be left alone (BK-4)."""
        kind = self.draw(st.sampled_from(["all_gather", "all_reduce"]))
        groups = self.draw(st.permutations(["world", *self.groups]))[:2]
        a = self._pick(self._readable(lambda v: v.bound <= EXACT["bf16"]) or self._readable())
        for i in range(self.draw(st.integers(3, 4))):
            before = len(self.values)
            self._collective(a, [kind], ("max",), group=groups[i % 2])
            if len(self.values) == before:  # nothing issued, or not waited yet
                return
            a = self.values[-1]

    def _burst(self) -> None:
        """Two to four collectives of one kind and group in a row, as FSDP gathers a layer's
        shards (cast to one dtype) and scatters its gradients, or DDP reduces them: the runs
        bucketing merges, and splits at a cap or a dependency (BK-3, BK-4)."""
        kind = self.draw(st.sampled_from(["all_gather", "reduce_scatter", "all_reduce"]))
        group = self.draw(st.sampled_from(["world", *self.groups]))
        dtype = self.draw(st.sampled_from(["bf16", "f16", None]))  # None: as they are
        for _ in range(self.draw(st.integers(2, 4))):
            values = self._readable(lambda v: v.bound <= EXACT["bf16"]) if dtype else []
            if kind == "all_gather" and values:
                shard = self._pick(values)
                self._collective(shard if shard.dtype == dtype else self._cast(shard, dtype),
                                 ["all_gather"], group=group)
            else:
                self._collective(None, [kind], ("sum",), group=group)

    def _fsdp(self) -> None:
        """A parameter shard cast to bf16 or f16 (if it is f32) and all-gathered."""
        shards = self._readable(lambda v: v.bound <= EXACT["bf16"])
        if not shards:
            return self._compute()
        shard = self._pick(shards)
        if shard.dtype == "f32":
            shard = self._cast(shard)
        self._collective(shard, ["all_gather", "all_gather", "all_gather_out"])

    def _tp(self) -> None:
        """A matmul whose result is all-reduced (or reduce-scattered)."""
        pairs = [a for a in self._readable() if self._factors(a)]
        if not pairs:
            return self._compute()
        out = self._mm(self._pick(pairs))
        # WORLD most often: the group symmetric memory is enabled for (CL-10's one-shot)
        group = self.draw(st.sampled_from(["world", "world", *self.groups]))
        self._collective(out, ["all_reduce", "all_reduce", "reduce_scatter"], ("sum",),
                         group=group)


    # ---- one-shot all-reduce and the steps around it (CL-10, CL-17) -------------------
    def _one_shot(self) -> None:
        """A sum all_reduce on WORLD of a computed value (TP's row-parallel output) in one
        of CL-10's dtypes or not (f64 is not one-shot, int32 is), now and then of exactly
        the default threshold's bytes or one element more, with chains of add/sub/mul by
        a number before and after it (CL-17's steps) and forms that are not steps
        (`alpha=`, a bool, an int that has no exact double, an int32 tensor times a float);
        sometimes avg or max instead of sum, or a write or a collective between the chain
        and the all_reduce."""
        n = self.groups["world"]
        values = self._readable(lambda v: v.bound <= 8)
        if not values:
            return self._compute()
        dtype = self.draw(st.sampled_from(["f32", "f32", "bf16", "f16", "f64", "i32"]))
        a = self._pick(values)
        if a.dtype != dtype:
            a = self._cast(a, dtype)
        if self.draw(st.integers(0, 3)) == 3:  # the default threshold's bytes, or over
            a = self._repeat(a, DEFAULT_ONE_SHOT_BYTES // DTYPES[a.dtype].itemsize
                             + self.draw(st.integers(0, 1)))
        reduce_op = self.draw(st.sampled_from(["sum", "sum", "sum", "sum", "avg", "max"]))
        if reduce_op == "avg" and a.dtype in ("f32", "bf16", "f16", "f64"):
            a = self._point(a, ("mul", n), n)  # so that the average is a whole number
        elif reduce_op == "avg":
            reduce_op = "sum"
        chain = []
        for _ in range(self.draw(st.integers(0, 3))):
            chain.append(a := self._point(a, self._step_form(a), n))
        if len(chain) > 1 and self.draw(st.integers(0, 3)) == 3:
            self._relu(self._pick(chain[:-1]))  # a step read twice ends the prologue
        self._between(a)
        if a.buffer in self.busy or a.bound * n > EXACT[a.dtype]:
            return
        grow = 1 if reduce_op == "max" else n
        (pending,) = self._issue("all_reduce", [a], "world", n, reduce_op, grow)
        if reduce_op == "avg":
            pending.result.bound = a.bound
        if self.draw(st.integers(0, 3)) == 3:
            return  # waited by a later step: no epilogue
        result = self._wait_for(pending)
        for _ in range(self.draw(st.integers(0, 3))):
            result = self._point(result, self._step_form(result, last=True), 1)

    def _repeat(self, a: Value, numel: int) -> Value:
        self._use(a)
        out = self._new(a, shape=(numel,))
        self._emit("repeat", f"{out.name} = {a.name}.reshape(-1)[:1].repeat({numel})")
        return out

    def _step_form(self, a: Value, last: bool = False) -> tuple:
        """How the next step is written: a step of CL-17, or a form that is not one."""
        steps = [("mul", 2), ("mul", -1), ("add", 1), ("sub", 1), ("rmul", 3), ("mul", 2.0)]
        others = [("alpha", 1), ("bool", True)]
        if last and a.dtype == "f32":
            # No exact double; every rank's value becomes 2**53 (in f32, so after the
            # all_reduce only: before it, the sum would leave the exact range)
            others.append(("add", 2**53 + 1))
        return self.draw(st.sampled_from(steps if self.draw(st.integers(0, 2)) else others))

    def _point(self, a: Value, form: tuple, n: int) -> Value:
        """`a` op number; within the exact range after a sum over `n` ranks (else `a` * -1)."""
        op, k = form
        if op in ("mul", "rmul"):
            bound = a.bound * abs(int(k))
        elif op == "alpha":
            bound = a.bound + 2
        elif op == "bool":
            bound = a.bound
        else:
            bound = a.bound + abs(k)
        if bound * n > EXACT[a.dtype] and k != 2**53 + 1:
            op, k, bound = "mul", -1, a.bound
        self._use(a)
        # int32 times a float is a float32 (not a step: the dtype changes, CL-17)
        dtype = "f32" if a.dtype == "i32" and isinstance(k, float) else a.dtype
        out = self._new(a, dtype=dtype, bound=2**60 if k == 2**53 + 1 else bound,
                        contiguous=a.contiguous)
        text = {"mul": f"{a.name} * {k!r}", "rmul": f"{k!r} * {a.name}",
                "add": f"{a.name} + {k!r}", "sub": f"{a.name} - {k!r}",
                "alpha": f"torch.add({a.name}, 1, alpha=2)", "bool": f"{a.name} * True"}[op]
        self._emit("point", f"{out.name} = {text}")
        return out

    def _between(self, a: Value) -> None:
        """Now and then, a node between a chain and its all_reduce: a write of another
        buffer (not of the chain's) or a collective (a coalesced one reads getitems)."""
        what = self.draw(st.sampled_from(["none", "none", "write", "collective"]))
        if what == "write":
            others = [v for v in self._readable(self._writable) if v.buffer != a.buffer]
            if others:
                self._inplace(self._pick(others))
        elif what == "collective":
            self._collective()


@dataclass(frozen=True)
class Case:
    """One drawn program and the options of every stage."""

    program: Program
    options: dict = field(hash=False)

    def stage_options(self, stage: str) -> dict:
        return self.options[stage]


@st.composite
def programs(draw) -> Program:
    # The first draw differs from the simplest example's in every example after it
    # (hypothesis looks for a new one there): the step count, not the world size.
    steps = draw(st.integers(1, MAX_STEPS))
    world_size = draw(st.sampled_from(sorted(GROUPS)))
    dtypes = ["f32", "f32", "bf16", "f16"]
    inputs = [(draw(st.sampled_from(INPUT_SHAPES)), draw(st.sampled_from(dtypes)))
              for _ in range(draw(st.integers(1, 4)))]
    builder = _Builder(draw, world_size, inputs)
    for _ in range(steps):
        builder.step()
    program = builder.finish(world_size, inputs)
    program = dataclasses.replace(program, upstream_ops=draw(st.booleans()),
                                  dict_outputs=draw(st.booleans()))
    # Now and then the program also returns a value other nodes read: an output is kept to
    # the end whoever reads it (MEM-7), which an output nobody else reads never shows.
    # Half the time one a collective read: lowered one-shot, it is a comm buffer, which
    # the program must return as a clone (CL-13).
    read = [v.name for v in builder.values
            if v.name not in program.outputs and not v.name.startswith("x")]
    sent = [name for name in read if name in builder.communicated]
    if read and draw(st.booleans()):
        read = sent if sent and draw(st.booleans()) else read
        kept = read[draw(st.integers(0, len(read) - 1))]
        program = dataclasses.replace(program, outputs=(*program.outputs, kept))
    return program


# Bad options, drawn now and then instead of a program's valid ones: each MUST be refused
# on every rank with the error type given, naming the option (CL-16, RO-1).
BAD_OPTIONS = {
    "CL": (("one_shot_all_reduce_threshold_bytes", -1, "ValueError"),
           ("one_shot_all_reduce_threshold_bytes", True, "TypeError"),
           ("auto_select", 1, "TypeError")),
    "RO": (("memory_budget", -0.5, "ValueError"), ("memory_budget", math.nan, "ValueError"),
           ("memory_budget", True, "TypeError"), ("max_in_flight", {"all_gather": 0}, "ValueError"),
           ("max_in_flight", {"all_gather": True}, "TypeError"),
           ("max_in_flight", {"gather": 1}, "ValueError")),
}
BAD_RULE = {"CL": "CL-16", "RO": "RO-1"}
# Each program is also lowered under these (on WORLD's symmetric memory), its structure
# checked against the model and its values against eager's: the one-shot path with SPEC's
# default threshold, without and with fusion, whatever the drawn options are.
CL_VARIANTS = ({"auto_select": True}, {"auto_select": True, "fuse_pointwise": True})
OWN_CL_OPTIONS = ("fuse_pointwise", "force_one_shot_all_reduce")
# CommLoweringConfig's fields the CL stage draws (None in the options: left out).
CL_OPTIONS = ("auto_select", "one_shot_all_reduce_threshold_bytes", "fuse_pointwise",
              "reorder_for_compute_comm_overlap", "force_one_shot_all_reduce")


def _bounds(program: Program, pass_name: str) -> tuple[int, ...]:
    """Caps at a bucket's bounds (BK-3): the bytes of two or three consecutive candidates
    of one key, and a byte less (where the last of them no longer fits)."""
    by_key: dict[tuple, list[int]] = {}
    for name, key, size in program.candidates:
        if name == pass_name:
            by_key.setdefault(key, []).append(size)
    sums = {sum(sizes[i:i + k]) for sizes in by_key.values() for k in (2, 3)
            for i in range(len(sizes) - k + 1)}
    return tuple(sorted(sums | {b - 1 for b in sums}))


def _gather_options(draw, program: Program) -> dict:
    """BK's other options now and then (each pass's default otherwise): the out-of-place
    gather (BK-8), gathers of bytes (BK-12), and a spoiled candidate (BK-16) or cap (BK-3):
    a pass that has candidates, the argument spoiled, which candidate or bad cap."""
    options = {}  # each shrinks to the default (a backend may not implement the option)
    if draw(st.integers(0, 3)) == 3:
        options["use_out_variant"] = False
    if draw(st.integers(0, 3)) == 3:
        options["mixed_dtypes"] = True
    passes = sorted({name for name, _, _ in program.candidates})
    if passes and draw(st.integers(0, 3)) == 3:
        name = draw(st.sampled_from(passes))
        arguments = {"bucket_all_gather": ["group_name", "group_size"],
                     "bucket_reduce_scatter": ["group_name", "group_size", "reduce_op"],
                     "bucket_all_reduce": ["group_name", "reduce_op"]}[name]
        arguments.append("bucket_cap_mb_by_bucket_idx")
        options["bad"] = (name, draw(st.sampled_from(arguments)),
                          draw(st.integers(0, len(BAD_CAPS) - 1)))
    return options


def _threshold(draw, program: Program) -> int | None:
    """CL-10's threshold: SPEC's default (left out), at an all_reduce's bytes or a byte
    under, or one of a few fixed ones; a third each."""
    bounds = sorted({b - d for b in program.one_shot_bytes for d in (0, 1)})
    how = draw(st.sampled_from(("default", "bound", "fixed") if bounds else
                               ("default", "fixed")))
    if how == "default":
        return None
    if how == "bound":
        return draw(st.sampled_from(bounds))
    return draw(st.sampled_from((128 * 1024, 64, 0)))


def _options(draw, program: Program) -> dict:
    caps = {p: tuple(draw(st.lists(st.sampled_from(CAP_BYTES + _bounds(program, p)),
                                   min_size=1, max_size=2)))
            for p in BUCKET_PASSES}
    # A barrier with a collective in flight can make one in flight at a time impossible
    # (RO-6 holds both sides), which SPEC leaves open: such programs get no limit.
    limits = [{}] if program.barrier_in_flight else [{}, {"all_gather": 1}]
    options = {
        "BK": {"caps_bytes": caps, **_gather_options(draw, program)},
        # The one-shot path (CL-10) needs all three: drawn more often, and shrunk to.
        # None: the option left out, so that SPEC's default applies (CL-1); the flags
        # drawn on are refimpl's own (the torch adapter implements neither).
        "CL": {"auto_select": draw(st.sampled_from((True, True, False))),
               "one_shot_all_reduce_threshold_bytes": _threshold(draw, program),
               "symm_mem_world": draw(st.sampled_from((True, True, False))),
               "fuse_pointwise": draw(st.sampled_from((None, None, True))),
               "reorder_for_compute_comm_overlap": draw(st.sampled_from((None, None, True))),
               "force_one_shot_all_reduce": draw(st.sampled_from((None,) * 5 + (True,)))},
        "RO": {"memory_budget": draw(st.sampled_from((math.inf, 0.1, 0.0))),
               "max_in_flight": draw(st.sampled_from(limits)),
               "bucketed_first": draw(st.booleans())},
        "MEM": {},
        "E2E": {"bucket_cap_mb": draw(st.sampled_from((None, 25.0, 0.0002))),
                "lowering": draw(st.sampled_from((None, {}, {"auto_select": True}))),
                "reorder": draw(st.sampled_from((None, {}, {"memory_budget": 0.0})))},
    }
    # Drawn last, so that a seed's valid options do not depend on them; one case in six.
    for stage, bad in BAD_OPTIONS.items():
        options[stage]["bad"] = draw(st.sampled_from((None,) * 5 * len(bad) + bad))
    return options


def _refused(stage: str, bad, make) -> list[str]:
    """`make()` with one bad option: the problems if it is not refused as BAD_OPTIONS says."""
    name, value, error = bad
    try:
        make()
    except Exception as exc:  # the type is what is checked
        if type(exc).__name__ == error and name in str(exc):
            return []
        return [f"{BAD_RULE[stage]}: {name}={value!r} raised {type(exc).__name__}: "
                f"{_short(str(exc), 2)} (expected {error} naming {name})"]
    return [f"{BAD_RULE[stage]}: {name}={value!r} was not refused (expected {error})"]


@st.composite
def cases(draw) -> Case:
    program = draw(programs())
    return Case(program, _options(draw, program))


# --------------------------------------------------------------------------------------
# On a rank: build the program, run one stage, return what is wrong ([] when nothing)
# --------------------------------------------------------------------------------------
def _groups_on_rank(fc, world_size: int) -> dict[str, str]:
    """G: group key -> this rank's group name; every rank makes the groups together."""
    from conformance.bucketing_programs import group_of

    return {key: fc.resolve_group_name(dist.group.WORLD if rows is None else group_of(rows))
            for key, rows in GROUPS[world_size].items()}


def _load(spec: str, source: str, inputs):
    """(backend, fn(*inputs) against the backend's ops, this rank's inputs, G)."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    groups = _groups_on_rank(fc, dist.get_world_size())
    namespace = {"torch": torch, "G": groups}
    exec(compile(source, "<fuzz program>", "exec"), namespace)
    rank = dist.get_rank()
    xs = [rank_input(rank, shape, DTYPES[dt], salt=i) for i, (shape, dt) in enumerate(inputs)]
    return backend, functools.partial(namespace["program"], fc.ops), xs, groups


def _trace(fn, xs) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*[x.clone() for x in xs])


def _cap_fn(caps_bytes, asked: list | None = None):
    """Caps in MiB by bucket index (the last one for every later index); the indices asked
    go to `asked`."""
    caps = [b / 2**20 for b in caps_bytes]

    def cap(i):
        if asked is not None:
            asked.append(i)
        return caps[min(i, len(caps) - 1)]
    return cap


def _collective_keys(gm, label: dict[str, str]) -> Counter:
    """(kind, group key, dtype) -> how many collectives the graph issues."""
    return Counter(signature[:3] for signature in bucket_model.observed(gm, label))


def _side_by_side(want, got, sort_logs=False) -> str:
    """rp.differences of two (outputs, record_ log) runs; logs compared as multisets when
    the pass may move a side effect along its data edges (BK-7: a functional graph)."""
    if sort_logs:
        want, got = (want[0], sorted(want[1])), (got[0], sorted(got[1]))
    return rp.differences(want, got)


def bucketing_on_rank(spec: str, source: str, inputs, options) -> dict:
    """BK: the backend's passes on the traced program give its values bit for bit, true
    meta, and the collectives conformance.bucket_model plans from SPEC (which merge, where
    each stands, which caps are asked); each pass logs its numbers (BK-15), tags its blocks
    (BK-17) and, with nothing to merge, changes nothing (BK-5); a spoiled candidate is
    refused (BK-16)."""
    from conformance.true_meta import MetaChecker

    backend, fn, xs, groups = _load(spec, source, inputs)
    bucketing = backend.require("bucketing", *STAGES["BK"].attrs)
    label = {name: key for key, name in groups.items()}
    original, bucketed = _trace(fn, xs), _trace(fn, xs)
    passes = [(name, getattr(bucketing, name)) for name in BUCKET_PASSES
              if hasattr(bucketing, name)]  # bucket_all_reduce is optional
    model = [(name.removeprefix("bucket_"), _cap_fn(options["caps_bytes"][name]))
             for name, _ in passes]
    gather_options = {k: options[k] for k in ("use_out_variant", "mixed_dtypes") if k in options}
    mixed = gather_options.get("mixed_dtypes", False)
    want = bucket_model.predict(original, model, label, mixed_dtypes=mixed)
    if options.get("bad") and want.candidates[options["bad"][0].removeprefix("bucket_")]:
        return {"problems": _spoiled_candidate_refused(bucketed, passes, options, want),
                "merges": []}
    problems = []
    for name, bucket in passes:
        problems += _one_pass(bucketed, name, bucket, options,
                              gather_options if name == "bucket_all_gather" else {}, want)
    problems += _bucket_differences(original, model, label, want,
                                    bucket_model.observed(bucketed, label), mixed)
    traced, checker = MetaChecker(original), MetaChecker(bucketed)
    want_values = rp._run(original, xs, traced)
    diff = _side_by_side(want_values, rp._run(bucketed, xs, checker), sort_logs=True)
    problems += [f"BK-8: bucketed values differ: {diff}"] if diff else []
    problems += _untrue("BK-7", traced, checker)
    merges = sorted(_collective_keys(bucketed, label).items())
    if not problems and passes[0][0] == "bucket_all_gather":
        problems += _second_gather_pass(bucketed, passes[0][1], options, gather_options, label,
                                        xs, want_values)
    return {"problems": problems, "merges": merges}


def _second_gather_pass(gm, bucket, options, kwargs, label, xs, want_values) -> list[str]:
    """The all_gather pass once more on its own result (BK-17: a later call numbers its
    buckets on from the largest index there, and a block whose collective it merges joins
    the new block); what it merges (gathers it left alone, out-of-place merged ones) is
    judged as the first call's, on the graph it was given. Its cap takes every candidate
    left (1 MiB), so it merges whatever the first call's caps kept apart."""
    options = {**options, "caps_bytes": {**options["caps_bytes"], "bucket_all_gather": (2**20,)}}
    cap = _cap_fn(options["caps_bytes"]["bucket_all_gather"])
    before = gm.graph.__class__()
    before.graph_copy(gm.graph, {})
    given = torch.fx.GraphModule(gm, before)
    want = bucket_model.predict(given, [("all_gather", cap)], label,
                                mixed_dtypes=kwargs.get("mixed_dtypes", False))
    indices = [tag[1] for n in gm.graph.nodes
               if (tag := n.meta.get("refimpl_block")) and tag[0].startswith("all_gather")]
    first = max(indices) + 1 if indices else 0
    problems = [p.replace("bucket_all_gather", "bucket_all_gather (called again)") for p in
                _one_pass(gm, "bucket_all_gather", bucket, options, kwargs, want, first)]
    problems += _bucket_differences(given, [("all_gather", cap)], label, want,
                                    bucket_model.observed(gm, label),
                                    kwargs.get("mixed_dtypes", False))
    tags = {n.meta.get("refimpl_block") for n in gm.graph.nodes}
    issued = {n.meta.get("refimpl_block") for n in gm.graph.nodes
              if bucket_model.kind_of(n) == "all_gather"}
    orphans = sorted(t for t in tags if t and t[0] in ("all_gather", "all_gather_wait") and
                     ("all_gather", t[1]) not in issued)
    if orphans:
        problems.append(f"BK-17: blocks {orphans} kept after bucket_all_gather (called again) "
                        f"merged their collective; they join the new block")
    diff = _side_by_side(want_values, rp._run(gm, xs), sort_logs=True)
    return problems + ([f"BK-8: values differ after bucket_all_gather ran again: {diff}"]
                       if diff else [])


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        if record.levelno == logging.INFO:
            self.lines.append(record.getMessage())


def _one_pass(gm, name: str, bucket, options, kwargs, want, first: int = 0) -> list[str]:
    """Run one pass on `gm`; what it did against the model, besides the collectives: the
    cap indices asked (BK-3), no change without a merge (BK-5), its INFO line (BK-15), the
    tags of its merged collectives and waits (BK-17)."""
    kind, asked, code = name.removeprefix("bucket_"), [], gm.code
    before = {n.name for n in gm.graph.nodes}
    logger, lines = logging.getLogger("refimpl.bucketing"), _Lines()  # named by BK-15
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        bucket(gm, _cap_fn(options["caps_bytes"][name], asked), **kwargs)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    problems = []
    if Counter(asked) != want.asks[kind]:
        problems.append(f"BK-3: {name} asked bucket_cap_mb_by_bucket_idx for indices "
                        f"{sorted(asked)}; its buckets open {sorted(want.asks[kind].elements())}")
    if not want.merged[kind] and gm.code != code:
        problems.append(f"BK-5: {name} had nothing to merge but changed the graph")
    numbers = [tuple(int(n) for n in re.findall(r"\d+", line)[:4]) for line in lines.lines]
    if numbers != [want.counts[kind]]:
        problems.append(f"BK-15: {name} logged {lines.lines} at INFO; one line with "
                        f"{want.counts[kind]} (candidates, merged, buckets, left alone) expected")
    merged = [n for n in gm.graph.nodes if n.name not in before and
              bucket_model.kind_of(n) == kind]
    tags = [(n.meta.get("refimpl_block"), [u.meta.get("refimpl_block") for u in n.users])
            for n in merged]
    expected = [((kind, i), [(f"{kind}_wait", i)]) for i in range(first, first + len(merged))]
    if tags != expected:
        problems.append(f"BK-17: {name}'s merged collectives and their waits are tagged {tags}, "
                        f"in program order {expected} expected")
    return problems


# BK-3's bad caps: what bucket_cap_mb_by_bucket_idx returns (a number that is no cap, or no
# number), and (last) a cap that is no callable; `which` of a "bad" option picks one.
BAD_CAPS = (True, 0, -1.0, math.inf, math.nan, "1", 1.0)


def _spoiled_candidate_refused(gm, passes, options, want) -> list[str]:
    """BK-16: one candidate given an argument the op would refuse (`options["bad"]`: the
    pass, the argument, which candidate); its pass MUST raise ValueError naming gm, the
    node, the argument and the rule, before it rewrites anything. BK-3: a pass whose cap
    callback returns no cap MUST raise ValueError naming it (TypeError for a cap that is
    no callable)."""
    pass_name, argument, which = options["bad"]
    kind = pass_name.removeprefix("bucket_")
    if argument == "bucket_cap_mb_by_bucket_idx":
        bad = BAD_CAPS[which % len(BAD_CAPS)]
        what, words = f"a cap of {bad!r}", [argument, "BK-3"]
        error = TypeError if which % len(BAD_CAPS) == len(BAD_CAPS) - 1 else ValueError
        caps = {pass_name: bad if error is TypeError else lambda i: bad}
    else:
        names = want.candidates[kind]
        node = next(n for n in gm.graph.nodes if n.name == names[which % len(names)])
        size = bucket_model._argument(node, "group_size")
        bad = {"group_name": "no-such-group", "reduce_op": "median",
               "group_size": (2 * size if which % 2 else size - 1) if size else None}[argument]
        _set_argument(node, argument, bad)
        gm.recompile()
        what, words, error, caps = (f"{node.name} with {argument}={bad!r}",
                                    ["gm", node.name, argument, "BK-16"], ValueError, {})
    rule = words[-1]
    for name, bucket in passes:
        code = gm.code
        try:
            bucket(gm, caps.get(name, _cap_fn(options["caps_bytes"][name])))
        except Exception as exc:
            if name != pass_name or type(exc) is not error:
                return [f"{rule}: {name} raised {type(exc).__name__} given {what}"
                        f"{'' if name == pass_name else ' (in another pass)'}: {exc}"]
            missing = [w for w in words if w not in str(exc)]
            return ([f"{rule}: {name}'s refusal of {what} does not name {missing}: {exc}"]
                    if missing else []) + \
                ([f"{rule}: {name} rewrote the graph before refusing {what}"]
                 if gm.code != code else [])
        if name == pass_name:
            return [f"{rule}: {name} accepted {what}"]
    return []


def _set_argument(node, argument: str, value) -> None:
    index = [a.name for a in node.target._schema.arguments].index(argument)
    if index < len(node.args):
        node.args = (*node.args[:index], value, *node.args[index + 1:])
    else:
        node.kwargs = {**node.kwargs, argument: value}


def _bucket_differences(original, model, label, want, got: list[tuple],
                        mixed: bool) -> list[str]:
    """The bucketed graph's collectives against the model's: which merged (named by the
    rule of the reading that explains them, bucket_model.diagnose), then their order."""
    if Counter(got) != Counter(want.signatures):
        rules = bucket_model.diagnose(original, model, label, got, mixed) or ["BK-3"]
        missing = Counter(want.signatures) - Counter(got)
        extra = Counter(got) - Counter(want.signatures)
        return [f"{rule}: the bucketed graph issues {sorted(extra.elements())} where SPEC's "
                f"buckets issue {sorted(missing.elements())} (kind, group, dtype, elements)"
                for rule in rules]
    if got != want.signatures:
        return [f"BK-7: collectives in the order {got}; SPEC's order (each merged one where "
                f"its last member was) is {want.signatures}"]
    return []


def lowering_on_rank(spec: str, source: str, inputs, options) -> dict:
    """CL: the lowered program computes what the eager program does (and says so in
    meta), and makes SPEC's choices (lowering_model)."""
    backend, fn, xs, groups = _load(spec, source, inputs)
    ns = backend.require("lowering", *STAGES["CL"].attrs)
    config = {k: options[k] for k in CL_OPTIONS if options.get(k) is not None}
    if options["symm_mem_world"]:
        config["enable_symm_mem_for"] = [groups["world"]]
    if options.get("bad"):  # CL-16: refused, naming the option
        config[options["bad"][0]] = options["bad"][1]
        return {"problems": _refused("CL", options["bad"], lambda: ns.run_lowered(
            fn, [x.clone() for x in xs], dict(config)))}
    try:
        return _lowering_checks(backend, ns, fn, xs, groups, config)
    except NotImplementedConcept:
        # refimpl's own flags (CL-10's force, CL-17's fusion): a backend without them is
        # checked under the rest of the options
        rest = {k: v for k, v in config.items() if k not in OWN_CL_OPTIONS}
        if rest == config:
            raise
        return _lowering_checks(backend, ns, fn, xs, groups, rest)


def _lowering_checks(backend, ns, fn, xs, groups: dict, config: dict) -> dict:
    from conformance.true_meta import MetaChecker

    enabled = _symm_mem_groups(backend, groups, config)
    traced_graph = functools.cache(lambda: _trace(fn, xs))  # the model's input, traced once
    if config.get("force_one_shot_all_reduce") and enabled is not None:
        refusal = lowering_model.forced_refusal(traced_graph(), config, enabled)
        if refusal is not None:  # CL-10: refused, naming the first condition that fails
            return {"problems": _forced_refused(refusal, lambda: ns.run_lowered(
                fn, [x.clone() for x in xs], dict(config)))}
    want = _observe(lambda: fn(*[x.clone() for x in xs]))
    checker = None
    if getattr(ns, "lowered_graph", None) is not None:
        checker = MetaChecker(ns.lowered_graph(fn, [x.clone() for x in xs], dict(config)))
        got = _observe(lambda: checker.call(*[x.clone() for x in xs]))
    else:
        got = _observe(lambda: ns.run_lowered(fn, [x.clone() for x in xs], dict(config)))
    problems = _differences(want, got, "lowered", "CL-15", "CL-1")
    if checker is not None and checker.untrue:
        traced = MetaChecker(_trace(fn, xs))
        traced.call(*[x.clone() for x in xs])
        problems += _untrue("CL-1", traced, checker)
    alloc_ids: list = []
    if checker is not None and not problems:
        problems += _kept_by_the_caller(checker.module, xs, want[0])
        problems += _blocking_waits_removed(checker.module)
        if enabled is not None:  # CL-2..CL-5, CL-10, CL-14, CL-17: SPEC's choices
            problems += lowering_model.differences(
                lowering_model.plan(traced_graph(), config, enabled),
                lowering_model.lowered(checker.module))
            for variant in CL_VARIANTS:
                if not problems:
                    problems += _variant_problems(ns, fn, xs, traced_graph(), variant, want,
                                                  groups, enabled)
        alloc_ids = lp.alloc_ids(checker.module)
        problems += _alloc_ids_problems(ns, fn, xs, config, alloc_ids)
    return {"problems": problems, "alloc_ids": alloc_ids}


def _variant_problems(ns, fn, xs, traced, variant: dict, want, groups: dict,
                      enabled: set[str]) -> list[str]:
    """The program lowered again under one of CL_VARIANTS (symmetric memory on WORLD):
    SPEC's choices, eager's values, no blocking kernel's wait kept (CL-9) and a second
    call leaving the first one's outputs (CL-13)."""
    config = {**variant, "enable_symm_mem_for": [groups["world"]]}
    lowered = ns.lowered_graph(fn, [x.clone() for x in xs], dict(config))
    shown = f" (lowered again with {variant})"
    problems = lowering_model.differences(
        lowering_model.plan(traced, config, enabled | {groups["world"]}),
        lowering_model.lowered(lowered))
    if not problems:
        got = _observe(lambda: lowered(*[x.clone() for x in xs]))
        problems = _differences(want, got, "lowered", "CL-15", "CL-1")
    if not problems:
        problems = _blocking_waits_removed(lowered) + _kept_by_the_caller(lowered, xs, want[0])
    return [p + shown for p in problems]


def _symm_mem_groups(backend, groups: dict, config: dict) -> set[str] | None:
    """The program's groups symmetric memory is enabled for when it is lowered (enabling
    lasts in a rank process: an earlier program's counts), or None if the backend cannot
    say."""
    try:
        sm = backend.require("symmetric_memory", "is_symm_mem_enabled_for_group")
    except NotImplementedConcept:
        return None
    return ({name for name in groups.values() if sm.is_symm_mem_enabled_for_group(name)}
            | set(config.get("enable_symm_mem_for", ())))


def _forced_refused(refusal: tuple[str, str], make) -> list[str]:
    """CL-10: with force_one_shot_all_reduce, an all_reduce that cannot go one-shot is
    refused with a CommBufferError (a ValueError) naming the first condition that fails."""
    node, word = refusal
    try:
        make()
    except NotImplementedConcept:
        raise
    except ValueError as exc:
        if any(w in str(exc) for w in word.split("|")):
            return []
        return [f"CL-10: force_one_shot_all_reduce: the all_reduce {node} was refused with "
                f"{type(exc).__name__}: {_short(str(exc), 2)} (expected the first condition "
                f"that fails named: {word!r})"]
    except Exception as exc:  # the type is what is checked
        return [f"CL-10: force_one_shot_all_reduce: the all_reduce {node} raised "
                f"{type(exc).__name__}: {_short(str(exc), 2)} (expected a CommBufferError "
                f"naming {word!r})"]
    return [f"CL-10: force_one_shot_all_reduce: the all_reduce {node} cannot go one-shot "
            f"({word}) and was not refused"]


def _blocking_waits_removed(gm) -> list[str]:
    """CL-9: the wait of a collective lowered to a blocking kernel is removed."""
    from conformance.reorder_rules import is_blocking, is_wait

    kept = [n.name for n in gm.graph.nodes if is_wait(n) and
            isinstance(n.args[0], torch.fx.Node) and is_blocking(n.args[0])]
    return [f"CL-9: waits {kept} of blocking kernels kept in the lowered graph"] if kept else []


def _alloc_ids_problems(ns, fn, xs, config, ids: list) -> list[str]:
    """CL-12: ids in [0, 2**63), distinct within the graph, the same in another lowering
    of the same graph, different under another alloc_id_namespace (and, across ranks,
    the same: _across_ranks)."""
    if not ids:
        return []
    problems = []
    if not all(isinstance(i, int) and 0 <= i < 2**63 for i in ids):
        problems.append(f"CL-12: alloc_ids {ids} are not all ints in [0, 2**63)")
    if len(set(ids)) != len(ids):
        problems.append(f"CL-12: comm buffers of one graph share alloc_ids: {ids}")
    again = lp.alloc_ids(ns.lowered_graph(fn, [x.clone() for x in xs], dict(config)))
    if again != ids:
        problems.append(f"CL-12: two lowerings of one graph gave alloc_ids {ids} and {again}")
    try:
        other = lp.alloc_ids(ns.lowered_graph(fn, [x.clone() for x in xs],
                                            {**config, "alloc_id_namespace": "fuzz-other"}))
    except NotImplementedConcept:
        return problems
    if set(other) & set(ids):
        problems.append(f"CL-12: alloc_id_namespace 'fuzz-other' gave alloc_ids {other}, "
                        f"sharing some with the default namespace's {ids}")
    return problems


def _kept_by_the_caller(gm, xs, want: list[torch.Tensor]) -> list[str]:
    """CL-13: what one call of the lowered program returns is the caller's: a second call,
    on other inputs, leaves it as it was (a comm buffer returned would be written again,
    since the next call takes the same alloc_id, SM-4)."""
    first = rp._flat(gm(*[x.clone() for x in xs]))
    gm(*[-x for x in xs])
    try:
        torch.testing.assert_close(first, want, rtol=0, atol=0)
    except AssertionError as exc:
        return [f"CL-13: a second call of the lowered program changed what the first "
                f"returned: {exc}"]
    return []


def _untrue(rule: str, traced, checker) -> list[str]:
    """The nodes whose meta val `checker` found untrue, less those the traced program itself
    gets wrong (an upstream op's fake kernel can: `_c10d_functional.all_reduce_coalesced`
    says a transposed input's strides, its kernel returns a contiguous tensor): the
    tracer's slip is not the pass's."""
    known = set(traced.untrue)
    untrue = [u for u in checker.untrue if u not in known]
    return [f"{rule}: untrue meta val: {'; '.join(untrue)}"] if untrue else []


def _differences(want, got, what: str, value_rule: str, shape_rule: str) -> list[str]:
    """A transformed program's run (`got`, from _observe) against eager's (`want`): its
    values exactly, record_'s log, and the container it returns."""
    problems = []
    try:
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    except AssertionError as exc:
        problems.append(f"{value_rule}: {what} values differ from eager: {exc}")
    if got[1] != want[1]:
        problems.append(f"{value_rule}: record_ saw {want[1]} eagerly, {got[1]} {what}")
    if got[2] != want[2]:
        problems.append(f"{shape_rule}: the {what} program returns {got[2]}, eager {want[2]}")
    return problems


def _observe(run) -> tuple[list[torch.Tensor], list[float], str]:
    """What `run()` returns, as plain tensors, what record_ saw meanwhile, and the shape of
    the returned container (a dict stays a dict: RO-1, CL-1 keep the code generator)."""
    rp.RECORDED.clear()
    out = run()
    # FX's graphs return their immutable_list / immutable_dict: the same shape for a caller
    structure = re.sub(r"\bimmutable_(list|dict)\b", r"\1", str(pytree.tree_structure(out)))
    return [t.clone() for t in rp._flat(out)], list(rp.RECORDED), structure


def reorder_on_rank(spec: str, source: str, inputs, options) -> dict:
    """RO: the backend's order keeps RO-3..RO-9 (reorder_rules, the judge) and the values;
    with `bucketed_first`, the backend's own all_gather bucketing (BK-17 blocks) runs
    first, as an input of the case."""
    from conformance.reorder_rules import in_flight_violations, order_violations
    from conformance.true_meta import MetaChecker

    backend, fn, xs, _ = _load(spec, source, inputs)
    ns = backend.require("reorder", *STAGES["RO"].attrs)
    gm = _trace(fn, xs)
    if options["bucketed_first"]:
        try:
            bucket = backend.require("bucketing", "bucket_all_gather").bucket_all_gather
        except NotImplementedConcept:  # then the traced program alone
            bucket = None
        if bucket is not None:
            bucket(gm, _cap_fn(options["caps_bytes"]["bucket_all_gather"]))
    limits = dict(options["max_in_flight"])
    if options.get("bad"):  # RO-1: refused, naming the option
        name, value, _ = options["bad"]
        fields = {"memory_budget": options["memory_budget"], "max_in_flight": limits, name: value}
        return {"problems": _refused("RO", options["bad"], lambda: ns.ReorderConfig(**fields)),
                "order": []}
    config = ns.ReorderConfig(cost_model=ns.CostModel(pinned=rp.pinned_costs(gm)),
                              memory_budget=options["memory_budget"], max_in_flight=limits)
    new = ns.reorder(gm, config)
    unplaceable = {f"RO-7: block {sorted(b)} is not contiguous" for b in _split_blocks(gm)}
    # RO-9's exception: when the original order breaks a limit, the moves it forces may
    # pass the memory bound, and which moves those are is the scheduler's (RO-12): the
    # bound is then not judged.
    forced = bool(in_flight_violations(gm, limits))
    problems = [p for p in order_violations(gm, new, options["memory_budget"], limits)
                if p not in unplaceable and not (forced and p.startswith("RO-9:"))]
    traced, checker = MetaChecker(gm), MetaChecker(new)
    diff = _side_by_side(rp._run(gm, xs, traced), rp._run(new, xs, checker))
    problems += [f"RO-13: reordered values differ: {diff}"] if diff else []
    if _returns(new) != _returns(gm):
        problems.append(f"RO-1: the reordered program returns {_returns(new)}, the "
                        f"original {_returns(gm)}")
    problems += _untrue("RO-1", traced, checker)
    return {"problems": problems, "order": [n.name for n in new.graph.nodes]}


def _returns(gm) -> str:
    """What calling `gm` returns, as its code generator builds it: a pytree's spec (make_fx
    keeps a program's dict), or the output node's value as it is."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    spec = getattr(info, "out_spec", None)
    return str(spec) if spec is not None else "the output node's value"


def _split_blocks(gm) -> list[list[str]]:
    """The untagged blocks (a collective and its prologue, RO-7) that no order can keep
    together: a node outside one, between its members, follows one of them and precedes
    another (RO-3..RO-6), as a barrier between a prologue's view and its cast does. SPEC
    leaves them open (refimpl places the collective alone), so the judge's RO-7 line about
    them is not held against the backend."""
    from conformance import reorder_rules as rules

    body = rules._body(gm)  # the judge's own reading of the graph, not refimpl's
    position = {n.name: i for i, n in enumerate(body)}
    preds = _orderings(gm, body)
    split = []
    for block in rules.blocks(gm):
        members = set(block)
        if any(n.meta.get("refimpl_block") is not None for n in body if n.name in members):
            continue  # a tagged block that cannot be placed is refused instead (RO-7)
        after: set[str] = set()  # outside nodes in the block's span that follow a member
        for node in body[min(position[m] for m in members):max(position[m] for m in
                                                               members) + 1]:
            reached = preds[node.name] & (members | after)
            if node.name not in members and reached:
                after.add(node.name)
            elif node.name in members and preds[node.name] & after:
                split.append(block)
                break
    return split


def _orderings(gm, body) -> dict[str, set[str]]:
    """node -> the nodes it must follow in any order: data (RO-3), buffer versions (RO-4,
    from the judge's accesses), each group's issue order (RO-5) and barriers (RO-6)."""
    from conformance import reorder_rules as rules

    preds = {n.name: {a.name for a in n.all_input_nodes if a.op != "placeholder"}
             for n in body}
    last_write: dict = {}
    readers: dict = {}
    for name, reads, writes in rules._accesses(gm):
        for b in set(reads) | set(writes):
            if b in last_write:
                preds[name].add(last_write[b])
        for b in set(writes):
            preds[name].update(readers.pop(b, ()))
            last_write[b] = name
        for b in set(reads) - set(writes):
            readers.setdefault(b, []).append(name)
    last_of_group: dict = {}
    before: list[str] = []
    barrier = None
    for node in body:
        group = rules.group_of(node)
        if group is not None:
            preds[node.name].update([last_of_group[group]] if group in last_of_group else [])
            last_of_group[group] = node.name
        if barrier is not None:
            preds[node.name].add(barrier)
        if rules.is_barrier(node):
            preds[node.name].update(before)
            barrier = node.name
        before.append(node.name)
    for name in preds:
        preds[name].discard(name)
    return preds


def memory_on_rank(spec: str, source: str, inputs, options) -> dict:
    """MEM: the backend's plan of the traced program is what a real run allocates and
    frees, node by node (memory_programs.measure_run). On the backend's own ops: a real
    run of upstream's eager collectives frees what they communicate at its last reader,
    where MEM-5 holds it to the wait (SPEC names the difference), so a program drawn on
    upstream's ops runs here on the backend's."""
    from conformance.memory_programs import measure_run

    source = source.replace(f"\n    {UPSTREAM_OPS}\n", "\n")
    backend, fn, xs, _ = _load(spec, source, inputs)
    memory = backend.require("memory", *STAGES["MEM"].attrs)
    gm = _trace(fn, xs)
    return {"problems": measure_run(gm, xs, memory.plan_memory(gm))}  # each names its rule


# The collectives that return an alias of an argument: their compile may fail (E2E-7).
ALIASING_COLLECTIVE = re.compile(r"ops\.(all_reduce_|all_gather_into_tensor_out)\(")


def e2e_on_rank(spec: str, source: str, inputs, options) -> dict:
    """E2E: the program compiled by torch.compile with the backend's compile backend, its
    stages under the drawn options, computes what the eager program does (E2E-3: exactly,
    the values being small integers) and runs record_ as often with the same values; a
    program with an in-place or out= collective may instead be refused, naming it (E2E-7)."""
    backend, fn, xs, _ = _load(spec, source, inputs)
    concept = backend.require("compile_backend", *STAGES["E2E"].attrs)
    want = _observe(lambda: fn(*[x.clone() for x in xs]))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=concept.make(dict(options)))
    aliasing = ALIASING_COLLECTIVE.search(source)
    try:
        got = _observe(lambda: compiled(*[x.clone() for x in xs]))
    except Exception as exc:  # what torch.compile raises is its own class
        if aliasing is None:
            raise
        named = aliasing.group(1) in str(exc)
        return {"problems": [] if named else [
            f"E2E-7: compiling {aliasing.group(1)} failed without naming it: "
            f"{_short(str(exc), 3)}"]}
    return {"problems": _differences(want, got, "compiled", "E2E-3", "E2E-3")}


def ranks_ready(spec: str) -> bool:
    """On a rank: the backend loaded, the groups made and make_fx used once (its first
    trace costs seconds), before any stage is timed."""
    from conformance import memory_programs, reorder_rules, true_meta  # noqa: F401
    from conformance.harness import backend_in_rank

    _groups_on_rank(backend_in_rank(spec).require("functional_collectives"),
                    dist.get_world_size())
    _trace(lambda x: torch.relu(x * 2), [torch.ones(2)])
    return True


RANK_FUNCTIONS = {"BK": bucketing_on_rank, "CL": lowering_on_rank, "RO": reorder_on_rank,
                  "MEM": memory_on_rank, "E2E": e2e_on_rank}


def _across_ranks(stage: str, results: list[dict]) -> list[str]:
    """What every rank must agree on: the same merges (BK-6), the same order (RO-2), the
    same alloc_ids (CL-12)."""
    key = {"BK": "merges", "RO": "order", "CL": "alloc_ids"}.get(stage)
    if key is None or all(r.get(key) == results[0].get(key) for r in results):
        return []
    rule = {"BK": "BK-6: ranks merged differently", "RO": "RO-2: ranks ordered differently",
            "CL": "CL-12: ranks gave their comm buffers different alloc_ids"}
    return [f"{rule[stage]}: " + "; ".join(f"rank {i}: {r.get(key)}" for i, r in
                                           enumerate(results))]


# --------------------------------------------------------------------------------------
# In this process: one stage of one program, found and shrunk by hypothesis
# --------------------------------------------------------------------------------------
class _Failed(Exception):
    """The stage found something wrong (hypothesis shrinks the program)."""


@dataclass
class _Hunt:
    """One stage on one seed's program: what hypothesis has shown it so far."""

    calls: int = 0
    case: Case | None = None
    failures: list = field(default_factory=list)  # (case, problems), the smallest last
    runs: int = 0  # stage runs spent on shrinking
    missing: NotImplementedConcept | None = None


class Fuzzer:
    """Runs stages of generated programs against a backend, on gloo ranks."""

    def __init__(self, backend, shrink_runs: int = SHRINK_RUNS,
                 timeout_s: float = STAGE_TIMEOUT_S):
        self.backend = backend
        self.shrink_runs = shrink_runs
        self.timeout_s = timeout_s
        self.memo: dict[tuple, list[str]] = {}  # (stage, source, options) -> problems
        self.expected: dict[str, str] = {}  # rule -> reason: differences known by rule
        self.started: set[int] = set()  # world sizes whose ranks are up

    def check(self, stage: str, case: Case) -> list[str]:
        """Problems of `stage` on `case` (memoized; NotImplementedConcept passes through).
        A run past the time limit is tried once more on fresh ranks: on a loaded machine
        starting them can take that long, and a stage that hangs hangs twice."""
        from refimpl.multiprocess import RankError, RankTimeout

        key = _key(stage, case)
        if key not in self.memo:
            try:
                try:
                    results = self._run(stage, case)
                except RankTimeout:
                    results = self._run(stage, case)
                problems = [f"rank {i}: {p}" for i, r in enumerate(results)
                            for p in r["problems"]] + _across_ranks(stage, results)
            except (RankError, RankTimeout) as exc:
                problems = [_short(str(exc))]
            self.memo[key] = problems
        return self.memo[key]

    def _run(self, stage: str, case: Case) -> list[dict]:
        """The stage's rank function on ranks already started (not timed as the stage)."""
        from conformance import harness
        from refimpl.multiprocess import RankError, RankTimeout

        program = case.program
        if program.world_size not in self.started:
            try:
                harness.run(self.backend, ranks_ready, program.world_size,
                            timeout=max(START_TIMEOUT_S, self.timeout_s))
            except (RankError, RankTimeout):
                pass  # the stage's own run says what is wrong
        self.started.add(program.world_size)
        try:
            return harness.run(self.backend, RANK_FUNCTIONS[stage], program.world_size,
                               program.source(), program.inputs, self._options(stage, case),
                               timeout=self.timeout_s)
        except (RankError, RankTimeout):
            self.started.discard(program.world_size)  # the harness starts fresh ranks
            raise

    @staticmethod
    def _options(stage: str, case: Case) -> dict:
        options = dict(case.stage_options(stage))
        if stage == "RO":  # bucketing first (if drawn) with the BK caps of all_gather
            options["caps_bytes"] = case.options["BK"]["caps_bytes"]
        return options

    def hunt(self, stage: str, program_seed: int) -> dict:
        """Run `stage` on the program of `program_seed`; shrink it if it fails.
        {"case", "problems", "shrunk", "runs"}: the program drawn, and on a failure the
        smallest failing case found with its problems."""
        hunt = _Hunt()

        def stage_test(case):
            hunt.calls += 1
            if hunt.calls == 2:
                hunt.case = case  # the program of this seed (the first is the simplest)
            try:
                problems = self._problems(stage, case, hunt)
            except NotImplementedConcept as exc:  # reported as such, never shrunk
                hunt.missing = exc
                return
            if problems:
                hunt.failures.append((case, problems))
                raise _Failed("\n".join(problems))

        test = seed(program_seed)(settings(
            max_examples=2, phases=(Phase.generate, Phase.shrink), database=None,
            deadline=None, suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
            print_blob=False)(given(cases())(stage_test)))
        with with_reporter(lambda text: None):
            try:
                test()
            except Exception:  # _Failed, or hypothesis's own error about it
                if not hunt.failures:
                    raise
        if hunt.missing is not None:
            raise hunt.missing
        if not hunt.failures:
            return {"case": hunt.case, "problems": [], "shrunk": None, "runs": hunt.runs}
        shrunk, problems = hunt.failures[-1]  # hypothesis replays the smallest last
        return {"case": hunt.case or shrunk, "problems": problems, "shrunk": shrunk,
                "runs": hunt.runs}

    def _problems(self, stage: str, case: Case, hunt: _Hunt) -> list[str]:
        """`case`'s problems as the hunt counts them. While shrinking, a candidate counts as
        passing when the runs are spent, when it needs more ranks than the failure
        (starting them costs seconds), or when it fails another way (a run past its time
        limit on a loaded machine, say): shrinking keeps to the failure found."""
        problems = self._known(stage, case)
        if not hunt.failures:
            return problems if problems is not None else self.check(stage, case)
        first_case, first_problems = hunt.failures[0]
        if problems is None:
            if hunt.runs >= self.shrink_runs or \
                    case.program.world_size > first_case.program.world_size:
                return []
            hunt.runs += 1
            problems = self.check(stage, case)
        return problems if _kinds(problems) & _kinds(first_problems) else []

    def _known(self, stage, case) -> list[str] | None:
        return self.memo.get(_key(stage, case))


def _key(stage: str, case: Case) -> tuple:
    """What a stage's outcome depends on: the program's text and the stage's options."""
    options = json.dumps(Fuzzer._options(stage, case), sort_keys=True, default=str)
    return stage, case.program.source(), options


def _kinds(problems: list[str]) -> set[str]:
    """What kind of failure each problem is: the rule it names (`BK-8`, `MEM`), the error a
    rank raised, or a timeout; not its values."""
    kinds = set()
    for problem in problems:
        rule = re.match(r"(?:rank \d+: )?([A-Z]+(?:-\d+)?):", problem)
        error = re.search(r"raised (\w+)", problem)
        kinds.add(rule.group(1) if rule else error.group(1) if error else
                  "timeout" if "did not finish" in problem else problem.split(":")[0])
    return kinds


def _short(text: str, lines: int = 25) -> str:
    kept = text.splitlines()
    return "\n".join(kept if len(kept) <= lines else kept[:5] + ["..."] + kept[-(lines - 6):])


def program_of_seed(program_seed: int) -> Case:
    """The case of `program_seed`: the second example hypothesis draws with it."""
    drawn: list[Case] = []

    @seed(program_seed)
    @settings(max_examples=2, phases=(Phase.generate,), database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def collect(case):
        drawn.append(case)

    collect()
    return drawn[-1]


def reproducer(stage: str, program_seed: int, backend_spec: str, case: Case,
               options: dict) -> str:
    """The shrunk program's source, its stage options and the command that reruns it."""
    command = f"python -m conformance --fuzz 1 --seed {program_seed} --section {stage}"
    if backend_spec != "refimpl":
        command += f" --backend {backend_spec}"
    return "\n".join([f"shrunk program ({len(case.program.stmts)} statements):",
                      case.program.source().rstrip(), f"options: {options!r}",
                      f"rerun: {command}"])


# --------------------------------------------------------------------------------------
# The run: N programs, every selected stage of each
# --------------------------------------------------------------------------------------
def expected_rules(backend) -> dict[str, str]:
    """{rule ID: one listed reason} of the backend's expected failures that apply to the
    running torch (conformance/expected_failures/<name>.txt, CF-4). A generated program
    whose every problem names one of these rules shows a difference already known by rule,
    not a new finding."""
    from conformance.cases.conftest import expected_failures_file, read_expected_failures

    applying, _ = read_expected_failures(expected_failures_file(backend), torch.__version__)
    rules: dict[str, str] = {}
    for cid, reason in applying.items():
        head = re.match(r"\s*([A-Z]+-\d+(?:/[A-Z]+-\d+)*)\s*:", reason)  # "MEM-5/MEM-6: ..."
        for rule in head.group(1).split("/") if head else []:
            rules.setdefault(rule, f"{cid}: {reason}")
    return rules


def run(backend, backend_spec: str, count: int, first_seed: int, stages, *,
        verbose: bool = False, exitfirst: bool = False, shrink_runs: int = SHRINK_RUNS,
        timeout_s: float = STAGE_TIMEOUT_S,
        write=None) -> list[dict]:
    """One record per (program, stage), in the report's schema; a line per program
    (`write`, default print) as it finishes. A failure whose every problem names a rule the
    backend's expected failures list is `xfailed` (a known difference, matched by rule);
    any other is `failed`: a finding, with its reproducer."""
    write = write or functools.partial(print, flush=True)
    fuzzer = Fuzzer(backend, shrink_runs, timeout_s)
    fuzzer.expected = expected_rules(backend)
    start = time.monotonic()
    records = []
    for index in range(count):
        program_seed = first_seed + index
        case = program_of_seed(program_seed)
        if verbose:
            write(case.program.source())
        done = [_stage_record(fuzzer, stage, first_seed, index, program_seed, backend_spec,
                              case) for stage in stages]
        records += done
        summary = ", ".join(f"{r['id'].split('::')[1]} {r['outcome']}" for r in done)
        write(f"[{time.monotonic() - start:4.0f} s] program {index} (seed {program_seed}, "
              f"{case.program.world_size} ranks, {len(case.program.stmts)} statements): "
              f"{summary}")
        if exitfirst and any(r["outcome"] == "failed" for r in done):
            break
    return records


def _stage_record(fuzzer: Fuzzer, stage: str, first_seed: int, index: int,
                  program_seed: int, backend_spec: str, case: Case) -> dict:
    started = time.monotonic()
    record = {"id": f"fuzz::{stage}::{first_seed}::{index}",
              "section": section_title(stage), "spec_ids": list(STAGES[stage].spec_ids),
              "outcome": "passed", "reason": "", "world_sizes": [case.program.world_size]}
    try:
        fuzzer.backend.require(STAGES[stage].concept, *STAGES[stage].attrs)
        found = fuzzer.hunt(stage, program_seed)
    except NotImplementedConcept as exc:
        record.update(outcome="not_implemented", reason=f"not implemented: {exc}")
    else:
        if found["problems"]:
            shrunk = found["shrunk"]
            kinds = _kinds(found["problems"])
            known = sorted(kinds) if kinds <= set(fuzzer.expected) else []
            lines = [f"an expected difference by rule {', '.join(known)}: "
                     + "; ".join(fuzzer.expected[k] for k in known)] if known else []
            record.update(outcome="xfailed" if known else "failed", reason="\n".join([
                *lines, *found["problems"][:10],
                reproducer(stage, program_seed, backend_spec, shrunk,
                           Fuzzer._options(stage, shrunk))]))
    record["seconds"] = round(time.monotonic() - started, 3)
    return record


def load_error_record(stage: str, first_seed: int, index: int, error: str) -> dict:
    """The record of a (program, stage) when the backend failed to load (CF-7)."""
    return {"id": f"fuzz::{stage}::{first_seed}::{index}", "section": section_title(stage),
            "spec_ids": list(STAGES[stage].spec_ids), "outcome": "failed",
            "reason": f"the backend failed to load: {error}", "world_sizes": [],
            "seconds": 0.0}
