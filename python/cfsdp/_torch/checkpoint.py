"""Checkpoint internals: torch's sharded-tensor format, its state-dict helpers' steps, DCP's writer.

* ``ShardedTensor`` and its metadata (``torch.distributed._shard``): FSDP1's SHARDED and LOCAL
  state-dict entries; cfsdp builds them as torch does, from local shards and global metadata
  (``init_from_local_shards_and_global_metadata``).
* ``gather_state_dict``: torch's all-gather of a state dict's sharded entries.
* ``dsd``: ``torch.distributed.checkpoint.state_dict``, whose private steps (``DSD_STEPS``) cfsdp
  routes for models holding a cfsdp wrapper (``cfsdp/checkpoint/state_dict.py``), and the
  private helpers it reuses for the optimizer state (``StateDictInfo``, ``init_optim_state``,
  ``flatten_optim_state_dict``, ``unflatten_optim_state_dict``, ``split_optim_state_dict``,
  ``gc_context``, ``iterate_valid_model_state``, ``get_fqns``).  ``DSD_STEPS`` lists each step
  with its parameters: import fails, naming the step, when the installed torch's differs (cfsdp's
  replacement would then be called with other arguments).
* ``FileSystemWriterBase`` (``_FileSystemWriter``) and ``api_bc_check``: what ``dcp_save``
  redirects and how it keeps ``dcp.save``'s old positional form.
* ``IncompatibleKeys`` (``load_state_dict``'s result type) and ``pytree``.

The same in torch 2.11 to 2.15 (the DSD steps' parameters included).
"""

from __future__ import annotations

import inspect

from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed._shard.sharding_spec import ShardMetadata
from torch.distributed._state_dict_utils import _gather_state_dict as gather_state_dict
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.checkpoint.filesystem import _FileSystemWriter as FileSystemWriterBase
from torch.distributed.checkpoint.utils import _api_bc_check as api_bc_check
from torch.nn.modules.module import _IncompatibleKeys as IncompatibleKeys
from torch.utils import _pytree as pytree

from . import VERSION_STRING

init_from_local_shards_and_global_metadata = ShardedTensor._init_from_local_shards_and_global_metadata

# the steps of torch's DSD helpers that cfsdp replaces in ``dsd`` (each looked up there at call
# time by torch's public functions), with the parameters cfsdp's replacements take
DSD_STEPS: dict[str, tuple[str, ...]] = {
    "_verify_options": ("model", "optims", "optim_only", "submodules", "options"),
    "_get_model_state_dict": ("model", "info"),
    "_get_optim_state_dict": ("model", "optimizers", "info"),
    "_load_model_state_dict": ("model", "state_dict", "info"),
    "_load_optim_state_dict": ("model", "optimizers", "state_dict", "info"),
}

StateDictInfo = dsd._StateDictInfo
init_optim_state = dsd._init_optim_state
flatten_optim_state_dict = dsd._flatten_optim_state_dict
unflatten_optim_state_dict = dsd._unflatten_optim_state_dict
split_optim_state_dict = dsd._split_optim_state_dict
gc_context = dsd._gc_context
iterate_valid_model_state = dsd._iterate_valid_model_state
get_fqns = dsd._get_fqns


def _check_dsd_steps() -> None:
    for name, params in DSD_STEPS.items():
        fn = getattr(dsd, name, None)
        # cfsdp's dispatchers may already be installed (a reload): they take the same params
        got = None if fn is None else tuple(inspect.signature(fn).parameters)
        if got != params:
            raise ImportError(
                f"cfsdp: torch {VERSION_STRING}'s torch.distributed.checkpoint.state_dict.{name} "
                f"takes {got}, cfsdp's replacement {params}; cfsdp/_torch/checkpoint.py needs an "
                "update for this torch."
            )


_check_dsd_steps()

__all__ = ["DSD_STEPS", "FileSystemWriterBase", "IncompatibleKeys", "Shard", "ShardMetadata",
           "ShardedTensor", "ShardedTensorMetadata", "StateDictInfo", "TensorProperties",
           "api_bc_check", "dsd", "flatten_optim_state_dict", "gather_state_dict", "gc_context",
           "get_fqns", "init_from_local_shards_and_global_metadata", "init_optim_state",
           "iterate_valid_model_state", "pytree", "split_optim_state_dict",
           "unflatten_optim_state_dict"]
