"""A rank killed mid-training under ZeRO's shared bucket (run by test_zero.py).

Not a harness worker: the run is meant to fail.  Two ranks train a DDP model with
``cfsdp.ZeroRedundancyOptimizer(parameters_as_bucket_view=True)`` (gloo group timeout
``CFSDP_TEST_PG_TIMEOUT_S``, short): its bucket views are one host-shared bucket, a file of
``/dev/shm`` mapped by both.  After two steps the last rank ``os._exit(1)``s between its
backward pass and its step; the survivor's step must fail (its barrier names the dead rank)
instead of hanging.  Each rank prints ``RANK rank=<r> pid=<pid> bucket=<path>`` and the
survivor ``SURVIVOR rank=<r> elapsed=<s> error=<message>`` (or ``NO ERROR``); the test then
checks that nothing of the run is left in /dev/shm.
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cfsdp

TIMEOUT_S = float(os.environ.get("CFSDP_TEST_PG_TIMEOUT_S", "3"))


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
    t0 = time.monotonic()
    try:
        for step in range(4):
            x = torch.randn(8, 16)
            model(x).square().mean().backward()
            if step == 2 and rank == world - 1:
                sys.stdout.flush()
                os._exit(1)
            t0 = time.monotonic()
            opt.step()
            opt.zero_grad()
        msg = "NO ERROR"
    except RuntimeError as e:
        msg = "error=" + str(e)
    say(f"SURVIVOR rank={rank} elapsed={time.monotonic() - t0:.2f} {msg}")
    os._exit(0)


if __name__ == "__main__":
    main()
