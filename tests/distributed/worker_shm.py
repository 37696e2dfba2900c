"""cfsdp's shared-memory collectives (comm.py over csrc/shm.c) against gloo, on one host.

Run by tests/distributed/test_shm.py at W = 2, 3 and 4, with ``CFSDP_SHM_SLOT_BYTES`` small
(4096) so that most sizes below run in many pieces through both halves of the double
buffer (``big_default_slot`` sets the default slot back and moves 1.2 M elements).  Every rank
draws its data from a generator seeded by (subtest seed, rank), so every rank can rebuild
every other rank's input.  Each collective goes once through ``cfsdp._runtime.comm`` (shared
memory when ``CFSDP_IMPL=c``; checked with ``comm.uses_shm``) and once straight through gloo
on the same group and data.  Comparisons:

* all-gather, broadcast and all-to-all (uneven blocks, some empty): **bitwise** against gloo;
* reduce-scatter and all-reduce: **bitwise** against the sum kernel's twin
  ``cfsdp._ref.shm_reduce`` over the ranks' inputs in rank order (sum in float32, float64
  for float64, times the scale, one rounding), and against gloo **within**
  ``|shm - gloo| <= (W + 1) * u * scale * sum_r |x_r| + tiny`` elementwise, u the unit
  roundoff of the dtype (2^-24 fp32, 2^-53 fp64, 2^-9 bf16, 2^-11 fp16): gloo adds in the
  tensor's dtype in its own order (W - 1 roundings, each <= u times the partial sum), the
  shared-memory path rounds once (plus W - 1 float32 roundings far below u for bf16/fp16),
  and AVG/scale add one more rounding.  For bf16/fp16 the bound is doubled: gloo's
  half-precision sums were observed up to 2 ulps from the exact result at W = 3 where this
  first-order round-to-nearest bound allows about 1.6 (its bf16 path does not round each
  step to nearest from the exact partial sum).  At W = 2 the sum is one addition, commutative, so
  float32/float64 SUM results are bitwise equal to gloo's too (checked).

Under ``CFSDP_IMPL=python`` (or ``CFSDP_SHM=0``) comm takes the process group: the same
comparisons then check that path, and ``uses_shm`` must be False.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist

import _harness as h
from shm_common import (
    AVG,
    DTYPES,
    EXPECT_SHM,
    SIZES,
    all_data,
    assert_faces_match,
    check_all_ops,
    close_to_gloo,
    data,
    same_bits,
    train_faces,
)

from cfsdp._runtime import comm



def expect_shm(group) -> None:
    assert comm.uses_shm(group) == EXPECT_SHM, (comm.uses_shm(group), EXPECT_SHM)


@h.subtest(grid={"dtype": DTYPES})
def ops_vs_gloo(ctx, dtype):
    expect_shm(ctx.pg)
    check_all_ops(ctx, ctx.pg, dtype, SIZES)
    comm.release(ctx.pg)


def big_default_slot(ctx):
    """1.2 M fp32 elements (4.8 MB) and 0.7 M bf16 ones (1.4 MB) with the default slot
    halves (comm.DEFAULT_SLOT_BYTES, 1 MiB): several pieces for every op."""
    saved = os.environ.pop(comm.SHM_SLOT_ENV, None)
    try:
        expect_shm(ctx.pg)
        for dtype, n in ((torch.float32, 1_200_007), (torch.bfloat16, 700_001)):
            check_all_ops(ctx, ctx.pg, dtype, [n], seed0=7)
    finally:
        if saved is not None:
            os.environ[comm.SHM_SLOT_ENV] = saved
        comm.release(ctx.pg)


h.subtest(big_default_slot)


@h.subtest
def async_out_of_order(ctx):
    """Several async ops of every kind issued before any wait, waited newest first; the
    results are those of running them in issue order (an all-gather issued after an
    all-reduce of the same buffer sees the reduced values)."""
    expect_shm(ctx.pg)
    W, r, n = ctx.world_size, ctx.rank, 2001
    ins = [all_data(100 + k, W, n, torch.float32) for k in range(4)]
    bufs = [x[r].clone() for x in ins]
    pend = [comm.all_reduce(b, ctx.pg, True) for b in bufs]
    gathered = torch.empty(W * n)
    pend.append(comm.all_gather(gathered, bufs[3], ctx.pg, True))
    rs_in = data(200, r, W * n, torch.bfloat16)
    rs_out = torch.empty(n, dtype=torch.bfloat16)
    pend.append(comm.reduce_scatter(rs_out, rs_in, ctx.pg, True, op=AVG))
    bc = data(300, r, n, torch.float16)
    pend.append(comm.broadcast(bc, W - 1, ctx.pg, async_op=True))
    for p in reversed(pend):
        p.wait()
        assert p.is_completed()
    for k, b in enumerate(bufs):
        ref = ins[k][r].clone()
        dist.all_reduce(ref, group=ctx.pg)
        close_to_gloo(b, ref, ins[k], 1.0, f"all_reduce {k}")
    ref = torch.empty(W * n)
    dist.all_gather_into_tensor(ref, bufs[3], group=ctx.pg)
    same_bits(gathered, ref, "all_gather after all_reduce")
    ref = torch.empty(n, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(ref, rs_in.clone(), op=AVG, group=ctx.pg)
    close_to_gloo(rs_out, ref, [data(200, q, W * n, torch.bfloat16)[r * n:(r + 1) * n]
                                for q in range(W)], 1.0 / W, "reduce_scatter")
    same_bits(bc, data(300, W - 1, n, torch.float16), "broadcast")
    comm.release(ctx.pg)


@h.subtest
def overlaps_compute(ctx):
    """A large async all-gather runs on the group's worker while this thread computes
    (the GIL is released); the result is right when waited."""
    expect_shm(ctx.pg)
    W, r, n = ctx.world_size, ctx.rank, 1 << 20
    shard = data(400, r, n, torch.float32)
    out = torch.empty(W * n)
    p = comm.all_gather(out, shard, ctx.pg, True)
    x = torch.randn(256, 256)
    for _ in range(20):
        x = torch.tanh(x @ x.T / 256)
    counter = [0]

    def spin():  # a Python thread can run while the op is in flight
        counter[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    t.join()
    p.wait()
    assert counter[0] == 1
    same_bits(out, torch.cat(all_data(400, W, n, torch.float32)), "all_gather")
    comm.release(ctx.pg)


@h.subtest
def subgroups(ctx):
    """HSDP-style groups from dist.new_group: at W = 4 a 2 x 2 mesh (shard groups {0,1},
    {2,3}, replicate groups {0,2}, {1,3}); at W = 2 two 1-rank groups (process group path);
    at W = 3 {0,1} and {2}.  Each group gets its own segment through its group_name prefix
    in the store; every op is checked against gloo on that group.  Ranks interleave the
    two groups' ops as HSDP does (reduce-scatter in the shard group, all-reduce in the
    replicate group)."""
    W, r = ctx.world_size, ctx.rank
    timeout = comm.group_timeout(ctx.pg)
    from datetime import timedelta
    if W % 2 == 0:
        half = W // 2
        shard_sets = [list(range(k * 2, k * 2 + 2)) for k in range(half)]
        repl_sets = [list(range(k, W, 2)) for k in range(2)]
    else:
        shard_sets, repl_sets = [list(range(W - 1)), [W - 1]], [[q] for q in range(W)]
    mine = {}
    for name, sets in (("shard", shard_sets), ("replicate", repl_sets)):
        for ranks in sets:
            g = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout))
            if r in ranks:
                mine[name] = (g, ranks)
    for name, (g, ranks) in mine.items():
        assert comm.uses_shm(g) == (EXPECT_SHM and len(ranks) >= 2), (name, ranks)
    for name, (g, ranks) in mine.items():
        if len(ranks) >= 2:
            check_all_ops(ctx, g, torch.float32, [1, 1001, 5003], seed0=500)
            check_all_ops(ctx, g, torch.bfloat16, [999], seed0=600)
    # interleaved, async, across both groups
    sg, sranks = mine["shard"]
    rg, rranks = mine["replicate"]
    n = 3001
    inp = data(700, r, len(sranks) * n, torch.float32)
    out = torch.empty(n)
    p1 = comm.reduce_scatter(out, inp, sg, True, op=AVG)
    p1.wait()
    p2 = comm.all_reduce(out, rg, True, op=AVG)
    p2.wait()
    ref = torch.empty(n)
    dist.reduce_scatter_tensor(ref, inp.clone(), op=AVG, group=sg)
    dist.all_reduce(ref, op=AVG, group=rg)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6), (out - ref).abs().max()
    for g, _ in mine.values():
        comm.release(g)
    comm.release(ctx.pg)


@h.subtest
def fallback_and_ordering(ctx):
    """Ineligible calls take the process group with the same results: int64, strided,
    MAX; an ineligible op issued after async shared-memory ops on the same buffer sees
    their results (the queue is drained first), and a shared-memory op issued after an
    async process-group op sees its result."""
    expect_shm(ctx.pg)
    W, r, n = ctx.world_size, ctx.rank, 513
    ints = torch.arange(n, dtype=torch.int64) * (r + 1)
    comm.all_reduce(ints, ctx.pg, False)
    assert torch.equal(ints, torch.arange(n, dtype=torch.int64) * (W * (W + 1) // 2))
    strided = data(800, r, 2 * n, torch.float32)[::2]
    ref = data(800, r, 2 * n, torch.float32)[::2]
    comm.all_reduce(strided, ctx.pg, False)
    dist.all_reduce(ref, group=ctx.pg)  # the same process-group call on the same strided view
    same_bits(strided, ref, "strided all_reduce")
    t = torch.full((n,), float(r + 1))
    p1 = comm.all_reduce(t, ctx.pg, True)  # shared memory: t = W(W+1)/2
    p2 = comm.all_reduce(t, ctx.pg, True, op=dist.ReduceOp.MAX)  # process group, after p1
    p3 = comm.all_reduce(t, ctx.pg, True, scale=0.5)  # shared memory, after p2
    for p in (p3, p2, p1):
        p.wait()
    assert torch.equal(t, torch.full((n,), W * (W + 1) / 2 * W * 0.5)), t[:3]
    # an ineligible *reduction* (MIN) also waits for the async shared-memory op before it: a
    # large buffer keeps the shared-memory sum running long enough that a MIN reading the
    # buffer early would see a rank's own 1 or 2 (it once gave a wrong result under load)
    big = torch.full((1 << 22,), float(r + 1))
    p1 = comm.all_reduce(big, ctx.pg, True)
    p2 = comm.all_reduce(big, ctx.pg, True, op=dist.ReduceOp.MIN)
    p2.wait()
    p1.wait()
    assert torch.equal(big, torch.full_like(big, W * (W + 1) / 2)), big.unique()
    # the process group's scale is a post-multiply
    small = torch.ones(n, dtype=torch.int64)
    comm.all_reduce(small, ctx.pg, False, scale=3)
    assert torch.equal(small, torch.full((n,), 3 * W, dtype=torch.int64))
    # default group (None) works too
    d = torch.full((5,), float(r))
    comm.all_reduce(d, None, False)
    assert torch.equal(d, torch.full((5,), float(sum(range(W)))))
    comm.release(ctx.pg)


@h.subtest(grid={"transport": ["shared memory", "process group"]})
def process_group_work_waited_once(ctx, transport: str):
    """A process-group op's work is waited for once.  gloo's reduce-scatter work copies its
    result into the output again on every ``wait()``, and the next op on the group first
    waits for the group's last process-group op (shared memory: "Ordering"; the process
    group: "One in flight on gloo"): a second wait would silently undo what was done to the
    output in place since (HSDP's all-reduce, a post-divide).  On shared memory the
    reduce-scatter takes the process group through an ineligible op (MAX)."""
    import gloo_in_flight

    group = ctx.pg if transport == "shared memory" else gloo_in_flight.process_group_only()
    assert comm.uses_shm(group) == (transport == "shared memory"), comm.describe(group)
    W, n = ctx.world_size, 5
    out = torch.empty(n)
    comm.reduce_scatter(out, torch.full((W * n,), 2.0), group, True, op=dist.ReduceOp.MAX).wait()
    assert torch.equal(out, torch.full((n,), 2.0)), out
    out.mul_(10)  # used in place, as HSDP's all-reduce uses it
    comm.all_reduce(torch.ones(n), group, False)  # waits for the group's last op first
    assert torch.equal(out, torch.full((n,), 20.0)), f"the output was written again: {out}"


@h.subtest
def dev_shm_is_clean(ctx):
    """After set-up nothing of cfsdp is left in /dev/shm (the name is unlinked at once)."""
    expect_shm(ctx.pg)
    t = torch.ones(3)
    comm.all_reduce(t, ctx.pg, False)
    left = [e for e in os.listdir("/dev/shm") if e.startswith(f"cfsdp-{os.getpid()}-")]
    assert left == [], left
    comm.release(ctx.pg)


@h.subtest(grid={"face": ["fsdp1", "fsdp1_orig_params", "fully_shard"], "model": ["mlp", "lm"]})
def training_vs_torch(ctx, face, model):
    """Training on the default transport (shared memory, on at every world size) against
    torch's FSDP on gloo (the same face, model, seed and data): bitwise at W = 2 (every sum
    has two terms), within fp32 rounding at W >= 3 (rtol 1e-5: the sums add the ranks in
    rank order, gloo in its ring's order; see the module doc)."""
    expect_shm(ctx.pg)
    assert_faces_match(ctx, train_faces(ctx, face, model), face)
    # and the path really was taken: cfsdp's groups here are ctx.pg (checked above)
    comm.release(ctx.pg)


if __name__ == "__main__":
    h.main()
