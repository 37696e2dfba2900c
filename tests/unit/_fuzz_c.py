"""The fuzz driver of test_fuzz_c.py, run in a child process: every callable of cfsdp._C
(each function, ShmGroup, ShmSegment and every method and attribute of ShmGroup /
ShmWork / ShmSegment) and every
tensor entry point of cfsdp._core, called with hostile arguments drawn by hypothesis.

    python _fuzz_c.py FAMILY CASE_LOG SEED EXAMPLES

Before each call the case (entry point and arguments) is written to CASE_LOG in one
write(2), so when the process dies (a signal, a sanitizer report) the parent names the
entry point and the input that killed it.  The process prints ``FUZZ-OK`` after the
last example; any exception but the ones an entry point may raise (TypeError,
ValueError, OverflowError, ... per family) fails the example (hypothesis shrinks it and
the child exits non-zero with its report).

What C must take and what it must refuse.  C reads and writes the memory it is handed:
it cannot know how long a buffer is, so an address and the numel that describes its
buffer are *promised*: the fuzz gives either the truth (a buffer of exactly that many
bytes, maybe at an odd address, under ASan with ``PYTHONMALLOC=malloc`` so one byte past
it is a report) or a value C must refuse by itself (negative, 2**63 and more, NULL with
elements, not an int).  Everything else is *checked* and drawn from anything at all:
codes, plans, offsets, ranks, world sizes, scales and flags (any int, huge, negative,
floats, None, objects, int-likes whose ``__index__`` raises or empties the list being
read), sequences (lists that shrink while read, generators, wrong row lengths).  Queued
shared-memory ops get a plan nobody else keeps, freed before the op runs.

``--selftest-crash`` dies of SIGSEGV after logging a case (the parent's self-test).
"""

from __future__ import annotations

import array
import gc
import os
import secrets
import sys
import threading
import time

if __name__ == "__main__" and sys.argv[1:2] == ["--selftest-crash"]:
    import ctypes

    fd = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, b"CASE selftest ctypes.string_at(0)\n")
    ctypes.string_at(0)

import torch  # noqa: E402
from hypothesis import HealthCheck, given, seed as hseed, settings, strategies as st  # noqa: E402

import cfsdp._C as C  # noqa: E402
from cfsdp import _core  # noqa: E402
from _hostile import Wrapper  # noqa: E402

ESZ = {0: 4, 1: 8, 2: 2, 3: 2}


class EvilError(Exception):
    """Raised by an Evil int-like: must come out of the call unchanged."""


# --------------------------------------------------------------------------------------
# specs: what a case is made of (plain data, so a case prints), materialised per call
# --------------------------------------------------------------------------------------


class Buf:
    """A buffer of exactly `nbytes` at an address `shift` bytes past an aligned one."""

    def __init__(self, nbytes: int, shift: int = 0):
        self.nbytes, self.shift = nbytes, shift

    def __repr__(self):
        return f"Buf({self.nbytes}{', +' + str(self.shift) if self.shift else ''})"


class Evil:
    """An int-like (``__index__``, ``__float__``, ``__bool__``) that first does `effect`:
    "raise" (EvilError), "clear" / "grow" (the list it sits in), "gc", or nothing."""

    def __init__(self, value, effect: str = "none"):
        self.value, self.effect, self.target = value, effect, None

    def _fire(self):
        if self.effect == "raise":
            raise EvilError(f"Evil({self.value!r})")
        if self.effect == "clear" and self.target is not None:
            self.target.clear()
        elif self.effect == "grow" and self.target is not None:
            self.target.extend([0] * 64)
        elif self.effect == "gc":
            gc.collect(0)

    def __index__(self):
        self._fire()
        return self.value

    def __float__(self):
        self._fire()
        return float(self.value)

    def __bool__(self):
        self._fire()
        return bool(self.value)

    def __repr__(self):
        return f"Evil({self.value!r}, {self.effect!r})"


class Seq:
    """A sequence argument: `kind` "list", "tuple", "gen" (a generator) or "sub" (a list
    subclass); items are specs (Evil items that clear or grow act on this very list)."""

    def __init__(self, kind: str, items: list):
        self.kind, self.items = kind, items

    def __repr__(self):
        return f"{self.kind}{self.items!r}"


class Junk:
    """A value of the wrong kind, by name (so a case prints)."""

    VALUES = {"None": None, "1.5": 1.5, "nan": float("nan"), "inf": float("inf"), "'7'": "7",
              "b'7'": b"7", "[]": [], "()": (), "{}": {}, "object()": None}

    def __init__(self, name: str):
        self.name = name

    def make(self):
        return object() if self.name == "object()" else self.VALUES[self.name]

    def __repr__(self):
        return self.name


class SubList(list):
    pass


class Call:
    """Materialises specs into arguments; keeps every buffer alive until it is dropped."""

    def __init__(self):
        self.keep = []

    def buf(self, b: Buf) -> int:
        t = torch.empty(max(b.nbytes + b.shift, 1), dtype=torch.uint8)
        self.keep.append(t)
        return t.data_ptr() + b.shift

    def __call__(self, spec):
        if isinstance(spec, Buf):
            return self.buf(spec)
        if isinstance(spec, Junk):
            return spec.make()
        if isinstance(spec, Evil):
            return Evil(spec.value, spec.effect)
        if isinstance(spec, Seq):
            items = [self(x) for x in spec.items]
            out = SubList(items) if spec.kind == "sub" else items
            for x in out:
                if isinstance(x, Evil):
                    x.target = out
            if spec.kind == "tuple":
                return tuple(out)
            if spec.kind == "gen":
                return (x for x in items)
            return out
        if isinstance(spec, tuple):
            return tuple(self(x) for x in spec)
        if isinstance(spec, list):
            return [self(x) for x in spec]
        if isinstance(spec, dict):
            return {k: self(v) for k, v in spec.items()}
        return spec


# --------------------------------------------------------------------------------------
# hostility: how many arguments of a case are not what the entry point expects
# --------------------------------------------------------------------------------------

BIG = [2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**61, 2**62, 2**63 - 1, 2**63, 2**64, 2**64 + 1,
       2**100]
EDGE_INTS = BIG + [-x for x in BIG] + [0, 1, -1, 2, 3, 4, 8, 255, 256, 257, 65536, 65537]
junk = st.sampled_from([Junk(n) for n in Junk.VALUES])
anyint = st.one_of(st.integers(-2**66, 2**66), st.sampled_from(EDGE_INTS))
hostile = st.one_of(anyint, anyint, junk, st.booleans(),
                    st.builds(Evil, anyint, st.sampled_from(["none", "raise", "gc"])))
