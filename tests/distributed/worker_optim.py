"""cfsdp.optim on both faces against torch.optim on the same face.

Run by tests/distributed/test_optim.py under torchrun (gloo, CPU) at W=2 and W=4; every
subtest runs inside the one spawn (see _harness.py).

For each face (``cfsdp.FullyShardedDataParallel`` with use_orig_params False and True, and
``cfsdp.fully_shard``) and each optimizer (AdamW in two param groups, Adam with amsgrad and
L2 decay, SGD with nesterov momentum), two copies of the same sharded model train 8 steps
on the same data, one with ``cfsdp.optim.X`` and one with ``torch.optim.X`` (its default on
CPU: the single-tensor path).

Oracle and tolerance: **bitwise**.  The C step is torch's single-tensor math with torch's
roundings except the square root (torch's CPU ``Tensor.sqrt`` is MKL's, within 1 ulp but not
correctly rounded; cfsdp's is IEEE, see cfsdp/_ref/optim.py), so the torch run uses an IEEE
``Tensor.sqrt`` (patched for the whole worker: nothing else in these models calls it).  Then
per-step losses, final local parameters and the optimizer state dicts from the face's API
(``FSDP.optim_state_dict``; ``cfsdp.checkpoint.state_dict.get_optimizer_state_dict`` for
fully_shard) are equal bit for bit.  Resume: a fresh model and optimizer load the cfsdp run's
model and optimizer state dicts after 4 steps and train 4 more: losses equal the
uninterrupted run's.  The step is also checked to be fused: every parameter takes the C
path, in at most one bucket (one C call) per unit.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

import _harness as h
import _ieee_sqrt
import cfsdp
from cfsdp import FullyShardedDataParallel as CFSDP
from cfsdp import optim as co
from cfsdp.checkpoint import state_dict as dsd
from cfsdp.optim import _muon
from cfsdp.optim._muon_owners import assign_owners
from muon_oracle import WrapperAllGatherMuon, small_buckets, spy_muon

CPU = torch.device("cpu")
STEPS, SAVE_AT = 8, 4
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

_ieee_sqrt.install()  # see the module docstring


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 3 * d + 1)
        self.down = nn.Linear(3 * d + 1, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class Frozen(nn.Linear):
    """A frozen layer: its own unit (FSDP1 with use_orig_params=False needs uniform
    requires_grad within a unit)."""

    def __init__(self, d: int):
        super().__init__(d, d)
        for p in self.parameters():
            p.requires_grad_(False)


class Net(nn.Module):
    """Sizes that need padding at W=2 and W=4, a frozen layer, two blocks (units)."""

    def __init__(self, d: int = 13):
        super().__init__()
        self.emb = nn.Linear(5, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.frozen = Frozen(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x + self.frozen(x))


OPTIMS = {
    "adamw": lambda mod, ps: mod.AdamW(
        [{"params": ps[: len(ps) // 2]}, {"params": ps[len(ps) // 2 :], "lr": 5e-3}],
        lr=1e-2, weight_decay=0.05),
    "adam": lambda mod, ps: mod.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.01),
    "sgd": lambda mod, ps: mod.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
}


def make_optim(name: str, model: nn.Module, fused: bool):
    ps = [p for p in model.parameters() if p.requires_grad]
    if fused:
        return OPTIMS[name](co, ps)
    return OPTIMS[name](torch.optim, ps)  # on CPU torch's default is its single-tensor path


def build(face: str, ctx) -> tuple[nn.Module, int]:
    """The sharded model and its number of units."""
    torch.manual_seed(0)
    m = Net()
    if face == "fully_shard":
        mesh = DeviceMesh.from_group(ctx.pg, "cpu")
        for b in m.blocks:
            cfsdp.fully_shard(b, mesh=mesh)
        cfsdp.fully_shard(m, mesh=mesh)
        return m, 3
    uop = face == "fsdp1_orig"
    return CFSDP(m, process_group=ctx.pg, use_orig_params=uop, device_id=CPU,
                 auto_wrap_policy=ModuleWrapPolicy({Block, Frozen})), 3


def data(ctx, steps: int):
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + ctx.rank)
        out.append((torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)))
    return out


def train(model, opt, batches) -> list[torch.Tensor]:
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def same(what: str, a, b) -> None:
    """Bitwise equality of nested state dicts / tensors (DTensors by their local shards)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{what}: keys {list(a)} != {list(b)}"
        for k in a:
            same(f"{what}.{k}", a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{what}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            same(f"{what}[{i}]", x, y)
    elif isinstance(a, torch.Tensor):
        assert type(a) is type(b), f"{what}: {type(a).__name__} vs {type(b).__name__}"
        if isinstance(a, DTensor):
            assert a.placements == b.placements and a.shape == b.shape, f"{what}: spec differs"
        la, lb = local(a), local(b)
        assert la.dtype == lb.dtype and la.shape == lb.shape, f"{what}: {la.shape} vs {lb.shape}"
        assert torch.equal(la, lb), f"{what}: values differ (max {float((la - lb).abs().max())})"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def optim_sd(face: str, model, opt):
    if face == "fully_shard":
        return dsd.get_optimizer_state_dict(model, opt)
    return CFSDP.optim_state_dict(model, opt)


def load_optim_sd(face: str, model, opt, osd) -> None:
    if face == "fully_shard":
        dsd.set_optimizer_state_dict(model, opt, osd)
    else:
        opt.load_state_dict(CFSDP.optim_state_dict_to_load(model, opt, osd))


def model_sd(face: str, model):
    if face == "fully_shard":
        return dsd.get_model_state_dict(model)
    return model.state_dict()


def load_model_sd(face: str, model, sd) -> None:
    if face == "fully_shard":
        dsd.set_model_state_dict(model, sd)
    else:
        model.load_state_dict(sd)


def assert_fused(opt, n_units: int) -> None:
    """Every parameter with a gradient steps in C (with use_orig_params=True a parameter
    whose shard on this rank is empty has none), at most one C call per unit and group."""
    for gi, plan in opt._cf_plans.items():
        assert not any(isinstance(k, str) for k in plan.kind), f"group {gi}: {plan.kind}"
        assert plan.entries, f"group {gi}: no parameter on the C path"
        assert len(plan.buckets) <= n_units, f"group {gi}: {len(plan.buckets)} C calls"


# every face with AdamW (two groups); the other optimizers on a face each too
@h.subtest(grid={"case": [("fsdp1_flat", "adamw"), ("fsdp1_flat", "sgd"), ("fsdp1_orig", "adamw"),
                          ("fsdp1_orig", "adam"), ("fully_shard", "adamw"), ("fully_shard", "adam"),
                          ("fully_shard", "sgd")]})
def parity_and_resume(ctx, case):
    face, optim = case
    batches = data(ctx, STEPS)
    runs = {}
    for fused in (True, False):
        model, n_units = build(face, ctx)
        opt = make_optim(optim, model, fused)
        losses = train(model, opt, batches[:SAVE_AT])
        if fused:
            saved = (model_sd(face, model), optim_sd(face, model, opt))
            saved = tuple(_clone(s) for s in saved)
        losses += train(model, opt, batches[SAVE_AT:])
        runs[fused] = (model, opt, losses)
        if fused:
            assert_fused(opt, n_units)
    (cm, copt, closs), (tm, topt, tloss) = runs[True], runs[False]
    same("losses", closs, tloss)
    same("params", dict(cm.named_parameters()), dict(tm.named_parameters()))
    same("optim state dict", optim_sd(face, cm, copt), optim_sd(face, tm, topt))
    # resume from the state dicts saved at SAVE_AT
    model, _ = build(face, ctx)
    opt = make_optim(optim, model, True)
    load_model_sd(face, model, saved[0])
    load_optim_sd(face, model, opt, saved[1])
    same("resumed losses", train(model, opt, batches[SAVE_AT:]), closs[SAVE_AT:])
    same("resumed params", dict(model.named_parameters()), dict(cm.named_parameters()))


class MatBlock(nn.Module):
    """A unit of matrices only (the flat parameter Muon can take with use_orig_params=False):
    63 + 45 + 35 = 143 elements, so at W=2 ``a`` lies on rank 0, ``b`` straddles the shard
    boundary, ``c`` lies on rank 1 with the padding after it (at W=4: ``a`` and ``b`` straddle,
    ``c`` and the padding on rank 3)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 9, bias=False)
        self.b = nn.Linear(9, 5, bias=False)
        self.c = nn.Linear(5, 7, bias=False)

    def forward(self, x):
        return x + self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class MuonNet(nn.Module):
    """Two matrix units and a root unit of a matrix with a bias on each end.  ``strided``: the
    second unit's ``b.weight`` (5, 9) is transposed in memory (strides (1, 5)), which the
    wrapper keeps and lays out in memory order (at W=2 it straddles the shard boundary), and
    the first unit's ``a.weight`` (9, 7) too (on rank 0 only at W=2)."""

    def __init__(self, strided: bool = False):
        super().__init__()
        self.emb = nn.Linear(5, 7)
        self.blocks = nn.ModuleList([MatBlock(), MatBlock()])
        self.head = nn.Linear(7, 3)
        if strided:
            for lin in (self.blocks[1].b, self.blocks[0].a):
                lin.weight = nn.Parameter(lin.weight.detach().t().contiguous().t())

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


MUON_CASES = {  # name: (use_orig_params, Muon kwargs)
    "flat": (False, {"lr": 0.02, "weight_decay": 0.1}),
    "flat_plain_wd": (False, {"lr": 0.02, "weight_decay": 0.3, "nesterov": False}),
    "orig_adamw": (True, {"lr": 0.02, "weight_decay": 0.1}),
    "orig_plain_wd": (True, {"lr": 0.02, "weight_decay": 0.3, "nesterov": False,
                             "adjust_lr_fn": "match_rms_adamw"}),
    # Muon on the matrix units' originals only, AdamW on the root unit: FSDP.optim_state_dict
    # of the Muon (it wants every trainable parameter of a unit it sees in the optimizer)
    "orig_state_dict": (True, {"lr": 0.02, "weight_decay": 0.1}),
    # transposed weights (MuonNet(strided=True)), flat and original parameters
    "flat_strided": (False, {"lr": 0.02, "weight_decay": 0.1}),
    "orig_strided": (True, {"lr": 0.02, "weight_decay": 0.1}),
}


def _muon_model(ctx, uop: bool, strided: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return CFSDP(MuonNet(strided), process_group=ctx.pg, use_orig_params=uop, device_id=CPU,
                 auto_wrap_policy=ModuleWrapPolicy({MatBlock}))


def _muon_split(model: nn.Module, uop: bool, by_unit: bool = False):
    """(Muon's parameters, AdamW's): with use_orig_params=False the matrix units' flat
    parameters and the root's; with True the matrices (ndim >= 2 originals) and the rest
    (``by_unit``: the matrix units' originals and the root unit's)."""
    if uop:
        mats, rest = [], []
        root = model._handle.flat_param
        for p in model.parameters():
            unit, k = _muon._wrapped(p)
            mat = unit.flat_param is not root if by_unit else len(unit.infos[k].shape) >= 2
            (mats if mat else rest).append(p)
        return mats, rest
    units = [m for m in model.modules() if isinstance(m, CFSDP)]
    flat = [u._handle.flat_param for u in units if u._handle is not None]
    return flat[1:], flat[:1]  # the root unit's flat parameter comes first (emb, head)


@h.subtest(grid={"case": list(MUON_CASES)})
def muon_wrapper(ctx, case):
    """cfsdp.optim.Muon on the wrapper's flat shards against the all-gather-everywhere Muon
    (muon_oracle.WrapperAllGatherMuon) on the same wrapper: bitwise losses and parameters
    after 3 steps, each matrix orthogonalized once per step, by its owner, in one exchange."""
    _muon_wrapper_run(ctx, case)


@h.subtest(grid={"case": ["flat", "orig_adamw"]})
def muon_wrapper_buckets(ctx, case):
    """``muon_wrapper`` with the exchange cut into buckets of at most 200 bytes on the wire
    (the (9, 7) matrix alone, the (5, 9) and (7, 5) ones together): still bitwise."""
    with small_buckets(200) as plans:
        _muon_wrapper_run(ctx, case)
    assert plans and max(plans) > 1, f"bucket counts per exchange {plans}"


def _muon_wrapper_run(ctx, case):
    uop, kw = MUON_CASES[case]
    strided = case.endswith("_strided")
    batches = data(ctx, 3)
    runs = {}
    for impl in ("cfsdp", "oracle"):
        model = _muon_model(ctx, uop, strided)
        if strided:  # the wrapper kept both strides (else the case tests nothing new)
            units = [_muon._wrapped(m._handle.flat_param)[0] for m in model.modules()
                     if isinstance(m, CFSDP) and m._handle is not None]
            kept = sorted(i.fqn for u in units for i in u.infos if i.stride is not None)
            assert kept == ["a.weight", "b.weight"], kept
        mats, rest = _muon_split(model, uop, case == "orig_state_dict")
        adamw = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01)
        if impl == "cfsdp":
            muon = co.Muon(mats, **kw)
            counts: list = []
            spy_muon(muon, counts)
        else:
            pairs = [_muon._wrapped(p) for p in mats]
            muon = WrapperAllGatherMuon(
                [(u, k) for u, j in pairs for k in ([j] if j is not None else range(len(u.infos)))],
                **kw)
        losses = []
        for x, y in batches:
            model.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            muon.step()
            adamw.step()
            losses.append(loss.detach().clone())
        runs[impl] = (model, muon, losses, mats)
    (cm, cmuon, closs, cmats), (om, omuon, oloss, _) = runs["cfsdp"], runs["oracle"]
    same("losses", closs, oloss)
    same("params", dict(cm.named_parameters()), dict(om.named_parameters()))
    _single_process_muon(ctx, cm, uop, case == "orig_state_dict", kw, strided)
    if case == "orig_state_dict":  # FSDP.optim_state_dict consolidates the 1-D momentum pieces, and loads back
        _muon_state_round_trip(ctx, cm, cmuon, cmats, omuon, kw)
    shapes = [tuple(u.infos[k].shape) for u, k in omuon.matrices]
    owners = assign_owners(shapes, ctx.world_size)
    mine = sum(1 for o in owners if o == ctx.rank)
    assert counts == [[mine, 1]] * 3, (
        f"rank {ctx.rank}: (matrices orthogonalized, exchanges) per step {counts}, expected "
        f"{[mine, 1]} ({len(shapes)} matrices, owners {owners})")
    assert omuon.ns_matrices == 3 * len(shapes)


# against one process on the global batch: the gradients differ from it by the reduction
# order's ulps, which Newton–Schulz (in bf16) can turn into bf16 ulps of an update
MUON_REF_RTOL, MUON_REF_ATOL = 1e-5, 1e-6  # atol: times the reference's largest |value|


def _single_process_muon(ctx, model, uop: bool, by_unit: bool, kw: dict,
                         strided: bool = False) -> None:
    """The wrapper's full parameters after ``muon_wrapper``'s 3 steps against torch's Muon (+
    AdamW, the same split as ``_muon_split``) on the plain model in one process, on the global
    batch (every rank's rows: the mean of the ranks' mean losses is the mean over all rows)."""
    full = model.state_dict()  # FULL_STATE_DICT on every rank
    torch.manual_seed(0)
    ref = MuonNet(strided)
    to_muon = {n for n, p in ref.named_parameters()
               if (n.startswith("blocks.") if (not uop or by_unit) else p.ndim >= 2)}
    muon = torch.optim.Muon([p for n, p in ref.named_parameters() if n in to_muon], **kw)
    adamw = torch.optim.AdamW([p for n, p in ref.named_parameters() if n not in to_muon],
                              lr=1e-2, weight_decay=0.01)
    every = [data(dataclasses.replace(ctx, rank=r), 3)
             for r in range(ctx.world_size)]
    for step in range(3):
        x = torch.cat([b[step][0] for b in every])
        y = torch.cat([b[step][1] for b in every])
        ref.zero_grad(set_to_none=True)
        F.mse_loss(ref(x), y).backward()
        muon.step()
        adamw.step()
    for n, p in ref.named_parameters():
        got, want = full[n], p.detach()
        tol = MUON_REF_ATOL * want.abs().max().item()
        assert torch.allclose(got, want, rtol=MUON_REF_RTOL, atol=tol), (
            f"rank {ctx.rank}: {n} after 3 steps differs from one process on the global batch "
            f"by {(got - want).abs().max().item():.3e} (rtol {MUON_REF_RTOL}, atol {tol:.3e})")


@h.subtest
def optim_state_dict_split_unit(ctx):
    """``FSDP.optim_state_dict`` of an optimizer holding only some of a sharded unit's trainable
    parameters (use_orig_params=True, Muon on the matrices, AdamW on the rest, the root unit
    holding both kinds): torch's FSDP1 refuses it; cfsdp too, with torch's message first, then
    the parameter and what to do."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    msgs = {}
    for name, wrapper in (("torch", TorchFSDP), ("cfsdp", CFSDP)):
        torch.manual_seed(0)
        model = wrapper(MuonNet(), process_group=ctx.pg, use_orig_params=True,
                        device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({MatBlock}))
        names = {p: n.replace("_fsdp_wrapped_module.", "") for n, p in model.named_parameters()}
        weights = [p for p in model.parameters() if names[p].endswith("weight")]
        opt = torch.optim.SGD(weights, lr=0.1, momentum=0.9)
        x, y = data(ctx, 1)[0]
        F.mse_loss(model(x), y).backward()
        opt.step()
        try:
            wrapper.optim_state_dict(model, opt)
        except RuntimeError as e:
            msgs[name] = str(e)
        else:
            raise AssertionError(f"{name}: optim_state_dict took an optimizer without 'emb.bias'")
    head = msgs["torch"].split(" while the optimizer")[0]
    assert head.startswith("emb.bias is not in the optimizer state. The FSDPParamInfo has the "
                           "param keys"), msgs["torch"]
    assert msgs["cfsdp"].startswith(head), f"cfsdp: {msgs['cfsdp']!r}\ntorch: {msgs['torch']!r}"
    for want in ("parameter 'emb.bias'", "auto_wrap_policy"):
        assert want in msgs["cfsdp"], f"{want!r} not in {msgs['cfsdp']!r}"


@h.subtest
def muon_wrapper_cleared(ctx):
    """use_orig_params=True, matrices whose gradients were cleared: the ranks agree whether each
    matrix is stepped, whichever hold it (a rank with no element of a matrix cannot tell).
    Step 2 clears one matrix's gradient on every rank (at W=2 ``blocks.0.a``, wholly on rank 0:
    rank 1 joins its exchange only if rank 0 has its gradient): bitwise the oracle skipping it;
    ``zero_grad`` then ``step()`` without a backward: nothing moves, no rank waits; a gradient
    cleared on one holder only: ``ValueError`` naming it on every rank, nothing stepped."""
    uop, kw = MUON_CASES["orig_adamw"]
    batches = data(ctx, 3)
    runs = {}
    for impl in ("cfsdp", "oracle"):
        model = _muon_model(ctx, uop)
        mats, rest = _muon_split(model, uop)
        names = {p: n.replace("_fsdp_wrapped_module.", "") for n, p in model.named_parameters()}
        cleared = next(p for p in mats if names[p] == "blocks.0.a.weight")
        adamw = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01)
        if impl == "cfsdp":
            muon = co.Muon(mats, **kw)
        else:
            pairs = [_muon._wrapped(p) for p in mats]
            muon = WrapperAllGatherMuon(pairs, **kw)
        losses = []
        for step, (x, y) in enumerate(batches):
            model.zero_grad(set_to_none=True)
            if step == 2 and impl == "cfsdp":  # no gradient anywhere: a step moves nothing
                before = {n: q.detach().clone() for n, q in model.named_parameters()}
                muon.step()
                same("params after a step without gradients",
                     {n: q.detach() for n, q in model.named_parameters()}, before)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if step == 1:
                cleared.grad = None  # on every rank (rank 1 has none: an empty piece)
                muon.skip = {_muon._wrapped(cleared)} if impl == "oracle" else None
            muon.step()
            adamw.step()
            if impl == "oracle":
                muon.skip = set()
            losses.append(loss.detach().clone())
        runs[impl] = (model, muon, mats, names, losses)
    (cm, cmuon, cmats, cnames, closs), (om, _, _, _, oloss) = runs["cfsdp"], runs["oracle"]
    same("losses", closs, oloss)
    same("params", dict(cm.named_parameters()), dict(om.named_parameters()))
    # a gradient cleared on one of the ranks holding part of a matrix: every rank refuses
    F.mse_loss(cm(batches[0][0]), batches[0][1]).backward()
    straddling = next(p for p in cmats if cnames[p] == "blocks.0.b.weight")
    unit, k = _muon._wrapped(straddling)
    holders = [r for r, sl in enumerate(unit.layout.slices) if sl[k].numel]
    assert len(holders) >= 2, holders
    if ctx.rank == holders[0]:
        straddling.grad = None
    before = {n: q.detach().clone() for n, q in cm.named_parameters()}
    try:
        cmuon.step()
    except ValueError as e:
        for want in ("original parameter 'b.weight' of a FullyShardedDataParallel unit", f"on {len(holders) - 1} of the {len(holders)} ranks",
                     "zero_grad() on every rank"):
            assert want in str(e), f"{want!r} not in {e}"
    else:
        raise AssertionError(f"rank {ctx.rank}: Muon stepped a matrix whose gradient was cleared "
                             "on one holder only")
    same("params after the refused step", {n: q.detach() for n, q in cm.named_parameters()},
         before)


def _muon_state_round_trip(ctx, model, muon, mats, oracle, kw) -> None:
    """use_orig_params=True: ``FSDP.optim_state_dict`` gives each matrix's full momentum
    buffer, the oracle's bit for bit; ``optim_state_dict_to_load`` + ``load_state_dict`` on a
    fresh model and Muon give back each rank's 1-D pieces."""
    osd = CFSDP.optim_state_dict(model, muon)
    names = {p: n.replace("_fsdp_wrapped_module.", "") for n, p in model.named_parameters()}
    for p, s in zip(mats, oracle.shadows):
        same(f"full momentum of {names[p]}", osd["state"][names[p]]["momentum_buffer"],
             oracle.inner.state[s]["momentum_buffer"])
    fresh = _muon_model(ctx, True)
    fmats, _ = _muon_split(fresh, True, True)
    fmuon = co.Muon(fmats, **kw)
    fmuon.load_state_dict(CFSDP.optim_state_dict_to_load(fresh, fmuon, osd))
    for p, q in zip(mats, fmats):
        got = fmuon.state[q].get("momentum_buffer") if q in fmuon.state else None
        want = muon.state[p].get("momentum_buffer") if p in muon.state else None
        if want is None or want.numel() == 0:
            assert got is None or got.numel() == 0, f"{names[p]}: state loaded for an empty piece"
        else:
            same(f"loaded momentum of {names[p]}", got, want)


