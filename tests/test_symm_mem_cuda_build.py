"""The CUDA kernels build wherever nvcc is (CI included, no GPU needed), and what can be
checked of them without a GPU is checked (SM-21, SM-23):

- nvcc compiles kernels/cuda/symm_mem.cu to sm_90 machine code and compute_90 PTX with every
  warning an error (nvcc's, the host compiler's, and ptxas's: no register spill, no local
  memory), through the function that builds it for use, stamped with the hash of its source
  and flags;
- its PTX has what a reviewer looks for: system-scope acquire loads and release stores on
  the signal slots, %globaltimer deadlines, 16-byte loads that bypass L1, IEEE division,
  no fused multiply-add, no trap;
- the library loads without a GPU, every function refimpl/_symm_mem_cuda.py declares exists,
  a CUDA error becomes a `CudaError` naming what failed, and the kernels' element code, built
  for the host, gives bitwise the CPU kernels' results for every 16-bit pattern (a NaN that
  sum or avg computed may be another NaN, `same_bits`);
- the CUDA handle keeps the base class's protocol: its primitives have the base's
  signatures, its statuses are the shared ones plus its own, and, over a stand-in for the
  library, a timeout makes it fail-stop (SM-19) and differing calls raise SM-20's error;
- importing refimpl.symmetric_memory on a machine without CUDA imports nothing of it.

The kernels themselves run in tests/gpu/ (skipped without a GPU). Skipped without nvcc.
"""

from __future__ import annotations

import ctypes
import itertools
import subprocess
import sys

import pytest
import torch

import refimpl.symmetric_memory as sm
from refimpl import _native

SOURCE = _native.CUDA_KERNEL_DIR / "symm_mem.cu"
pytestmark = [pytest.mark.skipif(_native.nvcc_path() is None, reason="needs nvcc"),
              pytest.mark.xdist_group("nvcc")]  # one worker compiles, once


