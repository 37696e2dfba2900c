"""use_orig_params=True: writes to the original parameters between steps, carried over as torch
FSDP1's ``_writeback_orig_params``, and the writes it refuses."""

from __future__ import annotations

from typing import Any
import copy

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as SS

import _harness as h
from cfsdp import FullyShardedDataParallel as CFSDP
from parity_common import CPU, LOSSES, Mismatches, build, make_batches, make_optim
from strategies.common import GRID_STRATEGIES, HYBRID, _orig_params_model, TiedLM, _written


ORIG_WRITES = ["data", "grad", "grad_none", "new_param", "summon", "state_dict", "clip"]


@h.subtest(grid={"strategy": GRID_STRATEGIES, "write": ORIG_WRITES})
def orig_param_writes(ctx, strategy, write: str):
    """use_orig_params=True, writes to original parameters after wrapping (reached through module
    attributes, as a user does), carried over as torch FSDP1's ``_writeback_orig_params`` does
    (cfsdp's [Note: writeback of original parameters]).  Gradients accumulate over two
    backwards (zeroed after steps 1 and 3); after step 0's backward:

    * ``grad``: ``p.grad = p.grad * 3`` (a new tensor): the optimizer steps it and the next
      backward accumulates onto it;
    * ``clip``: the same, then ``clip_grad_norm_``: the norm is that of the new gradients (to
      float32 rounding, as cfsdp's clip always is: worker_clip.py, so this one compares with the
      REF tolerances);

    after step 0's optimizer step:

    * ``data``: ``p.data = p.data * 2 + 1``: the next forward computes with it, the next update
      lands on it;
    * ``grad_none``: ``p.grad = None`` for these parameters only: theirs restart from zero, the
      others' accumulate;
    * ``new_param``: ``module.w = nn.Parameter(...)`` (the optimizer built anew): adopted;
    * ``summon`` / ``state_dict``: a ``p.data`` write shows in ``summon_full_params`` and in the
      FULL state dict taken right after it.

    Bitwise torch's every step (losses, the gradients the optimizer sees, parameters, state
    dict) and whether each module attribute is its registered parameter, for every sharding
    strategy (hybrid ones at W=4)."""
    if strategy in HYBRID and ctx.world_size < 4:
        return
    mm = Mismatches(ctx)
    base, kw = _orig_params_model(ctx, strategy)
    batches = make_batches("transformer", ctx.world_size, steps=4)
    loss_fn = LOSSES["transformer"]
    record = []
    for wrapper in (TorchFSDP, CFSDP):
        model = wrapper(copy.deepcopy(base), **kw)
        opt = make_optim("adamw", model.parameters())
        seen: dict[str, Any] = {}  # what each step shows
        for step, chunks in enumerate(batches):
            x, y = chunks[ctx.rank]
            loss = loss_fn(model(x), y)
            loss.backward()
            seen[f"loss at step {step}"] = loss.detach().clone()
            if step == 0 and write in ("grad", "clip"):
                for mod, name in _written(model):
                    p = getattr(mod, name)
                    if p.grad is not None:
                        p.grad = p.grad * 3
                if write == "clip":
                    seen["total norm"] = model.clip_grad_norm_(0.5)
            for i, p in enumerate(model.parameters()):
                seen[f"grad #{i} seen by step {step}"] = None if p.grad is None else p.grad.detach().clone()
            opt.step()
            if step % 2 == 1:
                opt.zero_grad(set_to_none=True)
            if step != 0 or write in ("grad", "clip"):
                continue
            for mod, name in _written(model):
                p = getattr(mod, name)
                if write == "grad_none":
                    p.grad = None
                elif write == "new_param":
                    setattr(mod, name, nn.Parameter(p.detach() * 2 + 1))
                else:
                    p.data = p.data * 2 + 1
            if write == "new_param":
                opt = make_optim("adamw", model.parameters())
            elif write == "summon":
                with wrapper.summon_full_params(model):
                    for n, p in model.named_parameters():
                        seen[f"summoned {n}"] = p.detach().clone()
            elif write == "state_dict":
                for k, v in model.state_dict().items():
                    seen[f"state_dict[{k}] after the write"] = v
        for i, p in enumerate(model.parameters()):
            seen[f"local parameter #{i} at the end"] = p.detach().clone()
        for k, v in model.state_dict().items():
            seen[f"state_dict[{k}] at the end"] = v
        seen["attributes that are their registered parameter"] = [
            getattr(mod, name) is p for mod in model.modules()
            for name, p in mod._parameters.items() if p is not None]
        record.append(seen)
    ts, cs = record
    mm.check(list(cs) == list(ts), f"recorded {list(cs)} != torch {list(ts)}")
    for k, b in ts.items():
        a = cs.get(k)
        if isinstance(b, list):
            mm.check(a == b, f"{k}: {a} != torch {b}")
        else:
            mm.tensors(k, a, b, exact=write != "clip")
    mm.raise_if_any()


def _raises(fn) -> BaseException | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned to be compared with torch's
        return e
    return None


@h.subtest(grid={"strategy": [SS.FULL_SHARD, SS.NO_SHARD], "bad": ["shape", "tied"]})
def orig_param_write_errors(ctx, strategy, bad: str):
    """Writes that cannot be carried over (use_orig_params=True), as torch FSDP1: data of another
    shape (a sharded parameter given its full shape; a NO_SHARD one one element more) is torch's
    RuntimeError "Cannot writeback when the parameter shape changes", naming the FQN; a tied
    parameter given its own object is torch's NotImplementedError.  Every rank writes to every
    parameter it holds (so every rank raises before any collective)."""
    mm = Mismatches(ctx)
    got = []
    for wrapper in (TorchFSDP, CFSDP):
        if bad == "tied":
            torch.manual_seed(0)
            model = wrapper(TiedLM(), process_group=ctx.pg, device_id=CPU, use_orig_params=True,
                            sharding_strategy=strategy)
            head = model.module.head
            head.weight = nn.Parameter(head.weight.detach().clone())
            x = torch.randint(0, 11, (3, 5))
        else:
            model = wrapper(build("seq"), process_group=ctx.pg, device_id=CPU, use_orig_params=True,
                            sharding_strategy=strategy)
            for mod in model.module:
                for name, p in list(mod._parameters.items()):
                    if p.numel() == 0:
                        continue
                    new = torch.zeros(p.numel() + 1) if strategy is SS.NO_SHARD else torch.zeros(3, p.numel())
                    p.data = new
            x = torch.randn(4, 6)
        got.append(_raises(lambda: model(x)))
    te, ce = got
    mm.check(te is not None and ce is not None, f"torch raised {te!r}, cfsdp raised {ce!r}")
    if te is not None and ce is not None:
        mm.check(isinstance(ce, type(te)), f"cfsdp raised {type(ce).__name__}, torch {type(te).__name__}")
        mm.check(str(ce).startswith(str(te)), f"cfsdp's message {str(ce)!r} does not start with torch's {str(te)!r}")
        fqn = "'head.weight'" if bad == "tied" else "'0.weight'"
        if bad == "tied" or ctx.rank == 0:  # rank 0 holds 0.weight; each rank names its own first
            mm.check(fqn in str(ce), f"cfsdp's message does not name {fqn}: {ce}")
    mm.raise_if_any()
