"""Shard at init (twin of ``csrc/copy.c``)."""

from __future__ import annotations

from typing import Sequence

import torch


def shard_fill(
    dst: torch.Tensor,
    shard_start: int,
    srcs: Sequence[torch.Tensor],
    offsets: Sequence[int],
) -> None:
    """Fill ``dst`` (one rank's shard) from the original tensors.

    ``dst`` holds flat elements ``[shard_start, shard_start + dst.numel())`` of
    the unit's flat buffer, in which ``srcs[i]`` (contiguous, same dtype as
    ``dst``) starts at ``offsets[i]``.  Every element of ``dst`` not covered by
    a source (alignment and world-size padding) is set to zero.  The full flat
    buffer is never built.
    """
    n = dst.numel()
    dst.zero_()
    for src, off in zip(srcs, offsets):
        s = max(off, shard_start)
        e = min(off + src.numel(), shard_start + n)
        if e > s:
            dst[s - shard_start : e - shard_start].copy_(
                src.reshape(-1)[s - off : e - off]
            )
