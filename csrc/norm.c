/*
 * norm.c -- the local statistic of a gradient p-norm in one pass
 * (twin: cfsdp/_ref/norm.py).
 *
 * Design.  clip_grad_norm_ needs, per rank, sum |g|^p over every local
 * gradient element (or max |g| for p = inf); the ranks then sum (max) their
 * partials and take the 1/p root.  One call reads one whole buffer (a unit's
 * sharded flat gradient, padding included: padding is zero and adds nothing).
 *
 * Precision.  Every element is widened exactly to double.  For the dtypes we
 * take (fp32, bf16, fp16) the term x*x is then exact in double (at most 48
 * significant bits) and |x| is exact for every dtype, so for p = 1 and 2 the
 * only rounding is the summation: with n terms in double the relative error
 * is below n * 2^-53, far below the fp32 rounding of the result that torch
 * returns (torch sums in fp32).  p = inf is exact.
 *
 * Order.  The sum uses CF_NORM_LANES independent accumulators (element i in
 * lane i % CF_NORM_LANES, each lane summed in increasing i, then the lanes
 * added in order), so the loop vectorises and the result is still a fixed
 * function of the input: the Python twin reproduces it bit for bit for
 * p = 1, 2 and inf (for other p only pow's last-ulp rounding may differ).
 * No FP contraction (-std=c11) and FLT_EVAL_METHOD == 0 keep each operation
 * a single IEEE rounding.
 * Workload: once per unit per optimizer step; memory-bound.
 */
#include <float.h>
#include <math.h>

#include "cf_half.h"
#include "norm.h"

#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "cfsdp needs FLT_EVAL_METHOD == 0 (float arithmetic in float)"
#endif

typedef double (*cf_norm_loop)(const void *src, size_t n, double p);

/* Widen one stored element to double (exact for every dtype). */
#define CF_NLD_FP32(x) ((double)(x))
#define CF_NLD_FP64(x) (x)
#define CF_NLD_BF16(x) ((double)cf_bf16_to_f32(x))
#define CF_NLD_FP16(x) ((double)cf_f16_to_f32(x))

/* The term |v|^p of a widened value v. */
#define CF_NTERM_P1(v) fabs(v)
#define CF_NTERM_P2(v) ((v) * (v))
#define CF_NTERM_PG(v) pow(fabs(v), p)

/* Element i of a D-typed buffer, alignment-safe (cfsdp.h). */
#define CF_NGET_FP32(p, i) cf_load_f32(p, i)
#define CF_NGET_FP64(p, i) cf_load_f64(p, i)
#define CF_NGET_BF16(p, i) cf_load_u16(p, i)
#define CF_NGET_FP16(p, i) cf_load_u16(p, i)

/* sum |x|^p for dtype D and term kind K, in the lane order of norm.h. */
#define CF_DEFINE_SUM(D, K)                                                       \
    static double cf_norm_sum_##D##_##K(const void *src, size_t n, double p)      \
    {                                                                             \
        double acc[CF_NORM_LANES] = {0};                                          \
        double total = 0.0;                                                       \
        size_t i = 0, j;                                                          \
        (void)p;                                                                  \
        for (; n - i >= CF_NORM_LANES; i += CF_NORM_LANES)                        \
            for (j = 0; j < CF_NORM_LANES; j++) {                                 \
                double v = CF_NLD_##D(CF_NGET_##D(src, i + j));                   \
                acc[j] += CF_NTERM_##K(v);                                        \
            }                                                                     \
        for (j = 0; i + j < n; j++) {                                             \
            double v = CF_NLD_##D(CF_NGET_##D(src, i + j));                       \
            acc[j] += CF_NTERM_##K(v);                                            \
        }                                                                         \
        for (j = 0; j < CF_NORM_LANES; j++)                                       \
            total += acc[j];                                                      \
        return total;                                                             \
    }

/* max |x| for dtype D; NaN if any element is NaN, 0 if n == 0.  Lanes as for the sum
 * (a max is exact in any order; the lanes only let the loop vectorise). */
