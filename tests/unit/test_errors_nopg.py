"""Wrapping without a process group must fail fast with a message, not hang or crash later."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

import cfsdp


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("device_id", [None, torch.device("cpu")])
def test_no_default_process_group(use_orig_params, device_id):
    """torch's FSDP1 (on CPU it needs device_id=cpu to get that far) raises c10d's ValueError;
    cfsdp's error is an instance of it, contains its message and says what to do."""
    assert not dist.is_initialized(), "precondition: no default process group in this process"
    with pytest.raises(ValueError) as theirs:
        TorchFSDP(nn.Linear(3, 2), use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    with pytest.raises(ValueError, match="init_process_group") as ours:
        cfsdp.FullyShardedDataParallel(nn.Linear(3, 2), use_orig_params=use_orig_params,
                                       device_id=device_id)
    assert isinstance(ours.value, type(theirs.value))
    assert str(theirs.value) in str(ours.value)
    assert not dist.is_initialized()
