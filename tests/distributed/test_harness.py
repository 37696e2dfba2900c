"""The distributed harness must fail loudly, never hang: these tests pass when it fails."""

import os
import time
from pathlib import Path

import pytest

from launcher import run_worker

WORKER = "worker_harness_selftest.py"


def _live_workers(script: str) -> list[int]:
    """PIDs of processes still running ``script`` (there must be none after a launch)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if script in cmdline:
                pids.append(int(entry))
    return pids


@pytest.mark.timeout(120)
def test_passing_subtests_pass():
    res = run_worker(WORKER, 2, args=["--only", "ok_"], timeout=90)
    assert "PASS ok_collective" in res.output


@pytest.mark.timeout(150)
def test_one_rank_raises_fails_the_run_with_its_message():
    # rank 0 waits in the all_reduce rank 1 never joins: the 10 s process-group timeout frees it
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as err:
        run_worker(WORKER, 2, args=["--only", "raise_"], timeout=100,
                   env={"CFSDP_TEST_PG_TIMEOUT_S": "10"})
    msg = str(err.value)
    assert "timed out" not in msg, msg
    assert "exited with status" in msg, msg
    assert "FAIL raise_on_rank1_before_collective" in msg, msg
    assert "deliberate failure on rank 1 (harness self-test)" in msg, msg
    assert "[rank 1]" in msg, msg
    # the waiting rank reported too (its collective timed out), and the failure did not leak
    assert "PASS raise_then_next_subtest_passes" in msg, msg
    assert time.monotonic() - t0 < 100
    assert _live_workers(WORKER) == []


@pytest.mark.timeout(120)
def test_one_rank_hangs_times_out_with_a_message():
    timeout = 30
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as err:
        run_worker(WORKER, 2, args=["--only", "hang_"], timeout=timeout)
    elapsed = time.monotonic() - t0
    msg = str(err.value)
    assert f"timed out after {timeout} s" in msg, msg
    assert "sleeping forever (harness self-test)" in msg, msg  # output captured from all ranks
    assert elapsed < timeout + 20, elapsed
    assert _live_workers(WORKER) == [], "workers survived the timeout kill"
