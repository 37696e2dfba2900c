"""torch's own ``torch.distributed.checkpoint.state_dict`` helpers and torch.distributed.checkpoint
(DCP) on cfsdp wrapper models, against torch's FSDP1 driven by the same helpers.

Importing cfsdp routes torch's helpers to ``cfsdp.checkpoint.state_dict`` for models that hold
a cfsdp wrapper (see [Note: torch's helpers on cfsdp models] there), so every subtest calls
torch's functions, unchanged, on both models; ``cfsdp_api_matches_torch_helpers`` checks that
cfsdp's own module gives the same results.  Without that routing, torch's helpers return each
rank's local flat shard under one key for ``use_orig_params=False`` and a DCP round trip resumes
with another rank's optimizer state: ``dcp_roundtrip`` and ``torch_helpers_without_cfsdp_routing``
fail then.

Run by test_dcp.py (gloo, CPU). ``CFSDP_DCP_PHASE`` picks the subtests of a launch:

* unset: at W=2 and W=4, state-dict parity with torch FSDP1 for every sharding strategy the
  world size can run (hybrid ones at W=4 on a 2 x 2 mesh; same model, seed and data; keys,
  value types, shard metadata and values compared exactly), DCP save/load round trips that
  resume training with bitwise-equal losses, cross-loading between torch FSDP1 and cfsdp, the
  options (broadcast_from_rank0, ignore_frozen_params, submodules, flattening) and the
  delegation to torch for models without cfsdp;
* ``reshard_save`` / ``reshard_load`` (or both, comma-separated, run in the order given): one
  launch at W=a trains and saves with DCP (and writes the uninterrupted run's next losses to a
  JSON file), then a launch at W=b loads it and must reproduce them (up to float rounding: the
  two world sizes sum in different orders). Each world size saves into its own folder; a load
  takes the one folder of another world size.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as torch_dsd
from torch.distributed._shard.sharded_tensor import ShardedTensor

import _harness as h
import ckpt_common as cc
from dcp_common import DSD, assert_equal, dcp_save, describe
from dcp_common import reshard_save as _reshard_save

import cfsdp.checkpoint.state_dict as cfsdp_dsd
from cfsdp.checkpoint.state_dict import StateDictOptions


WORLD = int(os.environ.get("WORLD_SIZE", "2"))
STRATEGIES = cc.STRATEGIES[WORLD]
RESHARD_RTOL = 1e-5
PHASE = os.environ.get("CFSDP_DCP_PHASE", "")


def trained_pair(ctx, uop: bool, steps: int = 2, strategy=None):
    """torch FSDP1 and cfsdp on the same model and data, each trained ``steps`` steps."""
    data = cc.batches(steps, ctx.world_size)
    out = {}
    for impl in ("torch", "cfsdp"):
        model, opt = cc.make(ctx, impl, uop, strategy=strategy)
        cc.train(ctx, model, opt, data)
        out[impl] = (model, opt)
    return out


def dcp_load(ctx, impl: str, model, opt, path) -> None:
    msd, osd = DSD[impl].get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(path), process_group=ctx.pg)
    DSD[impl].set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


# ----------------------------------------------------------------------------- parity


@h.subtest(grid={"full_state_dict": [True, False], "use_orig_params": [False, True],
                 "strategy": STRATEGIES})
def state_dict_parity(ctx, full_state_dict: bool, use_orig_params: bool, strategy):
    """get_model_state_dict, get_optimizer_state_dict and get_state_dict give what they give
    on torch's FSDP1: keys, value types (ShardedTensor / DTensor / plain), shard metadata, values."""
    pair = trained_pair(ctx, use_orig_params, strategy=strategy)
    opts = StateDictOptions(full_state_dict=full_state_dict)
    got = {}
    for impl, (model, opt) in pair.items():
        got[impl] = (DSD[impl].get_model_state_dict(model, options=opts),
                     DSD[impl].get_optimizer_state_dict(model, opt, options=opts),
                     DSD[impl].get_state_dict(model, opt, options=opts))
    assert_equal(describe(got["cfsdp"]), describe(got["torch"]), "state dicts")


