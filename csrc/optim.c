/*
 * optim.c -- fused Adam/AdamW and SGD steps, and Muon's momentum, over many
 * element ranges of flat fp32 buffers (twin: cfsdp/_ref/optim.py).
 *
 * Design.  cfsdp.optim keeps a parameter group's optimizer state in flat
 * buffers that mirror the layout of the parameters' own storage (a unit's
 * flat shard), so one call can step a whole shard: it gets one base address
 * per buffer (param, grad, each state kind) and a list of element ranges,
 * the same for every buffer, that skip padding and parameters outside the
 * group.  Each element is read once and written once: Adam reads p, g, m, v
 * (and v_max) and writes p, m, v (and v_max); SGD reads p, g (and the
 * momentum buffer) and writes p (and the buffer).  That is 28 bytes per
 * element for Adam against torch's single-tensor path, which makes about ten
 * passes and allocates temporaries.
 *
 * Numerics.  The arithmetic is torch 2.13's single-tensor (and CPU foreach)
 * code, operation by operation, each result rounded to fp32 as torch's CPU
 * kernels round it.  Those kernels use fused multiply-adds on AVX2/AVX-512
 * builds (add with alpha, lerp, addcmul: probed on torch 2.13, vector and
 * scalar tails alike), so the loops call fmaf() at the same places; fmaf is
 * correctly rounded whether the compiler emits an FMA instruction (the AVX2
 * variant below) or calls libm (the portable one), so both variants give the
 * same bits.  Scalars are cast to fp32 where torch casts them (the Python
 * float arguments of mul_, lerp_, addcmul_, div, add_, addcdiv_); bias
 * corrections are computed in double with pow() exactly as torch's Python
 * code computes them (`1 - beta ** step`, `bc2 ** 0.5`: CPython's float pow
 * calls the same libm pow).  Adam, per element (g: grad, p: param, m, v):
 *
 *   g = maximize ? -g : g
 *   if wd != 0: decoupled ? p = p * fp32(1 - lr*wd) : g = fma(wd, p, g)
 *   m = |w| < 0.5 ? fma(w, g - m, m) : fma(w - 1, g - m, g)   (w = 1 - beta1)
 *   v = fma(fp32(1 - beta2) * g, g, v * beta2)
 *   s = amsgrad ? (v_max = maximum(v_max, v)) : v              (NaN wins)
 *   p = p + (fp32(-lr / bc1) * m) / (sqrt(s) / fp32(sqrt(bc2)) + eps)
 *
 * SGD: g = maximize ? -g : g; g = fma(wd, p, g) if wd != 0; with momentum,
 * b = first ? g : fma(1 - dampening, g, b * momentum), g = nesterov ?
 * fma(momentum, b, g) : b; p = fma(-lr, g, p).
 *
 * Muon (the momentum half of torch's _single_tensor_muon; Newton-Schulz and the
 * parameter update stay torch ops in cfsdp.optim._muon): b = lerp(b, g, 1 - momentum),
 * and with Nesterov u = lerp(g, b, momentum), each lerp in the form above.
 *
 * Loops.  Each segment loop is branch-free apart from what changes memory
 * traffic (amsgrad, the momentum modes): loop-invariant options are selects,
 * so gcc -O3 vectorises the SGD loops (-std=c11: no FP contraction beyond
 * the explicit fmaf).  The AVX2+FMA variant is the same source compiled for
 * that target, except Adam's loop, written with AVX2 intrinsics because
 * sqrtf's errno branch stops the vectoriser (the same operations, each
 * IEEE-rounded as the scalar code rounds it); it is picked at run time with
 * __builtin_cpu_supports.  Above CF_OPTIM_PARALLEL_BYTES the concatenated
 * ranges are split into nearly equal element counts across threads
 * (cf_parallel_for; a binary search over the ranges' prefix sums finds a
 * part's first range).  Workload: once per parameter group per step;
 * memory-bound.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "optim.h"
#include "thread.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define CF_OPTIM_X86 1
#define CF_AVX2 __attribute__((target("avx2,fma")))
#include <immintrin.h>
#else
#define CF_OPTIM_X86 0
#endif

#if defined(__GNUC__)
#define CF_INLINE static inline __attribute__((always_inline))
#else
#define CF_INLINE static inline
#endif

/* ------------------------------------------------------------ constants */

