"""Symmetric memory on real processes: allocation, rendezvous, handles, signals, ops.

Every multi-rank test runs over the gloo harness; a rank checks what it can see and
returns values that the test compares across ranks. Error cases catch the error on the
rank and return its message, so that no worker group is torn down. After every test no
segment of this session may remain in /dev/shm (SM-12).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import random

import pytest
import torch
import torch.distributed as dist
from symm_mem_helpers import no_segment_left_behind, rank_data, reference_all_reduce  # noqa: F401
from torch.fx.experimental.proxy_tensor import make_fx

import refimpl.symmetric_memory as sm
from refimpl import _native
from refimpl.multiprocess import run_on_ranks


def _world() -> str:
    name = dist.group.WORLD.group_name
    sm.enable_symm_mem_for_group(name)
    return name


def _error(fn, *args, **kwargs) -> tuple[str, str]:
    """Run `fn` on this rank and return (exception type, message); fail if it passes."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    raise AssertionError(f"{fn.__name__} did not raise")


# --------------------------------------------------------------------------------------
# Local rules: registry, group info, allocation, persistent ids (SM-1 .. SM-4, SM-18)
# --------------------------------------------------------------------------------------
def test_allocator_registry_per_device_type_SM_1():
    assert isinstance(sm.get_allocator("cpu"), sm.CpuAllocator)
    assert sm.get_allocator(torch.device("cpu")) is sm.get_allocator("cpu")
    with pytest.raises(ValueError, match=r"device type 'meta'.*\[SM-1\]"):
        sm.empty(4, dtype=torch.float32, device="meta")
    if torch.cuda.is_available():  # the CUDA backend registered itself (SM-21)
        from refimpl._symm_mem_cuda import CudaAllocator

        assert isinstance(sm.get_allocator("cuda"), CudaAllocator)
    else:
        with pytest.raises(ValueError, match=r"got device type 'cuda', which has none"):
            sm.get_allocator("cuda")
    marker = object()
    sm.register_allocator("privateuseone", marker)
    try:
        assert sm.get_allocator("privateuseone") is marker
    finally:
        sm._allocators.pop("privateuseone")


def test_ops_are_registered_for_cpu_and_cuda_SM_1_SM_13():
    for name in sm.SCHEMAS:
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{sm.LIBRARY}::{name}", key)


# The registry's use by the functions and ops (SM-1): the conformance case
# test_functions_and_ops_use_the_allocator_registered_now.


def test_a_repeated_persistent_request_is_checked_again_when_its_size_changed_SM_3():
    size = [4]  # mutable: the same object may hold another size next time
    sm.empty_strided_p2p(size, (1,), torch.float32, "cpu", "test-granted", 0x5151)
    size[0] = -1
    with pytest.raises(ValueError, match=r"^size: .*\[SM-3\]"):
        sm.empty_strided_p2p(size, (1,), torch.float32, "cpu", "test-granted", 0x5151)


def test_a_repeated_persistent_request_keeps_its_layout_after_another_grant_SM_4():
    """A layout granted by the allocator directly, between two repeats of a request: the
    repeat still gets its own layout, and a live tensor of it is still refused."""
    request = ((4,), (1,), torch.float32, "cpu", "test-granted", 0x5153)
    sm.empty_strided_p2p(*request)
    sm.get_allocator("cpu").empty_strided_p2p((4,), (1,), torch.int32, torch.device("cpu"),
                                              "test-granted", 0x5153)
    for _ in range(2):  # the first repeat lays it out again, the second looks it up
        again = sm.empty_strided_p2p(*request)
        assert again.dtype == torch.float32 and again.shape == (4,)
        with pytest.raises(RuntimeError, match=r"still alive \[SM-4\]"):
            sm.empty_strided_p2p(*request)
        del again


def test_a_persistent_allocation_first_asked_for_in_inference_mode_serves_autograd_SM_4():
    request = ((4,), (1,), torch.float32, "cpu", "test-granted", 0x5152)
    with torch.inference_mode():
        sm.empty_strided_p2p(*request).fill_(2)
    again, weight = sm.empty_strided_p2p(*request), torch.ones(4, requires_grad=True)
    (again * weight).sum().backward()  # an inference tensor cannot be saved for backward
    assert weight.grad.tolist() == [2.0] * 4


def test_default_timeout_is_positive_and_settable_SM_11():
    with pytest.raises(ValueError, match=r"^timeout_ms: .*\[SM-11\]"):
        sm.set_default_timeout(0)
    previous = sm.set_default_timeout(1234)
    try:
        assert sm._timeout_ms(0) == 1234 and sm._timeout_ms(5) == 5
    finally:
        assert sm.set_default_timeout(previous) == 1234


