"""Dead peers in cfsdp._C's shared-memory collectives (csrc/shm.c, "Liveness").

A rank whose process dies while another waits for it must fail the waiter within about a
second naming the dead rank, its global rank and the host, whatever the timeout (here 60 s):
killed by SIGKILL (and left a zombie: nobody reaps it), crashed by SIGSEGV, or gone by
``os._exit`` without closing its view; also when a child it forked outlives it (what a
DataLoader worker does; a file lock would live on in the child).  A rank that is stopped
(SIGSTOP) for longer than the probe interval, then continued, is not a failure: the
collective completes.  A view closed while a peer waits for it is named as closed.  And
``ShmGroup.failure``, the two-level lane's window on the segment, returns the first failure.

The ranks here are real processes (the liveness signal is the kernel's, at process death):
rank 0 is a view in this process, the peers are child processes running ``PEER`` below.
"""

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import cfsdp._C as C

TIMEOUT_S = 60.0  # the group's timeout: every detection below must come long before it
DETECT_S = 5.0  # the bound asserted (designed for ~0.1-0.2 s; the 2-core machine is loaded)
N = 64 * 1024  # elements of the all-reduce: many pieces of the 4 KiB slots
GLOBAL = [10, 11, 12]  # global ranks of the group's ranks, as the messages must name them

# A peer (the C core loaded alone, so that it starts in a blink): attach as rank RANK, say
# so, then act (ACT): "wait" sleeps (to be killed or
# stopped by the test), "reduce" runs the all-reduce and prints its first and last
# elements (or its error, and exits 3), "segv"
# crashes, "exit" leaves by os._exit without closing, "fork" forks a child that sleeps
# (and prints its pid) and then sleeps itself (to be killed).
PEER = r"""
import ctypes, importlib.util, os, sys, time
so, name, act = sys.argv[1], sys.argv[2], sys.argv[5]
world, rank = int(sys.argv[3]), int(sys.argv[4])
spec = importlib.util.spec_from_file_location("_C", so)  # the C core alone: no torch import
C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(C)
g = C.ShmGroup(name, False, world, rank, 4096 * world, 60.0, "unit", [10, 11, 12][:world])
g.wait_attached()
print("attached", flush=True)
if act == "reduce":
    n = int(sys.argv[6])
    t = (ctypes.c_float * n)(*([1.0] * n))
    p = ctypes.addressof(t)
    try:
        g.all_reduce(p, p, n, 0, 1.0, 1, None).wait()
        print("reduced", t[0], t[n - 1], flush=True)
    except RuntimeError as e:
        print("error", str(e).replace("\n", " "), flush=True)
        os._exit(3)
elif act == "segv":
    time.sleep(0.3)
    ctypes.string_at(0)
elif act == "exit":
    time.sleep(0.3)
    os._exit(0)
elif act == "fork":
    pid = os.fork()
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    print("child", pid, flush=True)
time.sleep(120)
"""


def _name() -> str:
    return f"/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}"


class Peer:
    """A child process that attaches as `rank` and does `act` (see PEER)."""

    def __init__(self, name: str, world: int, rank: int, act: str, *extra: str):
        self.proc = subprocess.Popen([sys.executable, "-c", PEER, C.__file__, name, str(world),
                                      str(rank), act, *extra], stdout=subprocess.PIPE,
                                     text=True)

    def line(self) -> str:
        return self.proc.stdout.readline().strip()

    def state(self) -> str:
        """The process state letter of /proc/<pid>/stat (Z: a zombie)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            stat = f.read()
        return stat[stat.rfind(")") + 2]

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture
def peers():
    made = []

    def make(*args):
        p = Peer(*args)
        made.append(p)
        return p

    yield make
    for p in made:
        p.end()


def _all_reduce(g, t):
    return g.all_reduce(t.data_ptr(), t.data_ptr(), t.numel(), 0, 1.0, 1, (t,))


def _open(world: int):
    """This process's view as rank 0 of a fresh segment of `world` ranks."""
    name = _name()
    return name, C.ShmGroup(name, True, world, 0, 4096 * world, TIMEOUT_S, "unit",
                            GLOBAL[:world])


def _fails_within(work, since: float) -> str:
    """`work` fails within DETECT_S of `since`: its message."""
    with pytest.raises(RuntimeError) as info:
        work.wait()
    elapsed = time.monotonic() - since
    assert elapsed < DETECT_S, f"the failure took {elapsed:.2f} s: {info.value}"
    return str(info.value)


def _names_dead(msg: str, rank: int) -> None:
    host = socket.gethostname()
    assert (f"rank {rank} (global rank {GLOBAL[rank]}) on host '{host}' died" in msg), msg


@pytest.mark.parametrize("how", ["sigkill", "zombie", "segv", "exit"])
def test_dead_peer_is_named_at_once(peers, how):
    """The peer dies while rank 0 waits in an all-reduce (SIGKILL, a segfault, os._exit
    without closing), or was killed before it and is a zombie nobody reaped: rank 0 fails
    within a second or so (not at the 60 s timeout), naming the peer and the host."""
    name, g = _open(2)
    try:
        peer = peers(name, 2, 1, {"sigkill": "wait", "zombie": "wait"}.get(how, how))
        g.wait_attached()
        assert peer.line() == "attached"
        if how == "zombie":
            peer.proc.send_signal(signal.SIGKILL)
            deadline = time.monotonic() + 10
            while peer.state() != "Z" and time.monotonic() < deadline:
                time.sleep(0.01)
            assert peer.state() == "Z"
        t = torch.ones(N)
        since = time.monotonic()
        work = _all_reduce(g, t)
        if how == "sigkill":
            time.sleep(0.3)
            peer.proc.send_signal(signal.SIGKILL)
            since = time.monotonic()
        elif how in ("segv", "exit"):  # the peer dies by itself 0.3 s after attaching
            since -= 0.3
        msg = _fails_within(work, since)
        _names_dead(msg, 1)
        assert "all_reduce #1" in msg and "cfsdp shm group 'unit' (rank 0 of 2" in msg, msg
        if how == "zombie":
            assert peer.state() == "Z", "the peer was reaped: the zombie case is not tested"
    finally:
        g.close()


