/*
 * shm.h -- intra-node collectives over POSIX shared memory (kernel twins:
 * cfsdp/_ref/shm.py; transport twin: the process group itself, see
 * cfsdp/_runtime/comm.py).
 *
 * A *group* is one rank's view of a segment shared by the `world_size` ranks
 * of a process group that live on one host.  Rank 0 creates the segment
 * (cf_shm_group_open with create), the others attach to it by name (the last
 * to attach unlinks the name at once, so nothing is left in /dev/shm), every
 * rank waits until all are attached (cf_shm_group_wait_attached, which also
 * unlinks the name if it is still there), and then every rank runs
 * the same collectives in the same order (cf_shm_run).  One process may open
 * the same segment several times as different ranks (each open is its own
 * mapping and its own cf_shm_group); the unit tests drive a collective that
 * way, one thread per rank.
 *
 * cf_shm_run is blocking and not re-entrant per group: one thread at a time
 * per cf_shm_group (queue.c runs them on the group's worker thread).
 *
 * Each open view also runs a *keeper* thread that holds the rank's liveness
 * lock (a robust mutex in the segment) until cf_shm_group_close, so a rank
 * that waits for a peer learns within CF_SHM_PROBE_S (0.1 s) that the peer's
 * process died or that it closed its view, whatever the timeout (shm.c,
 * Liveness).
 */
#ifndef CF_SHM_H
#define CF_SHM_H

#include <stdbool.h>

#include "cfsdp.h"
#include "chunk.h"

/* Collectives; must match cfsdp._runtime.comm's op codes (_C.SHM_OP_*). */
typedef enum {
    CF_SHM_ALL_GATHER = 0,
    CF_SHM_REDUCE_SCATTER = 1,
    CF_SHM_ALL_REDUCE = 2,
    CF_SHM_BROADCAST = 3,
    CF_SHM_ALL_TO_ALL = 4,
    CF_SHM_OP_COUNT = 5
} cf_shm_op;

/* The most ranks one segment serves. */
#define CF_SHM_MAX_WORLD 256
/* The smallest data slot half (bytes per rank per buffer) per rank of the group. */
#define CF_SHM_MIN_SLOT_PER_RANK 128
/* The largest data slot half: a segment is at most 2 x CF_SHM_MAX_WORLD x this. */
#define CF_SHM_MAX_SLOT_BYTES ((int64_t)1 << 30)

/* Name of an op code ("all_gather", ...), "?" for an unknown one. */
const char *cf_shm_op_name(int op);

/*
 * The reduction kernel: dst[i] = round(scale * (srcs[0][i] + srcs[1][i] + ...
 * + srcs[nsrc-1][i])), summed left to right in float (double for fp64), the
 * scale multiplied in that type ((float)scale for float; skipped when scale
 * == 1), then rounded once to `dtype` (bf16/fp16: round to nearest even, as
 * torch).  dst may be one of the sources exactly (in place); no other
 * overlap.  Unchecked: valid dtype, nsrc >= 1, non-NULL addresses when n > 0.
 * Needs no GIL; single-threaded.
 */
void cf_shm_reduce_run(void *dst, const void *const *srcs, int nsrc, size_t n, int dtype,
                       double scale);

/*
 * Checked and threaded cf_shm_reduce_run: CF_EINVAL for an unknown dtype,
 * nsrc outside [1, CF_SHM_MAX_WORLD], numel < 0 or a NULL address with numel
 * > 0; CF_EOVERFLOW if the byte size does not fit.  Buffers may be at any
 * address (alignment-safe loads, cfsdp.h).  Splits the loop over up
 * to cf_num_threads(max_threads) threads above CF_CHUNK_PARALLEL_BYTES moved.
 */
cf_status cf_shm_reduce(void *dst, const void *const *srcs, int64_t nsrc, int64_t numel,
                        int dtype, double scale, int64_t max_threads, cf_err *err);

/*
 * memcpy of nbytes (no overlap), split over up to cf_num_threads(max_threads)
 * threads above CF_CHUNK_PARALLEL_BYTES.  CF_EINVAL for nbytes < 0 or a NULL
 * address with nbytes > 0.  (Used by the collectives and, through the
 * module, by the benchmark as this machine's memcpy bandwidth.)
 */
cf_status cf_shm_memcpy(void *dst, const void *src, int64_t nbytes, int64_t max_threads,
                        cf_err *err);

typedef struct cf_shm_group cf_shm_group;

/* Where shm_open puts a name "/x" (glibc): CF_SHM_DIR "/x". */
#define CF_SHM_DIR "/dev/shm"

