/*
 * CUDA kernels of refimpl's symmetric memory (SPEC.md section 6: SM-9..SM-11, SM-15..SM-17
 * and SM-19, SM-20 on CUDA devices, and the CUDA backend's own rules SM-21..SM-23).
 *
 * STATUS: compiled by nvcc for sm_90 (+ compute_90 PTX) with warnings as errors, here and in
 * CI (tests/test_symm_mem_cuda_build.py), where the element arithmetic runs on the host
 * against the CPU kernels. Run on an H100 by tests/gpu/run_on_device.sh (2026-11-26):
 * tests/gpu and the SM conformance section on cuda pass, compute-sanitizer memcheck finds
 * nothing (benchmarks/results/symm_mem_cuda.md).
 *
 * CUDA C++ with the runtime API only, no torch headers: a C ABI loaded from Python with
 * ctypes (refimpl/_symm_mem_cuda.py), like kernels/cpu/symm_mem.c, whose protocol this is:
 *
 *   - memory (SM-21): a segment is one cudaMalloc'd block on a device, the buffer, the
 *     signal pad, then the op descriptor (64 bytes); peers map it through CUDA IPC (rsmc_ipc_get / rsmc_ipc_open, closed by
 *     rsmc_ipc_close). The pads are only ever written by these kernels.
 *   - signals (SM-9): a slot is a uint32 on the receiver's pad, EMPTY (0) or FULL (1): a put
 *     waits for EMPTY, then stores FULL with st.release.sys; a wait waits for FULL with
 *     ld.acquire.sys, then stores EMPTY. Each slot has one producer (the peer) and one
 *     consumer (the pad's owner), and each side writes only after it observed the other's
 *     write, so plain loads and stores suffice (no compare-and-swap). Unlike the CPU, no side
 *     sleeps, so the CPU's values 2 and 3 never appear. System scope: the peer is another
 *     process, possibly on another GPU.
 *   - barrier (SM-10): thread i of one block puts to peer (rank + i) % world, the block
 *     synchronises, then thread i waits for that peer: every put is out before any wait.
 *   - reductions (SM-15, SM-16): elementwise over the ranks' buffers in rank order, with the
 *     CPU kernel's own element code (16-bit floats accumulate in float32 and round once,
 *     avg divides the float32 sum, NaN propagates, integer sums wrap), compiled with
 *     -fmad=false -ftz=false -prec-div=true, so the result is bitwise the CPU kernel's, NaN
 *     payloads included (IEEE single-precision add, divide and compare are exact operations
 *     on both; rsmc_reduce_host runs this same element code on the host for the test).
 *     16-byte vector loads where every pointer allows, scalar otherwise: same bits.
 *
 *   - op descriptors (SM-20): before its first barrier an all-reduce writes its call (numel,
 *     byte offset, kind = algorithm << 16 | op << 8 | dtype, as the CPU's) into its own
 *     descriptor; after that barrier every rank compares every rank's with rank 0's. On a
 *     difference no kernel reads a peer's data, and the op runs exactly one more barrier,
 *     whichever its algorithm (two-shot skips its last), as the CPU's does: ranks that
 *     called different algorithms stay in step, and no rank writes its next call's
 *     descriptor before every rank has read this one's. The host then reports
 *     RSM_MISMATCH, naming the lowest differing rank, and both calls.
 *
 * An op is a sequence of kernels on the caller's stream (the current torch stream of the
 * tensor's device), so it is ordered after the work queued there: one-shot is one kernel
 * (one_shot_kernel: its first block describes, runs the first barrier and checks while the
 * others wait for it; the blocks reduce; the last block to finish runs the last barrier);
 * two-shot is describe, barrier, check, reduce-scatter, barrier, all-gather, barrier.
 * Kernel boundaries on one stream order the reduce after the barrier's acquire and the
 * barrier's release after the writes of the kernels before it; inside the one-shot kernel,
 * fences and a release/acquire flag between its blocks do.
 *
 * Timeouts (SM-11): the op's first kernel reads %globaltimer and stores the op's deadline in
 * a small device-side OpState; every wait of the op gives up at that deadline, and the
 * kernel that gives up records the status and the peer it waited for in OpState and in a
 * Report in mapped pinned host memory. Later kernels of the op see the failure and return at
 * once. Nothing traps: the context stays usable. The host waits for the op to finish by
 * polling an event recorded after its kernels, with its own, later deadline (the kernels'
 * timeout plus a grace, counted from when the op's first kernel reported its start in the
 * Report), so it never waits forever even if a kernel misbehaved (status RSM_STUCK), then
 * reads the Report.
 */
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <sched.h>
#include <time.h>
#include <type_traits>

#ifndef REFIMPL_SOURCE_HASH
#define REFIMPL_SOURCE_HASH "unknown"
#endif

