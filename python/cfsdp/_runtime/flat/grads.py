"""A wrapper unit's gradient path (torch FSDP1's post-backward, FSDP2's gradient
ownership), a part of ``unit.Unit``.  The forward views are views of ``flat_param``, so every
parameter's gradient lands in one flat gradient:

* before backward an existing sharded gradient is moved aside (``take_grad_for_backward``,
  into ``saved_grad``) so the new unsharded one accumulates alone; under ``no_sync()`` the
  unsharded gradient stays on ``flat_param`` unreduced (``keep_unsharded_grad``,
  ``grad_unsharded``);
* ``reduce_grad``: cast to ``reduce_dtype`` and pre-divided as torch's, then the
  reduce-scatter of the padded flat gradient (an all-reduce with NO_SHARD), or the user's
  communication hook; the finished reduction (``accumulate_reduced``) is post-divided, cast
  and folded into ``saved_grad`` (``base.accumulate_sharded``, HSDP's all-reduce across
  replicas included);
* ``publish_grad``: the reduced gradient becomes ``flat_param.grad`` (sharded; full with
  NO_SHARD; in ``param_dtype`` with ``keep_low_precision_grads``).  With
  ``use_orig_params=True`` each original parameter's ``.grad`` is a view of its part of it
  (``orig_grads_as_shard_views``, one C pass), or a full-shape view of no_sync()'s unsharded
  gradient (``publish_unsharded_grad``, ``show_unsharded_grad``), and a ``zero_grad`` of every
  original parameter drops the flat gradient.  A unit that took no part in a backward (its
  module not called in that step) keeps what its original parameters show, as torch's
  FSDP1, whose grad views are set in a unit's own post-backward only
  ([Note: units outside a backward]);
* summon_full_params(with_grads=True): the sharded gradient all-gathered (``unshard_grad``)
  and shown on the full parameters (``grads_as_full`` / ``grads_as_sharded``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ... import _core
from .. import comm, device
from ..base import (FinishedReduce, PendingReduce, accumulate_sharded, all_none, issue_reduction,
                    set_grad, views_or_none)
from ..reduce import scale_cast_add
from ..views import as_tp


class FlatGrads:
    """The flat gradient: its reduction, its accumulation, and what the optimizer and the
    original parameters see of it.  A part of ``unit.Unit``."""

    def reduce_grad(self, grad: torch.Tensor) -> PendingReduce:
        """Pre-divide and issue the reduction of the unsharded flat gradient:
        a reduce-scatter (sharded) or an all-reduce (NO_SHARD).  ``finish``
        post-divides and folds the result into the unit's gradient (with streams it is
        folded in already: a ``FinishedReduce``)."""
        self.in_backward = True
        ctx = self._comm
        if ctx is not None and ctx.streams:
            return self._reduce_on_streams(ctx, grad)
        return self._issue_reduce(grad, True)

    def _reduce_on_streams(self, ctx, grad: torch.Tensor) -> FinishedReduce:
        """[Note: FSDP1 streams] in streams.py: the post-backward stream waits for the
        current one; the cast, the collective (``async_op=False``) and the fold run on it
        (HSDP's all-reduce and the fold after it on the all-reduce stream, which waits for
        it); finished when it returns, as far as the CPU is concerned."""
        layer = ctx.layer
        pb = ctx.stream(device.POST_BACKWARD)
        ctx.post_backward_waits_current(pb, layer.current_stream())
        with layer.on(pb):
            reduction = self._issue_reduce(grad, False)
        post = pb
        if self.replicate_group is not None and self.sharded:
            post = ctx.stream(device.ALL_REDUCE)
            post.wait_stream(pb)
            layer.record_stream(reduction.out, post)
        with layer.on(post):
            reduction.finish()
        layer.record_stream(grad, pb)  # made on the current stream, read on this one
        return FinishedReduce()

    def _issue_reduce(self, grad: torch.Tensor, async_op: bool) -> PendingReduce:
        lay = self.layout
        if grad.numel() != lay.flat_numel:
            raise AssertionError(
                f"unsharded grad has {grad.numel()} elements, expected {lay.flat_numel}"
            )
        if grad.dtype != self.reduce_dtype and not self.comm_hook_low_precision:
            grad = grad.to(self.reduce_dtype)  # torch casts before dividing
        if self.comm_hook is not None:
            return self._reduce_with_hook(grad)
        if not self.sharded:
            if self.pre_divide > 1:
                scale_cast_add(grad, grad, self.pre_divide, False)
            return PendingReduce(self, comm.all_reduce(grad, self.group, async_op), grad)
        if lay.flat_numel == lay.padded_numel and grad.is_contiguous():
            inp = grad
            if self.pre_divide > 1:
                scale_cast_add(inp, inp, self.pre_divide, False)
        else:
            inp = torch.empty(lay.padded_numel, dtype=grad.dtype, device=grad.device)
            scale_cast_add(inp[: lay.flat_numel], grad.contiguous(), self.pre_divide, False)
            inp[lay.flat_numel :].zero_()
        out = torch.empty(lay.shard_numel, dtype=grad.dtype, device=grad.device)
        return PendingReduce(self, comm.reduce_scatter(out, inp, self.group, async_op), out)

    def _reduce_with_hook(self, grad: torch.Tensor) -> PendingReduce:
        """The user's communication hook does the reduction (synchronously), as
        torch's FSDP1 calls it: ``hook(state, padded_grad, output)`` for sharded
        strategies, ``hook(state, grad)`` (in place) for NO_SHARD."""
        lay = self.layout
        if not self.sharded:
            self.comm_hook(self.comm_hook_state, grad)
            return PendingReduce(self, comm.Pending(None), grad, divided=True)
        if lay.flat_numel == lay.padded_numel:
            inp = grad.contiguous()
        else:
            inp = torch.zeros(lay.padded_numel, dtype=grad.dtype, device=grad.device)
            inp[: lay.flat_numel].copy_(grad)
        out_dtype = self.dtype if self.comm_hook_low_precision else grad.dtype
        out = torch.empty(lay.shard_numel, dtype=out_dtype, device=grad.device)
        self.comm_hook(self.comm_hook_state, inp, out)
        return PendingReduce(self, comm.Pending(None, inp), out, divided=True)

    def accumulate_reduced(self, out: torch.Tensor, divided: bool) -> None:
        """A finished reduction: NO_SHARD's all-reduced gradient is the gradient
        (post-divided, cast unless low-precision gradients are kept); a sharded
        one is folded into ``saved_grad`` (``base.accumulate_sharded``)."""
        if self.sharded:
            accumulate_sharded(self, out, divided)
            return
        if self.post_divide > 1 and not divided:
            scale_cast_add(out, out, self.post_divide, False)
        if out.dtype != self.dtype and not self.keep_low_precision_grads:
            out = out.to(self.dtype)
        set_grad(self.flat_param, out)

    def new_grad_buffer(self) -> torch.Tensor:
        """A buffer for a new sharded gradient (the parameters' dtype)."""
        return torch.empty(self.layout.shard_numel, dtype=self.dtype, device=self.device)

    def keep_unsharded_grad(self, grad: torch.Tensor) -> None:
        """no_sync(): keep the local unsharded gradient (accumulating) unreduced.  It may
        be of another dtype than the parameter's data (NO_SHARD with mixed precision: the
        reduced full-precision gradient of an earlier backward, to which autograd added
        this one, as torch's FSDP1 accumulates it)."""
        set_grad(self.flat_param, grad)
        self.grad_unsharded = True
        self.in_backward = True

    def take_grad_for_backward(self) -> None:
        """Before backward: move an existing *sharded* gradient aside so the
        new unsharded one can accumulate, and fold it back in ``finish``.  An
        unsharded gradient from no_sync() (or NO_SHARD's full gradient) stays
        in place and keeps accumulating."""
        self.in_backward = True
        g = self.flat_param.grad
        if g is None or self.grad_unsharded or not self.sharded:
            return
        if self.saved_grad is not None:
            raise AssertionError("cfsdp unit already holds a saved gradient")
        # accumulate in the parameters' dtype even if the optimizer was shown a
        # low-precision gradient (keep_low_precision_grads)
        self.saved_grad = g if g.dtype == self.dtype else g.to(self.dtype)
        self.flat_param.grad = None

    def take_waiting_grad(self) -> Optional[torch.Tensor]:
        """At the end of backward: forget the recorded node, and take off the parameter a
        gradient accumulated in nodes the gradient-ready hook did not act in and that no
        hook took since (None if none) ([Note: one post-backward per iteration] in
        base.py)."""
        self.first_grad_node = None
        if not self.grad_waiting:
            return None
        self.grad_waiting = False
        grad = self.flat_param.grad
        self.flat_param.grad = None
        return grad

    # [Note: no_sync() then a backward that does not reach the unit]
    # A unit whose module ``no_sync()`` micro-batches used but the synchronising backward
    # did not reach (not called, or its output not in the loss): torch's FSDP1 runs no
    # post-backward for it, so what ``no_sync()`` accumulated stays unsharded and
    # unreduced on ``flat_param``.  With a sharded strategy torch then fails at the end of
    # that backward (``prepare_gradient_for_optim``: "All sharded parameters that received a
    # gradient in the post-backward should use `_saved_grad_shard`"); with NO_SHARD each
    # rank steps its own local sum, so the replicas silently drift apart.  cfsdp reduces it
    # at the end of that backward, as torch's FSDP2 does (its final callback runs
    # ``post_backward`` for every parameter group not reached), with the reduction the
    # unit's post-backward would have issued: the gradients are those of the same
    # micro-batches with the unit in the synchronising one's loss at weight 0 (a
    # single-process run is the oracle: ``no_sync_unit_not_reached`` in
    # tests/distributed/strategies/no_sync.py).

    def reduce_unreached(self, pending: list) -> None:
        """End of a synchronising backward that did not reach this unit: reduce what
        ``no_sync()`` accumulated (nothing when it accumulated nothing); see [Note: no_sync()
        then a backward that does not reach the unit].  Finishes the reductions in
        ``pending`` first (one in flight, as ``UnitState._post_backward``) and appends its
        own."""
        grad = self.flat_param.grad
        if not self.grad_unsharded or grad is None:
            return
        self.flat_param.grad = None
        issue_reduction(pending, self, grad)

    # [Note: units outside a backward]
    # The end of every backward visits every unit of the root, also those whose module
    # was not called in that step (a branch not taken) or whose output did not reach the
    # loss.  torch's FSDP1 sets the original parameters' gradients in a unit's own
    # post-backward only, so such a unit's original parameters keep what they showed:
    # None after ``zero_grad``.  Shown again from ``flat_param.grad``, which still holds
    # the last step's gradient (only the unit's own pre-forward drops it after a
    # ``zero_grad``), the optimizer would step them with that stale gradient; under
    # ``no_sync()`` a sharded stale gradient would be viewed at full shapes.
    # ``in_backward`` (set by the pre-backward and the post-backward) says whether the
    # unit took part; the end-of-backward calls read and clear it.

    def publish_grad(self) -> None:
        """After a synchronising backward: expose the reduced gradient to the
        optimizer (sharded for sharded strategies, full for NO_SHARD).  A unit that
        took no part in it leaves its original parameters' gradients as they are
        ([Note: units outside a backward])."""
        took_part, self.in_backward = self.in_backward, False
        if self.saved_grad is not None:
            g = self.saved_grad
            if self.keep_low_precision_grads and g.dtype != self.param_dtype:
                g = g.to(self.param_dtype)
            set_grad(self.flat_param, g)
            self.saved_grad = None
        self.grad_unsharded = False
        if self.use_orig_params and took_part:
            self.orig_grads_as_shard_views()

    def _grad_views(self, g: Optional[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        if g is None:
            return [None] * len(self.infos)
        return [
            i.view(g[off : off + i.numel]) for off, i in zip(self.layout.offsets, self.infos)
        ]

    def publish_unsharded_grad(self) -> None:
        """After a no_sync() backward: ``show_unsharded_grad`` if the unit took part in
        it ([Note: units outside a backward])."""
        took_part, self.in_backward = self.in_backward, False
        if took_part:
            self.show_unsharded_grad()

    def show_unsharded_grad(self) -> None:
        """With use_orig_params=True: each original parameter's ``.grad`` is a
        full-shape view of no_sync()'s unsharded gradient (as torch does, although the
        parameter itself is sharded)."""
        if not self.use_orig_params:
            return
        for info, v in zip(self.infos, self._grad_views(self.flat_param.grad)):
            set_grad(info.param, v if info.param.requires_grad else None)
        self._note_grads()

    # ---------------------------------------------- the original parameters' .grad
    def drop_grad_if_orig_grads_cleared(self) -> None:
        """With use_orig_params=True the optimizer sees the original parameters:
        when every one of their ``.grad`` was set to None (``zero_grad``), the
        flat gradient goes too."""
        if self.use_orig_params and self.flat_param.grad is not None:
            if all_none(_core.attr_get(self._orig_t, "grad")):
                self.flat_param.grad = None
                self.grad_unsharded = False
                self._note_grads()

    # ------------------------------------------- summon(with_grads=True)
    def unshard_grad(self) -> Optional[torch.Tensor]:
        """All-gather the sharded gradient (torch FSDP1's ``unshard_grad``).

        Collective: every rank of the unit calls it.  Returns the padded full
        gradient, or None when no rank has one; a rank without a gradient
        contributes zeros.  Unit must be idle (``flat_param.grad`` sharded)."""
        g = self.flat_param.grad
        if not self.sharded:  # NO_SHARD: the gradient is already full
            return g
        none = torch.tensor([int(g is None)], dtype=torch.int32, device=self.device)
        dist.all_reduce(none, group=self.group)
        if int(none.item()) == self.world_size:
            return None
        if g is None:
            g = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        full = torch.empty(self.layout.padded_numel, dtype=g.dtype, device=self.device)
        comm.all_gather(full, g.contiguous(), self.group, async_op=False)
        return full

    def grads_as_full(self, full: Optional[torch.Tensor]) -> None:
        """use_orig_params=True, after :meth:`params_as_full`: each original
        parameter's ``.grad`` is a view of ``full`` (None when ``full`` is).

        NO_SHARD shows the flat gradient itself, in its own dtype through
        ``set_grad``'s side-step (keep_low_precision_grads), as torch's
        ``_use_unsharded_grad_views``; a sharded strategy's low-precision
        gradient is refused by autograd's dtype check, as torch's
        ``flat_param.grad =`` in ``unshard_grad`` refuses it."""
        for i, (off, info) in enumerate(zip(self.layout.offsets, self.infos)):
            g = (None if full is None or not info.param.requires_grad
                 else info.view(full[off : off + info.numel]))
            shown = self._shown_tp.get(i)
            if shown is not None:  # a TP parameter shown as a DTensor: a DTensor gradient
                shown.grad = None if g is None else as_tp(g, info.tp_spec)
            elif self.sharded:
                info.param.grad = g
            else:
                set_grad(info.param, g)

    def grads_as_sharded(self, full: Optional[torch.Tensor], writeback: bool) -> None:
        """Undo :meth:`grads_as_full` (call before :meth:`params_as_sharded`).

        With ``writeback``, this rank's unpadded part of ``full`` is copied
        into the existing sharded gradient (none is created, as torch)."""
        for info in self.infos:
            info.param.grad = None
        g = self.flat_param.grad
        if writeback and full is not None and g is not None and self.sharded:
            lo, hi = self.layout.shard_range(self.rank)
            hi = min(hi, self.layout.flat_numel)
            if hi > lo:
                g[: hi - lo].copy_(full[lo:hi])

    def orig_grads_as_shard_views(self) -> None:
        """use_orig_params=True: each original parameter's ``.grad`` is its
        part of the flat gradient: its slice of this rank's shard (None outside
        it), or its full-shape view with NO_SHARD; None for frozen parameters."""
        g = self.flat_param.grad
        if g is None:
            _core.attr_set(self._orig_t, "grad", None)
        elif g.dtype == self.dtype:  # one C pass (see [Note: bulk binding])
            _core.attr_set(self._orig_t, "grad", self._orig_grad_views(g))
        elif not self.sharded:  # keep_low_precision_grads: set_grad's dtype side-step
            for info, v in zip(self.infos, self._grad_views(g)):
                set_grad(info.param, v if info.param.requires_grad else None)
        else:
            for info, sl in zip(self.infos, self.layout.slices[self.rank]):
                if sl.numel == 0 or not info.param.requires_grad:
                    info.param.grad = None
                else:
                    set_grad(info.param, g[sl.shard_offset : sl.shard_offset + sl.numel])
        self._note_grads()

    def _orig_grad_views(self, g: torch.Tensor) -> tuple:
        """Each original parameter's gradient as a view of the flat gradient ``g``
        (its shard slice, or its full shape with NO_SHARD), None where it has no
        element on this rank or is frozen."""
        mask = self._rg_mask
        cached = self._grad_split
        if cached is None or cached[0] != mask:
            sizes, index, pos = [], [], 0
            if not self.sharded:
                sizes, index = list(self._split_sizes), list(self._split_index)
                shapes = self._shapes
            else:
                shapes = (None,) * len(self.infos)  # 1-D slices of the shard
                for sl in self.layout.slices[self.rank]:
                    if sl.numel == 0:
                        index.append(-1)
                        continue
                    if sl.shard_offset > pos:
                        sizes.append(sl.shard_offset - pos)
                    index.append(len(sizes))
                    sizes.append(sl.numel)
                    pos = sl.shard_offset + sl.numel
                if self.layout.shard_numel > pos:
                    sizes.append(self.layout.shard_numel - pos)
            index, shapes = views_or_none(index, shapes, mask, len(sizes))
            cached = self._grad_split = (mask, sizes, index, shapes)
        _, sizes, index, shapes = cached
        views = _core.shape_views((*torch.split(g, sizes), None), index, shapes, None,
                                  self._param_index)
        if self._strided_params and not self.sharded:
            views = self._restride(views, self._strided_params)
        return views
