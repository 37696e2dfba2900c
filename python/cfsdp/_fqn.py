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


__all__ = [
    "FSDP_WRAPPED_MODULE", "FSDP_PREFIX", "CHECKPOINT_WRAPPED_MODULE", "CHECKPOINT_PREFIX",
    "FLAT_PARAM", "clean_tensor_name", "join_fqn", "module_prefix",
]
