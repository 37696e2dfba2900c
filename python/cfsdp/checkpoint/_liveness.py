"""Who is still writing: the rule by which a crash-safe save removes the leftovers of others.

A crash-safe save writes beside its destination and renames into place at the end:
``atomic_save`` writes the file ``.<name>.tmp-<tag>``, ``dcp_save`` the directory
``.<name>.partial-<tag>`` under the lock file ``.<name>.lock-<tag>`` (see ``_dcp_save``).  A
writer killed in between (SIGKILL, OOM killer, power loss) leaves them behind, as large as the
checkpoint; the next save of the same destination removes them, under this rule.

Tag
    ``<pid>@<host>.<16 hex digits>``: the writer's process id, its host name
    (``socket.gethostname()``, any character outside ``[A-Za-z0-9._-]`` written ``_``) and a
    random part.  An entry whose name is not exactly ``.<name>.<kind>-<tag>`` for the
    destination being saved (an older cfsdp's untagged ``.<name>.tmp-XXXXXXXX``, another
    destination's temporary files, anything of the user's) is never touched.

Lock
    The writer creates its file with ``O_EXCL`` and takes an exclusive ``flock`` on it at once,
    and holds it until the file is renamed into place or removed.  The kernel (or the file
    server) drops the lock when the writer dies, however it dies, so a held lock means a live
    writer, and a process id reused by another process changes nothing.  A cleaner can claim a
    file between its creation and its locking; so the writer, once it holds the lock, checks
    that the name still leads to the file it locked, and starts over under a new tag if not.

A leftover is removed only when all of these hold (``claim_if_dead``):

1. its name matches the pattern above;
2. its tag is not one this process holds now (another thread may be writing it, and where
   ``flock`` is emulated with POSIX locks, NFS, closing any descriptor of a file would drop
   this process's lock on it); this process's own tags that it released are judged like any;
3. it is a regular file (never a symbolic link, FIFO or directory: it is opened with
   ``O_NOFOLLOW | O_NONBLOCK`` and checked);
4. the cleaner takes the lock with ``LOCK_EX | LOCK_NB``: a lock held elsewhere means a live
   writer; any other error (no permission, a file system without locks) means "cannot tell",
   and the leftover stays;
5. if the tag names this host and another process, no process with the tag's id exists
   (``os.kill(pid, 0)``): a second guard for a file system that grants locks it does not
   enforce.  A process id reused since only keeps a leftover longer (a leak, never a loss);
6. holding the lock, the name still leads to the file the cleaner opened.

The cleaner then removes the leftover while it holds the lock, and releases it.

Across hosts the lock is the only evidence (rule 5 cannot see another host's processes), so it
relies on the shared file system propagating ``flock`` between hosts.  NFSv3/v4 (Linux emulates
``flock`` with whole-file byte-range locks there), Lustre mounted with ``-o flock``, GPFS and
CephFS do.  A mount whose locks are local to each host (NFS ``local_lock=flock`` or ``all``,
Lustre ``-o localflock``) does not: there, a save on one host can remove the files of a live
writer on another host that saves *the same destination at the same time*, and that writer's
save fails (``atomic_save``: its rename finds nothing; ``dcp_save``: the cleaner renames a
directory away before removing it, so the writer finds nothing under the name).
On a file system without ``flock`` at all, writers write unlocked and leftovers are never
removed automatically (remove them by hand).
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import socket
import stat
from typing import Optional

_HOST_CHARS = re.compile(r"[^A-Za-z0-9._-]")
TAG_PATTERN = r"(?P<pid>[0-9]+)@(?P<host>[A-Za-z0-9._-]+)\.(?P<rand>[0-9a-f]{16})"
_TAG = re.compile(TAG_PATTERN)
_held: set[str] = set()  # the tags this process holds the lock of now (rule 2)


def host() -> str:
    """This host's name as it appears in tags."""
    return _HOST_CHARS.sub("_", socket.gethostname()) or "_"


def new_tag() -> str:
    """A fresh tag for a writer of this process: ``<pid>@<host>.<16 hex digits>``."""
    return f"{os.getpid()}@{host()}.{secrets.token_hex(8)}"


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` (not followed if a link) is the file open as ``fd``."""
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def create_locked(directory: str, stem: str) -> tuple[int, str, str]:
    """Create ``<directory>/<stem><tag>`` (``O_EXCL``, mode 0o600, like ``mkstemp``) and hold
    an exclusive ``flock`` on it; return ``(fd, path, tag)``.

    The caller owns the file and ``fd``, and gives them up with ``release(fd, tag)``.  Where
    the file system has no locks the file is returned unlocked (the save must still work; its
    leftovers are then never removed by others).  Retries under a new tag if a cleaner claimed
    the file between its creation and its locking."""
    while True:
        tag = new_tag()
        path = os.path.join(directory, stem + tag)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a cleaner holds it and will remove it: start over
            os.close(fd)
            continue
        except OSError:  # no locks on this file system: write unlocked
            _held.add(tag)
            return fd, path, tag
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            _held.add(tag)
            return fd, path, tag
        os.close(fd)  # claimed and removed before we locked it


def release(fd: int, tag: str) -> None:
    """Close a descriptor from ``create_locked`` (releasing its lock): the tag is no longer
    held by this process."""
    _held.discard(tag)
    os.close(fd)


def scan(directory: str, stems: dict[str, str]) -> dict[str, dict[str, str]]:
    """The tagged entries of ``directory``: ``{tag: {kind: path}}`` for each entry named
    ``<stems[kind]><tag>`` exactly.  Nothing (an empty dict) if the directory cannot be read."""
    pattern = re.compile(
        "(?P<kind>" + "|".join(re.escape(s) for s in stems.values()) + ")" + TAG_PATTERN
    )
    kind_of = {s: k for k, s in stems.items()}
    found: dict[str, dict[str, str]] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return found
    for name in names:
        m = pattern.fullmatch(name)
        if m is not None:
            tag = name[len(m.group("kind")):]
            found.setdefault(tag, {})[kind_of[m.group("kind")]] = os.path.join(directory, name)
    return found


def fsync_dir(directory: str) -> None:
    """Make the entries just created or renamed in ``directory`` durable (no-op where
    directories cannot be opened or synced)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems (and all of Windows) refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, as another user's process
        return True
    return True


def claim_if_dead(path: str, tag: str) -> Optional[int]:
    """A locked descriptor of ``path`` if its writer (``tag``) is gone, else None.

    Rules 2-6 of the module doc.  The caller removes what the dead writer left, then closes the
    descriptor (releasing the lock)."""
    m = _TAG.fullmatch(tag)
    if m is None or tag in _held:
        return None
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, os.O_RDWR | flags)
    except PermissionError:  # a read-only leftover: flock needs no write access (but on NFS)
        try:
            fd = os.open(path, os.O_RDONLY | flags)
        except OSError:
            return None
    except OSError:  # gone, a link (ELOOP), a directory (EISDIR), ...
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _Keep
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:  # held (EWOULDBLOCK), or cannot tell (ENOLCK, EBADF, ...)
            raise _Keep from e
        pid = int(m.group("pid"))
        if m.group("host") == host() and pid != os.getpid() and _pid_alive(pid):
            raise _Keep
        if not _same_file(fd, path):
            raise _Keep
    except _Keep:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Keep(Exception):
    """Internal: the leftover stays."""


def remove_dead_files(directory: str, stem: str) -> list[str]:
    """Remove every ``<directory>/<stem><tag>`` file whose writer is gone; return their paths."""
    removed = []
    for tag, entries in scan(directory, {"file": stem}).items():
        path = entries["file"]
        fd = claim_if_dead(path, tag)
        if fd is None:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # removed by another cleaner since the claim: nothing left to do
            pass
        finally:
            os.close(fd)
    return removed
