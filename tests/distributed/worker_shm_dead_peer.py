"""A slow, a stopped, then a killed peer in shared-memory collectives (run by test_shm.py).

Not a harness worker: the run is meant to fail.  The gloo group's timeout is long
(``CFSDP_TEST_PG_TIMEOUT_S``, 120 s in the test), so only the dead-peer detection of
csrc/shm.c can end the last phase in time.  The last rank is the *victim*:

1. slow: it enters an all-reduce 2.5 s after the others; the all-reduce completes;
2. stopped: rank 0 stops it (SIGSTOP) before an all-reduce and continues it (SIGCONT) 2.5 s
   later, while it waits in that all-reduce; the all-reduce completes (25 probe intervals
   without a false "dead");
3. killed: every rank starts a 64 MB all-reduce through 4 KiB slots (thousands of pieces);
   0.3 s later rank 0 SIGKILLs the victim, mid-collective, and prints ``KILL rank=<r>
   at=<t>``.  Each survivor must get a RuntimeError naming it, and prints ``SURVIVOR
   rank=<r> pid=<pid> at=<t> error=<message>`` (or ``NO ERROR``); ``t`` is
   ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the machine),
   taken right after the ``kill`` and right after the error, so the test measures each
   survivor's detection time from the kill (a write to the shared pipe, which may block,
   comes after both).

Every rank prints ``RANK rank=<r> pid=<pid>`` first and ``PHASE <n> rank=<r> ok`` after the
first two phases.  torchrun sends SIGTERM to the survivors as soon as the victim dies; they
ignore it so they can report (torchrun kills them with SIGKILL after its grace period, far
longer than this).
"""

import os
import signal
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from cfsdp._runtime import comm

TIMEOUT_S = float(os.environ.get("CFSDP_TEST_PG_TIMEOUT_S", "120"))
PAUSE_S = 2.5
BIG = 16 << 20  # elements of the last all-reduce (64 MB of float32)


def say(line: str) -> None:
    """One line in one write(2): the ranks share torchrun's pipe, and print() writes the text
    and its newline separately, so two ranks' lines could interleave."""
    os.write(1, (line.replace("\n", " ") + "\n").encode())


def all_reduce_ones(world: int, n: int = 1000) -> None:
    t = torch.ones(n)
    comm.all_reduce(t, None, False)
    assert float(t[0]) == world and float(t[-1]) == world, (float(t[0]), float(t[-1]))


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    victim = world - 1
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    say(f"RANK rank={rank} pid={os.getpid()}")
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    all_reduce_ones(world)  # set-up + one collective
    assert comm.uses_shm(None), comm.describe(None)

    # 1. slow
    if rank == victim:
        time.sleep(PAUSE_S)
    all_reduce_ones(world)
    say(f"PHASE 1 rank={rank} ok")

    # 2. stopped
    dist.barrier()
    if rank == 0:
        os.kill(pids[victim], signal.SIGSTOP)
        threading.Timer(PAUSE_S, os.kill, (pids[victim], signal.SIGCONT)).start()
    all_reduce_ones(world)
    say(f"PHASE 2 rank={rank} ok")

    # 3. killed mid-collective
    dist.barrier()
    big = torch.ones(BIG)
    pending = comm.all_reduce(big, None, async_op=True)
    if rank == 0:
        time.sleep(0.3)
        os.kill(pids[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        say(f"KILL rank={victim} at={killed_at:.4f}")
    try:
        pending.wait()
        all_reduce_ones(world)  # in case the big one ended before the kill
        msg = "NO ERROR"
    except RuntimeError as e:
        msg = "error=" + str(e)
    at = time.monotonic()
    say(f"SURVIVOR rank={rank} pid={os.getpid()} at={at:.4f} {msg}")
    os._exit(0)


if __name__ == "__main__":
    main()
