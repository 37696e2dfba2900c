"""A unit of the wrapper face: one wrapped module's parameters in one flat parameter,
communicated together (torch FSDP1's ``FlatParamHandle``; FSDP2's ``FSDPParamGroup``).

:class:`Unit` composes four parts that share the unit's state, each owning one concern:
``FlatLayout`` (layout.py: the parameters, the layout, the buffers, the binding plan),
``FlatLifecycle`` (lifecycle.py: unshard / reshard and what the modules show),
``FlatGrads`` (grads.py: the gradient path) and ``FlatWriteback`` (writeback.py: writes to
the original parameters).  This module builds a unit (torch's checks in torch's order, the
mixed-precision dtypes with torch FSDP1's rules, the shard filled in one C pass), takes over
tensor-parallel parameters at wrap time, and takes over what ``nn.Module._apply``
(``model.to(dtype)``, ``.double()``, ``.half()``) makes of the flat parameter.

[Note: tensor-parallel wrapper units]
A parameter that tensor parallelism made a ``DTensor`` on a TP mesh (``parallelize_module``
with ``mesh["tp"]``, the wrapper with ``device_mesh=mesh["dp"]``) takes part in the flat
layout through its *TP-local* tensor, as torch FSDP1's DTensor extension flattens it: the
layout, shard, all-gather and reduce-scatter see only local bytes (C and shared memory as
usual).  At wrap time the unit registers a new ``nn.Parameter`` over the local tensor in
the DTensor's place (:meth:`Unit._take_tp_locals`; the DTensor is marked replaced and its
local storage released once copied), so every other path (flat parameter,
``use_orig_params`` views, tied occurrences, gradients) is the plain one, and
``ParamInfo.tp_spec`` keeps the DTensor's spec (TP mesh, placements, global shape and
stride).  What differs is what modules and
users see, as torch FSDP1 shows it:

* forward binds ``DTensor.from_local`` over each view (run_check=False, the global shape and
  stride; ``views.TPView`` without a sink, its spec built once): its backward turns the
  gradient into the parameter's placements (e.g. a partial
  sum over TP ranks into Replicate, one all-reduce per backward), as torch's;
* summoned and state-dict parameters are DTensors on the TP mesh over the full views
  (:meth:`Unit.params_as_full`); the idle (sharded) attributes of ``use_orig_params=False``
  too;
* with ``use_orig_params=True`` the registered parameters are the local ones: 1-D shard
  slices, as torch's; at dp=1 (NO_SHARD) full-shape local tensors, where torch registers
  DTensors and fails on the second forward (its writeback compares the local and global
  shapes).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ... import _core
from ..._fqn import FLAT_PARAM, clean_tensor_name
from ..base import TrainingState
from ..reduce import divide_factors
from ..replaced import WRAPPER, WRAPPER_TP, mark_replaced
from .grads import FlatGrads
from .layout import ALIGN_BYTES, FlatLayout
from .lifecycle import FlatLifecycle
from .writeback import FlatWriteback, writeback_check_skipped


class Unit(FlatLifecycle, FlatGrads, FlatWriteback, FlatLayout):
    """One unit's layout, buffers, state and gradient reduction (FSDP1's flat layout;
    meets ``base.UnitContract``), composed of its parts (``FlatLayout``, ``FlatLifecycle``,
    ``FlatGrads``, ``FlatWriteback``).  This class builds the state they share and takes over
    ``nn.Module._apply``'s results."""

    def __init__(
        self,
        module: nn.Module,
        params: list[nn.Parameter],
        group: dist.ProcessGroup,
        use_orig_params: bool,
        device: torch.device,
        name_for_errors: str,
        sharded: bool = True,
        replicate_group: Optional[dist.ProcessGroup] = None,
        mixed_precision=None,
    ):
        self.module = module
        self.group = group
        self.rank = group.rank()
        self.world_size = group.size()
        # NO_SHARD: every rank holds the whole flat parameter and gradients are
        # all-reduced; the layout then has one "rank".
        self.sharded = sharded
        # HSDP: the sharded gradient is also all-reduced over this group.
        self.replicate_group = replicate_group
        dp_size = self.world_size * (replicate_group.size() if replicate_group is not None else 1)
        self.use_orig_params = use_orig_params
        self.device = device
        self._where = name_for_errors
        # [Note: writeback of original parameters]; torch reads its switch at construction
        self._skip_writeback = writeback_check_skipped(use_orig_params)
        self.state = TrainingState.IDLE
        self.pre_divide, self.post_divide = divide_factors(dp_size)
        self.replicate_op = dist.ReduceOp.SUM  # HSDP's reduction across replicas
        self.all_reduce_hook = None  # called on the reduced shard before the post-divide
        self.requires_all_reduce = True  # fully_shard's setting; the wrapper always all-reduces
        self.partial_reduce: Optional[torch.Tensor] = None
        self.infos, self.shared = self._collect(module, params)
        self._validate(name_for_errors)
        # [Note: tensor-parallel wrapper units]
        self.tp = any(i.tp_spec is not None for i in self.infos)
        tp_originals = self._take_tp_locals() if self.tp else []
        dtype = self.infos[0].param.dtype
        self.dtype = dtype  # of the shard, the optimizer's parameters and gradients
        self.requires_grad = any(i.param.requires_grad for i in self.infos)
        # Mixed precision, with torch FSDP1's rules: forward/backward in
        # param_dtype; gradients reduced in reduce_dtype, which defaults to
        # param_dtype when only that is given, else to the parameter dtype.
        mp = mixed_precision
        mp_param = getattr(mp, "param_dtype", None)
        mp_reduce = getattr(mp, "reduce_dtype", None)
        self._mp_param_given, self._mp_reduce_given = mp_param is not None, mp_reduce is not None
        self.param_dtype = mp_param or dtype
        self.reduce_dtype = mp_param if (mp_param and not mp_reduce) else (mp_reduce or dtype)
        self.keep_low_precision_grads = bool(getattr(mp, "keep_low_precision_grads", False))
        self.uses_mp = self.param_dtype != dtype
        align = ALIGN_BYTES // self.param_dtype.itemsize if use_orig_params else 0
        lay_ws = self.world_size if sharded else 1
        self._lay_rank = self.rank if sharded else 0
        self.plan_align = align  # plan_layout's alignment (Muon plans other TP ranks' layouts)
        self.layout = _core.plan_layout([i.numel for i in self.infos], align, lay_ws)
        self._split_sizes, self._split_index = self._plan_splits()
        # Whether this rank's shard holds any element of an original parameter (else it is
        # all padding); with use_orig_params=True such a rank has no per-parameter grads.
        self.holds_local_elements = any(sl.numel > 0 for sl in self.layout.slices[self._lay_rank])

        lay = self.layout
        self.shard = torch.empty(lay.shard_numel, dtype=dtype, device=device)
        _core.shard_fill(
            self.shard,
            self._lay_rank * lay.shard_numel,
            [i.flat(i.param.detach()) for i in self.infos],
            lay.offsets,
        )
        self._fill_alignment_padding()
        for p in tp_originals:  # copied into the shard: the replaced DTensors' local storage goes
            p._local_tensor.data = torch.empty(0, dtype=p.dtype, device=p._local_tensor.device)
        if not sharded:
            self.shard = self.shard[: lay.flat_numel]
        self.flat_param = nn.Parameter(self.shard, requires_grad=self.requires_grad)
        self.flat_param._cfsdp_flattened = True  # type: ignore[attr-defined]
        # the unit of a wrapper parameter (flat or, use_orig_params=True, original): what
        # cfsdp.optim.Muon reads the layout of each matrix from
        self.flat_param._cfsdp_unit = weakref.ref(self)  # type: ignore[attr-defined]
        self._make_buffers()
        self.saved_grad: Optional[torch.Tensor] = None
        self._applied: Optional[nn.Parameter] = None  # see _take_applied
        # True while flat_param.grad is an unsharded gradient accumulated
        # under no_sync() (not yet reduced).
        self.grad_unsharded = False
        # True from the unit's pre-backward or post-backward to the end of that backward
        # ([Note: units outside a backward] in grads.py)
        self.in_backward = False
        self._init_binding()
        self._init_writeback()
        self._install_initial_views()
        self._hooked = False
        # [Note: one post-backward per iteration] in base.py
        self.first_grad_node = None
        self.grad_waiting = False
        self.refresh_requires_grad()
        # Set by the owning face: called with (unit, unsharded_grad) when the
        # flat gradient is ready in backward.
        self.post_backward_fn = None
        # the root's stream protocol (streams.FlatStreams), set by the face at lazy init
        self._comm = None
        # register_comm_hook: hook(state, grad[, output]) replaces the reduction
        # (and FSDP's own divides); a low-precision hook also does the casts.
        self.comm_hook = None
        self.comm_hook_state = None
        self.comm_hook_low_precision = False

    def _take_tp_locals(self) -> list:
        """[Note: tensor-parallel wrapper units]: register a new ``nn.Parameter`` over each TP
        parameter's local tensor (same ``requires_grad``) at every occurrence in place of the
        DTensor, which is marked replaced (an optimizer built from it is caught).  Returns the
        replaced DTensors, whose local storage the caller releases once the unit has copied
        it."""
        how = WRAPPER_TP if self.use_orig_params else WRAPPER
        swap: dict = {}
        for info in self.infos:
            if info.tp_spec is not None:
                dt = info.param
                swap[dt] = nn.Parameter(dt._local_tensor.detach(), requires_grad=dt.requires_grad)
                mark_replaced(dt, info.fqn, how, info.module, info.name)
        for info in [*self.infos, *self.shared]:
            local = swap.get(info.param)
            if local is not None:
                info.module._parameters[info.name] = local
                info.param = local
        return list(swap)

    # ----------------------------------- nn.Module._apply: model.to(dtype), .double(), .half()
    @contextlib.contextmanager
    def flat_param_registered(self):
        """Around ``nn.Module._apply`` of the unit's modules (``model.to(dtype)``,
        ``.double()``, ``.half()``): the flat parameter is what it converts, as torch
        FSDP1's ``_apply`` arranges (``_deregister_orig_params_ctx``).  The unit is
        resharded first (the shard is what is converted); with use_orig_params=True the
        original parameters are taken off their modules and the flat parameter registered
        for the call, then each is put back in its place.  :meth:`adopt_flat_data` takes
        the result over.  With use_orig_params=True, writes to the original parameters are carried over first, and
        gradients the user cleared (``zero_grad``) stay cleared: the flat gradient goes
        through the conversion too, and would otherwise show again."""
        self.reshard()
        self._applied = None
        if not self.use_orig_params:
            try:
                yield
            finally:
                self._take_applied()
            return
        self.drop_grad_if_orig_grads_cleared()
        self.writeback_orig_params()
        hidden: dict[int, tuple[dict, dict, list]] = {}  # id -> (_parameters, ours, order)
        for info in (*self.infos, *self.shared):
            d = info.module._parameters
            entry = hidden.setdefault(id(d), (d, {}, list(d)))
            entry[1][info.name] = self.infos[info.primary].param if info.primary >= 0 else info.param
            d.pop(info.name, None)
        self.module._parameters[FLAT_PARAM] = self.flat_param
        try:
            yield
        finally:
            self._take_applied()
            self.module._parameters.pop(FLAT_PARAM, None)
            for d, ours, order in hidden.values():
                rest = dict(d)
                d.clear()
                for k in order:
                    if k in ours:
                        d[k] = ours[k]
                    elif k in rest:
                        d[k] = rest.pop(k)
                d.update(rest)

    def _take_applied(self) -> None:
        """``_apply`` may register a new parameter in the flat parameter's place (a move
        to another kind of tensor, or ``torch.__future__``'s overwrite-on-conversion): the
        unit keeps its own object (the optimizer holds it) and :meth:`adopt_flat_data`
        looks at the new one's data."""
        got = self.module._parameters.get(FLAT_PARAM)
        if got is not None and got is not self.flat_param:
            self._applied = got
            self.module._parameters[FLAT_PARAM] = self.flat_param

    def adopt_flat_data(self, keep_dtypes: bool = False) -> None:
        """After ``nn.Module._apply`` (inside :meth:`flat_param_registered`): when it gave
        the flat parameter new data (a new dtype), that becomes the shard and the unit
        follows, with torch FSDP1's rules (its ``init_flat_param_attributes``): the
        mixed-precision dtypes the user gave stay, the others follow the new dtype; the
        buffers, the modules' views and the original parameters' data and gradients are
        made anew.  The layout (alignment included) stays, as torch's.  ``keep_dtypes``:
        every compute and reduction dtype stays, given or not (the caller set torch's
        ``_handle._orig_param_dtype`` to the new dtype itself, as accelerate does, so
        torch's lazy initialisation sees no change of dtype and refreshes nothing)."""
        applied, self._applied = self._applied, None
        new = (applied if applied is not None else self.flat_param).data
        old = self.shard
        if new.dtype == old.dtype and new.device == old.device and _core.address(new) == _core.address(old):
            return
        if new.device != old.device or not (new.is_floating_point() or new.is_complex()):
            self.flat_param.data = old
            what = (f"moves it to {new.device}" if new.device != old.device
                    else f"casts it to {new.dtype}")
            err = NotImplementedError if new.device != old.device else TypeError
            raise err(
                f"cfsdp: nn.Module._apply (to / cuda / type ...) {what}, but {self._where}'s "
                f"parameters (e.g. '{clean_tensor_name(self.infos[0].fqn)}') are sharded "
                f"{old.dtype} on {old.device}: cast to a floating-point dtype, or move the "
                "module before wrapping it.")
        if new.shape != old.shape:
            raise AssertionError(f"cfsdp unit: _apply changed the shard's shape {old.shape} to {new.shape}")
        if applied is not None:
            self.flat_param.data = new
            self.flat_param.grad = applied.grad
        self.shard = new
        self.dtype = new.dtype
        if not self._mp_param_given and not keep_dtypes:
            self.param_dtype = new.dtype
            if not self._mp_reduce_given:
                self.reduce_dtype = new.dtype
        self.uses_mp = self.param_dtype != self.dtype
        self._make_buffers()
        views = self._make_idle_views()
        if self.use_orig_params:
            for info, v in zip(self.infos, self.shard_views()):
                info.param.data = v
            self._note_data()
            if self.grad_unsharded:
                self.show_unsharded_grad()
            else:
                self.orig_grads_as_shard_views()
        else:
            self._bind.show(self._bind.per_occurrence(views))
