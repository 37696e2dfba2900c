"""Gradient post-processing (twin of ``csrc/reduce.c``)."""

from __future__ import annotations

import torch


def scale_cast_add(
    dst: torch.Tensor, src: torch.Tensor, divisor: float, accumulate: bool
) -> None:
    """``dst += cast(src / divisor)`` (``accumulate``) or ``dst = cast(src / divisor)``.

    Rounding is torch's sequence of ops exactly: ``src / divisor`` is rounded
    to ``src.dtype`` (skipped when ``divisor == 1``), then cast to
    ``dst.dtype``, then added to ``dst`` in ``dst.dtype`` (or written, so a
    ``-0.0`` stays ``-0.0``).  ``dst`` and ``src`` are 1-D contiguous tensors
    of the same numel; ``src`` may be ``dst`` itself (in place), but must not
    overlap it otherwise.
    """
    t = src / divisor if divisor != 1 else src
    if accumulate:
        dst.add_(t.to(dst.dtype))
    else:
        dst.copy_(t)