@h.subtest
def muon_wrapper_refuses(ctx):
    """A flat parameter holding a 1-D original parameter (use_orig_params=False): torch's
    ValueError, the original's FQN and what to do; the group is not added.  bf16 matrices
    without Nesterov (torch normalizes the bf16 momentum buffer in place), and with it (torch's
    bf16 add_ rounds by position in the whole tensor): NotImplementedError on every rank, those
    holding no element of the matrix too, before any collective."""
    model = _muon_model(ctx, False)
    _, (root,) = _muon_split(model, False)
    try:
        co.Muon([root], lr=0.02)
    except ValueError as e:
        msg = str(e)
    else:
        raise AssertionError("cfsdp.optim.Muon took a flat parameter holding 1-D parameters")
    for want in ("Muon only supports 2D parameters whereas we found a parameter with size: "
                 "torch.Size([7])", "'emb.bias'", "use_orig_params=True", "AdamW"):
        assert want in msg, f"{want!r} not in {msg!r}"
    for uop in (False, True):
        model = _muon_model(ctx, uop).to(torch.bfloat16)
        mats, _ = _muon_split(model, uop)
        x, y = data(ctx, 1)[0]
        F.mse_loss(model(x.bfloat16()), y.bfloat16()).backward()
        # without Nesterov its own reason; with it, torch's bf16 add_(alpha=) rounds by
        # position in the whole tensor
        for nesterov, want in ((False, "bf16 parameter stepped without Nesterov"),
                               (True, "sharded torch.bfloat16 parameter")):
            try:
                co.Muon(mats, lr=0.02, nesterov=nesterov).step()
            except NotImplementedError as e:
                assert want in str(e), str(e)
            else:
                raise AssertionError(f"use_orig_params={uop}, nesterov={nesterov}: bf16 Muon "
                                     "on shards stepped")


def _clone(x):
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    if isinstance(x, DTensor):
        return DTensor.from_local(x.to_local().clone(), x.device_mesh, x.placements,
                                  shape=x.shape, stride=x.stride(), run_check=False)
    if isinstance(x, torch.Tensor):
        return x.clone()
    return x


if __name__ == "__main__":
    h.main()
