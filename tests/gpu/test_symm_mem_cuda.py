"""CUDA symmetric memory on real processes: SM-21 .. SM-23, and SM-3 .. SM-20 on CUDA.

Skipped without CUDA. Ranks are processes of the gloo harness (`run_on_ranks`: gloo for the
group and its store, since NCCL refuses two processes on one GPU; CUDA IPC cannot open a
handle in the process that made it, so never threads); rank r uses cuda:(r mod device
count), so on a one-GPU machine every rank shares that GPU, which time-slices the processes'
contexts. Values are checked on every rank, all-reduce results bitwise against the CPU
kernels (kernels/cpu/symm_mem.c, SM-23: a NaN that sum or avg computed may be another NaN)
and, where no input is NaN, against torch.

`REFIMPL_GPU_TEST_DEVICE=cpu` runs the tests that do not need CUDA itself on the CPU
backend instead: a dry run of the test logic, which proves nothing about CUDA.

Run on an H100 by tests/gpu/run_on_device.sh, 2 and 4 processes on the one GPU (time-sliced):
every test passes (benchmarks/results/symm_mem_cuda.md says when).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import itertools
import json
import os
import random
import time

import pytest
import torch
import torch.distributed as dist
from symm_mem_helpers import reference_all_reduce
from torch.fx.experimental.proxy_tensor import make_fx

import refimpl.functional_collectives as fc
import refimpl.symmetric_memory as sm
from refimpl import _native
from refimpl.multiprocess import RankError, run_on_ranks

DEVICE_TYPE = os.environ.get("REFIMPL_GPU_TEST_DEVICE", "cuda")
CUDA = DEVICE_TYPE == "cuda"
pytestmark = pytest.mark.skipif(CUDA and not torch.cuda.is_available(),
                                reason="needs a CUDA device (SM-21..SM-23)")
needs_cuda = pytest.mark.skipif(not CUDA, reason="exercises the CUDA backend itself")
OPS = torch.ops.refimpl_symm_mem
CASES = [(dtype, op) for dtype in sm.SUPPORTED_DTYPES for op in sm.REDUCE_OPS
         if not (op == "avg" and not dtype.is_floating_point)]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _device(rank: int | None = None) -> torch.device:
    if not CUDA:
        return torch.device("cpu")
    rank = dist.get_rank() if rank is None else rank
    return torch.device("cuda", rank % torch.cuda.device_count())


def _world() -> str:
    name = dist.group.WORLD.group_name
    sm.enable_symm_mem_for_group(name)
    if CUDA:
        torch.cuda.set_device(_device())
    return name


def _cuda_library():
    from refimpl import _symm_mem_cuda

    return _symm_mem_cuda.library()


def _live() -> tuple[int, int]:
    """(segments, peer mappings) this process holds open; (0, 0) on the CPU dry run."""
    if not CUDA:
        return 0, 0
    lib = _cuda_library()
    return lib.rsmc_live_segments(), lib.rsmc_live_mappings()


def _error(fn, *args, **kwargs) -> tuple[str, str, int | None, float]:
    """(exception type, message, its `peer`, seconds taken); fails if `fn` returns."""
    start = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return type(exc).__name__, str(exc), getattr(exc, "peer", None), time.monotonic() - start
    raise AssertionError(f"{fn.__name__} did not raise")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN payloads and zero signs included), on the CPU."""
    return t.detach().cpu().contiguous().view(BITS[t.element_size()])