/*
 * Whether the open file `fd` may be mapped: fstat shows a regular file owned
 * by this process's effective uid with no group or other permission bits
 * (mode & 077 == 0).  Anything else is CF_EPERM with a message naming `path`
 * (the file's name, for the message only), its type, owner (uid and user
 * name, if the user database has one) and mode, and what to do: someone who
 * is not this job forged it (see the trust paragraph of shm.c).  CF_ERUNTIME
 * if fstat fails.  Twin: cfsdp._ref.shm._check_fd (the same message).  Every
 * mapping of cfsdp checks this before mmap (cf_shm_map_file, which every
 * segment of cfsdp goes through).  Needs no GIL.
 */
cf_status cf_shm_check_fd(int fd, const char *path, cf_err *err);

/*
 * The host-shared segment facility: map the file `path` (a name in a tmpfs
 * such as CF_SHM_DIR, or any directory) MAP_SHARED read-write, `bytes` long,
 * into *out (munmap(*out, bytes) to release it).  create: open it with
 * O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600, size it and reserve its pages
 * (posix_fallocate: a full tmpfs is an error here, not a SIGBUS later); the
 * file is unlinked again if anything after its creation fails.  Else attach:
 * open it with O_NOFOLLOW (never creating it) and require exactly `bytes`.
 * Either way the open file must pass cf_shm_check_fd before it is sized or
 * mapped (CF_EPERM naming its path, type, owner and mode; a symbolic link is
 * refused so too, naming the link's owner and mode), and the mapping is made
 * through that descriptor, never by name again.  Errors: CF_EINVAL for
 * bytes == 0 or a size that does not match, CF_EPERM for a file that is not
 * this job's, CF_ERUNTIME for a failing system call (strerror, errno).  Used
 * by cf_shm_group_open and by cfsdp._C.ShmSegment (ZeRO's shared bucket).
 * Twin: cfsdp._ref.ShmSegment.  Needs no GIL.
 */
cf_status cf_shm_map_file(const char *path, bool create, size_t bytes, void **out, cf_err *err);

/* Bytes of a segment for `world_size` ranks with data slots of `slot_bytes`
 * per half buffer (each rank has two halves); 0 if it overflows. */
size_t cf_shm_segment_bytes(int64_t world_size, int64_t slot_bytes);

/*
 * Open one rank's view of a segment.  create: shm_open(name, O_CREAT|O_EXCL,
 * 0600), size it and write its header (rank must then be 0); else attach to an
 * existing segment.  Either way the name is opened with O_NOFOLLOW and the file
 * must pass cf_shm_check_fd before it is sized or mapped (CF_EPERM naming its
 * path, type, owner and mode: a symbolic link is refused so too), and an
 * attached segment's header is checked (world size and slot size must
 * match; slot_bytes is a multiple of 64 in [CF_SHM_MIN_SLOT_PER_RANK x
 * world_size, CF_SHM_MAX_SLOT_BYTES]).  `name` is a POSIX shm name
 * ("/cfsdp-..."); `label` names the
 * group in every error message; `global_ranks` (world_size entries, may be
 * NULL) names the ranks in messages.  Every wait of this group is bounded by
 * timeout_s seconds.  Errors: CF_EINVAL for bad arguments or a header that
 * does not match, CF_EPERM for a file that is not this job's, CF_ERUNTIME
 * for a failing system call (message with strerror), CF_ENOMEM.  On success
 * *out is a new group (cf_shm_group_close) whose keeper thread holds this
 * rank's liveness lock; the view that brings the attach count to world_size
 * unlinks the name.  Needs no GIL.
 */
cf_status cf_shm_group_open(const char *name, bool create, int64_t world_size, int64_t rank,
                            int64_t slot_bytes, double timeout_s, const char *label,
                            const int64_t *global_ranks, cf_shm_group **out, cf_err *err);

/*
 * Wait until every rank has attached (bounded by the timeout), then unlink
 * the name (the creator; any rank on failure, ENOENT ignored), so the
 * segment disappears from /dev/shm and lives only in the mappings.
 * CF_ERUNTIME on a timeout (naming how many ranks attached).  Needs no GIL.
 */
cf_status cf_shm_group_wait_attached(cf_shm_group *g, cf_err *err);

/* Make the current and every later wait of this group fail at once with
 * "group closed" (thread-safe; for shutting down a worker). */
void cf_shm_group_abort(cf_shm_group *g);

/*
 * Fail this rank on the segment from outside a collective: record `msg` as
 * this rank's failure (the group's first failure wins, as for a failed op)
 * and wake every sleeper, so every other rank's current or next collective
 * fails at once naming this rank and its message, and every later collective
 * of this view fails too.  For a caller that drives the segment as one part
 * of a larger collective (comm.py's two-level collectives) and failed in
 * another part: without it the peers would wait out their timeout.  The
 * caller guarantees that no collective of this view runs meanwhile (the
 * binding drains the view's queue first).  Needs no GIL.
 */
void cf_shm_group_fail(cf_shm_group *g, const char *msg);

