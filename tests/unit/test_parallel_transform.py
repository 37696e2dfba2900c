"""cfsdp.pre_dp_module_transform at one rank: what it refuses (the DDP + TP parity is in
tests/distributed/worker_tp.py, ddp_pre_dp_transform)."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import cfsdp

pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py


class _Net(nn.Module):
    def __init__(self, placement):
        super().__init__()
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        self.weight = nn.Parameter(DTensor.from_local(torch.randn(4, 4), mesh, [placement]))

    def forward(self, x):
        return x @ self.weight.full_tensor()


def _model(placement) -> nn.Module:
    return nn.Sequential(_Net(placement))


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()])
def test_shard_and_replicate_train(placement):
    m = cfsdp.pre_dp_module_transform(_model(placement))
    m(torch.randn(2, 4)).sum().backward()
    (w,) = [p for n, p in m.named_parameters() if n == "0.weight"]
    assert isinstance(w, DTensor) and isinstance(w.grad, DTensor)
    assert w.grad.placements == (placement,)


def test_partial_parameter_is_refused_by_name():
    """A Partial parameter's gradient placement is Replicate, not its own: refused at the
    transform, naming the parameter (never a gradient in the wrong placement)."""
    with pytest.raises(NotImplementedError, match=r"'0\.weight'.*Partial"):
        cfsdp.pre_dp_module_transform(_model(Partial()))
