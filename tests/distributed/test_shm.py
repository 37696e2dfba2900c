"""Shared-memory collectives (cfsdp._runtime.comm over csrc/shm.c) against gloo; see
worker_shm.py for what is compared and the tolerances.

One torchrun launch per world size (2, 3, 4) runs every subtest, with 4 KiB slot halves so
that most sizes run in many pieces.  A separate launch per world size (2 and 3) has a slow,
then a stopped, then a killed peer (worker_shm_dead_peer.py) under a long process-group
timeout (120 s): the first two collectives complete, and the kill, mid-collective, fails
every survivor within seconds (designed for ~0.2 s; asserted < DETECT_S on this loaded
machine) naming the dead rank and the host; /dev/shm holds nothing of the run afterwards.
Another launch per case kills a rank inside the set-up window (worker_shm_setup_kill.py):
the survivors remove the segment.
One launch per world size (2 and 3) runs worker_shm_setup.py: two groups set up from two
threads at once, and set-ups that time out naming what the absent rank did not do.
``CFSDP_SUBTESTS=substr`` runs only the matching subtests.
"""

import os
import re
import socket

import pytest

from launcher import failure_message, launch, run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 120
# always the C core with shared memory on, whatever the suite's CFSDP_IMPL / CFSDP_SHM:
# these launches test that path (the twin pass's CFSDP_IMPL=python would turn it off)
SHM_ON = {"CFSDP_IMPL": "c", "CFSDP_SHM": "1"}
SLOT_ENV = {**SHM_ON, "CFSDP_SHM_SLOT_BYTES": "4096"}
LONG_TIMEOUT_S = 120  # the process group's: a dead peer must be named long before it
DETECT_S = 5.0  # the detection time asserted (measured ~0.1-0.3 s: benchmarks/RESULTS.md)


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


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 3])
def test_dead_peer_fails_every_survivor(world_size):
    res = launch("worker_shm_dead_peer.py", world_size, timeout=150,
                 env={**SLOT_ENV, "CFSDP_TEST_PG_TIMEOUT_S": str(LONG_TIMEOUT_S)})
    out = res.output
    assert not res.timed_out, failure_message(res)
    assert res.returncode != 0, "the dead rank's exit status must fail the run:\n" + out
    pids = [int(p) for p in re.findall(r"RANK rank=\d+ pid=(\d+)", out)]
    assert len(pids) == world_size, out
    dead = world_size - 1
    for phase in (1, 2):  # the slow and the stopped peer: no failure
        ok = re.findall(rf"PHASE {phase} rank=(\d+) ok", out)
        assert sorted(int(r) for r in ok) == list(range(world_size)), (phase, out)
    (killed_at,) = [float(t) for t in re.findall(rf"KILL rank={dead} at=([\d.]+)", out)]
    lines = re.findall(r"SURVIVOR rank=(\d+) pid=\d+ at=([\d.]+) (.*)", out)
    assert sorted(int(r) for r, _, _ in lines) == list(range(world_size - 1)), out
    host = socket.gethostname()
    for rank, at, msg in lines:
        assert msg.startswith("error="), out
        assert f"rank {dead} (global rank {dead}) on host '{host}' died" in msg, msg
        assert "all_reduce" in msg and "cfsdp shm group" in msg, msg
        took = float(at) - killed_at
        print(f"rank {rank}: failed {took:.3f} s after the kill")
        assert took < DETECT_S, (rank, took, msg)
    assert cfsdp_segments_of(pids) == [], "segments left in /dev/shm"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size,where,survivors", [
    (3, "creator_before_name", "stay"), (3, "creator_after_name", "stay"),
    (3, "before_attach", "stay"), (3, "after_attach", "stay"), (2, "after_attach", "stay"),
    (2, "after_attach", "sigterm"), (3, "creator_before_name", "sigterm"),
    (3, "before_attach", "sigterm")])
def test_kill_in_setup_window_leaves_nothing(world_size, where, survivors):
    """A rank SIGKILLed inside the set-up window (worker_shm_setup_kill.py, at a fixed
    point): the survivors' set-up fails after the (short) timeout, and nothing named after
    any rank of the run is left in /dev/shm, whichever rank created the segment.  With
    ``sigterm`` torchrun's SIGTERM ends the survivors at once, as it does without a test
    around it: after the last rank attached, the name is gone already (that rank removed
    it); before, the survivors' SIGTERM handler of the window removes it
    (``comm._unlink_on_sigterm``), whether the creator is alive or the rank that died."""
    res = launch("worker_shm_setup_kill.py", world_size, timeout=120,
                 env={**SHM_ON, "CFSDP_TEST_PG_TIMEOUT_S": "10",
                      "CFSDP_TEST_SETUP_KILL": where, "CFSDP_TEST_SURVIVORS": survivors})
    out = res.output
    assert not res.timed_out, failure_message(res)
    pids = [int(p) for p in re.findall(r"RANK rank=\d+ pid=(\d+)", out)]
    assert len(pids) == world_size, out
    (dead,) = [int(r) for r in re.findall(r"KILL rank=(\d+)", out)]
    lines = re.findall(r"SURVIVOR rank=(\d+) (.*)", out)
    alive = [] if survivors == "sigterm" else sorted(set(range(world_size)) - {dead})
    assert sorted(int(r) for r, _ in lines) == alive, out
    assert all(msg.startswith("error=") for _, msg in lines), out
    assert cfsdp_segments_of(pids) == [], f"left in /dev/shm: {cfsdp_segments_of(pids)}"
