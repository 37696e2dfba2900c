"""The composable face: cfsdp.fully_shard against torch's fully_shard (see worker_fully_shard.py).

One torchrun launch per world size runs every subtest (spawning is the slow part); resharding
runs two launches in sequence sharing the test's tmp_path (save at one world size, load at the
other). ``CFSDP_SUBTESTS=substr`` runs only the matching subtests of the first test;
``CFSDP_FS_SELFTEST=1`` puts torch's own fully_shard in cfsdp's seat (checks the test itself).
"""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 300


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_fully_shard(tmp_path, world_size):
    run_worker("worker_fully_shard.py", world_size, args=subtest_filter(), timeout=LAUNCH_TIMEOUT_S,
               env={"CFSDP_CKPT_DIR": str(tmp_path)})


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("save_ws, load_ws", [(4, 2), (2, 4)])
def test_fully_shard_reshard(tmp_path, save_ws, load_ws):
    for phase, ws in (("reshard_save", save_ws), ("reshard_load", load_ws)):
        run_worker("worker_fully_shard.py", ws, timeout=LAUNCH_TIMEOUT_S,
                   env={"CFSDP_CKPT_DIR": str(tmp_path), "CFSDP_FS_PHASE": phase})
