"""The C boundary against hostile input, one test per finding of issue 13.2 (the fuzz of
every entry point is test_fuzz_c.py):

* sequences that change while C reads them (an item whose ``__index__`` empties its list),
  for every entry point that takes a sequence: C reads a snapshot;
* the chunk plan of a queued shared-memory op, dropped by the caller: the op reads its own
  copy; a ShmWork waited from several threads at once; a group closed while another
  thread waits in ``wait_attached``;
* tensors at odd addresses: every typed loop loads and stores alignment-safe (same bits as
  an aligned copy), but the fused optimizer steps', which refuse them (``_core`` sends them
  to the twin);
* sizes bounded before anything is allocated (world size, (rank, parameter) pieces, slot
  size), the twins with the same messages;
* addresses: negative or past 2**63 are refused;
* tensors that must not cross (``DTensor``-like wrapper subclasses, FakeTensor, meta, lazy
  negation, functorch wrappers): ``_core`` gives the twins' result and never calls C; a
  tensor whose storage was shrunk is a ValueError on every path.

Under ``make sanitize`` these run against the ASan/UBSan build (with ``PYTHONMALLOC=malloc``,
so a freed Python object is a use-after-free ASan sees).
"""

import array
import gc
import os
import secrets
import threading
import time

import pytest
import torch
import cfsdp._C as C
from cfsdp import _core, _ref
from cfsdp._ref.layout import MAX_PIECES, MAX_WORLD_SIZE
from cfsdp._runtime import comm
from _hostile import Wrapper

F32, BF16 = _core.DTYPE_CODES[torch.float32], _core.DTYPE_CODES[torch.bfloat16]


class Clearing:
    """An int-like whose ``__index__`` empties `target` (the list C is reading), then
    returns `value`: before the snapshot, C read the freed slots (SIGSEGV)."""

    def __init__(self, target, value):
        self.target, self.value = target, value

    def __index__(self):
        self.target.clear()
        gc.collect(0)
        return self.value


def clearing_list(items, pos, make):
    """`items` as a list whose entry `pos` is make(the list)."""
    lst = list(items)
    lst[pos] = make(lst)
    return lst


# ----------------------------------------------------------------------------------------
# sequences read through a snapshot
# ----------------------------------------------------------------------------------------


def test_plan_layout_reads_a_snapshot():
    lst = clearing_list([1] * 8, 0, lambda l: Clearing(l, 1))
    assert C.plan_layout(lst, 0, 2) == _ref.plan_layout_lists([1] * 8, 0, 2)
    assert lst == []


def test_shard_fill_reads_a_snapshot():
    dst, src = torch.zeros(8), torch.arange(8.0)
    row = (src.data_ptr(), 8, 0)
    outer = clearing_list([row] * 8, 0, lambda l: (src.data_ptr(), 8, Clearing(l, 0)))
    C.shard_fill(dst.data_ptr(), 8, 4, 0, outer)
    assert torch.equal(dst, src) and outer == []
    dst.zero_()
    inner = [src.data_ptr(), 8, 0]
    inner[1] = Clearing(inner, 8)
    C.shard_fill(dst.data_ptr(), 8, 4, 0, [inner])
    assert torch.equal(dst, src) and inner == []


@pytest.mark.parametrize("which", ["unpack", "pack"])
def test_chunk_plans_read_a_snapshot(which):
    nat, gathered = torch.arange(8.0), torch.arange(8.0) + 100
    plan = clearing_list([(0, 8, 4, 0, 1)], 0, lambda l: (Clearing(l, 0), 8, 4, 0, 1))
    row = [0, 8, 4, 0, 1]
    row[2] = Clearing(row, 4)
    for p in (plan, [row]):
        if which == "unpack":
            C.chunk_unpack(nat.data_ptr(), 8, gathered.data_ptr(), 8, 4, p, 2, 4, 1)
            assert torch.equal(nat, gathered)
            nat = torch.arange(8.0)
        else:
            C.chunk_pack(gathered.data_ptr(), 8, F32, nat.data_ptr(), 8, F32, p, 2, 4, 0, 2,
                         1.0, 1)
            assert torch.equal(nat, gathered)
            gathered = torch.arange(8.0) + 100
        assert p in ([], [[]])


