"""fully_shard on a full SPMD mesh (``dp_mesh_dims``) and on per-parameter meshes
(``shard_placement_fn`` returning ``ShardPlacementResult``), cfsdp against torch's FSDP2.

Run by test_tp.py (``test_spmd_meshes``) under torchrun (gloo, CPU) at 2 and 4 ranks.

* ``dp_mesh_dims``: tp_common.SPMDModel, every parameter a DTensor on the whole mesh
  (``Replicate()`` on the data-parallel dims, the tensor-parallel placement on ``tp``) and the
  inputs DTensors too, as torchtitan's default path builds its model; fully_shard on each
  block, then the root, with ``mesh=<the whole mesh>, dp_mesh_dims=...``.  The layouts cover
  one shard dim on 1-D and 2-D (dp x tp) meshes, the dp dim right of tp, several shard dims
  flattened (``("dp", "cp")``, the sequence sharded on ``cp``), HSDP (one shard rank too),
  HSDP with flattened shard dims and tp, and torch's DDP mode (``replicate`` only).
* ``spmd_muon``: ``cfsdp.optim.Muon`` on those models against the all-gather Muon on torch's,
  bitwise.
* ``ShardPlacementResult``: a small mixture of experts whose expert weights are sharded on
  an ``(efsdp, ep)`` mesh (FSDP over ``efsdp``, the experts split over ``ep``) while the
  dense parameters are sharded over every rank (``moe_*`` subtests).

Oracle: torch's FSDP2 on the same model, seed and data, **bitwise** (losses; every
parameter's placements, local shard, full value and last local gradient; state dicts): the
same local tensors go through the same gloo collectives (launches of 4 ranks take gloo,
launcher.py's [Note: shm at 3+ ranks]) and the same DTensor ops.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims, MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard

import _harness as h
import tp_common as tc
from ckpt_common import ckpt_dir
from muon_oracle import muon_pair as _muon_pair
import parity_common as pc
from tp_dcp_common import SHARDERS, STEPS, compare, dcp_load, dcp_save, describe_sd, snapshot


WORLD = int(os.environ.get("WORLD_SIZE", "2"))
# torch 2.13+ flattens several dp_mesh_dims shard dims into one (read from torch's version)
TORCH_FLATTENS_SHARD_DIMS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


# ----------------------------------------------------------------------------- dp_mesh_dims
# fully_shard(mesh=<the full SPMD mesh>, dp_mesh_dims=DataParallelMeshDims(shard=...,
# replicate=...)) on tc.SPMDModel (every parameter a DTensor on the whole mesh, as torchtitan's
# default path makes them): bitwise as torch's FSDP2, with the same placements after sharding.
# A layout: (mesh shape, dim names, DataParallelMeshDims arguments).
if WORLD == 2:
    SPMD_LAYOUTS = {
        "fsdp": ((2,), ("dp",), {"shard": "dp"}),
        "fsdp_tp2": ((1, 2), ("dp", "tp"), {"shard": "dp"}),
        "fsdp2_tp": ((2, 1), ("dp", "tp"), {"shard": "dp"}),
        "tp_first": ((2, 1), ("tp", "dp"), {"shard": "dp"}),
        "flat_cp": ((1, 2), ("dp", "cp"), {"shard": ("dp", "cp")}),
        "hsdp_shard1": ((2, 1), ("rep", "dp"), {"shard": "dp", "replicate": "rep"}),
        "ddp": ((2, 1), ("dp", "tp"), {"replicate": "dp"}),
    }
else:
    SPMD_LAYOUTS = {
        "fsdp_tp": ((2, 2), ("dp", "tp"), {"shard": "dp"}),
        "hsdp": ((2, 2), ("rep", "dp"), {"shard": "dp", "replicate": "rep"}),
        "hsdp_tp": ((2, 1, 2), ("rep", "dp", "tp"), {"shard": "dp", "replicate": "rep"}),
        "flat_cp": ((2, 2), ("dp", "cp"), {"shard": ("dp", "cp")}),
        # Not here: flattened shard dims beside a replicate or tp dim ((2, 1, 2) ("rep", "dp",
        # "cp"), (2, 1, 1, 2) with "tp"): torch's own FSDP2 run of them does not finish in 5
        # minutes on CPU (DTensor's sharding propagation in the model's forward), so there is
        # no oracle at a launch's scale.
        "ddp_tp": ((2, 2), ("dp", "tp"), {"replicate": "dp"}),
    }


_SPMD_MESHES: dict = {}


def spmd_mesh(layout: str):
    """The layout's mesh, one object per (shape, names) for the whole run: DTensor's sharding
    propagation caches output specs by value, so a parameter made on a second equal mesh
    (its ``nn.Parameter(...)`` detach) can come back on the first one, and torch's FSDP2
    checks the parameters' mesh by identity."""
    shape, names, dims = SPMD_LAYOUTS[layout]
    mesh = _SPMD_MESHES.get((shape, names))
    if mesh is None:
        mesh = _SPMD_MESHES[(shape, names)] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return mesh, DataParallelMeshDims(**dims)


