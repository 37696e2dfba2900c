"""cfsdp.optim.ZeroRedundancyOptimizer against torch's ZeroRedundancyOptimizer and against
plain DDP + optimizer.

Run by tests/distributed/test_zero.py under torchrun (gloo, CPU) at W=2 and W=4 (shared
memory) and W=3 (the process group: CFSDP_SHM=0), every subtest in one spawn.

Oracle and tolerance: **bitwise**.  Three copies of one model (same seed), each in DDP
over the subtest's group, train on the same per-rank data: ``plain`` (torch.optim.X over
all parameters), ``torch`` (torch's ZeroRedundancyOptimizer with X) and ``cfsdp``
(cfsdp's, with X or cfsdp.optim.X).  DDP gives all three the same gradients, a ZeRO's
local step is X's per-parameter math on them, and the parameter sync copies bytes, so
losses, parameters and consolidated state dicts are equal bit for bit, at every world
size.  cfsdp.optim's Adam uses an IEEE square root where torch's CPU ``Tensor.sqrt`` is
MKL's (within 1 ulp); the worker patches ``Tensor.sqrt`` to an IEEE one (as
worker_optim.py does) so that cfsdp.optim.X inside is bitwise too.  The ZeRO-2 hook
(``reduce_scatter_hook``) is checked against plain DDP + AdamW: bitwise at W=2 (the
reduced gradient is the same two-term sum, divided by 2), within fp32 rounding of the
sum's order at W=3/4 (rtol 1e-5, atol 1e-6; stated in that subtest).

This script is a thin runner: the subtests live in the feature modules of ``zero/`` (listed in
``FEATURES`` below, in the order they run; what they share is in ``zero/common.py``), and one
spawn runs those of every module (see _harness.py; ``--modules zero.X,...`` and ``--subtests
NAME,...`` pick some).
"""

import warnings

import _harness as h
import _ieee_sqrt

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

_ieee_sqrt.install()  # see the module docstring

# the feature modules (zero/<name>.py), in the order their subtests run
FEATURES = ("parity", "shared_bucket", "state_dicts", "step_api", "duplicates", "join", "zero2_hook",
            "process_groups")
MODULES = tuple(f"zero.{f}" for f in FEATURES)


if __name__ == "__main__":
    h.main(modules=MODULES)
