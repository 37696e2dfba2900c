"""cfsdp.optim (fused Adam/AdamW/SGD) and its C core against the twins and torch.optim.

Tolerances, and why:

* SGD: bitwise everywhere (C, twin, torch.optim): torch's CPU kernels use FMA for
  ``add(alpha=)`` and the C loops call ``fmaf`` at the same places.
* Adam/AdamW: the C core is bitwise equal to the twin with an IEEE square root
  (``ieee_sqrt=True``), and so to ``torch.optim`` with ``Tensor.sqrt`` patched to the
  IEEE one.  torch's own CPU ``sqrt`` is MKL's, accurate to 1 ulp but not correctly
  rounded (about 16% of fp32 results are one ulp off): against the unpatched twin /
  torch, one step leaves the states bitwise equal and the parameter within five ulps of
  the largest of |old|, |update| and |new|: a one-ulp square root passes through three
  more roundings (``/ bc2``, ``+ eps``, ``m / denom``), each of which can widen a gap
  by one ulp, before the final ``p + update`` rounds once more (probed: up to 3).  Over many steps those ulps feed back
  (weight decay, amsgrad's max), so multi-step runs against unpatched torch compare
  with rtol 1e-5 relative to the parameters' scale.
* The twin (``CFSDP_IMPL=python``) is torch's single-tensor math op for op: bitwise
  equal to torch.optim (foreach=False, and foreach=True on CPU).

Hypothesis draws buffers, gaps and options; the sanitizer profile runs fewer examples.
"""

import array
import copy
import math

import pytest
import torch
from hypothesis import given, strategies as st

import cfsdp
import cfsdp._C as C
from cfsdp import _core
from cfsdp import optim as co
from cfsdp._ref import optim as twin

F32 = torch.float32
ADAM_OPTS = st.fixed_dictionaries({
    "lr": st.sampled_from([1e-3, 0.1, 0.0]),
    "beta1": st.sampled_from([0.9, 0.6, 0.3, 0.0]),
    "beta2": st.sampled_from([0.999, 0.95]),
    "eps": st.sampled_from([1e-8, 1e-3]),
    "weight_decay": st.sampled_from([0.0, 1e-2, 0.3]),
    "decoupled": st.booleans(),
    "amsgrad": st.booleans(),
    "maximize": st.booleans(),
})
SGD_OPTS = st.fixed_dictionaries({
    "lr": st.sampled_from([0.1, 1e-3]),
    "momentum": st.sampled_from([0.0, 0.9, 0.5]),
    "dampening": st.sampled_from([0.0, 0.3]),
    "weight_decay": st.sampled_from([0.0, 1e-2]),
    "nesterov": st.booleans(),
    "maximize": st.booleans(),
    "first_step": st.booleans(),
})


def assert_bits(got, want, what=""):
    g, w = got.reshape(-1), want.reshape(-1)
    nan = torch.isnan(g) & torch.isnan(w)
    bad = (g.view(torch.int32) != w.view(torch.int32)) & ~nan
    assert not bad.any(), f"{what}: {int(bad.sum())} differ; first {int(bad.nonzero()[0])}"


def assert_param_close(got, want, before, what=""):
    """Within five ulps of the largest operand of the final ``p + update``:
    max(|before|, |update|, |want|) (see the module docstring)."""
    g, w, b = got.reshape(-1).double(), want.reshape(-1).double(), before.reshape(-1).double()
    scale = torch.maximum(torch.maximum(b.abs(), w.abs()), (w - b).abs()).float()
    ulp = (torch.nextafter(scale, torch.full_like(scale, math.inf)) - scale).double()
    ok = ((g - w).abs() <= 5 * ulp) | (torch.isnan(g) & torch.isnan(w)) | (g == w)
    i = int((~ok).nonzero()[0]) if not ok.all() else 0
    assert ok.all(), f"{what}: {int((~ok).sum())} beyond 5 ulps; first {i}: {g[i].item()!r} {w[i].item()!r} before {b[i].item()!r} ulp {ulp[i].item()}"


@st.composite
def flat_layouts(draw, max_params=5):
    """(ranges, numel): a flat buffer with params at ranges and gaps between them."""
    ranges, at = [], draw(st.integers(0, 3))
    for _ in range(draw(st.integers(0, max_params))):
        n = draw(st.integers(0, 40))
        ranges.append((at, n))
        at += n + draw(st.integers(0, 5))
    return ranges, at + draw(st.integers(0, 3))


def rand_buffers(numel, gen, amsgrad=True):
    p = torch.randn(numel, generator=gen)
    g = torch.randn(numel, generator=gen)
    m = torch.randn(numel, generator=gen) * 0.1
    v = torch.rand(numel, generator=gen) * 0.01
    vm = v + torch.rand(numel, generator=gen) * 0.01 * (torch.rand(numel, generator=gen) < 0.5)
    return p, g, m, v, vm