@pytest.mark.parametrize("which", ["adam", "sgd"])
def test_optim_ranges_read_a_snapshot(which):
    outer = [(Clearing(None, 0), 4)] + [(4 + i, 1) for i in range(7)]  # elements 0..10
    outer[0][0].target = outer
    inner = [0, None]
    inner[1] = Clearing(inner, 4)  # elements 0..3
    for ranges, stepped in ((outer, 11), ([inner], 4)):
        bufs = [torch.ones(16) for _ in range(4)]
        ptrs = [t.data_ptr() for t in bufs]
        if which == "adam":
            C.adam_step(*ptrs, None, ranges, F32, 1e-1, 0.9, 0.999, 1e-8, 0.0, 1.0, False, False,
                        False, 1)
        else:
            C.sgd_step(ptrs[0], ptrs[1], None, ranges, F32, 0.5, 0.0, 0.0, 0.0, False, False,
                       False, 1)
        assert ranges == [] or inner == []
        assert (bufs[0][:stepped] != 1).all() and (bufs[0][stepped:] == 1).all()


def test_core_optim_checks_what_c_reads():
    """_core checks the ranges against the buffers; an int-like that answers differently
    each time it is read cannot pass the check with one value and reach C with another."""

    class Growing:
        calls = 0

        def __index__(self):
            Growing.calls += 1
            return 4 if Growing.calls == 1 else 1 << 40

    bufs = [torch.ones(8) for _ in range(4)]
    hp = dict(lr=0.5, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
              maximize=False, first_step=False)
    _core.sgd_step(bufs[0], bufs[1], None, [(0, Growing())], **hp)
    assert Growing.calls == 1 and torch.equal(bufs[0], torch.tensor([0.5] * 4 + [1.0] * 4))


def test_group_ranks_read_a_snapshot():
    name = f"/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}"
    ranks = clearing_list([0, 1], 0, lambda l: Clearing(l, 7))
    g = C.ShmGroup(name, True, 2, 0, 512, 5.0, "snap", ranks)
    g.close()
    assert ranks == []


def test_dict_pop_looks_a_key_up_once():
    """dicts[i].pop(keys[i], None) is one lookup, as dict.pop: a key whose second
    comparison empties the dict made the former contains-then-delete raise KeyError."""

    class Key:
        def __init__(self, d, evals):
            self.d, self.evals = d, evals

        def __hash__(self):
            return 1

        def __eq__(self, other):
            self.evals.append(1)
            if len(self.evals) > 1:
                self.d.clear()
            return True

    for impl in (C, _ref.bind):
        d, evals = {}, []
        d[Key(d, evals)] = 1
        impl.dict_pop((d,), (Key(d, evals),))
        assert d == {} and len(evals) == 1


# ----------------------------------------------------------------------------------------
# shared-memory ops hold what they read; threads
# ----------------------------------------------------------------------------------------


def _pair(slot=4096, timeout=10.0):
    name = f"/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}"
    views = [C.ShmGroup(name, r == 0, 2, r, slot, timeout, "boundary", [0, 1]) for r in range(2)]
    for v in views:
        v.wait_attached()
    return views


