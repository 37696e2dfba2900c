"""torch's private FSDP names that trainers touch (cfsdp/_internals.py, README "torch's private
FSDP names"): the ones cfsdp supports against torch's FSDP1 / FSDP2, and the AttributeError of
the others.

Run by tests/distributed/test_internals.py under torchrun (gloo, CPU) at W=2; every subtest in
one spawn (see _harness.py).  Oracle: torch's FSDP1 (``device_id=cpu``) and FSDP2 on the same
model, seed and per-rank data; values, losses and parameters compared bit for bit.

* FSDP1: ``_has_params``, ``_is_root`` (read before and after the first forward, and set as
  verl does after a ``summon_full_params`` on a submodule), ``_handle`` (``flat_param``,
  ``_offload_params``, ``_orig_param_dtype``, ``reshard``), ``_flat_param._fqns`` (accelerate),
  and accelerate's upcast of a low-precision model under mixed precision (its
  ``prepare_model`` snippet, run unchanged on both).
* FSDP2: ``_get_fsdp_state()`` (``fully_shard.state``), the state's ``_is_root`` and
  ``_lazy_init()``, ``_set_unshard_async_op`` with explicit forward prefetching.
* every name cfsdp answers with an AttributeError: torch's object has it (so the table names
  real internals of the installed torch), cfsdp's error says ``cfsdp`` and names it.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffload, MixedPrecision
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import _harness as h
import cfsdp
from cfsdp import _internals
from cfsdp._torch import at_least
from cfsdp import FullyShardedDataParallel as CFSDP

CPU = torch.device("cpu")
STEPS = 3


class Block(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    """An input layer, two blocks, two projections sharing one weight (so the root's unit holds
    a tied parameter) and a head."""

    def __init__(self, d: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(5, d, bias=False)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.proj = nn.Linear(d, d, bias=False)
        self.proj2 = nn.Linear(d, d, bias=False)
        self.proj2.weight = self.proj.weight
        self.out = nn.Linear(d, 5)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h + self.proj2(F.gelu(self.proj(h))))


def batch(rank: int, step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=g).to(dtype), torch.randn(4, 5, generator=g).to(dtype)


def wrap1(wrapper, ctx, model: nn.Module, **kw) -> nn.Module:
    """Nested by hand: block 0 checkpoint-wrapped inside its unit, block 1 a unit, the root
    holding the input layer and the head."""
    kw = dict(process_group=ctx.pg, device_id=CPU, **kw)
    model.blocks[0] = wrapper(checkpoint_wrapper(model.blocks[0]), **kw)
    model.blocks[1] = wrapper(model.blocks[1], **kw)
    return wrapper(model, **kw)


def pair1(ctx, **kw):
    base = Net()
    return {name: wrap1(w, ctx, copy.deepcopy(base), **kw)
            for name, w in (("torch", TorchFSDP), ("cfsdp", CFSDP))}


def train(ctx, model, opt, steps: int = STEPS, dtype=torch.float32) -> list[torch.Tensor]:
    losses = []
    for s in range(steps):
        x, y = batch(ctx.rank, s, dtype)
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x).float(), y.float())
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def same(what: str, a, b) -> None:
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{what}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(f"{what}[{i}]", x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{what}: cfsdp {a.dtype}{tuple(a.shape)} vs torch {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a.detach(), b.detach()), f"{what}: values differ"
    else:
        assert a == b, f"{what}: cfsdp {a!r} vs torch {b!r}"


def wrappers(models: dict) -> dict:
    """Each face's wrappers, in the same (module) order."""
    return {"torch": TorchFSDP.fsdp_modules(models["torch"]),
            "cfsdp": CFSDP.fsdp_modules(models["cfsdp"])}


def full_params(model, wrapper) -> list[torch.Tensor]:
    with wrapper.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------------------ FSDP1
