"""MixedPrecisionPolicy: bf16 parameters, reduce and output dtypes, cast inputs."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import _harness as h
from fs_common import Scenario, run_scenario
from fully_shard.common import BF16


# --------------------------------------------------------------------------------------------
# 3. mixed precision
# --------------------------------------------------------------------------------------------


def mp_scenario(kind: str, reduce_dtype, output_dtype, cast: bool, output_at_root_only: bool):
    unit = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype,
                                output_dtype=None if output_at_root_only else output_dtype,
                                cast_forward_inputs=cast)
    root = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype,
                                output_dtype=output_dtype, cast_forward_inputs=cast)
    return Scenario(kind=kind, optim="sgd", steps=3, unit_kw={"mp_policy": unit},
                    root_kw={"mp_policy": root}, mp=unit, root_mp=root)


@h.subtest(grid={"reduce_dtype": [torch.float32, BF16, None], "output_dtype": [None, torch.float32],
                 "cast_forward_inputs": [True, False]})
def mixed_precision_mlp(ctx, reduce_dtype, output_dtype, cast_forward_inputs: bool):
    run_scenario(ctx, mp_scenario("mlp", reduce_dtype, output_dtype, cast_forward_inputs, False))


@h.subtest(grid={"reduce_dtype": [torch.float32, BF16, None]})
def mixed_precision_lm(ctx, reduce_dtype):
    """The transformer's LayerNorms need bf16 inputs, so output_dtype=fp32 is on the root only."""
    run_scenario(ctx, mp_scenario("lm", reduce_dtype, torch.float32, True, True))
