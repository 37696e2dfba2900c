"""The torch cfsdp runs on: which versions, and every private API of torch cfsdp uses.

cfsdp supports torch 2.11.x to 2.15.x (``OLDEST`` .. ``NEWEST``; ``pyproject.toml`` says the
same).  On each, cfsdp mirrors *that* torch: its public names, signatures, errors and numbers
(parity is always against the installed torch).  Importing cfsdp with a torch outside the range
is an ``ImportError`` naming the version found and the range: a drop-in that might compute
differently on a torch it was never run against is worse than none.

Every torch-private API cfsdp reaches into (a name with a leading underscore, or a module under
a private package such as ``torch.distributed._composable``) is bound here, one module per
concern, and nowhere else in the package:

==================  ============================================================================
``fsdp2``           FSDP2's API as the installed torch has it (``ShardPlacementResult``,
                    ``DataParallelMeshDims``, ``fully_shard``'s keyword arguments, the
                    ``FSDPModule`` methods), torch's composable registry
``fsdp1``           FSDP1's internals the wrapper face reuses (hybrid groups, its training-state
                    enum, mixed-precision overrides, the low-precision hooks, activation
                    checkpointing's wrapper class, its sharded-tensor helpers)
``dtensor``         DTensor internals (specs, tensor metadata, ``redistribute_local_tensor``,
                    ``_StridedShard``, contiguous strides)
``checkpoint``      ``ShardedTensor``, the state-dict gather, the DSD steps cfsdp routes,
                    DCP's file-system writer, ``_IncompatibleKeys``, pytree
``core``            autograd's engine, storage and functorch checks, the dispatch-mode stack,
                    the profiler switch, the optimizers' scalar dtype
``dynamo``          compiled autograd and dynamo's frame skip
==================  ============================================================================

A module binds what its torch has; where the tested versions differ it says so with a version
check (``at_least``) and the test of ``tests/unit/test_torch_compat.py`` holds each module to
what each tested version has.  So a new torch release is a change of the module of each concern
it touches (and of ``NEWEST``), found by ``make test-torch TORCH=<version>``.

Where cfsdp cannot do something on the installed torch, the error names the version and the
feature (``not_in_this_torch``).

Bottom layer: imports nothing of cfsdp.
"""

from __future__ import annotations

import re

import torch

OLDEST: tuple[int, int] = (2, 11)
NEWEST: tuple[int, int] = (2, 15)
# the versions `make test` runs the suite against (README's version table)
TESTED: tuple[str, ...] = ("2.11.0", "2.13.0", "2.15.0")


def parse(version: str) -> tuple[int, int, int]:
    """``"2.14.1+cu130"`` -> ``(2, 14, 1)``; pre-release and local tags are dropped."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ImportError(f"cfsdp: cannot read torch's version {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


VERSION_STRING: str = torch.__version__
VERSION: tuple[int, int, int] = parse(VERSION_STRING)


def at_least(major: int, minor: int) -> bool:
    """The installed torch is ``major.minor`` or newer."""
    return VERSION[:2] >= (major, minor)


def supported_range() -> str:
    return f"{OLDEST[0]}.{OLDEST[1]}.x to {NEWEST[0]}.{NEWEST[1]}.x"


def check_supported(version: str = VERSION_STRING) -> None:
    """``ImportError`` when ``version`` is outside the supported range."""
    v = parse(version)[:2]
    if not OLDEST <= v <= NEWEST:
        raise ImportError(
            f"cfsdp supports torch {supported_range()}; this environment has torch {version}. "
            f"Install a supported torch (e.g. pip install torch=={NEWEST[0]}.{NEWEST[1]}.*) or a "
            "cfsdp release that supports this one."
        )


def not_in_this_torch(feature: str, since: str) -> NotImplementedError:
    """The error for a feature the installed torch does not have (and so cfsdp, which mirrors
    it, does not either)."""
    return NotImplementedError(
        f"{feature} needs torch {since} or newer; this environment has torch {VERSION_STRING} "
        f"(cfsdp mirrors the installed torch)."
    )


check_supported()

__all__ = ["OLDEST", "NEWEST", "TESTED", "VERSION", "VERSION_STRING", "at_least", "check_supported",
           "not_in_this_torch", "parse", "supported_range"]
