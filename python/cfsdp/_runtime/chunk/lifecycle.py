"""A ``fully_shard`` unit's parameter lifecycle (torch FSDP2's unshard / reshard of an
``FSDPParamGroup``): the unsharded buffer and flat parameter, the all-gather into it (the
post-forward group's too), the registered unsharded parameters, the views forward binds
each step, and the requires_grad refresh.

The layout is [Note: chunk layout] in ``unit.py``; what the modules show is shared with the
wrapper's unit in ``views.py``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ... import _core
from ..._torch import fsdp2 as _fsdp2
from .. import comm
from ..base import UnshardStates, alloc_storage, free_storage
from ..views import changed_mask, hook_flat_grad, split_views, tp_views
from . import ext
from .ext import forward_view, gather


class ChunkLifecycle(UnshardStates):
    """Unshard and reshard of a ``ChunkUnit`` (a part of it, sharing its state) and what the
    modules hold on the way: the registered unsharded parameters while unsharded, the
    forward views during forward, the sharded parameters otherwise."""

    def _new_natural(self) -> None:
        """The unsharded buffer (storage freed) and the flat parameter over it."""
        self.natural = torch.empty(self.natural_numel, dtype=self.param_dtype, device=self.shard.device)
        free_storage(self.natural)
        self.flat_param = nn.Parameter(self.natural, requires_grad=any(q.requires_grad for q in self.params))
        self._hooked = False
        # [Note: one post-backward per iteration] in base.py: one node, the hook acts in it
        self.first_grad_node = None
        self.grad_waiting = False
        for q in self.params:
            q.unsharded = None
        self._unsharded_t = None

    def _register_unsharded(self) -> None:
        """While unsharded, the modules hold full-size parameters (views of the
        unsharded buffer), as torch's FSDP2 registers its unsharded parameters.
        They are built once per unsharded buffer and kept (with the requires_grad
        of their sharded parameters, refreshed when that changes)."""
        if self._unsharded_t is None:
            for q in self.params:
                if q.unsharded is None and q.ext is not None:
                    q.unsharded = q.ext.param  # made by its first gather (ext.py)
                if q.unsharded is None:
                    v = self.natural[q.nat_off : q.nat_off + q.numel].view(q.shape)
                    if q.tp_spec is not None:
                        v = q.tp_dtensor(v)
                    q.unsharded = nn.Parameter(v, requires_grad=q.requires_grad)
                    if _fsdp2.REDUCES_IN_GRAD_DTYPE and v.is_floating_point():
                        # torch 2.15's unsharded parameters accumulate in this dtype (the
                        # views forward uses are others: autograd never fills these)
                        q.unsharded.grad_dtype = self.reduce_dtype
                elif q.unsharded.requires_grad != q.requires_grad:
                    q.unsharded.requires_grad_(q.requires_grad)
            self._unsharded_t = tuple(q.unsharded for q in self.params)
            self._unsharded_occ = self._bind.per_occurrence(self._unsharded_t)
        self._bind.register(self._unsharded_occ)

    def _start_unshard(self):
        ctx = self._comm
        if ctx is not None and ctx.streams:
            return self._start_unshard_on_streams(ctx)
        gathered = self._post_forward_shard_gather()
        if gathered is not None:
            return gathered
        src = self.shard
        if self.uses_mp:  # the all-gather input: the shard cast in one C pass
            src = torch.empty(self.shard_numel, dtype=self.param_dtype, device=self.device)
            _core.scale_cast_add(src, self.shard, 1.0, False)
        # straight into the natural buffer: on shared memory the copy-out from the
        # peers' slots is the chunk copy-out (no rank-major buffer); nothing reads
        # ``natural`` before wait_unshard
        alloc_storage(self.natural)
        work = comm.all_gather_unpack(self.natural.data, src, self._plan, self._plan_bytes,
                                      self.group, async_op=True)
        return work, None

    def _start_unshard_on_streams(self, ctx):
        """[Note: stream protocol] in streams.py: the copy-in on the copy-in stream, the
        all-gather (``async_op=False``) inside the all-gather stream, an event after it; the
        copy-out is ``_finish_unshard``'s, on the current stream."""
        layer = ctx.layer
        copy_in, ag, in_step = ctx.all_gather_streams()
        if in_step:
            ctx.release_all_gather()
        kept, self._post_forward_shard = self._post_forward_shard, None
        event, self._post_forward_event = self._post_forward_event, None
        if event is not None:  # the kept shard was written on the current stream
            copy_in.wait_event(event)
            ag.wait_event(event)
        with layer.on(copy_in):
            src, group = self.shard, self.group
            if kept is not None:  # reshard_after_forward=k: over the post-forward group
                src, group = kept, self.post_forward_group
            elif self.uses_mp:
                src = torch.empty(self.shard_numel, dtype=self.param_dtype, device=self.device)
                _core.scale_cast_add(src, self.shard, 1.0, False)
            gathered = torch.empty(self.world_size * self.shard_numel, dtype=self.param_dtype,
                                   device=self.device)
            # extension parameters' inputs too ([Note: all-gather extensions] in ext.py)
            pres = (ext.pre_all_gather(self._ext_params, self.mesh, self.mp_policy)
                    if self._ext_params else None)
        ag.wait_stream(copy_in)
        staged: tuple = ()
        with layer.on(ag):
            comm.all_gather(gathered, src, group, async_op=False)
            if pres is not None:
                staged = tuple(ext.all_gather_staged(pres, group))
            event = ag.record_event()
        temps = ((gathered,) if src is self.shard else (gathered, src)) + staged
        if pres is not None:  # their inputs (made on copy-in, possibly the shard itself) are
            for inputs, _ in pres:  # read on the all-gather stream: the allocator is told
                for t in inputs:
                    layer.record_stream(t, ag)
            pres = (pres, staged)
        return comm.Pending(None), (temps, event, in_step, pres)

    def _copy_out_on_streams(self, temps: tuple, event, in_step: bool,
                             pres: Optional[list]) -> None:
        ctx = self._comm
        ctx.wait_unshard_event(event)
        alloc_storage(self.natural)
        self.launches().unpack(self.natural.data, temps[0])  # one split_with_sizes_copy
        if pres is not None:  # ([Note: all-gather extensions] in ext.py)
            pres, staged = pres
            ext.copy_out(self._ext_params, pres, staged, self.world_size)
            ext.post_all_gather(self._ext_params, pres, self.param_dtype)
        if in_step:  # held until the next unshard's streams waited (torch's all_gather_state)
            ctx.hold_all_gather(temps, ctx.layer.current_stream().record_event())
        else:
            for t in temps:
                ctx.layer.free(t)

    def reshard_after_forward(self, for_backward: bool) -> None:
        """Post-forward reshard.  With a post-forward group (``reshard_after_forward``
        an int k: groups of k consecutive ranks), keep this rank's 1/k of the gathered
        buffer (the rank-major shards of the W/k ranks at its position in the group)
        so backward all-gathers over the k ranks only; else free everything."""
        if self.post_forward_group is None or not for_backward or self._buf is None:
            self.reshard()
            return
        if self._ext_params:  # torch's all_gather_inputs raises NotImplementedError too
            raise NotImplementedError(
                f"fully_shard: parameter '{self._ext_params[0].fqn}' uses the all-gather "
                "extensions, which reshard_after_forward as an int (a post-forward mesh) does "
                "not support (torch's FSDP2 neither). Pass reshard_after_forward=True or False."
            )
        k = self.post_forward_group.size()
        per = self.world_size // k
        j = self.post_forward_group.rank()
        kept = torch.empty(per * self.shard_numel, dtype=self.param_dtype, device=self.device)
        _core.chunk_pack(kept, self.natural.detach(), self._plan, self.world_size, self.shard_numel,
                         ranks=(j * per, (j + 1) * per))
        self.reshard()
        self._post_forward_shard = kept
        ctx = self._comm
        if ctx is not None and ctx.streams:  # written on the current stream, read by the
            # all-gather streams at the next unshard (torch's _reshard_after_forward_event)
            self._post_forward_event = ctx.layer.current_stream().record_event()

    def _post_forward_shard_gather(self):
        """With a post-forward shard kept, the all-gather over the post-forward group
        (``(work, gathered)``, copied out by ``_finish_unshard``); else None."""
        kept = self._post_forward_shard
        if kept is None:
            return None
        self._post_forward_shard = None
        out = torch.empty(self.world_size * self.shard_numel, dtype=self.param_dtype, device=self.device)
        return comm.all_gather(out, kept, self.post_forward_group, async_op=True), out

    def _finish_unshard(self, gathered) -> None:
        if type(gathered) is tuple:  # the stream protocol's all-gather
            self._copy_out_on_streams(*gathered)
        elif gathered is not None:  # gathered over the post-forward group: copy it out
            alloc_storage(self.natural)
            # through ``.data``: refilling the buffer must not bump the version counter
            # of the views autograd saved in forward (they see the same values again)
            _core.chunk_unpack(self.natural.data, gathered, self._plan, self.world_size,
                               self.shard_numel)
        self._buf = self.natural
        self.ever_unsharded = True  # [Note: unused parameters] in grads.py
        if self._ext_params and type(gathered) is not tuple:  # [Note: all-gather extensions]
            gather(self._ext_params, self.group, self.mesh, self.mp_policy, self.param_dtype)
        self._register_unsharded()

    def reshard(self) -> None:
        self._post_forward_shard = self._post_forward_event = None
        self.wait_unshard()
        if self._buf is None:
            return
        free_storage(self.natural)
        for q in self._ext_params:
            q.ext.free()
        self._buf = None
        self._bind.unshow()
        self._follow_unsharded_grads()  # what the user did to them while shown counts
        self._drop_shown_unsharded_grads()
        self._bind.register(self._sharded_occ)

    def record_grad_node(self) -> None:
        """Nothing: ``flat_param`` keeps its dtype, so every forward of an iteration uses
        one ``AccumulateGrad`` node, the hook's ([Note: one post-backward per iteration]
        in base.py), as torch FSDP2's unsharded parameters."""

    def use_forward_views(self) -> None:
        """Bind each parameter name to its view of ``flat_param`` (through autograd;
        frozen parameters get detached views), made in one C pass (see
        [Note: forward views] in views.py)."""
        if self._rg_mask is None:  # parameters replaced since the last forward
            self.refresh_requires_grad()
        parts, views = split_views(self.flat_param, self._split_sizes, self._param_index,
                                   self._shapes, self._rg_mask, self._bind.index)
        node = parts[0].grad_fn if parts else None
        if node is not None:  # which parameters get a gradient: [Note: unused parameters]
            node.register_prehook(self._note_grads_hook)
        if self._tp_occ:  # [Note: tensor-parallel parameters]
            views = tp_views(views, self._tp_occ)
        if self._ext_params:  # the unsharded parameters, their gradients routed (ext.py)
            views = tuple(v if self.params[qi].ext is None else forward_view(v, self.params[qi].ext)
                          for v, qi in zip(views, self._bind.index))
        self._bind.show(views)

    def end_forward_views(self) -> None:
        """A unit left unsharded after backward: unbind the forward views, so attribute
        access shows the registered unsharded parameters (and their gradients) until the
        next forward, as torch's FSDP2 shows them."""
        if self._buf is not None:
            self._bind.unshow()

    def refresh_requires_grad(self) -> None:
        """Follow the sharded parameters' requires_grad (the user may freeze or
        unfreeze them between steps): one C read per step, the per-parameter
        work only when it changed."""
        mask = changed_mask(self._sharded_t, self._rg_mask)
        if mask is None:
            return
        self._rg_mask = mask
        for q, rg in zip(self.params, mask):
            q.requires_grad = bool(rg)
        self._unsharded_t = None  # their requires_grad follows on the next unshard
        self._pub = None
        self.refresh_requires_grad_flat()
        if self._buf is not None:
            self._register_unsharded()

    def refresh_requires_grad_flat(self) -> None:
        rg = any(q.requires_grad for q in self.params)
        self.flat_param.requires_grad_(rg)
        hook_flat_grad(self, rg)


__all__ = ["ChunkLifecycle"]
