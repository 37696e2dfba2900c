"""The one door to the C core: picks ``cfsdp._C`` or its Python twins.

``CFSDP_IMPL=c`` (the default) uses the C extension and fails loudly (an
ImportError saying why) when it is missing or broken; ``CFSDP_IMPL=python``
runs everything on the twins in ``cfsdp._ref``.  Tensors that are not on the
CPU always take the twins' torch ops (the device-generic path), whatever the
backend, so CUDA tensors never reach C.

Tensors cross into C as (address, numel, dtype code); the caller guarantees
the memory stays alive for the duration of the call (C allocates nothing).
What may cross is one rule, :func:`c_tensor_ok`: a plain ``torch.Tensor`` or
``nn.Parameter`` (not a subclass: a ``DTensor``, a ``FakeTensor`` or any
``__torch_dispatch__`` wrapper has no memory of its own at its address), on
the CPU, strided and contiguous, of a C dtype, with no lazy negation bit, no
functorch/functional wrapper, and real storage that holds it.  Anything else
takes the twins' torch ops, so the result is the same either way (or torch's
own error).  Any address is fine (the C loops load and store alignment-safe),
but the fused optimizer steps' take fp32-aligned buffers only
(``_optim_c_ok``; ``FusedPlan`` makes one bucket per parameter of an odd
offset, and C refuses a misaligned address).  The fused optimizer
(``cfsdp.optim``) crosses through ``FusedPlan``, a plan built once from tensors
checked in full and stepped many times, with only what can change between
steps checked per step.  A CPU tensor whose storage cannot hold it (freed or shrunk
with ``untyped_storage().resize_()``) is a ``ValueError`` on every path:
torch's own ops would read past the storage too.
While a recording device layer is installed (``set_twins_only``, set by
``_runtime.device.use``) no tensor crosses (``c_tensor_ok`` is False): every call takes its
twin, as an accelerator tensor's does, so every op goes through torch's dispatcher.
Calls that may split a large copy across threads (``chunk_pack``,
``chunk_unpack``) pass ``torch.get_num_threads()`` as the limit, so
``OMP_NUM_THREADS`` / ``torch.set_num_threads`` bound the C core as they
bound torch (the core's own cap is ``_C.MAX_THREADS`` and the online CPUs).
"""

from __future__ import annotations

import array
import operator
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import _ref
from ._torch import core as _torch_core

_IMPL_ENV = "CFSDP_IMPL"


def _pick_backend() -> str:
    impl = os.environ.get(_IMPL_ENV, "c").strip().lower() or "c"
    if impl not in ("c", "python"):
        raise ImportError(
            f"{_IMPL_ENV}={impl!r} is not a cfsdp backend; use {_IMPL_ENV}=c "
            f"(the C core, default) or {_IMPL_ENV}=python (the pure-Python twins)"
        )
    return impl


backend: str = _pick_backend()
_C = None
if backend == "c":
    try:
        from . import _C  # type: ignore[attr-defined,no-redef]
    except ImportError as e:  # never fall back silently
        raise ImportError(
            "cfsdp's C extension cfsdp._C could not be imported "
            f"({type(e).__name__}: {e}). Rebuild it with `pip install .` from the "
            f"cfsdp source tree, or set {_IMPL_ENV}=python to run on the "
            "pure-Python twins (slower)."
        ) from e

# dtype codes shared with csrc/cfsdp.h (CF_DTYPE_*)
DTYPE_CODES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.bfloat16: 2,
    torch.float16: 3,
}


@dataclass(frozen=True)
class ShardSlice:
    """The part of one parameter that lies in one rank's shard."""

    param_start: int  # first element of the flattened parameter in the shard
    numel: int  # elements of the parameter in the shard (0: none)
    shard_offset: int  # where they start in the rank's shard


@dataclass(frozen=True)
class Layout:
    """A unit's flat layout; see ``cfsdp._ref.layout`` for the invariants."""

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    align_numel: int
    world_size: int
    flat_numel: int  # numel of the unsharded flat parameter (padding included)
    shard_numel: int  # numel of every rank's (padded) shard
    slices: tuple[tuple[ShardSlice, ...], ...]  # [rank][param]

    @property
    def padded_numel(self) -> int:
        """Numel of the all-gather buffer: ``world_size * shard_numel``."""
        return self.world_size * self.shard_numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Flat ``[start, end)`` owned by ``rank`` (end may pass ``flat_numel``)."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel


def plan_layout(numels: Sequence[int], align_numel: int, world_size: int) -> Layout:
    numels = tuple(int(n) for n in numels)
    fn = _C.plan_layout if _C is not None else _ref.plan_layout_lists
    offsets, flat_numel, shard_numel, flat_slices = fn(numels, align_numel, world_size)
    p = len(numels)
    slices = tuple(
        tuple(
            ShardSlice(*flat_slices[3 * (r * p + i) : 3 * (r * p + i) + 3])
            for i in range(p)
        )
        for r in range(world_size)
    )
    return Layout(
        numels, tuple(offsets), align_numel, world_size, flat_numel, shard_numel, slices
    )


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_has_storage = _torch_core.has_storage
_functorch_wrapped = _torch_core.is_functorch_wrapped


