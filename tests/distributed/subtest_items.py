"""One pytest item per subtest of a split worker, still one torchrun launch per configuration.

A split worker (``worker_<pkg>.py``: ``worker_fully_shard.py``, ``worker_strategies.py``,
``worker_zero.py``) is a thin runner over the feature modules of its package ``<pkg>/``, named in
its ``FEATURES``. :class:`SplitWorker` gives its test file:

* ``cases()``: one ``pytest.param(world_size, launch, feature, name)`` per registered subtest
  (every point of its grid) and launch configuration, with the id ``<launch>-<feature>-<name>``
  (``2-parity-structure``, ``3-pg-parity-parity``), so ``-k`` picks some. The registrations are
  read from the feature modules' source with ``ast`` (nothing is imported here: importing a
  feature module would import torch and register its subtests in this process):
  ``@h.subtest``, ``@h.subtest(grid=..., name=...)`` and ``h.subtest(...)(fn)``; an ``if WORLD
  == N:`` around registrations keeps them to that world size;
* ``launches(request, tmp_path_factory)``, for a module-scoped fixture: ``get(launch)`` runs the
  worker once per configuration, at its first item, for the union of the selected items of that
  configuration (``--modules``/``--subtests`` when ``-k`` deselected some);
* ``check(res, launch, feature, name)``: the item passes only if each of its subtests printed
  ``PASS`` in the harness summary (rank 0's ``PASS``/``FAIL``/``NOT RUN`` lines); a failed
  subtest, one that did not run, or a launch that ended without a summary (timeout, crash) or
  failed for a reason no subtest shows fail it, with the launch's output.

A configuration (:class:`Launch`) may run a subset of the subtests (``only``: ``A|B``, the
subtests whose full names contain A or B, as ``--only``; e.g. a file's 4-rank subset, see
[Note: coverage at 4 ranks] in launcher.py). Its items are then the registered subtests that
have a grid point matching it, and each such item checks that exactly those points ran; to know
the points, the grid is evaluated from the source: module-level assignments are evaluated in
order and every other name (an import) stands for a symbol that prints as its last attribute,
as the harness prints an enum member (``SS.FULL_SHARD`` -> ``FULL_SHARD``). A grid that cannot
be read so fails at collection, and a point printed otherwise fails the item, naming both.

``CFSDP_SUBTESTS=substr`` replaces a configuration's subset (as ``subtest_filter``): every
registered subtest then has an item, and an item none of whose subtests match fails, saying so
(a run that checks nothing is not a pass: pick the items with ``-k`` too).
"""

from __future__ import annotations

import ast
import builtins
import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from launcher import TAIL_CHARS, RunResult, SUMMARY_MARK, failure_message, launch

HERE = Path(__file__).resolve().parent

# one line of rank 0's summary (_harness.run_subtests): "  PASS name (1.23 s)", "  FAIL name
# (1.23 s)  failing ranks: [1]", "  NOT RUN name (a rank stopped reporting at ...)"
_LINE = re.compile(r"^  (PASS|FAIL|NOT RUN) (\S+) \(")


def summary(output: str) -> dict[str, str] | None:
    """Subtest name -> PASS / FAIL / NOT RUN from the last harness summary in ``output``; None
    if the launch printed none (it died or was killed before the end)."""
    i = output.rfind(SUMMARY_MARK)
    if i < 0:
        return None
    out = {}
    for line in output[i:].splitlines():
        m = _LINE.match(line)
        if m:
            out[m.group(2)] = m.group(1)
    return out


def failed_section(output: str, name: str) -> str:
    """The harness's ``---- FAILED name ----`` section (every failing rank's traceback)."""
    i = output.rfind(f"\n---- FAILED {name} ----")
    if i < 0:
        return ""
    j = output.find("\n---- FAILED ", i + 1)
    return output[i:j if j >= 0 else None]


def base(name: str) -> str:
    """The registered name of a subtest's full name (without its grid point)."""
    return name.split("[", 1)[0]


