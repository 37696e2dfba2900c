"""Model state dicts of cfsdp.FullyShardedDataParallel against torch's FSDP1: every type, FQN
rules, loading (strict and not, across implementations and from/to an unwrapped model), bad
input, and the unit-by-unit gather.

Run by tests/distributed/test_state_dict.py under torchrun (gloo, CPU) at W=2 and W=4.

The oracle is torch's FSDP1 on the same model, seed and data (cfsdp trains bitwise like it, see
worker_parity.py), so every value is compared **bitwise**: full tensors, ShardedTensor metadata
and local shards, DTensor placements and local tensors. Loading is checked by its effect: after
loading a state dict into a freshly built model (other seed), the model's full state dict equals
the saved one and the next training steps give the same losses as the model it came from.

Deliberate difference (documented in the README): torch 2.13's LOCAL_STATE_DICT with
use_orig_params=True holds both the flat local shard and a 1-D shard view per parameter, and
torch cannot load it back (unexpected keys); cfsdp holds only the flat shard, as with
use_orig_params=False, and loads it. There the flat shards are compared.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

import _harness as h
import parity_common as pc

import cfsdp
from cfsdp import FullyShardedDataParallel as CFSDP
from cfsdp._runtime.hooks import SummonStateError
from cfsdp._runtime.flat.unit import Unit

warnings.filterwarnings("ignore", message=".*FSDP.state_dict_type.*")
warnings.filterwarnings("ignore", message=".*ShardedTensor.*")
CPU = torch.device("cpu")
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
SF, SD, SL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT

# name -> (type, cfsdp's config, torch's config); "dtensor" builds both models with a
# device_mesh (torch then gives DTensors). torch 2.13's FSDP1 cannot offload to CPU on a CPU
# device (it frees the buffer it views, see worker_summon.py), so there the oracle is torch
# without offload: the values must be the same, on the CPU either way.
FLAVOURS = {
    "full": (SF, FullStateDictConfig(), FullStateDictConfig()),
    "full_rank0_offload": (SF, FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                           FullStateDictConfig(rank0_only=True)),
    "sharded": (SD, ShardedStateDictConfig(), ShardedStateDictConfig()),
    "sharded_offload": (SD, ShardedStateDictConfig(offload_to_cpu=True), ShardedStateDictConfig()),
    "dtensor": (SD, ShardedStateDictConfig(), ShardedStateDictConfig()),
    "local": (SL, LocalStateDictConfig(), LocalStateDictConfig()),
}


def cfg_of(flavour: str, torch_side: bool = False):
    t, c, tc = FLAVOURS[flavour]
    return t, copy.deepcopy(tc if torch_side else c)


# --------------------------------------------------------------------------------------------
# building and training
# --------------------------------------------------------------------------------------------


def wrap_kwargs(ctx, uop: bool, mesh=None, strategy=None) -> dict:
    kw = dict(device_id=CPU, use_orig_params=uop)
    if mesh is not None:
        kw["device_mesh"] = mesh
    else:
        kw["process_group"] = ctx.pg
    if strategy is not None:
        kw["sharding_strategy"] = strategy
    return kw


def build_pair(ctx, kind: str, uop: bool, seed: int = 0, mesh=None, strategy=None):
    """(torch FSDP1 model, cfsdp model) of ``kind`` from the same seed, wrapped alike."""
    kw = wrap_kwargs(ctx, uop, mesh, strategy)
    out = []
    for wrapper in (TorchFSDP, CFSDP):
        model = pc.build(kind, seed)
        if kind == "transformer":
            out.append(wrapper(model, auto_wrap_policy=ModuleWrapPolicy({pc.Block}), **kw))
        elif kind == "odd":
            out.append(pc.wrap_odd(wrapper, model, **kw))
        else:
            out.append(wrapper(model, **kw))
    return out


def train(model, opt, kind: str, rank: int, steps: int, seed: int = 7) -> list[torch.Tensor]:
    losses = []
    for chunks in pc.make_batches(kind, WORLD, steps, seed):
        x, y = chunks[rank]
        opt.zero_grad(set_to_none=True)
        loss = pc.LOSSES[kind](model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


def snapshot(sd: dict) -> dict:
    """A state dict's plain tensors cloned: buffers are the live module buffers (torch too)."""
    return type(sd)((k, v.clone() if type(v) is torch.Tensor else v) for k, v in sd.items())


