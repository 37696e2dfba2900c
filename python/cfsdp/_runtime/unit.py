"""A unit: the parameters that are communicated together.

[Note: unit buffers]
A unit owns three buffers, all 1-D and of the unit's dtype:

* ``shard``: this rank's ``layout.shard_numel`` elements of the flat buffer
  (flat elements ``[rank * S, (rank + 1) * S)``, zero past ``flat_numel``).
  It lives for the unit's whole life; the optimizer updates it in place
  (through ``flat_param`` or, with ``use_orig_params=True``, through the
  original parameters, whose ``.data`` are views into it).
* ``unsharded``: ``layout.padded_numel`` elements, the all-gather output.  Its
  tensor object lives for the unit's life but its *storage* is resized to
  zero bytes while the unit is sharded.  Views taken from it (and saved by
  autograd in forward) stay valid across reshard/unshard because a refill
  reuses the same storage object.
* ``flat_param``: the ``nn.Parameter`` autograd sees.  ``flat_param.data`` is
  ``shard`` while sharded and ``unsharded[:flat_numel]`` while unsharded;
  parameters used in forward are views of it, so their gradients accumulate
  into one flat gradient that the post-backward hook reduce-scatters.

The layout (offsets, padding, shard ranges) comes from the C planner
(``cfsdp._core.plan_layout``) and follows torch FSDP1's ``FlatParameter``
exactly, so shapes and numerics match torch.

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
  stride; :class:`~.views.TPView` without a sink, its spec built once): its backward turns the
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
import logging
import operator
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import _core
from .._fqn import FLAT_PARAM, clean_tensor_name, full_name, join_fqn
from . import comm
from .base import (PendingReduce, TrainingState, UnshardStates, accumulate_sharded, all_none,
                   alloc_storage, free_storage, set_grad, views_or_none)
from .reduce import divide_factors, scale_cast_add
from .replaced import WRAPPER, WRAPPER_TP, mark_replaced
from .views import Bindings, TPOccurrence, as_tp, changed_mask, hook_flat_grad, split_views, tp_views

# torch's FSDP1 aligns every original parameter to 16 bytes in the flat
# buffer when use_orig_params=True (a TorchInductor requirement).
_ALIGN_BYTES = 16
_ALIGN_PAD_VALUE = 42  # what torch's FSDP1 writes into those gaps


# The binding table, the forward views and the TP views are views.py's, shared with the
# chunk units ([Note: bulk binding], [Note: forward views]).


# [Note: strided parameters]
# A parameter that is not row-major (``nn.Parameter(torch.randn(a, b).t())``, a
# channels-last convolution weight) keeps its memory layout, as torch FSDP1's
# ``FlatParamHandle`` does: its elements enter the flat buffer in *memory* order
# (``as_strided((numel,), (1,))``) and every view of it (forward, summon, state dicts,
# gradients, optimizer states) is ``as_strided(shape, stride)`` with its own stride.
# So the module computes with the strides it was built with, the kernels pick the same
# paths and round the same as torch's and as the unwrapped model's (a row-major copy
# differs in the 7th digit), and the flat buffer, the shards and LOCAL state dicts are
# torch's element for element.  ``ParamInfo.stride`` is that stride, or None for a
# parameter viewed with ``.view(shape)``: a row-major one, and one whose elements do not
# fill a dense block of memory (``randn(4, 8)[:, :4]``), which torch would read past
# (its ``as_strided`` takes ``numel`` elements from the storage offset) and cfsdp lays
# out row-major.  Anything that moves values between a parameter's shape and its flat
# elements goes through ``ParamInfo.view`` / ``ParamInfo.flat``.


def kept_stride(t: torch.Tensor) -> Optional[tuple[int, ...]]:
    """The stride ``t``'s views keep in a flat buffer, or None: [Note: strided parameters].
    torch's test (``_is_truly_contiguous``): row-major and a last stride of 1."""
    if t.stride(-1) == 1 and t.is_contiguous():
        return None
    # dense and non-overlapping: the strides, smallest first, are the running products
    # of the sizes (a size-1 dimension's stride does not matter)
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1)
    step = 1
    for st, n in dims:
        if st != step:
            return None
        step *= n
    return tuple(t.stride())


# [Note: writeback of original parameters]
# With use_orig_params=True the optimizer and the user hold the original parameters, whose
# ``.data`` between steps are views of the shard (1-D slices; full shapes with NO_SHARD) and
# whose ``.grad`` are views of the flat gradient.  A user may point them elsewhere:
# ``p.data = t``, ``p.grad = g``, ``p.grad = None`` for some parameters only, or register a
# new parameter object (``module.weight = nn.Parameter(...)``).  torch's FSDP1 carries each
# over into the flat parameter before its next unshard (``FlatParamHandle.
# _writeback_orig_params``, from ``pre_unshard``: pre-forward, pre-backward, prefetch,
# summon_full_params, FULL and SHARDED state dicts), and so does
# :meth:`Unit.writeback_orig_params`, in torch's order and with torch's rules, for every
# parameter this rank holds elements of (the others are ignored, as torch):
#
# * a new registered object is adopted as the parameter (its gradient is not carried over);
# * a parameter whose data no longer shares the shard's storage is copied into its place:
#   it must have the shape it has between steps (torch's RuntimeError "Cannot writeback
#   when the parameter shape changes" otherwise, naming the FQN); a NO_SHARD parameter may
#   have another shape of as many elements, as torch's ``view(-1)`` allows;
# * a gradient set to None while the flat gradient exists zeroes its part of it (the
#   parameter's next gradient starts from zero, and it shows None until the next
#   backward); a gradient that does not share the flat gradient's storage is copied into
#   its part (creating a zero flat gradient if there is none);
# * a tied occurrence that no longer holds the same object as its first one is torch's
#   NotImplementedError.
#
# Then the parameters' data and gradients are views again (torch re-points them at its next
# reshard; cfsdp at once).  Nothing is written back while the modules show the forward's views
# (SHARD_GRAD_OP between forward and backward: torch raises there if a view changed) or full
# parameters (summon, state dicts); a unit kept unsharded writes back into the shard and keeps
# computing with the buffer it holds ([Note: kept unsharded units]).  With no_sync's unsharded
# gradient, a gradient set to None zeroes the parameter's whole range of it, and a new one is
# copied there (torch writes ``[offset_in_shard, + numel_in_shard)`` of it, the wrong region).
# The check costs three C-level passes per unshard (registered objects, data addresses,
# gradient objects against what the unit last set: ``_idle_ptrs``, ``_shown_grads``); the
# per-parameter Python runs only when one of them differs.  torch's
# ``FSDP_SKIP_WRITEBACK_CHECK=1`` turns it off.
#
# [Note: kept unsharded units]
# A wrapper unit stays unsharded (its all-gathered buffer kept, or NO_SHARD's parameters)
# after a training forward when it is the root or does not reshard after forward
# (SHARD_GRAD_OP, _HYBRID_SHARD_ZERO2, NO_SHARD), and after a no_sync() backward with those
# strategies.  As torch FSDP1 (``_reshard`` without freeing, then ``_use_sharded_views``),
# the modules then show the registered original parameters again (``end_forward_views``):
# their data the shard's views (full shapes with NO_SHARD), their gradients no_sync's
# unsharded gradient as full-shape views.  Only SHARD_GRAD_OP / _HYBRID_SHARD_ZERO2 keep the
# forward's views until backward (torch's "skipped sharded views").  During forward the
# views are registered too (``module._parameters``), as torch's: ``module.parameters()``
# inside forward gives them, and gradients flow through them.  A write to a kept unit's
# parameters is carried into the shard at its next unshard, as any other; the buffer it
# holds is not gathered again, so the rest of the accumulation computes with the values it
# holds, and the write shows from the next all-gather (after the synchronising backward), as
# torch's.  Showing it earlier would take a collective on every forward: ranks cannot know
# whether another rank wrote.  A state dict taken meanwhile copies the kept buffer (torch's
# values) and keeps it; summon_full_params frees it on exit, so the next forward gathers
# again (torch keeps it, with whatever summon's writeback=False left in it).

