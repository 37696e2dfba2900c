"""The set-up of a group's transport (comm.py, "Set-up"): concurrent set-ups, and what a
set-up that times out says (run by test_shm.py at W = 2 and 3).

* ``two_groups_from_two_threads``: each rank issues the first collective of two new groups
  from two threads at once, in the order that made the ranks wait on each other: rank r
  starts group ``r % 2`` first and the other 0.2 s later.  The set-ups used to block the
  store's one connection in ``store.wait``, so each thread stopped the other's publishing
  and both failed after the group timeout (30 s here) with ``missing []``; now both finish,
  with the right sums, far within it.
* ``missing_*``: the last rank of a new group with a 3 s timeout stops at one step of the
  set-up (it never issues the collective; it stops after publishing its host key; the
  segment's creator, group rank 0, stops before publishing the segment's name).  Every
  other rank's first collective raises a ``RuntimeError`` after the timeout that names the
  absent rank (group and global rank) and what it did not do, never ``missing []``.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import _harness as h

from cfsdp._runtime import comm

EXPECT_SHM = os.environ.get("CFSDP_IMPL", "c") == "c" and os.environ.get("CFSDP_SHM", "1") != "0"
THREADS_TIMEOUT_S = 30.0
SHORT_TIMEOUT_S = 3.0


@h.subtest
def two_groups_from_two_threads(ctx):
    groups = [dist.new_group(backend="gloo", timeout=timedelta(seconds=THREADS_TIMEOUT_S))
              for _ in range(2)]
    results: dict = {}
    errors: dict = {}
    took: dict = {}

    def first_collective(i: int) -> None:
        t0 = time.monotonic()
        try:
            x = torch.full((1000,), float(ctx.rank + 1 + 100 * i))
            comm.all_reduce(x, groups[i], async_op=False)
            results[i] = x
        except Exception as e:  # noqa: BLE001 - reported below
            errors[i] = e
        took[i] = time.monotonic() - t0

    order = [0, 1] if ctx.rank % 2 == 0 else [1, 0]
    threads = {i: threading.Thread(target=first_collective, args=(i,), daemon=True)
               for i in order}
    threads[order[0]].start()
    time.sleep(0.2)
    threads[order[1]].start()
    for t in threads.values():
        t.join(THREADS_TIMEOUT_S + 30)
    assert not any(t.is_alive() for t in threads.values()), "a set-up thread is still running"
    assert not errors, f"rank {ctx.rank}: {errors!r} (seconds taken: {took})"
    w = ctx.world_size
    for i in range(2):
        want = float(sum(r + 1 + 100 * i for r in range(w)))
        assert torch.equal(results[i], torch.full((1000,), want)), (i, results[i][:3], want)
        assert comm.uses_shm(groups[i]) == EXPECT_SHM, comm.describe(groups[i])
    ctx.log(f"both set-ups done in {took[0]:.2f} s and {took[1]:.2f} s")


class _Stop(Exception):
    """The last rank stopping its set-up on purpose (a rank that died there)."""


def _expect_named(ctx, group, absent: int, did_not: str, stop) -> None:
    """Group rank ``absent`` runs ``stop(group)`` instead of a first collective; every other
    rank's first collective must fail naming it and ``did_not``."""
    if ctx.rank == absent:
        try:
            stop(group)
        except _Stop:
            pass
        return
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(10), group, async_op=False)
    except RuntimeError as e:
        msg = str(e)
    else:
        raise AssertionError(f"rank {ctx.rank}: the set-up did not time out")
    took = time.monotonic() - t0
    who = f"group rank {absent} (global rank {dist.get_global_rank(group, absent)})"
    assert f"{who} did not {did_not}" in msg, msg
    assert "missing []" not in msg, msg
    assert f"timed out after {SHORT_TIMEOUT_S:g} s" in msg, msg
    assert took < SHORT_TIMEOUT_S + 30, took


def _short_group():
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=SHORT_TIMEOUT_S))


@h.subtest
def missing_rank_never_arrives(ctx):
    _expect_named(ctx, _short_group(), ctx.world_size - 1, "publish its host key",
                  lambda g: None)


def _stop_at(name: str):
    """Run the set-up on this rank with ``comm.<name>`` raising ``_Stop``: the rank stops
    right there."""
    def stop(group):
        def raise_stop(*args, **kwargs):
            raise _Stop()
        saved = getattr(comm, name)
        setattr(comm, name, raise_stop)
        try:
            comm.all_reduce(torch.ones(10), group, async_op=False)
        finally:
            setattr(comm, name, saved)
    return stop


@h.subtest
def missing_rank_stops_after_its_host_key(ctx):
    if not EXPECT_SHM:  # no segment: the set-up ends after the host keys
        return
    _expect_named(ctx, _short_group(), ctx.world_size - 1,
                  "say whether it attached segment 'all' (/cfsdp-", _stop_at("_open_segment"))


@h.subtest
def missing_creator_stops_before_the_name(ctx):
    if not EXPECT_SHM:
        return
    _expect_named(ctx, _short_group(), 0,
                  "publish the name of segment 'all', which it creates",
                  _stop_at("_open_segment"))


if __name__ == "__main__":
    h.main()
