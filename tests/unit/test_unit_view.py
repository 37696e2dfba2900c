"""The state-dict layer reads a wrapper's unit only through its declared interface
([Note: unit view] in ``python/cfsdp/_runtime/unit_view.py``).

Static checks (``no_core``: the source is read, nothing run) over ``_state_dict.py`` and
``_optim_state_dict.py``: no unit module or unit class is imported; no unit is fetched but
through ``unit_of`` (no ``<wrapper>._state.unit``); and on a unit view only the names
``UnitView`` declares are read (on a parameter view only ``ParamView``'s), never written, never
through ``getattr``.  The modules' naming is what the check relies on: a unit view is held in
``u`` or ``unit``, in an attribute ``.unit`` (``_Entry.unit``), is an element of ``.units`` or
the result of ``_unit(w)`` / ``unit_of(...)``; a parameter view is ``info`` or ``i``, or an
element of ``.infos`` / ``.shared``.  The views themselves enforce the rest at run time: no
``__dict__``, no ``__getattr__``, so any other read is an ``AttributeError`` in every
state-dict test.  On a one-rank group: every declared name reads the live unit's own value,
and each state-dict type saves and loads through the views.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from cfsdp._runtime.unit_view import ParamView, UnitView, unit_of

PKG = Path(__file__).resolve().parents[2] / "python" / "cfsdp"
STATE_DICT_MODULES = ["_state_dict.py", "_optim_state_dict.py"]

# what the state-dict layer may not import: the unit kinds' modules (where they are and where
# issue 25 moves them) and the unit classes, from wherever they are re-exported
UNIT_MODULES = ("cfsdp._runtime.unit", "cfsdp._runtime.chunk_unit", "cfsdp._runtime.chunk_group",
                "cfsdp._runtime.flat", "cfsdp._runtime.chunk")
UNIT_CLASSES = {"Unit", "ChunkUnit", "ChunkUnitGroup", "ParamInfo"}


def declared(cls: type) -> set[str]:
    """The names a view declares: its public properties and methods."""
    return {n for n in vars(cls) if not n.startswith("_")}


UNIT_API, PARAM_API = declared(UnitView), declared(ParamView)


def _named(node: ast.AST, names: set[str]) -> bool:
    return (isinstance(node, ast.Name) and node.id in names) or (
        isinstance(node, ast.Attribute) and node.attr in names)


def _is_unit(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("u", "unit")
    if isinstance(node, ast.Attribute):
        return node.attr == "unit"
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id in ("_unit", "unit_of")
    return isinstance(node, ast.Subscript) and _named(node.value, {"units"})


def _is_param(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("info", "i")
    return isinstance(node, ast.Subscript) and _named(node.value, {"infos", "shared"})


def _resolve(node: ast.ImportFrom) -> str:
    """The absolute module of ``from ... import`` in a module of the ``cfsdp`` package itself."""
    if not node.level:
        return node.module or ""
    return ".".join(["cfsdp"] + ([node.module] if node.module else []))


def _unit_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in UNIT_MODULES)


def violations(source: str, filename: str = "<source>") -> list[str]:
    """Every way ``source`` (a state-dict module) reaches a unit other than through the declared
    views, as ``line: what``."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{getattr(node, 'lineno', 0)}: "
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif _unit_module(_resolve(node)):
                mods = [_resolve(node)]
            else:
                mods = [f"{_resolve(node)}.{a.name}" for a in node.names]
            bad = [m for m in mods if _unit_module(m)]
            bad += [a.name for a in node.names if a.name.split(".")[-1] in UNIT_CLASSES]
            if bad:
                out.append(where + f"imports {', '.join(bad)}")
        elif isinstance(node, ast.Attribute):
            if node.attr == "unit" and _named(node.value, {"_state", "state", "st"}):
                out.append(where + f"fetches the raw unit {ast.unparse(node)} (use unit_of)")
            elif _is_unit(node.value) and node.attr not in UNIT_API:
                out.append(where + f"reads {ast.unparse(node)}, which UnitView does not declare")
            elif _is_param(node.value) and node.attr not in PARAM_API:
                out.append(where + f"reads {ast.unparse(node)}, which ParamView does not declare")
            elif ((_is_unit(node.value) or _is_param(node.value))
                  and not isinstance(node.ctx, ast.Load)):
                out.append(where + f"writes {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "vars") and node.args
              and (_is_unit(node.args[0]) or _is_param(node.args[0]))):
            out.append(where + f"{ast.unparse(node)} (read declared names only)")
    return sorted(out, key=lambda h: int(h.split(":")[0]))


@pytest.mark.no_core
@pytest.mark.parametrize("name", STATE_DICT_MODULES)
def test_state_dicts_read_units_through_the_view_only(name):
    path = PKG / name
    found = violations(path.read_text(), str(path))
    assert not found, (f"{name} reaches a unit outside its declared interface: {found}; read it "
                       "through _runtime.unit_view (declare a new read there, with its meaning)")


