"""Shared-memory collectives (cfsdp._runtime.comm over csrc/shm.c) against gloo; see
worker_shm.py for what is compared and the tolerances.

One torchrun launch per world size (2, 3, 4) runs every subtest, with 4 KiB slot halves so
that most sizes run in many pieces.  A separate launch per world size (2 and 3) kills a
peer between two collectives: the survivors must fail within the process-group timeout
naming it, and /dev/shm must hold nothing of the run afterwards.  One launch per world
size (2 and 3) runs worker_shm_setup.py: two groups set up from two threads at once, and
set-ups that time out naming what the absent rank did not do.
``CFSDP_SUBTESTS=substr`` runs only the matching subtests.
"""

import os
import re

import pytest

from launcher import failure_message, launch, run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 120
# always the C core with shared memory on, whatever the suite's CFSDP_IMPL / CFSDP_SHM:
# these launches test that path (the twin pass's CFSDP_IMPL=python would turn it off)
SHM_ON = {"CFSDP_IMPL": "c", "CFSDP_SHM": "1"}
SLOT_ENV = {**SHM_ON, "CFSDP_SHM_SLOT_BYTES": "4096"}


def cfsdp_segments_of(pids):
    return [e for e in os.listdir("/dev/shm")
            if any(e.startswith(f"cfsdp-{pid}-") for pid in pids)]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shm_collectives_vs_gloo(world_size):
    res = run_worker("worker_shm.py", world_size, args=subtest_filter(),
                     timeout=LAUNCH_TIMEOUT_S, env=SLOT_ENV)
    assert "subtests:" in res.output


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_set_up_threads_and_timeouts(world_size):
    res = run_worker("worker_shm_setup.py", world_size, args=subtest_filter(),
                     timeout=LAUNCH_TIMEOUT_S, env=SHM_ON)
    assert "subtests:" in res.output


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 3])
def test_dead_peer_fails_every_survivor(world_size):
    timeout_s = 3
    res = launch("worker_shm_dead_peer.py", world_size, timeout=90,
                 env={**SHM_ON, "CFSDP_TEST_PG_TIMEOUT_S": str(timeout_s)})
    out = res.output
    assert not res.timed_out, failure_message(res)
    assert res.returncode != 0, "the dead rank's exit status must fail the run:\n" + out
    pids = [int(p) for p in re.findall(r"RANK rank=\d+ pid=(\d+)", out)]
    assert len(pids) == world_size, out
    dead = world_size - 1
    lines = re.findall(r"SURVIVOR rank=(\d+) pid=\d+ elapsed=([\d.]+) (.*)", out)
    assert sorted(int(r) for r, _, _ in lines) == list(range(world_size - 1)), out
    for rank, elapsed, msg in lines:
        assert msg.startswith("error="), out
        assert f"rank(s) {dead} (global {dead}) did not arrive" in msg, msg
        assert "all_gather" in msg and "cfsdp shm group" in msg, msg
        assert float(elapsed) < timeout_s + 5, (rank, elapsed)
    assert cfsdp_segments_of(pids) == [], "segments left in /dev/shm"
