"""What the modules show of a unit's parameters: the per-parameter presentation both
unit kinds share.

A unit (``flat.unit.Unit``, the wrapper's flat layout; ``chunk.unit.ChunkUnit``,
``fully_shard``'s per-parameter chunks) owns a buffer engine: the layout, the shard,
unshard/reshard and the gradient reduction.  What the modules and the user see of
its parameters is this module's, the same for both kinds:

* the binding table (:class:`Bindings`, [Note: bulk binding]): every *occurrence* of
  every parameter (tied/shared parameters have several), its module's ``__dict__`` and
  ``_parameters``, its name; each pass that rebinds the names (forward views, the
  registered full or sharded parameters) is one call into the C core;
* the forward views ([Note: forward views]): made afresh every step from one
  ``torch.split`` of the flat parameter (:func:`split_views`), frozen parameters
  getting detached views;
* the requires_grad refresh (:func:`changed_mask`, :func:`hook_flat_grad`): one C read
  of the parameters' flags per step, the per-parameter work only when they changed, and
  the flat parameter's gradient hook registered once it first requires grad;
* the tensor-parallel view path: a TP parameter's views shown as DTensors on its TP
  mesh (:func:`as_dtensor`, :func:`tp_views` with :class:`TPView`), their specs built
  once per (mesh, placements, shape, stride, dtype) in ONE cache (:func:`dtensor_spec`).

What really differs between torch's two faces is a parameter of the shared code, not a
second copy: a TP view's backward (:class:`TPView`) either redistributes every
gradient to the parameter's placements at once (``sink`` None: torch FSDP1's
``DTensor.from_local``, as the wrapper face and ``pre_dp_module_transform`` show TP
parameters) or, FSDP2's way, leaves a partial sum as it is and notes it on the unit
(:class:`GradSink`), which redistributes the accumulated sum once before reducing.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor

from .. import _core
from .._torch.dtensor import DTensorSpec, TensorMeta, redistribute_local_tensor
from .base import hook_grad_ready

# [Note: bulk binding]
# Every step a unit rebinds its parameters' names several times: to forward views
# (pre-forward, pre-backward), to the registered full or sharded parameters
# (unshard, reshard), and publishes their gradients.  A unit builds the tuples
# involved once (:class:`Bindings`: each occurrence's module ``__dict__`` /
# ``_parameters``, its name; the objects to bind) and each pass is one call into the
# C core (``_core.dict_set`` / ``dict_pop`` / ``attr_set`` / ``attr_get`` /
# ``attr_flags``): no hook on the hot path runs Python per parameter.  Per-parameter
# Python is left to what happens rarely: the first step, a change of requires_grad, a
# new buffer.
#
# [Note: forward views]
# The views of the flat parameter that forward uses are made afresh every step
# (one ``torch.split`` and one ``_core.shape_views`` call, :func:`split_views`), on
# purpose.  Views kept from an earlier step can be differentiated through again (split
# and view save no tensors), but autograd's engine runs ready nodes in reverse order of
# creation: the old split/view nodes would run after every node of the current step, so
# each unit's flat gradient, and with it its reduce-scatter, would wait for the rest of
# backward (measured: the collective order changed against torch's, one reduce-scatter
# behind the next all-gather).  Made in this step's pre-forward, they run right after
# the unit's own backward, as torch's FSDP1 and FSDP2 views do.


class Bindings:
    """The binding table of [Note: bulk binding]: occurrence ``k`` is parameter
    ``index[k]`` shown as attribute ``keys[k]`` of a module whose ``__dict__`` is
    ``attrs[k]`` and whose ``_parameters`` is ``registered[k]``."""

    __slots__ = ("index", "attrs", "registered", "keys")

    def __init__(self, occurrences: list) -> None:
        """``occurrences``: ``(parameter index, module, name)`` per occurrence."""
        self.index = tuple(i for i, _, _ in occurrences)
        self.attrs = tuple(mod.__dict__ for _, mod, _ in occurrences)
        self.registered = tuple(mod._parameters for _, mod, _ in occurrences)
        self.keys = tuple(name for _, _, name in occurrences)

    def per_occurrence(self, per_param) -> tuple:
        """A per-parameter sequence spread over the occurrences."""
        return tuple(per_param[i] for i in self.index)

    def show(self, per_occ: tuple) -> None:
        """Bind every occurrence's attribute (the module's ``__dict__``, which shadows
        its registered parameter) to ``per_occ``."""
        _core.dict_set(self.attrs, self.keys, per_occ)

    def unshow(self) -> None:
        """Drop the attributes :meth:`show` bound: the registered parameters show."""
        _core.dict_pop(self.attrs, self.keys)

    def register(self, per_occ: tuple) -> None:
        """Register ``per_occ`` as every occurrence's parameter (``_parameters``)."""
        _core.dict_set(self.registered, self.keys, per_occ)

    def registered_now(self) -> tuple:
        """What every occurrence's ``_parameters`` holds now (None where nothing)."""
        return tuple(map(dict.get, self.registered, self.keys))


