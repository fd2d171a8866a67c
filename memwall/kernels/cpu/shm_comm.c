/* Collectives for the tensor-parallel ranks of one host, through a shared-memory segment that
 * every rank maps (memwall/distributed/shm_comm.py creates and attaches it; kernels.h lists
 * the other files). A call costs a copy into the segment, one barrier and a sum: microseconds,
 * where gloo takes 1-2 ms. Callable from Python (ctypes) and from C (mw_allreduce_fn).
 *
 * Segment layout, in 64-byte cache lines (world W ranks, slots of C floats, C % 16 == 0):
 *
 *     line 0          magic, W, C                     written once by mw_shm_init
 *     line 1          abort flag                      0 until some rank or the parent aborts
 *     line 2 + r      arrived[r], r = 0..W-1          rounds rank r has entered; only r writes
 *     slot[p][r]      p = 0, 1; r = 0..W-1            C floats each, p-major
 *
 * Every collective is a sequence of rounds (a chunk of at most C floats per rank each), and
 * every rank runs the same rounds in the same order. Round k (k = c->seq before the round) of
 * rank r: write its piece into slot[k & 1][r]; publish arrived[r] = k + 1 (release store);
 * wait until arrived[s] >= k + 1 for every s (acquire loads); read slot[k & 1][0..W-1].
 *
 * Why one barrier per round is enough (double buffering by the round's parity):
 *   - r's reads of slot[p][s] in round k see s's round-k writes: s wrote them before its
 *     release store of k + 1, which r's acquire load observed.
 *   - s writes slot[p][s] next in round k + 2. It enters round k + 2 only after its round
 *     k + 1 wait ended, i.e. after every rank r published arrived[r] >= k + 2 -- which r does
 *     only after it has finished reading round k's slots (its reads come before that release
 *     store; s's acquire load of it comes before s's writes). So no rank overwrites a slot that
 *     another may still read.
 *   - A rank can therefore be at most one round ahead of the slowest (it then writes the other
 *     parity's slot), which is why the wait is arrived[s] >= k + 1, not ==.
 * Sums are taken over slot[p][0], slot[p][1], ... in rank order on every rank, so all ranks
 * get bit-identical results (float addition is not associative).
 *
 * Failure: a rank that waits longer than c->timeout_s sets the abort flag and returns
 * MW_COMM_TIMEOUT; a rank that finds the flag set returns MW_COMM_ABORTED, and so does every
 * later call: once one rank gave up, the ranks' rounds are out of step for good (make a new
 * segment). Preconditions (checked in Python): every rank makes the same calls with the same
 * sizes; buffers do not overlap the segment.
 */
#define _GNU_SOURCE  /* clock_gettime and sched_yield under -std=c11 */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#define LINE 64
#define MAGIC 0x31306d6873776dULL   /* "mwshm01" */
#define CLOCK_EVERY 256            /* spins between looks at the clock while spinning */
#define SPIN_S 50e-6               /* then yield the core: ranks may outnumber free cores */
#define SUM_BLOCK 1024             /* floats summed over all ranks at a time (stays in L1) */

typedef struct { uint64_t magic; int64_t world, capacity; } shm_info;

static int64_t* abort_flag(void* base) { return (int64_t*)((char*)base + LINE); }
static int64_t* arrived(void* base, int64_t r) { return (int64_t*)((char*)base + (2 + r) * LINE); }

