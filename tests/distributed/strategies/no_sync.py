"""no_sync(): gradient accumulation for every strategy and model kind, its dtypes under
MixedPrecision and CPU offload, and its errors."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffload, MixedPrecision
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as SS

import _harness as h
from cfsdp import FullyShardedDataParallel as CFSDP
from parity_common import (
    CPU,
    LOSSES,
    Mismatches,
    build,
    make_batches,
    make_optim,
    make_policy,
    wrap_odd,
)
from strategies.common import GRID_STRATEGIES, groups_kw, HYBRID


@h.subtest(grid={"strategy": GRID_STRATEGIES, "use_orig_params": [False, True], "kind": ["transformer", "odd"]})
def no_sync_accumulation(ctx, strategy, use_orig_params: bool, kind: str):
    """Micro-batches under no_sync() then one synchronising backward, also mixed with plain
    accumulation across backwards; compared bitwise to torch FSDP1 every step (losses, the
    gradients the optimizer sees, parameters), and the gradient after no_sync to the single
    process's gradient of the mean micro-batch loss."""
    if kind == "odd" and (use_orig_params is False):
        # torch 2.13 FSDP1 mis-accumulates the 1-element unit of "odd" when use_orig_params=False
        # (see worker_parity.grad_accumulation_and_eval); the transformer covers that path.
        return
    _no_sync_parity(ctx, strategy, use_orig_params, kind, "fp32")


# [Note: wrapper accumulation dtypes] torch's FSDP1 keeps a no_sync() gradient in
# ``flat_param.grad`` in the compute dtype (param_dtype): autograd adds the next backward's
# to it there, and only the synchronising backward casts the sum to reduce_dtype.  Plain
# accumulation (backwards that sync, no zero_grad between) adds each reduced shard, cast to
# the parameter dtype, to the sharded gradient; NO_SHARD keeps its reduced full gradient in
# ``.grad`` and autograd adds the next local one to it (so torch reduces the sum again).
NO_SYNC_CONFIGS = {
    "fp32": {},
    "bf16_reduce_fp32": {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16,
                                                           reduce_dtype=torch.float32)},
    "bf16": {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)},
    "bf16_keep_low_grads": {"mixed_precision": MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, keep_low_precision_grads=True)},
    "reduce_bf16_only": {"mixed_precision": MixedPrecision(reduce_dtype=torch.bfloat16)},
    # torch refuses CPUOffload without an accelerator: its oracle runs without (see cpu_offload)
    "cpu_offload": {},
}


@h.subtest(grid={"strategy": GRID_STRATEGIES, "config": [c for c in NO_SYNC_CONFIGS if c != "fp32"],
                 "use_orig_params": [False, True]})
def no_sync_dtypes(ctx, strategy, config: str, use_orig_params: bool):
    """``no_sync_accumulation`` under every mixed-precision policy (and CPU offload): bitwise
    as torch FSDP1 ([Note: wrapper accumulation dtypes])."""
    _no_sync_parity(ctx, strategy, use_orig_params, "transformer", config)


