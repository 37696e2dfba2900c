"""DTensor internals cfsdp builds its DTensors with.

cfsdp makes a unit's DTensor parameters, gradients and state-dict entries from local views with
a ``DTensorSpec`` built once per (shape, mesh, placements) (torch's FSDP2 does the same through
``DTensor``'s private constructor), redistributes tensor-parallel local tensors with
``redistribute_local_tensor``, and names FSDP2's placement of a tensor-parallel parameter
sharded twice on one dim, ``_StridedShard``.  All of them are the same in torch 2.11 to
2.15 (``redistribute_local_tensor(local, current_spec, target_spec, *, async_op=False, ...)``;
``DTensorSpec(mesh, placements, tensor_meta=...)``; ``TensorMeta(shape, stride, dtype)``;
``_StridedShard(dim, split_factor=...)``), which ``tests/unit/test_torch_compat.py`` checks on
each.
"""

from __future__ import annotations

from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

__all__ = ["DTensorSpec", "StridedShard", "TensorMeta", "make_contiguous_strides_for",
           "redistribute_local_tensor"]
