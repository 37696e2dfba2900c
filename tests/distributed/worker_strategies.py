"""Sharding strategies, no_sync(), CPU offload and frozen parameters: cfsdp against torch FSDP1 (and the single process).

Run by test_strategies.py under torchrun (gloo, CPU) at W=2 and W=4; every subtest runs in one
spawn (see _harness.py). Hybrid strategies need a 2-D layout, so they run at W=4 only, as
2 replicas x 2 shards, with the groups given both as a 2-D ``device_mesh`` and as a
``(shard_group, replicate_group)`` tuple.

Tolerances: cfsdp vs torch FSDP1 is **bitwise** everywhere here, for the reasons given in
worker_parity.py (same fp32 ops in the same order, same collectives, same divide factors).
For HSDP the gradient is reduce-scattered within the shard group, all-reduced across replicas
and divided by torch's factors for the whole data-parallel size, in that order, as torch does.

This script is a thin runner: the subtests live in the feature modules of ``strategies/``
(listed in ``FEATURES`` below, in the order they run; what they share is in
``strategies/common.py`` and ``parity_common.py``), and one spawn runs those of every module
(see _harness.py; ``--modules strategies.X,...`` and ``--subtests NAME,...`` pick some).
"""

import _harness as h

# the feature modules (strategies/<name>.py), in the order their subtests run
FEATURES = ("parity", "no_sync", "orig_param_writes", "orig_param_attributes", "offload_frozen_init",
            "comm_hook", "tied", "collective_order", "memory")
MODULES = tuple(f"strategies.{f}" for f in FEATURES)


if __name__ == "__main__":
    h.main(modules=MODULES)
