"""Tied parameters: within the root unit (as torch allows) and across two units, also as one
submodule in both (refused)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import _harness as h
from cfsdp import FullyShardedDataParallel as CFSDP
from parity_common import CPU, Mismatches, make_optim
from strategies.common import TiedBlock, TiedLM


@h.subtest(grid={"use_orig_params": [False, True], "policy": ["blocks", "none"]})
def tied_parameters(ctx, use_orig_params: bool, policy: str):
    """Tied embedding/head in the root unit (the way torch allows): losses, names and the
    full state dict (both FQNs present, as torch) bitwise equal to torch FSDP1. Tying across
    two units (a parameter, or a whole submodule in both) is refused with a ValueError naming
    the parameter (torch trains it wrongly, or fails in forward)."""
    mm = Mismatches(ctx)
    torch.manual_seed(0)
    base = TiedLM()
    record = []
    for wrapper in (TorchFSDP, CFSDP):
        pol = ModuleWrapPolicy({TiedBlock}) if policy == "blocks" else None
        model = wrapper(copy.deepcopy(base), process_group=ctx.pg, device_id=CPU,
                        use_orig_params=use_orig_params, auto_wrap_policy=pol)
        opt = make_optim("adamw", model.parameters())
        g = torch.Generator().manual_seed(ctx.rank)
        losses = []
        for _ in range(4):
            x = torch.randint(0, 11, (3, 5), generator=g)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        record.append((losses, [n for n, _ in model.named_parameters()], model.state_dict()))
    (tl, tn, tsd), (cl, cn, csd) = record
    for i, (a, b) in enumerate(zip(cl, tl)):
        mm.tensors(f"loss at step {i}", a, b)
    mm.check(cn == tn, f"named_parameters {cn} != torch {tn}")
    mm.check(list(csd) == list(tsd), f"state_dict keys {list(csd)} != torch {list(tsd)}")
    for k in tsd:
        mm.tensors(f"state_dict[{k}]", csd.get(k), tsd[k])
    try:
        CFSDP(copy.deepcopy(base), process_group=ctx.pg, use_orig_params=use_orig_params,
              auto_wrap_policy=ModuleWrapPolicy({nn.Embedding, nn.Linear}))
    except ValueError as e:
        mm.check("weight" in str(e) and "common ancestor" in str(e), f"tied across units: {e}")
    else:
        mm.add("tied parameters across two units did not raise")
    # one submodule in two units (each block's ``lin`` is the same Linear): refused the same
    # way, also with use_orig_params=False, where the second unit finds the first unit's views
    # in that module's __dict__ (torch's FSDP1 wraps it and fails in the first forward: a shape
    # error, or "setStorage ... out of bounds" on the freed storage of those views)
    shared = nn.Sequential(TiedBlock(), TiedBlock())
    shared[1].lin = shared[0].lin
    try:
        CFSDP(shared, process_group=ctx.pg, use_orig_params=use_orig_params,
              auto_wrap_policy=ModuleWrapPolicy({TiedBlock}))
    except ValueError as e:
        mm.check("'lin.weight'" in str(e) and "common ancestor" in str(e), f"shared submodule: {e}")
    else:
        mm.add("a submodule shared by two units did not raise")
    mm.raise_if_any()
