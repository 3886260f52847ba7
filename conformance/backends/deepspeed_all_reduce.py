"""DeepSpeed's CPU shared-memory all-reduce (DeepSpeed 0.19.8, a client nobody here wrote)
judged by the symmetric-memory kernel cases (SPEC SM-14, SM-15, SM-16), as
`--backend conformance.backends.deepspeed_all_reduce:backend`
(benchmarks/results/clients.md holds the verdicts).

    pip install -e '.[clients]'
    python -m conformance --section SM \\
        --backend conformance.backends.deepspeed_all_reduce:backend

What a user calls is judged: `deepspeed.comm.inference_all_reduce(tensor, op, group)`,
in place, after `deepspeed.init_distributed` on the rank's own process group. Under it,
`torch.ops.deepspeed.inference_all_reduce_` (DeepSpeed's `ShareMemCommBuilder`, built
by ninja with the local compiler at the first use, about a minute) reduces through
shared memory when every rank of the world is on this machine (`LOCAL_SIZE`) and the
CPU has the vector width it needs; otherwise DeepSpeed falls back to
`torch.distributed.all_reduce`. The adapter maps the symmetric-memory ops of the cases
onto that one call, passing the reduction and the group through unchanged:

- `one_shot_all_reduce(t, op, group)`: a copy of `t` reduced in place (DeepSpeed copies
  its input into its own shared buffer on every call: there is no symmetric allocation
  to make), `one_shot_all_reduce_out` the same into `out`, `two_shot_all_reduce_` `t`
  reduced in place. DeepSpeed picks its own algorithm per size.
- `empty` is `torch.empty` (any tensor will do), `enable_symm_mem_for_group` starts
  DeepSpeed on the group once per process. Rendezvous, signals, barriers, persistent
  allocations, pointwise epilogues and timeouts have no DeepSpeed counterpart: their
  cases are `not implemented`, as are every other concept's.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import types

import torch
import torch.distributed as dist

from conformance.backends import Backend

SEGMENT_PREFIX = "deepspeed_allreduce_buffer"
# The cases' reduction names, as `torch.distributed.ReduceOp`s for DeepSpeed's API.
REDUCE_OPS = {name: getattr(dist.ReduceOp, name.upper())
              for name in ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")}


def _deepspeed_comm():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        import deepspeed.comm as ds_comm
    except ImportError as exc:
        raise ImportError(f"DeepSpeed is not installed ({exc}): pip install -e "
                          f"'.[clients]' (deepspeed==0.19.8)") from None
    return deepspeed, ds_comm


def _unlink_segments(port: str) -> None:
    """DeepSpeed leaves its shared-memory segments (named after MASTER_ADDR and
    MASTER_PORT) in /dev/shm for good; the run that made them removes them."""
    for name in os.listdir("/dev/shm"):
        if name.startswith(SEGMENT_PREFIX) and f"_{port}_" in name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))


_started: dict[str, object] = {}


def enable_symm_mem_for_group(group_name: str) -> None:
    """Start DeepSpeed on this world once per process: its op names its shared segments
    after MASTER_ADDR and MASTER_PORT, so every rank of a world sets the same pair (a
    port number rank 0 draws, never a listening socket) and LOCAL_SIZE to the world's
    size (every rank on this machine)."""
    if "comm" in _started:
        return
    deepspeed, ds_comm = _deepspeed_comm()
    drawn = [random.randrange(20_000, 60_000) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(drawn, src=0)
    port = str(drawn[0])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                      LOCAL_SIZE=str(dist.get_world_size()),
                      RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=str(dist.get_rank()))
    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    atexit.register(_unlink_segments, port)
    _started["comm"] = ds_comm


def _group(group_name: str):
    from torch.distributed import distributed_c10d as c10d

    return c10d._resolve_process_group(group_name)


def _reduce_(t: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    ds_comm = _started.get("comm")
    if ds_comm is None:
        raise RuntimeError("enable_symm_mem_for_group was not called on this rank")
    reduce_op = REDUCE_OPS.get(op.lower()) if isinstance(op, str) else None
    if reduce_op is None:
        raise ValueError(f"reduce_op: {op!r} is none of {', '.join(REDUCE_OPS)}")
    ds_comm.inference_all_reduce(t, reduce_op, group=_group(group_name))
    return t


def one_shot_all_reduce(t: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    return _reduce_(t.clone(), op, group_name)


def one_shot_all_reduce_out(t: torch.Tensor, op: str, group_name: str, *, out):
    out.copy_(t)
    return _reduce_(out, op, group_name)


def two_shot_all_reduce_(t: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    return _reduce_(t, op, group_name)


def _symmetric_memory():
    _deepspeed_comm()  # a missing DeepSpeed fails here, naming the install line
    ops = types.SimpleNamespace(one_shot_all_reduce=one_shot_all_reduce,
                                one_shot_all_reduce_out=one_shot_all_reduce_out,
                                two_shot_all_reduce_=two_shot_all_reduce_)
    return types.SimpleNamespace(DEVICE="cpu", empty=torch.empty, ops=ops,
                                 enable_symm_mem_for_group=enable_symm_mem_for_group)


backend = Backend(
    "deepspeed",
    {"symmetric_memory": _symmetric_memory()},
    notes={concept: "DeepSpeed 0.19.8 is judged as a CPU all-reduce kernel only "
                    "(symmetric-memory ops); it has no " + concept.replace("_", " ")
           for concept in ("functional_collectives", "lowering", "bucketing", "reorder",
                           "memory", "simulator", "compile_backend")},
)
