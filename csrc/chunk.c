/*
 * chunk.c -- FSDP2 (fully_shard) copy-in and copy-out, one pass each
 * (twin: cfsdp/_ref/chunk.py).
 *
 * Design.  In FSDP2 a parameter sharded on dim 0, of shape (d0, *rest), is
 * split as torch.chunk(p, W): chunk rows c = ceil(d0 / W), rank k holds rows
 * [k*c, min((k+1)*c, d0)), possibly none.  With r elements per row, the
 * parameter's elements [k*c*r, min((k+1)*c*r, numel)) go to rank k, padded
 * with zeros to chunk_numel = c*r.  A rank's shard (shard_numel elements)
 * holds one padded chunk per parameter at shard_off; the all-gather output
 * is rank-major: element j of rank k's chunk of p is G[k*S + shard_off + j].
 * The natural buffer holds the whole parameters, p at nat_off.
 *
 * Sharded on dim d > 0 (Shard(d); torch requires an even split there: the
 * size s_d of dim d is W*c), rank k's chunk is torch.chunk(p, W, dim=d)[k]
 * made contiguous: `outer` = s_0 * ... * s_{d-1} blocks of blk = c * inner
 * elements (inner = s_{d+1} * ... * s_n), block o being natural elements
 * [nat_off + o*row + k*blk, + blk) (row = s_d * inner = numel / outer) and
 * chunk elements [o*blk, (o+1)*blk).  So chunk_numel = outer * blk and
 * numel = W * chunk_numel.  Dim 0 is outer = 1: one block, the chunk itself
 * (and only then may the last chunks be short or empty).
 *
 * Plan invariants (checked by cf_chunk_check, in this order, each error
 * naming the parameter index; the twin raises the same messages):
 *   1 <= world_size <= CF_MAX_WORLD_SIZE, n_params * world_size <=
 *   CF_MAX_PIECES (cfsdp.h), shard_numel >= 0; the first four numbers of
 *   every parameter are >= 0 and outer >= 1; numel <= world_size *
 *   chunk_numel (every element has a rank); outer > 1 only with numel ==
 *   world_size * chunk_numel and chunk_numel a multiple of outer (whole
 *   blocks, every rank a full chunk); [shard_off, shard_off + chunk_numel)
 *   lies in the shard and non-empty chunks come in order without overlap;
 *   [nat_off, nat_off + numel) lies in the natural buffer and non-empty
 *   parameters come in order without overlap (gaps are allowed in both
 *   buffers).  The blocks of a parameter tile its two segments, so every
 *   element is written by at most one (rank, parameter, block) piece, which
 *   is what lets the loops below split freely.
 *
 * Loops.  Both directions walk the gathered buffer: a range [a, b) of it
 * is handled by visiting its ranks, and in each rank its parameters in
 * order, clipping every piece to [a, b) (and, for outer > 1, visiting only
 * the blocks that meet [a, b): at most one visit per element moved beyond
 * the (rank, parameter) pairs, which CF_MAX_PIECES bounds).  So the work
 * splits across threads by plain index ranges of the gathered buffer
 * (cf_parallel_for), with no two threads writing the same element.  Pack
 * writes every element of its range (data, or zero for padding and gaps:
 * one sweep with a cursor, as in copy.c); unpack reads data pieces only.
 * Casts reuse reduce.c's loops, so pack rounds exactly as scale_cast_add
 * without accumulate.  Dim 0 (outer == 1) takes one copy per (rank,
 * parameter), as it always did.
 * Workload: once per unit per all-gather (unpack) and per reduce-scatter
 * (pack); memory-bound.  With outer > 1 a copy moves blk elements at a time.
 */
#include <string.h>

#include "chunk.h"
#include "reduce.h"
#include "thread.h"

/* Elements of parameter `p` held by rank k (0 <= k < world_size). */
static int64_t cf_chunk_len(const cf_chunk_param *p, int64_t k)
{
    int64_t full;
    if (p->chunk_numel == 0)
        return 0;
    full = p->numel / p->chunk_numel; /* ranks holding a whole chunk */
    if (k < full)
        return p->chunk_numel;
    if (k == full)
        return p->numel - full * p->chunk_numel;
    return 0;
}

/* Parameter i's segment [off, off + len) of the `what` buffer must end by
 * `limit` and, if non-empty, start at or after *prev_end, the end of the
 * previous non-empty segment (then it becomes *prev_end). */
