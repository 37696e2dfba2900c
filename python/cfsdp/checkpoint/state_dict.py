"""``torch.distributed.checkpoint.state_dict``'s helpers, for models wrapped with cfsdp.

Same names, signatures and ``StateDictOptions`` (torch's own class, re-exported) as torch's
module.  A model without a cfsdp wrapper goes to torch's function unchanged; a model with
one is handled with cfsdp's own API (``FSDP.state_dict_type``, ``model.state_dict()``,
``FSDP.optim_state_dict`` / ``optim_state_dict_to_load``), the way torch's helpers drive
torch's FSDP1.

torch's own helpers work on cfsdp models too.  torch's helpers recognise only torch's FSDP
classes: on a cfsdp wrapper model they used to fall back to plain ``model.state_dict()`` and
``optim.state_dict()`` re-keyed through the raw parameter names, which for
``use_orig_params=False`` are each rank's *local flat shards* under one key, so ``dcp.save``
wrote one rank's shard as if replicated and a resumed run trained with another rank's Adam
moments, silently.  So importing cfsdp teaches torch's module to hand cfsdp models to the
functions below (:func:`install_torch_dispatch`): its internal steps (``_verify_options``,
``_get_model_state_dict``, ``_get_optim_state_dict``, ``_load_model_state_dict``,
``_load_optim_state_dict``), looked up by torch's public functions at call time, are replaced by
dispatchers that send a model holding a cfsdp wrapper here and everything else to torch's own
code, unchanged.  Its public functions are left as they are, so the names a user imported
before or after cfsdp all behave the same.  ``uninstall_torch_dispatch()`` restores torch's.

Options, all honoured (anything else is a ``NotImplementedError`` naming it):

* ``full_state_dict``: FULL_STATE_DICT (plain tensors) or SHARDED_STATE_DICT (ShardedTensor,
  or DTensor with a ``device_mesh``), for the model and the optimizer;
* ``cpu_offload``: the configs' ``offload_to_cpu``; with ``full_state_dict`` also
  ``rank0_only`` (ranks other than 0 get empty dicts), as torch;
* ``ignore_frozen_params``; ``submodules`` + ``keep_submodule_prefixes`` (model state dict
  only, as torch); ``strict`` (model ``load_state_dict`` and missing optimizer state);
* ``broadcast_from_rank0`` (needs ``full_state_dict``): on ``set_*``, rank 0's full state
  dicts are broadcast tensor by tensor over the model's ranks, then every rank loads them as
  full state dicts (peak memory: one full copy per rank);
* ``flatten_optimizer_state_dict``: torch's flat ``state.<fqn>.<name>`` /
  ``param_groups.<fqn>.<key>`` format (torch's generic helpers do the flattening);
* ``dsd_fqn_modifiers``: names a module method whose renames torch applies; a cfsdp model in
  which some module defines it is a ``NotImplementedError`` (without one it changes nothing).

Not supported with cfsdp wrappers: DDP or ``torch.compile`` wrappers around or inside the
model, torch's FSDP mixed with cfsdp's in one model, and model state dicts keyed by modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor
# bound at import: under cfsdp.patch_torch() a lookup at call time would give cfsdp's class
from torch.distributed.fsdp import FullyShardedDataParallel as _TorchFSDP
from torch.nn.parallel import DistributedDataParallel as DDP

from .._fqn import clean_tensor_name
from .._torch import checkpoint as _ckpt
from .._torch.checkpoint import IncompatibleKeys as _IncompatibleKeys
from .._torch.checkpoint import pytree
from .._torch.dynamo import OptimizedModule
from .._state_dict import optimizer_param_fqns
from ..api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from .._fully_shard import FSDPModule
from ..fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]

_STATE = "state"
_PG = "param_groups"

Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]]


@dataclasses.dataclass
class _Plan:
    """What one call does: the options, cfsdp's wrappers and torch's info object (torch's
    generic optimizer helpers read its FQN mapping, ``strict`` and flattening flags)."""

    model: nn.Module
    options: StateDictOptions
    wrappers: list
    info: Any  # torch's _StateDictInfo
    group: dist.ProcessGroup  # spans every rank holding a part of the model
    device: torch.device

    def context(self, loading: bool):
        """``FSDP.state_dict_type`` for these options.  A load under FULL_STATE_DICT always
        has the full dicts on every rank (broadcast first), so it uses the all-rank configs."""
        o = self.options
        if o.full_state_dict:
            rank0_only = o.cpu_offload and not loading
            cfgs = (
                StateDictType.FULL_STATE_DICT,
                FullStateDictConfig(offload_to_cpu=o.cpu_offload and not loading, rank0_only=rank0_only),
                FullOptimStateDictConfig(offload_to_cpu=o.cpu_offload and not loading, rank0_only=rank0_only),
            )
        else:
            cfgs = (
                StateDictType.SHARDED_STATE_DICT,
                ShardedStateDictConfig(offload_to_cpu=o.cpu_offload),
                ShardedOptimStateDictConfig(offload_to_cpu=o.cpu_offload),
            )
        return FSDP.state_dict_type(self.model, *cfgs)


@dataclasses.dataclass
class _CfsdpInfo(_ckpt.StateDictInfo):
    """torch's ``_StateDictInfo`` of a call on a cfsdp model: what torch's generic optimizer
    helpers read, plus the plan that tells torch's dispatched steps to come here."""

    cfsdp_plan: Optional[_Plan] = None


