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

import pytest

from launcher import failure_message, launch, run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 150
SHARED_BUCKET_SUBTESTS = "bucket_view=True|shared_bucket"


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,shm", [(2, "1"), (3, "0"), (3, "1"), (4, "1")])
def test_zero(world_size, shm):
    args = subtest_filter()
    if world_size == 3 and shm == "1" and not args:
        args = ["--only", SHARED_BUCKET_SUBTESTS]
    run_worker("worker_zero.py", world_size, args=args, timeout=LAUNCH_TIMEOUT_S,
               env={"CFSDP_SHM": shm})


@pytest.mark.timeout(150)
def test_killed_rank_leaves_nothing():
    """A rank killed mid-training with the shared bucket (worker_zero_kill.py): the
    survivor's step fails within the timeout naming the dead rank, and /dev/shm holds
    nothing of the run (the bucket's file was unlinked once both ranks had mapped it)."""
    timeout_s = 10  # the init's gloo connect too: 3 s failed on the loaded 2-core machine
    res = launch("worker_zero_kill.py", 2, timeout=90,
                 env={"CFSDP_IMPL": "c", "CFSDP_SHM": "1",
                      "CFSDP_TEST_PG_TIMEOUT_S": str(timeout_s)})
    out = res.output
    assert not res.timed_out, failure_message(res)
    assert res.returncode != 0, "the dead rank's exit status must fail the run:\n" + out
    ranks = re.findall(r"RANK rank=(\d+) pid=(\d+) shared=(\w+) bucket=(\S+)", out)
    assert len(ranks) == 2 and all(s == "True" for _, _, s, _ in ranks), out
    assert len({b for _, _, _, b in ranks}) == 1, out
    (line,) = re.findall(r"SURVIVOR rank=0 elapsed=([\d.]+) (.*)", out)
    assert line[1].startswith("error=") and "rank(s) 1 (global 1) did not arrive" in line[1], out
    assert float(line[0]) < timeout_s + 5, line
    pids = [int(p) for _, p, _, _ in ranks]
    left = [e for e in os.listdir("/dev/shm") if any(e.startswith(f"cfsdp-{p}-") for p in pids)]
    assert left == [], f"left in /dev/shm: {left}"
