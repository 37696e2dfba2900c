"""``CFSDP_TEST_WORLD_SIZES=2`` (comma-separated) runs only the launches at those world sizes.

The suite's second pass on the pure-Python twins (``make test``) uses it to stay within CI's
time budget: the twins are checked against the C core for every world size by the unit tests,
so the distributed pass on them needs one world size, not every one.
"""

import os

import pytest


def _allowed() -> set[int] | None:
    raw = os.environ.get("CFSDP_TEST_WORLD_SIZES", "").strip()
    return {int(x) for x in raw.split(",") if x.strip()} if raw else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    allowed = _allowed()
    if allowed is None:
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        sizes = {v for k, v in params.items() if k.endswith("ws") or k == "world_size"}
        (keep if sizes <= allowed else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
