"""MixedPrecision: parity with torch FSDP1 (see worker_mixed_precision.py)."""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 420
# at 4 ranks: these subtests only (see [Note: coverage at 4 ranks] in launcher.py)
AT_4 = "strategy=FULL_SHARD"


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_mixed_precision(world_size):
    run_worker("worker_mixed_precision.py", world_size, args=subtest_filter(world_size, AT_4),
               timeout=LAUNCH_TIMEOUT_S)
