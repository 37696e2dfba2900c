"""The parameter sync of cfsdp's ZeroRedundancyOptimizer: rank-major flat buckets, one
per host where the ranks share memory.

[Note: ZeRO buckets]
The parameters are grouped by (device, dtype).  For each group a :class:`RankMajor`
layout puts the parameters each rank owns, in partition order (the param groups in
order, each group's parameters as torch's sorted-greedy partition lists them: the order
of torch's own buckets and of the local optimizer's parameters), one after the other in
that rank's *segment*.  Every segment has the same length ``seg`` (the largest rank's
total, rounded up to 64 bytes; the rest of a shorter segment is padding), and the W
segments, rank after rank, form one flat buffer of ``W * seg`` elements: exactly an
all-gather whose input is this rank's segment.

* ``parameters_as_bucket_view=True`` (:class:`BucketViews`): the flat buffer is
  allocated once and every parameter in it becomes a view of its place (``p.data =
  flat[o:o + n].view_as(p)``), as torch's buckets do (torch keeps one buffer per rank;
  cfsdp one for all ranks, and within a host one for all the host's ranks: see [Note:
  ZeRO shared bucket]).  A view keeps its parameter's strides when the parameter is
  dense but not contiguous (a transposed weight stays transposed, its elements in memory
  order): DDP computes wrong gradients for a parameter whose strides change after it was
  wrapped, which torch's contiguous bucket views do.  The owner's step writes its segment
  in place, so the sync
  is ONE all-gather, in place: ``comm.all_gather(flat, flat[segment])`` -- shared memory
  within a host, the process group across hosts or with ``CFSDP_SHM=0`` (the rule of
  ``cfsdp._runtime.comm``).  Only trainable parameters are in buckets (torch's rule: a
  frozen parameter keeps memory of its own, a clone if it was in a bucket, and is not
  synced).
* ``parameters_as_bucket_view=False`` (:class:`StagedSync`; torch's default, and its
  promise that each ``p.data`` stays intact): the same layout over every parameter,
  frozen ones included (torch broadcasts those too), through a staging buffer of at most
  ``STAGING_BYTES``.  The segment is cut in windows of ``win`` elements; per window each
  rank packs its parameters' elements into its block (``_core.shard_fill``: one C pass,
  padding zeroed), one all-gather, and the other ranks' elements are copied out into
  their parameters (``torch._foreach_copy_``: one call).  Memory stays bounded and the
  bytes moved are the all-gather's.  A non-contiguous parameter (rare: a transposed
  tensor made a parameter) cannot take a flat window; it is synced by a broadcast of its
  own from its owner.

Either way the sync is byte copies: every rank ends with the owner's bits.

[Note: ZeRO duplicate parameters]
A parameter listed twice in a group (torch's Optimizer warns and keeps both copies) is
partitioned like two parameters: each copy goes to some rank, and every rank holding a
copy steps it, once per copy (its local optimizer has the duplicate too).  Which rank's
result everybody then gets is what torch's sync gives, and it differs by mode:

* bucket views: torch builds every rank's bucket in rank order and points ``p.data`` at
  each copy in turn, so ``p`` lives in the bucket of the *last* rank holding it; that
  rank's broadcast comes last: its result wins.  cfsdp's views do the same (the last
  place), and the private bucket's all-gather gives every rank that segment.  A host-
  shared bucket cannot (every holder would step the same memory: two steps, or more), so
  a layout with a parameter on two ranks takes private buckets;
* per-parameter broadcasts (no bucket views): torch broadcasts each rank's parameters in
  rank order, in place, so the *first* rank holding ``p`` sends its result, which
  overwrites the later holders' own before they send it on: the first holder's result
  wins.  :class:`StagedSync` copies ``p`` out of the first holder's block only (a later
  holder too), and an :class:`OwnBroadcast` is from the first holder.

[Note: ZeRO shared bucket]
With bucket views, when every rank of the group is on this host and the group takes ONE
shared-memory segment (``comm.one_segment``: the C core, ``CFSDP_SHM`` not ``0``, one
host key, the set-up proved; never two levels, never the process group, never one rank),
the flat buffer of each CPU (device, dtype) is one mapping shared by the group's ranks:
every rank's parameters are views of the same memory, held once per host instead of once
per rank.  Each owner's local step writes its segment in place and the sync copies
nothing; it only orders (the optimizer's ``step()``, ``zero.py``):

* a barrier before the local step (every rank has finished reading the parameters: its
  forward, backward and whatever it does with them before ``step()``); its payload says
  whether any rank must rebuild its buckets (trainability changed, a parameter moved), so
  every rank rebuilds, collectively, or none does;
* a barrier after it (every owner's writes are seen by every rank before its next
  forward).  Both are one-element all-reduces on the segment (``comm.all_reduce``: tens of
  microseconds);
* a closure is evaluated before the first barrier, and the local optimizer then steps
  without it (its step pre-hooks, if any, run after the closure).  That is what ``step(closure)`` does for the optimizers of
  ``zero._CLOSURE_FIRST`` (torch.optim's but LBFGS, cfsdp.optim's); any other
  ``optimizer_class`` (LBFGS re-evaluates the closure between writes, a custom ``step``
  may do anything) gets private buckets.

The other paths need nothing more: ``load_state_dict`` and consolidation move optimizer
state only, ZeRO-2's ``reduce_scatter_hook`` writes gradients only, a ``Join`` shadow step
is a ``step()`` (both barriers, matching the others'), and the staging path (no bucket
views) is unchanged.

Making the mapping (``_shared_flat``), collectively, at construction and every rebuild
(``add_param_group``, trainability changes, moved parameters):

1. group rank 0 creates ``SHM_DIR/cfsdp-<pid>-<16 random hex digits>-zero`` (``O_EXCL``,
   ``O_NOFOLLOW``, mode 0600, its pages reserved with ``posix_fallocate``: no SIGBUS later
   for a full ``/dev/shm``), the bucket's bytes followed by a random 64-byte nonce, and
   broadcasts its *name*;
2. every rank takes the name only in that form (no path, no ``..``), opens
   ``SHM_DIR/<name>`` with ``O_NOFOLLOW`` (never creating it: a private ``/dev/shm`` must
   not get one), refuses it unless ``fstat`` shows a regular file of its own effective
   uid with no group or other permission bits, checks its size against its own layout and
   maps it ``MAP_SHARED`` through that descriptor (never by name again) -- all of this the
   host-shared segment facility of the C core (``_core.ShmSegment``, ``cf_shm_map_file``:
   the checks of comm.py's "Trust", the one every segment of cfsdp goes through; group
   rank 0 made the file with it too) --, checks the nonce, and
   writes ONLY its own segment (its private values: the rest of the file is other
   ranks');
3. an all-reduce agrees that every rank did (and is the barrier after the writes), and
   counts the ranks that refused the name or the file; the creator then unlinks the
   name, so nothing is left in ``/dev/shm`` after this point even if a rank is killed;
   the mapping lives as long as views of it do;
4. every rank compares the shared bucket with its private one, bitwise (as integers), and
   an all-reduce agrees that all are equal.  torch's ZeRO leaves each rank's values as
   they are until the first step's broadcast, so where the ranks' initial values differ
   (no DDP broadcast before the optimizer), one shared copy would change the first
   forward's numbers: private buckets then.

A refusal in step 2 (a file of another user, a symbolic link, group or other permission
bits, a name of another form) is a ``PermissionError`` on every rank naming each
refusing rank's path, owner and mode: someone who is not the job made that file, and a
fallback would hide it (comm.py's "Trust").  Any other "no" in steps 1 to 4 gives every
rank its private bucket (today's path: the all-gather), at once; group rank 0 logs the
reason once per process (WARNING).  The
shared bucket changes no number: the local steps read and write the same values, the sync
copies the owners' bits in both cases.  One visible difference: a write to a parameter
outside ``step()`` (``model.load_state_dict``, an in-place op) is seen by every rank of
the host at once (torch's ZeRO: that rank's copy only, until the next step's broadcast);
ranks that write the same values, the normal case, see no difference.

Addresses.  Both keep per-parameter addresses (bucket views: where each view must be;
staged: where the copy-out writes).  ``moved()`` says whether any parameter's memory
is no longer where it was (``model.to(...)``, ``p.data = t``); the optimizer then
rebuilds the layout from the parameters' current values, so a stale address is never
written.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _core
from .._runtime import comm
from .._runtime.agree import agree

_ALIGN_BYTES = 64
STAGING_BYTES = 32 << 20  # StagedSync's staging buffer, all ranks' blocks together
SHM_DIR = "/dev/shm"  # where a shared bucket's file is made (a module variable: tests move it)
_FILE_NAME = re.compile(r"cfsdp-[0-9]+-[0-9a-f]{16}-zero")  # what group rank 0 makes
_NONCE_BYTES = 64  # after the bucket's elements in its file: proves the mapping is shared
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_log = logging.getLogger(__name__)
_logged: set = set()  # the fallback reasons already logged by this process


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive places in some dimension
    order (non-overlapping and dense: a permuted contiguous tensor, e.g. a transpose)."""
    expected = 1
    dims = sorted(((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1))
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True)
class Place:
    """One parameter's place in a :class:`RankMajor` layout."""

    param: Tensor
    rank: int  # its owner
    offset: int  # in the owner's segment
    numel: int


