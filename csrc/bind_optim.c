/*
 * bind_optim.c -- the fused optimizer steps of cfsdp._C (csrc/optim.c):
 * adam_step, sgd_step, muon_momentum, optim_uses_avx2.  Twin: cfsdp._ref.optim; callers:
 * cfsdp._core (tensors) and cfsdp.optim (addresses of whole flat shards).
 *
 * Design.  A step is one cf_py_parse table (buffers, dtype code,
 * hyper-parameters, flags, thread cap) plus its ranges, copied into a
 * malloc'd array of cf_optim_range (from an int64 buffer such as
 * array('q'), or a sequence of (start, len) pairs through cf_py_rows) before
 * the GIL is released: the core checks the ranges once and then walks them,
 * so nothing another thread writes may change them in between.  The caller
 * promises that every range of every buffer is memory it owns.
 */
#include "bind.h" /* first: it includes Python.h */

#include <stdlib.h>
#include <string.h>

#include "optim.h"

static const cf_py_rows_spec cf_py_ranges_spec = {
    "ranges must be an int64 buffer or a sequence of (start, len) pairs",
    "each range must be a (start, len) pair", "range", "(start, len)", 2,
    {{"range start", false}, {"range len", false}}};

/*
 * The ranges argument: an object exposing a C-contiguous buffer of int64
 * (format 'q' or 'l' with 8-byte items, e.g. array.array('q')) holding start,
 * len pairs, or a sequence of (start, len) pairs.  On success *out is a
 * malloc'd copy of the pairs (the caller frees it) and *n their count; -1
 * with an exception set otherwise (TypeError for another buffer format).
 */
static int cf_py_optim_ranges(PyObject *obj, cf_optim_range **out, size_t *n)
{
    int64_t *rows;
    size_t count;

    *out = NULL;
    if (PyObject_CheckBuffer(obj)) {
        Py_buffer view;
        const char *f;
        if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        f = view.format ? view.format : "B";
        if (f[0] == '@' || f[0] == '=' || f[0] == '<')
            f++;
        if (view.itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0) ||
            view.len % (Py_ssize_t)sizeof(cf_optim_range) != 0) {
            PyErr_Format(PyExc_TypeError,
                         "ranges buffer must hold int64 (start, len) pairs, got format '%s' "
                         "with %zd-byte items and %zd bytes",
                         view.format ? view.format : "B", view.itemsize, view.len);
            PyBuffer_Release(&view);
            return -1;
        }
        count = (size_t)(view.len / (Py_ssize_t)sizeof(cf_optim_range));
        *out = malloc((count ? count : 1) * sizeof **out);
        if (*out != NULL && count > 0)
            memcpy(*out, view.buf, count * sizeof **out); /* any alignment */
        PyBuffer_Release(&view);
        if (*out == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *n = count;
        return 0;
    }
    if (cf_py_rows(obj, &cf_py_ranges_spec, &rows, &count) < 0)
        return -1;
    *out = malloc((count ? count : 1) * sizeof **out);
    if (*out == NULL) {
        free(rows);
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < count; i++) {
        (*out)[i].start = rows[2 * i];
        (*out)[i].len = rows[2 * i + 1];
    }
    free(rows);
    *n = count;
    return 0;
}

CF_PY_DOC(adam_step,
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
"(dtype code 0), buffers at fp32-aligned addresses.  Runs with the GIL\n"
"released, on up to min(max_threads, 4, online CPUs) threads above\n"
"OPTIM_PARALLEL_BYTES.  ValueError for another dtype, a NULL or misaligned\n"
"buffer, bad or unordered ranges, overlapping buffers or step < 1;\n"
"OverflowError if an offset overflows.");

