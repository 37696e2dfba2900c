/*
 * bind_bulk.c -- the bulk binding of cfsdp._C: dict_set, dict_pop, attr_flags,
 * attr_set, attr_get, shape_views.  Twins: cfsdp._ref.bind.
 *
 * Design.  The runtime's per-step bookkeeping touches every parameter of a
 * unit: module attributes bound to forward views or to the registered
 * parameters, gradients published, requires_grad read.  These entry points do
 * one such pass in C over tuples the runtime builds once per unit, so no hook
 * runs Python bytecode per parameter.  They work on any Python objects and
 * touch no tensor memory (so they serve every device).  Their arguments are
 * tuples (immutable: Python code run by an item, a key's __eq__ or a view(),
 * cannot change what is being read), checked in full before anything is
 * written where a pass writes (dict_set, dict_pop); the messages are the
 * twins'.
 */
#include "bind.h" /* first: it includes Python.h */

/* `obj` must be a tuple (CF_PY_TUPLE); its size in *n.  0, or -1 with TypeError. */
static int cf_py_tuple(PyObject *obj, const char *fname, const char *what, Py_ssize_t *n)
{
    PyObject *t;
    const cf_py_arg a = {what, CF_PY_TUPLE, &t};
    if (cf_py_convert(fname, obj, &a) < 0)
        return -1;
    *n = PyTuple_GET_SIZE(t);
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

/* The (objs, name[, values]) arguments of attr_flags / attr_get / attr_set (`expected`
 * of them): objs a tuple (its size in *n), name a str.  0, or -1 with an exception. */
static int cf_py_objs_name(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t expected,
                           const char *fname, Py_ssize_t *n)
{
    PyObject *objs, *name, *values;
    const cf_py_arg table[] = {{"objs", CF_PY_TUPLE, &objs},
                               {"name", CF_PY_STR, &name},
                               {"values", CF_PY_OBJ, &values}};
    if (cf_py_parse(fname, args, nargs, table, expected) < 0)
        return -1;
    *n = PyTuple_GET_SIZE(objs);
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

CF_PY_DOC(dict_set,
"dict_set($module, dicts, keys, values, /)\n"
"--\n"
"\n"
"dicts[i][keys[i]] = values[i] for every i (three tuples of one length).");

PyObject *cf_py_dict_set(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
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

CF_PY_DOC(dict_pop,
"dict_pop($module, dicts, keys, /)\n"
"--\n"
"\n"
"dicts[i].pop(keys[i], None) for every i (two tuples of one length).");

PyObject *cf_py_dict_pop(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
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

CF_PY_DOC(attr_flags,
"attr_flags($module, objs, name, /)\n"
"--\n"
"\n"
"bytes(bool(getattr(o, name)) for o in objs): one byte, 0 or 1, per object.");

PyObject *cf_py_attr_flags(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
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

CF_PY_DOC(attr_set,
"attr_set($module, objs, name, values, /)\n"
"--\n"
"\n"
"setattr(objs[i], name, values[i]) for every i; values may be a tuple of one\n"
"length with objs, or None (every attribute set to None).");

PyObject *cf_py_attr_set(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
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

CF_PY_DOC(attr_get,
"attr_get($module, objs, name, /)\n"
"--\n"
"\n"
"tuple(getattr(o, name) for o in objs).");

PyObject *cf_py_attr_get(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
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

CF_PY_DOC(shape_views,
"shape_views($module, chunks, index, shapes, trainable, occ_index, /)\n"
"--\n"
"\n"
"A unit's forward views from the pieces of its split flat parameter: view i\n"
"is chunks[index[i]].view(shapes[i]) (the piece itself where shapes[i] is\n"
"None), detached where the bytes `trainable` (or None: all) hold 0.  Returns\n"
"the tuple of view occ_index[k] for every k.");

PyObject *cf_py_shape_views(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
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
