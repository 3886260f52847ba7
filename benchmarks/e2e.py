"""End to end: one FSDP training step on 2 gloo ranks, eager, refimpl-compiled, Inductor.

Trains the SimpleFSDP transformer of conformance/e2e_programs.py and reports per mode:
the collectives one step issues on the process group (forward / backward, counted by
c10d's sequence number), the median step time after warm-up (the slower of the two
ranks per step), its ratio to eager and to upstream Inductor measured in the same run,
and the first step's time (which includes compiling). For every refimpl mode, the
simulator's step time and exposed communication of the programs it compiled, summed
over the compiled graphs (forward and backward), under one CostModel profile (the H100
preset, or `--profile`, a `python -m refimpl.simulator calibrate` JSON) that the reorder
stage also schedules with: "bucket + lower" is the program before reorder, "all stages"
the same program after it.

    python benchmarks/e2e.py [--steps 20] [--warmup 3] [--dim 64] [--layers 4]
                             [--bucket-cap-mb 25] [--profile PROFILE.json]

Modes: eager; refimpl with every stage off (the traced program run by FX); refimpl with
bucketing and lowering, reorder off; refimpl with every stage (bucketing, lowering,
reorder: CompileConfig's defaults but the cap and the profile); Inductor; Inductor with
its FX bucketing of all_gathers and reduce_scatters at the same cap.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from conformance.e2e_programs import Model, parameter_shapes, train  # noqa: E402
from refimpl.multiprocess import run_on_ranks  # noqa: E402

MODES = ["eager", "refimpl, stages off", "refimpl, bucket + lower", "refimpl, all stages",
         "inductor", "inductor + fx bucketing"]
BEFORE_REORDER, AFTER_REORDER = "refimpl, bucket + lower", "refimpl, all stages"


def _cost_model(profile_path: str | None):
    """The one CostModel that the reorder stage schedules with and the simulator replays."""
    from refimpl.simulator import CostModel, HardwareProfile

    return CostModel(HardwareProfile.load(profile_path) if profile_path else None)


def _compile_backend(mode: str, cap_mb: float, profile_path: str | None):
    from conformance.backends import get_backend

    if mode == "eager":
        return None
    concept = get_backend("refimpl" if mode.startswith("refimpl") else "torch") \
        .require("compile_backend")
    stages_off = mode in ("refimpl, stages off", "inductor")
    options = {"bucket_cap_mb": None if stages_off else cap_mb}
    if mode.startswith("refimpl"):
        options["lowering"] = None if stages_off else {}
        options["reorder"] = ({"cost_model": _cost_model(profile_path)}
                              if mode == AFTER_REORDER else None)
    return concept.make(options)


def _simulated(compiled, profile_path: str | None) -> tuple[float, float]:
    """(step, exposed comm) in us of refimpl's compiled programs, summed over the graphs."""
    from refimpl.simulator import simulate

    cost_model = _cost_model(profile_path)
    timelines = [simulate(g.program, cost_model) for g in compiled.graphs]
    return (sum(t.step_time_us for t in timelines), sum(t.exposed_comm_us for t in timelines))


def run_rank(mode: str, model: Model, steps: int, cap_mb: float,
             profile_path: str | None) -> dict:
    import refimpl.functional_collectives as refimpl_fc
    from conformance.backends import get_backend

    fc = get_backend("torch").require("functional_collectives") \
        if mode.startswith("inductor") else refimpl_fc
    compiled = _compile_backend(mode, cap_mb, profile_path)
    result = train(fc, model, steps, compiled)
    records = result["steps"]
    simulated = _simulated(compiled, profile_path) if mode.startswith("refimpl") else None
    return {"seconds": [r.seconds for r in records],
            "issued": (records[-1].forward_collectives, records[-1].backward_collectives),
            "losses": [r.loss for r in records], "simulated": simulated}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--profile", default=None,
                        help="a HardwareProfile JSON (default: the simulator's H100 preset)")
    args = parser.parse_args()
    model = Model("transformer", dim=args.dim, layers=args.layers, heads=4, seq=32, batch=8)
    total = args.warmup + args.steps
    rows = {}
    for mode in MODES:
        ranks = run_on_ranks(run_rank, 2, mode, model, total, args.bucket_cap_mb,
                             args.profile, timeout=1800)
        per_step = [max(r["seconds"][i] for r in ranks) for i in range(total)]
        rows[mode] = {"first_s": per_step[0],
                      "median_ms": statistics.median(per_step[args.warmup:]) * 1e3,
                      "issued": ranks[0]["issued"], "simulated": ranks[0]["simulated"],
                      "losses": ranks[0]["losses"]}
    params = len(parameter_shapes(model))
    print(f"# one FSDP training step, 2 gloo ranks, transformer dim {args.dim}, "
          f"{args.layers} layers ({params} sharded parameters), seq 32, batch 8 per rank, "
          f"bucket cap {args.bucket_cap_mb:g} MiB")
    print(f"# torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores, "
          f"median of {args.steps} steps after {args.warmup} warm-up steps")
    print(f"# simulated (rank 0's programs, forward + backward): CostModel profile "
          f"{_cost_model(args.profile).profile.name!r}")
    header = (f"{'mode':26s} {'fw/bw collectives':>18s} {'step ms':>9s} {'/ eager':>8s} "
              f"{'/ inductor':>10s} {'first step s':>13s} {'sim. step us':>13s} "
              f"{'sim. exposed comm us':>21s}")
    print(header)
    eager_ms, inductor_ms = rows["eager"]["median_ms"], rows["inductor"]["median_ms"]
    for mode, row in rows.items():
        fw, bw = row["issued"]
        step_us, exposed_us = (f"{v:.1f}" for v in row["simulated"]) if row["simulated"] \
            else ("-", "-")
        print(f"{mode:26s} {f'{fw} / {bw}':>18s} {row['median_ms']:9.2f} "
              f"{row['median_ms'] / eager_ms:7.2f}x {row['median_ms'] / inductor_ms:9.2f}x "
              f"{row['first_s']:13.2f} {step_us:>13s} {exposed_us:>21s}")
    before, after = rows[BEFORE_REORDER]["simulated"][1], rows[AFTER_REORDER]["simulated"][1]
    print(f"# simulated exposed comm before reorder ({BEFORE_REORDER}) {before:.1f} us, "
          f"after ({AFTER_REORDER}) {after:.1f} us")
    for mode in (BEFORE_REORDER, AFTER_REORDER):
        same = rows[mode]["losses"] == rows["eager"]["losses"]
        print(f"# {mode}: losses equal eager's bit for bit: {same}")


if __name__ == "__main__":
    main()
