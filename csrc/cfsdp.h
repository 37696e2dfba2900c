/*
 * cfsdp.h -- types shared by every file of the C core: dtype codes, status
 * codes, the error record and the error-propagation macros.
 *
 * Design.  The C core knows nothing of Python or torch.  Every internal
 * function returns a cf_status; CF_OK is zero and anything else is an error
 * whose human-readable message has been written into a caller-provided cf_err
 * (a plain struct on the caller's stack: no globals, so the core is
 * re-entrant and safe to call with the GIL released).  CF_CHECK propagates a
 * failing status to the caller; CF_CHECK_GOTO jumps to the function's single
 * cleanup label.  Only cf_py_raise (bind_args.c) turns a cf_err into a
 * Python exception: CF_EINVAL -> ValueError, CF_EOVERFLOW -> OverflowError,
 * CF_ENOMEM -> MemoryError, CF_ERUNTIME -> RuntimeError (shm.c, queue.c: a
 * failed system call, a timeout, a peer that failed), CF_EPERM ->
 * PermissionError (shm.c: a file that is not this job's, refused before it
 * is mapped).
 */
#ifndef CFSDP_H
#define CFSDP_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* Dtype codes; must match cfsdp._core.DTYPE_CODES. */
typedef enum {
    CF_DTYPE_FP32 = 0,
    CF_DTYPE_FP64 = 1,
    CF_DTYPE_BF16 = 2,
    CF_DTYPE_FP16 = 3,
    CF_DTYPE_COUNT = 4
} cf_dtype;

typedef enum {
    CF_OK = 0,
    CF_EINVAL = 1,    /* bad argument (ValueError) */
    CF_EOVERFLOW = 2, /* a size or offset does not fit (OverflowError) */
    CF_ENOMEM = 3,    /* an index array could not be allocated (MemoryError) */
    CF_ERUNTIME = 4,  /* a collective or system call failed (RuntimeError) */
    CF_EPERM = 5      /* a file that is not this job's, refused (PermissionError) */
} cf_status;

#define CF_ERR_MSG_LEN 512

/* The error record: status plus a message, filled by cf_err_set. */
typedef struct {
    cf_status status;
    char msg[CF_ERR_MSG_LEN];
} cf_err;

/* Initialise an error record to "no error". */
static inline void cf_err_init(cf_err *err)
{
    err->status = CF_OK;
    err->msg[0] = '\0';
}

/*
 * Record an error (printf-style message, truncated to CF_ERR_MSG_LEN) and
 * return its status, so a caller can write `return cf_err_set(err, ...)`.
 * `status` must not be CF_OK.
 */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static inline cf_status cf_err_set(cf_err *err, cf_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    err->status = status;
    return status;
}

/* Propagate a failing status to the caller. */
#define CF_CHECK(expr)                      \
    do {                                    \
        cf_status cf_check_st_ = (expr);    \
        if (cf_check_st_ != CF_OK)          \
            return cf_check_st_;            \
    } while (0)

/* Store a failing status in `st` and jump to the cleanup `label`. */
#define CF_CHECK_GOTO(expr, st, label)      \
    do {                                    \
        (st) = (expr);                      \
        if ((st) != CF_OK)                  \
            goto label;                     \
    } while (0)

/* Size in bytes of one element of a valid dtype (0 for an unknown code). */
static inline size_t cf_dtype_size(int code)
{
    switch (code) {
    case CF_DTYPE_FP32: return 4;
    case CF_DTYPE_FP64: return 8;
    case CF_DTYPE_BF16: return 2;
    case CF_DTYPE_FP16: return 2;
    default: return 0;
    }
}

/*
 * Bounds every entry point enforces before it allocates or loops, so that no
 * argument makes the core allocate or run without limit: a world size is at
 * most CF_MAX_WORLD_SIZE ranks, and a layout or chunk plan describes at most
 * CF_MAX_PIECES (rank, parameter) pieces (world_size * parameters; layout.c
 * returns 3 int64 per piece, chunk.c visits each piece).  A larger model is
 * wrapped into more units.  The twins enforce the same bounds.
 */
#define CF_MAX_WORLD_SIZE 65536
#define CF_MAX_PIECES ((int64_t)1 << 22)

/*
 * Alignment-safe element access: element i of the array at p, loaded or stored
 * with memcpy.  gcc and clang compile these to plain (unaligned) moves and
 * still vectorise the loops around them, so a loop written with them runs as
 * fast as one through a typed pointer, and is correct, with no undefined
 * behaviour, at any address.  Every typed loop of the core reads and writes
 * through them (reduce.c, norm.c, shm.c; chunk.c's casts are reduce.c's
 * loops), so a buffer at an odd address is fine, but optim.c's: its fused
 * loops (AVX2 intrinsics) take fp32-aligned buffers and refuse others.  The
 * shared-memory collectives in particular must take any address: their route
 * (shared memory or the process group, cfsdp._runtime.comm) has to be the
 * same on every rank, so it cannot depend on one rank's addresses.
 */
#define CF_DEFINE_ACCESS(NAME, T)                                                \
    static inline T cf_load_##NAME(const void *p, size_t i)                     \
    {                                                                            \
        T v;                                                                     \
        memcpy(&v, (const unsigned char *)p + i * sizeof v, sizeof v);          \
        return v;                                                                \
    }                                                                            \
    static inline void cf_store_##NAME(void *p, size_t i, T v)                  \
    {                                                                            \
        memcpy((unsigned char *)p + i * sizeof v, &v, sizeof v);                \
    }
CF_DEFINE_ACCESS(f32, float)
CF_DEFINE_ACCESS(f64, double)
CF_DEFINE_ACCESS(u16, uint16_t)
#undef CF_DEFINE_ACCESS

/* Overflow-checked int64 arithmetic for non-negative operands. */
static inline int cf_add_i64_overflows(int64_t a, int64_t b, int64_t *out)
{
    if (a > INT64_MAX - b)
        return 1;
    *out = a + b;
    return 0;
}

static inline int cf_mul_i64_overflows(int64_t a, int64_t b, int64_t *out)
{
    if (a != 0 && b > INT64_MAX / a)
        return 1;
    *out = a * b;
    return 0;
}

static inline int cf_mul_size_overflows(size_t a, size_t b, size_t *out)
{
    if (a != 0 && b > SIZE_MAX / a)
        return 1;
    *out = a * b;
    return 0;
}

#endif /* CFSDP_H */
