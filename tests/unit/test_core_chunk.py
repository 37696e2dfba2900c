"""cfsdp._C.chunk_pack / chunk_unpack (FSDP2 copy-in / copy-out) against their twins
in cfsdp._ref.chunk, and both against an oracle built the way torch's FSDP2 lays out
its all-gather: per rank, the concatenation of each parameter's ``torch.chunk(p, W,
dim=d)`` chunk, contiguous, padded with zero rows to ``ceil(d0 / W)`` rows on dim 0
(``Shard(d)`` with ``d > 0`` needs an even split: no padding).

Byte copies (unpack, and pack without cast or divide) must match bit for bit; casts and
divides follow scale_cast_add's contract (bit equality except NaN payloads).
"""

import inspect
import itertools
import math
import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, strategies as st

import cfsdp._C as C
from cfsdp import _core
from cfsdp._ref import chunk_pack as ref_pack, chunk_unpack as ref_unpack
from cfsdp._ref import scale_cast_add as ref_scale_cast_add
from cfsdp._ref.chunk import check_plan
from _floats import assert_same, random_tensor

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
PAIRS = list(itertools.product(DTYPES, DTYPES))  # (dst, src)
NAMED_CASTS = [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
               (torch.float32, torch.float16)]  # (dst, src): fp32->bf16, bf16->fp32, fp16->fp32
DIVISORS = [1, 2, 3, 0.5, 1.5, 7.3]
# byte copies: any element size crosses chunk_unpack (the float ones also via _core)
BYTE_DTYPES = DTYPES + [torch.uint8, torch.int64, torch.complex128]


@dataclass
class Unit:
    shapes: list  # parameter shapes
    world_size: int
    plan: list  # (nat_off, numel, chunk_numel, shard_off, outer) per parameter
    shard_numel: int
    natural_numel: int
    shard_gaps: list  # zeros before each chunk (and after the last) in a shard
    dims: list  # the dim each parameter is sharded on (Shard(d))


