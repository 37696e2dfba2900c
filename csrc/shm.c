/*
 * shm.c -- intra-node collectives over POSIX shared memory: the segment, the
 * step counters that synchronise it, the five collectives and their sum
 * kernel (kernel twin: cfsdp/_ref/shm.py; transport twin: the process group,
 * see cfsdp/_runtime/comm.py).
 *
 * Segment.  [header | ctrl[0..W) | data], the data page-aligned:
 *   header   magic, sizes, `attached` (ranks that mapped it), `failed` (0, or
 *            1 + the group rank of the first rank that failed);
 *   ctrl[r]  rank r's `step` counter and `waiters` (own cache line), the
 *            descriptors of its current collectives (desc[2], see below) and
 *            its failure message;
 *   data     per rank two slot halves of `slot_bytes` (double buffering).
 * Only rank r writes ctrl[r] (but `waiters`) and its own slot halves.
 *
 * Steps.  Every rank runs the same collectives in the same order, cut into
 * the same pieces, so every rank goes through the same sequence of
 * synchronisation points.  At each one a rank *publishes* (step += 1, a
 * release store, plus a futex wake if anyone sleeps on it) and may *wait*
 * until every other rank's step has reached a value (acquire loads).  A
 * piece that uses slot half b:
 *   1. waits until every rank has passed free_at[b], the point where all of
 *      them had finished reading half b's previous contents;
 *   2. writes its input piece into its own half b and publishes (s);
 *   3. waits until every rank reached s, reads the others' halves b (sums or
 *      copies them into the output; all_reduce has one more publish/wait in
 *      the middle, see cf_shm_all_reduce);
 *   4. publishes again: that step is the new free_at[b].
 * So ranks run at most one piece apart, and a piece's copy-in overlaps the
 * previous piece's readers (pipelined over the two halves).  Counters are
 * 32-bit and compared modulo 2^32 (ranks are never 2^31 steps apart).
 * The first piece of a collective also writes desc[b] = (seq, op, dtype,
 * numel, root) before publishing; after the first wait every rank compares
 * all descriptors, so ranks that call different collectives fail with a
 * message instead of exchanging garbage.  (desc[b] of a rank is not
 * rewritten before every rank has passed free_at[b], i.e. has read it.)
 *
 * Waiting.  A wait spins briefly (CF_SHM_SPINS pauses), then sleeps on the
 * awaited counter with FUTEX_WAIT (a shared futex: it works across processes
 * and across several mappings in one process), waking at least every
 * CF_SHM_NAP_NS to re-check the deadline; without futexes (non-Linux) it
 * naps with nanosleep.  Every wait is bounded by the group's timeout.  A
 * rank that fails (timeout, mismatch, closed group, a dead peer, or a failure
 * outside the segment reported with cf_shm_group_fail) records its message in
 * its ctrl, sets header.failed and wakes every sleeper (and whoever sleeps on
 * header.failed itself: cf_shm_group_wait_failure): every other rank's
 * current or next wait then fails at once, naming it.
 *
 * Liveness.  A rank that dies (SIGKILL, the OOM killer, a segfault) publishes
 * nothing, so a wait alone would only notice it at the timeout.  Each ctrl[r]
 * holds a process-shared ROBUST mutex `alive`, initialised by the creator
 * before it writes the magic, and locked by rank r's *keeper*: a thread that
 * each view starts when it opens (before it counts itself in `attached`) and
 * that does nothing but hold the lock, blocked on a condition variable, until
 * the view is closed; it then sets ctrl[r].closed and unlocks.  A wait that
 * has lasted CF_SHM_PROBE_S on rank q, and every CF_SHM_PROBE_S after that,
 * probes q with pthread_mutex_trylock (an atomic compare-and-swap on q's
 * line, no system call): EBUSY means q's view is open (alive, or stopped, or
 * slow: it keeps the whole timeout); EOWNERDEAD (the kernel marked the lock
 * when q's keeper thread ended without unlocking: its process died) or a lock
 * found free with `closed` unset (an earlier prober saw EOWNERDEAD, made it
 * consistent and unlocked it) means q died; a free lock with `closed` set means
 * q closed its view and will never arrive.  Either way the prober re-reads q's
 * counter (q may have published before it went) and otherwise fails naming q,
 * its global rank and the host, which fails every rank at once as above.
 * Why this signal: the kernel releases a robust mutex when its owner THREAD
 * exits, while processing the thread's robust list in exit_mm, i.e. before
 * the process becomes a zombie, so an unreaped rank is seen dead at once; the
 * owner is recorded as a thread id of the owner's own pid namespace and only
 * the owner's exit marks it, so neither PID reuse nor ranks in different pid
 * namespaces (containers sharing /dev/shm) confuse it; a fork()ed child
 * (DataLoader workers) does not inherit ownership, so a rank whose children
 * outlive it is still seen dead.  (File locks on the segment's descriptor
 * would be inherited by such children and kept until they exit; pidfds and
 * /proc do not work across pid namespaces.)  The keeper is a thread of its
 * own because ownership dies with the thread: the thread that opens a view
 * (any user thread) may end before the view, and the worker of queue.c is
 * not the only thread that drives a view (the unit tests run collectives
 * directly).  A keeper blocks every signal and is joined by
 * cf_shm_group_close, only in the process that opened the view (a fork()ed
 * child that closes its copy just unmaps it).  Peers probe only a rank they
 * are waiting for, so a rank that closes its view cleanly once it has
 * nothing more to contribute fails nobody.  Builds without robust mutexes
 * (not Linux, or no pthreads) have no keeper and no probe: a dead peer is
 * then an error at the timeout.
 *
 * Bytes.  all_gather: a rank writes its piece into shm once, and every rank
 * reads the W - 1 other pieces once (its own block is copied straight from
 * its input, or not at all when the input is that block of the output).
 * reduce_scatter: a rank writes the W - 1 blocks the others need and sums
 * its own block from its input and the others' slots in one pass.
 * all_reduce: reduce_scatter then all_gather of the reduced blocks, through
 * the same slot half.  broadcast: root writes once, the others read once.
 * all_to_all: a rank writes the blocks the others need into their blocks of its
 * slot half once, every rank reads its block of every other rank's half once,
 * and its own block is copied straight from its input.
 * Sums always run over the ranks in order 0..W-1 (so every rank of an
 * all_reduce gets the same bits) in float (double for fp64), see
 * cf_shm_reduce_run.  Copies and sums split across up to max_threads
 * threads (cf_parallel_for) above CF_CHUNK_PARALLEL_BYTES.
 *
 * Trust.  The ranks of the job and whoever can reach its rendezvous store are
 * trusted (torch's store has no authentication); other users of the machine
 * are not.  So nothing of the job may land in memory another user can map:
 * the creator makes the segment with O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600,
 * under an unguessable name; and as the name reaches the other ranks through
 * the store, where another local user can forge it, every rank opens it with
 * O_NOFOLLOW and refuses, before mapping, any file that is not a regular file
 * of its own effective uid with no group or other permission bits
 * (cf_shm_check_fd: CF_EPERM naming the path, owner and mode).  comm.py makes
 * such a refusal an error on every rank of the group.
 */
#define _GNU_SOURCE /* syscall(SYS_futex), shm_open, clock_gettime */

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pwd.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#if defined(__linux__) && defined(CF_HAVE_PTHREADS)
#define CF_SHM_LIVENESS 1 /* robust mutexes: see "Liveness" above */
#include <pthread.h>
#include <signal.h>
#else
#define CF_SHM_LIVENESS 0
#endif

#include "cf_half.h"
#include "chunk.h"
#include "shm.h"
#include "thread.h"

#if ATOMIC_INT_LOCK_FREE != 2
#error "cfsdp's shared-memory collectives need lock-free 32-bit atomics"
#endif

#define CF_SHM_MAGIC 0x31736d7064736663ULL /* "cfsdpms1" */
#define CF_SHM_LINE 64
#define CF_SHM_PAGE 4096
#define CF_SHM_SPINS 256
#define CF_SHM_NAP_NS 10000000L /* 10 ms: the longest sleep between deadline checks */
#define CF_SHM_NAME_LEN 64
#define CF_SHM_LABEL_LEN 96
#define CF_SHM_HOST_LEN 72
#define CF_SHM_PROBE_S 0.1 /* a wait probes the awaited rank's liveness this often */
#define CF_SHM_KEEPER_STACK (64 * 1024)

typedef struct {
    _Atomic uint64_t magic; /* written last by the creator */
    uint64_t world_size;
    uint64_t slot_bytes;
    uint64_t total_bytes;
    _Alignas(CF_SHM_LINE) _Atomic uint32_t attached;
    _Atomic uint32_t failed; /* 0, or 1 + group rank of the first failure */
} cf_shm_header;

typedef struct {
    uint32_t seq, op;
    int32_t dtype, pad;
    int64_t numel, root;
} cf_shm_desc;

typedef struct {
    _Alignas(CF_SHM_LINE) _Atomic uint32_t step;
    _Atomic uint32_t waiters; /* sleepers on `step` (any rank increments) */
    _Alignas(CF_SHM_LINE) cf_shm_desc desc[2];
    char fail_msg[CF_ERR_MSG_LEN];
#if CF_SHM_LIVENESS
    _Alignas(CF_SHM_LINE) pthread_mutex_t alive; /* held by the rank's keeper (Liveness) */
#endif
    _Atomic uint32_t closed; /* set by the keeper when the rank closes its view */
} cf_shm_ctrl;

