"""cfsdp/_torch (torch's private APIs, one module per concern) against the installed torch.

``make test`` runs this file on every tested torch (2.13.0 in the full suite, 2.11.0 and 2.15.0
through ``make test-torch``; 2.12.0 and 2.14.1 by hand, ``make test-torch TORCH=2.12.0``).  ``VERSIONS`` is what each tested version has; a torch that is not
in it fails ``test_installed_torch_is_a_tested_one``, which is where a new release starts: add
its row, then fix the modules of ``cfsdp/_torch`` the other tests point at.
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
import torch
import torch.distributed.fsdp as tfsdp
import torch.nn as nn

import cfsdp
from cfsdp import _torch
from cfsdp._torch import checkpoint, core, dtensor, dynamo, fsdp1, fsdp2

pytestmark = pytest.mark.no_core

# what each tested torch has (major, minor) -> facts cfsdp's modules must mirror
VERSIONS = {
    (2, 11): dict(data_parallel_mesh_dims=False, shard_placement_result=False,
                  fully_shard_kwargs=("mesh", "reshard_after_forward", "shard_placement_fn",
                                      "mp_policy", "offload_policy", "ignored_params"),
                  reset_iter_state=False, placements_first=False, containers_with_forward=False),
    (2, 13): dict(data_parallel_mesh_dims=True, shard_placement_result=True,
                  fully_shard_kwargs=("mesh", "reshard_after_forward", "shard_placement_fn",
                                      "mp_policy", "offload_policy", "ignored_params",
                                      "dp_mesh_dims"),
                  reset_iter_state=True, placements_first=True, containers_with_forward=True),
}
VERSIONS[(2, 14)] = VERSIONS[(2, 13)]
# 2.15: FSDP2's GradientReductionHandle, manual backward finalization, kept unsharded storage,
# gradients reduced in their grad_dtype (cfsdp/_torch/fsdp2.py)
VERSIONS[(2, 15)] = dict(VERSIONS[(2, 13)], gradient_reduction_handle=True)
VERSIONS[(2, 12)] = dict(VERSIONS[(2, 13)], reset_iter_state=False)  # 2.13 added only that
HAVE = VERSIONS.get(_torch.VERSION[:2])


def test_installed_torch_is_a_tested_one():
    assert HAVE is not None, (
        f"torch {torch.__version__} is not one of the tested versions {sorted(VERSIONS)}: add its "
        "row to VERSIONS (read its torch/distributed/fsdp), then make test-torch TORCH=<it>")
    assert _torch.OLDEST <= _torch.VERSION[:2] <= _torch.NEWEST


@pytest.mark.parametrize("version, ok", [("2.10.1", False), ("2.11.0", True), ("2.12.0+cpu", True),
                                         ("2.14.1+cu130", True), ("2.15.0", True),
                                         ("2.16.0", False), ("2.16.0a0+git1234", False),
                                         ("3.0.0", False)])
def test_version_range(version, ok):
    if ok:
        _torch.check_supported(version)
        return
    with pytest.raises(ImportError, match=rf"(?s)supports torch 2\.11\.x to 2\.15\.x.*{re.escape(version)}"):
        _torch.check_supported(version)


def test_version_parse():
    assert _torch.parse("2.14.1+cu130") == (2, 14, 1)
    assert _torch.parse("2.15.0a0+git1234") == (2, 15, 0)
    assert _torch.parse("2.11") == (2, 11, 0)


def test_not_in_this_torch_names_version_and_feature():
    err = _torch.not_in_this_torch("fully_shard(dp_mesh_dims=...)", "2.13")
    assert isinstance(err, NotImplementedError)
    assert "dp_mesh_dims" in str(err) and torch.__version__ in str(err) and "2.13" in str(err)


# ------------------------------------------------------------------------------- the public API


def test_public_names_are_the_installed_torchs():
    assert sorted(cfsdp.__all__) == sorted(tfsdp.__all__)
    assert hasattr(cfsdp, "DataParallelMeshDims") == HAVE["data_parallel_mesh_dims"]
    assert hasattr(tfsdp, "DataParallelMeshDims") == HAVE["data_parallel_mesh_dims"]
    if HAVE["data_parallel_mesh_dims"]:
        assert cfsdp.DataParallelMeshDims is tfsdp.DataParallelMeshDims
    else:
        with pytest.raises(ImportError):
            exec("from cfsdp import DataParallelMeshDims", {})
    if HAVE.get("gradient_reduction_handle", False):
        assert cfsdp.GradientReductionHandle is tfsdp.GradientReductionHandle
    else:
        assert not hasattr(cfsdp, "GradientReductionHandle")
        assert not hasattr(cfsdp.FSDPModule, "finalize_backward")


def _params(fn):
    return [(n, p.kind, p.default) for n, p in inspect.signature(fn).parameters.items()]


def test_fully_shard_signature_is_the_installed_torchs():
    assert _params(cfsdp.fully_shard) == _params(tfsdp.fully_shard)
    assert tuple(inspect.signature(cfsdp.fully_shard).parameters)[1:] == HAVE["fully_shard_kwargs"]


def test_fully_shard_refuses_an_argument_this_torch_lacks_as_torch():
    """Before any other check (no process group here), as torch's."""
    for name in ("not_an_argument",) + (() if HAVE["fully_shard_kwargs"][-1] == "dp_mesh_dims"
                                        else ("dp_mesh_dims",)):
        msg = f"fully_shard() got an unexpected keyword argument '{name}'"
        with pytest.raises(TypeError) as theirs:
            tfsdp.fully_shard(nn.Linear(2, 2), **{name: None})
        assert str(theirs.value) == msg
        with pytest.raises(TypeError) as ours:
            cfsdp.fully_shard(nn.Linear(2, 2), **{name: None})
        assert str(ours.value) == msg


