/*
 * module.c -- the Python face of the C core: module cfsdp._C.
 *
 * Design.  This is the only file that includes Python.h.  Each entry point
 * parses its arguments (METH_FASTCALL, positional only) into plain C values
 * and malloc'd index arrays while holding the GIL, releases the GIL around
 * the pure-C work (layout.c, copy.c, chunk.c, reduce.c, norm.c validate,
 * then touch bytes; chunk.c may split a large copy across a few threads, see
 * thread.c), and turns a failing cf_status into a Python exception in one place,
 * cf_py_raise: CF_EINVAL -> ValueError, CF_EOVERFLOW -> OverflowError,
 * CF_ENOMEM -> MemoryError.  Tensors arrive as integer addresses; C never
 * allocates or frees tensor memory and the caller keeps it alive.
 * The module uses multi-phase initialisation (PEP 489) and keeps no state,
 * so it is safe in sub-interpreters and has no mutable globals.
 *
 * The boundary's contract (tests/unit/test_fuzz_c.py holds every entry point
 * to it).  An address and the numel that says how long its buffer is are
 * *promised*: C cannot check them, and trusts them once they are ints in
 * range (an address is an int, no __index__, in [0, 2**63); NULL only with
 * nothing to touch).  Every other argument is *checked*, whatever it is:
 * codes, plans, ranges' order, offsets, ranks, world sizes and the sizes that
 * bound allocations (cfsdp.h's CF_MAX_*), scales, flags, types.  Converting
 * an argument may run Python code (an __index__), so nothing is read from a
 * Python object after code ran that could change it: sequences are read
 * through a snapshot (cf_py_rows), and what a queued shared-memory op reads
 * is owned by its ShmWork (its copy of the plan) until the op is done.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cfsdp.h"
#include "chunk.h"
#include "copy.h"
#include "layout.h"
#include "norm.h"
#include "queue.h"
#include "optim.h"
#include "reduce.h"
#include "shm.h"
#include "thread.h"

/* Raise the Python exception for a failed status; always returns NULL. */
static PyObject *cf_py_raise(const cf_err *err)
{
    PyObject *type;
    switch (err->status) {
    case CF_EINVAL: type = PyExc_ValueError; break;
    case CF_EOVERFLOW: type = PyExc_OverflowError; break;
    case CF_ENOMEM: type = PyExc_MemoryError; break;
    default: type = PyExc_SystemError; break;
    }
    PyErr_SetString(type, err->msg[0] ? err->msg : "cfsdp._C: unknown error");
    return NULL;
}

/* 0 if `nargs == expected`, else -1 with TypeError set. */
static int cf_py_check_nargs(const char *fname, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs == expected)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd positional arguments (%zd given)",
                 fname, expected, nargs);
    return -1;
}

/* Convert an int-like object to int64; 0 on success, -1 with an exception. */
static int cf_py_int64(PyObject *obj, const char *what, int64_t *out)
{
    long long v;
    if (!PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)v;
    return 0;
}

/* Convert an int address (e.g. Tensor.data_ptr()) to a pointer: an int (no
 * __index__: no Python code runs) in [0, 2**63); ValueError for a negative or larger
 * one.  0, or -1 with an exception. */
static int cf_py_addr(PyObject *obj, const char *what, void **out)
{
    long long v;
    int overflow;
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int address, not %.100s", what,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow != 0 || v < 0 || (unsigned long long)v > (unsigned long long)UINTPTR_MAX) {
        PyErr_Format(PyExc_ValueError, "%s must be an address in [0, 2**63), got a %s int",
                     what, overflow > 0 || v >= 0 ? "too large" : "negative");
        return -1;
    }
    *out = (void *)(uintptr_t)v;
    return 0;
}

/*
 * Sequences.  A Python sequence argument is read through a snapshot: a tuple of its
 * items (PySequence_Fast's list is copied), held while the items are converted.
 * Converting an item may run Python code (its __index__), which could otherwise
 * clear or resize the list being read and leave C reading freed slots.
 */

/* The snapshot of `obj`: a new tuple reference, or NULL with TypeError `msg`. */
static PyObject *cf_py_snapshot(PyObject *obj, const char *msg)
{
    PyObject *fast = PySequence_Fast(obj, msg), *tuple;
    if (fast == NULL || PyTuple_CheckExact(fast))
        return fast;
    tuple = PySequence_Tuple(fast);
    Py_DECREF(fast);
    return tuple;
}

/* One column of a row sequence: an int64 (cf_py_int64) or an address (cf_py_addr,
 * stored as its integer value). */
typedef struct {
    const char *name;
    bool addr;
} cf_py_col;

/* How cf_py_rows reads a sequence argument. */
typedef struct {
    const char *seq_msg;  /* TypeError if the argument is not a sequence */
    const char *row_msg;  /* TypeError if a row is not a sequence; NULL: flat (one value a row) */
    const char *row_name; /* ValueError "<row_name> <i> must be <shape>, got <k> items" */
    const char *shape;
    Py_ssize_t width;     /* values a row (1 when flat) */
    cf_py_col cols[4];
} cf_py_rows_spec;

/* Convert one value of column `c` into *out; 0, or -1 with an exception. */
static int cf_py_cell(PyObject *v, const cf_py_col *c, int64_t *out)
{
    void *p;
    if (!c->addr)
        return cf_py_int64(v, c->name, out);
    if (cf_py_addr(v, c->name, &p) < 0)
        return -1;
    *out = (int64_t)(uintptr_t)p;
    return 0;
}

/*
 * Read the sequence argument `obj` as `spec` describes, each row through its own
 * snapshot too, into a malloc'd array of *n x spec->width int64 (row-major) that the
 * caller frees (NULL when *n is 0).  0, or -1 with an exception (and nothing to free).
 */
static int cf_py_rows(PyObject *obj, const cf_py_rows_spec *spec, int64_t **out, size_t *n)
{
    PyObject *seq = cf_py_snapshot(obj, spec->seq_msg);
    Py_ssize_t count, w = spec->width;
    int64_t *v = NULL;

    *out = NULL;
    *n = 0;
    if (seq == NULL)
        return -1;
    count = PyTuple_GET_SIZE(seq);
    if (count > 0) {
        v = malloc((size_t)count * (size_t)w * sizeof *v); /* < the tuple's own size */
        if (v == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i), *row;
        int ok = 1;
        if (spec->row_msg == NULL) {
            if (cf_py_cell(item, &spec->cols[0], &v[i]) < 0)
                goto fail;
            continue;
        }
        row = cf_py_snapshot(item, spec->row_msg);
        if (row == NULL)
            goto fail;
        if (PyTuple_GET_SIZE(row) != w) {
            PyErr_Format(PyExc_ValueError, "%s %zd must be %s, got %zd items", spec->row_name,
                         i, spec->shape, PyTuple_GET_SIZE(row));
            ok = 0;
        }
        for (Py_ssize_t j = 0; ok && j < w; j++)
            ok = cf_py_cell(PyTuple_GET_ITEM(row, j), &spec->cols[j], &v[i * w + j]) == 0;
        Py_DECREF(row);
        if (!ok)
            goto fail;
    }
    Py_DECREF(seq);
    *out = v;
    *n = (size_t)count;
    return 0;

fail:
    Py_DECREF(seq);
    free(v);
    return -1;
}

/* 0 if both are cf_dtype codes, else -1 with ValueError set. */
static int cf_py_check_dtype_codes(int64_t dst_code, int64_t src_code)
{
    cf_err err;
    if (dst_code >= 0 && dst_code < CF_DTYPE_COUNT && src_code >= 0 &&
        src_code < CF_DTYPE_COUNT)
        return 0;
    cf_err_init(&err);
    cf_err_set(&err, CF_EINVAL, "unknown dtype code (dst %lld, src %lld); expected 0..%d",
               (long long)dst_code, (long long)src_code, CF_DTYPE_COUNT - 1);
    cf_py_raise(&err);
    return -1;
}

/* A tuple of Python ints from an int64 array; new reference or NULL. */
static PyObject *cf_py_int_tuple(const int64_t *v, size_t n)
{
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    if (t == NULL)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong((long long)v[i]);
        if (x == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, x);
    }
    return t;
}

PyDoc_STRVAR(cf_py_plan_layout_doc,
"plan_layout($module, numels, align_numel, world_size, /)\n"
"--\n"
"\n"
"Plan a unit's flat layout (torch FSDP1's FlatParameter layout).\n"
"\n"
"Returns (offsets, flat_numel, shard_numel, slices): the flat offset of\n"
"each parameter, the padded flat numel, every rank's shard numel, and a\n"
"flat tuple, rank-major then parameter-major, of triples\n"
"(param_start, numel, shard_offset).  Same result as\n"
"cfsdp._ref.plan_layout_lists.  ValueError for a negative numel,\n"
"align_numel < 0 or world_size < 1; OverflowError if sizes overflow int64.");

