"""The ZeRO-2 hook (``reduce_scatter_hook``) against plain DDP + AdamW: parity, duplicate
parameters, accumulation, uneven inputs under Join."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import _harness as h
import cfsdp
from cfsdp import optim as co
from zero.common import batch, _dup_params, groups, Net, OPTIMS, raises, same, STEPS, _zero_of


def close(what: str, a, b, W: int) -> None:
    """Bitwise at W = 2; at W = 3/4 the hook's sum runs in another order than DDP's
    all-reduce (and 1/3 is not exact): rtol 1e-5, atol 1e-6 (a few float32 roundings of
    values of order 1, through five Adam steps)."""
    if W == 2:
        same(what, a, b)
        return
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what}[{i}]: {m}")
        else:
            assert x == y, f"{what}[{i}]: {x!r} != {y!r}"


class Zero2:
    """plain DDP + AdamW against DDP + reduce_scatter_hook + cfsdp's ZeRO (cfsdp.optim.AdamW),
    DDP in buckets of about 1 KiB (several per pass, rebuilt after the first)."""

    def __init__(self, pg, bucket_view: bool, grad_view: bool, clip: bool = True):
        self.pg, self.rank, self.W, self.clip = pg, dist.get_rank(pg), dist.get_world_size(pg), clip
        kw = dict(process_group=pg, gradient_as_bucket_view=grad_view, bucket_cap_mb=0.001)
        self.plain_m, self.zero_m = DDP(Net(), **kw), DDP(Net(), **kw)
        _, _, okw, _ = OPTIMS["adamw"]
        self.plain = torch.optim.AdamW(groups(self.plain_m, True), **okw)
        self.zero = cfsdp.ZeroRedundancyOptimizer(groups(self.zero_m, True), co.AdamW,
                                                  process_group=pg,
                                                  parameters_as_bucket_view=bucket_view, **okw)
        self.zero_m.register_comm_hook(self.zero, co.reduce_scatter_hook)
        self.losses: dict = {"plain": [], "zero": []}

    def backward(self, name: str, x, y):
        m = self.plain_m if name == "plain" else self.zero_m
        loss = F.mse_loss(m(x), y)
        loss.backward()
        return loss.detach()

    def check_grads(self, what: str) -> None:
        owner = self.zero._param_to_rank
        for i, (p, q) in enumerate(zip(self.plain_m.parameters(), self.zero_m.parameters())):
            if owner[q] == self.rank:
                close(f"{what} owned grad {i}", [q.grad], [p.grad], self.W)
            else:
                assert q.grad is None, f"{what}: grad {i} of a parameter another rank owns"

    def step(self, step_no: int) -> None:
        if self.clip:
            norms = (torch.nn.utils.clip_grad_norm_(self.plain_m.parameters(), 0.5),
                     self.zero.clip_grad_norm_(0.5))
            close(f"step {step_no} grad norm", [norms[1]], [norms[0]], self.W)
        self.plain.step()
        self.zero.step()

    def check(self) -> None:
        close("losses", self.losses["zero"], self.losses["plain"], self.W)
        close("params", list(self.zero_m.parameters()), list(self.plain_m.parameters()), self.W)


@h.subtest(grid={"bucket_view": [False, True], "grad_view": [False, True]})
def hook_parity(ctx, bucket_view, grad_view):
    """ZeRO-2: after each backward a rank holds DDP's averaged gradients for the
    parameters it owns and None for the others; zero.clip_grad_norm_ equals torch's
    clip_grad_norm_ of the full gradients; losses, parameters and the consolidated state
    dicts equal plain DDP + AdamW's (see ``close`` for the tolerance at 3/4 ranks)."""
    z = Zero2(ctx.pg, bucket_view, grad_view)
    for step in range(STEPS):
        x, y = batch(ctx.rank, step)
        for name, opt in (("plain", z.plain), ("zero", z.zero)):
            opt.zero_grad(set_to_none=True)
            z.losses[name].append(z.backward(name, x, y))
        z.check_grads(f"step {step}")
        z.step(step)
    z.check()
    for to in range(ctx.world_size):
        z.zero.consolidate_state_dict(to)
        if ctx.rank == to:
            want, got = z.plain.state_dict(), z.zero.state_dict()
            same("state keys", sorted(got["state"]), sorted(want["state"]))
            for i in want["state"]:
                close(f"state {i}", list(got["state"][i].values()),
                      list(want["state"][i].values()), ctx.world_size)


