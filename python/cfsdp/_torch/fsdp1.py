"""FSDP1's internals the wrapper face reuses, so it behaves as the installed torch's FSDP1.

* ``init_intra_and_inter_node_groups``: the hybrid strategies' intra-node (shard) and inter-node
  (replicate) groups, built with torch's own builder when ``process_group=None``.
* ``TrainingState``: torch FSDP1's training-state enum, whose names appear in torch's messages
  that cfsdp repeats.
* ``override_module_mixed_precision``: ``MixedPrecision._module_classes_to_ignore``'s wrapping.
* ``LOW_PRECISION_HOOKS``: torch's fp16/bf16 compression communication hooks.
* ``ActivationWrapper``: the base class of activation checkpointing's wrappers.
* ``create_chunk_dtensor``, ``create_chunk_sharded_tensor``: torch's sharded optimizer-state
  entries (dim-0 chunks as a ``DTensor`` or a ``ShardedTensor``).

The same in torch 2.11 to 2.15 (``tests/unit/test_torch_compat.py`` checks them on
each).  FSDP1's own numbers (gradient pre/post-divide factors, reduce-scatter and all-reduce ops,
mixed-precision casts) did not change between these versions either.
"""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.algorithms._comm_hooks import LOW_PRECISION_HOOKS
from torch.distributed.fsdp._common_utils import TrainingState
from torch.distributed.fsdp._common_utils import (
    _override_module_mixed_precision as override_module_mixed_precision,
)
from torch.distributed.fsdp._init_utils import (
    _init_intra_and_inter_node_groups as init_intra_and_inter_node_groups,
)
from torch.distributed.fsdp._shard_utils import _create_chunk_dtensor as create_chunk_dtensor
from torch.distributed.fsdp._shard_utils import (
    _create_chunk_sharded_tensor as create_chunk_sharded_tensor,
)

__all__ = ["ActivationWrapper", "LOW_PRECISION_HOOKS", "TrainingState", "create_chunk_dtensor",
           "create_chunk_sharded_tensor", "init_intra_and_inter_node_groups",
           "override_module_mixed_precision"]
