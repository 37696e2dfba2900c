/*
 * queue.c -- an ordered work queue with one worker pthread.
 *
 * Design.  A FIFO of ops under one mutex; the worker sleeps on `work_cv`
 * until an op arrives, runs it without the lock, marks it done and
 * broadcasts `done_cv`, on which callers of cf_queue_wait and
 * cf_queue_drain sleep (no busy waiting: on a 2-core machine with 2 ranks a
 * spinning waiter would steal the core the worker or the compute needs).
 * An op is shared by the queue and the submitter: a reference count under
 * the mutex frees it when both are done with it.  The first failing op
 * poisons the queue (its message is kept); later ops fail without running.
 * The worker blocks every signal, so signals reach the interpreter's threads.
 * Built without CF_HAVE_PTHREADS, cf_queue_create fails with CF_ERUNTIME.
 */
#if defined(CF_HAVE_PTHREADS)
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <signal.h>
#endif

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "queue.h"

struct cf_queue_op {
    struct cf_queue_op *next;
    _Atomic int done;
    int refs; /* under the queue's mutex */
    cf_err err;
    size_t size;
    _Alignas(16) unsigned char data[];
};

#if defined(CF_HAVE_PTHREADS)

struct cf_queue {
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    cf_queue_op *head, *tail;
    uint64_t submitted, completed;
    bool stopping, joined, started;
    pthread_t thread;
    cf_queue_fn fn;
    void *ctx;
    bool poisoned;
    cf_err poison;
    char label[128];
};

/* Under the lock: mark op done with its error, drop the queue's ref. */
static void cf_queue_finish_locked(cf_queue *q, cf_queue_op *op)
{
    atomic_store_explicit(&op->done, 1, memory_order_release);
    q->completed++;
    if (--op->refs == 0)
        free(op);
    pthread_cond_broadcast(&q->done_cv);
}

static void *cf_queue_main(void *arg)
{
    cf_queue *q = arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);

    pthread_mutex_lock(&q->mu);
    for (;;) {
        cf_queue_op *op;
        cf_status st;
        while (q->head == NULL && !q->stopping)
            pthread_cond_wait(&q->work_cv, &q->mu);
        if (q->head == NULL)
            break; /* stopping and nothing left */
        op = q->head;
        q->head = op->next;
        if (q->head == NULL)
            q->tail = NULL;
        if (q->poisoned) {
            cf_err_set(&op->err, CF_ERUNTIME, "%s: poisoned by an earlier failure: %s",
                       q->label, q->poison.msg);
            cf_queue_finish_locked(q, op);
            continue;
        }
        pthread_mutex_unlock(&q->mu);
        st = q->fn(q->ctx, op->data, &op->err);
        pthread_mutex_lock(&q->mu);
        if (st != CF_OK && !q->poisoned) {
            q->poisoned = true;
            q->poison = op->err;
        }
        cf_queue_finish_locked(q, op);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

cf_status cf_queue_create(cf_queue_fn fn, void *ctx, const char *label, cf_queue **out,
                          cf_err *err)
{
    cf_queue *q = calloc(1, sizeof *q);
    *out = NULL;
    if (q == NULL)
        return cf_err_set(err, CF_ENOMEM, "cfsdp queue: out of memory");
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->work_cv, NULL);
    pthread_cond_init(&q->done_cv, NULL);
    q->fn = fn;
    q->ctx = ctx;
    cf_err_init(&q->poison);
    snprintf(q->label, sizeof q->label, "%s", label ? label : "cfsdp queue");
    if (pthread_create(&q->thread, NULL, cf_queue_main, q) != 0) {
        pthread_cond_destroy(&q->done_cv);
        pthread_cond_destroy(&q->work_cv);
        pthread_mutex_destroy(&q->mu);
        free(q);
        return cf_err_set(err, CF_ERUNTIME, "cfsdp queue: cannot start a worker thread");
    }
    q->started = true;
    *out = q;
    return CF_OK;
}