def c_adam(bufs, ranges, step, hp, max_threads=1):
    p, g, m, v, vm = bufs
    C.adam_step(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
                vm.data_ptr() if hp["amsgrad"] else 0, ranges, C.DTYPE_FP32, hp["lr"],
                hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"], float(step),
                hp["decoupled"], hp["amsgrad"], hp["maximize"], max_threads)


# ---------------------------------------------------------------- C vs twin
@given(layout=flat_layouts(), hp=ADAM_OPTS, step=st.integers(1, 50), seed=st.integers(0, 2**31 - 1),
       as_buffer=st.booleans())
def test_adam_c_matches_twin(layout, hp, step, seed, as_buffer):
    """Bitwise against the twin with IEEE sqrt; against torch's sqrt: states bitwise,
    param within 5 ulps.  Memory outside the ranges is untouched."""
    ranges, numel = layout
    gen = torch.Generator().manual_seed(seed)
    bufs = rand_buffers(numel, gen)
    got = [t.clone() for t in bufs]
    exact = [t.clone() for t in bufs]
    mkl = [t.clone() for t in bufs]
    arg = array.array("q", [x for r in ranges for x in r]) if as_buffer else ranges
    c_adam(got, arg, step, hp)
    twin.adam_step(*exact, ranges, step=float(step), ieee_sqrt=True, **hp)
    twin.adam_step(*mkl, ranges, step=float(step), **hp)
    for name, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), got, exact):
        assert_bits(a, b, name)
    for name, a, b in zip(("grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), got[1:], mkl[1:]):
        assert_bits(a, b, name + " vs torch sqrt")
    assert_param_close(got[0], mkl[0], bufs[0], "param vs torch sqrt")
    inside = torch.zeros(numel, dtype=torch.bool)
    for s, n in ranges:
        inside[s : s + n] = True
    for a, b in zip(got, bufs):
        assert_bits(a[~inside], b[~inside], "outside the ranges")


@given(layout=flat_layouts(), hp=SGD_OPTS, seed=st.integers(0, 2**31 - 1))
def test_sgd_c_matches_twin(layout, hp, seed):
    ranges, numel = layout
    gen = torch.Generator().manual_seed(seed)
    p, g, b = (torch.randn(numel, generator=gen) for _ in range(3))
    got, want = [p.clone(), g.clone(), b.clone()], [p.clone(), g.clone(), b.clone()]
    C.sgd_step(got[0].data_ptr(), got[1].data_ptr(), got[2].data_ptr() if hp["momentum"] else None,
               ranges, C.DTYPE_FP32, hp["lr"], hp["momentum"], hp["dampening"], hp["weight_decay"],
               hp["nesterov"], hp["maximize"], hp["first_step"], 1)
    twin.sgd_step(*want, ranges, **hp)
    for name, x, y in zip(("param", "grad", "buf"), got, want):
        assert_bits(x, y, name)


def test_threaded_path_matches_one_thread():
    """Above OPTIM_PARALLEL_BYTES the ranges split across threads; same bits, and odd
    range lengths put thread borders inside ranges."""
    n = C.OPTIM_PARALLEL_BYTES // 28 * 3 + 7
    ranges = [(1, 1001), (1005, n // 2), (n // 2 + 2000, n - n // 2 - 2001)]
    gen = torch.Generator().manual_seed(3)
    bufs = rand_buffers(n, gen)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
              amsgrad=True, maximize=False)
    want = [t.clone() for t in bufs]
    c_adam(want, ranges, 3, hp, max_threads=1)
    for threads in (2, C.MAX_THREADS):
        got = [t.clone() for t in bufs]
        c_adam(got, ranges, 3, hp, max_threads=threads)
        for a, b in zip(got, want):
            assert_bits(a, b, f"{threads} threads")
    p, g, bb = bufs[0].clone(), bufs[1], bufs[2].clone()
    p2, b2 = p.clone(), bb.clone()
    for t, (pp, buf) in ((1, (p, bb)), (C.MAX_THREADS, (p2, b2))):
        C.sgd_step(pp.data_ptr(), g.data_ptr(), buf.data_ptr(), ranges, 0, 0.1, 0.9, 0.0, 0.01,
                   True, False, False, t)
    assert_bits(p2, p, "sgd threads")
    assert_bits(b2, bb, "sgd threads buf")


def test_core_wrappers_and_twin_for_other_dtypes():
    """_core picks C for fp32 CPU buffers and the twin otherwise (fp64 here), with the
    twin's bits; ranges past a buffer are a ValueError before anything is written."""
    gen = torch.Generator().manual_seed(4)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False,
              amsgrad=False, maximize=False, step=2.0)
    ranges = [(0, 5), (7, 3)]
    for dtype in (F32, torch.float64):
        bufs = [t.to(dtype) for t in rand_buffers(12, gen)]
        a, b = [t.clone() for t in bufs], [t.clone() for t in bufs]
        _core.adam_step(*a, ranges, **hp)
        twin.adam_step(*b, ranges, ieee_sqrt=dtype == F32, **hp)
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    with pytest.raises(ValueError, match="past a buffer"):
        _core.adam_step(*rand_buffers(5, gen), [(0, 6)], **hp)


# ---------------------------------------------------------------- C errors
def test_c_rejects_bad_calls():
    x = torch.zeros(8)
    a = x.data_ptr()
    ys = [torch.zeros(8) for _ in range(4)]
    addrs = [t.data_ptr() for t in ys]

    def adam(ranges, dtype=0, step=1.0, p=a, ams=False, vm=0):
        C.adam_step(p, addrs[0], addrs[1], addrs[2], vm, ranges, dtype, 1e-3, 0.9, 0.999, 1e-8,
                    0.0, step, False, ams, False, 1)

    with pytest.raises(ValueError, match="needs fp32"):
        adam([(0, 4)], dtype=1)
    with pytest.raises(ValueError, match="step must be"):
        adam([(0, 4)], step=0.0)
    with pytest.raises(ValueError, match="range 1 at 2 overlaps"):
        adam([(0, 4), (2, 1)])
    with pytest.raises(ValueError, match="range 0: start and length must be >= 0"):
        adam([(-1, 4)])
    with pytest.raises(OverflowError, match="overflows"):
        adam([(2**62, 2**62)])
    with pytest.raises(ValueError, match="max_exp_avg_sq: NULL"):
        adam([(0, 4)], ams=True)
    with pytest.raises(ValueError, match="param and grad overlap"):
        adam([(0, 4)], p=addrs[0] + 4)
    with pytest.raises(TypeError, match="int64"):
        adam(array.array("i", [0, 4]))
    with pytest.raises(ValueError, match="range 0 must be"):
        adam([(0, 4, 1)])
    with pytest.raises(TypeError, match="int address"):
        C.adam_step(1.5, 0, 0, 0, 0, [], 0, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, False, False, False, 1)
    with pytest.raises(ValueError, match="momentum_buffer: NULL"):
        C.sgd_step(a, addrs[0], 0, [(0, 4)], 0, 0.1, 0.9, 0, 0, False, False, False, 1)
    # no elements: NULL addresses are fine
    C.adam_step(0, 0, 0, 0, 0, [(3, 0)], 0, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, False, False, False, 1)
    assert all((t == 0).all() for t in ys) and (x == 0).all()
    assert isinstance(C.optim_uses_avx2(), bool)


def test_twin_rejects_like_c():
    with pytest.raises(ValueError, match="range 1 at 2 overlaps"):
        twin.check_ranges([(0, 4), (2, 1)])
    with pytest.raises(ValueError, match="step must be"):
        twin.adam_step(*rand_buffers(4, torch.Generator()), [(0, 4)], step=0.0, lr=1e-3,
                       beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0.0, decoupled=False,
                       amsgrad=False, maximize=False)


# ------------------------------------------------------ twin vs torch.optim
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("kw", [dict(), dict(amsgrad=True, maximize=True, weight_decay=0.1),
                                dict(decoupled_weight_decay=True, weight_decay=0.3, betas=(0.3, 0.9))])
def test_twin_is_torch_single_tensor_adam(kw, foreach):
    """100 steps of the twin's adam_tensor equal torch.optim.Adam bitwise."""
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(37, 3, generator=gen)
    ref_p = torch.nn.Parameter(p0.clone())
    ref = torch.optim.Adam([ref_p], lr=1e-2, foreach=foreach, **kw)
    p, m, v, vm = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0), torch.zeros_like(p0)
    b1, b2 = kw.get("betas", (0.9, 0.999))
    for step in range(1, 101):
        g = torch.randn(37, 3, generator=gen)
        ref_p.grad = g.clone()
        ref.step()
        twin.adam_tensor(p, g, m, v, vm, step=float(step), lr=1e-2, beta1=b1, beta2=b2, eps=1e-8,
                         weight_decay=kw.get("weight_decay", 0.0),
                         decoupled=kw.get("decoupled_weight_decay", False),
                         amsgrad=kw.get("amsgrad", False), maximize=kw.get("maximize", False))
    assert_bits(p, ref_p.detach(), "param")
    assert_bits(m, ref.state[ref_p]["exp_avg"], "exp_avg")


# ---------------------------------------------------- optimizers vs torch.optim
def ieee_sqrt_torch(monkeypatch):
    """torch.optim with an IEEE sqrt: cfsdp's C step must then be its bits."""
    real = torch.Tensor.sqrt

    def sqrt(self):
        return self.double().sqrt().to(self.dtype) if self.dtype == F32 else real(self)

    monkeypatch.setattr(torch.Tensor, "sqrt", sqrt)


class FlatModel:
    """Parameters as views of one flat buffer with gaps (padding), one frozen
    parameter, gradients as views of one flat gradient buffer (a new one every
    step, as a sharded unit publishes them), and an independent plain parameter."""

    SLICES = [(0, (10, 10)), (104, (200,)), (307, (1,)), (310, (3, 50)), (470, (5,))]
    NUMEL = 480

    def __init__(self, seed, frozen=(2,)):
        gen = torch.Generator().manual_seed(seed)
        self.flat = torch.randn(self.NUMEL, generator=gen)
        self.params = [torch.nn.Parameter(self.flat[s : s + math.prod(sh)].view(sh))
                       for s, sh in self.SLICES]
        self.params.append(torch.nn.Parameter(torch.randn(4, 6, generator=gen)))
        for i in frozen:
            self.params[i].requires_grad_(False)

    def clone(self):
        c = copy.copy(self)
        c.flat = self.flat.clone()
        c.params = [torch.nn.Parameter(c.flat[s : s + math.prod(sh)].view(sh))
                    for s, sh in self.SLICES]
        c.params.append(torch.nn.Parameter(self.params[-1].detach().clone()))
        for p, q in zip(c.params, self.params):
            p.requires_grad_(q.requires_grad)
        return c

    def set_grads(self, gen):
        gflat = torch.randn(self.NUMEL, generator=gen)
        extra = torch.randn(4, 6, generator=gen)
        for p, (s, sh) in zip(self.params, self.SLICES):
            p.grad = gflat[s : s + math.prod(sh)].view(sh) if p.requires_grad else None
        self.params[-1].grad = extra

    def groups(self, **second):
        return [{"params": self.params[:2]}, {"params": self.params[2:], **second}]


ADAM_CASES = [
    ("AdamW", dict()),
    ("AdamW", dict(weight_decay=0.0, amsgrad=True)),
    ("AdamW", dict(maximize=True, betas=(0.6, 0.95))),
    ("Adam", dict(weight_decay=0.1)),
    ("Adam", dict(amsgrad=True, maximize=True, weight_decay=0.05, eps=1e-3)),
    ("Adam", dict(decoupled_weight_decay=True, weight_decay=0.2)),
]
SGD_CASES = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.5, dampening=0.3, maximize=True, weight_decay=0.1)),
]


