"""Tensor parallelism with both faces: cfsdp against torch's FSDP2 + TP (and FSDP1 + TP).

Run by test_tp.py under torchrun (gloo, CPU).  The model is tp_common.TPModel, tensor-parallel
on the ``tp`` dimension of a ``(dp, tp)`` mesh with every parallel style torch ships
(column/row-wise, sequence parallel, PrepareModuleInput/Output; uneven TP shards), then sharded
on ``dp``.  At 2 ranks the meshes are (1, 2) and (2, 1); at 4 ranks (2, 2), and HSDP x TP on
the 3-D meshes (2, 1, 2) and (1, 2, 2) (replicate, shard, tp).

Oracle: torch on the same model, seed and data.  cfsdp is **bitwise** equal: the same local
tensors go through the same collectives (every dp sum has at most two terms at these sizes, so
shared memory and gloo agree) and the same DTensor ops.  Compared per step: losses; after
training: every parameter's placements, local shard and full value, the local gradients after
the last backward, and the model state dict (keys, placements, local values).

``CFSDP_TP_PHASE`` picks the checkpoint-across-meshes phases (test_tp.py chains them):
``save`` at 4 ranks on (2, 2) writes a DCP checkpoint through torch's helpers and the
uninterrupted run's next losses; ``load`` at 2 ranks loads it on (1, 2) and on (2, 1) and must
reproduce them (up to float rounding: another dp size sums in another order).
"""

from __future__ import annotations

import json
import os
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

import _harness as h
import tp_common as tc
from ckpt_common import ckpt_dir
import parity_common as pc
from tp_dcp_common import SHARDERS, STEPS, compare, dcp_load, dcp_save, describe_sd, snapshot

from muon_oracle import AllGatherMuon, Pair, muon_pair as _muon_pair, small_buckets

import cfsdp
from cfsdp.optim._muon_mesh import MeshLayout
from cfsdp.optim._muon_shard import shard_layout



WORLD = int(os.environ.get("WORLD_SIZE", "2"))
PHASE = os.environ.get("CFSDP_TP_PHASE", "")
RESHARD_RTOL = 1e-5


def fs_model(impl: str, mesh, sp: bool, seed: int = 0, dp_key="dp", **kw):
    """TPModel, TP on mesh["tp"], each block then the root given to ``impl``'s fully_shard."""
    model = tc.parallelize(tc.build(seed), mesh["tp"], sp)
    shard = SHARDERS[impl]
    dp_mesh = mesh[dp_key]
    for b in model.blocks:
        shard(b, mesh=dp_mesh, **kw)
    shard(model, mesh=dp_mesh, **kw)
    return model


def dp_rank(mesh, dp_key="dp") -> int:
    m = mesh[dp_key]
    if m.ndim == 1:
        return m.get_local_rank()
    return m.get_local_rank(0) * m.size(1) + m.get_local_rank(1)


def dp_size(mesh, dp_key="dp") -> int:
    return mesh[dp_key].size()


def train(model, opt, data, rank: int, micro: Callable | None = None) -> list[torch.Tensor]:
    losses = []
    for step in data:
        x, y = step[rank]
        loss = tc.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def run_pair(ctx, mesh, sp: bool, steps: int = STEPS, optim: str = "adamw", dp_key="dp",
             fs_kw: dict | None = None, cfsdp_optim: bool = False, make_opt: Callable | None = None):
    """Train torch and cfsdp; return {impl: (losses, snapshot, state-dict description)}.
    ``make_opt(impl, model)``: the optimizer (else ``optim``, or cfsdp's AdamW)."""
    data = tc.batches(steps, dp_size(mesh, dp_key))
    out = {}
    for impl in ("torch", "cfsdp"):
        model = fs_model(impl, mesh, sp, dp_key=dp_key, **(fs_kw or {}))
        if make_opt is not None:
            opt = make_opt(impl, model)
        elif cfsdp_optim and impl == "cfsdp":
            opt = cfsdp.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        else:
            opt = pc.make_optim(optim, model.parameters())
        losses = []
        for i, step in enumerate(data):
            x, y = step[dp_rank(mesh, dp_key)]
            loss = tc.loss_fn(model(x), y)
            loss.backward()
            if i == len(data) - 1:
                snap = snapshot(model)  # gradients of the last backward
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
        after = snapshot(model)
        out[impl] = (losses, {n: (*after[n][:3], snap[n][3]) for n in after},
                     describe_sd(model.state_dict()))
    return out


