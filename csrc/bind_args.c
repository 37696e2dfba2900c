/*
 * bind_args.c -- argument conversion and the status-to-exception mapping of
 * cfsdp._C (declared in bind.h, used by every bind_*.c file).
 *
 * Design.  Every conversion either stores a plain C value or raises and
 * returns -1, so an entry point is a parse, a GIL-free call into the core,
 * and one cf_py_raise on failure.  Addresses take ints only (no __index__: no
 * Python code runs while one is read) and must lie in [0, 2**63).  Sequences
 * are read through a snapshot tuple, because converting an item may run
 * Python code (its __index__) that changes the sequence being read; the
 * converted values land in a malloc'd int64 array, so nothing Python-side is
 * read once the GIL is released.  Stateless: no globals.
 */
#include "bind.h" /* first: it includes Python.h */

#include <stdlib.h>

PyObject *cf_py_raise(const cf_err *err)
{
    PyObject *type;
    switch (err->status) {
    case CF_EINVAL: type = PyExc_ValueError; break;
    case CF_EOVERFLOW: type = PyExc_OverflowError; break;
    case CF_ENOMEM: type = PyExc_MemoryError; break;
    case CF_ERUNTIME: type = PyExc_RuntimeError; break;
    case CF_EPERM: type = PyExc_PermissionError; break;
    default: type = PyExc_SystemError; break;
    }
    PyErr_SetString(type, err->msg[0] ? err->msg : "cfsdp._C: unknown error");
    return NULL;
}

int cf_py_int64(PyObject *obj, const char *what, int64_t *out)
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

/* An int address (e.g. Tensor.data_ptr()) as a pointer: an int in [0, 2**63),
 * read without __index__; ValueError for a negative or larger one.  0 or -1. */
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

int cf_py_check_dtype_codes(int64_t dst_code, int64_t src_code)
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

int cf_py_convert(const char *fname, PyObject *obj, const cf_py_arg *a)
{
    switch (a->kind) {
    case CF_PY_I64:
        return cf_py_int64(obj, a->name, a->out);
    case CF_PY_ADDR:
        return cf_py_addr(obj, a->name, a->out);
    case CF_PY_OPT_ADDR:
        if (obj == Py_None) {
            *(void **)a->out = NULL;
            return 0;
        }
        return cf_py_addr(obj, a->name, a->out);
    case CF_PY_F64: {
        double v = PyFloat_AsDouble(obj);
        if (v == -1.0 && PyErr_Occurred())
            return -1;
        *(double *)a->out = v;
        return 0;
    }
    case CF_PY_BOOL: {
        int v = PyObject_IsTrue(obj);
        if (v < 0)
            return -1;
        *(bool *)a->out = v != 0;
        return 0;
    }
    case CF_PY_DTYPE: {
        int64_t v;
        if (cf_py_int64(obj, a->name, &v) < 0)
            return -1;
        *(int *)a->out = v >= 0 && v < CF_DTYPE_COUNT ? (int)v : -1;
        return 0;
    }
    case CF_PY_TUPLE:
        if (!PyTuple_Check(obj)) {
            PyErr_Format(PyExc_TypeError, "%s(): %s must be a tuple, not %.100s", fname, a->name,
                         Py_TYPE(obj)->tp_name);
            return -1;
        }
        *(PyObject **)a->out = obj;
        return 0;
    case CF_PY_STR:
        if (!PyUnicode_Check(obj)) {
            PyErr_Format(PyExc_TypeError, "%s(): %s must be a str", fname, a->name);
            return -1;
        }
        *(PyObject **)a->out = obj;
        return 0;
    case CF_PY_OBJ:
        *(PyObject **)a->out = obj;
        return 0;
    }
    PyErr_Format(PyExc_SystemError, "%s(): argument %s has no kind", fname, a->name);
    return -1;
}

int cf_py_check_nargs(const char *fname, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs == expected)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd positional arguments (%zd given)",
                 fname, expected, nargs);
    return -1;
}

int cf_py_parse(const char *fname, PyObject *const *args, Py_ssize_t nargs,
                const cf_py_arg *table, Py_ssize_t n)
{
    if (cf_py_check_nargs(fname, nargs, n) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (cf_py_convert(fname, args[i], &table[i]) < 0)
            return -1;
    return 0;
}

PyObject *cf_py_snapshot(PyObject *obj, const char *msg)
{
    PyObject *fast, *tuple;
    /* str, bytes and bytearray iterate as characters or small ints: b"7" would read as the
       address 55.  No argument of cfsdp is ever one of them where a sequence is asked for. */
    if (PyUnicode_Check(obj) || PyBytes_Check(obj) || PyByteArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s, got %.100s", msg, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    fast = PySequence_Fast(obj, msg);
    if (fast == NULL || PyTuple_CheckExact(fast))
        return fast;
    tuple = PySequence_Tuple(fast);
    Py_DECREF(fast);
    return tuple;
}

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

int cf_py_rows(PyObject *obj, const cf_py_rows_spec *spec, int64_t **out, size_t *n)
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
