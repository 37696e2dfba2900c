"""Bad input to cfsdp.FullyShardedDataParallel: the right exception type, a message naming the thing.

Run by tests/distributed/test_errors.py under torchrun (gloo, W=2). Each case is a subtest.
Where torch's FSDP1 rejects the same input, the subtest checks torch too (same exception
type), so the expectation written here is torch's behaviour and not a guess.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
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

    def ok(self, who: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            self.items.append(f"{who}: expected no error, got {type(e).__name__}: {e}")

    def raise_if_any(self) -> None:
        if self.items:
            raise AssertionError(f"{len(self.items)} problem(s) on rank {self.ctx.rank}:\n  "
                                 + "\n  ".join(self.items))


def kw(ctx, **extra) -> dict:
    d = dict(process_group=ctx.pg, device_id=CPU)
    d.update(extra)
    return d


# --------------------------------------------------------------------------------------------


@h.subtest
def auto_wrap_over_existing_units(ctx):
    """auto_wrap_policy on a module that already contains FSDP units -> ValueError naming the unit."""
    f = Failures(ctx)
    for who, wrapper in (("torch", TorchFSDP), ("cfsdp", CFSDP)):
        m = Net()
        m.encoder.inner_unit = wrapper(m.encoder.inner_unit, **kw(ctx))
        f.expect(who, ValueError,
                 lambda: wrapper(m, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **kw(ctx)),
                 "encoder.inner_unit")
    f.raise_if_any()


@h.subtest
def integer_parameter(ctx):
    """A non-floating parameter in a unit -> ValueError naming its FQN."""
    f = Failures(ctx)
    m = Net()
    m.encoder.inner_unit.counts = nn.Parameter(torch.zeros(4, dtype=torch.int64), requires_grad=False)
    f.expect("cfsdp", ValueError, lambda: CFSDP(m, **kw(ctx)), "encoder.inner_unit.counts")
    f.raise_if_any()


@h.subtest
def scalar_parameter(ctx):
    """torch FSDP1 rejects 0-dim parameters with a ValueError naming the parameter; so must cfsdp."""
    f = Failures(ctx)
    for who, wrapper in (("torch", TorchFSDP), ("cfsdp", CFSDP)):
        m = Net()
        m.encoder.inner_unit.gain = nn.Parameter(torch.tensor(2.0))
        f.expect(who, ValueError, lambda: wrapper(m, **kw(ctx)), "gain")
    # cfsdp names the full FQN, as for every other parameter error
    m = Net()
    m.encoder.inner_unit.gain = nn.Parameter(torch.tensor(2.0))
    f.expect("cfsdp (FQN)", ValueError, lambda: CFSDP(m, **kw(ctx)), "encoder.inner_unit.gain")
    f.raise_if_any()


@h.subtest
def meta_device_parameters(ctx):
    """Deferred init that cannot complete names what is wrong: a param_init_fn that leaves a
    parameter on meta -> ValueError naming its FQN."""
    f = Failures(ctx)
    m = Net()
    m.proj.to_empty(device="meta")
    f.expect("cfsdp (param_init_fn leaves meta)", ValueError,
             lambda: CFSDP(m, param_init_fn=lambda mod: None, **kw(ctx)), "proj.weight")
    f.raise_if_any()


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
    """A non-Module entry -> an error that is both a TypeError (a wrong type) and a ValueError.

    torch 2.13 raises TypeError for a non-iterable ``ignored_modules`` (checked on both) but
    ValueError for a non-Module *entry* (``_check_ignored_states`` runs first); cfsdp raises
    ``WrongTypeError``, a subclass of both, so code catching torch's ValueError still works.
    """
    f = Failures(ctx)
    for exc in (TypeError, ValueError):
        m = Net()
        f.expect(f"cfsdp [str entry, {exc.__name__}]", exc,
                 lambda: CFSDP(m, ignored_modules=["proj"], **kw(ctx)), "entry 0")
        m = Net()
        f.expect(f"cfsdp [Parameter entry, {exc.__name__}]", exc,
                 lambda: CFSDP(m, ignored_modules=[m.proj.weight], **kw(ctx)), "entry 0")
    m = Net()
    f.expect("torch [str entry]", ValueError, lambda: TorchFSDP(m, ignored_modules=["proj"], **kw(ctx)))
    for who, wrapper in (("torch", TorchFSDP), ("cfsdp", CFSDP)):
        m = Net()
        f.expect(f"{who} [not iterable]", TypeError, lambda: wrapper(m, ignored_modules=5, **kw(ctx)))
    f.raise_if_any()


@h.subtest
def ignored_modules_with_fsdp_unit(ctx):
    f = Failures(ctx)
    for who, wrapper in (("torch", TorchFSDP), ("cfsdp", CFSDP)):
        m = Net()
        m.encoder.inner_unit = wrapper(m.encoder.inner_unit, **kw(ctx))
        f.expect(who, ValueError, lambda: wrapper(m, ignored_modules=[m.encoder.inner_unit], **kw(ctx)),
                 "ignored_modules")
    f.raise_if_any()


@h.subtest
def ignored_modules_and_ignored_states(ctx):
    f = Failures(ctx)
    for who, wrapper in (("torch", TorchFSDP), ("cfsdp", CFSDP)):
        m = Net()
        f.expect(f"{who} [both]", ValueError,
                 lambda: wrapper(m, ignored_modules=[m.proj], ignored_states=[m.proj.weight], **kw(ctx)),
                 "ignored_modules", "ignored_states")
        m = Net()
        f.expect(f"{who} [params and modules mixed]", ValueError,
                 lambda: wrapper(m, ignored_states=[m.proj, m.encoder.inner_unit.lin.weight], **kw(ctx)),
                 "ignored_states")
    f.raise_if_any()


@h.subtest
def process_group_and_device_mesh(ctx):
    f = Failures(ctx)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for who, wrapper in (("torch", TorchFSDP), ("cfsdp", CFSDP)):
        f.expect(who, ValueError, lambda: wrapper(Net(), device_mesh=mesh, **kw(ctx)),
                 "process_group", "device_mesh")
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
    """DTensor parameters (tensor parallelism, not supported yet) never reach the C core: a
    NotImplementedError at wrap time names the first one (before: an error deep in C)."""
    f = Failures(ctx)
    wrap = (lambda m: CFSDP(m, process_group=ctx.pg)) if face == "wrapper" else cfsdp.fully_shard
    f.expect("cfsdp", NotImplementedError, lambda: wrap(tp_model(ctx)), "'0.weight'", "DTensor")
    f.raise_if_any()


@h.subtest
def optimizer_built_before_wrapping(ctx):
    """use_orig_params=False replaces the parameters: an optimizer over the old ones is stale.

    The step must fail loudly (RuntimeError naming the stale parameter's FQN and saying to
    build the optimizer after wrapping), never silently update parameters FSDP no longer uses.
    """
    f = Failures(ctx)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    fqns = [n for n, _ in m.named_parameters()]
    model = CFSDP(m, use_orig_params=False, **kw(ctx))
    model(torch.randn(2, 4)).sum().backward()
    try:
        opt.step()
    except RuntimeError as e:
        msg = str(e)
        if not any(n in msg for n in fqns):
            f.items.append(f"cfsdp: RuntimeError names none of the stale FQNs {fqns}: {msg!r}")
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


if __name__ == "__main__":
    h.main()
