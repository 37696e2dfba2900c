"""Gradient accumulation without communication (set_requires_gradient_sync and friends) under
every dtype policy, and the lifetimes of gradients between steps."""

from __future__ import annotations

import weakref

import torch
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp import MixedPrecisionPolicy

import _harness as h
import parity_common as pc
from fs_common import (
    CFSDP,
    Scenario,
    TORCH,
    batches,
    local,
    loss_fn,
    make_model,
    mesh_1d,
    reg_state,
    run_scenario,
)
from fully_shard.common import BF16


# --------------------------------------------------------------------------------------------
# 4. gradient accumulation without communication
# --------------------------------------------------------------------------------------------


@h.subtest(grid={"kind": ["mlp", "lm"]})
def grad_accum(ctx, kind: str):
    """3 micro-batches a step: ``set_requires_gradient_sync(False)`` for the first two, True for
    the last. After each no-sync backward the registered parameters and their ``.grad`` must be
    what torch shows (torch: sharded DTensors, ``.grad`` None: the accumulated unsharded
    gradient is internal); after the last, gradients and the next step's losses as torch and
    the reference (the sum over micro-batches of the rank-averaged gradients)."""

    def before(impl, model, s, m, notes):
        model.set_requires_gradient_sync(m == 2)

    def after(impl, model, s, m, notes):
        if m < 2:
            notes.append((f"after no-sync micro-batch {m} of step {s}", reg_state(model)))

    run_scenario(ctx, Scenario(kind=kind, steps=2, micro=3, before_micro=before, after_micro=after))


# Every dtype policy's accumulation: torch's FSDP2 keeps a no-sync gradient in
# ``unsharded_param.grad`` (param dtype; autograd adds the next backward's to it) unless
# ``reduce_dtype`` differs from the gradient's dtype: then it moves it to
# ``unsharded_accumulated_grad`` cast to ``reduce_dtype`` (fp32 from bf16, but bf16 from fp32
# when only ``reduce_dtype=bf16`` is given) and adds every later backward's gradient to that.
FP16 = torch.float16
ACCUM_POLICIES: dict[str, MixedPrecisionPolicy | None] = {
    "fp32": None,
    "bf16_reduce_fp32": MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32),
    "bf16_reduce_bf16": MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16),
    "bf16": MixedPrecisionPolicy(param_dtype=BF16),
    "fp16_reduce_fp32": MixedPrecisionPolicy(param_dtype=FP16, reduce_dtype=torch.float32),
    "fp16": MixedPrecisionPolicy(param_dtype=FP16),
    "fp32_reduce_bf16": MixedPrecisionPolicy(reduce_dtype=BF16),
    # a bf16 model (its shards, gradients and optimizer in bf16): the reduced fp32 gradient is
    # cast to bf16 before it is added to the sharded gradient
    "bf16_model_reduce_fp32": MixedPrecisionPolicy(reduce_dtype=torch.float32),
    "bf16_model": None,
}


def _accum_sync(path: str, last: int):
    """``before_micro`` for ``accumulation``'s paths: which units sync on micro-batch ``m``."""

    def before(impl, model, s, m, notes):
        sync = m == last
        if path == "all":  # every unit accumulates (recurse)
            model.set_requires_gradient_sync(sync)
        elif path == "all_keep_unsharded":  # and stays unsharded until the sync backward
            model.set_requires_gradient_sync(sync)
            model.set_reshard_after_backward(sync)
        elif path == "root":  # the root's unit only (the output head): torchtitan's chunked loss
            model.set_requires_gradient_sync(sync, recurse=False)
        elif path == "block":  # one inner unit; the others reduce every micro-batch
            model.blocks[1].set_requires_gradient_sync(sync, recurse=False)
        else:
            raise AssertionError(path)

    return before


def _accum_notes(impl, model, s, m, notes):
    notes.append((f"after backward {m} of step {s}", reg_state(model)))
    notes.append((f"gradient values after backward {m} of step {s}",
                  [None if p.grad is None else local(p.grad).detach().clone()
                   for p in model.parameters()]))


