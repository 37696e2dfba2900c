"""The wrapper (``FullyShardedDataParallel(device_mesh=mesh["dp"])``) on tensor-parallel models:
cfsdp against torch's FSDP1 with its DTensor extension.

Run by test_tp.py (``test_tensor_parallel_wrapper``) under torchrun (gloo, CPU).  The models are
tp_common's: ``TPModel`` (an 11-token vocabulary: uneven TP shards) and ``EvenTPModel`` (12
tokens), tensor-parallel on ``mesh["tp"]`` with every parallel style (sequence parallel on and
off), then wrapped on ``mesh["dp"]`` with an auto-wrap policy (one unit per block, the root's
unit holding the embedding, the final norm and the output projection): every unit mixes TP
parameters with plain ones (the blocks' LayerNorms without sequence parallelism, the final
norm).  Meshes: (1, 2) and (2, 1) at 2 ranks, (2, 2) at 4.

Oracle: torch's FSDP1 on the same model, seed and data; cfsdp is **bitwise** equal (the same
local tensors through the same collectives and DTensor ops).  Compared: losses per step, the
flat (or original) gradients of the last backward, full parameters after training (FULL state
dict: keys, types, placements, local values), SHARDED state dicts (keys, placements, local
values), and optimizer state dicts of both types.  ``muon`` / ``muon_flat``:
cfsdp.optim.Muon on the TP units against the all-gather Muon on the same wrapper
(``muon_oracle.WrapperAllGatherMuon``), bitwise; ``muon_resume``: its state through the
wrapper's optimizer state dicts, resumed bitwise.

Where torch cannot be the oracle (each measured on torch 2.13, each test says which):
* ``use_orig_params=True`` at dp=1: torch fails on the second forward ("Cannot writeback when
  the parameter shape changes") and in summon_full_params;
* ``use_orig_params=True`` with uneven TP shards: torch fails on the first forward ("Cannot
  flatten unevenly sharded tensor"), and its FULL optimizer state dict at (2, 2) too;
* SHARDED state dicts (model, and optimizer even at dp=1) with uneven TP shards: torch aborts
  the process in gloo (a collective mismatch while redistributing);
* ``use_orig_params=True`` and ``no_sync()``: torch fails on the next forward ("Attempted to
  access the data pointer on an invalid python storage");
* ``use_orig_params=True``, FULL optimizer state dict: torch's holds each parameter's
  exp_avg_sq as its exp_avg too (silently);
* loading an optimizer state dict, even torch's own, except at dp > 1 and tp = 1: "Tensor
  optimizer state does not have same shape as its parameter" (the TP-local shape against the
  global one); at dp=1 its FULL dicts also hold the optimizer's live states;
* torch's checkpoint helpers (get_state_dict) at (2, 2): "Global rank 0 is not part of group"
  (a broadcast from global rank 0 over a dp group without it);
* sharded_optim_state_dict at dp > 1: "Global rank 0 does not exist in input process group";
  rank0_only full optimizer state dicts keep global rank 0's TP shard alone.
There the oracle is cfsdp's ``use_orig_params=False`` run, itself checked against torch
(bitwise: the same math on the same local tensors), and sharded values are checked against
the torch-checked FULL ones.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

import _harness as h
import ckpt_common as cc
import tp_common as tc
import parity_common as pc
from parity_common import expect_same_error

import cfsdp

WORLD = int(os.environ.get("WORLD_SIZE", "2"))
WRAPPERS = {"torch": TorchFSDP, "cfsdp": cfsdp.FullyShardedDataParallel}
STEPS = 3
VE = 12  # EvenTPModel's vocabulary (divides by 2)

warnings.filterwarnings("ignore", message=".*NO_SHARD.*")
warnings.filterwarnings("ignore", message=".*FSDP.state_dict_type.*")
warnings.filterwarnings("ignore", message=".*optim_input.*")


class EvenTPModel(tc.TPModel):
    """TPModel with a 12-token vocabulary: every TP shard even, so torch runs every path."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VE, tc.D)
        self.out = nn.Linear(tc.D, VE)


def vocab(kind: str) -> int:
    return VE if kind == "even" else tc.V


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return EvenTPModel() if kind == "even" else tc.TPModel()


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def wrap(impl: str, kind: str, mesh, sp: bool, uop: bool, seed: int = 0, **kw) -> nn.Module:
    """The TP model on mesh["tp"], wrapped on mesh["dp"] with one unit per block."""
    model = tc.parallelize(build(kind, seed), mesh["tp"], sp)
    return WRAPPERS[impl](model, device_mesh=mesh["dp"], use_orig_params=uop,
                          auto_wrap_policy=ModuleWrapPolicy({tc.TPBlock}),
                          device_id=torch.device("cpu"), **kw)


def dp_rank(mesh) -> int:
    return mesh["dp"].get_local_rank()


def dp_size(mesh) -> int:
    return mesh["dp"].size()


# ------------------------------------------------------------------------------ descriptions


