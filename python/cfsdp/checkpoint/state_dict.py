"""``torch.distributed.checkpoint.state_dict``'s helpers, for models wrapped with cfsdp.

Same names, signatures and ``StateDictOptions`` (torch's own class, re-exported) as torch's
module.  A model without a cfsdp wrapper goes to torch's function unchanged; a model with
one is handled with cfsdp's own API (``FSDP.state_dict_type``, ``model.state_dict()``,
``FSDP.optim_state_dict`` / ``optim_state_dict_to_load``), the way torch's helpers drive
torch's FSDP1.

What torch's helpers do on a cfsdp model (torch 2.13, probed; they look for torch's FSDP
classes only, so ``FSDP.fsdp_modules`` finds nothing and no ``state_dict_type`` is entered):

* ``get_model_state_dict``: plain ``model.state_dict()``, which is cfsdp's default
  FULL_STATE_DICT: clean FQNs, but *full, unsharded* plain tensors on every rank whatever
  ``full_state_dict`` says, so ``full_state_dict=False`` silently gives no ShardedTensors
  (every rank holds, and ``dcp.save`` treats as replicated, the whole model).
* ``get_optimizer_state_dict``: ``optim.state_dict()`` re-keyed through the raw
  ``named_parameters()`` names: keys carry ``_fsdp_wrapped_module.``, and with
  ``use_orig_params=False`` are ``..._flat_param`` names; values are this rank's local 1-D
  flat shards (parameters whose local shard is empty have no state at all), and
  ``full_state_dict=True`` gathers nothing.  Such a checkpoint cannot be loaded into a model
  at another world size, nor into torch's FSDP1.
* ``set_model_state_dict``: maps the clean keys to the raw names and hands those to
  ``load_state_dict``, which cfsdp rejects (``RuntimeError``: unexpected keys
  ``_fsdp_wrapped_module....``); with the default options and ``use_orig_params=False``
  it first fails with "``..._flat_param`` contains _flat_param".

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
from torch.distributed.checkpoint import state_dict as _torch_dsd
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils import _pytree as pytree

from .._state_dict import clean_tensor_name, optimizer_param_fqns
from ..api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
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


def _as_tuple(optimizers: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)


def _cfsdp_wrappers(model: nn.Module) -> list:
    return FSDP.fsdp_modules(model)


def _check_supported(model: nn.Module, options: StateDictOptions) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    for name, m in model.named_modules():
        if isinstance(m, TorchFSDP):
            raise ValueError(
                f"{name or 'the model'} is torch's FullyShardedDataParallel inside a model wrapped "
                "with cfsdp: use one FSDP implementation for the whole model."
            )
        if isinstance(m, (DDP, torch._dynamo.eval_frame.OptimizedModule)):
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
    info = _torch_dsd._StateDictInfo(
        **dataclasses.asdict(options),
        fqn_param_mapping=mapping,
        shared_params_mapping={},
        submodule_prefixes=prefixes,
        handle_model=not optim_only,
        handle_optim=len(optims) > 0,
        fsdp_modules=wrappers,
    )
    root = wrappers[0]
    group = root._process_group if root._replicate_group is None else dist.group.WORLD
    return _Plan(model, options, wrappers, info, group, root.compute_device)


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
        _torch_dsd._init_optim_state(optim)  # state exists even before the first step
        with plan.context(loading=False):
            osd = FSDP.optim_state_dict(model, optim)
        if not osd:  # rank0_only: nothing on this rank
            continue
        merged[_STATE].update(osd[_STATE])
        merged[_PG].extend(osd[_PG])
    if not merged[_STATE] and not merged[_PG]:
        return {}
    if plan.options.flatten_optimizer_state_dict:
        return _torch_dsd._flatten_optim_state_dict(merged)
    return merged


@torch.no_grad()
def _set_optim(model: nn.Module, optims, osd: dict[str, Any], plan: _Plan) -> None:
    if plan.options.broadcast_from_rank0:
        osd = _broadcast_from_rank0(osd, plan)
    for optim in optims:
        _torch_dsd._init_optim_state(optim)
        if not osd:
            mine: dict[str, Any] = {}
        elif _STATE in osd:  # FQN-keyed: this optimizer's parameters and groups
            mine = _torch_dsd._split_optim_state_dict(model, optim, osd, plan.info)
        else:
            mine = _torch_dsd._unflatten_optim_state_dict(optim, osd, plan.info)
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
        return _torch_dsd.get_model_state_dict(model, submodules=submodules, options=options)
    with _torch_dsd._gc_context():
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
        return _torch_dsd.get_optimizer_state_dict(
            model, optimizers, submodules=submodules, options=options
        )
    optims = _as_tuple(optimizers)
    with _torch_dsd._gc_context():
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
        return _torch_dsd.get_state_dict(model, optimizers, submodules=submodules, options=options)
    optims = _as_tuple(optimizers)
    with _torch_dsd._gc_context():
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
        return _torch_dsd.set_model_state_dict(model, model_state_dict, options=options)
    with _torch_dsd._gc_context():
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
        return _torch_dsd.set_optimizer_state_dict(
            model, optimizers, optim_state_dict, options=options
        )
    optims = _as_tuple(optimizers)
    with _torch_dsd._gc_context():
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
        return _torch_dsd.set_state_dict(
            model,
            optimizers,
            model_state_dict=model_state_dict,
            optim_state_dict=optim_state_dict,
            options=options,
        )
    optims = _as_tuple(optimizers)
    plan = _plan(model, optims, False, None, options)
    with _torch_dsd._gc_context():
        keys = _set_model(model, model_state_dict, plan)
        _set_optim(model, optims, optim_state_dict, plan)
    return keys
