"""Which rank orthogonalizes which matrix: ``cfsdp.optim.Muon``'s owner assignment.

Muon's Newton–Schulz step needs each matrix whole; on sharded layouts (issue 27 phase 2)
exactly one rank, its owner, gathers a matrix's momentum, orthogonalizes it and sends the
update back.  ``assign_owners`` picks the owners so that the ranks' Newton–Schulz work is
balanced: a matrix of trailing shape ``(m, n)`` stacked ``b`` times (``[..., m, n]``, leading
dims a batch, as stacked experts) costs ``b * m * n * min(m, n)`` (each iteration's three
matmuls are that order of multiply-adds; the constant and the iteration count are the same
for every matrix, so they drop out of the balance).

The rule is greedy "longest processing time first": matrices by cost, largest first (ties:
lower index first), each to the rank with the least load so far (ties: lower rank).  It is
deterministic (every rank computes the same owners from the same shapes, no communication)
and its maximum load is at most ``total / world_size + largest`` (the rank a matrix goes to
had the least load, at most the mean of what was placed before it).

``plan_buckets`` cuts the matrices, in index order, into the buckets the exchange moves one at
a time (``_muon_bucket``): consecutive matrices while their bytes sum to at most the bound, a
matrix larger than the bound alone.  Like the owners, it is computed from what every rank of a
group knows identically (the shapes), so every rank makes the same collectives.  Pure Python:
no torch, no C.
"""

from __future__ import annotations

import heapq
from math import prod
from typing import Sequence

__all__ = ["assign_owners", "ns_cost", "plan_buckets"]


def ns_cost(shape: Sequence[int]) -> int:
    """Newton–Schulz work of one parameter of ``shape`` (``ndim >= 2``; the leading dims a
    batch of trailing ``(m, n)`` matrices): ``batch * m * n * min(m, n)``."""
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2 or any(d < 0 for d in shape):
        raise ValueError(f"a Muon matrix needs ndim >= 2 and sizes >= 0, got shape {shape}")
    m, n = shape[-2:]
    return prod(shape[:-2]) * m * n * min(m, n)


def assign_owners(shapes: Sequence[Sequence[int]], world_size: int) -> list[int]:
    """The owner rank of each matrix of ``shapes`` (in order) among ``world_size`` ranks,
    balancing ``ns_cost`` (see the module docstring for the rule and its bound)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    costs = [ns_cost(s) for s in shapes]
    heap = [(0, r) for r in range(world_size)]  # (load, rank): the least, lower rank first
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    return owners


def plan_buckets(nbytes: Sequence[int], bound: int) -> list[list[int]]:
    """The matrices' indices cut into buckets, in order: each bucket consecutive matrices whose
    ``nbytes`` sum to at most ``bound`` (``>= 1``), a matrix of more than ``bound`` bytes alone;
    every index exactly once, no empty bucket."""
    if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
        raise ValueError(f"bound must be an int >= 1, got {bound!r}")
    buckets: list[list[int]] = []
    size = 0
    for k, b in enumerate(nbytes):
        b = int(b)
        if b < 0:
            raise ValueError(f"matrix {k}: bytes must be >= 0, got {b}")
        if not buckets or size + b > bound:
            buckets.append([])
            size = 0
        buckets[-1].append(k)
        size += b
    return buckets
