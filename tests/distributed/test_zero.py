"""cfsdp.optim.ZeroRedundancyOptimizer against torch's ZeroRedundancyOptimizer and plain
DDP + optimizer, bit for bit (see worker_zero.py for what is compared and why it is exact).

One torchrun launch per configuration, every subtest in each (they are small: a launch is
the slow part): 2 and 4 ranks on shared memory (the bucket views one host-shared bucket),
3 ranks on the process group (``CFSDP_SHM=0``: the other transport of the parameter sync
and of consolidation, private buckets), and 3 ranks on shared memory again for what the
shared bucket changes (the bucket-view subtests and its rule). One pytest item per registered
subtest and configuration, named ``test_zero[<W>-<shm|pg>-feature-subtest]`` after the feature
module ``zero/<feature>.py`` that registers it (``-k "2-shm-join"``; see subtest_items.py).
``CFSDP_SUBTESTS=substr`` runs only the matching subtests.
"""

import os
import re
import socket

import pytest

from launcher import failure_message, launch
from subtest_items import Launch, SplitWorker

LAUNCH_TIMEOUT_S = 150
LONG_TIMEOUT_S = 120  # the process group's: a dead peer must be named long before it
DETECT_S = 5.0  # the detection time asserted (measured ~0.1-0.3 s: benchmarks/RESULTS.md)
SHARED_BUCKET_SUBTESTS = "bucket_view=True|shared_bucket"
WORKER = SplitWorker("worker_zero.py", [
    Launch("2-shm", 2, {"CFSDP_SHM": "1"}),
    Launch("3-pg", 3, {"CFSDP_SHM": "0"}),
    Launch("3-shm", 3, {"CFSDP_SHM": "1"}, only=SHARED_BUCKET_SUBTESTS),
    Launch("4-shm", 4, {"CFSDP_SHM": "1"}),
], timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    return WORKER.launcher(request, tmp_path_factory)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size, launch, feature, name", WORKER.cases())
def test_zero(launches, world_size, launch, feature, name):
    WORKER.check(launches(launch), launch, feature, name)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 3])
def test_killed_rank_leaves_nothing(world_size):
    """A rank SIGKILLed mid-training with the shared bucket (worker_zero_kill.py), under a
    long process-group timeout: every survivor's step fails within seconds of the kill (its
    barrier on the group's segment names the dead rank and its host), and /dev/shm holds
    nothing of the run (the bucket's file was unlinked once every rank had mapped it)."""
    res = launch("worker_zero_kill.py", world_size, timeout=150,
                 env={"CFSDP_IMPL": "c", "CFSDP_SHM": "1",
                      "CFSDP_TEST_PG_TIMEOUT_S": str(LONG_TIMEOUT_S)})
    out = res.output
    assert not res.timed_out, failure_message(res)
    assert res.returncode != 0, "the dead rank's exit status must fail the run:\n" + out
    ranks = re.findall(r"RANK rank=(\d+) pid=(\d+) shared=(\w+) bucket=(\S+)", out)
    assert len(ranks) == world_size and all(s == "True" for _, _, s, _ in ranks), out
    assert len({b for _, _, _, b in ranks}) == 1, out
    dead = world_size - 1
    (killed_at,) = [float(t) for t in re.findall(rf"KILL rank={dead} at=([\d.]+)", out)]
    lines = re.findall(r"SURVIVOR rank=(\d+) at=([\d.]+) (.*)", out)
    assert sorted(int(r) for r, _, _ in lines) == list(range(dead)), out
    for rank, at, msg in lines:
        assert msg.startswith("error="), out
        assert f"rank {dead} (global rank {dead}) on host '{socket.gethostname()}' died" in msg, msg
        took = float(at) - killed_at
        print(f"rank {rank}: failed {took:.3f} s after the kill")
        assert took < DETECT_S, (rank, took, msg)
    pids = [int(p) for _, p, _, _ in ranks]
    left = [e for e in os.listdir("/dev/shm") if any(e.startswith(f"cfsdp-{p}-") for p in pids)]
    assert left == [], f"left in /dev/shm: {left}"