def check_pair(ctx, out, exact: bool = True) -> None:
    mm = pc.Mismatches(ctx)
    (tl, ts, tsd), (cl, cs, csd) = out["torch"], out["cfsdp"]
    for i, (a, b) in enumerate(zip(cl, tl)):
        mm.tensors(f"loss #{i}", a, b, exact=exact)
    if exact:
        compare(mm, "parameters (placements, local, full, local grad)", cs, ts)
        compare(mm, "state_dict", csd, tsd)
    mm.raise_if_any()


# ----------------------------------------------------------------------------- fully_shard


@h.subtest(grid={"layout": tc.meshes(WORLD), "sp": [False, True], "optim": ["adamw", "sgd"]})
def fs_parity(ctx, layout, sp: bool, optim: str):
    check_pair(ctx, run_pair(ctx, tc.mesh_2d(*layout), sp, optim=optim))


@h.subtest(grid={"layout": tc.meshes(WORLD), "sp": [False, True]})
def fs_shard_dim(ctx, layout, sp: bool):
    """shard_placement_fn puts every matrix on Shard(1) (torch's
    test_init_2d_transformer_shard_diff_dim): the dp shards of a row-wise weight, which TP
    shards on dim 1 too, are _StridedShard(1), those of a column-wise one Shard(1) beside
    TP's Shard(0); bitwise as torch's FSDP2 + TP."""
    mesh = tc.mesh_2d(*layout)
    dp = dp_size(mesh)

    def on_dim1(p):
        local = p.to_local() if isinstance(p, DTensor) else p
        return Shard(1) if local.dim() == 2 and local.size(1) % dp == 0 else None

    out = run_pair(ctx, mesh, sp, fs_kw={"shard_placement_fn": on_dim1})
    mm = pc.Mismatches(ctx)
    placements = {n: v[0] for n, v in out["cfsdp"][1].items()}
    mm.check(any(Shard(1) in pl or any(getattr(x, "dim", 0) == 1 and type(x).__name__ ==
                                       "_StridedShard" for x in pl) for pl in placements.values()),
             f"no parameter sharded on dim 1: {placements}")
    mm.raise_if_any()
    check_pair(ctx, out)


@h.subtest(grid={"layout": tc.meshes(WORLD)})
def fs_mixed_precision(ctx, layout):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    check_pair(ctx, run_pair(ctx, tc.mesh_2d(*layout), True, fs_kw={"mp_policy": policy}))


@h.subtest(grid={"layout": tc.meshes(WORLD), "mp": [False, True]})
def fs_grad_accumulation(ctx, layout, mp: bool):
    """set_requires_gradient_sync(False) for all but the last micro-batch of a step, and a
    unit kept unsharded after backward (no-sync gradients on the registered TP DTensors).
    ``mp``: bf16 parameters, fp32 reduction: torch sums the no-sync gradients in fp32 (the
    sequence-parallel norms' partial sums too, redistributed once complete)."""
    mesh = tc.mesh_2d(*layout)
    data = tc.batches(3, dp_size(mesh) * 2)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                            reduce_dtype=torch.float32)} if mp else {}
    res = {}
    for impl in ("torch", "cfsdp"):
        model = fs_model(impl, mesh, True, **kw)
        model.blocks[0].set_reshard_after_backward(False)
        opt = pc.make_optim("sgd", model.parameters())
        seen = []
        for step in data:
            for m in range(2):
                model.set_requires_gradient_sync(m == 1)
                x, y = step[2 * dp_rank(mesh) + m]
                loss = tc.loss_fn(model(x), y)
                loss.backward()
                seen.append(loss.detach().clone())
                if m == 0:
                    g = model.blocks[0].w1.weight.grad
                    seen.append(None if g is None else (tuple(g.placements), g.to_local().clone()))
            opt.step()
            opt.zero_grad()
        res[impl] = (seen, snapshot(model))
    mm = pc.Mismatches(ctx)
    compare(mm, "losses and no-sync gradients", res["cfsdp"][0], res["torch"][0])
    compare(mm, "parameters", res["cfsdp"][1], res["torch"][1])
    mm.raise_if_any()


