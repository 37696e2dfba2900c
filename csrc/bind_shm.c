/*
 * bind_shm.c -- the shared-memory collectives of cfsdp._C (csrc/shm.c on the
 * ordered work queue of csrc/queue.c): the kernels shm_reduce, shm_memcpy and
 * shm_segment_bytes, and the types
 * ShmGroup (one rank's view of a segment plus its worker thread), ShmWork (one
 * queued collective) and ShmSegment (a checked host-shared file mapping,
 * cf_shm_map_file, exported through the buffer protocol: ZeRO's shared
 * bucket).  Kernel twins: cfsdp._ref.shm (ShmSegment's: cfsdp._ref.ShmSegment);
 * transport twin: the process group (cfsdp._runtime.comm).
 *
 * Design.  A collective method parses its arguments into a cf_shm_args,
 * validates it with cf_shm_check (so a bad call raises and queues nothing),
 * and queues it; the returned ShmWork owns what the worker reads until the op
 * is done: the caller's `keep` (the tensors) and its own copy of the chunk
 * plan.  Waiting releases the GIL.  Lifetimes: a ShmWork holds its group, the
 * group holds its queue (freed with the group), its type, and the type its
 * module, whose state (cf_py_state) holds the ShmWork type.  Closing a group
 * (close() or its deallocation) aborts the running op, cancels the queued
 * ones and joins the worker; a wait_attached running in another thread is
 * aborted and waited for before the segment is unmapped.  Errors of a
 * collective are RuntimeError (cf_py_raise's CF_ERUNTIME).
 */
#include "bind.h" /* first: it includes Python.h */

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "chunk.h"
#include "queue.h"
#include "shm.h"

CF_PY_DOC(shm_reduce,
"shm_reduce($module, dst_addr, src_addrs, numel, dtype_code, scale, max_threads, /)\n"
"--\n"
"\n"
"dst = round(scale * (src[0] + src[1] + ...)), elementwise, in one pass.\n"
"\n"
"The sources are summed left to right in float32 (float64 for fp64; bf16\n"
"and fp16 widen exactly), multiplied by scale in that type (skipped when\n"
"scale == 1) and rounded once to the dtype (code fp32=0, fp64=1, bf16=2,\n"
"fp16=3).  dst may be one of the sources exactly.  The sum kernel of the\n"
"shared-memory collectives; same bits as cfsdp._ref.shm_reduce (NaN\n"
"payloads aside).  Runs with the GIL released, on up to min(max_threads, 4,\n"
"online CPUs) threads above CHUNK_PARALLEL_BYTES.  ValueError for an unknown\n"
"dtype code, no sources, negative numel or a NULL address.");

static const cf_py_rows_spec cf_py_src_addrs_spec = {
    "src_addrs must be a sequence of int addresses", NULL, NULL, NULL, 1, {{"src_addr", true}}};

