"""cfsdp.checkpoint.save_full_state_dict / load_full_state_dict (see worker_checkpoint.py).

One torchrun launch at W=2; the checkpoint files go to the test's tmp_path.
``CFSDP_SUBTESTS=substr`` runs only the matching subtests.
"""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 240


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_full_state_dict_checkpoint(tmp_path):
    run_worker("worker_checkpoint.py", 2, args=subtest_filter(), timeout=LAUNCH_TIMEOUT_S,
               env={"CFSDP_CKPT_DIR": str(tmp_path)})
