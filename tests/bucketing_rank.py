"""Rank-side helpers for the bucketing tests: trace, bucket, run, and report plain data.

Every function here runs on each gloo rank (refimpl.multiprocess.run_on_ranks) and
returns picklable results that the test process asserts on.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

import refimpl.bucketing as bk
import refimpl.functional_collectives as fc
from conformance import bucketing_programs as bp
from conformance.canonical import canonical_graph
from conformance.oracle import rank_input


def numeric_cases(cases) -> list:
    """(mismatch, (collectives before, after)) of each (program, pass, dtype, opts, args, cap)."""
    out = []
    for program, pass_name, dtype, options, args, cap in cases:
        result = bp.trace_bucket_run(fc, bk, program, pass_name, cap, dtype, options, args)
        out.append((result["mismatch"], result["collectives"]))
    return out


def upstream_graph_bucketed_by_refimpl(pass_name: str, program: str, dtype) -> dict:
    """A graph traced with upstream's functional collectives, bucketed by refimpl (BK-1)."""
    import torch.distributed._functional_collectives as ufc

    result = bp.trace_bucket_run(ufc, bk, program, pass_name, 25, dtype)
    fn, inputs = bp.PROGRAMS[program](ufc, dtype)
    gm = bp.trace(fn, inputs)
    getattr(bk, pass_name)(gm, lambda i: 25)
    namespaces = sorted({n.target.namespace for n in gm.graph.nodes
                         if isinstance(n.target, torch._ops.OpOverload)})
    return {"mismatch": result["mismatch"], "collectives": result["collectives"],
            "namespaces": namespaces}


def plan_of(program: str, kind: str, cap, dtype=torch.float32, args=None, mixed=False):
    """The buckets as lists of member names, and each member's size in bytes."""
    fn, inputs = bp.PROGRAMS[program](fc, dtype, **(args or {}))
    gm = bp.trace(fn, inputs)
    asked = []

    def caps(i):
        asked.append(i)
        return cap(i) if callable(cap) else cap

    buckets = [b.members for b in bk.plan_buckets(gm, kind, caps, mixed_dtypes=mixed)]
    sizes = [[member_bytes(n) for n in b] for b in buckets]
    keys = [[member_key(n, mixed) for n in b] for b in buckets]
    return {"names": [[n.name for n in b] for b in buckets], "sizes": sizes, "keys": keys,
            "asked": asked}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def member_bytes(node) -> int:
    """A member's size as BK-3 states it: the larger of its input and output, in bytes."""
    return max(_nbytes(node.meta["val"]), _nbytes(node.args[0].meta["val"]))


def member_key(node, mixed: bool) -> tuple:
    """A member's key as BK-2 states it: group, reduce op (if any), dtype (unless mixed)."""
    schema = [a.name for a in node.target._schema.arguments]
    key = [str(node.args[schema.index("group_name")])]
    if "reduce_op" in schema:
        key.append(str(node.args[schema.index("reduce_op")]).lower())
    if not mixed:
        key.append(str(node.meta["val"].dtype))
    return tuple(key)


def bucketed_text(program: str, pass_name: str, dtype=torch.float32, options=None, args=None,
                  cap=25) -> dict:
    fn, inputs = bp.PROGRAMS[program](fc, dtype, **(args or {}))
    gm = bp.trace(fn, inputs)
    before = gm.code
    getattr(bk, pass_name)(gm, lambda i: cap, **(options or {}))
    return {"canonical": canonical_graph(gm), "unchanged": gm.code == before}


