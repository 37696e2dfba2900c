"""Gradient-norm partials (twin of ``csrc/norm.c``)."""

from __future__ import annotations

import math

import torch

# Must match CF_NORM_LANES in csrc/norm.h: element i is summed in lane i % LANES.
LANES = 8


def norm_partial(t: torch.Tensor, p: float) -> torch.Tensor:
    """The local statistic of the p-norm of ``t`` (any shape), as a 0-dim float64 tensor
    on ``t.device``: ``max |x|`` for ``p == inf`` (0 when empty, NaN if any NaN), else
    ``sum |x|^p`` for ``p > 0``.

    Every element is widened to float64 first (exact); the term is ``|x|`` for p = 1,
    ``x * x`` for p = 2 and ``|x| ** p`` otherwise, and the terms are summed in float64 in
    the C core's fixed order (csrc/norm.h): zero-padded to a multiple of ``LANES``, each
    lane summed in increasing index (``cumsum`` is a sequential scan), then the lanes in
    order.  So for p in (1, 2, inf) this gives the C core's bits exactly.
    """
    p = float(p)
    if not p > 0:
        raise ValueError(f"p must be > 0 (or inf), got {p}")
    x = t.detach().reshape(-1).to(torch.float64)
    if math.isinf(p):
        if x.numel() == 0:
            return torch.zeros((), dtype=torch.float64, device=t.device)
        return x.abs().max()
    if p == 1.0:
        terms = x.abs()
    elif p == 2.0:
        terms = x * x
    else:
        terms = x.abs().pow(p)
    pad = (-terms.numel()) % LANES
    if pad:
        terms = torch.cat([terms, terms.new_zeros(pad)])
    if terms.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=t.device)
    lanes = terms.view(-1, LANES).cumsum(0)[-1]
    return lanes.cumsum(0)[-1]
