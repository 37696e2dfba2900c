"""One rank of one host killed in a two-level reduce-scatter (run by test_hosts.py on 2
emulated hosts x 2 ranks).

Not a harness worker: the run is meant to fail.  The gloo group's timeout is long
(``CFSDP_TEST_PG_TIMEOUT_S``, 300 s in the test), so only dead-peer detection ends the run in
time.  After a few two-level reduce-scatters that succeed, the last rank (global rank 3,
host 1, local rank 1) prints ``KILL rank=3 at=<t>`` and SIGKILLs itself, and the others
reduce-scatter again.  Each survivor learns it differently, which is the point:

* rank 2 (its host-mate) waits for it in host 1's segment: the segment's liveness probe;
* rank 1 (local rank 1 on host 0) exchanges with it over gloo: the broken connection, seen
  by the wait or, if it was already gone, by the post (``MODE`` picks which);
* rank 0 waits over gloo for rank 2, which is alive but failed and will never send: only
  host 0's segment, where rank 1 recorded its failure, can tell it (the lane's waiter).

Each prints ``SURVIVOR rank=<r> at=<t> error=<message>`` (or ``NO ERROR``), ``t`` being
``time.monotonic()`` (one clock for every process of the machine, whatever its namespaces;
the victim's is taken before its line is written, so a write that blocks can only lengthen
the time measured), and the test checks that each names global rank 3 and its host within seconds.  Survivors
ignore torchrun's SIGTERM so that each can report, and exit with status 3 five seconds
later (an exit would release a peer blocked on gloo for it, hiding a missed detection).
"""

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from cfsdp._runtime import comm

TIMEOUT_S = float(os.environ.get("CFSDP_TEST_PG_TIMEOUT_S", "300"))
# Which side of the race rank 1 is on (``CFSDP_TEST_DEAD_RANK_MODE``): "waited", the victim
# dies while rank 1 waits for it (gloo's wait fails); "posted_late", it is gone before rank 1
# posts its send/recv (gloo's post fails at once).  Both must name global rank 3.
MODE = os.environ.get("CFSDP_TEST_DEAD_RANK_MODE", "waited")
LATE_S = 1.0
N = 4096  # elements per rank block


def say(line: str) -> None:
    """One line in one write(2) (the ranks of a host share torchrun's pipe)."""
    os.write(1, (line.replace("\n", " ") + "\n").encode())


def reduce_scatter(world: int) -> torch.Tensor:
    out = torch.empty(N)
    comm.reduce_scatter(out, torch.ones(world * N), None, async_op=False)
    return out


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    assert comm.describe(None).startswith("two levels"), comm.describe(None)
    for _ in range(3):
        assert torch.equal(reduce_scatter(world), torch.full((N,), float(world)))
    dist.barrier()
    if rank == world - 1:
        if MODE == "waited":
            time.sleep(LATE_S)  # the survivors have posted their exchanges and wait
        say(f"KILL rank={rank} at={time.monotonic():.4f}")
        os.kill(os.getpid(), signal.SIGKILL)
    if MODE == "posted_late" and rank == 1:
        time.sleep(LATE_S)  # its gloo connection to rank 3 is closed before it posts
    try:
        reduce_scatter(world)
        reduce_scatter(world)  # in case the first ended before the kill
        msg = "NO ERROR"
    except RuntimeError as e:
        msg = "error=" + str(e)
    say(f"SURVIVOR rank={rank} at={time.monotonic():.4f} {msg}")
    time.sleep(5)  # no survivor's exit breaks a gloo connection another one still waits on
    os._exit(3)  # a failed worker: torchrun ends at once (after a success it would wait
    # at its exit barrier for the other host's agent, which is gone)


if __name__ == "__main__":
    main()
