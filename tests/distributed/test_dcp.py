"""cfsdp.checkpoint.state_dict and torch.distributed.checkpoint with cfsdp (see worker_dcp.py).

One torchrun launch per world size for the parity/round-trip subtests; resharding runs two
launches in sequence sharing the test's tmp_path (save at one world size, load at the other).
``CFSDP_SUBTESTS=substr`` runs only the matching subtests of the first test.
"""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 240
# at 4 ranks: these subtests only (see [Note: coverage at 4 ranks] in launcher.py)
AT_4 = "dcp_roundtrip|dcp_cross_load"


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_dcp_state_dict(tmp_path, world_size):
    run_worker("worker_dcp.py", world_size, args=subtest_filter(world_size, AT_4), timeout=LAUNCH_TIMEOUT_S,
               env={"CFSDP_CKPT_DIR": str(tmp_path)})


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("save_ws, load_ws", [(4, 2), (2, 4)])
def test_dcp_reshard(tmp_path, save_ws, load_ws):
    for phase, ws in (("reshard_save", save_ws), ("reshard_load", load_ws)):
        run_worker("worker_dcp.py", ws, timeout=LAUNCH_TIMEOUT_S,
                   env={"CFSDP_CKPT_DIR": str(tmp_path), "CFSDP_DCP_PHASE": phase})
