"""The composable face: ``fully_shard`` with the installed torch's FSDP2 API.

``fully_shard(module)`` swaps ``module``'s class for ``FSDP<Cls>`` (a subclass of
both :class:`FSDPModule` and the original class: ``isinstance`` checks and FQNs
are unchanged), turns each parameter it manages into a ``DTensor``
(``Shard(0)``, or the ``Shard(dim)`` that ``shard_placement_fn`` returns for it;
``(Replicate(), Shard(dim))`` on a 2-D HSDP mesh) whose local tensor is a view
into the unit's shard buffer, and registers forward hooks that
drive the runtime shared with the wrapper face (``_runtime.hooks``).  The unit
itself (the per-parameter chunk layout, copy-in/copy-out in C) is
``_runtime.chunk.unit.ChunkUnit``.

What is not implemented raises ``NotImplementedError`` naming it (and is
listed in README.md).
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

import torch.distributed.fsdp as _torch_fsdp
from typing_extensions import deprecated

from ._compile import dynamo_disable
from ._docs import adopt_class_docs, adopt_function_doc
from ._fqn import full_name
from ._internals import STATE, STATE_DEFAULT, no_torch_internal
from ._torch import fsdp2 as _fsdp2
from ._torch import not_in_this_torch
from ._torch.fsdp2 import REGISTRY_KEY as _REGISTRY_KEY
from ._torch.fsdp2 import STATE_KEY as _STATE_KEY
from ._torch.fsdp2 import RegistryItem as _RegistryItem
from ._torch.fsdp2 import ShardPlacementResult
from ._torch.fsdp2 import get_registry as _get_registry
from ._runtime import device as device_layer
from ._runtime.chunk.group import chunk_units
from ._runtime.chunk.streams import CommContext
from ._runtime.chunk.param import DPMesh, local_data
from ._runtime.chunk.unit import ChunkUnit
from ._runtime.hooks import BACKWARD_PRE, UnitState, cast_floating, lazy_init_root
from ._runtime.replaced import FULLY_SHARD, check_plain_param, mark_replaced
from ._runtime.base import TrainingState, wrappers_in

_STATE_ATTR = "_cfsdp_fs_state"
_CLS_CACHE: dict[type, type] = {}


def _nyi(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"cfsdp.fully_shard: {what} is not implemented yet (see the compatibility "
        "table in README.md)."
    )


def _refuse_grad_dtype(p: torch.Tensor, fqn: str) -> None:
    """torch 2.15 reduces and accumulates a parameter's gradient in its explicit
    ``grad_dtype``; cfsdp does not yet (``NotImplementedError`` naming the parameter)."""
    if _fsdp2.has_grad_dtype_override(p):
        raise NotImplementedError(
            f"cfsdp.fully_shard: parameter '{fqn}' has grad_dtype={p.grad_dtype} set explicitly (its "
            f"dtype is {p.dtype}); torch {torch.__version__}'s fully_shard reduces and "
            "accumulates such a gradient in that dtype, which cfsdp does not do yet. Leave "
            "grad_dtype unset (the gradient follows the parameter's dtype), or set "
            "MixedPrecisionPolicy(reduce_dtype=...) for the whole module (see the "
            "compatibility table in README.md)."
        )


class MeshError(AssertionError):
    """A mesh ``fully_shard`` cannot use: torch raises ``AssertionError`` (a 2-D mesh without
    dimension names, ``_fsdp_init``), so this is one."""


class AppliedTwiceError(AssertionError):
    """``fully_shard`` applied twice to one module: torch raises ``AssertionError``;
    (``torch.distributed._composable.contract``), so this is one."""


class _FSState:
    """What one ``fully_shard`` call creates: the modules, the policy and the
    runtime state (``UnitState``) of its unit."""

    def __init__(self, modules: list[nn.Module], unit: Optional[ChunkUnit], name: str,
                 reshard_after_forward: Optional[bool], mp: MixedPrecisionPolicy):
        self.modules = modules
        self.unit = unit
        self.mp = mp
        self.auto_reshard = reshard_after_forward is None
        self.ustate = UnitState(unit, name, True if reshard_after_forward is None else reshard_after_forward)
        self.ustate.reshard_after_backward = True
        self.ustate.pre_backward_each_output = True
        self.ustate.root_reshards_after_forward = not self.auto_reshard
        self.post_optim_event = None
        self._to_run: set[int] = set()  # modules of this call yet to run forward in this pass

    # ----------------------------------------------------------------- hooks
    def lazy_init(self, module: nn.Module) -> None:
        st = self.ustate
        if st.is_root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError(
                f"FSDP requires a single root module but got {tuple(self.modules)} (cfsdp: "
                f"{len(self.modules)} modules from one fully_shard([...]) call ran forward first; "
                "apply fully_shard to their parent as well and run forward through it)"
            )
        states: list[_FSState] = []
        for name, m in module.named_modules():
            s = getattr(m, _STATE_ATTR, None)
            if s is None or s in states:
                continue
            if s is not self and s.ustate.is_root is not None:
                raise RuntimeError(
                    f"FSDP state has already been lazily initialized for {name}\nFSDP requires "
                    "running forward through the root module first (cfsdp: a forward through "
                    f"'{name}' alone made it a root; run the first forward through the model's "
                    "root module)"
                )
            states.append(s)
        # as torch: one original parameter in two units (weights tied across fully_shard
        # calls) would come untied, each unit training its own copy
        seen: dict[int, str] = {}
        fqns: Optional[dict[int, str]] = None
        for s in states:
            for q in (s.unit.params if s.unit is not None else []):
                if q.orig_uid in seen:
                    if fqns is None:
                        fqns = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
                    raise ValueError(
                        f"Parameter '{fqns.get(id(q.sharded), q.fqn)}' is shared with a parameter "
                        "already managed by another FSDP group. For shared/tied parameters, use "
                        "fully_shard([module_a, module_b]) to place them in the same FSDP group. "
                        f"(cfsdp: it is tied to '{seen[q.orig_uid]}'; put the modules holding "
                        "both in one fully_shard call, or leave them to a common parent's.)"
                    )
                if fqns is None:
                    fqns = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
                seen[q.orig_uid] = fqns.get(id(q.sharded), q.fqn)
        for s in states:  # take over parameters materialised or replaced since fully_shard
            if s.unit is not None:
                s.unit.reset_sharded_params()
                for q in s.unit.params:  # (torch 2.15 reads grad_dtype until here)
                    _refuse_grad_dtype(q.sharded, q.fqn)
        for s in states:  # as torch, unit by unit, the root's first
            on_meta = s.unit.meta_param_names(module) if s.unit is not None else []
            if not on_meta:
                continue
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {on_meta}\n"
                "For example, call module.to_empty(device) to materialize to device and "
                "call module.reset_parameters() on each module to initialize values."
            )
        lazy_init_root(st, [s.ustate for s in states], BACKWARD_PRE, False)
        units = [s.unit for s in states if s.unit is not None]
        ctx = CommContext(st, units[0].device if units else torch.device("cpu"))
        st.root.streams = ctx
        for s in states:
            s.ustate.fs_state = s  # type: ignore[attr-defined]
        for u in units:
            u._comm = ctx

    @dynamo_disable
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        st = self.ustate
        if st.training_state is TrainingState.BACKWARD_PRE:  # activation-checkpoint recompute
            return self._cast_inputs(args, kwargs)
        if st.training_state is TrainingState.SUMMON:
            raise RuntimeError("fully_shard: forward was called while the module is being unsharded.")
        first = st.training_state is not TrainingState.FORWARD
        if first:
            self.lazy_init(module)
            if st.is_root:
                event, self.post_optim_event = self.post_optim_event, None
                # with streams the all-gather streams wait for it ([Note: stream protocol])
                if not st.root.streams.begin_forward(event) and event is not None:
                    _wait_event_on_current_stream(event)
            self._to_run = {id(m) for m in self.modules}
        args, kwargs = self._cast_inputs(args, kwargs)
        st.pre_forward()
        return args, kwargs

    @dynamo_disable
    def post_forward(self, module: nn.Module, output: Any) -> Any:
        st = self.ustate
        if st.training_state is TrainingState.BACKWARD_PRE:
            return self._cast_output(output)
        self._to_run.discard(id(module))
        if not self._to_run:
            output = st.post_forward(output)
        else:
            st._register_pre_backward(output)
        return self._cast_output(output)

    def _cast_inputs(self, args: tuple, kwargs: dict):
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            return cast_floating(self.mp.param_dtype, (args, kwargs))
        return args, kwargs

    def _cast_output(self, output: Any) -> Any:
        if self.mp.output_dtype is None:
            return output
        return cast_floating(self.mp.output_dtype, output)

    def check_idle(self, what: str) -> None:
        ts = self.ustate.training_state
        if ts is not TrainingState.IDLE:
            raise RuntimeError(
                f"fully_shard: {what} was called while the module is in {ts.name} "
                "(inside forward/backward); call it between training steps."
            )

    # ---------------------- torch's FSDPState names that mean something here (_internals.py)
    # FSDPModule._set_unshard_async_op's value (torch's FSDPParamGroup.unshard_async_op)
    unshard_async_op: bool = False

    @property
    def _is_root(self) -> Optional[bool]:
        """torch's ``FSDPState._is_root``: None until lazy initialisation (the first forward,
        or :meth:`_lazy_init`), then whether this call's state is the root."""
        return self.ustate.is_root

    def _lazy_init(self) -> None:
        """torch's ``FSDPState._lazy_init()``: what the first forward through this call's
        module does first (this state becomes the root of the ``fully_shard`` calls below
        it); a no-op once initialised."""
        self.lazy_init(self.modules[0])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise no_torch_internal(type(self).__name__, name, "FSDPState",
                                STATE.get(name, STATE_DEFAULT))


