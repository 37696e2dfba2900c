"""``cfsdp.patch_torch()`` and its switch: code written against torch's names runs on cfsdp.

Launched by tests/distributed/test_patch.py as ``torchrun -m cfsdp.run worker_patch.py
[--only ...]``: the switch patches torch before this script runs (``switch`` checks it saw
cfsdp's objects under torch's names before importing anything of its own, ran as
``__main__`` and got its arguments).  Then it imports torch_names_trainer.py, a trainer that
names only torch, twice: once while torch is patched (``patched``: every name it binds is
cfsdp's), once between ``cfsdp.unpatch_torch()`` and ``cfsdp.patch_torch()`` (``torch``:
torch's own objects, which therefore run while the patch is active: the patch must not
disturb torch's own FSDP, see [Note: only the outside view is patched] in cfsdp/_patch.py).

Three contenders per face, same seed and data, compared **bitwise** (losses, clipped total
norms, full model and optimizer state dicts, FSDP unit counts, a resumed run's losses, DSD
helper output, forward-method outputs):

* ``torch``:   torch's FSDP1 / FSDP2 (the oracle; cfsdp is bitwise torch's on these models:
  2 ranks on shared memory (a sum of two terms), 4 ranks on gloo);
* ``patched``: the same trainer on cfsdp, through torch's names;
* ``by_name``: cfsdp called by name (``cfsdp.FullyShardedDataParallel(...)``,
  ``cfsdp.fully_shard``, the static API through ``cfsdp.FullyShardedDataParallel``), trained
  by the trainer's own loop (the user's training code).

The wrapper clips with the inf norm, which cfsdp's ``clip_grad_norm_`` computes bit for bit as
torch's (p = 2 only within float32 rounding: README, ``clip_grad_norm_``); ``fully_shard`` models
clip with torch's ``torch.nn.utils.clip_grad_norm_`` (the 2-norm: torch's inf norm fails on a
rank whose shard is empty), which runs torch's own code on the DTensor gradients.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch.distributed.fsdp as _torch_fsdp

# what the switch left before this script imported anything of its own
SEEN_AT_START = {
    "names": {n: getattr(_torch_fsdp, n) for n in ("FullyShardedDataParallel", "FSDPModule",
                                                    "UnshardHandle", "fully_shard",
                                                    "register_fsdp_forward_method",
                                                    "share_comm_ctx")},
    "argv": list(sys.argv),
    "name": __name__,
    "path0": sys.path[0],
}

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType  # noqa: E402
from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import _harness as h  # noqa: E402
import cfsdp  # noqa: E402
from cfsdp import _patch  # noqa: E402

import torch_names_trainer as patched  # noqa: E402  (imported while patched)

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, RESUME_STEPS = 3, 2


def load_copy(name: str):
    """A fresh copy of torch_names_trainer.py under ``name`` (names bound now)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "torch_names_trainer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cfsdp.unpatch_torch()
TORCH_OBJECTS = {n: getattr(_torch_fsdp, n) for n in SEEN_AT_START["names"]}
torch_names = load_copy("torch_names_trainer_torch")  # imported while unpatched
cfsdp.patch_torch()


# --------------------------------------------------------------------------------- compare
def same(mm: list[str], what: str, a, b) -> None:
    """Bitwise equality of nested state: dict keys in order, sequences, tensors (type, dtype,
    shape, values; a DTensor's placements and local shard), anything else by ``==``."""
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            mm.append(f"{what}: keys {list(a)} != {list(b)}")
            return
        for k in a:
            same(mm, f"{what}[{k!r}]", a[k], b[k])
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            mm.append(f"{what}: {type(a).__name__} of {len(a)} != {type(b).__name__} of {len(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            same(mm, f"{what}[{i}]", x, y)
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if type(a) is not type(b):
            mm.append(f"{what}: {type(a).__name__} != {type(b).__name__}")
            return
        if isinstance(a, DTensor):
            if a.placements != b.placements or a.shape != b.shape:
                mm.append(f"{what}: DTensor {a.placements} {tuple(a.shape)} != "
                          f"{b.placements} {tuple(b.shape)}")
                return
            a, b = a.to_local(), b.to_local()
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.detach(), b.detach()):
            mm.append(f"{what}: {a.dtype} {tuple(a.shape)} {a.flatten()[:4].tolist()} != "
                      f"{b.dtype} {tuple(b.shape)} {b.flatten()[:4].tolist()}")
    elif type(a) is not type(b) or a != b:
        mm.append(f"{what}: {a!r} != {b!r}")


