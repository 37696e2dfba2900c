/*
 * thread.h -- split a loop over [0, n) across a few threads.
 */
#ifndef CF_THREAD_H
#define CF_THREAD_H

#include "cfsdp.h"

/* The most threads one call ever uses (the calling thread included). */
#define CF_MAX_THREADS 4

/*
 * How many threads a call asking for up to `max_threads` may use:
 * min(max_threads, CF_MAX_THREADS, online CPUs), at least 1.  Always 1 when
 * the core is built without threads (CF_HAVE_PTHREADS undefined).
 */
int cf_num_threads(int64_t max_threads);

/* The body of a parallel loop: handle the indices [begin, end). */
typedef void (*cf_range_fn)(void *ctx, int64_t begin, int64_t end);

/*
 * Run fn over [0, n) cut into `nthreads` contiguous parts of nearly equal
 * length: part 0 on the calling thread, the others on new threads, joined
 * before returning.  A thread that cannot be created is not an error: its
 * part runs on the calling thread.  nthreads <= 1 (or n <= 1) runs fn(ctx,
 * 0, n) inline.  fn must be safe to run concurrently on disjoint ranges and
 * must not fail.  Needs no GIL.
 */
void cf_parallel_for(int64_t n, int nthreads, cf_range_fn fn, void *ctx);

#endif /* CF_THREAD_H */
