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

import os
import re
import shutil
import struct
import sys
import tempfile
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from conformance import harness
from conformance.backends import NotImplementedConcept
from conformance.harness import backend_in_rank, fresh_ranks

CONCEPT = "symmetric_memory"


def run(backend, fn, world_size: int, *args, **kwargs) -> list:
    """harness.run, with the CPU as the ranks' default device: every tensor under test is
    made on the backend's symmetric-memory device (`device_for_rank`, which `--device cuda`
    selects), every reference on the CPU."""
    return harness.run(backend, fn, world_size, *args, tensors_on_the_cpu=True, **kwargs)


# Waits without a timeout argument (the ops) end after this where the backend lets a
# caller choose (refimpl's `set_default_timeout`): a backend that loses a signal fails a
# case in seconds, not at the harness's limit.
CASE_TIMEOUT_MS = 15_000


@pytest.fixture(autouse=True)
def _host_memory_needs_the_cpu(backend):
    """CF-13: symmetric memory on the CPU lives in host shared memory, a CPU-only
    feature: its cases are skipped, saying so, on another --device (the CUDA ones are
    conformance/cases/test_symmetric_memory_cuda.py's)."""
    try:
        sm = backend.require(CONCEPT)
    except NotImplementedConcept:
        return  # each case reports that itself
    if getattr(sm, "DEVICE", "cpu") == "cpu":
        harness.needs_the_cpu("symmetric memory in host shared memory")


def _needs_the_cpu_kernels(backend) -> None:
    """Skip a case of refimpl's CPU kernels (SM-18: their build, their Python fallback)
    where this run's symmetric memory is on another device (`--device cuda`)."""
    try:
        sm = backend.require(CONCEPT)
    except NotImplementedConcept:
        return  # each case reports that itself
    device = harness.symmetric_memory_device(sm)
    if device.type != "cpu":
        pytest.skip(f"a rule of the CPU kernels; this run's symmetric memory is on "
                    f"{device.type}")


def _setup(spec: str, *attrs: str):
    sm = backend_in_rank(spec).require(CONCEPT, *attrs)
    if hasattr(sm, "set_default_timeout"):
        sm.set_default_timeout(CASE_TIMEOUT_MS)
    group = dist.group.WORLD.group_name
    sm.enable_symm_mem_for_group(group)
    return sm, group, harness.symmetric_memory_device(sm, dist.get_rank())


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
# Every rank reaches each barrier of _handle_and_buffers at once: it returns in
# microseconds. 5 s holds a loaded machine, and is all that a barrier that waits on the
# wrong slot (SM-10) costs before it fails, instead of the default minute.
BARRIER_MS = 5000


