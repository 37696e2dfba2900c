"""What torch 2.15 added to FSDP2, on one rank, against the installed torch's fully_shard.

On torch 2.15+ (cfsdp/_torch/fsdp2.py): ``FSDPModule.finalize_backward`` raises and returns as
torch's does without manual finalization; ``set_manual_backward_finalization(False)`` and
``set_keep_unsharded_storage(False)`` (torch's defaults, what cfsdp does) are accepted and
``True`` is ``NotImplementedError``; an explicit ``grad_dtype`` other than the parameter's dtype
and ``MixedPrecisionPolicy(param_dtype_override_fn=)`` are ``NotImplementedError`` naming what
to do.  On an older torch none of these exist, in cfsdp as in torch.  (The 2.15 reduce dtype
rule, gradients reduced in their ``grad_dtype`` without ``reduce_dtype``, is checked against
torch's numbers by the mixed-precision and accumulation subtests of
tests/distributed/fully_shard/ under ``make test-torch``.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as tfsdp
import torch.nn as nn

import cfsdp
from cfsdp._torch import fsdp2

pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py

NEW_METHODS = ("finalize_backward", "set_manual_backward_finalization", "set_keep_unsharded_storage")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _model(impl):
    torch.manual_seed(0)
    m = Net()
    shard = cfsdp.fully_shard if impl == "cfsdp" else tfsdp.fully_shard
    shard(m.a)
    shard(m)
    return m


def _error(fn, *args, **kwargs):
    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the type and message are what is compared
        return type(e), str(e)
    return None, out


def test_new_methods_exist_as_in_torch():
    for name in NEW_METHODS:
        assert hasattr(cfsdp.FSDPModule, name) == hasattr(tfsdp.FSDPModule, name) == \
            fsdp2.REDUCES_IN_GRAD_DTYPE, name
    assert hasattr(cfsdp, "GradientReductionHandle") == fsdp2.REDUCES_IN_GRAD_DTYPE


@pytest.mark.parametrize("impl", ["cfsdp", "torch"])
def test_finalize_backward_without_manual_finalization(impl):
    """Both: before the first forward a no-op (``async_op``: a handle whose wait() does
    nothing); after a step torch's RuntimeError; on a non-root module torch's RuntimeError
    (compared with torch's, recorded from the same calls)."""
    if not fsdp2.REDUCES_IN_GRAD_DTYPE:
        m = _model(impl)
        for name in NEW_METHODS:
            assert not hasattr(m, name)
        return
    m = _model(impl)
    assert m.finalize_backward() is None
    h = m.finalize_backward(async_op=True)
    assert isinstance(h, tfsdp.GradientReductionHandle) and h.wait() is None
    m(torch.randn(3, 4)).sum().backward()
    got = [_error(m.finalize_backward), _error(m.finalize_backward, async_op=True),
           _error(m.a.finalize_backward), _error(m.set_manual_backward_finalization, False),
           _error(m.a.set_manual_backward_finalization, False)]
    want = [(RuntimeError, "FSDP finalize_backward requires manual backward finalization. "
                           "Call set_manual_backward_finalization(True) before forward")] * 2 + [
        (RuntimeError, "finalize_backward must be called on the root FSDP module"),
        (None, None),
        (RuntimeError, "set_manual_backward_finalization must be called on the root FSDP module")]
    assert got == want


def test_what_cfsdp_does_not_do_yet_is_refused():
    if not fsdp2.REDUCES_IN_GRAD_DTYPE:
        with pytest.raises(TypeError):  # as torch's: the field does not exist
            tfsdp.MixedPrecisionPolicy(param_dtype_override_fn=lambda p: None)
        return
    m = _model("cfsdp")
    m.set_keep_unsharded_storage(False)
    m.set_manual_backward_finalization(False)
    with pytest.raises(NotImplementedError, match=r"set_keep_unsharded_storage\(True\)"):
        m.set_keep_unsharded_storage(True)
    with pytest.raises(NotImplementedError, match=r"set_manual_backward_finalization\(True\)"):
        m.set_manual_backward_finalization(True)
    pol = tfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                     param_dtype_override_fn=lambda p: None)
    with pytest.raises(NotImplementedError, match="param_dtype_override_fn"):
        cfsdp.fully_shard(Net(), mp_policy=pol)


@pytest.mark.parametrize("when", ["before_fully_shard", "before_first_forward"])
def test_explicit_grad_dtype(when):
    """torch 2.15 reduces and accumulates such a gradient in that dtype; cfsdp refuses it
    (at fully_shard, or at the first forward when set on the sharded parameter), naming it.
    Before 2.15 torch's FSDP2 drops a grad_dtype set before fully_shard and fails to assign
    the gradient of one set on the sharded parameter: cfsdp does the same (compared)."""

    def run(impl):
        torch.manual_seed(0)
        m = Net()
        shard = cfsdp.fully_shard if impl == "cfsdp" else tfsdp.fully_shard
        if when == "before_fully_shard":
            m.b.weight.grad_dtype = torch.float64
        shard(m.a)
        shard(m)
        if when == "before_first_forward":
            m.b.weight.grad_dtype = torch.float64
        m(torch.randn(3, 4)).sum().backward()
        return m.b.weight.grad.dtype

    if not fsdp2.REDUCES_IN_GRAD_DTYPE:
        assert _error(run, "cfsdp") == _error(run, "torch")
        return
    with pytest.raises(NotImplementedError, match=r"(?s)'b\.weight' has grad_dtype=torch\.float64"
                                                 r".*Leave grad_dtype unset"):
        run("cfsdp")