def accumulation(ctx, policy: str, path: str, reshard_after_forward: bool = True,
                 offload: bool = False):
    """3 micro-batches a step (2 steps), gradient sync off on ``path``'s units for the first two:
    losses, the gradients (and what is registered) after every backward, and the parameters
    bitwise as torch's, for every dtype policy.  Units that keep syncing accumulate their
    reduced gradients into the sharded gradient.  Without mixed precision also as the
    reference (the mixed-precision reference takes one micro-batch a step).  ``offload``:
    both with ``CPUOffloadPolicy(pin_memory=False)`` (torch runs it on a CPU mesh)."""
    pol = ACCUM_POLICIES[policy]
    kw: dict = {"reshard_after_forward": reshard_after_forward}
    if pol is not None:
        kw["mp_policy"] = pol
    if offload:
        kw["offload_policy"] = torch_fsdp.CPUOffloadPolicy(pin_memory=False)
    bf16_model = policy.startswith("bf16_model")
    run_scenario(ctx, Scenario(kind="mlp", optim="adamw", steps=2, micro=3, unit_kw=kw,
                               before_micro=_accum_sync(path, 2), after_micro=_accum_notes,
                               prepare=(lambda m: m.to(BF16)) if bf16_model else None,
                               ref=pol is None and not bf16_model))


h.subtest(grid={"policy": list(ACCUM_POLICIES), "path": ["all", "root", "block", "all_keep_unsharded"]},
          name="accumulation")(accumulation)
h.subtest(grid={"policy": ["fp32", "bf16_reduce_fp32", "fp32_reduce_bf16"], "path": ["all", "root"],
                "reshard_after_forward": [False]}, name="accumulation")(accumulation)
h.subtest(grid={"policy": ["fp32", "bf16_reduce_fp32"], "path": ["all", "root"], "offload": [True]},
          name="accumulation")(accumulation)


@h.subtest(grid={"policy": ["fp32", "bf16_reduce_fp32", "bf16"], "path": ["all", "all_keep_unsharded"]})
def accumulation_unit_unreached(ctx, policy: str, path: str):
    """3 micro-batches a step, sync off for the first two; the synchronising backward does
    not reach ``blocks[1]`` (the last micro-batch's forward skips it): torch's final callback
    runs ``post_backward`` for that unit too, reducing what the no-sync backwards
    accumulated, so its gradients are those of micro-batches 0 and 1 (cfsdp dropped them:
    ``.grad`` None, the block not stepped).  torch is the oracle (the reference model calls
    every block)."""
    pol = ACCUM_POLICIES[policy]
    kw: dict = {} if pol is None else {"mp_policy": pol}
    sync = _accum_sync(path, 2)

    def before(impl, model, s, m, notes):
        sync(impl, model, s, m, notes)
        model.order = (0,) if m == 2 else (0, 1)

    run_scenario(ctx, Scenario(kind="mlp", steps=2, micro=3, unit_kw=kw, before_micro=before,
                               after_micro=_accum_notes, ref=False))


@h.subtest(grid={"policy": ["fp32", "bf16_reduce_fp32", "bf16", "fp32_reduce_bf16"],
                 "path": ["all", "root", "block", "all_keep_unsharded"]})
def accumulation_trailing_no_sync(ctx, policy: str, path: str):
    """3 micro-batches a step (3 steps), sync on the middle one only: the last backward's
    gradient stays unreduced past ``opt.step()`` and ``zero_grad()`` and joins the next step's
    synchronising backward, which adds its reduction to the sharded gradient the parameters
    hold then (None after ``zero_grad()``), as torch's.  cfsdp added it to the gradient of the
    step before (the buffer the trailing backward took and kept): other training.  torch is
    the oracle (the reference has no carried gradient)."""
    pol = ACCUM_POLICIES[policy]
    kw: dict = {} if pol is None else {"mp_policy": pol}
    run_scenario(ctx, Scenario(kind="mlp", optim="adamw", steps=3, micro=3, unit_kw=kw,
                               before_micro=_accum_sync(path, 1), after_micro=_accum_notes,
                               ref=False))