struct cf_shm_group {
    unsigned char *base;
    size_t bytes;
    cf_shm_header *hdr;
    cf_shm_ctrl *ctrl;
    unsigned char *data;
    int world, rank;
    size_t slot_bytes;
    double timeout_s;
    bool creator, linked;
    char name[CF_SHM_NAME_LEN];
    char label[CF_SHM_LABEL_LEN];
    char host[CF_SHM_HOST_LEN]; /* this host's name: every rank of a segment is on it */
    int64_t *global_ranks;
    pid_t pid; /* the process that opened the view (a fork()ed child's copy is not it) */
#if CF_SHM_LIVENESS
    /* the keeper thread (Liveness): keep_state 0 starting, 1 holding, -1 failed to lock */
    pthread_t keeper;
    pthread_mutex_t keep_mu;
    pthread_cond_t keep_cv;
    int keep_state;
    bool keep_stop, keeper_started;
#endif
    /* this rank's position in the step sequence (see the file comment) */
    uint32_t step, free_at[2], seq;
    unsigned buf;
    _Atomic int aborted;
    _Atomic int failed_self; /* cf_shm_group_fail ran: this view's ops are refused */
};

/* ------------------------------------------------------------------------
 * Kernels
 * ------------------------------------------------------------------------ */

#define CF_SHM_BLOCK 512 /* elements of the float accumulator block (L1) */

/* load / store of each dtype in its accumulator type */
#define CF_SHM_LD_FP32(x) (x)
#define CF_SHM_LD_FP64(x) (x)
#define CF_SHM_LD_BF16(x) cf_bf16_to_f32(x)
#define CF_SHM_LD_FP16(x) cf_f16_to_f32(x)
#define CF_SHM_ST_FP32(v) (v)
#define CF_SHM_ST_FP64(v) (v)
#define CF_SHM_ST_BF16(v) cf_f32_to_bf16(v)
#define CF_SHM_ST_FP16(v) cf_f32_to_f16(v)
/* alignment-safe access to element i (cfsdp.h): the caller's buffers may be anywhere */
#define CF_SHM_GET_FP32(p, i) cf_load_f32(p, i)
#define CF_SHM_GET_FP64(p, i) cf_load_f64(p, i)
#define CF_SHM_GET_BF16(p, i) cf_load_u16(p, i)
#define CF_SHM_GET_FP16(p, i) cf_load_u16(p, i)
#define CF_SHM_PUT_FP32(p, i, v) cf_store_f32(p, i, v)
#define CF_SHM_PUT_FP64(p, i, v) cf_store_f64(p, i, v)
#define CF_SHM_PUT_BF16(p, i, v) cf_store_u16(p, i, v)
#define CF_SHM_PUT_FP16(p, i, v) cf_store_u16(p, i, v)
/* element i of a D buffer in its accumulator type, and back */
#define CF_SHM_LOAD(D, p, i) CF_SHM_LD_##D(CF_SHM_GET_##D(p, i))
#define CF_SHM_STORE(D, p, i, v) CF_SHM_PUT_##D(p, i, CF_SHM_ST_##D(v))
#define CF_SHM_T_FP32 float
#define CF_SHM_T_FP64 double
#define CF_SHM_T_BF16 uint16_t
#define CF_SHM_T_FP16 uint16_t
#define CF_SHM_A_FP32 float
#define CF_SHM_A_FP64 double
#define CF_SHM_A_BF16 float
#define CF_SHM_A_FP16 float

/*
 * One sum loop per dtype.  Two sources (the common W = 2) fuse load, add,
 * scale and store in one loop; more go through a block accumulator in L1,
 * added source by source (the same left-to-right order).  Plain indexed
 * loops that gcc -O3 vectorises (no FP contraction: -std=c11), with
 * alignment-safe loads and stores, so the buffers may be at any address.
 */
#define CF_SHM_DEFINE_SUM(D)                                                              \
    static void cf_shm_sum_##D(void *dst, const void *const *srcs, int k, size_t n,       \
                               double scale)                                              \
    {                                                                                     \
        const size_t esz = sizeof(CF_SHM_T_##D);                                          \
        const CF_SHM_A_##D s = (CF_SHM_A_##D)scale;                                       \
        const int scaled = scale != 1.0;                                                  \
        CF_SHM_A_##D acc[CF_SHM_BLOCK];                                                   \
        if (k == 2) {                                                                     \
            const void *a = srcs[0], *b = srcs[1];                                        \
            if (scaled)                                                                   \
                for (size_t i = 0; i < n; i++)                                            \
                    CF_SHM_STORE(D, dst, i, (CF_SHM_LOAD(D, a, i) + CF_SHM_LOAD(D, b, i)) * s); \
            else                                                                          \
                for (size_t i = 0; i < n; i++)                                            \
                    CF_SHM_STORE(D, dst, i, CF_SHM_LOAD(D, a, i) + CF_SHM_LOAD(D, b, i)); \
            return;                                                                       \
        }                                                                                 \
        for (size_t i0 = 0; i0 < n; i0 += CF_SHM_BLOCK) {                                 \
            size_t m = n - i0 < CF_SHM_BLOCK ? n - i0 : CF_SHM_BLOCK;                     \
            const unsigned char *a = (const unsigned char *)srcs[0] + i0 * esz;           \
            unsigned char *d = (unsigned char *)dst + i0 * esz;                           \
            for (size_t i = 0; i < m; i++)                                                \
                acc[i] = CF_SHM_LOAD(D, a, i);                                            \
            for (int j = 1; j < k; j++) {                                                 \
                const unsigned char *b = (const unsigned char *)srcs[j] + i0 * esz;       \
                for (size_t i = 0; i < m; i++)                                            \
                    acc[i] += CF_SHM_LOAD(D, b, i);                                       \
            }                                                                             \
            if (scaled)                                                                   \
                for (size_t i = 0; i < m; i++)                                            \
                    CF_SHM_STORE(D, d, i, acc[i] * s);                                    \
            else                                                                          \
                for (size_t i = 0; i < m; i++)                                            \
                    CF_SHM_STORE(D, d, i, acc[i]);                                        \
        }                                                                                 \
    }

CF_SHM_DEFINE_SUM(FP32)
CF_SHM_DEFINE_SUM(FP64)
CF_SHM_DEFINE_SUM(BF16)
CF_SHM_DEFINE_SUM(FP16)

typedef void (*cf_shm_sum_fn)(void *, const void *const *, int, size_t, double);
static const cf_shm_sum_fn cf_shm_sums[CF_DTYPE_COUNT] = {cf_shm_sum_FP32, cf_shm_sum_FP64,
                                                          cf_shm_sum_BF16, cf_shm_sum_FP16};

void cf_shm_reduce_run(void *dst, const void *const *srcs, int nsrc, size_t n, int dtype,
                       double scale)
{
    if (n > 0)
        cf_shm_sums[dtype](dst, srcs, nsrc, n, scale);
}

typedef struct {
    unsigned char *dst;
    const unsigned char *srcs[CF_SHM_MAX_WORLD];
    int nsrc, dtype;
    size_t esz;
    double scale;
} cf_shm_reduce_ctx;

static void cf_shm_reduce_range(void *ctx_, int64_t a, int64_t b)
{
    const cf_shm_reduce_ctx *c = ctx_;
    const void *srcs[CF_SHM_MAX_WORLD];
    for (int j = 0; j < c->nsrc; j++)
        srcs[j] = c->srcs[j] + (size_t)a * c->esz;
    cf_shm_reduce_run(c->dst + (size_t)a * c->esz, srcs, c->nsrc, (size_t)(b - a), c->dtype,
                      c->scale);
}

/* Threads for a loop moving `bytes` (reads + writes). */
static int cf_shm_threads(size_t bytes, int64_t max_threads)
{
    return bytes > (size_t)CF_CHUNK_PARALLEL_BYTES ? cf_num_threads(max_threads) : 1;
}

/* Sum (unchecked, threaded): see cf_shm_reduce_run. */
static void cf_shm_reduce_par(void *dst, const void *const *srcs, int nsrc, size_t n, int dtype,
                              double scale, int64_t max_threads)
{
    cf_shm_reduce_ctx ctx;
    size_t esz = cf_dtype_size(dtype);
    int nt = cf_shm_threads(n * esz * (size_t)(nsrc + 1), max_threads);
    if (n == 0)
        return;
    if (nt <= 1) {
        cf_shm_reduce_run(dst, srcs, nsrc, n, dtype, scale);
        return;
    }
    ctx.dst = dst;
    for (int j = 0; j < nsrc; j++)
        ctx.srcs[j] = srcs[j];
    ctx.nsrc = nsrc;
    ctx.dtype = dtype;
    ctx.esz = esz;
    ctx.scale = scale;
    cf_parallel_for((int64_t)n, nt, cf_shm_reduce_range, &ctx);
}

cf_status cf_shm_reduce(void *dst, const void *const *srcs, int64_t nsrc, int64_t numel,
                        int dtype, double scale, int64_t max_threads, cf_err *err)
{
    size_t esz = cf_dtype_size(dtype), bytes;
    if (esz == 0)
        return cf_err_set(err, CF_EINVAL, "unknown dtype code %d; expected 0..%d", dtype,
                          CF_DTYPE_COUNT - 1);
    if (nsrc < 1 || nsrc > CF_SHM_MAX_WORLD)
        return cf_err_set(err, CF_EINVAL, "number of sources must be in [1, %d], got %lld",
                          CF_SHM_MAX_WORLD, (long long)nsrc);
    if (numel < 0)
        return cf_err_set(err, CF_EINVAL, "numel must be >= 0, got %lld", (long long)numel);
    if ((uint64_t)numel > (uint64_t)SIZE_MAX || cf_mul_size_overflows((size_t)numel, esz, &bytes))
        return cf_err_set(err, CF_EOVERFLOW, "numel %lld is too large", (long long)numel);
    if (numel == 0)
        return CF_OK;
    if (dst == NULL)
        return cf_err_set(err, CF_EINVAL, "dst: NULL address with numel %lld", (long long)numel);
    for (int64_t j = 0; j < nsrc; j++)
        if (srcs[j] == NULL)
            return cf_err_set(err, CF_EINVAL, "source %lld: NULL address with numel %lld",
                              (long long)j, (long long)numel);
    cf_shm_reduce_par(dst, srcs, (int)nsrc, (size_t)numel, dtype, scale, max_threads);
    return CF_OK;
}

/* A list of copies run as one parallel loop over their concatenated bytes. */
typedef struct {
    unsigned char *dst;
    const unsigned char *src;
    size_t len;
} cf_shm_seg;

typedef struct {
    const cf_shm_seg *segs;
    int n;
} cf_shm_copy_ctx;

static void cf_shm_copy_range(void *ctx_, int64_t a, int64_t b)
{
    const cf_shm_copy_ctx *c = ctx_;
    size_t at = 0;
    for (int i = 0; i < c->n && (int64_t)at < b; i++) {
        const cf_shm_seg *s = &c->segs[i];
        size_t lo = (int64_t)at > a ? at : (size_t)a;
        size_t hi = at + s->len < (size_t)b ? at + s->len : (size_t)b;
        if (hi > lo)
            memcpy(s->dst + (lo - at), s->src + (lo - at), hi - lo);
        at += s->len;
    }
}

static void cf_shm_copies(const cf_shm_seg *segs, int n, int64_t max_threads)
{
    cf_shm_copy_ctx ctx = {segs, n};
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += segs[i].len;
    if (total == 0)
        return;
    cf_parallel_for((int64_t)total, cf_shm_threads(2 * total, max_threads), cf_shm_copy_range,
                    &ctx);
}

cf_status cf_shm_memcpy(void *dst, const void *src, int64_t nbytes, int64_t max_threads,
                        cf_err *err)
{
    cf_shm_seg seg;
    if (nbytes < 0)
        return cf_err_set(err, CF_EINVAL, "nbytes must be >= 0, got %lld", (long long)nbytes);
    if ((uint64_t)nbytes > (uint64_t)SIZE_MAX)
        return cf_err_set(err, CF_EOVERFLOW, "nbytes %lld is too large", (long long)nbytes);
    if (nbytes == 0)
        return CF_OK;
    if (dst == NULL || src == NULL)
        return cf_err_set(err, CF_EINVAL, "NULL address with nbytes %lld", (long long)nbytes);
    seg.dst = dst;
    seg.src = src;
    seg.len = (size_t)nbytes;
    cf_shm_copies(&seg, 1, max_threads);
    return CF_OK;
}

/* ------------------------------------------------------------------------
 * Segment
 * ------------------------------------------------------------------------ */

static const char *const cf_shm_op_names[CF_SHM_OP_COUNT] = {
    "all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all"};
static const char *const cf_shm_dtype_names[CF_DTYPE_COUNT] = {"float32", "float64",
                                                               "bfloat16", "float16"};

const char *cf_shm_op_name(int op)
{
    return op >= 0 && op < CF_SHM_OP_COUNT ? cf_shm_op_names[op] : "?";
}

static const char *cf_shm_dtype_name(int dtype)
{
    return dtype >= 0 && dtype < CF_DTYPE_COUNT ? cf_shm_dtype_names[dtype] : "?";
}

static size_t cf_shm_ctrl_off(void)
{
    return sizeof(cf_shm_header); /* a multiple of CF_SHM_LINE (its alignment) */
}

static size_t cf_shm_data_off(int64_t world)
{
    size_t end = cf_shm_ctrl_off() + (size_t)world * sizeof(cf_shm_ctrl);
    return (end + CF_SHM_PAGE - 1) / CF_SHM_PAGE * CF_SHM_PAGE;
}

size_t cf_shm_segment_bytes(int64_t world_size, int64_t slot_bytes)
{
    size_t per_rank, data, total;
    if (world_size < 1 || world_size > CF_SHM_MAX_WORLD || slot_bytes < 0 ||
        (uint64_t)slot_bytes > SIZE_MAX / 2)
        return 0;
    per_rank = 2 * (size_t)slot_bytes;
    if (cf_mul_size_overflows(per_rank, (size_t)world_size, &data))
        return 0;
    total = cf_shm_data_off(world_size) + data;
    return total < data ? 0 : total;
}

/* CF_ERUNTIME with the message of a failed system call. */
static cf_status cf_shm_sys_err(cf_err *err, const char *call, const char *name)
{
    int e = errno;
    return cf_err_set(err, CF_ERUNTIME, "cfsdp shm: %s(\"%s\") failed: %s (errno %d)", call,
                      name, strerror(e), e);
}

static double cf_shm_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void cf_shm_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Sleep until *word != seen, a wake-up, or `ns` nanoseconds. */
static void cf_shm_sleep_on(_Atomic uint32_t *word, uint32_t seen, long ns)
{
    struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
#if defined(__linux__)
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, seen, &ts, NULL, 0);
#else
    (void)word;
    (void)seen;
    if (ts.tv_sec == 0 && ts.tv_nsec > 200000L)
        ts.tv_nsec = 200000L;
    nanosleep(&ts, NULL);
#endif
}

