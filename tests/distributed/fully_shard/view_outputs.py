"""A unit returning a view that the caller modifies in place."""

from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.distributed.fsdp as torch_fsdp

import _harness as h
import parity_common as pc
from fs_common import CFSDP, SELFTEST, TORCH, mesh_1d
from fully_shard.common import raised

import cfsdp


# --------------------------------------------------------------------------------------------
# A unit returning a view that the caller modifies in place ([Note: view outputs] in hooks.py)
# --------------------------------------------------------------------------------------------
class _ViewOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).view(-1, 8)  # a view of the Linear's output


class _InPlaceOnViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = _ViewOut(), _ViewOut(), nn.Linear(8, 1)

    def forward(self, x):
        y = self.a(x)
        y += 1.0  # in place on a unit's view output
        z = self.b(y)
        z.mul_(2.0)
        return self.head(z).pow(2).mean()


@h.subtest(grid={"face": ["fully_shard", "wrapper", "wrapper_orig"]})
def view_output_modified_in_place(ctx, face: str):
    """torch's FSDP2 and FSDP1 lose the pre-backward hook of a unit whose view output is
    modified in place: backward then fails on the freed parameters (FSDP2: "setStorage ... out
    of bounds for storage of size 0", after its forward's warning "can cause backward to fail or
    produce wrong gradients"; FSDP1: a training-state assertion).  cfsdp also hooks the view's
    base and trains; oracle: the single process on every rank's batch (torch's failure is
    checked, so this test says when torch starts to work)."""
    if SELFTEST:
        return
    torch.manual_seed(0)
    ref = _InPlaceOnViews()
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(ctx.world_size)]
    mm = pc.Mismatches(ctx)
    model = copy.deepcopy(ref)
    tm = copy.deepcopy(ref)
    if face == "fully_shard":
        for m, fs in ((model, CFSDP.fully_shard), (tm, TORCH.fully_shard)):
            fs(m.a, mesh=mesh_1d(ctx))
            fs(m.b, mesh=mesh_1d(ctx))
            fs(m, mesh=mesh_1d(ctx))
    else:
        orig = face == "wrapper_orig"
        for name in ("a", "b"):
            setattr(model, name, cfsdp.FullyShardedDataParallel(getattr(model, name), use_orig_params=orig))
            setattr(tm, name, torch_fsdp.FullyShardedDataParallel(getattr(tm, name), use_orig_params=orig,
                                                                 device_id=torch.device("cpu")))
        model = cfsdp.FullyShardedDataParallel(model, use_orig_params=orig)
        tm = torch_fsdp.FullyShardedDataParallel(tm, use_orig_params=orig, device_id=torch.device("cpu"))
    with contextlib.redirect_stderr(open(os.devnull, "w")):  # FSDP1 prints a stack first
        t_err = raised(lambda: tm(xs[ctx.rank]).backward())
    mm.check(t_err is not None, "torch's FSDP now trains a view output modified in place: use it "
                                "as the oracle")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(xs[ctx.rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = sum(ref(x) for x in xs) / ctx.world_size
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        mm.tensors("loss vs the single process", global_loss / ctx.world_size, ref_loss.detach(),
                   exact=False, b_name="ref")
    if face == "fully_shard":
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
    else:
        with cfsdp.FullyShardedDataParallel.summon_full_params(model):
            full = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for n, p in model.named_parameters()}
    for n, q in ref.named_parameters():
        mm.check(n in full, f"{n}: not among the trained model's parameters {sorted(full)}")
        if n in full:
            mm.tensors(f"{n} vs the single process", full[n], q.detach(), exact=False, b_name="ref")
    mm.raise_if_any()
