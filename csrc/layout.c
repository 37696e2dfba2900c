/*
 * layout.c -- flat layout planner for one unit (twin: cfsdp/_ref/layout.py).
 *
 * Design.  A unit's parameters live back to back in one flat buffer, in
 * order, exactly as torch FSDP1 lays out a FlatParameter:
 *   - if align_numel > 0, padding is inserted before every parameter whose
 *     offset is not a multiple of align_numel, and the total is then padded
 *     to a multiple of world_size (torch does both for use_orig_params=True);
 *   - shard_numel = ceil(flat_numel / world_size) (torch.chunk's chunk size);
 *     rank r owns flat elements [r * shard_numel, (r + 1) * shard_numel),
 *     the part past flat_numel being zero padding.
 * The planner also emits, for every (rank, parameter) pair, the slice of the
 * parameter held by that rank, so the Python side never recomputes ranges.
 * Invariants of the output: offsets are non-decreasing and aligned (when
 * align_numel > 0); across ranks the slices of a parameter cover
 * [0, numel) exactly once; world_size * shard_numel >= flat_numel.
 * Workload: called once per unit at wrap time; O(world_size * n_params),
 * bounded by CF_MAX_WORLD_SIZE and CF_MAX_PIECES (cfsdp.h) before anything
 * is allocated.  All arithmetic is int64 with explicit overflow checks.
 */
#include "layout.h"

/* world_size in [1, CF_MAX_WORLD_SIZE] and at most CF_MAX_PIECES (rank, parameter)
 * pieces (the bounds of cfsdp.h). */
static cf_status cf_layout_check_dims(size_t n_params, int64_t world_size, cf_err *err)
{
    if (world_size < 1)
        return cf_err_set(err, CF_EINVAL, "world_size must be >= 1, got %lld",
                          (long long)world_size);
    if (world_size > CF_MAX_WORLD_SIZE)
        return cf_err_set(err, CF_EINVAL, "world_size must be <= %d, got %lld",
                          CF_MAX_WORLD_SIZE, (long long)world_size);
    if (n_params > (size_t)(CF_MAX_PIECES / world_size))
        return cf_err_set(err, CF_EINVAL,
                          "a layout of %zu parameters over %lld ranks has more than %lld "
                          "(rank, parameter) pieces; wrap the model into smaller units",
                          n_params, (long long)world_size, (long long)CF_MAX_PIECES);
    return CF_OK;
}

cf_status cf_layout_slices_len(size_t n_params, int64_t world_size, size_t *out_len,
                               cf_err *err)
{
    CF_CHECK(cf_layout_check_dims(n_params, world_size, err));
    *out_len = n_params * 3 * (size_t)world_size; /* <= 3 * CF_MAX_PIECES */
    return CF_OK;
}

/* Round `*total` up to a multiple of `m` (m > 0), checking for overflow. */
static cf_status cf_layout_round_up(int64_t *total, int64_t m, cf_err *err)
{
    int64_t rem = *total % m;
    if (rem != 0 && cf_add_i64_overflows(*total, m - rem, total))
        return cf_err_set(err, CF_EOVERFLOW, "flat numel overflows int64");
    return CF_OK;
}

cf_status cf_layout_plan(const int64_t *numels, size_t n_params, int64_t align_numel,
                         int64_t world_size, int64_t *offsets, int64_t *flat_numel,
                         int64_t *shard_numel, int64_t *slices, cf_err *err)
{
    int64_t total = 0, shard, padded;
    size_t i, k = 0;

    CF_CHECK(cf_layout_check_dims(n_params, world_size, err));
    if (align_numel < 0)
        return cf_err_set(err, CF_EINVAL, "align_numel must be >= 0, got %lld",
                          (long long)align_numel);

    for (i = 0; i < n_params; i++) {
        if (numels[i] < 0)
            return cf_err_set(err, CF_EINVAL, "numel must be >= 0, got %lld (parameter %zu)",
                              (long long)numels[i], i);
        if (align_numel > 0)
            CF_CHECK(cf_layout_round_up(&total, align_numel, err));
        offsets[i] = total;
        if (cf_add_i64_overflows(total, numels[i], &total))
            return cf_err_set(err, CF_EOVERFLOW, "flat numel overflows int64 at parameter %zu",
                              i);
    }
    if (align_numel > 0)
        CF_CHECK(cf_layout_round_up(&total, world_size, err));

    shard = total / world_size + (total % world_size != 0);
    if (cf_mul_i64_overflows(shard, world_size, &padded))
        return cf_err_set(err, CF_EOVERFLOW, "world_size * shard_numel overflows int64");
    *flat_numel = total;
    *shard_numel = shard;

    for (int64_t r = 0; r < world_size; r++) {
        int64_t lo = r * shard, hi = lo + shard; /* hi <= padded: no overflow */
        for (i = 0; i < n_params; i++) {
            int64_t off = offsets[i], end = off + numels[i];
            int64_t s = off > lo ? off : lo;
            int64_t e = end < hi ? end : hi;
            if (e > s) {
                slices[k] = s - off;
                slices[k + 1] = e - s;
                slices[k + 2] = s - lo;
            } else {
                slices[k] = slices[k + 1] = slices[k + 2] = 0;
            }
            k += 3;
        }
    }
    return CF_OK;
}
