"""torchtitan's llama3 debug model with its SimpleFSDP data parallel on 2 gloo ranks of a
CPU: eager, torch.compile with torchtitan's passes, and with refimpl's backend, side by side
(issue 45; results in benchmarks/results/clients.md, "torchtitan").

    pip install -e '.[clients]'
    python benchmarks/torchtitan_llama3.py [--steps 2] [--seq 64]

Each rank builds the `debugmodel` flavour (6 layers, dim 256, vocab 2048) from one seed,
shards every parameter with `data_parallel(mode="fully_shard")` over a CPU DeviceMesh of the
2 ranks (each forward all_gathers every weight), and computes the cross-entropy loss of its
own batch: eagerly, compiled with torchtitan's JIT backend (`aot_eager` + its
`auto_bucketing` pass, conformance/backends/torchtitan_backend.py, whose only change for a
CPU is the scheduler's cost estimates), the same with its FSDP graph passes before it
(`deduplicate_fsdp_unshard_chains_pass`, `reassign_collective_pgs_pass`), and compiled
with `refimpl.compile.backend()`.
SPEC E2E-3: neither backend changes an arithmetic (both run the traced ATen ops; bucketing
and reorder move no reduction), so every loss must be bitwise the trace's: `aot_eager`
with no pass, the fourth column. The trace itself is not always eager's bits (the fifth
row of clients.md's table: torchtitan's attention block traced by AOTAutograd).

Forward only: torchtitan 0.3.0 refuses SDPA for its language models ("sdpa is no longer
supported for language models"), FlexAttention has no backward on a CPU (torch 2.13 and
2.15: "FlexAttention does not support backward on CPU"), and varlen attention runs
`_flash_attention_forward`, which has no CPU kernel. The script tries one backward and
prints the error it gets.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from refimpl.multiprocess import run_on_ranks  # noqa: E402

WORLD = 2
MODES = ("eager", "aot_eager", "torchtitan", "torchtitan_fsdp_passes", "refimpl")


def _loss_fn(model):
    import torch

    def loss(tokens, positions, masks, labels):
        logits = model(tokens, positions, masks)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 labels.flatten())

    return loss


def _compiled(mode, fn):
    import torch

    if mode == "eager":
        return fn
    if mode == "aot_eager":  # the trace with no pass: what both backends start from
        return torch.compile(fn, backend="aot_eager")
    if mode == "torchtitan":
        from conformance.backends import torchtitan_backend

        backend = torchtitan_backend.make({"bucket_cap_mb": 25.0, "reorder": {}})
    elif mode == "torchtitan_fsdp_passes":
        backend = _with_fsdp_passes()
    else:
        import refimpl.compile

        backend = refimpl.compile.backend()
    return torch.compile(fn, backend=backend)


def _with_fsdp_passes():
    """aot_eager with torchtitan's FSDP graph passes in the order its graph trainer runs
    them (`passes.compile_time_passes`): `deduplicate_fsdp_unshard_chains_pass` (one
    all_gather chain per flat parameter), `reassign_collective_pgs_pass` (FSDP all_gathers
    onto an extra group of the same ranks), then its auto-bucketing pass."""
    from torch._dynamo.backends.common import aot_autograd

    from conformance.backends import torchtitan_backend

    passes = torchtitan_backend.fsdp_passes_on_a_cpu()

    def compiler(gm, example_inputs):
        gm = passes.deduplicate_fsdp_unshard_chains_pass(gm, example_inputs)
        gm = passes.reassign_collective_pgs_pass(gm, example_inputs)
        return passes.autobucketing_reordering_pass(gm, example_inputs)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                        keep_inference_input_mutations=True)


def _rank(steps: int, seq: int) -> dict:
    """Every mode's losses on this rank (their float32 bits), seconds per step, and the
    error of one backward."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel
    from torchtitan.models.llama3 import llama3_configs

    torch.manual_seed(0)
    model = llama3_configs["debugmodel"]("flex").build()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = data_parallel(model, mesh, mode="fully_shard")
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    batches = [(torch.randint(0, 2048, (2, seq), generator=generator),
                torch.randint(0, 2048, (2, seq), generator=generator)) for _ in range(steps)]
    positions = torch.arange(seq).expand(2, seq)
    masks = model.get_attention_masks(positions)
    result = {}
    for mode in MODES:
        fn = _compiled(mode, _loss_fn(model))
        losses, started = [], time.perf_counter()
        with torch.no_grad():
            for tokens, labels in batches:
                losses.append(fn(tokens, positions, masks, labels).float())
        seconds = (time.perf_counter() - started) / steps
        result[mode] = {"losses": [x.item() for x in losses],
                        "bits": [x.view(torch.int32).item() for x in losses],
                        "s_per_step": seconds}
    try:
        tokens, labels = batches[0]
        _loss_fn(model)(tokens, positions, masks, labels).backward()
        result["backward"] = "ran"
    except Exception as exc:  # the reason this run is forward only
        result["backward"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    ranks = run_on_ranks(_rank, WORLD, args.steps, args.seq, timeout=1200)
    print("| rank | mode | losses | bitwise eager's | bitwise the trace's (aot_eager) "
          "| s per step |")
    print("|---|---|---|---|---|---|")
    for rank, got in enumerate(ranks):
        for mode in MODES:
            bits = got[mode]["bits"]
            eager, trace = (bits == got[m]["bits"] for m in ("eager", "aot_eager"))
            losses = ", ".join(f"{x:.7f}" for x in got[mode]["losses"])
            print(f"| {rank} | {mode} | {losses} | {'yes' if eager else 'NO'} | "
                  f"{'yes' if trace else 'NO'} | {got[mode]['s_per_step']:.2f} |")
    print(f"\none backward, eagerly: {ranks[0]['backward']}")


if __name__ == "__main__":
    main()
