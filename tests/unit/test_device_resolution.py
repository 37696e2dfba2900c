"""The wrapper's compute device and moves (issue 26), as torch FSDP1's ``_init_utils``:
``_get_device_from_device_id``, ``_move_module_to_device``, ``_get_compute_device``.

No GPU here: CUDA's availability and current device are stood in for (monkeypatched) to
check the resolution, and the move is checked with the ``meta`` device as the target (the
move logic does not depend on the device type).  Nothing here runs CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from cfsdp import fully_sharded_data_parallel as fsdp

pytestmark = pytest.mark.no_core


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    return m


@pytest.fixture
def cuda_here(monkeypatch):
    """A machine whose current CUDA device is 3 (no kernel ever runs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)


def test_cpu_machine_computes_on_cpu():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fsdp._resolve_device(model(), None) == (torch.device("cpu"), None)
        for spelling in ("cpu", "cpu:0", torch.device("cpu", 0)):
            assert fsdp._resolve_device(model(), spelling) == (torch.device("cpu"),) * 2


def test_no_device_id_on_a_cuda_machine_is_the_current_device_with_torchs_warning(cuda_here):
    """torch: the module stays where it is (a warning), the compute device is the current
    CUDA device, and a parameter still on the CPU is an error (at its lazy init; cfsdp's at
    wrap time, naming the parameter) -- never a silent CPU run."""
    m = model()
    with pytest.warns(UserWarning, match="The passed-in `module` is on CPU"):
        device, move_to = fsdp._resolve_device(m, None)
    assert (device, move_to) == (torch.device("cuda", 3), None)
    with pytest.raises(ValueError) as e:
        fsdp._validate_params(m, set(), device, None, None)
    msg = str(e.value)
    assert msg.startswith("An FSDP-managed module unexpectedly has parameters on cpu. Make "
                          "sure to move the module to cuda:3 before training."), msg
    assert "Parameter '0.weight'" in msg and "device_id=cuda:3" in msg, msg


def test_device_id_without_index_is_the_current_device(cuda_here):
    with pytest.warns(UserWarning, match="does not have an explicit index. FSDP will use the "
                                         "current device 3"):
        assert fsdp._resolve_device(model(), "cuda") == (torch.device("cuda", 3),) * 2
    assert fsdp._resolve_device(model(), 1) == (torch.device("cuda", 1),) * 2


def test_device_id_moves_cpu_states_but_not_ignored_or_nested():
    """With a device_id, the module's CPU parameters and buffers are the ones to move,
    except ignored modules' states and those of wrappers nested inside; states already on
    another device stay.  (The move itself is torch's ``.data`` assignment; a CPU tensor
    cannot be moved so to any device this machine has, so it is not run here.)"""
    m = model()
    ignored = {m[2]}
    params, bufs = fsdp._states_to_move(m, set(m[2].parameters()), ignored)
    assert list(map(id, params)) == list(map(id, [m[0].weight, m[0].bias, m[1].weight,
                                                  m[1].bias]))
    assert list(map(id, bufs)) == list(map(id, [m[1].running_mean, m[1].running_var,
                                                m[1].num_batches_tracked]))
    m[0].weight = nn.Parameter(torch.empty(4, 3, device="meta"))  # "already on the device"
    params, _ = fsdp._states_to_move(m, set(), set())
    assert id(m[0].weight) not in map(id, params) and id(m[2].weight) in map(id, params)
    fsdp._move_states(m, set(), set(), torch.device("cpu"))  # nothing to do on the CPU
    assert m[2].weight.device.type == "cpu"


def test_fully_shard_moves_managed_states_to_the_mesh_device():
    """``fully_shard``'s managed parameters and buffers on another device than the mesh's
    are the ones to move (torch's ``_move_states_to_device``), meta ones stay for deferred
    initialisation; a tensor-parallel DTensor on a mesh of another device type is torch's
    ValueError.  (The target here is the CPU, the only device this machine has: the states
    stand on meta to be "elsewhere" and are selected, not moved.)"""
    from cfsdp import _fully_shard as fs

    m = model()
    m[0].weight = nn.Parameter(torch.empty(4, 3, device="meta"))
    managed = list(m.modules())
    params = [(p, [(None, "")]) for p in m.parameters()]
    sel = fs._states_to_move(managed, params, torch.device("cpu"))
    assert sel == []  # everything is on the CPU or meta
    sel = fs._states_to_move(managed, params, torch.device("cuda", 0))
    want = [p for p in m.parameters() if p.device.type == "cpu"] + list(m[1].buffers())
    assert list(map(id, sel)) == list(map(id, want))

    class FakeMesh:
        device_type = "cpu"

    class FakeDTensor(fs.DTensor):  # only what _move_states reads
        def __new__(cls):
            return torch.Tensor._make_subclass(cls, torch.zeros(1))

        device_mesh = FakeMesh()

    with pytest.raises(ValueError, match="Requires DTensor to have mesh of the same type as "
                                         "the FSDP mesh but got cpu for DTensor and cuda for FSDP"):
        fs._move_states([FakeDTensor()], torch.device("cuda", 0))