def _handle_and_buffers(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous", "enable_symm_mem_for_group")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(2, 16, dtype=torch.float32, device=device)
    t.fill_(rank)
    h = sm.rendezvous(t, group)
    same = sm.rendezvous(t, group) is h or sm.rendezvous(t, group) == h
    h.barrier(timeout_ms=BARRIER_MS)
    peers = [h.get_buffer(r, (2, 16), torch.float32).unique().tolist() for r in range(world)]
    h.barrier(timeout_ms=BARRIER_MS)
    h.get_buffer((rank + 1) % world, (16,), torch.float32, storage_offset=16).fill_(50 + rank)
    h.barrier(timeout_ms=BARRIER_MS)
    got = t[1].unique().tolist()
    facts = (h.rank, h.world_size, h.buffer_size >= 128, len(h.buffer_ptrs),
             len(h.signal_pad_ptrs),
             # upstream may place the tensor at `offset` inside a larger allocation
             h.buffer_ptrs[rank] + getattr(h, "offset", 0) == t.data_ptr())
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


def _zeroed_ring(spec: str, numel, dtype):
    """A zeroed buffer of `numel` (None: the world size) rendezvoused on the world, past
    a barrier: (buffer, handle, rank, world, right neighbour, left neighbour)."""
    sm, group, device = _setup(spec, "empty", "rendezvous")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(numel or world, dtype=dtype, device=device)
    t.zero_()
    h = sm.rendezvous(t, group)
    h.barrier()
    return t, h, rank, world, (rank + 1) % world, (rank - 1) % world


def _signals(spec: str):
    t, h, rank, world, right, left = _zeroed_ring(spec, None, torch.int32)
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


def _rendezvous_on_a_group_never_enabled(spec: str):
    sm, _, device = _setup(spec, "empty", "rendezvous", "is_symm_mem_enabled_for_group")
    pg = dist.new_group([0, 1])  # a registered ProcessGroup, never enabled by name
    before = sm.is_symm_mem_enabled_for_group(pg.group_name)
    t = sm.empty(4, dtype=torch.float32, device=device)
    t.fill_(dist.get_rank() + 10)
    h = sm.rendezvous(t, pg.group_name)
    h.barrier()
    peer = h.get_buffer(1 - dist.get_rank(), (4,), torch.float32)[0].item()
    h.barrier()
    return before, sm.is_symm_mem_enabled_for_group(pg.group_name), h.world_size, peer


@pytest.mark.spec("SM-2", "SM-5")
def test_a_rendezvous_on_a_registered_group_enables_it(backend):
    """A ProcessGroup's name needs no enable_symm_mem_for_group first (as upstream)."""
    backend.require(CONCEPT, "empty", "rendezvous", "is_symm_mem_enabled_for_group")
    assert run(backend, _rendezvous_on_a_group_never_enabled, 2, restart_after=True) == \
        [(False, True, 2, 11.0), (False, True, 2, 10.0)]


def _subgroup_of_ranks_1_and_2(spec: str, how: str):
    """Global ranks 1 and 2 make a group in which they are ranks 0 and 1 (global rank 0
    makes it with them and stays out); each member fills its tensor with its global rank.
    `how` enables the group: by its ProcessGroup, by its name, or through the rendezvous."""
    sm, _, device = _setup(spec, "empty", "rendezvous", "enable_symm_mem_for_group",
                           "is_symm_mem_enabled_for_group")
    pg = dist.new_group([1, 2])
    me = dist.get_rank()
    if me not in (1, 2):
        return None
    name, enabled = pg.group_name, None
    if how != "rendezvous":
        try:
            sm.enable_symm_mem_for_group(pg if how == "process_group" else name)
            enabled = sm.is_symm_mem_enabled_for_group(name)
        except ValueError as exc:
            enabled = str(exc)
        both = [None, None]  # a member that failed would leave the other waiting
        dist.all_gather_object(both, enabled, group=pg)
        if both != [True, True]:
            return both
    t = sm.empty(4, dtype=torch.float32, device=device)
    t.fill_(me)
    try:
        h = sm.rendezvous(t, name)
    except (ValueError, RuntimeError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"
    h.barrier()
    peers = [h.get_buffer(r, (4,), torch.float32)[0].item() for r in range(2)]
    h.barrier()
    return enabled, pg.rank(), h.rank, h.world_size, peers


@pytest.mark.spec("SM-2", "SM-5", "SM-7")
@pytest.mark.parametrize("how", ["process_group", "name", "rendezvous"])
def test_a_subgroup_is_enabled_with_each_members_rank_in_it(backend, how):
    """In a group whose ranks are not the global ones, each member's group info and handle
    hold its rank in the group, on every member: global rank 2 is rank 1 of 2, not 2."""
    backend.require(CONCEPT, "empty", "rendezvous", "enable_symm_mem_for_group",
                    "is_symm_mem_enabled_for_group")
    enabled = None if how == "rendezvous" else True
    assert run(backend, _subgroup_of_ranks_1_and_2, 3, how, restart_after=True) == \
        [None, (enabled, 0, 0, 2, [1.0, 2.0]), (enabled, 1, 1, 2, [1.0, 2.0])]


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


def _sizes_that_differ(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous")
    t = sm.empty(4 + dist.get_rank(), dtype=torch.float32, device=device)  # 16 B, 20 B
    try:
        sm.rendezvous(t, group)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.spec("SM-5")
def test_rendezvous_of_unequal_sizes_fails_on_every_rank_naming_both(backend):
    backend.require(CONCEPT, "empty", "rendezvous")
    for rank, message in enumerate(run(backend, _sizes_that_differ, 2, restart_after=True)):
        assert message is not None, f"rank {rank}: no ValueError"
        assert "tensor" in message and "16" in message and "20" in message, \
            f"rank {rank}: {message}"


def _wrongly_typed_arguments(spec: str):
    """Each call passes one argument of the wrong type (a float or a bool where an int
    belongs): the argument each refusal names, or None where the call went through."""
    sm, group, device = _setup(spec, "empty", "empty_strided_p2p", "rendezvous")
    t = sm.empty(8, dtype=torch.float32, device=device)
    h = sm.rendezvous(t, group)
    f32 = torch.float32
    calls = [
        ("size", lambda: sm.empty(2.0, device=device)),
        ("size", lambda: sm.empty(True, device=device)),
        ("stride", lambda: sm.empty_strided_p2p((2,), (1.0,), f32, device)),
        ("alloc_id", lambda: sm.empty_strided_p2p((2,), (1,), f32, device, group,
                                                  alloc_id=True)),
        ("sizes", lambda: h.get_buffer(0, (2.0,), f32)),
        ("storage_offset", lambda: h.get_buffer(0, (2,), f32, storage_offset=1.0)),
        ("rank", lambda: h.get_buffer(False, (2,), f32)),
        ("channel", lambda: h.barrier(channel=True)),
        ("timeout_ms", lambda: h.barrier(timeout_ms=1.5)),
        ("timeout_ms", lambda: h.barrier(timeout_ms=True)),
        ("dst_rank", lambda: h.put_signal(True)),
    ]
    named = []
    for want, call in calls:
        try:
            call()
            named.append((want, None))
        except (ValueError, TypeError) as exc:
            named.append((want, str(exc).split(":")[0]))
    h.barrier()
    return named


@pytest.mark.spec("SM-3", "SM-4", "SM-8", "SM-9", "SM-11")
def test_arguments_of_the_wrong_type_are_refused_naming_them(backend):
    backend.require(CONCEPT, "empty", "empty_strided_p2p", "rendezvous")
    for rank, named in enumerate(run(backend, _wrongly_typed_arguments, 2)):
        assert all(want == got for want, got in named), f"rank {rank}: {named}"


def _group_of_the_allocation(spec: str):
    sm, group, device = _setup(spec, "empty_strided_p2p", "rendezvous")
    other = dist.new_group([0, 1]).group_name  # the same ranks, another group
    sm.enable_symm_mem_for_group(other)
    t = sm.empty_strided_p2p((4,), (1,), torch.float32, device, group)
    try:
        sm.rendezvous(t, other)
        refused = None
    except ValueError as exc:
        refused = str(exc).split(":")[0]
    return refused, sm.rendezvous(t, group).world_size


@pytest.mark.spec("SM-5")
def test_rendezvous_takes_the_group_the_tensor_was_allocated_for(backend):
    backend.require(CONCEPT, "empty_strided_p2p", "rendezvous")
    assert run(backend, _group_of_the_allocation, 2) == [("group", 2)] * 2


def _group_of_the_first_rendezvous(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous")
    rank = dist.get_rank()
    other = dist.new_group([0, 1]).group_name  # the same ranks, another group
    sm.enable_symm_mem_for_group(other)
    t = sm.empty(4, dtype=torch.float32, device=device)  # allocated without a group
    t.fill_(rank + 1)
    h = sm.rendezvous(t, other)
    # Asked for the other group, through the tensor and through a view of it.
    refused = [_refusal(sm.rendezvous, t, group), _refusal(sm.rendezvous, t[2:], group)]
    again = sm.rendezvous(t[1:], other)
    h.barrier()
    peer = h.get_buffer(1 - rank, (4,), torch.float32)[0].item()
    h.barrier()
    return refused, again is h or again == h, h.world_size, peer


@pytest.mark.spec("SM-5")
def test_a_tensor_allocated_without_a_group_keeps_the_group_of_its_rendezvous(backend):
    """A tensor allocated without a group takes the group of its first rendezvous: a
    later rendezvous for another group (of the same ranks) is refused naming `group` on
    every rank, before any communication, instead of handing out the first group's
    handle; the first group's rendezvous still returns that handle."""
    backend.require(CONCEPT, "empty", "rendezvous")
    assert run(backend, _group_of_the_first_rendezvous, 2) == \
        [(["group", "group"], True, 2, 2.0), (["group", "group"], True, 2, 1.0)]


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


def _persistent_through_a_collective(spec: str, alloc_id: int, rounds: int):
    """Each round: the persistent buffer asked for, filled, all-gathered by the backend's
    functional collective and waited, then dropped. A refused request still gathers (a
    plain tensor) so that the ranks stay in step; the refusals and wrong rounds come back."""
    sm, group, device = _setup(spec, "empty_strided_p2p")
    ops = backend_in_rank(spec).require("functional_collectives").ops
    rank, world = dist.get_rank(), dist.get_world_size()
    refusals, wrong = [], []
    for i in range(rounds):
        try:
            buffer = sm.empty_strided_p2p((3, 4), (4, 1), torch.float32, device, group,
                                          alloc_id=alloc_id)
        except (RuntimeError, ValueError) as exc:
            refusals.append(f"round {i}: {exc}")
            buffer = torch.empty(3, 4, device=device)
        buffer.fill_(10 * i + rank)
        gathered = ops.wait_tensor(ops.all_gather_into_tensor(buffer, world, group))
        want = torch.cat([torch.full((3, 4), 10.0 * i + r) for r in range(world)])
        if not torch.equal(gathered.cpu(), want):
            wrong.append(i)
        del buffer, gathered
    return refusals[:2], wrong


@pytest.mark.spec("SM-4")
def test_a_persistent_buffer_is_free_again_once_the_collective_that_read_it_is_waited(
        backend):
    """A process group's worker thread lets go of a finished collective's input just
    after the wait returns (gloo's drops it after marking the work complete): the buffer's
    next request, right after the wait, is not a live holder's and MUST be granted."""
    backend.require(CONCEPT, "empty_strided_p2p")
    backend.require("functional_collectives")
    results = run(backend, _persistent_through_a_collective, 2, 0x7A11, 200)
    for rank, (refusals, wrong) in enumerate(results):
        assert not refusals and not wrong, f"rank {rank}: refused {refusals}, wrong {wrong}"


def _persistent_let_go_by_another_thread(spec: str, alloc_id: int):
    """The persistent buffer's last view is held by another thread, which lets go of it
    50 ms after this one asks for the buffer again (as a process group's worker thread
    does just after a wait returns): (same address, contents kept), or the refusal."""
    sm, group, device = _setup(spec, "empty_strided_p2p")
    first = sm.empty_strided_p2p((16,), (1,), torch.float32, device, group, alloc_id=alloc_id)
    first.fill_(7)
    address = first.data_ptr()
    held = [first[4:]]  # a view, not the tensor handed out
    del first

    def let_go():
        time.sleep(0.05)
        held.clear()

    worker = threading.Thread(target=let_go)
    worker.start()
    try:
        again = sm.empty_strided_p2p((16,), (1,), torch.float32, device, group,
                                     alloc_id=alloc_id)
        outcome = (again.data_ptr() == address, float(again[0]))
    except (RuntimeError, ValueError) as exc:
        outcome = str(exc)
    worker.join()
    return outcome


@pytest.mark.spec("SM-4")
def test_a_view_another_thread_lets_go_of_at_once_is_no_live_holder(backend):
    """SM-4's moment: a reference another thread drops just after the request (here 50 ms)
    is waited for, not refused; the buffer comes back at its address, contents kept."""
    backend.require(CONCEPT, "empty_strided_p2p")
    for rank, outcome in enumerate(run(backend, _persistent_let_go_by_another_thread, 2,
                                       0x7A12)):
        assert outcome == (True, 7.0), f"rank {rank}: {outcome}"


def _persistent_made_under_inference_mode(spec: str, alloc_id: int):
    sm, group, device = _setup(spec, "empty_strided_p2p")
    with torch.inference_mode():  # a compiled program run for inference asks first
        first = sm.empty_strided_p2p((4,), (1,), torch.float32, device, group,
                                     alloc_id=alloc_id)
        first.fill_(2.0)
    del first
    again = sm.empty_strided_p2p((4,), (1,), torch.float32, device, group, alloc_id=alloc_id)
    weight = torch.ones(4, device=device, requires_grad=True)
    try:
        (again * weight).sum().backward()  # autograd saves `again` for the gradient
    except RuntimeError as exc:
        return again.is_inference(), str(exc)
    return again.is_inference(), weight.grad.tolist()


@pytest.mark.spec("SM-4")
def test_a_persistent_allocation_first_made_in_inference_mode_serves_autograd_later(backend):
    """The memory outlives the call that first asked for it: asked again outside
    inference mode, it is an ordinary tensor that autograd may save."""
    backend.require(CONCEPT, "empty_strided_p2p")
    for rank, result in enumerate(run(backend, _persistent_made_under_inference_mode, 2,
                                      0x1F3)):
        assert result == (False, [2.0] * 4), f"rank {rank}: {result}"


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
    check_all_reduces(results, getattr(torch, dtype_name), numel)


def check_all_reduces(results, dtype, numel: int, ranks=None) -> None:
    """Every rank's one-shot, out= and two-shot sums of `_all_reduces` are the rank-order
    reference, bit for bit, and one-shot left its input as it was. `ranks`: the global
    ranks of the results (default: 0, 1, ...)."""
    ranks = list(range(len(results))) if ranks is None else ranks
    want = _reference_sum([_rank_input(r, dtype, numel) for r in ranks])
    for rank, (one, out, two, unchanged) in zip(ranks, results, strict=True):
        assert torch.equal(one, want), f"one-shot on rank {rank}"
        assert torch.equal(out, want), f"one-shot out= on rank {rank}"
        assert torch.equal(two, want), f"two-shot on rank {rank}"
        assert unchanged, f"one-shot changed its input on rank {rank}"


@pytest.mark.spec("SM-15", "SM-16", "SM-2")
@pytest.mark.parametrize("world, numel", [(1, 5), (2, 0), (3, 2)],
                         ids=["one_rank", "no_element", "fewer_elements_than_ranks"])
def test_all_reduces_at_the_smallest_group_and_sizes(backend, world, numel):
    """A group of one (SM-2 allows it) reduces to the input itself; an input of no
    element gives an empty result; two-shot with fewer elements than ranks leaves some
    ranks an empty chunk (SM-16)."""
    backend.require(CONCEPT, "empty", "ops")
    results = run(backend, _all_reduces, world, "float32", numel)
    want = _reference_sum([_rank_input(r, torch.float32, numel) for r in range(world)])
    for rank, (one, out, two, unchanged) in enumerate(results):
        for name, got in (("one-shot", one), ("one-shot out=", out), ("two-shot", two)):
            assert got.shape == (numel,) and torch.equal(got, want), f"{name} on rank {rank}"
        assert unchanged, f"one-shot changed its input on rank {rank}"


def _subgroup_all_reduces(spec: str, numel: int):
    """World 3: ranks 1 and 2 sum over their subgroup [1, 2]; rank 0, outside it, sums
    over a group of itself alone at the same time. Each member's one-shot, out= and
    two-shot results, or None on rank 0 (its own sum is the input: a group of one)."""
    sm, _, device = _setup(spec, "empty", "ops")
    rank = dist.get_rank()
    pair, alone = dist.new_group([1, 2]), dist.new_group([0])
    group = pair if rank in (1, 2) else alone
    name = group.group_name
    sm.enable_symm_mem_for_group(name)
    t = sm.empty(numel, dtype=torch.float32, device=device)
    t.copy_(_rank_input(rank, torch.float32, numel))
    one = sm.ops.one_shot_all_reduce(t, "sum", name).cpu()
    out = torch.empty_like(t)
    sm.ops.one_shot_all_reduce_out(t, "sum", name, out=out)
    sm.ops.two_shot_all_reduce_(t, "sum", name)
    if rank == 0:
        alone_right = all(torch.equal(r, _rank_input(0, torch.float32, numel))
                          for r in (one, out.cpu(), t.cpu()))
        return "alone" if alone_right else "rank 0's group of one changed its input"
    return one, out.cpu(), t.cpu(), True


@pytest.mark.spec("SM-15", "SM-16", "SM-2")
def test_a_subgroups_all_reduce_sums_its_members_only(backend):
    """The ops reduce over the group they name: a subgroup's sum holds its members' inputs
    only, even while a rank outside it runs an all-reduce of its own (a kernel that reduces
    over the whole world, or over every rank attached to a shared buffer, adds rank 0's
    data, or waits for rank 0 forever: the run's timeout names the ranks)."""
    backend.require(CONCEPT, "empty", "ops")
    numel = 300
    results = run(backend, _subgroup_all_reduces, 3, numel, timeout=60, restart_after=True)
    assert results[0] == "alone", results[0]
    check_all_reduces(results[1:], torch.float32, numel, ranks=[1, 2])


def _subgroup_then_everyone(spec: str, numel: int):
    """Ranks 1 and 2 rendezvous on their subgroup; then all three on a group of every rank
    (a new one, so that no earlier case's rendezvous counts): its sum, or the error."""
    sm, _, device = _setup(spec, "empty", "rendezvous", "ops")
    rank = dist.get_rank()
    sub = dist.new_group([1, 2])  # every rank makes it; rank 0 gets no group
    everyone = dist.new_group([0, 1, 2])
    groups = [everyone] + ([sub] if rank in (1, 2) else [])
    for pg in groups:
        sm.enable_symm_mem_for_group(pg.group_name)
    try:
        if rank in (1, 2):
            first = sm.empty(numel, dtype=torch.float32, device=device)
            sm.rendezvous(first, sub.group_name, timeout_ms=5_000)
        t = sm.empty(numel, dtype=torch.float32, device=device)
        t.copy_(_rank_input(rank, torch.float32, numel))
        sm.rendezvous(t, everyone.group_name, timeout_ms=5_000)
        return sm.ops.one_shot_all_reduce(t, "sum", everyone.group_name).cpu()
    except Exception as exc:  # the verdict: a hang ends as the rendezvous' timeout
        return f"{type(exc).__name__}: {exc}"
    finally:
        for pg in groups:
            dist.destroy_process_group(pg)


@pytest.mark.spec("SM-12", "SM-5")
def test_a_subgroups_rendezvous_leaves_a_later_groups_rendezvous_in_step(backend):
    """Upstream's rendezvous numbered its store keys by the rendezvous a *process* had done
    (pytorch/pytorch#196082): after ranks 1 and 2 rendezvous on their subgroup, a
    rendezvous of all three meets under different keys on rank 0 and hangs. Keys numbered
    per group (SM-12) keep it in step: it completes and sums every rank's data."""
    backend.require(CONCEPT, "empty", "rendezvous", "ops")
    numel = 300
    results = run(backend, _subgroup_then_everyone, 3, numel, timeout=60, restart_after=True)
    want = _reference_sum([_rank_input(r, torch.float32, numel) for r in range(3)])
    for rank, result in enumerate(results):
        assert not isinstance(result, str), f"rank {rank}: {result}"
        assert torch.equal(result, want), f"rank {rank}: a wrong sum"


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


def _rendezvous_no_show(spec: str, absent: tuple[int, ...]):
    sm, _, device = _setup(spec, "empty", "rendezvous", "SymmMemTimeout", "leaked_segments")
    # A group of its own: the failed rendezvous leaves this group's ranks out of step
    # (one rank rendezvoused once less), and no later case uses it.
    pg = dist.new_group(list(range(dist.get_world_size())))
    other = pg.group_name
    sm.enable_symm_mem_for_group(other)
    t = sm.empty(4, dtype=torch.float32, device=device)
    found = None
    dist.barrier()  # the ranks that come start their waits together
    if dist.get_rank() not in absent:
        try:
            sm.rendezvous(t, other, timeout_ms=3_000)
        except sm.SymmMemTimeout as exc:
            found = exc.peer, str(exc)
    dist.barrier()  # every rank's wait has ended
    mine = [n for n in sm.leaked_segments() if f"-{os.getpid()}-" in n]
    dist.destroy_process_group(pg)
    return found, mine


@pytest.mark.spec("SM-11", "SM-12")
@pytest.mark.parametrize("world, absent", [(3, (1,)), (4, (1, 2))],
                         ids=["one_never_comes", "two_never_come"])
def test_a_rendezvous_times_out_naming_the_rank_that_never_came(backend, world, absent):
    """Every absent rank is named in the message, the lowest as `peer`."""
    backend.require(CONCEPT, "empty", "rendezvous", "SymmMemTimeout", "leaked_segments")
    results = run(backend, _rendezvous_no_show, world, absent)
    for rank in range(world):
        if rank in absent:
            assert results[rank] == (None, []), (rank, results[rank])
            continue
        (peer, message), mine = results[rank]
        assert peer == min(absent), (rank, peer, message)
        for missing in absent:
            assert re.search(rf"\b{missing}\b", message), (rank, missing, message)
        assert mine == [], f"rank {rank} left its segment {mine} [SM-12]"

# --------------------------------------------------------------------------------------
# The rank-order oracle of SM-15 for every dtype and reduce op (independent of any backend)
# --------------------------------------------------------------------------------------
DTYPES = ["float32", "bfloat16", "float16", "int32", "int64"]
OPS = ["sum", "avg", "max", "min"]
KINDS = [(d, op) for d in DTYPES for op in OPS if op != "avg" or d.startswith(("f", "b"))]


def _refusal(fn, *args, whole: bool = False, **kwargs) -> str | None:
    """The argument a ValueError of `fn(*args)` names (its whole message if `whole`)."""
    try:
        fn(*args, **kwargs)
    except ValueError as exc:
        return str(exc) if whole else str(exc).split(":")[0]
    return None


def _rank_order(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """((x0 op x1) op x2) ...: 16-bit floats in float32 rounded once, avg = sum / ranks,
    integer sums wrap, max/min propagate NaN."""
    dtype = inputs[0].dtype
    if not dtype.is_floating_point:  # exact in Python ints, then wrapped to the width
        bits = 8 * dtype.itemsize
        acc = [int(v) for v in inputs[0].tolist()]
        for x in inputs[1:]:
            for i, v in enumerate(x.tolist()):
                acc[i] = acc[i] + v if op == "sum" else (max if op == "max" else min)(acc[i], v)
        wrapped = [(v + 2 ** (bits - 1)) % 2 ** bits - 2 ** (bits - 1) for v in acc]
        return torch.tensor(wrapped, dtype=dtype)
    acc = inputs[0].float()
    for x in inputs[1:]:
        x = x.float()
        acc = acc + x if op in ("sum", "avg") else (torch.maximum if op == "max"
                                                    else torch.minimum)(acc, x)
    if op == "avg":
        acc = acc / len(inputs)
    return acc.to(dtype)


def _kind_input(rank: int, dtype_name: str, numel: int) -> torch.Tensor:
    """Inputs where the rank order shows: large values that cancel, NaN on one rank, and
    integers at the edge of their range (sums wrap)."""
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(31 * rank + numel)
    if dtype.is_floating_point:
        x = torch.randn(numel, generator=g) * 3
        pattern = [3e4, -3e4, 1.0, 0.5]  # (3e4 + -3e4) + 1 != 3e4 + (-3e4 + 1) in 16 bits
        if numel > 3:
            x[0] = pattern[rank % 4]
        if numel > 5 and rank == 1:
            x[5] = float("nan")
        return x.to(dtype)
    info = torch.iinfo(dtype)
    x = torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int64)
    if numel > 2:
        x[2] = info.max if rank % 2 == 0 else 7  # the sum wraps
    if numel > 3:
        x[3] = info.min + rank
    return x.to(dtype)


def _every_kind(spec: str, numels: list[int]):
    sm, group, device = _setup(spec, "empty", "ops")
    rank = dist.get_rank()
    results = {}
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        buf = sm.empty(max(numels) + 8, dtype=dtype, device=device)
        for (kind_dtype, op), numel in ((k, n) for k in KINDS for n in numels):
            if kind_dtype != dtype_name:
                continue
            data = _kind_input(rank, dtype_name, numel)
            x = buf[3:3 + numel]  # an input at an offset inside its allocation
            x.copy_(data)
            one = sm.ops.one_shot_all_reduce(x, op, group).cpu().clone()
            out = torch.empty(numel, dtype=dtype, device=device)
            sm.ops.one_shot_all_reduce_out(x, op, group, out=out)
            unchanged = torch.equal(x.cpu().view(torch.uint8), data.view(torch.uint8))
            sm.ops.two_shot_all_reduce_(x, op, group)
            results[dtype_name, op, numel] = (one, out.cpu(), x.cpu().clone(), unchanged)
    return results


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point:  # NaN == NaN here; -0.0 vs 0.0 only for max/min (SM-15)
        both_nan = a.isnan() & b.isnan()
        return bool(((a == b) | both_nan).all()) and a.shape == b.shape
    return torch.equal(a, b)


@pytest.mark.spec("SM-14", "SM-15", "SM-16")
@pytest.mark.parametrize("world", [2, 3])
def test_every_dtype_and_reduce_op_in_rank_order_on_every_rank(backend, world):
    """Numel 0 .. 7: fewer elements than ranks, not a multiple of the group size (two-shot's
    last chunks short or empty), order-sensitive values, NaN, integer wrap; and 300, past
    any vector width and block with a tail. A group of two is a case of its own: an
    implementation may reduce two sources in a pass of their own."""
    backend.require(CONCEPT, "empty", "ops")
    numels = [0, 1, 2, 4, 7, 300]
    results = run(backend, _every_kind, world, numels)
    for (dtype_name, op), numel in ((k, n) for k in KINDS for n in numels):
        want = _rank_order([_kind_input(r, dtype_name, numel) for r in range(world)], op)
        for rank in range(world):
            one, out, two, unchanged = results[rank][dtype_name, op, numel]
            where = f"{dtype_name} {op} numel={numel} on rank {rank}"
            assert _same_bits(one, want), f"one-shot {where}: {one} != {want}"
            assert _same_bits(out, want), f"one-shot out= {where}"
            assert _same_bits(two, want), f"two-shot {where}: {two} != {want}"
            assert unchanged, f"one-shot changed its input, {where}"
    # NaN reached every rank's max/min (rank 1 put it at index 5)
    assert results[0]["float32", "max", 7][0][5].isnan()


def _results_held(spec: str):
    """Three one-shot and pointwise results of one buffer, all held, for sizes around
    16 KiB (where an implementation might start to recycle the storage of a result the
    caller dropped): values read after the last call, and the distinct storages."""
    sm, group, device = _setup(spec, "empty", "ops")
    rank = dist.get_rank()
    found = {}
    for dtype_name, numel in (("float32", 4095), ("float32", 4096), ("bfloat16", 8192),
                              ("float32", 16384)):
        buf = sm.empty(numel, dtype=getattr(torch, dtype_name), device=device)
        ones = torch.ones(numel, dtype=buf.dtype, device=device)
        held = []
        for k in range(1, 4):
            buf.fill_((rank + 1) * k)
            held.append(sm.ops.one_shot_all_reduce(buf, "sum", group))
        if hasattr(sm, "pointwise_steps"):
            for k in range(1, 4):
                held.append(sm.ops.one_shot_all_reduce_pointwise(buf, ones, "sum", group,
                                                                 f"mul {k}.0", ""))
        storages = {r.untyped_storage().data_ptr() for r in held}
        found[dtype_name, numel] = ([r.cpu().unique().tolist() for r in held], len(storages))
    return found


@pytest.mark.spec("SM-15", "SM-13", "SM-24")
def test_every_result_is_a_new_tensor_while_earlier_ones_are_held(backend):
    """A one-shot result is a new tensor (SM-13's schema): a later call never writes into
    the storage of a result the caller still holds, at any size."""
    backend.require(CONCEPT, "empty", "ops")
    world = 2
    for rank, found in enumerate(run(backend, _results_held, world)):
        for (dtype_name, numel), (values, storages) in found.items():
            calls = len(values)
            want = [[3.0 * k] for k in range(1, 4)] + [[2.0 * k] for k in range(1, 4)]
            assert values == want[:calls], f"{dtype_name}[{numel}] on rank {rank}: {values}"
            assert storages == calls, f"{dtype_name}[{numel}] on rank {rank}: results share"


def _op_refusals(spec: str):
    sm, group, device = _setup(spec, "empty", "ops")
    f = sm.empty(6, dtype=torch.float32, device=device)
    f.fill_(1.0)
    i = sm.empty(6, dtype=torch.int32, device=device)
    i.fill_(2)
    sm.ops.one_shot_all_reduce(f, "sum", group)  # both rendezvoused: later calls are warm
    sm.ops.one_shot_all_reduce(i, "sum", group)

    plain = torch.ones(6, device=device)
    answers = [
        _refusal(sm.ops.one_shot_all_reduce, i, "avg", group),
        _refusal(sm.ops.two_shot_all_reduce_, i, "avg", group),
        _refusal(sm.ops.one_shot_all_reduce, f, "prod", group),
        _refusal(sm.ops.one_shot_all_reduce, f.view(2, 3).t(), "sum", group),
        # the same, with reduce_op in another case: the spelling does not skip the check
        _refusal(sm.ops.one_shot_all_reduce, f.view(2, 3).t(), "Sum", group),
        _refusal(sm.ops.two_shot_all_reduce_, i.view(2, 3).t(), "MAX", group),
        _refusal(sm.ops.one_shot_all_reduce_out, f, "sum", group,
                out=torch.empty(5, device=device)),
        _refusal(sm.ops.one_shot_all_reduce_out, f, "sum", group,
                out=torch.empty(6, dtype=torch.float64, device=device)),
        _refusal(sm.ops.one_shot_all_reduce_out, f[:3], "sum", group, out=f[3:]),
        _refusal(sm.ops.one_shot_all_reduce_out, f, "sum", group,
                 out=torch.empty(12, device=device)[::2]),  # the right shape, strided
        _refusal(sm.ops.one_shot_all_reduce, plain, "sum", group),
    ]
    # The same ranks under another name: not the group the allocations were rendezvoused
    # for (an implementation that finds an allocation by its address alone misses it).
    pg = dist.new_group([0, 1])
    other = pg.group_name
    sm.enable_symm_mem_for_group(other)
    for_group = sm.empty_strided_p2p((6,), (1,), torch.float32, device, group)  # unused yet
    answers += [_refusal(sm.ops.one_shot_all_reduce, f, "sum", other),
                _refusal(sm.ops.one_shot_all_reduce_out, f, "sum", other,
                         out=torch.empty(6, device=device)),
                _refusal(sm.ops.two_shot_all_reduce_, i, "sum", other),
                _refusal(sm.ops.one_shot_all_reduce, for_group, "sum", other)]
    dist.destroy_process_group(pg)
    upper = sm.ops.one_shot_all_reduce(f, "SUM", group).cpu().tolist()  # case-insensitive
    return answers, upper


@pytest.mark.spec("SM-14")
def test_op_arguments_are_refused_on_every_rank_before_any_wait(backend):
    backend.require(CONCEPT, "empty", "ops")
    for answers, upper in run(backend, _op_refusals, 2):
        assert answers == ["reduce_op", "reduce_op", "reduce_op", "input", "input", "input",
                           "out", "out", "out", "out", "input"] + ["group_name"] * 4
        assert upper == [2.0] * 6


# ---- SM-24: one_shot_all_reduce_pointwise ------------------------------------------------
POINTWISE_DTYPES = ["float32", "bfloat16", "float16"]
# (reduce_op, prologue, epilogue, the local input: "other", "itself" or "transposed")
POINTWISE_CALLS = [
    ("sum", "mul 0.1; add 3.3; sub 0.001", "mul 1.7; add -2.5; mul 3.0", "other"),
    # x + 1 + 1 is not x + 2 where the spacing is 2 (256 in bfloat16, 2048 in float16,
    # 2**24 in float32, all at the front of the input): each step rounds
    ("sum", "add 1.0; add 1.0", "sub 1.0; sub 1.0", "other"),
    # chains of the same length as the previous call's, other numbers
    ("sum", "add 2.0; add 1.0", "sub 3.0; sub 1.0", "other"),
    ("max", "mul -2.0; add 0.25", "add 0.5", "transposed"),  # Python kernel: not contiguous
    ("avg", "", "mul 3.0", "other"),
    ("sum", "", "add 1.0", "transposed"),  # copied as it is, by the Python kernel
    ("sum", " sub 1.5 ;mul 2.0", "", "itself"),
]


def _pointwise_input(rank: int, dtype_name: str) -> torch.Tensor:
    x = _rank_input(rank, torch.float32, 6) * 10
    x[:3] = torch.tensor([256.0, 2048.0, 2.0**24])
    return x.to(getattr(torch, dtype_name)).view(2, 3)


def _aten_steps(x: torch.Tensor, chain: str, device: torch.device) -> torch.Tensor:
    """The reference: each step as the ATen op with a Python number, on `device` (ATen's
    CPU and CUDA kernels read an add's number differently for 16-bit dtypes), on the CPU."""
    x = x.to(device)
    for step in filter(None, (s.strip() for s in chain.split(";"))):
        op, number = step.split(" ")
        x = getattr(torch, op)(x, float(number))
    return x.cpu()


def _pointwise(spec: str):
    sm, group, device = _setup(spec, "empty", "ops", "pointwise_steps", "rendezvous")
    results = {}
    for dtype_name in POINTWISE_DTYPES:
        dtype = getattr(torch, dtype_name)
        buf = sm.empty(2, 3, dtype=dtype, device=device)
        sm.rendezvous(buf, group)  # so that no call is a first use (a kernel's fast path)
        for i, (op, prologue, epilogue, local) in enumerate(POINTWISE_CALLS):
            data = _pointwise_input(dist.get_rank(), dtype_name).to(device)
            source = {"other": data.clone(), "itself": buf,
                      "transposed": data.t().contiguous().t()}[local]
            if local == "itself":
                buf.copy_(data)
            else:  # not what the previous call left there: a copy left out shows
                buf.fill_(-7.0)
            out = sm.ops.one_shot_all_reduce_pointwise(buf, source, op, group, prologue,
                                                       epilogue)
            unchanged = local == "itself" or torch.equal(source.cpu(), data.cpu())
            results[dtype_name, i] = (out.cpu(), buf.cpu().clone(), unchanged)
    return results


@pytest.mark.spec("SM-24", "SM-15")
def test_pointwise_steps_are_bitwise_the_aten_ops_on_every_rank(backend):
    """World 3: the prologue written into the buffer, the one-shot in rank order, the
    epilogue, each step rounded to the dtype, on every rank."""
    sm = backend.require(CONCEPT, "empty", "ops", "pointwise_steps", "rendezvous")
    world = 3
    device = harness.symmetric_memory_device(sm)
    results = run(backend, _pointwise, world)
    for dtype_name in POINTWISE_DTYPES:
        inputs = [_pointwise_input(r, dtype_name) for r in range(world)]
        for i, (op, prologue, epilogue, _) in enumerate(POINTWISE_CALLS):
            written = [_aten_steps(x, prologue, device) for x in inputs]
            want = _aten_steps(_rank_order([w.flatten() for w in written], op).view(2, 3),
                               epilogue, device)
            for rank in range(world):
                out, buf, unchanged = results[rank][dtype_name, i]
                where = f"{dtype_name} {op} {prologue!r} {epilogue!r} on rank {rank}"
                assert _same_bits(out, want), f"{where}: {out} != {want}"
                assert _same_bits(buf, written[rank]), f"buffer {where}: {buf}"
                assert unchanged, f"local_input changed, {where}"


def _pointwise_refusals(spec: str):
    sm, group, device = _setup(spec, "empty", "ops", "pointwise_steps", "rendezvous")
    f = sm.empty(8, device=device)
    f.fill_(1.0)
    i = sm.empty(4, dtype=torch.int32, device=device)
    wide = sm.empty(4, dtype=torch.int64, device=device)
    for allocation in (f, i, wide):  # no call is a first use: each meets a kernel's fast path
        sm.rendezvous(allocation, group)
    x = torch.ones(4, device=device)
    call = sm.ops.one_shot_all_reduce_pointwise
    answers = [_refusal(call, f[:4], x, "sum", group, bad, "") for bad in
               ("div 2.0", "mul", "add ", "mul two", "mul 2.0;", "mul  2.0", "mul 0x10",
                "mul 1.5.5", "add1.0")]
    answers += [
        _refusal(call, f[:4], x, "sum", group, "", "pow 2.0"),
        _refusal(call, i, x.int(), "sum", group, "add 1.0", ""),
        _refusal(call, f[:4], torch.ones(3, device=device), "sum", group, "", ""),
        _refusal(call, f[:4], x.double(), "sum", group, "", ""),
        _refusal(call, f[:4], f[2:6], "sum", group, "", ""),  # inside the buffer's allocation
        _refusal(call, f[:4], x, "prod", group, "", ""),
        _refusal(call, f.view(2, 4).t(), torch.ones(4, 2, device=device), "sum", group, "",
                 ""),
        _refusal(call, torch.ones(4, device=device), x, "sum", group, "", ""),
    ]
    pg = dist.new_group([0, 1])  # the same ranks, another group
    sm.enable_symm_mem_for_group(pg.group_name)
    answers.append(_refusal(call, f[:4], x, "sum", pg.group_name, "", ""))
    dist.destroy_process_group(pg)
    for bad in ([("mul", True)], [("mul", "2")], [("pow", 2)], [("add", 2**53 + 1)]):
        try:
            sm.pointwise_steps(bad)
            answers.append(None)
        except (TypeError, ValueError) as exc:
            answers.append(str(exc).split(":")[0])
    steps = sm.pointwise_steps([("mul", 2), ("add", 0.5)])
    result = call(f[:4], x * 3, "sum", group, steps, "sub 1.0").cpu().tolist()
    # Empty chains need no floating dtype: a plain one-shot of integers (rank + 1 each)
    ints = [call(buf, (x * (dist.get_rank() + 1)).to(buf.dtype), op, group, "", "").cpu()
            .tolist() for buf, op in ((i, "sum"), (wide, "max"), (i, "Min"))]
    return answers, steps, result, ints


@pytest.mark.spec("SM-24", "SM-14")
def test_pointwise_arguments_are_refused_on_every_rank_before_any_wait(backend):
    backend.require(CONCEPT, "empty", "ops", "pointwise_steps", "rendezvous")
    for answers, steps, result, ints in run(backend, _pointwise_refusals, 2):
        assert answers == ["prologue"] * 9 + ["epilogue", "prologue"] + ["local_input"] * 3 \
            + ["reduce_op", "symm_buffer", "symm_buffer", "group_name"] + ["steps"] * 4
        assert steps == "mul 2.0; add 0.5"
        assert result == [12.0] * 4  # (3 * 2 + 0.5) on 2 ranks, then - 1
        assert ints == [[3] * 4, [2] * 4, [1] * 4], f"integers with empty chains: {ints}"


@pytest.mark.spec("SM-24", "SM-13")
def test_pointwise_schema_and_fake_kernel(backend):
    sm = backend.require(CONCEPT, "ops", "pointwise_steps")
    op = sm.ops.one_shot_all_reduce_pointwise.default
    schema = op._schema  # compared field by field: torch versions quote defaults differently
    assert [(a.name, str(a.type), a.default_value) for a in schema.arguments] == [
        ("symm_buffer", "Tensor", None), ("local_input", "Tensor", None),
        ("reduce_op", "str", None), ("group_name", "str", None),
        ("prologue", "str", ""), ("epilogue", "str", "")]
    assert schema.arguments[0].alias_info.is_write  # Tensor(a!): the buffer is written
    assert not any(a.alias_info for a in schema.arguments[1:])
    assert [str(r.type) for r in schema.returns] == ["Tensor"]
    assert schema.returns[0].alias_info is None  # a new tensor, not the buffer
    from torch.fx.experimental.proxy_tensor import make_fx

    def program(epilogue="add 1.0", cast=lambda t: t, rows=3):  # fake: nothing communicates
        def traced(buf, x):
            return op(cast(buf), cast(x)[:rows], "sum", "no-such-group", "mul 2.0", epilogue)
        return traced

    gm = make_fx(program(), tracing_mode="fake")(torch.ones(3, 5), torch.ones(3, 5))
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert tuple(out.meta["val"].shape) == (3, 5)
    for dtype in (torch.int32, torch.int64):  # empty chains: no floating dtype needed
        gm = make_fx(lambda buf, x: op(buf, x, "sum", "no-such-group", "", ""),
                     tracing_mode="fake")(torch.ones(3, 5, dtype=dtype),
                                          torch.ones(3, 5, dtype=dtype))
        out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        assert out.meta["val"].dtype == dtype and tuple(out.meta["val"].shape) == (3, 5)
    for bad, argument in ((program(epilogue="pow 2.0"), "epilogue"),
                          (program(rows=2), "local_input"),
                          (program(cast=lambda t: t.int()), "prologue")):
        with pytest.raises(ValueError, match=f"^{argument}: "):
            make_fx(bad, tracing_mode="fake")(torch.ones(3, 5), torch.ones(3, 5))


def _ranked_buffer(spec: str):
    """The mismatch cases' setup: a 16-element float32 allocation filled with rank + 1,
    and the two mismatches of size and offset that both cases make first."""
    sm, group, device = _setup(spec, "empty", "ops")
    rank = dist.get_rank()
    buf = sm.empty(16, dtype=torch.float32, device=device)
    buf.fill_(rank + 1)
    size_and_offset = [
        # rank 2 passes fewer elements
        lambda: sm.ops.one_shot_all_reduce(buf[: 8 if rank == 2 else 9], "sum", group),
        # ranks 1 and 2 start at another offset: the lowest of them is named
        lambda: sm.ops.one_shot_all_reduce(buf[(rank > 0):][:8], "sum", group),
    ]
    return sm, group, device, rank, buf, size_and_offset


def _mismatched_calls(spec: str):
    sm, group, device, rank, buf, size_and_offset = _ranked_buffer(spec)
    fresh = sm.empty(16, dtype=torch.float32, device=device)
    fresh.fill_(rank + 1)

    calls = [
        *size_and_offset,
        # rank 1 reads the bytes as int32
        lambda: sm.ops.two_shot_all_reduce_(buf.view(torch.int32)[:8] if rank == 1
                                            else buf[:8], "max", group),
        # rank 2 asks for another reduce op
        lambda: sm.ops.two_shot_all_reduce_(buf[:8], "min" if rank == 2 else "max", group),
        # rank 1 calls two-shot where the others call one-shot
        lambda: (sm.ops.two_shot_all_reduce_(buf[:8], "sum", group) if rank == 1
                 else sm.ops.one_shot_all_reduce(buf[:8], "sum", group)),
        # the out= and pointwise variants: rank 1 passes fewer elements, rank 2 an offset
        lambda: sm.ops.one_shot_all_reduce_out(buf[: 8 if rank == 1 else 9], "sum", group,
                                               out=torch.empty(8 if rank == 1 else 9,
                                                               device=device)),
        lambda: sm.ops.one_shot_all_reduce_pointwise(buf[(rank == 2):][:8],
                                                     torch.ones(8, device=device), "sum",
                                                     group, "mul 2.0", ""),
        # no element, at another offset on rank 1 (data_ptr() is 0 for every such tensor)
        lambda: sm.ops.one_shot_all_reduce(buf[3:3] if rank == 1 else buf[2:2], "sum", group),
        # two-shot as the first call on an allocation (its rendezvous inside the call):
        # rank 2 asks for another reduce op
        lambda: sm.ops.two_shot_all_reduce_(fresh[:8], "min" if rank == 2 else "max", group),
    ]
    messages = [_refusal(call, whole=True) for call in calls]
    buf.fill_(rank + 1)  # the pointwise call wrote its input
    after = sm.ops.one_shot_all_reduce(buf[:4], "sum", group).cpu().tolist()  # still in step
    return messages, after


@pytest.mark.spec("SM-14", "SM-20")
def test_a_call_that_differs_between_ranks_fails_on_every_rank_naming_the_rank(backend):
    backend.require(CONCEPT, "empty", "ops", "pointwise_steps")  # a pointwise call too
    check_mismatches(run(backend, _mismatched_calls, 3))


def check_mismatches(results) -> None:
    """Every call of `_mismatched_calls` failed on every rank, naming the rank that
    differs, and the ranks stayed in step."""
    for rank, (messages, after) in enumerate(results):
        named = [m and m.split(";")[1].split()[1] for m in messages]
        assert named == ["2", "1", "1", "2", "1", "1", "2", "1", "2"], (rank, messages)
        assert all(m.startswith("input:") and "[SM-20]" in m for m in messages), messages
        assert "8 elements" in messages[0] and "9 elements" in messages[0]
        assert after == [6.0] * 4, "the ranks stay in step after a refused call"


def _mismatched_sums(spec: str):
    """`_mismatched_calls`'s mismatches that take only what upstream's all-reduces take
    (`sum` of float32 or bfloat16, SM-13), and a dtype that differs among those two."""
    sm, group, device, rank, buf, size_and_offset = _ranked_buffer(spec)
    calls = [
        *size_and_offset,
        # rank 1 reads the bytes as bfloat16
        lambda: sm.ops.one_shot_all_reduce(buf.view(torch.bfloat16)[:8] if rank == 1
                                           else buf[:8], "sum", group),
        # rank 1 calls two-shot where the others call one-shot
        lambda: (sm.ops.two_shot_all_reduce_(buf[:8], "sum", group) if rank == 1
                 else sm.ops.one_shot_all_reduce(buf[:8], "sum", group)),
        # the out= variant: rank 1 passes fewer elements
        lambda: sm.ops.one_shot_all_reduce_out(buf[: 8 if rank == 1 else 9], "sum", group,
                                               out=torch.empty(8 if rank == 1 else 9,
                                                               device=device)),
        # no element, at another offset on rank 1 (data_ptr() is 0 for every such tensor)
        lambda: sm.ops.one_shot_all_reduce(buf[3:3] if rank == 1 else buf[2:2], "sum", group),
    ]
    messages = [_refusal(call, whole=True) for call in calls]
    after = sm.ops.one_shot_all_reduce(buf[:4], "sum", group).cpu().tolist()  # still in step
    return messages, after


@pytest.mark.spec("SM-20")
def test_a_sum_that_differs_between_ranks_fails_on_every_rank_naming_the_rank(backend):
    """SM-20 on calls within upstream's all-reduces: every rank refuses each one, naming
    `input`, the lowest rank that differs and both calls, and the ranks stay in step."""
    backend.require(CONCEPT, "empty", "ops")
    for rank, (messages, after) in enumerate(run(backend, _mismatched_sums, 3)):
        named = [m and m.split(";")[1].split()[1] for m in messages]
        assert named == ["2", "1", "1", "1", "1", "1"], (rank, messages)
        assert all(m.startswith("input:") and "[SM-20]" in m for m in messages), messages
        assert "8 elements" in messages[0] and "9 elements" in messages[0], messages[0]
        assert "float32" in messages[2] and "bfloat16" in messages[2], messages[2]
        assert after == [6.0] * 4, "the ranks stay in step after a refused call"


def _ops_in_use(spec: str):
    sm = backend_in_rank(spec).require(CONCEPT)
    info = getattr(sm, "kernel_build_info", None)
    return info()["ops"] if info is not None else None


@pytest.mark.spec("SM-18", "SM-14", "SM-15", "SM-20")
def test_the_python_kernels_serve_cpu_with_the_same_results(backend, monkeypatch):
    """`REFIMPL_SYMM_MEM_NATIVE_OPS=0` keeps the Python kernels on CPU, as on a machine
    that cannot build the C++ ones; it is read when a rank defines the ops, so the case
    starts fresh ranks, and ends them after. Those kernels give the native cases' results:
    the sums bit for bit, every mismatch refused on every rank naming the rank. (Other
    backends ignore the variable: the case checks their ops once more.)"""
    # refimpl's kernels (SM-18), and a pointwise call among the mismatches
    backend.require(CONCEPT, "empty", "ops", "pointwise_steps", "kernel_build_info")
    _needs_the_cpu_kernels(backend)
    monkeypatch.setenv("REFIMPL_SYMM_MEM_NATIVE_OPS", "0")
    world, numel = 3, 4099
    fresh_ranks(world)
    try:
        values = run(backend, _all_reduces, world, "float32", numel)
        in_use = run(backend, _ops_in_use, world)  # the rendezvous above decided
        empty = run(backend, _all_reduces, world, "float32", 0)  # data_ptr() is 0 there
        mismatches = run(backend, _mismatched_calls, world)
    finally:
        fresh_ranks(world)  # the next case's ranks define the ops afresh
    assert set(in_use) <= {"python", None}, f"kernels in use: {in_use}"
    check_all_reduces(values, torch.float32, numel)
    check_all_reduces(empty, torch.float32, 0)
    check_mismatches(mismatches)


# dtype: numel of the all-reduces where the C++ kernels cannot be built
UNBUILT_NUMELS = {"float32": 4099, "bfloat16": 33}


def _ops_where_the_cxx_kernels_cannot_be_built(spec: str):
    """On fresh ranks: the first rendezvous builds the C++ op kernels (SM-18) into an empty
    user cache with a compiler that always fails (`false`), so the build fails, whatever
    libraries the real cache holds; the rank then runs every all-reduce."""
    saved = {k: os.environ.get(k) for k in ("CXX", "XDG_CACHE_HOME")}
    cache = tempfile.mkdtemp(prefix="refimpl-no-cxx-")
    os.environ.update(CXX="false", XDG_CACHE_HOME=cache)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # refimpl says that the build failed
            results = {d: _all_reduces(spec, d, n) for d, n in UNBUILT_NUMELS.items()}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(cache, ignore_errors=True)
    return results, _ops_in_use(spec)


@pytest.mark.spec("SM-18", "SM-15", "SM-16")
def test_the_python_kernels_serve_cpu_where_the_cxx_kernels_cannot_be_built(backend,
                                                                          monkeypatch):
    """Where the C++ kernels cannot be built, the ops' Python kernels keep serving CPU
    (they are withdrawn only once the C++ ones are ready to register): one-shot, out= and
    two-shot sums of float32 and bfloat16 are the rank-order reference on every
    rank. Fresh ranks before and after: the build is tried once per process. (Other
    backends ignore `CXX` and the cache: the case checks their ops once more.)"""
    # refimpl's kernel build (SM-18): another backend may build with CXX too
    backend.require(CONCEPT, "empty", "ops", "kernel_build_info")
    _needs_the_cpu_kernels(backend)
    monkeypatch.delenv("REFIMPL_SYMM_MEM_NATIVE_OPS", raising=False)  # the build is tried
    world = 2
    fresh_ranks(world)
    try:
        results = run(backend, _ops_where_the_cxx_kernels_cannot_be_built, world)
    finally:
        fresh_ranks(world)  # the next case's ranks load the C++ kernels again
    assert {in_use for _, in_use in results} <= {"python", None}, results
    for dtype_name, numel in UNBUILT_NUMELS.items():
        check_all_reduces([values[dtype_name] for values, _ in results],
                          getattr(torch, dtype_name), numel)


def _bounds(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(6, dtype=torch.int16, device=device)  # 12 bytes
    h = sm.rendezvous(t, group)

    peer = (rank + 1) % world
    fits = [
        tuple(h.get_buffer(peer, (6,), torch.int16).shape),
        tuple(h.get_buffer(peer, (3,), torch.int32).shape),
        tuple(h.get_buffer(peer, (2,), torch.int16, storage_offset=4).shape),
        tuple(h.get_buffer(peer, (0,), torch.int16, storage_offset=6).shape),
        tuple(h.get_signal_pad(peer, (h.signal_pad_size // 8,), torch.int64).shape),
        tuple(h.get_signal_pad(peer).shape),  # all of the pad, as uint32
        tuple(h.get_signal_pad(peer, storage_offset=10).shape),  # the rest of the pad
        tuple(h.get_signal_pad(peer, storage_offset=h.signal_pad_size // 4).shape),
    ]
    over = [
        _refusal(h.get_buffer, peer, (7,), torch.int16),
        _refusal(h.get_buffer, peer, (1,), torch.int64, storage_offset=1),
        _refusal(h.get_buffer, peer, (2,), torch.int16, storage_offset=5),
        _refusal(h.get_signal_pad, peer, (h.signal_pad_size // 4 + 1,)),
        _refusal(h.get_signal_pad, peer, (1,), torch.uint32, h.signal_pad_size // 4),
        _refusal(h.get_signal_pad, peer, storage_offset=h.signal_pad_size // 4 + 1),
        _refusal(h.get_buffer, world, (1,), torch.int16),
        _refusal(h.get_buffer, -1, (1,), torch.int16),
        _refusal(h.get_buffer, peer, (2, -1), torch.int16),  # one size negative of two
    ]
    # writes through a peer's view land in that peer's buffer
    h.barrier()
    h.get_buffer(peer, (6,), torch.int16)[5] = 100 + rank
    h.barrier()
    return fits, over, int(t[5].item()), h.signal_pad_size


@pytest.mark.spec("SM-8")
def test_buffer_and_signal_pad_views_end_exactly_at_their_bounds(backend):
    backend.require(CONCEPT, "empty", "rendezvous")
    world = 3
    for rank, (fits, over, written, pad) in enumerate(run(backend, _bounds, world)):
        assert fits == [(6,), (3,), (2,), (0,), (pad // 8,), (pad // 4,), (pad // 4 - 10,),
                        (0,)]
        assert over == ["sizes/storage_offset"] * 5 + ["storage_offset", "rank", "rank",
                                                       "sizes"]
        assert written == 100 + (rank - 1) % world


def _channels(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(world, dtype=torch.int32, device=device)
    t.zero_()
    h = sm.rendezvous(t, group)
    count = h.signal_pad_size // (4 * world)
    last = count - 1
    right, left = (rank + 1) % world, (rank - 1) % world
    h.get_buffer(right, (world,), torch.int32)[rank] = 70 + rank
    h.put_signal(right, channel=last)
    h.wait_signal(left, channel=last)
    received = int(t[left].item())
    h.barrier(channel=last)
    refused = []
    for call in (lambda: h.put_signal(right, channel=count),
                 lambda: h.wait_signal(left, channel=count),
                 lambda: h.barrier(channel=count),
                 lambda: h.put_signal(world),
                 lambda: h.wait_signal(-1)):
        try:
            call()
            refused.append(None)
        except ValueError as exc:
            refused.append(str(exc).split(":")[0])
    h.barrier()
    pad = h.get_signal_pad(rank, (h.signal_pad_size // 4,), torch.int32)
    return count, received, refused, int(pad.count_nonzero().item())


@pytest.mark.spec("SM-9")
@pytest.mark.parametrize("world", [2, 3])
def test_every_channel_up_to_the_last_works_and_one_more_is_refused(backend, world):
    backend.require(CONCEPT, "empty", "rendezvous")
    for rank, (count, received, refused, nonzero) in enumerate(run(backend, _channels, world)):
        assert count == 4096 // (4 * world)  # refimpl's pad: 341 channels for 3 ranks
        assert received == 70 + (rank - 1) % world
        assert refused == ["channel", "channel", "channel", "dst_rank", "src_rank"]
        assert nonzero == 0, "completed synchronisations leave the pad zero"


def _held_back_barriers(spec: str):
    """Each rank in turn is held back 0.3 s before it writes and enters the barrier: the
    others may only return from theirs once it entered, so they see its write."""
    sm, group, device = _setup(spec, "empty", "rendezvous", "ops")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = sm.empty(1, dtype=torch.int64, device=device)
    t.fill_(-1)
    h = sm.rendezvous(t, group)
    h.barrier()
    seen = []
    for round_ in range(2 * world):
        held = round_ % world
        if rank == held:
            time.sleep(0.3)
            t.fill_(1000 * round_ + rank)
        if round_ < world:
            h.barrier(channel=1)  # SM-10
        else:
            sm.ops.barrier(t, group, 2)  # the op, SM-17
        seen.append(int(h.get_buffer(held, (1,), torch.int64).item()))
        h.barrier(channel=3)  # nobody writes the next round before everyone has read
    return seen


@pytest.mark.spec("SM-10", "SM-17")
def test_barriers_wait_for_a_peer_that_is_held_back(backend):
    backend.require(CONCEPT, "empty", "rendezvous", "ops")
    world = 3
    want = [1000 * r + r % world for r in range(2 * world)]
    assert run(backend, _held_back_barriers, world) == [want] * world


def _held_back_signals(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous")
    rank = dist.get_rank()
    t = sm.empty(2, dtype=torch.int64, device=device)
    t.zero_()
    h = sm.rendezvous(t, group)
    h.barrier()
    if rank == 1:
        time.sleep(0.3)  # held back: rank 0 is blocked in wait_signal meanwhile
        h.get_buffer(0, (2,), torch.int64)[0] = 11
        h.put_signal(0, channel=4)
        time.sleep(0.3)  # held back again: rank 0's second put must wait for this rank
        before = int(t[1].item())
        h.wait_signal(0, channel=5)  # consumes the first put: releases rank 0's second
        h.wait_signal(0, channel=5)
        h.barrier()
        return before, int(t[1].item())
    h.wait_signal(1, channel=4)
    got = int(t[0].item())
    h.put_signal(1, channel=5)
    h.put_signal(1, channel=5)  # must wait until rank 1 consumed the first
    h.get_buffer(1, (2,), torch.int64)[1] = 22
    h.barrier()
    return got


@pytest.mark.spec("SM-9")
def test_signals_order_writes_and_a_put_waits_for_the_previous_to_be_consumed(backend):
    backend.require(CONCEPT, "empty", "rendezvous")
    got, (before, after) = run(backend, _held_back_signals, 2)
    assert got == 11, "a write before put_signal is seen after the matching wait_signal"
    assert before == 0, "the second put_signal returned before its slot was consumed"
    assert after == 22


def _read_before_return(spec: str, numel: int):
    """SM-15's second barrier: rank 1 writes its result into fresh pages (slow), rank 0 into
    warm ones and overwrites its input the moment its call returns; rank 1 must still
    have read rank 0's input, not the overwrite."""
    sm, group, device = _setup(spec, "empty", "ops")
    rank = dist.get_rank()
    t = sm.empty(numel, dtype=torch.float32, device=device)
    results = []
    warm = torch.zeros(numel, device=device)
    for round_ in range(2):
        t.fill_(rank + 1 + round_)
        out = warm if rank == 0 else torch.empty(numel, device=device)
        sm.ops.one_shot_all_reduce_out(t, "sum", group, out=out)
        if rank == 0:
            t[numel // 2:].fill_(float("nan"))  # the part a slow peer reads last
            t.fill_(float("nan"))
        results.append(bool((out == 3 + 2 * round_).all()))
        dist.barrier()
    return results


@pytest.mark.spec("SM-15")
def test_one_shot_returns_only_after_every_peer_read_its_input(backend):
    backend.require(CONCEPT, "empty", "ops")
    assert run(backend, _read_before_return, 2, 8 << 20) == [[True, True]] * 2


def _fail_stop(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous", "SymmMemTimeout", "ops")
    rank = dist.get_rank()
    t = sm.empty(4, dtype=torch.float32, device=device)
    t.fill_(1)
    h = sm.rendezvous(t, group)
    h.barrier()
    if rank == 1:
        dist.barrier()  # held back until rank 0's barrier timed out
        h.barrier(channel=1, timeout_ms=10_000)  # rank 0 did enter it: this one passes
        try:
            h.barrier(channel=1, timeout_ms=300)  # rank 0 is fail-stop: never comes
            return "returned"
        except sm.SymmMemTimeout as exc:
            return exc.peer
    try:
        h.barrier(channel=1, timeout_ms=300)
        first = None
    except sm.SymmMemTimeout as exc:
        first = (exc.peer, str(exc))
    # A fail-stop handle raises at once; one that is not waits for a peer that stays
    # away (rank 1 is held back below): a second is enough to tell the two apart.
    if hasattr(sm, "set_default_timeout"):
        sm.set_default_timeout(1_000)
    later = _later_synchronisations(sm, h, t, group, first)
    dist.barrier()  # releases rank 1
    return first[0] if first else None, "[SM-11]" in (first or ("", ""))[1], later


def _later_synchronisations(sm, h, t, group, first) -> list:
    """Each later synchronisation of a handle that should be fail-stop: (the peer its
    SymmMemTimeout names, whether it names the first timeout's message), None if it ran."""
    later = []
    for call in (lambda: h.barrier(channel=2, timeout_ms=1_000),
                 lambda: h.put_signal(1, channel=3),
                 lambda: h.wait_signal(1, channel=3, timeout_ms=1_000),
                 lambda: sm.ops.barrier(t, group),
                 lambda: sm.ops.one_shot_all_reduce(t, "sum", group),
                 lambda: sm.ops.two_shot_all_reduce_(t, "sum", group)):
        try:
            call()
            later.append(None)
        except sm.SymmMemTimeout as exc:
            later.append((exc.peer, first is not None and first[1] in str(exc)))
    return later


@pytest.mark.spec("SM-11", "SM-19")
def test_a_barrier_that_timed_out_makes_the_handle_fail_stop(backend):
    backend.require(CONCEPT, "empty", "rendezvous", "SymmMemTimeout", "ops")
    zero, one = run(backend, _fail_stop, 2)
    peer, rule, later = zero
    assert (peer, rule) == (1, True), "the barrier names the rank it waited for"
    assert later == [(1, True)] * 6, "every later synchronisation names the earlier timeout"
    assert one == 0, "rank 1's next barrier with the fail-stopped rank 0 times out naming it"


def _fail_stop_after_an_all_reduce(spec: str, op: str):
    sm, group, device = _setup(spec, "empty", "rendezvous", "SymmMemTimeout", "ops",
                               "set_default_timeout")
    rank = dist.get_rank()
    t = sm.empty(4, dtype=torch.float32, device=device)
    t.fill_(1)
    h = sm.rendezvous(t, group)
    h.barrier()
    if rank == 1:  # never calls the all-reduce; held back until rank 0 is done
        dist.barrier()
        return None
    sm.set_default_timeout(300)
    try:
        getattr(sm.ops, op)(t, "sum", group)
        first = None
    except sm.SymmMemTimeout as exc:
        first = (exc.peer, str(exc))
    sm.set_default_timeout(1_000)
    later = _later_synchronisations(sm, h, t, group, first)
    dist.barrier()  # releases rank 1
    return first[0] if first else None, later


@pytest.mark.spec("SM-19")
@pytest.mark.parametrize("op", ["one_shot_all_reduce", "two_shot_all_reduce_"])
def test_an_all_reduce_that_timed_out_makes_the_handle_fail_stop(backend, op):
    """SM-19 names the all-reduce ops beside the barrier: one that timed out may have
    signalled its peers, so every later synchronisation of the handle raises at once,
    naming that timeout and its peer, without touching a signal pad."""
    backend.require(CONCEPT, "empty", "rendezvous", "SymmMemTimeout", "ops",
                    "set_default_timeout")
    zero, one = run(backend, _fail_stop_after_an_all_reduce, 2, op)
    peer, later = zero
    assert peer == 1, f"the {op} that timed out names the rank it waited for: {zero}"
    assert later == [(1, True)] * 6, \
        f"every later synchronisation names the earlier timeout: {later}"
    assert one is None


def _op_under_the_default_timeout(spec: str, op: str):
    sm, group, device = _setup(spec, "empty", "rendezvous", "SymmMemTimeout", "ops",
                               "set_default_timeout")
    rank = dist.get_rank()
    t = sm.empty(256, dtype=torch.float32, device=device)
    t.fill_(rank + 1)
    sm.rendezvous(t, group).barrier()
    sm.set_default_timeout(300)  # after the handle exists: the ops read it at each call
    outcome = None
    if rank == 0:  # rank 1 never calls the op
        start = time.monotonic()
        try:
            getattr(sm.ops, op)(t, "sum", group)
            outcome = "returned"
        except sm.SymmMemTimeout as exc:
            outcome = (exc.peer, time.monotonic() - start < 5)
    dist.barrier()
    return outcome


@pytest.mark.spec("SM-11")
@pytest.mark.parametrize("op", ["one_shot_all_reduce", "two_shot_all_reduce_"])
def test_an_op_waits_as_long_as_the_default_timeout_set_last(backend, op):
    """The ops take no timeout: the default set just before governs their waits (here
    300 ms, where the case's own default is 15 s), whatever path runs them."""
    backend.require(CONCEPT, "empty", "rendezvous", "SymmMemTimeout", "ops",
                    "set_default_timeout")
    zero, one = run(backend, _op_under_the_default_timeout, 2, op, timeout=15,
                    restart_after=True)
    assert zero == (1, True), f"rank 0: {zero} (want a timeout naming rank 1 within 5 s)"
    assert one is None


def _python_op_under_the_default_timeout(spec: str, op: str):
    outcome = _op_under_the_default_timeout(spec, op)
    return outcome, _ops_in_use(spec)


@pytest.mark.spec("SM-11")
@pytest.mark.parametrize("op", ["one_shot_all_reduce", "two_shot_all_reduce_"])
def test_the_python_kernels_wait_as_long_as_the_default_timeout_set_last(backend, op,
                                                                         monkeypatch):
    """As the case above, on the ops' Python kernels (`REFIMPL_SYMM_MEM_NATIVE_OPS=0`,
    read when a rank defines the ops: fresh ranks before and after). Deadline: the 300 ms
    set last must end rank 0's wait within 5 s; a kernel that kept the default of the
    module's import (60 s) waits past the run's 15 s limit and fails. (Other backends
    ignore the variable: the case checks their ops once more.)"""
    backend.require(CONCEPT, "empty", "rendezvous", "SymmMemTimeout", "ops",
                    "set_default_timeout")
    _needs_the_cpu_kernels(backend)
    monkeypatch.setenv("REFIMPL_SYMM_MEM_NATIVE_OPS", "0")
    fresh_ranks(2)
    try:
        zero, one = run(backend, _python_op_under_the_default_timeout, 2, op, timeout=15,
                        restart_after=True)
    finally:
        fresh_ranks(2)  # the next case's ranks define the ops afresh
    assert {zero[1], one[1]} <= {"python", None}, f"kernels in use: {zero[1]}, {one[1]}"
    assert zero[0] == (1, True), f"rank 0: {zero[0]} (want a timeout naming rank 1 in 5 s)"
    assert one[0] is None


# The barrier op's own timeout against the default: a wait that ends by the other of the
# two ends after 5 s, where the right one ends after 300 ms; 2.5 s tells them apart on a
# loaded machine.
BARRIER_OP_DEADLINE_S = 2.5


def _barrier_op_timeouts(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous", "SymmMemTimeout", "ops",
                               "set_default_timeout")
    rank = dist.get_rank()
    t = sm.empty(4, dtype=torch.float32, device=device)
    u = sm.empty(4, dtype=torch.float32, device=device)  # t is fail-stop after its timeout
    sm.rendezvous(t, group).barrier()
    sm.rendezvous(u, group).barrier()
    outcomes = []
    if rank == 0:  # rank 1 never enters these barriers
        # (tensor, the op's timeout_ms, the default): its own 300 ms, then 0, the default
        for tensor, timeout_ms, default_ms in ((t, 300, 5_000), (u, 0, 300)):
            sm.set_default_timeout(default_ms)
            start = time.monotonic()
            try:
                sm.ops.barrier(tensor, group, 1, timeout_ms)
                outcomes.append("returned")
            except sm.SymmMemTimeout as exc:
                outcomes.append((exc.peer, time.monotonic() - start < BARRIER_OP_DEADLINE_S))
    dist.barrier()
    return outcomes


@pytest.mark.spec("SM-11")
def test_the_barrier_op_ends_by_its_own_timeout(backend):
    """The barrier op's `timeout_ms` bounds its wait as the handle's barrier's does: 300 ms
    with a default of 5 s raises `SymmMemTimeout` naming the rank that never came well
    before the default; `timeout_ms=0` waits the default (300 ms) instead."""
    backend.require(CONCEPT, "empty", "rendezvous", "SymmMemTimeout", "ops",
                    "set_default_timeout")
    zero, one = run(backend, _barrier_op_timeouts, 2, timeout=20)
    assert zero == [(1, True)] * 2, \
        f"rank 0: {zero} (want timeouts naming rank 1 within {BARRIER_OP_DEADLINE_S} s)"
    assert one == []


def _wait_timeouts_leave_the_handle_usable(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous", "SymmMemTimeout", "ops")
    rank = dist.get_rank()
    t = sm.empty(4, dtype=torch.float32, device=device)
    t.fill_(rank + 1)
    h = sm.rendezvous(t, group)
    h.barrier()
    outcomes = []
    if rank == 0:
        for call in (lambda: h.wait_signal(1, channel=6, timeout_ms=200),
                     lambda: (h.put_signal(1, channel=7), h.put_signal(1, channel=7,
                                                                         timeout_ms=200))):
            try:
                call()
                outcomes.append(None)
            except sm.SymmMemTimeout as exc:
                outcomes.append(exc.peer)
    dist.barrier()
    if rank == 1:
        h.wait_signal(0, channel=7)  # the one put that went through
    total = sm.ops.one_shot_all_reduce(t, "sum", group).cpu().tolist()
    h.barrier()
    pad = h.get_signal_pad(rank, (h.signal_pad_size // 4,), torch.int32)
    return outcomes, total, int(pad.count_nonzero().item())


@pytest.mark.spec("SM-11", "SM-19")
def test_signal_timeouts_name_the_peer_and_leave_the_handle_usable(backend):
    backend.require(CONCEPT, "empty", "rendezvous", "SymmMemTimeout", "ops")
    zero, one = run(backend, _wait_timeouts_leave_the_handle_usable, 2)
    assert zero == ([1, 1], [3.0] * 4, 0)
    assert one == ([], [3.0] * 4, 0)


def _persistent_boundaries(spec: str, alloc_id: int):
    sm, group, device = _setup(spec, "empty_strided_p2p")

    def refused(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except (RuntimeError, ValueError) as exc:
            return type(exc).__name__, str(alloc_id) in str(exc)
        return None

    new = sm.empty_strided_p2p
    shape, stride = (16,), (1,)  # the same objects each time: a request seen before
    first = new(shape, stride, torch.float32, device, group, alloc_id=alloc_id)
    first.fill_(5)
    # Each live refusal twice: the very arguments of the grant (an implementation may
    # remember a request it granted) and equal lists (a request it has not seen).
    answers = [refused(new, shape, stride, torch.float32, device, group, alloc_id=alloc_id),
               refused(new, [16], [1], torch.float32, device, group, alloc_id=alloc_id)]
    view = first[8:]
    del first
    answers += [refused(new, shape, stride, torch.float32, device, group, alloc_id=alloc_id),
                refused(new, [16], [1], torch.float32, device, group, alloc_id=alloc_id)]
    address = view.data_ptr() - 32
    del view
    answers += [refused(new, (15,), (1,), torch.float32, device, group, alloc_id=alloc_id),
                refused(new, (17,), (1,), torch.float32, device, group, alloc_id=alloc_id),
                refused(new, shape, stride, torch.float32, device, group + "-other",
                        alloc_id=alloc_id)]
    again = new((2, 8), (8, 1), torch.float32, device, group, alloc_id=alloc_id)
    same = (again.data_ptr() == address, again.flatten().tolist() == [5.0] * 16)
    del again
    # Another dtype of the same byte size, then the first layout again: each request gets
    # its own layout over the kept bytes.
    as_int = new((16,), (1,), torch.int32, device, group, alloc_id=alloc_id)
    relaid = [str(as_int.dtype), tuple(as_int.shape), as_int.data_ptr() == address,
              as_int[15].item()]
    del as_int
    back = new(shape, stride, torch.float32, device, group, alloc_id=alloc_id)
    relaid += [str(back.dtype), tuple(back.shape), back[15].item()]
    del back
    try:  # the request just granted, on a device type without an allocator
        new(shape, stride, torch.float32, torch.device("meta"), group, alloc_id=alloc_id)
        relaid.append(None)
    except ValueError as exc:
        relaid.append(str(exc).split(":")[0])
    # Lists the caller changes in place after a grant: each request is judged by the values
    # its lists hold when it is made (a remembered request must not be the caller's list).
    sizes, strides = [16], [1]
    held = new(sizes, strides, torch.float32, device, group, alloc_id=alloc_id)
    del held
    sizes[0] = 17
    changed = [refused(new, sizes, strides, torch.float32, device, group, alloc_id=alloc_id)]
    sizes[:], strides[:] = [4, 4], [1, 4]
    relaid_in_place = new(sizes, strides, torch.float32, device, group, alloc_id=alloc_id)
    changed += [tuple(relaid_in_place.shape), relaid_in_place.stride()]
    del relaid_in_place
    ends = []
    for edge in (0, 2**64 - 1):
        ends.append(new((1,), (1,), torch.int8, device, group, alloc_id=edge).numel())
    for outside in (-1, 2**64):
        try:
            new((1,), (1,), torch.int8, device, group, alloc_id=outside)
            ends.append(None)
        except ValueError as exc:
            ends.append(str(exc).split(":")[0])
    return answers, same, relaid, ends, changed


@pytest.mark.spec("SM-3", "SM-4")
def test_persistent_allocation_boundaries_and_its_three_refusals(backend):
    backend.require(CONCEPT, "empty_strided_p2p")
    results = run(backend, _persistent_boundaries, 2, 0xC0FFEE)
    five_as_int32 = struct.unpack("<i", struct.pack("<f", 5.0))[0]
    for answers, same, relaid, ends, changed in results:
        assert answers == [("RuntimeError", True)] * 4 + [("ValueError", True)] * 3
        assert same == (True, True), "the same memory, contents kept"
        assert relaid == ["torch.int32", (16,), True, five_as_int32,
                          "torch.float32", (16,), 5.0, "device"], "each request's own layout"
        assert ends == [1, 1, "alloc_id", "alloc_id"]
        assert changed == [("ValueError", True), (4, 4), (1, 4)], \
            f"requests by lists changed in place after a grant: {changed}"


def _handle_lookup_and_segments(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous", "get_symmetric_memory",
                               "leaked_segments")
    t = sm.empty(8, dtype=torch.float32, device=device)
    try:
        sm.get_symmetric_memory(t)
        before = None
    except RuntimeError:
        before = "RuntimeError"
    h = sm.rendezvous(t, group)
    same = sm.get_symmetric_memory(t[2:]) is h
    mine = [n for n in sm.leaked_segments() if f"-{os.getpid()}-" in n]
    return before, same, mine


@pytest.mark.spec("SM-6", "SM-12")
def test_the_handle_is_found_through_any_view_and_no_segment_outlives_rendezvous(backend):
    backend.require(CONCEPT, "empty", "rendezvous", "get_symmetric_memory", "leaked_segments")
    assert run(backend, _handle_lookup_and_segments, 3) == [("RuntimeError", True, [])] * 3


class _RecordingAllocator:
    """Delegates to another allocator and records the protocol methods used (SM-1)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.device_type = inner.device_type

    def empty_strided_p2p(self, *args):
        self.calls.append("empty_strided_p2p")
        return self.inner.empty_strided_p2p(*args)

    def allocation_of(self, tensor):
        self.calls.append("allocation_of")
        return self.inner.allocation_of(tensor)

    def rendezvous(self, *args):
        self.calls.append("rendezvous")
        handle = self.inner.rendezvous(*args)
        for primitive in ("_one_shot", "_two_shot", "_barrier"):
            kernel = getattr(handle, primitive)

            def recorded(*a, _kernel=kernel, _name=primitive):
                self.calls.append(_name)
                return _kernel(*a)
            setattr(handle, primitive, recorded)
        return handle


def _through_the_registry(spec: str):
    sm, group, device = _setup(spec, "empty", "empty_strided_p2p", "ops", "get_allocator",
                               "register_allocator")
    rank = dist.get_rank()
    own = sm.get_allocator(device.type)
    warm = sm.empty(4, dtype=torch.float32, device=device)  # the own allocator's, in use
    warm.fill_(rank + 1)
    sm.ops.one_shot_all_reduce(warm, "sum", group)
    request = ((4,), (1,), torch.float32, device, group, 0x5152)
    sm.empty_strided_p2p(*request)  # granted by the own allocator, then dropped
    # The allocator asked directly for another layout of that id: the request repeated
    # through the module still gets its own layout.
    own.empty_strided_p2p((2, 2), (2, 1), torch.float32, device, group, 0x5152)
    relaid = tuple(sm.empty_strided_p2p(*request).shape)
    recording = _RecordingAllocator(own)
    sm.register_allocator(device.type, recording)
    try:
        persistent = tuple(sm.empty_strided_p2p(*request).shape) == (4,)
        asked = {"persistent": list(recording.calls)}
        recording.calls.clear()
        warm_total = sm.ops.one_shot_all_reduce(warm, "sum", group).cpu().tolist()
        sm.ops.two_shot_all_reduce_(warm, "sum", group)
        asked["warm"] = list(recording.calls)
        recording.calls.clear()
        t = sm.empty(4, dtype=torch.float32, device=device)
        t.fill_(rank + 1)
        total = sm.ops.one_shot_all_reduce(t, "sum", group).cpu().tolist()
        sm.ops.two_shot_all_reduce_(t, "sum", group)
        sm.ops.barrier(t, group)
        asked["new"] = list(recording.calls)
    finally:
        sm.register_allocator(device.type, own)
    return relaid, persistent, warm_total, warm.cpu().tolist(), total, t.cpu().tolist(), asked


@pytest.mark.spec("SM-1")
def test_functions_and_ops_use_the_allocator_registered_now(backend):
    """An allocator registered for the device type serves every later call: tensors made
    by the one it replaced (ops still ask it `allocation_of`), a persistent request the
    replaced one granted before (asked again), and new tensors (every kernel through the
    handle it rendezvoused). Before that, the allocator asked directly for another
    layout of a persistent id does not change what the repeated request gets."""
    backend.require(CONCEPT, "empty", "empty_strided_p2p", "ops", "get_allocator",
                    "register_allocator")
    for rank, got in enumerate(run(backend, _through_the_registry, 2)):
        relaid, persistent, warm_total, warm, total, t, asked = got
        assert relaid == (4,), (rank, relaid)
        assert persistent and asked["persistent"] == ["empty_strided_p2p"], (rank, asked)
        assert warm_total == [3.0] * 4 and warm == [3.0] * 4, rank
        assert asked["warm"].count("allocation_of") >= 2, (rank, asked)
        assert total == [3.0] * 4 and t == [3.0] * 4, rank
        assert asked["new"][:2] == ["empty_strided_p2p", "allocation_of"], (rank, asked)
        assert asked["new"].count("rendezvous") == 1, (rank, asked)
        assert {"_one_shot", "_two_shot", "_barrier"} <= set(asked["new"]), (rank, asked)


# --------------------------------------------------------------------------------------
# Local rules: no ranks needed
# --------------------------------------------------------------------------------------
@pytest.mark.spec("SM-6")
def test_is_symm_mem_tensor_knows_its_allocations_and_nothing_else(backend):
    sm = backend.require(CONCEPT, "empty", "is_symm_mem_tensor")
    device = torch.device(getattr(sm, "DEVICE", "cpu"))
    t = sm.empty(8, device=device)
    assert sm.is_symm_mem_tensor(t) and sm.is_symm_mem_tensor(t[3:5])
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        view = sm.empty(8, dtype=dtype, device=device)[2:]  # the tensor handed out is gone
        assert sm.is_symm_mem_tensor(view), f"a {dtype} view that outlived its tensor"
        assert sm.is_symm_mem_tensor(view[2:].view(2, 2)), f"a view of that view, {dtype}"
    assert not sm.is_symm_mem_tensor(torch.empty(8, device=device))
    assert not sm.is_symm_mem_tensor(torch.empty(8, device="meta"))  # no allocator: False


@pytest.mark.spec("SM-1")
def test_a_device_type_without_an_allocator_is_refused_naming_device(backend):
    sm = backend.require(CONCEPT, "get_allocator", "empty")
    assert sm.get_allocator("cpu") is not None
    for call in (lambda: sm.get_allocator("meta"), lambda: sm.empty(4, device="meta")):
        with pytest.raises(ValueError, match=r"^device: .*'meta'"):
            call()


def _cuda_asked_for_where_torch_sees_none(spec: str):
    sm = backend_in_rank(spec).require(CONCEPT, "get_allocator", "empty")
    # What torch answers on a machine without a GPU; this rank process ends after the case.
    torch.cuda.is_available = lambda: False
    package = sm.get_allocator.__module__.split(".")[0]
    before = set(sys.modules)
    refused = [_refusal(sm.get_allocator, "cuda"), _refusal(sm.empty, 4, device="cuda")]
    imported = sorted(m for m in set(sys.modules) - before if m.split(".")[0] == package)
    return refused, imported


@pytest.mark.spec("SM-1", "SM-21")
def test_a_device_type_torch_does_not_see_imports_no_backend(backend):
    """Where torch sees no CUDA device, asking for a `cuda` allocator (directly or by
    allocating) is refused naming `device` and imports nothing of the backend's package
    (its CUDA backend is imported only where torch sees such a device). Run on a fresh
    single rank, before and after, whose torch is told it sees no GPU: so the case means
    the same on a machine with one, where earlier cases may have loaded that backend."""
    backend.require(CONCEPT, "get_allocator", "empty")
    fresh_ranks(1)
    try:
        [(refused, imported)] = run(backend, _cuda_asked_for_where_torch_sees_none, 1)
    finally:
        fresh_ranks(1)
    assert refused == ["device", "device"], refused
    assert imported == [], f"asking for 'cuda' without a CUDA device imported {imported}"


@pytest.mark.spec("SM-11")
def test_the_default_timeout_is_a_positive_int(backend):
    sm = backend.require(CONCEPT, "set_default_timeout")
    before = sm.set_default_timeout(CASE_TIMEOUT_MS)
    try:
        refused = [_refusal(sm.set_default_timeout, bad) for bad in (0, -1, 1.5, "5", True)]
        assert refused == ["timeout_ms"] * 5, refused
        assert sm.set_default_timeout(1) == CASE_TIMEOUT_MS  # the least, and the previous
    finally:
        sm.set_default_timeout(before)


def _open_files(shm: str) -> tuple[int, int]:
    """Descriptors of shared-memory files, and of directories (one opened to name a
    segment and left open leaks too): nothing else of the process counts."""
    import gc

    gc.collect()
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile (listdir's own descriptor)
            pass
    return (sum(name.startswith(shm) for name in names),
            sum(os.path.isdir(name) for name in names if name.startswith("/")))


def _rendezvous_rounds(spec: str):
    sm, group, device = _setup(spec, "empty", "rendezvous")
    shm = getattr(sm, "SHM_DIR", "/dev/shm")

    def round_():
        t = sm.empty(64, device=device)
        sm.rendezvous(t, group).barrier()

    round_()  # whatever a first rendezvous sets up for good
    before = _open_files(shm)
    for _ in range(5):
        round_()
    dist.barrier()
    after = _open_files(shm)
    return before == after or (before, after)


@pytest.mark.spec("SM-12")
def test_rendezvous_of_dropped_allocations_leaves_no_descriptor_open(backend):
    backend.require(CONCEPT, "empty", "rendezvous")
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd (Linux) to count open files")
    assert run(backend, _rendezvous_rounds, 2) == [True, True]


@pytest.mark.spec("SM-12")
def test_a_dropped_allocation_closes_its_file(backend):
    sm = backend.require(CONCEPT, "empty")
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd (Linux) to count open files")
    shm = getattr(sm, "SHM_DIR", "/dev/shm")
    device = torch.device(getattr(sm, "DEVICE", "cpu"))
    if device.type != "cpu":
        pytest.skip("a file per allocation is the CPU allocator's (SM-12)")
    sm.empty(4, device=device)  # whatever a first allocation sets up for good
    before = _open_files(shm)
    for _ in range(20):
        t = sm.empty(64, device=device)
        view = t[8:]
        del t
        del view  # the last tensor over the allocation
    assert _open_files(shm) == before


@pytest.mark.spec("SM-2")
def test_group_info_bounds(backend):
    sm = backend.require(CONCEPT, "set_group_info", "is_symm_mem_enabled_for_group")
    store = dist.HashStore()
    name = f"bounds-{time.monotonic_ns()}"
    sm.set_group_info(name + "-64", 63, 64, store)
    sm.set_group_info(name + "-1", 0, 1, store)
    assert sm.is_symm_mem_enabled_for_group(name + "-64")
    for rank, world, arg in ((0, 65, "world_size"), (0, 0, "world_size"), (3, 3, "rank"),
                             (-1, 3, "rank")):
        with pytest.raises(ValueError, match=rf"^{arg}: "):
            sm.set_group_info(f"{name}-{rank}-{world}", rank, world, store)
    with pytest.raises(ValueError, match=r"already set"):
        sm.set_group_info(name + "-1", 0, 1, store)
    with pytest.raises(TypeError, match=r"^store: "):
        sm.set_group_info(name + "-store", 0, 1, "not a store")
    assert not sm.is_symm_mem_enabled_for_group(f"{name}-0-65")


@pytest.mark.spec("SM-3")
def test_allocation_arguments_are_refused_naming_them(backend):
    sm = backend.require(CONCEPT, "empty", "empty_strided_p2p")
    device = torch.device(getattr(sm, "DEVICE", "cpu"))
    t = sm.empty(2, 3, dtype=torch.float16, device=device)
    assert (tuple(t.shape), t.dtype, t.is_contiguous()) == ((2, 3), torch.float16, True)
    s = sm.empty_strided_p2p((3, 2), (1, 3), torch.float32, device)
    assert s.stride() == (1, 3) and s.untyped_storage().nbytes() == 24
    # A stride of 0 (a broadcast row) is a layout too: it spans one row.
    b = sm.empty_strided_p2p((2, 3), (0, 1), torch.float32, device)
    assert b.stride() == (0, 1) and b.untyped_storage().nbytes() == 12
    assert sm.empty(0, 4, device=device).numel() == 0
    # No element, whichever dim is 0: at most one element of storage (a minimum an
    # implementation may keep), not the span of the other dims.
    for size in ((0, 4), (4, 0), (3, 0, 5)):
        nbytes = sm.empty(*size, device=device).untyped_storage().nbytes()
        assert nbytes <= 4, f"an empty {size} float32 tensor holds {nbytes} bytes"
    assert tuple(sm.empty((2, 3), device=device).shape) == (2, 3)  # a size sequence, as
    assert tuple(sm.empty([4], device=device).shape) == (4,)  # torch.empty takes one
    for call, arg in ((lambda: sm.empty(-1, 2, device=device), "size"),
                      (lambda: sm.empty(3, -2, device=device), "size"),
                      (lambda: sm.empty_strided_p2p((2,), (1, 1), torch.float32, device),
                       "stride"),
                      (lambda: sm.empty_strided_p2p((2, 2), (2, -1), torch.float32, device),
                       "stride"),  # one stride negative of two
                      # An empty stride is of another length too (only a 0-d size has
                      # none): not "derive the strides", which is `empty`'s business.
                      (lambda: sm.empty_strided_p2p((2, 3), (), torch.float32, device),
                       "stride"),
                      (lambda: sm.empty(2**62, dtype=torch.float32, device=device), "size")):
        with pytest.raises(ValueError, match=rf"^{arg}: .*\[SM-3\]"):
            call()
    with pytest.raises(TypeError, match=r"^dtype: "):
        sm.empty_strided_p2p((1,), (1,), "float32", device)


@pytest.mark.spec("SM-13")
def test_op_schemas_and_fake_kernels(backend):
    sm = backend.require(CONCEPT, "ops")
    ns = sm.ops
    if not hasattr(ns.one_shot_all_reduce, "default"):
        raise NotImplementedConcept(f"{backend.name}: symmetric_memory.ops are Python "
                                    f"functions, not torch operators with a schema")
    schemas = {name: str(getattr(ns, name).default._schema).split("::", 1)[1]
               for name in ("one_shot_all_reduce", "one_shot_all_reduce_out",
                            "two_shot_all_reduce_", "barrier")}
    assert schemas == {
        "one_shot_all_reduce": "one_shot_all_reduce(Tensor input, str reduce_op, "
                               "str group_name) -> Tensor",
        "one_shot_all_reduce_out": "one_shot_all_reduce_out(Tensor input, str reduce_op, "
                                   "str group_name, *, Tensor(a!) out) -> Tensor(a!)",
        "two_shot_all_reduce_": "two_shot_all_reduce_(Tensor(a!) input, str reduce_op, "
                                "str group_name) -> Tensor(a!)",
        "barrier": "barrier(Tensor(a!) input, str group_name, int channel=0, "
                   "int timeout_ms=0) -> ()",
    }
    from torch.fx.experimental.proxy_tensor import make_fx

    def program(x):
        y = ns.one_shot_all_reduce(x, "sum", "no-such-group")  # fake: nothing communicates
        return ns.two_shot_all_reduce_(y, "avg", "no-such-group") + 1

    gm = make_fx(program, tracing_mode="fake")(torch.ones(3, 5))
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert tuple(out.meta["val"].shape) == (3, 5)
    for bad in (lambda x: ns.one_shot_all_reduce(x, "prod", "g"),
                lambda x: ns.two_shot_all_reduce_(x.int(), "avg", "g"),
                lambda x: ns.one_shot_all_reduce_out(x, "sum", "g", out=x[:2])):
        with pytest.raises(ValueError):
            make_fx(bad, tracing_mode="fake")(torch.ones(3))


def _build_info_around_a_first_rendezvous(spec: str):
    sm, group, device = _setup(spec, "kernel_build_info", "empty", "rendezvous")
    before = sm.kernel_build_info()
    t = sm.empty(4, dtype=torch.float32, device=device)
    sm.rendezvous(t, group)
    return before, sm.kernel_build_info()


@pytest.mark.spec("SM-18")
def test_the_kernels_in_use_are_built_from_this_source(backend):
    """Fresh ranks: nothing is built or loaded at import (the Python kernels serve until
    then); the first rendezvous loads the C kernels, built from this very source, and
    decides for good which kernels serve the ops on CPU."""
    backend.require(CONCEPT, "kernel_build_info", "empty", "rendezvous")
    _needs_the_cpu_kernels(backend)
    world = 2
    fresh_ranks(world)
    try:
        results = run(backend, _build_info_around_a_first_rendezvous, world)
    finally:
        fresh_ranks(world)
    for rank, (before, after) in enumerate(results):
        assert before["c_library"]["stamped"] is None, (rank, "a C library loaded at import")
        assert before["ops"] == "unloaded", (rank, f"op kernels loaded at import: {before}")
        assert after["c_library"]["stamped"] == after["c_library"]["source"], (rank, after)
        assert after["ops"] in ("native", "python"), (rank, "a rendezvous did not load them")
        if after["ops"] == "native":
            assert after["native_library"]["source"] in after["native_library"]["path"]


# ---- SM-15 at the edge of the 16-bit floats' range ---------------------------------------
_F16_MAX, _BF16_MAX, _INF = 65504.0, torch.finfo(torch.bfloat16).max, float("inf")
# Per element: the inputs of ranks 0, 1 and 2, then the sum of a group of two and of three.
# The float32 sum is rounded once, to nearest with ties to even as torch's conversion: a
# float16 sum below 65520 (half a step past the largest half, 65504) is 65504, from 65520
# on it is inf; bfloat16's midpoint lies 2**119 past its largest value.
RANGE_EDGES = {
    "float16": [
        (_F16_MAX, 0.0, 0.0, _F16_MAX, _F16_MAX),
        (_F16_MAX, 8.0, 0.0, _F16_MAX, _F16_MAX),  # 65512: nearer 65504 than inf
        (_F16_MAX, 15.75, 0.0, _F16_MAX, _F16_MAX),  # just below the midpoint
        (_F16_MAX, 16.0, 0.0, _INF, _INF),  # 65520, the midpoint: ties to even, inf
        (_F16_MAX, 8.0, 8.0, _F16_MAX, _INF),  # the third rank takes it to 65520
        (_F16_MAX, 32.0, 0.0, _INF, _INF),  # 65536
        (_F16_MAX, 4096.0, 0.0, _INF, _INF),
        (_F16_MAX, _F16_MAX, -_F16_MAX, _INF, _F16_MAX),  # back in range: float32 holds it
        (_F16_MAX, _F16_MAX, _F16_MAX, _INF, _INF),  # past 2**17
        (-_F16_MAX, -15.75, 0.0, -_F16_MAX, -_F16_MAX),
        (-_F16_MAX, -16.0, 0.0, -_INF, -_INF),
        (60000.0, 5512.0, 0.0, _F16_MAX, _F16_MAX),  # 65512 from other addends
        (32768.0, 32752.0, 0.0, _INF, _INF),  # 65520 from other addends
    ],
    "bfloat16": [
        (_BF16_MAX, 0.0, 0.0, _BF16_MAX, _BF16_MAX),
        (_BF16_MAX, 2.0**118, 0.0, _BF16_MAX, _BF16_MAX),  # below the midpoint
        (_BF16_MAX, 2.0**119, 0.0, _INF, _INF),  # the midpoint: ties to even, inf
        (_BF16_MAX, _BF16_MAX, -_BF16_MAX, _INF, _INF),  # float32 itself overflows
        (-_BF16_MAX, -(2.0**119), 0.0, -_INF, -_INF),
    ],
}


def _edge_input(rank: int, dtype_name: str) -> torch.Tensor:
    rows = RANGE_EDGES[dtype_name]
    return torch.tensor([row[rank] for row in rows], dtype=getattr(torch, dtype_name))


def _range_edges(spec: str):
    sm, group, device = _setup(spec, "empty", "ops")
    rank = dist.get_rank()
    results = {}
    for dtype_name in RANGE_EDGES:
        data = _edge_input(rank, dtype_name)
        x = sm.empty(len(data), dtype=data.dtype, device=device)
        for op in ("sum", "avg"):
            x.copy_(data.to(device))
            one = sm.ops.one_shot_all_reduce(x, op, group).cpu()
            out = torch.empty_like(x)
            sm.ops.one_shot_all_reduce_out(x, op, group, out=out)
            sm.ops.two_shot_all_reduce_(x, op, group)
            results[dtype_name, op] = (one, out.cpu(), x.cpu().clone())
    return results


@pytest.mark.spec("SM-15", "SM-16")
@pytest.mark.parametrize("world", [2, 3])
def test_16_bit_sums_at_the_edge_of_the_range_round_as_torch_does(backend, world):
    """Sums that land on, just past or far past the largest float16 (and bfloat16) value:
    below the midpoint to the next power they round to the largest value, from it on to
    inf, bitwise torch's conversion of the float32 sum; a sum that leaves the range and
    comes back (accumulated in float32) is finite; avg divides the float32 sum first."""
    backend.require(CONCEPT, "empty", "ops")
    results = run(backend, _range_edges, world)
    for dtype_name, rows in RANGE_EDGES.items():
        inputs = [_edge_input(r, dtype_name) for r in range(world)]
        for op in ("sum", "avg"):
            want = _rank_order(inputs, op)
            if op == "sum":  # the reference is the rule stated above
                assert want.tolist() == [row[world + 1] for row in rows], (dtype_name, want)
            for rank in range(world):
                for name, got in zip(("one-shot", "one-shot out=", "two-shot"),
                                     results[rank][dtype_name, op], strict=True):
                    assert _same_bits(got, want), \
                        f"{name} {dtype_name} {op} on rank {rank}: {got} != {want}"


# ---- SM-11: a wait asleep on a slot is woken when the peer changes it ---------------------
WAKE_ROUNDS = 9
HELD_S = 0.005  # far past SM-11's spin and yield phases (2 us, 1 ms): the waiter sleeps
WOKEN_WITHIN_S = 0.02


def _sleepers_woken(spec: str):
    """Rank 0 waits for a signal that rank 1 puts HELD_S later; then rank 1 waits in a
    second put until rank 0, HELD_S later, consumes the first. Each round starts at a gloo
    barrier (not the signal pads, whose own waits a lost wake-up would skew). The times
    at which each side acted: time.monotonic, one clock for every process of the host."""
    sm, group, device = _setup(spec, "empty", "rendezvous")
    rank = dist.get_rank()
    t = sm.empty(4, dtype=torch.float32, device=device)
    h = sm.rendezvous(t, group)
    h.barrier()
    stamps = []
    for _ in range(WAKE_ROUNDS):  # the consumer sleeps
        dist.barrier()
        if rank == 1:
            time.sleep(HELD_S)
            stamps.append(time.monotonic())  # the signal comes
            h.put_signal(0, channel=1, timeout_ms=10_000)
        else:
            h.wait_signal(1, channel=1, timeout_ms=10_000)
            stamps.append(time.monotonic())  # the wait returned
    for _ in range(WAKE_ROUNDS):  # the producer sleeps
        dist.barrier()
        if rank == 1:
            h.put_signal(0, channel=2, timeout_ms=10_000)
            h.put_signal(0, channel=2, timeout_ms=10_000)  # waits for the first's consumer
            stamps.append(time.monotonic())  # the put returned
        else:
            time.sleep(HELD_S)
            stamps.append(time.monotonic())  # the first signal is consumed
            h.wait_signal(1, channel=2, timeout_ms=10_000)
            h.wait_signal(1, channel=2, timeout_ms=10_000)
    h.barrier()
    return stamps


@pytest.mark.spec("SM-11", "SM-9")
def test_a_sleeping_wait_is_woken_by_the_signal_not_by_its_own_timer(backend):
    """A wait that has slept on its slot for milliseconds returns within moments of the
    peer's change of the slot (SM-11's futex: the side that changes the slot wakes the
    sleeper), both a wait for a signal and a put that waits for the slot to be consumed.
    Medians of WAKE_ROUNDS rounds: a sleeper left to wake on its own sleep's end
    (refimpl's sleeps last up to 50 ms) returns tens of milliseconds late."""
    backend.require(CONCEPT, "empty", "rendezvous")
    zero, one = run(backend, _sleepers_woken, 2)
    consumer = sorted(zero[k] - one[k] for k in range(WAKE_ROUNDS))
    producer = sorted(one[k] - zero[k] for k in range(WAKE_ROUNDS, 2 * WAKE_ROUNDS))
    middle = WAKE_ROUNDS // 2
    assert consumer[middle] < WOKEN_WITHIN_S, \
        f"wait_signal returned {consumer[middle] * 1e3:.1f} ms after the put (median)"
    assert producer[middle] < WOKEN_WITHIN_S, \
        f"put_signal returned {producer[middle] * 1e3:.1f} ms after the wait (median)"


# ---- SM-14, SM-24: every kernel refuses a shape, numel or dtype that does not match -------
def _same_numel_other_shape(spec: str):
    sm, group, device = _setup(spec, "empty", "ops", "pointwise_steps", "rendezvous")
    f = sm.empty(8, device=device)
    b = sm.empty(8, dtype=torch.bfloat16, device=device)
    for allocation in (f, b):  # no call is a first use: each meets a kernel's fast path
        sm.rendezvous(allocation, group)
        allocation.fill_(3.0)
    call, out_call = sm.ops.one_shot_all_reduce_pointwise, sm.ops.one_shot_all_reduce_out

    def ones(*size, dtype=torch.float32):
        return torch.ones(*size, dtype=dtype, device=device)
    answers = [
        # local_input: as many elements as symm_buffer, another shape or dtype
        _refusal(call, f[:4], ones(2, 2), "sum", group, "", ""),
        _refusal(call, f[:4].view(2, 2), ones(4), "sum", group, "", ""),
        _refusal(call, f[:4], ones(4, 1), "sum", group, "mul 2.0", "add 1.0"),
        _refusal(call, b[:4], ones(4, dtype=torch.float16), "sum", group, "", ""),
        _refusal(call, f[:4], ones(4, dtype=torch.int32), "sum", group, "", ""),
        # out: as many elements as the input, another shape or dtype
        _refusal(out_call, f[:4], "sum", group, out=ones(2, 2)),
        _refusal(out_call, f[:4].view(2, 2), "sum", group, out=ones(4)),
        _refusal(out_call, b[:4], "sum", group, out=ones(4, dtype=torch.float16)),
        _refusal(out_call, f[:4], "sum", group, out=ones(4, dtype=torch.int32)),
    ]
    # Refused before the prologue wrote the buffer and before any wait: still in step.
    after = sm.ops.one_shot_all_reduce(f[:4], "sum", group).cpu().tolist()
    return answers, after


@pytest.mark.spec("SM-24", "SM-14", "SM-18")
def test_a_matching_numel_of_another_shape_or_dtype_is_refused_by_every_kernel(backend):
    """`local_input` of `symm_buffer`'s element count and width but another shape or dtype,
    and such an `out`, are refused naming the argument on the fast path too (SM-18: a
    native kernel hands such a call to the Python one rather than run it)."""
    backend.require(CONCEPT, "empty", "ops", "pointwise_steps", "rendezvous")
    for rank, (answers, after) in enumerate(run(backend, _same_numel_other_shape, 2)):
        assert answers == ["local_input"] * 5 + ["out"] * 4, f"rank {rank}: {answers}"
        assert after == [6.0] * 4, f"rank {rank}: a refused call wrote the buffer: {after}"


# ---- SM-12: a failed rendezvous unlinks the names of peers that cannot ----------------------
def _peer_stopped_after_publishing(spec: str, sizes_differ: bool):
    """Rank 1 starts a rendezvous and is stopped (SIGSTOP) once its segment is named and
    published, as a rank that died there; rank 0 then fails its rendezvous (unequal sizes,
    or rank 1 never reports its mappings) and must have unlinked rank 1's name as well as
    its own. Rank 1, continued, fails too and cleans up what is left."""
    import signal

    sm, _, device = _setup(spec, "empty", "rendezvous", "SymmMemTimeout", "leaked_segments")
    rank = dist.get_rank()
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    # A group of its own: its ranks end out of step, and no later case uses it.
    pg = dist.new_group(list(range(dist.get_world_size())))
    sm.enable_symm_mem_for_group(pg.group_name)
    t = sm.empty(4 + (rank if sizes_differ else 0), dtype=torch.float32, device=device)

    def ours():
        return [n for n in sm.leaked_segments() if any(f"-{pid}-" in n for pid in pids)]

    dist.barrier()
    outcome, left = None, None
    if rank == 1:
        try:
            sm.rendezvous(t, pg.group_name, timeout_ms=60_000)  # stopped in here
        except Exception as exc:  # what a rank finds its peer's segments gone is its own
            outcome = type(exc).__name__
    else:
        deadline = time.monotonic() + 30
        while not any(f"-{pids[1]}-" in n for n in ours()) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.0)  # the name is published to the store right after it is linked
        os.kill(pids[1], signal.SIGSTOP)
        try:
            try:
                sm.rendezvous(t, pg.group_name, timeout_ms=2_000)
            except (ValueError, sm.SymmMemTimeout) as exc:
                outcome = type(exc).__name__, getattr(exc, "peer", None)
            left = ours()  # rank 1 cannot unlink its own name meanwhile
        finally:
            os.kill(pids[1], signal.SIGCONT)
    dist.barrier()  # rank 1's rendezvous has ended
    mine = [n for n in sm.leaked_segments() if f"-{os.getpid()}-" in n]
    dist.destroy_process_group(pg)
    return outcome, left, mine


@pytest.mark.spec("SM-12", "SM-5", "SM-11")
@pytest.mark.parametrize("sizes_differ", [True, False], ids=["unequal_sizes", "timeout"])
def test_a_failed_rendezvous_unlinks_the_names_of_a_stopped_peer(backend, sizes_differ):
    sm = backend.require(CONCEPT, "empty", "rendezvous", "SymmMemTimeout", "leaked_segments")
    if torch.device(getattr(sm, "DEVICE", "cpu")).type != "cpu":
        pytest.skip("segments under /dev/shm are the CPU allocator's (SM-12)")
    results = run(backend, _peer_stopped_after_publishing, 2, sizes_differ, restart_after=True)
    (outcome, left, mine), (peer_outcome, _, peer_mine) = results
    assert outcome == (("ValueError", None) if sizes_differ else ("SymmMemTimeout", 1)), \
        outcome
    assert left == [], f"rank 0's failed rendezvous left {left} [SM-12]"
    assert peer_outcome is not None, "rank 1's rendezvous succeeded without rank 0"
    if sizes_differ:
        assert peer_outcome == "ValueError", peer_outcome
    assert mine == [] and peer_mine == [], (mine, peer_mine)


# --------------------------------------------------------------------------------------
# Invariants from upstream's own bug reports (issue 47)
# --------------------------------------------------------------------------------------
def _nth_rendezvous_maps_nth_allocations(spec: str, numel: int):
    """Every rank allocates five buffers of one size, each filled with (its rank, its
    number), drops the second before the fifth is made (an allocator may hand its place
    out again) and rendezvouses the other four in the order it made them. Rank 0 alone
    first makes and drops one more buffer and keeps a spare: its allocator starts in
    another state than its peers' (pytorch/pytorch#190977: a rank that used more memory
    first); it also comes late to each rendezvous, so its peers wait there first and
    must meet what it posts for this one, not for an earlier one. For each handle, the
    number found in every peer's buffer."""
    sm, group, device = _setup(spec, "empty", "rendezvous")
    rank, world = dist.get_rank(), dist.get_world_size()
    spare = []
    if rank == 0:
        dropped = sm.empty(numel, dtype=torch.float32, device=device)
        del dropped
        spare.append(sm.empty(numel, dtype=torch.float32, device=device))
    made = {}
    for number in range(5):
        if number == 4:
            del made[1]  # its place is free before the fifth is made
        t = sm.empty(numel, dtype=torch.float32, device=device)
        t.fill_(100.0 * rank + number)
        made[number] = t
    found = []
    for number in sorted(made):
        if rank == 0:  # late to each: its peers wait first, and must meet this one's post
            time.sleep(0.05)
        h = sm.rendezvous(made[number], group)
        h.barrier()
        found.append([h.get_buffer(peer, (numel,), torch.float32).cpu().unique().tolist()
                      for peer in range(world)])
        h.barrier()
    return found


@pytest.mark.spec("SM-5")
@pytest.mark.parametrize("world", [2, 3])
def test_the_nth_rendezvous_maps_every_peers_nth_allocation(backend, world):
    """pytorch/pytorch#190977, #198024: ranks rendezvous their allocations in one order,
    and the n-th handle MUST map, on every rank, every peer's buffer of that n-th
    rendezvous, whatever each rank's allocator did before (a dropped buffer's place given
    out again, a rank whose allocator started elsewhere): no handle may map a peer's
    other buffer of the same size (silent wrong sums)."""
    backend.require(CONCEPT, "empty", "rendezvous")
    numbers = [0, 2, 3, 4]
    for rank, found in enumerate(run(backend, _nth_rendezvous_maps_nth_allocations, world,
                                     1024)):
        want = [[[100.0 * peer + n] for peer in range(world)] for n in numbers]
        assert found == want, f"rank {rank}: handle n maps, per peer, {found}; want {want}"


def _ring_of_signals(spec: str, rounds: int, numel: int):
    """A ring handshake: each round, every rank writes the round's values into its right
    neighbour's buffer through get_buffer, signals it, waits for its left neighbour's
    signal and reads what that neighbour wrote, then signals back that it read (so the
    next round's write cannot overtake the read). The rounds whose read was not exactly
    the left neighbour's write."""
    t, h, rank, world, right, left = _zeroed_ring(spec, numel, torch.int64)
    target = h.get_buffer(right, (numel,), torch.int64)
    steps = torch.arange(numel, dtype=torch.int64, device=t.device)
    wrong = []
    for round_ in range(rounds):
        target.copy_(steps + (round_ * world + rank) * numel)
        h.put_signal(right, channel=0)
        h.wait_signal(left, channel=0)
        want = steps + (round_ * world + left) * numel
        if not torch.equal(t, want):
            wrong.append(round_)
        h.put_signal(left, channel=1)  # read: the left neighbour may write again
        h.wait_signal(right, channel=1)
    h.barrier()
    return wrong


@pytest.mark.spec("SM-9")
@pytest.mark.parametrize("world", [2, 4])
def test_signals_order_every_write_of_a_ring_handshake(backend, world):
    """pytorch/pytorch#191858's invariant, as a ring: every write a rank makes into its
    neighbour's buffer before put_signal is seen, all of it (64 KiB, past one cache
    line or page), by the neighbour's read after the matching wait_signal, in each of 200
    rounds, on every rank."""
    backend.require(CONCEPT, "empty", "rendezvous")
    for rank, wrong in enumerate(run(backend, _ring_of_signals, world, 200, 8192)):
        assert wrong == [], f"rank {rank}: rounds whose read missed the write: {wrong[:10]}"