static cf_status cf_chunk_check_segment(size_t i, const char *what, int64_t off, int64_t len,
                                        int64_t limit, int64_t *prev_end, cf_err *err)
{
    int64_t end;
    if (cf_add_i64_overflows(off, len, &end) || end > limit)
        return cf_err_set(err, CF_EINVAL,
                          "plan param %zu: %s segment of %lld elements at %lld passes the "
                          "end %lld",
                          i, what, (long long)len, (long long)off, (long long)limit);
    if (len > 0) {
        if (off < *prev_end)
            return cf_err_set(err, CF_EINVAL,
                              "plan param %zu: %s segment at %lld overlaps the previous one "
                              "(ends at %lld); segments must be in parameter order",
                              i, what, (long long)off, (long long)*prev_end);
        *prev_end = end;
    }
    return CF_OK;
}

/* Check every parameter of the plan against the natural buffer size. */
static cf_status cf_chunk_check_params(const cf_chunk_plan *plan, int64_t natural_numel,
                                       cf_err *err)
{
    int64_t shard_end = 0, nat_end = 0, cover;
    for (size_t i = 0; i < plan->n_params; i++) {
        const cf_chunk_param *p = &plan->params[i];
        bool cover_fits;
        if (p->nat_off < 0 || p->numel < 0 || p->chunk_numel < 0 || p->shard_off < 0)
            return cf_err_set(err, CF_EINVAL,
                              "plan param %zu: nat_off, numel, chunk_numel and shard_off "
                              "must be >= 0, got (%lld, %lld, %lld, %lld)",
                              i, (long long)p->nat_off, (long long)p->numel,
                              (long long)p->chunk_numel, (long long)p->shard_off);
        if (p->outer < 1)
            return cf_err_set(err, CF_EINVAL, "plan param %zu: outer must be >= 1, got %lld", i,
                              (long long)p->outer);
        /* an overflowing product is more than any numel */
        cover_fits = !cf_mul_i64_overflows(plan->world_size, p->chunk_numel, &cover);
        if (cover_fits && cover < p->numel)
            return cf_err_set(err, CF_EINVAL,
                              "plan param %zu: numel %lld does not fit in %lld chunks of "
                              "%lld elements",
                              i, (long long)p->numel, (long long)plan->world_size,
                              (long long)p->chunk_numel);
        if (p->outer > 1 && (!cover_fits || cover != p->numel || p->chunk_numel % p->outer != 0))
            return cf_err_set(err, CF_EINVAL,
                              "plan param %zu: a chunk of %lld blocks (outer) needs numel == "
                              "world_size x chunk_numel and chunk_numel a multiple of outer, "
                              "got numel %lld, world_size %lld, chunk_numel %lld",
                              i, (long long)p->outer, (long long)p->numel,
                              (long long)plan->world_size, (long long)p->chunk_numel);
        CF_CHECK(cf_chunk_check_segment(i, "shard", p->shard_off, p->chunk_numel,
                                        plan->shard_numel, &shard_end, err));
        CF_CHECK(cf_chunk_check_segment(i, "natural", p->nat_off, p->numel, natural_numel,
                                        &nat_end, err));
    }
    return CF_OK;
}

/* The plan's world size and shard numel; at most CF_MAX_PIECES pieces (cfsdp.h), so a
 * call visits a bounded number of (rank, parameter) pairs. */
static cf_status cf_chunk_check_dims(const cf_chunk_plan *plan, cf_err *err)
{
    if (plan->world_size < 1)
        return cf_err_set(err, CF_EINVAL, "world_size must be >= 1, got %lld",
                          (long long)plan->world_size);
    if (plan->world_size > CF_MAX_WORLD_SIZE)
        return cf_err_set(err, CF_EINVAL, "world_size must be <= %d, got %lld",
                          CF_MAX_WORLD_SIZE, (long long)plan->world_size);
    if (plan->n_params > (size_t)(CF_MAX_PIECES / plan->world_size))
        return cf_err_set(err, CF_EINVAL,
                          "a plan of %zu parameters over %lld ranks has more than %lld "
                          "(rank, parameter) pieces; wrap the model into smaller units",
                          plan->n_params, (long long)plan->world_size,
                          (long long)CF_MAX_PIECES);
    if (plan->shard_numel < 0)
        return cf_err_set(err, CF_EINVAL, "shard_numel must be >= 0, got %lld",
                          (long long)plan->shard_numel);
    return CF_OK;
}

cf_status cf_chunk_plan_check(const cf_chunk_plan *plan, int64_t natural_numel, cf_err *err)
{
    CF_CHECK(cf_chunk_check_dims(plan, err));
    return cf_chunk_check_params(plan, natural_numel, err);
}