def _rank_data(rank: int, dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """Rank `rank`'s input: random values, every 7th one special (NaN, infinities, zeros of
    both signs, subnormals, the dtype's extremes), integers near their limits so sums wrap."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if not dtype.is_floating_point:
        data = torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)
        data[::5] = torch.iinfo(dtype).max - rank
        return data
    data = torch.randn(numel, generator=g) * 4
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40,
                             6e-8, -6e-8, 65504.0, 3e38, -3e38, 1.0 + 2 ** -9])
    for k, i in enumerate(range(rank % 7, numel, 7)):
        data[i] = specials[(k + rank) % len(specials)]
    return data.to(dtype)


def _cpu_kernel(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The CPU kernel's all-reduce of `inputs` (kernels/cpu/symm_mem.c, rsm_reduce)."""
    inputs = [x.contiguous() for x in inputs]
    out = torch.empty_like(inputs[0])
    sources = (ctypes.c_void_p * len(inputs))(*[x.data_ptr() for x in inputs])
    status = sm.c_kernels().rsm_reduce(ctypes.c_void_p(out.data_ptr()), sources, len(inputs),
                                ctypes.c_int64(out.numel()), sm.SUPPORTED_DTYPES[out.dtype],
                                sm.REDUCE_OPS[op])
    assert status == 0
    return out


def same_bits(got: torch.Tensor, want: torch.Tensor, op: str) -> bool:
    """Bitwise equal, except that a NaN that sum or avg computed may be another NaN (SM-23:
    a GPU's arithmetic returns the canonical NaN, the CPU's one of its inputs')."""
    got, want = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
    same = _bits(got) == _bits(want)
    if op in ("sum", "avg") and got.dtype.is_floating_point:
        same |= got.isnan() & want.isnan()
    return bool(same.all())


def _check_all_reduce(got: torch.Tensor, inputs: list[torch.Tensor], op: str, where: str):
    """Bitwise the CPU kernel's result (SM-23); where no input is NaN, torch's (SM-15)."""
    assert same_bits(got, _cpu_kernel(inputs, op), op), where + ": not the CPU bits"
    got = got.cpu()
    if got.dtype.is_floating_point:
        clean = ~torch.stack([x.isnan() for x in inputs]).any(0)
        want = reference_all_reduce(inputs, op)
        same = (got == want) | (got.isnan() & want.isnan())  # inf - inf is NaN in both
        assert same[clean].all(), where + ": not the rank-order reference"


# --------------------------------------------------------------------------------------
# The library and local allocations (SM-3, SM-4, SM-21, SM-23)
# --------------------------------------------------------------------------------------
@needs_cuda
def test_library_is_built_from_this_source_and_sees_the_gpu_SM_21_SM_23():
    from refimpl._symm_mem_cuda import CudaAllocator

    lib = _cuda_library()
    source = _native.CUDA_KERNEL_DIR / "symm_mem.cu"
    assert lib.rsmc_source_hash().decode() == _native.source_hash(source, _native.nvcc_flags())
    count = ctypes.c_int()
    assert lib.rsmc_device_count(ctypes.byref(count)) == 0
    assert count.value == torch.cuda.device_count() >= 1
    assert isinstance(sm.get_allocator("cuda"), CudaAllocator)
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(
            f"{sm.LIBRARY}::one_shot_all_reduce", key)


@needs_cuda
def test_allocations_are_device_memory_freed_with_their_last_tensor_SM_3_SM_21():
    segments, _ = _live()
    t = sm.empty(2, 3, dtype=torch.bfloat16, device="cuda")
    assert (t.shape, t.dtype, t.device.type, t.is_contiguous()) == (
        (2, 3), torch.bfloat16, "cuda", True)
    assert sm.is_symm_mem_tensor(t) and sm.is_symm_mem_tensor(t[1])
    assert _live()[0] == segments + 1
    s = sm.empty_strided_p2p((3, 2), (1, 3), torch.float32, "cuda", "g")
    assert s.stride() == (1, 3) and s.untyped_storage().nbytes() == 24
    s.copy_(torch.arange(6.0).view(3, 2))
    assert s.cpu().tolist() == [[0, 1], [2, 3], [4, 5]]
    zero = sm.empty(0, 5, dtype=torch.float32, device="cuda")
    assert zero.numel() == 0 and sm.is_symm_mem_tensor(zero)
    assert not sm.is_symm_mem_tensor(torch.empty(3, device="cuda"))
    view = t[1]
    del t, s, zero
    gc.collect()
    assert _live()[0] == segments + 1, "a view keeps its allocation's segment"
    del view
    gc.collect()
    assert _live()[0] == segments, "the segment is freed with its last tensor [SM-21]"


@needs_cuda
@pytest.mark.parametrize("default", ["cpu", "cuda"])
def test_allocations_and_peer_views_stay_device_memory_under_any_default_device_SM_21(default):
    """Under `with torch.device(...)` (the SM cases' ranks run under the CPU's; a program may
    set either) an allocation, and a handle's view of a rank's buffer, are the device memory
    itself, not a copy on the default device (the first `--device cuda` run refused every
    allocation under the CPU default)."""
    group = _group_of_one()
    with torch.device(default):
        t = sm.empty(4099, dtype=torch.float32, device="cuda")
        h = sm.rendezvous(t, group)
        view = h.get_buffer(0, (4099,), torch.float32)
        assert t.device.type == "cuda" and sm.is_symm_mem_tensor(t)
        assert (view.device, view.data_ptr()) == (t.device, t.data_ptr())
        t.copy_(torch.arange(4099.0, device="cuda"))
        assert torch.equal(OPS.one_shot_all_reduce(t, "sum", group).cpu(),
                           torch.arange(4099.0))


@needs_cuda
def test_persistent_allocation_reuses_device_memory_SM_4_SM_21():
    alloc_id = random.getrandbits(40)
    first = sm.empty_strided_p2p((16,), (1,), torch.float32, "cuda", "g", alloc_id=alloc_id)
    address = first.data_ptr()
    first.fill_(7)
    with pytest.raises(RuntimeError, match=rf"alloc_id {alloc_id} while the previous"):
        sm.empty_strided_p2p((16,), (1,), torch.float32, "cuda", "g", alloc_id=alloc_id)
    view = first[4:]
    del first
    with pytest.raises(RuntimeError, match=r"still alive \[SM-4\]"):
        sm.empty_strided_p2p((16,), (1,), torch.float32, "cuda", "g", alloc_id=alloc_id)
    del view
    again = sm.empty_strided_p2p((4, 4), (4, 1), torch.float32, "cuda", "g", alloc_id=alloc_id)
    assert again.data_ptr() == address
    assert again.flatten().cpu().tolist() == [7.0] * 16, "the same memory, contents kept"
    del again
    with pytest.raises(ValueError, match=rf"alloc_id {alloc_id} was allocated with 64 bytes"):
        sm.empty_strided_p2p((8,), (1,), torch.float32, "cuda", "g", alloc_id=alloc_id)
    with pytest.raises(ValueError, match=rf"alloc_id {alloc_id} belongs to group 'g'"):
        sm.empty_strided_p2p((16,), (1,), torch.float32, "cuda", "h", alloc_id=alloc_id)


def _group_of_one() -> str:
    name = f"solo-{random.getrandbits(32)}"
    sm.set_group_info(name, 0, 1, dist.HashStore())
    return name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_group_of_one_runs_every_kernel_in_this_process_SM_15_SM_16_SM_22(dtype):
    """The smallest end-to-end run: no peer, no IPC; each kernel and the status path."""
    group = _group_of_one()
    data = _rank_data(0, dtype, 4099, seed=5)
    t = sm.empty(4099, dtype=dtype, device=DEVICE_TYPE)
    t.copy_(data)
    h = sm.rendezvous(t, group)
    h.barrier(timeout_ms=5_000)
    h.put_signal(0, channel=1, timeout_ms=5_000)  # to itself
    h.wait_signal(0, channel=1, timeout_ms=5_000)
    kind, message, peer, seconds = _error(h.wait_signal, 0, channel=2, timeout_ms=200)
    assert (kind, peer) == ("SymmMemTimeout", 0) and "[SM-11]" in message
    assert 0.18 <= seconds < 5
    for op in ("sum", "max"):
        assert torch.equal(_bits(OPS.one_shot_all_reduce(t, op, group)), _bits(data))
    OPS.two_shot_all_reduce_(t, "min", group)
    assert torch.equal(_bits(t), _bits(data))
    assert h.get_signal_pad(0).view(torch.int32).count_nonzero().item() == 0


@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_calls_on_another_device_leave_torchs_current_device_alone_SM_21():
    group = _group_of_one()
    torch.cuda.set_device(0)
    t = sm.empty(64, dtype=torch.float32, device="cuda:1")
    t.fill_(3)
    total = OPS.one_shot_all_reduce(t, "sum", group)
    assert total.device == torch.device("cuda", 1) and total.unique().tolist() == [3.0]
    assert torch.cuda.current_device() == 0
    torch.cuda.set_device(1)
    u = sm.empty(64, dtype=torch.float32, device="cuda:0")
    u.fill_(4)
    assert OPS.one_shot_all_reduce(u, "sum", group).unique().tolist() == [4.0]
    assert torch.cuda.current_device() == 1
    torch.cuda.set_device(0)


# --------------------------------------------------------------------------------------
# Rendezvous, the handle, IPC mappings (SM-5 .. SM-8, SM-21)
# --------------------------------------------------------------------------------------
def _rendezvous_and_handle():
    group = _world()
    rank, world = dist.get_rank(), dist.get_world_size()
    segments, mappings = _live()
    t = sm.empty(4, 8, dtype=torch.float32, device=_device())
    t.fill_(rank)
    h = sm.rendezvous(t, group)
    same = sm.rendezvous(t, group) is h and sm.get_symmetric_memory(t[1:]) is h
    facts = (h.rank, h.world_size, h.buffer_size, h.signal_pad_size, len(set(h.buffer_ptrs)),
             len(h.signal_pad_ptrs), h.buffer_ptrs[rank] == t.data_ptr())
    mapped = _live()[1] - mappings
    pad_zero = h.get_signal_pad(rank).view(torch.int32).count_nonzero().item() == 0
    dist.barrier()  # no peer signals before every rank looked at its fresh pad
    h.barrier(timeout_ms=30_000)
    peers = [h.get_buffer(r, (4, 8), torch.float32).unique().tolist() for r in range(world)]
    h.barrier(timeout_ms=30_000)
    h.get_buffer((rank + 1) % world, (8,), torch.float32, storage_offset=8).fill_(100 + rank)
    h.barrier(timeout_ms=30_000)
    written = t[1].unique().tolist()
    # Channel 0's slots; a fast peer may already signal on channel 1.
    pads_zero = h.get_signal_pad(rank, (world,), torch.int32).count_nonzero().item() == 0
    h.barrier(channel=1, timeout_ms=30_000)  # nobody touches this rank's memory after this
    del t, h
    gc.collect()
    closed = _live() == (segments, mappings)
    return same, facts, mapped, pad_zero, peers, written, pads_zero, closed


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rendezvous_maps_every_peer_and_closes_the_mappings_with_the_handle_SM_5_SM_21(world):
    for rank, (same, facts, mapped, pad_zero, peers, written, pads_zero, closed) in enumerate(
            run_on_ranks(_rendezvous_and_handle, world)):
        assert same, "a repeated rendezvous and get_symmetric_memory give the same handle"
        assert facts == (rank, world, 128, sm.SIGNAL_PAD_SIZE, world, world, True)
        if CUDA:
            assert mapped == world - 1, "every peer's segment opened through CUDA IPC"
        assert pad_zero, "a new allocation's signal pad is zero [SM-21]"
        assert peers == [[float(r)] for r in range(world)]
        assert written == [100.0 + (rank - 1) % world]
        assert pads_zero, "completed synchronisations leave the pad zero [SM-9]"
        assert closed, "mappings closed and segment freed once tensor and handle are gone"


def _rendezvous_errors():
    group = _world()
    rank = dist.get_rank()
    # Rank 1 brings a bigger allocation: every rank refuses, naming both sizes.
    t = sm.empty(8 if rank == 1 else 4, dtype=torch.float32, device=_device())
    size_error = _error(sm.rendezvous, t, group, timeout_ms=30_000)
    plain = _error(sm.rendezvous, torch.ones(4, device=_device()), group)
    ok = sm.empty(4, dtype=torch.float32, device=_device())
    h = sm.rendezvous(ok, group, timeout_ms=30_000)
    bounds = _error(h.get_buffer, 0, (5,), torch.float32)
    wrong_out = None
    if CUDA:  # an `out` on the CPU would have the kernel write through a host pointer
        wrong_out = _error(OPS.one_shot_all_reduce_out, ok, "sum", group, out=torch.empty(4))[:2]
    h.barrier(timeout_ms=30_000)
    return size_error[:2], plain[:2], bounds[:2], wrong_out


def test_rendezvous_and_op_errors_name_the_argument_on_every_rank_SM_5_SM_8_SM_14():
    for rank, (size_error, plain, bounds, wrong_out) in enumerate(
            run_on_ranks(_rendezvous_errors, 2)):
        assert size_error[0] == "ValueError" and "[SM-5]" in size_error[1]
        assert f"rank {rank} has {32 if rank == 1 else 16} bytes" in size_error[1]
        assert plain[0] == "ValueError" and plain[1].startswith("tensor: ")
        assert bounds[0] == "ValueError" and "holds 16 bytes" in bounds[1]
        if CUDA:
            assert wrong_out[0] == "ValueError" and wrong_out[1].startswith("out: ")


# --------------------------------------------------------------------------------------
# Signals, barriers, timeouts (SM-9 .. SM-11, SM-22)
# --------------------------------------------------------------------------------------
def _signals():
    group = _world()
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(world, dtype=torch.int64, device=_device())
    t.zero_()
    h = sm.rendezvous(t, group)
    h.barrier(timeout_ms=30_000)
    right, left = (rank + 1) % world, (rank - 1) % world
    h.get_buffer(right, (world,), torch.int64)[rank] = 10 + rank  # then signal: visible
    h.put_signal(right, timeout_ms=30_000)
    h.wait_signal(left, timeout_ms=30_000)
    received = t[left].item()
    h.put_signal(right, channel=3, timeout_ms=30_000)  # consumed in the other order
    h.put_signal(right, channel=1, timeout_ms=30_000)
    h.wait_signal(left, channel=1, timeout_ms=30_000)
    h.wait_signal(left, channel=3, timeout_ms=30_000)
    h.barrier(channel=2, timeout_ms=30_000)
    pads_zero = h.get_signal_pad(rank, (4 * world,), torch.int32).count_nonzero().item() == 0
    h.barrier(channel=4, timeout_ms=30_000)
    no_signal = _error(h.wait_signal, left, channel=5, timeout_ms=300)
    h.put_signal(right, channel=6, timeout_ms=30_000)
    unconsumed = _error(h.put_signal, right, channel=6, timeout_ms=300)
    h.barrier(channel=7, timeout_ms=30_000)
    h.wait_signal(left, channel=6, timeout_ms=30_000)
    h.barrier(channel=7, timeout_ms=30_000)
    zero_again = h.get_signal_pad(rank).view(torch.int32).count_nonzero().item() == 0
    usable = torch.ones(4, device=_device()).sum().item() == 4.0  # no trapped context
    return received, pads_zero, no_signal, unconsumed, zero_again, usable


@pytest.mark.parametrize("world", [2, 3, 4])
def test_signals_carry_data_per_channel_and_time_out_naming_the_peer_SM_9_SM_11(world):
    for rank, (received, zero, no_signal, unconsumed, zero_again, usable) in enumerate(
            run_on_ranks(_signals, world)):
        left, right = (rank - 1) % world, (rank + 1) % world
        assert received == 10 + left, "a write before put_signal is seen after wait_signal"
        assert zero and zero_again
        kind, message, peer, seconds = no_signal
        assert (kind, peer) == ("SymmMemTimeout", left)
        assert f"wait_signal: rank {left} of group" in message and "[SM-11]" in message
        assert 0.27 <= seconds < 10, f"waited {seconds:.2f} s for a 300 ms timeout"
        kind, message, peer, seconds = unconsumed
        assert (kind, peer) == ("SymmMemTimeout", right) and "did not consume" in message
        assert 0.27 <= seconds < 10
        assert usable, "a timed-out kernel leaves the context usable [SM-22]"


def _barriers(rounds):
    group = _world()
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(1, dtype=torch.int64, device=_device())
    h = sm.rendezvous(t, group)
    seen = []
    for i in range(rounds):
        t.fill_(i * world + rank)
        h.barrier(timeout_ms=30_000)
        seen.append([h.get_buffer(r, (1,), torch.int64).item() for r in range(world)])
        h.barrier(timeout_ms=30_000)  # nobody overwrites before everyone has read
    return seen


@pytest.mark.parametrize("world", [2, 4])
def test_barrier_orders_writes_and_reads_of_all_ranks_SM_10(world):
    rounds = 30
    expected = [[i * world + r for r in range(world)] for i in range(rounds)]
    assert run_on_ranks(_barriers, world, rounds) == [expected] * world


def _missing_partner(timeout_ms: int):
    group = _world()
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(8, dtype=torch.float32, device=_device())
    h = sm.rendezvous(t, group)
    h.barrier(timeout_ms=30_000)
    late = world - 1  # enters the barrier on channel 3 only after the others gave up
    error = after = None
    if rank != late:
        error = _error(h.barrier, channel=3, timeout_ms=timeout_ms)
        after = _error(h.barrier, channel=4, timeout_ms=30_000)[:3]  # fail-stop (SM-19)
    dist.barrier()
    if rank == late:
        h.barrier(channel=3, timeout_ms=30_000)  # passes: every other rank did enter it
    dist.barrier()
    fresh = sm.empty(8, dtype=torch.float32, device=_device())  # the group goes on
    fresh.fill_(rank + 1)
    total = OPS.one_shot_all_reduce(fresh, "sum", group).unique().tolist()
    return error, after, total


@pytest.mark.parametrize("world", [2, 3])
def test_a_missing_barrier_partner_is_named_then_the_handle_fails_stop_SM_10_SM_11_SM_19(world):
    timeout_ms = 700
    results = run_on_ranks(_missing_partner, world, timeout_ms)
    for rank, (error, after, total) in enumerate(results):
        assert total == [world * (world + 1) / 2], "a new allocation of the group works"
        if rank == world - 1:
            assert error is None and after is None
            continue
        kind, message, peer, seconds = error
        assert (kind, peer) == ("SymmMemTimeout", world - 1), error
        assert f"barrier: rank {world - 1} of group" in message
        assert 0.9 * timeout_ms / 1000 <= seconds < timeout_ms / 1000 + 10
        kind, message, peer = after
        assert (kind, peer) == ("SymmMemTimeout", world - 1), after
        assert "unusable since an earlier timeout" in message and "[SM-11]" in message


def _mismatched_calls():
    group = _world()
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(64, dtype=torch.float32, device=_device())
    t.fill_(rank + 1)
    sm.rendezvous(t, group)
    one = _error(OPS.one_shot_all_reduce, t[:32] if rank == 1 else t, "sum", group)[:3]
    late = world - 1  # a two-shot one element further in on the last rank
    two = _error(OPS.two_shot_all_reduce_, t[8:] if rank == late else t[:56], "max", group)[:3]
    untouched = t.unique().tolist() == [rank + 1.0]
    total = OPS.one_shot_all_reduce(t, "sum", group).unique().tolist()
    return one, two, untouched, total


@pytest.mark.parametrize("world", [2, 3])
def test_differing_calls_fail_on_every_rank_naming_the_lowest_differing_rank_SM_20(world):
    late = world - 1
    for one, two, untouched, total in run_on_ranks(_mismatched_calls, world):
        kind, message, _ = one
        assert kind == "ValueError" and message.startswith("input: one_shot_all_reduce "), one
        assert ("rank 1 called one_shot of 32 elements of torch.float32 at byte offset 0 "
                "with 'sum', rank 0 called one_shot of 64 elements") in message, message
        kind, message, _ = two
        assert kind == "ValueError" and "[SM-20]" in message, two
        assert (f"rank {late} called two_shot of 56 elements of torch.float32 at byte offset "
                f"32 with 'max', rank 0 called two_shot of 56 elements of torch.float32 at "
                f"byte offset 0 with 'max'") in message, message
        assert untouched, "a refused call wrote nothing"
        assert total == [world * (world + 1) / 2], "the handle stays usable and in step"


def _report(directory: str, what: str, result) -> None:
    with open(os.path.join(directory, f"{dist.get_rank()}-{what}.json"), "w") as f:
        json.dump({"rank": dist.get_rank(), "what": what, "result": result}, f)


WAITS = {  # what a survivor calls once its peer is dead, and the name its error gives
    "barrier": ("barrier", lambda h, t, group, dead: h.barrier(channel=1, timeout_ms=500)),
    "wait_signal": ("wait_signal", lambda h, t, group, dead: h.wait_signal(
        dead, channel=2, timeout_ms=500)),
    "one_shot": ("one_shot_all_reduce", lambda h, t, group, dead: OPS.one_shot_all_reduce(
        t, "sum", group)),
}
DEAD_TIMEOUT_MS = 500  # the harness gives survivors 3 s once a rank died


def _die_then_wait(directory: str, dead: int, whats: list[str]):
    group = _world()
    t = sm.empty(16, dtype=torch.float32, device=_device())
    h = sm.rendezvous(t, group)
    h.barrier(timeout_ms=30_000)
    if dist.get_rank() == dead:
        os._exit(3)
    previous = sm.set_default_timeout(DEAD_TIMEOUT_MS)  # the ops take the module's timeout
    try:
        for what in whats:
            _report(directory, what, _error(WAITS[what][1], h, t, group, dead))
    finally:
        sm.set_default_timeout(previous)
    fresh = sm.empty(4, dtype=torch.float32, device=_device())
    fresh.fill_(2)
    _report(directory, "usable", fresh.sum().item() == 8.0)
    raise RuntimeError("survivor done")  # the group is broken: end the task as failed


@pytest.mark.parametrize("world, dead, whats", [
    (2, 1, ["barrier"]), (3, 1, ["barrier"]), (2, 1, ["wait_signal", "one_shot"]),
    (3, 2, ["one_shot"])])
def test_a_dead_peer_is_named_by_every_survivor_whose_context_stays_usable_SM_11_SM_22(
        tmp_path, world, dead, whats):
    with pytest.raises(RankError):
        run_on_ranks(_die_then_wait, world, str(tmp_path), dead, whats)
    reports = {}
    for path in tmp_path.glob("*.json"):
        report = json.loads(path.read_text())
        reports[report["rank"], report["what"]] = report["result"]
    survivors = [r for r in range(world) if r != dead]
    assert sorted(reports) == sorted((r, w) for r in survivors for w in [*whats, "usable"])
    for rank in survivors:
        assert reports[rank, "usable"] is True, "no trapped context after the timeouts"
        for what in whats:
            kind, message, peer, seconds = reports[rank, what]
            assert (kind, peer) == ("SymmMemTimeout", dead), reports[rank, what]
            assert f"{WAITS[what][0]}: rank {dead} of group" in message
            assert "[SM-11]" in message
            assert 0.9 * DEAD_TIMEOUT_MS / 1000 <= seconds < 2.5, seconds


# --------------------------------------------------------------------------------------
# All-reduce (SM-15, SM-16, SM-23) and streams (SM-22)
# --------------------------------------------------------------------------------------
def _all_reduces(numels, seed):
    group = _world()
    rank = dist.get_rank()
    results = []
    for (dtype, op), numel in itertools.product(CASES, numels):
        data = _rank_data(rank, dtype, numel, seed)
        # Two inputs in one allocation: the second starts an odd number of elements in, so
        # never on 16 bytes (the element-wise path); the first at 0 (vectors).
        skip = numel + 1 if numel % 2 == 0 else numel + 2
        buf = sm.empty(skip + numel, dtype=dtype, device=_device())
        first, second = buf[:numel], buf[skip:]
        first.copy_(data)
        second.copy_(data.flip(0))
        one = OPS.one_shot_all_reduce(first, op, group)
        out = torch.empty_like(second)
        assert OPS.one_shot_all_reduce_out(second, op.upper(), group, out=out) is out
        unchanged = torch.equal(_bits(second), _bits(data.flip(0)))
        OPS.two_shot_all_reduce_(first, op, group)
        results.append((str(dtype), op, numel, one.cpu(), out.cpu(), first.cpu(), unchanged))
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduces_are_bitwise_the_cpu_kernels_on_every_rank_SM_15_SM_16_SM_23(world):
    # 8 and 9: one vector of float32 and one over; 4099: no multiple of a vector or of
    # the group size; 65539: many blocks, a grid-stride loop, ragged two-shot chunks.
    numels = [0, 1, 8, 9, 4099, 65539] if world != 3 else [1, 7, 4099]
    seed = random.getrandbits(16)
    per_rank = run_on_ranks(_all_reduces, world, numels, seed, timeout=600)
    for case in range(len(per_rank[0])):
        name, op, numel = per_rank[0][case][:3]
        dtype = getattr(torch, name.split(".")[1])
        inputs = [_rank_data(r, dtype, numel, seed) for r in range(world)]
        flipped = [x.flip(0) for x in inputs]
        for rank in range(world):
            _, _, _, one, out, two, unchanged = per_rank[rank][case]
            where = f"{name} {op} numel={numel} world={world} rank {rank}"
            _check_all_reduce(one, inputs, op, where + " one-shot")
            _check_all_reduce(out, flipped, op, where + " one-shot out= (unaligned)")
            _check_all_reduce(two, inputs, op, where + " two-shot")
            assert unchanged, where + ": one-shot changed its input"


def _soak(iterations: int, seed: int):
    """Back-to-back ops on one buffer with fresh data each time: a missing barrier shows
    as a wrong result somewhere (each rank checks itself against the CPU kernel)."""
    group = _world()
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = random.Random(seed)
    buf = sm.empty(1 << 18, dtype=torch.float32, device=_device())
    wrong = []
    for i in range(iterations):
        numel, op = rng.choice([1, 33, 4096, 1 << 18]), rng.choice(["sum", "max"])
        inputs = [_rank_data(r, torch.float32, numel, seed + i) for r in range(world)]
        x = buf[:numel]
        x.copy_(inputs[rank])
        if i % 2:
            got = OPS.one_shot_all_reduce(x, op, group)
        else:
            got = OPS.two_shot_all_reduce_(x, op, group)
        if not same_bits(got, _cpu_kernel(inputs, op), op):
            wrong.append((i, numel, op))
    return wrong


@pytest.mark.parametrize("world", [2, 4])
def test_back_to_back_all_reduces_never_race_SM_15_SM_16(world):
    assert run_on_ranks(_soak, world, 60, random.getrandbits(16), timeout=600) == [[]] * world


def _ordered_on_the_current_stream():
    group = _world()
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(1 << 16, dtype=torch.float32, device=_device())
    t.zero_()
    sm.rendezvous(t, group)
    torch.cuda.synchronize()
    side = torch.cuda.Stream(_device())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # tens of ms of GPU work queued before the fill
        t.fill_(rank + 1)
        total = OPS.one_shot_all_reduce(t, "sum", group)
        finished = side.query()  # the op returned: everything before it on `side` is done
    expected = float(world * (world + 1) // 2)
    return total.unique().tolist() == [expected], finished


@needs_cuda
def test_ops_run_after_the_work_queued_on_the_current_stream_SM_22():
    assert run_on_ranks(_ordered_on_the_current_stream, 2) == [(True, True)] * 2


def _capture_is_refused():
    group = _world()
    rank = dist.get_rank()
    t = sm.empty(64, dtype=torch.float32, device=_device())
    t.fill_(rank + 1)
    sm.rendezvous(t, group)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(_device())
    message = None
    try:
        with torch.cuda.graph(graph, stream=stream):
            OPS.one_shot_all_reduce(t, "sum", group)
    except RuntimeError as exc:
        message = str(exc)
    after = OPS.one_shot_all_reduce(t, "sum", group).unique().tolist()
    return message, after


@needs_cuda
def test_stream_capture_is_refused_before_any_kernel_runs_SM_22():
    for message, after in run_on_ranks(_capture_is_refused, 2):
        assert message is not None and "CUDA graph" in message and "[SM-22]" in message
        assert after == [3.0], "the group is in step after the refusal"


def _two_subgroups():
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    sm.enable_symm_mem_for_group(mine)
    if CUDA:
        torch.cuda.set_device(_device())
    t = sm.empty(16, dtype=torch.float32, device=_device())
    t.fill_(rank)
    return OPS.one_shot_all_reduce(t, "sum", mine.group_name).unique().tolist()


def test_groups_side_by_side_on_one_gpu_do_not_collide_SM_21():
    assert run_on_ranks(_two_subgroups, 4) == [[1.0], [1.0], [5.0], [5.0]]


# --------------------------------------------------------------------------------------
# Comm lowering's one-shot selection on CUDA tensors (CL-10, CL-14)
# --------------------------------------------------------------------------------------
ONE_SHOT_PROGRAMS = ["ar_intermediate", "ar_intermediate_shared", "ar_inplace",
                     "ar_small_intermediate", "ar_inplace_small"]


def _lowered_on_device():
    from lowering_rank import _plain

    from conformance.lowering_programs import PROGRAMS, inputs_for
    from refimpl.comm_lowering import CommLoweringConfig, lower

    _world()
    rank = dist.get_rank()
    out = {}
    for name in ONE_SHOT_PROGRAMS:
        program = functools.partial(PROGRAMS[name], fc)
        host_inputs = inputs_for(rank, [(4, 5)], salt=len(name))
        inputs = [x.to(_device()) for x in host_inputs]
        gm = make_fx(program, tracing_mode="fake")(*inputs)
        lowered = lower(gm, CommLoweringConfig(auto_select=True))
        one_shots = sum(1 for n in lowered.graph.nodes if "one_shot" in str(n.target))
        got = _plain(lowered(*[x.clone() for x in inputs]))
        want = _plain(program(*[x.clone() for x in host_inputs]))  # eager, on the CPU
        out[name] = (one_shots, want, got.cpu(), got.device.type)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_comm_lowering_goes_one_shot_on_device_tensors_CL_10(world):
    for results in run_on_ranks(_lowered_on_device, world):
        for name, (one_shots, want, got, device_type) in results.items():
            assert one_shots == 1, name
            assert device_type == DEVICE_TYPE, name
            assert torch.equal(got, want), name  # small integers: exact in any order
