"""A parameter listed twice (or more) in one group, or in two groups, as torch."""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

import _harness as h
import cfsdp
from zero.common import _dup_grads, _dup_params, Net, OPTIMS, raises, same, same_error, _zero_of


@h.subtest(grid={"layout": ["two_ranks", "same_rank", "thrice", "big_twice"],
                 "optim": ["sgd", "adam", "cfsdp_sgd", "cfsdp_adamw"], "bucket_view": [False, True]})
def duplicate_parameters(ctx, layout, optim, bucket_view):
    """A parameter listed twice (or three times) in one group: torch's Optimizer warns
    ("duplicate parameters") and keeps the copies; its ZeRO partitions them like any
    parameters, so each rank whose share holds a copy steps it (once per copy, the local
    optimizer's own duplicate), and the parameter sync decides which rank's result every
    rank gets.  cfsdp's ZeRO: the same warnings, parameters after every step, param_groups,
    local partition and consolidated state dict as torch's, bit for bit."""
    cls, ours, kw, _ = OPTIMS[optim]
    out = {}
    for name in ("torch", "cfsdp"):
        model = Net()
        ps = list(model.parameters())
        opt, msgs = _zero_of(name, _dup_params(layout, ps), cls if name == "torch" else ours,
                             ctx.pg, bucket_view, kw)
        where = {id(p): i for i, p in enumerate(ps)}
        seen = [[[where[id(p)] for p in g["params"]] for g in opt.param_groups],
                [[where[id(p)] for p in g["params"]] for g in opt.optim.param_groups]]
        values = []
        for step in range(3):
            _dup_grads(ps, step)
            opt.step()
            values.append([p.detach().clone() for p in ps])
        opt.consolidate_state_dict(0)
        sd = opt.state_dict() if ctx.rank == 0 else None
        out[name] = (msgs, seen, values, sd)
    (tm, ts, tv, tsd), (cm, cs, cv, csd) = out["torch"], out["cfsdp"]
    assert tm, "torch no longer warns about duplicate parameters: revisit this test"
    same("duplicate-parameter warnings", cm, tm)
    same("param_groups / local param_groups (parameter indices)", cs, ts)
    same("parameters after each step", cv, tv)
    if ctx.rank == 0:
        same("consolidated state dict", csd, tsd)


@h.subtest(grid={"how": ["two_groups", "add_param_group"], "bucket_view": [False, True]})
def duplicate_across_groups(ctx, how, bucket_view):
    """A parameter in two param groups: torch's Optimizer refuses it ("some parameters
    appear in more than one parameter group"), at construction and in add_param_group;
    cfsdp's ZeRO the same (and is left as it was: it still steps as torch's)."""
    errs, after = {}, {}
    for name, ctor in (("torch", TorchZeRO), ("cfsdp", cfsdp.ZeroRedundancyOptimizer)):
        model = Net()
        ps = list(model.parameters())
        if how == "two_groups":
            errs[name] = raises(ctor, [{"params": ps[:3]}, {"params": ps[2:]}], torch.optim.SGD,
                                process_group=ctx.pg, parameters_as_bucket_view=bucket_view, lr=0.1)
            continue
        opt = ctor(ps[:3], torch.optim.SGD, process_group=ctx.pg,
                   parameters_as_bucket_view=bucket_view, lr=0.1)
        errs[name] = raises(opt.add_param_group, {"params": ps[2:]})
        _dup_grads(ps, 0)
        opt.step()
        after[name] = [p.detach().clone() for p in ps]
    same_error(errs["cfsdp"], errs["torch"])
    if after:
        same("parameters after a step", after["cfsdp"], after["torch"])