/* Adam's per-call fp32 constants, cast once as torch casts its scalars. */
typedef struct {
    float wd;       /* L2 alpha */
    float decay;    /* fp32(1 - lr * wd) */
    float coeff;    /* lerp coefficient: w, or w - 1 for a large weight */
    float beta2;    /* v * beta2 */
    float omb2;     /* fp32(1 - beta2) (addcmul value) */
    float bc2s;     /* fp32(bc2 ** 0.5) */
    float eps;
    float neg_step; /* fp32(-(lr / bc1)) (addcdiv value) */
    bool maximize, l2, decoupled, lerp_small;
} cf_adam_k;

typedef struct {
    float wd, momentum, omd /* fp32(1 - dampening) */, neg_lr;
    bool maximize, has_wd, nesterov;
} cf_sgd_k;

/* torch.maximum for fp32 on AVX2: a > b ? a : b, NaN if either is NaN. */
CF_INLINE float cf_maximum(float a, float b)
{
    float r = a > b ? a : b;
    return (a != a || b != b) ? a + b : r;
}

/* ---------------------------------------------------------------- loops */

/* One Adam segment of n elements (the buffers' spans do not overlap). */
CF_INLINE void cf_adam_body(float *restrict p, const float *restrict g, float *restrict m,
                            float *restrict v, float *restrict vmax, int64_t n,
                            const cf_adam_k *k, const bool amsgrad)
{
    const float wd = k->wd, decay = k->decay, coeff = k->coeff, beta2 = k->beta2;
    const float omb2 = k->omb2, bc2s = k->bc2s, eps = k->eps, neg_step = k->neg_step;
    const bool maximize = k->maximize, l2 = k->l2, decoupled = k->decoupled;
    const bool small = k->lerp_small;
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i], pi = p[i], mi = m[i], vi = v[i], s, d;
        gi = maximize ? -gi : gi;
        gi = l2 ? fmaf(wd, pi, gi) : gi;
        pi = decoupled ? pi * decay : pi;
        mi = fmaf(coeff, gi - mi, small ? mi : gi);
        vi = fmaf(omb2 * gi, gi, vi * beta2);
        s = vi;
        if (amsgrad) {
            s = cf_maximum(vmax[i], vi);
            vmax[i] = s;
        }
        d = sqrtf(s) / bc2s + eps;
        p[i] = pi + (neg_step * mi) / d;
        m[i] = mi;
        v[i] = vi;
    }
}

/* Momentum modes of SGD: none, the first step (b = g), the others. */
enum { CF_SGD_PLAIN = 0, CF_SGD_FIRST = 1, CF_SGD_MOMENTUM = 2 };

CF_INLINE void cf_sgd_body(float *restrict p, const float *restrict g, float *restrict b,
                           int64_t n, const cf_sgd_k *k, const int mode)
{
    const float wd = k->wd, mom = k->momentum, omd = k->omd, neg_lr = k->neg_lr;
    const bool maximize = k->maximize, has_wd = k->has_wd, nesterov = k->nesterov;
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i], pi = p[i];
        gi = maximize ? -gi : gi;
        gi = has_wd ? fmaf(wd, pi, gi) : gi;
        if (mode != CF_SGD_PLAIN) {
            float bi = mode == CF_SGD_FIRST ? gi : fmaf(omd, gi, b[i] * mom);
            b[i] = bi;
            gi = nesterov ? fmaf(mom, bi, gi) : bi;
        }
        p[i] = fmaf(neg_lr, gi, pi);
    }
}

/* Muon's momentum (torch's _single_tensor_muon): b = lerp(b, g, w) with w = fp32(1 -
 * momentum), then with Nesterov u = lerp(g, b, fp32(momentum)).  torch's lerp is
 * |w| < 0.5 ? fma(w, end - start, start) : fma(w - 1, end - start, end) (see Adam). */
typedef struct {
    float bcoeff, ucoeff; /* lerp coefficients of the buffer and the Nesterov update */
    bool bsmall, usmall;  /* whether each lerp weight is small (|w| < 0.5) */
} cf_muon_k;