def train_pair(model, ref_model, opt, ref, seed, steps, after=None):
    """``steps`` steps of both on the same gradients (``after()`` after each)."""
    gen, rgen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model.set_grads(gen)
        ref_model.set_grads(rgen)
        opt.step()
        ref.step()
        if after is not None:
            after()


def run_pair(name, kw, steps, seed=0, second=None):
    model = FlatModel(seed)
    ref_model = model.clone()
    second = second if second is not None else {"lr": kw.get("lr", 1e-3) * 3}
    opt = getattr(co, name)(model.groups(**second), **kw)
    ref = getattr(torch.optim, name)(ref_model.groups(**second), foreach=False, **kw)
    train_pair(model, ref_model, opt, ref, seed + 1, steps)
    return model, ref_model, opt, ref


def compare_states(opt, ref, model, ref_model, check):
    for p, q in zip(model.params, ref_model.params):
        assert (p in opt.state) == (q in ref.state)
        if p not in opt.state:
            continue
        assert list(opt.state[p]) == list(ref.state[q])
        for k, v in opt.state[p].items():
            if k == "step":
                assert v.dtype == ref.state[q][k].dtype and v.dim() == 0
                assert float(v) == float(ref.state[q][k])
            else:
                check(v, ref.state[q][k], k)


@pytest.mark.parametrize("name, kw", ADAM_CASES + SGD_CASES, ids=lambda x: str(x))
def test_100_steps_bitwise_with_ieee_sqrt(name, kw, monkeypatch):
    """100 steps on views of a flat buffer (gaps, a frozen parameter, two groups with
    different lr) and a plain parameter: cfsdp == torch.optim bit for bit (with an
    IEEE sqrt for Adam, see the module docstring; the twin backend is torch's own
    math, so it needs no patch and gets the same check).  Gaps and the frozen
    parameter are never written."""
    if _core.backend == "c":
        ieee_sqrt_torch(monkeypatch)
    model, ref_model, opt, ref = run_pair(name, kw, 100)
    for p, q in zip(model.params, ref_model.params):
        assert_bits(p.detach(), q.detach(), "param")
    assert_bits(model.flat, ref_model.flat, "flat buffer incl. gaps")
    compare_states(opt, ref, model, ref_model, assert_bits)
    if _core.backend == "c":  # the group's states are one flat buffer per kind
        kinds = [k for k in opt.state[model.params[0]] if k != "step"]
        for k in kinds:
            a, b = opt.state[model.params[0]][k], opt.state[model.params[1]][k]
            assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        assert len(opt._cf_plans[0].buckets) == 1


