"""The leftovers of killed writers: ``atomic_save`` removes those of dead writers of the same
path, never those of a live writer, never anything else (cfsdp.checkpoint._liveness).

Live writers are real processes: a saver stopped with SIGSTOP half-way through its write, and a
small "holder" process that creates a file and holds its ``flock`` (a writer on this host or, by
its tag, on another one).  Dead writers are processes that ran and were reaped.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cfsdp.checkpoint import _liveness, atomic_save

from test_checkpoint_atomic import BIG_NUMEL, CHILD_TIMEOUT_S, OLD, run_child, scenario_sigkill_mid_write

pytestmark = pytest.mark.no_core  # plain Python and torch.save, like test_checkpoint_atomic

NEW = {"step": 8, "w": torch.ones(2, 2)}
STEM = ".ckpt.pt.tmp-"

_HOLDER = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("LOCKED", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def held(path: Path):
    """A live writer: another process holds the flock of ``path`` (created if missing)."""
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"LOCKED"
        yield p.pid
    finally:
        p.stdin.close()
        p.wait(timeout=CHILD_TIMEOUT_S)


def dead_pid() -> int:
    """The id of a process of this host that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def tag(pid: int, host: str | None = None) -> str:
    return f"{pid}@{host or _liveness.host()}.{secrets.token_hex(8)}"


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def loads(path: Path, want: dict) -> bool:
    got = torch.load(path, weights_only=True)
    return set(got) == set(want) and all(
        torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items()
    )


def test_killed_writer_leftover_removed_by_next_save(tmp_path):
    path = tmp_path / "ckpt.pt"
    assert scenario_sigkill_mid_write("atomic", tmp_path) == []  # SIGKILLed after >= 1 MB
    strays = [p for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    assert len(strays) == 1 and strays[0].name.startswith(STEM), names(tmp_path)
    assert strays[0].stat().st_size >= 1 << 20
    atomic_save(NEW, path)
    assert names(tmp_path) == ["ckpt.pt"] and loads(path, NEW)


def test_live_writer_is_not_disturbed(tmp_path):
    """A writer stopped half-way (alive, lock held) keeps its file through another save, then
    finishes and publishes its own checkpoint."""
    path = tmp_path / "ckpt.pt"
    torch.save(OLD, path)
    child = run_child("atomic", """
        import os, torch
        print("START", flush=True)
        save({"big": torch.zeros(%d)}, os.environ["CKPT_PATH"])
        print("DONE", flush=True)
    """ % BIG_NUMEL, path)
    try:
        assert child.stdout.readline().strip() == b"START"
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        tmp = None
        while tmp is None and time.monotonic() < deadline and child.poll() is None:
            for p in tmp_path.glob(STEM + "*"):
                with contextlib.suppress(FileNotFoundError):
                    if p.stat().st_size >= 1 << 20:
                        tmp = p
            time.sleep(0.0005)
        assert tmp is not None, "the child never got half-way"
        child.send_signal(signal.SIGSTOP)
        inode = tmp.stat().st_ino
        atomic_save(NEW, path)
        assert loads(path, NEW)
        assert tmp.exists() and tmp.stat().st_ino == inode, "a live writer's file was removed"
    finally:
        child.send_signal(signal.SIGCONT)
        out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0 and b"DONE" in out, err.decode()[-2000:]
    assert names(tmp_path) == ["ckpt.pt"]
    assert torch.load(path, weights_only=True)["big"].numel() == BIG_NUMEL


def test_lock_decides_for_another_hosts_writer(tmp_path):
    """A tag of another host: its process cannot be looked up, the lock alone decides."""
    path = tmp_path / "ckpt.pt"
    other = tmp_path / (STEM + tag(dead_pid(), "other-host.example"))
    with held(other):
        atomic_save(NEW, path)
        assert other.exists()
    atomic_save(NEW, path)  # its writer is gone
    assert names(tmp_path) == ["ckpt.pt"]


def test_process_guard_on_this_host(tmp_path):
    """Unlocked files (a file system that does not enforce locks): one of a live process of this
    host stays; those of an exited process and of this process (not held) go; one this
    process holds stays until released."""
    path = tmp_path / "ckpt.pt"
    live = tmp_path / (STEM + tag(os.getppid()))
    dead = tmp_path / (STEM + tag(dead_pid()))
    mine_released = tmp_path / (STEM + tag(os.getpid()))
    for p in (live, dead, mine_released):
        p.write_bytes(b"x" * 100)
    fd, mine_held, t = _liveness.create_locked(str(tmp_path), STEM)
    try:
        atomic_save(NEW, path)
        assert names(tmp_path) == sorted(["ckpt.pt", live.name, Path(mine_held).name])
    finally:
        _liveness.release(fd, t)
    atomic_save(NEW, path)
    assert names(tmp_path) == sorted(["ckpt.pt", live.name])


def test_unrelated_entries_are_untouched(tmp_path):
    path = tmp_path / "ckpt.pt"
    other_host = "other-host"
    t = [tag(dead_pid(), other_host) for _ in range(5)]
    keep_files = [
        ".ckpt.pt.tmp-abcd1234",        # an older cfsdp's untagged temporary file (or the user's)
        STEM + t[0] + "x",              # not exactly the pattern
        STEM + t[0][:-1],
        ".other.pt.tmp-" + t[0],        # another destination's
        "ckpt.pt.tmp-" + t[0],
        "ckpt.pt.bak",
    ]
    for n in keep_files:
        (tmp_path / n).write_bytes(b"user data")
    (tmp_path / (STEM + t[1])).mkdir()  # a directory
    (tmp_path / (STEM + t[1]) / "inside").write_bytes(b"user data")
    (tmp_path / "elsewhere.bin").write_bytes(b"user data")
    (tmp_path / (STEM + t[2])).symlink_to(tmp_path / "elsewhere.bin")  # a link to a user file
    os.mkfifo(tmp_path / (STEM + t[3]))  # a FIFO (opening it must not block)
    leftover = tmp_path / (STEM + t[4])  # the one real leftover: a dead writer's file
    leftover.write_bytes(b"x" * 1000)
    before = names(tmp_path)
    atomic_save(NEW, path)
    assert names(tmp_path) == sorted(set(before) - {leftover.name} | {"ckpt.pt"})
    for n in keep_files + ["elsewhere.bin", STEM + t[1] + "/inside"]:
        assert (tmp_path / n).read_bytes() == b"user data", n


def test_writer_starts_over_if_claimed_before_locking(tmp_path, monkeypatch):
    """A cleaner can claim and remove the writer's new file between its creation and its
    locking; the writer must notice and take another name (else os.replace fails)."""
    path = tmp_path / "ckpt.pt"
    real_flock = _liveness.fcntl.flock
    stolen = []

    def flock(fd, op):
        if not stolen:  # the first lock is the writer's: a cleaner removes the file first
            victim = os.readlink(f"/proc/self/fd/{fd}")
            os.unlink(victim)
            stolen.append(victim)
        return real_flock(fd, op)

    monkeypatch.setattr(_liveness.fcntl, "flock", flock)
    atomic_save(NEW, path)
    monkeypatch.undo()
    assert stolen and Path(stolen[0]).name.startswith(STEM)
    assert names(tmp_path) == ["ckpt.pt"] and loads(path, NEW)
