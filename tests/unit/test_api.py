"""The public API mirrors torch.distributed.fsdp (the installed torch), no process group needed."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed.fsdp as tfsdp
import torch.nn as nn

import cfsdp
from cfsdp import FullyShardedDataParallel as FSDP


def test_all_names_mirror_torch():
    assert sorted(cfsdp.__all__) == sorted(tfsdp.__all__)
    for name in cfsdp.__all__:
        assert hasattr(cfsdp, name), name


@pytest.mark.parametrize(
    "name",
    [
        "BackwardPrefetch", "CPUOffload", "FullOptimStateDictConfig", "FullStateDictConfig",
        "LocalOptimStateDictConfig", "LocalStateDictConfig", "MixedPrecision",
        "OptimStateDictConfig", "OptimStateKeyType", "ShardedOptimStateDictConfig",
        "ShardedStateDictConfig", "ShardingStrategy", "StateDictConfig", "StateDictSettings",
        "StateDictType", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
    ],
)
def test_configs_are_torchs_objects(name):
    assert getattr(cfsdp, name) is getattr(tfsdp, name)


def test_wrap_policies_are_torchs():
    import torch.distributed.fsdp.wrap as twrap

    import cfsdp.wrap as cwrap

    for name in cwrap.__all__:
        assert getattr(cwrap, name) is getattr(twrap, name), name


def test_constructor_signature_matches_torch():
    ours = inspect.signature(FSDP.__init__).parameters
    theirs = inspect.signature(tfsdp.FullyShardedDataParallel.__init__).parameters
    assert list(ours) == list(theirs)
    for name, p in theirs.items():
        assert ours[name].default == p.default, name
        assert ours[name].kind == p.kind, name


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        (dict(backward_prefetch="pre"), ValueError, "backward_prefetch"),
        (dict(mixed_precision="bf16"), TypeError, "mixed_precision"),
        (dict(param_init_fn=3), ValueError, "param_init_fn"),
    ],
)
def test_bad_arguments_are_named_before_any_communication(kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        FSDP(nn.Linear(2, 2), **kwargs)


def test_fully_shard_without_process_group_says_what_to_do(monkeypatch):
    """As torch, the default group comes from torchrun's environment; without it, torch's
    message and then what to do."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="(?s)environment variable RANK expected.*init_process_group"):
        cfsdp.fully_shard(nn.Linear(2, 2))


def test_fully_shard_rejects_containers_and_non_modules():
    with pytest.raises(ValueError, match="containers"):
        cfsdp.fully_shard(nn.ModuleList([nn.Linear(2, 2)]))
    with pytest.raises(TypeError, match="nn.Module"):
        cfsdp.fully_shard("model")


def test_fully_shard_helpers_check_their_arguments():
    with pytest.raises(ValueError, match="FSDPModule"):
        cfsdp.share_comm_ctx([nn.Linear(2, 2)])
    lin = nn.Linear(2, 2)
    cfsdp.register_fsdp_forward_method(lin, "forward")  # as torch: no-op without fully_shard
    assert "forward" not in vars(lin)


def test_backend_is_reported():
    assert cfsdp.backend in ("c", "python")


def test_clip_grad_norm_signature_matches_torch():
    ours = inspect.signature(FSDP.clip_grad_norm_).parameters
    theirs = inspect.signature(tfsdp.FullyShardedDataParallel.clip_grad_norm_).parameters
    assert [(n, p.default, p.kind) for n, p in ours.items()] == [
        (n, p.default, p.kind) for n, p in theirs.items()
    ]
