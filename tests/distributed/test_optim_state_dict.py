"""Optimizer state dicts of cfsdp.FullyShardedDataParallel against torch FSDP1: all eight static
methods, saved and loaded, bitwise parity and resumed training (see worker_optim_state_dict.py).

One torchrun launch per world size. ``CFSDP_SUBTESTS=substr`` runs only the matching subtests.
"""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 240
# at 4 ranks: these subtests only (see [Note: coverage at 4 ranks] in launcher.py)
AT_4 = "bad_input|strategy=FULL_SHARD,optim=adamw|hybrid|strided"


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_optim_state_dict(world_size):
    run_worker("worker_optim_state_dict.py", world_size, args=subtest_filter(world_size, AT_4), timeout=LAUNCH_TIMEOUT_S)