def test_fsdp_module_methods_are_the_installed_torchs():
    ours = {n for n in vars(cfsdp.FSDPModule) if not n.startswith("_")}
    missing = sorted(ours - {n for n in dir(tfsdp.FSDPModule) if not n.startswith("_")})
    assert not missing, f"cfsdp's FSDPModule has methods this torch's does not: {missing}"
    absent = sorted({n for n in dir(tfsdp.FSDPModule) if not n.startswith("_")}
                    - {n for n in dir(cfsdp.FSDPModule) if not n.startswith("_")})
    assert not absent, f"this torch's FSDPModule has methods cfsdp's does not: {absent}"
    assert hasattr(cfsdp.FSDPModule, "reset_iter_state") == HAVE["reset_iter_state"]


def test_mesh_info_is_torchs():
    """fsdp2.mesh_info is torch's _get_mesh_info (a one-rank gloo mesh here); with
    dp_mesh_dims (2.13+) the mesh info names the SPMD mesh and its dims (spmd_of)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        info = fsdp2.mesh_info(mesh["dp"])
        assert type(info) is fsdp2.FSDPMeshInfo and fsdp2.spmd_of(info) is None
        assert type(fsdp2.mesh_info(mesh)) is fsdp2.HSDPMeshInfo
        if HAVE["data_parallel_mesh_dims"]:
            dims = fsdp2.DataParallelMeshDims(shard="dp")
            info = fsdp2.mesh_info(mesh, dims)
            assert type(info) is fsdp2.FSDPMeshInfo
            assert fsdp2.spmd_of(info) == (mesh, ("dp",), ())
            info = fsdp2.mesh_info(mesh, fsdp2.DataParallelMeshDims(replicate="dp"))
            assert type(info) is fsdp2.DDPMeshInfo and fsdp2.spmd_of(info) == (mesh, (), ("dp",))
    finally:
        dist.destroy_process_group()


def test_fsdp2_facts():
    assert (fsdp2.ShardPlacementResult is not None) == HAVE["shard_placement_result"]
    assert fsdp2.RESOLVES_PLACEMENTS_FIRST == HAVE["placements_first"]
    common = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_common")
    assert fsdp2.ShardPlacementResult is getattr(common, "ShardPlacementResult", None)


class _ListWithForward(nn.ModuleList):
    def forward(self, x):
        return x


def test_containers_as_this_torch(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert fsdp2.refuses_container(nn.ModuleList([nn.Linear(2, 2)]))
    assert fsdp2.refuses_container(nn.ModuleDict({"a": nn.Linear(2, 2)}))
    assert not fsdp2.refuses_container(nn.Linear(2, 2))
    assert fsdp2.refuses_container(_ListWithForward()) == (not HAVE["containers_with_forward"])
    # torch's own check, and cfsdp.fully_shard's (both run before anything needs a process
    # group: a module they let through fails later, for want of torchrun's environment)
    from torch.distributed.fsdp._fully_shard._fsdp_init import _validate_module

    for m in (nn.ModuleList(), _ListWithForward(), nn.Linear(2, 2)):
        refused = False
        try:
            _validate_module(m, "fully_shard")
        except ValueError:
            refused = True
        assert refused == fsdp2.refuses_container(m), m
        try:
            cfsdp.fully_shard(m)
        except ValueError as e:
            assert ("does not support containers" in str(e)) == refused, (m, e)
        else:
            raise AssertionError(f"cfsdp.fully_shard({m}) without a process group did not raise")


class _DimOnly:
    dim = 1

    def __repr__(self):
        return "_DimOnly()"


def test_placement_result_errors_as_this_torch():
    from torch.distributed.tensor import Shard

    assert fsdp2.placement_result_error(None) is None
    assert fsdp2.placement_result_error(Shard(1)) is None
    if HAVE["placements_first"]:
        assert fsdp2.placement_result_error("rows") == (ValueError, "Invalid shard_placement_fn result: rows")
        assert fsdp2.placement_result_error(_DimOnly())[0] is ValueError
    else:
        assert fsdp2.placement_result_error("rows") == (AttributeError, "'str' object has no attribute 'dim'")
        assert fsdp2.placement_result_error(_DimOnly()) == (
            AssertionError, f"Expected Shard, got {_DimOnly}: _DimOnly()")


# ------------------------------------------------------------------ every binding is torch's own

BINDINGS = [
    (fsdp2, "REGISTRY_KEY", "torch.distributed._composable.contract", "REGISTRY_KEY"),
    (fsdp2, "STATE_KEY", "torch.distributed._composable.contract", "STATE_KEY"),
    (fsdp2, "RegistryItem", "torch.distributed._composable.contract", "RegistryItem"),
    (fsdp2, "get_registry", "torch.distributed._composable.contract", "_get_registry"),
    (fsdp2, "FSDPMeshInfo", "torch.distributed.fsdp._fully_shard._fsdp_common", "FSDPMeshInfo"),
    (fsdp2, "HSDPMeshInfo", "torch.distributed.fsdp._fully_shard._fsdp_common", "HSDPMeshInfo"),
    (fsdp2, "DDPMeshInfo", "torch.distributed.fsdp._fully_shard._fsdp_common", "DDPMeshInfo"),
    (dtensor, "DTensorSpec", "torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    (dtensor, "TensorMeta", "torch.distributed.tensor._dtensor_spec", "TensorMeta"),
    (dtensor, "redistribute_local_tensor", "torch.distributed.tensor._redistribute",
     "redistribute_local_tensor"),
    (dtensor, "StridedShard", "torch.distributed.tensor.placement_types", "_StridedShard"),
    (dtensor, "make_contiguous_strides_for", "torch._prims_common", "make_contiguous_strides_for"),
    (fsdp1, "ActivationWrapper", "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
     "ActivationWrapper"),
    (fsdp1, "LOW_PRECISION_HOOKS", "torch.distributed.algorithms._comm_hooks", "LOW_PRECISION_HOOKS"),
    (fsdp1, "TrainingState", "torch.distributed.fsdp._common_utils", "TrainingState"),
    (fsdp1, "override_module_mixed_precision", "torch.distributed.fsdp._common_utils",
     "_override_module_mixed_precision"),
    (fsdp1, "init_intra_and_inter_node_groups", "torch.distributed.fsdp._init_utils",
     "_init_intra_and_inter_node_groups"),
    (fsdp1, "create_chunk_dtensor", "torch.distributed.fsdp._shard_utils", "_create_chunk_dtensor"),
    (fsdp1, "create_chunk_sharded_tensor", "torch.distributed.fsdp._shard_utils",
     "_create_chunk_sharded_tensor"),
    (checkpoint, "ShardedTensor", "torch.distributed._shard.sharded_tensor", "ShardedTensor"),
    (checkpoint, "ShardMetadata", "torch.distributed._shard.sharding_spec", "ShardMetadata"),
    (checkpoint, "gather_state_dict", "torch.distributed._state_dict_utils", "_gather_state_dict"),
    (checkpoint, "FileSystemWriterBase", "torch.distributed.checkpoint.filesystem", "_FileSystemWriter"),
    (checkpoint, "api_bc_check", "torch.distributed.checkpoint.utils", "_api_bc_check"),
    (checkpoint, "IncompatibleKeys", "torch.nn.modules.module", "_IncompatibleKeys"),
    (checkpoint, "StateDictInfo", "torch.distributed.checkpoint.state_dict", "_StateDictInfo"),
    (core, "current_autograd_node", "torch._C", "_current_autograd_node"),
    (core, "scalar_dtype", "torch.optim.optimizer", "_get_scalar_dtype"),
    (core, "muon_adjust_lr", "torch.optim._muon", "_adjust_lr"),
    (core, "muon_newton_schulz", "torch.optim._muon", "_zeropower_via_newtonschulz"),
    (dynamo, "OptimizedModule", "torch._dynamo.eval_frame", "OptimizedModule"),
]


@pytest.mark.parametrize("mod, name, torch_mod, torch_name", BINDINGS,
                         ids=[f"{m.__name__.rsplit('.', 1)[1]}.{n}" for m, n, _, _ in BINDINGS])
def test_binding_is_torchs_object(mod, name, torch_mod, torch_name):
    assert getattr(mod, name) is getattr(importlib.import_module(torch_mod), torch_name)


def test_dsd_steps_take_what_cfsdp_passes():
    """cfsdp replaces these steps of torch's DSD helpers (cfsdp/checkpoint/state_dict.py):
    the installed torch's take the same parameters (the originals, before cfsdp's dispatch)."""
    from cfsdp.checkpoint import state_dict as cfsdp_dsd

    for name, params in checkpoint.DSD_STEPS.items():
        original = cfsdp_dsd._TORCH_ORIGINALS.get(name, getattr(checkpoint.dsd, name))
        assert tuple(inspect.signature(original).parameters) == params, name


def test_core_and_dynamo_answer():
    assert core.has_storage(torch.zeros(2))
    assert not core.is_functorch_wrapped(torch.zeros(2))
    assert core.dispatch_mode_active() is False
    assert core.profiler_enabled() is False
    assert core.current_autograd_node() is None  # outside backward
    assert core.scalar_dtype() in (torch.float32, torch.float64)
    torch.optim.Adagrad([nn.Parameter(torch.zeros(1))])  # torch wraps Adagrad.step, hooks and all
    assert torch.optim.Adagrad.step.hooked
    plain = core.unhooked_step(torch.optim.Adagrad.step)
    assert not getattr(plain, "hooked", False) and plain is torch.optim.Adagrad.step.__wrapped__
    assert dynamo.in_compiled_autograd_region() is False
    assert dynamo.skip is not None  # every supported torch has it (else _compile's fallback)
    with torch.profiler.profile():
        assert core.profiler_enabled() is True
