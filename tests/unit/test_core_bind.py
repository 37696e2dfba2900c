"""cfsdp._C's bulk-binding entry points against their twins in cfsdp._ref.bind:
same effects, same results, same errors."""

import pytest
import torch
import torch.nn as nn

import cfsdp._C as C
from cfsdp._ref import bind as R

IMPLS = [pytest.param(C, id="c"), pytest.param(R, id="twin")]


def _mods(n=3):
    return [nn.Linear(2, 2) for _ in range(n)]


@pytest.mark.parametrize("impl", IMPLS)
def test_dict_set_and_pop(impl):
    mods = _mods()
    dicts = tuple(m.__dict__ for m in mods) + (mods[0]._parameters,)
    keys = ("a", "b", "a", "weight")
    vals = (torch.ones(1), torch.zeros(2), "x", nn.Parameter(torch.ones(2, 2)))
    impl.dict_set(dicts, keys, vals)
    assert mods[0].a is vals[0] and mods[1].b is vals[1] and mods[2].a == "x"
    assert mods[0].weight is vals[3]
    impl.dict_pop(dicts[:3], keys[:3])
    impl.dict_pop(dicts[:3], keys[:3])  # missing keys are fine
    assert "a" not in mods[0].__dict__ and "b" not in mods[1].__dict__
    impl.dict_set((), (), ())


@pytest.mark.parametrize("impl", IMPLS)
def test_attr_flags_get_set(impl):
    ts = (torch.zeros(1, requires_grad=True), torch.zeros(1), nn.Parameter(torch.zeros(2)))
    assert impl.attr_flags(ts, "requires_grad") == b"\x01\x00\x01"
    assert impl.attr_flags((), "requires_grad") == b""
    grads = (torch.ones(1), None, torch.full((2,), 3.0))
    impl.attr_set(ts, "grad", grads)
    got = impl.attr_get(ts, "grad")
    assert got[0] is grads[0] and got[1] is None and got[2] is grads[2]
    impl.attr_set(ts, "grad", None)
    assert impl.attr_get(ts, "grad") == (None, None, None)


BAD = [
    ("dict_set", ([], (), ()), TypeError, "dicts must be a tuple, not list"),
    ("dict_set", (({},), ("k", "l"), (1,)), ValueError, "dicts has 1 items but keys has 2"),
    ("dict_set", (({},), ("k",), (1, 2)), ValueError, "dicts has 1 items but values has 2"),
    ("dict_set", (({}, 5), ("k", "l"), (1, 2)), TypeError, r"dicts\[1\] is a int, not a dict"),
    ("dict_pop", (({},), ()), ValueError, "dicts has 1 items but keys has 0"),
    ("attr_flags", ((torch.zeros(1),), 3), TypeError, "name must be a str"),
    ("attr_flags", ((torch.zeros(1),), "no_such"), AttributeError, "no_such"),
    ("attr_set", ((torch.zeros(1),), "grad", ()), ValueError, "objs has 1 items but values has 0"),
    ("attr_get", ([torch.zeros(1)], "grad"), TypeError, "objs must be a tuple, not list"),
]


@pytest.mark.parametrize("fn, args, exc, msg", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
@pytest.mark.parametrize("impl", IMPLS)
def test_bad_calls(impl, fn, args, exc, msg):
    with pytest.raises(exc, match=msg):
        getattr(impl, fn)(*args)


@pytest.mark.parametrize("impl", IMPLS)
def test_dict_set_checks_every_dict_before_writing(impl):
    d = {}
    with pytest.raises(TypeError):
        impl.dict_set((d, 3), ("k", "l"), (1, 2))
    assert d == {}


@pytest.mark.parametrize("impl", IMPLS)
def test_shape_views(impl):
    flat = torch.arange(10.0, requires_grad=True)
    chunks = torch.split(flat, [6, 1, 3])
    got = impl.shape_views(chunks, (0, 2), (torch.Size([2, 3]), None), b"\x01\x00", (0, 1, 0))
    assert len(got) == 3 and got[0] is got[2]
    assert got[0].shape == (2, 3) and got[0].requires_grad and got[0]._base is flat
    assert got[1] is not chunks[2] and not got[1].requires_grad  # detached
    assert torch.equal(got[1], torch.tensor([7.0, 8.0, 9.0]))
    all_trainable = impl.shape_views(chunks, (2,), (None,), None, (0,))
    assert all_trainable[0] is chunks[2]
    got[0].sum().backward()
    assert torch.equal(flat.grad, torch.tensor([1.0] * 6 + [0.0] * 4))


SHAPE_VIEWS_BAD = [
    (((torch.zeros(2),), (1,), (None,), None, (0,)), ValueError, r"index\[0\] = 1 is not a chunk"),
    (((torch.zeros(2),), (0,), (None,), None, (1,)), ValueError, r"occ_index\[0\] = 1 is not a view"),
    (((torch.zeros(2),), (0,), (None,), b"", (0,)), ValueError, "trainable must be None or 1 bytes"),
    (((torch.zeros(2),), (0,), (None, None), None, (0,)), ValueError, "index has 1 items but shapes has 2"),
    (((torch.zeros(2),), (0,), ((3,),), None, (0,)), RuntimeError, "invalid for input of size 2"),
]


@pytest.mark.parametrize("args, exc, msg", SHAPE_VIEWS_BAD)
@pytest.mark.parametrize("impl", IMPLS)
def test_shape_views_bad_calls(impl, args, exc, msg):
    with pytest.raises(exc, match=msg):
        impl.shape_views(*args)
