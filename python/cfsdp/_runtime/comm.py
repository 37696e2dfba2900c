"""The collective engine: plain functions over a process group.

Every rank issues a unit's collectives in the same order; each function
returns a :class:`Pending` to wait on.  Gloo and NCCL both execute the
collectives of one process group in issue order, so an asynchronous
all-gather issued for prefetching is complete before a later collective's
result is used.

Transports
----------
Two transports serve these functions, picked automatically per group and per
call:

* **shared memory** (``csrc/shm.c`` on the ordered work queue of
  ``csrc/queue.c``): one POSIX shm segment per group and one C worker thread
  per group (the CPU analogue of a CUDA stream).  Ops run in issue order on
  the worker, without the GIL, so they overlap compute; ``Pending.wait()``
  sleeps (GIL released) until the op is done and raises ``RuntimeError`` with
  the op's message if it failed.  A wait inside a collective is bounded by the
  group's timeout (``group``'s gloo timeout, else torch's default); a peer that
  dies or stalls is an error on every rank naming the group, the op and the
  rank, and after an error the group is poisoned (every later op on it fails
  with the first error).
* **the process group** (gloo), exactly as before, for everything else.

Rule.  A call goes through shared memory when all of these hold, else through
the process group:

1. the C core is in use (``CFSDP_IMPL=c``) and ``CFSDP_SHM`` is not ``"0"``
   (set both the same on every rank; torchrun passes one environment);
2. the group has at least 2 ranks, all on this host: hostname and
   ``/proc/sys/kernel/random/boot_id`` are exchanged once through the store
   when the group's first collective is issued (``uses_shm`` does the same);
3. every tensor of the call is a contiguous CPU tensor that may cross into C
   (``_core.c_tensor_ok``: no ``DTensor`` or other subclass) of one dtype among
   float32, float64, bfloat16, float16;
4. the reduction (``op``) is SUM or AVG (anything else: the process group);
5. no ``TorchDispatchMode`` is active (see Visibility).

Set-up is lazy and collective-safe (all ranks of a group issue collectives in
the same order): on the group's first collective, through the default store
under the prefix ``cfsdp_shm/<group_name>/``, group rank 0 creates a segment
named ``/cfsdp-<pid>-<random>`` (``O_EXCL``), publishes the name, the others
attach, every rank checks in and rank 0 unlinks the name: nothing stays in
``/dev/shm``, even if the job is killed later.  ``CFSDP_SHM_SLOT_BYTES``
(default 1 MiB, a multiple of 64) sets the bytes per rank and half buffer;
larger tensors are processed in pieces of that size, double-buffered.

Ordering between the transports on one group: an op that takes the process
group first drains the group's shared-memory queue, and a shared-memory op
first waits for the group's last asynchronous process-group op, so the issue
order holds across both.

Numerics.  Shared-memory sums run over the ranks in rank order in float32
(float64 for float64; bf16/fp16 widen exactly, so they are *not* rounded per
addition as gloo's bf16 sums are) and round once; every rank of an all-reduce
gets the same bits.  ``scale`` (and AVG, which is ``scale = 1/W``) multiplies
the sum before that single rounding.  On the process group ``scale`` is a
separate ``mul_`` after the collective.  All-gather and broadcast are byte
copies, identical on both transports.

One rank.  A group of one rank needs no transport: every function does its
local equivalent at once (a copy, the chunk copy, the scale), in either
implementation.  ``fully_shard`` on one process, or the shard dimension of an
HSDP mesh with one rank per shard group, then pays no collective at all.

Visibility.  Every function runs inside a ``torch.profiler`` range named
``cfsdp::<function>`` (``cfsdp::all_gather``, ``cfsdp::reduce_scatter_pack``, ...) while
the profiler is on, whichever transport it takes.  A ``TorchDispatchMode`` (torch's
``CommDebugMode``, ...) sees torch's collective ops only, so while one is active every
call takes the process group, one-rank groups included: the mode then counts cfsdp's
collectives under torch's own ops (``c10d._allgather_base_``, ``_reduce_scatter_base_``,
``allreduce_``), exactly as it counts torch's FSDP's.

Twin.  Under ``CFSDP_IMPL=python`` (the pure-Python twins) every call takes
the process group: the process group is the shared-memory transport's twin,
and tests/distributed/test_shm.py compares the two on the same data; the sum
kernel's own twin is ``cfsdp._ref.shm_reduce``.
"""

from __future__ import annotations