static const cf_py_rows_spec cf_py_numels_spec = {
    "numels must be a sequence of ints", NULL, NULL, NULL, 1, {{"numel", false}}};

static PyObject *cf_py_plan_layout(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seq = NULL, *result = NULL, *offsets_t = NULL, *slices_t = NULL;
    int64_t *numels = NULL, *offsets = NULL, *slices = NULL;
    int64_t align_numel, world_size, flat_numel = 0, shard_numel = 0;
    size_t n, n_slices = 0;
    cf_err err;
    cf_status st;

    (void)module;
    cf_err_init(&err);
    if (cf_py_check_nargs("plan_layout", nargs, 3) < 0)
        return NULL;
    if (cf_py_int64(args[1], "align_numel", &align_numel) < 0 ||
        cf_py_int64(args[2], "world_size", &world_size) < 0)
        return NULL;
    /* the sizes are bounded (cf_layout_slices_len) before anything is converted */
    seq = cf_py_snapshot(args[0], cf_py_numels_spec.seq_msg);
    if (seq == NULL)
        return NULL;
    n = (size_t)PyTuple_GET_SIZE(seq);
    CF_CHECK_GOTO(cf_layout_slices_len(n, world_size, &n_slices, &err), st, fail);
    if (cf_py_rows(seq, &cf_py_numels_spec, &numels, &n) < 0)
        goto done;
    offsets = malloc((n ? n : 1) * sizeof *offsets);
    slices = malloc((n_slices ? n_slices : 1) * sizeof *slices); /* <= 3 * CF_MAX_PIECES */
    if (offsets == NULL || slices == NULL) {
        PyErr_NoMemory();
        goto done;
    }

    Py_BEGIN_ALLOW_THREADS
    st = cf_layout_plan(numels, n, align_numel, world_size, offsets, &flat_numel,
                        &shard_numel, slices, &err);
    Py_END_ALLOW_THREADS
    if (st != CF_OK)
        goto fail;

    offsets_t = cf_py_int_tuple(offsets, n);
    if (offsets_t == NULL)
        goto done;
    slices_t = cf_py_int_tuple(slices, n_slices);
    if (slices_t == NULL)
        goto done;
    result = Py_BuildValue("(OLLO)", offsets_t, (long long)flat_numel,
                           (long long)shard_numel, slices_t);
    goto done;

fail:
    cf_py_raise(&err);
done:
    Py_XDECREF(offsets_t);
    Py_XDECREF(slices_t);
    Py_XDECREF(seq);
    free(numels);
    free(offsets);
    free(slices);
    return result;
}

PyDoc_STRVAR(cf_py_shard_fill_doc,
"shard_fill($module, dst_addr, dst_numel, elem_size, shard_start, srcs, /)\n"
"--\n"
"\n"
"Fill one rank's shard from the original tensors, zeroing the padding.\n"
"\n"
"dst holds flat elements [shard_start, shard_start + dst_numel) of the\n"
"unit's flat buffer; srcs is a sequence of (src_addr, src_numel,\n"
"flat_offset).  Element size elem_size bytes, for dst and all sources.\n"
"Same bytes as cfsdp._ref.shard_fill.  Runs with the GIL released.\n"
"ValueError for negative sizes/offsets or NULL addresses; OverflowError\n"
"if an end offset or byte size overflows.");

static const cf_py_rows_spec cf_py_srcs_spec = {
    "srcs must be a sequence of (addr, numel, offset)",
    "each src must be a (addr, numel, offset) tuple", "src", "(addr, numel, offset)", 3,
    {{"src_addr", true}, {"src_numel", false}, {"flat_offset", false}}};

static PyObject *cf_py_shard_fill(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    cf_copy_src *srcs = NULL;
    int64_t *rows = NULL;
    void *dst;
    int64_t dst_numel, elem_size, shard_start;
    size_t n;
    cf_err err;
    cf_status st;

    (void)module;
    cf_err_init(&err);
    if (cf_py_check_nargs("shard_fill", nargs, 5) < 0)
        return NULL;
    if (cf_py_addr(args[0], "dst_addr", &dst) < 0 ||
        cf_py_int64(args[1], "dst_numel", &dst_numel) < 0 ||
        cf_py_int64(args[2], "elem_size", &elem_size) < 0 ||
        cf_py_int64(args[3], "shard_start", &shard_start) < 0 ||
        cf_py_rows(args[4], &cf_py_srcs_spec, &rows, &n) < 0)
        return NULL;
    srcs = malloc((n ? n : 1) * sizeof *srcs);
    if (srcs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        srcs[i].addr = (const void *)(uintptr_t)rows[3 * i];
        srcs[i].numel = rows[3 * i + 1];
        srcs[i].offset = rows[3 * i + 2];
    }

    Py_BEGIN_ALLOW_THREADS
    st = cf_copy_shard_fill(dst, dst_numel, elem_size, shard_start, srcs, n, &err);
    Py_END_ALLOW_THREADS
    if (st != CF_OK) {
        cf_py_raise(&err);
        goto done;
    }
    result = Py_NewRef(Py_None);

done:
    free(rows);
    free(srcs);
    return result;
}

static const cf_py_rows_spec cf_py_plan_spec = {
    "plan must be a sequence of (nat_off, numel, chunk_numel, shard_off) tuples",
    "each plan entry must be a tuple (nat_off, numel, chunk_numel, shard_off)", "plan param",
    "(nat_off, numel, chunk_numel, shard_off)", 4,
    {{"nat_off", false}, {"numel", false}, {"chunk_numel", false}, {"shard_off", false}}};

/*
 * Parse a unit's plan from its three arguments: `params_obj`, a sequence of
 * (nat_off, numel, chunk_numel, shard_off) tuples, into a malloc'd array
 * *params (the caller frees it on success; NULL after an error), and the
 * world size and shard numel.  0 on success, -1 with an exception set.
 */
static int cf_py_chunk_plan(PyObject *params_obj, PyObject *world_size, PyObject *shard_numel,
                            cf_chunk_plan *plan, cf_chunk_param **params)
{
    cf_chunk_param *out;
    int64_t *rows;
    size_t n;

    *params = NULL;
    if (cf_py_int64(world_size, "world_size", &plan->world_size) < 0 ||
        cf_py_int64(shard_numel, "shard_numel", &plan->shard_numel) < 0 ||
        cf_py_rows(params_obj, &cf_py_plan_spec, &rows, &n) < 0)
        return -1;
    out = malloc((n ? n : 1) * sizeof *out);
    if (out == NULL) {
        free(rows);
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        out[i].nat_off = rows[4 * i];
        out[i].numel = rows[4 * i + 1];
        out[i].chunk_numel = rows[4 * i + 2];
        out[i].shard_off = rows[4 * i + 3];
    }
    free(rows);
    plan->params = out;
    plan->n_params = n;
    *params = out;
    return 0;
}

PyDoc_STRVAR(cf_py_chunk_unpack_doc,
"chunk_unpack($module, dst_addr, dst_numel, src_addr, src_numel, elem_size,\n"
"             plan, world_size, shard_numel, max_threads, /)\n"
"--\n"
"\n"
"FSDP2 copy-out: the rank-major all-gather output src -> the natural buffer dst.\n"
"\n"
"plan is a sequence of (nat_off, numel, chunk_numel, shard_off), one per\n"
"parameter; src has world_size * shard_numel elements; rank k's part of a\n"
"parameter, natural elements [nat_off + k*chunk_numel, nat_off +\n"
"min((k+1)*chunk_numel, numel)), is read from src[k*shard_numel + shard_off:].\n"
"Bytes are copied exactly (elem_size bytes per element); chunk padding is\n"
"not read and dst outside the parameters is not written.  Same bytes as\n"
"cfsdp._ref.chunk_unpack.  Runs with the GIL released, on up to\n"
"min(max_threads, 4, online CPUs) threads above CHUNK_PARALLEL_BYTES.\n"
"ValueError (naming the parameter index) for a plan that does not fit the\n"
"buffers, a wrong src_numel, negative sizes or NULL addresses.");