def full_sd(model) -> dict:
    with CFSDP.state_dict_type(model, SF) if isinstance(model, CFSDP) else TorchFSDP.state_dict_type(model, SF):
        return snapshot(model.state_dict())


# --------------------------------------------------------------------------------------------
# comparisons
# --------------------------------------------------------------------------------------------


def same_value(mm: pc.Mismatches, what: str, a, b) -> None:
    """``a`` (cfsdp) and ``b`` (torch) are the same state-dict value: type, metadata, data."""
    if type(a) is not type(b):
        mm.add(f"{what}: cfsdp gives {type(a).__name__}, torch {type(b).__name__}")
        return
    if isinstance(a, ShardedTensor):
        mm.check(a.metadata() == b.metadata(), f"{what}: ShardedTensor metadata {a.metadata()} != {b.metadata()}")
        la, lb = a.local_shards(), b.local_shards()
        mm.check(len(la) == len(lb), f"{what}: {len(la)} local shards, torch {len(lb)}")
        for i, (sa, sb) in enumerate(zip(la, lb)):
            mm.check(sa.metadata == sb.metadata, f"{what}: local shard {i} metadata {sa.metadata} != {sb.metadata}")
            mm.tensors(f"{what}: local shard {i}", sa.tensor, sb.tensor)
    elif isinstance(a, DTensor):
        mm.check(a.placements == b.placements, f"{what}: placements {a.placements} != {b.placements}")
        mm.check(a.shape == b.shape, f"{what}: global shape {a.shape} != {b.shape}")
        mm.check(a.device_mesh.mesh.tolist() == b.device_mesh.mesh.tolist(), f"{what}: meshes differ")
        mm.tensors(f"{what}: local tensor", a.to_local(), b.to_local())
    elif isinstance(a, torch.Tensor):
        mm.tensors(what, a, b)
        mm.check(a.device == b.device, f"{what}: device {a.device} != {b.device}")
    else:
        mm.check(a == b, f"{what}: {a!r} != {b!r}")


def same_state_dict(mm: pc.Mismatches, what: str, a: dict, b: dict, ignore=()) -> None:
    ka = [k for k in a if k not in ignore]
    kb = [k for k in b if k not in ignore]
    mm.check(ka == kb, f"{what}: keys (in order) differ:\n    cfsdp {ka}\n    torch {kb}")
    for k in ka:
        if k in b:
            same_value(mm, f"{what} '{k}'", a[k], b[k])


def torch_local_extra_keys(sd: dict, uop: bool) -> set:
    """torch 2.13's LOCAL_STATE_DICT with use_orig_params=True also holds a 1-D shard view of
    every parameter next to the flat shard (and cannot load it back); cfsdp does not."""
    if not uop:
        return set()
    return {k for k, v in sd.items() if not isinstance(v, ShardedTensor) and not k.endswith("_flat_param")
            and v.dim() == 1 and "running" not in k and "shift" not in k and "num_batches" not in k}


# --------------------------------------------------------------------------------------------
# subtests
# --------------------------------------------------------------------------------------------