def _storage_error(t: torch.Tensor, need: int, have: int) -> ValueError:
    return ValueError(
        f"cfsdp: a {t.dtype} tensor of shape {tuple(t.shape)} at storage offset "
        f"{t.storage_offset()} needs {need} bytes of storage but its storage has {have} "
        "(freed or shrunk with untyped_storage().resize_()?); neither the C core nor "
        "torch can read it: keep its storage allocated while cfsdp uses it"
    )


_TWINS_ONLY = False  # set_twins_only: a recording device layer is installed


def set_twins_only(on: bool) -> None:
    """While on, no tensor may cross into C (``c_tensor_ok`` is False): every call takes
    its twin, as an accelerator tensor's does.  Set by the runtime's device layer
    (``_runtime.device.use``) for a layer whose tensors must take the accelerator path."""
    global _TWINS_ONLY
    _TWINS_ONLY = bool(on)


def c_tensor_ok(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory may cross into C as (address, numel, dtype code): the
    rule of the module doc, also the shared-memory collectives' (``cfsdp._runtime.comm``;
    nothing in it depends on an address, so it picks the same route on every rank).
    ``ValueError`` for a CPU tensor whose storage cannot hold it.  On the hot path of
    every call: cheap checks first, no Python loop for a contiguous tensor."""
    if type(t) not in _PLAIN or not t.is_cpu or t.layout != torch.strided or _TWINS_ONLY:
        return False
    if not _has_storage(t) or _functorch_wrapped(t):
        return False
    contiguous, n = t.is_contiguous(), t.numel()
    if n:
        span = n if contiguous else 1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride()))
        need = (t.storage_offset() + span) * t.element_size()
        have = t.untyped_storage().nbytes()
        if need > have:
            raise _storage_error(t, need, have)
    return contiguous and t.dtype in DTYPE_CODES and not t.is_neg() and (n == 0 or t.data_ptr())


def address(t: torch.Tensor) -> int:
    """``t``'s address (``data_ptr()``), for comparing and laying out memory in Python:
    identity, aliasing, offsets between buffers.  Outside this module an address is
    never handed to C: what crosses goes through this module's entry points, which
    check the tensors themselves (``c_tensor_ok``; tests/unit/test_layers.py)."""
    return t.data_ptr()


def storage_address(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (``untyped_storage().data_ptr()``): two tensors
    with the same one share memory (see ``address``)."""
    return t.untyped_storage().data_ptr()


def _c_ok(*tensors: torch.Tensor) -> bool:
    """C takes the call: the core is on and every tensor may cross (each is checked
    whatever the backend, so a broken storage fails the same way on the twins)."""
    ok = all([c_tensor_ok(t) for t in tensors])
    return _C is not None and ok


def shard_fill(
    dst: torch.Tensor,
    shard_start: int,
    srcs: Sequence[torch.Tensor],
    offsets: Sequence[int],
) -> None:
    """Fill one rank's shard straight from the original tensors; see the twin."""
    if len(srcs) != len(offsets):
        raise AssertionError("shard_fill: srcs and offsets differ in length")
    for s in srcs:
        if s.dtype != dst.dtype:
            raise AssertionError(f"shard_fill: dtype {s.dtype} != {dst.dtype}")
    if _c_ok(dst, *srcs):
        _C.shard_fill(
            dst.data_ptr(),
            dst.numel(),
            dst.element_size(),
            shard_start,
            [(s.data_ptr(), s.numel(), o) for s, o in zip(srcs, offsets)],
        )
    else:
        _ref.shard_fill(dst, shard_start, srcs, offsets)


