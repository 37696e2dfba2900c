"""cfsdp.checkpoint.dcp_save / dcp_recover in one process (``no_dist``): parity with
``torch.distributed.checkpoint.save`` (files, metadata, values, errors), the publish with and
without RENAME_EXCHANGE, failures at each step, and recovery from every state a dead save can
leave.  Kills of real ranks: tests/distributed/test_dcp_save.py.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

import torch.distributed.checkpoint.filesystem as dcp_fs
from cfsdp import _torch
from cfsdp.checkpoint import _dcp_save, dcp_recover, dcp_save

from test_checkpoint_leftovers import dead_pid, held, names, tag

pytestmark = [
    pytest.mark.no_core,  # plain Python and torch.distributed.checkpoint
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

BF16 = torch.bfloat16
A = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=BF16), "step": 1}
B = {"w": -torch.arange(6.0).reshape(2, 3) - 1, "b": torch.zeros(4, dtype=BF16), "step": 2}
C = {"w": torch.full((2, 3), 7.0), "b": torch.full((4,), 3.0, dtype=BF16), "step": 3}
STATES = {"A": A, "B": B, "C": C}


def which(path: Path) -> str:
    """``A``/``B``/``C`` if ``path`` loads as exactly that state, ``missing``, or what is wrong."""
    if not (path / ".metadata").exists():
        return "missing"
    sd = {"w": torch.empty(2, 3), "b": torch.empty(4, dtype=BF16), "step": 0}
    try:
        dcp.load(sd, checkpoint_id=path, no_dist=True)
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        return f"does not load: {type(e).__name__}"
    for name, want in STATES.items():
        if sd["step"] == want["step"] and all(torch.equal(sd[k], want[k]) for k in ("w", "b")):
            return name
    return f"neither: {sd}"


def save_plain(state: dict, path: Path) -> None:
    dcp.save(state, checkpoint_id=path, no_dist=True)


def test_signature_is_dcp_saves():
    import inspect

    mine, torch_s = inspect.signature(dcp_save), inspect.signature(dcp.save)
    assert [(p.name, p.kind, p.default) for p in mine.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in torch_s.parameters.values()]


def test_old_positional_storage_writer_as_torch(tmp_path):
    with pytest.warns(UserWarning, match="argument order of dcp_save has been changed"):
        dcp_save(A, FileSystemWriter(tmp_path / "ck"), no_dist=True)
    assert which(tmp_path / "ck") == "A"


def test_round_trip_replaces_and_records_the_path(tmp_path):
    target = tmp_path / "ck"
    md = dcp_save(A, checkpoint_id=target, no_dist=True)
    assert isinstance(md, Metadata) and which(target) == "A" and names(tmp_path) == ["ck"]
    md = dcp_save(B, checkpoint_id=str(target), no_dist=True)
    assert which(target) == "B" and names(tmp_path) == ["ck"]
    stored = FileSystemReader(target).read_metadata().storage_meta
    assert stored.checkpoint_id == target
    # dcp_save returns what dcp.save returns: torch 2.13+ the metadata it wrote, 2.11 the global
    # plan's (its FileSystemWriter.finish fills a copy: no storage_meta, no storage_data)
    theirs = dcp.save(A, checkpoint_id=tmp_path / "plain", no_dist=True)
    assert (md.storage_meta is None) == (theirs.storage_meta is None) == (not _torch.at_least(2, 12))
    if md.storage_meta is not None:
        assert stored.save_id == md.storage_meta.save_id


@pytest.mark.parametrize("opts", [{}, {"single_file_per_rank": False}, {"thread_count": 2}],
                         ids=["default", "file-per-tensor", "two-threads"])
def test_same_checkpoint_as_torch(tmp_path, opts):
    """Same files, metadata and values as dcp.save with the same FileSystemWriter options, and
    the writer ends up pointing at the checkpoint, as after dcp.save."""
    writers = {}
    for impl, save in (("torch", dcp.save), ("cfsdp", dcp_save)):
        target = tmp_path / impl / "ck"
        target.parent.mkdir()
        writers[impl] = FileSystemWriter(target, **opts)
        save(A, storage_writer=writers[impl], no_dist=True)
        assert which(target) == "A" and writers[impl].path == target
    t, c = (tmp_path / i / "ck" for i in ("torch", "cfsdp"))
    assert names(t) == names(c) and names(c.parent) == ["ck"]
    mt, mc = (FileSystemReader(p).read_metadata() for p in (t, c))
    assert mt.state_dict_metadata == mc.state_dict_metadata
    assert mt.storage_data == mc.storage_data
    assert mc.storage_meta.checkpoint_id == c


def test_checkpoint_id_overrides_the_writers_path(tmp_path):
    writer = FileSystemWriter(tmp_path / "x")
    dcp_save(A, checkpoint_id=tmp_path / "y", storage_writer=writer, no_dist=True)
    assert names(tmp_path) == ["y"] and which(tmp_path / "y") == "A" and writer.path == tmp_path / "y"


def torch_error(**kw) -> str:
    with pytest.raises(BaseException) as info:
        dcp.save(A, no_dist=True, **kw)
    return str(info.value)


def test_errors_contain_torchs_message(tmp_path):
    with pytest.raises(RuntimeError) as info:
        dcp_save(A, no_dist=True)
    assert str(info.value) == torch_error()

    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(FileExistsError) as info:
        dcp_save(A, checkpoint_id=tmp_path / "file", no_dist=True)
    assert str(info.value) in torch_error(checkpoint_id=tmp_path / "file")

    save_plain(A, tmp_path / "ck")
    with pytest.raises(RuntimeError) as info:
        dcp_save(B, storage_writer=FileSystemWriter(tmp_path / "ck", overwrite=False), no_dist=True)
    assert str(info.value) in torch_error(storage_writer=FileSystemWriter(tmp_path / "ck", overwrite=False))
    assert which(tmp_path / "ck") == "A" and names(tmp_path) == ["ck", "file"]


def test_storage_it_cannot_redirect(tmp_path):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    with pytest.raises(NotImplementedError, match=r"storage_writer=FsspecWriter .*FileSystemWriter"):
        dcp_save(A, storage_writer=FsspecWriter(str(tmp_path / "ck")), no_dist=True)
    with pytest.raises(NotImplementedError, match="is not a local path"):
        dcp_save(A, checkpoint_id="memory://bucket/ck", no_dist=True)
    assert names(tmp_path) == []


def test_refuses_a_directory_with_other_files(tmp_path):
    target = tmp_path / "ck"
    save_plain(A, target)
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"\['notes.txt'\].*move them elsewhere"):
        dcp_save(B, checkpoint_id=target, no_dist=True)
    assert which(target) == "A" and (target / "notes.txt").read_text() == "mine"
    assert names(tmp_path) == ["ck"]


def test_stale_shards_of_an_earlier_save_are_dcp_files(tmp_path):
    """A directory holding shard files of a larger world size (DCP's names) is replaced."""
    target = tmp_path / "ck"
    save_plain(A, target)
    (target / "__3_0.distcp").write_bytes(b"stale")
    dcp_save(B, checkpoint_id=target, no_dist=True)
    assert which(target) == "B" and "__3_0.distcp" not in names(target)


def test_symlinked_checkpoint_stays_a_link(tmp_path):
    real = tmp_path / "real"
    save_plain(A, real / "ck")
    (tmp_path / "link").symlink_to(real)
    dcp_save(B, checkpoint_id=tmp_path / "link" / "ck", no_dist=True)
    assert (tmp_path / "link").is_symlink() and which(real / "ck") == "B" and names(real) == ["ck"]


def test_exchange_swaps_two_directories(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "from_a").touch()
    (tmp_path / "b").mkdir()
    _dcp_save._exchange(str(tmp_path / "a"), str(tmp_path / "b"))
    assert names(tmp_path / "a") == [] and names(tmp_path / "b") == ["from_a"]


def failing_renameat2(err: int):
    def fn(*args):
        ctypes.set_errno(err)
        return -1

    return fn


@pytest.mark.parametrize("how", ["no-libc-symbol", "EINVAL", "ENOSYS", "EOPNOTSUPP"])
def test_publish_without_exchange(tmp_path, monkeypatch, how):
    fake = None if how == "no-libc-symbol" else failing_renameat2(getattr(errno, how))
    monkeypatch.setattr(_dcp_save, "_renameat2", fake)
    target = tmp_path / "ck"
    dcp_save(A, checkpoint_id=target, no_dist=True)
    dcp_save(B, checkpoint_id=target, no_dist=True)
    assert which(target) == "B" and names(tmp_path) == ["ck"]


def test_failed_exchange_publishes_nothing(tmp_path, monkeypatch):
    target = tmp_path / "ck"
    dcp_save(A, checkpoint_id=target, no_dist=True)
    monkeypatch.setattr(_dcp_save, "_renameat2", failing_renameat2(errno.EACCES))
    with pytest.raises(PermissionError) as info:
        dcp_save(B, checkpoint_id=target, no_dist=True)
    assert any("nothing was published" in n for n in info.value.__notes__)
    assert which(target) == "A" and names(tmp_path) == ["ck"]


def fail_publish_rename(tmp_path, monkeypatch, fails) -> tuple[Path, BaseException]:
    """Save A, then B through the fallback publish with ``os.rename(src, dst)`` failing where
    ``fails(src, dst)``; the target and the error B's save raised."""
    target = tmp_path / "ck"
    dcp_save(A, checkpoint_id=target, no_dist=True)
    monkeypatch.setattr(_dcp_save, "_renameat2", None)
    real_rename = os.rename

    def rename(src, dst):
        if fails(Path(src), Path(dst)):
            raise OSError(errno.EIO, "injected")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="injected") as info:
        dcp_save(B, checkpoint_id=target, no_dist=True)
    monkeypatch.undo()
    return target, info.value


