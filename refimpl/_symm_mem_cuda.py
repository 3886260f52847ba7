"""The CUDA backend of symmetric memory: cudaMalloc'd segments shared through CUDA IPC.

An allocation on a CUDA device is one segment on that device, the buffer, the signal pad
and the op descriptor (both zeroed), allocated by the nvcc-built library
`kernels/cuda/symm_mem.cu` (loaded with ctypes; no torch C++ headers, so any CUDA torch
2.11-2.14 will do). At rendezvous each rank
publishes its segment's CUDA IPC handle through the group's store, opens every peer's, and
reports back; a handle's peer mappings are closed when the handle dies, a segment is freed
once neither a tensor over it nor its handle is alive (SM-21). Signals, barriers and the
all-reduce kernels run on the current stream of the tensor's device, and each call returns
once its kernels finished, raising `SymmMemTimeout` for the peer a kernel waited for in vain
(SM-22); the reductions give the CPU kernels' bits (SM-23). The handle is the base class's
(every argument check, fail-stop after a timeout, SM-19), and the all-reduce kernels check
the call against every rank's as the CPU's do (SM-20). Ranks may share one GPU: they
are processes (a process cannot open its own IPC handle).

STATUS: run on an H100 (torch 2.11, 2 and 4 processes time-sliced on the one GPU) by
tests/gpu/run_on_device.sh: tests/gpu and the SM conformance section on cuda pass,
compute-sanitizer finds nothing (benchmarks/results/symm_mem_cuda.md). CI compiles it only.

This module imports `refimpl.symmetric_memory` (which never imports it: it names it in
`BACKEND_MODULES`, loaded the first time a program asks for "cuda"), uses only its backend
interface (see `register_allocator` there), and registers `CudaAllocator` for "cuda" as it
is imported where torch sees a CUDA device; the ops' CUDA kernels find the allocator by
device type. Importing it needs no GPU and builds nothing: the library is built and loaded
on the first allocation (`library()`). Implements SM-21 .. SM-23 and, on CUDA, SM-3 .. SM-11,
SM-15 .. SM-17, SM-19 and SM-20.
"""

from __future__ import annotations

import ctypes
import json
import os
import weakref
from dataclasses import dataclass, field

import torch

import refimpl.symmetric_memory as sm
from refimpl._errors import refuse
from refimpl._native import load_cuda_library

__all__ = ["CudaAllocator", "CudaSymmetricMemory", "library", "STATUS_CUDA_ERROR",
           "STATUS_STUCK", "STATUS_CAPTURING"]

# Statuses past the shared ones (sm.STATUS_OK .. sm.STATUS_MISMATCH), as
# kernels/cuda/symm_mem.cu returns them.
STATUS_CUDA_ERROR, STATUS_STUCK, STATUS_CAPTURING = 5, 6, 7

_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The CUDA kernels' library, built by nvcc on first use (refimpl._native)."""
    global _lib
    if _lib is None:
        _lib = _declare(load_cuda_library("symm_mem"))
    return _lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The C ABI of kernels/cuda/symm_mem.cu."""
    i32, i64, u64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
    out_ptr = ctypes.POINTER(ctypes.c_void_p)
    report = ctypes.POINTER(ctypes.c_int32)
    signatures = {
        "rsmc_source_hash": ([], ctypes.c_char_p),
        "rsmc_error_string": ([i32], ctypes.c_char_p),
        "rsmc_ipc_handle_size": ([], i32),
        "rsmc_device_count": ([ctypes.POINTER(i32)], i32),
        "rsmc_live_segments": ([], i32),
        "rsmc_live_mappings": ([], i32),
        "rsmc_segment_alloc": ([i32, i64, i64, out_ptr], i32),
        "rsmc_segment_free": ([i32, ptr], i32),
        "rsmc_ipc_get": ([i32, ptr, ptr], i32),
        "rsmc_ipc_open": ([i32, ptr, out_ptr], i32),
        "rsmc_ipc_close": ([i32, ptr], i32),
        "rsmc_context_create": ([i32, i32, i32, i32, ptr, ptr, out_ptr], i32),
        "rsmc_context_destroy": ([ptr], i32),
        "rsmc_put_signal": ([ptr, u64, i32, i32, i64, report], i32),
        "rsmc_wait_signal": ([ptr, u64, i32, i32, i64, report], i32),
        "rsmc_barrier": ([ptr, u64, i32, i64, report], i32),
        "rsmc_one_shot_all_reduce": ([ptr, u64, i32, i64, i64, i32, i32, ptr, i64, report], i32),
        "rsmc_two_shot_all_reduce": ([ptr, u64, i32, i64, i64, i32, i32, i64, report], i32),
        "rsmc_reduce_host": ([ptr, ptr, i32, i64, i32, i32], i32),
        "rsmc_mismatched_calls": ([ptr, ctypes.POINTER(i64)], i32),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


class CudaError(RuntimeError):
    """A CUDA runtime call of the backend failed; `code` is its cudaError_t."""

    def __init__(self, what: str, code: int):
        super().__init__(f"{what}: CUDA error {code} "
                         f"({library().rsmc_error_string(code).decode()}) [SM-21]")
        self.code = code


def _check_cuda(code: int, what: str) -> None:
    if code != 0:
        raise CudaError(what, code)


# --------------------------------------------------------------------------------------
# Device memory: segments, peer mappings, tensors over them (SM-21)
# --------------------------------------------------------------------------------------
def _check_device_room(device: torch.device, size: int) -> None:
    """Refuse a segment larger than the device's memory with SM-3's error, before the size
    reaches the C ABI's int64 (where a larger one would wrap)."""
    total = (torch.cuda.get_device_properties(device).total_memory
             if torch.cuda.is_available() else 2**63 - 1)
    if size > total:
        refuse("size", f"an allocation that fits on {device}, which has {total} bytes",
               f"one that needs {size} bytes (buffer, signal pad and descriptor)", "SM-3")


class _Segment:
    """One cudaMalloc'd block: `nbytes` of buffer, then the zeroed signal pad and op
    descriptor. Freed with the last reference (a tensor over it, its allocation record or
    its handle)."""

    def __init__(self, device: torch.device, nbytes: int):
        self.device = device
        self.pad_offset = sm.pad_offset(nbytes)
        self.size = self.pad_offset + sm.SIGNAL_PAD_SIZE + sm.DESCRIPTOR_SIZE
        _check_device_room(device, self.size)
        out = ctypes.c_void_p()
        _check_cuda(library().rsmc_segment_alloc(device.index, self.size, self.pad_offset,
                                                 ctypes.byref(out)),
                    f"allocating {self.size} bytes on {device}")
        self.ptr = out.value
        weakref.finalize(self, library().rsmc_segment_free, device.index, self.ptr)

    def ipc_handle(self) -> bytes:
        handle = ctypes.create_string_buffer(library().rsmc_ipc_handle_size())
        _check_cuda(library().rsmc_ipc_get(self.device.index, self.ptr, handle),
                    "cudaIpcGetMemHandle")
        return handle.raw


class _PeerMapping:
    """A peer's segment opened through its IPC handle; closed with the last reference."""

    def __init__(self, device: torch.device, handle: bytes, peer: int):
        out = ctypes.c_void_p()
        _check_cuda(library().rsmc_ipc_open(device.index, handle, ctypes.byref(out)),
                    f"rendezvous: opening the CUDA IPC handle of rank {peer} on {device}")
        self.ptr = out.value
        weakref.finalize(self, library().rsmc_ipc_close, device.index, self.ptr)


class _DeviceBytes:
    """`nbytes` of device memory at `ptr` on `device`, as torch.as_tensor reads them
    (__cuda_array_interface__); the tensor keeps this object, and so `owner`, alive."""

    def __init__(self, ptr: int, nbytes: int, device: torch.device, owner):
        self.owner = owner
        self.device = device
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 2}


def _byte_tensor(holder: _DeviceBytes) -> torch.Tensor:
    """A uint8 tensor over the holder's bytes, on their device. The device is named: under
    a default device (`with torch.device("cpu")`, torch.set_default_device) torch.as_tensor
    would otherwise copy the bytes there."""
    tensor = torch.as_tensor(holder, device=holder.device)
    ptr = holder.__cuda_array_interface__["data"][0]
    if tensor.data_ptr() != ptr or tensor.device != holder.device:
        raise RuntimeError(f"torch.as_tensor did not wrap the device memory at {ptr:#x} "
                           f"[SM-21]")
    return tensor


