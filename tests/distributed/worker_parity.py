"""FSDP1 parity: cfsdp.FullyShardedDataParallel against torch's FSDP1 and a single-process model.

Run by tests/distributed/test_parity.py under torchrun (gloo, CPU) at W=2 and W=4; every
subtest below runs inside the one spawn (see _harness.py).

Three copies of the same model (same seed) train on the same data:

* ``torch``:  torch.distributed.fsdp.FullyShardedDataParallel (device_id=cpu, gloo), the oracle;
* ``cfsdp``:  cfsdp.FullyShardedDataParallel with the same arguments;
* ``ref``:    the unwrapped model in one process, on every rank, trained on all ranks' batches.

Compared (``run_parity``): before training, ``named_parameters()`` names and shapes,
``parameters()`` count and shapes, the local (sharded) parameter values, ``state_dict()`` keys,
order, shapes and values, and that the keys are the unwrapped model's; then the loss of every
step; the local gradients after the last backward (flat shards for use_orig_params=False,
per-parameter sharded views for True, via ``named_parameters()``); the local parameters, the full
parameters under ``summon_full_params`` and ``state_dict()`` after the last step. torch FSDP1 is
checked against ``ref`` for losses, gradients (mapped element by element through torch's own
flat-parameter metadata) and the full state dict.

Tolerances (why they are what they are):

* cfsdp vs torch FSDP1: **bitwise** (``torch.equal``) for losses, sharded parameters and
  gradients, full parameters and buffers. Both run the same fp32 ops in the same order on the
  same values: the same all-gathered parameters, the same local forward/backward, a sum over
  ranks by the same gloo collective, the same pre/post divide factors and the same optimizer on
  the same shards. Any difference is a real divergence in what cfsdp computes.
* torch FSDP1 vs ref: ``rtol=REF_RTOL, atol=REF_ATOL``. FSDP averages the per-rank gradients
  as ``(sum_r g_r / f) / (W / f)`` through gloo's reduction order, while the reference
  accumulates ``g_r / W`` through autograd: same maths, different rounding (a few ulps per
  step, ~1e-7 relative). Over 10 steps of SGD-momentum/AdamW at these learning rates the
  observed drift stays below 1e-5 relative for losses and parameters; elements of a
  gradient that are ~0 have large *relative* error, hence the small absolute term.
  The ref checks that the torch oracle itself is right, so cfsdp == torch also implies cfsdp ~ ref.

The reference forwards each rank's chunk separately (so BatchNorm sees the same per-rank
batch statistics as under FSDP, which does not sync buffers) and backpropagates the mean of the
per-chunk losses, which is exactly the loss whose gradient FSDP's averaging computes. BatchNorm
running statistics are per-rank under FSDP, so they are compared against torch FSDP only.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.fsdp import BackwardPrefetch
from torch.distributed.fsdp import ShardingStrategy as SS
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

import _harness as h
from parity_common import (
    Attention,
    BN_STATS,
    Block,
    CPU,
    LOSSES,
    Mismatches,
    build,
    make_batches,
    make_optim,
    make_policy,
    make_seq,
    mse_loss,
    run_parity,
    train_fsdp,
    train_ref,
    wrap_odd,
    wrap_root,
    wrap_strided,
)

from cfsdp import FullyShardedDataParallel as CFSDP


def wrap_odd_kw(wrapper, model, kw):
    return wrap_odd(wrapper, model, **kw)


# --------------------------------------------------------------------------------------------
# subtests
# --------------------------------------------------------------------------------------------


@h.subtest(grid={"policy": ["module", "transformer", "size", "lambda"],
                 "use_orig_params": [False, True], "optim": ["sgd", "adamw"]})
def transformer_autowrap(ctx, policy: str, use_orig_params: bool, optim: str):
    run_parity(ctx, "transformer", use_orig_params, optim, wrap_root,
               fsdp_kwargs={"auto_wrap_policy": make_policy(policy)})


@h.subtest(grid={"use_orig_params": [False, True], "optim": ["sgd", "adamw"]})
def odd_hand_nested(ctx, use_orig_params: bool, optim: str):
    run_parity(ctx, "odd", use_orig_params, optim, wrap_odd_kw)


@h.subtest(grid={"use_orig_params": [False, True]})
def single_unit_sequential(ctx, use_orig_params: bool):
    run_parity(ctx, "seq", use_orig_params, "adamw", wrap_root)


def strides_of(model: nn.Module, wrapper) -> list[tuple[str, tuple[int, ...]]]:
    """Each parameter's stride as the module shows it between steps and under summon_full_params."""
    out = [(n, p.stride()) for n, p in model.named_parameters()]
    with wrapper.summon_full_params(model):
        out += [("summoned " + n, p.stride()) for n, p in model.named_parameters()]
    return out