def test_group_info_is_set_once_and_checked_SM_2():
    store = dist.HashStore()
    name = f"local-{random.getrandbits(32)}"
    assert not sm.is_symm_mem_enabled_for_group(name)
    sm.set_group_info(name, 1, 3, store)
    assert sm.is_symm_mem_enabled_for_group(name)
    with pytest.raises(ValueError, match=r"already set \[SM-2\]"):
        sm.set_group_info(name, 1, 3, store)
    with pytest.raises(ValueError, match=r"^rank: .*\[SM-2\]"):
        sm.set_group_info(name + "x", 3, 3, store)
    with pytest.raises(ValueError, match=r"^world_size: "):
        sm.set_group_info(name + "x", 0, 0, store)
    with pytest.raises(TypeError, match=r"^store: "):
        sm.set_group_info(name + "x", 0, 1, "not a store")
    with pytest.raises(TypeError, match=r"^group: "):
        sm.is_symm_mem_enabled_for_group(3)
    with pytest.raises(ValueError, match=r"no process group is registered as 'nope'"):
        sm.enable_symm_mem_for_group("nope")


def test_allocation_gives_a_symmetric_tensor_SM_3():
    t = sm.empty(2, 3, dtype=torch.bfloat16, device="cpu")
    assert (t.shape, t.dtype, t.device.type, t.is_contiguous()) == ((2, 3), torch.bfloat16,
                                                                   True and "cpu", True)
    assert sm.is_symm_mem_tensor(t) and sm.is_symm_mem_tensor(t[1])
    assert sm.empty([4], dtype=torch.int64).shape == (4,)
    s = sm.empty_strided_p2p((3, 2), (1, 3), torch.float32, "cpu", "g")
    assert s.stride() == (1, 3) and s.untyped_storage().nbytes() == 24
    s.copy_(torch.arange(6.0).view(3, 2))
    assert s.tolist() == [[0, 1], [2, 3], [4, 5]]
    zero = sm.empty(0, 5, dtype=torch.float32)
    assert zero.numel() == 0 and sm.is_symm_mem_tensor(zero)
    assert not sm.is_symm_mem_tensor(torch.empty(3))
    with pytest.raises(ValueError, match=r"^stride: .*\[SM-3\]"):
        sm.empty_strided_p2p((3, 2), (1,), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"^size: "):
        sm.empty_strided_p2p((-1,), (1,), torch.float32, "cpu")
    with pytest.raises(TypeError, match=r"^dtype: "):
        sm.empty_strided_p2p((1,), (1,), "float", "cpu")
    with pytest.raises(TypeError, match=r"^group_name: "):
        sm.empty_strided_p2p((1,), (1,), torch.float32, "cpu", 5)
    with pytest.raises(TypeError, match=r"^alloc_id: .*\[SM-4\]"):
        sm.empty_strided_p2p((1,), (1,), torch.float32, "cpu", "g", alloc_id="7")


def test_not_a_symmetric_allocation_fails_before_communicating_SM_5_SM_6():
    with pytest.raises(ValueError,
                       match=r"^tensor: expected .*symmetric alloc.*rendezvous needs"):
        sm.rendezvous(torch.ones(4), "0")  # would hang if it waited on peers
    with pytest.raises(TypeError, match=r"^tensor: "):
        sm.rendezvous([1, 2], "0")
    t = sm.empty(4, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"rendezvous first \[SM-6\]"):
        sm.get_symmetric_memory(t)
    with pytest.raises(ValueError, match=r"^group: expected a group .*got None \[SM-5\]"):
        sm.rendezvous(t)
    g = sm.empty_strided_p2p((4,), (1,), torch.float32, "cpu", "group-a")
    with pytest.raises(ValueError, match=r"allocated for group 'group-a', not 'group-b'"):
        sm.rendezvous(g, "group-b")