/* Check a buffer: numel >= 0, non-NULL if non-empty, bytes fit size_t (any address:
 * the casts are reduce.c's alignment-safe loops). */
static cf_status cf_chunk_check_buffer(const char *what, const void *addr, int64_t numel,
                                       size_t esz, cf_err *err)
{
    size_t bytes;
    if (numel < 0)
        return cf_err_set(err, CF_EINVAL, "%s numel must be >= 0, got %lld", what,
                          (long long)numel);
    if (numel > 0 && addr == NULL)
        return cf_err_set(err, CF_EINVAL, "%s: NULL address with numel %lld", what,
                          (long long)numel);
    if ((uint64_t)numel > (uint64_t)SIZE_MAX ||
        cf_mul_size_overflows((size_t)numel, esz, &bytes))
        return cf_err_set(err, CF_EOVERFLOW, "%s numel %lld is too large", what,
                          (long long)numel);
    return CF_OK;
}

/* Validate a call: the plan, the rank range, both buffers. */
static cf_status cf_chunk_check(const cf_chunk_plan *plan, const void *natural,
                                int64_t natural_numel, size_t natural_esz, const void *gathered,
                                int64_t gathered_numel, size_t gathered_esz, int64_t rank_lo,
                                int64_t rank_hi, cf_err *err)
{
    int64_t expected;
    CF_CHECK(cf_chunk_check_dims(plan, err));
    if (rank_lo < 0 || rank_lo > rank_hi || rank_hi > plan->world_size)
        return cf_err_set(err, CF_EINVAL,
                          "ranks (%lld, %lld) must satisfy 0 <= lo <= hi <= world_size %lld",
                          (long long)rank_lo, (long long)rank_hi,
                          (long long)plan->world_size);
    CF_CHECK(cf_chunk_check_buffer("natural buffer", natural, natural_numel, natural_esz, err));
    CF_CHECK(cf_chunk_check_buffer("gathered buffer", gathered, gathered_numel, gathered_esz,
                                   err));
    if (cf_mul_i64_overflows(rank_hi - rank_lo, plan->shard_numel, &expected))
        return cf_err_set(err, CF_EOVERFLOW, "%lld ranks x shard_numel %lld overflows",
                          (long long)(rank_hi - rank_lo), (long long)plan->shard_numel);
    if (gathered_numel != expected)
        return cf_err_set(err, CF_EINVAL,
                          "gathered buffer has %lld elements, expected %lld (%lld ranks x "
                          "shard_numel %lld)",
                          (long long)gathered_numel, (long long)expected,
                          (long long)(rank_hi - rank_lo), (long long)plan->shard_numel);
    return cf_chunk_check_params(plan, natural_numel, err);
}

/* How many threads a call uses: above CF_CHUNK_PARALLEL_BYTES moved (read +
 * written, counted over the gathered buffer, padding included), as many as
 * cf_num_threads allows.  numel * bytes_per > T  <=>  numel > T / bytes_per. */
static int cf_chunk_threads(int64_t gathered_numel, size_t bytes_per, int64_t max_threads)
{
    return gathered_numel > CF_CHUNK_PARALLEL_BYTES / (int64_t)bytes_per
               ? cf_num_threads(max_threads)
               : 1;
}

/* The blocks [*lo, *hi) of a chunk at gathered element `start` (outer blocks of
 * blk >= 1 elements) that meet gathered elements [a, b); the caller knows the
 * chunk meets [a, b) (so start < b). */
static void cf_chunk_blocks_in(int64_t start, int64_t blk, int64_t outer, int64_t a, int64_t b,
                               int64_t *lo, int64_t *hi)
{
    *lo = a > start ? (a - start) / blk : 0;
    *hi = b - start >= outer * blk ? outer : (b - start - 1) / blk + 1; /* ceil, no overflow */
}

typedef struct {
    const cf_chunk_plan *plan;
    unsigned char *natural;
    const unsigned char *gathered;
    size_t esz;
    int64_t origin; /* the element index `gathered` points at (0: the whole buffer) */
} cf_chunk_unpack_ctx;

/* Natural elements from `nat` <- gathered elements [start, start + len) clipped
 * to [a, b). */
static void cf_chunk_unpack_copy(const cf_chunk_unpack_ctx *c, int64_t start, int64_t len,
                                 int64_t nat, int64_t a, int64_t b)
{
    int64_t s = start > a ? start : a, e = start + len < b ? start + len : b;
    if (e > s)
        memcpy(c->natural + (size_t)(nat + (s - start)) * c->esz,
               c->gathered + (size_t)(s - c->origin) * c->esz, (size_t)(e - s) * c->esz);
}

