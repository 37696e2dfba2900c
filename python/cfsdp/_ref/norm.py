"""Gradient-norm partials (twin of ``csrc/norm.c``)."""

from __future__ import annotations

import math
from typing import Optional

import torch

# Must match CF_NORM_LANES in csrc/norm.h: element i is summed in lane i % LANES.
LANES = 8
CHUNK = LANES << 17  # elements read at a time (1 Mi): see norm_partial


def norm_partial(t: torch.Tensor, p: float) -> torch.Tensor:
    """The local statistic of the p-norm of ``t`` (any shape), as a 0-dim float64 tensor
    on ``t.device``: ``max |x|`` for ``p == inf`` (0 when empty, NaN if any NaN), else
    ``sum |x|^p`` for ``p > 0``.

    Every element is widened to float64 first (exact); the term is ``|x|`` for p = 1,
    ``x * x`` for p = 2 and ``|x| ** p`` otherwise, and the terms are summed in float64 in
    the C core's fixed order (csrc/norm.h): zero-padded to a multiple of ``LANES``, each
    lane summed in increasing index (``cumsum`` is a sequential scan), then the lanes in
    order.  So for p in (1, 2, inf) this gives the C core's bits exactly.

    ``t`` is read ``CHUNK`` elements at a time (each chunk's scan starts from the lanes'
    running sums, so the order of the additions, and the bits, are those of one scan over
    the whole tensor): the float64 temporaries are a few ``CHUNK`` s, not three times the
    tensor's elements in float64 (this is the path of accelerator tensors, which never
    reach C).
    """
    p = float(p)
    if not p > 0:
        raise ValueError(f"p must be > 0 (or inf), got {p}")
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float64, device=t.device)
    inf = math.isinf(p)
    acc: Optional[torch.Tensor] = None  # max so far, or the lanes' running sums
    for start in range(0, n, CHUNK):
        x = flat[start:start + CHUNK].to(torch.float64)
        if inf:
            m = x.abs().max()
            acc = m if acc is None else torch.maximum(acc, m)  # (NaN propagates)
            continue
        if p == 1.0:
            terms = x.abs()
        elif p == 2.0:
            terms = x * x
        else:
            terms = x.abs().pow(p)
        pad = (-terms.numel()) % LANES  # only the last chunk (CHUNK is a multiple of LANES)
        if pad:
            terms = torch.cat([terms, terms.new_zeros(pad)])
        rows = terms.view(-1, LANES)
        if acc is not None:
            rows = torch.cat([acc.view(1, LANES), rows])
        acc = rows.cumsum(0)[-1]
    if inf:
        return acc
    return acc.cumsum(0)[-1]
