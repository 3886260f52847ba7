"""Benchmark: does the simulator rank node orders as reality does, and is it fast?

1. Validation. Two programs on 2 gloo ranks: an FSDP-like forward (each layer gathers
   its weight shard, then multiplies) and its backward (each layer computes a gradient,
   then reduce-scatters it). Each runs in 6 or more node orders (the program order,
   prefetching the next all_gathers, sinking the waits, ...), for real (median step time
   of the slower rank over repeats, the ranks synchronized by a barrier before each
   step), and simulated with a profile calibrated on this machine in the same run
   (`refimpl.simulator.calibrate`). Prints measured and simulated milliseconds, the error
   per order, and Kendall's tau between the two rankings, per program and overall.
2. Speed. plan_memory and simulate on FSDP-like forward graphs of 1,000, 2,000 and 4,000
   all_gathers traced on a fake process group of 8, with upstream's memory estimator
   (MemoryTracker, CPU storages kept) on the same graphs in the same run; microseconds
   per collective show linearity. Upstream has no simulator of a given order to compare.

Run with nothing else busy on the machine:
    python benchmarks/simulator.py [--sizes 1000,2000,4000] [--repeat 15] [--profile-out FILE]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time

import torch
import torch.distributed as dist

LAYERS = 4
SHARD = (128, 256)  # a rank's shard of a 256 x 256 weight (2 ranks)
ACT = (192, 256)


# --------------------------------------------------------------------------------------
# Programs
# --------------------------------------------------------------------------------------
def forward(ops, act, *shards):
    for shard in shards:
        w = ops.wait_tensor(ops.all_gather_into_tensor(shard, 2, "0"))
        act = torch.tanh(act @ w.view(256, 256))
    return act


def backward(ops, act, *grads_out):
    outs = []
    for g in grads_out:
        grad_w = act.t() @ g                         # 256 x 256
        outs.append(ops.wait_tensor(ops.reduce_scatter_tensor(grad_w, "sum", 2, "0")))
    return outs


# An accelerator's kernel, as the CPU sees it: the host waits while the device computes.
# `kernel(dep, shape, us)` sleeps `us` microseconds and returns a new tensor of `shape`;
# the simulator is given the same duration (pinned), so these programs test the schedule
# model (streams, issue, waits) apart from the compute model and from CPU contention.
_bench = torch.library.Library("refimpl_bench", "DEF")
_bench.define("kernel(Tensor dep, int[] shape, float us) -> Tensor")


def _kernel(dep, shape, us):
    time.sleep(us / 1e6)
    return dep.new_zeros(shape)  # not new_empty: reducing denormal garbage is slow


_bench.impl("kernel", _kernel, "CPU")
torch.library.register_fake("refimpl_bench::kernel", lib=_bench)(
    lambda dep, shape, us: dep.new_empty(shape))
KERNEL_US = 700.0


def forward_accel(ops, act, *shards):
    for shard in shards:
        w = ops.wait_tensor(ops.all_gather_into_tensor(shard, 2, "0"))
        act = torch.ops.refimpl_bench.kernel(w, list(ACT), KERNEL_US)
    return act


def backward_accel(ops, act, *grads_out):
    outs = []
    for g in grads_out:
        grad_w = torch.ops.refimpl_bench.kernel(g, [256, 256], KERNEL_US)
        outs.append(ops.wait_tensor(ops.reduce_scatter_tensor(grad_w, "sum", 2, "0")))
    return outs


PROGRAMS = {"forward": forward, "backward": backward, "forward, accelerator-like compute":
            forward_accel, "backward, accelerator-like compute": backward_accel}


def inputs(program: str, rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    act = torch.randn(ACT, generator=gen) * 0.1
    if program.startswith("forward"):
        return [act] + [torch.randn(SHARD, generator=gen) * 0.05 for _ in range(LAYERS)]
    return [act] + [torch.randn(ACT, generator=gen) * 0.05 for _ in range(LAYERS)]


def trace(program: str, rank: int) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    import refimpl.functional_collectives  # noqa: F401

    fn = PROGRAMS[program]
    ops = torch.ops.refimpl_c10d
    return make_fx(lambda *xs: fn(ops, *xs), tracing_mode="fake")(*inputs(program, rank))


# --------------------------------------------------------------------------------------
# Orders: lists of node names, built from the graph's structure
# --------------------------------------------------------------------------------------
def _kinds(gm):
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    colls = [n for n in body if "all_gather" in str(n.target) or "reduce_scatter" in
             str(n.target)]
    waits = [n for n in body if "wait_tensor" in str(n.target)]
    return body, colls, waits


def _move_before(order, node, anchor):
    order = [n for n in order if n is not node]
    at = order.index(anchor)
    return order[:at] + [node] + order[at:]


def _move_after(order, node, anchor):
    order = [n for n in order if n is not node]
    at = order.index(anchor) + 1
    return order[:at] + [node] + order[at:]


def forward_orders(gm):
    body, colls, waits = _kinds(gm)

    def prefetch(distance):  # issue gather i+d right after wait i
        order = body
        for i in range(len(colls)):
            j = i + distance
            if j < len(colls) and i < len(waits):
                order = _move_after(order, colls[j], waits[i])
        return order

    all_first = colls + [n for n in body if n not in colls]
    serial_first = [x for c, w in zip(colls, waits, strict=True) for x in (c, w)] + \
        [n for n in body if n not in colls and n not in waits]
    return {"program order": body, "prefetch 1": prefetch(1), "prefetch 2": prefetch(2),
            "prefetch 3": prefetch(3), "all gathers first": all_first,
            "gathers and waits first": serial_first}


def backward_orders(gm):
    body, colls, waits = _kinds(gm)

    def sink(by):  # wait i moved to just before collective i+by is issued (or the end)
        order = body
        for i, w in enumerate(waits):
            if i + by < len(colls):
                order = _move_before(order, w, colls[i + by])
            else:
                order = [n for n in order if n is not w] + [w]
        return order

    compute_first = [n for n in body if n not in colls and n not in waits] + \
        [x for c, w in zip(colls, waits, strict=True) for x in (c, w)]
    issue_late = [n for n in body if n not in colls and n not in waits] + colls + waits
    return {"program order": body, "waits sunk 1": sink(1), "waits sunk 2": sink(2),
            "waits at the end": sink(len(colls)), "compute first, serial comm": compute_first,
            "compute first, comm together": issue_late}


def orders_of(program: str, gm):
    return (forward_orders if program.startswith("forward") else backward_orders)(gm)


def pinned_kernels(gm) -> dict[str, float]:
    return {n.name: n.args[2] for n in gm.graph.nodes if "refimpl_bench" in str(n.target)}


def reordered(gm, order) -> torch.fx.GraphModule:
    """A copy of gm whose nodes run in `order`."""
    graph = torch.fx.Graph()
    env = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = graph.node_copy(n, env.__getitem__)
    for n in order:
        env[n] = graph.node_copy(n, env.__getitem__)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    graph.node_copy(output, env.__getitem__)
    return torch.fx.GraphModule(gm, graph)


# --------------------------------------------------------------------------------------
# Measured on ranks
# --------------------------------------------------------------------------------------
def measure_orders(program: str, repeat: int) -> dict[str, float]:
    """On a rank: median ms per step of every order. The orders take turns, round after
    round, so that a slow spell of the machine lands on all of them; a barrier starts
    every step on both ranks together."""
    rank = dist.get_rank()
    gm = trace(program, rank)
    xs = inputs(program, rank)
    runs = {name: reordered(gm, order) for name, order in orders_of(program, gm).items()}
    samples = {name: [] for name in runs}
    for round_ in range(repeat + 3):
        for name, run in runs.items():
            dist.barrier()
            start = time.perf_counter()
            run(*xs)
            if round_ >= 3:  # warm-up rounds
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(times) for name, times in samples.items()}


def measure_collectives(repeat: int) -> dict[str, float]:
    """On a rank: median us of each collective of the programs, alone (barrier first)."""
    import refimpl.functional_collectives as fc

    ops = fc.ops
    shard, grad = torch.randn(SHARD), torch.randn(256, 256)
    cases = {
        "all_gather of a 128 KiB shard": lambda: ops.wait_tensor(
            ops.all_gather_into_tensor(shard, 2, "0")),
        "reduce_scatter of a 256 KiB gradient": lambda: ops.wait_tensor(
            ops.reduce_scatter_tensor(grad, "sum", 2, "0")),
    }
    result = {}
    for name, fn in cases.items():
        times = []
        for i in range(repeat + 3):
            dist.barrier()
            start = time.perf_counter()
            fn()
            if i >= 3:
                times.append((time.perf_counter() - start) * 1e6)
        result[name] = statistics.median(times)
    return result


# --------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------
def kendall_tau(xs, ys) -> float:
    """Kendall's tau-b of two equally long sequences."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = ((concordant + discordant + ties_x) * (concordant + discordant + ties_y)) ** 0.5
    return (concordant - discordant) / denominator if denominator else 0.0


