"""What the fully_shard (FSDP2) workers share: the contenders (``TORCH``, ``CFSDP``), the models
(``mlp``, ``lm``, ``frozen``), data and losses, meshes, ``Scenario`` and ``run_scenario`` (train
torch, cfsdp and the single process, compare bitwise and against the reference; see
worker_fully_shard.py's docstring).  Registers no subtest (tests/unit/test_harness_imports.py).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

import _harness as h
import parity_common as pc
from dcp_common import assert_equal

import cfsdp


SELFTEST = os.environ.get("CFSDP_FS_SELFTEST") == "1"
STEPS = 3
ROWS = 12  # global batch rows per micro-batch: 6 a rank at W=2, 3 at W=4
MP_TOL = 2.0 ** -5
CKPT_PREFIX = "_checkpoint_wrapped_module."


# --------------------------------------------------------------------------------------------
# the two sharded implementations
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Impl:
    name: str
    fully_shard: Callable[..., Any]
    FSDPModule: type
    UnshardHandle: type
    register_fsdp_forward_method: Callable[[nn.Module, str], None]
TORCH = Impl("torch", torch_fsdp.fully_shard, torch_fsdp.FSDPModule, torch_fsdp.UnshardHandle,
             torch_fsdp.register_fsdp_forward_method)
CFSDP = Impl("cfsdp", *((torch_fsdp.fully_shard, torch_fsdp.FSDPModule, torch_fsdp.UnshardHandle,
                         torch_fsdp.register_fsdp_forward_method) if SELFTEST else
                        (cfsdp.fully_shard, cfsdp.FSDPModule, cfsdp.UnshardHandle,
                         cfsdp.register_fsdp_forward_method)))


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


class InjectedFailure(RuntimeError):
    """Raised once by a block's forward (reset_iter_state's recovery test)."""


def _linear(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)`` with x cast to the weight's dtype: under a mixed-precision policy a unit may
    hand fp32 (its ``output_dtype``) to bf16 parameters."""
    return lin(x.to(lin.weight.dtype))


