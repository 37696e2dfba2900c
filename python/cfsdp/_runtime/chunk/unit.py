"""A unit of the composable face (``fully_shard``): per-parameter chunks (``ChunkUnit``,
torch FSDP2's ``FSDPParamGroup``), composed of its parameters (``param.py``), their
lifecycle (``lifecycle.py``) and its gradients (``grads.py``).

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

import math
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ... import _core
from ..._torch import fsdp2 as _fsdp2
from .. import comm
from ..replaced import orig_uid
from .ext import ExtState, has_extension
from .grads import ChunkGrads, _Published, _weak_note_grads
from .launch import Launches
from .lifecycle import ChunkLifecycle
from .param import ChunkParam, DPMesh, ShardedParams, _contiguous_stride, local_data


class ChunkUnit(ShardedParams, ChunkLifecycle, ChunkGrads):
    """The parameters of one ``fully_shard`` call (see [Note: chunk layout]); meets
    ``base.UnitContract``.  Its parts share the unit's state and each own one concern:
    ``ShardedParams`` (param.py) the sharded parameters, ``ChunkLifecycle`` (lifecycle.py)
    unshard/reshard and what forward binds, ``ChunkGrads`` (grads.py) the gradient path;
    this class lays the parameters out and holds the settings the API sets."""

    def __init__(
        self,
        entries: Sequence[tuple[nn.Module, str, str, nn.Parameter, tuple]],
        dp: DPMesh,
        device: torch.device,
        mp_param_dtype: Optional[torch.dtype],
        mp_reduce_dtype: Optional[torch.dtype],
        shard_dims: Optional[Mapping[nn.Parameter, int]] = None,
        mp_policy: Any = None,
    ):
        """``shard_dims``: the dim (>= 0) of each parameter not sharded on dim 0, as
        ``fully_shard`` validated them (``shard_placement_fn``); ``dp``: the meshes and
        groups, and with ``dp_mesh_dims`` the full SPMD mesh, validated by ``fully_shard``
        too; ``mp_policy``: the call's ``MixedPrecisionPolicy``, which extension parameters'
        ``fsdp_pre_all_gather`` receives ([Note: all-gather extensions] in ext.py)."""
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
        self.mp_policy = mp_policy
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
                q.init_spmd(p, dp)
                self._tp = True
            elif isinstance(p, DTensor):
                q.init_tp(p, dp)
                self._tp = True
            else:
                q.global_shape, q.global_stride = q.shape, q.stride
            if has_extension(p):
                q.ext = self._ext_state(q, p)
            self.params.append(q)
            nat += data.numel()
            shard += q.chunk_numel
        self._ext_params = tuple(q for q in self.params if q.ext is not None)
        self.natural_numel = nat
        self.shard_numel = shard
        self._plan = [q.plan_entry(q.shard_off) for q in self.params]
        self._plan_bytes = comm.pack_plan(self._plan)
        self._launches: Optional[Launches] = None  # made by launches(): the streams' path
        # the trainable parameters' reduce-scatter layout when some are frozen
        # ([Note: trainable layout] in grads.py)
        self._sub_layout = None
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
                if q.ext is not None:  # its values live in its own subclass tensor (ext.py)
                    rows_here.append(self.shard.new_zeros(q.local_numel))
                    continue
                if q.dim:  # Shard(d > 0): this rank's blocks, gathered in one small copy
                    rows_here.append(local_data(p).detach().narrow(q.dim, self.rank * q.chunk_rows,
                                                       q.local_rows).reshape(-1))
                    continue
                start = self.rank * q.chunk_numel
                rows_here.append(local_data(p).detach().reshape(-1)[start : start + q.local_numel])
            _core.shard_fill(self.shard, 0, rows_here, [q.shard_off for q in self.params])
        self._new_natural()
        self._init_unshard_states()  # ``_buf``: ``natural`` while unsharded
        self._comm = None  # the root's CommContext (streams.py), set at lazy init
        self.saved_grad: Optional[torch.Tensor] = None
        # no sync: the unreduced gradient summed in reduce_dtype ([Note: no-sync accumulation])
        self.acc_grad: Optional[torch.Tensor] = None
        # the sharded gradient last published and its DTensors (see [Note: gradient ownership])
        self._pub: Optional[_Published] = None
        self.grad_unsharded = False
        self._init_binding()
        self._unsharded_grads = False  # publish_unsharded_grad's views, shown on the full-size params
        # which parameters received a gradient in the backwards since the last publish
        # (see [Note: unused parameters])
        self._got_all = False  # some backward gave every parameter a gradient
        self._got_some = False  # _got_grad records a backward that gave some none
        self._got_grad = bytearray(len(self.params))
        # the sharded gradients the reduction adds to, as the parameters held them (None: none)
        self._had_grad: Optional[tuple] = None
        # set_reduce_scatter_unused_params; whether the unit was ever unsharded (torch
        # reduces zeros only for parameters that have their unsharded parameter)
        self.reduce_scatter_unused_params = False
        self.ever_unsharded = False
        self._note_grads_hook = _weak_note_grads(self)
        self.post_backward_fn = None
        self.requires_all_reduce = True  # set_requires_all_reduce (HSDP)
        self.partial_reduce: Optional[torch.Tensor] = None  # reduced shards not yet all-reduced
        self.all_reduce_hook = None  # set_all_reduce_hook: called on the reduced shard
        # reshard_after_forward=k (1 < k < W): the group of k ranks backward gathers over
        self.post_forward_group: Optional[dist.ProcessGroup] = None
        self._post_forward_shard: Optional[torch.Tensor] = None
        self._post_forward_event: Any = None  # streams: when the kept shard was written
        self._install_sharded_params()
        self.refresh_requires_grad()
        self.pre_divide = self.post_divide = 1.0
        self.reduce_op = self.replicate_op = dist.ReduceOp.SUM
        self.update_divide_factors()

    def launches(self) -> Launches:
        """The copy-out and reduce-scatter copy-in in a fixed number of launches (launch.py),
        for the accelerator's path (the streams' path: ``_copy_out_on_streams``,
        ``_reduce_on_streams``)."""
        if self._launches is None:
            self._launches = Launches(self._plan, [max(q.rows, 1) for q in self.params],
                                      self.world_size, self.shard_numel)
        return self._launches

    def _ext_state(self, q: ChunkParam, p: nn.Parameter) -> ExtState:
        """An extension parameter's pieces ([Note: all-gather extensions] in ext.py), or
        what it needs that cfsdp does not do yet, raised naming it."""
        missing = [what for what, bad in (
            (f"a Shard({q.dim}) placement", q.dim != 0),
            ("HSDP (a replicate dim)", self.replicate_group is not None),
            ("a tensor-parallel (DTensor) parameter", isinstance(p, DTensor)),
            ("the meta device (deferred initialisation)", p.is_meta)) if bad]
        if missing:
            raise NotImplementedError(
                f"fully_shard: parameter '{q.fqn}' ({type(p).__name__}) uses the all-gather "
                f"extensions (fsdp_pre_all_gather / fsdp_post_all_gather); cfsdp does not "
                f"support them with {' and '.join(missing)} yet. Use torch's fully_shard for "
                "this module, or shard it on dim 0 of a 1-D mesh, materialised."
            )
        return ExtState(p.detach(), self.rank, self.world_size, q.chunk_rows, q.local_rows, q.fqn)

    def _set_dtypes(self, dtype: torch.dtype) -> None:
        """The shard's dtype and the installed torch's mixed-precision rules for it: a policy
        ``param_dtype`` equal to the parameters' dtype (or a non-floating unit) means no
        cast; without a ``reduce_dtype`` the gradients are reduced in ``param_dtype`` (torch
        2.11-2.14, which also treat a ``reduce_dtype`` equal to ``param_dtype`` as none) or in
        the parameters' own dtype, their ``grad_dtype`` (2.15+: fp32 parameters computing in
        bf16 reduce in fp32)."""
        param_dtype, reduce_dtype = self._mp_dtypes
        if reduce_dtype == param_dtype and not _fsdp2.REDUCES_IN_GRAD_DTYPE:
            reduce_dtype = None
        if param_dtype == dtype or not dtype.is_floating_point:
            param_dtype = None
        self.dtype = dtype
        self.param_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or (dtype if _fsdp2.REDUCES_IN_GRAD_DTYPE
                                             else self.param_dtype)
        self.uses_mp = self.param_dtype != dtype

    def drop_iteration(self) -> None:
        """reset_iter_state: reshard and drop what the failed iteration accumulated."""
        self.reshard()
        self.saved_grad = None
        self._had_grad = None
        self._forget_got_grads()
        self.flat_param.grad = None
        self.acc_grad = None
        self.grad_unsharded = False
        self.partial_reduce = None
        self._partial.clear()

    def before_forward(self) -> None:
        self.refresh_requires_grad()
        self._forget_dropped_grads()


__all__ = ["ChunkUnit"]
