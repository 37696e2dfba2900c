"""Configs and enums: torch's own objects, re-exported.

``cfsdp.ShardingStrategy is torch.distributed.fsdp.ShardingStrategy`` and so on,
so code written for torch's FSDP passes the same objects to cfsdp and back.
"""

from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

from ._torch import fsdp2 as _fsdp2

# torch 2.13+ only: on an older torch neither torch.distributed.fsdp nor cfsdp has the name
if _fsdp2.DataParallelMeshDims is not None:
    DataParallelMeshDims = _fsdp2.DataParallelMeshDims
# torch 2.15+ only: the handle of an asynchronous FSDPModule.finalize_backward (torch's class)
if _fsdp2.GradientReductionHandle is not None:
    GradientReductionHandle = _fsdp2.GradientReductionHandle

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
] + (["DataParallelMeshDims"] if _fsdp2.DataParallelMeshDims is not None else []) + (
    ["GradientReductionHandle"] if _fsdp2.GradientReductionHandle is not None else [])
