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
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _core
from .._state_dict import FLAT_PARAM, join_fqn
from . import comm
from .reduce import divide_factors, scale_cast_add

# torch's FSDP1 aligns every original parameter to 16 bytes in the flat
# buffer when use_orig_params=True (a TorchInductor requirement).
_ALIGN_BYTES = 16


class TrainingState(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()
    SUMMON = enum.auto()


@dataclass
class ParamInfo:
    """Where an original parameter lives: ``module.<name>``."""

    module: nn.Module
    name: str
    fqn: str  # relative to the unit's module, raw (wrapper prefixes kept)
    shape: torch.Size
    numel: int
    param: nn.Parameter  # the original parameter object
    primary: int = -1  # for a shared (tied) occurrence: index of the first one


class Unit:
    """One unit's layout, buffers, state and gradient reduction."""

    def __init__(
        self,
        module: nn.Module,
        params: list[nn.Parameter],
        group: dist.ProcessGroup,
        use_orig_params: bool,
        device: torch.device,
        name_for_errors: str,
    ):
        self.module = module
        self.group = group
        self.rank = group.rank()
        self.world_size = group.size()
        self.use_orig_params = use_orig_params
        self.device = device
        self.state = TrainingState.IDLE
        self.pre_divide, self.post_divide = divide_factors(self.world_size)
        self.infos, self.shared = self._collect(module, params)
        self._validate(name_for_errors)
        dtype = self.infos[0].param.dtype
        self.dtype = dtype
        self.requires_grad = any(i.param.requires_grad for i in self.infos)
        align = _ALIGN_BYTES // dtype.itemsize if use_orig_params else 0
        self.layout = _core.plan_layout([i.numel for i in self.infos], align, self.world_size)
        self._split_sizes, self._split_index = self._plan_splits()

        lay = self.layout
        self.shard = torch.empty(lay.shard_numel, dtype=dtype, device=device)
        _core.shard_fill(
            self.shard,
            self.rank * lay.shard_numel,
            [i.param.detach().contiguous() for i in self.infos],
            lay.offsets,
        )
        self.flat_param = nn.Parameter(self.shard, requires_grad=self.requires_grad)
        self.flat_param._cfsdp_flattened = True  # type: ignore[attr-defined]
        self.unsharded = torch.empty(lay.padded_numel, dtype=dtype, device=device)
        self.is_unsharded = False
        self._pending_unshard: Optional[comm.Pending] = None
        self.saved_grad: Optional[torch.Tensor] = None
        self._install_initial_views()
        self._free_unsharded()
        if self.requires_grad:
            self.flat_param.register_post_accumulate_grad_hook(self._on_grad_ready)
        # Set by the owning face: called with (unit, unsharded_grad) when the
        # flat gradient is ready in backward.
        self.post_backward_fn = None

    # ------------------------------------------------------------------ init
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
                info = ParamInfo(mod, name, join_fqn(mod_name, name), p.shape, p.numel(), p)
                if p in first:
                    info.primary = first[p]
                    shared.append(info)
                else:
                    first[p] = len(infos)
                    infos.append(info)
        return infos, shared

    def _validate(self, where: str) -> None:
        dtype = self.infos[0].param.dtype
        for i in self.infos:
            p = i.param
            if not (p.is_floating_point() or p.is_complex()):
                raise ValueError(
                    f"FSDP can only shard floating-point parameters, but {where}'s "
                    f"parameter '{i.fqn}' has dtype {p.dtype}. Register it as a buffer, "
                    "or pass its module in ignored_modules / the parameter in ignored_states."
                )
            if p.dim() == 0:
                raise ValueError(
                    f"FSDP does not shard scalar (0-dim) parameters, but {where}'s '{i.fqn}' "
                    "is one. Make it a 1-D tensor with one element, or pass it in ignored_states."
                )
            if p.dtype != dtype:
                raise ValueError(
                    f"All parameters of one FSDP unit must share a dtype: {where}'s "
                    f"'{self.infos[0].fqn}' is {dtype} but '{i.fqn}' is {p.dtype}. Cast the "
                    "module to one dtype before wrapping, or wrap these parameters in "
                    "separate units."
                )
            if p.device != self.device:
                raise ValueError(
                    f"{where}'s parameter '{i.fqn}' is on {p.device} but FSDP runs on "
                    f"{self.device}. Move the module to {self.device} before wrapping "
                    "(or pass the matching device_id)."
                )
        rgs = {i.param.requires_grad for i in self.infos}
        if len(rgs) > 1:
            frozen = next(i.fqn for i in self.infos if not i.param.requires_grad)
            if not self.use_orig_params:
                raise ValueError(
                    f"FSDP with use_orig_params=False needs uniform requires_grad within "
                    f"a unit, but {where}'s parameter '{frozen}' is frozen while others "
                    "are not. Wrap frozen and trainable parameters in separate units, or "
                    "use use_orig_params=True."
                )
            raise NotImplementedError(
                f"mixed requires_grad within one unit with use_orig_params=True "
                f"({where}'s parameter '{frozen}' is frozen) is not implemented yet in "
                "cfsdp; wrap frozen and trainable parameters in separate units."
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
        return sizes, index

    @property
    def flat_numel(self) -> int:
        return self.layout.flat_numel

    def _full_views(self, buf: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Views of ``unsharded`` (or of ``buf``, a copy of it) with the
        original shapes (no autograd)."""
        u = self.unsharded if buf is None else buf
        return [
            u[off : off + i.numel].view(i.shape)
            for off, i in zip(self.layout.offsets, self.infos)
        ]

    def shard_views(self) -> list[torch.Tensor]:
        """This rank's slice of each original parameter, as 1-D views of ``shard``."""
        out = []
        for sl in self.layout.slices[self.rank]:
            out.append(self.shard[sl.shard_offset : sl.shard_offset + sl.numel])
        return out

    def _install_initial_views(self) -> None:
        self._alloc_unsharded()
        views = self._full_views()
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
                info.param._cfsdp_stale_fqn = info.fqn  # type: ignore[attr-defined]
            for s in self.shared:
                del s.module._parameters[s.name]
                s.module.__dict__[s.name] = views[s.primary]
                s.param._cfsdp_stale_fqn = s.fqn  # type: ignore[attr-defined]
            self.module._parameters[FLAT_PARAM] = self.flat_param
        if self.use_orig_params:
            for s in self.shared:
                s.param._cfsdp_flattened = True  # type: ignore[attr-defined]

    # ------------------------------------------------------- unshard/reshard
    def _alloc_unsharded(self) -> None:
        st = self.unsharded.untyped_storage()
        want = self.layout.padded_numel * self.unsharded.element_size()
        if st.size() != want:
            st.resize_(want)

    def _free_unsharded(self) -> None:
        self.unsharded.untyped_storage().resize_(0)

    def unshard(self, async_op: bool = False) -> None:
        """Issue the all-gather of the unit (no-op if unsharded or in flight)."""
        if self.is_unsharded or self._pending_unshard is not None:
            if not async_op:
                self.wait_unshard()
            return
        self._alloc_unsharded()
        self._pending_unshard = comm.all_gather(
            self.unsharded, self.shard, self.group, async_op=True
        )
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self._pending_unshard is not None:
            self._pending_unshard.wait()
            self._pending_unshard = None
            self.is_unsharded = True
            self.flat_param.data = self.unsharded[: self.layout.flat_numel]

    def reshard(self) -> None:
        """Free the unsharded buffer and point every parameter back at the shard."""
        if self._pending_unshard is not None:
            self.wait_unshard()
        if not self.is_unsharded:
            return
        self.flat_param.data = self.shard
        self._free_unsharded()
        self.is_unsharded = False
        if self.use_orig_params:
            for info in self.infos:
                info.module.__dict__.pop(info.name, None)
            for s in self.shared:
                s.module.__dict__.pop(s.name, None)

    def use_forward_views(self) -> None:
        """Bind each original parameter name to a view of ``flat_param``
        (through autograd, so gradients flow into the flat gradient)."""
        chunks = torch.split(self.flat_param, self._split_sizes)
        views = [chunks[j].view(i.shape) for j, i in zip(self._split_index, self.infos)]
        for info, v in zip(self.infos, views):
            info.module.__dict__[info.name] = v
        for s in self.shared:
            s.module.__dict__[s.name] = views[s.primary]

    # ------------------------------------------------- summon / state dicts
    def params_as_full(self, buf: Optional[torch.Tensor] = None) -> None:
        """Expose full parameters as ``nn.Parameter`` s (unsharded first).

        ``buf`` (summon's ``offload_to_cpu`` on a non-CPU device): a copy of
        ``unsharded`` the parameters view instead; the caller copies it back
        before :meth:`params_as_sharded`."""
        views = self._full_views(buf)
        if self.use_orig_params:
            for info, v in zip(self.infos, views):
                info.module.__dict__.pop(info.name, None)
                info.param.data = v
            for s in self.shared:
                s.module.__dict__.pop(s.name, None)
        else:
            del self.module._parameters[FLAT_PARAM]
            params = []
            for info, v in zip(self.infos, views):
                p = nn.Parameter(v, requires_grad=info.param.requires_grad)
                params.append(p)
                info.module.__dict__.pop(info.name, None)
                info.module._parameters[info.name] = p
            for s in self.shared:
                s.module.__dict__.pop(s.name, None)
                s.module._parameters[s.name] = params[s.primary]

    def params_as_sharded(self, writeback: bool) -> None:
        """Undo :meth:`params_as_full`; copy full values back to the shard if asked."""
        if writeback:
            lo, hi = self.layout.shard_range(self.rank)
            self.shard.copy_(self.unsharded[lo:hi])
        views = self._full_views()
        if self.use_orig_params:
            for info, v in zip(self.infos, self.shard_views()):
                info.param.data = v
        else:
            for info, v in zip(self.infos, views):
                del info.module._parameters[info.name]
                info.module.__dict__[info.name] = v
            for s in self.shared:
                del s.module._parameters[s.name]
                s.module.__dict__[s.name] = views[s.primary]
            self.module._parameters[FLAT_PARAM] = self.flat_param

    # ------------------------------------------- summon(with_grads=True)
    def unshard_grad(self) -> Optional[torch.Tensor]:
        """All-gather the sharded gradient (torch FSDP1's ``unshard_grad``).

        Collective: every rank of the unit calls it.  Returns the padded full
        gradient, or None when no rank has one; a rank without a gradient
        contributes zeros.  Unit must be idle (``flat_param.grad`` sharded)."""
        g = self.flat_param.grad
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
        for off, info in zip(self.layout.offsets, self.infos):
            info.param.grad = (
                None
                if full is None or not info.param.requires_grad
                else full[off : off + info.numel].view(info.shape)
            )

    def grads_as_sharded(self, full: Optional[torch.Tensor], writeback: bool) -> None:
        """Undo :meth:`grads_as_full` (call before :meth:`params_as_sharded`).

        With ``writeback``, this rank's unpadded part of ``full`` is copied
        into the existing sharded gradient (none is created, as torch)."""
        for info in self.infos:
            info.param.grad = None
        g = self.flat_param.grad
        if writeback and full is not None and g is not None:
            lo, hi = self.layout.shard_range(self.rank)
            hi = min(hi, self.layout.flat_numel)
            if hi > lo:
                g[: hi - lo].copy_(full[lo:hi])

    def orig_grads_as_shard_views(self) -> None:
        """use_orig_params=True: each original parameter's ``.grad`` is its
        slice of the sharded flat gradient (None outside this rank's shard)."""
        g = self.flat_param.grad
        for info, sl in zip(self.infos, self.layout.slices[self.rank]):
            if g is None or sl.numel == 0 or not info.param.requires_grad:
                info.param.grad = None
            else:
                info.param.grad = g[sl.shard_offset : sl.shard_offset + sl.numel]

    # --------------------------------------------------------------- grads
    def _on_grad_ready(self, flat_param: torch.Tensor) -> None:
        grad = flat_param.grad
        flat_param.grad = None
        if self.post_backward_fn is None:
            raise AssertionError("cfsdp unit has no post-backward handler")
        self.post_backward_fn(self, grad)

    def reduce_grad(self, grad: torch.Tensor) -> "PendingReduce":
        """Pre-divide, pad and issue the reduce-scatter of the unsharded flat
        gradient; the result is folded into ``saved_grad`` by ``finish``."""
        lay = self.layout
        if grad.numel() != lay.flat_numel:
            raise AssertionError(
                f"unsharded grad has {grad.numel()} elements, expected {lay.flat_numel}"
            )
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

    def take_grad_for_backward(self) -> None:
        """Before backward: move an existing sharded gradient aside so the
        new unsharded one can accumulate, and fold it back in ``finish``."""
        g = self.flat_param.grad
        if g is not None:
            if self.saved_grad is not None:
                raise AssertionError("cfsdp unit already holds a saved gradient")
            self.saved_grad = g
            self.flat_param.grad = None

    def publish_grad(self) -> None:
        """After backward: expose the sharded gradient to the optimizer."""
        if self.saved_grad is not None:
            self.flat_param.grad = self.saved_grad
            self.saved_grad = None
        if self.use_orig_params:
            g = self.flat_param.grad
            for info, sl in zip(self.infos, self.layout.slices[self.rank]):
                if g is None or sl.numel == 0 or not info.param.requires_grad:
                    info.param.grad = None
                else:
                    info.param.grad = g[sl.shard_offset : sl.shard_offset + sl.numel]

    def drop_grad_if_orig_grads_cleared(self) -> None:
        """With use_orig_params=True the optimizer sees the original parameters:
        when every one of their ``.grad`` was set to None (``zero_grad``), the
        flat gradient goes too."""
        if self.use_orig_params and self.flat_param.grad is not None:
            if all(i.param.grad is None for i in self.infos):
                self.flat_param.grad = None


class PendingReduce:
    """A reduce-scatter in flight; ``finish`` post-divides and accumulates."""

    __slots__ = ("unit", "pending", "out")

    def __init__(self, unit: Unit, pending: comm.Pending, out: torch.Tensor):
        self.unit = unit
        self.pending = pending
        self.out = out

    def finish(self) -> None:
        self.pending.wait()
        u = self.unit
        out = self.out.to(u.dtype) if self.out.dtype != u.dtype else self.out
        if u.saved_grad is None:
            if u.post_divide > 1:
                scale_cast_add(out, out, u.post_divide, False)
            u.saved_grad = out
        else:
            scale_cast_add(u.saved_grad, out, u.post_divide if u.post_divide > 1 else 1.0, True)
