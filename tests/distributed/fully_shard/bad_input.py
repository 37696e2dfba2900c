"""Bad input (torch's message where torch rejects it, a ValueError/TypeError naming the
FQN where torch does not check) and unusual models, optimizers, dtypes and meshes."""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import _harness as h
import parity_common as pc
from fs_common import (
    CFSDP,
    Impl,
    MLPBlock,
    SELFTEST,
    Scenario,
    TORCH,
    batches,
    build,
    local,
    loss_fn,
    make_model,
    mesh_1d,
    run_steps,
    shard,
)
from fully_shard.common import (
    BF16,
    WORLD,
    _TORCH_2_12,
    _TORCH_HAS_DP_MESH_DIMS,
    _TORCH_REFUSES_TIED_ACROSS_UNITS,
    _TORCH_SHARDS_INT_PARAMS,
    raised,
    largest_dim,
)

import cfsdp


# --------------------------------------------------------------------------------------------
# 8. bad input
# --------------------------------------------------------------------------------------------


class Holder(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.pre = nn.Linear(5, 3)
        self.inner = inner

    def forward(self, x):
        return self.inner(self.pre(x))


class ScalarParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.sub = nn.Module()
        self.sub.gain = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.lin(x) * self.sub.gain


def _fsdp1(impl: Impl, ctx, module: nn.Module) -> nn.Module:
    if impl is TORCH or SELFTEST:
        return torch_fsdp.FullyShardedDataParallel(module, process_group=ctx.pg, device_id=torch.device("cpu"))
    return cfsdp.FullyShardedDataParallel(module, process_group=ctx.pg)


def _twice(impl, ctx, mesh):
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))
    impl.fully_shard(model[0], mesh=mesh)
    impl.fully_shard(model[0], mesh=mesh)


def _sharded_pair(impl, mesh) -> nn.Module:
    """A Sequential of two Linears: the first one its own unit, then the root."""
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))
    impl.fully_shard(model[0], mesh=mesh)
    return impl.fully_shard(model, mesh=mesh)


def _non_contiguous(impl, ctx, mesh):
    lin = nn.Linear(4, 6)
    lin.weight = nn.Parameter(torch.randn(4, 6).t())
    impl.fully_shard(Holder(lin), mesh=mesh)


def _no_state(impl, ctx, mesh):
    """A module of an FSDP class that fully_shard was never applied to."""
    other = nn.Linear(2, 2)
    other.__class__ = type(impl.fully_shard(nn.Linear(2, 2), mesh=mesh))
    other.reshard()


def _placement(result):
    """fully_shard of a Holder (``pre.weight`` (3, 5) first) with ``shard_placement_fn``
    returning ``result`` for every parameter."""
    def call(impl, ctx, mesh):
        impl.fully_shard(Holder(nn.Linear(3, 3)), mesh=mesh, shard_placement_fn=lambda p: result)
    return call


def _reset_iter_state_on_a_unit(impl, ctx, mesh):
    model = _sharded_pair(impl, mesh)
    model(torch.randn(2, 5))
    model[0].reset_iter_state()


def _hsdp_hook_stream(impl, ctx, mesh):
    hsdp = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard"))
    impl.fully_shard(nn.Linear(5, 3), mesh=hsdp).set_all_reduce_hook(lambda t: None, stream=torch.Stream("cpu"))


def _two_roots(impl, ctx, mesh):
    """fully_shard([a, b]) with no parent call: a forward through ``a`` finds two roots."""
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))
    impl.fully_shard([model[0], model[1]], mesh=mesh)
    model[0](torch.randn(2, 5))


def _unit_ran_first(impl, ctx, mesh):
    """A forward through a unit before the root's first forward made the unit a root."""
    model = _sharded_pair(impl, mesh)
    model[0](torch.randn(2, 5))
    model(torch.randn(2, 5))


def _class_repr_dropped(msg: str) -> str:
    """torch's message starts with the repr of its own FSDP<Cls> class (torch's module path),
    which cfsdp's FSDP<Cls> cannot repeat: compare what follows it."""
    return msg.split("> ", 1)[-1]


