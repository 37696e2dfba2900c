"""The accelerator path's copy-out and reduce-scatter copy-in in a fixed number of launches
(``cfsdp._runtime.chunk.launch.Launches``: one ``split_with_sizes_copy`` / one ``_chunk_cat``)
against the twins ``cfsdp._ref.chunk.chunk_unpack`` / ``chunk_pack``, bit for bit, on plans of
every kind (dim 0 even and uneven, ranks holding only padding, ``Shard(d > 0)`` blocks, empty
parameters, gaps in either buffer, 1 to 4 ranks, a cast and a pre-division), and the ops each
runs counted.  The recorded training in test_streams.py runs them inside the units."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cfsdp._ref import chunk as ref
from cfsdp._runtime.chunk.launch import Launches

pytestmark = pytest.mark.no_core  # torch ops only: run once, in the plain unit pass


def make_plan(shapes: list[tuple[tuple, int]], W: int, gap: int = 0):
    """A unit's plan as ``ChunkUnit`` lays it out (``gap`` elements between segments of
    both buffers): ``(plan, rows, natural_numel, shard_numel)``."""
    plan, rows, nat, shard = [], [], gap, gap
    for shape, d in shapes:
        numel = math.prod(shape)
        r = shape[d] if shape else 1
        c = -(-r // W)
        row = math.prod(shape[d + 1:])
        outer = math.prod(shape[:d])
        chunk = outer * c * row
        plan.append((nat, numel, chunk, shard, max(outer, 1)))
        rows.append(max(r, 1))
        nat += numel + gap
        shard += chunk + gap
    return plan, rows, nat, shard


CASES = {
    "even": [((8, 3), 0), ((4,), 0), ((12, 2, 2), 0)],
    "uneven": [((5, 3), 0), ((7,), 0), ((3, 4), 0)],
    "padding_ranks": [((1, 6), 0), ((2,), 0), ((5, 2), 0)],  # at W=4 ranks with nothing
    "shard_dims": [((3, 8, 2), 1), ((4, 3), 0), ((2, 3, 8), 2), ((6, 4), 1)],
    "empty": [((0, 3), 0), ((4, 2), 0), ((0,), 0), ((3,), 0)],
    "scalar": [((), 0), ((6, 2), 0)],
}


def _shapes_for(case: str, W: int):
    shapes = CASES[case]
    if case == "shard_dims":  # torch requires W | shape[d] for d > 0
        shapes = [(s, d) for s, d in shapes if d == 0 or s[d] % W == 0]
    return shapes


@pytest.mark.parametrize("gap", [0, 3])
@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_unpack_is_the_twin(case, W, gap):
    plan, rows, nat, S = make_plan(_shapes_for(case, W), W, gap)
    g = torch.randn(W * S)
    want = torch.full((nat,), 7.0)
    got = want.clone()
    ref.chunk_unpack(want, g, plan, W, S)
    Launches(plan, rows, W, S).unpack(got, g)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("divisor", [1.0, 3.0])
@pytest.mark.parametrize("gap", [0, 2])
@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_pack_is_the_twin(case, W, gap, divisor, dtypes):
    src_dtype, dst_dtype = dtypes
    plan, rows, nat, S = make_plan(_shapes_for(case, W), W, gap)
    grad = torch.randn(nat).to(src_dtype)
    want = torch.full((W * S,), 7.0, dtype=dst_dtype)
    got = want.clone()
    ref.chunk_pack(want, grad, plan, W, S, divisor=divisor)
    Launches(plan, rows, W, S).pack(got, grad, divisor=divisor)
    assert torch.equal(got, want)


def test_random_plans():
    rng = random.Random(0)
    for _ in range(200):
        W = rng.randint(1, 5)
        shapes = []
        for _ in range(rng.randint(1, 6)):
            nd = rng.randint(1, 3)
            shape = [rng.randint(0, 7) for _ in range(nd)]
            d = rng.randrange(nd) if rng.random() < 0.3 else 0
            if d:
                shape[d] = W * rng.randint(1, 3)
            shapes.append((tuple(shape), d))
        plan, rows, nat, S = make_plan(shapes, W, rng.choice([0, 0, 1]))
        g = torch.randn(W * S)
        want = torch.zeros(nat)
        got = want.clone()
        ref.chunk_unpack(want, g, plan, W, S)
        la = Launches(plan, rows, W, S)
        la.unpack(got, g)
        assert torch.equal(got, want), (shapes, W)
        grad = torch.randn(nat)
        want = torch.empty(W * S)
        got = torch.empty(W * S)
        ref.chunk_pack(want, grad, plan, W, S, divisor=2.0)
        la.pack(got, grad, divisor=2.0)
        assert torch.equal(got, want), (shapes, W)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in ("view", "slice", "transpose", "empty", "new_empty", "_unsafe_view",
                        "as_strided", "detach", "t", "reshape", "alias"):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _ops(fn) -> Counter:
    with _Ops() as mode:
        fn()
    return mode.ops


def test_launch_counts():
    """A unit of even dim-0 parameters: the copy-out is one ``split_with_sizes_copy`` and the
    copy-in one ``_chunk_cat`` (plus the pre-division and the cast when asked); each uneven or
    ``Shard(d > 0)`` parameter adds one copy (the twin: one or more per parameter)."""
    W = 2
    even = [((8, 3), 0), ((4,), 0), ((2, 6), 0)] * 10
    plan, rows, nat, S = make_plan(even, W)
    la = Launches(plan, rows, W, S)
    g, natural, grad = torch.randn(W * S), torch.empty(nat), torch.randn(nat)
    assert _ops(lambda: la.unpack(natural, g)) == Counter({"split_with_sizes_copy": 1})
    dst = torch.empty(W * S)
    assert _ops(lambda: la.pack(dst, grad)) == Counter({"_chunk_cat": 1})
    assert _ops(lambda: la.pack(dst, grad, divisor=2.0)) == Counter({"_chunk_cat": 1, "div_": 1})
    low = torch.empty(W * S, dtype=torch.bfloat16)
    assert _ops(lambda: la.pack(low, grad, divisor=2.0)) == Counter(
        {"_chunk_cat": 1, "div_": 1, "copy_": 1})
    twin = _ops(lambda: ref.chunk_unpack(natural, g, plan, W, S))
    assert sum(twin.values()) >= len(even)
    mixed = even + [((5, 3), 0), ((3, 4, 2), 1)]
    plan, rows, nat, S = make_plan(mixed, W)
    la = Launches(plan, rows, W, S)
    g, natural, grad = torch.randn(W * S), torch.empty(nat), torch.randn(nat)
    ops = _ops(lambda: la.unpack(natural, g))
    assert ops == Counter({"split_with_sizes_copy": 1, "copy_": 2}), ops
    ops = _ops(lambda: la.pack(torch.empty(W * S), grad))
    assert ops == Counter({"_chunk_cat": 1, "clone": 1}), ops


def test_bad_buffers():
    plan, rows, nat, S = make_plan([((4, 2), 0)], 2)
    la = Launches(plan, rows, 2, S)
    with pytest.raises(ValueError, match="gathered must be 1-D with 8 elements"):
        la.unpack(torch.empty(nat), torch.empty(7))
    with pytest.raises(ValueError, match="dst must be 1-D with 8 elements"):
        la.pack(torch.empty(9), torch.empty(nat))
    with pytest.raises(ValueError, match="every rank's part"):
        la.pack(torch.empty(4), torch.empty(nat), ranks=(0, 1))
