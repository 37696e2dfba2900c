"""What worker_tp.py shares with worker_spmd.py: the sharders (``SHARDERS``: torch's and cfsdp's
fully_shard on a TP mesh), the comparison of two trained models (``snapshot``, ``compare``,
``describe_sd``) and the DCP save/load of a model and optimizer.  Registers no subtest
(tests/unit/test_harness_imports.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import parity_common as pc

import cfsdp

SHARDERS = {"torch": torch_fully_shard, "cfsdp": cfsdp.fully_shard}
STEPS = 3


def snapshot(model) -> dict[str, Any]:
    """Placements, local value and full value of every parameter; local gradients."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = (tuple(p.placements), p.to_local().detach().clone(), p.full_tensor().detach().clone(),
                  None if g is None else (tuple(g.placements), g.to_local().detach().clone()))
    return out


def describe_sd(sd: dict) -> dict:
    return {k: (type(v).__name__, tuple(v.placements) if isinstance(v, DTensor) else None,
                (v.to_local() if isinstance(v, DTensor) else v).detach().clone())
            for k, v in sd.items()}


def compare(mm: pc.Mismatches, what: str, c: Any, t: Any) -> None:
    if c is None or t is None:
        mm.check(c is None and t is None, f"{what}: cfsdp {c!r}, torch {t!r}")
    elif isinstance(t, dict):
        mm.check(list(c) == list(t), f"{what}: keys {list(c)[:4]}... != torch's {list(t)[:4]}...")
        for k in t:
            if k in c:
                compare(mm, f"{what}[{k}]", c[k], t[k])
    elif isinstance(t, (list, tuple)):
        mm.check(type(c) is type(t) and len(c) == len(t), f"{what}: {c!r} != torch's {t!r}")
        for i, (a, b) in enumerate(zip(c, t)):
            compare(mm, f"{what}[{i}]", a, b)
    elif isinstance(t, torch.Tensor) or isinstance(c, torch.Tensor):
        mm.tensors(what, c, t)
    else:
        mm.check(c == t, f"{what}: {c!r} != torch's {t!r}")


# ----------------------------------------------------------------------------- checkpoints


def dcp_save(model, opt, path) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))


def dcp_load(model, opt, path) -> None:
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