CF_INLINE void cf_muon_body(const float *restrict g, float *restrict b, float *restrict u,
                            int64_t n, const cf_muon_k *k, const bool nesterov)
{
    const float bcoeff = k->bcoeff, ucoeff = k->ucoeff;
    const bool bsmall = k->bsmall, usmall = k->usmall;
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i], bi = b[i];
        bi = fmaf(bcoeff, gi - bi, bsmall ? bi : gi);
        b[i] = bi;
        if (nesterov)
            u[i] = fmaf(ucoeff, bi - gi, usmall ? gi : bi);
    }
}

typedef void (*cf_adam_seg_fn)(float *, const float *, float *, float *, float *, int64_t,
                               const cf_adam_k *);
typedef void (*cf_muon_seg_fn)(const float *, float *, float *, int64_t, const cf_muon_k *);
typedef void (*cf_sgd_seg_fn)(float *, const float *, float *, int64_t, const cf_sgd_k *);

/* The variants: portable, and (x86) the same source compiled for AVX2+FMA.
 * gcc vectorises the SGD bodies itself; Adam's sqrtf keeps its errno branch
 * under the project's flags (-fmath-errno), which stops the vectoriser, so
 * the AVX2 Adam loop is written with intrinsics (cf_adam_avx2 below): the
 * same operations in the same order, each IEEE-rounded like its scalar
 * twin. */
#define CF_OPTIM_VARIANTS(SUFFIX, ATTR, ADAM)                                              \
    ATTR static void cf_adam_seg_##SUFFIX(float *p, const float *g, float *m, float *v,  \
                                          float *vmax, int64_t n, const cf_adam_k *k)     \
    {                                                                                     \
        ADAM(p, g, m, v, vmax, n, k, false);                                              \
    }                                                                                     \
    ATTR static void cf_adam_ams_seg_##SUFFIX(float *p, const float *g, float *m, float *v, \
                                              float *vmax, int64_t n, const cf_adam_k *k) \
    {                                                                                     \
        ADAM(p, g, m, v, vmax, n, k, true);                                               \
    }                                                                                     \
    ATTR static void cf_sgd_plain_##SUFFIX(float *p, const float *g, float *b, int64_t n, \
                                           const cf_sgd_k *k)                             \
    {                                                                                     \
        cf_sgd_body(p, g, b, n, k, CF_SGD_PLAIN);                                         \
    }                                                                                     \
    ATTR static void cf_sgd_first_##SUFFIX(float *p, const float *g, float *b, int64_t n, \
                                           const cf_sgd_k *k)                             \
    {                                                                                     \
        cf_sgd_body(p, g, b, n, k, CF_SGD_FIRST);                                         \
    }                                                                                     \
    ATTR static void cf_sgd_mom_##SUFFIX(float *p, const float *g, float *b, int64_t n,   \
                                         const cf_sgd_k *k)                               \
    {                                                                                     \
        cf_sgd_body(p, g, b, n, k, CF_SGD_MOMENTUM);                                      \
    }                                                                                     \
    ATTR static void cf_muon_##SUFFIX(const float *g, float *b, float *u, int64_t n,      \
                                      const cf_muon_k *k)                                 \
    {                                                                                     \
        cf_muon_body(g, b, u, n, k, false);                                               \
    }                                                                                     \
    ATTR static void cf_muon_nesterov_##SUFFIX(const float *g, float *b, float *u,        \
                                               int64_t n, const cf_muon_k *k)             \
    {                                                                                     \
        cf_muon_body(g, b, u, n, k, true);                                                \
    }

CF_OPTIM_VARIANTS(portable, , cf_adam_body)

