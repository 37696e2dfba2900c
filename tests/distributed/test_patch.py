"""``cfsdp.patch_torch()`` and ``python -m cfsdp.run``: see worker_patch.py.

Each launch is ``torchrun -m cfsdp.run worker_patch.py ARGS`` (the switch), at 2 and 4 ranks;
the worker checks that the switch patched before it ran and passed ARGS on
(``CFSDP_PATCH_ARGV``), then compares a trainer written against torch's names, on torch and on
cfsdp through those names, with cfsdp called by name, bit for bit.
"""

import json

import pytest

from launcher import HERE, run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 240  # a few seconds of subtests: tiny models, every subtest at 4 ranks too


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_patch_torch(world_size):
    args = [str(HERE / "worker_patch.py"), *subtest_filter(world_size)]
    run_worker("cfsdp.run", world_size, args=args, timeout=LAUNCH_TIMEOUT_S, module=True,
               env={"CFSDP_PATCH_ARGV": json.dumps(args[1:])})