PyObject *cf_py_shm_reduce(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *srcs_obj;
    const void *srcs[CF_SHM_MAX_WORLD];
    int64_t *addrs;
    void *dst;
    int64_t numel, code, max_threads;
    size_t n;
    double scale;
    cf_err err;
    cf_status st;
    const cf_py_arg table[] = {{"dst_addr", CF_PY_ADDR, &dst},
                               {"src_addrs", CF_PY_OBJ, &srcs_obj},
                               {"numel", CF_PY_I64, &numel},
                               {"dtype_code", CF_PY_I64, &code},
                               {"scale", CF_PY_F64, &scale},
                               {"max_threads", CF_PY_I64, &max_threads}};

    (void)module;
    cf_err_init(&err);
    if (cf_py_parse("shm_reduce", args, nargs, table, CF_PY_COUNT(table)) < 0 ||
        cf_py_rows(srcs_obj, &cf_py_src_addrs_spec, &addrs, &n) < 0)
        return NULL;
    if (n < 1 || n > CF_SHM_MAX_WORLD) {
        free(addrs);
        PyErr_Format(PyExc_ValueError, "number of sources must be in [1, %d], got %zu",
                     CF_SHM_MAX_WORLD, n);
        return NULL;
    }
    for (size_t j = 0; j < n; j++)
        srcs[j] = (const void *)(uintptr_t)addrs[j];
    free(addrs);
    if (code < 0 || code >= CF_DTYPE_COUNT) {
        cf_err_set(&err, CF_EINVAL, "unknown dtype code %lld; expected 0..%d", (long long)code,
                   CF_DTYPE_COUNT - 1);
        return cf_py_raise(&err);
    }

    Py_BEGIN_ALLOW_THREADS
    st = cf_shm_reduce(dst, srcs, (int64_t)n, numel, (int)code, scale, max_threads, &err);
    Py_END_ALLOW_THREADS
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

CF_PY_DOC(shm_memcpy,
"shm_memcpy($module, dst_addr, src_addr, nbytes, max_threads, /)\n"
"--\n"
"\n"
"Copy nbytes from src to dst (no overlap), as the collectives copy: one\n"
"memcpy per thread, up to min(max_threads, 4, online CPUs) threads above\n"
"CHUNK_PARALLEL_BYTES.  Twin: cfsdp._ref.shm_memcpy.  Runs with the GIL\n"
"released.  ValueError for a negative size or a NULL address.");

PyObject *cf_py_shm_memcpy(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    void *dst, *src;
    int64_t nbytes, max_threads;
    cf_err err;
    cf_status st;
    const cf_py_arg table[] = {{"dst_addr", CF_PY_ADDR, &dst},
                               {"src_addr", CF_PY_ADDR, &src},
                               {"nbytes", CF_PY_I64, &nbytes},
                               {"max_threads", CF_PY_I64, &max_threads}};

    (void)module;
    cf_err_init(&err);
    if (cf_py_parse("shm_memcpy", args, nargs, table, CF_PY_COUNT(table)) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    st = cf_shm_memcpy(dst, src, nbytes, max_threads, &err);
    Py_END_ALLOW_THREADS
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

CF_PY_DOC(shm_segment_bytes,
"shm_segment_bytes($module, world_size, slot_bytes, /)\n"
"--\n"
"\n"
"Bytes of a segment for world_size ranks with slot halves of slot_bytes\n"
"(0 if out of range).");

PyObject *cf_py_shm_segment_bytes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t w, s;
    const cf_py_arg table[] = {{"world_size", CF_PY_I64, &w}, {"slot_bytes", CF_PY_I64, &s}};
    (void)module;
    if (cf_py_parse("shm_segment_bytes", args, nargs, table, CF_PY_COUNT(table)) < 0)
        return NULL;
    return PyLong_FromSize_t(cf_shm_segment_bytes(w, s));
}

/* ------------------------------------------------------------------ types */

/* One rank's view.  `g` is set to NULL (under the GIL) when it is closed, so no new
 * call starts on it; a call that uses g with the GIL released (wait_attached) counts
 * itself in `busy`, and the shutdown aborts it and waits for it before unmapping. */
typedef struct {
    PyObject_HEAD
    cf_shm_group *g; /* NULL once closed */
    cf_queue *q;     /* freed with the object (ShmWork objects hold the group) */
    _Atomic int busy;     /* a wait_attached in flight (at most one) */
    _Atomic int watching; /* failure() calls in flight */
} cf_py_shm_group;

/* A queued op.  It holds what the worker reads until the op is done: the tensors
 * (`keep`) and its own copy of the chunk plan.  Several threads may wait() on it at
 * once; the last one to return (`waiters`, under the GIL) releases the op. */
typedef struct {
    PyObject_HEAD
    cf_py_shm_group *group; /* keeps the queue alive */
    cf_queue_op *op;        /* NULL once released */
    PyObject *keep;         /* the tensors, until the op is done */
    cf_chunk_param *plan;   /* the op's plan (NULL: none), until the op is done */
    int64_t *counts;        /* all_to_all's counts (NULL: none), until the op is done */
    PyObject *error;        /* the op's message (str) once it failed */
    int waiters;
    int op_code;
} cf_py_shm_work;

/* Stop the worker (the running op fails with "group closed") and unmap. */
static void cf_py_shm_group_shutdown(cf_py_shm_group *self)
{
    cf_shm_group *g = self->g;
    if (g == NULL)
        return;
    self->g = NULL;
    Py_BEGIN_ALLOW_THREADS
    cf_shm_group_abort(g); /* a wait_attached or failure() in flight returns at once... */
    while (atomic_load(&self->busy) > 0 || atomic_load(&self->watching) > 0)
        sched_yield(); /* ...and is gone before g is unmapped */
    cf_queue_stop(self->q);
    cf_shm_group_close(g);
    Py_END_ALLOW_THREADS
}

static const cf_py_rows_spec cf_py_granks_spec = {
    "global_ranks must be a sequence of ints", NULL, NULL, NULL, 1, {{"global rank", false}}};

/* ShmGroup(name, create, world_size, rank, slot_bytes, timeout_s, label, global_ranks),
 * keywords accepted: open the view (cf_shm_group_open) and start its queue. */
static PyObject *cf_py_shm_group_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"name",       "create",    "world_size", "rank", "slot_bytes",
                             "timeout_s",  "label",     "global_ranks", NULL};
    const char *name, *label;
    int create;
    long long world, rank, slot;
    double timeout_s;
    PyObject *granks_obj;
    int64_t *granks;
    size_t n_granks;
    char qlabel[128];
    cf_py_shm_group *self = NULL;
    cf_shm_group *g = NULL;
    cf_queue *q = NULL;
    cf_err err;
    cf_status st;

    cf_err_init(&err);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "spLLLdsO:ShmGroup", kwlist, &name, &create,
                                     &world, &rank, &slot, &timeout_s, &label, &granks_obj))
        return NULL;
    if (world < 1 || world > CF_SHM_MAX_WORLD) {
        PyErr_Format(PyExc_ValueError, "world_size must be in [1, %d], got %lld",
                     CF_SHM_MAX_WORLD, world);
        return NULL;
    }
    if (cf_py_rows(granks_obj, &cf_py_granks_spec, &granks, &n_granks) < 0)
        return NULL;
    if (n_granks != (size_t)world) {
        PyErr_Format(PyExc_ValueError, "global_ranks has %zu entries, expected world_size %lld",
                     n_granks, world);
        free(granks);
        return NULL;
    }

    snprintf(qlabel, sizeof qlabel, "cfsdp shm group '%s'", label);
    Py_BEGIN_ALLOW_THREADS
    st = cf_shm_group_open(name, create != 0, world, rank, slot, timeout_s, label, granks, &g,
                           &err);
    if (st == CF_OK) {
        st = cf_queue_create(cf_shm_run_queued, g, qlabel, &q, &err);
        if (st != CF_OK)
            cf_shm_group_close(g);
    }
    Py_END_ALLOW_THREADS
    free(granks); /* cf_shm_group_open copied them */
    if (st != CF_OK)
        return cf_py_raise(&err);
    self = (cf_py_shm_group *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_BEGIN_ALLOW_THREADS
        cf_queue_free(q);
        cf_shm_group_close(g);
        Py_END_ALLOW_THREADS
        return NULL;
    }
    self->g = g;
    self->q = q;
    atomic_init(&self->busy, 0);
    atomic_init(&self->watching, 0);
    return (PyObject *)self;
}