import array
import atexit
import functools
import os
import secrets
import socket
import weakref
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .. import _core

SHM_ENV = "CFSDP_SHM"
SHM_SLOT_ENV = "CFSDP_SHM_SLOT_BYTES"
DEFAULT_SLOT_BYTES = 1 << 20
_SHM_DTYPES = frozenset((torch.float32, torch.float64, torch.bfloat16, torch.float16))
# what every backend's all-gather takes as it is; other dtypes (float8, ...) travel as bytes
_PG_DTYPES = frozenset((*_SHM_DTYPES, torch.int8, torch.uint8, torch.int16, torch.int32,
                        torch.int64, torch.bool))
_STORE_PREFIX = "cfsdp_shm"


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


class _GroupState:
    """What this process knows of one group: its shared-memory view (or None:
    the group uses the process group) and its last async process-group op."""

    __slots__ = ("shm", "last_pg", "__weakref__")

    def __init__(self, shm: Optional[Any]):
        self.shm = shm
        self.last_pg: Optional[Any] = None


_states: "weakref.WeakKeyDictionary[Any, _GroupState]" = weakref.WeakKeyDictionary()
_all_shm: "weakref.WeakSet[_GroupState]" = weakref.WeakSet()


def _resolve(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    return group if group is not None else dist.distributed_c10d._get_default_group()


def group_timeout(group: dist.ProcessGroup) -> float:
    """The group's timeout in seconds (its gloo backend's, else torch's default)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d.default_pg_timeout.total_seconds()


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}|{boot}"


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


def _shm_enabled() -> bool:
    C = _core._C
    return (C is not None and bool(getattr(C, "SHM_AVAILABLE", 0))
            and os.environ.get(SHM_ENV, "1").strip() != "0")


def _setup(group: dist.ProcessGroup) -> Optional[Any]:
    """The group's ShmGroup, or None when it must use the process group (see the
    module doc).  Collective: every rank of the group calls it at the same point."""
    if not _shm_enabled():
        return None
    world = dist.get_world_size(group)
    if world < 2 or world > _core._C.SHM_MAX_WORLD:
        return None
    rank = dist.get_rank(group)
    timeout = group_timeout(group)
    wait_for = timedelta(seconds=timeout)
    store = dist.PrefixStore(f"{_STORE_PREFIX}/{group.group_name}/",
                             dist.distributed_c10d._get_default_store())
    store.set(f"host/{rank}", _host_id())
    keys = [f"host/{r}" for r in range(world)]
    store.wait(keys, wait_for)
    hosts = {store.get(k).decode() for k in keys}
    if len(hosts) != 1:
        return None
    slot = _slot_bytes()
    ranks = dist.get_process_group_ranks(group)
    label = f"{group.group_name}"
    if rank == 0:
        name = f"/cfsdp-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            shm = _core._C.ShmGroup(name, True, world, 0, slot, timeout, label, ranks)
        except (RuntimeError, ValueError) as e:
            store.set("name", "error:" + str(e))
            raise RuntimeError(
                f"cfsdp: cannot set up shared memory for group {label!r}: {e} (set "
                f"{SHM_ENV}=0 to use the process group, or a smaller {SHM_SLOT_ENV})"
            ) from e
        store.set("name", name)
    else:
        store.wait(["name"], wait_for)
        name = store.get("name").decode()
        if name.startswith("error:"):
            raise RuntimeError(
                f"cfsdp: group rank 0 could not set up shared memory for group {label!r}: "
                f"{name[6:]}"
            )
        shm = _core._C.ShmGroup(name, False, world, rank, slot, timeout, label, ranks)
    shm.wait_attached()
    return shm


def _state(group: dist.ProcessGroup) -> _GroupState:
    st = _states.get(group)
    if st is None:
        st = _GroupState(_setup(group))
        _states[group] = st
        if st.shm is not None:
            _all_shm.add(st)
    return st


def uses_shm(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether ``group``'s eligible collectives go through shared memory.  Sets the
    group up on the first call, like its first collective: call it on every rank."""
    st = _state(_resolve(group))
    return st.shm is not None and not st.shm.closed


def release(group: Optional[dist.ProcessGroup] = None) -> None:
    """Close ``group``'s shared-memory view (worker thread joined, segment unmapped)
    and forget it; its next collective sets it up again.  Wait on its pending ops
    first: ops still queued fail.  Call on every rank (e.g. before destroying the
    process group).  A no-op for a group never set up."""
    st = _states.pop(_resolve(group), None)
    if st is not None and st.shm is not None:
        st.shm.close()


