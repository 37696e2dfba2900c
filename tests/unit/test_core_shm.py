"""cfsdp._C's shared-memory collectives (csrc/shm.c on csrc/queue.c), in one process.

The C API lets one process map a segment several times, as different ranks, each view
with its own worker thread; so these tests run every collective at world sizes 2, 3 and
4 inside the unit suite (and under ASan/UBSan in ``make sanitize``) and compare it with
torch: all-gather and broadcast byte for byte, reduce-scatter and all-reduce bit for bit
with the sum kernel's twin ``cfsdp._ref.shm_reduce`` over the ranks in rank order (the
kernel itself is checked against the twin with hypothesis here too).  Small slots make
every size above a few dozen elements run in several pieces, through both halves of the
double buffer.  Failure paths: a stalled rank (timeout naming it on the waiting ranks,
then the shared failure flag failing the others at once), a poisoned group, ranks that
disagree about the collective, a closed group, bad arguments.

The distributed twin (the process group) is compared in tests/distributed/test_shm.py.
"""

import array
import itertools
import os
import secrets
import threading
import time

import pytest
import torch
from hypothesis import given, strategies as st

import cfsdp._C as C
from cfsdp import _core
from cfsdp._ref import shm_memcpy as ref_memcpy, shm_reduce as ref_reduce
from _floats import assert_same, random_tensor



def test_shared_memory_is_built():
    """cfsdp builds its shared-memory collectives on every POSIX system with pthreads (the
    only systems its C core targets); a build without them fails here rather than skipping
    the tests below."""
    assert C.SHM_AVAILABLE == 1

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
CODE = _core.DTYPE_CODES
SCALES = [1.0, 0.5, 0.25, 1 / 3, 7.3, -2.0]


def shm_entries():
    """This process's test segments in /dev/shm (their names carry our pid): another cfsdp
    job on the same host must not fail these tests."""
    mine = f"cfsdp-test-{os.getpid()}-"
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(mine))


class Groups:
    """`world` views of one fresh segment (rank 0 creates it), all attached."""

    def __init__(self, world, slot_per_rank=256, timeout=20.0, attach=None):
        self.name = f"/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}"
        self.world = world
        slot = slot_per_rank * world
        attach = range(world) if attach is None else attach
        self.views = [C.ShmGroup(self.name, r == 0, world, r, slot, timeout, "unit",
                                 [10 + q for q in range(world)]) for r in attach]

    def wait_attached(self):
        for g in self.views:
            g.wait_attached()

    def close(self):
        for g in self.views:
            g.close()


@pytest.fixture
def groups():
    made = []

    def make(*args, **kwargs):
        g = Groups(*args, **kwargs)
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()
    assert shm_entries() == []


# ----------------------------------------------------------------------------------------
# the sum kernel against its twin
# ----------------------------------------------------------------------------------------