@h.subtest(grid={"strategy": [SS.FULL_SHARD, SS.SHARD_GRAD_OP, SS.NO_SHARD], "use_orig_params": [False, True]})
def strided_params(ctx, strategy, use_orig_params: bool):
    """Parameters that are not row-major (``Strided``) keep their strides, as torch FSDP1 keeps
    them: bitwise torch's flat layout and shards (LOCAL values), losses, gradients, summoned
    parameters and state dict, the strides the module sees, and the single process within the
    REF tolerances.

    Except NO_SHARD with use_orig_params=True, where torch 2.13's FSDP1 is wrong: it shows each
    parameter's gradient as ``flat_grad[offset:offset + numel].reshape(shape)``
    (``_use_sharded_grad_views``), a row-major reading of elements it laid out in memory order,
    so the optimizer steps a transposed weight with a scrambled gradient (W=2: the loss of step 1
    is 31.30 where the single process has 30.96).  There the oracle is the single process, and
    torch's signature is asserted so that a fix in torch is noticed."""
    kw = {"sharding_strategy": strategy}
    mm = Mismatches(ctx)
    base = build("strided")
    wkw = dict(process_group=ctx.pg, use_orig_params=use_orig_params, device_id=CPU, **kw)
    t_strides = strides_of(wrap_strided(TorchFSDP, copy.deepcopy(base), wkw), TorchFSDP)
    c_strides = strides_of(wrap_strided(CFSDP, copy.deepcopy(base), wkw), CFSDP)
    mm.check(c_strides == t_strides, f"strides: cfsdp {c_strides} != torch {t_strides}")
    mm.raise_if_any()
    if not (strategy is SS.NO_SHARD and use_orig_params):
        run_parity(ctx, "strided", use_orig_params, "adamw", wrap_strided, fsdp_kwargs=kw)
        return
    batches = make_batches("strided", ctx.world_size)
    models = [wrap_strided(w, copy.deepcopy(base), wkw) for w in (TorchFSDP, CFSDP)]
    (t_losses, _), (c_losses, _) = (
        train_fsdp(m, make_optim("adamw", m.parameters()), batches, mse_loss, ctx.rank) for m in models)
    ref = copy.deepcopy(base)
    r_losses, _ = train_ref(ref, make_optim("adamw", ref.parameters()), batches, mse_loss)
    for step, (c, r) in enumerate(zip(c_losses, r_losses)):
        mm.tensors(f"cfsdp-vs-ref loss at step {step}", c, r[ctx.rank], exact=False, b_name="ref")
    c_sd = models[1].state_dict()
    for k, v in ref.state_dict().items():
        mm.tensors(f"cfsdp-vs-ref state_dict[{k}] at the end", c_sd.get(k), v, exact=False, b_name="ref")
    torch_off = max(abs(t.item() - r[ctx.rank].item()) for t, r in zip(t_losses, r_losses))
    mm.check(torch_off > 1e-3, f"torch FSDP1 (NO_SHARD, use_orig_params=True) now matches the single "
                               f"process (max loss difference {torch_off:.2e}): make it the oracle here")
    mm.raise_if_any()


@h.subtest(grid={"backward_prefetch": [BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST, None],
                 "forward_prefetch": [False, True]})
def prefetch(ctx, backward_prefetch, forward_prefetch: bool):
    run_parity(ctx, "transformer", False, "sgd", wrap_root, with_ref=False, steps=4,
               fsdp_kwargs={"auto_wrap_policy": make_policy("module"), "backward_prefetch": backward_prefetch,
                            "forward_prefetch": forward_prefetch, "limit_all_gathers": forward_prefetch})


@h.subtest(grid={"backward_prefetch": [BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST]})
def gloo_one_in_flight(ctx, backward_prefetch):
    """On the process group (gloo), cfsdp's prefetch all-gather and its asynchronous
    reduce-scatter are never in flight together on one group (torch 2.13's gloo corrupts its
    heap when two finish at once: gloo_in_flight.py), and training is bitwise torch's."""
    import gloo_in_flight

    group = gloo_in_flight.process_group_only()
    with gloo_in_flight.watch(group) as overlaps:
        run_parity(ctx, "transformer", False, "sgd", wrap_root, with_ref=False, steps=3,
                   fsdp_kwargs={"auto_wrap_policy": make_policy("module"), "process_group": group,
                                "backward_prefetch": backward_prefetch, "forward_prefetch": True})
    assert not overlaps, "two collectives in flight on one gloo group:\n" + "\n".join(overlaps[:2])


@h.subtest(grid={"use_orig_params": [False, True]})
def cfsdp_defaults(ctx, use_orig_params: bool):
    """cfsdp with process_group=None (the default group) and device_id=None on a CPU module.

    torch needs device_id=cpu on this CPU-only machine; cfsdp should just work.
    """
    run_parity(ctx, "transformer", use_orig_params, "adamw", wrap_root, with_ref=False, steps=4,
               fsdp_kwargs={"auto_wrap_policy": make_policy("module")},
               cfsdp_kwargs={"process_group": None, "device_id": None})