@pytest.mark.parametrize("name, kw", ADAM_CASES + SGD_CASES, ids=lambda x: str(x))
def test_duplicate_parameter_as_torch(name, kw, monkeypatch):
    """A parameter listed twice in a group (torch warns and keeps both copies; a view of a
    flat buffer, which the C path would take, and a plain one): torch steps it once per
    copy with its one state (Adam's ``step`` counted twice; SGD's first step starts a
    buffer per copy and keeps the last): parameters and states bit for bit torch's, and
    the same warning."""
    if _core.backend == "c":
        ieee_sqrt_torch(monkeypatch)
    out = []
    for cls in (getattr(co, name), getattr(torch.optim, name)):
        torch.manual_seed(3)
        flat = torch.randn(20)
        a = torch.nn.Parameter(flat[2:9])  # noqa: the views share one buffer: C's layout
        b = torch.nn.Parameter(flat[11:20])
        c = torch.nn.Parameter(torch.randn(4))
        extra = {} if cls.__module__.startswith("cfsdp") else {"foreach": False}
        with pytest.warns(UserWarning, match="duplicate parameters"):
            opt = cls([a, b, a, c, c], **kw, **extra)
        g = torch.Generator().manual_seed(5)
        for _ in range(4):
            for p in (a, b, c):
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        out.append(([p.detach().clone() for p in (a, b, c)], opt.state_dict()["state"]))
    (ours, our_sd), (theirs, their_sd) = out
    for x, y in zip(ours, theirs):
        assert_bits(x, y, "param")
    assert list(our_sd) == list(their_sd)
    for i in their_sd:
        assert list(our_sd[i]) == list(their_sd[i])
        for k, v in their_sd[i].items():
            assert_bits(our_sd[i][k].reshape(-1), v.reshape(-1), f"state {i} {k}")