def _state(module: nn.Module) -> _FSState:
    s = getattr(module, _STATE_ATTR, None)
    if s is None:
        raise AssertionError(
            f"No FSDP state found on {module} (cfsdp: call fully_shard on the module first.)"
        )
    return s


def _fs_modules(module: nn.Module, recurse: bool) -> list[nn.Module]:
    if not recurse:
        return [module]
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class FSDPModule:
    """Mixed into ``FSDP<Cls>``: the methods torch's FSDP2 adds to a module."""

    def __new__(cls, *args: Any, **kwargs: Any):
        # FSDP<Cls>(...) builds a plain Cls, as torch (fully_shard makes FSDP<Cls>)
        orig = cls.__mro__[2]
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo):
        raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")

    def _get_fsdp_state(self) -> _FSState:
        """torch's private accessor: the state of the ``fully_shard`` call this module was
        given to, ``fully_shard.state(self)`` (cfsdp's state object: its ``_is_root`` and
        ``_lazy_init()`` are torch's, any other torch ``FSDPState`` attribute is an
        ``AttributeError`` saying what to use instead)."""
        return _state(self)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """torch's private switch for every ``fully_shard`` module in this module's tree: with
        True torch issues the pre-forward and pre-backward all-gathers as asynchronous ops
        (on CPU its default, False, makes each prefetch wait for its all-gather).  cfsdp
        always issues them asynchronously, in order, and waits when the unit runs, so the
        value is recorded (``_get_fsdp_state().unshard_async_op``) and changes no number,
        as on torch."""
        for m in _fs_modules(self, True):
            _state(m).unshard_async_op = async_op

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``module.to(...)``, ``.double()``, ``.half()``, ``to_empty``: as torch, reshard
        first (the sharded parameters are the registered ones), apply, then the unit takes
        over what changed: new values, new parameter objects, or a new dtype."""
        s = _state(self)
        if s.unit is not None:
            s.check_idle("module._apply (to / double / half / to_empty)")
            s.unit.reshard()
        ret = super()._apply(*args, **kwargs)  # type: ignore[misc]
        if s.unit is not None:
            with torch.no_grad():
                s.unit.reset_sharded_params()
        return ret

    def unshard(self, async_op: bool = False) -> Optional["UnshardHandle"]:
        """All-gather this module's parameters (``async_op=True``: return a handle to
        ``wait()`` on, and the forward waits for it if not waited before)."""
        s = _state(self)
        if s.unit is None:
            return UnshardHandle(None) if async_op else None
        s.unit.unshard(async_op=True)
        handle = UnshardHandle(s)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters; the module sees its DTensor shards again."""
        s = _state(self)
        if s.unit is not None:
            s.unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps unreduced gradients (gradient accumulation without
        communication) until a backward with True.  As torch's, it sets HSDP's
        ``set_requires_all_reduce`` to the same value: a True after
        ``set_requires_all_reduce(False)`` all-reduces again."""
        for m in _fs_modules(self, recurse):
            st = _state(m)
            st.ustate.sync_gradients = bool(requires_gradient_sync)
            if st.unit is not None:
                st.unit.requires_all_reduce = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether backward all-reduces the reduce-scattered gradients across
        replicas. False: each backward's reduced shard is summed aside, and the gradients
        are left as they are, until a backward with True all-reduces the sum (torch's
        FSDP2 semantics; on a 1-D mesh there is nothing to all-reduce)."""
        for m in _fs_modules(self, recurse):
            u = _state(m).unit
            if u is not None:
                u.requires_all_reduce = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for m in _fs_modules(self, recurse):
            st = _state(m).ustate
            st.reshard_after_forward = reshard_after_forward
            st.root_reshards_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for m in _fs_modules(self, recurse):
            _state(m).ustate.reshard_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        _check_fsdp_modules(modules, "Expects FSDPModule but got {cls}: {m}")
        _state(self).ustate.forward_prefetch_states = [_state(m).ustate for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        _check_fsdp_modules(modules, "Expects FSDPModule but got {cls}: {m}")
        _state(self).ustate.backward_prefetch_states = [_state(m).ustate for m in modules]

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The root's next forward waits for ``event`` before its all-gathers."""
        _state(self).post_optim_event = event

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This module's unit only, as torch (not its FSDP submodules: call it on each)."""
        self._set_reduction(gradient_divide_factor=float(factor))

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """This module's unit only, as torch (not its FSDP submodules: call it on each)."""
        self._set_reduction(force_sum_reduction=bool(enable))

    def _set_reduction(self, **attrs: Any) -> None:
        """Set reduction attributes on this module's unit and rederive its ops.  torch's
        setters take ``self._get_fsdp_state()``'s parameter groups only, with no
        ``recurse``: a factor set on the root leaves its submodules' units as they were."""
        u = _state(self).unit
        if u is not None:
            for k, v in attrs.items():
                setattr(u, k, v)
            u.update_divide_factors()

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward does not all-gather this module's parameters (for modules
        whose backward needs no parameter values, e.g. an embedding)."""
        _state(self).ustate.unshard_in_backward = bool(unshard_in_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for compatibility: cfsdp finishes every gradient reduction at
        the end of each backward, so there is nothing to defer (on CPU torch has no
        stream to defer it on either)."""
        _state(self)  # as torch: only on a module fully_shard was applied to

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        """``hook(reduced)`` on each unit's reduced gradient shard (in ``reduce_dtype``,
        before any post-divide) of this module's unit: after the HSDP all-reduce, or
        after the reduce-scatter on a 1-D mesh.  cfsdp runs it synchronously in backward,
        with ``stream`` (if given) as the device's current stream, as torch does, ordered
        both ways: ``stream`` first waits for the stream the reduction's result was made
        on (torch: ``all_reduce_stream.wait_stream(reduce_scatter_stream)``), and that
        stream, where cfsdp post-divides and accumulates the result, then waits for
        ``stream`` (torch does those on ``stream`` itself); the result is recorded on
        ``stream`` for the caching allocator."""
        u = _state(self).unit  # this module's unit only, as torch
        if u is None:
            return
        if stream is not None and u.replicate_group is not None:
            raise ValueError("stream cannot be set when using native HSDP")
        if stream is not None:
            hook = _on_stream(hook, stream)

        u.all_reduce_hook = hook

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: wait for collectives in
        flight, reshard every unit, drop the failed iteration's gradients (reductions
        in flight and unreduced accumulations) and per-iteration state.  Call it on
        the root."""
        st = _state(self).ustate
        if st.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        root = st.root
        if root is None:
            return
        for p in root.pending:
            p.pending.wait()
        root.pending.clear()
        if root.streams is not None:  # as torch: the current stream waits, held buffers go
            root.streams.end_backward()
        root.callback_queued = False
        root.exec_order.clear()
        root.recording = True
        for s in root.states:
            s.order_index = None
            s.training_state = TrainingState.IDLE
            s.fs_state._to_run.clear()
            u = s.unit
            if u is not None:
                u.drop_iteration()

    def _only_default(self, is_default: bool, what: str) -> None:
        """A setting of torch's where cfsdp does only the default: checked on a module
        ``fully_shard`` was applied to, ``NotImplementedError`` naming ``what`` otherwise."""
        _state(self)
        if not is_default:
            raise _nyi(what)

    @deprecated("Use `set_gradient_divide_factor` instead")
    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's deprecated name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """torch 2.13+: ``True`` reduces zero gradients for this module's (and, with
        ``recurse``, its FSDP submodules') trainable parameters that got none in a
        backward, so ranks whose control flow left a parameter unused take part in the
        reduction and get the other ranks' gradients; each such parameter's ``.grad`` is
        then a tensor (zeros where no rank used it), as torch's, which an optimizer steps
        (weight decay).  ``False`` (the default): a parameter no rank used keeps ``.grad``
        as it was (None after ``zero_grad()``).  See [Note: unused parameters] in
        ``_runtime/chunk/grads.py``."""
        for m in _fs_modules(self, recurse):
            u = _state(m).unit
            if u is not None:
                u.reduce_scatter_unused_params = bool(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """torch: how many reduce-scatter input buffers may be in flight (a CUDA memory and
        overlap dial).  cfsdp keeps one, torch's default: ``1`` is that, more is not
        implemented yet; torch's errors for a value that is no positive int."""
        if not isinstance(max_input_buffers, int) or isinstance(max_input_buffers, bool):
            raise TypeError("max_input_buffers must be an int, got "
                            f"{type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        self._only_default(max_input_buffers == 1,
                           f"FSDPModule.set_reduce_scatter_max_input_buffers({max_input_buffers}) "
                           "(cfsdp keeps one reduce-scatter input in flight, torch's default)")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """torch: run the reduce-scatters on a process group of their own (overlap with the
        all-gathers).  cfsdp issues both on one group, torch's default: ``False`` is that,
        ``True`` is not implemented yet."""
        self._only_default(not enable, "FSDPModule.set_separate_reduce_scatter_group(True) "
                           "(cfsdp issues reduce-scatters and all-gathers on one group, torch's "
                           "default)")

    def set_custom_all_gather(self, comm: Any) -> None:
        """torch: a user-defined all-gather (``AllGather``).  Not implemented yet."""
        self._only_default(False, "FSDPModule.set_custom_all_gather (cfsdp's all-gather is "
                           "its own C pass over shared memory or the process group)")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """torch: a user-defined reduce-scatter (``ReduceScatter``).  Not implemented yet."""
        self._only_default(False, "FSDPModule.set_custom_reduce_scatter (cfsdp's "
                           "reduce-scatter is its own C pass over shared memory or the process "
                           "group)")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """torch: the collectives' staging buffers from the process group's allocator (NCCL
        zero-copy).  cfsdp allocates them itself, torch's default: ``False`` is that,
        ``True`` is not implemented yet."""
        self._only_default(not enable,
                           "FSDPModule.set_allocate_memory_from_process_group_for_comm(True)")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """torch: NCCL symmetric memory for the all-gathers' staging buffers.  Not
        implemented yet (an NCCL feature; cfsdp has not run on a GPU)."""
        self._only_default(False, f"FSDPModule.set_symm_mem_for_comm({backend!r})")

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """torch 2.15: keep the unsharded parameters' storage (and its addresses) across
        reshard and unshard, for CUDA graph capture.  cfsdp frees it at every reshard,
        torch's default: ``keep=False`` is that, ``True`` is not implemented yet."""
        self._only_default(not keep, "FSDPModule.set_keep_unsharded_storage(True) (cfsdp "
                           "frees the unsharded storage at every reshard, torch's default)")

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """torch 2.15: the caller finalizes backward (:meth:`finalize_backward`) instead of
        the end of each backward.  cfsdp finalizes at the end of each backward, torch's
        default: ``enabled=False`` is that, ``True`` is not implemented yet."""
        if _state(self).ustate.is_root is False:
            raise RuntimeError("set_manual_backward_finalization must be called on the root "
                               "FSDP module")
        self._only_default(not enabled, "FSDPModule.set_manual_backward_finalization(True) "
                           "(cfsdp finalizes every backward itself, torch's default)")

    def finalize_backward(self, *, async_op: bool = False) -> Any:
        """torch 2.15: finish backward by hand, after ``set_manual_backward_finalization(
        True)``.  As torch's without it: nothing before the first forward (a handle whose
        ``wait()`` does nothing with ``async_op``), else torch's ``RuntimeError``."""
        st = _state(self).ustate
        if st.is_root is None:
            return _fsdp2.GradientReductionHandle() if async_op else None
        if not st.is_root:
            raise RuntimeError("finalize_backward must be called on the root FSDP module")
        raise RuntimeError("FSDP finalize_backward requires manual backward finalization. Call "
                           "set_manual_backward_finalization(True) before forward")


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``: ``wait()`` for the all-gather."""

    def __init__(self, state: Optional[_FSState]):
        self._state = state

    def wait(self) -> None:
        s = self._state
        if s is not None and s.unit is not None:
            s.unit.wait_unshard()
            s.unit.use_forward_views()
        self._state = None


def _check_fsdp_modules(modules: Any, torch_message: str) -> None:
    """Every entry a module ``fully_shard`` was applied to; ``torch_message`` is what
    torch's check for the calling function says of a bad entry (``{cls}``, ``{m}``)."""
    if not isinstance(modules, (list, tuple)):
        raise ValueError(f"Expects list of FSDPModules but got {modules}")
    for i, m in enumerate(modules):
        if not isinstance(m, FSDPModule):
            raise ValueError(
                torch_message.format(cls=type(m), m=m)
                + f" (cfsdp: entry {i} is a {type(m).__name__} that fully_shard was not applied "
                "to; pass modules given to fully_shard.)"
            )