static void cf_shm_wake(_Atomic uint32_t *word)
{
#if defined(__linux__)
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#else
    (void)word;
#endif
}

/* A file type in words (messages). */
static const char *cf_shm_file_kind(mode_t mode)
{
    switch (mode & S_IFMT) {
    case S_IFREG: return "regular file";
    case S_IFDIR: return "directory";
    case S_IFLNK: return "symbolic link";
    case S_IFIFO: return "FIFO";
    case S_IFSOCK: return "socket";
    case S_IFCHR: return "character device";
    case S_IFBLK: return "block device";
    default: return "file of unknown type";
    }
}

/* The user name of `uid` into buf, or "no user name" if the user database has none. */
static void cf_shm_user_name(uid_t uid, char *buf, size_t n)
{
    struct passwd pw, *found = NULL;
    char tmp[2048];
    if (getpwuid_r(uid, &pw, tmp, sizeof tmp, &found) == 0 && found != NULL)
        snprintf(buf, n, "%s", found->pw_name);
    else
        snprintf(buf, n, "no user name");
}

/* cf_shm_check_fd on a stat already taken (fstat, or lstat of a symbolic link). */
static cf_status cf_shm_check_stat(const struct stat *sb, const char *path, cf_err *err)
{
    uid_t me = geteuid();
    char owner[64], mine[64];
    if (S_ISREG(sb->st_mode) && sb->st_uid == me && (sb->st_mode & 077) == 0)
        return CF_OK;
    cf_shm_user_name(sb->st_uid, owner, sizeof owner);
    cf_shm_user_name(me, mine, sizeof mine);
    return cf_err_set(err, CF_EPERM,
                      "cfsdp: refused to map %s: a %s of uid %lu (%s) with mode %04o, not "
                      "this job's (a regular file of uid %lu (%s) with no group or other "
                      "permissions). Another user of this machine may be attacking the job "
                      "through its rendezvous store (torch's store has no authentication): "
                      "find who, keep other users off the store's port, restart the job",
                      path, cf_shm_file_kind(sb->st_mode), (unsigned long)sb->st_uid, owner,
                      (unsigned)(sb->st_mode & 07777), (unsigned long)me, mine);
}

cf_status cf_shm_check_fd(int fd, const char *path, cf_err *err)
{
    struct stat sb;
    if (fstat(fd, &sb) != 0)
        return cf_shm_sys_err(err, "fstat", path);
    return cf_shm_check_stat(&sb, path, err);
}

cf_status cf_shm_map_file(const char *path, bool create, size_t bytes, void **out, cf_err *err)
{
    struct stat sb;
    void *base;
    cf_status st = CF_OK;
    int fd;

    *out = NULL;
    if (bytes == 0 || bytes > (size_t)INT64_MAX)
        return cf_err_set(err, CF_EINVAL, "cfsdp shm: a segment of %zu bytes (1 to 2**63-1)",
                          bytes);
    fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0), 0600);
    if (fd < 0) {
        int e = errno;
        if (e == ELOOP && lstat(path, &sb) == 0)
            st = cf_shm_check_stat(&sb, path, err); /* names the link's owner and mode */
        if (st == CF_OK) {
            errno = e;
            st = cf_shm_sys_err(err, "open", path);
        }
        return st;
    }
    /* before anything reads, writes or maps it: see "Trust" in the file comment */
    st = cf_shm_check_fd(fd, path, err);
    if (st == CF_OK && create) {
        if (ftruncate(fd, (off_t)bytes) != 0)
            st = cf_shm_sys_err(err, "ftruncate", path);
        else if ((errno = posix_fallocate(fd, 0, (off_t)bytes)) != 0)
            st = cf_shm_sys_err(err, "posix_fallocate", path); /* its pages, or ENOSPC now */
    } else if (st == CF_OK) {
        if (fstat(fd, &sb) != 0)
            st = cf_shm_sys_err(err, "fstat", path);
        else if ((uint64_t)sb.st_size != (uint64_t)bytes)
            st = cf_err_set(err, CF_EINVAL, "cfsdp shm: %s has %lld bytes, expected %zu", path,
                            (long long)sb.st_size, bytes);
    }
    if (st == CF_OK) {
        base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (base == MAP_FAILED)
            st = cf_shm_sys_err(err, "mmap", path);
        else
            *out = base;
    }
    close(fd);
    if (st != CF_OK && create)
        unlink(path); /* ours (O_EXCL): nothing half-made is left */
    return st;
}

/* Unlink the segment's name (the creator's, or any rank's on failure). */
static void cf_shm_unlink(cf_shm_group *g)
{
    if (g->linked || !g->creator) {
        shm_unlink(g->name); /* ENOENT (someone did it) is fine */
        g->linked = false;
    }
}

/* ------------------------------------------------------------------------
 * Liveness (see the file comment)
 * ------------------------------------------------------------------------ */

#if CF_SHM_LIVENESS
/* Initialise every rank's `alive` lock (the creator, before the magic). */
static cf_status cf_shm_alive_init(cf_shm_group *g, cf_err *err)
{
    pthread_mutexattr_t attr;
    int rc = pthread_mutexattr_init(&attr);
    if (rc == 0)
        rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    if (rc == 0)
        rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    for (int q = 0; rc == 0 && q < g->world; q++)
        rc = pthread_mutex_init(&g->ctrl[q].alive, &attr);
    pthread_mutexattr_destroy(&attr);
    if (rc != 0)
        return cf_err_set(err, CF_ERUNTIME,
                          "cfsdp shm: cannot make the liveness locks of segment \"%s\": %s",
                          g->name, strerror(rc));
    return CF_OK;
}