def _check_1d(fn: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dim() != 1:
            raise AssertionError(f"{fn}: {name} must be 1-D, got shape {tuple(t.shape)}")


def chunk_unpack(
    dst_natural: torch.Tensor,
    src_gathered: torch.Tensor,
    plan: Sequence[tuple[int, int, int, int, int]],
    world_size: int,
    shard_numel: int,
) -> None:
    """FSDP2 copy-out: the rank-major all-gather output -> the natural buffer, in one
    pass.  ``plan`` holds ``(nat_off, numel, chunk_numel, shard_off, outer)`` per
    parameter (``outer``: 1 for dim 0, the blocks of an even ``Shard(d)`` chunk); see
    ``cfsdp._ref.chunk`` for the layout and the plan's invariants (a plan that
    breaks them is a ``ValueError`` naming the parameter index)."""
    _check_1d("chunk_unpack", dst_natural=dst_natural, src_gathered=src_gathered)
    if dst_natural.dtype != src_gathered.dtype:
        raise AssertionError(
            f"chunk_unpack: dtype {src_gathered.dtype} != {dst_natural.dtype}"
        )
    if _c_ok(dst_natural, src_gathered):
        _C.chunk_unpack(
            dst_natural.data_ptr(),
            dst_natural.numel(),
            src_gathered.data_ptr(),
            src_gathered.numel(),
            dst_natural.element_size(),
            plan,
            world_size,
            shard_numel,
            torch.get_num_threads(),
        )
    else:
        _ref.chunk_unpack(dst_natural, src_gathered, plan, world_size, shard_numel)


def chunk_pack(
    dst_gathered: torch.Tensor,
    src_natural: torch.Tensor,
    plan: Sequence[tuple[int, int, int, int, int]],
    world_size: int,
    shard_numel: int,
    divisor: float = 1.0,
    ranks: Optional[tuple[int, int]] = None,
) -> None:
    """FSDP2 copy-in: the natural buffer -> ranks ``[lo, hi)`` (``ranks``, default all)
    of the rank-major layout, ``dst = cast(src / divisor)`` rounded as
    ``scale_cast_add``, padding and gaps zeroed, in one pass.  ``ranks=(rank, rank +
    1)`` builds one rank's shard.  See ``cfsdp._ref.chunk``."""
    _check_1d("chunk_pack", dst_gathered=dst_gathered, src_natural=src_natural)
    lo, hi = (0, world_size) if ranks is None else ranks
    if _c_ok(dst_gathered, src_natural):
        _C.chunk_pack(
            dst_gathered.data_ptr(),
            dst_gathered.numel(),
            DTYPE_CODES[dst_gathered.dtype],
            src_natural.data_ptr(),
            src_natural.numel(),
            DTYPE_CODES[src_natural.dtype],
            plan,
            world_size,
            shard_numel,
            lo,
            hi,
            float(divisor),
            torch.get_num_threads(),
        )
    else:
        _ref.chunk_pack(
            dst_gathered, src_natural, plan, world_size, shard_numel, divisor, (lo, hi)
        )


def scale_cast_add(
    dst: torch.Tensor, src: torch.Tensor, divisor: float, accumulate: bool
) -> None:
    """``dst (+)= cast(src / divisor)`` in one pass; see the twin for rounding."""
    if dst.numel() != src.numel():
        raise AssertionError(
            f"scale_cast_add: numel {dst.numel()} != {src.numel()}"
        )
    if _c_ok(dst, src):
        _C.scale_cast_add(
            dst.data_ptr(),
            DTYPE_CODES[dst.dtype],
            src.data_ptr(),
            DTYPE_CODES[src.dtype],
            dst.numel(),
            float(divisor),
            bool(accumulate),
        )
    else:
        _ref.scale_cast_add(dst, src, divisor, accumulate)


def norm_partial(t: torch.Tensor, p: float) -> torch.Tensor:
    """The local p-norm statistic of ``t`` (``sum |x|^p``, or ``max |x|`` for
    ``p = inf``) in float64, as a 0-dim float64 tensor on ``t.device``; one pass
    over the whole buffer.  See the twin for the exact contract."""
    if _c_ok(t):
        return torch.tensor(
            _C.norm_partial(t.data_ptr(), DTYPE_CODES[t.dtype], t.numel(), float(p)),
            dtype=torch.float64,
        )
    return _ref.norm_partial(t, p)


def shm_reduce(dst: torch.Tensor, srcs: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """``dst = round(scale * sum(srcs))`` summed in float32 (float64 for float64) in
    source order, rounded once: the sum kernel of the shared-memory collectives
    (``cfsdp._runtime.comm``); see the twin ``cfsdp._ref.shm_reduce``."""
    for s in srcs:
        if s.dtype != dst.dtype or s.numel() != dst.numel():
            raise AssertionError(
                f"shm_reduce: source {s.dtype}[{s.numel()}] != dst {dst.dtype}[{dst.numel()}]"
            )
    if srcs and _c_ok(dst, *srcs):
        _C.shm_reduce(
            dst.data_ptr(),
            [s.data_ptr() for s in srcs],
            dst.numel(),
            DTYPE_CODES[dst.dtype],
            float(scale),
            torch.get_num_threads(),
        )
    else:
        _ref.shm_reduce(dst, srcs, scale)


def shm_memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s bytes into ``dst`` (equal byte sizes, no overlap) as the
    shared-memory collectives copy; see the twin ``cfsdp._ref.shm_memcpy``."""
    nbytes = dst.numel() * dst.element_size()
    if src.numel() * src.element_size() != nbytes:
        raise AssertionError("shm_memcpy: byte sizes differ")
    if _c_ok(dst, src):
        _C.shm_memcpy(dst.data_ptr(), src.data_ptr(), nbytes, torch.get_num_threads())
    else:
        _ref.shm_memcpy(dst, src)


class ShmSegment:
    """The host-shared segment facility (C: ``cf_shm_map_file`` through
    ``cfsdp._C.ShmSegment``; twin: ``cfsdp._ref.ShmSegment``, the same checks and
    messages): the file ``path`` mapped ``MAP_SHARED``, ``nbytes`` long.  ``create`` makes
    it (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600, pages reserved); else it attaches
    (``O_NOFOLLOW``, never creating) and requires exactly ``nbytes``.  Either way a file
    that is not this job's (another owner, group or other permission bits, not a regular
    file, a symbolic link) is a ``PermissionError`` naming it, its owner and mode, before
    it is sized or mapped ("Trust" in ``csrc/shm.c``); a failing system call a
    ``RuntimeError`` naming the call, path and errno; a size that does not match a
    ``ValueError``.  ``tensor()`` views the whole mapping as uint8 and keeps it mapped as
    long as the view (or any view of it) lives; ``unlink()`` removes the name."""

    __slots__ = ("_seg", "_buffer")

    def __init__(self, path: str, create: bool, nbytes: int):
        if _C is not None:
            self._seg = self._buffer = _C.ShmSegment(path, bool(create), int(nbytes))
        else:
            self._seg = _ref.ShmSegment(path, bool(create), int(nbytes))
            self._buffer = self._seg.buffer

    @property
    def path(self) -> str:
        return self._seg.path

    @property
    def nbytes(self) -> int:
        return self._seg.nbytes

    def tensor(self) -> torch.Tensor:
        """The mapping as a 1-D uint8 tensor (it holds the mapping alive)."""
        return torch.frombuffer(self._buffer, dtype=torch.uint8)

    def unlink(self) -> None:
        """Remove the name (the mapping stays valid); a name already gone is fine."""
        self._seg.unlink()


# ---------------------------------------------------------------------------
# Fused optimizer steps (cfsdp.optim; C: csrc/optim.c, twin: cfsdp._ref.optim).
# Ranges are (start, len) element pairs, the same for every buffer, counted
# from each buffer's address: an int64 ``array.array('q')`` of flat pairs (read
# in place by C) or a sequence of pairs.


def optim_c_available() -> bool:
    """Whether cfsdp.optim steps fp32 CPU tensors in C (``CFSDP_IMPL=c``)."""
    return _C is not None


def _adam_addrs(
    param: int, grad: int, exp_avg: int, exp_avg_sq: int, max_exp_avg_sq: Optional[int],
    ranges, *, step: float, lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, decoupled: bool, amsgrad: bool, maximize: bool,
) -> None:
    """One Adam/AdamW step of fp32 CPU memory at addresses this module took from checked
    tensors (``adam_step``), in C; see ``_C.adam_step``."""
    _C.adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, ranges, DTYPE_CODES[torch.float32],
                 float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
                 float(step), decoupled, amsgrad, maximize, torch.get_num_threads())


def _sgd_addrs(
    param: int, grad: int, momentum_buffer: Optional[int], ranges, *, lr: float,
    momentum: float, dampening: float, weight_decay: float, nesterov: bool, maximize: bool,
    first_step: bool,
) -> None:
    """One SGD step of fp32 CPU memory at checked addresses, in C; see ``_C.sgd_step``."""
    _C.sgd_step(param, grad, momentum_buffer, ranges, DTYPE_CODES[torch.float32], float(lr),
                float(momentum), float(dampening), float(weight_decay), nesterov, maximize,
                first_step, torch.get_num_threads())


def _muon_addrs(grad: int, momentum_buffer: int, update: Optional[int], ranges, *,
                momentum: float, nesterov: bool) -> None:
    """Muon's momentum of fp32 CPU memory at checked addresses, in C; see
    ``_C.muon_momentum``."""
    _C.muon_momentum(grad, momentum_buffer, update, ranges, DTYPE_CODES[torch.float32],
                     float(momentum), nesterov, torch.get_num_threads())


def _optim_c_ok(*tensors: Optional[torch.Tensor]) -> bool:
    """C takes a fused step: fp32 1-D buffers that may cross, fp32-aligned (the fused
    loops' one requirement of an address; the twin takes any)."""
    return _c_ok(*(t for t in tensors if t is not None)) and all(
        t.dtype == torch.float32 and t.dim() == 1 and t.data_ptr() % 4 == 0
        for t in tensors if t is not None
    )


def adam_step(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: Optional[torch.Tensor], ranges, **hp,
) -> None:
    """One Adam step over ``ranges`` of flat 1-D buffers: C for fp32 CPU buffers,
    else the twin (same contract: ``cfsdp._ref.optim.adam_step``).  The ranges
    must lie inside every buffer (checked here)."""
    ams = max_exp_avg_sq if hp.get("amsgrad") else None
    ranges = _check_optim_ranges(ranges, param, grad, exp_avg, exp_avg_sq, ams)
    if _optim_c_ok(param, grad, exp_avg, exp_avg_sq, ams):
        _adam_addrs(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                    exp_avg_sq.data_ptr(), ams.data_ptr() if ams is not None else None,
                    ranges, **hp)
    else:
        _ref.adam_step(param, grad, exp_avg, exp_avg_sq, ams, ranges, **hp)


def sgd_step(
    param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor], ranges,
    **hp,
) -> None:
    """One SGD step over ``ranges`` of flat 1-D buffers (see ``adam_step``)."""
    buf = momentum_buffer if hp.get("momentum") else None
    ranges = _check_optim_ranges(ranges, param, grad, buf)
    if _optim_c_ok(param, grad, buf):
        _sgd_addrs(param.data_ptr(), grad.data_ptr(),
                   buf.data_ptr() if buf is not None else None, ranges, **hp)
    else:
        _ref.sgd_step(param, grad, buf, ranges, **hp)


def muon_momentum(
    grad: torch.Tensor, momentum_buffer: torch.Tensor, update: Optional[torch.Tensor], ranges,
    *, momentum: float, nesterov: bool,
) -> None:
    """Muon's momentum over ``ranges`` of flat 1-D buffers (``update`` receives the
    Nesterov update; used only when ``nesterov``): C for fp32 CPU buffers, else the twin
    (``cfsdp._ref.optim.muon_momentum``).  The ranges must lie inside every buffer."""
    upd = update if nesterov else None
    ranges = _check_optim_ranges(ranges, grad, momentum_buffer, upd)
    if _optim_c_ok(grad, momentum_buffer, upd):
        _muon_addrs(grad.data_ptr(), momentum_buffer.data_ptr(),
                    upd.data_ptr() if upd is not None else None, ranges,
                    momentum=momentum, nesterov=nesterov)
    else:
        _ref.optim.muon_momentum(grad, momentum_buffer, upd, ranges, momentum=momentum,
                                 nesterov=nesterov)


def muon_momentum_tensor(grad: torch.Tensor, momentum_buffer: torch.Tensor, *,
                         momentum: float, nesterov: bool) -> torch.Tensor:
    """Muon's momentum of one tensor of any dtype and device, in torch ops (the twin's
    ``muon_momentum_tensor``: cfsdp.optim.Muon's path for what C does not take)."""
    return _ref.optim.muon_momentum_tensor(grad, momentum_buffer, momentum=momentum,
                                           nesterov=nesterov)


def adam_tensor(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, max_exp_avg_sq: Optional[torch.Tensor], **hp) -> None:
    """One Adam step of one tensor of any dtype and device, in torch ops (the twin's
    ``adam_tensor``: cfsdp.optim's path for what C does not step)."""
    _ref.optim.adam_tensor(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, **hp)


def sgd_tensor(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor],
               **hp) -> None:
    """One SGD step of one tensor in torch ops (the twin's ``sgd_tensor``)."""
    _ref.optim.sgd_tensor(param, grad, momentum_buffer, **hp)