/*
 * Block up to timeout_s seconds (0: just look) until the segment records a
 * failure of any rank (header.failed); then copy "rank R (global rank G) of
 * cfsdp shm group '<label>' failed: <its message>" into msg (n bytes, NUL
 * terminated) and return true.  False on timeout or once the view is aborted
 * (cf_shm_group_abort).  For a caller that waits on something else than the
 * segment meanwhile (comm.py's two-level lane, waiting on the process group)
 * and must learn at once that this host's segment failed.  Thread-safe
 * against the view's collectives; needs no GIL.
 */
bool cf_shm_group_wait_failure(cf_shm_group *g, double timeout_s, char *msg, size_t n);

/* Unmap and free (unlinks the name first if still linked).  In the process
 * that opened the view, first stops its keeper thread, which marks the rank's
 * view closed and releases its liveness lock (see shm.c, Liveness).  NULL is
 * a no-op. */
void cf_shm_group_close(cf_shm_group *g);

int64_t cf_shm_group_rank(const cf_shm_group *g);
int64_t cf_shm_group_world_size(const cf_shm_group *g);
size_t cf_shm_group_bytes(const cf_shm_group *g);

/* One collective's arguments (numel semantics per op; see cf_shm_check). */
typedef struct {
    int op;              /* cf_shm_op */
    void *dst;           /* output (broadcast: the buffer, read on root) */
    const void *src;     /* input (broadcast: unused, NULL) */
    int64_t numel;       /* AG: per-rank input; RS: per-rank output; AR, BC: buffer;
                          * A2A: the sum of counts (every element moved) */
    int dtype;           /* cf_dtype */
    double scale;        /* RS, AR: result multiplier (1.0: plain sum) */
    int64_t root;        /* BC: source rank in the group */
    int64_t max_threads; /* thread cap for copies and sums */
    /* Optional (NULL: a plain collective): a unit's chunk plan (csrc/chunk.h;
     * its world_size is the group's, its shard_numel is numel) that fuses
     * FSDP2's copies into the collective, so the rank-major buffer is never
     * built.  AG: dst is the unit's natural buffer (natural_numel elements) and
     * each rank's block is copied into it as cf_chunk_unpack would copy it.
     * RS: src is the natural gradient (natural_numel elements of
     * natural_dtype), packed piece by piece straight into the slots as
     * cf_chunk_pack would pack it (cast to dtype after dividing by divisor).
     * The caller keeps the array alive until the op is done. */
    const cf_chunk_param *plan;
    int64_t n_plan;
    int64_t natural_numel;
    int natural_dtype; /* RS with a plan */
    double divisor;    /* RS with a plan: the pre-divide (1: none) */
    /* A2A only: world_size x world_size element counts, sender-major (counts[s *
     * world_size + r]: what rank s sends rank r), the same on every rank.  src
     * holds this rank's blocks for ranks 0, 1, ... back to back (row `rank`), dst
     * receives rank 0's block for this rank, then rank 1's, ... (column `rank`).
     * The caller keeps the array alive until the op is done. */
    const int64_t *counts;
} cf_shm_args;

/*
 * Validate a collective locally, before it is queued: known op and dtype,
 * (all_to_all) a counts matrix of non-negative entries whose sums fit and
 * whose total is numel, no plan, root 0 and scale 1,
 * numel >= 0 and its byte sizes fit, non-NULL buffers when numel > 0 (at
 * any address: the sums and casts use alignment-safe loads), root in range,
 * finite scale, a plan within the bounds of cfsdp.h, and buffers that do not
 * overlap -- except the
 * overlaps FSDP uses: all_gather's src may be dst's own rank block exactly,
 * all_reduce's src may be dst exactly.  CF_EINVAL / CF_EOVERFLOW.
 */
cf_status cf_shm_check(const cf_shm_group *g, const cf_shm_args *a, cf_err *err);

/*
 * Run one collective (validated by cf_shm_check) to completion, in pieces
 * of at most one slot half, double-buffered.  Every rank must run the same
 * sequence of collectives; a rank that sees a different op, dtype, numel or
 * root fails with CF_ERUNTIME naming the rank.  A wait longer than the
 * timeout fails with CF_ERUNTIME naming the op and the ranks that did not
 * arrive; a wait on a peer whose process died, or that closed its view, fails
 * within about 0.1 s naming that peer, its global rank and the host; any
 * failure is published in the segment, so every other rank's current or next
 * wait fails at once naming this rank and its message.
 * Needs no GIL; one thread at a time per group.
 */
cf_status cf_shm_run(cf_shm_group *g, const cf_shm_args *a, cf_err *err);

/* cf_shm_run as a cf_queue_fn: ctx is the group, data a cf_shm_args. */
cf_status cf_shm_run_queued(void *ctx, const void *data, cf_err *err);

#endif /* CF_SHM_H */