#if CF_OPTIM_X86
/* cf_adam_body, 8 lanes at a time; the tail runs the scalar body. */
CF_INLINE CF_AVX2 void cf_adam_avx2(float *restrict p, const float *restrict g,
                                    float *restrict m, float *restrict v,
                                    float *restrict vmax, int64_t n, const cf_adam_k *k,
                                    const bool amsgrad)
{
    const __m256 wd = _mm256_set1_ps(k->wd), decay = _mm256_set1_ps(k->decay);
    const __m256 coeff = _mm256_set1_ps(k->coeff), beta2 = _mm256_set1_ps(k->beta2);
    const __m256 omb2 = _mm256_set1_ps(k->omb2), bc2s = _mm256_set1_ps(k->bc2s);
    const __m256 eps = _mm256_set1_ps(k->eps), neg_step = _mm256_set1_ps(k->neg_step);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const bool maximize = k->maximize, l2 = k->l2, decoupled = k->decoupled;
    const bool small = k->lerp_small;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gi = _mm256_loadu_ps(g + i), pi = _mm256_loadu_ps(p + i);
        __m256 mi = _mm256_loadu_ps(m + i), vi = _mm256_loadu_ps(v + i), s, d;
        if (maximize)
            gi = _mm256_xor_ps(gi, sign);
        if (l2)
            gi = _mm256_fmadd_ps(wd, pi, gi);
        if (decoupled)
            pi = _mm256_mul_ps(pi, decay);
        mi = _mm256_fmadd_ps(coeff, _mm256_sub_ps(gi, mi), small ? mi : gi);
        vi = _mm256_fmadd_ps(_mm256_mul_ps(omb2, gi), gi, _mm256_mul_ps(vi, beta2));
        s = vi;
        if (amsgrad) { /* torch.maximum: a > b ? a : b, NaN if either is */
            __m256 a = _mm256_loadu_ps(vmax + i);
            s = _mm256_or_ps(_mm256_max_ps(a, vi), _mm256_cmp_ps(a, vi, _CMP_UNORD_Q));
            _mm256_storeu_ps(vmax + i, s);
        }
        d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(s), bc2s), eps);
        _mm256_storeu_ps(p + i, _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(neg_step, mi), d)));
        _mm256_storeu_ps(m + i, mi);
        _mm256_storeu_ps(v + i, vi);
    }
    cf_adam_body(p + i, g + i, m + i, v + i, amsgrad ? vmax + i : vmax, n - i, k, amsgrad);
}

CF_OPTIM_VARIANTS(avx2, CF_AVX2, cf_adam_avx2)
#endif

bool cf_optim_uses_avx2(void)
{
#if CF_OPTIM_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return false;
#endif
}

/* ----------------------------------------------------------- validation */

/* What a call steps: the ranges' total and their first start / last end. */
typedef struct {
    int64_t total, lo, hi;
} cf_optim_extent;

static cf_status cf_optim_check_ranges(const cf_optim_range *ranges, size_t n,
                                       cf_optim_extent *ext, cf_err *err)
{
    int64_t prev_end = 0, end;
    ext->total = 0;
    ext->lo = -1;
    ext->hi = 0;
    if (n > 0 && ranges == NULL)
        return cf_err_set(err, CF_EINVAL, "ranges: NULL array of %zu ranges", n);
    for (size_t i = 0; i < n; i++) {
        const cf_optim_range *r = &ranges[i];
        if (r->start < 0 || r->len < 0)
            return cf_err_set(err, CF_EINVAL,
                              "range %zu: start and length must be >= 0, got (%lld, %lld)", i,
                              (long long)r->start, (long long)r->len);
        if (cf_add_i64_overflows(r->start, r->len, &end))
            return cf_err_set(err, CF_EOVERFLOW, "range %zu: start %lld + length %lld overflows",
                              i, (long long)r->start, (long long)r->len);
        if (r->len == 0)
            continue;
        if (r->start < prev_end)
            return cf_err_set(err, CF_EINVAL,
                              "range %zu at %lld overlaps or precedes the previous one (ends at "
                              "%lld); ranges must be in increasing order without overlap",
                              i, (long long)r->start, (long long)prev_end);
        if (ext->lo < 0)
            ext->lo = r->start;
        prev_end = ext->hi = end;
        ext->total += r->len; /* <= end: cannot overflow */
    }
    if (ext->lo < 0)
        ext->lo = 0;
    return CF_OK;
}

/* The buffers of a call: their addresses and names, for the span checks. */
typedef struct {
    const void *addr;
    const char *name;
} cf_optim_buf;

/* Every used buffer is non-NULL and fp32-aligned, its span [lo, hi) of fp32 elements
 * fits the address space, and no two spans overlap (the loops use restrict). */
