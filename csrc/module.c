/*
 * module.c -- the module cfsdp._C: its one table of functions, its state and
 * its initialisation.  The entry points live in one binding file per concern
 * (shared argument conversion and the status-to-exception mapping in
 * bind_args.c; see bind.h for the boundary's contract).  What the module
 * defines:
 *
 *   functions (cf_py_methods below; Python callers: cfsdp/_core.py)
 *     bind_core.c   plan_layout, shard_fill, chunk_unpack, chunk_pack,
 *                   scale_cast_add, norm_partial
 *     bind_shm.c    shm_reduce, shm_memcpy, shm_segment_bytes
 *     bind_optim.c  adam_step, sgd_step, muon_momentum, optim_uses_avx2
 *     bind_bulk.c   dict_set, dict_pop, attr_flags, attr_set, attr_get,
 *                   shape_views
 *   types (bind_shm.c, made by cf_py_shm_exec)
 *     ShmGroup      a host-shared segment and its worker thread: wait_attached,
 *                   all_gather, all_gather_unpack, reduce_scatter_pack,
 *                   reduce_scatter, all_reduce, broadcast, drain, fail,
 *                   failure, close; closed, rank, world_size, nbytes
 *     ShmWork       one queued collective: wait, is_completed, op
 *     ShmSegment    a checked host-shared file mapping (the buffer protocol):
 *                   unlink; nbytes, path
 *   constants
 *     here          DTYPE_FP32, DTYPE_FP64, DTYPE_BF16, DTYPE_FP16,
 *                   CHUNK_PARALLEL_BYTES, MAX_THREADS, OPTIM_PARALLEL_BYTES,
 *                   MAX_WORLD_SIZE, MAX_PIECES
 *     bind_shm.c    SHM_OP_ALL_GATHER, SHM_OP_REDUCE_SCATTER, SHM_OP_ALL_REDUCE,
 *                   SHM_OP_BROADCAST, SHM_OP_ALL_TO_ALL, SHM_MAX_WORLD, SHM_MIN_SLOT_PER_RANK,
 *                   SHM_AVAILABLE
 *
 * Design.  Multi-phase initialisation (PEP 489): the exec slot adds the
 * constants and makes the ShmWork / ShmGroup types, kept in the module's state
 * (cf_py_state) rather than in globals or looked up by attribute, so the module
 * is safe in sub-interpreters (one state each) and has no mutable globals.
 * The state holds its types strongly; traverse/clear/free let the collector see
 * and break the module <-> type cycle.
 */
#include "bind.h"
#include "chunk.h"
#include "optim.h"
#include "thread.h"

/* An entry of the table for a METH_FASTCALL function cf_py_<name> (bind.h). */
#define CF_PY_FASTCALL(name) \
    {#name, (PyCFunction)(void (*)(void))cf_py_##name, METH_FASTCALL, cf_py_##name##_doc}

static PyMethodDef cf_py_methods[] = {
    /* bind_core.c: the per-unit core */
    CF_PY_FASTCALL(plan_layout),
    CF_PY_FASTCALL(shard_fill),
    CF_PY_FASTCALL(chunk_unpack),
    CF_PY_FASTCALL(chunk_pack),
    CF_PY_FASTCALL(scale_cast_add),
    CF_PY_FASTCALL(norm_partial),
    /* bind_shm.c: the shared-memory kernels (ShmGroup / ShmWork: cf_py_shm_exec) */
    CF_PY_FASTCALL(shm_reduce),
    CF_PY_FASTCALL(shm_memcpy),
    CF_PY_FASTCALL(shm_segment_bytes),
    /* bind_optim.c: the fused optimizer steps */
    CF_PY_FASTCALL(adam_step),
    CF_PY_FASTCALL(sgd_step),
    CF_PY_FASTCALL(muon_momentum),
    {"optim_uses_avx2", cf_py_optim_uses_avx2, METH_NOARGS, cf_py_optim_uses_avx2_doc},
    /* bind_bulk.c: the runtime's per-parameter passes */
    CF_PY_FASTCALL(dict_set),
    CF_PY_FASTCALL(dict_pop),
    CF_PY_FASTCALL(attr_flags),
    CF_PY_FASTCALL(attr_set),
    CF_PY_FASTCALL(attr_get),
    CF_PY_FASTCALL(shape_views),
    {NULL, NULL, 0, NULL}};

/* Py_mod_exec: the constants, then the shared-memory types (into the state);
 * 0 on success, -1 on error. */
static int cf_py_exec(PyObject *m)
{
    cf_py_state *state = PyModule_GetState(m);
    if (state == NULL)
        return -1;
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
    return cf_py_shm_exec(m, state);
}

/* The state's part in the collector's graph (m_traverse / m_clear / m_free). */
static int cf_py_traverse(PyObject *m, visitproc visit, void *arg)
{
    cf_py_state *state = PyModule_GetState(m);
    if (state != NULL) {
        Py_VISIT(state->shm_group_type);
        Py_VISIT(state->shm_work_type);
        Py_VISIT(state->shm_segment_type);
    }
    return 0;
}

static int cf_py_clear(PyObject *m)
{
    cf_py_state *state = PyModule_GetState(m);
    if (state != NULL) {
        Py_CLEAR(state->shm_group_type);
        Py_CLEAR(state->shm_work_type);
        Py_CLEAR(state->shm_segment_type);
    }
    return 0;
}

static void cf_py_free(void *m)
{
    cf_py_clear((PyObject *)m);
}

static PyModuleDef_Slot cf_py_slots[] = {
    {Py_mod_exec, (void *)cf_py_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
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
    .m_size = sizeof(cf_py_state),
    .m_methods = cf_py_methods,
    .m_slots = cf_py_slots,
    .m_traverse = cf_py_traverse,
    .m_clear = cf_py_clear,
    .m_free = cf_py_free,
};

PyMODINIT_FUNC PyInit__C(void)
{
    return PyModuleDef_Init(&cf_py_module);
}