def _as_tuple(optimizers: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)


def _cfsdp_wrappers(model: nn.Module) -> list:
    return FSDP.fsdp_modules(model)


def _check_supported(model: nn.Module, options: StateDictOptions) -> None:
    for name, m in model.named_modules():
        if isinstance(m, _TorchFSDP):
            raise ValueError(
                f"{name or 'the model'} is torch's FullyShardedDataParallel inside a model wrapped "
                "with cfsdp: use one FSDP implementation for the whole model."
            )
        if isinstance(m, (DDP, OptimizedModule)):
            raise NotImplementedError(
                f"cfsdp.checkpoint.state_dict: a {type(m).__name__} wrapper "
                f"({name or 'the root'}) in a model wrapped with cfsdp is not supported; pass "
                "the uncompiled, un-DDP'd model."
            )
        if hasattr(type(m), options.dsd_fqn_modifiers):
            raise NotImplementedError(
                f"StateDictOptions.dsd_fqn_modifiers={options.dsd_fqn_modifiers!r}: module "
                f"{name or 'root'} ({type(m).__name__}) defines it; FQN modifiers are not "
                "supported for models wrapped with cfsdp."
            )


def _plan(
    model: nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    optim_only: bool,
    submodules: Optional[set[nn.Module]],
    options: Optional[StateDictOptions],
) -> _Plan:
    options = options or StateDictOptions()
    _check_supported(model, options)
    if optim_only and not optims:
        raise RuntimeError("Optimizers are not passed in but optim_only is set to True.")
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError("full_state_dict must be True when broadcast_from_rank0 is True.")
    wrappers = _cfsdp_wrappers(model)
    fqns_of = optimizer_param_fqns(model, wrappers)
    mapping: dict[Any, Any] = {}
    for p, fqns in fqns_of.items():
        mapping[p] = fqns
        for f in fqns:
            mapping[f] = p
    prefixes: set[str] = set()
    if submodules:
        wanted = set(submodules)
        for name, m in model.named_modules():
            if m in wanted:
                prefixes.add(clean_tensor_name(name + ".") if name else "")
    info = _CfsdpInfo(
        **dataclasses.asdict(options),
        fqn_param_mapping=mapping,
        shared_params_mapping={},
        submodule_prefixes=prefixes,
        handle_model=not optim_only,
        handle_optim=len(optims) > 0,
        # torch's checks look up torch's FSDP state of each module listed here; cfsdp's
        # wrappers have none, so they are kept in the plan instead
        fsdp_modules=[],
    )
    root = wrappers[0]
    group = root._process_group if root._replicate_group is None else dist.group.WORLD
    plan = _Plan(model, options, wrappers, info, group, root.compute_device)
    info.cfsdp_plan = plan
    return plan


# ----------------------------------------------------------------------------- model


@torch.no_grad()
def _get_model(model: nn.Module, plan: _Plan) -> dict[str, Any]:
    o = plan.options
    with plan.context(loading=False):
        raw = model.state_dict()
    sd = {clean_tensor_name(k): v for k, v in raw.items()}
    prefixes = plan.info.submodule_prefixes
    if prefixes:
        kept: dict[str, Any] = {}
        for fqn, v in sd.items():
            for prefix in prefixes:
                if fqn.startswith(prefix):
                    kept[fqn if o.keep_submodule_prefixes else fqn[len(prefix):]] = v
        sd = kept
    if o.ignore_frozen_params:
        for p, fqns in plan.info.fqn_param_mapping.items():
            if isinstance(p, torch.Tensor) and not p.requires_grad:
                for f in fqns:
                    sd.pop(f, None)
    return sd


