"""A host killed mid-step (run by test_hosts.py on 2 emulated hosts x 2 ranks).

Not a harness worker: the run is meant to fail.  Every rank trains worker_shm's transformer
under cfsdp.fully_shard over the world (two levels: shared memory inside each host, gloo
between them).  In step 2 the ranks of host 1 print ``FREEZE`` in a block's forward and
sleep there; the test kills every process of host 1 when it sees that line (the plug is
pulled mid-step: host 0's ranks are in or about to enter a collective that needs host 1).
Each rank of host 0 must then fail with a message naming host 1 and print one line that the
test checks: ``SURVIVOR rank=<r> at=<t> error=<message>`` (or ``NO ERROR``), ``t`` being
``time.monotonic()`` (the machine's one clock: the test measures from its kill).  The gloo
group's timeout is long (``CFSDP_TEST_PG_TIMEOUT_S``, 300 s in the test): the failure must
not wait for it.  The survivors ignore torchrun's SIGTERM (sent once one of them exits) so
that each can report.
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import shm_common as shmc

import cfsdp

FREEZE_STEP = 2
TIMEOUT_S = float(os.environ.get("CFSDP_TEST_PG_TIMEOUT_S", "300"))


def say(line: str) -> None:
    """One line in one write(2) (the ranks of a host share torchrun's pipe)."""
    os.write(1, (line.replace("\n", " ") + "\n").encode())


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank, host = dist.get_rank(), int(os.environ["GROUP_RANK"])
    if host == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    model = shmc._LM()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for b in model.blocks:
        cfsdp.fully_shard(b, mesh=mesh)
    cfsdp.fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = [0]

    def freeze(module, args):
        if step[0] == FREEZE_STEP and host == 1:
            say(f"FREEZE rank={rank}")
            time.sleep(600)

    model.blocks[1].register_forward_pre_hook(freeze)
    try:
        for step[0] in range(5):
            g = torch.Generator().manual_seed(step[0] * 10 + rank)
            loss = model(torch.randn(6, 13, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            say(f"STEP {step[0]} rank={rank}")
        msg = "NO ERROR"
    except RuntimeError as e:
        msg = "error=" + str(e)
    say(f"SURVIVOR rank={rank} at={time.monotonic():.4f} {msg}")
    sys.stdout.flush()
    os._exit(3)


if __name__ == "__main__":
    main()
