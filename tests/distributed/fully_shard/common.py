"""What several feature modules of worker_fully_shard.py share: the world size, torch-version
flags, the contenders by name, shard placements and small checks. A helper: it registers no
subtest."""

from __future__ import annotations

import inspect
import os

import torch
import torch.nn as nn
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp._fully_shard import _fsdp_common
from torch.distributed.tensor import DTensor, Shard

from fs_common import CFSDP, Impl, TORCH


WORLD = int(os.environ.get("WORLD_SIZE", "1"))
BF16 = torch.bfloat16

# torch 2.12+ features (read from the installed torch, not from cfsdp's mirror of it)
_TORCH_HAS_DP_MESH_DIMS = "dp_mesh_dims" in inspect.signature(torch_fsdp.fully_shard).parameters
_TORCH_SHARD_PLACEMENT_RESULT = getattr(_fsdp_common, "ShardPlacementResult", None)
# torch 2.12+ also shards non-float parameters and refuses weights tied across fully_shard
# calls; 2.11 does neither (the subtests say what they compare with there)
_TORCH_2_12 = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 12)
_TORCH_SHARDS_INT_PARAMS = _TORCH_REFUSES_TIED_ACROSS_UNITS = _TORCH_2_12
IMPLS = {"torch": TORCH, "cfsdp": CFSDP}


def largest_dim(p: nn.Parameter) -> Shard:
    """torch's shard_placement_fn of test_init_1d_transformer_shard_largest_dim (the first
    largest dim)."""
    return Shard(max(range(p.dim()), key=lambda d: p.shape[d]))


def fsdp_modules(impl: Impl, model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, impl.FSDPModule)]


def assert_all_sharded(model: nn.Module, where: str) -> None:
    bad = [n for n, p in model.named_parameters()
           if not (isinstance(p, nn.Parameter) and isinstance(p, DTensor))]
    if bad:
        raise AssertionError(f"{where}: parameters not registered as sharded DTensors: {bad}")


def raised(fn) -> BaseException | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the exception is the result
        return e
    return None
