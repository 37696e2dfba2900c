"""A rank killed inside the shared-memory set-up window (run by test_shm.py).

Not a harness worker: the run is meant to fail.  The window is the part of a group's set-up
(cfsdp._runtime.comm, "Set-up") where its segment has a name in /dev/shm: from the creator's
``shm_open`` to the moment every rank has attached.  ``CFSDP_TEST_SETUP_KILL`` says where a
rank SIGKILLs itself (deterministically, by wrapping the set-up's own steps):

* ``creator_before_name``: group rank 0, right after creating the segment, before publishing
  its name (only the planned name, published before, tells the others what to remove);
* ``creator_after_name``: group rank 0, after publishing its name, before saying it attached;
* ``before_attach``: the last rank, before it attaches;
* ``after_attach``: the last rank, right after it attached, before saying so.

The survivors' first collective fails after the group's timeout (``CFSDP_TEST_PG_TIMEOUT_S``,
short: the set-up waits for ranks that never come); each prints ``SURVIVOR rank=<r>
error=<message>`` (or ``NO ERROR``) and leaves by ``os._exit`` with the error still
referenced (as a process that ends on that error, or is killed while handling it), so
nothing but the set-up's own clean-up runs: no garbage collection of what the error's
frames held.  Every rank prints ``RANK rank=<r> pid=<pid>`` first; the test then checks
that /dev/shm holds no segment named after any of them.  Survivors ignore torchrun's SIGTERM,
unless ``CFSDP_TEST_SURVIVORS=sigterm``: then torchrun's SIGTERM kills them as soon as the
victim is dead (what happens without a test around it), before any clean-up of theirs.
"""

import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

from cfsdp._runtime import comm

TIMEOUT_S = float(os.environ.get("CFSDP_TEST_PG_TIMEOUT_S", "10"))
WHERE = os.environ["CFSDP_TEST_SETUP_KILL"]


def say(line: str) -> None:
    """One line in one write(2) (the ranks share torchrun's pipe)."""
    os.write(1, (line.replace("\n", " ") + "\n").encode())


def die(what: str) -> None:
    say(f"KILL rank={dist.get_rank()} {what}")
    os.kill(os.getpid(), signal.SIGKILL)


def arm(rank: int, world: int) -> None:
    """Wrap the set-up step after or before which this rank dies (see the module doc)."""
    if WHERE.startswith("creator") and rank == 0:
        publish = comm._Setup.publish
        when = "name/" if WHERE == "creator_before_name" else "attach/"

        def dying_publish(self, key, value):
            if key.startswith(when):
                die(f"before publishing {key}")
            publish(self, key, value)

        comm._Setup.publish = dying_publish
    elif WHERE in ("before_attach", "after_attach") and rank == world - 1:
        open_segment = comm._open_segment

        def dying_open(*args, **kwargs):
            if WHERE == "before_attach":
                die("before attaching")
            got = open_segment(*args, **kwargs)
            assert got[0] is not None, got
            die("after attaching")

        comm._open_segment = dying_open


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    if os.environ.get("CFSDP_TEST_SURVIVORS") != "sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    say(f"RANK rank={rank} pid={os.getpid()}")
    dist.barrier()  # every RANK line is out before anyone dies
    arm(rank, world)
    kept = None
    try:
        comm.all_reduce(torch.ones(8), None, False)
        msg = "NO ERROR"
    except RuntimeError as e:
        kept, msg = e, "error=" + str(e)  # kept: its frames' objects stay alive
    say(f"SURVIVOR rank={rank} {msg}")
    os._exit(0 if kept is None else 3)


if __name__ == "__main__":
    main()