def describe(v: Any) -> Any:
    """A state-dict value as compared: (type, placements, mesh shape, local value)."""
    if isinstance(v, DTensor):
        return ("DTensor", tuple(v.placements), tuple(v.device_mesh.shape), tuple(v.shape),
                v.to_local().detach().clone())
    if isinstance(v, ShardedTensor):
        return ("ShardedTensor", tuple(v.size()), [s.tensor.detach().clone() for s in v.local_shards()])
    if isinstance(v, torch.Tensor):
        return ("Tensor", v.detach().clone())
    if isinstance(v, dict):
        return {k: describe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(describe(x) for x in v)
    return v


def compare(mm: pc.Mismatches, what: str, c: Any, t: Any, ordered: bool = True) -> None:
    """``c`` (cfsdp's) against ``t`` (the oracle's), recursively; tensors bitwise.  Unordered:
    dict keys and the ``params`` lists of param groups as sets (use_orig_params=True orders an
    optimizer state dict's entries otherwise, as torch does)."""
    if c is None or t is None:
        mm.check(c is None and t is None, f"{what}: cfsdp {c!r}, torch {t!r}")
    elif isinstance(t, dict):
        same = isinstance(c, dict) and (list(c) == list(t) if ordered else set(c) == set(t))
        mm.check(same, f"{what}: keys {list(c)[:6]}... != the oracle's {list(t)[:6]}...")
        if isinstance(c, dict):
            for k in t:
                if k in c:
                    a, b = c[k], t[k]
                    if not ordered and k == "params":
                        a, b = sorted(a), sorted(b)
                    compare(mm, f"{what}[{k}]", a, b, ordered)
    elif isinstance(t, (list, tuple)):
        if type(c) is not type(t) or len(c) != len(t) or (len(t) and type(c[0]) is not type(t[0])):
            mm.add(f"{what}: {str(c)[:200]} != the oracle's {str(t)[:200]}")
            return
        for i, (a, b) in enumerate(zip(c, t)):
            compare(mm, f"{what}[{i}]", a, b, ordered)
    elif isinstance(t, torch.Tensor) or isinstance(c, torch.Tensor):
        mm.tensors(what, c, t)
    else:
        mm.check(c == t, f"{what}: {c!r} != torch's {t!r}")


def grads(model) -> dict:
    return {pc.clean(n): None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def model_sd(model, sd_type: StateDictType) -> dict:
    with WRAPPERS["torch"].state_dict_type(model, sd_type) if isinstance(model, TorchFSDP) else \
            cfsdp.FullyShardedDataParallel.state_dict_type(model, sd_type):
        return describe(model.state_dict())


def optim_sd(model, opt, sd_type: StateDictType) -> dict:
    cls = TorchFSDP if isinstance(model, TorchFSDP) else cfsdp.FullyShardedDataParallel
    with cls.state_dict_type(model, sd_type):
        return describe(cls.optim_state_dict(model, opt))


def train(model, opt, data, rank: int) -> list[torch.Tensor]:
    losses = []
    for step in data:
        x, y = step[rank]
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def run(impl: str, kind: str, mesh, sp: bool, uop: bool, sharded_sd: bool, optim: str = "adamw",
        steps: int = STEPS, **kw) -> dict:
    """Train ``impl``; its losses, last gradients and state dicts (SHARDED ones if asked)."""
    model = wrap(impl, kind, mesh, sp, uop, **kw)
    opt = pc.make_optim(optim, model.parameters())
    data = tc.batches(steps, dp_size(mesh))
    out: dict = {"losses": []}
    for i, step in enumerate(data):
        x, y = step[dp_rank(mesh)]
        loss = loss_fn(model(x), y)
        loss.backward()
        if i == len(data) - 1:
            out["grads"] = grads(model)
        opt.step()
        if i < len(data) - 1:
            opt.zero_grad()
        out["losses"].append(loss.detach().clone())
    out["full"] = model_sd(model, StateDictType.FULL_STATE_DICT)
    out["optim_full"] = optim_sd(model, opt, StateDictType.FULL_STATE_DICT)
    if sharded_sd:
        out["sharded"] = model_sd(model, StateDictType.SHARDED_STATE_DICT)
        out["optim_sharded"] = optim_sd(model, opt, StateDictType.SHARDED_STATE_DICT)
    out["model"], out["opt"] = model, opt
    return out


ALL = ("losses", "grads", "full", "optim_full", "sharded", "optim_sharded")


def check(ctx, got: dict, want: dict, keys=ALL, ordered: bool = True) -> None:
    mm = pc.Mismatches(ctx)
    for k in keys:
        if k in want:
            compare(mm, k, got[k], want[k], ordered)
    mm.raise_if_any()


def torch_runs(kind: str, layout: tuple, uop: bool) -> bool:
    """Whether torch's FSDP1 can train this case (see the module docstring)."""
    dp, tp = layout
    if uop and dp == 1:
        return False  # "Cannot writeback when the parameter shape changes"
    if uop and kind == "odd" and tp > 1:
        return False  # "Cannot flatten unevenly sharded tensor"
    return True


# ------------------------------------------------------------------------------ parity


@h.subtest(grid={"layout": tc.meshes(WORLD), "kind": ["even", "odd"], "uop": [False, True],
                 "sp": [False, True]})
def parity(ctx, layout, kind: str, uop: bool, sp: bool):
    """Training and every state-dict type against torch's FSDP1 (or, where torch cannot run,
    against cfsdp's use_orig_params=False run, which the uop=False subtest checks against
    torch: the same math on the same local tensors, so bitwise too)."""
    mesh = tc.mesh_2d(*layout)
    # torch's sharded dicts abort gloo on uneven TP shards at tp > 1
    sharded_ok = kind == "even" or layout[1] == 1
    got = run("cfsdp", kind, mesh, sp, uop, sharded_sd=True)
    if torch_runs(kind, tuple(layout), uop):
        want = run("torch", kind, mesh, sp, uop, sharded_sd=sharded_ok)
        if uop:
            # torch's FULL optimizer state dict with use_orig_params=True on a (dp, tp) mesh
            # gives each parameter's exp_avg_sq as its exp_avg too (measured: its exp_avg
            # entries equal its exp_avg_sq ones, the optimizer's own differ): not an oracle
            want.pop("optim_full")
        check(ctx, got, want)
    if uop:
        # the same training with use_orig_params=False (checked against torch by its own
        # subtest): the same values, in use_orig_params=True's entry order
        ref = run("cfsdp", kind, mesh, sp, False, sharded_sd=True)
        check(ctx, got, ref, keys=("losses", "full", "optim_full", "sharded", "optim_sharded"),
              ordered=False)
    if not sharded_ok:
        check_sharded_against_full(ctx, got)


def check_sharded_against_full(ctx, got: dict) -> None:
    """Where torch's sharded dicts cannot run: each sharded DTensor's whole value is the FULL
    state dict's (which torch checked)."""
    mm = pc.Mismatches(ctx)
    model, opt = got["model"], got["opt"]
    F_ = cfsdp.FullyShardedDataParallel
    with F_.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
        osd_sharded = F_.optim_state_dict(model, opt)
    with F_.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = model.state_dict()
        osd_full = F_.optim_state_dict(model, opt)

    def whole(v):
        return v.full_tensor() if isinstance(v, DTensor) else v

    for k, v in full.items():
        mm.tensors(f"sharded {k} (whole)", whole(sharded[k]), whole(v), b_name="FULL")
    for k, st in osd_full["state"].items():
        for n, v in st.items():
            mm.tensors(f"sharded optim {k}.{n} (whole)", whole(osd_sharded["state"][k][n]), whole(v),
                       b_name="FULL")
    mm.raise_if_any()


# ------------------------------------------------------------------------------ resuming


def sd_class(model) -> type:
    return TorchFSDP if isinstance(model, TorchFSDP) else cfsdp.FullyShardedDataParallel


def save(model, opt, sd_type: StateDictType) -> tuple[dict, dict]:
    cls = sd_class(model)
    with cls.state_dict_type(model, sd_type):
        return model.state_dict(), cls.optim_state_dict(model, opt)


def torch_loads_optim(layout) -> bool:
    """torch's FSDP1 loads an optimizer state dict (its own too) only at dp > 1 and tp = 1:
    elsewhere "Tensor optimizer state does not have same shape as its parameter" (the TP-local
    shape against the global one)."""
    return layout[0] > 1 and layout[1] == 1


def load(model, opt, sd_type: StateDictType, msd: dict, osd: Optional[dict]) -> None:
    cls = sd_class(model)
    with cls.state_dict_type(model, sd_type):
        model.load_state_dict(msd)
        if osd is not None:
            opt.load_state_dict(cls.optim_state_dict_to_load(model, opt, osd))


def check_resumed(mm: pc.Mismatches, what: str, model, opt, fresh, fresh_opt, data, r: int) -> None:
    """The writer and the model that loaded its state train on: bitwise the same losses."""
    want = train(model, opt, data, r)
    got = train(fresh, fresh_opt, data, r)
    for i, (a, b) in enumerate(zip(got, want)):
        mm.tensors(f"{what}: resumed loss #{i}", a, b)


@torch.no_grad()
def eval_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return loss_fn(model(x), y)


def resume_cases(layout) -> list:
    """(kind, uop, state-dict type, writer, reader) where the writer and the reader run: torch
    never at dp=1 with use_orig_params=True, never with uneven TP shards in sharded dicts or
    with use_orig_params=True, and never writes a FULL optimizer state dict with
    use_orig_params=True (its exp_avg entries hold exp_avg_sq); see the module docstring."""
    out = []
    for kind in ("even", "odd"):
        for uop in (False, True):
            for t in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
                for writer, reader in (("cfsdp", "cfsdp"), ("torch", "cfsdp"), ("cfsdp", "torch")):
                    if "torch" in (writer, reader):
                        if not torch_runs(kind, layout, uop) or (uop and writer == "torch" and
                                                                  t == StateDictType.FULL_STATE_DICT):
                            continue
                        uneven = kind == "odd" and layout[1] > 1
                        if uneven and (uop or t == StateDictType.SHARDED_STATE_DICT):
                            continue

                    out.append((kind, uop, t, writer, reader))
    return out


@h.subtest(grid={"layout": tc.meshes(WORLD)})
def resume(ctx, layout):
    """Model and optimizer state dicts of both types (sequence parallel on): a fresh model with
    other weights loads what another model saved after two steps and trains on with bitwise
    the losses of the uninterrupted run; torch's FSDP1 and cfsdp load each other's dicts."""
    layout = tuple(layout)
    mesh = tc.mesh_2d(*layout)
    data = tc.batches(4, dp_size(mesh))
    r = dp_rank(mesh)
    mm = pc.Mismatches(ctx)
    for kind, uop, t, writer, reader in resume_cases(layout):
        what = f"{kind} uop={uop} {t.name} {writer}->{reader}"
        model = wrap(writer, kind, mesh, True, uop)
        opt = pc.make_optim("adamw", model.parameters())
        train(model, opt, data[:2], r)
        msd, osd = save(model, opt, t)
        fresh = wrap(reader, kind, mesh, True, uop, seed=1)
        fresh_opt = pc.make_optim("adamw", fresh.parameters())
        with_optim = reader == "cfsdp" or torch_loads_optim(layout)
        # loaded before the writer trains on: torch's dicts at dp=1 hold the live states
        load(fresh, fresh_opt, t, msd, osd if with_optim else None)
        mm.tensors(f"{what}: loss of the loaded model", eval_loss(fresh, data[2][r]),
                   eval_loss(model, data[2][r]))
        if with_optim:  # else torch loads the model only (see torch_loads_optim)
            check_resumed(mm, what, model, opt, fresh, fresh_opt, data[2:], r)
    mm.raise_if_any()


# ------------------------------------------------------------------------------ accumulation


@h.subtest(grid={"layout": tc.meshes(WORLD), "kind": ["even", "odd"], "sp": [False, True]})
def muon(ctx, layout, kind: str, sp: bool):
    """cfsdp.optim.Muon on the TP wrapper's original matrices (use_orig_params=True; the units
    mix them with LayerNorms, which go to AdamW) against the all-gather Muon on the same
    wrapper (``WrapperAllGatherMuon``: each matrix gathered over dp, then over tp): losses and
    every parameter bitwise after 3 steps.  A TP ``Shard(d)`` matrix is cut over the (dp, tp)
    ranks (a TP chunk, dp-sharded by element ranges; uneven TP chunks at ``odd``), its pieces
    exchanged with its owner among them; at dp = 1 the units are NO_SHARD and the TP chunks
    whole."""
    from cfsdp.optim import _muon
    from muon_oracle import WrapperAllGatherMuon, Pair

    mesh = tc.mesh_2d(*layout)
    data = tc.batches(STEPS, dp_size(mesh))
    runs = {}
    for impl in ("cfsdp", "oracle"):
        model = wrap("cfsdp", kind, mesh, sp, True)
        mats = [(n, p) for n, p in model.named_parameters()
                if len(_muon._wrapped(p)[0].infos[_muon._wrapped(p)[1]].global_shape) >= 2]
        rest = [p for n, p in model.named_parameters() if all(p is not q for _, q in mats)]
        adamw = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01)
        if impl == "cfsdp":
            muon_opt = cfsdp.optim.Muon(mats, lr=0.02)
        else:
            muon_opt = WrapperAllGatherMuon([_muon._wrapped(p) for _, p in mats], lr=0.02)
        batches = [step[dp_rank(mesh)] for step in data]
        runs[impl] = _muon_steps(model, Pair(muon_opt, adamw), batches,
                                 lambda out, y: loss_fn(out, y))
    _muon_check(ctx, runs)


def _muon_steps(model, opt, batches, loss_of) -> tuple:
    """Train on ``batches`` of ``(x, y)``; (losses, parameters after the last step)."""
    losses = []
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        loss = loss_of(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _muon_check(ctx, runs: dict) -> None:
    mm = pc.Mismatches(ctx)
    compare(mm, "losses", runs["cfsdp"][0], runs["oracle"][0])
    compare(mm, "parameters after 3 steps", runs["cfsdp"][1], runs["oracle"][1])
    mm.raise_if_any()


class _MatBlock(nn.Module):
    """A unit of TP matrices only (colwise ``w1``, rowwise ``w2``): the flat parameter Muon
    takes with use_orig_params=False."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(tc.D, 2 * tc.D, bias=False)
        self.w2 = nn.Linear(2 * tc.D, tc.D, bias=False)

    def forward(self, x):
        return x + self.w2(torch.tanh(self.w1(x)))


class _MatNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_MatBlock() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _mat_model(mesh, uop: bool, seed: int = 0) -> nn.Module:
    """_MatNet, tensor-parallel on ``mesh["tp"]``, a wrapper unit per block on ``mesh["dp"]``."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.manual_seed(seed)
    model = _MatNet()
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    return cfsdp.FullyShardedDataParallel(
        model, device_mesh=mesh["dp"], use_orig_params=uop, device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({_MatBlock}))


def _mat_inputs(mesh, steps: int) -> list:
    g = torch.Generator().manual_seed(dp_rank(mesh))
    return [torch.randn(4, tc.D, generator=g) for _ in range(steps)]


@h.subtest(grid={"layout": tc.meshes(WORLD)})
def muon_flat(ctx, layout):
    """cfsdp.optim.Muon on the flat parameters of TP units of matrices only
    (use_orig_params=False: each original's pieces cut from the flat shard) against the
    all-gather Muon on the same wrapper: losses and parameters bitwise after 3 steps."""
    from cfsdp.optim import _muon
    from muon_oracle import WrapperAllGatherMuon

    mesh = tc.mesh_2d(*layout)
    xs = _mat_inputs(mesh, STEPS)
    runs = {}
    for impl in ("cfsdp", "oracle"):
        model = _mat_model(mesh, uop=False)
        flats = [m._handle.flat_param for m in model.modules()
                 if isinstance(m, cfsdp.FullyShardedDataParallel) and m._handle is not None]
        if impl == "cfsdp":
            opt = cfsdp.optim.Muon(flats, lr=0.02)
        else:
            units = [_muon._wrapped(f)[0] for f in flats]
            opt = WrapperAllGatherMuon([(u, k) for u in units for k in range(len(u.infos))],
                                       lr=0.02)
        runs[impl] = _muon_steps(model, opt, [(x, None) for x in xs],
                                 lambda out, _: out.square().mean())
    _muon_check(ctx, runs)


@h.subtest(grid={"layout": tc.meshes(WORLD), "uop": [False, True]})
def muon_resume(ctx, layout, uop: bool):
    """cfsdp.optim.Muon's state through the wrapper's optimizer state dicts on TP units of
    matrices (``FSDP.optim_state_dict`` / ``optim_state_dict_to_load``, FULL and SHARDED): the
    momentum buffers come out under the original FQNs with the parameters' shapes, and a fresh
    model with other weights that loads model and optimizer after two steps trains on with
    bitwise the losses and parameters of torch's Muon run uninterrupted on the same wrapper
    (``WrapperAllGatherMuon``: ``torch.optim.Muon`` on the gathered matrices; torch's Muon
    refuses the flat parameters itself, and torch's FSDP1 loads no optimizer state dict with
    tp > 1, see the module docstring)."""
    from cfsdp.optim import _muon
    from muon_oracle import WrapperAllGatherMuon

    mesh = tc.mesh_2d(*layout)
    xs = _mat_inputs(mesh, 4)
    loss_of = lambda out, _: out.square().mean()  # noqa: E731
    mm = pc.Mismatches(ctx)
    for t in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
        model = _mat_model(mesh, uop)
        opt = cfsdp.optim.Muon(model.parameters(), lr=0.02)
        _muon_steps(model, opt, [(x, None) for x in xs[:2]], loss_of)
        msd, osd = save(model, opt, t)
        full = dict(msd)  # the original FQNs (the model has only matrices, no buffers)
        for fqn, st in osd["state"].items():
            buf = st["momentum_buffer"]
            if fqn not in full or tuple(buf.shape) != tuple(full[fqn].shape):
                mm.add(f"{t.name}: momentum_buffer of {fqn}: shape {tuple(buf.shape)}, the "
                       f"parameter's {tuple(full[fqn].shape) if fqn in full else 'absent'}")
        if set(osd["state"]) != set(full):
            mm.add(f"{t.name}: optimizer states for {sorted(osd['state'])}, parameters "
                   f"{sorted(full)}")
        fresh = _mat_model(mesh, uop, seed=1)
        fresh_opt = cfsdp.optim.Muon(fresh.parameters(), lr=0.02)
        load(fresh, fresh_opt, t, msd, osd)
        got = _muon_steps(fresh, fresh_opt, [(x, None) for x in xs[2:]], loss_of)
        oracle = _mat_model(mesh, uop)
        oracle_opt = WrapperAllGatherMuon(
            [(u, k) for u in (_muon._wrapped(m._handle.flat_param)[0] for m in oracle.modules()
                              if isinstance(m, cfsdp.FullyShardedDataParallel)
                              and m._handle is not None)
             for k in range(len(u.infos))], lr=0.02)
        want = _muon_steps(oracle, oracle_opt, [(x, None) for x in xs], loss_of)
        want = (want[0][2:], want[1])
        compare(mm, f"{t.name} resumed losses", got[0], want[0])
        compare(mm, f"{t.name} resumed parameters", got[1], want[1])
    mm.raise_if_any()


@h.subtest(grid={"layout": tc.meshes(WORLD), "uop": [False, True]})
def no_sync(ctx, layout, uop: bool):
    """Gradient accumulation: no_sync() for the first micro-batch of each step, with sequence
    parallelism (the norms' gradients arrive as partial sums over TP).  Oracle: torch, or with
    use_orig_params=True (torch fails on the forward after a no_sync backward) cfsdp's
    use_orig_params=False run."""
    layout = tuple(layout)
    mesh = tc.mesh_2d(*layout)
    data = tc.batches(3, dp_size(mesh) * 2)
    res = {}
    runs = [("torch", uop)] if (not uop and torch_runs("even", layout, uop)) else [("cfsdp", False)]
    for impl, u in [("cfsdp", uop), *runs]:
        model = wrap(impl, "even", mesh, True, u)
        opt = pc.make_optim("sgd", model.parameters())
        seen = []
        for step in data:
            for m in range(2):
                x, y = step[2 * dp_rank(mesh) + m]
                ctx_m = model.no_sync() if m == 0 else contextlib.nullcontext()
                with ctx_m:
                    loss = loss_fn(model(x), y)
                    loss.backward()
                seen.append(loss.detach().clone())
            opt.step()
            opt.zero_grad()
        res[impl if impl == "torch" or u == uop else "ref"] = (
            seen, model_sd(model, StateDictType.FULL_STATE_DICT))
    oracle = res.get("torch") or res["ref"]
    mm = pc.Mismatches(ctx)
    compare(mm, "losses", res["cfsdp"][0], oracle[0])
    compare(mm, "FULL state dict after training", res["cfsdp"][1], oracle[1])
    mm.raise_if_any()


@h.subtest(grid={"layout": tc.meshes(WORLD), "uop": [False, True]})
def mixed_precision(ctx, layout, uop: bool):
    """bf16 parameters, fp32 reduction (sequence parallel on): bitwise torch's (or, with
    use_orig_params=True at dp=1, cfsdp's use_orig_params=False run)."""
    layout = tuple(layout)
    mesh = tc.mesh_2d(*layout)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    got = run("cfsdp", "even", mesh, True, uop, sharded_sd=False, mixed_precision=mp)
    if torch_runs("even", layout, uop):
        want = run("torch", "even", mesh, True, uop, sharded_sd=False, mixed_precision=mp)
        check(ctx, got, want, keys=("losses", "grads", "full"))
    else:
        ref = run("cfsdp", "even", mesh, True, False, sharded_sd=False, mixed_precision=mp)
        check(ctx, got, ref, keys=("losses", "full"))


# ------------------------------------------------------------------------------ summon


@h.subtest(grid={"layout": tc.meshes(WORLD), "uop": [False, True]})
def summon(ctx, layout, uop: bool):
    """summon_full_params shows each TP parameter as a DTensor on the TP mesh over its full
    local value (plain parameters as tensors), as torch; a change made inside is written
    back: the next FULL state dict and the next losses are torch's after the same change."""
    layout = tuple(layout)
    mesh = tc.mesh_2d(*layout)
    data = tc.batches(2, dp_size(mesh))
    res = {}
    impls = ["cfsdp", "torch" if torch_runs("even", layout, uop) else "ref"]
    for impl in impls:
        model = wrap("cfsdp" if impl == "ref" else impl, "even", mesh, True, uop and impl != "ref")
        opt = pc.make_optim("sgd", model.parameters())
        train(model, opt, data[:1], dp_rank(mesh))
        cls = sd_class(model)
        with cls.summon_full_params(model):
            shown = {pc.clean(n): describe(p) for n, p in model.named_parameters()}
            with torch.no_grad():
                model.module.blocks[0].w1.weight.add_(1.0)
                model.module.norm.weight.mul_(2.0)
        grads_shown = None
        if uop and impls[1] == "torch":  # with_grads: full gradients, DTensors for TP parameters
            loss_fn(model(data[1][dp_rank(mesh)][0]), data[1][dp_rank(mesh)][1]).backward()
            with cls.summon_full_params(model, with_grads=True):
                grads_shown = {pc.clean(n): describe(p.grad) for n, p in model.named_parameters()}
            opt.zero_grad()
        losses = train(model, opt, data[1:], dp_rank(mesh))
        res[impl] = (shown, model_sd(model, StateDictType.FULL_STATE_DICT), losses, grads_shown)
    mm = pc.Mismatches(ctx)
    compare(mm, "summoned parameters", res["cfsdp"][0], res[impls[1]][0])
    compare(mm, "FULL state dict after the change", res["cfsdp"][1], res[impls[1]][1])
    compare(mm, "losses after the change", res["cfsdp"][2], res[impls[1]][2])
    compare(mm, "summoned gradients", res["cfsdp"][3], res[impls[1]][3])
    mm.raise_if_any()


SINGLE_CASES = [(kind, sp) for kind in ("even", "odd") for sp in (False, True)]


@h.subtest(grid={"layout": [lay for lay in tc.meshes(WORLD)
                            if any(not torch_runs(k, lay, True) for k, _ in SINGLE_CASES)]})
def single_process(ctx, layout):
    """Where torch cannot run (use_orig_params=True at dp=1, or on uneven TP shards): cfsdp's
    training against the model without TP or FSDP in one process on the global batch (each dp
    rank's loss is that process's loss on the rank's rows; the gradient is their mean).  TP and
    dp sum in another order than one process, so within REF_RTOL / REF_ATOL (losses per step,
    whole parameters after training)."""
    layout = tuple(layout)
    mesh = tc.mesh_2d(*layout)
    mm = pc.Mismatches(ctx)
    for kind, sp in SINGLE_CASES:
        if torch_runs(kind, layout, True):
            continue
        got = run("cfsdp", kind, mesh, sp, True, sharded_sd=False)
        ref = build(kind)
        ref_losses, _ = pc.train_ref(ref, pc.make_optim("adamw", ref.parameters()),
                                     tc.batches(STEPS, dp_size(mesh)), loss_fn)
        what = f"{kind} sp={sp}"
        for i, (a, b) in enumerate(zip(got["losses"], ref_losses)):
            mm.tensors(f"{what}: loss #{i}", a, b[dp_rank(mesh)], exact=False, b_name="single process")
        with cfsdp.FullyShardedDataParallel.state_dict_type(got["model"], StateDictType.FULL_STATE_DICT):
            full = got["model"].state_dict()
        for k, v in ref.state_dict().items():
            g = full[k]
            mm.tensors(f"{what}: {k} after training", g.full_tensor() if isinstance(g, DTensor) else g, v,
                       exact=False, b_name="single process")
    ctx.log(f"worst |diff| / tolerance against the single process: {mm.worst_ref:.3f}")
    mm.raise_if_any()


@h.subtest(grid={"layout": tc.meshes(WORLD), "uop": [False, True]})
def load_plain_full_state_dict(ctx, layout, uop: bool):
    """A FULL state dict of the model before tensor parallelism (plain whole tensors) loads into
    the wrapped TP model: each rank keeps its TP part (torch's FSDP1 cannot copy a plain tensor
    into a DTensor parameter; cfsdp does, so a single-process checkpoint starts a TP run)."""
    layout = tuple(layout)
    mesh = tc.mesh_2d(*layout)
    plain = build("odd", seed=1).state_dict()
    model = wrap("cfsdp", "odd", mesh, True, uop)
    F_ = cfsdp.FullyShardedDataParallel
    with F_.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model.load_state_dict(plain)
        got = model.state_dict()
    mm = pc.Mismatches(ctx)
    mm.check(list(got) == list(plain), f"keys {list(got)} != {list(plain)}")
    for k, v in plain.items():
        g = got[k]
        mm.tensors(k, g.full_tensor() if isinstance(g, DTensor) else g, v, b_name="loaded")
    mm.raise_if_any()


@h.subtest(grid={"layout": tc.meshes(WORLD)})
def sync_module_states(ctx, layout):
    """sync_module_states=True broadcasts rank 0's TP-local values over each dp group (ranks of
    one dp group hold the same TP shard): models built with another seed on each dp rank end
    up with dp rank 0's weights.  torch's FSDP1 refuses sync_module_states on CPU ranks; the
    oracle is the wrapper of dp rank 0's model."""
    layout = tuple(layout)
    mesh = tc.mesh_2d(*layout)
    synced = wrap("cfsdp", "odd", mesh, True, False, seed=dp_rank(mesh), sync_module_states=True)
    ref = wrap("cfsdp", "odd", mesh, True, False, seed=0)
    mm = pc.Mismatches(ctx)
    compare(mm, "FULL state dict", model_sd(synced, StateDictType.FULL_STATE_DICT),
            model_sd(ref, StateDictType.FULL_STATE_DICT))
    mm.raise_if_any()


# ------------------------------------------------------------------------------ DCP


def dcp_cases(layout) -> list:
    out = [(kind, uop, "cfsdp", "cfsdp") for kind in ("even", "odd") for uop in (False, True)]
    out.append(("even", False, "torch", "cfsdp"))
    if torch_loads_optim(layout):
        out.append(("even", False, "cfsdp", "torch"))
    return out


def dcp_state(model, opt) -> dict:
    """What a checkpoint holds: torch's helpers' dicts for cfsdp; for torch's FSDP1 its own
    SHARDED dicts (the same FQN-keyed format): torch's helpers fail on its dp groups that do
    not hold global rank 0 ("Global rank 0 is not part of group", a broadcast_object_list from
    global rank 0 in _map_param_key_to_optim_keys)."""
    if isinstance(model, TorchFSDP):
        _init_optim_state(opt)  # as torch's helpers do: a fresh optimizer has states to load into
        msd, osd = save(model, opt, StateDictType.SHARDED_STATE_DICT)
    else:
        msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def dcp_restore(model, opt, sd: dict) -> None:
    if isinstance(model, TorchFSDP):
        load(model, opt, StateDictType.SHARDED_STATE_DICT, sd["model"], sd["optim"])
    else:
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


@h.subtest(grid={"layout": tc.meshes(WORLD)})
def dcp_roundtrip(ctx, layout):
    """torch's helpers (get_state_dict / set_state_dict) and torch.distributed.checkpoint on the
    wrapper: a fresh model with other weights loads the checkpoint and resumes with bitwise the
    uninterrupted losses (uneven TP shards too, where torch's own sharded dicts abort); cfsdp
    loads torch FSDP1's checkpoints, and torch cfsdp's where it loads optimizer state at all
    (torch_loads_optim); even shards, use_orig_params=False."""
    layout = tuple(layout)
    mesh = tc.mesh_2d(*layout)
    data = tc.batches(4, dp_size(mesh))
    r = dp_rank(mesh)
    mm = pc.Mismatches(ctx)
    for kind, uop, writer, reader in dcp_cases(layout):
        path = cc.ckpt_dir(ctx, f"dcp_{layout[0]}x{layout[1]}_{kind}_{uop}_{writer}_{reader}")
        model = wrap(writer, kind, mesh, True, uop)
        opt = pc.make_optim("adamw", model.parameters())
        train(model, opt, data[:2], r)
        dcp.save(dcp_state(model, opt), checkpoint_id=str(path))
        fresh = wrap(reader, kind, mesh, True, uop, seed=1)
        fresh_opt = pc.make_optim("adamw", fresh.parameters())
        sd = dcp_state(fresh, fresh_opt)
        dcp.load(sd, checkpoint_id=str(path))
        dcp_restore(fresh, fresh_opt, sd)
        check_resumed(mm, f"{kind} uop={uop} {writer}->{reader}", model, opt, fresh, fresh_opt,
                      data[2:], r)
    mm.raise_if_any()


@h.subtest(grid={"layout": tc.meshes(WORLD), "uop": [False, True]})
def broadcast_from_rank0(ctx, layout, uop: bool):
    """torch's helpers with full_state_dict + cpu_offload (rank 0 of each dp group holds the
    dicts, TP states as DTensors) then broadcast_from_rank0 into a fresh model: it resumes with
    bitwise the uninterrupted losses (uneven TP shards)."""
    layout = tuple(layout)
    mesh = tc.mesh_2d(*layout)
    data = tc.batches(4, dp_size(mesh))
    r = dp_rank(mesh)
    model = wrap("cfsdp", "odd", mesh, True, uop)
    opt = pc.make_optim("adamw", model.parameters())
    train(model, opt, data[:2], r)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    fresh = wrap("cfsdp", "odd", mesh, True, uop, seed=1)
    fresh_opt = pc.make_optim("adamw", fresh.parameters())
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    mm = pc.Mismatches(ctx)
    check_resumed(mm, "broadcast_from_rank0", model, opt, fresh, fresh_opt, data[2:], r)
    mm.raise_if_any()


# ------------------------------------------------------------------------------ torch's older API


@h.subtest(grid={"layout": tc.meshes(WORLD), "uop": [False, True]})
def deprecated_optim_apis(ctx, layout, uop: bool):
    """torch's older optimizer state-dict API.  full_optim_state_dict: torch's dict
    (use_orig_params=False; with True torch's is wrong, see the module docstring, and the
    oracle is cfsdp's use_orig_params=False dict); with rank0_only on rank 0 of each dp group
    (torch keeps global rank 0's alone: the other TP ranks' shards are lost).
    sharded_optim_state_dict: torch's fails at
    dp > 1 ("Global rank 0 does not exist in input process group", building ShardedTensors of
    ShardedTensors over the TP group) and nests ShardedTensors at dp=1; cfsdp's holds what
    optim_state_dict gives with SHARDED_STATE_DICT (DTensors on the (dp, tp) mesh), whose whole
    values are the full dict's.  The loading counterparts (scatter_full_optim_state_dict,
    shard_full_optim_state_dict, flatten_sharded_optim_state_dict) give back each rank's own
    optimizer state."""
    layout = tuple(layout)
    mesh = tc.mesh_2d(*layout)
    data = tc.batches(2, dp_size(mesh))
    oracle = "torch" if (not uop and torch_runs("even", layout, uop)) else "ref"
    fulls = {}
    mm = pc.Mismatches(ctx)
    for impl, u in (("cfsdp", uop), (oracle, False)):
        model = wrap("cfsdp" if impl == "ref" else impl, "even", mesh, True, u)
        opt = pc.make_optim("adamw", model.parameters())
        train(model, opt, data, dp_rank(mesh))
        cls = sd_class(model)
        # rank0_only=False: torch's rank0_only dict lives on global rank 0 alone, which drops the
        # other TP ranks' shards (cfsdp's lives on rank 0 of each dp group: checked below)
        fulls[impl] = describe(cls.full_optim_state_dict(model, opt, rank0_only=False))
        if impl != "cfsdp":
            continue
        full = cls.full_optim_state_dict(model, opt)
        full_all = cls.full_optim_state_dict(model, opt, rank0_only=False)
        if dp_rank(mesh) == 0:
            compare(mm, "rank0_only dict on rank 0 of the dp group", describe(full), describe(full_all))
        else:
            mm.check(full == {}, f"rank0_only: dp rank {dp_rank(mesh)} got a dict")
        sharded = cls.sharded_optim_state_dict(model, opt)
        with cls.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            compare(mm, "sharded_optim_state_dict", describe(sharded),
                    describe(cls.optim_state_dict(model, opt)))
        for k, st in full_all["state"].items():
            for n, v in st.items():
                whole = sharded["state"][k][n]
                whole = whole.full_tensor() if isinstance(whole, DTensor) else whole
                mm.tensors(f"sharded {k}.{n} (whole)", whole, v.full_tensor() if isinstance(v, DTensor) else v,
                           b_name="full")
        own = {k: {n: v.clone() for n, v in st.items()} for k, st in opt.state_dict()["state"].items()}
        loaded = [cls.scatter_full_optim_state_dict(full if dp_rank(mesh) == 0 else None, model, optim=opt),
                  cls.shard_full_optim_state_dict(full_all, model, optim=opt),
                  cls.flatten_sharded_optim_state_dict(sharded, model, opt)]
        for name, osd in zip(("scatter_full", "shard_full", "flatten_sharded"), loaded):
            for k, st in own.items():
                for n, v in st.items():
                    mm.tensors(f"{name}: state {k}.{n}", osd["state"][k][n], v, b_name="own")
    compare(mm, "full_optim_state_dict", fulls["cfsdp"], fulls[oracle], ordered=oracle == "torch")
    mm.raise_if_any()


# ------------------------------------------------------------------------------ errors


def expect(mm: pc.Mismatches, what: str, exc: type, fn, *needles: str) -> None:
    """cfsdp's ``fn`` raises ``exc`` with ``needles`` in its message."""
    expect_same_error(mm, what, {"cfsdp": fn}, exc, *needles)


@h.subtest(grid={"layout": tc.meshes(WORLD)})
def unsupported_and_errors(ctx, layout):
    """What stays unsupported is an error naming the parameter; torch's LOCAL_STATE_DICT rules."""
    layout = tuple(layout)
    mesh = tc.mesh_2d(*layout)
    F_ = cfsdp.FullyShardedDataParallel
    mm = pc.Mismatches(ctx)

    def tp_model():
        return tc.parallelize(build("even"), mesh["tp"], False)

    # TP parameters with process_group= (torch's FSDP1 flattens the DTensors without its
    # extension and fails on uneven shards; cfsdp says what to pass)
    expect(mm, "process_group", NotImplementedError,
           lambda: F_(tp_model(), process_group=mesh["dp"].get_group()), "'tok.weight'", "DTensor",
           "device_mesh=mesh['dp']")
    # a device_mesh that is not the dp slice of the TP mesh's 2-D mesh
    other = init_device_mesh("cpu", layout, mesh_dim_names=("dp2", "tp2"))
    expect(mm, "another mesh", ValueError,
           lambda: F_(tc.parallelize(build("even"), other["tp2"], False), device_mesh=mesh["dp"]),
           "'tok.weight'", "mesh['tp']")
    # clip_grad_norm_: torch's FSDP1 gives each TP rank another norm
    model = wrap("cfsdp", "even", mesh, False, False)
    x, y = tc.batches(1, dp_size(mesh))[0][dp_rank(mesh)]
    loss_fn(model(x), y).backward()
    expect(mm, "clip_grad_norm_", NotImplementedError, lambda: model.clip_grad_norm_(1.0),
           "tensor-parallel", "'tok.weight'")
    # an optimizer built from the DTensor parameters before wrapping steps nothing the model uses
    for uop in (False, True):
        m = tp_model()
        stale = torch.optim.SGD(m.parameters(), lr=0.1)
        w = F_(m, device_mesh=mesh["dp"], use_orig_params=uop)
        loss_fn(w(x), y).backward()
        expect(mm, f"optimizer built before wrapping (uop={uop})", RuntimeError, stale.step,
               "'tok.weight'", "after wrapping")
    # LOCAL_STATE_DICT: torch's RuntimeError with a device_mesh; a NO_SHARD wrapper (dp=1)
    # gives a FULL state dict instead, as torch's hooks do
    models = {impl: wrap(impl, "even", mesh, False, False) for impl in ("torch", "cfsdp")}

    def local_sd(m):
        with sd_class(m).state_dict_type(m, StateDictType.LOCAL_STATE_DICT):
            return describe(m.state_dict())

    if layout[0] > 1:
        fns = {k: functools.partial(local_sd, m) for k, m in models.items()}
        expect_same_error(mm, "LOCAL_STATE_DICT", fns, RuntimeError,
                          "DeviceMesh is not compatible with LOCAL_STATE_DICT")
    else:
        for impl, m in models.items():
            compare(mm, f"{impl} LOCAL_STATE_DICT at dp=1", local_sd(m),
                    model_sd(m, StateDictType.FULL_STATE_DICT))
    mm.raise_if_any()


if WORLD == 4:
    @h.subtest
    def hybrid_with_tp(ctx):
        """HSDP x TP through the wrapper is refused naming the parameter (fully_shard does it)."""
        mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("rep", "shard", "tp"))
        model = tc.parallelize(build("even"), mesh["tp"], False)
        mm = pc.Mismatches(ctx)
        expect(mm, "HYBRID_SHARD", NotImplementedError,
               lambda: cfsdp.FullyShardedDataParallel(
                   model, device_mesh=mesh["rep", "shard"],
                   sharding_strategy=ShardingStrategy.HYBRID_SHARD),
               "'tok.weight'", "HYBRID_SHARD")
        mm.raise_if_any()


if __name__ == "__main__":
    h.main()
