"""``cfsdp.optim.Muon``: ``torch.optim.Muon`` with a C momentum pass, on sharded matrices.

Phase 1 of issue 27: whole parameters (a single process, DDP, each rank's own parameters
under ``ZeroRedundancyOptimizer``, a DTensor that is not sharded).  A subclass of
``torch.optim.Muon`` with the same constructor signature, defaults and validation (torch's
own: the constructor validates its arguments by building a ``torch.optim.Muon`` of one
1x1 probe parameter, so the messages and the accepted ``adjust_lr_fn`` values are the
installed torch's), ``param_groups`` keys and ``state_dict()`` format (per parameter
``momentum_buffer``, created as torch creates it: ``zeros_like(p.grad)``), so state dicts
load both ways.  On whole fp32 parameters the numbers are torch's bit for bit:

* the momentum (``buf.lerp_(grad, 1 - momentum)``, with Nesterov ``grad.lerp(buf,
  momentum)``) is one C pass over the gradient and the buffer when both are contiguous fp32
  CPU tensors (``cfsdp._core.muon_momentum``, ``csrc/optim.c``; torch's lerp rounds with
  FMA, the C loop calls ``fmaf`` at the same place), else torch's two ops
  (``cfsdp._ref.optim.muon_momentum_tensor``: bf16/fp16/fp64, strided, non-CPU, a Tensor
  momentum).  Every parameter's momentum is done before the group's Newton–Schulz;
* Newton–Schulz is torch's ``_zeropower_via_newtonschulz`` op for op (bf16, transpose of a
  tall matrix, division by the clamped Frobenius norm, ``ns_steps`` quintic iterations
  with ``addmm``), each matrix on its own ([Note: Newton-Schulz per matrix] below);
* the update is torch's: ``p.mul_(1 - lr * weight_decay)``,
  ``p.add_(update, alpha=-adjusted_lr)`` with torch's ``_adjust_lr`` of the matrix's
  ``(m, n)``.

Beyond torch: a parameter of ``ndim >= 3`` (stacked experts ``[E, M, N]``) is a batch of its
trailing ``(M, N)`` matrices, each orthogonalized on its own and its learning rate adjusted
by ``(M, N)`` (torch's Muon refuses such parameters).  A parameter of ``ndim < 2`` raises
torch's ``ValueError`` plus its name (when the optimizer was given named parameters) and
what to do, when the group is added (torch checks ``ndim != 2`` at construction only);
complex parameters and sparse gradients raise torch's ``RuntimeError``, in torch's order
(``_init_group``: every parameter checked, its buffer created, before any arithmetic).  A
parameter listed twice in a group (torch warns and keeps both) is stepped once per copy,
as torch: the pending matrices are finished before a copy's momentum reads its buffer
again.

Sharded parameters (issue 27 phase 2a): a DTensor ``Shard(d)`` over one mesh dim of more than
one rank, the others ``Replicate`` (``fully_shard``'s parameters: ``Shard(0)``, any ``d`` from
``shard_placement_fn``, HSDP's ``(Replicate(), Shard(d))``), whose gradient is placed the same
way.  The momentum (and Nesterov) update runs on the local shard (elementwise: the shard's bits
are the whole one's); every such matrix of a param group then goes to its owner rank in the
shard group, is orthogonalized there once and comes back chunk by chunk
(``_muon_shard.exchange`` through ``_muon_bucket``: bounded buckets, bf16 on the wire, two
all-to-alls per bucket through cfsdp's collectives, the next bucket in flight while the owners
work; owners from ``_muon_owners.assign_owners``); each shard is updated with the full shape's
adjusted lr as its bucket lands.  The numbers are those of torch's Muon on the full matrices
(the all-gather-everywhere Muon of tests/distributed/muon_oracle.py), bit for bit.  Still
``NotImplementedError`` naming the parameter: a layout whose chunks are not the matrix's
``torch.chunk`` along one dim, nor TP x FSDP's blocks (``_muon_mesh``: plain ``Shard(d)``s on
any number of mesh dims, fully_shard's ``_StridedShard`` beside TP's ``Shard``, HSDP x TP's 3-D
meshes, sub-meshes; a lone ``_StridedShard``, a ``Partial`` parameter), a sharded
parameter whose gradient is placed otherwise, a sharded bf16 one without Nesterov (torch
normalizes its bf16 momentum buffer in place, which a gathered copy cannot), any sharded bf16 or
fp16 one (torch's 16-bit ``add_(update, alpha=)`` rounds an element by its position in the
whole tensor: vectorized body or scalar tail; fp32 and fp64 do not), and a whole
parameter whose gradient is sharded (e.g. an unreduced ``Partial`` one: its local tensor is
not the whole gradient).

The FullyShardedDataParallel wrapper's parameters (issue 27, the wrapper): its flat parameter
(``use_orig_params=False``) and its original parameters (``use_orig_params=True``: 1-D views of
the flat shard, possibly empty, as torch FSDP1's) carry ``_cfsdp_unit``, a weak reference to
their unit (``_runtime/flat``), whose layout places each original parameter: rank ``r`` holds
``unit.layout.slices[r][k].numel`` consecutive elements of original ``k``'s row-major flat
elements, the ranks' ranges in rank order.  A flat parameter's momentum (and Nesterov) is one C
pass over the whole local shard (elementwise: padding included, whose gradient is zero); then
each original matrix's range of the update goes to the matrix's owner over the unit's process
group, which concatenates the ranges in rank order (the row-major matrix), and gets its range of
the orthogonalized update back (``_muon_shard.exchange`` with element ranges: the same buckets,
every matrix of the group's units in one exchange); each range of the shard is updated with
torch's weight decay and the full shape's adjusted lr.  Every original parameter of a flat
parameter given to Muon must be a matrix (torch's ``ValueError`` plus the original's FQN
otherwise: a flat parameter is one param group).  With ``use_orig_params=True`` each original
matrix is stepped the same way on its own 1-D piece (so the 1-D ones go to AdamW: the usual
pairing), its ``momentum_buffer`` of the piece's shape (what ``FSDP.optim_state_dict``
consolidates).  A rank holding no element of a matrix has no gradient for it (torch FSDP1 leaves
it None) and no state, yet takes part in its exchange with an empty range when the ranks holding
it have gradients for it, which the unit's ranks agree on each step (``_agree_pieces``: one
small ``all_reduce`` per process group).  With NO_SHARD (one rank) the matrices are whole.  An
original that is not row-major (a transposed weight, a channels-last one: the wrapper lays it
out in memory order) travels in memory order, its owner viewing the matrix through its strides
(``Layout.stride``).  A tensor-parallel ``Shard(d)`` original (the wrapper on ``mesh["dp"]`` of
a TP model) is cut over the (dp, tp) ranks: a TP chunk per TP rank, dp-sharded by element ranges
that each TP rank's unit lays out from its own local numels (``_tp_layout``), exchanged over all
those ranks; with NO_SHARD (dp = 1) the TP chunks are whole.  Still ``NotImplementedError``: a
tensor-parallel original that is not row-major.  The numbers are the all-gather-everywhere
``torch.optim.Muon`` on the same wrapper's full matrices (``muon_oracle.WrapperAllGatherMuon``),
bit for bit.

[Note: Newton-Schulz per matrix]
Every matrix (a 2-D parameter, each trailing matrix of a 3-D one) goes through torch's own
``_zeropower_via_newtonschulz``, one call per matrix, so its bits and errors are torch's by
construction.  Same-shape matrices used to go through one stacked run (``baddbmm`` for
``addmm``, a per-matrix norm), believed to give the same bits on the CPU: it does not in
general.  The bf16 ``baddbmm(o, gram_update, o)`` of a (6, 6) by (6, 8) batch differs from
torch's per-matrix ``addmm`` by a bf16 ulp in about 1% of random stacks (measured on this
CPU build: 49 of 5000 iterations; in 14 of 720 whole runs of random (E, m, n) stacks, E = 1..8,
every one of them a (6, 8) stack), so
stacked experts and same-shape matrices trained to other numbers than torch's Muon, silently
(found by the mixture-of-experts Muon case at 4 ranks, ``moe_parity[case=muon]`` in
tests/distributed/worker_spmd.py; tests/unit/test_muon.py's
``test_newton_schulz_is_torchs_per_matrix`` runs those stacks).  A bf16 update is normalized
in place, as torch's function does it (without Nesterov: the momentum buffer).
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from .. import _core
from .._torch.core import muon_adjust_lr, muon_newton_schulz
from ._muon_mesh import Blocks, MeshLayout, _exchange_group, block
from ._muon_shard import Layout, exchange, shard_layout

__all__ = ["Muon"]

_KIND = "momentum_buffer"
_PHASE2 = "cfsdp.optim.Muon on this layout is not implemented yet (issue 27 phase 2)"


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class _UnitIndex:
    """What Muon reads of one wrapper unit each step, found once: each original parameter's
    index (by identity, re-found when the unit's parameter was replaced) and, on a sharded
    unit, each original's element-range ``Layout`` (a tensor-parallel ``Shard(d)`` one's:
    ``_tp_layout``)."""

    __slots__ = ("index", "layouts")

    def __init__(self, unit):
        self.index = {id(info.param): j for j, info in enumerate(unit.infos)}
        self.layouts: list = [None] * len(unit.infos)  # None: whole (NO_SHARD, not TP)
        if unit.sharded:
            lay, ranks = unit.layout, tuple(dist.get_process_group_ranks(unit.group))
            self.layouts = [Layout(unit.group, -1, 0, unit.rank, unit.world_size, ranks,
                                   tuple(lay.slices[r][j].numel for r in range(lay.world_size)),
                                   unit.infos[j].stride)
                            for j in range(len(unit.infos))]
        for j, info in enumerate(unit.infos):  # TP Shard(d) ones: over the (dp, tp) ranks
            if _tp_sharded(info) and unit.flat_param.requires_grad:
                self.layouts[j] = _tp_layout(unit, j)


def _tp_sharded(info) -> bool:
    """Whether a wrapper original is a tensor-parallel parameter placed ``Shard(d)`` (a
    ``Replicate()`` one holds the whole matrix on every TP rank: the plain element ranges)."""
    return info.tp_spec is not None and _tp_dim(info.tp_spec) is not None


def _tp_dim(sp) -> Optional[int]:
    """The tensor dim a TP spec shards (its one ``Shard(d)``), or None (``Replicate()``)."""
    dims = [pl.dim % len(sp.shape) for pl in sp.placements if pl.is_shard()]
    return dims[0] if dims else None


def _tp_layout(unit, j: int) -> MeshLayout:
    """Tensor-parallel original ``j`` of a wrapper unit ([Note: tensor-parallel wrapper
    units] in ``_runtime/flat/unit.py``): TP rank ``t`` holds ``torch.chunk`` ``t`` of the
    matrix along its ``Shard(d)`` dim, and the unit on that TP rank lays its local tensors out
    as ``unit.layout`` does on this one (``plan_layout`` of their numels: uneven TP chunks give
    other ranges), so dp rank ``a`` of TP rank ``t`` holds elements ``[param_start, +numel)``
    of that chunk, row-major.  Every rank of the (dp, tp) root mesh has a piece; the exchange
    runs over all of them (``_muon_mesh``'s group of those ranks)."""
    sp = unit.infos[j].tp_spec
    d = _tp_dim(sp)
    root = sp.mesh._get_root_mesh()
    dps, tps = root.shape
    where = {int(root.mesh[a, t]): (a, t) for a in range(dps) for t in range(tps)}
    me = dist.get_rank()
    layouts = []
    for t in range(tps):  # each TP rank's unit layout, from its local numels
        numels = []
        for info in unit.infos:
            di = None if info.tp_spec is None else _tp_dim(info.tp_spec)
            if di is None:
                numels.append(info.numel)
            else:
                g = info.tp_spec.shape
                numels.append(math.prod(g[:di]) * block(g, [(di, tps, t)])[1][di] *
                              math.prod(g[di + 1:]))
        if t == where[me][1] and numels != [info.numel for info in unit.infos]:
            raise AssertionError(f"Muon's TP layout of unit {unit}: local numels {numels}, the "
                                 f"unit's {[info.numel for info in unit.infos]}")
        layouts.append(_core.plan_layout(numels, unit.plan_align, dps))
    ranks = tuple(sorted(where))
    blocks = []
    for r in ranks:
        a, t = where[r]
        starts, sizes = block(sp.shape, [(d, tps, t)])
        sl = layouts[t].slices[a][j]
        blocks.append((starts, sizes, sl.param_start, sl.param_start + sl.numel))
    return MeshLayout(_exchange_group(ranks), None, Blocks(tuple(blocks)), ranks.index(me),
                      len(ranks), ranks)


_unit_index: "weakref.WeakKeyDictionary[Any, _UnitIndex]" = weakref.WeakKeyDictionary()


def _index_of(unit) -> _UnitIndex:
    ix = _unit_index.get(unit)
    if ix is None:
        ix = _unit_index[unit] = _UnitIndex(unit)
    return ix


def _wrapped(p: Tensor) -> Optional[tuple]:
    """``(unit, index)`` for a FullyShardedDataParallel wrapper's parameter: its flat parameter
    (``index`` None) or, with ``use_orig_params=True``, original parameter ``index`` of
    ``unit.infos`` (a view of the flat shard); None for any other tensor."""
    ref = getattr(p, "_cfsdp_unit", None)
    unit = ref() if ref is not None else None
    if unit is None:
        return None
    if p is unit.flat_param:
        return unit, None
    j = _index_of(unit).index.get(id(p))
    if j is None or unit.infos[j].param is not p:  # a parameter replaced since: index again
        ix = _unit_index[unit] = _UnitIndex(unit)
        j = ix.index.get(id(p))
        if j is None or unit.infos[j].param is not p:
            return None
    return unit, j


def _flat_layout(unit, j: int):
    """Original parameter ``j`` of a wrapper unit as pieces: on a sharded unit, element ranges
    (rank ``r`` of the unit's group holds ``layout.slices[r][j].numel`` consecutive elements of
    it); a tensor-parallel ``Shard(d)`` one, on any unit, its ``_tp_layout``; else None (whole
    on this rank)."""
    return _index_of(unit).layouts[j]


def _holders(lay) -> int:
    """How many ranks hold a piece of a matrix laid out as ``lay``."""
    if isinstance(lay, MeshLayout):
        return sum(1 for b in lay.dim.of_rank
                   if math.prod(b[1]) and (len(b) == 2 or b[3] > b[2]))
    return sum(1 for k in lay.sizes if k)


def _wrapped_why(unit, j: Optional[int]) -> Optional[str]:
    """Why original parameter ``j`` (every one of the unit when None) cannot be stepped."""
    for k in range(len(unit.infos)) if j is None else (j,):
        info = unit.infos[k]
        where = f"original parameter '{info.fqn}' of shape {tuple(info.shape)}"
        if _tp_sharded(info) and info.stride is not None:
            return (f"{where}: a tensor-parallel parameter of a wrapper unit that is not "
                    f"row-major (stride {info.stride})")
    return None


def _shared_original(unit, j: Optional[int]) -> bool:
    """Whether original parameter ``j`` is a trainable one spread over ranks (of a sharded
    unit, or tensor-parallel): whether it is stepped is agreed (``_agree_pieces``), by every
    rank of its exchange alike (its matrix goes through the exchange, whichever ranks hold
    it)."""
    return (j is not None and unit.infos[j].param.requires_grad
            and _flat_layout(unit, j) is not None)


def _agree_pieces(group: dict, gi: int, wrapped: list) -> set:
    """The wrapper's ``use_orig_params=True`` matrices of sharded units: whether each
    is stepped is agreed by the ranks of its unit's group, so that every rank makes the same
    exchanges.  A rank holding no element of a matrix has no gradient for it (torch FSDP1
    leaves it None) and cannot tell locally whether the holders have one (``zero_grad`` or a
    gradient set to None clears only theirs); the holders' gradients are counted in one
    ``all_reduce`` per process group (by its ranks, in parameter order: the same on every rank)
    and step.  Returns the ids of the parameters this rank joins with an empty piece; none
    holding a gradient: no rank steps it; some but not all: ``ValueError`` on every rank."""
    shared: dict = {}  # group's ranks -> (process group, device, [(i, p, unit, j)])
    for i, (p, w) in enumerate(zip(group["params"], wrapped)):  # wrapped: each one's _wrapped
        if w is not None and _shared_original(*w):
            lay = _flat_layout(*w)
            shared.setdefault(lay.ranks, (lay.group, w[0].flat_param.device, []))[2].append(
                (i, p, *w))
    joined: set = set()
    for pg, device, entries in shared.values():
        have = torch.tensor([int(p.grad is not None) for _, p, _, _ in entries],
                            dtype=torch.int32, device=device)
        dist.all_reduce(have, group=pg)
        for (i, p, unit, j), n in zip(entries, have.tolist()):
            holders = _holders(_flat_layout(unit, j))
            if n == holders:
                if p.grad is None:  # an empty piece here
                    joined.add(id(p))
            elif n:
                info = unit.infos[j]
                raise ValueError(
                    f"cfsdp.optim.Muon: original parameter '{info.fqn}' of a "
                    f"FullyShardedDataParallel unit (parameter {_describe(group, i, gi)} of the "
                    f"optimizer), of shape {tuple(info.shape)} has a gradient on "
                    f"{n} of the {holders} ranks holding part of it: its matrix is stepped "
                    "whole, so every rank's piece needs its gradient or none does; clear "
                    "gradients on every rank alike (zero_grad() on every rank, or set .grad = "
                    "None on every rank's copy of the parameter)")
    return joined


def _piece_dtype(unit) -> torch.dtype:
    """The dtype of the holders' gradients of a unit's original (their flat gradient's; the
    parameters' where this rank's flat gradient is gone): an empty piece joins the exchange
    batched with them, by dtype."""
    g = unit.flat_param.grad
    return g.dtype if g is not None else unit.flat_param.dtype


def _layout(p: Tensor) -> tuple[Optional[Layout], Optional[str]]:
    """``(layout, None)`` for a sharded ``p`` Muon steps, ``(None, None)`` for a whole one,
    ``(None, why)`` for a layout it cannot reassemble (see ``_muon_shard.shard_layout``).
    The wrapper's parameters: see ``_wrapped`` (their layouts are per original parameter)."""
    if getattr(p, "_cfsdp_flattened", False):
        w = _wrapped(p)
        if w is not None:
            return None, _wrapped_why(*w)
        fqns = getattr(p, "_fqns", None)
        if fqns:
            return None, f"a FullyShardedDataParallel wrapper's flat parameter (of {', '.join(fqns)})"
        return None, ("a FullyShardedDataParallel wrapper's original parameter (use_orig_params="
                      "True) whose unit is gone")
    return shard_layout(p)


def _sharded(p: Tensor) -> Optional[str]:
    """Why ``p`` (a gradient) is not whole on this rank, or None when it is."""
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        for dim, pl in enumerate(p.placements):
            if mesh.size(dim) > 1 and not pl.is_replicate():
                return (f"a DTensor sharded as {tuple(p.placements)} over a mesh of shape "
                        f"{tuple(mesh.shape)} (mesh dim {dim} holds {pl!r})")
    return None


def _describe(group: dict, i: int, gi: Optional[int]) -> str:
    names = group.get("param_names")
    if names is not None and i < len(names):
        return f"'{names[i]}'"
    where = f" of param group {gi}" if gi is not None else ""
    return f"{i}{where}"


def _check_newton_schulz(ns_coefficients: tuple, ns_steps: int) -> None:
    """torch's ``_zeropower_via_newtonschulz`` checks of a group's settings, its errors."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")


def _newton_schulz(x: Tensor, ns_coefficients: tuple, ns_steps: int, eps: float) -> Tensor:
    """torch's ``_zeropower_via_newtonschulz`` on a matrix (2-D), or on each trailing matrix of
    ``x`` (ndim >= 3: a ``[batch, m, n]`` stack of the results), so its bits and errors
    ([Note: Newton-Schulz per matrix]).  A bf16 ``x`` is normalized in place, as torch's
    function does it.  Returns bf16."""
    if x.ndim == 2:
        return muon_newton_schulz(x, ns_coefficients, ns_steps, eps)
    _check_newton_schulz(ns_coefficients, ns_steps)
    mats = _matrices(x)
    if mats.shape[0] == 0:
        return torch.empty(mats.shape, dtype=torch.bfloat16, device=x.device)
    return torch.stack([muon_newton_schulz(m, ns_coefficients, ns_steps, eps) for m in mats])


def _matrices(u: Tensor) -> Tensor:
    """``u`` as a stack of its trailing matrices, ``[batch, m, n]``."""
    return u.reshape(math.prod(u.shape[:-2]), *u.shape[-2:])


def _to_scalar(x):
    """torch's ``_to_scalar``: a 1-element Tensor of nonzero dims squeezed to 0-dim."""
    return x.squeeze() if isinstance(x, Tensor) and x.dim() != 0 else x


class Muon(torch.optim.Muon):
    __doc__ = (
        "``torch.optim.Muon`` with cfsdp's C momentum pass, on\n"
        "parameters of ndim >= 2 (see ``cfsdp.optim._muon``).\n\n"
        + (torch.optim.Muon.__doc__ or "")
    )

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: Optional[str] = None,
    ) -> None:
        # torch's validation and defaults, on a probe torch.optim.Muon
        probe = torch.optim.Muon(
            [torch.zeros(1, 1)], lr=lr, weight_decay=weight_decay, momentum=momentum,
            nesterov=nesterov, ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        torch.optim.Optimizer.__init__(self, params, dict(probe.defaults))

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            for i, p in enumerate(group["params"]):
                self._check_param(group, i, p, len(self.param_groups) - 1)
        except (ValueError, NotImplementedError):
            self.param_groups.pop()  # not added, as torch leaves a group it refuses
            raise

    @staticmethod
    def _check_param(group: dict, i: int, p: Tensor, gi: int) -> None:
        why = _layout(p)[1]
        if why is not None:
            raise NotImplementedError(
                f"{_PHASE2}: parameter {_describe(group, i, gi)} of shape {tuple(p.shape)} "
                f"is {why}; Newton–Schulz needs each matrix whole on the rank that steps it, "
                "gathered from torch.chunk shards along one dim: use cfsdp.fully_shard "
                "(Shard(d) DTensors on one mesh dim, HSDP included; TP x FSDP, HSDP x TP and "
                "plain Shard(d)s on several mesh dims: blocks), ZeroRedundancyOptimizer "
                "or DDP (whole parameters on each rank)"
            )
        w = _wrapped(p)
        if w is not None:
            Muon._check_wrapped(group, i, p, gi, *w)
            return
        if p.ndim < 2:
            raise ValueError(
                "Muon only supports 2D parameters whereas we found a parameter with size: "
                f"{p.size()} (parameter {_describe(group, i, gi)}; cfsdp.optim.Muon takes "
                "ndim >= 2, leading dims a batch of matrices): put it in an AdamW group "
                "(biases, norms, embeddings and the output head usually go to AdamW)"
            )

    @staticmethod
    def _check_wrapped(group: dict, i: int, p: Tensor, gi: int, unit, j: Optional[int]) -> None:
        """torch's refusal of a parameter of ndim < 2, for the wrapper's original parameters
        (``p`` a flat parameter, or with use_orig_params=True a 1-D view of one's shard)."""
        fqns = getattr(unit.flat_param, "_fqns", None) or [x.fqn for x in unit.infos]
        for k in range(len(unit.infos)) if j is None else (j,):
            info = unit.infos[k]
            if len(info.shape) >= 2:
                continue
            head = ("Muon only supports 2D parameters whereas we found a parameter with size: "
                    f"{info.shape} (original parameter '{fqns[k]}' ")
            if j is None:
                raise ValueError(
                    head + f"in the flat parameter {_describe(group, i, gi)} of a "
                    "FullyShardedDataParallel unit with use_orig_params=False; cfsdp.optim.Muon "
                    "steps every original parameter of a flat parameter it is given, each needs "
                    "ndim >= 2): a flat parameter's original parameters share its param group, so "
                    "wrap with use_orig_params=True and put the 1-D ones (biases, norms) in an "
                    "AdamW group (the usual Muon + AdamW pairing), or wrap the modules holding "
                    "the matrices in FSDP units of their own and give the other units' flat "
                    "parameters to AdamW"
                )
            raise ValueError(
                head + f"of a FullyShardedDataParallel unit, parameter {_describe(group, i, gi)}"
                " of the optimizer: a 1-D view of the unit's flat shard): put it in an AdamW "
                "group (biases, norms, embeddings and the output head usually go to AdamW)"
            )

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """Perform a single optimization step (see ``cfsdp.optim._muon``).

        Args:
            closure (Callable, optional): A closure that reevaluates the model
                and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            self._cf_step_group(gi, group)
        return loss

    def _cf_step_group(self, gi: int, group: dict) -> None:
        # torch's _init_group: every check and new buffer before any arithmetic
        todo = []
        wrapped = [_wrapped(p) for p in group["params"]]  # once per parameter and step
        joined = _agree_pieces(group, gi, wrapped)
        for i, (p, w) in enumerate(zip(group["params"], wrapped)):
            if p.grad is None:
                if id(p) in joined:  # its matrix is stepped by the holders: in the exchange
                    self._check_param(group, i, p, gi)
                    self._check_dtype(group, i, gi, p, _piece_dtype(w[0]))
                    todo.append((i, p, None, w))
                continue
            if torch.is_complex(p):
                raise RuntimeError("Muon does not support complex parameters")
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            layout, unsupported = _layout(p)
            if unsupported is not None:  # placed so since it was added: its error
                self._check_param(group, i, p, gi)
            if w is not None:
                self._check_param(group, i, p, gi)
                if w[0].sharded or any(x is not None for x in _index_of(w[0]).layouts):
                    self._check_dtype(group, i, gi, p, p.grad.dtype)
            elif layout is None:
                why = _sharded(p.grad)
                if why is not None:  # a whole parameter whose local gradient is not the whole one
                    raise NotImplementedError(
                        f"{_PHASE2}: parameter {_describe(group, i, gi)} of shape "
                        f"{tuple(p.shape)} is whole on this rank but its gradient is {why}: "
                        "reduce the gradient to Replicate() before step() (e.g. grad."
                        "redistribute(placements=[Replicate()] * mesh.ndim)), or use "
                        "ZeroRedundancyOptimizer or DDP"
                    )
            else:
                self._check_sharded(group, i, gi, p)
            state = self.state[p]
            if _KIND not in state:
                state[_KIND] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            todo.append((i, p, layout, w))
        for i, p, layout, w in todo:
            if w is not None:
                if p.grad is not None and not (p.grad.shape == self.state[p][_KIND].shape
                                               == p.shape):
                    raise ValueError(
                        f"cfsdp.optim.Muon: parameter {_describe(group, i, gi)} of shape "
                        f"{tuple(p.shape)} (a FullyShardedDataParallel unit's) has a gradient of "
                        f"shape {tuple(p.grad.shape)} and a momentum buffer of shape "
                        f"{tuple(self.state[p][_KIND].shape)}; both must be the parameter's")
                continue
            pl, g, buf = _local(p), _local(p.grad), _local(self.state[p][_KIND])
            whole = p.shape if layout is None else pl.shape
            if not (pl.shape == g.shape == buf.shape == whole) or p.ndim < 2:
                self._check_param(group, i, p, gi)  # sharded (since added), or 1-D: its error
                raise ValueError(  # its gradient or buffer is not laid out as the parameter
                    f"cfsdp.optim.Muon: parameter {_describe(group, i, gi)} of shape "
                    f"{tuple(p.shape)} (local {tuple(pl.shape)}) has a gradient of local shape "
                    f"{tuple(g.shape)} and a momentum buffer of local shape {tuple(buf.shape)}; "
                    "both must be the parameter's local shape"
                )
        # torch's Newton–Schulz errors before any momentum buffer moves (torch raises them
        # after the first parameter's momentum update; here no buffer changes, and every rank of
        # a sharded exchange raises before it, so none waits for the others)
        if todo:
            _check_newton_schulz(group["ns_coefficients"], group["ns_steps"])
        # a parameter listed twice is stepped twice, as torch: the first copy's step is
        # finished before the second's momentum reads the buffer it updated
        pending: list = []
        seen: set = set()
        for _, p, layout, w in todo:
            if id(p) in seen:
                self._cf_finish(pending, group)
                pending, seen = [], set()
            seen.add(id(p))
            if w is not None:
                pending += self._cf_wrapped(p, *w, group)
                continue
            buf = _local(self.state[p][_KIND])
            upd = self._cf_momentum(_local(p.grad), buf, group["momentum"], group["nesterov"])
            pending.append((_local(p), upd, layout, tuple(p.shape)))
        self._cf_finish(pending, group)

    def _cf_wrapped(self, p: Tensor, unit, j: Optional[int], group: dict) -> list:
        """The pending entries of a wrapper parameter: the momentum on its whole local tensor
        (the flat shard, or an original parameter's 1-D piece of it: elementwise), then one
        entry per original matrix, its range of the shard over the unit's group (whole with
        NO_SHARD).  An original parameter with no element here (no gradient) sends nothing."""
        pd = p.detach()
        if p.grad is None:  # an empty piece (_agree_pieces)
            empty = unit.flat_param.new_empty(0, dtype=_piece_dtype(unit))  # as the holders'
            return [(pd, empty, _flat_layout(unit, j), tuple(unit.infos[j].global_shape))]
        upd = self._cf_momentum(p.grad, self.state[p][_KIND], group["momentum"], group["nesterov"])
        if j is not None:
            lay = _flat_layout(unit, j)
            if isinstance(lay, MeshLayout) and pd.ndim != 1:  # a TP original of a NO_SHARD unit
                pd, upd = pd.view(-1), upd.view(-1)
            return [(pd, upd, lay, tuple(unit.infos[j].global_shape))]
        out = []
        for k, info in enumerate(unit.infos):
            lay = _flat_layout(unit, k)
            if unit.sharded:
                sl = unit.layout.slices[unit.rank][k]
                a, b = sl.shard_offset, sl.shard_offset + sl.numel
            else:
                a, b = unit.layout.offsets[k], unit.layout.offsets[k] + info.numel
            if lay is not None:
                out.append((pd[a:b], upd[a:b], lay, tuple(info.global_shape)))
            else:
                out.append((info.view(pd[a:b]), info.view(upd[a:b]), None, tuple(info.shape)))
        return out

    @staticmethod
    def _check_sharded(group: dict, i: int, gi: int, p: Tensor) -> None:
        """A sharded parameter's gradient must be placed as the parameter (what fully_shard's
        reduce-scatter gives); it must be fp32 or fp64 (``_check_dtype``)."""
        g = p.grad
        if (not isinstance(g, DTensor) or g.device_mesh != p.device_mesh
                or tuple(g.placements) != tuple(p.placements)):
            got = (f"placed as {tuple(g.placements)}" if isinstance(g, DTensor)
                   else f"a {type(g).__name__}")
            raise NotImplementedError(
                f"{_PHASE2}: parameter {_describe(group, i, gi)} of shape {tuple(p.shape)} is "
                f"sharded as {tuple(p.placements)} but its gradient is {got}: cfsdp.optim.Muon "
                "steps a sharded parameter whose gradient is placed as the parameter (as "
                "fully_shard's reduce-scatter leaves it); reduce it so before step()"
            )
        Muon._check_dtype(group, i, gi, p, p.grad.dtype)

    @staticmethod
    def _check_dtype(group: dict, i: int, gi: int, p: Tensor, dtype: torch.dtype) -> None:
        """A sharded parameter must be fp32 or fp64 (``dtype``: its gradient's; see the module
        docstring): bf16 without Nesterov first (its own reason), then any 16-bit float."""
        if not group["nesterov"] and dtype == torch.bfloat16:
            raise NotImplementedError(
                f"{_PHASE2}: parameter {_describe(group, i, gi)} of shape {tuple(p.shape)} is a "
                "sharded bf16 parameter stepped without Nesterov: torch's Muon then normalizes "
                "the bf16 momentum buffer in place during Newton–Schulz, which the gathered copy "
                "cannot reproduce on the shards; use nesterov=True or fp32 parameters"
            )
        if dtype in (torch.bfloat16, torch.float16):
            raise NotImplementedError(
                f"{_PHASE2}: parameter {_describe(group, i, gi)} of shape {tuple(p.shape)} is a "
                f"sharded {dtype} parameter: torch's {dtype} add_(update, alpha=-lr) rounds an "
                "element differently by where it falls in the whole tensor (vectorized body or "
                "scalar tail), which an update of the shards cannot reproduce; keep fp32 "
                "parameters (mixed precision computes in bf16 with fp32 shards: fully_shard's "
                "MixedPrecisionPolicy, the wrapper's MixedPrecision), or step whole parameters "
                "(ZeroRedundancyOptimizer, DDP)"
            )

    def _cf_finish(self, pending: list, group: dict) -> None:
        """Newton–Schulz of the pending (local parameter, update, layout, full shape) entries
        (whole ones here, sharded ones through their owners: ``_muon_shard.exchange``), then
        torch's parameter update (a sharded entry's as soon as its bucket's result lands; each
        update is dropped from ``pending`` once sent, so the caller's list frees it too)."""
        if not pending:
            return
        lr = _to_scalar(group["lr"])

        def update(k: int, o: Tensor) -> None:
            pl, shape = pending[k][0], pending[k][3]
            adjusted_lr = muon_adjust_lr(lr, group["adjust_lr_fn"], shape[-2:])
            pl.mul_(1 - lr * group["weight_decay"])
            pl.add_(o if o.shape == pl.shape else o.reshape(pl.shape), alpha=-adjusted_lr)

        # (group's ranks, chunk index, dtype) -> pending indices, in order: by ranks, not by
        # group object (a unit's Shard(d > 0) parameters may hold another ProcessGroup object of
        # the same ranks), so that each group's matrices share one owner assignment and exchange
        batches: dict = {}
        for k, (_, upd, lay, _) in enumerate(pending):
            if lay is not None:
                batches.setdefault((type(lay), lay.ranks, lay.index, upd.dtype), []).append(k)
        for ks in batches.values():
            lay = pending[ks[0]][2]
            ups = [pending[k][1] for k in ks]
            for k in ks:  # the exchange drops each update once it is sent
                pending[k] = pending[k][:1] + (None,) + pending[k][2:]
            # bf16 on the wire: Newton–Schulz's first op rounds to bf16 (exact either way); the
            # gathered matrices are the exchange's own (normalized in place: nobody's buffer)
            exchange(lay, [pending[k][3] for k in ks], [pending[k][2].dim for k in ks], ups,
                     lambda fulls: self._cf_orthogonalize(fulls, group, gathered=True),
                     torch.bfloat16, [pending[k][2].sizes for k in ks], torch.bfloat16,
                     lambda i, o, ks=ks: update(ks[i], o),
                     [getattr(pending[k][2], "stride", None) for k in ks])
            del ups
        whole = [k for k, e in enumerate(pending) if e[2] is None]
        if whole:
            for k, o in zip(whole, self._cf_orthogonalize([pending[k][1] for k in whole], group)):
                update(k, o)

    @staticmethod
    def _cf_momentum(g: Tensor, buf: Tensor, momentum, nesterov: bool) -> Tensor:
        """The momentum of one parameter: the buffer updated in place; returns the update
        (one C pass for contiguous fp32 CPU memory, else torch's ops)."""
        if (isinstance(momentum, (float, int)) and _core.fused_ok(g) and _core.fused_ok(buf)):
            upd = torch.empty_like(g) if nesterov else None
            _core.muon_momentum(g.view(-1), buf.view(-1),
                                upd.view(-1) if upd is not None else None,
                                [(0, g.numel())], momentum=momentum, nesterov=nesterov)
            return upd if upd is not None else buf
        return _core.muon_momentum_tensor(g, buf, momentum=momentum, nesterov=nesterov)

    @staticmethod
    def _cf_orthogonalize(updates: list, group: dict, gathered: bool = False) -> list:
        """Newton–Schulz of every update ([Note: Newton-Schulz per matrix]): one list entry per
        update (``[-1, m, n]`` or ``[m, n]``), each matrix through torch's own function.
        ``gathered``: the updates are the exchange's own bf16 copies, and the list's entries
        are dropped as they are done (the exchange holds no other reference: one copy at a
        time)."""
        hp = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        out: list = [None] * len(updates)
        for k in range(len(updates)):
            u = updates[k]
            if gathered:
                updates[k] = None
            out[k] = _newton_schulz(u, *hp)
            del u
        return out
