"""Join with uneven inputs, as torch's own Join test."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as DDP

import _harness as h
import cfsdp
from zero.common import bcast, same


class _SetGrads(Joinable):
    """After joining, a rank must still set the gradients it would have had (torch's own
    Join test): this Joinable's hook sets them before the ZeRO hook steps."""

    def __init__(self, pg):
        super().__init__()
        self.pg = pg

    def join_hook(self, **kwargs) -> JoinHook:
        outer = kwargs["zero_params"], kwargs["grads"]

        class Hook(JoinHook):
            def __init__(self):
                self.i = 0

            def main_hook(self):
                params, grads = outer
                for p, g in zip(params, grads[self.i]):
                    p.grad = g.clone()
                self.i += 1

        return Hook()

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return self.pg


@h.subtest(grid={"bucket_view": [False, True]})
def join_uneven_inputs(ctx, bucket_view):
    """Rank r has 3 + r inputs per epoch (torch's Join test): the reference is DDP +
    Adam under DDP's join on the last rank; both ZeROs, under Join with a gradient
    setter, must follow its parameters bit for bit every iteration."""
    W, rank, epochs = ctx.world_size, ctx.rank, 2
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 3))
    g = torch.Generator().manual_seed(100 + rank)
    inputs = [torch.randn(20, 2, generator=g) for _ in range(3 + rank)]
    labels = torch.randn(20, 3, generator=torch.Generator().manual_seed(7))
    ddp = DDP(copy.deepcopy(base), process_group=ctx.pg)
    ref_opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    grads, params = [], []
    with ddp.join():
        for _ in range(epochs):
            for x in inputs:
                F.mse_loss(ddp(x), labels).backward()
                grads.append([p.grad.detach().clone() for p in ddp.parameters()])
                ref_opt.step()
                params.append([p.detach().clone() for p in ddp.parameters()])
    grads, params = bcast((grads, params), ctx.pg, src=W - 1)
    for cls in (TorchZeRO, cfsdp.ZeroRedundancyOptimizer):
        model = copy.deepcopy(base)
        zero = cls(model.parameters(), torch.optim.Adam, process_group=ctx.pg,
                   parameters_as_bucket_view=bucket_view, lr=0.01)
        setter = _SetGrads(ctx.pg)
        after = epochs * (W - 1 - rank)
        with Join([setter, zero], zero_params=list(model.parameters()),
                  grads=grads[len(grads) - after:]):
            it = 0
            for _ in range(epochs):
                for _x in inputs:
                    Join.notify_join_context(setter)
                    for p, gr in zip(model.parameters(), grads[it]):
                        p.grad = gr.clone()
                    zero.step()
                    same(f"{cls.__module__} iteration {it}", list(model.parameters()),
                         params[it])
                    it += 1
