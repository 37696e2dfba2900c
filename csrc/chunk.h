/*
 * chunk.h -- FSDP2 copy-in / copy-out between a unit's natural buffer and
 * its rank-major all-gather buffer (twin: cfsdp/_ref/chunk.py).
 */
#ifndef CF_CHUNK_H
#define CF_CHUNK_H

#include <stdbool.h>

#include "cfsdp.h"

/* Above this many bytes moved (read + written, counted over the gathered
 * buffer) a call splits its loop across threads (see thread.h); below it,
 * thread start-up would cost more than it saves. */
#define CF_CHUNK_PARALLEL_BYTES ((int64_t)4 << 20)

/* One parameter of a unit (see chunk.c for the layout).  Sharded on dim d of
 * shape (s_0, ..., s_n): outer = s_0 * ... * s_{d-1} (1 for dim 0), rows = s_d,
 * inner = s_{d+1} * ... * s_n, c = ceil(rows / world_size). */
typedef struct {
    int64_t nat_off;     /* first element of the parameter in the natural buffer */
    int64_t numel;       /* elements of the parameter: outer * rows * inner */
    int64_t chunk_numel; /* one rank's padded chunk: outer * c * inner */
    int64_t shard_off;   /* where the chunk starts in each rank's shard */
    int64_t outer;       /* blocks of a chunk: 1 (dim 0), or outer for an even dim d > 0 */
} cf_chunk_param;

/* A unit's plan: its parameters in order, the world size and the per-rank
 * shard numel. */
typedef struct {
    const cf_chunk_param *params;
    size_t n_params;
    int64_t world_size;
    int64_t shard_numel;
} cf_chunk_plan;

/*
 * Copy-out after the all-gather: write every parameter's elements from the
 * gathered buffer (`gathered_numel` == world_size * shard_numel elements) to
 * its segment of the natural buffer, bytes exactly (`elem_size` bytes per
 * element, both buffers).  Chunk padding is not read; natural elements
 * outside every parameter's segment are not written.
 *
 * Errors, all found before any byte is written: CF_EINVAL for a plan that
 * cf_chunk_pack would also reject (see chunk.c: message names the parameter
 * index; world_size and the plan's length within the bounds of cfsdp.h),
 * elem_size < 1, a buffer numel that does not match, a negative
 * numel or a NULL address with numel > 0; CF_EOVERFLOW if a byte size does
 * not fit.  Uses up to cf_num_threads(max_threads) threads above
 * CF_CHUNK_PARALLEL_BYTES.  The buffers must not overlap.  Needs no GIL.
 */
cf_status cf_chunk_unpack(void *natural, int64_t natural_numel, const void *gathered,
                          int64_t gathered_numel, int64_t elem_size, const cf_chunk_plan *plan,
                          int64_t max_threads, cf_err *err);

/*
 * Copy-in before the all-gather or reduce-scatter: write ranks
 * [rank_lo, rank_hi) of the gathered buffer (`gathered_numel` ==
 * (rank_hi - rank_lo) * shard_numel elements; rank k at (k - rank_lo) *
 * shard_numel) from the natural buffer, each element as
 * cast(src / divisor) with the rounding of cf_reduce_scale_cast_add (no
 * divide when divisor == 1; a plain byte copy when the dtypes are equal too).
 * Every other element of the gathered buffer (chunk padding, gaps between
 * chunks, the tail of a shard) is set to zero.  Dtypes are cf_dtype codes.
 *
 * Errors, all found before any byte is written: as cf_chunk_unpack, plus an
 * unknown dtype code and 0 <= rank_lo <= rank_hi <= world_size not holding.
 * Buffers may be at any address (the casts load and store alignment-safe).
 * Threads as cf_chunk_unpack.  The buffers must not overlap.  Needs no GIL.
 */
cf_status cf_chunk_pack(void *gathered, int64_t gathered_numel, int gathered_dtype,
                        const void *natural, int64_t natural_numel, int natural_dtype,
                        const cf_chunk_plan *plan, int64_t rank_lo, int64_t rank_hi,
                        double divisor, int64_t max_threads, cf_err *err);

/*
 * Validate a plan on its own (world_size and n_params within the bounds of
 * cfsdp.h, shard_numel >= 0, every
 * parameter as cf_chunk_unpack checks it against a natural buffer of
 * natural_numel elements).  For callers that copy pieces of a plan's
 * gathered buffer themselves (the shared-memory all-gather's copy-out).
 */
cf_status cf_chunk_plan_check(const cf_chunk_plan *plan, int64_t natural_numel, cf_err *err);

/*
 * Copy-out of one piece, without checks (the caller validated the plan with
 * cf_chunk_plan_check against the natural buffer): elements [a, b) of the
 * whole rank-major buffer (all world_size ranks, rank k at k * shard_numel),
 * read from `from` (element a at from[0], elem_size bytes each), go to their
 * places in `natural` as cf_chunk_unpack puts them (padding is not read).
 * Single-threaded.  Needs no GIL.
 */
void cf_chunk_unpack_piece(void *natural, const void *from, size_t elem_size,
                           const cf_chunk_plan *plan, int64_t a, int64_t b);

/*
 * Copy-in of one piece, without checks (the caller validated the plan with
 * cf_chunk_plan_check against the natural buffer, and the dtype codes):
 * elements [a, b) of the whole rank-major buffer (all world_size ranks,
 * rank k at k * shard_numel) go to `out` (b - a elements), each as
 * cf_chunk_pack writes it (cast(src / divisor), padding and gaps zero).
 * Single-threaded.  Needs no GIL.
 */
void cf_chunk_pack_piece(void *out, int out_dtype, const void *natural, int natural_dtype,
                         const cf_chunk_plan *plan, int64_t a, int64_t b, double divisor);

#endif /* CF_CHUNK_H */