@given(dtype=st.sampled_from(DTYPES), k=st.integers(1, 5), numel=st.integers(0, 1500),
       scale=st.sampled_from(SCALES), inplace=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_reduce_matches_twin(dtype, k, numel, scale, inplace, seed):
    gen = torch.Generator().manual_seed(seed)
    srcs = [random_tensor(numel, dtype, gen) for _ in range(k)]
    want = torch.empty(numel, dtype=dtype)
    ref_reduce(want, srcs, scale)
    got = srcs[0].clone() if inplace else random_tensor(numel, dtype, gen)
    C.shm_reduce(got.data_ptr(), [got.data_ptr()] + [s.data_ptr() for s in srcs[1:]]
                 if inplace else [s.data_ptr() for s in srcs], numel, CODE[dtype],
                 scale, 1)
    assert_same(got, want, f"C vs twin ({dtype}, k={k}, scale={scale})")


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_is_one_rounding_of_a_wide_sum(dtype):
    """The oracle in torch terms: float32 (float64) sum in order, times scale, cast once."""
    gen = torch.Generator().manual_seed(3)
    srcs = [(torch.randn(999, generator=gen, dtype=torch.float64) * 100).to(dtype)
            for _ in range(3)]
    acc_t = torch.float64 if dtype == torch.float64 else torch.float32
    want = ((srcs[0].to(acc_t) + srcs[1].to(acc_t) + srcs[2].to(acc_t)) * 0.3).to(dtype)
    got = torch.empty(999, dtype=dtype)
    _core.shm_reduce(got, srcs, 0.3)
    assert_same(got, want)


def test_reduce_and_memcpy_threaded_paths():
    n = (C.CHUNK_PARALLEL_BYTES // 4) + 4097  # above the threading threshold
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        srcs = [random_tensor(n, dtype, gen) for _ in range(3)]
        want = torch.empty(n, dtype=dtype)
        ref_reduce(want, srcs, 0.5)
        for threads in (1, 2, C.MAX_THREADS):
            got = torch.empty(n, dtype=dtype)
            C.shm_reduce(got.data_ptr(), [s.data_ptr() for s in srcs], n, CODE[dtype], 0.5,
                         threads)
            assert_same(got, want, f"{threads} threads")
    src = torch.randint(0, 255, (3 * C.CHUNK_PARALLEL_BYTES + 5,), dtype=torch.uint8)
    for threads in (1, 3):
        dst = torch.zeros_like(src)
        C.shm_memcpy(dst.data_ptr(), src.data_ptr(), src.numel(), threads)
        assert torch.equal(dst, src)
    dst, want = torch.zeros(77), torch.zeros(77)
    src = torch.randn(77)
    _core.shm_memcpy(dst, src)
    ref_memcpy(want, src)
    assert torch.equal(dst, want) and torch.equal(dst, src)


def test_kernel_errors():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="dtype code"):
        C.shm_reduce(x.data_ptr(), [x.data_ptr()], 4, 9, 1.0, 1)
    with pytest.raises(ValueError, match="number of sources"):
        C.shm_reduce(x.data_ptr(), [], 4, 0, 1.0, 1)
    with pytest.raises(ValueError, match="NULL"):
        C.shm_reduce(x.data_ptr(), [x.data_ptr(), 0], 4, 0, 1.0, 1)
    with pytest.raises(ValueError, match="numel"):
        C.shm_reduce(x.data_ptr(), [x.data_ptr()], -1, 0, 1.0, 1)
    with pytest.raises(ValueError, match="nbytes"):
        C.shm_memcpy(x.data_ptr(), x.data_ptr(), -1, 1)
    with pytest.raises(ValueError, match="NULL"):
        C.shm_memcpy(0, x.data_ptr(), 4, 1)
    for chars in ("7", b"7", bytearray(b"7")):  # iterate as 1-item sequences: b"7" is 55
        with pytest.raises(TypeError, match="sequence of int addresses"):
            C.shm_reduce(x.data_ptr(), chars, 1, 0, 1.0, 1)
    C.shm_reduce(0, [0], 0, 0, 1.0, 1)  # empty: nothing touched
    C.shm_memcpy(0, 0, 0, 1)


# ----------------------------------------------------------------------------------------
# the collectives, W views of one segment in this process
# ----------------------------------------------------------------------------------------

SIZES = [0, 1, 13, 67, 1001]  # 1001 spans many pieces at every dtype with 256 B per rank


def run_all(works):
    for w in works:
        w.wait()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_match_torch(groups, world):
    gs = groups(world)
    gs.wait_attached()
    assert shm_entries() == []  # unlinked as soon as everyone attached
    gen = torch.Generator().manual_seed(world)
    views = gs.views
    for dtype, n in itertools.product(DTYPES, SIZES):
        code = CODE[dtype]
        # all_gather: separate input, and input = own block of the output (FSDP's way)
        ins = [random_tensor(n, dtype, gen) for _ in range(world)]
        outs = [random_tensor(world * n, dtype, gen) for _ in range(world)]
        run_all([g.all_gather(o.data_ptr(), i.data_ptr(), n, code, 1, (o, i))
                 for g, o, i in zip(views, outs, ins)])
        want = torch.cat(ins)
        for o in outs:
            assert torch.equal(o.view(torch.uint8), want.view(torch.uint8)), (dtype, n)
        outs = [random_tensor(world * n, dtype, gen) for _ in range(world)]
        for r, o in enumerate(outs):
            o[r * n:(r + 1) * n] = ins[r]
        run_all([g.all_gather(o.data_ptr(), o[r * n:].data_ptr(), n, code, 1, (o,))
                 for r, (g, o) in enumerate(zip(views, outs))])
        for o in outs:
            assert torch.equal(o.view(torch.uint8), want.view(torch.uint8)), (dtype, n)
        # reduce_scatter with a fused scale
        for scale in (1.0, 1 / world):
            ins = [random_tensor(world * n, dtype, gen) for _ in range(world)]
            outs = [random_tensor(n, dtype, gen) for _ in range(world)]
            run_all([g.reduce_scatter(o.data_ptr(), i.data_ptr(), n, code, scale, 1, (o, i))
                     for g, o, i in zip(views, outs, ins)])
            for r, o in enumerate(outs):
                want = torch.empty(n, dtype=dtype)
                ref_reduce(want, [i[r * n:(r + 1) * n] for i in ins], scale)
                assert_same(o, want, f"reduce_scatter {dtype} n={n} rank {r}")
        # all_reduce: in place and out of place; every rank gets the same bits
        for inplace in (True, False):
            ins = [random_tensor(n, dtype, gen) for _ in range(world)]
            want = torch.empty(n, dtype=dtype)
            ref_reduce(want, ins, 0.5)
            outs = [i.clone() for i in ins] if inplace else [torch.empty(n, dtype=dtype)
                                                             for _ in range(world)]
            srcs = outs if inplace else ins
            run_all([g.all_reduce(o.data_ptr(), s.data_ptr(), n, code, 0.5, 1, (o, s))
                     for g, o, s in zip(views, outs, srcs)])
            for o in outs:
                assert_same(o, want, f"all_reduce {dtype} n={n} inplace={inplace}")
        # broadcast from every root
        for root in range(world):
            bufs = [random_tensor(n, dtype, gen) for _ in range(world)]
            want = bufs[root].clone()
            run_all([g.broadcast(b.data_ptr(), n, code, root, 1, (b,))
                     for g, b in zip(views, bufs)])
            for b in bufs:
                assert torch.equal(b.view(torch.uint8), want.view(torch.uint8))


def counts_of(world, n, gen):
    """An all-to-all's counts: blocks up to n elements, some empty, one exactly n."""
    counts = torch.randint(0, n + 1, (world, world), generator=gen)
    counts[torch.rand(world, world, generator=gen) < 0.25] = 0
    counts[world - 1, 0] = n
    return counts.tolist()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_to_all_matches_its_twin(groups, world):
    """Every rank's blocks of uneven sizes (empty ones, many pieces of the small slots),
    every dtype, each rank's buffers at an odd address now and then: byte for byte what
    the twin ``_ref.shm_all_to_all`` says each rank receives; the op leaves its input as it
    was.  Also through ``_core.ShmView``'s checks."""
    from cfsdp._ref import shm_all_to_all as ref_a2a

    gs = groups(world)
    gs.wait_attached()
    gen = torch.Generator().manual_seed(world + 100)
    for dtype, n, shift in itertools.product(DTYPES, SIZES, (0, 1)):
        counts = counts_of(world, n, gen)
        blob = array.array("q", [c for row in counts for c in row]).tobytes()
        ins = [random_tensor(sum(counts[r]) + shift, dtype, gen)[shift:] for r in range(world)]
        before = [i.clone() for i in ins]
        outs = [random_tensor(sum(row[r] for row in counts) + shift, dtype, gen)[shift:]
                for r in range(world)]
        run_all([g.all_to_all(o.data_ptr(), i.data_ptr(), blob, CODE[dtype], 1 + r % 2, (o, i))
                 for r, (g, o, i) in enumerate(zip(gs.views, outs, ins))])
        for r, (o, want) in enumerate(zip(outs, ref_a2a(before, counts))):
            assert torch.equal(o.view(torch.uint8), want.view(torch.uint8)), (dtype, n, r)
        for i, b in zip(ins, before):
            assert torch.equal(i.view(torch.uint8), b.view(torch.uint8))


def test_all_to_all_refuses_what_does_not_fit(groups):
    """Bad counts are refused before anything is queued (C's own checks and the view's),
    ranks with different matrices fail with a message naming the other rank."""
    gs = groups(2)
    gs.wait_attached()
    g, x, y = gs.views[0], torch.zeros(8), torch.zeros(8)

    def blob(rows):
        return array.array("q", [c for row in rows for c in row]).tobytes()

    p, q = x.data_ptr(), y.data_ptr()
    cases = [
        (lambda: g.all_to_all(p, q, blob([[1, -1], [0, 0]]), 0, 1, None), ValueError,
         r"counts\[0\]\[1\] must be >= 0"),
        (lambda: g.all_to_all(p, q, blob([[2**62, 2**62], [0, 0]]), 0, 1, None), OverflowError,
         "too large"),
        (lambda: g.all_to_all(p, q, b"\0" * 24, 0, 1, None), ValueError, "expected 32"),
        (lambda: g.all_to_all(p, q, [[1, 1], [1, 1]], 0, 1, None), TypeError, "bytes"),
        (lambda: g.all_to_all(p, p + 4, blob([[2, 2], [2, 2]]), 0, 1, None), ValueError,
         "overlap"),
        (lambda: g.all_to_all(0, q, blob([[2, 2], [2, 2]]), 0, 1, None), ValueError, "NULL"),
        (lambda: g.all_to_all(p, q, blob([[2, 2], [2, 2]]), 9, 1, None), ValueError,
         "dtype code"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    view = _core.ShmView.__new__(_core.ShmView)
    view._g, view._world = g, 2
    with pytest.raises(ValueError, match="sends 3 and receives 2 elements"):
        view.all_to_all(torch.zeros(2), torch.zeros(4), [[1, 2], [1, 0]], 1)
    with pytest.raises(ValueError, match="must be 2 x 2"):
        view.all_to_all(torch.zeros(2), torch.zeros(3), [[1, 2]], 1)
    with pytest.raises(ValueError, match=">= 0"):
        view.all_to_all(torch.zeros(2), torch.zeros(3), [[4, -1], [0, 0]], 1)
    # nothing was queued; then ranks that disagree about the matrix fail, naming the other
    a, b = torch.zeros(4), torch.zeros(4)
    w0 = gs.views[0].all_to_all(x.data_ptr(), a.data_ptr(), blob([[2, 2], [2, 2]]), 0, 1, (x, a))
    w1 = gs.views[1].all_to_all(y.data_ptr(), b.data_ptr(), blob([[2, 2], [1, 3]]), 0, 1, (y, b))
    for w in (w0, w1):
        with pytest.raises(RuntimeError, match=r"collectives differ between ranks: .*all_to_all "
                           r"\(numel 8, float32, counts hash \d+\), rank \d \(global 1[01]\)"):
            w.wait()


def chunk_plan(shapes, world):
    """fully_shard's plan for parameters of these shapes: (nat_off, numel, chunk_numel,
    shard_off, outer) each, and the per-rank shard numel.  A shape (rows, row_numel) is
    sharded on dim 0; (outer, k, inner) is (outer, k * world, inner) sharded on dim 1."""
    plan, nat, shard = [], 0, 0
    for shape in shapes:
        if len(shape) == 2:
            (rows, row_numel), outer = shape, 1
            chunk = -(-rows // world) * row_numel
            numel = rows * row_numel
        else:
            outer, k, inner = shape
            chunk, numel = outer * k * inner, outer * k * world * inner
        plan.append((nat, numel, chunk, shard, outer))
        nat += numel
        shard += chunk
    return plan, nat, shard


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_gather_unpack_is_all_gather_then_chunk_unpack(groups, world):
    """The fused copy-out writes the natural buffer exactly as chunk_unpack of the
    rank-major all-gather would (padding dropped, ranks holding nothing included),
    through many pieces of the small slots, for every dtype."""
    from cfsdp._ref import chunk_unpack as ref_unpack
    from cfsdp._runtime.comm import pack_plan

    gs = groups(world)
    gs.wait_attached()
    gen = torch.Generator().manual_seed(100 + world)
    shape_sets = [[(1, 1)], [(5, 3), (1, 7), (world + 1, 1), (2, 64)], [(37, 11), (3, 129), (8, 8)],
                  [(world - 1, 5), (1, 1000)], [(3, 2, 5), (5, 3), (40, 1, 3), (1, 1, 1)],
                  [(2, 40, 7), (300, 1, 1), (7, 1)]]  # Shard(1) blocks across piece borders
    for dtype, shapes in itertools.product(DTYPES, shape_sets):
        plan, nat_numel, shard_numel = chunk_plan(shapes, world)
        shards = [random_tensor(shard_numel, dtype, gen) for _ in range(world)]
        start = random_tensor(nat_numel + 3, dtype, gen)  # 3 trailing elements no plan covers
        want = start.clone()
        ref_unpack(want[:nat_numel], torch.cat(shards), plan, world, shard_numel)
        want[nat_numel:] = start[nat_numel:]
        nats = [start.clone() for _ in range(world)]
        blob = pack_plan(plan)
        run_all([g.all_gather_unpack(n.data_ptr(), n.numel(), sh.data_ptr(), shard_numel,
                                     CODE[dtype], blob, 1, (n, sh, blob))
                 for g, n, sh in zip(gs.views, nats, shards)])
        for n in nats:
            assert torch.equal(n.view(torch.uint8), want.view(torch.uint8)), (dtype, shapes)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reduce_scatter_pack_is_chunk_pack_then_reduce_scatter(groups, world):
    """The fused copy-in packs each piece of the natural gradient into the slots
    exactly as chunk_pack (cast after the pre-divide, padding zero) would build the
    rank-major input; the result equals chunk_pack + the plain reduce-scatter bit for
    bit, for every reduce dtype, a gradient in another dtype, divisors and scales."""
    from cfsdp._ref import chunk_pack as ref_pack
    from cfsdp._runtime.comm import pack_plan

    gs = groups(world)
    gs.wait_attached()
    gen = torch.Generator().manual_seed(200 + world)
    shape_sets = [[(1, 1)], [(5, 3), (1, 7), (world + 1, 1), (2, 64)], [(37, 11), (3, 129)],
                  [(world - 1, 5), (1, 1000)], [(3, 2, 5), (5, 3), (40, 1, 3)],
                  [(2, 40, 7), (300, 1, 1), (7, 1)]]  # Shard(1) blocks across piece borders
    cases = [(d, d) for d in DTYPES] + [(torch.bfloat16, torch.float32),
                                        (torch.float16, torch.float32)]
    for (rdt, gdt), shapes, (divisor, scale) in itertools.product(
            cases, shape_sets, [(1.0, 1.0), (2.0, 0.5), (3.0, 1 / world)]):
        plan, nat_numel, shard_numel = chunk_plan(shapes, world)
        grads = [random_tensor(nat_numel, gdt, gen) for _ in range(world)]
        blob = pack_plan(plan)
        # reference: chunk_pack on each rank, then the plain shared-memory reduce-scatter
        inps = []
        for gr in grads:
            inp = torch.empty(world * shard_numel, dtype=rdt)
            ref_pack(inp, gr, plan, world, shard_numel, divisor, (0, world))
            inps.append(inp)
        want = [torch.empty(shard_numel, dtype=rdt) for _ in range(world)]
        run_all([g.reduce_scatter(o.data_ptr(), i.data_ptr(), shard_numel, CODE[rdt], scale, 1,
                                  (o, i)) for g, o, i in zip(gs.views, want, inps)])
        outs = [random_tensor(shard_numel, rdt, gen) for _ in range(world)]
        run_all([g.reduce_scatter_pack(o.data_ptr(), shard_numel, CODE[rdt], gr.data_ptr(),
                                       nat_numel, CODE[gdt], divisor, scale, blob, 1,
                                       (o, gr, blob))
                 for g, o, gr in zip(gs.views, outs, grads)])
        for r, (o, w) in enumerate(zip(outs, want)):
            assert_same(o, w, f"reduce_scatter_pack {rdt}<-{gdt} {shapes} /{divisor} rank {r}")


def test_all_gather_unpack_threads_match_one_thread(groups):
    """Pieces large enough for the threaded copy-out (above CHUNK_PARALLEL_BYTES): thread
    borders fall inside dim-0 chunks, padding and Shard(1) blocks (of 5 and of 1
    elements); every thread count writes what chunk_unpack does."""
    from cfsdp._ref import chunk_unpack as ref_unpack
    from cfsdp._runtime.comm import pack_plan

    world = 2
    plan, nat_numel, shard_numel = chunk_plan([(1001, 301), (3, 20011, 5), (70001, 1, 1), (7, 3)],
                                              world)
    gen = torch.Generator().manual_seed(7)
    shards = [random_tensor(shard_numel, torch.float32, gen) for _ in range(world)]
    want = torch.zeros(nat_numel)
    ref_unpack(want, torch.cat(shards), plan, world, shard_numel)
    blob = pack_plan(plan)
    for threads in (1, 2, C.MAX_THREADS):
        gs = groups(world, slot_per_rank=1 << 20)  # 512 K fp32 a piece: about 3 pieces
        assert 2 * world * (world << 20) > C.CHUNK_PARALLEL_BYTES  # bytes a piece moves
        nats = [torch.zeros(nat_numel) for _ in range(world)]
        run_all([g.all_gather_unpack(n.data_ptr(), nat_numel, sh.data_ptr(), shard_numel,
                                     CODE[torch.float32], blob, threads, (n, sh, blob))
                 for g, n, sh in zip(gs.views, nats, shards)])
        for n in nats:
            assert torch.equal(n.view(torch.int32), want.view(torch.int32)), threads
        gs.close()


def test_all_gather_unpack_bad_plans_raise_before_queuing(groups):
    from cfsdp._runtime.comm import pack_plan

    gs = groups(2)
    gs.wait_attached()
    g, nat, sh = gs.views[0], torch.zeros(10), torch.zeros(5)
    args = (nat.data_ptr(), 10, sh.data_ptr(), 5, CODE[torch.float32])
    with pytest.raises(TypeError, match="plan must be bytes"):
        g.all_gather_unpack(*args, [(0, 10, 5, 0, 1)], 1, ())
    with pytest.raises(ValueError, match="multiple of 40"):
        g.all_gather_unpack(*args, array.array("q", [0, 10, 5, 0]).tobytes(), 1, ())
    with pytest.raises(ValueError, match="does not fit in 2 chunks"):  # chunks too small
        g.all_gather_unpack(*args, pack_plan([(0, 10, 4, 0, 1)]), 1, ())
    with pytest.raises(ValueError, match="passes the end 10"):  # natural too small
        g.all_gather_unpack(*args, pack_plan([(1, 10, 5, 0, 1)]), 1, ())
    with pytest.raises(ValueError, match="outer must be >= 1, got 0"):
        g.all_gather_unpack(*args, pack_plan([(0, 10, 5, 0, 0)]), 1, ())
    with pytest.raises(ValueError, match="a chunk of 2 blocks"):  # 5 is not 2 whole blocks
        g.all_gather_unpack(*args, pack_plan([(0, 10, 5, 0, 2)]), 1, ())
    with pytest.raises(ValueError, match="plan param 0 must be"):  # a short row
        pack_plan([(0, 10, 5, 0)])
    with pytest.raises(ValueError, match="overlap"):
        g.all_gather_unpack(nat.data_ptr(), 10, nat.data_ptr(), 5, CODE[torch.float32],
                            pack_plan([(0, 10, 5, 0, 1)]), 1, ())
    f32 = CODE[torch.float32]
    with pytest.raises(ValueError, match="divisor must be finite and non-zero"):
        g.reduce_scatter_pack(sh.data_ptr(), 5, f32, nat.data_ptr(), 10, f32, 0.0, 1.0,
                              pack_plan([(0, 10, 5, 0, 1)]), 1, ())
    with pytest.raises(ValueError, match="passes the end 10"):
        g.reduce_scatter_pack(sh.data_ptr(), 5, f32, nat.data_ptr(), 10, f32, 1.0, 1.0,
                              pack_plan([(1, 10, 5, 0, 1)]), 1, ())
    with pytest.raises(ValueError, match="overlap"):
        g.reduce_scatter_pack(nat.data_ptr(), 5, f32, nat.data_ptr(), 10, f32, 1.0, 1.0,
                              pack_plan([(0, 10, 5, 0, 1)]), 1, ())


def test_async_ops_overlap_and_wait_out_of_order(groups):
    """Many ops queued before any wait; waited newest first; results as if run in order."""
    world, n = 3, 517
    gs = groups(world)
    gs.wait_attached()
    gen = torch.Generator().manual_seed(9)
    bufs = [[torch.randn(n, generator=gen) for _ in range(world)] for _ in range(6)]
    works = []
    for k in range(6):  # all_reduce op k on buffers k, then an all_gather of buffers k
        works.append([g.all_reduce(b.data_ptr(), b.data_ptr(), n, 0, 1.0, 1, (b,))
                      for g, b in zip(gs.views, bufs[k])])
    outs = [torch.empty(world * n) for _ in range(world)]
    # gathers the already reduced buffers 5, because ops run in issue order
    works.append([g.all_gather(o.data_ptr(), bufs[5][r].data_ptr(), n, 0, 1, (o,))
                  for r, (g, o) in enumerate(zip(gs.views, outs))])
    for ws in reversed(works):
        for w in reversed(ws):
            w.wait()
            assert w.is_completed()
    for o in outs:
        assert torch.equal(o, torch.cat(bufs[5]))
    assert all(torch.equal(b, bufs[0][0]) for b in bufs[0])


def test_ranks_driven_from_python_threads(groups):
    """Each rank issues and waits its ops from its own Python thread (GIL released)."""
    world, n, rounds = 4, 333, 20
    gs = groups(world)
    gs.wait_attached()
    results, errors = [None] * world, []

    def rank_main(r):
        try:
            t = torch.full((n,), float(r + 1))
            for _ in range(rounds):
                gs.views[r].all_reduce(t.data_ptr(), t.data_ptr(), n, 0, 1.0 / world, 1,
                                       (t,)).wait()
            results[r] = t
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    want = torch.full((n,), 2.5)  # the mean of 1..4 is a fixed point of the average
    for t in results:
        assert torch.equal(t, want)


def test_stalled_rank_times_out_everywhere_and_poisons(groups):
    """Rank 2 never issues: ranks 0 and 1 fail, the first by its deadline naming rank 2,
    the other at once through the shared flag; rank 2's late op fails at once naming the
    failure; later ops fail fast with the first error."""
    world, timeout = 3, 0.5
    gs = groups(world, timeout=timeout)
    gs.wait_attached()
    bufs = [torch.zeros(8) for _ in range(world)]
    t0 = time.monotonic()
    works = [g.all_reduce(b.data_ptr(), b.data_ptr(), 8, 0, 1.0, 1, (b,))
             for g, b in zip(gs.views[:2], bufs)]
    msgs = []
    for w in works:
        with pytest.raises(RuntimeError) as e:
            w.wait()
        msgs.append(str(e.value))
    elapsed = time.monotonic() - t0
    assert elapsed < timeout + 5, elapsed
    assert any("timed out after 0.5 s" in m and "rank(s) 2 (global 12) did not arrive" in m
               and "all_reduce #1" in m and "'unit'" in m for m in msgs), msgs
    assert all("rank(s) 2 (global 12)" in m for m in msgs), msgs
    late = gs.views[2].all_reduce(bufs[2].data_ptr(), bufs[2].data_ptr(), 8, 0, 1.0, 1, None)
    with pytest.raises(RuntimeError, match=r"aborted because rank \d \(global rank 1\d\) failed"):
        late.wait()
    with pytest.raises(RuntimeError, match="aborted because"):  # raised again
        late.wait()
    again = gs.views[0].all_gather(bufs[0].data_ptr(), bufs[0].data_ptr(), 0, 0, 1, None)
    with pytest.raises(RuntimeError, match="poisoned by an earlier failure: .*did not arrive"):
        again.wait()


def test_failure_flag_beats_long_timeouts(groups):
    """One rank with a short timeout fails; a rank with a long one fails right after."""
    name = f"/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}"
    world = 3
    v0 = C.ShmGroup(name, True, world, 0, 256 * world, 0.3, "flag", [0, 1, 2])
    v1 = C.ShmGroup(name, False, world, 1, 256 * world, 60.0, "flag", [0, 1, 2])
    v2 = C.ShmGroup(name, False, world, 2, 256 * world, 60.0, "flag", [0, 1, 2])
    try:
        for v in (v0, v1, v2):
            v.wait_attached()
        x = torch.zeros(4)
        t0 = time.monotonic()
        w1 = v1.broadcast(x.data_ptr(), 4, 0, 2, 1, (x,))
        w0 = v0.broadcast(x.data_ptr(), 4, 0, 2, 1, (x,))
        with pytest.raises(RuntimeError, match="timed out after 0.3 s"):
            w0.wait()
        with pytest.raises(RuntimeError, match=r"aborted because rank 0 \(global rank 0\)"):
            w1.wait()
        assert time.monotonic() - t0 < 10
    finally:
        for v in (v0, v1, v2):
            v.close()


def test_fail_from_outside_wakes_every_rank_at_once(groups):
    """fail(msg) on one view (a rank whose two-level collective failed in its process-group
    part): a peer already waiting in a collective, and a peer's next collective, fail at once
    naming that rank and the message, long before the timeout; the failed view refuses its
    own later collectives; fail() on a closed view is a no-op."""
    world = 3
    gs = groups(world, timeout=60.0)
    gs.wait_attached()
    x = [torch.zeros(4) for _ in range(world)]
    t0 = time.monotonic()
    waiting = gs.views[1].all_reduce(x[1].data_ptr(), x[1].data_ptr(), 4, 0, 1.0, 1, (x[1],))
    time.sleep(0.05)
    gs.views[0].fail("exchange with global rank 7 on host 'h1' failed: connection reset")
    with pytest.raises(RuntimeError, match=r"aborted because rank 0 \(global rank 10\) failed: "
                       r"exchange with global rank 7 on host 'h1' failed"):
        waiting.wait()
    nxt = gs.views[2].broadcast(x[2].data_ptr(), 4, 0, 1, 1, (x[2],))
    with pytest.raises(RuntimeError, match="aborted because rank 0 .*connection reset"):
        nxt.wait()
    assert time.monotonic() - t0 < 10
    own = gs.views[0].all_reduce(x[0].data_ptr(), x[0].data_ptr(), 4, 0, 1.0, 1, (x[0],))
    with pytest.raises(RuntimeError, match="refused: this rank failed outside the segment"):
        own.wait()
    with pytest.raises(TypeError, match="message must be str"):
        gs.views[0].fail(b"bytes")
    gs.views[2].close()
    gs.views[2].fail("ignored")  # closed: nothing to tell


def test_ranks_that_disagree_fail_with_a_message(groups):
    gs = groups(2)
    gs.wait_attached()
    a, b = torch.zeros(6), torch.zeros(8)
    w0 = gs.views[0].all_reduce(a.data_ptr(), a.data_ptr(), 6, 0, 1.0, 1, (a,))
    w1 = gs.views[1].all_reduce(b.data_ptr(), b.data_ptr(), 8, 0, 1.0, 1, (b,))
    for w in (w0, w1):
        with pytest.raises(RuntimeError, match="collectives differ between ranks"):
            w.wait()


def test_attach_timeout_unlinks(groups):
    """A rank that never attaches: set-up times out naming the count, and the name is
    gone from /dev/shm."""
    gs = groups(3, timeout=0.3, attach=[0, 1])
    assert len(shm_entries()) == 1
    for g in gs.views:
        with pytest.raises(RuntimeError, match="set-up timed out after 0.3 s: 2 of 3 ranks"):
            g.wait_attached()
    assert shm_entries() == []


def test_close_fails_queued_and_running_ops(groups):
    gs = groups(2, timeout=30.0)
    gs.wait_attached()
    x = torch.zeros(16)
    running = gs.views[0].all_reduce(x.data_ptr(), x.data_ptr(), 16, 0, 1.0, 1, (x,))
    queued = gs.views[0].all_reduce(x.data_ptr(), x.data_ptr(), 16, 0, 1.0, 1, (x,))
    time.sleep(0.05)
    t0 = time.monotonic()
    gs.views[0].close()
    assert time.monotonic() - t0 < 5
    assert gs.views[0].closed and running.is_completed() and queued.is_completed()
    with pytest.raises(RuntimeError, match="closed"):
        running.wait()
    with pytest.raises(RuntimeError, match="closed"):
        queued.wait()
    with pytest.raises(RuntimeError, match="group is closed"):
        gs.views[0].all_reduce(x.data_ptr(), x.data_ptr(), 16, 0, 1.0, 1, None)
    # the peer learns about it through the failure flag
    w = gs.views[1].all_reduce(x.data_ptr(), x.data_ptr(), 16, 0, 1.0, 1, None)
    with pytest.raises(RuntimeError, match="group was closed"):
        w.wait()


def test_dropping_a_handle_waits_for_its_op(groups):
    gs = groups(2)
    gs.wait_attached()
    n = 5000
    ts = [torch.full((n,), float(r)) for r in range(2)]
    w0 = gs.views[0].all_reduce(ts[0].data_ptr(), ts[0].data_ptr(), n, 0, 1.0, 1, (ts[0],))
    gs.views[1].all_reduce(ts[1].data_ptr(), ts[1].data_ptr(), n, 0, 1.0, 1, (ts[1],))
    # the second handle was dropped at once: its dealloc waited for the op
    assert torch.equal(ts[1], torch.ones(n))
    w0.wait()
    assert torch.equal(ts[0], torch.ones(n))


def test_bad_arguments_raise_before_queuing(groups):
    gs = groups(2)
    gs.wait_attached()
    g, x = gs.views[0], torch.zeros(8)
    p = x.data_ptr()
    cases = [
        (lambda: g.all_gather(p, p + 4, 2, 0, 1, None), ValueError, "overlap"),
        (lambda: g.reduce_scatter(p, p, 4, 0, 1.0, 1, None), ValueError, "overlap"),
        (lambda: g.all_reduce(p, p + 4, 4, 0, 1.0, 1, None), ValueError, "overlap"),
        (lambda: g.all_gather(p, 0, 2, 0, 1, None), ValueError, "NULL"),
        (lambda: g.all_gather(p, p, 2, 7, 1, None), ValueError, "dtype code"),
        (lambda: g.all_gather(p, p, -1, 0, 1, None), ValueError, "numel"),
        (lambda: g.all_reduce(p, p, 8, 0, float("nan"), 1, None), ValueError, "scale"),
        (lambda: g.broadcast(p, 8, 0, 2, 1, None), ValueError, "root 2"),
        (lambda: g.all_gather(p, p, 2**62, 0, 1, None), OverflowError, "too large"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    # nothing was queued: the group still works
    y = [torch.ones(8), torch.ones(8)]
    run_all([v.all_reduce(t.data_ptr(), t.data_ptr(), 8, 0, 1.0, 1, (t,))
             for v, t in zip(gs.views, y)])
    assert torch.equal(y[0], torch.full((8,), 2.0))


def test_open_errors():
    name = f"/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}"
    with pytest.raises(RuntimeError, match=r'open\("/dev/shm/cfsdp-test-.*No such file'):
        C.ShmGroup(name, False, 2, 1, 512, 1.0, "x", [0, 1])
    with pytest.raises(ValueError, match="slot_bytes"):
        C.ShmGroup(name, True, 2, 0, 100, 1.0, "x", [0, 1])
    with pytest.raises(ValueError, match="creator is rank 0"):
        C.ShmGroup(name, True, 2, 1, 512, 1.0, "x", [0, 1])
    with pytest.raises(ValueError, match="timeout"):
        C.ShmGroup(name, True, 2, 0, 512, 0.0, "x", [0, 1])
    with pytest.raises(ValueError, match="global_ranks has 1"):
        C.ShmGroup(name, True, 2, 0, 512, 1.0, "x", [0])
    g = C.ShmGroup(name, True, 2, 0, 512, 1.0, "x", [0, 1])
    try:
        with pytest.raises(RuntimeError, match="File exists"):  # O_EXCL
            C.ShmGroup(name, True, 2, 0, 512, 1.0, "x", [0, 1])
        with pytest.raises(ValueError, match="has .* bytes, expected"):
            C.ShmGroup(name, False, 2, 1, 1024, 1.0, "x", [0, 1])
        assert g.nbytes == C.shm_segment_bytes(2, 512) and g.rank == 0 and g.world_size == 2
    finally:
        g.close()
    assert shm_entries() == []


# ----------------------------------------------------------------------------------------
# Trust: nothing is mapped that is not this job's ("Trust" in csrc/shm.c)
# ----------------------------------------------------------------------------------------


def needs_root(what):
    """chown to another user needs root (CI runs as root): fail, never skip."""
    if os.geteuid() != 0:
        pytest.fail(f"{what} needs root (chown to another user); run the tests as root",
                    pytrace=False)


def unknown_uid():
    """A uid that the user database does not know."""
    import pwd

    known = {p.pw_uid for p in pwd.getpwall()}
    return next(u for u in range(54321, 60000) if u not in known)


def both(path, create, nbytes):
    """``(exception type, message)`` of ``cfsdp._C.ShmSegment`` and of its twin
    ``cfsdp._ref.ShmSegment`` on the same arguments, which must agree (the message byte for
    byte); a segment made by the first is unlinked before the second runs."""
    from cfsdp._ref import ShmSegment as RefSegment

    out = []
    for make in (C.ShmSegment, RefSegment):
        try:
            seg = make(path, create, nbytes)
            if create:
                seg.unlink()
            out.append((None, ""))
        except Exception as e:  # noqa: BLE001 - compared below
            out.append((type(e), str(e)))
    assert out[0] == out[1], out
    return out[0]


def test_segment_refuses_what_is_not_ours_like_its_twin(tmp_path):
    """The host-shared segment facility (``cf_shm_map_file``: ``_C.ShmSegment`` and its twin
    ``_ref.ShmSegment``) attaches only to a regular file of this process's uid with no
    group/other bits; anything else is a PermissionError (the same message, byte for
    byte, in C and twin) naming the path, the file's type, owner (uid and user name) and
    mode, and what to do -- before it is sized or mapped; a symbolic link is refused naming
    the link; a missing file or a directory is a RuntimeError naming the call and errno;
    a size that does not match a ValueError."""
    needs_root("test_segment_refuses_what_is_not_ours_like_its_twin")
    import pwd

    me = f"uid {os.geteuid()} ({pwd.getpwuid(os.geteuid()).pw_name})"
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 64)
    try:
        for mode in (0o600, 0o700, 0o400 | 0o200):
            os.fchmod(fd, mode)
            assert both(path, False, 64) == (None, "")
            _core.ShmSegment(path, False, 64)  # the door: either implementation, one contract
        for mode in (0o644, 0o660, 0o606, 0o602, 0o620, 0o666):
            os.fchmod(fd, mode)
            kind, msg = both(path, False, 64)
            assert kind is PermissionError, (oct(mode), kind, msg)
            assert msg.startswith(f"cfsdp: refused to map {path}: a regular file of {me} "
                                  f"with mode {mode & 0o7777:04o}, not this job's"), msg
            assert "rendezvous store" in msg and "restart the job" in msg, msg
        os.fchmod(fd, 0o600)
        for uid, name in ((65534, pwd.getpwuid(65534).pw_name), (unknown_uid(), "no user name")):
            os.fchown(fd, uid, -1)
            kind, msg = both(path, False, 64)
            assert kind is PermissionError
            assert f"a regular file of uid {uid} ({name}) with mode 0600" in msg, msg
        os.fchown(fd, os.geteuid(), -1)
        assert both(path, False, 65) == (ValueError, f"cfsdp shm: {path} has 64 bytes, "
                                                     f"expected 65")
    finally:
        os.close(fd)
    link = str(tmp_path / "link")
    os.symlink(path, link)
    kind, msg = both(link, False, 64)
    assert kind is PermissionError and msg.startswith(
        f"cfsdp: refused to map {link}: a symbolic link of {me} "), msg
    assert both(link, True, 64)[0] is RuntimeError  # O_EXCL: it exists; never followed
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo, 0o600)
    assert both(fifo, False, 64)[0] is PermissionError
    missing = str(tmp_path / "missing")
    assert both(missing, False, 64) == (
        RuntimeError, f'cfsdp shm: open("{missing}") failed: No such file or directory '
                      f"(errno 2)")
    assert both(str(tmp_path), False, 64)[0] is RuntimeError  # a directory: EISDIR
    assert both(path, False, 0) == (ValueError, "nbytes must be positive, got 0")
    assert both(path + "\0x", False, 64) == (ValueError,
                                              "path must not contain a NUL character")


@pytest.mark.parametrize("impl", ["c", "python"])
def test_segment_is_shared_private_and_leaves_nothing(tmp_path, impl):
    """Made by one handle and attached by another, the segment is one memory (a write
    through either view is seen by the other), of mode 0600 with its pages reserved, and
    outlives its handles as long as a tensor view of it does; made over an existing name
    it fails (O_EXCL) and leaves that file alone; a failed creation leaves no file;
    ``unlink`` removes the name (twice is fine) and the mapping stays valid."""
    from cfsdp._ref import ShmSegment as RefSegment

    make = C.ShmSegment if impl == "c" else RefSegment
    view = (lambda s: torch.frombuffer(s, dtype=torch.uint8)) if impl == "c" else \
        (lambda s: torch.frombuffer(s.buffer, dtype=torch.uint8))
    path = str(tmp_path / "seg")
    made = make(path, True, 4096)
    st_ = os.stat(path)
    assert (st_.st_mode & 0o777, st_.st_size, st_.st_uid) == (0o600, 4096, os.geteuid())
    assert st_.st_blocks * 512 >= 4096  # posix_fallocate reserved its pages
    other = make(path, False, 4096)
    a, b = view(made), view(other)
    a[:8] = torch.arange(8, dtype=torch.uint8)
    assert b[:8].tolist() == list(range(8))
    b[-1] = 200
    assert int(a[-1]) == 200
    assert (made.nbytes, made.path) == (4096, path)
    with pytest.raises(RuntimeError, match="File exists"):
        make(path, True, 4096)
    assert os.stat(path).st_size == 4096 and int(view(make(path, False, 4096))[-1]) == 200
    made.unlink()
    made.unlink()
    assert not os.path.exists(path)
    del made, other
    b[0] = 42  # the views keep the mapping
    assert int(a[0]) == 42
    with pytest.raises((RuntimeError, ValueError)):
        make(str(tmp_path / "nodir" / "x"), True, 64)
    assert sorted(os.listdir(tmp_path)) == []
    seg = _core.ShmSegment(str(tmp_path / "door"), True, 64)  # the door picks CFSDP_IMPL's
    t = seg.tensor()
    t.fill_(3)
    seg.unlink()
    assert t.sum().item() == 192 and os.listdir(tmp_path) == []


def test_attach_refuses_a_segment_that_is_not_ours():
    """The attack of issue 22 at the C level (it serves one-level and two-level segments
    alike, comm.py's _open_segment): a segment name that leads to a file of another user,
    or with group/other permission bits, or to a symbolic link, is refused before it is
    mapped (PermissionError naming path, owner and mode), and nothing of the file changes
    (no attach count, no data)."""
    needs_root("test_attach_refuses_a_segment_that_is_not_ours")
    import pwd

    world, slot = 2, 512
    nobody = pwd.getpwuid(65534).pw_name
    for mode, owner, what in ((0o666, 65534, f"uid 65534 ({nobody}) with mode 0666"),
                              (0o600, 65534, f"uid 65534 ({nobody}) with mode 0600"),
                              (0o640, os.geteuid(), "with mode 0640")):
        name = f"/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}"
        creator = C.ShmGroup(name, True, world, 0, slot, 1.0, "forger", [0, 1])
        path = "/dev/shm" + name
        try:
            size = os.stat(path).st_size
            with open(path, "r+b") as f:  # data that an attach or a collective would change
                f.seek(size // 2)
                f.write(secrets.token_bytes(size - size // 2))
            os.chmod(path, mode)
            os.chown(path, owner, -1)
            with open(path, "rb") as f:
                before = f.read()
            with pytest.raises(PermissionError) as e:
                C.ShmGroup(name, False, world, 1, slot, 1.0, "victim", [0, 1])
            assert f"refused to map {path}: a regular file of " in str(e.value), str(e.value)
            assert what in str(e.value), str(e.value)
            with open(path, "rb") as f:
                assert f.read() == before, "the refused attach changed the file"
        finally:
            creator.close()  # unlinks the name
    # a symbolic link in /dev/shm (shm_open never follows one: O_NOFOLLOW)
    target = f"/dev/shm/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}"
    link = f"/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, C.shm_segment_bytes(world, slot))
        os.symlink(target, "/dev/shm" + link)
        with pytest.raises(PermissionError, match=f"refused to map /dev/shm{link}: a symbolic "
                                                  f"link of uid {os.geteuid()} "):
            C.ShmGroup(link, False, world, 1, slot, 1.0, "victim", [0, 1])
    finally:
        os.close(fd)
        os.unlink(target)
        if os.path.lexists("/dev/shm" + link):
            os.unlink("/dev/shm" + link)
    assert shm_entries() == []
