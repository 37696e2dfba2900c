"""The collective engine: plain functions over a process group.

Every rank issues a unit's collectives in the same order; each function
returns a handle to wait on (``None`` when issued synchronously).  Gloo and
NCCL both execute the collectives of one process group in issue order, so an
asynchronous all-gather issued for prefetching is complete before a later
collective's result is used.  This is the one seam where an intra-node C path
(shared memory) slots in later.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class Pending:
    """A collective in flight and the tensors it must keep alive."""

    __slots__ = ("work", "keep")

    def __init__(self, work: Optional[dist.Work], *keep: torch.Tensor):
        self.work = work
        self.keep = keep

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.keep = ()


def all_gather(
    out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> Pending:
    """Gather every rank's ``shard`` into ``out`` (``world_size * shard.numel()``)."""
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old
    # name warns); look it up per call so torch>=2.9 works and tools that patch
    # torch.distributed (our collective-order test) see the call.
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = ag(out, shard, group=group, async_op=async_op)
    return Pending(work, out, shard)


def reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, async_op: bool,
    op=dist.ReduceOp.SUM,
) -> Pending:
    """Reduce ``inp`` over ranks (sum, or ``op``) and keep this rank's chunk in ``out``."""
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = rs(out, inp, op=op, group=group, async_op=async_op)
    return Pending(work, out, inp)


def all_reduce(
    t: torch.Tensor, group: dist.ProcessGroup, async_op: bool, op=dist.ReduceOp.SUM
) -> Pending:
    """Reduce ``t`` (sum, or ``op``) over the ranks of ``group``, in place."""
    work = dist.all_reduce(t, op=op, group=group, async_op=async_op)
    return Pending(work, t)


def broadcast(t: torch.Tensor, src_rank_in_group: int, group: dist.ProcessGroup) -> None:
    """Broadcast ``t`` in place from the group's rank ``src_rank_in_group``."""
    dist.broadcast(t, group=group, group_src=src_rank_in_group)
