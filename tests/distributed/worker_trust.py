"""Another user of the machine attacks the job's shared memory (run by test_trust.py).

The attacker is a real second local user (``CFSDP_TEST_ATTACKER_UID``/``_GID``, made by the
test with ``useradd``): rank 0 forks it at start-up, before the process group exists, and
the child drops to that uid at once (``setgroups``, ``setgid``, ``setuid``), keeping only
the torch already loaded (it needs no file of the job). It then does what the user of
issue 22 did, on command of rank 0 through a pipe:

* ``segment``: it connects to the job's rendezvous store (torch's ``TCPStore`` has no
  authentication: ``MASTER_ADDR:MASTER_PORT``), watches the store's keys (``list_keys``)
  for the segment name a creating rank publishes (``.../cfsdp_shm/<group>/<n>/name/<seg>``),
  makes a file of its own in ``/dev/shm`` (mode 0666, the size and header of a real
  segment, its attach count set so that a victim would go ahead at once) and overwrites
  the key with its name: as a plain name (``file``), through a symbolic link of its own
  (``symlink``), or as a path out of ``/dev/shm`` (``name``); it removes its files when
  rank 0 exits;
* ``zero``: ZeRO's shared bucket in a directory that is world-writable without the sticky
  bit (a ``/dev/shm`` set up wrong): it waits for the bucket's file that group rank 0
  makes and replaces it with a file of its own (``file``) or a symbolic link to one
  (``symlink``).

The race is made deterministic, and nothing else: the victims run the real code but
pause just before they read the name (``comm._segment_name``) or open the file
(``_zero_buckets._attach``) until the attacker says it is done (a key of the store).
Each subtest then checks, on every rank: the collective (or the optimizer) raised
``PermissionError`` naming the refusing ranks, the attacker's file (its path, uid and user
name, mode); and on rank 0: the attacker's file holds exactly the bytes the attacker wrote
(nothing of the job: no attach count, no shard).  ``forged_two_level`` (4 ranks) emulates
two hosts of two ranks (``comm._host_id``) and attacks the second host's segment.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import select
import shutil
import struct
import time
import traceback
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

import _harness as h
import cfsdp
import cfsdp._C as C
from cfsdp._runtime import comm
from cfsdp.optim import _zero_buckets

A_UID = int(os.environ.get("CFSDP_TEST_ATTACKER_UID", "-1"))
A_GID = int(os.environ.get("CFSDP_TEST_ATTACKER_GID", "-1"))
A_NAME = os.environ.get("CFSDP_TEST_ATTACKER_NAME", "?")
KEYS = "cfsdp_test_trust"  # raw store keys of this test (the attacker's signal)
WAIT_S = 60  # the longest any step here waits for another
GROUP_TIMEOUT = timedelta(seconds=15)  # without the checks a victim waits this out
MAGIC = 0x31736D7064736663  # csrc/shm.c's CF_SHM_MAGIC ("cfsdpms1")


# --------------------------------------------------------------------------------------
# the attacker (a forked child running as the second user)
# --------------------------------------------------------------------------------------


_MADE: list = []  # the attacker's files in /dev/shm, removed when it exits


def _connect():
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(seconds=WAIT_S))


def _own_file(path: str, size: int, header: Optional[bytes] = None) -> str:
    """A file of the attacker's, mode 0666, of ``size`` bytes: ``header`` then zeros (a
    fresh segment, as cfsdp makes one), or random bytes; the sha256 of its content."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
    _MADE.append(path)
    try:
        os.fchmod(fd, 0o666)  # whatever the umask
        content = (secrets.token_bytes(size) if header is None
                   else header + bytes(size - len(header)))
        os.pwrite(fd, content, 0)
    finally:
        os.close(fd)
    return hashlib.sha256(content).hexdigest()