@h.subtest(grid={"layout": tc.meshes(WORLD)})
def fs_cfsdp_optim(ctx, layout):
    """cfsdp.optim.AdamW steps the 2-D DTensor parameters (their local shards) as torch's
    AdamW does: within a few ulps per step (csrc/optim.c's IEEE sqrt against torch's MKL one,
    see cfsdp/optim.py), so losses agree to 1e-5 relative over the steps."""
    check_pair(ctx, run_pair(ctx, tc.mesh_2d(*layout), False, cfsdp_optim=True), exact=False)


@h.subtest(grid={"layout": tc.meshes(WORLD), "sp": [False, True]})
def fs_muon(ctx, layout, sp: bool):
    """cfsdp.optim.Muon (+ AdamW) on TP x fully_shard against the all-gather Muon on torch's:
    bitwise (losses, placements, local and full parameters, local gradients, state dict).  At
    (2, 2) every matrix is sharded over both mesh dims: colwise weights and the rowwise
    embedding (_StridedShard(0) on dp, Shard(0) on tp; the 11-row head uneven) and rowwise
    weights (Shard(0), Shard(1)), reassembled on one owner of the 4 ranks; at 2 ranks one
    dim (Shard on tp or on dp)."""
    mesh = tc.mesh_2d(*layout)
    out = run_pair(ctx, mesh, sp, make_opt=_muon_pair)
    check_pair(ctx, out)
    _single_process_muon(ctx, {n: v[2] for n, v in out["cfsdp"][1].items()})
    _check_blocks(ctx, fs_model("cfsdp", mesh, sp))


# against one process on the global batch: the gradients differ from it by the reduction
# order's ulps, which Newton–Schulz (in bf16) can turn into bf16 ulps of an update
MUON_REF_RTOL, MUON_REF_ATOL = 1e-5, 1e-6  # atol: times the reference's largest |value|


def _single_process_muon(ctx, full: dict) -> None:
    """cfsdp's full parameters after ``run_pair``'s steps against torch's Muon (+ AdamW, as
    ``_muon_pair``) on the plain model in one process, on the global batch."""
    ref = tc.build(0)
    opt = Pair(torch.optim.Muon([p for p in ref.parameters() if p.ndim >= 2], lr=0.02),
               torch.optim.AdamW([p for p in ref.parameters() if p.ndim < 2], lr=1e-2,
                                 weight_decay=0.01))
    for step in tc.batches(STEPS, 1):
        x, y = step[0]
        tc.loss_fn(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    mm = pc.Mismatches(ctx)
    for n, p in ref.named_parameters():
        want = p.detach()
        mm.tensors(f"{n} against one process on the global batch", full[n], want, exact=False,
                   a_name="cfsdp", b_name="one process", rtol=MUON_REF_RTOL,
                   atol=MUON_REF_ATOL * want.abs().max().item())
    if ctx.rank == 0:
        ctx.log(f"against one process: worst |diff|/(atol+rtol*|ref|) = {mm.worst_ref:.3f}")
    mm.raise_if_any()


@h.subtest(grid={"layout": tc.meshes(WORLD)})
def fs_muon_buckets(ctx, layout):
    """``fs_muon`` (no sequence parallelism) with the exchange cut into one bucket per matrix
    (bound 1 byte): the blocks of every layout still reassembled and returned bitwise."""
    with small_buckets(1) as plans:
        check_pair(ctx, run_pair(ctx, tc.mesh_2d(*layout), False, make_opt=_muon_pair))
    assert plans and max(plans) > 1, f"bucket counts per exchange {plans}"


def _check_blocks(ctx, model) -> None:
    """The blocks Muon computes for a parameter sharded over both mesh dims
    (``_muon_mesh.block``) are DTensor's: this rank's block of ``full_tensor()`` is its local
    tensor, and the ranks' blocks tile the matrix once (a permuted layout would still pass
    the parity: Newton–Schulz commutes with permuting rows)."""
    mm = pc.Mismatches(ctx)
    for n, p in model.named_parameters():
        lay, why = shard_layout(p)
        if not isinstance(lay, MeshLayout):
            continue
        full, cover = p.full_tensor(), torch.zeros(p.shape, dtype=torch.int32)
        for r, (starts, sizes) in enumerate(lay.dim.of_rank):
            region = tuple(slice(a, a + b) for a, b in zip(starts, sizes))
            cover[region] += 1
            if r == lay.index:
                mm.tensors(f"{n} ({p.placements}): rank {r}'s block {starts} {sizes}",
                           full[region], p.to_local(), a_name="block of full", b_name="local")
        mm.check(bool((cover == 1).all()), f"{n}: blocks cover the matrix {cover.tolist()}")
    mm.raise_if_any()


if WORLD == 4:
    @h.subtest(grid={"shape": [(2, 1, 2), (1, 2, 2)], "sp": [False, True]})
    def fs_hsdp_tp(ctx, shape, sp: bool):
        """HSDP x TP on 4 ranks: a 3-D (replicate, shard, tp) mesh, fully_shard on the 2-D
        (replicate, shard) sub-mesh."""
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("rep", "shard", "tp"))
        check_pair(ctx, run_pair(ctx, mesh, sp, dp_key=("rep", "shard")))



