/*
 * bind_core.c -- the entry points of cfsdp._C over the per-unit C core:
 * plan_layout (layout.c), shard_fill (copy.c), chunk_unpack / chunk_pack
 * (chunk.c), scale_cast_add (reduce.c), norm_partial (norm.c).  Twins:
 * cfsdp._ref; dispatcher: cfsdp._core.
 *
 * Design.  Each function parses its arguments with one cf_py_parse table,
 * reads its sequence argument (numels, sources, the chunk plan) through
 * cf_py_rows into a malloc'd C array, calls the core with the GIL released
 * (the core validates everything it can before touching a byte), and raises
 * through cf_py_raise.  Nothing here keeps state between calls.
 */
#include "bind.h" /* first: it includes Python.h */

#include <stdlib.h>

#include "chunk.h"
#include "copy.h"
#include "layout.h"
#include "norm.h"
#include "reduce.h"

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

CF_PY_DOC(plan_layout,
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
"align_numel < 0, world_size outside [1, MAX_WORLD_SIZE] or more than\n"
"MAX_PIECES (rank, parameter) pieces; OverflowError if sizes overflow int64.");

static const cf_py_rows_spec cf_py_numels_spec = {
    "numels must be a sequence of ints", NULL, NULL, NULL, 1, {{"numel", false}}};

