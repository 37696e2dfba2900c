"""Training parity of every sharding strategy (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD,
_HYBRID_SHARD_ZERO2) with torch FSDP1 and the single process, and the hybrid strategies' groups:
default groups, sync_module_states, manual wrapping."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as SS

import _harness as h
from cfsdp import FullyShardedDataParallel as CFSDP
from parity_common import (
    CPU,
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
from strategies.common import GRID_STRATEGIES, groups_kw, HYBRID, one_rank_shard_mesh


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
def hybrid_one_rank_shard_groups(ctx, strategy, how: str, use_orig_params: bool):
    """A hybrid strategy whose shard groups hold one rank each (a ``(W, 1)`` mesh, or such a
    ``(shard, replicate)`` tuple): sharding over one rank is a no-op, so cfsdp trains it as
    NO_SHARD over the replicate group, gradients averaged over every rank: bitwise torch
    FSDP1's NO_SHARD on the world group, and the single process.  torch's own hybrid strategy
    there switches to NO_SHARD over the one-rank shard group and never all-reduces across
    the replicate group, so each rank trains alone on its own data (measured, torch 2.13;
    its signature is asserted below, so a torch fix is noticed)."""
    mesh = one_rank_shard_mesh()
    groups = ({"process_group": None, "device_mesh": mesh} if how == "mesh" else
              {"process_group": (mesh.get_group(1), mesh.get_group(0))})
    policy = make_policy("module")
    run_parity(ctx, "transformer", use_orig_params, "adamw", wrap_root,
               fsdp_kwargs=dict(sharding_strategy=SS.NO_SHARD, auto_wrap_policy=policy),
               cfsdp_kwargs=dict(groups, sharding_strategy=strategy), steps=4)
    if how == "mesh" and not use_orig_params:
        t = TorchFSDP(build("transformer"), sharding_strategy=strategy, device_id=CPU,
                      auto_wrap_policy=policy, **groups)
        if not (t.sharding_strategy is SS.NO_SHARD and t.process_group.size() == 1):
            raise AssertionError("torch's hybrid strategy on one-rank shard groups no longer "
                                 "trains each rank alone: revisit cfsdp's _one_rank_no_shard")


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


@h.subtest(grid={"strategy": ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]})
def recorded_streams(ctx, strategy: str):
    """torch FSDP1's streams in the wrapper under the recording device layer (stream_check.py;
    tests/unit/test_streams_flat.py runs it at world 1, sharded over one rank): two steps with
    gloo's collectives, the happens-before checker passes, losses and parameters bitwise those
    of the same run without the recorder, the all-gathers on the unshard stream and the
    reductions on the post-backward stream.  The ordering logic only: nothing here runs on a
    GPU."""
    import stream_check as sc

    kw = dict(sharding_strategy=SS[strategy], limit_all_gathers=True, forward_prefetch=True)
    want = sc.train_wrapper(None, seed=ctx.rank, **kw)
    rec = sc.RecordingDevice()
    got = sc.train_wrapper(rec, seed=ctx.rank, **kw)
    sc.check(rec.log)
    sc.assert_same(want, got)
    on_current = [op for op in rec.ops_on(sc.CURRENT) if op.startswith("c10d.")]
    if on_current:
        raise AssertionError(f"collectives on the current stream: {on_current}")
    expect = [("post_backward", "c10d.allreduce_.default" if strategy == "NO_SHARD"
               else "c10d._reduce_scatter_base_.default")]
    if strategy != "NO_SHARD":
        expect.append(("unshard", "c10d._allgather_base_.default"))
    for stream, op in expect:
        if op not in rec.ops_on(stream):
            raise AssertionError(f"no {op} on the {stream} stream")
