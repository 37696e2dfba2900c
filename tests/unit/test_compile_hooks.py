"""torch.compile at one rank: dynamo treats cfsdp's hooks as torch's FSDP hooks (issue 18).

A process group of one rank (gloo over a ``HashStore``, for this module only, as
test_single_rank.py): the collectives are local copies, so nothing here needs torchrun.
What does not depend on the world size is checked here; tests/distributed/test_compile.py
trains at 2 and 4 ranks against torch for every pattern and backend.

* ``torch._dynamo.explain`` on each face gives torch's counterpart's graphs, graph breaks
  and operations: the hooks are never traced (before issue 18 dynamo traced into
  cfsdp's pre-forward hook, and at more than one rank reached the process group).
* Compiled autograd: torch 2.13's FSDP2 trains with wrong losses there, 2.11's fails inside
  dynamo (both checked, so a torch that fixes it shows up); cfsdp raises ``NotImplementedError`` naming the setting, for
  both faces.  torch 2.13+ has no ``torch._dynamo.config.skip_fsdp_hooks`` to trace FSDP
  hooks (setting it raises ``AttributeError``, checked); torch 2.11 has it, and cfsdp refuses
  ``False`` naming the setting and the version (checked).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import cfsdp
from cfsdp._torch import dynamo as torch_dynamo

FACES = ("fully_shard", "wrapper_orig", "wrapper_flat")


pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Unit(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.lin(self.norm(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.units = nn.ModuleList(Unit(8) for _ in range(2))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for u in self.units:
            x = u(x)
        return self.out(x)


def build(impl: str, face: str) -> nn.Module:
    torch.manual_seed(0)
    net = Net()
    if face == "fully_shard":
        shard = torch_fully_shard if impl == "torch" else cfsdp.fully_shard
        for u in net.units:
            shard(u)
        return shard(net)
    cls = TorchFSDP if impl == "torch" else cfsdp.FullyShardedDataParallel
    kw = {"use_orig_params": face == "wrapper_orig", "device_id": torch.device("cpu")}
    for i, u in enumerate(net.units):
        net.units[i] = cls(u, **kw)
    return cls(net, **kw)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def explained(impl: str, face: str) -> tuple:
    torch._dynamo.reset()
    model = build(impl, face)
    x, _ = batch(0)
    e = torch._dynamo.explain(model)(x)
    model(x).sum().backward()  # the step the explained forward began
    return e.graph_count, e.graph_break_count, [[str(op) for op in ops] for ops in e.ops_per_graph]


@pytest.mark.parametrize("face", FACES)
def test_hooks_are_not_traced_as_torch(face):
    """The same graphs (count, breaks, operations) as torch's FSDP: each unit's forward (with
    use_orig_params=False none: dynamo refuses FSDP-managed modules there, as for torch)."""
    want = explained("torch", face)
    assert explained("cfsdp", face) == want
    assert want[0] == (0 if face == "wrapper_flat" else 1), want  # one graph: Unit.forward


def train(impl: str, face: str, compiled_autograd: bool, steps: int = 3) -> list[float]:
    model = build(impl, face)
    run = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = F.mse_loss(run(x), y)
        if compiled_autograd:
            with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
                loss.backward()
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_compiled_autograd_refused_where_torch_fsdp2_goes_wrong():
    """torch 2.13 cannot trace its FSDP hooks into a graph (``skip_fsdp_hooks`` is gone:
    setting it raises), and under compiled autograd its FSDP2's losses leave eager FSDP2's
    (which cfsdp matches bit for bit) from the second step: cfsdp refuses rather than copy
    that.  A torch that brings the setting back, or fixes FSDP2 there, fails here.  torch 2.11-2.12
    has the setting (False: FSDP2's hooks traced into the graphs): cfsdp refuses False, naming
    it and the version, at the first backward hook."""
    if torch_dynamo.HAS_SKIP_FSDP_HOOKS:
        assert torch.__version__.startswith(("2.11", "2.12")), torch.__version__
        torch._dynamo.config.skip_fsdp_hooks = False
        try:
            with pytest.raises(NotImplementedError,
                               match=rf"skip_fsdp_hooks=False \(torch {re.escape(torch.__version__)}"):
                train("cfsdp", "fully_shard", False, steps=1)
        finally:
            torch._dynamo.config.skip_fsdp_hooks = True
    else:
        with pytest.raises(AttributeError, match="skip_fsdp_hooks"):
            torch._dynamo.config.skip_fsdp_hooks = False
    eager = train("torch", "fully_shard", False)
    assert train("cfsdp", "fully_shard", False) == eager
    torch._dynamo.reset()
    if torch.__version__.startswith("2.11"):  # its FSDP2 fails inside dynamo there
        with pytest.raises(AssertionError, match="queue_callback"):
            train("torch", "fully_shard", True)
    else:
        ca = train("torch", "fully_shard", True)
        assert ca[0] == eager[0] and ca[1:] != eager[1:], (ca, eager)
    with pytest.raises(NotImplementedError, match=r"torch\._dynamo\.config\.compiled_autograd"):
        train("cfsdp", "fully_shard", True, steps=1)


@pytest.mark.parametrize("face", ["wrapper_orig", "wrapper_flat"])
def test_compiled_autograd_is_refused_naming_the_setting(face):
    with pytest.raises(NotImplementedError, match=r"torch\._dynamo\.config\.compiled_autograd"):
        train("cfsdp", face, True, steps=1)
