"""cfsdp.optim.ZeroRedundancyOptimizer against torch's ZeroRedundancyOptimizer and plain
DDP + optimizer, bit for bit (see worker_zero.py for what is compared and why it is exact).

One torchrun launch per world size, every subtest in each (they are small: a launch is
the slow part): 2 and 4 ranks on shared memory, 3 ranks on the process group
(``CFSDP_SHM=0``: the other transport of the parameter sync and of consolidation).
``CFSDP_SUBTESTS=substr`` runs only the matching subtests.
"""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 150
SHM = {2: "1", 3: "0", 4: "1"}


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero(world_size):
    run_worker("worker_zero.py", world_size, args=subtest_filter(), timeout=LAUNCH_TIMEOUT_S,
               env={"CFSDP_SHM": SHM[world_size]})