# name -> (call(impl, ctx, mesh), expectation). Expectations:
#   ("same", needles, cfsdp_needles[, stable]): torch raises; cfsdp raises an instance of torch's
#       type whose message contains torch's verbatim (``stable`` of both, when given: only where
#       torch's message holds what cfsdp cannot repeat); both messages contain every needle;
#       cfsdp's also every cfsdp_needle (what torch names only by its local name, cfsdp must
#       name by FQN).
#   ("cfsdp", types, needles, torch_raises): torch does not check (it accepts the input and
#       fails later or never, or fails at once by accident: ``torch_raises`` records which);
#       cfsdp must raise one of ``types`` at fully_shard time, naming the needles.
BAD_INPUT: dict[str, tuple[Callable, tuple]] = {
    "fsdp1_wrapped_root": (
        lambda impl, ctx, mesh: impl.fully_shard(_fsdp1(impl, ctx, nn.Linear(5, 3)), mesh=mesh),
        ("cfsdp", (ValueError, TypeError), ["FullyShardedDataParallel"], None)),
    "fsdp1_wrapped_submodule": (
        lambda impl, ctx, mesh: impl.fully_shard(Holder(_fsdp1(impl, ctx, nn.Linear(3, 2))), mesh=mesh),
        ("cfsdp", (ValueError, TypeError), ["FullyShardedDataParallel", "inner"], None)),
    "applied_twice": (_twice, ("same", ["already"], [])),
    "cuda_mesh_on_cpu_build": (
        lambda impl, ctx, mesh: impl.fully_shard(nn.Linear(5, 3), mesh=DeviceMesh.from_group(ctx.pg, "cuda")),
        # a CPU build of torch says "Torch not compiled with CUDA enabled", a CUDA build on a
        # machine without a GPU (the registry's torch 2.11 / 2.14 here) "Found no NVIDIA driver"
        ("same", ["cuda" if torch.version.cuda is None else "nvidia"], [])),
    "reshard_after_forward_str": (
        lambda impl, ctx, mesh: impl.fully_shard(nn.Linear(5, 3), mesh=mesh, reshard_after_forward="yes"),
        ("same", ["reshard_after_forward"], [])),
    "reshard_after_forward_not_a_factor": (
        lambda impl, ctx, mesh: impl.fully_shard(nn.Linear(5, 3), mesh=mesh, reshard_after_forward=3),
        ("same", ["reshard_after_forward"], [])),
    "mp_policy_fsdp1_class": (
        lambda impl, ctx, mesh: impl.fully_shard(nn.Linear(5, 3), mesh=mesh,
                                                 mp_policy=MixedPrecision(param_dtype=BF16)),
        ("cfsdp", (TypeError,), ["mp_policy", "MixedPrecisionPolicy"], None)),
    "mp_policy_dict": (
        lambda impl, ctx, mesh: impl.fully_shard(nn.Linear(5, 3), mesh=mesh, mp_policy={"param_dtype": BF16}),
        ("cfsdp", (TypeError,), ["mp_policy", "MixedPrecisionPolicy"], None)),
    "mesh_is_a_process_group": (
        lambda impl, ctx, mesh: impl.fully_shard(nn.Linear(5, 3), mesh=ctx.pg),
        # torch: AttributeError "'ProcessGroup' object has no attribute 'ndim'"
        ("cfsdp", (TypeError, ValueError), ["mesh", "DeviceMesh"], AttributeError)),
    "scalar_parameter": (
        lambda impl, ctx, mesh: impl.fully_shard(ScalarParam(), mesh=mesh),
        ("same", ["gain"], ["sub.gain"])),
    # a layer sharded on its own knows nothing above it: the FQN is still the model's
    "scalar_parameter_in_a_layer_sharded_alone": (
        lambda impl, ctx, mesh: (lambda m: impl.fully_shard(m[1], mesh=mesh))(
            nn.Sequential(nn.Linear(3, 3), ScalarParam())),
        ("same", ["gain"], ["'1.sub.gain'"])),
    "mesh_2d_without_names": (
        lambda impl, ctx, mesh: impl.fully_shard(
            nn.Linear(5, 3), mesh=DeviceMesh("cpu", torch.arange(WORLD).view(WORLD // 2, 2)))
        if WORLD % 2 == 0 else None,
        ("same", ["mesh_dim_names"], [])),
    "container_without_forward": (
        lambda impl, ctx, mesh: impl.fully_shard(nn.ModuleList([nn.Linear(2, 2)]), mesh=mesh),
        ("same", ["forward"], [])),
    "mesh_3d": (
        lambda impl, ctx, mesh: impl.fully_shard(
            nn.Linear(5, 3), mesh=init_device_mesh("cpu", (1, 1, WORLD), mesh_dim_names=("a", "b", "c"))),
        ("same", ["1D or 2D"], [])),
    "reshard_after_forward_float": (
        lambda impl, ctx, mesh: impl.fully_shard(nn.Linear(5, 3), mesh=mesh, reshard_after_forward=1.5),
        ("same", ["reshard_after_forward"], [])),
    "reshard_after_forward_0": (
        lambda impl, ctx, mesh: impl.fully_shard(nn.Linear(5, 3), mesh=mesh, reshard_after_forward=0),
        ("same", ["reshard_after_forward"], [])),
    "non_contiguous_parameter": (_non_contiguous, ("same", ["non-contiguous"], ["inner.weight"])),
    # torch 2.11 checks results one parameter at a time: 'str' object has no attribute 'dim'
    "shard_placement_fn_invalid_result": (_placement("rows"), (
        "same", ["shard_placement_fn" if _TORCH_2_12 else "attribute 'dim'"], ["pre.weight"])),
    "shard_placement_fn_dim_past_the_end": (_placement(Shard(2)), ("same", ["Shard dim 2"], ["pre.weight"])),
    "shard_placement_fn_uneven_dim_1": (_placement(Shard(1)), ("same", ["uneven"], ["pre.weight"])),
    "shard_placement_fn_dim_not_normalized": (
        _placement(Shard(-3)), ("same", ["Shard dim -1", "must be normalized"], ["pre.weight"])),
    # torch's test_init_1d_uneven_shard_largest_dim and test_invalid_shard_dim
    "shard_placement_fn_uneven_largest_dim": (
        lambda impl, ctx, mesh: impl.fully_shard(nn.Sequential(nn.Linear(16, 17), nn.Linear(17, 8)),
                                                 mesh=mesh, shard_placement_fn=largest_dim),
        ("same", ["FSDP does not support uneven sharding on dim 1"], ["1.weight"])),
    "shard_placement_fn_shard1_of_a_bias": (
        lambda impl, ctx, mesh: impl.fully_shard(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8)),
                                                 mesh=mesh, shard_placement_fn=lambda p: Shard(1)),
        ("same", ["Shard dim 1 is invalid for 1D tensor"], ["0.bias"])),
    "no_fsdp_state": (_no_state, ("same", ["No FSDP state"], [])),
    "forward_prefetch_not_fsdp_modules": (
        lambda impl, ctx, mesh: _sharded_pair(impl, mesh).set_modules_to_forward_prefetch([nn.Linear(2, 2)]),
        ("same", ["FSDPModule"], [])),
    "backward_prefetch_not_fsdp_modules": (
        lambda impl, ctx, mesh: (lambda m: m.set_modules_to_backward_prefetch([m[1]]))(_sharded_pair(impl, mesh)),
        ("same", ["FSDPModule"], [])),
    "share_comm_ctx_not_fsdp_modules": (
        lambda impl, ctx, mesh: (torch_fsdp if impl is TORCH or SELFTEST else cfsdp).share_comm_ctx(
            (lambda m: [m, m[1]])(_sharded_pair(impl, mesh))),
        ("same", ["FSDPModules"], [])),
    "forward_method_missing": (
        lambda impl, ctx, mesh: impl.register_fsdp_forward_method(_sharded_pair(impl, mesh), "nope"),
        ("same", ["nope"], [], _class_repr_dropped)),
    # torch 2.11: no reset_iter_state at all (the same AttributeError)
    "reset_iter_state_on_a_unit": (_reset_iter_state_on_a_unit, (
        "same", ["root" if hasattr(torch_fsdp.FSDPModule, "reset_iter_state") else "reset_iter_state"], [])),
    # an argument this torch's fully_shard does not take (2.11: dp_mesh_dims) is torch's TypeError
    "argument_not_in_this_torch": (
        lambda impl, ctx, mesh: impl.fully_shard(nn.Linear(5, 3), mesh=mesh, **(
            {"placements": None} if _TORCH_HAS_DP_MESH_DIMS else {"dp_mesh_dims": None})),
        ("same", ["unexpected keyword argument"], [])),
    "set_reshard_after_forward_str": (
        lambda impl, ctx, mesh: _sharded_pair(impl, mesh).set_reshard_after_forward("yes"),
        ("same", ["reshard_after_forward"], [])),
    "deepcopy": (lambda impl, ctx, mesh: copy.deepcopy(_sharded_pair(impl, mesh)), ("same", ["deepcopy"], [])),
    "all_reduce_hook_stream_with_hsdp": (_hsdp_hook_stream, ("same", ["HSDP"], [])),
    "two_roots_in_one_call": (_two_roots, ("same", ["single root"], [])),
    "unit_forward_before_root": (_unit_ran_first, ("same", ["lazily initialized"], [])),
}


@h.subtest(grid={"case": list(BAD_INPUT)})
def bad_input(ctx, case: str):
    call, expect = BAD_INPUT[case]
    mesh = mesh_1d(ctx)
    t_exc = raised(lambda: call(TORCH, ctx, mesh))
    c_exc = raised(lambda: call(CFSDP, ctx, mesh))
    c_msg = "" if c_exc is None else str(c_exc)
    if expect[0] == "same":
        _, needles, cfsdp_needles, *rest = expect
        stable = rest[0] if rest else (lambda msg: msg)
        if t_exc is None:
            raise AssertionError(f"torch did not raise for {case}: the expectation is out of date")
        for n in needles:
            if n.lower() not in str(t_exc).lower():
                raise AssertionError(f"torch's message does not contain {n!r}: {t_exc}")
        if c_exc is None:
            raise AssertionError(f"cfsdp did not raise; torch raises {type(t_exc).__name__}: {t_exc}")
        if not isinstance(c_exc, type(t_exc)):
            raise AssertionError(f"cfsdp raised {type(c_exc).__name__}: {c_msg}; torch raises "
                                 f"{type(t_exc).__name__}: {t_exc}")
        if stable(str(t_exc)) not in stable(c_msg):
            raise AssertionError(f"cfsdp's message does not contain torch's.\n  torch: {t_exc}\n  cfsdp: {c_msg}")
        missing = [n for n in needles + ([] if SELFTEST else cfsdp_needles) if n.lower() not in c_msg.lower()]
        if missing:
            raise AssertionError(f"cfsdp's message does not name {missing}: {c_msg}")
        return
    _, types, needles, torch_raises = expect
    if SELFTEST:
        # torch in the cfsdp seat: only the recorded torch behaviour can be checked
        if type(t_exc) is not (torch_raises or type(None)):
            raise AssertionError(f"torch's behaviour for {case} is not the recorded one "
                                 f"({torch_raises}): {t_exc!r}")
        ctx.log(f"self-test: torch gives {t_exc!r} for {case} (cfsdp must raise {types})")
        return
    if c_exc is None or not isinstance(c_exc, types):
        raise AssertionError(f"cfsdp {'did not raise' if c_exc is None else f'raised {type(c_exc).__name__}: {c_msg}'}"
                             f"; expected one of {[t.__name__ for t in types]} at fully_shard time "
                             f"(torch: {'no check' if t_exc is None else repr(t_exc)})")
    missing = [n for n in needles if n.lower() not in c_msg.lower()]
    if missing:
        raise AssertionError(f"cfsdp's message does not name {missing}: {c_msg}")


@h.subtest
def optimizer_built_before_fully_shard(ctx):
    """fully_shard replaces the parameters by DTensor ones: an optimizer over the old ones would
    train nothing (torch's FSDP2 lets it, silently).  cfsdp's step raises naming the FQN."""
    if SELFTEST:
        return
    x, y = batches("mlp", 1, ctx.world_size)[0][0][ctx.rank]
    # the optimizer's first parameter in the root's unit, then in a block's (a unit sharded
    # before the root: it knows it as 'lin.weight'); the error names it as the model does
    for first in ("in_proj.weight", "blocks.1.lin.weight"):
        model = build("mlp")
        params = dict(model.named_parameters())
        opt = torch.optim.SGD([params[first]] + [p for n, p in params.items() if n != first],
                              lr=0.1)
        shard(CFSDP, model, mesh_1d(ctx), {}, {})
        loss_fn("mlp", model(x), y).backward()
        err = raised(opt.step)
        if (not isinstance(err, RuntimeError) or f"'{first}'" not in str(err)
                or "after fully_shard" not in str(err)):
            raise AssertionError(f"expected a RuntimeError naming {first!r} and saying to build "
                                 f"the optimizer after fully_shard, got {err!r}")
    # the supported order steps
    model = build("mlp")
    shard(CFSDP, model, mesh_1d(ctx), {}, {})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn("mlp", model(x), y).backward()
    opt.step()


@h.subtest
def optimizer_before_load_assign(ctx):
    """load_state_dict(assign=True) puts new parameter objects in the modules; the units adopt
    them (as torch's FSDP2 does), so an optimizer built before the load holds objects nothing
    uses: torch trains nothing, silently; cfsdp's step raises naming the FQN.  An optimizer
    built after the load trains as torch's."""
    if SELFTEST:
        return
    mesh = mesh_1d(ctx)
    data = batches("mlp", 2, ctx.world_size)
    losses = {}
    for impl in (TORCH, CFSDP):
        src = make_model(impl, Scenario(), mesh, seed=1)
        sd = {k: v.detach().clone() if not isinstance(v, DTensor) else
              DTensor.from_local(v.to_local().clone(), v.device_mesh, v.placements, run_check=False,
                                 shape=v.shape, stride=v.stride())
              for k, v in src.state_dict().items()}
        model = make_model(impl, Scenario(), mesh)
        stale = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model.load_state_dict(sd, assign=True)
        if impl is CFSDP:
            x, y = data[0][0][ctx.rank]
            loss_fn("mlp", model(x), y).backward()
            err = raised(stale.step)
            names = [n for n, _ in build("mlp").named_parameters()]
            if (not isinstance(err, RuntimeError) or "after loading" not in str(err)
                    or not any(f"'{n}'" in str(err) for n in names)):
                raise AssertionError(f"a step of the optimizer built before load_state_dict(assign=True) "
                                     f"gave {err!r}, expected a RuntimeError naming the parameter")
            model.zero_grad(set_to_none=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[impl.name] = run_steps(impl, Scenario(), model, opt, data, ctx.rank, [])
    mm = pc.Mismatches(ctx)
    for i, (a, b) in enumerate(zip(losses["cfsdp"], losses["torch"])):
        mm.tensors(f"loss #{i} after load_state_dict(assign=True)", a, b)
    mm.raise_if_any()


@h.subtest
def tied_across_units(ctx):
    """A weight tied across two fully_shard calls (embedding and output head in different
    units) would come untied; torch refuses it at the first forward, and so does cfsdp, with
    torch's message (then naming the other parameter).  torch 2.11 does not check it (the
    forward runs, the weight then trains as two): cfsdp refuses it there too, with 2.13's
    message."""
    errs = {}
    for impl in (TORCH, CFSDP):
        model = build("lm1")
        impl.fully_shard(model.tok, mesh=mesh_1d(ctx))
        impl.fully_shard(model.head, mesh=mesh_1d(ctx))
        impl.fully_shard(model, mesh=mesh_1d(ctx))
        x, _ = batches("lm1", 1, ctx.world_size)[0][0][ctx.rank]
        errs[impl.name] = raised(lambda: model(x))
    t, c = errs["torch"], errs["cfsdp"]
    if not _TORCH_REFUSES_TIED_ACROSS_UNITS and not SELFTEST:
        if t is not None:
            raise AssertionError(f"torch 2.11's behaviour changed: {t!r}")
        if not isinstance(c, ValueError) or "already managed by another FSDP group" not in str(c) \
                or "tok.weight" not in str(c):
            raise AssertionError(f"cfsdp gave {c!r}; expected its ValueError naming tok.weight")
        return
    if not isinstance(t, ValueError) or "already managed by another FSDP group" not in str(t):
        raise AssertionError(f"torch's behaviour changed: {t!r}")
    if not isinstance(c, ValueError) or str(t) not in str(c):
        raise AssertionError(f"cfsdp gave {c!r}; torch {t!r} (its message must be contained)")
    if not SELFTEST and "tok.weight" not in str(c):
        raise AssertionError(f"cfsdp's message does not name the other parameter: {c}")


@h.subtest
def broadcast_from_rank0_wrong_shape(ctx):
    """set_model_state_dict(broadcast_from_rank0=True) with a wrongly shaped entry on rank 0:
    every rank raises naming the entry (torch fails in a copy, naming nothing), nothing loads."""
    if SELFTEST:
        return
    model = make_model(CFSDP, Scenario(), mesh_1d(ctx))
    before = {n: local(p).clone() for n, p in model.named_parameters()}
    full = build("mlp", seed=1).state_dict()
    full["blocks.1.lin.weight"] = torch.zeros(4, 4)
    err = raised(lambda: set_model_state_dict(
        model, full if ctx.rank == 0 else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)))
    if not isinstance(err, RuntimeError) or "size mismatch for blocks.1.lin.weight" not in str(err):
        raise AssertionError(f"expected a RuntimeError naming blocks.1.lin.weight, got {err!r}")
    for n, p in model.named_parameters():
        if not torch.equal(local(p), before[n]):
            raise AssertionError(f"'{n}' changed although the load was refused")


class PlainMLP(nn.Module):
    """Parameters only (no buffers): a model a rank-0 checkpoint can be broadcast into."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(7, 9)
        self.blocks = nn.ModuleList(MLPBlock(9) for _ in range(2))
        self.out = nn.Linear(9, 3)

    def forward(self, x):
        h = torch.tanh(self.in_proj(x))
        for b in self.blocks:
            h = b(h)
        return self.out(h)


@h.subtest
def meta_init_rank0_broadcast_assign(ctx):
    """torch's recipe (test_rank0_broadcast_meta_device_init): fully_shard on the meta device,
    then load_state_dict(assign=True) of DTensors distribute_tensor builds from rank 0's
    broadcast full tensors; then train.  Same parameters and losses as torch's FSDP2."""
    mesh = mesh_1d(ctx)
    full = {}
    if ctx.rank == 0:
        torch.manual_seed(42)
        full = PlainMLP().state_dict()
    data = batches("mlp", 3, ctx.world_size)
    runs = {}
    for impl in (TORCH, CFSDP):
        with torch.device("meta"):
            model = PlainMLP()
        for b in model.blocks:
            impl.fully_shard(b, mesh=mesh)
        impl.fully_shard(model, mesh=mesh)
        sharded = {}
        for name, meta in model.state_dict().items():
            t = full[name].detach().clone() if ctx.rank == 0 else torch.empty(meta.size(), dtype=meta.dtype)
            dist.broadcast(t, src=0)
            sharded[name] = nn.Parameter(distribute_tensor(t, meta.device_mesh, meta.placements))
        model.load_state_dict(sharded, assign=True)
        bad = [n for n, p in model.named_parameters() if not isinstance(p, DTensor) or p.device.type != "cpu"]
        if bad:
            raise AssertionError(f"{impl.name}: parameters not materialised DTensors after the load: {bad}")
        opt = pc.make_optim("adamw", model.parameters())
        losses = run_steps(impl, Scenario(), model, opt, data, ctx.rank, [])
        runs[impl.name] = (losses, {n: local(p).detach().clone() for n, p in model.named_parameters()})
    mm = pc.Mismatches(ctx)
    for i, (a, b) in enumerate(zip(runs["cfsdp"][0], runs["torch"][0])):
        mm.tensors(f"loss #{i}", a, b)
    for n, v in runs["torch"][1].items():
        mm.tensors(f"local param {n} after training", runs["cfsdp"][1].get(n), v)
    mm.raise_if_any()


@h.subtest
def meta_params_left_are_named(ctx):
    """A forward with parameters still on the meta device: torch's RuntimeError, naming every
    one of them by FQN under the root (cfsdp's message contains torch's)."""
    msgs = {}
    for impl in (TORCH, CFSDP):
        with torch.device("meta"):
            model = PlainMLP()
        for b in model.blocks:
            impl.fully_shard(b, mesh=mesh_1d(ctx))
        impl.fully_shard(model, mesh=mesh_1d(ctx))
        msgs[impl.name] = str(raised(lambda: model(torch.randn(2, 7))))
    t = msgs["torch"]
    if "still on meta device" not in t or msgs["cfsdp"] != t and t not in msgs["cfsdp"]:
        raise AssertionError(f"torch: {t}\ncfsdp: {msgs['cfsdp']}")


@h.subtest
def state_per_call(ctx):
    """fully_shard.state(module): one state object per call, shared by its modules; None for
    a module no call was given (torch's composable contract)."""
    for impl in (TORCH, CFSDP):
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3))
        impl.fully_shard([model[0], model[1]], mesh=mesh_1d(ctx))
        impl.fully_shard(model, mesh=mesh_1d(ctx))
        st = impl.fully_shard.state
        if not (st(model[0]) is st(model[1]) and st(model) is not st(model[0])
                and st(model) is not None and st(model[2]) is None):
            raise AssertionError(f"{impl.name}: states {st(model[0])}, {st(model[1])}, "
                                 f"{st(model)}, {st(model[2])}")