def test_queued_op_reads_its_own_plan():
    """all_gather_unpack / reduce_scatter_pack with a plan nobody keeps: before the fix
    the worker read the freed bytes (a use-after-free ASan reports; in the plain build,
    whatever the memory held next: wrong numbers)."""
    views = _pair()
    n = 1 << 13  # many pieces of the 4 KiB slots: the op outlives the call
    try:
        for _ in range(3):
            shards = [torch.full((n,), float(r + 1)) for r in range(2)]
            nats = [torch.zeros(2 * n) for _ in range(2)]
            works = [v.all_gather_unpack(nat.data_ptr(), 2 * n, sh.data_ptr(), n, F32,
                                         array.array("q", [0, 2 * n, n, 0, 1]).tobytes(), 1,
                                         (nat, sh))
                     for v, nat, sh in zip(views, nats, shards)]
            junk = [array.array("q", [0] * 5).tobytes() for _ in range(2000)]  # reuse the memory
            del junk
            gc.collect(0)
            for w in works:
                w.wait()
            want = torch.cat([torch.ones(n), torch.full((n,), 2.0)])
            assert all(torch.equal(nat, want) for nat in nats)
            grads = [torch.full((2 * n,), float(r + 1)) for r in range(2)]
            outs = [torch.empty(n) for _ in range(2)]
            works = [v.reduce_scatter_pack(o.data_ptr(), n, F32, gr.data_ptr(), 2 * n, F32,
                                           1.0, 1.0,
                                           array.array("q", [0, 2 * n, n, 0, 1]).tobytes(), 1,
                                           (o, gr))
                     for v, o, gr in zip(views, outs, grads)]
            junk = [array.array("q", [0] * 5).tobytes() for _ in range(2000)]
            del junk
            gc.collect(0)
            for w in works:
                w.wait()
            assert all(torch.equal(o, torch.full((n,), 3.0)) for o in outs)
    finally:
        for v in views:
            v.close()


def test_work_waited_from_many_threads():
    """Every waiter returns, and the op is released once, by the last one (before the fix
    the first waiter back freed the op under the others: ASan use-after-free)."""
    views = _pair()
    try:
        for _ in range(20):
            xs = [torch.ones(1 << 14) for _ in range(2)]
            works = [v.all_reduce(x.data_ptr(), x.data_ptr(), x.numel(), F32, 1.0, 1, (x,))
                     for v, x in zip(views, xs)]
            errors = []

            def wait(w):
                try:
                    w.wait()
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            threads = [threading.Thread(target=wait, args=(w,)) for w in works for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == [] and all(w.is_completed() for w in works)
            for w in works:
                w.wait()  # again, after the release
            assert all(torch.equal(x, torch.full((1 << 14,), 2.0)) for x in xs)
    finally:
        for v in views:
            v.close()


def test_close_while_another_thread_waits_attached():
    """close() aborts a wait_attached running in another thread and waits for it before
    unmapping the segment (before the fix: a use after unmap, SIGSEGV in the plain build)."""
    for _ in range(30):
        name = f"/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}"
        g = C.ShmGroup(name, True, 2, 0, 512, 30.0, "closing", [0, 1])  # rank 1 never comes
        errors = []

        def wait():
            try:
                g.wait_attached()
            except RuntimeError as e:
                errors.append(str(e))

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.002)
        g.close()
        t.join(10)
        assert not t.is_alive()
        assert len(errors) == 1 and ("closed" in errors[0] or "is closed" in errors[0]), errors
    with pytest.raises(RuntimeError, match="already running"):
        name = f"/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}"
        g = C.ShmGroup(name, True, 2, 0, 512, 0.5, "twice", [0, 1])
        t = threading.Thread(target=lambda: pytest.raises(RuntimeError, g.wait_attached))
        t.start()
        time.sleep(0.05)
        try:
            g.wait_attached()
        finally:
            t.join()
            g.close()


# ----------------------------------------------------------------------------------------
# odd addresses
# ----------------------------------------------------------------------------------------