def plan_entry(shape, dim, world_size, nat_off, shard_off):
    """A parameter's plan entry, sharded on ``dim``, as fully_shard builds it."""
    outer, rows, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:])
    chunk = outer * -(-rows // world_size) * inner
    return (nat_off, math.prod(shape), chunk, shard_off, max(outer, 1))


def make_unit(shapes, world_size, nat_gaps, shard_gaps, dims=None):
    """The FSDP2 plan of `shapes` (sharded on `dims`, default all 0), with `nat_gaps[i]`
    elements before parameter i in the natural buffer (`nat_gaps[-1]` after the last),
    and likewise `shard_gaps`."""
    dims = [0] * len(shapes) if dims is None else list(dims)
    plan, nat, shard = [], 0, 0
    for shape, dim, ng, sg in zip(shapes, dims, nat_gaps, shard_gaps):
        nat, shard = nat + ng, shard + sg
        plan.append(plan_entry(shape, dim, world_size, nat, shard))
        nat, shard = nat + plan[-1][1], shard + plan[-1][2]
    return Unit(list(shapes), world_size, plan, shard + shard_gaps[-1],
                nat + nat_gaps[-1], list(shard_gaps), dims)


@st.composite
def sharded_shape(draw, world_size):
    """(shape, dim): 1-D to 3-D; dim 0 with d0 from 0 to 7 against world sizes 1..5 (d0 < W:
    ranks with no rows, d0 = 1, exact multiples), or a dim d > 0 (Shard(d)) whose size W
    divides (torch requires it), the dims before it anything (0 too: an empty parameter)."""
    shape = [draw(st.integers(0, 7))] + draw(st.lists(st.integers(1, 3), max_size=2))
    dim = draw(st.integers(0, len(shape) - 1))
    if dim > 0:
        shape[dim] = world_size * draw(st.integers(0, 3))
    return tuple(shape), dim


@st.composite
def units(draw, max_params=5):
    world_size = draw(st.integers(1, 5))
    sharded = draw(st.lists(sharded_shape(world_size), max_size=max_params))
    n = len(sharded) + 1
    nat_gaps = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    shard_gaps = (draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
                  if draw(st.booleans()) else [0] * n)
    return make_unit([s for s, _ in sharded], world_size, nat_gaps, shard_gaps,
                     [d for _, d in sharded])


@st.composite
def rank_ranges(draw, world_size):
    lo = draw(st.integers(0, world_size))
    return lo, draw(st.integers(lo, world_size))


def place(unit, params, background):
    """The natural buffer: `background` with each parameter at its natural offset."""
    natural = background.clone()
    for (off, numel, *_), p in zip(unit.plan, params):
        natural[off : off + numel] = p.reshape(-1)
    return natural


def fsdp2_gathered(unit, params, dtype):
    """The rank-major all-gather output as FSDP2 builds it: per rank, each parameter's
    ``torch.chunk(p, W, dim=d)`` chunk, contiguous, padded with zeros to ceil(size_d / W)
    along d (empty when the rank holds nothing), in order, with the unit's shard gaps as
    zeros."""
    w, ranks = unit.world_size, []
    for k in range(w):
        pieces = []
        for p, d, gap in zip(params, unit.dims, unit.shard_gaps):
            chunks = torch.chunk(p, w, dim=d)
            part = chunks[k] if k < len(chunks) else p.narrow(d, 0, 0)
            pad_shape = list(p.shape)
            pad_shape[d] = -(-p.shape[d] // w) - part.shape[d]
            padded = torch.cat([part, p.new_zeros(pad_shape)], dim=d)
            pieces += [torch.zeros(gap, dtype=dtype), padded.reshape(-1)]
        ranks.append(torch.cat(pieces + [torch.zeros(unit.shard_gaps[-1], dtype=dtype)]))
    return torch.cat(ranks)


def natural_tags(unit):
    """Each parameter as 1 + its natural indices (int64): in a gathered layout, 0 marks
    padding and t > 0 natural element t - 1."""
    return [torch.arange(off + 1, off + 1 + numel).reshape(shape)
            for (off, numel, *_), shape in zip(unit.plan, unit.shapes)]


def as_bytes(t):
    return t.reshape(-1).view(torch.uint8)


def c_unpack(dst, src, unit, max_threads=1):
    C.chunk_unpack(dst.data_ptr(), dst.numel(), src.data_ptr(), src.numel(),
                   dst.element_size(), unit.plan, unit.world_size, unit.shard_numel,
                   max_threads)


def c_pack(dst, src, unit, divisor=1.0, ranks=None, max_threads=1):
    lo, hi = (0, unit.world_size) if ranks is None else ranks
    C.chunk_pack(dst.data_ptr(), dst.numel(), _core.DTYPE_CODES[dst.dtype], src.data_ptr(),
                 src.numel(), _core.DTYPE_CODES[src.dtype], unit.plan, unit.world_size,
                 unit.shard_numel, lo, hi, float(divisor), max_threads)


def pack_all_ways(unit, natural, dst_dtype, divisor, ranks, gen, max_threads=1):
    """chunk_pack through C, the twin and _core over the same garbage; checks they agree
    and returns the twin's result."""
    lo, hi = ranks
    garbage = random_tensor((hi - lo) * unit.shard_numel, dst_dtype, gen)
    want, got, via_core = garbage.clone(), garbage.clone(), garbage.clone()
    ref_pack(want, natural, unit.plan, unit.world_size, unit.shard_numel, divisor, ranks)
    c_pack(got, natural, unit, divisor, ranks, max_threads)
    _core.chunk_pack(via_core, natural, unit.plan, unit.world_size, unit.shard_numel,
                     divisor=divisor, ranks=ranks)
    check = assert_bytes if dst_dtype == natural.dtype and divisor == 1 else assert_same
    check(got, want, "C vs twin")
    check(via_core, want, "_core vs twin")
    return want


def assert_bytes(got, want, context=""):
    assert torch.equal(as_bytes(got), as_bytes(want)), context


def expected_pack(unit, params, dst_dtype, divisor, ranks):
    """The oracle: FSDP2's gathered layout of cast(p / divisor), ranks lo..hi-1."""
    lo, hi = ranks
    scaled = [(p / divisor if divisor != 1 else p).to(dst_dtype) for p in params]
    return fsdp2_gathered(unit, scaled, dst_dtype)[lo * unit.shard_numel : hi * unit.shard_numel]


@given(unit=units(), pair=st.sampled_from(PAIRS), divisor=st.sampled_from(DIVISORS),
       data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_pack_matches_twin_and_fsdp2(unit, pair, divisor, data, seed):
    dst_dtype, src_dtype = pair
    ranks = data.draw(rank_ranges(unit.world_size))
    gen = torch.Generator().manual_seed(seed)
    params = [random_tensor(math.prod(s), src_dtype, gen).reshape(s) for s in unit.shapes]
    natural = place(unit, params, random_tensor(unit.natural_numel, src_dtype, gen))
    got = pack_all_ways(unit, natural, dst_dtype, divisor, ranks, gen)
    want = expected_pack(unit, params, dst_dtype, divisor, ranks)
    check = assert_bytes if dst_dtype == src_dtype and divisor == 1 else assert_same
    check(got, want, "vs FSDP2 layout")


@given(unit=units(), dtype=st.sampled_from(BYTE_DTYPES), seed=st.integers(0, 2**31 - 1))
def test_unpack_matches_twin_and_fsdp2(unit, dtype, seed):
    """Padding holds garbage (it must not be read); the natural gaps keep theirs."""
    gen = torch.Generator().manual_seed(seed)
    params = [random_tensor(math.prod(s), dtype, gen).reshape(s) for s in unit.shapes]
    gathered = fsdp2_gathered(unit, params, dtype)
    padding = fsdp2_gathered(unit, natural_tags(unit), torch.int64) == 0
    gathered[padding] = random_tensor(int(padding.sum()), dtype, gen)
    background = random_tensor(unit.natural_numel, dtype, gen)
    got, want = background.clone(), background.clone()
    c_unpack(got, gathered, unit)
    ref_unpack(want, gathered, unit.plan, unit.world_size, unit.shard_numel)
    assert_bytes(got, want, "C vs twin")
    assert_bytes(got, place(unit, params, background), "vs FSDP2 layout")
    if dtype in _core.DTYPE_CODES:
        via_core = background.clone()
        _core.chunk_unpack(via_core, gathered, unit.plan, unit.world_size, unit.shard_numel)
        assert_bytes(via_core, want, "_core vs twin")


@given(unit=units(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_unpack_of_pack_is_identity(unit, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    natural = random_tensor(unit.natural_numel, dtype, gen)
    gathered = torch.empty(unit.world_size * unit.shard_numel, dtype=dtype)
    _core.chunk_pack(gathered, natural, unit.plan, unit.world_size, unit.shard_numel)
    background = random_tensor(unit.natural_numel, dtype, gen)
    back = background.clone()
    _core.chunk_unpack(back, gathered, unit.plan, unit.world_size, unit.shard_numel)
    inside = torch.zeros(unit.natural_numel, dtype=torch.bool)
    for off, numel, *_ in unit.plan:
        inside[off : off + numel] = True
    assert torch.equal(as_bytes(back[inside]), as_bytes(natural[inside]))  # the params
    assert torch.equal(as_bytes(back[~inside]), as_bytes(background[~inside]))  # gaps


# a fixed unit with every awkward case: d0 < W, d0 = 1, d0 = 0, 1-D / 2-D / 3-D, gaps,
# Shard(1) and Shard(2) next to Shard(0) (blocks of 3 and of 1 elements), an empty Shard(1)
FIXED = make_unit([(5, 3), (1,), (2, 2, 3), (2, 8, 3), (0, 4), (7,), (3, 4), (4, 1, 2),
                   (2, 3, 4)], 4,
                  [2, 0, 1, 0, 3, 0, 1, 1, 0, 2], [0, 1, 0, 1, 0, 2, 0, 0, 1, 1],
                  [0, 0, 0, 1, 1, 0, 1, 0, 2])


@pytest.mark.parametrize("divisor", [1, 2, 3, 0.1])
@pytest.mark.parametrize("pair", NAMED_CASTS + [(d, d) for d in DTYPES],
                         ids=lambda p: f"{p[1]}->{p[0]}".replace("torch.", ""))
def test_pack_casts_round_as_scale_cast_add(pair, divisor):
    """Every rank range of a fixed unit; the data equals scale_cast_add's result on the
    natural buffer, and every element outside the data is +0."""
    dst_dtype, src_dtype = pair
    gen = torch.Generator().manual_seed(17)
    unit = FIXED
    params = [random_tensor(math.prod(s), src_dtype, gen).reshape(s) for s in unit.shapes]
    natural = place(unit, params, random_tensor(unit.natural_numel, src_dtype, gen))
    cast = torch.empty(unit.natural_numel, dtype=dst_dtype)
    ref_scale_cast_add(cast, natural, divisor, False)
    tag_layout = fsdp2_gathered(unit, natural_tags(unit), torch.int64)
    S = unit.shard_numel
    for lo, hi in [(0, 4), (0, 1), (1, 2), (3, 4), (1, 3), (2, 2)]:
        got = pack_all_ways(unit, natural, dst_dtype, divisor, (lo, hi), gen)
        assert_same(got, expected_pack(unit, params, dst_dtype, divisor, (lo, hi)), "oracle")
        tags = tag_layout[lo * S : hi * S]
        assert_same(got[tags > 0], cast[tags[tags > 0] - 1], "vs scale_cast_add")
        assert torch.equal(as_bytes(got[tags == 0]), as_bytes(torch.zeros_like(got[tags == 0])))


def big_unit(world_size=3):
    """About 1.9 M elements per all-gather, odd sizes so thread borders fall inside
    chunks, blocks (Shard(1): blocks of 400 or 300 elements, and of 4 or 3) and padding:
    6 bytes moved per element (fp32 -> bf16) is above CHUNK_PARALLEL_BYTES already."""
    return make_unit([(1201, 1001), (333, 1003), (7,), (2, 5), (301, 1200), (3001, 12)],
                     world_size, [3, 1, 0, 2, 5, 0, 1], [0, 1, 0, 3, 3, 1, 2],
                     [0, 0, 0, 0, 1, 1])


def test_threaded_path_matches_twin():
    unit = big_unit()
    n = unit.world_size * unit.shard_numel
    assert n * 6 > C.CHUNK_PARALLEL_BYTES and C.MAX_THREADS >= 2
    gen = torch.Generator().manual_seed(5)
    natural = random_tensor(unit.natural_numel, torch.float32, gen)
    for dst_dtype, divisor in ((torch.float32, 1), (torch.bfloat16, 3)):
        want = torch.empty(n, dtype=dst_dtype)
        ref_pack(want, natural, unit.plan, unit.world_size, unit.shard_numel, divisor)
        for threads in (1, 2, C.MAX_THREADS):
            got = torch.full((n,), 9.0, dtype=dst_dtype)
            c_pack(got, natural, unit, divisor, max_threads=threads)
            assert_same(got, want, f"pack, {threads} threads")
    background = random_tensor(unit.natural_numel, torch.float32, gen)
    want = background.clone()
    gathered = random_tensor(n, torch.float32, gen)
    ref_unpack(want, gathered, unit.plan, unit.world_size, unit.shard_numel)
    for threads in (1, 2, C.MAX_THREADS):
        got = background.clone()
        c_unpack(got, gathered, unit, max_threads=threads)
        assert_bytes(got, want, f"unpack, {threads} threads")


def test_one_rank_shard_at_init():
    """ranks=(k, k+1) builds rank k's shard: the k-th row of the full layout."""
    unit = big_unit(world_size=4)
    gen = torch.Generator().manual_seed(6)
    natural = random_tensor(unit.natural_numel, torch.float32, gen)
    full = torch.empty(unit.world_size * unit.shard_numel)
    _core.chunk_pack(full, natural, unit.plan, unit.world_size, unit.shard_numel)
    for k in range(unit.world_size):
        shard = torch.empty(unit.shard_numel)
        _core.chunk_pack(shard, natural, unit.plan, unit.world_size, unit.shard_numel,
                         ranks=(k, k + 1))
        assert_bytes(shard, full[k * unit.shard_numel : (k + 1) * unit.shard_numel])


def test_non_contiguous_takes_the_twin():
    """Strided 1-D views go through the twin's torch ops, with the same result."""
    unit = FIXED
    gen = torch.Generator().manual_seed(8)
    natural = random_tensor(unit.natural_numel, torch.float32, gen)
    n = unit.world_size * unit.shard_numel
    want = torch.empty(n, dtype=torch.bfloat16)
    c_pack(want, natural, unit, 3)
    strided_src = torch.empty(2 * unit.natural_numel)[::2]
    strided_src.copy_(natural)
    got = torch.empty(2 * n, dtype=torch.bfloat16)[::2]
    _core.chunk_pack(got, strided_src, unit.plan, unit.world_size, unit.shard_numel, 3)
    assert_same(got.contiguous(), want)
    back = torch.zeros(2 * unit.natural_numel)[::2]
    gathered = torch.empty(n)
    c_pack(gathered, natural, unit)
    _core.chunk_unpack(back, gathered, unit.plan, unit.world_size, unit.shard_numel)
    want_back = torch.zeros(unit.natural_numel)
    c_unpack(want_back, gathered, unit)
    assert_bytes(back.contiguous(), want_back)


def test_core_rejects_misuse():
    x, y = torch.zeros(4), torch.zeros(2, 2)
    with pytest.raises(AssertionError, match="1-D"):
        _core.chunk_pack(y, x, [], 1, 4)
    with pytest.raises(AssertionError, match="1-D"):
        _core.chunk_unpack(x, y, [], 1, 4)
    with pytest.raises(AssertionError, match="dtype"):
        _core.chunk_unpack(x, x.to(torch.float64), [], 1, 4)


# (plan, world_size, shard_numel, natural_numel, gathered_numel, ranks, message start)
GOOD = [(0, 6, 2, 0, 1), (6, 4, 2, 2, 1)]  # W = 3, S = 4, natural 10
BAD_PLANS = [
    (GOOD, 0, 4, 10, 0, (0, 0), "world_size must be >= 1, got 0"),
    (GOOD, 3, -1, 10, 0, (0, 3), "shard_numel must be >= 0, got -1"),
    (GOOD, 3, 4, 10, 4, (2, 1), "ranks (2, 1) must satisfy"),
    (GOOD, 3, 4, 10, 4, (-1, 0), "ranks (-1, 0) must satisfy"),
    (GOOD, 3, 4, 10, 16, (0, 4), "ranks (0, 4) must satisfy"),
    (GOOD, 3, 4, 10, 11, (0, 3), "gathered buffer has 11 elements, expected 12"),
    ([(0, 6, 2, 0, 1), (6, 4, -2, 2, 1)], 3, 4, 10, 12, (0, 3), "plan param 1: nat_off, numel"),
    ([(0, 6, 2, 0, 1), (-6, 4, 2, 2, 1)], 3, 4, 10, 12, (0, 3), "plan param 1: nat_off, numel"),
    ([(0, 6, 2, 0, 1), (6, 4, 1, 2, 1)], 3, 4, 10, 12, (0, 3), "plan param 1: numel 4 does not fit"),
    ([(0, 6, 2, 0, 1), (6, 4, 2, 3, 1)], 3, 4, 10, 12, (0, 3), "plan param 1: shard segment of 2 elements at 3"),
    ([(0, 6, 2, 1, 1), (6, 4, 2, 2, 1)], 3, 4, 10, 12, (0, 3), "plan param 1: shard segment at 2 overlaps"),
    ([(0, 6, 2, 0, 1), (7, 4, 2, 2, 1)], 3, 4, 10, 12, (0, 3), "plan param 1: natural segment of 4 elements at 7"),
    ([(0, 6, 2, 0, 1), (5, 4, 2, 2, 1)], 3, 4, 10, 12, (0, 3), "plan param 1: natural segment at 5 overlaps"),
    ([(0, 6, 2, 0, 1), (0, 0, 0, 9, 1)], 3, 4, 10, 12, (0, 3), "plan param 1: shard segment of 0 elements at 9"),
    # the blocks of a Shard(d > 0) chunk: outer >= 1, whole blocks, every rank a full chunk
    ([(0, 6, 2, 0, 0), (6, 4, 2, 2, 1)], 3, 4, 10, 12, (0, 3), "plan param 0: outer must be >= 1, got 0"),
    ([(0, 6, 2, 0, -2)], 3, 4, 10, 12, (0, 3), "plan param 0: outer must be >= 1, got -2"),
    ([(0, 6, 2, 0, 2), (6, 4, 2, 2, 2)], 3, 4, 10, 12, (0, 3),
     "plan param 1: a chunk of 2 blocks (outer) needs numel == world_size x chunk_numel"),
    ([(0, 6, 2, 0, 3)], 3, 4, 10, 12, (0, 3), "plan param 0: a chunk of 3 blocks (outer)"),
    ([(0, 0, 0, 0, 5), (0, 6, 2, 0, 4)], 3, 4, 10, 12, (0, 3), "plan param 1: a chunk of 4 blocks"),
    # world_size * chunk_numel overflows int64 (so every numel fits); the chunk does not
    ([(0, 0, 2**62, 0, 1)], 4, 2**62 - 1, 10, 0, (0, 0), "plan param 0: shard segment of 4611686"),
    ([(0, 6, 2, 0, 1), (2**62, 2**62, 2**60, 0, 1)], 3, 4, 10, 12, (0, 3),
     "plan param 1: numel 4611686018427387904 does not fit"),
    # ... and with blocks it cannot be numel
    ([(0, 2**62, 2**62, 0, 2)], 4, 2**62, 10, 0, (0, 0),
     "plan param 0: a chunk of 2 blocks (outer) needs"),
    # nat_off + numel overflows int64
    ([(0, 2, 1, 0, 1), (2**62, 2**62, 2**61, 1, 1)], 2, 2**61 + 1, 2, 2**62 + 2, (0, 2),
     "plan param 1: natural segment of 4611686018427387904 elements"),
]


@pytest.mark.parametrize("case", BAD_PLANS, ids=lambda c: c[-1][:36])
def test_bad_plans_raise_the_same_value_error(case):
    """C and the twin reject the plan with the same message, naming the parameter
    index, before writing anything."""
    plan, w, s, natural_numel, gathered_numel, ranks, match = case
    with pytest.raises(ValueError) as twin_err:
        check_plan(plan, w, s, natural_numel, gathered_numel, ranks)
    assert str(twin_err.value).startswith(match), str(twin_err.value)
    # real buffers where they are small; else a fake address, as C must touch nothing.
    # The gathered side is declared bf16 (elem_size 2) so 2**62 elements fit in size_t.
    natural = torch.full((natural_numel,), 7.0)
    small = gathered_numel <= 64
    gathered = torch.full((gathered_numel if small else 1,), 7.0, dtype=torch.bfloat16)
    g_addr, (lo, hi) = gathered.data_ptr() if small else 8, ranks
    with pytest.raises(ValueError) as c_err:
        C.chunk_pack(g_addr, gathered_numel, C.DTYPE_BF16, natural.data_ptr(), natural_numel,
                     C.DTYPE_FP32, plan, w, s, lo, hi, 1.0, 4)
    assert str(c_err.value) == str(twin_err.value)
    if ranks == (0, w):  # unpack checks the same plan over all ranks
        with pytest.raises(ValueError) as c_err:
            C.chunk_unpack(natural.data_ptr(), natural_numel, g_addr, gathered_numel, 2, plan,
                           w, s, 4)
        assert str(c_err.value) == str(twin_err.value)
    assert (natural == 7).all() and (gathered == 7).all()  # nothing written
    if small:  # and through _core (C or the twin, per CFSDP_IMPL)
        with pytest.raises(ValueError, match="^" + re.escape(match)):
            _core.chunk_pack(gathered, natural, plan, w, s, ranks=ranks)


def test_zero_sizes_and_null_addresses():
    C.chunk_unpack(0, 0, 0, 0, 4, [], 1, 0, 1)
    C.chunk_pack(0, 0, 0, 0, 0, 0, [], 3, 0, 0, 3, 1.0, 1)
    C.chunk_pack(0, 0, 0, 0, 0, 0, [(0, 0, 0, 0, 1)] * 3, 2, 0, 0, 2, 2.0, 1)  # all empty
    # empty Shard(d) chunks of any number of blocks: nothing visited (2**62 would never end)
    C.chunk_pack(0, 0, 0, 0, 0, 0, [(0, 0, 0, 0, 2**62)] * 2, 2, 0, 0, 2, 2.0, 1)
    C.chunk_unpack(0, 0, 0, 0, 4, [(0, 0, 0, 0, 2**62)] * 2, 2, 0, 1)
    g = torch.full((6,), 7.0)
    C.chunk_pack(g.data_ptr(), 6, 0, 0, 0, 0, [(0, 0, 0, 1, 1)], 3, 2, 0, 3, 1.0, 1)
    assert g.tolist() == [0.0] * 6  # every element of a shard is written


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda n, g: C.chunk_unpack(n.data_ptr(), 4, g.data_ptr(), 4, 0, [], 1, 4, 1),
         ValueError, "elem_size"),
        (lambda n, g: C.chunk_unpack(0, 4, g.data_ptr(), 4, 4, [], 1, 4, 1), ValueError,
         "natural buffer: NULL"),
        (lambda n, g: C.chunk_unpack(n.data_ptr(), 4, 0, 4, 4, [], 1, 4, 1), ValueError,
         "gathered buffer: NULL"),
        (lambda n, g: C.chunk_unpack(n.data_ptr(), -1, g.data_ptr(), 4, 4, [], 1, 4, 1),
         ValueError, "natural buffer numel"),
        (lambda n, g: C.chunk_unpack(n.data_ptr(), 2**62, g.data_ptr(), 4, 4, [], 1, 4, 1),
         OverflowError, "too large"),
        (lambda n, g: C.chunk_pack(g.data_ptr(), 4, 4, n.data_ptr(), 4, 0, [], 1, 4, 0, 1, 1.0,
                                   1), ValueError, "dtype code"),
        (lambda n, g: C.chunk_pack(g.data_ptr(), 4, 0, n.data_ptr(), 4, -1, [], 1, 4, 0, 1, 1.0,
                                   1), ValueError, "dtype code"),
        (lambda n, g: C.chunk_pack(g.data_ptr(), 4, 0, n.data_ptr(), 4, 0, [], 2, 2**62, 0, 2,
                                   1.0, 1), OverflowError, "overflows"),
        (lambda n, g: C.chunk_unpack(n.data_ptr(), 4, g.data_ptr(), 4, 4, [(0, 1, 1)], 1, 4, 1),
         ValueError, "plan param 0 must be"),
        (lambda n, g: C.chunk_unpack(n.data_ptr(), 4, g.data_ptr(), 4, 4, [(0, 4, 4, 0)], 1, 4,
                                     1), ValueError, r"plan param 0 must be \(nat_off, numel, "
         r"chunk_numel, shard_off, outer\), got 4 items"),
        (lambda n, g: C.chunk_unpack(n.data_ptr(), 4, g.data_ptr(), 4, 4, [0], 1, 4, 1),
         TypeError, "plan entry"),
        (lambda n, g: C.chunk_unpack(n.data_ptr(), 4, g.data_ptr(), 4, 4, 5, 1, 4, 1),
         TypeError, "plan must be"),
        (lambda n, g: C.chunk_unpack(n.data_ptr(), 4, g.data_ptr(), 4, 4, [(0, 1.5, 1, 0, 1)], 1,
                                     4, 1), TypeError, "numel"),
        (lambda n, g: C.chunk_unpack(n.data_ptr(), 4, g.data_ptr(), 4, 4, [], 1, 4),
         TypeError, "9 positional"),
        (lambda n, g: C.chunk_pack(g.data_ptr(), 4, 0, n.data_ptr(), 4, 0, [], 1, 4, 0, 1, "x",
                                   1), TypeError, "real number"),
    ],
)
def test_bad_arguments(call, exc, match):
    natural, gathered = torch.full((4,), 7.0), torch.full((4,), 7.0)
    with pytest.raises(exc, match=match):
        call(natural, gathered)
    assert natural.tolist() == [7.0] * 4 and gathered.tolist() == [7.0] * 4


def test_signatures():
    assert list(inspect.signature(C.chunk_unpack).parameters) == [
        "dst_addr", "dst_numel", "src_addr", "src_numel", "elem_size", "plan", "world_size",
        "shard_numel", "max_threads"]
    assert list(inspect.signature(C.chunk_pack).parameters) == [
        "dst_addr", "dst_numel", "dst_dtype_code", "src_addr", "src_numel", "src_dtype_code",
        "plan", "world_size", "shard_numel", "rank_lo", "rank_hi", "divisor", "max_threads"]
    assert C.CHUNK_PARALLEL_BYTES == 4 << 20 and C.MAX_THREADS == 4