class MLPBlock(nn.Module):
    """A residual unit (its input may be fp32 under ``output_dtype``, see ``_linear``)."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        # activation checkpointing inside the unit's own forward: False, True (non-reentrant)
        # or "reentrant" (torch.utils.checkpoint's use_reentrant=True)
        self.ckpt: bool | str = False
        self.fail = False  # raise once, to test reset_iter_state

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(_linear(self.lin, x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            self.fail = False
            raise InjectedFailure("injected failure in a block's forward")
        if self.ckpt:
            return checkpoint(self._body, x, use_reentrant=self.ckpt == "reentrant")
        return self._body(x)


class MLP(nn.Module):
    def __init__(self, order: tuple[int, ...] = (0, 1)):
        super().__init__()
        self.register_buffer("shift", torch.randn(7))
        self.in_proj = nn.Linear(7, 9)
        self.blocks = nn.ModuleList(MLPBlock(9) for _ in range(2))
        self.out = nn.Linear(9, 3)
        self.scale = nn.Parameter(torch.tensor([1.25]))
        self.order = order  # the blocks, in the order forward calls them
        # each block call under a reentrant checkpoint around the unit (the block's own
        # forward hooks run again in the recompute)
        self.ckpt_around_blocks = False

    def body(self, x: torch.Tensor) -> torch.Tensor:
        # the elementwise op runs in the input's dtype: shows whether fully_shard cast it
        hid = F.gelu(_linear(self.in_proj, torch.tanh(x - self.shift)))
        for i in self.order:
            if self.ckpt_around_blocks:
                hid = checkpoint(self.blocks[i], hid, use_reentrant=True)
            else:
                hid = self.blocks[i](hid)
        return _linear(self.out, hid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        """Not ``forward``: uses the root's parameters directly (needs
        ``register_fsdp_forward_method``)."""
        return (self.body(x) * self.scale).tanh()

    def fsdp_units(self) -> list:
        if getattr(self, "grouped", False):  # fully_shard([block0, block1]): one unit
            return [list(self.blocks)]
        return list(self.blocks)


def _branch(lin: nn.Linear, h: torch.Tensor, use: bool, zero_use: bool,
            gain: torch.Tensor | None = None) -> torch.Tensor:
    """``h + gain * tanh(lin(h))`` where used; where not, ``h`` (``lin`` and ``gain`` get no
    gradient), or with ``zero_use`` ``h + 0 * gain * tanh(lin(h))``: the same values (adding
    zeros), and they get a zero gradient, as ``0 * p.sum()`` in the loss gives one."""
    if not (use or zero_use):
        return h
    t = torch.tanh(_linear(lin, h))
    if gain is not None:
        t = gain.to(t.dtype) * t
    return h + t if use else h + 0 * t


class BranchBlock(MLPBlock):
    """An ``MLPBlock`` with a (9, 9) ``branch`` its forward uses where ``use_branch``."""

    def __init__(self, d: int):
        super().__init__(d)
        self.branch = nn.Linear(d, d)
        self.use_branch = True
        self.zero_use = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _branch(self.branch, super().forward(x), self.use_branch, self.zero_use)


class BranchMLP(MLP):
    """``mlp_branch``: the mlp with a (9, 9) ``branch`` in the root's unit and one in block
    1's, each used only where the scenario says (``use_branch``, set before each micro-batch,
    possibly per rank), and ``order`` (the blocks forward calls) settable per step: parameters
    that get no gradient in some steps, on some ranks, or in a whole unit. The root's branch
    has a 1-element ``gain`` (only rank 0 holds a row of it). ``zero_use``: the branches not
    used are used times 0 (a zero gradient, same values)."""

    def __init__(self):
        super().__init__()
        self.blocks[1] = BranchBlock(9)
        self.branch = nn.Linear(9, 9)
        self.gain = nn.Parameter(torch.tensor([0.75]))
        self.use_branch = True
        self.zero_use = False

    def body(self, x: torch.Tensor) -> torch.Tensor:
        hid = F.gelu(_linear(self.in_proj, torch.tanh(x - self.shift)))
        hid = _branch(self.branch, hid, self.use_branch, self.zero_use, self.gain)
        for i in self.order:
            hid = self.blocks[i](hid)
        return _linear(self.out, hid)


VOCAB, SEQ, D_MODEL, HEADS = 19, 6, 12, 2


class TiedLM(nn.Module):
    def __init__(self, n_blocks: int = 2):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
        self.blocks = nn.ModuleList(pc.Block(D_MODEL, HEADS) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied: one parameter, two state-dict keys

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind in ("mlp", "mlp_twice", "mlp_apart", "frozen", "mlp_grouped"):
        model = MLP({"mlp_twice": (0, 1, 1), "mlp_apart": (0, 1, 0)}.get(kind, (0, 1)))
        model.grouped = kind == "mlp_grouped"
        if kind == "frozen":
            model.blocks[0].requires_grad_(False)
            model.in_proj.weight.requires_grad_(False)
        return model
    if kind in ("lm", "lm1"):
        return TiedLM(n_blocks=2 if kind == "lm" else 1)
    if kind == "mlp_branch":
        return BranchMLP()
    if kind == "mlp_unused":  # parameters forward never uses: in the root's unit and a block's
        model = MLP()
        model.unused = nn.Linear(9, 9)
        model.blocks[1].spare = nn.Linear(9, 2)
        return model
    raise AssertionError(kind)


def loss_fn(kind: str, out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    if kind.startswith("lm"):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))
    return F.mse_loss(out, tgt.to(out.dtype))


def batches(kind: str, steps: int, world: int, micro: int = 1, seed: int = 1234):
    """``[step][micro][rank] -> (x, y)``: a global batch of ROWS rows per micro-batch, split into
    ``world`` equal chunks (the same data at every world size)."""
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + step)
        per_micro = []
        for _ in range(micro):
            if kind.startswith("lm"):
                x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
                y = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
            else:
                x = torch.randn(ROWS, 7, generator=g)
                y = torch.randn(ROWS, 3, generator=g)
            per_micro.append(list(zip(x.chunk(world), y.chunk(world))))
        out.append(per_micro)
    return out


# --------------------------------------------------------------------------------------------
# meshes and sharding
# --------------------------------------------------------------------------------------------


def mesh_1d(ctx: h.Context) -> DeviceMesh:
    return DeviceMesh.from_group(ctx.pg, "cpu")


def mesh_2d(ctx: h.Context) -> DeviceMesh:
    """(replicate 2, shard W/2) over fresh gloo groups (every rank creates every group)."""
    layout = torch.arange(ctx.world_size).view(2, ctx.world_size // 2)
    shard = [dist.new_group(row.tolist(), backend="gloo", timeout=h.PG_TIMEOUT) for row in layout]
    rep = [dist.new_group(col.tolist(), backend="gloo", timeout=h.PG_TIMEOUT) for col in layout.T]
    r, s = divmod(ctx.rank, layout.shape[1])
    return DeviceMesh.from_group([rep[s], shard[r]], "cpu", mesh=layout,
                                 mesh_dim_names=("replicate", "shard"))


def shard_index(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's chunk index, number of chunks) along the mesh's shard dimension."""
    return mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)


