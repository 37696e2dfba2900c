"""The composable face: ``cfsdp.fully_shard`` against torch's own ``fully_shard`` (FSDP2).

Run by tests/distributed/test_fully_shard.py under torchrun (gloo, CPU) at W=2 and W=4. This
script is a thin runner: the subtests live in the feature modules of ``fully_shard/`` (listed
in ``FEATURES`` below, in the order they run; what they share is in ``fully_shard/common.py``
and ``fs_common.py``), and one spawn runs those of every module (see _harness.py;
``--modules fully_shard.X,...`` and ``--subtests NAME,...`` pick some). The HSDP subtests
(2-D mesh, replicate 2 x shard 2) are registered at W=4 only.

Three contenders, built from the same seed and trained on the same data:

* ``torch``: torch.distributed.fsdp.fully_shard, the oracle;
* ``cfsdp``: cfsdp.fully_shard with the same arguments (``CFSDP_FS_SELFTEST=1`` makes this one
  torch's own fully_shard/FSDPModule too: every subtest must then pass, which checks the
  comparisons and tolerances themselves, see "Self-test" below);
* ``ref``:   the unwrapped model in one process (every rank computes it) on all ranks' chunks.

Both sharded contenders run on a DeviceMesh built from the subtest's own gloo group
(``DeviceMesh.from_group(ctx.pg, "cpu")``; HSDP: from fresh shard/replicate groups), so a
subtest that dies half-way through a collective cannot desynchronise the next one. fully_shard
is applied the torch way: each block first, then the root.

Models (tiny, with sizes that W does not divide, so chunks are padded and at W=4 some ranks
hold empty shards: ``in_proj.weight`` (9, 7), the blocks' (9, 9) and ``out.weight`` (3, 9)
give rank 3 nothing, ``scale`` (1,) leaves ranks 1-3 empty):

* ``mlp``: a buffer, an input projection, two residual blocks (units), an output projection and
  a 1-element scale on the root; ``mlp_twice`` calls block 1 twice in a row in one forward,
  ``mlp_apart`` calls block 0 again after block 1 (torch reduces each unit once, after its
  last use in backward, in both cases);
* ``lm``: a tiny transformer (two of worker_parity's Blocks) with a token embedding tied to the
  output head (one parameter, two state-dict keys) and a (6, 12) position parameter; ``lm1``
  has one Block (the checkpoint subtests: DSD gathers tensor by tensor, which is the slow part);
* ``frozen``: the mlp with block 0 frozen (a unit without gradients) and ``in_proj.weight``
  frozen (frozen and trainable parameters in the root unit);
* ``mlp_branch``: the mlp with a branch layer in the root's unit and in block 1's, used only
  in the steps, micro-batches and ranks a scenario says, and block 1 left out of some
  forwards (parameters without gradients: ``unused_*`` and ``reduce_scatter_unused_params*``
  in fully_shard/features.py).

What is compared, and with which tolerance:

* cfsdp vs torch: **bitwise** (``torch.equal``, same dtype and shape) for every loss, every
  local gradient shard (``to_local()``) after the last backward, every local parameter shard
  after the last step, the type/placement/shape of every registered parameter and gradient at
  the points where a feature changes them, forward outputs, state dicts (keys in order, types,
  placements, local values; full tensors for full state dicts). Both run the same fp32 (or
  bf16) ops on the same values: the same dim-0 chunks (``torch.chunk`` sizes, padded), the same
  all-gathered parameters, the same local forward/backward, the same gloo reduction. torch 2.13
  reduce-scatters fp32 and bf16 gradients with ``ReduceOp.AVG`` (``_get_gradient_divide_factors``
  in torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py; gloo supports AVG there); a sum
  by the same gloo collective followed by a division by W is bitwise the same, since W = 2 and
  4 are powers of two (the division is exact). Any difference is a real divergence.
* torch vs ref, fp32: ``rtol=1e-5, atol=1e-6`` elementwise (worker_parity's REF_RTOL/REF_ATOL,
  same reasoning): the same maths, but FSDP averages the per-rank gradients through gloo's
  reduction order while the reference accumulates ``g_r / W`` through autograd, a few ulps per
  step; over 3 steps of SGD-momentum/AdamW the drift stays far below 1e-5 relative (the worst
  ratio is logged: <= 0.05 of the tolerance at W=2 and 4). This check is what makes the oracle
  trustworthy: on torch 2.13 with gloo, FSDP2 *averages* fp32 and bf16 gradients (pytorch
  issue 162338 reported a sum), so torch itself is the oracle, without force-sum; a summing
  implementation is off by a factor W, which fails here by a factor ~6e4 (checked by mutating
  the oracle).
* torch vs ref under bf16 mixed precision (``MP_TOL``, 2**-5, relative to each tensor's
  largest magnitude): the reference emulates FSDP2's policy exactly (a bf16 copy of the fp32
  parameters, the same input/output casts at the same module boundaries as forward hooks,
  per-rank bf16 gradients, the average taken in ``reduce_dtype or param_dtype``), so the only
  difference is the reduction's summation order and rounding in bf16 (a few bf16 half-ulps,
  2**-9 each) and what that does to the next steps' bf16 parameters. At W=2 the emulation is
  bitwise (a sum of two terms has one rounding); at W=4 the worst case uses 0.48 of the
  tolerance (bf16 reductions). A summing implementation (a factor W) fails by a factor ~25
  (checked by mutating the oracle). cfsdp vs torch stays bitwise (same bf16 ops, same gloo
  reduction in the same dtype).

Deliberate oracle adjustments (torch cannot do it on gloo, or torch is not the spec):

* ``set_gradient_divide_factor(k)``: with k != W torch uses ``ReduceOp.PREMUL_SUM(1/k)``, which
  gloo rejects ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). The torch oracle adds
  ``set_force_sum_reduction_for_comms(True)`` (sum, then divide by k); cfsdp is called with the
  factor only (in the self-test the torch stand-in needs force-sum too). k is 1 or 2W, powers of
  two, so pre-multiplying by 1/k and dividing the sum by k give the same bits. The reference
  checks the scale: gradients are ``W / k`` times the mean.
* ``bad_input``: where torch rejects the input on purpose, cfsdp must raise an instance of
  torch's exception type whose message contains torch's verbatim (cfsdp adds ``(cfsdp: ...)``),
  and name by FQN what torch names by local name (a scalar parameter: torch names ``gain``,
  cfsdp must also say ``sub.gain``). Where torch does not check
  (an FSDP1-wrapped module: torch shards the flat parameter again and trains on garbage, or
  fails at the first forward; an ``mp_policy`` that is not a MixedPrecisionPolicy: accepted,
  then an AttributeError or a dtype mismatch at the first forward; a ProcessGroup as ``mesh``:
  an accidental AttributeError), cfsdp must raise a ValueError or TypeError at once, naming
  the argument or module. The self-test can only check that torch still behaves as recorded.
* a no_grad eval forward between steps: torch 2.13 leaves the root's unsharded parameters
  registered after it (the root's reshard_after_forward defaults to False); cfsdp must not
  leak them (every parameter a sharded DTensor again). Outputs are compared bitwise.
* state dicts: what is "saved" is a clone of every tensor (``clone_tree``): state dicts hold
  live tensors (AdamW's ``step`` too) that the writer's next steps update in place.
  ``copy.deepcopy(model.state_dict())`` is checked separately (``structure``).
* Parameters on the ``meta`` device with a CPU mesh are not an error in torch (deferred
  initialisation); that is tested as the ``meta_init`` feature. The device-type mismatch case
  is a "cuda" mesh on this machine without a GPU (a CPU or a CUDA build of torch).

Self-test: ``CFSDP_FS_SELFTEST=1`` runs every subtest with torch in both seats, so the bitwise
comparisons, the reference tolerances and the state-dict/DCP round trips are checked to pass on
a correct implementation.

``CFSDP_FS_PHASE=reshard_save``, ``reshard_load`` or both in the order given (comma-separated; with
``CFSDP_CKPT_DIR``) replaces the subtests by DCP resharding phases (``fully_shard/reshard.py``): a
launch at W=a trains, saves
(torch and cfsdp) with ``torch.distributed.checkpoint`` and records the next losses; a launch at
W=b loads both into cfsdp and must reproduce them (``RESHARD_RTOL``: the two world sizes sum in
different orders). Each world size saves into its own folder; a load takes the one folder of
another world size (so ``reshard_load,reshard_save`` at W=b loads W=a's, then saves its own).
"""

import os

import _harness as h

# the feature modules (fully_shard/<name>.py), in the order their subtests run
FEATURES = ("parity", "mixed_precision", "accumulation", "features", "checkpoint", "hsdp",
            "bad_input", "shard_dims", "view_outputs", "extensions", "muon")
MODULES = tuple(f"fully_shard.{f}" for f in FEATURES)
RESHARD = "fully_shard.reshard"  # registers the phases of CFSDP_FS_PHASE, nothing without it


if __name__ == "__main__":
    h.main(modules=(RESHARD,) if os.environ.get("CFSDP_FS_PHASE") else MODULES)
