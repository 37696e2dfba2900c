"""cfsdp across emulated hosts (run by test_hosts.py through emulated_hosts.py: one torchrun
per network namespace, each with its own /dev/shm and host name).

``CFSDP_EMULATED_HOSTS`` (H) and torchrun's ``LOCAL_WORLD_SIZE`` (k) give the layout; the
world group is host-major (group rank = host * k + local rank).  Subtests:

* ``transport``: what the set-up decided for the world group: the process group at k = 1
  (one rank per host), two levels at k >= 2;
* ``faces_vs_torch``: both faces (FSDP1 flat, FSDP1 orig params, fully_shard) train a tiny
  transformer against torch's FSDP on gloo, same seed and data: **bitwise** at W = 2 (every
  sum has two terms), within ``rtol=1e-5`` at W = 4 (two levels add the ranks in their
  documented order, gloo in its ring's: fp32 rounding, as test_shm's W >= 3);
* at W = 2 also the full parity suites of one scenario per face (worker_parity.run_parity,
  worker_fully_shard.run_scenario): bitwise against torch and checked against the
  single-process model;
* ``two_level_collectives`` (k >= 2): every collective through cfsdp against the
  single-process oracle of the documented two-level order (``cfsdp._ref.shm_reduce``, the
  twin, host sums in local-rank order then over hosts: **bitwise**) and against gloo on the
  same group (all-gather, broadcast and all-to-all bitwise, sums within worker_shm's
  tolerance), with async ops waited out of order and process-group ops interleaved (ordering);
* ``bytes_between_hosts`` (k >= 2): this host's link counter around one all-gather and one
  reduce-scatter: two levels send (H - 1) x k blocks per host, the least any algorithm can;
  gloo's flat collectives on the same group more (measured, and bounded here);
* ``hsdp_*`` (k >= 2): HSDP with one shard group per host (shared memory) and replicate
  groups across hosts (the process group): fully_shard on a (replicate 2, shard 2) mesh and
  the wrapper's HYBRID_SHARD with process_group=None (cfsdp builds the host groups from
  torchrun's LOCAL_WORLD_SIZE), both bitwise against torch;
* ``dcp_save`` (k >= 2): worker_dcp's resharding save; test_hosts.py loads it on one host.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import ShardingStrategy as SS

import _harness as h
import dcp_common as dcc
import fs_common as fsc
import parity_common as pc
import shm_common as shmc

from cfsdp._ref import shm_reduce as ref_reduce
from cfsdp._runtime import comm

HOSTS = int(os.environ["CFSDP_EMULATED_HOSTS"])
PER_HOST = int(os.environ["LOCAL_WORLD_SIZE"])
TWO_LEVEL = PER_HOST >= 2
SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
shmc.EXPECT_SHM = False  # worker_shm's checks against its one-level twin do not apply here


def expect_transport(group, want: str) -> str:
    got = comm.describe(group)
    if not got.startswith(want):
        raise AssertionError(f"transport of group {group.group_name}: {got!r}, expected "
                             f"{want!r}...")
    return got


@h.subtest
def transport(ctx):
    if TWO_LEVEL:
        got = expect_transport(ctx.pg, "two levels")
        assert f"{HOSTS} hosts x {PER_HOST} ranks" in got, got
    else:
        got = expect_transport(ctx.pg, "process group")
        assert f"{HOSTS} ranks on {HOSTS} hosts" in got, got
    assert comm.uses_shm(ctx.pg) == TWO_LEVEL
    comm.release(ctx.pg)


# ------------------------------------------------------------------------------ training


@h.subtest(grid={"face": ["fsdp1", "fsdp1_orig_params", "fully_shard"]})
def faces_vs_torch(ctx, face):
    """worker_shm's transformer on both faces against torch's FSDP (see the module doc)."""
    shmc.assert_faces_match(ctx, shmc.train_faces(ctx, face, "lm"), face)
    expect_transport(ctx.pg, "two levels" if TWO_LEVEL else "process group")
    comm.release(ctx.pg)


if not TWO_LEVEL:
    @h.subtest(grid={"use_orig_params": [False, True]})
    def wrapper_parity(ctx, use_orig_params):
        """worker_parity's whole comparison (structure, losses, grads, params, summon, state
        dict; torch against the single process) for the transformer, across hosts."""
        pc.run_parity(ctx, "transformer", use_orig_params, "adamw", pc.wrap_root)
        comm.release(ctx.pg)

    @h.subtest
    def fully_shard_parity(ctx):
        """worker_fully_shard's whole comparison for its transformer, across hosts."""
        fsc.run_scenario(ctx, fsc.Scenario(kind="lm"))
        comm.release(ctx.pg)


# --------------------------------------------------------------------------- collectives


def oracle(blocks: list, scale: float) -> torch.Tensor:
    """The documented two-level sum of one block per group rank (host-major), computed in
    this process with the twin kernel: each host's blocks in local-rank order, rounded; then
    the host sums in host order, times ``scale``, rounded once."""
    sums = []
    for q in range(HOSTS):
        p = torch.empty_like(blocks[0])
        ref_reduce(p, blocks[q * PER_HOST:(q + 1) * PER_HOST], 1.0)
        sums.append(p)
    out = torch.empty_like(blocks[0])
    ref_reduce(out, sums, scale)
    return out