static PyObject *cf_py_chunk_unpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    cf_chunk_param *params = NULL;
    cf_chunk_plan plan;
    void *dst, *src;
    int64_t dst_numel, src_numel, elem_size, max_threads;
    cf_err err;
    cf_status st;

    (void)module;
    cf_err_init(&err);
    if (cf_py_check_nargs("chunk_unpack", nargs, 9) < 0)
        return NULL;
    if (cf_py_addr(args[0], "dst_addr", &dst) < 0 ||
        cf_py_int64(args[1], "dst_numel", &dst_numel) < 0 ||
        cf_py_addr(args[2], "src_addr", &src) < 0 ||
        cf_py_int64(args[3], "src_numel", &src_numel) < 0 ||
        cf_py_int64(args[4], "elem_size", &elem_size) < 0 ||
        cf_py_int64(args[8], "max_threads", &max_threads) < 0 ||
        cf_py_chunk_plan(args[5], args[6], args[7], &plan, &params) < 0)
        return NULL;

    Py_BEGIN_ALLOW_THREADS
    st = cf_chunk_unpack(dst, dst_numel, src, src_numel, elem_size, &plan, max_threads, &err);
    Py_END_ALLOW_THREADS
    free(params);
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cf_py_chunk_pack_doc,
"chunk_pack($module, dst_addr, dst_numel, dst_dtype_code, src_addr, src_numel,\n"
"           src_dtype_code, plan, world_size, shard_numel, rank_lo, rank_hi,\n"
"           divisor, max_threads, /)\n"
"--\n"
"\n"
"FSDP2 copy-in: the natural buffer src -> ranks [rank_lo, rank_hi) of the\n"
"rank-major all-gather layout dst.\n"
"\n"
"Layout and plan as chunk_unpack; dst has (rank_hi - rank_lo) * shard_numel\n"
"elements, rank k at (k - rank_lo) * shard_numel.  Each element is\n"
"cast(src / divisor), rounded exactly as scale_cast_add (no divide when\n"
"divisor == 1; dtype codes fp32=0, fp64=1, bf16=2, fp16=3); every other\n"
"element of dst (chunk padding, gaps) is set to zero.  Same bits as\n"
"cfsdp._ref.chunk_pack (NaN payloads aside when casting).  Runs with the\n"
"GIL released, threads as chunk_unpack.  ValueError as chunk_unpack, and\n"
"for an unknown dtype code or a rank range outside [0, world_size].");

static PyObject *cf_py_chunk_pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    cf_chunk_param *params = NULL;
    cf_chunk_plan plan;
    void *dst, *src;
    int64_t dst_numel, dst_code, src_numel, src_code, rank_lo, rank_hi, max_threads;
    double divisor;
    cf_err err;
    cf_status st;

    (void)module;
    cf_err_init(&err);
    if (cf_py_check_nargs("chunk_pack", nargs, 13) < 0)
        return NULL;
    if (cf_py_addr(args[0], "dst_addr", &dst) < 0 ||
        cf_py_int64(args[1], "dst_numel", &dst_numel) < 0 ||
        cf_py_int64(args[2], "dst_dtype_code", &dst_code) < 0 ||
        cf_py_addr(args[3], "src_addr", &src) < 0 ||
        cf_py_int64(args[4], "src_numel", &src_numel) < 0 ||
        cf_py_int64(args[5], "src_dtype_code", &src_code) < 0 ||
        cf_py_int64(args[9], "rank_lo", &rank_lo) < 0 ||
        cf_py_int64(args[10], "rank_hi", &rank_hi) < 0 ||
        cf_py_int64(args[12], "max_threads", &max_threads) < 0)
        return NULL;
    divisor = PyFloat_AsDouble(args[11]);
    if (divisor == -1.0 && PyErr_Occurred())
        return NULL;
    if (cf_py_check_dtype_codes(dst_code, src_code) < 0 ||
        cf_py_chunk_plan(args[6], args[7], args[8], &plan, &params) < 0)
        return NULL;

    Py_BEGIN_ALLOW_THREADS
    st = cf_chunk_pack(dst, dst_numel, (int)dst_code, src, src_numel, (int)src_code, &plan,
                       rank_lo, rank_hi, divisor, max_threads, &err);
    Py_END_ALLOW_THREADS
    free(params);
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cf_py_scale_cast_add_doc,
"scale_cast_add($module, dst_addr, dst_dtype_code, src_addr, src_dtype_code,\n"
"               numel, divisor, accumulate, /)\n"
"--\n"
"\n"
"dst = (dst if accumulate else 0) + cast(src / divisor), in one pass.\n"
"\n"
"Rounds exactly as torch's `t = src / divisor` (skipped when divisor == 1),\n"
"`t.to(dst.dtype)`, `dst.add_(t)` / `dst.copy_(t)` on the CPU; dtype codes\n"
"fp32=0, fp64=1, bf16=2, fp16=3.  Same bits as cfsdp._ref.scale_cast_add\n"
"(NaN payloads aside).  Runs with the GIL released.  ValueError for an\n"
"unknown dtype code, negative numel or NULL address.");

static PyObject *cf_py_scale_cast_add(PyObject *module, PyObject *const *args,
                                      Py_ssize_t nargs)
{
    void *dst, *src;
    int64_t dst_code, src_code, numel;
    double divisor;
    int accumulate;
    cf_err err;
    cf_status st;

    (void)module;
    cf_err_init(&err);
    if (cf_py_check_nargs("scale_cast_add", nargs, 7) < 0)
        return NULL;
    if (cf_py_addr(args[0], "dst_addr", &dst) < 0 ||
        cf_py_int64(args[1], "dst_dtype_code", &dst_code) < 0 ||
        cf_py_addr(args[2], "src_addr", &src) < 0 ||
        cf_py_int64(args[3], "src_dtype_code", &src_code) < 0 ||
        cf_py_int64(args[4], "numel", &numel) < 0)
        return NULL;
    divisor = PyFloat_AsDouble(args[5]);
    if (divisor == -1.0 && PyErr_Occurred())
        return NULL;
    accumulate = PyObject_IsTrue(args[6]);
    if (accumulate < 0)
        return NULL;
    if (cf_py_check_dtype_codes(dst_code, src_code) < 0)
        return NULL;

    Py_BEGIN_ALLOW_THREADS
    st = cf_reduce_scale_cast_add(dst, (int)dst_code, src, (int)src_code, numel, divisor,
                                  accumulate != 0, &err);
    Py_END_ALLOW_THREADS
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cf_py_norm_partial_doc,
"norm_partial($module, src_addr, dtype_code, numel, p, /)\n"
"--\n"
"\n"
"The local statistic of a p-norm over one buffer, as a float.\n"
"\n"
"sum |x|^p accumulated in double (p > 0 finite), or max |x| (p = inf),\n"
"over numel elements of dtype code fp32=0, fp64=1, bf16=2, fp16=3.  NaN\n"
"and inf propagate; an empty buffer gives 0.0.  The summation order is\n"
"fixed (see csrc/norm.h), so the result is a function of the input: the\n"
"same bits as cfsdp._ref.norm_partial for p in (1, 2, inf).  Runs with the\n"
"GIL released.  ValueError for an unknown dtype code, negative numel, NULL\n"
"address or p not > 0.");

static PyObject *cf_py_norm_partial(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    void *src;
    int64_t code, numel;
    double p, out = 0.0;
    cf_err err;
    cf_status st;

    (void)module;
    cf_err_init(&err);
    if (cf_py_check_nargs("norm_partial", nargs, 4) < 0)
        return NULL;
    if (cf_py_addr(args[0], "src_addr", &src) < 0 ||
        cf_py_int64(args[1], "dtype_code", &code) < 0 ||
        cf_py_int64(args[2], "numel", &numel) < 0)
        return NULL;
    p = PyFloat_AsDouble(args[3]);
    if (p == -1.0 && PyErr_Occurred())
        return NULL;
    if (code < 0 || code >= CF_DTYPE_COUNT) {
        cf_err_set(&err, CF_EINVAL, "unknown dtype code %lld; expected 0..%d",
                   (long long)code, CF_DTYPE_COUNT - 1);
        return cf_py_raise(&err);
    }

    Py_BEGIN_ALLOW_THREADS
    st = cf_norm_partial(src, (int)code, numel, p, &out, &err);
    Py_END_ALLOW_THREADS
    if (st != CF_OK)
        return cf_py_raise(&err);
    return PyFloat_FromDouble(out);
}

/* ==========================================================================
 * Shared-memory collectives (csrc/shm.c) on an ordered work queue
 * (csrc/queue.c): the kernels shm_reduce / shm_memcpy, and the types
 * ShmGroup (one rank's view of a segment plus its worker thread) and ShmWork
 * (one queued collective).  Everything of this feature in module.c is in
 * this block, plus its method-table entries at the end of the table and one
 * call in cf_py_exec.  Errors of a collective are RuntimeError.
 * ========================================================================== */

