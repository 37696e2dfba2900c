"""tools/gpu_check.sh (issue 26's prepared GPU check): on a machine without a GPU it exits
at once with status 2, saying so, and runs nothing (no build, no output directory written
to).  What it does on a GPU is not checked here (no GPU); its plumbing was checked with
``GPU_CHECK_DRY_RUN=1`` (the CPU, gloo, tiny sizes), see tools/gpu_check.sh."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.no_core
ROOT = Path(__file__).resolve().parents[2]


def test_no_gpu_exits_2_at_once(tmp_path):
    assert not torch.cuda.is_available(), "this test is for a machine without a GPU"
    out = tmp_path / "out"
    t0 = time.monotonic()
    res = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh")], capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "OUT": str(out), "PYTHON": sys.executable})
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "gpu_check: no GPU on this machine" in res.stdout and "nothing was run" in res.stdout
    assert time.monotonic() - t0 < 60
    assert not any(out.iterdir()), list(out.iterdir())  # no build log, no report