bad_promise = st.one_of(st.integers(-2**63, -1), st.integers(2**63, 2**66), st.sampled_from(
    [-1, 2**63, 2**64]), junk, st.builds(Evil, st.sampled_from([-1, 2**63]), st.just("none")))
bad_addr = st.one_of(st.just(0), st.integers(-2**63, -1), st.integers(2**63, 2**65), junk,
                     st.builds(Evil, st.just(4096), st.just("none")))
FLOATS = [1.0, 2.0, 0.5, 1 / 3, -3.0, 0.0, -0.0, float("inf"), float("-inf"), float("nan"),
          1e308, 5e-324, 1e-30, 7.0]


class H:
    """A case's hostility, drawn once: rate 0 (every argument valid: the call must work),
    or a rate (percent) at which each argument is replaced by something it must refuse
    or survive.  Its methods draw one argument of each kind."""

    def __init__(self, draw):
        self.draw = draw
        self.rate = draw(st.sampled_from([0, 0, 0, 5, 5, 10, 10, 30, 60]))

    def bad(self) -> bool:
        return self.rate > 0 and self.draw(st.integers(0, 99)) < self.rate

    def checked(self, valid):
        """A checked argument: `valid` (a value or a strategy), an int-like that reads as
        it, or (hostile) anything at all."""
        v = self.draw(valid) if isinstance(valid, st.SearchStrategy) else valid
        if self.bad():
            return self.draw(st.one_of(hostile, st.builds(Evil, st.just(v) if isinstance(
                v, int) else anyint, st.sampled_from(["raise", "gc", "none"]))))
        return v

    def fl(self, valid=None):
        return self.checked(st.sampled_from(FLOATS) if valid is None else valid)

    def promise(self, n):
        """A promised numel: the truth, or a value C must refuse by itself."""
        return self.draw(bad_promise) if self.bad() else n

    def addr(self, buf):
        """A promised address: the buffer's, or one C must refuse (NULL: with elements)."""
        return self.draw(bad_addr) if self.bad() else buf

    def buf(self, nbytes):
        """A buffer of exactly nbytes, at an odd address now and then."""
        return Buf(nbytes, self.draw(st.sampled_from([0, 0, 0, 0, 1, 2, 3, 4, 6])))

    def seq(self, items, bad=hostile, kinds=("list", "list", "list", "tuple", "gen", "sub")):
        """A sequence argument of `items` (specs): a list, tuple, generator or list
        subclass; hostile, an entry that empties or grows the list when read (and reads
        as 0: less than any promise), an item replaced by one from `bad` (what the items
        may be instead: anything for checked values, refused ones for promised), or not a
        sequence at all."""
        items = list(items)
        if self.bad() and items:
            i = self.draw(st.integers(0, len(items) - 1))
            items[i] = Evil(0, self.draw(st.sampled_from(["clear", "grow"])))
        if self.bad() and items:
            items[self.draw(st.integers(0, len(items) - 1))] = self.draw(bad)
        if self.bad():
            return self.draw(st.one_of(junk, anyint))
        return Seq(self.draw(st.sampled_from(kinds)), items)

    def row(self, values):
        """A row of a sequence argument, of `values` (specs, already drawn as checked or
        promised): a tuple, or hostile, of the wrong length, or a list with an entry that
        empties it when read (reading as 0)."""
        values = list(values)
        if self.bad():
            values = values[: self.draw(st.integers(0, len(values)))] + \
                self.draw(st.lists(st.just(0), max_size=1))
        if self.bad() and values:
            values[self.draw(st.integers(0, len(values) - 1))] = Evil(
                0, self.draw(st.sampled_from(["clear", "grow"])))
            return Seq("list", values)
        return Seq("tuple", values)


def value_of(spec, default):
    """The int a checked argument reads as (bools are ints to C), else `default`."""
    v = spec.value if isinstance(spec, Evil) else spec
    return int(v) if isinstance(v, int) else default


def esz_of(code_spec) -> int:
    """The element size C reads a dtype code as (8, the largest, for anything else)."""
    return ESZ.get(value_of(code_spec, -1), 8)


# --------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------

ENTRIES: dict[str, tuple] = {}  # name -> (family, strategy, run(call, spec))
CORE_ALLOWED = (TypeError, ValueError, OverflowError, EvilError)
ALLOWED = {
    "core": CORE_ALLOWED,
    "shm": CORE_ALLOWED + (RuntimeError, PermissionError),
    "bind": CORE_ALLOWED + (KeyError, AttributeError, RuntimeError, IndexError),
    "_core": CORE_ALLOWED + (AssertionError, RuntimeError, NotImplementedError, IndexError),
}


def entry(name, family, strategy):
    def register(run):
        ENTRIES[name] = (family, strategy, run)
        return run

    return register


def plain(name, family="core"):
    """Register `composite` (drawing an H) as the strategy of C.name(*args)."""

    def register(composite):
        ENTRIES[name] = (family, composite(),
                         lambda call, spec: getattr(C, name)(*call(spec)))
        return composite

    return register


@plain("plan_layout")
@st.composite
def _plan_layout(draw):
    h = H(draw)
    numels = [h.checked(st.integers(0, 40)) for _ in range(draw(st.integers(0, 6)))]
    return (h.seq(numels), h.checked(st.integers(0, 16)),
            h.checked(st.sampled_from([1, 2, 3, 8, 65536])))


@plain("shard_fill")
@st.composite
def _shard_fill(draw):
    h = H(draw)
    esz = draw(st.sampled_from([1, 2, 4, 8, 3, 16]))
    n = draw(st.integers(0, 24))
    srcs = []
    for _ in range(draw(st.integers(0, 4))):
        m = draw(st.integers(0, 12))
        srcs.append(h.row([h.addr(h.buf(m * esz)), h.promise(m), h.checked(st.integers(0, 40))]))
    return (h.addr(h.buf(n * esz)), h.promise(n), h.promise(esz), h.checked(st.integers(0, 30)),
            h.seq(srcs, bad=junk))


