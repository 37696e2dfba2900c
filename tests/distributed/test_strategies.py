"""Sharding strategies (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, _HYBRID_SHARD_ZERO2)
and no_sync(): parity with torch FSDP1 (see worker_strategies.py).

One pytest item per registered subtest (every point of its grid) and world size, named
``test_strategies[W-feature-subtest]`` after the feature module ``strategies/<feature>.py`` that
registers it (``-k no_sync``, ``-k "2-tied"``); still ONE torchrun launch per world size (see
subtest_items.py). At 4 ranks only the subtests matching AT_4 run, so only those have items.
"""

import pytest

from subtest_items import Launch, SplitWorker

LAUNCH_TIMEOUT_S = 420
# at 4 ranks: these subtests only (see [Note: coverage at 4 ranks] in launcher.py)
# (no_sync_dtypes' mixed-precision configurations, 20 points at 4 ranks, keep one each of the
# hybrid strategies there: the configurations do not depend on the world size)
AT_4 = ("strategy_parity[strategy=HYBRID|strategy_parity[strategy=_HYBRID|hybrid|odd"
        "|no_sync_accumulation[strategy=HYBRID|no_sync_accumulation[strategy=_HYBRID"
        "|writes_inside_no_sync[strategy=HYBRID|writes_inside_no_sync[strategy=_HYBRID"
        "|orig_param_attributes[strategy=HYBRID|orig_param_attributes[strategy=_HYBRID"
        "|no_sync_dtypes[strategy=HYBRID_SHARD,config=bf16,"
        "|no_sync_dtypes[strategy=_HYBRID_SHARD_ZERO2,config=cpu_offload,"
        "|orig_param_writes[strategy=FULL_SHARD"
        "|no_sync_unit_not_reached[strategy=HYBRID|no_sync_unit_not_reached[strategy=_HYBRID"
        "|params_unused_on_some_ranks[strategy=HYBRID|params_unused_on_some_ranks[strategy=_HYBRID")
WORKER = SplitWorker("worker_strategies.py", [Launch("2", 2), Launch("4", 4, only=AT_4)],
                     timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    return WORKER.launcher(request, tmp_path_factory)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size, launch, feature, name", WORKER.cases())
def test_strategies(launches, world_size, launch, feature, name):
    WORKER.check(launches(launch), launch, feature, name)
