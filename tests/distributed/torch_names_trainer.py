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
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
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
from torch.distributed.fsdp import MixedPrecisionPolicy
import torch.distributed.fsdp as _fsdp_names

DataParallelMeshDims = getattr(_fsdp_names, "DataParallelMeshDims", None)  # torch 2.13+

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


# ------------------------------------------------------- torchtitan's full-DTensor path
# torchtitan 0.3.0's parallelize_llama with a full-DTensor backend, reproduced (torchtitan
# itself does not train on CPU: README, "torchtitan"): every parameter a DTensor on the whole
# (data-parallel x tp) mesh, the inputs too, then its apply_fsdp_to_decoder: fully_shard with
# dp_mesh_dims (from torch.distributed.fsdp, 2.13+) and a bf16 / fp32 policy on the token
# embedding, [norm, lm_head] as one unit, each layer, the root; set_gradient_divide_factor(1.0)
# on every FSDP module (the loss is divided by the global token count instead).
TITAN_V, TITAN_D, TITAN_H, TITAN_T = 13, 8, 12, 6  # vocab, width, hidden, sequence
TITAN_TP = {"w1": Shard(0), "w3": Shard(0), "w2": Shard(1), "lm_head": Shard(0)}


class TitanBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ffn_norm = nn.RMSNorm(TITAN_D)
        self.w1 = nn.Linear(TITAN_D, TITAN_H, bias=False)
        self.w3 = nn.Linear(TITAN_D, TITAN_H, bias=False)
        self.w2 = nn.Linear(TITAN_H, TITAN_D, bias=False)

    def forward(self, x):
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TitanLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(TITAN_V, TITAN_D)
        self.layers = nn.ModuleDict({str(i): TitanBlock() for i in range(2)})
        self.norm = nn.RMSNorm(TITAN_D)
        self.lm_head = nn.Linear(TITAN_D, TITAN_V, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.lm_head(self.norm(h))


def titan_build(mesh: DeviceMesh, seed: int = 0) -> TitanLike:
    """TitanLike with every parameter a DTensor on ``mesh`` (tp placements on ``tp``)."""
    torch.manual_seed(seed)
    model = TitanLike()
    for mn, m in model.named_modules():
        for pn, p in list(m._parameters.items()):
            if p is None:
                continue
            tp = TITAN_TP.get(mn.rsplit(".", 1)[-1], Replicate())
            pls = [tp if n == "tp" else Replicate() for n in mesh.mesh_dim_names]
            m._parameters[pn] = nn.Parameter(distribute_tensor(p.detach(), mesh, pls))
    return model


def titan_shard(model: TitanLike, mesh: DeviceMesh, force_sum: bool) -> TitanLike:
    """apply_fsdp_to_decoder's calls (reshard_after_forward policy "default", no pipeline);
    ``force_sum``: torch's oracle on gloo, which has no PREMUL_SUM for the divide factor."""
    names = mesh.mesh_dim_names
    dims = DataParallelMeshDims(shard="dp_shard",
                                replicate="dp_replicate" if "dp_replicate" in names else None)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                     cast_forward_inputs=False)
    fsdp_config = {"mesh": mesh, "mp_policy": mp_policy, "dp_mesh_dims": dims}
    fully_shard(model.tok_embeddings, **fsdp_config, reshard_after_forward=True)
    fully_shard([model.norm, model.lm_head], **fsdp_config, reshard_after_forward=False)
    for block in model.layers.values():
        fully_shard(block, **fsdp_config, reshard_after_forward=True)
    fully_shard(model, **fsdp_config)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            if force_sum:
                m.set_force_sum_reduction_for_comms(True)
    return model


def titan_batches(mesh: DeviceMesh, steps: int, seed: int = 3) -> list:
    """This rank's rows of each step's global batch (rows over the data-parallel dims)."""
    dp = [i for i, n in enumerate(mesh.mesh_dim_names) if n != "tp"]
    parts, me = 1, 0
    for i in dp:
        parts, me = parts * mesh.size(i), me * mesh.size(i) + mesh.get_local_rank(i)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 100 + step)
        tokens = torch.randint(0, TITAN_V, (4, TITAN_T + 1), generator=g)
        out.append(tokens.chunk(parts)[me])
    return out


def titan_train(model: TitanLike, mesh: DeviceMesh, data) -> list:
    """AdamW steps on inputs wrapped as DTensors (the batch Shard(0) on the data-parallel
    dims), the loss summed over tokens and divided by the global token count."""
    from torch.distributed.tensor import DTensor

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    in_pl = [Replicate() if n == "tp" else Shard(0) for n in mesh.mesh_dim_names]
    losses = []
    for rows in data:
        tokens = DTensor.from_local(rows[:, :-1], mesh, in_pl)
        logits = model(tokens).redistribute(placements=in_pl).to_local()
        total = 4 * TITAN_T
        loss = F.cross_entropy(logits.float().reshape(-1, TITAN_V), rows[:, 1:].reshape(-1),
                               reduction="sum") / total
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses
