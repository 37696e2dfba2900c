"""``dcp_save``: ``torch.distributed.checkpoint.save`` that a killed rank cannot damage.

``dcp.save(state_dict, checkpoint_id=path)`` writes into ``path`` in place: each rank truncates
and rewrites its shard files (``__<rank>_<n>.distcp``), then the coordinator replaces
``.metadata``.  A rank killed half-way leaves the old ``.metadata`` pointing into rewritten or
truncated shard files: the previous checkpoint is gone and the new one does not exist.
``dcp_save`` takes the same arguments and returns the same ``Metadata``, but the new checkpoint
becomes visible at ``path`` all at once, and only when every rank has finished writing it.

Names (``<parent>/<name>`` is ``checkpoint_id`` with symbolic links resolved; ``<tag>`` is
``<pid>@<host>.<random>`` of rank 0, see ``_liveness``)::

    <parent>/.<name>.lock-<tag>       rank 0 holds an exclusive flock on it for the whole save
    <parent>/.<name>.partial-<tag>/   every rank writes the new checkpoint here
    <parent>/.<name>.old-<tag>/       only without RENAME_EXCHANGE: the previous checkpoint,
                                      moved aside for the instant of the publish
    <parent>/.<name>.trash-<tag>/     a dead save's directory being removed (renamed first:
                                      a save misjudged dead then finds its name gone and
                                      fails, rather than publishing a half-removed directory)

Protocol (every rank of ``process_group`` calls it; "rank 0" is its rank 0, DCP's coordinator)

1. Prepare.  Every rank checks its arguments.  Rank 0 runs ``dcp_recover(path)`` (below), checks
   ``path`` (absent, or a directory holding nothing but DCP's own files, and not refused by the
   writer's ``overwrite=False``), creates and locks the lock file (this picks the tag), then
   creates the partial directory.  One ``all_gather_object``: every rank learns every rank's
   error (then all raise; rank 0 removes what it created) or rank 0's tag.
2. Write.  ``dcp.save`` on every rank with the same planner, process group, ``no_dist`` and
   ``use_collectives``, into the partial directory: the ``FileSystemWriter`` (yours, with its
   options, or one made from ``checkpoint_id`` as ``dcp.save`` would) is pointed there for the
   call, and the ``StorageMeta`` recorded in ``.metadata`` still names ``path``; afterwards the
   writer's ``path`` is ``path``, as after ``dcp.save``.  It returns on a rank once the
   coordinator has written ``.metadata``, i.e. after every rank's files are written and fsynced
   (``sync_files=True``, the default; without it the guarantees below hold against killed
   processes, not against power loss).  Rank 0 then checks that every file its metadata names
   is in the partial directory at full length (all ranks must write to one directory rank 0
   can see: a shared file system, not node-local disks).
3. Agree.  One ``all_gather_object``: every rank reports that its ``dcp.save`` returned.  A rank
   that raised, died, or whose files are missing makes every rank raise; rank 0 removes the
   partial directory; ``path`` is untouched.
4. Publish (rank 0).  The partial directory is fsynced, then:

   * ``path`` absent: ``rename(partial, path)``;
   * Linux ``renameat2(partial, path, RENAME_EXCHANGE)`` (through ctypes): one atomic swap of
     the two directories; the partial name now holds the previous checkpoint;
   * where the file system or kernel refuses the exchange (NFS, Lustre, other systems without
     it: ``EINVAL``/``ENOSYS``/``EOPNOTSUPP``, or a libc without ``renameat2``):
     ``rename(path, old)`` then ``rename(partial, path)``.  If the second rename fails, the
     first is undone and the save raises.

   The parent directory is fsynced.  One ``all_gather_object``: every rank learns whether the
   publish worked; if rank 0 stopped without telling (killed), the others raise saying that
   ``path`` holds the previous or the new checkpoint.
5. Clean up (rank 0, after the others returned): the previous checkpoint (under the partial or
   the old name) is removed, then the lock file, and the lock is released.  A failure here is a
   warning: the save itself succeeded, and the next ``dcp_save`` removes what is left.

Guarantee.  Whoever is killed at whatever point, ``path`` holds the complete previous checkpoint
(or nothing, if there was none) until the instant of the publish and the complete new one after
it.  With ``RENAME_EXCHANGE`` (Linux 3.15+ on ext4, xfs, btrfs, tmpfs, f2fs, ...) this holds at
every instant.  Without it there is one window, between the two renames of the fallback (two
system calls by one process), in which ``path`` does not exist: if rank 0 dies exactly there,
``path`` stays absent, with both complete checkpoints beside it, until ``dcp_recover(path)`` or
the next ``dcp_save`` of ``path`` renames the new one into place (``dcp.load`` meanwhile fails
with a missing ``.metadata``; it never reads a mix).

``dcp_recover(checkpoint_id)``: for each tag beside ``path`` whose writer is gone (its lock file
is claimed by the rule of ``_liveness``, or it has no lock file: rank 0 creates the lock file
before anything else of a save and removes it last, so entries without one belong to no live
save), finish or undo what it left, then remove its entries:

* ``path`` absent and ``.old-<tag>`` present (died inside the fallback's publish): the new
  checkpoint, complete since step 3, is renamed into place (or, if there is no partial
  directory, the old one back); only under the claimed lock, never for entries without one;
* otherwise ``.partial-<tag>`` (an unfinished new checkpoint, or the previous one swapped out)
  and ``.old-<tag>`` are removed (each renamed to a ``.trash-<new tag>`` first), and so is
  ``.trash-<tag>`` (a removal cut short).

A live save's entries (lock held; on this host also: its process exists) are never touched.
Safe to call from any number of processes at once; ``dcp_save`` calls it on rank 0 first.

What differs from ``dcp.save``: ``path`` ends up holding exactly the files of this save (stale
shard files of an earlier save at another world size are gone); a ``path`` that holds files
DCP did not write is refused (``ValueError``: they would be deleted with the previous
checkpoint); storage other than a local or shared POSIX directory written through torch's
``FileSystemWriter`` is ``NotImplementedError`` (the destination could not be redirected); and
torch's "overwriting" warning is not given (nothing is overwritten in place).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import os
import pickle
import re
import shutil
import stat
import warnings
from typing import Any, Iterator, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from .._torch.checkpoint import FileSystemWriterBase as _FileSystemWriter
from .._torch.checkpoint import api_bc_check as _api_bc_check
from . import _liveness
from ._agree import agree

__all__ = ["dcp_save", "dcp_recover"]

_KINDS = ("lock", "partial", "old", "trash")
# what DCP's FileSystemWriter writes into a checkpoint directory (filesystem.py in torch 2.13)
_DCP_FILE = re.compile(r"(\.metadata|__[0-9]+\.metadata)(\.tmp)?|__[0-9]+_[0-9]+\.distcp")
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE_ERRNOS = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


# ---------------------------------------------------------------------------------------------
# renames
# ---------------------------------------------------------------------------------------------


class _NoExchange(Exception):
    """The kernel, the file system or libc cannot swap two directory entries atomically."""


def _libc_renameat2():
    """libc's ``renameat2``, or None where libc lacks it (glibc < 2.28, musl < 1.2.3, macOS)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2()


