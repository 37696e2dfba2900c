"""use_orig_params=True: writes to the original parameters inside no_sync(), and what the modules
show of their parameters (attributes, types, shapes, gradients) as torch FSDP1 shows it."""

from __future__ import annotations

import contextlib
from typing import Any
import copy

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as SS
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import _harness as h
from cfsdp import FullyShardedDataParallel as CFSDP
from parity_common import CPU, LOSSES, Mismatches, make_batches, make_optim
from strategies.common import GRID_STRATEGIES, HYBRID, _orig_params_model, _written, groups_kw


def _attributes(model: nn.Module) -> list[tuple]:
    """What every module shows of each of its registered parameters: whether the attribute is
    the registered object, the attribute's type and shape, the registered one's gradient's
    shape (None without one; a view registered during forward has none)."""
    out = []
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is None:
                continue
            a = getattr(mod, name)
            g = p.grad if p.is_leaf else None
            out.append((a is p, type(a).__name__, tuple(a.shape), None if g is None else tuple(g.shape)))
    return out


def _list_diff(a: list, b: list) -> str:
    """Where two recorded lists differ (for a readable mismatch)."""
    if len(a) != len(b):
        return f"{len(a)} entries != torch {len(b)}"
    return "; ".join(f"#{i}: {x} != torch {y}" for i, (x, y) in enumerate(zip(a, b)) if x != y)


NO_SYNC_WRITES = ["data", "data_state_dict", "grad_inplace", "grad_none"]


def _no_sync_write(model: nn.Module, write: str) -> None:
    """One write to each WRITTEN parameter, reached through module attributes."""
    for mod, name in _written(model):
        p = getattr(mod, name)
        if write.startswith("data"):
            p.data = p.data * 0.5 + 0.25
        elif write == "grad_inplace":
            if p.grad is not None:
                p.grad.mul_(3)
        else:
            p.grad = None


@h.subtest(grid={"strategy": GRID_STRATEGIES, "write": NO_SYNC_WRITES})
def writes_inside_no_sync(ctx, strategy, write: str):
    """use_orig_params=True, writes to original parameters inside no_sync(), made after the first
    of three micro-batches (reaching them through module attributes, as a user does) on steps 0
    and 1 of 3:

    * ``data``: ``p.data = p.data * 0.5 + 0.25``, carried into the shard before the next
      unshard, as torch FSDP1's ``_writeback_orig_params``.  A unit no_sync() keeps unsharded
      (SHARD_GRAD_OP, _HYBRID_SHARD_ZERO2) computes the rest of the step with the parameters it
      holds, as torch's: the write shows from the next all-gather, after the synchronising
      backward ([Note: kept unsharded units] in _runtime/flat/lifecycle.py);
    * ``data_state_dict``: the same, then a FULL state dict: a kept unit gives the values it
      holds and keeps them, as torch's;
    * ``grad_inplace``: ``p.grad.mul_(3)`` on no_sync's unsharded gradient (each parameter's
      ``.grad`` is a full-shape view of it, as torch's);
    * ``grad_none``: ``p.grad = None`` for these parameters only: their accumulated gradient
      restarts from zero, on every rank.

    Bitwise torch's every micro-batch (losses, gradients after each backward, what each module
    attribute is after each forward and backward), parameters and state dict at the end.  For
    ``grad_none`` torch is wrong, so the oracle of the values is the single process on the global
    batch (REF tolerances), and the attributes are torch's: with a sharded strategy torch zeroes
    ``[offset_in_shard, + numel_in_shard)`` of the unsharded gradient, not the parameter's range,
    and nothing on a rank that holds no element of the parameter; with NO_SHARD (the right range)
    its ``_is_grad_none_mask`` hides the gradient again after every forward until a synchronising
    backward, and the next pre-unshard (the pre-backward's) takes that None for a new write and
    zeroes the gradient again, dropping the micro-batches between (asserted below, so that a
    torch fix is noticed).  cfsdp shows the accumulated gradient after those forwards: the
    attributes' gradient column is not compared there."""
    if strategy in HYBRID and ctx.world_size < 4:
        return
    mm = Mismatches(ctx)
    base, kw = _orig_params_model(ctx, strategy)
    W, r, micro = ctx.world_size, ctx.rank, 3
    batches = make_batches("transformer", micro * W, steps=3)  # chunk micro*r+m: rank r's m-th
    loss_fn = LOSSES["transformer"]
    record = []
    for wrapper in (TorchFSDP, CFSDP):
        model = wrapper(copy.deepcopy(base), **kw)
        opt = make_optim("sgd", model.parameters())
        seen: dict[str, Any] = {}
        for step, chunks in enumerate(batches):
            opt.zero_grad(set_to_none=True)
            for m in range(micro):
                with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    x, y = chunks[micro * r + m]
                    loss = loss_fn(model(x), y)
                    seen[f"step {step}: attributes after forward {m}"] = _attributes(model)
                    loss.backward()
                    seen[f"step {step}: loss {m}"] = loss.detach().clone()
                    seen[f"step {step}: attributes after backward {m}"] = _attributes(model)
                    for i, p in enumerate(model.parameters()):
                        seen[f"step {step}: grad #{i} after backward {m}"] = (
                            None if p.grad is None else p.grad.detach().clone())
                    if m == 0 and step < 2:
                        _no_sync_write(model, write)
                        if write == "data_state_dict":
                            for k, v in model.state_dict().items():
                                seen[f"step {step}: state_dict[{k}] after the write"] = v
            opt.step()
        for i, p in enumerate(model.parameters()):
            seen[f"local parameter #{i} at the end"] = p.detach().clone()
        for k, v in model.state_dict().items():
            seen[f"state_dict[{k}] at the end"] = v
        record.append(seen)
    ts, cs = record
    torch_right = write != "grad_none"
    mm.check(list(cs) == list(ts), f"recorded {list(cs)} != torch {list(ts)}")
    for k, b in ts.items():
        a = cs.get(k)
        if isinstance(b, list):
            if not torch_right and strategy is SS.NO_SHARD and "after forward" in k:
                a, b = [x[:3] for x in a or []], [x[:3] for x in b]  # torch's mask: see above
            mm.check(a == b, f"{k}: {_list_diff(a or [], b)}")
        elif torch_right:
            mm.tensors(k, a, b)
    if write == "grad_none":
        ref = copy.deepcopy(base)
        opt = make_optim("sgd", ref.parameters())
        for step, chunks in enumerate(batches):
            opt.zero_grad(set_to_none=True)
            for m in range(micro):
                (torch.stack([loss_fn(ref(x), y) for x, y in chunks[m::micro]]).sum() / W).backward()
                if m == 0 and step < 2:
                    _no_sync_write(ref, write)
            opt.step()
        torch_vs_ref = Mismatches(ctx)
        for k, v in ref.state_dict().items():
            mm.tensors(f"cfsdp-vs-ref state_dict[{k}] at the end", cs.get(f"state_dict[{k}] at the end"),
                       v, exact=False, b_name="ref")
            torch_vs_ref.tensors(k, ts.get(f"state_dict[{k}] at the end"), v, exact=False)
        mm.check(bool(torch_vs_ref.items),
                 "torch FSDP1 now matches the single process after p.grad = None inside no_sync(): "
                 "compare cfsdp with torch bitwise here")
    mm.raise_if_any()


