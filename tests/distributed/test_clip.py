"""FullyShardedDataParallel.clip_grad_norm_ against torch FSDP1 (see worker_clip.py).

One torchrun launch per world size runs every clip subtest.
``CFSDP_SUBTESTS=substr`` runs only the subtests whose name contains ``substr``.
"""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 180


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_clip_grad_norm_parity(world_size):
    run_worker("worker_clip.py", world_size, args=subtest_filter(), timeout=LAUNCH_TIMEOUT_S)