def all_same(ctx: h.Context, results: dict[str, dict]) -> None:
    """Every contender's results bitwise equal to torch's."""
    mm: list[str] = []
    for who, res in results.items():
        if who != "torch":
            same(mm, who, res, results["torch"])
    if mm:
        raise AssertionError(f"rank {ctx.rank}: {len(mm)} mismatch(es) with torch:\n  "
                             + "\n  ".join(mm[:25]))


def expect_type(model, cls, who: str) -> None:
    if not isinstance(model, cls):
        raise AssertionError(f"{who}: the model is a {type(model).__module__}."
                             f"{type(model).__qualname__}, not a {cls.__module__}.{cls.__qualname__}")


# ---------------------------------------------------------------------------------- subtests
@h.subtest
def switch(ctx: h.Context) -> None:
    """``-m cfsdp.run`` patched before the script, which ran as __main__ with its arguments;
    the two trainer copies bound cfsdp's and torch's objects."""
    bad = [n for n, o in SEEN_AT_START["names"].items() if o is not _patch.CFSDP_OBJECTS[n]]
    if bad:
        raise AssertionError(f"torch.distributed.fsdp's {bad} were not cfsdp's when the script started")
    if SEEN_AT_START["name"] != "__main__" or SEEN_AT_START["argv"][0] != __file__:
        raise AssertionError(f"ran as {SEEN_AT_START['name']!r} with argv {SEEN_AT_START['argv']}")
    if SEEN_AT_START["argv"][1:] != json.loads(os.environ["CFSDP_PATCH_ARGV"]):
        raise AssertionError(f"the script's arguments were {SEEN_AT_START['argv'][1:]}, "
                             f"the launch passed {os.environ['CFSDP_PATCH_ARGV']}")
    if SEEN_AT_START["path0"] != HERE:
        raise AssertionError(f"sys.path[0] was {SEEN_AT_START['path0']!r}, not the script's directory")
    for n, o in TORCH_OBJECTS.items():
        if not o.__module__.startswith("torch."):
            raise AssertionError(f"unpatched torch.distributed.fsdp.{n} is {o!r}")
    for n in patched.BOUND:
        for copy, want in ((patched, _patch.CFSDP_OBJECTS[n]), (torch_names, TORCH_OBJECTS[n])):
            got = copy.BOUND[n]
            if any(o is not want for o in got):
                raise AssertionError(f"{copy.__name__} bound {n} to {got}, not {want}")


def fsdp1_contenders(ctx: h.Context, uop: bool):
    """(name, trainer copy, wrap, checkpoint, resume) of each contender."""
    policy = ModuleWrapPolicy({patched.Block})
    F = cfsdp.FullyShardedDataParallel
    cfgs = (StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False))

    def by_name_wrap(model):
        return F(model, process_group=ctx.pg, auto_wrap_policy=policy, use_orig_params=uop,
                 device_id=patched.CPU)

    def by_name_checkpoint(model, opt):
        with F.state_dict_type(model, *cfgs):
            return len(F.fsdp_modules(model)), model.state_dict(), F.optim_state_dict(model, opt)

    def by_name_resume(model, opt, msd, osd):
        with F.state_dict_type(model, *cfgs):
            model.load_state_dict(msd)
            opt.load_state_dict(F.optim_state_dict_to_load(model, opt, osd))

    def via(t):
        return (lambda m: t.wrap_fsdp1(m, ctx.pg, uop)), t.fsdp1_checkpoint, t.fsdp1_resume

    return {"torch": (torch_names, *via(torch_names)), "patched": (patched, *via(patched)),
            "by_name": (patched, by_name_wrap, by_name_checkpoint, by_name_resume)}


