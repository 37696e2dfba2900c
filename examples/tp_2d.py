"""2-D training on CPU ranks: tensor parallelism on the ``tp`` dimension of a ``(dp, tp)``
mesh, data parallelism (cfsdp's FSDP, either face, or DDP) on ``dp``.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 examples/tp_2d.py --dp 1 --tp 2
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 examples/tp_2d.py --face wrapper

``--face`` picks the data-parallel half: ``fully_shard`` (the default), ``wrapper``
(``FullyShardedDataParallel(device_mesh=mesh["dp"])``) or ``ddp``
(``cfsdp.pre_dp_module_transform`` then ``DistributedDataParallel``).  ``--impl torch`` runs
the same script on torch's FSDP2 / FSDP1 / DDP instead: rank 0 prints the same losses.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import cfsdp

VOCAB, WIDTH, SEQ, ROWS = 64, 32, 16, 8  # ROWS: the global batch, split over the dp ranks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)  # a plain parameter beside the TP ones
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, n_blocks: int = 4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(mesh, face: str, impl: str = "cfsdp") -> nn.Module:
    """The model, tensor-parallel on ``mesh["tp"]``, data-parallel on ``mesh["dp"]``."""
    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:  # Megatron-style MLP: column-wise, then row-wise
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fsdp = cfsdp if impl == "cfsdp" else torch.distributed.fsdp
    if face == "fully_shard":
        for block in model.blocks:
            fsdp.fully_shard(block, mesh=mesh["dp"])
        return fsdp.fully_shard(model, mesh=mesh["dp"])
    if face == "wrapper":
        return fsdp.FullyShardedDataParallel(
            model, device_mesh=mesh["dp"], device_id=torch.device("cpu"),
            auto_wrap_policy=torch.distributed.fsdp.wrap.ModuleWrapPolicy({Block}))
    if face == "ddp":
        if impl == "cfsdp":  # torch's DDP calls torch's own transform given device_mesh
            cfsdp.pre_dp_module_transform(model)
            return nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
        return nn.parallel.DistributedDataParallel(model, device_mesh=mesh["dp"])
    raise ValueError(f"unknown face {face!r}")


def train(mesh, face: str, impl: str = "cfsdp", steps: int = 5) -> list[float]:
    """Train ``steps`` AdamW steps; returns the global-batch loss of each step."""
    model = build(mesh, face, impl)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    losses = []
    for _ in range(steps):  # one fixed batch: the loss falls as the model learns it
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
        x, y = tokens.chunk(dp)[dp_rank][:, :-1], tokens.chunk(dp)[dp_rank][:, 1:]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())  # the TP ranks agree already
        losses.append(mean.item() / dp)
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world / tp)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--face", choices=["fully_shard", "wrapper", "ddp"], default="fully_shard")
    p.add_argument("--impl", choices=["cfsdp", "torch"], default="cfsdp")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    dp = args.dp or dist.get_world_size() // args.tp
    mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    losses = train(mesh, args.face, args.impl, args.steps)
    if dist.get_rank() == 0:
        print(f"{args.impl} {args.face} on (dp, tp) = {(dp, args.tp)}: losses "
              + " ".join(f"{v:.6f}" for v in losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