def _cuda_device(device: torch.device) -> torch.device:
    """`device` with its index (the current device when it has none)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", index)


# --------------------------------------------------------------------------------------
# The allocator (SM-1, SM-3, SM-4, SM-5, SM-21)
# --------------------------------------------------------------------------------------
@dataclass(eq=False)
class _CudaAllocation(sm.SymmetricAllocation):
    segment: _Segment | None = None
    holder: weakref.ref | None = field(default=None, repr=False)  # the tensor's _DeviceBytes


class CudaAllocator:
    """Symmetric allocations in CUDA device memory, exchanged through the group's store."""

    device_type = "cuda"

    def __init__(self):
        self._live: dict[int, _CudaAllocation] = {}  # buffer address -> live allocation
        self._persistent: dict[int, _CudaAllocation] = {}  # alloc_id -> allocation

    def empty_strided_p2p(self, size, stride, dtype, device, group_name,
                          alloc_id) -> torch.Tensor:
        device = _cuda_device(device)
        element = dtype.itemsize
        nbytes = sm.storage_elements(size, stride) * element
        if alloc_id is None:
            alloc = self._new_allocation(nbytes, device, group_name, None)
        else:
            alloc = self._persistent_allocation(nbytes, device, group_name, alloc_id)
        holder = _DeviceBytes(alloc.base, max(nbytes, element), device, alloc)
        alloc.holder = weakref.ref(holder)
        weakref.finalize(holder, self._release, alloc.base, alloc)
        self._live[alloc.base] = alloc
        flat = _byte_tensor(holder)
        del holder  # the tensor's storage holds it now
        return flat.view(dtype).as_strided(size, stride)

    def _new_allocation(self, nbytes, device, group_name, alloc_id) -> _CudaAllocation:
        segment = _Segment(device, nbytes)
        return _CudaAllocation(nbytes, group_name, alloc_id, segment.ptr, segment=segment)

    def _persistent_allocation(self, nbytes, device, group_name, alloc_id) -> _CudaAllocation:
        alloc = self._persistent.get(alloc_id)
        if alloc is None:
            alloc = self._new_allocation(nbytes, device, group_name, alloc_id)
            self._persistent[alloc_id] = alloc
            return alloc
        alive = sm.held_past_grace(
            lambda: int(alloc.holder is not None and alloc.holder() is not None), 0)
        sm.check_persistent(alloc, alive, nbytes, group_name, alloc_id)
        if alloc.segment.device != device:
            refuse("alloc_id", f"a request on {alloc.segment.device}, where alloc_id "
                   f"{alloc_id} lives", f"one on {device}", "SM-21")
        return alloc

    def _release(self, base: int, alloc: _CudaAllocation) -> None:
        """The tensor over `alloc` died: forget it. Its segment goes with the last reference
        (a persistent allocation keeps it, and its handle, for the next holder)."""
        if self._live.get(base) is alloc:
            del self._live[base]

    def allocation_of(self, tensor: torch.Tensor) -> _CudaAllocation | None:
        return self._live.get(tensor.untyped_storage().data_ptr())

    def rendezvous(self, alloc: _CudaAllocation, group_name: str,
                   timeout_ms: int) -> CudaSymmetricMemory:
        """SM-5 over CUDA IPC: publish this rank's handle, open every peer's, and return
        only once every rank reported its mappings open (or raise naming who could not)."""
        info = sm.group_info(group_name)
        info.rendezvous_count += 1
        key = f"rdzv{info.rendezvous_count}"
        deadline_s = timeout_ms / 1000
        what = f"rendezvous on group {group_name!r}"
        segment = alloc.segment
        record = {"ipc": segment.ipc_handle().hex(), "nbytes": alloc.nbytes, "pid": os.getpid(),
                  "device": str(segment.device)}
        info.store.set(f"{key}/segment{info.rank}", json.dumps(record))
        records = sm.gather(info, f"{key}/segment", deadline_s, what)
        sm.check_sizes(records, alloc.nbytes, info.rank)
        try:
            mappings = {r: _PeerMapping(segment.device, bytes.fromhex(rec["ipc"]), r)
                        for r, rec in enumerate(records) if r != info.rank}
        except CudaError as exc:
            info.store.set(f"{key}/mapped{info.rank}", f"rank {info.rank}: {exc}")
            sm.gather(info, f"{key}/mapped", deadline_s, what)  # let every rank learn why
            raise
        info.store.set(f"{key}/mapped{info.rank}", "ok")
        failures = [r for r in sm.gather(info, f"{key}/mapped", deadline_s, what) if r != "ok"]
        if failures:
            raise RuntimeError(f"{what}: a peer could not map the others' memory: "
                               f"{'; '.join(failures)} [SM-21]")
        ptrs = [segment.ptr if r == info.rank else mappings[r].ptr
                for r in range(info.world_size)]
        return CudaSymmetricMemory(group_name, info.rank, info.world_size, alloc.nbytes, ptrs,
                                   segment, list(mappings.values()))