/* The keeper: lock this rank's `alive`, say so, hold it until told to stop,
 * then mark the view closed and unlock. */
static void *cf_shm_keeper_main(void *arg)
{
    cf_shm_group *g = arg;
    pthread_mutex_t *alive = &g->ctrl[g->rank].alive;
    sigset_t all;
    int rc;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    rc = pthread_mutex_lock(alive);
    if (rc == EOWNERDEAD) /* cannot happen on a fresh segment; be safe anyway */
        rc = pthread_mutex_consistent(alive);
    pthread_mutex_lock(&g->keep_mu);
    g->keep_state = rc == 0 ? 1 : -1;
    pthread_cond_broadcast(&g->keep_cv);
    while (rc == 0 && !g->keep_stop)
        pthread_cond_wait(&g->keep_cv, &g->keep_mu);
    pthread_mutex_unlock(&g->keep_mu);
    if (rc == 0) {
        atomic_store_explicit(&g->ctrl[g->rank].closed, 1u, memory_order_seq_cst);
        pthread_mutex_unlock(alive);
    }
    return NULL;
}

/* Start the keeper and wait until it holds this rank's lock. */
static cf_status cf_shm_keeper_start(cf_shm_group *g, cf_err *err)
{
    pthread_attr_t attr;
    int rc, state;
    rc = pthread_attr_init(&attr);
    if (rc == 0) {
        pthread_attr_setstacksize(&attr, CF_SHM_KEEPER_STACK); /* EINVAL: the default */
        rc = pthread_create(&g->keeper, &attr, cf_shm_keeper_main, g);
        pthread_attr_destroy(&attr);
    }
    if (rc != 0)
        return cf_err_set(err, CF_ERUNTIME,
                          "cfsdp shm: cannot start the liveness thread of segment \"%s\": %s",
                          g->name, strerror(rc));
    g->keeper_started = true;
    pthread_mutex_lock(&g->keep_mu);
    while (g->keep_state == 0)
        pthread_cond_wait(&g->keep_cv, &g->keep_mu);
    state = g->keep_state;
    pthread_mutex_unlock(&g->keep_mu);
    if (state < 0)
        return cf_err_set(err, CF_ERUNTIME,
                          "cfsdp shm: cannot take rank %d's liveness lock in segment \"%s\"",
                          g->rank, g->name);
    return CF_OK;
}

/* Stop and join the keeper (it unlocks); only in the process that started it. */
static void cf_shm_keeper_stop(cf_shm_group *g)
{
    if (!g->keeper_started)
        return;
    if (getpid() == g->pid) {
        pthread_mutex_lock(&g->keep_mu);
        g->keep_stop = true;
        pthread_cond_broadcast(&g->keep_cv);
        pthread_mutex_unlock(&g->keep_mu);
        pthread_join(g->keeper, NULL);
    }
    g->keeper_started = false;
}
#endif

typedef enum { CF_SHM_ALIVE = 0, CF_SHM_DEAD, CF_SHM_CLOSED } cf_shm_liveness;

/* Whether rank q's view is open (see Liveness); CF_SHM_ALIVE when unknown. */
static cf_shm_liveness cf_shm_probe(const cf_shm_group *g, int q)
{
#if CF_SHM_LIVENESS
    pthread_mutex_t *alive = &g->ctrl[q].alive;
    int rc = pthread_mutex_trylock(alive);
    if (rc == EBUSY)
        return CF_SHM_ALIVE;
    if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(alive);
        pthread_mutex_unlock(alive);
        return CF_SHM_DEAD;
    }
    if (rc == 0) {
        pthread_mutex_unlock(alive);
        return atomic_load(&g->ctrl[q].closed) ? CF_SHM_CLOSED : CF_SHM_DEAD;
    }
    return rc == ENOTRECOVERABLE ? CF_SHM_DEAD : CF_SHM_ALIVE;
#else
    (void)g;
    (void)q;
    return CF_SHM_ALIVE;
#endif
}

cf_status cf_shm_group_open(const char *name, bool create, int64_t world_size, int64_t rank,
                            int64_t slot_bytes, double timeout_s, const char *label,
                            const int64_t *global_ranks, cf_shm_group **out, cf_err *err)
{
    cf_shm_group *g = NULL;
    size_t bytes;
    char path[sizeof CF_SHM_DIR + CF_SHM_NAME_LEN];
    void *base = NULL;
    cf_status st = CF_OK;

    *out = NULL;
    if (world_size < 1 || world_size > CF_SHM_MAX_WORLD)
        return cf_err_set(err, CF_EINVAL, "world_size must be in [1, %d], got %lld",
                          CF_SHM_MAX_WORLD, (long long)world_size);
    if (rank < 0 || rank >= world_size || (create && rank != 0))
        return cf_err_set(err, CF_EINVAL,
                          "rank %lld is not valid for world_size %lld (the creator is rank 0)",
                          (long long)rank, (long long)world_size);
    if (slot_bytes < CF_SHM_MIN_SLOT_PER_RANK * world_size || slot_bytes % CF_SHM_LINE != 0 ||
        slot_bytes > CF_SHM_MAX_SLOT_BYTES)
        return cf_err_set(err, CF_EINVAL,
                          "slot_bytes must be a multiple of %d in [%d x world_size = %lld, "
                          "%lld], got %lld",
                          CF_SHM_LINE, CF_SHM_MIN_SLOT_PER_RANK,
                          (long long)(CF_SHM_MIN_SLOT_PER_RANK * world_size),
                          (long long)CF_SHM_MAX_SLOT_BYTES, (long long)slot_bytes);
    if (!(timeout_s > 0) || !isfinite(timeout_s))
        return cf_err_set(err, CF_EINVAL, "timeout must be a positive number of seconds, got %g",
                          timeout_s);
    if (name == NULL || name[0] != '/' || strlen(name) >= CF_SHM_NAME_LEN ||
        strchr(name + 1, '/') != NULL)
        return cf_err_set(err, CF_EINVAL,
                          "shm name must be \"/name\" (no other '/') shorter than %d bytes",
                          CF_SHM_NAME_LEN);
    bytes = cf_shm_segment_bytes(world_size, slot_bytes);
    if (bytes == 0)
        return cf_err_set(err, CF_EOVERFLOW, "segment of %lld ranks x 2 x %lld bytes is too large",
                          (long long)world_size, (long long)slot_bytes);

    g = calloc(1, sizeof *g);
    if (g != NULL)
        g->global_ranks = calloc((size_t)world_size, sizeof *g->global_ranks);
    if (g == NULL || g->global_ranks == NULL) {
        st = cf_err_set(err, CF_ENOMEM, "cfsdp shm: out of memory for a group");
        goto fail;
    }
#if CF_SHM_LIVENESS
    pthread_mutex_init(&g->keep_mu, NULL);
    pthread_cond_init(&g->keep_cv, NULL);
#endif
    snprintf(path, sizeof path, "%s%s", CF_SHM_DIR, name);
    /* the name is opened as shm_open does (O_NOFOLLOW | O_CLOEXEC in CF_SHM_DIR), checked
     * before it is sized or mapped ("Trust" in the file comment) */
    CF_CHECK_GOTO(cf_shm_map_file(path, create, bytes, &base, err), st, fail);
    g->creator = g->linked = create;

    g->base = base;
    g->bytes = bytes;
    g->hdr = base;
    g->ctrl = (cf_shm_ctrl *)(g->base + cf_shm_ctrl_off());
    g->data = g->base + cf_shm_data_off(world_size);
    g->world = (int)world_size;
    g->rank = (int)rank;
    g->slot_bytes = (size_t)slot_bytes;
    g->timeout_s = timeout_s;
    snprintf(g->name, sizeof g->name, "%s", name);
    snprintf(g->label, sizeof g->label, "%s", label ? label : "");
    if (gethostname(g->host, sizeof g->host) != 0)
        snprintf(g->host, sizeof g->host, "?");
    g->host[sizeof g->host - 1] = '\0'; /* a truncated name may lack its NUL */
    g->pid = getpid();
    for (int64_t q = 0; q < world_size; q++)
        g->global_ranks[q] = global_ranks ? global_ranks[q] : q;
    atomic_init(&g->aborted, 0);
    atomic_init(&g->failed_self, 0);

    if (create) { /* ftruncate zero-filled it: counters and flags start at 0 */
        g->hdr->world_size = (uint64_t)world_size;
        g->hdr->slot_bytes = (uint64_t)slot_bytes;
        g->hdr->total_bytes = (uint64_t)bytes;
#if CF_SHM_LIVENESS
        st = cf_shm_alive_init(g, err);
        if (st != CF_OK)
            goto fail;
#endif
        atomic_store_explicit(&g->hdr->magic, CF_SHM_MAGIC, memory_order_release);
    } else if (atomic_load_explicit(&g->hdr->magic, memory_order_acquire) != CF_SHM_MAGIC ||
               g->hdr->world_size != (uint64_t)world_size ||
               g->hdr->slot_bytes != (uint64_t)slot_bytes) {
        st = cf_err_set(err, CF_EINVAL,
                        "cfsdp shm: segment \"%s\" is not a cfsdp segment for %lld ranks x "
                        "slot %lld (header: magic %llx, %llu ranks, slot %llu)",
                        name, (long long)world_size, (long long)slot_bytes,
                        (unsigned long long)atomic_load(&g->hdr->magic),
                        (unsigned long long)g->hdr->world_size,
                        (unsigned long long)g->hdr->slot_bytes);
        goto fail;
    }
#if CF_SHM_LIVENESS
    st = cf_shm_keeper_start(g, err); /* before counting in: peers may probe us after */
    if (st != CF_OK)
        goto fail;
#endif
    if (atomic_fetch_add(&g->hdr->attached, 1u) + 1u == (uint32_t)world_size)
        cf_shm_unlink(g); /* every rank has mapped it: the name has done its work */
    cf_shm_wake(&g->hdr->attached);
    *out = g;
    return CF_OK;

fail:
#if CF_SHM_LIVENESS
    if (g != NULL && g->global_ranks != NULL) { /* keep_mu and keep_cv were made */
        cf_shm_keeper_stop(g);
        pthread_cond_destroy(&g->keep_cv);
        pthread_mutex_destroy(&g->keep_mu);
    }
#endif
    if (g != NULL && g->base != NULL)
        munmap(g->base, g->bytes);
    if (g != NULL && g->linked)
        shm_unlink(name);
    if (g != NULL)
        free(g->global_ranks);
    free(g);
    return st;
}