@torch.no_grad()
def _set_model(model: nn.Module, sd: dict[str, Any], plan: _Plan) -> _IncompatibleKeys:
    o = plan.options
    if sd and isinstance(next(iter(sd)), nn.Module):
        raise NotImplementedError(
            "set_model_state_dict with a state dict keyed by submodules (deprecated in torch) "
            "is not supported for models wrapped with cfsdp; key it by FQN."
        )
    # keys as torch's set_model_state_dict gives them for a state dict keyed by submodules
    # (raw names, through the wrappers) are the clean FQNs with the wrappers' prefixes
    sd = {clean_tensor_name(k) if isinstance(k, str) else k: v for k, v in sd.items()}
    if o.broadcast_from_rank0:
        sd = _broadcast_from_rank0(sd, plan)
    elif not sd:
        return _IncompatibleKeys([], [])
    with plan.context(loading=True):
        return model.load_state_dict(sd, strict=o.strict)


# ----------------------------------------------------------------------------- optimizer


@torch.no_grad()
def _get_optim(model: nn.Module, optims, plan: _Plan) -> dict[str, Any]:
    merged: dict[str, Any] = {_STATE: {}, _PG: []}
    for optim in optims:
        _ckpt.init_optim_state(optim)  # state exists even before the first step
        with plan.context(loading=False):
            osd = FSDP.optim_state_dict(model, optim)
        if not osd:  # rank0_only: nothing on this rank
            continue
        merged[_STATE].update(osd[_STATE])
        merged[_PG].extend(osd[_PG])
    if not merged[_STATE] and not merged[_PG]:
        return {}
    if plan.options.flatten_optimizer_state_dict:
        return _ckpt.flatten_optim_state_dict(merged)
    return merged


@torch.no_grad()
def _set_optim(model: nn.Module, optims, osd: dict[str, Any], plan: _Plan) -> None:
    if plan.options.broadcast_from_rank0:
        osd = _broadcast_from_rank0(osd, plan)
    for optim in optims:
        _ckpt.init_optim_state(optim)
        if not osd:
            mine: dict[str, Any] = {}
        elif _STATE in osd:  # FQN-keyed: this optimizer's parameters and groups
            mine = _ckpt.split_optim_state_dict(model, optim, osd, plan.info)
        else:
            mine = _ckpt.unflatten_optim_state_dict(optim, osd, plan.info)
        with plan.context(loading=True):
            to_load = FSDP.optim_state_dict_to_load(model, optim, mine)
        optim.load_state_dict(to_load)


# ----------------------------------------------------------------------------- broadcast


@dataclasses.dataclass(frozen=True)
class _TensorSlot:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _broadcast_from_rank0(obj: Any, plan: _Plan) -> Any:
    """Rank 0's (nested) state dict on every rank of ``plan.group``: the structure and
    non-tensor values in one object broadcast, then each tensor in its own broadcast."""
    group = plan.group
    src = dist.get_global_rank(group, 0)
    am_src = group.rank() == 0
    payload: list[Any] = [None]
    leaves: list[Any] = []
    if am_src:
        leaves, spec = pytree.tree_flatten(obj)
        # a tensor-parallel parameter's DTensor (on its TP mesh) is sent whole: the sources
        # (rank 0 of each dp group) gather it over TP together; each rank loads its part
        leaves = [x.full_tensor() if isinstance(x, DTensor) else x for x in leaves]
        slots = [
            _TensorSlot(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
            for x in leaves
        ]
        payload = [(spec, slots)]
    dist.broadcast_object_list(payload, src=src, group=group)
    spec, slots = payload[0]
    out = []
    for i, slot in enumerate(slots):
        if isinstance(slot, _TensorSlot):
            if am_src:
                t = leaves[i].detach().to(plan.device).contiguous()
            else:
                t = torch.empty(slot.shape, dtype=slot.dtype, device=plan.device)
            dist.broadcast(t, src=src, group=group)
            out.append(t)
        else:
            out.append(slot)
    return pytree.tree_unflatten(out, spec)


# ----------------------------------------------------------------------------- public API


def get_model_state_dict(
    model: nn.Module,
    *,
    submodules: Optional[set[nn.Module]] = None,
    options: Optional[StateDictOptions] = None,
) -> dict[str, Any]:
    """torch's ``get_model_state_dict``; for a cfsdp model see the module doc."""
    if not _cfsdp_wrappers(model):
        return _ckpt.dsd.get_model_state_dict(model, submodules=submodules, options=options)
    with _ckpt.gc_context():
        return _get_model(model, _plan(model, (), False, submodules, options))


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: Optional[set[nn.Module]] = None,
    options: Optional[StateDictOptions] = None,
) -> dict[str, Any]:
    """torch's ``get_optimizer_state_dict``; for a cfsdp model see the module doc."""
    if not _cfsdp_wrappers(model):
        return _ckpt.dsd.get_optimizer_state_dict(
            model, optimizers, submodules=submodules, options=options
        )
    optims = _as_tuple(optimizers)
    with _ckpt.gc_context():
        return _get_optim(model, optims, _plan(model, optims, True, submodules, options))


