/*
 * optim.h -- fused optimizer steps (Adam/AdamW, SGD; Muon's momentum) over
 * many contiguous element ranges of flat fp32 buffers, one pass over memory
 * per element (twin: cfsdp/_ref/optim.py).
 */
#ifndef CF_OPTIM_H
#define CF_OPTIM_H

#include <stdbool.h>

#include "cfsdp.h"

/* Above this many bytes moved (read + written, summed over the ranges) a
 * step splits its loop across threads (see thread.h). */
#define CF_OPTIM_PARALLEL_BYTES ((int64_t)4 << 20)

/* Elements [start, start + len) of every buffer of a call (param, grad and
 * each state buffer), counted from that buffer's base address. */
typedef struct {
    int64_t start;
    int64_t len;
} cf_optim_range;

/* Adam / AdamW hyper-parameters of one call, as torch's param_groups hold
 * them (doubles); `step` is the value of state["step"] after its increment. */
typedef struct {
    double lr, beta1, beta2, eps, weight_decay, step;
    bool decoupled; /* AdamW: p *= 1 - lr * wd; else Adam's L2: g += wd * p */
    bool amsgrad;   /* max_exp_avg_sq = max(max_exp_avg_sq, exp_avg_sq) */
    bool maximize;  /* g = -g */
} cf_adam_args;

/* SGD hyper-parameters of one call. */
typedef struct {
    double lr, momentum, dampening, weight_decay;
    bool nesterov;
    bool maximize;
    bool first_step; /* the momentum buffer is set to the gradient (torch's clone) */
} cf_sgd_args;

/*
 * One Adam (decoupled: AdamW) step of every element of `ranges`, in place:
 * reads param, grad, exp_avg, exp_avg_sq (and max_exp_avg_sq when amsgrad),
 * writes param, exp_avg, exp_avg_sq (and max_exp_avg_sq), each element once.
 * The arithmetic is torch 2.13's single-tensor Adam (see optim.c): the same
 * results, bit for bit, as torch's CPU kernels where they use FMA (AVX2 and
 * AVX-512 builds).  Elements outside the ranges are never touched.
 *
 * The caller guarantees every range of every buffer is memory it owns.
 * Errors, found before any element is written: CF_EINVAL for dtype other than
 * CF_DTYPE_FP32, a NULL buffer (max_exp_avg_sq only when amsgrad) with
 * elements to step, a buffer address that is not a multiple of 4, a
 * negative start or length, ranges out of order or
 * overlapping, the buffers' spans overlapping each other, step < 1;
 * CF_EOVERFLOW if an end or byte offset does not fit; CF_ENOMEM if the
 * threads' index cannot be allocated.  Uses up to cf_num_threads(max_threads)
 * threads above CF_OPTIM_PARALLEL_BYTES.  Needs no GIL.
 */
cf_status cf_optim_adam_step(void *param, const void *grad, void *exp_avg, void *exp_avg_sq,
                             void *max_exp_avg_sq, const cf_optim_range *ranges,
                             size_t n_ranges, int dtype, const cf_adam_args *args,
                             int64_t max_threads, cf_err *err);

/*
 * One SGD step of every element of `ranges`, in place: reads param, grad (and
 * momentum_buffer when momentum != 0 and not first_step), writes param (and
 * momentum_buffer when momentum != 0).  torch 2.13's single-tensor SGD, with
 * the rounding of cf_optim_adam_step.  Errors and threads as
 * cf_optim_adam_step (momentum_buffer may be NULL only when momentum == 0).
 */
cf_status cf_optim_sgd_step(void *param, const void *grad, void *momentum_buffer,
                            const cf_optim_range *ranges, size_t n_ranges, int dtype,
                            const cf_sgd_args *args, int64_t max_threads, cf_err *err);

/*
 * Muon's momentum of every element of `ranges` (torch 2.13's _single_tensor_muon:
 * momentum_buffer.lerp_(grad, 1 - momentum), and with nesterov update =
 * grad.lerp(momentum_buffer, momentum)), in place: reads grad and momentum_buffer,
 * writes momentum_buffer (and update when nesterov; update may be NULL otherwise), each
 * element once, with the rounding of cf_optim_adam_step.  Errors and threads as
 * cf_optim_adam_step.
 */
cf_status cf_optim_muon_momentum(const void *grad, void *momentum_buffer, void *update,
                                 const cf_optim_range *ranges, size_t n_ranges, int dtype,
                                 double momentum, bool nesterov, int64_t max_threads,
                                 cf_err *err);

/* Whether the AVX2+FMA loops run on this CPU (else the portable ones, same
 * results: fmaf is correctly rounded either way). */
bool cf_optim_uses_avx2(void);

#endif /* CF_OPTIM_H */