@h.subtest
def replicate_child_stays_replicated(ctx):
    """A child given to torch's replicate() (DDP) under a fully_shard parent is left alone by
    the parent's unit, as torch does: its parameters stay plain, DDP all-reduces them, and
    training matches torch's FSDP2 + replicate bit for bit."""
    from torch.distributed._composable.replicate import replicate

    data = batches("mlp", 3, ctx.world_size)
    runs = {}
    for impl in (TORCH, CFSDP):
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 3))
        replicate(model[0])
        impl.fully_shard(model[2], mesh=mesh_1d(ctx))
        impl.fully_shard(model, mesh=mesh_1d(ctx))
        if isinstance(model[0].weight, DTensor):
            raise AssertionError(f"{impl.name}: the replicated child's weight became a DTensor")
        opt = pc.make_optim("sgd", model.parameters())
        runs[impl.name] = run_steps(impl, Scenario(), model, opt, data, ctx.rank, [])
    mm = pc.Mismatches(ctx)
    for i, (a, b) in enumerate(zip(runs["cfsdp"], runs["torch"])):
        mm.tensors(f"loss #{i}", a, b)
    mm.raise_if_any()


@h.subtest
def all_reduce_hook_stream(ctx):
    """set_all_reduce_hook(hook, stream=s): the hook runs with s as the current stream."""
    used = {}
    for impl in (TORCH, CFSDP):
        model = impl.fully_shard(nn.Linear(4, 4), mesh=mesh_1d(ctx))
        s = torch.cpu.Stream()
        seen = []
        model.set_all_reduce_hook(lambda out: seen.append(torch.cpu.current_stream()), stream=s)
        model(torch.randn(2, 4)).sum().backward()
        used[impl.name] = bool(seen) and seen[0] == s
    if used["torch"] and not used["cfsdp"]:
        raise AssertionError(f"the hook did not run on the given stream: {used}")