def validation(repeat: int, profile_out: str | None) -> None:
    from refimpl.multiprocess import run_on_ranks
    from refimpl.simulator import CostModel, calibrate, ring_us, simulate

    profile = calibrate((2,), repeat=20)
    if profile_out:
        with open(profile_out, "w") as f:
            f.write(profile.to_json() + "\n")
    link = profile.link(2)
    print(f"\nCalibrated profile: {profile.flops_per_us['default'] * 1e-3:.2f} GFLOP/s float32, "
          f"{profile.memory_bytes_per_us * 1e-3:.2f} GB/s memory, op overhead "
          f"{profile.op_overhead_us:.1f} us, gloo (2 ranks) alpha {link.alpha_us:.0f} us, "
          f"beta {link.beta_bytes_per_us * 1e-3:.2f} GB/s")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    alone = run_on_ranks(measure_collectives, 2, 4 * repeat)
    model = {"all_gather of a 128 KiB shard": ring_us(link, 2, 2 * 128 * 1024),
             "reduce_scatter of a 256 KiB gradient": ring_us(link, 2, 256 * 1024)}
    print("\n| collective, alone on 2 ranks | measured us | model us |\n|---|---:|---:|")
    for name, us in model.items():
        print(f"| {name} | {max(r[name] for r in alone):.0f} | {us:.0f} |")
    taus = {}
    for program in PROGRAMS:
        per_rank = run_on_ranks(measure_orders, 2, program, repeat, timeout=1200)
        gm = trace(program, 0)
        cost = CostModel(profile, pinned=pinned_kernels(gm))
        orders = orders_of(program, gm)
        print(f"\n## {program}: {LAYERS} layers, 2 gloo ranks\n")
        print("| order | measured ms | simulated ms | error | simulated exposed comm ms "
              "| simulated peak MiB |")
        print("|---|---:|---:|---:|---:|---:|")
        measured, simulated = [], []
        for name, order in orders.items():
            real = max(r[name] for r in per_rank)
            tl = simulate(gm, cost, order)
            sim = tl.step_time_us / 1e3
            measured.append(real)
            simulated.append(sim)
            print(f"| {name} | {real:.2f} | {sim:.2f} | {100 * (sim - real) / real:+.0f}% | "
                  f"{tl.exposed_comm_us / 1e3:.2f} | {tl.peak_bytes / 2**20:.2f} |")
        taus[program] = kendall_tau(measured, simulated)
        print(f"\nKendall tau (measured vs simulated ranking): {taus[program]:+.2f}")
    print("\n| program | Kendall tau |\n|---|---:|")
    for program, tau in taus.items():
        print(f"| {program} | {tau:+.2f} |")
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# Speed
# --------------------------------------------------------------------------------------
def big_forward(n: int) -> torch.fx.GraphModule:
    """An FSDP-like forward of n all_gathers (upstream's ops), traced on a fake group of 8."""
    import torch.distributed._functional_collectives as ufc
    from torch.fx.experimental.proxy_tensor import make_fx

    shapes = [(128, 64), (32,), (64, 64), (16, 8)]
    params = [torch.randn(shapes[i % len(shapes)]) for i in range(n)]

    def fwd(act, *shards):
        for shard in shards:
            full = ufc.all_gather_tensor(shard, 0, dist.group.WORLD)
            act = act + full.reshape(-1)[:1]
        return act

    return make_fx(fwd, tracing_mode="fake")(torch.zeros(1), *params)


