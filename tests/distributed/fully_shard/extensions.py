"""All-gather extensions (torch FSDP2's fsdp_pre_all_gather / fsdp_post_all_gather protocol,
which torchao's float8 weights use): cfsdp.fully_shard against torch's, bitwise.

Two weight subclasses of this module's own, each a wrapper around a plain fp32 tensor whose
ops run on that tensor (the optimizer steps it through the sharded DTensor):

* ``bf16``: the all-gather input is the shard cast to bf16 (padded to the chunk size by the
  5-argument fsdp_pre_all_gather), the unsharded parameter its cast to ``param_dtype``;
  ``bf16_v1`` is the same with the older one-argument fsdp_pre_all_gather(mesh), on a model
  every world size divides (it cannot pad);
* ``rowscale``: two all-gather inputs of two dtypes, as float8 rowwise: the rows divided by a
  per-row scale, in bf16, and the fp32 scales; the unsharded parameter is their product;
* ``plain``: the same model without extensions (the control: the same units, plain weights).

The hooks log every call with its arguments (outer size and stride, module, the policy's
param_dtype, ``out=`` given or not): the logs of both contenders must be equal, so the
``out=`` path (every unshard after the first) runs where torch runs it.  Losses, gradients,
parameters and the state dict are compared bitwise every step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import _harness as h
import parity_common as pc
from fs_common import CFSDP, SELFTEST, TORCH, Impl, mesh_1d
from fully_shard.common import raised

_LOG: list[tuple] = []  # the hooks' calls in this process, cleared per contender


class _Wrapped(torch.Tensor):
    """A wrapper subclass over a plain tensor ``_data``: every op runs on ``_data`` and
    tensors come back wrapped (so ``new_zeros``, ``narrow``, an optimizer's in-place steps
    keep the class)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, data.stride(), data.storage_offset(),
                                                   dtype=data.dtype, device=data.device)

    def __init__(self, data: torch.Tensor):
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*pytree.tree_map_only(cls, lambda t: t._data, args),
                   **pytree.tree_map_only(cls, lambda t: t._data, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(inner["_data"])

    def __repr__(self):
        return f"{type(self).__name__}({self._data})"

    def _padded(self, outer_size: torch.Size, mesh: Any, dtype: torch.dtype) -> torch.Tensor:
        """``_data`` in ``dtype``, padded with zero rows to the chunk size of ``outer_size``."""
        rows = -(-outer_size[0] // mesh.size())
        out = torch.zeros((rows, *outer_size[1:]), dtype=dtype, device=self.device)
        out[: self._data.size(0)].copy_(self._data)
        return out


def _log_pre(mesh, outer_size=None, outer_stride=None, module=None, mp_policy=None) -> None:
    _LOG.append(("pre", mesh.size(), tuple(outer_size or ()), tuple(outer_stride or ()),
                 type(module).__name__, getattr(mp_policy, "param_dtype", None)))


def _refill(out: torch.Tensor, value: torch.Tensor) -> None:
    """``out=``: the unsharded parameter (the parameter's size) refilled in place from the
    all-gathered rows (padded: the first rows are the parameter's)."""
    with torch.no_grad(), _unsafe_preserve_version_counter(out):
        out.copy_(value[: out.size(0)])


class BF16Gather(_Wrapped):
    """All-gathers its shard in bf16; the unsharded parameter is a plain ``param_dtype`` tensor."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        _log_pre(mesh, outer_size, outer_stride, module, mp_policy)
        return (self._padded(outer_size, mesh, torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs: tuple, metadata: Any, param_dtype: torch.dtype, *,
                             out: Optional[torch.Tensor] = None):
        (gathered,) = outputs
        _LOG.append(("post", out is None, param_dtype, gathered.dtype, tuple(gathered.shape)))
        assert metadata is None
        if out is not None:
            _refill(out, gathered)
            return None
        full = gathered.to(param_dtype)
        return full, (gathered, full)


class BF16GatherV1(BF16Gather):
    """The same with the one-argument fsdp_pre_all_gather(mesh) (no padding: even shards only)."""

    def fsdp_pre_all_gather(self, mesh):
        _log_pre(mesh)
        return (self._data.to(torch.bfloat16),), None


class RowScaled(_Wrapped):
    """All-gathers two tensors of two dtypes, as float8 rowwise: its rows over a per-row
    scale, in bf16, and the fp32 scales (broadcast to the chunk's shape: torch wants every
    input of an unevenly sharded parameter at the padded chunk size); the unsharded
    parameter is their product.  The metadata (a tag) travels from pre to post."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        _log_pre(mesh, outer_size, outer_stride, module, mp_policy)
        data = self._padded(outer_size, mesh, torch.float32)
        scale = data.abs().amax(dim=1, keepdim=True).clamp(min=1e-6) / 8.0
        return ((data / scale).to(torch.bfloat16), scale.expand_as(data).contiguous()), ("rowscale", 8.0)

    def fsdp_post_all_gather(self, outputs: tuple, metadata: Any, param_dtype: torch.dtype, *,
                             out: Optional[torch.Tensor] = None):
        q, scales = outputs
        _LOG.append(("post", out is None, param_dtype, q.dtype, tuple(q.shape), scales.dtype,
                     tuple(scales.shape), metadata))
        assert metadata == ("rowscale", 8.0)
        value = q.to(param_dtype) * scales[:, :1].to(param_dtype)
        if out is not None:
            _refill(out, value)
            return None
        return value, (q, scales, value)


class PreOnly(_Wrapped):
    """Defines fsdp_pre_all_gather only: torch refuses it."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._data,), None


KINDS = {"bf16": BF16Gather, "bf16_v1": BF16GatherV1, "rowscale": RowScaled, "plain": None}


class _Block(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.relu(self.lin1(x)))


class Net(nn.Module):
    """Uneven shapes (chunks padded, some empty at W=4): (7, 5), (9, 7), (7, 9), (3, 7);
    ``even``: every dim a multiple of 4."""

    def __init__(self, even: bool = False):
        super().__init__()
        d_in, d, hidden, d_out = (4, 8, 8, 4) if even else (5, 7, 9, 3)
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(_Block(d, hidden) for _ in range(2))
        self.out = nn.Linear(d, d_out)
        self.d_in = d_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def build(kind: str, seed: int = 0) -> Net:
    """The model, every Linear weight of class ``KINDS[kind]`` (biases plain)."""
    torch.manual_seed(seed)
    model = Net(even=kind == "bf16_v1")
    for m in model.modules():
        if isinstance(m, nn.Linear) and KINDS[kind] is not None:
            m.weight = nn.Parameter(KINDS[kind](m.weight.detach().clone()))
    return model


def plain(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A sharded tensor's local values as a plain tensor (the subclass unwrapped)."""
    if t is None:
        return None
    if isinstance(t, DTensor):
        t = t._local_tensor
    while isinstance(t, _Wrapped):
        t = t._data
    return t.detach()


def _train(impl: Impl, ctx: h.Context, kind: str, raf: bool, mp: Optional[torch.dtype],
           around: Any = contextlib.nullcontext) -> dict:
    """``around()``: a context the training steps run in (the recording device layer)."""
    model = build(kind)
    kw = {"mesh": mesh_1d(ctx), "reshard_after_forward": raf}
    if mp is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=torch.float32)
    for b in model.blocks:
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + ctx.rank)
    _LOG.clear()
    rec = {"types": {n: type(p._local_tensor).__name__ for n, p in model.named_parameters()},
           "steps": []}
    for step in range(3):
        x = torch.randn(4, model.d_in, generator=g)
        with around():
            loss = model(x).float().pow(2).mean()
            loss.backward()
            grads = {n: plain(p.grad) for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
        rec["steps"].append((loss.detach(), grads, {n: plain(p) for n, p in model.named_parameters()}))
    rec["state_dict"] = {k: (type(v).__name__, plain(v)) for k, v in model.state_dict().items()}
    rec["log"] = list(_LOG)
    return rec


@h.subtest(grid={"kind": ["bf16", "rowscale", "bf16_v1", "plain"], "reshard_after_forward": [True, False],
                 "mp": [None, torch.bfloat16]})
def extension_parity(ctx: h.Context, kind: str, reshard_after_forward: bool, mp):
    """Training parity with torch's fully_shard, bitwise: losses, gradients, parameters after
    each step, the state dict, the local tensors' classes and the hooks' call logs."""
    c = _train(CFSDP, ctx, kind, reshard_after_forward, mp)
    t = _train(TORCH, ctx, kind, reshard_after_forward, mp)
    mm = pc.Mismatches(ctx)
    mm.check(c["types"] == t["types"], f"local tensor classes {c['types']} != torch's {t['types']}")
    mm.check(c["log"] == t["log"], f"hook calls differ:\n  cfsdp {c['log']}\n  torch {t['log']}")
    mm.check(kind == "plain" or any(e[0] == "post" and not e[1] for e in t["log"]),
             "torch never called fsdp_post_all_gather with out= (the test's premise: every "
             "unshard after the first refills the unsharded parameter)")
    for step, ((cl, cg, cp), (tl, tg, tp)) in enumerate(zip(c["steps"], t["steps"])):
        mm.tensors(f"step {step}: loss", cl, tl)
        for n in tp:
            mm.tensors(f"step {step}: {n}.grad", cg.get(n), tg[n])
            mm.tensors(f"step {step}: {n} after the step", cp.get(n), tp[n])
    mm.check(list(c["state_dict"]) == list(t["state_dict"]),
             f"state-dict keys {list(c['state_dict'])} != torch's {list(t['state_dict'])}")
    for k, (ty, v) in t["state_dict"].items():
        cty, cv = c["state_dict"].get(k, (None, None))
        mm.check(cty == ty, f"state dict {k}: {cty}, torch's {ty}")
        mm.tensors(f"state dict {k}", cv, v)
    mm.raise_if_any()


@h.subtest
def extension_bad_input(ctx: h.Context):
    """A weight whose class defines fsdp_pre_all_gather without fsdp_post_all_gather: torch's
    error (an AssertionError) with the parameter's FQN; a subclass without the hooks is still
    refused with cfsdp's message."""
    mm = pc.Mismatches(ctx)
    for impl in (TORCH, CFSDP):
        model = build("bf16")
        block = model.blocks[0]
        block.lin1.weight = nn.Parameter(PreOnly(block.lin1.weight.detach().clone()))
        err = raised(lambda: impl.fully_shard(block, mesh=mesh_1d(ctx)))
        want = "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined"
        mm.check(isinstance(err, AssertionError) and want in str(err),
                 f"{impl.name}: {type(err).__name__}: {err}, expected an AssertionError saying {want!r}")
        if impl is CFSDP and not SELFTEST:  # (torch's own message names no FQN)
            mm.check(err is not None and "'lin1.weight'" in str(err), f"cfsdp's error names no FQN: {err}")
    if not SELFTEST:  # (torch shards such a subclass)
        model = build("bf16")
        model.inp.weight = nn.Parameter(_Wrapped(model.inp.weight.detach().clone()))
        err = raised(lambda: CFSDP.fully_shard(model, mesh=mesh_1d(ctx)))
        mm.check(isinstance(err, NotImplementedError) and "'inp.weight'" in str(err)
                 and "plain strided tensors" in str(err),
                 f"a subclass without the hooks: {type(err).__name__}: {err}")
    dist.barrier()
    mm.raise_if_any()


@h.subtest(grid={"kind": ["bf16", "rowscale"], "reshard_after_forward": [True, False]})
def extension_recorded_streams(ctx: h.Context, kind: str, reshard_after_forward: bool):
    """Extension parameters (fsdp_pre_all_gather's inputs all-gathered beside the packed
    buffer, fsdp_post_all_gather's outputs) under torch FSDP2's stream protocol, recorded
    (stream_check.py): the happens-before checker passes, the numbers and the hooks' calls
    are bitwise those of the plain run, every collective on a side stream.  The ordering
    logic only: nothing here runs on a GPU."""
    import stream_check as sc
    from cfsdp._runtime import device

    want = _train(CFSDP, ctx, kind, reshard_after_forward, None)
    rec = sc.RecordingDevice()
    got = _train(CFSDP, ctx, kind, reshard_after_forward, None, lambda: device.use(rec))
    sc.check(rec.log)
    mm = pc.Mismatches(ctx)
    mm.check(got["log"] == want["log"], f"hook calls differ:\n  recorded {got['log']}\n  plain "
             f"{want['log']}")
    for step, ((gl, gg, gp), (wl, wg, wp)) in enumerate(zip(got["steps"], want["steps"])):
        mm.tensors(f"step {step}: loss", gl, wl, a_name="recorded", b_name="plain")
        for n in wp:
            mm.tensors(f"step {step}: {n}.grad", gg.get(n), wg[n], a_name="recorded", b_name="plain")
            mm.tensors(f"step {step}: {n}", gp.get(n), wp[n], a_name="recorded", b_name="plain")
    on_current = [op for op in rec.ops_on(sc.CURRENT) if op.startswith("c10d.")]
    mm.check(not on_current, f"collectives on the current stream: {on_current}")
    gathers = rec.ops_on("all_gather")
    mm.check(any(op.startswith("c10d.") for op in gathers),
             f"no collective on the all-gather stream: {sorted(set(gathers))}")
    mm.raise_if_any()