/* The prefix of every message of a collective. */
#define CF_SHM_WHO "cfsdp shm group '%s' (rank %d of %d, global rank %lld)"
#define CF_SHM_WHO_ARGS(g) (g)->label, (g)->rank, (g)->world, (long long)(g)->global_ranks[(g)->rank]

cf_status cf_shm_group_wait_attached(cf_shm_group *g, cf_err *err)
{
    double deadline = cf_shm_now() + g->timeout_s;
    cf_status st = CF_OK;
    int spins = 0;
    for (;;) {
        uint32_t n = atomic_load_explicit(&g->hdr->attached, memory_order_acquire);
        double now;
        if (n >= (uint32_t)g->world)
            break;
        if (atomic_load(&g->aborted)) {
            st = cf_err_set(err, CF_ERUNTIME, CF_SHM_WHO ": set-up aborted: the group was closed",
                            CF_SHM_WHO_ARGS(g));
            break;
        }
        if (spins++ < CF_SHM_SPINS) {
            cf_shm_cpu_relax();
            continue;
        }
        now = cf_shm_now();
        if (now >= deadline) {
            st = cf_err_set(err, CF_ERUNTIME,
                            CF_SHM_WHO ": set-up timed out after %g s: %u of %d ranks attached "
                            "to segment %s (a peer died or stalled before attaching)",
                            CF_SHM_WHO_ARGS(g), g->timeout_s, n, g->world, g->name);
            break;
        }
        {
            double left = deadline - now;
            long ns = left * 1e9 < CF_SHM_NAP_NS ? (long)(left * 1e9) + 1 : CF_SHM_NAP_NS;
            cf_shm_sleep_on(&g->hdr->attached, n, ns);
        }
    }
    if (st == CF_OK) {
        if (g->creator)
            cf_shm_unlink(g);
    } else {
        cf_shm_unlink(g); /* nobody may be left to do it */
    }
    return st;
}

void cf_shm_group_abort(cf_shm_group *g)
{
    atomic_store(&g->aborted, 1);
    cf_shm_wake(&g->ctrl[g->rank].step); /* our own thread may sleep on nothing else... */
    for (int q = 0; q < g->world; q++)   /* ...but on any peer's counter */
        cf_shm_wake(&g->ctrl[q].step);
    cf_shm_wake(&g->hdr->attached);
    cf_shm_wake(&g->hdr->failed); /* a cf_shm_group_wait_failure */
}

void cf_shm_group_close(cf_shm_group *g)
{
    if (g == NULL)
        return;
    if (g->linked)
        cf_shm_unlink(g);
#if CF_SHM_LIVENESS
    cf_shm_keeper_stop(g); /* marks the view closed and unlocks: before the unmap */
    pthread_cond_destroy(&g->keep_cv);
    pthread_mutex_destroy(&g->keep_mu);
#endif
    munmap(g->base, g->bytes);
    free(g->global_ranks);
    free(g);
}

int64_t cf_shm_group_rank(const cf_shm_group *g) { return g->rank; }
int64_t cf_shm_group_world_size(const cf_shm_group *g) { return g->world; }
size_t cf_shm_group_bytes(const cf_shm_group *g) { return g->bytes; }

/* ------------------------------------------------------------------------
 * Synchronisation
 * ------------------------------------------------------------------------ */

/* Publish this rank's next step; returns it. */
static uint32_t cf_shm_publish(cf_shm_group *g)
{
    cf_shm_ctrl *me = &g->ctrl[g->rank];
    g->step++;
    atomic_store_explicit(&me->step, g->step, memory_order_seq_cst);
    if (atomic_load_explicit(&me->waiters, memory_order_seq_cst) != 0)
        cf_shm_wake(&me->step);
    return g->step;
}

/* Record this rank's failure in the segment (first failure wins) and wake
 * every sleeper, so the other ranks fail now rather than at their deadline. */
static void cf_shm_publish_failure(cf_shm_group *g, const cf_err *err)
{
    uint32_t none = 0;
    cf_shm_ctrl *me = &g->ctrl[g->rank];
    if (atomic_load(&g->hdr->failed) != 0)
        return;
    snprintf(me->fail_msg, sizeof me->fail_msg, "%s", err->msg);
    if (atomic_compare_exchange_strong(&g->hdr->failed, &none, (uint32_t)g->rank + 1u)) {
        for (int q = 0; q < g->world; q++)
            cf_shm_wake(&g->ctrl[q].step);
        cf_shm_wake(&g->hdr->attached);
        cf_shm_wake(&g->hdr->failed);
    }
}

bool cf_shm_group_wait_failure(cf_shm_group *g, double timeout_s, char *msg, size_t n)
{
    double deadline = cf_shm_now() + (timeout_s > 0 ? timeout_s : 0);
    for (;;) {
        uint32_t f = atomic_load_explicit(&g->hdr->failed, memory_order_acquire);
        double left;
        if (f != 0) {
            int r = (int)f - 1;
            snprintf(msg, n, "rank %d (global rank %lld) of cfsdp shm group '%s' failed: %s", r,
                     (long long)g->global_ranks[r], g->label, g->ctrl[r].fail_msg);
            return true;
        }
        left = deadline - cf_shm_now();
        if (left <= 0 || atomic_load(&g->aborted))
            return false;
        cf_shm_sleep_on(&g->hdr->failed, 0u,
                        left * 1e9 < CF_SHM_NAP_NS ? (long)(left * 1e9) + 1 : CF_SHM_NAP_NS);
    }
}

void cf_shm_group_fail(cf_shm_group *g, const char *msg)
{
    cf_err e;
    cf_err_init(&e);
    cf_err_set(&e, CF_ERUNTIME, "%s", msg != NULL ? msg : "failed");
    atomic_store_explicit(&g->failed_self, 1, memory_order_release);
    cf_shm_publish_failure(g, &e);
}

/* CF_ERUNTIME if another rank failed or this group was closed. */
static cf_status cf_shm_check_failed(const cf_shm_group *g, const cf_shm_args *a, cf_err *err)
{
    uint32_t f = atomic_load_explicit(&g->hdr->failed, memory_order_acquire);
    if (atomic_load_explicit(&g->aborted, memory_order_relaxed))
        return cf_err_set(err, CF_ERUNTIME, CF_SHM_WHO ": %s #%u aborted: the group was closed",
                          CF_SHM_WHO_ARGS(g), cf_shm_op_name(a->op), g->seq);
    if (atomic_load_explicit(&g->failed_self, memory_order_acquire))
        return cf_err_set(err, CF_ERUNTIME,
                          CF_SHM_WHO ": %s #%u refused: this rank failed outside the segment",
                          CF_SHM_WHO_ARGS(g), cf_shm_op_name(a->op), g->seq);
    if (f != 0 && (int)f - 1 != g->rank) {
        int r = (int)f - 1;
        return cf_err_set(err, CF_ERUNTIME,
                          CF_SHM_WHO ": %s #%u aborted because rank %d (global rank %lld) "
                          "failed: %s",
                          CF_SHM_WHO_ARGS(g), cf_shm_op_name(a->op), g->seq, r,
                          (long long)g->global_ranks[r], g->ctrl[r].fail_msg);
    }
    return CF_OK;
}

/* Wait until every other rank's step has reached `target` (mod 2^32). */
/* Rank q, which this rank waits for (its step has not reached `target`), is
 * dead or closed (`how`): fail naming it, unless it published `target` before
 * it went (re-read after the probe). */
static cf_status cf_shm_gone(cf_shm_group *g, int q, cf_shm_liveness how, uint32_t target,
                             const cf_shm_args *a, cf_err *err)
{
    uint32_t v = atomic_load_explicit(&g->ctrl[q].step, memory_order_seq_cst);
    if ((int32_t)(v - target) >= 0)
        return CF_OK;
    return cf_err_set(err, CF_ERUNTIME,
                      CF_SHM_WHO ": %s #%u (numel %lld, %s): rank %d (global rank %lld) on "
                      "host '%s' %s while this rank waited for it",
                      CF_SHM_WHO_ARGS(g), cf_shm_op_name(a->op), g->seq, (long long)a->numel,
                      cf_shm_dtype_name(a->dtype), q, (long long)g->global_ranks[q], g->host,
                      how == CF_SHM_DEAD
                          ? "died (its process ended: killed, crashed, or exited without "
                            "closing the group)"
                          : "closed the group (it will not run this collective)");
}

/* Wait until every other rank's step has reached `target` (mod 2^32).  A
 * wait on rank q probes q's liveness every CF_SHM_PROBE_S (see Liveness). */