static cf_status cf_optim_check_bufs(const cf_optim_buf *bufs, size_t n,
                                     const cf_optim_extent *ext, cf_err *err)
{
    int64_t lo_b, hi_b;
    uintptr_t s[8], e[8];
    if (ext->total == 0)
        return CF_OK;
    if (cf_mul_i64_overflows(ext->hi, 4, &hi_b) || (uint64_t)hi_b > (uint64_t)SIZE_MAX)
        return cf_err_set(err, CF_EOVERFLOW, "ranges end at element %lld: too large",
                          (long long)ext->hi);
    lo_b = ext->lo * 4;
    for (size_t i = 0; i < n; i++) {
        uintptr_t a = (uintptr_t)bufs[i].addr;
        if (bufs[i].addr == NULL)
            return cf_err_set(err, CF_EINVAL, "%s: NULL address with %lld elements to step",
                              bufs[i].name, (long long)ext->total);
        if (a % _Alignof(float) != 0)
            return cf_err_set(err, CF_EINVAL, "%s: address %p is not aligned to its 4-byte "
                              "elements", bufs[i].name, bufs[i].addr);
        if (a > UINTPTR_MAX - (uintptr_t)hi_b)
            return cf_err_set(err, CF_EOVERFLOW, "%s: address + %lld bytes overflows",
                              bufs[i].name, (long long)hi_b);
        s[i] = a + (uintptr_t)lo_b;
        e[i] = a + (uintptr_t)hi_b;
        for (size_t j = 0; j < i; j++)
            if (s[i] < e[j] && s[j] < e[i])
                return cf_err_set(err, CF_EINVAL,
                                  "%s and %s overlap over the ranges' span; every buffer must "
                                  "be separate memory",
                                  bufs[j].name, bufs[i].name);
    }
    return CF_OK;
}

/* ---------------------------------------------------------- range walks */

/* A segment visitor: elements [off, off + len) of every buffer. */
typedef void (*cf_optim_visit)(const void *kctx, int64_t off, int64_t len);

typedef struct {
    const cf_optim_range *ranges;
    size_t n;
    const int64_t *prefix; /* prefix[i]: elements of ranges before i; NULL: inline */
    cf_optim_visit visit;
    const void *kctx;
} cf_optim_walk;

/* Visit elements [a, b) of the ranges' concatenation. */
static void cf_optim_part(void *ctx_, int64_t a, int64_t b)
{
    const cf_optim_walk *w = ctx_;
    size_t r = 0;
    int64_t at = 0;
    if (w->prefix != NULL) { /* the last range starting at or before a */
        size_t lo = 0, hi = w->n;
        while (hi - lo > 1) {
            size_t mid = lo + (hi - lo) / 2;
            if (w->prefix[mid] <= a)
                lo = mid;
            else
                hi = mid;
        }
        r = lo;
        at = w->prefix[r];
    }
    for (; r < w->n && at < b; r++) {
        int64_t len = w->ranges[r].len;
        int64_t s = a > at ? a - at : 0, e = b < at + len ? b - at : len;
        if (e > s)
            w->visit(w->kctx, w->ranges[r].start + s, e - s);
        at += len;
    }
}

/* Run the visitor over every range, on threads above the byte threshold. */
static cf_status cf_optim_run(const cf_optim_range *ranges, size_t n, int64_t total,
                              int64_t bytes_per, cf_optim_visit visit, const void *kctx,
                              int64_t max_threads, cf_err *err)
{
    cf_optim_walk w = {ranges, n, NULL, visit, kctx};
    int threads = total > CF_OPTIM_PARALLEL_BYTES / bytes_per ? cf_num_threads(max_threads) : 1;
    int64_t *prefix = NULL;
    if (threads > 1) {
        prefix = malloc((n + 1) * sizeof *prefix);
        if (prefix == NULL)
            return cf_err_set(err, CF_ENOMEM, "no memory for the index of %zu ranges", n);
        prefix[0] = 0;
        for (size_t i = 0; i < n; i++)
            prefix[i + 1] = prefix[i] + ranges[i].len;
        w.prefix = prefix;
    }
    cf_parallel_for(total, threads, cf_optim_part, &w);
    free(prefix);
    return CF_OK;
}

/* ----------------------------------------------------------------- Adam */

typedef struct {
    float *p, *m, *v, *vmax;
    const float *g;
    cf_adam_k k;
    cf_adam_seg_fn seg;
} cf_adam_ctx;

static void cf_adam_visit(const void *ctx_, int64_t off, int64_t len)
{
    const cf_adam_ctx *c = ctx_;
    c->seg(c->p + off, c->g + off, c->m + off, c->v + off, c->vmax ? c->vmax + off : NULL, len,
           &c->k);
}

