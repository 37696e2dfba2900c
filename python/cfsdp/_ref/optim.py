"""Fused optimizer steps over element ranges (twin of ``csrc/optim.c``).

The per-tensor functions (``adam_tensor``, ``sgd_tensor``) are torch 2.13's
single-tensor Adam/AdamW and SGD, op for op (``torch/optim/adam.py``
``_single_tensor_adam``, ``sgd.py`` ``_single_tensor_sgd``, without the
capturable/differentiable/complex branches), on tensors of any dtype, device
or layout, DTensors included.  They are also ``cfsdp.optim``'s path for what
the C core does not take (fp64/bf16/fp16 parameters, non-CPU or strided
tensors).  ``adam_step`` / ``sgd_step`` have the C entry points' contract:
flat 1-D buffers and ``(start, len)`` element ranges, each range stepped as
one tensor.

Rounding against the C core: every result but one is the same bits (torch's
CPU kernels use FMA where the C loops call ``fmaf``; see optim.c).  The one
difference is Adam's ``sqrt``: torch computes ``Tensor.sqrt`` on the CPU
through MKL's vector math (accurate to 1 ulp, not correctly rounded: about
16% of fp32 results differ by one ulp from IEEE ``sqrt``), the C core with
the IEEE ``sqrt``.  So ``exp_avg``, ``exp_avg_sq`` and ``max_exp_avg_sq`` are
bitwise equal and the parameter is within five ulps of the largest of its
old value, the update ``lr * m / denom`` and its new value (the one-ulp root
passes three more roundings before the final add rounds once more).  With
``ieee_sqrt=True`` the twin is the C core's bits.
SGD has no sqrt: bitwise equal.  Muon's momentum (``muon_momentum_tensor``,
``muon_momentum``: two lerps) too.
"""

from __future__ import annotations

import array

from typing import Optional, Sequence

import torch

Ranges = Sequence[tuple[int, int]]


def adam_tensor(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: Optional[torch.Tensor],
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    ieee_sqrt: bool = False,
) -> None:
    """One Adam step of one tensor, in place; ``step`` is state['step'] after
    its increment (torch reads it with ``.item()``).  ``ieee_sqrt`` takes the
    correctly rounded square root (through float64, exact for fp32) in place
    of ``Tensor.sqrt``: then fp32 results are the C core's bits."""
    sqrt = _ieee_sqrt if ieee_sqrt else torch.Tensor.sqrt  # looked up per call, as torch
    grad = grad if not maximize else -grad
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    if amsgrad:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        denom = (sqrt(max_exp_avg_sq) / bias_correction2_sqrt).add_(eps)
    else:
        denom = (sqrt(exp_avg_sq) / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _ieee_sqrt(t: torch.Tensor) -> torch.Tensor:
    """sqrt rounded once (float64's sqrt is exact enough: 53 >= 2 * 24 + 2)."""
    return t.double().sqrt().to(t.dtype) if t.dtype == torch.float32 else t.sqrt()


def sgd_tensor(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: Optional[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    first_step: bool,
) -> None:
    """One SGD step of one tensor, in place.  With momentum, ``momentum_buffer``
    is updated in place; on the first step it receives the (decayed, negated)
    gradient, as torch's ``grad.detach().clone()`` creates it."""
    grad = grad if not maximize else -grad
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum != 0:
        buf = momentum_buffer
        if first_step:
            buf.copy_(grad)
        else:
            buf.mul_(momentum).add_(grad, alpha=1 - dampening)
        if nesterov:
            grad = grad.add(buf, alpha=momentum)
        else:
            grad = buf
    param.add_(grad, alpha=-lr)


def muon_momentum_tensor(
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    *,
    momentum: float,
    nesterov: bool,
) -> torch.Tensor:
    """The momentum half of torch 2.13's ``_single_tensor_muon`` for one tensor, op for
    op: ``momentum_buffer`` is updated in place; returns the update Newton-Schulz
    orthogonalizes (a new tensor with Nesterov, else ``momentum_buffer`` itself)."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


def check_ranges(ranges: Ranges) -> list[tuple[int, int]]:
    """The C core's range checks, same messages: non-negative, in increasing
    order, non-overlapping (empty ranges are skipped).  ``ranges`` may be flat
    int64 pairs in an ``array.array('q')``, as the C core takes them."""
    if isinstance(ranges, array.array):
        ranges = list(zip(ranges[0::2], ranges[1::2]))
    out, prev_end = [], 0
    for i, (start, length) in enumerate(ranges):
        start, length = int(start), int(length)
        if start < 0 or length < 0:
            raise ValueError(
                f"range {i}: start and length must be >= 0, got ({start}, {length})"
            )
        if length == 0:
            continue
        if start < prev_end:
            raise ValueError(
                f"range {i} at {start} overlaps or precedes the previous one (ends at "
                f"{prev_end}); ranges must be in increasing order without overlap"
            )
        prev_end = start + length
        out.append((start, length))
    return out


def _check_flat(**bufs: Optional[torch.Tensor]) -> None:
    for name, t in bufs.items():
        if t is not None and t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D buffer, got shape {tuple(t.shape)}")


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: Optional[torch.Tensor],
    ranges: Ranges,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    ieee_sqrt: bool = False,
) -> None:
    """Twin of ``cfsdp._C.adam_step``: each ``(start, len)`` range of the flat
    buffers stepped as one tensor (``adam_tensor``)."""
    _check_flat(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                max_exp_avg_sq=max_exp_avg_sq if amsgrad else None)
    if not (step >= 1 and step != float("inf")):
        raise ValueError(f"step must be a finite number >= 1, got {step:g}")
    for s, n in check_ranges(ranges):
        e = s + n
        adam_tensor(
            param[s:e], grad[s:e], exp_avg[s:e], exp_avg_sq[s:e],
            max_exp_avg_sq[s:e] if amsgrad else None,
            step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, decoupled=decoupled, amsgrad=amsgrad,
            maximize=maximize, ieee_sqrt=ieee_sqrt,
        )


def sgd_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: Optional[torch.Tensor],
    ranges: Ranges,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    first_step: bool,
) -> None:
    """Twin of ``cfsdp._C.sgd_step``."""
    _check_flat(param=param, grad=grad,
                momentum_buffer=momentum_buffer if momentum != 0 else None)
    for s, n in check_ranges(ranges):
        e = s + n
        sgd_tensor(
            param[s:e], grad[s:e],
            momentum_buffer[s:e] if momentum != 0 else None,
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize, first_step=first_step,
        )


def muon_momentum(
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    update: Optional[torch.Tensor],
    ranges: Ranges,
    *,
    momentum: float,
    nesterov: bool,
) -> None:
    """Twin of ``cfsdp._C.muon_momentum``: each range of the flat buffers as one tensor
    (``muon_momentum_tensor``), the Nesterov update written into ``update``."""
    _check_flat(grad=grad, momentum_buffer=momentum_buffer,
                update=update if nesterov else None)
    for s, n in check_ranges(ranges):
        e = s + n
        u = muon_momentum_tensor(grad[s:e], momentum_buffer[s:e], momentum=momentum,
                                 nesterov=nesterov)
        if nesterov:
            update[s:e].copy_(u)
