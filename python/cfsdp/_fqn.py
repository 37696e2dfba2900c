"""Every FQN rule of cfsdp in one place (the bottom layer: imports nothing of cfsdp).

torch's FSDP1 wraps a module as ``FullyShardedDataParallel(_fsdp_wrapped_module=module)``
and activation checkpointing wraps as ``CheckpointWrapper(_checkpoint_wrapped_module=...)``,
so raw ``nn.Module`` names carry those prefixes.  The names a user sees in state dicts
(and inside ``summon_full_params``) are *clean*: both prefixes removed, wherever they occur.
``named_parameters()`` outside ``summon_full_params`` keeps the raw names, as torch does.
A wrapper without ``use_orig_params`` registers its unit's flat parameter as
``<module>._flat_param`` (``FLAT_PARAM``).
"""

from __future__ import annotations

import gc

from torch import nn

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
CHECKPOINT_WRAPPED_MODULE = "_checkpoint_wrapped_module"
CHECKPOINT_PREFIX = CHECKPOINT_WRAPPED_MODULE + "."
FLAT_PARAM = "_flat_param"


def clean_tensor_name(name: str) -> str:
    """Strip every wrapper prefix from a parameter/buffer/module name."""
    return name.replace(FSDP_PREFIX, "").replace(CHECKPOINT_PREFIX, "")


def join_fqn(prefix: str, name: str) -> str:
    """``prefix.name`` (either may be empty)."""
    if not prefix:
        return name
    if not name:
        return prefix
    return f"{prefix}.{name}"


def module_prefix(name: str) -> str:
    """The clean prefix (with a trailing dot, or empty for the root) of a module named
    ``name`` in ``named_modules()``."""
    return clean_tensor_name(name + ".") if name else ""


def full_name(module: nn.Module, name: str, known: str = "") -> str:
    """The clean FQN of ``name`` (a parameter of ``module``, or a dotted name below it) in
    the outermost module that holds ``module``: ``full_name(model.l1, "weight")`` is
    ``"l1.weight"``, from ``model.l1`` alone (a face handed a submodule knows nothing
    above it).  The parents are found in one pass over the garbage collector's objects
    (every live module's children): for error messages only.  The walk stops at a module
    with no parent, or with several (a shared module: the name is then relative to it).
    ``known``, a name of the same tensor relative to some module on the way, is returned
    (clean) instead when the walked name does not end with it (the module left its
    tree)."""
    parents: dict = {}
    for o in gc.get_objects():
        if issubclass(type(o), nn.Module):
            for child_name, child in o._modules.items():
                if child is not None:
                    parents.setdefault(id(child), []).append((o, child_name))
    parts, seen, m = [], {id(module)}, module
    while len(parents.get(id(m), ())) == 1 and id(parents[id(m)][0][0]) not in seen:
        m, child_name = parents[id(m)][0]
        seen.add(id(m))
        parts.append(child_name)
    walked = clean_tensor_name(join_fqn(".".join(reversed(parts)), name))
    known = clean_tensor_name(known)
    if known and not (walked == known or walked.endswith("." + known)):
        return known
    return walked


__all__ = [
    "FSDP_WRAPPED_MODULE", "FSDP_PREFIX", "CHECKPOINT_WRAPPED_MODULE", "CHECKPOINT_PREFIX",
    "FLAT_PARAM", "clean_tensor_name", "join_fqn", "module_prefix", "full_name",
]