@h.subtest(grid={"strategy": GRID_STRATEGIES})
def orig_param_attributes(ctx, strategy):
    """use_orig_params=True: what the modules show, as torch FSDP1 shows it, after a training
    forward (the root and NO_SHARD units stay unsharded but show their registered parameters;
    SHARD_GRAD_OP / _HYBRID_SHARD_ZERO2 keep the forward's views, registered too, until
    backward), after a synchronising and a no_sync() backward (every unit: the registered
    parameters), inside and after summon_full_params, after forwards under torch.no_grad (train
    and eval) and after a state dict; and inside forward, where ``module.parameters()`` gives
    the forward's views: a regularizer computed from them in a forward hook trains as torch's
    (losses, gradients, parameters bitwise)."""
    if strategy in HYBRID and ctx.world_size < 4:
        return
    mm = Mismatches(ctx)
    base, kw = _orig_params_model(ctx, strategy)
    batches = make_batches("transformer", ctx.world_size, steps=3)
    loss_fn = LOSSES["transformer"]
    record = []
    for wrapper in (TorchFSDP, CFSDP):
        model = wrapper(copy.deepcopy(base), **kw)
        inner = model.module
        hooked = [inner.ln_f, *(blk.module.mlp if isinstance(blk, wrapper) else blk.mlp
                                for blk in inner.blocks)]
        reg: list = []
        shown: list = []

        def hook(mod, args, out, _reg=reg, _shown=shown):
            _shown.append([(type(p).__name__, tuple(p.shape)) for p in mod.parameters()])
            _reg.append(sum((p * p).sum() for p in mod.parameters()))

        for mod in hooked:
            mod.register_forward_hook(hook)
        opt = make_optim("sgd", model.parameters())
        seen: dict[str, Any] = {}

        def train(what: str, x, y) -> None:
            reg.clear()
            shown.clear()
            loss = loss_fn(model(x), y) + 1e-3 * sum(reg)
            seen[f"{what}: parameters() in forward"] = list(shown)
            seen[f"{what}: attributes after forward"] = _attributes(model)
            loss.backward()
            seen[f"{what}: loss"] = loss.detach().clone()
            seen[f"{what}: attributes after backward"] = _attributes(model)
            for i, p in enumerate(model.parameters()):
                seen[f"{what}: grad #{i}"] = None if p.grad is None else p.grad.detach().clone()

        for step, chunks in enumerate(batches):
            x, y = chunks[ctx.rank]
            opt.zero_grad(set_to_none=True)
            if step == 1:
                with model.no_sync():
                    train(f"step {step} no_sync", x, y)
                with wrapper.summon_full_params(model):
                    seen["in summon_full_params"] = _attributes(model)
                seen["after summon_full_params"] = _attributes(model)
            train(f"step {step}", x, y)
            opt.step()
            with torch.no_grad():
                model(x)
            seen[f"step {step}: attributes after a forward under no_grad"] = _attributes(model)
        model.eval()
        with torch.no_grad():
            seen["eval output"] = model(x)
        seen["attributes after an eval forward"] = _attributes(model)
        for k, v in model.state_dict().items():
            seen[f"state_dict[{k}] at the end"] = v
        seen["attributes after state_dict"] = _attributes(model)
        for i, p in enumerate(model.parameters()):
            seen[f"local parameter #{i} at the end"] = p.detach().clone()
        record.append(seen)
    ts, cs = record
    mm.check(list(cs) == list(ts), f"recorded {list(cs)} != torch {list(ts)}")
    for k, b in ts.items():
        if isinstance(b, list):
            mm.check(cs.get(k) == b, f"{k}: {_list_diff(cs.get(k) or [], b)}")
        else:
            mm.tensors(k, cs.get(k), b)
    mm.raise_if_any()