namespace {

// Statuses (0..4 are kernels/cpu/symm_mem.c's; refimpl/symmetric_memory.py reads them).
enum Status {
  RSM_OK = 0,
  RSM_PUT_TIMEOUT = 1,
  RSM_WAIT_TIMEOUT = 2,
  RSM_BAD_ARGUMENT = 3,
  RSM_MISMATCH = 4,    // ranks called an all-reduce differently (SM-20)
  RSM_CUDA_ERROR = 5,  // a CUDA call failed; its cudaError_t is reported
  RSM_STUCK = 6,       // the kernels did not finish by the host's deadline
  RSM_CAPTURING = 7,   // the stream is being captured into a CUDA graph
};
enum { ALGO_ONE_SHOT = 1, ALGO_TWO_SHOT = 2 };
enum { DT_FLOAT32 = 0, DT_BFLOAT16 = 1, DT_FLOAT16 = 2, DT_INT32 = 3, DT_INT64 = 4 };
enum { OP_SUM = 0, OP_AVG = 1, OP_MAX = 2, OP_MIN = 3 };

constexpr int MAX_WORLD = 64;
constexpr uint32_t EMPTY = 0, FULL = 1;
constexpr int BARRIER_THREADS = MAX_WORLD;  // thread i handles the peer visited i-th (+1)
constexpr int THREADS = 256;                // reduce and copy kernels
constexpr int BLOCKS_PER_SM = 8;
constexpr int NONE = INT_MAX;
// Which barrier of an op a barrier kernel is: the first (starts the op's clock), a later
// one, or a later one that runs only while the ranks' calls agree (SM-20).
enum { BARRIER_NEXT = 0, BARRIER_FIRST = 1, BARRIER_IF_CALLS_AGREE = 2 };
constexpr int64_t SIGNAL_PAD_SIZE = 4096;  // a pad's bytes; the descriptor follows (SM-20)

// One pointer per rank, passed by value as a kernel parameter.
struct Pointers {
  char *p[MAX_WORLD];
};

// Device side of an op in flight: its deadline, its first failure, and the lowest rank whose
// call differs from rank 0's (-1: none), which skips the kernels that read peers' data.
struct OpState {
  unsigned long long deadline_ns;
  int status;
  int peer;
  int differing;
  // The one-shot kernel's blocks (one_shot_kernel): tickets taken, blocks done reading, and
  // whether the entry (ticket 0's) is done. Zero between ops: its last block resets them.
  unsigned int arrived;
  unsigned int finished;
  unsigned int entered;
};

// Host side (mapped pinned memory): what the host reads once the op finished; `calls`:
// (numel, byte offset, kind) of rank 0's call, then of the differing rank's.
struct Report {
  int started;  // set by the op's first kernel as it starts its clock (the host's deadline)
  int status;
  int peer;
  int differing;
  long long calls[6];
};

// -------------------------------------------------------------------------------------
// Signal slots: system-scope release/acquire, deadlines from %globaltimer
// -------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t load_relaxed_sys(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_sys(uint32_t *p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void store_relaxed_sys(uint32_t *p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Wait until *slot == want; false once the deadline passed without it. The value is read
// before the clock, so a slot that is ready at the deadline still counts.
__device__ bool await_slot(const uint32_t *slot, uint32_t want, bool acquire,
                           unsigned long long deadline_ns) {
  for (;;) {
    uint32_t v = acquire ? load_acquire_sys(slot) : load_relaxed_sys(slot);
    if (v == want) return true;
    if (globaltimer_ns() >= deadline_ns) return false;
    __nanosleep(100);  // fewer remote reads while waiting; well under a peer's latency
  }
}

// Producer: wait for EMPTY (the previous signal consumed), then FULL with release, so the
// writes made before the put are visible to whoever acquires FULL.
__device__ int put(uint32_t *slot, unsigned long long deadline_ns) {
  if (!await_slot(slot, EMPTY, false, deadline_ns)) return RSM_PUT_TIMEOUT;
  store_release_sys(slot, FULL);
  return RSM_OK;
}

// Consumer: wait for FULL with acquire, then clear it (only this side moves FULL -> EMPTY).
__device__ int take(uint32_t *slot, unsigned long long deadline_ns) {
  if (!await_slot(slot, FULL, true, deadline_ns)) return RSM_WAIT_TIMEOUT;
  store_relaxed_sys(slot, EMPTY);
  return RSM_OK;
}

// Slot [channel][peer] of a pad (the layout of SM-9, the same as the CPU's).
__device__ __forceinline__ uint32_t *slot_of(char *pad, int world, int channel, int peer) {
  return reinterpret_cast<uint32_t *>(pad) + static_cast<int64_t>(channel) * world + peer;
}

// Record the op's first failure where the later kernels (OpState) and the host (Report)
// see it. Called by one thread.
__device__ void record_failure(OpState *state, Report *report, int status, int peer) {
  state->status = status;
  state->peer = peer;
  report->status = status;
  report->peer = peer;
  __threadfence_system();
}

// Every op's kernels start with this, on one thread of one block: the first kernel of an op
// (`begin`) starts its clock and tells the host, whose own deadline counts from then; the
// others return early if an earlier kernel failed. Returns the deadline, or 0 when the op
// already failed.
__device__ unsigned long long op_deadline(OpState *state, Report *report, int begin,
                                          long long timeout_ns) {
  if (begin) {
    report->started = 1;
    state->deadline_ns = globaltimer_ns() + static_cast<unsigned long long>(timeout_ns);
    state->status = RSM_OK;
    state->peer = -1;
    state->differing = -1;
    return state->deadline_ns;
  }
  const volatile OpState *seen = state;  // another block of the kernel may have written it
  return seen->status == RSM_OK ? seen->deadline_ns : 0;
}

// -------------------------------------------------------------------------------------
// put_signal / wait_signal / barrier kernels (SM-9, SM-10)
// -------------------------------------------------------------------------------------
__global__ void __launch_bounds__(1) put_signal_kernel(char *dst_pad, int rank, int world,
                                                       int channel, int dst, OpState *state,
                                                       Report *report, long long timeout_ns) {
  unsigned long long deadline = op_deadline(state, report, 1, timeout_ns);
  if (put(slot_of(dst_pad, world, channel, rank), deadline))
    record_failure(state, report, RSM_PUT_TIMEOUT, dst);
}

__global__ void __launch_bounds__(1) wait_signal_kernel(char *my_pad, int src, int world,
                                                        int channel, OpState *state,
                                                        Report *report, long long timeout_ns) {
  unsigned long long deadline = op_deadline(state, report, 1, timeout_ns);
  if (take(slot_of(my_pad, world, channel, src), deadline))
    record_failure(state, report, RSM_WAIT_TIMEOUT, src);
}

// The barrier, run by every thread of one block of at least BARRIER_THREADS threads. Thread t
// visits peer (rank + t + 1) % world, so that ranks do not all start with rank 0 (the CPU's
// order). A failure is reported for the first late peer in that order; a failed put skips
// the waits, as on the CPU. `deadline`: 0 skips the barrier (the same on every thread).
__device__ __noinline__ void barrier_block(const Pointers &pads, int rank, int world,
                                           int channel, OpState *state, Report *report,
                                           unsigned long long deadline) {
  __shared__ int first_late_put, first_late_wait;
  if (deadline == 0) return;
  if (threadIdx.x == 0) {
    first_late_put = NONE;
    first_late_wait = NONE;
  }
  __syncthreads();
  const int visit = static_cast<int>(threadIdx.x) + 1;
  const bool mine = visit < world;
  const int peer = (rank + visit) % world;
  if (mine && put(slot_of(pads.p[peer], world, channel, rank), deadline))
    atomicMin(&first_late_put, visit);
  __syncthreads();  // phase 1 complete: every put is out before any wait
  if (first_late_put == NONE && mine &&
      take(slot_of(pads.p[rank], world, channel, peer), deadline))
    atomicMin(&first_late_wait, visit);
  __syncthreads();
  if (threadIdx.x == 0 && first_late_put != NONE)
    record_failure(state, report, RSM_PUT_TIMEOUT, (rank + first_late_put) % world);
  else if (threadIdx.x == 0 && first_late_wait != NONE)
    record_failure(state, report, RSM_WAIT_TIMEOUT, (rank + first_late_wait) % world);
  __syncthreads();  // the failure recorded before any thread reads the state
}

// Which barrier of an op this is (BARRIER_*): its deadline, or 0 to skip it (an earlier
// kernel failed; or the calls differ and it runs only while they agree). Thread 0 only.
__device__ unsigned long long barrier_deadline(OpState *state, Report *report,
                                               long long timeout_ns, int which) {
  unsigned long long deadline = op_deadline(state, report, which == BARRIER_FIRST,
                                            timeout_ns);
  const volatile OpState *seen = state;
  if (which == BARRIER_IF_CALLS_AGREE && seen->differing >= 0) deadline = 0;
  return deadline;
}

// One block of BARRIER_THREADS threads: one barrier of an op (`which`: BARRIER_*).
__global__ void __launch_bounds__(BARRIER_THREADS) barrier_kernel(
    const __grid_constant__ Pointers pads, int rank, int world, int channel, OpState *state,
    Report *report, long long timeout_ns, int which) {
  __shared__ unsigned long long deadline;
  if (threadIdx.x == 0) deadline = barrier_deadline(state, report, timeout_ns, which);
  __syncthreads();
  barrier_block(pads, rank, world, channel, state, report, deadline);
}

// -------------------------------------------------------------------------------------
// Op descriptors: the cross-rank check of an all-reduce's call (SM-20)
// -------------------------------------------------------------------------------------
__device__ __forceinline__ long long *descriptor_of(char *pad) {
  return reinterpret_cast<long long *>(pad + SIGNAL_PAD_SIZE);
}

__device__ __forceinline__ long long load_relaxed_sys64(const long long *p) {
  long long v;
  asm volatile("ld.relaxed.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Before the op's first barrier: this rank's call into its descriptor. The barrier's
// release (later on this stream, or after a block synchronisation) publishes it.
__device__ void describe(char *my_pad, long long numel, long long offset, long long kind) {
  volatile long long *d = descriptor_of(my_pad);
  d[0] = numel;
  d[1] = offset;
  d[2] = kind;
  __threadfence_system();
}

__global__ void __launch_bounds__(1) describe_kernel(char *my_pad, long long numel,
                                                     long long offset, long long kind) {
  describe(my_pad, numel, offset, kind);
}

// After the op's first barrier (its acquire saw every peer's descriptor): the lowest rank
// whose call differs from rank 0's. Every rank reads the same descriptors, so every rank
// names the same one; no peer writes its next call's before this op's last barrier.
__device__ void check_calls(const Pointers &pads, int world, OpState *state, Report *report) {
  const volatile OpState *seen = state;
  if (seen->status != RSM_OK) return;
  const long long *d0 = descriptor_of(pads.p[0]);
  long long first[3];
  for (int i = 0; i < 3; i++) first[i] = load_relaxed_sys64(d0 + i);
  for (int r = 1; r < world; r++) {
    const long long *d = descriptor_of(pads.p[r]);
    long long call[3];
    for (int i = 0; i < 3; i++) call[i] = load_relaxed_sys64(d + i);
    if (call[0] == first[0] && call[1] == first[1] && call[2] == first[2]) continue;
    for (int i = 0; i < 3; i++) {
      report->calls[i] = first[i];
      report->calls[3 + i] = call[i];
    }
    state->differing = r;
    report->differing = r;
    __threadfence_system();
    return;
  }
}

__global__ void __launch_bounds__(1) check_kernel(Pointers pads, int world, OpState *state,
                                                  Report *report) {
  check_calls(pads, world, state, report);
}

// The kernels that read peers' data run only while the op is in step and its calls agree.
__device__ __forceinline__ bool op_goes_on(const OpState *state) {
  const volatile OpState *seen = state;
  return seen->status == RSM_OK && seen->differing < 0;
}

// -------------------------------------------------------------------------------------
// Element arithmetic, host and device: the CPU kernel's (kernels/cpu/symm_mem.c) line by line
// -------------------------------------------------------------------------------------
__host__ __device__ __forceinline__ float bits_to_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

__host__ __device__ __forceinline__ uint32_t float_to_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}

__host__ __device__ __forceinline__ bool is_nan(float f) { return f != f; }

__host__ __device__ __forceinline__ float bf16_to_float(uint16_t h) {
  return bits_to_float(static_cast<uint32_t>(h) << 16);
}

__host__ __device__ __forceinline__ uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if (is_nan(f)) return static_cast<uint16_t>((u >> 16) | 0x0040);  // keep sign, quiet NaN
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

__host__ __device__ __forceinline__ float f16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1f,
           mant = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: exact in float
    float f = static_cast<float>(mant) * 0x1p-24f;
    return sign ? -f : f;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
}

__host__ __device__ __forceinline__ uint16_t float_to_f16(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t out;
  if (u >= (127u + 16) << 23) {  // overflow, inf or NaN
    out = u > 0x7f800000u ? 0x7e00 : 0x7c00;
  } else if (u < 113u << 23) {  // half subnormal or zero: let float addition round
    float magic = bits_to_float(126u << 23);
    out = float_to_bits(bits_to_float(u) + magic) - (126u << 23);
  } else {
    uint32_t odd = (u >> 13) & 1;
    u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfff + odd;
    out = u >> 13;
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

// A dtype: its storage type S, accumulator type A and the conversions between them.
template <class T, bool Floating>
struct Plain {  // stored as it is accumulated
  static constexpr bool floating = Floating;
  using S = T;
  using A = T;
  __host__ __device__ static A load(S x) { return x; }
  __host__ __device__ static S store(A a) { return a; }
};
using F32 = Plain<float, true>;
using I32 = Plain<int32_t, false>;
using I64 = Plain<int64_t, false>;

struct BF16 {
  static constexpr bool floating = true;
  using S = uint16_t;
  using A = float;
  __host__ __device__ static A load(S x) { return bf16_to_float(x); }
  __host__ __device__ static S store(A a) { return float_to_bf16(a); }
};
struct F16 {
  static constexpr bool floating = true;
  using S = uint16_t;
  using A = float;
  __host__ __device__ static A load(S x) { return f16_to_float(x); }
  __host__ __device__ static S store(A a) { return float_to_f16(a); }
};

// acc op x. max/min propagate NaN like torch.maximum / torch.minimum; integer sums wrap
// (two's complement; unsigned arithmetic avoids undefined behaviour).
template <int OP>
__host__ __device__ __forceinline__ float combine(float a, float b) {
  if constexpr (OP == OP_SUM || OP == OP_AVG) return a + b;
  if constexpr (OP == OP_MAX) return is_nan(a) ? a : (is_nan(b) ? b : (b > a ? b : a));
  return is_nan(a) ? a : (is_nan(b) ? b : (b < a ? b : a));
}

template <int OP>
__host__ __device__ __forceinline__ int32_t combine(int32_t a, int32_t b) {
  if constexpr (OP == OP_SUM) return static_cast<int32_t>(static_cast<uint32_t>(a) +
                                                          static_cast<uint32_t>(b));
  if constexpr (OP == OP_MAX) return b > a ? b : a;
  return b < a ? b : a;
}

template <int OP>
__host__ __device__ __forceinline__ int64_t combine(int64_t a, int64_t b) {
  if constexpr (OP == OP_SUM) return static_cast<int64_t>(static_cast<uint64_t>(a) +
                                                          static_cast<uint64_t>(b));
  if constexpr (OP == OP_MAX) return b > a ? b : a;
  return b < a ? b : a;
}

// The last step: avg divides the accumulated sum by the group size (float only).
template <class D, int OP>
__host__ __device__ __forceinline__ typename D::S finish(typename D::A acc, int nsrc) {
  if constexpr (OP == OP_AVG && D::floating) acc = acc / static_cast<typename D::A>(nsrc);
  return D::store(acc);
}

// -------------------------------------------------------------------------------------
// Reduce and copy kernels (SM-15, SM-16)
// -------------------------------------------------------------------------------------
// A load that goes to L2 (the GPU's point of coherence), not the SM's non-coherent L1; on
// the host (rsmc_reduce_host) a plain load.
template <class T>
__host__ __device__ __forceinline__ T load_global(const char *p) {
#ifdef __CUDA_ARCH__
  return __ldcg(reinterpret_cast<const T *>(p));
#else
  T v;
  memcpy(&v, p, sizeof(T));
  return v;
#endif
}

template <class T>
__host__ __device__ __forceinline__ void store_global(char *p, T v) {
#ifdef __CUDA_ARCH__
  *reinterpret_cast<T *>(p) = v;
#else
  memcpy(p, &v, sizeof(T));
#endif
}

// out[i] = srcs[0][i] op srcs[1][i] op ... for element i.
template <class D, int OP>
__host__ __device__ __forceinline__ void reduce_element(const Pointers &srcs, int nsrc,
                                                        char *out, int64_t i) {
  using S = typename D::S;
  const int64_t at = i * static_cast<int64_t>(sizeof(S));
  typename D::A acc = D::load(load_global<S>(srcs.p[0] + at));
  for (int r = 1; r < nsrc; r++)
    acc = combine<OP>(acc, D::load(load_global<S>(srcs.p[r] + at)));
  store_global<S>(out + at, finish<D, OP>(acc, nsrc));
}

// The same for the N elements of 16-byte vector v: one 16-byte load per rank.
template <class D, int OP>
__device__ __forceinline__ void reduce_vector(const Pointers &srcs, int nsrc, char *out,
                                              int64_t v) {
  using S = typename D::S;
  constexpr int N = 16 / sizeof(S);
  union Vec {
    uint4 bits;
    S lane[N];
  };
  const int64_t at = v * 16;
  Vec x;
  typename D::A acc[N];
  x.bits = load_global<uint4>(srcs.p[0] + at);
#pragma unroll
  for (int k = 0; k < N; k++) acc[k] = D::load(x.lane[k]);
  for (int r = 1; r < nsrc; r++) {
    x.bits = load_global<uint4>(srcs.p[r] + at);
#pragma unroll
    for (int k = 0; k < N; k++) acc[k] = combine<OP>(acc[k], D::load(x.lane[k]));
  }
#pragma unroll
  for (int k = 0; k < N; k++) x.lane[k] = finish<D, OP>(acc[k], nsrc);
  *reinterpret_cast<uint4 *>(out + at) = x.bits;
}

// `numel` elements from every srcs.p[r] into `out` (which may be one of them: each element
// is stored after all of its sources were read). `vectorized`: every pointer is 16-byte
// aligned, so the first numel / N elements go as vectors.
template <class D, int OP>
__device__ __forceinline__ void reduce_range(const Pointers &srcs, int nsrc, char *out,
                                             int64_t numel, int vectorized) {
  constexpr int N = 16 / sizeof(typename D::S);
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t vectors = vectorized ? numel / N : 0;
  for (int64_t v = first; v < vectors; v += stride) reduce_vector<D, OP>(srcs, nsrc, out, v);
  for (int64_t i = vectors * N + first; i < numel; i += stride)
    reduce_element<D, OP>(srcs, nsrc, out, i);
}

template <class D, int OP>
__global__ void __launch_bounds__(THREADS) reduce_kernel(Pointers srcs, int nsrc, char *out,
                                                         int64_t numel, int vectorized,
                                                         const OpState *state) {
  if (!op_goes_on(state)) return;  // an earlier kernel failed, or the calls differ
  reduce_range<D, OP>(srcs, nsrc, out, numel, vectorized);
}

// -------------------------------------------------------------------------------------
// One-shot in one kernel: entry (describe, first barrier, check), reduce, last barrier
// -------------------------------------------------------------------------------------
// One launch instead of five (a one-shot of up to 1 MiB is all launch and synchronisation
// cost). The blocks coordinate through OpState without assuming they are all resident at
// once: the first block to start (ticket 0, so it is running) does the entry alone while the
// others wait for it on the device; the last block to finish reading (the finished count)
// runs the last barrier, so no peer's input changes before every block of this rank read
// it; then it resets the counters for the next op on the stream.
struct OneShot {
  Pointers pads, srcs;
  char *out;
  int64_t numel, offset;
  long long kind, timeout_ns;
  int rank, world, channel, vectorized;
  OpState *state;
  Report *report;
};

__device__ __forceinline__ void store_release_gpu(unsigned int *p, unsigned int v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned int load_acquire_gpu(const unsigned int *p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Ticket 0's block: the op's clock, this rank's call, the first barrier, the check (SM-20).
__device__ __noinline__ void one_shot_entry(const OneShot &c) {
  __shared__ unsigned long long deadline;
  if (threadIdx.x == 0) {
    deadline = op_deadline(c.state, c.report, 1, c.timeout_ns);
    describe(c.pads.p[c.rank], c.numel, c.offset, c.kind);
  }
  __syncthreads();  // the call described before any thread's put publishes it
  barrier_block(c.pads, c.rank, c.world, c.channel, c.state, c.report, deadline);
  if (threadIdx.x == 0) check_calls(c.pads, c.world, c.state, c.report);
}

template <class D, int OP>
__global__ void __launch_bounds__(THREADS)
    one_shot_kernel(const __grid_constant__ OneShot c) {
  __shared__ unsigned int ticket;
  __shared__ int goes_on, last;
  if (threadIdx.x == 0) ticket = atomicAdd(&c.state->arrived, 1u);
  __syncthreads();
  if (ticket == 0) {
    one_shot_entry(c);
    if (threadIdx.x == 0) {
      __threadfence();
      store_release_gpu(&c.state->entered, 1u);
    }
  } else if (threadIdx.x == 0) {
    while (load_acquire_gpu(&c.state->entered) == 0) __nanosleep(100);
  }
  if (threadIdx.x == 0) goes_on = op_goes_on(c.state);
  __syncthreads();
  if (goes_on) reduce_range<D, OP>(c.srcs, c.world, c.out, c.numel, c.vectorized);
  __syncthreads();  // this block's reads of its peers' inputs are done
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(&c.state->finished, 1u) == gridDim.x - 1;
    if (last) __threadfence();
  }
  __syncthreads();
  if (!last) return;
  __shared__ unsigned long long deadline;
  if (threadIdx.x == 0)
    deadline = barrier_deadline(c.state, c.report, c.timeout_ns, BARRIER_NEXT);
  __syncthreads();
  barrier_block(c.pads, c.rank, c.world, c.channel, c.state, c.report, deadline);
  if (threadIdx.x == 0) {  // every other block is past its last use of the counters
    c.state->arrived = 0;
    c.state->finished = 0;
    c.state->entered = 0;
  }
}

// All-gather of two-shot: blockIdx.y = p copies bytes [begin[p], end[p]) of rank p's buffer
// into the same place of this rank's (p != rank). Source and destination sit at the same
// offset from their bases, so after a byte head both are 16-byte aligned (if the bases'
// alignments ever differed, every byte goes on its own).
struct Ranges {
  int64_t begin[MAX_WORLD], end[MAX_WORLD];
};

__global__ void __launch_bounds__(THREADS) gather_kernel(Pointers bufs, Ranges ranges, int rank,
                                                         const OpState *state) {
  const int p = static_cast<int>(blockIdx.y);
  if (!op_goes_on(state) || p == rank) return;
  const char *src = bufs.p[p] + ranges.begin[p];
  char *dst = bufs.p[rank] + ranges.begin[p];
  const int64_t n = ranges.end[p] - ranges.begin[p];
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  const int64_t misaligned = static_cast<int64_t>(d & 15);
  int64_t head = misaligned ? (16 - misaligned < n ? 16 - misaligned : n) : 0;
  if (((d ^ s) & 15) != 0) head = n;
  const int64_t vectors = (n - head) / 16;
  for (int64_t i = first; i < head; i += stride) dst[i] = load_global<char>(src + i);
  for (int64_t v = first; v < vectors; v += stride)
    reinterpret_cast<uint4 *>(dst + head)[v] = load_global<uint4>(src + head + v * 16);
  for (int64_t i = head + vectors * 16 + first; i < n; i += stride)
    dst[i] = load_global<char>(src + i);
}

// -------------------------------------------------------------------------------------
// Host side: the handle's context, launches, waiting for an op
// -------------------------------------------------------------------------------------
const int64_t ELEMENT_SIZE[] = {4, 2, 2, 4, 8};

// Makes `device` current for the calling thread and restores the previous one (torch's).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    error_ = previous_ == device ? cudaSuccess : cudaSetDevice(device);
    if (previous_ == device) previous_ = -1;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard &) = delete;
  DeviceGuard &operator=(const DeviceGuard &) = delete;
  cudaError_t error() const { return error_; }

 private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

// What a handle (refimpl's CudaSymmetricMemory) holds on the C side.
struct Context {
  int device, rank, world, channels, max_blocks;
  Pointers bufs, pads;
  OpState *state;          // device memory
  Report *report;          // mapped pinned host memory, as the host sees it
  Report *report_device;   // the same, as kernels see it
  cudaEvent_t after;          // recorded after an op's kernels
};

int64_t now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// Wait for the op's kernels: 0 once `ctx->after` completed, a cudaError_t if it failed, -1
// if `budget_ns` passed since the op's first kernel started (Report.started). The work
// queued before the kernels (torch's) is waited for without a deadline, as torch itself
// would. Spin briefly (a small op takes microseconds), then yield, then sleep 50 us at a
// time. One event, no second one before the kernels: each costs the host a call.
int wait_for_op(Context *ctx, int64_t budget_ns) {
  const volatile Report *report = ctx->report;  // written by the kernels, through PCIe
  const int64_t start = now_ns();
  int64_t deadline = INT64_MAX;
  for (;;) {
    cudaError_t err = cudaEventQuery(ctx->after);
    if (err == cudaSuccess) return 0;
    if (err != cudaErrorNotReady) return static_cast<int>(err);
    int64_t now = now_ns();
    if (deadline == INT64_MAX && report->started) deadline = now + budget_ns;
    if (now >= deadline) return -1;
    if (now - start < 20000) continue;
    if (now - start < 1000000) {
      sched_yield();
    } else {
      struct timespec pause = {0, 50000};
      nanosleep(&pause, nullptr);
    }
  }
}

// After the op's kernels were queued: wait for them and return their status. The grace
// covers the kernels' own work and their scheduling on a GPU that time-slices processes.
// A launch that failed is reported only once the kernels queued before it are done, so
// none is left running.
int finish_op(Context *ctx, cudaStream_t stream, long long timeout_ns, int32_t *report_out) {
  const cudaError_t launch = cudaGetLastError();
  cudaError_t err = cudaEventRecord(ctx->after, stream);
  if (err != cudaSuccess) {
    report_out[1] = static_cast<int32_t>(err);
    return RSM_CUDA_ERROR;
  }
  const long long grace = timeout_ns > 2000000000LL ? timeout_ns : 2000000000LL;
  const int waited = wait_for_op(ctx, timeout_ns + grace);
  if (waited == -1) return RSM_STUCK;
  if (waited != 0 || launch != cudaSuccess) {
    report_out[1] = waited != 0 ? waited : static_cast<int32_t>(launch);
    return RSM_CUDA_ERROR;
  }
  const volatile Report *report = ctx->report;
  if (report->status == RSM_OK && report->differing >= 0) {
    report_out[0] = report->differing;
    return RSM_MISMATCH;
  }
  report_out[0] = report->peer;
  return report->status;
}

// Timeouts past this (about 13 days) are this: deadlines never overflow.
constexpr long long MAX_TIMEOUT_NS = 1LL << 50;

long long bounded(long long timeout_ns) {
  return timeout_ns < MAX_TIMEOUT_NS ? timeout_ns : MAX_TIMEOUT_NS;
}

// Before an op (on the op's device): refuse stream capture (the host waits for the
// kernels), clear the report.
int start_op(Context *ctx, cudaStream_t stream, const DeviceGuard &guard, int32_t *report_out) {
  report_out[0] = -1;
  report_out[1] = 0;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t err = guard.error();
  if (err == cudaSuccess) err = cudaStreamIsCapturing(stream, &capture);
  if (err != cudaSuccess) {
    report_out[1] = static_cast<int32_t>(err);
    return RSM_CUDA_ERROR;
  }
  if (capture != cudaStreamCaptureStatusNone) return RSM_CAPTURING;
  ctx->report->started = 0;
  ctx->report->status = RSM_OK;
  ctx->report->peer = -1;
  ctx->report->differing = -1;
  return RSM_OK;
}

cudaStream_t stream_of(uint64_t stream) {
  return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream));
}

bool valid_channel(const Context *ctx, int channel) {
  return channel >= 0 && channel < ctx->channels;
}

// Every call: its arguments checked, its device current, then `launch(stream, timeout_ns)`
// queues its kernels between start_op and finish_op.
template <class Launch>
int run_call(Context *ctx, uint64_t stream, bool valid, long long timeout_ns,
             int32_t *report_out, Launch &&launch) {
  if (!valid || timeout_ns < 0) return RSM_BAD_ARGUMENT;
  timeout_ns = bounded(timeout_ns);
  DeviceGuard guard(ctx->device);
  const cudaStream_t s = stream_of(stream);
  const int status = start_op(ctx, s, guard, report_out);
  if (status != RSM_OK) return status;
  launch(s, timeout_ns);
  return finish_op(ctx, s, timeout_ns, report_out);
}

int blocks_for(const Context *ctx, int64_t units) {
  int64_t blocks = (units + THREADS - 1) / THREADS;
  if (blocks < 1) blocks = 1;
  return static_cast<int>(blocks < ctx->max_blocks ? blocks : ctx->max_blocks);
}

void launch_barrier(Context *ctx, cudaStream_t stream, int channel, long long timeout_ns,
                    int which) {
  barrier_kernel<<<1, BARRIER_THREADS, 0, stream>>>(ctx->pads, ctx->rank, ctx->world, channel,
                                                    ctx->state, ctx->report_device, timeout_ns,
                                                    which);
}

// An all-reduce's call as its descriptor holds it (SM-20): algorithm, op, dtype.
long long kind_of(int algorithm, int op, int dtype) {
  return static_cast<long long>(algorithm) << 16 | op << 8 | dtype;
}

// An all-reduce's start: its call into this rank's descriptor, the first barrier, and the
// cross-rank check of the calls (SM-20).
void launch_entry(Context *ctx, cudaStream_t stream, int channel, long long timeout_ns,
                  int64_t numel, int64_t offset, int algorithm, int op, int dtype) {
  const long long kind = kind_of(algorithm, op, dtype);
  describe_kernel<<<1, 1, 0, stream>>>(ctx->pads.p[ctx->rank], numel, offset, kind);
  launch_barrier(ctx, stream, channel, timeout_ns, BARRIER_FIRST);
  check_kernel<<<1, 1, 0, stream>>>(ctx->pads, ctx->world, ctx->state, ctx->report_device);
}

// Call f(D{}, std::integral_constant<int, OP>{}) for the dtype and reduce op codes; avg only
// for floating dtypes. Host and device reductions are dispatched the same way.
template <class D, class F>
int with_op(int op, F &&f) {
  switch (op) {
    case OP_SUM: f(D{}, std::integral_constant<int, OP_SUM>{}); return RSM_OK;
    case OP_MAX: f(D{}, std::integral_constant<int, OP_MAX>{}); return RSM_OK;
    case OP_MIN: f(D{}, std::integral_constant<int, OP_MIN>{}); return RSM_OK;
    case OP_AVG:
      if constexpr (D::floating) {
        f(D{}, std::integral_constant<int, OP_AVG>{});
        return RSM_OK;
      }
      return RSM_BAD_ARGUMENT;
    default: return RSM_BAD_ARGUMENT;
  }
}

template <class F>
int with_types(int dtype, int op, F &&f) {
  switch (dtype) {
    case DT_FLOAT32: return with_op<F32>(op, f);
    case DT_BFLOAT16: return with_op<BF16>(op, f);
    case DT_FLOAT16: return with_op<F16>(op, f);
    case DT_INT32: return with_op<I32>(op, f);
    case DT_INT64: return with_op<I64>(op, f);
    default: return RSM_BAD_ARGUMENT;
  }
}

// Whether every rank's source and `out` are 16-byte aligned (ranks share the offset; `out`
// is the caller's): the reductions then go by 16-byte vectors, else by scalars.
bool all_aligned(const Context *ctx, const Pointers &srcs, const char *out) {
  bool aligned = (reinterpret_cast<uintptr_t>(out) & 15) == 0;
  for (int r = 0; r < ctx->world; r++)
    aligned = aligned && (reinterpret_cast<uintptr_t>(srcs.p[r]) & 15) == 0;
  return aligned;
}

// The blocks a reduction of `numel` elements of D needs: one thread per 16-byte vector
// (and per element of the tail) when vectorized, per element otherwise.
template <class D>
int reduce_blocks(const Context *ctx, int64_t numel, bool vectorized) {
  constexpr int N = 16 / sizeof(typename D::S);
  return blocks_for(ctx, vectorized ? numel / N + numel % N : numel);
}

// Reduce `numel` elements at srcs.p[r] (r < world) into `out`.
int launch_reduce(Context *ctx, cudaStream_t stream, int dtype, int op, const Pointers &srcs,
                  char *out, int64_t numel) {
  if (numel == 0) return RSM_OK;
  const bool aligned = all_aligned(ctx, srcs, out);
  return with_types(dtype, op, [&](auto d, auto op_tag) {
    using D = decltype(d);
    reduce_kernel<D, decltype(op_tag)::value>
        <<<reduce_blocks<D>(ctx, numel, aligned), THREADS, 0, stream>>>(
            srcs, ctx->world, out, numel, aligned ? 1 : 0, ctx->state);
  });
}

// The one-shot kernel over every rank's input at byte `offset` into `out`.
void launch_one_shot(Context *ctx, cudaStream_t stream, int channel, long long timeout_ns,
                     int64_t offset, int64_t numel, int dtype, int op, char *out) {
  OneShot c = {};
  c.pads = ctx->pads;
  for (int r = 0; r < ctx->world; r++) c.srcs.p[r] = ctx->bufs.p[r] + offset;
  const bool aligned = all_aligned(ctx, c.srcs, out);
  c.out = out;
  c.numel = numel;
  c.offset = offset;
  c.kind = kind_of(ALGO_ONE_SHOT, op, dtype);
  c.timeout_ns = timeout_ns;
  c.rank = ctx->rank;
  c.world = ctx->world;
  c.channel = channel;
  c.vectorized = aligned ? 1 : 0;
  c.state = ctx->state;
  c.report = ctx->report_device;
  with_types(dtype, op, [&](auto d, auto op_tag) {
    using D = decltype(d);
    one_shot_kernel<D, decltype(op_tag)::value>
        <<<reduce_blocks<D>(ctx, numel, aligned), THREADS, 0, stream>>>(c);
  });
}

bool valid_op(int dtype, int op) {
  if (dtype < DT_FLOAT32 || dtype > DT_INT64 || op < OP_SUM || op > OP_MIN) return false;
  return !(op == OP_AVG && (dtype == DT_INT32 || dtype == DT_INT64));
}

std::atomic<int> live_segments{0};  // cudaMalloc'd segments of this process not yet freed
std::atomic<int> live_mappings{0};  // peers' segments this process has open

}  // namespace