def local_chunk(full: torch.Tensor, idx: int, n: int, dim: int = 0) -> torch.Tensor:
    """What FSDP2 keeps of ``full`` on chunk ``idx`` of ``n``: torch.chunk on ``dim``, empty
    past the last chunk."""
    chunks = torch.chunk(full, n, dim=dim)
    return chunks[idx] if idx < len(chunks) else full.narrow(dim, 0, 0)


def shard(impl: Impl, model: nn.Module, mesh: DeviceMesh, unit_kw: dict | None = None,
          root_kw: dict | None = None) -> nn.Module:
    """fully_shard each unit, then the root (``root_kw`` overrides ``unit_kw`` on the root)."""
    unit_kw = unit_kw or {}
    for unit in model.fsdp_units():
        impl.fully_shard(unit, mesh=mesh, **unit_kw)
    impl.fully_shard(model, mesh=mesh, **{**unit_kw, **(root_kw or {})})
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def desc(t: torch.Tensor | None) -> Any:
    """What a registered parameter or gradient looks like to the user (not its values)."""
    if t is None:
        return None
    kind = "Parameter" if isinstance(t, nn.Parameter) else "Tensor"
    if isinstance(t, DTensor):
        return (kind, "DTensor", tuple(t.placements), tuple(t.shape), tuple(t.to_local().shape), t.dtype)
    return (kind, tuple(t.shape), t.dtype)


def reg_state(model: nn.Module) -> dict[str, tuple]:
    """name -> (parameter, gradient) as registered on the module right now."""
    return {n: (desc(p), desc(p.grad)) for n, p in model.named_parameters()}


def clean(name: str) -> str:
    return name.replace(CKPT_PREFIX, "")


# --------------------------------------------------------------------------------------------
# training: one scenario, run by each contender
# --------------------------------------------------------------------------------------------

Hook = Callable[..., Any]


@dataclass
class Scenario:
    kind: str = "mlp"
    optim: str = "adamw"
    steps: int = STEPS
    micro: int = 1
    unit_kw: dict | Callable[[nn.Module], dict] = field(default_factory=dict)
    root_kw: dict | Callable[[nn.Module], dict] = field(default_factory=dict)
    mp: MixedPrecisionPolicy | None = None  # the policy of the units (for the reference)
    root_mp: MixedPrecisionPolicy | None = None  # the root's, if not ``mp``
    build: Callable[[str, int], nn.Module] = build
    prepare: Hook | None = None  # (model) before fully_shard
    configure: Hook | None = None  # (impl, model) after fully_shard
    before_micro: Hook | None = None  # (impl, model, step, micro, notes)
    after_micro: Hook | None = None  # (impl, model, step, micro, notes)
    after_step: Hook | None = None  # (impl, model, step, data, notes)
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda model, x: model(x)
    ref: bool = True  # compare torch with the single-process reference
    # (impl, model) -> the optimizer of that contender's model; None: pc.make_optim(optim)
    make_optim: Callable[[Impl, nn.Module], Any] | None = None
    ref_grad_scale: float = 1.0
    # (kind, seed) -> the reference's model where ``build`` is not the plain one (a model of
    # the test's own); None: ``build``
    ref_build: Callable[[str, int], nn.Module] | None = None
    # (reference model) -> its optimizer; None: pc.make_optim(optim)
    ref_optim: Callable[[nn.Module], Any] | None = None
    # (rtol, atol as a fraction of the reference's largest |value|) against the reference;
    # None: pc.REF_RTOL, pc.REF_ATOL (MP_TOL with mixed precision)
    ref_tol: tuple[float, float] | None = None
    # each step starts with ``opt.zero_grad(set_to_none=...)`` (False: zeroed in place)
    set_to_none: bool = True


