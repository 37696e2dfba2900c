"""shard_placement_fn: Shard(dim) for any valid dim (structure, parity, features, checkpoints,
HSDP)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import _harness as h
import parity_common as pc
from fs_common import (
    CFSDP,
    SELFTEST,
    Scenario,
    TORCH,
    batches,
    build,
    compare_ref,
    compare_traces,
    local,
    mesh_1d,
    mesh_2d,
    run_scenario,
    shard,
    train,
    train_ref,
)
from fully_shard.common import BF16, WORLD, raised, largest_dim
from fully_shard.parity import check_structure
from fully_shard.mixed_precision import mp_scenario
from fully_shard.features import (
    _explicit_unshard,
    _materialise_as,
    _meta_build,
    _no_reshard_after_backward,
)
from fully_shard.checkpoint import DSD_OPTIONS, dcp_roundtrip, dsd, state_dict_load


# --------------------------------------------------------------------------------------------
# 9. shard_placement_fn: Shard(dim) for any valid dim
# --------------------------------------------------------------------------------------------
# The transformer (``lm``) sharded as torch's test_init_1d_transformer_shard_largest_dim and
# ..._shard_dim_neg1 shard theirs: every dim > 0 that gets picked (12, 48) is a multiple of W
# (and of the HSDP shard size 2). ``largest_dim`` mixes Shard(0) (the embedding (19, 12), the
# blocks' qkv (36, 12) and mlp.0 (48, 12), every 1-D parameter) and Shard(1) (``pos`` (6, 12),
# the blocks' mlp.2 (12, 48)) inside one unit; ``dim_neg1`` is Shard(1) for every 2-D parameter
# and Shard(0) for the 1-D ones (-1 + 1). Everything is compared as in sections 1, 2 and 6:
# bitwise against torch (losses, local shards and gradients, placements, state dicts), and
# torch against the single process on torch.chunk(full, W, dim)[rank].


PLACEMENT_FNS: dict[str, Callable[[nn.Parameter], Shard]] = {
    "largest_dim": largest_dim,
    "dim_neg1": lambda p: Shard(-1),
}


def expected_placements(fn: Callable[[nn.Parameter], Shard], hsdp: bool) -> Callable[[nn.Parameter], tuple]:
    """The placements fully_shard gives a parameter: fn's dim made non-negative."""
    rep = (Replicate(),) if hsdp else ()
    return lambda p: (*rep, Shard(fn(p).dim % p.dim()))


def _check_mixed_dims(mm: pc.Mismatches, fn_name: str, model: nn.Module) -> None:
    """Every unit (each block, and the root's: the rest) holds Shard(0) and Shard(1) parameters
    side by side."""
    blocks = [list(b.parameters()) for b in model.fsdp_units()]
    in_blocks = {id(p) for ps in blocks for p in ps}
    for ps in [*blocks, [p for p in model.parameters() if id(p) not in in_blocks]]:
        dims = {p.placements[-1].dim for p in ps if isinstance(p, DTensor)}
        mm.check(dims == {0, 1}, f"{fn_name}: a unit holds Shard dims {dims}, expected both 0 and 1")


@h.subtest(grid={"fn": list(PLACEMENT_FNS)})
def shard_dims_structure(ctx, fn: str):
    """Placements Shard(d) with d made non-negative, local shards torch.chunk(full, W, d)[rank]
    (torch's and the original's), state dicts as torch's; the transformer's units mix dims."""
    mm = pc.Mismatches(ctx)
    kw = {"shard_placement_fn": PLACEMENT_FNS[fn]}
    check_structure(ctx, mm, "lm", mesh_1d(ctx), expected_placements(PLACEMENT_FNS[fn], False), kw)
    _check_mixed_dims(mm, fn, shard(CFSDP, build("lm"), mesh_1d(ctx), kw))
    mm.raise_if_any()


@h.subtest(grid={"fn": list(PLACEMENT_FNS), "reshard_after_forward": [True, False]})
def shard_dims_parity(ctx, fn: str, reshard_after_forward: bool):
    """Training with Shard(d) parameters: bitwise as torch (losses, local gradients after the
    last backward, local parameters after the last step), torch as the single process."""
    run_scenario(ctx, Scenario(kind="lm", unit_kw={"shard_placement_fn": PLACEMENT_FNS[fn],
                                                   "reshard_after_forward": reshard_after_forward}))


def _with_largest_dim(sc: Scenario) -> Scenario:
    sc.unit_kw = {**sc.unit_kw, "shard_placement_fn": largest_dim}
    return sc