def split_views(flat: torch.Tensor, sizes, index: tuple, shapes: tuple, mask: Optional[bytes],
                occ_index: tuple) -> tuple[tuple, tuple]:
    """``(pieces, views)``: one ``torch.split`` of ``flat`` into ``sizes``, and one view per
    occurrence (piece ``index[occ_index[k]]`` with shape ``shapes[...]``, None for 1-D),
    made in one C pass; a parameter that ``mask`` (requires_grad flags, or None: all)
    marks frozen gets a detached view ([Note: forward views])."""
    pieces = torch.split(flat, sizes)
    return pieces, _core.shape_views(pieces, index, shapes, mask, occ_index)


def changed_mask(params: tuple, last: Optional[bytes]) -> Optional[bytes]:
    """The parameters' requires_grad flags (one C read) when they differ from ``last``,
    else None: the caller's per-parameter work runs only when the user froze or
    unfroze a parameter."""
    mask = _core.attr_flags(params, "requires_grad")
    return None if mask == last else mask


def hook_flat_grad(unit: Any, requires_grad: bool) -> None:
    """Once ``unit.flat_param`` first requires grad, register its gradient-ready hook
    (:func:`~.base.hook_grad_ready`), once per flat parameter (``unit._hooked``)."""
    if requires_grad and not unit._hooked:
        hook_grad_ready(unit)
        unit._hooked = True


# ---------------------------------------------------------------------------
# tensor-parallel views
# ---------------------------------------------------------------------------

# DTensorSpecs by mesh, then (placements, shape, stride, dtype): the parameters of
# repeated blocks share them (a spec is immutable; torch shares specs between
# DTensors too), so a unit builds one per distinct parameter and dtype, not one per
# parameter, view or step.  The one cache of both unit kinds.
_SPECS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def dtensor_spec(mesh, placements: tuple, shape, stride: tuple, dtype: torch.dtype) -> DTensorSpec:
    """The (cached) spec of a DTensor on ``mesh`` with ``placements``, global ``shape``
    and ``stride``, of ``dtype``."""
    per_mesh = _SPECS.setdefault(mesh, {})
    key = (placements, tuple(shape), tuple(stride), dtype)
    spec = per_mesh.get(key)
    if spec is None:
        spec = per_mesh[key] = DTensorSpec(mesh, placements,
                                           tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))
    return spec


def as_dtensor(local: torch.Tensor, mesh, placements: tuple, shape, stride: tuple) -> DTensor:
    """``local`` as a DTensor on ``mesh`` (global ``shape``/``stride``, ``local``'s dtype):
    no autograd edge, no communication.  The spec comes from the cache and the DTensor is
    constructed directly: ``DTensor.from_local`` goes through an autograd Function and
    rebuilds the spec on every call, which dominated publishing small units' gradients."""
    return DTensor(local, dtensor_spec(mesh, placements, shape, stride, local.dtype),
                   requires_grad=False)


