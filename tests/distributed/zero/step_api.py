"""step(): closures, extra keyword arguments and new state keys; the constructor's errors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as DDP

import _harness as h
import cfsdp
from zero.common import batch, Net, raises, same, same_error


@h.subtest(grid={"bucket_view": [False, True]})
def closure_kwargs_and_new_keys(ctx, bucket_view):
    """step(closure) returns the closure's loss; extra step kwargs reach the local
    optimizer; a key the local optimizer adds to its groups shows in param_groups;
    zero_grad sets every gradient to None (torch's tests, against torch's ZeRO)."""

    class SGDKwarg(torch.optim.SGD):
        def step(self, closure=None, kwarg=None):
            super().step()
            kwarg.append(5)
            self.param_groups[0]["new_key"] = 0.1

    out = {}
    for name, cls in (("torch", TorchZeRO), ("cfsdp", cfsdp.ZeroRedundancyOptimizer)):
        m = DDP(Net(), process_group=ctx.pg)
        o = cls(m.parameters(), torch.optim.SGD, process_group=ctx.pg,
                parameters_as_bucket_view=bucket_view, lr=0.1)
        x, y = batch(ctx.rank, 0)

        def closure():
            o.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            return loss

        loss = o.step(closure)
        o.zero_grad()
        assert all(p.grad is None for p in m.parameters())
        k = DDP(Net(), process_group=ctx.pg)
        ok = cls(k.parameters(), SGDKwarg, process_group=ctx.pg,
                 parameters_as_bucket_view=bucket_view, lr=0.1)
        F.mse_loss(k(x), y).backward()
        kwarg: list = []
        ok.step(kwarg=kwarg)
        assert kwarg == [5]
        out[name] = (loss.detach(), list(m.parameters()), list(k.parameters()),
                     ok.param_groups[0].get("new_key"))
    same("closure / kwargs / new key", out["cfsdp"], out["torch"])
    assert out["cfsdp"][3] == 0.1


@h.subtest
def constructor_errors(ctx):
    """Bad ``params``, functional optimizers, sparse parameters, ``overlap_with_ddp``:
    torch's exception types and messages (torch refuses overlap_with_ddp on gloo in its
    DDP hook; cfsdp at construction, with that message)."""
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim.utils import functional_optim_map

    m = Net()
    cases = [
        ([], {}),
        (torch.randn(3), {}),
        (1.2, {}),
        (list(m.parameters()) + [42], {}),
        ([{"lr": 0.1}], {}),
        ([torch.sparse_coo_tensor(size=(2, 3))], {}),
        (list(m.parameters()), dict(optimizer_class=functional_optim_map[torch.optim.SGD])),
        (list(m.parameters()), dict(optimizer_class=torch.optim.LBFGS, overlap_with_ddp=True)),
    ]
    for params, kw in cases:
        kw = {"optimizer_class": torch.optim.SGD, **kw}
        ours = raises(cfsdp.ZeroRedundancyOptimizer, params, process_group=ctx.pg, lr=0.1, **kw)
        theirs = raises(TorchZeRO, params, process_group=ctx.pg, lr=0.1, **kw)
        same_error(ours, theirs)
    ddp = DDP(Net(), process_group=ctx.pg)
    tz = TorchZeRO(ddp.parameters(), torch.optim.SGD, process_group=ctx.pg,
                   overlap_with_ddp=True, lr=0.1)
    theirs = raises(hook_with_zero_step, allreduce_hook, ddp, tz)
    ours = raises(cfsdp.ZeroRedundancyOptimizer, ddp.parameters(), torch.optim.SGD,
                  process_group=ctx.pg, overlap_with_ddp=True, lr=0.1)
    same_error(ours, theirs)
    assert "overlap_with_ddp=False" in str(ours)