class _Head(nn.Linear):
    """A head of ``_TwoHeads``: one unit each (the wrap policy's class)."""


class _TwoHeads(nn.Module):
    """A trunk and two heads, of which each step uses the one ``head`` names (the same on
    every rank): the other head's unit takes no part in that step's backwards."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(6, 9)
        self.heads = nn.ModuleList(_Head(9, 3) for _ in range(2))
        self.head = 0

    def forward(self, x):
        return self.heads[self.head](torch.relu(self.trunk(x)))


@h.subtest(grid={"strategy": GRID_STRATEGIES, "use_orig_params": [False, True]})
def unit_outside_backward(ctx, strategy, use_orig_params: bool):
    """A unit whose module a step does not call (a branch not taken) keeps what its
    parameters show, as torch FSDP1 ([Note: units outside a backward] in cfsdp's
    ``flat/grads.py``): after ``zero_grad`` its gradients stay None through the other head's
    synchronising and no_sync() backwards, so SGD with momentum leaves it alone.  Losses,
    the gradients after every backward, the parameters and the state dict bitwise torch's.
    (cfsdp showed the unit's last gradient again at the end of every backward: the optimizer
    stepped the head with it; after a no_sync() backward it viewed the sharded gradient at
    full shapes and failed.)"""
    if strategy in HYBRID and ctx.world_size < 4:
        return
    mm = Mismatches(ctx)
    kw = dict(groups_kw(ctx, strategy, "tuple"), use_orig_params=use_orig_params, device_id=CPU,
              sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({_Head}))
    # per step: the head used and, per backward, whether it runs under no_sync()
    plan = [(0, [False]), (1, [False]), (1, [True, False]), (0, [True, False]), (1, [False])]
    batches = make_batches("seq", ctx.world_size, steps=len(plan))
    record = []
    for wrapper in (TorchFSDP, CFSDP):
        model = wrapper(_TwoHeads(), **kw)
        opt = make_optim("sgd", model.parameters())
        seen: dict[str, Any] = {}
        for step, ((head, micro), chunks) in enumerate(zip(plan, batches)):
            x, y = chunks[ctx.rank]
            opt.zero_grad(set_to_none=True)
            model.module.head = head
            for m, use_no_sync in enumerate(micro):
                with model.no_sync() if use_no_sync else contextlib.nullcontext():
                    loss = LOSSES["seq"](model(x + m), y)
                    loss.backward()
                seen[f"step {step}.{m}: loss"] = loss.detach().clone()
                for n, p in model.named_parameters():
                    seen[f"step {step}.{m}: grad of {n}"] = None if p.grad is None else p.grad.detach().clone()
            opt.step()
        for n, p in model.named_parameters():
            seen[f"local parameter {n} at the end"] = p.detach().clone()
        for k, v in model.state_dict().items():
            seen[f"state_dict[{k}] at the end"] = v
        record.append(seen)
    ts, cs = record
    mm.check(list(cs) == list(ts), f"recorded {list(cs)} != torch {list(ts)}")
    for k, b in ts.items():
        mm.tensors(k, cs.get(k), b)
    mm.raise_if_any()
