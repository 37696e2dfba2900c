"""Models, data and training steps shared by worker_checkpoint.py and worker_dcp.py.

The model is worker_parity's TinyTransformer, auto-wrapped per Block, trained with AdamW.
Data is one *global* batch per step, split into ``world`` equal chunks, so runs at different
world sizes see the same data and their global (mean) losses agree up to rounding.
Checkpoint files go under ``$CFSDP_CKPT_DIR`` (a pytest ``tmp_path``), one folder a subtest.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy

import _harness as h
import parity_common as pc

from cfsdp import FullyShardedDataParallel as CFSDP

CPU = torch.device("cpu")
GLOBAL_BATCH = 8
WRAPPERS = {"torch": TorchFSDP, "cfsdp": CFSDP}


def ckpt_dir(ctx: h.Context, name: str) -> Path:
    """A folder shared by every rank (same host): ``$CFSDP_CKPT_DIR/<name>``."""
    root = os.environ.get("CFSDP_CKPT_DIR")
    if not root:
        raise AssertionError("CFSDP_CKPT_DIR is not set (the pytest test passes its tmp_path)")
    d = Path(root) / name
    if ctx.rank == 0:
        d.mkdir(parents=True, exist_ok=True)
    dist.barrier(group=ctx.pg)
    return d


def reshard_source(ctx: h.Context, name: str) -> Path:
    """The checkpoint a resharding load reads: the one folder ``$CFSDP_CKPT_DIR/<name>/w<W>``
    saved at a world size W other than this launch's."""
    root = ckpt_dir(ctx, name)
    others = sorted(d for d in root.glob("w*") if d.name != f"w{ctx.world_size}")
    if len(others) != 1:
        raise AssertionError(f"{root}: want one checkpoint of another world size, found "
                             f"{[d.name for d in others]}")
    return others[0]


def batches(steps: int, world: int, seed: int = 7):
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + step)
        x = torch.randint(0, pc.VOCAB, (GLOBAL_BATCH, pc.SEQ), generator=g)
        y = torch.randint(0, pc.VOCAB, (GLOBAL_BATCH, pc.SEQ), generator=g)
        out.append(list(zip(x.chunk(world), y.chunk(world))))
    return out


HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
# the strategies a world size can run: hybrid ones need 2 replicas x 2 shards
STRATEGIES = {
    2: [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD],
    4: [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD, *HYBRID],
}


def make(ctx: h.Context, impl: str, uop: bool, seed: int = 0, strategy=None):
    """(wrapped model, AdamW) for ``impl`` in WRAPPERS; ``seed`` picks the initial weights.
    A hybrid ``strategy`` runs on a (2, W/2) device mesh (replicas, shards)."""
    groups: dict = {"process_group": ctx.pg}
    if strategy in HYBRID:
        groups = {"device_mesh": init_device_mesh("cpu", (2, ctx.world_size // 2))}
    model = WRAPPERS[impl](
        pc.build("transformer", seed),
        use_orig_params=uop,
        device_id=CPU,
        auto_wrap_policy=pc.make_policy("module"),
        sharding_strategy=strategy,
        **groups,
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def strategies_here(ctx: h.Context, strategy) -> bool:
    """Whether this world size runs ``strategy`` (a grid point it cannot run passes)."""
    return strategy in STRATEGIES[ctx.world_size]


def train(ctx: h.Context, model, opt, steps) -> list[float]:
    """One optimizer step per batch; returns the global mean losses."""
    losses = []
    for chunks in steps:
        x, y = chunks[ctx.rank]
        opt.zero_grad(set_to_none=True)
        loss = pc.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t, group=ctx.pg)
        losses.append((t / ctx.world_size).item())
    return losses


def assert_same_losses(got: list[float], want: list[float], what: str, rtol: float = 0.0) -> None:
    ok = len(got) == len(want) and all(
        abs(a - b) <= rtol * abs(b) for a, b in zip(got, want)
    )
    if not ok:
        raise AssertionError(f"{what}: losses {got} != {want} (rtol {rtol})")