/* Close the view (as close()) and free its queue. */
static void cf_py_shm_group_dealloc(PyObject *obj)
{
    cf_py_shm_group *self = (cf_py_shm_group *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    cf_py_shm_group_shutdown(self);
    if (self->q != NULL) {
        Py_BEGIN_ALLOW_THREADS
        cf_queue_free(self->q);
        Py_END_ALLOW_THREADS
    }
    tp->tp_free(obj);
    Py_DECREF(tp);
}

/* The group, or NULL with RuntimeError if it was closed. */
static cf_shm_group *cf_py_shm_open_group(cf_py_shm_group *self)
{
    if (self->g == NULL)
        PyErr_SetString(PyExc_RuntimeError, "cfsdp shm: the group is closed");
    return self->g;
}

PyDoc_STRVAR(cf_py_shm_group_wait_attached_doc,
"wait_attached($self, /)\n"
"--\n"
"\n"
"Block (GIL released) until every rank has attached, then unlink the\n"
"segment's name.  RuntimeError after the timeout, if the group is closed\n"
"meanwhile, or if another thread is already waiting on this view.");

static PyObject *cf_py_shm_group_wait_attached(PyObject *obj, PyObject *unused)
{
    cf_py_shm_group *self = (cf_py_shm_group *)obj;
    cf_shm_group *g = cf_py_shm_open_group(self);
    cf_err err;
    cf_status st;
    (void)unused;
    if (g == NULL)
        return NULL;
    if (atomic_fetch_add(&self->busy, 1) > 0) {
        atomic_fetch_sub(&self->busy, 1);
        PyErr_SetString(PyExc_RuntimeError,
                        "cfsdp shm: wait_attached() is already running in another thread");
        return NULL;
    }
    cf_err_init(&err);
    Py_BEGIN_ALLOW_THREADS
    st = cf_shm_group_wait_attached(g, &err);
    atomic_fetch_sub(&self->busy, 1); /* before the GIL: close() may be waiting for it */
    Py_END_ALLOW_THREADS
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

/* One collective method call: what its argument table stores into.  `src` is
 * a->src's (a const pointer in cf_shm_args); `plan` stays NULL for a method
 * without a plan argument. */
typedef struct {
    cf_shm_args a;
    void *src;
    PyObject *plan, *keep;
} cf_py_shm_call;

/* A call of collective `op` with every optional field at its default (no root,
 * scale 1, no plan, no pre-divide); the method's table fills in the rest. */
static void cf_py_shm_call_init(cf_py_shm_call *c, int op)
{
    memset(c, 0, sizeof *c);
    c->a.op = op;
    c->a.dtype = c->a.natural_dtype = -1;
    c->a.scale = c->a.divisor = 1.0;
}

/* Validate and queue one collective; a new ShmWork.  Takes a->plan and a->counts
 * (malloc'd by cf_py_shm_plan / cf_py_shm_counts, or NULL): the work frees them once
 * the op is done, or they are freed here if nothing is queued. */
static PyObject *cf_py_shm_enqueue(cf_py_shm_group *self, cf_shm_args *a, PyObject *keep)
{
    cf_shm_group *g = cf_py_shm_open_group(self);
    cf_py_state *state = PyType_GetModuleState(Py_TYPE(self));
    cf_chunk_param *plan = (cf_chunk_param *)a->plan;
    int64_t *counts = (int64_t *)a->counts;
    cf_py_shm_work *w = NULL;
    PyTypeObject *wt;
    cf_queue_op *op;
    cf_err err;
    cf_err_init(&err);
    if (g == NULL || state == NULL)
        goto fail;
    if (cf_shm_check(g, a, &err) != CF_OK) {
        cf_py_raise(&err);
        goto fail;
    }
    wt = (PyTypeObject *)state->shm_work_type;
    w = (cf_py_shm_work *)wt->tp_alloc(wt, 0);
    if (w == NULL)
        goto fail;
    if (cf_queue_submit(self->q, a, sizeof *a, &op, &err) != CF_OK) {
        cf_py_raise(&err);
        goto fail;
    }
    Py_INCREF(self);
    w->group = self;
    w->op = op;
    w->keep = Py_NewRef(keep);
    w->plan = plan;
    w->counts = counts;
    w->error = NULL;
    w->waiters = 0;
    w->op_code = a->op;
    return (PyObject *)w;

fail:
    Py_XDECREF(w); /* its group is NULL: nothing of an op to release */
    free(plan);
    free(counts);
    return NULL;
}

/* A plan argument (bytes of int64 quintuples, cf_chunk_param) copied into a->plan (malloc'd, for
 * cf_py_shm_enqueue to hand to the op's ShmWork: the worker reads the op's own copy,
 * whatever the caller does with the bytes) and a->n_plan; 0 or -1. */
static int cf_py_shm_plan(PyObject *obj, cf_shm_args *a)
{
    Py_ssize_t len;
    cf_chunk_param *copy;
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "plan must be bytes of int64 quintuples, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    len = PyBytes_GET_SIZE(obj);
    if (len % (Py_ssize_t)sizeof(cf_chunk_param) != 0) {
        PyErr_Format(PyExc_ValueError, "plan has %zd bytes, not a multiple of %zu", len,
                     sizeof(cf_chunk_param));
        return -1;
    }
    copy = malloc(len > 0 ? (size_t)len : 1);
    if (copy == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(copy, PyBytes_AS_STRING(obj), (size_t)len);
    a->plan = copy;
    a->n_plan = (int64_t)(len / (Py_ssize_t)sizeof(cf_chunk_param));
    return 0;
}

/* all_to_all's counts argument (bytes of world_size x world_size int64, sender-major)
 * copied into a->counts (malloc'd, as a plan: the worker reads the op's own copy) and
 * their total into a->numel (wrapping: cf_shm_check refuses counts whose sum does not
 * fit, before numel is compared); 0 or -1. */
static int cf_py_shm_counts(PyObject *obj, int64_t world, cf_shm_args *a)
{
    size_t want = (size_t)world * (size_t)world * sizeof(int64_t);
    uint64_t total = 0;
    int64_t *copy;
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "counts must be bytes of int64, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if ((size_t)PyBytes_GET_SIZE(obj) != want) {
        PyErr_Format(PyExc_ValueError,
                     "counts has %zd bytes, expected %zu (%lld x %lld int64, sender-major)",
                     PyBytes_GET_SIZE(obj), want, (long long)world, (long long)world);
        return -1;
    }
    copy = malloc(want);
    if (copy == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(copy, PyBytes_AS_STRING(obj), want);
    for (size_t i = 0; i < (size_t)world * (size_t)world; i++)
        total += (uint64_t)copy[i];
    a->counts = copy;
    a->numel = (int64_t)(total & (uint64_t)INT64_MAX);
    return 0;
}

/* Parse a collective method's arguments with `table` (which stores into *c, set up
 * by cf_py_shm_call_init), copy its plan (last: it allocates) and queue it. */
static PyObject *cf_py_shm_queue(PyObject *obj, const char *fname, cf_py_shm_call *c,
                                 PyObject *const *args, Py_ssize_t nargs,
                                 const cf_py_arg *table, Py_ssize_t n)
{
    if (cf_py_parse(fname, args, nargs, table, n) < 0 ||
        (c->plan != NULL && cf_py_shm_plan(c->plan, &c->a) < 0))
        return NULL;
    c->a.src = c->src;
    return cf_py_shm_enqueue((cf_py_shm_group *)obj, &c->a, c->keep);
}

PyDoc_STRVAR(cf_py_shm_group_all_gather_doc,
"all_gather($self, dst_addr, src_addr, numel, dtype_code, max_threads, keep, /)\n"
"--\n"
"\n"
"Queue an all-gather: every rank's numel elements at src into dst\n"
"(world_size * numel, rank-major).  src may be this rank's block of dst.\n"
"Returns a ShmWork; `keep` is held until the op is done.  ValueError for\n"
"bad arguments (nothing queued).");

static PyObject *cf_py_shm_group_all_gather(PyObject *obj, PyObject *const *args,
                                            Py_ssize_t nargs)
{
    cf_py_shm_call c;
    const cf_py_arg table[] = {{"dst_addr", CF_PY_ADDR, &c.a.dst},
                               {"src_addr", CF_PY_ADDR, &c.src},
                               {"numel", CF_PY_I64, &c.a.numel},
                               {"dtype_code", CF_PY_DTYPE, &c.a.dtype},
                               {"max_threads", CF_PY_I64, &c.a.max_threads},
                               {"keep", CF_PY_OBJ, &c.keep}};
    cf_py_shm_call_init(&c, CF_SHM_ALL_GATHER);
    return cf_py_shm_queue(obj, "all_gather", &c, args, nargs, table, CF_PY_COUNT(table));
}

PyDoc_STRVAR(cf_py_shm_group_all_gather_unpack_doc,
"all_gather_unpack($self, natural_addr, natural_numel, src_addr, numel, dtype_code, plan,\n"
"                  max_threads, keep, /)\n"
"--\n"
"\n"
"Queue an all-gather whose copy-out is chunk_unpack's: every rank's numel\n"
"elements at src land in the natural buffer (natural_numel) by the plan, a\n"
"bytes object of int64 (nat_off, numel, chunk_numel, shard_off, outer) quintuples\n"
"(world_size: the group's, shard_numel: numel).  The rank-major buffer is\n"
"never built.  The op reads its own copy of the plan; `keep` is held until\n"
"the op is done.");

static PyObject *cf_py_shm_group_all_gather_unpack(PyObject *obj, PyObject *const *args,
                                                   Py_ssize_t nargs)
{
    cf_py_shm_call c;
    const cf_py_arg table[] = {{"natural_addr", CF_PY_ADDR, &c.a.dst},
                               {"natural_numel", CF_PY_I64, &c.a.natural_numel},
                               {"src_addr", CF_PY_ADDR, &c.src},
                               {"numel", CF_PY_I64, &c.a.numel},
                               {"dtype_code", CF_PY_DTYPE, &c.a.dtype},
                               {"plan", CF_PY_OBJ, &c.plan},
                               {"max_threads", CF_PY_I64, &c.a.max_threads},
                               {"keep", CF_PY_OBJ, &c.keep}};
    cf_py_shm_call_init(&c, CF_SHM_ALL_GATHER);
    return cf_py_shm_queue(obj, "all_gather_unpack", &c, args, nargs, table,
                           CF_PY_COUNT(table));
}

PyDoc_STRVAR(cf_py_shm_group_reduce_scatter_pack_doc,
"reduce_scatter_pack($self, dst_addr, numel, dtype_code, natural_addr, natural_numel,\n"
"                    natural_dtype_code, divisor, scale, plan, max_threads, keep, /)\n"
"--\n"
"\n"
"Queue a reduce-scatter whose input is chunk_pack's: the natural gradient\n"
"(natural_numel elements) is packed rank-major by the plan (bytes of int64\n"
"quintuples, as all_gather_unpack's), cast to dtype after dividing by divisor,\n"
"piece by piece straight into the shared slots; dst (numel) = scale * sum\n"
"over ranks of this rank's block.  The rank-major buffer is never built.\n"
"The op reads its own copy of the plan; `keep` is held until the op is done.");

static PyObject *cf_py_shm_group_reduce_scatter_pack(PyObject *obj, PyObject *const *args,
                                                     Py_ssize_t nargs)
{
    cf_py_shm_call c;
    const cf_py_arg table[] = {{"dst_addr", CF_PY_ADDR, &c.a.dst},
                               {"numel", CF_PY_I64, &c.a.numel},
                               {"dtype_code", CF_PY_DTYPE, &c.a.dtype},
                               {"natural_addr", CF_PY_ADDR, &c.src},
                               {"natural_numel", CF_PY_I64, &c.a.natural_numel},
                               {"natural_dtype_code", CF_PY_DTYPE, &c.a.natural_dtype},
                               {"divisor", CF_PY_F64, &c.a.divisor},
                               {"scale", CF_PY_F64, &c.a.scale},
                               {"plan", CF_PY_OBJ, &c.plan},
                               {"max_threads", CF_PY_I64, &c.a.max_threads},
                               {"keep", CF_PY_OBJ, &c.keep}};
    cf_py_shm_call_init(&c, CF_SHM_REDUCE_SCATTER);
    return cf_py_shm_queue(obj, "reduce_scatter_pack", &c, args, nargs, table,
                           CF_PY_COUNT(table));
}

PyDoc_STRVAR(cf_py_shm_group_reduce_scatter_doc,
"reduce_scatter($self, dst_addr, src_addr, numel, dtype_code, scale, max_threads, keep, /)\n"
"--\n"
"\n"
"Queue a reduce-scatter: dst (numel) = scale * sum over ranks of block\n"
"`rank` of src (world_size * numel), summed as shm_reduce in rank order.\n"
"Returns a ShmWork.");

/* reduce_scatter / all_reduce: (dst, src, numel, dtype, scale, max_threads, keep). */
static PyObject *cf_py_shm_group_reduction(PyObject *obj, PyObject *const *args,
                                           Py_ssize_t nargs, int op)
{
    cf_py_shm_call c;
    const cf_py_arg table[] = {{"dst_addr", CF_PY_ADDR, &c.a.dst},
                               {"src_addr", CF_PY_ADDR, &c.src},
                               {"numel", CF_PY_I64, &c.a.numel},
                               {"dtype_code", CF_PY_DTYPE, &c.a.dtype},
                               {"scale", CF_PY_F64, &c.a.scale},
                               {"max_threads", CF_PY_I64, &c.a.max_threads},
                               {"keep", CF_PY_OBJ, &c.keep}};
    cf_py_shm_call_init(&c, op);
    return cf_py_shm_queue(obj, cf_shm_op_name(op), &c, args, nargs, table, CF_PY_COUNT(table));
}

static PyObject *cf_py_shm_group_reduce_scatter(PyObject *obj, PyObject *const *args,
                                                Py_ssize_t nargs)
{
    return cf_py_shm_group_reduction(obj, args, nargs, CF_SHM_REDUCE_SCATTER);
}

PyDoc_STRVAR(cf_py_shm_group_all_reduce_doc,
"all_reduce($self, dst_addr, src_addr, numel, dtype_code, scale, max_threads, keep, /)\n"
"--\n"
"\n"
"Queue an all-reduce: dst = scale * sum over ranks of src (numel each),\n"
"the same bits on every rank; dst may be src (in place).  Returns a ShmWork.");

static PyObject *cf_py_shm_group_all_reduce(PyObject *obj, PyObject *const *args,
                                            Py_ssize_t nargs)
{
    return cf_py_shm_group_reduction(obj, args, nargs, CF_SHM_ALL_REDUCE);
}

PyDoc_STRVAR(cf_py_shm_group_broadcast_doc,
"broadcast($self, addr, numel, dtype_code, root, max_threads, keep, /)\n"
"--\n"
"\n"
"Queue a broadcast of the buffer (numel) from group rank root.  Returns a\n"
"ShmWork.");

static PyObject *cf_py_shm_group_broadcast(PyObject *obj, PyObject *const *args,
                                           Py_ssize_t nargs)
{
    cf_py_shm_call c;
    const cf_py_arg table[] = {{"addr", CF_PY_ADDR, &c.a.dst},
                               {"numel", CF_PY_I64, &c.a.numel},
                               {"dtype_code", CF_PY_DTYPE, &c.a.dtype},
                               {"root", CF_PY_I64, &c.a.root},
                               {"max_threads", CF_PY_I64, &c.a.max_threads},
                               {"keep", CF_PY_OBJ, &c.keep}};
    cf_py_shm_call_init(&c, CF_SHM_BROADCAST);
    return cf_py_shm_queue(obj, "broadcast", &c, args, nargs, table, CF_PY_COUNT(table));
}

PyDoc_STRVAR(cf_py_shm_group_all_to_all_doc,
"all_to_all($self, dst_addr, src_addr, counts, dtype_code, max_threads, keep, /)\n"
"--\n"
"\n"
"Queue an all-to-all: counts (bytes of world_size x world_size int64,\n"
"sender-major, the same on every rank) says how many elements rank s sends\n"
"rank r.  src holds this rank's blocks for ranks 0, 1, ... back to back; dst\n"
"receives every rank's block for this rank, in rank order (torch's\n"
"all_to_all_single with those splits).  The op reads its own copy of the\n"
"counts; `keep` is held until the op is done.  Returns a ShmWork.");

static PyObject *cf_py_shm_group_all_to_all(PyObject *obj, PyObject *const *args,
                                            Py_ssize_t nargs)
{
    cf_py_shm_call c;
    PyObject *counts = NULL;
    cf_shm_group *g = cf_py_shm_open_group((cf_py_shm_group *)obj);
    const cf_py_arg table[] = {{"dst_addr", CF_PY_ADDR, &c.a.dst},
                               {"src_addr", CF_PY_ADDR, &c.src},
                               {"counts", CF_PY_OBJ, &counts},
                               {"dtype_code", CF_PY_DTYPE, &c.a.dtype},
                               {"max_threads", CF_PY_I64, &c.a.max_threads},
                               {"keep", CF_PY_OBJ, &c.keep}};
    if (g == NULL)
        return NULL;
    cf_py_shm_call_init(&c, CF_SHM_ALL_TO_ALL);
    if (cf_py_parse("all_to_all", args, nargs, table, CF_PY_COUNT(table)) < 0 ||
        cf_py_shm_counts(counts, cf_shm_group_world_size(g), &c.a) < 0)
        return NULL;
    c.a.src = c.src;
    return cf_py_shm_enqueue((cf_py_shm_group *)obj, &c.a, c.keep);
}

PyDoc_STRVAR(cf_py_shm_group_drain_doc,
"drain($self, /)\n"
"--\n"
"\n"
"Block (GIL released) until every op queued so far is done.");

static PyObject *cf_py_shm_group_drain(PyObject *obj, PyObject *unused)
{
    cf_py_shm_group *self = (cf_py_shm_group *)obj;
    (void)unused;
    if (self->g != NULL) {
        Py_BEGIN_ALLOW_THREADS
        cf_queue_drain(self->q);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cf_py_shm_group_fail_doc,
"fail($self, message, /)\n"
"--\n"
"\n"
"Fail this rank on the segment from outside a collective: wait (GIL\n"
"released) until the ops queued so far are done, then record `message` as\n"
"this rank's failure and wake every rank, so their current or next\n"
"collective fails at once naming this rank and the message; this view's\n"
"later collectives fail too.  For a caller that failed in another part of a\n"
"larger collective (comm.py's two-level collectives).  A no-op once closed.\n"
"See cf_shm_group_fail in csrc/shm.h.");

static PyObject *cf_py_shm_group_fail(PyObject *obj, PyObject *arg)
{
    cf_py_shm_group *self = (cf_py_shm_group *)obj;
    const char *msg;
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "message must be str, not %.100s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    msg = PyUnicode_AsUTF8(arg);
    if (msg == NULL)
        return NULL;
    if (self->g == NULL)
        Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    cf_queue_drain(self->q); /* q lives as long as self */
    Py_END_ALLOW_THREADS
    /* with the GIL: a close() meanwhile set g to NULL before unmapping it */
    if (self->g != NULL)
        cf_shm_group_fail(self->g, msg); /* a CAS and some wake-ups: no need to drop the GIL */
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cf_py_shm_group_failure_doc,
"failure($self, timeout_s, /)\n"
"--\n"
"\n"
"Block up to timeout_s seconds (GIL released; 0: just look) until some rank\n"
"of the segment has failed, and return 'rank R (global rank G) of cfsdp shm\n"
"group ... failed: <its message>'; None on timeout, once the view is closed\n"
"(also by a close() meanwhile), or if no rank failed.  For a thread that\n"
"waits on something else than the segment (the two-level lane's process-\n"
"group waits) and must learn that this host's segment failed.  See\n"
"cf_shm_group_wait_failure in csrc/shm.h.");

static PyObject *cf_py_shm_group_failure(PyObject *obj, PyObject *arg)
{
    cf_py_shm_group *self = (cf_py_shm_group *)obj;
    char msg[CF_ERR_MSG_LEN + 160];
    double timeout_s = PyFloat_AsDouble(arg);
    cf_shm_group *g;
    bool failed = false;
    if (timeout_s == -1.0 && PyErr_Occurred())
        return NULL;
    if (!(timeout_s >= 0.0) || timeout_s > 1e6) { /* NaN too */
        PyErr_Format(PyExc_ValueError, "timeout_s must be in [0, 1e6] seconds, got %R", arg);
        return NULL;
    }
    g = self->g; /* close() sets self->g to NULL, then waits for `watching` */
    if (g == NULL)
        Py_RETURN_NONE;
    atomic_fetch_add(&self->watching, 1);
    Py_BEGIN_ALLOW_THREADS
    failed = cf_shm_group_wait_failure(g, timeout_s, msg, sizeof msg);
    atomic_fetch_sub(&self->watching, 1); /* before the GIL: close() may be waiting for it */
    Py_END_ALLOW_THREADS
    if (!failed)
        Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace");
}

PyDoc_STRVAR(cf_py_shm_group_close_doc,
"close($self, /)\n"
"--\n"
"\n"
"Stop the worker thread and unmap the segment.  Ops not yet started fail\n"
"with 'closed before the op ran', a running one with 'the group was closed'\n"
"(and the other ranks' current collective fails naming this rank).  Wait\n"
"on the handles first for a clean shutdown.  Idempotent; also done when\n"
"the object is deallocated.");

static PyObject *cf_py_shm_group_close(PyObject *obj, PyObject *unused)
{
    (void)unused;
    cf_py_shm_group_shutdown((cf_py_shm_group *)obj);
    Py_RETURN_NONE;
}

/* The attributes: closed (a bool), and rank, world_size, nbytes of an open view
 * (RuntimeError once closed). */
static PyObject *cf_py_shm_group_get_closed(PyObject *obj, void *closure)
{
    (void)closure;
    return PyBool_FromLong(((cf_py_shm_group *)obj)->g == NULL);
}

static PyObject *cf_py_shm_group_get_rank(PyObject *obj, void *closure)
{
    cf_shm_group *g = cf_py_shm_open_group((cf_py_shm_group *)obj);
    (void)closure;
    return g ? PyLong_FromLongLong((long long)cf_shm_group_rank(g)) : NULL;
}

static PyObject *cf_py_shm_group_get_world_size(PyObject *obj, void *closure)
{
    cf_shm_group *g = cf_py_shm_open_group((cf_py_shm_group *)obj);
    (void)closure;
    return g ? PyLong_FromLongLong((long long)cf_shm_group_world_size(g)) : NULL;
}

static PyObject *cf_py_shm_group_get_nbytes(PyObject *obj, void *closure)
{
    cf_shm_group *g = cf_py_shm_open_group((cf_py_shm_group *)obj);
    (void)closure;
    return g ? PyLong_FromSize_t(cf_shm_group_bytes(g)) : NULL;
}

static PyMethodDef cf_py_shm_group_methods[] = {
    {"wait_attached", cf_py_shm_group_wait_attached, METH_NOARGS,
     cf_py_shm_group_wait_attached_doc},
    {"all_gather", (PyCFunction)(void (*)(void))cf_py_shm_group_all_gather, METH_FASTCALL,
     cf_py_shm_group_all_gather_doc},
    {"all_gather_unpack", (PyCFunction)(void (*)(void))cf_py_shm_group_all_gather_unpack,
     METH_FASTCALL, cf_py_shm_group_all_gather_unpack_doc},
    {"reduce_scatter_pack", (PyCFunction)(void (*)(void))cf_py_shm_group_reduce_scatter_pack,
     METH_FASTCALL, cf_py_shm_group_reduce_scatter_pack_doc},
    {"reduce_scatter", (PyCFunction)(void (*)(void))cf_py_shm_group_reduce_scatter,
     METH_FASTCALL, cf_py_shm_group_reduce_scatter_doc},
    {"all_reduce", (PyCFunction)(void (*)(void))cf_py_shm_group_all_reduce, METH_FASTCALL,
     cf_py_shm_group_all_reduce_doc},
    {"broadcast", (PyCFunction)(void (*)(void))cf_py_shm_group_broadcast, METH_FASTCALL,
     cf_py_shm_group_broadcast_doc},
    {"all_to_all", (PyCFunction)(void (*)(void))cf_py_shm_group_all_to_all, METH_FASTCALL,
     cf_py_shm_group_all_to_all_doc},
    {"drain", cf_py_shm_group_drain, METH_NOARGS, cf_py_shm_group_drain_doc},
    {"fail", cf_py_shm_group_fail, METH_O, cf_py_shm_group_fail_doc},
    {"failure", cf_py_shm_group_failure, METH_O, cf_py_shm_group_failure_doc},
    {"close", cf_py_shm_group_close, METH_NOARGS, cf_py_shm_group_close_doc},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef cf_py_shm_group_getset[] = {
    {"closed", cf_py_shm_group_get_closed, NULL, "True once close() ran.", NULL},
    {"rank", cf_py_shm_group_get_rank, NULL, "This view's rank in the group.", NULL},
    {"world_size", cf_py_shm_group_get_world_size, NULL, "Ranks of the group.", NULL},
    {"nbytes", cf_py_shm_group_get_nbytes, NULL, "Bytes of the mapped segment.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyDoc_STRVAR(cf_py_shm_group_doc,
"ShmGroup(name, create, world_size, rank, slot_bytes, timeout_s, label, global_ranks)\n"
"--\n"
"\n"
"One rank's view of a shared-memory segment and its ordered work queue\n"
"(one worker thread).  create=True (rank 0) creates the POSIX shm segment\n"
"`name` (O_EXCL); the others attach to it; then every rank calls\n"
"wait_attached(), which unlinks the name.  Collectives (all_gather,\n"
"reduce_scatter, all_reduce, broadcast, all_to_all) are queued and run in order on the\n"
"worker with no GIL; each returns a ShmWork.  One process may open the\n"
"same segment as several ranks.  After a failed op the group is poisoned.\n"
"Every wait is bounded by timeout_s; errors name `label` and the ranks\n"
"(global_ranks[group rank]).  See csrc/shm.h.");

static PyType_Slot cf_py_shm_group_slots[] = {
    {Py_tp_new, cf_py_shm_group_new},
    {Py_tp_dealloc, cf_py_shm_group_dealloc},
    {Py_tp_methods, cf_py_shm_group_methods},
    {Py_tp_getset, cf_py_shm_group_getset},
    {Py_tp_doc, (void *)cf_py_shm_group_doc},
    {0, NULL}};

static PyType_Spec cf_py_shm_group_spec = {
    .name = "cfsdp._C.ShmGroup",
    .basicsize = sizeof(cf_py_shm_group),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = cf_py_shm_group_slots,
};

/* Drop the op reference, the plan and the kept objects once the op is done. */
static void cf_py_shm_work_release(cf_py_shm_work *self)
{
    if (self->op != NULL) {
        cf_queue_op_release(self->group->q, self->op);
        self->op = NULL;
    }
    free(self->plan);
    self->plan = NULL;
    free(self->counts);
    self->counts = NULL;
    Py_CLEAR(self->keep);
}

PyDoc_STRVAR(cf_py_shm_work_wait_doc,
"wait($self, /)\n"
"--\n"
"\n"
"Block (GIL released, sleeping, not spinning) until the collective is done.\n"
"RuntimeError with the op's message if it failed (a timeout naming the\n"
"ranks that did not arrive, a peer's failure, a poisoned or closed group);\n"
"raised again by every later wait().  Several threads may wait at once.\n"
"Returns None.");

static PyObject *cf_py_shm_work_wait(PyObject *obj, PyObject *unused)
{
    cf_py_shm_work *self = (cf_py_shm_work *)obj;
    cf_queue_op *op = self->op;
    cf_err err;
    cf_status st = CF_OK;
    (void)unused;
    cf_err_init(&err);
    if (op != NULL) {
        self->waiters++; /* the op stays until every waiter is back */
        Py_BEGIN_ALLOW_THREADS
        st = cf_queue_wait(self->group->q, op, &err);
        Py_END_ALLOW_THREADS
        self->waiters--;
        if (st != CF_OK && self->error == NULL) /* kept for later waits */
            self->error = PyUnicode_FromString(err.msg);
        if (self->waiters == 0)
            cf_py_shm_work_release(self);
        if (st != CF_OK && self->error == NULL)
            return NULL; /* the message could not be kept */
    }
    if (self->error != NULL) {
        PyErr_SetObject(PyExc_RuntimeError, self->error);
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cf_py_shm_work_is_completed_doc,
"is_completed($self, /)\n"
"--\n"
"\n"
"True once the collective has finished (successfully or not); never blocks.");

static PyObject *cf_py_shm_work_is_completed(PyObject *obj, PyObject *unused)
{
    cf_py_shm_work *self = (cf_py_shm_work *)obj;
    (void)unused;
    return PyBool_FromLong(self->op == NULL || cf_queue_op_done(self->op));
}

/* The attribute op: the collective's name. */
static PyObject *cf_py_shm_work_get_op(PyObject *obj, void *closure)
{
    (void)closure;
    return PyUnicode_FromString(cf_shm_op_name(((cf_py_shm_work *)obj)->op_code));
}

/* Wait for the op if it is still running (it reads and writes the kept tensors), then
 * release it and drop the group. */
static void cf_py_shm_work_dealloc(PyObject *obj)
{
    cf_py_shm_work *self = (cf_py_shm_work *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    if (self->op != NULL && !cf_queue_op_done(self->op)) {
        /* the op still reads/writes the kept tensors: let it finish first */
        cf_err err;
        Py_BEGIN_ALLOW_THREADS
        cf_queue_wait(self->group->q, self->op, &err);
        Py_END_ALLOW_THREADS
    }
    cf_py_shm_work_release(self);
    Py_XDECREF(self->error);
    Py_XDECREF(self->group);
    tp->tp_free(obj);
    Py_DECREF(tp);
}

static PyMethodDef cf_py_shm_work_methods[] = {
    {"wait", cf_py_shm_work_wait, METH_NOARGS, cf_py_shm_work_wait_doc},
    {"is_completed", cf_py_shm_work_is_completed, METH_NOARGS, cf_py_shm_work_is_completed_doc},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef cf_py_shm_work_getset[] = {
    {"op", cf_py_shm_work_get_op, NULL, "The collective's name.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyDoc_STRVAR(cf_py_shm_work_doc,
"A collective queued on a ShmGroup (from its all_gather, ... methods).\n"
"Dropping it before completion blocks until the op is done (it uses the\n"
"tensors it keeps alive).");

static PyType_Slot cf_py_shm_work_slots[] = {
    {Py_tp_dealloc, cf_py_shm_work_dealloc},
    {Py_tp_methods, cf_py_shm_work_methods},
    {Py_tp_getset, cf_py_shm_work_getset},
    {Py_tp_doc, (void *)cf_py_shm_work_doc},
    {0, NULL}};

static PyType_Spec cf_py_shm_work_spec = {
    .name = "cfsdp._C.ShmWork",
    .basicsize = sizeof(cf_py_shm_work),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = cf_py_shm_work_slots,
};

/* Make the type of `spec` for module `m`, store it in *slot (the module state's
 * reference) and add it to the module as `name`.  0 or -1. */
static int cf_py_add_type(PyObject *m, PyType_Spec *spec, const char *name, PyObject **slot)
{
    PyObject *type = PyType_FromModuleAndSpec(m, spec, NULL);
    if (type == NULL)
        return -1;
    *slot = type;
    return PyModule_AddObjectRef(m, name, type);
}

/* ------------------------------------------------------------ ShmSegment */

/* A mapping made by cf_shm_map_file; unmapped when the object dies.  Its memory is
 * lent through the buffer protocol, and whoever keeps it past a PyBuffer_Release
 * (torch.frombuffer) keeps a reference to the object instead, so the mapping lives as
 * long as any view of it. */
typedef struct {
    PyObject_HEAD
    void *base;
    size_t bytes;
    PyObject *path; /* str */
} cf_py_shm_segment;

static PyObject *cf_py_shm_segment_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"path", "create", "nbytes", NULL};
    PyObject *path_obj;
    const char *path;
    Py_ssize_t path_len;
    int create;
    long long nbytes;
    void *base = NULL;
    cf_py_shm_segment *self;
    cf_err err;
    cf_status st;

    cf_err_init(&err);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "UpL:ShmSegment", kwlist, &path_obj, &create,
                                     &nbytes))
        return NULL;
    if (nbytes < 1) {
        PyErr_Format(PyExc_ValueError, "nbytes must be positive, got %lld", nbytes);
        return NULL;
    }
    path = PyUnicode_AsUTF8AndSize(path_obj, &path_len);
    if (path == NULL)
        return NULL;
    if (strlen(path) != (size_t)path_len) {
        PyErr_SetString(PyExc_ValueError, "path must not contain a NUL character");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    st = cf_shm_map_file(path, create != 0, (size_t)nbytes, &base, &err);
    Py_END_ALLOW_THREADS
    if (st != CF_OK)
        return cf_py_raise(&err);
    self = (cf_py_shm_segment *)type->tp_alloc(type, 0);
    if (self == NULL) {
        munmap(base, (size_t)nbytes);
        return NULL;
    }
    self->base = base;
    self->bytes = (size_t)nbytes;
    Py_INCREF(path_obj);
    self->path = path_obj;
    return (PyObject *)self;
}

static void cf_py_shm_segment_dealloc(PyObject *obj)
{
    cf_py_shm_segment *self = (cf_py_shm_segment *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    if (self->base != NULL)
        munmap(self->base, self->bytes);
    Py_XDECREF(self->path);
    tp->tp_free(obj);
    Py_DECREF(tp);
}

static int cf_py_shm_segment_getbuffer(PyObject *obj, Py_buffer *view, int flags)
{
    cf_py_shm_segment *self = (cf_py_shm_segment *)obj;
    return PyBuffer_FillInfo(view, obj, self->base, (Py_ssize_t)self->bytes, 0, flags);
}

PyDoc_STRVAR(cf_py_shm_segment_unlink_doc,
"unlink($self, /)\n"
"--\n"
"\n"
"Remove the segment's name (the mapping stays valid): None, also if the\n"
"name is already gone; RuntimeError naming the path for another failure.");

static PyObject *cf_py_shm_segment_unlink(PyObject *obj, PyObject *unused)
{
    cf_py_shm_segment *self = (cf_py_shm_segment *)obj;
    const char *path = PyUnicode_AsUTF8(self->path);
    int rc, e = 0;
    (void)unused;
    if (path == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = unlink(path);
    if (rc != 0)
        e = errno;
    Py_END_ALLOW_THREADS
    if (rc != 0 && e != ENOENT)
        return PyErr_Format(PyExc_RuntimeError, "cfsdp shm: unlink(\"%s\") failed: %s (errno %d)",
                            path, strerror(e), e);
    Py_RETURN_NONE;
}

static PyObject *cf_py_shm_segment_get_nbytes(PyObject *obj, void *closure)
{
    (void)closure;
    return PyLong_FromSize_t(((cf_py_shm_segment *)obj)->bytes);
}

static PyObject *cf_py_shm_segment_get_path(PyObject *obj, void *closure)
{
    (void)closure;
    return Py_NewRef(((cf_py_shm_segment *)obj)->path);
}

static PyMethodDef cf_py_shm_segment_methods[] = {
    {"unlink", cf_py_shm_segment_unlink, METH_NOARGS, cf_py_shm_segment_unlink_doc},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef cf_py_shm_segment_getset[] = {
    {"nbytes", cf_py_shm_segment_get_nbytes, NULL, "Bytes of the mapping.", NULL},
    {"path", cf_py_shm_segment_get_path, NULL, "The file it maps (its name may be gone).", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyDoc_STRVAR(cf_py_shm_segment_doc,
"ShmSegment(path, create, nbytes)\n"
"--\n"
"\n"
"A host-shared segment: the file `path` mapped MAP_SHARED, read-write,\n"
"nbytes long, lent through the buffer protocol (torch.frombuffer(seg,\n"
"dtype=torch.uint8)); unmapped when the last reference dies.  create=True\n"
"makes the file (O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600, its pages\n"
"reserved); create=False attaches to it (O_NOFOLLOW, never creating it) and\n"
"requires exactly nbytes.  Either way the file is refused unless it is a\n"
"regular file of this process's effective uid with no group or other\n"
"permission bits (PermissionError naming its path, type, owner and mode, a\n"
"symbolic link too), before it is sized or mapped.  ValueError for\n"
"nbytes < 1 or a size that does not match; RuntimeError naming the system\n"
"call, path and errno otherwise.  See cf_shm_map_file in csrc/shm.h; twin:\n"
"cfsdp._ref.ShmSegment.");

static PyType_Slot cf_py_shm_segment_slots[] = {
    {Py_tp_new, cf_py_shm_segment_new},
    {Py_tp_dealloc, cf_py_shm_segment_dealloc},
    {Py_tp_methods, cf_py_shm_segment_methods},
    {Py_tp_getset, cf_py_shm_segment_getset},
    {Py_tp_doc, (void *)cf_py_shm_segment_doc},
    {Py_bf_getbuffer, cf_py_shm_segment_getbuffer},
    {0, NULL}};

static PyType_Spec cf_py_shm_segment_spec = {
    .name = "cfsdp._C.ShmSegment",
    .basicsize = sizeof(cf_py_shm_segment),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = cf_py_shm_segment_slots,
};

int cf_py_shm_exec(PyObject *m, cf_py_state *state)
{
    if (cf_py_add_type(m, &cf_py_shm_work_spec, "ShmWork", &state->shm_work_type) < 0 ||
        cf_py_add_type(m, &cf_py_shm_group_spec, "ShmGroup", &state->shm_group_type) < 0 ||
        cf_py_add_type(m, &cf_py_shm_segment_spec, "ShmSegment", &state->shm_segment_type) < 0)
        return -1;
    if (PyModule_AddIntConstant(m, "SHM_OP_ALL_GATHER", CF_SHM_ALL_GATHER) < 0 ||
        PyModule_AddIntConstant(m, "SHM_OP_REDUCE_SCATTER", CF_SHM_REDUCE_SCATTER) < 0 ||
        PyModule_AddIntConstant(m, "SHM_OP_ALL_REDUCE", CF_SHM_ALL_REDUCE) < 0 ||
        PyModule_AddIntConstant(m, "SHM_OP_BROADCAST", CF_SHM_BROADCAST) < 0 ||
        PyModule_AddIntConstant(m, "SHM_OP_ALL_TO_ALL", CF_SHM_ALL_TO_ALL) < 0 ||
        PyModule_AddIntConstant(m, "SHM_MAX_WORLD", CF_SHM_MAX_WORLD) < 0 ||
        PyModule_AddIntConstant(m, "SHM_MIN_SLOT_PER_RANK", CF_SHM_MIN_SLOT_PER_RANK) < 0 ||
#if defined(__linux__) && defined(CF_HAVE_PTHREADS)
        PyModule_AddIntConstant(m, "SHM_AVAILABLE", 1) < 0
#else
        PyModule_AddIntConstant(m, "SHM_AVAILABLE", 0) < 0
#endif
    )
        return -1;
    return 0;
}
