"""The composable face: cfsdp.fully_shard against torch's fully_shard (see worker_fully_shard.py).

One torchrun launch per world size runs every subtest (spawning is the slow part); resharding
runs three launches in sequence sharing the test's tmp_path (save at 2, load and save at 4,
load at 2). ``CFSDP_SUBTESTS=substr`` runs only the matching subtests of the first test;
``CFSDP_FS_SELFTEST=1`` puts torch's own fully_shard in cfsdp's seat (checks the test itself).
"""

import pytest

from launcher import run_reshard_chain, run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 300


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_fully_shard(tmp_path, world_size):
    run_worker("worker_fully_shard.py", world_size, args=subtest_filter(), timeout=LAUNCH_TIMEOUT_S,
               env={"CFSDP_CKPT_DIR": str(tmp_path)})


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("first_ws, second_ws", [(2, 4)])
def test_fully_shard_reshard(tmp_path, first_ws, second_ws):
    """W=2 saves, W=4 loads it (2 -> 4) and saves, W=2 loads that (4 -> 2)."""
    run_reshard_chain("worker_fully_shard.py", "CFSDP_FS_PHASE", tmp_path, first_ws, second_ws, LAUNCH_TIMEOUT_S)
