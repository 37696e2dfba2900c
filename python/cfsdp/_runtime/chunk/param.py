"""A ``fully_shard`` unit's parameters: what one parameter is and where its pieces live
(``ChunkParam``, torch FSDP2's ``FSDPParam``: its chunk of the layout, its sharded DTensor's
mesh and placements, tensor-parallel and ``dp_mesh_dims`` parameters included), the unit's
data-parallel meshes (``DPMesh``), and the unit's sharded parameters (``ShardedParams``: the
DTensors installed in the modules, the binding table over every occurrence, parameters taken
over after ``to_empty``, ``load_state_dict(assign=True)`` or ``module.to(dtype)``).

The layout itself is [Note: chunk layout] in ``unit.py``.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ... import _core
from ..._torch.dtensor import make_contiguous_strides_for
from ..._torch.dtensor import StridedShard as _StridedShard
from ..replaced import ADOPTED, mark_replaced
from ..views import Bindings, GradSink, TPOccurrence, as_dtensor, dtensor_spec


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
    # an all-gather extension parameter's own pieces (ext.ExtState; None: a plain parameter)
    ext: Any = None

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

    def plan_entry(self, shard_off: int) -> tuple:
        """This parameter's entry of a chunk plan (``comm.pack_plan``), its chunk at
        ``shard_off`` of the shard (an empty parameter's chunk has no blocks: outer 1)."""
        return (self.nat_off, self.numel, self.chunk_numel, shard_off, max(self.outer, 1))

    def local_view(self, buf: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the parameter in a shard-sized ``buf`` (the shard, a sharded
        gradient)."""
        return buf[self.shard_off : self.shard_off + self.local_numel].view(self.local_shape)

    def dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` as this parameter's sharded DTensor (no autograd edge)."""
        return as_dtensor(local, self.mesh, self.placements, self.global_shape, self.global_stride)

    def tp_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (a view of the unsharded buffer) as the module sees a TP parameter:
        a DTensor on the TP mesh (no autograd edge)."""
        return as_dtensor(local, self.tp_spec.mesh, self.tp_spec.placements, self.global_shape,
                          self.global_stride)

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
    def init_tp(self, p: DTensor, dp: DPMesh) -> None:
        """A tensor-parallel parameter (see [Note: tensor-parallel parameters]): the unit
        shards its local tensor over the data-parallel mesh; the sharded DTensor lives on
        the data-parallel mesh and the TP mesh side by side, with torch FSDP2's
        placements."""
        tp_spec = p._spec
        if len(tp_spec.placements) > 2:
            raise NotImplementedError(
                f"FSDP only supports 1D TP/EP or 2D EP+TP, not {tp_spec.placements} (cfsdp: "
                f"parameter '{self.fqn}')"
            )
        try:
            self.mesh = DeviceMesh._concatenate([dp.mesh, tp_spec.mesh])
        except Exception as e:  # noqa: BLE001 - reworded with the parameter's name
            raise ValueError(
                f"fully_shard: parameter '{self.fqn}' is a DTensor on {tp_spec.mesh}, which does not "
                f"combine with the data-parallel mesh {dp.mesh} ({e}). Take both from one "
                "DeviceMesh, e.g. mesh['dp'] for fully_shard and mesh['tp'] for "
                "parallelize_module."
            ) from e
        split = tp_spec.num_shards_map[self.dim]  # TP shards on the dim the unit shards
        dp_placement = _StridedShard(self.dim, split_factor=split) if split > 1 else Shard(self.dim)
        self.placements = ((Replicate(),) if dp.replicate_group is not None else ()) + (
            dp_placement, *tp_spec.placements)
        self.tp_spec = tp_spec
        self.global_shape = p.shape
        self.global_stride = tuple(p.stride())

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
    def init_spmd(self, p: DTensor, dp: DPMesh) -> None:
        """A parameter on the full SPMD mesh (``dp_mesh_dims``: [Note: dp_mesh_dims]):
        ``fully_shard`` checked its mesh and its ``Replicate()`` on the data-parallel dims."""
        spec = p._spec
        spmd = spec.mesh
        names = spmd.mesh_dim_names
        shard_idx = [names.index(n) for n in dp.shard_names]
        rep_idx = [names.index(n) for n in dp.replicate_names]
        pls = list(spec.placements)
        for i in shard_idx:
            split = 1
            for j in range(i + 1, spmd.ndim):
                pj = spec.placements[j]
                if isinstance(pj, (Shard, _StridedShard)) and pj.dim == self.dim:
                    split *= spmd.size(j)
            pls[i] = _StridedShard(self.dim, split_factor=split) if split > 1 else Shard(self.dim)
        if len(shard_idx) <= 1:
            self.mesh, self.placements = spmd, tuple(pls)
        else:  # the shard dims flattened: the data-parallel mesh where the first one was
            meshes, out, skip = [], [], 0
            hsdp = dp.replicate_group is not None
            for i, name in enumerate(names):
                if skip:
                    skip -= 1
                elif name in dp.shard_names:
                    meshes.append(dp.mesh)
                    out.extend(((Replicate(),) if hsdp else ()) + (pls[i],))
                    skip = len(dp.shard_names) - 1
                elif not (hsdp and name in dp.replicate_names):
                    meshes.append(spmd[name])
                    out.append(pls[i])
            self.mesh, self.placements = DeviceMesh._concatenate(meshes), tuple(out)
        self.tp_spec = spec
        self.dp_dims = frozenset(shard_idx + rep_idx)
        self.global_shape = p.shape
        self.global_stride = tuple(p.stride())


class ShardedParams:
    """The sharded parameters of a ``ChunkUnit`` (a part of it, sharing its state): the
    DTensors the modules hold while the unit is sharded, their binding table, and the
    parameters the unit takes over when the user replaces them or their data."""

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

    def _shard_local(self, q: ChunkParam) -> torch.Tensor:
        """``q``'s local tensor: its rows of the shard buffer."""
        local = q.local_view(self.shard)
        if not local.is_meta:
            # The same memory with a storage offset of 0 (DLPack keeps the shard
            # alive): torch's DTensor deep-copies a local tensor at a non-zero
            # offset through its storage and fails (copy.deepcopy(state_dict)).
            local = torch.from_dlpack(local)
        return local

    def _install_sharded_params(self) -> None:
        for q in self.params:
            local = self._shard_local(q) if q.ext is None else q.ext.local
            q.sharded = self._dtensor_param(local, q)
            if q.ext is not None:  # (an alias of it: what _moved compares with)
                q.ext.local = q.sharded._local_tensor
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
            dt = q.dtensor(local.detach())
        dt.requires_grad_(q.requires_grad)
        dt._is_param = True
        return dt

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
                if q.ext is not None:
                    raise NotImplementedError(
                        f"fully_shard: parameter '{q.fqn}' uses the all-gather extensions and was "
                        "replaced or its data swapped (to_empty, load_state_dict(assign=True), "
                        "module.to(...)); cfsdp does not take such a parameter over yet. Load "
                        "values in place (load_state_dict without assign) or replace the "
                        "parameters before fully_shard."
                    )
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
                    q.local_view(self.shard).copy_(cur.to_local())
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
        if q.ext is not None:  # its own subclass tensor (ext.py), not a view of the shard
            return local is not q.ext.local
        mine = q.local_view(self.shard)
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


__all__ = ["ChunkParam", "DPMesh", "ShardedParams", "local_data"]
