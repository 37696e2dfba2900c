"""comm._unlink_on_sigterm: a SIGTERM inside a shared-memory set-up window first unlinks the
segment name the creator planned, then does what it would have done (the distributed side:
test_shm.py's test_kill_in_setup_window_leaves_nothing, survivors ``sigterm``)."""

import os
import secrets
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.no_core

# Run in a child: it sends itself SIGTERM.  A fake set-up (just what _unlink_planned reads:
# a store holding plan/<seg>, a label) and a real /dev/shm file of cfsdp's name form.
CHILD = textwrap.dedent("""
    import os, signal, sys
    from cfsdp._runtime import comm

    name, mode = sys.argv[1], sys.argv[2]

    class Store:
        def check(self, keys): return True
        def get(self, key):
            assert key == "plan/all", key
            return name.encode()

    class Setup:
        store, label = Store(), "test"

    fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    seen = []
    if mode == "python":
        signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    elif mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    before = signal.getsignal(signal.SIGTERM)
    with comm._unlink_on_sigterm(Setup(), "all"):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the handler runs between bytecodes: give it some
            pass
    print("left:", os.path.exists("/dev/shm" + name), "seen:", seen,
          "restored:", signal.getsignal(signal.SIGTERM) is before, flush=True)
    if os.path.exists("/dev/shm" + name):
        os.unlink("/dev/shm" + name)
""")


def run(mode):
    """The child's result, and whether the file is still there when it has ended."""
    name = f"/cfsdp-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        res = subprocess.run([sys.executable, "-c", CHILD, name, mode], capture_output=True,
                             text=True, timeout=120)
        return res, os.path.exists("/dev/shm" + name)
    finally:
        if os.path.exists("/dev/shm" + name):
            os.unlink("/dev/shm" + name)


def test_default_action_unlinks_then_ends_by_sigterm():
    res, left = run("default")
    assert res.returncode == -signal.SIGTERM, (res.returncode, res.stdout, res.stderr)
    assert "left:" not in res.stdout  # ended by the signal, inside the window
    assert not left, "the planned name is still in /dev/shm"


def test_python_handler_unlinks_then_calls_it_and_is_restored():
    res, _ = run("python")
    assert res.returncode == 0, res.stderr
    assert "left: False seen: [15] restored: True" in res.stdout, res.stdout


def test_ignored_sigterm_stays_ignored():
    res, _ = run("ignore")
    assert res.returncode == 0, res.stderr
    assert "left: True seen: [] restored: True" in res.stdout, res.stdout