def _matches(only: str, name: str) -> bool:
    """The harness's ``--only``: ``A|B`` keeps the names containing A or B."""
    return any(w in name for w in only.split("|") if w)


# ------------------------------------------------------------------------ reading the source
# torch's dtypes print as ``torch.bfloat16`` (str of a torch.dtype), not as their last attribute
_TORCH_DTYPES = frozenset({
    "float32", "float", "float64", "double", "float16", "half", "bfloat16", "int8", "uint8",
    "int16", "int32", "int", "int64", "long", "bool", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2"})


class _Sym:
    """A name the source reader does not evaluate (an import, or what it gives): prints as its
    last attribute, as _harness._fmt prints an enum member (a torch dtype as torch prints it:
    ``torch.bfloat16``); calling it gives itself."""

    def __init__(self, name: str):
        self.name = self.value = name

    def __getattr__(self, attr: str) -> _Sym:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if self.name == "torch" and attr in _TORCH_DTYPES:
            return _Sym(f"torch.{attr}")
        return _Sym(attr)

    def __call__(self, *args: Any, **kwargs: Any) -> _Sym:
        return self

    def __str__(self) -> str:
        return self.name


class _Names(dict):
    def __missing__(self, key: str) -> Any:
        return getattr(builtins, key) if hasattr(builtins, key) else _Sym(key)


def _fmt(v: Any) -> str:
    """_harness._fmt: how a grid value appears in a subtest's name."""
    if isinstance(v, type):
        return v.__name__
    if hasattr(v, "name") and hasattr(v, "value"):
        return str(v.name)
    return str(v)


def _subtest_call(dec: ast.expr) -> bool:
    f = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(f, ast.Attribute) and f.attr == "subtest"


@dataclass
class Registered:
    """A subtest as its feature module registers it: ``name`` (``name=`` or the function's),
    the world sizes it is registered at, and its ``grid=`` expression (None without one)."""
    name: str
    sizes: tuple[int, ...]
    grid: ast.expr | None
    where: str


def _registration(reg: ast.expr, fn: str) -> tuple[str, ast.expr | None]:
    kw = {k.arg: k.value for k in getattr(reg, "keywords", [])}
    return (ast.literal_eval(kw["name"]) if "name" in kw else fn), kw.get("grid")


@dataclass
class Launch:
    """One torchrun launch of the worker: ``key`` starts its items' ids (``"2"``, ``"3-pg"``),
    ``env`` is added to the launch's, ``only`` (``A|B``) the subset it runs (all when None)."""
    key: str
    world_size: int
    env: dict[str, str] = field(default_factory=dict)
    only: str | None = None


class SplitWorker:
    """The items of ``worker`` (``worker_<pkg>.py``) over ``launches``; see the module docstring.
    ``tmp_env``: a variable set to a fresh folder for each launch (e.g. ``CFSDP_CKPT_DIR``)."""

    def __init__(self, worker: str, launches: list[Launch], timeout: float,
                 tmp_env: str | None = None):
        assert worker.startswith("worker_") and worker.endswith(".py"), worker
        self.worker, self.package = worker, worker[len("worker_"):-len(".py")]
        self.launches = {ln.key: ln for ln in launches}
        self.timeout, self.tmp_env = timeout, tmp_env
        self.features = self._features()
        self._registered = {f: self._read(f) for f in self.features}
        self._ns: dict[str, _Names] = {}
        self.items = [(ln, f, r.name) for ln in launches for f in self.features
                      for r in self._registered[f] if self._has_item(ln, f, r)]

    # -- the source
    def _features(self) -> tuple[str, ...]:
        """The worker's ``FEATURES`` (read from its source: the worker is not imported here)."""
        for node in ast.parse((HERE / self.worker).read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FEATURES"
                                                    for t in node.targets):
                return tuple(ast.literal_eval(node.value))
        raise AssertionError(f"{self.worker} defines no FEATURES")

    def _path(self, feature: str) -> Path:
        return HERE / self.package / f"{feature}.py"

    def _read(self, feature: str) -> list[Registered]:
        """Every subtest ``<pkg>/<feature>.py`` registers, once per name."""
        where = f"{self.package}/{feature}.py"
        out: dict[str, Registered] = {}
        every = tuple(sorted({ln.world_size for ln in self.launches.values()}))

        def sizes_of(cond: ast.expr) -> tuple[int, ...]:
            """The world sizes an ``if`` around subtest registrations keeps: only ``WORLD == N``."""
            if (isinstance(cond, ast.Compare) and isinstance(cond.left, ast.Name)
                    and cond.left.id == "WORLD" and len(cond.ops) == 1
                    and isinstance(cond.ops[0], ast.Eq) and isinstance(cond.comparators[0], ast.Constant)):
                return (cond.comparators[0].value,)
            raise AssertionError(f"{where} registers subtests under `if {ast.unparse(cond)}`: teach "
                                 f"subtest_items.py which world sizes that keeps")

        def add(reg: ast.expr, fn: str, sizes: tuple[int, ...]) -> None:
            name, grid = _registration(reg, fn)
            out.setdefault(name, Registered(name, sizes, grid, where))

        def walk(body: list[ast.stmt], sizes: tuple[int, ...]) -> None:
            for node in body:
                if isinstance(node, ast.If):
                    walk(node.body, sizes_of(node.test))
                    assert not node.orelse, f"{where}: an `else` around subtests"
                elif isinstance(node, ast.FunctionDef):
                    for dec in node.decorator_list:
                        if _subtest_call(dec):
                            add(dec, node.name, sizes)
                elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                      and _subtest_call(node.value.func) and len(node.value.args) == 1
                      and isinstance(node.value.args[0], ast.Name)):  # h.subtest(grid=...)(fn)
                    add(node.value.func, node.value.args[0].id, sizes)

        walk(ast.parse(self._path(feature).read_text()).body, every)
        return list(out.values())

    def _names(self, feature: str) -> _Names:
        """The module-level assignments of ``<pkg>/<feature>.py``, evaluated in order, and the
        names it imports from its package's modules (see _Sym)."""
        if feature not in self._ns:
            ns = _Names()
            for node in ast.parse(self._path(feature).read_text()).body:
                if (isinstance(node, ast.ImportFrom)
                        and (node.module or "").startswith(f"{self.package}.")):
                    sibling = self._names(node.module[len(self.package) + 1:])
                    for a in node.names:
                        if a.name in sibling:
                            ns[a.asname or a.name] = sibling[a.name]
                    continue
                targets = (node.targets if isinstance(node, ast.Assign)
                           else [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
                if not all(isinstance(t, ast.Name) for t in targets) or not targets:
                    continue
                try:
                    code = compile(ast.Expression(node.value), "<grid>", "eval")
                    value = eval(code, ns, ns)  # noqa: S307 - the worker's own source
                except Exception:  # noqa: BLE001 - a name it needs is then a _Sym
                    continue
                for t in targets:
                    ns[t.id] = value
            self._ns[feature] = ns
        return self._ns[feature]

    def points(self, feature: str, reg: Registered) -> list[str]:
        """The full names of ``reg``'s grid points, as the harness names them."""
        if reg.grid is None:
            return [reg.name]
        try:
            grid = eval(compile(ast.Expression(reg.grid), "<grid>", "eval"),  # noqa: S307
                        self._names(feature), self._names(feature))
            keys = list(grid)
            values = [list(grid[k]) for k in keys]
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"{reg.where}: cannot read the grid of {reg.name} from the source "
                                 f"({type(e).__name__}: {e}); teach subtest_items.py") from e
        return [reg.name + ("[" + ",".join(f"{k}={_fmt(v)}" for k, v in zip(keys, vs)) + "]"
                            if keys else "") for vs in itertools.product(*values)]

    def _only(self, ln: Launch) -> str | None:
        return os.environ.get("CFSDP_SUBTESTS") or ln.only

    def _has_item(self, ln: Launch, feature: str, reg: Registered) -> bool:
        if ln.world_size not in reg.sizes:
            return False
        if ln.only is None or os.environ.get("CFSDP_SUBTESTS"):
            return True
        return any(_matches(ln.only, p) for p in self.points(feature, reg))

    # -- pytest
    def cases(self) -> list:
        return [pytest.param(ln.world_size, ln.key, f, n, id=f"{ln.key}-{f}-{n}")
                for ln, f, n in self.items]

    def launcher(self, request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
        """``get(launch key) -> RunResult``: the one launch of that configuration, run at its
        first call for every selected item of it (for a module-scoped fixture)."""
        done: dict[str, RunResult] = {}

        def get(key: str) -> RunResult:
            if key not in done:
                ln = self.launches[key]
                mine = [it.callspec.params for it in request.session.items
                        if it.module is request.module and getattr(it, "callspec", None) is not None
                        and it.callspec.params.get("launch") == key]
                args = []
                if len(mine) < sum(1 for i in self.items if i[0] is ln):  # a selection
                    feats = {p["feature"] for p in mine}
                    args = ["--modules",
                            ",".join(f"{self.package}.{f}" for f in self.features if f in feats),
                            "--subtests", ",".join(sorted({p["name"] for p in mine}))]
                only = self._only(ln)
                env = dict(ln.env)
                if self.tmp_env:
                    env[self.tmp_env] = str(tmp_path_factory.mktemp(f"{self.package}_{key}"))
                done[key] = launch(self.worker, ln.world_size,
                                   args=args + (["--only", only] if only else []),
                                   timeout=self.timeout, env=env)
                out = done[key].output
                head = (out[out.rfind(SUMMARY_MARK):].strip().splitlines()[0] if SUMMARY_MARK in out
                        else "no summary")
                print(f"$ {' '.join(done[key].cmd)}\n{head}")  # with -s: this configuration's launch
            return done[key]

        return get

    def check(self, res: RunResult, key: str, feature: str, name: str) -> None:
        """Fail the calling item unless each of its subtests passed in ``res``."""
        ln = self.launches[key]
        lines = summary(res.output)
        why = failure_message(res) or f"$ {' '.join(res.cmd)}\nOutput:\n{res.output[-TAIL_CHARS:]}"
        if lines is None:
            pytest.fail(f"the launch printed no subtest summary.\n{why}", pytrace=False)
        claimed = {n for i_ln, _, n in self.items if i_ln is ln}
        unclaimed = sorted(n for n in lines if base(n) not in claimed)
        if unclaimed:  # registered in a way _read() does not see: it would go unchecked
            pytest.fail(f"subtests without a pytest item (teach subtest_items.py how they are "
                        f"registered): {unclaimed}\n{why}", pytrace=False)
        own = {n: s for n, s in lines.items() if base(n) == name}
        if not own:
            if os.environ.get("CFSDP_SUBTESTS"):  # a run that checks nothing is not a pass
                why = (f"CFSDP_SUBTESTS={os.environ['CFSDP_SUBTESTS']!r} matches none of its "
                       f"subtests: pick the items with -k as well.\n{why}")
            pytest.fail(f"subtest {name} did not run in launch {key}.\n{why}", pytrace=False)
        bad = {n: s for n, s in own.items() if s != "PASS"}
        if bad:
            detail = "\n".join(failed_section(res.output, n) for n in bad)
            pytest.fail(f"{bad}\n{detail}\n{why}", pytrace=False)
        if ln.only is not None and not os.environ.get("CFSDP_SUBTESTS"):
            (reg,) = [r for r in self._registered[feature] if r.name == name]
            want = sorted(p for p in self.points(feature, reg) if _matches(ln.only, p))
            if sorted(own) != want:
                pytest.fail(f"launch {key} ran {sorted(own)} of {name}, the source says {want} match "
                            f"{ln.only!r}: teach subtest_items.py how its grid prints", pytrace=False)
        if res.returncode != 0 and not any(s != "PASS" for s in lines.values()):
            pytest.fail(f"every subtest passed but the launch failed.\n{why}", pytrace=False)
        print("\n".join(f"{s} {n}" for n, s in own.items()))
