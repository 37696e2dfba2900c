"""cfsdp._C.plan_layout against its twin cfsdp._ref.plan_layout_lists."""

import inspect
import math

import pytest
import torch
from hypothesis import given, strategies as st

import cfsdp._C as C
from cfsdp import _core
from cfsdp._ref import plan_layout_lists

ALIGNS = [0, 1, 4, 8, 16]

numels_st = st.lists(
    st.one_of(st.integers(0, 40), st.sampled_from([0, 1, 2, 3, 7, 1000, 4099])),
    max_size=12,
)


def check_invariants(numels, align, ws, out):
    offsets, flat, shard, slices = out
    p = len(numels)
    assert len(offsets) == p and len(slices) == 3 * p * ws
    prev_end = 0
    for off, n in zip(offsets, numels):
        assert off >= prev_end  # in order, no overlap
        if align > 0:
            assert off % align == 0
            assert off - prev_end < align  # minimal padding
        else:
            assert off == prev_end  # no padding without alignment
        prev_end = off + n
    assert flat >= prev_end
    if align > 0:
        assert flat % ws == 0 and flat - prev_end < max(ws, 1)
    else:
        assert flat == prev_end
    assert shard == math.ceil(flat / ws)
    for i, (off, n) in enumerate(zip(offsets, numels)):
        pieces = []
        for r in range(ws):
            start, cnt, soff = slices[3 * (r * p + i) : 3 * (r * p + i) + 3]
            if cnt == 0:
                assert (start, soff) == (0, 0)
                continue
            assert 0 <= soff and soff + cnt <= shard
            assert r * shard + soff == off + start  # the slice is where it says
            pieces.append((start, cnt))
        pieces.sort()
        pos = 0
        for start, cnt in pieces:  # covers [0, n) exactly once
            assert start == pos
            pos += cnt
        assert pos == n


@given(numels=numels_st, align=st.sampled_from(ALIGNS), ws=st.integers(1, 8))
def test_plan_layout_matches_twin(numels, align, ws):
    got = C.plan_layout(tuple(numels), align, ws)
    want = plan_layout_lists(numels, align, ws)
    assert got == want
    assert all(type(x) is int for x in got[0] + got[3])
    check_invariants(numels, align, ws, got)


@given(numels=numels_st, align=st.sampled_from(ALIGNS), ws=st.integers(1, 8))
def test_core_layout_same_for_both_backends(numels, align, ws):
    via_c = _core.plan_layout(numels, align, ws)
    saved = _core._C
    try:
        _core._C = None  # force the twin
        via_ref = _core.plan_layout(numels, align, ws)
    finally:
        _core._C = saved
    assert via_c == via_ref
    assert via_c.padded_numel == ws * via_c.shard_numel
    for r in range(ws):
        lo, hi = via_c.shard_range(r)
        assert hi - lo == via_c.shard_numel


@pytest.mark.parametrize("ws", [1, 2, 3, 8])
@pytest.mark.parametrize("align", ALIGNS)
def test_special_lists(ws, align):
    for numels in ([], [0], [0, 0, 0], [1], [1] * 11, [ws - 1 or 1, 0, 2], [5, 3, 2**40]):
        got = C.plan_layout(tuple(numels), align, ws)
        assert got == plan_layout_lists(numels, align, ws)
        check_invariants(numels, align, ws, got)


def test_shards_are_torch_chunks():
    """A rank's range is torch.chunk's chunk of the flat buffer (FSDP1 sharding)."""
    for numels, align, ws in [([3, 5], 0, 4), ([7], 0, 3), ([1, 1], 4, 8), ([10, 1], 8, 3)]:
        offsets, flat, shard, _ = C.plan_layout(tuple(numels), align, ws)
        chunks = torch.arange(flat).chunk(ws)
        for r in range(ws):
            want = chunks[r].tolist() if r < len(chunks) else []
            assert list(range(r * shard, min((r + 1) * shard, flat))) == want


def test_accepts_list_and_large_values():
    assert C.plan_layout([2**40, 3], 16, 7) == plan_layout_lists([2**40, 3], 16, 7)


@pytest.mark.parametrize(
    "args, match",
    [
        (((1, -2), 0, 2), "numel"),
        (((1,), -1, 2), "align_numel"),
        (((1,), 0, 0), "world_size"),
        (((1,), 4, -3), "world_size"),
    ],
)
def test_bad_arguments_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        C.plan_layout(*args)
    with pytest.raises(ValueError, match=match):
        plan_layout_lists(*args)


def test_overflow_and_type_errors():
    with pytest.raises(OverflowError):
        C.plan_layout((2**62, 2**62), 0, 1)
    with pytest.raises(OverflowError):
        C.plan_layout((1, 2**63 - 2), 8, 3)  # alignment padding overflows
    with pytest.raises(OverflowError):
        C.plan_layout((2**64,), 0, 1)
    with pytest.raises(TypeError):
        C.plan_layout((1.5,), 0, 1)
    with pytest.raises(TypeError):
        C.plan_layout(5, 0, 1)
    with pytest.raises(TypeError):
        C.plan_layout((1,), 0)


def test_signature():
    sig = inspect.signature(C.plan_layout)
    assert list(sig.parameters) == ["numels", "align_numel", "world_size"]
    assert all(p.kind is p.POSITIONAL_ONLY for p in sig.parameters.values())


def test_world_size_padding_overflow():
    # align > 0 pads the total up to a multiple of world_size
    with pytest.raises(OverflowError):
        C.plan_layout((2**63 - 2,), 1, 5)
