"""Sharding strategies, no_sync(), CPU offload and frozen parameters: cfsdp against torch FSDP1 (and the single process).

Run by test_strategies.py under torchrun (gloo, CPU) at W=2 and W=4; every subtest runs in one
spawn (see _harness.py). Hybrid strategies need a 2-D layout, so they run at W=4 only, as
2 replicas x 2 shards, with the groups given both as a 2-D ``device_mesh`` and as a
``(shard_group, replicate_group)`` tuple.

Tolerances: cfsdp vs torch FSDP1 is **bitwise** everywhere here, for the reasons given in
worker_parity.py (same fp32 ops in the same order, same collectives, same divide factors).
For HSDP the gradient is reduce-scattered within the shard group, all-reduced across replicas
and divided by torch's factors for the whole data-parallel size, in that order, as torch does.
"""

from __future__ import annotations

import contextlib
from typing import Any
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as SS
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

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
    mse_loss,
    run_parity,
    train_fsdp,
    train_ref,
    wrap_odd,
    wrap_root,
)

HYBRID = (SS.HYBRID_SHARD, SS._HYBRID_SHARD_ZERO2)
_MESH = {}


def hybrid_mesh():
    """A (replicate=2, shard=W/2) mesh over all ranks, made once per spawn."""
    if "mesh" not in _MESH:
        _MESH["mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2))
    return _MESH["mesh"]


def groups_kw(ctx, strategy, how: str) -> dict:
    if strategy not in HYBRID:
        return {"process_group": ctx.pg}
    mesh = hybrid_mesh()
    if how == "mesh":
        return {"process_group": None, "device_mesh": mesh}
    return {"process_group": (mesh.get_group(1), mesh.get_group(0))}


def strategies(world: int) -> list:
    out = [SS.SHARD_GRAD_OP, SS.NO_SHARD]
    return out + list(HYBRID) if world == 4 else out


# one grid for both world sizes: hybrid points are skipped at W=2 inside the subtest
GRID_STRATEGIES = [SS.FULL_SHARD, SS.SHARD_GRAD_OP, SS.NO_SHARD, *HYBRID]


@h.subtest(grid={"strategy": GRID_STRATEGIES, "use_orig_params": [False, True], "how": ["tuple", "mesh"]})
def strategy_parity(ctx, strategy, use_orig_params: bool, how: str):
    """Losses, grads, params, summon and state dict against torch FSDP1 and the single process."""
    if strategy in HYBRID and ctx.world_size < 4:
        return
    if strategy not in HYBRID and how == "mesh":
        return
    kw = dict(groups_kw(ctx, strategy, how), sharding_strategy=strategy,
              auto_wrap_policy=make_policy("module"))
    run_parity(ctx, "transformer", use_orig_params, "adamw", wrap_root, fsdp_kwargs=kw, steps=6)


@h.subtest(grid={"strategy": list(HYBRID), "local_world_size": [2, 4], "use_orig_params": [False, True]})
def hybrid_default_groups(ctx, strategy, local_world_size: int, use_orig_params: bool):
    """HYBRID_SHARD / _HYBRID_SHARD_ZERO2 with process_group=None and an auto-wrap policy: the
    root builds torch's intra-node (shard) and inter-node (replicate) groups itself, a CPU
    host's ranks (LOCAL_WORLD_SIZE) being its node, and shares them with every unit.  Oracle:
    torch FSDP1 given the same groups from torch's own builder (bitwise) and the single
    process.  torch itself with process_group=None sizes a node by the accelerator count, 1 on
    CPU: it shards over one rank, switches to NO_SHARD and never all-reduces across ranks, so
    each rank trains alone (its signature is asserted below, so a torch fix is noticed).
    LOCAL_WORLD_SIZE=2 at W=4 stands for 2 hosts x 2 ranks (torchrun sets it per host)."""
    if ctx.world_size < 4:
        return
    import os

    from torch.distributed.fsdp._init_utils import _init_intra_and_inter_node_groups

    old = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    try:
        groups = _init_intra_and_inter_node_groups(dist.distributed_c10d._get_default_group(),
                                                   local_world_size)
        kw = dict(process_group=groups, sharding_strategy=strategy,
                  auto_wrap_policy=make_policy("module"))
        run_parity(ctx, "transformer", use_orig_params, "adamw", wrap_root, fsdp_kwargs=kw,
                   cfsdp_kwargs={"process_group": None}, steps=4)
        if local_world_size == 2 and strategy is SS.HYBRID_SHARD and not use_orig_params:
            t = TorchFSDP(build("transformer"), sharding_strategy=strategy, device_id=CPU,
                          auto_wrap_policy=make_policy("module"))
            if not (t.sharding_strategy is SS.NO_SHARD and t.process_group.size() == 1):
                raise AssertionError("torch's HYBRID_SHARD with process_group=None on CPU no "
                                     "longer shards over one rank: revisit cfsdp's groups")
    finally:
        if old is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = old


@h.subtest(grid={"strategy": list(HYBRID), "how": ["tuple", "mesh"], "use_orig_params": [False, True]})
def hybrid_sync_module_states(ctx, strategy, how: str, use_orig_params: bool):
    """sync_module_states=True with a hybrid strategy makes every rank's parameters and
    buffers rank 0's, across the replicate groups too (torch FSDP1 broadcasts over the
    inter-node group, then the shard group; cfsdp broadcast over the shard group only, so
    each replica kept its own initial values and the replicas trained apart).  Each rank
    builds the model from its own seed.  torch FSDP1 rejects sync_module_states for CPU
    modules ("requires them to be on GPU"), so the oracle is the model built with rank 0's
    seed in this process (as worker_parity's sync_module_states), and two training steps
    from it on the single process."""
    if ctx.world_size < 4:
        return
    mm = Mismatches(ctx)
    expected = build("odd", seed=100)  # what rank 0 builds below
    expected.bn.running_mean.add_(0.25)
    local = build("odd", seed=100 + ctx.rank)
    local.bn.running_mean.add_(0.25 + ctx.rank)
    model = wrap_odd(CFSDP, local, **groups_kw(ctx, strategy, how), sharding_strategy=strategy,
                     use_orig_params=use_orig_params, device_id=CPU, sync_module_states=True)
    sd, exp = model.state_dict(), expected.state_dict()
    mm.check(list(sd) == list(exp), f"keys {list(sd)} != {list(exp)}")
    for k, v in exp.items():
        mm.tensors(f"state_dict[{k}] after sync_module_states", sd.get(k), v,
                   a_name="cfsdp", b_name="rank0 model")
    mm.raise_if_any()
    batches = make_batches("odd", ctx.world_size, steps=2)
    c_losses, _ = train_fsdp(model, make_optim("sgd", model.parameters()), batches, mse_loss,
                             ctx.rank)
    r_losses, _ = train_ref(expected, make_optim("sgd", expected.parameters()), batches, mse_loss)
    for step in range(2):
        mm.tensors(f"cfsdp-vs-ref loss at step {step}", c_losses[step], r_losses[step][ctx.rank],
                   exact=False, b_name="ref")  # the single process sums in another order
    mm.raise_if_any()


@h.subtest
def hybrid_manual_wrap_needs_groups(ctx):
    """Without an auto-wrap policy the units could not share groups: torch's ValueError."""
    errs = []
    for w in (TorchFSDP, CFSDP):
        try:
            w(build("seq"), sharding_strategy=SS.HYBRID_SHARD, device_id=CPU)
        except ValueError as e:
            errs.append(str(e))
        else:
            errs.append(None)
    t, c = errs
    if t is None or c is None or t not in c:
        raise AssertionError(f"torch: {t!r}; cfsdp: {c!r} (must contain torch's message)")


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


# parameters written after wrapping (one in each unit kind: root, a block, the root's LayerNorm)
WRITTEN = (("pos", None), ("blocks.1.mlp.0", "weight"), ("ln_f", "bias"), ("blocks.0.attn.q", "bias"))


def _written(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of each WRITTEN parameter, found through attributes as a user would
    (``model``: a wrapper, or the unwrapped single-process model)."""
    root = model.module if isinstance(model, (TorchFSDP, CFSDP)) else model
    out = []
    for path, name in WRITTEN:
        if name is None:
            out.append((root, path))
            continue
        mod = root
        for part in path.split("."):
            mod = getattr(mod, part)
        mod = mod.module if isinstance(mod, (TorchFSDP, CFSDP)) else mod
        out.append((mod, name))
    return out


ORIG_WRITES = ["data", "grad", "grad_none", "new_param", "summon", "state_dict", "clip"]


def _orig_params_model(ctx, strategy) -> tuple[nn.Module, dict]:
    """The transformer and the wrapper arguments (use_orig_params=True, a unit per module) of
    the subtests on the original parameters."""
    kw = dict(groups_kw(ctx, strategy, "tuple"), use_orig_params=True, device_id=CPU,
              sharding_strategy=strategy, auto_wrap_policy=make_policy("module"))
    return build("transformer"), kw


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


class TiedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class TiedLM(nn.Module):
    """Embedding and output head share one weight (GPT-2 style)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.Sequential(TiedBlock(), TiedBlock())
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.blocks(self.emb(x)))


@h.subtest(grid={"use_orig_params": [False, True], "policy": ["blocks", "none"]})
def tied_parameters(ctx, use_orig_params: bool, policy: str):
    """Tied embedding/head in the root unit (the way torch allows): losses, names and the
    full state dict (both FQNs present, as torch) bitwise equal to torch FSDP1. Tying across
    two units is refused with a ValueError naming the parameter (torch trains it wrongly)."""
    mm = Mismatches(ctx)
    torch.manual_seed(0)
    base = TiedLM()
    record = []
    for wrapper in (TorchFSDP, CFSDP):
        pol = ModuleWrapPolicy({TiedBlock}) if policy == "blocks" else None
        model = wrapper(copy.deepcopy(base), process_group=ctx.pg, device_id=CPU,
                        use_orig_params=use_orig_params, auto_wrap_policy=pol)
        opt = make_optim("adamw", model.parameters())
        g = torch.Generator().manual_seed(ctx.rank)
        losses = []
        for _ in range(4):
            x = torch.randint(0, 11, (3, 5), generator=g)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        record.append((losses, [n for n, _ in model.named_parameters()], model.state_dict()))
    (tl, tn, tsd), (cl, cn, csd) = record
    for i, (a, b) in enumerate(zip(cl, tl)):
        mm.tensors(f"loss at step {i}", a, b)
    mm.check(cn == tn, f"named_parameters {cn} != torch {tn}")
    mm.check(list(csd) == list(tsd), f"state_dict keys {list(csd)} != torch {list(tsd)}")
    for k in tsd:
        mm.tensors(f"state_dict[{k}]", csd.get(k), tsd[k])
    try:
        CFSDP(copy.deepcopy(base), process_group=ctx.pg, use_orig_params=use_orig_params,
              auto_wrap_policy=ModuleWrapPolicy({nn.Embedding, nn.Linear}))
    except ValueError as e:
        mm.check("weight" in str(e) and "common ancestor" in str(e), f"tied across units: {e}")
    else:
        mm.add("tied parameters across two units did not raise")
    mm.raise_if_any()


class OrderBlock(nn.Module):
    def __init__(self, extra: int):
        super().__init__()
        self.lin = nn.Linear(8, 8 + extra)  # a different size per unit, to tell them apart

    def forward(self, x):
        return torch.relu(self.lin(x))[..., :8]


_COLLECTIVES = {"all_gather": "AG", "all_gather_into_tensor": "AG", "all_gather_single": "AG",
                "reduce_scatter_tensor": "RS", "reduce_scatter_single": "RS"}


@contextlib.contextmanager
def record_collectives(events: list):
    """Record (kind, numel) of every all-gather / reduce-scatter issued, by patching
    torch.distributed (torch's FSDP1 calls through it) and cfsdp's comm.py (whose
    shared-memory path does not call torch.distributed; a comm call that falls back to
    the process group is recorded once)."""
    from cfsdp._runtime import comm

    saved = {name: getattr(dist, name) for name in _COLLECTIVES}
    saved_comm = {"all_gather": comm.all_gather, "reduce_scatter": comm.reduce_scatter}
    inside_comm = [0]

    def make(name, orig):
        def fn(*args, **kwargs):
            out = args[0]
            if not inside_comm[0]:
                events.append((_COLLECTIVES[name], sum(t.numel() for t in out) if isinstance(out, list) else out.numel()))
            return orig(*args, **kwargs)
        return fn

    def make_comm(kind, orig):
        def fn(*args, **kwargs):
            events.append((kind, args[0].numel()))
            inside_comm[0] += 1
            try:
                return orig(*args, **kwargs)
            finally:
                inside_comm[0] -= 1
        return fn

    try:
        for name, orig in saved.items():
            setattr(dist, name, make(name, orig))
        for name, orig in saved_comm.items():
            setattr(comm, name, make_comm("AG" if name == "all_gather" else "RS", orig))
        yield
    finally:
        for name, orig in saved.items():
            setattr(dist, name, orig)
        for name, orig in saved_comm.items():
            setattr(comm, name, orig)


@h.subtest(grid={"backward_prefetch": [BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST, None],
                 "forward_prefetch": [False, True]})
def collective_order(ctx, backward_prefetch, forward_prefetch: bool):
    """The order of all-gathers and reduce-scatters in a steady-state step (the third), as
    torch's prefetch tests check it: identical to torch FSDP1's, except that with
    forward_prefetch=True torch 2.13 also all-gathers one unit further ahead in backward
    (BACKWARD_PRE and None); there cfsdp's order is the one backward_prefetch alone asks for,
    checked against torch with forward_prefetch=False."""
    mm = Mismatches(ctx)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8), OrderBlock(1), OrderBlock(2), OrderBlock(3), nn.Linear(8, 1))
    seqs = []
    for wrapper, fp in ((TorchFSDP, forward_prefetch), (CFSDP, forward_prefetch), (TorchFSDP, False)):
        model = wrapper(copy.deepcopy(base), process_group=ctx.pg, device_id=CPU,
                        auto_wrap_policy=ModuleWrapPolicy({OrderBlock}),
                        backward_prefetch=backward_prefetch, forward_prefetch=fp)
        events: list = []
        g = torch.Generator().manual_seed(ctx.rank)
        for _ in range(3):
            events.clear()
            with record_collectives(events):
                model(torch.randn(4, 8, generator=g)).sum().backward()
        seqs.append(events)
    torch_seq, cfsdp_seq, torch_nofp = seqs
    expected = torch_seq
    if forward_prefetch and backward_prefetch != BackwardPrefetch.BACKWARD_POST:
        expected = torch_nofp
    mm.check(cfsdp_seq == expected, f"collectives issued in a step:\n    cfsdp {cfsdp_seq}\n    torch {expected}")
    mm.raise_if_any()


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


if __name__ == "__main__":
    h.main()
