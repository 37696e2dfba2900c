"""cfsdp._C.shard_fill against its twin cfsdp._ref.shard_fill (byte equality)."""

import inspect

import pytest
import torch
from hypothesis import given, strategies as st

import cfsdp._C as C
from cfsdp import _core
from cfsdp._ref import plan_layout_lists, shard_fill as ref_shard_fill

# every element size the C copy may see; the float ones also go through _core
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16,
          torch.uint8, torch.int16, torch.int64, torch.complex128]


def random_tensor(numel, dtype, gen, shape=None):
    """Random bytes viewed as `dtype` (NaNs, infs and subnormals included)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    t = raw.view(dtype)
    return t.reshape(shape) if shape is not None else t


def as_bytes(t):
    return t.reshape(-1).view(torch.uint8)


def c_fill(dst, shard_start, srcs, offsets):
    C.shard_fill(dst.data_ptr(), dst.numel(), dst.element_size(), shard_start,
                 [(s.data_ptr(), s.numel(), o) for s, o in zip(srcs, offsets)])


@given(
    numels=st.lists(st.integers(0, 40), max_size=8),
    align=st.sampled_from([0, 1, 4, 8, 16]),
    ws=st.integers(1, 8),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_shard_fill_matches_twin_every_rank(numels, align, ws, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    offsets, flat, shard, _ = plan_layout_lists(numels, align, ws)
    # multi-dim sources: the twin flattens, C sees the contiguous bytes
    srcs = [random_tensor(n, dtype, gen, shape=(n, 1) if n % 2 else None) for n in numels]
    for r in range(ws):
        garbage = random_tensor(shard, dtype, gen)
        want, got = garbage.clone(), garbage.clone()
        ref_shard_fill(want, r * shard, srcs, offsets)
        c_fill(got, r * shard, srcs, offsets)
        assert torch.equal(as_bytes(got), as_bytes(want)), (r, shard)
        if dtype in _core.DTYPE_CODES:  # the dispatch layer takes the C path
            via_core = garbage.clone()
            _core.shard_fill(via_core, r * shard, srcs, offsets)
            assert torch.equal(as_bytes(via_core), as_bytes(want))


@given(
    placements=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 60)), max_size=6),
    shard_start=st.integers(0, 50),
    dst_numel=st.integers(0, 40),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_shard_fill_arbitrary_placements(placements, shard_start, dst_numel, dtype, seed):
    """Unsorted and overlapping sources too: later sources win, as in the twin."""
    gen = torch.Generator().manual_seed(seed)
    srcs = [random_tensor(n, dtype, gen) for n, _ in placements]
    offsets = [o for _, o in placements]
    garbage = random_tensor(dst_numel, dtype, gen)
    want, got = garbage.clone(), garbage.clone()
    ref_shard_fill(want, shard_start, srcs, offsets)
    c_fill(got, shard_start, srcs, offsets)
    assert torch.equal(as_bytes(got), as_bytes(want))


def test_zero_sizes_and_null_addresses():
    C.shard_fill(0, 0, 4, 0, [])
    C.shard_fill(0, 0, 4, 5, [(0, 0, 3)])
    dst = torch.full((4,), 7.0)
    C.shard_fill(dst.data_ptr(), 4, 4, 0, [(0, 0, 1)])
    assert dst.tolist() == [0.0] * 4


def _dst_and_src():
    return torch.full((4,), 7.0), torch.arange(4.0)


@pytest.mark.parametrize(
    "make_args, exc, match",
    [
        (lambda d, s: (d.data_ptr(), -1, 4, 0, []), ValueError, "dst numel"),
        (lambda d, s: (d.data_ptr(), 4, 0, 0, []), ValueError, "elem_size"),
        (lambda d, s: (d.data_ptr(), 4, 4, -1, []), ValueError, "shard_start"),
        (lambda d, s: (0, 4, 4, 0, []), ValueError, "NULL"),
        (lambda d, s: (d.data_ptr(), 4, 4, 0, [(s.data_ptr(), -1, 0)]), ValueError, "numel"),
        (lambda d, s: (d.data_ptr(), 4, 4, 0, [(s.data_ptr(), 4, -2)]), ValueError, "offset"),
        (lambda d, s: (d.data_ptr(), 4, 4, 0, [(s.data_ptr(), 4, 0), (0, 4, 0)]), ValueError,
         "NULL"),
        (lambda d, s: (d.data_ptr(), 4, 4, 0, [(s.data_ptr(), 4, 0, 1)]), ValueError, "src 0"),
        (lambda d, s: (d.data_ptr(), 4, 4, 0, [(s.data_ptr(), 2**62, 2**62)]), OverflowError,
         "overflow"),
        (lambda d, s: (d.data_ptr(), 4, 4, 2**63 - 2, []), OverflowError, "overflow"),
        (lambda d, s: (d.data_ptr(), 2**62, 4, 0, []), OverflowError, "overflow"),
        (lambda d, s: (d.data_ptr(), 4, 4, 0, [s.data_ptr()]), TypeError, "src"),
        (lambda d, s: (d.data_ptr(), 4, 4, 0), TypeError, "5 positional"),
        (lambda d, s: (1.5, 4, 4, 0, []), TypeError, "dst_addr"),
    ],
)
def test_bad_arguments(make_args, exc, match):
    dst, src = _dst_and_src()
    with pytest.raises(exc, match=match):
        C.shard_fill(*make_args(dst, src))
    assert dst.tolist() == [7.0] * 4  # validated before any byte is written


def test_signature():
    sig = inspect.signature(C.shard_fill)
    assert list(sig.parameters) == ["dst_addr", "dst_numel", "elem_size", "shard_start", "srcs"]


@pytest.mark.parametrize("misalign", [0, 3])
def test_large_shard_with_huge_page_advice(misalign):
    """A shard past CF_HUGE_PAGE_ADVICE_BYTES (8 MiB) is advised to use huge pages before
    it is filled (advice only): the bytes are still exactly the twin's, also when the shard
    does not start on a page boundary and the padding is not a whole number of pages."""
    gen = torch.Generator().manual_seed(5)
    numels = [3 << 20, 5, (1 << 20) + 7]  # 4 MiB + ... of fp32: 16 MiB-ish in total
    srcs = [random_tensor(n, torch.float32, gen) for n in numels]
    offsets = [0, (3 << 20) + 100, (3 << 20) + 200]
    n = offsets[-1] + numels[-1] + 1000
    backing = torch.full((n + misalign,), 7.0)
    dst = backing[misalign:]
    assert dst.numel() * 4 >= 8 << 20
    want = torch.full_like(dst, 7.0)
    ref_shard_fill(want, 0, srcs, offsets)
    c_fill(dst, 0, srcs, offsets)
    assert torch.equal(as_bytes(dst), as_bytes(want))