def test_persistent_allocation_reuses_memory_and_refuses_misuse_SM_4():
    alloc_id = random.getrandbits(40)
    first = sm.empty_strided_p2p((16,), (1,), torch.float32, "cpu", "g", alloc_id=alloc_id)
    address = first.data_ptr()
    first.fill_(7)
    with pytest.raises(RuntimeError, match=rf"alloc_id {alloc_id} while the previous"):
        sm.empty_strided_p2p((16,), (1,), torch.float32, "cpu", "g", alloc_id=alloc_id)
    view = first[4:]
    del first
    with pytest.raises(RuntimeError, match=r"still alive \[SM-4\]"):  # a view keeps it alive
        sm.empty_strided_p2p((16,), (1,), torch.float32, "cpu", "g", alloc_id=alloc_id)
    del view
    again = sm.empty_strided_p2p((4, 4), (4, 1), torch.float32, "cpu", "g", alloc_id=alloc_id)
    assert again.data_ptr() == address
    assert again.flatten().tolist() == [7.0] * 16, "the same memory"
    del again
    with pytest.raises(ValueError, match=rf"alloc_id {alloc_id} was allocated with 64 bytes"):
        sm.empty_strided_p2p((8,), (1,), torch.float32, "cpu", "g", alloc_id=alloc_id)
    with pytest.raises(ValueError, match=rf"alloc_id {alloc_id} belongs to group 'g'"):
        sm.empty_strided_p2p((16,), (1,), torch.float32, "cpu", "h", alloc_id=alloc_id)
    other = sm.empty_strided_p2p((8,), (1,), torch.float32, "cpu", "g", alloc_id=alloc_id + 1)
    assert other.data_ptr() != address


def test_kernels_build_from_source_and_carry_its_hash_SM_18(tmp_path):
    source = _native.KERNEL_DIR / "symm_mem.c"
    target = _native.compile_library(source, tmp_path / "libsymm_mem-test.so")
    lib = ctypes.CDLL(str(target))
    lib.rsm_source_hash.restype = ctypes.c_char_p
    assert lib.rsm_source_hash().decode() == _native.source_hash(source)
    assert [p.name for p in tmp_path.iterdir()] == ["libsymm_mem-test.so"], "no temp file left"
    loaded = _native.load_kernel_library("symm_mem")
    loaded.rsm_source_hash.restype = ctypes.c_char_p
    assert loaded.rsm_source_hash().decode() == _native.source_hash(source), "not stale"