def same_bits(got: torch.Tensor, want: torch.Tensor, op: str) -> bool:
    """Bitwise equal, except that a NaN that sum or avg computed may be another NaN: the
    arithmetic returns one input's NaN on the CPU (which one is up to the compiler) and the
    canonical NaN on a GPU (SM-23). max and min select an input, so their NaNs are exact."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    same = got.view(bits) == want.view(bits)
    if op in ("sum", "avg") and got.dtype.is_floating_point:
        same |= got.isnan() & want.isnan()
    return bool(same.all())


def _library():
    from refimpl import _symm_mem_cuda

    return _symm_mem_cuda.library()


def test_kernels_compile_for_hopper_with_warnings_as_errors_and_carry_their_hash_SM_21():
    lib = _library()  # compiles with NVCC_FLAGS unless this source was compiled before
    digest = _native.source_hash(SOURCE, _native.nvcc_flags())
    assert lib.rsmc_source_hash().decode() == digest
    built = [d / f"libsymm_mem_cuda-{digest}.so" for d in _native._cache_dirs()]
    assert any(path.exists() for path in built)
    for flag in ("-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90",
                 "-fmad=false", "-ftz=false", "-prec-div=true", "--warning-as-error"):
        assert any(flag in f for f in _native.NVCC_FLAGS), flag


def test_ptx_orders_signals_at_system_scope_and_loads_16_bytes_SM_9_SM_11_SM_21(tmp_path):
    ptx = tmp_path / "symm_mem.ptx"
    cmd = [_native.nvcc_path(), "-ptx", "-arch=compute_90", "-std=c++17", "-O3", "-fmad=false",
           "-ftz=false", "-prec-div=true", "-o", str(ptx), str(SOURCE)]
    subprocess.run(cmd, check=True, capture_output=True)
    text = ptx.read_text()
    assert ".target sm_90" in text
    for needed in ("ld.acquire.sys.global.u32", "st.release.sys.global.u32",  # SM-9
                   "%globaltimer",  # SM-11: deadlines without trapping
                   "ld.global.cg.v4.u32",  # 16-byte loads, coherent at L2
                   "div.rn.f32"):  # avg divides exactly, as the CPU does
        assert needed in text, needed
    for forbidden in ("trap;", "fma.rn.f32", "div.approx", "div.full"):
        assert forbidden not in text, forbidden


def test_library_loads_without_a_gpu_and_turns_cuda_errors_into_messages_SM_19():
    from refimpl import _symm_mem_cuda

    lib = _library()
    assert lib.rsmc_ipc_handle_size() == 64
    count = ctypes.c_int(-1)
    err = lib.rsmc_device_count(ctypes.byref(count))
    if torch.cuda.is_available():
        assert err == 0 and count.value >= 1
        return
    assert err != 0 and count.value == 0
    assert lib.rsmc_error_string(err).decode()
    with pytest.raises(_symm_mem_cuda.CudaError,
                       match=r"^allocating 4224 bytes on cuda:0: CUDA error \d+ \(.+\) "
                             r"\[SM-21\]$"):
        _symm_mem_cuda._Segment(torch.device("cuda", 0), 60)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_element_code_gives_the_cpu_kernels_bits_for_every_16_bit_pattern_SM_21(dtype):
    lib = _library()
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    for value, op in itertools.product([1.0, -3.5, 6e-8, 60000.0, 0.1, float("inf"),
                                        float("nan")], sm.REDUCE_OPS):
        other = torch.full_like(every, value)
        sources = (ctypes.c_void_p * 2)(every.data_ptr(), other.data_ptr())
        cuda_out, cpu_out = torch.empty_like(every), torch.empty_like(every)
        code, op_code = sm.SUPPORTED_DTYPES[dtype], sm.REDUCE_OPS[op]
        assert lib.rsmc_reduce_host(cuda_out.data_ptr(), sources, 2, every.numel(), code,
                                    op_code) == 0
        assert sm.c_kernels().rsm_reduce(ctypes.c_void_p(cpu_out.data_ptr()), sources, 2,
                                  ctypes.c_int64(every.numel()), code, op_code) == 0
        assert same_bits(cuda_out, cpu_out, op), (value, op)


def test_element_code_gives_the_cpu_kernels_bits_for_every_dtype_and_group_size_SM_21():
    lib = _library()
    specials = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, 3e38, -3e38]
    for dtype, op in [(d, o) for d in sm.SUPPORTED_DTYPES for o in sm.REDUCE_OPS]:
        for nsrc in (1, 2, 3, 7):
            inputs = []
            for r in range(nsrc):
                g = torch.Generator().manual_seed(31 * nsrc + r)
                if dtype.is_floating_point:
                    x = torch.randn(500, generator=g) * 1e3
                    x[r::9] = torch.tensor(specials).repeat(100)[: len(x[r::9])]
                else:
                    x = torch.randint(-1000, 1000, (500,), generator=g)
                    x[::4] = torch.iinfo(dtype).max - r  # sums wrap
                inputs.append(x.to(dtype))
            sources = (ctypes.c_void_p * nsrc)(*[x.data_ptr() for x in inputs])
            cuda_out, cpu_out = torch.empty_like(inputs[0]), torch.empty_like(inputs[0])
            code, op_code = sm.SUPPORTED_DTYPES[dtype], sm.REDUCE_OPS[op]
            status = lib.rsmc_reduce_host(cuda_out.data_ptr(), sources, nsrc, 500, code, op_code)
            if op == "avg" and not dtype.is_floating_point:
                assert status == sm.STATUS_BAD_ARGUMENT
                continue
            assert status == 0
            assert sm.c_kernels().rsm_reduce(ctypes.c_void_p(cpu_out.data_ptr()), sources, nsrc,
                                      ctypes.c_int64(500), code, op_code) == 0
            assert same_bits(cuda_out, cpu_out, op), (dtype, op, nsrc)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_symmetric_memory_imports_no_cuda_backend_without_cuda_SM_1():
    code = ("import sys, refimpl.symmetric_memory as sm; "
            "print('refimpl._symm_mem_cuda' in sys.modules, sorted(sm._allocators))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=_native.REPO_ROOT).stdout.split()
    assert out == ["False", "['cpu']"]


# ---- the handle's Python layer over a stand-in library (no GPU, no nvcc needed) ----------
class _StandInLibrary:
    """The C ABI's calls the handle makes, answering with the statuses a test sets."""

    def __init__(self):
        self.calls = []
        self.answer = {}  # function name -> (status, peer)

    def rsmc_context_create(self, device, rank, world, channels, bufs, pads, out):
        out._obj.value = 1234
        return 0

    def rsmc_context_destroy(self, context):
        return 0

    def rsmc_mismatched_calls(self, context, calls):
        calls[:] = [64, 0, 1 << 16 | 0 << 8 | 0, 32, 0, 1 << 16 | 0 << 8 | 0]
        return 0

    def __getattr__(self, name):
        def call(context, stream, *args):
            self.calls.append(name)
            status, peer = self.answer.get(name, (0, -1))
            args[-1][0] = peer
            return status
        return call