if WORLD in (4, 8):
    @h.subtest(grid={"shape": [(2, 1, 2), (1, 2, 2)] if WORLD == 4 else [(2, 2, 2)]})
    def fs_muon_hsdp_tp(ctx, shape):
        """cfsdp.optim.Muon (+ AdamW) on HSDP x TP (a 3-D (replicate, shard, tp) mesh) against
        the all-gather Muon on torch's: bitwise.  (1, 2, 2): every matrix sharded over the
        shard and tp dims of a 3-D mesh (blocks over the 4 ranks, on the exchange's own group
        of them); (2, 1, 2): over tp only, each replicate orthogonalizing its own copy; (2, 2,
        2) at 8 ranks (test_tp.py's launch of this subtest alone): over (shard, tp), each
        replicate's 4 ranks exchanging on a group of their own."""
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("rep", "shard", "tp"))
        check_pair(ctx, run_pair(ctx, mesh, False, dp_key=("rep", "shard"), make_opt=_muon_pair))
        model = fs_model("cfsdp", mesh, False, dp_key=("rep", "shard"))
        _check_blocks(ctx, model)
        if shape[1] > 1:  # the exchange's group: the ranks of this rank's replicate
            lay = shard_layout(model.tok.weight)[0]
            rep = mesh.get_local_rank("rep")
            want = tuple(int(r) for r in mesh.mesh[rep].flatten().sort().values)
            assert isinstance(lay, MeshLayout) and lay.ranks == want, (lay, want)
            assert dist.get_process_group_ranks(lay.group) == list(want)


if WORLD == 8:
    @h.subtest
    def muon_three_sharded_dims(ctx):
        """Matrices cut over three mesh dims of a (2, 2, 2) mesh by plain Shard(d)s (an EP x FSDP
        x TP layout; uneven and 3-D ones too), 2 steps of cfsdp.optim.Muon against the
        all-gather Muon on copies: local parameters bitwise; the blocks are DTensor's."""
        from torch.distributed.tensor import distribute_tensor

        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("ep", "dp", "tp"))
        cases = [((12, 10), [Shard(0), Shard(1), Shard(0)]),
                 ((9, 7, 5), [Shard(0), Shard(2), Shard(1)]),
                 ((16, 8), [Shard(1), Shard(0), Shard(1)])]
        g = torch.Generator().manual_seed(5)
        fulls = [torch.randn(s, generator=g) for s, _ in cases]
        ours = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, pl))
                for f, (_, pl) in zip(fulls, cases)]
        theirs = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, pl))
                  for f, (_, pl) in zip(fulls, cases)]
        opt = cfsdp.optim.Muon([(f"w{i}", p) for i, p in enumerate(ours)], lr=0.02)
        oracle = AllGatherMuon(theirs, lr=0.02)
        for step in range(2):
            for i, (shape, pl) in enumerate(cases):
                grad = torch.randn(shape, generator=g)
                ours[i].grad = distribute_tensor(grad.clone(), mesh, pl)
                theirs[i].grad = distribute_tensor(grad.clone(), mesh, pl)
            opt.step()
            oracle.step()
        mm = pc.Mismatches(ctx)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            mm.tensors(f"w{i} {cases[i][1]} local after 2 steps", a.to_local(), b.to_local(),
                       a_name="cfsdp", b_name="all-gather Muon")
            lay = shard_layout(a)[0]
            mm.check(isinstance(lay, MeshLayout) and lay.ranks == tuple(range(8)),
                     f"w{i}: layout {lay}")
            starts, sizes = lay.dim.of_rank[lay.index]
            region = tuple(slice(s0, s0 + k) for s0, k in zip(starts, sizes))
            mm.tensors(f"w{i}: this rank's block", a.full_tensor()[region], a.to_local())
        mm.raise_if_any()