def test_three_ranks_every_survivor_fails(peers):
    """3 ranks: rank 2 is killed while ranks 0 (here) and 1 (a peer process) wait in the
    all-reduce: both fail at once, rank 1 through the segment's failure flag or its own
    probe, both naming rank 2."""
    name, g = _open(3)
    try:
        survivor = peers(name, 3, 1, "reduce", str(N))
        victim = peers(name, 3, 2, "wait")
        g.wait_attached()
        assert survivor.line() == "attached" and victim.line() == "attached"
        work = _all_reduce(g, torch.ones(N))
        time.sleep(0.3)
        victim.proc.send_signal(signal.SIGKILL)
        since = time.monotonic()
        _names_dead(_fails_within(work, since), 2)
        out, _ = survivor.proc.communicate(timeout=DETECT_S + 10)
        assert out.startswith("error ") and survivor.proc.returncode == 3, out
        _names_dead(out, 2)
    finally:
        g.close()


def test_forked_child_does_not_keep_a_dead_rank_alive(peers):
    """The peer forks a child that outlives it (as DataLoader workers do): the peer's death
    is still seen at once (the liveness lock belongs to the peer's thread, not to a file
    descriptor the child inherited)."""
    name, g = _open(2)
    child = None
    try:
        peer = peers(name, 2, 1, "fork")
        g.wait_attached()
        assert peer.line() == "attached"
        child = int(peer.line().split()[1])
        work = _all_reduce(g, torch.ones(N))
        time.sleep(0.3)
        peer.proc.send_signal(signal.SIGKILL)
        since = time.monotonic()
        _names_dead(_fails_within(work, since), 1)
        os.kill(child, 0)  # the child is alive: it did not keep the rank "alive"
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        g.close()


def test_stopped_peer_is_not_dead(peers):
    """A peer stopped (SIGSTOP) for 1.5 s, fifteen probe intervals, then continued: no
    failure, the all-reduce completes with every rank's contribution.  Then the same peer,
    killed while rank 0 waits in the next all-reduce, is named at once."""
    name, g = _open(2)
    try:
        peer = peers(name, 2, 1, "reduce", str(N))
        g.wait_attached()
        assert peer.line() == "attached"
        peer.proc.send_signal(signal.SIGSTOP)
        t = torch.ones(N)
        work = _all_reduce(g, t)
        time.sleep(1.5)
        assert not work.is_completed()
        peer.proc.send_signal(signal.SIGCONT)
        work.wait()
        assert torch.equal(t, torch.full((N,), 2.0))
        assert peer.line() == "reduced 2.0 2.0"
        work = _all_reduce(g, t)
        time.sleep(0.3)
        peer.proc.send_signal(signal.SIGKILL)
        _names_dead(_fails_within(work, time.monotonic()), 1)
    finally:
        g.close()


def test_closed_peer_is_named():
    """A view closed (cleanly) while rank 0 waits for it in a collective it never ran:
    rank 0 fails at once saying so, instead of at the timeout."""
    name, g0 = _open(2)
    g1 = C.ShmGroup(name, False, 2, 1, 8192, TIMEOUT_S, "unit", GLOBAL[:2])
    try:
        g0.wait_attached()
        g1.wait_attached()
        work = _all_reduce(g0, torch.ones(N))
        time.sleep(0.2)
        g1.close()
        msg = _fails_within(work, time.monotonic())
        assert (f"rank 1 (global rank 11) on host '{socket.gethostname()}' closed the group"
                in msg), msg
    finally:
        g0.close()
        g1.close()


def test_failure_reports_the_first_failure():
    """ShmGroup.failure: None while no rank failed (after waiting its timeout), the failing
    rank's message once one did, and None at once when the view is closed meanwhile."""
    name, g0 = _open(2)
    g1 = C.ShmGroup(name, False, 2, 1, 8192, TIMEOUT_S, "unit", GLOBAL[:2])
    try:
        g0.wait_attached()
        g1.wait_attached()
        t0 = time.monotonic()
        assert g0.failure(0.2) is None
        assert time.monotonic() - t0 >= 0.19
        got = []
        waiter = threading.Thread(target=lambda: got.append(g0.failure(30.0)))
        waiter.start()
        time.sleep(0.1)
        g1.fail("boom in another part")
        waiter.join(DETECT_S)
        assert not waiter.is_alive()
        assert got == ["rank 1 (global rank 11) of cfsdp shm group 'unit' failed: "
                       "boom in another part"], got
        got.clear()
        _, g2 = _open(2)  # a view with no failure: close() ends its wait
        try:
            closing = threading.Thread(target=lambda: got.append(g2.failure(30.0)))
            closing.start()
            time.sleep(0.1)
            t0 = time.monotonic()
            g2.close()
            closing.join(DETECT_S)
            assert not closing.is_alive() and got == [None]
            assert time.monotonic() - t0 < DETECT_S
            assert g2.failure(0.0) is None
        finally:
            g2.close()
    finally:
        g0.close()
        g1.close()
