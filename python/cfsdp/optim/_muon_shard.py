"""``cfsdp.optim.Muon`` on sharded DTensor parameters: each matrix gathered to one owner rank,
orthogonalized there, its chunks scattered back (issue 27 phase 2a).

A parameter of ``fully_shard`` is a DTensor ``Shard(d)`` over the mesh's shard dim (``Shard(0)``
by default, any ``d`` from ``shard_placement_fn``; HSDP: ``(Replicate(), Shard(d))``), and after
the reduce-scatter (and HSDP's all-reduce) its gradient has the same placements: rank ``i`` of
the shard group holds ``torch.chunk(full, n, d)[i]`` (empty past the last chunk).  Muon's
momentum is elementwise (done on the local shard by the caller); its Newton–Schulz needs the
whole matrix.  ``exchange`` does, per process group and dtype, for every matrix of a step:

each rank's chunk is a block of the matrix (``torch.chunk``'s offset and size along ``d``,
the whole extent along the others), every rank knows every rank's block from the full shape,
and ``_muon_bucket.exchange_blocks`` moves the blocks: owners from ``assign_owners``
(``_muon_owners``), bounded buckets, per bucket one all-to-all (cfsdp's ``comm.all_to_all``)
sending each rank's block of every matrix to the matrix's owner in bf16 (Newton–Schulz's first
op is ``.bfloat16()``), the owner writing the blocks into the full matrix and orthogonalizing
its matrices in one call (the caller's function: each matrix through torch's, [Note:
Newton-Schulz per matrix] in ``_muon``), so each matrix's Newton–Schulz runs on exactly one
rank of its shard group (HSDP: once per replica group), and one all-to-all back with each
rank's block of the results; the next bucket in flight while the owners work on this one.

The FullyShardedDataParallel wrapper's matrices take the same path with element ranges
(``Layout.sizes``, ``exchange``'s ``sizes``): rank ``i`` holds ``sizes[i]`` consecutive elements
of the row-major flattened matrix (its range of the flat shard), the ranges in rank order: a
block of the flattened ``[numel]`` matrix.  Both collectives of a bucket move about one
all-gather's bytes of its matrices (in bf16 forward: half of fp32's).
Pure torch (``torch.distributed``; no C), layouts checked by ``shard_layout``.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from . import _muon_mesh
from ._muon_bucket import exchange_blocks

__all__ = ["Layout", "chunk_blocks", "chunk_sizes", "exchange", "shard_layout"]


class Layout(NamedTuple):
    """Where a sharded parameter's matrix lies: chunk ``index`` of ``count`` along tensor dim
    ``dim``, over process ``group`` (mesh dim ``mesh_dim``) of global ``ranks``.  ``exchange``
    batches the matrices of one group (any ``dim`` each)."""
    group: object
    mesh_dim: int
    dim: int
    index: int
    count: int
    ranks: tuple
    # per rank of the group, how many consecutive elements of the row-major flattened matrix
    # it holds (the wrapper's flat shards); None: torch.chunk along ``dim``
    sizes: Optional[tuple] = None
    # with ``sizes``: the matrix's strides when it is not row-major (the wrapper's strided
    # originals: the ranges are of its memory order); None: row-major
    stride: Optional[tuple] = None


def shard_layout(t: Tensor) -> tuple[Optional[Layout], Optional[str]]:
    """``(layout, None)`` for a DTensor sharded as ``Shard(d)`` over exactly one mesh dim of more
    than one rank (the others ``Replicate``); ``(None, None)`` for a whole tensor (not a DTensor,
    or only ``Replicate`` / one-rank mesh dims); sharded over two mesh dims (TP x FSDP):
    ``_muon_mesh.mesh_layout``'s; ``(None, why)`` for a layout Muon cannot reassemble
    (``Partial``, a lone ``_StridedShard``)."""
    if not isinstance(t, DTensor):
        return None, None
    mesh = t.device_mesh
    found = []
    for md, pl in enumerate(t.placements):
        if mesh.size(md) > 1 and not pl.is_replicate():
            found.append((md, pl))
    if not found:
        return None, None
    desc = (f"a DTensor placed as {tuple(t.placements)} over a mesh of shape "
            f"{tuple(mesh.shape)}")
    if len(found) > 1:  # TP x FSDP: _muon_mesh
        return _muon_mesh.mesh_layout(t, found)
    md, pl = found[0]
    if type(pl) is not Shard:  # Partial, _StridedShard
        return None, (f"{desc}: mesh dim {md} holds {pl!r}, not a plain Shard(d) whose chunks "
                      "concatenate to the matrix")
    group = mesh.get_group(md)
    index = mesh.get_local_rank(md)
    if dist.get_rank(group) != index:
        return None, (f"{desc}: its chunk index {index} on mesh dim {md} is not its rank "
                      f"{dist.get_rank(group)} in that dim's process group")
    ranks = tuple(dist.get_process_group_ranks(group))
    return Layout(group, md, pl.dim % t.ndim, index, mesh.size(md), ranks), None


def chunk_sizes(size: int, count: int) -> list[int]:
    """The sizes of ``torch.chunk(x, count)`` along a dim of ``size``, padded with zeros to
    ``count`` entries (FSDP2's empty shards past the last chunk)."""
    c = -(-size // count)
    return [max(0, min(c, size - i * c)) for i in range(count)]


def chunk_blocks(shape: Sequence[int], dim: int, split: Sequence[int]) -> list[tuple]:
    """Every rank's ``(starts, sizes)`` block of a tensor of ``shape`` cut along ``dim`` into
    consecutive pieces of ``split`` (rank order): the whole extent along the other dims."""
    out, start = [], 0
    for c in split:
        starts, sizes = [0] * len(shape), list(shape)
        starts[dim], sizes[dim] = start, c
        out.append((tuple(starts), tuple(sizes)))
        start += c
    return out


def _view_shape(shape: Sequence[int], sizes: Optional[Sequence[int]]) -> list[int]:
    """The shape a matrix is split in: its own, or for element ranges
    (``sizes`` given) its flattened ``[numel]``."""
    return list(shape) if sizes is None else [math.prod(shape)]


def exchange(
    layout: Layout,
    shapes: Sequence[Sequence[int]],
    dims: Sequence[int],
    chunks: list,
    orthogonalize: Callable[[list], list],
    out_dtype: torch.dtype,
    sizes: Optional[Sequence[Optional[Sequence[int]]]] = None,
    wire_dtype: Optional[torch.dtype] = None,
    on_result: Optional[Callable[[int, Tensor], None]] = None,
    strides: Optional[Sequence[Optional[Sequence[int]]]] = None,
) -> list[Optional[Tensor]]:
    """This rank's chunk of ``orthogonalize``'s result for every matrix (see the module
    docstring).  ``chunks[k]`` is this rank's chunk along ``dims[k]`` of matrix ``k`` (full
    shape ``shapes[k]``; all over ``layout``'s group, chunk ``layout.index`` of
    ``layout.count``, one dtype); they travel as ``wire_dtype`` (default: the chunks' dtype),
    so ``orthogonalize`` must start by rounding to it (Muon's Newton–Schulz: bf16); it takes a
    list of full tensors of ``wire_dtype`` (its own to overwrite) and returns one tensor per
    input, each reshapeable to the input's shape, of ``out_dtype`` (given: a rank that owns no
    matrix sends and receives it too).  ``chunks`` (a list) is emptied as it is sent and
    ``on_result`` takes each result as it lands (``_muon_bucket.exchange_blocks``).
    ``sizes[k]``, when given and not None, makes matrix ``k``'s chunks element ranges (the
    wrapper's flat shards): rank ``r`` holds ``sizes[k][r]`` consecutive elements of the
    row-major flattened matrix, the ranges in rank order (``chunks[k]`` 1-D, ``dims[k]`` 0);
    ``strides[k]`` (element ranges only) of a matrix that is not row-major: the ranges are of
    its memory order (``_muon_bucket.exchange_blocks``).
    Every rank of ``layout.group`` must call this with the same shapes and sizes.  A matrix
    sharded over two mesh dims (``_muon_mesh.MeshLayout``, ``dims`` its ``Blocks``):
    ``_muon_mesh``'s."""
    if isinstance(layout, _muon_mesh.MeshLayout):
        return _muon_mesh.exchange(layout, shapes, dims, chunks, orthogonalize, out_dtype,
                                   wire_dtype, on_result)
    n, me = layout.count, layout.index
    sizes = list(sizes) if sizes is not None else [None] * len(shapes)
    vshapes = [_view_shape(s, z) for s, z in zip(shapes, sizes)]
    blocks = []
    for k, (v, d, z) in enumerate(zip(vshapes, dims, sizes)):
        split = chunk_sizes(v[d], n) if z is None else [int(x) for x in z]
        if len(split) != n or sum(split) != v[d]:
            raise AssertionError(f"matrix {k} of shape {tuple(shapes[k])}: split {split} of dim "
                                 f"{d} of {tuple(v)} over {n} ranks")
        blocks.append(chunk_blocks(v, d, split))
    return exchange_blocks(layout.group, n, me, shapes, vshapes, blocks, chunks, orthogonalize,
                           out_dtype, wire_dtype, on_result, strides)