def get_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: Optional[set[nn.Module]] = None,
    options: Optional[StateDictOptions] = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """torch's ``get_state_dict``: ``(model state dict, optimizer state dict)``."""
    if not _cfsdp_wrappers(model):
        return _ckpt.dsd.get_state_dict(model, optimizers, submodules=submodules, options=options)
    optims = _as_tuple(optimizers)
    with _ckpt.gc_context():
        plan = _plan(model, optims, False, submodules, options)
        return _get_model(model, plan), _get_optim(model, optims, plan)


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: dict[str, Any],
    *,
    options: Optional[StateDictOptions] = None,
) -> _IncompatibleKeys:
    """torch's ``set_model_state_dict``; returns the missing and unexpected keys."""
    if not _cfsdp_wrappers(model):
        return _ckpt.dsd.set_model_state_dict(model, model_state_dict, options=options)
    with _ckpt.gc_context():
        return _set_model(model, model_state_dict, _plan(model, (), False, None, options))


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    optim_state_dict: dict[str, Any],
    *,
    options: Optional[StateDictOptions] = None,
) -> None:
    """torch's ``set_optimizer_state_dict``."""
    if not _cfsdp_wrappers(model):
        return _ckpt.dsd.set_optimizer_state_dict(
            model, optimizers, optim_state_dict, options=options
        )
    optims = _as_tuple(optimizers)
    with _ckpt.gc_context():
        _set_optim(model, optims, optim_state_dict, _plan(model, optims, True, None, options))


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: Optional[StateDictOptions] = None,
) -> _IncompatibleKeys:
    """torch's ``set_state_dict``: the model first, then the optimizers."""
    if not _cfsdp_wrappers(model):
        return _ckpt.dsd.set_state_dict(
            model,
            optimizers,
            model_state_dict=model_state_dict,
            optim_state_dict=optim_state_dict,
            options=options,
        )
    optims = _as_tuple(optimizers)
    plan = _plan(model, optims, False, None, options)
    with _ckpt.gc_context():
        keys = _set_model(model, model_state_dict, plan)
        _set_optim(model, optims, optim_state_dict, plan)
    return keys


# ----------------------------------------------------------------------------- torch's helpers
#
# [Note: torch's helpers on cfsdp models]
# torch's public functions (get_state_dict, set_state_dict, ...) run the same steps for every
# model: _verify_options builds a _StateDictInfo, then _get_model_state_dict /
# _get_optim_state_dict / _load_model_state_dict / _load_optim_state_dict do the work, and
# _verify_state_dict checks the result.  Each step is looked up in torch's module namespace at
# call time, so replacing the five that know about FSDP routes a cfsdp model here whatever
# name the user imported and whenever: _verify_options returns a _CfsdpInfo carrying the plan
# for a model holding a cfsdp wrapper, and each later step takes that info to cfsdp's code.
# Any other model gets torch's own info and torch's own steps.  _verify_state_dict is torch's
# (a _CfsdpInfo lists no torch FSDP modules, so its checks are the generic ones).

_TORCH_STEPS = tuple(_ckpt.DSD_STEPS)  # the steps and their parameters: cfsdp/_torch/checkpoint.py
_TORCH_ORIGINALS: dict[str, Any] = {}


def _plan_of(info: Any) -> Optional[_Plan]:
    return info.cfsdp_plan if isinstance(info, _CfsdpInfo) else None


def _dispatch_verify_options(model, optims, optim_only, *, submodules=None, options=None):
    if not _cfsdp_wrappers(model):
        return _TORCH_ORIGINALS["_verify_options"](
            model, optims, optim_only, submodules=submodules, options=options
        )
    if submodules:  # torch's deprecation warning, as its own _verify_options gives it
        import warnings

        warnings.warn(
            "Getting submodules only model/optim state_dict is deprecated and will be removed "
            "in 2.5. This feature can be achieved by manually filtering out the state_dict "
            "returned from get_state_dict.",
            FutureWarning,
            stacklevel=3,
        )
    return _plan(model, tuple(optims), optim_only, submodules, options).info


