"""Training parity with torch's ZeroRedundancyOptimizer and plain DDP + optimizer: every
optimizer, both bucket modes, param groups added later, trainability and parameter changes,
mixed dtypes, the staged sync, a transposed parameter, cfsdp.optim.Muon."""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

import _harness as h
import cfsdp
from cfsdp.optim import _zero_buckets
from zero.common import check_shared, fused, Net, OPTIMS, raises, shared_expected, STEPS, Trio


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
def muon(ctx):
    """cfsdp.optim.Muon inside cfsdp's ZeRO (bucket views): each rank steps its own whole
    matrices, so each is orthogonalized once, by the rank that owns it, against plain DDP +
    torch.optim.Muon (one optimizer over every matrix, on the same gradients: what a single
    process on the global batch steps) and torch's ZeRO with torch.optim.Muon: losses,
    parameters, LR schedule and the consolidated state dicts bit for bit.  Muon trains the
    2-D weights; biases and the norm keep their values."""
    spec = (torch.optim.Muon, cfsdp.optim.Muon,
            dict(lr=0.02, weight_decay=0.05, momentum=0.9, nesterov=True), False)
    t = Trio(ctx.pg, spec, True,
             select=lambda m: [p for p in m.parameters() if p.ndim == 2])
    assert type(t.opts["cfsdp"].optim) is cfsdp.optim.Muon
    t.train(STEPS)
    t.check_same()
    assert t.local_indices("cfsdp") == t.local_indices("torch"), "partition differs from torch's"
    t.check_state_dicts()
