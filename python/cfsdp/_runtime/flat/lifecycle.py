"""What a wrapper unit's modules show through a step and the unsharded buffer behind it:
the parameters' lifecycle (torch FSDP1's ``_use_unsharded_views`` / ``_use_sharded_views``,
FSDP2's ``FSDPParam``), a part of ``unit.Unit``.

* Between steps, with ``use_orig_params=False``, the modules hold plain views with full
  shapes of the (freed) forward buffer and the wrapped module registers the flat parameter;
  with ``use_orig_params=True`` they hold the registered original parameters, whose data are
  views of the shard ([Note: unit buffers] in layout.py).
* ``unshard`` / ``reshard``: the all-gather into the unsharded buffer (the shard cast to
  ``param_dtype`` first under mixed precision; with NO_SHARD the shard itself, or its
  low-precision copy), through ``base.UnshardStates``'s state machine; writes to the original
  parameters are carried over first ([Note: writeback of original parameters] in
  writeback.py).
* Forward binds each parameter name to its view of the flat parameter, made afresh every step
  ([Note: forward views] in views.py; registered too with ``use_orig_params=True``): a strided
  parameter's with its stride ([Note: strided parameters]), a TP parameter's as a DTensor
  ([Note: tensor-parallel wrapper units] in unit.py).  A unit that stays unsharded after
  forward or a no_sync() backward shows what torch's does: [Note: kept unsharded units].
* summon_full_params and state dicts: the full parameters shown as ``nn.Parameter`` s
  (``params_as_full`` / ``params_as_sharded``), and a full-precision copy of the flat buffer
  (``gather_full_copy``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..._fqn import FLAT_PARAM
from .. import comm, device
from ..base import UnshardStates, alloc_storage, free_storage, new_grad_node
from ..reduce import scale_cast_add
from ..replaced import WRAPPER, mark_replaced
from ..views import as_tp, changed_mask, hook_flat_grad, split_views, tp_views

# [Note: kept unsharded units]
# A wrapper unit stays unsharded (its all-gathered buffer kept, or NO_SHARD's parameters)
# after a training forward when it is the root or does not reshard after forward
# (SHARD_GRAD_OP, _HYBRID_SHARD_ZERO2, NO_SHARD), and after a no_sync() backward with those
# strategies.  As torch FSDP1 (``_reshard`` without freeing, then ``_use_sharded_views``),
# the modules then show the registered original parameters again (``end_forward_views``):
# their data the shard's views (full shapes with NO_SHARD), their gradients no_sync's
# unsharded gradient as full-shape views.  Only SHARD_GRAD_OP / _HYBRID_SHARD_ZERO2 keep the
# forward's views until backward (torch's "skipped sharded views").  During forward the
# views are registered too (``module._parameters``), as torch's: ``module.parameters()``
# inside forward gives them, and gradients flow through them.  A write to a kept unit's
# parameters is carried into the shard at its next unshard, as any other; the buffer it
# holds is not gathered again, so the rest of the accumulation computes with the values it
# holds, and the write shows from the next all-gather (after the synchronising backward), as
# torch's.  Showing it earlier would take a collective on every forward: ranks cannot know
# whether another rank wrote.  A state dict taken meanwhile copies the kept buffer (torch's
# values) and keeps it; summon_full_params frees it on exit, so the next forward gathers
# again (torch keeps it, with whatever summon's writeback=False left in it).


class FlatLifecycle(UnshardStates):
    """Unshard / reshard (``base.UnshardStates``'s two steps), the forward views, the idle
    views, summon's and the state dicts' full parameters.  A part of ``unit.Unit``."""

    def _make_idle_views(self) -> list:
        """What a sharded unit's modules hold with use_orig_params=False: views with full
        shapes of the forward buffer, whose storage is freed until the first unshard (as
        torch leaves its module attributes); with NO_SHARD, views of the shard."""
        if self.sharded or self.uses_mp:
            alloc_storage(self.unsharded)
            views = self._views_of(self.unsharded)
            free_storage(self.unsharded)
        else:
            views = self._views_of(self.shard)
        self._idle_views = self._as_seen(views)
        return self._idle_views

    def _install_initial_views(self) -> None:
        views = self._make_idle_views()
        if self.use_orig_params:
            for info, v in zip(self.infos, self.shard_views()):
                info.param.data = v
                info.param._cfsdp_flattened = True  # type: ignore[attr-defined]
                info.param._cfsdp_unit = self.flat_param._cfsdp_unit  # type: ignore[attr-defined]
        else:
            for info, v in zip(self.infos, views):
                del info.module._parameters[info.name]
                info.module.__dict__[info.name] = v
                # The original parameter is no longer trained: free it, and
                # mark it so an optimizer built before wrapping is caught.
                info.param.data = torch.empty(0, dtype=self.dtype, device=self.device)
                mark_replaced(info.param, info.fqn, WRAPPER, info.module, info.name)
            for s in self.shared:
                del s.module._parameters[s.name]
                s.module.__dict__[s.name] = views[s.primary]
                mark_replaced(s.param, s.fqn, WRAPPER, s.module, s.name)
            self.module._parameters[FLAT_PARAM] = self.flat_param
        if self.use_orig_params:
            for s in self.shared:
                s.param._cfsdp_flattened = True  # type: ignore[attr-defined]
            self._note_data()

    # ------------------------------------------------------- unshard/reshard
    def unshard(self, async_op: bool = False, full_precision: bool = False) -> None:
        """Make the full parameters available: issue the all-gather (sharded)
        or the low-precision copy (NO_SHARD with mixed precision).  A no-op if
        already unsharded or in flight; ``full_precision`` is for summon.  Writes to the
        original parameters are carried over first ([Note: writeback of original
        parameters]), as torch's ``pre_unshard``."""
        self.writeback_orig_params()
        super().unshard(async_op, full_precision=full_precision)
        ctx = self._comm
        if not async_op and ctx is not None and ctx.in_step():
            ctx.wait_unshard()  # [Note: FSDP1 streams] in streams.py: the consumer waits

    def _start_unshard(self, full_precision: bool = False):
        ctx = self._comm
        if ctx is not None and not full_precision and ctx.in_step():
            return self._start_unshard_on_streams(ctx)
        low = self.uses_mp and not full_precision
        if not self.sharded:
            if low:
                alloc_storage(self.unsharded)
                scale_cast_add(self.unsharded, self.shard, 1.0, False)
                self._use_buf(self.unsharded)
            else:
                self._use_buf(self.shard)
            return None
        target = self.unsharded if (low or not self.uses_mp) else self.unsharded_full
        alloc_storage(target)
        src = self.shard
        if low:  # the all-gather input: the shard cast in one C pass
            src = torch.empty(self.layout.shard_numel, dtype=self.param_dtype, device=self.device)
            scale_cast_add(src, self.shard, 1.0, False)
        return comm.all_gather(target, src, self.group, async_op=True), target

    def _start_unshard_on_streams(self, ctx) -> None:
        """[Note: FSDP1 streams] in streams.py: the low-precision shard on the pre-unshard
        stream, the all-gather (``async_op=False``) inside the unshard stream; done when it
        returns, as far as the CPU is concerned."""
        layer = ctx.layer
        unshard = ctx.stream(device.UNSHARD)
        src = self.shard
        if self.uses_mp:  # torch's pre_unshard: the low-precision shard
            pre = ctx.stream(device.PRE_UNSHARD)
            with layer.on(pre):
                if self.sharded:
                    src = torch.empty(self.layout.shard_numel, dtype=self.param_dtype,
                                      device=self.device)
                else:  # NO_SHARD: the low-precision copy is what the modules use
                    src = self.unsharded
                    alloc_storage(src)
                scale_cast_add(src, self.shard, 1.0, False)
            unshard.wait_stream(pre)
        ctx.rate_limit()
        if not self.sharded:
            with layer.on(unshard):
                self._use_buf(src)
            return None
        with layer.on(unshard):
            alloc_storage(self.unsharded)
            comm.all_gather(self.unsharded, src, self.group, async_op=False)
            if src is not self.shard:  # torch's _free_low_precision_sharded_param
                layer.record_stream(src, unshard)
                layer.free(src)
            self._use_buf(self.unsharded)
        return None

    def _finish_unshard(self, buf: torch.Tensor) -> None:
        self._use_buf(buf)

    def _use_buf(self, buf: torch.Tensor) -> None:
        self._buf = buf
        self.flat_param.data = buf[: self.layout.flat_numel]

    def reshard(self) -> None:
        """Free the unsharded buffer and point every parameter back at the shard."""
        self.wait_unshard()
        if not self.sharded and not self.uses_mp:
            # NO_SHARD: the parameters stay where they are, but the modules show the
            # registered original parameters again, not the forward's views (as torch)
            self._unbind_views()
            return
        if self._buf is None:
            return
        self.flat_param.data = self.shard
        if self._buf is not self.shard:
            ctx = self._comm
            if ctx is not None and ctx.streams:  # [Note: FSDP1 streams] in streams.py
                ctx.before_free(self._buf)
                free_storage(self._buf)
                if self.sharded:
                    ctx.after_free()
            else:
                free_storage(self._buf)
        self._buf = None
        self._unbind_views()

    def reshard_after_forward(self, for_backward: bool) -> None:
        """Post-forward reshard (the wrapper face frees everything); no_sync's unsharded
        gradient shows again (:meth:`_show_unsharded_grad`)."""
        self.reshard()
        self._show_unsharded_grad()

    # ------------------------------------------------------------- forward
    def before_forward(self) -> None:
        """Per-step bookkeeping of the original parameters (use_orig_params)."""
        if self.use_orig_params:
            self.refresh_requires_grad()
            self.drop_grad_if_orig_grads_cleared()

    def refresh_requires_grad(self) -> None:
        """With use_orig_params=True the flat parameter requires grad while any
        original parameter does (they may be frozen after wrapping, as torch)."""
        if self.use_orig_params:
            mask = changed_mask(self._orig_t, self._rg_mask)
            if mask is not None:
                self._rg_mask = mask
                self.requires_grad = any(mask)
                self.flat_param.requires_grad_(self.requires_grad)
        hook_flat_grad(self, self.requires_grad)

    def use_forward_views(self) -> None:
        """Bind each original parameter name to its view of ``flat_param``
        (through autograd, so gradients flow into the flat gradient), built once
        each step in one C pass: [Note: forward views].  Frozen parameters (use_orig_params=True)
        get detached views: no gradient is computed for them, so their part of the
        flat gradient stays zero."""
        _, views = split_views(self.flat_param, self._split_sizes, self._split_index, self._shapes,
                               self._rg_mask if self.use_orig_params else None, self._occ_index)
        if self._strided_occ:
            views = self._restride(views, self._strided_occ)
        if self._tp_occ:  # [Note: tensor-parallel wrapper units]
            views = tp_views(views, self._tp_occ)
        self._bind.show(views)
        if self.use_orig_params:  # registered too, as torch's: [Note: kept unsharded units]
            self._bind.register(views)
            self._views_bound = True

    def record_grad_node(self) -> None:
        """A grad-enabled forward, after its unshard and before its views: the first since
        the last backward records the flat parameter's ``AccumulateGrad`` node, the one
        node the gradient-ready hook acts in ([Note: one post-backward per iteration] in
        base.py; torch's ``_register_post_backward_hook``).  Under mixed precision each
        later forward gets a node of its own, as torch's: its post-forward swaps ``.data``
        to the full-precision shard and its unshard back, every strategy, the root
        included (the accumulation order of several calls' gradients onto an earlier
        one, no_sync()'s, follows the nodes)."""
        p = self.flat_param
        if not p.requires_grad:
            return
        if self.first_grad_node is None:
            self.first_grad_node = p.expand_as(p).grad_fn.next_functions[0][0]
        elif self.uses_mp:
            new_grad_node(p, self.dtype)

    def end_forward_views(self) -> None:
        """A unit that stays unsharded after forward or backward: the modules show the
        registered original parameters again, their data views of the shard, and no_sync's
        unsharded gradient on each (torch's ``_use_unsharded_grad_views``); the unsharded
        buffer stays as it is ([Note: kept unsharded units]).  With use_orig_params=False
        the views stay, as torch's."""
        self._unbind_views()
        self._show_unsharded_grad()

    def _unbind_views(self) -> None:
        """Unbind the forward's views (use_orig_params=True): the registered parameters show."""
        if self._views_bound:
            self._bind.unshow()
            self._bind.register(self._occ_params)
            self._views_bound = False

    def _show_unsharded_grad(self) -> None:
        """After a forward, a sharded unit holding no_sync's unsharded gradient shows it on
        every original parameter again, those the writeback showed as None included, as
        torch's post-forward reshard does."""
        if self._grads_hidden and self.sharded and self.grad_unsharded:
            self.show_unsharded_grad()

    # ------------------------------------------------- summon / state dicts
    def params_as_full(self, buf: Optional[torch.Tensor] = None) -> None:
        """Expose full parameters as ``nn.Parameter`` s (unsharded first, in
        full precision).

        ``buf`` (summon's ``offload_to_cpu`` on a non-CPU device): a copy of
        the unsharded buffer the parameters view instead; the caller copies it
        back before :meth:`params_as_sharded`."""
        views = self._full_views(buf)
        if self.use_orig_params:
            self._unbind_views()
            self._shown_full = True
            for i, (info, v) in enumerate(zip(self.infos, views)):
                info.module.__dict__.pop(info.name, None)
                if info.tp_spec is None:
                    info.param.data = v
                    continue
                # a TP parameter shows as a DTensor over its full view; its gradient
                # (with_grads) goes on that parameter too
                dt = nn.Parameter(as_tp(v, info.tp_spec), requires_grad=info.param.requires_grad)
                self._shown_tp[i] = dt
                info.module._parameters[info.name] = dt
            for s in self.shared:
                s.module.__dict__.pop(s.name, None)
                if s.primary in self._shown_tp:
                    s.module._parameters[s.name] = self._shown_tp[s.primary]
        else:
            del self.module._parameters[FLAT_PARAM]
            params = []
            for info, v in zip(self.infos, self._as_seen(views)):
                p = nn.Parameter(v, requires_grad=info.param.requires_grad)
                params.append(p)
                info.module.__dict__.pop(info.name, None)
                info.module._parameters[info.name] = p
            for s in self.shared:
                s.module.__dict__.pop(s.name, None)
                s.module._parameters[s.name] = params[s.primary]

    def params_as_sharded(self, writeback: bool) -> None:
        """Undo :meth:`params_as_full`; copy full values back to the shard if asked
        (the unit may be sharded when :meth:`params_as_full` showed a copy)."""
        views = self._as_seen(self._full_views()) if self._buf is not None else self._idle_views
        writeback = writeback and self._buf is not None
        if writeback and self._buf is not self.shard:
            lo, hi = self.layout.shard_range(self.rank)
            self.shard.copy_(self._buf[lo:hi])
        if self.use_orig_params:
            for info, v in zip(self.infos, self.shard_views()):
                info.param.data = v
            if self._shown_tp:
                for info in [*self.infos, *self.shared]:
                    info.module._parameters[info.name] = info.param
                self._shown_tp = {}
            self._note_data()
            self._shown_full = False
        else:
            for info, v in zip(self.infos, views):
                del info.module._parameters[info.name]
                info.module.__dict__[info.name] = v
            for s in self.shared:
                del s.module._parameters[s.name]
                s.module.__dict__[s.name] = views[s.primary]
            self.module._parameters[FLAT_PARAM] = self.flat_param

    def gather_full_copy(self, scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A full-precision unsharded flat buffer (with padding), all-gathered from
        the shards into a new tensor (or into the front of ``scratch``, a 1-D buffer
        of this dtype and device that is large enough); the unit itself stays as it
        is.  A FULL state dict keeps it: its entries are views of it, so a unit
        costs one copy, not two.  Collective over the unit's group, unless the unit is kept
        unsharded in full precision: then a copy of that buffer, as torch's state dicts
        reuse it ([Note: kept unsharded units]).  Writes to the original parameters are
        carried over first, as torch's state dicts unshard ([Note: writeback of original
        parameters])."""
        self.writeback_orig_params()
        n = self.layout.padded_numel if self.sharded else self.layout.flat_numel
        out = torch.empty(n, dtype=self.dtype, device=self.device) if scratch is None else scratch[:n]
        if not self.sharded:
            out.copy_(self.shard.detach())
        elif self.holds_full_precision and self._unshard_work is None and self._buf is not self.shard:
            out.copy_(self._buf.detach())  # kept unsharded: the values it computes with
        else:
            comm.all_gather(out, self.shard.detach(), self.group, async_op=False)
        return out
