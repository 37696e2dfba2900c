"""What several feature modules of worker_zero.py share: the model and its data, the optimizers,
the three contenders (``Trio``), bitwise comparisons, torch's errors, the shared bucket's checks
and the duplicate-parameter layouts. A helper: it registers no subtest."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as DDP

import _harness as h
import cfsdp
from cfsdp import optim as co


STEPS = 5
LOW_DTYPES = (torch.bfloat16, torch.float16)


class Net(nn.Module):
    """Parameters of many sizes, with ties (the partition's stable sort), optionally a
    frozen layer, a float64 layer, bfloat16 and float16 layers (``low``) or a non-contiguous
    (transposed) weight."""

    def __init__(self, frozen: bool = False, fp64: bool = False, transposed: bool = False,
                 low: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(6, 24)
        self.mid = nn.Linear(24, 24)
        self.norm = nn.LayerNorm(24)
        self.side = nn.Linear(24, 5)
        self.head = nn.Linear(29, 3)
        self.frozen = nn.Linear(24, 24) if frozen else None
        if frozen:
            self.frozen.requires_grad_(False)
        self.fp64 = fp64
        if fp64:
            self.side.double()
        if transposed:
            self.mid.weight = nn.Parameter(self.mid.weight.detach().t().contiguous().t())
        # a residual branch per low-precision dtype, computed in it
        self.low = nn.ModuleList([nn.Linear(24, 24).to(dt) for dt in LOW_DTYPES]) if low else None

    def forward(self, x):
        h = self.norm(F.gelu(self.mid(F.gelu(self.emb(x)))))
        if self.frozen is not None:
            h = h + self.frozen(h)
        for lin in self.low or ():
            h = h + lin(h.to(lin.weight.dtype)).float()
        s = self.side(h.double()).float() if self.fp64 else self.side(h)
        return self.head(torch.cat([h, s], dim=1))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def groups(model: nn.Module, two: bool):
    ps = list(model.parameters())
    if not two:
        return ps
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": weights}, {"params": rest, "lr": 5e-3, "weight_decay": 0.0}]


# name: (torch class, cfsdp ZeRO's inner class, kwargs, two param groups)
OPTIMS = {
    "sgd": (torch.optim.SGD, torch.optim.SGD,
            dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), False),
    "adam": (torch.optim.Adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.01),
             False),
    "adamw": (torch.optim.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05), True),
    "cfsdp_adamw": (torch.optim.AdamW, co.AdamW, dict(lr=1e-2, weight_decay=0.05), True),
    "cfsdp_sgd": (torch.optim.SGD, co.SGD, dict(lr=0.05, momentum=0.9), True),
    "cfsdp_adam": (torch.optim.Adam, co.Adam, dict(lr=1e-2, maximize=True), False),
}


class Trio:
    """plain, torch's ZeRO and cfsdp's ZeRO on three DDP copies of one model."""

    def __init__(self, pg, optim, bucket_view: bool, net: dict | None = None,
                 torch_zero: bool = True, find_unused: bool = False, two: bool | None = None,
                 extra: dict | None = None, select=None):
        """``optim``: a name of OPTIMS, or such a tuple; ``select(model)``: the parameters
        the optimizers train (default: ``groups``; the others keep their values)."""
        cls, ours, kw, two_groups = OPTIMS[optim] if isinstance(optim, str) else optim
        kw = dict(kw, **(extra or {}))
        two = two_groups if two is None else two
        pick = select or (lambda m: groups(m, two))
        self.pg, self.rank = pg, dist.get_rank(pg)
        self.names = ["plain", "torch", "cfsdp"] if torch_zero else ["plain", "cfsdp"]
        self.models = {n: DDP(Net(**(net or {})), process_group=pg,
                              find_unused_parameters=find_unused) for n in self.names}
        self.opts = {"plain": cls(pick(self.models["plain"]), **kw)}
        if torch_zero:
            self.opts["torch"] = TorchZeRO(pick(self.models["torch"]), cls,
                                           process_group=pg,
                                           parameters_as_bucket_view=bucket_view, **kw)
        self.opts["cfsdp"] = cfsdp.ZeroRedundancyOptimizer(
            pick(self.models["cfsdp"]), ours, process_group=pg,
            parameters_as_bucket_view=bucket_view, **kw)
        self.scheds = {n: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
                       for n, o in self.opts.items()}
        self.losses = {n: [] for n in self.names}
        self.step_no = 0

    def train(self, steps: int, between=None) -> None:
        for _ in range(steps):
            x, y = batch(self.rank, self.step_no)
            for n in self.names:
                opt = self.opts[n]
                opt.zero_grad(set_to_none=True)
                loss = F.mse_loss(self.models[n](x), y)
                loss.backward()
                opt.step()
                self.scheds[n].step()
                self.losses[n].append(loss.detach())
            self.step_no += 1
            if between is not None:
                between(self)

    def check_same(self, what: str = "") -> None:
        ref = "plain"
        for n in self.names[1:]:
            same(f"{what}losses {n}", self.losses[n], self.losses[ref])
            same(f"{what}params {n}", list(self.models[n].parameters()),
                 list(self.models[ref].parameters()))
            same(f"{what}lr {n}", [g["lr"] for g in self.opts[n].param_groups],
                 [g["lr"] for g in self.opts[ref].param_groups])

    def local_indices(self, name: str) -> list:
        """Indices (model.parameters() order) of the parameters the ZeRO's local optimizer
        steps, by group."""
        where = {id(p): i for i, p in enumerate(self.models[name].parameters())}
        return [[where[id(p)] for p in g["params"]] for g in self.opts[name].optim.param_groups]

    def check_state_dicts(self) -> None:
        """Consolidate to every rank in turn: equal to plain's bit for bit; elsewhere
        state_dict() raises as torch's does."""
        W = dist.get_world_size(self.pg)
        zeros = [n for n in self.names if n != "plain"]
        for to in range(W):
            for n in zeros:
                self.opts[n].consolidate_state_dict(to)
            if self.rank == to:
                want = self.opts["plain"].state_dict()
                for n in zeros:
                    same(f"state dict {n} (to={to})", self.opts[n].state_dict(), want,
                         ordered=False)
            else:
                errs = {n: raises(self.opts[n].state_dict) for n in zeros}
                same_error(errs["cfsdp"], errs.get("torch", errs["cfsdp"]))


def raises(fn, *args, **kwargs) -> BaseException:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the exception is the result
        return e
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise")


def same_error(ours: BaseException, theirs: BaseException) -> None:
    """Misuse errors as torch's: the same type, a message containing torch's."""
    assert type(ours) is type(theirs), f"{type(ours).__name__} vs torch's {type(theirs).__name__}"
    assert str(theirs) in str(ours), f"cfsdp's message\n  {ours}\nlacks torch's\n  {theirs}"


def same(what: str, a, b, ordered: bool = True) -> None:
    """Bitwise equality of nested dicts / lists / tensors (``ordered``: dict key order too)."""
    if isinstance(a, dict):
        assert isinstance(b, dict), f"{what}: dict vs {type(b).__name__}"
        ka, kb = list(a), list(b)
        if not ordered:
            ka, kb = sorted(ka, key=repr), sorted(kb, key=repr)
        assert ka == kb, f"{what}: keys {ka} != {kb}"
        for k in a:
            same(f"{what}.{k}", a[k], b[k], ordered)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{what}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            same(f"{what}[{i}]", x, y, ordered)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{what}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a.detach(), b.detach()), \
            f"{what}: values differ (max {float((a.detach().double() - b.detach().double()).abs().max())})"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def fused(opt) -> None:
    """Every parameter of a cfsdp.optim local optimizer that stepped took the C path."""
    for gi, plan in opt.optim._cf_plans.items():
        assert not any(isinstance(k, str) for k in plan.kind), f"group {gi}: {plan.kind}"