static cf_status cf_shm_wait_all(cf_shm_group *g, uint32_t target, const cf_shm_args *a,
                                 cf_err *err)
{
    double deadline = -1.0;
    for (int q = 0; q < g->world; q++) {
        cf_shm_ctrl *c = &g->ctrl[q];
        int spins = 0;
        double probe_at = -1.0;
        if (q == g->rank)
            continue;
        for (;;) {
            uint32_t v = atomic_load_explicit(&c->step, memory_order_acquire);
            double now;
            if ((int32_t)(v - target) >= 0)
                break;
            CF_CHECK(cf_shm_check_failed(g, a, err));
            if (spins++ < CF_SHM_SPINS) {
                cf_shm_cpu_relax();
                continue;
            }
            now = cf_shm_now();
            if (deadline < 0)
                deadline = now + g->timeout_s;
            if (probe_at < 0)
                probe_at = now + CF_SHM_PROBE_S;
            if (now >= probe_at) {
                cf_shm_liveness how = cf_shm_probe(g, q);
                if (how != CF_SHM_ALIVE) {
                    CF_CHECK(cf_shm_gone(g, q, how, target, a, err));
                    break; /* it published before it went */
                }
                probe_at = now + CF_SHM_PROBE_S;
            }
            if (now >= deadline) {
                char who[160];
                size_t at = 0;
                who[0] = '\0';
                for (int p = 0; p < g->world && at + 40 < sizeof who; p++) {
                    uint32_t w = atomic_load(&g->ctrl[p].step);
                    if (p != g->rank && (int32_t)(w - target) < 0) {
                        int n = snprintf(who + at, sizeof who - at, "%s%d (global %lld)",
                                         at ? ", " : "", p, (long long)g->global_ranks[p]);
                        at += n > 0 ? (size_t)n : 0;
                    }
                }
                return cf_err_set(err, CF_ERUNTIME,
                                  CF_SHM_WHO ": %s #%u (numel %lld, %s) timed out after %g s: "
                                  "rank(s) %s did not arrive (dead, stalled, or running "
                                  "different collectives)",
                                  CF_SHM_WHO_ARGS(g), cf_shm_op_name(a->op), g->seq,
                                  (long long)a->numel, cf_shm_dtype_name(a->dtype),
                                  g->timeout_s, who);
            }
            {
                double left = (deadline - now) * 1e9;
                long ns = left < (double)CF_SHM_NAP_NS ? (long)left + 1 : CF_SHM_NAP_NS;
                atomic_fetch_add(&c->waiters, 1u);
                if (atomic_load(&c->step) == v && !atomic_load(&g->hdr->failed))
                    cf_shm_sleep_on(&c->step, v, ns);
                atomic_fetch_sub(&c->waiters, 1u);
            }
        }
    }
    return CF_OK;
}

/* Write this rank's descriptor of the current collective into desc[b]. */
static void cf_shm_put_desc(cf_shm_group *g, unsigned b, const cf_shm_args *a)
{
    cf_shm_desc *d = &g->ctrl[g->rank].desc[b];
    d->seq = g->seq;
    d->op = (uint32_t)a->op;
    d->dtype = a->dtype;
    d->pad = 0;
    d->numel = a->numel;
    d->root = a->root;
}

/* After the first wait of a collective: every rank runs the same one. */
static cf_status cf_shm_check_desc(const cf_shm_group *g, unsigned b, const cf_shm_args *a,
                                   cf_err *err)
{
    const cf_shm_desc *m = &g->ctrl[g->rank].desc[b];
    /* all_to_all's root is a hash of its counts matrix (cf_shm_all_to_all) */
    const char *mr = a->op == CF_SHM_ALL_TO_ALL ? "counts hash" : "root";
    for (int q = 0; q < g->world; q++) {
        const cf_shm_desc *d = &g->ctrl[q].desc[b];
        if (d->seq != m->seq || d->op != m->op || d->dtype != m->dtype ||
            d->numel != m->numel || d->root != m->root)
            return cf_err_set(err, CF_ERUNTIME,
                              CF_SHM_WHO ": collectives differ between ranks: this rank runs "
                              "#%u %s (numel %lld, %s, %s %lld), rank %d (global %lld) runs "
                              "#%u %s (numel %lld, %s, %s %lld)",
                              CF_SHM_WHO_ARGS(g), m->seq, cf_shm_op_name(a->op),
                              (long long)m->numel, cf_shm_dtype_name(m->dtype), mr,
                              (long long)m->root, q, (long long)g->global_ranks[q], d->seq,
                              cf_shm_op_name((int)d->op), (long long)d->numel,
                              cf_shm_dtype_name(d->dtype),
                              d->op == CF_SHM_ALL_TO_ALL ? "counts hash" : "root",
                              (long long)d->root);
    }
    return CF_OK;
}

/* Start piece k of a collective in slot half g->buf: wait until every rank
 * has finished reading it, and put the descriptor for the first piece. */
static cf_status cf_shm_piece_begin(cf_shm_group *g, int64_t k, const cf_shm_args *a,
                                    cf_err *err)
{
    CF_CHECK(cf_shm_wait_all(g, g->free_at[g->buf], a, err));
    if (k == 0)
        cf_shm_put_desc(g, g->buf, a);
    return CF_OK;
}

/* Publish the piece's data and wait for everyone's (checking descriptors
 * on the first piece). */
static cf_status cf_shm_piece_exchange(cf_shm_group *g, int64_t k, const cf_shm_args *a,
                                       cf_err *err)
{
    CF_CHECK(cf_shm_wait_all(g, cf_shm_publish(g), a, err));
    if (k == 0)
        CF_CHECK(cf_shm_check_desc(g, g->buf, a, err));
    return CF_OK;
}

/* The piece is read: its half is free once every rank has published this. */
static void cf_shm_piece_end(cf_shm_group *g)
{
    g->free_at[g->buf] = cf_shm_publish(g);
    g->buf ^= 1u;
}

static unsigned char *cf_shm_slot(const cf_shm_group *g, int q)
{
    return g->data + ((size_t)q * 2 + g->buf) * g->slot_bytes;
}

static int64_t cf_shm_clip(int64_t len, int64_t off, int64_t cap)
{
    int64_t left = len - off;
    return left <= 0 ? 0 : (left < cap ? left : cap);
}

/* ------------------------------------------------------------------------
 * Collectives
 * ------------------------------------------------------------------------ */

/* Pieces of `len` elements, `per` at a time (at least one, maybe empty). */
static int64_t cf_shm_pieces(int64_t len, int64_t per)
{
    return len <= 0 ? 1 : (len + per - 1) / per;
}

/* Elements per rank block when a slot half holds one block per rank
 * (cache-line aligned blocks). */
static int64_t cf_shm_block_numel(const cf_shm_group *g, size_t esz)
{
    size_t block = g->slot_bytes / (size_t)g->world / CF_SHM_LINE * CF_SHM_LINE;
    return (int64_t)(block / esz);
}

/*
 * The fused copy-out of one piece [off, off + len) of every rank's block: rank
 * q's piece (at from[q]) is elements [q*n + off, q*n + off + len) of the
 * rank-major buffer the plan describes, and goes to the natural buffer as
 * cf_chunk_unpack would put it (chunk padding is skipped).  One parallel loop
 * over the W pieces side by side, each range handed to cf_chunk_unpack_piece.
 */
typedef struct {
    const cf_chunk_plan *plan;
    void *natural;
    const unsigned char *const *from;
    int64_t n, off, len;
    size_t esz;
} cf_shm_unpack_ctx;

/* Elements [a, b) of the W pieces side by side (rank q's at [q*len, (q+1)*len)). */
static void cf_shm_unpack_range(void *ctx_, int64_t a, int64_t b)
{
    const cf_shm_unpack_ctx *c = ctx_;
    for (int64_t q = a / c->len; q * c->len < b; q++) {
        int64_t lo = a > q * c->len ? a - q * c->len : 0;
        int64_t hi = b < (q + 1) * c->len ? b - q * c->len : c->len;
        int64_t first = q * c->n + c->off; /* rank-major index of the piece's element 0 */
        cf_chunk_unpack_piece(c->natural, c->from[q] + (size_t)lo * c->esz, c->esz, c->plan,
                              first + lo, first + hi);
    }
}

static cf_status cf_shm_all_gather(cf_shm_group *g, const cf_shm_args *a, cf_err *err)
{
    const size_t esz = cf_dtype_size(a->dtype);
    const int64_t n = a->numel, per = (int64_t)(g->slot_bytes / esz);
    const int W = g->world, me = g->rank;
    unsigned char *dst = a->dst;
    const unsigned char *src = a->src;
    const cf_chunk_plan plan = {a->plan, (size_t)(a->n_plan > 0 ? a->n_plan : 0), W, n};
    const unsigned char *from[CF_SHM_MAX_WORLD];
    cf_shm_seg segs[CF_SHM_MAX_WORLD];

    for (int64_t k = 0, np = cf_shm_pieces(n, per); k < np; k++) {
        int64_t off = k * per, len = cf_shm_clip(n, off, per);
        size_t bytes = (size_t)len * esz;
        int ns = 0;
        CF_CHECK(cf_shm_piece_begin(g, k, a, err));
        segs[0] = (cf_shm_seg){cf_shm_slot(g, me), src + (size_t)off * esz, bytes};
        cf_shm_copies(segs, 1, a->max_threads);
        CF_CHECK(cf_shm_piece_exchange(g, k, a, err));
        for (int q = 0; q < W; q++) {
            unsigned char *to = dst + ((size_t)q * (size_t)n + (size_t)off) * esz;
            from[q] = q == me ? src + (size_t)off * esz : cf_shm_slot(g, q);
            if (a->plan == NULL && to != from[q])
                segs[ns++] = (cf_shm_seg){to, from[q], bytes};
        }
        if (a->plan != NULL && len > 0) {
            cf_shm_unpack_ctx ctx = {&plan, a->dst, from, n, off, len, esz};
            cf_parallel_for((int64_t)W * len, cf_shm_threads(2 * (size_t)W * bytes, a->max_threads),
                            cf_shm_unpack_range, &ctx);
        }
        cf_shm_copies(segs, ns, a->max_threads);
        cf_shm_piece_end(g);
    }
    return CF_OK;
}