@h.subtest(grid={"when": ["before_training", "between_steps"]})
def to_dtype(ctx, when: str):
    """model.to(torch.float64) after fully_shard: the units follow module._apply (new shard
    dtype, forward and gradients in float64), the optimizer built after the cast.  Before the
    first forward: bit for bit torch's FSDP2.  Between training steps torch 2.13 fails at the
    next forward ("Expected out tensor to have dtype double, but got float"), so the oracle is
    the single process cast at the same step (fp64 from there on: rtol 1e-6)."""
    cast_at = 0 if when == "before_training" else 2
    data = batches("mlp", 4, ctx.world_size)

    def run(model, shard):
        if shard is not None:
            for b in model.blocks:
                shard(b, mesh=mesh_1d(ctx))
            shard(model, mesh=mesh_1d(ctx))
        opt, losses = None, []
        for step, step_data in enumerate(data):
            if step == cast_at:
                model.to(torch.float64)
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
            if opt is None:
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
            dt = next(model.parameters()).dtype
            if shard is None:  # the single process: every rank's chunk, mean loss
                loss = sum(loss_fn("mlp", model(x.to(dt)), y.to(dt)) for x, y in step_data[0])
                loss = loss / ctx.world_size
            else:
                x, y = step_data[0][ctx.rank]
                loss = loss_fn("mlp", model(x.to(dt)), y.to(dt))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses, [(p.full_tensor() if isinstance(p, DTensor) else p).detach() for p in model.parameters()]

    mm = pc.Mismatches(ctx)
    got = run(build("mlp"), CFSDP.fully_shard)
    if when == "before_training":
        want = run(build("mlp"), TORCH.fully_shard)
        for i, (a, b) in enumerate(zip(got[0], want[0])):
            mm.tensors(f"loss #{i}", a, b)
        for i, (a, b) in enumerate(zip(got[1], want[1])):
            mm.tensors(f"parameter #{i} after training", a, b)
    else:
        err = raised(lambda: run(build("mlp"), TORCH.fully_shard))
        mm.check(err is not None and "dtype double" in str(err),
                 f"torch's FSDP2 now handles .to(float64) between steps ({err!r}): use it as the oracle")
        ref = run(build("mlp"), None)
        for i, (a, b) in enumerate(zip(got[1], ref[1])):
            mm.check(a.dtype == torch.float64, f"parameter #{i} is {a.dtype}")
            mm.tensors(f"parameter #{i} vs the single process", a, b, exact=False, b_name="ref",
                       rtol=1e-6, atol=1e-7)
    mm.raise_if_any()


