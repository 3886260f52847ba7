/*
 * CPU kernels of refimpl's symmetric memory (SPEC.md section 6, SM-*).
 *
 * Plain C11, no torch headers; loaded from Python with ctypes. Every pointer handed in
 * points into POSIX shared memory mapped by all ranks of a group, so these functions
 * synchronise real processes:
 *
 *   - signals (SM-9): a signal slot is a uint32 on the receiver's signal pad. put sets it
 *     EMPTY -> FULL with release ordering (waiting while the previous signal is
 *     unconsumed); wait sets it FULL -> EMPTY with acquire ordering. A completed
 *     synchronisation therefore leaves the slot zero, and whatever the sender wrote
 *     before `put` is visible to the receiver after `wait`.
 *   - barrier (SM-10): put to every peer, then wait for every peer, on one channel.
 *   - reductions (SM-15, SM-16): elementwise over the ranks' buffers in rank order, so
 *     every rank computes bitwise the same result; 16-bit floats accumulate in float32
 *     and round once.
 *
 * Every wait has a deadline (SM-11). Waits back off (spin, then poll between
 * sched_yield calls, then sleep on a futex until the other side changes the slot)
 * because ranks may outnumber cores. A wait that times out reports the peer it waited
 * for through `*peer_out` (the `peer` field of a group).
 *
 *   - op descriptors (SM-14): before its first barrier an all-reduce writes what it was
 *     called with (numel, byte offset, dtype, reduce op, algorithm) into this rank's
 *     descriptor; after that barrier every rank compares every rank's with rank 0's, so
 *     a call that differs between ranks fails on every rank, naming the same rank,
 *     without any synchronisation beyond the barrier the op needs anyway.
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

enum { RSM_OK = 0, RSM_PUT_TIMEOUT = 1, RSM_WAIT_TIMEOUT = 2, RSM_BAD_ARGUMENT = 3,
       RSM_MISMATCH = 4 };
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

/* A signal slot is a one-place mailbox between one producer (the peer that puts) and one
 * consumer (the rank that owns the pad). Besides EMPTY and FULL it records whether the
 * other side is asleep in the kernel (futex), so that it is woken the moment the slot
 * changes instead of polling: when ranks outnumber cores, a polling waiter would take
 * the core from the very rank it waits for. Whoever sleeps marks the slot first; whoever
 * then changes the slot sees the mark and wakes it. */
enum { EMPTY = 0, FULL = 1, EMPTY_CONSUMER_ASLEEP = 2, FULL_PRODUCER_ASLEEP = 3 };

/* Waiting goes through three phases, measured from its start: spin (a peer on another
 * core usually arrives within microseconds), then poll between sched_yield calls (with
 * nothing else runnable on this core the yield returns at once and this is still a
 * spin; when ranks outnumber cores it hands the core to whoever needs it, often the
 * peer waited for), then sleep on the slot until woken. Ranks run Python between their
 * synchronisations, so their skew is often tens of microseconds: sleeping that early
 * would add a wake-up (tens of microseconds more) to many waits. */
#define SPIN_NS 2000LL
#define YIELD_NS 1000000LL
#define MAX_SLEEP_NS 50000000LL

#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
/* Shared (not process-private) futexes: the slot lives in memory mapped by several
 * processes. */