def check_ops(group, dtype, sizes, seed0: int) -> None:
    W, r = group.size(), group.rank()
    for i, n in enumerate(sizes):
        seed = seed0 + 10 * i
        shard = shmc.data(seed, r, n, dtype)
        out, ref = torch.empty(W * n, dtype=dtype), torch.empty(W * n, dtype=dtype)
        comm.all_gather(out, shard, group, async_op=True).wait()
        dist.all_gather_into_tensor(ref, shard, group=group)
        shmc.same_bits(out, ref, f"all_gather {dtype} n={n}")
        out2 = torch.zeros(W * n, dtype=dtype)
        out2[r * n:(r + 1) * n] = shard
        comm.all_gather(out2, out2[r * n:(r + 1) * n], group, async_op=False)
        shmc.same_bits(out2, ref, f"all_gather in place {dtype} n={n}")
        full = shmc.all_data(seed + 1, W, W * n, dtype)
        chunks = [x[r * n:(r + 1) * n] for x in full]
        for op, scale in ((SUM, None), (AVG, None), (SUM, 0.125)):
            eff = (1.0 if scale is None else scale) / (W if op == AVG else 1)
            got = torch.empty(n, dtype=dtype)
            comm.reduce_scatter(got, full[r], group, True, op=op, scale=scale).wait()
            what = f"reduce_scatter {dtype} n={n} op={op} scale={scale}"
            shmc.same_bits(got, oracle(chunks, eff), what + " vs the two-level oracle")
            ref = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(ref, full[r].clone(), op=op, group=group)
            if scale is not None:
                ref.mul_(scale)
            shmc.close_to_gloo(got, ref, chunks, eff, what)
        ins = shmc.all_data(seed + 2, W, n, dtype)
        for op in (SUM, AVG):
            eff = 1.0 / W if op == AVG else 1.0
            t, ref = ins[r].clone(), ins[r].clone()
            comm.all_reduce(t, group, True, op=op).wait()
            what = f"all_reduce {dtype} n={n} op={op}"
            shmc.same_bits(t, oracle(ins, eff), what + " vs the two-level oracle")
            dist.all_reduce(ref, op=op, group=group)
            shmc.close_to_gloo(t, ref, ins, eff, what)
        for root in range(W):
            t = shmc.data(seed + 3, r, n, dtype)
            ref = t.clone()
            comm.broadcast(t, root, group, async_op=True).wait()
            dist.broadcast(ref, group=group, group_src=root)
            shmc.same_bits(t, ref, f"broadcast {dtype} n={n} root={root}")
        shmc.check_all_to_all(group, dtype, n, seed + 4)


