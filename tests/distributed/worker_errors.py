"""Bad input to cfsdp.FullyShardedDataParallel: the right exception type, a message naming the thing.

Run by tests/distributed/test_errors.py under torchrun (gloo, W=2). Each case is a subtest.

``SAME_AS_TORCH`` is the wrapper face's table of every input torch's FSDP1 rejects with a
deliberate error (the rule of issue 15: users' and torch's tests match torch's messages by
regex): each case runs torch's FSDP1 and cfsdp on the same input and requires (a) cfsdp's
exception to be an instance of torch's type, (b) torch's message, verbatim, inside cfsdp's
(cfsdp adds ``(cfsdp: ...)`` with the FQN and what to do), (c) cfsdp's message to name the
FQNs listed.  The other subtests cover what torch does not check, or checks by accident
(an AttributeError deep inside, a hang), where cfsdp's own message is the contract.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._comm_hooks import default_hooks
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import _harness as h
import cfsdp
from cfsdp import (
    CPUOffload,
    FullyShardedDataParallel as CFSDP,
    ShardingStrategy,
)

CPU = torch.device("cpu")


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.inner_unit = Inner()
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.proj(self.encoder.inner_unit(x))


class StrayModule(nn.Linear):
    """Not part of any model here: only ever passed as a (wrong) ignored module."""


class Failures:
    def __init__(self, ctx: h.Context):
        self.ctx = ctx
        self.items: list[str] = []

    def expect(self, who: str, exc: type[BaseException], fn: Callable[[], Any], *needles: str) -> None:
        """``fn()`` must raise ``exc`` (or a subclass) whose message contains every needle."""
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            msg = str(e)
            if not isinstance(e, exc):
                self.items.append(f"{who}: expected {exc.__name__}, got {type(e).__name__}: {msg}")
                return
            missing = [n for n in needles if n not in msg]
            if missing:
                self.items.append(f"{who}: {type(e).__name__} message does not mention {missing}: {msg!r}")
            return
        self.items.append(f"{who}: expected {exc.__name__}, nothing was raised")

    def same(self, case: str, call: Callable[[type], Any], *fqns: str,
             stable: Callable[[str], str] = lambda msg: msg) -> None:
        """torch's FSDP1 rejects ``call(TorchFSDP)``; ``call(CFSDP)`` must raise an instance
        of torch's exception type whose message contains torch's verbatim and names every
        one of ``fqns``.  ``stable`` picks the part of both messages to compare, only where
        torch's holds what cfsdp cannot repeat (object addresses); none does here."""
        theirs, ours = _raised(lambda: call(TorchFSDP)), _raised(lambda: call(CFSDP))
        if theirs is None:
            self.items.append(f"{case}: torch did not raise: the expectation is out of date")
            return
        if ours is None:
            self.items.append(f"{case}: cfsdp did not raise; torch raises {type(theirs).__name__}: {theirs}")
            return
        if not isinstance(ours, type(theirs)):
            self.items.append(f"{case}: cfsdp raised {type(ours).__name__} ({ours}), not an instance of "
                              f"torch's {type(theirs).__name__} ({theirs})")
        if stable(str(theirs)) not in stable(str(ours)):
            self.items.append(f"{case}: cfsdp's message does not contain torch's.\n    torch: "
                              f"{theirs!s}\n    cfsdp: {ours!s}")
        missing = [n for n in fqns if n not in str(ours)]
        if missing:
            self.items.append(f"{case}: cfsdp's message does not name {missing}: {ours}")

    def ok(self, who: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            self.items.append(f"{who}: expected no error, got {type(e).__name__}: {e}")

    def raise_if_any(self) -> None:
        if self.items:
            raise AssertionError(f"{len(self.items)} problem(s) on rank {self.ctx.rank}:\n  "
                                 + "\n  ".join(self.items))


def _raised(fn: Callable[[], Any]) -> Optional[BaseException]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the exception is the result
        return e
    return None


def kw(ctx, **extra) -> dict:
    d = dict(process_group=ctx.pg, device_id=CPU)
    d.update(extra)
    return d


# --------------------------------------------------------------------------------------------


@h.subtest(grid={"device_id": ["cuda", "cuda:0"]})
def cuda_device_id_without_cuda(ctx, device_id):
    """device_id=cuda on this CPU-only machine -> ValueError naming device_id."""
    f = Failures(ctx)
    assert not torch.cuda.is_available(), "this case needs a machine without CUDA"
    f.expect("cfsdp", ValueError, lambda: CFSDP(Net(), process_group=ctx.pg,
                                                  device_id=torch.device(device_id)), "device_id")
    f.raise_if_any()


@h.subtest
def ignored_modules_not_a_submodule(ctx):
    f = Failures(ctx)
    f.expect("cfsdp", ValueError,
             lambda: CFSDP(Net(), ignored_modules=[StrayModule(2, 2)], **kw(ctx)), "StrayModule")
    f.raise_if_any()


@h.subtest
def ignored_modules_non_module_entry(ctx):
    """A non-Module entry -> torch's ValueError.

    torch 2.13 raises TypeError for a non-iterable ``ignored_modules`` (checked on both) but
    ValueError for a non-Module *entry* (``_check_ignored_states`` runs first); cfsdp raises
    ``WrongTypeError``, a ValueError, so code catching torch's ValueError still works.
    """
    f = Failures(ctx)
    for exc in (ValueError,):
        m = Net()
        f.expect(f"cfsdp [str entry, {exc.__name__}]", exc,
                 lambda: CFSDP(m, ignored_modules=["proj"], **kw(ctx)), "entry 0")
        m = Net()
        f.expect(f"cfsdp [Parameter entry, {exc.__name__}]", exc,
                 lambda: CFSDP(m, ignored_modules=[m.proj.weight], **kw(ctx)), "entry 0")
    for who, wrapper in (("torch", TorchFSDP), ("cfsdp", CFSDP)):
        m = Net()
        f.expect(f"{who} [not iterable]", TypeError, lambda: wrapper(m, ignored_modules=5, **kw(ctx)))
    f.raise_if_any()


@h.subtest
def device_id_spellings(ctx):
    """Every spelling of the CPU as device_id wraps and trains as device_id=None (torch's FSDP1
    rejects "cpu:0", which accelerate passes)."""
    f = Failures(ctx)
    results = {}
    for dev in (None, "cpu", "cpu:0", torch.device("cpu"), torch.device("cpu", 0)):
        torch.manual_seed(0)
        model = CFSDP(Net(), process_group=ctx.pg, device_id=dev)
        if model.compute_device != torch.device("cpu"):
            f.items.append(f"device_id={dev!r}: compute_device {model.compute_device}")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1 + ctx.rank)
        loss = model(torch.randn(2, 4)).square().sum()
        loss.backward()
        opt.step()
        results[str(dev)] = (loss.item(), [p.detach().clone() for p in model.parameters()])
    want = results["None"]
    for dev, (loss, params) in results.items():
        if loss != want[0] or not all(torch.equal(a, b) for a, b in zip(params, want[1])):
            f.items.append(f"device_id={dev}: trains differently from device_id=None")
    f.raise_if_any()


