"""``cfsdp.optim.Muon`` on a parameter sharded over several mesh dims (TP x FSDP, HSDP x TP, EP).

TP's ``ColwiseParallel`` / ``RowwiseParallel`` shard a weight along dim 0 / 1 over the ``tp``
mesh dim; ``fully_shard`` on ``dp`` then shards each TP-local piece along dim 0 (torch.chunk):
placements ``(Shard(0), Shard(1))`` (rowwise), or, when both shard dim 0 (colwise),
``(_StridedShard(0, split_factor=tp), Shard(0))``: the TP chunk taken first, the dp chunk of
it second.  Either way each rank holds one rectangular block of the matrix, found by applying
torch.chunk per mesh dim in the order the shardings were applied (``block``).  ``exchange``
(the two-dim form of ``_muon_shard.exchange``): every rank computes every rank's block of every
matrix from the full shape and placements, and ``_muon_bucket.exchange_blocks`` (shared with
``_muon_shard``) sends each block to the matrix's owner (``assign_owners`` over the flattened
``dp x tp`` ranks) in bounded buckets, bf16 on the wire, one all-to-all over those ranks each
way per bucket; the owner writes the blocks into the full matrix, orthogonalizes its matrices,
and sends each rank its block of the results.

More than two sharded dims are taken when every one is a plain ``Shard(d)`` (DTensor takes
their chunks in mesh-dim order: ``block`` does the same).  The mesh may have more dims than the
sharded ones, each ``Replicate`` or of one rank (HSDP x
TP: ``(Replicate(), Shard or _StridedShard, Shard)`` over ``(replicate, shard, tp)``), and need
not span the world (a pipeline stage's ``(dp, tp)`` sub-mesh): a matrix's blocks lie on the
ranks that share this rank's coordinates on the other dims (``group_ranks``), which hold the
same values on every replicate (the gradients are reduced over it), so each such set of ranks
orthogonalizes its own copy, as HSDP's shard groups do.  The exchange runs on a process group
of exactly those ranks, made once per set of ranks (``dist.new_group`` with
``use_local_synchronization``: only its members take part, at the optimizer's construction,
where they check their parameters in the same order).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ._muon_bucket import exchange_blocks

__all__ = ["Blocks", "MeshLayout", "block", "exchange", "group_ranks", "mesh_layout"]

# the exchange's process groups: default group -> {sorted global ranks: group}
_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class Blocks(NamedTuple):
    """Every rank's block of one matrix, in the group's rank order: ``(starts, sizes)``."""
    of_rank: tuple


class MeshLayout(NamedTuple):
    """A matrix sharded over two mesh dims: its ``Blocks`` (``dim``) over process ``group``
    (the ranks it is cut over, ``ranks``, sorted: group rank order), this rank ``index`` of
    ``count``."""
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


def group_ranks(where: dict, me: int, sharded: Sequence[int]) -> tuple:
    """The global ranks (sorted) whose mesh coordinates equal rank ``me``'s on every mesh dim
    but the ``sharded`` ones: the ranks over which ``me``'s matrices are cut.  ``where``: global
    rank -> mesh coordinate, for every rank of the mesh."""
    mine = where[me]
    return tuple(sorted(r for r, c in where.items()
                        if all(c[m] == mine[m] for m in range(len(mine)) if m not in sharded)))


def _exchange_group(ranks: tuple):
    """The process group of ``ranks`` (sorted global ranks, this one among them) for Muon's
    exchange, made the first time its members ask (they ask together: see the module doc)."""
    default = dist.distributed_c10d._get_default_group()
    made = _GROUPS.setdefault(default, {})
    if ranks not in made:
        made[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return made[ranks]


def _order(found: list, mesh) -> Optional[tuple]:
    """The mesh dims of ``found`` in the order their chunks are taken: every placement a plain
    ``Shard`` (any number of dims: mesh-dim order, as DTensor shards), or two where the first
    is the ``_StridedShard`` fully_shard puts beside TP's ``Shard`` of the same dim (TP's chunk
    first); None for anything else."""
    if all(type(p) is Shard for _, p in found):
        return tuple(m for m, _ in found)
    if len(found) == 2:
        (m0, p0), (m1, p1) = found
        if (type(p0) is _StridedShard and type(p1) is Shard and p0.dim == p1.dim
                and p0.split_factor == mesh.size(m1)):
            return (m1, m0)
    return None


def mesh_layout(t, found: list) -> tuple[Optional[MeshLayout], Optional[str]]:
    """The layout of DTensor ``t`` whose ``found`` ``(mesh dim, placement)`` entries are its
    sharded mesh dims (two or more), or ``(None, why)``."""
    mesh = t.device_mesh
    desc = (f"a DTensor placed as {tuple(t.placements)} over a mesh of shape "
            f"{tuple(mesh.shape)}")
    order = _order(found, mesh)
    if order is None:
        return None, (f"{desc}: its chunks are not plain Shard(d)s taken in mesh-dim order, "
                      "nor fully_shard's _StridedShard beside TP's Shard of the same dim")
    dims = {m: p.dim % t.ndim for m, p in found}
    where = {}  # global rank -> its mesh coordinate
    for coord in itertools.product(*(range(s) for s in mesh.shape)):
        where[int(mesh.mesh[coord])] = coord
    me = dist.get_rank()
    if me not in where:
        return None, f"{desc}: this rank ({me}) is not in the mesh"
    ranks = group_ranks(where, me, order)
    blocks = Blocks(tuple(block(t.shape, [(dims[m], mesh.size(m), where[r][m]) for m in order])
                          for r in ranks))
    return MeshLayout(_exchange_group(ranks), None, blocks, ranks.index(me), len(ranks),
                      ranks), None


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
