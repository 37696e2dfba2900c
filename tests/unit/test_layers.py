"""The import rule of docs/ARCHITECTURE.md, checked on the source: layers go one way.

Every ``import`` / ``from ... import`` inside ``python/cfsdp`` (at module level *and* inside
functions: a late import that dodges a cycle is still an edge) is read from the AST and
resolved to a module of the package.  Then:

* a module imports only modules of its own layer or of a lower one (faces -> state dicts ->
  runtime -> bottom -> torch, where ``cfsdp._torch`` binds torch's private APIs);
* the import graph has no cycle (within a layer too);
* only ``cfsdp._core`` (the one door to the C core) imports ``cfsdp._C`` or the twins in
  ``cfsdp._ref`` (which import nothing of cfsdp but each other);
* only ``cfsdp._core`` uses ``_C`` (a name ``_C`` or an attribute ``x._C`` of anything but
  ``torch``) or calls ``.data_ptr()``: what crosses into C is checked there
  (``c_tensor_ok``), and other modules read addresses through ``_core.address``.

A new module must be given a layer in ``LAYERS``; the test fails for a module it does not
know.  Nothing is imported or run: these tests are pure source checks (``no_core``).
"""

from __future__ import annotations

import ast
from fnmatch import fnmatch
from pathlib import Path

import pytest

PKG_ROOT = Path(__file__).resolve().parents[2] / "python"
PKG = "cfsdp"

# top to bottom; a module's layer is the first whose patterns match its dotted name
LAYERS: list[tuple[str, list[str]]] = [
    ("faces", ["cfsdp", "cfsdp.fully_sharded_data_parallel", "cfsdp._fully_shard", "cfsdp.optim",
               "cfsdp.optim.*", "cfsdp.checkpoint", "cfsdp.checkpoint.*", "cfsdp.parallel",
               "cfsdp.parallel.*", "cfsdp._patch", "cfsdp.run"]),
    ("state dicts", ["cfsdp._state_dict", "cfsdp._optim_state_dict"]),
    ("runtime", ["cfsdp._runtime", "cfsdp._runtime.*"]),
    ("bottom", ["cfsdp._fqn", "cfsdp._docs", "cfsdp._compile", "cfsdp._internals", "cfsdp.api",
                "cfsdp.wrap", "cfsdp._core", "cfsdp._C", "cfsdp._ref", "cfsdp._ref.*"]),
    # torch's private APIs, one module per concern, for every supported torch version
    ("torch", ["cfsdp._torch", "cfsdp._torch.*"]),
]
CORE_DOOR = "cfsdp._core"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((PKG_ROOT / PKG).rglob("*.py")):
        rel = path.relative_to(PKG_ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def layer_of(name: str) -> int:
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch(name, p) for p in patterns):
            return i
    raise AssertionError(f"{name} has no layer: add it to LAYERS in {__file__}")


