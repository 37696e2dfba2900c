"""comm.py's "Accelerator tensors": a collective on tensors that are not on the CPU takes
the process group through a transport of its own per group and sets nothing up (no store
traffic, no segment, no worker thread), so a GPU job's groups never make a segment.  No
GPU here: the ``meta`` device stands in for an accelerator (only ``device.type`` decides the
route), the group is a stand-in object and the process-group calls are recorded, not run.
What this checks is the routing, not NCCL."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cfsdp._runtime import comm

pytestmark = pytest.mark.no_core


class FakeGroup:
    """What comm reads of a process group on these paths."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.fixture
def recorded(monkeypatch):
    """The process-group calls comm makes, recorded; a set-up fails the test."""
    calls: list = []

    def record(name):
        def call(*args, group=None, **kwargs):
            calls.append((name, group))
            return None  # as a synchronous op: no work to wait on
        return call

    for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                 "reduce_scatter_tensor", "all_reduce", "broadcast"):
        monkeypatch.setattr(dist, name, record(name), raising=False)
    monkeypatch.setattr(comm, "_setup", lambda group: pytest.fail(
        "an accelerator tensor's collective set the group up"))
    return calls


def test_accelerator_tensors_take_the_process_group_and_set_nothing_up(recorded):
    g = FakeGroup(2)
    t = torch.zeros(4, device="meta")
    tr = comm.transport(g, t)
    assert tr.transport == "process group (accelerator tensors)" and not tr.live()
    assert comm.transport(g, torch.zeros(1, device="meta")) is tr  # one per group
    comm.all_gather(torch.zeros(8, device="meta"), t, g, async_op=False)
    comm.reduce_scatter(torch.zeros(2, device="meta"), t, g, async_op=False)
    comm.all_reduce(t, g, async_op=False)
    comm.broadcast(t, 0, g, async_op=False)
    assert [c[1] for c in recorded] == [g] * 4, recorded
    assert {c[0] for c in recorded} >= {"all_reduce", "broadcast"}
    assert g not in comm._states  # nothing was set up
    comm.release(g)
    assert g not in comm._accelerator


def test_one_rank_group_stays_local(recorded):
    """A one-rank group's accelerator collectives are local copies, as before (``_Solo``)."""
    g = FakeGroup(1)
    t = torch.zeros(4, device="meta")
    assert comm.transport(g, t).transport == "local (one rank)"
    comm.all_reduce(t, g, async_op=False)
    assert recorded == [] and g not in comm._states


def test_cpu_tensors_set_the_group_up(monkeypatch, recorded):
    """A CPU tensor's collective on the same group takes the group's own transport, set up
    at that call (the one collective point every rank reaches)."""
    g = FakeGroup(2)
    made = []

    def setup(group):
        made.append(group)
        return comm.Transport(group, "process group")

    monkeypatch.setattr(comm, "_setup", setup)
    comm.all_reduce(torch.zeros(4, device="meta"), g, async_op=False)
    assert made == []
    tr = comm.transport(g, torch.zeros(4))
    assert made == [g] and tr is comm._states[g] and tr.transport == "process group"
    comm.release(g)
