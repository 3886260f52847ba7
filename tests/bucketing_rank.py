"""Rank-side helpers for the bucketing tests: trace, bucket, run, and report plain data.

Every function here runs on each gloo rank (refimpl.multiprocess.run_on_ranks) and
returns picklable results that the test process asserts on.
"""

from __future__ import annotations

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








def keyword_arguments() -> dict:
    """BK-16: a candidate whose group arguments are given by keyword is read by name."""
    fn, inputs = bp.PROGRAMS["fsdp_all_gather"](fc, torch.float32)
    original = bp.trace(fn, inputs)
    gm = bp.trace(fn, inputs)
    for node in gm.graph.nodes:
        if "all_gather_into_tensor" in str(node.target):
            node.kwargs = {"group_size": node.args[1], "group_name": node.args[2]}
            node.args = node.args[:1]
    gm.recompile()
    bk.bucket_all_gather(gm, lambda i: 25)
    return {"mismatch": bp.compare(original(*inputs), gm(*inputs)),
            "collectives": bp.collective_count(gm)}


def block_tags_after_two_passes() -> dict:
    """BK-17: blocks of one pass, then of a second pass over the first's merged gathers."""
    fn, inputs = bp.PROGRAMS["fsdp_all_gather"](fc, torch.float32, rows=(1, 1, 1, 1))
    gm = bp.trace(fn, inputs)
    bk.bucket_all_gather(gm, lambda i: 48 / 2**20, use_out_variant=False)  # two buckets
    first = bp.block_runs(gm)
    bk.bucket_all_gather(gm, lambda i: 25, use_out_variant=False)  # merges the two
    fn, inputs = bp.PROGRAMS["all_reduces"](fc, torch.float32)
    ar = bp.trace(fn, inputs)
    bk.bucket_all_reduce(ar, lambda i: 25)
    return {"first": first, "second": bp.block_runs(gm), "all_reduce": bp.block_runs(ar)}


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


def _through_refimpls_stages(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """refimpl's later stages as its compiler runs them (lowering, then reorder), and its
    memory plan and timeline of the result (which must not refuse the graph)."""
    from conformance.backends import get_backend

    return bp.later_stages(get_backend("refimpl"), gm)[0]


def upstream_mode_through_refimpl(mode: str) -> dict:
    """A program traced with upstream's functional collectives, rewritten by upstream's
    pass of `mode` (coalesced bucketing, summed reduce_scatters), then through refimpl's
    stages: whether the values are the traced program's bit for bit, and the collectives
    the final graph issues."""
    import types

    import torch.distributed._functional_collectives as ufc
    from torch._inductor.pattern_matcher import stable_topological_sort

    fc_ = types.SimpleNamespace(reduce_scatter_tensor=ufc.reduce_scatter_tensor)
    if mode == "coalesced":
        from torch._inductor.fx_passes.bucketing import bucket_reduce_scatter

        fn, xs = bp.PROGRAMS["fsdp_reduce_scatter"](fc_, torch.float32)
        rewrite = lambda gm: bucket_reduce_scatter(gm, bp.cap_fn(25), mode="coalesced")
    else:
        from torch._inductor.fx_passes.fsdp import dedup_fsdp_reduce_scatter as rewrite

        fn, xs = bp.PROGRAMS["summed_reduce_scatters"](fc_, torch.float32, count=3)
    traced, gm = bp.trace(fn, xs), bp.trace(fn, xs)
    rewrite(gm)
    stable_topological_sort(gm.graph)
    gm.recompile()
    gm = _through_refimpls_stages(gm)
    return {"mismatch": bp.compare(traced(*[x.clone() for x in xs]),
                                   gm(*[x.clone() for x in xs])),
            "issued": sorted(bp.issued_by_group(gm).values())}


def upstream_module_plans_through_refimpl(plans) -> dict:
    """conformance's PlannedModel with upstream's functional collectives, compiled with
    AOTAutograd: each graph as traced, or through upstream's manual_overlap_bucketing
    (`plans`) and then refimpl's stages. One step each: whether the losses and gradients
    are alike bit for bit, and the ops upstream's pass left that are neither ATen nor
    c10d's."""
    import torch.distributed._functional_collectives as ufc
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing

    from conformance.backends.torch_reorder import roofline
    from conformance.e2e_programs import PlannedModel

    other_ops: set[str] = set()

    def compiler(with_plans: bool):
        def compile_graph(gm, _inputs):
            if with_plans:
                with roofline({}):  # no GPU for its estimates (conformance's torch adapter)
                    gm = manual_overlap_bucketing(gm, plans)
                other_ops.update(str(n.target) for n in gm.graph.nodes
                                 if n.op == "call_function" and "aten" not in str(n.target)
                                 and "c10d" not in str(n.target) and "getitem" not in str(n.target))
                gm = _through_refimpls_stages(gm)
            return make_boxed_func(gm)

        return aot_autograd(fw_compiler=compile_graph, bw_compiler=compile_graph)

    runs = []
    for with_plans in (False, True):
        torch._dynamo.reset()
        model = PlannedModel(ufc, dist.group.WORLD)
        step = torch.compile(model, backend=compiler(with_plans), fullgraph=True)
        loss = step(rank_input(dist.get_rank(), (4, 8), salt=5)).square().mean()
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    same = torch.equal(loss_a, loss_b) and all(
        torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    return {"same": same, "other_ops": sorted(other_ops)}
