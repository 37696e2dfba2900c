/*
 * queue.h -- an ordered work queue with one worker thread: the CPU analogue
 * of a CUDA stream (used by the shared-memory collectives, one queue per
 * group; transport twin: the process group, see cfsdp/_runtime/comm.py).
 */
#ifndef CF_QUEUE_H
#define CF_QUEUE_H

#include <stdbool.h>

#include "cfsdp.h"

/* Runs one op: `data` is the op's copy of what cf_queue_submit was given. */
typedef cf_status (*cf_queue_fn)(void *ctx, const void *data, cf_err *err);

typedef struct cf_queue cf_queue;
typedef struct cf_queue_op cf_queue_op;

/*
 * Start a queue whose worker thread runs fn(ctx, data) for each submitted op,
 * one at a time, in submission order.  After an op fails, the queue is
 * poisoned: every later op fails at once with "<label>: poisoned by an
 * earlier failure: <first message>" without calling fn.  CF_ERUNTIME if the
 * thread cannot be started (or the build has no threads), CF_ENOMEM.
 */
cf_status cf_queue_create(cf_queue_fn fn, void *ctx, const char *label, cf_queue **out,
                          cf_err *err);

/*
 * Append an op (its `size` bytes of data are copied).  *op is the caller's
 * reference, to pass to cf_queue_wait / cf_queue_op_done and to drop with
 * cf_queue_op_release.  CF_ERUNTIME after cf_queue_stop, CF_ENOMEM.
 * Thread-safe; never blocks on the op.
 */
cf_status cf_queue_submit(cf_queue *q, const void *data, size_t size, cf_queue_op **op,
                          cf_err *err);

/* True once the op has run (or was cancelled).  Never blocks. */
bool cf_queue_op_done(const cf_queue_op *op);

/* Block (no spinning: a condition variable) until the op is done; return its
 * status, its message in *err. */
cf_status cf_queue_wait(cf_queue *q, cf_queue_op *op, cf_err *err);

/* Drop the caller's reference (the op is freed when the worker is done too). */
void cf_queue_op_release(cf_queue *q, cf_queue_op *op);

/* Block until every op submitted so far is done. */
void cf_queue_drain(cf_queue *q);

/*
 * Stop: refuse new ops, cancel the ops not yet started (they fail with
 * "<label>: closed before the op ran"), let the running one finish (the
 * caller may abort it first, see cf_shm_group_abort), join the worker.
 * Idempotent.  After it, waits return at once.
 */
void cf_queue_stop(cf_queue *q);

/* Free a stopped queue; every op reference must have been released.  NULL
 * is a no-op. */
void cf_queue_free(cf_queue *q);

#endif /* CF_QUEUE_H */