def odd(n, dtype, shift=1, fill=None, gen=None):
    """A contiguous `dtype` tensor of n elements at an address `shift` bytes past an aligned
    one (its storage a bytearray)."""
    esz = torch.empty((), dtype=dtype).element_size()
    t = torch.frombuffer(bytearray(n * esz + shift + 8), dtype=dtype, count=n, offset=shift)
    if fill is not None:
        t.copy_(fill)
    assert t.data_ptr() % esz != 0 or esz == 1
    return t


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_addresses_give_the_aligned_bits(dtype):
    """scale_cast_add, norm_partial, chunk_pack (a cast), shm_reduce in C on odd addresses:
    the same bits as on aligned copies (before: misaligned typed loads, a UBSan report)."""
    gen = torch.Generator().manual_seed(5)
    n = 101
    src = torch.randn(n, generator=gen).to(dtype)
    other = torch.randn(n, generator=gen).to(torch.float32)
    for shift in (1, 3):
        a_dst, a_src = other.clone(), src.clone()
        o_dst, o_src = odd(n, torch.float32, shift, other), odd(n, dtype, shift, src)
        for d, s in ((a_dst, a_src), (o_dst, o_src)):
            C.scale_cast_add(d.data_ptr(), F32, s.data_ptr(), _core.DTYPE_CODES[dtype], n, 3.0,
                             True)
        assert torch.equal(a_dst, o_dst)
        assert (C.norm_partial(o_src.data_ptr(), _core.DTYPE_CODES[dtype], n, 2.0)
                == C.norm_partial(a_src.data_ptr(), _core.DTYPE_CODES[dtype], n, 2.0))
        plan = [(0, n, -(-n // 2), 0, 1)]
        outs = [torch.empty(2 * -(-n // 2)), odd(2 * -(-n // 2), torch.float32, shift)]
        for out, s in zip(outs, (a_src, o_src)):
            C.chunk_pack(out.data_ptr(), out.numel(), F32, s.data_ptr(), n,
                         _core.DTYPE_CODES[dtype], plan, 2, -(-n // 2), 0, 2, 2.0, 1)
        assert torch.equal(outs[0], outs[1])
        sums = [torch.empty(n, dtype=dtype), odd(n, dtype, shift)]
        for out, s in zip(sums, (a_src, o_src)):
            C.shm_reduce(out.data_ptr(), [s.data_ptr(), s.data_ptr(), s.data_ptr()], n,
                         _core.DTYPE_CODES[dtype], 0.5, 1)
        assert torch.equal(sums[0].view(torch.uint8), sums[1].view(torch.uint8))


def test_odd_addresses_in_collectives():
    """reduce_scatter / all_reduce / reduce_scatter_pack sum and cast on odd addresses."""
    views = _pair()
    n = 300
    try:
        for dtype in (torch.float32, torch.bfloat16):
            code = _core.DTYPE_CODES[dtype]
            ins = [odd(2 * n, dtype, 1, torch.arange(2 * n, dtype=dtype) * (r + 1))
                   for r in range(2)]
            outs = [odd(n, dtype, 3) for _ in range(2)]
            total = ins[0].float() + ins[1].float()  # the kernel: a float32 sum, rounded once
            for w in [v.reduce_scatter(o.data_ptr(), i.data_ptr(), n, code, 0.5, 1, (o, i))
                      for v, o, i in zip(views, outs, ins)]:
                w.wait()
            want = (total * 0.5).to(dtype)
            assert torch.equal(outs[0], want[:n]) and torch.equal(outs[1], want[n:])
            for w in [v.all_reduce(i.data_ptr(), i.data_ptr(), 2 * n, code, 1.0, 1, (i,))
                      for v, i in zip(views, ins)]:
                w.wait()
            assert all(torch.equal(i, total.to(dtype)) for i in ins)
            grads = [odd(2 * n, torch.float32, 1, torch.arange(2 * n, dtype=torch.float32))
                     for _ in range(2)]
            blob = array.array("q", [0, 2 * n, n, 0, 1]).tobytes()
            for w in [v.reduce_scatter_pack(o.data_ptr(), n, code, g.data_ptr(), 2 * n, F32,
                                            2.0, 1.0, blob, 1, (o, g))
                      for v, o, g in zip(views, outs, grads)]:
                w.wait()
            want = (torch.arange(2 * n, dtype=torch.float32) / 2).to(dtype).to(torch.float32)
            want = (want + want).to(dtype)
            assert torch.equal(outs[0], want[:n]) and torch.equal(outs[1], want[n:])
    finally:
        for v in views:
            v.close()


def test_odd_addresses_in_optimizer_steps():
    """The fused steps refuse an odd address (their loops take aligned fp32); through
    _core such a buffer takes the twin."""
    bufs = [odd(8, torch.float32, 2, torch.ones(8)) for _ in range(4)]
    with pytest.raises(ValueError, match="param: address .* not aligned"):
        C.sgd_step(bufs[0].data_ptr(), bufs[1].data_ptr(), None, [(0, 8)], F32, 0.5, 0.0, 0.0,
                   0.0, False, False, False, 1)
    hp = dict(lr=0.5, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
              maximize=False, first_step=False)
    want = [torch.ones(8) for _ in range(4)]
    _ref.sgd_step(want[0], want[1], None, [(0, 8)], **hp)
    _core.sgd_step(bufs[0], bufs[1], None, [(0, 8)], **hp)
    assert torch.equal(bufs[0], want[0])


# ----------------------------------------------------------------------------------------
# bounds
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, exc, match", [
    (([1] * 10, 0, 2**40), ValueError, "world_size must be <= 65536"),
    (([10] * 1000, 3, 2**20), ValueError, "world_size must be <= 65536"),
    (([10] * 1000, 3, 2**16), ValueError, "more than 4194304 .rank, parameter. pieces"),
    (([1] * (MAX_PIECES // 4 + 1), 0, 4), ValueError, "wrap the model into smaller units"),
])
def test_layout_sizes_are_bounded(args, exc, match):
    t0 = time.perf_counter()
    with pytest.raises(exc, match=match):
        C.plan_layout(*args)
    with pytest.raises(exc, match=match):
        _ref.plan_layout_lists(*args)
    assert time.perf_counter() - t0 < 5  # before: ~240 TB asked for, or minutes
    assert C.MAX_WORLD_SIZE == MAX_WORLD_SIZE and C.MAX_PIECES == MAX_PIECES


def test_chunk_plans_are_bounded():
    nat, g = torch.zeros(4), torch.zeros(4)
    for world, plan, match in [(MAX_WORLD_SIZE + 1, [], "world_size must be <= 65536"),
                               (2**16, [(0, 0, 0, 0, 1)] * 65, "more than 4194304")]:
        with pytest.raises(ValueError, match=match):
            C.chunk_unpack(nat.data_ptr(), 4, g.data_ptr(), 0, 4, plan, world, 0, 1)
        with pytest.raises(ValueError, match=match):
            C.chunk_pack(g.data_ptr(), 0, F32, nat.data_ptr(), 4, F32, plan, world, 0, 0, 0,
                         1.0, 1)
        with pytest.raises(ValueError, match=match):
            _ref.chunk_pack(torch.zeros(0), nat, plan, world, 0, 1.0, (0, 0))


def test_shm_slot_is_bounded():
    name = f"/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}"
    with pytest.raises(ValueError, match="slot_bytes must be a multiple of 64 in"):
        C.ShmGroup(name, True, 2, 0, (1 << 30) + 64, 1.0, "big", [0, 1])


def test_addresses_must_be_non_negative():
    x = torch.zeros(4)
    for bad, what in [(-1, "negative"), (-x.data_ptr(), "negative"), (2**63, "too large"),
                      (2**64 + 8, "too large")]:
        with pytest.raises(ValueError, match=f"dst_addr must be an address in .*{what}"):
            C.scale_cast_add(bad, F32, x.data_ptr(), F32, 4, 1.0, False)
    C.scale_cast_add(0, F32, 0, F32, 0, 1.0, False)  # NULL with nothing to touch


# ----------------------------------------------------------------------------------------
# what may cross into C
# ----------------------------------------------------------------------------------------


def _calls(monkeypatch):
    calls = []
    if _core._C is not None:
        for name in ("scale_cast_add", "norm_partial", "chunk_pack", "chunk_unpack",
                     "shard_fill", "shm_reduce", "shm_memcpy", "sgd_step", "adam_step"):
            fn = getattr(_core._C, name)
            monkeypatch.setattr(_core._C, name,
                                lambda *a, _f=fn, _n=name: (calls.append(_n), _f(*a))[1])
    return calls


KINDS = ["wrapper", "fake", "neg", "functional", "plain"]


def _make(kind, t):
    if kind == "wrapper":
        return Wrapper(t.clone())
    if kind == "neg":
        return torch._neg_view(-t)  # lazy negation: same values, memory holds -t
    return t.clone()


@pytest.mark.parametrize("kind", ["wrapper", "neg", "plain"])
def test_core_routes_tensors_that_must_not_cross(kind, monkeypatch):
    """Every tensor entry point of _core on tensors C must not read gives the twins'
    result (in the wrapper's own arithmetic) and calls no C; plain ones take C."""
    calls = _calls(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, generator=gen), torch.randn(8, generator=gen)

    def unwrap(t):
        return t.inner if isinstance(t, Wrapper) else t.clone().resolve_neg()

    dst, src = _make(kind, a), _make(kind, b)
    _core.scale_cast_add(dst, src, 2.0, True)
    want = a.clone()
    _ref.scale_cast_add(want, b, 2.0, True)
    assert torch.equal(unwrap(dst), want)
    assert _core.norm_partial(_make(kind, a), 2.0).item() == _ref.norm_partial(a, 2.0).item()
    plan = [(0, 8, 4, 0, 1)]
    g = _make(kind, torch.zeros(8))
    _core.chunk_pack(g, _make(kind, a), plan, 2, 4, divisor=2.0)
    want = torch.zeros(8)
    _ref.chunk_pack(want, a, plan, 2, 4, 2.0)
    assert torch.equal(unwrap(g), want)
    nat = _make(kind, torch.zeros(8))
    _core.chunk_unpack(nat, _make(kind, b), plan, 2, 4)
    assert torch.equal(unwrap(nat), b)
    out = _make(kind, torch.zeros(8))
    _core.shm_reduce(out, [_make(kind, a), _make(kind, b)], 0.5)
    want = torch.zeros(8)
    _ref.shm_reduce(want, [a, b], 0.5)
    assert torch.equal(unwrap(out), want)
    shard = _make(kind, torch.ones(8))
    _core.shard_fill(shard, 4, [_make(kind, a)], [0])
    assert torch.equal(unwrap(shard), torch.cat([a[4:], torch.zeros(4)]))
    p, gr = _make(kind, a), _make(kind, b)
    hp = dict(lr=0.5, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
              maximize=False, first_step=False)
    _core.sgd_step(p, gr, None, [(0, 8)], **hp)
    assert torch.equal(unwrap(p), a - 0.5 * b)
    if kind == "plain" and _core._C is not None:
        assert sorted(set(calls)) == ["chunk_pack", "chunk_unpack", "norm_partial",
                                      "scale_cast_add", "sgd_step", "shard_fill", "shm_reduce"]
    else:
        assert calls == []
    assert (_core.admit((_make(kind, a),), dtypes=comm._SHM_DTYPES) is not None) == (kind == "plain")


def test_core_refuses_fake_meta_and_functorch_tensors(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = _calls(monkeypatch)
    with FakeTensorMode():
        fake = torch.ones(4)
    assert not _core.c_tensor_ok(fake)
    assert not _core.c_tensor_ok(torch.ones(4, device="meta"))
    seen = []
    torch.vmap(lambda x: seen.append(_core.c_tensor_ok(x)) or x)(torch.ones(3, 4))
    torch.func.functionalize(lambda x: seen.append(_core.c_tensor_ok(x)) or x + 1)(torch.ones(3))
    assert seen == [False, False]
    assert not _core.c_tensor_ok(torch.ones(4).to_sparse())
    out = torch.empty(4, device="meta")
    _core.scale_cast_add(out, torch.ones(4, device="meta"), 1.0, False)  # torch ops on meta
    assert calls == []


def test_shrunk_storage_is_an_error_on_every_path(monkeypatch):
    """A tensor whose storage was shrunk (untyped_storage().resize_()) would make C, and
    torch's own ops, read past the storage: a ValueError, whatever the backend."""
    calls = _calls(monkeypatch)
    for make in (lambda: torch.ones(8)[2:], lambda: torch.ones(8)):
        t = make()
        t.untyped_storage().resize_(8 if t.storage_offset() else 0)
        with pytest.raises(ValueError, match="storage"):
            _core.norm_partial(t, 2.0)
        with pytest.raises(ValueError, match="storage"):
            _core.scale_cast_add(torch.zeros(t.numel()), t, 1.0, False)
        monkeypatch.setattr(_core, "_C", None)
        with pytest.raises(ValueError, match="storage"):
            _core.norm_partial(t, 2.0)
        monkeypatch.undo()
        calls = _calls(monkeypatch)
    assert calls == []
    with pytest.raises(ValueError, match="storage"):
        _core.admit((t,), dtypes=comm._SHM_DTYPES)  # the route decision of comm


class _Sub(torch.Tensor):
    """A plain subclass: memory of its own at its address, but not a type that may cross."""


@pytest.mark.parametrize("when", ["first_step", "later_step"])
@pytest.mark.parametrize("kind", ["sub", "neg"])
@pytest.mark.parametrize("opt", ["SGD", "Adam"])
def test_fused_optimizer_gradient_that_may_not_cross(when, kind, opt):
    """A gradient that may not cross into C (a subclass; a lazily negated one, which C would
    read un-negated: a wrong step) is stepped as torch.optim steps it, whether it comes when
    the plan is built or on a later step (the plan's per-step check)."""
    from cfsdp import optim as co

    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    odd = {"sub": lambda: b.clone().as_subclass(_Sub), "neg": lambda: torch._neg_view(-b)}[kind]
    kw = dict(lr=0.5, momentum=0.9) if opt == "SGD" else dict(lr=0.5)
    p, want = torch.nn.Parameter(a.clone()), torch.nn.Parameter(a.clone())
    mine, theirs = getattr(co, opt)([p], **kw), getattr(torch.optim, opt)([want], foreach=False, **kw)
    steps = [odd, b.clone] if when == "first_step" else [b.clone, odd]
    for make in steps:
        p.grad, want.grad = make(), b.clone()
        mine.step()
        theirs.step()
    torch.testing.assert_close(p.detach(), want.detach(), rtol=1e-6, atol=0)


def _core_pair():
    """Two ``_core.ShmView``s of one fresh segment (ranks 0 and 1 in this process)."""
    name = f"/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}"
    views = [_core.ShmView(name, r == 0, 2, r, 4096, 30.0, "boundary", [0, 1]) for r in range(2)]
    for v in views:
        v.wait_attached()
    return views


def test_admission_is_the_check_and_covers_only_its_tensors():
    """comm decides a shared-memory route with ``_core.admit`` and hands the ``Admitted``
    to the segment op, which then does not check the same tensors again; given other
    tensors, the op checks them as always (a non-contiguous one is refused, not read)."""
    a, b = torch.ones(8), torch.ones(8)
    adm = _core.admit((a,))
    assert adm is not None and adm.covers((a,)) and not adm.covers((b,))
    assert _core.admit((a, torch.ones(8, dtype=torch.float64))) is None  # two dtypes
    assert _core.admit((torch.ones(8, dtype=torch.int64),)) is None  # not a segment dtype
    assert _core.admit((a,), other=torch.ones(4, 4).t()) is None  # other not contiguous
    both = _core.admit((a,), other=torch.ones(4, dtype=torch.float64))
    assert both is not None and both.codes == (_core.DTYPE_CODES[torch.float32],
                                               _core.DTYPE_CODES[torch.float64])
    shrunk = torch.ones(8, dtype=torch.int64)
    shrunk.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="needs 64 bytes of storage"):
        _core.admit((shrunk,))  # the storage check holds whatever the dtype
    if _core._C is None:  # the twins' pass (CFSDP_IMPL=python): no segment, and it says why
        with pytest.raises(RuntimeError, match="need the C core"):
            _core_pair()
        return
    views = _core_pair()
    try:
        xs = [torch.ones(16) for _ in range(2)]
        works = [v.all_reduce(x, 1.0, 1, admitted=_core.admit((x,))) for v, x in zip(views, xs)]
        for w in works:
            w.wait()
        assert all(torch.equal(x, torch.full((16,), 2.0)) for x in xs)
        strided = torch.ones(4, 8).t()
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            views[0].all_reduce(strided, 1.0, 1, admitted=adm)  # adm is a's, not strided's
    finally:
        for v in views:
            v.close()


def test_fused_plan_checks_in_full_once_and_cheaply_per_step():
    """cfsdp.optim's crossing, ``_core.FusedPlan``: every tensor it is built from is checked
    in full (a shrunk storage is the door's ValueError; a tensor that may not cross, an
    AssertionError: the caller routes by ``fused_ok``), and each step's ``refresh`` refuses
    what can change between steps: a gradient that may not cross (subclass, lazily negated,
    strided, fp64, another numel, one its storage no longer holds) or at another offset
    than its bucket's, and a parameter whose memory moved."""
    flat, gbuf, m, v = torch.randn(24), torch.randn(24), torch.zeros(24), torch.zeros(24)
    ps, gs = [flat[0:8], flat[8:16]], [gbuf[0:8], gbuf[8:16]]
    states = [(m[0:8], v[0:8]), (m[8:16], v[8:16])]
    plan = _core.FusedPlan(["a", "b"], ps, gs, states, [False, False])
    assert [(b.entries, list(b.ranges)) for b in plan.buckets] == [(["a", "b"], [0, 16])]
    assert plan.refresh(gs) and plan.buckets[0].grad_delta == gbuf.data_ptr() - flat.data_ptr()
    g2 = torch.randn(16)
    assert plan.refresh([g2[0:8], g2[8:16]])  # a new gradient buffer, same relative layout
    assert plan.buckets[0].grad_delta == g2.data_ptr() - flat.data_ptr()
    # at the gradient's own address (all but the last: another offset than the bucket's)
    odd = [gs[0].as_subclass(_Sub), torch._neg_view(gs[0]), gbuf[0:16:2],
           gbuf.view(torch.float64)[0:8], gbuf[0:7], torch.randn(8)]
    assert all(g.data_ptr() == gs[0].data_ptr() for g in odd[:-1])
    for g in odd:
        assert not plan.refresh([g, gs[1]]), g
    assert plan.refresh(gs)
    # a gradient whose storage was resized smaller than it (numel, shape and contiguity
    # unchanged): C would read past the end of its memory
    g3 = torch.randn(16)
    g3s = [g3[0:8], g3[8:16]]
    assert plan.refresh(g3s)
    g3.untyped_storage().resize_(4 * 12)
    assert g3s[1].numel() == 8 and g3s[1].is_contiguous() and not plan.refresh(g3s)
    assert plan.refresh(gs)
    ps[1].data = ps[1].clone()  # the parameter moved (as ZeRO rebuilding its buckets)
    assert not plan.refresh(gs)
    bad = [(ps[0], gs[0].as_subclass(_Sub), states[0]),
           (ps[0], gs[0], (m[0:8].double(), v[0:8])),
           (ps[0], gs[0], (m[0:8], torch._neg_view(v[0:8]))),
           (ps[0], gs[0], (m[0:7], v[0:8]))]
    for p, g, st in bad:
        with pytest.raises(AssertionError, match="may not be stepped in C"):
            _core.FusedPlan(["a"], [p], [g], [st], [False])
    shrunk = torch.zeros(8)
    shrunk.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="storage"):
        _core.FusedPlan(["a"], [ps[0]], [gs[0]], [(shrunk, v[0:8])], [False])