cf_status cf_optim_adam_step(void *param, const void *grad, void *exp_avg, void *exp_avg_sq,
                             void *max_exp_avg_sq, const cf_optim_range *ranges,
                             size_t n_ranges, int dtype, const cf_adam_args *a,
                             int64_t max_threads, cf_err *err)
{
    cf_optim_buf bufs[5] = {{param, "param"}, {grad, "grad"}, {exp_avg, "exp_avg"},
                            {exp_avg_sq, "exp_avg_sq"}, {max_exp_avg_sq, "max_exp_avg_sq"}};
    cf_optim_extent ext;
    cf_adam_ctx c;
    double bc1, bc2;
    float w;
    bool avx2 = cf_optim_uses_avx2();

    if (dtype != CF_DTYPE_FP32)
        return cf_err_set(err, CF_EINVAL, "the fused step needs fp32 buffers (dtype code %d), "
                          "got dtype code %d", CF_DTYPE_FP32, dtype);
    if (!(a->step >= 1.0) || isinf(a->step))
        return cf_err_set(err, CF_EINVAL, "step must be a finite number >= 1, got %g", a->step);
    CF_CHECK(cf_optim_check_ranges(ranges, n_ranges, &ext, err));
    CF_CHECK(cf_optim_check_bufs(bufs, a->amsgrad ? 5 : 4, &ext, err));
    if (ext.total == 0)
        return CF_OK;

    /* torch's Python: bias_correction1 = 1 - beta1 ** step; step_size = lr /
     * bias_correction1; bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5 */
    bc1 = 1.0 - pow(a->beta1, a->step);
    bc2 = 1.0 - pow(a->beta2, a->step);
    w = (float)(1.0 - a->beta1);
    c.k.wd = (float)a->weight_decay;
    c.k.decay = (float)(1.0 - a->lr * a->weight_decay);
    c.k.lerp_small = fabsf(w) < 0.5f;
    c.k.coeff = c.k.lerp_small ? w : w - 1.0f;
    c.k.beta2 = (float)a->beta2;
    c.k.omb2 = (float)(1.0 - a->beta2);
    c.k.bc2s = (float)pow(bc2, 0.5);
    c.k.eps = (float)a->eps;
    c.k.neg_step = (float)(-(a->lr / bc1));
    c.k.maximize = a->maximize;
    c.k.l2 = a->weight_decay != 0.0 && !a->decoupled;
    c.k.decoupled = a->weight_decay != 0.0 && a->decoupled;
    c.p = param;
    c.g = grad;
    c.m = exp_avg;
    c.v = exp_avg_sq;
    c.vmax = a->amsgrad ? max_exp_avg_sq : NULL;
#if CF_OPTIM_X86
    if (avx2)
        c.seg = a->amsgrad ? cf_adam_ams_seg_avx2 : cf_adam_seg_avx2;
    else
#endif
        c.seg = a->amsgrad ? cf_adam_ams_seg_portable : cf_adam_seg_portable;
    (void)avx2;
    return cf_optim_run(ranges, n_ranges, ext.total, a->amsgrad ? 36 : 28, cf_adam_visit, &c,
                        max_threads, err);
}

/* ------------------------------------------------------------------ SGD */

typedef struct {
    float *p, *b;
    const float *g;
    cf_sgd_k k;
    cf_sgd_seg_fn seg;
} cf_sgd_ctx;

static void cf_sgd_visit(const void *ctx_, int64_t off, int64_t len)
{
    const cf_sgd_ctx *c = ctx_;
    c->seg(c->p + off, c->g + off, c->b ? c->b + off : NULL, len, &c->k);
}

