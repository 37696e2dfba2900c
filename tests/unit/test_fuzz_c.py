"""Fuzz of the C boundary: every callable of cfsdp._C (functions, ShmGroup and its methods
and attributes, ShmWork's) and every tensor entry point of cfsdp._core, with hostile
arguments (wrong types, huge / negative / overflowing sizes and offsets, buffers exactly
as long as promised, odd addresses, sequences that change while read, int-likes that
raise, plans freed before their queued op runs, tensors that must not cross).  See
_fuzz_c.py for what is drawn and what each entry point may raise.

The cases run in a child process (one per family), so a crash is a test failure that
names the entry point, the input, the signal and the sanitizer's report, not a dead
pytest.  Under ``make sanitize`` the child runs on the ASan/UBSan build with
``PYTHONMALLOC=malloc`` (one byte read past a buffer, or a freed object read, is a
report).  The seed is new on every run (printed on failure; ``CFSDP_FUZZ_SEED`` replays
one); the examples per entry point are ``_examples()``'s.
"""

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("_fuzz_c.py")
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer",
                   "Sanitizer CHECK failed")
FAMILIES = ["core", "shm", "bind", "_core"]


def _examples() -> int:
    """Examples per entry point: 80 in the sanitizer pass of ``make test`` (its fuzz is the
    one that sees every bad read), 40 in the plain pass, 10 in the twin pass
    (``CFSDP_IMPL=python``: the C families repeat the plain pass's; ``_core`` runs its
    twins); ``CFSDP_FUZZ_EXAMPLES`` overrides."""
    if os.environ.get("CFSDP_FUZZ_EXAMPLES"):
        return int(os.environ["CFSDP_FUZZ_EXAMPLES"])
    if os.environ.get("CFSDP_HYPOTHESIS_PROFILE") == "sanitize":
        return 80
    return 10 if os.environ.get("CFSDP_IMPL", "c") == "python" else 40


def run_driver(args, tmp_path, timeout=600):
    """Run the driver with `args`; (returncode, stdout, stderr, last case)."""
    log = tmp_path / "cases.log"
    env = dict(os.environ, PYTHONMALLOC="malloc", OMP_NUM_THREADS="1",
               PYTHONFAULTHANDLER="1")
    try:
        r = subprocess.run([sys.executable, str(DRIVER), *args[:1], str(log), *args[1:]],
                           capture_output=True, text=True, timeout=timeout, env=env,
                           cwd=DRIVER.parent)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", e.stdout or "", e.stderr or ""
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x for x in (out, err))
    last = ""
    if log.exists():
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("CASE")]
        last = lines[-1] if lines else ""
    return rc, out, err, last


def failure(rc, out, err, last, seed=None) -> str:
    """'' if the child ran every case cleanly, else a message naming the entry point, the
    input, how the child died and the tail of its stderr (the sanitizer's report)."""
    marks = [m for m in SANITIZER_MARKS if m in err]
    if rc == 0 and "FUZZ-OK" in out and not marks:
        return ""
    if isinstance(rc, int) and rc < 0:
        how = f"killed by {signal.Signals(-rc).name}"
    elif rc == "timeout":
        how = "timed out"
    else:
        how = f"exit status {rc}"
    entry, _, case = last[5:].partition(" ")
    return (f"fuzz child {how}{' with a sanitizer report' if marks else ''}\n"
            f"entry point: {entry or '?'}\ninput: {case or '?'}\n"
            f"seed: {seed} (replay: CFSDP_FUZZ_SEED={seed})\n"
            f"--- child stderr (tail) ---\n" + "\n".join(err.splitlines()[-60:]))


def test_every_entry_point_is_fuzzed():
    sys.path.insert(0, str(DRIVER.parent))
    try:
        import _fuzz_c as F
    finally:
        sys.path.remove(str(DRIVER.parent))
    covered = set(F.ENTRIES) | set(F.COVERED_BY)
    assert [n for n in F.c_callables() if n not in covered] == []
    assert all(F.COVERED_BY[n] in F.ENTRIES for n in F.COVERED_BY)
    assert {fam for fam, _, _ in F.ENTRIES.values()} == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_fuzz(family, tmp_path):
    seed = int(os.environ.get("CFSDP_FUZZ_SEED") or random.randrange(2**32))
    rc, out, err, last = run_driver([family, str(seed), str(_examples())], tmp_path)
    msg = failure(rc, out, err, last, seed)
    if msg:
        pytest.fail(msg, pytrace=False)


def test_harness_reports_a_crash(tmp_path):
    """The harness turns a dead child into a failure naming the case (the driver's
    self-test segfaults after logging one)."""
    rc, out, err, last = run_driver(["--selftest-crash"], tmp_path, timeout=60)
    msg = failure(rc, out, err, last)
    # plain build: the signal; under ASan: its report of the SEGV (exit status 1)
    assert "killed by SIGSEGV" in msg or "with a sanitizer report" in msg, msg
    assert "entry point: selftest" in msg
    assert "input: ctypes.string_at(0)" in msg