@pytest.mark.parametrize("nsrc", [2, 3])  # two sources take a pass of their own
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_kernels_round_like_torch_for_every_bit_pattern_SM_15(dtype, nsrc):
    """The C conversions (float32 <-> 16-bit, round to nearest even) against torch's."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    for value in [1.0, -3.5, 6e-8, 60000.0, 0.1, float("inf"), float("nan")]:
        other = torch.full_like(every, value)
        zero = torch.zeros_like(every)  # the third source adds nothing, as +0.0
        for op, reference in [("sum", torch.add), ("avg", lambda x, y: (x + y) / nsrc),
                              ("max", torch.maximum), ("min", torch.minimum)]:
            out = torch.empty_like(every)
            inputs = [every, other, zero][:nsrc]
            if nsrc == 3 and op in ("max", "min"):
                inputs[2] = other  # a repeat changes nothing: max(x, y, y) = max(x, y)
            sources = (ctypes.c_void_p * nsrc)(*(t.data_ptr() for t in inputs))
            assert sm.c_kernels().rsm_reduce(ctypes.c_void_p(out.data_ptr()), sources, nsrc,
                                      ctypes.c_int64(every.numel()),
                                      sm.SUPPORTED_DTYPES[dtype], sm.REDUCE_OPS[op]) == 0
            want = reference(every.float(), other.float()).to(dtype)
            same = ((out.view(torch.int16) == want.view(torch.int16))
                    | (out.isnan() & want.isnan()) | ((out == 0) & (want == 0)))
            assert same.all(), (dtype, value, op, every[~same][:5], out[~same][:5])


# --------------------------------------------------------------------------------------
# Rendezvous and the handle (SM-5 .. SM-8, SM-12)
# --------------------------------------------------------------------------------------
def _rendezvous_and_handle(alloc_id):
    group = _world()
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(4, 8, dtype=torch.float32, device="cpu")
    t.fill_(rank)
    h = sm.rendezvous(t, dist.group.WORLD)
    same = sm.rendezvous(t, group) is h and sm.get_symmetric_memory(t[1:]) is h
    facts = (h.rank, h.world_size, h.buffer_size, h.signal_pad_size, len(h.buffer_ptrs),
             len(h.signal_pad_ptrs), h.buffer_ptrs[rank] == t.data_ptr())
    peers = [h.get_buffer(r, (4, 8), torch.float32).unique().tolist() for r in range(world)]
    h.barrier(timeout_ms=20_000)
    # Write into the next rank's buffer; after a barrier each rank sees its left neighbour's.
    h.get_buffer((rank + 1) % world, (8,), torch.float32, storage_offset=8).fill_(100 + rank)
    h.barrier(timeout_ms=20_000)
    written = t[1].unique().tolist()
    pads_zero = h.get_signal_pad(rank).view(torch.int32).count_nonzero().item() == 0
    # A persistent allocation keeps its handle for its next holder, without communicating.
    p = sm.empty_strided_p2p((8,), (1,), torch.int64, "cpu", group, alloc_id=alloc_id)
    hp = sm.rendezvous(p, group)
    p_address = p.data_ptr()
    del p
    p2 = sm.empty_strided_p2p((8,), (1,), torch.int64, "cpu", group, alloc_id=alloc_id)
    kept = sm.rendezvous(p2, group) is hp and p2.data_ptr() == p_address
    own_segments = [n for n in sm.leaked_segments() if n.split("-")[2] == str(os.getpid())]
    # The names went through the group's store; each rank unlinked its own before its
    # rendezvous returned, so after a barrier none is left (SM-12).
    h.barrier(timeout_ms=20_000)
    info = sm._groups[group]
    records = [json.loads(info.store.get(f"rdzv{info.rendezvous_count}/segment{r}"))
               for r in range(world)]
    published = [(r["name"], r["pid"], os.path.exists(os.path.join(sm.SHM_DIR, r["name"])))
                 for r in records]
    return same, facts, peers, written, pads_zero, kept, own_segments, published, os.getpid()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rendezvous_maps_every_peer_and_returns_one_handle_SM_5_SM_6_SM_7_SM_8(world):
    results = run_on_ranks(_rendezvous_and_handle, world, random.getrandbits(40))
    pids = [r[-1] for r in results]
    for rank, (same, facts, peers, written, pads_zero, kept, own, published, _) in enumerate(
            results):
        names = [name for name, _, _ in published]
        assert len(set(names)) == world and all(n.startswith(sm.SEGMENT_PREFIX) for n in names)
        assert [pid for _, pid, _ in published] == pids, "each rank published its own segment"
        assert [f"{sm.SEGMENT_PREFIX}{pid}-" for pid in pids] == [n[:n.rindex("-") + 1]
                                                                  for n in names]
        assert not any(exists for _, _, exists in published), "unlinked once all mapped"
        assert same, "a repeated rendezvous and get_symmetric_memory give the same handle"
        assert facts == (rank, world, 128, sm.SIGNAL_PAD_SIZE, world, world, True)
        assert peers == [[float(r)] for r in range(world)]
        assert written == [100.0 + (rank - 1) % world]
        assert pads_zero, "signal pads are zero after completed synchronisations [SM-9]"
        assert kept
        assert own == [], "a rank's segment is unlinked once every peer mapped it [SM-12]"


def _rendezvous_errors():
    group = _world()
    rank = dist.get_rank()
    # Rank 1 brings a bigger allocation: every rank refuses, naming the ranks' sizes.
    t = sm.empty(8 if rank == 1 else 4, dtype=torch.float32)
    size_error = _error(sm.rendezvous, t, group, timeout_ms=20_000)
    ok = sm.empty(4, dtype=torch.float32)
    h = sm.rendezvous(ok, group)
    errors = [
        _error(h.get_buffer, 5, (1,), torch.float32),
        _error(h.get_buffer, 0, (5,), torch.float32),
        _error(h.get_buffer, 0, (2,), torch.float32, storage_offset=3),
        _error(h.get_buffer, 0, (-1,), torch.float32),
        _error(h.get_buffer, 0, (1,), torch.float32, storage_offset=-1),
        _error(h.get_signal_pad, 0, (sm.SIGNAL_PAD_SIZE // 4 + 1,)),
        _error(h.put_signal, 7),
        _error(h.wait_signal, 0, channel=h.channels),
        _error(h.barrier, channel=-1),
        _error(h.barrier, timeout_ms=-5),
        _error(sm.rendezvous, ok, "another-group"),
    ]
    h.barrier(timeout_ms=20_000)
    fits = h.get_buffer(0, (2,), torch.float32, storage_offset=2).shape
    pad = h.get_signal_pad(0)
    return size_error, errors, tuple(fits), (pad.dtype, pad.numel()), sm.leaked_segments()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rendezvous_and_handle_errors_name_argument_and_rule_SM_5_SM_8(world):
    results = run_on_ranks(_rendezvous_errors, world)
    for rank, (size_error, errors, fits, pad, _) in enumerate(results):
        kind, message = size_error
        assert kind == "ValueError" and "[SM-5]" in message
        other = 0 if rank == 1 else 1
        assert f"rank {rank} has {32 if rank == 1 else 16} bytes" in message
        assert f"rank {other} has" in message
        starts = [m.split(":")[0] for _, m in errors]
        assert starts == ["rank", "sizes/storage_offset", "sizes/storage_offset", "sizes",
                          "storage_offset", "sizes/storage_offset", "dst_rank", "channel",
                          "channel", "timeout_ms", "group"]
        assert all(k == "ValueError" for k, _ in errors)
        assert "[SM-8]" in errors[1][1] and "holds 16 bytes" in errors[1][1]
        assert fits == (2,)
        assert pad == (torch.uint32, sm.SIGNAL_PAD_SIZE // 4)


# --------------------------------------------------------------------------------------
# Signals, barriers and timeouts (SM-9 .. SM-11)
# --------------------------------------------------------------------------------------
def _signals():
    group = _world()
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(world, dtype=torch.int64)
    t.zero_()
    h = sm.rendezvous(t, group)
    right, left = (rank + 1) % world, (rank - 1) % world
    # Data written before put_signal is visible after wait_signal.
    h.get_buffer(right, (world,), torch.int64)[rank] = 10 + rank
    h.put_signal(right, timeout_ms=20_000)
    h.wait_signal(left, timeout_ms=20_000)
    received = t[left].item()
    # Channels are independent: signals on 3 and 1 are consumed in the other order.
    h.put_signal(right, channel=3, timeout_ms=20_000)
    h.put_signal(right, channel=1, timeout_ms=20_000)
    h.wait_signal(left, channel=1, timeout_ms=20_000)
    h.wait_signal(left, channel=3, timeout_ms=20_000)
    h.barrier(channel=2, timeout_ms=20_000)
    # Channels 0..3 are done; a fast peer may already signal on later ones (channel 4).
    used = h.get_signal_pad(rank, (4 * world,), torch.int32)
    pads_zero = used.count_nonzero().item() == 0
    h.barrier(channel=4, timeout_ms=20_000)
    # Nobody signals: the wait ends at its timeout, naming the rank it waited for.
    no_signal = _error(h.wait_signal, left, channel=5, timeout_ms=200)
    # The right neighbour never consumes: a second put on the same channel times out.
    h.put_signal(right, channel=6, timeout_ms=20_000)
    unconsumed = _error(h.put_signal, right, channel=6, timeout_ms=200)
    h.barrier(channel=7, timeout_ms=20_000)
    h.wait_signal(left, channel=6, timeout_ms=20_000)
    h.barrier(channel=7, timeout_ms=20_000)
    pads_zero_again = h.get_signal_pad(rank).view(torch.int32).count_nonzero().item() == 0
    return received, pads_zero, no_signal, unconsumed, pads_zero_again


@pytest.mark.parametrize("world", [2, 3, 4])
def test_signals_carry_data_per_channel_and_time_out_naming_the_peer_SM_9_SM_11(world):
    for rank, (received, zero, no_signal, unconsumed, zero_again) in enumerate(
            run_on_ranks(_signals, world)):
        left, right = (rank - 1) % world, (rank + 1) % world
        assert received == 10 + left
        assert zero and zero_again, "every completed synchronisation leaves the pad zero"
        assert no_signal[0] == "SymmMemTimeout"
        assert f"wait_signal: rank {left} of group" in no_signal[1]
        assert "within 200 ms" in no_signal[1] and "[SM-11]" in no_signal[1]
        assert unconsumed[0] == "SymmMemTimeout"
        assert f"put_signal: rank {right} of group" in unconsumed[1]
        assert "did not consume" in unconsumed[1]


def _barriers(rounds):
    group = _world()
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(1, dtype=torch.int64)
    h = sm.rendezvous(t, group)
    seen = []
    for i in range(rounds):
        t.fill_(i * world + rank)
        h.barrier(timeout_ms=20_000)
        seen.append([h.get_buffer(r, (1,), torch.int64).item() for r in range(world)])
        h.barrier(timeout_ms=20_000)  # nobody overwrites before everyone has read
    return seen


@pytest.mark.parametrize("world", [2, 3, 4])
def test_barrier_orders_writes_and_reads_of_all_ranks_SM_10(world):
    rounds = 50
    expected = [[i * world + r for r in range(world)] for i in range(rounds)]
    assert run_on_ranks(_barriers, world, rounds) == [expected] * world


# --------------------------------------------------------------------------------------
# Ops (SM-13 .. SM-17)
# --------------------------------------------------------------------------------------
CASES = [(dtype, op) for dtype in sm.SUPPORTED_DTYPES for op in sm.REDUCE_OPS
         if not (op == "avg" and not dtype.is_floating_point)]


def _all_reduce_cases(numels, seed):
    group = _world()
    rank = dist.get_rank()
    results = []
    for (dtype, op), numel in itertools.product(CASES, numels):
        data = rank_data(rank, dtype, numel, seed)
        # One allocation holds two inputs: the second starts at an offset (views work).
        buf = sm.empty(2 * numel + 3, dtype=dtype)
        first, second = buf[:numel], buf[numel + 3:]
        first.copy_(data)
        second.copy_(data.flip(0))
        one = torch.ops.refimpl_symm_mem.one_shot_all_reduce(first, op, group)
        out = torch.empty_like(second)
        returned = torch.ops.refimpl_symm_mem.one_shot_all_reduce_out(second, op.upper(), group,
                                                                       out=out)
        assert returned is out
        torch.ops.refimpl_symm_mem.two_shot_all_reduce_(first, op, group)
        unchanged = torch.equal(second, data.flip(0))
        results.append((str(dtype), op, numel, one, out, first.clone(), unchanged))
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_shot_and_two_shot_all_reduce_are_exact_and_identical_on_all_ranks_SM_15_SM_16(
        world):
    numels = [0, 1, 5, 1000] if world == 2 else [1, 5, 1000] if world == 4 else [2, 1001]
    seed = random.getrandbits(16)
    per_rank = run_on_ranks(_all_reduce_cases, world, numels, seed)
    for case in range(len(per_rank[0])):
        name, op, numel = per_rank[0][case][:3]
        dtype = getattr(torch, name.split(".")[1])
        inputs = [rank_data(r, dtype, numel, seed) for r in range(world)]
        want = reference_all_reduce(inputs, op)
        want_flipped = reference_all_reduce([x.flip(0) for x in inputs], op)
        for rank in range(world):
            _, _, _, one, out, two, unchanged = per_rank[rank][case]
            where = f"{name} {op} numel={numel} rank {rank}"
            assert torch.equal(one, want), where  # bitwise: same order on every rank
            assert torch.equal(out, want_flipped), where
            assert torch.equal(two, want), where + " (two-shot, in place)"
            assert unchanged, where + ": one-shot must not modify its input"


def _op_errors():
    group = _world()
    f = sm.empty(6, dtype=torch.float32)
    f.fill_(1.0)
    plain = torch.ones(6)
    errors = [
        _error(sm.ops.one_shot_all_reduce, plain, "sum", group),  # not symmetric: no hang
        _error(sm.ops.one_shot_all_reduce, f, "product", group),
        _error(sm.ops.one_shot_all_reduce, sm.empty(6, dtype=torch.int32), "avg", group),
        _error(sm.ops.one_shot_all_reduce, sm.empty(6, dtype=torch.float64), "sum", group),
        _error(sm.ops.one_shot_all_reduce, f.view(2, 3).t(), "sum", group),
        _error(sm.ops.one_shot_all_reduce_out, f, "sum", group, out=torch.empty(5)),
        _error(sm.ops.two_shot_all_reduce_, plain, "sum", group),
        _error(sm.ops.barrier, plain, group),
    ]
    # out may not be the input's own allocation, which peers are reading.
    errors.append(_error(sm.ops.one_shot_all_reduce_out, f[:3], "sum", group, out=f[3:]))
    sm.ops.barrier(f, group)
    return errors


@pytest.mark.parametrize("world", [2, 3, 4])
def test_op_argument_errors_name_argument_and_rule_SM_14(world):
    for errors in run_on_ranks(_op_errors, world):
        assert [(k, m.split(":")[0]) for k, m in errors] == [
            ("ValueError", "input"), ("ValueError", "reduce_op"), ("ValueError", "reduce_op"),
            ("ValueError", "input"), ("ValueError", "input"), ("ValueError", "out"),
            ("ValueError", "input"), ("ValueError", "input"), ("ValueError", "out")]
        assert all("[SM-14]" in m or "[SM-5]" in m for _, m in errors)
        assert "symmetric allocation" in errors[0][1]


def _barrier_op_orders(rounds):
    group = _world()
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(world, dtype=torch.int64)
    h = sm.rendezvous(t, group)
    ok = True
    for i in range(rounds):
        h.get_buffer((rank + 1) % world, (world,), torch.int64)[rank] = i
        torch.ops.refimpl_symm_mem.barrier(t, group, 1, 20_000)
        ok &= t[(rank - 1) % world].item() == i
        torch.ops.refimpl_symm_mem.barrier(t, group)
    return ok


@pytest.mark.parametrize("world", [2, 3, 4])
def test_barrier_op_synchronises_the_group_SM_17(world):
    assert run_on_ranks(_barrier_op_orders, world, 20) == [True] * world


def test_ops_schemas_and_fake_kernels_SM_13():
    ns = torch.ops.refimpl_symm_mem
    assert str(ns.one_shot_all_reduce.default._schema) == (
        "refimpl_symm_mem::one_shot_all_reduce(Tensor input, str reduce_op, str group_name)"
        " -> Tensor")
    assert str(ns.one_shot_all_reduce_out.default._schema).endswith(
        "(Tensor input, str reduce_op, str group_name, *, Tensor(a!) out) -> Tensor(a!)")
    assert str(ns.two_shot_all_reduce_.default._schema).endswith(
        "(Tensor(a!) input, str reduce_op, str group_name) -> Tensor(a!)")

    def program(x):
        y = ns.one_shot_all_reduce(x, "sum", "g")
        ns.barrier(x, "g")
        return ns.two_shot_all_reduce_(y, "avg", "g") * 2

    gm = make_fx(program, tracing_mode="fake")(torch.ones(3, 4))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == ["refimpl_symm_mem.one_shot_all_reduce.default",
                       "refimpl_symm_mem.barrier.default",
                       "refimpl_symm_mem.two_shot_all_reduce_.default", "aten.mul.Tensor"]
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert out.meta["val"].shape == (3, 4)
    with pytest.raises(ValueError, match=r"^reduce_op: .*\[SM-14\]"):
        make_fx(lambda x: ns.one_shot_all_reduce(x, "prod", "g"), tracing_mode="fake")(
            torch.ones(3))
    with pytest.raises(ValueError,
                       match=r"^reduce_op: expected a floating dtype for 'avg', got torch.int32"):
        make_fx(lambda x: ns.two_shot_all_reduce_(x, "avg", "g"), tracing_mode="fake")(
            torch.ones(3, dtype=torch.int32))


# --------------------------------------------------------------------------------------
# Groups never share segments or signals (SM-12)
# --------------------------------------------------------------------------------------
def _two_subgroups():
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    sm.enable_symm_mem_for_group(mine)
    t = sm.empty(16, dtype=torch.float32)
    t.fill_(rank)
    result = torch.ops.refimpl_symm_mem.one_shot_all_reduce(t, "sum", mine.group_name)
    return result.unique().tolist()


def test_groups_rendezvous_side_by_side_without_colliding_SM_12():
    assert run_on_ranks(_two_subgroups, 4) == [[1.0], [1.0], [5.0], [5.0]]


def _custom_group(name):
    """A symmetric-memory group that is no ProcessGroup: only a name and a store (SM-2)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.PrefixStore(name, dist.distributed_c10d._get_default_store())
    sm.set_group_info(name, world - 1 - rank, world, store)  # ranks numbered in reverse
    t = sm.empty(4, dtype=torch.int64)
    t.fill_(rank)
    h = sm.rendezvous(t, name)
    order = [h.get_buffer(r, (4,), torch.int64)[0].item() for r in range(world)]
    total = torch.ops.refimpl_symm_mem.one_shot_all_reduce(t, "sum", name)
    return h.rank, order, total.tolist(), sm.is_symm_mem_enabled_for_group(name)


