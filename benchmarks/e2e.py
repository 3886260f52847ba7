"""End to end: one FSDP training step on 2 gloo ranks, eager, refimpl-compiled, Inductor.

Trains the SimpleFSDP transformer of conformance/e2e_programs.py and reports per mode:
the collectives one step issues on the process group (forward / backward, counted by
c10d's sequence number), the median step time after warm-up (the slower of the two
ranks per step), its ratio to eager and to upstream Inductor measured in the same run,
and the first step's time (which includes compiling). For refimpl, the simulator's
exposed communication of the compiled programs before and after reorder, once
refimpl/simulator.py and refimpl/reorder.py exist (marked pending until then), under
the simulator's default CostModel() profile, summed over the compiled graphs.

    python benchmarks/e2e.py [--steps 20] [--warmup 3] [--dim 64] [--layers 4]

Modes: eager; refimpl with every stage off (the traced program run by FX); refimpl with
bucketing and lowering (bucket_cap_mb 25); Inductor; Inductor with its FX bucketing of
all_gathers and reduce_scatters at the same cap.
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

MODES = ["eager", "refimpl, stages off", "refimpl, bucket + lower", "inductor",
         "inductor + fx bucketing"]


def _compile_backend(mode: str):
    from conformance.backends import get_backend

    if mode == "eager":
        return None
    concept = get_backend("refimpl" if mode.startswith("refimpl") else "torch") \
        .require("compile_backend")
    stages_off = mode in ("refimpl, stages off", "inductor")
    options = {"bucket_cap_mb": None if stages_off else 25.0}
    if mode.startswith("refimpl"):
        options["lowering"] = None if stages_off else {}
    return concept.make(options)


def _exposed_comm(compiled) -> tuple[str, str]:
    """Simulated exposed comm (us) of refimpl's programs, before and after reorder."""
    try:
        import refimpl.simulator as simulator
    except ModuleNotFoundError:
        return "pending (simulator)", "pending (reorder)"
    before = sum(simulator.simulate(g.program, simulator.CostModel()).exposed_comm_us
                 for g in compiled.graphs)
    return f"{before:.0f}", "pending (reorder)"


def run_rank(mode: str, model: Model, steps: int) -> dict:
    import refimpl.functional_collectives as refimpl_fc
    from conformance.backends import get_backend

    fc = get_backend("torch").require("functional_collectives") \
        if mode.startswith("inductor") else refimpl_fc
    compiled = _compile_backend(mode)
    result = train(fc, model, steps, compiled)
    records = result["steps"]
    exposed = _exposed_comm(compiled) if mode == "refimpl, bucket + lower" else ("", "")
    return {"seconds": [r.seconds for r in records],
            "issued": (records[-1].forward_collectives, records[-1].backward_collectives),
            "losses": [r.loss for r in records], "exposed": exposed}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    model = Model("transformer", dim=args.dim, layers=args.layers, heads=4, seq=32, batch=8)
    total = args.warmup + args.steps
    rows = {}
    for mode in MODES:
        ranks = run_on_ranks(run_rank, 2, mode, model, total, timeout=1800)
        per_step = [max(r["seconds"][i] for r in ranks) for i in range(total)]
        rows[mode] = {"first_s": per_step[0],
                      "median_ms": statistics.median(per_step[args.warmup:]) * 1e3,
                      "issued": ranks[0]["issued"], "exposed": ranks[0]["exposed"],
                      "losses": ranks[0]["losses"]}
    params = len(parameter_shapes(model))
    print(f"# one FSDP training step, 2 gloo ranks, transformer dim {args.dim}, "
          f"{args.layers} layers ({params} sharded parameters), seq 32, batch 8 per rank")
    print(f"# torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores, "
          f"median of {args.steps} steps after {args.warmup} warm-up steps")
    header = (f"{'mode':26s} {'fw/bw collectives':>18s} {'step ms':>9s} {'/ eager':>8s} "
              f"{'/ inductor':>10s} {'first step s':>13s} "
              f"{'exposed comm us (before / after reorder)':>42s}")
    print(header)
    eager_ms, inductor_ms = rows["eager"]["median_ms"], rows["inductor"]["median_ms"]
    for mode, row in rows.items():
        fw, bw = row["issued"]
        exposed = " / ".join(row["exposed"]) if any(row["exposed"]) else "-"
        print(f"{mode:26s} {f'{fw} / {bw}':>18s} {row['median_ms']:9.2f} "
              f"{row['median_ms'] / eager_ms:7.2f}x {row['median_ms'] / inductor_ms:9.2f}x "
              f"{row['first_s']:13.2f} {exposed:>42s}")
    same = rows["refimpl, bucket + lower"]["losses"] == rows["eager"]["losses"]
    print(f"# refimpl's losses equal eager's bit for bit: {same}")


if __name__ == "__main__":
    main()
