"""Watch one gloo group for two collectives in flight at once (comm.py, "One in flight on gloo").

torch 2.13's ``ProcessGroupGloo`` corrupts its heap when two collectives of one group finish
together on its two worker threads, so cfsdp keeps at most one of its collectives in flight per
gloo group.  :func:`process_group_only` makes a group cfsdp serves through the process group
(``CFSDP_SHM=0`` while it is set up: the path of groups across hosts without two levels, or of
ranks that turn shared memory off); :func:`watch` lists every collective issued on it while an
earlier asynchronous one on it was neither waited for nor completed.  The race itself strikes
rarely (a few runs in ten under ASan), so the tests check the order, which is what decides it.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Iterator

import torch.distributed as dist

import cfsdp
from cfsdp._runtime import comm

_CFSDP_DIR = os.path.dirname(cfsdp.__file__)

# every collective torch's FSDP, cfsdp and the tests issue through torch.distributed
_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                "reduce_scatter_tensor", "all_reduce", "broadcast", "all_gather", "reduce_scatter")


def process_group_only() -> dist.ProcessGroup:
    """A new gloo group of every rank that cfsdp serves through the process group.
    Collective: every rank calls it."""
    before = os.environ.get(comm.SHM_ENV)
    os.environ[comm.SHM_ENV] = "0"
    try:
        group = dist.new_group(backend="gloo")
        transport = comm.describe(group)  # the set-up reads the wish now
    finally:
        if before is None:
            del os.environ[comm.SHM_ENV]
        else:
            os.environ[comm.SHM_ENV] = before
    assert transport.startswith("process group"), transport
    return group


@contextlib.contextmanager
def watch(group: dist.ProcessGroup) -> Iterator[list[str]]:
    """Yield a list that gets, for each collective cfsdp issues on ``group`` while an earlier
    asynchronous one of cfsdp's on it is in flight, both ops and where the second was issued.
    A work is done once waited for (gloo's reduce-scatter work never says ``is_completed()``).
    torch's FSDP2 is not watched: it does put two in flight when the user asks for it
    (``unshard(async_op=True)`` on two modules), so it is exposed to the race there."""
    overlaps: list[str] = []
    in_flight: list[tuple[object, str]] = []
    waited: set[int] = set()
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    wait = dist.Work.wait

    def waiting(work, *args, **kwargs):
        out = wait(work, *args, **kwargs)
        waited.add(id(work))
        return out

    def watched(name, fn):
        def call(*args, **kwargs):
            if kwargs.get("group") is not group or not any(
                    f.filename.startswith(_CFSDP_DIR) for f in traceback.extract_stack()):
                return fn(*args, **kwargs)
            in_flight[:] = [(w, n) for w, n in in_flight
                            if id(w) not in waited and not w.is_completed()]
            if in_flight:
                where = "".join(traceback.format_stack(limit=6)[:-1])
                overlaps.append(f"{name} issued while {in_flight[0][1]} was in flight, at\n"
                                f"{where}")
            work = fn(*args, **kwargs)
            if kwargs.get("async_op") and work is not None:
                in_flight.append((work, name))
            return work
        return call

    dist.Work.wait = waiting
    for name, fn in saved.items():
        setattr(dist, name, watched(name, fn))
    try:
        yield overlaps
    finally:
        dist.Work.wait = wait
        for name, fn in saved.items():
            setattr(dist, name, fn)
