"""The composable face (``fully_shard``): not built yet (issue 5).

Every name exists so ``from cfsdp import fully_shard`` works; using one raises
``NotImplementedError`` naming it.
"""

from __future__ import annotations

from typing import Any


def _nyi(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"cfsdp.{name} (the composable fully_shard face) is not implemented yet "
        "(tracked in issue 5; see the compatibility table in README.md)."
    )


def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
    """Not implemented yet (issue 5)."""
    raise _nyi("fully_shard")


def register_fsdp_forward_method(module: Any, method_name: str) -> None:
    """Not implemented yet (issue 5)."""
    raise _nyi("register_fsdp_forward_method")


def share_comm_ctx(modules: Any) -> None:
    """Not implemented yet (issue 5)."""
    raise _nyi("share_comm_ctx")


class FSDPModule:
    """Not implemented yet (issue 5): ``fully_shard`` would make modules of this class."""

    def __new__(cls, *args: Any, **kwargs: Any):
        raise _nyi("FSDPModule")


class UnshardHandle:
    """Not implemented yet (issue 5)."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise _nyi("UnshardHandle")
