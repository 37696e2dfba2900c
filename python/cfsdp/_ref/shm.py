"""Kernels of the shared-memory collectives (twins of ``csrc/shm.c``).

The collectives themselves have the process group as their twin (see
``cfsdp._runtime.comm``); what is C in them besides synchronisation is one sum
kernel and plain copies, twinned here, and the check that a file is this job's
before it is mapped (``shm_check_fd``: see "Trust" in ``csrc/shm.c``).
"""

from __future__ import annotations

import os
import pwd
import stat
from typing import Sequence

import torch

_FD_MAX = 2**31 - 1  # C's INT_MAX
_KINDS = {stat.S_IFREG: "regular file", stat.S_IFDIR: "directory",
          stat.S_IFLNK: "symbolic link", stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket",
          stat.S_IFCHR: "character device", stat.S_IFBLK: "block device"}


def shm_reduce(dst: torch.Tensor, srcs: Sequence[torch.Tensor], scale: float) -> None:
    """``dst = round(scale * (srcs[0] + srcs[1] + ...))``, elementwise.

    The sources are summed left to right in float32 (float64 when the dtype is
    float64; bf16 and fp16 widen exactly), the sum is multiplied by ``scale`` in
    that type (the Python float read as float32 for a float32 accumulator, as torch
    reads a scalar; skipped when ``scale == 1``), and rounded once to ``dst.dtype``.
    ``dst`` and every source are 1-D contiguous tensors of one dtype and numel;
    ``dst`` may be one of the sources (in place).
    """
    if not srcs:
        raise ValueError("shm_reduce needs at least one source")
    acc_dtype = torch.float64 if dst.dtype == torch.float64 else torch.float32
    acc = srcs[0].to(acc_dtype, copy=True)
    for s in srcs[1:]:
        acc.add_(s.to(acc_dtype))
    if scale != 1:
        acc.mul_(scale)
    dst.copy_(acc)


def shm_memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s bytes into ``dst`` (same number of bytes, no overlap)."""
    dst.reshape(-1).view(torch.uint8).copy_(src.reshape(-1).view(torch.uint8))


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no user name"


def shm_check_fd(fd: int, path: str) -> None:
    """Refuse to map the open file ``fd`` unless it is a regular file owned by this
    process's effective uid with no group or other permission bits: ``PermissionError``
    naming ``path`` (for the message only), the file's type, owner (uid and user name)
    and mode, and what to do; ``ValueError`` for ``fd`` outside ``[0, 2**31)``;
    ``RuntimeError`` if ``fstat`` fails.  The messages are C's, to the byte."""
    if not 0 <= fd <= _FD_MAX:
        raise ValueError(f"fd must be in [0, {_FD_MAX}], got {fd}")
    try:
        sb = os.fstat(fd)
    except OSError as e:
        raise RuntimeError(f'cfsdp shm: fstat("{path}") failed: {os.strerror(e.errno)} '
                           f"(errno {e.errno})") from None
    me = os.geteuid()
    if stat.S_ISREG(sb.st_mode) and sb.st_uid == me and sb.st_mode & 0o077 == 0:
        return
    kind = _KINDS.get(stat.S_IFMT(sb.st_mode), "file of unknown type")
    raise PermissionError(
        f"cfsdp: refused to map {path}: a {kind} of uid {sb.st_uid} ({_user_name(sb.st_uid)}) "
        f"with mode {sb.st_mode & 0o7777:04o}, not this job's (a regular file of uid {me} "
        f"({_user_name(me)}) with no group or other permissions). Another user of this "
        f"machine may be attacking the job through its rendezvous store (torch's store has "
        f"no authentication): find who, keep other users off the store's port, restart the "
        f"job")
