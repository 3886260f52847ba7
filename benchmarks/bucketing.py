"""Benchmark: refimpl's bucketing passes against upstream's, and what bucketing buys.

1. Pass time. FSDP-like graphs of N = 100, 1,000 and 4,000 all_gathers (parameter shards
   gathered one by one, each used after its wait) and of N reduce_scatters (gradients
   computed one by one, each scattered), traced once with upstream's functional
   collectives on a fake process group of 8 ranks. Both passes run on copies of the same
   graph with 25 MiB buckets; upstream's time includes the stable_topological_sort that
   Inductor runs after it (its graph is not in order without it); refimpl runs with
   recompile=False, as upstream does not regenerate code either. The cost of the one
   `gm.recompile()` that either result needs before it runs is printed on its own.
   Prints seconds, the ratio upstream / refimpl, and refimpl's microseconds per
   collective (flat = linear).
2. Step time. 64 small all_gathers on 2 gloo ranks, the traced graph against its
   bucketed form, run for real; prints the ratio.

Run: PYTHONPATH=. python benchmarks/bucketing.py [--sizes 100,1000,4000] [--skip-upstream]
"""

from __future__ import annotations

import argparse
import gc
import platform
import time

import torch
import torch.distributed as dist

CAP_MB = 25.0
WORLD = 8


def fsdp_graph(kind: str, n: int) -> torch.fx.GraphModule:
    """A traced FSDP-like graph with `n` collectives of `kind` (upstream's ops)."""
    import torch.distributed._functional_collectives as ufc
    from torch.fx.experimental.proxy_tensor import make_fx

    group = dist.group.WORLD
    # Shards of a few shapes, as a transformer's weights and norms would give.
    shapes = [(128, 64), (32,), (64, 64), (16, 8)]
    params = [torch.randn(shapes[i % len(shapes)]) for i in range(n)]

    def forward(act, *shards):
        for shard in shards:
            full = ufc.all_gather_tensor(shard, 0, group)
            act = act + full.reshape(-1)[:1]
        return act

    def backward(act, *shards):
        grads = []
        for shard in shards:
            grad = torch.cat([shard] * WORLD) * act
            grads.append(ufc.reduce_scatter_tensor(grad, "sum", 0, group))
        return grads

    fn = forward if kind == "all_gather" else backward
    return make_fx(fn, tracing_mode="fake")(torch.zeros(1), *params)


def copy_of(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def collectives(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and ("all_gather" in str(n.target) or "reduce_scatter" in str(n.target)))


def time_pass(run, gm) -> float:
    # Graphs of earlier sizes are cyclic garbage (nodes and users point at each other);
    # collect it first so that neither pass pays for the other's leftovers.
    gc.collect()
    start = time.perf_counter()
    run(gm)
    return time.perf_counter() - start


def upstream_pass(kind: str):
    from torch._inductor.fx_passes import bucketing as upstream
    from torch._inductor.pattern_matcher import stable_topological_sort

    fn = upstream.bucket_all_gather if kind == "all_gather" else upstream.bucket_reduce_scatter

    def run(gm):
        fn(gm, lambda i: CAP_MB, mode="default")
        stable_topological_sort(gm.graph)

    return run


def refimpl_pass(kind: str):
    import refimpl.bucketing as bk

    fn = bk.bucket_all_gather if kind == "all_gather" else bk.bucket_reduce_scatter
    return lambda gm: fn(gm, lambda i: CAP_MB, recompile=False)


def pass_times(sizes, skip_upstream: bool) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    print(f"## Pass time, {CAP_MB:g} MiB buckets, fake process group of {WORLD}\n")
    print("| collectives | kind | after | upstream s | refimpl s | upstream/refimpl "
          "| refimpl us/collective | gm.recompile() s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for kind in ("all_gather", "reduce_scatter"):
        for n in sizes:
            gm = fsdp_graph(kind, n)
            ours = copy_of(gm)
            t_ref = time_pass(refimpl_pass(kind), ours)
            buckets = collectives(ours)
            t_recompile = time_pass(lambda g: g.recompile(), ours)
            if skip_upstream:
                t_up, ratio = float("nan"), "n/a"
            else:
                t_up = time_pass(upstream_pass(kind), copy_of(gm))
                ratio = f"{t_up / t_ref:.0f}x"
            print(f"| {n:,} | {kind} | {buckets} | {t_up:.2f} | {t_ref:.3f} | {ratio} "
                  f"| {t_ref / n * 1e6:.0f} | {t_recompile:.2f} |", flush=True)
    dist.destroy_process_group()


def step_time_on_rank(count: int, iters: int) -> tuple[float, float]:
    """On a rank: seconds per run of 64 small all_gathers, unbucketed and bucketed."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import refimpl.bucketing as bk
    import refimpl.functional_collectives as fc

    xs = [torch.full((16,), float(i)) for i in range(count)]

    def step(*xs):
        return [fc.all_gather_tensor(x, 0, dist.group.WORLD) for x in xs]

    plain = make_fx(step, tracing_mode="fake")(*xs)
    bucketed = make_fx(step, tracing_mode="fake")(*xs)
    bk.bucket_all_gather(bucketed, lambda i: CAP_MB)
    times = []
    for gm in (plain, bucketed):
        for _ in range(3):
            gm(*xs)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            gm(*xs)
        times.append((time.perf_counter() - start) / iters)
    return times[0], times[1]


def step_times() -> None:
    from refimpl.multiprocess import run_on_ranks

    count, iters = 64, 30
    plain, bucketed = run_on_ranks(step_time_on_rank, 2, count, iters)[0]
    print(f"\n## Step time, {count} all_gathers of 16 floats, 2 gloo ranks\n")
    print("| graph | ms per step |\n|---|---:|")
    print(f"| unbucketed ({count} all_gathers) | {plain * 1e3:.2f} |")
    print(f"| bucketed (1 all_gather) | {bucketed * 1e3:.2f} |")
    print(f"\nunbucketed / bucketed step time: {plain / bucketed:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,4000")
    parser.add_argument("--skip-upstream", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# Bucketing benchmark: torch {torch.__version__}, {platform.machine()}, "
          f"{platform.processor() or 'cpu'}\n")
    pass_times([int(s) for s in args.sizes.split(",")], args.skip_upstream)
    step_times()


if __name__ == "__main__":
    main()
