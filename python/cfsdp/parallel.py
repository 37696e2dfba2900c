"""Tensor-parallel / data-parallel composability for DDP: ``pre_dp_module_transform``.

torch's ``torch.distributed.tensor.parallel.ddp._pre_dp_module_transform(module)`` (which
``DistributedDataParallel(module, device_mesh=...)`` calls itself) lets DDP train a module whose
parameters tensor parallelism made DTensors: DDP must see plain parameters, so it replaces
each DTensor parameter by a plain one holding its local tensor, and around every forward
turns them back into DTensors and then into plain ones again.  Its forward pre-hook deletes the
parameters and sets the DTensors as plain attributes, so from the first forward on
``named_parameters()`` and ``state_dict()`` of the model are empty (pytorch issue 152712).

``cfsdp.pre_dp_module_transform(module)`` has the same contract (call it after
``parallelize_module`` and before wrapping with DDP; DDP then all-reduces the local gradients),
without that bug:

* ``transform``: each DTensor parameter ``p`` is registered as a plain ``nn.Parameter``
  ``local`` holding ``p``'s local tensor (the same memory), so the DDP built next sees and
  hooks plain parameters, as with torch's;
* every forward binds, for each of them, ``DTensor.from_local(local, ...)`` on the parameter's
  mesh and placements as the module's attribute (through autograd: the gradient reaches
  ``local``, where DDP's hooks reduce it), and unbinds it after;
* from the end of the first forward (DDP is built by then) the module's registration holds
  the DTensor parameters ``p`` again, so ``named_parameters()``, ``parameters()`` and
  ``state_dict()`` show DTensors between steps; each ``p.grad`` is a DTensor over
  ``local.grad`` (the same memory, so it carries DDP's reduced values), and an optimizer over
  ``p`` (or over ``local``, built before the first forward) steps the one memory both share.
  ``zero_grad()`` through either clears both.  Before the first forward the registration
  holds the plain parameters (DDP reads them when it is built), but ``state_dict()`` shows
  the DTensors already and ``load_state_dict`` takes DTensors.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._runtime.views import from_local

__all__ = ["pre_dp_module_transform"]


class _Entry:
    __slots__ = ("module", "name", "fqn", "local", "param", "spec")

    def __init__(self, module: nn.Module, name: str, fqn: str, local: nn.Parameter,
                 param: nn.Parameter):
        self.module, self.name, self.fqn, self.local, self.param = module, name, fqn, local, param
        self.spec = param._spec


class _Transform:
    """The DTensor parameters of one transformed module and the state of the swap."""

    def __init__(self, entries: list[_Entry]):
        self.entries = entries
        self.shown = False  # the registration holds the DTensor parameters (after forward 1)

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        for e in self.entries:
            if self.shown and e.param.grad is None and e.local.grad is not None:
                e.local.grad = None  # zero_grad() through the DTensor parameters
            spec = e.spec
            if spec.tensor_meta.dtype != e.local.dtype:  # the module was cast since
                spec = e.spec = _grad_spec(spec, e.local)
            # DTensor.from_local(local, mesh, placements, run_check=False, shape=, stride=)
            # with the spec built once
            e.module.__dict__[e.name] = from_local(e.local, spec)

    def state_dict_hook(self, module: nn.Module, state_dict, prefix: str, local_metadata) -> None:
        """Before the first forward the registration holds the plain parameters DDP needs:
        the state dict shows the DTensors anyway (over the same memory)."""
        if self.shown:
            return
        for e in self.entries:
            k = prefix + e.fqn
            v = state_dict.get(k)
            if v is not None and not isinstance(v, DTensor):
                state_dict[k] = DTensor(v.detach(), _grad_spec(e.spec, v), requires_grad=False)

    def load_pre_hook(self, state_dict, prefix: str, *args: Any) -> None:
        """Before the first forward: DTensor values load into the plain parameters (their
        local tensors, in the parameters' placements)."""
        if self.shown:
            return
        for e in self.entries:
            k = prefix + e.fqn
            v = state_dict.get(k)
            if isinstance(v, DTensor):
                if v.placements != e.spec.placements or v.device_mesh != e.spec.mesh:
                    v = v.redistribute(e.spec.mesh, e.spec.placements)
                state_dict[k] = v.to_local()

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        for e in self.entries:
            e.module.__dict__.pop(e.name, None)
        if not self.shown:
            self.shown = True
            for e in self.entries:
                e.module._parameters[e.name] = e.param
                e.local.register_post_accumulate_grad_hook(_grad_alias(e))


def _grad_alias(e: _Entry):
    """``param.grad`` follows ``local.grad`` (the same memory, as a DTensor)."""
    ref = weakref.ref(e.param)
    spec = e.spec

    def hook(local: torch.Tensor) -> None:
        param = ref()
        if param is None or local.grad is None:
            return
        g = local.grad
        if param.grad is None or param.grad._local_tensor is not g:
            param.grad = DTensor(g, _grad_spec(spec, g), requires_grad=False)

    return hook


def _grad_spec(spec, g: torch.Tensor):
    from ._torch.dtensor import DTensorSpec, TensorMeta

    return DTensorSpec(spec.mesh, spec.placements,
                       tensor_meta=TensorMeta(spec.shape, spec.stride, g.dtype))


def pre_dp_module_transform(module: nn.Module) -> nn.Module:
    """Prepare a tensor-parallel ``module`` for ``DistributedDataParallel`` (torch's
    ``_pre_dp_module_transform`` contract; see the module doc for what differs).  Returns
    ``module``."""
    if getattr(module, "_cfsdp_dp_transform", None) is not None:
        raise ValueError("pre_dp_module_transform was already applied to this module")
    entries: list[_Entry] = []
    seen: dict[int, nn.Parameter] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if not isinstance(p, DTensor):
                continue
            fqn = f"{mod_name}.{name}" if mod_name else name
            if not all(pl.is_shard() or pl.is_replicate() for pl in p.placements):
                # from_local's backward hands back gradients in the forward placements,
                # which are their own gradient placements only for Shard and Replicate
                raise NotImplementedError(
                    f"pre_dp_module_transform: parameter '{fqn}' is a DTensor placed "
                    f"{p.placements}; cfsdp's transform takes Shard and Replicate placements "
                    "(those parallelize_module gives parameters). Redistribute it to one of "
                    "them first.")
            local = seen.get(id(p))
            if local is None:
                local = nn.Parameter(p._local_tensor.detach(), requires_grad=p.requires_grad)
                seen[id(p)] = local
            mod._parameters[name] = local
            entries.append(_Entry(mod, name, fqn, local, p))
    state = _Transform(entries)
    module._cfsdp_dp_transform = state
    module.register_forward_pre_hook(state.pre_forward)
    module.register_forward_hook(state.post_forward)
    module._register_state_dict_hook(state.state_dict_hook)
    module._register_load_state_dict_pre_hook(state.load_pre_hook)
    return module
