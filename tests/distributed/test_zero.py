"""cfsdp.optim.ZeroRedundancyOptimizer against torch's ZeroRedundancyOptimizer and plain
DDP + optimizer, bit for bit (see worker_zero.py for what is compared and why it is exact).

One torchrun launch per world size, every subtest in each (they are small: a launch is
the slow part): 2 and 4 ranks on shared memory (the bucket views one host-shared bucket),
3 ranks on the process group (``CFSDP_SHM=0``: the other transport of the parameter sync
and of consolidation, private buckets), and 3 ranks on shared memory again for what the
shared bucket changes (the bucket-view subtests and its rule).
``CFSDP_SUBTESTS=substr`` runs only the matching subtests.
"""

import os
import re
import socket

import pytest

from launcher import failure_message, launch, run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 150
LONG_TIMEOUT_S = 120  # the process group's: a dead peer must be named long before it
DETECT_S = 5.0  # the detection time asserted (measured ~0.1-0.3 s: benchmarks/RESULTS.md)
SHARED_BUCKET_SUBTESTS = "bucket_view=True|shared_bucket"


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,shm", [(2, "1"), (3, "0"), (3, "1"), (4, "1")])
def test_zero(world_size, shm):
    args = subtest_filter()
    if world_size == 3 and shm == "1" and not args:
        args = ["--only", SHARED_BUCKET_SUBTESTS]
    run_worker("worker_zero.py", world_size, args=args, timeout=LAUNCH_TIMEOUT_S,
               env={"CFSDP_SHM": shm})


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
