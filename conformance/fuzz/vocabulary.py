"""The vocabulary of generated programs and the program model (SPEC CF-12).

What a program is written in: the groups of each world size (`GROUPS`), the dtypes and the
integers each holds exactly (`DTYPES`, `EXACT`), input shapes, the collectives and how each
is written (`KINDS`, `ISSUE`), and the stages a program is checked by (`STAGES`, each a
concept of the backend and the SPEC IDs it checks). The program model: a `Program` is a
list of statements (`Stmt`) that renders to Python source; `Value` and `Pending` are what
the generator (generator.py) knows of a tensor and of a collective in flight; a `Case` is
a program with the options of every stage (stage_options.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
        return [f"# {self.world_size} gloo ranks; group names: {groups}; P[k]: (the group "
                f"rank after this rank's in G[k], the one before)",
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


@dataclass(frozen=True)
class Case:
    """One drawn program and the options of every stage."""

    program: Program
    options: dict = field(hash=False)

    def stage_options(self, stage: str) -> dict:
        return self.options[stage]