@st.composite
def chunk_layout(draw, world):
    """A valid FSDP2 unit: its plan rows, natural numel and shard numel (gaps allowed);
    each parameter sharded on dim 0 (outer 1) or, as (outer, rows, inner) sharded on dim 1
    (Shard(1): rows a multiple of the world size), in blocks."""
    rows, nat, shard = [], 0, 0
    for _ in range(draw(st.integers(0, 4))):
        outer, d0, r = 1, draw(st.integers(0, 7)), draw(st.integers(1, 4))
        if draw(st.booleans()):
            outer, d0 = draw(st.integers(1, 5)), world * draw(st.integers(0, 3))
        c = outer * -(-d0 // world) * r
        nat += draw(st.integers(0, 2))
        shard += draw(st.integers(0, 2))
        rows.append([nat, outer * d0 * r, c, shard, outer])
        nat, shard = nat + outer * d0 * r, shard + c
    return rows, nat + draw(st.integers(0, 3)), shard + draw(st.integers(0, 2))


@st.composite
def chunk_unit(draw):
    """(world, plan rows, natural numel, shard numel) of a valid unit over 1 to 4 ranks."""
    world = draw(st.integers(1, 4))
    return (world, *draw(chunk_layout(world)))


def plan_spec(h, rows):
    """A plan argument (checked: any value may be anything)."""
    return h.seq([h.row([h.checked(v) for v in r]) for r in rows])


@plain("chunk_unpack")
@st.composite
def _chunk_unpack(draw):
    h, (world, rows, nat, shard) = H(draw), draw(chunk_unit())
    esz = draw(st.sampled_from([1, 2, 4, 8, 3]))
    return (h.addr(h.buf(nat * esz)), h.promise(nat), h.addr(h.buf(world * shard * esz)),
            h.promise(world * shard), h.promise(esz), plan_spec(h, rows), h.checked(world),
            h.checked(shard), h.checked(st.integers(1, 4)))


@plain("chunk_pack")
@st.composite
def _chunk_pack(draw):
    h, (world, rows, nat, shard) = H(draw), draw(chunk_unit())
    lo = draw(st.integers(0, world))
    hi = draw(st.integers(lo, world))
    dc, sc = h.checked(st.integers(0, 3)), h.checked(st.integers(0, 3))
    return (h.addr(h.buf((hi - lo) * shard * esz_of(dc))), h.promise((hi - lo) * shard), dc,
            h.addr(h.buf(nat * esz_of(sc))), h.promise(nat), sc, plan_spec(h, rows),
            h.checked(world), h.checked(shard), h.checked(lo), h.checked(hi), h.fl(),
            h.checked(st.integers(1, 4)))


@st.composite
def _scale_cast_add(draw):
    h = H(draw)
    dc, sc = h.checked(st.integers(0, 3)), h.checked(st.integers(0, 3))
    n = draw(st.integers(0, 40))
    inplace = draw(st.integers(0, 4)) == 0  # src is dst (one buffer, long enough for both)
    dst = h.addr(h.buf(n * (8 if inplace else esz_of(dc))))
    return dst, dc, "DST" if inplace else h.addr(h.buf(n * esz_of(sc))), sc, h.promise(n), \
        h.fl(), h.checked(st.booleans())


@entry("scale_cast_add", "core", _scale_cast_add())
def _run_sca(call, spec):
    args = call(tuple(None if x == "DST" else x for x in spec))
    C.scale_cast_add(*[args[0] if x == "DST" else a for x, a in zip(spec, args)])


@plain("norm_partial")
@st.composite
def _norm_partial(draw):
    h = H(draw)
    code, n = h.checked(st.integers(0, 3)), draw(st.integers(0, 64))
    return h.addr(h.buf(n * esz_of(code))), code, h.promise(n), \
        h.fl(st.sampled_from([1.0, 2.0, 3.0, 0.5, float("inf")]))


@plain("shm_reduce")
@st.composite
def _shm_reduce(draw):
    h = H(draw)
    code, n = h.checked(st.integers(0, 3)), draw(st.integers(0, 40))
    k = draw(st.sampled_from([1, 2, 2, 3, 5, 257]))
    srcs = [h.addr(h.buf(n * esz_of(code))) for _ in range(k)]
    return h.addr(h.buf(n * esz_of(code))), h.seq(srcs, bad=bad_addr), h.promise(n), code, h.fl(), \
        h.checked(st.integers(1, 4))


@plain("shm_memcpy")
@st.composite
def _shm_memcpy(draw):
    h = H(draw)
    n = draw(st.integers(0, 100))
    return h.addr(h.buf(n)), h.addr(h.buf(n)), h.promise(n), h.checked(st.integers(1, 4))


@plain("shm_segment_bytes")
@st.composite
def _shm_segment_bytes(draw):
    h = H(draw)
    return h.checked(st.integers(1, 300)), h.checked(st.integers(0, 1 << 20))


_SEG_FILES: list = []


def _seg_files() -> list:
    """Paths for ShmSegment to attach to, made once: a 0600 file of this process of 256
    bytes (accepted at that size), a 0644 one (refused), a symbolic link to the first
    (refused) and a directory (open fails).  Removed by the child's exit hook."""
    if not _SEG_FILES:
        base = f"/dev/shm/cfsdp-fuzz-{os.getpid()}-{secrets.token_hex(4)}"
        for mode, tag in ((0o600, "ok"), (0o644, "wide")):
            fd = os.open(f"{base}-{tag}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.fchmod(fd, mode)
            os.ftruncate(fd, 256)
            os.close(fd)
            _SEG_FILES.append(f"{base}-{tag}")
        os.symlink(f"{base}-ok", f"{base}-link")
        _SEG_FILES.append(f"{base}-link")
        import atexit

        atexit.register(lambda: [os.unlink(f) for f in _SEG_FILES if os.path.lexists(f)])
    return _SEG_FILES + ["/dev/shm"]


@st.composite
def _segment_new(draw):
    h = H(draw)
    path = draw(st.sampled_from(_seg_files() + ["NEW", "NEW"] + (
        ["", "x" * 5000, "\udc80", "/dev/shm/caf\u00e9", "/nul\x00x", "/proc/nope/x"]
        if h.bad() else [])))
    nbytes = h.checked(st.sampled_from([256, 1, 64, 4096] + ([0, -1, 1 << 62] if h.bad() else [])))
    kw = draw(st.sampled_from([None, None, "kw", "bogus" if h.bad() else None]))
    ops = draw(st.lists(st.sampled_from(["tensor", "write", "unlink", "nbytes", "path", "args"]),
                        max_size=5))
    return path, h.checked(path == "NEW"), nbytes, kw, ops


@entry("ShmSegment", "shm", _segment_new())
def _run_segment(call, spec):
    """Make or attach with the case's arguments (any of them hostile), then view, write,
    unlink and read the attributes in any order; a made file is always removed."""
    path, create, nbytes, kw, ops = spec
    made = path == "NEW"  # a name of its own (the fixed files are never unlinked)
    path = f"/dev/shm/cfsdp-fuzz-{os.getpid()}-{secrets.token_hex(6)}" if made else path
    args = [path, *call((create, nbytes))]
    try:
        if kw == "kw":
            seg = C.ShmSegment(path=args[0], create=args[1], nbytes=args[2])
        elif kw == "bogus":
            seg = C.ShmSegment(*args, bogus=1)
        else:
            seg = C.ShmSegment(*args)
        for op in ops:
            if op == "tensor":
                t = torch.frombuffer(seg, dtype=torch.uint8)
                assert t.numel() == seg.nbytes
            elif op == "write":
                m = memoryview(seg)
                m[0] = 7
                m[-1] = 9  # (the same byte when nbytes is 1)
                assert bytes(m[:1]) == (b"\x09" if len(m) == 1 else b"\x07")
                m.release()
            elif op == "unlink" and made:
                seg.unlink()
            elif op == "args":
                try:
                    seg.unlink(1)
                except TypeError:
                    pass
            elif op in ("nbytes", "path"):
                getattr(seg, op)
    finally:
        if made and os.path.lexists(path):
            os.unlink(path)


OPT_ELEMS = 16


@st.composite
def ranges_spec(draw, h, elems):
    """Promised (start, len) ranges over `elems` elements: increasing and disjoint, or
    (hostile) unordered, overlapping, negative, or ending at 2**61 and more (C must refuse
    those: they pass every buffer); as rows, an int64 array, an int64 view at an odd
    address, an array of another type, or junk."""
    cuts = sorted(draw(st.lists(st.integers(0, elems), max_size=8)))
    pairs = [(a, b - a) for a, b in zip(cuts[0::2], cuts[1::2])]
    if h.bad():
        pairs.append(draw(st.one_of(
            st.tuples(st.integers(0, elems), st.integers(0, elems)).filter(
                lambda p: p[0] + p[1] <= elems),
            st.tuples(st.integers(-2**63, -1), st.integers(0, 4)),
            st.tuples(st.integers(0, 4), st.integers(-2**63, -1)),
            st.tuples(st.integers(2**61, 2**63 - 1), st.integers(0, 2**62)),
            st.tuples(st.integers(0, 2**62), st.integers(2**61, 2**63 - 1)))))
        draw(st.randoms()).shuffle(pairs)
    flat = [v for p in pairs for v in p]
    form = draw(st.sampled_from(["rows", "rows", "array", "odd", "other"]))
    if form == "array":
        return ("array", "q", flat)
    if form == "odd":
        return ("odd", flat)  # an int64 memoryview at an odd address
    if form == "other" and h.bad():
        return ("array", draw(st.sampled_from(["i", "d", "b"])), flat)
    return h.seq([h.row(list(p)) for p in pairs], bad=junk)


def materialise_ranges(call, spec):
    if isinstance(spec, tuple) and spec and spec[0] == "array":
        try:
            return array.array(spec[1], spec[2])
        except (OverflowError, TypeError):
            return array.array(spec[1])
    if isinstance(spec, tuple) and spec and spec[0] == "odd":
        raw = bytearray(8 * len(spec[1]) + 1)
        mv = memoryview(raw)[1:].cast("q")
        if spec[1]:
            mv[:] = array.array("q", spec[1])
        return mv
    return call(spec)


@st.composite
def optim_args(draw, n_bufs, n_float, step, n_flags=3):
    """A fused step's arguments: n_bufs buffers of OPT_ELEMS fp32, the optional one (None,
    0 or a buffer), the ranges, the dtype code, n_float hyper-parameters (and `step`:
    Adam's step count), n_flags flags and the thread cap."""
    h = H(draw)
    bufs = [h.addr(h.buf(4 * OPT_ELEMS)) for _ in range(n_bufs)]
    opt = draw(st.sampled_from([None, 0, "BUF"]))
    opt = h.addr(h.buf(4 * OPT_ELEMS)) if opt == "BUF" else opt
    floats = [h.fl(st.sampled_from([1e-3, 0.9, 0.999, 1e-8, 0.0, 0.01, 0.5]))
              for _ in range(n_float)]
    if step:
        floats.append(h.fl(st.sampled_from([1.0, 2.0, 7.0])))
    return (*bufs, opt, draw(ranges_spec(h, OPT_ELEMS)), h.checked(0), *floats,
            *[h.checked(st.booleans()) for _ in range(n_flags)], h.checked(st.integers(1, 4)))


def _run_optim(name, at):
    def run(call, spec):
        args = [*call(spec[:at]), materialise_ranges(call, spec[at]), *call(spec[at + 1:])]
        getattr(C, name)(*args)

    return run


entry("adam_step", "core", optim_args(4, 5, True))(_run_optim("adam_step", 5))
entry("sgd_step", "core", optim_args(2, 4, False))(_run_optim("sgd_step", 3))
entry("muon_momentum", "core", optim_args(2, 1, False, n_flags=1))(_run_optim("muon_momentum", 3))


@plain("optim_uses_avx2")
@st.composite
def _optim_uses_avx2(draw):
    return tuple(draw(st.lists(hostile, max_size=1)))


# --------------------------------------------------------------------------- bulk binding


class Obj:
    """An object with hostile attributes (`mode`): reading `x` raises, `_use_count` gives
    something that is not a small int, `view` raises."""

    def __init__(self, mode):
        self.mode = mode
        if mode != "noattr":
            self.x = Evil(1, "raise") if mode == "evil" else 1
            self.requires_grad = Evil(1, "raise") if mode == "evil" else True

    def _use_count(self):
        if self.mode == "raise":
            raise EvilError("use count")
        return {"evil": Evil(1, "gc"), "big": 2**70, "junk": "1"}.get(self.mode, 1)

    def view(self, shape):
        if self.mode == "raise":
            raise EvilError("view")
        return self

    def detach(self):
        return self

    def __repr__(self):
        return f"Obj({self.mode!r})"


class BadKey:
    """A dict key whose hash raises, or whose comparison runs the collector."""

    def __init__(self, mode):
        self.mode = mode

    def __hash__(self):
        if self.mode == "raise":
            raise EvilError("hash")
        return 7

    def __eq__(self, other):
        if self.mode == "gc":
            gc.collect(0)
        return self is other

    def __repr__(self):
        return f"BadKey({self.mode!r})"


MODES = ["tensor", "tensor", "plain", "evil", "raise", "big", "junk", "noattr"]


def _obj(mode):
    return torch.zeros(4, requires_grad=True) if mode == "tensor" else Obj(mode)


def tup(h, items):
    """A tuple argument of `items`; hostile: a list, or junk."""
    if h.bad():
        return h.draw(st.one_of(junk, st.just(list(items))))
    return tuple(items)


def objs_spec(h, n):
    return tup(h, [h.draw(st.sampled_from(MODES)) if h.bad() else "tensor" for _ in range(n)])


def key_spec(h):
    return h.draw(st.one_of(st.builds(BadKey, st.sampled_from(["raise", "gc"])), st.just([]))) \
        if h.bad() else h.draw(st.sampled_from(["a", "b", "x"]))


def name_spec(h):
    return h.checked(st.sampled_from(["x", "requires_grad", "grad", "missing"]))


def _objs(spec):
    return tuple(_obj(m) for m in spec) if isinstance(spec, tuple) else Call()(spec)


def _dicts(spec):
    return tuple({} if k == "dict" else 5 for k in spec) if isinstance(spec, tuple) else \
        Call()(spec)


def _mismatch(h, n):
    return n + (h.draw(st.sampled_from([-1, 1])) if h.bad() and n else 0)


@st.composite
def _dict_set(draw):
    h = H(draw)
    n = draw(st.integers(0, 4))
    return (tup(h, ["junk" if h.bad() else "dict" for _ in range(n)]),
            tup(h, [key_spec(h) for _ in range(_mismatch(h, n))]),
            tup(h, [h.draw(hostile) for _ in range(_mismatch(h, n))]))


@entry("dict_set", "bind", _dict_set())
def _run_dict_set(call, spec):
    C.dict_set(_dicts(spec[0]), call(spec[1]), call(spec[2]))


@st.composite
def _dict_pop(draw):
    h = H(draw)
    n = draw(st.integers(0, 4))
    return (tup(h, ["junk" if h.bad() else "dict" for _ in range(n)]),
            tup(h, [key_spec(h) for _ in range(_mismatch(h, n))]))


@entry("dict_pop", "bind", _dict_pop())
def _run_dict_pop(call, spec):
    C.dict_pop(_dicts(spec[0]), call(spec[1]))


@st.composite
def _objs_name(draw):
    h = H(draw)
    n = draw(st.integers(0, 4))
    return objs_spec(h, n), name_spec(h), tup(h, [h.draw(hostile) for _ in range(
        _mismatch(h, n))]) if draw(st.booleans()) else None, h.checked(st.integers(0, 3))


def _run_objs(name, picks):
    """C.name(objs, *the spec's entries at `picks`)."""

    def run(call, spec):
        getattr(C, name)(_objs(spec[0]), *[call(spec[i]) for i in picks])

    return run


for _name_, _picks in [("attr_flags", (1,)), ("attr_get", (1,)), ("attr_set", (1, 2))]:
    entry(_name_, "bind", _objs_name())(_run_objs(_name_, _picks))


@st.composite
def _shape_views(draw):
    h = H(draw)
    n_chunks, n = draw(st.integers(0, 3)), draw(st.integers(0, 4))
    index = [h.checked(st.integers(0, max(n_chunks - 1, 0))) for _ in range(n)]
    shapes = [h.checked(st.sampled_from([None, (2, 2), (4,), (-1,), (5,)])) for _ in range(n)]
    train = draw(st.one_of(st.none(), st.binary(min_size=n, max_size=n)))
    if h.bad():
        train = draw(st.one_of(st.binary(max_size=6), junk))
    occ = [h.checked(st.integers(0, max(n - 1, 0))) for _ in range(draw(st.integers(0, 5)))]
    return (objs_spec(h, n_chunks), tup(h, index), tup(h, shapes[: _mismatch(h, n)]), train,
            tup(h, occ))


@entry("shape_views", "bind", _shape_views())
def _run_shape_views(call, spec):
    C.shape_views(_objs(spec[0]), call(spec[1]), call(spec[2]), call(spec[3]), call(spec[4]))


# --------------------------------------------------------------------------- ShmGroup


def _name():
    return f"/cfsdp-fuzz-{os.getpid()}-{secrets.token_hex(6)}"


@st.composite
def _group_new(draw):
    h = H(draw)
    world = draw(st.integers(1, 3))
    name = draw(st.sampled_from(["", "noslash", "/a/b", "/" + "x" * 80, "/nul\x00x"])) \
        if h.bad() else "NEW"
    slot = h.checked(st.sampled_from([128 * world * k for k in (1, 2, 4)] + (
        [64, 100, (1 << 30) + 64] if h.bad() else [])))
    label = h.checked(st.one_of(st.just("fuzz"), st.text(max_size=200)))
    ranks = h.seq([h.checked(r) for r in range(world)])
    kw = draw(st.sampled_from([None, None, "create", "bogus" if h.bad() else None]))
    return (name, h.checked(True), h.checked(world), h.checked(0), slot, h.fl(1.0), label,
            ranks, kw)


@entry("ShmGroup", "shm", _group_new())
def _run_group_new(call, spec):
    """Rank 0 of a segment made with the case's arguments; the other ranks attach with
    valid ones (then, if the case's timeout is the valid 1 s, every rank waits)."""
    name, create, world, rank, slot, timeout, label, ranks, kw = spec
    name = _name() if name == "NEW" else name
    args = [name, *call((create, world, rank, slot, timeout, label, ranks))]
    kwargs = {}
    if kw == "create":
        kwargs = dict(zip(["create", "world_size", "rank", "slot_bytes", "timeout_s", "label",
                           "global_ranks"], args[1:]))
        args = args[:1]
    elif kw == "bogus":
        kwargs["bogus"] = 1
    views = [C.ShmGroup(*args, **kwargs)]
    try:
        w, s = views[0].world_size, views[0].nbytes  # the arguments C took
        slot_ok = value_of(slot, 0)
        for r in range(1, w):
            views.append(C.ShmGroup(name, False, w, r, slot_ok, 1.0, "fuzz", list(range(w))))
        if timeout == 1.0 or w == 1:
            for v in views:
                v.wait_attached()
        assert s == C.shm_segment_bytes(w, slot_ok)
    finally:
        for v in views:
            v.close()


class Groups:
    """A one-rank group and a two-rank pair (two views of one segment), made once per
    child and made again after an op fails (a failed op poisons its group)."""

    def __init__(self):
        self.solo, self.pair = None, []
        self.renew()

    def renew(self):
        for g in [self.solo, *self.pair]:
            if g is not None:
                g.close()
        self.solo = C.ShmGroup(_name(), True, 1, 0, 512, 2.0, "fuzz-solo", [0])
        name = _name()
        self.pair = [C.ShmGroup(name, r == 0, 2, r, 512, 2.0, "fuzz-pair", [0, 1])
                     for r in range(2)]
        for g in [self.solo, *self.pair]:
            g.wait_attached()

    def close(self):
        for g in [self.solo, *self.pair]:
            g.close()


GROUPS = None


def groups():
    global GROUPS
    if GROUPS is None:
        GROUPS = Groups()
    return GROUPS


OPS = ["all_gather", "all_gather_unpack", "reduce_scatter_pack", "reduce_scatter", "all_reduce",
       "broadcast", "all_to_all"]

# all_to_all's counts: promised (the buffers are sized by them), so either the truth or
# entries C must refuse by itself (negative, or a total whose bytes do not fit int64)
bad_count = st.one_of(st.integers(-2**63, -1), st.sampled_from([2**62, 2**63 - 1]))


class A2A:
    """An all_to_all buffer of one rank, sized by the counts matrix: "dst" its column (what
    it receives), "src" its row (what it sends), ``shift`` bytes past an aligned address;
    ``bad``: a promised address C must refuse instead (from ``bad_addr``)."""

    def __init__(self, which: str, shift: int, bad=None):
        self.which, self.shift, self.bad = which, shift, bad

    def __repr__(self):
        return f"A2A({self.which}, +{self.shift}{', ' + repr(self.bad) if self.bad else ''})"


def _a2a_nbytes(which, matrix, rank, esz):
    """The bytes of rank ``rank``'s buffer (a bad count reads as 0: C refuses the call)."""
    vals = [value_of(v, 0) for v in (matrix[rank] if which == "src" else
                                      [row[rank] for row in matrix])]
    return sum(v for v in vals if 0 <= v < 2**62) * esz


def _counts_blob(matrix, world):
    """The counts' bytes (int64, sender-major), made per call; junk or a wrong length as drawn."""
    if isinstance(matrix, str):
        return {"SHORT": b"\0" * (8 * world * world - 1), "LONG": b"\0" * (8 * world * world + 8)
                }.get(matrix, matrix)
    if not isinstance(matrix, list):
        return Call()(matrix)
    return array.array("q", [value_of(v, 0) for row in matrix for v in row]).tobytes()


@st.composite
def _collective(draw, op):
    """One collective's arguments: the same checked values on every rank of the group,
    each rank its own buffers; how the handles are used; the plan (all_gather_unpack,
    reduce_scatter_pack) as rows, packed per call into bytes nobody else keeps."""
    h = H(draw)
    world = draw(st.sampled_from([1, 2]))
    code = h.checked(st.integers(0, 3))
    esz, mt = esz_of(code), h.checked(st.integers(1, 4))
    if op in ("all_gather_unpack", "reduce_scatter_pack"):
        rows, nat, n = draw(chunk_layout(world))
        plan = [[h.checked(v) for v in r] for r in rows]
        if h.bad():
            plan = draw(st.one_of(junk, st.just("SHORT")))  # not bytes, or not 40-byte rows
        if op == "all_gather_unpack":
            args = [h.addr(h.buf(nat * esz)), h.promise(nat), h.addr(h.buf(n * esz)),
                    h.promise(n), code, ("PLAN", plan), mt]
        else:
            ncode = h.checked(st.integers(0, 3))
            args = [h.addr(h.buf(n * esz)), h.promise(n), code,
                    h.addr(h.buf(nat * esz_of(ncode))), h.promise(nat), ncode,
                    h.fl(st.sampled_from([1.0, 2.0, 0.5])), h.fl(st.sampled_from([1.0, 0.5])),
                    ("PLAN", plan), mt]
    elif op == "all_to_all":
        # every count up to several pieces of a slot half's block per rank
        matrix = [[draw(st.integers(0, 200)) for _ in range(world)] for _ in range(world)]
        if h.bad():
            r, c = draw(st.integers(0, world - 1)), draw(st.integers(0, world - 1))
            matrix[r][c] = draw(bad_count)
        counts = ("COUNTS", matrix)
        if h.bad():
            counts = ("COUNTS", draw(st.one_of(junk, st.sampled_from(["SHORT", "LONG"]))))
        shifts = [draw(st.sampled_from([0, 0, 0, 1, 2, 6])) for _ in range(2)]
        dst = A2A("dst", shifts[0], draw(bad_addr) if h.bad() else None)
        src = A2A("src", shifts[1], draw(bad_addr) if h.bad() else None)
        args = [dst, src, counts, code, mt]
    else:
        n = draw(st.integers(0, 300))  # up to several pieces of the 512-byte slots
        if op == "all_gather":
            own = draw(st.booleans())  # the input is this rank's block of the output
            args = [h.addr(h.buf(world * n * esz)), "OWN" if own else h.addr(h.buf(n * esz)),
                    h.promise(n), code, mt]
        elif op in ("reduce_scatter", "all_reduce"):
            same = op == "all_reduce" and draw(st.booleans())  # in place
            mult = world if op == "reduce_scatter" else 1
            args = [h.addr(h.buf(n * esz)), "DST" if same else h.addr(h.buf(mult * n * esz)),
                    h.promise(n), code, h.fl(st.sampled_from([1.0, 0.5, 1 / 3])), mt]
        else:
            args = [h.addr(h.buf(n * esz)), h.promise(n), code,
                    h.checked(st.integers(0, world - 1)), mt]
    use = draw(st.sampled_from(["wait", "wait", "threads", "drop", "close", "twice"]))
    extra = draw(st.sampled_from([0, 0, 0, 0, 0, 1, -1])) if h.bad() else 0
    return world, op, args, use, extra


def _plan_blob(plan):
    """The plan's bytes (int64 quintuples), made per call: only the op may keep them."""
    if plan == "SHORT":
        return b"\0" * 39
    if not isinstance(plan, list):
        return Call()(plan)
    try:
        return array.array("q", [value_of(v, 0) for r in plan for v in r]).tobytes()
    except OverflowError:
        return b"\xff" * 40


def _args_for(call, args, world, rank):
    """One rank's arguments: its own buffers, the same checked values as the others."""
    mat = []
    matrix = next((x[1] for x in args if isinstance(x, tuple) and x[:1] == ("COUNTS",)), None)
    for x in args:
        if isinstance(x, tuple) and x[:1] == ("PLAN",):
            mat.append(_plan_blob(x[1]))
        elif isinstance(x, tuple) and x[:1] == ("COUNTS",):
            mat.append(_counts_blob(x[1], world))
        elif isinstance(x, A2A):
            if x.bad is not None:
                mat.append(call(x.bad))
            elif not isinstance(matrix, list):  # the call is refused before any buffer is read
                mat.append(call(Buf(0)))
            else:
                mat.append(call(Buf(_a2a_nbytes(x.which, matrix, rank, esz_of(args[3])),
                                    x.shift)))
        elif isinstance(x, str):
            mat.append(None)
        else:
            mat.append(call(x))
    if "OWN" in args:
        i = args.index("OWN")
        mat[i] = mat[0] + rank * (args[0].nbytes // world) if isinstance(args[0], Buf) else 0
    if "DST" in args:
        mat[args.index("DST")] = mat[0]
    return mat


def _run_collective(call, spec):
    world, op, args, use, extra = spec
    gs = groups()
    views = [gs.solo] if world == 1 else gs.pair
    works = []
    for v in views:
        mat = _args_for(call, args, world, v.rank)
        mat.append(tuple(call.keep))  # keep: the tensors
        if extra > 0:
            mat.append(0)
        elif extra < 0:
            mat.pop()
        try:
            works.append(getattr(v, op)(*mat))
        except ALLOWED["shm"]:
            works.append(None)
        del mat  # the plan bytes are freed here, before the op runs
    filler = [bytes(32) for _ in range(64)]  # reuse their memory
    del filler
    live = [w for w in works if w is not None]
    if live and len(live) != len(works):  # one rank refused what the other queued
        gs.renew()
        return
    if use == "drop":  # the handles' deallocation waits for the ops
        del works, live
        return
    if use == "close":
        for v in views:
            v.close()
    failed = use == "close"
    for w in live:
        try:
            if use == "threads":
                ts = [threading.Thread(target=_swallow, args=(w.wait,)) for _ in range(3)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
            w.wait()
            if use == "twice":
                w.wait()
        except RuntimeError:
            failed = True
        if not (w.is_completed() and w.op in OPS):
            raise AssertionError(f"a waited {w.op!r} handle is not completed")
    if failed:
        gs.renew()


def _swallow(fn):
    try:
        fn()
    except RuntimeError:
        pass


for _op in OPS:
    entry(f"ShmGroup.{_op}", "shm", _collective(_op))(_run_collective)


@entry("ShmGroup.misc", "shm", st.lists(st.sampled_from(
    ["wait_attached", "drain", "close", "closed", "rank", "world_size", "nbytes", "args",
     "fail", "fail_bad", "failure"]
    + [("failure", bad) for bad in (-1.0, float("nan"), float("inf"), 1e7, "1", None)]),
    min_size=1, max_size=6))
def _run_group_misc(call, spec):
    """wait_attached, drain, fail, failure, close and the attributes, in any order, closed
    or not."""
    g = C.ShmGroup(_name(), True, 1, 0, 512, 1.0, "misc", [0])
    try:
        for what in spec:
            try:
                if what == "args":
                    g.drain(1)
                elif what == "fail":
                    g.fail("x" * 600)  # longer than a failure message holds
                elif what == "fail_bad":
                    g.fail(b"not a str")
                elif what == "failure":
                    msg = g.failure(0.01)
                    assert msg is None or "failed: " in msg, msg
                elif isinstance(what, tuple):  # a bad timeout: ValueError / TypeError
                    g.failure(what[1])
                elif what in ("closed", "rank", "world_size", "nbytes"):
                    getattr(g, what)
                else:
                    getattr(g, what)()
            except (RuntimeError, TypeError, ValueError):
                pass
    finally:
        g.close()


# --------------------------------------------------------------------------- cfsdp._core

KINDS = ["plain", "plain", "plain", "odd", "noncontig", "wrapper", "meta", "neg", "shrunk",
         "2d", "int32", "param"]


DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16]


class T:
    """A tensor spec: kind, numel, dtype."""

    def __init__(self, kind, n, dtype):
        self.kind, self.n, self.dtype = kind, n, dtype

    def __repr__(self):
        return f"T({self.kind}, {self.n}, {str(self.dtype)[6:]})"

    def make(self):
        n, dtype = self.n, self.dtype
        if self.kind == "odd":
            esz = torch.empty((), dtype=dtype).element_size()
            return torch.frombuffer(bytearray(n * esz + 3), dtype=dtype, count=n, offset=1) \
                if n else torch.empty(0, dtype=dtype)
        if self.kind == "noncontig":
            return torch.zeros(2 * n, dtype=dtype)[::2]
        if self.kind == "wrapper":
            return Wrapper(torch.zeros(n, dtype=dtype))
        if self.kind == "meta":
            return torch.zeros(n, dtype=dtype, device="meta")
        if self.kind == "neg":
            return torch._neg_view(torch.ones(n, dtype=dtype))
        if self.kind == "shrunk":
            t = torch.zeros(n + 2, dtype=dtype)[2:]
            t.untyped_storage().resize_(2 * t.element_size())
            return t
        if self.kind == "2d":
            return torch.zeros(2, max(n // 2, 1), dtype=dtype)
        if self.kind == "int32":
            return torch.zeros(n, dtype=torch.int32)
        if self.kind == "param":
            return torch.nn.Parameter(torch.zeros(n, dtype=dtype))
        return torch.zeros(n, dtype=dtype)


def tspec(h, n, dtype=None):
    """A tensor of n elements: plain (valid) or, hostile, of another kind, size or dtype."""
    dtype = dtype or h.draw(st.sampled_from(DTYPES))
    if h.bad():
        return T(h.draw(st.sampled_from(KINDS)), h.draw(st.sampled_from([n, n, 0, n + 1])),
                 h.draw(st.sampled_from(DTYPES)))
    return T(h.draw(st.sampled_from(["plain", "plain", "param", "odd"])), n, dtype)


def _make(call, spec):
    if isinstance(spec, T):
        return spec.make()
    if isinstance(spec, list):
        return [_make(call, x) for x in spec]
    return call(spec)


@st.composite
def _core_sca(draw):
    h = H(draw)
    n = draw(st.integers(0, 12))
    return "scale_cast_add", [tspec(h, n), tspec(h, n), h.fl(), h.checked(st.booleans())]


@st.composite
def _core_norm(draw):
    h = H(draw)
    return "norm_partial", [tspec(h, draw(st.integers(0, 12))),
                            h.fl(st.sampled_from([1.0, 2.0, 3.0, float("inf")]))]


@st.composite
def _core_memcpy(draw):
    h = H(draw)
    n, dt = draw(st.integers(0, 12)), draw(st.sampled_from(DTYPES))
    return "shm_memcpy", [tspec(h, n, dt), tspec(h, n, dt)]


@st.composite
def _core_chunk(draw, name):
    h, (world, rows, nat, shard) = H(draw), draw(chunk_unit())
    dt = draw(st.sampled_from(DTYPES))
    natural, gathered = tspec(h, nat, dt), tspec(h, world * shard, dt)
    plan, w, s = plan_spec(h, rows), h.checked(world), h.checked(shard)
    if name == "chunk_unpack":
        return name, [natural, gathered, plan, w, s]
    return name, [gathered, natural, plan, w, s, h.fl(st.sampled_from([1.0, 2.0, 3.0]))]


@st.composite
def _core_reduce(draw):
    h = H(draw)
    n, dt = draw(st.integers(0, 12)), draw(st.sampled_from(DTYPES))
    return "shm_reduce", [tspec(h, n, dt), [tspec(h, n, dt) for _ in range(
        draw(st.integers(0 if h.rate else 1, 4)))], h.fl(st.sampled_from([1.0, 0.5]))]


@st.composite
def _core_shard_fill(draw):
    h = H(draw)
    dt = draw(st.sampled_from(DTYPES))
    srcs = [tspec(h, draw(st.integers(0, 8)), dt) for _ in range(draw(st.integers(0, 3)))]
    offs = [h.checked(st.integers(0, 20)) for _ in srcs]
    return "shard_fill", [tspec(h, draw(st.integers(0, 12)), dt), h.checked(st.integers(0, 20)),
                          srcs, offs]


def _optim_case(h, n_bufs):
    n = h.draw(st.integers(0, 12))
    return [tspec(h, n, torch.float32) for _ in range(n_bufs)], h.draw(ranges_spec(h, n))


@st.composite
def _core_sgd(draw):
    h = H(draw)
    bufs, ranges = _optim_case(h, 3)
    return "sgd_step", [*bufs, ("RANGES", ranges)], dict(
        lr=h.fl(st.sampled_from([0.1, 0.5])), momentum=h.fl(st.sampled_from([0.0, 0.9])),
        dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
        first_step=h.checked(st.booleans()))


@st.composite
def _core_adam(draw):
    h = H(draw)
    bufs, ranges = _optim_case(h, 5)
    return "adam_step", [*bufs, ("RANGES", ranges)], dict(
        lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False,
        amsgrad=draw(st.booleans()), maximize=False, step=h.fl(st.sampled_from([1.0, 2.0])))


@st.composite
def _core_muon(draw):
    h = H(draw)
    bufs, ranges = _optim_case(h, 3)
    return "muon_momentum", [*bufs, ("RANGES", ranges)], dict(
        momentum=h.fl(st.sampled_from([0.95, 0.3, 0.0])), nesterov=h.checked(st.booleans()))


@st.composite
def _core_layout(draw):
    return "plan_layout", list(draw(_plan_layout()))


def _run_core(call, spec):
    name, args, *kw = spec
    made = []
    for a in args:
        if isinstance(a, tuple) and a[:1] == ("RANGES",):
            made.append(materialise_ranges(call, a[1]))
        else:
            made.append(_make(call, a))
    getattr(_core, name)(*made, **(call(kw[0]) if kw else {}))


for _name_, _strategy in [("scale_cast_add", _core_sca()), ("norm_partial", _core_norm()),
                          ("shm_memcpy", _core_memcpy()),
                          ("chunk_unpack", _core_chunk("chunk_unpack")),
                          ("chunk_pack", _core_chunk("chunk_pack")),
                          ("shm_reduce", _core_reduce()), ("shard_fill", _core_shard_fill()),
                          ("sgd_step", _core_sgd()), ("adam_step", _core_adam()),
                          ("muon_momentum", _core_muon()),
                          ("plan_layout", _core_layout())]:
    entry(f"_core.{_name_}", "_core", _strategy)(_run_core)


# --------------------------------------------------------------------------------------
# the coverage the test checks, and the run
# --------------------------------------------------------------------------------------


def c_callables() -> list[str]:
    """Every public callable of cfsdp._C, ShmGroup's methods and attributes and ShmWork's
    (the names ENTRIES must cover)."""
    names = [n for n in dir(C) if not n.startswith("_") and callable(getattr(C, n))]
    names += [f"ShmGroup.{n}" for n in vars(C.ShmGroup) if not n.startswith("_")]
    names += [f"ShmWork.{n}" for n in vars(C.ShmWork) if not n.startswith("_")]
    names += [f"ShmSegment.{n}" for n in vars(C.ShmSegment) if not n.startswith("_")]
    return sorted(names)


# what covers what is not an entry of its own
COVERED_BY = {
    "ShmWork": "ShmGroup.all_gather",  # no constructor; made by every collective
    "ShmWork.wait": "ShmGroup.all_gather", "ShmWork.is_completed": "ShmGroup.all_gather",
    "ShmWork.op": "ShmGroup.all_gather",
    **{f"ShmGroup.{n}": "ShmGroup.misc" for n in ("wait_attached", "drain", "fail", "failure",
                                                  "close", "closed", "rank", "world_size",
                                                  "nbytes")},
    **{f"ShmSegment.{n}": "ShmSegment" for n in ("unlink", "nbytes", "path")},
}


def fuzz_one(name: str, fd: int, seed: int, examples: int) -> None:
    """Run `examples` cases of entry point `name`, each logged to `fd` first."""
    fam, strategy, run = ENTRIES[name]
    allowed = ALLOWED[fam]

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def check(spec):
        os.write(fd, f"CASE {name} {spec!r}"[:6000].encode("utf-8", "replace") + b"\n")
        call = Call()
        try:
            run(call, spec)
        except allowed:
            pass
        finally:
            call.keep.clear()

    check()


def main(family: str, log_path: str, seed: int, examples: int) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for name in [n for n, (fam, _, _) in ENTRIES.items() if fam == family]:
        t0 = time.perf_counter()
        fuzz_one(name, fd, seed, examples)
        print(f"DONE {name} {time.perf_counter() - t0:.1f}s", flush=True)
    if GROUPS is not None:
        GROUPS.close()
    print("FUZZ-OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
