"""cfsdp: torch's FSDP with its hot paths in C.

Switch a training script with one import::

    from cfsdp import FullyShardedDataParallel as FSDP

Public names mirror ``torch.distributed.fsdp.__all__`` of the installed torch (2.11.x to
2.15.x: ``cfsdp/_torch/``); configs and enums are torch's own objects.  ``cfsdp.backend`` says which core runs: ``"c"``
(default) or ``"python"`` (``CFSDP_IMPL=python``, the pure-Python twins).
``cfsdp.patch_torch()`` (or ``python -m cfsdp.run script.py``) points torch's own FSDP names at
cfsdp's, for code you cannot edit.  ``cfsdp.ZeroRedundancyOptimizer`` (also
``cfsdp.optim.ZeroRedundancyOptimizer``) is torch.distributed.optim's ZeRO-1; like
``patch_torch`` it is not in ``__all__``, which mirrors ``torch.distributed.fsdp``'s.
"""

from . import _torch  # first: a torch outside the supported range is an ImportError naming it
from ._core import backend
from . import api as _api
from .api import (
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
from ._fully_shard import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from .fully_sharded_data_parallel import FullyShardedDataParallel
from .parallel import pre_dp_module_transform
from ._patch import patch_torch, unpatch_torch  # torch's FSDP names -> cfsdp's (code you cannot edit)
from . import wrap  # noqa: E402  (as torch.distributed.fsdp.wrap after importing the package)
from . import optim  # noqa: E402  (cfsdp.optim: fused Adam/AdamW/SGD over flat shards, ZeRO)
from .optim import ZeroRedundancyOptimizer  # noqa: E402  (torch.distributed.optim's ZeRO-1)
from .checkpoint import state_dict as _checkpoint_state_dict  # noqa: E402

# torch.distributed.checkpoint.state_dict's helpers (get_state_dict, set_state_dict, ...) hand
# models holding a cfsdp wrapper to cfsdp.checkpoint.state_dict (see its module doc)
_checkpoint_state_dict.install_torch_dispatch()

__version__ = "0.1.0"

__all__ = [
    # FSDP1
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    # FSDP2
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "fully_shard",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "register_fsdp_forward_method",
    "UnshardHandle",
    "share_comm_ctx",
]
if "GradientReductionHandle" in _api.__all__:  # torch 2.15+: torch's class (cfsdp/_torch/fsdp2.py)
    GradientReductionHandle = _api.GradientReductionHandle
    __all__.append("GradientReductionHandle")
if "DataParallelMeshDims" in _api.__all__:  # torch 2.13+ (cfsdp/_torch/fsdp2.py)
    DataParallelMeshDims = _api.DataParallelMeshDims
else:
    __all__.remove("DataParallelMeshDims")
