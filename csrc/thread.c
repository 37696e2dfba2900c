/*
 * thread.c -- the C core's parallel loops: cut a memory-bound loop into a
 * few contiguous parts and run them at once.  (The only other threads of the
 * core are long-lived ones of a shared-memory group: its queue's worker,
 * queue.c, and its view's liveness keeper, shm.c.)
 *
 * Design.  No pool and no globals: each call creates its helper threads and
 * joins them before it returns, so the core stays re-entrant and nothing
 * outlives a call.  Thread start-up costs tens of microseconds, so callers
 * only go parallel above a size threshold (CF_CHUNK_PARALLEL_BYTES in
 * chunk.h), where a part is at least about a megabyte of copying.  The
 * count is capped at CF_MAX_THREADS and at the online CPUs, and the caller
 * passes its own limit (cfsdp._core passes torch.get_num_threads(), so
 * OMP_NUM_THREADS=1 and torch.set_num_threads(1) keep the core on one
 * thread, as they keep torch).  POSIX threads when the build defines
 * CF_HAVE_PTHREADS (setup.py does on POSIX systems); otherwise every loop
 * runs on the calling thread.
 */
#if defined(CF_HAVE_PTHREADS)
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <unistd.h>
#endif

#include "thread.h"

int cf_num_threads(int64_t max_threads)
{
    int64_t n = max_threads < CF_MAX_THREADS ? max_threads : CF_MAX_THREADS;
#if defined(CF_HAVE_PTHREADS)
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (cpus >= 1 && cpus < n)
        n = cpus;
#else
    n = 1;
#endif
    return n >= 1 ? (int)n : 1;
}

/* One part of a parallel loop. */
typedef struct {
    cf_range_fn fn;
    void *ctx;
    int64_t begin, end;
} cf_thread_part;

#if defined(CF_HAVE_PTHREADS)
static void *cf_thread_main(void *arg)
{
    cf_thread_part *part = arg;
    part->fn(part->ctx, part->begin, part->end);
    return NULL;
}
#endif

void cf_parallel_for(int64_t n, int nthreads, cf_range_fn fn, void *ctx)
{
#if defined(CF_HAVE_PTHREADS)
    cf_thread_part parts[CF_MAX_THREADS];
    pthread_t tids[CF_MAX_THREADS];
    int started[CF_MAX_THREADS] = {0};
    int64_t q, r, at = 0;
    int i;

    if (nthreads > CF_MAX_THREADS)
        nthreads = CF_MAX_THREADS;
    if (nthreads <= 1 || n <= 1) {
        fn(ctx, 0, n);
        return;
    }
    q = n / nthreads; /* the first n % nthreads parts get one more index */
    r = n % nthreads;
    for (i = 0; i < nthreads; i++) {
        parts[i].fn = fn;
        parts[i].ctx = ctx;
        parts[i].begin = at;
        at += q + (i < r ? 1 : 0);
        parts[i].end = at;
    }
    for (i = 1; i < nthreads; i++)
        started[i] = pthread_create(&tids[i], NULL, cf_thread_main, &parts[i]) == 0;
    fn(ctx, parts[0].begin, parts[0].end);
    for (i = 1; i < nthreads; i++) {
        if (started[i])
            pthread_join(tids[i], NULL);
        else
            fn(ctx, parts[i].begin, parts[i].end);
    }
#else
    (void)nthreads;
    fn(ctx, 0, n);
#endif
}