@pytest.fixture
def stand_in_handle(monkeypatch):
    from refimpl import _symm_mem_cuda

    lib = _StandInLibrary()
    monkeypatch.setattr(_symm_mem_cuda, "_lib", lib)
    monkeypatch.setattr(_symm_mem_cuda.CudaSymmetricMemory, "_stream", lambda self: 0)

    class Segment:
        device = torch.device("cuda", 0)
        pad_offset = 256

    handle = _symm_mem_cuda.CudaSymmetricMemory("g", 0, 2, 256, [4096, 8192], Segment(), [])
    return handle, lib


def test_cuda_handle_has_the_base_classs_primitives_and_statuses_SM_19_SM_20():
    import inspect

    from refimpl import _symm_mem_cuda

    cuda = _symm_mem_cuda.CudaSymmetricMemory
    for name, member in vars(sm.SymmetricMemory).items():
        own = vars(cuda).get(name)
        if callable(member) and own is not None and not name.startswith("__"):
            assert (list(inspect.signature(own).parameters)
                    == list(inspect.signature(member).parameters)), name
    for name in ("_put_signal", "_wait_signal", "_barrier", "_one_shot", "_two_shot",
                 "_mismatched_calls", "_tensor_at"):
        assert name in vars(cuda), f"the CUDA handle does not implement {name}"
    shared = {sm.STATUS_OK, sm.STATUS_PUT_TIMEOUT, sm.STATUS_WAIT_TIMEOUT,
              sm.STATUS_BAD_ARGUMENT, sm.STATUS_MISMATCH}
    own = {_symm_mem_cuda.STATUS_CUDA_ERROR, _symm_mem_cuda.STATUS_STUCK,
           _symm_mem_cuda.STATUS_CAPTURING}
    assert len(own) == 3 and not shared & own
    text = SOURCE.read_text()
    for status, value in [("RSM_MISMATCH", sm.STATUS_MISMATCH),
                          ("RSM_CUDA_ERROR", _symm_mem_cuda.STATUS_CUDA_ERROR),
                          ("RSM_STUCK", _symm_mem_cuda.STATUS_STUCK),
                          ("RSM_CAPTURING", _symm_mem_cuda.STATUS_CAPTURING)]:
        assert f"{status} = {value}," in text, status


def test_cuda_handle_fails_stop_after_a_barrier_timeout_SM_19(stand_in_handle):
    handle, lib = stand_in_handle
    handle.put_signal(1, channel=1, timeout_ms=10)
    lib.answer["rsmc_wait_signal"] = (sm.STATUS_WAIT_TIMEOUT, 1)
    with pytest.raises(sm.SymmMemTimeout, match=r"wait_signal: rank 1 of group 'g' did not"):
        handle.wait_signal(1, channel=1, timeout_ms=10)
    handle.put_signal(1, channel=1, timeout_ms=10)  # a timed-out wait left the handle usable
    lib.answer["rsmc_barrier"] = (sm.STATUS_WAIT_TIMEOUT, 1)
    with pytest.raises(sm.SymmMemTimeout, match=r"barrier: rank 1 of group 'g' did not") as e:
        handle.barrier(channel=2, timeout_ms=10)
    assert e.value.peer == 1
    called = len(lib.calls)
    for call in (lambda: handle.barrier(), lambda: handle.put_signal(1),
                 lambda: handle.wait_signal(1)):
        with pytest.raises(sm.SymmMemTimeout, match=r"unusable since an earlier timeout"):
            call()
    assert len(lib.calls) == called, "a fail-stopped handle touched a signal pad"