cf_status cf_queue_submit(cf_queue *q, const void *data, size_t size, cf_queue_op **out,
                          cf_err *err)
{
    cf_queue_op *op;
    *out = NULL;
    if (size > SIZE_MAX - sizeof *op)
        return cf_err_set(err, CF_EOVERFLOW, "cfsdp queue: op data too large");
    op = malloc(sizeof *op + size);
    if (op == NULL)
        return cf_err_set(err, CF_ENOMEM, "cfsdp queue: out of memory for an op");
    op->next = NULL;
    atomic_init(&op->done, 0);
    op->refs = 2;
    cf_err_init(&op->err);
    op->size = size;
    memcpy(op->data, data, size);
    pthread_mutex_lock(&q->mu);
    if (q->stopping) {
        pthread_mutex_unlock(&q->mu);
        free(op);
        return cf_err_set(err, CF_ERUNTIME, "%s: closed; no more collectives can be issued",
                          q->label);
    }
    if (q->tail)
        q->tail->next = op;
    else
        q->head = op;
    q->tail = op;
    q->submitted++;
    pthread_cond_signal(&q->work_cv);
    pthread_mutex_unlock(&q->mu);
    *out = op;
    return CF_OK;
}

bool cf_queue_op_done(const cf_queue_op *op)
{
    return atomic_load_explicit(&op->done, memory_order_acquire) != 0;
}

cf_status cf_queue_wait(cf_queue *q, cf_queue_op *op, cf_err *err)
{
    if (!cf_queue_op_done(op)) {
        pthread_mutex_lock(&q->mu);
        while (!cf_queue_op_done(op))
            pthread_cond_wait(&q->done_cv, &q->mu);
        pthread_mutex_unlock(&q->mu);
    }
    *err = op->err;
    return op->err.status;
}

void cf_queue_op_release(cf_queue *q, cf_queue_op *op)
{
    pthread_mutex_lock(&q->mu);
    if (--op->refs == 0)
        free(op);
    pthread_mutex_unlock(&q->mu);
}

void cf_queue_drain(cf_queue *q)
{
    pthread_mutex_lock(&q->mu);
    uint64_t target = q->submitted;
    while (q->completed < target)
        pthread_cond_wait(&q->done_cv, &q->mu);
    pthread_mutex_unlock(&q->mu);
}

void cf_queue_stop(cf_queue *q)
{
    bool join;
    pthread_mutex_lock(&q->mu);
    q->stopping = true;
    while (q->head != NULL) { /* cancel what has not started */
        cf_queue_op *op = q->head;
        q->head = op->next;
        cf_err_set(&op->err, CF_ERUNTIME, "%s: closed before the op ran", q->label);
        cf_queue_finish_locked(q, op);
    }
    q->tail = NULL;
    pthread_cond_signal(&q->work_cv);
    join = q->started && !q->joined;
    q->joined = true;
    pthread_mutex_unlock(&q->mu);
    if (join)
        pthread_join(q->thread, NULL);
}

void cf_queue_free(cf_queue *q)
{
    if (q == NULL)
        return;
    cf_queue_stop(q);
    pthread_cond_destroy(&q->done_cv);
    pthread_cond_destroy(&q->work_cv);
    pthread_mutex_destroy(&q->mu);
    free(q);
}

#else /* !CF_HAVE_PTHREADS */

struct cf_queue {
    int unused;
};

cf_status cf_queue_create(cf_queue_fn fn, void *ctx, const char *label, cf_queue **out,
                          cf_err *err)
{
    (void)fn;
    (void)ctx;
    (void)label;
    *out = NULL;
    return cf_err_set(err, CF_ERUNTIME, "cfsdp queue: this build has no threads");
}

cf_status cf_queue_submit(cf_queue *q, const void *data, size_t size, cf_queue_op **out,
                          cf_err *err)
{
    (void)q;
    (void)data;
    (void)size;
    *out = NULL;
    return cf_err_set(err, CF_ERUNTIME, "cfsdp queue: this build has no threads");
}

bool cf_queue_op_done(const cf_queue_op *op) { return atomic_load(&op->done) != 0; }

cf_status cf_queue_wait(cf_queue *q, cf_queue_op *op, cf_err *err)
{
    (void)q;
    *err = op->err;
    return op->err.status;
}

void cf_queue_op_release(cf_queue *q, cf_queue_op *op)
{
    (void)q;
    free(op);
}

void cf_queue_drain(cf_queue *q) { (void)q; }
void cf_queue_stop(cf_queue *q) { (void)q; }
void cf_queue_free(cf_queue *q) { free(q); }

#endif
