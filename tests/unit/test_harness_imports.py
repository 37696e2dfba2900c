"""The layout rule of tests/distributed (tests/README.md), checked on the source: no worker
imports another, helpers register no subtest, and feature modules run.

A worker (``tests/distributed/worker_*.py``) registers its subtests with the harness when it is
imported, so a worker importing another one would register the other's subtests as well; what
workers share (models, data, training loops, compare and checkpoint helpers) lives in the helper
modules next to them (``parity_common.py``, ``fs_common.py``, ``fully_shard/common.py``, ...),
which register no subtest (the harness runs only the launched script's own subtests and those of
the feature modules it names, so one registered in a helper would never run).  A worker may keep
its subtests in *feature modules* (``fully_shard/<feature>.py``, one package per worker): only
that worker and its sibling feature modules import them, and the worker names every one of them
in ``FEATURES`` (else its subtests would never run).  Every ``import`` / ``from ... import``, at
module level and inside functions, is read from the AST; nothing is imported or run
(``no_core``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DIST = Path(__file__).resolve().parents[1] / "distributed"


def _imported_full(path: Path) -> set[str]:
    """The dotted module names ``path`` imports (``from a import b``: ``a`` and ``a.b``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _imported(path: Path) -> set[str]:
    """The top-level module names ``path`` imports."""
    return {m.split(".")[0] for m in _imported_full(path)}


def _registers_subtests(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "subtest":
            return True
    return False


def _packages() -> list[Path]:
    """The feature-module packages (``fully_shard/``, ``strategies/``, ``zero/``): folders of
    tests/distributed with Python files."""
    return sorted(d for d in DIST.iterdir() if d.is_dir() and any(d.glob("*.py")))


def _feature_modules(pkg: Path) -> list[Path]:
    return sorted(f for f in pkg.glob("*.py") if _registers_subtests(f))


def _sources() -> list[Path]:
    files = sorted(DIST.glob("*.py")) + [f for d in _packages() for f in sorted(d.glob("*.py"))]
    assert any(f.name.startswith("worker_") for f in files), f"no worker found in {DIST}"
    return files


def _id(path: Path) -> str:
    return str(path.relative_to(DIST))


@pytest.mark.no_core
@pytest.mark.parametrize("path", _sources(), ids=_id)
def test_no_source_of_tests_distributed_imports_a_worker(path):
    workers = {f.stem for f in DIST.glob("worker_*.py")}
    bad = sorted(_imported(path) & workers)
    assert not bad, (f"{path.name} imports {bad}: importing a worker registers its subtests; "
                     f"move what is shared into a helper module (e.g. parity_common.py) and "
                     f"import that")


@pytest.mark.no_core
@pytest.mark.parametrize("path", [f for f in sorted(DIST.glob("*.py"))
                                  if not f.name.startswith("worker_")
                                  and not f.name.startswith("test_")], ids=_id)
def test_helpers_register_no_subtest(path):
    assert path.name == "_harness.py" or not _registers_subtests(path), (
        f"{path.name} registers a subtest: the harness runs only the launched worker's own "
        f"subtests and its feature modules', so this one would never run; register it in a "
        f"worker_*.py or a feature module (e.g. fully_shard/<feature>.py)")


def _features_of(worker: Path) -> tuple[str, ...]:
    for node in ast.parse(worker.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FEATURES" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    return ()


@pytest.mark.no_core
def test_feature_modules_exist():
    # the package checks below mean something only while there is a package to check
    assert any(_feature_modules(d) for d in _packages()), f"no feature module under {DIST}"


@pytest.mark.no_core
@pytest.mark.parametrize("pkg", _packages(), ids=lambda d: d.name)
def test_feature_modules_are_run_and_imported_only_by_their_worker(pkg):
    """Every feature module of ``pkg/`` is named in its worker's FEATURES (else its subtests
    never run; ``reshard``-like modules the worker imports by name count too), and only that
    worker and the package's own modules import feature modules; the package's other modules
    are helpers (they register no subtest)."""
    worker = DIST / f"worker_{pkg.name}.py"
    assert worker.exists(), f"{pkg.name}/ holds subtests of {worker.name}, which does not exist"
    features = {f"{pkg.name}.{f}" for f in _features_of(worker)}
    named = features | {c.value for c in ast.walk(ast.parse(worker.read_text()))
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)
                        and c.value.startswith(f"{pkg.name}.")}
    mods = {f"{pkg.name}.{f.stem}": f for f in _feature_modules(pkg)}
    assert features, f"{worker.name} names no FEATURES"
    missing = sorted(set(mods) - named)
    assert not missing, f"{missing} register subtests that {worker.name} never runs: add them to FEATURES"
    unknown = sorted(features - set(mods))
    assert not unknown, f"{worker.name}'s FEATURES {unknown} are not feature modules of {pkg.name}/"
    for src in _sources():
        if src == worker or src.parent == pkg:
            continue
        bad = sorted(_imported_full(src) & set(mods))
        assert not bad, (f"{_id(src)} imports the feature modules {bad}: importing one registers "
                         f"its subtests; move what is shared into {pkg.name}/common.py or a helper")
