/*
 * bind.h -- what the binding files of cfsdp._C share: argument conversion, the
 * status-to-exception mapping, the module state and the entry points that
 * module.c's table lists.  Internal: only module.c and the bind_*.c files
 * include it (they are the only files that include Python.h).
 *
 * Design.  The CPython binding is one file per concern, each over its part of
 * the C core: bind_core.c (layout, shard fill, FSDP2 chunk copies,
 * scale/cast/accumulate, norm partials), bind_shm.c (the shared-memory
 * kernels and the ShmGroup / ShmWork types), bind_optim.c (the fused
 * optimizer steps), bind_bulk.c (the runtime's per-parameter passes over
 * Python objects), bind_args.c (the functions declared here), module.c (the
 * one module table, the module state, initialisation).  An entry point
 * converts its arguments (METH_FASTCALL, positional only) into plain C values
 * and malloc'd arrays while holding the GIL, releases the GIL around the
 * pure-C work, and returns NULL with an exception set on any error.  Tensors
 * arrive as integer addresses; C never allocates or frees tensor memory and
 * the caller keeps it alive.
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
 *
 * Arguments are converted by one table-driven parser, cf_py_parse: a table of
 * (name, kind, where to store) per entry point, one row per positional
 * argument, converted in order.  Errors: a wrong count or type is TypeError
 * (from the parser), a failing cf_status becomes an exception in exactly one
 * place, cf_py_raise.
 */
#ifndef CF_BIND_H
#define CF_BIND_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdbool.h>
#include <stdint.h>

#include "cfsdp.h"

/* The module's state (PEP 489): the types its exec slot made.  No globals. */
typedef struct {
    PyObject *shm_group_type;
    PyObject *shm_work_type;
    PyObject *shm_segment_type;
} cf_py_state;

/* ------------------------------------------------------------------ errors */

/*
 * Raise the Python exception for a failed status, the only mapping of
 * statuses to exceptions: CF_EINVAL -> ValueError, CF_EOVERFLOW ->
 * OverflowError, CF_ENOMEM -> MemoryError, CF_ERUNTIME -> RuntimeError (a
 * collective or a system call failed), CF_EPERM -> PermissionError (a file
 * that is not this job's), anything else SystemError; the
 * message is err->msg.  Always returns NULL.
 */
PyObject *cf_py_raise(const cf_err *err);

/* ---------------------------------------------------------------- arguments */

/* How cf_py_parse converts one argument, and what `out` points at. */
typedef enum {
    CF_PY_I64,      /* int64_t: an int, or any object with __index__ ("%s must be an int") */
    CF_PY_ADDR,     /* void *: an int (no __index__) in [0, 2**63) (cf_py_addr) */
    CF_PY_OPT_ADDR, /* void *: as CF_PY_ADDR, or None for NULL */
    CF_PY_F64,      /* double: PyFloat_AsDouble (a float, __float__ or __index__) */
    CF_PY_BOOL,     /* bool: the object's truth value */
    CF_PY_DTYPE,    /* int: a dtype code as CF_PY_I64; -1 for one outside cf_dtype */
    CF_PY_TUPLE,    /* PyObject * (borrowed): a tuple ("%s(): %s must be a tuple") */
    CF_PY_STR,      /* PyObject * (borrowed): a str ("%s(): %s must be a str") */
    CF_PY_OBJ       /* PyObject * (borrowed): anything, read by the caller afterwards */
} cf_py_kind;

/* One positional argument: its name (in messages), its kind, where it goes. */
typedef struct {
    const char *name;
    cf_py_kind kind;
    void *out;
} cf_py_arg;

/* The number of rows of a cf_py_arg table (an array). */
#define CF_PY_COUNT(table) ((Py_ssize_t)(sizeof(table) / sizeof((table)[0])))

/*
 * Check that `nargs` is `n` (TypeError "<fname>() takes exactly n positional
 * arguments (k given)") and convert args[i] as table[i] says into
 * *table[i].out, for i in order.  0, or -1 with an exception set (what was
 * stored before the failing argument is unspecified).  Borrowed objects stay
 * valid while the caller's argument array does.
 */
