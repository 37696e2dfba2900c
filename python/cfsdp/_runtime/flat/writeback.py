"""Writes to a wrapper unit's original parameters carried into the flat parameter
(``use_orig_params=True``), as torch FSDP1's ``FlatParamHandle._writeback_orig_params`` does:
[Note: writeback of original parameters] below; :class:`WritebackError` for a write that
cannot be carried over; torch's switch that turns the check off
(``FSDP_SKIP_WRITEBACK_CHECK=1``, read when the unit is built).  A part of ``unit.Unit``.
"""

from __future__ import annotations

import logging
import operator
import os

import torch

from ... import _core
from ..._fqn import clean_tensor_name
from .layout import ParamInfo

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

_SKIP_WRITEBACK_ENV = "FSDP_SKIP_WRITEBACK_CHECK"  # torch's switch (_flat_param.py)
_log = logging.getLogger(__name__)


def writeback_check_skipped(use_orig_params: bool) -> bool:
    """Whether torch's ``FSDP_SKIP_WRITEBACK_CHECK=1`` turns the writeback check off for a
    unit (read when it is built, as torch reads it; logged with torch's warning)."""
    skip = use_orig_params and os.environ.get(_SKIP_WRITEBACK_ENV, "") == "1"
    if skip:
        _log.warning("Since %s=1, FSDP will not check for parameter or gradient writeback. "
                     "Changing parameter or gradient storages may lead to silent correctness "
                     "errors.", _SKIP_WRITEBACK_ENV)
    return skip


class WritebackError(RuntimeError):
    """A write to an original parameter (or its gradient) after wrapping that cannot be
    carried over into the flat parameter ([Note: writeback of original parameters]).
    torch's FSDP1 raises ``RuntimeError`` there, so this is one (and a ``ValueError``:
    bad user input)."""


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch FSDP1's test of whether ``a`` still lives in ``b``'s memory."""
    return _core.storage_address(a) == _core.storage_address(b)


class FlatWriteback:
    """[Note: writeback of original parameters]: what the unit last set as the original
    parameters' data and gradients, and the pass that carries the user's writes over.  A part
    of ``unit.Unit``."""

    def _init_writeback(self) -> None:
        """Nothing set yet: the records of what the unit shows on the original parameters."""
        self._idle_ptrs: tuple = ()
        self._shown_grads: tuple = (None,) * len(self.infos)
        self._grads_hidden = False  # the writeback showed a gradient set to None as None

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
                    param._cfsdp_unit = self.flat_param._cfsdp_unit  # type: ignore[attr-defined]
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
            self.show_unsharded_grad()
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
