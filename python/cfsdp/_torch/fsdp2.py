"""FSDP2's API as the installed torch has it, and torch's composable registry.

cfsdp's ``fully_shard`` face mirrors the installed torch's, not the newest one's.  What the
tested versions differ in, and what cfsdp does on each:

=================================  =============  ==============================================
                                   torch 2.11     torch 2.12 to 2.15
=================================  =============  ==============================================
``DataParallelMeshDims``           absent         ``torch.distributed.fsdp.DataParallelMeshDims``
(``torch.distributed.fsdp``)                      (in ``__all__``; cfsdp re-exports it)
``fully_shard(dp_mesh_dims=)``     absent         the data-parallel dims of a full SPMD mesh
                                                  (its mesh info: torch's ``_get_mesh_info``,
                                                  :func:`mesh_info`)
``ShardPlacementResult``           absent         a ``shard_placement_fn`` result naming a
                                                  per-parameter mesh (a torch mesh info)
``FSDPModule.reset_iter_state``    absent         present from 2.13 (2.12: absent)
``dp_mesh_dims`` with several      absent         2.13+: flattened into one mesh dim; 2.12:
shard dims                                        kept as the SPMD mesh's dims (cfsdp:
                                                  ``NotImplementedError`` on 2.12)
``shard_placement_fn`` results     resolved per   all resolved before the per-parameter
                                   parameter,     checks; a result that is neither ``None``,
                                   after its      ``Shard`` nor ``ShardPlacementResult`` is
                                   device and     ``ValueError("Invalid shard_placement_fn
                                   contiguity     result: ...")``
                                   checks; one
                                   without
                                   ``.dim`` is
                                   ``Attribute-
                                   Error``, one
                                   with ``.dim
                                   >= 0`` but no
                                   ``Shard``
                                   ``Assertion-
                                   Error``
``fully_shard(ModuleList or        refused, with  refused only when the container does not
ModuleDict)``                      or without a   implement ``forward``
                                   ``forward``
=================================  =============  ==============================================

What torch 2.15 changed (2.11-2.14 as the left column), and what cfsdp does on 2.15:

=================================  ===========================================================
``MixedPrecisionPolicy`` with      2.11-2.14 reduce the gradients in ``param_dtype``; 2.15 in
``reduce_dtype=None``              each parameter's ``grad_dtype``, its original dtype unless
                                   set (fp32 parameters with ``param_dtype=bf16`` reduce in
                                   fp32), and no longer clamps a ``reduce_dtype`` equal to
                                   ``param_dtype``: cfsdp does as the installed torch
                                   (:data:`REDUCES_IN_GRAD_DTYPE`)
a parameter's explicit             2.15 reduces and accumulates its gradient in that dtype:
``grad_dtype`` (other than its     cfsdp: ``NotImplementedError`` naming the parameter
dtype), ``MixedPrecisionPolicy(    (:func:`has_grad_dtype_override`); 2.15's per-parameter
param_dtype_override_fn=)``        ``param_dtype``: ``NotImplementedError``
``GradientReductionHandle``,       new in 2.15: the class is torch's; the methods are cfsdp's,
``FSDPModule.finalize_backward``,  ``NotImplementedError`` for what cfsdp does not do yet
``set_manual_backward_final-       (manual finalization, keeping the unsharded storage),
ization``, ``set_keep_unsharded_   accepted where they ask for the default
storage``
=================================  ===========================================================

``fully_shard`` passes its keyword arguments through :func:`newer_kwargs`: an argument the
installed torch's ``fully_shard`` does not take is torch's ``TypeError`` ("fully_shard() got an
unexpected keyword argument ..."), and ``inspect.signature(cfsdp.fully_shard)`` is the installed
torch's (:func:`fully_shard_signature`).  ``FSDPModule`` drops the methods the installed torch's
``FSDPModule`` does not have (:func:`drop_newer_methods`), so they are ``AttributeError`` as on
that torch.  2.12 and 2.14 are tested like 2.11 and 2.15, by hand (``make test-torch TORCH=2.12.0``); it has
2.13's FSDP2 in every row but ``reset_iter_state``.  Where torch defines a name, cfsdp reads it
from torch (``getattr``, ``hasattr``) rather than from the version number.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch.distributed.fsdp as _fsdp
import torch.nn as nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem
from torch.distributed._composable.contract import _get_registry as get_registry
from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_init
from torch.distributed.tensor import Shard

from . import VERSION_STRING, at_least

# torch's classes, or None where the installed torch has none
ShardPlacementResult: Optional[type] = getattr(_fsdp_common, "ShardPlacementResult", None)
DataParallelMeshDims: Optional[type] = getattr(_fsdp, "DataParallelMeshDims", None)
# torch's mesh infos (every tested version): what fully_shard derives from its mesh, and what a
# ShardPlacementResult names for its parameter (2.12+: ``is_spmd_mesh``, ``spmd_mesh`` and
# ``dp_mesh_dims`` for dp_mesh_dims)
FSDPMeshInfo: type = _fsdp_common.FSDPMeshInfo
HSDPMeshInfo: type = _fsdp_common.HSDPMeshInfo
DDPMeshInfo: type = _fsdp_common.DDPMeshInfo

# fully_shard's keyword arguments added after the oldest supported torch: name -> (major, minor)
_FULLY_SHARD_SINCE: dict[str, tuple[int, int]] = {"dp_mesh_dims": (2, 12)}
# FSDPModule methods cfsdp implements that torch added after the oldest supported torch
_FSDP_MODULE_SINCE: dict[str, tuple[int, int]] = {
    "reset_iter_state": (2, 13), "set_symm_mem_for_comm": (2, 12),
    "set_reduce_scatter_unused_params": (2, 13), "set_reduce_scatter_max_input_buffers": (2, 13),
    "set_separate_reduce_scatter_group": (2, 13), "finalize_backward": (2, 15),
    "set_manual_backward_finalization": (2, 15), "set_keep_unsharded_storage": (2, 15)}

# torch 2.15+: with ``reduce_dtype=None`` the gradients are reduced (and accumulated without
# synchronization) in each parameter's grad_dtype, its original dtype unless set, not in
# ``param_dtype``; a ``reduce_dtype`` equal to ``param_dtype`` is no longer clamped to None
REDUCES_IN_GRAD_DTYPE: bool = at_least(2, 15)
# torch 2.15's handle of an asynchronous finalize_backward, or None where torch has none
GradientReductionHandle: Optional[type] = getattr(_fsdp, "GradientReductionHandle", None)


def has_grad_dtype_override(param: Any) -> bool:
    """Whether the installed torch's FSDP2 reduces and accumulates ``param``'s gradient in
    an explicit ``grad_dtype`` other than the parameter's dtype (2.15+:
    ``param._has_grad_dtype_override``; ``grad_dtype=None`` is "any dtype")."""
    return (REDUCES_IN_GRAD_DTYPE and getattr(param, "_has_grad_dtype_override", False)
            and param.grad_dtype != param.dtype)


def param_dtype_override_fn(mp_policy: Any) -> Optional[Any]:
    """``MixedPrecisionPolicy.param_dtype_override_fn`` (2.15+), or None."""
    return getattr(mp_policy, "param_dtype_override_fn", None)

# dp_mesh_dims naming several shard dims: 2.13+ flattens them into one dim of the sharded
# parameters' mesh, as cfsdp does; 2.12 leaves its parameters on the SPMD mesh's own dims (other
# placements), which cfsdp does not reproduce: fully_shard raises there (not_in_this_torch)
FLATTENS_SHARD_DIMS: bool = at_least(2, 13)

# whether fully_shard resolves every shard_placement_fn result before its per-parameter checks
# (2.12+: ``resolve_shard_placement``, a wrong type is its ValueError) or one parameter at a
# time inside them (2.11: ``FSDPParam._init_sharded_param``)
RESOLVES_PLACEMENTS_FIRST: bool = hasattr(_fsdp_common, "resolve_shard_placement")

if at_least(2, 12) != (ShardPlacementResult is not None) or at_least(2, 12) != (
        DataParallelMeshDims is not None) or at_least(2, 12) != RESOLVES_PLACEMENTS_FIRST:
    raise ImportError(
        f"cfsdp: torch {VERSION_STRING} does not have the FSDP2 names its version should have "
        f"(ShardPlacementResult: {ShardPlacementResult}, DataParallelMeshDims: "
        f"{DataParallelMeshDims}); cfsdp/_torch/fsdp2.py needs an update for this torch."
    )


def mesh_info(mesh: Any, dp_mesh_dims: Any = None) -> Any:
    """torch's mesh info for ``fully_shard``'s ``mesh`` (``_get_mesh_info``): ``FSDPMeshInfo``
    for a 1-D mesh, ``HSDPMeshInfo`` for a 2-D one; with ``dp_mesh_dims`` (2.12+), the
    data-parallel sub-mesh of the full SPMD mesh, several named dims flattened into one as
    torch flattens them (``DeviceMesh._flatten``), ``DDPMeshInfo`` without a shard dim."""
    if dp_mesh_dims is None:
        return _fsdp_init._get_mesh_info(mesh)
    return _fsdp_init._get_mesh_info(mesh, dp_mesh_dims)


def spmd_of(info: Any) -> Optional[tuple[Any, tuple[str, ...], tuple[str, ...]]]:
    """``(spmd_mesh, shard_names, replicate_names)`` of a mesh info made for ``dp_mesh_dims``
    (2.12+), else None."""
    if not getattr(info, "is_spmd_mesh", False):
        return None
    dims = info.dp_mesh_dims
    return info.spmd_mesh, tuple(dims.shard_names), tuple(dims.replicate_names)


def placement_result_types() -> tuple[type, ...]:
    """What a ``shard_placement_fn`` may return besides ``None`` on the installed torch."""
    return (Shard,) if ShardPlacementResult is None else (Shard, ShardPlacementResult)


def placement_result_error(result: Any) -> Optional[tuple[type, str]]:
    """torch's error (its type and message) for a ``shard_placement_fn`` result of a type it
    rejects, or None when it takes the result (see the table above)."""
    if result is None or isinstance(result, placement_result_types()):
        return None
    if RESOLVES_PLACEMENTS_FIRST:
        return ValueError, f"Invalid shard_placement_fn result: {result}"
    dim = getattr(result, "dim", None)
    if dim is None:
        return AttributeError, f"'{type(result).__name__}' object has no attribute 'dim'"
    if isinstance(dim, int) and dim < 0:
        return None  # torch 2.11 takes Shard(dim + ndim) in its place
    return AssertionError, f"Expected Shard, got {type(result)}: {result}"


def refuses_container(module: nn.Module) -> bool:
    """Whether the installed torch's ``fully_shard`` refuses ``module`` as a container
    (``ValueError``: "does not support containers that do not implement forward")."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return False
    return not at_least(2, 12) or type(module).forward is nn.Module.forward


