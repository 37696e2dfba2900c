"""Forward/backward hooks, root lazy init and the end-of-backward callback.

Written once for both faces.  A face owns one ``UnitState`` per wrapped module
(or ``fully_shard`` call); the first one whose forward runs becomes the root and
owns a ``RootState`` shared by every ``UnitState`` below it.

Order of events in one training step (FULL_SHARD):

1. root pre-forward: lazy init on the first step; reset per-step state.
2. each unit's pre-forward: unshard (all-gather), bind forward views; record the
   unit in the execution order on the first step; forward-prefetch the next.
3. each unit's post-forward: reshard (non-root), register pre-backward hooks on
   the outputs that require grad.
4. pre-backward (first output gradient of a unit): unshard again, move any
   existing sharded gradient aside; backward-prefetch the next unit.  The root's
   first pre-backward queues the end-of-backward callback.
5. post-backward (the flat gradient is accumulated): reduce-scatter (async), then
   reshard.
6. end of backward: wait for every reduction, fold it into the sharded gradient,
   reshard anything still unsharded, publish gradients, reset states.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

import torch

from .._compile import check_not_compiled_autograd, dynamo_disable
from .._torch import core as _torch_core
from .base import PendingReduce, TrainingState, UnitContract, issue_reduction

# [Note: recompute]
# Activation checkpointing runs a module's forward again in backward, after
# the unit's pre-backward hook has unsharded it.  So the pre-backward hook
# binds fresh forward views with grad mode on (reshard unbinds them with
# use_orig_params=True, and a reentrant checkpoint differentiates the recompute),
# and a forward that starts while its unit is in BACKWARD_PRE (a checkpointed
# region wrapping a whole unit) skips the pre/post-forward logic, as torch's
# FSDP1 does: no unshard, no reshard, no new hooks.
#
# A reentrant checkpoint differentiates each recompute in a backward of its own,
# so the unit's gradient is accumulated, and its post-backward runs (reduce,
# reshard), once per checkpointed call of a unit called several times in one
# forward, before the next call's recompute.  torch's FSDP2 runs the pre-backward
# of every output gradient (``FSDPParamGroup.pre_backward``: unshard, a no-op when
# unsharded), so the earlier call's recompute finds the unit unsharded again:
# ``UnitState.pre_backward_each_output``.  torch's FSDP1 runs it once per
# backward (``_ran_pre_backward_hook``) and that recompute fails on the resharded
# parameters; the wrapper face does the same.
#
# A forward that runs inside a backward (a recompute of a unit whose earlier call's
# post-backward ran already: reentrant checkpointing around the unit) is part of the
# step that backward belongs to, not a new one: it skips the unit's ``before_forward``
# (with ``use_orig_params=True`` the wrapper's unit drops its flat gradient there when
# every original parameter's ``.grad`` is None, which is what they show until the end
# of backward: the reduced gradient of the later call was dropped).  torch's FSDP1
# clears those gradients in the root's pre-forward and first pre-backward only.

BACKWARD_PRE = "BACKWARD_PRE"
BACKWARD_POST = "BACKWARD_POST"


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested output: tensors, lists, tuples (named too),
    sets, dicts (also ``OrderedDict`` / ``ModelOutput``-like) and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from iter_tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))


def cast_floating(dtype: torch.dtype, obj: Any) -> Any:
    """``obj`` with every floating-point tensor in it cast to ``dtype`` (same
    containers as :func:`iter_tensors`)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, dict):
        return type(obj)((k, cast_floating(dtype, v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(cast_floating(dtype, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floating(dtype, v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: cast_floating(dtype, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        )
    return obj


class SummonStateError(AssertionError):
    """``summon_full_params`` (or a full state dict) at a time it cannot run:
    during forward/backward, or nested.  torch's FSDP1 raises ``AssertionError``
    there (``_unshard_params_for_summon``), so this is one."""


def check_can_summon(states: list["UnitState"]) -> None:
    """Full parameters (summon, full/sharded state dicts) only between steps, not nested."""
    for st in states:
        ts = st.training_state
        if ts in (TrainingState.FORWARD, TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST):
            raise SummonStateError(
                "Cannot manually unshard parameters during forward/backward: "
                "summon_full_params / state_dict was called while a unit of "
                f"{st.name} is in {ts.name}. Call it between training steps "
                "(after backward, or before forward)."
            )
        if ts is TrainingState.SUMMON:
            raise SummonStateError(
                "Cannot manually unshard parameters when already unsharding parameters: "
                "summon_full_params / state_dict was called inside summon_full_params of "
                f"{st.name}. Leave the outer summon_full_params context first (its "
                "parameters are already full), or summon disjoint units with recurse=False."
            )


class RootState:
    """State shared by every unit below one root."""

    def __init__(self, backward_prefetch: Optional[str], forward_prefetch: bool):
        self.states: list["UnitState"] = []
        self.exec_order: list["UnitState"] = []
        self.recording = True  # first iteration: record the forward order
        self.pending: list[PendingReduce] = []
        self.callback_queued = False
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        # the face's stream protocol (fully_shard: chunk.streams.CommContext; the wrapper:
        # flat.streams.FlatStreams): ``end_backward()`` runs in the final callback once
        # every reduction is finished
        self.streams: Optional[Any] = None


class UnitState:
    """A face's per-module runtime state."""

    def __init__(self, unit: Optional[UnitContract], name: str, reshard_after_forward: bool):
        self.unit = unit
        self.name = name
        self.reshard_after_forward = reshard_after_forward
        # False inside no_sync(): gradients accumulate unsharded, unreduced.
        self.sync_gradients = True
        self.is_root: Optional[bool] = None
        self.root: Optional[RootState] = None
        self.training_state = TrainingState.IDLE
        self.order_index: Optional[int] = None
        # The composable face's knobs (None / False: the wrapper face's rules).
        # reshard_after_backward: reshard when the unit's gradient is reduced
        # (None: always when syncing, else as after forward).
        self.reshard_after_backward: Optional[bool] = None
        # The root keeps its parameters after a training forward (backward needs
        # them at once) unless this is set (fully_shard(reshard_after_forward=True)).
        self.root_reshards_after_forward = False
        # Explicit prefetch targets (set_modules_to_{forward,backward}_prefetch):
        # None means the implicit neighbour in the recorded order.
        self.forward_prefetch_states: Optional[list["UnitState"]] = None
        self.backward_prefetch_states: Optional[list["UnitState"]] = None
        # False: backward needs no parameter values (e.g. an embedding), skip the unshard
        self.unshard_in_backward = True
        # The composable face (torch's FSDP2): the pre-backward runs for every output
        # gradient, also after the unit's post-backward in the same backward (a reentrant
        # checkpoint's recompute of an earlier call: [Note: recompute]); the wrapper face
        # (torch's FSDP1): once per backward.
        self.pre_backward_each_output = False
        # The wrapper face (torch's FSDP1): a unit that stays unsharded after forward shows
        # its registered parameters again (``end_forward_views``), unless this is True and
        # backward will follow (SHARD_GRAD_OP / _HYBRID_SHARD_ZERO2 keep the forward's views
        # for backward, as torch's).  None: the views stay bound (the composable face).
        self.keeps_views_for_backward: Optional[bool] = None
        if unit is not None:
            unit.post_backward_fn = self._post_backward

    # ----------------------------------------------------------------- summon
    def enter_summon(self) -> None:
        """Full parameters are shown outside a step (summon_full_params, state dicts)."""
        self.training_state = TrainingState.SUMMON

    def leave_summon(self) -> None:
        self.training_state = TrainingState.IDLE

    # ---------------------------------------------------------------- forward
    @dynamo_disable
    def pre_forward(self) -> None:
        root = self.root
        if root is None:
            raise AssertionError("cfsdp: pre_forward before lazy init")
        if self.training_state is TrainingState.BACKWARD_PRE:
            return  # activation-checkpoint recompute: see [Note: recompute]
        self.training_state = TrainingState.FORWARD
        if root.recording and self.order_index is None:
            self.order_index = len(root.exec_order)
            root.exec_order.append(self)
        u = self.unit
        if u is None:
            return
        if not root.callback_queued:  # a recompute in backward is no new step: [Note: recompute]
            u.before_forward()
        u.unshard()
        if self.forward_prefetch_states is not None:
            for st in self.forward_prefetch_states:
                if st.unit is not None:
                    st.unit.unshard(async_op=True)
        elif root.forward_prefetch and not root.recording:
            nxt = self._neighbour(+1)
            if nxt is not None and nxt.unit is not None:
                nxt.unit.unshard(async_op=True)
        if torch.is_grad_enabled():  # [Note: one post-backward per iteration] in base.py
            u.record_grad_node()
        u.use_forward_views()

    @dynamo_disable
    def post_forward(self, output: Any) -> Any:
        if self.training_state is TrainingState.BACKWARD_PRE:
            return output  # activation-checkpoint recompute: see [Note: recompute]
        u = self.unit
        needs_grad = torch.is_grad_enabled()
        keep_for_backward = self.is_root and needs_grad and not self.root_reshards_after_forward
        if u is not None:
            if not keep_for_backward and self.reshard_after_forward:
                u.reshard_after_forward(needs_grad)
            elif self.keeps_views_for_backward is not None and not (
                    needs_grad and self.keeps_views_for_backward):
                u.end_forward_views()  # kept unsharded: [Note: kept unsharded units]
        self.training_state = TrainingState.IDLE
        hooked = needs_grad and self._register_pre_backward(output)
        if self.is_root and not hooked and self.root is not None:
            # Nothing will run backward from this forward: free everything now
            # so eval / no_grad forwards never leave full parameters behind.
            for st in self.root.states:
                if st.unit is not None:
                    st.unit.reshard()
        return output

    def _register_pre_backward(self, output: Any) -> bool:
        hooked = False
        for t in iter_tensors(output):
            if t.requires_grad:
                t.register_hook(self._pre_backward_hook)
                base = t._base  # [Note: view outputs]
                if base is not None and base.grad_fn is not None:
                    base.register_hook(self._pre_backward_hook)
                hooked = True
        return hooked

    # [Note: view outputs]
    # A unit whose forward returns a view (``x.view(...)``, ``x[:, 0]``) and a caller that
    # modifies it in place (``out += y``): autograd rebases the view onto a new node, and the
    # hook registered on the view is never called, so backward would run the unit's
    # backward without its all-gather (torch's FSDP2 warns about it; backward then fails on
    # freed parameters, or computes with whatever the buffer holds).  A hook on the view's
    # base stays where it was registered, on the node that produced the base's pre-in-place
    # value, which backward still reaches before the unit's own backward; the training-state
    # check makes the second of the two calls a no-op.  Only a base that autograd produced:
    # a hook on a leaf (a view of a parameter, e.g. ``self.weight[:n]``, whose base is the
    # unit's flat parameter) would stay on it for good, one more every forward, and a leaf
    # that requires grad cannot be modified in place through a view anyway.

    def _neighbour(self, step: int) -> Optional["UnitState"]:
        root = self.root
        if self.order_index is None or root is None:
            return None
        j = self.order_index + step
        if 0 <= j < len(root.exec_order):
            return root.exec_order[j]
        return None

    # --------------------------------------------------------------- backward
    @dynamo_disable
    def _pre_backward_hook(self, grad: torch.Tensor) -> torch.Tensor:
        check_not_compiled_autograd()
        ts = self.training_state
        if ts is TrainingState.BACKWARD_PRE or (
                ts is TrainingState.BACKWARD_POST and not self.pre_backward_each_output):
            return grad  # [Note: recompute]
        root = self.root
        if root is None:
            raise AssertionError("cfsdp: backward before lazy init")
        if not root.callback_queued:
            root.callback_queued = True
            _torch_core.queue_callback(self._final_callback)
        self.training_state = TrainingState.BACKWARD_PRE
        u = self.unit
        if u is not None:
            if self.unshard_in_backward:
                u.unshard()
                with torch.enable_grad():  # backward runs without grad mode
                    u.use_forward_views()  # for a recompute in backward: [Note: recompute]
            u.take_grad_for_backward()
        if root.backward_prefetch == BACKWARD_PRE:
            self._prefetch_backward()
        return grad

    def _prefetch_backward(self) -> None:
        if self.backward_prefetch_states is not None:
            for st in self.backward_prefetch_states:
                if st.unit is not None and st.training_state not in (
                    TrainingState.BACKWARD_PRE,
                    TrainingState.BACKWARD_POST,
                ):
                    st.unit.unshard(async_op=True)
            return
        nxt = self._neighbour(-1)
        if nxt is not None and nxt.unit is not None and nxt.training_state not in (
            TrainingState.BACKWARD_PRE,
            TrainingState.BACKWARD_POST,
        ):
            nxt.unit.unshard(async_op=True)

    @dynamo_disable
    def _post_backward(self, unit: UnitContract, grad: torch.Tensor) -> None:
        check_not_compiled_autograd()
        root = self.root
        if root is None:
            raise AssertionError("cfsdp: post-backward before lazy init")
        self.training_state = TrainingState.BACKWARD_POST
        if root.backward_prefetch == BACKWARD_POST:
            self._prefetch_backward()
        self._reduce_or_keep(root, unit, grad)
        if not self.keeps_unsharded_after_backward():
            unit.reshard()

    def _reduce_or_keep(self, root: RootState, unit: UnitContract, grad: torch.Tensor) -> None:
        """Keep the unit's unsharded gradient (no sync) or issue its reduction."""
        if not self.sync_gradients:
            unit.keep_unsharded_grad(grad)
        else:
            issue_reduction(root.pending, unit, grad)

    def keeps_unsharded_after_backward(self) -> bool:
        """Whether backward leaves this unit unsharded.  The wrapper face (like
        torch's FSDP1) reshards when it syncs gradients and, under ``no_sync``,
        keeps what forward kept; the composable face says so explicitly
        (``set_reshard_after_backward``)."""
        if self.reshard_after_backward is not None:
            return not self.reshard_after_backward
        return not self.sync_gradients and not self.reshard_after_forward

    @dynamo_disable
    def _final_callback(self) -> None:
        root = self.root
        if root is None:
            raise AssertionError("cfsdp: final callback without root")
        for st in root.states:
            u = st.unit
            if u is None:
                continue
            waiting = u.take_waiting_grad()  # [Note: one post-backward per iteration] in base.py
            if waiting is not None:
                st._reduce_or_keep(root, u, waiting)
            if st.sync_gradients and st.training_state is not TrainingState.BACKWARD_POST:
                u.reduce_unreached(root.pending)  # a synchronising backward did not reach it
        while root.pending:
            root.pending.pop(0).finish()
        if root.streams is not None:
            root.streams.end_backward()
        for st in root.states:
            u = st.unit
            if u is not None:
                if not st.keeps_unsharded_after_backward():
                    u.reshard()
                else:
                    u.end_forward_views()  # the registered parameters show between steps
                if st.sync_gradients:
                    u.publish_grad()
                else:
                    u.publish_unsharded_grad()
            st.training_state = TrainingState.IDLE
        root.callback_queued = False
        root.recording = False


def lazy_init_root(root_state: UnitState, tree: list[UnitState], backward_prefetch, forward_prefetch) -> None:
    """Make ``root_state`` the root of ``tree`` (root first, then the rest)."""
    rs = RootState(backward_prefetch, forward_prefetch)
    rs.states = list(tree)
    for st in tree:
        st.is_root = st is root_state
        st.root = rs
        st.order_index = None