def accumulation_keep_unsharded_user_grads(ctx, policy: str, what: str, kind: str = "mlp"):
    """3 micro-batches a step, sync on the last, the units left unsharded until then: the
    no-sync gradient shows on the registered full-size parameters, where torch keeps it, and
    after the first backward the user clears (``model.zero_grad()``), replaces or zeroes in
    place those ``.grad``: torch's next backward adds to what they hold then.  cfsdp kept
    adding to its own copy (a cleared or replaced gradient still counted).

    With ``reduce_dtype`` differing from the gradient's dtype torch 2.11-2.14 accumulate off
    the parameters (``unsharded_accumulated_grad``): nothing is shown, a clear changes
    nothing, but a ``.grad`` the user assigns there is the unsharded parameter's gradient,
    which the next backward adds its own to (in the compute dtype) and post-backward then adds
    to the accumulation; cfsdp ignored it.  ``assign_some`` assigns every other parameter's
    only (the others keep what they show, or nothing); ``assign_skip``: the next (no-sync)
    micro-batch does not call ``blocks[1]``, whose assigned gradients torch's final callback
    folds in then; ``assign_skip_sync``: assigned after the second backward, and the
    synchronising one does not call ``blocks[1]`` (its final callback reduces them).  The
    units reshard after forward, the root does not: the assignment is followed both ways.
    ``mlp_unused``: parameters forward never uses (no gradient shown, none to add to) get one
    assigned, which torch reduces.  torch is the oracle."""
    pol = ACCUM_POLICIES[policy]
    kw: dict = {} if pol is None else {"mp_policy": pol}
    sync = _accum_sync("all_keep_unsharded", 2)
    acts_after = 1 if what == "assign_skip_sync" else 0
    skips = {"assign_skip": 1, "assign_skip_sync": 2}.get(what)

    def before(impl, model, s, m, notes):
        sync(impl, model, s, m, notes)
        model.order = (0,) if m == skips else (0, 1)

    def after(impl, model, s, m, notes):
        _accum_notes(impl, model, s, m, notes)
        if m != acts_after:
            return
        if what == "zero_grad":
            model.zero_grad()
        elif what == "zero_in_place":
            model.zero_grad(set_to_none=False)
        else:  # assign, in the dtype the parameter's gradient has (torch 2.15: its grad_dtype)
            for i, p in enumerate(model.parameters()):
                dtype = getattr(p, "grad_dtype", None) or p.dtype
                if what == "assign":
                    p.grad = torch.full_like(p, 0.01, dtype=dtype)
                elif i % 2 == 0:  # values that differ by element, parameter and step
                    p.grad = (p.detach() * (0.5 + s)).to(dtype)

    run_scenario(ctx, Scenario(kind=kind, steps=2, micro=3, unit_kw=kw, before_micro=before,
                               after_micro=after, ref=False))


h.subtest(grid={"policy": ["fp32", "bf16", "fp32_reduce_bf16", "bf16_reduce_fp32"],
                "what": ["zero_grad", "zero_in_place", "assign"]},
          name="accumulation_keep_unsharded_user_grads")(accumulation_keep_unsharded_user_grads)
h.subtest(grid={"policy": ["fp32", "bf16", "fp32_reduce_bf16", "bf16_reduce_fp32"],
                "what": ["assign_some", "assign_skip", "assign_skip_sync"]},
          name="accumulation_keep_unsharded_user_grads")(accumulation_keep_unsharded_user_grads)
# (every parameter: torch's reduce-scatter packs only the parameters with a gradient, so one left
# without while a later one has one changes its layout, hence gloo's order of summation at 4
# ranks; a difference of cfsdp's outside this test, which packs every parameter)
h.subtest(grid={"policy": ["fp32", "bf16", "fp32_reduce_bf16", "bf16_reduce_fp32"],
                "what": ["assign"], "kind": ["mlp_unused"]},
          name="accumulation_keep_unsharded_user_grads")(accumulation_keep_unsharded_user_grads)