@dataclass
class Trace:
    losses: list[torch.Tensor]  # this rank's loss per (step, micro-batch)
    grads: dict[str, torch.Tensor | None]  # local gradients after the last backward
    params: dict[str, torch.Tensor]  # local parameters after the last optimizer step
    sharded: dict[str, tuple[bool, bool]]  # (grad, param) registered as DTensor at the snapshot
    notes: list[tuple[str, Any]]  # (label, observation): feature-specific, compared exactly
    reg: dict[str, tuple]  # registered parameters/gradients after the last optimizer step
    dims: dict[str, int] = field(default_factory=dict)  # each DTensor parameter's Shard dim


def snapshot(model: nn.Module, of_grads: bool) -> tuple[dict[str, torch.Tensor | None], dict[str, bool]]:
    """(local values, is-a-DTensor) of every registered parameter or its gradient. A unit that
    keeps its parameters unsharded (the root after a forward) registers full tensors."""
    out: dict[str, torch.Tensor | None] = {}
    for n, p in model.named_parameters():
        t = p.grad if of_grads else p
        out[n] = None if t is None else local(t).detach().clone()
    return out, {n: isinstance(p, DTensor) for n, p in model.named_parameters()}


def kwargs_for(spec, model: nn.Module) -> dict:
    return spec(model) if callable(spec) else dict(spec)


def make_model(impl: Impl, sc: Scenario, mesh: DeviceMesh, seed: int = 0) -> nn.Module:
    model = sc.build(sc.kind, seed)
    if sc.prepare:
        sc.prepare(model)
    shard(impl, model, mesh, kwargs_for(sc.unit_kw, model), kwargs_for(sc.root_kw, model))
    if sc.configure:
        sc.configure(impl, model)
    return model


def run_steps(impl: Impl, sc: Scenario, model: nn.Module, opt, data, rank: int, notes: list,
              record: dict | None = None) -> list[torch.Tensor]:
    losses = []
    for s, step_data in enumerate(data):
        opt.zero_grad(set_to_none=sc.set_to_none)
        for m, chunks in enumerate(step_data):
            x, y = chunks[rank]
            if sc.before_micro:
                sc.before_micro(impl, model, s, m, notes)
            loss = loss_fn(sc.kind, sc.call(model, x), y)
            loss.backward()
            losses.append(loss.detach().clone())
            if sc.after_micro:
                sc.after_micro(impl, model, s, m, notes)
        if record is not None and s == len(data) - 1:
            record["grads"] = snapshot(model, of_grads=True)
        opt.step()
        if record is not None and s == len(data) - 1:
            record["params"], record["reg"] = snapshot(model, of_grads=False), reg_state(model)
        if sc.after_step:
            sc.after_step(impl, model, s, step_data, notes)
    return losses


