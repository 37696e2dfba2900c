"""Sharding strategies (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, _HYBRID_SHARD_ZERO2)
and no_sync(): parity with torch FSDP1 (see worker_strategies.py)."""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 420
# at 4 ranks: these subtests only (see [Note: coverage at 4 ranks] in launcher.py)
AT_4 = "HYBRID|odd|hybrid|orig_param_writes[strategy=FULL_SHARD"


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_strategies_and_no_sync(world_size):
    run_worker("worker_strategies.py", world_size, args=subtest_filter(world_size, AT_4),
               timeout=LAUNCH_TIMEOUT_S)
