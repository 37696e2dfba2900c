"""The layout rule of tests/distributed (tests/README.md), checked on the source: no worker
imports another.

A worker (``tests/distributed/worker_*.py``) registers its subtests with the harness when it is
imported, so a worker importing another one would register the other's subtests as well; what
workers share (models, data, training loops, compare and checkpoint helpers) lives in the helper
modules next to them (``parity_common.py``, ``fs_common.py``, ...), which register no subtest
(the harness runs only the launched script's own subtests, so one registered in a helper would
never run).  Every ``import`` / ``from ... import``, at module level and inside functions, is
read from the AST; nothing is imported or run (``no_core``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DIST = Path(__file__).resolve().parents[1] / "distributed"


def _imported(path: Path) -> set[str]:
    """The top-level module names ``path`` imports."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def _registers_subtests(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "subtest":
            return True
    return False


def _sources() -> list[Path]:
    files = sorted(DIST.glob("*.py"))
    assert any(f.name.startswith("worker_") for f in files), f"no worker found in {DIST}"
    return files


@pytest.mark.no_core
@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.name)
def test_no_source_of_tests_distributed_imports_a_worker(path):
    workers = {f.stem for f in DIST.glob("worker_*.py")}
    bad = sorted(_imported(path) & workers)
    assert not bad, (f"{path.name} imports {bad}: importing a worker registers its subtests; "
                     f"move what is shared into a helper module (e.g. parity_common.py) and "
                     f"import that")


@pytest.mark.no_core
@pytest.mark.parametrize("path", [f for f in _sources() if not f.name.startswith("worker_")
                                  and not f.name.startswith("test_")], ids=lambda p: p.name)
def test_helpers_register_no_subtest(path):
    assert path.name == "_harness.py" or not _registers_subtests(path), (
        f"{path.name} registers a subtest: the harness runs only the launched worker's own "
        f"subtests, so this one would never run; register it in a worker_*.py")
