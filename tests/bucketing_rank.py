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

    buckets = bk.plan_buckets(gm, kind, caps, mixed_dtypes=mixed)
    sizes = [[bk._size_bytes(n, bk.KINDS[kind]) for n in b] for b in buckets]
    keys = [[bk._bucket_key(n, bk.KINDS[kind], mixed) for n in b] for b in buckets]
    keys = [[(str(k[0]),) + tuple(str(x) for x in k[1:]) for k in ks] for ks in keys]
    return {"names": [[n.name for n in b] for b in buckets], "sizes": sizes, "keys": keys,
            "asked": asked}


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
    buckets = bk.plan_buckets(bucketed, "all_gather", lambda i: 25)
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
