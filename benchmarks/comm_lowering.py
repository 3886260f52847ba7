"""A small all-reduce program, lowered: refimpl (gloo or one-shot) against upstream Inductor.

On 2 gloo ranks, each rank runs `all_reduce(x * 2, "sum") + 1` with `x` of 4 KiB:
- upstream: `torch.compile` with Inductor on CPU (its lowering: clone + all_reduce_ over
  gloo; one-shot needs CUDA upstream);
- refimpl, default lowering (in-place all_reduce_ over gloo);
- refimpl with `auto_select` (one-shot all-reduce through CPU symmetric memory), against
  the bare `one_shot_all_reduce` op on a symmetric buffer (the program adds the `x * 2`
  written into its persistent comm buffer, the buffer's lookup, and the `+ 1`), and
  against the program's own three ops called by hand as the graph calls them (a buffer
  allocated once, no GraphModule): what is left of the lowering's cost;
- the same with `fuse_pointwise` (CL-17): `x * 2` and `+ 1` run inside the one-shot
  kernel (`one_shot_all_reduce_pointwise`), called as the GraphModule and as its
  generated `forward`, against the bare op and against the bare op reducing new data:
  the same op with empty chains, copying `x` into its buffer each call as the program
  does (the bare op reduces a buffer nobody writes, whose cache lines stay shared by
  both cores; new data has to cross between them every call). And the fused program's
  two ops called by hand, their constants made once: no GraphModule, no generated code,
  the floor of any lowering with an allocation and a kernel per one-shot.
Prints microseconds per call (median over ranks of the best of several repeats) and the
ratios. Also times `lower()` itself on a graph of 1,000 all_reduces.

    python benchmarks/comm_lowering.py [--iters 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import torch
import torch.distributed as dist
from native_ops import require_native_ops

from refimpl.multiprocess import run_on_ranks

WORLD = "0"


def program(fc, x):
    return fc.all_reduce(x * 2, "sum", WORLD) + 1


def best_us(fn, x, iters: int, repeats: int) -> float:
    fn(x)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn(x)
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
    return best


def rank_timings(iters: int, repeats: int) -> dict:
    import torch.distributed._functional_collectives as ufc
    from torch.fx.experimental.proxy_tensor import make_fx

    import refimpl.functional_collectives as fc
    import refimpl.symmetric_memory as sm
    from refimpl.comm_lowering import CommLoweringConfig, lower

    sm.enable_symm_mem_for_group(WORLD)
    torch.set_num_threads(1)
    x = torch.ones(1024)
    buf = sm.empty(1024)
    buf.copy_(x)
    by_hand_buf = sm.empty(1024)
    new_data_buf = sm.empty(1024)

    def by_hand(x):
        torch.ops.aten.mul.out(x, 2, out=by_hand_buf)
        return torch.ops.aten.add.Tensor(
            sm.ops.one_shot_all_reduce.default(by_hand_buf, "sum", WORLD), 1)

    gm = make_fx(functools.partial(program, fc), tracing_mode="fake")(x)
    fused = lower(gm, CommLoweringConfig(auto_select=True, fuse_pointwise=True))
    # The fused program's two ops, called by hand with its constants made once (the
    # allocation's device among them): what any lowering of two ops per one-shot costs.
    allocation, kernel = [n for n in fused.graph.nodes if n.op == "call_function"]

    def fused_by_hand(x):
        buffer = allocation.target(*allocation.args)
        return kernel.target(buffer, x, *kernel.args[2:])
    upstream = torch.compile(functools.partial(program, ufc), backend="inductor",
                             fullgraph=True)
    variants = {
        "upstream inductor (gloo)": upstream,
        "refimpl lowered (gloo)": lower(gm),
        "refimpl lowered one-shot": lower(gm, CommLoweringConfig(auto_select=True)),
        "refimpl lowered fused": fused,
        "fused program forward": fused.forward,
        "fused ops by hand": fused_by_hand,
        "same ops by hand (one-shot)": by_hand,
        "bare one-shot op": lambda _: sm.ops.one_shot_all_reduce(buf, "sum", WORLD),
        "bare op, new data": lambda x: sm.ops.one_shot_all_reduce_pointwise(
            new_data_buf, x, "sum", WORLD),
    }
    results = {}
    for name, fn in variants.items():
        n = iters * (1 if "gloo" in name else 10)
        results[name] = best_us(fn, x, n, repeats)
    return results


def lowering_time_s(n: int) -> float:
    """Seconds for `lower()` on a traced graph of n all_reduces (fake process group)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import refimpl.functional_collectives as fc
    from refimpl.comm_lowering import lower

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)

    def many(x):
        return [fc.all_reduce(x * i, "sum", WORLD) for i in range(n)]

    gm = make_fx(many, tracing_mode="fake")(torch.ones(16))
    start = time.perf_counter()
    lower(gm)
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    require_native_ops("benchmarks/comm_lowering.py")
    per_rank = run_on_ranks(rank_timings, 2, args.iters, args.repeats)
    print("# all_reduce(x * 2) + 1, x = 1024 f32 (4 KiB), 2 gloo ranks on one machine")
    print(f"# torch {torch.__version__}, {platform.machine()}, 1 thread per rank, "
          f"best of {args.repeats}")
    med = {k: sorted(r[k] for r in per_rank)[len(per_rank) // 2] for k in per_rank[0]}
    for name, us in med.items():
        print(f"{name:28s} {us:10.1f} us/call")
    up = med["upstream inductor (gloo)"]
    print(f"upstream / refimpl gloo     {up / med['refimpl lowered (gloo)']:10.2f}x")
    print(f"upstream / refimpl one-shot {up / med['refimpl lowered one-shot']:10.2f}x")
    one_shot = med["refimpl lowered one-shot"]
    print(f"lowered one-shot / bare op  {one_shot / med['bare one-shot op']:10.2f}x")
    print(f"lowered one-shot / by hand  "
          f"{one_shot / med['same ops by hand (one-shot)']:10.2f}x")
    bare = med["bare one-shot op"]
    print(f"lowered fused / bare op     {med['refimpl lowered fused'] / bare:10.2f}x")
    print(f"fused forward / bare op     {med['fused program forward'] / bare:10.2f}x")
    print(f"fused by hand / bare op     {med['fused ops by hand'] / bare:10.2f}x")
    new_data = med["bare op, new data"]
    print(f"lowered fused / new data    {med['refimpl lowered fused'] / new_data:10.2f}x")
    print(f"lower() on 1,000 all_reduces: {lowering_time_s(1000):.2f} s")


if __name__ == "__main__":
    main()