@pytest.mark.no_core
def test_the_checker_sees_each_way_around_the_view():
    """The check can fail: each planted way around the views is reported; declared reads,
    the layout's own fields and other objects' attributes of the same names are not."""
    src = (
        "from ._runtime.unit import Unit\n"                          # 1: a unit module
        "from ._runtime import chunk_unit\n"                         # 2: one too
        "from ._runtime.unit_view import UnitView, unit_of\n"
        "def f(w, e, view):\n"
        "    u = unit_of(w._state)\n"
        "    raw = w._state.unit\n"                                   # 6: a raw fetch
        "    x = u.shard, u.layout.flat_numel, e.unit.rank, view.units[0].device\n"
        "    y = u.replicate_op\n"                                    # 8: undeclared
        "    z = e.unit._buf\n"                                       # 9: undeclared
        "    for info in u.infos:\n"
        "        info.fqn, info.module\n"                             # 11: undeclared
        "    u.infos[0].primary\n"                                    # 12: undeclared
        "    u.rank = 3\n"                                            # 13: a write
        "    getattr(u, 'dtype')\n"                                   # 14: dynamic
        "    _unit(w).pre_divide\n"                                   # 15: undeclared
        "    w.rank, w.module\n"
    )
    found = violations(src)
    assert [int(h.split(":")[0]) for h in found] == [1, 2, 6, 8, 9, 11, 12, 13, 14, 15], found
    assert "imports cfsdp._runtime.unit" in found[0] and "Unit" in found[0]
    assert "cfsdp._runtime.chunk_unit" in found[1]


@pytest.mark.no_core
def test_the_views_have_no_way_around_them():
    """No instance dict and no ``__getattr__``: an undeclared read or any write raises."""
    for cls in (UnitView, ParamView):
        assert "__getattr__" not in vars(cls) and "__getattribute__" not in vars(cls)
        assert not hasattr(cls(object()), "__dict__")
    unit = nn.Linear(2, 2)  # anything with attributes: the view must not pass them through
    view = UnitView(unit)
    with pytest.raises(AttributeError):
        view.weight  # noqa: B018
    with pytest.raises(AttributeError):
        view.rank = 0
    with pytest.raises(AttributeError):
        ParamView(unit).training  # noqa: B018


# ------------------------------------------------------------------ a live unit (one rank)


def _tied_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    model[2].weight = model[0].weight  # a tied occurrence: the unit's ``shared`` is not empty
    return model


def _same(a, b) -> bool:
    return a is b or (not isinstance(a, torch.Tensor) and a == b)


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_every_declared_name_reads_the_unit(use_orig_params):
    """Each property of the views gives the live unit's own object; each method exists on it
    (a rename in the unit's engine fails here, not only in the distributed tests)."""
    import cfsdp

    w = cfsdp.FullyShardedDataParallel(_tied_model(), use_orig_params=use_orig_params)
    raw = w._state.unit
    view = unit_of(w._state)
    assert isinstance(view, UnitView) and view._unit is raw and raw.shared
    for name in sorted(UNIT_API - {"infos", "shared"}):
        if isinstance(vars(UnitView)[name], property):
            assert _same(getattr(view, name), getattr(raw, name)), name
        else:
            assert callable(getattr(raw, name)), name
    for views, infos in ((view.infos, raw.infos), (view.shared, raw.shared)):
        assert len(views) == len(infos)
        for pv, info in zip(views, infos):
            for name in sorted(PARAM_API):
                if isinstance(vars(ParamView)[name], property):
                    assert _same(getattr(pv, name), getattr(info, name)), name
                else:
                    assert callable(getattr(info, name)), name
    t = torch.arange(view.infos[0].numel, dtype=torch.float32)
    assert torch.equal(view.infos[0].view(t), raw.infos[0].view(t))
    assert torch.equal(view.infos[0].flat(view.infos[0].view(t)), t)


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")  # torch's ShardedTensor
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_state_dicts_run_through_the_views(use_orig_params):
    """Every state-dict type and the optimizer state dict save and load on one rank, reading
    the unit only through the views (an undeclared read would be an AttributeError here), and
    the round trip leaves the parameters and the optimizer state as they were."""
    from cfsdp import FullyShardedDataParallel as FSDP
    from cfsdp import StateDictType

    w = FSDP(_tied_model(), use_orig_params=use_orig_params)
    opt = torch.optim.Adam(w.parameters(), lr=0.1)
    w(torch.randn(2, 3)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in w.parameters()]
    for t in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT,
              StateDictType.LOCAL_STATE_DICT):
        with FSDP.state_dict_type(w, t):
            sd = w.state_dict()
            assert sd, t
            w.load_state_dict(sd)
            osd = FSDP.optim_state_dict(w, opt)
            assert osd["state"], t
            opt.load_state_dict(FSDP.optim_state_dict_to_load(w, opt, osd))
        for p, q in zip(w.parameters(), before):
            assert torch.equal(p.detach(), q), t
