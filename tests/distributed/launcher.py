"""Run a worker script under ``torchrun --standalone`` from a pytest test, hang-proof.

The worker runs as ``python -m torch.distributed.run --standalone --nproc_per_node W
script [args]`` in a new session (its own process group), with ``OMP_NUM_THREADS=1``
and ``CFSDP_IMPL`` passed through from the environment. ``--standalone`` makes torchrun
pick a free rendezvous port on localhost, so parallel and consecutive runs never collide.

Two ways a run fails, both with the output of every rank in the failure message:

* exit status != 0: the tail of the combined output (torchrun forwards every rank's
  stdout/stderr; the harness prefixes its own lines with ``[rank r]``);
* no exit within ``timeout`` seconds: every process of the run is killed (torchrun's
  process group *and* the workers, which torchrun starts in sessions of their own) and
  the test fails with "timed out after N s" and all output captured so far.

``launch`` returns a :class:`RunResult` and never fails by itself (the harness tests
use it to check that a broken worker is reported); ``run_worker`` is what the tests call.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# Default hard limit for one torchrun launch; a launch that groups many subtests at W=4
# on this 2-core machine takes well under half of it.
DEFAULT_TIMEOUT_S = 240.0
TAIL_CHARS = 12000
SUMMARY_MARK = "\n==== subtests:"  # printed by _harness.py on rank 0
SHM_ENV = "CFSDP_SHM"


@dataclass
class RunResult:
    cmd: list[str]
    returncode: int | None  # None when the run was killed on timeout
    output: str
    timed_out: bool
    elapsed_s: float
    timeout_s: float


def _descendants(root_pid: int) -> list[int]:
    """PIDs of all live descendants of ``root_pid`` (walks /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # the command name is in parentheses and may contain spaces
        fields = stat[stat.rfind(")") + 2 :].split()
        ppid = int(fields[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            out.append(child)
            todo.append(child)
    return out


def _kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun, its process group and every worker it started (by pid)."""
    pids = _descendants(proc.pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # proc.pid is its own pgid (new session)
    except ProcessLookupError:
        pass


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("CFSDP_IMPL", os.environ.get("CFSDP_IMPL", "c"))
    # the workers import the shared harness module from this directory
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    # torchrun's own log noise (rendezvous, agent start/stop) off; errors still show
    env.setdefault("LOGLEVEL", "WARNING")
    if extra:
        env.update(extra)
    return env


def launch(
    script: str | os.PathLike,
    nproc: int,
    args: Sequence[str] = (),
    timeout: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
    module: bool = False,
) -> RunResult:
    """``module``: ``script`` is a module name, run as ``torchrun -m script [args]``."""
    if not module:
        script = Path(script)
        if not script.is_absolute():
            script = HERE / script
    env = dict(env or {})
    if nproc >= 3 and SHM_ENV not in env and SHM_ENV not in os.environ:
        # [Note: shm at 3+ ranks] The parity suites compare with torch's FSDP on gloo bit
        # for bit.  Shared-memory sums add the ranks in rank order, gloo's in its ring
        # order; with 2 ranks that is the same sum (a + b == b + a), with 3 or more it
        # differs by fp32 rounding.  So launches of 3+ ranks take gloo unless the test
        # sets CFSDP_SHM itself; test_shm.py runs the collectives and training on shared
        # memory at 2, 3 and 4 ranks against gloo within the dtype's tolerance.
        env[SHM_ENV] = "0"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "--max_restarts",
        "0",
        *(["-m"] if module else []),
        str(script),
        *args,
    ]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=worker_env(env),
        cwd=str(REPO),
        start_new_session=True,
    )
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_run(proc)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:  # a pipe still held open: give up on the rest
            out = b"<output could not be collected after killing the run>"
    finally:
        if proc.poll() is None:
            _kill_run(proc)
            proc.wait()
    # a worker that outlived torchrun (e.g. torchrun died) must not leak into the next test
    for pid in _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return RunResult(
        cmd=cmd,
        returncode=None if timed_out else proc.returncode,
        output=out.decode(errors="replace"),
        timed_out=timed_out,
        elapsed_s=time.monotonic() - start,
        timeout_s=timeout,
    )


def failure_message(res: RunResult) -> str | None:
    """The message a test fails with for ``res``, or None if the run succeeded."""
    head = f"$ {' '.join(res.cmd)}\n(CFSDP_IMPL={os.environ.get('CFSDP_IMPL', 'c')})\n"
    if res.timed_out:
        return (
            f"{head}timed out after {res.timeout_s:g} s; all processes of the run were "
            f"killed. Output of all ranks:\n{res.output}"
        )
    if res.returncode != 0:
        tail = res.output[-TAIL_CHARS:]
        cut = "...\n" if len(res.output) > TAIL_CHARS else ""
        # the harness's per-subtest summary first (it may be far from the tail)
        i = res.output.find(SUMMARY_MARK)
        summary = ""
        if i >= 0 and i < len(res.output) - TAIL_CHARS:
            summary = "Subtest summary:" + res.output[i : i + TAIL_CHARS] + "\n...\n"
        return (
            f"{head}exited with status {res.returncode} after {res.elapsed_s:.1f} s.\n"
            f"{summary}Tail of the output:\n{cut}{tail}"
        )
    return None


def run_worker(
    script: str | os.PathLike,
    nproc: int,
    args: Sequence[str] = (),
    timeout: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
    module: bool = False,
) -> RunResult:
    """Run ``script`` on ``nproc`` ranks; fail the calling test unless it exits 0."""
    res = launch(script, nproc, args=args, timeout=timeout, env=env, module=module)
    msg = failure_message(res)
    if msg is not None:
        pytest.fail(msg, pytrace=False)
    # show the per-subtest summary with `pytest -s` / in the captured stdout of a failure
    print(res.output[-TAIL_CHARS:])
    return res


def run_reshard_chain(script: str, phase_env: str, ckpt_dir: os.PathLike, first_ws: int,
                      second_ws: int, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Resharding both ways in three launches of ``script`` sharing ``ckpt_dir`` (a launch is
    the slow part): ``first_ws`` saves; ``second_ws`` loads it, then saves; ``first_ws`` loads
    that. ``phase_env`` is the worker's variable naming the phases of a launch, in order."""
    for ws, phases in ((first_ws, "reshard_save"), (second_ws, "reshard_load,reshard_save"),
                       (first_ws, "reshard_load")):
        run_worker(script, ws, timeout=timeout,
                   env={"CFSDP_CKPT_DIR": str(ckpt_dir), phase_env: phases})


def subtest_filter(world_size: int = 2, at_4: str | None = None) -> list[str]:
    """``--only SUBSTR`` from ``CFSDP_SUBTESTS`` (run only the matching subtests); else, for
    a launch of 4 ranks, ``at_4`` (``A|B``: the subtests whose names contain A or B); else
    nothing (every subtest).

    [Note: coverage at 4 ranks] A launch of 4 ranks on this 2-core machine is 3-4x slower
    than one of 2.  Every subtest runs at 2 ranks; at 4 ranks a suite runs what 4 ranks add:
    hybrid strategies (a 2 x 2 mesh), uneven shards and ranks that hold only padding (the
    "odd" models), and one representative of each remaining kind, named by ``at_4`` in the
    test file.  ``CFSDP_SUBTESTS`` overrides it (e.g. ``CFSDP_SUBTESTS=_`` runs everything)."""
    only = os.environ.get("CFSDP_SUBTESTS")
    if only:
        return ["--only", only]
    if world_size >= 4 and at_4:
        return ["--only", at_4]
    return []
