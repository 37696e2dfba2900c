"""The order and sizes of the collectives of a step, under each backward and forward prefetch,
as torch FSDP1 issues them."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import BackwardPrefetch
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import _harness as h
from cfsdp import FullyShardedDataParallel as CFSDP
from parity_common import CPU, Mismatches


class OrderBlock(nn.Module):
    def __init__(self, extra: int):
        super().__init__()
        self.lin = nn.Linear(8, 8 + extra)  # a different size per unit, to tell them apart

    def forward(self, x):
        return torch.relu(self.lin(x))[..., :8]


_COLLECTIVES = {"all_gather": "AG", "all_gather_into_tensor": "AG", "all_gather_single": "AG",
                "reduce_scatter_tensor": "RS", "reduce_scatter_single": "RS"}


@contextlib.contextmanager
def record_collectives(events: list):
    """Record (kind, numel) of every all-gather / reduce-scatter issued, by patching
    torch.distributed (torch's FSDP1 calls through it) and cfsdp's comm.py (whose
    shared-memory path does not call torch.distributed; a comm call that falls back to
    the process group is recorded once)."""
    from cfsdp._runtime import comm

    saved = {name: getattr(dist, name) for name in _COLLECTIVES}
    saved_comm = {"all_gather": comm.all_gather, "reduce_scatter": comm.reduce_scatter}
    inside_comm = [0]

    def make(name, orig):
        def fn(*args, **kwargs):
            out = args[0]
            if not inside_comm[0]:
                events.append((_COLLECTIVES[name], sum(t.numel() for t in out) if isinstance(out, list) else out.numel()))
            return orig(*args, **kwargs)
        return fn

    def make_comm(kind, orig):
        def fn(*args, **kwargs):
            events.append((kind, args[0].numel()))
            inside_comm[0] += 1
            try:
                return orig(*args, **kwargs)
            finally:
                inside_comm[0] -= 1
        return fn

    try:
        for name, orig in saved.items():
            setattr(dist, name, make(name, orig))
        for name, orig in saved_comm.items():
            setattr(comm, name, make_comm("AG" if name == "all_gather" else "RS", orig))
        yield
    finally:
        for name, orig in saved.items():
            setattr(dist, name, orig)
        for name, orig in saved_comm.items():
            setattr(comm, name, orig)


@h.subtest(grid={"backward_prefetch": [BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST, None],
                 "forward_prefetch": [False, True]})
def collective_order(ctx, backward_prefetch, forward_prefetch: bool):
    """The order of all-gathers and reduce-scatters in a steady-state step (the third), as
    torch's prefetch tests check it: identical to torch FSDP1's, except that with
    forward_prefetch=True torch 2.13 also all-gathers one unit further ahead in backward
    (BACKWARD_PRE and None); there cfsdp's order is the one backward_prefetch alone asks for,
    checked against torch with forward_prefetch=False."""
    mm = Mismatches(ctx)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8), OrderBlock(1), OrderBlock(2), OrderBlock(3), nn.Linear(8, 1))
    seqs = []
    for wrapper, fp in ((TorchFSDP, forward_prefetch), (CFSDP, forward_prefetch), (TorchFSDP, False)):
        model = wrapper(copy.deepcopy(base), process_group=ctx.pg, device_id=CPU,
                        auto_wrap_policy=ModuleWrapPolicy({OrderBlock}),
                        backward_prefetch=backward_prefetch, forward_prefetch=fp)
        events: list = []
        g = torch.Generator().manual_seed(ctx.rank)
        for _ in range(3):
            events.clear()
            with record_collectives(events):
                model(torch.randn(4, 8, generator=g)).sum().backward()
        seqs.append(events)
    torch_seq, cfsdp_seq, torch_nofp = seqs
    expected = torch_seq
    if forward_prefetch and backward_prefetch != BackwardPrefetch.BACKWARD_POST:
        expected = torch_nofp
    mm.check(cfsdp_seq == expected, f"collectives issued in a step:\n    cfsdp {cfsdp_seq}\n    torch {expected}")
    mm.raise_if_any()