def train(impl: Impl, ctx: h.Context, mesh: DeviceMesh, sc: Scenario, data) -> Trace:
    model = make_model(impl, sc, mesh)
    opt = sc.make_optim(impl, model) if sc.make_optim else pc.make_optim(sc.optim, model.parameters())
    notes: list = []
    record: dict = {}
    losses = run_steps(impl, sc, model, opt, data, ctx.rank, notes, record)
    (grads, g_sharded), (params, p_sharded) = record["grads"], record["params"]
    dims = {n: p.placements[-1].dim for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return Trace(losses, grads, params, {n: (g_sharded[n], p_sharded[n]) for n in params},
                 notes, record["reg"], dims)


def low_precision_copy(ref: nn.Module, sc: Scenario) -> nn.Module:
    """FSDP2's mixed precision, emulated on one process: the parameters cast to param_dtype and
    the same input/output casts at the same module boundaries (units and root)."""
    lp = copy.deepcopy(ref)
    for p in lp.parameters():  # parameters only: FSDP2 does not cast buffers
        p.data = p.data.to(sc.mp.param_dtype)

    def cast(dtype):
        return lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    for mod, pol in [(u, sc.mp) for u in lp.fsdp_units()] + [(lp, sc.root_mp or sc.mp)]:
        if pol.cast_forward_inputs and pol.param_dtype is not None:
            mod.register_forward_pre_hook(
                lambda _m, args, kwargs, f=cast(pol.param_dtype): (tree_map(f, args), tree_map(f, kwargs)),
                with_kwargs=True)
        if pol.output_dtype is not None:
            mod.register_forward_hook(lambda _m, _a, out, f=cast(pol.output_dtype): tree_map(f, out))
    return lp


def train_ref(sc: Scenario, data, world: int) -> tuple[list[list[torch.Tensor]], dict, dict]:
    """(per (step, micro) the loss of every rank's chunk, full grads after the last backward,
    full params at the end) of the unwrapped model on all chunks."""
    # never sc.build (it may wrap or place the model): the reference is the plain model on the CPU
    ref = (sc.ref_build or build)(sc.kind, 0)
    opt = sc.ref_optim(ref) if sc.ref_optim else pc.make_optim(sc.optim, ref.parameters())
    losses: list[list[torch.Tensor]] = []
    grads: dict = {}
    trainable = [p for p in ref.parameters() if p.requires_grad]
    for s, step_data in enumerate(data):
        opt.zero_grad(set_to_none=sc.set_to_none)
        if sc.mp is None:
            total = 0.0
            for chunks in step_data:
                per = [loss_fn(sc.kind, sc.call(ref, x), y) for x, y in chunks]
                losses.append([l.detach().clone() for l in per])
                total = total + torch.stack(per).mean()
            (total * sc.ref_grad_scale).backward()
        else:
            if len(step_data) != 1:
                raise AssertionError("the mixed-precision reference takes one micro-batch a step")
            lp = low_precision_copy(ref, sc)
            lp_trainable = [p for p in lp.parameters() if p.requires_grad]
            red = sc.mp.reduce_dtype or sc.mp.param_dtype
            per, acc = [], None
            for x, y in step_data[0]:
                loss = loss_fn(sc.kind, sc.call(lp, x), y)
                per.append(loss.detach().clone())
                g = [t.to(red) for t in torch.autograd.grad(loss, lp_trainable)]
                acc = g if acc is None else [a + b for a, b in zip(acc, g)]
            losses.append(per)
            for p, a in zip(trainable, acc):
                p.grad = (a / world).to(p.dtype)
        if s == len(data) - 1:
            grads = {n: None if p.grad is None else p.grad.detach().clone()
                     for n, p in ref.named_parameters()}
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in ref.named_parameters()}


# --------------------------------------------------------------------------------------------
# comparisons
# --------------------------------------------------------------------------------------------