def test_cuda_handle_names_the_differing_call_SM_20(stand_in_handle):
    handle, lib = stand_in_handle
    lib.answer["rsmc_two_shot_all_reduce"] = (sm.STATUS_MISMATCH, 1)
    status, peer = handle._two_shot(0, 64, (0, 0), 1000)
    assert (status, peer) == (sm.STATUS_MISMATCH, 1)
    message = handle._mismatch(peer, "two_shot_all_reduce_")
    assert message.startswith("input: two_shot_all_reduce_ needs the same call")
    assert ("rank 1 called one_shot of 32 elements of torch.float32 at byte offset 0 with "
            "'sum', rank 0 called one_shot of 64 elements") in message


@pytest.mark.parametrize("copies", [False, True], ids=["wraps", "copies"])
def test_device_memory_is_wrapped_on_its_own_device_under_a_cpu_default_SM_21(monkeypatch,
                                                                              copies):
    """Under `with torch.device("cpu")` (the SM cases' ranks, or a user's program),
    torch.as_tensor copies __cuda_array_interface__ memory to the default device unless it
    is told the memory's device: the wrap names it (the first GPU run with `--device cuda`
    found every allocation refused), and a wrap that copied anyway is refused (SM-21)."""
    from types import SimpleNamespace

    from refimpl import _symm_mem_cuda

    asked = []

    def as_tensor(data, **kwargs):  # torch.as_tensor's choice of device, without a GPU
        asked.append(kwargs)
        device = kwargs.get("device") or torch.get_default_device()
        ptr = data.__cuda_array_interface__["data"][0]
        return SimpleNamespace(data_ptr=lambda: ptr + 64 if copies else ptr, device=device)

    monkeypatch.setattr(torch, "as_tensor", as_tensor)
    gpu = torch.device("cuda", 1)
    holder = _symm_mem_cuda._DeviceBytes(0x7F0000000000, 4096, gpu, owner=None)
    with torch.device("cpu"):
        if copies:
            with pytest.raises(RuntimeError, match=r"did not wrap .*SM-21"):
                _symm_mem_cuda._byte_tensor(holder)
        else:
            assert _symm_mem_cuda._byte_tensor(holder).device == gpu
    assert asked == [{"device": gpu}]


@pytest.mark.parametrize("first", ["refimpl._symm_mem_cuda", "refimpl.symmetric_memory"])
def test_either_module_imported_first_registers_one_cuda_allocator_SM_21(first):
    """Where torch sees a GPU (here pretended: nothing touches the GPU before an allocation)
    the CUDA allocator is registered once, whichever module a program imports first."""
    code = ("import torch, sys; torch.cuda.is_available = lambda: True; "
            f"import {first}; import refimpl.symmetric_memory as sm, refimpl._symm_mem_cuda as c; "
            "print(type(sm.get_allocator('cuda')).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=_native.REPO_ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["CudaAllocator"]


def test_the_cuda_backend_is_found_by_device_type_on_first_use_SM_1():
    """Symmetric memory imports no backend; the first request for "cuda" loads the one
    BACKEND_MODULES names, which registers itself where torch sees a GPU (pretended)."""
    code = ("import torch, sys; torch.cuda.is_available = lambda: True; "
            "import refimpl.symmetric_memory as sm; "
            "print('refimpl._symm_mem_cuda' in sys.modules, end=' '); "
            "print(type(sm.get_allocator('cuda')).__name__, "
            "'refimpl._symm_mem_cuda' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=_native.REPO_ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "CudaAllocator", "True"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_asking_for_cuda_without_a_gpu_names_the_device_type_and_loads_nothing_SM_1():
    code = ("import sys, refimpl.symmetric_memory as sm\n"
            "try:\n    sm.get_allocator('cuda')\n"
            "except ValueError as e:\n    print(e)\n"
            "print('refimpl._symm_mem_cuda' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=_native.REPO_ROOT).stdout.splitlines()
    assert out[0].startswith("device: expected a device type with a symmetric-memory "
                             "allocator") and "got device type 'cuda'" in out[0] \
        and out[0].endswith("[SM-1]"), out
    assert out[1] == "False"  # SM-21: nothing of the CUDA backend without a GPU