def _forge_segment(store, cmd: dict) -> Iterator[dict]:
    """The ``segment`` attack (see the module doc)."""
    seen = set(store.list_keys())
    yield {"ready": True, "euid": os.geteuid()}
    want = re.compile(r".*cfsdp_shm/.+/name/" + re.escape(cmd["seg"]))
    deadline = time.monotonic() + WAIT_S
    while True:
        new = [k for k in store.list_keys() if k not in seen and want.fullmatch(k)]
        if new:
            key = new[0]
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"no new segment name {cmd['seg']!r} in the store")
        time.sleep(0.005)
    world, slot = cmd["world"], cmd["slot"]
    size = C.shm_segment_bytes(world, slot)
    # the header of csrc/shm.c: magic, world size, slot bytes, total bytes; then (its own
    # cache line) the attach count: world - 1, so a victim's attach completes it at once
    header = struct.pack("<QQQQ", MAGIC, world, slot, size) + bytes(32) + \
        struct.pack("<II", world - 1, 0)
    base = f"cfsdp-{os.getpid()}-{secrets.token_hex(8)}"
    path = "/dev/shm/" + base
    if cmd["how"] == "symlink":
        target = f"/dev/shm/cfsdp-attacker-{os.getpid()}-{secrets.token_hex(4)}"
        sha = _own_file(target, size, header)
        os.symlink(target, path)
        _MADE.append(path)
        name, kept = "/" + base, target
    else:
        sha = _own_file(path, size, header)
        name, kept = ("/" + base if cmd["how"] == "file" else "/../.." + path), path
    store.set(key, name)
    yield {"key": key, "name": name, "path": kept, "link": path if kept != path else "",
           "sha256": sha}


def _forge_zero(store, cmd: dict) -> Iterator[dict]:
    """The ``zero`` attack (see the module doc)."""
    d = cmd["dir"]
    yield {"ready": True, "euid": os.geteuid()}
    deadline = time.monotonic() + WAIT_S
    while True:
        found = [e for e in os.listdir(d) if re.fullmatch(r"cfsdp-.*-zero", e)]
        if found:
            target = os.path.join(d, found[0])
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"no bucket file in {d}")
        time.sleep(0.005)
    size = os.stat(target).st_size  # the directory is searchable: its size is visible
    mine = os.path.join(d, f"attacker-{secrets.token_hex(4)}")
    sha = _own_file(mine, size)
    tmp = os.path.join(d, f"attacker-tmp-{secrets.token_hex(4)}")
    if cmd["how"] == "symlink":
        os.symlink(mine, tmp)
    else:
        os.link(mine, tmp)  # `mine` stays (to check), `tmp` takes the bucket's name
    os.rename(tmp, target)  # no sticky bit: another user's file may be replaced
    yield {"path": mine, "target": target, "sha256": sha}


def _attacker_main(rfd: int, wfd: int) -> None:
    os.setgroups([])
    os.setgid(A_GID)
    os.setuid(A_UID)
    out = os.fdopen(wfd, "w", buffering=1)
    store = None
    for line in os.fdopen(rfd):
        cmd = json.loads(line)
        try:
            if store is None:
                store = _connect()
            steps = {"segment": _forge_segment, "zero": _forge_zero}[cmd["op"]](store, cmd)
            for reply in steps:
                out.write(json.dumps(reply) + "\n")
        except Exception:  # noqa: BLE001 - reported to rank 0
            out.write(json.dumps({"error": traceback.format_exc()}) + "\n")
        finally:
            if store is not None:  # the victims go on in any case (and fail if it failed)
                store.set(f"{KEYS}/attacked/{cmd['tag']}", "1")
    for path in _MADE:  # rank 0 exited (its checks are done): leave nothing behind
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class Attacker:
    """Rank 0's handle on the attacker child."""

    def __init__(self):
        if A_UID <= 0:
            raise SystemExit("worker_trust.py needs CFSDP_TEST_ATTACKER_UID (another user than "
                             "root; test_trust.py makes one)")
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the attacker: never returns
            os.close(w1)
            os.close(r2)
            try:
                _attacker_main(r1, w2)
            finally:
                os._exit(0)
        os.close(r1)
        os.close(w2)
        self._to = os.fdopen(w1, "w", buffering=1)
        self._from, self._buf = r2, b""  # read with os.read: select sees every byte

    def ask(self, **cmd) -> dict:
        """Send a command; its first reply (the attacker is watching when it returns)."""
        self._to.write(json.dumps(cmd) + "\n")
        reply = self.reply()
        assert reply.get("euid") == A_UID and A_UID != os.geteuid(), reply
        return reply

    def reply(self) -> dict:
        deadline = time.monotonic() + WAIT_S
        while b"\n" not in self._buf:
            left = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._from], [], [], left)
            if not ready:
                raise AssertionError(f"the attacker said nothing in {WAIT_S} s")
            chunk = os.read(self._from, 65536)
            if not chunk:
                raise AssertionError("the attacker exited")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise AssertionError("the attacker failed:\n" + reply["error"])
        return reply