@h.subtest(grid={"use_orig_params": [False, True]})
def fsdp1(ctx: h.Context, use_orig_params: bool) -> None:
    """The wrapper with an auto-wrap policy, torch's static API, a resumed run."""
    data = patched.batches(ctx.rank, STEPS + RESUME_STEPS)
    results = {}
    for who, (t, wrap, checkpoint, resume) in fsdp1_contenders(ctx, use_orig_params).items():
        model = wrap(t.build())
        expect_type(model, TORCH_OBJECTS["FullyShardedDataParallel"] if who == "torch"
                    else cfsdp.FullyShardedDataParallel, who)
        opt = t.adamw(model)
        losses, norms = t.train_fsdp1(model, opt, data[:STEPS])
        units, msd, osd = checkpoint(model, opt)
        fresh = wrap(t.build(seed=1))
        fresh_opt = t.adamw(fresh)
        resume(fresh, fresh_opt, msd, osd)
        resumed, _ = t.train_fsdp1(fresh, fresh_opt, data[STEPS:])
        results[who] = {"losses": losses, "norms": norms, "units": units, "msd": msd,
                        "osd": osd, "resumed": resumed}
    if results["torch"]["units"] != 3:
        raise AssertionError(f"torch's fsdp_modules found {results['torch']['units']} units, not 3")
    all_same(ctx, results)


@h.subtest(grid={"from_meta": [False, True]})
def fully_shard(ctx: h.Context, from_meta: bool) -> None:
    """fully_shard per block then the root (two torch names), a registered forward method,
    unshard/reshard, the DTensor state dicts; ``from_meta``: sharded on the meta device and
    loaded with ``load_state_dict(assign=True)``, as accelerate does."""
    mesh = DeviceMesh.from_group(ctx.pg, "cpu")
    data = patched.batches(ctx.rank, STEPS + 1)

    def by_name_shard(model):
        for b in model.blocks:
            cfsdp.fully_shard(b, mesh=mesh)
        cfsdp.fully_shard(model, mesh=mesh)
        cfsdp.register_fsdp_forward_method(model, "score")
        return model

    def via(t):
        shard = t.shard_fsdp2_from_meta if from_meta else t.shard_fsdp2
        return t, lambda m: shard(m, mesh)

    contenders = {"torch": via(torch_names), "patched": via(patched),
                  "by_name": (patched, by_name_shard)}
    results = {}
    for who, (t, shard) in contenders.items():
        model = shard(t.build())
        expect_type(model, TORCH_OBJECTS["FSDPModule"] if who == "torch" else cfsdp.FSDPModule, who)
        opt = t.adamw(model)
        losses, norms = t.train_fsdp2(model, opt, data[:STEPS])
        results[who] = {"losses": losses, "norms": norms, "osd": opt.state_dict(),
                        **t.fsdp2_extras(model, data[STEPS][0])}
    all_same(ctx, results)


@h.subtest
def dsd_helpers(ctx: h.Context) -> None:
    """torch's ``get_state_dict`` on the patched trainer's wrapper (cfsdp checks for torch's
    FSDP1 class inside a cfsdp model: it must be torch's class, not the patched name's)."""
    data = patched.batches(ctx.rank, 2)
    results = {}
    for who, (t, wrap, _, _) in fsdp1_contenders(ctx, True).items():
        model = wrap(t.build())
        opt = t.adamw(model)
        t.train_fsdp1(model, opt, data)
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        results[who] = {"msd": msd, "osd": osd}
    all_same(ctx, results)


