"""A recording device layer and a happens-before checker for cfsdp's stream protocol.

``RecordingDevice`` is a device layer ([Note: device layer] in ``cfsdp/_runtime/device.py``)
installed with ``cfsdp._runtime.device.use``: its streams are names with one sequential queue
each, and it logs, in program order, every stream op (``wait_stream``, ``record_event``,
``wait_event``), ``record_stream``, the runtime's ``free``/``alloc`` notifications, and every
tensor op the run executes (a ``TorchDispatchMode``), with the stream that was current when it
ran, the storages it read and wrote (an ``empty_like`` reads only its argument's metadata:
no access), and those it made.  While it is installed the runtime
takes the accelerator path (twins' torch ops, the process group), so every op is seen.

``check(log)`` replays the log with one vector clock per stream (``wait_event`` and
``wait_stream`` join clocks; an event's ``synchronize``, the CPU waiting for it, joins every
stream's clock, since all work issued after it starts after it) and raises :class:`RaceError` on:

* a read of a storage not ordered after the last write to it on another stream;
* a write not ordered after the prior reads and writes on other streams;
* a free not ordered (on the stream the storage was allocated on, or on a stream
  ``record_stream`` named, as that stream stands at the free) after every access on other
  streams;
* an allocation on a stream (an op's fresh output, an ``alloc``) not ordered after an access
  on another stream to a storage of that stream that ended (its last reference dropped,
  seen by a finalizer on each storage the log names: ``gone``) unordered with it: the caching
  allocator may hand its memory to that allocation (a storage whose allocation the log does
  not show, e.g. one a gloo collective makes inside, is not checked at its end: its stream
  is not known).  A later storage at the same address starts a history of its own.

This checks the ordering logic of the runtime, as the log shows it; it proves nothing about
CUDA itself (kernels, the caching allocator, NCCL).  :func:`train` is the ``fully_shard`` run
both its tests make (``tests/unit/test_streams.py`` at world 1, ``fully_shard/features.py``'s
``recorded_streams`` at world 2), :func:`train_wrapper` the wrapper's
(``tests/unit/test_streams_flat.py``).  A helper: it registers no subtest.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CURRENT = "current"
HOST = "host"  # the CPU, in a ``synchronize`` entry


class RaceError(AssertionError):
    """An access or free the streams do not order (the message names ops and streams)."""


class RecEvent:
    _ids = itertools.count()

    def __init__(self, stream: "RecStream"):
        self.id = next(self._ids)
        self.stream = stream

    def synchronize(self) -> None:
        """The CPU waits for the event (work issued after it is ordered after it)."""
        self.stream.rec.log.append(("synchronize", HOST, self.id))


class RecStream:
    """A stream of the recording device: its ops only go to the log."""

    def __init__(self, rec: "RecordingDevice", name: str):
        self.rec, self.name = rec, name
        self.device = torch.device("cpu")

    def wait_stream(self, other: "RecStream") -> None:
        self.rec.log.append(("wait_stream", self.name, other.name))

    def record_event(self) -> RecEvent:
        ev = RecEvent(self)
        self.rec.log.append(("record_event", self.name, ev.id))
        return ev

    def wait_event(self, ev: RecEvent) -> None:
        self.rec.log.append(("wait_event", self.name, ev.id))

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


def _storages(x: Any, out: list, objs: Optional[list] = None) -> None:
    """The keys of the storages ``x`` holds into ``out`` (their storage objects into ``objs``)."""
    if isinstance(x, torch.Tensor):
        if type(x) not in (torch.Tensor, torch.nn.Parameter) and hasattr(x, "__tensor_flatten__"):
            attrs, _ = x.__tensor_flatten__()
            for a in attrs:
                _storages(getattr(x, a), out, objs)
            return
        try:
            st = x.untyped_storage()
        except (RuntimeError, NotImplementedError) as e:  # an access the checker cannot see
            raise AssertionError(f"stream_check: a {type(x).__name__} argument has no storage "
                                 f"to key its accesses by ({e})") from e
        out.append(st._cdata)
        if objs is not None:
            objs.append(st)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _storages(y, out, objs)


def key(t: torch.Tensor) -> int:
    out: list = []
    _storages(t, out)
    return out[0]


# ops that read only their tensor argument's metadata (shape, dtype, device), never its memory
_METADATA_ONLY = {"aten::empty_like", "aten::zeros_like", "aten::ones_like", "aten::full_like"}

# c10d's schemas mark no writes: the tensors each collective writes, by argument name
_C10D_WRITES = {"output_tensor", "output_tensors", "output"}
_C10D_INPLACE = {"tensors", "tensor"}


class RecordingDevice(TorchDispatchMode):
    """A device layer that logs (see the module doc); ``log`` is the list ``check`` reads."""

    has_streams = True
    host_paths = False

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []
        self._streams: dict[str, RecStream] = {}
        self.priorities: dict[str, set] = {}
        self._current = self._cur = RecStream(self, CURRENT)
        self._watched: set = set()  # storage keys with a finalizer (see _watch)

    # -- the device layer --------------------------------------------------------------------
    def current_stream(self) -> RecStream:
        return self._cur

    def stream(self, name: str, priority: int | None = None) -> RecStream:
        """The stream ``name`` (one per name here); the priorities asked for it are kept in
        ``priorities[name]`` (``None``: the layer's default for the name, ``device.
        default_priority``).  A CUDA layer makes another stream for the same name at another
        priority, which this layer would merge with the first (hiding a missing wait between
        them): asking for one name at two priorities fails the run."""
        from cfsdp._runtime import device

        prio = device.default_priority(name) if priority is None else priority
        seen = self.priorities.setdefault(name, set())
        seen.add(prio)
        if len(seen) > 1:
            raise AssertionError(f"stream {name!r} asked for at priorities {sorted(seen)}: the "
                                 "recording layer models one stream per name")
        s = self._streams.get(name)
        if s is None:
            s = self._streams[name] = RecStream(self, name)
        return s

    @contextlib.contextmanager
    def on(self, s: RecStream) -> Iterator[None]:
        prev, self._cur = self._cur, s
        try:
            yield
        finally:
            self._cur = prev

    def record_stream(self, t: torch.Tensor, s: RecStream) -> None:
        self.log.append(("record_stream", s.name, self._key(t)))

    def free(self, t: torch.Tensor) -> None:
        self.log.append(("free", self._cur.name, self._key(t)))

    def alloc(self, t: torch.Tensor) -> None:
        self.log.append(("alloc", self._cur.name, self._key(t)))

    # -- storage lifetimes ---------------------------------------------------------------------
    # A key is a storage's address, which a later storage may reuse once it is gone (a
    # temporary the last reference to drops, one a collective makes and reads inside):
    # each storage seen is watched, and its end logged ("gone", checked as a free), so
    # the next one at that address starts a history of its own.
    def _key(self, t: torch.Tensor) -> int:
        keys: list = []
        objs: list = []
        _storages(t, keys, objs)
        self._watch(keys, objs)
        return keys[0]

    def _watch(self, keys: list, objs: list) -> None:
        for k, st in zip(keys, objs):
            if k not in self._watched:
                self._watched.add(k)
                weakref.finalize(st, self._gone, k)

    def _gone(self, k: int) -> None:
        self._watched.discard(k)
        self.log.append(("gone", self._cur.name, k))

    # -- every tensor op -----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        reads: list = []
        writes: list = []
        c10d = schema.name.startswith("c10d::")
        named = dict(zip((a.name for a in schema.arguments), args))
        named.update(kwargs)
        for a in () if schema.name in _METADATA_ONLY else schema.arguments:
            if a.name not in named:
                continue
            got: list = []
            objs: list = []
            _storages(named[a.name], got, objs)
            if not got:
                continue
            self._watch(got, objs)
            if c10d:
                if a.name in _C10D_WRITES:
                    writes += got
                elif a.name in _C10D_INPLACE and schema.name.endswith("_"):
                    reads += got
                    writes += got
                else:
                    reads += got
            elif a.alias_info is not None and a.alias_info.is_write:
                writes += got
            else:
                reads += got
        out = func(*args, **kwargs)
        fresh: list = []
        if not c10d:
            flat, _ = tree_flatten(out)
            rets = schema.returns
            for i, o in enumerate(flat):
                r = rets[i] if i < len(rets) else None
                if r is not None and r.alias_info is not None:
                    continue
                got, objs = [], []
                _storages(o, got, objs)
                self._watch(got, objs)
                for k in got:
                    (writes if k in reads or k in writes else fresh).append(k)
        self.log.append(("op", self._cur.name, str(func), tuple(reads), tuple(writes), tuple(fresh)))
        return out

    def ops_on(self, stream: str) -> list[str]:
        """The names of the tensor ops logged on ``stream``."""
        return [e[2] for e in self.log if e[0] == "op" and e[1] == stream]


# ---------------------------------------------------------------------------------------------
# the checker
# ---------------------------------------------------------------------------------------------


class _Storage:
    __slots__ = ("owner", "write", "reads", "acc", "rec")

    def __init__(self, owner: Optional[str]):
        self.owner = owner
        self.write: Optional[tuple] = None  # (stream, n, op)
        self.reads: dict[str, tuple] = {}  # since the last write: stream -> (n, op)
        self.acc: dict[str, tuple] = {}  # since the allocation: stream -> (n, op)
        self.rec: set[str] = set()  # record_stream'd streams


def check(log: list[tuple]) -> None:
    """Replay ``log`` (``RecordingDevice.log``'s format) and raise :class:`RaceError` at the
    first access or free the streams do not order."""
    vc: dict[str, dict[str, int]] = {}
    events: dict[int, dict[str, int]] = {}
    st: dict[int, _Storage] = {}
    host: dict[str, int] = {}  # what the CPU has waited for (``synchronize``)

    def clock(s: str) -> dict[str, int]:
        c = vc.get(s)
        if c is None:
            c = vc[s] = dict(host)
        return c

    def join(a: dict, b: dict) -> None:
        for k, v in b.items():
            if a.get(k, 0) < v:
                a[k] = v

    def ordered(at: str, s: str, n: int) -> bool:
        return s == at or clock(at).get(s, 0) >= n

    # storages that ended (``gone``: no runtime free) while an access on another stream was
    # not yet ordered before their stream: the caching allocator may hand their memory to
    # that stream's next allocation, which must then be ordered after the access (as torch's
    # FSDP2 relies on for its reduce-scatter outputs: the next reduce-scatter stream waits
    # for the current stream first)
    later: dict[str, list] = {}

    def reuse(i: int, s: str, what: str) -> None:
        for t, n, op, k, j in later.pop(s, ()):
            if not ordered(s, t, n):
                raise RaceError(
                    f"log[{i}]: {what} on stream '{s}' may reuse the memory of storage {k:#x} "
                    f"(ended at log[{j}], allocated on '{s}') before {op} on stream '{t}' is "
                    "ordered before it")

    for i, e in enumerate(log):
        kind, s = e[0], e[1]
        if kind == "wait_stream":
            join(clock(s), clock(e[2]))
        elif kind == "record_event":
            events[e[2]] = dict(clock(s))
        elif kind == "wait_event":
            join(clock(s), events[e[2]])
        elif kind == "synchronize":
            join(host, events[e[2]])
            for c in vc.values():
                join(c, host)
        elif kind == "record_stream":
            st.setdefault(e[2], _Storage(None)).rec.add(s)
        elif kind == "alloc":
            reuse(i, s, "an allocation")
            st[e[2]] = _Storage(s)
        elif kind in ("free", "gone"):
            x = st.pop(e[2], None)
            if x is None or (kind == "gone" and x.owner is None):
                continue  # (an end of a storage whose allocation the log does not show, e.g.
                # one a collective made inside: which stream's memory it is, is not known)
            owner = x.owner or s
            for t, (n, op) in x.acc.items():
                # reuse waits for the owner stream and for each record_stream'd stream as
                # they are now (the allocator records an event on each at the free)
                if t != owner and t not in x.rec and not ordered(owner, t, n) and not any(
                        ordered(r, t, n) for r in x.rec):
                    if kind == "gone":  # checked at the owner's next allocation (reuse)
                        later.setdefault(owner, []).append((t, n, op, e[2], i))
                        continue
                    raise RaceError(
                        f"log[{i}]: free of storage {e[2]:#x} (notified on stream '{s}', "
                        f"allocated on '{owner}') is not ordered after {op} on stream '{t}'")
        elif kind == "op":
            op, reads, writes, fresh = e[2], e[3], e[4], e[5]
            c = clock(s)
            n = c[s] = c.get(s, 0) + 1
            for k in reads:
                x = st.get(k)
                if x is not None and x.write is not None:
                    ws, wn, wop = x.write
                    if not ordered(s, ws, wn):
                        raise RaceError(
                            f"log[{i}]: {op} on stream '{s}' reads storage {k:#x} not ordered "
                            f"after its write by {wop} on stream '{ws}'")
            for k in writes:
                x = st.get(k)
                if x is None:
                    continue
                prior = ([x.write] if x.write is not None else []) + [
                    (t, rn, rop) for t, (rn, rop) in x.reads.items()]
                for ps, pn, pop in prior:
                    if not ordered(s, ps, pn):
                        raise RaceError(
                            f"log[{i}]: {op} on stream '{s}' writes storage {k:#x} not ordered "
                            f"after {pop} on stream '{ps}'")
            for k in reads:
                x = st.get(k)
                if x is None:
                    x = st[k] = _Storage(None)
                x.reads[s] = (n, op)
                x.acc[s] = (n, op)
            for k in writes:
                x = st.get(k)
                if x is None:
                    x = st[k] = _Storage(None)
                x.write = (s, n, op)
                x.reads = {}
                x.acc[s] = (n, op)
            if fresh:
                reuse(i, s, op)
            for k in fresh:
                x = st[k] = _Storage(s)
                x.write = (s, n, op)
                x.acc[s] = (n, op)
        else:
            raise ValueError(f"log[{i}]: unknown entry {e!r}")


# ---------------------------------------------------------------------------------------------
# the run the tests record
# ---------------------------------------------------------------------------------------------


def train(rec: Optional[RecordingDevice], mesh: Any = None, reshard_after_forward: bool = True,
          hook: bool = True, hook_stream: Any = None, steps: int = 2, seed: int = 0,
          mp_policy: Any = None, frozen: bool = False) -> tuple:
    """A 3-unit ``cfsdp.fully_shard`` model (two children and the root) on ``mesh``, ``steps``
    steps of SGD with momentum, with an all-reduce hook on one unit (``hook``; on
    ``hook_stream(rec)`` if given) and ``mp_policy`` (if given), that unit's weight frozen
    with ``frozen`` (its bias alone reduced); under ``rec`` if given.  Returns (losses,
    parameters' full tensors)."""
    import cfsdp
    from cfsdp._runtime import device

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    if frozen:
        model[2].weight.requires_grad_(False)
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    for i in (0, 2):
        cfsdp.fully_shard(model[i], mesh=mesh, reshard_after_forward=reshard_after_forward, **kw)
    cfsdp.fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, **kw)
    if hook:
        stream = None if hook_stream is None else hook_stream(rec)
        model[2].set_all_reduce_hook(lambda out: out.mul_(0.5), stream=stream)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    with device.use(rec) if rec is not None else contextlib.nullcontext():
        for _ in range(steps):
            loss = model(torch.randn(4, 8, generator=gen)).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    return losses, [p.detach().full_tensor() for p in model.parameters()]


def train_wrapper(rec: Optional[RecordingDevice], steps: int = 2, seed: int = 0,
                  no_sync: int = 0, comm_hook: Any = None, between: Any = None,
                  **fsdp_kw: Any) -> tuple:
    """The same model as :func:`train` under ``cfsdp.FullyShardedDataParallel`` (three units:
    two children and the root, each with ``fsdp_kw``), ``steps`` steps of SGD with momentum,
    each with ``no_sync`` backwards under ``no_sync()`` first, ``comm_hook`` (``(state,
    hook)``) registered on the root if given, ``between(model)`` called after each step if
    given; under ``rec`` if given.  Returns (losses, this
    rank's parameters as the optimizer sees them)."""
    import cfsdp
    from cfsdp._runtime import device

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    for i in (0, 2):
        model[i] = cfsdp.FullyShardedDataParallel(model[i], **fsdp_kw)
    model = cfsdp.FullyShardedDataParallel(model, **fsdp_kw)
    if comm_hook is not None:
        model.register_comm_hook(*comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    with device.use(rec) if rec is not None else contextlib.nullcontext():
        for _ in range(steps):
            for _ in range(no_sync):
                with model.no_sync():
                    loss = model(torch.randn(4, 8, generator=gen)).float().square().sum()
                    loss.backward()
                    losses.append(loss.detach())
            loss = model(torch.randn(4, 8, generator=gen)).float().square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if between is not None:
                between(model)
    return losses, [p.detach().clone() for p in model.parameters()]


def assert_race(log: list, *fragments: str) -> None:
    """``check(log)`` raises a RaceError naming a tensor op and every one of ``fragments``
    (the op that went unordered and the access it raced, with their streams)."""
    try:
        check(log)
    except RaceError as e:
        msg = str(e)
        assert all(x in msg for x in fragments) and "aten." in msg, msg
    else:
        raise AssertionError(f"no race found; expected one naming {fragments}")


def assert_same(want: tuple, got: tuple) -> None:
    """Losses and parameters of two :func:`train` runs bitwise equal."""
    for i, (a, b) in enumerate(zip(want[0] + want[1], got[0] + got[1])):
        if not torch.equal(a, b):
            raise AssertionError(f"recorded run differs at item {i}: {a} != {b}")


__all__ = ["CURRENT", "HOST", "RaceError", "RecordingDevice", "RecStream", "assert_race", "assert_same", "check", "key",
           "train", "train_wrapper"]
