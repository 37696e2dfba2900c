"""Ranks that are threads of one process: torch's own FSDP tests run their ranks so
(``FSDPTestMultiThread``, the "threaded" process group of ``torch.testing._internal``), and
users run torch's tests against cfsdp.  Every per-process registry of cfsdp must then be
per rank: a set-up counter shared by the threads once gave the two ranks different store
keys, and every collective waited out the group timeout (torch's test_old_import_training
and test_reset_sharded_param_in_lazy_init, 300 s each).

cfsdp's ``fully_shard`` and torch's train a small model for 2 steps on 2 threaded ranks;
the losses and local shards must be bitwise equal, and each world must end within a bound
far below the group timeout.  The second test first runs a world in which the ranks set a
group up different numbers of times (as when a test fails on one rank mid-way), then a new
world with a new store: its set-ups must agree again (a count kept in the process, even
per rank, carried the first world's counts over and hung torch's
test_rank0_broadcast_meta_device_init).
"""

import copy
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup,
    _install_threaded_pg,
    _uninstall_threaded_pg,
)

import cfsdp
from cfsdp._runtime import comm

WORLD = 2
BOUND_S = 60.0  # the group timeout below is 120 s: a stuck set-up cannot pass


def _train(shard, model: nn.Module, x: torch.Tensor) -> tuple[list, list]:
    for block in model:
        shard(block)
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses, [p.to_local().detach().clone() for p in model.parameters()]


def _train_both(rank: int):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    return (_train(cfsdp.fully_shard, copy.deepcopy(ref), x),
            _train(torch_fully_shard, copy.deepcopy(ref), x))


def _uneven_setups(rank: int):
    for _ in range(rank + 1):  # rank 0 once, rank 1 twice: no collective, only the count
        comm._Setup(dist.group.WORLD)


def _rank(fn, rank: int, store, results: dict, errors: dict) -> None:
    try:
        dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store,
                                timeout=timedelta(seconds=120))
        try:
            results[rank] = fn(rank)
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors[rank] = e
        ProcessLocalGroup.exception_handle(e)  # wake the other rank's collectives


def _install() -> None:
    world = _install_threaded_pg()
    if not hasattr(type(world), "comms"):
        # torch 2.11's threaded world lacks the per-world list of communicators its own
        # destroy_process_group iterates (AttributeError "'ThreadLocalWorld' object has no
        # attribute 'comms'", for torch's FSDP as for cfsdp): one per thread, as torch 2.13's
        type(world).comms = property(lambda self: vars(self._get_world()).setdefault("comms", []))


def _world(fn) -> dict:
    """Run ``fn(rank)`` on WORLD threaded ranks of a new world (a new store); their results."""
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install()
    results: dict = {}
    errors: dict = {}
    try:
        store = dist.HashStore()
        threads = [threading.Thread(target=_rank, args=(fn, r, store, results, errors), daemon=True)
                   for r in range(WORLD)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, BOUND_S - (time.monotonic() - start)))
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        assert not stuck, f"threaded ranks {stuck} still running after {BOUND_S:g} s (a hang)"
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    assert not errors, f"threaded ranks failed: {errors!r}"
    return results


def _check_as_torch(results: dict) -> None:
    for rank, ((c_losses, c_params), (t_losses, t_params)) in sorted(results.items()):
        for i, (a, b) in enumerate(zip(c_losses, t_losses)):
            assert torch.equal(a, b), f"rank {rank} step {i}: loss {a.item()} vs torch's {b.item()}"
        for i, (a, b) in enumerate(zip(c_params, t_params)):
            assert torch.equal(a, b), f"rank {rank}: local shard of parameter #{i} differs from torch's"


def train_as_torch() -> None:
    _check_as_torch(_world(_train_both))


def new_world_starts_afresh() -> None:
    _world(_uneven_setups)
    _check_as_torch(_world(_train_both))


def _in_child(scenario: str) -> None:
    """Run ``scenario`` in a fresh interpreter, so one process trains DTensors in one threaded
    world only: torch 2.11 segfaults in DTensor's dispatch (FakeTensorMode) when a later world
    of the same process steps DTensors, with its own FSDP2 in both seats too (measured: 8 of 8
    runs); torch 2.13 does not."""
    p = subprocess.run([sys.executable, "-c", f"import test_threaded_ranks as t; t.{scenario}()"],
                       cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                       timeout=3 * BOUND_S + 60)
    assert p.returncode == 0, f"{scenario} failed (exit {p.returncode}):\n{p.stdout}{p.stderr[-4000:]}"


def test_threaded_ranks_train_as_torch():
    _in_child("train_as_torch")


def test_a_new_world_starts_its_set_ups_afresh():
    _in_child("new_world_starts_afresh")
