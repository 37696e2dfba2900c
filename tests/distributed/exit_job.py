"""A small training job whose subject is its exit (run many times by test_exit.py).

Not a harness worker: the harness leaves with ``os._exit``, and what is tested here is the
interpreter's own exit.  ``exit_job.py FACES END [starve]``:

* ``FACES``, comma-separated, trained in that order, a few steps each, every model and
  optimizer kept alive to the end (as a script's globals are): ``zero`` (torch's DDP with
  ``cfsdp.ZeroRedundancyOptimizer(parameters_as_bucket_view=True)``: the bucket shared by the
  ranks when the group takes shared memory), ``wrapper`` (``cfsdp.FullyShardedDataParallel``,
  a unit per Linear), ``fully_shard`` (per Linear, then the root); then a last all-reduce of
  a metric (a fresh tensor, as a log line sums a loss over the ranks);
* ``END``: ``destroy`` ends with ``dist.barrier(); dist.destroy_process_group();
  sys.exit(0)``; ``default`` with nothing (torch's default exit, the group never destroyed);
* ``starve`` makes likely what a loaded machine does by chance ([Note: exit and gloo
  workers] in cfsdp/_runtime/shutdown.py): every thread of the rank on one core and gloo's
  worker threads at ``SCHED_IDLE`` there from the first model on, so a worker that finishes
  a collective while the main thread runs gets no CPU until the core is idle; with
  ``default`` the main thread does not sleep after the last all-reduce, so its worker still
  owes the release of that collective's Python objects when Python finalizes; then, freed
  with the globals during finalization, ``StarvedUntilFreed`` gives the workers their
  scheduling back and sleeps a moment (as destroying a process group at exit does: its
  destructor joins gloo's threads), so the worker runs there.

Each rank prints ``TRAINED rank=<r> shared=<bool>`` (``shared``: the ZeRO bucket is the
host-shared one) once trained; the exit status of each rank is the launch's business.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cfsdp

FACES, END, STARVE = sys.argv[1].split(","), sys.argv[2], sys.argv[3:] == ["starve"]
assert END in ("destroy", "default") and sys.argv[3:] in ([], ["starve"]), sys.argv


STARVED: list = []  # the gloo worker threads set to SCHED_IDLE


def starve_gloo_workers() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[int(os.environ["LOCAL_RANK"]) % len(cpus)]
    for tid in map(int, os.listdir("/proc/self/task")):
        os.sched_setaffinity(tid, {cpu})
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == "pt_gloo_runloop":
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                STARVED.append(tid)


class StarvedUntilFreed:
    """Freed with the script's globals while Python finalizes: gloo's workers get their
    normal scheduling back and the main thread sleeps for a moment (as it does when a
    process group is destroyed at exit: its destructor joins gloo's threads), so a worker
    that still owes a release runs then, not later at the process's end."""

    def __del__(self, sleep=time.sleep, setscheduler=os.sched_setscheduler,
                other=os.SCHED_OTHER, param=os.sched_param):
        for tid in STARVED:
            try:
                setscheduler(tid, other, param(0))
            except OSError:  # the thread ended (its process group was destroyed)
                pass
        sleep(0.2)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def build(face: str):
    if face == "zero":
        model = DDP(mlp())
        return model, cfsdp.ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=True,
            lr=1e-3)
    if face == "wrapper":
        model = cfsdp.FullyShardedDataParallel(
            mlp(), auto_wrap_policy=cfsdp.wrap.ModuleWrapPolicy({nn.Linear}))
    elif face == "fully_shard":
        model = mlp()
        for m in model:
            if isinstance(m, nn.Linear):
                cfsdp.fully_shard(m)
        cfsdp.fully_shard(model)
    else:
        raise AssertionError(face)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
gen = torch.Generator().manual_seed(rank)
kept = []
for face in FACES:
    torch.manual_seed(0)
    model, opt = build(face)
    if STARVE:
        starve_gloo_workers()
    for _ in range(4):
        model(torch.randn(8, 32, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    kept.append((model, opt))
starved_until_freed = StarvedUntilFreed() if STARVE else None
shared = any(getattr(o, "_shared", lambda: False)() for _, o in kept)
total = torch.tensor([float(rank)])
dist.all_reduce(total)  # a last metric summed over the ranks, as a log line does
print(f"TRAINED rank={rank} shared={shared} sum={total.item():g}", flush=True)
if END == "destroy":
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)
