"""``cfsdp.optim.Muon`` on a parameter sharded over two mesh dims (TP x FSDP, issue 27 phase 2b).

TP's ``ColwiseParallel`` / ``RowwiseParallel`` shard a weight along dim 0 / 1 over the ``tp``
mesh dim; ``fully_shard`` on ``dp`` then shards each TP-local piece along dim 0 (torch.chunk):
placements ``(Shard(0), Shard(1))`` (rowwise), or, when both shard dim 0 (colwise),
``(_StridedShard(0, split_factor=tp), Shard(0))``: the TP chunk taken first, the dp chunk of
it second.  Either way each rank holds one rectangular block of the matrix, found by applying
torch.chunk per mesh dim in the order the shardings were applied (``block``).  ``exchange``
(the two-dim form of ``_muon_shard.exchange``): every rank computes every rank's block of every
matrix from the full shape and placements, and ``_muon_bucket.exchange_blocks`` (shared with
``_muon_shard``) sends each block to the matrix's owner (``assign_owners`` over the flattened
``dp x tp`` ranks) in bounded buckets, bf16 on the wire, one ``all_to_all_single`` over the
mesh's ranks each way per bucket; the owner writes the blocks into the full matrix,
orthogonalizes its matrices, and sends each rank its block of the results.  The process group
is the world's (the mesh must span every rank: the mesh's own groups are one per dim).  Pure
torch.
"""

from __future__ import annotations

import itertools
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ._muon_bucket import exchange_blocks

__all__ = ["Blocks", "MeshLayout", "block", "exchange", "mesh_layout"]


class Blocks(NamedTuple):
    """Every rank's block of one matrix, in the group's rank order: ``(starts, sizes)``."""
    of_rank: tuple


class MeshLayout(NamedTuple):
    """A matrix sharded over two mesh dims: its ``Blocks`` (``dim``) over process ``group``
    (every rank of the mesh, ``ranks``), this rank ``index`` of ``count``."""
    group: object
    mesh_dim: Optional[int]
    dim: Blocks
    index: int
    count: int
    ranks: tuple
    sizes: None = None  # (``_muon_shard.Layout``'s element ranges: never, for blocks)


def block(shape: Sequence[int], steps: Sequence[tuple[int, int, int]]) -> tuple[tuple, tuple]:
    """``(starts, sizes)`` of the piece ``torch.chunk`` leaves after each ``(dim, count,
    index)`` of ``steps`` in turn (empty past the last chunk)."""
    starts, sizes = [0] * len(shape), list(shape)
    for d, n, i in steps:
        c = -(-sizes[d] // n)
        lo = min(i * c, sizes[d])
        starts[d] += lo
        sizes[d] = max(0, min(c, sizes[d] - lo))
    return tuple(starts), tuple(sizes)


def mesh_layout(t, found: list) -> tuple[Optional[MeshLayout], Optional[str]]:
    """The layout of DTensor ``t`` whose ``found`` ``(mesh dim, placement)`` entries are its
    sharded mesh dims (two), or ``(None, why)``."""
    mesh = t.device_mesh
    desc = (f"a DTensor placed as {tuple(t.placements)} over a mesh of shape "
            f"{tuple(mesh.shape)}")
    if len(found) != 2 or mesh.ndim != 2:
        return None, (f"{desc}: sharded over {len(found)} of {mesh.ndim} mesh dims; only a "
                      "2-D (dp, tp) mesh with both dims sharded is implemented (issue 27 phase 2b)")
    (m0, p0), (m1, p1) = found
    if type(p1) is not Shard:
        return None, f"{desc}: mesh dim {m1} holds {p1!r}, not a plain Shard(d)"
    if type(p0) is _StridedShard:
        if p0.dim != p1.dim or p0.split_factor != mesh.size(m1):
            return None, (f"{desc}: {p0!r} is not the dp chunk of a tp Shard({p0.dim}) of "
                          f"{mesh.size(m1)} chunks")
        order = (m1, m0)  # the tp chunk first, then fully_shard's chunk of it
    elif type(p0) is Shard:
        order = (m0, m1)
    else:
        return None, f"{desc}: mesh dim {m0} holds {p0!r}, not Shard(d) or _StridedShard"
    world = dist.get_world_size()
    if mesh.size() != world:
        return None, (f"{desc}: the mesh spans {mesh.size()} of {world} ranks; Muon reassembles "
                      "a matrix sharded over two mesh dims over the world's group only")
    dims = {m0: p0.dim % t.ndim, m1: p1.dim % t.ndim}
    where = {}  # global rank -> its mesh coordinate
    for coord in itertools.product(*(range(s) for s in mesh.shape)):
        where[int(mesh.mesh[coord])] = coord
    ranks = tuple(range(world))
    blocks = Blocks(tuple(block(t.shape, [(dims[m], mesh.size(m), where[r][m]) for m in order])
                          for r in ranks))
    group = dist.group.WORLD
    return MeshLayout(group, None, blocks, dist.get_rank(), world, ranks), None


def exchange(
    layout: MeshLayout,
    shapes: Sequence[Sequence[int]],
    blocks: Sequence[Blocks],
    chunks: list,
    orthogonalize: Callable[[list], list],
    out_dtype: torch.dtype,
    wire_dtype: Optional[torch.dtype] = None,
    on_result: Optional[Callable[[int, Tensor], None]] = None,
) -> list[Optional[Tensor]]:
    """This rank's block of ``orthogonalize``'s result for every matrix (see the module
    docstring); ``_muon_shard.exchange``'s contract with ``blocks[k]`` (every rank's block of
    matrix ``k``) for its ``dims``."""
    return exchange_blocks(layout.group, layout.count, layout.index, shapes, shapes,
                           [b.of_rank for b in blocks], chunks, orthogonalize, out_dtype,
                           wire_dtype, on_result)