def spmd_fs_model(impl: str, mesh, dims, seed: int = 0, **kw):
    """tc.SPMDModel on ``mesh``, each block then the root given to ``impl``'s fully_shard with
    ``dp_mesh_dims``."""
    model = tc.spmd_model(mesh, seed)
    shard = SHARDERS[impl]
    for b in model.blocks:
        shard(b, mesh=mesh, dp_mesh_dims=dims, **kw)
    shard(model, mesh=mesh, dp_mesh_dims=dims, **kw)
    return model


def spmd_loss(model, x, y, mesh) -> torch.Tensor:
    out = model(tc.spmd_input(x, mesh))
    want = [Replicate() if n == "tp" else Shard(1) if n == "cp" else Shard(0)
            for n in mesh.mesh_dim_names]
    return tc.loss_fn(out.redistribute(placements=want).to_local(), y)


def _result(model, seen: list, snap: dict) -> tuple:
    """What a run is compared by: the recorded losses (and no-sync gradients), each
    parameter's placements, local shard and full value at the end with its local gradient of
    the last step (``snap``), and the state dict."""
    after = snapshot(model)
    return (seen, {n: (*after[n][:3], snap[n][3]) for n in after}, describe_sd(model.state_dict()))


def spmd_run(mesh, dims, steps: int = STEPS, micro: int = 1, fs_kw: dict | None = None,
             setup: Callable | None = None, optim: str = "adamw",
             make_opt: Callable | None = None):
    """Train torch and cfsdp; {impl: (losses and no-sync gradients, snapshot, state dict)}.
    ``micro`` > 1: set_requires_gradient_sync(False) for all but the last micro-batch, the
    first block kept unsharded after backward (its no-sync gradients compared).
    ``make_opt(impl, model)``: the optimizer (else ``optim``'s)."""
    data = tc.spmd_batches(steps, mesh, micro=micro)
    out = {}
    for impl in ("torch", "cfsdp"):
        model = spmd_fs_model(impl, mesh, dims, **(fs_kw or {}))
        if setup is not None:
            setup(model, impl)
        if micro > 1:
            model.blocks[0].set_reshard_after_backward(False)
        opt = (make_opt(impl, model) if make_opt is not None
               else pc.make_optim(optim, model.parameters()))
        seen = []
        for i, step in enumerate(data):
            for m, (x, y) in enumerate(step):
                if micro > 1:
                    model.set_requires_gradient_sync(m == micro - 1)
                loss = spmd_loss(model, x, y, mesh)
                loss.backward()
                seen.append(loss.detach().clone())
                if m < micro - 1:
                    g = model.blocks[0].w1.weight.grad
                    seen.append(None if g is None else (tuple(g.placements), g.to_local().clone()))
            if i == len(data) - 1:
                snap = snapshot(model)
            opt.step()
            opt.zero_grad()
        out[impl] = _result(model, seen, snap)
    return out


def spmd_check(ctx, out) -> None:
    mm = pc.Mismatches(ctx)
    (tl, ts, tsd), (cl, cs, csd) = out["torch"], out["cfsdp"]
    compare(mm, "losses (and no-sync gradients)", cl, tl)
    compare(mm, "parameters (placements, local, full, local grad)", cs, ts)
    compare(mm, "state_dict", csd, tsd)
    mm.raise_if_any()


