"""cfsdp._C.scale_cast_add against its twin cfsdp._ref.scale_cast_add.

The contract is bit equality with torch's op sequence for every non-NaN
result, and NaN exactly where torch gives NaN (torch's own NaN bit patterns
differ between its scalar and vectorised kernels, so payloads are not
compared).
"""

import inspect
import itertools
import zlib

import pytest
import torch
from hypothesis import given, strategies as st

import cfsdp._C as C
from cfsdp import _core
from cfsdp._ref import scale_cast_add as ref_scale_cast_add
from _floats import assert_same, random_tensor

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
PAIRS = list(itertools.product(DTYPES, DTYPES))  # (dst, src)
DIVISORS = [1, 2, 1.5, 3, 0.5]
EXTRA_DIVISORS = [0.1, 7.3, 1.0004, 1.004, 1e-30, 3e38, 1e300, 0.0, -2.0]
def c_call(dst, src, divisor, accumulate):
    C.scale_cast_add(dst.data_ptr(), _core.DTYPE_CODES[dst.dtype], src.data_ptr(),
                     _core.DTYPE_CODES[src.dtype], dst.numel(), float(divisor), accumulate)


def run_both(dst0, src, divisor, accumulate):
    want, got = dst0.clone(), dst0.clone()
    ref_scale_cast_add(want, src, divisor, accumulate)
    c_call(got, src, divisor, accumulate)
    assert_same(got, want, f"{src.dtype}->{dst0.dtype} /{divisor} acc={accumulate}")
    return got


@given(
    pair=st.sampled_from(PAIRS),
    numel=st.integers(0, 300),
    divisor=st.sampled_from(DIVISORS + EXTRA_DIVISORS),
    accumulate=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_twin_random(pair, numel, divisor, accumulate, seed):
    dst_dtype, src_dtype = pair
    gen = torch.Generator().manual_seed(seed)
    src = random_tensor(numel, src_dtype, gen)
    dst0 = random_tensor(numel, dst_dtype, gen)
    run_both(dst0, src, divisor, accumulate)
    via_core = dst0.clone()  # and through the dispatch layer
    _core.scale_cast_add(via_core, src, divisor, accumulate)
    want = dst0.clone()
    ref_scale_cast_add(want, src, divisor, accumulate)
    assert_same(via_core, want, "via _core")


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("divisor", DIVISORS + [0.1, 1.0004])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: str(p).replace("torch.", ""))
def test_matches_twin_grid(pair, divisor, accumulate):
    dst_dtype, src_dtype = pair
    gen = torch.Generator().manual_seed(zlib.crc32(f"{pair}{divisor}{accumulate}".encode()))
    src = random_tensor(2000, src_dtype, gen)
    dst0 = random_tensor(2000, dst_dtype, gen)
    run_both(dst0, src, divisor, accumulate)


@pytest.mark.parametrize("divisor", [1, 3, 0.5])
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_pattern(src_dtype, dst_dtype, divisor):
    """All 65536 bf16 / fp16 values as src, plain write and accumulate."""
    src = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(src_dtype)
    run_both(torch.zeros(src.numel(), dtype=dst_dtype), src, divisor, False)
    gen = torch.Generator().manual_seed(7)
    run_both(random_tensor(src.numel(), dst_dtype, gen), src, divisor, True)


@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_pattern_as_accumulator(dst_dtype):
    """All 65536 dst values, plus every value again: the fp32 add and rounding."""
    dst0 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dst_dtype)
    run_both(dst0, dst0.clone(), 1, True)
    run_both(dst0, dst0.flip(0).clone(), 2, True)
    run_both(dst0, dst0.to(torch.float32) * 1.0001, 1, True)


