/*
 * copy.c -- shard at init: fill one rank's shard straight from the original
 * parameters (twin: cfsdp/_ref/copy.py).
 *
 * Design.  The unsharded flat buffer is never built.  A rank's shard is the
 * flat range [shard_start, shard_start + dst_numel); each source occupies
 * [offset, offset + numel).  The bytes of the shard are either copied from
 * the source covering them or zeroed (alignment and world-size padding).
 * Sources come in layout order, so the common case is one sweep: memset the
 * gap before a source, memcpy its overlap, move on; every byte of dst is
 * written once.  If the clipped sources are not sorted and disjoint (never
 * the case for a planned layout, but allowed by the contract), the shard is
 * zeroed first and the sources copied in order, so the later source wins,
 * exactly as in the twin.  The copy is dtype-agnostic (elem_size bytes per
 * element).  Workload: once per parameter at wrap time; memory-bound, and on
 * fresh memory bound by page faults more than by bytes: a large shard is first
 * advised to use transparent huge pages (cf_advise_huge_pages; Linux, where
 * THP is "madvise" or "always"), one fault per 2 MiB instead of per 4 KiB.
 * The advice changes no byte, so the twin has no counterpart.
 */
#define _DEFAULT_SOURCE /* madvise, MADV_HUGEPAGE */
#include <stdint.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "copy.h"

void cf_advise_huge_pages(void *addr, size_t bytes)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)1 << 21;
    uintptr_t lo = ((uintptr_t)addr + huge - 1) & ~(huge - 1);
    uintptr_t hi = ((uintptr_t)addr + bytes) & ~(huge - 1);
    if (bytes >= CF_HUGE_PAGE_ADVICE_BYTES && hi > lo)
        (void)madvise((void *)lo, (size_t)(hi - lo), MADV_HUGEPAGE); /* advice: may be refused */
#else
    (void)addr;
    (void)bytes;
#endif
}

/* Validate one source; on success store its end offset in *end. */
static cf_status cf_copy_check_src(const cf_copy_src *s, size_t i, int64_t elem_size,
                                   int64_t *end, cf_err *err)
{
    int64_t bytes = 0;
    if (s->numel < 0)
        return cf_err_set(err, CF_EINVAL, "source %zu: numel must be >= 0, got %lld", i,
                          (long long)s->numel);
    if (s->offset < 0)
        return cf_err_set(err, CF_EINVAL, "source %zu: flat offset must be >= 0, got %lld",
                          i, (long long)s->offset);
    if (s->numel > 0 && s->addr == NULL)
        return cf_err_set(err, CF_EINVAL, "source %zu: NULL address with numel %lld", i,
                          (long long)s->numel);
    if (cf_add_i64_overflows(s->offset, s->numel, end) ||
        cf_mul_i64_overflows(s->numel, elem_size, &bytes) ||
        (uint64_t)bytes > (uint64_t)SIZE_MAX)
        return cf_err_set(err, CF_EOVERFLOW, "source %zu: offset + numel overflows", i);
    return CF_OK;
}

cf_status cf_copy_shard_fill(void *dst, int64_t dst_numel, int64_t elem_size,
                             int64_t shard_start, const cf_copy_src *srcs, size_t n_srcs,
                             cf_err *err)
{
    int64_t shard_end = 0, dst_bytes = 0, end = 0, cursor, s, e;
    int sweep = 1;
    size_t i;
    unsigned char *out = dst;
    size_t esz;

    if (elem_size < 1)
        return cf_err_set(err, CF_EINVAL, "elem_size must be >= 1, got %lld",
                          (long long)elem_size);
    if (dst_numel < 0)
        return cf_err_set(err, CF_EINVAL, "dst numel must be >= 0, got %lld",
                          (long long)dst_numel);
    if (shard_start < 0)
        return cf_err_set(err, CF_EINVAL, "shard_start must be >= 0, got %lld",
                          (long long)shard_start);
    if (dst_numel > 0 && dst == NULL)
        return cf_err_set(err, CF_EINVAL, "dst: NULL address with numel %lld",
                          (long long)dst_numel);
    if (cf_add_i64_overflows(shard_start, dst_numel, &shard_end) ||
        cf_mul_i64_overflows(dst_numel, elem_size, &dst_bytes) ||
        (uint64_t)dst_bytes > (uint64_t)SIZE_MAX)
        return cf_err_set(err, CF_EOVERFLOW, "shard_start + dst numel overflows");

    /* Validate everything first; note whether one sweep is enough. */
    cursor = shard_start;
    for (i = 0; i < n_srcs; i++) {
        CF_CHECK(cf_copy_check_src(&srcs[i], i, elem_size, &end, err));
        s = srcs[i].offset > shard_start ? srcs[i].offset : shard_start;
        e = end < shard_end ? end : shard_end;
        if (e > s) {
            if (s < cursor)
                sweep = 0;
            cursor = e;
        }
    }
    if (dst_numel == 0)
        return CF_OK;

    esz = (size_t)elem_size;
    cf_advise_huge_pages(out, (size_t)dst_bytes);
    if (!sweep)
        memset(out, 0, (size_t)dst_bytes);
    cursor = shard_start;
    for (i = 0; i < n_srcs; i++) {
        const unsigned char *in = srcs[i].addr;
        s = srcs[i].offset > shard_start ? srcs[i].offset : shard_start;
        e = srcs[i].offset + srcs[i].numel;
        e = e < shard_end ? e : shard_end;
        if (e <= s)
            continue;
        if (sweep && s > cursor)
            memset(out + (size_t)(cursor - shard_start) * esz, 0,
                   (size_t)(s - cursor) * esz);
        memcpy(out + (size_t)(s - shard_start) * esz, in + (size_t)(s - srcs[i].offset) * esz,
               (size_t)(e - s) * esz);
        cursor = e;
    }
    if (sweep && shard_end > cursor)
        memset(out + (size_t)(cursor - shard_start) * esz, 0,
               (size_t)(shard_end - cursor) * esz);
    return CF_OK;
}
