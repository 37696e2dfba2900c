/*
 * layout.h -- the flat layout planner (twin: cfsdp/_ref/layout.py).
 */
#ifndef CF_LAYOUT_H
#define CF_LAYOUT_H

#include "cfsdp.h"

/*
 * Number of int64 entries of the `slices` array for `n_params` parameters
 * and `world_size` ranks (3 per rank and parameter).  Fails with CF_EINVAL
 * unless 1 <= world_size <= CF_MAX_WORLD_SIZE and n_params * world_size <=
 * CF_MAX_PIECES (cfsdp.h), so the count is at most 3 * CF_MAX_PIECES.
 */
cf_status cf_layout_slices_len(size_t n_params, int64_t world_size, size_t *out_len,
                               cf_err *err);

/*
 * Plan the flat layout of `n_params` parameters with element counts
 * `numels` (torch FSDP1's FlatParameter layout; see layout.c).
 *
 * Caller provides `offsets` (n_params entries) and `slices`
 * (cf_layout_slices_len entries); on success they hold the offset of each
 * parameter in the flat buffer and, rank-major then parameter-major, the
 * triples (param_start, numel, shard_offset) -- (0, 0, 0) where a parameter
 * has nothing in a rank's shard.  `*flat_numel` and `*shard_numel` receive
 * the padded flat size and the per-rank shard size.  Errors: CF_EINVAL for a
 * negative numel, align_numel < 0, or world_size and n_params outside the
 * bounds of cf_layout_slices_len; CF_EOVERFLOW if any
 * offset or world_size * shard_numel exceeds INT64_MAX.  On error the output
 * arrays are unspecified.  Pure function; needs no GIL.
 */
cf_status cf_layout_plan(const int64_t *numels, size_t n_params, int64_t align_numel,
                         int64_t world_size, int64_t *offsets, int64_t *flat_numel,
                         int64_t *shard_numel, int64_t *slices, cf_err *err);

#endif /* CF_LAYOUT_H */
