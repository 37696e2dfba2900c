"""The all-gather extensions' gradient route (``_runtime/chunk/ext.py``): a plain gradient
goes to the parameter's view of the flat parameter; a gradient that is a tensor subclass
is an error naming the parameter, never reduced as something else."""

import pytest
import torch

from cfsdp._runtime.chunk.ext import _Route

pytestmark = pytest.mark.no_core


class Sub(torch.Tensor):
    pass


def test_plain_gradient_is_routed_to_the_view():
    view = torch.zeros(3, requires_grad=True)
    out = _Route.apply(view, torch.ones(3), "blocks.0.w")
    out.backward(torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(view.grad, torch.tensor([1.0, 2.0, 3.0]))


def test_subclass_gradient_is_refused_naming_the_parameter():
    view = torch.zeros(3, requires_grad=True)
    out = _Route.apply(view, torch.ones(3), "blocks.0.w")
    with pytest.raises(NotImplementedError, match="parameter 'blocks.0.w' .* gradient of type Sub"):
        out.backward(torch.ones(3).as_subclass(Sub))