def test_failed_second_rename_is_undone(tmp_path, monkeypatch):
    # the publish's rename of the partial directory, not DCP's own renames inside it
    target, e = fail_publish_rename(tmp_path, monkeypatch, lambda src, dst: src.name.startswith(".ck.partial-"))
    assert any("nothing was published" in n for n in e.__notes__)
    assert which(target) == "A" and names(tmp_path) == ["ck"]


def test_publish_that_cannot_be_undone_is_finished_by_recover(tmp_path, monkeypatch):
    """Both the second rename and its undo fail: the save says so, and dcp_recover (in the same
    process: its tag is no longer held) puts the new checkpoint in place."""
    target, e = fail_publish_rename(tmp_path, monkeypatch, lambda src, dst: dst == tmp_path / "ck")
    assert any("dcp_recover" in n for n in e.__notes__)
    assert which(target) == "missing"
    dcp_recover(target)
    assert which(target) == "B" and names(tmp_path) == ["ck"]


def test_write_error_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "ck"
    dcp_save(A, checkpoint_id=target, no_dist=True)
    real = dcp_fs._write_item
    calls = []

    def write_item(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "injected: no space left")
        return real(*args, **kw)

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    with pytest.raises(BaseException, match="injected") as info:
        dcp_save(B, checkpoint_id=target, no_dist=True)
    assert any("nothing was published" in n for n in info.value.__notes__)
    assert which(target) == "A" and names(tmp_path) == ["ck"]


