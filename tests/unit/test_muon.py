"""cfsdp.optim.Muon (issue 27 phase 1: whole parameters) against torch.optim.Muon: bit for
bit over several steps and options, state dicts both ways, the C momentum pass against its
twin and torch, Newton–Schulz of stacks against torch's per-matrix function, 3-D parameters,
errors (1-D, complex, sparse, sharded), the owner assignment and the exchange's buckets
(``_muon_owners``), the blocks and bf16 wire of the exchange (``_muon_shard``,
``_muon_bucket``)."""

from __future__ import annotations

import copy
import inspect
import itertools
import math
import random

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

import cfsdp
import cfsdp._C as C
from cfsdp import _core
from cfsdp._ref import optim as ref
from cfsdp.optim import _muon
from cfsdp.optim import _muon_bucket
from cfsdp.optim._muon_owners import assign_owners, ns_cost, plan_buckets
from cfsdp.optim._muon_mesh import block, group_ranks
from cfsdp.optim._muon_shard import chunk_blocks, chunk_sizes

_CORE_MOMENTUM = _core.muon_momentum
NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)
SHAPES = [(8, 8), (24, 6), (6, 24), (16, 16), (24, 6), (5, 33), (1, 9)]


def _params(shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def _train(opt, params, steps, start=0):
    for s in range(start, start + steps):
        _grads(params, s)
        opt.step()


def _same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x.detach(), y.detach()), (x - y).abs().max()


# --------------------------------------------------------------------- parity with torch

@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_bitwise_like_torch(nesterov, adjust_lr_fn):
    kw = dict(lr=0.02, weight_decay=0.05, momentum=0.9, nesterov=nesterov,
              adjust_lr_fn=adjust_lr_fn)
    ours, theirs = _params(SHAPES), _params(SHAPES)
    o, t = cfsdp.optim.Muon(ours, **kw), torch.optim.Muon(theirs, **kw)
    calls = []
    with pytest.MonkeyPatch.context() as mp:  # every parameter's momentum crosses _core
        mp.setattr(_core, "muon_momentum",
                   lambda *a, **k: calls.append(1) or _CORE_MOMENTUM(*a, **k))
        _train(o, ours, 3)
    assert len(calls) == 3 * len(SHAPES)
    _train(t, theirs, 3)
    _same(ours, theirs)
    _same([o.state[p]["momentum_buffer"] for p in ours],
          [t.state[p]["momentum_buffer"] for p in theirs])


def test_signature_defaults_and_state_dict_format():
    assert issubclass(cfsdp.optim.Muon, torch.optim.Muon)
    def sig(cls):
        return [(q.name, q.kind, q.default)
                for q in inspect.signature(cls.__init__).parameters.values()]

    assert sig(cfsdp.optim.Muon) == sig(torch.optim.Muon)
    ours, theirs = _params(SHAPES[:2]), _params(SHAPES[:2])
    o, t = cfsdp.optim.Muon(ours), torch.optim.Muon(theirs)
    assert o.param_groups[0].keys() == t.param_groups[0].keys()
    assert o.defaults == t.defaults
    _train(o, ours, 1)
    _train(t, theirs, 1)
    so, st = o.state_dict(), t.state_dict()
    assert so["param_groups"] == st["param_groups"]
    assert {k: list(v) for k, v in so["state"].items()} == {k: list(v) for k, v in st["state"].items()}


@pytest.mark.no_core
@pytest.mark.parametrize("bad, match", [
    (dict(lr=-1.0), "Learning rate should be >= 0"),
    (dict(momentum=-0.5), "momentum should be >= 0"),
    (dict(weight_decay=-0.1), "weight decay should be >= 0"),
    (dict(adjust_lr_fn="nope"), "Adjust learning rate function nope is not supported"),
    (dict(lr=torch.tensor([1.0, 2.0])), "Tensor lr must be 1-element"),
])
def test_validation_is_torchs(bad, match):
    with pytest.raises(ValueError, match=match):
        torch.optim.Muon(_params([(2, 2)]), **bad)
    with pytest.raises(ValueError, match=match):
        cfsdp.optim.Muon(_params([(2, 2)]), **bad)