// =====================================================================================
// The C ABI (refimpl/_symm_mem_cuda.py declares the same signatures)
// =====================================================================================
extern "C" {

// The build stamps the hash of this file and its flags in, so a loader can tell a stale one.
const char *rsmc_source_hash(void) { return REFIMPL_SOURCE_HASH; }

const char *rsmc_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

int rsmc_ipc_handle_size(void) { return static_cast<int>(sizeof(cudaIpcMemHandle_t)); }

int rsmc_device_count(int *count) {
  *count = 0;
  return static_cast<int>(cudaGetDeviceCount(count));
}

int rsmc_live_segments(void) { return live_segments; }
int rsmc_live_mappings(void) { return live_mappings; }

// ---- memory (SM-21) -----------------------------------------------------------------

// A segment of `nbytes` on `device` whose signal pad ([pad_offset, nbytes)) is zero once
// this returns (the device is synchronised: no peer may see a pad before it is zero).
int rsmc_segment_alloc(int device, int64_t nbytes, int64_t pad_offset, void **ptr_out) {
  *ptr_out = nullptr;
  if (nbytes <= 0 || pad_offset < 0 || pad_offset > nbytes) return cudaErrorInvalidValue;
  DeviceGuard guard(device);
  cudaError_t err = guard.error();
  void *ptr = nullptr;
  if (err == cudaSuccess) err = cudaMalloc(&ptr, static_cast<size_t>(nbytes));
  if (err != cudaSuccess) return static_cast<int>(err);
  err = cudaMemset(static_cast<char *>(ptr) + pad_offset, 0,
                   static_cast<size_t>(nbytes - pad_offset));
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    cudaFree(ptr);
    return static_cast<int>(err);
  }
  live_segments++;
  *ptr_out = ptr;
  return cudaSuccess;
}