def errors() -> dict:
    """The message of each kind of bad input (BK-1, BK-3, BK-8, BK-12)."""
    fn, inputs = bp.PROGRAMS["fsdp_all_gather"](fc, torch.float32)
    messages = {}

    def catch(name, call):
        try:
            call()
            messages[name] = "no error"
        except (ValueError, TypeError) as exc:
            messages[name] = f"{type(exc).__name__}: {exc}"

    catch("not_gm", lambda: bk.bucket_all_gather(object(), lambda i: 1))
    catch("cap_not_callable", lambda: bk.bucket_all_gather(bp.trace(fn, inputs), 25))
    catch("cap_negative", lambda: bk.bucket_all_gather(bp.trace(fn, inputs), lambda i: -1))
    catch("cap_nan", lambda: bk.bucket_all_gather(bp.trace(fn, inputs), lambda i: float("nan")))
    gm = bp.trace(fn, inputs)
    for node in gm.graph.nodes:
        node.meta.pop("val", None)
    catch("no_meta", lambda: bk.bucket_all_gather(gm, lambda i: 1))
    rs_fn, rs_inputs = bp.PROGRAMS["fsdp_reduce_scatter"](fc, torch.float32)
    catch("mixed_rs", lambda: bk.bucket_reduce_scatter(bp.trace(rs_fn, rs_inputs), lambda i: 1,
                                                       mixed_dtypes=True))
    catch("mixed_ar", lambda: bk.bucket_all_reduce(bp.trace(rs_fn, rs_inputs), lambda i: 1,
                                                   mixed_dtypes=True))
    catch("kind", lambda: bk.plan_buckets(bp.trace(fn, inputs), "broadcast", lambda i: 1))
    return messages


def cross_key_cycle() -> dict:
    """Two keys whose members feed each other: merging both would make a cycle (BK-4).

    Order: a1 (group A), b1 (group B), b2 <- a1, a2 <- b1. Merging {a1, a2} needs b1 first;
    merging {b1, b2} needs a1 first; only one of the two merges can be done.
    """
    world = dist.group.WORLD
    other = bp.group_of([[0, 1]])
    me = dist.get_rank()
    xs = [rank_input(me, (2,), torch.float32, salt=70 + i) for i in range(2)]

    def step(x, y):
        a1 = fc.all_gather_tensor(x, 0, world)
        b1 = fc.all_gather_tensor(y, 0, other)
        b2 = fc.all_gather_tensor(a1[:2] * 2, 0, other)
        a2 = fc.all_gather_tensor(b1[:2] + 1, 0, world)
        return a1, b1, b2, a2

    original = bp.trace(step, xs)
    bucketed = bp.trace(step, xs)
    buckets = [b.members for b in bk.plan_buckets(bucketed, "all_gather", lambda i: 25)]
    bk.bucket_all_gather(bucketed, lambda i: 25)
    return {"buckets": [[n.name for n in b] for b in buckets],
            "mismatch": bp.compare(original(*xs), bucketed(*xs)),
            "collectives": (bp.collective_count(original), bp.collective_count(bucketed))}


def log_records() -> list:
    """(logger name, level, message) of everything the passes log, at DEBUG (BK-15)."""
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
        bp.trace_bucket_run(fc, bk, "chain", "bucket_all_gather", 25, torch.float32)
        bp.trace_bucket_run(fc, bk, "fsdp_reduce_scatter", "bucket_reduce_scatter", 25,
                            torch.float32)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    return [r for r in records if "bucket" in r[0] or "bucket" in r[2]]