# The default group's 1-D mesh, made once per group and device type: every
# fully_shard call without a mesh shares it (torch makes an equal mesh per call;
# building one is a third of wrapping a model on the meta device).
_DEFAULT_MESHES: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict]" = weakref.WeakKeyDictionary()


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        # as torch: the default group from the environment (torchrun's variables)
        try:
            dist.init_process_group()
        except ValueError as e:  # no torchrun environment: torch's message, then what to do
            raise ValueError(
                f"{e} (cfsdp: fully_shard without a mesh initialises the default process "
                "group from torchrun's environment variables, and they are not set; launch "
                "with torchrun, or call torch.distributed.init_process_group(...) or pass "
                "mesh= before fully_shard)"
            ) from e
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    per_device = _DEFAULT_MESHES.setdefault(dist.distributed_c10d._get_default_group(), {})
    mesh = per_device.get(dev)
    if mesh is None:
        mesh = per_device[dev] = init_device_mesh(dev, (dist.get_world_size(),))
    return mesh


def _managed(modules: list[nn.Module], ignored: set) -> tuple[list[nn.Module], list]:
    """The modules this call manages (not below another fully_shard) and its
    parameters in torch's order, each with every (module, name) it appears under."""
    roots = set(modules)
    managed: list[nn.Module] = []
    seen: set[nn.Module] = set()

    def dfs(m: nn.Module) -> None:
        if m not in roots and (getattr(m, _STATE_ATTR, None) is not None
                               or "replicate" in (_get_registry(m) or ())):
            return  # another unit's, or torch's replicate's (as torch skips them)
        seen.add(m)
        for c in m.children():
            if c not in seen:
                dfs(c)
        managed.append(m)

    for m in modules:
        dfs(m)
    occurrences: dict[nn.Parameter, list] = {}
    order: list[nn.Parameter] = []
    for m in managed:
        for name, p in m._parameters.items():
            if p is None or p in ignored:
                continue
            if p not in occurrences:
                occurrences[p] = []
                order.append(p)
            occurrences[p].append((m, name))
    return managed, [(p, occurrences[p]) for p in order]