static void sleep_while(_Atomic uint32_t *slot, uint32_t value, int64_t ns) {
  struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
  syscall(SYS_futex, (uint32_t *)slot, FUTEX_WAIT, value, &ts, NULL, 0);
}
static void wake(_Atomic uint32_t *slot) {
  syscall(SYS_futex, (uint32_t *)slot, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}
#else
static void sleep_while(_Atomic uint32_t *slot, uint32_t value, int64_t ns) {
  (void)slot; (void)value;
  struct timespec ts = {0, ns < 20000 ? (long)ns : 20000};
  nanosleep(&ts, NULL);
}
static void wake(_Atomic uint32_t *slot) { (void)slot; }
#endif

static int cas(_Atomic uint32_t *slot, uint32_t from, uint32_t to, memory_order order) {
  return atomic_compare_exchange_strong_explicit(slot, &from, to, order, memory_order_relaxed);
}

/* Move the slot from `ready` (or `ready_with_sleeper`, then wake the sleeper) to `next`.
 * Called repeatedly while waiting; 1 once done. */
static int try_transition(_Atomic uint32_t *slot, uint32_t ready, uint32_t ready_with_sleeper,
                          uint32_t next, memory_order order) {
  if (cas(slot, ready, next, order)) return 1;
  if (cas(slot, ready_with_sleeper, next, order)) {
    wake(slot);
    return 1;
  }
  return 0;
}

/* Wait until the slot can go from `ready` to `next`, then move it. While it holds
 * `busy` (the other side has not acted yet) spin, yield, then mark it `busy_asleep` and
 * sleep until woken or the deadline. 0 on success, 1 on timeout. */
static int transition(_Atomic uint32_t *slot, uint32_t ready, uint32_t ready_with_sleeper,
                      uint32_t next, uint32_t busy, uint32_t busy_asleep, memory_order order,
                      int64_t spin_ns, int64_t deadline_ns) {
  int64_t start = 0;
  int spinning = spin_ns > 0;
  for (uint32_t step = 0;; step++) {
    if (try_transition(slot, ready, ready_with_sleeper, next, order)) return 0;
    if (spinning && step % 32 != 31) { /* while spinning, read the clock now and then */
      cpu_relax();
      continue;
    }
    int64_t now = now_ns();
    if (start == 0) start = now;
    int64_t left = deadline_ns - now;
    if (left <= 0) {
      cas(slot, busy_asleep, busy, memory_order_relaxed); /* withdraw our mark */
      return try_transition(slot, ready, ready_with_sleeper, next, order) ? 0 : 1;
    }
    if (now - start < spin_ns) {
      cpu_relax();
      continue;
    }
    spinning = 0; /* from here on, every step reads the clock */
    if (now - start < YIELD_NS) {
      sched_yield();
    } else if (cas(slot, busy, busy_asleep, memory_order_relaxed) ||
               atomic_load_explicit(slot, memory_order_relaxed) == busy_asleep) {
      sleep_while(slot, busy_asleep, left < MAX_SLEEP_NS ? left : MAX_SLEEP_NS);
    }
  }
}

/* Producer: EMPTY -> FULL (release), waiting while the previous signal is unconsumed. */
static int put(_Atomic uint32_t *slot, int64_t spin_ns, int64_t deadline_ns) {
  return transition(slot, EMPTY, EMPTY_CONSUMER_ASLEEP, FULL, FULL, FULL_PRODUCER_ASLEEP,
                    memory_order_release, spin_ns, deadline_ns);
}

/* Consumer: FULL -> EMPTY (acquire), waiting while no signal has arrived. */
static int take(_Atomic uint32_t *slot, int64_t spin_ns, int64_t deadline_ns) {
  return transition(slot, FULL, FULL_PRODUCER_ASLEEP, EMPTY, EMPTY, EMPTY_CONSUMER_ASLEEP,
                    memory_order_acquire, spin_ns, deadline_ns);
}

static _Atomic uint32_t *slot_of(uint32_t *pad, int world, int channel, int peer) {
  return (_Atomic uint32_t *)(pad + (int64_t)channel * world + peer);
}

/* put_signal: set slot [channel][rank] of dst's pad 0 -> 1 (release). */
int rsm_put_signal(uint32_t *dst_pad, int rank, int world, int channel, int64_t timeout_ns) {
  return put(slot_of(dst_pad, world, channel, rank), SPIN_NS, now_ns() + timeout_ns)
             ? RSM_PUT_TIMEOUT
                                                                            : RSM_OK;
}

/* wait_signal: set slot [channel][src] of my own pad 1 -> 0 (acquire). */
int rsm_wait_signal(uint32_t *my_pad, int src, int world, int channel, int64_t timeout_ns) {
  return take(slot_of(my_pad, world, channel, src), SPIN_NS, now_ns() + timeout_ns)
             ? RSM_WAIT_TIMEOUT
                                                                         : RSM_OK;
}

#define MAX_WORLD 64

/* One rank's view of a rendezvoused allocation: built once per handle by Python. */
typedef struct {
  int32_t rank, world;
  int32_t peer; /* out: the peer a wait timed out on, or the first rank whose call differs */
  int32_t unused;
  void *bufs[MAX_WORLD];
  uint32_t *pads[MAX_WORLD];
  int64_t *descs[MAX_WORLD]; /* each rank's descriptor: the op call, then its last CPU */
  int64_t mismatch[2][3];    /* out: rank 0's call and the differing rank's (SM-20) */
} rsm_group;

enum { DESC_CPU = 4 }; /* descs[r][DESC_CPU]: the CPU rank r last waited on */

/* Spinning only helps while the peer runs on another core: when it last waited on this
 * one, go straight to yielding (a heuristic: the scheduler may have moved either). */
static int64_t spin_for(const rsm_group *g, int peer, int64_t my_cpu) {
  int64_t peer_cpu = __atomic_load_n(&g->descs[peer][DESC_CPU], __ATOMIC_RELAXED);
  return peer_cpu == my_cpu ? 0 : SPIN_NS;
}

static int64_t publish_cpu(const rsm_group *g) {
#ifdef __linux__
  int64_t cpu = sched_getcpu();
#else
  int64_t cpu = -1;
#endif
  __atomic_store_n(&g->descs[g->rank][DESC_CPU], cpu, __ATOMIC_RELAXED);
  return cpu;
}

/* SM-10: signal every peer on `channel`, then wait for every peer's signal. */
static int barrier_until(rsm_group *g, int channel, int64_t deadline_ns) {
  int rank = g->rank, world = g->world;
  int64_t cpu = publish_cpu(g);
  /* Visit peers starting after `rank` so that ranks do not all hit rank 0 first. */
  for (int i = 1; i < world; i++) {
    int peer = (rank + i) % world;
    if (put(slot_of(g->pads[peer], world, channel, rank), spin_for(g, peer, cpu), deadline_ns)) {
      g->peer = peer;
      return RSM_PUT_TIMEOUT;
    }
  }
  for (int i = 1; i < world; i++) {
    int peer = (rank + i) % world;
    if (take(slot_of(g->pads[rank], world, channel, peer), spin_for(g, peer, cpu), deadline_ns)) {
      g->peer = peer;
      return RSM_WAIT_TIMEOUT;
    }
  }
  return RSM_OK;
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

/* The reductions are compiled for AVX2 too and chosen by the CPU at load time (wider
 * vectors, same elementwise operations in the same order: the same bits, SM-15). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* max/min that propagate NaN, like torch.maximum / torch.minimum. */
#define FMAX(a, b) (isnan(a) ? (a) : (isnan(b) ? (b) : ((b) > (a) ? (b) : (a))))
#define FMIN(a, b) (isnan(a) ? (a) : (isnan(b) ? (b) : ((b) < (a) ? (b) : (a))))
#define IMAX(a, b) ((b) > (a) ? (b) : (a))
#define IMIN(a, b) ((b) < (a) ? (b) : (a))

/* Accumulate a block in ACC_T from sources of STORE_T, then store it. The block is
 * stored only after every source was read, so `out` may be one of the sources. Two
 * sources (a group of two) take one pass instead: each element is stored right after
 * both of its inputs were read, the same operations in the same order, about 1.4x
 * faster than three passes over a block. */
#define DEFINE_REDUCE(NAME, STORE_T, ACC_T, LOAD, STORE, ADD, MAX, MIN)                    \
  VECTOR_CLONES static void NAME##_pair(STORE_T *out, const STORE_T *a, const STORE_T *b,  \
                                        int64_t numel, int op) {                           \
    switch (op) {                                                                          \
      case OP_SUM:                                                                         \
        for (int64_t i = 0; i < numel; i++) out[i] = STORE(ADD(LOAD(a[i]), LOAD(b[i])));   \
        break;                                                                             \
      case OP_AVG:                                                                         \
        for (int64_t i = 0; i < numel; i++)                                                \
          out[i] = STORE(ADD(LOAD(a[i]), LOAD(b[i])) / (ACC_T)2);                          \
        break;                                                                             \
      case OP_MAX:                                                                         \
        for (int64_t i = 0; i < numel; i++) {                                              \
          ACC_T x = LOAD(a[i]), y = LOAD(b[i]);                                            \
          out[i] = STORE(MAX(x, y));                                                       \
        }                                                                                  \
        break;                                                                             \
      default:                                                                             \
        for (int64_t i = 0; i < numel; i++) {                                              \
          ACC_T x = LOAD(a[i]), y = LOAD(b[i]);                                            \
          out[i] = STORE(MIN(x, y));                                                       \
        }                                                                                  \
    }                                                                                      \
  }                                                                                        \
  VECTOR_CLONES static void NAME(void *out_v, void *const *srcs, int nsrc, int64_t numel, int op) {      \
    STORE_T *out = (STORE_T *)out_v;                                                       \
    if (nsrc == 2) {                                                                       \
      NAME##_pair(out, (const STORE_T *)srcs[0], (const STORE_T *)srcs[1], numel, op);     \
      return;                                                                              \
    }                                                                                      \
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


enum { ALGO_ONE_SHOT = 1, ALGO_TWO_SHOT = 2 };

static void write_descriptor(const rsm_group *g, int64_t offset, int64_t numel, int64_t kind) {
  int64_t *d = g->descs[g->rank];
  d[0] = numel;
  d[1] = offset;
  d[2] = kind;
}

/* After a barrier: the lowest rank whose call differs from rank 0's, or -1. */
static int first_differing_rank(const rsm_group *g) {
  const int64_t *d0 = g->descs[0];
  for (int r = 1; r < g->world; r++) {
    const int64_t *d = g->descs[r];
    if (d[0] != d0[0] || d[1] != d0[1] || d[2] != d0[2]) return r;
  }
  return -1;
}

static int check_arguments(const rsm_group *g, int dtype, int op) {
  if (g->world < 1 || g->world > MAX_WORLD || dtype < 0 || dtype > DT_INT64) return 0;
  if (op < OP_SUM || op > OP_MIN) return 0;
  return !(op == OP_AVG && (dtype == DT_INT32 || dtype == DT_INT64));
}

/* The first barrier of an all-reduce, then the cross-rank check of the descriptors. */
static int enter(rsm_group *g, int channel, int64_t offset, int64_t numel, int64_t kind,
                 int64_t deadline) {
  write_descriptor(g, offset, numel, kind);
  int status = barrier_until(g, channel, deadline);
  if (status) return status;
  int differing = first_differing_rank(g);
  if (differing < 0) return RSM_OK;
  for (int i = 0; i < 3; i++) { /* for the error message: peers move on after the barrier */
    g->mismatch[0][i] = g->descs[0][i];
    g->mismatch[1][i] = g->descs[differing][i];
  }
  /* No rank may write its next call's descriptor before every rank has read these. */
  status = barrier_until(g, channel, deadline);
  if (status) return status;
  g->peer = differing;
  return RSM_MISMATCH;
}

/* One-shot (SM-15): after a barrier every rank reads every rank's input, at the same
 * byte offset of each buffer, and reduces them in rank order into `out`; a second
 * barrier keeps the inputs unchanged until every peer has read them. */
int rsm_one_shot(rsm_group *g, int channel, int64_t offset, int64_t numel, int dtype, int op,
                 void *out, int64_t timeout_ns) {
  if (!check_arguments(g, dtype, op)) return RSM_BAD_ARGUMENT;
  int64_t deadline = now_ns() + timeout_ns;
  int status = enter(g, channel, offset, numel, ALGO_ONE_SHOT << 16 | op << 8 | dtype, deadline);
  if (status) return status;
  void *srcs[MAX_WORLD];
  for (int r = 0; r < g->world; r++) srcs[r] = (char *)g->bufs[r] + offset;
  rsm_reduce(out, srcs, g->world, numel, dtype, op);
  return barrier_until(g, channel, deadline);
}

/* Elements [*begin, *end) of chunk `r` of `numel` split in chunks of `chunk`. */
static void chunk_bounds(int64_t chunk, int r, int64_t numel, int64_t *begin, int64_t *end) {
  *begin = chunk * r < numel ? chunk * r : numel;
  *end = *begin + chunk < numel ? *begin + chunk : numel;
}

/* Two-shot (SM-16), in place: rank r reduces chunk r of every rank's buffer into its own
 * buffer (reduce-scatter), then copies every other chunk from the rank that reduced it
 * (all-gather). Barriers separate the phases and keep the buffers unchanged until
 * every peer is done reading them. */
int rsm_two_shot(rsm_group *g, int channel, int64_t offset, int64_t numel, int dtype, int op,
                 int64_t timeout_ns) {
  if (!check_arguments(g, dtype, op)) return RSM_BAD_ARGUMENT;
  int64_t deadline = now_ns() + timeout_ns;
  int status = enter(g, channel, offset, numel, ALGO_TWO_SHOT << 16 | op << 8 | dtype, deadline);
  if (status) return status;
  int64_t esize = ELEMENT_SIZE[dtype];
  int64_t chunk = (numel + g->world - 1) / g->world;
  int64_t begin, end;
  chunk_bounds(chunk, g->rank, numel, &begin, &end);
  void *srcs[MAX_WORLD];
  for (int r = 0; r < g->world; r++) srcs[r] = (char *)g->bufs[r] + offset + begin * esize;
  rsm_reduce(srcs[g->rank], srcs, g->world, end - begin, dtype, op);
  status = barrier_until(g, channel, deadline);
  if (status) return status;
  for (int r = 0; r < g->world; r++) {
    chunk_bounds(chunk, r, numel, &begin, &end);
    if (r == g->rank || end <= begin) continue;
    memcpy((char *)g->bufs[g->rank] + offset + begin * esize,
           (char *)g->bufs[r] + offset + begin * esize, (size_t)((end - begin) * esize));
  }
  return barrier_until(g, channel, deadline);
}

/* barrier (SM-10) on a group's pads. */
int rsm_group_barrier(rsm_group *g, int channel, int64_t timeout_ns) {
  return barrier_until(g, channel, now_ns() + timeout_ns);
}
