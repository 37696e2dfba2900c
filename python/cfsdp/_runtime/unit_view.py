"""What the state-dict layer may read of a wrapper's unit: [Note: unit view].

[Note: unit view]
``_state_dict.py`` and ``_optim_state_dict.py`` turn a wrapper's unit into torch's state-dict
formats and back.  They see the unit only through :class:`UnitView` (and its parameters only
through :class:`ParamView`), which exposes exactly the reads and calls listed below, each
with its meaning, and nothing else: the views have ``__slots__`` and no ``__getattr__``, so a
read of anything not declared here is an ``AttributeError`` wherever it runs, and
``tests/unit/test_unit_view.py`` checks the two modules' source (no unit module imported, no
raw unit fetched, no undeclared name read) and that every declared name reads the unit's own
value.  The engine behind a unit (``Unit``'s fields, its buffers, its move between files) can
thus change freely as long as these names keep their meaning; a state-dict feature that needs
more adds it here, with its one line.

The views forward every read to the live unit: a state-dict call sees the unit as it is at
that moment, exactly as a direct read would.  The one thing kept is the tuple of parameter
views, made at the first read of ``infos`` / ``shared`` (a unit's parameter lists are fixed
when it is built; each view still reads its parameter's fields live).  Views are made where
the state-dict code fetches a unit (``unit_of``): per hook call in ``_state_dict.py``, one per
unit per call in ``_optim_state_dict.py``; state dicts are not per-step hot paths.

The layout a view gives is the unit's ``cfsdp._core.Layout`` (a value of the bottom layer,
read-only): offsets, flat / shard / padded sizes, per-rank shard slices, ``shard_range``.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Optional

import torch

__all__ = ["ParamView", "UnitView", "unit_of"]


def _read(path: str, doc: str) -> property:
    """A declared read: the live value at ``path`` (``"_unit.rank"``), documented by ``doc``."""
    return property(attrgetter(path), doc=doc)


class ParamView:
    """One original parameter of a unit (or a tied occurrence of one), as state dicts read it."""

    __slots__ = ("_info",)

    def __init__(self, info: Any):
        self._info = info

    fqn = _read("_info.fqn", "Its name relative to the unit's module, raw (wrapper prefixes kept).")
    param = _read("_info.param",
                  "The original parameter object (a tensor-parallel one's local one).")
    shape = _read("_info.shape",
                  "Its shape in the flat layout (a tensor-parallel one's local shape).")
    numel = _read("_info.numel", "Its number of elements in the flat layout.")
    global_shape = _read("_info.global_shape",
                         "The shape modules and state dicts see (a TP one's DTensor's).")
    tp_spec = _read("_info.tp_spec",
                    "A tensor-parallel parameter's DTensorSpec (TP mesh, placements); else None.")

    def view(self, piece: torch.Tensor) -> torch.Tensor:
        """``piece`` (its ``numel`` flat elements) with its shape and stride."""
        return self._info.view(piece)

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a tensor of its shape) as its ``numel`` flat elements in layout order."""
        return self._info.flat(t)


class UnitView:
    """A wrapper's unit (FSDP1's flat layout) as the state-dict layer reads and drives it."""

    __slots__ = ("_unit", "_infos", "_shared")

    def __init__(self, unit: Any):
        self._unit = unit
        self._infos: Optional[tuple[ParamView, ...]] = None
        self._shared: Optional[tuple[ParamView, ...]] = None

    # what it holds
    module = _read("_unit.module",
                   "The module the unit was built on; parameter FQNs are relative to it.")

    @property
    def infos(self) -> tuple[ParamView, ...]:
        """Its original parameters, in layout order (first occurrences only)."""
        if self._infos is None:
            self._infos = tuple(ParamView(i) for i in self._unit.infos)
        return self._infos

    @property
    def shared(self) -> tuple[ParamView, ...]:
        """The tied occurrences after the first of a parameter (each with its own FQN)."""
        if self._shared is None:
            self._shared = tuple(ParamView(i) for i in self._unit.shared)
        return self._shared

    layout = _read("_unit.layout", "The flat layout (cfsdp._core.Layout), a read-only value.")
    shard = _read("_unit.shard",
                  "This rank's 1-D shard (padded; NO_SHARD: the whole unpadded flat parameter).")
    flat_param = _read("_unit.flat_param",
                       "The flat parameter the optimizer holds with use_orig_params=False.")
    dtype = _read("_unit.dtype",
                  "The dtype of the shard, the parameters and their optimizer states.")
    device = _read("_unit.device", "The device of the shard and of what state dicts gather.")
    use_orig_params = _read("_unit.use_orig_params", "Whether the optimizer and the modules hold "
                            "the original parameters (else the flat one).")
    # its ranks
    sharded = _read("_unit.sharded", "False for NO_SHARD (every rank holds every element).")
    group = _read("_unit.group",
                  "The process group the unit is sharded over (HSDP: the shard group).")
    rank = _read("_unit.rank", "This rank in group.")
    world_size = _read("_unit.world_size", "The size of group.")
    replicate_group = _read("_unit.replicate_group",
                            "HSDP's group across replicas; None without one.")
    # its state
    is_unsharded = _read("_unit.is_unsharded", "Whether the unit holds its unsharded buffer now.")
    holds_full_precision = _read("_unit.holds_full_precision", "Unsharded in the parameters' "
                                 "own dtype (not a mixed-precision compute copy)?")

    def full_storage_ptr(self) -> int:
        """The storage address of the unsharded buffer the full parameters view."""
        return self._unit.full_storage_ptr()

    # what it does
    def unshard(self, full_precision: bool = False) -> None:
        """All-gather the unsharded buffer (in the parameters' dtype if ``full_precision``)."""
        self._unit.unshard(full_precision=full_precision)

    def reshard(self) -> None:
        """Free the unsharded buffer; the parameters view the shard again."""
        self._unit.reshard()

    def gather_full_copy(self, scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A new full-precision unsharded flat buffer (or the front of ``scratch``); collective."""
        return self._unit.gather_full_copy(scratch)

    def params_as_full(self, buf: Optional[torch.Tensor] = None) -> None:
        """Show full parameters on the modules (views of the unsharded buffer, or of ``buf``)."""
        self._unit.params_as_full(buf)

    def params_as_sharded(self, writeback: bool) -> None:
        """Undo ``params_as_full``, writing this rank's part of the full values back if asked."""
        self._unit.params_as_sharded(writeback)

    def drop_grad_if_orig_grads_cleared(self) -> None:
        """``use_orig_params``: drop the flat gradient when every original ``.grad`` is None."""
        self._unit.drop_grad_if_orig_grads_cleared()


def unit_of(state: Any) -> Optional[UnitView]:
    """The unit of a wrapper's ``UnitState`` (``w._state``) as a :class:`UnitView`; None for a
    wrapper without one (no parameters of its own)."""
    unit = state.unit
    return None if unit is None else UnitView(unit)
