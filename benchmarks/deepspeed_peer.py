"""DeepSpeed's CPU shared-memory all-reduce, timed the way `benchmarks/symm_mem.py` times refimpl.

Runs in DeepSpeed's own virtual environment (never the project's: nothing in refimpl or
its tests needs DeepSpeed), started by `benchmarks/symm_mem.py` as a peer column:

    DS_ACCELERATOR=cpu /work/venvs/deepspeed/bin/python benchmarks/deepspeed_peer.py \
        --world 2 --sizes 1024 4096 --iterations 600 60

`world` processes join a gloo group (`deepspeed.init_distributed`), which builds and
initialises DeepSpeed's `ShareMemCommBuilder` op; every rank then times
`deepspeed.comm.inference_all_reduce` (what a user calls) and the op under it,
`torch.ops.deepspeed.inference_all_reduce_`, on float32 tensors. Prints one JSON object:
rank 0's p50 and p90 in microseconds per size. DeepSpeed leaves its segments in
/dev/shm for good; this script unlinks the ones its run created.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from percentiles import percentiles_us

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def rank_main(rank: int, world: int, port: int, sizes: list[int], iterations: list[int],
              queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as ds_comm

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rows = {}
    for nbytes, n in zip(sizes, iterations, strict=True):
        t = torch.zeros(nbytes // 4)
        api = percentiles_us(lambda t=t: ds_comm.inference_all_reduce(t), n)
        raw = percentiles_us(lambda t=t: torch.ops.deepspeed.inference_all_reduce_(t), n)
        rows[nbytes] = {"inference_all_reduce": api, "raw_op": raw}
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unlink_segments(port: int) -> None:
    """DeepSpeed names its segments after the master address and port of the run."""
    for name in os.listdir("/dev/shm"):
        if name.startswith("deepspeed_allreduce_buffer") and f"_{port}_" in name:
            os.unlink(os.path.join("/dev/shm", name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    parser.add_argument("--iterations", type=int, nargs="+", required=True)
    args = parser.parse_args()
    port = free_port()
    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    try:
        procs = [ctx.Process(target=rank_main, args=(r, args.world, port, args.sizes,
                                                     args.iterations, queue))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=900)
        for p in procs:
            p.join()
    finally:
        unlink_segments(port)
    import deepspeed

    print(json.dumps({"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                      "rows": rows}))


if __name__ == "__main__":
    main()