def test_incomplete_partial_is_not_published(tmp_path, monkeypatch):
    """A shard file short after dcp.save returned (e.g. a rank that wrote elsewhere)."""
    target = tmp_path / "ck"
    dcp_save(A, checkpoint_id=target, no_dist=True)
    real = dcp.save

    def save(*args, checkpoint_id, **kw):
        md = real(*args, checkpoint_id=checkpoint_id, **kw)
        os.truncate(Path(checkpoint_id) / "__0_0.distcp", 10)
        return md

    monkeypatch.setattr(dcp, "save", save)
    with pytest.raises(RuntimeError, match=r"lacks \['__0_0.distcp'\]"):
        dcp_save(B, checkpoint_id=target, no_dist=True)
    assert which(target) == "A" and names(tmp_path) == ["ck"]


# --------------------------------------------------------------------------------- recovery

# the states a dead save can leave: what is at the target and under the tag's names
# (None: absent; "B-"; half-written), whether its lock file exists, and what must be at the
# target after dcp_recover
RECOVERY = {
    # name: (target, partial, old, lock file, target after, entries left)
    "before-publish": ("A", "B", None, True, "A", False),
    "half-written": ("A", "B-", None, True, "A", False),
    "first-save": (None, "B", None, True, "missing", False),
    "after-exchange": ("B", "A", None, True, "B", False),
    "fallback-between-renames": (None, "B", "A", True, "B", False),
    "fallback-renamed-back": (None, None, "A", True, "A", False),
    "fallback-after": ("B", None, "A", True, "B", False),
    "no-lock-file": ("A", "B", None, False, "A", False),
    "no-lock-file-between": (None, "B", "A", False, "missing", True),  # never without the lock
}


