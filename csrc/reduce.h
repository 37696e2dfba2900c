/*
 * reduce.h -- gradient post-processing (twin: cfsdp/_ref/reduce.py).
 */
#ifndef CF_REDUCE_H
#define CF_REDUCE_H

#include <stdbool.h>

#include "cfsdp.h"

/*
 * dst[i] = (accumulate ? dst[i] : 0) + cast(src[i] / divisor), for i < numel,
 * rounding exactly as torch's op sequence (see reduce.c).  `dst_dtype` and
 * `src_dtype` are cf_dtype codes.  Errors (checked before any write):
 * CF_EINVAL for an unknown dtype code, numel < 0 or a NULL address with
 * numel > 0; CF_EOVERFLOW if numel bytes do not fit in size_t.  Buffers
 * may be at any address (alignment-safe loads, cfsdp.h).  `src` may
 * be `dst` itself (same dtype, in place); any other overlap is the caller's
 * error.  Needs no GIL.
 */
cf_status cf_reduce_scale_cast_add(void *dst, int dst_dtype, const void *src, int src_dtype,
                                   int64_t numel, double divisor, bool accumulate,
                                   cf_err *err);

/*
 * The loop of cf_reduce_scale_cast_add without its checks, for other files
 * of the core that validated their arguments already (chunk.c): valid dtype
 * codes, `n` elements at non-NULL addresses (or n == 0).  Same rounding,
 * same aliasing rule.  Needs no GIL.
 */
void cf_reduce_scale_cast_run(void *dst, int dst_dtype, const void *src, int src_dtype,
                              size_t n, double divisor, bool accumulate);

#endif /* CF_REDUCE_H */
