"""Bad input to cfsdp.FullyShardedDataParallel under a real process group (W=2).

The no-process-group case is a unit test: tests/unit/test_errors_nopg.py.
"""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 180


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_fsdp1_bad_input():
    run_worker("worker_errors.py", 2, args=subtest_filter(), timeout=LAUNCH_TIMEOUT_S)
