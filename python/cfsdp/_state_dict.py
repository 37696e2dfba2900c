"""Every FQN rule of cfsdp in one place.

torch's FSDP1 wraps a module as ``FullyShardedDataParallel(_fsdp_wrapped_module=module)``
and activation checkpointing wraps as ``CheckpointWrapper(_checkpoint_wrapped_module=...)``,
so raw ``nn.Module`` names carry those prefixes.  The names a user sees in state dicts
(and inside ``summon_full_params``) are *clean*: both prefixes removed, wherever they occur.
``named_parameters()`` outside ``summon_full_params`` keeps the raw names, as torch does.
"""

from __future__ import annotations

from typing import Optional

from .api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

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


# ---------------------------------------------------------------------------
# state-dict types and their configs (torch FSDP1's rules)
# ---------------------------------------------------------------------------

_CONFIG_OF = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def default_settings() -> tuple[StateDictType, StateDictConfig, OptimStateDictConfig]:
    """A new wrapper's settings: FULL_STATE_DICT with default configs (as torch)."""
    return StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()


def set_state_dict_type(
    wrappers: list,
    state_dict_type: StateDictType,
    state_dict_config: Optional[StateDictConfig],
    optim_state_dict_config: Optional[OptimStateDictConfig],
) -> StateDictSettings:
    """Set every wrapper's type and configs; return the previous settings.

    As torch: a config of the wrong class for the type is a ``RuntimeError``
    (``None`` takes the type's default config), and the wrappers must agree on
    the previous type and config classes (``AssertionError``)."""
    if state_dict_type not in _CONFIG_OF:
        raise ValueError(
            f"state_dict_type must be a StateDictType (FULL_STATE_DICT, SHARDED_STATE_DICT or "
            f"LOCAL_STATE_DICT), got {state_dict_type!r}"
        )
    cfg_cls, optim_cfg_cls = _CONFIG_OF[state_dict_type]
    if state_dict_config is None:
        state_dict_config = cfg_cls()
    if optim_state_dict_config is None:
        optim_state_dict_config = optim_cfg_cls()
    if type(state_dict_config) is not cfg_cls:
        raise RuntimeError(
            f"Expected state_dict_config of type {cfg_cls} but got {type(state_dict_config)} "
            f"(state_dict_type={state_dict_type})"
        )
    if type(optim_state_dict_config) is not optim_cfg_cls:
        raise RuntimeError(
            f"Expected optim_state_dict_config of type {optim_cfg_cls} but got "
            f"{type(optim_state_dict_config)} (state_dict_type={state_dict_type})"
        )
    prev_type = prev_cfg = prev_optim_cfg = None
    for w in wrappers:
        if prev_type is None:
            prev_type, prev_cfg, prev_optim_cfg = (
                w._state_dict_type, w._state_dict_config, w._optim_state_dict_config
            )
        else:
            if w._state_dict_type != prev_type:
                raise AssertionError("All FSDP modules should have the same state_dict_type.")
            if not isinstance(w._state_dict_config, type(prev_cfg)):
                raise AssertionError("All FSDP modules must have the same type of state_dict_config.")
            if not isinstance(w._optim_state_dict_config, type(prev_optim_cfg)):
                raise AssertionError(
                    "All FSDP modules must have the same type of optim_state_dict_config."
                )
        w._state_dict_type = state_dict_type
        w._state_dict_config = state_dict_config
        w._optim_state_dict_config = optim_state_dict_config
    return StateDictSettings(prev_type, prev_cfg, prev_optim_cfg)


def check_mesh_settings(w) -> None:
    """A wrapper built with a ``device_mesh`` gives DTensors in sharded state dicts
    (torch turns ``_use_dtensor`` on) and has no LOCAL state dict."""
    if getattr(w, "_device_mesh", None) is None:
        return
    if w._state_dict_type == StateDictType.LOCAL_STATE_DICT:
        raise RuntimeError(
            "Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible with "
            "LOCAL_STATE_DICT. Please set state_dict_type to SHARDED_STATE_DICT to get "
            "DTensor state_dict."
        )
    if w._state_dict_type == StateDictType.SHARDED_STATE_DICT:
        w._state_dict_config._use_dtensor = True
        w._optim_state_dict_config._use_dtensor = True


def get_state_dict_type(wrappers: list) -> Optional[StateDictSettings]:
    """The settings every wrapper shares (None without wrappers)."""
    settings: Optional[StateDictSettings] = None
    for w in wrappers:
        check_mesh_settings(w)
        mine = StateDictSettings(w._state_dict_type, w._state_dict_config, w._optim_state_dict_config)
        if settings is None:
            settings = mine
        elif mine != settings:
            raise AssertionError(
                f"All FSDP modules must have the same state dict settings. Got {mine} and {settings}."
            )
    return settings


# ---------------------------------------------------------------------------
# parameters as an optimizer sees them -> the clean FQNs they hold
# ---------------------------------------------------------------------------


def optimizer_param_fqns(model, wrappers: list) -> dict:
    """``{parameter: [clean FQN, ...]}`` for every parameter ``model.parameters()`` yields.

    A flat parameter (``use_orig_params=False``) maps to the FQNs of the original parameters
    it holds, in layout order (torch's ``FlatParameter._fqns``); an original parameter
    (``use_orig_params=True``) and a parameter no unit manages (ignored) map to their own
    clean name.  Tied occurrences of a parameter are not listed again (as
    ``named_parameters()`` and torch's FSDP1 optimizer state dicts)."""
    module_names = {id(m): n for n, m in model.named_modules()}
    out: dict = {}
    for w in wrappers:
        unit = w._state.unit
        if unit is None:
            continue
        prefix = module_names[id(unit.module)]
        fqns = [clean_tensor_name(join_fqn(prefix, i.fqn)) for i in unit.infos]
        if unit.use_orig_params:
            for info, fqn in zip(unit.infos, fqns):
                out[info.param] = [fqn]
        else:
            out[unit.flat_param] = fqns
    for name, p in model.named_parameters():
        out.setdefault(p, [clean_tensor_name(name)])
    return out