/* Like cf_py_raise, with CF_ERUNTIME -> RuntimeError. */
static PyObject *cf_py_shm_raise(const cf_err *err)
{
    if (err->status == CF_ERUNTIME) {
        PyErr_SetString(PyExc_RuntimeError, err->msg[0] ? err->msg : "cfsdp shm: error");
        return NULL;
    }
    return cf_py_raise(err);
}

PyDoc_STRVAR(cf_py_shm_reduce_doc,
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

static PyObject *cf_py_shm_reduce(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    const void *srcs[CF_SHM_MAX_WORLD];
    int64_t *addrs;
    void *dst;
    int64_t numel, code, max_threads;
    size_t n;
    double scale;
    cf_err err;
    cf_status st;

    (void)module;
    cf_err_init(&err);
    if (cf_py_check_nargs("shm_reduce", nargs, 6) < 0)
        return NULL;
    if (cf_py_addr(args[0], "dst_addr", &dst) < 0 || cf_py_int64(args[2], "numel", &numel) < 0 ||
        cf_py_int64(args[3], "dtype_code", &code) < 0 ||
        cf_py_int64(args[5], "max_threads", &max_threads) < 0)
        return NULL;
    scale = PyFloat_AsDouble(args[4]);
    if (scale == -1.0 && PyErr_Occurred())
        return NULL;
    if (cf_py_rows(args[1], &cf_py_src_addrs_spec, &addrs, &n) < 0)
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

PyDoc_STRVAR(cf_py_shm_memcpy_doc,
"shm_memcpy($module, dst_addr, src_addr, nbytes, max_threads, /)\n"
"--\n"
"\n"
"Copy nbytes from src to dst (no overlap), as the collectives copy: one\n"
"memcpy per thread, up to min(max_threads, 4, online CPUs) threads above\n"
"CHUNK_PARALLEL_BYTES.  Twin: cfsdp._ref.shm_memcpy.  Runs with the GIL\n"
"released.  ValueError for a negative size or a NULL address.");

static PyObject *cf_py_shm_memcpy(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    void *dst, *src;
    int64_t nbytes, max_threads;
    cf_err err;
    cf_status st;

    (void)module;
    cf_err_init(&err);
    if (cf_py_check_nargs("shm_memcpy", nargs, 4) < 0)
        return NULL;
    if (cf_py_addr(args[0], "dst_addr", &dst) < 0 || cf_py_addr(args[1], "src_addr", &src) < 0 ||
        cf_py_int64(args[2], "nbytes", &nbytes) < 0 ||
        cf_py_int64(args[3], "max_threads", &max_threads) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    st = cf_shm_memcpy(dst, src, nbytes, max_threads, &err);
    Py_END_ALLOW_THREADS
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cf_py_shm_segment_bytes_doc,
"shm_segment_bytes($module, world_size, slot_bytes, /)\n"
"--\n"
"\n"
"Bytes of a segment for world_size ranks with slot halves of slot_bytes\n"
"(0 if out of range).");

static PyObject *cf_py_shm_segment_bytes(PyObject *module, PyObject *const *args,
                                         Py_ssize_t nargs)
{
    int64_t w, s;
    (void)module;
    if (cf_py_check_nargs("shm_segment_bytes", nargs, 2) < 0 ||
        cf_py_int64(args[0], "world_size", &w) < 0 || cf_py_int64(args[1], "slot_bytes", &s) < 0)
        return NULL;
    return PyLong_FromSize_t(cf_shm_segment_bytes(w, s));
}

/* One rank's view.  `g` is set to NULL (under the GIL) when it is closed, so no new
 * call starts on it; a call that uses g with the GIL released (wait_attached) counts
 * itself in `busy`, and the shutdown aborts it and waits for it before unmapping. */
typedef struct {
    PyObject_HEAD
    cf_shm_group *g; /* NULL once closed */
    cf_queue *q;     /* freed with the object (ShmWork objects hold the group) */
    PyObject *work_type;
    _Atomic int busy;
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
    cf_shm_group_abort(g); /* a wait_attached in flight returns at once... */
    while (atomic_load(&self->busy) > 0)
        sched_yield(); /* ...and is gone before g is unmapped */
    cf_queue_stop(self->q);
    cf_shm_group_close(g);
    Py_END_ALLOW_THREADS
}

static const cf_py_rows_spec cf_py_granks_spec = {
    "global_ranks must be a sequence of ints", NULL, NULL, NULL, 1, {{"global rank", false}}};

static PyObject *cf_py_shm_group_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"name",       "create",    "world_size", "rank", "slot_bytes",
                             "timeout_s",  "label",     "global_ranks", NULL};
    const char *name, *label;
    int create;
    long long world, rank, slot;
    double timeout_s;
    PyObject *granks_obj, *module, *work_type;
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
    module = PyType_GetModule(type);
    work_type = module == NULL ? NULL : PyObject_GetAttrString(module, "ShmWork");
    if (work_type == NULL) {
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
    if (st != CF_OK) {
        Py_DECREF(work_type);
        return cf_py_shm_raise(&err);
    }
    self = (cf_py_shm_group *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_BEGIN_ALLOW_THREADS
        cf_queue_free(q);
        cf_shm_group_close(g);
        Py_END_ALLOW_THREADS
        Py_DECREF(work_type);
        return NULL;
    }
    self->g = g;
    self->q = q;
    self->work_type = work_type;
    atomic_init(&self->busy, 0);
    return (PyObject *)self;
}

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
    Py_XDECREF(self->work_type);
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
"segment's name.  RuntimeError after the timeout.");

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
        return cf_py_shm_raise(&err);
    Py_RETURN_NONE;
}

/* Validate and queue one collective; a new ShmWork.  Takes a->plan (malloc'd by
 * cf_py_shm_plan, or NULL): the work frees it once the op is done, or it is freed here
 * if nothing is queued. */
static PyObject *cf_py_shm_enqueue(cf_py_shm_group *self, cf_shm_args *a, PyObject *keep)
{
    cf_shm_group *g = cf_py_shm_open_group(self);
    PyTypeObject *wt = (PyTypeObject *)self->work_type;
    cf_chunk_param *plan = (cf_chunk_param *)a->plan;
    cf_py_shm_work *w = NULL;
    cf_queue_op *op;
    cf_err err;
    cf_err_init(&err);
    if (g == NULL)
        goto fail;
    if (cf_shm_check(g, a, &err) != CF_OK) {
        cf_py_shm_raise(&err);
        goto fail;
    }
    w = (cf_py_shm_work *)wt->tp_alloc(wt, 0);
    if (w == NULL)
        goto fail;
    if (cf_queue_submit(self->q, a, sizeof *a, &op, &err) != CF_OK) {
        cf_py_shm_raise(&err);
        goto fail;
    }
    Py_INCREF(self);
    w->group = self;
    w->op = op;
    w->keep = Py_NewRef(keep);
    w->plan = plan;
    w->error = NULL;
    w->waiters = 0;
    w->op_code = a->op;
    return (PyObject *)w;

fail:
    Py_XDECREF(w); /* its group is NULL: nothing of an op to release */
    free(plan);
    return NULL;
}

/* Parse (dst_addr, src_addr, numel, dtype_code) into a; 0 or -1. */
static int cf_py_shm_parse_buffers(PyObject *const *args, cf_shm_args *a)
{
    void *dst, *src;
    int64_t code;
    if (cf_py_addr(args[0], "dst_addr", &dst) < 0 || cf_py_addr(args[1], "src_addr", &src) < 0 ||
        cf_py_int64(args[2], "numel", &a->numel) < 0 ||
        cf_py_int64(args[3], "dtype_code", &code) < 0)
        return -1;
    a->dst = dst;
    a->src = src;
    a->dtype = code >= 0 && code < CF_DTYPE_COUNT ? (int)code : -1;
    a->root = 0;
    a->scale = 1.0;
    a->plan = NULL;
    a->n_plan = a->natural_numel = 0;
    a->natural_dtype = a->dtype;
    a->divisor = 1.0;
    return 0;
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
    cf_shm_args a;
    if (cf_py_check_nargs("all_gather", nargs, 6) < 0 || cf_py_shm_parse_buffers(args, &a) < 0 ||
        cf_py_int64(args[4], "max_threads", &a.max_threads) < 0)
        return NULL;
    a.op = CF_SHM_ALL_GATHER;
    return cf_py_shm_enqueue((cf_py_shm_group *)obj, &a, args[5]);
}