def test_grad_dtype_equal_to_the_dtype_is_taken():
    m = Net()
    m.b.weight.grad_dtype = torch.float32
    cfsdp.fully_shard(m)
    m(torch.randn(3, 4)).sum().backward()
    assert m.b.weight.grad is not None


# FSDPModule's communication knobs (torch 2.11+, the first three 2.13+): what cfsdp does is
# torch's default; asking for it is accepted, asking for anything else NotImplementedError
KNOBS = [  # (method, the default's arguments, other arguments)
    ("set_reduce_scatter_max_input_buffers", (1,), (2,)),
    ("set_separate_reduce_scatter_group", (False,), (True,)),
    ("set_allocate_memory_from_process_group_for_comm", (False,), (True,)),
    ("set_custom_all_gather", None, (object(),)),
    ("set_custom_reduce_scatter", None, (object(),)),
    ("set_symm_mem_for_comm", None, ()),
]


@pytest.mark.parametrize("name, default, other", KNOBS, ids=[k[0] for k in KNOBS])
def test_communication_knobs(name, default, other):
    assert hasattr(cfsdp.FSDPModule, name) == hasattr(tfsdp.FSDPModule, name)
    if not hasattr(tfsdp.FSDPModule, name):
        return
    m = _model("cfsdp")
    if default is not None:
        getattr(m, name)(*default)
    with pytest.raises(NotImplementedError, match=name):
        getattr(m, name)(*other)


@pytest.mark.parametrize("recurse", [True, False])
def test_reduce_scatter_unused_params(recurse):
    """torch 2.13+: zero gradients for parameters backward left without one, in the units
    the setter reached (``recurse=False``: the root's only), as torch's (the ranks that
    use other parameters: tests/distributed/fully_shard/features.py)."""
    assert hasattr(cfsdp.FSDPModule, "set_reduce_scatter_unused_params") == \
        hasattr(tfsdp.FSDPModule, "set_reduce_scatter_unused_params")
    if not hasattr(tfsdp.FSDPModule, "set_reduce_scatter_unused_params"):
        return
    grads = {}
    for impl, shard in (("cfsdp", cfsdp.fully_shard), ("torch", tfsdp.fully_shard)):
        torch.manual_seed(0)
        m = Net()
        m.spare = nn.Linear(4, 3)  # never used: the root's unit
        m.a.spare = nn.Linear(4, 3)  # never used: a's unit
        shard(m.a)
        shard(m)
        m.set_reduce_scatter_unused_params(True, recurse=recurse)
        m(torch.randn(3, 4)).sum().backward()
        grads[impl] = {n: None if p.grad is None else p.grad.to_local() for n, p in m.named_parameters()}
    assert grads["cfsdp"].keys() == grads["torch"].keys()
    for n, g in grads["torch"].items():
        assert (grads["cfsdp"][n] is None) == (g is None), n
        assert g is None or torch.equal(grads["cfsdp"][n], g), n
    assert grads["torch"]["a.spare.weight"] is None if not recurse else \
        not grads["torch"]["a.spare.weight"].any()
    assert not grads["torch"]["spare.weight"].any()


def test_max_input_buffers_errors_are_torchs():
    if not hasattr(tfsdp.FSDPModule, "set_reduce_scatter_max_input_buffers"):
        return
    ours, theirs = _model("cfsdp"), _model("torch")
    for bad in (0, 1.5):
        assert _error(ours.set_reduce_scatter_max_input_buffers, bad) == \
            _error(theirs.set_reduce_scatter_max_input_buffers, bad)


def test_reduce_scatter_divide_factor_is_the_deprecated_name():
    """torch's deprecated alias of set_gradient_divide_factor (every supported torch): the same
    warning, and the factor set on the module's own unit."""
    ours, theirs = _model("cfsdp"), _model("torch")
    with pytest.warns(DeprecationWarning, match="Use `set_gradient_divide_factor` instead"):
        ours.set_reduce_scatter_divide_factor(2.0)
    with pytest.warns(DeprecationWarning, match="Use `set_gradient_divide_factor` instead"):
        theirs.set_reduce_scatter_divide_factor(2.0)
    x = torch.randn(3, 4)
    for m in (ours, theirs):
        m(x).sum().backward()
    for (n, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(a.grad.to_local(), b.grad.to_local()), n
