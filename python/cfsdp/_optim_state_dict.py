"""Optimizer state dicts for the wrapper face (torch FSDP1's eight static methods).

Being built (issue 4): each function raises ``NotImplementedError`` until it lands.
"""

from __future__ import annotations

from typing import Any


def _nyi(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"FullyShardedDataParallel.{name} is not implemented yet in cfsdp (issue 4)."
    )


def optim_state_dict(model, optim, optim_state_dict=None, group=None) -> dict[str, Any]:
    raise _nyi("optim_state_dict")


def optim_state_dict_to_load(
    model, optim, optim_state_dict, is_named_optimizer=False, load_directly=False, group=None
) -> dict[str, Any]:
    raise _nyi("optim_state_dict_to_load")


def full_optim_state_dict(model, optim, optim_input=None, rank0_only=True, group=None):
    raise _nyi("full_optim_state_dict")


def sharded_optim_state_dict(model, optim, group=None):
    raise _nyi("sharded_optim_state_dict")


def shard_full_optim_state_dict(full_optim_state_dict, model, optim_input=None, optim=None):
    raise _nyi("shard_full_optim_state_dict")


def flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim):
    raise _nyi("flatten_sharded_optim_state_dict")


def scatter_full_optim_state_dict(
    full_optim_state_dict, model, optim_input=None, optim=None, group=None
):
    raise _nyi("scatter_full_optim_state_dict")


def rekey_optim_state_dict(optim_state_dict, optim_state_key_type, model, optim_input=None, optim=None):
    raise _nyi("rekey_optim_state_dict")