@h.subtest(grid={"face": ["fully_shard", "hsdp_shard1", "wrapper"]})
def one_rank_no_collectives(ctx, face: str):
    """Groups of one rank issue no collective (torch's FSDP2 skips its all-gather and
    reduce-scatter at world size 1), counted by torch's CommDebugMode over a training step (the second):
    fully_shard on a one-rank mesh (torch's count, none, is the oracle; losses and gradients
    bitwise as torch's), the shard dim of an HSDP mesh of one rank per shard group (only the
    replicate all-reduces, as torch's), and the wrapper on a one-rank process group, built
    under the mode with sync_module_states (none; torch's FSDP1 all-reduces there, it is not
    the oracle here)."""
    from torch.distributed.tensor.debug import CommDebugMode

    W = ctx.world_size
    solo = [dist.new_group([r], backend="gloo", timeout=h.PG_TIMEOUT) for r in range(W)][ctx.rank]
    if face == "hsdp_shard1":
        rep = dist.new_group(list(range(W)), backend="gloo", timeout=h.PG_TIMEOUT)
        mesh = DeviceMesh.from_group([rep, solo], "cpu", mesh=torch.arange(W).view(W, 1),
                                     mesh_dim_names=("replicate", "shard"))
        data = batches("mlp", 2, W)
        rows = lambda step: step[0][ctx.rank]  # noqa: E731 - each replica its own rows
    else:
        mesh = DeviceMesh.from_group(solo, "cpu")
        data = batches("mlp", 2, 1)
        rows = lambda step: step[0][0]  # noqa: E731
    out = {}
    for impl in ((TORCH, CFSDP) if face != "wrapper" else (CFSDP,)):
        model = build("mlp")
        with CommDebugMode() as build_mode:  # (a module built under the mode breaks its tracker)
            if face == "wrapper":
                model = cfsdp.FullyShardedDataParallel(
                    model, process_group=solo, sync_module_states=True,
                    auto_wrap_policy=pc.ModuleWrapPolicy({MLPBlock}))
            else:
                for b in model.blocks:
                    impl.fully_shard(b, mesh=mesh)
                impl.fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for i, step in enumerate(data):
            # the second step under the mode (its module tracker fails on a first forward,
            # torch's fully_shard's too: collectives_visible does the same)
            with CommDebugMode() if i else contextlib.nullcontext() as mode:
                x, y = rows(step)
                loss = loss_fn("mlp", model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
        counts = {str(k): v for m in (build_mode, mode) for k, v in m.get_comm_counts().items() if v}
        out[impl.name] = (counts, losses,
                          [p.to_local().detach().clone() if isinstance(p, DTensor) else p.detach().clone()
                           for p in model.parameters()])
    mm = pc.Mismatches(ctx)
    counts = out["cfsdp"][0]
    if face == "wrapper":
        mm.check(not counts, f"the wrapper on a one-rank group issued collectives: {counts}")
    else:
        mm.check(counts == out["torch"][0], f"CommDebugMode counts: cfsdp {counts}, torch "
                 f"{out['torch'][0]}")
        mm.check(bool(counts) == (face == "hsdp_shard1"), f"counts {counts} on {face}")
        for i, (a, b) in enumerate(zip(out["cfsdp"][1], out["torch"][1])):
            mm.tensors(f"loss #{i}", a, b)
        for i, (a, b) in enumerate(zip(out["cfsdp"][2], out["torch"][2])):
            mm.tensors(f"parameter #{i}", a, b)
    mm.raise_if_any()


@h.subtest(grid={"face": ["fully_shard", "wrapper"]})
def collectives_visible(ctx, face: str):
    """torch's CommDebugMode counts cfsdp's collectives of a training step under the same ops
    and numbers as torch's FSDP's (the default transport is shared memory, which a dispatch
    mode cannot see: while one is active cfsdp takes the process group), and the profiler
    shows them as cfsdp::<collective> ranges, on shared memory too."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.profiler import ProfilerActivity, profile

    from cfsdp._runtime import comm

    x, y = batches("mlp", 1, ctx.world_size)[0][0][ctx.rank]

    def build_face(impl):
        model = build("mlp")
        if face == "fully_shard":
            for b in model.blocks:
                impl.fully_shard(b, mesh=mesh_1d(ctx))
            return impl.fully_shard(model, mesh=mesh_1d(ctx))
        cls = torch_fsdp.FullyShardedDataParallel if impl is TORCH else cfsdp.FullyShardedDataParallel
        return cls(model, process_group=ctx.pg, device_id=torch.device("cpu"),
                   auto_wrap_policy=pc.ModuleWrapPolicy({MLPBlock}))

    counts = {}
    for impl in (TORCH, CFSDP):
        model = build_face(impl)
        loss_fn("mlp", model(x), y).backward()  # a first step outside the mode
        with CommDebugMode() as mode:
            loss_fn("mlp", model(x), y).backward()
        # torch's FSDP1 all-gathers CPU tensors through the list form (c10d.allgather_),
        # cfsdp through the tensor form (c10d._allgather_base_, as FSDP2): the same
        # collective, counted here by kind for the wrapper face
        kind = (lambda k: k.replace("c10d.allgather_", "c10d._allgather_base_")) \
            if face == "wrapper" else (lambda k: k)
        counts[impl.name] = {kind(str(k)): v for k, v in mode.get_comm_counts().items()}
    if counts["cfsdp"] != counts["torch"] or not counts["torch"]:
        raise AssertionError(f"CommDebugMode counts: cfsdp {counts['cfsdp']}, torch {counts['torch']}")
    model = build_face(CFSDP)
    loss_fn("mlp", model(x), y).backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_fn("mlp", model(x), y).backward()
    names = {e.name for e in prof.events()}
    want = {"cfsdp::all_gather_unpack", "cfsdp::reduce_scatter_pack"} if face == "fully_shard" else \
        {"cfsdp::all_gather", "cfsdp::reduce_scatter"}
    if not want <= names:
        raise AssertionError(f"profiler ranges {sorted(n for n in names if n.startswith('cfsdp'))}, "
                             f"want {sorted(want)} (shared memory in use: {comm.uses_shm(ctx.pg)})")


class TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3).double()

    def forward(self, x):
        return self.a(x) + self.b(x.double()).float()


class FrozenOtherDtypes(nn.Module):
    """torch's test_mixed_dtypes_no_grad_param, trained: frozen float8 and int64 parameters
    beside trainable fp32 ones, in one fully_shard call."""

    def __init__(self):
        super().__init__()
        self.w_fp8 = nn.Parameter(torch.randn(8, 7).to(torch.float8_e4m3fn), requires_grad=False)
        self.count = nn.Parameter(torch.arange(5, dtype=torch.int64), requires_grad=False)
        self.lin = nn.Linear(7, 3)

    def forward(self, x):
        return self.lin(x @ self.w_fp8.float().T[:7, :7] * 0.01) + self.count.sum().float() * 1e-3


@h.subtest
def mixed_dtypes_frozen(ctx):
    """One call over float8 and int64 (frozen) and fp32 (trainable) parameters: bit for bit
    torch's FSDP2 (which all-gathers the dtypes' bytes together; cfsdp per dtype).  torch 2.11's
    FSDP2 cannot shard the int64 parameter (its sharded ``nn.Parameter`` of a DTensor raises
    "only Tensors of floating point dtype can require gradients"; 2.13 shards it): there the
    oracle is torch's FSDP2 with that parameter in ``ignored_params`` (the same forward; its
    full value is compared with cfsdp's gathered one)."""
    data = batches("mlp", 3, ctx.world_size)
    runs = {}
    ignored = False
    for impl in (TORCH, CFSDP):
        torch.manual_seed(0)
        model = FrozenOtherDtypes()
        state = torch.random.get_rng_state()
        err = raised(lambda: impl.fully_shard(model, mesh=mesh_1d(ctx)))
        if err is not None:
            if impl is not TORCH or _TORCH_SHARDS_INT_PARAMS or "floating point dtype" not in str(err):
                raise AssertionError(f"{impl.name}'s fully_shard raised {err!r}")
            torch.manual_seed(0)
            model = FrozenOtherDtypes()
            impl.fully_shard(model, mesh=mesh_1d(ctx), ignored_params={model.count})
            ignored = True
        elif impl is TORCH and not _TORCH_SHARDS_INT_PARAMS:
            raise AssertionError("torch's FSDP2 now shards an int64 parameter: update the expectation")
        torch.random.set_rng_state(state)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
        losses = run_steps(impl, Scenario(), model, opt, data, ctx.rank, [])
        runs[impl.name] = (losses, {n: (p.full_tensor() if ignored and n == "count" and isinstance(p, DTensor) else local(p)).detach().clone()
                                    for n, p in model.named_parameters()})
    mm = pc.Mismatches(ctx)
    for i, (a, b) in enumerate(zip(runs["cfsdp"][0], runs["torch"][0])):
        mm.tensors(f"loss #{i}", a, b)
    for n, v in runs["torch"][1].items():
        c = runs["cfsdp"][1].get(n)
        mm.check(c is not None and c.dtype == v.dtype and torch.equal(c.view(torch.uint8), v.view(torch.uint8)),
                 f"local {n} after training differs from torch's")
    mm.raise_if_any()