@pytest.mark.parametrize("first", ["cfsdp", "torch"])
def test_state_dict_loads_both_ways(first):
    kw = dict(lr=0.02, momentum=0.95)
    cls = {"cfsdp": cfsdp.optim.Muon, "torch": torch.optim.Muon}
    second = "torch" if first == "cfsdp" else "cfsdp"
    ref_params = _params(SHAPES)
    ref_opt = torch.optim.Muon(ref_params, **kw)
    _train(ref_opt, ref_params, 4)

    a = _params(SHAPES)
    oa = cls[first](a, **kw)
    _train(oa, a, 2)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ob = cls[second](b, **kw)
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    _train(ob, b, 2, start=2)
    _same(b, ref_params)


# ------------------------------------------------------------------ the C momentum pass

def _c_momentum(grad, buf, upd, ranges, *, momentum, nesterov):
    C.muon_momentum(grad.data_ptr(), buf.data_ptr(), upd.data_ptr(), ranges, 0, momentum,
                    nesterov, 1)


@pytest.mark.parametrize("momentum", [0.95, 0.5, 0.3, 0.0])
@pytest.mark.parametrize("nesterov", [True, False])
def test_c_momentum_matches_twin_and_torch(momentum, nesterov):
    g0 = torch.Generator().manual_seed(7)
    n = 1037  # vector body and scalar tail
    grad, buf0 = torch.randn(n, generator=g0), torch.randn(n, generator=g0)
    ranges = [(0, 5), (8, 500), (600, 437)]
    outs = []
    for fn in (_c_momentum, _core.muon_momentum, ref.muon_momentum):
        b, u = buf0.clone(), torch.full((n,), -1.0)
        fn(grad, b, u, ranges, momentum=momentum, nesterov=nesterov)
        outs.append((b, u))
    _same(outs[0], outs[2])
    _same(outs[1], outs[2])
    bt = buf0.clone()
    for s, ln in ranges:
        bt[s:s + ln].lerp_(grad[s:s + ln], 1 - momentum)
    assert torch.equal(outs[0][0], bt)
    if nesterov:
        ut = torch.full((n,), -1.0)
        for s, ln in ranges:
            ut[s:s + ln] = grad[s:s + ln].lerp(bt[s:s + ln], momentum)
        assert torch.equal(outs[0][1], ut)
    else:  # untouched
        assert torch.equal(outs[0][1], torch.full((n,), -1.0))