@h.subtest(grid={"layout": ["two_ranks", "thrice", "big_twice"], "bucket_view": [False, True]})
def hook_duplicate_parameters(ctx, layout, bucket_view):
    """ZeRO-2 with a parameter listed twice (see duplicate_parameters): every rank that
    steps a copy gets its reduced gradient, so parameters and the consolidated state dict
    are torch's ZeRO-1's (DDP's gradients; ``close``'s tolerance at 3/4 ranks)."""
    kw = dict(process_group=ctx.pg, bucket_cap_mb=0.001)
    cls, _, okw, _ = OPTIMS["sgd"]
    out = {}
    for name in ("torch", "cfsdp"):
        model = DDP(Net(), **kw)
        opt, _ = _zero_of(name, _dup_params(layout, list(model.parameters())), cls, ctx.pg,
                          bucket_view, okw, record=False)
        if name == "cfsdp":
            model.register_comm_hook(opt, co.reduce_scatter_hook)
        values = []
        for step in range(3):
            x, y = batch(ctx.rank, step)
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            opt.step()
            values += [p.detach().clone() for p in model.parameters()]
        opt.consolidate_state_dict(0)
        out[name] = (values, opt.state_dict() if ctx.rank == 0 else None)
    close("parameters after each step", out["cfsdp"][0], out["torch"][0], ctx.world_size)
    if ctx.rank == 0:
        got, want = out["cfsdp"][1], out["torch"][1]
        same("state keys", sorted(got["state"]), sorted(want["state"]))
        for i in want["state"]:
            close(f"state {i}", list(got["state"][i].values()), list(want["state"][i].values()),
                  ctx.world_size)


@h.subtest
def hook_accumulation(ctx):
    """Two micro-batches under ddp.no_sync(), the third synchronised: equal to plain DDP
    doing the same.  A second synchronised backward before step()/zero_grad() raises."""
    z = Zero2(ctx.pg, True, False, clip=False)
    for step in range(3):
        for name, opt in (("plain", z.plain), ("zero", z.zero)):
            opt.zero_grad(set_to_none=True)
            m = z.plain_m if name == "plain" else z.zero_m
            for micro in range(3):
                x, y = batch(ctx.rank, 10 * step + micro)
                if micro < 2:
                    with m.no_sync():
                        z.backward(name, x, y)
                else:
                    z.losses[name].append(z.backward(name, x, y))
        z.check_grads(f"step {step}")
        z.step(step)
    z.check()
    x, y = batch(ctx.rank, 99)
    z.backward("zero", x, y)
    e = raises(z.backward, "zero", x, y)
    assert isinstance(e, RuntimeError) and "ddp.no_sync()" in str(e), e
    wrong = DDP(Net(), process_group=ctx.pg)  # registered with a state that is not the ZeRO
    wrong.register_comm_hook(None, co.reduce_scatter_hook)
    e = raises(lambda: F.mse_loss(wrong(x), y).backward())
    assert "register it with the cfsdp.optim.ZeroRedundancyOptimizer" in str(e), e


@h.subtest(grid={"bucket_view": [False, True]})
def hook_join_uneven_inputs(ctx, bucket_view):
    """ZeRO-2 under Join([ddp, zero]) with 3 + r inputs on rank r, no gradient-setting
    hook: a joined rank gets its owned gradients from DDP's shadow reductions through
    the hook and keeps stepping them.  The last rank's parameters follow plain DDP +
    AdamW under ddp.join() (whose joined ranks stop stepping); at the end every rank
    holds the same parameters."""
    W, rank = ctx.world_size, ctx.rank
    z = Zero2(ctx.pg, bucket_view, False, clip=False)
    inputs = [batch(rank, 50 + i) for i in range(3 + rank)]
    for name, opt, ctxm in (("plain", z.plain, z.plain_m.join()),
                            ("zero", z.zero, Join([z.zero_m, z.zero]))):
        with ctxm:
            for x, y in inputs:
                opt.zero_grad(set_to_none=True)
                z.losses[name].append(z.backward(name, x, y))
                opt.step()
    finals = [None] * W
    dist.all_gather_object(finals, [p.detach() for p in z.zero_m.parameters()], group=ctx.pg)
    for r in range(1, W):
        same(f"rank {r}'s parameters", finals[r], finals[0])
    if rank == W - 1:
        z.check()