def _mesh(ctx, flavour: str, strategy=None):
    if strategy is ShardingStrategy.HYBRID_SHARD:
        return DeviceMesh("cpu", torch.arange(WORLD).view(2, WORLD // 2), mesh_dim_names=("rep", "shard"))
    if flavour == "dtensor":
        return DeviceMesh.from_group(ctx.pg, "cpu")
    return None


def _types_vs_torch(ctx, kind: str, uop: bool, flavour: str, strategy=None):
    mesh = _mesh(ctx, flavour, strategy)
    tm, cm = build_pair(ctx, kind, uop, mesh=mesh, strategy=strategy)
    topt, copt = sgd(tm), sgd(cm)
    mm = pc.Mismatches(ctx)
    tl, cl = train(tm, topt, kind, ctx.rank, 2), train(cm, copt, kind, ctx.rank, 2)
    for s, (a, b) in enumerate(zip(cl, tl)):
        mm.tensors(f"loss at step {s}", a, b)
    t, cfg = cfg_of(flavour)
    with TorchFSDP.state_dict_type(tm, t, cfg_of(flavour, torch_side=True)[1]):
        tsd = snapshot(tm.state_dict())
    with CFSDP.state_dict_type(cm, t, copy.deepcopy(cfg)):
        csd = snapshot(cm.state_dict())
        mm.check(CFSDP.get_state_dict_type(cm).state_dict_type == t, "get_state_dict_type inside the context")
    mm.check(CFSDP.get_state_dict_type(cm).state_dict_type == SF, "state_dict_type not restored on exit")
    extra = torch_local_extra_keys(tsd, uop) if t == SL else set()
    same_state_dict(mm, f"{flavour} state dict", csd, tsd, ignore=extra)
    if t == SF and cfg.rank0_only and ctx.rank != 0:
        mm.check(csd == {}, f"rank0_only: rank {ctx.rank} got keys {list(csd)}")
    mm.raise_if_any()

    # load: into fresh models built from another seed; then both must train like the source
    if t == SF and cfg.rank0_only:
        return  # a rank0_only state dict is for saving: the other ranks hold nothing to load
    sources = {"cfsdp": csd} if (t == SL and uop) else {"cfsdp": csd, "torch": tsd}
    for src_name, sd in sources.items():
        for dst_name in ("cfsdp", "torch"):
            if t == SL and uop and dst_name == "torch":
                continue  # torch 2.13 cannot load a LOCAL state dict with use_orig_params=True
            tm2, cm2 = build_pair(ctx, kind, uop, seed=99, mesh=mesh, strategy=strategy)
            dst = cm2 if dst_name == "cfsdp" else tm2
            W = CFSDP if dst_name == "cfsdp" else TorchFSDP
            with W.state_dict_type(dst, t, cfg_of(flavour, torch_side=dst_name == "torch")[1]):
                res = dst.load_state_dict(sd)
            mm.check(not res.missing_keys and not res.unexpected_keys, f"{src_name}->{dst_name}: {res}")
            ref = full_sd(cm)
            same_state_dict(mm, f"{flavour} {src_name}->{dst_name} full state dict after load", full_sd(dst), ref)
            # the optimizers start fresh on both sides: the next losses must match the source's
            src_opt = sgd(cm)
            la = train(dst, sgd(dst), kind, ctx.rank, 2, seed=8)
            lb = train(cm, src_opt, kind, ctx.rank, 2, seed=8)
            for s, (a, b) in enumerate(zip(la, lb)):
                mm.tensors(f"{flavour} {src_name}->{dst_name}: loss at step {s} after load", a, b)
            # put cm back where it was for the next destination
            with CFSDP.state_dict_type(cm, SF):
                cm.load_state_dict(ref)
    mm.raise_if_any()


@h.subtest(grid={"kind": ["transformer", "odd"], "uop": [False, True], "flavour": list(FLAVOURS)})
def types_vs_torch(ctx, kind: str, uop: bool, flavour: str):
    _types_vs_torch(ctx, kind, uop, flavour)


@h.subtest(grid={"strategy": [ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD],
                 "flavour": ["full", "sharded", "local"]})
def strategies_vs_torch(ctx, strategy, flavour: str):
    _types_vs_torch(ctx, "transformer", False, flavour, strategy=strategy)


if WORLD == 4:
    @h.subtest(grid={"flavour": ["full", "sharded"], "uop": [False, True]})
    def hybrid_vs_torch(ctx, flavour: str, uop: bool):
        """HSDP on a 2x2 mesh: sharded entries are DTensors (Replicate(), Shard(0))."""
        _types_vs_torch(ctx, "transformer", uop, flavour, strategy=ShardingStrategy.HYBRID_SHARD)


@h.subtest(grid={"uop": [False, True]})
def dtensor_without_mesh(ctx, uop: bool):
    """``ShardedStateDictConfig(_use_dtensor=True)`` on wrappers built without a device_mesh:
    torch 2.13 crashes (no mesh to build DTensors on); cfsdp builds the mesh from the process
    group and gives what torch gives with a mesh over the same ranks. The wrappers' own
    process_group is what torch reports there too."""
    mm = pc.Mismatches(ctx)
    tm, _ = build_pair(ctx, "transformer", uop, mesh=DeviceMesh.from_group(ctx.pg, "cpu"))
    _, cm = build_pair(ctx, "transformer", uop)
    mm.check(cm.process_group is ctx.pg, "process_group property")
    with TorchFSDP.state_dict_type(tm, SD):
        tsd = snapshot(tm.state_dict())
    with CFSDP.state_dict_type(cm, SD, ShardedStateDictConfig(_use_dtensor=True)):
        csd = snapshot(cm.state_dict())
    same_state_dict(mm, "DTensor state dict", csd, tsd)
    _, cm2 = build_pair(ctx, "transformer", uop, seed=5)
    with CFSDP.state_dict_type(cm2, SD, ShardedStateDictConfig(_use_dtensor=True)):
        cm2.load_state_dict(csd)
    same_state_dict(mm, "after loading it", full_sd(cm2), full_sd(cm))
    mm.raise_if_any()


class Tied(nn.Module):
    """Tied embedding/head weights, a persistent and a non-persistent buffer, an ignored module."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(pc.VOCAB, 12)
        self.body = nn.Sequential(nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 12))
        self.head = nn.Linear(12, pc.VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.side = nn.Linear(12, 12)  # ignored
        self.register_buffer("persist", torch.arange(3.0))
        self.register_buffer("scratch", torch.ones(2), persistent=False)

    def forward(self, idx):
        return self.head(self.body(self.emb(idx)) + self.side.bias)


class Outer(nn.Module):
    """A plain root holding wrapped submodules (units around submodules, not the root)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(pc.WIDTH, pc.WIDTH)
        self.net = pc.TinyTransformer(n_blocks=2)

    def forward(self, idx):
        return self.net(idx)


def _wrap_fqn_case(case: str, wrapper, ctx, uop: bool):
    torch.manual_seed(3)
    kw = wrap_kwargs(ctx, uop)
    if case == "tied_ignored":
        m = Tied()
        return m, wrapper(m, ignored_modules=[m.side], **kw) if wrapper else m
    if case == "submodule_units":
        m = Outer()
        if wrapper:
            m.net.blocks[0] = wrapper(m.net.blocks[0], **kw)
            m.net = wrapper(m.net, **kw)
        return m, m
    if case == "checkpointed":
        m = pc.TinyTransformer(n_blocks=2)
        if not wrapper:
            return m, m
        apply_activation_checkpointing(m, check_fn=lambda s: isinstance(s, pc.Block))
        return m, wrapper(m, auto_wrap_policy=ModuleWrapPolicy({pc.Block}), **kw)
    raise AssertionError(case)


@h.subtest(grid={"case": ["tied_ignored", "submodule_units", "checkpointed"], "uop": [False, True]})
def fqn_rules(ctx, case: str, uop: bool):
    """Keys (in order) equal torch's FSDP1 and the unwrapped model's, for FULL and SHARDED;
    each loads back into cfsdp; FULL loads into the unwrapped model and back."""
    mm = pc.Mismatches(ctx)
    _, plain = _wrap_fqn_case(case, None, ctx, uop)
    _, tm = _wrap_fqn_case(case, TorchFSDP, ctx, uop)
    _, cm = _wrap_fqn_case(case, CFSDP, ctx, uop)
    plain_keys = list(plain.state_dict().keys())
    for t in (SF, SD):
        with TorchFSDP.state_dict_type(tm, t):
            tsd = tm.state_dict()
        with CFSDP.state_dict_type(cm, t):
            csd = cm.state_dict()
        same_state_dict(mm, f"{case} {t.name}", csd, tsd)
        mm.check(list(csd) == plain_keys, f"{case} {t.name}: keys {list(csd)} != unwrapped {plain_keys}")
        with CFSDP.state_dict_type(cm, t):
            res = cm.load_state_dict(csd)
        mm.check(not res.missing_keys and not res.unexpected_keys, f"{case} {t.name} reload: {res}")
    # unwrapped -> wrapped -> unwrapped
    torch.manual_seed(11)
    src = copy.deepcopy(plain)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p))
    with CFSDP.state_dict_type(cm, SF):
        cm.load_state_dict(src.state_dict())
        back = cm.state_dict()
    same_state_dict(mm, f"{case} plain->cfsdp->full", back, src.state_dict())
    fresh = copy.deepcopy(plain)
    fresh.load_state_dict(back)
    same_state_dict(mm, f"{case} cfsdp->plain", fresh.state_dict(), src.state_dict())
    mm.raise_if_any()


