"""FSDP1 parity of cfsdp.FullyShardedDataParallel (see worker_parity.py for what is compared).

One torchrun launch per world size runs every parity subtest (spawning is the slow part).
``CFSDP_SUBTESTS=substr`` runs only the subtests whose name contains ``substr``.
"""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 420  # W=4 on 2 shared cores takes ~100 s for the whole grid
# at 4 ranks: these subtests only (see [Note: coverage at 4 ranks] in launcher.py)
AT_4 = "odd|strided"


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp1_parity(world_size):
    run_worker("worker_parity.py", world_size, args=subtest_filter(world_size, AT_4), timeout=LAUNCH_TIMEOUT_S)