@h.subtest(grid={"full_state_dict": [True, False], "use_orig_params": [False, True]})
def cfsdp_api_matches_torch_helpers(ctx, full_state_dict: bool, use_orig_params: bool):
    """cfsdp.checkpoint.state_dict (cfsdp's own names) gives what torch's helpers give."""
    model, opt = cc.make(ctx, "cfsdp", use_orig_params)
    cc.train(ctx, model, opt, cc.batches(2, ctx.world_size))
    opts = StateDictOptions(full_state_dict=full_state_dict)
    assert_equal(describe(cfsdp_dsd.get_state_dict(model, opt, options=opts)),
                 describe(torch_dsd.get_state_dict(model, opt, options=opts)), "cfsdp api")


@h.subtest
def torch_helpers_without_cfsdp_routing(ctx):
    """What the routing prevents: with torch's own steps back, torch's helpers give a
    use_orig_params=False cfsdp model's local flat shards under raw keys (so a DCP round trip
    would keep one rank's shard); with the routing, clean FQNs and sharded tensors."""
    model, opt = cc.make(ctx, "cfsdp", False)
    cc.train(ctx, model, opt, cc.batches(1, ctx.world_size))
    if not cfsdp_dsd.torch_dispatch_installed():
        raise AssertionError("import cfsdp did not route torch's helpers")
    cfsdp_dsd.uninstall_torch_dispatch()
    try:
        _, raw = torch_dsd.get_state_dict(model, opt)
    finally:
        cfsdp_dsd.install_torch_dispatch()
    if not any("_flat_param" in k for k in raw["state"]):
        raise AssertionError(f"without the routing torch gave {list(raw['state'])[:3]}")
    _, osd = torch_dsd.get_state_dict(model, opt)
    keys = list(osd["state"])
    if any("_fsdp_wrapped_module" in k or "_flat_param" in k for k in keys):
        raise AssertionError(f"raw keys through the routing: {keys[:3]}")
    if not all(isinstance(v["exp_avg"], ShardedTensor) for v in osd["state"].values()):
        raise AssertionError("optimizer state is not sharded through the routing")


@h.subtest(grid={"option": ["ignore_frozen_params", "submodules", "flatten_optimizer_state_dict"]})
def options_parity(ctx, option: str):
    pair = trained_pair(ctx, True)
    kw: dict[str, Any] = {}
    if option == "ignore_frozen_params":
        for model, _ in pair.values():
            for n, p in model.named_parameters():
                if "blocks.0" in n:
                    p.requires_grad_(False)
    for impl, (model, opt) in pair.items():
        if option == "submodules":
            sub = {m for n, m in model.named_modules() if n.endswith("blocks.1")}
            kw[impl] = dict(submodules=sub, options=StateDictOptions(
                full_state_dict=True, keep_submodule_prefixes=False))
        else:
            kw[impl] = dict(options=StateDictOptions(full_state_dict=True, **{option: True}))
    got = {impl: DSD[impl].get_state_dict(*pair[impl], **kw[impl]) for impl in pair}
    assert_equal(describe(got["cfsdp"]), describe(got["torch"]), option)


