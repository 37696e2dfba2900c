"""cfsdp.checkpoint.atomic_save: a save that fails or is killed half-way never leaves a file
at ``path`` that is anything but the previous complete checkpoint.

Each scenario is a function that runs one saver and returns the damage it finds (an empty
list when ``path`` still loads as the old checkpoint and, where the saver ran to its end, no
temporary files are left).  Every scenario is run twice: with ``atomic_save`` (no damage
allowed) and with a naive ``torch.save(obj, path)`` (damage required), so a scenario that
stopped exercising a failure half-way through a write would fail its control test.

Crashes are real: a child process is SIGKILLed while the bytes of a 200 MB tensor are being
written, or leaves with ``os._exit`` from inside the save (a pickling hook, and just before the
rename).  An error half-way through writing is a real ``EFBIG`` from ``RLIMIT_FSIZE``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

import cfsdp
from cfsdp.checkpoint import atomic_save

# atomic_save is plain Python (os, tempfile, torch.save): no core call here or in the children,
# which only import cfsdp; run once, not again under the sanitizer or on the twins (see
# tests/unit/conftest.py).
pytestmark = pytest.mark.no_core

PKG_ROOT = str(Path(cfsdp.__file__).resolve().parent.parent)

OLD = {"step": 7, "w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
BIG_NUMEL = 50 * 1024 * 1024  # 200 MB of float32: long enough to be killed mid-write
CHILD_TIMEOUT_S = 60


def naive_save(obj, path, **kw) -> None:
    torch.save(obj, path, **kw)


SAVERS = {"atomic": "from cfsdp.checkpoint import atomic_save as save",
          "naive": "import torch\ndef save(obj, path): torch.save(obj, path)"}


class Boom:
    """Pickling it raises (after the save opened its destination)."""

    def __reduce__(self):
        raise RuntimeError("boom while pickling")


def write_old(path: Path) -> None:
    torch.save(OLD, path)


def damage(path: Path, *, strays_allowed: bool) -> list[str]:
    """What is wrong with ``path``'s directory compared with 'old checkpoint intact'."""
    problems = []
    if not path.exists():
        problems.append(f"{path.name} is gone")
    else:
        try:
            got = torch.load(path, weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure to load is the damage
            problems.append(f"{path.name} does not load: {type(e).__name__}: {e}"[:200])
        else:
            if set(got) != set(OLD) or got["step"] != OLD["step"] or not torch.equal(got["w"], OLD["w"]):
                problems.append(f"{path.name} loads but is not the old checkpoint: {got}"[:200])
    strays = sorted(p.name for p in path.parent.iterdir() if p.name != path.name)
    if strays and not strays_allowed:
        problems.append(f"temporary files left behind: {strays}")
    return problems


def run_child(saver: str, body: str, path: Path, extra_env: dict | None = None) -> subprocess.Popen:
    code = SAVERS[saver] + "\n" + textwrap.dedent(body)
    env = dict(os.environ, OMP_NUM_THREADS="1", CKPT_PATH=str(path), **(extra_env or {}))
    # the child imports the same cfsdp as this process
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PKG_ROOT, env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


# ----------------------------------------------------------------------------- scenarios


def scenario_pickling_error(saver: Callable, tmp_path: Path) -> list[str]:
    path = tmp_path / "ckpt.pt"
    write_old(path)
    with pytest.raises(RuntimeError, match="boom while pickling"):
        saver({"w": torch.ones(3), "bad": Boom()}, path)
    return damage(path, strays_allowed=False)


def scenario_write_error(saver: str, tmp_path: Path) -> list[str]:
    """The file-size limit makes a write fail with EFBIG after 1 MB of the 200 MB tensor."""
    path = tmp_path / "ckpt.pt"
    write_old(path)
    child = run_child(saver, """
        import os, resource, signal, torch
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            save({"big": torch.zeros(%d)}, os.environ["CKPT_PATH"])
        except Exception as e:
            print("RAISED", type(e).__name__, e)
        else:
            print("SAVED")
    """ % BIG_NUMEL, path)
    out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, err.decode()
    assert out.startswith(b"RAISED"), (out, err)  # the write really failed half-way
    return damage(path, strays_allowed=False)


def scenario_sigkill_mid_write(saver: str, tmp_path: Path) -> list[str]:
    """SIGKILL once some file in the directory holds >= 1 MB of the new 200 MB checkpoint."""
    path = tmp_path / "ckpt.pt"
    write_old(path)
    child = run_child(saver, """
        import os, sys, torch
        big = {"big": torch.zeros(%d)}
        print("START", flush=True)
        save(big, os.environ["CKPT_PATH"])
        print("DONE", flush=True)
    """ % BIG_NUMEL, path)
    assert child.stdout.readline().strip() == b"START"
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    killed = False
    while time.monotonic() < deadline and child.poll() is None:
        sizes = []
        for p in tmp_path.iterdir():
            try:
                sizes.append(p.stat().st_size)
            except FileNotFoundError:  # renamed away between listing and stat
                pass
        if any(s >= (1 << 20) for s in sizes):
            child.send_signal(signal.SIGKILL)
            killed = True
            break
        time.sleep(0.0005)
    child.wait(timeout=CHILD_TIMEOUT_S)
    out = child.stdout.read()
    assert killed and child.returncode == -signal.SIGKILL, (child.returncode, out)
    assert b"DONE" not in out  # killed before the save finished
    return damage(path, strays_allowed=True)  # a killed process cannot clean up


def scenario_exit_in_pickling_hook(saver: str, tmp_path: Path) -> list[str]:
    """The process dies (os._exit) from inside the save, while the object is pickled."""
    path = tmp_path / "ckpt.pt"
    write_old(path)
    child = run_child(saver, """
        import os, torch
        class Die:
            def __reduce__(self):
                os._exit(3)
        save({"w": torch.ones(4), "die": Die()}, os.environ["CKPT_PATH"])
    """, path)
    _, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 3, err.decode()
    return damage(path, strays_allowed=True)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("saver, want_damage", [(atomic_save, False), (naive_save, True)],
                         ids=["atomic", "naive-control"])
def test_pickling_error_keeps_old_file(tmp_path, saver, want_damage):
    assert bool(scenario_pickling_error(saver, tmp_path)) == want_damage


@pytest.mark.parametrize("scenario", [
    scenario_write_error, scenario_sigkill_mid_write, scenario_exit_in_pickling_hook,
], ids=lambda f: f.__name__.removeprefix("scenario_"))
@pytest.mark.parametrize("saver", ["atomic", "naive"], ids=["atomic", "naive-control"])
def test_crash_or_error_mid_save(tmp_path, scenario, saver):
    problems = scenario(saver, tmp_path)
    if saver == "atomic":
        assert problems == []
    else:
        assert problems, "the naive save survived: the scenario does not interrupt a write"


def test_exit_before_rename_keeps_old_file(tmp_path):
    """Killed after the temporary file is complete and fsynced, before ``os.replace``."""
    path = tmp_path / "ckpt.pt"
    write_old(path)
    child = run_child("atomic", """
        import os, torch
        os.replace = lambda *a, **k: os._exit(4)
        save({"w": torch.ones(4)}, os.environ["CKPT_PATH"])
    """, path)
    _, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 4, err.decode()
    assert damage(path, strays_allowed=True) == []


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_late_failure_removes_temp_file(tmp_path, monkeypatch, failing):
    path = tmp_path / "ckpt.pt"
    write_old(path)

    def fail(*a, **k):
        raise OSError(f"{failing} failed")

    monkeypatch.setattr(os, failing, fail)
    with pytest.raises(OSError, match=f"{failing} failed"):
        atomic_save({"w": torch.ones(2)}, path)
    monkeypatch.undo()
    assert damage(path, strays_allowed=False) == []


def test_success_round_trips(tmp_path):
    path = tmp_path / "ckpt.pt"
    write_old(path)
    old_mode = os.stat(path).st_mode
    new = {"model": {"a.weight": torch.randn(5, 3), "a.bias": torch.zeros(5, dtype=torch.bfloat16)},
           "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}}
    atomic_save(new, path)
    got = torch.load(path, weights_only=True)
    assert got.keys() == new.keys()
    for k, v in new["model"].items():
        assert torch.equal(got["model"][k], v) and got["model"][k].dtype == v.dtype
    assert got["optim"]["param_groups"] == new["optim"]["param_groups"]
    assert torch.equal(got["optim"]["state"][0]["step"], new["optim"]["state"][0]["step"])
    assert os.stat(path).st_mode == old_mode  # permissions of the file it replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    # a new file gets open()'s permissions (0o666 minus the umask), not mkstemp's 0o600
    fresh = tmp_path / "fresh.pt"
    atomic_save(new, str(fresh), _use_new_zipfile_serialization=True)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(fresh).st_mode & 0o777 == 0o666 & ~umask
    assert torch.equal(torch.load(fresh, weights_only=True)["model"]["a.weight"], new["model"]["a.weight"])


def test_destination_given_twice(tmp_path):
    with pytest.raises(TypeError, match="destination twice"):
        atomic_save({}, tmp_path / "x.pt", f=str(tmp_path / "y.pt"))
