"""[Note: view outputs] in _runtime/hooks.py: a unit's output that is a view also hooks its
base, but never a leaf base.  A view of a parameter (``self.weight[:n]``, a position
embedding's slice) has the unit's flat parameter as its base; a hook registered on a leaf stays
for good, so one per forward accumulated without end (measured: 2 more on the wrapper's flat
parameter every step).  Both faces, one rank, 4 steps: the hook count of the output's base
stays what it was after the first step, and the training matches the plain module."""

import copy

import pytest
import torch
import torch.nn as nn

from torch.distributed.fsdp import ShardingStrategy

import cfsdp

pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py


class PosView(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return self.weight[: x.shape[0]]  # the output itself is a view of the parameter


def _hook_count(t: torch.Tensor) -> int:
    return len(t._backward_hooks or {})


@pytest.mark.parametrize("face", ["fully_shard", "wrapper"])
def test_view_of_a_parameter_adds_no_hook_per_step(face):
    torch.manual_seed(0)
    ref = nn.Sequential(PosView(), nn.Linear(4, 4))
    model = copy.deepcopy(ref)
    if face == "fully_shard":
        cfsdp.fully_shard(model[0], reshard_after_forward=False)  # the output views it
        cfsdp.fully_shard(model)
        inner = model[0]
    else:
        model[0] = cfsdp.FullyShardedDataParallel(  # the output views the unsharded buffer
            model[0], use_orig_params=True, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
        model = cfsdp.FullyShardedDataParallel(model, use_orig_params=True)
        inner = model.module[0]
    bases: list = []
    inner.register_forward_hook(lambda m, args, out: bases.append(out._base))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    counts = []
    for step in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(x).pow(2).sum()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.equal(loss, ref_loss), f"step {step}: {loss.item()} vs {ref_loss.item()}"
        counts.append(_hook_count(bases[-1]))
    same_base = bases[-1] is bases[0]  # (no tensor in the assertion: its repr would read
    bases.clear()                      # a resharded buffer's freed storage)
    assert same_base, "the output's base changed between steps"
    assert counts == [counts[0]] * 4, f"hooks on the output's base after each step: {counts}"
