"""rekey_optim_state_dict on unwrapped models (no process group): the same result as torch
FSDP1's, both directions, and clear errors for keys that match no parameter."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

from cfsdp import FullyShardedDataParallel as CFSDP
from cfsdp import OptimStateKeyType


def _model_and_osd():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.Adam([{"params": [m[0].weight, m[2].bias]}, {"params": [m[0].bias, m[2].weight], "lr": 0.1}])
    m(torch.randn(5, 3)).sum().backward()
    opt.step()
    return m, opt, opt.state_dict()


def _same(a, b):
    assert list(a["state"]) == list(b["state"])
    for k in b["state"]:
        assert list(a["state"][k]) == list(b["state"][k])
        for n, v in b["state"][k].items():
            assert torch.equal(a["state"][k][n], v)
    assert a["param_groups"] == b["param_groups"]


@pytest.mark.parametrize("use_optim", [True, False])
def test_rekey_matches_torch_both_ways(use_optim):
    m, opt, osd = _model_and_osd()
    kw = {"optim": opt} if use_optim else {}
    if not use_optim:  # model.parameters() order: ids of an optimizer built from it
        opt = torch.optim.Adam(m.parameters())
        m(torch.randn(5, 3)).sum().backward()
        opt.step()
        osd = opt.state_dict()
    by_name = CFSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, m, **kw)
    _same(by_name, TorchFSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, m, **kw))
    assert set(by_name["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    by_id = CFSDP.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, m, **kw)
    _same(by_id, TorchFSDP.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, m, **kw))
    # already keyed as asked: returned as is (torch's contract)
    assert CFSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_ID, m, **kw) is by_id


def test_rekey_errors_name_the_key():
    m, opt, osd = _model_and_osd()
    by_name = CFSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, m, optim=opt)
    by_name["state"]["nope.weight"] = by_name["state"].pop("0.weight")
    with pytest.raises(ValueError, match="'nope.weight'"):
        CFSDP.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, m, optim=opt)
    bad = dict(osd, state={**osd["state"], 17: {}})
    with pytest.raises(ValueError, match="17"):
        CFSDP.rekey_optim_state_dict(bad, OptimStateKeyType.PARAM_NAME, m, optim=opt)
    with pytest.raises(AssertionError, match="OptimStateKeyType"):
        CFSDP.rekey_optim_state_dict(osd, "by-name", m, optim=opt)
    mixed = dict(osd, state={0: {}, "x": {}})
    with pytest.raises(ValueError, match="Invalid parameter keys"):
        CFSDP.rekey_optim_state_dict(mixed, OptimStateKeyType.PARAM_ID, m, optim=opt)
