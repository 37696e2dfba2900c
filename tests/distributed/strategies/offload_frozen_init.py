"""CPU offload, frozen and trainable parameters in one unit, and deferred (meta-device)
initialisation."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffload
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as SS
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import _harness as h
from cfsdp import FullyShardedDataParallel as CFSDP
from parity_common import CPU, Mismatches, make_optim, make_policy, run_parity, wrap_root


@h.subtest(grid={"strategy": [SS.FULL_SHARD, SS.NO_SHARD], "use_orig_params": [False, True]})
def cpu_offload(ctx, strategy, use_orig_params: bool):
    """CPUOffload(offload_params=True) on CPU ranks. torch's FSDP1 refuses to run it without an
    accelerator ("Cannot access accelerator device"), so the oracle is torch *without* offload
    (on a CPU compute device offloading changes where nothing lives: shards, gradients and the
    optimizer step are on the CPU either way) and, through run_parity, the single process."""
    run_parity(ctx, "transformer", use_orig_params, "adamw", wrap_root, steps=4,
               fsdp_kwargs={"sharding_strategy": strategy, "auto_wrap_policy": make_policy("module")},
               cfsdp_kwargs={"cpu_offload": CPUOffload(offload_params=True)})


class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank adapter, in one module."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


class LoRANet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([LoRALinear(6, 6) for _ in range(3)])
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        for blk in self.blocks:
            x = torch.tanh(blk(x))
        return self.head(x)


@h.subtest(grid={"strategy": [SS.FULL_SHARD, SS.SHARD_GRAD_OP, SS.NO_SHARD]})
def frozen_and_trainable_in_one_unit(ctx, strategy):
    """use_orig_params=True with a frozen base and trainable adapters in the same unit (LoRA):
    losses, the adapters' gradients and parameters bitwise equal to torch FSDP1; the frozen
    parameters get no gradient and do not change. (cfsdp computes no gradient for frozen
    parameters at all, torch computes and discards it; the trainable gradients are the same.)"""
    mm = Mismatches(ctx)
    torch.manual_seed(0)
    base = LoRANet()
    models = [w(copy.deepcopy(base), process_group=ctx.pg, device_id=CPU, use_orig_params=True,
                sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({LoRALinear}))
              for w in (TorchFSDP, CFSDP)]
    record = []
    for model in models:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        g = torch.Generator().manual_seed(7 + ctx.rank)
        losses, grads = [], []
        for _ in range(4):
            x = torch.randn(5, 6, generator=g)
            loss = model(x).pow(2).mean()
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append([(n, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()])
            opt.step()
            opt.zero_grad()
        record.append((losses, grads, model.state_dict()))
    (tl, tg, tsd), (cl, cg, csd) = record
    for i, (a, b) in enumerate(zip(cl, tl)):
        mm.tensors(f"loss at step {i}", a, b)
    for s, (ga, gb) in enumerate(zip(cg, tg)):
        for (n, a), (_, b) in zip(ga, gb):
            mm.check((a is None) == (b is None), f"step {s}: grad of {n}: None vs torch {b is None}")
            if a is not None and b is not None:
                mm.tensors(f"step {s}: grad of {n}", a, b)
    for k in tsd:
        mm.tensors(f"state_dict[{k}] at the end", csd.get(k), tsd[k])
        if ".base." in k:
            mm.tensors(f"frozen {k} unchanged", csd.get(k), base.state_dict()[k])
    # with use_orig_params=False torch and cfsdp both refuse a unit with mixed requires_grad
    for who, wrapper in (("torch", TorchFSDP), ("cfsdp", CFSDP)):
        try:
            wrapper(copy.deepcopy(base), process_group=ctx.pg, device_id=CPU, use_orig_params=False,
                    auto_wrap_policy=ModuleWrapPolicy({LoRALinear}))
        except ValueError as e:
            mm.check("requires_grad" in str(e) or "frozen" in str(e), f"{who}: message: {e}")
        else:
            mm.add(f"{who}: mixed requires_grad with use_orig_params=False did not raise")
    mm.raise_if_any()


def _meta_mlp():
    """Every module holding state has reset_parameters() (torch's contract for meta init)."""
    torch.manual_seed(1)
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(6, 9), nn.LayerNorm(9), nn.Sequential(nn.Linear(9, 9), nn.Tanh()),
                             nn.Linear(9, 3))


def _init_fn(module: nn.Module) -> None:
    """A param_init_fn: materialise the module's own tensors and fill them deterministically."""
    module.to_empty(device=CPU, recurse=False)
    with torch.no_grad():
        for i, t in enumerate(list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))):
            if t.is_floating_point():
                t.copy_(torch.linspace(-0.3, 0.3, t.numel()).reshape(t.shape) * (1 + 0.1 * i))


@h.subtest(grid={"init": ["reset_parameters", "param_init_fn"], "use_orig_params": [False, True]})
def deferred_init(ctx, init: str, use_orig_params: bool):
    """A model built on the meta device, materialised unit by unit (torch's order: inner units
    first, breadth first within a unit) by reset_parameters() or by param_init_fn; then trained.
    Bitwise against torch FSDP1 given the same construction (same RNG draws in the same order).
    A module with state but no reset_parameters() is an error in both."""
    mm = Mismatches(ctx)
    results = []
    for wrapper in (TorchFSDP, CFSDP):
        torch.manual_seed(1)
        kw = dict(process_group=ctx.pg, device_id=CPU, use_orig_params=use_orig_params,
                  auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        if init == "param_init_fn":
            kw["param_init_fn"] = _init_fn
        model = wrapper(_meta_mlp(), **kw)
        mm.check(all(not p.is_meta for p in model.parameters()), f"{wrapper.__name__}: meta params left")
        sd0 = model.state_dict()
        opt = make_optim("adamw", model.parameters())
        g = torch.Generator().manual_seed(3 + ctx.rank)
        losses = []
        for _ in range(3):
            loss = model(torch.randn(4, 6, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        results.append((sd0, losses, model.state_dict()))
    (t0, tl, tsd), (c0, cl, csd) = results
    mm.check(list(c0) == list(t0), "state_dict keys after materialisation differ")
    for k in t0:
        mm.tensors(f"materialised state_dict[{k}]", c0.get(k), t0[k])
    for i, (a, b) in enumerate(zip(cl, tl)):
        mm.tensors(f"loss at step {i}", a, b)
    for k in tsd:
        mm.tensors(f"state_dict[{k}] at the end", csd.get(k), tsd[k])
    if init == "reset_parameters":
        class NoReset(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(3))
        with torch.device("meta"):
            bad = NoReset()
        for who, wrapper in (("torch", TorchFSDP), ("cfsdp", CFSDP)):
            try:
                wrapper(copy.deepcopy(bad), process_group=ctx.pg, device_id=CPU)
            except Exception as e:  # noqa: BLE001 - torch raises AttributeError, cfsdp ValueError
                if who == "cfsdp":
                    mm.check(isinstance(e, ValueError) and "reset_parameters" in str(e),
                             f"cfsdp: expected a ValueError naming reset_parameters, got {e!r}")
            else:
                mm.add(f"{who}: a meta module without reset_parameters() did not raise")
    mm.raise_if_any()
