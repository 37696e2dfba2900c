"""What a process does at exit so that it exits cleanly: cfsdp's own threads stopped, and
torch's gloo worker threads done with Python before the interpreter finalizes.

[Note: exit and gloo workers]
A gloo process group runs its collectives on worker threads of its own (named
``pt_gloo_runloop``), and a worker drops its reference to a collective's work object right
after finishing it.  In torch 2.13 that work can hold Python objects: the thread-local state
it captured at issue (a collective issued inside ``backward()``, as DDP's gradient all-reduces
and cfsdp's reduce-scatters are, captures the ``contextvars`` context that ``torch.autograd``
stashes there for the whole backward), or a tensor whose Python object outlived its last
Python reference.  Releasing it takes the GIL.  Once Python has begun to finalize (after every
``atexit`` handler), a thread that takes the GIL is ended by ``pthread_exit``, whose unwinding
through torch's ``noexcept`` destructors calls ``std::terminate``: the rank dies with
"terminate called without an active exception" (SIGABRT) after training correctly, and
torchrun reports the job failed.  It happens when a worker is still owing that release at
finalization, which needs the process group to be alive then (``destroy_process_group`` only
unregisters a group: the ``DistributedDataParallel``, optimizer or model that still holds it
keeps its threads) and the worker to have been descheduled since its last collective finished
(a loaded machine: 3 of 40 runs of a 2-rank job of torch's DDP with cfsdp's ZeRO on 2 busy
cores, 1 of 30 with torch's ZeRO).  gloo has no call that waits for its workers (its
``shutdown`` and ``abort`` do nothing), so at exit, before finalization,
:func:`quiesce_gloo_workers` yields the GIL until every gloo worker thread of the process has
stayed asleep without running for two consecutive windows of ``QUIET_WINDOW_S``: a worker
owing a release wakes for the GIL as soon as it is free and runs, so it is seen as busy until
it is done.  Bounded by ``QUIET_MAX_S``; a worker blocked in an unfinished collective (a peer
that left) sleeps without running and does not hold the exit up.  Linux (``/proc/self/task``);
elsewhere it does nothing.  A process without gloo groups pays nothing; one with them about
two windows.
"""

from __future__ import annotations

import os
import time
from typing import Optional

GLOO_WORKER = "pt_gloo_runloop"  # torch's name for a ProcessGroupGloo worker thread
QUIET_WINDOW_S = 0.01
QUIET_MAX_S = 5.0
_TASKS = "/proc/self/task"


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the thread ended meanwhile (or no /proc): nothing to wait for
        return None


def gloo_workers() -> list:
    """The thread ids of this process's gloo worker threads."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return []
    return [t for t in tids if (_read(f"{_TASKS}/{t}/comm") or "").strip() == GLOO_WORKER]


def _activity(tids: list) -> dict:
    """tid -> (asleep, nanoseconds run so far) for the threads still there."""
    out = {}
    for t in tids:
        stat, sched = _read(f"{_TASKS}/{t}/stat"), _read(f"{_TASKS}/{t}/schedstat")
        if stat is None or sched is None:
            continue
        state = stat[stat.rfind(")") + 2:].split(" ", 1)[0]
        out[t] = (state in ("S", "D"), int(sched.split()[0]))
    return out


def quiesce_gloo_workers(max_s: float = QUIET_MAX_S) -> bool:
    """[Note: exit and gloo workers]: yield the GIL until every gloo worker thread has
    stayed asleep, without running, for two windows in a row (or ``max_s`` passed).  True
    when they did (or there were none)."""
    tids = gloo_workers()
    if not tids:
        return True
    deadline = time.monotonic() + max_s
    before, quiet = _activity(tids), 0
    while time.monotonic() < deadline:
        time.sleep(QUIET_WINDOW_S)  # the GIL is free: a worker owing a release takes it
        now = _activity(tids)
        idle = all(asleep and before.get(t, (False, -1))[1] == ran
                   for t, (asleep, ran) in now.items())
        quiet = quiet + 1 if idle else 0
        if quiet >= 2:
            return True
        before = now
    return False


__all__ = ["GLOO_WORKER", "QUIET_WINDOW_S", "QUIET_MAX_S", "gloo_workers", "quiesce_gloo_workers"]