PyObject *cf_py_adam_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *ranges_obj;
    cf_optim_range *ranges;
    size_t n;
    void *p, *g, *m, *v, *vmax;
    int64_t code, max_threads;
    cf_adam_args a;
    cf_err err;
    cf_status st;
    const cf_py_arg table[] = {{"param_addr", CF_PY_ADDR, &p},
                               {"grad_addr", CF_PY_ADDR, &g},
                               {"exp_avg_addr", CF_PY_ADDR, &m},
                               {"exp_avg_sq_addr", CF_PY_ADDR, &v},
                               {"max_exp_avg_sq_addr", CF_PY_OPT_ADDR, &vmax},
                               {"ranges", CF_PY_OBJ, &ranges_obj},
                               {"dtype_code", CF_PY_I64, &code},
                               {"lr", CF_PY_F64, &a.lr},
                               {"beta1", CF_PY_F64, &a.beta1},
                               {"beta2", CF_PY_F64, &a.beta2},
                               {"eps", CF_PY_F64, &a.eps},
                               {"weight_decay", CF_PY_F64, &a.weight_decay},
                               {"step", CF_PY_F64, &a.step},
                               {"decoupled", CF_PY_BOOL, &a.decoupled},
                               {"amsgrad", CF_PY_BOOL, &a.amsgrad},
                               {"maximize", CF_PY_BOOL, &a.maximize},
                               {"max_threads", CF_PY_I64, &max_threads}};

    (void)module;
    cf_err_init(&err);
    if (cf_py_parse("adam_step", args, nargs, table, CF_PY_COUNT(table)) < 0 ||
        cf_py_optim_ranges(ranges_obj, &ranges, &n) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    st = cf_optim_adam_step(p, g, m, v, vmax, ranges, n, (int)code, &a, max_threads, &err);
    Py_END_ALLOW_THREADS
    free(ranges);
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

CF_PY_DOC(sgd_step,
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

PyObject *cf_py_sgd_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *ranges_obj;
    cf_optim_range *ranges;
    size_t n;
    void *p, *g, *b;
    int64_t code, max_threads;
    cf_sgd_args a;
    cf_err err;
    cf_status st;
    const cf_py_arg table[] = {{"param_addr", CF_PY_ADDR, &p},
                               {"grad_addr", CF_PY_ADDR, &g},
                               {"momentum_buffer_addr", CF_PY_OPT_ADDR, &b},
                               {"ranges", CF_PY_OBJ, &ranges_obj},
                               {"dtype_code", CF_PY_I64, &code},
                               {"lr", CF_PY_F64, &a.lr},
                               {"momentum", CF_PY_F64, &a.momentum},
                               {"dampening", CF_PY_F64, &a.dampening},
                               {"weight_decay", CF_PY_F64, &a.weight_decay},
                               {"nesterov", CF_PY_BOOL, &a.nesterov},
                               {"maximize", CF_PY_BOOL, &a.maximize},
                               {"first_step", CF_PY_BOOL, &a.first_step},
                               {"max_threads", CF_PY_I64, &max_threads}};

    (void)module;
    cf_err_init(&err);
    if (cf_py_parse("sgd_step", args, nargs, table, CF_PY_COUNT(table)) < 0 ||
        cf_py_optim_ranges(ranges_obj, &ranges, &n) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    st = cf_optim_sgd_step(p, g, b, ranges, n, (int)code, &a, max_threads, &err);
    Py_END_ALLOW_THREADS
    free(ranges);
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

CF_PY_DOC(muon_momentum,
"muon_momentum($module, grad_addr, momentum_buffer_addr, update_addr, ranges,\n"
"              dtype_code, momentum, nesterov, max_threads, /)\n"
"--\n"
"\n"
"Muon's momentum over many element ranges, in place: momentum_buffer.lerp_(\n"
"grad, 1 - momentum) and, when nesterov, update = grad.lerp(momentum_buffer,\n"
"momentum) (update_addr is used only when nesterov: 0 or None otherwise).\n"
"Ranges as adam_step.  torch 2.13's _single_tensor_muon, with adam_step's\n"
"rounding contract, threads and errors.");

PyObject *cf_py_muon_momentum(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *ranges_obj;
    cf_optim_range *ranges;
    size_t n;
    void *g, *b, *u;
    int64_t code, max_threads;
    double momentum;
    bool nesterov;
    cf_err err;
    cf_status st;
    const cf_py_arg table[] = {{"grad_addr", CF_PY_ADDR, &g},
                               {"momentum_buffer_addr", CF_PY_ADDR, &b},
                               {"update_addr", CF_PY_OPT_ADDR, &u},
                               {"ranges", CF_PY_OBJ, &ranges_obj},
                               {"dtype_code", CF_PY_I64, &code},
                               {"momentum", CF_PY_F64, &momentum},
                               {"nesterov", CF_PY_BOOL, &nesterov},
                               {"max_threads", CF_PY_I64, &max_threads}};

    (void)module;
    cf_err_init(&err);
    if (cf_py_parse("muon_momentum", args, nargs, table, CF_PY_COUNT(table)) < 0 ||
        cf_py_optim_ranges(ranges_obj, &ranges, &n) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    st = cf_optim_muon_momentum(g, b, u, ranges, n, (int)code, momentum, nesterov,
                                max_threads, &err);
    Py_END_ALLOW_THREADS
    free(ranges);
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

CF_PY_DOC(optim_uses_avx2,
"optim_uses_avx2($module, /)\n"
"--\n"
"\n"
"Whether adam_step / sgd_step run their AVX2+FMA loops on this CPU (the\n"
"portable loops give the same bits).");

PyObject *cf_py_optim_uses_avx2(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyBool_FromLong(cf_optim_uses_avx2());
}