def test_group_info_from_any_store_defines_the_group_SM_2():
    name = f"custom-{random.getrandbits(32)}"
    results = run_on_ranks(_custom_group, 3, name)
    for rank, (group_rank, order, total, enabled) in enumerate(results):
        assert group_rank == 2 - rank
        assert order == [2, 1, 0], "group rank r is the process that registered as r"
        assert total == [3] * 4 and enabled


# --------------------------------------------------------------------------------------
# The C++ CPU kernels (SM-18): the same bits as the Python kernels, results never aliased
# --------------------------------------------------------------------------------------
def _native_and_python_kernels_agree():
    group = _world()
    rank = dist.get_rank()
    results = []
    for dtype, op in CASES:
        x = sm.empty(1001, dtype=dtype)
        x.copy_(rank_data(rank, dtype, 1001, seed=5))
        native = sm.ops.one_shot_all_reduce(x, op, group)
        python = torch.ops.refimpl_symm_mem._python_one_shot_all_reduce(x, op, group)
        out = torch.empty_like(x)
        torch.ops.refimpl_symm_mem._python_one_shot_all_reduce_out(x, op, group, out=out)
        results.append(torch.equal(native.view(torch.uint8), python.view(torch.uint8))
                       and torch.equal(native.view(torch.uint8), out.view(torch.uint8)))
    return sm.kernel_build_info()["ops"], results


