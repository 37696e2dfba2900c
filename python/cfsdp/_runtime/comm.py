"""The collective engine: plain functions over a process group.

Every rank issues a unit's collectives in the same order; each function
returns a :class:`Pending` to wait on.  Gloo and NCCL both execute the
collectives of one process group in issue order, so an asynchronous
all-gather issued for prefetching is complete before a later collective's
result is used.  On a gloo group (CPU tensors) cfsdp keeps at most one of its
collectives in flight (see "One in flight on gloo").

Transports
----------
Three transports serve these functions, picked automatically per group (once, at its
set-up) and per call:

* **shared memory** (``csrc/shm.c`` on the ordered work queue of
  ``csrc/queue.c``), for a group whose ranks are all on one host: one POSIX shm
  segment per group and one C worker thread per group (the CPU analogue of a CUDA
  stream).  Ops run in issue order on the worker, without the GIL, so they overlap
  compute; ``Pending.wait()`` sleeps (GIL released) until the op is done and raises
  ``RuntimeError`` with the op's message if it failed.  A wait inside a collective is
  bounded by the group's timeout (``group``'s gloo timeout, else torch's default); a
  peer that stalls is an error on every rank at that timeout, a peer that dies one at
  once (see Dead peers), both naming the group, the op and the rank, and after an error
  the group is poisoned (every later op on it fails with the first error).
* **two levels** (``two_level.py``), for a group spread over several hosts with several
  ranks on each: shared memory inside each host (a segment per host) and the process
  group between hosts, in one collective, so the bytes between hosts are 1/(ranks per
  host) of a flat collective's per rank.  Ops run in issue order on a Python thread per
  group (its *lane*), waiting with the GIL released; errors, the timeout and poisoning
  as for shared memory, and a peer or a host that goes away is named (global rank and
  host name) on every rank at once (see Dead peers).  See two_level.py for the
  algorithms and the order of the sums.
* **the process group** (gloo), exactly as before, for everything else.

Each group's transport is an object chosen once, at its set-up (:class:`Transport`, the
process group, and its subclasses ``_Solo``, ``_SharedMemory``, ``_TwoLevel``); every
function below calls its group's transport (:func:`transport`), which takes the process
group itself for a call it does not carry (the Rule).  The C core's segment is behind
``_core.ShmView``: no address crosses here.

Rule.  A call goes through shared memory (one level or two) when all of these hold,
else through the process group:

1. the C core is in use (``CFSDP_IMPL=c``) and ``CFSDP_SHM`` is not ``"0"`` on every
   rank of the group (the ranks tell each other at set-up: one rank with it off turns it
   off for the group, logged as a warning; torchrun passes one environment).
   ``CFSDP_SHM=host`` keeps shared memory for groups on one host but takes the process
   group for groups across hosts (no two levels).
2. the group's ranks share memory: the ranks exchange a *host key* (host name, boot id
   ``/proc/sys/kernel/random/boot_id`` and the device number of ``/dev/shm``, so two
   containers with one host name but separate ``/dev/shm`` mounts are two hosts) and
   the group has at least 2 ranks, either all with one key (one level: one segment), or
   H >= 2 keys with the same k >= 2 ranks each, laid out host-major (group rank
   ``h * k + l``: torchrun's order; two levels: a segment per host); any other layout
   takes the process group;
3. the set-up proved it (below): every rank of the group attached its segment;
4. every tensor of the call is a contiguous CPU tensor that may cross into C
   (``_core.c_tensor_ok``: no ``DTensor`` or other subclass) of one dtype among
   float32, float64, bfloat16, float16;
5. the reduction (``op``) is SUM or AVG (anything else: the process group);
6. no ``TorchDispatchMode`` is active (see Visibility).

Accelerator tensors.  A call on tensors that are not on the CPU (CUDA, any accelerator)
takes the process group (NCCL) through a transport of its own per group
(``_accelerator_transport``), which sets nothing up: no store traffic, no segment, no worker
thread.  So a group whose collectives only ever carry accelerator tensors (every group of a
GPU job) never makes a segment; a group that carries both (``cpu:gloo,cuda:nccl``) is set
up at its first CPU-tensor collective, which is the same point on every rank (ranks issue
a group's collectives in one order).  A device layer whose tensors must take that path
(``device.layer_for(t.device).host_paths`` False: a test's recording layer, [Note: device
layer]) sends CPU tensors here too, the one seam for it.

Set-up (the decision that cannot be fooled).  On the group's first collective on CPU tensors (or
``uses_shm``/``describe``), every rank of the group, through the default store under the
prefix ``cfsdp_shm/<group_name>/<n>/`` (``n`` counts this process's set-ups of the group,
so a set-up after ``release`` never reads an older one's keys):

a. publishes its host key, host name and ``CFSDP_SHM`` wish and reads everyone's: rules
   1 and 2 decide, the same way on every rank; if they say process group, done;
b. the first rank of each segment (group rank 0, or each host's local rank 0) publishes
   the name it is about to use (key ``plan/<segment>``), creates it
   (``/cfsdp-<pid>-<16 random hex digits>``, ``O_EXCL``, ``O_NOFOLLOW``, mode 0600, its
   pages reserved) and publishes its name, or the error; the others read the name, take
   it only in that form, and attach to it, checking the file before mapping it (see
   Trust); the last to attach unlinks the name at once;
c. every rank publishes whether it has its view ("ok", "refused" with the reason, or the
   error: no ``/dev/shm``, not enough room, permission denied, a segment of another
   ``/dev/shm``, ...) and reads everyone's.  All "ok": the group uses shared memory (the
   attach counts in each segment are then complete, so ``wait_attached`` returns at once
   and the creator unlinks the name: nothing stays in ``/dev/shm``, even if the job is
   killed later).  Any "refused": every rank closes its view (the name is unlinked) and
   raises ``PermissionError`` naming the refusing ranks and their reasons (Trust).  Any
   other error: every rank closes its view and the group takes the process group, on
   every rank at once, and group rank 0 logs one warning naming the ranks and their
   errors.

Trust.  Every rank of the job and whoever can reach its rendezvous store are trusted
(torch's store has no authentication); other users of the machine are not, and nothing of
the job may land in memory they can map.  Segment names are unguessable and created
``O_EXCL``/0600, so another user cannot open a segment; but a name travels through the
store, where another user who reaches it can replace it with a file of their own.  So a
name read from the store must be of the creator's form (``_SEGMENT_NAME``: no path, no
``..``), and every rank opens it with ``O_NOFOLLOW`` and, before mapping it, checks that
``fstat`` shows a regular file owned by its own effective uid with no group or other
permission bits (``csrc/shm.c``, ``cf_shm_check_fd``; two-level segments are opened the
same way).  Anything else is refused, and a refusal is an error on every rank of the
group, never a fallback to the process group: a forged name means someone is attacking
the job (or two jobs share a store), and carrying on with a warning would hide it while
the attacker keeps the store.  The message names the file's path, owner (uid and user
name) and mode, and what to do.  ZeRO's shared bucket applies the same check to its file
(``optim/_zero_buckets.py``).

The set-ups of different groups are independent, also in threads of one process (a side
thread's group set up while the main thread sets up another): the waits poll the store and
never hold its connection (``_Setup``).  Nothing in a set-up waits for a timeout but a
rank that died or stalled before or during its first collective on the group: after the
group's timeout a ``RuntimeError`` names each absent rank (group and global rank) and the
step it did not do ("did not publish its host key", "did not publish the name of segment
'all', which it creates", "did not say whether it attached segment 'all'
(/cfsdp-...)").  A set-up that raises so (a rank killed between b and c: the *set-up
window*, while the segment has a name) first closes this rank's view and unlinks the
planned name, whoever created it, so the survivors leave nothing in ``/dev/shm`` even when
the creator is the rank that died; and a survivor that torchrun SIGTERMs in that window (it
does so to every rank the moment one dies) unlinks it before it ends, when the set-up runs
in the main thread over SIGTERM's default action or a Python handler (``_unlink_on_sigterm``;
a SIGKILL leaves nothing to run: the last rank to attach unlinks the name at once, so the
window is as short as the attaching).

Group rank 0 logs the transport a group takes at INFO
(``logging.getLogger("cfsdp")``); :func:`describe` returns it in words, and
:func:`one_segment` whether it is one segment over every rank (what may share more host
memory than the segment asks it: ZeRO's shared parameter bucket).
``CFSDP_SHM_SLOT_BYTES`` (default 1 MiB, a multiple of 64) sets the bytes per rank and
half buffer; larger tensors are processed in pieces of that size, double-buffered.

Dead peers.  A rank whose process dies (SIGKILL, the OOM killer, a segfault) while
others wait for it in a shared-memory collective is an error on every other rank within a
fraction of a second (0.1 s and scheduling), whatever the group's timeout, naming its group
rank, global rank and host;
a peer that is stopped (SIGSTOP) or slow gets the whole timeout, as before.  The signal
is a robust mutex per rank in the segment, held by a thread of that rank's view for the
view's life; a wait that has lasted 0.1 s on a peer probes it every 0.1 s (one
compare-and-swap): the kernel frees the mutex of a thread that ends without unlocking it,
before the process becomes a zombie, whatever its pid namespace, and a forked child does
not inherit it (csrc/shm.c, Liveness, says why not file locks or pidfds).  A rank that
closes its view (``release``, exit) while a peer waits for it is an error too, since it
will never arrive; one that exits with nothing more to contribute fails nobody (only a
rank being waited for is probed).  The first rank that sees the death fails in the
segment, so the others fail at once with its message.  Two levels: a dead peer on the
same host is seen by the segment's waits, on another host by gloo (its connections
break: an error at once), and every rank of every host learns it through one or the
other, even a rank blocked in a gloo exchange with a peer that failed without dying
(two_level.py).  ZeRO's shared-bucket barriers are all-reduces on the group's segment:
the same.  The set-up itself still waits for a rank that never arrives until the timeout.

Ordering between the transports on one group: an op that takes the process
group first drains the group's shared-memory queue (or lane), and a shared-memory
op (one level or two) first waits for the group's last asynchronous process-group
op, so the issue order holds across them.

One in flight on gloo.  A process-group op on CPU tensors (gloo) first waits for the
group's last asynchronous process-group op.  Gloo runs a group's collectives on two
worker threads, and torch 2.13's ``ProcessGroupGloo::runLoop`` writes the group's
"last completed" status (a ``std::string``) from whichever thread finishes, outside its
lock: two collectives of one group finishing together corrupt the heap (ASan: a
double-free in ``runLoop``; without it ``malloc(): unaligned tcache chunk detected`` or a
silent corruption).  torch's FSDP issues its CPU collectives synchronously and never has
two in flight; cfsdp's prefetch all-gather and its asynchronous reduce-scatter would, so
the second waits for the first (the prefetch still overlaps the compute before it).
NCCL groups (accelerator tensors) are not affected.

Numerics.  Shared-memory sums run over the ranks in rank order in float32
(float64 for float64; bf16/fp16 widen exactly, so they are *not* rounded per
addition as gloo's bf16 sums are) and round once; every rank of an all-reduce
gets the same bits.  ``scale`` (and AVG, which is ``scale = 1/W``) multiplies
the sum before that single rounding.  Two levels sum in a documented order of
their own: each host's ranks in local-rank order, rounded, then the host sums in
host order, scaled and rounded once (two_level.py); every rank gets the same bits
there too.  On the process group ``scale`` is a separate ``mul_`` after the
collective.  All-gather, broadcast and all-to-all are byte copies, identical on every
transport.

One rank.  A group of one rank needs no transport: every function does its
local equivalent at once (a copy, the chunk copy, the scale), in either
implementation, whatever is watching (a ``TorchDispatchMode`` too: see Visibility).
``fully_shard`` on a mesh of one rank, the wrapper on a one-rank process group, or
the shard dimension of an HSDP mesh with one rank per shard group, then pay no
collective at all, as torch's FSDP2 issues none there (its all-gather and
reduce-scatter are skipped at world size 1).

Visibility.  Every function runs inside a ``torch.profiler`` range named
``cfsdp::<function>`` (``cfsdp::all_gather``, ``cfsdp::reduce_scatter_pack``, ...) while
the profiler is on, whichever transport it takes.  A ``TorchDispatchMode`` (torch's
``CommDebugMode``, ...) sees torch's collective ops only, so while one is active every
call on a group of two or more ranks takes the process group: the mode then counts cfsdp's
collectives under torch's own ops (``c10d._allgather_base_``, ``_reduce_scatter_base_``,
``allreduce_``), exactly as it counts torch's FSDP's.  A one-rank group issues nothing even
then (One rank): the mode counts none, as it counts none of torch's FSDP2 on one rank.

Exit.  An ``atexit`` handler, before Python finalizes, closes every view and lane (their
threads joined), then lets gloo's worker threads finish with Python (shutdown.py, [Note:
exit and gloo workers]): a job exits 0 on every rank.

Twin.  Under ``CFSDP_IMPL=python`` (the pure-Python twins) every call takes
the process group: the process group is the shared-memory transport's twin,
and tests/distributed/test_shm.py compares the two on the same data (one host),
tests/distributed/test_hosts.py on emulated hosts (two levels, against the process
group and a single-process oracle of the documented order); the sum kernel's own
twin is ``cfsdp._ref.shm_reduce``.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import functools
import json
import logging
import os
import re
import secrets
import signal
import socket
import threading
import time
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _core
from .._torch import core as _torch_core
from . import agree, device, shutdown, two_level

SHM_ENV = "CFSDP_SHM"
SHM_SLOT_ENV = "CFSDP_SHM_SLOT_BYTES"
DEFAULT_SLOT_BYTES = 1 << 20
_SHM_DTYPES = frozenset((torch.float32, torch.float64, torch.bfloat16, torch.float16))
# what every backend's all-gather takes as it is; other dtypes (float8, ...) travel as bytes
_PG_DTYPES = frozenset((*_SHM_DTYPES, torch.int8, torch.uint8, torch.int16, torch.int32,
                        torch.int64, torch.bool))
_STORE_PREFIX = "cfsdp_shm"
_SHM_DIR = agree.SHM_DIR
_log = logging.getLogger(__name__)
_NOT_ATTEMPTED = "not attempted"
_REFUSED = "refused:"  # an attach status: a name or file that is not this job's ("Trust")
_SEGMENT_NAME = re.compile(r"/cfsdp-[0-9]+-[0-9a-f]{16}")  # what _open_segment creates
_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.05  # a set-up's polls of the store: see _Setup
_SAME_EVERYWHERE = "set it the same on every rank"


class _Once:
    """A process-group work that is waited for once, whoever asks first (its ``Pending``,
    or the next op on the group: "One in flight on gloo").  gloo's reduce-scatter work
    copies its result into the output again on every ``wait()`` (torch 2.13: its
    ``is_completed()`` never turns True), so a second wait after the output was used in
    place (HSDP's all-reduce, a post-divide) would silently put the old values back."""

    __slots__ = ("work", "done")

    def __init__(self, work: Any):
        self.work = work
        self.done = False

    def wait(self) -> None:
        if not self.done:
            self.work.wait()
            self.done = True

    def is_completed(self) -> bool:
        return self.done or bool(self.work.is_completed())


class Pending:
    """A collective in flight and the tensors it must keep alive.

    ``work`` is a ``dist.Work`` or a ``cfsdp._C.ShmWork`` (or ``None`` when the
    collective already ran); ``post`` runs once after it completes (the
    process group's post-multiply by ``scale``).
    """

    __slots__ = ("work", "keep", "post")

    def __init__(self, work: Optional[Any], *keep: torch.Tensor,
                 post: Optional[Callable[[], None]] = None):
        self.work = work
        self.keep = keep
        self.post = post

    def wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            work.wait()
        if self.post is not None:
            post, self.post = self.post, None
            post()
        self.keep = ()

    def is_completed(self) -> bool:
        """True once the collective is done (``wait()`` then returns at once)."""
        return self.work is None or bool(self.work.is_completed())


# --------------------------------------------------------------------------------------
# shared-memory groups
# --------------------------------------------------------------------------------------


_states: "weakref.WeakKeyDictionary[Any, Transport]" = weakref.WeakKeyDictionary()
_all_shm: "weakref.WeakSet[Transport]" = weakref.WeakSet()  # the live ones, closed at exit


def _resolve(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    return group if group is not None else dist.distributed_c10d._get_default_group()


def group_timeout(group: dist.ProcessGroup) -> float:
    """The group's timeout in seconds (its gloo backend's, else torch's default)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d.default_pg_timeout.total_seconds()


def _host_id() -> str:
    """This rank's host key (rule 2; ``agree.host_key``, the package's one; tests that
    emulate hosts on one machine replace this function)."""
    return agree.host_key()


def _slot_bytes() -> int:
    raw = os.environ.get(SHM_SLOT_ENV, "").strip()
    if not raw:
        return DEFAULT_SLOT_BYTES
    try:
        v = int(raw)
    except ValueError:
        raise ValueError(f"{SHM_SLOT_ENV}={raw!r} is not an integer number of bytes") from None
    if v <= 0 or v % 64:
        raise ValueError(f"{SHM_SLOT_ENV}={v} must be a positive multiple of 64")
    return v


def _shm_mode() -> str:
    """This rank's wish (rule 1): "off" (twins, or CFSDP_SHM=0), "host" (CFSDP_SHM=host:
    single-host groups only) or "on"."""
    if not _core.shm_available():
        return "off"
    raw = os.environ.get(SHM_ENV, "1").strip().lower()
    return "off" if raw == "0" else "host" if raw == "host" else "on"


class _Setup:
    """One set-up of one group: its store keys (fresh per set-up), the group's ranks and
    their bounded waits on each other (the only waits of a set-up: each is for a rank
    that has not yet reached its own set-up, so only a dead or stalled rank times out).

    The waits poll the store (``check``, a few milliseconds apart) and never block in
    ``store.wait``: a blocking wait holds the store client's one connection for as long as
    it waits, so the set-ups of two groups in two threads of a process (a side thread with
    its own group) would each stop the other's ``set`` until the timeout."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.label = str(group.group_name)
        self.world = group.size()
        self.rank = group.rank()
        self.ranks = dist.get_process_group_ranks(group)
        self.timeout = group_timeout(group)
        self.segment_of: dict = {}  # group rank -> its segment's label, once planned
        # each rank counts its set-ups of this group in the store itself (not in the
        # process): ranks that are threads of one process (torch's threaded test groups)
        # count their own, and a new store (a new world) starts every count afresh
        store = dist.distributed_c10d._get_default_store()
        n = store.add(f"{_STORE_PREFIX}/{self.label}/setups/{self.rank}", 1)
        self.store = dist.PrefixStore(f"{_STORE_PREFIX}/{self.label}/{n}/", store)

    def who(self, r: int) -> str:
        return f"group rank {r} (global rank {self.ranks[r]})"

    def segment(self, r: int) -> str:
        """Group rank ``r``'s segment in words: its label and, once published, its name."""
        seg = self.segment_of.get(r, "?")
        key = f"name/{seg}"
        name = self.store.get(key).decode() if seg != "?" and self.store.check([key]) else ""
        return f"{seg!r}" + (f" ({name})" if name and not name.startswith("error:") else "")

    def publish(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def gather(self, key: str, ranks: Sequence[int], did: Callable[[int], str]) -> list:
        """Every value of ``key/<r>`` for group ranks ``ranks`` (waiting for them);
        ``did(r)`` says what rank r does by publishing it, for the timeout's message."""
        says = {f"{key}/{r}": f"{self.who(r)} did not {did(r)}" for r in ranks}
        self.wait(says)
        return [self.store.get(k).decode() for k in says]

    def wait(self, says: dict) -> None:
        """Wait for every key of ``says`` (key -> what its absence means: "group rank 1
        (global rank 1) did not publish its host key"); after the group's timeout a
        ``RuntimeError`` naming each absent key's meaning."""
        deadline = time.monotonic() + self.timeout
        left, pause = list(says), _POLL_FIRST_S
        while left:
            if self.store.check([left[-1]]):
                left.pop()
                continue
            now = time.monotonic()
            if now >= deadline:
                missing = [says[k] for k in reversed(left) if not self.store.check([k])]
                if not missing:  # the last ones came in meanwhile
                    return
                raise RuntimeError(
                    f"cfsdp: set-up of group {self.label!r} (group rank {self.rank} of "
                    f"{self.world}) timed out after {self.timeout:g} s: "
                    + "; ".join(missing) + " (a rank that died or stalled, or that has not "
                    "issued its first collective on this group: every rank must issue it)")
            time.sleep(min(pause, deadline - now))
            pause = min(2 * pause, _POLL_MAX_S)


def _plan(infos: list) -> tuple:
    """The group's transport from every rank's ``[host key, host name, mode]`` (the same
    answer on every rank): ``("pg", why)``, ``("one", [ranks])`` (one segment over all
    ranks) or ``("two", hosts)`` (a segment per host; ``hosts`` lists each host's ranks,
    host-major).  See rules 1 and 2 of the module doc."""
    world = len(infos)
    modes = {m for _, _, m in infos}
    if "off" in modes:
        if len(modes) > 1:
            off = [r for r, (_, _, m) in enumerate(infos) if m == "off"]
            return ("pg", f"shared memory is off on group rank(s) {off} ({SHM_ENV}=0 or "
                          f"CFSDP_IMPL=python) but not on the others: {_SAME_EVERYWHERE}")
        return ("pg", f"shared memory off ({SHM_ENV}=0 or CFSDP_IMPL=python)")
    by_key: dict = {}
    for r, (key, _, _) in enumerate(infos):
        by_key.setdefault(key, []).append(r)
    hosts = list(by_key.values())
    if len(hosts) == 1:
        if world > _core.SHM_MAX_WORLD:
            return ("pg", f"{world} ranks on one host: more than a segment serves "
                          f"({_core.SHM_MAX_WORLD})")
        return ("one", hosts[0])
    k = len(hosts[0])
    shape = (f"{world} ranks on {len(hosts)} hosts (ranks per host: "
             f"{', '.join(str(len(h)) for h in hosts)})")
    if "host" in modes:
        return ("pg", f"{shape}; {SHM_ENV}=host: no two-level collectives")
    if k < 2 or any(len(h) != k for h in hosts):
        return ("pg", f"{shape}: two levels need the same number (2 or more) on every host")
    if any(h != list(range(i * k, (i + 1) * k)) for i, h in enumerate(hosts)):
        return ("pg", f"{shape}, not host-major (group rank = host * {k} + local rank): "
                      f"hosts hold ranks {hosts}")
    if k > _core.SHM_MAX_WORLD:
        return ("pg", f"{shape}: more ranks per host than a segment serves")
    return ("two", hosts)


def _has_cpu_backend(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` can send CPU tensors (gloo): the process-group part of two levels."""
    try:
        group._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError):
        return False
    return True


def _segment_name(su: _Setup, seg: str, creator: int) -> str:
    """The name of segment ``seg`` that group rank ``creator`` published (waiting for it),
    or its ``"error:..."``.  Anything else than a name of the creator's form
    (``_SEGMENT_NAME``) was not written by cfsdp: ``PermissionError`` (see "Trust")."""
    su.wait({f"name/{seg}": f"{su.who(creator)} did not publish the name of segment "
                            f"{seg!r}, which it creates"})
    name = su.store.get(f"name/{seg}").decode(errors="replace")
    if name.startswith("error:") or _SEGMENT_NAME.fullmatch(name):
        return name
    raise PermissionError(
        f"cfsdp: refused the segment name {name[:80]!r} that the job's rendezvous store "
        f"holds for group {su.label!r} (segment {seg!r}): cfsdp's names are "
        f"/cfsdp-<pid>-<16 hex digits>, so someone else wrote it. Another user of this "
        f"machine may be attacking the job through the store (torch's store has no "
        f"authentication): find who, keep other users off the store's port, restart the job")


def _open_segment(su: _Setup, members: list, seg: str, slot: int) -> tuple:
    """Create (first member) or attach this rank's view of segment ``seg`` shared by the
    group ranks ``members`` (``slot`` bytes per slot half); ``(view or None, error or
    None)``, never raising for a failure of the segment itself: the caller reports it and
    the group agrees; but ``PermissionError`` for a name or a file that is not this job's
    (see "Trust"), after publishing what the other ranks wait for."""
    local = members.index(su.rank)
    label = su.label if seg == "all" else f"{su.label}/{seg}"
    granks = [su.ranks[r] for r in members]
    if local == 0:
        name = f"/cfsdp-{os.getpid()}-{secrets.token_hex(8)}"
        su.publish(f"plan/{seg}", name)  # before it exists: see _abandon
        try:
            shm = _core.ShmView(name, True, len(members), 0, slot, su.timeout, label, granks)
        except (RuntimeError, ValueError, OverflowError, PermissionError) as e:
            su.publish(f"name/{seg}", "error:" + str(e))
            if isinstance(e, PermissionError):
                raise
            return None, str(e)
        su.publish(f"name/{seg}", name)
        return shm, None
    name = _segment_name(su, seg, members[0])
    if name.startswith("error:"):
        return None, f"{_NOT_ATTEMPTED}: group rank {members[0]} could not create it"
    try:
        return _core.ShmView(name, False, len(members), local, slot, su.timeout, label,
                                 granks), None
    except (RuntimeError, ValueError, OverflowError) as e:
        return None, str(e)


def _abandon(su: _Setup, seg: str, shm: Optional[Any]) -> None:
    """A set-up that raised inside its window (a rank died or stalled between creating
    segment ``seg`` and the agreement): close this rank's view and unlink the name its
    creator planned, whoever that is and whether or not it got to create it, so nothing
    is left in ``/dev/shm`` (see Set-up).  Never raises: the caller re-raises the cause."""
    if shm is not None:
        shm.close()  # the creator's close unlinks the name
    _unlink_planned(su, seg)


def _unlink_planned(su: _Setup, seg: str) -> None:
    """Unlink the name the creator of segment ``seg`` planned (``plan/<seg>``), if it is of
    cfsdp's form and still there.  Never raises."""
    key = f"plan/{seg}"
    try:
        name = su.store.get(key).decode() if su.store.check([key]) else ""
    except Exception as e:  # noqa: BLE001 - a store that went with the dead rank
        _log.warning("cfsdp: group %r: set-up failed and its segment name could not be read "
                     "from the store (%s); a /dev/shm/cfsdp-* file may be left", su.label, e)
        return
    if not _SEGMENT_NAME.fullmatch(name):
        return
    try:
        os.unlink(_SHM_DIR + name)
    except FileNotFoundError:  # never created, or already unlinked
        pass
    except OSError as e:
        _log.warning("cfsdp: group %r: set-up failed and %s could not be removed: %s",
                     su.label, _SHM_DIR + name, e)


@contextlib.contextmanager
def _unlink_on_sigterm(su: _Setup, seg: str):
    """While the set-up window is open, a SIGTERM first unlinks the planned name, then does
    what it would have done (torchrun SIGTERMs every other rank the moment one dies, and a
    process ended by a signal's default action runs no clean-up: without this the survivors
    of a kill in the window left the segment behind).  Only in the main thread (Python runs
    signal handlers there, and the set-up's waits poll the store, so the handler runs within
    one poll), and only over the default action or a Python handler, which is then called;
    a SIGTERM ignored stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    prev = signal.getsignal(signal.SIGTERM)
    if prev is signal.SIG_IGN or prev is None:  # None: a handler not set from Python
        yield
        return

    def on_sigterm(signum, frame):
        _unlink_planned(su, seg)
        signal.signal(signal.SIGTERM, prev)
        if callable(prev):
            prev(signum, frame)
        else:  # the default action: end by the signal, as without cfsdp
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, prev)


def _setup(group: dist.ProcessGroup) -> Transport:
    """The group's transport (see "Set-up" in the module doc).  Collective: every rank of
    the group calls it at the same point (its first collective on the group)."""
    if group.size() < 2:
        return _Solo(group, "local (one rank)")
    su = _Setup(group)
    try:
        slot: Any = _slot_bytes()
    except ValueError as e:  # every rank learns of it below, and raises
        slot = str(e)
    su.publish(f"host/{su.rank}", json.dumps([_host_id(), socket.gethostname(), _shm_mode(),
                                              slot]))
    infos = [json.loads(v) for v in su.gather("host", range(su.world),
                                              lambda r: "publish its host key")]
    kind, how = _plan([i[:3] for i in infos])
    slots = {i[3] for i in infos}
    if kind != "pg":
        bad = {r: i[3] for r, i in enumerate(infos) if isinstance(i[3], str)}
        if bad:  # a configuration error: every rank raises it
            raise ValueError(f"cfsdp: group {su.label!r}: " + "; ".join(
                f"group rank {r}: {m}" for r, m in sorted(bad.items())))
        if len(slots) > 1:
            kind, how = "pg", (f"{SHM_SLOT_ENV} differs between ranks ({sorted(slots)}): "
                               f"{_SAME_EVERYWHERE}")
    if kind == "two" and not _has_cpu_backend(group):
        kind, how = "pg", ("ranks on several hosts, and the group has no CPU backend for the "
                           "process-group part of two levels")
    if kind == "pg":
        if su.rank == 0 and _SAME_EVERYWHERE in how:  # a misconfiguration: say so
            _log.warning("cfsdp: group %r takes the process group: %s", su.label, how)
        return Transport(group, f"process group ({how})")
    if kind == "one":
        members, seg, hosts = how, "all", [how]
    else:
        hosts = how
        h = su.rank // len(hosts[0])
        members, seg = hosts[h], f"host{h}"
    su.segment_of = {r: "all" if kind == "one" else f"host{i}"
                     for i, ms in enumerate(hosts) for r in ms}
    shm = None
    try:
        with _unlink_on_sigterm(su, seg):
            try:
                shm, err = _open_segment(su, members, seg, slot)
                status = "ok" if err is None else "error:" + err
            except PermissionError as e:  # see "Trust": every rank raises it below
                shm, status = None, _REFUSED + str(e)
            su.publish(f"attach/{su.rank}", status)
            results = su.gather("attach", range(su.world),
                                lambda r: f"say whether it attached segment {su.segment(r)}")
    except BaseException:
        _abandon(su, seg, shm)
        raise
    refused = {r: v[len(_REFUSED):] for r, v in enumerate(results) if v.startswith(_REFUSED)}
    if refused:
        if shm is not None:
            shm.close()  # the creator's close unlinks the name
        raise PermissionError(
            f"cfsdp: group {su.label!r} (rank {su.rank} of {su.world}): group rank(s) "
            f"{sorted(refused)} refused to map shared memory that is not this job's: "
            + "; ".join(f"rank {r}: {m}" for r, m in sorted(refused.items())))
    failed = {r: v[6:] for r, v in enumerate(results) if v != "ok"}
    if failed:
        if shm is not None:
            shm.close()  # the creator's close unlinks the name
        failed = {r: m for r, m in failed.items() if not m.startswith(_NOT_ATTEMPTED)} or failed
        why = (f"shared memory could not be set up on group rank(s) {sorted(failed)}: "
               + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items())))
        if su.rank == 0:
            _log.warning("cfsdp: group %r takes the process group: %s", su.label, why)
        return Transport(group, f"process group ({why})")
    shm.wait_attached()  # every rank attached (they said so): returns at once, unlinks
    names = [infos[m[0]][1] for m in hosts]
    if kind == "one":
        st: Transport = _SharedMemory(group, shm, f"shared memory ({su.world} ranks on host "
                                                  f"{names[0]!r})")
    else:
        k = len(hosts[0])
        lane = two_level.Lane(group, shm, len(hosts), k, su.rank // k, su.ranks, names, su.label)
        st = _TwoLevel(group, lane, (
            f"two levels: shared memory inside each of {len(hosts)} hosts x {k} ranks "
            f"({', '.join(map(repr, names))}), the process group between them"))
    if su.rank == 0:
        _log.info("cfsdp: group %r: %s", su.label, st.transport)
    return st


def _state(group: dist.ProcessGroup) -> Transport:
    st = _states.get(group)
    if st is None:
        st = _setup(group)
        _states[group] = st
        if st.live():
            _all_shm.add(st)
    return st


def describe(group: Optional[dist.ProcessGroup] = None) -> str:
    """Which transport ``group``'s eligible collectives take, in words (e.g. "two levels:
    shared memory inside each of 2 hosts x 2 ranks (...), the process group between them").
    Sets the group up on the first call, like its first collective: call it on every rank."""
    return _state(_resolve(group)).transport


def uses_shm(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether ``group``'s eligible collectives go through shared memory (one segment, or
    a segment per host in two levels).  Sets the group up on the first call, like its
    first collective: call it on every rank."""
    st = _state(_resolve(group))
    return st.live()


def one_segment(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether ``group``'s eligible collectives go through ONE shared-memory segment: every
    rank of the group on this host, shared memory proved by the set-up (rules 1 to 3; not
    two levels, not one rank).  What may share more host memory than a segment (ZeRO's
    parameter buckets) asks this.  Sets the group up on the first call, like its first
    collective: call it on every rank."""
    st = _state(_resolve(group))
    return isinstance(st, _SharedMemory) and st.live()


def release(group: Optional[dist.ProcessGroup] = None) -> None:
    """Close ``group``'s shared-memory view or two-level lane (worker thread joined,
    segment unmapped) and forget it; its next collective sets it up again.  Wait on its
    pending ops first: ops still queued fail.  Call on every rank (e.g. before destroying
    the process group).  A no-op for a group never set up."""
    group = _resolve(group)
    _accelerator.pop(group, None)
    st = _states.pop(group, None)
    if st is not None:
        st.close()


@atexit.register
def _close_all() -> None:
    """At exit, before Python finalizes: every shared-memory view and lane closed (their
    threads joined), then gloo's worker threads given the GIL until they are done with
    Python ([Note: exit and gloo workers] in shutdown.py)."""
    for st in list(_all_shm):
        st.close()
    shutdown.quiesce_gloo_workers()


def _is_sum_or_avg(op) -> Optional[bool]:
    """True for AVG, False for SUM, None for any other reduction."""
    if op == dist.ReduceOp.SUM:
        return False
    if op == dist.ReduceOp.AVG:
        return True
    return None


def _dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` (e.g. ``CommDebugMode``) is on: see Visibility."""
    return _torch_core.dispatch_mode_active()


def _check_blocks(op: str, what: str, whole: torch.Tensor, block: torch.Tensor, w: int) -> None:
    """``whole`` must hold one ``block`` per rank of the group."""
    if whole.numel() != w * block.numel():
        raise ValueError(f"{op}: {what} has {whole.numel()} elements, expected {w} x "
                         f"{block.numel()}")


def _shm_done(work: Any, async_op: bool, *keep: torch.Tensor) -> Pending:
    if async_op:
        return Pending(work, *keep)
    work.wait()
    return Pending(None)


def _shm_scale(world: int, avg: bool, scale: Optional[float]) -> float:
    """The one factor the shared-memory sum is multiplied by (AVG is 1/W)."""
    return (1.0 if scale is None else float(scale)) / (world if avg else 1)


def _threads() -> int:
    return torch.get_num_threads()


def _traced(name: str):
    """Run the collective inside a profiler range ``cfsdp::<name>`` while the profiler is
    on (one flag check otherwise): see Visibility."""
    label = f"cfsdp::{name}"

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not _torch_core.profiler_enabled():
                return fn(*args, **kwargs)
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)

        return wrapper

    return deco


def _scaled(work: Optional[Any], out: torch.Tensor, scale: Optional[float], async_op: bool,
            *keep: torch.Tensor) -> Pending:
    post = None if scale is None or scale == 1 else (lambda: out.mul_(scale))
    p = Pending(work, out, *keep, post=post)
    if not async_op:
        p.wait()
    return p


# --------------------------------------------------------------------------------------
# the transports: one object per group, chosen at its set-up
# --------------------------------------------------------------------------------------


class Transport:
    """How one group's collectives travel, chosen once at the group's set-up (``_setup``;
    the module doc's Transports, Rule and Set-up): every collective function of this
    module calls its group's transport.  Methods take tensors, never addresses (the C
    core's segment is ``_core.ShmView``).

    This base class is the process group (gloo on CPU, NCCL on accelerators).  It is also
    what the other transports take, per call, for what they do not carry (rules 4 to 6):
    they override ``_carries`` and the ops they run themselves.  A process-group op first
    drains the transport's own queue and, on CPU tensors, waits for the group's last
    asynchronous process-group op (see "One in flight on gloo"); ``_issue`` is where a
    process-group op starts, the seam where a device's streams will enter.
    ``transport`` says which transport in words (``describe``)."""

    def __init__(self, group: dist.ProcessGroup, transport: str):
        self.group = group
        self.transport = transport
        self.last_pg: Optional[Any] = None  # the last asynchronous process-group op

    # -- life ----------------------------------------------------------------------------
    def live(self) -> bool:
        """Whether shared memory (one level or two) serves the group now."""
        return False

    def drain(self) -> None:
        """Wait until every op issued so far on the transport's own queue is done."""

    def close(self) -> None:
        """Close what the transport holds (segment view, lane); the process group stays."""

    # -- the process group ---------------------------------------------------------------
    def _wait_last_pg(self) -> None:
        if self.last_pg is not None:
            work, self.last_pg = self.last_pg, None
            work.wait()

    def _issue(self, t: torch.Tensor, start: Callable[[], Any]) -> Optional[_Once]:
        """Start a process-group op on ``t`` (``start()``) after everything before it; its
        work, to be waited for once (``_Once``), or None when it ran synchronously."""
        self.drain()
        if t.device.type == "cpu":
            self._wait_last_pg()
        work = start()
        if work is None:
            return None
        self.last_pg = once = _Once(work)
        return once

    def _carries(self, *tensors: torch.Tensor, op=dist.ReduceOp.SUM,
                 other: Optional[torch.Tensor] = None) -> Optional[_core.Admitted]:
        """Whether this call goes through the transport's own path (rules 4 to 6):
        ``tensors`` of one eligible dtype, ``other`` eligible in its own, ``op`` SUM or
        AVG, no dispatch mode; then after the group's last process-group op.  The answer
        is ``_core.admit``'s (None: not carried), which the segment op takes as its check."""
        if not self.live() or _dispatch_mode_active() or _is_sum_or_avg(op) is None:
            return None
        admitted = _core.admit(tensors, other, _SHM_DTYPES)
        if admitted is not None:
            self._wait_last_pg()
        return admitted

    # -- the collectives -------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool) -> Pending:
        # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old
        # name warns); look it up per call so torch>=2.9 works and tools that patch
        # torch.distributed (our collective-order test) see the call.
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        if out.dtype not in _PG_DTYPES:  # e.g. float8: a byte copy, as torch's FSDP2 does it
            out, shard = out.view(torch.uint8), shard.view(torch.uint8)
        work = self._issue(out, lambda: ag(out, shard, group=self.group, async_op=async_op))
        return Pending(work, out, shard)

    def all_gather_unpack(self, natural: torch.Tensor, shard: torch.Tensor, plan,
                          plan_bytes: bytes, async_op: bool) -> Pending:
        W = self.group.size()
        gathered = torch.empty(W * shard.numel(), dtype=shard.dtype, device=shard.device)
        pending = self.all_gather(gathered, shard, async_op=True)

        def unpack() -> None:
            _core.chunk_unpack(natural, gathered, plan, W, shard.numel())

        p = Pending(pending.work, natural, shard, gathered, post=unpack)
        if not async_op:
            p.wait()
        return p

    def reduce_scatter_pack(self, out: torch.Tensor, natural: torch.Tensor, plan,
                            plan_bytes: bytes, divisor: float, async_op: bool,
                            op=dist.ReduceOp.SUM) -> Pending:
        W = self.group.size()
        inp = torch.empty(W * out.numel(), dtype=out.dtype, device=out.device)
        _core.chunk_pack(inp, natural.contiguous(), plan, W, out.numel(), divisor=divisor)
        return self.reduce_scatter(out, inp, async_op, op=op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                       op=dist.ReduceOp.SUM, scale: Optional[float] = None) -> Pending:
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        work = self._issue(out, lambda: rs(out, inp, op=op, group=self.group, async_op=async_op))
        return _scaled(work, out, scale, async_op, inp)

    def all_reduce(self, t: torch.Tensor, async_op: bool, op=dist.ReduceOp.SUM,
                   scale: Optional[float] = None) -> Pending:
        work = self._issue(t, lambda: dist.all_reduce(t, op=op, group=self.group,
                                                      async_op=async_op))
        return _scaled(work, t, scale, async_op)

    def broadcast(self, t: torch.Tensor, src: int, async_op: bool) -> Pending:
        work = self._issue(t, lambda: dist.broadcast(t, group=self.group, group_src=src,
                                                     async_op=async_op))
        return Pending(work, t)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[Sequence[int]],
                   async_op: bool) -> Pending:
        me = self.group.rank()
        splits_in = [int(c) for c in counts[me]]
        splits_out = [int(row[me]) for row in counts]
        work = self._issue(out, lambda: dist.all_to_all_single(
            out, inp, splits_out, splits_in, group=self.group, async_op=async_op))
        return Pending(work, out, inp)


class _Solo(Transport):
    """A group of one rank: every op is its local equivalent, at once (see "One rank")."""

    def all_gather(self, out, shard, async_op):
        _check_blocks("all_gather", "output", out, shard, 1)
        out.copy_(shard)
        return Pending(None)

    def all_gather_unpack(self, natural, shard, plan, plan_bytes, async_op):
        _core.chunk_unpack(natural, shard, plan, 1, shard.numel())
        return Pending(None)

    def reduce_scatter_pack(self, out, natural, plan, plan_bytes, divisor, async_op,
                            op=dist.ReduceOp.SUM):
        # any reduction over one rank is the identity
        _core.chunk_pack(out, natural.contiguous(), plan, 1, out.numel(), divisor=divisor)
        return Pending(None)

    def reduce_scatter(self, out, inp, async_op, op=dist.ReduceOp.SUM, scale=None):
        _check_blocks("reduce_scatter", "input", inp, out, 1)
        out.copy_(inp.view_as(out))
        return _scaled(None, out, scale, False)

    def all_reduce(self, t, async_op, op=dist.ReduceOp.SUM, scale=None):
        return _scaled(None, t, scale, False)

    def broadcast(self, t, src, async_op):
        return Pending(None)

    def all_to_all(self, out, inp, counts, async_op):
        _, sent, got = _core.counts_blob(counts, 1, 0)
        if inp.numel() != sent or out.numel() != got:
            raise ValueError(f"all_to_all: input has {inp.numel()} and output {out.numel()} "
                             f"elements, the counts say {sent} and {got}")
        out.copy_(inp)
        return Pending(None)


class _SharedBase(Transport):
    """What shared memory carries, one level or two: the engine (``_core.ShmView`` or a
    ``two_level.Lane``, which take the same calls) runs the group's eligible all-gathers,
    reduce-scatters, all-reduces, broadcasts and all-to-alls in issue order."""

    def __init__(self, group: dist.ProcessGroup, engine: Any, transport: str):
        super().__init__(group, transport)
        self.engine = engine
        # a segment op takes ``_carries``'s check as its own; a lane checks the pieces it
        # hands its segment itself
        self._checks_once = isinstance(engine, _core.ShmView)

    def live(self) -> bool:
        return not self.engine.closed

    def _run(self, name: str, admitted: _core.Admitted, *args: Any) -> Any:
        fn = getattr(self.engine, name)
        return fn(*args, admitted=admitted) if self._checks_once else fn(*args)

    def drain(self) -> None:
        if self.live():
            self.engine.drain()

    def close(self) -> None:
        self.engine.close()

    def _check_src(self, src: int) -> None:
        """A broadcast's source rank, before the engine takes it (a segment checks it itself)."""

    def all_gather(self, out, shard, async_op):
        adm = self._carries(out, shard)
        if adm is None:
            return super().all_gather(out, shard, async_op)
        _check_blocks("all_gather", "output", out, shard, self.group.size())
        return _shm_done(self._run("all_gather", adm, out, shard, _threads()), async_op,
                         out, shard)

    def reduce_scatter(self, out, inp, async_op, op=dist.ReduceOp.SUM, scale=None):
        adm = self._carries(out, inp, op=op)
        if adm is None:
            return super().reduce_scatter(out, inp, async_op, op=op, scale=scale)
        _check_blocks("reduce_scatter", "input", inp, out, self.group.size())
        s = _shm_scale(self.group.size(), _is_sum_or_avg(op), scale)
        return _shm_done(self._run("reduce_scatter", adm, out, inp, s, _threads()), async_op,
                         out, inp)

    def all_reduce(self, t, async_op, op=dist.ReduceOp.SUM, scale=None):
        adm = self._carries(t, op=op)
        if adm is None:
            return super().all_reduce(t, async_op, op=op, scale=scale)
        s = _shm_scale(self.group.size(), _is_sum_or_avg(op), scale)
        return _shm_done(self._run("all_reduce", adm, t, s, _threads()), async_op, t)

    def broadcast(self, t, src, async_op):
        adm = self._carries(t)
        if adm is None:
            return super().broadcast(t, src, async_op)
        self._check_src(src)
        return _shm_done(self._run("broadcast", adm, t, int(src), _threads()), async_op, t)

    def all_to_all(self, out, inp, counts, async_op):
        adm = self._carries(out, inp)
        if adm is None:
            return super().all_to_all(out, inp, counts, async_op)
        return _shm_done(self._run("all_to_all", adm, out, inp, counts, _threads()), async_op,
                         out, inp)


class _SharedMemory(_SharedBase):
    """Every rank of the group on one host: one segment (``_core.ShmView``, the engine),
    its ops on the segment's C worker thread in issue order; the chunk ops copy straight
    between the slots and the unit's buffer."""

    def all_gather_unpack(self, natural, shard, plan, plan_bytes, async_op):
        adm = self._carries(natural, shard)
        if adm is None:
            return super().all_gather_unpack(natural, shard, plan, plan_bytes, async_op)
        work = self.engine.all_gather_unpack(natural, shard, plan_bytes, _threads(),
                                             admitted=adm)
        return _shm_done(work, async_op, natural, shard)

    def reduce_scatter_pack(self, out, natural, plan, plan_bytes, divisor, async_op,
                            op=dist.ReduceOp.SUM):
        adm = self._carries(out, op=op, other=natural)
        if adm is None:
            return super().reduce_scatter_pack(out, natural, plan, plan_bytes, divisor,
                                               async_op, op=op)
        scale = _shm_scale(self.group.size(), _is_sum_or_avg(op), None)
        work = self.engine.reduce_scatter_pack(out, natural, divisor, scale, plan_bytes,
                                               _threads(), admitted=adm)
        return _shm_done(work, async_op, out, natural)


class _TwoLevel(_SharedBase):
    """A group over several hosts with the same number of ranks on each: a segment per host
    and the process group between hosts, run by the group's lane (two_level.py, the
    engine).  The chunk ops take the base class's composition (an all-gather or
    reduce-scatter, which the lane carries, and the chunk copy)."""

    def _check_src(self, src: int) -> None:
        if not 0 <= src < self.group.size():
            raise ValueError(f"broadcast: source rank {src} is not a rank of "
                             f"the group (size {self.group.size()})")


# --------------------------------------------------------------------------------------
# the collectives: each calls its group's transport
# --------------------------------------------------------------------------------------


_accelerator: "weakref.WeakKeyDictionary[Any, Transport]" = weakref.WeakKeyDictionary()


def _accelerator_transport(group: dist.ProcessGroup) -> Transport:
    """The process group for a group's accelerator tensors (see "Accelerator tensors"):
    made on first use, set up nothing."""
    tr = _accelerator.get(group)
    if tr is None:
        tr = _accelerator[group] = (_Solo(group, "local (one rank)") if group.size() < 2 else
                                    Transport(group, "process group (accelerator tensors)"))
    return tr


def transport(group: Optional[dist.ProcessGroup] = None,
              t: Optional[torch.Tensor] = None) -> Transport:
    """``group``'s transport (default: the default group) for a call on tensor ``t``: for a
    tensor that is not on the CPU, the process group, with no set-up ("Accelerator
    tensors"); else the group's transport, set up on its first use: a collective call, so
    every rank of the group calls it at the same point."""
    group = _resolve(group)
    if t is not None and (t.device.type != "cpu" or not device.layer_for(t.device).host_paths):
        return _accelerator_transport(group)
    return _state(group)


@_traced("all_gather")
def all_gather(
    out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> Pending:
    """Gather every rank's ``shard`` into ``out`` (``world_size * shard.numel()``)."""
    return transport(group, shard).all_gather(out, shard, async_op)


def pack_plan(plan) -> bytes:
    """A chunk plan ``[(nat_off, numel, chunk_numel, shard_off, outer), ...]`` as the
    bytes :func:`all_gather_unpack` takes (int64 quintuples, csrc/chunk.h's
    cf_chunk_param)."""
    for i, entry in enumerate(plan):  # C sees only bytes: a short row would shift the rest
        if len(entry) != 5:
            raise ValueError(f"plan param {i} must be (nat_off, numel, chunk_numel, shard_off, "
                             f"outer), got {len(entry)} items")
    return array.array("q", [int(v) for entry in plan for v in entry]).tobytes()


@_traced("all_gather_unpack")
def all_gather_unpack(
    natural: torch.Tensor, shard: torch.Tensor, plan, plan_bytes: bytes,
    group: dist.ProcessGroup, async_op: bool,
) -> Pending:
    """All-gather every rank's ``shard`` straight into a unit's ``natural`` buffer by
    its chunk ``plan`` (``plan_bytes = pack_plan(plan)``): the result of an all-gather
    into the rank-major buffer followed by ``_core.chunk_unpack``, which is what the
    process group path does.  On shared memory the copy-out from the peers' slots
    writes the natural buffer directly, so the rank-major buffer is never built."""
    return transport(group, shard).all_gather_unpack(natural, shard, plan, plan_bytes, async_op)


@_traced("reduce_scatter_pack")
def reduce_scatter_pack(
    out: torch.Tensor, natural: torch.Tensor, plan, plan_bytes: bytes, divisor: float,
    group: dist.ProcessGroup, async_op: bool, op=dist.ReduceOp.SUM,
) -> Pending:
    """Reduce-scatter a unit's natural gradient by its chunk ``plan``: the result of
    ``_core.chunk_pack`` into the rank-major buffer (``out``'s dtype, divided by
    ``divisor``) followed by :func:`reduce_scatter`, which is what the process group
    path does.  On shared memory each piece is packed straight into the shared slot,
    so the rank-major buffer is never built."""
    return transport(group, natural).reduce_scatter_pack(out, natural, plan, plan_bytes, divisor,
                                                async_op, op=op)


@_traced("reduce_scatter")
def reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, async_op: bool,
    op=dist.ReduceOp.SUM, scale: Optional[float] = None,
) -> Pending:
    """Reduce ``inp`` over ranks (sum, or ``op``) and keep this rank's chunk in ``out``,
    multiplied by ``scale`` if given (fused into the sum on shared memory)."""
    return transport(group, inp).reduce_scatter(out, inp, async_op, op=op, scale=scale)


@_traced("all_reduce")
def all_reduce(
    t: torch.Tensor, group: dist.ProcessGroup, async_op: bool, op=dist.ReduceOp.SUM,
    scale: Optional[float] = None,
) -> Pending:
    """Reduce ``t`` (sum, or ``op``) over the ranks of ``group``, in place, multiplied
    by ``scale`` if given (fused into the sum on shared memory)."""
    return transport(group, t).all_reduce(t, async_op, op=op, scale=scale)


@_traced("all_to_all")
def all_to_all(
    out: torch.Tensor, inp: torch.Tensor, counts: Sequence[Sequence[int]],
    group: dist.ProcessGroup, async_op: bool,
) -> Pending:
    """Every rank's blocks to every rank: ``counts[s][r]`` elements go from rank ``s`` to rank
    ``r`` (the whole ``world x world`` matrix, sender-major, the same on every rank: shared
    memory copies every block once from the sender's slot, and the ranks check that they
    agree on it).  ``inp`` holds this rank's row of blocks back to back, ``out`` receives its
    column in rank order: ``dist.all_to_all_single(out, inp, column, row)``, which is the
    process-group path.  Byte copies: the same bits on every transport."""
    return transport(group, inp).all_to_all(out, inp, counts, async_op)


@_traced("broadcast")
def broadcast(
    t: torch.Tensor, src_rank_in_group: int, group: dist.ProcessGroup, async_op: bool = False
) -> Pending:
    """Broadcast ``t`` in place from the group's rank ``src_rank_in_group``."""
    return transport(group, t).broadcast(t, src_rank_in_group, async_op)