@h.subtest
def accumulation_keep_unsharded_frozen_grad(ctx):
    """A ``.grad`` assigned to a frozen parameter's unsharded parameter (the units left
    unsharded, no sync), then a synchronising backward: torch reduces it into the sharded
    parameter's ``.grad``; cfsdp publishes no gradient for a frozen parameter, so it refuses
    it: NotImplementedError naming the parameter, not a dropped gradient."""
    mm = pc.Mismatches(ctx)
    data = batches("mlp", 1, ctx.world_size, 2)
    for impl in (TORCH, CFSDP):
        model = make_model(impl, Scenario(kind="frozen"), mesh_1d(ctx))
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        x, y = data[0][0][ctx.rank]
        loss_fn("mlp", model(x), y).backward()
        model.in_proj.weight.grad = torch.ones_like(model.in_proj.weight)
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)  # (the sharded parameters registered after it)
        x, y = data[0][1][ctx.rank]
        try:
            loss_fn("mlp", model(x), y).backward()
            err = None
        except Exception as e:  # noqa: BLE001 (the check says what came)
            err = e
        if impl is TORCH:
            mm.check(err is None and model.in_proj.weight.grad is not None,
                     f"torch: {type(err).__name__}: {err}, grad {model.in_proj.weight.grad}: "
                     "expected the assigned gradient reduced")
        else:
            mm.check(isinstance(err, NotImplementedError) and "'in_proj.weight'" in str(err)
                     and "does not require grad" in str(err),
                     f"{type(err).__name__}: {err}, expected NotImplementedError naming "
                     "'in_proj.weight'")
    mm.raise_if_any()


def _grad_step(s: int, params: list, opt) -> list | None:
    """What the user does with the gradients before step ``s`` of ``grad_lifetimes``; returns
    the gradients the user keeps (step 2)."""
    if s == 1:
        opt.zero_grad(set_to_none=False)  # zeroed in place: the same tensors accumulate
    elif s == 2:
        kept = [p.grad for p in params]
        opt.zero_grad(set_to_none=True)
        return kept
    elif s == 3:
        params[0].grad = None  # one cleared, the others accumulate
    elif s != 4:  # step 4: no zero_grad, everything accumulates
        opt.zero_grad(set_to_none=True)
    return None


@h.subtest
def grad_lifetimes(ctx):
    """Sharded gradients across steps as users handle them: zeroed in place, kept by the user
    and cleared, cleared for one parameter, accumulated, cleared: losses and gradients bit for
    bit as torch's.  Ownership follows [Note: gradient ownership]: gradients the user kept keep
    their values; after a plain ``zero_grad()`` the unit forgets the old gradients by the next
    forward (their memory goes with the last reference) and the next backward's are new."""
    mesh = mesh_1d(ctx)
    mm = pc.Mismatches(ctx)
    data = batches("mlp", 6, ctx.world_size)
    runs = {}
    for impl in (TORCH, CFSDP):
        model = make_model(impl, Scenario(kind="mlp"), mesh)
        opt = pc.make_optim("sgd", model.parameters())
        names, params = zip(*model.named_parameters())
        rec, kept, kept_vals = [], None, None
        for s, step_data in enumerate(data):
            k = _grad_step(s, list(params), opt)
            if k is not None:
                kept, kept_vals = k, [local(g).clone() for g in k]
            x, y = step_data[0][ctx.rank]
            loss = loss_fn("mlp", model(x), y)
            loss.backward()
            rec.append((loss.detach().clone(), [local(p.grad).clone() for p in params]))
            opt.step()
        for n, g, v in zip(names, kept, kept_vals):
            mm.tensors(f"{impl.name}: gradient of {n} the user kept at step 2", local(g), v)
        if impl is CFSDP:
            refs = [weakref.ref(p.grad) for p in params]
            opt.zero_grad()
            x, y = data[0][0][ctx.rank]
            out = model(x)
            alive = [r() is not None for r in refs]
            mm.check(not any(alive), f"gradients kept alive by the forward after zero_grad(): {alive}")
            loss_fn("mlp", out, y).backward()
            mm.check(all(p.grad is not None for p in params), "no gradients after the backward")
        runs[impl.name] = rec
    for s, ((lc, gc), (lt, gt)) in enumerate(zip(runs["cfsdp"], runs["torch"])):
        mm.tensors(f"loss at step {s}", lc, lt)
        for n, a, b in zip(names, gc, gt):
            mm.tensors(f"gradient of {n} at step {s}", a, b)
    mm.raise_if_any()