# ----------------------------------------------------------------------------- DDP + TP


def ddp_model(impl: str, mesh, sp: bool, seed: int = 0):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = tc.parallelize(tc.build(seed), mesh["tp"], sp)
    if impl == "torch":  # DDP calls torch's _pre_dp_module_transform itself
        return DDP(model, device_mesh=mesh["dp"]), model
    cfsdp.pre_dp_module_transform(model)
    return DDP(model, process_group=mesh["dp"].get_group()), model


def _dtensor_attrs(model) -> dict[str, torch.Tensor]:
    """Every DTensor the model's modules hold (as parameters or, after torch's transform
    broke them, as plain attributes), by FQN, as full tensors."""
    out = {}
    for mn, m in model.named_modules():
        for k, v in list(vars(m).items()) + list(m._parameters.items()):
            if isinstance(v, DTensor):
                out[f"{mn}.{k}" if mn else k] = v.full_tensor().detach().clone()
    return out


@h.subtest(grid={"layout": tc.meshes(WORLD), "sp": [False, True]})
def ddp_pre_dp_transform(ctx, layout, sp: bool):
    """cfsdp.pre_dp_module_transform + DDP trains as torch's DDP + TP (bit for bit: losses and
    parameters), and, unlike torch's (pytorch issue 152712), named_parameters() and
    state_dict() keep showing the DTensor parameters between steps; the state dict saved
    through DCP loads into the same model and into torch's FSDP2 + TP model."""
    mesh = tc.mesh_2d(*layout)
    data = tc.batches(3, dp_size(mesh))
    res = {}
    for impl in ("torch", "cfsdp"):
        ddp, model = ddp_model(impl, mesh, sp)
        names_before = [n for n, _ in model.named_parameters()]
        opt = pc.make_optim("adamw", ddp.parameters())
        losses = train(ddp, opt, data, dp_rank(mesh))
        res[impl] = (losses, _dtensor_attrs(model), names_before, model)
    mm = pc.Mismatches(ctx)
    for i, (a, b) in enumerate(zip(res["cfsdp"][0], res["torch"][0])):
        mm.tensors(f"loss #{i}", a, b)
    compare(mm, "parameters after training", res["cfsdp"][1], res["torch"][1])
    model = res["cfsdp"][3]
    after = dict(model.named_parameters())
    mm.check(list(after) == res["cfsdp"][2] and all(isinstance(p, DTensor) for n, p in after.items()
                                                 if n in res["torch"][1]),
             f"named_parameters() between steps: {[(n, type(p).__name__) for n, p in after.items()]}")
    torch_left = [n for n, _ in res["torch"][3].named_parameters()]
    mm.check(not [n for n in torch_left if n in res["torch"][1]],
             f"torch's transform now keeps the DTensor parameters ({torch_left}): issue 152712 fixed?")
    sd = model.state_dict()
    mm.check(all(isinstance(sd[n], DTensor) for n in res["torch"][1] if n in sd) and set(sd) >= set(after),
             "state_dict() lacks the DTensor parameters")
    # the state dict through DCP into the same model (other weights) and into FSDP2 + TP
    path = ckpt_dir(ctx, f"ddp_tp_{layout[0]}x{layout[1]}_{int(sp)}")
    dcp.save(sd, checkpoint_id=str(path))
    for target in ("same", "fsdp2"):
        if target == "same":
            _, fresh = ddp_model("cfsdp", mesh, sp, seed=1)
        else:
            fresh = fs_model("torch", mesh, sp, seed=1)
        fsd = fresh.state_dict()
        dcp.load(fsd, checkpoint_id=str(path))
        fresh.load_state_dict(fsd)
        for n, v in sd.items():
            got = fresh.state_dict()[n]
            full = got.full_tensor() if isinstance(got, DTensor) else got
            mm.tensors(f"{target}: {n} after loading", full, v.full_tensor() if isinstance(v, DTensor) else v)
    mm.raise_if_any()


# ----------------------------------------------------------------------------- README example


