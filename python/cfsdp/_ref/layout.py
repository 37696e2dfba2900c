"""Flat layout planner (twin of ``csrc/layout.c``).

The layout of a unit is torch FSDP1's ``FlatParameter`` layout:

* parameters are laid out in order; when ``align_numel > 0`` (torch does this
  for ``use_orig_params=True``) padding is inserted before a parameter whose
  offset is not a multiple of ``align_numel``, and after the last parameter the
  total is padded to a multiple of ``world_size``;
* ``flat_numel`` is the numel of the unsharded flat parameter (padding included);
* every rank holds ``shard_numel = ceil(flat_numel / world_size)`` elements;
  rank ``r`` owns flat elements ``[r * shard_numel, (r + 1) * shard_numel)``;
  the part past ``flat_numel`` is zero padding.

``slices`` is a flat tuple, rank-major then parameter-major, of triples
``(param_start, numel, shard_offset)``: the elements
``[param_start, param_start + numel)`` of the flattened parameter live at
``[shard_offset, shard_offset + numel)`` of that rank's shard.  A parameter
with no elements in a rank's shard gets ``(0, 0, 0)``.

Bounds (``csrc/cfsdp.h``, the same in C): ``world_size <= MAX_WORLD_SIZE`` and
``len(numels) * world_size <= MAX_PIECES`` (rank, parameter) pieces, checked
before anything is built, so no argument makes the planner allocate or loop
without limit.
"""

from __future__ import annotations

from typing import Sequence

MAX_WORLD_SIZE = 65536  # CF_MAX_WORLD_SIZE
MAX_PIECES = 1 << 22  # CF_MAX_PIECES: world_size * parameters of a layout or chunk plan


def check_dims(n_params: int, world_size: int, what: str = "layout") -> None:
    """``ValueError`` unless ``1 <= world_size <= MAX_WORLD_SIZE`` and ``n_params *
    world_size <= MAX_PIECES`` (the C core's messages; ``what``: "layout" or "plan")."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be <= {MAX_WORLD_SIZE}, got {world_size}")
    if n_params > MAX_PIECES // world_size:
        raise ValueError(
            f"a {what} of {n_params} parameters over {world_size} ranks has more than "
            f"{MAX_PIECES} (rank, parameter) pieces; wrap the model into smaller units"
        )


def plan_layout_lists(
    numels: Sequence[int], align_numel: int, world_size: int
) -> tuple[tuple[int, ...], int, int, tuple[int, ...]]:
    """Return ``(offsets, flat_numel, shard_numel, slices)``; see module doc."""
    numels = tuple(numels)
    check_dims(len(numels), world_size)
    if align_numel < 0:
        raise ValueError(f"align_numel must be >= 0, got {align_numel}")
    offsets = []
    total = 0
    for n in numels:
        if n < 0:
            raise ValueError(f"numel must be >= 0, got {n}")
        if align_numel > 0 and total % align_numel:
            total += align_numel - total % align_numel
        offsets.append(total)
        total += n
    if align_numel > 0 and total % world_size:
        total += world_size - total % world_size
    flat_numel = total
    shard_numel = -(-flat_numel // world_size)
    slices: list[int] = []
    for r in range(world_size):
        lo, hi = r * shard_numel, (r + 1) * shard_numel
        for off, n in zip(offsets, numels):
            s, e = max(off, lo), min(off + n, hi)
            if e > s:
                slices += (s - off, e - s, s - lo)
            else:
                slices += (0, 0, 0)
    return tuple(offsets), flat_numel, shard_numel, tuple(slices)