// cudaFree synchronises the device first, so no queued kernel still uses the segment.
int rsmc_segment_free(int device, void *ptr) {
  DeviceGuard guard(device);
  cudaError_t err = guard.error();
  if (err == cudaSuccess) err = cudaFree(ptr);
  if (err == cudaSuccess) live_segments--;
  return static_cast<int>(err);
}

int rsmc_ipc_get(int device, void *ptr, void *handle_out) {
  DeviceGuard guard(device);
  cudaError_t err = guard.error();
  cudaIpcMemHandle_t handle;
  if (err == cudaSuccess) err = cudaIpcGetMemHandle(&handle, ptr);
  if (err == cudaSuccess) memcpy(handle_out, &handle, sizeof(handle));
  return static_cast<int>(err);
}

// Map a peer's segment on `device` (the peer may sit on another device: lazy peer access).
// A process cannot open a handle it made itself: a rank maps only its peers'.
int rsmc_ipc_open(int device, const void *handle_bytes, void **ptr_out) {
  *ptr_out = nullptr;
  DeviceGuard guard(device);
  cudaError_t err = guard.error();
  cudaIpcMemHandle_t handle;
  memcpy(&handle, handle_bytes, sizeof(handle));
  if (err == cudaSuccess) err = cudaIpcOpenMemHandle(ptr_out, handle,
                                                     cudaIpcMemLazyEnablePeerAccess);
  if (err == cudaSuccess) live_mappings++;
  return static_cast<int>(err);
}