@h.subtest(grid={"uop": [False, True]})
def fsdp1_handle_and_names(ctx, uop):
    """``_is_root`` (None, then the root's True and the others' False), ``_has_params``,
    ``_handle`` (None without parameters; ``flat_param`` is ``_flat_param``, this rank's
    shard, equal to torch's; ``_offload_params``; ``_orig_param_dtype``), ``_flat_param._fqns``
    (the checkpoint wrapper's prefix kept, the tied head's weight given once)."""
    models = pair1(ctx, use_orig_params=uop)
    ws = wrappers(models)
    assert len(ws["torch"]) == len(ws["cfsdp"]) == 3
    for t, c in zip(ws["torch"], ws["cfsdp"]):
        same("_is_root before the first forward", c._is_root, t._is_root)
        same("_has_params", c._has_params, t._has_params)
        assert (c._handle is None) == (t._handle is None) == (not t._has_params)
        assert c._handle is c._handle
        same("_fqns", c._flat_param._fqns, tuple(t._flat_param._fqns))
        assert c._handle.flat_param is c._flat_param and t._handle.flat_param is t._flat_param
        same("flat_param (this rank's shard)", c._handle.flat_param, t._handle.flat_param)
        same("_offload_params", c._handle._offload_params, t._handle._offload_params)
        same("_orig_param_dtype", c._handle._orig_param_dtype, t._handle._orig_param_dtype)
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.1) for n, m in models.items()}
    losses = {n: train(ctx, m, opts[n]) for n, m in models.items()}
    same("losses", losses["cfsdp"], losses["torch"])
    for t, c in zip(ws["torch"], ws["cfsdp"]):
        same("_is_root after the first forward", c._is_root, t._is_root)
        same("flat_param after training", c._handle.flat_param, t._handle.flat_param)
    # a wrapper that manages no parameters of its own
    base = nn.Sequential(Block(), Block())
    empty = {}
    for name, w in (("torch", TorchFSDP), ("cfsdp", CFSDP)):
        m = copy.deepcopy(base)
        m[0], m[1] = (w(b, process_group=ctx.pg, device_id=CPU) for b in m)
        empty[name] = w(m, process_group=ctx.pg, device_id=CPU)
    same("_has_params without parameters", empty["cfsdp"]._has_params, empty["torch"]._has_params)
    assert empty["torch"]._handle is None and empty["cfsdp"]._handle is None


@h.subtest(grid={"uop": [False, True]})
def fsdp1_reshard_after_no_grad_forward(ctx, uop):
    """verl's pattern: a ``no_grad`` forward of the root (torch keeps the root's unsharded
    parameters), ``root._handle.reshard(True)``, then training: the root's flat parameter is
    this rank's shard again on both, and the losses are torch's."""
    models = pair1(ctx, use_orig_params=uop)
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-2) for n, m in models.items()}
    losses = {}
    for name, m in models.items():
        shard_numel = m._flat_param.numel()
        with torch.no_grad():
            m(batch(ctx.rank, 9)[0])
        m._handle.reshard(True)
        assert m._flat_param.numel() == shard_numel, (name, m._flat_param.numel(), shard_numel)
        losses[name] = train(ctx, m, opts[name])
        with torch.no_grad():
            m(batch(ctx.rank, 9)[0])
        m._handle.reshard(False)
        losses[name] += train(ctx, m, opts[name])
    same("losses", losses["cfsdp"], losses["torch"])
    same("full parameters", full_params(models["cfsdp"], CFSDP), full_params(models["torch"], TorchFSDP))


@h.subtest(grid={"uop": [False, True]})
def fsdp1_is_root_reset_after_summon(ctx, uop):
    """verl's pattern: ``summon_full_params(block, writeback=False)`` before the model's first
    forward makes the block's wrapper a root (torch's lazy init), verl sets ``_is_root =
    False`` on it (torch's root lazy init asserts otherwise), then trains: the same losses."""
    models = pair1(ctx, use_orig_params=uop)
    for name, m in models.items():
        w = TorchFSDP if name == "torch" else CFSDP
        sub = m.blocks[1]
        with w.summon_full_params(sub, writeback=False):
            pass
        assert sub._is_root is True, (name, sub._is_root)
        sub._is_root = False
        assert sub._is_root is False
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for n, m in models.items()}
    losses = {n: train(ctx, m, opts[n]) for n, m in models.items()}
    same("losses", losses["cfsdp"], losses["torch"])
    same("_is_root of the root", models["cfsdp"]._is_root, models["torch"]._is_root)
    try:
        models["cfsdp"].blocks[1]._is_root = 1
    except TypeError as e:
        assert "_is_root" in str(e), e
    else:
        raise AssertionError("_is_root = 1 was accepted")