class PlacementError(ValueError):
    """A ``shard_placement_fn`` result torch rejects as invalid (``ValueError``); cfsdp's
    error is one."""


class PlacementAttributeError(AttributeError):
    """torch 2.11: a ``shard_placement_fn`` result without ``.dim`` (``AttributeError``)."""


class PlacementAssertionError(AssertionError):
    """torch 2.11: a ``shard_placement_fn`` result with ``.dim`` that is not a ``Shard``."""


_PLACEMENT_ERRORS = {ValueError: PlacementError, AttributeError: PlacementAttributeError,
                     AssertionError: PlacementAssertionError}


class ShardDimError(AssertionError):
    """``Shard(dim)`` past the parameter's dimensions: torch raises ``AssertionError``;
    (``FSDPParam._init_sharded_param``), so this is one."""


def _check_placement_result(pl: Any, fqn: str) -> None:
    """A result of a type torch rejects is torch's error (torch 2.13+ resolves every
    parameter's result before any other per-parameter check: ``ValueError``; 2.11 one
    parameter at a time: ``AttributeError`` or ``AssertionError``)."""
    err = _fsdp2.placement_result_error(pl)
    if err is not None:
        torch_type, message = err
        raise _PLACEMENT_ERRORS[torch_type](
            f"{message} (cfsdp: the result for '{fqn}'; return None or a Shard(dim))")


