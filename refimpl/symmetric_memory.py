"""Symmetric memory: buffers that every rank of a group can read and write directly.

A symmetric allocation is one buffer per rank, of the same size, that all ranks of a
group map into their address space, together with a small *signal pad* per rank for
synchronisation. `empty_strided_p2p` / `empty` allocate the local buffer (SM-3, SM-4);
the collective `rendezvous` exchanges the segments through the group's c10d store and
returns a `SymmetricMemory` handle (SM-5..SM-7) that gives tensors on any peer's buffer,
signals, and barriers with timeouts that name the late peer (SM-8..SM-11). The CPU
backend keeps each allocation in a POSIX shared-memory segment under /dev/shm that is
unlinked as soon as every peer mapped it (SM-12). The `refimpl_symm_mem` op library
runs one-shot and two-shot all-reduce and a barrier through these buffers with C
kernels (`kernels/cpu/symm_mem.c`, SM-13..SM-18). A timed-out synchronisation makes its
handle fail-stop (SM-19); an all-reduce checks that every rank made the same call
(SM-20); CUDA devices get an allocator and kernels of their own (SM-21..SM-23) in
refimpl/_symm_mem_cuda.py, which registers itself where torch sees a GPU (the package
imports it there; this module imports no backend).
`one_shot_all_reduce_pointwise` applies chains of add/sub/mul by a number to the input
as it writes the buffer and to the result (SM-24), for lowering's fusion (CL-17).

Implements SPEC.md section "6. Symmetric memory": SM-1 .. SM-24.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import importlib
import json
import math
import mmap
import os
import secrets
import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from refimpl import _native
from refimpl._errors import expected_got, refuse, require_type
from refimpl._native import build_torch_op_library, load_kernel_library

__all__ = [
    "SymmetricMemory", "SymmMemTimeout", "register_allocator", "get_allocator",
    "set_group_info", "enable_symm_mem_for_group", "is_symm_mem_enabled_for_group",
    "empty_strided_p2p", "empty", "rendezvous", "get_symmetric_memory", "is_symm_mem_tensor",
    "set_default_timeout", "leaked_segments", "ops", "LIBRARY", "SIGNAL_PAD_SIZE",
    "SEGMENT_PREFIX", "SUPPORTED_DTYPES", "REDUCE_OPS", "device_for_rank",
    "cases_device_type",
    "SymmetricAllocation", "CpuAllocator", "CpuSymmetricMemory", "OP_CHANNEL",
    "kernel_build_info", "load_kernels", "POINTWISE_STEPS", "POINTWISE_DTYPES", "pointwise_steps",
    # the backend interface (see `register_allocator`)
    "GroupInfo", "pad_offset", "storage_elements", "check_persistent", "held_past_grace",
    "group_info", "gather", "check_sizes",
]

LIBRARY = "refimpl_symm_mem"
SIGNAL_PAD_SIZE = 4096  # bytes per rank: uint32 slots, one per (channel, peer)
SEGMENT_PREFIX = "refimpl-symm-"
MAX_ALLOC_ID = 2**64 - 1  # alloc_id is a uint64 upstream
RELEASE_GRACE_S = 1.0  # how long SM-4 waits for a finished collective's worker to let go
SHM_DIR = os.environ.get("REFIMPL_SHM_DIR", "/dev/shm")
_default_timeout_ms = int(os.environ.get("REFIMPL_SYMM_MEM_TIMEOUT_MS", "60000"))


def set_default_timeout(timeout_ms: int) -> int:
    """Set the timeout used when a call passes none (or 0); returns the previous one."""
    global _default_timeout_ms
    if not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or timeout_ms <= 0:
        refuse("timeout_ms", "a positive int", repr(timeout_ms), "SM-11")
    previous, _default_timeout_ms = _default_timeout_ms, timeout_ms
    if _native_ops is not None:
        _native_ops.rsm_ops_set_timeout(timeout_ms * 1_000_000)
    return previous


def cases_device_type() -> str:
    """The device type the conformance cases allocate on (the module attribute `DEVICE`,
    read at each use): $REFIMPL_SYMM_MEM_DEVICE if set, else the type of the runner's
    `--device` ($REFIMPL_DEVICE: `--device cuda` runs the SM cases on the CUDA allocator,
    one knob for every section), else cpu."""
    chosen = os.environ.get("REFIMPL_SYMM_MEM_DEVICE") or os.environ.get("REFIMPL_DEVICE")
    return torch.device(chosen).type if chosen else "cpu"


def __getattr__(name: str):
    if name == "DEVICE":
        return cases_device_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def device_for_rank(rank: int) -> torch.device:
    """The device a rank allocates on: `DEVICE`, one GPU per rank round robin for cuda."""
    device = cases_device_type()
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("the SM cases' device is cuda ($REFIMPL_SYMM_MEM_DEVICE or "
                               "--device), but torch sees no CUDA device")
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(device)


def _timeout_ms(timeout_ms) -> int:
    """0 (upstream's default) means the module default: no wait in refimpl is unbounded."""
    if not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or timeout_ms < 0:
        refuse("timeout_ms", "a non-negative int (0: the default)", repr(timeout_ms), "SM-11")
    return timeout_ms or _default_timeout_ms


class SymmMemTimeout(TimeoutError):
    """A wait on a peer ran out of time; `peer` is the group rank waited for."""

    def __init__(self, message: str, peer: int):
        super().__init__(message)
        self.peer = peer


# --------------------------------------------------------------------------------------
# The C kernels (SM-18)
# --------------------------------------------------------------------------------------
_i32, _i64, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
MAX_WORLD_SIZE = 64  # the C kernels' limit


class _CGroup(ctypes.Structure):
    """`rsm_group` of kernels/cpu/symm_mem.c: one rank's view of an allocation."""

    _fields_ = [("rank", ctypes.c_int32), ("world", ctypes.c_int32), ("peer", ctypes.c_int32),
                ("unused", ctypes.c_int32), ("bufs", _ptr * MAX_WORLD_SIZE),
                ("pads", _ptr * MAX_WORLD_SIZE), ("descs", _ptr * MAX_WORLD_SIZE),
                ("mismatch", ctypes.c_int64 * 6)]


@functools.cache
def c_kernels() -> ctypes.CDLL:
    """The C kernels of kernels/cpu/symm_mem.c, loaded on first use (the first CPU
    rendezvous), never at import: a checkout that was not pip-installed compiles them
    then (SM-18)."""
    lib = load_kernel_library("symm_mem")
    lib.rsm_put_signal.argtypes = [_ptr, _i32, _i32, _i32, _i64]
    lib.rsm_wait_signal.argtypes = [_ptr, _i32, _i32, _i32, _i64]
    lib.rsm_group_barrier.argtypes = [_ptr, _i32, _i64]
    lib.rsm_one_shot.argtypes = [_ptr, _i32, _i64, _i64, _i32, _i32, _ptr, _i64]
    lib.rsm_two_shot.argtypes = [_ptr, _i32, _i64, _i64, _i32, _i32, _i64]
    lib.rsm_reduce.argtypes = [_ptr, _ptr, _i32, _i64, _i32, _i32]
    return lib

# Statuses of a backend's primitives (the C kernels return the same numbers).
STATUS_OK, STATUS_PUT_TIMEOUT, STATUS_WAIT_TIMEOUT, STATUS_BAD_ARGUMENT = 0, 1, 2, 3
STATUS_MISMATCH = 4  # ranks called an all-reduce differently (SM-20)
DESCRIPTOR_SIZE = 64  # bytes after the signal pad: the last all-reduce call's description
OP_CHANNEL = 0  # the signal-pad channel the all-reduce kernels synchronise on (SM-17)

# dtype and reduction codes shared with kernels/cpu/symm_mem.c
SUPPORTED_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int32: 3,
                    torch.int64: 4}
REDUCE_OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3}


# --------------------------------------------------------------------------------------
# Allocator registry (SM-1)
# --------------------------------------------------------------------------------------
_allocators: dict[str, object] = {}
# alloc_id -> its last granted request: (size, stride, dtype, device, group_name) as given,
# then a function of no arguments that grants it again (see `empty_strided_p2p`).
_granted: dict[int, tuple] = {}