def test_c_momentum_threads_same_bits():
    n = C.OPTIM_PARALLEL_BYTES // 16 * 3 + 7
    ranges = [(1, 1001), (1005, n // 2), (n // 2 + 2000, n - n // 2 - 2001)]
    gen = torch.Generator().manual_seed(5)
    g, b0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    outs = []
    for threads in (1, C.MAX_THREADS):
        b, u = b0.clone(), torch.zeros(n)
        C.muon_momentum(g.data_ptr(), b.data_ptr(), u.data_ptr(), ranges, 0, 0.95, True,
                        threads)
        outs.append((b, u))
    _same(outs[0], outs[1])


def test_c_momentum_errors_match_twin():
    g, b, u = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    for fn in (_c_momentum, _core.muon_momentum, ref.muon_momentum):
        with pytest.raises(ValueError, match="overlaps or precedes"):
            fn(g, b, u, [(4, 2), (0, 2)], momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="past a buffer"):
        _core.muon_momentum(g, b, u, [(0, 9)], momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="grad and momentum_buffer overlap"):
        _c_momentum(g, g, u, [(0, 8)], momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="fp32 buffers"):
        C.muon_momentum(g.data_ptr(), b.data_ptr(), None, [(0, 8)], 1, 0.9, False, 1)
    with pytest.raises(ValueError, match="update: NULL"):
        C.muon_momentum(g.data_ptr(), b.data_ptr(), None, [(0, 8)], 0, 0.9, True, 1)
    C.muon_momentum(g.data_ptr(), b.data_ptr(), None, [(0, 8)], 0, 0.9, False, 1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
def test_other_dtypes_take_torch_ops(dtype, nesterov):
    shapes = [(8, 4), (4, 8), (8, 4)]
    ours, theirs = _params(shapes, dtype=dtype), _params(shapes, dtype=dtype)
    o = cfsdp.optim.Muon(ours, lr=0.02, nesterov=nesterov)
    t = torch.optim.Muon(theirs, lr=0.02, nesterov=nesterov)
    for opt, ps in ((o, ours), (t, theirs)):
        _train(opt, ps, 2)
    _same(ours, theirs)
    _same([o.state[p]["momentum_buffer"] for p in ours],
          [t.state[p]["momentum_buffer"] for p in theirs])


@pytest.mark.parametrize("nesterov", [True, False])
def test_duplicate_parameter_stepped_twice_like_torch(nesterov):
    ours, theirs = _params([(6, 4), (6, 4)]), _params([(6, 4), (6, 4)])
    with pytest.warns(UserWarning, match="duplicate"):
        o = cfsdp.optim.Muon([ours[0], ours[1], ours[0]], nesterov=nesterov)
    with pytest.warns(UserWarning, match="duplicate"):
        t = torch.optim.Muon([theirs[0], theirs[1], theirs[0]], nesterov=nesterov)
    _train(o, ours, 2)
    _train(t, theirs, 2)
    _same(ours, theirs)
    _same([o.state[p]["momentum_buffer"] for p in ours],
          [t.state[p]["momentum_buffer"] for p in theirs])


def test_complex_checked_before_any_update():
    """As torch's _init_group: a complex parameter later in the group raises before the
    earlier ones change (their buffers are created, zero)."""
    a = _params([(4, 4)])[0]
    c = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    a.grad, c.grad = torch.randn(4, 4), torch.randn_like(c)
    before = a.detach().clone()
    opt = cfsdp.optim.Muon([a, c])
    with pytest.raises(RuntimeError, match="complex"):
        opt.step()
    assert torch.equal(a.detach(), before)
    assert torch.equal(opt.state[a]["momentum_buffer"], torch.zeros(4, 4))


def test_strided_parameter():
    ours = [torch.nn.Parameter(torch.randn(6, 10).t())]
    theirs = [torch.nn.Parameter(ours[0].detach().clone())]
    o, t = cfsdp.optim.Muon(ours, lr=0.02), torch.optim.Muon(theirs, lr=0.02)
    for opt, ps in ((o, ours), (t, theirs)):
        for s in range(2):
            ps[0].grad = torch.randn(6, 10, generator=torch.Generator().manual_seed(s)).t()
            opt.step()
    _same(ours, theirs)


# ------------------------------------------------------------- Newton–Schulz, 3-D params

@pytest.mark.no_core
@pytest.mark.parametrize("shape, seed", [((4, 8, 16), 3), ((3, 16, 8), 3), ((2, 33, 17), 3),
                                         ((5, 12, 12), 3), ((2, 1, 7), 3), ((3, 6, 8), 58),
                                         ((4, 6, 8), 0), ((8, 6, 8), 27), ((4, 8, 6), 5)])
def test_newton_schulz_is_torchs_per_matrix(shape, seed):
    """Every matrix of a stack (a 3-D parameter; the owner's gathered matrices) comes out as
    torch's function of it, bit for bit.  The (E, 6, 8) cases at these seeds are stacks whose
    batched run (the same ops with ``baddbmm``, what cfsdp did before 2026-12-03) differs from
    torch's per-matrix ``addmm`` by a bf16 ulp on torch 2.13's CPU build ([Note: Newton-Schulz
    per matrix]): they fail if batching comes back."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    want = torch.stack([torch_ns(m, *NS) for m in x])
    assert torch.equal(_muon._newton_schulz(x, *NS), want)
    assert torch.equal(_muon._newton_schulz(x[0], *NS), want[0])
    group = {"ns_coefficients": NS[0], "ns_steps": NS[1], "eps": NS[2]}
    got = _muon.Muon._cf_orthogonalize([x.bfloat16(), x[:1].clone()], group, gathered=True)
    assert torch.equal(got[0].reshape(want.shape), want)
    assert torch.equal(got[1].reshape(want[:1].shape), want[:1])


def test_empty_matrices_like_torch():
    shapes = [(0, 4), (4, 4)]
    ours, theirs = _params(shapes), _params(shapes)
    o, t = cfsdp.optim.Muon(ours), torch.optim.Muon(theirs)
    _train(o, ours, 2)
    _train(t, theirs, 2)
    _same(ours, theirs)
    for cls in (torch.optim.Muon, cfsdp.optim.Muon):  # torch's _adjust_lr divides by n
        with pytest.raises(ZeroDivisionError):
            p = _params([(3, 0)])
            _train(cls(p), p, 1)
    empty = _params([(2, 0, 3), (0, 3, 3)])
    _train(cfsdp.optim.Muon(empty), empty, 1)
    assert [tuple(p.shape) for p in empty] == [(2, 0, 3), (0, 3, 3)]


def test_3d_parameters_per_trailing_matrix():
    """Stacked experts: each [M, N] slice stepped as torch steps a 2-D parameter of that
    shape (and stacked with same-shape 2-D parameters of the group)."""
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    ours = _params([(3, 8, 4), (8, 4), (2, 4, 8)])
    theirs = [torch.nn.Parameter(s.detach().clone())
              for p in ours for s in (p.unbind(0) if p.ndim == 3 else [p])]
    o, t = cfsdp.optim.Muon(ours, **kw), torch.optim.Muon(theirs, **kw)
    for s in range(3):
        _grads(ours, s)
        slices = [gs for p in ours for gs in (p.grad.unbind(0) if p.ndim == 3 else [p.grad])]
        for p, g in zip(theirs, slices):
            p.grad = g.clone()
        o.step()
        t.step()
    got = [s for p in ours for s in (p.unbind(0) if p.ndim == 3 else [p])]
    _same(got, theirs)


# ----------------------------------------------------------------------------- errors

@pytest.mark.no_core
def test_1d_parameter_named():
    lin = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError) as torch_err:
        torch.optim.Muon(lin.parameters())
    with pytest.raises(ValueError) as ours:
        cfsdp.optim.Muon(lin.named_parameters())
    msg = str(ours.value)
    assert str(torch_err.value) in msg and "'bias'" in msg and "AdamW" in msg
    with pytest.raises(ValueError, match="parameter 1 of param group 0"):
        cfsdp.optim.Muon(lin.parameters())
    opt = cfsdp.optim.Muon([lin.weight])
    with pytest.raises(ValueError, match="AdamW"):
        opt.add_param_group({"params": [lin.bias]})
    assert len(opt.param_groups) == 1


@pytest.mark.no_core
def test_complex_and_sparse_are_torchs_errors():
    for make, msg in ((lambda: torch.randn(3, 3, dtype=torch.complex64), "complex parameters"),
                      (lambda: torch.randn(3, 3), "sparse gradients")):
        for cls in (torch.optim.Muon, cfsdp.optim.Muon):
            p = torch.nn.Parameter(make())
            p.grad = torch.randn_like(p)
            if "sparse" in msg:
                p.grad = p.grad.to_sparse()
            with pytest.raises(RuntimeError, match=f"^Muon does not support {msg}$"):
                cls([p]).step()


@pytest.mark.no_core
def test_flattened_parameter_is_not_implemented():
    p = torch.nn.Parameter(torch.randn(12))
    p._cfsdp_flattened = True
    with pytest.raises(NotImplementedError, match="issue 27 phase 2.*'w.flat'.*wrapper"):
        cfsdp.optim.Muon([("w.flat", p)])


@pytest.mark.usefixtures("one_rank_group")
def test_dtensor_sharded_vs_whole():
    """A DTensor on a one-rank mesh is whole (stepped like its local tensor); one placed over
    more ranks in a way Muon cannot reassemble (Partial, _StridedShard) raises, naming it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (1,))
    local = torch.randn(8, 4)
    ours = torch.nn.Parameter(DTensor.from_local(local.clone(), mesh, [Shard(0)]))
    theirs = torch.nn.Parameter(local.clone())
    o, t = cfsdp.optim.Muon([ours], lr=0.02), torch.optim.Muon([theirs], lr=0.02)
    for s in range(2):
        g = torch.randn(8, 4, generator=torch.Generator().manual_seed(s))
        ours.grad = DTensor.from_local(g.clone(), mesh, [Shard(0)])
        theirs.grad = g.clone()
        o.step()
        t.step()
    assert torch.equal(ours.to_local(), theirs.detach())
    assert isinstance(o.state[ours]["momentum_buffer"], DTensor)

    class _Mesh:  # what _sharded reads of a mesh of two ranks
        shape = (2,)

        def size(self, dim):
            return 2

    partial = torch.nn.Parameter(DTensor.from_local(local.clone(), mesh, [Partial()]))
    strided = torch.nn.Parameter(DTensor.from_local(local.clone(), mesh,
                                                    [_StridedShard(0, split_factor=2)]))
    whole = torch.nn.Parameter(DTensor.from_local(local.clone(), mesh, [Replicate()]))
    opt = cfsdp.optim.Muon([("r", whole)])
    whole.grad = DTensor.from_local(torch.ones(8, 4), mesh, [Partial()])
    replicated = DTensor.from_local(local.clone(), mesh, [Replicate()])
    with pytest.MonkeyPatch.context() as mp:  # the mesh as two ranks would see it
        mp.setattr(DTensor, "device_mesh", property(lambda self: _Mesh()))
        assert _muon._sharded(replicated) is None
        # layouts whose chunks are not torch.chunk along one dim: refused, named, what to use
        with pytest.raises(NotImplementedError, match="'w'.*Partial.*fully_shard"):
            cfsdp.optim.Muon([("w", partial)])
        with pytest.raises(NotImplementedError, match="'s'.*_StridedShard.*fully_shard"):
            cfsdp.optim.Muon([("s", strided)])
        # a replicated parameter with an unreduced (Partial) gradient: its local gradient is
        # not the whole one, so stepping it would be another number than torch's; refused
        with pytest.raises(NotImplementedError, match="'r'.*gradient is a DTensor.*Partial"):
            opt.step()
        assert torch.equal(whole.to_local(), local)  # nothing stepped


def _bias_free_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4, bias=False))