def _dispatch_get_model_state_dict(model, info):
    plan = _plan_of(info)
    if plan is None:
        return _TORCH_ORIGINALS["_get_model_state_dict"](model, info)
    return _get_model(model, plan) if info.handle_model else {}


def _dispatch_get_optim_state_dict(model, optimizers, info):
    plan = _plan_of(info)
    if plan is None:
        return _TORCH_ORIGINALS["_get_optim_state_dict"](model, optimizers, info)
    return _get_optim(model, optimizers, plan) if info.handle_optim else {}


def _dispatch_load_model_state_dict(model, state_dict, info):
    plan = _plan_of(info)
    if plan is None:
        if info.broadcast_from_rank0 and any(isinstance(m, FSDPModule) for m in model.modules()):
            _check_broadcast_shapes(model, state_dict)
        return _TORCH_ORIGINALS["_load_model_state_dict"](model, state_dict, info)
    # set_state_dict marks the model "not handled" on a rank given an empty model state dict,
    # which with broadcast_from_rank0 is every rank but 0: they still take part in the broadcast
    if not info.handle_model and not info.broadcast_from_rank0:
        return _IncompatibleKeys([], [])
    return _set_model(model, state_dict, plan)


def _dispatch_load_optim_state_dict(model, optimizers, state_dict, info):
    plan = _plan_of(info)
    if plan is None:
        return _TORCH_ORIGINALS["_load_optim_state_dict"](model, optimizers, state_dict, info)
    if info.handle_optim:
        _set_optim(model, optimizers, state_dict, plan)


def _check_broadcast_shapes(model: nn.Module, state_dict: dict[str, Any]) -> None:
    """``broadcast_from_rank0`` into a ``fully_shard`` model: rank 0 checks the full state
    dict's shapes against the model's before anything is sent, and every rank raises naming
    the first entry of another shape (torch fails later, in a copy, naming nothing)."""
    msg: list[Optional[str]] = [None]
    if dist.get_rank() == 0:
        for name, local in _ckpt.iterate_valid_model_state(model):
            if not isinstance(local, torch.Tensor):
                continue
            for fqn in _ckpt.get_fqns(model, name):
                v = state_dict.get(fqn)
                if isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(local.shape):
                    msg[0] = (
                        f"Error(s) in loading state_dict: size mismatch for {fqn}: copying a param "
                        f"with shape {v.shape} from checkpoint, the shape in current model is "
                        f"{local.shape}. (set_model_state_dict with broadcast_from_rank0=True: "
                        "nothing was loaded; rank 0's state dict must come from the same model.)"
                    )
                    break
            if msg[0] is not None:
                break
    dist.broadcast_object_list(msg, src=0)
    if msg[0] is not None:
        raise RuntimeError(msg[0])


_DISPATCHERS = {
    "_verify_options": _dispatch_verify_options,
    "_get_model_state_dict": _dispatch_get_model_state_dict,
    "_get_optim_state_dict": _dispatch_get_optim_state_dict,
    "_load_model_state_dict": _dispatch_load_model_state_dict,
    "_load_optim_state_dict": _dispatch_load_optim_state_dict,
}


def install_torch_dispatch() -> None:
    """Route torch's ``torch.distributed.checkpoint.state_dict`` helpers to cfsdp for models
    that hold a cfsdp wrapper (see [Note: torch's helpers on cfsdp models]); idempotent.
    ``import cfsdp`` calls it."""
    for name in _TORCH_STEPS:
        current = getattr(_ckpt.dsd, name)
        if current is _DISPATCHERS[name]:
            continue
        _TORCH_ORIGINALS[name] = current
        setattr(_ckpt.dsd, name, _DISPATCHERS[name])


def uninstall_torch_dispatch() -> None:
    """Give torch's helpers back their own steps (cfsdp models then get torch's plain
    ``model.state_dict()`` / ``optim.state_dict()`` behaviour: see the module doc)."""
    for name, fn in _TORCH_ORIGINALS.items():
        if getattr(_ckpt.dsd, name) is _DISPATCHERS[name]:
            setattr(_ckpt.dsd, name, fn)


def torch_dispatch_installed() -> bool:
    return all(getattr(_ckpt.dsd, n) is _DISPATCHERS[n] for n in _TORCH_STEPS)
