"""A ``fully_shard`` unit's gradients (torch FSDP2's ``foreach_reduce`` and the gradient
side of ``FSDPParamGroup``): the divide factors and reduce ops (``gradient_divide``), the
reduce-scatter of a backward's flat gradient, no-sync accumulation, the partial sums of
tensor-parallel parameters, and who owns a published gradient ([Note: gradient ownership],
[Note: unused parameters], [Note: no-sync accumulation]).
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ... import _core
from ..._torch import fsdp2 as _fsdp2
from ..._torch.dtensor import DTensorSpec, redistribute_local_tensor
from .. import comm, device
from ..base import (FinishedReduce, PendingReduce, accumulate_sharded, all_none, issue_reduction,
                    views_or_none)
from ..reduce import divide_factors
from .launch import Launches


def gradient_divide(
    dp_size: int, shard_size: int, reduce_dtype: torch.dtype, factor: Optional[float], force_sum: bool
) -> tuple[float, float, object, object]:
    """``(pre, post, reduce_scatter_op, all_reduce_op)`` by torch 2.13 FSDP2's rules:
    fp32/bf16 average in the collective itself (``AVG``); fp16/fp64 (overflow risk)
    and ``force_sum`` sum and divide around it, fp16/fp64 by about ``sqrt(W)`` on
    each side.  A custom ``factor`` is a premultiplied sum (gloo has no
    ``PREMUL_SUM``: cfsdp divides in the pack pass)."""
    SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    if not overflow_risk and not force_sum:
        if factor is None:
            if dp_size == 1:
                return 1.0, 1.0, SUM, SUM
            return 1.0, 1.0, AVG, AVG
        if factor == shard_size:
            return 1.0, 1.0, AVG, SUM
        return float(factor), 1.0, SUM, SUM
    f = float(dp_size) if factor is None else float(factor)
    if overflow_risk:  # torch FSDP1's split into a pre- and a post-divide factor
        pre, post = divide_factors(f)
        return pre, post, SUM, SUM
    return 1.0, f, SUM, SUM


class ChunkGrads:
    """The gradient path of a ``ChunkUnit`` (a part of it, sharing its state): from the
    flat gradient autograd hands the unit to the sharded DTensor gradients the parameters
    show."""

    def update_divide_factors(self) -> None:
        dp = self.world_size * (self.replicate_group.size() if self.replicate_group is not None else 1)
        self.pre_divide, self.post_divide, self.reduce_op, self.replicate_op = gradient_divide(
            dp, self.world_size, self.reduce_dtype, self.gradient_divide_factor, self.force_sum_reduction
        )

    # [Note: gradient ownership]
    # Publishing a gradient means one DTensor per parameter, viewing this rank's rows
    # of the unit's sharded gradient buffer.  Who owns that memory is decided by one
    # explicit rule, torch's FSDP2 rule, and never by counting references:
    #
    # * While the parameters still hold exactly the DTensors the unit published (an
    #   identity check, ``take_grad_for_backward``), the user left them in place
    #   (``zero_grad(set_to_none=False)``, gradient accumulation): the next reduction
    #   adds to that buffer, as torch adds to ``param.grad``.
    # * Once the parameters hold anything else (``zero_grad()`` set them to None, or
    #   the user assigned other gradients), the published gradients are the user's:
    #   the unit forgets them (``before_forward``) and never writes to them again; the
    #   next reduction gets a new buffer.  Gradients the user assigned are copied into
    #   it first, so they accumulate as torch's would.
    #
    # So a gradient a user kept (``g = p.grad``) stays intact whatever they do, and the
    # memory of dropped gradients is freed by Python as soon as nobody holds them.

    # [Note: unused parameters]
    # Every forward binds the parameters to views of one ``torch.split`` of the flat
    # parameter, so backward produces one flat gradient with zeros where a parameter took
    # no part in the forward.  torch's FSDP2 leaves such a parameter out of its
    # reduce-scatter, so its sharded ``.grad`` stays as it was: None after
    # ``zero_grad()`` (optimizers then skip it: no weight decay, no step), the tensor it
    # held otherwise (zeros after ``zero_grad(set_to_none=False)``, or the gradient of an
    # earlier backward), which the optimizer steps.  The split node's pre-hook sees a None
    # gradient for each view that received none (``note_grads``; one check per backward
    # when every view got one).  At publish, a trainable parameter that got no gradient on
    # this rank and held none before this backward (``_had_grad``, taken with the
    # gradients the reduction adds to) keeps ``.grad`` None if its reduced rows here are
    # all zero, i.e. no rank's gradient reached them; otherwise (it held one: the zeros
    # added left it as it was; or another rank used it) its gradient is published, so no
    # gradient value is ever dropped.  The reduce-scatter itself is unchanged (the zeros
    # take part, as torch's padding does).  A frozen parameter (``requires_grad`` False)
    # keeps whatever ``.grad`` it holds, as torch's FSDP2 never touches it: a gradient it
    # got before it was frozen stays (zeroed in place by ``zero_grad(set_to_none=False)``),
    # and optimizers step it, as torch's.
    #
    # ``set_reduce_scatter_unused_params(True)`` (torch 2.13+) makes torch reduce zeros
    # for every trainable parameter without a gradient, in every unit whose parameters
    # were ever unsharded (``hasattr(fsdp_param, "_unsharded_param")``), also a unit a
    # synchronising backward did not reach (its final callback's ``post_backward``): every
    # such parameter's ``.grad`` is then a tensor, zeros where no rank used it.  The unit
    # publishes every trainable parameter then, and ``reduce_unreached`` reduces a zero
    # gradient for a unit that got none (``reduces_unused``).

    def note_grads(self, grad_outputs: tuple) -> None:
        """The split node's pre-hook: record which parameters' views got a gradient, over
        every backward (and every forward's split node) since the last publish: once a node
        gave every view one (``_got_all``), nothing more to record."""
        if self._got_all:
            return
        if not any(g is None for g in grad_outputs):
            self._got_all = True
            return
        self._got_some = True
        for i, g in enumerate(grad_outputs):
            if g is not None:
                self._got_grad[i] = 1

    def _got_every_grad(self) -> bool:
        """Whether every parameter got a gradient since the last publish, as far as the
        unit knows (nothing recorded: the unit publishes every trainable parameter)."""
        return self._got_all or not self._got_some

    def _forget_got_grads(self) -> None:
        self._got_all = False
        self._got_some = False
        if any(self._got_grad):  # recorded by note_grads or a followed user .grad
            self._got_grad[:] = bytes(len(self.params))

    def _unused(self, grad: torch.Tensor) -> list[int]:
        """Indices of trainable parameters that got no gradient on this rank since the
        last publish, held none before (``_had_grad``) and whose reduced rows here are
        all zero (no rank's gradient reached them): their ``.grad`` stays None, as
        torch's FSDP2 leaves it.  None with ``reduce_scatter_unused_params`` (torch
        reduced zeros for them)."""
        had, self._had_grad = self._had_grad, None
        if self._got_every_grad() or self.reduce_scatter_unused_params:
            self._forget_got_grads()
            return []
        out = [i for i, q in enumerate(self.params)
               if q.requires_grad and not self._got_grad[i] and (had is None or had[i] is None)
               and not bool(q.local_view(grad).any())]
        self._forget_got_grads()
        return out

    def reduces_unused(self) -> bool:
        """Whether a synchronising backward that gave this unit no gradient reduces zeros
        for it (torch's ``reduce_scatter_unused_params``, for a unit unsharded before and
        holding a trainable parameter: [Note: unused parameters])."""
        return (self.reduce_scatter_unused_params and self.ever_unsharded
                and any(q.requires_grad for q in self.params))

    def _forget_dropped_grads(self) -> None:
        """The parameters no longer hold the published gradients: they are the user's
        now ([Note: gradient ownership])."""
        pub = self._pub
        if pub is not None and self.saved_grad is not pub.buf and not all(
                map(operator.is_, _core.attr_get(self._sharded_t, "grad"), pub.shown)):
            self._pub = None

    def new_grad_buffer(self) -> torch.Tensor:
        """A new shard-sized buffer of the parameters' dtype for a new sharded gradient."""
        return torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)

    def take_grad_for_backward(self) -> None:
        """Before backward: collect the sharded gradients the user's parameters hold
        (they may have been cleared or replaced since they were published) into one
        shard-sized buffer that the reduced gradient is added to."""
        self._follow_unsharded_grads()
        if self.saved_grad is not None:
            return
        self._had_grad = None
        grads = _core.attr_get(self._sharded_t, "grad")
        pub = self._pub
        if pub is not None and all(map(operator.is_, grads, pub.shown)):
            if not all_none(grads):
                self.saved_grad = pub.buf  # the gradients as published: add to them
                self._had_grad = grads  # [Note: unused parameters]
            return
        self._pub = None  # dropped or replaced: the user's ([Note: gradient ownership])
        if all_none(grads):
            return
        self._had_grad = grads
        # gradients the user assigned: copied into a new buffer the reduction adds to
        buf = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for g, q in zip(grads, self.params):
                if g is not None and q.local_numel:
                    q.local_view(buf).copy_(g.to_local())
        self.saved_grad = buf

    def accumulate_reduced(self, out: torch.Tensor, divided: bool) -> None:
        accumulate_sharded(self, out, divided, self._expander(out))

    # [Note: trainable layout]
    # torch's FSDP2 reduce-scatters the gradients of the parameters that require one only
    # (``foreach_reduce`` over ``fsdp_params_with_grad``: a frozen parameter never has a
    # gradient, nor gets zeros from ``reduce_scatter_unused_params``), each rank's chunks back
    # to back.  The collective's summation order depends on that layout (gloo sums an
    # element in another order when the elements before it change, from 3 ranks on), so a
    # unit holding frozen parameters reduce-scatters its trainable ones only, in torch's
    # layout (``_reduce_layout``: the plan over them, its shard size, the spans to copy
    # back, made once per requires_grad mask), and the result is copied into a shard-sized
    # tensor (zeros for the frozen ones) after the HSDP all-reduce and the all-reduce hook
    # (``_expander``), which see torch's layout too.  A trainable parameter that got no
    # gradient stays in (zeros: [Note: unused parameters]), so every rank reduces the same
    # layout whatever its control flow; torch leaves such a parameter out unless
    # ``reduce_scatter_unused_params``, so without that flag the other parameters' gradients
    # may differ from torch's in the last bit from 3 ranks on (README).

    def _reduce_layout(self) -> Optional["_TrainableLayout"]:
        """The trainable parameters' reduce-scatter layout ([Note: trainable layout]); None
        when every parameter is trainable (the unit's own plan) or none is."""
        mask = self._rg_mask
        if mask is None or all(mask) or not any(mask):
            return None
        lay = self._sub_layout
        if lay is None or lay.mask != mask:
            lay = self._sub_layout = _TrainableLayout(self.params, mask, self.world_size)
        return lay

    def _expander(self, out: torch.Tensor):
        """For a reduced shard of the trainable layout: the function that copies it into a
        shard-sized tensor ([Note: trainable layout]); None for the unit's own layout."""
        if out.numel() == self.shard_numel:
            return None
        lay = self._sub_layout
        if lay is None or lay.numel != out.numel():
            raise AssertionError(
                f"cfsdp: a reduced shard of {out.numel()} elements, expected {self.shard_numel} "
                "or the trainable layout's")
        spans = lay.spans

        def expand(part: torch.Tensor) -> torch.Tensor:
            full = torch.zeros(self.shard_numel, dtype=part.dtype, device=part.device)
            for dst, src, n in spans:
                full[dst : dst + n].copy_(part[src : src + n])
            return full

        return expand

    # [Note: no-sync accumulation]
    # With gradient sync off, torch's FSDP2 keeps a backward's unsharded gradient where
    # autograd accumulates the next one (``unsharded_param.grad``, in the gradient's dtype),
    # unless ``reduce_dtype`` (after its clamping, see ``_set_dtypes``) differs from that
    # dtype: then post-backward moves it off the parameter, cast to ``reduce_dtype``
    # (``unsharded_accumulated_grad``: fp32 from bf16, but bf16 from fp32 with only
    # ``reduce_dtype=bf16``), and adds every later backward's gradient to it in place
    # (``acc += grad``, computed in the wider dtype and rounded to ``acc``'s); the
    # synchronising backward adds its own the same way, then reduces the sum.  The unit
    # does exactly that on its flat gradient (elementwise the same ops): ``acc_grad``.
    # So a bf16 gradient accumulated with fp32 reduction is summed in fp32, not in bf16.
    # A synchronising backward that does not reach the unit still reduces what it
    # accumulated, at the end of that backward (``reduce_unreached``), as torch's final
    # callback runs ``post_backward`` for every group it did not reach.
    #
    # torch 2.15 accumulates on the unsharded parameter itself, in its ``grad_dtype``
    # (``reduce_dtype``, else the parameter's own dtype): autograd casts each backward's
    # gradient to that dtype, then adds.  For a wider accumulation dtype (fp32 from bf16) that
    # is the same sum; for a narrower one (``reduce_dtype=bf16`` on fp32 parameters) each
    # gradient is rounded to bf16 before it is added: ``_accumulate``.
    #
    # What torch keeps on a unit's unsharded parameters' ``.grad`` is the gradient the next
    # backward's autograd adds to, in place, and what the user does to it counts (a unit left
    # unsharded shows them: ``publish_unsharded_grad``, followed by ``_follow_unsharded_grads``).
    # Its home here is ``_unsharded_grad_buffer``: ``flat_param.grad`` (compute dtype), or on
    # 2.15, where ``reduce_dtype`` differs from the compute dtype, ``acc_grad`` (their
    # ``grad_dtype``).  2.11-2.14 keep ``acc_grad`` off the parameters, so a ``.grad`` the user
    # assigns there sits in ``flat_param.grad`` beside ``acc_grad``, as in torch
    # (``unsharded_param.grad`` beside ``unsharded_accumulated_grad``): the next backward adds
    # its gradient to it in the compute dtype, and post-backward adds the sum to ``acc_grad``
    # (``accumulate_unsharded_grad_if_needed``; ``keep_unsharded_grad`` / ``reduce_grad``).  A
    # backward that does not reach the unit does the same at its end (torch's final callback
    # runs that post-backward): ``_join_unsharded_grad``.

    def _accumulate(self, acc: torch.Tensor, grad: torch.Tensor) -> None:
        if _fsdp2.REDUCES_IN_GRAD_DTYPE and grad.dtype != acc.dtype:
            grad = grad.to(acc.dtype)
        acc += grad

    def keep_unsharded_grad(self, grad: torch.Tensor) -> None:
        """No gradient sync: accumulate the natural gradient, unreduced, in torch's dtype
        ([Note: no-sync accumulation])."""
        acc = self.acc_grad
        if acc is not None:
            self._accumulate(acc, grad)
            return
        if grad.dtype != self.reduce_dtype:
            self.acc_grad = grad.to(self.reduce_dtype)
            return
        self.flat_param.grad = grad
        self.grad_unsharded = True

    def reduce_unreached(self, pending: list) -> None:
        """End of a synchronising backward that did not reach this unit (it was not
        called, or its output took no part in the loss): reduce what earlier no-sync
        backwards accumulated, as torch's FSDP2 does (its final callback runs
        ``post_backward`` for every parameter group not in ``POST_BACKWARD``, which
        reduce-scatters an accumulated gradient, or with ``reduce_scatter_unused_params``
        zeros: [Note: unused parameters]).  Finishes the reductions in ``pending`` first
        (one in flight, as ``UnitState._post_backward``) and appends its own; nothing when
        there is nothing to reduce."""
        self._follow_unsharded_grads()
        self._join_unsharded_grad()
        acc = self.acc_grad
        if acc is not None:  # [Note: no-sync accumulation], in reduce_dtype
            self.acc_grad, grad = None, acc
        elif self.grad_unsharded and self.flat_param.grad is not None:
            grad, self.flat_param.grad = self.flat_param.grad, None
        elif self.reduces_unused():  # zeros for every trainable parameter: [Note: unused parameters]
            grad = torch.zeros(self.natural_numel, dtype=self.param_dtype, device=self.device)
        else:
            return
        self.take_grad_for_backward()
        issue_reduction(pending, self, grad)

    def _redistribute_partial(self, grad: torch.Tensor) -> None:
        """The TP parameters whose gradient arrived as a partial sum over TP ranks (e.g.
        a sequence-parallel norm's): their accumulated local gradients, in ``grad``, become
        the parameters' own placements now, once, as torch's FSDP2 redistributes the
        accumulated gradient before reducing it."""
        for qi, spec in self._partial.items():
            q = self.params[qi]
            want = q.grad_placements(spec.placements)  # [Note: dp_mesh_dims]
            if want == spec.placements:
                continue  # as it arrived on the data-parallel dims, its own elsewhere
            view = grad[q.nat_off : q.nat_off + q.numel].view(q.shape)
            target = DTensorSpec(q.tp_spec.mesh, want, tensor_meta=spec.tensor_meta)
            out = redistribute_local_tensor(view, spec, target)
            if out is not view:
                view.copy_(out)
        self._partial.clear()

    def note_partial(self, qi: int, spec: Any) -> None:
        """A TP view's backward (``views.TPView`` with this unit's ``GradSink``): parameter
        ``qi``'s local gradient is a partial sum, or has other placements than the
        parameter's on the data-parallel dims of ``dp_mesh_dims`` (kept as they are:
        [Note: dp_mesh_dims])."""
        have = self._partial.get(qi)
        if have is not None and have.placements != spec.placements:
            raise AssertionError(
                f"cfsdp: the gradient of '{self.params[qi].fqn}' arrived as {spec.placements} "
                f"after {have.placements} in the same accumulation")
        self._partial[qi] = spec

    def reduce_grad(self, grad: torch.Tensor) -> PendingReduce:
        """Pack the natural gradient into the rank-major reduce-scatter input (cast
        to ``reduce_dtype`` and pre-divided in the same C pass) and issue it."""
        acc = self.acc_grad
        if acc is not None:  # [Note: no-sync accumulation]
            self._accumulate(acc, grad)
            grad, self.acc_grad = acc, None
        if self._partial:  # (a partial sum is redistributed once it is complete)
            if _fsdp2.REDUCES_IN_GRAD_DTYPE and grad.dtype != self.reduce_dtype:
                # torch 2.15: such a gradient reaches its grad_dtype (reduce_dtype, else
                # the parameter's dtype) in autograd, before its reduction over the TP
                # ranks, which then runs in that dtype (the other parameters' cast at the
                # copy-in gives the same values)
                grad = grad.to(self.reduce_dtype)
            self._redistribute_partial(grad)
        ctx = self._comm
        lay = self._reduce_layout()  # the trainable parameters only: [Note: trainable layout]
        if ctx is not None and ctx.streams:
            return self._reduce_on_streams(ctx, grad, lay)
        if lay is None:
            out, plan, plan_bytes = self._reduce_out(), self._plan, self._plan_bytes
        else:
            out = torch.empty(lay.numel, dtype=self.reduce_dtype, device=self.device)
            plan, plan_bytes = lay.plan, lay.plan_bytes
        self.grad_unsharded = False
        # on shared memory the pack runs piece by piece into the shared slots (no
        # rank-major buffer); on the process group it is chunk_pack, then the collective
        pending = comm.reduce_scatter_pack(out, grad.contiguous(), plan, plan_bytes,
                                           self.pre_divide, self.group, True, op=self.reduce_op)
        return PendingReduce(self, pending, out)

    def _reduce_out(self) -> torch.Tensor:
        if self.saved_grad is None and self.reduce_dtype == self.dtype:
            return self.new_grad_buffer()  # reduce straight into the gradient
        return torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)

    def _reduce_on_streams(self, ctx, grad: torch.Tensor,
                           lay: Optional["_TrainableLayout"]) -> FinishedReduce:
        """[Note: stream protocol] in streams.py: pack, reduce-scatter (``async_op=False``)
        and fold in on the reduce-scatter stream (HSDP's all-reduce and an all-reduce hook
        on the all-reduce stream, which the fold then follows); finished when it returns,
        as far as the CPU is concerned."""
        layer = ctx.layer
        cur = layer.current_stream()
        rs = layer.stream(device.REDUCE_SCATTER)
        ctx.release_reduce_scatter()
        ctx.reduce_scatter_waits_current(rs, cur)
        W, S = self.world_size, self.shard_numel
        launches = self.launches()
        if lay is not None:  # [Note: trainable layout]
            S, launches = lay.numel, lay.launches()
        grad = grad.contiguous()
        layer.record_stream(grad, rs)  # made on the current stream, read on this one
        with layer.on(rs):
            inp = torch.empty(W * S, dtype=self.reduce_dtype, device=self.device)
            launches.pack(inp, grad, divisor=self.pre_divide)  # one _chunk_cat
            out = (self._reduce_out() if lay is None
                   else torch.empty(S, dtype=self.reduce_dtype, device=self.device))
            comm.reduce_scatter(out, inp, self.group, False, op=self.reduce_op)
            rs_event = rs.record_event()
        self.grad_unsharded = False
        post = rs
        if (self.replicate_group is not None and self.requires_all_reduce) or (
                self.replicate_group is None and self.all_reduce_hook is not None):
            post = layer.stream(device.ALL_REDUCE)
            post.wait_stream(rs)
        if lay is not None and post is not rs:  # read there by the copy into the shard-sized
            layer.record_stream(out, post)  # tensor, then dropped ([Note: trainable layout])
        with layer.on(post):
            accumulate_sharded(self, out, False, self._expander(out))
            ctx.post_reduce_events[post] = post.record_event()
        ctx.hold_reduce_scatter((inp,), rs_event)
        return FinishedReduce()

    def take_waiting_grad(self) -> Optional[torch.Tensor]:
        """None: the flat parameter keeps its dtype, one node per iteration, and the
        gradient-ready hook acts in each ([Note: one post-backward per iteration] in
        base.py)."""
        return None

    def publish_grad(self) -> None:
        """Expose the reduced gradient: each parameter's ``.grad`` is a DTensor
        whose local tensor views this rank's rows of the sharded gradient.  A unit left
        unsharded (``reshard_after_backward`` False) drops the full-size gradients that
        earlier no-sync backwards showed on its registered parameters: torch's
        ``FSDPParamGroup.post_backward`` sets each unsharded parameter's ``.grad`` to None
        once it takes it for the reduction, and they stay registered."""
        g = self.saved_grad
        self.saved_grad = None
        self.grad_unsharded = False
        self._drop_shown_unsharded_grads()
        if g is None:
            self._had_grad = None
            self._forget_got_grads()
            return
        pub = self._pub
        if pub is None or pub.buf is not g:
            pub = self._pub = self._new_published(g)
        unused = self._unused(g)
        frozen = pub.frozen
        if unused or frozen:
            shown = list(pub.dts_all)
            for i in unused:
                shown[i] = None
            if frozen:  # a frozen parameter keeps the .grad it holds ([Note: unused parameters])
                held = _core.attr_get(self._sharded_t, "grad")
                for i in frozen:
                    shown[i] = held[i]
            pub.shown = tuple(shown)
        else:
            pub.shown = pub.dts_all
        _core.attr_set(self._sharded_t, "grad", pub.shown)

    def _new_published(self, g: torch.Tensor) -> "_Published":
        locals_, dts_all = [], []
        with torch.no_grad():
            for q in self.params:
                if q.requires_grad:
                    local = q.local_view(g)
                    locals_.append(local)
                    dts_all.append(q.dtensor(local))
                else:
                    dts_all.append(None)
        return _Published(g, tuple(locals_), tuple(dts_all))

    def publish_unsharded_grad(self) -> None:
        """No gradient sync: the unreduced gradient stays with the unit until a
        synchronising backward.  A unit left unsharded (``reshard_after_backward``
        False) shows it as the full-size gradient of each registered parameter,
        as torch does; the sharded parameters keep their sharded gradients.  On torch 2.15
        that is the gradient accumulated in ``reduce_dtype`` where it differs from the
        gradient's (``acc_grad``: the unsharded parameters' own, in their ``grad_dtype``);
        before 2.15 torch keeps that one off the parameters, which show no gradient, but a
        ``.grad`` the user assigns them still counts ([Note: no-sync accumulation]).  A unit
        this backward did not reach follows what the user did since the last publish first,
        as torch's final callback runs its post-backward.

        The sharded gradient this backward's pre-hook took to add to (``saved_grad``) is let
        go: nothing was added to it, and the synchronising backward adds to whatever the
        parameters hold then, as torch's post-backward adds to ``sharded_param.grad`` as it
        finds it.  Kept, a ``zero_grad()`` between this backward and that one went unseen
        (``_forget_dropped_grads`` spares the buffer it holds): the reduction was added to
        the gradient of the step before."""
        self.saved_grad = None
        self._follow_unsharded_grads()
        self._join_unsharded_grad()
        if self._buf is None:
            return
        g = self.acc_grad if self._shows_acc_grad() else self.flat_param.grad
        if g is None:  # nothing shown; followed from there (a .grad assigned counts)
            _core.attr_set(self._unsharded_t, "grad", None)
            self._unsharded_grads = (None,) * len(self.params)
            return
        if self._got_every_grad():
            plan = self._grad_view_plan
            if plan is None or plan[0] != self._rg_mask:
                plan = self._grad_view_plan = (
                    self._rg_mask, *views_or_none(self._param_index, self._shapes, self._rg_mask,
                                                  len(self.params)))
            _, index, shapes = plan
        else:  # parameters without a local gradient keep None (not cached: rare)
            mask = bytes(a and b for a, b in zip(self._rg_mask, self._got_grad))
            index, shapes = views_or_none(self._param_index, self._shapes, mask, len(self.params))
        views = _core.shape_views((*torch.split(g, self._split_sizes), None), index, shapes, None,
                                  self._param_index)
        if self._tp:  # a TP parameter's full-size gradient is a DTensor (a partial sum
            # over TP ranks while not yet redistributed, as torch's shows it)
            views = tuple(
                v if v is None or q.tp_spec is None else
                DTensor(v, self._partial[i], requires_grad=False) if i in self._partial else
                q.tp_dtensor(v)
                for i, (v, q) in enumerate(zip(views, self.params)))
        _core.attr_set(self._unsharded_t, "grad", views)
        self._unsharded_grads = views

    def _shows_acc_grad(self) -> bool:
        """Whether the no-sync gradient shown on the unsharded parameters is ``acc_grad``
        (torch 2.15: accumulated there, in their ``grad_dtype``) rather than
        ``flat_param.grad``."""
        return _fsdp2.REDUCES_IN_GRAD_DTYPE and self.acc_grad is not None

    def _drop_shown_unsharded_grads(self) -> None:
        """The registered full-size parameters show no gradient any more (as torch's, once
        post-backward takes it, or at reshard)."""
        if self._unsharded_grads:
            _core.attr_set(self._unsharded_t, "grad", None)
            self._unsharded_grads = False

    def _follow_unsharded_grads(self) -> None:
        """Before a backward adds to the no-sync gradient (or the end of a backward reduces it
        or folds it in for a unit it did not reach): a unit left unsharded shows it on its
        registered parameters (``publish_unsharded_grad``), where torch's FSDP2 keeps it, so
        what the user did to those ``.grad`` counts, as in torch: cleared
        (``model.zero_grad()``) drops that parameter's part (all cleared: the whole gradient),
        assigned replaces it.  In-place changes already went to the gradient (the views share
        it).  A ``.grad`` assigned where nothing was shown (a parameter without a gradient yet;
        on torch 2.11-2.14 every parameter where ``reduce_dtype`` differs from the compute
        dtype) goes where torch keeps it: ``_unsharded_grad_buffer``."""
        shown = self._unsharded_grads
        if not shown:
            return
        cur = _core.attr_get(self._unsharded_t, "grad")
        if all(map(operator.is_, cur, shown)):
            return
        self._unsharded_grads = False
        if all_none(cur):  # what was shown: publish_unsharded_grad's g
            if self._shows_acc_grad():
                self.acc_grad = None
            else:
                self.flat_param.grad = None
                self.grad_unsharded = False
            return
        buf = None
        with torch.no_grad():
            for i, (c, v) in enumerate(zip(cur, shown)):
                if c is v:
                    continue
                if v is not None:
                    if c is None:
                        v.zero_()
                    else:
                        v.copy_(c)
                    continue
                q = self.params[i]
                self._check_assigned_grad(q, c)
                if buf is None:
                    buf = self._unsharded_grad_buffer()
                buf[q.nat_off : q.nat_off + q.numel].view(q.shape).copy_(c)
                # torch reduces it: [Note: unused parameters] (also where a later node of
                # this backward leaves the parameter without a gradient of its own)
                self._got_grad[i] = 1

    def _check_assigned_grad(self, q: Any, c: torch.Tensor) -> None:
        """A ``.grad`` the user assigned to ``q``'s unsharded parameter where nothing was shown
        (``_follow_unsharded_grads``): what cfsdp cannot hold as torch does is an error
        naming the parameter."""
        dtype = self._unsharded_grad_dtype()
        if not q.requires_grad:
            why = ("it does not require grad (torch's FSDP2 would reduce that gradient into "
                   "its sharded parameter's .grad)")
        elif q.tp_spec is not None:
            why = "it is a tensor-parallel (DTensor) parameter"
        elif q.ext is not None:
            why = "it uses the all-gather extensions"
        elif isinstance(c, DTensor) or c.dtype != dtype or tuple(c.shape) != tuple(q.shape):
            why = (f"the gradient is a {type(c).__name__} of {c.dtype} and shape "
                   f"{tuple(c.shape)}, not a tensor of {dtype} and shape {tuple(q.shape)}")
        else:
            return
        raise NotImplementedError(
            f"fully_shard: a .grad was assigned to the unsharded parameter '{q.fqn}' of a unit "
            "left unsharded during gradient accumulation without sync, where it showed no "
            f"gradient; cfsdp cannot add it to the accumulation as torch does: {why}. Assign "
            "gradients to the sharded parameters after the synchronising backward instead.")

    def _unsharded_grad_dtype(self) -> torch.dtype:
        """The dtype of what torch keeps on the unsharded parameters' ``.grad``
        (``_unsharded_grad_buffer``'s)."""
        if _fsdp2.REDUCES_IN_GRAD_DTYPE:
            return self.reduce_dtype
        return self.param_dtype

    def _unsharded_grad_buffer(self) -> torch.Tensor:
        """The flat gradient that holds what torch keeps on the unsharded parameters' ``.grad``
        ([Note: no-sync accumulation]), made (zero) if there is none: ``acc_grad`` on torch
        2.15 where ``reduce_dtype`` differs from the compute dtype, else ``flat_param.grad``,
        to which the next backward's autograd adds its gradient."""
        if _fsdp2.REDUCES_IN_GRAD_DTYPE and self.reduce_dtype != self.param_dtype:
            if self.acc_grad is None:
                self.acc_grad = torch.zeros(self.natural_numel, dtype=self.reduce_dtype,
                                            device=self.flat_param.device)
            return self.acc_grad
        g = self.flat_param.grad
        if g is None:
            g = torch.zeros(self.natural_numel, dtype=self.param_dtype,
                            device=self.flat_param.device)
            self.flat_param.grad = g
            self.grad_unsharded = True
        return g

    def _join_unsharded_grad(self) -> None:
        """torch 2.11-2.14's post-backward for a unit the backward did not reach (its final
        callback runs it): a gradient in the compute dtype on the unsharded parameters where
        ``reduce_dtype`` differs (one the user assigned: ``_follow_unsharded_grads``) is added
        to the accumulation in ``reduce_dtype``, or becomes it, cast
        (``accumulate_unsharded_grad_if_needed``, ``to_accumulated_grad_if_needed``)."""
        g = self.flat_param.grad
        if g is None or g.dtype == self.reduce_dtype:
            return
        self.flat_param.grad = None
        self.grad_unsharded = False
        self.keep_unsharded_grad(g)