def build(tmp_path: Path, state: tuple, host: str | None = None) -> tuple[Path, dict[str, Path]]:
    target = tmp_path / "ck"
    t = tag(dead_pid(), host)
    paths = {k: Path(v) for k, v in _dcp_save._names(str(target), t).items()}
    at, partial, old, lock = state[:4]
    for where, what in ((target, at), (paths["partial"], partial), (paths["old"], old)):
        if what is not None:
            save_plain(STATES[what[0]], where)
            if what.endswith("-"):  # half-written: no metadata yet, a short shard file
                (where / ".metadata").unlink()
                os.truncate(where / "__0_0.distcp", 5)
    if lock:
        paths["lock"].write_bytes(b"")
    return target, paths


@pytest.mark.parametrize("host", ["this-host", "other-host"])
@pytest.mark.parametrize("case", list(RECOVERY))
def test_recover_dead_save(tmp_path, case, host):
    state = RECOVERY[case]
    target, paths = build(tmp_path, state, None if host == "this-host" else "other-host")
    left = sorted(p.name for p in paths.values() if p.exists())
    dcp_recover(target)
    assert which(target) == state[4]
    if state[5]:
        assert names(tmp_path) == left  # untouched
        return
    assert names(tmp_path) == ([] if state[4] == "missing" else ["ck"])
    dcp_save(C, checkpoint_id=target, no_dist=True)  # the next save just works
    assert which(target) == "C" and names(tmp_path) == ["ck"]


@pytest.mark.parametrize("case", ["before-publish", "after-exchange", "fallback-between-renames"])
def test_live_save_is_untouched(tmp_path, case):
    """The lock held by a live process (its tag: another host, so the lock alone decides)."""
    state = RECOVERY[case]
    target, paths = build(tmp_path, state, "other-host")
    before = {p.name: sorted(os.listdir(p)) if p.is_dir() else None for p in tmp_path.iterdir()}
    with held(paths["lock"]):
        dcp_recover(target)
        assert {p.name: sorted(os.listdir(p)) if p.is_dir() else None
                for p in tmp_path.iterdir()} == before
        if state[0] is not None:  # a save beside it works and leaves it alone
            dcp_save(C, checkpoint_id=target, no_dist=True)
            assert which(target) == "C"
            assert names(tmp_path) == sorted(before)
    dcp_recover(target)  # once its writer is gone
    assert names(tmp_path) == ["ck"]


def test_unrelated_entries_are_untouched(tmp_path):
    target = tmp_path / "ck"
    save_plain(A, target)
    t = tag(dead_pid(), "other-host")
    keep = [".ck.partial-abc", ".ck.partial-" + t + "x", ".other.partial-" + t, "ck.partial-" + t,
            ".ck.tmp-" + t, "ck.bak"]
    for n in keep:
        save_plain(B, tmp_path / n)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "data").write_text("mine")
    t2 = tag(dead_pid(), "other-host")
    (tmp_path / (".ck.partial-" + t2)).symlink_to(tmp_path / "elsewhere")  # a link: not followed
    for kind in ("partial", "trash"):  # the real leftovers
        save_plain(B, tmp_path / f".ck.{kind}-{tag(dead_pid(), 'other-host')}")
    dcp_save(C, checkpoint_id=target, no_dist=True)
    assert names(tmp_path) == sorted(keep + ["ck", "elsewhere", ".ck.partial-" + t2])
    assert all(which(tmp_path / n) == "B" for n in keep)
    assert (tmp_path / "elsewhere" / "data").read_text() == "mine"
    shutil.rmtree(tmp_path / "elsewhere")