int cf_py_parse(const char *fname, PyObject *const *args, Py_ssize_t nargs,
                const cf_py_arg *table, Py_ssize_t n);

/* Convert one argument `obj` as the table row `a` says (cf_py_parse's step, for
 * arguments read one by one); 0, or -1 with an exception set. */
int cf_py_convert(const char *fname, PyObject *obj, const cf_py_arg *a);

/* 0 if `nargs` is `expected`, else -1 with cf_py_parse's TypeError (for entry points
 * that read their arguments themselves). */
int cf_py_check_nargs(const char *fname, Py_ssize_t nargs, Py_ssize_t expected);

/* One CF_PY_I64 conversion (for values that are not arguments: items, fields). */
int cf_py_int64(PyObject *obj, const char *what, int64_t *out);

/* 0 if both are cf_dtype codes, else -1 with ValueError "unknown dtype code
 * (dst d, src s)". */
int cf_py_check_dtype_codes(int64_t dst_code, int64_t src_code);

/* ---------------------------------------------------------------- sequences */

/* The snapshot of a sequence argument: a new tuple of its items (a list is
 * copied, so Python code run while the items are converted cannot resize or
 * free what is read), or NULL with TypeError `msg`: also for str, bytes and
 * bytearray, which iterate as characters or small ints, never as the values
 * asked for (b"7" is not the address 55). */
PyObject *cf_py_snapshot(PyObject *obj, const char *msg);

/* One column of a row sequence: an int64 (CF_PY_I64 rules) or an address
 * (CF_PY_ADDR rules, stored as its integer value). */
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
    Py_ssize_t width; /* values a row (1 when flat) */
    cf_py_col cols[5];
} cf_py_rows_spec;

/*
 * Read the sequence argument `obj` as `spec` describes, through snapshots
 * (the sequence's and each row's), into a malloc'd array of *n x spec->width
 * int64 (row-major) that the caller frees (NULL when *n is 0).  0, or -1 with
 * an exception set (and nothing to free).
 */
int cf_py_rows(PyObject *obj, const cf_py_rows_spec *spec, int64_t **out, size_t *n);

/* ------------------------------------------------------------- entry points */

/* A METH_FASTCALL function of the module and its docstring (module.c's table). */
#define CF_PY_DECLARE(name)                                                          \
    PyObject *cf_py_##name(PyObject *module, PyObject *const *args, Py_ssize_t nargs); \
    extern const char cf_py_##name##_doc[]

/* The docstring of entry point `name`, defined where it is (a signature line for
 * inspect.signature, then the contract). */
#define CF_PY_DOC(name, text) const char cf_py_##name##_doc[] = PyDoc_STR(text)

/* bind_core.c */
CF_PY_DECLARE(plan_layout);
CF_PY_DECLARE(shard_fill);
CF_PY_DECLARE(chunk_unpack);
CF_PY_DECLARE(chunk_pack);
CF_PY_DECLARE(scale_cast_add);
CF_PY_DECLARE(norm_partial);

/* bind_shm.c: the kernels; the types are made by cf_py_shm_exec */
CF_PY_DECLARE(shm_reduce);
CF_PY_DECLARE(shm_memcpy);
CF_PY_DECLARE(shm_segment_bytes);

/*
 * module.c's exec slot, for bind_shm.c: make the ShmWork and ShmGroup types
 * (into `state`, and as module attributes) and add the SHM_* constants.  0,
 * or -1 with an exception set.
 */
int cf_py_shm_exec(PyObject *module, cf_py_state *state);

/* bind_optim.c */
CF_PY_DECLARE(adam_step);
CF_PY_DECLARE(sgd_step);
CF_PY_DECLARE(muon_momentum);
PyObject *cf_py_optim_uses_avx2(PyObject *module, PyObject *unused); /* METH_NOARGS */
extern const char cf_py_optim_uses_avx2_doc[];

/* bind_bulk.c */
CF_PY_DECLARE(dict_set);
CF_PY_DECLARE(dict_pop);
CF_PY_DECLARE(attr_flags);
CF_PY_DECLARE(attr_set);
CF_PY_DECLARE(attr_get);
CF_PY_DECLARE(shape_views);

#endif /* CF_BIND_H */