@h.subtest
def zero(ctx: h.Context) -> None:
    """``torch.distributed.optim.ZeroRedundancyOptimizer`` looked up while patched is cfsdp's,
    and trains (under DDP) bit for bit as torch's, read before the patch: losses, parameters
    and the consolidated state dict."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch.distributed.optim as torch_optim

    if ZeroRedundancyOptimizer is not cfsdp.ZeroRedundancyOptimizer:
        raise AssertionError(f"patched lookup gave {ZeroRedundancyOptimizer}, not cfsdp's")
    data = patched.batches(ctx.rank, STEPS)
    results = {}
    for who, cls in (("torch", vars(torch_optim)["ZeroRedundancyOptimizer"]),
                     ("patched", ZeroRedundancyOptimizer)):
        model = DDP(patched.build())
        opt = cls(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        losses = []
        for x, y in data:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        opt.consolidate_state_dict(to=0)
        results[who] = {"losses": losses, "params": dict(model.module.state_dict()),
                        "optim": opt.state_dict() if ctx.rank == 0 else None}
    all_same(ctx, results)


@h.subtest
def ddp_tensor_parallel(ctx: h.Context) -> None:
    """While patched, ``DistributedDataParallel(tp_model, device_mesh=mesh["dp"])`` imports
    ``_pre_dp_module_transform`` from torch and so runs cfsdp's: the same losses and
    parameters as torch's transform (built with torch unpatched), and the model's parameters
    stay visible as DTensors between steps (torch's lose them: pytorch issue 152712)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tp_common as tc

    layout = (1, 2) if ctx.world_size == 2 else (2, 2)
    mesh = tc.mesh_2d(*layout)
    data = tc.batches(STEPS, layout[0])
    dp_rank = mesh["dp"].get_local_rank()
    results, visible = {}, {}
    for who in ("torch", "patched"):
        model = tc.parallelize(tc.build(), mesh["tp"], sp=False)
        if who == "torch":
            cfsdp.unpatch_torch()
        try:
            ddp = DDP(model, device_mesh=mesh["dp"])
        finally:
            cfsdp.patch_torch()
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        losses = []
        for step in data:
            x, y = step[dp_rank]
            loss = tc.loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        visible[who] = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
        results[who] = {"losses": losses}
    if not visible["patched"]:
        raise AssertionError("patched DDP + TP: no DTensor parameter visible after training "
                             "(torch's transform ran, not cfsdp's)")
    if visible["torch"]:
        raise AssertionError(f"torch's transform now keeps its parameters {visible['torch']}: "
                             "pytorch issue 152712 fixed? Revisit cfsdp.parallel")
    all_same(ctx, results)


_TITAN_MESHES: dict = {}


if patched.DataParallelMeshDims is not None:  # torch 2.13+ (2.11: no dp_mesh_dims at all)
    @h.subtest(grid={"tp": [False, True]})
    def torchtitan_path(ctx: h.Context, tp: bool) -> None:
        """torchtitan 0.3.0's full-DTensor parallelize path (torch_names_trainer.titan_shard:
        fully_shard with dp_mesh_dims on the whole mesh, its mixed precision, a two-module unit,
        set_gradient_divide_factor(1.0)) trains through torch's names on cfsdp bit for bit as on
        torch (losses, every parameter's placements and local shard).  Meshes: (dp_shard,) or
        (dp_shard, tp) at 2 ranks; (dp_replicate, dp_shard) (HSDP) or (dp_shard, tp) at 4.  torch
        needs force-sum on gloo (no PREMUL_SUM for the factor): the same sums, divided by 1."""
        W = ctx.world_size
        if tp:
            shape, names = (W // 2, 2), ("dp_shard", "tp")
        else:
            shape, names = ((W,), ("dp_shard",)) if W == 2 else ((2, W // 2), ("dp_replicate", "dp_shard"))
        mesh = _TITAN_MESHES.get(shape + names)  # one object: DTensor caches specs by value
        if mesh is None:
            mesh = _TITAN_MESHES[shape + names] = DeviceMesh("cpu", torch.arange(W).view(shape),
                                                             mesh_dim_names=names)
        data = patched.titan_batches(mesh, STEPS)
        results = {}
        for who, t in (("torch", torch_names), ("patched", patched)):
            model = t.titan_shard(t.titan_build(mesh), mesh, force_sum=who == "torch")
            expect_type(model, TORCH_OBJECTS["FSDPModule"] if who == "torch" else cfsdp.FSDPModule, who)
            losses = t.titan_train(model, mesh, data)
            results[who] = {"losses": losses,
                            "params": {n: (tuple(p.placements), p.to_local())
                                       for n, p in model.named_parameters()}}
        all_same(ctx, results)


@h.subtest
def unpatch(ctx: h.Context) -> None:
    """unpatch_torch() gives torch's objects back to new lookups (idempotent), patch_torch()
    again gives cfsdp's."""
    try:
        cfsdp.unpatch_torch()
        cfsdp.unpatch_torch()
        again = load_copy("torch_names_trainer_unpatched")
        if _patch.patched_torch_names():
            raise AssertionError(f"still patched: {_patch.patched_torch_names()}")
        for n, objs in again.BOUND.items():
            if any(o is not TORCH_OBJECTS[n] for o in objs):
                raise AssertionError(f"after unpatch_torch() {n} is {objs}, not torch's")
    finally:
        cfsdp.patch_torch()
    relinked = load_copy("torch_names_trainer_repatched")
    for n, objs in relinked.BOUND.items():
        if any(o is not _patch.CFSDP_OBJECTS[n] for o in objs):
            raise AssertionError(f"after patch_torch() again {n} is {objs}, not cfsdp's")


if __name__ == "__main__":
    h.main()