def _no_sync_parity(ctx, strategy, use_orig_params: bool, kind: str, config: str) -> None:
    if strategy in HYBRID and ctx.world_size < 4:
        return
    mm = Mismatches(ctx)
    base = build(kind)
    kw = dict(groups_kw(ctx, strategy, "tuple"), use_orig_params=use_orig_params, device_id=CPU,
              sharding_strategy=strategy, **NO_SYNC_CONFIGS[config])
    extra = {"cpu_offload": CPUOffload(offload_params=True)} if config == "cpu_offload" else {}
    if kind == "odd":
        models = [wrap_odd(w, copy.deepcopy(base), **kw, **(extra if w is CFSDP else {}))
                  for w in (TorchFSDP, CFSDP)]
    else:
        models = [w(copy.deepcopy(base), auto_wrap_policy=make_policy("module"), **kw,
                    **(extra if w is CFSDP else {}))
                  for w in (TorchFSDP, CFSDP)]
    W, r = ctx.world_size, ctx.rank
    micro = 3
    batches = make_batches(kind, micro * W, steps=4)  # chunk micro*r+m is micro-batch m of rank r
    loss_fn = LOSSES[kind]
    record = []
    for model in models:
        # SGD: AdamW divides near-zero gradients by their own square root, which turns the
        # rounding difference of the single-process sum into visible updates (see worker_parity)
        opt = make_optim("sgd", model.parameters())
        losses, grads = [], []
        for step, chunks in enumerate(batches):
            # step 3 keeps step 2's gradients (no zero_grad): they accumulate as well
            if step != 3:
                opt.zero_grad(set_to_none=True)
            for m in range(micro):
                # step 1 accumulates without no_sync for its first micro-batch (reduced, sharded
                # grads) then no_sync for the second; other steps no_sync all but the last
                use_no_sync = m < micro - 1 and not (step == 1 and m == 0)
                ctx_mgr = model.no_sync() if use_no_sync else contextlib.nullcontext()
                with ctx_mgr:
                    x, y = chunks[micro * r + m]
                    loss = loss_fn(model(x), y)
                    loss.backward()
                losses.append(loss.detach().clone())
                # what the parameters show after every backward (no_sync: the unsharded
                # gradient, in the compute dtype), then what the optimizer sees
                grads.append([None if p.grad is None else p.grad.detach().clone()
                              for p in model.parameters()])
            opt.step()
        record.append((losses, grads, [p.detach().clone() for p in model.parameters()], model.state_dict()))
    (tl, tg, tp, tsd), (cl, cg, cp, csd) = record
    for i, (a, b) in enumerate(zip(cl, tl)):
        mm.tensors(f"loss of micro-batch {i}", a, b)
    for k, (ga, gb) in enumerate(zip(cg, tg)):
        s, m = divmod(k, micro)
        mm.check(len(ga) == len(gb), f"step {s}: {len(ga)} grads vs torch {len(gb)}")
        for i, (a, b) in enumerate(zip(ga, gb)):
            mm.tensors(f"step {s}: grad of parameter #{i} after backward {m}", a, b)
    for i, (a, b) in enumerate(zip(cp, tp)):
        mm.tensors(f"local parameter #{i} at the end", a, b)
    mm.check(list(csd) == list(tsd), f"state_dict keys {list(csd)} != torch {list(tsd)}")
    for k in tsd:
        mm.tensors(f"state_dict[{k}] at the end", csd.get(k), tsd[k])
    if config in ("fp32", "cpu_offload"):
        # the single process: the same micro-batches, mean over every rank's micro-batches
        ref = copy.deepcopy(base)
        opt = make_optim("sgd", ref.parameters())
        for step, chunks in enumerate(batches):
            if step != 3:
                opt.zero_grad(set_to_none=True)
            (torch.stack([loss_fn(ref(x), y) for x, y in chunks]).sum() / W).backward()
            opt.step()
        for k, v in ref.state_dict().items():
            if k.rsplit(".", 1)[-1] not in ("running_mean", "running_var", "num_batches_tracked"):
                mm.tensors(f"cfsdp-vs-ref state_dict[{k}] at the end", csd.get(k), v, exact=False,
                           b_name="ref")
    mm.raise_if_any()