PyObject *cf_py_plan_layout(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *numels_obj, *seq = NULL, *result = NULL, *offsets_t = NULL, *slices_t = NULL;
    int64_t *numels = NULL, *offsets = NULL, *slices = NULL;
    int64_t align_numel, world_size, flat_numel = 0, shard_numel = 0;
    size_t n, n_slices = 0;
    cf_err err;
    cf_status st;
    const cf_py_arg table[] = {{"numels", CF_PY_OBJ, &numels_obj},
                               {"align_numel", CF_PY_I64, &align_numel},
                               {"world_size", CF_PY_I64, &world_size}};

    (void)module;
    cf_err_init(&err);
    if (cf_py_parse("plan_layout", args, nargs, table, CF_PY_COUNT(table)) < 0)
        return NULL;
    /* the sizes are bounded (cf_layout_slices_len) before anything is converted */
    seq = cf_py_snapshot(numels_obj, cf_py_numels_spec.seq_msg);
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

CF_PY_DOC(shard_fill,
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

PyObject *cf_py_shard_fill(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *srcs_obj, *result = NULL;
    cf_copy_src *srcs = NULL;
    int64_t *rows = NULL;
    void *dst;
    int64_t dst_numel, elem_size, shard_start;
    size_t n;
    cf_err err;
    cf_status st;
    const cf_py_arg table[] = {{"dst_addr", CF_PY_ADDR, &dst},
                               {"dst_numel", CF_PY_I64, &dst_numel},
                               {"elem_size", CF_PY_I64, &elem_size},
                               {"shard_start", CF_PY_I64, &shard_start},
                               {"srcs", CF_PY_OBJ, &srcs_obj}};

    (void)module;
    cf_err_init(&err);
    if (cf_py_parse("shard_fill", args, nargs, table, CF_PY_COUNT(table)) < 0 ||
        cf_py_rows(srcs_obj, &cf_py_srcs_spec, &rows, &n) < 0)
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
    "plan must be a sequence of (nat_off, numel, chunk_numel, shard_off, outer) tuples",
    "each plan entry must be a tuple (nat_off, numel, chunk_numel, shard_off, outer)",
    "plan param", "(nat_off, numel, chunk_numel, shard_off, outer)", 5,
    {{"nat_off", false}, {"numel", false}, {"chunk_numel", false}, {"shard_off", false},
     {"outer", false}}};

/*
 * Read a unit's plan: `params_obj`, a sequence of (nat_off, numel,
 * chunk_numel, shard_off, outer) rows, into a malloc'd array that plan->params
 * points at (the caller frees it; NULL after an error); plan->world_size and
 * plan->shard_numel are the caller's.  0, or -1 with an exception set.
 */
static int cf_py_chunk_plan(PyObject *params_obj, cf_chunk_plan *plan)
{
    cf_chunk_param *out;
    int64_t *rows;
    size_t n;

    plan->params = NULL;
    plan->n_params = 0;
    if (cf_py_rows(params_obj, &cf_py_plan_spec, &rows, &n) < 0)
        return -1;
    out = malloc((n ? n : 1) * sizeof *out);
    if (out == NULL) {
        free(rows);
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        out[i].nat_off = rows[5 * i];
        out[i].numel = rows[5 * i + 1];
        out[i].chunk_numel = rows[5 * i + 2];
        out[i].shard_off = rows[5 * i + 3];
        out[i].outer = rows[5 * i + 4];
    }
    free(rows);
    plan->params = out;
    plan->n_params = n;
    return 0;
}

CF_PY_DOC(chunk_unpack,
"chunk_unpack($module, dst_addr, dst_numel, src_addr, src_numel, elem_size,\n"
"             plan, world_size, shard_numel, max_threads, /)\n"
"--\n"
"\n"
"FSDP2 copy-out: the rank-major all-gather output src -> the natural buffer dst.\n"
"\n"
"plan is a sequence of (nat_off, numel, chunk_numel, shard_off, outer), one\n"
"per parameter; src has world_size * shard_numel elements.  With outer == 1\n"
"(sharded on dim 0) rank k's part of a parameter, natural elements\n"
"[nat_off + k*chunk_numel, nat_off + min((k+1)*chunk_numel, numel)), is read\n"
"from src[k*shard_numel + shard_off:]; with outer > 1 (Shard(d), d > 0, even:\n"
"numel == world_size * chunk_numel) rank k's chunk is outer blocks of\n"
"blk = chunk_numel / outer elements, block o at natural element\n"
"nat_off + o*(numel / outer) + k*blk.\n"
"Bytes are copied exactly (elem_size bytes per element); chunk padding is\n"
"not read and dst outside the parameters is not written.  Same bytes as\n"
"cfsdp._ref.chunk_unpack.  Runs with the GIL released, on up to\n"
"min(max_threads, 4, online CPUs) threads above CHUNK_PARALLEL_BYTES.\n"
"ValueError (naming the parameter index) for a plan that does not fit the\n"
"buffers, a wrong src_numel, negative sizes or NULL addresses.");

PyObject *cf_py_chunk_unpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *plan_obj;
    cf_chunk_plan plan;
    void *dst, *src;
    int64_t dst_numel, src_numel, elem_size, max_threads;
    cf_err err;
    cf_status st;
    const cf_py_arg table[] = {{"dst_addr", CF_PY_ADDR, &dst},
                               {"dst_numel", CF_PY_I64, &dst_numel},
                               {"src_addr", CF_PY_ADDR, &src},
                               {"src_numel", CF_PY_I64, &src_numel},
                               {"elem_size", CF_PY_I64, &elem_size},
                               {"plan", CF_PY_OBJ, &plan_obj},
                               {"world_size", CF_PY_I64, &plan.world_size},
                               {"shard_numel", CF_PY_I64, &plan.shard_numel},
                               {"max_threads", CF_PY_I64, &max_threads}};

    (void)module;
    cf_err_init(&err);
    if (cf_py_parse("chunk_unpack", args, nargs, table, CF_PY_COUNT(table)) < 0 ||
        cf_py_chunk_plan(plan_obj, &plan) < 0)
        return NULL;

    Py_BEGIN_ALLOW_THREADS
    st = cf_chunk_unpack(dst, dst_numel, src, src_numel, elem_size, &plan, max_threads, &err);
    Py_END_ALLOW_THREADS
    free((void *)plan.params);
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

CF_PY_DOC(chunk_pack,
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

PyObject *cf_py_chunk_pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *plan_obj;
    cf_chunk_plan plan;
    void *dst, *src;
    int64_t dst_numel, dst_code, src_numel, src_code, rank_lo, rank_hi, max_threads;
    double divisor;
    cf_err err;
    cf_status st;
    const cf_py_arg table[] = {{"dst_addr", CF_PY_ADDR, &dst},
                               {"dst_numel", CF_PY_I64, &dst_numel},
                               {"dst_dtype_code", CF_PY_I64, &dst_code},
                               {"src_addr", CF_PY_ADDR, &src},
                               {"src_numel", CF_PY_I64, &src_numel},
                               {"src_dtype_code", CF_PY_I64, &src_code},
                               {"plan", CF_PY_OBJ, &plan_obj},
                               {"world_size", CF_PY_I64, &plan.world_size},
                               {"shard_numel", CF_PY_I64, &plan.shard_numel},
                               {"rank_lo", CF_PY_I64, &rank_lo},
                               {"rank_hi", CF_PY_I64, &rank_hi},
                               {"divisor", CF_PY_F64, &divisor},
                               {"max_threads", CF_PY_I64, &max_threads}};

    (void)module;
    cf_err_init(&err);
    if (cf_py_parse("chunk_pack", args, nargs, table, CF_PY_COUNT(table)) < 0 ||
        cf_py_check_dtype_codes(dst_code, src_code) < 0 || cf_py_chunk_plan(plan_obj, &plan) < 0)
        return NULL;

    Py_BEGIN_ALLOW_THREADS
    st = cf_chunk_pack(dst, dst_numel, (int)dst_code, src, src_numel, (int)src_code, &plan,
                       rank_lo, rank_hi, divisor, max_threads, &err);
    Py_END_ALLOW_THREADS
    free((void *)plan.params);
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

CF_PY_DOC(scale_cast_add,
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

PyObject *cf_py_scale_cast_add(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    void *dst, *src;
    int64_t dst_code, src_code, numel;
    double divisor;
    bool accumulate;
    cf_err err;
    cf_status st;
    const cf_py_arg table[] = {{"dst_addr", CF_PY_ADDR, &dst},
                               {"dst_dtype_code", CF_PY_I64, &dst_code},
                               {"src_addr", CF_PY_ADDR, &src},
                               {"src_dtype_code", CF_PY_I64, &src_code},
                               {"numel", CF_PY_I64, &numel},
                               {"divisor", CF_PY_F64, &divisor},
                               {"accumulate", CF_PY_BOOL, &accumulate}};

    (void)module;
    cf_err_init(&err);
    if (cf_py_parse("scale_cast_add", args, nargs, table, CF_PY_COUNT(table)) < 0 ||
        cf_py_check_dtype_codes(dst_code, src_code) < 0)
        return NULL;

    Py_BEGIN_ALLOW_THREADS
    st = cf_reduce_scale_cast_add(dst, (int)dst_code, src, (int)src_code, numel, divisor,
                                  accumulate, &err);
    Py_END_ALLOW_THREADS
    if (st != CF_OK)
        return cf_py_raise(&err);
    Py_RETURN_NONE;
}

CF_PY_DOC(norm_partial,
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

PyObject *cf_py_norm_partial(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    void *src;
    int64_t code, numel;
    double p, out = 0.0;
    cf_err err;
    cf_status st;
    const cf_py_arg table[] = {{"src_addr", CF_PY_ADDR, &src},
                               {"dtype_code", CF_PY_I64, &code},
                               {"numel", CF_PY_I64, &numel},
                               {"p", CF_PY_F64, &p}};

    (void)module;
    cf_err_init(&err);
    if (cf_py_parse("norm_partial", args, nargs, table, CF_PY_COUNT(table)) < 0)
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
