"""Consolidated state dicts: loaded across torch's and cfsdp's ZeRO, at half the world size, and
consolidation's misuse."""

from __future__ import annotations

import copy

import torch.distributed as dist

import _harness as h
from zero.common import bcast, raises, same, same_error, Trio


@h.subtest(grid={"bucket_view": [False, True]})
def cross_load_with_torch(ctx, bucket_view):
    """Consolidated dicts saved after 2 steps, loaded after 4 (rewinding the optimizer
    state): torch's ZeRO loads cfsdp's dict, cfsdp's loads torch's, plain loads cfsdp's;
    the three then train on equal.  Loading sets the other ranks' entries to None, as
    torch's does."""
    t = Trio(ctx.pg, "cfsdp_adamw", bucket_view)
    t.train(2)
    saved, kept = {}, None
    for n in ("torch", "cfsdp"):
        t.opts[n].consolidate_state_dict(0)
        sd = t.opts[n].state_dict() if t.rank == 0 else None
        if n == "cfsdp":
            kept = sd
        # deepcopy: torch's dict holds the target's live state tensors (the next steps
        # change them); cfsdp's is a snapshot (checked below)
        saved[n] = bcast(copy.deepcopy(sd), ctx.pg)
    same("saved dicts", saved["cfsdp"], saved["torch"])
    t.train(2)
    if t.rank == 0:
        same("cfsdp's consolidated dict after 2 more steps", kept, saved["cfsdp"])
    given = {"torch": copy.deepcopy(saved["cfsdp"]), "cfsdp": copy.deepcopy(saved["torch"])}
    for n, d in given.items():
        t.opts[n].load_state_dict(d)
    t.opts["plain"].load_state_dict(copy.deepcopy(saved["cfsdp"]))
    nones = {n: sorted(i for i, v in d["state"].items() if v is None) for n, d in given.items()}
    assert nones["cfsdp"] == nones["torch"] and len(nones["cfsdp"]) > 0, nones
    t.train(3)
    t.check_same()
    t.check_state_dicts()


@h.subtest(grid={"bucket_view": [False, True]})
def load_at_half_world(ctx, bucket_view):
    """A dict consolidated at world W, loaded at world W // 2 (a group of the first
    ranks; at W = 2 a group of one): the loaded ZeRO re-consolidates to the same dict
    and trains on equal to plain DDP + AdamW that loaded it."""
    W = ctx.world_size
    t = Trio(ctx.pg, "cfsdp_adamw", bucket_view, torch_zero=False)
    t.train(3)
    t.opts["cfsdp"].consolidate_state_dict(0)
    saved = bcast(t.opts["cfsdp"].state_dict() if ctx.rank == 0 else None, ctx.pg)
    half = dist.new_group(list(range(max(1, W // 2))), backend="gloo", timeout=h.PG_TIMEOUT)
    if ctx.rank >= max(1, W // 2):
        return
    small = Trio(half, "cfsdp_adamw", bucket_view, torch_zero=False)
    for n in small.names:  # the same parameters as the trained model
        small.models[n].module.load_state_dict(t.models["cfsdp"].module.state_dict())
        small.opts[n].load_state_dict(copy.deepcopy(saved))
    small.opts["cfsdp"].consolidate_state_dict(0)
    if dist.get_rank(half) == 0:
        same("reconsolidated at half world", small.opts["cfsdp"].state_dict(), saved)
    small.step_no = 3
    small.train(3)
    small.check_same()


@h.subtest
def consolidation_misuse(ctx):
    """state_dict() before any consolidation, on a rank that was not the target, and
    after a ``to`` that is not a rank of the group: torch's RuntimeError and message."""
    W = ctx.world_size
    t = Trio(ctx.pg, "adam", False)
    t.train(1)
    tz, cz = t.opts["torch"], t.opts["cfsdp"]
    same_error(raises(cz.state_dict), raises(tz.state_dict))
    for o in (tz, cz):
        o.consolidate_state_dict(to=W)  # no error (torch moves everything to nobody)
    ours, theirs = raises(cz.state_dict), raises(tz.state_dict)
    same_error(ours, theirs)
    assert f"to={W}, which is not a rank" in str(ours), ours
    t.check_state_dicts()  # non-targets raise as torch's
