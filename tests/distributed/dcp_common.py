"""What worker_dcp.py shares: its state-dict description and comparison (``describe``,
``assert_equal``) and its resharding save (``reshard_save``, also run on emulated hosts by
worker_hosts.py).  Registers no subtest (tests/unit/test_harness_imports.py).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as torch_dsd
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

import ckpt_common as cc


# torch's own helpers for both: cfsdp models reach cfsdp.checkpoint.state_dict through them
DSD = {"torch": torch_dsd, "cfsdp": torch_dsd}


def describe(v: Any) -> Any:
    """A value reduced to what must match exactly between torch and cfsdp."""
    if isinstance(v, ShardedTensor):
        md = v.metadata()
        return ("ShardedTensor", tuple(md.size), md.tensor_properties.dtype,
                [(tuple(s.shard_offsets), tuple(s.shard_sizes), s.placement.rank())
                 for s in md.shards_metadata],
                [s.tensor for s in v.local_shards()])
    if isinstance(v, DTensor):
        return ("DTensor", tuple(v.shape), v.dtype, v.placements, v.to_local())
    if isinstance(v, torch.Tensor):
        return ("Tensor", tuple(v.shape), v.dtype, v)
    if isinstance(v, dict):
        return {k: describe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(describe(x) for x in v)
    return v


def assert_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
            raise AssertionError(f"{where}: {a!r} != {b!r}")
    elif isinstance(a, dict) and isinstance(b, dict):
        if list(a.keys()) != list(b.keys()):
            raise AssertionError(f"{where}: keys {list(a.keys())} != {list(b.keys())}")
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            raise AssertionError(f"{where}: {a!r} != {b!r}")
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    elif a != b:
        raise AssertionError(f"{where}: {a!r} != {b!r}")


def dcp_save(ctx, impl: str, model, opt, path) -> None:
    msd, osd = DSD[impl].get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path), process_group=ctx.pg)


# ----------------------------------------------------------------------------- resharding


def reshard_save(ctx):
    """Both use_orig_params: each trains, saves through torch's helpers + DCP, trains on."""
    for uop in (False, True):
        path = cc.ckpt_dir(ctx, f"reshard/w{ctx.world_size}/uop{int(uop)}")
        data = cc.batches(4, ctx.world_size)
        model, opt = cc.make(ctx, "cfsdp", uop)
        cc.train(ctx, model, opt, data[:2])
        dcp_save(ctx, "cfsdp", model, opt, path / "dcp")
        want = cc.train(ctx, model, opt, data[2:])
        if ctx.rank == 0:
            (path / "losses.json").write_text(json.dumps({"world_size": ctx.world_size, "losses": want}))
