"""``cfsdp.optim.Muon``: ``torch.optim.Muon`` with a C momentum pass and stacked matrices.

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
  with ``addmm``).  [Note: stacked Newton-Schulz] below: same-shape matrices of a param
  group go through it together;
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
(``_muon_shard.exchange``: two ``all_to_all_single`` per process group and step, owners from
``_muon_owners.assign_owners``); each shard is updated with the full shape's adjusted lr.  The
numbers are those of torch's Muon on the full matrices (the all-gather-everywhere Muon
of tests/distributed/muon_oracle.py), bit for bit.  Still ``NotImplementedError`` naming the
parameter: a layout whose chunks are not the matrix's ``torch.chunk`` along one dim, nor TP x
FSDP's blocks on a 2-D world mesh (``_muon_mesh``: phase 2b; a lone ``_StridedShard``, a
``Partial`` parameter, a 3-D mesh sharded over two dims), a sharded
parameter whose gradient is placed otherwise, a sharded bf16 one without Nesterov (torch
normalizes its bf16 momentum buffer in place, which a gathered copy cannot), the
FullyShardedDataParallel wrapper's parameters (its flat parameter, and with
``use_orig_params=True`` the original parameters, views of the flat shard: both marked
``_cfsdp_flattened``), and a whole parameter whose gradient is sharded (e.g. an unreduced
``Partial`` one: its local tensor is not the whole gradient).

[Note: stacked Newton-Schulz]
The matrices of a param group that share a trailing shape and dtype (2-D parameters of one
shape, and the slices of 3-D ones), on the CPU and not bf16, are orthogonalized as one stack: the
same ops with ``baddbmm`` for ``addmm`` and a per-matrix Frobenius norm
(``norm(dim=(-2, -1))``), one call per op for the whole stack.  On the CPU this is the same
bits as torch's per-matrix path (tests/unit/test_muon.py checks it for square, tall, wide
and odd shapes against ``torch.optim._muon._zeropower_via_newtonschulz`` slice by slice):
the bf16 batched matmul computes each matrix of the batch as the single matmul does, and
the norm of a matrix is the same reduction either way.  On other devices (cuBLAS picks its
batched kernels by shape) each matrix goes alone, through torch's 2-D ops, and so does a
bf16 one (torch's ``grad.bfloat16()`` is then the update itself, which torch normalizes in
place: without Nesterov, the momentum buffer; stacking would copy it).  A lone matrix
always takes the 2-D ops.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .. import _core
from .._torch.core import muon_adjust_lr, muon_newton_schulz
from ._muon_shard import Layout, exchange, shard_layout

__all__ = ["Muon"]

_KIND = "momentum_buffer"
_PHASE2 = "cfsdp.optim.Muon on this layout is not implemented yet (issue 27 phase 2)"


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _layout(p: Tensor) -> tuple[Optional[Layout], Optional[str]]:
    """``(layout, None)`` for a sharded ``p`` Muon steps, ``(None, None)`` for a whole one,
    ``(None, why)`` for a layout it cannot reassemble (see ``_muon_shard.shard_layout``)."""
    if getattr(p, "_cfsdp_flattened", False):
        fqns = getattr(p, "_fqns", None)
        if fqns:
            return None, f"a FullyShardedDataParallel wrapper's flat parameter (of {', '.join(fqns)})"
        return None, ("a FullyShardedDataParallel wrapper's original parameter (use_orig_params="
                      "True): a view of the wrapper's flat shard")
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


def _newton_schulz(x: Tensor, ns_coefficients: tuple, ns_steps: int, eps: float) -> Tensor:
    """torch's ``_zeropower_via_newtonschulz`` on a matrix (2-D: torch's own function, so
    its bits and errors) or the same ops batched over a stack of matrices (3-D; [Note:
    stacked Newton-Schulz]).  Returns bf16."""
    if x.ndim == 2:
        return muon_newton_schulz(x, ns_coefficients, ns_steps, eps)
    if ns_steps >= 100:  # torch's checks, before any arithmetic, as its 2-D function
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    o = x.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        o = o.mT
    o.div_(o.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
    for _ in range(ns_steps):
        gram = o @ o.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        o = torch.baddbmm(o, gram_update, o, beta=a)
    return o.mT if tall else o


def _matrices(u: Tensor) -> Tensor:
    """``u`` as a stack of its trailing matrices, ``[batch, m, n]``."""
    return u.reshape(math.prod(u.shape[:-2]), *u.shape[-2:])


def _to_scalar(x):
    """torch's ``_to_scalar``: a 1-element Tensor of nonzero dims squeezed to 0-dim."""
    return x.squeeze() if isinstance(x, Tensor) and x.dim() != 0 else x