@pytest.mark.usefixtures("one_rank_group")
def test_fully_shard_and_wrapper_one_rank_are_whole():
    """cfsdp.fully_shard on one rank: DTensor parameters sharded over a one-rank mesh are
    whole, stepped as torch.optim.Muon steps the plain model; so is the wrapper's (NO_SHARD on
    one rank) flat parameter, matrix by matrix, and its use_orig_params=True originals.  A flat
    parameter holding a 1-D original raises torch's ValueError with the original's FQN."""
    model, ref = _bias_free_mlp(), _bias_free_mlp()
    cfsdp.fully_shard(model)
    o = cfsdp.optim.Muon(model.parameters(), lr=0.02)
    t = torch.optim.Muon(ref.parameters(), lr=0.02)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    for m, opt in ((model, o), (ref, t)):
        for _ in range(2):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    _same([p.to_local() for p in model.parameters()], list(ref.parameters()))
    for orig in (False, True):
        w = cfsdp.FullyShardedDataParallel(_bias_free_mlp(), use_orig_params=orig)
        o, ref = cfsdp.optim.Muon(w.parameters(), lr=0.02), _bias_free_mlp()
        t = torch.optim.Muon(ref.parameters(), lr=0.02)
        for m, opt in ((w, o), (ref, t)):
            for _ in range(2):
                m(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        with cfsdp.FullyShardedDataParallel.summon_full_params(w):
            got = [w.module[0].weight.clone(), w.module[2].weight.clone()]
        _same(got, list(ref.parameters()))
    w = cfsdp.FullyShardedDataParallel(torch.nn.Linear(3, 4), use_orig_params=False)
    with pytest.raises(ValueError, match=r"^Muon only supports 2D parameters .*torch.Size\(\[4\]\)"
                       r" \(original parameter 'bias' .*use_orig_params=True"):
        cfsdp.optim.Muon(w.parameters())


# ------------------------------------------------------------------------------ owners

@pytest.mark.no_core
def test_owner_assignment_balanced_and_deterministic():
    rng = random.Random(0)
    for _ in range(50):
        shapes = [tuple(rng.choice([1, 3, 16, 64, 100]) for _ in range(rng.choice([2, 2, 3])))
                  for _ in range(rng.randint(0, 30))]
        for w in (1, 2, 3, 4, 8):
            owners = assign_owners(shapes, w)
            assert owners == assign_owners(shapes, w)
            assert all(0 <= r < w for r in owners) and len(owners) == len(shapes)
            costs = [ns_cost(s) for s in shapes]
            loads = [sum(c for c, r in zip(costs, owners) if r == k) for k in range(w)]
            assert max(loads) <= sum(costs) / w + max(costs, default=0)
    assert ns_cost((4, 8, 16)) == 4 * 8 * 16 * 8
    assert assign_owners([(4, 4), (8, 8), (2, 2)], 2) == [1, 0, 1]
    with pytest.raises(ValueError):
        ns_cost((5,))
    with pytest.raises(ValueError):
        assign_owners([(2, 2)], 0)


# ------------------------------------------------------------- sharded layouts: packing

@pytest.mark.no_core
@pytest.mark.parametrize("size", [0, 1, 3, 7, 8, 9, 12, 19])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_chunk_sizes_are_torch_chunk_padded(size, count):
    """torch.chunk's sizes along the dim, zeros for the chunks it does not make (FSDP2's
    empty shards past the last one)."""
    got = chunk_sizes(size, count)
    want = [c.shape[0] for c in torch.arange(size).chunk(count)] if size else []
    assert got == want + [0] * (count - len(want))
    assert sum(got) == size and len(got) == count


@pytest.mark.no_core
@pytest.mark.parametrize("shape, dim", [((9, 7), 0), ((9, 7), 1), ((3, 5, 4), 0), ((3, 5, 4), 2),
                                        ((2, 3), 0), ((0, 4), 0), ((63,), 0)])
@pytest.mark.parametrize("count", [2, 3, 4])
def test_chunk_blocks_are_torch_chunks_in_rank_order(shape, dim, count):
    """``chunk_blocks`` of torch.chunk's sizes: each rank's block is its torch.chunk piece
    (empty past the last), the blocks tile the tensor once; of uneven element ranges (the
    wrapper's flat shards, a 1-D view) each block is that rank's consecutive range."""
    full = torch.arange(math.prod(shape)).reshape(shape)
    splits = [chunk_sizes(shape[dim], count)]
    if len(shape) == 1:
        splits.append([shape[0] - 10 * (count - 1)] + [10] * (count - 1))
    for split in splits:
        cover = torch.zeros(shape, dtype=torch.int32)
        blocks = chunk_blocks(shape, dim, split)
        assert len(blocks) == count
        start = 0
        for (starts, sizes), k in zip(blocks, split):
            region = tuple(slice(a, a + b) for a, b in zip(starts, sizes))
            assert torch.equal(full[region], full.narrow(dim, start, k))
            cover[region] += 1
            start += k
        assert bool((cover == 1).all())
    chunks = full.chunk(count, dim)
    for i, (starts, sizes) in enumerate(chunk_blocks(shape, dim, splits[0])):
        want = chunks[i] if i < len(chunks) else full.narrow(dim, 0, 0)
        assert tuple(sizes) == tuple(want.shape)


@pytest.mark.no_core
def test_bucket_plan_bounded_each_matrix_once_deterministic():
    """``plan_buckets``: every matrix once, in index order, consecutive; each bucket within
    the bound unless it is one matrix larger than the bound (alone); no empty bucket; the same
    plan from the same sizes (every rank computes it from the shapes)."""
    rng = random.Random(3)
    for _ in range(200):
        sizes = [rng.choice([0, 1, 7, 64, 100, 1000, 5000]) for _ in range(rng.randint(0, 25))]
        bound = rng.choice([1, 50, 100, 1000, 4096])
        plan = plan_buckets(sizes, bound)
        assert plan == plan_buckets(list(sizes), bound)
        assert [k for b in plan for k in b] == list(range(len(sizes)))
        for b in plan:
            assert b, plan
            total = sum(sizes[k] for k in b)
            assert total <= bound or len(b) == 1, (sizes, bound, plan)
        for b, nxt in zip(plan, plan[1:]):  # a bucket closes only when the next would not fit
            assert sum(sizes[k] for k in b) + sizes[nxt[0]] > bound
    assert plan_buckets([3, 10, 2, 2, 1], 4) == [[0], [1], [2, 3], [4]]
    assert plan_buckets([], 4) == []
    with pytest.raises(ValueError):
        plan_buckets([1], 0)
    with pytest.raises(ValueError):
        plan_buckets([-1], 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bf16_wire_is_newton_schulz_first_rounding(dtype):
    """The exchange writes each piece into a bf16 send buffer (``copy_``); torch's
    Newton–Schulz begins with ``.bfloat16()`` of the whole matrix: the same elementwise
    rounding, so the owner's reassembled bf16 matrix is torch's operand bit for bit (fp64
    included: a value between two bf16 whose fp32 rounding is a tie rounds as torch does)."""
    g = torch.Generator().manual_seed(5)
    full = torch.randn(37, 23, generator=g, dtype=dtype) * torch.rand(37, 23, generator=g,
                                                                      dtype=dtype) ** 8
    full[0, :2] = torch.tensor([1 + 2 ** -8 + 2 ** -40, -(1 + 2 ** -8)], dtype=dtype)
    pieces = full.chunk(3, 1)
    wire = torch.empty(full.numel(), dtype=torch.bfloat16)
    off, parts = 0, []
    for t in pieces:
        parts.append(wire.narrow(0, off, t.numel()).view(t.shape))
        parts[-1].copy_(t)
        off += t.numel()
    got = torch.cat(parts, 1)
    assert torch.equal(got.view(torch.int16), full.bfloat16().view(torch.int16))


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("bound", [1, 3000, 1 << 30])
def test_exchange_buckets_one_rank_is_newton_schulz(bound, monkeypatch):
    """``_muon_bucket.exchange_blocks`` on a one-rank group, its buckets bounded to ``bound``
    bytes (one matrix each, a few, all in one): every matrix comes back orthogonalized as
    cfsdp's Muon orthogonalizes it (bf16 wire, stacked), in its own place, bit for bit with
    torch's per-matrix Newton–Schulz; fp32 and fp64 pieces, 2-D and 3-D."""
    import torch.distributed as dist

    monkeypatch.setattr(_muon_bucket, "BUCKET_BYTES", bound)
    monkeypatch.delenv(_muon_bucket.BUCKET_ENV, raising=False)
    shapes = [(8, 8), (24, 6), (8, 8), (3, 6, 5), (6, 24), (40, 30), (8, 8)]
    g = torch.Generator().manual_seed(11)
    ups = [torch.randn(s, generator=g, dtype=torch.float64 if k % 3 == 1 else torch.float32)
           for k, s in enumerate(shapes)]
    group = {"ns_coefficients": NS[0], "ns_steps": NS[1], "eps": NS[2]}
    calls = []

    def ortho(fulls):
        calls.append(len(fulls))
        assert all(f.dtype == torch.bfloat16 for f in fulls)
        return _muon.Muon._cf_orthogonalize(fulls, group, gathered=True)

    for dt in (torch.float32, torch.float64):
        ks = [k for k, u in enumerate(ups) if u.dtype == dt]
        got = _muon_bucket.exchange_blocks(
            dist.group.WORLD, 1, 0, [shapes[k] for k in ks], [shapes[k] for k in ks],
            [[((0,) * len(shapes[k]), shapes[k])] for k in ks], [ups[k] for k in ks], ortho,
            torch.bfloat16, torch.bfloat16)
        for k, o in zip(ks, got):
            want = torch.stack([torch_ns(m, *NS) for m in ups[k].reshape(-1, *shapes[k][-2:])])
            assert o.shape == ups[k].shape and o.dtype == torch.bfloat16
            assert torch.equal(o.reshape(want.shape), want)
    if bound == 1:
        assert calls == [1] * len(shapes)
    if bound == 1 << 30:
        assert len(calls) == 2


@pytest.mark.parametrize("bad", [{"ns_steps": 100}, {"ns_coefficients": (3.4, -4.7)}])
def test_newton_schulz_settings_refused_before_any_buffer_moves(bad):
    """torch's Newton–Schulz errors (its messages), raised before any momentum buffer changes:
    torch's Muon has by then updated its first parameter's buffer; cfsdp's updates none (a
    sharded exchange must not start on one rank and not another)."""
    ps = _params(SHAPES[:3])
    opt = cfsdp.optim.Muon(ps, lr=0.02)
    _train(opt, ps, 1)
    before = [opt.state[p]["momentum_buffer"].clone() for p in ps]
    opt.param_groups[0].update(bad)
    tp = _params(SHAPES[:3])
    topt = torch.optim.Muon(tp, lr=0.02, **bad)
    _grads(tp, 0)
    with pytest.raises(ValueError) as torch_err:
        topt.step()
    _grads(ps, 1)
    with pytest.raises(ValueError) as ours:
        opt.step()
    assert str(ours.value) == str(torch_err.value)
    _same([opt.state[p]["momentum_buffer"] for p in ps], before)


def _nested_chunk(full: torch.Tensor, steps) -> torch.Tensor:
    for d, n, i in steps:
        chunks = full.chunk(n, d)
        full = chunks[i] if i < len(chunks) else full.narrow(d, 0, 0)
    return full


@pytest.mark.no_core
@pytest.mark.parametrize("shape", [(11, 12), (12, 48), (48, 12), (3, 5), (1, 4)])
@pytest.mark.parametrize("dims", [(0, 0), (0, 1), (1, 0)])
def test_mesh_blocks_are_nested_torch_chunks(shape, dims):
    """``_muon_mesh.block``: the piece torch.chunk leaves after chunking along ``dims[0]`` in
    2 then along ``dims[1]`` in 2 (TP's chunk, then fully_shard's): a rectangular block of the
    full tensor, its region the nested chunks' elements (uneven and empty chunks included);
    the 4 blocks tile the tensor once."""
    full = torch.arange(math.prod(shape)).reshape(shape)
    cover = torch.zeros(shape, dtype=torch.int32)
    for a in range(2):
        for b in range(2):
            steps = [(dims[0], 2, a), (dims[1], 2, b)]
            starts, sizes = block(shape, steps)
            region = tuple(slice(s, s + k) for s, k in zip(starts, sizes))
            assert torch.equal(full[region], _nested_chunk(full, steps))
            cover[region] += 1
    assert bool((cover == 1).all())


@pytest.mark.no_core
def test_mesh_group_ranks():
    """``_muon_mesh.group_ranks``: on a 2 x 2 x 2 (replicate, shard, tp) mesh whose ranks are
    laid out in another order than 0..7, a matrix sharded over (shard, tp) is cut over the 4
    ranks of this rank's replicate (sorted: the exchange group's rank order), over (replicate,
    tp) the 4 of its shard coordinate; on a 2 x 2 sub-mesh of ranks 4..7 (a pipeline stage's),
    its 4 ranks."""
    ids = torch.tensor([3, 0, 6, 5, 1, 2, 7, 4]).reshape(2, 2, 2)
    where = {int(ids[c]): c for c in itertools.product(range(2), range(2), range(2))}
    assert group_ranks(where, 5, (1, 2)) == (0, 3, 5, 6)
    assert group_ranks(where, 2, (1, 2)) == (1, 2, 4, 7)
    assert group_ranks(where, 2, (0, 2)) == (0, 1, 2, 3)
    sub = {4 + 2 * a + b: (a, b) for a in range(2) for b in range(2)}
    assert group_ranks(sub, 6, (0, 1)) == (4, 5, 6, 7)


@pytest.mark.no_core
def test_bucket_bound_read_once_per_process(monkeypatch):
    """``CFSDP_MUON_BUCKET_BYTES`` is read the first time the bound is asked for and kept (a
    later change on one rank cannot give it other buckets than its group agreed on); unset,
    ``BUCKET_BYTES``; not a positive integer, a ValueError naming the variable, every time."""
    monkeypatch.setattr(_muon_bucket, "_ENV_READ", None)
    monkeypatch.setenv(_muon_bucket.BUCKET_ENV, "4096")
    assert _muon_bucket.bucket_bytes() == 4096
    monkeypatch.setenv(_muon_bucket.BUCKET_ENV, "8192")
    assert _muon_bucket.bucket_bytes() == 4096
    monkeypatch.setattr(_muon_bucket, "_ENV_READ", None)
    monkeypatch.delenv(_muon_bucket.BUCKET_ENV)
    monkeypatch.setattr(_muon_bucket, "BUCKET_BYTES", 123)
    assert _muon_bucket.bucket_bytes() == 123
    for bad in ("0", "-5", "1MiB", str(1 << 62)):
        monkeypatch.setattr(_muon_bucket, "_ENV_READ", None)
        monkeypatch.setenv(_muon_bucket.BUCKET_ENV, bad)
        for _ in range(2):
            with pytest.raises(ValueError, match=f"{_muon_bucket.BUCKET_ENV}='{bad}'"):
                _muon_bucket.bucket_bytes()
    # one rank: no collective, the bound as read
    monkeypatch.setattr(_muon_bucket, "_ENV_READ", None)
    monkeypatch.setenv(_muon_bucket.BUCKET_ENV, "77")
    assert _muon_bucket.agreed_bucket_bytes(object(), 1, torch.device("cpu")) == 77
