"""summon_full_params options, activation checkpointing, torch.compile and robustness cases
of cfsdp.FullyShardedDataParallel against torch FSDP1 (see worker_summon.py).

One torchrun launch per world size. ``CFSDP_SUBTESTS=substr`` runs only the matching subtests.
"""

import os

import pytest

from launcher import run_worker

LAUNCH_TIMEOUT_S = 240


def _only():
    only = os.environ.get("CFSDP_SUBTESTS")
    return ["--only", only] if only else []


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_summon_ac_compile_robustness(world_size):
    run_worker("worker_summon.py", world_size, args=_only(), timeout=LAUNCH_TIMEOUT_S)