def _check_optim_ranges(ranges, *bufs: Optional[torch.Tensor]) -> array.array:
    """The ranges as one snapshot, ``array('q')`` of flat (start, len) pairs (every value
    read once: what is checked here is what C reads), checked to lie inside every buffer."""
    if isinstance(ranges, array.array):
        flat = array.array("q", ranges)
    else:
        flat = array.array("q")
        for i, pair in enumerate(ranges):
            try:
                pair = tuple(pair)
            except TypeError:
                raise TypeError("each range must be a (start, len) pair") from None
            if len(pair) != 2:
                raise ValueError(f"range {i} must be (start, len), got {len(pair)} items")
            flat.append(operator.index(pair[0]))
            flat.append(operator.index(pair[1]))
    end = max((s + n for s, n in zip(flat[0::2], flat[1::2]) if n > 0), default=0)
    for t in bufs:
        if t is not None and end > t.numel():
            raise ValueError(f"ranges end at element {end}, past a buffer of {t.numel()} elements")
    return flat


_F32 = torch.float32
_F32_CODE = DTYPE_CODES[_F32]
_STRIDED = torch.strided
_Tensor = torch.Tensor


def fused_ok(t: torch.Tensor) -> bool:
    """Whether ``t`` (a local tensor) may be stepped in place by the fused optimizer loops:
    fp32 and :func:`c_tensor_ok` in full.  ``cfsdp.optim`` routes by it; ``FusedPlan``
    checks every tensor it is built from with it."""
    return t.dtype is _F32 and c_tensor_ok(t)