@h.subtest(grid={"ignore": ["ignored_modules", "ignored_states_params", "ignored_states_modules"],
                 "use_orig_params": [False, True]})
def ignored(ctx, ignore: str, use_orig_params: bool):
    """The head is not sharded: its grads stay local (not reduced) on each rank, as in torch.

    Ranks diverge on purpose, so only torch-vs-cfsdp (per rank, bitwise) is checked.
    """

    def wrap(wrapper, model, kw):
        kw = dict(kw, auto_wrap_policy=make_policy("module"))
        if ignore == "ignored_modules":
            kw["ignored_modules"] = [model.head]
        elif ignore == "ignored_states_params":
            kw["ignored_states"] = list(model.head.parameters()) + [model.pos]
        else:
            kw["ignored_states"] = [model.head, model.ln_f]
        return wrapper(model, **kw)

    run_parity(ctx, "transformer", use_orig_params, "sgd", wrap, with_ref=False, steps=4)


@h.subtest(grid={"use_orig_params": [False, True]})
def sync_module_states(ctx, use_orig_params: bool):
    """Each rank builds the model from its own seed; sync_module_states=True makes them rank 0's.

    torch FSDP1 rejects sync_module_states for CPU modules ("requires them to be on GPU"), so
    the oracle is the model built with rank 0's seed, in this process; then two training steps
    must match the single-process reference from that model.
    """
    mm = Mismatches(ctx)
    expected = build("odd", seed=100)  # what rank 0 builds below
    expected.bn.running_mean.add_(0.25)  # a buffer that differs from a fresh BatchNorm too
    local = build("odd", seed=100 + ctx.rank)
    local.bn.running_mean.add_(0.25 + ctx.rank)
    model = wrap_odd(CFSDP, local, process_group=ctx.pg, use_orig_params=use_orig_params,
                     device_id=CPU, sync_module_states=True)
    sd = model.state_dict()
    exp = expected.state_dict()
    mm.check(list(sd) == list(exp), f"keys {list(sd)} != {list(exp)}")
    for k, v in exp.items():
        mm.tensors(f"state_dict[{k}] after sync_module_states", sd.get(k), v, a_name="cfsdp", b_name="rank0 model")
    mm.raise_if_any()
    batches = make_batches("odd", ctx.world_size, steps=2)
    c_losses, _ = train_fsdp(model, make_optim("sgd", model.parameters()), batches, mse_loss, ctx.rank)
    r_losses, _ = train_ref(expected, make_optim("sgd", expected.parameters()), batches, mse_loss)
    for s in range(2):
        mm.tensors(f"cfsdp-vs-ref loss at step {s}", c_losses[s], r_losses[s][ctx.rank],
                   exact=False, b_name="ref")
    mm.raise_if_any()


