"""Float helpers shared by the unit tests of the C core's numeric entry points
(scale_cast_add, chunk_pack): random tensors that hit every dtype's edges, and
a bit-level comparison that treats every NaN as equal.

Bit equality with torch is the contract for every non-NaN result, and NaN
exactly where torch gives NaN (torch's own NaN bit patterns differ between its
scalar and vectorised kernels, so payloads are not compared).
"""

import torch

INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}

# values at the edges of every dtype, as float64 (rounded to the tensor dtype
# by torch): overflow to inf, ties, subnormals, double rounding via fp32
SPECIALS = [
    0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), -float("nan"),
    65504.0, 65519.99, 65520.0, -65520.0, 65536.0, 1e5,
    2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-25 + 2.0**-40, 5.96e-8, 1e-8,
    3.3895e38, 3.39e38, 3.4028234663852886e38, 3.4028235677973366e38, 3.5e38,
    1e-38, 1e-40, 1.4e-45, 7e-46, 1e-300, 1e-320, 1e300, -1e300,
    1 + 2.0**-8 + 2.0**-30, 1 + 2.0**-11 + 2.0**-40, 1 + 2.0**-24 + 2.0**-60,
    255.5, 256.5, 2049.0, 2051.0, 1 / 3, -2 / 3, 0.1, 7.3,
]


def random_tensor(numel, dtype, gen, special_frac=0.3):
    """Random bit patterns of `dtype` mixed with SPECIALS."""
    size = torch.empty((), dtype=dtype).element_size()
    t = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen).view(dtype)
    t = t.clone()
    if numel:
        mask = torch.rand(numel, generator=gen) < special_frac
        idx = torch.randint(0, len(SPECIALS), (numel,), generator=gen)
        specials = torch.tensor(SPECIALS, dtype=torch.float64)[idx].to(dtype)
        t[mask] = specials[mask]
        # some "ordinary" gradients too: normal-ish values of moderate range
        mask2 = torch.rand(numel, generator=gen) < 0.3
        t[mask2] = (torch.randn(numel, generator=gen, dtype=torch.float64) * 10).to(dtype)[mask2]
    return t


def assert_same(got, want, context=""):
    assert got.dtype == want.dtype
    gn, wn = torch.isnan(got), torch.isnan(want)
    ints = INT_VIEW[got.element_size()]
    gi, wi = got.view(ints).clone(), want.view(ints).clone()
    gi[gn | wn] = 0
    wi[gn | wn] = 0
    bad = (gn != wn) | (gi != wi)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{context}: {int(bad.sum())} mismatches; first at {i}: "
            f"got {got[i].item()!r} (bits {hex(int(got.view(ints)[i]))}), "
            f"want {want[i].item()!r} (bits {hex(int(want.view(ints)[i]))})"
        )