class FusedBucket:
    """Parameters that ONE fused C call steps (see ``FusedPlan``): each one's gradient and
    each of its states sit at the same byte offset from the parameter, so the call takes one
    base address per buffer and ``(start, len)`` element ranges from it (adjacent parameters
    merged): padding, frozen parameters and other groups' parameters in between are never
    touched.  ``entries`` are the caller's tags of its parameters, by address;
    ``grad_delta`` is this step's gradient offset, set by ``FusedPlan.refresh``."""

    __slots__ = ("entries", "_idx", "_ptrs", "_numels", "ranges", "base", "state_deltas",
                 "first", "grad_delta")

    def __init__(self, entries: list, idx: list, ptrs: list, numels: list, state_deltas: tuple,
                 first: bool, grad_delta: int = 0):
        self.entries, self._idx, self._ptrs, self._numels = entries, idx, ptrs, numels
        base = ptrs[0]
        flat: list[int] = []
        for ptr, n in zip(ptrs, numels):
            start = (ptr - base) // 4
            if flat and flat[-2] + flat[-1] == start:
                flat[-1] += n
            else:
                flat += [start, n]
        self.ranges = array.array("q", flat)
        self.base, self.state_deltas, self.first = base, state_deltas, first
        self.grad_delta = grad_delta

    def part(self, positions: Sequence[int]) -> "FusedBucket":
        """The bucket of the members at ``positions`` (ascending indices into ``entries``),
        with this bucket's offsets (this step's gradient offset included)."""
        return FusedBucket([self.entries[j] for j in positions],
                           [self._idx[j] for j in positions],
                           [self._ptrs[j] for j in positions],
                           [self._numels[j] for j in positions],
                           self.state_deltas, self.first, self.grad_delta)

    def spans_disjoint(self, grad_delta: int) -> bool:
        """The C core's restrict contract: param, grad and state spans do not overlap."""
        r = self.ranges
        lo, hi = 4 * r[0], 4 * (r[-2] + r[-1])
        starts = sorted([self.base, self.base + grad_delta]
                        + [self.base + d for d in self.state_deltas])
        return all(s2 - s1 >= hi - lo for s1, s2 in zip(starts, starts[1:]))

    def adam_step(self, *, step: float, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float, decoupled: bool, amsgrad: bool, maximize: bool) -> None:
        """One Adam/AdamW step of the bucket in C (states: exp_avg, exp_avg_sq[,
        max_exp_avg_sq]); see ``_C.adam_step``.  One call per bucket per step: no layer
        between it and C."""
        base, d = self.base, self.state_deltas
        if _C is None or len(d) != 2 + bool(amsgrad):
            raise AssertionError(f"FusedBucket.adam_step: C core {_C is not None}, "
                                 f"{len(d)} states for amsgrad={amsgrad}")
        _C.adam_step(base, base + self.grad_delta, base + d[0], base + d[1],
                     base + d[2] if amsgrad else None, self.ranges, _F32_CODE, float(lr),
                     float(beta1), float(beta2), float(eps), float(weight_decay), float(step),
                     decoupled, amsgrad, maximize, torch.get_num_threads())

    def sgd_step(self, *, lr: float, momentum: float, dampening: float, weight_decay: float,
                 nesterov: bool, maximize: bool) -> None:
        """One SGD step of the bucket in C (state: momentum_buffer when ``momentum``); see
        ``_C.sgd_step``."""
        base, d = self.base, self.state_deltas
        if _C is None or len(d) != (momentum != 0):
            raise AssertionError(f"FusedBucket.sgd_step: C core {_C is not None}, "
                                 f"{len(d)} states for momentum={momentum}")
        _C.sgd_step(base, base + self.grad_delta, base + d[0] if d else None, self.ranges,
                    _F32_CODE, float(lr), float(momentum), float(dampening), float(weight_decay),
                    nesterov, maximize, self.first, torch.get_num_threads())


