"""Shared-memory set-up failures fall back to the process group at once, on every rank
(run by test_hosts.py on one emulated host whose /dev/shm is an 8 MiB tmpfs, 3 ranks).

Each subtest makes the set-up of its group fail one way, then checks on every rank: the
group takes the process group with the reason (the failing rank and the system's message)
within seconds, not after the group's 60 s timeout; group rank 0 logged exactly one warning,
the others none; the collectives give gloo's results (worker_shm's checks); /dev/shm (this
host's own tmpfs) holds nothing of cfsdp afterwards.

* ``creator_cannot_create``: the segment is larger than /dev/shm (``CFSDP_SHM_SLOT_BYTES`` =
  2 MiB: 12 MiB for 3 ranks): group rank 0's ``posix_fallocate`` fails, no rank attaches;
* ``one_rank_cannot_attach``: rank 2 opens the segment as user nobody (``seteuid``), which the
  creator's 0600 segment refuses: ranks 0 and 1 attached, rank 2 could not;
* ``ranks_disagree_on_CFSDP_SHM``: rank 1 has ``CFSDP_SHM=0``, the others not;
* ``ranks_disagree_on_slot_bytes``: rank 1 has another ``CFSDP_SHM_SLOT_BYTES``;
* ``bad_slot_bytes_raises_everywhere``: rank 2's ``CFSDP_SHM_SLOT_BYTES`` is no number: a
  ``ValueError`` naming it on every rank, at once (a configuration error, not a fallback).
"""

from __future__ import annotations

import logging
import os
import time

import torch

import _harness as h
import shm_common as shmc

from cfsdp._runtime import comm

shmc.EXPECT_SHM = False  # the process group's results are checked, not shared memory's
NOBODY = 65534


class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(record.getMessage())


def check_fallback(ctx, set_up, failing: list, message: str) -> None:
    """``set_up()`` triggers the set-up of ctx.pg on this rank (in whatever condition the
    subtest made); then the checks of the module doc."""
    log = logging.getLogger("cfsdp")
    count = _Count()
    log.addHandler(count)
    try:
        t0 = time.monotonic()
        got = set_up()
        elapsed = time.monotonic() - t0
    finally:
        log.removeHandler(count)
    want = f"process group (shared memory could not be set up on group rank(s) {failing}"
    if not failing:  # the ranks' settings disagree: no segment was tried
        want = f"process group ({message}"
    assert got.startswith(want) and message in got, (got, want, message)
    assert elapsed < 10, f"set-up took {elapsed:.1f} s: a timeout, not an agreement"
    assert not comm.uses_shm(ctx.pg)
    warned = [m for m in count.records if "takes the process group" in m]
    assert len(warned) == (1 if ctx.rank == 0 else 0), count.records
    if ctx.rank == 0:
        assert message in warned[0], warned
    shmc.check_all_ops(ctx, ctx.pg, torch.float32, [1, 1001, 9973])
    left = [e for e in os.listdir("/dev/shm") if e.startswith("cfsdp-")]
    assert left == [], left
    comm.release(ctx.pg)


def _with_env_on(rank: int, name: str, value: str, fn):
    """``fn()`` with ``name=value`` in the environment on ``rank`` only."""
    def run(ctx):
        if ctx.rank != rank:
            return fn()
        saved = os.environ.get(name)
        os.environ[name] = value
        try:
            return fn()
        finally:
            if saved is None:
                del os.environ[name]
            else:
                os.environ[name] = saved
    return run


@h.subtest
def creator_cannot_create(ctx):
    saved = os.environ.get(comm.SHM_SLOT_ENV)
    os.environ[comm.SHM_SLOT_ENV] = str(2 << 20)
    try:
        check_fallback(ctx, lambda: comm.describe(ctx.pg), [0], "No space left on device")
    finally:
        if saved is None:
            del os.environ[comm.SHM_SLOT_ENV]
        else:
            os.environ[comm.SHM_SLOT_ENV] = saved


@h.subtest
def one_rank_cannot_attach(ctx):
    def set_up():
        if ctx.rank != 2:
            return comm.describe(ctx.pg)
        os.seteuid(NOBODY)
        try:
            return comm.describe(ctx.pg)
        finally:
            os.seteuid(0)

    check_fallback(ctx, set_up, [2], "Permission denied")


@h.subtest
def ranks_disagree_on_CFSDP_SHM(ctx):
    def set_up():
        return _with_env_on(1, comm.SHM_ENV, "0", lambda: comm.describe(ctx.pg))(ctx)

    check_fallback(ctx, set_up, [], "shared memory is off on group rank(s) [1]")


@h.subtest
def ranks_disagree_on_slot_bytes(ctx):
    set_up = _with_env_on(1, comm.SHM_SLOT_ENV, "8192", lambda: comm.describe(ctx.pg))
    check_fallback(ctx, lambda: set_up(ctx), [],
                   f"{comm.SHM_SLOT_ENV} differs between ranks ([8192, 1048576])")


@h.subtest
def bad_slot_bytes_raises_everywhere(ctx):
    """A value that is no number of bytes (on one rank) is an error on every rank at once."""
    set_up = _with_env_on(2, comm.SHM_SLOT_ENV, "12x", lambda: comm.describe(ctx.pg))
    t0 = time.monotonic()
    try:
        set_up(ctx)
    except ValueError as e:
        assert "group rank 2: CFSDP_SHM_SLOT_BYTES='12x' is not an integer" in str(e), e
    else:
        raise AssertionError("no ValueError")
    assert time.monotonic() - t0 < 10
    comm.release(ctx.pg)


@h.subtest
def then_shared_memory_works(ctx):
    """A group whose set-up succeeds, after the failures: shared memory, as usual."""
    assert comm.describe(ctx.pg).startswith("shared memory (3 ranks on host"), comm.describe(ctx.pg)
    shmc.check_all_ops(ctx, ctx.pg, torch.float32, [1001])
    comm.release(ctx.pg)


if __name__ == "__main__":
    h.main()
