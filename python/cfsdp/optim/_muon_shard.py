"""``cfsdp.optim.Muon`` on sharded DTensor parameters: each matrix gathered to one owner rank,
orthogonalized there, its chunks scattered back (issue 27 phase 2a).

A parameter of ``fully_shard`` is a DTensor ``Shard(d)`` over the mesh's shard dim (``Shard(0)``
by default, any ``d`` from ``shard_placement_fn``; HSDP: ``(Replicate(), Shard(d))``), and after
the reduce-scatter (and HSDP's all-reduce) its gradient has the same placements: rank ``i`` of
the shard group holds ``torch.chunk(full, n, d)[i]`` (empty past the last chunk).  Muon's
momentum is elementwise (done on the local shard by the caller); its Newton–Schulz needs the
whole matrix.  ``exchange`` does, per process group and dtype, for every matrix of a step:

1. ``assign_owners`` (``_muon_owners``) over the shard group's size: every rank computes the same
   owners from the full shapes, no communication;
2. one ``all_to_all_single``: each rank sends its chunk of every matrix to the matrix's owner,
   the chunk padded along ``d`` to the largest chunk (``ceil(size / n)``: torch.chunk's chunk
   size) so that every slot of a matrix has one size every rank knows; the owner drops the
   padding and concatenates the chunks in torch.chunk order along ``d``: the full matrix;
3. the owner orthogonalizes its matrices in one call (the caller's function: same-shape ones
   stacked, [Note: stacked Newton-Schulz] in ``_muon``), so each matrix's Newton–Schulz runs on
   exactly one rank of its shard group (HSDP: once per replica group);
4. one ``all_to_all_single`` back: the owner sends rank ``i`` chunk ``i`` of each result
   (padded the same way); each rank gets its chunk of every matrix's update.

The FullyShardedDataParallel wrapper's matrices take the same path with element ranges
(``Layout.sizes``, ``exchange``'s ``sizes``): rank ``i`` holds ``sizes[i]`` consecutive elements
of the row-major flattened matrix (its range of the flat shard), the ranges in rank order, so
the same padding to the largest range and concatenation (of the 1-D ranges) reassemble it.

Slots are ordered by matrix index within a destination, destinations by rank (what
``all_to_all_single``'s splits want).  Both collectives move about one all-gather's bytes.
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
from ._muon_owners import assign_owners

__all__ = ["Layout", "chunk_sizes", "exchange", "pad_chunk", "shard_layout", "unpad_cat"]


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


def pad_chunk(t: Tensor, dim: int, padded: int) -> Tensor:
    """``t`` (a chunk) zero-padded along ``dim`` to ``padded``, contiguous (a new tensor)."""
    shape = list(t.shape)
    shape[dim] = padded
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def unpad_cat(slots: Sequence[Tensor], sizes: Sequence[int], dim: int) -> Tensor:
    """The full tensor from its padded chunks (``slots[i]`` holds ``sizes[i]`` of ``dim``)."""
    return torch.cat([s.narrow(dim, 0, k) for s, k in zip(slots, sizes)], dim=dim)


def _view_shape(shape: Sequence[int], sizes: Optional[Sequence[int]]) -> list[int]:
    """The shape a matrix is split in: its own, or for element ranges
    (``sizes`` given) its flattened ``[numel]``."""
    return list(shape) if sizes is None else [math.prod(shape)]


def exchange(
    layout: Layout,
    shapes: Sequence[Sequence[int]],
    dims: Sequence[int],
    chunks: Sequence[Tensor],
    orthogonalize: Callable[[list], list],
    out_dtype: torch.dtype,
    sizes: Optional[Sequence[Optional[Sequence[int]]]] = None,
) -> list[Tensor]:
    """This rank's chunk of ``orthogonalize``'s result for every matrix (see the module
    docstring).  ``chunks[k]`` is this rank's chunk along ``dims[k]`` of matrix ``k`` (full
    shape ``shapes[k]``; all over ``layout``'s group, chunk ``layout.index`` of
    ``layout.count``, one dtype); ``orthogonalize`` takes a list of full tensors and
    returns one tensor per input, each reshapeable to the input's shape, of ``out_dtype``
    (given: a rank that owns no matrix sends and receives it too).
    ``sizes[k]``, when given and not None, makes matrix ``k``'s chunks element ranges (the
    wrapper's flat shards): rank ``r`` holds ``sizes[k][r]`` consecutive elements of the
    row-major flattened matrix, the ranges in rank order (``chunks[k]`` 1-D, ``dims[k]`` 0).
    Every rank of ``layout.group`` must call this with the same shapes and sizes.  A matrix
    sharded over two mesh dims (``_muon_mesh.MeshLayout``, ``dims`` its ``Blocks``):
    ``_muon_mesh``'s."""
    if isinstance(layout, _muon_mesh.MeshLayout):
        return _muon_mesh.exchange(layout, shapes, dims, chunks, orthogonalize, out_dtype)
    n, me, pg = layout.count, layout.index, layout.group
    owners = assign_owners(shapes, n)
    sizes = list(sizes) if sizes is not None else [None] * len(shapes)
    vshapes = [_view_shape(s, z) for s, z in zip(shapes, sizes)]
    split = [chunk_sizes(v[d], n) if z is None else [int(x) for x in z]
             for v, d, z in zip(vshapes, dims, sizes)]
    for k, (v, d, t) in enumerate(zip(vshapes, dims, chunks)):
        want = list(v)
        want[d] = split[k][me]
        if len(split[k]) != n or sum(split[k]) != v[d] or list(t.shape) != want:
            raise AssertionError(f"matrix {k} of shape {tuple(shapes[k])}: local chunk "
                                 f"{tuple(t.shape)} on chunk {me} of {n} along dim {d} of "
                                 f"{tuple(v)} split {split[k]}, expected {tuple(want)}")
    slots = []
    for v, d, ss in zip(vshapes, dims, split):
        slot = list(v)
        slot[d] = max(ss) if ss else 0
        slots.append(slot)
    starts = [[sum(ss[:r]) for r in range(n)] for ss in split]
    numel = [math.prod(s) for s in slots]
    dtype = chunks[0].dtype if chunks else torch.float32
    device = chunks[0].device if chunks else torch.device("cpu")
    by_owner = [[k for k in range(len(shapes)) if owners[k] == r] for r in range(n)]
    per_owner = [sum(numel[k] for k in ks) for ks in by_owner]  # slots' numel per owner
    mine, mine_numel = by_owner[me], per_owner[me]
    # 1. chunks to their owners
    send = [pad_chunk(chunks[k], dims[k], slots[k][dims[k]]).view(-1)
            for r in range(n) for k in by_owner[r]]
    send_t = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
    recv_t = torch.empty(mine_numel * n, dtype=dtype, device=device)
    dist.all_to_all_single(recv_t, send_t, [mine_numel] * n, per_owner, group=pg)
    # 2. the owner reassembles and orthogonalizes its matrices (rank r's slots at r * mine_numel)
    fulls, off = [], 0
    for k in mine:
        fulls.append(unpad_cat([recv_t.narrow(0, r * mine_numel + off, numel[k]).view(slots[k])
                                for r in range(n)], split[k], dims[k]).view(shapes[k]))
        off += numel[k]
    results = [o.reshape(vshapes[k]) for k, o in zip(mine, orthogonalize(fulls))] if fulls else []
    # 3. each rank's chunk of every result back
    send = []
    for r in range(n):
        for k, res in zip(mine, results):
            if res.dtype != out_dtype:
                raise AssertionError(f"orthogonalize returned {res.dtype}, expected {out_dtype}")
            d = dims[k]
            part = res.narrow(d, starts[k][r], split[k][r])
            send.append(pad_chunk(part, d, slots[k][d]).view(-1))
    send_t = torch.cat(send) if send else torch.empty(0, dtype=out_dtype, device=device)
    recv_t = torch.empty(sum(per_owner), dtype=out_dtype, device=device)
    dist.all_to_all_single(recv_t, send_t, per_owner, [mine_numel] * n, group=pg)
    # 4. this rank's chunk of each matrix, padding dropped
    out: list = [None] * len(shapes)
    off = 0
    for r in range(n):
        for k in by_owner[r]:
            out[k] = recv_t.narrow(0, off, numel[k]).view(slots[k]).narrow(dims[k], 0, split[k][me])
            off += numel[k]
    return out
