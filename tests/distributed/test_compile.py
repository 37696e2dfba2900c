"""torch.compile on models wrapped by either face, against torch's FSDP compiled the same way
(see worker_compile.py for what is compared).

One torchrun launch per world size runs every subtest; each launch compiles inductor's
kernels into its own cache directory under the test's tmp_path (nothing stale from an
earlier run, nothing shared with a parallel one).  ``CFSDP_SUBTESTS=substr`` runs only the
matching subtests.
"""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 300
AT_4 = ("backend=eager|backend=aot_eager|whole_flat|pattern=blocks]|activation_checkpointing"
        "|compiled_autograd")  # [Note: coverage at 4 ranks]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_compile(tmp_path, world_size):
    run_worker("worker_compile.py", world_size, args=subtest_filter(world_size, AT_4),
               timeout=LAUNCH_TIMEOUT_S,
               env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                    "TORCHINDUCTOR_COMPILE_THREADS": "1"})
