"""What several feature modules of worker_strategies.py share: the hybrid strategies and their
2 x 2 mesh, the strategies grid, the parameters written after wrapping and the tied model. A
helper: it registers no subtest."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as SS

from cfsdp import FullyShardedDataParallel as CFSDP
from parity_common import CPU, build, make_policy


HYBRID = (SS.HYBRID_SHARD, SS._HYBRID_SHARD_ZERO2)
_MESH = {}


def hybrid_mesh():
    """A (replicate=2, shard=W/2) mesh over all ranks, made once per spawn."""
    if "mesh" not in _MESH:
        _MESH["mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2))
    return _MESH["mesh"]


def one_rank_shard_mesh():
    """A (replicate=W, shard=1) mesh over all ranks, made once per spawn."""
    if "one_rank_shards" not in _MESH:
        _MESH["one_rank_shards"] = init_device_mesh("cpu", (dist.get_world_size(), 1))
    return _MESH["one_rank_shards"]


def groups_kw(ctx, strategy, how: str) -> dict:
    if strategy not in HYBRID:
        return {"process_group": ctx.pg}
    mesh = hybrid_mesh()
    if how == "mesh":
        return {"process_group": None, "device_mesh": mesh}
    return {"process_group": (mesh.get_group(1), mesh.get_group(0))}


def strategies(world: int) -> list:
    out = [SS.SHARD_GRAD_OP, SS.NO_SHARD]
    return out + list(HYBRID) if world == 4 else out


# one grid for both world sizes: hybrid points are skipped at W=2 inside the subtest
GRID_STRATEGIES = [SS.FULL_SHARD, SS.SHARD_GRAD_OP, SS.NO_SHARD, *HYBRID]


# parameters written after wrapping (one in each unit kind: root, a block, the root's LayerNorm)
WRITTEN = (("pos", None), ("blocks.1.mlp.0", "weight"), ("ln_f", "bias"), ("blocks.0.attn.q", "bias"))


def _written(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of each WRITTEN parameter, found through attributes as a user would
    (``model``: a wrapper, or the unwrapped single-process model)."""
    root = model.module if isinstance(model, (TorchFSDP, CFSDP)) else model
    out = []
    for path, name in WRITTEN:
        if name is None:
            out.append((root, path))
            continue
        mod = root
        for part in path.split("."):
            mod = getattr(mod, part)
        mod = mod.module if isinstance(mod, (TorchFSDP, CFSDP)) else mod
        out.append((mod, name))
    return out


def _orig_params_model(ctx, strategy) -> tuple[nn.Module, dict]:
    """The transformer and the wrapper arguments (use_orig_params=True, a unit per module) of
    the subtests on the original parameters."""
    kw = dict(groups_kw(ctx, strategy, "tuple"), use_orig_params=True, device_id=CPU,
              sharding_strategy=strategy, auto_wrap_policy=make_policy("module"))
    return build("transformer"), kw


class TiedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class TiedLM(nn.Module):
    """Embedding and output head share one weight (GPT-2 style)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.Sequential(TiedBlock(), TiedBlock())
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.blocks(self.emb(x)))
