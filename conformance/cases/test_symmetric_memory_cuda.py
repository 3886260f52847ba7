"""Conformance cases of SPEC.md section 6 that concern the CUDA backend (SM-21 .. SM-23).

They run where the backend's symmetric memory allocates on CUDA (refimpl with
--device cuda, upstream on a GPU machine) and are skipped elsewhere, so a CPU
run reports them "skipped". Ranks are processes of the gloo harness, rank r on cuda:(r mod
device count): on a one-GPU machine all ranks share it. Results are checked on every rank
against the rank-order fold of SM-15 computed here with torch on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conformance import harness
from conformance.harness import backend_in_rank

CONCEPT = "symmetric_memory"


def run(backend, fn, world_size: int, *args, **kwargs) -> list:
    """harness.run, with the CPU as the ranks' default device: every tensor under test is
    made on the backend's symmetric-memory device (`device_for_rank`, which `--device cuda`
    selects), every reference on the CPU."""
    return harness.run(backend, fn, world_size, *args, tensors_on_the_cpu=True, **kwargs)


BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
REDUCE_OPS = ["sum", "avg", "max", "min"]


def _require_cuda(backend, *attrs):
    sm = backend.require(CONCEPT, *attrs)
    if harness.symmetric_memory_device(sm).type != "cuda":
        pytest.skip("a rule of the CUDA backend: run on a GPU with --device cuda "
                    "(refimpl) or --backend torch")


def _setup(spec: str, *attrs: str):
    sm = backend_in_rank(spec).require(CONCEPT, *attrs)
    group = dist.group.WORLD.group_name
    sm.enable_symm_mem_for_group(group)
    device = sm.device_for_rank(dist.get_rank())
    torch.cuda.set_device(device)
    return sm, group, device


def _input(rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Random values, some huge (sums overflow to inf) and some subnormal (no flush to
    zero); integers near their limit, so sums wrap. No NaN, no -inf, no exact zero."""
    g = torch.Generator().manual_seed(4243 + rank)
    if not dtype.is_floating_point:
        x = torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)
        x[::5] = torch.iinfo(dtype).max - rank
        return x
    x = torch.randn(numel, generator=g) * 3
    x[::11] = 3e38  # on every rank: the sum overflows
    x[5::13] = 1e-40 * (rank + 1)  # on every rank: the sum is subnormal too
    return x.to(dtype)


