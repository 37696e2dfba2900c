"""Features of FSDPModule (prefetching, explicit unshard, hooks, divide factors, meta init,
compile, ...), each run as a Scenario against torch and the single process."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import distribute_tensor

import _harness as h
import parity_common as pc
from fs_common import (
    CFSDP,
    Impl,
    InjectedFailure,
    ROWS,
    SELFTEST,
    STEPS,
    Scenario,
    TORCH,
    build,
    local,
    mesh_1d,
    reg_state,
    run_scenario,
)
from fully_shard.common import WORLD, assert_all_sharded, fsdp_modules


# --------------------------------------------------------------------------------------------
# 5. features
# --------------------------------------------------------------------------------------------


def _every_block(fn):
    def prepare(model):
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = fn(blk)
    return prepare


def _ckpt_in_forward(blk):
    blk.ckpt = True
    return blk


def _ckpt_reentrant_in_forward(blk):
    blk.ckpt = "reentrant"
    return blk


def _ckpt_reentrant_around_blocks(impl, model):
    """cfsdp: each block call under a reentrant checkpoint around the unit (the recompute runs
    the unit's hooks again); torch: the reentrant checkpoint inside the unit's forward, the
    same gradients bitwise (each call's recompute is differentiated in a backward of its own,
    and its gradient reduced there).  torch 2.13's own placement around the unit is wrong
    when a unit is called twice (README): after backward the unit stays unsharded, its
    registered parameters the unsharded ones holding a gradient never reduced, and the
    sharded parameters lack a call's gradient."""
    if impl is TORCH or SELFTEST:
        for blk in model.blocks:
            blk.ckpt = "reentrant"
    else:
        model.ckpt_around_blocks = True


_MP_BF16_FP32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _mp(**kw) -> Scenario:
    """``Scenario(**kw)`` under MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)."""
    return Scenario(optim="sgd", unit_kw={"mp_policy": _MP_BF16_FP32},
                    root_kw={"mp_policy": _MP_BF16_FP32}, mp=_MP_BF16_FP32, **kw)


def _eval_forward(require_sharded: Callable[[Impl], bool]):
    """After each step, an eval-mode no_grad forward; its output is compared with torch's.

    With the root's default reshard_after_forward (False for the root), torch 2.13 leaves the
    root's unsharded parameters registered after it (until the next forward); cfsdp must not
    leak them: every parameter is a sharded DTensor again (as its wrapper face frees every unit
    after a no_grad forward, README). With reshard_after_forward=True everywhere, torch too."""

    def after_step(impl, model, s, step_data, notes):
        model.eval()
        with torch.no_grad():
            out = model(step_data[0][0][0])
        model.train()
        notes.append((f"eval output after step {s}", out.clone()))
        if require_sharded(impl):
            assert_all_sharded(model, f"{impl.name}: after a no_grad eval forward")

    return after_step


def _explicit_unshard(async_op: bool):
    def before(impl, model, s, m, notes):
        handles = [mod.unshard(async_op=async_op) for mod in fsdp_modules(impl, model)]
        if async_op:
            bad = [type(hd).__name__ for hd in handles if not isinstance(hd, impl.UnshardHandle)]
            if bad:
                raise AssertionError(f"{impl.name}: unshard(async_op=True) returned {bad}, not UnshardHandle")
            for hd in handles:
                hd.wait()
        elif any(hd is not None for hd in handles):
            raise AssertionError(f"{impl.name}: unshard() returned {handles}, expected None")
        notes.append((f"after unshard(async_op={async_op}), step {s}", reg_state(model)))

    def after(impl, model, s, m, notes):
        for mod in fsdp_modules(impl, model):
            mod.reshard()
        notes.append((f"after reshard(), step {s}", reg_state(model)))
        assert_all_sharded(model, f"{impl.name}: after reshard()")

    return before, after


def _prefetch(impl, model):
    b0, b1 = model.blocks
    model.set_modules_to_forward_prefetch([b0, b1])
    b0.set_modules_to_forward_prefetch([b1])
    b1.set_modules_to_backward_prefetch([b0])


def _no_reshard_after_backward(impl, model, s, m, notes):
    model.set_requires_gradient_sync(m == 1)
    model.set_reshard_after_backward(m == 1)


def _note_state_and_grads(impl, model, s, m, notes):
    notes.extend([(f"after backward {m} of step {s}", reg_state(model)),
                  (f"gradient values after backward {m} of step {s}",
                   [None if p.grad is None else local(p.grad).detach().clone()
                    for p in model.parameters()])])


def _no_reshard_after_backward_ever(impl, model, s, m, notes):
    model.set_requires_gradient_sync(m == 2)
    model.set_reshard_after_backward(False)


def _divide_factor(factor_of_w: Callable[[int], float]):
    def configure(impl, model):
        k = factor_of_w(WORLD)
        for mod in fsdp_modules(impl, model):
            mod.set_gradient_divide_factor(k)
            if impl is TORCH or SELFTEST:  # gloo has no PREMUL_SUM (see the module docstring)
                mod.set_force_sum_reduction_for_comms(True)
    return configure


def _divide_factor_root_only(impl, model):
    """``set_gradient_divide_factor(1.0)`` on the root only: torch's setter takes no
    ``recurse`` and changes the root's unit alone, so the blocks keep averaging (their
    gradients a factor W apart from the root's; torch is the oracle: the reference has one
    scale).  force-sum on every unit for torch, as ``_divide_factor``."""
    model.set_gradient_divide_factor(1.0)
    if impl is TORCH or SELFTEST:
        for mod in fsdp_modules(impl, model):
            mod.set_force_sum_reduction_for_comms(True)


def _is_last_backward(impl, model, s, m, notes):
    model.set_is_last_backward(m == 1)


def _fail_then_reset(impl, model, s, m, notes):
    if s != 1:
        return
    model.blocks[1].fail = True
    failed = False
    try:
        model(torch.zeros(ROWS // WORLD, 7))
    except InjectedFailure:
        failed = True  # expected: the forward aborts mid-flight
    if not failed:
        raise AssertionError("the injected failure did not propagate")
    model.reset_iter_state()
    notes.append(("after reset_iter_state", reg_state(model)))


def _force_sum(impl, model):
    for mod in fsdp_modules(impl, model):
        mod.set_force_sum_reduction_for_comms(True)


def _halve_in_hook(impl, model):
    for mod in fsdp_modules(impl, model):
        mod.set_all_reduce_hook(lambda reduced: reduced.mul_(0.5))


def _branches(root: Callable[[int, int, int], bool], block: Callable[[int, int, int], bool],
              order: Callable[[int, int], tuple] = lambda s, m: (0, 1),
              sync: Callable[[int, int], bool] = lambda s, m: True):
    """``mlp_branch``: before micro-batch m of step s, which branches this rank uses (the
    root's, block 1's: ``(s, m, rank) -> bool``), which blocks forward calls, and whether the
    backward syncs gradients."""

    def before(impl, model, s, m, notes):
        r = dist.get_rank()
        model.use_branch = root(s, m, r)
        model.blocks[1].use_branch = block(s, m, r)
        model.order = order(s, m)
        model.set_requires_gradient_sync(sync(s, m))

    return before


def _reduce_scatter_unused(on: Callable[[Impl], bool], freeze: tuple[str, ...] = (),
                           zero_use: Callable[[Impl], bool] = lambda impl: False):
    """``set_reduce_scatter_unused_params(True)`` on the contenders ``on`` picks (on the root,
    recursing); ``zero_use``: those whose branches not used are used times 0 (a zero
    gradient, the same values: [Note: unused parameters] in chunk/grads.py); ``freeze``:
    the parameters frozen (torch reduces no zeros for them: ``.grad`` stays None)."""

    def configure(impl, model):
        if on(impl):
            model.set_reduce_scatter_unused_params(True)
        model.zero_use = model.blocks[1].zero_use = zero_use(impl)
        for name in freeze:
            model.get_parameter(name).requires_grad_(False)

    return configure


def _toggle_requires_grad(impl, model, s, m, notes):
    """``mlp_branch``, before each step: block 1 frozen as a whole in step 1, block 0's weight
    in step 2, the root's branch trainable in step 1 only (frozen from the start, then again
    with a gradient it got)."""
    model.blocks[1].requires_grad_(s != 1)
    model.blocks[0].lin.weight.requires_grad_(s != 2)
    model.branch.requires_grad_(s == 1)


def _on_rank(*ranks):
    return lambda s, m, r: r in ranks


_BF16_FP32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# set_reduce_scatter_unused_params(True) (torch 2.13+): torch reduces zeros for every trainable
# parameter that got no gradient, in every unit unsharded before, a unit that backward did not
# reach included (its final callback), so ranks whose control flow left a parameter unused still
# take part.  Each after every backward: the registered gradients (None or a tensor) and their
# values, bitwise torch's; torch is the oracle (the branches depend on the rank: no
# single-process reference).  (Module-level values: subtest_items.py reads FEATURES' keys from
# the source.)
# The root's branch on rank 0 in steps 0 and 1, on none in step 2 (zeros for it, in a unit
# backward reached), block 1's on rank 1; block 1 not called in step 0 (never unsharded: no
# zeros, torch's ``hasattr(_unsharded_param)``) nor in step 2 (zeros)
_RS_RANK_DEPENDENT = _branches(root=lambda s, m, r: r == 0 and s < 2, block=_on_rank(1),
                               order=lambda s, m: (0, 1) if s == 1 else (0,))
# 3 micro-batches, the last synchronising: the root's branch on rank 0 in micro-batch 0 and on
# rank 1 in the last, block 1's on rank 0 in the middle one
_RS_ACCUMULATING = dict(root=lambda s, m, r: (m + r) % 3 == 0 and r < 2,
                        block=lambda s, m, r: m == 1 and r == 0, sync=lambda s, m: m == 2)


def _both(impl) -> bool:
    return True


def _compile_body(blk):
    # aot_eager: the compiled graph runs the same aten ops as eager (inductor would
    # fuse differently and takes minutes to compile on 2 cores)
    blk._body = torch.compile(blk._body, backend="aot_eager")
    return blk


def _register_generate(impl, model):
    impl.register_fsdp_forward_method(model, "generate")


def _meta_build(kind, seed):
    with torch.device("meta"):
        return build(kind, seed)


def _materialise_in_place(impl, model):
    """torchtitan's order: to_empty, then initialise the local shards in place (here with the
    rows of an eagerly built model), then the optimizer (built by the scenario after this):
    the optimizer must step the parameters the units use from the first forward on."""
    model.to_empty(device="cpu")
    ref = build("mlp").state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            local(p).copy_(distribute_tensor(ref[name], p.device_mesh, p.placements).to_local())
        model.shift.copy_(ref["shift"])


def _materialise_as(kind: str):
    def configure(impl, model):
        model.to_empty(device="cpu")
        set_model_state_dict(model, build(kind).state_dict(), options=StateDictOptions(full_state_dict=True))
        assert_all_sharded(model, f"{impl.name}: after to_empty + set_model_state_dict")
    return configure


_materialise = _materialise_as("mlp")


FEATURES: dict[str, Callable[[], Scenario]] = {
    "called_twice": lambda: Scenario(kind="mlp_twice"),
    "called_twice_apart": lambda: Scenario(kind="mlp_apart"),
    "eval_between_steps": lambda: Scenario(
        after_step=_eval_forward(lambda impl: impl is CFSDP and not SELFTEST)),
    "eval_between_steps_reshard_root": lambda: Scenario(
        unit_kw={"reshard_after_forward": True}, after_step=_eval_forward(lambda impl: True)),
    "checkpoint_in_forward": lambda: Scenario(prepare=_every_block(_ckpt_in_forward)),
    "checkpoint_wrapper": lambda: Scenario(prepare=_every_block(checkpoint_wrapper)),
    # reentrant checkpointing (torch.utils.checkpoint(use_reentrant=True)) in each block's
    # forward; ``called_twice``: block 1 called twice in one forward, each call's recompute
    # differentiated in a backward of its own, so the unit reduces and reshards after the
    # later call's, then the earlier call's recompute needs it unsharded again (torch's
    # pre-backward of every output gradient unshards; cfsdp's ran once per backward and that
    # recompute failed: "aten.addmm.default got mixed torch.Tensor and DTensor")
    "checkpoint_reentrant_mp": lambda: _mp(prepare=_every_block(_ckpt_reentrant_in_forward)),
    "checkpoint_reentrant_called_twice": lambda: Scenario(
        kind="mlp_twice", prepare=_every_block(_ckpt_reentrant_in_forward)),
    "checkpoint_reentrant_called_twice_mp": lambda: _mp(
        kind="mlp_twice", prepare=_every_block(_ckpt_reentrant_in_forward)),
    "checkpoint_reentrant_around_units_called_twice": lambda: Scenario(
        kind="mlp_twice", configure=_ckpt_reentrant_around_blocks),
    "ignored_params": lambda: Scenario(
        root_kw=lambda model: {"ignored_params": {model.out.weight, model.out.bias}},
        ref=False),  # ignored grads are not reduced: ranks diverge, torch is the only oracle
    "unshard_reshard": lambda: Scenario(steps=2, before_micro=_explicit_unshard(False)[0],
                                        after_micro=_explicit_unshard(False)[1]),
    "unshard_async": lambda: Scenario(steps=2, before_micro=_explicit_unshard(True)[0],
                                      after_micro=_explicit_unshard(True)[1]),
    "prefetch_lists": lambda: Scenario(configure=_prefetch),
    "reshard_after_backward_false": lambda: Scenario(
        steps=2, micro=2, before_micro=_no_reshard_after_backward,
        after_micro=_note_state_and_grads),
    # unsharded through the synchronising backward too: torch drops the full-size gradients
    # the no-sync backwards showed (the root's unit, not resharded after forward, kept them).
    # torch is the only oracle: never resharded, the next step's forward uses the unsharded
    # parameters of before the optimizer step (and the gradients shown are None)
    "reshard_after_backward_false_sync": lambda: Scenario(ref=False,
        steps=2, micro=3, before_micro=_no_reshard_after_backward_ever,
        after_micro=_note_state_and_grads),
    "gradient_divide_factor_1": lambda: Scenario(
        optim="sgd", configure=_divide_factor(lambda w: 1.0), ref_grad_scale=float(WORLD)),
    "gradient_divide_factor_2w": lambda: Scenario(
        optim="sgd", configure=_divide_factor(lambda w: 2.0 * w), ref_grad_scale=0.5),
    "gradient_divide_factor_root_only": lambda: Scenario(
        optim="sgd", configure=_divide_factor_root_only, ref=False),
    "is_last_backward": lambda: Scenario(steps=2, micro=2, before_micro=_is_last_backward),
    # torch 2.13+ (2.11's FSDPModule has no reset_iter_state, nor has cfsdp's there)
    **({"reset_iter_state": lambda: Scenario(steps=3, before_micro=_fail_then_reset)}
       if hasattr(torch_fsdp.FSDPModule, "reset_iter_state") else {}),
    "register_fsdp_forward_method": lambda: Scenario(configure=_register_generate,
                                                     call=lambda model, x: model.generate(x)),
    "meta_init": lambda: Scenario(build=_meta_build, configure=_materialise),
    "meta_init_in_place": lambda: Scenario(build=_meta_build, configure=_materialise_in_place),
    # torch leaves .grad None for a parameter forward never used (AdamW then skips it)
    "unused_params": lambda: Scenario(kind="mlp_unused"),
    "unused_params_accumulate": lambda: Scenario(kind="mlp_unused", steps=2, micro=2),
    # a parameter unused in a step keeps the gradient it held (zeros after
    # zero_grad(set_to_none=False)), which AdamW steps (weight decay), as torch's: torch
    # leaves it out of its reduce-scatter, so its sharded .grad is left as it was
    "unused_params_kept_grads": lambda: Scenario(
        kind="mlp_branch", ref=False, set_to_none=False, after_micro=_note_state_and_grads,
        before_micro=_branches(root=lambda s, m, r: s != 1, block=lambda s, m, r: s != 2)),
    # 3 micro-batches, the last synchronising: the root's branch used in the middle one only
    # (after one that left it without a gradient; its gain has no row on rank 1), block 1's in
    # the first only: each gets the sum of what it got, as torch's (which reduces what a
    # parameter accumulated), also where this rank's rows of it are empty or zero
    "unused_params_accumulate_middle": lambda: Scenario(
        kind="mlp_branch", ref=False, micro=3, after_micro=_note_state_and_grads,
        before_micro=_branches(root=lambda s, m, r: m == 1, block=lambda s, m, r: m == 0,
                               sync=lambda s, m: m == 2)),
    # requires_grad changed between steps (a whole unit, and parameters of units that keep
    # trainable ones); kept grads: a parameter frozen with a gradient keeps it (zeros after
    # zero_grad(set_to_none=False)) and AdamW steps it, as torch's, which never touches a
    # frozen parameter's .grad
    "requires_grad_toggled": lambda: Scenario(
        kind="mlp_branch", ref=False, before_micro=_toggle_requires_grad,
        after_micro=_note_state_and_grads),
    "requires_grad_toggled_kept_grads": lambda: Scenario(
        kind="mlp_branch", ref=False, set_to_none=False, before_micro=_toggle_requires_grad,
        after_micro=_note_state_and_grads),
    **({
        "reduce_scatter_unused_params": lambda: Scenario(
            kind="mlp_branch", ref=False,
            configure=_reduce_scatter_unused(_both, freeze=("in_proj.weight",)),
            before_micro=_RS_RANK_DEPENDENT, after_micro=_note_state_and_grads),
        "reduce_scatter_unused_params_mp": lambda: Scenario(
            kind="mlp_branch", ref=False,
            configure=_reduce_scatter_unused(_both, freeze=("in_proj.weight",)),
            unit_kw={"mp_policy": _BF16_FP32}, before_micro=_RS_RANK_DEPENDENT,
            after_micro=_note_state_and_grads),
        # the unit not reached by the synchronising backward (step 1) reduces what the
        # no-sync ones accumulated, with zeros for what they left without a gradient
        "reduce_scatter_unused_params_accumulate": lambda: Scenario(
            kind="mlp_branch", ref=False, micro=3, configure=_reduce_scatter_unused(_both),
            before_micro=_branches(**_RS_ACCUMULATING,
                                   order=lambda s, m: (0,) if (s, m) in ((1, 2), (2, 0), (2, 1), (2, 2))
                                   else (0, 1)),
            after_micro=_note_state_and_grads),
        # torch 2.13 fails here (AssertionError "FSDP reduce-scatter expects uniform gradient
        # dtype": bf16 zeros beside fp32 accumulated gradients; 2.15 casts the zeros). The
        # oracle is torch without the flag on the same model whose branches not used are
        # used times 0: every parameter gets a gradient, zeros where the flag reduces zeros
        "reduce_scatter_unused_params_accumulate_mp": lambda: Scenario(
            kind="mlp_branch", ref=False, micro=3, unit_kw={"mp_policy": _BF16_FP32},
            configure=_reduce_scatter_unused(lambda impl: impl is CFSDP and not SELFTEST,
                                             zero_use=lambda impl: impl is TORCH or SELFTEST),
            before_micro=_branches(**_RS_ACCUMULATING), after_micro=_note_state_and_grads),
        # without the flag: torch aborts (gloo: a reduce-scatter of another size on each
        # rank); cfsdp reduces the whole unit, and each parameter some rank used gets its
        # gradient on every rank, None only where no rank used it: torch with the flag is
        # the oracle where every branch is used by some rank (rank s % W uses none in step s).
        # ``gain`` frozen: a rank holding no row of it that did not use it cannot tell that
        # from no rank using it (None; torch with the flag: an empty gradient)
        "unused_on_some_ranks": lambda: Scenario(
            kind="mlp_branch", ref=False,
            configure=_reduce_scatter_unused(lambda impl: impl is TORCH or SELFTEST,
                                             freeze=("gain",)),
            before_micro=_branches(root=lambda s, m, r: r != s % WORLD,
                                   block=lambda s, m, r: r != s % WORLD),
            after_micro=_note_state_and_grads),
    } if hasattr(torch_fsdp.FSDPModule, "set_reduce_scatter_unused_params") else {}),
    "all_reduce_hook": lambda: Scenario(optim="sgd", configure=_halve_in_hook, ref_grad_scale=0.5),
    "compiled_block": lambda: Scenario(prepare=_every_block(_compile_body)),
    "force_sum_reduction": lambda: Scenario(configure=_force_sum),
    "grouped_modules": lambda: Scenario(kind="mlp_grouped"),
}
if WORLD == 4:  # reshard to a group of 2 after forward (at W=2 the int 2 means True)
    FEATURES["reshard_after_forward_int"] = lambda: Scenario(unit_kw={"reshard_after_forward": 2})


class EmbNet(nn.Module):
    """An embedding unit whose backward needs no weight values (set_unshard_in_backward)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(idx)))


@h.subtest
def unshard_in_backward_false(ctx):
    """emb.set_unshard_in_backward(False): backward skips the embedding's all-gather; losses,
    local gradients and parameters equal torch's (which skips it too) bitwise."""
    mm = pc.Mismatches(ctx)
    mesh = mesh_1d(ctx)
    out = {}
    for impl in (TORCH, CFSDP):
        torch.manual_seed(0)
        m = EmbNet()
        impl.fully_shard(m.emb, mesh=mesh)
        impl.fully_shard(m, mesh=mesh)
        m.emb.set_unshard_in_backward(False)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 + step)
            idx = torch.randint(0, 11, (ROWS, 3), generator=g).chunk(ctx.world_size)[ctx.rank]
            loss = m(idx).pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
            grads = {n: local(p.grad).clone() for n, p in m.named_parameters()}
            opt.step()
            opt.zero_grad()
        out[impl.name] = (losses, grads, {n: local(p).clone() for n, p in m.named_parameters()})
    (cl, cg, cp), (tl, tg, tp) = out["cfsdp"], out["torch"]
    for i, (a, b) in enumerate(zip(cl, tl)):
        mm.tensors(f"loss {i}", a, b)
    for n in tg:
        mm.tensors(f"grad {n}", cg[n], tg[n])
        mm.tensors(f"param {n}", cp[n], tp[n])
    mm.raise_if_any()


@h.subtest(grid={"feature": list(FEATURES)})
def features(ctx, feature: str):
    run_scenario(ctx, FEATURES[feature]())


@h.subtest(grid={"reshard_after_forward": [True, False]})
def recorded_streams(ctx, reshard_after_forward: bool):
    """torch FSDP2's stream protocol under the recording device layer (stream_check.py;
    tests/unit/test_streams.py runs it at world 1): two steps with gloo's collectives, the
    happens-before checker passes, losses and parameters bitwise those of the same run
    without the recorder, every collective issued on a side stream.  The ordering logic
    only: nothing here runs on a GPU."""
    _recorded_streams(ctx, reshard_after_forward)


if WORLD == 4:
    @h.subtest
    def recorded_streams_post_forward_group(ctx):
        """The same with ``reshard_after_forward=2``: after forward each unit keeps its
        shard of a post-forward group of 2 ranks, and backward's all-gather runs over it
        (inside the all-gather stream, from the kept shard)."""
        _recorded_streams(ctx, 2)


def _recorded_streams(ctx, reshard_after_forward) -> None:
    import stream_check as sc

    mesh = mesh_1d(ctx)
    want = sc.train(None, mesh, reshard_after_forward, seed=ctx.rank)
    rec = sc.RecordingDevice()
    got = sc.train(rec, mesh, reshard_after_forward, seed=ctx.rank)
    sc.check(rec.log)
    sc.assert_same(want, got)
    on_current = [op for op in rec.ops_on(sc.CURRENT) if op.startswith("c10d.")]
    if on_current:
        raise AssertionError(f"collectives on the current stream: {on_current}")
    # the copy-out one split_with_sizes_copy on the current stream, the reduce-scatter's
    # copy-in one _chunk_cat on its stream (chunk/launch.py)
    for stream, op in (("all_gather", "c10d._allgather_base_.default"),
                       ("reduce_scatter", "c10d._reduce_scatter_base_.default"),
                       (sc.CURRENT, "aten.split_with_sizes_copy.out"),
                       ("reduce_scatter", "aten._chunk_cat.out")):
        if op not in rec.ops_on(stream):
            raise AssertionError(f"no {op} on the {stream} stream: {sorted(set(rec.ops_on(stream)))}")