class FusedPlan:
    """The fused optimizer step's crossing into C (``cfsdp.optim``; [Note: flat-shard fusion]
    in ``cfsdp.optim._fused``), checked once and stepped many times.

    Built from the C-path parameters of a param group: per entry the caller's tag, the
    parameter's local tensor, its local gradient and its local state tensors (the same
    kinds, in the same order, for every entry) and whether its states are still unset (SGD's
    first step).  Every tensor is checked here in full (``fused_ok``: ``c_tensor_ok``,
    fp32; states and gradient the parameter's numel; an empty parameter's states are in no
    bucket and not checked), and the entries are grouped into
    ``buckets`` (``FusedBucket``) of equal gradient and state offsets; an entry whose memory
    overlaps another's, or every entry of a run whose merged spans would overlap, gets a
    bucket of its own.  The plan keeps the tensors, so the addresses it holds stay valid.

    Each step, ``refresh`` checks what can change between steps, cheaply: every
    parameter tensor is still where it was (``p.data = t`` moves it), and every gradient (a new
    tensor each step, possibly) is a plain fp32 CPU tensor, strided, contiguous, not lazily
    negated (C would read it un-negated: a wrong step), of the parameter's numel, held by
    its storage (one whose storage was resized smaller would be read past its end), at the
    same offset as its bucket's others, with the bucket's spans disjoint.  False: the caller
    builds a new plan (or steps the tensors with torch ops).  The states are not checked
    again: the caller rebuilds the plan when they may have been replaced."""

    __slots__ = ("_params", "_states", "_ptrs", "_numels", "buckets")

    def __init__(self, entries: Sequence, params: Sequence[torch.Tensor],
                 grads: Sequence[torch.Tensor], states: Sequence[Sequence[torch.Tensor]],
                 firsts: Sequence[bool]):
        if not len(entries) == len(params) == len(grads) == len(states) == len(firsts):
            raise AssertionError("FusedPlan: entries, params, grads, states, firsts differ "
                                 "in length")
        ptrs, numels, deltas = [], [], []
        for p, g, sts in zip(params, grads, states):
            n = p.numel()
            for t in (p, g, *sts) if n else (p, g):  # an empty one crosses no memory
                if not fused_ok(t) or t.numel() != n:
                    raise AssertionError(
                        f"FusedPlan: a {type(t).__name__} {t.dtype} tensor of shape "
                        f"{tuple(t.shape)} may not be stepped in C beside a parameter of "
                        f"{n} elements (the caller routes by fused_ok)")
            ptr = p.data_ptr()
            ptrs.append(ptr)
            numels.append(n)
            deltas.append((g.data_ptr() - ptr, tuple(s.data_ptr() - ptr for s in sts)))
        self._params, self._states = list(params), [tuple(s) for s in states]
        self._ptrs, self._numels = ptrs, numels
        groups: dict = {}
        for i, ((gd, sd), first) in enumerate(zip(deltas, firsts)):
            if numels[i]:
                groups.setdefault((gd, sd, bool(first)), []).append(i)
        self.buckets: list[FusedBucket] = []
        for (gd, sd, first), idx in groups.items():
            idx.sort(key=ptrs.__getitem__)
            base = ptrs[idx[0]]
            if any((ptrs[i] - base) % 4 for i in idx) or any(d % 4 for d in sd):
                self.buckets += [self._bucket(entries, [i], sd, first) for i in idx]
                continue
            run, end = [], None
            for i in idx:
                if end is not None and ptrs[i] < end:  # aliasing: step it on its own
                    self.buckets.append(self._bucket(entries, [i], sd, first))
                    continue
                run.append(i)
                end = ptrs[i] + 4 * numels[i]
            merged = self._bucket(entries, run, sd, first)
            if len(run) > 1 and not merged.spans_disjoint(gd):
                # entries of different units can share a gradient offset by coincidence
                # (the allocator often hands back the same addresses); merged, the param
                # span may overlap the gradient span though no entry's own memory does
                self.buckets += [self._bucket(entries, [i], sd, first) for i in run]
            else:
                self.buckets.append(merged)

    def _bucket(self, entries: Sequence, idx: list, state_deltas: tuple,
                first: bool) -> FusedBucket:
        return FusedBucket([entries[i] for i in idx], idx, [self._ptrs[i] for i in idx],
                           [self._numels[i] for i in idx], state_deltas, first)

    def refresh(self, grads: Sequence[torch.Tensor]) -> bool:
        """This step's check (see the class doc) of the entries' parameters (the local
        tensors the plan was built from: the caller checks that they are still its
        parameters') and of ``grads``, their current local gradients in entry order; sets
        every bucket's ``grad_delta``."""
        if len(grads) != len(self._ptrs):
            return False
        deltas = []
        for p, g, ptr, n in zip(self._params, grads, self._ptrs, self._numels):
            if not (
                type(g) is _Tensor and p.data_ptr() == ptr and g.dtype is _F32
                and g.layout is _STRIDED and g.is_cpu and g.is_contiguous() and not g.is_neg()
                and g.numel() == n
                and g.untyped_storage().nbytes() >= 4 * (g.storage_offset() + n)
            ):
                return False
            deltas.append(g.data_ptr() - ptr)
        for b in self.buckets:
            idx = b._idx
            d = deltas[idx[0]]
            for i in idx:
                if deltas[i] != d:
                    return False
            b.grad_delta = d
            if not b.spans_disjoint(d):
                return False
        return True