ATTACKER = Attacker() if __name__ == "__main__" and os.environ.get("RANK") == "0" else None


# --------------------------------------------------------------------------------------
# the victims
# --------------------------------------------------------------------------------------


def raw_store():
    s = dist.distributed_c10d._get_default_store()
    while isinstance(s, dist.PrefixStore):
        s = s.underlying_store
    return s


class PauseBefore:
    """Replace ``module.attr`` by a wrapper that waits until the attacker is done (its key
    ``attacked/<tag>``), then calls the real function: the real code, in the order that
    makes the race deterministic."""

    def __init__(self, module, attr: str, tag: str):
        self.module, self.attr, self.tag = module, attr, tag
        self.real = getattr(module, attr)

    def __enter__(self):
        def paused(*args, **kwargs):
            raw_store().wait([f"{KEYS}/attacked/{self.tag}"], timedelta(seconds=WAIT_S))
            return self.real(*args, **kwargs)

        setattr(self.module, self.attr, paused)

    def __exit__(self, *exc):
        setattr(self.module, self.attr, self.real)


def check_untouched(reply: dict, job_bytes: list) -> None:
    """Rank 0: the attacker's file holds what the attacker wrote (nothing of the job)."""
    with open(reply["path"], "rb") as f:
        content = f.read()
    for r, b in enumerate(job_bytes):
        assert b not in content, \
            f"rank {r}'s values are in the attacker's file {reply['path']}"
    assert hashlib.sha256(content).hexdigest() == reply["sha256"], \
        f"the job wrote into the attacker's file {reply['path']}"


def outcome(run) -> Optional[Exception]:
    """What ``run()`` raised (None: nothing)."""
    try:
        run()
    except Exception as e:  # noqa: BLE001 - checked by expect_refusal
        return e
    return None


def expect_refusal(e: Optional[Exception], refusing: list, what: str) -> str:
    """``e`` must be a PermissionError naming the refusing ranks and ``what``."""
    if not isinstance(e, PermissionError):
        raise AssertionError("the job went on with a file or name of another user") from e
    msg = str(e)
    assert f"group rank(s) {refusing} refused to map" in msg, msg
    assert what in msg, (what, msg)
    assert msg.count("rendezvous store") == len(refusing), msg  # each says what to do
    return msg


def owner_mode(kind: str, mode: str) -> str:
    return f"a {kind} of uid {A_UID} ({A_NAME}) with mode {mode}"


def shard_values(rank: int) -> torch.Tensor:
    """A parameter shard whose bytes no attacker file holds by chance."""
    return torch.arange(4096, dtype=torch.float32) * 1.2345 + rank