def test_native_kernels_give_the_bits_of_the_python_kernels_SM_18():
    for ops, same in run_on_ranks(_native_and_python_kernels_agree, 2):
        assert ops == "native", "the C++ kernels build here (g++ and torch's headers)"
        assert same == [True] * len(CASES)


def _reused_results_never_alias_a_live_one(numel):
    group = _world()
    x = sm.empty(numel, dtype=torch.float32)
    x.fill_(1)
    first = sm.ops.one_shot_all_reduce(x, "sum", group)
    x.fill_(2)
    second = sm.ops.one_shot_all_reduce(x, "sum", group)  # `first` is alive: a new one
    kept = bool((first == 2).all()) and first.data_ptr() != second.data_ptr()
    address = second.data_ptr()
    del second
    x.fill_(3)
    third = sm.ops.one_shot_all_reduce(x, "sum", group)  # may reuse the dropped one
    return kept, bool((first == 2).all()), bool((third == 6).all()), third.data_ptr() == address


def test_one_shot_results_reuse_only_storage_nobody_holds_SM_18():
    for kept, first_intact, third, reused in run_on_ranks(_reused_results_never_alias_a_live_one,
                                                          2, 1 << 16):
        assert kept and first_intact and third
        assert reused, "a dropped result of 256 KiB is reused (no page faults)"


