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
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp import ShardingStrategy as SS
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import _harness as h
from cfsdp import FullyShardedDataParallel as CFSDP
from worker_parity import CPU, Mismatches

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

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
    record = []
    for model in models:
        if mp.keep_low_precision_grads:
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(100 + ctx.rank)
        losses, grads = [], []
        for step in range(4):
            x = torch.randn(4, 5, generator=g)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append([(n, None if p.grad is None else p.grad.detach().clone())
                          for n, p in model.named_parameters()])
            opt.step()
            opt.zero_grad()
        record.append((losses, grads, model.state_dict()))
    (tl, tg, tsd), (cl, cg, csd) = record
    for i, (a, b) in enumerate(zip(cl, tl)):
        mm.tensors(f"loss at step {i}", a, b)
    for s, (ga, gb) in enumerate(zip(cg, tg)):
        mm.check([n for n, _ in ga] == [n for n, _ in gb], f"step {s}: parameter names differ")
        for (n, a), (_, b) in zip(ga, gb):
            mm.check((a is None) == (b is None), f"step {s}: grad of {n}: None mismatch")
            if a is not None and b is not None:
                mm.check(a.dtype == b.dtype, f"step {s}: grad of {n}: dtype {a.dtype} != torch {b.dtype}")
                mm.tensors(f"step {s}: grad of {n}", a, b)
    mm.check(list(csd) == list(tsd), f"state_dict keys {list(csd)} != torch {list(tsd)}")
    for k in tsd:
        c = csd.get(k)
        mm.check(c is not None and c.dtype == tsd[k].dtype,
                 f"state_dict[{k}] dtype {None if c is None else c.dtype} != torch {tsd[k].dtype}")
        mm.tensors(f"state_dict[{k}] at the end", c, tsd[k])
    mm.raise_if_any()


if __name__ == "__main__":
    h.main()
