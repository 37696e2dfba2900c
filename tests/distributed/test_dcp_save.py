"""cfsdp.checkpoint.dcp_save across ranks, with ranks SIGKILLed mid-save (see worker_dcp_save.py
and dcp_kill.py).

One torchrun launch at W=2: the kill scenarios run their ranks as forked children of the two
torchrun ranks, so a killed rank costs a fork, not a launch.  ``CFSDP_SUBTESTS=substr`` runs
only the matching subtests.
"""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 240


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_dcp_save_survives_killed_ranks(tmp_path):
    run_worker("worker_dcp_save.py", 2, args=subtest_filter(), timeout=LAUNCH_TIMEOUT_S,
               env={"CFSDP_CKPT_DIR": str(tmp_path)})
