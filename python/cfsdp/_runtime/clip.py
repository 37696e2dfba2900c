"""Gradient-norm clipping over sharded and replicated gradients (FSDP1's ``clip_grad_norm_``).

[Note: clip maths]
The total p-norm of all gradients viewed as one vector is

    ``(sum_ranks S_r + N) ** (1/p)``      (``max(max_ranks S_r, N)`` for p = inf)

where ``S_r`` is rank r's ``sum |g|^p`` over its *sharded* gradients (every element lives
on exactly one rank of the shard group, so the partials are summed by an all-reduce over it;
with HSDP the replicas hold equal copies and are not summed) and ``N`` is the same statistic
over the *non-sharded* gradients (NO_SHARD units, and parameters FSDP does not manage such as
ignored ones): those are replicated, so each rank adds its own ``N`` once, after the all-reduce, as
torch's FSDP1 does (for p = inf they join the MAX all-reduce, which is idempotent).

Each unit's sharded flat gradient is read in one C pass (``_core.norm_partial``), padding
included (it is zero, so it adds nothing for p > 0); an accelerator gradient takes the twin,
which reads it a chunk at a time with the same bits (no float64 copy of the gradient).  torch instead takes the float32 norm of
each gradient, re-combines the norms with another ``vector_norm`` and all-reduces
``local ** p`` in float32; our partials are float64 sums of exact terms and are all-reduced in
float64, so our total norm is the exact one rounded once to float32, and torch's differs from
it by torch's own float32 summation error (see tests/unit/test_core_norm.py).  For p = inf
both are exact and equal.

The clip coefficient, its clamp and the in-place multiply are torch's ops in torch's dtypes
(``max_norm / (total + 1e-6)`` in float32, clamped to 1.0, cast to each gradient's dtype):
one ``mul_`` per unit flat gradient (with ``use_orig_params=True`` the original parameters'
``.grad`` are views into it) and one per non-sharded gradient.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _core
from .flat.unit import Unit


class ClipResult(NamedTuple):
    total_norm: torch.Tensor  # in the grads' promoted dtype (float32 when there are none)
    num_grads: int  # gradients this rank holds (torch's count: per parameter with orig params)


def check_norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if p == 0.0:
        # torch's FSDP1 fails the same way, at its `1.0 / norm_type` after the all-reduce.
        raise ZeroDivisionError(
            "float division by zero (cfsdp: clip_grad_norm_(norm_type=0): the 0-'norm' has no "
            "1/p root; use norm_type > 0 or inf.)"
        )
    if not (p > 0.0):
        raise NotImplementedError(
            f"clip_grad_norm_(norm_type={norm_type!r}) is not supported by cfsdp: use a "
            "norm_type > 0 or inf (negative, -inf and NaN norm types do not define a norm; "
            "torch's FSDP1 returns meaningless values for them)."
        )
    return p


def _combine(acc: Optional[torch.Tensor], part: torch.Tensor, inf: bool) -> torch.Tensor:
    if acc is None:
        return part
    return torch.maximum(acc, part) if inf else acc + part


def clip_grad_norm_(
    units: Sequence[Unit],
    nonsharded_grads: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    group: dist.ProcessGroup,
    device: torch.device,
) -> ClipResult:
    """Clip the gradients of ``units`` (sharded) and ``nonsharded_grads`` in place so that
    their total ``norm_type``-norm is at most ``max_norm``; return the total norm before
    clipping.  Collective: every rank of ``group`` must call it.  See [Note: clip maths]."""
    max_norm = float(max_norm)
    p = check_norm_type(norm_type)
    inf = math.isinf(p)

    flat_grads: list[torch.Tensor] = []  # sharded: each element on one rank of `group`
    replicated_flat: list[torch.Tensor] = []  # NO_SHARD units: every rank holds all of it
    dtypes: list[torch.dtype] = []
    num_grads = 0
    for u in units:
        u.drop_grad_if_orig_grads_cleared()
        u.writeback_orig_params(grads_only=True)  # torch clips the parameters' own gradients
        g = u.flat_param.grad
        if g is None:
            continue
        (flat_grads if u.sharded else replicated_flat).append(g)
        if not u.use_orig_params or u.holds_local_elements:
            # torch counts the original parameters' grads (None where this rank holds no
            # element of the parameter); only whether there is one and the dtype matter here
            num_grads += 1
            dtypes.append(g.dtype)
    num_grads += len(nonsharded_grads)
    dtypes.extend(g.dtype for g in nonsharded_grads)

    sharded: Optional[torch.Tensor] = None
    for g in flat_grads:  # one C pass per unit
        sharded = _combine(sharded, _core.norm_partial(g, p).to(device), inf)
    local = (  # a tensor of our own: the all-reduce writes into it
        torch.zeros((), dtype=torch.float64, device=device) if sharded is None else sharded.clone()
    )
    replicated: Optional[torch.Tensor] = None
    for g in list(replicated_flat) + list(nonsharded_grads):
        replicated = _combine(replicated, _core.norm_partial(g, p).to(device), inf)

    if inf:
        if replicated is not None:
            local = torch.maximum(local, replicated)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total64 = local
    else:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        if replicated is not None:
            local = local + replicated
        total64 = local.pow(1.0 / p)

    out_dtype = functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32
    # torch computes the norm and the coefficient in float32 (it cannot take fp64 grads at
    # all); with fp64 gradients we keep float64 instead of throwing precision away.
    compute_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    total_norm = total64.to(compute_dtype)
    clip_coef = max_norm / (total_norm + 1e-6)
    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
    for g in flat_grads + replicated_flat:
        g.mul_(clip_coef_clamped.to(g.device, g.dtype))
    for g in nonsharded_grads:
        g.mul_(clip_coef_clamped.to(g.device, g.dtype))
    if num_grads == 0:
        return ClipResult(total_norm, 0)
    return ClipResult(total_norm.to(out_dtype), num_grads)
