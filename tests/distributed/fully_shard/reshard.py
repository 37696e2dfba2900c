"""DCP resharding across world sizes (test_fully_shard_reshard): ``CFSDP_FS_PHASE`` names the
phases a launch registers, in order (``reshard_save``, ``reshard_load``; nothing without it),
and worker_fully_shard.py then runs only these (see its docstring)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import _harness as h
import ckpt_common as cc
from fs_common import CFSDP, Scenario, batches, mesh_1d, run_steps
from fully_shard.common import IMPLS
from fully_shard.checkpoint import dcp_load, dcp_save, trained


PHASE = os.environ.get("CFSDP_FS_PHASE", "")
RESHARD_RTOL = 1e-5


def _global_losses(ctx, losses: list[torch.Tensor]) -> list[float]:
    out = []
    for loss in losses:
        t = loss.detach().clone()
        dist.all_reduce(t, group=ctx.pg)
        out.append((t / ctx.world_size).item())
    return out


def reshard_save(ctx):
    mesh = mesh_1d(ctx)
    data = batches("lm1", 4, ctx.world_size)
    root = cc.ckpt_dir(ctx, f"fully_shard_reshard/w{ctx.world_size}")
    want = {}
    for name, impl in IMPLS.items():
        model, opt = trained(impl, ctx, mesh, "lm1", data[:2])
        dcp_save(ctx, model, opt, str(root / name))
        want[name] = _global_losses(ctx, run_steps(impl, Scenario(kind="lm1"), model, opt, data[2:], ctx.rank, []))
    if ctx.rank == 0:
        (root / "losses.json").write_text(json.dumps({"world_size": ctx.world_size, "losses": want}))


def reshard_load(ctx):
    mesh = mesh_1d(ctx)
    root = cc.reshard_source(ctx, "fully_shard_reshard")
    saved = json.loads((root / "losses.json").read_text())
    if saved["world_size"] == ctx.world_size:
        raise AssertionError("the resharding test must load at another world size")
    data = batches("lm1", 4, ctx.world_size)
    for writer in IMPLS:
        model, opt = trained(CFSDP, ctx, mesh, "lm1", None, seed=1)
        dcp_load(ctx, model, opt, str(root / writer))
        got = _global_losses(ctx, run_steps(CFSDP, Scenario(kind="lm1"), model, opt, data[2:], ctx.rank, []))
        cc.assert_same_losses(got, saved["losses"][writer],
                              f"{writer} at W={saved['world_size']} -> cfsdp at W={ctx.world_size}",
                              rtol=RESHARD_RTOL)


for _phase in [p for p in PHASE.split(",") if p]:
    h.subtest({"reshard_save": reshard_save, "reshard_load": reshard_load}[_phase])
