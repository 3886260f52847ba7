"""CUDA symmetric memory: one-shot latency and two-shot bandwidth, against the GPU's own copy
bandwidth and upstream torch.distributed._symmetric_memory, same ranks, one run.

Ranks are processes of the gloo harness, rank r on cuda:(r mod #GPUs). On a one-GPU machine
they share the GPU, which time-slices their contexts (unless MPS runs, which the header
reports): a kernel waiting in a barrier for a rank whose context is not running holds the GPU
until its time slice ends, so one-shot latencies there show the time-slicing, not an
interconnect (vLLM's 10-13 us at 512 KiB is across GPUs on NVLink).

- one-shot: float32, 4 KiB to 1 MiB, `one_shot_all_reduce` (allocates its result) and
  `one_shot_all_reduce_out`; the median of rank 0's wall time per call (refimpl's calls return
  once the kernels finished; upstream's calls are followed by a stream synchronisation, so both
  columns time the same thing);
- two-shot: 64 MiB in place (`sum`), its algorithm
  bandwidth (bytes / time) and the device-memory traffic of all ranks together per second
  ((3 * world - 1) * bytes: reduce-scatter reads world chunks and writes one, all-gather reads
  and writes world - 1), against a device-to-device copy of 256 MiB on the same GPU in the same
  run (bytes read + written per second);
- upstream: the same calls through torch.distributed._symmetric_memory where it runs; where
  it refuses or hangs, its message is reported instead. Ratios are upstream's time over
  refimpl's. NCCL is not compared: it refuses two processes on one GPU.

    python benchmarks/symm_mem_cuda.py [--worlds 2 4] [--quick] [--out FILE]
                                       [--upstream-timeout SECONDS]

`--worlds 1` runs the kernels with no peer: one process, no time-slicing, the one setup
where upstream (which refuses ranks that share a GPU) can be compared. Results:
benchmarks/results/symm_mem_cuda.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from percentiles import percentiles_us  # noqa: E402  (benchmarks/percentiles.py, beside this)

import refimpl.symmetric_memory as sm  # noqa: E402
from refimpl.multiprocess import RankError, RankTimeout, run_on_ranks  # noqa: E402

LATENCY_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 512 << 10, 1 << 20]
BANDWIDTH_SIZE = 64 << 20
COPY_SIZE = 256 << 20


def _p50_us(step, n: int) -> float:
    """The median of `n` timed calls of `step` after a warm-up, in microseconds."""
    return percentiles_us(step, n)[0]


def _device() -> torch.device:
    return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())


def _random(numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))


def _copy_bandwidth() -> float:
    """Device-to-device copy on this rank's GPU: bytes read + written per second (rank 0
    measures while the others wait)."""
    rate = 0.0
    if dist.get_rank() == 0:
        src = torch.randn(COPY_SIZE // 4, device=_device())
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            dst.copy_(src)
        end.record()
        end.synchronize()
        rate = 2 * COPY_SIZE * 20 / (start.elapsed_time(end) / 1000)
    dist.barrier()
    return rate


def _api(upstream: bool) -> SimpleNamespace:
    """The calls timed: refimpl's (which return once their kernels finished), or upstream's
    followed by a synchronisation, so that both columns time the same thing."""
    if upstream:
        import torch.distributed._symmetric_memory as usm

        ops, done = torch.ops.symm_mem, torch.cuda.synchronize
        return SimpleNamespace(
            module=usm,
            one_shot=lambda x, g: (ops.one_shot_all_reduce(x, "sum", g), done()),
            one_shot_out=lambda x, g, out: (ops.one_shot_all_reduce_out(x, "sum", g, out), done()),
            two_shot=lambda x, g: (ops.two_shot_all_reduce_(x, "sum", g), done()))
    ops = torch.ops.refimpl_symm_mem
    return SimpleNamespace(
        module=sm,
        one_shot=lambda x, g: ops.one_shot_all_reduce(x, "sum", g),
        one_shot_out=lambda x, g, out: ops.one_shot_all_reduce_out(x, "sum", g, out=out),
        two_shot=lambda x, g: ops.two_shot_all_reduce_(x, "sum", g))


def _symmetric(api, numel: int, group: str) -> torch.Tensor:
    buf = api.module.empty(numel, dtype=torch.float32, device=_device())
    buf.copy_(_random(numel))  # never zeros; sums grow by the group size per two-shot call
    api.module.rendezvous(buf, group)
    return buf


def _bench_rank(upstream: bool, quick: bool) -> dict:
    api = _api(upstream)
    group = dist.group.WORLD.group_name
    torch.cuda.set_device(_device())
    api.module.enable_symm_mem_for_group(group)
    rows = []
    for nbytes in LATENCY_SIZES:
        buf = _symmetric(api, nbytes // 4, group)
        out = torch.empty_like(buf)
        n = 50 if quick else 300
        one = _p50_us(lambda: api.one_shot(buf, group), n)
        one_out = _p50_us(lambda: api.one_shot_out(buf, group, out), n)
        rows.append((nbytes, one, one_out))
    big = _symmetric(api, BANDWIDTH_SIZE // 4, group)
    two = _p50_us(lambda: api.two_shot(big, group), 5 if quick else 20)
    copy = 0.0 if upstream else _copy_bandwidth()
    return {"latency": rows, "two_shot_us": two, "copy_bytes_per_s": copy}


def _breakdown_rank(quick: bool) -> list[tuple[str, float]]:
    """Where one 4 KiB one-shot call's time goes on one rank: the op through torch's
    dispatcher, the handle's Python call, the C call alone, a lone barrier, and the floor
    any synchronous call pays (a small copy and a synchronisation), medians in us."""
    from refimpl import _symm_mem_cuda

    group = dist.group.WORLD.group_name
    torch.cuda.set_device(_device())
    sm.enable_symm_mem_for_group(group)
    buf = _symmetric(_api(False), 1024, group)
    out = torch.empty_like(buf)
    handle = sm.get_symmetric_memory(buf)
    lib, report = _symm_mem_cuda.library(), handle._report
    context, stream = handle._context, handle._stream()
    codes = sm._check_reduce_input(buf, "sum", "breakdown")
    offset = buf.data_ptr() - handle.buffer_ptrs[handle.rank]
    timeout_ms = 60_000
    ops, n = torch.ops.refimpl_symm_mem, 200 if quick else 2000
    steps = [
        ("op `one_shot_all_reduce_out` (dispatcher, checks, lookups, handle, C)",
         lambda: ops.one_shot_all_reduce_out(buf, "sum", group, out=out)),
        ("the handle's `_one_shot` (Python, ctypes, C)",
         lambda: handle._one_shot(offset, buf.numel(), codes, out, timeout_ms)),
        ("`rsmc_one_shot_all_reduce` through ctypes alone",
         lambda: lib.rsmc_one_shot_all_reduce(context, stream, sm.OP_CHANNEL, offset,
                                              buf.numel(), codes[1], codes[0],
                                              out.data_ptr(), timeout_ms * 1_000_000, report)),
        ("`rsmc_barrier` through ctypes (one 64-thread kernel, waited)",
         lambda: lib.rsmc_barrier(context, stream, sm.OP_CHANNEL, timeout_ms * 1_000_000,
                                  report)),
        ("floor: `out.copy_(buf)` then `torch.cuda.synchronize()`",
         lambda: (out.copy_(buf), torch.cuda.synchronize())),
        ("floor: `torch.cuda.synchronize()` alone", torch.cuda.synchronize),
    ]
    return [(name, _p50_us(step, n)) for name, step in steps]


def _breakdown_report(rows: list[tuple[str, float]] | str) -> list[str]:
    lines = ["\n## Where a 4 KiB one-shot's time goes (1 rank)\n"]
    if isinstance(rows, str):
        return lines + [f"refimpl: {rows}"]
    lines += ["| what is timed (median per call) | us |", "|---|---|"]
    return lines + [f"| {name} | {us:.1f} |" for name, us in rows]


def _run(fn, world: int, *args, timeout_s: float) -> dict | str:
    """Rank 0's results, or why the ranks did not produce any."""
    try:
        return run_on_ranks(fn, world, *args, timeout=timeout_s)[0]
    except RankError as err:
        return f"refused: rank {err.rank} raised {err.exc_type}: {err.message.splitlines()[0]}"
    except RankTimeout as err:
        return f"hung: {err}"


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _sharing() -> str:
    """How the ranks share the GPU(s): the count, the compute mode, MPS or time-slicing."""
    try:
        mode = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        mode = ["unknown"]
    mps = os.path.exists(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    return (f"{torch.cuda.device_count()} GPU(s), compute mode {', '.join(mode) or 'unknown'}, "
            f"MPS {'pipe present' if mps else 'not running'}: ranks beyond the GPU count share "
            f"a GPU by {'MPS' if mps else 'time-slicing their contexts'}")


def _report(world: int, ours: dict | str, upstream: dict | str) -> list[str]:
    lines = [f"\n## {world} ranks\n"]
    if isinstance(ours, str):
        return lines + [f"refimpl: {ours}"]
    up = upstream if isinstance(upstream, dict) else None
    lines += ["| size | refimpl one-shot (us) | upstream | ratio | refimpl one-shot out= (us) "
              "| upstream | ratio |", "|---|---|---|---|---|---|---|"]
    for i, (nbytes, one, one_out) in enumerate(ours["latency"]):
        cells = [f"{one:.1f}", "-", "-", f"{one_out:.1f}", "-", "-"]
        if up:  # ratio: upstream's time / refimpl's (above 1: refimpl is faster)
            theirs, theirs_out = up["latency"][i][1:]
            cells[1:3] = [f"{theirs:.1f}", f"{theirs / one:.2f}x"]
            cells[4:6] = [f"{theirs_out:.1f}", f"{theirs_out / one_out:.2f}x"]
        lines.append(f"| {_size(nbytes)} | " + " | ".join(cells) + " |")
    seconds = ours["two_shot_us"] / 1e6
    traffic = (3 * world - 1) * BANDWIDTH_SIZE / seconds
    copy = ours["copy_bytes_per_s"]
    lines += ["", f"two-shot 64 MiB in place: {ours['two_shot_us']:.0f} us, algorithm bandwidth "
              f"{BANDWIDTH_SIZE / seconds / 1e9:.1f} GB/s, device-memory traffic of all ranks "
              f"{traffic / 1e9:.0f} GB/s = {traffic / copy:.2f} x the copy's {copy / 1e9:.0f} GB/s"]
    if up:
        lines.append(f"upstream two-shot 64 MiB: {up['two_shot_us']:.0f} us "
                     f"(refimpl / upstream time: {ours['two_shot_us'] / up['two_shot_us']:.2f})")
    else:
        lines.append(f"upstream: {upstream}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    parser.add_argument("--upstream-timeout", type=float, default=120,
                        help="seconds before upstream's ranks count as hung")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the parts of one 4 KiB one-shot call on one rank")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/symm_mem_cuda.py needs a CUDA device")
    lines = ["# CUDA symmetric memory (`benchmarks/symm_mem_cuda.py`)\n",
             f"{torch.cuda.get_device_name(0)}; {_sharing()}; torch {torch.__version__}, "
             f"CUDA {torch.version.cuda}, Python {platform.python_version()}, "
             f"{os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"{'--quick' if args.quick else 'full'} run."]
    print("\n".join(lines), flush=True)
    for world in args.worlds:
        ours = _run(_bench_rank, world, False, args.quick, timeout_s=240)
        upstream = _run(_bench_rank, world, True, args.quick, timeout_s=args.upstream_timeout)
        section = _report(world, ours, upstream)
        print("\n".join(section), flush=True)
        lines += section
        if args.out:  # after every group size: a run stopped later keeps what it measured
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
    if args.breakdown:
        section = _breakdown_report(_run(_breakdown_rank, 1, args.quick, timeout_s=120))
        print("\n".join(section), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write("\n".join(section) + "\n")


if __name__ == "__main__":
    main()
