"""Parameters a unit replaced, and the optimizer check that catches them.

Both faces replace the ``nn.Parameter`` objects a user's model held: the wrapper with
``use_orig_params=False`` registers one flat parameter instead of a unit's parameters;
``fully_shard`` registers a sharded ``DTensor`` parameter instead of each original one (and
adopts the parameter that ``load_state_dict(assign=True)`` or a user's ``setattr`` puts in
its place).  An optimizer built from the old objects would step tensors nothing reads any
more: it would train nothing, silently.  So every replaced parameter is marked with its FQN,
the module that held it and how it was replaced (:func:`mark_replaced`), and one optimizer
step pre-hook, installed with the first mark, raises a ``RuntimeError`` naming the first
replaced parameter an optimizer holds, by its FQN in the whole model (``l1.weight``, also
when each layer was wrapped or sharded on its own: ``_fqn.full_name`` from the module that
held it), and saying to build the optimizer afterwards.

Cost: the hook runs for every optimizer of the process, but checks an optimizer's
parameters only when something changed since it last passed: a mark was made (a global
generation counter) or its param groups changed size (``add_param_group``).  In a steady
training loop it is one comparison per step.

Every original parameter a unit takes also gets an id (:func:`orig_uid`), as torch's FSDP2
gives it: two units holding the same original parameter (weights tied across
``fully_shard`` calls) are refused by that id.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .._fqn import full_name

_FQN_ATTR = "_cfsdp_stale_fqn"
_HOW_ATTR = "_cfsdp_replaced_by"
_UID_ATTR = "_cfsdp_orig_uid"

_generation = 0
_hook_installed = False
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()
# replaced parameter -> (a weak reference to the module that held it, its name there); not an
# attribute of the parameter, which must stay picklable
_holders: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
# module -> the names of its parameters the wrapper (use_orig_params=False) replaced by views
# of a flat parameter: another unit using that module shares those parameters
_taken: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
_uids = itertools.count()

# how -> (what replaced it, when to build the optimizer)
WRAPPER = ("FullyShardedDataParallel replaced it by a flat sharded parameter when it wrapped "
           "the module (use_orig_params=False)", "after wrapping, from the wrapped model's parameters()")
WRAPPER_TP = ("FullyShardedDataParallel replaced this tensor-parallel DTensor parameter by a "
              "parameter of its local tensor when it wrapped the module (use_orig_params=True, as "
              "torch's FSDP1)", "after wrapping, from the wrapped model's parameters()")
FULLY_SHARD = ("fully_shard replaced it by a sharded DTensor parameter when it sharded the module",
               "after fully_shard, from the model's parameters()")
ADOPTED = ("fully_shard now uses the parameter that took its place in the module (e.g. "
           "load_state_dict(assign=True) or an assignment)",
           "after loading or replacing parameters, from the model's parameters()")


def mark_replaced(param: torch.Tensor, fqn: str, how: tuple[str, str], module: nn.Module,
                  name: str) -> None:
    """Record that a unit no longer uses ``param``, named ``fqn`` relative to the unit's
    module and ``name`` in ``module``, which held it; see the module doc."""
    global _generation
    setattr(param, _FQN_ATTR, fqn)
    _holders[param] = (weakref.ref(module), name)
    setattr(param, _HOW_ATTR, how)
    if how is WRAPPER:
        _taken.setdefault(module, {})[name] = None  # (in registration order)
    _generation += 1
    _install()


def replaced_fqn(param: torch.Tensor) -> Optional[str]:
    """The FQN ``param`` had when a unit replaced it (relative to the unit's module), or
    None."""
    return getattr(param, _FQN_ATTR, None)


def taken_by_wrapper(module: nn.Module) -> list[str]:
    """The names in ``module`` of parameters a wrapper unit (``use_orig_params=False``)
    replaced by views of its flat parameter and that ``module`` still shows as such (not
    registered parameters again)."""
    return [n for n in _taken.get(module, ())
            if n not in module._parameters and isinstance(module.__dict__.get(n), torch.Tensor)]


def _model_fqn(param: torch.Tensor, fqn: str) -> str:
    """A replaced parameter's FQN in the whole model, as far as the module that held it is
    still in it (``_fqn.full_name``: for the error only, it walks the heap)."""
    ref, name = _holders.get(param, (lambda: None, ""))
    module = ref()
    return fqn if module is None else full_name(module, name, known=fqn)


def orig_uid(param: torch.Tensor) -> int:
    """A process-wide id of an original parameter (given on first use, kept on the object)."""
    uid = getattr(param, _UID_ATTR, None)
    if uid is None:
        uid = next(_uids)
        setattr(param, _UID_ATTR, uid)
    return uid


def check_plain_param(param: torch.Tensor, fqn: str, face: str, tp_ok: bool = False,
                      ext_ok: bool = False) -> bool:
    """A unit shards plain strided tensors (``nn.Parameter`` s of ``torch.Tensor``; the meta
    device is fine), with ``tp_ok`` the ``DTensor`` parameters of tensor parallelism
    (whose local tensor is plain), and with ``ext_ok`` (``fully_shard``) a tensor whose
    class defines torch FSDP2's all-gather extension hooks (``fsdp_pre_all_gather`` and
    ``fsdp_post_all_gather``: [Note: all-gather extensions] in chunk/ext.py; torch's error
    for one without the other); any other tensor subclass is refused at wrap time, naming
    it.  Returns whether ``param`` is such an extension parameter."""
    from torch.distributed.tensor import DTensor

    from .chunk.ext import check_extension

    if isinstance(param, DTensor) and tp_ok:
        check_plain_param(param._local_tensor, fqn, face)
        return False
    if isinstance(param, DTensor):
        raise NotImplementedError(
            f"{face}: parameter '{fqn}' is a DTensor (placements {param.placements} on "
            f"{param.device_mesh}), e.g. from tensor parallelism (parallelize_module). cfsdp does "
            "not shard DTensor parameters yet (tensor parallelism is a planned feature: see the "
            "compatibility table in README.md); use torch's FSDP for this model, or apply cfsdp "
            "to a model without tensor-parallel parameters."
        )
    if ext_ok and param.layout == torch.strided and check_extension(param, fqn):
        return True
    if type(param) not in (torch.Tensor, torch.nn.Parameter) or param.layout != torch.strided:
        raise NotImplementedError(
            f"{face}: parameter '{fqn}' is a {type(param).__name__} with layout {param.layout}; "
            "cfsdp shards plain strided tensors only. Convert it to a plain tensor before "
            "wrapping, or leave it out (ignored_states / ignored_params)."
        )
    return False


def _check_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    key = (_generation, tuple(len(g["params"]) for g in optimizer.param_groups))
    if _checked.get(optimizer) == key:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            fqn = replaced_fqn(p)
            if fqn is not None:
                what, when = getattr(p, _HOW_ATTR, WRAPPER)
                raise RuntimeError(
                    f"The optimizer holds parameter '{_model_fqn(p, fqn)}', which the model "
                    "no longer uses: "
                    f"{what}, so stepping it would train nothing. Build the optimizer {when}."
                )
    _checked[optimizer] = key


def _install() -> None:
    global _hook_installed
    if not _hook_installed:
        register_optimizer_step_pre_hook(_check_optimizer)
        _hook_installed = True


__all__ = ["check_plain_param", "mark_replaced", "replaced_fqn", "taken_by_wrapper", "orig_uid",
           "WRAPPER", "WRAPPER_TP",
           "FULLY_SHARD", "ADOPTED"]
