"""A tensor-parallel model and its 2-D meshes, shared by the tensor-parallel workers.

``TPModel`` is a small language model whose every layer goes through one of torch's parallel
styles (``parallelize``): the embedding row-wise (its output replicated, or sharded on the
sequence dim under sequence parallelism), each block's MLP column-wise then row-wise, the
output projection column-wise; with ``sp`` the LayerNorms are ``SequenceParallel`` and the
blocks' boundaries go through ``PrepareModuleOutput`` / ``PrepareModuleInput``.  The vocabulary
(11) does not divide by 2 or 4, so TP shards are uneven; each block also holds plain
parameters (its LayerNorm when not sequence-parallel), so a unit mixes TP and plain ones.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

V, D, T, ROWS = 11, 12, 8, 4  # vocab, width, sequence, rows of the global batch


class TPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.w1 = nn.Linear(D, 4 * D)
        self.w2 = nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class TPModel(nn.Module):
    def __init__(self, n_blocks: int = 2):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(TPBlock() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, V)

    def forward(self, idx):
        x = self.tok(idx)
        for b in self.blocks:
            x = b(x)
        return self.out(self.norm(x))


def build(seed: int = 0) -> TPModel:
    torch.manual_seed(seed)
    return TPModel()


def parallelize(model: TPModel, tp_mesh, sp: bool) -> TPModel:
    seq = Shard(1)
    plan = {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else Replicate()),
        "out": ColwiseParallel(input_layouts=seq if sp else Replicate(), output_layouts=Replicate()),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, plan)
    for i, b in enumerate(model.blocks):
        bp = {"w1": ColwiseParallel(input_layouts=seq) if sp else ColwiseParallel(),
              "w2": RowwiseParallel(output_layouts=seq) if sp else RowwiseParallel()}
        if sp:
            bp["norm"] = SequenceParallel()
            bp[""] = (PrepareModuleOutput(output_layouts=seq, desired_output_layouts=seq) if i == 0
                      else PrepareModuleInput(input_layouts=seq, desired_input_layouts=seq,
                                              use_local_output=True))
        parallelize_module(b, tp_mesh, bp)
    return model


def meshes(world: int):
    """The (dp, tp) layouts a world size runs: 2 ranks (1, 2) and (2, 1), 4 ranks (2, 2)."""
    return [(1, 2), (2, 1)] if world == 2 else [(2, 2)]


def mesh_2d(dp: int, tp: int):
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def batches(steps: int, dp: int, seed: int = 5):
    """``[step][dp_rank] -> (x, y)``: one global batch per step split over the dp ranks (the TP
    ranks of one dp rank see the same rows, as tensor parallelism needs)."""
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + step)
        x = torch.randint(0, V, (ROWS, T), generator=g)
        y = torch.randint(0, V, (ROWS, T), generator=g)
        out.append(list(zip(x.chunk(dp), y.chunk(dp))))
    return out


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))


# ------------------------------------------------------------------ the full SPMD mesh (dp_mesh_dims)
# As torchtitan's default path builds a model: every parameter a DTensor on the whole mesh
# (data-parallel dims and ``tp``), Replicate() on the data-parallel dims, the tensor-parallel
# placement on ``tp``; the inputs DTensors too (the batch Shard(0) on the data-parallel dims,
# the sequence Shard(1) on ``cp``), so forward and backward are DTensor ops on the whole mesh
# and a weight's gradient arrives as a Partial sum on the batch-sharded dims.

SPMD_TP = {"w1.weight": Shard(0), "w1.bias": Shard(0), "w2.weight": Shard(1),
           "out.weight": Shard(0), "out.bias": Shard(0)}  # the rest: Replicate() on tp


class SPMDModel(nn.Module):
    """TPBlocks over a float input, a final norm and an output projection (no embedding:
    the inputs are DTensors of activations)."""

    def __init__(self, n_blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(TPBlock() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, V)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(self.norm(x))


def spmd_model(mesh, seed: int = 0) -> SPMDModel:
    """An SPMDModel whose parameters are DTensors on ``mesh`` (Replicate() but on ``tp``)."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(seed)
    model = SPMDModel()
    names = mesh.mesh_dim_names
    for mn, m in model.named_modules():
        for pn, p in list(m._parameters.items()):
            key = f"{mn.split('.')[-1]}.{pn}" if mn else pn
            pls = [SPMD_TP.get(key, Replicate()) if n == "tp" else Replicate() for n in names]
            m._parameters[pn] = nn.Parameter(distribute_tensor(p.detach(), mesh, pls),
                                             requires_grad=p.requires_grad)
    return model


def spmd_input(local: torch.Tensor, mesh):
    """This rank's rows (and sequence part on ``cp``) as a DTensor on the whole mesh."""
    from torch.distributed.tensor import DTensor

    pls = [Replicate() if n == "tp" else Shard(1) if n == "cp" else Shard(0)
           for n in mesh.mesh_dim_names]
    return DTensor.from_local(local, mesh, pls)


def spmd_rank(mesh) -> tuple[int, int]:
    """``(batch part, sequence part)`` of this rank: its coordinates on the data-parallel
    dims (row-major), and on ``cp``."""
    names = mesh.mesh_dim_names
    b = s = 0
    for i, n in enumerate(names):
        if n == "tp":
            continue
        if n == "cp":
            s = s * mesh.size(i) + mesh.get_local_rank(i)
        else:
            b = b * mesh.size(i) + mesh.get_local_rank(i)
    return b, s


def spmd_parts(mesh) -> tuple[int, int]:
    names = mesh.mesh_dim_names
    b = s = 1
    for i, n in enumerate(names):
        if n == "cp":
            s *= mesh.size(i)
        elif n != "tp":
            b *= mesh.size(i)
    return b, s


def spmd_batches(steps: int, mesh, seed: int = 5, micro: int = 1):
    """``[step][micro] -> (x, y)``: this rank's part of each step's global batch of
    activations (rows over the data-parallel dims, the sequence over ``cp``)."""
    nb, ns = spmd_parts(mesh)
    b, s = spmd_rank(mesh)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + step)
        x = torch.randn(ROWS * micro, T, D, generator=g)
        y = torch.randint(0, V, (ROWS * micro, T), generator=g)
        out.append([(xm.chunk(nb)[b].chunk(ns, dim=1)[s], ym.chunk(nb)[b].chunk(ns, dim=1)[s])
                    for xm, ym in zip(x.chunk(micro), y.chunk(micro))])
    return out
