/*
 * CPU kernels of refimpl's symmetric memory (SPEC.md section 6, SM-*).
 *
 * Plain C11, no torch headers; loaded from Python with ctypes. Every pointer handed in
 * points into POSIX shared memory mapped by all ranks of a group, so these functions
 * synchronise real processes:
 *
 *   - signals (SM-12): a signal slot is a uint32 on the receiver's signal pad. put sets it
 *     0 -> 1 with release ordering (waiting while the previous signal is unconsumed);
 *     wait sets it 1 -> 0 with acquire ordering. A completed synchronisation therefore
 *     leaves every slot zero, and whatever the sender wrote before `put` is visible to
 *     the receiver after `wait`.
 *   - barrier (SM-13): put to every peer, then wait for every peer, on one channel.
 *   - reductions (SM-16..SM-18): elementwise over the ranks' buffers in rank order, so
 *     every rank computes bitwise the same result; 16-bit floats accumulate in float32
 *     and round once.
 *
 * Every wait has a deadline (SM-14). Waits back off (spin, then sched_yield, then short
 * sleeps) because ranks may outnumber cores. A wait that times out reports the peer it
 * waited for through `*peer_out`.
 */
#define _GNU_SOURCE
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#ifndef REFIMPL_SOURCE_HASH
#define REFIMPL_SOURCE_HASH "unknown"
#endif

/* The build stamps the hash of this file in, so a loader can tell a stale library. */
const char *rsm_source_hash(void) { return REFIMPL_SOURCE_HASH; }

enum { RSM_OK = 0, RSM_PUT_TIMEOUT = 1, RSM_WAIT_TIMEOUT = 2, RSM_BAD_ARGUMENT = 3 };
enum { DT_FLOAT32 = 0, DT_BFLOAT16 = 1, DT_FLOAT16 = 2, DT_INT32 = 3, DT_INT64 = 4 };
enum { OP_SUM = 0, OP_AVG = 1, OP_MAX = 2, OP_MIN = 3 };

/* ---------------------------------------------------------------------------------- */
/* Waiting with a deadline and backoff                                                 */
/* ---------------------------------------------------------------------------------- */

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

#define SPIN_STEPS 256
#define YIELD_STEPS 4096
#define SLEEP_NS 20000

/* One step of waiting. Spinning is fastest when every rank has a core; when ranks
 * outnumber cores a spinning waiter would steal the core of the rank it waits for, so
 * after a short spin it yields, and after that it sleeps. */
static void backoff(uint32_t step) {
  if (step < SPIN_STEPS) {
    cpu_relax();
  } else if (step < YIELD_STEPS) {
    sched_yield();
  } else {
    struct timespec ts = {0, SLEEP_NS};
    nanosleep(&ts, NULL);
  }
}

/* Swap *slot from `from` to `to` once it holds `from`; 0 on success, 1 on timeout. */
static int swap_when(_Atomic uint32_t *slot, uint32_t from, uint32_t to, memory_order order,
                     int64_t deadline_ns) {
  for (uint32_t step = 0;; step++) {
    uint32_t expected = from;
    if (atomic_compare_exchange_weak_explicit(slot, &expected, to, order,
                                              memory_order_relaxed))
      return 0;
    if (step >= SPIN_STEPS && now_ns() > deadline_ns) return 1;
    backoff(step);
  }
}

static _Atomic uint32_t *slot_of(uint32_t *pad, int world, int channel, int peer) {
  return (_Atomic uint32_t *)(pad + (int64_t)channel * world + peer);
}

/* put_signal: set slot [channel][rank] of dst's pad 0 -> 1 (release). */
int rsm_put_signal(uint32_t *dst_pad, int rank, int world, int channel, int64_t timeout_ns) {
  return swap_when(slot_of(dst_pad, world, channel, rank), 0, 1, memory_order_release,
                   now_ns() + timeout_ns)
             ? RSM_PUT_TIMEOUT
             : RSM_OK;
}

/* wait_signal: set slot [channel][src] of my own pad 1 -> 0 (acquire). */
int rsm_wait_signal(uint32_t *my_pad, int src, int world, int channel, int64_t timeout_ns) {
  return swap_when(slot_of(my_pad, world, channel, src), 1, 0, memory_order_acquire,
                   now_ns() + timeout_ns)
             ? RSM_WAIT_TIMEOUT
             : RSM_OK;
}

static int barrier_until(uint32_t **pads, int rank, int world, int channel,
                         int64_t deadline_ns, int32_t *peer_out) {
  /* Visit peers starting after `rank` so that ranks do not all hit rank 0 first. */
  for (int i = 1; i < world; i++) {
    int peer = (rank + i) % world;
    if (swap_when(slot_of(pads[peer], world, channel, rank), 0, 1, memory_order_release,
                  deadline_ns)) {
      *peer_out = peer;
      return RSM_PUT_TIMEOUT;
    }
  }
  for (int i = 1; i < world; i++) {
    int peer = (rank + i) % world;
    if (swap_when(slot_of(pads[rank], world, channel, peer), 1, 0, memory_order_acquire,
                  deadline_ns)) {
      *peer_out = peer;
      return RSM_WAIT_TIMEOUT;
    }
  }
  return RSM_OK;
}

/* barrier: every rank signals every peer, then waits for every peer, on `channel`. */
int rsm_barrier(uint32_t **pads, int rank, int world, int channel, int64_t timeout_ns,
                int32_t *peer_out) {
  return barrier_until(pads, rank, world, channel, now_ns() + timeout_ns, peer_out);
}

/* ---------------------------------------------------------------------------------- */
/* 16-bit float conversions (round to nearest even, as torch does)                     */
/* ---------------------------------------------------------------------------------- */

static inline float bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

static inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if (isnan(f)) return (uint16_t)((u >> 16) | 0x0040); /* keep sign, quiet NaN */
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

static inline float f16_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) { /* zero or subnormal: exact in float */
    float f = (float)mant * 0x1p-24f;
    return sign ? -f : f;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
}

static inline uint16_t float_to_f16(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t out;
  if (u >= (127u + 16) << 23) { /* overflow, inf or NaN */
    out = u > 0x7f800000u ? 0x7e00 : 0x7c00;
  } else if (u < 113u << 23) { /* half subnormal or zero: let float addition round */
    float magic = bits_to_float(126u << 23);
    out = float_to_bits(bits_to_float(u) + magic) - (126u << 23);
  } else {
    uint32_t odd = (u >> 13) & 1;
    u += ((uint32_t)(15 - 127) << 23) + 0xfff + odd;
    out = u >> 13;
  }
  return (uint16_t)(out | (sign >> 16));
}

/* ---------------------------------------------------------------------------------- */
/* Reductions in rank order                                                            */
/* ---------------------------------------------------------------------------------- */

#define BLOCK 256

/* max/min that propagate NaN, like torch.maximum / torch.minimum. */
#define FMAX(a, b) (isnan(a) ? (a) : (isnan(b) ? (b) : ((b) > (a) ? (b) : (a))))
#define FMIN(a, b) (isnan(a) ? (a) : (isnan(b) ? (b) : ((b) < (a) ? (b) : (a))))
#define IMAX(a, b) ((b) > (a) ? (b) : (a))
#define IMIN(a, b) ((b) < (a) ? (b) : (a))

/* Accumulate a block in ACC_T from sources of STORE_T, then store it. The block is
 * stored only after every source was read, so `out` may be one of the sources. */
#define DEFINE_REDUCE(NAME, STORE_T, ACC_T, LOAD, STORE, ADD, MAX, MIN)                    \
  static void NAME(void *out_v, void *const *srcs, int nsrc, int64_t numel, int op) {      \
    STORE_T *out = (STORE_T *)out_v;                                                       \
    ACC_T acc[BLOCK];                                                                      \
    for (int64_t base = 0; base < numel; base += BLOCK) {                                  \
      int64_t n = numel - base < BLOCK ? numel - base : BLOCK;                             \
      const STORE_T *s0 = (const STORE_T *)srcs[0] + base;                                 \
      for (int64_t i = 0; i < n; i++) acc[i] = LOAD(s0[i]);                                \
      for (int r = 1; r < nsrc; r++) {                                                     \
        const STORE_T *s = (const STORE_T *)srcs[r] + base;                                \
        switch (op) {                                                                      \
          case OP_SUM: case OP_AVG:                                                        \
            for (int64_t i = 0; i < n; i++) acc[i] = ADD(acc[i], LOAD(s[i]));              \
            break;                                                                         \
          case OP_MAX:                                                                     \
            for (int64_t i = 0; i < n; i++) { ACC_T v = LOAD(s[i]); acc[i] = MAX(acc[i], v); } \
            break;                                                                         \
          default:                                                                         \
            for (int64_t i = 0; i < n; i++) { ACC_T v = LOAD(s[i]); acc[i] = MIN(acc[i], v); } \
            break;                                                                         \
        }                                                                                  \
      }                                                                                    \
      if (op == OP_AVG)                                                                    \
        for (int64_t i = 0; i < n; i++) acc[i] = acc[i] / (ACC_T)nsrc;                     \
      for (int64_t i = 0; i < n; i++) out[base + i] = STORE(acc[i]);                       \
    }                                                                                      \
  }

#define ID(x) (x)
#define FADD(a, b) ((a) + (b))
/* Integer sums wrap around (two's complement), as torch's do; unsigned math avoids UB. */
#define I32ADD(a, b) ((int32_t)((uint32_t)(a) + (uint32_t)(b)))
#define I64ADD(a, b) ((int64_t)((uint64_t)(a) + (uint64_t)(b)))

