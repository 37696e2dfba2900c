"""HSDP on a 2 x 2 mesh (replicate 2, shard 2); registered at W=4 only."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

import _harness as h
import parity_common as pc
from fs_common import Scenario, mesh_2d, reg_state, run_scenario
from fully_shard.common import BF16, WORLD
from fully_shard.parity import check_structure
from fully_shard.mixed_precision import mp_scenario
from fully_shard.accumulation import ACCUM_POLICIES, _accum_notes


# --------------------------------------------------------------------------------------------
# 7. HSDP
# --------------------------------------------------------------------------------------------

if WORLD == 4:

    @h.subtest(grid={"kind": ["mlp", "lm"]})
    def hsdp(ctx, kind: str):
        """2-D mesh (replicate 2, shard 2): placements (Replicate(), Shard(0)), the shard of the
        rank's shard coordinate; training bitwise as torch, and as the reference (gradients
        averaged over all 4 ranks: reduce-scatter in the shard group, all-reduce across)."""
        mesh = mesh_2d(ctx)
        mm = pc.Mismatches(ctx)
        check_structure(ctx, mm, kind, mesh, (Replicate(), Shard(0)))
        run_scenario(ctx, Scenario(kind=kind), mesh, mm)

    @h.subtest(grid={"reduce_dtype": [torch.float32, BF16]})
    def hsdp_mixed_precision(ctx, reduce_dtype):
        """HSDP 2 x 2 with bf16 parameters: bitwise as torch, and as the reference."""
        run_scenario(ctx, mp_scenario("mlp", reduce_dtype, None, True, False), mesh_2d(ctx))

    @h.subtest(grid={"kind": ["mlp", "lm"]})
    def hsdp_requires_all_reduce(ctx, kind: str):
        """HSDP 2 x 2, 3 micro-batches a step: ``set_requires_all_reduce(False)`` for the
        first two (each backward reduce-scatters and sums its shard aside; the gradients stay
        as they are: torch shows none), True for the last (the sum joins its all-reduce).
        Bitwise as torch, and as the reference (the sum over micro-batches of the gradients
        averaged over all 4 ranks)."""

        def before(impl, model, s, m, notes):
            model.set_requires_all_reduce(m == 2)

        def after(impl, model, s, m, notes):
            if m < 2:
                notes.append((f"after micro-batch {m} of step {s} without all-reduce", reg_state(model)))

        run_scenario(ctx, Scenario(kind=kind, steps=2, micro=3, before_micro=before, after_micro=after),
                     mesh_2d(ctx))

    def _hsdp_accum(path: str):
        def before(impl, model, s, m, notes):
            if path == "no_all_reduce":
                model.set_requires_all_reduce(m == 2)
            elif path == "no_sync":
                model.set_requires_gradient_sync(m == 2)
            elif path == "mixed":
                # torch's set_requires_gradient_sync sets all_reduce_grads too: the True of the
                # last micro-batch all-reduces again (the first one's shard and the others)
                if m == 0:
                    model.set_requires_all_reduce(False)
                else:
                    model.set_requires_gradient_sync(m == 2)
            elif path == "root_no_all_reduce":
                model.set_requires_all_reduce(m == 2, recurse=False)
            else:
                raise AssertionError(path)
        return before

    @h.subtest(grid={"policy": ["fp32", "bf16_reduce_fp32", "bf16_reduce_bf16", "fp32_reduce_bf16"],
                     "path": ["no_all_reduce", "no_sync", "mixed", "root_no_all_reduce"]})
    def hsdp_accumulation(ctx, policy: str, path: str):
        """HSDP 2 x 2, 3 micro-batches a step, every dtype policy: the reduce-scatter-only
        accumulation (``set_requires_all_reduce(False)``: the reduced shard summed aside in
        ``reduce_dtype``), the no-sync one, and the two mixed (``set_requires_gradient_sync``
        sets torch's ``all_reduce_grads`` as well); bitwise as torch after every backward."""
        pol = ACCUM_POLICIES[policy]
        run_scenario(ctx, Scenario(kind="mlp", steps=2, micro=3,
                                   unit_kw={} if pol is None else {"mp_policy": pol},
                                   before_micro=_hsdp_accum(path), after_micro=_accum_notes,
                                   ref=pol is None), mesh_2d(ctx))