@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp32_and_fp64_narrowing_edges(dst_dtype):
    """Dense sweep around rounding boundaries of the narrow dtypes."""
    gen = torch.Generator().manual_seed(3)
    centres = torch.tensor([1.0, 65504.0, 65520.0, 2.0**-14, 2.0**-24, 2.0**-25,
                            3.3895313892515355e38, 2.0**-126, 2.0**-133, 1e-45],
                           dtype=torch.float64)
    rel = torch.randn(20000, generator=gen, dtype=torch.float64) * 2.0**-9
    vals = (centres[torch.randint(0, len(centres), (20000,), generator=gen)] * (1 + rel))
    vals = vals * torch.where(torch.rand(20000, generator=gen) < 0.5, -1.0, 1.0).double()
    for src in (vals, vals.to(torch.float32)):
        for divisor in (1, 3):
            run_both(torch.zeros(vals.numel(), dtype=dst_dtype), src, divisor, False)


def test_fp64_to_half_rounds_through_fp32():
    """torch builds bf16/fp16 from a float: fp64 -> fp32 -> half (double rounding)."""
    src = torch.tensor([1 + 2.0**-8 + 2.0**-30, 1 + 2.0**-11 + 2.0**-40], dtype=torch.float64)
    for dst_dtype, i in ((torch.bfloat16, 0), (torch.float16, 1)):
        got = run_both(torch.zeros(2, dtype=dst_dtype), src, 1, False)
        assert got[i].item() == 1.0  # a single rounding would give the next value up


def test_half_division_uses_float_divisor():
    """src / divisor for bf16/fp16 divides by float(divisor), not by half(divisor)."""
    for dtype, x, d, want in ((torch.float16, 2048.0, 1.0004, 2047.0),
                              (torch.bfloat16, 256.0, 1.004, 255.0)):
        src = torch.full((3,), x, dtype=dtype)
        got = run_both(torch.zeros(3, dtype=dtype), src, d, False)
        assert got.tolist() == [want] * 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place(dtype):
    gen = torch.Generator().manual_seed(11)
    x = random_tensor(500, dtype, gen)
    want = x.clone()
    ref_scale_cast_add(want, want.clone(), 3, True)
    got = x.clone()
    c_call(got, got, 3, True)
    assert_same(got, want, "in place")


def test_zero_numel_and_null():
    C.scale_cast_add(0, 0, 0, 1, 0, 2.0, True)
    x = torch.ones(2)
    with pytest.raises(ValueError, match="NULL"):
        C.scale_cast_add(0, 0, x.data_ptr(), 0, 2, 2.0, True)
    with pytest.raises(ValueError, match="NULL"):
        C.scale_cast_add(x.data_ptr(), 0, 0, 0, 2, 2.0, True)
    assert x.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("codes", [(4, 0), (0, 4), (-1, 0), (0, -1), (99, 99)])
def test_unknown_dtype_code(codes):
    x = torch.ones(2)
    with pytest.raises(ValueError, match="dtype code"):
        C.scale_cast_add(x.data_ptr(), codes[0], x.data_ptr(), codes[1], 2, 2.0, False)
    assert x.tolist() == [1.0, 1.0]


def test_bad_numel_and_types():
    x = torch.ones(2)
    with pytest.raises(ValueError, match="numel"):
        C.scale_cast_add(x.data_ptr(), 0, x.data_ptr(), 0, -1, 2.0, False)
    with pytest.raises(OverflowError):
        C.scale_cast_add(x.data_ptr(), 1, x.data_ptr(), 1, 2**62, 2.0, False)
    with pytest.raises(TypeError):
        C.scale_cast_add(x.data_ptr(), 0, x.data_ptr(), 0, 2, "2", False)
    with pytest.raises(TypeError):
        C.scale_cast_add(x.data_ptr(), 0, x.data_ptr(), 0, 2, 2.0)
    assert x.tolist() == [1.0, 1.0]


def test_signature():
    sig = inspect.signature(C.scale_cast_add)
    assert list(sig.parameters) == ["dst_addr", "dst_dtype_code", "src_addr",
                                    "src_dtype_code", "numel", "divisor", "accumulate"]
    assert C.DTYPE_FP32 == 0 and C.DTYPE_FP64 == 1 and C.DTYPE_BF16 == 2 and C.DTYPE_FP16 == 3
    assert {v: k for k, v in _core.DTYPE_CODES.items()}[C.DTYPE_BF16] is torch.bfloat16
