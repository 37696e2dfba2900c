"""Run an unmodified training script on cfsdp: ``python -m cfsdp.run script.py [args]``.

Usage (each runs ``script.py`` exactly as ``python script.py [args]`` would, after
``cfsdp.patch_torch()``, so every FSDP name the script or its libraries look up in torch's
modules is cfsdp's; see ``cfsdp/_patch.py`` for the list)::

    python -m cfsdp.run script.py [args]
    python -m cfsdp.run -m package.module [args]           # as python -m package.module
    torchrun --nproc_per_node 2 -m cfsdp.run script.py [args]
    accelerate launch -m cfsdp.run script.py [args]

The script runs as ``__main__`` (``runpy``), with ``sys.argv`` = ``[script.py, args...]`` and
the script's directory first on ``sys.path`` in place of the working directory, as ``python
script.py`` sets them (unless Python runs with ``-P``, which adds neither); ``-m`` runs a module
as ``python -m`` does.  Its exit status is the script's.  A ``--local-rank=N`` that a legacy
launcher (``torch.distributed.launch`` without ``--use-env``) puts before the script is handed
to the script, after its path, where it would be without this module.

Processes the script starts with the ``spawn`` method (multiprocessing, DataLoader workers
with ``multiprocessing_context="spawn"``) are fresh interpreters: they are not patched.  Forked
ones are.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Optional, Sequence

from . import patch_torch

USAGE = "usage: python -m cfsdp.run (script.py | -m module) [args ...]"
_LEGACY_RANK_FLAGS = ("--local-rank=", "--local_rank=")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Patch torch's FSDP names, then run ``argv`` (``sys.argv[1:]`` by default) as the
    script or ``-m`` module it names.  A missing script is exit status 2 with the usage."""
    argv = list(sys.argv[1:] if argv is None else argv)
    legacy = []
    while argv and argv[0].startswith(_LEGACY_RANK_FLAGS):
        legacy.append(argv.pop(0))
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if not argv or argv == ["-m"]:
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    patch_torch()
    if argv[0] == "-m":
        sys.argv[:] = [argv[1], *legacy, *argv[2:]]  # run_module sets argv[0] to the file
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv[:] = [script, *legacy, *argv[1:]]
    if not sys.flags.safe_path and sys.path:
        sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
