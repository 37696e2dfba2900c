"""Two-level collectives: shared memory inside each host, the process group between hosts.

``comm.py`` routes a collective here when its group spans ``H >= 2`` hosts with the same
``k >= 2`` ranks on each, laid out host-major (group rank ``g = h * k + l``: host ``h``,
local rank ``l``; torchrun's order), and the set-up proved a shared-memory segment on every
host (see comm.py's docstring: it decides, this module executes).  Notation below: ``W = H
* k`` ranks, ``n`` elements per rank block, ``peer(h') = h' * k + l`` the rank with this
rank's local index on host ``h'``.

Algorithms (each rank moves ``(H - 1) / W`` of the buffer between hosts, the least any
algorithm can: 1/k of what a flat collective over the W ranks moves per rank)
-------------------------------------------------------------------------------------
* **all_gather** (``out = [block of g for g in 0..W)``): first between hosts, this rank's
  block to every ``peer(h')`` and theirs into ``out`` (process-group send/recv, ``n`` each
  way per peer); then inside the host, for each ``h'``, a shared-memory all-gather of the
  ``k`` blocks of host ``h'`` straight into ``out[h']`` (each rank's block is already there).
* **reduce_scatter** (``out = scale * sum over g of inp_g[block of this rank]``): first
  inside the host, for each ``h'``, a shared-memory reduce-scatter of the ``k`` blocks of
  host ``h'`` (scale 1): ``part[h']`` is this host's sum for block ``peer(h')``; then between
  hosts, ``part[h']`` to ``peer(h')`` and theirs back (``n`` each way per peer); then the
  ``H`` host sums of this rank's block are added in host order, times ``scale``.
* **all_reduce**: reduce_scatter into this rank's block of a buffer padded to ``W`` equal
  blocks, then all_gather of the blocks (each block summed once, by its owner, so every
  rank gets the same bits).
* **all_to_all** (``counts[s][r]`` elements from rank ``s`` to rank ``r``, every rank knowing
  the whole matrix): first inside the host, a shared-memory all-to-all that gives local rank
  ``l'`` every block of this host for a rank of local index ``l'`` on any host (ordered by
  host); then between hosts, to each ``peer(h')`` all of this host's blocks for it in one
  message (sender order) and from it all of host ``h'``'s blocks for this rank, straight into
  their place in the output (whose senders ``h' * k .. h' * k + k - 1`` are contiguous); this
  host's blocks for this rank are copied from the first stage.  Every byte crosses between
  hosts once, in ``H - 1`` messages per rank instead of ``W - k``.
* **broadcast** from group rank ``R = h_R * k + l_R``: between hosts the root sends to
  ``peer(h')`` of local rank ``l_R``, then a shared-memory broadcast from local rank ``l_R``
  inside every host.

Numerics (the documented order; every rank gets the same bits).  A sum over the group is
``round(scale * (P_0 + P_1 + ... + P_{H-1}))`` where ``P_h = round(x_{h,0} + x_{h,1} + ... +
x_{h,k-1})``: each host's sum in local-rank order, rounded once to the dtype (the
shared-memory kernel: float32 accumulation, float64 for float64), then the host sums in host
order, multiplied by ``scale`` and rounded once (the same kernel, ``_core.shm_reduce``).  For
float32 and float64 this rounds at each addition as a flat sum does, in a different order
than the flat shared-memory sum ``round(scale * (x_0 + ... + x_{W-1}))``; for bf16 and fp16 it
rounds twice (host sums, then the total) where the flat one rounds once and gloo once per
addition.  All-gather and broadcast are byte copies: identical on every transport.

Execution.  One *lane* per group: a Python thread that runs the group's two-level
collectives one at a time in issue order (the CPU "stream" of this transport; the group's
own ``ShmGroup`` queue is used only by the lane, so its order is the lane's).  The lane waits
on the process group and the segment with the GIL released.  A failure (a peer host gone, a
timeout) fails the op with a message naming the group, the op and the peer's global rank and
host; it is recorded in the segment (``ShmGroup.fail``), so this host's other ranks fail at
once rather than at their timeout; and the lane is poisoned: every later op fails with the
first error.  Process-group messages use send/recv tag ``TAG`` on the group, so they never
match a collective of the group or a user's send/recv with another tag.

A dead peer, within about a second, whatever the timeout (comm.py, "Dead peers").  A peer
on this host that dies is seen by the segment's own waits (csrc/shm.c, Liveness); a peer on
another host that dies breaks its gloo connections, so the send/recv with it fails at once.
What neither sees: a peer on another host that is alive but failed (its host-mate died, or
its lane is poisoned) never posts its half of an exchange, and a gloo send/recv cannot be
interrupted (gloo's own timeout on one poisons every connection of the group).  So the
lane never blocks in a gloo wait itself: a *waiter* thread per lane does the blocking
waits of an exchange, and the lane meanwhile waits for the waiter's answer and, every
``POLL_S``, asks the segment whether a rank of this host failed (``ShmGroup.failure``).  In
every exchange each host has a rank paired with the dead peer's local index, which gets the
gloo error and records it in its segment; so every rank of every host learns it, through
gloo or through its segment.  When the segment says so, the op fails with that rank's
message (naming the dead peer and its host) and the waiter is left behind, blocked until
gloo's wait ends (the peer's process exits, or gloo's timeout); the lane is poisoned, so it
never gets another exchange.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _core

TAG = 0x0CF5D  # send/recv tag of the process-group part (any fixed value the user does not use)
POLL_S = 0.05  # how often a lane waiting on the process group looks at its segment


class LaneWork:
    """One queued two-level collective: ``wait()`` blocks (GIL released) until it is done
    and raises ``RuntimeError`` with its message if it failed."""

    __slots__ = ("_done", "error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: Optional[str] = None

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(self.error)

    def is_completed(self) -> bool:
        return self._done.is_set()


class Lane:
    """The two-level transport of one group on this rank (see the module doc).

    ``group``: the process group; ``intra``: this host's ``_core.ShmView`` (its ``k`` ranks,
    local rank ``local``); ``hosts``, ``per_host``, ``host``: H, k and this rank's host
    index; ``global_ranks``: the group's global ranks; ``host_names``: a name per host for
    messages; ``label``: the group's name in messages.
    """

    def __init__(self, group: dist.ProcessGroup, intra: Any, hosts: int, per_host: int,
                 host: int, global_ranks: Sequence[int], host_names: Sequence[str], label: str):
        self.group = group
        self.intra = intra
        self.hosts, self.per_host, self.host = hosts, per_host, host
        self.local = intra.rank
        self.rank = host * per_host + self.local
        self.global_ranks = list(global_ranks)
        self.host_names = list(host_names)
        self.label = label
        self._tasks: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._queued = 0  # tasks submitted and not yet done (under _lock)
        self._idle = threading.Condition(self._lock)
        self.error: Optional[str] = None  # the first failure: the lane is poisoned
        self.closed = False
        # the waiter (see the module doc): (posted works, _Waits) to wait for, None to stop
        self._waits: "queue.SimpleQueue[Optional[_Waits]]" = queue.SimpleQueue()
        self._waiter: Optional[threading.Thread] = None

    # -- the lane ----------------------------------------------------------------------

    def submit(self, name: str, fn: Callable[[], None]) -> LaneWork:
        """Queue ``fn`` (one collective, named ``name`` in messages) behind every earlier one."""
        if self.closed:
            raise RuntimeError(f"cfsdp two-level group '{self.label}': the group is closed")
        work = LaneWork()
        with self._lock:
            self._queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"cfsdp-two-level-{self.label}")
                self._thread.start()
        self._tasks.put((name, fn, work))
        return work

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            name, fn, work = task
            try:
                if self.error is not None:
                    work.error = (f"cfsdp two-level group '{self.label}': {name} refused: "
                                  f"poisoned by an earlier failure: {self.error}")
                elif self.closed:
                    work.error = (f"cfsdp two-level group '{self.label}': {name}: closed "
                                  "before the op ran")
                else:
                    try:
                        fn()
                    except Exception as e:  # noqa: BLE001 - every failure poisons the lane
                        self.error = self._message(name, e)
                        work.error = self.error
                        try:
                            self.intra.fail(self.error)
                        except Exception:  # noqa: BLE001 - a closed view has nobody to tell
                            pass
            finally:
                work._done.set()
                with self._lock:
                    self._queued -= 1
                    if self._queued == 0:
                        self._idle.notify_all()

    def _message(self, name: str, e: BaseException) -> str:
        who = (f"cfsdp two-level group '{self.label}' (rank {self.rank} of "
               f"{self.hosts * self.per_host}, global rank {self.global_ranks[self.rank]}, "
               f"host {self.host} '{self.host_names[self.host]}')")
        if isinstance(e, _PeerError):
            return (f"{who}: {name}: the exchange with global rank {e.global_rank} on host "
                    f"{e.host} '{self.host_names[e.host]}' failed (that host died, stalled "
                    f"past the timeout, or the network failed): {e.cause}")
        if isinstance(e, _HostFailed):
            peers = ", ".join(f"global rank {self.global_ranks[self._peer(h)]} on host {h} "
                              f"'{self.host_names[h]}'" for h in e.hosts)
            return (f"{who}: {name}: aborted while exchanging with {peers}: a rank of this "
                    f"host failed: {e.cause}")
        return f"{who}: {name} failed: {e}"

    def drain(self) -> None:
        """Block until every collective queued so far is done (errors are the ops' own)."""
        with self._lock:
            while self._queued:
                self._idle.wait()

    def close(self) -> None:
        """Stop the lane: queued ops that did not start fail; the running one finishes
        (a shared-memory wait in it is aborted); the segment view is closed."""
        if self.closed:
            return
        self.closed = True
        self.intra.close()
        if self._thread is not None:
            self._tasks.put(None)
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=5.0)
        if self._waiter is not None:
            self._waits.put(None)  # a waiter left blocked in gloo (a failure) is not joined

    # -- the process-group part ----------------------------------------------------------

    def _peer(self, h: int) -> int:
        return h * self.per_host + self.local

    def _exchange(self, sends: Sequence[tuple], recvs: Sequence[tuple]) -> None:
        """Post every send ``(host, tensor)`` and receive ``(host, tensor)`` with the rank of
        this local index on that host, then wait for all of them; a failure names the peer."""
        posted = []
        for op, pairs in ((self.group.send, sends), (self.group.recv, recvs)):
            for h, t in pairs:
                if t.numel():
                    try:
                        posted.append((h, op([t], self._peer(h), TAG)))
                    except Exception as e:  # noqa: BLE001 - a peer already gone fails the post
                        raise _PeerError(self.global_ranks[self._peer(h)], h, e) from e
        if not posted:
            return
        if self._waiter is None:
            self._waiter = threading.Thread(target=self._wait_loop, daemon=True,
                                            name=f"cfsdp-two-level-wait-{self.label}")
            self._waiter.start()
        waits = _Waits(posted)
        self._waits.put(waits)
        while not waits.done.wait(POLL_S):
            failed = self.intra.failure(0.0)
            if failed is not None:
                raise _HostFailed(sorted({h for h, _ in posted}), failed)
        if waits.error is not None:
            raise waits.error

    def _wait_loop(self) -> None:
        """The waiter: wait for each exchange's works in turn (see the module doc)."""
        while True:
            waits = self._waits.get()
            if waits is None:
                return
            for h, w in waits.posted:
                try:
                    w.wait()
                except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError or DistError
                    if waits.error is None:
                        waits.error = _PeerError(self.global_ranks[self._peer(h)], h, e)
            waits.done.set()

    def _shm_wait(self, works: Sequence[Any]) -> None:
        for w in works:
            w.wait()

    # -- the collectives (the bodies run on the lane) ------------------------------------

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, threads: int) -> LaneWork:
        H, k, h, l = self.hosts, self.per_host, self.host, self.local
        n = shard.numel()
        blocks = out.view(H, k, n)

        def run() -> None:
            mine = blocks[h, l]
            if _core.address(mine) != _core.address(shard):
                mine.copy_(shard)
            others = [q for q in range(H) if q != h]
            self._exchange([(q, mine) for q in others], [(q, blocks[q, l]) for q in others])
            self._shm_wait([self.intra.all_gather(blocks[q], blocks[q, l], threads)
                            for q in range(H)])

        return self.submit("all_gather", run)

    def _reduce_scatter_body(self, out: torch.Tensor, inp: torch.Tensor, scale: float,
                             threads: int) -> None:
        H, k, h = self.hosts, self.per_host, self.host
        n = out.numel()
        parts = torch.empty(H, n, dtype=out.dtype)
        self._shm_wait([self.intra.reduce_scatter(parts[q], inp[q * k * n:(q + 1) * k * n],
                                                  1.0, threads)
                        for q in range(H)])
        got = torch.empty(H, n, dtype=out.dtype)
        others = [q for q in range(H) if q != h]
        self._exchange([(q, parts[q]) for q in others], [(q, got[q]) for q in others])
        got[h] = parts[h]
        _core.shm_reduce(out, list(got.unbind(0)), scale)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, scale: float,
                       threads: int) -> LaneWork:
        return self.submit("reduce_scatter",
                           lambda: self._reduce_scatter_body(out, inp, scale, threads))

    def all_reduce(self, t: torch.Tensor, scale: float, threads: int) -> LaneWork:
        W = self.hosts * self.per_host
        N = t.numel()
        m = -(-N // W)

        def run() -> None:
            if m * W == N:
                buf = t
            else:
                buf = torch.zeros(m * W, dtype=t.dtype)
                buf[:N] = t
            mine = torch.empty(m, dtype=t.dtype)
            self._reduce_scatter_body(mine, buf, scale, threads)
            blocks = buf.view(self.hosts, self.per_host, m)
            blocks[self.host, self.local] = mine
            others = [q for q in range(self.hosts) if q != self.host]
            own = blocks[self.host, self.local]
            self._exchange([(q, own) for q in others],
                           [(q, blocks[q, self.local]) for q in others])
            self._shm_wait([self.intra.all_gather(blocks[q], blocks[q, self.local], threads)
                            for q in range(self.hosts)])
            if buf is not t:
                t.copy_(buf[:N])

        return self.submit("all_reduce", run)

    def broadcast(self, t: torch.Tensor, root: int, threads: int) -> LaneWork:
        k = self.per_host
        root_host, root_local = divmod(root, k)

        def run() -> None:
            if self.local == root_local:
                if self.host == root_host:
                    self._exchange([(q, t) for q in range(self.hosts) if q != root_host], [])
                else:
                    self._exchange([], [(root_host, t)])
            self._shm_wait([self.intra.broadcast(t, root_local, threads)])

        return self.submit("broadcast", run)


    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[Sequence[int]],
                   threads: int) -> LaneWork:
        H, k, h, l = self.hosts, self.per_host, self.host, self.local
        W, me = H * k, self.rank
        C = [[int(c) for c in row] for row in counts]
        _, sent, got = _core.counts_blob(C, W, me)
        if inp.numel() != sent or out.numel() != got:
            raise ValueError(f"all_to_all: rank {me} sends {sent} and receives {got} elements "
                             f"by the counts, but the input has {inp.numel()} and the output "
                             f"{out.numel()}")
        g = lambda hh, ll: hh * k + ll  # noqa: E731 - group rank of (host, local rank)
        sdisp = [sum(C[me][:r]) for r in range(W)]
        rdisp = [sum(C[s][me] for s in range(q)) for q in range(W)]
        # stage 1, inside the host: local rank l1 gets from each host-mate l0 its blocks for
        # (h', l1) for every host h', ordered by h'
        c1 = [[sum(C[g(h, l0)][g(q, l1)] for q in range(H)) for l1 in range(k)]
              for l0 in range(k)]

        def run() -> None:
            send1 = torch.cat([inp.narrow(0, sdisp[g(q, l1)], C[me][g(q, l1)])
                               for l1 in range(k) for q in range(H)]) if sent else inp
            recv1 = torch.empty(sum(c1[l0][l] for l0 in range(k)), dtype=out.dtype)
            self._shm_wait([self.intra.all_to_all(recv1, send1, c1, threads)])
            # recv1: for each host-mate l0, for each host h', the block (h, l0) -> (h', l)
            at, piece = 0, {}
            for l0 in range(k):
                for q in range(H):
                    n = C[g(h, l0)][g(q, l)]
                    piece[l0, q] = recv1.narrow(0, at, n)
                    at += n
            # stage 2, between hosts, with the rank of local index l on each other host: all
            # of this host's blocks for it, sender order; theirs for this rank land in place
            # (out is in sender order, and host q's senders are contiguous)
            others = [q for q in range(H) if q != h]
            sends = [(q, torch.cat([piece[l0, q] for l0 in range(k)])) for q in others]
            recvs = [(q, out.narrow(0, rdisp[g(q, 0)],
                                    sum(C[g(q, l0)][me] for l0 in range(k)))) for q in others]
            self._exchange(sends, recvs)
            for l0 in range(k):
                out.narrow(0, rdisp[g(h, l0)], C[g(h, l0)][me]).copy_(piece[l0, h])

        return self.submit("all_to_all", run)


class _Waits:
    """One exchange's posted works ``[(host, work)]``, handed to the waiter; ``done`` once
    all are waited for, ``error`` the first failure."""

    __slots__ = ("posted", "done", "error")

    def __init__(self, posted: list):
        self.posted = posted
        self.done = threading.Event()
        self.error: Optional[_PeerError] = None


class _HostFailed(Exception):
    """This host's segment recorded a failure (``cause``, the failing rank's message) while
    the lane waited on the exchange with the peers on ``hosts``."""

    def __init__(self, hosts: list, cause: str):
        super().__init__(cause)
        self.hosts, self.cause = hosts, cause


class _PeerError(Exception):
    """A send/recv with ``global_rank`` on host index ``host`` failed with ``cause``."""

    def __init__(self, global_rank: int, host: int, cause: BaseException):
        super().__init__(str(cause))
        self.global_rank, self.host, self.cause = global_rank, host, cause