def _weak_note_grads(unit: ChunkGrads):
    """``unit.note_grads`` holding the unit weakly: the hook lives on autograd nodes that
    the views in the modules' ``__dict__`` keep alive, out of the garbage collector's
    sight (see ``hook_grad_ready``)."""
    ref = weakref.ref(unit)

    def hook(grad_outputs: tuple) -> None:
        u = ref()
        if u is not None:
            u.note_grads(grad_outputs)

    return hook


class _TrainableLayout:
    """The reduce-scatter layout of a unit's trainable parameters ([Note: trainable layout]):
    their chunk plan (the unit's own entries, each at its offset in the smaller shard), the
    shard size, the spans that copy the result back into the unit's shard (adjacent
    parameters merged into one copy), and the streams' path's launches (made when first
    asked for)."""

    __slots__ = ("mask", "plan", "plan_bytes", "numel", "spans", "rows", "world_size", "_launches")

    def __init__(self, params: list, mask: tuple, world_size: int):
        plan, spans, rows, off = [], [], [], 0
        for q, rg in zip(params, mask):
            if not rg:
                continue
            plan.append(q.plan_entry(off))
            rows.append(max(q.rows, 1))
            if spans and spans[-1][0] + spans[-1][2] == q.shard_off and spans[-1][1] + spans[-1][2] == off:
                dst, src, n = spans[-1]
                spans[-1] = (dst, src, n + q.chunk_numel)  # adjacent: one copy
            else:
                spans.append((q.shard_off, off, q.chunk_numel))
            off += q.chunk_numel
        self.mask, self.plan, self.plan_bytes = mask, plan, comm.pack_plan(plan)
        self.numel, self.spans, self.rows = off, tuple(spans), rows
        self.world_size, self._launches = world_size, None

    def launches(self) -> Launches:
        if self._launches is None:
            self._launches = Launches(self.plan, self.rows, self.world_size, self.numel)
        return self._launches


class _Published:
    """A unit's published sharded gradient: its buffer, the local views of it, the
    DTensor gradients over them (None for a frozen parameter) and what the parameters
    were given; see [Note: gradient ownership]."""

    __slots__ = ("buf", "locals", "dts_all", "shown", "frozen")

    def __init__(self, buf: torch.Tensor, locals_: tuple, dts_all: tuple):
        self.buf = buf
        self.locals = locals_
        self.dts_all = dts_all
        # what the parameters were given: dts_all, None where unused, what a frozen one held
        self.shown = dts_all
        self.frozen = tuple(i for i, d in enumerate(dts_all) if d is None)  # their indices


__all__ = ["ChunkGrads", "gradient_divide"]
