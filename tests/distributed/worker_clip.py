"""FullyShardedDataParallel.clip_grad_norm_: cfsdp against torch's FSDP1 (gloo, CPU).

Run by tests/distributed/test_clip.py under torchrun at W=2 and W=4; every subtest runs in
the one spawn (see _harness.py).

Two copies of the same model (same seed) are wrapped, by torch's FSDP1 (``device_id=cpu``,
the oracle) and by cfsdp with the same arguments, and trained on the same per-rank data for
STEPS steps of SGD-momentum with ``clip_grad_norm_`` between backward and the optimizer
step, every step.  Compared on every rank: the returned total norm of every step (value and
dtype), the loss of every step, the clipped gradients of the last step and the local
parameters at the end.  "clip" uses a max_norm far below the gradient norm (every step is
clipped: checked), "noclip" one far above it (no step is clipped: checked).

Tolerances (why they are what they are):

* p = inf: **bitwise** everywhere.  The local statistic is a max (exact in any order and
  dtype) and the MAX all-reduce is exact, so the norm, the clip coefficient (same float32 ops
  on the same value) and everything after it are torch's bits.
* no clipping (coefficient clamped to 1.0 in both): **bitwise** losses, gradients and
  parameters; the norm itself as below.
* p = 1, 2 with clipping: ``rtol=RTOL, atol=ATOL`` for norms, losses, gradients and
  parameters.  torch sums every gradient's |g|^p in float32 (rounding error growing with the
  gradient's size: worst case n * 2^-24, 6e-5 for the largest 1024-element gradient here;
  random-sign roundings stay near sqrt(n) ulps, observed <= 6e-7 relative) and combines the
  per-gradient norms and the per-rank partials in float32; cfsdp
  sums exact float64 terms in float64 (tests/unit/test_core_norm.py), so its norm is the
  exact one rounded once to float32.  The clip coefficients then differ by the same relative
  amount, the clipped gradients by that much relative to themselves, and SGD turns it into
  parameter differences of order lr * |g| * 1e-7 per step.  Observed worst ratios
  |a - b| / (ATOL + RTOL |b|) are printed by rank 0: <= 0.06 at W=2 and 4 with either
  backend (largest for p = 1), i.e. > 15x headroom over what torch's float32 sums do here.
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import _harness as h
from cfsdp import FullyShardedDataParallel as CFSDP

CPU = torch.device("cpu")
STEPS = 5
RTOL = 1e-5
ATOL = 1e-7
CLIP = {"clip": 0.01, "noclip": 1e4}
INF = math.inf

# --------------------------------------------------------------------------------------------
# models and data
# --------------------------------------------------------------------------------------------

D_IN, D, D_OUT, BATCH = 12, 16, 5, 4


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class Mlp(nn.Module):
    """Root unit (inp, head) + one unit per Block (auto-wrapped); ``head`` may be ignored."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.Sequential(Block(D), Block(D))
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


