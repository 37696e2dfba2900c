/*
 * norm.h -- partial p-norm statistic of a buffer (twin: cfsdp/_ref/norm.py).
 */
#ifndef CF_NORM_H
#define CF_NORM_H

#include "cfsdp.h"

/* Number of double accumulators; element i goes to lane i % CF_NORM_LANES. */
#define CF_NORM_LANES 8

/*
 * The partial statistic of the p-norm of `numel` elements of dtype `dtype`
 * (a cf_dtype code) at `src`, written to `*out`:
 *   - p == +inf: max |x_i| (0 for an empty buffer; NaN if any x_i is NaN);
 *   - finite p > 0: sum |x_i|^p, each term computed in double from the
 *     exactly widened element (|x| for p == 1, x*x for p == 2, pow(|x|, p)
 *     otherwise) and summed in double in a fixed order: lane j sums the
 *     elements i == j (mod CF_NORM_LANES) in increasing i, then the lanes are
 *     added in order, starting from 0.  NaN and inf propagate as in a plain
 *     sum (any NaN -> NaN; an inf term and no NaN -> inf).
 * The caller takes the 1/p root after combining partials (sum, or max for
 * inf).  Zero elements (padding) leave the statistic unchanged.
 * Errors (nothing is read before the checks): CF_EINVAL for an unknown dtype
 * code, numel < 0, a NULL address with numel > 0, or p that is not > 0
 * (NaN included); CF_EOVERFLOW if numel bytes do not fit in size_t.  `src`
 * may be at any address (alignment-safe loads, cfsdp.h).
 * Needs no GIL.
 */
cf_status cf_norm_partial(const void *src, int dtype, int64_t numel, double p, double *out,
                          cf_err *err);

#endif /* CF_NORM_H */
