"""Shared settings for the unit tests of the C core.

Hypothesis profiles: ``cfsdp`` (default: moderate example counts, no
deadline, so the unit suite stays well under a minute on 2 cores),
``sanitize`` (fewer examples; ``make sanitize`` runs the suite under
ASan/UBSan, which is several times slower) and ``versions`` (as few:
``make test-torch`` repeats the suite on other torch versions, where what
differs is torch, not the C core the full pass already searched).  Pick one
with ``CFSDP_HYPOTHESIS_PROFILE``.
"""

import functools
import inspect
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "cfsdp",
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "sanitize",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "versions",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("CFSDP_HYPOTHESIS_PROFILE", "cfsdp"))


# --------------------------------------------------------------------------------------------
# the no_core marker (pytest.ini), checked
# --------------------------------------------------------------------------------------------
#
# `make test` runs a test marked ``no_core`` once, in the plain unit pass: not again under
# ASan/UBSan (it runs no C code of ours beyond loading the module, which the sanitize target
# checks by itself and every other test does too) and not again on the twins (it calls
# nothing that CFSDP_IMPL switches).  So the marker must be true: while such a test runs,
# every function of the dispatcher cfsdp._core and every callable of cfsdp._C (functions and
# the ShmGroup/ShmWork types) is replaced by a spy, and a call to any of them fails the test.
# Child processes are the test's own business: they may import cfsdp (loading the module) or
# pick their own CFSDP_IMPL, nothing more.


@pytest.fixture(autouse=True)
def _no_core_guard(request, monkeypatch):
    if request.node.get_closest_marker("no_core") is None:
        yield
        return
    from cfsdp import _core

    calls: list[str] = []

    def spy(owner, name: str, fn) -> None:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            calls.append(f"{owner.__name__}.{name}")
            return fn(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name, obj in list(vars(_core).items()):
        if inspect.isfunction(obj) and obj.__module__ == _core.__name__:
            spy(_core, name, obj)
    if _core._C is not None:
        for name in dir(_core._C):
            obj = getattr(_core._C, name)
            if not name.startswith("_") and callable(obj):
                spy(_core._C, name, obj)
    yield
    if calls:
        pytest.fail(f"marked no_core but called {sorted(set(calls))}: remove the marker "
                    "(the test must run under the sanitizer and on the twins)", pytrace=False)


# --------------------------------------------------------------------------------------------
# a process group of one rank, for the modules that ask for it
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank_group():
    """gloo over a ``HashStore``, rank 0 of 1, for one module (``pytestmark =
    pytest.mark.usefixtures("one_rank_group")``), destroyed after it: the other unit tests
    still run without a default group."""
    import torch.distributed as dist

    from cfsdp._runtime import comm

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    comm.release(None)
    dist.destroy_process_group()