@h.subtest(grid={"layout": list(SPMD_LAYOUTS), "reshard": [None, False] if WORLD == 2 else [None]})
def spmd_parity(ctx, layout: str, reshard):
    """dp_mesh_dims: bitwise as torch's FSDP2 (losses; every parameter's placements, local
    shard, full value and last local gradient; the state dict's keys, placements, values)."""
    mesh, dims = spmd_mesh(layout)
    kw = {} if reshard is None else {"reshard_after_forward": reshard}
    if len(dims.shard_names) > 1 and not TORCH_FLATTENS_SHARD_DIMS:
        # torch 2.12 leaves such parameters on the unflattened SPMD mesh: cfsdp refuses there,
        # naming the version (README, "Torch versions")
        try:
            spmd_fs_model("cfsdp", mesh, dims, **kw)
        except NotImplementedError as e:
            if torch.__version__ in str(e) and "2.13" in str(e):
                return
            raise
        raise AssertionError(f"cfsdp took several shard dims on torch {torch.__version__}")
    out = spmd_run(mesh, dims, fs_kw=kw)
    if ctx.rank == 0:
        ctx.log({n: v[0] for n, v in out["cfsdp"][1].items() if "blocks.0.w" in n})
    spmd_check(ctx, out)


@h.subtest(grid={"layout": [k for k in SPMD_LAYOUTS if k in ("fsdp", "fsdp_tp2", "fsdp2_tp",
                                                               "tp_first", "flat_cp", "fsdp_tp",
                                                               "hsdp_tp", "ddp_tp")]})
def spmd_muon(ctx, layout: str):
    """cfsdp.optim.Muon (+ AdamW) on dp_mesh_dims models (torchtitan's default path: every
    parameter a DTensor on the whole SPMD mesh) against the all-gather Muon on torch's FSDP2:
    bitwise (losses, placements, local and full parameters, last local gradients, state
    dict).  The layouts put a matrix on one shard dim, on dp x tp blocks (``_StridedShard``
    beside tp's ``Shard``), on a flattened (dp, cp) mesh, on a 3-D mesh's (dp, tp) with a
    replicate dim, and whole (DDP mode)."""
    mesh, dims = spmd_mesh(layout)
    if len(dims.shard_names) > 1 and not TORCH_FLATTENS_SHARD_DIMS:
        return  # cfsdp refuses the layout on this torch (spmd_parity checks the error)
    spmd_check(ctx, spmd_run(mesh, dims, make_opt=_muon_pair))


@h.subtest(grid={"layout": list(SPMD_LAYOUTS)[:3] if WORLD == 2 else list(SPMD_LAYOUTS)[:2],
                 "mp": [False, True] if WORLD == 2 else [True]})
def spmd_grad_accumulation(ctx, layout: str, mp: bool):
    """dp_mesh_dims with set_requires_gradient_sync(False) on all but the last micro-batch (the
    first block's no-sync gradients on its registered parameters compared too), with and
    without bf16 parameters / fp32 reduction."""
    mesh, dims = spmd_mesh(layout)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                            reduce_dtype=torch.float32)} if mp else {}
    spmd_check(ctx, spmd_run(mesh, dims, micro=2, fs_kw=kw, optim="sgd"))


@h.subtest(grid={"layout": list(SPMD_LAYOUTS)[:2] if WORLD == 2 else list(SPMD_LAYOUTS)[:1]})
def spmd_shard_dim(ctx, layout: str):
    """dp_mesh_dims with shard_placement_fn putting every matrix on Shard(1) where the data
    parallel size divides it: _StridedShard(1) beside TP's Shard(1), Shard(1) otherwise."""
    mesh, dims = spmd_mesh(layout)
    n = 1
    for name in dims.shard_names:
        n *= mesh[name].size()

    def on_dim1(p):
        local = p.to_local()
        return Shard(1) if local.dim() == 2 and local.size(1) % n == 0 else None

    spmd_check(ctx, spmd_run(mesh, dims, fs_kw={"shard_placement_fn": on_dim1}))


@h.subtest(grid={"direction": ["cfsdp->cfsdp", "torch->cfsdp", "cfsdp->torch"] if WORLD == 2
                 else ["cfsdp->torch"]})