DEFINE_REDUCE(reduce_f32, float, float, ID, ID, FADD, FMAX, FMIN)
DEFINE_REDUCE(reduce_bf16, uint16_t, float, bf16_to_float, float_to_bf16, FADD, FMAX, FMIN)
DEFINE_REDUCE(reduce_f16, uint16_t, float, f16_to_float, float_to_f16, FADD, FMAX, FMIN)
DEFINE_REDUCE(reduce_i32, int32_t, int32_t, ID, ID, I32ADD, IMAX, IMIN)
DEFINE_REDUCE(reduce_i64, int64_t, int64_t, ID, ID, I64ADD, IMAX, IMIN)

static const int64_t ELEMENT_SIZE[] = {4, 2, 2, 4, 8};

/* out[i] = srcs[0][i] op srcs[1][i] op ... in rank order, for i < numel. */
int rsm_reduce(void *out, void *const *srcs, int nsrc, int64_t numel, int dtype, int op) {
  if (nsrc < 1 || numel < 0 || op < OP_SUM || op > OP_MIN) return RSM_BAD_ARGUMENT;
  if (op == OP_AVG && (dtype == DT_INT32 || dtype == DT_INT64)) return RSM_BAD_ARGUMENT;
  switch (dtype) {
    case DT_FLOAT32: reduce_f32(out, srcs, nsrc, numel, op); break;
    case DT_BFLOAT16: reduce_bf16(out, srcs, nsrc, numel, op); break;
    case DT_FLOAT16: reduce_f16(out, srcs, nsrc, numel, op); break;
    case DT_INT32: reduce_i32(out, srcs, nsrc, numel, op); break;
    case DT_INT64: reduce_i64(out, srcs, nsrc, numel, op); break;
    default: return RSM_BAD_ARGUMENT;
  }
  return RSM_OK;
}

/* ---------------------------------------------------------------------------------- */
/* All-reduce kernels                                                                  */
/* ---------------------------------------------------------------------------------- */

#define MAX_WORLD 64

/* One-shot (SM-16): after a barrier every rank reads every rank's input, at the same
 * byte offset of each buffer, and reduces them in rank order into `out`; a second
 * barrier keeps the inputs unchanged until every peer has read them. */
int rsm_one_shot_all_reduce(void **bufs, uint32_t **pads, int rank, int world, int channel,
                            int64_t offset, int64_t numel, int dtype, int op, void *out,
                            int64_t timeout_ns, int32_t *peer_out) {
  if (world < 1 || world > MAX_WORLD || dtype < 0 || dtype > DT_INT64) return RSM_BAD_ARGUMENT;
  int64_t deadline = now_ns() + timeout_ns;
  void *srcs[MAX_WORLD];
  for (int r = 0; r < world; r++) srcs[r] = (char *)bufs[r] + offset;
  int status = barrier_until(pads, rank, world, channel, deadline, peer_out);
  if (status) return status;
  status = rsm_reduce(out, srcs, world, numel, dtype, op);
  if (status) return status;
  return barrier_until(pads, rank, world, channel, deadline, peer_out);
}

/* Two-shot (SM-17), in place: rank r reduces chunk r of every rank's buffer into its own
 * buffer (reduce-scatter), then copies every other chunk from the rank that reduced it
 * (all-gather). Barriers separate the phases and keep the buffers unchanged until
 * every peer is done reading them. */
int rsm_two_shot_all_reduce(void **bufs, uint32_t **pads, int rank, int world, int channel,
                            int64_t offset, int64_t numel, int dtype, int op,
                            int64_t timeout_ns, int32_t *peer_out) {
  if (world < 1 || world > MAX_WORLD || dtype < 0 || dtype > DT_INT64) return RSM_BAD_ARGUMENT;
  int64_t deadline = now_ns() + timeout_ns;
  int64_t esize = ELEMENT_SIZE[dtype];
  int64_t chunk = (numel + world - 1) / world;
  void *srcs[MAX_WORLD];
  int status = barrier_until(pads, rank, world, channel, deadline, peer_out);
  if (status) return status;
  int64_t begin = chunk * rank < numel ? chunk * rank : numel;
  int64_t end = begin + chunk < numel ? begin + chunk : numel;
  for (int r = 0; r < world; r++) srcs[r] = (char *)bufs[r] + offset + begin * esize;
  status = rsm_reduce(srcs[rank], srcs, world, end - begin, dtype, op);
  if (status) return status;
  status = barrier_until(pads, rank, world, channel, deadline, peer_out);
  if (status) return status;
  for (int r = 0; r < world; r++) {
    int64_t b = chunk * r < numel ? chunk * r : numel;
    int64_t e = b + chunk < numel ? b + chunk : numel;
    if (r == rank || e <= b) continue;
    memcpy((char *)bufs[rank] + offset + b * esize, (char *)bufs[r] + offset + b * esize,
           (size_t)((e - b) * esize));
  }
  return barrier_until(pads, rank, world, channel, deadline, peer_out);
}