static cf_status cf_shm_reduce_scatter(cf_shm_group *g, const cf_shm_args *a, cf_err *err)
{
    const size_t esz = cf_dtype_size(a->dtype);
    const int64_t n = a->numel, per = cf_shm_block_numel(g, esz);
    const int W = g->world, me = g->rank;
    const size_t block = (size_t)per * esz;
    unsigned char *dst = a->dst;
    const unsigned char *src = a->src;
    cf_shm_seg segs[CF_SHM_MAX_WORLD];
    const void *srcs[CF_SHM_MAX_WORLD];

    const cf_chunk_plan plan = {a->plan, (size_t)(a->n_plan > 0 ? a->n_plan : 0), W, n};

    for (int64_t k = 0, np = cf_shm_pieces(n, per); k < np; k++) {
        int64_t off = k * per, len = cf_shm_clip(n, off, per);
        size_t bytes = (size_t)len * esz;
        int ns = 0;
        CF_CHECK(cf_shm_piece_begin(g, k, a, err));
        if (a->plan != NULL) {
            /* fused copy-in: every rank block's piece packed from the natural
             * gradient into this rank's slot (its own block too, read back below) */
            for (int q = 0; q < W; q++)
                cf_chunk_pack_piece(cf_shm_slot(g, me) + (size_t)q * block, a->dtype, a->src,
                                    a->natural_dtype, &plan, (int64_t)q * n + off,
                                    (int64_t)q * n + off + len, a->divisor);
        } else {
            for (int q = 0; q < W; q++)
                if (q != me)
                    segs[ns++] = (cf_shm_seg){cf_shm_slot(g, me) + (size_t)q * block,
                                              src + ((size_t)q * (size_t)n + (size_t)off) * esz,
                                              bytes};
            cf_shm_copies(segs, ns, a->max_threads);
        }
        CF_CHECK(cf_shm_piece_exchange(g, k, a, err));
        for (int q = 0; q < W; q++)
            srcs[q] = q == me && a->plan == NULL
                          ? src + ((size_t)me * (size_t)n + (size_t)off) * esz
                          : cf_shm_slot(g, q) + (size_t)me * block;
        cf_shm_reduce_par(dst + (size_t)off * esz, srcs, W, (size_t)len, a->dtype, a->scale,
                          a->max_threads);
        cf_shm_piece_end(g);
    }
    return CF_OK;
}

/*
 * all_reduce: the buffer is cut into W chunks of c = ceil(N / W) elements
 * (the last ones shorter or empty); rank q reduces chunk q.  Per piece (the
 * same offset range in every chunk): copy the other ranks' chunk pieces into
 * their blocks of our half; exchange; sum our chunk piece from our input and
 * the others' blocks straight into dst, and copy it into our own block;
 * exchange; copy the other ranks' reduced pieces from their own blocks.
 * dst may be src (in place): every input element is read before its place
 * in dst is written.
 */
static cf_status cf_shm_all_reduce(cf_shm_group *g, const cf_shm_args *a, cf_err *err)
{
    const size_t esz = cf_dtype_size(a->dtype);
    const int W = g->world, me = g->rank;
    const int64_t N = a->numel, c = (N + W - 1) / W, per = cf_shm_block_numel(g, esz);
    const size_t block = (size_t)per * esz;
    unsigned char *dst = a->dst;
    const unsigned char *src = a->src;
    cf_shm_seg segs[CF_SHM_MAX_WORLD];
    const void *srcs[CF_SHM_MAX_WORLD];

    for (int64_t k = 0, np = cf_shm_pieces(c, per); k < np; k++) {
        int64_t off = k * per;
        int ns = 0;
        size_t mine;
        unsigned char *out;
        CF_CHECK(cf_shm_piece_begin(g, k, a, err));
        for (int q = 0; q < W; q++) {
            int64_t len = cf_shm_clip(cf_shm_clip(N, q * c, c), off, per);
            if (q != me && len > 0)
                segs[ns++] = (cf_shm_seg){cf_shm_slot(g, me) + (size_t)q * block,
                                          src + (size_t)(q * c + off) * esz, (size_t)len * esz};
        }
        cf_shm_copies(segs, ns, a->max_threads);
        CF_CHECK(cf_shm_piece_exchange(g, k, a, err));
        mine = (size_t)cf_shm_clip(cf_shm_clip(N, me * c, c), off, per);
        for (int q = 0; q < W; q++)
            srcs[q] = q == me ? src + (size_t)(me * c + off) * esz
                              : cf_shm_slot(g, q) + (size_t)me * block;
        out = dst + (size_t)(me * c + off) * esz;
        cf_shm_reduce_par(out, srcs, W, mine, a->dtype, a->scale, a->max_threads);
        segs[0] = (cf_shm_seg){cf_shm_slot(g, me) + (size_t)me * block, out, mine * esz};
        cf_shm_copies(segs, 1, a->max_threads);
        CF_CHECK(cf_shm_wait_all(g, cf_shm_publish(g), a, err));
        ns = 0;
        for (int q = 0; q < W; q++) {
            int64_t len = cf_shm_clip(cf_shm_clip(N, q * c, c), off, per);
            if (q != me && len > 0)
                segs[ns++] = (cf_shm_seg){dst + (size_t)(q * c + off) * esz,
                                          cf_shm_slot(g, q) + (size_t)q * block,
                                          (size_t)len * esz};
        }
        cf_shm_copies(segs, ns, a->max_threads);
        cf_shm_piece_end(g);
    }
    return CF_OK;
}

static cf_status cf_shm_broadcast(cf_shm_group *g, const cf_shm_args *a, cf_err *err)
{
    const size_t esz = cf_dtype_size(a->dtype);
    const int64_t n = a->numel, per = (int64_t)(g->slot_bytes / esz);
    const int root = (int)a->root;
    unsigned char *buf = a->dst;
    cf_shm_seg seg;

    for (int64_t k = 0, np = cf_shm_pieces(n, per); k < np; k++) {
        int64_t off = k * per, len = cf_shm_clip(n, off, per);
        CF_CHECK(cf_shm_piece_begin(g, k, a, err));
        if (g->rank == root) {
            seg = (cf_shm_seg){cf_shm_slot(g, root), buf + (size_t)off * esz, (size_t)len * esz};
            cf_shm_copies(&seg, 1, a->max_threads);
        }
        CF_CHECK(cf_shm_piece_exchange(g, k, a, err));
        if (g->rank != root) {
            seg = (cf_shm_seg){buf + (size_t)off * esz, cf_shm_slot(g, root), (size_t)len * esz};
            cf_shm_copies(&seg, 1, a->max_threads);
        }
        cf_shm_piece_end(g);
    }
    return CF_OK;
}

/*
 * all_to_all: rank s's block for rank r has C[s][r] elements (counts, sender-
 * major; the same matrix on every rank).  Per piece (the same offset range of
 * every block, per = a slot half's block per rank): copy this rank's block
 * pieces for each other rank q into block q of our half; exchange; copy block
 * `me` of every other rank's half into dst at that sender's displacement.
 * Pieces cover the largest block between two ranks (the same count on every
 * rank); a rank's own block goes straight from src to dst in the first piece.
 * The descriptor carries the total (numel) and a hash of the matrix (root), so
 * ranks whose matrices differ fail at the first piece with a message.
 */
static uint64_t cf_shm_counts_hash(const int64_t *counts, int W)
{
    uint64_t h = 0xcbf29ce484222325ULL; /* FNV-1a over the entries' bytes */
    for (size_t i = 0; i < (size_t)W * (size_t)W; i++) {
        uint64_t v = (uint64_t)counts[i];
        for (int b = 0; b < 8; b++) {
            h ^= (v >> (8 * b)) & 0xffu;
            h *= 0x100000001b3ULL;
        }
    }
    return h;
}

static cf_status cf_shm_all_to_all(cf_shm_group *g, const cf_shm_args *a0, cf_err *err)
{
    const size_t esz = cf_dtype_size(a0->dtype);
    const int W = g->world, me = g->rank;
    const int64_t *C = a0->counts, per = cf_shm_block_numel(g, esz);
    const size_t block = (size_t)per * esz;
    unsigned char *dst = a0->dst;
    const unsigned char *src = a0->src;
    int64_t sdisp[CF_SHM_MAX_WORLD], rdisp[CF_SHM_MAX_WORLD], most = 0, at_s = 0, at_r = 0;
    cf_shm_seg segs[CF_SHM_MAX_WORLD];
    cf_shm_args a = *a0;
    a.root = (int64_t)(cf_shm_counts_hash(C, W) >> 1); /* compared as the descriptor's root */

    for (int q = 0; q < W; q++) {
        sdisp[q] = at_s;
        at_s += C[(size_t)me * (size_t)W + (size_t)q];
        rdisp[q] = at_r;
        at_r += C[(size_t)q * (size_t)W + (size_t)me];
    }
    for (int s = 0; s < W; s++)
        for (int r = 0; r < W; r++)
            if (s != r && C[(size_t)s * (size_t)W + (size_t)r] > most)
                most = C[(size_t)s * (size_t)W + (size_t)r];

    for (int64_t k = 0, np = cf_shm_pieces(most, per); k < np; k++) {
        int64_t off = k * per;
        int ns = 0;
        CF_CHECK(cf_shm_piece_begin(g, k, &a, err));
        for (int q = 0; q < W; q++) {
            int64_t len = cf_shm_clip(C[(size_t)me * (size_t)W + (size_t)q], off, per);
            if (q != me && len > 0)
                segs[ns++] = (cf_shm_seg){cf_shm_slot(g, me) + (size_t)q * block,
                                          src + (size_t)(sdisp[q] + off) * esz,
                                          (size_t)len * esz};
        }
        cf_shm_copies(segs, ns, a.max_threads);
        CF_CHECK(cf_shm_piece_exchange(g, k, &a, err));
        ns = 0;
        for (int q = 0; q < W; q++) {
            int64_t n = C[(size_t)q * (size_t)W + (size_t)me];
            int64_t len = q == me ? (k == 0 ? n : 0) : cf_shm_clip(n, off, per);
            if (len > 0)
                segs[ns++] = (cf_shm_seg){
                    dst + (size_t)(rdisp[q] + (q == me ? 0 : off)) * esz,
                    q == me ? src + (size_t)sdisp[me] * esz
                            : cf_shm_slot(g, q) + (size_t)me * block,
                    (size_t)len * esz};
        }
        cf_shm_copies(segs, ns, a.max_threads);
        cf_shm_piece_end(g);
    }
    return CF_OK;
}

