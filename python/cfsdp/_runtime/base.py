"""The contract between the hooks and the units, and what every unit kind shares.

[Note: unit contract]
A *unit* is the set of parameters communicated together: one wrapped module
(``flat.unit.Unit``: torch FSDP1's flat layout) or one ``fully_shard`` call
(``chunk.unit.ChunkUnit``: FSDP2's per-parameter dim-0 chunks).  The hooks
(``hooks.UnitState``) drive a unit through one training step with the calls listed
in :class:`UnitContract`, and nothing else:

==========================  ======================================================
pre-forward                 ``before_forward()`` (not in a recompute inside backward:
                            [Note: recompute] in hooks.py), ``unshard()``, with grad
                            enabled ``record_grad_node()``, ``use_forward_views()``
post-forward                ``reshard_after_forward(for_backward)``, or
                            ``end_forward_views()`` for a unit that stays unsharded
                            (the wrapper face: ``UnitState.keeps_views_for_backward``)
pre-backward                ``unshard()``, ``use_forward_views()``,
                            ``take_grad_for_backward()`` (once per backward; the
                            composable face's again after its post-backward: [Note:
                            recompute])
gradient ready              ``post_backward_fn(unit, grad)`` (set by the hooks, called
                            by :func:`hook_grad_ready`, once per iteration: [Note: one
                            post-backward per iteration]), then ``keep_unsharded_grad``
                            (no sync) or ``reduce_grad`` -> :class:`PendingReduce`
reduction finished          ``PendingReduce.finish()`` -> ``accumulate_reduced``
end of backward             ``take_waiting_grad()`` (a gradient that waits goes the way
                            of a ready one), ``reduce_unreached(pending)`` for a unit
                            a synchronising backward did not reach,
                            ``reshard()`` (or ``end_forward_views()`` for a unit kept
                            unsharded), ``publish_grad()`` or ``publish_unsharded_grad()``
prefetch                    ``unshard(async_op=True)``
==========================  ======================================================

Every unit kind also shares the unshard state machine of :class:`UnshardStates`
(sharded -> in flight -> unsharded -> sharded), the storage helpers
(:func:`alloc_storage`, :func:`free_storage`), :func:`set_grad`, the view plans of
[Note: bulk binding] (:func:`views_or_none`), and the sharded half of a finished
reduction (:func:`accumulate_sharded`).  A new unit kind (tensor-parallel chunks, say)
subclasses :class:`UnshardStates` and meets :class:`UnitContract`; a type checker can check
it statically, and ``tests/unit/test_single_rank.py`` checks both existing kinds' live units
against every member of it.

This module also holds the one traversal that finds a model's wrapper units
(:func:`wrappers_in`), so layers below the faces find them without importing a face.
"""

from __future__ import annotations

import enum
import itertools
import operator
import weakref
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from .._torch.core import current_autograd_node
from . import comm, device
from .reduce import scale_cast_add


