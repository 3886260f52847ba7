"""Conformance cases of SPEC.md section 6, symmetric memory (SM).

Each case drives the backend's symmetric-memory concept with upstream's names
(`empty`, `empty_strided_p2p`, `rendezvous`, the handle's `get_buffer`, `put_signal`,
`wait_signal`, `barrier`, the ops `one_shot_all_reduce(_out)` and `two_shot_all_reduce_`)
on real ranks, and checks numbers: what peers see in each other's buffers, and
all-reduce results bitwise against the rank-order reference of SM-15 and across ranks.
Cases that need a refimpl extension (timeouts) require it by name, so a backend without
it reports them "not implemented".
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conformance.harness import backend_in_rank, run

CONCEPT = "symmetric_memory"


def _setup(spec: str, *attrs: str):
    sm = backend_in_rank(spec).require(CONCEPT, *attrs)
    group = dist.group.WORLD.group_name
    sm.enable_symm_mem_for_group(group)
    if hasattr(sm, "device_for_rank"):
        device = sm.device_for_rank(dist.get_rank())
    else:
        device = torch.device(sm.DEVICE)
    return sm, group, device


def _rank_input(rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 + rank)
    return (torch.randn(numel, generator=g) * 3).to(dtype)


def _reference_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """SM-15: rank order, 16-bit floats accumulated in float32 and rounded once."""
    wide = inputs[0].dtype in (torch.float16, torch.bfloat16)
    acc = inputs[0].float() if wide else inputs[0].clone()
    for x in inputs[1:]:
        acc = acc + (x.float() if wide else x)
    return acc.to(inputs[0].dtype)


# --------------------------------------------------------------------------------------
def _handle_and_buffers(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous", "enable_symm_mem_for_group")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(2, 16, dtype=torch.float32, device=device)
    t.fill_(rank)
    h = sm.rendezvous(t, group)
    same = sm.rendezvous(t, group) is h or sm.rendezvous(t, group) == h
    h.barrier()
    peers = [h.get_buffer(r, (2, 16), torch.float32).unique().tolist() for r in range(world)]
    h.barrier()
    h.get_buffer((rank + 1) % world, (16,), torch.float32, storage_offset=16).fill_(50 + rank)
    h.barrier()
    got = t[1].unique().tolist()
    facts = (h.rank, h.world_size, h.buffer_size >= 128, len(h.buffer_ptrs),
             len(h.signal_pad_ptrs), h.buffer_ptrs[rank] == t.data_ptr())
    return same, facts, peers, got


@pytest.mark.spec("SM-3", "SM-5", "SM-7", "SM-8", "SM-10")
@pytest.mark.parametrize("world", [2, 3])
def test_rendezvous_gives_one_handle_over_every_peers_buffer(backend, world):
    backend.require(CONCEPT, "empty", "rendezvous", "enable_symm_mem_for_group")
    results = run(backend, _handle_and_buffers, world)
    for rank, (same, facts, peers, got) in enumerate(results):
        assert same
        assert facts == (rank, world, True, world, world, True)
        assert peers == [[float(r)] for r in range(world)]
        assert got == [50.0 + (rank - 1) % world]


def _signals(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(world, dtype=torch.int32, device=device)
    t.zero_()
    h = sm.rendezvous(t, group)
    h.barrier()
    right, left = (rank + 1) % world, (rank - 1) % world
    h.get_buffer(right, (world,), torch.int32)[rank] = 40 + rank
    h.put_signal(right, channel=2)
    h.put_signal(right, channel=1)
    h.wait_signal(left, channel=1)  # consumed out of order: channels are independent
    h.wait_signal(left, channel=2)
    received = t[left].item()
    h.barrier()
    pad = h.get_signal_pad(rank, (h.signal_pad_size // 4,), torch.int32)
    return received, int(pad.count_nonzero().item())


@pytest.mark.spec("SM-9", "SM-10")
def test_signals_carry_writes_per_channel_and_leave_pads_zero(backend):
    backend.require(CONCEPT, "empty", "rendezvous")
    assert run(backend, _signals, 2) == [(41, 0), (40, 0)]


def _plain_tensor_is_refused(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous")
    try:
        sm.rendezvous(torch.ones(8, device=device), group)
    except (ValueError, RuntimeError, TypeError) as exc:
        return type(exc).__name__
    return None


@pytest.mark.spec("SM-5")
def test_rendezvous_refuses_a_plain_tensor_without_waiting_on_peers(backend):
    backend.require(CONCEPT, "empty", "rendezvous")
    # Only rank 0 would be stuck if the check came after communication: all ranks call.
    assert None not in run(backend, _plain_tensor_is_refused, 2)


def _persistent(spec: str, alloc_id: int):
    sm, group, device = _setup(spec, "empty_strided_p2p")
    first = sm.empty_strided_p2p((64,), (1,), torch.float32, device, group, alloc_id=alloc_id)
    address = first.data_ptr()
    first.fill_(3)
    try:
        sm.empty_strided_p2p((64,), (1,), torch.float32, device, group, alloc_id=alloc_id)
        refused_live = False
    except (RuntimeError, ValueError):
        refused_live = True
    del first
    again = sm.empty_strided_p2p((64,), (1,), torch.float32, device, group, alloc_id=alloc_id)
    return refused_live, again.data_ptr() == address


@pytest.mark.spec("SM-4")
def test_persistent_allocation_returns_the_same_memory_once_free(backend):
    backend.require(CONCEPT, "empty_strided_p2p")
    assert run(backend, _persistent, 2, 0x5EED) == [(True, True)] * 2


def _all_reduces(spec: str, dtype_name: str, numel: int):
    sm, group, device = _setup(spec, "empty", "ops")
    rank = dist.get_rank()
    dtype = getattr(torch, dtype_name)
    t = sm.empty(numel, dtype=dtype, device=device)
    t.copy_(_rank_input(rank, dtype, numel))
    one = sm.ops.one_shot_all_reduce(t, "sum", group).cpu()
    out = torch.empty_like(t)
    sm.ops.one_shot_all_reduce_out(t, "sum", group, out=out)
    unchanged = torch.equal(t.cpu(), _rank_input(rank, dtype, numel))
    sm.ops.two_shot_all_reduce_(t, "sum", group)
    return one, out.cpu(), t.cpu(), unchanged


@pytest.mark.spec("SM-14", "SM-15", "SM-16")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_one_shot_and_two_shot_sum_are_bitwise_the_rank_order_reference(backend, world,
                                                                          dtype_name):
    backend.require(CONCEPT, "empty", "ops")
    numel = 4099  # not a multiple of the group size, nor of any vector width
    results = run(backend, _all_reduces, world, dtype_name, numel)
    dtype = getattr(torch, dtype_name)
    want = _reference_sum([_rank_input(r, dtype, numel) for r in range(world)])
    for rank, (one, out, two, unchanged) in enumerate(results):
        assert torch.equal(one, want), f"one-shot on rank {rank}"
        assert torch.equal(out, want), f"one-shot out= on rank {rank}"
        assert torch.equal(two, want), f"two-shot on rank {rank}"
        assert unchanged, f"one-shot changed its input on rank {rank}"


def _late_peer(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous", "SymmMemTimeout")
    t = sm.empty(4, dtype=torch.float32, device=device)
    h = sm.rendezvous(t, group)
    h.barrier(timeout_ms=30_000)
    try:
        if dist.get_rank() == 0:
            h.wait_signal(1, channel=3, timeout_ms=300)  # rank 1 never signals
    except sm.SymmMemTimeout as exc:
        return exc.peer, str(exc)
    finally:
        h.barrier(timeout_ms=30_000)
    return None


@pytest.mark.spec("SM-11")
def test_a_wait_times_out_naming_the_peer(backend):
    backend.require(CONCEPT, "empty", "rendezvous", "SymmMemTimeout")
    results = run(backend, _late_peer, 2)
    peer, message = results[0]
    assert peer == 1 and "rank 1" in message
    assert results[1] is None
