"""FullyShardedDataParallel.clip_grad_norm_ against torch FSDP1 (see worker_clip.py).

One torchrun launch per world size runs every clip subtest.
``CFSDP_SUBTESTS=substr`` runs only the subtests whose name contains ``substr``.
"""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 180
# at 4 ranks: these subtests only (see [Note: coverage at 4 ranks] in launcher.py)
AT_4 = "odd|HYBRID"


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_clip_grad_norm_parity(world_size):
    run_worker("worker_clip.py", world_size, args=subtest_filter(world_size, AT_4), timeout=LAUNCH_TIMEOUT_S)
