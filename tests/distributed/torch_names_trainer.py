"""A trainer written against torch's FSDP names only, as third-party code is written.

It never names cfsdp.  It imports its names from the modules trainers take them from:
``torch.distributed.fsdp`` (torchtitan, Lightning), ``torch.distributed.fsdp.
fully_sharded_data_parallel`` (accelerate), ``torch.distributed._composable.fsdp`` (older
FSDP2 code) and ``torch.distributed.fsdp._fully_shard``.  worker_patch.py imports one copy of
it while torch is unpatched (torch's objects) and one after ``cfsdp.patch_torch()`` (cfsdp's),
and compares what they compute.  Both faces: the FSDP1 wrapper with an auto-wrap policy and
torch's static API (``fsdp_modules``, ``state_dict_type``, ``optim_state_dict``,
``optim_state_dict_to_load``, ``clip_grad_norm_``), and ``fully_shard`` per block then on the
root, with ``FSDPModule`` methods and ``register_fsdp_forward_method``, also from the meta
device as accelerate shards.

Sizes are chosen so no world size here divides them: chunks are padded and at 4 ranks some
ranks hold empty shards.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable.fsdp import fully_shard as composable_fully_shard
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.fsdp import (
    FSDPModule,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    StateDictType,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.fsdp._fully_shard import FSDPModule as PrivateFSDPModule
from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as FSDPFromSub
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

CPU = torch.device("cpu")
IN, WIDTH, HIDDEN, OUT, BATCH = 7, 9, 13, 3, 5
MAX_NORM = 0.05  # small enough that every step clips
# the names this module bound, for the worker's identity checks
BOUND = {
    "FullyShardedDataParallel": (FSDP, FSDPFromSub),
    "FSDPModule": (FSDPModule, PrivateFSDPModule),
    "UnshardHandle": (UnshardHandle,),
    "fully_shard": (fully_shard, composable_fully_shard),
    "register_fsdp_forward_method": (register_fsdp_forward_method,),
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(WIDTH, HIDDEN)
        self.lin2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(F.gelu(self.lin1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        """A method other than forward (an FSDP2 model calls it after
        ``register_fsdp_forward_method``)."""
        return self.forward(x).sum(-1)


def build(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batches(rank: int, steps: int, seed: int = 11) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return [(torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g))
            for _ in range(steps)]


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


# ------------------------------------------------------------------------------ FSDP1 wrapper
def wrap_fsdp1(model: nn.Module, pg, use_orig_params: bool) -> nn.Module:
    """As accelerate does: the class from fully_sharded_data_parallel, an auto-wrap policy."""
    return FSDPFromSub(model, process_group=pg, auto_wrap_policy=ModuleWrapPolicy({Block}),
                       use_orig_params=use_orig_params, device_id=CPU)


def train_fsdp1(model: nn.Module, opt: torch.optim.Optimizer, data) -> tuple[list, list]:
    """Losses and (clipped) total norms; the norm through torch's class, unbound."""
    losses, norms = [], []
    for x, y in data:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        norms.append(FSDP.clip_grad_norm_(model, MAX_NORM, norm_type=float("inf")))
        opt.step()
        losses.append(loss.detach())
    return losses, norms


# full state dicts on every rank.  Not the optimizer config's default offload_to_cpu=True: on
# CPU ranks with use_orig_params=True torch 2.13 then gives every state of a unit the values of
# the last one gathered (see worker_optim_state_dict.torch_offload_bug); cfsdp does not
FULL = (StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False))


def fsdp1_checkpoint(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, dict, dict]:
    """(number of FSDP units, full model state dict, full optimizer state dict)."""
    units = len(FSDP.fsdp_modules(model))
    with FSDP.state_dict_type(model, *FULL):
        return units, model.state_dict(), FSDP.optim_state_dict(model, opt)


def fsdp1_resume(model: nn.Module, opt: torch.optim.Optimizer, msd: dict, osd: dict) -> None:
    with FSDP.state_dict_type(model, *FULL):
        model.load_state_dict(msd)
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, osd))


# ---------------------------------------------------------------------------- fully_shard
def shard_fsdp2(model: Net, mesh: DeviceMesh) -> Net:
    """As torchtitan does: each block, then the root; the blocks through the older
    ``torch.distributed._composable.fsdp`` name."""
    for b in model.blocks:
        composable_fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not isinstance(model, FSDPModule):
        raise AssertionError(f"{type(model).__name__} is not torch's FSDPModule name's class")
    register_fsdp_forward_method(model, "score")
    return model


def shard_fsdp2_from_meta(model: Net, mesh: DeviceMesh) -> Net:
    """As accelerate's FSDP2 path with ``cpu_ram_efficient_loading`` (its launcher's default):
    the model goes to the meta device, is sharded there, and takes its values back through
    ``load_state_dict(assign=True)`` of DTensors made by ``distribute_tensor`` (the root unit's
    parameters live in two modules, ``inp`` and ``out``: loaded one after the other)."""
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model = shard_fsdp2(model.to(torch.device("meta")), mesh)
    sharded = {k: distribute_tensor(full[k], v.device_mesh, v.placements)
               for k, v in model.state_dict().items()}
    model.load_state_dict(sharded, assign=True)
    return model


def train_fsdp2(model: Net, opt: torch.optim.Optimizer, data) -> tuple[list, list]:
    losses, norms = [], []
    for x, y in data:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        # the 2-norm: torch's inf norm fails on a rank whose shard is empty
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).full_tensor())
        opt.step()
        losses.append(loss.detach())
    return losses, norms


def fsdp2_extras(model: Net, x: torch.Tensor) -> dict:
    """``score`` (a registered forward method) in eval, an explicit unshard/reshard, and the
    model's own (DTensor) state dict."""
    with torch.no_grad():
        score = model.score(x)
    handle = model.unshard(async_op=True)
    if not isinstance(handle, UnshardHandle):
        raise AssertionError(f"unshard(async_op=True) gave {type(handle).__name__}")
    handle.wait()
    model.reshard()
    return {"score": score, "state_dict": model.state_dict()}
