"""cfsdp.optim.ZeroRedundancyOptimizer against torch's ZeroRedundancyOptimizer and against
plain DDP + optimizer.

Run by tests/distributed/test_zero.py under torchrun (gloo, CPU) at W=2 and W=4 (shared
memory) and W=3 (the process group: CFSDP_SHM=0), every subtest in one spawn.

Oracle and tolerance: **bitwise**.  Three copies of one model (same seed), each in DDP
over the subtest's group, train on the same per-rank data: ``plain`` (torch.optim.X over
all parameters), ``torch`` (torch's ZeroRedundancyOptimizer with X) and ``cfsdp``
(cfsdp's, with X or cfsdp.optim.X).  DDP gives all three the same gradients, a ZeRO's
local step is X's per-parameter math on them, and the parameter sync copies bytes, so
losses, parameters and consolidated state dicts are equal bit for bit, at every world
size.  cfsdp.optim's Adam uses an IEEE square root where torch's CPU ``Tensor.sqrt`` is
MKL's (within 1 ulp); the worker patches ``Tensor.sqrt`` to an IEEE one (as
worker_optim.py does) so that cfsdp.optim.X inside is bitwise too.  The ZeRO-2 hook
(``reduce_scatter_hook``) is checked against plain DDP + AdamW: bitwise at W=2 (the
reduced gradient is the same two-term sum, divided by 2), within fp32 rounding of the
sum's order at W=3/4 (rtol 1e-5, atol 1e-6; stated in that subtest).
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as DDP

import _harness as h
import _ieee_sqrt
import cfsdp
from cfsdp import optim as co
from cfsdp._runtime import comm
from cfsdp.optim import _zero_buckets

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

_ieee_sqrt.install()  # see the module docstring

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

    def __init__(self, pg, optim: str, bucket_view: bool, net: dict | None = None,
                 torch_zero: bool = True, find_unused: bool = False, two: bool | None = None,
                 extra: dict | None = None):
        cls, ours, kw, two_groups = OPTIMS[optim]
        kw = dict(kw, **(extra or {}))
        two = two_groups if two is None else two
        self.pg, self.rank = pg, dist.get_rank(pg)
        self.names = ["plain", "torch", "cfsdp"] if torch_zero else ["plain", "cfsdp"]
        self.models = {n: DDP(Net(**(net or {})), process_group=pg,
                              find_unused_parameters=find_unused) for n in self.names}
        self.opts = {"plain": cls(groups(self.models["plain"], two), **kw)}
        if torch_zero:
            self.opts["torch"] = TorchZeRO(groups(self.models["torch"], two), cls,
                                           process_group=pg,
                                           parameters_as_bucket_view=bucket_view, **kw)
        self.opts["cfsdp"] = cfsdp.ZeroRedundancyOptimizer(
            groups(self.models["cfsdp"], two), ours, process_group=pg,
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


# ----------------------------------------------------------------------------- parity
@h.subtest(grid={"optim": list(OPTIMS), "bucket_view": [False, True]})
def parity(ctx, optim, bucket_view):
    """Losses, parameters, LR schedule, the partition and the consolidated state dicts
    (to each rank) of all three, two param groups where the optimizer has them, a frozen
    layer."""
    t = Trio(ctx.pg, optim, bucket_view, net=dict(frozen=True))
    t.train(STEPS)
    t.check_same()
    assert t.local_indices("cfsdp") == t.local_indices("torch"), "partition differs from torch's"
    t.check_state_dicts()
    if OPTIMS[optim][1] is not OPTIMS[optim][0]:
        fused(t.opts["cfsdp"])
    if bucket_view:  # every trainable parameter is a view of the one flat bucket
        (sync,) = t.opts["cfsdp"]._syncs
        check_shared(t.opts["cfsdp"], shared_expected(ctx.pg))
        trainable = [p for p in t.models["cfsdp"].parameters() if p.requires_grad]
        assert all(sync.holds(p) for p in trainable)
        assert not any(sync.holds(p) for p in t.models["cfsdp"].module.frozen.parameters())


@h.subtest(grid={"bucket_view": [False, True]})
def add_param_group_later(ctx, bucket_view):
    """Biases (and the norm) added as a second group after two steps, by all three."""
    def weights(m):
        return [p for n, p in m.named_parameters() if n.endswith("weight")]

    t = Trio(ctx.pg, "adamw", bucket_view, two=False)
    for n, m in t.models.items():  # rebuild with the weights only
        cls, ours, kw, _ = OPTIMS["adamw"]
        if n == "plain":
            t.opts[n] = cls(weights(m), **kw)
        elif n == "torch":
            t.opts[n] = TorchZeRO(weights(m), cls, process_group=ctx.pg,
                                  parameters_as_bucket_view=bucket_view, **kw)
        else:
            t.opts[n] = cfsdp.ZeroRedundancyOptimizer(weights(m), ours, process_group=ctx.pg,
                                                      parameters_as_bucket_view=bucket_view, **kw)
        t.scheds[n] = torch.optim.lr_scheduler.StepLR(t.opts[n], step_size=2, gamma=0.5)
    t.train(2)
    for n, m in t.models.items():
        rest = [p for name, p in m.named_parameters() if not name.endswith("weight")]
        t.opts[n].add_param_group({"params": rest, "lr": 5e-3, "weight_decay": 0.0})
    t.train(3)
    t.check_same()
    assert t.local_indices("cfsdp") == t.local_indices("torch")
    t.check_state_dicts()


@h.subtest(grid={"bucket_view": [False, True]})
def trainability_changes(ctx, bucket_view):
    """A frozen layer, and the first weight frozen and unfrozen every other step (torch's
    own test): the bucket views are rebuilt, frozen parameters cloned out of them."""
    t = Trio(ctx.pg, "cfsdp_adamw", bucket_view, net=dict(frozen=True), find_unused=True)

    def toggle(trio):
        for m in trio.models.values():
            next(m.parameters()).requires_grad_(bool(trio.step_no % 2))

    t.train(STEPS + 1, between=toggle)
    t.check_same()
    t.check_state_dicts()


@h.subtest(grid={"bucket_view": [False, True]})
def moved_parameters(ctx, bucket_view):
    """``p.data = clone`` on every parameter between steps (as ``model.to`` would):
    cfsdp's ZeRO rebuilds its buckets from the current values (torch's would keep
    syncing its old buckets: not compared)."""
    t = Trio(ctx.pg, "cfsdp_sgd", bucket_view, torch_zero=False)

    def move(trio):
        if trio.step_no == 2:
            with torch.no_grad():
                for m in trio.models.values():
                    for p in m.parameters():
                        p.data = p.data.clone()

    t.train(STEPS, between=move)
    t.check_same()
    t.check_state_dicts()


@h.subtest(grid={"optim": ["adamw", "cfsdp_adamw", "sgd", "cfsdp_sgd", "cfsdp_adam"]})
def mixed_dtypes(ctx, optim):
    """Layers of float64, bfloat16 and float16 among float32 ones (beyond torch: its ZeRO
    raises ValueError; one cfsdp bucket per dtype), both bucket modes, torch's optimizers and
    cfsdp.optim's (fused C for float32, torch's per-tensor math for the others) inside,
    against plain DDP + the same optimizer over every parameter: losses, parameters of every
    dtype and consolidated state dicts bit for bit."""
    e = raises(TorchZeRO, Net(fp64=True, low=True).parameters(), torch.optim.AdamW,
               process_group=ctx.pg, lr=1e-2)
    assert isinstance(e, ValueError) and "same dense type" in str(e), e
    # Adam's default eps (1e-8) is 0 in float16: every float16 parameter would become NaN
    extra = {"eps": 1e-3} if "adam" in optim else {}
    for bucket_view in (False, True):
        t = Trio(ctx.pg, optim, bucket_view, net=dict(fp64=True, low=True), torch_zero=False,
                 extra=extra)
        dtypes = sorted(str(p.dtype) for p in t.models["cfsdp"].parameters())
        assert set(dtypes) == {"torch.float32", "torch.float64", "torch.bfloat16",
                                       "torch.float16"}, dtypes
        assert len(t.opts["cfsdp"]._syncs) == 4
        t.train(STEPS)
        t.check_same(f"bucket_view={bucket_view}: ")
        t.check_state_dicts()


@h.subtest
def staged_sync_in_windows(ctx):
    """Without bucket views, a staging buffer of a few hundred bytes: the sync runs in
    many windows of 80 elements (40 for float64), the last one shorter, parameters cut
    across windows, against torch's ZeRO and plain DDP (frozen layer, and a float64 layer
    without torch)."""
    old = _zero_buckets.STAGING_BYTES
    _zero_buckets.STAGING_BYTES = 320 * ctx.world_size
    try:
        t = Trio(ctx.pg, "adamw", False, net=dict(frozen=True))
        sync = t.opts["cfsdp"]._syncs[0]
        assert sync.win == 80 and len(sync._rounds) > 5, (sync.win, len(sync._rounds))
        assert sync.layout.seg % sync.win, "the last window must be a short one"
        t.train(STEPS)
        t.check_same()
        t.check_state_dicts()
        t = Trio(ctx.pg, "cfsdp_sgd", False, net=dict(fp64=True), torch_zero=False)
        assert [s.win for s in t.opts["cfsdp"]._syncs] == [80, 40]
        t.train(STEPS)
        t.check_same("float64: ")
    finally:
        _zero_buckets.STAGING_BYTES = old


@h.subtest(grid={"bucket_view": [False, True]})
def transposed_parameter(ctx, bucket_view):
    """A transposed (non-contiguous) weight: without bucket views it is synced by a
    broadcast of its own; with them its view keeps its strides.  (torch's bucket view
    makes it contiguous, after which DDP, which laid out its gradient bucket by the
    old strides, computes wrong gradients: torch's ZeRO is left out there.)"""
    t = Trio(ctx.pg, "adam", bucket_view, net=dict(transposed=True), torch_zero=not bucket_view)
    w = t.models["cfsdp"].module.mid.weight
    assert w.stride() == (1, 24), w.stride()
    t.train(STEPS)
    t.check_same()
    t.check_state_dicts()


@h.subtest
def shared_bucket_rule(ctx):
    """[Note: ZeRO shared bucket]: the bucket views are one host-shared bucket where the
    rule says so (checked in ``parity`` too), and private buckets, with torch's numbers,
    where it does not: ranks whose initial values differ (against torch's ZeRO without
    DDP, which keeps each rank's values until the first step), ranks on emulated hosts
    (a host key per pair of ranks at 4 ranks: two levels; per rank at 2 and 3: the
    process group), a bucket file the peers cannot see (a directory per rank: a private
    /dev/shm), an optimizer whose step is not known to evaluate the closure first."""
    want = shared_expected(ctx.pg)
    t = Trio(ctx.pg, "cfsdp_adamw", True, net=dict(frozen=True))
    check_shared(t.opts["cfsdp"], want)
    t.train(2)
    t.check_same("shared: ")

    # initial values that differ between ranks
    cls, ours, kw, _ = OPTIMS["adamw"]
    models = {"torch": Net(), "cfsdp": Net()}
    with torch.no_grad():
        for m in models.values():
            m.mid.weight.add_(ctx.rank)
    opts = {"torch": TorchZeRO(models["torch"].parameters(), cls, process_group=ctx.pg,
                               parameters_as_bucket_view=True, **kw),
            "cfsdp": cfsdp.ZeroRedundancyOptimizer(models["cfsdp"].parameters(), ours,
                                                   process_group=ctx.pg,
                                                   parameters_as_bucket_view=True, **kw)}
    check_shared(opts["cfsdp"], False)
    for step in range(3):
        x, y = batch(ctx.rank, step)
        out = {}
        for n, m in models.items():
            opts[n].zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opts[n].step()
            out[n] = (loss.detach(), list(m.parameters()))
        same(f"differing initial values, step {step}", out["cfsdp"], out["torch"])

    # emulated hosts: 2 x 2 ranks at 4 ranks (two levels), else one rank per host
    real, host = comm._host_id, ctx.rank // 2 if ctx.world_size == 4 else ctx.rank
    comm._host_id = lambda: f"{real()}|emulated-host-{host}"
    try:
        pg = dist.new_group(list(range(ctx.world_size)), backend="gloo", timeout=h.PG_TIMEOUT)
        t = Trio(pg, "cfsdp_adamw", True, torch_zero=False)
    finally:
        comm._host_id = real
    check_shared(t.opts["cfsdp"], False)
    assert comm.describe(pg).startswith("two levels" if ctx.world_size == 4 else "process"), \
        comm.describe(pg)
    t.train(2)
    t.check_same("emulated hosts: ")

    # a bucket file each rank looks for in a directory of its own
    with tempfile.TemporaryDirectory(prefix="cfsdp-zero-test-") as d:
        old, _zero_buckets.SHM_DIR = _zero_buckets.SHM_DIR, d
        try:
            t = Trio(ctx.pg, "cfsdp_adamw", True, torch_zero=False)
        finally:
            _zero_buckets.SHM_DIR = old
        check_shared(t.opts["cfsdp"], False)
        assert os.listdir(d) == [], os.listdir(d)
    t.train(2)
    t.check_same("private directories: ")

    # a step that may re-evaluate the closure between writes (LBFGS), or unknown
    class OwnStep(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    for opt_cls in (torch.optim.LBFGS, OwnStep):
        z = cfsdp.ZeroRedundancyOptimizer(Net().parameters(), opt_cls, process_group=ctx.pg,
                                          parameters_as_bucket_view=True, lr=0.1)
        check_shared(z, False)
        assert z._share is None
    assert want == (cfsdp.ZeroRedundancyOptimizer(
        Net().parameters(), torch.optim.Adagrad, process_group=ctx.pg,
        parameters_as_bucket_view=True, lr=0.1)._share is not None)


# ------------------------------------------------------------------------ state dicts
@h.subtest(grid={"bucket_view": [False, True]})
def cross_load_with_torch(ctx, bucket_view):
    """Consolidated dicts saved after 2 steps, loaded after 4 (rewinding the optimizer
    state): torch's ZeRO loads cfsdp's dict, cfsdp's loads torch's, plain loads cfsdp's;
    the three then train on equal.  Loading sets the other ranks' entries to None, as
    torch's does."""
    t = Trio(ctx.pg, "cfsdp_adamw", bucket_view)
    t.train(2)
    saved, kept = {}, None
    for n in ("torch", "cfsdp"):
        t.opts[n].consolidate_state_dict(0)
        sd = t.opts[n].state_dict() if t.rank == 0 else None
        if n == "cfsdp":
            kept = sd
        # deepcopy: torch's dict holds the target's live state tensors (the next steps
        # change them); cfsdp's is a snapshot (checked below)
        saved[n] = bcast(copy.deepcopy(sd), ctx.pg)
    same("saved dicts", saved["cfsdp"], saved["torch"])
    t.train(2)
    if t.rank == 0:
        same("cfsdp's consolidated dict after 2 more steps", kept, saved["cfsdp"])
    given = {"torch": copy.deepcopy(saved["cfsdp"]), "cfsdp": copy.deepcopy(saved["torch"])}
    for n, d in given.items():
        t.opts[n].load_state_dict(d)
    t.opts["plain"].load_state_dict(copy.deepcopy(saved["cfsdp"]))
    nones = {n: sorted(i for i, v in d["state"].items() if v is None) for n, d in given.items()}
    assert nones["cfsdp"] == nones["torch"] and len(nones["cfsdp"]) > 0, nones
    t.train(3)
    t.check_same()
    t.check_state_dicts()


@h.subtest(grid={"bucket_view": [False, True]})
def load_at_half_world(ctx, bucket_view):
    """A dict consolidated at world W, loaded at world W // 2 (a group of the first
    ranks; at W = 2 a group of one): the loaded ZeRO re-consolidates to the same dict
    and trains on equal to plain DDP + AdamW that loaded it."""
    W = ctx.world_size
    t = Trio(ctx.pg, "cfsdp_adamw", bucket_view, torch_zero=False)
    t.train(3)
    t.opts["cfsdp"].consolidate_state_dict(0)
    saved = bcast(t.opts["cfsdp"].state_dict() if ctx.rank == 0 else None, ctx.pg)
    half = dist.new_group(list(range(max(1, W // 2))), backend="gloo", timeout=h.PG_TIMEOUT)
    if ctx.rank >= max(1, W // 2):
        return
    small = Trio(half, "cfsdp_adamw", bucket_view, torch_zero=False)
    for n in small.names:  # the same parameters as the trained model
        small.models[n].module.load_state_dict(t.models["cfsdp"].module.state_dict())
        small.opts[n].load_state_dict(copy.deepcopy(saved))
    small.opts["cfsdp"].consolidate_state_dict(0)
    if dist.get_rank(half) == 0:
        same("reconsolidated at half world", small.opts["cfsdp"].state_dict(), saved)
    small.step_no = 3
    small.train(3)
    small.check_same()


@h.subtest
def consolidation_misuse(ctx):
    """state_dict() before any consolidation, on a rank that was not the target, and
    after a ``to`` that is not a rank of the group: torch's RuntimeError and message."""
    W = ctx.world_size
    t = Trio(ctx.pg, "adam", False)
    t.train(1)
    tz, cz = t.opts["torch"], t.opts["cfsdp"]
    same_error(raises(cz.state_dict), raises(tz.state_dict))
    for o in (tz, cz):
        o.consolidate_state_dict(to=W)  # no error (torch moves everything to nobody)
    ours, theirs = raises(cz.state_dict), raises(tz.state_dict)
    same_error(ours, theirs)
    assert f"to={W}, which is not a rank" in str(ours), ours
    t.check_state_dicts()  # non-targets raise as torch's


# ------------------------------------------------------------------------- step API
@h.subtest(grid={"bucket_view": [False, True]})
def closure_kwargs_and_new_keys(ctx, bucket_view):
    """step(closure) returns the closure's loss; extra step kwargs reach the local
    optimizer; a key the local optimizer adds to its groups shows in param_groups;
    zero_grad sets every gradient to None (torch's tests, against torch's ZeRO)."""

    class SGDKwarg(torch.optim.SGD):
        def step(self, closure=None, kwarg=None):
            super().step()
            kwarg.append(5)
            self.param_groups[0]["new_key"] = 0.1

    out = {}
    for name, cls in (("torch", TorchZeRO), ("cfsdp", cfsdp.ZeroRedundancyOptimizer)):
        m = DDP(Net(), process_group=ctx.pg)
        o = cls(m.parameters(), torch.optim.SGD, process_group=ctx.pg,
                parameters_as_bucket_view=bucket_view, lr=0.1)
        x, y = batch(ctx.rank, 0)

        def closure():
            o.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            return loss

        loss = o.step(closure)
        o.zero_grad()
        assert all(p.grad is None for p in m.parameters())
        k = DDP(Net(), process_group=ctx.pg)
        ok = cls(k.parameters(), SGDKwarg, process_group=ctx.pg,
                 parameters_as_bucket_view=bucket_view, lr=0.1)
        F.mse_loss(k(x), y).backward()
        kwarg: list = []
        ok.step(kwarg=kwarg)
        assert kwarg == [5]
        out[name] = (loss.detach(), list(m.parameters()), list(k.parameters()),
                     ok.param_groups[0].get("new_key"))
    same("closure / kwargs / new key", out["cfsdp"], out["torch"])
    assert out["cfsdp"][3] == 0.1


@h.subtest
def constructor_errors(ctx):
    """Bad ``params``, functional optimizers, sparse parameters, ``overlap_with_ddp``:
    torch's exception types and messages (torch refuses overlap_with_ddp on gloo in its
    DDP hook; cfsdp at construction, with that message)."""
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim.utils import functional_optim_map

    m = Net()
    cases = [
        ([], {}),
        (torch.randn(3), {}),
        (1.2, {}),
        (list(m.parameters()) + [42], {}),
        ([{"lr": 0.1}], {}),
        ([torch.sparse_coo_tensor(size=(2, 3))], {}),
        (list(m.parameters()), dict(optimizer_class=functional_optim_map[torch.optim.SGD])),
        (list(m.parameters()), dict(optimizer_class=torch.optim.LBFGS, overlap_with_ddp=True)),
    ]
    for params, kw in cases:
        kw = {"optimizer_class": torch.optim.SGD, **kw}
        ours = raises(cfsdp.ZeroRedundancyOptimizer, params, process_group=ctx.pg, lr=0.1, **kw)
        theirs = raises(TorchZeRO, params, process_group=ctx.pg, lr=0.1, **kw)
        same_error(ours, theirs)
    ddp = DDP(Net(), process_group=ctx.pg)
    tz = TorchZeRO(ddp.parameters(), torch.optim.SGD, process_group=ctx.pg,
                   overlap_with_ddp=True, lr=0.1)
    theirs = raises(hook_with_zero_step, allreduce_hook, ddp, tz)
    ours = raises(cfsdp.ZeroRedundancyOptimizer, ddp.parameters(), torch.optim.SGD,
                  process_group=ctx.pg, overlap_with_ddp=True, lr=0.1)
    same_error(ours, theirs)
    assert "overlap_with_ddp=False" in str(ours)


# ------------------------------------------------------------------- duplicates
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


@h.subtest(grid={"layout": ["two_ranks", "same_rank", "thrice", "big_twice"],
                 "optim": ["sgd", "adam", "cfsdp_sgd", "cfsdp_adamw"], "bucket_view": [False, True]})
def duplicate_parameters(ctx, layout, optim, bucket_view):
    """A parameter listed twice (or three times) in one group: torch's Optimizer warns
    ("duplicate parameters") and keeps the copies; its ZeRO partitions them like any
    parameters, so each rank whose share holds a copy steps it (once per copy, the local
    optimizer's own duplicate), and the parameter sync decides which rank's result every
    rank gets.  cfsdp's ZeRO: the same warnings, parameters after every step, param_groups,
    local partition and consolidated state dict as torch's, bit for bit."""
    cls, ours, kw, _ = OPTIMS[optim]
    out = {}
    for name in ("torch", "cfsdp"):
        model = Net()
        ps = list(model.parameters())
        opt, msgs = _zero_of(name, _dup_params(layout, ps), cls if name == "torch" else ours,
                             ctx.pg, bucket_view, kw)
        where = {id(p): i for i, p in enumerate(ps)}
        seen = [[[where[id(p)] for p in g["params"]] for g in opt.param_groups],
                [[where[id(p)] for p in g["params"]] for g in opt.optim.param_groups]]
        values = []
        for step in range(3):
            _dup_grads(ps, step)
            opt.step()
            values.append([p.detach().clone() for p in ps])
        opt.consolidate_state_dict(0)
        sd = opt.state_dict() if ctx.rank == 0 else None
        out[name] = (msgs, seen, values, sd)
    (tm, ts, tv, tsd), (cm, cs, cv, csd) = out["torch"], out["cfsdp"]
    assert tm, "torch no longer warns about duplicate parameters: revisit this test"
    same("duplicate-parameter warnings", cm, tm)
    same("param_groups / local param_groups (parameter indices)", cs, ts)
    same("parameters after each step", cv, tv)
    if ctx.rank == 0:
        same("consolidated state dict", csd, tsd)


@h.subtest(grid={"how": ["two_groups", "add_param_group"], "bucket_view": [False, True]})
def duplicate_across_groups(ctx, how, bucket_view):
    """A parameter in two param groups: torch's Optimizer refuses it ("some parameters
    appear in more than one parameter group"), at construction and in add_param_group;
    cfsdp's ZeRO the same (and is left as it was: it still steps as torch's)."""
    errs, after = {}, {}
    for name, ctor in (("torch", TorchZeRO), ("cfsdp", cfsdp.ZeroRedundancyOptimizer)):
        model = Net()
        ps = list(model.parameters())
        if how == "two_groups":
            errs[name] = raises(ctor, [{"params": ps[:3]}, {"params": ps[2:]}], torch.optim.SGD,
                                process_group=ctx.pg, parameters_as_bucket_view=bucket_view, lr=0.1)
            continue
        opt = ctor(ps[:3], torch.optim.SGD, process_group=ctx.pg,
                   parameters_as_bucket_view=bucket_view, lr=0.1)
        errs[name] = raises(opt.add_param_group, {"params": ps[2:]})
        _dup_grads(ps, 0)
        opt.step()
        after[name] = [p.detach().clone() for p in ps]
    same_error(errs["cfsdp"], errs["torch"])
    if after:
        same("parameters after a step", after["cfsdp"], after["torch"])


# ------------------------------------------------------------------------------ Join
class _SetGrads(Joinable):
    """After joining, a rank must still set the gradients it would have had (torch's own
    Join test): this Joinable's hook sets them before the ZeRO hook steps."""

    def __init__(self, pg):
        super().__init__()
        self.pg = pg

    def join_hook(self, **kwargs) -> JoinHook:
        outer = kwargs["zero_params"], kwargs["grads"]

        class Hook(JoinHook):
            def __init__(self):
                self.i = 0

            def main_hook(self):
                params, grads = outer
                for p, g in zip(params, grads[self.i]):
                    p.grad = g.clone()
                self.i += 1

        return Hook()

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return self.pg


@h.subtest(grid={"bucket_view": [False, True]})
def join_uneven_inputs(ctx, bucket_view):
    """Rank r has 3 + r inputs per epoch (torch's Join test): the reference is DDP +
    Adam under DDP's join on the last rank; both ZeROs, under Join with a gradient
    setter, must follow its parameters bit for bit every iteration."""
    W, rank, epochs = ctx.world_size, ctx.rank, 2
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 3))
    g = torch.Generator().manual_seed(100 + rank)
    inputs = [torch.randn(20, 2, generator=g) for _ in range(3 + rank)]
    labels = torch.randn(20, 3, generator=torch.Generator().manual_seed(7))
    ddp = DDP(copy.deepcopy(base), process_group=ctx.pg)
    ref_opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    grads, params = [], []
    with ddp.join():
        for _ in range(epochs):
            for x in inputs:
                F.mse_loss(ddp(x), labels).backward()
                grads.append([p.grad.detach().clone() for p in ddp.parameters()])
                ref_opt.step()
                params.append([p.detach().clone() for p in ddp.parameters()])
    grads, params = bcast((grads, params), ctx.pg, src=W - 1)
    for cls in (TorchZeRO, cfsdp.ZeroRedundancyOptimizer):
        model = copy.deepcopy(base)
        zero = cls(model.parameters(), torch.optim.Adam, process_group=ctx.pg,
                   parameters_as_bucket_view=bucket_view, lr=0.01)
        setter = _SetGrads(ctx.pg)
        after = epochs * (W - 1 - rank)
        with Join([setter, zero], zero_params=list(model.parameters()),
                  grads=grads[len(grads) - after:]):
            it = 0
            for _ in range(epochs):
                for _x in inputs:
                    Join.notify_join_context(setter)
                    for p, gr in zip(model.parameters(), grads[it]):
                        p.grad = gr.clone()
                    zero.step()
                    same(f"{cls.__module__} iteration {it}", list(model.parameters()),
                         params[it])
                    it += 1


# ---------------------------------------------------------------------- ZeRO-2 hook
def close(what: str, a, b, W: int) -> None:
    """Bitwise at W = 2; at W = 3/4 the hook's sum runs in another order than DDP's
    all-reduce (and 1/3 is not exact): rtol 1e-5, atol 1e-6 (a few float32 roundings of
    values of order 1, through five Adam steps)."""
    if W == 2:
        same(what, a, b)
        return
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what}[{i}]: {m}")
        else:
            assert x == y, f"{what}[{i}]: {x!r} != {y!r}"


class Zero2:
    """plain DDP + AdamW against DDP + reduce_scatter_hook + cfsdp's ZeRO (cfsdp.optim.AdamW),
    DDP in buckets of about 1 KiB (several per pass, rebuilt after the first)."""

    def __init__(self, pg, bucket_view: bool, grad_view: bool, clip: bool = True):
        self.pg, self.rank, self.W, self.clip = pg, dist.get_rank(pg), dist.get_world_size(pg), clip
        kw = dict(process_group=pg, gradient_as_bucket_view=grad_view, bucket_cap_mb=0.001)
        self.plain_m, self.zero_m = DDP(Net(), **kw), DDP(Net(), **kw)
        _, _, okw, _ = OPTIMS["adamw"]
        self.plain = torch.optim.AdamW(groups(self.plain_m, True), **okw)
        self.zero = cfsdp.ZeroRedundancyOptimizer(groups(self.zero_m, True), co.AdamW,
                                                  process_group=pg,
                                                  parameters_as_bucket_view=bucket_view, **okw)
        self.zero_m.register_comm_hook(self.zero, co.reduce_scatter_hook)
        self.losses: dict = {"plain": [], "zero": []}

    def backward(self, name: str, x, y):
        m = self.plain_m if name == "plain" else self.zero_m
        loss = F.mse_loss(m(x), y)
        loss.backward()
        return loss.detach()

    def check_grads(self, what: str) -> None:
        owner = self.zero._param_to_rank
        for i, (p, q) in enumerate(zip(self.plain_m.parameters(), self.zero_m.parameters())):
            if owner[q] == self.rank:
                close(f"{what} owned grad {i}", [q.grad], [p.grad], self.W)
            else:
                assert q.grad is None, f"{what}: grad {i} of a parameter another rank owns"

    def step(self, step_no: int) -> None:
        if self.clip:
            norms = (torch.nn.utils.clip_grad_norm_(self.plain_m.parameters(), 0.5),
                     self.zero.clip_grad_norm_(0.5))
            close(f"step {step_no} grad norm", [norms[1]], [norms[0]], self.W)
        self.plain.step()
        self.zero.step()

    def check(self) -> None:
        close("losses", self.losses["zero"], self.losses["plain"], self.W)
        close("params", list(self.zero_m.parameters()), list(self.plain_m.parameters()), self.W)


@h.subtest(grid={"bucket_view": [False, True], "grad_view": [False, True]})
def hook_parity(ctx, bucket_view, grad_view):
    """ZeRO-2: after each backward a rank holds DDP's averaged gradients for the
    parameters it owns and None for the others; zero.clip_grad_norm_ equals torch's
    clip_grad_norm_ of the full gradients; losses, parameters and the consolidated state
    dicts equal plain DDP + AdamW's (see ``close`` for the tolerance at 3/4 ranks)."""
    z = Zero2(ctx.pg, bucket_view, grad_view)
    for step in range(STEPS):
        x, y = batch(ctx.rank, step)
        for name, opt in (("plain", z.plain), ("zero", z.zero)):
            opt.zero_grad(set_to_none=True)
            z.losses[name].append(z.backward(name, x, y))
        z.check_grads(f"step {step}")
        z.step(step)
    z.check()
    for to in range(ctx.world_size):
        z.zero.consolidate_state_dict(to)
        if ctx.rank == to:
            want, got = z.plain.state_dict(), z.zero.state_dict()
            same("state keys", sorted(got["state"]), sorted(want["state"]))
            for i in want["state"]:
                close(f"state {i}", list(got["state"][i].values()),
                      list(want["state"][i].values()), ctx.world_size)


@h.subtest(grid={"layout": ["two_ranks", "thrice", "big_twice"], "bucket_view": [False, True]})
def hook_duplicate_parameters(ctx, layout, bucket_view):
    """ZeRO-2 with a parameter listed twice (see duplicate_parameters): every rank that
    steps a copy gets its reduced gradient, so parameters and the consolidated state dict
    are torch's ZeRO-1's (DDP's gradients; ``close``'s tolerance at 3/4 ranks)."""
    kw = dict(process_group=ctx.pg, bucket_cap_mb=0.001)
    cls, _, okw, _ = OPTIMS["sgd"]
    out = {}
    for name in ("torch", "cfsdp"):
        model = DDP(Net(), **kw)
        opt, _ = _zero_of(name, _dup_params(layout, list(model.parameters())), cls, ctx.pg,
                          bucket_view, okw, record=False)
        if name == "cfsdp":
            model.register_comm_hook(opt, co.reduce_scatter_hook)
        values = []
        for step in range(3):
            x, y = batch(ctx.rank, step)
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            opt.step()
            values += [p.detach().clone() for p in model.parameters()]
        opt.consolidate_state_dict(0)
        out[name] = (values, opt.state_dict() if ctx.rank == 0 else None)
    close("parameters after each step", out["cfsdp"][0], out["torch"][0], ctx.world_size)
    if ctx.rank == 0:
        got, want = out["cfsdp"][1], out["torch"][1]
        same("state keys", sorted(got["state"]), sorted(want["state"]))
        for i in want["state"]:
            close(f"state {i}", list(got["state"][i].values()), list(want["state"][i].values()),
                  ctx.world_size)


@h.subtest
def hook_accumulation(ctx):
    """Two micro-batches under ddp.no_sync(), the third synchronised: equal to plain DDP
    doing the same.  A second synchronised backward before step()/zero_grad() raises."""
    z = Zero2(ctx.pg, True, False, clip=False)
    for step in range(3):
        for name, opt in (("plain", z.plain), ("zero", z.zero)):
            opt.zero_grad(set_to_none=True)
            m = z.plain_m if name == "plain" else z.zero_m
            for micro in range(3):
                x, y = batch(ctx.rank, 10 * step + micro)
                if micro < 2:
                    with m.no_sync():
                        z.backward(name, x, y)
                else:
                    z.losses[name].append(z.backward(name, x, y))
        z.check_grads(f"step {step}")
        z.step(step)
    z.check()
    x, y = batch(ctx.rank, 99)
    z.backward("zero", x, y)
    e = raises(z.backward, "zero", x, y)
    assert isinstance(e, RuntimeError) and "ddp.no_sync()" in str(e), e
    wrong = DDP(Net(), process_group=ctx.pg)  # registered with a state that is not the ZeRO
    wrong.register_comm_hook(None, co.reduce_scatter_hook)
    e = raises(lambda: F.mse_loss(wrong(x), y).backward())
    assert "register it with the cfsdp.optim.ZeroRedundancyOptimizer" in str(e), e


@h.subtest(grid={"bucket_view": [False, True]})
def hook_join_uneven_inputs(ctx, bucket_view):
    """ZeRO-2 under Join([ddp, zero]) with 3 + r inputs on rank r, no gradient-setting
    hook: a joined rank gets its owned gradients from DDP's shadow reductions through
    the hook and keeps stepping them.  The last rank's parameters follow plain DDP +
    AdamW under ddp.join() (whose joined ranks stop stepping); at the end every rank
    holds the same parameters."""
    W, rank = ctx.world_size, ctx.rank
    z = Zero2(ctx.pg, bucket_view, False, clip=False)
    inputs = [batch(rank, 50 + i) for i in range(3 + rank)]
    for name, opt, ctxm in (("plain", z.plain, z.plain_m.join()),
                            ("zero", z.zero, Join([z.zero_m, z.zero]))):
        with ctxm:
            for x, y in inputs:
                opt.zero_grad(set_to_none=True)
                z.losses[name].append(z.backward(name, x, y))
                opt.step()
    finals = [None] * W
    dist.all_gather_object(finals, [p.detach() for p in z.zero_m.parameters()], group=ctx.pg)
    for r in range(1, W):
        same(f"rank {r}'s parameters", finals[r], finals[0])
    if rank == W - 1:
        z.check()


# ------------------------------------------------------------------- process groups
@h.subtest(grid={"bucket_view": [False, True]})
def subgroup_without_rank_0(ctx, bucket_view):
    """A group of ranks 1..W-1 (group ranks differ from global ones; at W = 2 a group of
    one rank): parity of all three inside it."""
    W = ctx.world_size
    sub = dist.new_group(list(range(1, W)), backend="gloo", timeout=h.PG_TIMEOUT)
    if ctx.rank == 0:
        return
    t = Trio(sub, "cfsdp_adamw", bucket_view)
    t.train(STEPS)
    t.check_same()
    t.check_state_dicts()


if __name__ == "__main__":
    h.main()