static float* slot(const mw_shm_comm* c, int64_t parity, int64_t r) {
    float* first = (float*)((char*)c->base + (2 + c->world) * LINE);
    return first + (parity * c->world + r) * c->capacity;
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int aborted(void* base) { return __atomic_load_n(abort_flag(base), __ATOMIC_ACQUIRE) != 0; }

int64_t mw_shm_bytes(int64_t world, int64_t capacity) {
    return (2 + world) * LINE + 2 * world * capacity * (int64_t)sizeof(float);
}

void mw_shm_init(void* base, int64_t world, int64_t capacity) {
    memset(base, 0, (size_t)((2 + world) * LINE));
    shm_info* info = (shm_info*)base;
    info->world = world, info->capacity = capacity;
    __atomic_store_n(&info->magic, MAGIC, __ATOMIC_RELEASE);  /* last: the header is whole */
}

int mw_shm_attach(mw_shm_comm* c, void* base, int64_t rank, int64_t world, double timeout_s) {
    const shm_info* info = (const shm_info*)base;
    if (__atomic_load_n(&info->magic, __ATOMIC_ACQUIRE) != MAGIC) return 1;
    if (info->world != world) return 2;
    c->base = base, c->rank = rank, c->world = world, c->capacity = info->capacity;
    c->timeout_s = timeout_s;
    /* a rank that closed and attached again goes on from the rounds it has entered */
    c->seq = __atomic_load_n(arrived(base, rank), __ATOMIC_ACQUIRE);
    return MW_OK;
}

void mw_shm_abort(void* base) { __atomic_store_n(abort_flag(base), 1, __ATOMIC_RELEASE); }

/* Publishes this rank's next round and waits for every rank to enter it (see the top). Spins
 * with a pause first (a peer is usually microseconds away), then yields between looks. */
static int arrive_and_wait(mw_shm_comm* c) {
    const int64_t target = ++c->seq;
    __atomic_store_n(arrived(c->base, c->rank), target, __ATOMIC_RELEASE);
    double start = 0.0;
    int64_t spins = 0;
    int yielding = 0;
    for (int64_t r = 0; r < c->world; r++) {
        const int64_t* theirs = arrived(c->base, r);
        while (__atomic_load_n(theirs, __ATOMIC_ACQUIRE) < target) {
            if (__atomic_load_n(abort_flag(c->base), __ATOMIC_RELAXED)) return MW_COMM_ABORTED;
            if (spins++ == 0) start = now_s();
            if (yielding) sched_yield(); else cpu_relax();
            if (spins % (yielding ? 8 : CLOCK_EVERY) != 0) continue;
            const double waited = now_s() - start;
            if (c->timeout_s > 0 && waited > c->timeout_s) {
                mw_shm_abort(c->base);  /* the others stop waiting for a round that won't come */
                return MW_COMM_TIMEOUT;
            }
            yielding = waited > SPIN_S;
        }
    }
    return MW_OK;
}

/* simple loops -O3 vectorizes for each build's instruction set */
static void add2(float* restrict out, const float* restrict a, const float* restrict b, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

static void add_into(float* restrict out, const float* restrict a, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] += a[i];
}

/* out[0..n) = ((slot[p][0] + slot[p][1]) + slot[p][2]) + ..., in rank order (world >= 2) */
static void sum_slots(const mw_shm_comm* c, int64_t parity, float* out, int64_t n) {
    for (int64_t b = 0; b < n; b += SUM_BLOCK) {
        const int64_t m = min64(SUM_BLOCK, n - b);
        add2(out + b, slot(c, parity, 0) + b, slot(c, parity, 1) + b, m);
        for (int64_t r = 2; r < c->world; r++) add_into(out + b, slot(c, parity, r) + b, m);
    }
}

int mw_shm_allreduce(void* comm, float* buf, int64_t n) {
    mw_shm_comm* c = (mw_shm_comm*)comm;
    if (aborted(c->base)) return MW_COMM_ABORTED;
    if (c->world == 1) return MW_OK;
    for (int64_t done = 0; done < n; done += c->capacity) {
        const int64_t m = min64(c->capacity, n - done), parity = c->seq & 1;
        memcpy(slot(c, parity, c->rank), buf + done, sizeof(float) * (size_t)m);
        const int rc = arrive_and_wait(c);
        if (rc != MW_OK) return rc;
        sum_slots(c, parity, buf + done, m);
    }
    return MW_OK;
}

/* Flat elements [a, b) of a rank's piece (row-major, `cols` wide), found at `from`, into its
 * columns of dst (row-major, `total` wide, the piece's columns starting at `offset`). */
static void place(float* dst, int64_t total, int64_t offset, int64_t cols, const float* from,
                  int64_t a, int64_t b) {
    while (a < b) {
        const int64_t row = a / cols, col = a % cols, run = min64(cols - col, b - a);
        memcpy(dst + row * total + offset + col, from, sizeof(float) * (size_t)run);
        from += run, a += run;
    }
}

int mw_shm_allgather(mw_shm_comm* c, const float* src, int64_t rows, const int64_t* cols,
                     float* dst) {
    if (aborted(c->base)) return MW_COMM_ABORTED;
    int64_t total = 0, longest = 0;
    for (int64_t r = 0; r < c->world; r++) {
        total += cols[r];
        longest = rows * cols[r] > longest ? rows * cols[r] : longest;
    }
    const int64_t mine = rows * cols[c->rank];
    /* every rank runs ceil(longest / capacity) rounds, contributing nothing once its piece
     * is through */
    for (int64_t done = 0; done < longest; done += c->capacity) {
        const int64_t parity = c->seq & 1;
        if (done < mine)
            memcpy(slot(c, parity, c->rank), src + done,
                   sizeof(float) * (size_t)min64(c->capacity, mine - done));
        const int rc = arrive_and_wait(c);
        if (rc != MW_OK) return rc;
        int64_t offset = 0;
        for (int64_t r = 0; r < c->world; r++) {
            const int64_t len = rows * cols[r];
            if (done < len)
                place(dst, total, offset, cols[r], slot(c, parity, r), done,
                      min64(done + c->capacity, len));
            offset += cols[r];
        }
    }
    return MW_OK;
}

int mw_shm_barrier(mw_shm_comm* c) {
    if (aborted(c->base)) return MW_COMM_ABORTED;
    return arrive_and_wait(c);
}
