"""Memory: a deleted model's units and shards are freed, and deferred initialisation
materialises unit by unit (one unit at full size plus the shards already made, never the whole
model)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import _harness as h
from cfsdp import FullyShardedDataParallel as CFSDP
from parity_common import CPU, LOSSES, Mismatches, build, make_batches, make_optim, make_policy


@h.subtest(grid={"use_orig_params": [False, True]})
def model_memory_is_freed(ctx, use_orig_params: bool):
    """Deleting a trained model (and its optimizer) frees its units and their shards: no
    reference cycle through the flat parameter's gradient hook keeps them alive."""
    import gc
    import weakref

    mm = Mismatches(ctx)
    model = CFSDP(build("transformer"), process_group=ctx.pg, device_id=CPU,
                  use_orig_params=use_orig_params, auto_wrap_policy=make_policy("module"))
    opt = make_optim("adamw", model.parameters())
    (x, y), = make_batches("transformer", 1, steps=1)[0]
    LOSSES["transformer"](model(x), y).backward()
    opt.step()
    refs = [weakref.ref(w._state.unit) for w in CFSDP.fsdp_modules(model) if w._state.unit is not None]
    del model, opt
    gc.collect()
    alive = sum(r() is not None for r in refs)
    mm.check(alive == 0, f"{alive} of {len(refs)} units still alive after del model, optimizer")
    mm.raise_if_any()


@h.subtest(grid={"use_orig_params": [False, True]})
def deferred_init_memory(ctx, use_orig_params: bool):
    """Deferred init materialises and shards unit by unit: while any module is being
    materialised, the parameter elements that exist (not on meta) are at most one unit at full
    size plus the shards of the units already wrapped -- never the whole model."""
    mm = Mismatches(ctx)
    n_blocks, width = 6, 32
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n_blocks)])
    block_numel = width * width + width
    total = n_blocks * block_numel
    seen: list[int] = []

    def init_fn(module: nn.Module) -> None:
        module.to_empty(device=CPU, recurse=False)
        if isinstance(module, nn.Linear):
            module.reset_parameters()
        live = {id(t): t.numel() for m in model.modules() for t in m.parameters(recurse=False)
                if not t.is_meta and t.numel() > 0}
        seen.append(sum(live.values()))

    CFSDP(model, process_group=ctx.pg, device_id=CPU, use_orig_params=use_orig_params,
          param_init_fn=init_fn, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    bound = block_numel + (total + ctx.world_size * n_blocks) // ctx.world_size
    mm.check(len(seen) > 0 and max(seen) <= bound,
             f"parameter elements alive while materialising: max {max(seen, default=0)} > bound "
             f"{bound} (one unit {block_numel} + shards; whole model {total})")
    mm.check(max(seen) < total, f"max {max(seen)} reached the whole model ({total})")
    mm.raise_if_any()
