/*
 * copy.h -- shard-at-init copies (twin: cfsdp/_ref/copy.py).
 */
#ifndef CF_COPY_H
#define CF_COPY_H

#include "cfsdp.h"

/* One source tensor: `numel` elements at `addr`, placed at flat `offset`. */
typedef struct {
    const void *addr;
    int64_t numel;
    int64_t offset;
} cf_copy_src;

/*
 * Fill one rank's shard `dst` (`dst_numel` elements of `elem_size` bytes,
 * holding flat elements [shard_start, shard_start + dst_numel)) from the
 * sources: every element covered by a source is copied from it, every other
 * element is zeroed.  Where sources overlap in flat space the later one wins.
 *
 * All arguments are validated before any byte is written: CF_EINVAL for
 * elem_size < 1, a negative numel/offset/shard_start, or a NULL address with
 * numel > 0; CF_EOVERFLOW if a byte size or an end offset does not fit.
 * The caller guarantees the memory ranges are valid and that no source
 * aliases `dst`.  Needs no GIL.
 */
/* Shards of at least this many bytes get huge-page advice before they are filled. */
#define CF_HUGE_PAGE_ADVICE_BYTES ((size_t)8 << 20)

/*
 * Advise the kernel to back the 2 MiB-aligned inner part of [addr, addr +
 * bytes) with transparent huge pages (madvise MADV_HUGEPAGE), if `bytes` is at
 * least CF_HUGE_PAGE_ADVICE_BYTES.  Call before the memory is first touched.
 * Advice only: a no-op off Linux, and a refusal is ignored; no byte changes.
 */
void cf_advise_huge_pages(void *addr, size_t bytes);

cf_status cf_copy_shard_fill(void *dst, int64_t dst_numel, int64_t elem_size,
                             int64_t shard_start, const cf_copy_src *srcs, size_t n_srcs,
                             cf_err *err);

#endif /* CF_COPY_H */