PyDoc_STRVAR(cf_py_shm_group_all_gather_unpack_doc,
"all_gather_unpack($self, natural_addr, natural_numel, src_addr, numel, dtype_code, plan,\n"
"                  max_threads, keep, /)\n"
"--\n"
"\n"
"Queue an all-gather whose copy-out is chunk_unpack's: every rank's numel\n"
"elements at src land in the natural buffer (natural_numel) by the plan, a\n"
"bytes object of int64 (nat_off, numel, chunk_numel, shard_off) quadruples\n"
"(world_size: the group's, shard_numel: numel).  The rank-major buffer is\n"
"never built.  The op reads its own copy of the plan; `keep` is held until\n"
"the op is done.");

/* A plan argument (bytes of int64 quadruples) copied into a->plan (malloc'd, for
 * cf_py_shm_enqueue to hand to the op's ShmWork: the worker reads the op's own copy,
 * whatever the caller does with the bytes) and a->n_plan; 0 or -1. */
static int cf_py_shm_plan(PyObject *obj, cf_shm_args *a)
{
    Py_ssize_t len;
    cf_chunk_param *copy;
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "plan must be bytes of int64 quadruples, not %.100s",
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

static PyObject *cf_py_shm_group_all_gather_unpack(PyObject *obj, PyObject *const *args,
                                                   Py_ssize_t nargs)
{
    cf_shm_args a;
    void *src;
    int64_t code;
    if (cf_py_check_nargs("all_gather_unpack", nargs, 8) < 0 ||
        cf_py_addr(args[0], "natural_addr", &a.dst) < 0 ||
        cf_py_int64(args[1], "natural_numel", &a.natural_numel) < 0 ||
        cf_py_addr(args[2], "src_addr", &src) < 0 || cf_py_int64(args[3], "numel", &a.numel) < 0 ||
        cf_py_int64(args[4], "dtype_code", &code) < 0 ||
        cf_py_int64(args[6], "max_threads", &a.max_threads) < 0)
        return NULL;
    if (cf_py_shm_plan(args[5], &a) < 0)
        return NULL;
    a.src = src;
    a.dtype = code >= 0 && code < CF_DTYPE_COUNT ? (int)code : -1;
    a.natural_dtype = a.dtype;
    a.divisor = 1.0;
    a.root = 0;
    a.scale = 1.0;
    a.op = CF_SHM_ALL_GATHER;
    return cf_py_shm_enqueue((cf_py_shm_group *)obj, &a, args[7]);
}

PyDoc_STRVAR(cf_py_shm_group_reduce_scatter_pack_doc,
"reduce_scatter_pack($self, dst_addr, numel, dtype_code, natural_addr, natural_numel,\n"
"                    natural_dtype_code, divisor, scale, plan, max_threads, keep, /)\n"
"--\n"
"\n"
"Queue a reduce-scatter whose input is chunk_pack's: the natural gradient\n"
"(natural_numel elements) is packed rank-major by the plan (bytes of int64\n"
"quadruples, as all_gather_unpack's), cast to dtype after dividing by divisor,\n"
"piece by piece straight into the shared slots; dst (numel) = scale * sum\n"
"over ranks of this rank's block.  The rank-major buffer is never built.\n"
"The op reads its own copy of the plan; `keep` is held until the op is done.");

static PyObject *cf_py_shm_group_reduce_scatter_pack(PyObject *obj, PyObject *const *args,
                                                     Py_ssize_t nargs)
{
    cf_shm_args a;
    void *nat;
    int64_t code, ncode;
    if (cf_py_check_nargs("reduce_scatter_pack", nargs, 11) < 0 ||
        cf_py_addr(args[0], "dst_addr", &a.dst) < 0 || cf_py_int64(args[1], "numel", &a.numel) < 0 ||
        cf_py_int64(args[2], "dtype_code", &code) < 0 ||
        cf_py_addr(args[3], "natural_addr", &nat) < 0 ||
        cf_py_int64(args[4], "natural_numel", &a.natural_numel) < 0 ||
        cf_py_int64(args[5], "natural_dtype_code", &ncode) < 0 ||
        cf_py_int64(args[9], "max_threads", &a.max_threads) < 0)
        return NULL;
    a.divisor = PyFloat_AsDouble(args[6]);
    if (a.divisor == -1.0 && PyErr_Occurred())
        return NULL;
    a.scale = PyFloat_AsDouble(args[7]);
    if ((a.scale == -1.0 && PyErr_Occurred()) || cf_py_shm_plan(args[8], &a) < 0) /* last: malloc */
        return NULL;
    a.src = nat;
    a.dtype = code >= 0 && code < CF_DTYPE_COUNT ? (int)code : -1;
    a.natural_dtype = ncode >= 0 && ncode < CF_DTYPE_COUNT ? (int)ncode : -1;
    a.root = 0;
    a.op = CF_SHM_REDUCE_SCATTER;
    return cf_py_shm_enqueue((cf_py_shm_group *)obj, &a, args[10]);
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
    cf_shm_args a;
    if (cf_py_check_nargs(cf_shm_op_name(op), nargs, 7) < 0 ||
        cf_py_shm_parse_buffers(args, &a) < 0 ||
        cf_py_int64(args[5], "max_threads", &a.max_threads) < 0)
        return NULL;
    a.scale = PyFloat_AsDouble(args[4]);
    if (a.scale == -1.0 && PyErr_Occurred())
        return NULL;
    a.op = op;
    return cf_py_shm_enqueue((cf_py_shm_group *)obj, &a, args[6]);
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
    cf_shm_args a;
    int64_t code;
    if (cf_py_check_nargs("broadcast", nargs, 6) < 0 ||
        cf_py_addr(args[0], "addr", &a.dst) < 0 || cf_py_int64(args[1], "numel", &a.numel) < 0 ||
        cf_py_int64(args[2], "dtype_code", &code) < 0 || cf_py_int64(args[3], "root", &a.root) < 0 ||
        cf_py_int64(args[4], "max_threads", &a.max_threads) < 0)
        return NULL;
    a.dtype = code >= 0 && code < CF_DTYPE_COUNT ? (int)code : -1;
    a.src = NULL;
    a.scale = 1.0;
    a.plan = NULL;
    a.n_plan = a.natural_numel = 0;
    a.natural_dtype = a.dtype;
    a.divisor = 1.0;
    a.op = CF_SHM_BROADCAST;
    return cf_py_shm_enqueue((cf_py_shm_group *)obj, &a, args[5]);
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
    {"drain", cf_py_shm_group_drain, METH_NOARGS, cf_py_shm_group_drain_doc},
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
"reduce_scatter, all_reduce, broadcast) are queued and run in order on the\n"
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
    Py_CLEAR(self->keep);
}

PyDoc_STRVAR(cf_py_shm_work_wait_doc,
"wait($self, /)\n"
"--\n"
"\n"
"Block (GIL released, sleeping, not spinning) until the collective is done.\n"
"RuntimeError with the op's message if it failed (a timeout naming the\n"
"ranks that did not arrive, a peer's failure, a poisoned or closed group);\n"
"raised again by every later wait().  Returns None.");

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

static PyObject *cf_py_shm_work_get_op(PyObject *obj, void *closure)
{
    (void)closure;
    return PyUnicode_FromString(cf_shm_op_name(((cf_py_shm_work *)obj)->op_code));
}

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

/* Py_mod_exec part: the two types and the constants; 0 or -1. */
static int cf_py_shm_exec(PyObject *m)
{
    PyObject *group_type, *work_type;
    work_type = PyType_FromModuleAndSpec(m, &cf_py_shm_work_spec, NULL);
    if (work_type == NULL)
        return -1;
    if (PyModule_AddObjectRef(m, "ShmWork", work_type) < 0) {
        Py_DECREF(work_type);
        return -1;
    }
    Py_DECREF(work_type);
    group_type = PyType_FromModuleAndSpec(m, &cf_py_shm_group_spec, NULL);
    if (group_type == NULL)
        return -1;
    if (PyModule_AddObjectRef(m, "ShmGroup", group_type) < 0) {
        Py_DECREF(group_type);
        return -1;
    }
    Py_DECREF(group_type);
    if (PyModule_AddIntConstant(m, "SHM_OP_ALL_GATHER", CF_SHM_ALL_GATHER) < 0 ||
        PyModule_AddIntConstant(m, "SHM_OP_REDUCE_SCATTER", CF_SHM_REDUCE_SCATTER) < 0 ||
        PyModule_AddIntConstant(m, "SHM_OP_ALL_REDUCE", CF_SHM_ALL_REDUCE) < 0 ||
        PyModule_AddIntConstant(m, "SHM_OP_BROADCAST", CF_SHM_BROADCAST) < 0 ||
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

/* ====================== end of the shared-memory block ==================== */
/* ==================================================================
 * Fused optimizer steps (csrc/optim.c).  Everything of the optimizer
 * bindings is in this block; their method-table entries are the last ones.
 * ================================================================== */

/*
 * The ranges argument: an object exposing a C-contiguous buffer of int64
 * (format 'q' or 'l' with 8-byte items; e.g. array.array('q')) holding
 * start, len pairs, or a sequence of (start, len) pairs (read through
 * cf_py_rows' snapshot).  Either way the pairs are copied into a malloc'd
 * array before the GIL is released, so another thread writing the buffer
 * cannot change them between the checks and the loops (and an odd-offset
 * buffer is read with memcpy).  On success *ranges points at the pairs, *n
 * is their count and the caller calls cf_py_optim_ranges_release; -1 with an
 * exception set otherwise.
 */
typedef struct {
    Py_buffer view;
    int have_view;
    cf_optim_range *owned;
} cf_py_optim_ranges_hold;

static void cf_py_optim_ranges_release(cf_py_optim_ranges_hold *h)
{
    if (h->have_view)
        PyBuffer_Release(&h->view);
    h->have_view = 0;
    free(h->owned);
    h->owned = NULL;
}

static const cf_py_rows_spec cf_py_ranges_spec = {
    "ranges must be an int64 buffer or a sequence of (start, len) pairs",
    "each range must be a (start, len) pair", "range", "(start, len)", 2,
    {{"range start", false}, {"range len", false}}};

static int cf_py_optim_ranges(PyObject *obj, cf_py_optim_ranges_hold *h,
                              const cf_optim_range **ranges, size_t *n)
{
    int64_t *rows;
    size_t count;

    h->have_view = 0;
    h->owned = NULL;
    if (PyObject_CheckBuffer(obj)) {
        const char *f;
        if (PyObject_GetBuffer(obj, &h->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        h->have_view = 1;
        f = h->view.format ? h->view.format : "B";
        if (f[0] == '@' || f[0] == '=' || f[0] == '<')
            f++;
        if (h->view.itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0) ||
            h->view.len % (Py_ssize_t)sizeof(cf_optim_range) != 0) {
            PyErr_Format(PyExc_TypeError,
                         "ranges buffer must hold int64 (start, len) pairs, got format '%s' "
                         "with %zd-byte items and %zd bytes",
                         h->view.format ? h->view.format : "B", h->view.itemsize,
                         h->view.len);
            cf_py_optim_ranges_release(h);
            return -1;
        }
        count = (size_t)(h->view.len / (Py_ssize_t)sizeof(cf_optim_range));
        h->owned = malloc((count ? count : 1) * sizeof *h->owned);
        if (h->owned == NULL) {
            cf_py_optim_ranges_release(h);
            PyErr_NoMemory();
            return -1;
        }
        if (count > 0)
            memcpy(h->owned, h->view.buf, count * sizeof *h->owned);
        PyBuffer_Release(&h->view);
        h->have_view = 0;
        *ranges = h->owned;
        *n = count;
        return 0;
    }
    if (cf_py_rows(obj, &cf_py_ranges_spec, &rows, &count) < 0)
        return -1;
    h->owned = malloc((count ? count : 1) * sizeof *h->owned);
    if (h->owned == NULL) {
        free(rows);
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < count; i++) {
        h->owned[i].start = rows[2 * i];
        h->owned[i].len = rows[2 * i + 1];
    }
    free(rows);
    *ranges = h->owned;
    *n = count;
    return 0;
}

/* A float argument; 0 on success, -1 with an exception set. */
static int cf_py_double(PyObject *obj, double *out)
{
    double v = PyFloat_AsDouble(obj);
    if (v == -1.0 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

/* A bool argument (any object's truth value); 0 on success, -1 on error. */
static int cf_py_bool(PyObject *obj, bool *out)
{
    int v = PyObject_IsTrue(obj);
    if (v < 0)
        return -1;
    *out = v != 0;
    return 0;
}

/* An optional address: 0 or None is NULL. */
static int cf_py_opt_addr(PyObject *obj, const char *what, void **out)
{
    if (obj == Py_None) {
        *out = NULL;
        return 0;
    }
    return cf_py_addr(obj, what, out);
}

PyDoc_STRVAR(cf_py_adam_step_doc,
"adam_step($module, param_addr, grad_addr, exp_avg_addr, exp_avg_sq_addr,\n"
"          max_exp_avg_sq_addr, ranges, dtype_code, lr, beta1, beta2, eps,\n"
"          weight_decay, step, decoupled, amsgrad, maximize, max_threads, /)\n"
"--\n"
"\n"
"One Adam (decoupled=True: AdamW) step over many element ranges, in place.\n"
"\n"
"ranges are (start, len) element pairs, the same for every buffer, counted\n"
"from each buffer's address (an int64 buffer of pairs, e.g. array('q'), or a\n"
"sequence of pairs), in increasing order without overlap; memory outside\n"
"them is not touched.  max_exp_avg_sq_addr is used only when amsgrad (0 or\n"
"None otherwise); step is state['step'] after its increment.  The results\n"
"are torch 2.13's single-tensor Adam on CPU bit for bit where torch's\n"
"kernels use FMA (AVX2/AVX-512), as cfsdp._ref.adam_step.  fp32 only\n"
"(dtype code 0).  Runs with the GIL released, on up to min(max_threads, 4,\n"
"online CPUs) threads above OPTIM_PARALLEL_BYTES.  ValueError for another\n"
"dtype, a NULL buffer, bad or unordered ranges, overlapping buffers or\n"
"step < 1; OverflowError if an offset overflows.");

static PyObject *cf_py_adam_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    cf_py_optim_ranges_hold hold;
    const cf_optim_range *ranges;
    size_t n;
    void *p, *g, *m, *v, *vmax;
    int64_t code, max_threads;
    cf_adam_args a;
    cf_err err;
    cf_status st;

    (void)module;
    cf_err_init(&err);
    if (cf_py_check_nargs("adam_step", nargs, 17) < 0)
        return NULL;
    if (cf_py_addr(args[0], "param_addr", &p) < 0 ||
        cf_py_addr(args[1], "grad_addr", &g) < 0 ||
        cf_py_addr(args[2], "exp_avg_addr", &m) < 0 ||
        cf_py_addr(args[3], "exp_avg_sq_addr", &v) < 0 ||
        cf_py_opt_addr(args[4], "max_exp_avg_sq_addr", &vmax) < 0 ||
        cf_py_int64(args[6], "dtype_code", &code) < 0 || cf_py_double(args[7], &a.lr) < 0 ||
        cf_py_double(args[8], &a.beta1) < 0 || cf_py_double(args[9], &a.beta2) < 0 ||
        cf_py_double(args[10], &a.eps) < 0 || cf_py_double(args[11], &a.weight_decay) < 0 ||
        cf_py_double(args[12], &a.step) < 0 || cf_py_bool(args[13], &a.decoupled) < 0 ||
        cf_py_bool(args[14], &a.amsgrad) < 0 || cf_py_bool(args[15], &a.maximize) < 0 ||
        cf_py_int64(args[16], "max_threads", &max_threads) < 0)
        return NULL;
    if (cf_py_optim_ranges(args[5], &hold, &ranges, &n) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    st = cf_optim_adam_step(p, g, m, v, vmax, ranges, n, (int)code, &a, max_threads, &err);
    Py_END_ALLOW_THREADS
    cf_py_optim_ranges_release(&hold);
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cf_py_sgd_step_doc,
"sgd_step($module, param_addr, grad_addr, momentum_buffer_addr, ranges,\n"
"         dtype_code, lr, momentum, dampening, weight_decay, nesterov,\n"
"         maximize, first_step, max_threads, /)\n"
"--\n"
"\n"
"One SGD step over many element ranges, in place.\n"
"\n"
"Ranges as adam_step.  momentum_buffer_addr is used only when momentum != 0\n"
"(0 or None otherwise); first_step sets the buffer to the (decayed,\n"
"maximize-negated) gradient as torch's first step clones it.  torch 2.13's\n"
"single-tensor SGD, with adam_step's rounding contract, threads and errors.");

static PyObject *cf_py_sgd_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    cf_py_optim_ranges_hold hold;
    const cf_optim_range *ranges;
    size_t n;
    void *p, *g, *b;
    int64_t code, max_threads;
    cf_sgd_args a;
    cf_err err;
    cf_status st;

    (void)module;
    cf_err_init(&err);
    if (cf_py_check_nargs("sgd_step", nargs, 13) < 0)
        return NULL;
    if (cf_py_addr(args[0], "param_addr", &p) < 0 ||
        cf_py_addr(args[1], "grad_addr", &g) < 0 ||
        cf_py_opt_addr(args[2], "momentum_buffer_addr", &b) < 0 ||
        cf_py_int64(args[4], "dtype_code", &code) < 0 || cf_py_double(args[5], &a.lr) < 0 ||
        cf_py_double(args[6], &a.momentum) < 0 || cf_py_double(args[7], &a.dampening) < 0 ||
        cf_py_double(args[8], &a.weight_decay) < 0 || cf_py_bool(args[9], &a.nesterov) < 0 ||
        cf_py_bool(args[10], &a.maximize) < 0 || cf_py_bool(args[11], &a.first_step) < 0 ||
        cf_py_int64(args[12], "max_threads", &max_threads) < 0)
        return NULL;
    if (cf_py_optim_ranges(args[3], &hold, &ranges, &n) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    st = cf_optim_sgd_step(p, g, b, ranges, n, (int)code, &a, max_threads, &err);
    Py_END_ALLOW_THREADS
    cf_py_optim_ranges_release(&hold);
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cf_py_optim_uses_avx2_doc,
"optim_uses_avx2($module, /)\n"
"--\n"
"\n"
"Whether adam_step / sgd_step run their AVX2+FMA loops on this CPU (the\n"
"portable loops give the same bits).");

static PyObject *cf_py_optim_uses_avx2(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyBool_FromLong(cf_optim_uses_avx2());
}

/* ============================ end of the optimizer block ============================ */

/* ================================ bulk binding ================================
 *
 * The runtime's per-step bookkeeping touches every parameter of a unit: module
 * attributes bound to forward views or to the registered parameters, gradients
 * published, requires_grad read.  These entry points do one such pass in C over
 * tuples the runtime builds once per unit, so no hook runs Python bytecode per
 * parameter.  They work on any Python objects; the twins are cfsdp._ref.bind. */

/* `obj` must be a tuple; its size in *n.  0, or -1 with TypeError. */
static int cf_py_tuple(PyObject *obj, const char *fname, const char *what, Py_ssize_t *n)
{
    if (!PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be a tuple, not %.100s", fname, what,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *n = PyTuple_GET_SIZE(obj);
    return 0;
}

/* Tuples `a` and `b` of one length (in *n); 0, or -1 with an exception. */
static int cf_py_tuple_pair(PyObject *a, PyObject *b, const char *fname, const char *wa,
                            const char *wb, Py_ssize_t *n)
{
    Py_ssize_t nb;
    if (cf_py_tuple(a, fname, wa, n) < 0 || cf_py_tuple(b, fname, wb, &nb) < 0)
        return -1;
    if (*n != nb) {
        PyErr_Format(PyExc_ValueError, "%s(): %s has %zd items but %s has %zd", fname, wa, *n,
                     wb, nb);
        return -1;
    }
    return 0;
}

/* The (objs, name, ...) head of attr_flags / attr_get / attr_set: `nargs` must be
 * `expected`, args[0] a tuple (its size in *n), args[1] a str.  0, or -1 with an
 * exception. */
static int cf_py_objs_name(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t expected,
                           const char *fname, Py_ssize_t *n)
{
    if (cf_py_check_nargs(fname, nargs, expected) < 0 ||
        cf_py_tuple(args[0], fname, "objs", n) < 0)
        return -1;
    if (!PyUnicode_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "%s(): name must be a str", fname);
        return -1;
    }
    return 0;
}

/* Every dicts[i] must be a dict (checked before anything is written). */
static int cf_py_check_dicts(PyObject *dicts, Py_ssize_t n, const char *fname)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(dicts, i);
        if (!PyDict_Check(d)) {
            PyErr_Format(PyExc_TypeError, "%s(): dicts[%zd] is a %.100s, not a dict", fname, i,
                         Py_TYPE(d)->tp_name);
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(cf_py_dict_set_doc,
"dict_set($module, dicts, keys, values, /)\n"
"--\n"
"\n"
"dicts[i][keys[i]] = values[i] for every i (three tuples of one length).");

static PyObject *cf_py_dict_set(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n;
    (void)module;
    if (cf_py_check_nargs("dict_set", nargs, 3) < 0 ||
        cf_py_tuple_pair(args[0], args[1], "dict_set", "dicts", "keys", &n) < 0 ||
        cf_py_tuple_pair(args[0], args[2], "dict_set", "dicts", "values", &n) < 0)
        return NULL;
    if (cf_py_check_dicts(args[0], n, "dict_set") < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyDict_SetItem(PyTuple_GET_ITEM(args[0], i), PyTuple_GET_ITEM(args[1], i),
                           PyTuple_GET_ITEM(args[2], i)) < 0)
            return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cf_py_dict_pop_doc,
"dict_pop($module, dicts, keys, /)\n"
"--\n"
"\n"
"dicts[i].pop(keys[i], None) for every i (two tuples of one length).");

static PyObject *cf_py_dict_pop(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n;
    (void)module;
    if (cf_py_check_nargs("dict_pop", nargs, 2) < 0 ||
        cf_py_tuple_pair(args[0], args[1], "dict_pop", "dicts", "keys", &n) < 0 ||
        cf_py_check_dicts(args[0], n, "dict_pop") < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* one lookup: a key's __eq__ may change the dict between two */
        if (PyDict_DelItem(PyTuple_GET_ITEM(args[0], i), PyTuple_GET_ITEM(args[1], i)) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError))
                return NULL;
            PyErr_Clear();
        }
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cf_py_attr_flags_doc,
"attr_flags($module, objs, name, /)\n"
"--\n"
"\n"
"bytes(bool(getattr(o, name)) for o in objs): one byte, 0 or 1, per object.");

static PyObject *cf_py_attr_flags(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n;
    PyObject *out;
    char *buf;
    (void)module;
    if (cf_py_objs_name(args, nargs, 2, "attr_flags", &n) < 0)
        return NULL;
    out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL)
        return NULL;
    buf = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyObject_GetAttr(PyTuple_GET_ITEM(args[0], i), args[1]);
        int truth = v == NULL ? -1 : PyObject_IsTrue(v);
        Py_XDECREF(v);
        if (truth < 0) {
            Py_DECREF(out);
            return NULL;
        }
        buf[i] = (char)truth;
    }
    return out;
}

PyDoc_STRVAR(cf_py_attr_set_doc,
"attr_set($module, objs, name, values, /)\n"
"--\n"
"\n"
"setattr(objs[i], name, values[i]) for every i; values may be a tuple of one\n"
"length with objs, or None (every attribute set to None).");

static PyObject *cf_py_attr_set(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n;
    (void)module;
    if (cf_py_objs_name(args, nargs, 3, "attr_set", &n) < 0 ||
        (args[2] != Py_None &&
         cf_py_tuple_pair(args[0], args[2], "attr_set", "objs", "values", &n) < 0))
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = args[2] == Py_None ? Py_None : PyTuple_GET_ITEM(args[2], i);
        if (PyObject_SetAttr(PyTuple_GET_ITEM(args[0], i), args[1], v) < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cf_py_attr_get_doc,
"attr_get($module, objs, name, /)\n"
"--\n"
"\n"
"tuple(getattr(o, name) for o in objs).");

static PyObject *cf_py_attr_get(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n;
    PyObject *out;
    (void)module;
    if (cf_py_objs_name(args, nargs, 2, "attr_get", &n) < 0)
        return NULL;
    out = PyTuple_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyObject_GetAttr(PyTuple_GET_ITEM(args[0], i), args[1]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

PyDoc_STRVAR(cf_py_sole_owner_doc,
"sole_owner($module, objs, refs, /)\n"
"--\n"
"\n"
"True when every object of the tuple `objs` is referenced by exactly `refs`\n"
"Python references (the tuple's own included) and its tensor has one owner\n"
"(`o._use_count() == 1`): nothing outside the caller's bookkeeping can see\n"
"it, in Python or in C++.");

static PyObject *cf_py_sole_owner(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n;
    int64_t refs;
    PyObject *name;
    (void)module;
    if (cf_py_check_nargs("sole_owner", nargs, 2) < 0 ||
        cf_py_tuple(args[0], "sole_owner", "objs", &n) < 0 ||
        cf_py_int64(args[1], "refs", &refs) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (Py_REFCNT(PyTuple_GET_ITEM(args[0], i)) != refs)
            Py_RETURN_FALSE;
    name = PyUnicode_InternFromString("_use_count");
    if (name == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = PyObject_CallMethodNoArgs(PyTuple_GET_ITEM(args[0], i), name);
        long long v = c == NULL ? -1 : PyLong_AsLongLong(c);
        Py_XDECREF(c);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(name);
            return NULL;
        }
        if (v != 1) {
            Py_DECREF(name);
            Py_RETURN_FALSE;
        }
    }
    Py_DECREF(name);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(cf_py_shape_views_doc,
"shape_views($module, chunks, index, shapes, trainable, occ_index, /)\n"
"--\n"
"\n"
"A unit's forward views from the pieces of its split flat parameter: view i\n"
"is chunks[index[i]].view(shapes[i]) (the piece itself where shapes[i] is\n"
"None), detached where the bytes `trainable` (or None: all) hold 0.  Returns\n"
"the tuple of view occ_index[k] for every k.");

static PyObject *cf_py_shape_views(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n_chunks, n, n_occ;
    PyObject *views = NULL, *out = NULL, *view_name = NULL, *detach_name = NULL;
    const char *trainable = NULL;
    (void)module;
    if (cf_py_check_nargs("shape_views", nargs, 5) < 0 ||
        cf_py_tuple(args[0], "shape_views", "chunks", &n_chunks) < 0 ||
        cf_py_tuple_pair(args[1], args[2], "shape_views", "index", "shapes", &n) < 0 ||
        cf_py_tuple(args[4], "shape_views", "occ_index", &n_occ) < 0)
        return NULL;
    if (args[3] != Py_None) {
        if (!PyBytes_Check(args[3]) || PyBytes_GET_SIZE(args[3]) != n) {
            PyErr_Format(PyExc_ValueError,
                         "shape_views(): trainable must be None or %zd bytes", n);
            return NULL;
        }
        trainable = PyBytes_AS_STRING(args[3]);
    }
    views = PyTuple_New(n);
    view_name = PyUnicode_InternFromString("view");
    detach_name = PyUnicode_InternFromString("detach");
    if (views == NULL || view_name == NULL || detach_name == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[1], i));
        PyObject *shape = PyTuple_GET_ITEM(args[2], i), *v;
        if (j == -1 && PyErr_Occurred())
            goto done;
        if (j < 0 || j >= n_chunks) {
            PyErr_Format(PyExc_ValueError, "shape_views(): index[%zd] = %zd is not a chunk (%zd)",
                         i, j, n_chunks);
            goto done;
        }
        v = PyTuple_GET_ITEM(args[0], j);
        if (shape == Py_None)
            Py_INCREF(v);
        else if ((v = PyObject_CallMethodOneArg(v, view_name, shape)) == NULL)
            goto done;
        if (trainable != NULL && !trainable[i]) {
            PyObject *d = PyObject_CallMethodNoArgs(v, detach_name);
            Py_DECREF(v);
            if (d == NULL)
                goto done;
            v = d;
        }
        PyTuple_SET_ITEM(views, i, v);
    }
    out = PyTuple_New(n_occ);
    if (out == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < n_occ; k++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[4], k));
        if (i == -1 && PyErr_Occurred()) {
            Py_CLEAR(out);
            goto done;
        }
        if (i < 0 || i >= n) {
            PyErr_Format(PyExc_ValueError,
                         "shape_views(): occ_index[%zd] = %zd is not a view (%zd)", k, i, n);
            Py_CLEAR(out);
            goto done;
        }
        Py_INCREF(PyTuple_GET_ITEM(views, i));
        PyTuple_SET_ITEM(out, k, PyTuple_GET_ITEM(views, i));
    }
done:
    Py_XDECREF(views);
    Py_XDECREF(view_name);
    Py_XDECREF(detach_name);
    return out;
}

/* ============================== end of bulk binding ============================== */

static PyMethodDef cf_py_methods[] = {
    {"plan_layout", (PyCFunction)(void (*)(void))cf_py_plan_layout, METH_FASTCALL,
     cf_py_plan_layout_doc},
    {"shard_fill", (PyCFunction)(void (*)(void))cf_py_shard_fill, METH_FASTCALL,
     cf_py_shard_fill_doc},
    {"chunk_unpack", (PyCFunction)(void (*)(void))cf_py_chunk_unpack, METH_FASTCALL,
     cf_py_chunk_unpack_doc},
    {"chunk_pack", (PyCFunction)(void (*)(void))cf_py_chunk_pack, METH_FASTCALL,
     cf_py_chunk_pack_doc},
    {"scale_cast_add", (PyCFunction)(void (*)(void))cf_py_scale_cast_add, METH_FASTCALL,
     cf_py_scale_cast_add_doc},
    {"norm_partial", (PyCFunction)(void (*)(void))cf_py_norm_partial, METH_FASTCALL,
     cf_py_norm_partial_doc},
    /* shared-memory collectives (the block above cf_py_methods) */
    {"shm_reduce", (PyCFunction)(void (*)(void))cf_py_shm_reduce, METH_FASTCALL,
     cf_py_shm_reduce_doc},
    {"shm_memcpy", (PyCFunction)(void (*)(void))cf_py_shm_memcpy, METH_FASTCALL,
     cf_py_shm_memcpy_doc},
    {"shm_segment_bytes", (PyCFunction)(void (*)(void))cf_py_shm_segment_bytes, METH_FASTCALL,
     cf_py_shm_segment_bytes_doc},
    /* fused optimizer steps (optimizer block above) */
    {"adam_step", (PyCFunction)(void (*)(void))cf_py_adam_step, METH_FASTCALL,
     cf_py_adam_step_doc},
    {"sgd_step", (PyCFunction)(void (*)(void))cf_py_sgd_step, METH_FASTCALL,
     cf_py_sgd_step_doc},
    {"optim_uses_avx2", cf_py_optim_uses_avx2, METH_NOARGS, cf_py_optim_uses_avx2_doc},
    /* bulk binding (the block above cf_py_methods) */
    {"dict_set", (PyCFunction)(void (*)(void))cf_py_dict_set, METH_FASTCALL, cf_py_dict_set_doc},
    {"dict_pop", (PyCFunction)(void (*)(void))cf_py_dict_pop, METH_FASTCALL, cf_py_dict_pop_doc},
    {"attr_flags", (PyCFunction)(void (*)(void))cf_py_attr_flags, METH_FASTCALL,
     cf_py_attr_flags_doc},
    {"attr_set", (PyCFunction)(void (*)(void))cf_py_attr_set, METH_FASTCALL, cf_py_attr_set_doc},
    {"attr_get", (PyCFunction)(void (*)(void))cf_py_attr_get, METH_FASTCALL, cf_py_attr_get_doc},
    {"sole_owner", (PyCFunction)(void (*)(void))cf_py_sole_owner, METH_FASTCALL,
     cf_py_sole_owner_doc},
    {"shape_views", (PyCFunction)(void (*)(void))cf_py_shape_views, METH_FASTCALL,
     cf_py_shape_views_doc},
    {NULL, NULL, 0, NULL}};

/* Py_mod_exec: add the dtype codes and the chunk copies' threading constants;
 * 0 on success, -1 on error. */
static int cf_py_exec(PyObject *m)
{
    if (PyModule_AddIntConstant(m, "DTYPE_FP32", CF_DTYPE_FP32) < 0 ||
        PyModule_AddIntConstant(m, "DTYPE_FP64", CF_DTYPE_FP64) < 0 ||
        PyModule_AddIntConstant(m, "DTYPE_BF16", CF_DTYPE_BF16) < 0 ||
        PyModule_AddIntConstant(m, "DTYPE_FP16", CF_DTYPE_FP16) < 0 ||
        PyModule_AddIntConstant(m, "CHUNK_PARALLEL_BYTES", (long)CF_CHUNK_PARALLEL_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "MAX_THREADS", CF_MAX_THREADS) < 0 ||
        PyModule_AddIntConstant(m, "OPTIM_PARALLEL_BYTES", (long)CF_OPTIM_PARALLEL_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "MAX_WORLD_SIZE", CF_MAX_WORLD_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "MAX_PIECES", (long)CF_MAX_PIECES) < 0)
        return -1;
    return cf_py_shm_exec(m);
}

static PyModuleDef_Slot cf_py_slots[] = {
    {Py_mod_exec, (void *)cf_py_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_GIL_DISABLED
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL}};

PyDoc_STRVAR(cf_py_module_doc,
"The C core of cfsdp: flat layout planning, shard copies, FSDP2 chunk\n"
"copy-in/copy-out, gradient scale/cast/accumulate and gradient-norm\n"
"partials.  Use it through cfsdp._core; every function has a pure-Python\n"
"twin in cfsdp._ref.");

static struct PyModuleDef cf_py_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cfsdp._C",
    .m_doc = cf_py_module_doc,
    .m_size = 0,
    .m_methods = cf_py_methods,
    .m_slots = cf_py_slots,
};

PyMODINIT_FUNC PyInit__C(void)
{
    return PyModuleDef_Init(&cf_py_module);
}