// Unmap a peer's segment once no kernel of this device can still use it.
int rsmc_ipc_close(int device, void *ptr) {
  DeviceGuard guard(device);
  cudaError_t err = guard.error();
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaIpcCloseMemHandle(ptr);
  if (err == cudaSuccess) live_mappings--;
  return static_cast<int>(err);
}

// ---- the handle's context -------------------------------------------------------------

// bufs[r], pads[r]: rank r's buffer and signal pad as mapped in this process; `channels`:
// how many (channel, peer) rows of slots a pad holds (SM-9).
int rsmc_context_create(int device, int rank, int world, int channels, void *const *bufs,
                        void *const *pads, void **ctx_out) {
  *ctx_out = nullptr;
  if (world < 1 || world > MAX_WORLD || rank < 0 || rank >= world || channels < 1)
    return cudaErrorInvalidValue;
  DeviceGuard guard(device);
  cudaError_t err = guard.error();
  Context *ctx = new Context();
  ctx->device = device;
  ctx->rank = rank;
  ctx->world = world;
  ctx->channels = channels;
  for (int r = 0; r < world; r++) {
    ctx->bufs.p[r] = static_cast<char *>(bufs[r]);
    ctx->pads.p[r] = static_cast<char *>(pads[r]);
  }
  int sms = 0;
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                                                       device);
  ctx->max_blocks = (sms > 0 ? sms : 1) * BLOCKS_PER_SM;
  if (err == cudaSuccess) err = cudaMalloc(&ctx->state, sizeof(OpState));
  if (err == cudaSuccess) err = cudaMemset(ctx->state, 0, sizeof(OpState));
  if (err == cudaSuccess)
    err = cudaHostAlloc(&ctx->report, sizeof(Report),
                        cudaHostAllocMapped | cudaHostAllocPortable);
  if (err == cudaSuccess) err = cudaHostGetDevicePointer(&ctx->report_device, ctx->report, 0);
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&ctx->after, cudaEventDisableTiming);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    // Partial contexts are released field by field; a null field is skipped.
    if (ctx->state) cudaFree(ctx->state);
    if (ctx->report) cudaFreeHost(ctx->report);
    delete ctx;
    return static_cast<int>(err);
  }
  ctx->report->status = RSM_OK;
  ctx->report->peer = -1;
  ctx->report->differing = -1;
  *ctx_out = ctx;
  return cudaSuccess;
}