def _resolve(name: str) -> str | None:
    """The package module ``name`` refers to (a package's submodule or the package), or None
    outside cfsdp (``cfsdp._C`` counts: it is a module of the package)."""
    if name != PKG and not name.startswith(PKG + "."):
        return None
    while name not in MODULES and name != f"{PKG}._C":
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(name: str) -> set[str]:
    """Every cfsdp module ``name`` imports, anywhere in its source."""
    path = MODULES[name]
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # ``from pkg import sub`` imports the submodule when there is one, else a
            # name of ``pkg``
            targets = [f"{base}.{a.name}" if (f"{base}.{a.name}" in MODULES
                                               or f"{base}.{a.name}" == f"{PKG}._C") else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            r = _resolve(t)
            if r is not None and r != name:
                out.add(r)
    return out


GRAPH = {name: imports_of(name) for name in MODULES}


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down(name):
    mine = layer_of(name)
    up = sorted(t for t in GRAPH[name] if layer_of(t) < mine)
    assert not up, (f"{name} ({LAYERS[mine][0]}) imports {up} from a higher layer; move what it "
                     "needs down instead (docs/ARCHITECTURE.md, 'Layers')")


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(GRAPH.get(n, ())):
            if state.get(m) == 1:
                cycle = stack[stack.index(m):] + [m]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(GRAPH):
        if n not in state:
            visit(n)


def test_only_core_reaches_the_c_core_and_twins():
    for name, targets in GRAPH.items():
        if name == CORE_DOOR or name.startswith(f"{PKG}._ref"):
            continue
        bad = sorted(t for t in targets if t == f"{PKG}._C" or t.startswith(f"{PKG}._ref"))
        assert not bad, f"{name} imports {bad}: go through cfsdp._core, the one door to the C core"
    for name, targets in GRAPH.items():
        if name.startswith(f"{PKG}._ref"):
            outside = sorted(t for t in targets if not t.startswith(f"{PKG}._ref"))
            assert not outside, f"twin {name} imports {outside}: twins depend on torch only"


def test_the_checker_sees_a_bad_edge(monkeypatch):
    """The checks can fail: an upward import and a cycle, planted in a copy of the graph."""
    g = {k: set(v) for k, v in GRAPH.items()}
    g[f"{PKG}._runtime.comm"].add(f"{PKG}._state_dict")
    g[f"{PKG}._fqn"] = {f"{PKG}._core"}
    g[f"{PKG}._core"] = g[f"{PKG}._core"] | {f"{PKG}._fqn"}
    monkeypatch.setitem(globals(), "GRAPH", g)
    with pytest.raises(AssertionError, match="higher layer"):
        test_imports_go_down(f"{PKG}._runtime.comm")
    with pytest.raises(AssertionError, match="import cycle"):
        test_no_import_cycle()


def test_the_resolver_follows_every_form():
    """Relative (``from .. import _core``, ``from .base import x``), absolute and late
    (inside a function) imports all become edges."""
    assert f"{PKG}._core" in GRAPH[f"{PKG}._runtime.flat.unit"]
    assert f"{PKG}._runtime.base" in GRAPH[f"{PKG}._runtime.flat.unit"]
    assert f"{PKG}._C" in GRAPH[CORE_DOOR]  # ``from . import _C`` inside a try block


def c_crossings(source: str, filename: str = "<source>") -> list[str]:
    """Every use of cfsdp's C module and every ``.data_ptr()`` call in ``source``, as
    ``line: code``, read from the AST (comments and docstrings do not count).  A use of
    ``_C`` is the name ``_C`` or an attribute ``x._C`` of anything but ``torch``
    (``torch._C`` is torch's own)."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Name) and node.id == "_C":
            hit = True
        elif isinstance(node, ast.Attribute) and node.attr == "_C":
            hit = not (isinstance(node.value, ast.Name) and node.value.id == "torch")
        else:
            hit = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and node.func.attr == "data_ptr")
        if hit:
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(out, key=lambda h: (int(h.split(":")[0]), h))


@pytest.mark.parametrize("name", sorted(MODULES))
def test_only_core_crosses_into_c(name):
    hits = c_crossings(MODULES[name].read_text(), str(MODULES[name]))
    if name == CORE_DOOR or name.startswith(f"{PKG}._ref"):
        return
    assert not hits, (f"{name} reaches the C core or reads addresses outside cfsdp._core: "
                      f"{hits}; go through a _core entry point (addresses: _core.address)")


def test_the_crossing_checker_sees_a_crossing():
    """The check can fail: a planted ``_C.foo`` and ``t.data_ptr()`` are both reported;
    the same words in a comment, a docstring or a string, and torch's ``torch._C``, are
    not."""
    src = (
        '"""Docstring: _C.foo and t.data_ptr() here do not count."""\n'
        "import torch\n"
        "# a comment: _C.bar, u.data_ptr()\n"
        "def f(t):\n"
        "    x = '_C.baz t.data_ptr()'\n"
        "    torch._C._has_storage(t)\n"
        "    _C.foo(t.data_ptr())\n"
        "    return _core._C\n"
    )
    assert c_crossings(src) == ["7: _C", "7: t.data_ptr()", "8: _core._C"]


pytestmark = pytest.mark.no_core