def has_fully_shard_kwarg(name: str) -> bool:
    since = _FULLY_SHARD_SINCE.get(name)
    return since is None or at_least(*since)


def newer_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``fully_shard``'s keyword arguments newer than the oldest supported torch, with their
    defaults filled in; an argument the installed torch's ``fully_shard`` does not take is
    torch's ``TypeError``."""
    for name in kwargs:
        if name not in _FULLY_SHARD_SINCE or not has_fully_shard_kwarg(name):
            raise TypeError(f"fully_shard() got an unexpected keyword argument '{name}'")
    return {name: kwargs.get(name) for name in _FULLY_SHARD_SINCE if has_fully_shard_kwarg(name)}


def fully_shard_signature(fn: Any) -> inspect.Signature:
    """``fn``'s signature (cfsdp's ``fully_shard``, written with ``**kwargs`` for the newer
    arguments) with the installed torch's newer keyword arguments in place of ``**kwargs``."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
               for name in _FULLY_SHARD_SINCE if has_fully_shard_kwarg(name)]
    return sig.replace(parameters=params)


def drop_newer_methods(cls: type) -> None:
    """Remove from ``cls`` (cfsdp's ``FSDPModule``) the methods the installed torch's
    ``FSDPModule`` does not have."""
    for name, since in _FSDP_MODULE_SINCE.items():
        if not at_least(*since) and name in vars(cls):
            delattr(cls, name)


__all__ = ["DDPMeshInfo", "DataParallelMeshDims", "FLATTENS_SHARD_DIMS", "FSDPMeshInfo",
           "GradientReductionHandle", "HSDPMeshInfo", "REDUCES_IN_GRAD_DTYPE", "REGISTRY_KEY",
           "has_grad_dtype_override", "param_dtype_override_fn",
           "RESOLVES_PLACEMENTS_FIRST", "RegistryItem", "STATE_KEY", "ShardPlacementResult",
           "drop_newer_methods", "fully_shard_signature", "get_registry", "has_fully_shard_kwarg",
           "mesh_info", "newer_kwargs", "placement_result_error", "placement_result_types",
           "refuses_container", "spmd_of"]
