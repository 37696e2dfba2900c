"""cfsdp.checkpoint.state_dict and torch.distributed.checkpoint with cfsdp (see worker_dcp.py).

One torchrun launch per world size for the parity/round-trip subtests; resharding runs three
launches in sequence sharing the test's tmp_path (save at 2, load and save at 4, load at 2).
``CFSDP_SUBTESTS=substr`` runs only the matching subtests of the first test.
"""

import pytest

from launcher import run_reshard_chain, run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 240
# at 4 ranks: these subtests only (see [Note: coverage at 4 ranks] in launcher.py)
AT_4 = "HYBRID|dcp_cross_load"


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_dcp_state_dict(tmp_path, world_size):
    run_worker("worker_dcp.py", world_size, args=subtest_filter(world_size, AT_4), timeout=LAUNCH_TIMEOUT_S,
               env={"CFSDP_CKPT_DIR": str(tmp_path)})


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("first_ws, second_ws", [(2, 4)])
def test_dcp_reshard(tmp_path, first_ws, second_ws):
    """W=2 saves, W=4 loads it (2 -> 4) and saves, W=2 loads that (4 -> 2)."""
    run_reshard_chain("worker_dcp.py", "CFSDP_DCP_PHASE", tmp_path, first_ws, second_ws, LAUNCH_TIMEOUT_S)