def _shard_dim(pl: Any, p: nn.Parameter, fqn: str, shard_size: int,
               hsdp: bool) -> Union[int, NotImplementedError]:
    """The dim ``p`` is sharded on by the ``shard_placement_fn`` result ``pl`` (None:
    0; ``Shard(d)``, ``d < 0`` meaning ``d + ndim``; a ``ShardPlacementResult`` comes
    resolved, its placement here and its mesh's ``shard_size``), with torch's errors for the
    dims it rejects (past the end; uneven on a dim other than 0; still negative after adding
    ``ndim``), in torch's order.  A result torch accepts that cfsdp cannot use (a ``Shard``
    subclass) is returned as cfsdp's ``NotImplementedError``, for the caller to raise once
    no parameter has an error torch would raise first."""
    if pl is None:
        return 0
    dim = pl.dim + p.dim() if pl.dim < 0 else pl.dim
    if not isinstance(pl, Shard):  # torch 2.11 takes Shard(dim + ndim) for such a result
        pl = Shard(dim)
    if dim >= p.dim():
        raise ShardDimError(
            f"Shard dim {dim} is invalid for {p.dim()}D tensor: {p.shape} (cfsdp: the parameter "
            f"is '{fqn}'; return Shard(d) with -{p.dim()} <= d < {p.dim()} for it)"
        )
    data = local_data(p)  # a tensor-parallel parameter: its local tensor is what is sharded
    if dim > 0 and data.size(dim) % shard_size != 0:
        raise NotImplementedError(
            f"FSDP does not support uneven sharding on dim {dim}: {data.size()} (world size: "
            f"{shard_size}) (cfsdp: the parameter is '{fqn}'; shard it on dim 0, where chunks "
            f"may be uneven, or on a dim whose size {shard_size} divides)"
        )
    if dim < 0:
        placements = (Replicate(), Shard(dim)) if hsdp else (Shard(dim),)
        raise ShardDimError(
            f"Shard dim {dim} in placements {placements} must be normalized (cfsdp: the "
            f"parameter '{fqn}' has {p.dim()} dims; return Shard(d) with -{p.dim()} <= d < "
            f"{p.dim()} for it)"
        )
    if type(pl) is not Shard:
        return _nyi(f"shard_placement_fn returning {pl} for '{fqn}' (a Shard subclass)")
    return dim


def _check_dp_mesh_dims(mesh: DeviceMesh, dims: Any) -> None:
    """torch's checks of ``dp_mesh_dims`` against the mesh (``_validate_mesh``)."""
    if dims.shard is None and dims.replicate is None:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    if mesh.mesh_dim_names is None:
        raise ValueError(
            "mesh must have mesh_dim_names when dp_mesh_dims is provided (cfsdp: build the "
            "SPMD mesh with names, e.g. init_device_mesh(device, (dp, tp), "
            "mesh_dim_names=('dp', 'tp')))")
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in mesh.mesh_dim_names:
            raise ValueError(
                f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {mesh.mesh_dim_names}")
    if len(dims.shard_names) > 1 and not _fsdp2.FLATTENS_SHARD_DIMS:
        raise not_in_this_torch(
            f"cfsdp's fully_shard with dp_mesh_dims naming several shard dims "
            f"{tuple(dims.shard_names)} (this torch places their parameters on the unflattened "
            "SPMD mesh, cfsdp as 2.13+ on one flattened dim; name one shard dim, or use torch "
            "2.13+)", "2.13")


# one group of this rank alone per process: torch's DDP mode of dp_mesh_dims (no shard dim)
# shards over one rank; cfsdp's unit does that over a group of one (no collective: comm.py)
_SOLO: dict[str, dist.ProcessGroup] = {}


def _solo_group() -> dist.ProcessGroup:
    key = str(dist.get_rank())
    g = _SOLO.get(key)
    if g is None:
        g = _SOLO[key] = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return g


def _dp_mesh(info: Any) -> DPMesh:
    """cfsdp's view of one of torch's mesh infos (``fully_shard``'s mesh, or a
    ``ShardPlacementResult``'s)."""
    spmd = _fsdp2.spmd_of(info)
    spmd_kw = {} if spmd is None else dict(spmd_mesh=spmd[0], shard_names=spmd[1],
                                            replicate_names=spmd[2])
    rep = info.replicate_process_group if isinstance(info, _fsdp2.DDPMeshInfo) else None
    if isinstance(info, _fsdp2.FSDPMeshInfo):
        return DPMesh(info.mesh, info.shard_process_group, rep, **spmd_kw)
    if not isinstance(info, _fsdp2.DDPMeshInfo):
        raise TypeError(f"expected one of torch's FSDP mesh infos, got {type(info).__name__}")
    return DPMesh(info.mesh, _solo_group(), rep, **spmd_kw)


def _post_forward(reshard_after_forward: Union[bool, int],
                  dp: DPMesh) -> tuple[bool, Optional[dist.ProcessGroup]]:
    """torch's ``_get_post_forward_mesh_info`` for a mesh: whether to reshard after forward,
    and for an int ``k`` between 1 and the shard size the group of ``k`` consecutive ranks
    of the (flattened) data-parallel mesh that backward gathers over (every rank creates
    every such group)."""
    shard_size = dp.group.size()
    if not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(
            "reshard_after_forward should be a bool or an int representing the "
            f"group size to reshard to, not {reshard_after_forward}"
        )
    if isinstance(reshard_after_forward, bool):
        return reshard_after_forward, None
    n = reshard_after_forward
    if n < 1 or n > shard_size or shard_size % n != 0:
        raise ValueError(
            "If passing reshard_after_forward as an int, it should be a "
            f"factor of {shard_size}, not {n}"
        )
    if n == 1:
        return False, None
    if n == shard_size:
        return True, None
    return True, DeviceMesh(dp.mesh.device_type, dp.mesh.mesh.view(-1, n)).get_group(1)


class _ParamMeshes:
    """Each parameter's mesh in one ``fully_shard`` call: ``fully_shard``'s, or the one a
    ``ShardPlacementResult`` names (torch groups parameters by their process groups, one
    mesh info object per pair)."""

    def __init__(self, info: Any, dp: DPMesh):
        self.default_info, self.default = info, dp
        self._by_pg: dict[tuple, tuple[Any, DPMesh]] = {}
        self._of: dict[nn.Parameter, DPMesh] = {}

    def resolve(self, p: nn.Parameter, result: Any, fqn: str) -> Any:
        """The placement of a ``shard_placement_fn`` result, noting the parameter's mesh
        (torch's ``resolve_shard_placement`` and ``_init_param_group``'s grouping)."""
        if ShardPlacementResult is None or not isinstance(result, ShardPlacementResult):
            info, pl = self.default_info, result
        else:
            info, pl = result.mesh_info, result.placement
            if not isinstance(info, _fsdp2.FSDPMeshInfo):
                raise TypeError(
                    f"ShardPlacementResult.mesh_info must be an FSDPMeshInfo (or HSDPMeshInfo), "
                    f"got {type(info).__name__} (cfsdp: the result for '{fqn}')")
        rep = info.replicate_process_group if isinstance(info, _fsdp2.HSDPMeshInfo) else None
        key = (info.shard_process_group, rep)
        have = self._by_pg.get(key)
        if have is None:
            have = self._by_pg[key] = (info, self.default if info is self.default_info
                                       else _dp_mesh(info))
        elif have[0] is not info:
            raise ValueError(
                "Params sharing the same process group must use the same FSDPMeshInfo object, "
                f"but got different objects: {have[0]} vs {info} (cfsdp: the result for "
                f"'{fqn}'; build one mesh info per mesh and return it for each of its "
                "parameters)")
        self._of[p] = have[1]
        return pl

    def of(self, p: nn.Parameter) -> DPMesh:
        return self._of.get(p, self.default)

    def others(self) -> list[DPMesh]:
        """The meshes other than ``fully_shard``'s that some parameter is on."""
        return [dp for _, dp in self._by_pg.values() if dp is not self.default]


def _check_spmd_param(p: nn.Parameter, name: str, fqn: str, dp: DPMesh) -> None:
    """With ``dp_mesh_dims``, torch's checks of a parameter (``_init_sharding_spec``): a
    DTensor on the very mesh given to ``fully_shard``, ``Replicate()`` on every
    data-parallel dim."""
    if dp.spmd_mesh is None:
        return
    if not isinstance(p, DTensor):
        raise ValueError(
            "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD "
            f"mesh (e.g. via distribute_module). Got plain tensor for parameter '{name}'. "
            f"(cfsdp: the parameter is '{fqn}'; distribute it on {dp.spmd_mesh} with "
            "Replicate() on the data-parallel dims, or leave it out with ignored_params.)")
    mesh = p.device_mesh
    if mesh is not dp.spmd_mesh:
        raise ValueError(
            "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got "
            f"different mesh objects (cfsdp: '{fqn}' is on {mesh}, fully_shard was given "
            f"{dp.spmd_mesh}; distribute the parameters on the mesh object given to "
            "fully_shard)")
    for role, names in (("shard", dp.shard_names), ("replicate", dp.replicate_names)):
        for n in names:
            i = mesh.mesh_dim_names.index(n)
            if not isinstance(p.placements[i], Replicate):
                raise ValueError(
                    f"Expected Replicate() on DP {role} dim '{n}' (index {i}) but got "
                    f"{p.placements[i]} (cfsdp: the parameter is '{fqn}')")


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[Union[bool, int]] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Optional[set[nn.Parameter]] = None,
    **kwargs: Any,
):
    """Shard ``module``'s parameters across ``mesh`` (the installed torch's ``fully_shard``:
    ``kwargs`` are the arguments torch added after 2.11, those this torch has; see
    ``cfsdp/_torch/fsdp2.py``).

    Apply it bottom-up (each block, then the root).  Returns ``module`` (its
    class is now ``FSDP<Cls>``).

    Three steps, as torch FSDP2's ``_fsdp_init.py`` separates them, each raising in
    torch's order: :func:`_validate_call` (the modules, mesh and policies; the mesh
    infos and the post-forward reshard), :func:`_discover` (which modules and parameters
    this call manages, each parameter checked and given its mesh and shard dim) and
    :func:`_install` (the unit, the modules' state, hooks and classes)."""
    newer = _fsdp2.newer_kwargs(kwargs)  # torch's TypeError for an argument this torch lacks
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    call = _validate_call(modules, mesh, newer.get("dp_mesh_dims"), reshard_after_forward,
                          mp_policy, offload_policy)
    found = _discover(modules, call, set(ignored_params or ()), shard_placement_fn)
    _install(modules, call, found, mp_policy)
    return module


