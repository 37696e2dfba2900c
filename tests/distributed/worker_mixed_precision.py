"""Mixed precision (``MixedPrecision``): cfsdp against torch FSDP1, bitwise.

Run by test_mixed_precision.py under torchrun (gloo, CPU) at W=2 and W=4.

Compared every step: the loss, the gradients the optimizer sees (values *and* dtypes), and at
the end the full state dict (values and dtypes: parameters in full precision, buffers cast back
to their original dtype). Both sides run the same ops in the same dtypes in the same order:
the shard cast to ``param_dtype`` before the all-gather, forward/backward in ``param_dtype``,
the gradient cast to ``reduce_dtype`` and pre-divided, reduce-scattered (or all-reduced),
post-divided in ``reduce_dtype``, cast to the parameter dtype and accumulated; so equality is
exact. The model has a BatchNorm, which torch's default ``_module_classes_to_ignore`` wraps as
its own fp32 unit when an auto-wrap policy is given.

Configurations whose *torch* behaviour excludes them on CPU are adjusted, not skipped: bf16/fp16
parameters with fp32 buffers make CPU LayerNorm/BatchNorm kernels reject the mixed dtypes, so
those configs also set ``buffer_dtype``; ``keep_low_precision_grads`` hands fp16 gradients to the
optimizer, which AdamW rejects on fp32 parameters (in torch too), so that config uses SGD.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision, StateDictType
from torch.distributed.fsdp import ShardingStrategy as SS
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, CheckpointWrapper, checkpoint_wrapper)
from torch.utils.checkpoint import checkpoint

import _harness as h
from cfsdp import FullyShardedDataParallel as CFSDP
from parity_common import CPU, Mismatches

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CKPT_PREFIX = "_checkpoint_wrapped_module."

CONFIGS = {
    "bf16": MixedPrecision(param_dtype=BF16, buffer_dtype=BF16),
    "bf16_reduce_fp32": MixedPrecision(param_dtype=BF16, reduce_dtype=FP32, buffer_dtype=BF16),
    "fp16_keep_low_grads": MixedPrecision(param_dtype=FP16, reduce_dtype=FP16, buffer_dtype=FP16,
                                          keep_low_precision_grads=True),
    "reduce_bf16_only": MixedPrecision(reduce_dtype=BF16),
    "bf16_cast_inputs": MixedPrecision(param_dtype=BF16, buffer_dtype=BF16, cast_forward_inputs=True),
}


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.l1 = nn.Linear(d, 3 * d + 1)
        self.l2 = nn.Linear(3 * d + 1, d)
        self.ln = nn.LayerNorm(d)
        self.register_buffer("scale", torch.full((d,), 0.9))

    def forward(self, x):
        return x + self.l2(torch.relu(self.l1(self.ln(x)))) * self.scale


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), Block(7), Block(7), nn.Linear(7, 1))


@h.subtest(grid={"config": list(CONFIGS), "strategy": [SS.FULL_SHARD, SS.SHARD_GRAD_OP, SS.NO_SHARD],
                 "use_orig_params": [False, True]})
def mixed_precision_parity(ctx, config: str, strategy, use_orig_params: bool):
    mp = CONFIGS[config]
    mm = Mismatches(ctx)
    base = build()
    models = [w(copy.deepcopy(base), process_group=ctx.pg, device_id=CPU, mixed_precision=mp,
                sharding_strategy=strategy, use_orig_params=use_orig_params,
                auto_wrap_policy=ModuleWrapPolicy({Block}))
              for w in (TorchFSDP, CFSDP)]
    record, local_buffers = [], []
    for model in models:
        if mp.keep_low_precision_grads:
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(100 + ctx.rank)
        losses, grads = [], []
        train_steps(model, opt, [torch.randn(4, 5, generator=g) for _ in range(4)], losses, grads)
        record.append((losses, grads, model.state_dict()))
        buffers = {n.replace("_fsdp_wrapped_module.", "") for n, _ in model.named_buffers()}
        with type(model).state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            local_buffers.append({k: v for k, v in model.state_dict().items() if k in buffers})
    compare_records(mm, record)
    # LOCAL state dicts: buffers stay in the dtype they compute in (torch casts them back in the
    # state dicts that unshard only, and for NO_SHARD units, which save FULL ones)
    mm.check(list(local_buffers[1]) == list(local_buffers[0]),
             f"LOCAL plain entries {list(local_buffers[1])} != torch {list(local_buffers[0])}")
    for k, v in local_buffers[0].items():
        mm.tensors(f"LOCAL state_dict[{k}]", local_buffers[1].get(k), v)
    mm.raise_if_any()


def square_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def train_steps(model: nn.Module, opt, inputs: list, losses: list, grads: list,
                loss_of=square_loss) -> None:
    """One optimizer step per input (``loss_of(model, input)``); records each loss and the
    gradients the optimizer sees."""
    for x in inputs:
        loss = loss_of(model, x)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([(n, None if p.grad is None else p.grad.detach().clone())
                      for n, p in model.named_parameters()])
        opt.step()
        opt.zero_grad()


def compare_records(mm: Mismatches, record: list) -> None:
    """torch's and cfsdp's ``(losses, [(name, grad)] per step, state dict)``, bitwise: values,
    dtypes (``Mismatches.tensors`` compares them) and None-ness."""
    (tl, tg, tsd), (cl, cg, csd) = record
    for i, (a, b) in enumerate(zip(cl, tl)):
        mm.tensors(f"loss at step {i}", a, b)
    for s, (ga, gb) in enumerate(zip(cg, tg)):
        mm.check([n for n, _ in ga] == [n for n, _ in gb], f"step {s}: parameter names differ")
        for (n, a), (_, b) in zip(ga, gb):
            mm.tensors(f"step {s}: grad of {n}", a, b)
    mm.check(list(csd) == list(tsd), f"state_dict keys {list(csd)} != torch {list(tsd)}")
    for k in tsd:
        mm.tensors(f"state_dict[{k}] at the end", csd.get(k), tsd[k])


CASTS = {
    "to_float64": lambda m: m.to(torch.float64),
    "double": lambda m: m.double(),
    "to_bfloat16": lambda m: m.to(BF16),
    "half": lambda m: m.half(),
}
CAST_DTYPE = {"to_float64": torch.float64, "double": torch.float64, "to_bfloat16": BF16, "half": FP16}
CAST_MP = {None: None, "bf16": MixedPrecision(param_dtype=BF16, buffer_dtype=BF16),
           "reduce_fp32": MixedPrecision(reduce_dtype=FP32)}


def build_cast() -> nn.Module:
    """``build()`` without its BatchNorm: torch's FSDP1 runs no mixed precision with one on CPU
    once the model is cast (its BatchNorm unit, kept in full precision by
    ``_module_classes_to_ignore``, gets fp32 inputs and float64 parameters: "mixed dtype
    (CPU): expect parameter to have scalar type of Float")."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), Block(7), Block(7), nn.Linear(7, 1))


