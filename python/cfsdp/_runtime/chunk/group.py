"""One ``fully_shard`` call over parameters of several dtypes or meshes: one ``ChunkUnit`` each.

torch's FSDP2 all-gathers a call's parameters of several dtypes in one collective (their
bytes side by side) and reduce-scatters the gradients of one dtype.  cfsdp gives each dtype
of the call its own chunk unit (a shard, all-gather and reduce-scatter per dtype, each a
C pass as usual) and drives them together through :class:`ChunkUnitGroup`: every
parameter's local shard, full value and gradient is the one torch computes (an all-gather
is a byte copy either way).  Gradients of several dtypes in one call, which torch refuses
("FSDP reduce-scatter expects uniform gradient dtype"), are reduced per dtype.  A call whose
``shard_placement_fn`` puts parameters on other meshes (``ShardPlacementResult``: torch makes
one parameter group per process group) has a chunk unit per (mesh, dtype) the same way.

The group is what the call's hooks hold as their unit: the forward-path calls of
``base.UnitContract`` go to every member, in order (an unshard issues every member's
all-gather before waiting for any).  The gradient path needs no group: each member's flat
parameter reports its own gradient to ``post_backward_fn`` with the member as the unit.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from .unit import ChunkUnit

# settings the call's API sets on "the unit": every member takes them
_SHARED_SETTINGS = frozenset((
    "post_backward_fn", "all_reduce_hook", "gradient_divide_factor", "force_sum_reduction",
    "post_forward_group", "requires_all_reduce", "_comm", "reduce_scatter_unused_params",
))


class ChunkUnitGroup:
    """The chunk units (one per (mesh, dtype), in the order they first appear) of one call."""

    def __init__(self, units: list[ChunkUnit]):
        object.__setattr__(self, "units", units)
        first = units[0]
        for name in ("dp", "group", "rank", "world_size", "device", "mesh", "replicate_group"):
            object.__setattr__(self, name, getattr(first, name))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHARED_SETTINGS:
            for u in self.units:
                setattr(u, name, value)
        object.__setattr__(self, name, value)

    # ----------------------------------------------------------- the call's view
    @property
    def params(self) -> list:
        return list(itertools.chain.from_iterable(u.params for u in self.units))

    @property
    def is_unsharded(self) -> bool:
        return all(u.is_unsharded for u in self.units)

    def update_divide_factors(self) -> None:
        for u in self.units:
            u.update_divide_factors()

    def reset_sharded_params(self) -> None:
        for u in self.units:
            u.reset_sharded_params()

    def meta_param_names(self, root: nn.Module) -> list[str]:
        return [n for u in self.units for n in u.meta_param_names(root)]

    def drop_iteration(self) -> None:
        for u in self.units:
            u.drop_iteration()

    # ---------------------------------------------------------- the forward path
    def before_forward(self) -> None:
        for u in self.units:
            u.before_forward()

    def unshard(self, async_op: bool = False) -> None:
        for u in self.units:
            u.unshard(async_op=True)
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        for u in self.units:
            u.wait_unshard()

    def use_forward_views(self) -> None:
        for u in self.units:
            u.use_forward_views()

    def record_grad_node(self) -> None:
        pass  # [Note: one post-backward per iteration] in base.py: one node per member

    def end_forward_views(self) -> None:
        for u in self.units:
            u.end_forward_views()

    def reshard(self) -> None:
        for u in self.units:
            u.reshard()

    def reshard_after_forward(self, for_backward: bool) -> None:
        for u in self.units:
            u.reshard_after_forward(for_backward)

    def take_grad_for_backward(self) -> None:
        for u in self.units:
            u.take_grad_for_backward()

    def take_waiting_grad(self) -> Optional[torch.Tensor]:
        return None  # no member's gradient waits: one node each

    def publish_grad(self) -> None:
        for u in self.units:
            u.publish_grad()

    def reduce_unreached(self, pending: list) -> None:
        for u in self.units:
            u.reduce_unreached(pending)

    def publish_unsharded_grad(self) -> None:
        for u in self.units:
            u.publish_unsharded_grad()


def chunk_units(entries, make: Callable[[list], ChunkUnit],
                mesh_of: Callable[[Any], Any] = lambda p: None) -> Optional[Any]:
    """The unit of a call: one ``ChunkUnit`` (``make(entries)``), or a group of one per
    (mesh, dtype) when the call's parameters have several (``mesh_of(param)``: a key of the
    parameter's mesh); None without parameters."""
    if not entries:
        return None
    by_key: dict[tuple, list] = {}
    for e in entries:
        by_key.setdefault((mesh_of(e[3]), e[3].dtype), []).append(e)
    units = [make(es) for es in by_key.values()]
    return units[0] if len(units) == 1 else ChunkUnitGroup(units)


__all__ = ["ChunkUnitGroup", "chunk_units"]