SHARD_DIM_FEATURES: dict[str, Callable[[], Scenario]] = {
    "mixed_precision": lambda: mp_scenario("lm", BF16, torch.float32, True, True),
    "reshard_after_backward_false": lambda: Scenario(  # full-size unsharded gradients shown
        kind="lm", steps=2, micro=2, before_micro=_no_reshard_after_backward,
        after_micro=lambda impl, model, s, m, notes: notes.append(
            (f"gradients after backward {m} of step {s}",
             [None if p.grad is None else local(p.grad).detach().clone() for p in model.parameters()]))),
    "unshard_reshard": lambda: Scenario(kind="lm", steps=2, before_micro=_explicit_unshard(True)[0],
                                        after_micro=_explicit_unshard(True)[1]),
    "meta_init": lambda: Scenario(kind="lm", build=_meta_build, configure=_materialise_as("lm")),
    "sgd": lambda: Scenario(kind="lm", optim="sgd"),
}


@h.subtest(grid={"feature": list(SHARD_DIM_FEATURES)})
def shard_dims_features(ctx, feature: str):
    """Features whose paths touch the layout (mixed precision casts, unsharded gradients, explicit
    unshard, meta-device materialisation, the post-forward shard) with ``largest_dim``."""
    run_scenario(ctx, _with_largest_dim(SHARD_DIM_FEATURES[feature]()))


CHECKPOINTS: dict[str, Callable] = {
    "state_dict": lambda ctx, kw: state_dict_load(ctx, "lm1", kw),
    **{f"dsd_{o}": (lambda o: lambda ctx, kw: dsd(ctx, o, kw))(o) for o in DSD_OPTIONS},
    "dcp": lambda ctx, kw: dcp_roundtrip(ctx, kw),
}


@h.subtest(grid={"how": list(CHECKPOINTS)})
def shard_dims_checkpoint(ctx, how: str):
    """Section 6's round trips with ``largest_dim``: saved by torch or cfsdp, loaded by the other
    or itself, the resumed steps equal the uninterrupted run's bitwise (and the DSD state dicts,
    their Shard(d) DTensors or full tensors, torch's)."""
    CHECKPOINTS[how](ctx, {"shard_placement_fn": largest_dim})


if WORLD == 4:

    @h.subtest
    def shard_dims_reshard_after_forward_int(ctx):
        """reshard_after_forward=2 with Shard(d) (forward keeps 2 of the 4 ranks' shards, packed
        by chunk_pack; backward gathers them over 2 ranks). torch 2.13 fails in that backward
        (foreach_all_gather_copy_out indexes dim d of the flat post-forward shard: IndexError),
        so the oracles are cfsdp with reshard_after_forward=True, checked against torch in
        shard_dims_parity (a gather moves the same bits either way: bitwise the same training),
        and the single process."""
        if SELFTEST:
            return  # torch cannot run it in either seat
        mesh, mm = mesh_1d(ctx), pc.Mismatches(ctx)
        kw = {"shard_placement_fn": largest_dim}
        sc = Scenario(kind="lm", unit_kw={**kw, "reshard_after_forward": 2})
        data = batches("lm", sc.steps, ctx.world_size)
        t_err = raised(lambda: train(TORCH, ctx, mesh, sc, data))
        mm.check(isinstance(t_err, IndexError),
                 f"torch 2.13 now runs reshard_after_forward=2 with Shard(d) ({t_err!r}): make it the oracle")
        got = train(CFSDP, ctx, mesh, sc, data)
        compare_traces(mm, got, train(CFSDP, ctx, mesh, Scenario(kind="lm", unit_kw=kw), data))
        compare_ref(mm, got, train_ref(sc, data, ctx.world_size), ctx, mesh)
        mm.raise_if_any()

    @h.subtest(grid={"fn": list(PLACEMENT_FNS)})
    def shard_dims_hsdp(ctx, fn: str):
        """HSDP 2 x 2 with Shard(d): placements (Replicate(), Shard(d)), training bitwise as torch
        and as the reference."""
        mesh = mesh_2d(ctx)
        mm = pc.Mismatches(ctx)
        kw = {"shard_placement_fn": PLACEMENT_FNS[fn]}
        check_structure(ctx, mm, "lm", mesh, expected_placements(PLACEMENT_FNS[fn], True), kw)
        run_scenario(ctx, Scenario(kind="lm", unit_kw=kw), mesh, mm)