class RankMajor:
    """Where each parameter of one (device, dtype) sits in the rank-major flat layout.

    ``per_rank[r]`` lists rank r's parameters in partition order; ``places[r]`` their
    places; ``seg`` the common segment length (elements); ``numel = world_size * seg``."""

    def __init__(self, per_rank: list[list[Tensor]]):
        first = next(p for ps in per_rank for p in ps)
        self.dtype, self.device = first.dtype, first.device
        self.world_size = len(per_rank)
        self.places: list[list[Place]] = []
        totals = []
        for r, ps in enumerate(per_rank):
            off, row = 0, []
            for p in ps:
                row.append(Place(p, r, off, p.numel()))
                off += p.numel()
            self.places.append(row)
            totals.append(off)
        self.elem_size = first.element_size()
        self.align = max(1, _ALIGN_BYTES // self.elem_size)
        self.seg = _round_up(max(totals), self.align)
        self.numel = self.world_size * self.seg

    def params(self) -> list[Tensor]:
        return [pl.param for row in self.places for pl in row]


def _views(layout: RankMajor, flat: Tensor) -> list[Tensor]:
    """Each parameter's view of its place in ``flat`` (``layout.places`` order); a dense
    non-contiguous parameter keeps its strides."""
    seg, out = layout.seg, []
    for r, row in enumerate(layout.places):
        for pl in row:
            view = flat[r * seg + pl.offset : r * seg + pl.offset + pl.numel]
            p = pl.param
            if p.numel() and not p.is_contiguous() and _dense(p):  # its strides
                out.append(view.as_strided(p.shape, p.stride()))
            else:
                out.append(view.view(p.shape))
    return out


def _count(flags: list, group: Any) -> list:
    """How many ranks of ``group`` say each of ``flags``; a collective, hence also a
    barrier."""
    t = torch.tensor([1.0 if f else 0.0 for f in flags])
    comm.all_reduce(t, group, async_op=False)
    return [int(v) for v in t.tolist()]


def _agree(ok: bool, group: Any) -> bool:
    """Whether every rank of ``group`` says ``ok``; a collective, hence also a barrier."""
    return _count([ok], group)[0] == dist.get_world_size(group)


def _log_once(rank: int, why: str) -> None:
    key = why.split(" (")[0]  # one line per kind of reason, whatever its file or rank
    if rank == 0 and key not in _logged:
        _logged.add(key)
        _log.warning("cfsdp ZeroRedundancyOptimizer: private parameter buckets per rank "
                     "(not one shared bucket per host): %s", why)


def _attach(path: str, nbytes: int) -> _core.ShmSegment:
    """The bucket's file ``path`` mapped through the segment facility
    (``_core.ShmSegment``: opened with ``O_NOFOLLOW``, never created, refused unless it is
    this job's, exactly ``nbytes``): ``PermissionError`` (no errno) naming its path, type,
    owner and mode if it is not this job's; ``RuntimeError``/``ValueError`` if it cannot
    be mapped."""
    return _core.ShmSegment(path, False, nbytes)


def _map_shared(layout: RankMajor, rank: int, group: Any
                ) -> tuple[Optional[Tensor], str, str, bool]:
    """[Note: ZeRO shared bucket], steps 1 and 2: group rank 0 makes the file, every rank
    maps it and checks the nonce.  ``(this rank's mapping as uint8 or None, the file's
    path or "", why not, whether it was refused as not this job's)``; the creator unlinks
    the file after the caller's agreement."""
    nbytes = layout.numel * layout.elem_size
    info = ["", "", ""]  # file name, nonce (hex), error
    if rank == 0:
        name = f"cfsdp-{os.getpid()}-{secrets.token_hex(8)}-zero"
        path = os.path.join(SHM_DIR, name)
        nonce = secrets.token_bytes(_NONCE_BYTES)
        try:  # (a failed creation leaves no file: the facility unlinks it)
            made = _core.ShmSegment(path, True, nbytes + _NONCE_BYTES).tensor()
            made[nbytes:].copy_(torch.frombuffer(bytearray(nonce), dtype=torch.uint8))
            del made  # unmapped: every rank (this one too) maps it by name below
            info = [name, nonce.hex(), ""]
        except (OSError, RuntimeError, ValueError) as e:
            info[2] = f"group rank 0 could not make {path}: {e}"
    box = [info]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    name, nonce_hex, err = box[0]
    if err:
        return None, "", err, False
    if not _FILE_NAME.fullmatch(name):  # no path, no "..": only what rank 0 makes
        return None, "", (f"cfsdp: refused the shared bucket's file name {name[:80]!r} "
                          f"from group rank 0: not of the form cfsdp-<pid>-<16 hex "
                          f"digits>-zero, the only one it makes, so someone else wrote it. "
                          f"Another user of this machine may be attacking the job: find "
                          f"who, keep other users off the rendezvous store's port, restart "
                          f"the job"), True
    path = os.path.join(SHM_DIR, name)  # each rank's own SHM_DIR
    try:
        m = _attach(path, nbytes + _NONCE_BYTES).tensor()
    except PermissionError as e:  # not this job's file
        return None, path, str(e), True
    except (OSError, RuntimeError, ValueError) as e:
        return None, path, f"group rank {rank} could not map {path}: {e}", False
    if bytes(m[nbytes:].numpy()) != bytes.fromhex(nonce_hex):
        return None, path, f"group rank {rank} maps {path} but sees another file", False
    return m, path, "", False


def _shared_flat(layout: RankMajor, rank: int, group: Any, private: Tensor
                 ) -> tuple[Optional[Tensor], str, str]:
    """[Note: ZeRO shared bucket]: one host-shared flat buffer holding ``private``'s
    values, or None, on every rank at once; with the (unlinked) file's path and why not.
    Collective over ``group``."""
    m, path, why, refused = _map_shared(layout, rank, group)
    seg, nbytes = layout.seg, layout.numel * layout.elem_size
    flat = None
    try:
        if m is not None:
            flat = m[:nbytes].view(layout.dtype)
            flat[rank * seg : (rank + 1) * seg].copy_(private[rank * seg : (rank + 1) * seg])
        # every rank mapped it and wrote its segment; how many refused it
        n_mapped, n_refused = _count([flat is not None, refused], group)
    finally:  # after the agreement, or when it raised (a peer died): nothing is left
        if rank == 0 and path:
            try:
                os.unlink(path)
            except OSError:  # in a finally: never hide the error that got us here; the
                pass         # mapping works unlinked or not, and the name is cfsdp-<pid>-...
    if n_refused:  # "Trust": an error on every rank, naming what each refused
        whys = agree(group, None, "ZeroRedundancyOptimizer: the shared bucket's refusals",
                     why if refused else None)
        bad = {r: w for r, w in enumerate(whys) if w is not None}
        raise PermissionError(
            f"cfsdp ZeroRedundancyOptimizer (group rank {rank}): group rank(s) {sorted(bad)} "
            f"refused to map the shared parameter bucket's file, which is not this job's: "
            + "; ".join(f"rank {r}: {w}" for r, w in sorted(bad.items())))
    if n_mapped != dist.get_world_size(group):
        return None, path, ("the bucket's file in " + SHM_DIR + " is not shared by every rank"
                      + (f" ({why})" if why else ""))
    as_int = _INT_OF_SIZE[layout.elem_size]
    if not _agree(torch.equal(flat.view(as_int), private.view(as_int)), group):
        return None, path, ("the ranks' initial parameter values differ (each rank keeps its own "
                      "until the first step, as torch's ZeRO)")
    return flat, path, ""


class BucketViews:
    """``parameters_as_bucket_view=True``: the parameters live in one flat buffer, this
    rank's own or, with ``group`` given, one shared by every rank of the group
    ([Note: ZeRO shared bucket]; ``shared`` says which it got)."""

    def __init__(self, layout: RankMajor, rank: int = 0, group: Any = None):
        self.layout = layout
        self.flat = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
        params = layout.params()
        with torch.no_grad():
            for p, view in zip(params, _views(layout, self.flat)):
                view.copy_(p.detach())
            self.shared, self.path = False, ""
            if group is not None:
                flat, self.path, why = _shared_flat(layout, rank, group, self.flat)
                if flat is None:
                    _log_once(rank, why)
                else:
                    self.flat, self.shared = flat, True
            for p, view in zip(params, _views(layout, self.flat)):
                p.data = view
        self._ptrs = [(p, _core.address(p)) for p in params]

    def holds(self, p: Tensor) -> bool:
        """Whether ``p``'s memory lies in this bucket buffer."""
        lo = _core.address(self.flat)
        return lo <= _core.address(p) < lo + self.flat.numel() * self.flat.element_size()

    def moved(self) -> bool:
        return any(_core.address(p) != ptr for p, ptr in self._ptrs)

    def sync(self, rank: int, group: Any) -> None:
        """The private bucket's all-gather; nothing for a shared one (its owners wrote
        their segments in place: the caller's barrier orders them)."""
        seg = self.layout.seg
        if seg and self.layout.world_size > 1 and not self.shared:
            comm.all_gather(self.flat, self.flat[rank * seg : (rank + 1) * seg], group,
                            async_op=False)


class StagedSync:
    """``parameters_as_bucket_view=False``: each parameter keeps its memory; the sync
    goes through a bounded staging buffer, window by window (see the module doc)."""

    def __init__(self, layout: RankMajor, rank: int):
        self.layout, self.rank = layout, rank
        W, seg = layout.world_size, layout.seg
        cap = STAGING_BYTES // (W * layout.elem_size)  # elements per rank's block
        self.win = min(seg, max(layout.align, cap // layout.align * layout.align))
        self.staging = (torch.empty(W * self.win, dtype=layout.dtype, device=layout.device)
                        if self.win else None)
        own = layout.places[rank]
        self._own = ([pl.param.detach() for pl in own], [pl.offset for pl in own])
        # where each parameter is copied from: its first holder's first place ([Note: ZeRO
        # duplicate parameters]); the first holder itself copies nothing
        source: dict = {}
        for row in layout.places:
            for pl in row:
                source.setdefault(id(pl.param), pl)
        self._rounds = []  # per window: (lo, n, dsts, srcs)
        for lo in range(0, seg, self.win or 1):
            n = min(self.win, seg - lo)
            dsts, srcs = [], []
            for q, row in enumerate(layout.places):
                if q == rank:
                    continue
                for pl in row:
                    if source[id(pl.param)] is not pl:
                        continue
                    s, e = max(pl.offset, lo), min(pl.offset + pl.numel, lo + n)
                    if e > s:
                        dsts.append(pl.param.detach().view(-1)[s - pl.offset : e - pl.offset])
                        srcs.append(self.staging[q * n + s - lo : q * n + e - lo])
            self._rounds.append((lo, n, dsts, srcs))
        self._ptrs = [(p, _core.address(p)) for p in layout.params()]

    def moved(self) -> bool:
        return any(_core.address(p) != ptr for p, ptr in self._ptrs)

    def sync(self, rank: int, group: Any) -> None:
        if self.staging is None or self.layout.world_size == 1:
            return
        srcs, offs = self._own
        with torch.no_grad():
            for lo, n, dsts, outs in self._rounds:
                block = self.staging[rank * n : (rank + 1) * n]
                _core.shard_fill(block, lo, srcs, offs)
                comm.all_gather(self.staging[: self.layout.world_size * n], block, group,
                                async_op=False)
                if dsts:
                    torch._foreach_copy_(dsts, outs)


class OwnBroadcast:
    """A parameter synced on its own: a broadcast from its owner (non-contiguous
    parameters under ``StagedSync``)."""

    def __init__(self, param: Tensor, owner: int):
        self.param, self.owner = param, owner

    def moved(self) -> bool:
        return False  # nothing is cached: the broadcast reads the parameter as it is

    def sync(self, rank: int, group: Any) -> None:
        with torch.no_grad():
            p = self.param
            buf = p.detach().contiguous() if rank == self.owner else torch.empty(
                p.shape, dtype=p.dtype, device=p.device)
            comm.broadcast(buf, self.owner, group, async_op=False)
            if rank != self.owner:
                p.copy_(buf)


def build_syncs(per_rank: list[list[Tensor]], rank: int, bucket_view: bool,
                old: Optional[list] = None, share: Any = None) -> list:
    """The syncs for a partition: ``per_rank[r]`` lists rank r's parameters to sync in
    partition order (bucket view: the trainable ones; else all).  One layout per
    (device, dtype), in order of first appearance (the same on every rank).  ``old``:
    the previous syncs, whose bucket buffers frozen parameters are cloned out of.
    ``share``: the group whose ranks may share the CPU buckets ([Note: ZeRO shared
    bucket]; a collective then), or None."""
    keys: dict = {}
    for r, ps in enumerate(per_rank):
        for p in ps:
            if not bucket_view and not p.is_contiguous():
                keys.setdefault(("own", id(p)), (p, r))
                continue
            keys.setdefault((p.device, p.dtype), [[] for _ in per_rank])[r].append(p)
    if bucket_view and old:
        synced = {id(p) for ps in per_rank for p in ps}
        with torch.no_grad():
            for s in old:
                if isinstance(s, BucketViews):
                    for p in s.layout.params():
                        if id(p) not in synced and s.holds(p):
                            p.data = p.data.detach().clone()
    out: list = []
    for key, v in keys.items():
        if key[0] == "own":
            out.append(OwnBroadcast(*v))
        else:
            layout = RankMajor(v)
            if not bucket_view:
                out.append(StagedSync(layout, rank))
            else:
                cpu = share is not None and layout.device.type == "cpu"
                if cpu and _on_two_ranks(v):  # [Note: ZeRO duplicate parameters]
                    _log_once(rank, "a parameter listed twice is stepped on two ranks (torch's "
                                    "sync keeps the last one's result)")
                    cpu = False
                out.append(BucketViews(layout, rank, share if cpu else None))
    return out


def _on_two_ranks(per_rank: list[list[Tensor]]) -> bool:
    """Whether some parameter is in the lists of two ranks (a duplicate)."""
    seen: dict = {}
    for r, ps in enumerate(per_rank):
        for p in ps:
            if seen.setdefault(id(p), r) != r:
                return True
    return False
