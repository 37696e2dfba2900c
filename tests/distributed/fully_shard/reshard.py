"""DCP resharding across world sizes (test_fully_shard_reshard): ``CFSDP_FS_PHASE`` names the
phases a launch registers, in order (``reshard_save``, ``reshard_load``; nothing without it),
and worker_fully_shard.py then runs only these (see its docstring).  Each phase is two
subtests: AdamW on both implementations (losses against the saver's uninterrupted run, within
``RESHARD_RTOL``), and cfsdp.optim.Muon (+ AdamW) on cfsdp (``muon_reshard_*``: the loaded
state against the saver's full tensors and the next steps against the oracle loaded from the
same checkpoint, both bitwise)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import _harness as h
import ckpt_common as cc
import parity_common as pc
from fs_common import CFSDP, TORCH, Scenario, batches, make_model, mesh_1d, run_steps
from fully_shard.common import IMPLS
from fully_shard.checkpoint import dcp_load, dcp_save, trained
from fully_shard.muon import check_full_state, full_state, muon_scenario


PHASE = os.environ.get("CFSDP_FS_PHASE", "")
RESHARD_RTOL = 1e-5


def _global_losses(ctx, losses: list[torch.Tensor]) -> list[float]:
    out = []
    for loss in losses:
        t = loss.detach().clone()
        dist.all_reduce(t, group=ctx.pg)
        out.append((t / ctx.world_size).item())
    return out


def reshard_save(ctx):
    mesh = mesh_1d(ctx)
    data = batches("lm1", 4, ctx.world_size)
    root = cc.ckpt_dir(ctx, f"fully_shard_reshard/w{ctx.world_size}")
    want = {}
    for name, impl in IMPLS.items():
        model, opt = trained(impl, ctx, mesh, "lm1", data[:2])
        dcp_save(ctx, model, opt, str(root / name))
        want[name] = _global_losses(ctx, run_steps(impl, Scenario(kind="lm1"), model, opt, data[2:], ctx.rank, []))
    if ctx.rank == 0:
        (root / "losses.json").write_text(json.dumps({"world_size": ctx.world_size, "losses": want}))


def reshard_load(ctx):
    mesh = mesh_1d(ctx)
    root = cc.reshard_source(ctx, "fully_shard_reshard")
    saved = json.loads((root / "losses.json").read_text())
    if saved["world_size"] == ctx.world_size:
        raise AssertionError("the resharding test must load at another world size")
    data = batches("lm1", 4, ctx.world_size)
    for writer in IMPLS:
        model, opt = trained(CFSDP, ctx, mesh, "lm1", None, seed=1)
        dcp_load(ctx, model, opt, str(root / writer))
        got = _global_losses(ctx, run_steps(CFSDP, Scenario(kind="lm1"), model, opt, data[2:], ctx.rank, []))
        cc.assert_same_losses(got, saved["losses"][writer],
                              f"{writer} at W={saved['world_size']} -> cfsdp at W={ctx.world_size}",
                              rtol=RESHARD_RTOL)


# ----------------------------------------------------------------------------- Muon


def muon_reshard_save(ctx):
    """cfsdp.fully_shard + cfsdp.optim.Muon (+ AdamW) train 2 steps and dcp.save
    get_state_dict(model, (Muon, AdamW)); rank 0 writes ``full_state`` (every parameter and
    optimizer state tensor, full_tensor()) beside it: what the load must bring back."""
    mesh, sc = mesh_1d(ctx), muon_scenario("lm1")
    root = cc.ckpt_dir(ctx, f"fully_shard_reshard_muon/w{ctx.world_size}")
    model = make_model(CFSDP, sc, mesh)
    opt = sc.make_optim(CFSDP, model)
    run_steps(CFSDP, sc, model, opt, batches(sc.kind, 2, ctx.world_size), ctx.rank, [])
    dcp_save(ctx, model, (opt.muon, opt.adamw), str(root / "dcp"))
    full = full_state(model, opt)
    if ctx.rank == 0:
        torch.save({"world_size": ctx.world_size, "full": full}, root / "full.pt")
    dist.barrier(group=ctx.pg)


def _oracle_from_checkpoint(ctx, sc: Scenario, mesh, path: str, muon_keys: dict):
    """torch's fully_shard + the all-gather Muon (+ torch AdamW) with everything read from the
    checkpoint at ``path``: the model and AdamW's state through torch's helpers (DTensors), each
    Muon momentum buffer as a plain tensor (DCP reads the whole saved tensor) handed to the
    oracle's full-matrix ``torch.optim.Muon``.  ``muon_keys``: fqn -> full shape of the Muon
    state in the checkpoint."""
    model = make_model(TORCH, sc, mesh, seed=1)
    opt = sc.make_optim(TORCH, model)
    msd = get_model_state_dict(model)
    asd = get_optimizer_state_dict(model, opt.adamw)
    state = {**asd["state"], **{f: {"momentum_buffer": torch.zeros(s)} for f, s in muon_keys.items()}}
    dcp.load({"model": msd, "optim": {"state": state}}, checkpoint_id=path, process_group=ctx.pg)
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, opt.adamw, {"state": {f: v for f, v in state.items()
                                                          if f in asd["state"]},
                                                "param_groups": asd["param_groups"]})
    named = dict(model.named_parameters())
    for f in muon_keys:
        opt.muon.load_full_momentum(named[f], state[f]["momentum_buffer"])
    return model, opt


def muon_reshard_load(ctx):
    """The checkpoint of ``muon_reshard_save`` at another world size, loaded by dcp.load +
    set_state_dict into a fresh cfsdp model and optimizers (other weights): every parameter
    and optimizer state tensor, full_tensor(), is the saved one bitwise (momentum buffers
    resharded: W=4's chunks into W=2's and back); then 2 steps at this world size equal,
    bitwise (losses, local parameters), those of the oracle (torch's fully_shard + the
    all-gather Muon) loaded from the same checkpoint (``_oracle_from_checkpoint``).  Not
    compared with the saver's own next steps: another world size sums the gradients in
    another order, and Newton–Schulz in bf16 makes those ulps bf16 ulps."""
    mesh, sc, mm = mesh_1d(ctx), muon_scenario("lm1"), pc.Mismatches(ctx)
    root = cc.reshard_source(ctx, "fully_shard_reshard_muon")
    saved = torch.load(root / "full.pt", weights_only=True)
    if saved["world_size"] == ctx.world_size:
        raise AssertionError("the resharding test must load at another world size")
    where = f"W={saved['world_size']} -> W={ctx.world_size}"
    path = str(root / "dcp")
    model = make_model(CFSDP, sc, mesh, seed=1)
    opt = sc.make_optim(CFSDP, model)
    dcp_load(ctx, model, (opt.muon, opt.adamw), path)
    check_full_state(mm, full_state(model, opt), saved["full"], where)
    osd = get_optimizer_state_dict(model, opt.muon)
    muon_keys = {f: tuple(v["momentum_buffer"].shape) for f, v in osd["state"].items()}
    mm.check(len(muon_keys) == sum(p.ndim >= 2 for p in model.parameters()),
             f"{where}: Muon state of {sorted(muon_keys)}")
    ref, ref_opt = _oracle_from_checkpoint(ctx, sc, mesh, path, muon_keys)
    data = batches(sc.kind, 4, ctx.world_size)[2:]
    got = run_steps(CFSDP, sc, model, opt, data, ctx.rank, [])
    want = run_steps(TORCH, sc, ref, ref_opt, data, ctx.rank, [])
    for i, (a, b) in enumerate(zip(got, want)):
        mm.tensors(f"{where}: loss #{i} after the load", a, b, b_name="oracle")
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        mm.tensors(f"{where}: local param {n} 2 steps after the load",
                   p.to_local() if isinstance(p, DTensor) else p,
                   q.to_local() if isinstance(q, DTensor) else q, b_name="oracle")
    mm.raise_if_any()


PHASES = {"reshard_save": (reshard_save, muon_reshard_save),
          "reshard_load": (reshard_load, muon_reshard_load)}
for _phase in [p for p in PHASE.split(",") if p]:
    for _fn in PHASES[_phase]:
        h.subtest(_fn)