def _expect_error(mm, what: str, fn, exc, *needles) -> None:
    try:
        fn()
    except exc as e:
        msg = str(e)
        for n in needles:
            mm.check(n in msg, f"{what}: error does not mention {n!r}: {msg}")
    else:
        mm.add(f"{what}: no {exc.__name__} raised")


@h.subtest(grid={"uop": [False, True], "dtype": [torch.float64, torch.bfloat16]})
def load_other_dtype(ctx, uop: bool, dtype):
    """A full state dict of another precision (another model's weights) loads with a cast,
    as torch's FSDP1 (nn.Module.load_state_dict) does: the same values on both."""
    mm = pc.Mismatches(ctx)
    tm, cm = build_pair(ctx, "odd", uop)
    src = {k: (v.to(dtype) if v.is_floating_point() else v)
           for k, v in full_sd(build_pair(ctx, "odd", uop, seed=1)[1]).items()}
    for model in (tm, cm):
        with (CFSDP if model is cm else TorchFSDP).state_dict_type(model, SF):
            model.load_state_dict(dict(src))
    got, want = full_sd(cm), full_sd(tm)
    same_state_dict(mm, f"after loading {dtype} values", got, want)
    mm.check(all(torch.equal(got[k], v.to(got[k].dtype)) for k, v in src.items()),
             "loaded values are not the cast checkpoint")
    mm.raise_if_any()