def _example():
    """examples/tp_2d.py (the README's tensor-parallel example) as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "tp_2d.py"
    spec = importlib.util.spec_from_file_location("tp_2d_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@h.subtest(grid={"layout": tc.meshes(WORLD), "face": ["fully_shard", "wrapper", "ddp"]})
def readme_example(ctx, layout, face: str):
    """The README's example trains as torch's FSDP2 / FSDP1 / DDP do (bit for bit), and learns."""
    ex = _example()
    mesh = tc.mesh_2d(*layout)
    got, want = (ex.train(mesh, face, impl, steps=4) for impl in ("cfsdp", "torch"))
    mm = pc.Mismatches(ctx)
    mm.check(got == want, f"losses {got} != torch's {want}")
    mm.check(got[-1] < got[0], f"the example does not learn: losses {got}")
    mm.raise_if_any()


@h.subtest(grid={"direction": ["cfsdp->cfsdp", "torch->cfsdp", "cfsdp->torch"]})
def fs_dcp(ctx, direction: str):
    """torch's helpers + DCP on a TP + fully_shard model: a fresh model (other weights) loads
    the checkpoint and resumes with bitwise the uninterrupted losses; cross-loads between
    torch's FSDP2 + TP and cfsdp both ways."""
    writer, reader = direction.split("->")
    mesh = tc.mesh_2d(*tc.meshes(WORLD)[0])
    path = ckpt_dir(ctx, f"fs_dcp_{writer}_{reader}")
    data = tc.batches(4, dp_size(mesh))
    r = dp_rank(mesh)
    model = fs_model(writer, mesh, True)
    opt = pc.make_optim("adamw", model.parameters())
    train(model, opt, data[:2], r)
    dcp_save(model, opt, path)
    want = train(model, opt, data[2:], r)
    fresh = fs_model(reader, mesh, True, seed=1)
    fresh_opt = pc.make_optim("adamw", fresh.parameters())
    dcp_load(fresh, fresh_opt, path)
    got = train(fresh, fresh_opt, data[2:], r)
    mm = pc.Mismatches(ctx)
    for i, (a, b) in enumerate(zip(got, want)):
        mm.tensors(f"resumed loss #{i} ({direction})", a, b)
    mm.raise_if_any()


def _global_losses(losses: list[torch.Tensor], dp_group) -> list[float]:
    out = []
    for t in losses:
        t = t.clone()
        dist.all_reduce(t, group=dp_group)
        out.append((t / dist.get_world_size(dp_group)).item())
    return out


def phase_save(ctx):
    """At 4 ranks on (2, 2): train, save through torch's helpers + DCP, train on; rank 0
    writes the uninterrupted run's global losses."""
    mesh = tc.mesh_2d(2, 2)
    path = ckpt_dir(ctx, "across_meshes")
    data = tc.batches(4, 2)
    model = fs_model("cfsdp", mesh, True)
    opt = pc.make_optim("adamw", model.parameters())
    train(model, opt, data[:2], dp_rank(mesh))
    dcp_save(model, opt, path / "dcp")
    want = _global_losses(train(model, opt, data[2:], dp_rank(mesh)), mesh["dp"].get_group())
    if ctx.rank == 0:
        (path / "losses.json").write_text(json.dumps(want))


def phase_load(ctx):
    """At 2 ranks: load the (2, 2) checkpoint on (1, 2) and on (2, 1), each must go on with
    the saved run's losses."""
    path = ckpt_dir(ctx, "across_meshes")
    want = json.loads((path / "losses.json").read_text())
    mm = pc.Mismatches(ctx)
    for layout in ((1, 2), (2, 1)):
        mesh = tc.mesh_2d(*layout)
        data = tc.batches(4, layout[0])
        model = fs_model("cfsdp", mesh, True, seed=1)
        opt = pc.make_optim("adamw", model.parameters())
        dcp_load(model, opt, path / "dcp")
        got = _global_losses(train(model, opt, data[2:], dp_rank(mesh)), mesh["dp"].get_group())
        for i, (a, b) in enumerate(zip(got, want)):
            mm.check(abs(a - b) <= RESHARD_RTOL * abs(b),
                     f"mesh {layout}: loss #{i} {a} != {b} saved on (2, 2) (rtol {RESHARD_RTOL})")
    mm.raise_if_any()


if PHASE:
    del h._REGISTRY[:]
    h.subtest({"save": phase_save, "load": phase_load}[PHASE])


if __name__ == "__main__":
    h.main()
