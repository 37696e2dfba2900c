"""Tensor parallelism with both faces against torch (see worker_tp.py and worker_tp_wrapper.py
for what is compared).

One torchrun launch per world size runs every subtest (and one of 8 ranks the one subtest that
needs them: Muon on a (2, 2, 2) HSDP x TP mesh); the checkpoint-across-meshes test
chains two launches sharing the test's tmp_path: 4 ranks on (2, 2) save, 2 ranks load on
(1, 2) and (2, 1).  ``CFSDP_SUBTESTS=substr`` runs only the matching subtests.
"""

import pytest

from launcher import run_worker, subtest_filter

LAUNCH_TIMEOUT_S = 300


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel(tmp_path, world_size):
    run_worker("worker_tp.py", world_size, args=subtest_filter(), timeout=LAUNCH_TIMEOUT_S,
               env={"CFSDP_CKPT_DIR": str(tmp_path)})


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_wrapper(tmp_path, world_size):
    """FullyShardedDataParallel(device_mesh=mesh["dp"]) on TP models against torch's FSDP1.  At 4
    ranks (the (2, 2) mesh) the subtests 4 ranks add: every parity case, resuming and DCP across
    both implementations, no_sync, the single-process oracle, sync_module_states, the errors
    ([Note: coverage at 4 ranks] in launcher.py)."""
    at_4 = "parity|resume|dcp|no_sync|single|sync_module|unsupported|hybrid|muon"
    run_worker("worker_tp_wrapper.py", world_size, timeout=LAUNCH_TIMEOUT_S,
               args=subtest_filter(world_size, at_4=at_4), env={"CFSDP_CKPT_DIR": str(tmp_path)})


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_spmd_meshes(tmp_path, world_size):
    """fully_shard with dp_mesh_dims (a full SPMD mesh) and with per-parameter meshes
    (ShardPlacementResult: a mixture of experts) against torch's FSDP2 (worker_spmd.py)."""
    run_worker("worker_spmd.py", world_size, args=subtest_filter(), timeout=LAUNCH_TIMEOUT_S,
               env={"CFSDP_CKPT_DIR": str(tmp_path)})


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [8])  # CFSDP_TEST_WORLD_SIZES=2 passes leave it out
def test_muon_hsdp_tp_at_8_ranks(tmp_path, world_size):
    """cfsdp.optim.Muon on HSDP x TP over a (2, 2, 2) mesh: the one case that needs 8 ranks
    (two replicates, each matrix cut over the (shard, tp) ranks of its replicate, each
    replicate's exchange on a process group of its own), worker_tp.py's ``fs_muon_hsdp_tp``,
    bitwise against torch's fully_shard with the all-gather Muon; the exchange through shared
    memory (every reduction of this layout has two terms, so gloo's sums agree); and
    ``muon_three_sharded_dims``: matrices cut over all three dims of the mesh."""
    run_worker("worker_tp.py", world_size, args=["--only", "fs_muon_hsdp_tp|muon_three_sharded"],
               timeout=LAUNCH_TIMEOUT_S,
               env={"CFSDP_CKPT_DIR": str(tmp_path), "CFSDP_SHM": "1"})


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 60)
def test_checkpoint_across_meshes(tmp_path):
    """DCP save at (2, 2) on 4 ranks, load at (1, 2) and (2, 1) on 2 ranks."""
    for ws, phase in ((4, "save"), (2, "load")):
        run_worker("worker_tp.py", ws, timeout=LAUNCH_TIMEOUT_S,
                   env={"CFSDP_CKPT_DIR": str(tmp_path), "CFSDP_TP_PHASE": phase})