def forged(ctx, how: str, seg: str, seg_world: int, refusing: list) -> None:
    """The segment attack on a new group: ``seg`` (of ``seg_world`` ranks) its target."""
    pg = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
    tag = ctx.name
    reply = None
    if ATTACKER is not None:
        ATTACKER.ask(op="segment", how=how, seg=seg, world=seg_world, slot=comm._slot_bytes(),
                     tag=tag)
    shard = shard_values(ctx.rank)
    out = torch.empty(ctx.world_size * shard.numel())
    path_re = r"/dev/shm/cfsdp-\d+-[0-9a-f]{16}"
    what = {"file": owner_mode("regular file", "0666"),
            "symlink": owner_mode("symbolic link", "0777"),
            "name": "refused the segment name '/../../dev/shm/cfsdp-"}[how]
    with PauseBefore(comm, "_segment_name", tag):
        got = outcome(lambda: comm.all_gather(out, shard, pg, async_op=False))
    if ATTACKER is not None:
        reply = ATTACKER.reply()
        try:
            check_untouched(reply, [shard_values(r).numpy().tobytes()[:64]
                                    for r in range(ctx.world_size)])
        finally:  # (the attacker removes them too when rank 0 exits)
            for p in filter(None, (reply["path"], reply["link"])):
                os.unlink(p)
    msg = expect_refusal(got, refusing, what)
    if ctx.rank == 0:
        ctx.log("every rank raised, e.g.:", msg)
    if how != "name":
        assert re.search("refused to map " + path_re + ": ", msg), msg
        if reply is not None:
            assert f"refused to map {reply['link'] or reply['path']}: " in msg, (reply, msg)
    dist.destroy_process_group(pg)


@h.subtest(grid={"how": ["file", "symlink", "name"]})
def forged_segment(ctx, how):
    """One segment over every rank: the attacker replaces its name; every non-creating
    rank refuses it, and every rank raises."""
    forged(ctx, how, "all", ctx.world_size, list(range(1, ctx.world_size)))


@h.subtest
def forged_two_level(ctx):
    """Two emulated hosts of two ranks (4 ranks): the attacker replaces the second host's
    segment name; its non-creating rank (3) refuses it, and every rank of the group raises."""
    assert ctx.world_size == 4, "forged_two_level runs at 4 ranks"
    real = comm._host_id  # (the set-up, at the first collective, reads it)
    comm._host_id = lambda: f"{real()}|trust-host-{ctx.rank // 2}"
    try:
        forged(ctx, "file", "host1", 2, [3])
    finally:
        comm._host_id = real


@h.subtest(grid={"how": ["file", "symlink"]})
def forged_zero_bucket(ctx, how):
    """ZeRO's shared bucket in a world-writable directory without the sticky bit: the
    attacker replaces the bucket's file after group rank 0 made it; every rank refuses
    it (a file of another user, or a symbolic link), and every rank raises."""
    pg = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
    assert comm.one_segment(pg), comm.describe(pg)
    d = f"/dev/shm/cfsdp-test-trust-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{how}"
    if ctx.rank == 0:
        os.mkdir(d)
        os.chmod(d, 0o777)  # world-writable, no sticky bit
    dist.barrier(ctx.pg)
    reply = None
    old_dir, _zero_buckets.SHM_DIR = _zero_buckets.SHM_DIR, d
    try:
        if ATTACKER is not None:
            ATTACKER.ask(op="zero", how=how, dir=d, tag=ctx.name)
        torch.manual_seed(0)
        model = nn.Linear(64, 64)
        what = owner_mode("regular file", "0666") if how == "file" else \
            owner_mode("symbolic link", "0777")
        with PauseBefore(_zero_buckets, "_attach", ctx.name):
            got = outcome(lambda: cfsdp.ZeroRedundancyOptimizer(
                model.parameters(), torch.optim.SGD, process_group=pg,
                parameters_as_bucket_view=True, lr=0.1))
        if ATTACKER is not None:
            reply = ATTACKER.reply()
            check_untouched(reply, [model.weight.detach().numpy().tobytes()[:64]])
        msg = expect_refusal(got, list(range(ctx.world_size)), what)
        assert "the shared parameter bucket's file" in msg, msg
        if ctx.rank == 0:
            ctx.log("every rank raised, e.g.:", msg)
        if reply is not None:
            assert f"refused to map {reply['target']}: " in msg, (reply, msg)
    finally:
        _zero_buckets.SHM_DIR = old_dir
        dist.barrier(ctx.pg)
        if ctx.rank == 0:
            shutil.rmtree(d)
    dist.destroy_process_group(pg)


if __name__ == "__main__":
    h.main()  # (the attacker exits when rank 0 does: its pipe closes)
