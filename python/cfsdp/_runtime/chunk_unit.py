"""A unit of the composable face (``fully_shard``): per-parameter chunks.

[Note: chunk layout]
torch's FSDP2 shards every parameter of shape ``(d0, *rest)`` on its own, as
``torch.chunk(p, W)`` does: ``c = ceil(d0 / W)`` rows per rank, rank ``k``
holding rows ``[k*c, min((k+1)*c, d0))`` (possibly none).  A parameter that
``shard_placement_fn`` puts on ``Shard(d)``, ``d > 0`` (``W`` divides
``shape[d]``, as torch requires), is split the same way along ``d``: rank ``k``
holds ``torch.chunk(p, W, dim=d)[k]``, contiguous, which is ``outer =
prod(shape[:d])`` blocks of the flat parameter (cfsdp._ref.chunk); its
DTensor's placement is ``Shard(d)``.  A unit keeps:

* ``shard``: this rank's padded chunks back to back, ``S = sum_p outer_p * c_p *
  r_p`` elements (``r_p``: elements per row, ``prod(shape[d+1:])``; ``outer_p`` 1
  on dim 0) in the parameters' dtype.  The user's parameters are ``DTensor`` s
  whose local tensors are views of it (narrowed to the rows this rank really
  holds), so the optimizer updates it in place.
* ``gathered``: the all-gather output, ``W * S`` elements of ``param_dtype``,
  rank-major (rank ``k``'s shard at ``[k*S, (k+1)*S)``).  Only alive between
  the all-gather and the copy-out.
* ``natural``: the full parameters back to back (``param_dtype``); forward
  uses views of it.  Its storage is freed while the unit is sharded; the
  tensor object (and views autograd saved) live on, as the wrapper face's
  unsharded buffer does.
* ``flat_param``: the ``nn.Parameter`` autograd sees (data: ``natural``).
  Forward binds every parameter name to a view of it, so the gradients of a
  unit arrive as one flat natural gradient, which one C call packs (cast and
  pre-divide fused) into the rank-major reduce-scatter input.

The chunk sizes, local shapes and the reduction ops follow torch 2.13's FSDP2
exactly, so local shards and gradients match torch's bit for bit.
"""

from __future__ import annotations

import functools
import math
import operator
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import _core
from .._torch.dtensor import DTensorSpec, make_contiguous_strides_for, redistribute_local_tensor
from .._torch.dtensor import StridedShard as _StridedShard
from . import comm
from .reduce import divide_factors
from .replaced import ADOPTED, mark_replaced, orig_uid
from .base import (PendingReduce, UnshardStates, accumulate_sharded, all_none, alloc_storage,
                   free_storage, views_or_none)
from .views import (Bindings, GradSink, TPOccurrence, as_dtensor, changed_mask, dtensor_spec,
                    hook_flat_grad, split_views, tp_views)


def local_data(p: torch.Tensor) -> torch.Tensor:
    """What a unit shards of parameter ``p``: a DTensor's (tensor-parallel) local tensor,
    else ``p`` itself."""
    return p._local_tensor if isinstance(p, DTensor) else p


@functools.lru_cache(maxsize=4096)
def _contiguous_stride(shape: tuple) -> tuple:
    return tuple(make_contiguous_strides_for(shape))


@dataclass(frozen=True)
class DPMesh:
    """Where a unit's parameters are sharded and replicated: what cfsdp reads of torch's
    FSDP2 mesh info (``FSDPMeshInfo`` / ``HSDPMeshInfo`` / ``DDPMeshInfo``).

    ``mesh`` is the data-parallel mesh (1-D: shard; 2-D: (replicate, shard); ``dp_mesh_dims``
    with several names per role: each role flattened into one dim), ``group`` the shard group
    (``dp_mesh_dims`` without a shard dim, torch's DDP mode: a group of this rank alone) and
    ``replicate_group`` the HSDP replicate group.  With ``dp_mesh_dims`` the parameters are
    DTensors on ``spmd_mesh`` with ``Replicate()`` on the dims named in ``shard_names`` and
    ``replicate_names`` ([Note: dp_mesh_dims])."""

    mesh: Any
    group: dist.ProcessGroup
    replicate_group: Optional[dist.ProcessGroup] = None
    spmd_mesh: Any = None
    shard_names: tuple = ()
    replicate_names: tuple = ()


@dataclass
class ChunkParam:
    """One managed parameter and where its pieces live."""

    module: nn.Module
    name: str
    fqn: str  # relative to the unit's (first) module, for errors
    shape: torch.Size
    numel: int
    rows: int  # shape[dim]
    row_numel: int  # elements per row: prod(shape[dim + 1:])
    chunk_rows: int  # c = ceil(rows / W)
    local_rows: int  # rows this rank holds
    nat_off: int  # offset in ``natural``
    shard_off: int  # offset in ``shard`` (and in each rank's part of ``gathered``)
    requires_grad: bool
    stride: tuple = ()  # the full parameter's contiguous stride (the DTensors' global stride)
    sharded: Optional[nn.Parameter] = None  # the DTensor parameter the user sees
    unsharded: Optional[nn.Parameter] = None  # registered while the unit is unsharded
    aliases: tuple = ()  # further (module, name) occurrences of a shared parameter
    orig_uid: int = -1  # the original parameter's id (replaced.orig_uid): tied across units
    dim: int = 0  # the dim it is sharded on (Shard(dim)); torch requires W | rows when > 0
    outer: int = 1  # prod(shape[:dim]): blocks of a chunk (the plan's ``outer``)
    # its sharded DTensors' mesh and placements: (Shard(dim),), HSDP (Replicate(), Shard(dim));
    # a tensor-parallel parameter ([Note: tensor-parallel parameters]) adds the TP mesh and
    # placements, and keeps the DTensorSpec it has as the module uses it (on the TP mesh;
    # None: a plain parameter) and its global shape/stride
    mesh: Any = None
    placements: tuple = ()
    tp_spec: Any = None
    global_shape: Optional[torch.Size] = None
    global_stride: tuple = ()
    # dp_mesh_dims: the indices of the data-parallel dims of tp_spec's (full SPMD) mesh, whose
    # gradient placements are left to the reduction ([Note: dp_mesh_dims])
    dp_dims: frozenset = frozenset()

    def grad_placements(self, arrived: tuple) -> tuple:
        """What a gradient that ``arrived`` with these placements is redistributed to: the
        parameter's own (``tp_spec``), but on the data-parallel dims of ``dp_mesh_dims``
        the ones it arrived with ([Note: dp_mesh_dims])."""
        own = self.tp_spec.placements
        if not self.dp_dims:
            return own
        return tuple(a if i in self.dp_dims else w for i, (a, w) in enumerate(zip(arrived, own)))

    @property
    def chunk_numel(self) -> int:
        return self.outer * self.chunk_rows * self.row_numel

    @property
    def local_numel(self) -> int:
        return self.outer * self.local_rows * self.row_numel

    @property
    def local_shape(self) -> tuple:
        """The shape of this rank's chunk (``torch.chunk(p, W, dim)[rank]``)."""
        return (*self.shape[: self.dim], self.local_rows, *self.shape[self.dim + 1 :])


