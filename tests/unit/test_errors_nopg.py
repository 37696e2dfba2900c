"""Wrapping without a process group must fail fast with a message, not hang or crash later."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import cfsdp


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("device_id", [None, torch.device("cpu")])
def test_no_default_process_group(use_orig_params, device_id):
    assert not dist.is_initialized(), "precondition: no default process group in this process"
    with pytest.raises(RuntimeError, match="init_process_group"):
        cfsdp.FullyShardedDataParallel(nn.Linear(3, 2), use_orig_params=use_orig_params,
                                       device_id=device_id)
    assert not dist.is_initialized()