if TWO_LEVEL:
    @h.subtest(grid={"dtype": shmc.DTYPES})
    def two_level_collectives(ctx, dtype):
        expect_transport(ctx.pg, "two levels")
        check_ops(ctx.pg, dtype, shmc.SIZES, seed0=0)
        for bad in (-1, ctx.pg.size()):  # refused on every rank before any rank sends
            try:
                comm.broadcast(torch.zeros(4, dtype=dtype), bad, ctx.pg, async_op=False)
            except ValueError as e:
                assert "is not a rank of the group" in str(e), e
            else:
                raise AssertionError(f"broadcast from source rank {bad} was not refused")
        comm.release(ctx.pg)

    @h.subtest
    def two_level_big_default_slot(ctx):
        """1.2 M fp32 elements with the default slot: many pieces in every segment op."""
        saved = os.environ.pop(comm.SHM_SLOT_ENV, None)
        try:
            expect_transport(ctx.pg, "two levels")
            check_ops(ctx.pg, torch.float32, [300_007], seed0=7)
        finally:
            if saved is not None:
                os.environ[comm.SHM_SLOT_ENV] = saved
            comm.release(ctx.pg)

    @h.subtest
    def two_level_ordering(ctx):
        """Async two-level ops of every kind issued before any wait and waited newest first,
        with process-group ops (int64, MAX) in between: the results of running them in issue
        order."""
        expect_transport(ctx.pg, "two levels")
        W, r, n = ctx.world_size, ctx.rank, 2001
        ins = [shmc.all_data(100 + k, W, n, torch.float32) for k in range(3)]
        bufs = [x[r].clone() for x in ins]
        pend = [comm.all_reduce(b, ctx.pg, True) for b in bufs]
        ints = torch.arange(n, dtype=torch.int64) * (r + 1)
        pend.append(comm.all_reduce(ints, ctx.pg, True))  # the process group, after the lane
        gathered = torch.empty(W * n)
        pend.append(comm.all_gather(gathered, bufs[2], ctx.pg, True))  # sees the reduced bufs[2]
        mx = torch.full((n,), float(r))
        pend.append(comm.all_reduce(mx, ctx.pg, True, op=dist.ReduceOp.MAX))
        pend.append(comm.all_reduce(mx, ctx.pg, True, scale=0.5))  # the lane, after the MAX
        for p in reversed(pend):
            p.wait()
            assert p.is_completed()
        for k, b in enumerate(bufs):
            shmc.same_bits(b, oracle(ins[k], 1.0), f"all_reduce {k}")
        assert torch.equal(ints, torch.arange(n, dtype=torch.int64) * (W * (W + 1) // 2))
        shmc.same_bits(gathered, torch.cat([bufs[2]] * W), "all_gather after all_reduce")
        assert torch.equal(mx, torch.full((n,), (W - 1) * W * 0.5)), mx[:3]
        comm.release(ctx.pg)

    def _link_bytes() -> int:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())

    def _measured(ctx, fn) -> int:
        """Bytes this host sent while ``fn`` ran on every rank (barriers around it: every
        rank of the host reads the counter before any starts ``fn``)."""
        dist.barrier(group=ctx.pg)
        before = _link_bytes()
        dist.barrier(group=ctx.pg)
        fn()
        dist.barrier(group=ctx.pg)
        time.sleep(0.2)  # the counter of the last packets
        return _link_bytes() - before

    @h.subtest
    def bytes_between_hosts(ctx):
        """One all-gather and one reduce-scatter of 1 MiB fp32 blocks, through the two
        levels and through gloo's flat collectives on the same group: this host's link
        counter (both local ranks send on it).  Two levels: each local rank sends its block
        (all-gather) or its host's partial sum (reduce-scatter) to its peer on each other
        host: (H - 1) x k blocks per host, plus headers and the barriers."""
        W, r, n = ctx.world_size, ctx.rank, 1 << 18
        block = n * 4
        expect_transport(ctx.pg, "two levels")
        shard = shmc.data(900, r, n, torch.float32)
        out = torch.empty(W * n)
        inp = shmc.data(901, r, W * n, torch.float32)
        red = torch.empty(n)
        two_ag = _measured(ctx, lambda: comm.all_gather(out, shard, ctx.pg, False))
        two_rs = _measured(ctx, lambda: comm.reduce_scatter(red, inp, ctx.pg, False))
        flat_ag = _measured(ctx, lambda: dist.all_gather_into_tensor(out, shard, group=ctx.pg))
        flat_rs = _measured(ctx, lambda: dist.reduce_scatter_tensor(red, inp.clone(),
                                                                     group=ctx.pg))
        least = (HOSTS - 1) * PER_HOST * block
        ctx.log(f"bytes sent by this host for {block} B blocks: two levels all_gather {two_ag}, "
                f"reduce_scatter {two_rs}; gloo all_gather {flat_ag}, reduce_scatter {flat_rs}; "
                f"least possible {least}")
        for what, got in (("all_gather", two_ag), ("reduce_scatter", two_rs)):
            assert least <= got <= 1.1 * least, (what, got, least)
        assert flat_ag >= 1.3 * two_ag and flat_rs >= 2 * two_rs, (flat_ag, flat_rs)
        comm.release(ctx.pg)

    # ------------------------------------------------------------------------------ HSDP

    @h.subtest
    def hsdp_fully_shard(ctx):
        """(replicate 2, shard 2) mesh: the shard groups are the hosts."""
        mesh = fsc.mesh_2d(ctx)
        expect_transport(mesh.get_group("shard"), "shared memory")
        expect_transport(mesh.get_group("replicate"), "process group")
        fsc.run_scenario(ctx, fsc.Scenario(kind="lm"), mesh=mesh)
        for g in (mesh.get_group("shard"), mesh.get_group("replicate")):
            comm.release(g)

    @h.subtest(grid={"use_orig_params": [False, True]})
    def hsdp_wrapper_default_groups(ctx, use_orig_params):
        """HYBRID_SHARD with process_group=None: cfsdp builds a shard group per host (torchrun's
        LOCAL_WORLD_SIZE, checked against the host names); torch FSDP1 gets the same groups
        from torch's builder (on CPU torch cannot build them itself, see strategies/parity.py)."""
        from torch.distributed.fsdp._init_utils import _init_intra_and_inter_node_groups

        groups = _init_intra_and_inter_node_groups(dist.distributed_c10d._get_default_group(),
                                                   PER_HOST)
        expect_transport(groups[0], "shared memory")
        expect_transport(groups[1], "process group")
        kw = dict(process_group=groups, sharding_strategy=SS.HYBRID_SHARD,
                  auto_wrap_policy=pc.make_policy("module"))
        pc.run_parity(ctx, "transformer", use_orig_params, "adamw", pc.wrap_root,
                      fsdp_kwargs=kw, cfsdp_kwargs={"process_group": None}, steps=4)
        for g in groups:
            comm.release(g)

    @h.subtest
    def dcp_save(ctx):
        """Train and save with DCP across the hosts (worker_dcp's resharding save at W = 4);
        test_hosts.py loads it on one host at W = 2 and checks the next losses."""
        dcc.reshard_save(ctx)


if __name__ == "__main__":
    h.main()