_SKIP_WRITEBACK_ENV = "FSDP_SKIP_WRITEBACK_CHECK"  # torch's switch (_flat_param.py)
_log = logging.getLogger(__name__)


class WritebackError(RuntimeError):
    """A write to an original parameter (or its gradient) after wrapping that cannot be
    carried over into the flat parameter ([Note: writeback of original parameters]).
    torch's FSDP1 raises ``RuntimeError`` there, so this is one (and a ``ValueError``:
    bad user input)."""


def scalar_param_message(torch_name: str, fqn: str) -> str:
    """torch FSDP1's error for a 0-dim parameter (``_verify_managed_params``: it names the
    parameter relative to the wrapped module), with cfsdp's FQN and advice."""
    return (
        "FSDP doesn't support scalar parameters. "
        f"Change {torch_name} to a 1D tensor with numel equal to 1. (cfsdp: the parameter "
        f"is '{fqn}'; e.g. nn.Parameter(torch.tensor([v])), or pass it in ignored_states.)"
    )


def flatten_error(params: list, use_orig_params: bool) -> Optional[tuple[str, int]]:
    """What torch FSDP1 says of these parameters (in flatten order) when it builds their
    flat parameter (``FlatParamHandle._validate_tensors_to_flatten``): ``(torch's
    message, index of the parameter it stops at)``, or None if torch accepts them.  A
    complex first parameter is accepted here (cfsdp flattens complex parameters; torch
    calls it an integer dtype)."""
    dtype = requires_grad = device = None
    for k, p in enumerate(params):
        if dtype is None and not (p.is_floating_point() or p.is_complex()):
            return "Cannot flatten integer dtype tensors", k
        if dtype is not None and p.dtype != dtype:
            return f"Must flatten tensors with uniform dtype but got {dtype} and {p.dtype}", k
        if not use_orig_params and requires_grad is not None and p.requires_grad != requires_grad:
            return ("Must flatten tensors with uniform `requires_grad` when "
                    "`use_orig_params=False`"), k
        if device is not None and p.device != device:
            return f"Must flatten tensors on the same device but got both {device} and {p.device}", k
        dtype, device = p.dtype, p.device
        requires_grad = requires_grad or p.requires_grad
    return None


