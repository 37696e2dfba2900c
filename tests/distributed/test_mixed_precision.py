"""MixedPrecision: parity with torch FSDP1 (see worker_mixed_precision.py)."""

import os

import pytest

from launcher import run_worker

LAUNCH_TIMEOUT_S = 420


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_mixed_precision(world_size):
    only = os.environ.get("CFSDP_SUBTESTS")
    run_worker("worker_mixed_precision.py", world_size, args=["--only", only] if only else [],
               timeout=LAUNCH_TIMEOUT_S)
