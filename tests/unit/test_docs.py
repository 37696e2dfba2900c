"""help() on cfsdp's torch-mirrored API shows torch's documentation (then cfsdp's notes)."""

import inspect

import pytest
import torch.distributed.fsdp as tfsdp

import cfsdp

pytestmark = pytest.mark.no_core

PAIRS = [(cfsdp.FullyShardedDataParallel, tfsdp.FullyShardedDataParallel),
         (cfsdp.FSDPModule, tfsdp.FSDPModule), (cfsdp.UnshardHandle, tfsdp.UnshardHandle)]
PUBLIC = [(c, t, n) for c, t in PAIRS for n in sorted(vars(c))
          if not n.startswith("_") and hasattr(t, n)]


def _doc(obj) -> str:
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    return inspect.getdoc(obj) or ""


@pytest.mark.parametrize("cls, torch_cls, name", PUBLIC, ids=[f"{c.__name__}.{n}" for c, _, n in PUBLIC])
def test_methods_carry_torch_docs(cls, torch_cls, name):
    theirs = _doc(inspect.getattr_static(torch_cls, name))
    ours = _doc(vars(cls)[name])
    assert theirs, f"torch documents {name}: the pair list is out of date"
    assert ours.startswith(theirs), f"{cls.__name__}.{name} does not start with torch's docstring"


@pytest.mark.parametrize("name", ["fully_shard", "register_fsdp_forward_method", "share_comm_ctx"])
def test_functions_carry_torch_docs(name):
    assert inspect.getdoc(getattr(cfsdp, name)).startswith(inspect.getdoc(getattr(tfsdp, name)))


def test_cfsdp_notes_follow():
    doc = inspect.getdoc(cfsdp.FullyShardedDataParallel.summon_full_params)
    assert "\n\ncfsdp: " in doc and "offload_to_cpu" in doc.split("cfsdp: ", 1)[1]
