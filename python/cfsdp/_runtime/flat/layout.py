"""A wrapper unit's layout (``unit.Unit``, torch FSDP1's flat parameter): which original
parameters it flattens, in which order and where (:class:`ParamInfo`), torch FSDP1's checks of
them (:func:`scalar_param_message`, :func:`flatten_error`, ``FlatLayout._validate``), the
layout the C planner computes, the unit's buffers and the binding plan the other parts of the
unit use (``FlatLayout``: the occurrences of [Note: bulk binding], the split that makes the
forward views, the per-parameter views of a buffer).

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ... import _core
from ..._fqn import full_name, join_fqn
from ..views import Bindings, TPOccurrence, as_tp

# torch's FSDP1 aligns every original parameter to 16 bytes in the flat
# buffer when use_orig_params=True (a TorchInductor requirement).
ALIGN_BYTES = 16
ALIGN_PAD_VALUE = 42  # what torch's FSDP1 writes into those gaps


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


class FlatLayout:
    """A unit's parameters (``infos``, tied occurrences in ``shared``), its layout and buffers
    ([Note: unit buffers]), and the binding plan: the tables of [Note: bulk binding] and the
    split of the flat parameter that :class:`~.lifecycle.FlatLifecycle` and
    :class:`~.grads.FlatGrads` make their views with.  A part of ``unit.Unit``, whose
    ``__init__`` sets the state it reads."""

    def _init_binding(self) -> None:
        """The tuples of [Note: bulk binding]: every occurrence of an original
        parameter (tied ones have several), its module's ``__dict__``, its name."""
        self._bind = Bindings([(i, info.module, info.name) for i, info in enumerate(self.infos)]
                              + [(s.primary, s.module, s.name) for s in self.shared])
        self._occ_index = self._bind.index
        self._orig_t = tuple(i.param for i in self.infos)
        # [Note: writeback of original parameters]: the object each occurrence's registered
        # parameters should hold (what the unit last set: FlatWriteback._init_writeback)
        self._occ_params = self._bind.per_occurrence(self._orig_t)
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
        with ``ALIGN_PAD_VALUE``; they only show in LOCAL state dicts, which must
        match torch's bit for bit."""
        lay = self.layout
        lo, hi = self._lay_rank * lay.shard_numel, (self._lay_rank + 1) * lay.shard_numel
        ends = [off + n for off, n in zip(lay.offsets, lay.numels)]
        for gap_lo, gap_hi in zip(ends, [*lay.offsets[1:], lay.flat_numel]):
            a, b = max(gap_lo, lo), min(gap_hi, hi)
            if a < b:
                self.shard[a - lo : b - lo].fill_(ALIGN_PAD_VALUE)

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