@pytest.mark.parametrize("name, kw", ADAM_CASES, ids=lambda x: str(x))
def test_100_steps_against_unpatched_torch(name, kw):
    """Against torch's MKL sqrt: within rtol 1e-5 of the parameters' scale."""
    model, ref_model, opt, ref = run_pair(name, kw, 100)
    for p, q in zip(model.params, ref_model.params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5,
                                   atol=1e-5 * float(q.detach().abs().max()))
    compare_states(opt, ref, model, ref_model,
                   lambda a, b, k: torch.testing.assert_close(
                       a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max())))


def test_one_step_states_bitwise_param_1ulp():
    model, ref_model, opt, ref = run_pair("AdamW", dict(amsgrad=True), 0)
    before = [p.detach().clone() for p in model.params]
    train_pair(model, ref_model, opt, ref, 9, 1)
    for p, q, b in zip(model.params, ref_model.params, before):
        assert_param_close(p.detach(), q.detach(), b)
    compare_states(opt, ref, model, ref_model, assert_bits)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name, kw", [ADAM_CASES[4], SGD_CASES[3]], ids=lambda x: str(x))
def test_other_dtypes_take_torch_ops(dtype, name, kw):
    """Non-fp32 parameters run torch's per-tensor math: torch's bits, torch's states."""
    gen = torch.Generator().manual_seed(11)
    p0 = torch.randn(9, 5, generator=gen).to(dtype)
    p, q = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt, ref = getattr(co, name)([p], **kw), getattr(torch.optim, name)([q], foreach=False, **kw)
    for _ in range(20):
        g = torch.randn(9, 5, generator=gen).to(dtype)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert torch.equal(p, q)
    for k, v in ref.state[q].items():
        assert torch.equal(opt.state[p][k], v) and opt.state[p][k].dtype == v.dtype
    assert opt._cf_plans[0].kind == ["torch"]