def as_tp(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """``local`` (a TP parameter's local tensor or a view with its shape) as a DTensor with
    the parameter's ``spec``'s mesh, placements, shape and stride, in ``local``'s dtype."""
    return as_dtensor(local, spec.mesh, spec.placements, spec.shape, spec.stride)


class GradSink:
    """Where a :class:`TPView`'s backward notes a gradient it leaves in other placements
    than the parameter's (the FSDP2 face, [Note: tensor-parallel parameters] in
    chunk/param.py): ``grad_placements(arrived)`` gives the placements the gradient
    should have; ``unit_ref()`` the unit (held weakly: the sink lives on autograd nodes),
    whose ``note_partial(qi, spec)`` records parameter ``qi``'s."""

    __slots__ = ("grad_placements", "unit_ref", "qi")

    def __init__(self, grad_placements: Callable[[tuple], tuple], unit_ref, qi: int) -> None:
        self.grad_placements = grad_placements
        self.unit_ref = unit_ref
        self.qi = qi


class TPView(torch.autograd.Function):
    """A TP parameter's forward view as the module sees it: ``DTensor.from_local(view, mesh,
    placements, run_check=False, shape=, stride=)`` with the spec built once (``spec``, in
    the view's dtype).  ``from_local`` rebuilds the spec and checks its arguments on every
    call: most of the host time per TP parameter.

    Backward hands the gradient's local tensor to the view.  ``sink`` None (torch FSDP1's
    ``from_local``, for ``Shard`` and ``Replicate`` placements): a gradient arriving in
    other placements (e.g. a partial sum) is redistributed to ``spec``'s at once.  With a
    :class:`GradSink` (torch FSDP2): the gradient should have ``sink.grad_placements``'s
    placements; a partial sum over TP ranks where those are ``Replicate`` is left as it is
    and noted on the unit (it accumulates as a partial sum and is redistributed once before
    the reduction, as torch's FSDP2 does), and any placement other than the parameter's is
    noted."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, sink: Optional[GradSink]):  # type: ignore[override]
        ctx.spec = spec
        ctx.sink = sink
        ctx.set_materialize_grads(False)
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad: Optional[DTensor]):  # type: ignore[override]
        if grad is None:
            return None, None, None
        spec, sink = ctx.spec, ctx.sink
        if sink is None:
            if grad.placements == spec.placements:
                return grad._local_tensor, None, None
            target = DTensorSpec(spec.mesh, spec.placements, tensor_meta=grad._spec.tensor_meta)
            return redistribute_local_tensor(grad._local_tensor, grad._spec, target), None, None
        want = sink.grad_placements(grad.placements)
        unit = sink.unit_ref()
        if grad.placements == want:
            if want != spec.placements and unit is not None:
                unit.note_partial(sink.qi, grad._spec)
            return grad._local_tensor, None, None
        if unit is not None and all(
                g == w or (g.is_partial() and getattr(g, "reduce_op", "sum") == "sum"
                           and w.is_replicate()) for g, w in zip(grad.placements, want)):
            unit.note_partial(sink.qi, grad._spec)
            return grad._local_tensor, None, None
        target = DTensorSpec(spec.mesh, want, tensor_meta=grad._spec.tensor_meta)
        if want != spec.placements and unit is not None:
            unit.note_partial(sink.qi, target)
        return redistribute_local_tensor(grad._local_tensor, grad._spec, target), None, None


def from_local(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """``DTensor.from_local`` over ``local`` with ``spec`` (in ``local``'s dtype), torch
    FSDP1's way (:class:`TPView` without a sink)."""
    return TPView.apply(local, spec, None)


class TPOccurrence:
    """One occurrence of a TP parameter in a :class:`Bindings` table: its position ``k``,
    the TP mesh, placements and global shape and stride its views show, and its
    :class:`GradSink` (None: FSDP1's backward)."""

    __slots__ = ("k", "mesh", "placements", "shape", "stride", "sink")

    def __init__(self, k: int, mesh, placements: tuple, shape, stride: tuple,
                 sink: Optional[GradSink] = None) -> None:
        self.k, self.mesh, self.placements = k, mesh, placements
        self.shape, self.stride, self.sink = shape, tuple(stride), sink


def tp_views(views: tuple, tp_occ: tuple) -> tuple:
    """``views`` (one per occurrence) with each TP occurrence's view a DTensor on its TP
    mesh: through :class:`TPView` when it requires grad, else a plain DTensor over it."""
    views = list(views)
    for o in tp_occ:
        v = views[o.k]
        if v.requires_grad:
            views[o.k] = TPView.apply(v, dtensor_spec(o.mesh, o.placements, o.shape, o.stride, v.dtype),
                                      o.sink)
        else:
            views[o.k] = as_dtensor(v, o.mesh, o.placements, o.shape, o.stride)
    return tuple(views)


__all__ = [
    "Bindings", "split_views", "changed_mask", "hook_flat_grad", "dtensor_spec", "as_dtensor",
    "as_tp", "GradSink", "TPView", "from_local", "TPOccurrence", "tp_views",
]