# Bulk binding (C: csrc/bind_bulk.c, twin: cfsdp._ref.bind): one
# pass over tuples a unit builds once, instead of a Python loop per parameter in
# the hooks.  No tensor data is touched, so the C versions serve every device.
_B = _C if _C is not None else _ref
dict_set = _B.dict_set
dict_pop = _B.dict_pop
attr_flags = _B.attr_flags
attr_set = _B.attr_set
attr_get = _B.attr_get
shape_views = _B.shape_views


# ------------------------------------------------------------------ shared-memory segments
# csrc/shm.c's ShmGroup behind the same door: its collectives take tensors here, checked
# (c_tensor_ok, one dtype, sizes that fit), and cross as (address, numel, dtype code); the
# op keeps the tensors (and the plan's bytes) alive until it is done.  The transports
# (_runtime/comm.py, _runtime/two_level.py) never see an address.

SHM_MAX_WORLD: int = int(getattr(_C, "SHM_MAX_WORLD", 0)) if _C is not None else 0


def shm_available() -> bool:
    """Whether this build can set up shared-memory segments (the C core, with POSIX shm)."""
    return _C is not None and bool(getattr(_C, "SHM_AVAILABLE", 0))


class Admitted:
    """What :func:`admit` returns: the tensors it checked, in order, and their dtype codes.
    A segment op given it for the same tensor objects (``ShmView``'s ``admitted=``) does
    not check them again; for any other tensors it checks them as always.  So a route
    decision and the crossing share one check, and nothing unchecked crosses."""

    __slots__ = ("tensors", "codes")

    def __init__(self, tensors: tuple, codes: tuple):
        self.tensors, self.codes = tensors, codes

    def covers(self, tensors: tuple) -> bool:
        mine = self.tensors
        if len(mine) != len(tensors):
            return False
        for a, b in zip(mine, tensors):  # a loop, not all(...): this is on every op
            if a is not b:
                return False
        return True


def admit(tensors: tuple, other: Optional[torch.Tensor] = None,
          dtypes=DTYPE_CODES) -> Optional[Admitted]:
    """Whether ``tensors`` (one dtype, in ``dtypes``) and ``other`` (its own dtype in
    ``dtypes``) may cross into a shared-memory segment op (``c_tensor_ok``): an
    ``Admitted`` for ``tensors + (other,)``, else None.  ``ValueError`` as ``c_tensor_ok``."""
    dtype = tensors[0].dtype
    for t in tensors:
        if not c_tensor_ok(t) or t.dtype is not dtype or dtype not in dtypes:
            return None  # c_tensor_ok first: its ValueError holds whatever the route
    codes = (DTYPE_CODES[dtype],) * len(tensors)
    if other is None:
        return Admitted(tensors, codes)
    if not c_tensor_ok(other) or other.dtype not in dtypes:
        return None
    return Admitted((*tensors, other), (*codes, DTYPE_CODES[other.dtype]))


def counts_blob(counts: Sequence[Sequence[int]], world: int, rank: int) -> tuple:
    """An all-to-all's ``world`` x ``world`` counts (sender-major) as C takes them (int64
    bytes), with what ``rank`` sends and receives in all: (bytes, sent, received).
    ``ValueError`` for a matrix of another shape or a negative count."""
    rows = [list(r) for r in counts]
    if len(rows) != world or any(len(r) != world for r in rows):
        raise ValueError(f"cfsdp: all_to_all counts must be {world} x {world} (sender-major), "
                         f"got {len(rows)} rows of {sorted({len(r) for r in rows})}")
    flat = [int(v) for r in rows for v in r]
    if min(flat, default=0) < 0:
        raise ValueError(f"cfsdp: all_to_all counts must be >= 0, got {min(flat)}")
    return (array.array("q", flat).tobytes(), sum(rows[rank]),
            sum(r[rank] for r in rows))


