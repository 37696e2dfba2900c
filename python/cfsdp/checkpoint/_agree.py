"""One collective that tells every rank of a group whether any rank failed a step.

The checkpoint helpers do their file work on some ranks (rank 0 writes, or rank 0 publishes)
and must not let the others return as if it had worked.  ``agree`` is the one place where the
ranks compare notes: each rank contributes its own exception (or None) and, optionally, a small
picklable payload; if any rank failed, every rank raises (the failing rank its own exception,
the others a ``RankFailed``, a RuntimeError naming the failing ranks and their errors);
otherwise every rank gets every rank's payload.  One ``all_gather_object`` over the group;
without a process group (``no_dist``) it only re-raises the local error.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist


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