def register_allocator(device_type: str, allocator) -> None:
    """Make `allocator` serve symmetric memory on devices of type `device_type` (SM-1).

    The module's functions and the `refimpl_symm_mem` ops find the allocator by the
    device type of the tensor they are given and touch nothing of it but this protocol
    (see `CpuAllocator` for the CPU one):

    Allocator
      - `empty_strided_p2p(size, stride, dtype, device, group_name, alloc_id) -> Tensor`:
        a tensor of exactly that layout on `device` whose storage is a new symmetric
        allocation, or, with an `alloc_id`, the persistent one of SM-4 (raising as SM-4
        says; once it exists, a lookup: no system call). Arguments arrive checked
        (SM-3; a repeated persistent request was checked when it was first granted,
        see `empty_strided_p2p`); it MUST NOT communicate.
      - `reissuer(alloc_id) -> Callable[[], Tensor]` (optional), right after a persistent
        request was granted: a function that grants that same request again (SM-4's
        check that no tensor of the last grant is alive, then the tensor), for the
        module to call instead of `empty_strided_p2p` while the request repeats.
      - `allocation_of(tensor) -> SymmetricAllocation | None`: the record of the
        allocation whose storage holds `tensor` (any view of it), else None. The ops
        call it on every call: it must be a lookup (no system call, no allocation).
      - `rendezvous(allocation, group_name, timeout_ms) -> SymmetricMemory`: the
        collective of SM-5 and SM-12 over `group_info(group_name)` (rank, world size,
        store), every wait bounded by `timeout_ms` (SM-11). The module caches the
        handle in `allocation.handle` and never calls it twice for one allocation.

    SymmetricAllocation (the record; the allocator may subclass it)
      `nbytes`, `group_name` (or None), `alloc_id` (or None), `base` (the address of
      the buffer in this process: an input's byte offset counts from it) and
      `handle` (None until rendezvous).

    SymmetricMemory (the handle; the allocator subclasses it)
      The base class holds the attributes of SM-7 and every argument check of
      SM-8..SM-11, SM-14..SM-17 and SM-19; a subclass implements the device's
      primitives. Those that wait return a status (`STATUS_OK`, `STATUS_PUT_TIMEOUT`,
      `STATUS_WAIT_TIMEOUT`, `STATUS_MISMATCH`): `_put_signal` and `_wait_signal` the
      status alone (their peer is an argument), the others `(status, peer)`, the group
      rank waited for when it timed out:
      - `_tensor_at(rank, byte_offset, numel, dtype) -> Tensor`: a 1-D tensor over
        rank `rank`'s memory, `byte_offset` bytes from the start of its buffer (the
        signal pad starts at `pad_offset`); bounds are already checked.
      - `_put_signal(dst_rank, channel, timeout_ms)`, `_wait_signal(src_rank, channel,
        timeout_ms)`, `_barrier(channel, timeout_ms)`: SM-9 and SM-10 on the signal pads.
      - `_one_shot(offset, numel, codes, out, timeout_ms)`: SM-15 from the inputs at
        byte `offset` of every rank's buffer into the contiguous tensor `out`;
        `_two_shot(offset, numel, codes, timeout_ms)`: SM-16 in place. `codes` is
        `(reduce op code, dtype code)` of `REDUCE_OPS` and `SUPPORTED_DTYPES`, shared
        with every backend's kernels. Both synchronise on channel `OP_CHANNEL` and check
        the call against every rank's (SM-20): on a difference they return
        `STATUS_MISMATCH` with the lowest differing rank, and `_mismatched_calls()` then
        gives `((numel, byte offset, kind), (...))` of rank 0's call and that rank's,
        `kind = algorithm << 16 | reduce op code << 8 | dtype code` (one-shot 1,
        two-shot 2).
      - `_failed()` (optional): told once when the handle becomes fail-stop (SM-19).
    Allocator also has `device_type`. Registering an allocator also makes the ops run on
    its device type: their Python kernels are registered for the CPU and CUDA dispatch
    keys and choose the allocator at run time (on CPU, refimpl's C++ kernels take the
    calls they can serve only while refimpl's own CPU allocator is the registered one).

    Backend interface: what a backend in another module (refimpl/_symm_mem_cuda.py) may
    use of this one, besides the classes above, `SIGNAL_PAD_SIZE`, `DESCRIPTOR_SIZE`,
    `OP_CHANNEL` and the statuses; a backend module imports this one and registers its
    allocator itself, this module imports no backend:
      - `pad_offset(nbytes)`: where the signal pad of an allocation of `nbytes` starts;
        the descriptor (`DESCRIPTOR_SIZE` bytes) follows the pad.
      - `storage_elements(size, stride)`: the elements a layout spans (its bytes, times
        the element size).
      - `check_persistent(alloc, alive, nbytes, group_name, alloc_id)`: SM-4's checks
        of a repeated persistent request, with SM-4's errors; `held_past_grace(users,
        owners)` judges `alive` (a worker thread's last moment with a finished
        collective's tensors is not a live holder).
      - `group_info(group_name) -> GroupInfo`: the group's rank, world size, store and a
        counter of its rendezvous (keys of their own: `rdzv<count>/...`).
      - `gather(info, prefix, timeout_s, what)`: every rank's value of key
        `prefix<rank>` in the group's store, the ranks missing at the timeout named
        (SM-11).
      - `check_sizes(records, nbytes, rank)`: SM-5's check that every rank's record has
        this rank's `"nbytes"`.
    """
    _allocators[str(device_type)] = allocator
    _granted.clear()  # requests granted by the allocator this one replaces
    if str(device_type) == "cpu" and _native_ops is not None:
        # The C++ kernels serve only allocations of refimpl's own CPU allocator.
        _native_ops.rsm_ops_enable(int(allocator is _cpu_allocator))


# The backend module of a device type, imported the first time a program asks for that
# type where torch sees such a device (SM-1, SM-21): it registers its allocator as it is
# imported. Importing this module loads no other backend, and a machine without the
# device never loads its backend. Another backend adds its entry here, or calls
# `register_allocator` itself.
BACKEND_MODULES = {"cuda": "refimpl._symm_mem_cuda"}


def _device_present(device_type: str) -> bool:
    available = getattr(getattr(torch, device_type, None), "is_available", None)
    return bool(available()) if callable(available) else False


def get_allocator(device_type) -> object:
    device_type = str(getattr(device_type, "type", device_type))
    allocator = _allocators.get(device_type)
    if allocator is None and device_type in BACKEND_MODULES and _device_present(device_type):
        importlib.import_module(BACKEND_MODULES[device_type])  # registers itself
        allocator = _allocators.get(device_type)
    if allocator is None:
        refuse("device", f"a device type with a symmetric-memory allocator (registered: "
               f"{sorted(_allocators)})", f"device type {device_type!r}, which has none", "SM-1")
    return allocator


# --------------------------------------------------------------------------------------
# Groups (SM-2)
# --------------------------------------------------------------------------------------
@dataclass
class GroupInfo:
    """A group's rank, size and rendezvous store; `rendezvous_count` numbers the
    rendezvous of the group in this process, so that each uses keys of its own."""

    rank: int
    world_size: int
    store: dist.Store
    rendezvous_count: int = 0


_groups: dict[str, GroupInfo] = {}


def set_group_info(group_name: str, rank: int, world_size: int, store: dist.Store) -> None:
    """Register the rank, size and rendezvous store of the group `group_name`, once."""
    require_type(group_name, str, "group_name", "a str", "SM-2")
    if group_name in _groups:
        refuse("group_name", "a group without group info",
               f"{group_name!r}, whose group info is already set", "SM-2")
    if not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        refuse("world_size", f"an int in 1..{MAX_WORLD_SIZE}", repr(world_size), "SM-2")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        refuse("rank", f"an int in 0..{world_size - 1}", repr(rank), "SM-2")
    require_type(store, dist.Store, "store", "a torch.distributed.Store", "SM-2")
    _groups[group_name] = GroupInfo(rank, world_size, store)


def _group_name_of(group) -> str:
    if isinstance(group, str):
        return group
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    refuse("group", "a group name or a ProcessGroup", type(group).__name__, "SM-2", TypeError)


def enable_symm_mem_for_group(group) -> None:
    """Set the group info of a registered ProcessGroup from the group itself (idempotent)."""
    group_name = _group_name_of(group)
    if group_name in _groups:
        return
    try:
        pg = c10d._resolve_process_group(group_name)
    except Exception as exc:
        raise ValueError(expected_got(
            "group", "the name of a registered process group",
            f"{group_name!r}, but no process group is registered as {group_name!r}",
            "SM-2")) from exc
    global_ranks = "_".join(map(str, dist.get_process_group_ranks(pg)))
    # Groups with the same ranks share the same store keys only under the same name.
    store = dist.PrefixStore(f"{SEGMENT_PREFIX}{global_ranks}-{group_name}",
                             c10d._get_process_group_store(pg))
    set_group_info(group_name, pg.rank(), pg.size(), store)


