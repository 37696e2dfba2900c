"""A rank killed mid-training under ZeRO's shared bucket (run by test_zero.py).

Not a harness worker: the run is meant to fail.  The ranks train a DDP model with
``cfsdp.ZeroRedundancyOptimizer(parameters_as_bucket_view=True)`` (gloo group timeout
``CFSDP_TEST_PG_TIMEOUT_S``, long in the test: only the dead-peer detection ends the run in
time): its bucket views are one host-shared bucket, a file of ``/dev/shm`` mapped by all.
After two steps the last rank, between its backward pass and its step, prints ``KILL
rank=<r> at=<t>`` and SIGKILLs itself; the survivors' step must fail at once (their barrier
on the group's segment names the dead rank and its host) instead of waiting out the
timeout.  Each rank prints ``RANK rank=<r> pid=<pid> bucket=<path>`` and each survivor
``SURVIVOR rank=<r> at=<t> error=<message>`` (or ``NO ERROR``), ``t`` being
``time.monotonic()`` (one clock for the machine's processes; the victim's is taken before
its line is written, so a write that blocks on the shared pipe can only lengthen the time
measured); the test then checks that nothing of the run is left in /dev/shm.
"""

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cfsdp

TIMEOUT_S = float(os.environ.get("CFSDP_TEST_PG_TIMEOUT_S", "120"))


def say(line: str) -> None:
    """One line in one write(2) (the ranks share torchrun's pipe)."""
    os.write(1, (line.replace("\n", " ") + "\n").encode())


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)))
    opt = cfsdp.ZeroRedundancyOptimizer(model.parameters(), cfsdp.optim.AdamW, lr=1e-3,
                                        parameters_as_bucket_view=True)
    (sync,) = opt._syncs
    say(f"RANK rank={rank} pid={os.getpid()} shared={sync.shared} bucket={sync.path}")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # report before torchrun's SIGKILL
    try:
        for step in range(4):
            x = torch.randn(8, 16)
            model(x).square().mean().backward()
            if step == 2 and rank == world - 1:
                say(f"KILL rank={rank} at={time.monotonic():.4f}")
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            opt.zero_grad()
        msg = "NO ERROR"
    except RuntimeError as e:
        msg = "error=" + str(e)
    say(f"SURVIVOR rank={rank} at={time.monotonic():.4f} {msg}")
    os._exit(0)


if __name__ == "__main__":
    main()