def _exchange(a: str, b: str) -> None:
    """Swap the directory entries ``a`` and ``b`` in one atomic step (both must exist).

    Raises ``_NoExchange`` where the system cannot (see ``_NO_EXCHANGE_ERRNOS``), ``OSError``
    for any other failure (nothing changed then either)."""
    if _renameat2 is None:
        raise _NoExchange("libc has no renameat2")
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE_ERRNOS:
        raise _NoExchange(os.strerror(err))
    raise OSError(err, os.strerror(err), a, None, b)


def _rmtree(path: str) -> Optional[BaseException]:
    """Remove the directory ``path`` if it exists (never through a link); the error, if any."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return e
    return None


def _is_dir(path: str) -> bool:
    """A directory, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _discard(path: str, target: str) -> Optional[BaseException]:
    """Remove a dead save's directory ``path``: renamed to ``.<name>.trash-<new tag>`` beside
    ``target`` first (one atomic step for anyone who still uses the name), then removed.  Not
    a directory (a link, a file: not ours): left alone."""
    if not _is_dir(path):
        return None
    parent, name = os.path.split(target)
    trash = os.path.join(parent, f".{name}.trash-{_liveness.new_tag()}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return None
    except OSError as e:
        return e
    return _rmtree(trash)


# ---------------------------------------------------------------------------------------------
# recovery
# ---------------------------------------------------------------------------------------------


def _names(target: str, tag: str) -> dict[str, str]:
    parent, name = os.path.split(target)
    return {k: os.path.join(parent, f".{name}.{k}-{tag}") for k in _KINDS}


def _resolve(target: str, names: dict[str, str], claimed: bool) -> bool:
    """Finish or undo what a dead save of ``target`` left under ``names``, then remove it.

    Returns whether it is all gone (False: left for a later call, see ``dcp_recover``)."""
    if not os.path.lexists(target) and _is_dir(names["old"]):
        if not claimed:
            return False  # the only copies of both checkpoints: never without the lock
        src = names["partial"] if _is_dir(names["partial"]) else names["old"]
        try:
            os.rename(src, target)
        except OSError:
            return False
        _liveness.fsync_dir(os.path.dirname(target))
    errors = [_discard(names["partial"], target), _discard(names["old"], target),
              _rmtree(names["trash"])]
    return all(e is None for e in errors)


def dcp_recover(checkpoint_id: str | os.PathLike) -> None:
    """Finish or undo the saves of ``checkpoint_id`` whose writers died, and remove what they
    left beside it (see the module doc).  Local (no collective); any process may call it."""
    target = os.path.realpath(os.fspath(checkpoint_id))
    parent, name = os.path.split(target)
    stems = {k: f".{name}.{k}-" for k in _KINDS}
    for tag, entries in _liveness.scan(parent, stems).items():
        names = _names(target, tag)
        fd = None
        # a lock file created while the directory was being listed may be missing from the
        # listing: look again (the lock file is created before the partial directory)
        if "lock" in entries or os.path.lexists(names["lock"]):
            fd = _liveness.claim_if_dead(names["lock"], tag)
            if fd is None:
                continue  # a live save (or cannot tell)
        try:
            if _resolve(target, names, claimed=fd is not None) and fd is not None:
                os.unlink(names["lock"])
        except OSError:  # another cleaner took it first; the next save looks again
            pass
        finally:
            if fd is not None:
                os.close(fd)


# ---------------------------------------------------------------------------------------------
# rank 0's side of one save
# ---------------------------------------------------------------------------------------------


def _check_target(target: str, given: Any, writer: _FileSystemWriter,
                  use_collectives: bool) -> None:
    """``target`` may be absent, or a directory holding DCP's files only (see module doc);
    ``given`` is how the caller named it (for torch's message)."""
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):  # what dcp.save's mkdir raises
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(given))
    names = os.listdir(target)
    foreign = sorted(n for n in names if not _DCP_FILE.fullmatch(n))
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise ValueError(
            f"dcp_save: checkpoint_id {target!r} holds {foreign[:5]}{more}, which "
            "torch.distributed.checkpoint did not write. dcp_save replaces the whole directory "
            "with the new checkpoint and would delete them with the previous one: move them "
            "elsewhere or save to another path (torch.distributed.checkpoint.save writes into "
            "the directory and keeps them, but a rank killed mid-save destroys the checkpoint)."
        )
    if not writer.overwrite and (".metadata" if use_collectives else "__0.metadata") in names:
        raise RuntimeError("Checkpoint already exists and self.overwrite=False.")  # torch's