def spmd_dcp(ctx, direction: str):
    """dp_mesh_dims + torch's helpers + DCP: a fresh model (other weights) loads the checkpoint
    and resumes with bitwise the uninterrupted losses; cross-loads both ways with torch."""
    writer, reader = direction.split("->")
    mesh, dims = spmd_mesh(list(SPMD_LAYOUTS)[1])
    path = ckpt_dir(ctx, f"spmd_dcp_{writer}_{reader}")
    data = tc.spmd_batches(4, mesh)

    def run(model, opt, steps):
        losses = []
        for step in steps:
            x, y = step[0]
            loss = spmd_loss(model, x, y, mesh)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
        return losses

    model = spmd_fs_model(writer, mesh, dims)
    opt = pc.make_optim("adamw", model.parameters())
    run(model, opt, data[:2])
    dcp_save(model, opt, path)
    want = run(model, opt, data[2:])
    fresh = spmd_fs_model(reader, mesh, dims, seed=1)
    fresh_opt = pc.make_optim("adamw", fresh.parameters())
    dcp_load(fresh, fresh_opt, path)
    got = run(fresh, fresh_opt, data[2:])
    mm = pc.Mismatches(ctx)
    for i, (a, b) in enumerate(zip(got, want)):
        mm.tensors(f"resumed loss #{i} ({direction})", a, b)
    mm.raise_if_any()


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - compared with torch's
        return e
    return None


@h.subtest()
def spmd_errors(ctx):
    """dp_mesh_dims errors as torch's (its exception type, its message first): a name not in
    the mesh, a mesh without names, a plain parameter, a parameter on another mesh, a
    data-parallel dim that is not Replicate(), an int reshard_after_forward, a
    shard_placement_fn in DDP mode."""
    from torch.distributed.tensor import distribute_tensor

    layout = list(SPMD_LAYOUTS)[1]
    mesh, dims = spmd_mesh(layout)
    dp = dims.shard_names[0]
    unnamed = init_device_mesh("cpu", tuple(mesh.shape))
    # another mesh over the same ranks (other names: an equal one could come back as the
    # first, see spmd_mesh)
    other = init_device_mesh("cpu", tuple(mesh.shape),
                             mesh_dim_names=tuple(f"{n}_2" for n in mesh.mesh_dim_names))

    def plain(m):
        m.norm.weight = nn.Parameter(m.norm.weight.to_local().clone())

    def elsewhere(m):
        m.norm.weight = nn.Parameter(distribute_tensor(m.norm.weight.full_tensor().detach(), other,
                                                       m.norm.weight.placements))

    def sharded_dp(m):
        i = mesh.mesh_dim_names.index(dp)
        pls = list(m.out.bias.placements)
        pls[i] = Shard(0)
        m.out.bias = nn.Parameter(distribute_tensor(m.out.bias.full_tensor().detach(), mesh, pls))

    cases = {
        "unknown name": (lambda m: None, mesh, {"dp_mesh_dims": DataParallelMeshDims(shard="nope")}),
        "unnamed mesh": (lambda m: None, unnamed, {"dp_mesh_dims": dims}),
        "plain parameter": (plain, mesh, {"dp_mesh_dims": dims}),
        "other mesh": (elsewhere, mesh, {"dp_mesh_dims": dims}),
        "dp dim sharded": (sharded_dp, mesh, {"dp_mesh_dims": dims}),
        "int reshard": (lambda m: None, mesh, {"dp_mesh_dims": dims, "reshard_after_forward": 1}),
        "ddp + placement fn": (lambda m: None, mesh, {
            "dp_mesh_dims": DataParallelMeshDims(replicate=dp), "shard_placement_fn": lambda p: None}),
    }
    mm = pc.Mismatches(ctx)
    for what, (edit, m, kw) in cases.items():
        errs = {}
        for impl in ("torch", "cfsdp"):
            model = tc.spmd_model(mesh)
            edit(model)
            errs[impl] = _raises(lambda: SHARDERS[impl](model, mesh=m, **kw))
        t, c = errs["torch"], errs["cfsdp"]
        mm.check(t is not None, f"{what}: torch no longer raises")
        if t is not None:
            mm.check(isinstance(c, type(t)) and str(c).startswith(str(t)),
                     f"{what}: cfsdp raised {c!r}, torch {t!r}")
    mm.raise_if_any()


