"""Gradient reduction: divide factors and the post-reduce pass.

torch's FSDP1 divides a gradient twice to keep sums in range: by a
*pre-divide* factor before the reduce-scatter and by a *post-divide* factor
after it, with ``pre * post == world_size``.  The pre factor ``f`` starts at
1 and doubles while ``world_size % f == 0 and world_size / f > f``.  A factor
of 1 means no division at all.  cfsdp uses the same factors and the same
rounding, so its gradients match torch's bit for bit.

After the reduce-scatter, one C pass divides by the post factor, casts to the
parameter dtype and accumulates into the unit's existing sharded gradient
(``cfsdp._core.scale_cast_add``).
"""

from __future__ import annotations

from .. import _core


def divide_factors(world_size: int) -> tuple[float, float]:
    """``(pre, post)`` divide factors for a data-parallel group of this size."""
    f = 1
    while world_size % f == 0 and world_size / f > f:
        f *= 2
    return float(f), world_size / f


scale_cast_add = _core.scale_cast_add
