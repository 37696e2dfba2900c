"""register_comm_hook: torch's default hooks and a custom hook, and its errors."""

from __future__ import annotations

import copy

from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as SS

import _harness as h
from cfsdp import FullyShardedDataParallel as CFSDP
from parity_common import CPU, LOSSES, Mismatches, build, make_batches, make_optim, make_policy


@h.subtest(grid={"hook": ["default", "custom"],
                 "strategy": [SS.FULL_SHARD, SS.SHARD_GRAD_OP, SS.NO_SHARD]})
def comm_hook(ctx, hook: str, strategy):
    """register_comm_hook with torch's default hooks (allreduce_hook for NO_SHARD,
    reduce_scatter_hook otherwise) and a custom hook: bitwise against torch FSDP1; the custom
    hook sees the state it was given, the padded unsharded gradient and the shard-sized output,
    once per unit per backward. (torch's fp16/bf16 compression hooks call ``record_stream`` and
    fail on CPU tensors inside torch's own hook code, so they cannot run on CPU ranks.)"""
    from torch.distributed.algorithms._comm_hooks import default_hooks as dh

    mm = Mismatches(ctx)
    base = build("transformer")
    record = []
    for wrapper in (TorchFSDP, CFSDP):
        model = wrapper(copy.deepcopy(base), process_group=ctx.pg, device_id=CPU, sharding_strategy=strategy,
                        auto_wrap_policy=make_policy("module"))
        calls = []
        state = dh.DefaultState(ctx.pg)
        fn = dh.allreduce_hook if strategy == SS.NO_SHARD else dh.reduce_scatter_hook
        if hook == "custom":
            inner = fn

            def fn(st, grad, output=None, _inner=inner, _calls=calls, _state=state):
                _calls.append((st is _state, grad.numel(), None if output is None else output.numel()))
                return _inner(st, grad) if output is None else _inner(st, grad, output)
        model.register_comm_hook(state, fn)
        opt = make_optim("sgd", model.parameters())
        losses, grads = [], []
        for chunks in make_batches("transformer", ctx.world_size, steps=3):
            x, y = chunks[ctx.rank]
            loss = LOSSES["transformer"](model(x), y)
            loss.backward()
            losses.append(loss.detach())
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        units = [m for m in model.modules() if isinstance(m, wrapper) and m._flat_param is not None]
        record.append((losses, grads, calls, len(units)))
    (tl, tg, tcalls, tunits), (cl, cg, ccalls, cunits) = record
    for i, (a, b) in enumerate(zip(cl, tl)):
        mm.tensors(f"loss at step {i}", a, b)
    for s_, (ga, gb) in enumerate(zip(cg, tg)):
        for i, (a, b) in enumerate(zip(ga, gb)):
            mm.tensors(f"step {s_}: grad of parameter #{i}", a, b)
    if hook == "custom":
        mm.check(ccalls == tcalls, f"hook calls (state ok, grad numel, output numel): cfsdp {ccalls} != torch {tcalls}")
        mm.check(len(ccalls) == 3 * cunits and all(c[0] for c in ccalls),
                 f"custom hook called {len(ccalls)} times for {cunits} units x 3 steps, or with a wrong state")
    mm.raise_if_any()


@h.subtest
def comm_hook_errors(ctx):
    """As torch: only on the root, only once, not with hybrid strategies, only callables."""
    from torch.distributed.algorithms._comm_hooks import default_hooks as dh

    mm = Mismatches(ctx)
    model = CFSDP(build("transformer"), process_group=ctx.pg, device_id=CPU,
                  auto_wrap_policy=make_policy("module"))
    state = dh.DefaultState(ctx.pg)
    inner = next(m for m in model.modules() if isinstance(m, CFSDP) and m is not model)
    model.check_is_root()
    for what, fn, exc in (("non-root", lambda: inner.register_comm_hook(state, dh.reduce_scatter_hook), AssertionError),
                          ("not callable", lambda: model.register_comm_hook(state, 3), ValueError)):
        try:
            fn()
        except exc:
            pass
        else:
            mm.add(f"register_comm_hook {what}: no {exc.__name__}")
    model.register_comm_hook(state, dh.reduce_scatter_hook)
    try:
        model.register_comm_hook(state, dh.reduce_scatter_hook)
    except AssertionError as e:
        mm.check("already" in str(e), f"second registration: {e}")
    else:
        mm.add("a second register_comm_hook did not raise")
    mm.raise_if_any()