int rsmc_context_destroy(void *opaque) {
  Context *ctx = static_cast<Context *>(opaque);
  DeviceGuard guard(ctx->device);
  cudaError_t err = guard.error();
  if (err == cudaSuccess) err = cudaDeviceSynchronize();  // no kernel still uses the state
  cudaEventDestroy(ctx->after);
  cudaFree(ctx->state);
  cudaFreeHost(ctx->report);
  delete ctx;
  return static_cast<int>(err);
}

// ---- synchronisation (SM-9..SM-11) ----------------------------------------------------
// Each returns a Status; report_out[0] is the peer waited for on a timeout, report_out[1]
// the cudaError_t on RSM_CUDA_ERROR.

int rsmc_put_signal(void *opaque, uint64_t stream, int dst, int channel, long long timeout_ns,
                    int32_t *report_out) {
  Context *ctx = static_cast<Context *>(opaque);
  const bool valid = dst >= 0 && dst < ctx->world && valid_channel(ctx, channel);
  return run_call(ctx, stream, valid, timeout_ns, report_out, [&](cudaStream_t s, long long t) {
    put_signal_kernel<<<1, 1, 0, s>>>(ctx->pads.p[dst], ctx->rank, ctx->world, channel, dst,
                                      ctx->state, ctx->report_device, t);
  });
}

