"""torch's private FSDP names that trainers touch: what cfsdp supports, against torch's FSDP1
and FSDP2, and the AttributeError of the rest (see worker_internals.py).

One torchrun launch at 2 ranks (nothing here depends on the world size beyond sharding).
``CFSDP_SUBTESTS=substr`` runs only the matching subtests.
"""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 180


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_internals():
    run_worker("worker_internals.py", 2, args=subtest_filter(), timeout=LAUNCH_TIMEOUT_S)