# ----------------------------------------------------------------------------- per-parameter meshes
# shard_placement_fn returning ShardPlacementResult (torch's expert-parallel path, as
# torchtitan applies it): a mixture of experts whose expert weights live on an (efsdp, ep)
# mesh (FSDP over efsdp, the experts split over ep) while everything else is sharded over
# every rank.  Expert parallelism by all-gather: each ep rank gathers its ep group's tokens,
# runs its own experts on all of them, and the outputs are reduce-scattered back (functional
# collectives, differentiable).

E, DM, HM, NTOK, C = 4, 8, 6, 6, 5  # experts, width, expert hidden, tokens per rank, classes


class MoE(nn.Module):
    def __init__(self, ep_mesh):
        super().__init__()
        self.ep_mesh = ep_mesh
        self.norm = nn.LayerNorm(DM)
        self.router = nn.Linear(DM, E)
        self.w1 = nn.Parameter(torch.randn(E, DM, HM) * 0.3)
        self.w2 = nn.Parameter(torch.randn(E, HM, DM) * 0.3)

    def forward(self, x):
        from torch.distributed._functional_collectives import (
            all_gather_tensor_autograd, reduce_scatter_tensor_autograd)

        h = self.norm(x)
        gates = torch.softmax(self.router(h), dim=-1)
        ep = self.ep_mesh
        # One all-gather for both: torch 2.13's gloo process group corrupts its heap when two
        # collectives on one group finish at once on its two worker threads (a race on
        # ProcessGroupGloo's pgStatus_ in runLoop, seen as "double-free" under ASan with torch
        # alone), and two functional all-gathers here (and their two reduce-scatters in
        # backward) are in flight together.
        both = all_gather_tensor_autograd(torch.cat([h, gates], -1), gather_dim=0, group=ep)
        hg, gg = both.split([h.shape[-1], gates.shape[-1]], dim=-1)
        w1, w2 = self.w1.to_local(), self.w2.to_local()  # this ep rank's experts
        first = ep.get_local_rank() * w1.shape[0]
        mid = torch.nn.functional.gelu(torch.einsum("nd,edh->neh", hg, w1))
        y = torch.einsum("neh,ehd->ned", mid, w2)
        y = (y * gg[:, first:first + w1.shape[0], None]).sum(1)
        return x + reduce_scatter_tensor_autograd(y, "sum", scatter_dim=0, group=ep)


class MoEModel(nn.Module):
    def __init__(self, ep_mesh):
        super().__init__()
        self.inp = nn.Linear(DM, DM)
        self.blocks = nn.ModuleList(MoE(ep_mesh) for _ in range(2))
        self.out = nn.Linear(DM, C)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


_MOE_MESHES: dict = {}