_IMPORT_EVERYTHING = """
import ctypes, importlib, pathlib, warnings
warnings.simplefilter("error")  # a kernel overriding another warns in the dispatcher
import refimpl
from refimpl import _native
def refuse(*args, **kwargs):
    raise AssertionError(f"compiled at import: {args[:2]}")
_native._build = _native._compile_cxx = refuse
original_cdll = ctypes.CDLL.__init__
def no_library(self, name, *args, **kwargs):
    if "refimpl" in str(name) or "symm_mem" in str(name):
        raise AssertionError(f"loaded at import: {name}")
    original_cdll(self, name, *args, **kwargs)
ctypes.CDLL.__init__ = no_library
for source in pathlib.Path(refimpl.__path__[0]).glob("*.py"):  # not the built C library
    importlib.import_module("refimpl." + source.stem)
import refimpl.symmetric_memory as sm
print(sm.kernel_build_info()["ops"])
"""


def test_importing_refimpl_builds_and_loads_no_kernel_SM_18():
    """Every module of refimpl imports without compiling or loading a kernel library; the
    ops' Python kernels serve until the first CPU rendezvous."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(_native.REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", _IMPORT_EVERYTHING], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["unloaded"]


def _kernels_serving_cpu_around_the_first_rendezvous():
    import warnings

    group = _world()
    name = f"{sm.LIBRARY}::one_shot_all_reduce"

    def cpu_kernel():
        dump = torch._C._dispatch_dump(name).splitlines()
        return [line.split(" :: ")[0] for line in dump if line.startswith("CPU:")]

    before = cpu_kernel()
    x = sm.empty(64, dtype=torch.float32)
    x.fill_(dist.get_rank() + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm.rendezvous(x, group)
    value = sm.ops.one_shot_all_reduce(x, "sum", group)
    return before, cpu_kernel(), [str(w.message) for w in caught], float(value[0])


def test_the_first_rendezvous_hands_cpu_to_the_cpp_kernels_SM_18():
    """Exactly one CPU kernel at a time: the Python one before, the C++ one after, and the
    switch overrides nothing (the dispatcher would warn)."""
    from refimpl.multiprocess import shutdown

    shutdown(2)  # ranks that never rendezvoused
    try:
        results = run_on_ranks(_kernels_serving_cpu_around_the_first_rendezvous, 2)
    finally:
        shutdown(2)
    for before, after, warned, value in results:
        assert len(before) == 1 and "symmetric_memory.py" in before[0], before
        assert len(after) == 1 and "symm_mem_ops.cpp" in after[0], after
        assert warned == []
        assert value == 3.0


@pytest.mark.parametrize("env, expected", [
    ({}, "cpu"),
    ({"REFIMPL_DEVICE": "cuda"}, "cuda"),  # --device cuda: the SM cases on the CUDA allocator
    ({"REFIMPL_DEVICE": "cuda:1"}, "cuda"),
    ({"REFIMPL_DEVICE": "cuda", "REFIMPL_SYMM_MEM_DEVICE": "cpu"}, "cpu"),  # the override
    ({"REFIMPL_SYMM_MEM_DEVICE": "cuda"}, "cuda"),
])
def test_the_sm_cases_device_follows_the_runs_device_unless_overridden_CF_13(monkeypatch, env,
                                                                             expected):
    """`DEVICE` is read at each use: the SM cases' device is $REFIMPL_SYMM_MEM_DEVICE, else
    the type of the run's --device ($REFIMPL_DEVICE), else cpu."""
    for name in ("REFIMPL_DEVICE", "REFIMPL_SYMM_MEM_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert sm.cases_device_type() == expected
    assert sm.DEVICE == expected
