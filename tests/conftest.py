"""Suite-wide pytest hooks.

* Every test under tests/distributed/ gets the ``distributed`` marker, so
  ``pytest -m "not distributed"`` runs the fast unit tests only.
* The header shows which cfsdp core the run exercises (``CFSDP_IMPL``), since the whole suite
  is meant to pass once per backend.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_DISTRIBUTED = Path(__file__).resolve().parent / "distributed"


def pytest_report_header(config):
    return f"cfsdp backend under test: CFSDP_IMPL={os.environ.get('CFSDP_IMPL', 'c')}"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _DISTRIBUTED in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.distributed)
