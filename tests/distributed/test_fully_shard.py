"""The composable face: cfsdp.fully_shard against torch's fully_shard (see worker_fully_shard.py).

One pytest item per registered subtest (every point of its grid) and world size, named
``test_fully_shard[W-feature-subtest]`` after the feature module ``fully_shard/<feature>.py``
that registers it, so ``-k bad_input`` or ``-k "2-checkpoint"`` picks some. Still ONE torchrun
launch per world size (spawning is the slow part): the module-scoped ``launches`` fixture runs
the worker once, at the first item of a world size, for the union of that world size's selected
items, and each item then reads its own subtests' lines in the harness summary (see
subtest_items.py, shared with test_strategies.py and test_zero.py).

Resharding runs three launches in sequence sharing the test's tmp_path (save at 2, load and save
at 4, load at 2). ``CFSDP_SUBTESTS=substr`` runs only the matching subtests of the selected items
(an item none of whose subtests match fails, saying so: add -k); ``CFSDP_FS_SELFTEST=1`` puts torch's
own fully_shard in cfsdp's seat (checks the test itself).
"""

import pytest

from launcher import run_reshard_chain
from subtest_items import Launch, SplitWorker

# one launch per world size runs every selected subtest (at 4 ranks on a slow 2-core machine:
# the whole set took 430 s, the AT_4 subset about 150 s)
LAUNCH_TIMEOUT_S = 600
# at 4 ranks: these subtests only (see [Note: coverage at 4 ranks] in launcher.py): the 2 x 2
# meshes (hsdp*, shard_dims_hsdp, one_rank_no_collectives' hsdp_shard1), uneven shards and
# ranks holding only padding (structure, training parity, Shard(d) parity and its DCP), the
# checkpoints at 4 ranks, and one representative of the rest (gradient accumulation, bf16
# mixed precision, the bad-input table, visible collectives, two extension kinds, Muon on HSDP
# and in small buckets),
# Muon's parity cases (experts_shard2: torch's fully_shard refuses Shard(2) of 6 over 4 ranks),
# the stream protocol with reshard_after_forward=2 (a post-forward group of 2), frozen parameters
# beside trainable ones in a unit (gloo's sums depend on the reduce-scatter's layout from 3
# ranks on: torch's, the trainable parameters only).
# ``parity[kind=...`` is spelled per kind: ``extension_parity[kind=...`` contains ``parity[kind=``.
AT_4 = ("structure|parity[kind=mlp|parity[kind=lm|parity[kind=frozen|hsdp|shard_dims_parity"
        "|shard_dims_checkpoint[how=dcp]|dcp_roundtrip|state_dict_load|grad_accum"
        "|mixed_precision_lm|bad_input|one_rank_no_collectives|collectives_visible"
        "|extension_parity[kind=bf16,reshard_after_forward=True,mp=None]"
        "|extension_parity[kind=rowscale,reshard_after_forward=False,mp=torch.bfloat16]"
        "|muon_hsdp|muon_parity[case=lm|muon_parity[case=mlp|muon_parity[case=experts_shard0"
        "|recorded_streams_post_forward_group|muon_buckets|features[feature=requires_grad_toggled")
WORKER = SplitWorker("worker_fully_shard.py", [Launch("2", 2), Launch("4", 4, only=AT_4)],
                     timeout=LAUNCH_TIMEOUT_S, tmp_env="CFSDP_CKPT_DIR")


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    return WORKER.launcher(request, tmp_path_factory)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size, launch, feature, name", WORKER.cases())
def test_fully_shard(launches, world_size, launch, feature, name):
    WORKER.check(launches(launch), launch, feature, name)


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("first_ws, second_ws", [(2, 4)])
def test_fully_shard_reshard(tmp_path, first_ws, second_ws):
    """W=2 saves, W=4 loads it (2 -> 4) and saves, W=2 loads that (4 -> 2)."""
    run_reshard_chain(WORKER.worker, "CFSDP_FS_PHASE", tmp_path, first_ws, second_ws, LAUNCH_TIMEOUT_S)
