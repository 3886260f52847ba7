"""Benchmark: refimpl's reorder pass against upstream's FX overlap scheduler.

FSDP-like forward graphs of N = 100, 1,000 and 4,000 layers, traced once with upstream's
`_c10d_functional` ops on a fake process group of 8: per layer an fp32 parameter shard
[256, 2048] cast to bf16 (the prologue), all_gathered to [2048, 2048], waited, and used by
a bf16 matmul of a [4096, 2048] activation and a relu. On the simulator's H100 NVLink
preset a gather (8 MiB) takes about 48 us and a layer's compute about 45 us, so the order
decides how much communication is exposed.

1. Pass time. refimpl's `reorder(gm, ReorderConfig())` (default budget 0.1, its cost
   model's H100 preset; the time includes computing the durations and building the new
   GraphModule with its code; best of 3) against upstream's `schedule_overlap_bucketing`
   on a copy of the same graph (one run each), given the same durations (its roofline
   replaced, as it needs triton on CPU: conformance/backends/torch_reorder.py), with
   `compute_estimator="analytical"`: with its default memory limit (an increase of the
   larger of 5% and 1 GB), without and with its FSDP pre-bucketing (on by default), and
   with refimpl's bound (10%, no absolute allowance). A run of upstream longer than
   `--upstream-timeout` seconds is stopped and reported as such. Prints seconds, ratios,
   and refimpl's microseconds per all_gather with Python's cyclic garbage collector on
   (what a caller sees) and off (the pass's own work; flat = linear: the collector's full
   collections scan every live object, the traced graph's included, so with it on the
   time per layer grows with the heap, for any pass).
2. Quality. Every order simulated with one profile (refimpl.simulator, H100 preset):
   step time, exposed communication, and the planned peak memory (refimpl.memory) against
   the original order's.
3. Pictures. The Perfetto trace and the SVG of the original order of an 8-layer graph
   and of refimpl's with one all_gather in flight (FSDP's schedule) go to
   benchmarks/results/ (reorder_before/after.json/.svg).
4. Small programs (`--small`). The programs of conformance/reorder_programs.py that issue
   30 names, and a few more, traced with upstream's ops on a fake world of 4, each
   ordered by refimpl and by upstream's scheduler (through the torch backend's adapter,
   conformance/backends/torch_reorder.py) under the same config and pinned costs as the
   conformance case, and each order simulated with refimpl's simulator and planned with
   refimpl's memory model: exposed communication and planned peak, with whether each
   order keeps SPEC section 4's rules (conformance/reorder_rules.py). Run it under each
   upstream release to compare (upstream is the torch that runs the script).

Run: PYTHONPATH=. python benchmarks/reorder.py [--sizes 100,1000,4000] [--skip-upstream]
     [--upstream-timeout 240] [--small]
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

WORLD = 8
D, ROWS = 2048, 4096
RESULTS = Path(__file__).resolve().parent / "results"


def fsdp_forward(n: int) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    ops = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name

    def forward(act, *shards):
        for shard in shards:
            full = ops.wait_tensor(ops.all_gather_into_tensor(shard.to(torch.bfloat16),
                                                              WORLD, group))
            act = torch.relu(act @ full)
        return act

    shards = [torch.empty(D // WORLD, D) for _ in range(n)]
    return make_fx(forward, tracing_mode="fake")(torch.empty(ROWS, D, dtype=torch.bfloat16),
                                                 *shards)


def timed(run, *args, collector: bool = True):
    gc.collect()  # earlier graphs are cyclic garbage; neither pass pays for them
    if not collector:
        gc.disable()
    try:
        start = time.perf_counter()
        result = run(*args)
        return result, time.perf_counter() - start
    finally:
        gc.enable()


class UpstreamTimeout(Exception):
    pass


def timed_with_limit(seconds: float, run, *args):
    """`timed(run, *args)`, or (None, None) when it runs longer than `seconds`."""
    def stop(signum, frame):
        raise UpstreamTimeout

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return timed(run, *args)
    except UpstreamTimeout:
        return None, None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def refimpl_pass(gm):
    from refimpl.reorder import ReorderConfig, reorder

    return reorder(gm, ReorderConfig())


# Upstream's variants: (label, pre-bucketing, memory limits); None keeps its default.
UPSTREAM = (
    ("upstream", False, None),
    ("upstream + pre-bucketing", True, None),
    ("upstream, refimpl's 10% bound", False,
     {"max_memory_increase_gb": None, "max_memory_increase_ratio": 0.1}),
)


def upstream_pass(pre_bucketing: bool, memory: dict | None):
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    from conformance.backends.torch_reorder import copy_graph, roofline
    from refimpl.simulator import CostModel

    def prepare(gm):  # upstream rewrites the graph it is given: a copy each
        gm = copy_graph(gm)
        durations_ms = {n: us / 1000 for n, us in CostModel().durations(gm).items()}
        return gm, durations_ms

    def run(prepared):
        gm, durations_ms = prepared
        with roofline(durations_ms):
            return schedule_overlap_bucketing(
                gm, custom_runtime_estimation=lambda node, size: durations_ms.get(node)
                if size is None else None,
                compute_estimator="analytical", collective_bucketing=False,
                pre_bucketing_fsdp_collectives=pre_bucketing, **(memory or {}))

    return prepare, run


def quality(gm) -> dict:
    from refimpl.simulator import CostModel, simulate

    tl = simulate(gm, CostModel())
    return {"step": tl.step_time_us / 1e3, "exposed": tl.exposed_comm_us / 1e3,
            "peak": tl.peak_bytes / 2**20, "gathers": sum(
                1 for n in gm.graph.nodes if "all_gather" in str(n.target))}


def benchmark(sizes, skip_upstream: bool, upstream_timeout: float) -> None:
    print(f"## FSDP forward, fake process group of {WORLD}, H100 NVLink preset\n")
    print("| layers | order | all_gathers | pass s | vs refimpl | refimpl us/layer "
          "(gc on / off) | step ms | exposed comm ms | planned peak MiB | peak / original |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        gm = fsdp_forward(n)
        base = quality(gm)
        runs = [timed(refimpl_pass, gm) for _ in range(3)]
        ours, t_ours = min(runs, key=lambda run: run[1])
        _, t_no_gc = timed(refimpl_pass, gm, collector=False)
        per = f"{t_ours / n * 1e6:.0f} / {t_no_gc / n * 1e6:.0f}"
        row(n, "original", base, base)
        row(n, "refimpl", quality(ours), base, f"{t_ours:.2f}", "", per)
        for label, pre, memory in () if skip_upstream else UPSTREAM:
            prepare, run = upstream_pass(pre, memory)
            theirs, t = timed_with_limit(upstream_timeout, run, prepare(gm))
            if theirs is None:
                print(f"| {n:,} | {label} | | stopped after {upstream_timeout:.0f} s | "
                      f"> {upstream_timeout / t_ours:.0f}x | | | | | |", flush=True)
                continue
            row(n, label, quality(theirs), base, f"{t:.2f}", f"{t / t_ours:.1f}x")
            del theirs


def row(n, label, q, base, seconds="", ratio="", per="") -> None:
    print(f"| {n:,} | {label} | {q['gathers']:,} | {seconds} | {ratio} | {per} | "
          f"{q['step']:.2f} | {q['exposed']:.2f} | {q['peak']:,.0f} | "
          f"{q['peak'] / base['peak']:.3f} |", flush=True)


def pictures(n: int = 8) -> None:
    """One all_gather in flight and no memory bound: FSDP's own schedule, readable at 8
    layers (at this size the default budget, 10% of 72 MiB, pays for no 8 MiB gather)."""
    from refimpl.reorder import ReorderConfig, reorder
    from refimpl.simulator import CostModel, simulate

    gm = fsdp_forward(n)
    config = ReorderConfig(memory_budget=math.inf, max_in_flight={"all_gather": 1})
    for name, graph in (("before", gm), ("after", reorder(gm, config))):
        tl = simulate(graph, CostModel())
        tl.to_chrome_trace(RESULTS / f"reorder_{name}.json")
        tl.to_svg(RESULTS / f"reorder_{name}.svg")
        print(f"{name}: step {tl.step_time_us:.0f} us, exposed {tl.exposed_comm_us:.0f} us, "
              f"peak {tl.peak_bytes / 2**20:.0f} MiB -> benchmarks/results/reorder_{name}.svg")


# (program, memory budget, in-flight limits, pinned durations) of the small-programs table.
SMALL = (
    ("wait_then_matmul", 0.1, (), ()),
    ("compute_feeds_a_collective", 0.1, (), ()),
    ("small_then_large", 0.1, (("all_gather", 1),), "SMALL_THEN_LARGE"),
    ("small_then_large", 0.1, (("all_gather", 1),), "SMALL_THEN_LARGE_TIE"),
    ("gather_then_matmul", 0.1, (), ()),
    ("fsdp_forward", 0.1, (), ()),
    ("fsdp_forward", math.inf, (("all_gather", 1),), ()),
    ("fsdp_backward", 0.1, (), ()),
    ("two_groups", 0.1, (), ()),
    ("memory_bound", 0.1, (), ()),
)


def small_programs() -> None:
    """Section 4 of the docstring: one row per program and config."""
    import torch

    from conformance import reorder_programs as rp
    from conformance.backends.torch_reorder import concept as upstream_concept
    from conformance.reorder_rules import order_violations
    from refimpl.reorder import ReorderConfig, reorder
    from refimpl.simulator import CostModel, simulate

    upstream = upstream_concept()
    print(f"## Small programs: refimpl and upstream {torch.__version__}, fake world of "
          f"{dist.get_world_size()}, pinned costs\n")
    print("| program | budget, limits | original exposed us / peak B | refimpl | "
          f"upstream {torch.__version__.split('+')[0]} | refimpl exposes no more |")
    print("|---|---|---:|---:|---:|---|")
    for name, budget, limits, pins in SMALL:
        pins = getattr(rp, pins) if pins else ()
        gm = rp.program_graph(name, torch.ops._c10d_functional)
        cost = CostModel(pinned={**rp.pinned_costs(gm), **dict(pins)})
        config = ReorderConfig(cost_model=cost, memory_budget=budget,
                               max_in_flight=dict(limits))
        cells, exposed = [], []
        for order in (gm, reorder(gm, config), upstream.reorder(gm, config)):
            by = {n.name: n for n in gm.graph.nodes}
            tl = simulate(gm, cost, [by[n.name] for n in order.graph.nodes])
            broken = order_violations(gm, order, budget, dict(limits)) if order is not gm \
                else []
            rules = "" if not broken else " (breaks " + ", ".join(
                sorted({b.split(":")[0] for b in broken})) + ")"
            cells.append(f"{tl.exposed_comm_us:.0f} / {tl.peak_bytes:,}{rules}")
            exposed.append(tl.exposed_comm_us)
        limit_text = ", ".join(f"{k} {v}" for k, v in limits)
        print(f"| {name}{' ' + str(dict(pins)) if pins else ''} | {budget:g}"
              f"{', ' + limit_text if limit_text else ''} | {' | '.join(cells)} | "
              f"{'yes' if exposed[1] <= exposed[2] + 1e-9 else 'NO'} |", flush=True)


def main() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,4000")
    parser.add_argument("--skip-upstream", action="store_true")
    parser.add_argument("--upstream-timeout", type=float, default=240.0,
                        help="seconds after which a run of upstream's pass is stopped")
    parser.add_argument("--small", action="store_true",
                        help="only the small programs' table (section 4)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# Reorder benchmark: torch {torch.__version__}, {platform.machine()}, "
          f"{platform.processor() or 'cpu'}\n")
    if args.small:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        small_programs()
        dist.destroy_process_group()
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    benchmark([int(s) for s in args.sizes.split(",")], args.skip_upstream,
              args.upstream_timeout)
    print("\n## Pictures: 8 layers, original order and refimpl's with one all_gather in "
          "flight, no memory bound\n")
    pictures()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