@h.subtest(grid={"uop": [False, True], "t": [SF, SD, SL]})
def bad_input(ctx, uop: bool, t):
    """A wrong state dict raises naming the first offending FQN and loads nothing."""
    mm = pc.Mismatches(ctx)
    _, cm = build_pair(ctx, "odd", uop)
    before = full_sd(cm)
    with CFSDP.state_dict_type(cm, t):
        good = cm.state_dict()
    keys = list(good)
    first_param = next(k for k in keys if "lin1" in k or "_flat_param" in k)

    def load(sd, strict=True):
        with CFSDP.state_dict_type(cm, t):
            return cm.load_state_dict(sd, strict=strict)

    missing = dict(good)
    del missing[first_param]
    # LOCAL: torch's pre-load hook refuses a missing flat parameter with AssertionError
    _expect_error(mm, "missing key", lambda: load(missing), AssertionError if t == SL else RuntimeError,
                  f"missing key '{first_param}'")
    extra = dict(good)
    extra["lin1.not_a_param"] = torch.zeros(3)
    _expect_error(mm, "unexpected key", lambda: load(extra), RuntimeError, "unexpected key 'lin1.not_a_param'")
    if t == SF:
        wrong_shape = dict(good)
        wrong_shape["lin1.weight"] = torch.zeros(4, 4)
        _expect_error(mm, "wrong shape", lambda: load(wrong_shape), RuntimeError, "'lin1.weight'", "(4, 4)", "(5, 7)")
        # non-strict: the missing key is skipped, the rest loads
        res = load(missing, strict=False)
        mm.check(first_param in res.missing_keys, f"non-strict load: missing keys {res.missing_keys}")
    if t != SF:
        # a state dict sharded another way (as saved at another world size): one shard on rank 0
        from cfsdp._state_dict import _sharded_tensor

        v = good[first_param]
        shape = v.size()
        rg = v.metadata().tensor_properties.requires_grad
        local = torch.zeros(shape, requires_grad=rg) if ctx.rank == 0 else None
        regrouped = dict(good)
        regrouped[first_param] = _sharded_tensor(local, [(0, [0] * len(shape), list(shape))], shape,
                                                 v.dtype, ctx.pg, ctx.rank, CPU, requires_grad=rg)
        _expect_error(mm, "another sharding", lambda: load(regrouped), RuntimeError,
                      f"'{first_param}' is sharded as", "torch.distributed.checkpoint")
    _expect_error(mm, "None", lambda: load(None), TypeError, "Expected state_dict to be dict-like",
                  "NoneType")
    other = build_pair(ctx, "seq", uop)[1]
    with CFSDP.state_dict_type(other, t):
        foreign = other.state_dict()
    _expect_error(mm, "different model", lambda: load(foreign), AssertionError if t == SL else RuntimeError,
                  "Nothing was loaded")
    same_state_dict(mm, "parameters after the rejected loads", full_sd(cm), before)

    # state dicts during forward and inside summon_full_params are rejected, as torch
    # (cfsdp rejects every type there; torch lets LOCAL through, whose flat shard is not what
    # the module holds mid-forward)
    seen = []

    def hook(*_):
        for fn in (cm.state_dict, lambda: cm.load_state_dict(before)):
            try:
                with CFSDP.state_dict_type(cm, t):
                    fn()
            except SummonStateError as e:
                seen.append(str(e))
    handles = [cm.module.lin1.register_forward_pre_hook(hook), cm.module.lin1.register_full_backward_hook(hook)]
    x, y = pc.make_batches("odd", WORLD, 1)[0][ctx.rank]
    cm.eval()  # (a training forward would update BatchNorm's statistics)
    pc.mse_loss(cm(x), y).backward()
    cm.train()
    for hd in handles:
        hd.remove()
    for p in cm.parameters():
        p.grad = None
    mm.check(len(seen) == 4 and all("forward/backward" in s for s in seen), f"during forward and backward: {seen}")
    with CFSDP.summon_full_params(cm):
        _expect_error(mm, "state_dict inside summon", lambda: full_sd(cm), AssertionError, "summon_full_params")
    mm.check(all(w.training_state.name == "IDLE" for w in CFSDP.fsdp_modules(cm)), "a unit left busy")
    same_state_dict(mm, "parameters after the rejected calls", full_sd(cm), before)
    mm.raise_if_any()