int rsmc_wait_signal(void *opaque, uint64_t stream, int src, int channel, long long timeout_ns,
                     int32_t *report_out) {
  Context *ctx = static_cast<Context *>(opaque);
  const bool valid = src >= 0 && src < ctx->world && valid_channel(ctx, channel);
  return run_call(ctx, stream, valid, timeout_ns, report_out, [&](cudaStream_t s, long long t) {
    wait_signal_kernel<<<1, 1, 0, s>>>(ctx->pads.p[ctx->rank], src, ctx->world, channel,
                                       ctx->state, ctx->report_device, t);
  });
}

int rsmc_barrier(void *opaque, uint64_t stream, int channel, long long timeout_ns,
                 int32_t *report_out) {
  Context *ctx = static_cast<Context *>(opaque);
  return run_call(ctx, stream, valid_channel(ctx, channel), timeout_ns, report_out,
                  [&](cudaStream_t s, long long t) {
                    launch_barrier(ctx, s, channel, t, BARRIER_FIRST);
                  });
}

// ---- all-reduce (SM-15, SM-16) ----------------------------------------------------------

// One-shot: barrier; every rank reduces every rank's input (at byte `offset` of each
// buffer) in rank order into `out`; barrier, so no input changes before all peers read it.
int rsmc_one_shot_all_reduce(void *opaque, uint64_t stream, int channel, int64_t offset,
                             int64_t numel, int dtype, int op, void *out, long long timeout_ns,
                             int32_t *report_out) {
  Context *ctx = static_cast<Context *>(opaque);
  const bool valid = valid_op(dtype, op) && offset >= 0 && numel >= 0 &&
                     valid_channel(ctx, channel);
  return run_call(ctx, stream, valid, timeout_ns, report_out, [&](cudaStream_t s, long long t) {
    launch_one_shot(ctx, s, channel, t, offset, numel, dtype, op, static_cast<char *>(out));
  });
}