@h.subtest(grid={"uop": [False, True], "mp": [True, False]})
def fsdp1_accelerate_upcast(ctx, uop, mp):
    """accelerate 1.15's ``prepare_model`` for FSDP1 with mixed precision on, run unchanged on
    both (its loop over ``FSDP.fsdp_modules``: ``_has_params``, ``_flat_param``,
    ``_flat_param._fqns``, ``param.data = param.data.to(float32)``,
    ``_handle._orig_param_dtype = float32``) on a model loaded in bfloat16, with accelerate's
    MixedPrecision policy for bf16 or without one (the plugin's policy unset): the flat
    parameters become float32 shards, the units still compute and reduce in bfloat16 (torch's
    lazy init keeps the dtypes, as ``_orig_param_dtype`` now matches the data), and the
    losses and full parameters are torch's."""
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                        buffer_dtype=torch.bfloat16) if mp else None
    base = Net().to(torch.bfloat16)
    models = {name: wrap1(w, ctx, copy.deepcopy(base), use_orig_params=uop, mixed_precision=mp)
              for name, w in (("torch", TorchFSDP), ("cfsdp", CFSDP))}
    logs = {}
    for name, model in models.items():
        fsdp = TorchFSDP if name == "torch" else CFSDP
        upcasted_log = []
        for module in fsdp.fsdp_modules(model):  # accelerate/accelerator.py, prepare_model
            if not module._has_params:
                continue
            param = module._flat_param
            if param.dtype != torch.float32 and param.device != torch.device("meta") and param.requires_grad:
                name_param_log = (module.module.__class__.__name__, ", ".join(module._flat_param._fqns))
                if name_param_log not in upcasted_log:
                    upcasted_log.append(name_param_log)
                param.data = param.data.to(torch.float32)
                module._handle._orig_param_dtype = torch.float32
        logs[name] = upcasted_log
        for module in fsdp.fsdp_modules(model):
            assert module._flat_param.dtype == torch.float32, (name, module._flat_param.dtype)
    same("accelerate's log of upcast units", logs["cfsdp"], logs["torch"])
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-2) for n, m in models.items()}
    losses = {n: train(ctx, m, opts[n], dtype=torch.bfloat16) for n, m in models.items()}
    same("losses", losses["cfsdp"], losses["torch"])
    same("full parameters", full_params(models["cfsdp"], CFSDP), full_params(models["torch"], TorchFSDP))
    # a dtype the flat parameter does not hold
    w = CFSDP.fsdp_modules(models["cfsdp"])[0]
    try:
        w._handle._orig_param_dtype = torch.float64
    except ValueError as e:
        assert "_orig_param_dtype" in str(e) and "float64" in str(e), e
    else:
        raise AssertionError("_orig_param_dtype = float64 was accepted on a float32 unit")


# ------------------------------------------------------------------------------ FSDP2
def pair2(ctx):
    base = Net()
    models = {}
    for name, fs in (("torch", torch_fully_shard), ("cfsdp", cfsdp.fully_shard)):
        m = copy.deepcopy(base)
        for b in m.blocks:
            fs(b)
        fs(m)
        models[name] = m
    return models