cf_status cf_optim_sgd_step(void *param, const void *grad, void *momentum_buffer,
                            const cf_optim_range *ranges, size_t n_ranges, int dtype,
                            const cf_sgd_args *a, int64_t max_threads, cf_err *err)
{
    cf_optim_buf bufs[3] = {{param, "param"}, {grad, "grad"},
                            {momentum_buffer, "momentum_buffer"}};
    bool has_mom = a->momentum != 0.0, avx2 = cf_optim_uses_avx2();
    int mode = !has_mom ? CF_SGD_PLAIN : a->first_step ? CF_SGD_FIRST : CF_SGD_MOMENTUM;
    cf_optim_extent ext;
    cf_sgd_ctx c;

    if (dtype != CF_DTYPE_FP32)
        return cf_err_set(err, CF_EINVAL, "the fused step needs fp32 buffers (dtype code %d), "
                          "got dtype code %d", CF_DTYPE_FP32, dtype);
    CF_CHECK(cf_optim_check_ranges(ranges, n_ranges, &ext, err));
    CF_CHECK(cf_optim_check_bufs(bufs, has_mom ? 3 : 2, &ext, err));
    if (ext.total == 0)
        return CF_OK;

    c.k.wd = (float)a->weight_decay;
    c.k.momentum = (float)a->momentum;
    c.k.omd = (float)(1.0 - a->dampening);
    c.k.neg_lr = (float)(-a->lr);
    c.k.maximize = a->maximize;
    c.k.has_wd = a->weight_decay != 0.0;
    c.k.nesterov = a->nesterov;
    c.p = param;
    c.g = grad;
    c.b = has_mom ? momentum_buffer : NULL;
#if CF_OPTIM_X86
    if (avx2)
        c.seg = mode == CF_SGD_PLAIN ? cf_sgd_plain_avx2
                : mode == CF_SGD_FIRST ? cf_sgd_first_avx2 : cf_sgd_mom_avx2;
    else
#endif
        c.seg = mode == CF_SGD_PLAIN ? cf_sgd_plain_portable
                : mode == CF_SGD_FIRST ? cf_sgd_first_portable : cf_sgd_mom_portable;
    (void)avx2;
    return cf_optim_run(ranges, n_ranges, ext.total, has_mom ? 20 : 12, cf_sgd_visit, &c,
                        max_threads, err);
}

/* ----------------------------------------------------------------- Muon */

typedef struct {
    const float *g;
    float *b, *u;
    cf_muon_k k;
    cf_muon_seg_fn seg;
} cf_muon_ctx;

static void cf_muon_visit(const void *ctx_, int64_t off, int64_t len)
{
    const cf_muon_ctx *c = ctx_;
    c->seg(c->g + off, c->b + off, c->u ? c->u + off : NULL, len, &c->k);
}

cf_status cf_optim_muon_momentum(const void *grad, void *momentum_buffer, void *update,
                                 const cf_optim_range *ranges, size_t n_ranges, int dtype,
                                 double momentum, bool nesterov, int64_t max_threads,
                                 cf_err *err)
{
    cf_optim_buf bufs[3] = {{grad, "grad"}, {momentum_buffer, "momentum_buffer"},
                            {update, "update"}};
    bool avx2 = cf_optim_uses_avx2();
    cf_optim_extent ext;
    cf_muon_ctx c;
    float w;

    if (dtype != CF_DTYPE_FP32)
        return cf_err_set(err, CF_EINVAL, "the fused step needs fp32 buffers (dtype code %d), "
                          "got dtype code %d", CF_DTYPE_FP32, dtype);
    CF_CHECK(cf_optim_check_ranges(ranges, n_ranges, &ext, err));
    CF_CHECK(cf_optim_check_bufs(bufs, nesterov ? 3 : 2, &ext, err));
    if (ext.total == 0)
        return CF_OK;

    /* torch's Python: buf.lerp_(grad, 1 - momentum); grad.lerp(buf, momentum) */
    w = (float)(1.0 - momentum);
    c.k.bsmall = fabsf(w) < 0.5f;
    c.k.bcoeff = c.k.bsmall ? w : w - 1.0f;
    w = (float)momentum;
    c.k.usmall = fabsf(w) < 0.5f;
    c.k.ucoeff = c.k.usmall ? w : w - 1.0f;
    c.g = grad;
    c.b = momentum_buffer;
    c.u = nesterov ? update : NULL;
#if CF_OPTIM_X86
    if (avx2)
        c.seg = nesterov ? cf_muon_nesterov_avx2 : cf_muon_avx2;
    else
#endif
        c.seg = nesterov ? cf_muon_nesterov_portable : cf_muon_portable;
    (void)avx2;
    return cf_optim_run(ranges, n_ranges, ext.total, nesterov ? 16 : 12, cf_muon_visit, &c,
                        max_threads, err);
}