/* Unpack the data pieces inside gathered elements [a, b). */
static void cf_chunk_unpack_range(void *ctx_, int64_t a, int64_t b)
{
    const cf_chunk_unpack_ctx *c = ctx_;
    const cf_chunk_plan *plan = c->plan;
    const int64_t S = plan->shard_numel;

    for (int64_t k = S > 0 ? a / S : plan->world_size; k < plan->world_size && k * S < b; k++) {
        for (size_t i = 0; i < plan->n_params; i++) {
            const cf_chunk_param *p = &plan->params[i];
            int64_t len = cf_chunk_len(p, k), start = k * S + p->shard_off, lo, hi, blk, row;
            if (len == 0)
                continue;
            if (start >= b)
                break; /* chunks are in order */
            if (start + len <= a)
                continue;
            if (p->outer == 1) {
                cf_chunk_unpack_copy(c, start, len, p->nat_off + k * p->chunk_numel, a, b);
                continue;
            }
            blk = p->chunk_numel / p->outer;
            row = p->numel / p->outer;
            cf_chunk_blocks_in(start, blk, p->outer, a, b, &lo, &hi);
            for (int64_t o = lo; o < hi; o++)
                cf_chunk_unpack_copy(c, start + o * blk, blk, p->nat_off + o * row + k * blk, a,
                                     b);
        }
    }
}

cf_status cf_chunk_unpack(void *natural, int64_t natural_numel, const void *gathered,
                          int64_t gathered_numel, int64_t elem_size, const cf_chunk_plan *plan,
                          int64_t max_threads, cf_err *err)
{
    cf_chunk_unpack_ctx ctx;
    if (elem_size < 1)
        return cf_err_set(err, CF_EINVAL, "elem_size must be >= 1, got %lld",
                          (long long)elem_size);
    if ((uint64_t)elem_size > (uint64_t)SIZE_MAX)
        return cf_err_set(err, CF_EOVERFLOW, "elem_size %lld is too large",
                          (long long)elem_size);
    CF_CHECK(cf_chunk_check(plan, natural, natural_numel, (size_t)elem_size, gathered,
                            gathered_numel, (size_t)elem_size, 0, plan->world_size, err));
    ctx.plan = plan;
    ctx.natural = natural;
    ctx.gathered = gathered;
    ctx.esz = (size_t)elem_size;
    ctx.origin = 0;
    cf_parallel_for(gathered_numel, cf_chunk_threads(gathered_numel, 2 * ctx.esz, max_threads),
                    cf_chunk_unpack_range, &ctx);
    return CF_OK;
}

typedef struct {
    const cf_chunk_plan *plan;
    unsigned char *gathered;
    const unsigned char *natural;
    int gathered_dtype, natural_dtype;
    size_t gathered_esz, natural_esz;
    int64_t rank_lo, n_ranks;
    double divisor;
    bool bytes_only; /* same dtype, no divide: memcpy */
    int64_t origin;  /* the element index `gathered` points at (0: the whole buffer) */
} cf_chunk_pack_ctx;

/* Zero gathered elements [s, e) clipped to [a, b). */
static void cf_chunk_pack_zero(const cf_chunk_pack_ctx *c, int64_t s, int64_t e, int64_t a,
                               int64_t b)
{
    s = s > a ? s : a;
    e = e < b ? e : b;
    if (e > s)
        memset(c->gathered + (size_t)(s - c->origin) * c->gathered_esz, 0,
               (size_t)(e - s) * c->gathered_esz);
}

/* Gathered elements [start, start + len) <- natural [nat, nat + len),
 * clipped to [a, b). */
static void cf_chunk_pack_copy(const cf_chunk_pack_ctx *c, int64_t start, int64_t len,
                               int64_t nat, int64_t a, int64_t b)
{
    int64_t s = start > a ? start : a, e = start + len < b ? start + len : b;
    unsigned char *dst;
    const unsigned char *src;
    if (e <= s)
        return;
    dst = c->gathered + (size_t)(s - c->origin) * c->gathered_esz;
    src = c->natural + (size_t)(nat + (s - start)) * c->natural_esz;
    if (c->bytes_only)
        memcpy(dst, src, (size_t)(e - s) * c->gathered_esz);
    else
        cf_reduce_scale_cast_run(dst, c->gathered_dtype, src, c->natural_dtype, (size_t)(e - s),
                                 c->divisor, false);
}

