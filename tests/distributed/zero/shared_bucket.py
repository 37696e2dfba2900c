"""[Note: ZeRO shared bucket]: where the bucket views are one host-shared bucket and where
private buckets, with torch's numbers."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

import _harness as h
import cfsdp
from cfsdp._runtime import comm
from cfsdp.optim import _zero_buckets
from zero.common import batch, check_shared, Net, OPTIMS, same, shared_expected, Trio


@h.subtest
def shared_bucket_rule(ctx):
    """[Note: ZeRO shared bucket]: the bucket views are one host-shared bucket where the
    rule says so (checked in ``parity`` too), and private buckets, with torch's numbers,
    where it does not: ranks whose initial values differ (against torch's ZeRO without
    DDP, which keeps each rank's values until the first step), ranks on emulated hosts
    (a host key per pair of ranks at 4 ranks: two levels; per rank at 2 and 3: the
    process group), a bucket file the peers cannot see (a directory per rank: a private
    /dev/shm), an optimizer whose step is not known to evaluate the closure first."""
    want = shared_expected(ctx.pg)
    t = Trio(ctx.pg, "cfsdp_adamw", True, net=dict(frozen=True))
    check_shared(t.opts["cfsdp"], want)
    t.train(2)
    t.check_same("shared: ")

    # initial values that differ between ranks
    cls, ours, kw, _ = OPTIMS["adamw"]
    models = {"torch": Net(), "cfsdp": Net()}
    with torch.no_grad():
        for m in models.values():
            m.mid.weight.add_(ctx.rank)
    opts = {"torch": TorchZeRO(models["torch"].parameters(), cls, process_group=ctx.pg,
                               parameters_as_bucket_view=True, **kw),
            "cfsdp": cfsdp.ZeroRedundancyOptimizer(models["cfsdp"].parameters(), ours,
                                                   process_group=ctx.pg,
                                                   parameters_as_bucket_view=True, **kw)}
    check_shared(opts["cfsdp"], False)
    for step in range(3):
        x, y = batch(ctx.rank, step)
        out = {}
        for n, m in models.items():
            opts[n].zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opts[n].step()
            out[n] = (loss.detach(), list(m.parameters()))
        same(f"differing initial values, step {step}", out["cfsdp"], out["torch"])

    # emulated hosts: 2 x 2 ranks at 4 ranks (two levels), else one rank per host
    real, host = comm._host_id, ctx.rank // 2 if ctx.world_size == 4 else ctx.rank
    comm._host_id = lambda: f"{real()}|emulated-host-{host}"
    try:
        pg = dist.new_group(list(range(ctx.world_size)), backend="gloo", timeout=h.PG_TIMEOUT)
        t = Trio(pg, "cfsdp_adamw", True, torch_zero=False)
    finally:
        comm._host_id = real
    check_shared(t.opts["cfsdp"], False)
    assert comm.describe(pg).startswith("two levels" if ctx.world_size == 4 else "process"), \
        comm.describe(pg)
    t.train(2)
    t.check_same("emulated hosts: ")

    # a bucket file each rank looks for in a directory of its own
    with tempfile.TemporaryDirectory(prefix="cfsdp-zero-test-") as d:
        old, _zero_buckets.SHM_DIR = _zero_buckets.SHM_DIR, d
        try:
            t = Trio(ctx.pg, "cfsdp_adamw", True, torch_zero=False)
        finally:
            _zero_buckets.SHM_DIR = old
        check_shared(t.opts["cfsdp"], False)
        assert os.listdir(d) == [], os.listdir(d)
    t.train(2)
    t.check_same("private directories: ")

    # a step that may re-evaluate the closure between writes (LBFGS), or unknown
    class OwnStep(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    for opt_cls in (torch.optim.LBFGS, OwnStep):
        z = cfsdp.ZeroRedundancyOptimizer(Net().parameters(), opt_cls, process_group=ctx.pg,
                                          parameters_as_bucket_view=True, lr=0.1)
        check_shared(z, False)
        assert z._share is None
    assert want == (cfsdp.ZeroRedundancyOptimizer(
        Net().parameters(), torch.optim.Adagrad, process_group=ctx.pg,
        parameters_as_bucket_view=True, lr=0.1)._share is not None)
