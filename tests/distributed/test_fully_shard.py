"""The composable face: cfsdp.fully_shard against torch's fully_shard (see worker_fully_shard.py).

One pytest item per registered subtest (every point of its grid) and world size, named
``test_fully_shard[W-feature-subtest]`` after the feature module ``fully_shard/<feature>.py``
that registers it, so ``-k bad_input`` or ``-k "2-checkpoint"`` picks some. Still ONE torchrun
launch per world size (spawning is the slow part): the module-scoped ``launches`` fixture runs
the worker once, at the first item of a world size, for the union of that world size's selected
items (``--modules``/``--subtests``), and each item then reads its own subtests' lines in the
harness summary (rank 0's ``PASS``/``FAIL``/``NOT RUN`` lines): an item fails if any of its
subtests failed, did not run, or the launch ended without a summary (timeout, crash) or failed
for a reason no subtest shows; the message carries the launch's output.

Resharding runs three launches in sequence sharing the test's tmp_path (save at 2, load and save
at 4, load at 2). ``CFSDP_SUBTESTS=substr`` runs only the matching subtests of the selected items
(an item none of whose subtests match fails, saying so: add -k); ``CFSDP_FS_SELFTEST=1`` puts torch's
own fully_shard in cfsdp's seat (checks the test itself).
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from launcher import RunResult, SUMMARY_MARK, failure_message, launch, run_reshard_chain, subtest_filter

LAUNCH_TIMEOUT_S = 300
WORKER = "worker_fully_shard.py"
HERE = Path(__file__).resolve().parent
WORLD_SIZES = (2, 4)


def _features() -> tuple[str, ...]:
    """The worker's ``FEATURES`` (read from its source: the worker is not imported here)."""
    for node in ast.parse((HERE / WORKER).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FEATURES" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError(f"{WORKER} defines no FEATURES")


def _is_subtest(dec: ast.expr) -> bool:
    f = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(f, ast.Attribute) and f.attr == "subtest"


def _world_sizes(cond: ast.expr, feature: str) -> tuple[int, ...]:
    """The world sizes an ``if`` around subtest registrations keeps: only ``WORLD == N``."""
    if (isinstance(cond, ast.Compare) and isinstance(cond.left, ast.Name) and cond.left.id == "WORLD"
            and len(cond.ops) == 1 and isinstance(cond.ops[0], ast.Eq)
            and isinstance(cond.comparators[0], ast.Constant)):
        return (cond.comparators[0].value,)
    raise AssertionError(f"fully_shard/{feature}.py registers subtests under `if {ast.unparse(cond)}`: "
                         f"teach test_fully_shard.py which world sizes that keeps")


def _name(reg: ast.expr, fn: str) -> str:
    kw = {k.arg: k.value for k in getattr(reg, "keywords", [])}
    return ast.literal_eval(kw["name"]) if "name" in kw else fn


def registered(feature: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, world sizes)`` of every subtest ``fully_shard/<feature>.py`` registers, with
    ``@h.subtest`` or ``h.subtest(...)(fn)`` (its ``name=`` or the function's name), read from
    the source; once per name."""
    out: dict[str, tuple[int, ...]] = {}

    def walk(body: list[ast.stmt], sizes: tuple[int, ...]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                walk(node.body, _world_sizes(node.test, feature))
                assert not node.orelse, f"fully_shard/{feature}.py: an `else` around subtests"
            elif isinstance(node, ast.FunctionDef):
                for dec in node.decorator_list:
                    if _is_subtest(dec):
                        out.setdefault(_name(dec, node.name), sizes)
            elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                  and _is_subtest(node.value.func) and len(node.value.args) == 1
                  and isinstance(node.value.args[0], ast.Name)):  # h.subtest(grid=...)(fn)
                out.setdefault(_name(node.value.func, node.value.args[0].id), sizes)

    walk(ast.parse((HERE / "fully_shard" / f"{feature}.py").read_text()).body, WORLD_SIZES)
    return list(out.items())


CASES = [pytest.param(ws, feature, name, id=f"{ws}-{feature}-{name}")
         for ws in WORLD_SIZES for feature in _features()
         for name, sizes in registered(feature) if ws in sizes]

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


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """``get(world_size) -> RunResult``: the one launch of that world size, run at its first
    call for every selected item of that world size."""
    done: dict[int, RunResult] = {}

    def get(ws: int) -> RunResult:
        if ws not in done:
            mine = [it.callspec.params for it in request.session.items
                    if it.module is request.module and getattr(it, "originalname", "") == "test_fully_shard"
                    and it.callspec.params["world_size"] == ws]
            every = [c.values for c in CASES if c.values[0] == ws]
            args = []
            if len(mine) < len(every):  # a selection: its modules, its subtests
                feats = {p["feature"] for p in mine}
                args = ["--modules", ",".join(f"fully_shard.{f}" for f in _features() if f in feats),
                        "--subtests", ",".join(sorted({p["name"] for p in mine}))]
            done[ws] = launch(WORKER, ws, args=args + subtest_filter(), timeout=LAUNCH_TIMEOUT_S,
                              env={"CFSDP_CKPT_DIR": str(tmp_path_factory.mktemp(f"fs_w{ws}"))})
            out = done[ws].output
            head = out[out.rfind(SUMMARY_MARK):].strip().splitlines()[0] if SUMMARY_MARK in out else "no summary"
            print(f"$ {' '.join(done[ws].cmd)}\n{head}")  # with -s: the one launch of this W
        return done[ws]

    return get


def _base(name: str) -> str:
    return name.split("[", 1)[0]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size, feature, name", CASES)
def test_fully_shard(launches, world_size, feature, name):
    res = launches(world_size)
    lines = summary(res.output)
    why = failure_message(res) or f"$ {' '.join(res.cmd)}\nOutput:\n{res.output[-12000:]}"
    if lines is None:
        pytest.fail(f"the launch printed no subtest summary.\n{why}", pytrace=False)
    claimed = {c.values[2] for c in CASES if c.values[0] == world_size}
    unclaimed = sorted(n for n in lines if _base(n) not in claimed)
    if unclaimed:  # registered in a way registered() does not read: it would go unchecked
        pytest.fail(f"subtests without a pytest item (teach registered() how they are "
                    f"registered): {unclaimed}\n{why}", pytrace=False)
    own = {n: s for n, s in lines.items() if _base(n) == name}
    if not own:
        if os.environ.get("CFSDP_SUBTESTS"):  # a run that checks nothing is not a pass
            why = (f"CFSDP_SUBTESTS={os.environ['CFSDP_SUBTESTS']!r} matches none of its "
                   f"subtests: pick the items with -k as well.\n{why}")
        pytest.fail(f"subtest {name} did not run at world size {world_size}.\n{why}", pytrace=False)
    bad = {n: s for n, s in own.items() if s != "PASS"}
    if bad:
        detail = "\n".join(_failed_section(res.output, n) for n in bad)
        pytest.fail(f"{bad}\n{detail}\n{why}", pytrace=False)
    if res.returncode != 0 and not any(s != "PASS" for s in lines.values()):
        pytest.fail(f"every subtest passed but the launch failed.\n{why}", pytrace=False)
    print("\n".join(f"{s} {n}" for n, s in own.items()))


def _failed_section(output: str, name: str) -> str:
    """The harness's ``---- FAILED name ----`` section (every failing rank's traceback)."""
    i = output.rfind(f"\n---- FAILED {name} ----")
    if i < 0:
        return ""
    j = output.find("\n---- FAILED ", i + 1)
    return output[i:j if j >= 0 else None]


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("first_ws, second_ws", [(2, 4)])
def test_fully_shard_reshard(tmp_path, first_ws, second_ws):
    """W=2 saves, W=4 loads it (2 -> 4) and saves, W=2 loads that (4 -> 2)."""
    run_reshard_chain(WORKER, "CFSDP_FS_PHASE", tmp_path, first_ws, second_ws, LAUNCH_TIMEOUT_S)
