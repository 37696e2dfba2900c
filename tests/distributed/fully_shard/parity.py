"""Structure (placements, shapes, state-dict keys) and training parity, bitwise as torch's
fully_shard and as the single process."""

from __future__ import annotations

import copy
from typing import Callable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import _harness as h
import parity_common as pc
from dcp_common import assert_equal, describe
from fs_common import (
    CFSDP,
    Scenario,
    TORCH,
    build,
    local,
    local_chunk,
    mesh_1d,
    run_scenario,
    shard,
    shard_index,
)


# --------------------------------------------------------------------------------------------
# 1. structure
# --------------------------------------------------------------------------------------------


def check_structure(ctx: h.Context, mm: pc.Mismatches, kind: str, mesh: DeviceMesh,
                    placements: tuple | Callable[[nn.Parameter], tuple],
                    unit_kw: dict | None = None) -> None:
    """``placements``: every parameter's, or a function of the original parameter giving
    them; ``unit_kw``: fully_shard's keywords (units and root)."""
    orig = build(kind)
    t = shard(TORCH, build(kind), mesh, unit_kw)
    c = shard(CFSDP, build(kind), mesh, unit_kw)
    idx, n = shard_index(mesh)
    units = {id(u) for u in c.fsdp_units()} | {id(c)}
    for (name, mod), (_, omod), (_, tmod) in zip(c.named_modules(), orig.named_modules(), t.named_modules()):
        who = f"module {name or '<root>'}"
        if id(mod) in units:
            mm.check(type(mod).__name__ == "FSDP" + type(omod).__name__,
                     f"{who}: class {type(mod).__name__}, expected FSDP{type(omod).__name__}")
            mm.check(isinstance(mod, CFSDP.FSDPModule), f"{who}: not an instance of cfsdp.FSDPModule")
            mm.check(isinstance(mod, type(omod)), f"{who}: not an instance of {type(omod).__name__}")
        else:
            mm.check(type(mod) is type(omod) and not isinstance(mod, CFSDP.FSDPModule),
                     f"{who}: class {type(mod).__name__} (not a fully_shard unit: must stay "
                     f"{type(omod).__name__})")
        mm.check(type(tmod).__name__ == type(mod).__name__,
                 f"{who}: class {type(mod).__name__}, torch's {type(tmod).__name__}")
    names = [n_ for n_, _ in c.named_parameters()]
    mm.check(names == [n_ for n_, _ in orig.named_parameters()],
             f"named_parameters() {names} != unwrapped {[n_ for n_, _ in orig.named_parameters()]}")
    mm.check(names == [n_ for n_, _ in t.named_parameters()],
             f"named_parameters() {names} != torch's {[n_ for n_, _ in t.named_parameters()]}")
    tp, op = dict(t.named_parameters()), dict(orig.named_parameters())
    for name, p in c.named_parameters():
        if name not in tp or name not in op:
            continue
        mm.check(isinstance(p, nn.Parameter) and isinstance(p, DTensor),
                 f"{name}: {type(p).__name__}, expected an nn.Parameter holding a DTensor")
        if not isinstance(p, DTensor):
            continue
        want = placements(op[name]) if callable(placements) else placements
        mm.check(tuple(p.placements) == want, f"{name}: placements {p.placements} != {want}")
        mm.check(p.device_mesh == mesh, f"{name}: mesh {p.device_mesh} is not the given mesh {mesh}")
        mm.check(p.shape == op[name].shape, f"{name}: global shape {tuple(p.shape)} != {tuple(op[name].shape)}")
        mm.check(p.requires_grad == op[name].requires_grad, f"{name}: requires_grad {p.requires_grad}")
        mm.check(p.dtype == op[name].dtype, f"{name}: dtype {p.dtype}")
        mm.tensors(f"{name}: to_local()", p.to_local(), local(tp[name]))
        mm.tensors(f"{name}: to_local() vs chunk {idx} of the original", p.to_local(),
                   local_chunk(op[name].detach(), idx, n, want[-1].dim), b_name="original")
    # buffers: unchanged, plain tensors
    cb, ob = list(c.named_buffers()), list(orig.named_buffers())
    mm.check([b for b, _ in cb] == [b for b, _ in ob], f"buffers {[b for b, _ in cb]} != {[b for b, _ in ob]}")
    for (bn, b), (_, ob_) in zip(cb, ob):
        mm.check(not isinstance(b, DTensor), f"buffer {bn} became a DTensor")
        mm.tensors(f"buffer {bn}", b, ob_, b_name="original")
    # state_dict(): keys in order, types, placements, local values
    csd, tsd = c.state_dict(), t.state_dict()
    mm.check(list(csd) == list(orig.state_dict()),
             f"state_dict() keys {list(csd)} != unwrapped {list(orig.state_dict())}")
    try:
        assert_equal(describe(csd), describe(tsd), "state_dict()")
    except AssertionError as e:
        mm.add(str(e))
    try:  # a common way to keep a snapshot of the weights
        assert_equal(describe(copy.deepcopy(csd)), describe(tsd), "copy.deepcopy(state_dict())")
    except Exception as e:  # noqa: BLE001 - reported with the other mismatches
        mm.add(f"copy.deepcopy(state_dict()): {type(e).__name__}: {e}")


@h.subtest(grid={"kind": ["mlp", "lm", "frozen"]})
def structure(ctx, kind: str):
    mm = pc.Mismatches(ctx)
    check_structure(ctx, mm, kind, mesh_1d(ctx), (Shard(0),))
    mm.raise_if_any()


# --------------------------------------------------------------------------------------------
# 2. parity
# --------------------------------------------------------------------------------------------


@h.subtest(grid={"kind": ["mlp", "lm", "frozen"], "reshard_after_forward": [True, False],
                 "optim": ["adamw", "sgd"]})
def parity(ctx, kind: str, reshard_after_forward: bool, optim: str):
    run_scenario(ctx, Scenario(kind=kind, optim=optim,
                               unit_kw={"reshard_after_forward": reshard_after_forward}))