class _Call(NamedTuple):
    """What :func:`_validate_call` settles of one ``fully_shard`` call."""

    mesh: DeviceMesh
    device: torch.device
    info: Any  # torch's mesh info (dp_mesh_dims: the data-parallel dims, flattened)
    default_dp: DPMesh
    sharded: bool  # an FSDP mesh info; else torch's DDP mode (no shard dim)
    raf_arg: Optional[Union[bool, int]]  # reshard_after_forward as given
    reshard_after_forward: Optional[bool]
    post_forward_group: Optional[dist.ProcessGroup]


class _Found(NamedTuple):
    """What :func:`_discover` finds: the managed modules; per parameter ``(owner module,
    name, fqn, parameter, further (module, name) occurrences)``; the dims of parameters
    not sharded on dim 0; each parameter's mesh."""

    managed: list
    entries: list
    shard_dims: dict
    meshes: "_ParamMeshes"


def _validate_call(modules: list, mesh: Optional[DeviceMesh], dp_mesh_dims: Any,
                   reshard_after_forward: Optional[Union[bool, int]],
                   mp_policy: Any, offload_policy: Any) -> _Call:
    """Validation: the modules (not wrapped, not given to ``fully_shard`` before), the mesh
    (the default one when none is given) and the policies; then the mesh info, the
    device and the post-forward reshard (torch's ``_get_post_forward_mesh_info``)."""
    if not modules:
        raise ValueError("fully_shard needs at least one module")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}")
        if _fsdp2.refuses_container(m):  # torch 2.11: every ModuleList / ModuleDict
            raise ValueError(f"fully_shard does not support containers that do not implement forward: {m}")
        wrapped = set(wrappers_in(m))
        for name, sub in m.named_modules():
            if sub in wrapped:
                where = f"'{name}'" if name else "the module itself"
                raise ValueError(
                    f"fully_shard cannot be applied to {type(m).__name__}: {where} is already "
                    "wrapped by cfsdp.FullyShardedDataParallel. Use one face per model."
                )
        if getattr(m, _STATE_ATTR, None) is not None or "fully_shard" in (_get_registry(m) or ()):
            raise AppliedTwiceError(
                "Each distinct composable distributed API can only be applied to a module "
                f"once. fully_shard has already been applied to the following module:\n{m}\n"
                "(cfsdp: apply it once per module; fully_shard([a, b]) groups several modules "
                "in one unit)"
            )
    mesh = mesh if mesh is not None else _default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if dp_mesh_dims is not None:
        _check_dp_mesh_dims(mesh, dp_mesh_dims)
    elif mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    elif mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise MeshError(
            "Please init the 2D mesh for HSDP with mesh_dim_names specified (cfsdp: e.g. "
            "init_device_mesh(device, (replicas, shards), mesh_dim_names=('replicate', 'shard')))"
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if _fsdp2.param_dtype_override_fn(mp_policy) is not None:
        raise _nyi("MixedPrecisionPolicy(param_dtype_override_fn=...) (torch 2.15's "
                   "per-parameter param_dtype; give the parameters to keep in their own dtype "
                   "a fully_shard call of their own with its own mp_policy)")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}")
    device = torch.device(mesh.device_type) if mesh.device_type == "cpu" else torch.device(
        mesh.device_type, torch.get_device_module(mesh.device_type).current_device()
    )
    if isinstance(offload_policy, CPUOffloadPolicy) and device.type != "cpu":
        raise _nyi("CPUOffloadPolicy on a non-CPU device")
    # torch's mesh info (dp_mesh_dims: the data-parallel dims of the SPMD mesh, flattened)
    info = _fsdp2.mesh_info(mesh, dp_mesh_dims)
    default_dp = _dp_mesh(info)
    sharded = isinstance(info, _fsdp2.FSDPMeshInfo)  # else torch's DDP mode (no shard dim)
    raf_arg = reshard_after_forward
    post_forward_group = None
    if not sharded:  # as torch: no post-forward mesh, so never resharded after forward
        reshard_after_forward = False
    else:
        if default_dp.spmd_mesh is not None and not isinstance(reshard_after_forward, bool) \
                and isinstance(reshard_after_forward, int):
            raise NotImplementedError(
                "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)")
        if reshard_after_forward is not None:
            reshard_after_forward, post_forward_group = _post_forward(reshard_after_forward,
                                                                      default_dp)
    return _Call(mesh, device, info, default_dp, sharded, raf_arg, reshard_after_forward,
                 post_forward_group)