def tp_model(ctx):
    """A model whose Linear layers went through torch's tensor parallelism (DTensor parameters)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("tp",))
    return parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


@h.subtest(grid={"face": ["wrapper", "fully_shard"]})
def tensor_parallel_parameters(ctx, face: str):
    """DTensor parameters on a TP mesh that is not a slice of the data-parallel mesh's root never
    reach the C core: an error at wrap time names the first one and says which meshes to pass.

    The wrapper given process_group= (not device_mesh=mesh['dp']) refuses with
    NotImplementedError; fully_shard on an unrelated mesh fails as torch's does ("Invariant
    encountered", a TypeError deep in torch's FSDP2) but with the FQN and the fix.
    """
    f = Failures(ctx)
    if face == "wrapper":
        f.expect("cfsdp", NotImplementedError, lambda: CFSDP(tp_model(ctx), process_group=ctx.pg),
                 "'0.weight'", "DTensor", "device_mesh=mesh['dp']")
    else:
        f.expect("cfsdp", ValueError, lambda: cfsdp.fully_shard(tp_model(ctx)),
                 "'0.weight'", "Invariant encountered", "one DeviceMesh")
    f.raise_if_any()


@h.subtest(grid={"inner_wrapped_first": [False, True]})
def optimizer_built_before_wrapping(ctx, inner_wrapped_first):
    """use_orig_params=False replaces the parameters: an optimizer over the old ones is stale.

    The step must fail loudly (RuntimeError naming the stale parameter's FQN in the model
    and saying to build the optimizer after wrapping), never silently update parameters FSDP
    no longer uses.  ``inner_wrapped_first``: the unit holding the first parameter is
    wrapped on its own before the root (it names it 'lin.weight'; the model, and the error,
    'encoder.inner_unit.lin.weight').
    """
    f = Failures(ctx)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    first = next(n for n, _ in m.named_parameters())
    if inner_wrapped_first:
        m.encoder.inner_unit = CFSDP(m.encoder.inner_unit, use_orig_params=False, **kw(ctx))
    model = CFSDP(m, use_orig_params=False, **kw(ctx))
    model(torch.randn(2, 4)).sum().backward()
    try:
        opt.step()
    except RuntimeError as e:
        msg = str(e)
        if f"'{first}'" not in msg:
            f.items.append(f"cfsdp: RuntimeError does not name the first stale FQN {first!r}: "
                           f"{msg!r}")
        if not re.search(r"after\b.*wrap", msg, flags=re.IGNORECASE | re.DOTALL):
            f.items.append(f"cfsdp: RuntimeError does not say to build the optimizer after wrapping: {msg!r}")
    except BaseException as e:  # noqa: BLE001
        f.items.append(f"cfsdp: expected RuntimeError at optimizer.step(), got {type(e).__name__}: {e}")
    else:
        f.items.append("cfsdp: optimizer.step() over pre-wrapping parameters did not raise")
    f.raise_if_any()


@h.subtest
def optimizer_built_after_wrapping_is_fine(ctx):
    """The counterpart of the case above: the supported order steps without error."""
    f = Failures(ctx)
    model = CFSDP(Net(), use_orig_params=False, **kw(ctx))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    f.ok("cfsdp", opt.step)
    f.raise_if_any()


@h.subtest
def unsupported_arguments(ctx):
    """Arguments of the wrong type are named before any communication; supported values
    are accepted."""
    f = Failures(ctx)
    f.expect("cfsdp [mixed_precision]", TypeError,
             lambda: CFSDP(Net(), mixed_precision="bf16", **kw(ctx)), "mixed_precision")
    f.expect("cfsdp [param_init_fn]", ValueError,
             lambda: CFSDP(Net(), param_init_fn=3, **kw(ctx)), "param_init_fn")
    f.ok("cfsdp [cpu_offload=CPUOffload(offload_params=False)]",
         lambda: CFSDP(Net(), cpu_offload=CPUOffload(offload_params=False), **kw(ctx)))
    f.ok("cfsdp [sharding_strategy=FULL_SHARD, mixed_precision=None]",
         lambda: CFSDP(Net(), sharding_strategy=ShardingStrategy.FULL_SHARD, mixed_precision=None, **kw(ctx)))
    f.raise_if_any()


# --------------------------------------------------------------------------------------------
# SAME_AS_TORCH: every input torch's FSDP1 rejects on purpose, run through both
# --------------------------------------------------------------------------------------------

SF, SS_, SL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT


class NetBN(Net):
    """Net with a BatchNorm (parameters and buffers) in the root unit."""

    def __init__(self):
        super().__init__()
        self.encoder.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.proj(self.encoder.norm(self.encoder.inner_unit(x)))


class Gained(nn.Module):
    """A unit with a 0-dim parameter (torch's FSDP1 names it relative to the unit)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.tensor(2.0))


def nested(ctx, F, uop: bool = False, model: Callable[[], nn.Module] = Net, **extra) -> nn.Module:
    """``model()`` with its inner unit wrapped by hand, then the root (same seed on both faces)."""
    torch.manual_seed(0)
    m = model()
    m.encoder.inner_unit = F(m.encoder.inner_unit, **kw(ctx, use_orig_params=uop, **extra))
    return F(m, **kw(ctx, use_orig_params=uop, **extra))


def trained(ctx, F, uop: bool = False):
    """``nested`` after one Adam step on this rank's data (the same on both faces)."""
    w = nested(ctx, F, uop)
    opt = torch.optim.Adam(w.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1 + ctx.rank)
    w(torch.randn(2, 4, generator=g)).sum().backward()
    opt.step()
    return w, opt


def hybrid_mesh(ctx) -> DeviceMesh:
    return init_device_mesh("cpu", (1, ctx.world_size), mesh_dim_names=("replicate", "shard"))


def meta_proj() -> Net:
    m = Net()
    m.proj.to_empty(device="meta")
    return m


def with_param(where: str, name: str, value: nn.Parameter) -> Callable[[], Net]:
    def make() -> Net:
        m = Net()
        setattr(m.get_submodule(where), name, value)
        return m
    return make


def load_sd(ctx, F, t, mutate: Callable[[dict], None], model: Callable[[], nn.Module] = Net) -> None:
    """Save ``t``'s state dict, ``mutate`` it, load it back (strict)."""
    w = nested(ctx, F, model=model)
    with F.state_dict_type(w, t):
        sd = dict(w.state_dict())
        mutate(sd)
        w.load_state_dict(sd)


def several_errors(sd: dict) -> None:
    """Missing keys in three modules (a buffer, another unit), unexpected keys at two depths
    (given deepest first) and a wrong shape: torch lists them in its load order."""
    for k in ("proj.weight", "encoder.norm.running_mean", "encoder.inner_unit.lin.bias"):
        del sd[k]
    sd["encoder.zzz"] = torch.zeros(1)
    sd["aaa"] = torch.zeros(1)
    sd["encoder.norm.weight"] = torch.zeros(5)


def load_osd(ctx, F, mutate: Callable[[dict], None], uop: bool = False) -> None:
    """``optim_state_dict`` after a step, ``mutate`` d, through ``optim_state_dict_to_load``."""
    w, opt = trained(ctx, F, uop)
    osd = F.optim_state_dict(w, opt)
    mutate(osd["state"])
    F.optim_state_dict_to_load(w, opt, osd)


def with_extra(value_of: Callable[[str], Any]) -> Callable[[dict], None]:
    """Every parameter's state gets an ``extra`` entry (``value_of(fqn)``)."""
    def mutate(state: dict) -> None:
        for fqn, st in state.items():
            st["extra"] = value_of(fqn)
    return mutate


BIAS = "encoder.inner_unit.lin.bias"  # shares its unit (a flat parameter) with lin.weight


def summon_in_forward(ctx, F) -> None:
    w = nested(ctx, F)

    def hook(*_):
        with F.summon_full_params(w):
            pass

    w.module.proj.register_forward_pre_hook(hook)
    w(torch.randn(2, 4))


def inner_wrapped(ctx, F) -> Net:
    """A Net whose inner unit is wrapped by hand; the root is not."""
    m = Net()
    m.encoder.inner_unit = F(m.encoder.inner_unit, **kw(ctx))
    return m


def summon_of(F, w: nn.Module) -> None:
    with F.summon_full_params(w):
        pass


def local_with_mesh(ctx, F) -> None:
    w = F(Net(), device_mesh=DeviceMesh.from_group(ctx.pg, "cpu"), device_id=CPU)
    with F.state_dict_type(w, SL):
        w.state_dict()


def summon(ctx, F, uop: bool = False, **opts) -> None:
    w = nested(ctx, F, uop)
    with F.summon_full_params(w, **opts):
        pass


def inside_summon(ctx, F, fn: Callable[[nn.Module], Any]) -> None:
    w = nested(ctx, F)
    w(torch.randn(2, 4)).sum().backward()
    with F.summon_full_params(w):
        fn(w)


def no_sync(w: nn.Module) -> None:
    with w.no_sync():
        pass


def inner(w: nn.Module) -> nn.Module:
    """The inner unit of ``nested``, once a forward through the root made that the root."""
    w(torch.randn(2, 4))
    return w.module.encoder.inner_unit


def hook_twice(ctx, F) -> None:
    w = nested(ctx, F)
    st = default_hooks.DefaultState(ctx.pg)
    w.register_comm_hook(st, default_hooks.reduce_scatter_hook)
    w.register_comm_hook(st, default_hooks.reduce_scatter_hook)


def types_differ(ctx, F, get: bool) -> None:
    w = nested(ctx, F)
    F.set_state_dict_type(w.module.encoder.inner_unit, SS_)
    F.get_state_dict_type(w) if get else F.set_state_dict_type(w, SF)


def mixed_use_orig_params(ctx, F) -> None:
    m = Net()
    m.encoder.inner_unit = F(m.encoder.inner_unit, **kw(ctx, use_orig_params=True))
    w = F(m, **kw(ctx))
    F.optim_state_dict(w, torch.optim.Adam(w.parameters()))


def optim_input(ctx, F, value_of: Callable[[nn.Module], Any]) -> None:
    w, opt = trained(ctx, F)
    F.full_optim_state_dict(w, opt, optim_input=value_of(w))


def dsd_set_missing(ctx, F) -> None:
    w, _ = trained(ctx, F)
    sd = dsd.get_model_state_dict(w)
    del sd["proj.weight"]
    dsd.set_model_state_dict(w, sd)


def dsd_optim_missing(ctx, F) -> None:
    w, opt = trained(ctx, F)
    osd = dsd.get_optimizer_state_dict(w, opt)
    del osd["state"]["proj.weight"]
    dsd.set_optimizer_state_dict(w, opt, osd)


# case -> (call(ctx, F) with F torch's or cfsdp's FullyShardedDataParallel, FQNs cfsdp must name)
SAME_AS_TORCH: dict[str, tuple[Callable[[Any, type], Any], tuple[str, ...]]] = {
    # constructor arguments
    "process_group_and_device_mesh": (
        lambda ctx, F: F(Net(), device_mesh=init_device_mesh("cpu", (ctx.world_size,)), **kw(ctx)), ()),
    "hybrid_with_a_1d_mesh": (
        lambda ctx, F: F(Net(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=CPU,
                         device_mesh=DeviceMesh.from_group(ctx.pg, "cpu")), ()),
    "hybrid_with_one_group": (
        lambda ctx, F: F(Net(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, **kw(ctx)), ()),
    "hybrid_manual_wrapping_without_groups": (
        lambda ctx, F: F(Net(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=CPU), ()),
    "param_init_fn_not_callable": (lambda ctx, F: F(meta_proj(), param_init_fn=3, **kw(ctx)), ()),
    "param_init_fn_leaves_meta": (
        lambda ctx, F: F(meta_proj(), param_init_fn=lambda mod: None, **kw(ctx)), ("proj.weight",)),
    # ignored modules and states
    "ignored_modules_and_ignored_states": (
        lambda ctx, F: (lambda m: F(m, ignored_modules=[m.proj], ignored_states=[m.proj.weight],
                                    **kw(ctx)))(Net()), ()),
    "ignored_modules_non_module_entry": (
        lambda ctx, F: (lambda m: F(m, ignored_modules=[m.proj, "proj", m.proj.weight], **kw(ctx)))(Net()),
        ("entry 1",)),
    "ignored_states_params_and_modules": (
        lambda ctx, F: (lambda m: F(m, ignored_states=[m.proj, m.encoder.inner_unit.lin.weight],
                                    **kw(ctx)))(Net()), ()),
    "ignored_states_strings": (lambda ctx, F: F(Net(), ignored_states=["proj"], **kw(ctx)), ()),
    "ignored_modules_with_fsdp_unit": (
        lambda ctx, F: (lambda m: F(m, ignored_modules=[m.encoder.inner_unit], **kw(ctx)))(inner_wrapped(ctx, F)),
        ()),
    # parameters
    "scalar_parameter": (
        lambda ctx, F: F(with_param("encoder.inner_unit", "gain", nn.Parameter(torch.tensor(2.0)))(),
                         **kw(ctx)), ("encoder.inner_unit.gain",)),
    # a unit wrapped on its own knows nothing above it: the FQN is still the model's
    "scalar_parameter_in_a_unit_wrapped_alone": (
        lambda ctx, F: (lambda m: F(m.encoder.inner_unit, **kw(ctx)))(
            with_param("encoder.inner_unit", "gain", nn.Parameter(torch.tensor(2.0)))()),
        ("'encoder.inner_unit.gain'",)),
    "scalar_parameter_auto_wrapped_unit": (
        lambda ctx, F: F(with_param("encoder", "inner_unit", Gained())(),
                         auto_wrap_policy=ModuleWrapPolicy({Gained}), **kw(ctx)), ("encoder.inner_unit.gain",)),
    "integer_parameter_first_in_unit": (
        lambda ctx, F: F(with_param("encoder.inner_unit", "counts",
                                    nn.Parameter(torch.zeros(4, dtype=torch.int64), requires_grad=False))(),
                         **kw(ctx)), ("encoder.inner_unit.counts",)),
    "integer_parameter_after_a_float_one": (
        lambda ctx, F: F(with_param("proj", "counts",
                                    nn.Parameter(torch.zeros(4, dtype=torch.int64), requires_grad=False))(),
                         **kw(ctx)), ("proj.counts",)),
    "parameters_of_two_dtypes": (lambda ctx, F: F(with_param("proj", "weight", nn.Parameter(
        torch.zeros(4, 4, dtype=torch.float64)))(), **kw(ctx)), ("proj.weight",)),
    "frozen_and_trainable_in_one_flat_unit": (lambda ctx, F: F(with_param("proj", "weight", nn.Parameter(
        torch.zeros(4, 4), requires_grad=False))(), **kw(ctx)), ("proj.weight",)),
    "auto_wrap_over_existing_units": (
        lambda ctx, F: F(inner_wrapped(ctx, F), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **kw(ctx)),
        ("encoder.inner_unit",)),
    # summon_full_params
    "summon_inside_forward": (summon_in_forward, ()),
    "summon_inside_summon": (lambda ctx, F: inside_summon(ctx, F, lambda w: summon_of(F, w)), ()),
    "summon_with_grads_flat_params": (lambda ctx, F: summon(ctx, F, with_grads=True), ()),
    "summon_with_grads_offload_to_cpu": (
        lambda ctx, F: summon(ctx, F, True, with_grads=True, offload_to_cpu=True), ()),
    "summon_writeback_rank0_only": (lambda ctx, F: summon(ctx, F, writeback=True, rank0_only=True), ()),
    # no_sync, communication hooks, clipping
    "no_sync_on_inner_unit": (lambda ctx, F: no_sync(inner(nested(ctx, F))), ()),
    "no_sync_inside_summon": (lambda ctx, F: inside_summon(ctx, F, no_sync), ()),
    "comm_hook_not_callable": (lambda ctx, F: nested(ctx, F).register_comm_hook(None, 5), ()),
    "comm_hook_on_inner_unit": (
        lambda ctx, F: inner(nested(ctx, F)).register_comm_hook(None, default_hooks.allreduce_hook), ()),
    "comm_hook_twice": (hook_twice, ()),
    "comm_hook_hybrid": (
        lambda ctx, F: F(Net(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=hybrid_mesh(ctx),
                         device_id=CPU).register_comm_hook(None, default_hooks.allreduce_hook), ()),
    "clip_on_inner_unit": (lambda ctx, F: inner(nested(ctx, F)).clip_grad_norm_(1.0), ()),
    "clip_inside_summon": (lambda ctx, F: inside_summon(ctx, F, lambda w: w.clip_grad_norm_(1.0)), ()),
    "clip_norm_type_0": (lambda ctx, F: trained(ctx, F)[0].clip_grad_norm_(1.0, 0), ()),
    # state-dict settings
    "state_dict_config_of_another_type": (
        lambda ctx, F: F.set_state_dict_type(nested(ctx, F), SF, ShardedStateDictConfig()), ()),
    "optim_state_dict_config_of_another_type": (
        lambda ctx, F: F.set_state_dict_type(nested(ctx, F), SF, FullStateDictConfig(),
                                             ShardedOptimStateDictConfig()), ()),
    "set_over_different_types": (lambda ctx, F: types_differ(ctx, F, get=False), ()),
    "get_different_settings": (lambda ctx, F: types_differ(ctx, F, get=True), ()),
    "local_state_dict_with_device_mesh": (local_with_mesh, ()),
    # loading model state dicts
    "load_state_dict_none": (lambda ctx, F: nested(ctx, F).load_state_dict(None), ()),
    "load_full_missing_key": (lambda ctx, F: load_sd(ctx, F, SF, lambda sd: sd.pop("proj.weight")), ("proj.weight",)),
    "load_full_unexpected_key": (
        lambda ctx, F: load_sd(ctx, F, SF, lambda sd: sd.__setitem__("encoder.bogus", torch.zeros(1))),
        ("encoder.bogus",)),
    "load_full_wrong_shape": (
        lambda ctx, F: load_sd(ctx, F, SF, lambda sd: sd.__setitem__("encoder.inner_unit.lin.weight",
                                                                      torch.zeros(5, 4))),
        ("encoder.inner_unit.lin.weight",)),
    "load_full_several_errors": (lambda ctx, F: load_sd(ctx, F, SF, several_errors, NetBN), ("proj.weight",)),
    "load_sharded_missing_key": (lambda ctx, F: load_sd(ctx, F, SS_, lambda sd: sd.pop(BIAS)), (BIAS,)),
    "load_sharded_unexpected_key": (
        lambda ctx, F: load_sd(ctx, F, SS_, lambda sd: sd.__setitem__("bogus", torch.zeros(1))), ("bogus",)),
    "load_sharded_missing_buffer": (
        lambda ctx, F: load_sd(ctx, F, SS_, lambda sd: sd.pop("encoder.norm.running_var"), NetBN),
        ("encoder.norm.running_var",)),
    "load_local_unexpected_key": (
        lambda ctx, F: load_sd(ctx, F, SL, lambda sd: sd.__setitem__("bogus", torch.zeros(1))), ("bogus",)),
    "load_local_without_flat_param": (
        lambda ctx, F: load_sd(ctx, F, SL, lambda sd: sd.pop("encoder.inner_unit._flat_param")),
        ("encoder.inner_unit._flat_param",)),
    # optimizer state dicts
    "optim_mixed_use_orig_params": (mixed_use_orig_params, ()),
    "optim_input_not_iterable": (lambda ctx, F: optim_input(ctx, F, lambda w: 5), ()),
    "optim_input_empty": (lambda ctx, F: optim_input(ctx, F, lambda w: []), ()),
    "optim_input_tensors_and_groups": (
        lambda ctx, F: optim_input(ctx, F, lambda w: [next(w.parameters()), {"params": []}]), ()),
    "optim_input_group_without_params": (lambda ctx, F: optim_input(ctx, F, lambda w: [{"lr": 1.0}]), ()),
    "optim_load_without_state": (
        lambda ctx, F: (lambda w, o: F.optim_state_dict_to_load(w, o, {"param_groups": []}))(*trained(ctx, F)), ()),
    "optim_shard_full_without_state": (
        lambda ctx, F: (lambda w, o: F.shard_full_optim_state_dict({"param_groups": []}, w, optim=o))(
            *trained(ctx, F)), ()),
    "optim_load_wrong_shape": (
        lambda ctx, F: load_osd(ctx, F, lambda st: st["proj.weight"].__setitem__("exp_avg", torch.zeros(5, 4))),
        ("proj.weight",)),
    "optim_load_state_names_differ": (
        lambda ctx, F: load_osd(ctx, F, lambda st: st[BIAS].pop("exp_avg")), (BIAS,)),
    "optim_load_dtypes_differ": (
        lambda ctx, F: load_osd(ctx, F, lambda st: st[BIAS].__setitem__("exp_avg", st[BIAS]["exp_avg"].double())),
        (BIAS,)),
    "optim_load_steps_differ": (
        lambda ctx, F: load_osd(ctx, F, lambda st: st[BIAS].__setitem__("step", torch.tensor(7.0))), ("step",)),
    "optim_load_scalar_state_missing": (
        lambda ctx, F: load_osd(ctx, F, with_extra(lambda f: None if f == BIAS else torch.tensor(1.0))), ("extra",)),
    "optim_load_plain_states_differ": (
        lambda ctx, F: load_osd(ctx, F, with_extra(lambda f: 2 if f == BIAS else 1)), ("extra",)),
    "optim_load_state_kinds_differ": (
        lambda ctx, F: load_osd(ctx, F, lambda st: st[BIAS].__setitem__("exp_avg", 3.0)), ()),
    "rekey_key_type": (
        lambda ctx, F: (lambda w, o: F.rekey_optim_state_dict(o.state_dict(), "name", w))(*trained(ctx, F)), ()),
    "rekey_mixed_keys": (
        lambda ctx, F: (lambda w, o: F.rekey_optim_state_dict(
            dict(o.state_dict(), state={**o.state_dict()["state"], "x": {}}), OptimStateKeyType.PARAM_NAME, w))(
            *trained(ctx, F)), ()),
    # torch.distributed.checkpoint.state_dict on a wrapped model
    "dsd_optim_only_without_optimizers": (
        lambda ctx, F: dsd.get_optimizer_state_dict(nested(ctx, F), ()), ()),
    "dsd_broadcast_without_full_state_dict": (
        lambda ctx, F: dsd.get_model_state_dict(nested(ctx, F), options=dsd.StateDictOptions(
            broadcast_from_rank0=True)), ()),
    "dsd_set_missing_key": (dsd_set_missing, ("proj.weight",)),
    "dsd_optimizer_state_missing": (dsd_optim_missing, ("proj.weight",)),
}


@h.subtest(grid={"case": list(SAME_AS_TORCH)})
def same_error_as_torch(ctx, case: str):
    f = Failures(ctx)
    call, fqns = SAME_AS_TORCH[case]
    f.same(case, lambda F: call(ctx, F), *fqns)
    f.raise_if_any()


if __name__ == "__main__":
    h.main()