class Muon(torch.optim.Muon):
    __doc__ = (
        "``torch.optim.Muon`` with cfsdp's C momentum pass and stacked Newton–Schulz, on\n"
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
                "(Shard(d) DTensors on one mesh dim, HSDP included; TP x FSDP on a 2-D (dp, "
                "tp) mesh of every rank), ZeroRedundancyOptimizer "
                "or DDP (whole parameters on each rank)"
            )
        if p.ndim < 2:
            raise ValueError(
                "Muon only supports 2D parameters whereas we found a parameter with size: "
                f"{p.size()} (parameter {_describe(group, i, gi)}; cfsdp.optim.Muon takes "
                "ndim >= 2, leading dims a batch of matrices): put it in an AdamW group "
                "(biases, norms, embeddings and the output head usually go to AdamW)"
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
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if torch.is_complex(p):
                raise RuntimeError("Muon does not support complex parameters")
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            layout, unsupported = _layout(p)
            if unsupported is not None:  # placed so since it was added: its error
                self._check_param(group, i, p, gi)
            if layout is None:
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
            todo.append((i, p, layout))
        for i, p, layout in todo:
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
        # a parameter listed twice is stepped twice, as torch: the first copy's step is
        # finished before the second's momentum reads the buffer it updated
        pending: list = []
        seen: set = set()
        for _, p, layout in todo:
            if id(p) in seen:
                self._cf_finish(pending, group)
                pending, seen = [], set()
            seen.add(id(p))
            buf = _local(self.state[p][_KIND])
            upd = self._cf_momentum(_local(p.grad), buf, group["momentum"], group["nesterov"])
            pending.append((_local(p), upd, layout, tuple(p.shape)))
        self._cf_finish(pending, group)

    @staticmethod
    def _check_sharded(group: dict, i: int, gi: int, p: Tensor) -> None:
        """A sharded parameter's gradient must be placed as the parameter (what fully_shard's
        reduce-scatter gives); a bf16 one needs Nesterov (see the module docstring)."""
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
        if not group["nesterov"] and p.grad.dtype == torch.bfloat16:
            raise NotImplementedError(
                f"{_PHASE2}: parameter {_describe(group, i, gi)} of shape {tuple(p.shape)} is a "
                "sharded bf16 parameter stepped without Nesterov: torch's Muon then normalizes "
                "the bf16 momentum buffer in place during Newton–Schulz, which the gathered copy "
                "cannot reproduce on the shards; use nesterov=True or fp32 parameters"
            )

    def _cf_finish(self, pending: list, group: dict) -> None:
        """Newton–Schulz of the pending (local parameter, update, layout, full shape) entries
        (whole ones here, sharded ones through their owners: ``_muon_shard.exchange``), then
        torch's parameter update."""
        if not pending:
            return
        lr = _to_scalar(group["lr"])
        ortho: list = [None] * len(pending)
        whole = [k for k, e in enumerate(pending) if e[2] is None]
        if whole:
            for k, o in zip(whole, self._cf_orthogonalize([pending[k][1] for k in whole], group)):
                ortho[k] = o
        # (group's ranks, chunk index, dtype) -> pending indices, in order: by ranks, not by
        # group object (a unit's Shard(d > 0) parameters may hold another ProcessGroup object of
        # the same ranks), so that each group's matrices share one owner assignment and exchange
        batches: dict = {}
        for k, (_, upd, lay, _) in enumerate(pending):
            if lay is not None:
                batches.setdefault((type(lay), lay.ranks, lay.index, upd.dtype), []).append(k)
        for ks in batches.values():
            lay = pending[ks[0]][2]
            res = exchange(lay, [pending[k][3] for k in ks], [pending[k][2].dim for k in ks],
                           [pending[k][1] for k in ks],
                           lambda fulls: self._cf_orthogonalize(fulls, group), torch.bfloat16)
            for k, o in zip(ks, res):
                ortho[k] = o
        for (pl, _, _, shape), o in zip(pending, ortho):
            adjusted_lr = muon_adjust_lr(lr, group["adjust_lr_fn"], shape[-2:])
            pl.mul_(1 - lr * group["weight_decay"])
            pl.add_(o if o.shape == pl.shape else o.reshape(pl.shape), alpha=-adjusted_lr)

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
    def _cf_orthogonalize(updates: list, group: dict) -> list:
        """Newton–Schulz of every update ([Note: stacked Newton-Schulz]): one list entry per
        update, a bf16 tensor of the update's matrices (``[-1, m, n]`` or ``[m, n]``)."""
        hp = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        out: list = [None] * len(updates)
        stacks: dict = {}
        for k, u in enumerate(updates):
            if u.device.type == "cpu" and u.dtype != torch.bfloat16:
                stacks.setdefault((tuple(u.shape[-2:]), u.dtype), []).append(k)
            else:  # alone, matrix by matrix (a bf16 one, as torch's, normalized in place)
                out[k] = (_newton_schulz(u, *hp) if u.ndim == 2 else
                          torch.stack([_newton_schulz(t, *hp) for t in _matrices(u)]))
        for ks in stacks.values():
            mats = [_matrices(updates[k]) for k in ks]
            counts = [t.shape[0] for t in mats]
            if sum(counts) == 1:
                out[ks[0]] = _newton_schulz(mats[0][0], *hp)
                continue
            res = _newton_schulz(torch.cat(mats) if len(mats) > 1 else mats[0], *hp)
            for k, part in zip(ks, res.split(counts)):
                out[k] = part
        return out
