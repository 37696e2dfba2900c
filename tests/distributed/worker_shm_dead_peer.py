"""A peer that dies between two shared-memory collectives (run by test_shm.py).

Not a harness worker: the run is meant to fail.  Every rank sets up the shared-memory path
with one all-reduce (gloo group timeout ``CFSDP_TEST_PG_TIMEOUT_S``, short), then the last
rank ``os._exit(1)``s before the next collective.  The survivors must get a RuntimeError from
the all-gather within the timeout, naming the dead rank; each prints one line that the test
checks: ``SURVIVOR rank=<r> pid=<pid> elapsed=<s> error=<message>`` (or ``NO ERROR``).
torchrun sends SIGTERM to the survivors as soon as the dead rank exits; they ignore it so they
can report (torchrun kills them with SIGKILL after its grace period, far longer than this).
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from cfsdp._runtime import comm

TIMEOUT_S = float(os.environ.get("CFSDP_TEST_PG_TIMEOUT_S", "3"))


def say(line: str) -> None:
    """One line in one write(2): the ranks share torchrun's pipe, and print() writes the text
    and its newline separately, so two ranks' lines could interleave."""
    os.write(1, (line.replace("\n", " ") + "\n").encode())


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    say(f"RANK rank={rank} pid={os.getpid()}")
    t = torch.ones(1000)
    comm.all_reduce(t, None, False)  # set-up + one collective
    assert comm.uses_shm(None)
    assert float(t[0]) == world
    if rank == world - 1:
        sys.stdout.flush()
        os._exit(1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = torch.empty(world * 1000)
    t0 = time.monotonic()
    try:
        comm.all_gather(out, t, None, async_op=True).wait()
        msg = "NO ERROR"
    except RuntimeError as e:
        msg = "error=" + str(e).replace("\n", " ")
    say(f"SURVIVOR rank={rank} pid={os.getpid()} elapsed={time.monotonic() - t0:.2f} {msg}")
    os._exit(0)


if __name__ == "__main__":
    main()
