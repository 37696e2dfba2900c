"""A unit's copy-out and reduce-scatter copy-in in a fixed number of kernel launches, for an
accelerator's tensors (issue 26 item 2): torch FSDP2's ``split_with_sizes_copy`` and
``_chunk_cat``.

On the CPU, ``_core.chunk_unpack`` / ``chunk_pack`` are one C pass each.  An accelerator's
tensors take their Python twins (``cfsdp._ref.chunk``), which launch one or two copies per
parameter plus a Python loop: on a unit of many small parameters that is the host-bound
pre-forward torch's FSDP2 avoids.  ``Launches`` (built once per unit, from its plan) does the
same copies, bit for bit (pure copies; the division and cast of ``chunk_pack`` in the same
order), as:

* copy-out: one ``torch.split_with_sizes_copy`` of the rank-major all-gather output, viewed
  ``(W, S)``, along dim 1: a parameter whose ``W`` chunks tile it exactly (dim 0, ``numel ==
  W * chunk_numel``) lands straight in its segment of ``natural`` viewed ``(W, chunk)``;
  any other (uneven: its last chunks padded; ``Shard(d > 0)``: blocks) goes to a
  ``(W, chunk)`` temporary and then one copy into ``natural`` (torch's FSDP2 all-gathers into
  padded buffers and views them; cfsdp's ``natural`` has no padding);
* reduce-scatter copy-in: one ``torch._chunk_cat`` of the parameters' gradient views (dim 0,
  ``W`` chunks, padded as ``torch.chunk``) into the rank-major input; a ``Shard(d > 0)``
  gradient first made rank-major by one copy (as FSDP2's ``torch.cat`` of its chunks); then
  the pre-division in place and, when the reduce dtype differs, one cast (``chunk_pack``'s
  ``cast(src / divisor)``, the division in the gradient's dtype).

Gaps between chunks (none in cfsdp's layout today) are read into a temporary and written as
zeros.  tests/unit/test_streams.py compares both with the twins on every kind of plan and
counts the launches of a recorded training step.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

PlanEntry = tuple[int, int, int, int, int]  # (nat_off, numel, chunk_numel, shard_off, outer)

_GAP = -1  # a piece of the shard between chunks


def _check(t: torch.Tensor, numel: int, what: str) -> None:
    """The unit's plan was checked when the unit was laid out; the buffers each call."""
    if t.dim() != 1 or t.numel() != numel:
        raise ValueError(f"Launches: {what} must be 1-D with {numel} elements, got shape "
                         f"{tuple(t.shape)}")


class Launches:
    """The split of a unit's ``(W, S)`` rank-major layout into its parameters' chunks."""

    __slots__ = ("plan", "rows", "world_size", "shard_numel", "sizes", "owners")

    def __init__(self, plan: Sequence[PlanEntry], rows: Sequence[int], world_size: int,
                 shard_numel: int):
        """``rows``: each parameter's length along its shard dim (a dim-0 gradient is viewed
        ``(rows, numel // rows)`` for ``_chunk_cat``)."""
        self.plan, self.rows = list(plan), list(rows)
        self.world_size, self.shard_numel = world_size, shard_numel
        self.sizes: list[int] = []
        self.owners: list[int] = []  # per piece: its parameter's index, or _GAP
        pos = 0
        for i, (_, _, chunk, shard_off, _) in enumerate(self.plan):
            if chunk == 0:
                continue
            if shard_off > pos:
                self.sizes.append(shard_off - pos)
                self.owners.append(_GAP)
            self.sizes.append(chunk)
            self.owners.append(i)
            pos = shard_off + chunk
        if shard_numel > pos:
            self.sizes.append(shard_numel - pos)
            self.owners.append(_GAP)

    def _tiles(self, i: int) -> bool:
        """Whether parameter ``i``'s ``W`` chunks are its elements in order, unpadded."""
        _, numel, chunk, _, outer = self.plan[i]
        return outer == 1 and numel == self.world_size * chunk

    def _blocks(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s segment ``t`` (``outer > 1``) as ``(W, outer, blk)``: rank,
        block, element (a view)."""
        _, numel, _, _, outer = self.plan[i]
        W = self.world_size
        return t.view(outer, W, numel // (outer * W)).transpose(0, 1)

    def unpack(self, natural: torch.Tensor, gathered: torch.Tensor) -> None:
        """``_core.chunk_unpack(natural, gathered, plan, W, S)``."""
        W, S = self.world_size, self.shard_numel
        _check(gathered, W * S, "gathered")
        if not self.sizes:
            return
        outs, later = [], []
        for size, i in zip(self.sizes, self.owners):
            if i != _GAP and self._tiles(i):
                nat_off, numel, chunk, _, _ = self.plan[i]
                outs.append(natural[nat_off: nat_off + numel].view(W, chunk))
                continue
            tmp = gathered.new_empty((W, size))
            outs.append(tmp)
            if i != _GAP:
                later.append((i, tmp))
        torch.split_with_sizes_copy(gathered.view(W, S), self.sizes, dim=1, out=outs)
        for i, tmp in later:
            nat_off, numel, _, _, outer = self.plan[i]
            seg = natural[nat_off: nat_off + numel]
            if outer > 1:
                self._blocks(seg, i).copy_(tmp.view(W, outer, -1))
            else:  # rank-major (W, chunk) flattened is the padded parameter
                seg.copy_(tmp.view(-1)[:numel])

    def pack(self, dst: torch.Tensor, grad: torch.Tensor, divisor: float = 1.0,
             ranks: Optional[tuple[int, int]] = None) -> None:
        """``_core.chunk_pack(dst, grad, plan, W, S, divisor)`` (every rank)."""
        W, S = self.world_size, self.shard_numel
        if ranks is not None and tuple(ranks) != (0, W):
            raise ValueError(f"Launches.pack builds every rank's part, got ranks {ranks}")
        _check(dst, W * S, "dst")
        if S == 0:
            return
        parts = []
        for size, i in zip(self.sizes, self.owners):
            if i == _GAP:
                parts.append(grad.new_zeros((W, size)))
                continue
            nat_off, numel, _, _, outer = self.plan[i]
            seg = grad[nat_off: nat_off + numel]
            if outer > 1:  # rank-major first: its chunks are not runs of rows
                parts.append(self._blocks(seg, i).reshape(W, -1))
            else:
                rows = self.rows[i]
                parts.append(seg.view(rows, numel // rows))
        same = dst.dtype == grad.dtype
        out = dst.view(W, S) if same else grad.new_empty((W, S))
        torch._chunk_cat(parts, dim=0, num_chunks=W, out=out)
        if divisor != 1:
            out.div_(divisor)
        if not same:
            dst.view(W, S).copy_(out)