def timed(fn) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def speed(sizes) -> None:
    from torch._inductor.fx_passes.memory_estimator import MemoryTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from refimpl.memory import plan_memory
    from refimpl.simulator import simulate

    def upstream(gm):
        tracker = MemoryTracker(gm.graph, device_filter=lambda d: True)
        for node in gm.graph.nodes:
            tracker.schedule_node(node)
        return tracker.peak_memory

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    print("\n## Speed: FSDP-like forward graphs, fake process group of 8\n")
    print("| all_gathers | nodes | plan_memory s | us/collective | simulate s | us/collective "
          "| upstream MemoryTracker s | upstream / plan_memory |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        gm = big_forward(n)
        nodes = len(gm.graph.nodes)
        plan_s = min(timed(lambda gm=gm: plan_memory(gm)) for _ in range(3))
        sim_s = min(timed(lambda gm=gm: simulate(gm)) for _ in range(3))
        up_s = timed(lambda gm=gm: upstream(gm))
        print(f"| {n:,} | {nodes:,} | {plan_s:.3f} | {plan_s / n * 1e6:.0f} | {sim_s:.3f} | "
              f"{sim_s / n * 1e6:.0f} | {up_s:.3f} | {up_s / plan_s:.1f}x |")
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# Pictures for the README: one program, two orders, on the H100 preset
# --------------------------------------------------------------------------------------
def pictures(out_dir: str) -> None:
    """An FSDP-like forward of 4 layers (bf16 4096 x 4096 weights, 8 ranks) in program
    order and with each gather prefetched one layer ahead: SVG, Perfetto trace, plan."""
    from pathlib import Path

    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import refimpl.functional_collectives  # noqa: F401
    from refimpl.memory import plan_memory
    from refimpl.simulator import simulate

    def layers(act, *shards):
        ops = torch.ops.refimpl_c10d
        for shard in shards:
            w = ops.wait_tensor(ops.all_gather_into_tensor(shard, 8, "0"))
            act = torch.relu(act @ w.view(4096, 4096))
        return act

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    act = torch.empty(8192, 4096, dtype=torch.bfloat16, device="meta")
    shards = [torch.empty(512, 4096, dtype=torch.bfloat16, device="meta") for _ in range(4)]
    gm = make_fx(layers, tracing_mode="fake")(act, *shards)
    orders = forward_orders(gm)
    out = Path(out_dir)
    for name in ("program order", "prefetch 1"):
        tl = simulate(gm, order=orders[name])
        stem = "timeline_" + name.replace(" ", "_")
        tl.to_svg(out / f"{stem}.svg")
        tl.to_chrome_trace(out / f"{stem}.json")
        print(f"{name}: step {tl.step_time_us:.0f} us, exposed comm {tl.exposed_comm_us:.0f} "
              f"us, overlap {tl.overlap:.0%}, peak {tl.peak_bytes / 2**20:.0f} MiB")
    print(plan_memory(gm, orders["prefetch 1"]).table(unit=2**20))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,2000,4000")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--profile-out", default=None)
    parser.add_argument("--skip-validation", action="store_true")
    parser.add_argument("--pictures", metavar="DIR",
                        help="only write the README's timeline pictures into DIR")
    args = parser.parse_args()
    if args.pictures:
        return pictures(args.pictures)
    print(f"# Simulator benchmark: torch {torch.__version__}, {platform.machine()}, "
          f"{platform.processor() or 'cpu'}")
    if not args.skip_validation:
        validation(args.repeat, args.profile_out)
    speed([int(s) for s in args.sizes.split(",")])


if __name__ == "__main__":
    main()
