"""How the ranks of a group learn about each other: the host key, and one agreement.

``host_key``: which ranks share a host (and its ``/dev/shm``), the one key every decision
of that kind uses (the transports' set-up in comm.py; the wrapper's ranks per host for
HYBRID_SHARD with ``process_group=None``): host name, boot id and the device of
``/dev/shm``, so two containers with one host name but separate ``/dev/shm`` mounts are
two hosts.

``agree``: one collective that tells every rank of a group whether any rank failed a step,
and hands every rank every rank's small payload.  The checkpoint helpers do their file work
on some ranks (rank 0 writes, or rank 0 publishes) and must not let the others return as if
it had worked; ZeRO's shared bucket says why a rank refused a file; the wrapper counts ranks
per host.  Each rank contributes its own exception (or None) and, optionally, a picklable
payload; if any rank failed, every rank raises (the failing rank its own exception, the
others a ``RankFailed``, a RuntimeError naming the failing ranks and their errors);
otherwise every rank gets every rank's payload.  One ``all_gather_object`` over the group;
without a process group (``no_dist``) it only re-raises the local error.

The transports' own set-up (comm.py's ``_Setup``) agrees through the store instead: it runs
before the group has a transport, and a rank that never arrives must be named at the
timeout, which a collective cannot do.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Optional

import torch.distributed as dist

SHM_DIR = "/dev/shm"  # where POSIX shm_open puts segments (glibc)


def host_key() -> str:
    """This rank's host key: ``"<host name>|<boot id>|<device of /dev/shm>"``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    try:
        shm_dev = str(os.stat(SHM_DIR).st_dev)
    except OSError:
        shm_dev = "no-dev-shm"
    return f"{socket.gethostname()}|{boot}|{shm_dev}"


class RankFailed(RuntimeError):
    """Raised by ``agree`` on the ranks that did not fail themselves."""


def agree(group: Optional[dist.ProcessGroup], error: Optional[BaseException], what: str,
          payload: Any = None, *, no_dist: bool = False) -> list[Any]:
    """Every rank of ``group`` learns whether any rank failed ``what``; all raise if one did.

    Returns the list of every rank's ``payload`` (by group rank).  ``group=None`` is the default
    group; ``no_dist=True`` is one process alone (returns ``[payload]``)."""
    if no_dist:
        if error is not None:
            raise error
        return [payload]
    mine = None if error is None else f"{type(error).__name__}: {error}"
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (mine, payload), group=group)
    failed = {r: s for r, (s, _) in enumerate(gathered) if s is not None}
    if not failed:
        return [p for _, p in gathered]
    if error is not None:
        raise error
    detail = "; ".join(f"rank {r}: {s}" for r, s in failed.items())
    raise RankFailed(f"{what} failed on rank(s) {sorted(failed)}: {detail}")
