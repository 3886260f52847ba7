"""The program generator: hypothesis draws a program statement by statement (`programs`).

`_Builder` writes FSDP- and TP-like sequences: collectives of several groups (WORLD and
subgroups), plain, coalesced, in place (`all_reduce_`) and into an `out=` buffer, each
waited somewhere later; a pipeline stage's exchange on a ring of a group (FC-52); casts
to bf16 or f16 before an all_gather, views, compute of several shapes and dtypes,
in-place ops and `out=` ops on buffers after their wait,
one-shot candidates with chains of pointwise steps around them (CL-10, CL-17), and
`refimpl_conformance::record_` (conformance/reorder_programs.py) as a barrier (RO-6).
Every value stays below the size its dtype holds exactly (CF-9). The order of the draws
is what makes a seed's program: keep it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from hypothesis import strategies as st

from conformance.fuzz.vocabulary import (
    DEFAULT_ONE_SHOT_BYTES,
    DTYPES,
    EXACT,
    GROUPS,
    INPUT_BOUND,
    INPUT_SHAPES,
    ISSUE,
    KINDS,
    MAX_STEPS,
    REDUCE_OPS,
    Pending,
    Program,
    Stmt,
    Value,
)


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
                 "chain", "cross", "one_shot", "one_shot", "pipeline"]
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

    def _wait_for(self, p: Pending) -> Value | None:
        self.pending.remove(p)
        self.busy.discard(p.writes)
        if p.kind == "isend":  # its result has no elements: the wait completes the send
            self._emit("wait", f"ops.wait_tensor({p.handle})")
            return None
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


    # ---- a pipeline stage's exchange (FC-52) --------------------------------------------
    def _pipeline(self) -> None:
        """A pipeline stage's exchange on one group: this rank sends a value to the group
        rank after it and receives, from the one before, a tensor of that shape and dtype
        (a ring: `P[group]` is (after, before) on each rank), as a receive and a send in
        either order or one batch of both, each waited later; nothing blocks when issued,
        so any order of the two completes (FC-52)."""
        values = self._readable(lambda v: v.contiguous)
        if not values:
            return self._compute()
        group = self.draw(st.sampled_from(["world", *self.groups]))
        x = self._pick(values)
        form = self.draw(st.sampled_from(["receive_first", "send_first", "batch"]))
        tag = self.draw(st.sampled_from([0, 0, 1]))
        received, token = self._name("h"), self._name("h")
        g, after, before = f"G[{group!r}]", f"P[{group!r}][0]", f"P[{group!r}][1]"
        receive = f"ops.irecv(torch.empty_like({x.name}), {before}, {tag}, {g})"
        send = f"ops.isend({x.name}, {after}, {tag}, {g})"
        if form == "batch":
            self._emit("batch_p2p_ops", f"{received}, {token} = ops.batch_p2p_ops(['irecv', "
                       f"'isend'], [{before}, {after}], [{tag}, {tag}], "
                       f"[torch.empty_like({x.name}), {x.name}], {g})")
        else:
            lines = [f"{received} = {receive}", f"{token} = {send}"]
            self._emit("p2p", *(lines if form == "receive_first" else lines[::-1]))
        self._use(x)  # read by the send until its wait: nothing may write it afterwards
        value = Value("", x.shape, x.dtype, x.bound, self._buffer(), True, True)
        nothing = Value("", (0,), x.dtype, 0, self._buffer(), True, True)
        batch = form == "batch"
        self.pending += [Pending(received, value, "irecv", None, batch),
                         Pending(token, nothing, "isend", None, batch)]

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
    # Upstream's namespace has no point-to-point ops before torch 2.12: such a program
    # keeps the backend's there (the draw is made all the same, so that the rest is too).
    upstream_ops = draw(st.booleans()) and (
        not any(s.op in ("p2p", "batch_p2p_ops") for s in program.stmts)
        or hasattr(torch.ops._c10d_functional, "isend"))
    program = dataclasses.replace(program, upstream_ops=upstream_ops,
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