def _on_stream(hook: Callable[[torch.Tensor], None], stream) -> Callable[[torch.Tensor], None]:
    """``set_all_reduce_hook``'s ``hook`` run on ``stream``, ordered after the work that
    made its argument and before the work that reads it next (both on the current stream
    of ``stream``'s device, as its device layer gives it: [Note: device layer])."""
    device = getattr(stream, "device", None)  # (torch.cpu.Stream has none)
    device = torch.device("cpu") if device is None else torch.device(device)
    device_module = torch.get_device_module(device.type)

    def on_stream(output: torch.Tensor) -> None:
        layer = device_layer.layer_for(device)
        if not layer.has_streams:  # CPU work is synchronous: nothing to order
            with device_module.stream(stream):
                hook(output)
            return
        current = layer.current_stream()
        stream.wait_stream(current)  # the reduced gradient is ready
        with layer.on(stream):
            hook(output)
        if output.device.type == device.type:
            layer.record_stream(output, stream)  # not reused while the hook's kernels read it
        current.wait_stream(stream)  # the post-divide and accumulation come after the hook

    return on_stream


def _wait_event_on_current_stream(event: torch.Event) -> None:
    """``set_post_optim_event``'s wait, as torch's FSDP2 (its all-gather streams
    ``wait_event``): the stream cfsdp issues the root's all-gathers from (the current one)
    waits for ``event`` on the device, the CPU does not block.  A CPU event (torch has none
    that records) is waited for on the CPU."""
    if event.device.type == "cpu" and device_layer.layer_for(event.device) is device_layer.NO_STREAMS:
        event.synchronize()
        return
    device_layer.layer_for(event.device).current_stream().wait_event(event)


def _states_to_move(managed: list[nn.Module], params: list, device: torch.device) -> list:
    """The managed parameters and buffers torch's ``fully_shard`` moves to the mesh's device
    (``_move_states_to_device``): those on another device, but not meta ones (deferred
    initialisation) and not DTensors (tensor parallelism: on their own mesh's device, or
    torch's error, raised by ``_move_states``)."""
    buffers = [b for m in managed for b in m.buffers(recurse=False)]
    return [t for t in [p for p, _ in params] + buffers
            if t.device != device and t.device.type != "meta"]


def _move_states(tensors: list, device: torch.device) -> None:
    """Move ``tensors`` (``_states_to_move``) to ``device`` as torch's ``fully_shard`` does
    (``nn.Module._apply``'s ``.data``); a DTensor whose mesh is of another device type is
    torch's ``ValueError``."""
    for t in tensors:
        if isinstance(t, DTensor):
            if t.device_mesh.device_type != device.type:
                raise ValueError(
                    "Requires DTensor to have mesh of the same type as the FSDP mesh but got "
                    f"{t.device_mesh.device_type} for DTensor and {device.type} for FSDP")
            continue  # on its mesh's device: checked per parameter later
        with torch.no_grad():
            t.data = t.to(device)


def _discover(modules: list, call: _Call, ignored: set,
              shard_placement_fn: Optional[Callable[[nn.Parameter], Any]]) -> _Found:
    """Discovery: the modules and parameters this call manages (:func:`_managed`, torch's
    ``_get_managed_states``), every parameter checked as torch checks it (in torch's
    order: scalars first, then the placements, then each parameter's own checks) and
    given its mesh (``ShardPlacementResult``) and shard dim (``shard_placement_fn``)."""
    managed, params = _managed(modules, ignored)
    _move_states(_states_to_move(managed, params, call.device), call.device)
    fqn_of = {p: n for n, p in modules[0].named_parameters(remove_duplicate=False)}
    entries = []
    not_implemented: Optional[NotImplementedError] = None
    for p, occ in params:  # as torch, every parameter before the per-parameter checks
        if p.dim() == 0:
            raise ValueError(
                "fully_shard doesn't support scalar parameters. "
                f"Change {occ[0][1]} to a 1D tensor with numel equal to 1. (cfsdp: the parameter "
                f"is '{full_name(*occ[0], known=fqn_of.get(p, occ[0][1]))}'; e.g. "
                "nn.Parameter(torch.tensor([v])), or pass it in ignored_params.)"
            )
    if shard_placement_fn is not None and not call.sharded:
        raise ValueError(
            "Per-param mesh via shard_placement_fn is not supported with "
            f"{type(call.info).__name__}; it requires FSDPMeshInfo (or subclass) (cfsdp: "
            "dp_mesh_dims names no shard dim; name one, or pass no shard_placement_fn)")
    placements: dict[nn.Parameter, Any] = {}
    meshes = _ParamMeshes(call.info, call.default_dp)  # each parameter's mesh (ShardPlacementResult)
    if shard_placement_fn is not None and _fsdp2.RESOLVES_PLACEMENTS_FIRST:
        for p, occ in params:  # as torch 2.13+, every result is resolved first
            placements[p] = shard_placement_fn(p)
            _check_placement_result(placements[p], fqn_of.get(p, occ[0][1]))
            placements[p] = meshes.resolve(p, placements[p], fqn_of.get(p, occ[0][1]))
    shard_dims: dict[nn.Parameter, int] = {}
    device = call.device
    for p, occ in params:
        fqn = fqn_of.get(p, occ[0][1])
        check_plain_param(p, fqn, "fully_shard", tp_ok=True, ext_ok=True)
        _refuse_grad_dtype(p, fqn)
        if p.device != device and p.device.type != "meta":  # meta: deferred initialisation
            raise ValueError(
                f"fully_shard: parameter '{fqn}' is on {p.device} but the mesh is on "
                f"{call.mesh.device_type}; move the module to {device} before fully_shard."
            )
        if not p.is_contiguous():
            raise NotImplementedError(
                f"FSDP does not support non-contiguous parameters yet: param.shape={p.shape} "
                f"param.stride()={p.stride()} (cfsdp: the parameter is '{fqn}'; make it "
                "contiguous before fully_shard, e.g. nn.Parameter(p.contiguous()).)"
            )
        if shard_placement_fn is not None and not _fsdp2.RESOLVES_PLACEMENTS_FIRST:
            placements[p] = shard_placement_fn(p)  # as torch 2.11, one parameter at a time
            _check_placement_result(placements[p], fqn)
        dp = meshes.of(p)
        _check_spmd_param(p, occ[0][1], fqn, dp)
        dim = _shard_dim(placements.get(p), p, fqn, dp.group.size(), dp.replicate_group is not None)
        if isinstance(dim, NotImplementedError):
            not_implemented = not_implemented or dim
        elif dim:
            shard_dims[p] = dim
        entries.append((occ[0][0], occ[0][1], fqn, p, tuple(occ[1:])))
    if not_implemented is not None:
        raise not_implemented
    return _Found(managed, entries, shard_dims, meshes)