@h.subtest
def settings_api(ctx):
    """set/get/state_dict_type: defaults, restore, torch's errors."""
    mm = pc.Mismatches(ctx)
    tm, cm = build_pair(ctx, "transformer", False)
    for W, m in ((TorchFSDP, tm), (CFSDP, cm)):
        s = W.get_state_dict_type(m)
        mm.check(s.state_dict_type == SF and s.state_dict_config == FullStateDictConfig()
                 and s.optim_state_dict_config == FullOptimStateDictConfig(), f"{W.__module__} defaults {s}")
    prev_t = TorchFSDP.set_state_dict_type(tm, SD)
    prev_c = CFSDP.set_state_dict_type(cm, SD)
    mm.check(prev_t == prev_c, f"set_state_dict_type returns {prev_c}, torch {prev_t}")
    mm.check(CFSDP.get_state_dict_type(cm) == TorchFSDP.get_state_dict_type(tm), "settings differ from torch")
    for W, m in ((TorchFSDP, tm), (CFSDP, cm)):
        _expect_error(mm, f"{W.__module__} wrong config class",
                      lambda: W.set_state_dict_type(m, SF, ShardedStateDictConfig()), RuntimeError, "Expected")
    CFSDP.set_state_dict_type(cm, SF)
    inner = CFSDP.fsdp_modules(cm)[1]
    CFSDP.set_state_dict_type(inner, SL)
    _expect_error(mm, "inconsistent settings", lambda: CFSDP.get_state_dict_type(cm), AssertionError, "same state dict")
    _expect_error(mm, "set over inconsistent types", lambda: CFSDP.set_state_dict_type(cm, SF), AssertionError,
                  "same state_dict_type")
    CFSDP.set_state_dict_type(inner, SF)
    mesh_model = CFSDP(pc.build("seq"), device_mesh=DeviceMesh.from_group(ctx.pg, "cpu"))
    with CFSDP.state_dict_type(mesh_model, SL):
        _expect_error(mm, "LOCAL with a device mesh", mesh_model.state_dict, RuntimeError, "DeviceMesh")
    mm.check(CFSDP.get_state_dict_type(nn.Linear(2, 2)) is None, "no wrappers: None")
    mm.raise_if_any()


