"""A process group without rank 0 (group ranks are not global ranks)."""

from __future__ import annotations

import torch.distributed as dist

import _harness as h
from zero.common import STEPS, Trio


@h.subtest(grid={"bucket_view": [False, True]})
def subgroup_without_rank_0(ctx, bucket_view):
    """A group of ranks 1..W-1 (group ranks differ from global ones; at W = 2 a group of
    one rank): parity of all three inside it."""
    W = ctx.world_size
    sub = dist.new_group(list(range(1, W)), backend="gloo", timeout=h.PG_TIMEOUT)
    if ctx.rank == 0:
        return
    t = Trio(sub, "cfsdp_adamw", bucket_view)
    t.train(STEPS)
    t.check_same()
    t.check_state_dicts()