def padded_reduce_scatter() -> dict:
    """A reduce_scatter whose input rows do not divide by the group size (BK-10).

    No traced program holds one (the op refuses it, FC-20), so the graph is built by hand
    with FSDP's meaning: rank i receives chunk i of torch.chunk(sum, group size).
    """
    from torch._subclasses import FakeTensorMode

    n, me = dist.get_world_size(), dist.get_rank()
    mode = FakeTensorMode()
    graph = torch.fx.Graph()
    shapes = [(3, 2), (5,), (4, 1)]
    placeholders, outs = [], []
    for i, shape in enumerate(shapes):
        x = graph.placeholder(f"x{i}")
        x.meta["val"] = mode.from_tensor(torch.empty(shape))
        placeholders.append(x)
    for x, shape in zip(placeholders, shapes, strict=True):
        chunk = -(-shape[0] // n)
        rs = graph.call_function(torch.ops.refimpl_c10d.reduce_scatter_tensor.default,
                                 (x, "sum", n, dist.group.WORLD.group_name))
        rs.meta["val"] = mode.from_tensor(torch.empty((chunk, *shape[1:])))
        wait = graph.call_function(torch.ops.refimpl_c10d.wait_tensor.default, (rs,))
        wait.meta["val"] = rs.meta["val"]
        outs.append(wait)
    graph.output(outs)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    bk.bucket_reduce_scatter(gm, lambda i: 25)
    inputs = [rank_input(me, s, torch.float32, salt=80 + i) for i, s in enumerate(shapes)]
    got = [t.clone() for t in gm(*inputs)]
    return {"got": got, "collectives": bp.collective_count(gm)}


# --------------------------------------------------------------------------------------
# Random programs for the property test
# --------------------------------------------------------------------------------------
DTYPES = {"f32": torch.float32, "f64": torch.float64}


def random_program(steps, n_inputs: int, second_group):
    """A traceable function from a step list drawn by hypothesis (plain data).

    Every value is 1-D. A step is (op, source indices, length, group, dtype):
    "ag"/"rs"/"ar" run a collective on a prefix of a value (cast to `dtype` first),
    "add" combines two values. Each step appends its result to the values.
    """
    pgs = {"world": dist.group.WORLD, "other": second_group}

    def program(*inputs):
        values = list(inputs)
        for op, sources, length, group, dtype_name in steps:
            pg = pgs[group]
            n = pg.size()
            src = values[sources[0] % len(values)]
            if op == "add":
                other = values[sources[1] % len(values)]
                m = min(src.numel(), other.numel())
                values.append(src[:m] + other[:m])
                continue
            x = src[:max(1, min(length, src.numel()))].to(DTYPES[dtype_name])
            if op == "ag":
                out = fc.all_gather_tensor(x, 0, pg)
            elif op == "rs":
                out = fc.reduce_scatter_tensor(x.repeat(n), "sum", 0, pg)
            else:
                out = fc.all_reduce(x, "sum", pg)
            values.append(out.to(torch.float32))
        return values

    return program


def _ancestors_within(bucket_members) -> bool:
    """True if some member of the bucket depends on another (found by brute force)."""
    members = set(bucket_members)
    for member in bucket_members:
        seen, stack = set(), list(member.all_input_nodes)
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            if node in members:
                return True
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return False


def property_check(steps, n_inputs: int, caps_bytes) -> dict:
    """Run every pass (and all three in a row) on a random program; report violations."""
    me = dist.get_rank()
    second = bp.group_of([list(range(dist.get_world_size()))])
    program = random_program(steps, n_inputs, second)
    inputs = [rank_input(me, (4,), torch.float32, salt=90 + i) for i in range(n_inputs)]
    caps = functools_caps(caps_bytes)
    original = bp.trace(program, inputs)
    expected = original(*inputs)
    report = {"problems": [], "merged": 0}
    passes = [("all_gather", bk.bucket_all_gather), ("reduce_scatter", bk.bucket_reduce_scatter),
              ("all_reduce", bk.bucket_all_reduce)]
    for kind, run_pass in passes:
        gm = bp.trace(program, inputs)
        for bucket in bk.plan_buckets(gm, kind, caps):
            report["merged"] += len(bucket.members)
            size = sum(member_bytes(m) for m in bucket.members)
            if size > caps(bucket.index) * 1024 * 1024:
                report["problems"].append(f"{kind}: bucket {bucket.index} holds {size} bytes")
            if _ancestors_within(bucket.members):
                report["problems"].append(f"{kind}: bucket {bucket.index} holds a dependent")
        run_pass(gm, caps)
        _check_graph(gm, kind, expected, inputs, report)
    chained = bp.trace(program, inputs)
    for _, run_pass in passes:
        run_pass(chained, caps)
    _check_graph(chained, "all three passes", expected, inputs, report)
    return report


def _check_graph(gm, what, expected, inputs, report) -> None:
    seen = set()
    for node in gm.graph.nodes:
        if any(i not in seen for i in node.all_input_nodes):
            report["problems"].append(f"{what}: {node.name} precedes an input")
        seen.add(node)
    mismatch = bp.compare(expected, gm(*inputs))
    if mismatch:
        report["problems"].append(f"{what}: {mismatch}")


def functools_caps(caps_bytes):
    """Cap of bucket i in MiB: the drawn byte caps, cycling."""
    return lambda i: caps_bytes[i % len(caps_bytes)] / (1024 * 1024)
