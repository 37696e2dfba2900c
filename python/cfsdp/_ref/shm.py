"""Kernels of the shared-memory collectives (twins of ``csrc/shm.c``).

The collectives themselves have the process group as their twin (see ``cfsdp._runtime.comm``);
what is C in them besides synchronisation is one sum kernel and plain copies, twinned here (and
the all-to-all's block layout, ``shm_all_to_all``, for the in-process tests that drive every
rank at once), the check that a file is this job's before it is mapped (``_check_fd``: see
"Trust" in ``csrc/shm.c``) and the host-shared segment facility that makes and maps such files
(``ShmSegment``, twin of ``cfsdp._C.ShmSegment`` / ``cf_shm_map_file``).
"""

from __future__ import annotations

import errno
import mmap
import os
import pwd
import stat
from typing import Sequence

import torch

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


def shm_all_to_all(inputs: Sequence[torch.Tensor],
                   counts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """What every rank of an all-to-all receives (the twin of the segment's ``all_to_all``,
    taking every rank's input at once): ``inputs[s]`` holds rank ``s``'s blocks for ranks
    0, 1, ... back to back, ``counts[s][r]`` elements each; rank ``r`` receives rank 0's
    block for it, then rank 1's, ... (``torch.distributed.all_to_all_single``'s layout)."""
    world = len(inputs)
    rows = [[int(c) for c in row] for row in counts]
    if len(rows) != world or any(len(r) != world for r in rows):
        raise ValueError(f"counts must be {world} x {world}")
    blocks = [list(torch.split(x.reshape(-1), row)) for x, row in zip(inputs, rows)]
    return [torch.cat([blocks[s][r] for s in range(world)]) for r in range(world)]


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no user name"


def _check_fd(fd: int, path: str) -> None:
    """C's ``cf_shm_check_fd``: refuse to map the open file ``fd`` unless it is a regular
    file owned by this process's effective uid with no group or other permission bits:
    ``PermissionError`` naming ``path`` (for the message only), the file's type, owner
    (uid and user name) and mode, and what to do; ``RuntimeError`` if ``fstat`` fails.
    The messages are C's, to the byte."""
    try:
        sb = os.fstat(fd)
    except OSError as e:
        raise _sys_err("fstat", path, e.errno) from None
    _check_stat(sb, path)


def _sys_err(call: str, path: str, err: int) -> RuntimeError:
    """C's ``cf_shm_sys_err`` message for a failing system call."""
    return RuntimeError(f'cfsdp shm: {call}("{path}") failed: {os.strerror(err)} (errno {err})')


def _check_stat(sb: os.stat_result, path: str) -> None:
    """``_check_fd`` on a stat already taken (``fstat``, or ``lstat`` of a link)."""
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


class ShmSegment:
    """The host-shared segment facility (twin of ``cfsdp._C.ShmSegment``, C's
    ``cf_shm_map_file``): the file ``path`` mapped ``MAP_SHARED`` read-write, ``nbytes``
    long; ``buffer`` is the mapping (``torch.frombuffer(seg.buffer, dtype=torch.uint8)``
    views it and keeps it mapped).  ``create`` makes the file (``O_CREAT | O_EXCL |
    O_NOFOLLOW``, mode 0600, its pages reserved; unlinked again if a later step fails);
    else it attaches (``O_NOFOLLOW``, never creating) and requires exactly ``nbytes``.
    Either way the open file passes ``_check_fd`` before it is sized or mapped (a
    symbolic link is refused naming the link's owner and mode).  The errors and their
    messages are C's."""

    def __init__(self, path: str, create: bool, nbytes: int):
        if nbytes < 1:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        if "\0" in path:
            raise ValueError("path must not contain a NUL character")
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                try:
                    sb = os.lstat(path)
                except OSError:
                    sb = None
                if sb is not None:
                    _check_stat(sb, path)  # names the link's owner and mode
            raise _sys_err("open", path, e.errno) from None
        try:
            self.buffer = self._map(fd, path, create, nbytes)
        except BaseException:
            if create:
                try:
                    os.unlink(path)  # ours (O_EXCL): nothing half-made is left
                except OSError:
                    pass  # never hide the error that got us here
            raise
        finally:
            os.close(fd)
        self.path, self.nbytes = path, nbytes

    @staticmethod
    def _map(fd: int, path: str, create: bool, nbytes: int) -> mmap.mmap:
        _check_fd(fd, path)  # before anything reads, writes or maps it
        call = "ftruncate"
        try:
            if create:
                os.ftruncate(fd, nbytes)
                call = "posix_fallocate"
                os.posix_fallocate(fd, 0, nbytes)
            else:
                call = "fstat"
                size = os.fstat(fd).st_size
                if size != nbytes:
                    raise ValueError(f"cfsdp shm: {path} has {size} bytes, expected {nbytes}")
            call = "mmap"
            return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise _sys_err(call, path, e.errno) from None

    def unlink(self) -> None:
        """Remove the segment's name (the mapping stays valid); a name already gone is
        fine, another failure a ``RuntimeError`` naming the path."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _sys_err("unlink", self.path, e.errno) from None