# ------------------------------------------------------------- state dicts
@pytest.mark.parametrize("name, kw", [ADAM_CASES[1], ADAM_CASES[4], SGD_CASES[2]],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("direction", ["cfsdp->torch", "torch->cfsdp"])
def test_state_dict_round_trip(name, kw, direction, monkeypatch):
    """Train 10 steps with one, load its state dict into the other (fresh), train 10
    more on both: identical to an uninterrupted run (IEEE sqrt, as above)."""
    if _core.backend == "c":
        ieee_sqrt_torch(monkeypatch)
    model, _, opt, ref = run_pair(name, kw, 10)
    src = opt if direction == "cfsdp->torch" else ref
    src_model = model if src is opt else _
    sd = copy.deepcopy(src.state_dict())
    if src is opt:
        for st_ in sd["state"].values():  # the format torch writes
            assert st_.get("step") is None or (st_["step"].dtype == F32 and st_["step"].dim() == 0)
    dst_model = src_model.clone()
    dst_cls = torch.optim if src is opt else co
    dst = getattr(dst_cls, name)(dst_model.groups(lr=kw.get("lr", 1e-3) * 3), **kw)
    dst.load_state_dict(sd)
    assert dst.state_dict()["param_groups"] == src.state_dict()["param_groups"]
    train_pair(src_model, dst_model, src, dst, 21, 10)
    for p, q in zip(src_model.params, dst_model.params):
        assert_bits(p.detach(), q.detach(), "param")
    if dst_cls is co and _core.backend == "c":  # re-packed into flat buffers
        k = next(k for k in dst.state[dst_model.params[0]] if k != "step")
        a, b = dst.state[dst_model.params[0]][k], dst.state[dst_model.params[1]][k]
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# ------------------------------------------------------------ schedulers etc
@pytest.mark.parametrize("sched", ["step", "onecycle"])
@pytest.mark.parametrize("name, kw", [ADAM_CASES[0], SGD_CASES[1]], ids=lambda x: str(x))
def test_lr_scheduler_parity(sched, name, kw, monkeypatch):
    """lr (and OneCycleLR's momentum / beta1) changed in param_groups take effect."""
    if _core.backend == "c":
        ieee_sqrt_torch(monkeypatch)
    model = FlatModel(3)
    ref_model = model.clone()
    opt = getattr(co, name)(model.groups(), **kw)
    ref = getattr(torch.optim, name)(ref_model.groups(), foreach=False, **kw)

    def make(o):
        if sched == "step":
            return torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)
        return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=30)

    s, rs = make(opt), make(ref)
    train_pair(model, ref_model, opt, ref, 2, 30, after=lambda: (s.step(), rs.step()))
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    for p, q in zip(model.params, ref_model.params):
        assert_bits(p.detach(), q.detach(), "param")


def test_closure_zero_grad_add_param_group_hooks():
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(2))
    opt = co.AdamW([p], lr=0.1)
    calls = []
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))

    def closure():
        opt.zero_grad()
        loss = (p * 2).sum()
        loss.backward()
        return loss

    assert float(opt.step(closure).detach()) == 6.0 and calls == ["post"]
    assert (p < 1).all()
    opt.add_param_group({"params": [q], "lr": 0.5})
    q.grad = torch.ones(2)
    opt.step()
    assert (q < 1).all() and float(opt.state[q]["step"]) == 1.0
    opt.zero_grad(set_to_none=True)
    assert p.grad is None and q.grad is None
    before = p.detach().clone()
    opt.step()  # no grads: nothing moves
    assert torch.equal(p.detach(), before)
    assert isinstance(opt, torch.optim.AdamW) and isinstance(opt, torch.optim.Optimizer)
    assert cfsdp.optim is co