class TrainingState(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()
    SUMMON = enum.auto()


# ---------------------------------------------------------------------------
# the contract
# ---------------------------------------------------------------------------


class UnitContract(Protocol):
    """What the hooks and :class:`PendingReduce` use of a unit ([Note: unit contract])."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype  # of the shard, the optimizer's parameters and gradients
    flat_param: nn.Parameter  # the parameter autograd sees; its gradient is the unit's
    saved_grad: Optional[torch.Tensor]  # the sharded gradient being accumulated in backward
    post_backward_fn: Optional[Callable[[Any, torch.Tensor], None]]
    # [Note: one post-backward per iteration]: the AccumulateGrad node the gradient-ready
    # hook acts in (None: any), and whether a gradient accumulated in another is waiting
    first_grad_node: Optional[Any]
    grad_waiting: bool

    @property
    def is_unsharded(self) -> bool: ...

    def before_forward(self) -> None: ...

    def unshard(self, async_op: bool = False) -> None: ...

    def wait_unshard(self) -> None: ...

    def use_forward_views(self) -> None: ...

    def record_grad_node(self) -> None: ...

    def end_forward_views(self) -> None: ...

    def reshard(self) -> None: ...

    def reshard_after_forward(self, for_backward: bool) -> None: ...

    def take_grad_for_backward(self) -> None: ...

    def keep_unsharded_grad(self, grad: torch.Tensor) -> None: ...

    def reduce_grad(self, grad: torch.Tensor) -> "PendingReduce": ...

    def accumulate_reduced(self, out: torch.Tensor, divided: bool) -> None: ...

    def take_waiting_grad(self) -> Optional[torch.Tensor]: ...

    def reduce_unreached(self, pending: list) -> None: ...

    def publish_grad(self) -> None: ...

    def publish_unsharded_grad(self) -> None: ...


class ShardedReduceTarget(Protocol):
    """What :func:`accumulate_sharded` reads and writes of a unit."""

    dtype: torch.dtype
    post_divide: float
    replicate_group: Optional[dist.ProcessGroup]
    replicate_op: Any
    all_reduce_hook: Optional[Callable[[torch.Tensor], None]]
    saved_grad: Optional[torch.Tensor]
    requires_all_reduce: bool
    partial_reduce: Optional[torch.Tensor]

    def new_grad_buffer(self) -> torch.Tensor: ...


# ---------------------------------------------------------------------------
# the unshard state machine
# ---------------------------------------------------------------------------


class UnshardStates:
    """The unshard state machine every unit kind shares.

    States: *sharded* (``_buf`` None, nothing in flight), *in flight* (a collective
    issued, ``_unshard_work`` set), *unsharded* (``_buf`` is the buffer the full
    parameters live in).  A subclass implements two steps:

    * ``_start_unshard(**kw)``: issue the collective and return ``(work, payload)``,
      or finish synchronously (set ``_buf``) and return None;
    * ``_finish_unshard(payload)``: after the work completed, make the full
      parameters usable (set ``_buf``, copy out, register them).

    :meth:`unshard` is then idempotent (a no-op when unsharded, a wait when in
    flight and asked to block), and :meth:`wait_unshard` a no-op unless in flight."""

    _buf: Optional[torch.Tensor]
    _unshard_work: Optional[comm.Pending]
    _unshard_payload: Any

    def _init_unshard_states(self, buf: Optional[torch.Tensor] = None) -> None:
        self._buf = buf
        self._unshard_work = None
        self._unshard_payload = None

    @property
    def is_unsharded(self) -> bool:
        return self._buf is not None

    def unshard(self, async_op: bool = False, **kw: Any) -> None:
        if self._buf is None and self._unshard_work is None:
            started = self._start_unshard(**kw)
            if started is not None:
                self._unshard_work, self._unshard_payload = started
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        work = self._unshard_work
        if work is None:
            return
        work.wait()
        payload = self._unshard_payload
        self._unshard_work = self._unshard_payload = None
        self._finish_unshard(payload)

    def _start_unshard(self, **kw: Any) -> Optional[tuple[comm.Pending, Any]]:
        raise NotImplementedError

    def _finish_unshard(self, payload: Any) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------


class PendingReduce:
    """A reduction in flight; ``finish`` waits for it and hands the result to the unit
    (``accumulate_reduced``: post-divide, cast, fold into the unit's gradient)."""

    __slots__ = ("unit", "pending", "out", "divided")

    def __init__(self, unit: UnitContract, pending: comm.Pending, out: torch.Tensor, divided: bool = False):
        self.unit = unit
        self.pending = pending
        self.out = out
        self.divided = divided  # a comm hook did its own division

    def finish(self) -> None:
        self.pending.wait()
        self.unit.accumulate_reduced(self.out, self.divided)


class FinishedReduce:
    """A reduction already folded in when it was issued (the stream protocol's: its
    ordering is the streams', [Note: stream protocol] in chunk/streams.py)."""

    __slots__ = ()
    pending = comm.Pending(None)  # nothing in flight (reset_iter_state waits for it)

    def finish(self) -> None:
        pass


def accumulate_sharded(u: ShardedReduceTarget, out: torch.Tensor, divided: bool,
                       expand: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
    """Fold a reduce-scattered gradient shard ``out`` into ``u.saved_grad``: HSDP's
    all-reduce across replicas, the all-reduce hook, then torch's order: post-divide in
    the reduction dtype, cast to the gradient dtype, accumulate (one C pass).  ``expand``:
    ``out`` holds some of the unit's parameters only (a ``fully_shard`` unit's trainable
    ones: [Note: trainable layout] in chunk/grads.py); it makes the shard-sized tensor
    (zeros elsewhere) after the all-reduce and the hook, which see what torch's see.

    HSDP with ``requires_all_reduce`` False (``set_requires_all_reduce(False)``): as
    torch's FSDP2, the shard is only added to ``u.partial_reduce`` (in the reduction
    dtype, before any hook or post-divide; the gradient is left as it is); the next
    reduction that all-reduces adds that sum to its own shard first."""
    if u.replicate_group is not None:
        if not u.requires_all_reduce:
            if u.partial_reduce is None:
                u.partial_reduce = out  # a new buffer per reduction: nothing else holds it
            else:
                u.partial_reduce += out
            return
        if u.partial_reduce is not None:
            out += u.partial_reduce
            u.partial_reduce = None
        comm.all_reduce(out, u.replicate_group, False, op=u.replicate_op).wait()
    if u.all_reduce_hook is not None:  # fully_shard's set_all_reduce_hook
        u.all_reduce_hook(out)
    if expand is not None:
        out = expand(out)
    div = u.post_divide if (u.post_divide > 1 and not divided) else 1.0
    if u.saved_grad is not None:
        scale_cast_add(u.saved_grad, out, div, True)
    elif out.dtype == u.dtype:
        if div != 1.0:
            scale_cast_add(out, out, div, False)
        u.saved_grad = out
    else:
        g = u.new_grad_buffer()
        scale_cast_add(g, out, div, False)
        u.saved_grad = g


# [Note: one post-backward per iteration]
# torch's FSDP1 runs a unit's post-backward (reduce, reshard) once per iteration, from a
# hook on the ``AccumulateGrad`` node of the unit's *first* grad-enabled forward
# (``_register_post_backward_hook``: registered after that forward's unshard, kept, with
# the node, to the end of backward).  A flat parameter can have several such nodes in one
# backward: autograd makes a new accumulator when ``.data`` changes dtype, and the
# wrapper's mixed precision does just that (the unsharded buffer is in ``param_dtype``,
# the shard in full precision), so a FULL_SHARD unit called twice in one forward
# (``a(b(a(x)))``, or two forwards before one backward) and resharded in between gets one
# node per call.  The later calls' nodes (backward runs them first) only accumulate into
# ``flat_param.grad``, in ``param_dtype``; the first node's hook reduces that sum.  A
# post-accumulate-grad hook fires once per node, so a unit that may have several
# (the wrapper's; ``fully_shard``'s flat parameter keeps its dtype, one node, as torch
# FSDP2's unsharded parameters) records the node of its first grad-enabled forward
# (``record_grad_node``, after the pre-forward's unshard and before its views, as torch's)
# in ``first_grad_node``, and the hook acts only inside that node
# (``current_autograd_node``); in another it leaves the gradient on the parameter, to
# accumulate, and marks the unit ``grad_waiting``.  (Acting in each node reduced each
# call's gradient on its own, summed in full precision: other numbers than torch's; and
# the first reduction resharded the unit before the earlier call's backward, which may
# need its parameters: a freed-storage error.)  torch's post-forward swaps ``.data`` to the
# full-precision shard under every strategy, the root's unit included, so every forward
# has its own node; cfsdp's SHARD_GRAD_OP, NO_SHARD and root units stay unsharded between
# the calls, so a later forward's ``record_grad_node`` makes it a node of its own
# (``new_grad_node``).  The nodes' order matters once ``flat_param.grad`` holds a
# gradient (``no_sync()``'s): torch adds each call's gradient to it in turn, one node would
# add their sum (other bf16 roundings).  Full precision has one node throughout.  The end
# of backward forgets the node.  A grad-enabled forward
# that no backward follows leaves its node recorded, never to run; torch's unit then never
# reduces (its optimizer step fails on the unsharded gradient).  cfsdp's end of backward
# takes a gradient still waiting (``take_waiting_grad``) through the reduction (or
# no_sync's keep) the hook would have issued: the same gradient, the same numbers.


def hook_grad_ready(unit: UnitContract) -> None:
    """When ``unit.flat_param``'s gradient has been accumulated in backward, take it
    off the parameter and hand it to ``unit.post_backward_fn(unit, grad)`` (set by
    the runtime); only in ``unit.first_grad_node`` when one is recorded
    ([Note: one post-backward per iteration]).

    The hook lives in the tensor's C++ hook list, out of the garbage collector's
    sight: it holds the unit weakly, or a unit and its flat parameter would keep
    each other alive after the model is gone."""
    unit_ref = weakref.ref(unit)

    def hook(p: torch.Tensor) -> None:
        u = unit_ref()
        if u is None:
            return
        first = u.first_grad_node
        if first is not None and current_autograd_node() is not first:
            u.grad_waiting = True  # a later call's node: accumulate, reduce once
            return
        u.grad_waiting = False
        grad = p.grad
        p.grad = None
        if u.post_backward_fn is None:
            raise AssertionError("cfsdp unit has no post-backward handler")
        u.post_backward_fn(u, grad)

    unit.flat_param.register_post_accumulate_grad_hook(hook)


# ---------------------------------------------------------------------------
# tensors and views
# ---------------------------------------------------------------------------


def issue_reduction(pending: list, unit: "UnitContract", grad: torch.Tensor) -> None:
    """Issue ``unit``'s reduction of ``grad`` with one reduction in flight: the older ones in
    ``pending`` are finished first."""
    while pending:
        pending.pop(0).finish()
    pending.append(unit.reduce_grad(grad))


def new_grad_node(p: torch.Tensor, other_dtype: torch.dtype) -> None:
    """Views of ``p`` made from now on get a new ``AccumulateGrad`` node, as after a
    ``.data`` swap to ``other_dtype`` and back (what torch FSDP1's reshard and unshard do
    under mixed precision): autograd drops a live node when ``.data`` changes dtype
    ([Note: one post-backward per iteration])."""
    data = p.data
    p.data = torch.empty(0, dtype=other_dtype, device=data.device)
    p.data = data


def alloc_storage(t: torch.Tensor) -> None:
    """Give ``t`` (whose storage may have been freed) its full storage back."""
    st = t.untyped_storage()
    want = t.numel() * t.element_size()
    if st.size() != want:
        st.resize_(want)
        layer = device.notified()
        if layer is not None:
            layer.alloc(t)


def free_storage(t: torch.Tensor) -> None:
    """Free ``t``'s storage, keeping the tensor (and views of it) for reuse."""
    layer = device.notified()
    if layer is not None:
        layer.free(t)
    t.untyped_storage().resize_(0)


def set_grad(p: torch.Tensor, g: Optional[torch.Tensor]) -> None:
    """``p.grad = g`` even when ``g``'s shape or dtype differs from ``p``'s (a
    sharded parameter with a full gradient under no_sync, a low-precision
    gradient): the check is side-stepped through ``.data``, as torch's FSDP1 does."""
    if g is None or (g.shape == p.shape and g.dtype == p.dtype):
        p.grad = g
        return
    p.grad = torch.empty_like(p)
    p.grad.data = g


def all_none(objs: tuple) -> bool:
    """Every item is None (by identity: ``==`` on a tensor would run an op)."""
    return all(map(operator.is_, objs, itertools.repeat(None)))


def views_or_none(index, shapes: tuple, mask: Optional[bytes], none: int) -> tuple[tuple, tuple]:
    """``(index, shapes)`` for ``_core.shape_views`` that give None for a parameter
    without a piece (``index`` -1) or frozen (``mask`` 0): they point at piece
    ``none``, a None the caller appends after the split's pieces.  Built once per
    requires_grad mask, so publishing gradients runs no Python per parameter."""
    index = tuple(j if j >= 0 and (mask is None or mask[i]) else none for i, j in enumerate(index))
    return index, tuple(None if j == none else sh for j, sh in zip(index, shapes))


# ---------------------------------------------------------------------------
# finding the units of a model
# ---------------------------------------------------------------------------

# A face's module class that owns a unit per instance sets this class attribute
# (FullyShardedDataParallel); the traversal below finds its instances.
WRAPPER_CLASS_MARK = "_cfsdp_is_wrapper"


def wrappers_in(module: nn.Module) -> list[nn.Module]:
    """Every cfsdp wrapper (``FullyShardedDataParallel``) in ``module``'s tree, in
    ``modules()`` order (``module`` itself first if it is one)."""
    return [m for m in module.modules() if getattr(type(m), WRAPPER_CLASS_MARK, False)]


__all__ = [
    "TrainingState", "UnitContract", "ShardedReduceTarget", "UnshardStates", "PendingReduce",
    "FinishedReduce",
    "accumulate_sharded", "hook_grad_ready", "alloc_storage", "free_storage", "set_grad",
    "issue_reduction",
    "all_none", "views_or_none", "WRAPPER_CLASS_MARK", "wrappers_in",
]
