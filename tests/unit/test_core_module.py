"""The module cfsdp._C itself (csrc/module.c, its one table over the bind_*.c files):
every function is listed with a text signature, every METH_FASTCALL entry point counts
its arguments through the one parser, and the ShmWork type comes from the module's state,
not from looking up the module attribute."""

import inspect
import os
import secrets

import pytest
import torch

import cfsdp._C as C

FUNCTIONS = sorted(n for n in dir(C) if not n.startswith("_") and inspect.isbuiltin(getattr(C, n)))


def test_the_table_lists_every_entry_point():
    assert FUNCTIONS == sorted([
        "plan_layout", "shard_fill", "chunk_unpack", "chunk_pack", "scale_cast_add",
        "norm_partial", "shm_reduce", "shm_memcpy", "shm_segment_bytes",
        "adam_step", "sgd_step", "muon_momentum", "optim_uses_avx2", "dict_set", "dict_pop", "attr_flags",
        "attr_set", "attr_get", "shape_views"])
    assert {"ShmGroup", "ShmWork", "ShmSegment"} <= set(dir(C))


@pytest.mark.parametrize("name", FUNCTIONS)
def test_signatures_and_argument_counts(name):
    """A text signature of positional-only parameters for each function, and the parser's
    TypeError for one argument too many (or, without parameters, any argument)."""
    fn = getattr(C, name)
    params = list(inspect.signature(fn).parameters.values())
    assert all(p.kind is p.POSITIONAL_ONLY for p in params)
    assert fn.__doc__ and fn.__doc__.strip()
    with pytest.raises(TypeError, match=f"{name}\\(\\) takes"):
        fn(*([0] * (len(params) + 1)))


def test_shm_work_type_is_module_state(monkeypatch):
    """A collective's handle is made from the type the module keeps in its state: the
    module attribute may be gone or replaced (before, ShmGroup() looked it up by name)."""
    work_type = C.ShmWork
    monkeypatch.delattr(C, "ShmWork")
    g = C.ShmGroup(f"/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}", True, 1, 0, 512, 5.0,
                   "state", [0])
    try:
        g.wait_attached()
        x = torch.ones(8)
        w = g.all_reduce(x.data_ptr(), x.data_ptr(), 8, 0, 2.0, 1, (x,))
        assert type(w) is work_type
        w.wait()
        assert torch.equal(x, torch.full((8,), 2.0))
    finally:
        g.close()


def test_statuses_map_to_exceptions():
    """One mapping for every entry point: ValueError, OverflowError, RuntimeError."""
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="numel must be >= 0"):
        C.scale_cast_add(x.data_ptr(), 0, x.data_ptr(), 0, -1, 1.0, False)
    with pytest.raises(OverflowError, match="overflows"):
        C.plan_layout((2**62, 2**62), 0, 1)
    with pytest.raises(RuntimeError, match=r"open\(\"/dev/shm/cfsdp-test-.*No such file"):
        C.ShmGroup(f"/cfsdp-test-{os.getpid()}-{secrets.token_hex(6)}", False, 2, 1, 512, 1.0,
                   "x", [0, 1])