@h.subtest(grid={"uop": [False, True]})
def full_gather_unit_by_unit(ctx, uop: bool):
    """A FULL state dict costs one copy of the model on rank 0 plus one unit in flight: each
    unit is all-gathered once into a new buffer that the state dict keeps (its entries are
    views of it, not clones of a second buffer), no unit's own unsharded buffer is allocated,
    and on the other ranks (rank0_only) each gathered buffer is dropped at once."""
    import weakref

    mm = pc.Mismatches(ctx)
    m = CFSDP(pc.TinyTransformer(n_blocks=4), auto_wrap_policy=ModuleWrapPolicy({pc.Block}),
              **wrap_kwargs(ctx, uop))
    units = [w._state.unit for w in CFSDP.fsdp_modules(m)]
    copies: list = []  # (weak reference to each gathered buffer, its storage's address)
    orig = Unit.gather_full_copy

    def tracking(self, scratch=None):
        alive = sum(r() is not None for r, _ in copies)
        mm.check(not any(u.is_unsharded for u in units), "a unit's own buffer was unsharded")
        if ctx.rank != 0:
            # dropped at once; gloo's last work object may still hold the previous output
            # until the next collective runs (C++ references, not ours): at most one
            mm.check(alive <= 1, f"rank {ctx.rank}: {alive} gathered copies alive at the next gather")
        mm.check(scratch is None, "a FULL state dict gathered into a shared scratch buffer")
        out = orig(self, scratch)
        copies.append((weakref.ref(out), out.untyped_storage().data_ptr()))
        return out

    Unit.gather_full_copy = tracking
    try:
        with CFSDP.state_dict_type(m, SF, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            sd = m.state_dict()
    finally:
        Unit.gather_full_copy = orig
    mm.check(len(copies) == len(units), f"{len(copies)} gathers for {len(units)} units")
    mm.check(all(not u.is_unsharded for u in units), "a unit stayed unsharded")
    if ctx.rank == 0:
        kept = {ptr for _, ptr in copies}
        ptrs = {v.untyped_storage().data_ptr() for v in sd.values()}  # (the model has no buffers)
        mm.check(len(kept) == len(units), f"rank 0 keeps {len(kept)} of {len(units)} gathered buffers")
        mm.check(ptrs == kept, f"state dict entries live in {len(ptrs)} storages, not the {len(kept)} gathered ones")
    else:
        mm.check(len(sd) == 0, f"rank {ctx.rank}: {len(sd)} keys")
    mm.raise_if_any()


if __name__ == "__main__":
    h.main()