class Odd(nn.Module):
    """Odd numels (padding at W=2 and 4) and a unit smaller than W=4 (``tiny``: 3 elements,
    so at W=4 one rank's shard of it is all padding and, with use_orig_params=True, that
    rank has no gradient for it)."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(D_IN, 5)  # root: 65
        self.mid = nn.Sequential(nn.Linear(5, 3), nn.Tanh())  # unit: 18
        self.tiny = nn.Linear(3, 1, bias=False)  # unit: 3

    def forward(self, x):
        return self.tiny(self.mid(torch.relu(self.lin1(x)))).expand(-1, D_OUT)


def build(kind: str, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    m = Mlp() if kind == "mlp" else Odd()
    return m.to(dtype)


def wrap(wrapper, model: nn.Module, kind: str, **kw) -> nn.Module:
    if kind == "mlp":
        return wrapper(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)
    model.mid = wrapper(model.mid, **kw)
    model.tiny = wrapper(model.tiny, **kw)
    return wrapper(model, **kw)


def batches(rank: int, steps: int, dtype=torch.float32):
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        out.append((torch.randn(BATCH, D_IN, generator=g).to(dtype),
                    torch.randn(BATCH, D_OUT, generator=g).to(dtype)))
    return out


# --------------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------------


class Mismatches:
    def __init__(self, ctx: h.Context):
        self.ctx = ctx
        self.items: list[str] = []
        self.worst = 0.0  # max |a-b| / (ATOL + RTOL |b|) over inexact comparisons

    def check(self, cond: bool, msg: str) -> None:
        if not cond:
            self.items.append(msg)

    def tensors(self, what: str, a, b, exact: bool) -> None:
        if a is None or b is None:
            self.check(a is None and b is None, f"{what}: cfsdp {a is None=} torch {b is None=}")
            return
        if a.shape != b.shape or a.dtype != b.dtype:
            self.items.append(f"{what}: cfsdp {tuple(a.shape)} {a.dtype} != torch {tuple(b.shape)} {b.dtype}")
            return
        a, b = a.detach(), b.detach()
        if exact:
            ok = torch.equal(a, b)
        else:
            if a.numel():
                diff = (a.double() - b.double()).abs() / (ATOL + RTOL * b.double().abs())
                self.worst = max(self.worst, diff.max().item())
            ok = torch.allclose(a, b, rtol=RTOL, atol=ATOL)
        if not ok:
            d = (a.double() - b.double()).abs()
            i = int(d.flatten().argmax()) if a.numel() else 0
            self.items.append(
                f"{what}: {'not bitwise equal' if exact else 'not close'} (max |diff| "
                f"{d.max().item() if a.numel() else 0:.3e}; cfsdp {a.flatten()[i].item()!r} "
                f"torch {b.flatten()[i].item()!r})")

    def raise_if_any(self) -> None:
        if self.items:
            raise AssertionError(f"{len(self.items)} mismatch(es) on rank {self.ctx.rank}:\n  "
                                 + "\n  ".join(self.items[:25]))


def train(model, data, max_norm, norm_type, lr=0.2):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, norms, grads = [], [], []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x).float(), y.float())
        loss.backward()
        norms.append(model.clip_grad_norm_(max_norm, norm_type).detach().clone())
        grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
        opt.step()
        losses.append(loss.detach().clone())
    return losses, norms, grads


def run_clip_parity(ctx, kind: str, use_orig_params: bool, norm_type: float, clip: str,
                    dtype=torch.float32, **extra_kw) -> Mismatches:
    mm = Mismatches(ctx)
    base = build(kind, dtype)
    kw = dict(process_group=ctx.pg, use_orig_params=use_orig_params, device_id=CPU)
    ignored = extra_kw.pop("ignore_head", False)
    kw.update(extra_kw)
    models = []
    for wrapper in (TorchFSDP, CFSDP):
        m = copy.deepcopy(base)
        if ignored:
            kw["ignored_modules"] = [m.head]
        models.append(wrap(wrapper, m, kind, **kw))
    tmodel, cmodel = models
    data = batches(ctx.rank, STEPS, dtype)
    max_norm = CLIP[clip]
    t_losses, t_norms, t_grads = train(tmodel, data, max_norm, norm_type)
    c_losses, c_norms, c_grads = train(cmodel, data, max_norm, norm_type)

    exact = math.isinf(norm_type) or clip == "noclip"
    for s in range(STEPS):
        mm.tensors(f"total norm at step {s}", c_norms[s], t_norms[s], exact=math.isinf(norm_type))
        mm.tensors(f"loss at step {s}", c_losses[s], t_losses[s], exact=exact)
        tn = t_norms[s].item()
        if clip == "clip":
            mm.check(tn > 1.5 * max_norm, f"step {s}: torch's norm {tn} does not clip at {max_norm}")
        else:
            mm.check(tn < max_norm / 1.5, f"step {s}: torch's norm {tn} clips at {max_norm}")
    mm.check(len(c_grads) == len(t_grads), f"{len(c_grads)} grads vs torch {len(t_grads)}")
    for i, (a, b) in enumerate(zip(c_grads, t_grads)):
        mm.tensors(f"clipped grad of local parameter #{i} at the last step", a, b, exact=exact)
    for (n, p), (_, q) in zip(cmodel.named_parameters(), tmodel.named_parameters()):
        mm.tensors(f"local parameter {n} after {STEPS} steps", p, q, exact=exact)
    if ctx.rank == 0 and not exact:
        ctx.log(f"worst |cfsdp-torch|/(atol+rtol|torch|) = {mm.worst:.4f} (passes if <= 1)")
    return mm


# --------------------------------------------------------------------------------------------
# subtests
# --------------------------------------------------------------------------------------------


# "noclip" only with p = 2: once the coefficient clamps to 1.0 nothing after the norm depends
# on p (and the norm itself is compared in every "clip" case); this keeps W=4 fast.
CASES = {"p2-clip": (2.0, "clip"), "p2-noclip": (2.0, "noclip"), "p1-clip": (1.0, "clip"),
         "pinf-clip": (INF, "clip")}


@h.subtest(grid={"kind": ["mlp", "odd"], "use_orig_params": [False, True], "case": list(CASES)})
def parity(ctx, kind, use_orig_params, case):
    norm_type, clip = CASES[case]
    run_clip_parity(ctx, kind, use_orig_params, norm_type, clip).raise_if_any()


@h.subtest(grid={"strategy": ["SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"], "norm_type": [2.0, INF]})
def strategies(ctx, strategy, norm_type):
    """NO_SHARD gradients are replicated (counted once, like ignored ones); with HSDP the
    partial norms are summed over the shard group only (replicas hold equal copies)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import ShardingStrategy

    extra = {"sharding_strategy": ShardingStrategy[strategy]}
    if strategy == "HYBRID_SHARD":
        if ctx.world_size < 4:
            return
        extra.update(process_group=None, device_mesh=init_device_mesh("cpu", (2, ctx.world_size // 2)))
    run_clip_parity(ctx, "mlp", True, norm_type, "clip", **extra).raise_if_any()


@h.subtest(grid={"use_orig_params": [False, True], "norm_type": [2.0, INF]})
def ignored_module_with_grads(ctx, use_orig_params, norm_type):
    """``head`` is ignored: its grads are local to each rank (not reduced, so they differ
    between ranks) and counted once per rank; the ranks' total norms differ, as in torch."""
    mm = run_clip_parity(ctx, "mlp", use_orig_params, norm_type, "clip", ignore_head=True)
    mm.raise_if_any()


def test_bf16_model(ctx):
    """bf16 parameters and gradients: the norm is returned in bf16 (torch computes it in
    float32 and casts), the coefficient is cast to bf16 before the multiply."""
    run_clip_parity(ctx, "mlp", True, 2.0, "clip", dtype=torch.bfloat16).raise_if_any()


h.subtest(test_bf16_model, name="bf16_model")


@h.subtest(grid={"use_orig_params": [False, True]})
def non_root_call_raises(ctx, use_orig_params):
    mm = Mismatches(ctx)
    kw = dict(process_group=ctx.pg, use_orig_params=use_orig_params, device_id=CPU)
    x, y = batches(ctx.rank, 1)[0]
    for wrapper in (TorchFSDP, CFSDP):  # torch's behaviour is checked too: it is the spec
        model = wrap(wrapper, build("mlp"), "mlp", **kw)
        F.mse_loss(model(x), y).backward()
        try:
            model.blocks[0].clip_grad_norm_(1.0)
        except RuntimeError as e:
            mm.check("should only be called on the root FSDP instance" in str(e),
                     f"{wrapper.__module__}: message {e}")
        else:
            mm.check(False, f"{wrapper.__module__}: non-root clip_grad_norm_ did not raise")
        # the root still works afterwards (nothing half-done)
        mm.check(model.clip_grad_norm_(1e4).item() > 0, f"{wrapper.__module__}: root norm")
    mm.raise_if_any()


@h.subtest(grid={"use_orig_params": [False, True]})
def before_any_forward_and_without_grads(ctx, use_orig_params):
    """On the root before the first forward (lazy init happens in clip_grad_norm_), and after
    a forward with no backward: no gradients anywhere, so torch warns and returns a float32
    zero; training afterwards is unaffected."""
    mm = Mismatches(ctx)
    kw = dict(process_group=ctx.pg, use_orig_params=use_orig_params, device_id=CPU)
    base = build("odd")
    results = []
    for wrapper in (TorchFSDP, CFSDP):
        model = wrap(wrapper, copy.deepcopy(base), "odd", **kw)
        rec = []
        for stage in ("before forward", "after forward"):
            if stage == "after forward":
                model(batches(ctx.rank, 1)[0][0])
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                n = model.clip_grad_norm_(1.0, 2.0)
            msgs = [str(i.message) for i in w if "with no gradients" in str(i.message)]
            mm.check(len(msgs) == 1, f"{wrapper.__module__} {stage}: warnings {[str(i.message) for i in w]}")
            rec.append(n)
        rec.extend(train(model, batches(ctx.rank, 2), 0.05, 2.0)[1])
        results.append(rec)
    t, c = results
    for i, (a, b) in enumerate(zip(c, t)):
        mm.tensors(f"norm #{i}", a, b, exact=i < 2)
    mm.check(c[0].item() == 0.0 and c[0].dtype == torch.float32, f"norm before forward {c[0]}")
    mm.raise_if_any()


def norm_type_zero(ctx):
    """norm_type=0 has no 1/p root: torch raises ZeroDivisionError (after its all-reduce),
    cfsdp raises it before any collective."""
    mm = Mismatches(ctx)
    kw = dict(process_group=ctx.pg, device_id=CPU)
    x, y = batches(ctx.rank, 1)[0]
    for wrapper in (TorchFSDP, CFSDP):
        model = wrap(wrapper, build("odd"), "odd", **kw)
        F.mse_loss(model(x), y).backward()
        try:
            model.clip_grad_norm_(1.0, 0)
        except ZeroDivisionError:
            pass
        else:
            mm.check(False, f"{wrapper.__module__}: norm_type=0 did not raise ZeroDivisionError")
    mm.raise_if_any()


h.subtest(norm_type_zero, name="norm_type_zero")


def unsupported_norm_types(ctx):
    """Negative, -inf and NaN norm types: NotImplementedError naming norm_type (torch returns
    meaningless numbers, e.g. always 1.0 for -inf), raised before any collective."""
    x, y = batches(ctx.rank, 1)[0]
    model = wrap(CFSDP, build("odd"), "odd", process_group=ctx.pg)
    F.mse_loss(model(x), y).backward()
    for p in (-1.0, -INF, math.nan):
        try:
            model.clip_grad_norm_(1.0, p)
        except NotImplementedError as e:
            assert "norm_type" in str(e), e
        else:
            raise AssertionError(f"norm_type={p} did not raise")
    assert model.clip_grad_norm_(1e4, 2.0).item() > 0  # still usable


h.subtest(unsupported_norm_types, name="unsupported_norm_types")


if __name__ == "__main__":
    h.main()