#define CF_DEFINE_MAX(D)                                                          \
    static double cf_norm_max_##D(const void *src, size_t n, double p)            \
    {                                                                             \
        double m[CF_NORM_LANES] = {0}, best = 0.0;                                \
        int nan[CF_NORM_LANES] = {0}, any_nan = 0;                                \
        size_t i = 0, j;                                                          \
        (void)p;                                                                  \
        for (; n - i >= CF_NORM_LANES; i += CF_NORM_LANES)                        \
            for (j = 0; j < CF_NORM_LANES; j++) {                                 \
                double a = fabs(CF_NLD_##D(CF_NGET_##D(src, i + j)));             \
                m[j] = a > m[j] ? a : m[j];                                       \
                nan[j] |= a != a;                                                 \
            }                                                                     \
        for (j = 0; i + j < n; j++) {                                             \
            double a = fabs(CF_NLD_##D(CF_NGET_##D(src, i + j)));                 \
            m[j] = a > m[j] ? a : m[j];                                           \
            nan[j] |= a != a;                                                     \
        }                                                                         \
        for (j = 0; j < CF_NORM_LANES; j++) {                                     \
            best = m[j] > best ? m[j] : best;                                     \
            any_nan |= nan[j];                                                    \
        }                                                                         \
        return any_nan ? (double)NAN : best;                                      \
    }

#define CF_DEFINE_FOR_DTYPE(D)                                                    \
    CF_DEFINE_SUM(D, P1)                                                          \
    CF_DEFINE_SUM(D, P2)                                                          \
    CF_DEFINE_SUM(D, PG)                                                          \
    CF_DEFINE_MAX(D)

CF_DEFINE_FOR_DTYPE(FP32)
CF_DEFINE_FOR_DTYPE(FP64)
CF_DEFINE_FOR_DTYPE(BF16)
CF_DEFINE_FOR_DTYPE(FP16)

enum { CF_NORM_P1, CF_NORM_P2, CF_NORM_PG, CF_NORM_INF, CF_NORM_KINDS };

#define CF_NORM_ROW(D)                                                            \
    {cf_norm_sum_##D##_P1, cf_norm_sum_##D##_P2, cf_norm_sum_##D##_PG, cf_norm_max_##D}

/* [dtype code][kind], in cf_dtype order; read-only. */
static const cf_norm_loop cf_norm_loops[CF_DTYPE_COUNT][CF_NORM_KINDS] = {
    CF_NORM_ROW(FP32), CF_NORM_ROW(FP64), CF_NORM_ROW(BF16), CF_NORM_ROW(FP16)};

cf_status cf_norm_partial(const void *src, int dtype, int64_t numel, double p, double *out,
                          cf_err *err)
{
    size_t esz = cf_dtype_size(dtype), bytes;
    int kind;

    if (esz == 0)
        return cf_err_set(err, CF_EINVAL, "unknown dtype code %d", dtype);
    if (numel < 0)
        return cf_err_set(err, CF_EINVAL, "numel must be >= 0, got %lld", (long long)numel);
    if ((uint64_t)numel > (uint64_t)SIZE_MAX || cf_mul_size_overflows((size_t)numel, esz, &bytes))
        return cf_err_set(err, CF_EOVERFLOW, "numel %lld is too large", (long long)numel);
    if (!(p > 0.0))
        return cf_err_set(err, CF_EINVAL, "p must be > 0 (or inf), got %g", p);
    if (numel > 0 && src == NULL)
        return cf_err_set(err, CF_EINVAL, "src: NULL address with numel %lld",
                          (long long)numel);

    if (isinf(p))
        kind = CF_NORM_INF;
    else if (p == 1.0)
        kind = CF_NORM_P1;
    else if (p == 2.0)
        kind = CF_NORM_P2;
    else
        kind = CF_NORM_PG;
    *out = cf_norm_loops[dtype][kind](src, (size_t)numel, p);
    return CF_OK;
}