@h.subtest(grid={"kind": ["odd", "transformer"], "use_orig_params": [False, True]})
def grad_accumulation_and_eval(ctx, kind: str, use_orig_params: bool):
    """Two forward/backward micro-batches per optimizer step (gradients accumulate in the
    sharded grads), and an eval-mode ``no_grad`` forward after every step (a forward with no
    backward; BatchNorm then uses its running stats).

    Oracle: the single-process model (mean of all ranks' micro-batch losses), always; torch
    FSDP1 bitwise only for the transformer. For the Odd model torch 2.13's FSDP1 itself is
    wrong with use_orig_params=False: the accumulated gradient of the 1-element unit ``one``
    on the rank that holds it is 0.7822 where the single-process gradient is 1.0748 (W=2,
    step 0), so torch is not the oracle there (DESIGN: "do not copy bugs").
    """
    mm = Mismatches(ctx)
    base = build(kind)
    kw = dict(process_group=ctx.pg, use_orig_params=use_orig_params, device_id=CPU)
    if kind == "odd":
        models = [wrap_odd(w, copy.deepcopy(base), **kw) for w in (TorchFSDP, CFSDP)]
    else:
        models = [w(copy.deepcopy(base), auto_wrap_policy=make_policy("module"), **kw)
                  for w in (TorchFSDP, CFSDP)]
    W = ctx.world_size
    batches = make_batches(kind, 2 * W, steps=4)  # chunk 2r+m is micro-batch m of rank r
    loss_fn = LOSSES[kind]
    record = []
    for model in models:
        opt = make_optim("adamw", model.parameters())
        losses, evals = [], []
        for chunks in batches:
            opt.zero_grad(set_to_none=True)
            for micro in range(2):
                x, y = chunks[2 * ctx.rank + micro]
                loss = loss_fn(model(x), y)
                loss.backward()
                losses.append(loss.detach().clone())
            grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
            opt.step()
            model.eval()
            with torch.no_grad():
                evals.append(model(chunks[0][0]).clone())
            model.train()
        record.append((losses, evals, grads, model.state_dict()))
    ref = copy.deepcopy(base)
    opt = make_optim("adamw", ref.parameters())
    r_losses = []
    for chunks in batches:
        opt.zero_grad(set_to_none=True)
        per_chunk = [loss_fn(ref(x), y) for x, y in chunks]
        (torch.stack(per_chunk).sum() / W).backward()
        r_losses.extend(l.detach().clone() for l in per_chunk[2 * ctx.rank: 2 * ctx.rank + 2])
        opt.step()
        ref.eval()
        with torch.no_grad():
            ref(chunks[0][0])
        ref.train()

    (tl, te, tg, tsd), (cl, ce, cg, csd) = record
    for i, (a, b) in enumerate(zip(cl, r_losses)):
        mm.tensors(f"cfsdp-vs-ref loss of micro-batch {i}", a, b, exact=False, b_name="ref")
    r_sd = ref.state_dict()
    mm.check(list(csd) == list(r_sd), f"state_dict keys {list(csd)} != unwrapped {list(r_sd)}")
    for k, v in r_sd.items():
        if k.rsplit(".", 1)[-1] not in BN_STATS:
            mm.tensors(f"cfsdp-vs-ref state_dict[{k}] at the end", csd.get(k), v, exact=False, b_name="ref")
    if kind == "transformer":
        for i, (a, b) in enumerate(zip(cl, tl)):
            mm.tensors(f"loss of micro-batch {i}", a, b)
        for i, (a, b) in enumerate(zip(ce, te)):
            mm.tensors(f"eval output after step {i}", a, b)
        mm.check(len(cg) == len(tg), f"{len(cg)} grads vs torch {len(tg)}")
        for i, (a, b) in enumerate(zip(cg, tg)):
            mm.tensors(f"accumulated grad of parameter #{i} at the last step", a, b)
        for k in tsd:
            mm.tensors(f"state_dict[{k}] at the end", csd.get(k), tsd[k])
    mm.raise_if_any()


@h.subtest(grid={"use_orig_params": [False, True]})
def module_api(ctx, use_orig_params: bool):
    """``module`` property, attribute forwarding, ``__getitem__`` on a wrapped nn.Sequential."""
    mm = Mismatches(ctx)
    kw = dict(process_group=ctx.pg, use_orig_params=use_orig_params, device_id=CPU)

    seq = make_seq()
    first, last = seq[0], seq[2]
    for wrapper in (TorchFSDP, CFSDP):  # torch's behaviour is asserted too, as the spec
        w = wrapper(copy.deepcopy(seq) if wrapper is TorchFSDP else seq, **kw)
        who = wrapper.__module__
        mm.check(isinstance(w.module, nn.Sequential), f"{who}: .module is {type(w.module)}")
        if wrapper is CFSDP:
            mm.check(w.module is seq, f"{who}: .module is not the wrapped nn.Sequential")
            mm.check(w[0] is first and w[2] is last, f"{who}: __getitem__ does not return the submodules")
            mm.check(w[-1] is last, f"{who}: w[-1] is not the last submodule")
        mm.check(isinstance(w[1], nn.ReLU), f"{who}: w[1] is {type(w[1])}")
        out = w(torch.randn(2, 6))
        mm.check(tuple(out.shape) == (2, 3), f"{who}: output shape {tuple(out.shape)}")

    for wrapper in (TorchFSDP, CFSDP):
        who = wrapper.__module__
        model = build("transformer")
        blocks = model.blocks
        w = wrapper(model, auto_wrap_policy=make_policy("module"), **kw)
        mm.check(w.module is model, f"{who}: root .module is not the original module")
        mm.check(w.some_attr == "tiny-transformer", f"{who}: attribute forwarding gave {w.some_attr!r}")
        mm.check(w.describe() == "TinyTransformer(3)", f"{who}: method forwarding gave {w.describe()!r}")
        mm.check(w.blocks is blocks, f"{who}: w.blocks is not the original ModuleList")
        mm.check(type(w.blocks[0]) is wrapper, f"{who}: auto-wrapped block is {type(w.blocks[0])}")
        mm.check(isinstance(w.blocks[0].module, Block), f"{who}: inner .module is {type(w.blocks[0].module)}")
        mm.check(isinstance(w.blocks[0].attn, Attention), f"{who}: attribute forwarding through a nested unit")
        try:
            w.no_such_attribute
        except AttributeError:
            pass
        else:
            mm.add(f"{who}: missing attribute did not raise AttributeError")
    mm.raise_if_any()


if __name__ == "__main__":
    h.main()
