"""cfsdp.checkpoint.save_full_state_dict / load_full_state_dict under torchrun (gloo, CPU).

Run by test_checkpoint.py at W=2. A run saved after two steps and resumed in a fresh model
(other initial weights) must give the next steps' losses bitwise equal to the uninterrupted
run; a checkpoint written from torch's FSDP1 loads into cfsdp and the reverse (the helpers
use only the torch-compatible API, so they drive torch's FSDP1 too). A failed write on rank 0
raises on every rank.
"""

from __future__ import annotations

import torch

import _harness as h
import ckpt_common as cc

from cfsdp.checkpoint import load_full_state_dict, save_full_state_dict


def _save_resume(ctx, writer: str, reader: str, uop: bool, with_optim: bool) -> None:
    path = cc.ckpt_dir(ctx, ctx.name) / "full.pt"
    data = cc.batches(4, ctx.world_size)
    model, opt = cc.make(ctx, writer, uop)
    cc.train(ctx, model, opt, data[:2])
    save_full_state_dict(model, path, opt if with_optim else None)
    if ctx.rank == 0:
        ck = torch.load(path, weights_only=True)
        want = list(cc.pc.build("transformer").state_dict().keys())
        if list(ck["model"].keys()) != want:
            raise AssertionError(f"keys {list(ck['model'])} != {want}")
        if (ck["optim"] is None) == with_optim:
            raise AssertionError(f"optim entry: {type(ck['optim'])}, with_optim={with_optim}")
    if not with_optim:  # a model-only checkpoint: resume with a fresh optimizer on both sides
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    want_losses = cc.train(ctx, model, opt, data[2:])
    fresh, fresh_opt = cc.make(ctx, reader, uop, seed=1)
    load_full_state_dict(fresh, path, fresh_opt if with_optim else None)
    got = cc.train(ctx, fresh, fresh_opt, data[2:])
    cc.assert_same_losses(got, want_losses, f"{writer} -> {reader} resume")


@h.subtest(grid={"use_orig_params": [False, True], "with_optim": [False, True]})
def full_roundtrip(ctx, use_orig_params: bool, with_optim: bool):
    _save_resume(ctx, "cfsdp", "cfsdp", use_orig_params, with_optim)


@h.subtest(grid={"direction": ["torch->cfsdp", "cfsdp->torch"], "with_optim": [False, True]})
def full_cross_load(ctx, direction: str, with_optim: bool):
    writer, reader = direction.split("->")
    _save_resume(ctx, writer, reader, True, with_optim)


@h.subtest
def write_failure_raises_everywhere(ctx):
    model, opt = cc.make(ctx, "cfsdp", False)
    bad = cc.ckpt_dir(ctx, ctx.name) / "no-such-dir" / "full.pt"
    try:
        save_full_state_dict(model, bad)
    except FileNotFoundError if ctx.rank == 0 else RuntimeError as e:
        if ctx.rank != 0 and "rank(s) [0]" not in str(e):
            raise AssertionError(f"message does not name rank 0: {e}") from e
    else:
        raise AssertionError("save_full_state_dict into a missing directory did not raise")
    try:  # and reading it back fails on every rank, with the same kind of error
        load_full_state_dict(model, bad)
    except FileNotFoundError:
        pass
    else:
        raise AssertionError("load_full_state_dict of a missing file did not raise")


if __name__ == "__main__":
    h.main()