@atexit.register
def _close_all() -> None:
    for st in list(_all_shm):
        if st.shm is not None:
            st.shm.close()


def _is_sum_or_avg(op) -> Optional[bool]:
    """True for AVG, False for SUM, None for any other reduction."""
    if op == dist.ReduceOp.SUM:
        return False
    if op == dist.ReduceOp.AVG:
        return True
    return None


def _shm_ok(t: torch.Tensor) -> bool:
    return _core.c_tensor_ok(t) and t.dtype in _SHM_DTYPES


def _dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` (e.g. ``CommDebugMode``) is on: see Visibility."""
    return torch._C._len_torch_dispatch_stack() > 0


def _shm_for(group: dist.ProcessGroup, *tensors: torch.Tensor, op=dist.ReduceOp.SUM,
             other: Optional[torch.Tensor] = None) -> Optional[_GroupState]:
    """The group's state if this call goes through shared memory (rules 3 to 5 of
    the module doc: ``tensors`` of one eligible dtype, ``other`` eligible in its own
    dtype, ``op`` SUM or AVG, no dispatch mode), else None, after draining the group's
    shared-memory queue, so the process-group op comes after every earlier one."""
    st = _state(group)
    shm = st.shm
    if shm is None or shm.closed:
        return None
    dtype = tensors[0].dtype
    if (not _dispatch_mode_active() and all(_shm_ok(t) and t.dtype == dtype for t in tensors)
            and (other is None or _shm_ok(other)) and _is_sum_or_avg(op) is not None):
        if st.last_pg is not None:
            st.last_pg.wait()
            st.last_pg = None
        return st
    shm.drain()
    return None


def _pg_issued(group: dist.ProcessGroup, work: Optional[Any]) -> None:
    st = _states.get(group)
    if st is not None and st.shm is not None:
        st.last_pg = work


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


def _shm_scale(st: _GroupState, avg: bool, scale: Optional[float]) -> float:
    """The one factor the shared-memory sum is multiplied by (AVG is 1/W)."""
    return (1.0 if scale is None else float(scale)) / (st.shm.world_size if avg else 1)


def _solo(group: dist.ProcessGroup) -> bool:
    """A group of one rank: its collectives are local (see "One rank"), unless a
    dispatch mode wants to see them (see Visibility)."""
    return group.size() == 1 and not _dispatch_mode_active()


def _traced(name: str):
    """Run the collective inside a profiler range ``cfsdp::<name>`` while the profiler is
    on (one flag check otherwise): see Visibility."""
    label = f"cfsdp::{name}"

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not torch.autograd._profiler_enabled():
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
# the collectives
# --------------------------------------------------------------------------------------


@_traced("all_gather")
def all_gather(
    out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> Pending:
    """Gather every rank's ``shard`` into ``out`` (``world_size * shard.numel()``)."""
    group = _resolve(group)
    if _solo(group):
        _check_blocks("all_gather", "output", out, shard, 1)
        out.copy_(shard)
        return Pending(None)
    st = _shm_for(group, out, shard)
    if st is not None:
        _check_blocks("all_gather", "output", out, shard, st.shm.world_size)
        work = st.shm.all_gather(out.data_ptr(), shard.data_ptr(), shard.numel(),
                                 _core.DTYPE_CODES[out.dtype], torch.get_num_threads(),
                                 (out, shard))
        return _shm_done(work, async_op, out, shard)
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old
    # name warns); look it up per call so torch>=2.9 works and tools that patch
    # torch.distributed (our collective-order test) see the call.
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if out.dtype not in _PG_DTYPES:  # e.g. float8: a byte copy, as torch's FSDP2 does it
        out, shard = out.view(torch.uint8), shard.view(torch.uint8)
    work = ag(out, shard, group=group, async_op=async_op)
    _pg_issued(group, work)
    return Pending(work, out, shard)


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
    group = _resolve(group)
    if _solo(group):
        _core.chunk_unpack(natural, shard, plan, 1, shard.numel())
        return Pending(None)
    st = _shm_for(group, natural, shard)
    if st is not None:
        work = st.shm.all_gather_unpack(
            natural.data_ptr(), natural.numel(), shard.data_ptr(), shard.numel(),
            _core.DTYPE_CODES[natural.dtype], plan_bytes, torch.get_num_threads(),
            (natural, shard, plan_bytes))
        return _shm_done(work, async_op, natural, shard)
    W = dist.get_world_size(group)
    gathered = torch.empty(W * shard.numel(), dtype=shard.dtype, device=shard.device)
    pending = all_gather(gathered, shard, group, async_op=True)

    def unpack() -> None:
        _core.chunk_unpack(natural, gathered, plan, W, shard.numel())

    p = Pending(pending.work, natural, shard, gathered, post=unpack)
    if not async_op:
        p.wait()
    return p


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
    group = _resolve(group)
    if _solo(group):  # any reduction over one rank is the identity
        _core.chunk_pack(out, natural.contiguous(), plan, 1, out.numel(), divisor=divisor)
        return Pending(None)
    avg = _is_sum_or_avg(op)
    st = _shm_for(group, out, op=op, other=natural)
    if st is not None:
        work = st.shm.reduce_scatter_pack(
            out.data_ptr(), out.numel(), _core.DTYPE_CODES[out.dtype], natural.data_ptr(),
            natural.numel(), _core.DTYPE_CODES[natural.dtype], float(divisor),
            _shm_scale(st, avg, None), plan_bytes, torch.get_num_threads(),
            (out, natural, plan_bytes))
        return _shm_done(work, async_op, out, natural)
    W = dist.get_world_size(group)
    inp = torch.empty(W * out.numel(), dtype=out.dtype, device=out.device)
    _core.chunk_pack(inp, natural.contiguous(), plan, W, out.numel(), divisor=divisor)
    return reduce_scatter(out, inp, group, async_op, op=op)


@_traced("reduce_scatter")
def reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, async_op: bool,
    op=dist.ReduceOp.SUM, scale: Optional[float] = None,
) -> Pending:
    """Reduce ``inp`` over ranks (sum, or ``op``) and keep this rank's chunk in ``out``,
    multiplied by ``scale`` if given (fused into the sum on shared memory)."""
    group = _resolve(group)
    if _solo(group):
        _check_blocks("reduce_scatter", "input", inp, out, 1)
        out.copy_(inp.view_as(out))
        return _scaled(None, out, scale, False)
    avg = _is_sum_or_avg(op)
    st = _shm_for(group, out, inp, op=op)
    if st is not None:
        _check_blocks("reduce_scatter", "input", inp, out, st.shm.world_size)
        work = st.shm.reduce_scatter(out.data_ptr(), inp.data_ptr(), out.numel(),
                                     _core.DTYPE_CODES[out.dtype], _shm_scale(st, avg, scale),
                                     torch.get_num_threads(), (out, inp))
        return _shm_done(work, async_op, out, inp)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = rs(out, inp, op=op, group=group, async_op=async_op)
    _pg_issued(group, work)
    return _scaled(work, out, scale, async_op, inp)


@_traced("all_reduce")
def all_reduce(
    t: torch.Tensor, group: dist.ProcessGroup, async_op: bool, op=dist.ReduceOp.SUM,
    scale: Optional[float] = None,
) -> Pending:
    """Reduce ``t`` (sum, or ``op``) over the ranks of ``group``, in place, multiplied
    by ``scale`` if given (fused into the sum on shared memory)."""
    group = _resolve(group)
    if _solo(group):
        return _scaled(None, t, scale, False)
    avg = _is_sum_or_avg(op)
    st = _shm_for(group, t, op=op)
    if st is not None:
        work = st.shm.all_reduce(t.data_ptr(), t.data_ptr(), t.numel(),
                                 _core.DTYPE_CODES[t.dtype], _shm_scale(st, avg, scale),
                                 torch.get_num_threads(), (t,))
        return _shm_done(work, async_op, t)
    work = dist.all_reduce(t, op=op, group=group, async_op=async_op)
    _pg_issued(group, work)
    return _scaled(work, t, scale, async_op)


@_traced("broadcast")
def broadcast(
    t: torch.Tensor, src_rank_in_group: int, group: dist.ProcessGroup, async_op: bool = False
) -> Pending:
    """Broadcast ``t`` in place from the group's rank ``src_rank_in_group``."""
    group = _resolve(group)
    if _solo(group):
        return Pending(None)
    st = _shm_for(group, t)
    if st is not None:
        work = st.shm.broadcast(t.data_ptr(), t.numel(), _core.DTYPE_CODES[t.dtype],
                                int(src_rank_in_group), torch.get_num_threads(), (t,))
        return _shm_done(work, async_op, t)
    work = dist.broadcast(t, group=group, group_src=src_rank_in_group, async_op=async_op)
    _pg_issued(group, work)
    return Pending(work, t)