// Two-shot, in place: chunks of ceil(numel / world) elements; rank r reduces chunk r of
// every rank into its own buffer (reduce-scatter), then, after a barrier, copies chunk p
// from rank p for every p != r (all-gather); a last barrier keeps every chunk unchanged
// until all peers copied it.
int rsmc_two_shot_all_reduce(void *opaque, uint64_t stream, int channel, int64_t offset,
                             int64_t numel, int dtype, int op, long long timeout_ns,
                             int32_t *report_out) {
  Context *ctx = static_cast<Context *>(opaque);
  const bool valid = valid_op(dtype, op) && offset >= 0 && numel >= 0 &&
                     valid_channel(ctx, channel);
  return run_call(ctx, stream, valid, timeout_ns, report_out, [&](cudaStream_t s, long long t) {
    const int world = ctx->world, rank = ctx->rank;
    const int64_t esize = ELEMENT_SIZE[dtype];
    const int64_t chunk = (numel + world - 1) / world;
    Ranges ranges = {};
    for (int r = 0; r < world; r++) {
      const int64_t b = chunk * r < numel ? chunk * r : numel;
      const int64_t e = b + chunk < numel ? b + chunk : numel;
      ranges.begin[r] = offset + b * esize;
      ranges.end[r] = offset + e * esize;
    }
    Pointers srcs = {};
    for (int r = 0; r < world; r++) srcs.p[r] = ctx->bufs.p[r] + ranges.begin[rank];
    const int64_t mine = (ranges.end[rank] - ranges.begin[rank]) / esize;
    launch_entry(ctx, s, channel, t, numel, offset, ALGO_TWO_SHOT, op, dtype);
    launch_reduce(ctx, s, dtype, op, srcs, srcs.p[rank], mine);
    launch_barrier(ctx, s, channel, t, BARRIER_NEXT);
    if (numel > 0 && world > 1) {
      const dim3 grid(blocks_for(ctx, (chunk * esize + 15) / 16), world);
      gather_kernel<<<grid, THREADS, 0, s>>>(ctx->bufs, ranges, rank, ctx->state);
    }
    launch_barrier(ctx, s, channel, t, BARRIER_IF_CALLS_AGREE);
  });
}

// The two calls of the last RSM_MISMATCH: (numel, byte offset, kind) of rank 0's, then of
// the differing rank's (SM-20).
int rsmc_mismatched_calls(void *opaque, long long *calls_out) {
  const Context *ctx = static_cast<const Context *>(opaque);
  const volatile Report *report = ctx->report;
  for (int i = 0; i < 6; i++) calls_out[i] = report->calls[i];
  return RSM_OK;
}

// ---- the element arithmetic on the host (tests compare it with kernels/cpu/symm_mem.c) --

int rsmc_reduce_host(void *out, void *const *srcs, int nsrc, int64_t numel, int dtype, int op) {
  if (nsrc < 1 || nsrc > MAX_WORLD || numel < 0 || !valid_op(dtype, op)) return RSM_BAD_ARGUMENT;
  Pointers from = {};
  for (int r = 0; r < nsrc; r++) from.p[r] = static_cast<char *>(srcs[r]);
  return with_types(dtype, op, [&](auto d, auto op_tag) {
    for (int64_t i = 0; i < numel; i++)
      reduce_element<decltype(d), decltype(op_tag)::value>(from, nsrc, static_cast<char *>(out),
                                                          i);
  });
}

}  // extern "C"
