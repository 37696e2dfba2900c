"""FSDP2 copy-in / copy-out (twin of ``csrc/chunk.c``).

The layout of a ``fully_shard`` unit: a parameter sharded on dim 0, of shape
``(d0, *rest)``, is split as ``torch.chunk(p, W)``, so with ``c = ceil(d0 / W)``
rows per chunk and ``r`` elements per row, rank ``k`` holds the parameter's
flat elements ``[k*c*r, min((k+1)*c*r, numel))`` (possibly none), padded with
zeros to ``chunk_numel = c*r``.  A parameter sharded on dim ``d > 0``
(``Shard(d)``, an even split: ``shape[d] == W*c``) gives rank ``k``
``torch.chunk(p, W, dim=d)[k]`` made contiguous: ``outer = prod(shape[:d])``
blocks of ``blk = c * prod(shape[d+1:])`` elements, block ``o`` being the
parameter's flat elements ``[o*row + k*blk, o*row + (k+1)*blk)`` with ``row =
numel / outer``; so ``chunk_numel = outer * blk`` and ``numel = W *
chunk_numel``.  Dim 0 is ``outer = 1``.  A rank's shard (``shard_numel``
elements) holds one padded chunk per parameter, at ``shard_off``; the
all-gather output ``G`` is rank-major, ``G[k*shard_numel + shard_off + j]``
being element ``j`` of rank ``k``'s chunk.  The *natural* buffer holds the
whole parameters, parameter ``p`` at ``nat_off``.

A *plan* is a sequence of ``(nat_off, numel, chunk_numel, shard_off, outer)``,
one per parameter, in order; with ``world_size`` and ``shard_numel`` it
describes the unit.  Invariants, checked (in this order, naming the parameter
index) by ``check_plan`` here and by the C core with the same messages:

* ``1 <= world_size <= MAX_WORLD_SIZE`` and ``len(plan) * world_size <= MAX_PIECES``
  (``cfsdp._ref.layout``), ``shard_numel >= 0``, the first four numbers are
  ``>= 0`` and ``outer >= 1``;
* ``numel <= world_size * chunk_numel`` (every element belongs to a rank);
* ``outer > 1`` only with ``numel == world_size * chunk_numel`` and
  ``chunk_numel`` a multiple of ``outer`` (whole blocks, every rank a full chunk);
* the shard segment (the chunk) ``[shard_off, shard_off + chunk_numel)`` lies
  in the shard, and non-empty ones come in parameter order without overlap;
* the natural segment ``[nat_off, nat_off + numel)`` lies in the natural
  buffer, and non-empty ones come in parameter order without overlap (both
  buffers may have gaps).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .layout import check_dims

PlanEntry = tuple[int, int, int, int, int]  # (nat_off, numel, chunk_numel, shard_off, outer)


def check_plan(
    plan: Sequence[PlanEntry],
    world_size: int,
    shard_numel: int,
    natural_numel: int,
    gathered_numel: int,
    ranks: tuple[int, int],
) -> None:
    """Raise ``ValueError`` unless the plan fits the buffers; see the module doc."""
    lo, hi = ranks
    check_dims(len(plan), world_size, "plan")
    if shard_numel < 0:
        raise ValueError(f"shard_numel must be >= 0, got {shard_numel}")
    if not 0 <= lo <= hi <= world_size:
        raise ValueError(
            f"ranks ({lo}, {hi}) must satisfy 0 <= lo <= hi <= world_size {world_size}"
        )
    if gathered_numel != (hi - lo) * shard_numel:
        raise ValueError(
            f"gathered buffer has {gathered_numel} elements, expected "
            f"{(hi - lo) * shard_numel} ({hi - lo} ranks x shard_numel {shard_numel})"
        )
    shard_end = nat_end = 0
    for i, (nat_off, numel, chunk, shard_off, outer) in enumerate(plan):
        if min(nat_off, numel, chunk, shard_off) < 0:
            raise ValueError(
                f"plan param {i}: nat_off, numel, chunk_numel and shard_off must be "
                f">= 0, got ({nat_off}, {numel}, {chunk}, {shard_off})"
            )
        if outer < 1:
            raise ValueError(f"plan param {i}: outer must be >= 1, got {outer}")
        if world_size * chunk < numel:
            raise ValueError(
                f"plan param {i}: numel {numel} does not fit in {world_size} chunks of "
                f"{chunk} elements"
            )
        if outer > 1 and (world_size * chunk != numel or chunk % outer):
            raise ValueError(
                f"plan param {i}: a chunk of {outer} blocks (outer) needs numel == "
                f"world_size x chunk_numel and chunk_numel a multiple of outer, got numel "
                f"{numel}, world_size {world_size}, chunk_numel {chunk}"
            )
        shard_end = _check_segment(i, "shard", shard_off, chunk, shard_numel, shard_end)
        nat_end = _check_segment(i, "natural", nat_off, numel, natural_numel, nat_end)


def _check_segment(i: int, what: str, off: int, n: int, limit: int, prev_end: int) -> int:
    """Parameter ``i``'s segment ``[off, off + n)`` of the ``what`` buffer must end by
    ``limit`` and, if non-empty, start at or after ``prev_end`` (the end of the previous
    non-empty segment); returns the new ``prev_end``."""
    if off + n > limit:
        raise ValueError(
            f"plan param {i}: {what} segment of {n} elements at {off} passes the end {limit}"
        )
    if n == 0:
        return prev_end
    if off < prev_end:
        raise ValueError(
            f"plan param {i}: {what} segment at {off} overlaps the previous one (ends at "
            f"{prev_end}); segments must be in parameter order"
        )
    return off + n


def _pieces(plan: Sequence[PlanEntry], lo: int, hi: int):
    """Per parameter with a non-empty chunk: ``(nat_off, numel, chunk, shard_off, outer,
    a, b, rem)``: of the ranks ``[lo, hi)``, ranks ``[a, b)`` (``a == lo``) hold a whole
    chunk and rank ``b`` holds the ``rem`` trailing elements (``rem == 0``: none, or
    ``b`` is past ``hi``); ranks after that hold nothing (``outer > 1``: every rank
    holds a whole chunk)."""
    for nat_off, numel, chunk, shard_off, outer in plan:
        if chunk == 0:
            continue
        full = numel // chunk  # ranks holding a whole chunk
        rem = numel - full * chunk if lo <= full < hi else 0
        yield nat_off, numel, chunk, shard_off, outer, lo, max(lo, min(hi, full)), rem


def _blocks(natural: torch.Tensor, nat_off: int, numel: int, outer: int, world_size: int,
            a: int, b: int) -> torch.Tensor:
    """Ranks ``[a, b)``'s chunks of a parameter with ``outer > 1`` blocks, as a view of
    ``natural`` shaped ``(b - a, outer, blk)`` (rank, block, element)."""
    blk = numel // (outer * world_size)
    return natural[nat_off : nat_off + numel].view(outer, world_size, blk)[:, a:b].transpose(0, 1)


def chunk_unpack(
    dst_natural: torch.Tensor,
    src_gathered: torch.Tensor,
    plan: Sequence[PlanEntry],
    world_size: int,
    shard_numel: int,
) -> None:
    """Copy-out after the all-gather: every parameter's elements from the rank-major
    ``src_gathered`` (``world_size * shard_numel`` elements) to its segment of
    ``dst_natural``, bit for bit.  Padding is not read; elements of ``dst_natural``
    outside the parameters are not written.  Both tensors 1-D, same dtype."""
    check_plan(plan, world_size, shard_numel, dst_natural.numel(), src_gathered.numel(),
               (0, world_size))
    g = src_gathered.view(world_size, shard_numel)
    for nat_off, numel, chunk, shard_off, outer, a, b, rem in _pieces(plan, 0, world_size):
        part = g[a:b, shard_off : shard_off + chunk]
        if outer > 1:
            _blocks(dst_natural, nat_off, numel, outer, world_size, a, b).copy_(
                part.view(b - a, outer, -1))
            continue
        n = (b - a) * chunk
        if n:
            dst_natural[nat_off : nat_off + n].view(b - a, chunk).copy_(part)
        if rem:
            dst_natural[nat_off + n : nat_off + n + rem].copy_(g[b, shard_off : shard_off + rem])


def chunk_pack(
    dst_gathered: torch.Tensor,
    src_natural: torch.Tensor,
    plan: Sequence[PlanEntry],
    world_size: int,
    shard_numel: int,
    divisor: float = 1.0,
    ranks: Optional[tuple[int, int]] = None,
) -> None:
    """Copy-in: ranks ``[lo, hi)`` (``ranks``, default all) of the rank-major layout,
    ``(hi - lo) * shard_numel`` elements of ``dst_gathered``, from ``src_natural``.

    Each element is ``cast(src / divisor)`` rounded as ``scale_cast_add`` (torch's
    ``src / divisor`` in the src dtype, skipped when ``divisor == 1``, then a copy
    into the dst dtype); every other element of ``dst_gathered`` (chunk padding, gaps)
    is zero.  Both tensors 1-D."""
    lo, hi = (0, world_size) if ranks is None else ranks
    check_plan(plan, world_size, shard_numel, src_natural.numel(), dst_gathered.numel(),
               (lo, hi))
    dst_gathered.zero_()
    g = dst_gathered.view(hi - lo, shard_numel)

    def scaled(t: torch.Tensor) -> torch.Tensor:
        return t / divisor if divisor != 1 else t

    for nat_off, numel, chunk, shard_off, outer, a, b, rem in _pieces(plan, lo, hi):
        part = g[a - lo : b - lo, shard_off : shard_off + chunk]
        if outer > 1:
            if b > a:
                part.view(b - a, outer, -1).copy_(
                    scaled(_blocks(src_natural, nat_off, numel, outer, world_size, a, b)))
            continue
        start = nat_off + a * chunk  # natural element of rank a's part
        n = (b - a) * chunk
        if n:
            part.copy_(scaled(src_natural[start : start + n]).view(b - a, chunk))
        if rem:
            g[b - lo, shard_off : shard_off + rem].copy_(
                scaled(src_natural[start + n : start + n + rem])
            )
