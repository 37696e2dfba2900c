"""cfsdp.optim on both faces (FSDP1 wrapper with use_orig_params False/True, fully_shard)
against torch.optim on the same face: bitwise losses, parameters and optimizer state dicts,
and resume from saved state dicts (see worker_optim.py); cfsdp.optim.Muon on the wrapper's flat
shards against the all-gather-everywhere Muon (muon_wrapper*).

One torchrun launch per world size. ``CFSDP_SUBTESTS=substr`` runs only the matching subtests.
"""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 240  # 4 ranks took 116 s once on a loaded machine
# at 4 ranks: these subtests only (see [Note: coverage at 4 ranks] in launcher.py): every
# optimizer parity subtest, one Muon-on-the-wrapper case (and it in small buckets), transposed
# weights (their memory-order ranges straddle more ranks) and the agreement on cleared gradients
AT_4 = ("parity_and_resume|muon_wrapper[case=orig_adamw]|muon_wrapper_buckets[case=orig_adamw]"
        "|muon_wrapper[case=orig_strided]|muon_wrapper_cleared")


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_optim(world_size):
    run_worker("worker_optim.py", world_size, args=subtest_filter(world_size, AT_4), timeout=LAUNCH_TIMEOUT_S)