# --------------------------------------------------------------------------------------
# The handle: the device's primitives (SM-9 .. SM-11, SM-15 .. SM-17, SM-22)
# --------------------------------------------------------------------------------------
class CudaSymmetricMemory(sm.SymmetricMemory):
    """The CUDA handle: every rank's segment mapped on this rank's device; kernels from
    kernels/cuda/symm_mem.cu on the device's current stream, waited for before returning."""

    def __init__(self, group_name, rank, world_size, buffer_size, buffer_ptrs,
                 segment: _Segment, mappings: list[_PeerMapping]):
        super().__init__(group_name, rank, world_size, buffer_size, buffer_ptrs,
                         segment.pad_offset)
        self.device = segment.device
        self._memory = (segment, mappings)  # mapped for as long as the handle lives
        bufs = (ctypes.c_void_p * world_size)(*self.buffer_ptrs)
        pads = (ctypes.c_void_p * world_size)(*self.signal_pad_ptrs)
        context = ctypes.c_void_p()
        _check_cuda(library().rsmc_context_create(self.device.index, rank, world_size,
                                                  self.channels, bufs, pads,
                                                  ctypes.byref(context)),
                    "creating the handle's CUDA context")
        self._context = context.value
        # Runs as the handle dies, before its attributes (the mappings) are released; at
        # exit, finalizers run newest first: the context goes before the memory either way.
        weakref.finalize(self, library().rsmc_context_destroy, self._context)
        self._report = (ctypes.c_int32 * 2)()  # the peer waited for, the cudaError_t
        self._broken: str | None = None

    def _tensor_at(self, rank, byte_offset, numel, dtype):
        if numel == 0:
            return torch.empty(0, dtype=dtype, device=self.device)
        holder = _DeviceBytes(self.buffer_ptrs[rank] + byte_offset, numel * dtype.itemsize,
                              self.device, self)
        return _byte_tensor(holder).view(dtype)

    def _stream(self) -> int:
        # The raw handle of the device's current stream (what torch.cuda.current_stream(
        # device).cuda_stream gives, without making a Stream object at every call).
        return torch._C._cuda_getCurrentRawStream(self.device.index)

    def _run(self, what: str, status: int) -> tuple[int, int]:
        """A kernel call's status and the peer it names; raises for the CUDA-only ones."""
        if status == STATUS_CUDA_ERROR:
            raise CudaError(what, self._report[1])
        if status == STATUS_CAPTURING:
            raise RuntimeError(f"{what}: refimpl's CUDA symmetric memory waits for its kernels "
                               f"and cannot be captured into a CUDA graph [SM-22]")
        if status == STATUS_STUCK:
            self._broken = (f"{what}: the kernels did not finish long after their timeout; "
                            f"the GPU context may be unusable [SM-22]")
            raise RuntimeError(self._broken)
        return status, self._report[0]

    def _live_context(self) -> int:
        """The C context, unless a call found the kernels stuck (SM-22)."""
        if self._broken is not None:
            raise RuntimeError(f"this handle is unusable since: {self._broken}")
        return self._context

    def _put_signal(self, dst_rank, channel, timeout_ms):
        status = library().rsmc_put_signal(self._live_context(), self._stream(), dst_rank,
                                           channel, timeout_ms * 1_000_000, self._report)
        return self._run("put_signal", status)[0]

    def _wait_signal(self, src_rank, channel, timeout_ms):
        status = library().rsmc_wait_signal(self._live_context(), self._stream(), src_rank,
                                            channel, timeout_ms * 1_000_000, self._report)
        return self._run("wait_signal", status)[0]

    def _barrier(self, channel, timeout_ms):
        status = library().rsmc_barrier(self._live_context(), self._stream(), channel,
                                        timeout_ms * 1_000_000, self._report)
        return self._run("barrier", status)

    def _one_shot(self, offset, numel, codes, out, timeout_ms):
        if out.device != self.device:
            refuse("out", f"a tensor on the input's device {self.device}", out.device,
                   "SM-22")
        status = library().rsmc_one_shot_all_reduce(
            self._live_context(), self._stream(), sm.OP_CHANNEL, offset, numel, codes[1],
            codes[0], out.data_ptr(), timeout_ms * 1_000_000, self._report)
        return self._run("one_shot_all_reduce", status)

    def _two_shot(self, offset, numel, codes, timeout_ms):
        status = library().rsmc_two_shot_all_reduce(
            self._live_context(), self._stream(), sm.OP_CHANNEL, offset, numel, codes[1],
            codes[0], timeout_ms * 1_000_000, self._report)
        return self._run("two_shot_all_reduce_", status)

    def _mismatched_calls(self):
        calls = (ctypes.c_int64 * 6)()
        library().rsmc_mismatched_calls(self._context, calls)
        return tuple(calls[:3]), tuple(calls[3:])


def register() -> None:
    """Serve symmetric memory on CUDA devices (SM-1): done as this module is imported where
    torch sees a CUDA device (symmetric memory imports it on the first request for "cuda",
    or a program imports it itself)."""
    sm.register_allocator("cuda", CudaAllocator())


# The one registration: a module runs once, however it was first imported.
if torch.cuda.is_available():
    register()