@dataclass
class ParamInfo:
    """Where an original parameter lives: ``module.<name>``."""

    module: nn.Module
    name: str
    fqn: str  # relative to the unit's module, raw (wrapper prefixes kept)
    shape: torch.Size
    numel: int
    param: nn.Parameter  # the original parameter object (a TP parameter's local one)
    primary: int = -1  # for a shared (tied) occurrence: index of the first one
    # a tensor-parallel parameter's DTensorSpec (TP mesh, placements, global shape and
    # stride); None for a plain one.  ``shape`` / ``numel`` are then the local tensor's.
    tp_spec: Any = None
    # [Note: strided parameters]: the stride its views keep (its flat elements are in
    # memory order); None for a parameter laid out and viewed row-major
    stride: Optional[tuple[int, ...]] = None

    def view(self, piece: torch.Tensor) -> torch.Tensor:
        """``piece`` (this parameter's ``numel`` elements of a flat buffer) with the
        parameter's shape, and its stride ([Note: strided parameters])."""
        if self.stride is None:
            return piece.view(self.shape)
        return piece.as_strided(self.shape, self.stride)

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a tensor of the parameter's shape: the parameter itself, a state of it)
        as its ``numel`` flat elements in the layout's order ([Note: strided
        parameters]); a view of ``t`` where it can be."""
        if self.stride is None:
            return t.reshape(-1)
        if t.stride() != self.stride:
            t = torch.empty_strided(self.shape, self.stride, dtype=t.dtype, device=t.device).copy_(t)
        return t.as_strided((self.numel,), (1,))

    @property
    def global_shape(self) -> torch.Size:
        """The shape the module and state dicts see (the DTensor's, for a TP parameter)."""
        return self.shape if self.tp_spec is None else self.tp_spec.shape


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch FSDP1's test of whether ``a`` still lives in ``b``'s memory."""
    return _core.storage_address(a) == _core.storage_address(b)


class Unit(UnshardStates):
    """One unit's layout, buffers, state and gradient reduction (FSDP1's flat layout;
    meets ``base.UnitContract``)."""

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
        self._skip_writeback = use_orig_params and os.environ.get(_SKIP_WRITEBACK_ENV, "") == "1"
        if self._skip_writeback:
            _log.warning("Since %s=1, FSDP will not check for parameter or gradient writeback. "
                         "Changing parameter or gradient storages may lead to silent correctness "
                         "errors.", _SKIP_WRITEBACK_ENV)
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
        align = _ALIGN_BYTES // self.param_dtype.itemsize if use_orig_params else 0
        lay_ws = self.world_size if sharded else 1
        self._lay_rank = self.rank if sharded else 0
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
        self._make_buffers()
        self.saved_grad: Optional[torch.Tensor] = None
        self._applied: Optional[nn.Parameter] = None  # see _take_applied
        # True while flat_param.grad is an unsharded gradient accumulated
        # under no_sync() (not yet reduced).
        self.grad_unsharded = False
        self._init_binding()
        self._install_initial_views()
        self._hooked = False
        self.refresh_requires_grad()
        # Set by the owning face: called with (unit, unsharded_grad) when the
        # flat gradient is ready in backward.
        self.post_backward_fn = None
        # register_comm_hook: hook(state, grad[, output]) replaces the reduction
        # (and FSDP's own divides); a low-precision hook also does the casts.
        self.comm_hook = None
        self.comm_hook_state = None
        self.comm_hook_low_precision = False

    # ------------------------------------------------------------------ init
    def _init_binding(self) -> None:
        """The tuples of [Note: bulk binding]: every occurrence of an original
        parameter (tied ones have several), its module's ``__dict__``, its name."""
        self._bind = Bindings([(i, info.module, info.name) for i, info in enumerate(self.infos)]
                              + [(s.primary, s.module, s.name) for s in self.shared])
        self._occ_index = self._bind.index
        self._orig_t = tuple(i.param for i in self.infos)
        # [Note: writeback of original parameters]: the object each occurrence's registered
        # parameters should hold; what the unit last set as data and gradients
        self._occ_params = self._bind.per_occurrence(self._orig_t)
        self._idle_ptrs: tuple = ()
        self._shown_grads: tuple = (None,) * len(self.infos)
        self._grads_hidden = False  # the writeback showed a gradient set to None as None
        # the modules show the forward's views ([Note: kept unsharded units]) / full
        # parameters (summon, state dicts); while neither, they show the registered
        # parameters over the shard, and writes to them may be carried over
        self._views_bound = False
        self._shown_full = False
        # a 1-D parameter's piece of the split already has its shape
        # (a strided parameter's too: _restride makes its view, [Note: strided parameters])
        self._shapes = tuple(None if len(i.shape) == 1 or i.stride is not None else i.shape
                             for i in self.infos)
        # occurrences of strided parameters: (parameter index, its occurrence indices)
        strided: dict[int, list[int]] = {}
        for k, i in enumerate(self._occ_index):
            if self.infos[i].stride is not None:
                strided.setdefault(i, []).append(k)
        self._strided_occ = tuple((i, tuple(ks)) for i, ks in strided.items())
        self._strided_params = tuple((i, (i,)) for i in strided)
        self._param_index = tuple(range(len(self.infos)))
        self._grad_split: Optional[tuple] = None  # see _orig_grad_views
        self._rg_mask: Optional[bytes] = None
        # occurrences of TP parameters, whose views the module sees as DTensors, their
        # gradients redistributed at once as torch FSDP1's from_local does (no sink:
        # [Note: tensor-parallel wrapper units])
        self._tp_occ = tuple(
            TPOccurrence(k, sp.mesh, sp.placements, sp.shape, sp.stride)
            for k, sp in enumerate(self.infos[i].tp_spec for i in self._occ_index) if sp is not None)
        # summon/state dicts with use_orig_params=True: the DTensor parameters registered
        # over a TP parameter's full view while shown full (restored by params_as_sharded)
        self._shown_tp: dict[int, nn.Parameter] = {}

    def _fill_alignment_padding(self) -> None:
        """torch's FSDP1 fills the gaps that align parameters (use_orig_params=True)
        with ``_ALIGN_PAD_VALUE``; they only show in LOCAL state dicts, which must
        match torch's bit for bit."""
        lay = self.layout
        lo, hi = self._lay_rank * lay.shard_numel, (self._lay_rank + 1) * lay.shard_numel
        ends = [off + n for off, n in zip(lay.offsets, lay.numels)]
        for gap_lo, gap_hi in zip(ends, [*lay.offsets[1:], lay.flat_numel]):
            a, b = max(gap_lo, lo), min(gap_hi, hi)
            if a < b:
                self.shard[a - lo : b - lo].fill_(_ALIGN_PAD_VALUE)

    @staticmethod
    def _collect(module: nn.Module, params: list[nn.Parameter]):
        wanted = set(params)
        infos: list[ParamInfo] = []
        shared: list[ParamInfo] = []
        first: dict[nn.Parameter, int] = {}
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            for name, p in list(mod._parameters.items()):
                if p is None or p not in wanted:
                    continue
                local = p._local_tensor if isinstance(p, DTensor) else p
                info = ParamInfo(mod, name, join_fqn(mod_name, name), local.shape, local.numel(), p,
                                 tp_spec=p._spec if isinstance(p, DTensor) else None,
                                 stride=kept_stride(local))
                if p in first:
                    info.primary = first[p]
                    shared.append(info)
                else:
                    first[p] = len(infos)
                    infos.append(info)
        return infos, shared

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

    def _validate(self, where: str) -> None:
        """torch FSDP1's checks of a flat parameter's tensors, in its order and with its
        messages (``scalar_param_message``, ``flatten_error``), then cfsdp's: every
        parameter on the unit's device.  cfsdp also flattens complex parameters."""
        for i in self.infos:
            if i.param.dim() == 0:
                raise ValueError(scalar_param_message(
                    i.fqn, full_name(i.module, i.name, known=i.fqn)))
        err = flatten_error([i.param for i in self.infos], self.use_orig_params)
        if err is not None:
            msg, k = err
            i, first = self.infos[k], self.infos[0]
            p = i.param
            if k == 0:
                advice = (f"{where}'s parameter '{i.fqn}' has dtype {p.dtype}; FSDP shards "
                          "floating-point parameters only. Register it as a buffer, or pass its "
                          "module in ignored_modules / the parameter in ignored_states.")
            elif msg.startswith("Must flatten tensors with uniform dtype"):
                advice = (f"all parameters of one FSDP unit must share a dtype: {where}'s "
                          f"'{first.fqn}' is {first.param.dtype} but '{i.fqn}' is {p.dtype}. Cast "
                          "the module to one dtype before wrapping, or wrap these parameters "
                          "in separate units (a non-floating parameter: register it as a "
                          "buffer or ignore it).")
            elif msg.startswith("Must flatten tensors on the same device"):
                advice = (f"{where}'s parameter '{i.fqn}' is on {p.device} but '{first.fqn}' "
                          f"is on {first.param.device}. Move the module to {self.device} "
                          "before wrapping.")
            else:
                advice = (f"use_orig_params=False needs uniform requires_grad within a unit, "
                          f"but {where}'s parameter '{i.fqn}' has requires_grad="
                          f"{p.requires_grad} and an earlier one does not. Wrap frozen and "
                          "trainable parameters in separate units, or use use_orig_params=True.")
            raise ValueError(f"{msg} (cfsdp: {advice})")
        for i in self.infos:
            p = i.param
            if p.device != self.device:
                raise ValueError(
                    f"{where}'s parameter '{i.fqn}' is on {p.device} but FSDP runs on "
                    f"{self.device}. Move the module to {self.device} before wrapping "
                    "(or pass the matching device_id)."
                )

    def _plan_splits(self) -> tuple[list[int], list[int]]:
        """Split sizes of the flat parameter (padding pieces included) and,
        for each original parameter, the index of its piece."""
        sizes: list[int] = []
        index: list[int] = []
        pos = 0
        for off, n in zip(self.layout.offsets, self.layout.numels):
            if off > pos:
                sizes.append(off - pos)
            index.append(len(sizes))
            sizes.append(n)
            pos = off + n
        if self.layout.flat_numel > pos:
            sizes.append(self.layout.flat_numel - pos)
        return sizes, tuple(index)

    @property
    def flat_numel(self) -> int:
        return self.layout.flat_numel

    @property
    def holds_full_precision(self) -> bool:
        """Unsharded in the parameters' own dtype (as summon needs)?"""
        return self._buf is not None and self._buf.dtype == self.dtype

    def full_storage_ptr(self) -> int:
        """Address of the storage the unsharded parameters live in (summon)."""
        if self._buf is None:
            raise AssertionError("cfsdp unit: not unsharded")
        return _core.storage_address(self._buf)

    def _views_of(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return [
            i.view(buf[off : off + i.numel])
            for off, i in zip(self.layout.offsets, self.infos)
        ]

    def _as_seen(self, views: list) -> list:
        """Per-parameter ``views`` as the module sees them: a TP parameter's as a DTensor
        on its TP mesh ([Note: tensor-parallel wrapper units]), the others as they are."""
        if not self.tp:
            return views
        return [v if i.tp_spec is None else as_tp(v, i.tp_spec) for i, v in zip(self.infos, views)]

    def _full_views(self, buf: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Views with the original shapes of the current unsharded buffer (or of
        ``buf``, a copy of it)."""
        if buf is not None:
            return self._views_of(buf)
        if self._buf is None:
            raise AssertionError("cfsdp unit: full views of a sharded unit")
        return self._views_of(self._buf)

    def shard_views(self) -> list[torch.Tensor]:
        """This rank's slice of each original parameter, as views of ``shard``
        (1-D slices when sharded; the full shapes with NO_SHARD)."""
        if not self.sharded:
            return self._views_of(self.shard)
        out = []
        for sl in self.layout.slices[self.rank]:
            out.append(self.shard[sl.shard_offset : sl.shard_offset + sl.numel])
        return out

    def _make_buffers(self) -> None:
        """The forward buffer (param_dtype): the all-gather output, or for NO_SHARD with
        mixed precision the low-precision copy of the shard; the full-precision gather for
        summon and state dicts under mixed precision; the buffer the parameters live in
        (None while sharded).  Storage freed until the first unshard."""
        lay, sharded = self.layout, self.sharded
        fwd_numel = lay.padded_numel if sharded else (lay.flat_numel if self.uses_mp else 0)
        self.unsharded = torch.empty(fwd_numel, dtype=self.param_dtype, device=self.device)
        self.unsharded_full = (
            torch.empty(lay.padded_numel, dtype=self.dtype, device=self.device)
            if (sharded and self.uses_mp)
            else None
        )
        if self.unsharded_full is not None:
            self.unsharded_full.untyped_storage().resize_(0)
        self._init_unshard_states(None if (sharded or self.uses_mp) else self.shard)

    def _make_idle_views(self) -> list:
        """What a sharded unit's modules hold with use_orig_params=False: views with full
        shapes of the forward buffer, whose storage is freed until the first unshard (as
        torch leaves its module attributes); with NO_SHARD, views of the shard."""
        if self.sharded or self.uses_mp:
            alloc_storage(self.unsharded)
            views = self._views_of(self.unsharded)
            free_storage(self.unsharded)
        else:
            views = self._views_of(self.shard)
        self._idle_views = self._as_seen(views)
        return self._idle_views

    def _install_initial_views(self) -> None:
        views = self._make_idle_views()
        if self.use_orig_params:
            for info, v in zip(self.infos, self.shard_views()):
                info.param.data = v
                info.param._cfsdp_flattened = True  # type: ignore[attr-defined]
        else:
            for info, v in zip(self.infos, views):
                del info.module._parameters[info.name]
                info.module.__dict__[info.name] = v
                # The original parameter is no longer trained: free it, and
                # mark it so an optimizer built before wrapping is caught.
                info.param.data = torch.empty(0, dtype=self.dtype, device=self.device)
                mark_replaced(info.param, info.fqn, WRAPPER, info.module, info.name)
            for s in self.shared:
                del s.module._parameters[s.name]
                s.module.__dict__[s.name] = views[s.primary]
                mark_replaced(s.param, s.fqn, WRAPPER, s.module, s.name)
            self.module._parameters[FLAT_PARAM] = self.flat_param
        if self.use_orig_params:
            for s in self.shared:
                s.param._cfsdp_flattened = True  # type: ignore[attr-defined]
            self._note_data()

    # ------------------------------------------------------- unshard/reshard
    def unshard(self, async_op: bool = False, full_precision: bool = False) -> None:
        """Make the full parameters available: issue the all-gather (sharded)
        or the low-precision copy (NO_SHARD with mixed precision).  A no-op if
        already unsharded or in flight; ``full_precision`` is for summon.  Writes to the
        original parameters are carried over first ([Note: writeback of original
        parameters]), as torch's ``pre_unshard``."""
        self.writeback_orig_params()
        super().unshard(async_op, full_precision=full_precision)

    def _start_unshard(self, full_precision: bool = False):
        low = self.uses_mp and not full_precision
        if not self.sharded:
            if low:
                alloc_storage(self.unsharded)
                scale_cast_add(self.unsharded, self.shard, 1.0, False)
                self._use_buf(self.unsharded)
            else:
                self._use_buf(self.shard)
            return None
        target = self.unsharded if (low or not self.uses_mp) else self.unsharded_full
        alloc_storage(target)
        src = self.shard
        if low:  # the all-gather input: the shard cast in one C pass
            src = torch.empty(self.layout.shard_numel, dtype=self.param_dtype, device=self.device)
            scale_cast_add(src, self.shard, 1.0, False)
        return comm.all_gather(target, src, self.group, async_op=True), target

    def _finish_unshard(self, buf: torch.Tensor) -> None:
        self._use_buf(buf)

    def _use_buf(self, buf: torch.Tensor) -> None:
        self._buf = buf
        self.flat_param.data = buf[: self.layout.flat_numel]

    def reshard(self) -> None:
        """Free the unsharded buffer and point every parameter back at the shard."""
        self.wait_unshard()
        if not self.sharded and not self.uses_mp:
            # NO_SHARD: the parameters stay where they are, but the modules show the
            # registered original parameters again, not the forward's views (as torch)
            self._unbind_views()
            return
        if self._buf is None:
            return
        self.flat_param.data = self.shard
        if self._buf is not self.shard:
            free_storage(self._buf)
        self._buf = None
        self._unbind_views()

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
                self.publish_unsharded_grad()
            else:
                self.orig_grads_as_shard_views()
        else:
            self._bind.show(self._bind.per_occurrence(views))

    def reshard_after_forward(self, for_backward: bool) -> None:
        """Post-forward reshard (the wrapper face frees everything); no_sync's unsharded
        gradient shows again (:meth:`_show_unsharded_grad`)."""
        self.reshard()
        self._show_unsharded_grad()

    def refresh_requires_grad(self) -> None:
        """With use_orig_params=True the flat parameter requires grad while any
        original parameter does (they may be frozen after wrapping, as torch)."""
        if self.use_orig_params:
            mask = changed_mask(self._orig_t, self._rg_mask)
            if mask is not None:
                self._rg_mask = mask
                self.requires_grad = any(mask)
                self.flat_param.requires_grad_(self.requires_grad)
        hook_flat_grad(self, self.requires_grad)

    def use_forward_views(self) -> None:
        """Bind each original parameter name to its view of ``flat_param``
        (through autograd, so gradients flow into the flat gradient), built once
        each step in one C pass: [Note: forward views].  Frozen parameters (use_orig_params=True)
        get detached views: no gradient is computed for them, so their part of the
        flat gradient stays zero."""
        _, views = split_views(self.flat_param, self._split_sizes, self._split_index, self._shapes,
                               self._rg_mask if self.use_orig_params else None, self._occ_index)
        if self._strided_occ:
            views = self._restride(views, self._strided_occ)
        if self._tp_occ:  # [Note: tensor-parallel wrapper units]
            views = tp_views(views, self._tp_occ)
        self._bind.show(views)
        if self.use_orig_params:  # registered too, as torch's: [Note: kept unsharded units]
            self._bind.register(views)
            self._views_bound = True

    def end_forward_views(self) -> None:
        """A unit that stays unsharded after forward or backward: the modules show the
        registered original parameters again, their data views of the shard, and no_sync's
        unsharded gradient on each (torch's ``_use_unsharded_grad_views``); the unsharded
        buffer stays as it is ([Note: kept unsharded units]).  With use_orig_params=False
        the views stay, as torch's."""
        self._unbind_views()
        self._show_unsharded_grad()

    def _unbind_views(self) -> None:
        """Unbind the forward's views (use_orig_params=True): the registered parameters show."""
        if self._views_bound:
            self._bind.unshow()
            self._bind.register(self._occ_params)
            self._views_bound = False

    def _show_unsharded_grad(self) -> None:
        """After a forward, a sharded unit holding no_sync's unsharded gradient shows it on
        every original parameter again, those the writeback showed as None included, as
        torch's post-forward reshard does."""
        if self._grads_hidden and self.sharded and self.grad_unsharded:
            self.publish_unsharded_grad()

    # ------------------------------------------------- summon / state dicts
    def params_as_full(self, buf: Optional[torch.Tensor] = None) -> None:
        """Expose full parameters as ``nn.Parameter`` s (unsharded first, in
        full precision).

        ``buf`` (summon's ``offload_to_cpu`` on a non-CPU device): a copy of
        the unsharded buffer the parameters view instead; the caller copies it
        back before :meth:`params_as_sharded`."""
        views = self._full_views(buf)
        if self.use_orig_params:
            self._unbind_views()
            self._shown_full = True
            for i, (info, v) in enumerate(zip(self.infos, views)):
                info.module.__dict__.pop(info.name, None)
                if info.tp_spec is None:
                    info.param.data = v
                    continue
                # a TP parameter shows as a DTensor over its full view; its gradient
                # (with_grads) goes on that parameter too
                dt = nn.Parameter(as_tp(v, info.tp_spec), requires_grad=info.param.requires_grad)
                self._shown_tp[i] = dt
                info.module._parameters[info.name] = dt
            for s in self.shared:
                s.module.__dict__.pop(s.name, None)
                if s.primary in self._shown_tp:
                    s.module._parameters[s.name] = self._shown_tp[s.primary]
        else:
            del self.module._parameters[FLAT_PARAM]
            params = []
            for info, v in zip(self.infos, self._as_seen(views)):
                p = nn.Parameter(v, requires_grad=info.param.requires_grad)
                params.append(p)
                info.module.__dict__.pop(info.name, None)
                info.module._parameters[info.name] = p
            for s in self.shared:
                s.module.__dict__.pop(s.name, None)
                s.module._parameters[s.name] = params[s.primary]

    def params_as_sharded(self, writeback: bool) -> None:
        """Undo :meth:`params_as_full`; copy full values back to the shard if asked
        (the unit may be sharded when :meth:`params_as_full` showed a copy)."""
        views = self._as_seen(self._full_views()) if self._buf is not None else self._idle_views
        writeback = writeback and self._buf is not None
        if writeback and self._buf is not self.shard:
            lo, hi = self.layout.shard_range(self.rank)
            self.shard.copy_(self._buf[lo:hi])
        if self.use_orig_params:
            for info, v in zip(self.infos, self.shard_views()):
                info.param.data = v
            if self._shown_tp:
                for info in [*self.infos, *self.shared]:
                    info.module._parameters[info.name] = info.param
                self._shown_tp = {}
            self._note_data()
            self._shown_full = False
        else:
            for info, v in zip(self.infos, views):
                del info.module._parameters[info.name]
                info.module.__dict__[info.name] = v
            for s in self.shared:
                del s.module._parameters[s.name]
                s.module.__dict__[s.name] = views[s.primary]
            self.module._parameters[FLAT_PARAM] = self.flat_param

    def gather_full_copy(self, scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A full-precision unsharded flat buffer (with padding), all-gathered from
        the shards into a new tensor (or into the front of ``scratch``, a 1-D buffer
        of this dtype and device that is large enough); the unit itself stays as it
        is.  A FULL state dict keeps it: its entries are views of it, so a unit
        costs one copy, not two.  Collective over the unit's group, unless the unit is kept
        unsharded in full precision: then a copy of that buffer, as torch's state dicts
        reuse it ([Note: kept unsharded units]).  Writes to the original parameters are
        carried over first, as torch's state dicts unshard ([Note: writeback of original
        parameters])."""
        self.writeback_orig_params()
        n = self.layout.padded_numel if self.sharded else self.layout.flat_numel
        out = torch.empty(n, dtype=self.dtype, device=self.device) if scratch is None else scratch[:n]
        if not self.sharded:
            out.copy_(self.shard.detach())
        elif self.holds_full_precision and self._unshard_work is None and self._buf is not self.shard:
            out.copy_(self._buf.detach())  # kept unsharded: the values it computes with
        else:
            comm.all_gather(out, self.shard.detach(), self.group, async_op=False)
        return out

    # ------------------------------------------- summon(with_grads=True)
    def unshard_grad(self) -> Optional[torch.Tensor]:
        """All-gather the sharded gradient (torch FSDP1's ``unshard_grad``).

        Collective: every rank of the unit calls it.  Returns the padded full
        gradient, or None when no rank has one; a rank without a gradient
        contributes zeros.  Unit must be idle (``flat_param.grad`` sharded)."""
        g = self.flat_param.grad
        if not self.sharded:  # NO_SHARD: the gradient is already full
            return g
        none = torch.tensor([int(g is None)], dtype=torch.int32, device=self.device)
        dist.all_reduce(none, group=self.group)
        if int(none.item()) == self.world_size:
            return None
        if g is None:
            g = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        full = torch.empty(self.layout.padded_numel, dtype=g.dtype, device=self.device)
        comm.all_gather(full, g.contiguous(), self.group, async_op=False)
        return full

    def grads_as_full(self, full: Optional[torch.Tensor]) -> None:
        """use_orig_params=True, after :meth:`params_as_full`: each original
        parameter's ``.grad`` is a view of ``full`` (None when ``full`` is)."""
        for i, (off, info) in enumerate(zip(self.layout.offsets, self.infos)):
            g = (None if full is None or not info.param.requires_grad
                 else info.view(full[off : off + info.numel]))
            shown = self._shown_tp.get(i)
            if shown is not None:  # a TP parameter shown as a DTensor: a DTensor gradient
                shown.grad = None if g is None else as_tp(g, info.tp_spec)
            else:
                info.param.grad = g

    def grads_as_sharded(self, full: Optional[torch.Tensor], writeback: bool) -> None:
        """Undo :meth:`grads_as_full` (call before :meth:`params_as_sharded`).

        With ``writeback``, this rank's unpadded part of ``full`` is copied
        into the existing sharded gradient (none is created, as torch)."""
        for info in self.infos:
            info.param.grad = None
        g = self.flat_param.grad
        if writeback and full is not None and g is not None and self.sharded:
            lo, hi = self.layout.shard_range(self.rank)
            hi = min(hi, self.layout.flat_numel)
            if hi > lo:
                g[: hi - lo].copy_(full[lo:hi])

    def orig_grads_as_shard_views(self) -> None:
        """use_orig_params=True: each original parameter's ``.grad`` is its
        part of the flat gradient: its slice of this rank's shard (None outside
        it), or its full-shape view with NO_SHARD; None for frozen parameters."""
        g = self.flat_param.grad
        if g is None:
            _core.attr_set(self._orig_t, "grad", None)
        elif g.dtype == self.dtype:  # one C pass (see [Note: bulk binding])
            _core.attr_set(self._orig_t, "grad", self._orig_grad_views(g))
        elif not self.sharded:  # keep_low_precision_grads: set_grad's dtype side-step
            for info, v in zip(self.infos, self._grad_views(g)):
                set_grad(info.param, v if info.param.requires_grad else None)
        else:
            for info, sl in zip(self.infos, self.layout.slices[self.rank]):
                if sl.numel == 0 or not info.param.requires_grad:
                    info.param.grad = None
                else:
                    set_grad(info.param, g[sl.shard_offset : sl.shard_offset + sl.numel])
        self._note_grads()

    def _orig_grad_views(self, g: torch.Tensor) -> tuple:
        """Each original parameter's gradient as a view of the flat gradient ``g``
        (its shard slice, or its full shape with NO_SHARD), None where it has no
        element on this rank or is frozen."""
        mask = self._rg_mask
        cached = self._grad_split
        if cached is None or cached[0] != mask:
            sizes, index, pos = [], [], 0
            if not self.sharded:
                sizes, index = list(self._split_sizes), list(self._split_index)
                shapes = self._shapes
            else:
                shapes = (None,) * len(self.infos)  # 1-D slices of the shard
                for sl in self.layout.slices[self.rank]:
                    if sl.numel == 0:
                        index.append(-1)
                        continue
                    if sl.shard_offset > pos:
                        sizes.append(sl.shard_offset - pos)
                    index.append(len(sizes))
                    sizes.append(sl.numel)
                    pos = sl.shard_offset + sl.numel
                if self.layout.shard_numel > pos:
                    sizes.append(self.layout.shard_numel - pos)
            index, shapes = views_or_none(index, shapes, mask, len(sizes))
            cached = self._grad_split = (mask, sizes, index, shapes)
        _, sizes, index, shapes = cached
        views = _core.shape_views((*torch.split(g, sizes), None), index, shapes, None,
                                  self._param_index)
        if self._strided_params and not self.sharded:
            views = self._restride(views, self._strided_params)
        return views

    def _restride(self, views: tuple, occurrences: tuple) -> tuple:
        """``views`` with each strided parameter's 1-D piece made its ``as_strided`` view
        ([Note: strided parameters]): ``occurrences`` pairs a parameter's index with the
        positions of its pieces in ``views`` (tied ones share one view object, as
        ``shape_views`` gives them); None stays None."""
        views = list(views)
        for i, ks in occurrences:
            v = views[ks[0]]
            if v is None:
                continue
            v = self.infos[i].view(v)
            for k in ks:
                views[k] = v
        return tuple(views)

    # --------------------------------------------------------------- grads
    def reduce_grad(self, grad: torch.Tensor) -> PendingReduce:
        """Pre-divide and issue the reduction of the unsharded flat gradient:
        a reduce-scatter (sharded) or an all-reduce (NO_SHARD).  ``finish``
        post-divides and folds the result into the unit's gradient."""
        lay = self.layout
        if grad.numel() != lay.flat_numel:
            raise AssertionError(
                f"unsharded grad has {grad.numel()} elements, expected {lay.flat_numel}"
            )
        if grad.dtype != self.reduce_dtype and not self.comm_hook_low_precision:
            grad = grad.to(self.reduce_dtype)  # torch casts before dividing
        if self.comm_hook is not None:
            return self._reduce_with_hook(grad)
        if not self.sharded:
            if self.pre_divide > 1:
                scale_cast_add(grad, grad, self.pre_divide, False)
            return PendingReduce(self, comm.all_reduce(grad, self.group, True), grad)
        if lay.flat_numel == lay.padded_numel and grad.is_contiguous():
            inp = grad
            if self.pre_divide > 1:
                scale_cast_add(inp, inp, self.pre_divide, False)
        else:
            inp = torch.empty(lay.padded_numel, dtype=grad.dtype, device=grad.device)
            scale_cast_add(inp[: lay.flat_numel], grad.contiguous(), self.pre_divide, False)
            inp[lay.flat_numel :].zero_()
        out = torch.empty(lay.shard_numel, dtype=grad.dtype, device=grad.device)
        return PendingReduce(self, comm.reduce_scatter(out, inp, self.group, True), out)

    def _reduce_with_hook(self, grad: torch.Tensor) -> PendingReduce:
        """The user's communication hook does the reduction (synchronously), as
        torch's FSDP1 calls it: ``hook(state, padded_grad, output)`` for sharded
        strategies, ``hook(state, grad)`` (in place) for NO_SHARD."""
        lay = self.layout
        if not self.sharded:
            self.comm_hook(self.comm_hook_state, grad)
            return PendingReduce(self, comm.Pending(None), grad, divided=True)
        if lay.flat_numel == lay.padded_numel:
            inp = grad.contiguous()
        else:
            inp = torch.zeros(lay.padded_numel, dtype=grad.dtype, device=grad.device)
            inp[: lay.flat_numel].copy_(grad)
        out_dtype = self.dtype if self.comm_hook_low_precision else grad.dtype
        out = torch.empty(lay.shard_numel, dtype=out_dtype, device=grad.device)
        self.comm_hook(self.comm_hook_state, inp, out)
        return PendingReduce(self, comm.Pending(None, inp), out, divided=True)

    def accumulate_reduced(self, out: torch.Tensor, divided: bool) -> None:
        """A finished reduction: NO_SHARD's all-reduced gradient is the gradient
        (post-divided, cast unless low-precision gradients are kept); a sharded
        one is folded into ``saved_grad`` (``base.accumulate_sharded``)."""
        if self.sharded:
            accumulate_sharded(self, out, divided)
            return
        if self.post_divide > 1 and not divided:
            scale_cast_add(out, out, self.post_divide, False)
        if out.dtype != self.dtype and not self.keep_low_precision_grads:
            out = out.to(self.dtype)
        set_grad(self.flat_param, out)

    def new_grad_buffer(self) -> torch.Tensor:
        """A buffer for a new sharded gradient (the parameters' dtype)."""
        return torch.empty(self.layout.shard_numel, dtype=self.dtype, device=self.device)

    def keep_unsharded_grad(self, grad: torch.Tensor) -> None:
        """no_sync(): keep the local unsharded gradient (accumulating) unreduced.  It may
        be of another dtype than the parameter's data (NO_SHARD with mixed precision: the
        reduced full-precision gradient of an earlier backward, to which autograd added
        this one, as torch's FSDP1 accumulates it)."""
        set_grad(self.flat_param, grad)
        self.grad_unsharded = True

    def take_grad_for_backward(self) -> None:
        """Before backward: move an existing *sharded* gradient aside so the
        new unsharded one can accumulate, and fold it back in ``finish``.  An
        unsharded gradient from no_sync() (or NO_SHARD's full gradient) stays
        in place and keeps accumulating."""
        g = self.flat_param.grad
        if g is None or self.grad_unsharded or not self.sharded:
            return
        if self.saved_grad is not None:
            raise AssertionError("cfsdp unit already holds a saved gradient")
        # accumulate in the parameters' dtype even if the optimizer was shown a
        # low-precision gradient (keep_low_precision_grads)
        self.saved_grad = g if g.dtype == self.dtype else g.to(self.dtype)
        self.flat_param.grad = None

    def publish_grad(self) -> None:
        """After a synchronising backward: expose the reduced gradient to the
        optimizer (sharded for sharded strategies, full for NO_SHARD)."""
        if self.saved_grad is not None:
            g = self.saved_grad
            if self.keep_low_precision_grads and g.dtype != self.param_dtype:
                g = g.to(self.param_dtype)
            set_grad(self.flat_param, g)
            self.saved_grad = None
        self.grad_unsharded = False
        if self.use_orig_params:
            self.orig_grads_as_shard_views()

    def _grad_views(self, g: Optional[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        if g is None:
            return [None] * len(self.infos)
        return [
            i.view(g[off : off + i.numel]) for off, i in zip(self.layout.offsets, self.infos)
        ]

    def publish_unsharded_grad(self) -> None:
        """After a no_sync() backward with use_orig_params=True: each original
        parameter's ``.grad`` is a full-shape view of the unsharded gradient
        (as torch does, although the parameter itself is sharded)."""
        if not self.use_orig_params:
            return
        for info, v in zip(self.infos, self._grad_views(self.flat_param.grad)):
            set_grad(info.param, v if info.param.requires_grad else None)
        self._note_grads()

    def before_forward(self) -> None:
        """Per-step bookkeeping of the original parameters (use_orig_params)."""
        if self.use_orig_params:
            self.refresh_requires_grad()
            self.drop_grad_if_orig_grads_cleared()

    def drop_grad_if_orig_grads_cleared(self) -> None:
        """With use_orig_params=True the optimizer sees the original parameters:
        when every one of their ``.grad`` was set to None (``zero_grad``), the
        flat gradient goes too."""
        if self.use_orig_params and self.flat_param.grad is not None:
            if all_none(_core.attr_get(self._orig_t, "grad")):
                self.flat_param.grad = None
                self.grad_unsharded = False
                self._note_grads()

    # --------------------------------------------- writes to the original parameters
    def _note_data(self) -> None:
        """Record where the original parameters' data are, as the unit set them
        ([Note: writeback of original parameters])."""
        self._idle_ptrs = tuple(map(torch.Tensor.data_ptr, self._orig_t))

    def _note_grads(self) -> None:
        """Record the gradient objects the unit set on the original parameters (all of
        their part of the flat gradient: none hidden)."""
        self._shown_grads = _core.attr_get(self._orig_t, "grad")
        self._grads_hidden = False

    def writeback_orig_params(self, grads_only: bool = False) -> bool:
        """Carry writes to the original parameters (``p.data = t``, ``p.grad = g``,
        ``p.grad = None``, a new registered parameter) over into the flat parameter and its
        gradient, as torch FSDP1's ``_writeback_orig_params``: [Note: writeback of original
        parameters].  ``grads_only``: the gradients alone (clip_grad_norm_).  Returns whether
        a parameter was written back.  A no-op without use_orig_params, while the modules
        show the forward's views or full parameters (summon, state dicts), or while its
        all-gather is in flight."""
        if not self.use_orig_params or self._skip_writeback:
            return False
        if self._unshard_work is not None or self._views_bound or self._shown_full:
            return False
        if (all(map(operator.is_, self._bind.registered_now(), self._occ_params))
                and all(map(operator.is_, _core.attr_get(self._orig_t, "grad"), self._shown_grads))
                and (grads_only or tuple(map(torch.Tensor.data_ptr, self._orig_t)) == self._idle_ptrs)):
            return False
        return self._writeback(grads_only)

    def _writeback(self, grads_only: bool) -> bool:
        """The per-parameter pass of :meth:`writeback_orig_params`, in torch's order."""
        fgrad = self.flat_param.grad
        full_grad = self.sharded and self.grad_unsharded  # no_sync's unsharded gradient
        wrote = adopted = False
        grad_none = [False] * len(self.infos)
        for i, (info, sl) in enumerate(zip(self.infos, self.layout.slices[self._lay_rank])):
            if sl.numel == 0 and not full_grad:
                continue  # no element on this rank: nothing to write (torch skips it too)
            param = info.param
            if not grads_only and sl.numel > 0:
                current = info.module._parameters.get(info.name)
                if current is None:
                    continue  # deregistered: nothing to write back, as torch
                new = current is not param
                if new:  # a new parameter object: it becomes the parameter
                    param = info.param = current
                    param._cfsdp_flattened = True  # type: ignore[attr-defined]
                    adopted = True
                if new or not _same_storage(param, self.shard):
                    self._write_param(info, sl, param)
                    wrote = True
            g = param.grad
            if g is None:
                if fgrad is not None:
                    self._grad_slot(i, sl, fgrad, full_grad).zero_()
                    grad_none[i] = True
            elif fgrad is None or not _same_storage(g, fgrad):
                if fgrad is None:
                    fgrad = self.flat_param.grad = torch.zeros_like(self.shard)
                self._write_grad(i, sl, g, fgrad, full_grad)
        if adopted:
            self._orig_t = tuple(i.param for i in self.infos)
            self._occ_params = self._bind.per_occurrence(self._orig_t)
            self._rg_mask = None
            self.refresh_requires_grad()
        if not grads_only:
            for info in self.infos:  # torch registers its own objects again (_use_sharded_views):
                # an adopted one, else the old one (where this rank holds no element of it)
                if info.module._parameters.get(info.name) is not info.param:
                    info.module._parameters[info.name] = info.param
            for s in self.shared:
                if s.module._parameters.get(s.name) is not self.infos[s.primary].param:
                    raise NotImplementedError(
                        "Changing shared parameters is not supported yet (cfsdp: "
                        f"{self._where}'s '{clean_tensor_name(s.fqn)}' is tied to "
                        f"'{clean_tensor_name(self.infos[s.primary].fqn)}' and no longer holds the "
                        "same parameter; assign the same object to both, or change the values "
                        "in place.)")
            for info, v in zip(self.infos, self.shard_views()):  # views of the shard again
                info.param.data = v
            self._note_data()
        if full_grad or (not self.sharded and self.grad_unsharded):
            self.publish_unsharded_grad()
        else:
            self.orig_grads_as_shard_views()
        if any(grad_none):  # None until the next backward gives them a gradient, as torch
            for info, none in zip(self.infos, grad_none):
                if none:
                    info.param.grad = None
            self._note_grads()
            self._grads_hidden = True
        return wrote

    def _shape_error(self, info: ParamInfo, what: str, want: torch.Size, got: torch.Size,
                     given: torch.Size, sl) -> WritebackError:
        held = (f"this rank's 1-D shard of its elements ({sl.numel})" if self.sharded
                else f"its full shape {tuple(info.shape)}")
        return WritebackError(
            f"Cannot writeback when the {what} shape changes\nExpects {want} but got {got} "
            f"(cfsdp: {self._where}'s parameter '{clean_tensor_name(info.fqn)}' was given a "
            f"{what} of shape {tuple(given)} after wrapping; with use_orig_params=True it is "
            f"{held} between steps: assign a tensor of that shape, change the values in place, "
            "or write full values inside summon_full_params.)")

    def _write_param(self, info: ParamInfo, sl, src: torch.Tensor) -> None:
        """Copy a parameter's new data ``src`` into its place in the shard."""
        src = src.detach()
        if self.sharded:
            want, flat = torch.Size([sl.numel]), src
        elif info.stride is None:  # NO_SHARD: any shape of as many elements (torch's view(-1))
            want, flat = torch.Size([info.numel]), src.reshape(-1)
        else:  # a strided parameter's elements in memory order: its own shape only
            if src.shape != info.shape:
                raise self._shape_error(info, "parameter", info.shape, src.shape, src.shape, sl)
            want, flat = torch.Size([info.numel]), info.flat(src)
        if flat.shape != want:
            raise self._shape_error(info, "parameter", want, flat.shape, src.shape, sl)
        self.shard[sl.shard_offset : sl.shard_offset + sl.numel].copy_(flat)

    def _grad_slot(self, i: int, sl, fgrad: torch.Tensor, full_grad: bool) -> torch.Tensor:
        """Parameter ``i``'s part of the flat gradient: its shard slice, or its whole
        range of no_sync's unsharded gradient."""
        if full_grad:
            off = self.layout.offsets[i]
            return fgrad[off : off + self.infos[i].numel]
        return fgrad[sl.shard_offset : sl.shard_offset + sl.numel]

    def _write_grad(self, i: int, sl, g: torch.Tensor, fgrad: torch.Tensor, full_grad: bool) -> None:
        """Copy a parameter's new gradient ``g`` into its part of the flat gradient."""
        info = self.infos[i]
        g = g.detach()
        if self.sharded and not full_grad:
            want, flat = torch.Size([sl.numel]), g
        elif info.stride is not None and g.shape == info.shape:
            want, flat = torch.Size([info.numel]), info.flat(g)
        else:
            want, flat = torch.Size([info.numel]), g.reshape(-1)
        if flat.shape != want:
            raise self._shape_error(info, "gradient", want, flat.shape, g.shape, sl)
        self._grad_slot(i, sl, fgrad, full_grad).copy_(flat)