/*
 * all_to_all's checks (cf_shm_check): the counts matrix (non-negative entries,
 * its sums fit in bytes), numel its total, this rank's send and receive totals
 * addressable and not overlapping; no plan, root 0, scale 1.
 */
/* [lo, lo + n) and [lo2, lo2 + n2) overlap (byte ranges, non-empty). */
static bool cf_shm_overlap(const void *p, size_t n, const void *q, size_t m)
{
    uintptr_t a = (uintptr_t)p, b = (uintptr_t)q;
    return n > 0 && m > 0 && a < b + m && b < a + n;
}

static cf_status cf_shm_check_all_to_all(const cf_shm_group *g, const cf_shm_args *a,
                                         size_t esz, cf_err *err)
{
    const int W = g->world, me = g->rank;
    const int64_t cap = (int64_t)((size_t)INT64_MAX / esz);
    int64_t total = 0, sent = 0, got = 0;
    if (a->counts == NULL)
        return cf_err_set(err, CF_EINVAL, "all_to_all: counts is NULL");
    if (a->plan != NULL || a->root != 0 || a->scale != 1.0)
        return cf_err_set(err, CF_EINVAL, "all_to_all takes no plan, root 0 and scale 1");
    for (int s = 0; s < W; s++)
        for (int r = 0; r < W; r++) {
            int64_t c = a->counts[(size_t)s * (size_t)W + (size_t)r];
            if (c < 0)
                return cf_err_set(err, CF_EINVAL,
                                  "all_to_all: counts[%d][%d] must be >= 0, got %lld", s, r,
                                  (long long)c);
            if (c > cap - total)
                return cf_err_set(err, CF_EOVERFLOW, "all_to_all: counts are too large");
            total += c;
            if (s == me)
                sent += c;
            if (r == me)
                got += c;
        }
    if (total != a->numel)
        return cf_err_set(err, CF_EINVAL, "all_to_all: numel %lld is not the counts' total %lld",
                          (long long)a->numel, (long long)total);
    if ((sent > 0 && a->src == NULL) || (got > 0 && a->dst == NULL))
        return cf_err_set(err, CF_EINVAL, "all_to_all: NULL address");
    if (cf_shm_overlap(a->dst, (size_t)got * esz, a->src, (size_t)sent * esz))
        return cf_err_set(err, CF_EINVAL, "all_to_all: input and output overlap");
    return CF_OK;
}


cf_status cf_shm_check(const cf_shm_group *g, const cf_shm_args *a, cf_err *err)
{
    size_t esz = cf_dtype_size(a->dtype), unit, in_bytes = 0, out_bytes = 0;
    const char *name = cf_shm_op_name(a->op);
    if (a->op < 0 || a->op >= CF_SHM_OP_COUNT)
        return cf_err_set(err, CF_EINVAL, "unknown collective code %d; expected 0..%d", a->op,
                          CF_SHM_OP_COUNT - 1);
    if (esz == 0)
        return cf_err_set(err, CF_EINVAL, "%s: unknown dtype code %d; expected 0..%d", name,
                          a->dtype, CF_DTYPE_COUNT - 1);
    if (a->numel < 0)
        return cf_err_set(err, CF_EINVAL, "%s: numel must be >= 0, got %lld", name,
                          (long long)a->numel);
    if (a->op == CF_SHM_ALL_TO_ALL)
        return cf_shm_check_all_to_all(g, a, esz, err);
    if (a->counts != NULL)
        return cf_err_set(err, CF_EINVAL, "%s takes no counts", name);
    if ((uint64_t)a->numel > (uint64_t)SIZE_MAX ||
        cf_mul_size_overflows((size_t)a->numel, esz, &unit) ||
        cf_mul_size_overflows(unit, (size_t)g->world, &in_bytes) || in_bytes > (size_t)INT64_MAX)
        return cf_err_set(err, CF_EOVERFLOW, "%s: numel %lld is too large", name,
                          (long long)a->numel);
    if (a->plan != NULL) {
        cf_chunk_plan plan = {a->plan, (size_t)(a->n_plan > 0 ? a->n_plan : 0), g->world,
                              a->numel};
        size_t nat_esz = a->op == CF_SHM_REDUCE_SCATTER ? cf_dtype_size(a->natural_dtype) : esz;
        size_t nat_bytes, other_bytes;
        const void *nat = a->op == CF_SHM_REDUCE_SCATTER ? a->src : a->dst;
        const void *other = a->op == CF_SHM_REDUCE_SCATTER ? a->dst : a->src;
        if (a->op != CF_SHM_ALL_GATHER && a->op != CF_SHM_REDUCE_SCATTER)
            return cf_err_set(err, CF_EINVAL,
                              "%s: a chunk plan is for all_gather and reduce_scatter only", name);
        if (nat_esz == 0)
            return cf_err_set(err, CF_EINVAL, "%s: unknown natural dtype code %d", name,
                              a->natural_dtype);
        if (a->n_plan < 0 || a->natural_numel < 0)
            return cf_err_set(err, CF_EINVAL,
                              "%s: plan length and natural numel must be >= 0", name);
        if ((uint64_t)a->natural_numel > (uint64_t)SIZE_MAX ||
            cf_mul_size_overflows((size_t)a->natural_numel, nat_esz, &nat_bytes))
            return cf_err_set(err, CF_EOVERFLOW, "%s: natural numel %lld is too large", name,
                              (long long)a->natural_numel);
        if ((a->natural_numel > 0 && nat == NULL) || (a->numel > 0 && other == NULL))
            return cf_err_set(err, CF_EINVAL, "%s: NULL address", name);
        CF_CHECK(cf_chunk_plan_check(&plan, a->natural_numel, err));
        if (a->root != 0 || !isfinite(a->scale) ||
            (a->op == CF_SHM_ALL_GATHER && a->scale != 1.0))
            return cf_err_set(err, CF_EINVAL, "%s takes no root and a finite scale (1 for "
                              "all_gather)", name);
        if (a->op == CF_SHM_REDUCE_SCATTER && !(isfinite(a->divisor) && a->divisor != 0.0))
            return cf_err_set(err, CF_EINVAL, "reduce_scatter: divisor must be finite and "
                              "non-zero, got %g", a->divisor);
        other_bytes = unit; /* AG: the shard; RS: the reduced chunk */
        if (cf_shm_overlap(nat, nat_bytes, other, other_bytes))
            return cf_err_set(err, CF_EINVAL, "%s: the natural buffer and the %s overlap",
                              name, a->op == CF_SHM_ALL_GATHER ? "shard" : "output");
        return CF_OK;
    }
    switch (a->op) {
    case CF_SHM_ALL_GATHER: in_bytes = unit; out_bytes = unit * (size_t)g->world; break;
    case CF_SHM_REDUCE_SCATTER: in_bytes = unit * (size_t)g->world; out_bytes = unit; break;
    case CF_SHM_ALL_REDUCE: in_bytes = out_bytes = unit; break;
    default: in_bytes = 0; out_bytes = unit; break; /* broadcast: one buffer, dst */
    }
    if (a->numel > 0 && (a->dst == NULL || (in_bytes > 0 && a->src == NULL)))
        return cf_err_set(err, CF_EINVAL, "%s: NULL address with numel %lld", name,
                          (long long)a->numel);
    if (a->op == CF_SHM_BROADCAST) {
        if (a->src != NULL)
            return cf_err_set(err, CF_EINVAL, "broadcast takes one buffer (dst); src must be NULL");
        if (a->root < 0 || a->root >= g->world)
            return cf_err_set(err, CF_EINVAL, "broadcast: root %lld is not a rank of %d",
                              (long long)a->root, g->world);
    } else if (a->root != 0) {
        return cf_err_set(err, CF_EINVAL, "%s takes no root (must be 0), got %lld", name,
                          (long long)a->root);
    }
    if (!isfinite(a->scale) ||
        (a->scale != 1.0 && a->op != CF_SHM_REDUCE_SCATTER && a->op != CF_SHM_ALL_REDUCE))
        return cf_err_set(err, CF_EINVAL,
                          "%s: scale must be finite (and 1 for all_gather / broadcast), got %g",
                          name, a->scale);
    if (cf_shm_overlap(a->dst, out_bytes, a->src, in_bytes)) {
        bool ok = (a->op == CF_SHM_ALL_GATHER &&
                   (const unsigned char *)a->src ==
                       (const unsigned char *)a->dst + (size_t)g->rank * unit) ||
                  (a->op == CF_SHM_ALL_REDUCE && a->src == a->dst);
        if (!ok)
            return cf_err_set(err, CF_EINVAL,
                              "%s: input and output overlap (allowed only as all_gather's "
                              "input being this rank's block of the output, or an in-place "
                              "all_reduce)",
                              name);
    }
    return CF_OK;
}

cf_status cf_shm_run(cf_shm_group *g, const cf_shm_args *a, cf_err *err)
{
    cf_status st;
    g->seq++;
    st = cf_shm_check_failed(g, a, err);
    if (st == CF_OK) {
        switch (a->op) {
        case CF_SHM_ALL_GATHER: st = cf_shm_all_gather(g, a, err); break;
        case CF_SHM_REDUCE_SCATTER: st = cf_shm_reduce_scatter(g, a, err); break;
        case CF_SHM_ALL_REDUCE: st = cf_shm_all_reduce(g, a, err); break;
        case CF_SHM_BROADCAST: st = cf_shm_broadcast(g, a, err); break;
        case CF_SHM_ALL_TO_ALL: st = cf_shm_all_to_all(g, a, err); break;
        default:
            st = cf_err_set(err, CF_EINVAL, "unknown collective code %d", a->op);
            break;
        }
    }
    if (st != CF_OK)
        cf_shm_publish_failure(g, err);
    return st;
}

cf_status cf_shm_run_queued(void *ctx, const void *data, cf_err *err)
{
    return cf_shm_run(ctx, data, err);
}
