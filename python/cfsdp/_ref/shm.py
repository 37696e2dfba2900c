"""Kernels of the shared-memory collectives (twins of ``csrc/shm.c``).

The collectives themselves have the process group as their twin (see
``cfsdp._runtime.comm``); what is C in them besides synchronisation is one sum
kernel and plain copies, twinned here.
"""

from __future__ import annotations

from typing import Sequence

import torch


def shm_reduce(dst: torch.Tensor, srcs: Sequence[torch.Tensor], scale: float) -> None:
    """``dst = round(scale * (srcs[0] + srcs[1] + ...))``, elementwise.

    The sources are summed left to right in float32 (float64 when the dtype is
    float64; bf16 and fp16 widen exactly), the sum is multiplied by ``scale`` in
    that type (the Python float read as float32 for a float32 accumulator, as torch
    reads a scalar; skipped when ``scale == 1``), and rounded once to ``dst.dtype``.
    ``dst`` and every source are 1-D contiguous tensors of one dtype and numel;
    ``dst`` may be one of the sources (in place).
    """
    if not srcs:
        raise ValueError("shm_reduce needs at least one source")
    acc_dtype = torch.float64 if dst.dtype == torch.float64 else torch.float32
    acc = srcs[0].to(acc_dtype, copy=True)
    for s in srcs[1:]:
        acc.add_(s.to(acc_dtype))
    if scale != 1:
        acc.mul_(scale)
    dst.copy_(acc)


def shm_memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s bytes into ``dst`` (same number of bytes, no overlap)."""
    dst.reshape(-1).view(torch.uint8).copy_(src.reshape(-1).view(torch.uint8))
