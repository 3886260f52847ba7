"""Soak: many eager all_reduce + wait on 2 gloo ranks, and as many dropped unwaited.

Checks FC-6 and FC-8 over a long run: after every block of ops the work registry must
be empty again, and the resident memory of each rank (VmRSS, not the peak) must stay
flat. The same loop runs on upstream's functional collectives in the same workers, as
the yardstick for memory and time (upstream keeps its registry in C++ and exposes no
count of it).

    python benchmarks/funcol_soak.py [--ops 20000] [--blocks 10] [--no-drop]

Prints, per library and block, ops done, registry size and RSS per rank, then the RSS
growth from the first block to the last and the time per op.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from refimpl.multiprocess import run_on_ranks  # noqa: E402


def rss_mb() -> float:
    """Current resident set size of this process (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def soak(library: str, ops: int, blocks: int, drop: bool = True) -> dict:
    """On every rank: `ops` all_reduce + wait and (`drop`) `ops` dropped unwaited."""
    import torch.distributed as dist

    if library == "refimpl":
        import refimpl.functional_collectives as fc

        registry = fc.work_registry_size
    else:
        import torch.distributed._functional_collectives as fc

        registry = None
    group = dist.group.WORLD
    x = torch.ones(16) * (dist.get_rank() + 1)
    per_block = ops // blocks
    rows, wrong = [], 0
    start = time.perf_counter()
    for block in range(blocks):
        for _ in range(per_block):
            y = fc.all_reduce(x, "sum", group)
            if y.wait()[0].item() != 3.0:  # waited: its value is checked
                wrong += 1
            if drop:
                fc.all_reduce(x, "sum", group)  # dropped unwaited: the finalizer waits it
        gc.collect()
        rows.append((block + 1, (1 + drop) * (block + 1) * per_block,
                     registry() if registry else None, rss_mb()))
    seconds = time.perf_counter() - start
    return {"rows": rows, "seconds": seconds, "wrong": wrong, "ops": (1 + drop) * ops}


def report(library: str, results: list[dict]) -> None:
    print(f"\n## {library}")
    print(f"{'block':>5s} {'ops':>8s} {'registry':>9s} " +
          " ".join(f"{'rss r' + str(r) + ' MB':>11s}" for r in range(len(results))))
    for i, row in enumerate(results[0]["rows"]):
        block, done, pending, _ = row
        rss = [res["rows"][i][3] for res in results]
        pending_text = "-" if pending is None else str(max(r["rows"][i][2] for r in results))
        print(f"{block:5d} {done:8d} {pending_text:>9s} " +
              " ".join(f"{m:11.1f}" for m in rss))
    growth = [res["rows"][-1][3] - res["rows"][0][3] for res in results]
    seconds = max(res["seconds"] for res in results)
    print("RSS growth from block 1 to the last: " +
          ", ".join(f"rank {r} {g:+.1f} MB" for r, g in enumerate(growth)))
    ops = results[0]["ops"]
    print(f"wrong values: {sum(res['wrong'] for res in results)}; "
          f"{seconds / ops * 1e6:.0f} us per op ({ops} ops per rank, {seconds:.1f} s)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20000,
                        help="waited all_reduces per rank (and as many dropped)")
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--no-drop", action="store_true",
                        help="only waited all_reduces (to time them apart)")
    args = parser.parse_args()
    dropped = "no" if args.no_drop else str(args.ops)
    print(f"# soak: {args.ops} all_reduce+wait and {dropped} dropped unwaited, 2 gloo ranks, "
          f"16 floats")
    print(f"# torch {torch.__version__}, {platform.machine()}, Python "
          f"{platform.python_version()}, cross-rank check (FC-28) "
          f"{'on' if os.environ.get('REFIMPL_CHECK_COLLECTIVES') == '1' else 'off'}")
    for library in ("refimpl", "upstream"):
        results = run_on_ranks(soak, 2, library, args.ops, args.blocks, not args.no_drop,
                               timeout=3600)
        report(library, results)


if __name__ == "__main__":
    main()