/* Write gathered elements [a, b) (local to the rank range): data or zero. */
static void cf_chunk_pack_range(void *ctx_, int64_t a, int64_t b)
{
    const cf_chunk_pack_ctx *c = ctx_;
    const cf_chunk_plan *plan = c->plan;
    const int64_t S = plan->shard_numel;

    for (int64_t r = S > 0 ? a / S : c->n_ranks; r < c->n_ranks && r * S < b; r++) {
        int64_t base = r * S, cursor = base, k = c->rank_lo + r;
        for (size_t i = 0; i < plan->n_params; i++) {
            const cf_chunk_param *p = &plan->params[i];
            int64_t len = cf_chunk_len(p, k), start = base + p->shard_off;
            if (p->chunk_numel == 0)
                continue;
            if (start >= b)
                break; /* chunks are in order; the rest of [a, b) is a gap */
            cf_chunk_pack_zero(c, cursor, start, a, b);
            if (len > 0 && p->outer == 1) {
                cf_chunk_pack_copy(c, start, len, p->nat_off + k * p->chunk_numel, a, b);
            } else if (len > 0 && start + len > a) {
                int64_t blk = p->chunk_numel / p->outer, row = p->numel / p->outer, lo, hi;
                cf_chunk_blocks_in(start, blk, p->outer, a, b, &lo, &hi);
                for (int64_t o = lo; o < hi; o++)
                    cf_chunk_pack_copy(c, start + o * blk, blk, p->nat_off + o * row + k * blk,
                                       a, b);
            }
            cursor = start + len;
        }
        cf_chunk_pack_zero(c, cursor, base + S, a, b);
    }
}

/* The copy-in of ranks [rank_lo, rank_lo + n_ranks) into `gathered`, whose element 0
 * is element `origin` of the whole rank-major buffer. */
static void cf_chunk_pack_ctx_init(cf_chunk_pack_ctx *c, void *gathered, int gathered_dtype,
                                   const void *natural, int natural_dtype,
                                   const cf_chunk_plan *plan, int64_t rank_lo, int64_t n_ranks,
                                   double divisor, int64_t origin)
{
    c->plan = plan;
    c->gathered = gathered;
    c->natural = natural;
    c->gathered_dtype = gathered_dtype;
    c->natural_dtype = natural_dtype;
    c->gathered_esz = cf_dtype_size(gathered_dtype);
    c->natural_esz = cf_dtype_size(natural_dtype);
    c->rank_lo = rank_lo;
    c->n_ranks = n_ranks;
    c->divisor = divisor;
    c->bytes_only = gathered_dtype == natural_dtype && divisor == 1.0;
    c->origin = origin;
}

cf_status cf_chunk_pack(void *gathered, int64_t gathered_numel, int gathered_dtype,
                        const void *natural, int64_t natural_numel, int natural_dtype,
                        const cf_chunk_plan *plan, int64_t rank_lo, int64_t rank_hi,
                        double divisor, int64_t max_threads, cf_err *err)
{
    cf_chunk_pack_ctx ctx;
    size_t gesz = cf_dtype_size(gathered_dtype), nesz = cf_dtype_size(natural_dtype);
    if (gesz == 0 || nesz == 0)
        return cf_err_set(err, CF_EINVAL,
                          "unknown dtype code (gathered %d, natural %d); expected 0..%d",
                          gathered_dtype, natural_dtype, CF_DTYPE_COUNT - 1);
    CF_CHECK(cf_chunk_check(plan, natural, natural_numel, nesz, gathered, gathered_numel, gesz,
                            rank_lo, rank_hi, err));
    cf_chunk_pack_ctx_init(&ctx, gathered, gathered_dtype, natural, natural_dtype, plan, rank_lo,
                           rank_hi - rank_lo, divisor, 0);
    cf_parallel_for(gathered_numel, cf_chunk_threads(gathered_numel, gesz + nesz, max_threads),
                    cf_chunk_pack_range, &ctx);
    return CF_OK;
}

void cf_chunk_pack_piece(void *out, int out_dtype, const void *natural, int natural_dtype,
                         const cf_chunk_plan *plan, int64_t a, int64_t b, double divisor)
{
    cf_chunk_pack_ctx ctx;
    cf_chunk_pack_ctx_init(&ctx, out, out_dtype, natural, natural_dtype, plan, 0,
                           plan->world_size, divisor, a);
    cf_chunk_pack_range(&ctx, a, b);
}

void cf_chunk_unpack_piece(void *natural, const void *from, size_t elem_size,
                           const cf_chunk_plan *plan, int64_t a, int64_t b)
{
    cf_chunk_unpack_ctx ctx = {plan, natural, from, elem_size, a};
    cf_chunk_unpack_range(&ctx, a, b);
}
