"""Shared-memory all-reduce (one-shot, `out=`, two-shot) against gloo and DeepSpeed, one run.

For 2 and 4 ranks and float32 `sum` over 1 KiB to 4 MiB, every rank times each operation
on its own; the table shows rank 0's p50 / p90 latency in microseconds. `one-shot`
allocates its result, `out=` writes a preallocated one; gloo, two-shot and DeepSpeed
reduce in place. Those three refimpl columns reduce a symmetric buffer that nobody
writes between calls, so its cache lines stay shared by every core; `copy-in` copies a
plain tensor into the buffer first, inside the kernel (`one_shot_all_reduce_pointwise`
with empty chains), as DeepSpeed's op copies its input into its shared buffer on every
call: new data crosses between cores each time, the fair column against DeepSpeed.
DeepSpeed (`deepspeed.comm.inference_all_reduce`, its CPU shared-memory op) is the peer
column when its virtual environment exists (`--deepspeed-python`, default
/work/venvs/deepspeed/bin/python; see benchmarks/deepspeed_peer.py), run right after
refimpl's ranks of the same world size; nothing in refimpl needs it. The ratio columns
are DeepSpeed's p50 over refimpl one-shot's and copy-in's (above 1: refimpl is faster).
`DeepSpeed op` is the op under DeepSpeed's Python API (`torch.ops.deepspeed.
inference_all_reduce_`), what refimpl's columns call directly.

    python benchmarks/symm_mem.py [--worlds 2 4] [--quick] [--no-deepspeed]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import refimpl.symmetric_memory as sm  # noqa: E402
from refimpl.multiprocess import run_on_ranks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from native_ops import require_native_ops  # noqa: E402
from percentiles import percentiles_us  # noqa: E402

SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
DEEPSPEED_PYTHON = "/work/venvs/deepspeed/bin/python"
HERE = os.path.dirname(os.path.abspath(__file__))



def iterations(nbytes: int, quick: bool) -> int:
    if nbytes <= 64 << 10:
        return 100 if quick else 600
    return 20 if quick else (200 if nbytes <= 1 << 20 else 60)


def _bench_rank(sizes: list[int], quick: bool) -> list[tuple]:
    torch.set_num_threads(1)
    group = dist.group.WORLD.group_name
    sm.enable_symm_mem_for_group(group)
    ops = sm.ops
    rows = []
    for nbytes in sizes:
        numel, n = nbytes // 4, iterations(nbytes, quick)
        plain = torch.zeros(numel)
        gloo = percentiles_us(lambda: dist.all_reduce(plain), max(n // 4, 10))
        buf = sm.empty(numel, dtype=torch.float32)
        buf.zero_()  # sums of zeros stay zero, however often two-shot reduces in place
        sm.rendezvous(buf, group)
        out = torch.empty(numel)
        fresh = torch.zeros(numel)
        one = percentiles_us(lambda: ops.one_shot_all_reduce(buf, "sum", group), n)
        copy_in = percentiles_us(
            lambda: ops.one_shot_all_reduce_pointwise(buf, fresh, "sum", group), n)
        one_out = percentiles_us(lambda: ops.one_shot_all_reduce_out(buf, "sum", group, out=out),
                                 n)
        two = percentiles_us(lambda: ops.two_shot_all_reduce_(buf, "sum", group), n)
        rows.append((nbytes, gloo, one, copy_in, one_out, two))
    return rows


def deepspeed_rows(python: str, world: int, sizes: list[int], quick: bool) -> dict | None:
    """DeepSpeed's p50/p90 per size from its own environment, or None (with the reason)."""
    if not python or not os.path.exists(python):
        print(f"# DeepSpeed: no interpreter at {python!r}; column left empty")
        return None
    cmd = [python, os.path.join(HERE, "deepspeed_peer.py"), "--world", str(world),
           "--sizes", *map(str, sizes), "--iterations",
           *(str(iterations(s, quick)) for s in sizes)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        print(f"# DeepSpeed failed (exit {proc.returncode}): {proc.stderr[-500:]}")
        return None
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"# DeepSpeed {report['deepspeed']} on torch {report['torch']}, world {world}")
    return {int(k): v for k, v in report["rows"].items()}


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _cell(p: tuple[float, float] | list[float] | None) -> str:
    return "-" if p is None else f"{p[0]:.1f} / {p[1]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--deepspeed-python", default=DEEPSPEED_PYTHON)
    parser.add_argument("--no-deepspeed", action="store_true")
    args = parser.parse_args()
    require_native_ops("benchmarks/symm_mem.py")
    print(f"# symmetric-memory all-reduce, float32 sum: {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"load average before {os.getloadavg()[0]:.2f}\n")
    tables = []
    for world in args.worlds:
        rows = run_on_ranks(_bench_rank, world, SIZES, args.quick, timeout=1800)[0]
        ds = None if args.no_deepspeed else deepspeed_rows(args.deepspeed_python, world, SIZES,
                                                           args.quick)
        tables.append((world, rows, ds))
    print("\np50 / p90 in microseconds (rank 0); ratios = DeepSpeed p50 / refimpl one-shot p50 "
          "and / copy-in p50\n")
    print("| ranks | size | refimpl one-shot | refimpl copy-in | refimpl `out=` "
          "| refimpl two-shot | DeepSpeed | DeepSpeed op | ratio | ratio copy-in | gloo |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for world, rows, ds in tables:
        for nbytes, gloo, one, copy_in, one_out, two in rows:
            peer = ds[nbytes]["inference_all_reduce"] if ds else None
            raw = ds[nbytes]["raw_op"] if ds else None
            ratio = f"{peer[0] / one[0]:.2f}" if peer else "-"
            ratio_in = f"{peer[0] / copy_in[0]:.2f}" if peer else "-"
            print(f"| {world} | {_size(nbytes)} | {_cell(one)} | {_cell(copy_in)} "
                  f"| {_cell(one_out)} | {_cell(two)} | {_cell(peer)} | {_cell(raw)} | {ratio} "
                  f"| {ratio_in} | {_cell(gloo)} |")
    print(f"\n# load average after {os.getloadavg()[0]:.2f}; /dev/shm refimpl segments left: "
          f"{len(sm.leaked_segments())}")


if __name__ == "__main__":
    main()