def _train_cast(model, steps, rank: int, dtype, losses: list, grads: list, first: int = 0) -> None:
    """``steps`` SGD steps on rank-seeded inputs in ``dtype`` (step indices from ``first``);
    SGD, as AdamW's ``eps`` underflows in float16."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    inputs = [torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank)).to(dtype)
              for step in range(first, first + steps)]
    train_steps(model, opt, inputs, losses, grads)


@h.subtest(grid={"cast": list(CASTS), "mp": list(CAST_MP), "strategy": [SS.FULL_SHARD, SS.NO_SHARD],
                 "use_orig_params": [False, True]})
def cast_after_wrapping(ctx, cast: str, mp, strategy, use_orig_params: bool):
    """``model.to(float64)`` / ``.double()`` / ``.to(bfloat16)`` / ``.half()`` after wrapping and
    before the first forward, which torch FSDP1 takes: its lazy initialisation trains the flat
    parameters in the new dtype, mixed-precision dtypes given explicitly staying (with
    ``reduce_fp32`` only the reduction stays fp32).  Bitwise torch's: losses, the gradients the
    optimizer sees (values and dtypes), the state dict (values and dtypes: buffers cast back to
    their dtype at wrapping, as torch records them then)."""
    mm = Mismatches(ctx)
    dtype = CAST_DTYPE[cast]
    base = build_cast()
    record = []
    for w in (TorchFSDP, CFSDP):
        model = w(copy.deepcopy(base), process_group=ctx.pg, device_id=CPU, mixed_precision=CAST_MP[mp],
                  sharding_strategy=strategy, use_orig_params=use_orig_params,
                  auto_wrap_policy=ModuleWrapPolicy({Block}))
        CASTS[cast](model)
        losses, grads = [], []
        _train_cast(model, 3, ctx.rank, dtype, losses, grads)
        record.append((losses, grads, model.state_dict()))
    compare_records(mm, record)
    mm.raise_if_any()


@h.subtest(grid={"cast": ["to_float64", "to_bfloat16"], "strategy": [SS.FULL_SHARD, SS.NO_SHARD],
                 "use_orig_params": [False, True]})
def cast_between_steps(ctx, cast: str, strategy, use_orig_params: bool):
    """The same cast between training steps.  torch 2.13's FSDP1 reads the dtype only in its lazy
    initialisation and fails afterwards (its optimizer step meets fp32 buffers: "Invalid usage of
    tensors with different dtypes"); cfsdp casts the units at any time between steps.  Oracle:
    torch trained the same first steps, its full state dict loaded into a fresh torch model cast
    before (loading is its first use); both continue with a new optimizer, bitwise equal."""
    mm = Mismatches(ctx)
    dtype = CAST_DTYPE[cast]
    base = build_cast()
    kw = dict(process_group=ctx.pg, device_id=CPU, sharding_strategy=strategy,
              use_orig_params=use_orig_params, auto_wrap_policy=ModuleWrapPolicy({Block}))
    record = []
    for w in (TorchFSDP, CFSDP):
        model = w(copy.deepcopy(base), **kw)
        losses, grads = [], []
        _train_cast(model, 2, ctx.rank, FP32, losses, grads)
        if w is TorchFSDP:  # a fresh model, cast, then loaded (loading initialises it lazily)
            sd = model.state_dict()
            model = w(copy.deepcopy(base), **kw)
            CASTS[cast](model)
            model.load_state_dict(sd)
        else:
            CASTS[cast](model)
        _train_cast(model, 2, ctx.rank, dtype, losses, grads, first=2)
        record.append((losses, grads, model.state_dict()))
    compare_records(mm, record)
    mm.raise_if_any()


class LinearUnit(nn.Linear):
    """A Linear wrapped as its own unit (``ModuleWrapPolicy({LinearUnit, Block})``)."""


class CalledTwice(nn.Module):
    """Unit ``a`` called twice in one forward, ``out(a(b(a(h))))`` (``out(b(a(h)))`` if not
    ``twice``).  ``first_on_input``: ``a`` and ``b`` are Linears and ``a``'s first call takes
    the input, so that call's backward needs no parameter; else ``h = inp(x)`` and ``a``,
    ``b`` are Blocks, whose backward needs the parameters of both calls."""

    def __init__(self, first_on_input: bool, twice: bool = True):
        super().__init__()
        self.twice = twice
        self.inp = None if first_on_input else nn.Linear(5, 7)
        self.a, self.b = ((LinearUnit(7, 7), LinearUnit(7, 7)) if first_on_input
                          else (Block(7), Block(7)))
        self.out = nn.Linear(7, 1)

    def forward(self, x):
        h = x if self.inp is None else self.inp(x)
        h = self.b(self.a(h))
        return self.out(self.a(h) if self.twice else h)


@h.subtest(grid={"case": ["first_on_input", "first_needs_weights", "two_forwards",
                          "forward_without_backward", "no_sync"],
                 "strategy": [SS.FULL_SHARD, SS.SHARD_GRAD_OP, SS.NO_SHARD],
                 "use_orig_params": [False, True]})
def unit_called_twice(ctx, case: str, strategy, use_orig_params: bool):
    """A unit used by several forwards before one backward under ``param_dtype=bf16``
    ([Note: one post-backward per iteration] in cfsdp/_runtime/base.py): torch FSDP1 reduces
    once per iteration, the bf16 sum of every call's gradient, when the first forward's
    ``AccumulateGrad`` node has run; FULL_SHARD makes one such node per call (the flat
    parameter's dtype changes at each unshard and reshard).  ``first_on_input``: ``a`` called
    twice in one forward, its first call's backward needing no parameter (cfsdp reduced each
    call's gradient on its own: other gradients from step 0); ``first_needs_weights``: the
    same with Blocks (cfsdp resharded after the second call's gradient: "setStorage: ... out
    of bounds for storage of size 0" in the first call's backward); ``two_forwards``: the
    model (each unit called once) twice, one backward of the sum.  ``forward_without_backward``: a grad-enabled
    forward whose output is dropped before each step's: torch's hook stays on the node of
    that forward, never run, and its optimizer step fails on the unreduced gradient
    (RuntimeError: size mismatch); cfsdp reduces it at the end of backward, so the oracle is
    torch without that forward (it changes nothing).  ``no_sync``: as ``first_needs_weights``,
    each step's backward after one inside ``no_sync()``: every call has a node of its own
    under every strategy (torch's post-forward swaps ``.data`` to the fp32 shard, also with
    SHARD_GRAD_OP / NO_SHARD and on the root), so the calls' bf16 gradients are added one by
    one to no_sync's (cfsdp's SHARD_GRAD_OP / NO_SHARD kept one node: their sum was added,
    other bf16 roundings).  Bitwise torch's: losses, the gradients the optimizer sees, the
    state dict."""
    mm = Mismatches(ctx)
    mp = MixedPrecision(param_dtype=BF16, buffer_dtype=BF16)
    torch.manual_seed(0)
    base = CalledTwice(first_on_input=case == "first_on_input", twice=case != "two_forwards")
    d_in = 7 if case == "first_on_input" else 5
    record = []
    for w in (TorchFSDP, CFSDP):
        model = w(copy.deepcopy(base), process_group=ctx.pg, device_id=CPU, mixed_precision=mp,
                  sharding_strategy=strategy, use_orig_params=use_orig_params,
                  auto_wrap_policy=ModuleWrapPolicy({LinearUnit, Block}))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        g = torch.Generator().manual_seed(100 + ctx.rank)
        inputs = [(torch.randn(4, d_in, generator=g), torch.randn(4, d_in, generator=g))
                  for _ in range(3)]

        def loss_of(model, xs, extra_forward=case == "forward_without_backward" and w is CFSDP):
            if extra_forward:
                model(xs[1])
            if case == "no_sync":
                with model.no_sync():
                    square_loss(model, xs[1]).backward()
            loss = square_loss(model, xs[0])
            return loss + square_loss(model, xs[1]) if case == "two_forwards" else loss

        losses, grads = [], []
        train_steps(model, opt, inputs, losses, grads, loss_of)
        record.append((losses, grads, model.state_dict()))
    compare_records(mm, record)
    mm.raise_if_any()


class CheckpointNet(nn.Module):
    """``out(b(a(inp(x))))``, or ``out(a(b(a(inp(x)))))`` (``twice``), ``a`` and ``b`` Blocks."""

    def __init__(self, twice: bool):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.a, self.b = Block(7), Block(7)
        self.out = nn.Linear(7, 1)
        self.twice = twice

    def forward(self, x):
        h = self.b(self.a(self.inp(x)))
        return self.out(self.a(h) if self.twice else h)


def _reentrant(m: nn.Module) -> nn.Module:
    return checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.REENTRANT)


# (placement, strategy, use_orig_params): representatives, not the product (a few seconds)
REENTRANT_CASES = {
    f"{p}-{s.name}-uop{int(u)}": (p, s, u) for p, s, u in [
        ("inside", SS.FULL_SHARD, False), ("inside", SS.SHARD_GRAD_OP, True),
        ("inside", SS.NO_SHARD, False),
        ("outside", SS.FULL_SHARD, True), ("outside", SS.SHARD_GRAD_OP, False),
        ("outside", SS.NO_SHARD, True),
        ("whole", SS.FULL_SHARD, False), ("whole", SS.NO_SHARD, True),
        ("outside_twice", SS.FULL_SHARD, True), ("outside_twice", SS.SHARD_GRAD_OP, True),
        ("outside_twice", SS.NO_SHARD, True), ("outside_twice", SS.FULL_SHARD, False),
        ("inside_twice", SS.FULL_SHARD, True), ("inside_twice", SS.SHARD_GRAD_OP, False),
        ("inside_twice", SS.SHARD_GRAD_OP, True), ("inside_twice", SS.NO_SHARD, False),
        ("inside_twice", SS.NO_SHARD, True)]}


@h.subtest(grid={"case": list(REENTRANT_CASES)})
def reentrant_checkpoint(ctx, case: str):
    """Reentrant activation checkpointing (``CheckpointImpl.REENTRANT``,
    ``torch.utils.checkpoint(use_reentrant=True)``): the forward runs without grad, and each
    recompute is differentiated in a backward of its own.  ``inside``: FSDP(checkpoint_wrapper(
    Block)); ``outside``: checkpoint_wrapper(FSDP(Block)), the recompute runs the unit's forward
    hooks again; ``whole``: checkpoint(model, x) around the root.  Each under
    ``param_dtype=bf16``; each step's backward after one inside ``no_sync()``; bitwise torch's
    losses, the gradients the optimizer sees and the state dict.

    ``outside_twice``: ``a`` called twice (``outside``, fp32): the earlier call's recompute runs
    after the later call's post-backward; with ``use_orig_params=True`` cfsdp's pre-forward
    of that recompute dropped the reduced gradient (every original parameter's ``.grad`` was
    still None, which it took for a ``zero_grad``): other gradients than torch's.  torch's
    with ``param_dtype=bf16`` reduces one call's gradient only (its hook sits on the node of
    the first recompute, the other call's recompute makes another; README), so fp32 here.
    ``inside_twice``: ``a`` called twice (``inside``, bf16): torch fails (FULL_SHARD /
    SHARD_GRAD_OP with use_orig_params=False: a size mismatch in its post-backward) or trains
    on other gradients (use_orig_params=True: ``a``'s ``.grad`` None; NO_SHARD: a call's
    gradient dropped); cfsdp reduces the sum of both calls' gradients once, at the end of
    backward (neither recompute runs in the node of the forward), which is torch's gradient
    without checkpointing, bitwise: that is the oracle (cfsdp failed on SHARD_GRAD_OP /
    NO_SHARD: "mat1 and mat2 must have the same dtype", or a freed storage)."""
    placement, strategy, use_orig_params = REENTRANT_CASES[case]
    mm = Mismatches(ctx)
    twice = placement.endswith("_twice")
    mp = None if placement == "outside_twice" else MixedPrecision(param_dtype=BF16, buffer_dtype=BF16)
    torch.manual_seed(0)
    base = CheckpointNet(twice)
    record = []
    for w in (TorchFSDP, CFSDP):
        model = copy.deepcopy(base)
        kw = dict(process_group=ctx.pg, device_id=CPU, mixed_precision=mp, sharding_strategy=strategy,
                  use_orig_params=use_orig_params)
        oracle_without_ac = placement == "inside_twice" and w is TorchFSDP
        if placement in ("outside", "outside_twice"):
            model.a, model.b = _reentrant(w(model.a, **kw)), _reentrant(w(model.b, **kw))
            model = w(model, **kw)
        elif placement.startswith("inside") and not oracle_without_ac:
            model.a, model.b = _reentrant(model.a), _reentrant(model.b)
            model = w(model, auto_wrap_policy=ModuleWrapPolicy({CheckpointWrapper}), **kw)
        else:
            model = w(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        g = torch.Generator().manual_seed(100 + ctx.rank)
        inputs = [(torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)) for _ in range(3)]

        def loss_of(model, xs):
            def one(x):
                if placement != "whole":
                    return square_loss(model, x)
                out = checkpoint(model, x.requires_grad_(), use_reentrant=True)
                return out.float().pow(2).mean()
            with model.no_sync():
                one(xs[1]).backward()
            return one(xs[0])

        losses, grads = [], []
        train_steps(model, opt, inputs, losses, grads, loss_of)
        record.append((losses, [[(n.replace(CKPT_PREFIX, ""), g) for n, g in s] for s in grads],
                       {k.replace(CKPT_PREFIX, ""): v for k, v in model.state_dict().items()}))
    compare_records(mm, record)
    mm.raise_if_any()


@h.subtest(grid={"use_orig_params": [False, True]})
def cast_refused(ctx, use_orig_params: bool):
    """What the units cannot take over is refused, naming a parameter, never ignored: a move to
    another device (here the meta device: the GPU path cannot run here)."""
    mm = Mismatches(ctx)
    model = CFSDP(build_cast(), process_group=ctx.pg, device_id=CPU, use_orig_params=use_orig_params)
    try:
        model.to("meta")
    except NotImplementedError as e:
        mm.check("'0.weight'" in str(e) and "meta" in str(e), f"the error names no parameter: {e}")
    else:
        mm.add("model.to('meta') was not refused")
    mm.raise_if_any()


if __name__ == "__main__":
    h.main()