@h.subtest
def mixed_dtypes_trainable(ctx):
    """Trainable fp32 and fp64 parameters in one call: torch's FSDP2 refuses them at the first
    backward ("FSDP expects uniform original parameter dtype"); cfsdp reduces each dtype's
    gradients.  Oracle: the single process."""
    data = batches("mlp", 3, ctx.world_size)
    torch.manual_seed(0)
    ref = TwoDtypes()
    model = copy.deepcopy(ref)
    CFSDP.fully_shard(model, mesh=mesh_1d(ctx))
    t_err = raised(lambda: run_steps(TORCH, Scenario(), TORCH.fully_shard(
        copy.deepcopy(ref), mesh=mesh_1d(ctx)), torch.optim.SGD(ref.parameters(), lr=0.05),
        data[:1], ctx.rank, []))
    mm = pc.Mismatches(ctx)
    mm.check(t_err is not None and "uniform original parameter dtype" in str(t_err),
             f"torch FSDP2 now trains mixed dtypes ({t_err!r}): use it as the oracle")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step_data in data:
        x, y = step_data[0][ctx.rank][0][:, :3], step_data[0][ctx.rank][1]
        loss = loss_fn("mlp", model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = sum(loss_fn("mlp", ref(xr[:, :3]), yr) for xr, yr in step_data[0]) / ctx.world_size
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        mm.check(p.dtype == q.dtype, f"{n}: dtype {p.dtype}, the module's {q.dtype}")
        mm.tensors(f"{n} vs the single process", p.full_tensor(), q.detach(), exact=False, b_name="ref")
    mm.raise_if_any()