@h.subtest
def fsdp2_state(ctx):
    """``_get_fsdp_state()`` is ``fully_shard.state(m)``; its ``_is_root`` is None until
    ``_lazy_init()`` on the root's state, then True there and False below, as torch's."""
    models = pair2(ctx)
    fs = {"torch": torch_fully_shard, "cfsdp": cfsdp.fully_shard}
    for name, m in models.items():
        assert m._get_fsdp_state() is fs[name].state(m), name
        assert m.blocks[0]._get_fsdp_state() is fs[name].state(m.blocks[0]), name
    states = {n: [m._get_fsdp_state()] + [b._get_fsdp_state() for b in m.blocks]
              for n, m in models.items()}
    same("_is_root before", [s._is_root for s in states["cfsdp"]], [s._is_root for s in states["torch"]])
    for n in models:
        states[n][0]._lazy_init()
        states[n][0]._lazy_init()  # a no-op once initialised
    same("_is_root after _lazy_init", [s._is_root for s in states["cfsdp"]],
         [s._is_root for s in states["torch"]])
    assert [s._is_root for s in states["cfsdp"]] == [True, False, False]
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.1) for n, m in models.items()}
    losses = {n: train(ctx, m, opts[n]) for n, m in models.items()}
    same("losses", losses["cfsdp"], losses["torch"])


@h.subtest(grid={"async_op": [True, False]})
def fsdp2_unshard_async_op(ctx, async_op):
    """``_set_unshard_async_op`` on the root (every ``fully_shard`` module below it) with
    explicit forward and backward prefetching, as torch documents its use: losses and the
    local shards are torch's; each state below records the value."""
    models = pair2(ctx)
    for name, m in models.items():
        m._set_unshard_async_op(async_op)
        m.blocks[0].set_modules_to_forward_prefetch([m.blocks[1]])
        m.blocks[1].set_modules_to_backward_prefetch([m.blocks[0]])
    assert all(b._get_fsdp_state().unshard_async_op is async_op
               for b in [models["cfsdp"], *models["cfsdp"].blocks])
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-2) for n, m in models.items()}
    losses = {n: train(ctx, m, opts[n]) for n, m in models.items()}
    same("losses", losses["cfsdp"], losses["torch"])
    same("local shards", [p.to_local() for p in models["cfsdp"].parameters()],
         [p.to_local() for p in models["torch"].parameters()])


# ------------------------------------------------------------------------------ the rest
def _refused(obj, name: str, torch_object: str) -> None:
    try:
        getattr(obj, name)
    except AttributeError as e:
        msg = str(e)
        assert msg.startswith(f"'{type(obj).__name__}' object has no attribute '{name}'"), msg
        assert "(cfsdp:" in msg and f"torch's {torch_object}" in msg, msg
    else:
        raise AssertionError(f"cfsdp's {type(obj).__name__} answered {name}")
    assert not hasattr(obj, name)


@h.subtest
def torch_internals_refused(ctx):
    """Every name of cfsdp/_internals.py's tables is an attribute of torch's object (FSDP1
    wrapper after its first forward, its FlatParamHandle, FSDP2's FSDPState), and cfsdp's
    object raises its AttributeError for it; a name that is no torch internal keeps the
    wrapped module's plain error."""
    models = pair1(ctx)
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.1) for n, m in models.items()}
    for n, m in models.items():
        train(ctx, m, opts[n], steps=1)
    t, c = models["torch"], models["cfsdp"]
    for name in _internals.FSDP1:
        assert hasattr(t, name), f"torch's FullyShardedDataParallel has no {name}"
        _refused(c, name, "FullyShardedDataParallel")
    for name in list(_internals.HANDLE) + ["_fully_sharded_module"]:
        assert hasattr(t._handle, name), f"torch's FlatParamHandle has no {name}"
        _refused(c._handle, name, "FlatParamHandle")
    try:
        c._not_an_fsdp_name
    except AttributeError as e:
        assert "cfsdp" not in str(e) and "'Net' object" in str(e), e
    models2 = pair2(ctx)
    for n, m in models2.items():
        train(ctx, m, torch.optim.SGD(m.parameters(), lr=0.1), steps=1)
    ts, cs = models2["torch"]._get_fsdp_state(), models2["cfsdp"]._get_fsdp_state()
    for name in _internals.STATE:
        # torch 2.11's FSDPState has one _fsdp_param_group (the plural came with 2.13)
        newer = name == "_fsdp_param_groups" and not at_least(2, 12)
        assert hasattr(ts, name) != newer, f"torch's FSDPState: {name} {hasattr(ts, name)}"
        _refused(cs, name, "FSDPState")
    _refused(cs, "_modules", "FSDPState")


if __name__ == "__main__":
    h.main()