def moe_meshes():
    """(the dense mesh over every rank, the (efsdp, ep) mesh): ep 2, efsdp W / 2 (one rank
    at W = 2).  Made once (see spmd_mesh)."""
    if not _MOE_MESHES:
        _MOE_MESHES["dense"] = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        _MOE_MESHES["moe"] = init_device_mesh("cpu", (WORLD // 2, 2), mesh_dim_names=("efsdp", "ep"))
    return _MOE_MESHES["dense"], _MOE_MESHES["moe"]


def moe_model(impl: str, style: str, seed: int = 0, **kw):
    """MoEModel with its experts on the (efsdp, ep) mesh, ``style``: ``ep_mesh`` DTensors on
    the ep sub-mesh (Shard(0)), FSDP's mesh the efsdp sub-mesh (torch's TP/EP path);
    ``spmd`` DTensors on the whole (efsdp, ep) mesh ((Replicate(), Shard(0))), FSDP's mesh
    info from dp_mesh_dims (torchtitan's full-DTensor path).  ``shard_placement_fn`` returns
    a ShardPlacementResult on that mesh for the experts, one on the dense mesh (another
    mesh info object over fully_shard's own groups, as torchtitan makes it) for the rest."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import distribute_tensor

    dense, moe = moe_meshes()
    torch.manual_seed(seed)
    model = MoEModel(moe["ep"])
    experts = []
    for b in model.blocks:
        for name in ("w1", "w2"):
            full = getattr(b, name).detach()
            if style == "ep_mesh":
                dt = distribute_tensor(full, moe["ep"], [Shard(0)])
            else:
                dt = distribute_tensor(full, moe, [Replicate(), Shard(0)])
            setattr(b, name, nn.Parameter(dt))
            experts.append(getattr(b, name))
    if style == "ep_mesh":
        expert_info = FSDPMeshInfo(moe["efsdp"], shard_mesh_dim=0)
    else:
        expert_info = _get_mesh_info(moe, DataParallelMeshDims(shard="efsdp"))
    dense_info = _get_mesh_info(dense)
    ids = {id(p) for p in experts}

    def placement(p):
        if id(p) in ids:
            return ShardPlacementResult(placement=Shard(0), mesh_info=expert_info)
        return ShardPlacementResult(placement=Shard(0), mesh_info=dense_info)

    shard = SHARDERS[impl]
    for b in model.blocks:
        shard(b, mesh=dense, shard_placement_fn=placement, **kw)
    shard(model, mesh=dense, **kw)
    return model


def moe_batches(steps: int, micro: int = 1):
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(77 * 1000 + step)
        x = torch.randn(WORLD * micro, NTOK, DM, generator=g)
        y = torch.randint(0, C, (WORLD * micro, NTOK), generator=g)
        rank = torch.distributed.get_rank()
        out.append([(x[m * WORLD + rank], y[m * WORLD + rank]) for m in range(micro)])
    return out


@h.subtest(grid={"style": ["ep_mesh", "spmd"], "case": ["plain", "accumulate", "mp", "muon"]
                 if WORLD == 2 else ["plain", "mp", "muon"]})
def moe_parity(ctx, style: str, case: str):
    """ShardPlacementResult: the experts on the (efsdp, ep) mesh, the rest on the dense mesh,
    bitwise as torch's FSDP2 (losses; placements, local shards, full values and gradients;
    state dict); ``accumulate``: set_requires_gradient_sync(False) on the first of two
    micro-batches; ``mp``: bf16 parameters, fp32 reduction; ``muon``: cfsdp.optim.Muon (+
    AdamW) against the all-gather Muon (the stacked experts per trailing matrix, at 4 ranks
    cut over both mesh dims)."""
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                            reduce_dtype=torch.float32)} if case == "mp" else {}
    micro = 2 if case == "accumulate" else 1
    data = moe_batches(STEPS, micro)
    out = {}
    for impl in ("torch", "cfsdp"):
        model = moe_model(impl, style, **kw)
        opt = (_muon_pair(impl, model) if case == "muon"
               else pc.make_optim("adamw", model.parameters()))
        seen = []
        for i, step in enumerate(data):
            for m, (x, y) in enumerate(step):
                if micro > 1:
                    model.set_requires_gradient_sync(m == micro - 1)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                seen.append(loss.detach().clone())
            if i == len(data) - 1:
                snap = snapshot(model)
            opt.step()
            opt.zero_grad()
        out[impl] = _result(model, seen, snap)
    if ctx.rank == 0 and case == "plain":
        ctx.log({n: v[0] for n, v in out["cfsdp"][1].items() if n.startswith("blocks.0")})
    spmd_check(ctx, out)


@h.subtest()
def moe_dcp(ctx):
    """A per-parameter-mesh model saved with torch's helpers + DCP by cfsdp loads into torch's
    FSDP2 (other weights) and resumes with bitwise the uninterrupted losses."""
    path = ckpt_dir(ctx, "moe_dcp")
    data = moe_batches(4)

    def run(model, opt, steps):
        losses = []
        for step in steps:
            x, y = step[0]
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
        return losses

    model = moe_model("cfsdp", "spmd")
    opt = pc.make_optim("adamw", model.parameters())
    run(model, opt, data[:2])
    dcp_save(model, opt, path)
    want = run(model, opt, data[2:])
    fresh = moe_model("torch", "spmd", seed=1)
    fresh_opt = pc.make_optim("adamw", fresh.parameters())
    dcp_load(fresh, fresh_opt, path)
    got = run(fresh, fresh_opt, data[2:])
    mm = pc.Mismatches(ctx)
    for i, (a, b) in enumerate(zip(got, want)):
        mm.tensors(f"resumed loss #{i}", a, b)
    mm.raise_if_any()


if __name__ == "__main__":
    h.main()
