"""Workers that must make the harness fail (used by test_harness.py), selected with --only.

* ``ok_*``:          pass on every rank (the harness is not failing everything);
* ``raise_*``:       rank 1 raises before an all_reduce that the other ranks enter, so they
                     sit in the collective until the process-group timeout; the next subtest
                     runs on a fresh group and passes (the failure does not leak);
* ``hang_*``:        rank 1 never returns; only the launcher's timeout can end the run.
"""

import sys
import time

import torch
import torch.distributed as dist

import _harness as h


def _sum_of_ranks(ctx) -> None:
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t, group=ctx.pg)
    assert t.item() == sum(range(ctx.world_size)), t


@h.subtest
def ok_collective(ctx):
    _sum_of_ranks(ctx)


@h.subtest
def raise_on_rank1_before_collective(ctx):
    if ctx.rank == 1:
        raise ValueError("deliberate failure on rank 1 (harness self-test)")
    _sum_of_ranks(ctx)


@h.subtest
def raise_then_next_subtest_passes(ctx):
    _sum_of_ranks(ctx)


@h.subtest
def hang_on_rank1(ctx):
    if ctx.rank == 1:
        print("[rank 1] sleeping forever (harness self-test)", flush=True)
        while True:
            time.sleep(3600)
    _sum_of_ranks(ctx)


if __name__ == "__main__":
    h.main()