def test_plan_is_reused_across_grad_buffers_and_rebuilt_on_change():
    model = FlatModel(4)
    opt = co.Adam(model.groups(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    model.set_grads(gen)
    opt.step()
    plan = opt._cf_plans[0]
    model.set_grads(gen)  # a new gradient buffer, same relative layout
    opt.step()
    assert opt._cf_plans[0] is plan
    model.params[0].grad = model.params[0].grad.clone()  # moves relative to the others
    opt.step()
    assert opt._cf_plans[0] is not plan
    assert len(opt._cf_plans[0].buckets) == 2
    steps = [float(opt.state[p]["step"]) for p in model.params if p in opt.state]
    assert steps == [3.0] * len(steps)
    model.params[2].requires_grad_(True)  # gets its first gradient: its own step count
    model.set_grads(gen)
    opt.step()
    assert float(opt.state[model.params[2]]["step"]) == 1.0
    assert float(opt.state[model.params[0]]["step"]) == 4.0


@pytest.mark.parametrize("name,kw", [ADAM_CASES[0], SGD_CASES[1]])
def test_plan_follows_moved_parameters_and_replaced_state(monkeypatch, name, kw):
    """What torch's ZeroRedundancyOptimizer (and cfsdp's) do to a local optimizer between
    steps: move a parameter's memory (``p.data = bucket view``) and replace a parameter's
    whole state dict (its ``load_state_dict``).  The plan must follow both (before, the C
    step wrote to the freed old memory, or kept stepping the old state)."""
    ieee_sqrt_torch(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(1000, generator=gen))
    q = torch.nn.Parameter(p.detach().clone())
    opt = getattr(co, name)([p], **kw)
    ref = getattr(torch.optim, name)([q], foreach=False, **kw)
    for step in range(4):
        g = torch.randn(1000, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        if step == 0:  # move p into a bucket; the old memory is freed
            bucket = torch.zeros(3000)
            bucket[1000:2000].copy_(p.detach())
            p.data = bucket[1000:2000]
            del bucket
        if step == 1:  # a fresh state dict, with other values
            opt.state[p] = {k: v.clone() * 0.5 for k, v in opt.state[p].items()}
            ref.state[q] = {k: v.clone() * 0.5 for k, v in ref.state[q].items()}
        assert_bits(p.detach(), q.detach(), f"param after step {step}")


# ------------------------------------------------------------------- errors
def _outcome(fn):
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - compared
        return None, (type(e), str(e))


@pytest.mark.parametrize("cls", ["Adam", "AdamW", "SGD"])
@pytest.mark.parametrize("option", ["foreach", "fused", "capturable", "differentiable"])
def test_torch_kernel_options_take_torchs_step(cls, option):
    """``foreach`` / ``fused`` / ``capturable`` / ``differentiable`` = True: the group takes
    torch's own step ([Note: torch's kernels] in optim/_fused.py), so the parameters and
    states are torch's bits (or torch's own error, e.g. capturable on the CPU)."""
    kw = {option: True}
    if cls != "SGD":
        kw.update(weight_decay=0.1, amsgrad=option == "fused")
    else:
        kw.update(momentum=0.9, nesterov=True)
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(33, generator=gen), torch.randn(4, 5, generator=gen)]
    grads = [[torch.randn(t.shape, generator=gen) for t in init] for _ in range(3)]

    def run(make):
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        opt = make(ps, lr=0.01, **kw)
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
        return ps, opt

    mine, err_mine = _outcome(lambda: run(getattr(co, cls)))
    ref, err_ref = _outcome(lambda: run(getattr(torch.optim, cls)))
    if cls == "SGD" and option == "capturable":  # torch's SGD has no capturable either
        assert err_ref[0] is TypeError and err_mine == err_ref
        return
    assert err_mine == err_ref, (err_mine, err_ref)
    if err_ref is not None:
        return
    for (p, q) in zip(mine[0], ref[0]):
        assert_bits(p.detach(), q.detach(), f"{cls} {option}")
    sd, want = mine[1].state_dict(), ref[1].state_dict()
    assert sd["param_groups"] == want["param_groups"]
    for i in want["state"]:
        for k, v in want["state"][i].items():
            assert_bits(sd["state"][i][k], v, f"{cls} {option} state {k}")


@pytest.mark.parametrize("cls, kw", [("Adam", dict(foreach=True)), ("AdamW", dict(fused=True)),
                                     ("SGD", dict(foreach=True, momentum=0.9))])
def test_torch_kernel_groups_run_step_hooks_once(cls, kw):
    """A group on torch's kernels once a torch optimizer of the same class exists (which
    wraps the torch class's ``step`` in torch's hook runner): the step pre/post hooks, this
    optimizer's and the global ones, run once per ``step()``, as torch's.  They ran twice
    (cfsdp's step, then torch's wrapped one): a pre-hook scaling the gradients scaled them
    twice and training silently went elsewhere."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    gen = torch.Generator().manual_seed(6)
    init = torch.randn(17, generator=gen)
    grads = [torch.randn(17, generator=gen) for _ in range(3)]
    out = []
    for make in (getattr(torch.optim, cls), getattr(co, cls)):  # torch's first: wraps its step
        p = torch.nn.Parameter(init.clone())
        opt = make([p], lr=0.01, **kw)
        calls = []
        opt.register_step_pre_hook(lambda o, a, k: (calls.append("pre"), p.grad.mul_(0.5))[0])
        opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
        handle = register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global"))
        try:
            for g in grads:
                p.grad = g.clone()
                opt.step()
        finally:
            handle.remove()
        out.append((p.detach().clone(), calls))
    (want, want_calls), (got, got_calls) = out
    assert got_calls == want_calls == ["global", "pre", "post"] * 3, got_calls
    assert_bits(got, want, f"{cls} {kw}")


@pytest.mark.parametrize("cls", ["Adam", "AdamW", "SGD"])
@pytest.mark.parametrize("second", [dict(), dict(fused=False)])
def test_grad_scaler_fused_step(cls, second):
    """``torch.amp.GradScaler`` on an optimizer built with ``fused=True``: it hands the step
    its scale (``grad_scale`` / ``found_inf``) instead of unscaling.  Every group fused:
    torch's fused kernels, torch's bits.  A second group with ``fused=False``: torch's
    ``AssertionError`` (its non-fused paths do not unscale), as torch; the C step stepped
    that group with the scaled gradients (1024 x for SGD), silently."""
    gen = torch.Generator().manual_seed(8)
    init = [torch.randn(9, generator=gen), torch.randn(5, generator=gen)]
    out = []
    for mod in (co, torch.optim):
        a, b = (torch.nn.Parameter(t.clone()) for t in init)
        opt = getattr(mod, cls)([{"params": [a]}, {"params": [b], **second}], lr=0.1,
                                fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        res = None
        for _ in range(2):
            opt.zero_grad()
            scaler.scale((a * a).sum() + (b * 3).sum()).backward()
            res = _outcome(lambda: scaler.step(opt))[1]
            if res is not None:
                break
            scaler.update()
        out.append((res, a.detach().clone(), b.detach().clone()))
    (err, a1, b1), (want_err, a2, b2) = out
    assert err == want_err, (err, want_err)
    if second:
        assert want_err is not None and want_err[0] is AssertionError
    assert_bits(a1, a2, "fused group")
    assert_bits(b1, b2, "second group")


def test_groups_pick_their_step(monkeypatch):
    """One group with ``fused=True`` (torch's fused kernel) and one without (cfsdp's C
    step): each group is stepped by its own path (torch's step sees the first group only);
    the first is torch's fused bits, the second the C step's bits (an optimizer of that
    group alone)."""
    seen = []
    real = torch.optim.Adam.step

    def spy(self, *args, **kwargs):
        seen.append([g["params"] for g in self.param_groups])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", spy)
    gen = torch.Generator().manual_seed(4)
    a0, b0 = torch.randn(40, generator=gen), torch.randn(24, generator=gen)
    ga, gb = torch.randn(40, generator=gen), torch.randn(24, generator=gen)
    a, b = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(b0.clone())
    opt = co.AdamW([{"params": [a], "fused": True}, {"params": [b]}], lr=0.01)
    ra, rb = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(b0.clone())
    ref_a = torch.optim.AdamW([ra], lr=0.01, fused=True)
    ref_b = co.AdamW([rb], lr=0.01)
    for _ in range(2):
        a.grad, b.grad, ra.grad, rb.grad = ga.clone(), gb.clone(), ga.clone(), gb.clone()
        opt.step()
        ref_a.step()
        ref_b.step()
    assert_bits(a.detach(), ra.detach(), "fused group")
    assert_bits(b.detach(), rb.detach(), "C group")
    assert len(opt.param_groups) == 2 and opt.param_groups[0]["params"] == [a]
    mine = [s for s in seen if len(s) == 1 and s[0][0] is a]
    assert len(mine) == 2 and all(not any(q is b for g in s for q in g) for s in seen), seen


@pytest.mark.parametrize("cls, key", [("Adam", "lr"), ("AdamW", "betas"), ("SGD", "lr"),
                                      ("SGD", "weight_decay")])
def test_tensor_hyperparameters_raise(cls, key):
    p = torch.nn.Parameter(torch.ones(2))
    val = (torch.tensor(0.9), torch.tensor(0.99)) if key == "betas" else torch.tensor(0.01)
    with pytest.raises(NotImplementedError, match=f"Tensor {key}"):
        getattr(co, cls)([p], **{key: val})
    opt = getattr(co, cls)([p])
    opt.param_groups[0][key] = val  # set later (a scheduler, a loaded state dict)
    p.grad = torch.ones(2)
    with pytest.raises(NotImplementedError, match=f"Tensor {key}"):
        opt.step()


def test_torch_validation_and_loaded_options():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        co.AdamW([p], lr=-1.0)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 0"):
        co.Adam([p], betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="Nesterov momentum requires"):
        co.SGD([p], nesterov=True)
    q = torch.nn.Parameter(torch.ones(2))
    ref = torch.optim.AdamW([q], fused=True)
    opt = co.AdamW([p])
    opt.load_state_dict(ref.state_dict())  # carries fused=True in its param group
    p.grad, q.grad = torch.ones(2), torch.ones(2)
    opt.step()  # torch's fused step now ([Note: torch's kernels])
    ref.step()
    assert_bits(p.detach(), q.detach(), "loaded fused=True")


def test_complex_and_sparse_raise():
    c = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
    c.grad = torch.ones(2, dtype=torch.complex64)
    with pytest.raises(NotImplementedError, match="complex"):
        co.Adam([c]).step()
    e = torch.nn.Embedding(5, 3, sparse=True)
    e(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(NotImplementedError, match="sparse gradient"):
        co.SGD(e.parameters(), lr=0.1).step()


@pytest.mark.parametrize("name, kw", [("AdamW", dict()), ("SGD", dict(momentum=0.9))])
def test_coincident_grad_offsets_overlapping_when_merged(name, kw):
    """Two parameters whose gradients sit at the same offset from them (as the
    allocator often arranges for the shards and gradients of different units),
    interleaved so that the merged spans would overlap (param A, grad A, param B,
    grad B in one buffer): each gets a bucket of its own and steps as torch's."""
    n = 64
    gen = torch.Generator().manual_seed(3)

    def make():
        buf = torch.randn(4 * n, generator=gen)
        return buf, [torch.nn.Parameter(buf[0:n]), torch.nn.Parameter(buf[2 * n : 3 * n])]

    buf, params = make()
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = getattr(co, name)(params, lr=1e-2, **kw)
    ref = getattr(torch.optim, name)(ref_params, lr=1e-2, foreach=False, **kw)
    for _ in range(3):
        grads = torch.randn(2, n, generator=gen)
        with torch.no_grad():
            buf[n : 2 * n].copy_(grads[0])
            buf[3 * n :].copy_(grads[1])
        params[0].grad, params[1].grad = buf[n : 2 * n], buf[3 * n :]
        for q, g in zip(ref_params, grads):
            q.grad = g.clone()
        opt.step()
        ref.step()
    if _core.backend == "c":
        assert [len(b.entries) for b in opt._cf_plans[0].buckets] == [1, 1]
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