def _install(modules: list, call: _Call, found: _Found, mp_policy: MixedPrecisionPolicy) -> None:
    """Installation: the chunk unit(s) (the parameters become its sharded DTensors), the
    managed modules' buffers moved to the device and torch's markers set, then per module
    the call's state, torch's registry entries, the forward hooks and the ``FSDP<Cls>``
    class; the state-dict hooks on the modules that hold the unit's parameters."""
    meshes, entries, device = found.meshes, found.entries, call.device
    # the post-forward group of each other mesh, as torch makes it (an int checked against
    # that mesh's shard size too)
    post_forward = {id(call.default_dp): call.post_forward_group}
    for dp in meshes.others():
        post_forward[id(dp)] = _post_forward(True if call.raf_arg is None else call.raf_arg, dp)[1]
    # one chunk unit, or one per (mesh, dtype) when the call's parameters have several
    unit = chunk_units(entries, lambda es: ChunkUnit(
        es, meshes.of(es[0][3]), device, mp_policy.param_dtype, mp_policy.reduce_dtype,
        shard_dims=found.shard_dims, mp_policy=mp_policy), mesh_of=lambda p: id(meshes.of(p)))
    if unit is not None:
        for u in getattr(unit, "units", (unit,)):
            u.post_forward_group = post_forward[id(u.dp)]
        for owner, name, fqn, p, _ in entries:  # an optimizer holding them fails at step()
            mark_replaced(p, fqn, FULLY_SHARD, owner, name)
    for b in (b for m in found.managed for b in m._buffers.values() if b is not None):
        if b.device != device and b.device.type != "meta":
            b.data = b.to(device)
    for m in found.managed:  # as torch sets them (torch.compile reads these)
        m._is_fsdp_managed_module = True
        m._fsdp_use_orig_params = True
    name = type(modules[0]).__name__
    state = _FSState(modules, unit, name, call.reshard_after_forward, mp_policy)
    for m in modules:
        setattr(m, _STATE_ATTR, state)
        # torch's composable registry (_composable.contract): fully_shard.state(m), and
        # torch's own checks (replicate refuses a fully_shard module) see this call
        m.__dict__.setdefault(_REGISTRY_KEY, OrderedDict())["fully_shard"] = _RegistryItem()
        m.__dict__.setdefault(_STATE_KEY, OrderedDict())[fully_shard] = state
        m.register_forward_pre_hook(functools.partial(_pre_hook, state), prepend=True, with_kwargs=True)
        m.register_forward_hook(functools.partial(_post_hook, state), prepend=False)
        _swap_class(m)
    if unit is not None:
        for m in {q.module for q in unit.params}:
            m.register_state_dict_pre_hook(functools.partial(_to_sharded_hook, state))
            m._register_load_state_dict_pre_hook(functools.partial(_to_sharded_hook, state))
            m.register_load_state_dict_post_hook(functools.partial(_post_load_hook, state))


def _state_of(module: nn.Module) -> Optional[_FSState]:
    """``fully_shard.state(module)``: the state of the ``fully_shard`` call that ``module``
    was given to (one per call, shared by its modules), or None, as torch's contract API."""
    return module.__dict__.setdefault(_STATE_KEY, {}).get(fully_shard)


fully_shard.state = _state_of  # type: ignore[attr-defined]
# the installed torch's signature and FSDPModule methods (cfsdp/_torch/fsdp2.py)
fully_shard.__signature__ = _fsdp2.fully_shard_signature(fully_shard)  # type: ignore[attr-defined]
_fsdp2.drop_newer_methods(FSDPModule)


@dynamo_disable
def _pre_hook(state: _FSState, module: nn.Module, args: tuple, kwargs: dict):
    return state.pre_forward(module, args, kwargs)


@dynamo_disable
def _post_hook(state: _FSState, module: nn.Module, args: tuple, output: Any) -> Any:
    return state.post_forward(module, output)


def _to_sharded_hook(state: _FSState, *args: Any, **kwargs: Any) -> None:
    if state.unit is not None and state.ustate.training_state is TrainingState.IDLE:
        state.unit.reshard()


def _post_load_hook(state: _FSState, *args: Any, **kwargs: Any) -> None:
    state.unit.reset_sharded_params()  # a partly loaded meta unit waits for the rest


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    new = _CLS_CACHE.get(cls)
    if new is None:
        new = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _CLS_CACHE[cls] = new
    module.__class__ = new


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run FSDP's pre/post-forward around ``module.<method_name>`` (e.g. ``generate``)."""
    if not isinstance(module, FSDPModule):
        return  # torch: a no-op on a module without fully_shard
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    state = _state(module)
    orig = getattr(module, method_name).__func__

    @functools.wraps(orig)
    def wrapped(self, *args: Any, **kwargs: Any):
        args, kwargs = state.pre_forward(self, args, kwargs)
        out = orig(self, *args, **kwargs)
        return state.post_forward(self, out)

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Accepted for compatibility: torch shares CUDA streams between the modules'
    collectives; cfsdp issues every collective in order on its process group, so
    the modules already share one context."""
    if not modules:
        raise ValueError(f"Expects list of FSDPModules but got {modules}")
    _check_fsdp_modules(modules, "Expects list of FSDPModules but got {m}")


# help() shows torch's documentation of the mirrored API, then cfsdp's notes
adopt_class_docs(FSDPModule, _torch_fsdp.FSDPModule)
adopt_class_docs(UnshardHandle, _torch_fsdp.UnshardHandle)
for _fn, _torch_fn in ((fully_shard, _torch_fsdp.fully_shard),
                       (register_fsdp_forward_method, _torch_fsdp.register_fsdp_forward_method),
                       (share_comm_ctx, _torch_fsdp.share_comm_ctx)):
    adopt_function_doc(_fn, _torch_fn)