def bcast(obj, pg, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, src), group=pg)
    return box[0]


def shared_expected(pg) -> bool:
    """Whether ZeRO's bucket views are one host-shared bucket on ``pg`` (the rule of
    [Note: ZeRO shared bucket], from the launch's environment: all ranks on this host, the
    C core with shared memory on, more than one rank)."""
    return (os.environ.get("CFSDP_SHM", "1") != "0" and cfsdp.backend == "c"
            and dist.get_world_size(pg) > 1)


def check_shared(zero, want: bool) -> None:
    """Every bucket of ``zero`` shared or not as ``want``; a shared bucket's file is gone
    from its directory (unlinked once every rank mapped it) and mapped by this process."""
    for s in zero._syncs:
        assert s.shared == want, f"bucket shared={s.shared}, expected {want}"
        if s.shared:
            assert s.path and not os.path.exists(s.path), f"{s.path} left behind"
            with open("/proc/self/maps") as f:
                assert f"{s.path} (deleted)" in f.read(), f"{s.path} not mapped"


def _dup_params(layout: str, ps: list):
    """Every parameter of ``ps`` (emb.weight (144), emb.bias, mid.weight (576), mid.bias,
    ...), some listed twice or three times; where torch's sorted-greedy partition puts the
    copies (two ranks, one rank, both) depends on the sizes around them and the world size."""
    w0, b0, w1, b1 = ps[:4]
    return {
        "two_ranks": [w0, b0, w0, w1, b1] + ps[4:],
        "same_rank": [w1, b1] + ps[4:] + [w0, b0, w0],
        "thrice": [w1, w1, w1, b1, w0, b0] + ps[4:],
        "big_twice": [w1, w0, w1, b0, b1] + ps[4:],
    }[layout]


def _zero_of(name: str, params: list, optim_class, pg, bucket_view: bool, kw: dict,
             record: bool = True) -> tuple:
    """(torch's or cfsdp's ZeroRedundancyOptimizer over ``params``, the duplicate-parameter
    warnings its construction gave, if ``record``)."""
    ctor = TorchZeRO if name == "torch" else cfsdp.ZeroRedundancyOptimizer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always" if record else "ignore")
        opt = ctor(params, optim_class, process_group=pg, parameters_as_bucket_view=bucket_view,
                   **kw)
    return opt, sorted({str(w.message) for w in caught if issubclass(w.category, UserWarning)
                        and "duplicate" in str(w.message)})


def _dup_grads(params: list, step: int) -> None:
    g = torch.Generator().manual_seed(7 + step)  # the same on every rank, as after DDP
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