class _Sided(nn.Module):
    """A root unit around a ``side`` unit that forward calls only where ``use_side``
    (``zero_side``: otherwise called and added times 0, so it gets a zero gradient), and an
    ``extra`` layer of the root's unit used only where ``use_extra``."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(5, 6)
        self.side = nn.Linear(6, 6)
        self.extra = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)
        self.use_side = True
        self.zero_side = False
        self.use_extra = True

    def forward(self, x):
        h = torch.tanh(self.pre(x))
        if self.use_extra:
            h = h + torch.tanh(self.extra(h))
        if self.use_side:
            h = h + torch.tanh(self.side(h))
        elif self.zero_side:
            h = h + 0 * torch.tanh(self.side(h))
        return self.head(h)


def _wrapped_sided(base: nn.Module, wrapper, kw: dict) -> nn.Module:
    """``base`` copied, its ``side`` unit and the root wrapped by ``wrapper``."""
    model = copy.deepcopy(base)
    model.side = wrapper(model.side, **kw)
    return wrapper(model, **kw)


def _compare_runs(mm: Mismatches, cfsdp_run: tuple, torch_run: tuple, loss_what: str) -> None:
    """Bitwise: the losses, each step's gradients the optimizer sees, the final parameters
    (``(losses, grads, params, ...)`` of each run)."""
    (cl, cg, cp), (tl, tg, tp) = cfsdp_run[:3], torch_run[:3]
    for i, (a, b) in enumerate(zip(cl, tl)):
        mm.tensors(f"{loss_what} {i}", a, b)
    for s, (ga, gb) in enumerate(zip(cg, tg)):
        mm.check(len(ga) == len(gb), f"step {s}: {len(ga)} grads vs torch {len(gb)}")
        for i, (a, b) in enumerate(zip(ga, gb)):
            mm.tensors(f"step {s}: grad of parameter #{i} the optimizer sees", a, b)
    for i, (a, b) in enumerate(zip(cp, tp)):
        mm.tensors(f"local parameter #{i} at the end", a, b)


@h.subtest(grid={"strategy": GRID_STRATEGIES, "use_orig_params": [False, True],
                 "config": ["fp32", "bf16_reduce_fp32"]})
def no_sync_unit_not_reached(ctx, strategy, use_orig_params: bool, config: str):
    """A unit that no_sync() micro-batches use and the synchronising backward does not reach
    (steps 0 and 1; step 2 uses it in every micro-batch): cfsdp reduces what no_sync()
    accumulated at the end of that backward, as torch's FSDP2 does ([Note: no_sync() then a
    backward that does not reach the unit] in _runtime/flat/grads.py). torch's FSDP1 leaves it
    unreduced: with a sharded strategy its end of backward fails ("All sharded parameters that
    received a gradient in the post-backward should use `_saved_grad_shard`"), with NO_SHARD
    every rank steps its own local sum (the replicas drift apart). So the oracles are torch's
    FSDP1 on the same model whose synchronising micro-batch adds the unit's output times 0
    (the unit is reached and gets a zero gradient: the same sums; bitwise: losses, the
    gradients the optimizer sees, the parameters) and the single process on every rank's
    micro-batches (fp32: the full parameters at the end, within REF_RTOL/REF_ATOL)."""
    if strategy in HYBRID and ctx.world_size < 4:
        return
    mm = Mismatches(ctx)
    torch.manual_seed(0)
    base = _Sided()
    kw = dict(groups_kw(ctx, strategy, "tuple"), use_orig_params=use_orig_params, device_id=CPU,
              sharding_strategy=strategy, **NO_SYNC_CONFIGS[config])
    W, r, micro = ctx.world_size, ctx.rank, 2
    g = torch.Generator().manual_seed(7)
    batches = [[(torch.randn(3, 5, generator=g), torch.randn(3, 2, generator=g))
                for _ in range(micro * W)] for _ in range(3)]

    def side_in(step: int, m: int) -> bool:
        return step == 2 or m < micro - 1

    record = []
    for wrapper in (TorchFSDP, CFSDP):
        model = _wrapped_sided(base, wrapper, kw)
        model.module.zero_side = wrapper is TorchFSDP  # the oracle reaches the unit
        opt = make_optim("sgd", model.parameters())
        losses, grads = [], []
        for step, chunks in enumerate(batches):
            opt.zero_grad(set_to_none=True)
            for m in range(micro):
                model.module.use_side = side_in(step, m)
                with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    x, y = chunks[micro * r + m]
                    loss = F.mse_loss(model(x).float(), y)  # (bf16 outputs: torch 2.11 wants one dtype)
                    loss.backward()
                losses.append(loss.detach().clone())
            grads.append([None if p.grad is None else p.grad.detach().clone()
                          for p in model.parameters()])
            opt.step()
        record.append((losses, grads, [p.detach().clone() for p in model.parameters()],
                       model.state_dict()))
    _compare_runs(mm, record[1], record[0], "loss of micro-batch")
    csd = record[1][3]
    if config != "fp32":
        mm.raise_if_any()
        return
    ref = copy.deepcopy(base)
    opt = make_optim("sgd", ref.parameters())
    for step, chunks in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        total = 0
        for k, (x, y) in enumerate(chunks):
            ref.use_side = side_in(step, k % micro)
            total = total + F.mse_loss(ref(x), y)
        (total / W).backward()
        opt.step()
    for k, v in ref.state_dict().items():
        mm.tensors(f"cfsdp-vs-ref state_dict[{k}] at the end", csd.get(k), v, exact=False,
                   b_name="ref")
    mm.raise_if_any()


@h.subtest(grid={"strategy": GRID_STRATEGIES, "use_orig_params": [False, True]})
def params_unused_on_some_ranks(ctx, strategy, use_orig_params: bool):
    """Parameters without gradients in the wrapper, against torch's FSDP1 bitwise (losses,
    the gradients the optimizer sees, the parameters): ``extra`` (in the root's unit) used
    on every other rank, alternating by step, and by no rank in step 3; the ``side`` unit
    not called in step 2; zero_grad(set_to_none=False) before steps 1 and 3 (kept, zeroed
    gradients: AdamW steps them); with use_orig_params=True ``extra.weight`` frozen from
    step 3 on (keeping its gradient). Both reduce each unit's whole flat gradient (zeros where
    a rank did not use a parameter), so every rank gets the others' gradients."""
    if strategy in HYBRID and ctx.world_size < 4:
        return
    mm = Mismatches(ctx)
    torch.manual_seed(0)
    base = _Sided()
    kw = dict(groups_kw(ctx, strategy, "tuple"), use_orig_params=use_orig_params, device_id=CPU,
              sharding_strategy=strategy)
    r, W = ctx.rank, ctx.world_size
    g = torch.Generator().manual_seed(11)
    batches = [[(torch.randn(3, 5, generator=g), torch.randn(3, 2, generator=g)) for _ in range(W)]
               for _ in range(4)]
    record = []
    for wrapper in (TorchFSDP, CFSDP):
        model = _wrapped_sided(base, wrapper, kw)
        opt = make_optim("adamw", model.parameters())
        losses, grads = [], []
        for step, chunks in enumerate(batches):
            opt.zero_grad(set_to_none=step not in (1, 3))
            if use_orig_params and step == 3:
                model.module.extra.weight.requires_grad_(False)
            model.module.use_extra = (r + step) % 2 == 0 and step != 3
            model.module.use_side = step != 2
            x, y = chunks[r]
            loss = F.mse_loss(model(x).float(), y)  # (bf16 outputs: torch 2.11 wants one dtype)
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append([None if p.grad is None else p.grad.detach().clone()
                          for p in model.parameters()])
            opt.step()
        record.append((losses, grads, [p.detach().clone() for p in model.parameters()]))
    _compare_runs(mm, record[1], record[0], "loss at step")
    mm.raise_if_any()


