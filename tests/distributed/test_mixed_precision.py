"""MixedPrecision: parity with torch FSDP1 (see worker_mixed_precision.py)."""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 420


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_mixed_precision(world_size):
    run_worker("worker_mixed_precision.py", world_size, args=subtest_filter(),
               timeout=LAUNCH_TIMEOUT_S)