class _Publisher:
    """Rank 0's lock, partial directory, publish and clean-up for one save (steps 1, 4, 5).

    States: ``writing`` (the partial directory is the new checkpoint in the making; ``abort``
    removes it), ``published`` (``garbage`` is the previous checkpoint, or None), ``stuck`` (a
    failed publish could not be undone: everything stays for ``dcp_recover``)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.parent, name = os.path.split(target)
        os.makedirs(self.parent, exist_ok=True)
        self.fd, self.lock, self.tag = _liveness.create_locked(self.parent, f".{name}.lock-")
        names = _names(target, self.tag)
        self.partial, self.old = names["partial"], names["old"]
        self.state = "writing"
        self.garbage: Optional[str] = None
        try:
            os.mkdir(self.partial)
        except BaseException:
            self._release(unlink=True)
            raise

    def check_complete(self, use_collectives: bool) -> None:
        """Every file the metadata rank 0 wrote names is in the partial directory at full
        length.  The metadata is read from its file: what ``dcp.save`` returns has no
        ``storage_data`` in torch 2.11 (its ``FileSystemWriter.finish`` fills a copy)."""
        present = {e.name: e.stat().st_size for e in os.scandir(self.partial)}
        md_file = ".metadata" if use_collectives else "__0.metadata"
        need = {md_file: 0}
        try:
            with open(os.path.join(self.partial, md_file), "rb") as f:
                metadata = pickle.load(f)  # DCP's own format (FileSystemWriter.finish)
        except (OSError, EOFError, pickle.UnpicklingError):
            metadata = None  # missing or short: reported below
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            rel = getattr(info, "relative_path", None)
            if rel is not None:
                need[rel] = max(need.get(rel, 0), info.offset + info.length)
        missing = sorted(f for f, size in need.items() if present.get(f, -1) < size
                         or (f == md_file and metadata is None))
        if missing:
            raise RuntimeError(
                f"dcp_save: the checkpoint written to {self.partial!r} lacks {missing[:5]} (or "
                "they are short): every rank must save to the same checkpoint_id on a file "
                "system that rank 0 sees too (a shared one, not node-local disks). Nothing was "
                "published."
            )

    def publish(self) -> None:
        _liveness.fsync_dir(self.partial)
        if not os.path.lexists(self.target):
            os.rename(self.partial, self.target)
        else:
            try:
                _exchange(self.partial, self.target)
                self.garbage = self.partial
            except _NoExchange:
                self._publish_by_two_renames()
        self.state = "published"
        _liveness.fsync_dir(self.parent)

    def _publish_by_two_renames(self) -> None:
        os.rename(self.target, self.old)
        try:
            os.rename(self.partial, self.target)
        except BaseException:
            try:
                os.rename(self.old, self.target)
            except OSError:
                self.state = "stuck"
            raise
        self.garbage = self.old

    def abort(self) -> None:
        """After a failure: remove the unpublished checkpoint, the lock file, release."""
        if self.state == "writing":
            _rmtree(self.partial)
        self._release(unlink=self.state == "writing")

    def finish(self) -> None:
        """After a publish: remove the previous checkpoint and the lock file, release."""
        error = None if self.garbage is None else _rmtree(self.garbage)
        self._release(unlink=error is None)
        if error is not None:
            warnings.warn(
                f"dcp_save: the new checkpoint is at {self.target!r}, but removing the previous "
                f"one ({self.garbage!r}) failed: {error}. The next dcp_save of that path (or "
                "cfsdp.checkpoint.dcp_recover) removes it.", stacklevel=3)

    def _release(self, unlink: bool) -> None:
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self.lock)
        _liveness.release(self.fd, self.tag)


# ---------------------------------------------------------------------------------------------
# dcp_save
# ---------------------------------------------------------------------------------------------


def _writer_and_target(storage_writer: Any, checkpoint_id: Any) -> tuple[_FileSystemWriter, Any]:
    """The FileSystemWriter to redirect and the destination as the caller named it (what
    ``dcp.save``'s ``_storage_setup`` would use); errors for what cannot be redirected."""
    if storage_writer is None:
        if not checkpoint_id:  # torch's message
            raise RuntimeError(
                "`checkpoint_id` must be specified if storage_reader/storage_writer is None.")
        if not FileSystemWriter.validate_checkpoint_id(checkpoint_id):
            if "://" in str(checkpoint_id):
                raise NotImplementedError(
                    f"dcp_save: checkpoint_id={str(checkpoint_id)!r} is not a local path: dcp_save "
                    "publishes by renaming a directory on a POSIX file system (local or shared). "
                    "Use torch.distributed.checkpoint.save for other storage (it is not "
                    "crash-safe)."
                )
            raise RuntimeError(  # torch's message
                "Cannot detect which StorageReader or StorageWriter to use. "
                "Please specify the storage_reader/storage_writer."
            )
        return FileSystemWriter(checkpoint_id), checkpoint_id
    redirectable = isinstance(storage_writer, _FileSystemWriter) and \
        type(storage_writer.fs) is FileSystem
    if not redirectable:
        fs = type(getattr(storage_writer, "fs", None))
        raise NotImplementedError(
            f"dcp_save: storage_writer={type(storage_writer).__name__} "
            f"(file system {fs.__module__}.{fs.__qualname__}) cannot be redirected: dcp_save "
            "writes through torch's FileSystemWriter into a sibling directory and renames it "
            "into place. Pass a torch.distributed.checkpoint.FileSystemWriter (its options are "
            "kept) or checkpoint_id alone, or call torch.distributed.checkpoint.save with this "
            "writer (it is not crash-safe)."
        )
    return storage_writer, (checkpoint_id if checkpoint_id else storage_writer.path)


@contextlib.contextmanager
def _redirected(writer: _FileSystemWriter, given: Any) -> Iterator[None]:
    """For one ``dcp.save(checkpoint_id=partial, storage_writer=writer)``: the StorageMeta it
    records names ``given``, and afterwards ``writer.path`` is ``given``, as after
    ``dcp.save(checkpoint_id=given)``."""
    own = vars(writer)
    saved = own.get("storage_meta", None)
    had = "storage_meta" in own
    original = writer.storage_meta
    final = writer.fs.init_path(given)

    def storage_meta():
        meta = original()
        if meta is not None and meta.checkpoint_id == writer.path:
            meta = dataclasses.replace(meta, checkpoint_id=final)
        return meta

    writer.storage_meta = storage_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            writer.storage_meta = saved  # type: ignore[method-assign]
        else:
            del writer.storage_meta
        writer.path = final


def _noted(e: BaseException, note: str) -> BaseException:
    """``e`` with ``note`` added (shown under its message; DCP's CheckpointException is a
    BaseException); KeyboardInterrupt and SystemExit unchanged."""
    if not isinstance(e, (KeyboardInterrupt, SystemExit)):
        e.add_note(note)
    return e


@_api_bc_check  # as dcp.save: the old positional (state_dict, storage_writer) still works
def dcp_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: Optional[dist.ProcessGroup] = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Metadata:
    """``torch.distributed.checkpoint.save`` with the same arguments and result, all or
    nothing: the new checkpoint replaces the one at ``checkpoint_id`` only once every rank has
    written it, in one atomic rename (see the module doc for the protocol, the guarantee and
    what differs).  A collective over ``process_group``: every rank must call it."""
    no_dist = no_dist or (not dist.is_available()) or (not dist.is_initialized())
    rank = 0 if no_dist else dist.get_rank(process_group)

    # 1. prepare
    publisher: Optional[_Publisher] = None
    error: Optional[BaseException] = None
    target: Any = checkpoint_id
    try:
        writer, given = _writer_and_target(storage_writer, checkpoint_id)
        target = os.path.realpath(os.fspath(given))
        if rank == 0:
            dcp_recover(target)
            _check_target(target, given, writer, use_collectives)
            publisher = _Publisher(target)
    except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised here
        error = e
    what = f"dcp_save({str(target)!r})"
    kept = f"cfsdp.checkpoint.dcp_save: nothing was published; {target} holds what it held before."
    try:
        tags = agree(process_group, error, f"{what}: preparing", publisher and publisher.tag,
                     no_dist=no_dist)
    except BaseException as e:
        if publisher is not None:
            publisher.abort()
        raise _noted(e, kept)
    partial = _names(target, tags[0])["partial"]

    # 2. write, 3. agree (a rank whose dcp.save raised does not agree: its peers' dcp.save
    # raised too, or they wait in its collectives until the process group's timeout)
    error = None
    try:
        with _redirected(writer, given):
            metadata = dcp.save(state_dict, checkpoint_id=partial, storage_writer=writer,
                                planner=planner, process_group=process_group, no_dist=no_dist,
                                use_collectives=use_collectives)
        if publisher is not None:
            try:
                publisher.check_complete(use_collectives)
            except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised here
                error = e
        agree(process_group, error, f"{what}: writing", no_dist=no_dist)
    except BaseException as e:
        if publisher is not None:
            publisher.abort()
        raise _noted(e, kept)

    # 4. publish
    error = None
    if publisher is not None:
        try:
            publisher.publish()
        except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised here
            error = e
            publisher.abort()
    try:
        agree(process_group, error, f"{what}: publishing", no_dist=no_dist)
    except BaseException as e:
        if publisher is None:
            note = (f"cfsdp.checkpoint.dcp_save: rank 0 failed or stopped during the publish; "
                    f"{target} holds the previous checkpoint or the new one, each complete (if "
                    f"it is missing, call cfsdp.checkpoint.dcp_recover({target!r})).")
        elif publisher.state == "published":
            note = (f"cfsdp.checkpoint.dcp_save: the new checkpoint is at {target}; a rank "
                    "failed after it was published.")
            publisher.finish()
        elif publisher.state == "stuck":
            note = (f"cfsdp.checkpoint.dcp_save: the publish could not be undone; call "
                    f"cfsdp.checkpoint.dcp_recover({target!r}) to finish it.")
        else:
            note = kept
        raise _noted(e, note)

    # 5. clean up
    if publisher is not None:
        publisher.finish()
    return metadata