def gradient_divide(
    dp_size: int, shard_size: int, reduce_dtype: torch.dtype, factor: Optional[float], force_sum: bool
) -> tuple[float, float, object, object]:
    """``(pre, post, reduce_scatter_op, all_reduce_op)`` by torch 2.13 FSDP2's rules:
    fp32/bf16 average in the collective itself (``AVG``); fp16/fp64 (overflow risk)
    and ``force_sum`` sum and divide around it, fp16/fp64 by about ``sqrt(W)`` on
    each side.  A custom ``factor`` is a premultiplied sum (gloo has no
    ``PREMUL_SUM``: cfsdp divides in the pack pass)."""
    SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    if not overflow_risk and not force_sum:
        if factor is None:
            if dp_size == 1:
                return 1.0, 1.0, SUM, SUM
            return 1.0, 1.0, AVG, AVG
        if factor == shard_size:
            return 1.0, 1.0, AVG, SUM
        return float(factor), 1.0, SUM, SUM
    f = float(dp_size) if factor is None else float(factor)
    if overflow_risk:  # torch FSDP1's split into a pre- and a post-divide factor
        pre, post = divide_factors(f)
        return pre, post, SUM, SUM
    return 1.0, f, SUM, SUM


class ChunkUnit(UnshardStates):
    """The parameters of one ``fully_shard`` call (see [Note: chunk layout]); meets
    ``base.UnitContract``."""

    def __init__(
        self,
        entries: Sequence[tuple[nn.Module, str, str, nn.Parameter, tuple]],
        dp: DPMesh,
        device: torch.device,
        mp_param_dtype: Optional[torch.dtype],
        mp_reduce_dtype: Optional[torch.dtype],
        shard_dims: Optional[Mapping[nn.Parameter, int]] = None,
    ):
        """``shard_dims``: the dim (>= 0) of each parameter not sharded on dim 0, as
        ``fully_shard`` validated them (``shard_placement_fn``); ``dp``: the meshes and
        groups, and with ``dp_mesh_dims`` the full SPMD mesh, validated by ``fully_shard``
        too."""
        self.dp = dp
        self.mesh = mesh = dp.mesh
        self.group = group = dp.group
        self.rank = group.rank()
        self.world_size = W = group.size()
        self.replicate_group = replicate_group = dp.replicate_group
        self.device = device
        replicated = () if replicate_group is None else (Replicate(),)
        shard_dims = shard_dims or {}
        dtype = local_data(entries[0][3]).dtype
        self._tp = False  # any tensor-parallel parameter
        self._mp_dtypes = (mp_param_dtype, mp_reduce_dtype)
        self._set_dtypes(dtype)
        self.keep_low_precision_grads = False
        self.gradient_divide_factor: Optional[float] = None
        self.force_sum_reduction = False
        self.params: list[ChunkParam] = []
        nat = shard = 0
        for module, name, fqn, p, aliases in entries:
            data = local_data(p)  # the tensor this unit shards: a TP parameter's local tensor
            dim = shard_dims.get(p, 0)
            rows = data.shape[dim]
            c = -(-rows // W)
            local = max(0, min(c, rows - self.rank * c))
            q = ChunkParam(module, name, fqn, data.shape, data.numel(), rows,
                           math.prod(data.shape[dim + 1 :]), c, local, nat, shard, p.requires_grad,
                           _contiguous_stride(tuple(data.shape)), aliases=aliases,
                           orig_uid=orig_uid(p), dim=dim, outer=math.prod(data.shape[:dim]),
                           mesh=mesh, placements=(*replicated, Shard(dim)))
            if isinstance(p, DTensor) and dp.spmd_mesh is not None:
                self._init_spmd(q, p)
            elif isinstance(p, DTensor):
                self._init_tp(q, p, fqn)
            else:
                q.global_shape, q.global_stride = q.shape, q.stride
            self.params.append(q)
            nat += data.numel()
            shard += q.chunk_numel
        self.natural_numel = nat
        self.shard_numel = shard
        # (an empty parameter's chunk has no blocks to speak of: outer 1 then)
        self._plan = [(q.nat_off, q.numel, q.chunk_numel, q.shard_off, max(q.outer, 1))
                      for q in self.params]
        self._plan_bytes = comm.pack_plan(self._plan)
        self._split_sizes = [q.numel for q in self.params]

        # This rank's shard, straight from the original parameters (on the meta
        # device for deferred initialisation: see ``reset_sharded_params``).
        is_meta = local_data(entries[0][3]).is_meta
        self.shard = torch.empty(shard, dtype=dtype, device="meta" if is_meta else device)
        if not is_meta:
            # Only this rank's rows of each parameter are read, straight into the
            # shard (one C pass, padding zeroed): the unit is never concatenated.
            rows_here = []
            for q, (*_, p, _) in zip(self.params, entries):
                if q.dim:  # Shard(d > 0): this rank's blocks, gathered in one small copy
                    rows_here.append(local_data(p).detach().narrow(q.dim, self.rank * q.chunk_rows,
                                                       q.local_rows).reshape(-1))
                    continue
                start = self.rank * q.chunk_numel
                rows_here.append(local_data(p).detach().reshape(-1)[start : start + q.local_numel])
            _core.shard_fill(self.shard, 0, rows_here, [q.shard_off for q in self.params])
        self._new_natural()
        self._init_unshard_states()  # ``_buf``: ``natural`` while unsharded
        self.saved_grad: Optional[torch.Tensor] = None
        # no sync: the unreduced gradient summed in reduce_dtype ([Note: no-sync accumulation])
        self.acc_grad: Optional[torch.Tensor] = None
        # the sharded gradient last published and its DTensors (see [Note: gradient ownership])
        self._pub: Optional[_Published] = None
        self.grad_unsharded = False
        self._init_binding()
        self._unsharded_grads = False  # publish_unsharded_grad gave the full-size params grads
        # which parameters received a gradient in the backwards since the last publish
        # (see [Note: unused parameters])
        self._all_got_grad = True
        self._got_grad = bytearray(len(self.params))
        self._note_grads_hook = _weak_note_grads(self)
        self.post_backward_fn = None
        self.requires_all_reduce = True  # set_requires_all_reduce (HSDP)
        self.partial_reduce: Optional[torch.Tensor] = None  # reduced shards not yet all-reduced
        self.all_reduce_hook = None  # set_all_reduce_hook: called on the reduced shard
        # reshard_after_forward=k (1 < k < W): the group of k ranks backward gathers over
        self.post_forward_group: Optional[dist.ProcessGroup] = None
        self._post_forward_shard: Optional[torch.Tensor] = None
        self._install_sharded_params()
        self.refresh_requires_grad()
        self.pre_divide = self.post_divide = 1.0
        self.reduce_op = self.replicate_op = dist.ReduceOp.SUM
        self.update_divide_factors()

    # ------------------------------------------------------------------ init
    def _set_dtypes(self, dtype: torch.dtype) -> None:
        """The shard's dtype and torch's mixed-precision rules for it: a policy
        ``param_dtype`` equal to the parameters' dtype (or a non-floating unit) means no
        cast, and a ``reduce_dtype`` equal to ``param_dtype`` means none either."""
        param_dtype, reduce_dtype = self._mp_dtypes
        if reduce_dtype == param_dtype:
            reduce_dtype = None
        if param_dtype == dtype or not dtype.is_floating_point:
            param_dtype = None
        self.dtype = dtype
        self.param_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.uses_mp = self.param_dtype != dtype

    def update_divide_factors(self) -> None:
        dp = self.world_size * (self.replicate_group.size() if self.replicate_group is not None else 1)
        self.pre_divide, self.post_divide, self.reduce_op, self.replicate_op = gradient_divide(
            dp, self.world_size, self.reduce_dtype, self.gradient_divide_factor, self.force_sum_reduction
        )

    def _init_binding(self) -> None:
        """The binding table (``views.Bindings``, [Note: bulk binding]): every occurrence of
        every parameter (shared parameters have several), its module's ``__dict__`` and
        ``_parameters`` and its name; and what the per-step passes read."""
        self._bind = Bindings([(qi, mod, name) for qi, q in enumerate(self.params)
                               for mod, name in ((q.module, q.name), *q.aliases)])
        self._sharded_t: tuple = ()  # per parameter: the DTensor parameters
        self._sharded_occ: tuple = ()  # per occurrence
        self._unsharded_t: Optional[tuple] = None  # per parameter, built on first unshard
        self._unsharded_occ: tuple = ()
        self._param_index = tuple(range(len(self.params)))
        self._shapes = tuple(None if len(q.shape) == 1 else q.shape for q in self.params)
        self._rg_mask: Optional[bytes] = None
        self._grad_view_plan: Optional[tuple] = None  # (mask, index, shapes): publish_unsharded_grad
        # occurrences of tensor-parallel parameters: their views become TP DTensors whose
        # backward leaves partial sums to the unit (FSDP2's: [Note: tensor-parallel parameters])
        weak_self = weakref.ref(self)
        self._tp_occ = tuple(
            TPOccurrence(k, q.tp_spec.mesh, q.tp_spec.placements, q.global_shape, q.global_stride,
                         GradSink(q.grad_placements, weak_self, qi))
            for k, (qi, q) in enumerate((qi, self.params[qi]) for qi in self._bind.index)
            if q.tp_spec is not None)
        # TP parameters whose accumulated local gradient is still a partial sum (by index):
        # the spec it has; redistributed once, just before the reduction
        self._partial: dict[int, Any] = {}

    def _local_view(self, buf: torch.Tensor, q: ChunkParam) -> torch.Tensor:
        return buf[q.shard_off : q.shard_off + q.local_numel].view(q.local_shape)

    def _init_tp(self, q: ChunkParam, p: DTensor, fqn: str) -> None:
        """A tensor-parallel parameter (see [Note: tensor-parallel parameters]): the unit
        shards its local tensor over the data-parallel mesh; the sharded DTensor lives on
        the data-parallel mesh and the TP mesh side by side, with torch FSDP2's
        placements."""
        tp_spec = p._spec
        if len(tp_spec.placements) > 2:
            raise NotImplementedError(
                f"FSDP only supports 1D TP/EP or 2D EP+TP, not {tp_spec.placements} (cfsdp: "
                f"parameter '{fqn}')"
            )
        try:
            q.mesh = DeviceMesh._concatenate([self.mesh, tp_spec.mesh])
        except Exception as e:  # noqa: BLE001 - reworded with the parameter's name
            raise ValueError(
                f"fully_shard: parameter '{fqn}' is a DTensor on {tp_spec.mesh}, which does not "
                f"combine with the data-parallel mesh {self.mesh} ({e}). Take both from one "
                "DeviceMesh, e.g. mesh['dp'] for fully_shard and mesh['tp'] for "
                "parallelize_module."
            ) from e
        split = tp_spec.num_shards_map[q.dim]  # TP shards on the dim the unit shards
        dp_placement = _StridedShard(q.dim, split_factor=split) if split > 1 else Shard(q.dim)
        q.placements = ((Replicate(),) if self.replicate_group is not None else ()) + (
            dp_placement, *tp_spec.placements)
        q.tp_spec = tp_spec
        q.global_shape = p.shape
        q.global_stride = tuple(p.stride())
        self._tp = True

    # [Note: dp_mesh_dims]
    # With ``fully_shard(mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims(shard=...,
    # replicate=...))`` the parameters are DTensors on the whole SPMD mesh (data-parallel and
    # TP/CP dims), ``Replicate()`` on the data-parallel ones.  As a tensor-parallel parameter
    # ([Note: tensor-parallel parameters]), the unit shards the local tensor, over the shard
    # dims' group (several shard dims: their flattened mesh, torch's ``_flatten``), and
    # forward sees a DTensor with the parameter's own spec.  What torch 2.13 does differently
    # (``FSDPParam._init_sharding_spec_spmd``), cfsdp does the same way:
    #   * the sharded parameter lives on the SPMD mesh itself, each shard dim's Replicate()
    #     replaced by Shard(d) (d: the dim the unit shards) or, when mesh dims to its right
    #     shard d too, _StridedShard(d, split_factor=their product); replicate dims stay
    #     Replicate().  With several shard dims the mesh is the data-parallel mesh (HSDP:
    #     (replicate, shard), placements (Replicate(), ...)) put where the first shard dim
    #     was, beside the other non-data-parallel dims;
    #   * a gradient keeps the placements it arrived with on the data-parallel dims (a
    #     Partial sum over the batch-sharded dims is what the reduce-scatter sums; no extra
    #     all-reduce), only the other dims being redistributed to the parameter's own.
    def _init_spmd(self, q: ChunkParam, p: DTensor) -> None:
        """A parameter on the full SPMD mesh (``dp_mesh_dims``: [Note: dp_mesh_dims]):
        ``fully_shard`` checked its mesh and its ``Replicate()`` on the data-parallel dims."""
        spec = p._spec
        dp = self.dp
        spmd = spec.mesh
        names = spmd.mesh_dim_names
        shard_idx = [names.index(n) for n in dp.shard_names]
        rep_idx = [names.index(n) for n in dp.replicate_names]
        pls = list(spec.placements)
        for i in shard_idx:
            split = 1
            for j in range(i + 1, spmd.ndim):
                pj = spec.placements[j]
                if isinstance(pj, (Shard, _StridedShard)) and pj.dim == q.dim:
                    split *= spmd.size(j)
            pls[i] = _StridedShard(q.dim, split_factor=split) if split > 1 else Shard(q.dim)
        if len(shard_idx) <= 1:
            q.mesh, q.placements = spmd, tuple(pls)
        else:  # the shard dims flattened: the data-parallel mesh where the first one was
            meshes, out, skip = [], [], 0
            hsdp = self.replicate_group is not None
            for i, name in enumerate(names):
                if skip:
                    skip -= 1
                elif name in dp.shard_names:
                    meshes.append(self.mesh)
                    out.extend(((Replicate(),) if hsdp else ()) + (pls[i],))
                    skip = len(dp.shard_names) - 1
                elif not (hsdp and name in dp.replicate_names):
                    meshes.append(spmd[name])
                    out.append(pls[i])
            q.mesh, q.placements = DeviceMesh._concatenate(meshes), tuple(out)
        q.tp_spec = spec
        q.dp_dims = frozenset(shard_idx + rep_idx)
        q.global_shape = p.shape
        q.global_stride = tuple(p.stride())
        self._tp = True

    @staticmethod
    def _tp_dtensor(local: torch.Tensor, q: ChunkParam) -> DTensor:
        """``local`` (a view of the unsharded buffer) as the module sees a TP parameter:
        a DTensor on the TP mesh (no autograd edge)."""
        return as_dtensor(local, q.tp_spec.mesh, q.tp_spec.placements, q.global_shape,
                          q.global_stride)

    @staticmethod
    def _dtensor(local: torch.Tensor, q: ChunkParam) -> DTensor:
        """``local`` as this parameter's sharded DTensor (no autograd edge)."""
        return as_dtensor(local, q.mesh, q.placements, q.global_shape, q.global_stride)

    def _new_natural(self) -> None:
        """The unsharded buffer (storage freed) and the flat parameter over it."""
        self.natural = torch.empty(self.natural_numel, dtype=self.param_dtype, device=self.shard.device)
        free_storage(self.natural)
        self.flat_param = nn.Parameter(self.natural, requires_grad=any(q.requires_grad for q in self.params))
        self._hooked = False
        for q in self.params:
            q.unsharded = None
        self._unsharded_t = None

    def _shard_local(self, q: ChunkParam) -> torch.Tensor:
        """``q``'s local tensor: its rows of the shard buffer."""
        local = self._local_view(self.shard, q)
        if not local.is_meta:
            # The same memory with a storage offset of 0 (DLPack keeps the shard
            # alive): torch's DTensor deep-copies a local tensor at a non-zero
            # offset through its storage and fails (copy.deepcopy(state_dict)).
            local = torch.from_dlpack(local)
        return local

    def _install_sharded_params(self) -> None:
        for q in self.params:
            q.sharded = self._dtensor_param(self._shard_local(q), q)
        self._bind_sharded_params()

    def _bind_sharded_params(self) -> None:
        """Register every parameter's ``q.sharded`` in its modules and rebuild what
        the per-step passes read."""
        self._sharded_t = tuple(q.sharded for q in self.params)
        self._sharded_occ = self._bind.per_occurrence(self._sharded_t)
        self._bind.register(self._sharded_occ)
        self._pub = None
        self._rg_mask = None  # read the new parameters' requires_grad

    def _dtensor_param(self, local: torch.Tensor, q: ChunkParam) -> nn.Parameter:
        """The sharded parameter: a leaf DTensor marked as a parameter, exactly what
        ``nn.Parameter(dtensor)`` returns for a tensor subclass, without its
        ``detach()``, a DTensor op that cost half of wrapping on the meta device."""
        with torch.no_grad():
            dt = self._dtensor(local.detach(), q)
        dt.requires_grad_(q.requires_grad)
        dt._is_param = True
        return dt

    def _register_unsharded(self) -> None:
        """While unsharded, the modules hold full-size parameters (views of the
        unsharded buffer), as torch's FSDP2 registers its unsharded parameters.
        They are built once per unsharded buffer and kept (with the requires_grad
        of their sharded parameters, refreshed when that changes)."""
        if self._unsharded_t is None:
            for q in self.params:
                if q.unsharded is None:
                    v = self.natural[q.nat_off : q.nat_off + q.numel].view(q.shape)
                    if q.tp_spec is not None:
                        v = self._tp_dtensor(v, q)
                    q.unsharded = nn.Parameter(v, requires_grad=q.requires_grad)
                elif q.unsharded.requires_grad != q.requires_grad:
                    q.unsharded.requires_grad_(q.requires_grad)
            self._unsharded_t = tuple(q.unsharded for q in self.params)
            self._unsharded_occ = self._bind.per_occurrence(self._unsharded_t)
        self._bind.register(self._unsharded_occ)

    def reset_sharded_params(self) -> None:
        """Take over parameters that replaced ours or their data (``to_empty`` after
        meta-device construction, ``load_state_dict(assign=True)``, a user's
        ``setattr``): copy their local values into the shard (allocating it if it was
        on the meta device) and adopt the parameter objects the modules now hold, their
        local tensors becoming views of the shard again.  The objects are kept, as
        torch's FSDP2 keeps them: an optimizer built from ``model.parameters()`` after
        ``to_empty`` steps the very parameters the unit uses.  A parameter object the
        unit stops using is marked, so an optimizer still holding it fails at ``step``
        (see ``replaced``).  A unit on the meta device whose parameters are replaced only
        in part (``load_state_dict`` reaches its modules one after the other) waits for
        the rest; the first forward names any left on the meta device."""
        if self._buf is not None:
            return  # unsharded: the registered parameters are the full views
        replaced = {}
        for q in self.params:
            cur = q.module._parameters.get(q.name)
            if cur is not None and (cur is not q.sharded or self._moved(q)):
                local = cur.to_local() if isinstance(cur, DTensor) else None
                want = q.local_shape
                if local is None or tuple(local.shape) != want:
                    raise ValueError(
                        f"fully_shard: parameter '{q.fqn}' was replaced by a {type(cur).__name__} "
                        f"of shape {tuple(getattr(local, 'shape', cur.shape))}; expected a DTensor "
                        f"whose local shard has shape {want}."
                    )
                if cur.placements != q.placements or cur.device_mesh != q.mesh:
                    raise ValueError(
                        f"fully_shard: parameter '{q.fqn}' was replaced by a DTensor with "
                        f"placements {cur.placements} on {cur.device_mesh}; the unit shards it as "
                        f"{q.placements} on {q.mesh}. Load values sharded the unit's way "
                        "(e.g. distribute_tensor(full, mesh, placements) with the unit's mesh)."
                    )
                replaced[id(q)] = cur
        if not replaced:
            return
        new_dtypes = {cur.dtype for cur in replaced.values()}
        if new_dtypes != {self.dtype}:
            self._retype(replaced, new_dtypes)
        if self.shard.is_meta:
            if len(replaced) != len(self.params):
                # some are materialised, others not yet (load_state_dict(assign=True) runs
                # this hook after each module): taken over when all are, or refused at the
                # first forward, naming the ones left (meta_param_names)
                return
            dev = next(iter(replaced.values())).to_local().device
            self.device = dev
            self.shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=dev)
            self._new_natural()
            self.refresh_requires_grad_flat()
        with torch.no_grad():
            for q in self.params:
                cur = replaced.get(id(q))
                if cur is not None:
                    self._local_view(self.shard, q).copy_(cur.to_local())
                    q.requires_grad = cur.requires_grad
        if self.shard.device.type == "meta":
            return
        for q in self.params:
            cur = replaced.get(id(q))
            if cur is None:
                continue
            if q.sharded is not None and cur is not q.sharded:
                mark_replaced(q.sharded, q.fqn, ADOPTED, q.module, q.name)
            # the object stays the user's; its local tensor is the shard's rows again
            cur._local_tensor = self._shard_local(q)
            cur._spec = dtensor_spec(q.mesh, q.placements, q.global_shape, q.global_stride, self.dtype)
            q.sharded = cur
        self._bind_sharded_params()

    def _retype(self, replaced: dict, new_dtypes: set) -> None:
        """``module.to(dtype)`` (``.double()``, ``.half()``) changed the parameters' dtype:
        the unit becomes a unit of that dtype (a new shard buffer, the values copied in
        by ``reset_sharded_params``; the mixed-precision rules applied anew), as torch's
        FSDP2 follows ``module._apply``."""
        if len(new_dtypes) != 1 or len(replaced) != len(self.params):
            kept = [q.fqn for q in self.params if id(q) not in replaced]
            raise NotImplementedError(
                f"fully_shard: the parameters of one unit now have dtypes "
                f"{sorted(map(str, new_dtypes))}{' and ' + str(self.dtype) + ' (' + ', '.join(kept) + ')' if kept else ''}; "
                "a unit holds one dtype. Change the dtype of every parameter of the module "
                "given to fully_shard together (module.to(dtype)), or before fully_shard."
            )
        dtype = new_dtypes.pop()
        if self.saved_grad is not None or self._buf is not None:
            raise AssertionError("cfsdp: a unit changes dtype only while sharded and idle")
        self._set_dtypes(dtype)
        self.update_divide_factors()
        self._pub = None  # gradients of the old dtype are the user's
        if not self.shard.is_meta:
            self.shard = torch.zeros(self.shard_numel, dtype=dtype, device=self.device)
        else:
            self.shard = torch.empty(self.shard_numel, dtype=dtype, device="meta")
        self._new_natural()
        self.refresh_requires_grad_flat()

    def _moved(self, q: "ChunkParam") -> bool:
        """Whether our own parameter's local tensor was swapped (``module._apply``,
        e.g. ``to_empty``, may assign ``param.data`` in place)."""
        local = q.sharded._local_tensor
        mine = self._local_view(self.shard, q)
        if local.device != mine.device or local.dtype != mine.dtype:
            return True  # (a rank holding no rows of it sees a new dtype, not a new address)
        return q.local_numel > 0 and _core.address(local) != _core.address(mine)

    def meta_param_names(self, root: nn.Module) -> list[str]:
        """The FQNs (under ``root``) of this unit's parameters still on the meta device."""
        if not self.shard.is_meta:
            return []
        names = {id(p): n for n, p in root.named_parameters(remove_duplicate=False)}
        out = []
        for q in self.params:
            cur = q.module._parameters.get(q.name)
            if cur is None or cur.is_meta:
                out.append(names.get(id(cur), q.fqn))
        return out

    # ------------------------------------------------------- unshard/reshard
    def _start_unshard(self):
        gathered = self._post_forward_shard_gather()
        if gathered is not None:
            return gathered
        src = self.shard
        if self.uses_mp:  # the all-gather input: the shard cast in one C pass
            src = torch.empty(self.shard_numel, dtype=self.param_dtype, device=self.device)
            _core.scale_cast_add(src, self.shard, 1.0, False)
        # straight into the natural buffer: on shared memory the copy-out from the
        # peers' slots is the chunk copy-out (no rank-major buffer); nothing reads
        # ``natural`` before wait_unshard
        alloc_storage(self.natural)
        work = comm.all_gather_unpack(self.natural.data, src, self._plan, self._plan_bytes,
                                      self.group, async_op=True)
        return work, None

    def reshard_after_forward(self, for_backward: bool) -> None:
        """Post-forward reshard.  With a post-forward group (``reshard_after_forward``
        an int k: groups of k consecutive ranks), keep this rank's 1/k of the gathered
        buffer (the rank-major shards of the W/k ranks at its position in the group)
        so backward all-gathers over the k ranks only; else free everything."""
        if self.post_forward_group is None or not for_backward or self._buf is None:
            self.reshard()
            return
        k = self.post_forward_group.size()
        per = self.world_size // k
        j = self.post_forward_group.rank()
        kept = torch.empty(per * self.shard_numel, dtype=self.param_dtype, device=self.device)
        _core.chunk_pack(kept, self.natural.detach(), self._plan, self.world_size, self.shard_numel,
                         ranks=(j * per, (j + 1) * per))
        self.reshard()
        self._post_forward_shard = kept

    def _post_forward_shard_gather(self):
        """With a post-forward shard kept, the all-gather over the post-forward group
        (``(work, gathered)``, copied out by ``_finish_unshard``); else None."""
        kept = self._post_forward_shard
        if kept is None:
            return None
        self._post_forward_shard = None
        out = torch.empty(self.world_size * self.shard_numel, dtype=self.param_dtype, device=self.device)
        return comm.all_gather(out, kept, self.post_forward_group, async_op=True), out

    def _finish_unshard(self, gathered: Optional[torch.Tensor]) -> None:
        if gathered is not None:  # gathered over the post-forward group: copy it out
            alloc_storage(self.natural)
            # through ``.data``: refilling the buffer must not bump the version counter
            # of the views autograd saved in forward (they see the same values again)
            _core.chunk_unpack(self.natural.data, gathered, self._plan, self.world_size,
                               self.shard_numel)
        self._buf = self.natural
        self._register_unsharded()

    def reshard(self) -> None:
        self._post_forward_shard = None
        self.wait_unshard()
        if self._buf is None:
            return
        free_storage(self.natural)
        self._buf = None
        self._bind.unshow()
        if self._unsharded_grads:
            _core.attr_set(self._unsharded_t, "grad", None)
        self._bind.register(self._sharded_occ)
        self._unsharded_grads = False

    def use_forward_views(self) -> None:
        """Bind each parameter name to its view of ``flat_param`` (through autograd;
        frozen parameters get detached views), made in one C pass (see
        [Note: forward views] in views.py)."""
        if self._rg_mask is None:  # parameters replaced since the last forward
            self.refresh_requires_grad()
        parts, views = split_views(self.flat_param, self._split_sizes, self._param_index,
                                   self._shapes, self._rg_mask, self._bind.index)
        node = parts[0].grad_fn if parts else None
        if node is not None:  # which parameters get a gradient: [Note: unused parameters]
            node.register_prehook(self._note_grads_hook)
        if self._tp_occ:  # [Note: tensor-parallel parameters]
            views = tp_views(views, self._tp_occ)
        self._bind.show(views)

    def end_forward_views(self) -> None:
        """A unit left unsharded after backward: unbind the forward views, so attribute
        access shows the registered unsharded parameters (and their gradients) until the
        next forward, as torch's FSDP2 shows them."""
        if self._buf is not None:
            self._bind.unshow()

    def note_grads(self, grad_outputs: tuple) -> None:
        """The split node's pre-hook: record which parameters' views got a gradient."""
        if not any(g is None for g in grad_outputs):
            return
        if self._all_got_grad:
            self._all_got_grad = False
            self._got_grad[:] = bytes(len(self.params))
        for i, g in enumerate(grad_outputs):
            if g is not None:
                self._got_grad[i] = 1

    def _unused(self, grad: torch.Tensor) -> list[int]:
        """Indices of trainable parameters that got no gradient on this rank since the
        last publish and whose reduced rows here are all zero (no rank's gradient
        reached them): their ``.grad`` stays None, as torch's FSDP2 leaves it."""
        if self._all_got_grad:
            return []
        out = [i for i, q in enumerate(self.params)
               if q.requires_grad and not self._got_grad[i]
               and not bool(self._local_view(grad, q).any())]
        self._all_got_grad = True
        return out

    def refresh_requires_grad(self) -> None:
        """Follow the sharded parameters' requires_grad (the user may freeze or
        unfreeze them between steps): one C read per step, the per-parameter
        work only when it changed."""
        mask = changed_mask(self._sharded_t, self._rg_mask)
        if mask is None:
            return
        self._rg_mask = mask
        for q, rg in zip(self.params, mask):
            q.requires_grad = bool(rg)
        self._unsharded_t = None  # their requires_grad follows on the next unshard
        self._pub = None
        self.refresh_requires_grad_flat()
        if self._buf is not None:
            self._register_unsharded()

    def refresh_requires_grad_flat(self) -> None:
        rg = any(q.requires_grad for q in self.params)
        self.flat_param.requires_grad_(rg)
        hook_flat_grad(self, rg)

    def drop_iteration(self) -> None:
        """reset_iter_state: reshard and drop what the failed iteration accumulated."""
        self.reshard()
        self.saved_grad = None
        self.flat_param.grad = None
        self.acc_grad = None
        self.grad_unsharded = False
        self.partial_reduce = None
        self._partial.clear()

    def before_forward(self) -> None:
        self.refresh_requires_grad()
        self._forget_dropped_grads()

    # --------------------------------------------------------------- grads
    # [Note: gradient ownership]
    # Publishing a gradient means one DTensor per parameter, viewing this rank's rows
    # of the unit's sharded gradient buffer.  Who owns that memory is decided by one
    # explicit rule, torch's FSDP2 rule, and never by counting references:
    #
    # * While the parameters still hold exactly the DTensors the unit published (an
    #   identity check, ``take_grad_for_backward``), the user left them in place
    #   (``zero_grad(set_to_none=False)``, gradient accumulation): the next reduction
    #   adds to that buffer, as torch adds to ``param.grad``.
    # * Once the parameters hold anything else (``zero_grad()`` set them to None, or
    #   the user assigned other gradients), the published gradients are the user's:
    #   the unit forgets them (``before_forward``) and never writes to them again; the
    #   next reduction gets a new buffer.  Gradients the user assigned are copied into
    #   it first, so they accumulate as torch's would.
    #
    # So a gradient a user kept (``g = p.grad``) stays intact whatever they do, and the
    # memory of dropped gradients is freed by Python as soon as nobody holds them.

    # [Note: tensor-parallel parameters]
    # A parameter that tensor parallelism made a DTensor on a TP mesh (parallelize_module
    # with mesh["tp"], fully_shard with mesh["dp"]) is sharded like any other, through
    # its *local* tensor: the unit's layout, all-gather, copy-in/out and reduce-scatter
    # see only the TP-local bytes (C and shared memory as usual).  What differs is what
    # the module and the user see, as torch's FSDP2 shows it:
    #   * the sharded parameter (and its gradient) is a DTensor on the data-parallel and
    #     TP meshes concatenated, placements (dp placement, *TP placements), where the dp
    #     placement is _StridedShard(0, split_factor=k) when TP already splits dim 0 in k
    #     (column-parallel weights), else Shard(0); with HSDP, Replicate() first;
    #   * forward binds a DTensor on the TP mesh over the view of the unsharded buffer
    #     (DTensor.from_local, run_check=False: through autograd, whose backward turns the
    #     gradient into the parameter's own placements, e.g. a Partial sum over TP ranks
    #     into Replicate, as torch redistributes it before reducing);
    #   * the registered unsharded parameters and their no-sync gradients are DTensors
    #     on the TP mesh.

    # [Note: unused parameters]
    # Every forward binds the parameters to views of one ``torch.split`` of the flat
    # parameter, so backward produces one flat gradient with zeros where a parameter took
    # no part in the forward.  torch's FSDP2 leaves such a parameter's ``.grad`` None
    # (optimizers then skip it: no weight decay, no step).  The split node's pre-hook sees
    # a None gradient for each view that received none (``note_grads``; one check per
    # backward when every view got one).  At publish, a trainable parameter that got no
    # gradient on this rank keeps ``.grad`` None if its reduced rows here are all zero,
    # i.e. no rank's gradient reached them; otherwise (another rank used it) its gradient
    # is published, so no gradient value is ever dropped.  The reduce-scatter itself is
    # unchanged (the zeros take part, as torch's padding does).

    def _forget_dropped_grads(self) -> None:
        """The parameters no longer hold the published gradients: they are the user's
        now ([Note: gradient ownership])."""
        pub = self._pub
        if pub is not None and self.saved_grad is not pub.buf and not all(
                map(operator.is_, _core.attr_get(self._sharded_t, "grad"), pub.shown)):
            self._pub = None

    def new_grad_buffer(self) -> torch.Tensor:
        """A new shard-sized buffer of the parameters' dtype for a new sharded gradient."""
        return torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)

    def take_grad_for_backward(self) -> None:
        """Before backward: collect the sharded gradients the user's parameters hold
        (they may have been cleared or replaced since they were published) into one
        shard-sized buffer that the reduced gradient is added to."""
        if self.saved_grad is not None:
            return
        grads = _core.attr_get(self._sharded_t, "grad")
        pub = self._pub
        if pub is not None and all(map(operator.is_, grads, pub.shown)):
            if not all_none(grads):
                self.saved_grad = pub.buf  # the gradients as published: add to them
            return
        self._pub = None  # dropped or replaced: the user's ([Note: gradient ownership])
        if all_none(grads):
            return
        # gradients the user assigned: copied into a new buffer the reduction adds to
        buf = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for g, q in zip(grads, self.params):
                if g is not None and q.local_numel:
                    self._local_view(buf, q).copy_(g.to_local())
        self.saved_grad = buf

    def accumulate_reduced(self, out: torch.Tensor, divided: bool) -> None:
        accumulate_sharded(self, out, divided)

    # [Note: no-sync accumulation]
    # With gradient sync off, torch's FSDP2 keeps a backward's unsharded gradient where
    # autograd accumulates the next one (``unsharded_param.grad``, in the gradient's dtype),
    # unless ``reduce_dtype`` (after its clamping, see ``_set_dtypes``) differs from that
    # dtype: then post-backward moves it off the parameter, cast to ``reduce_dtype``
    # (``unsharded_accumulated_grad``: fp32 from bf16, but bf16 from fp32 with only
    # ``reduce_dtype=bf16``), and adds every later backward's gradient to it in place
    # (``acc += grad``, computed in the wider dtype and rounded to ``acc``'s); the
    # synchronising backward adds its own the same way, then reduces the sum.  The unit
    # does exactly that on its flat gradient (elementwise the same ops): ``acc_grad``.
    # So a bf16 gradient accumulated with fp32 reduction is summed in fp32, not in bf16.

    def keep_unsharded_grad(self, grad: torch.Tensor) -> None:
        """No gradient sync: accumulate the natural gradient, unreduced, in torch's dtype
        ([Note: no-sync accumulation])."""
        acc = self.acc_grad
        if acc is not None:
            acc += grad
            return
        if grad.dtype != self.reduce_dtype:
            self.acc_grad = grad.to(self.reduce_dtype)
            return
        self.flat_param.grad = grad
        self.grad_unsharded = True

    def _redistribute_partial(self, grad: torch.Tensor) -> None:
        """The TP parameters whose gradient arrived as a partial sum over TP ranks (e.g.
        a sequence-parallel norm's): their accumulated local gradients, in ``grad``, become
        the parameters' own placements now, once, as torch's FSDP2 redistributes the
        accumulated gradient before reducing it."""
        for qi, spec in self._partial.items():
            q = self.params[qi]
            want = q.grad_placements(spec.placements)  # [Note: dp_mesh_dims]
            if want == spec.placements:
                continue  # as it arrived on the data-parallel dims, its own elsewhere
            view = grad[q.nat_off : q.nat_off + q.numel].view(q.shape)
            target = DTensorSpec(q.tp_spec.mesh, want, tensor_meta=spec.tensor_meta)
            out = redistribute_local_tensor(view, spec, target)
            if out is not view:
                view.copy_(out)
        self._partial.clear()

    def note_partial(self, qi: int, spec: Any) -> None:
        """A TP view's backward (``views.TPView`` with this unit's ``GradSink``): parameter
        ``qi``'s local gradient is a partial sum, or has other placements than the
        parameter's on the data-parallel dims of ``dp_mesh_dims`` (kept as they are:
        [Note: dp_mesh_dims])."""
        have = self._partial.get(qi)
        if have is not None and have.placements != spec.placements:
            raise AssertionError(
                f"cfsdp: the gradient of '{self.params[qi].fqn}' arrived as {spec.placements} "
                f"after {have.placements} in the same accumulation")
        self._partial[qi] = spec

    def reduce_grad(self, grad: torch.Tensor) -> PendingReduce:
        """Pack the natural gradient into the rank-major reduce-scatter input (cast
        to ``reduce_dtype`` and pre-divided in the same C pass) and issue it."""
        acc = self.acc_grad
        if acc is not None:  # [Note: no-sync accumulation]
            acc += grad
            grad, self.acc_grad = acc, None
        if self._partial:  # (a partial sum is redistributed once it is complete)
            self._redistribute_partial(grad)
        if self.saved_grad is None and self.reduce_dtype == self.dtype:
            out = self.new_grad_buffer()  # reduce straight into the gradient
        else:
            out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
        self.grad_unsharded = False
        # on shared memory the pack runs piece by piece into the shared slots (no
        # rank-major buffer); on the process group it is chunk_pack, then the collective
        pending = comm.reduce_scatter_pack(out, grad.contiguous(), self._plan, self._plan_bytes,
                                           self.pre_divide, self.group, True, op=self.reduce_op)
        return PendingReduce(self, pending, out)

    def publish_grad(self) -> None:
        """Expose the reduced gradient: each parameter's ``.grad`` is a DTensor
        whose local tensor views this rank's rows of the sharded gradient."""
        g = self.saved_grad
        self.saved_grad = None
        self.grad_unsharded = False
        if g is None:
            return
        pub = self._pub
        if pub is None or pub.buf is not g:
            pub = self._pub = self._new_published(g)
        unused = self._unused(g)
        if unused:
            shown = list(pub.dts_all)
            for i in unused:
                shown[i] = None
            pub.shown = tuple(shown)
        else:
            pub.shown = pub.dts_all
        _core.attr_set(self._sharded_t, "grad", pub.shown)

    def _new_published(self, g: torch.Tensor) -> "_Published":
        locals_, dts_all = [], []
        with torch.no_grad():
            for q in self.params:
                if q.requires_grad:
                    local = self._local_view(g, q)
                    locals_.append(local)
                    dts_all.append(self._dtensor(local, q))
                else:
                    dts_all.append(None)
        return _Published(g, tuple(locals_), tuple(dts_all))

    def publish_unsharded_grad(self) -> None:
        """No gradient sync: the unreduced gradient stays with the unit until a
        synchronising backward.  A unit left unsharded (``reshard_after_backward``
        False) shows it as the full-size gradient of each registered parameter,
        as torch does; the sharded parameters keep their sharded gradients."""
        g = self.flat_param.grad
        if self._buf is None or g is None:
            return
        if self._all_got_grad:
            plan = self._grad_view_plan
            if plan is None or plan[0] != self._rg_mask:
                plan = self._grad_view_plan = (
                    self._rg_mask, *views_or_none(self._param_index, self._shapes, self._rg_mask,
                                                  len(self.params)))
            _, index, shapes = plan
        else:  # parameters without a local gradient keep None (not cached: rare)
            mask = bytes(a and b for a, b in zip(self._rg_mask, self._got_grad))
            index, shapes = views_or_none(self._param_index, self._shapes, mask, len(self.params))
        views = _core.shape_views((*torch.split(g, self._split_sizes), None), index, shapes, None,
                                  self._param_index)
        if self._tp:  # a TP parameter's full-size gradient is a DTensor (a partial sum
            # over TP ranks while not yet redistributed, as torch's shows it)
            views = tuple(
                v if v is None or q.tp_spec is None else
                DTensor(v, self._partial[i], requires_grad=False) if i in self._partial else
                self._tp_dtensor(v, q)
                for i, (v, q) in enumerate(zip(views, self.params)))
        _core.attr_set(self._unsharded_t, "grad", views)
        self._unsharded_grads = True


def _weak_note_grads(unit: "ChunkUnit"):
    """``unit.note_grads`` holding the unit weakly: the hook lives on autograd nodes that
    the views in the modules' ``__dict__`` keep alive, out of the garbage collector's
    sight (see ``hook_grad_ready``)."""
    ref = weakref.ref(unit)

    def hook(grad_outputs: tuple) -> None:
        u = ref()
        if u is not None:
            u.note_grads(grad_outputs)

    return hook


class _Published:
    """A unit's published sharded gradient: its buffer, the local views of it, the
    DTensor gradients over them (None for a frozen parameter) and what the parameters
    were given; see [Note: gradient ownership]."""

    __slots__ = ("buf", "locals", "dts_all", "shown")

    def __init__(self, buf: torch.Tensor, locals_: tuple, dts_all: tuple):
        self.buf = buf
        self.locals = locals_
        self.dts_all = dts_all
        self.shown = dts_all  # what the parameters were given: dts_all, None where unused


__all__ = ["ChunkUnit", "ChunkParam", "gradient_divide"]