def _rank_order(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """SM-15: ((x0 op x1) op x2) ..., 16-bit floats in float32, avg divides, one rounding."""
    dtype = inputs[0].dtype
    wide = dtype in (torch.float16, torch.bfloat16)
    acc = inputs[0].float() if wide else inputs[0].clone()
    for x in inputs[1:]:
        x = x.float() if wide else x
        acc = {"sum": torch.add, "avg": torch.add, "max": torch.maximum,
               "min": torch.minimum}[op](acc, x)
    if op == "avg":
        acc = acc / len(inputs)
    return acc.to(dtype)


# --------------------------------------------------------------------------------------
def _pads_and_mappings(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous")
    rank, world = dist.get_rank(), dist.get_world_size()
    right = (rank + 1) % world
    first = sm.empty(64, dtype=torch.float32, device=device)
    first.fill_(rank)
    h = sm.rendezvous(first, group)
    on_device = (first.device.type, h.get_buffer(right, (64,), torch.float32).device.type)
    h.barrier()
    peer_values = [h.get_buffer(r, (64,), torch.float32)[0].item() for r in range(world)]
    h.put_signal(right, channel=1)  # left in the pad: the next allocation must not see it
    h.barrier()
    del first, h
    second = sm.empty(64, dtype=torch.float32, device=device)
    h2 = sm.rendezvous(second, group)
    pad_zero = h2.get_signal_pad(rank).view(torch.int32).count_nonzero().item() == 0
    dist.barrier()  # no peer signals on the new pads before every rank looked at its own
    h2.barrier()
    return on_device, peer_values, pad_zero


@pytest.mark.spec("SM-21")
@pytest.mark.parametrize("world", [2, 3])
def test_cuda_allocations_are_device_memory_with_zeroed_pads_mapped_by_every_peer(backend,
                                                                                 world):
    _require_cuda(backend, "empty", "rendezvous")
    for on_device, peer_values, pad_zero in run(backend, _pads_and_mappings, world):
        assert on_device == ("cuda", "cuda")
        assert peer_values == [float(r) for r in range(world)]
        assert pad_zero, "a new allocation's signal pad is zero"


def _stream_order(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous", "ops")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(1 << 16, dtype=torch.float32, device=device)
    t.zero_()
    sm.rendezvous(t, group)
    torch.cuda.synchronize()
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # GPU work queued before the fill
        t.fill_(rank + 1)
        total = sm.ops.one_shot_all_reduce(t, "sum", group)
        finished = side.query()
    return total.unique().tolist() == [float(world * (world + 1) // 2)], finished


@pytest.mark.spec("SM-22")
def test_cuda_ops_run_after_the_current_streams_work_and_finish_before_returning(backend):
    _require_cuda(backend, "empty", "rendezvous", "ops")
    for ordered, finished in run(backend, _stream_order, 2):
        assert ordered, "the op read its input before the work queued on the current stream"
        assert finished, "the op returned before its kernels finished"


def _timeout_then_work(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous", "SymmMemTimeout")
    t = sm.empty(8, dtype=torch.float32, device=device)
    h = sm.rendezvous(t, group)
    h.barrier(timeout_ms=30_000)
    peer = None
    if dist.get_rank() == 0:
        try:
            h.wait_signal(1, channel=2, timeout_ms=300)  # rank 1 never signals
        except sm.SymmMemTimeout as exc:
            peer = exc.peer
    h.barrier(timeout_ms=30_000)
    usable = torch.arange(4.0, device=device).sum().item() == 6.0
    return peer, usable


@pytest.mark.spec("SM-22", "SM-11")
def test_cuda_timeout_names_the_peer_and_leaves_the_context_usable(backend):
    _require_cuda(backend, "empty", "rendezvous", "SymmMemTimeout")
    assert run(backend, _timeout_then_work, 2) == [(1, True), (None, True)]


def _all_reduces(spec: str, numel: int):
    sm, group, device = _setup(spec, "empty", "ops")
    rank = dist.get_rank()
    results = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64):
        for op in REDUCE_OPS:
            if op == "avg" and not dtype.is_floating_point:
                continue
            # An odd number of elements in: no 16-byte alignment, the element-wise path.
            buf = sm.empty(2 * numel + 2, dtype=dtype, device=device)
            aligned, unaligned = buf[:numel], buf[numel + 2:]
            aligned.copy_(_input(rank, dtype, numel))
            unaligned.copy_(_input(rank, dtype, numel))
            one = sm.ops.one_shot_all_reduce(aligned, op, group).cpu()
            out = torch.empty_like(unaligned)
            sm.ops.one_shot_all_reduce_out(unaligned, op, group, out=out)
            sm.ops.two_shot_all_reduce_(aligned, op, group)
            results.append((str(dtype), op, one, out.cpu(), aligned.cpu()))
    return results


@pytest.mark.spec("SM-23", "SM-15", "SM-16")
@pytest.mark.parametrize("world", [2, 3])
def test_cuda_all_reduces_are_bitwise_the_rank_order_fold(backend, world):
    _require_cuda(backend, "empty", "ops")
    numel = 4099  # odd: no multiple of a 16-byte vector nor of the group size
    for rank, results in enumerate(run(backend, _all_reduces, world, numel)):
        for name, op, *got in results:
            dtype = getattr(torch, name.split(".")[1])
            want = _rank_order([_input(r, dtype, numel) for r in range(world)], op)
            for kind, tensor in zip(["one-shot", "one-shot out=", "two-shot"], got,
                                    strict=True):
                bits = BITS[want.element_size()]
                assert torch.equal(tensor.view(bits), want.view(bits)), (
                    f"{kind} {name} {op} on rank {rank}")
