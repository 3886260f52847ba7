"""Train a small transformer sharded FSDP-style on gloo ranks: eagerly, compiled with
refimpl's backend, and compiled with Inductor; print the losses side by side.

    python examples/fsdp_train.py --ranks 2 [--steps 10] [--layers 2] [--no-inductor]
                                  [--bucket-cap-mb 25] [--one-shot] [--debug-dir DIR]

The model and its SimpleFSDP-style sharding are conformance/e2e_programs.py: every rank
keeps a shard of each parameter, all_gathers it (refimpl.functional_collectives) where
the forward uses it, and autograd reduce_scatters its gradient. Compiled with
`refimpl.compile.backend(...)`, AOTAutograd's forward and backward graphs are bucketed,
lowered and reordered, then run eagerly as FX programs on the same gloo group: the
losses are eager's bit for bit. `--debug-dir` keeps every stage of every graph as
canonical text, with the final program's memory plan and simulated timeline (SPEC.md
E2E-5). Upstream's `fully_shard` runs on CPU but does not compile with
fullgraph=True in torch 2.13 (Dynamo skips its hooks), hence the SimpleFSDP sharding.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import refimpl.functional_collectives as fc  # noqa: E402
from conformance.e2e_programs import Model, train  # noqa: E402
from refimpl.comm_lowering import CommLoweringConfig  # noqa: E402
from refimpl.compile import STAGES, CompileConfig, backend  # noqa: E402
from refimpl.multiprocess import run_on_ranks  # noqa: E402


def progress(mode: str, steps: int):
    """A line per step on rank 0: loss, collectives issued, time."""
    def report(step, record):
        if dist.get_rank() == 0:
            print(f"[{mode:8s}] step {step + 1}/{steps}  loss {record.loss:.6f}  "
                  f"collectives fw {record.forward_collectives} "
                  f"bw {record.backward_collectives}  {record.seconds * 1e3:8.1f} ms",
                  flush=True)
    return report


def run_rank(args) -> dict:
    model = Model("transformer", layers=args.layers)
    lowering = CommLoweringConfig(auto_select=args.one_shot)
    if args.one_shot:
        from refimpl.symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(dist.group.WORLD)
    config = CompileConfig(bucket_cap_mb=args.bucket_cap_mb, lowering=lowering,
                           debug_dir=args.debug_dir)
    modes = {"eager": None, "refimpl": backend(config)}
    if args.inductor:
        modes["inductor"] = "inductor"
    return {mode: train(fc, model, args.steps, compiler, on_step=progress(mode, args.steps))
            for mode, compiler in modes.items()}


def summary(runs: dict) -> str:
    """The losses side by side, then how each compiled run compares with eager."""
    modes = list(runs)
    lines = ["step " + "".join(f"{m:>14s}" for m in modes)]
    for i in range(len(runs["eager"]["steps"])):
        lines.append(f"{i + 1:4d} " + "".join(f"{runs[m]['steps'][i].loss:14.8f}"
                                              for m in modes))
    eager = runs["eager"]
    for mode in modes[1:]:
        losses = [(a.loss, b.loss) for a, b in zip(eager["steps"], runs[mode]["steps"],
                                                      strict=True)]
        shards = list(zip(eager["shards"], runs[mode]["shards"], strict=True))
        if all(a == b for a, b in losses) and all(torch.equal(a, b) for a, b in shards):
            lines.append(f"{mode}: losses and parameters equal eager's bit for bit")
        else:
            loss_diff = max(abs(a - b) for a, b in losses)
            param_diff = max((a - b).abs().max().item() for a, b in shards)
            lines.append(f"{mode}: max |loss - eager| {loss_diff:.2e}, max |parameter - "
                         f"eager| {param_diff:.2e} (fused arithmetic rounds differently)")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--one-shot", action="store_true",
                        help="lowering picks the one-shot all-reduce on symmetric memory")
    parser.add_argument("--debug-dir", default=None)
    parser.add_argument("--no-inductor", dest="inductor", action="store_false",
                        help="skip Inductor (its first step compiles for ~30 s here)")
    args = parser.parse_args(argv)
    runs = run_on_ranks(run_rank, args.ranks, args, timeout=1800)
    print()
    print(summary(runs[0]))
    if args.debug_dir:
        files = ", ".join(f"{i}_{stage}.txt" for i, stage in enumerate(STAGES))
        print(f"\nevery stage of every graph: {args.debug_dir}/rank<r>/graph<i>_<kind>/"
              f"{{{files}}}")


if __name__ == "__main__":
    main()