def compare_traces(mm: pc.Mismatches, c: Trace, t: Trace) -> None:
    """cfsdp against torch: bitwise."""
    mm.check(len(c.losses) == len(t.losses), f"{len(c.losses)} losses, torch {len(t.losses)}")
    for i, (a, b) in enumerate(zip(c.losses, t.losses)):
        mm.tensors(f"loss #{i}", a, b)
    mm.check(list(c.grads) == list(t.grads), f"grad names {list(c.grads)} != torch {list(t.grads)}")
    for n in t.grads:
        if n in c.grads:
            mm.tensors(f"local grad {n} after the last backward", c.grads[n], t.grads[n])
    mm.check(list(c.params) == list(t.params), f"param names {list(c.params)} != torch {list(t.params)}")
    for n in t.params:
        if n in c.params:
            mm.tensors(f"local param {n} after the last step", c.params[n], t.params[n])
    compare_reg(mm, "after the last step", c.reg, t.reg)
    mm.check([n[0] for n in c.notes] == [n[0] for n in t.notes],
             f"observations {[n[0] for n in c.notes]} != torch's {[n[0] for n in t.notes]}")
    for (label, a), (_, b) in zip(c.notes, t.notes):
        if isinstance(a, dict) and isinstance(b, dict):
            compare_reg(mm, label, a, b)
            continue
        try:
            assert_equal(a, b, label)
        except AssertionError as e:
            mm.add(str(e))


def compare_reg(mm: pc.Mismatches, when: str, c: dict, t: dict) -> None:
    """Registered (parameter, gradient) descriptions, every differing name listed."""
    mm.check(list(c) == list(t), f"{when}: parameter names {list(c)} != torch's {list(t)}")
    for n in t:
        if n in c and c[n] != t[n]:
            mm.add(f"{when}: {n} registered as (param, grad) {c[n]}, torch {t[n]}")


def compare_ref(mm: pc.Mismatches, t: Trace, ref: tuple, ctx: h.Context, mesh: DeviceMesh,
                mp: bool = False, tol: tuple[float, float] | None = None) -> None:
    """torch against the single-process reference (see the module docstring for tolerances;
    ``tol``: the scenario's ``ref_tol``)."""
    r_losses, r_grads, r_params = ref
    idx, n = shard_index(mesh)
    if tol is None and mp:
        tol = (MP_TOL, MP_TOL)

    def close(what, a, b):
        if tol is not None and b is not None and b.numel():
            mm.tensors(what, a, b, exact=False, a_name="torch", b_name="ref", rtol=tol[0],
                       atol=tol[1] * b.detach().abs().max().item())
        else:
            mm.tensors(what, a, b, exact=False, a_name="torch", b_name="ref")

    for i, (a, b) in enumerate(zip(t.losses, r_losses)):
        close(f"torch-vs-ref loss #{i}", a, b[ctx.rank])
    for name in t.params:
        full_g, full_p = r_grads.get(clean(name)), r_params.get(clean(name))
        if full_p is None:
            mm.add(f"torch parameter {name} is not in the reference model")
            continue
        g_sharded, p_sharded = t.sharded[name]
        dim = t.dims.get(name, 0)
        if g_sharded and full_g is not None:
            full_g = local_chunk(full_g, idx, n, dim)
        if p_sharded:
            full_p = local_chunk(full_p, idx, n, dim)
        close(f"torch-vs-ref grad {name} (local) after the last backward", t.grads[name], full_g)
        close(f"torch-vs-ref param {name} (local) after the last step", t.params[name], full_p)
    if ctx.rank == 0:
        ctx.log(f"torch-vs-ref: worst |diff|/(atol+rtol*|ref|) = {mm.worst_ref:.3f} (passes if <= 1)")


def run_scenario(ctx: h.Context, sc: Scenario, mesh: DeviceMesh | None = None,
                 mm: pc.Mismatches | None = None) -> None:
    """Train torch and cfsdp (and the reference) on ``sc``; raise with every mismatch (and
    those already in ``mm``)."""
    mesh = mesh or mesh_1d(ctx)
    mm = mm or pc.Mismatches(ctx)
    data = batches(sc.kind, sc.steps, ctx.world_size, sc.micro)
    t = train(TORCH, ctx, mesh, sc, data)
    c = train(CFSDP, ctx, mesh, sc, data)
    compare_traces(mm, c, t)
    if sc.ref:
        compare_ref(mm, t, train_ref(sc, data, ctx.world_size), ctx, mesh, mp=sc.mp is not None,
                    tol=sc.ref_tol)
    mm.raise_if_any()