class ShmView:
    """This rank's view of one shared-memory segment of ``world`` ranks (``create``: make
    it, as the segment's rank 0; else attach to ``name``); see csrc/shm.c.  Raises what
    ``ShmGroup`` raises (``PermissionError`` for a file that is not this job's)."""

    __slots__ = ("_g", "_world")

    def __init__(self, name: str, create: bool, world: int, rank: int, slot: int,
                 timeout: float, label: str, global_ranks: Sequence[int]):
        if _C is None:
            raise RuntimeError("cfsdp: shared-memory segments need the C core (CFSDP_IMPL=c)")
        self._g = _C.ShmGroup(name, create, world, rank, slot, timeout, label, list(global_ranks))
        self._world = int(self._g.world_size)  # read on every op (_blocks): fixed for life

    # -- the segment -----------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return bool(self._g.closed)

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def rank(self) -> int:
        return int(self._g.rank)

    def wait_attached(self) -> None:
        self._g.wait_attached()

    def drain(self) -> None:
        self._g.drain()

    def close(self) -> None:
        self._g.close()

    def fail(self, message: str) -> None:
        self._g.fail(message)

    def failure(self, timeout: float):
        return self._g.failure(timeout)

    # -- the collectives (each returns a ShmWork: wait(), is_completed()) ----------------
    def _code(self, op: str, *tensors: torch.Tensor, admitted: Optional[Admitted] = None) -> int:
        """The dtype code of ``tensors`` (one dtype), each checked (``c_tensor_ok``) unless
        ``admitted`` covers exactly these tensor objects."""
        if admitted is not None and admitted.covers(tensors):
            return admitted.codes[0]
        dtype = tensors[0].dtype
        for t in tensors:
            if not c_tensor_ok(t) or t.dtype != dtype:
                raise ValueError(
                    f"cfsdp: shared-memory {op}: every tensor must be a contiguous CPU tensor "
                    f"of one of {sorted(map(str, DTYPE_CODES))} (got a {type(t).__name__} of "
                    f"{t.dtype}, shape {tuple(t.shape)}, beside {dtype})")
        return DTYPE_CODES[dtype]

    def _blocks(self, op: str, whole: torch.Tensor, block: torch.Tensor) -> None:
        if whole.numel() != self._world * block.numel():
            raise ValueError(f"cfsdp: shared-memory {op}: {whole.numel()} elements are not "
                             f"{self.world_size} x {block.numel()}")

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, threads: int,
                   admitted: Optional[Admitted] = None):
        code = self._code("all_gather", out, shard, admitted=admitted)
        self._blocks("all_gather", out, shard)
        return self._g.all_gather(out.data_ptr(), shard.data_ptr(), shard.numel(), code,
                                  threads, (out, shard))

    def all_gather_unpack(self, natural: torch.Tensor, shard: torch.Tensor, plan_bytes: bytes,
                          threads: int, admitted: Optional[Admitted] = None):
        code = self._code("all_gather_unpack", natural, shard, admitted=admitted)
        return self._g.all_gather_unpack(natural.data_ptr(), natural.numel(), shard.data_ptr(),
                                         shard.numel(), code, plan_bytes, threads,
                                         (natural, shard, plan_bytes))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, scale: float, threads: int,
                       admitted: Optional[Admitted] = None):
        code = self._code("reduce_scatter", out, inp, admitted=admitted)
        self._blocks("reduce_scatter", inp, out)
        return self._g.reduce_scatter(out.data_ptr(), inp.data_ptr(), out.numel(), code,
                                      float(scale), threads, (out, inp))

    def reduce_scatter_pack(self, out: torch.Tensor, natural: torch.Tensor, divisor: float,
                            scale: float, plan_bytes: bytes, threads: int,
                            admitted: Optional[Admitted] = None):
        if admitted is not None and admitted.covers((out, natural)):
            out_code, nat_code = admitted.codes
        else:
            out_code = self._code("reduce_scatter_pack", out)
            nat_code = self._code("reduce_scatter_pack", natural)
        return self._g.reduce_scatter_pack(out.data_ptr(), out.numel(), out_code,
                                           natural.data_ptr(), natural.numel(), nat_code,
                                           float(divisor), float(scale), plan_bytes, threads,
                                           (out, natural, plan_bytes))

    def all_reduce(self, t: torch.Tensor, scale: float, threads: int,
                   admitted: Optional[Admitted] = None):
        code = self._code("all_reduce", t, admitted=admitted)
        return self._g.all_reduce(t.data_ptr(), t.data_ptr(), t.numel(), code, float(scale),
                                  threads, (t,))

    def broadcast(self, t: torch.Tensor, root: int, threads: int,
                  admitted: Optional[Admitted] = None):
        code = self._code("broadcast", t, admitted=admitted)
        return self._g.broadcast(t.data_ptr(), t.numel(), code, int(root), threads, (t,))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[Sequence[int]],
                   threads: int, admitted: Optional[Admitted] = None):
        """``counts[s][r]``: the elements rank ``s`` sends rank ``r`` (every rank passes the
        same matrix); ``inp`` is this rank's row back to back, ``out`` gets its column in
        rank order.  The sizes are checked here: C reads as many elements as the counts
        say."""
        code = self._code("all_to_all", out, inp, admitted=admitted)
        blob, sent, got = counts_blob(counts, self._world, self.rank)
        if inp.numel() != sent or out.numel() != got:
            raise ValueError(f"cfsdp: shared-memory all_to_all: rank {self.rank} sends {sent} "
                             f"and receives {got} elements by the counts, but the input has "
                             f"{inp.numel()} and the output {out.numel()}")
        return self._g.all_to_all(out.data_ptr(), inp.data_ptr(), blob, code, threads,
                                  (out, inp))