@h.subtest
def cpu_offload_rank0_only(ctx):
    """full_state_dict + cpu_offload: rank 0 gets the full dicts, the others {}.  The oracle is
    torch without cpu_offload on rank 0: torch FSDP1's offload_to_cpu on a CPU device frees the
    storage its "copy" shares and crashes (SIGSEGV) in torch 2.13."""
    pair = trained_pair(ctx, False)
    want = DSD["torch"].get_state_dict(*pair["torch"], options=StateDictOptions(full_state_dict=True))
    got = DSD["cfsdp"].get_state_dict(
        *pair["cfsdp"], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert_equal(describe(got), describe(want) if ctx.rank == 0 else ({}, {}), "cpu_offload")


@h.subtest
def no_cfsdp_delegates_to_torch(ctx):
    model = cc.pc.build("transformer")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    assert_equal(describe(cfsdp_dsd.get_state_dict(model, opt, options=opts)),
                 describe(torch_dsd.get_state_dict(model, opt, options=opts)), "plain model")


@h.subtest
def unsupported_options_raise(ctx):
    model, opt = cc.make(ctx, "cfsdp", True)
    type(model.module).fqn_mods = lambda self: {}
    try:
        torch_dsd.get_model_state_dict(model, options=StateDictOptions(dsd_fqn_modifiers="fqn_mods"))
    except NotImplementedError as e:
        if "dsd_fqn_modifiers" not in str(e):
            raise AssertionError(f"message does not name the option: {e}") from e
    else:
        raise AssertionError("dsd_fqn_modifiers on a module did not raise")
    finally:
        del type(model.module).fqn_mods
    try:
        torch_dsd.set_model_state_dict(model, {}, options=StateDictOptions(broadcast_from_rank0=True))
    except ValueError:
        pass
    else:
        raise AssertionError("broadcast_from_rank0 without full_state_dict did not raise")


# ----------------------------------------------------------------------------- resume


@h.subtest(grid={"use_orig_params": [False, True], "strategy": STRATEGIES})
def dcp_roundtrip(ctx, use_orig_params: bool, strategy):
    """torch's helpers + dcp.save, then a fresh model (other weights) + dcp.load + torch's
    set_state_dict resumes with bitwise the uninterrupted run's losses."""
    path = cc.ckpt_dir(ctx, ctx.name)
    data = cc.batches(4, ctx.world_size)
    model, opt = cc.make(ctx, "cfsdp", use_orig_params, strategy=strategy)
    cc.train(ctx, model, opt, data[:2])
    dcp_save(ctx, "cfsdp", model, opt, path)
    want = cc.train(ctx, model, opt, data[2:])
    fresh, fresh_opt = cc.make(ctx, "cfsdp", use_orig_params, seed=1, strategy=strategy)
    dcp_load(ctx, "cfsdp", fresh, fresh_opt, path)
    cc.assert_same_losses(cc.train(ctx, fresh, fresh_opt, data[2:]), want, "DCP resume")


@h.subtest(grid={"direction": ["torch->cfsdp", "cfsdp->torch"], "use_orig_params": [False, True]})
def dcp_cross_load(ctx, direction: str, use_orig_params: bool):
    writer, reader = direction.split("->")
    path = cc.ckpt_dir(ctx, ctx.name)
    data = cc.batches(4, ctx.world_size)
    model, opt = cc.make(ctx, writer, use_orig_params)
    cc.train(ctx, model, opt, data[:2])
    dcp_save(ctx, writer, model, opt, path)
    want = cc.train(ctx, model, opt, data[2:])
    fresh, fresh_opt = cc.make(ctx, reader, use_orig_params, seed=1)
    dcp_load(ctx, reader, fresh, fresh_opt, path)
    cc.assert_same_losses(cc.train(ctx, fresh, fresh_opt, data[2:]), want, f"{direction} DCP")


@h.subtest(grid={"use_orig_params": [False, True]})
def broadcast_from_rank0(ctx, use_orig_params: bool):
    """Full state dicts on rank 0 only (cpu_offload), loaded into a fresh model by broadcast."""
    data = cc.batches(4, ctx.world_size)
    model, opt = cc.make(ctx, "cfsdp", use_orig_params)
    cc.train(ctx, model, opt, data[:2])
    msd, osd = torch_dsd.get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if (ctx.rank != 0) != (msd == {} and osd == {}):
        raise AssertionError(f"rank {ctx.rank}: {len(msd)} model / {len(osd)} optim entries")
    want = cc.train(ctx, model, opt, data[2:])
    fresh, fresh_opt = cc.make(ctx, "cfsdp", use_orig_params, seed=1)
    torch_dsd.set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    cc.assert_same_losses(cc.train(ctx, fresh, fresh_opt, data[2:]), want, "broadcast resume")


def reshard_load(ctx):
    source = cc.reshard_source(ctx, "reshard")
    for uop in (False, True):
        path = source / f"uop{int(uop)}"
        saved = json.loads((path / "losses.json").read_text())
        if saved["world_size"] == ctx.world_size:
            raise AssertionError("the resharding test must load at another world size")
        data = cc.batches(4, ctx.world_size)
        model, opt = cc.make(ctx, "cfsdp", uop, seed=1)
        dcp_load(ctx, "cfsdp", model, opt, path / "dcp")
        got = cc.train(ctx, model, opt, data[2:])
        cc.assert_same_losses(got, saved["losses"], f"use_orig_params={uop}: "
                              f"W={saved['world_size']} -> W={ctx.world_size}", rtol=RESHARD_RTOL)


def reshard_save(ctx):
    """This world size trains and saves (``dcp_common.reshard_save``, which worker_hosts.py
    also runs); a subtest of this script, so the harness runs it (it runs only the launched
    script's own)."""
    _reshard_save(ctx)


if PHASE:
    del h._REGISTRY[:]
    for _phase in PHASE.split(","):
        h.subtest({"reshard_save": reshard_save, "reshard_load": reshard_load}[_phase])


if __name__ == "__main__":
    h.main()