@h.subtest
def no_sync_errors(ctx):
    """no_sync() on an inner unit (once the root is known: before the first forward an
    inner unit would become a root itself, in torch as in cfsdp) is rejected by torch and by
    cfsdp; so is a tuple of groups for a non-hybrid strategy and a 1-D mesh for a hybrid one."""
    mm = Mismatches(ctx)
    (x, y), = make_batches("transformer", 1, steps=1)[0]
    for who, wrapper in (("torch", TorchFSDP), ("cfsdp", CFSDP)):
        model = wrapper(build("transformer"), auto_wrap_policy=make_policy("module"),
                        process_group=ctx.pg, device_id=CPU)
        LOSSES["transformer"](model(x), y).backward()
        inner = next(m for m in model.modules() if isinstance(m, wrapper) and m is not model)
        try:
            with inner.no_sync():
                pass
        except RuntimeError as e:
            mm.check("root" in str(e), f"{who}: no_sync on inner unit: message lacks 'root': {e}")
        else:
            mm.add(f"{who}: no_sync() on an inner unit did not raise")
    try:
        CFSDP(build("seq"), process_group=(ctx.pg, ctx.pg), device_id=CPU)
    except ValueError as e:
        mm.check("HYBRID_SHARD" in str(e), f"tuple process_group with FULL_SHARD: {e}")
    else:
        mm.add("cfsdp: a (shard, replicate) tuple with FULL_SHARD did not raise")
    mesh1 = init_device_mesh("cpu", (ctx.world_size,))
    try:
        CFSDP(build("seq"), device_mesh=mesh1, sharding_strategy=SS.HYBRID_SHARD, device_id=CPU)
    except ValueError as e:
        mm.check("2-D device_mesh" in str(e), f"1-D mesh with HYBRID_SHARD: {e}")
    else:
        mm.add("cfsdp: a 1-D mesh with HYBRID_SHARD did not raise")
    mm.raise_if_any()