def is_symm_mem_enabled_for_group(group) -> bool:
    return _group_name_of(group) in _groups


def group_info(group_name: str) -> GroupInfo:
    """The info of group `group_name`, set up from its ProcessGroup when none was set
    (a backend's rendezvous starts here; see `register_allocator`)."""
    if group_name not in _groups:
        enable_symm_mem_for_group(group_name)  # a registered ProcessGroup needs no setup
    return _groups[group_name]


# --------------------------------------------------------------------------------------
# The handle (SM-6 .. SM-11)
# --------------------------------------------------------------------------------------
def _check_index(name: str, value, limit: int, rule: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
        refuse(name, f"an int in 0..{limit - 1}", repr(value), rule)
    return value


class SymmetricMemory:
    """One rank's view of a rendezvoused symmetric allocation of a group.

    Device-neutral: every argument check and error lives here; a backend's subclass
    implements the primitives listed in `register_allocator`.
    """

    def __init__(self, group_name: str, rank: int, world_size: int, buffer_size: int,
                 buffer_ptrs: list[int], pad_offset: int):
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.buffer_size = buffer_size
        self.signal_pad_size = SIGNAL_PAD_SIZE
        self.pad_offset = pad_offset  # bytes from a buffer's start to its signal pad
        self.buffer_ptrs = list(buffer_ptrs)
        self.signal_pad_ptrs = [b + pad_offset for b in buffer_ptrs]
        self.channels = SIGNAL_PAD_SIZE // (4 * world_size)
        self._failure: str | None = None  # the timeout that made this handle unusable (SM-19)
        self._failed_peer = -1

    def __repr__(self):
        return (f"{type(self).__name__}(group={self.group_name!r}, rank={self.rank}, "
                f"world_size={self.world_size}, buffer_size={self.buffer_size})")

    # ---- tensors on any rank's memory (SM-8)
    def _view(self, rank, sizes, dtype, storage_offset, base: int, limit: int, what: str):
        _check_index("rank", rank, self.world_size, "SM-8")
        sizes = tuple(sizes)
        if any(not isinstance(s, int) or s < 0 for s in sizes):
            refuse("sizes", "non-negative ints", sizes, "SM-8")
        if not isinstance(storage_offset, int) or storage_offset < 0:
            refuse("storage_offset", "a non-negative int", repr(storage_offset), "SM-8")
        element = torch.empty((), dtype=dtype).element_size()
        numel = math.prod(sizes)
        end = (storage_offset + numel) * element
        if end > limit:
            refuse("sizes/storage_offset",
                   f"a view within {what} of rank {rank}, which holds {limit} bytes",
                   f"{sizes} of {dtype} at offset {storage_offset}, which needs {end}", "SM-8")
        flat = self._tensor_at(rank, base + storage_offset * element, numel, dtype)
        return flat.view(sizes)

    def get_buffer(self, rank: int, sizes: Sequence[int], dtype: torch.dtype,
                   storage_offset: int = 0) -> torch.Tensor:
        """A tensor on rank `rank`'s buffer (this rank's own, or a peer's)."""
        return self._view(rank, sizes, dtype, storage_offset, 0, self.buffer_size, "the buffer")

    def get_signal_pad(self, rank: int, sizes: Sequence[int] | None = None,
                       dtype: torch.dtype | None = None, storage_offset: int = 0) -> torch.Tensor:
        """A tensor on rank `rank`'s signal pad (default: all of it, as uint32)."""
        dtype = dtype or torch.uint32
        if sizes is None or len(sizes) == 0:  # the rest of the pad from storage_offset on
            element = torch.empty((), dtype=dtype).element_size()
            elements = self.signal_pad_size // element
            if not isinstance(storage_offset, int) or not 0 <= storage_offset <= elements:
                refuse("storage_offset", f"an int in 0..{elements}: the signal pad of rank "
                       f"{rank} holds {elements} elements of {dtype}", repr(storage_offset),
                       "SM-8")
            sizes = (elements - storage_offset,)
        return self._view(rank, sizes, dtype, storage_offset, self.pad_offset,
                          self.signal_pad_size, "the signal pad")

    # ---- synchronisation (SM-9 .. SM-11, SM-19)
    def _channel(self, channel) -> int:
        return _check_index("channel", channel, self.channels, "SM-9")

    def _usable(self, what: str) -> None:
        """Fail-stop: after a timeout no synchronisation may run on this handle (SM-19)."""
        if self._failure is not None:
            raise SymmMemTimeout(f"{what}: this handle of group {self.group_name!r} is "
                                 f"unusable since an earlier timeout: {self._failure}",
                                 self._failed_peer)

    def put_signal(self, dst_rank: int, channel: int = 0, timeout_ms: int = 0) -> None:
        """Signal `dst_rank` on `channel`; waits while its previous signal is unconsumed."""
        _check_index("dst_rank", dst_rank, self.world_size, "SM-9")
        channel, timeout = self._channel(channel), _timeout_ms(timeout_ms)
        self._usable("put_signal")
        status = self._put_signal(dst_rank, channel, timeout)
        self._check(status, dst_rank, "put_signal", channel, timeout)

    def wait_signal(self, src_rank: int, channel: int = 0, timeout_ms: int = 0) -> None:
        """Wait for (and consume) a signal from `src_rank` on `channel`."""
        _check_index("src_rank", src_rank, self.world_size, "SM-9")
        channel, timeout = self._channel(channel), _timeout_ms(timeout_ms)
        self._usable("wait_signal")
        status = self._wait_signal(src_rank, channel, timeout)
        self._check(status, src_rank, "wait_signal", channel, timeout)

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        """Return once every rank of the group reached this barrier on `channel`."""
        channel, timeout = self._channel(channel), _timeout_ms(timeout_ms)
        self._usable("barrier")
        status, peer = self._barrier(channel, timeout)
        self._check(status, peer, "barrier", channel, timeout)

    def _check(self, status: int, peer: int, what: str, channel: int, timeout_ms: int):
        if status == STATUS_OK:
            return
        if status == STATUS_MISMATCH:
            raise ValueError(self._mismatch(peer, what))
        if status == STATUS_PUT_TIMEOUT:
            did = "did not consume this rank's previous signal"
        elif status == STATUS_WAIT_TIMEOUT:
            did = "did not signal"
        else:
            raise RuntimeError(f"{what}: the kernel refused its arguments (status {status})")
        message = (f"{what}: rank {peer} of group {self.group_name!r} {did} on channel "
                   f"{channel} within {timeout_ms} ms (waiting on rank {self.rank}) [SM-11]")
        if what not in ("put_signal", "wait_signal"):
            # A barrier (alone or in an all-reduce) that gave up may have signalled some
            # peers already; a later barrier would meet those signals: fail-stop (SM-19).
            self._failure, self._failed_peer = message, peer
            self._failed()
        raise SymmMemTimeout(message, peer)

    def _mismatch(self, peer: int, what: str) -> str:
        """Rank `peer` is the lowest whose all-reduce call differs from rank 0's (SM-20)."""
        calls = self._mismatched_calls()

        def described(index):
            numel, offset, kind = calls[index]
            algorithm = {1: "one_shot", 2: "two_shot"}.get(kind >> 16, kind >> 16)
            op = {code: name for name, code in REDUCE_OPS.items()}.get(kind >> 8 & 0xFF)
            dtype = {code: d for d, code in SUPPORTED_DTYPES.items()}.get(kind & 0xFF)
            return (f"{algorithm} of {numel} elements of {dtype} at byte offset {offset} "
                    f"with {op!r}")
        return (f"input: {what} needs the same call on every rank of group "
                f"{self.group_name!r}; rank {peer} called {described(1)}, rank 0 called "
                f"{described(0)} [SM-20]")

    # ---- the device's primitives (see register_allocator)
    def _failed(self) -> None:
        """Told once when the handle becomes unusable (SM-19)."""
    def _tensor_at(self, rank: int, byte_offset: int, numel: int, dtype) -> torch.Tensor:
        raise NotImplementedError

    def _put_signal(self, dst_rank: int, channel: int, timeout_ms: int) -> int:
        raise NotImplementedError

    def _wait_signal(self, src_rank: int, channel: int, timeout_ms: int) -> int:
        raise NotImplementedError

    def _barrier(self, channel: int, timeout_ms: int) -> tuple[int, int]:
        raise NotImplementedError

    def _one_shot(self, offset: int, numel: int, codes, out, timeout_ms: int) -> tuple[int, int]:
        raise NotImplementedError

    def _two_shot(self, offset: int, numel: int, codes, timeout_ms: int) -> tuple[int, int]:
        raise NotImplementedError

    def _mismatched_calls(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        raise NotImplementedError


class CpuSymmetricMemory(SymmetricMemory):
    """The CPU handle: every rank's segment mapped here; C kernels on the mappings."""

    def __init__(self, group_name: str, rank: int, world_size: int, buffer_size: int,
                 maps: list[mmap.mmap]):
        super().__init__(group_name, rank, world_size, buffer_size,
                         [_address_of(m) for m in maps], pad_offset(buffer_size))
        self._maps = maps  # keeps every rank's segment mapped while the handle lives
        self._c = c_kernels()
        group = self._group = _CGroup(rank=rank, world=world_size, peer=-1)
        for r in range(world_size):
            group.bufs[r] = self.buffer_ptrs[r]
            group.pads[r] = self.signal_pad_ptrs[r]
            group.descs[r] = self.signal_pad_ptrs[r] + SIGNAL_PAD_SIZE
        self._group_ptr = ctypes.addressof(group)

    def _tensor_at(self, rank, byte_offset, numel, dtype):
        if numel == 0:  # may sit at the very end of the segment, where no view fits
            return torch.empty(0, dtype=dtype)
        element = torch.empty((), dtype=dtype).element_size()
        view = memoryview(self._maps[rank])[byte_offset:byte_offset + numel * element]
        return torch.frombuffer(view, dtype=dtype)

    def _put_signal(self, dst_rank, channel, timeout_ms):
        return self._c.rsm_put_signal(self.signal_pad_ptrs[dst_rank], self.rank, self.world_size,
                                   channel, timeout_ms * 1_000_000)

    def _wait_signal(self, src_rank, channel, timeout_ms):
        return self._c.rsm_wait_signal(self.signal_pad_ptrs[self.rank], src_rank, self.world_size,
                                    channel, timeout_ms * 1_000_000)

    def _barrier(self, channel, timeout_ms):
        status = self._c.rsm_group_barrier(self._group_ptr, channel, timeout_ms * 1_000_000)
        return status, self._group.peer

    def _one_shot(self, offset, numel, codes, out, timeout_ms):
        status = self._c.rsm_one_shot(self._group_ptr, OP_CHANNEL, offset, numel, codes[1],
                                   codes[0], out.data_ptr(), timeout_ms * 1_000_000)
        return status, self._group.peer

    def _two_shot(self, offset, numel, codes, timeout_ms):
        status = self._c.rsm_two_shot(self._group_ptr, OP_CHANNEL, offset, numel, codes[1],
                                   codes[0], timeout_ms * 1_000_000)
        return status, self._group.peer

    def _failed(self):
        if _native_ops is not None:  # from now on every op call goes through Python
            _native_ops.rsm_ops_forget(self.buffer_ptrs[self.rank])

    def _mismatched_calls(self):
        seen = list(self._group.mismatch)
        return tuple(seen[:3]), tuple(seen[3:])


def _address_of(m: mmap.mmap) -> int:
    holder = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder  # release the export so the mapping can be closed later


# --------------------------------------------------------------------------------------
# The CPU backend: POSIX shared memory (SM-3, SM-4, SM-5, SM-12)
# --------------------------------------------------------------------------------------
def pad_offset(nbytes: int) -> int:
    """Bytes from the start of an allocation of `nbytes` to its signal pad."""
    return (nbytes + 63) // 64 * 64  # the signal pad starts on its own cache line


@dataclass(eq=False)
class SymmetricAllocation:
    """What every allocator records of an allocation (see `register_allocator`)."""

    nbytes: int
    group_name: str | None
    alloc_id: int | None
    base: int = 0  # the buffer's address in this process
    handle: SymmetricMemory | None = None  # set by `rendezvous`


@dataclass(eq=False)
class _CpuAllocation(SymmetricAllocation):
    """This rank's segment: buffer bytes, then the signal pad."""

    map: mmap.mmap | None = None
    fd: int | None = None  # the unnamed segment's file, until rendezvous names it
    # Persistent only: the storage, kept for good, and a tensor over it of the layout
    # last asked for, which a request of that layout gets an alias of.
    storage: torch.UntypedStorage | None = field(default=None, repr=False)
    owner: torch.Tensor | None = field(default=None, repr=False)
    layout: tuple | None = None  # (size, stride, dtype) of `owner`


def _check_room(size: int) -> None:
    """Refuse a segment the shared-memory filesystem cannot hold: tmpfs would accept it
    and kill the process with SIGBUS when a page beyond its room is touched (SM-3)."""
    fs = os.statvfs(SHM_DIR)
    free = fs.f_bavail * fs.f_frsize
    if size > free:
        refuse("size", f"an allocation that fits in {SHM_DIR}, which has {free} bytes free",
               f"one that needs {size} bytes of shared memory (buffer and signal pad)", "SM-3")


def _open_segment(size: int) -> tuple[int, mmap.mmap]:
    """A new, zeroed, still unnamed shared-memory file of `size` bytes, mapped."""
    _check_room(size)
    try:
        fd = os.open(SHM_DIR, getattr(os, "O_TMPFILE", 0) | os.O_RDWR, 0o600)
    except OSError as exc:
        raise OSError(exc.errno, f"symmetric memory allocates unnamed files (O_TMPFILE) in "
                                 f"{SHM_DIR} (a tmpfs on Linux; REFIMPL_SHM_DIR chooses "
                                 f"another): {exc.strerror} [SM-12]") from exc
    try:
        os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


def _segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _name_segment(fd: int) -> str:
    """Give the unnamed segment a name under SHM_DIR, unique to this process and call."""
    name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    proc_fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(str(fd), _segment_path(name), src_dir_fd=proc_fds, follow_symlinks=True)
    finally:
        os.close(proc_fds)
    return name


def _unlink_quietly(name: str) -> None:
    try:
        os.unlink(_segment_path(name))
    except FileNotFoundError:
        pass


def leaked_segments() -> list[str]:
    """Names of refimpl segments present under SHM_DIR (there should be none, SM-12)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(SEGMENT_PREFIX))
    except FileNotFoundError:
        return []


def _storage_users(storage: torch.UntypedStorage) -> int:
    """How many tensors use `storage` (its own Python object is not counted)."""
    return torch._C._storage_Use_Count(storage._cdata) - 1


def storage_elements(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """How many elements a tensor of `size` and `stride` spans in its storage (SM-3)."""
    if any(s == 0 for s in size):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(size, stride, strict=True))


def held_past_grace(users, owners: int) -> bool:
    """SM-4: does `users()` stay above `owners` for RELEASE_GRACE_S? A process group's
    worker thread lets go of a finished collective's tensors just after that collective's
    wait returns (gloo's marks the work complete, then drops it), so a count above the
    owners right after a wait is usually that thread: read it again until the grace is
    spent before calling the allocation alive. The common case (no extra user) reads once."""
    if users() <= owners:
        return False
    deadline = time.monotonic() + RELEASE_GRACE_S
    pause_s = 1e-5
    while time.monotonic() < deadline:
        time.sleep(pause_s)
        pause_s = min(2 * pause_s, 0.01)
        if users() <= owners:
            return False
    return True


def check_persistent(alloc: SymmetricAllocation, alive: bool, nbytes: int, group_name,
                     alloc_id: int) -> None:
    """SM-4, for every allocator: may persistent `alloc` be handed out again for a request
    of `nbytes` for `group_name`, `alive` whether a tensor of its last grant lives?"""
    if alive:
        refuse("alloc_id", f"no live tensor of the previous allocation with alloc_id {alloc_id}",
               f"a request for alloc_id {alloc_id} while the previous allocation with this id "
               f"is still alive", "SM-4", RuntimeError)
    if alloc.nbytes != nbytes:
        refuse("alloc_id", f"a request of {alloc.nbytes} bytes, as alloc_id {alloc_id} was "
               f"allocated with {alloc.nbytes} bytes", f"one that needs {nbytes}", "SM-4")
    if alloc.group_name != group_name:
        refuse("alloc_id", f"group {alloc.group_name!r}, as alloc_id {alloc_id} belongs to "
               f"group {alloc.group_name!r}", repr(group_name), "SM-4")


class CpuAllocator:
    """Symmetric allocations in /dev/shm, exchanged through the group's store."""

    device_type = "cpu"

    def __init__(self):
        self._live: dict[int, _CpuAllocation] = {}  # base address -> live allocation
        self._persistent: dict[int, _CpuAllocation] = {}  # alloc_id -> allocation

    # ---- allocation (SM-3, SM-4)
    def empty_strided_p2p(self, size, stride, dtype, device, group_name,
                          alloc_id) -> torch.Tensor:
        if alloc_id is not None:
            return self._persistent_tensor(size, stride, dtype, group_name, alloc_id)
        nbytes = storage_elements(size, stride) * dtype.itemsize
        alloc = self._new_allocation(nbytes, group_name, None)
        view = memoryview(alloc.map)[: max(nbytes, dtype.itemsize)]
        weakref.finalize(view, self._release, alloc)  # the last tensor over it died
        self._live[alloc.base] = alloc
        return torch.frombuffer(view, dtype=torch.uint8).view(dtype).as_strided(size, stride)

    def _new_allocation(self, nbytes, group_name, alloc_id) -> _CpuAllocation:
        fd, segment = _open_segment(pad_offset(nbytes) + SIGNAL_PAD_SIZE + DESCRIPTOR_SIZE)
        return _CpuAllocation(nbytes, group_name, alloc_id, _address_of(segment), map=segment,
                              fd=fd)

    def _persistent_tensor(self, size, stride, dtype, group_name, alloc_id) -> torch.Tensor:
        """A tensor over persistent allocation `alloc_id`: a lookup once it exists (SM-4).

        The allocator keeps the storage for good, and a tensor over it of the layout last
        asked for (`owner`): a request of that layout gets a detached alias of it (one
        cheap op, not a view), another layout a new owner. Every tensor handed out, and
        every view of one, is one more user of the storage."""
        layout = (size, stride, dtype)
        alloc = self._persistent.get(alloc_id)
        if alloc is None:
            nbytes = storage_elements(size, stride) * dtype.itemsize
            alloc = self._new_allocation(nbytes, group_name, alloc_id)
            view = memoryview(alloc.map)[: max(nbytes, 8)]
            alloc.storage = torch.frombuffer(view, dtype=torch.uint8).untyped_storage()
            self._persistent[alloc_id] = self._live[alloc.base] = alloc
        else:
            alive = held_past_grace(lambda: _storage_users(alloc.storage), 1)  # the owner
            same = layout == alloc.layout  # then the byte size is the same too
            nbytes = alloc.nbytes if same else storage_elements(size, stride) * dtype.itemsize
            check_persistent(alloc, alive, nbytes, group_name, alloc_id)
            if same:
                return alloc.owner.detach()
        with torch.inference_mode(False):  # it outlives the call: autograd may see it later
            alloc.owner = torch.empty(0, dtype=dtype).set_(alloc.storage, 0, size, stride)
        alloc.layout = layout
        return alloc.owner.detach()

    def reissuer(self, alloc_id: int):
        """`alloc_id`'s last granted request, again: SM-4's alive check and an alias of
        the kept tensor (see `register_allocator`). What a compiled program's comm
        buffer costs per call once it exists."""
        alloc = self._persistent[alloc_id]
        layout = alloc.layout  # the request just granted: `owner` has its layout
        use_count = functools.partial(torch._C._storage_Use_Count, alloc.storage._cdata)

        def grant_again() -> torch.Tensor:
            nonlocal layout
            if alloc.layout is not layout:  # another layout was granted since, directly
                tensor = self._persistent_tensor(*layout, alloc.group_name, alloc_id)
                layout = alloc.layout  # ours again
                return tensor
            if held_past_grace(use_count, 2):  # more users than the storage object and the owner
                check_persistent(alloc, True, alloc.nbytes, alloc.group_name, alloc_id)
            return alloc.owner.detach()
        return grant_again

    def _release(self, alloc: _CpuAllocation) -> None:
        """The last tensor over a (non-persistent) allocation died: forget it."""
        if self._live.get(alloc.base) is alloc:
            del self._live[alloc.base]
        if _native_ops is not None and alloc.handle is not None:
            _native_ops.rsm_ops_forget(alloc.base)
        if alloc.fd is not None:
            os.close(alloc.fd)
            alloc.fd = None

    def allocation_of(self, tensor: torch.Tensor) -> _CpuAllocation | None:
        return self._live.get(tensor.untyped_storage().data_ptr())

    # ---- rendezvous (SM-5, SM-12)
    def rendezvous(self, alloc: _CpuAllocation, group_name: str,
                   timeout_ms: int) -> SymmetricMemory:
        info = group_info(group_name)
        info.rendezvous_count += 1
        key = f"rdzv{info.rendezvous_count}"
        deadline_s = timeout_ms / 1000
        own_name = _name_segment(alloc.fd)
        published: list[str] = [own_name]
        try:
            record = {"name": own_name, "nbytes": alloc.nbytes, "pid": os.getpid()}
            info.store.set(f"{key}/segment{info.rank}", json.dumps(record))
            what = f"rendezvous on group {group_name!r}"
            records = gather(info, f"{key}/segment", deadline_s, what)
            published = [r["name"] for r in records]
            check_sizes(records, alloc.nbytes, info.rank)
            maps = [alloc.map if r == info.rank else _map_peer(records[r], alloc.map.size())
                    for r in range(info.world_size)]
            info.store.set(f"{key}/mapped{info.rank}", "1")
            gather(info, f"{key}/mapped", deadline_s, what)
        except BaseException:
            # A peer may have died before unlinking its segment: unlink every one we know.
            for name in published:
                _unlink_quietly(name)
            raise
        _unlink_quietly(own_name)  # every peer has it mapped now; nothing can leak
        os.close(alloc.fd)
        alloc.fd = None
        handle = CpuSymmetricMemory(group_name, info.rank, info.world_size, alloc.nbytes, maps)
        _load_native_ops_once()
        if _native_ops is not None:  # the C++ kernels may run ops on it from now on
            _native_ops.rsm_ops_register(alloc.base, handle._group_ptr,
                                         handle._group_ptr + _CGroup.peer.offset,
                                         group_name.encode())
        return handle


def gather(info: GroupInfo, prefix: str, timeout_s: float, what: str) -> list:
    """Wait for key `prefix<r>` of every rank r of the group in its store; their values,
    JSON objects decoded. Raises `SymmMemTimeout` naming the ranks missing at the timeout,
    `what` the wait (SM-11)."""
    keys = [f"{prefix}{r}" for r in range(info.world_size)]
    try:
        info.store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception:
        missing = [r for r, k in enumerate(keys) if not info.store.check([k])]
        raise SymmMemTimeout(
            f"{what}: rank(s) {missing} did not arrive within "
            f"{timeout_s * 1000:.0f} ms (waiting on rank {info.rank}) [SM-11]",
            missing[0] if missing else -1) from None
    values = [info.store.get(k).decode() for k in keys]
    return [json.loads(v) if v.startswith("{") else v for v in values]


def check_sizes(records: list[dict], nbytes: int, rank: int) -> None:
    """SM-5: every rank's record (gathered by `gather`) has `"nbytes"` equal to this
    rank's `nbytes`."""
    for peer, record in enumerate(records):
        if record["nbytes"] != nbytes:
            refuse("tensor", "allocations of one size on every rank (rendezvous needs them)",
                   f"different sizes: rank {rank} has {nbytes} bytes, rank {peer} has "
                   f"{record['nbytes']}", "SM-5")



def _map_peer(record: dict, size: int) -> mmap.mmap:
    fd = os.open(_segment_path(record["name"]), os.O_RDWR)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise RuntimeError(f"rendezvous: segment {record['name']} has {actual} bytes, "
                               f"expected {size} [SM-12]")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


_native_ops = None  # the C++ op kernels, once the first CPU rendezvous loaded them
_native_ops_path = None
_cpu_allocator = CpuAllocator()
register_allocator("cpu", _cpu_allocator)


# --------------------------------------------------------------------------------------
# Public API (SM-3 .. SM-6)
# --------------------------------------------------------------------------------------
def _check_shape(size, stride) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`stride=None` checks the size alone (`empty` derives the strides from it); an
    empty stride is a stride like any other (right only for a 0-d size)."""
    size = tuple(size)
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in size):
        refuse("size", "non-negative ints", size, "SM-3")
    if stride is None:
        return size, ()
    stride = tuple(stride)
    if len(stride) != len(size) or any(not isinstance(s, int) or s < 0 for s in stride):
        refuse("stride", f"{len(size)} non-negative ints", stride, "SM-3")
    return size, stride


def empty_strided_p2p(size, stride, dtype: torch.dtype, device, group_name: str | None = None,
                      alloc_id: int | None = None) -> torch.Tensor:
    """An uninitialised tensor whose storage is a symmetric allocation (not collective).

    With `alloc_id`, the allocation is persistent: the same id gives the same memory at
    the same address once the previous tensor with that id is gone (SM-4).
    """
    granted = _granted.get(alloc_id) if type(alloc_id) is int else None
    if (granted is not None and granted[0] is size and granted[1] is stride
            and granted[2] is dtype and granted[3] == device and granted[4] == group_name):
        # The arguments of the last granted request, unchanged (immutable): SM-3's checks
        # passed on them already; only SM-4's alive check remains.
        return granted[5]()
    size, stride = _check_shape(size, stride)
    if not isinstance(dtype, torch.dtype):
        refuse("dtype", "a torch.dtype", repr(dtype), "SM-3", TypeError)
    if group_name is not None and not isinstance(group_name, str):
        refuse("group_name", "a str or None", repr(group_name), "SM-3", TypeError)
    if alloc_id is not None and (not isinstance(alloc_id, int) or isinstance(alloc_id, bool)):
        refuse("alloc_id", "an int or None", repr(alloc_id), "SM-4", TypeError)
    if alloc_id is not None and not 0 <= alloc_id <= MAX_ALLOC_ID:
        refuse("alloc_id", "an int in 0..2**64-1 (a uint64, as upstream's)", alloc_id, "SM-4")
    given_device, device = device, torch.device(device)
    allocator = get_allocator(device.type)
    tensor = allocator.empty_strided_p2p(size, stride, dtype, device, group_name, alloc_id)
    if alloc_id is not None:
        # `size` and `stride` are tuples now, ours unless the caller gave tuples.
        reissuer = getattr(allocator, "reissuer", None)
        again = (reissuer(alloc_id) if reissuer is not None else functools.partial(
            allocator.empty_strided_p2p, size, stride, dtype, device, group_name, alloc_id))
        _granted[alloc_id] = (size, stride, dtype, given_device, group_name, again)
    return tensor


def empty(*size, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """Like `torch.empty`, but the storage is a symmetric allocation (SM-3)."""
    if len(size) == 1 and isinstance(size[0], Sequence):
        size = tuple(size[0])
    dtype = dtype or torch.get_default_dtype()
    device = torch.device(device) if device is not None else torch.get_default_device()
    size, _ = _check_shape(size, None)  # before the strides are derived from it
    stride = tuple(torch._prims_common.make_contiguous_strides_for(size))
    return empty_strided_p2p(size, stride, dtype, device)


def _allocation(tensor, where: str, arg: str = "tensor"):
    require_type(tensor, torch.Tensor, arg, "a Tensor", "SM-5")
    allocator = get_allocator(tensor.device.type)
    alloc = allocator.allocation_of(tensor)
    if alloc is None:
        refuse(arg, f"a tensor allocated by empty_strided_p2p or empty (a symmetric "
               f"allocation), which {where} needs", "a tensor that is not", "SM-5")
    return allocator, alloc


def rendezvous(tensor: torch.Tensor, group=None, *, timeout_ms: int = 0) -> SymmetricMemory:
    """Collective: map every rank's allocation of `tensor`; returns the (cached) handle."""
    allocator, alloc = _allocation(tensor, "rendezvous")
    group_name = _group_name_of(group) if group is not None else alloc.group_name
    if group_name is None:
        refuse("group", "a group (the tensor was allocated without one)", "None", "SM-5")
    if alloc.group_name is not None and alloc.group_name != group_name:
        refuse("group", "the group the tensor was allocated for", f"{group_name!r}, but the "
               f"tensor was allocated for group {alloc.group_name!r}, not {group_name!r}",
               "SM-5")
    if alloc.handle is not None:
        if alloc.handle.group_name != group_name:
            refuse("group", "the group the tensor was rendezvoused with",
                   f"{group_name!r}, but the tensor was rendezvoused with group "
                   f"{alloc.handle.group_name!r}, not {group_name!r}", "SM-5")
        return alloc.handle
    alloc.handle = allocator.rendezvous(alloc, group_name, _timeout_ms(timeout_ms))
    return alloc.handle


def get_symmetric_memory(tensor: torch.Tensor) -> SymmetricMemory:
    """The handle of a rendezvoused tensor; fails before its rendezvous (SM-6)."""
    _, alloc = _allocation(tensor, "get_symmetric_memory")
    if alloc.handle is None:
        refuse("tensor", "a tensor that went through rendezvous (get_symmetric_memory needs "
               "its handle)", "one without a handle: call rendezvous first", "SM-6",
               RuntimeError)
    return alloc.handle


def is_symm_mem_tensor(tensor: torch.Tensor) -> bool:
    # A backend not loaded yet allocated nothing: no import for this question.
    allocator = _allocators.get(tensor.device.type)
    return allocator is not None and allocator.allocation_of(tensor) is not None


# --------------------------------------------------------------------------------------
# Ops (SM-13 .. SM-18, SM-20, SM-24)
# --------------------------------------------------------------------------------------
# Valid (reduce_op, dtype) pairs and their kernel codes, so the hot path is one lookup.
_KERNEL_CODES = {(op, dtype): (op_code, dtype_code)
                 for op, op_code in REDUCE_OPS.items()
                 for dtype, dtype_code in SUPPORTED_DTYPES.items()
                 if op != "avg" or dtype.is_floating_point}


def _check_reduce_input(input, reduce_op, where: str, arg: str = "input") -> tuple[int, int]:
    """Checks every backend applies before anything runs, fake kernels included (SM-14)."""
    codes = _KERNEL_CODES.get((reduce_op, input.dtype))
    if codes is None:
        codes = _explain_reduce_input(input, reduce_op, where, arg)
    if not input.is_contiguous():
        refuse(arg, f"a contiguous tensor for {where}",
               f"a non-contiguous one of strides {tuple(input.stride())}", "SM-14")
    return codes


def _explain_reduce_input(input, reduce_op, where: str, arg: str) -> tuple[int, int]:
    if not isinstance(reduce_op, str) or reduce_op.lower() not in REDUCE_OPS:
        refuse("reduce_op", f"one of {sorted(REDUCE_OPS)}, which {where} supports",
               repr(reduce_op), "SM-14")
    if input.dtype not in SUPPORTED_DTYPES:
        refuse(arg, f"one of the dtypes {list(SUPPORTED_DTYPES)}, which {where} supports",
               input.dtype, "SM-14")
    codes = _KERNEL_CODES.get((reduce_op.lower(), input.dtype))
    if codes is None:
        refuse("reduce_op", "a floating dtype for 'avg'", input.dtype, "SM-14")
    return codes


def _check_group_of(alloc, group_name, where: str, arg: str) -> None:
    """SM-14: an op's input lies in an allocation for `group_name`, the group it was
    allocated or rendezvoused for (rendezvous would refuse it too, naming its own `group`)."""
    own = alloc.handle.group_name if alloc.handle is not None else alloc.group_name
    if own is not None and own != group_name:
        refuse("group_name", f"group {own!r}, which {where}'s {arg}'s allocation is for",
               repr(group_name), "SM-14")


# ---- pointwise steps of one_shot_all_reduce_pointwise (SM-24) ----------------------------
# A chain of steps is one str, "mul 2.0; add 1.0": each step the ATen op with a Python
# number as its other operand, applied in order.
POINTWISE_STEPS = {"add": torch.ops.aten.add, "sub": torch.ops.aten.sub,
                   "mul": torch.ops.aten.mul}
POINTWISE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pointwise_steps(steps) -> str:
    """The text of a chain of (op, number) steps: `[("mul", 2), ("add", 1)]` gives
    "mul 2.0; add 1.0" (SM-24). A number must be an int or float (not a bool) whose
    double is exact, as ATen receives it."""
    texts = []
    for op, number in steps:
        if op not in POINTWISE_STEPS:
            refuse("steps", f"ops in {sorted(POINTWISE_STEPS)}", repr(op), "SM-24")
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            refuse("steps", "numbers that are ints or floats",
                   f"{type(number).__name__} {number!r}", "SM-24", TypeError)
        if isinstance(number, int) and float(number) != number:
            refuse("steps", "numbers with an exact double", f"{number}, which has none",
                   "SM-24")
        texts.append(f"{op} {float(number)!r}")
    return "; ".join(texts)


def _parse_steps(text, argument: str, dtype: torch.dtype) -> tuple:
    """((op name, float), ...) of a chain's text; refuses what SM-24 does not allow."""
    if not isinstance(text, str):
        refuse(argument, "a str of steps such as 'mul 2.0; add 1.0'",
               f"{type(text).__name__} {text!r}", "SM-24", TypeError)
    return _parsed_steps(text, argument, dtype)


@functools.lru_cache(maxsize=256)  # the hot path: a program passes the same chains each call
def _parsed_steps(text: str, argument: str, dtype: torch.dtype) -> tuple:
    parsed = tuple(_parse_step(step, argument) for step in text.split(";")) if text else ()
    if parsed and dtype not in POINTWISE_DTYPES:
        refuse(argument, f"steps on a floating dtype ({', '.join(map(str, POINTWISE_DTYPES))})",
               dtype, "SM-24")
    return parsed


def _parse_step(step: str, argument: str) -> tuple[str, float]:
    op, _, number = step.strip().partition(" ")
    try:
        value = float(number)
    except ValueError:
        value = None
    if op not in POINTWISE_STEPS or value is None or number != number.strip():
        refuse(argument, f"steps '<op> <number>' with op in {sorted(POINTWISE_STEPS)}, "
               "joined by ';'", repr(step), "SM-24")
    return op, value


def _apply_steps(source: torch.Tensor, steps: tuple, target: torch.Tensor) -> None:
    """target = steps(source), each step an ATen op rounded to the dtype (SM-24)."""
    if not steps:
        if source.data_ptr() != target.data_ptr():
            target.copy_(source)
        return
    (op, value), rest = steps[0], steps[1:]
    POINTWISE_STEPS[op].out(source, value, out=target)
    for op, value in rest:
        POINTWISE_STEPS[op].out(target, value, out=target)


# ---- what every op's kernels share ---------------------------------------------------------
def _byte_offset(tensor: torch.Tensor, base: int) -> int:
    """Bytes from `base` (the buffer of `tensor`'s allocation) to `tensor`'s first element.
    From the storage, not `data_ptr()`, which is 0 for a tensor without elements."""
    storage = tensor.untyped_storage().data_ptr()
    return storage + tensor.storage_offset() * tensor.element_size() - base


def _symmetric_input(input, group_name, where, arg="input") -> tuple[SymmetricMemory, int]:
    """The handle of `input`'s allocation (rendezvous on first use), and its byte offset.

    The hot path of an op is a few lookups and one kernel call: the kernel codes by
    (reduce_op, dtype), then here the allocator of the input's device type (the ops'
    dispatch keys are CPU and CUDA; looked up at every call, so the allocator registered
    now serves, SM-1), the allocation by the input's storage and its handle.
    """
    allocator = _allocators.get("cuda" if input.is_cuda else "cpu")
    alloc = allocator.allocation_of(input) if allocator is not None else None
    if alloc is None or alloc.handle is None or alloc.handle.group_name != group_name:
        _, alloc = _allocation(input, where, arg=arg)  # the checks, with their errors
        _check_group_of(alloc, group_name, where, arg)
        rendezvous(input, group_name)
    handle = alloc.handle
    if handle._failure is not None:
        handle._usable(where)
    return handle, _byte_offset(input, alloc.base)


def _one_shot_into(input, codes, group_name, out, where):
    handle, offset = _symmetric_input(input, group_name, where)
    return _one_shot_on(handle, offset, input.numel(), codes, out, where)


def _one_shot_on(handle, offset, numel, codes, out, where):
    timeout = _default_timeout_ms
    status, peer = handle._one_shot(offset, numel, codes, out, timeout)
    if status:
        handle._check(status, peer, where, OP_CHANNEL, timeout)
    return out


# ---- the C++ CPU kernels (kernels/cpu/symm_mem_ops.cpp, SM-18) ----------------------------
# Nothing is built or loaded at import. The Python kernels of NATIVE_OPS serve CPU until
# the first CPU rendezvous (an op needs one to communicate) loads the C++ kernels, building
# them first if need be. They are registered in a library of their own, which that load
# removes just before the C++ library registers its kernels, so that no kernel ever
# overrides another; they serve CPU for good where the C++ kernels cannot be built, or
# with REFIMPL_SYMM_MEM_NATIVE_OPS=0.
class _PythonCpuKernels:
    """The Python CPU kernels of NATIVE_OPS, while no C++ kernel serves them."""

    def __init__(self):
        self._kernels: dict[str, object] = {}
        self._library: torch.library.Library | None = None

    def add(self, name: str, kernel) -> None:
        self._kernels[name] = kernel
        self._register(name, kernel)

    def withdraw(self) -> None:
        if self._library is not None:
            self._library._destroy()
            self._library = None

    def restore(self) -> None:
        for name, kernel in self._kernels.items():
            self._register(name, kernel)

    def _register(self, name: str, kernel) -> None:
        if self._library is None:
            self._library = torch.library.Library(LIBRARY, "IMPL")
        self._library.impl(name, kernel, "CPU")


_python_cpu_kernels = _PythonCpuKernels()
_native_ops_tried = False


def _load_native_ops_once() -> None:
    """Load the C++ kernels on the first call (the first CPU rendezvous); later calls do
    nothing, whatever the first found."""
    global _native_ops, _native_ops_tried
    if _native_ops_tried:
        return
    _native_ops_tried = True
    _native_ops = _load_native_ops()
    if _native_ops is not None:  # they serve only refimpl's own CPU allocator (SM-1)
        _native_ops.rsm_ops_enable(int(_allocators.get("cpu") is _cpu_allocator))


def _load_native_ops() -> ctypes.CDLL | None:
    """The C++ CPU kernels of NATIVE_OPS, or None: then the Python kernels serve CPU too.
    REFIMPL_SYMM_MEM_NATIVE_OPS=0 keeps the Python kernels."""
    if os.environ.get("REFIMPL_SYMM_MEM_NATIVE_OPS", "1") == "0":
        return None
    global _native_ops_path
    try:
        _native_ops_path = build_torch_op_library("symm_mem_ops")
        _python_cpu_kernels.withdraw()
        try:  # loading registers its CPU kernels
            torch.ops.load_library(str(_native_ops_path))
            native = ctypes.CDLL(str(_native_ops_path))
        except BaseException:
            _python_cpu_kernels.restore()
            raise
    except Exception as exc:  # no compiler, or headers this torch cannot build with
        warnings.warn(f"refimpl.symmetric_memory: the C++ CPU op kernels could not be built "
                      f"({str(exc)[:300]}); the ops run their Python kernels [SM-18]",
                      stacklevel=3)
        return None
    native.rsm_ops_init.argtypes = [_ptr, _ptr]
    native.rsm_ops_set_timeout.argtypes = [_i64]
    native.rsm_ops_register.argtypes = [ctypes.c_size_t, _ptr, _ptr, ctypes.c_char_p]
    native.rsm_ops_forget.argtypes = [ctypes.c_size_t]
    native.rsm_ops_enable.argtypes = [_i32]
    c = c_kernels()
    native.rsm_ops_init(ctypes.cast(c.rsm_one_shot, _ptr), ctypes.cast(c.rsm_two_shot, _ptr))
    native.rsm_ops_set_timeout(_default_timeout_ms * 1_000_000)
    return native


def load_kernels() -> dict:
    """Load (building if need be) the kernels now, as the first CPU rendezvous would;
    returns `kernel_build_info()`."""
    c_kernels()
    _load_native_ops_once()
    return kernel_build_info()


def kernel_build_info() -> dict:
    """Which kernels serve the ops, and the source identities they were built from (SM-18);
    asking loads nothing. `ops` is "unloaded" until the first CPU rendezvous (the Python
    kernels serve meanwhile), then "native" or "python" for good; the C library's `stamped`
    hash is None until its first use."""
    source = _native.KERNEL_DIR / "symm_mem.c"
    loaded = c_kernels() if c_kernels.cache_info().currsize else None
    ops = "unloaded" if not _native_ops_tried else "python" if _native_ops is None else "native"
    info = {"c_library": {"stamped": _native.stamped_hash(loaded) if loaded else None,
                          "source": _native.source_hash(source) if source.exists() else None},
            "ops": ops}
    if _native_ops is not None:
        info["native_library"] = {"path": str(_native_ops_path),
                                  "source": _native.torch_op_digest("symm_mem_ops")}
    return info


# ---- defining an op: schema, kernels per device, fake kernel (SM-13) ----------------------
SCHEMAS: dict[str, str] = {}  # op name -> schema, filled by `_define`
NATIVE_OPS: list[str] = []  # the ops the C++ kernels serve on CPU once loaded
_oplib = torch.library.Library(LIBRARY, "DEF")
ops = getattr(torch.ops, LIBRARY)


def _define(name: str, schema: str, *, eager, fake, native: bool = False) -> None:
    """Define op `name`. The Python kernel `eager` serves CUDA, and CPU unless the op is
    `native` and the C++ kernels are loaded; `fake` gives shapes without communication,
    after the same argument checks (SM-13). A `native` op's C++ kernel hands every call it
    does not run itself to `_python_<name>` (same schema), the Python kernel on CPU."""
    SCHEMAS[name] = schema
    _oplib.define(name + schema)
    if native:
        NATIVE_OPS.append(name)
        _oplib.define(f"_python_{name}{schema}")
        _oplib.impl(f"_python_{name}", eager, "CPU")
        _python_cpu_kernels.add(name, eager)
    else:
        _oplib.impl(name, eager, "CPU")
    _oplib.impl(name, eager, "CUDA")
    torch.library.register_fake(f"{LIBRARY}::{name}", fake, lib=_oplib)


def _raise_status(input, group_name, where, status, peer):
    """What the Python kernels raise for a kernel status the C++ kernel got."""
    handle = get_allocator(input.device.type).allocation_of(input).handle
    handle._check(status, peer, where, OP_CHANNEL, _default_timeout_ms)


_oplib.define("_python_raise_status"
              "(Tensor input, str group_name, str where, int status, int peer) -> ()")
_oplib.impl("_python_raise_status", _raise_status, "CPU")


# ---- one_shot_all_reduce (SM-15) -----------------------------------------------------------
def _one_shot_all_reduce(input, reduce_op, group_name):
    codes = _check_reduce_input(input, reduce_op, "one_shot_all_reduce")
    out = torch.empty_like(input, memory_format=torch.contiguous_format)
    return _one_shot_into(input, codes, group_name, out, "one_shot_all_reduce")


def _one_shot_all_reduce_fake(input, reduce_op, group_name):
    _check_reduce_input(input, reduce_op, "one_shot_all_reduce")
    return input.new_empty(input.shape)


_define("one_shot_all_reduce", "(Tensor input, str reduce_op, str group_name) -> Tensor",
        eager=_one_shot_all_reduce, fake=_one_shot_all_reduce_fake, native=True)


# ---- one_shot_all_reduce_out (SM-14, SM-15) ------------------------------------------------
def _check_one_shot_all_reduce_out(input, reduce_op, out) -> tuple[int, int]:
    codes = _check_reduce_input(input, reduce_op, "one_shot_all_reduce_out")
    if out.shape != input.shape or out.dtype != input.dtype or not out.is_contiguous():
        refuse("out", f"a contiguous tensor of the input's shape {tuple(input.shape)} and dtype "
               f"{input.dtype}", f"{tuple(out.shape)} {out.dtype}", "SM-14")
    return codes


def _one_shot_all_reduce_out(input, reduce_op, group_name, *, out):
    codes = _check_one_shot_all_reduce_out(input, reduce_op, out)
    if out.untyped_storage().data_ptr() == input.untyped_storage().data_ptr():
        refuse("out", "a tensor outside the input's allocation, which peers are reading",
               "a tensor in it: one_shot_all_reduce_out must not write into it", "SM-14")
    return _one_shot_into(input, codes, group_name, out, "one_shot_all_reduce_out")


def _one_shot_all_reduce_out_fake(input, reduce_op, group_name, *, out):
    _check_one_shot_all_reduce_out(input, reduce_op, out)
    return out


_define("one_shot_all_reduce_out",
        "(Tensor input, str reduce_op, str group_name, *, Tensor(a!) out) -> Tensor(a!)",
        eager=_one_shot_all_reduce_out, fake=_one_shot_all_reduce_out_fake, native=True)


# ---- two_shot_all_reduce_ (SM-16) ----------------------------------------------------------
def _two_shot_all_reduce_(input, reduce_op, group_name):
    codes = _check_reduce_input(input, reduce_op, "two_shot_all_reduce_")
    handle, offset = _symmetric_input(input, group_name, "two_shot_all_reduce_")
    timeout = _default_timeout_ms
    status, peer = handle._two_shot(offset, input.numel(), codes, timeout)
    if status:
        handle._check(status, peer, "two_shot_all_reduce_", OP_CHANNEL, timeout)
    return input


def _two_shot_all_reduce_fake(input, reduce_op, group_name):
    _check_reduce_input(input, reduce_op, "two_shot_all_reduce_")
    return input


_define("two_shot_all_reduce_",
        "(Tensor(a!) input, str reduce_op, str group_name) -> Tensor(a!)",
        eager=_two_shot_all_reduce_, fake=_two_shot_all_reduce_fake, native=True)


# ---- barrier (SM-17) -----------------------------------------------------------------------
def _barrier_eager(input, group_name, channel=0, timeout_ms=0):
    handle, _ = _symmetric_input(input, group_name, "barrier")
    handle.barrier(channel, timeout_ms)


def _barrier_fake(input, group_name, channel=0, timeout_ms=0):
    return None  # channel and timeout are the handle's to check: a fake call has none


_define("barrier", "(Tensor(a!) input, str group_name, int channel=0, int timeout_ms=0) -> ()",
        eager=_barrier_eager, fake=_barrier_fake)


# ---- one_shot_all_reduce_pointwise (SM-24) -------------------------------------------------
def _check_local_input(symm_buffer, local_input, real: bool) -> None:
    if (local_input.shape != symm_buffer.shape or local_input.dtype != symm_buffer.dtype
            or local_input.device != symm_buffer.device):
        refuse("local_input", f"symm_buffer's shape {tuple(symm_buffer.shape)}, dtype "
               f"{symm_buffer.dtype} and device {symm_buffer.device}",
               f"{tuple(local_input.shape)} {local_input.dtype} {local_input.device}", "SM-24")
    if not real:
        return  # a fake tensor has no storage to compare
    same_storage = (local_input.untyped_storage().data_ptr()
                    == symm_buffer.untyped_storage().data_ptr())
    if same_storage and not (local_input.data_ptr() == symm_buffer.data_ptr()
                             and local_input.stride() == symm_buffer.stride()):
        refuse("local_input", "symm_buffer itself or a tensor outside its allocation (the "
               "steps would overwrite what they read)",
               "another tensor in symm_buffer's allocation", "SM-24")


def _check_pointwise(symm_buffer, local_input, reduce_op, prologue, epilogue,
                     where: str, real: bool = True) -> tuple:
    codes = _check_reduce_input(symm_buffer, reduce_op, where, "symm_buffer")
    _check_local_input(symm_buffer, local_input, real)
    return (codes, _parse_steps(prologue, "prologue", symm_buffer.dtype),
            _parse_steps(epilogue, "epilogue", symm_buffer.dtype))


def _one_shot_all_reduce_pointwise(symm_buffer, local_input, reduce_op, group_name,
                                   prologue="", epilogue=""):
    where = "one_shot_all_reduce_pointwise"
    codes, before, after = _check_pointwise(symm_buffer, local_input, reduce_op,
                                            prologue, epilogue, where)
    # Refused (a plain tensor, another group) before the prologue writes into it.
    handle, offset = _symmetric_input(symm_buffer, group_name, where, "symm_buffer")
    _apply_steps(local_input, before, symm_buffer)
    out = torch.empty_like(symm_buffer, memory_format=torch.contiguous_format)
    _one_shot_on(handle, offset, symm_buffer.numel(), codes, out, where)
    _apply_steps(out, after, out)
    return out


def _one_shot_all_reduce_pointwise_fake(symm_buffer, local_input, reduce_op, group_name,
                                        prologue="", epilogue=""):
    _check_pointwise(symm_buffer, local_input, reduce_op, prologue, epilogue,
                     "one_shot_all_reduce_pointwise", real=False)
    return symm_buffer.new_empty(symm_buffer.shape)


_define("one_shot_all_reduce_pointwise",
        "(Tensor(a!) symm_buffer, Tensor local_input, str reduce_op, str group_name, "
        "str prologue='', str epilogue='') -> Tensor",
        eager=_one_shot_all_reduce_pointwise, fake=_one_shot_all_reduce_pointwise_fake,
        native=True)
