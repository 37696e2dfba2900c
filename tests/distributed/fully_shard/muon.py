"""cfsdp.optim.Muon on fully_shard's sharded DTensor parameters (issue 27 phase 2a).

The oracle is torch's fully_shard with the all-gather-everywhere Muon (``muon_oracle``:
``full_tensor()`` of every gradient, ``torch.optim.Muon`` on the full matrices, the local chunk
written back); the contender is cfsdp's fully_shard with ``cfsdp.optim.Muon`` (momentum on the
local shard, each matrix gathered to one owner, orthogonalized there, its chunks scattered back).
Both get the same gradient bits (fully_shard's parity, sections 1 and 9), the momentum is
elementwise and Newton–Schulz deterministic on the same full matrix, so losses, local gradients
and local parameters are compared **bitwise** (``run_scenario``'s comparisons). torch's side is
also compared with one process on the global batch (``single_process_muon``: torch's Muon +
AdamW) within ``MUON_REF_TOL`` (Newton–Schulz in bf16 can turn the reduction order's ulps into
bf16 ulps of an update; measured at 2 ranks: the parameters bitwise on these cases). Matrices
(ndim >= 2) go to Muon, the rest (biases, norms, the 1-element scale) to a torch AdamW on the
same model (the usual pairing). A spy counts the matrices each rank orthogonalizes: per step,
each matrix exactly once in its shard group, on the owner ``assign_owners`` names, all of
them in one exchange per step (``muon_buckets``: that exchange cut into several buckets, one
pair of all-to-alls each, still bitwise), through shared memory (``comm.all_to_all``) where
the launch's collectives take it (2 ranks), else the process group.
"""

from __future__ import annotations

import math
import os
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import _harness as h
import parity_common as pc
from fs_common import CFSDP, Scenario, batches, make_model, mesh_1d, mesh_2d, run_scenario, run_steps
from fully_shard.checkpoint import clone_tree, dcp_load, dcp_save, shared_tmpdir
from fully_shard.common import WORLD, largest_dim, raised
from muon_oracle import (AllGatherMuon, Pair, exchange_transports, shm_expected, small_buckets,
                         spy_muon)

import cfsdp
from cfsdp.optim import _muon_bucket as mb
from cfsdp.optim._muon_owners import assign_owners


class Experts(nn.Module):
    """A unit holding a stacked-experts parameter ``[E, M, N]`` (3, 8, 6): E=3 does not divide
    by W (Shard(0): chunks 2+1, at W=4 1+1+1+0)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 8, 6) * 0.3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,eij->bj", h, self.w) / 3


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 8)
        self.moe = Experts()
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.moe(torch.tanh(self.inp(x)))))

    def fsdp_units(self) -> list:
        return [self.moe]


def _build_moe(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MoE()


def muon_factory(kw: dict, counts: list | None = None):
    """(impl, model) -> Pair: the oracle on torch's model, cfsdp.optim.Muon on cfsdp's."""

    def make(impl, model):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        mats = [(n, p) for n, p in named if p.ndim >= 2]
        rest = [p for _, p in named if p.ndim < 2]
        adamw = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01) if rest else None
        if impl.name == "torch":
            return Pair(AllGatherMuon([p for _, p in mats], **kw), adamw)
        muon = cfsdp.optim.Muon(mats, **kw)
        if counts is not None:
            spy_muon(muon, counts)
        return Pair(muon, adamw)

    return make


def _check_owners(ctx, mm: pc.Mismatches, model: nn.Module, mesh, counts: list) -> None:
    """Each matrix of (the unsharded) ``model`` orthogonalized once per step in its shard group
    (the mesh's last dim), by its assigned owner."""
    shard_dim = mesh.ndim - 1
    n, me = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
    shapes = [tuple(p.shape) for p in model.parameters() if p.ndim >= 2]
    owners = assign_owners(shapes, n)
    mine = sum(math.prod(s[:-2]) for s, o in zip(shapes, owners) if o == me)
    total = sum(math.prod(s[:-2]) for s in shapes)
    mm.check([e for _, e in counts] == [1] * len(counts),
             f"rank {ctx.rank}: {[e for _, e in counts]} exchanges per step, expected one (every "
             "matrix of the shard group batched)")
    counts = [c for c, _ in counts]
    mm.check(counts == [mine] * len(counts),
             f"rank {ctx.rank} (chunk {me} of {n}) orthogonalized {counts} matrices per step, "
             f"its owned share is {mine} of {total}")
    every: list = [None] * ctx.world_size
    dist.all_gather_object(every, (mesh.get_coordinate(), counts), group=ctx.pg)
    groups: dict = {}
    for coord, c in every:
        key = tuple(x for i, x in enumerate(coord) if i != shard_dim)
        groups[key] = [a + b for a, b in zip(groups.get(key, [0] * len(c)), c)]
    for key, c in groups.items():
        mm.check(c == [total] * len(c), f"shard group {key}: {c} matrices orthogonalized per "
                 f"step, expected each of the {total} once")
    if ctx.rank == 0:
        ctx.log(f"Muon owners over {n}: this rank {mine} of {total} matrices per step")


CASES: dict[str, tuple[dict, dict]] = {  # name -> (Scenario kwargs, Muon kwargs)
    # Shard(0): qkv (36, 12), mlp (48, 12), pos (6, 12) even; tok (19, 12) uneven
    "lm_shard0": (dict(kind="lm"), dict(lr=0.02)),
    # Shard(0) of (9, 7), (9, 9), (3, 9): uneven; at W=4 rank 3 holds nothing of (3, 9)
    "mlp_no_nesterov_wd": (dict(kind="mlp"), dict(lr=0.02, nesterov=False, weight_decay=0.05,
                                                  adjust_lr_fn="match_rms_adamw")),
    # Shard(1) beside Shard(0) in one unit (shard_placement_fn)
    "lm_largest_dim": (dict(kind="lm", unit_kw={"shard_placement_fn": largest_dim}),
                       dict(lr=0.02, adjust_lr_fn="original")),
    # stacked experts [E, M, N], Shard(0) (along E) and Shard(2) (the matrices' N = 6: FSDP2
    # takes Shard(d > 0) on even dims only)
    "experts_shard0": (dict(kind="mlp", build=_build_moe), dict(lr=0.03)),
    "experts_shard2": (dict(kind="mlp", build=_build_moe,
                            unit_kw={"shard_placement_fn": lambda p: Shard(2 if p.ndim == 3 else 0)}),
                       dict(lr=0.03, nesterov=False, momentum=0.9)),
}


def single_process_muon(kw: dict):
    """(reference model) -> torch's Muon on its matrices (each trailing matrix of a 3-D one:
    ``AllGatherMuon`` on plain tensors) + AdamW on the rest, one process on the global batch."""

    def make(model):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        rest = [p for n, p in named if p.ndim < 2]
        return Pair(AllGatherMuon([p for _, p in named if p.ndim >= 2], **kw),
                    torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01) if rest else None)

    return make


# against one process on the global batch: the gradients differ from it by the reduction
# order's ulps, which Newton–Schulz (in bf16) turns into bf16 ulps of the update
MUON_REF_TOL = (1e-5, 1e-6)


def _muon_run(ctx, case: str, mesh) -> None:
    sc_kw, kw = CASES[case]
    counts: list = []
    sc = Scenario(**sc_kw, make_optim=muon_factory(kw, counts), ref_optim=single_process_muon(kw),
                  ref_tol=MUON_REF_TOL, ref_build=sc_kw.get("build"))
    mm = pc.Mismatches(ctx)
    with exchange_transports() as seen:
        run_scenario(ctx, sc, mesh, mm)
    _check_owners(ctx, mm, sc.build(sc.kind, 0), mesh, counts)
    # the exchange goes through cfsdp's collectives: shared memory on this one host when the
    # process's collectives take it, else the process group
    want = "shared memory" if shm_expected() else "process group"
    mm.check(seen and all(t.startswith(want) for t in seen),
             f"rank {ctx.rank}: Muon's all-to-alls went through {sorted(set(seen))}, "
             f"expected {want}")
    mm.raise_if_any()


@h.subtest(grid={"case": list(CASES)})
def muon_parity(ctx, case: str):
    """3 steps of cfsdp.optim.Muon (+ AdamW) on cfsdp.fully_shard against the all-gather Muon
    on torch's fully_shard: bitwise; each matrix orthogonalized once, by its owner."""
    _muon_run(ctx, case, mesh_1d(ctx))


@h.subtest(grid={"bound": [1, 1000]})
def muon_buckets(ctx, bound: int):
    """The exchange in buckets of at most ``bound`` bytes (1: every matrix alone; 1000: a few
    small matrices together, the larger alone), bf16 on the wire, the next bucket in flight
    while the owners work: still bitwise the oracle, each matrix once, by its owner (Shard(0)
    and Shard(1) matrices, stacked experts)."""
    with small_buckets(bound) as plans:
        for case in ("lm_largest_dim", "experts_shard0"):
            _muon_run(ctx, case, mesh_1d(ctx))
    assert plans and max(plans) > 1, f"bucket counts per exchange {plans}"


@h.subtest(grid={"rank1": ["4096", "lots"]})
def muon_bucket_bound_differs(ctx, rank1: str):
    """``CFSDP_MUON_BUCKET_BYTES`` set on rank 1 only (a bound, or not a number), as a fresh
    process reads it: the group's first exchange makes every rank raise a ValueError naming the
    variable (rank 1's own parse error for "lots"), no rank waits for a collective the others
    never post, no parameter changes (the fix is a restart: the variable is read once per
    process); the variable unset again, the next step runs."""
    mm, mesh = pc.Mismatches(ctx), mesh_1d(ctx)
    sc = Scenario(kind="lm", unit_kw={"shard_placement_fn": largest_dim}, ref=False,
                  make_optim=muon_factory(dict(lr=0.02)))
    model = make_model(CFSDP, sc, mesh)
    opt = sc.make_optim(CFSDP, model)
    data = batches("lm", 2, ctx.world_size)

    def fresh_process(value):
        """What a new process would see: the variable read again, no group agreed yet."""
        os.environ.pop(mb.BUCKET_ENV, None)
        if value is not None:
            os.environ[mb.BUCKET_ENV] = value
        mb._ENV_READ, mb._AGREED = None, weakref.WeakSet()

    fresh_process(rank1 if ctx.rank == 1 else None)
    try:
        before = [q.to_local().clone() for q in model.parameters()]
        e = raised(lambda: run_steps(CFSDP, sc, model, opt, data[:1], ctx.rank, []))
        text = str(e)
        if ctx.rank == 1 and rank1 == "lots":
            mm.check(isinstance(e, ValueError) and "expected a positive integer" in text
                     and mb.BUCKET_ENV in text, f"rank 1's own bad value: {e!r}")
        else:
            mm.check(isinstance(e, ValueError) and "differs across the" in text
                     and mb.BUCKET_ENV in text and "every rank" in text,
                     f"a bound set on rank 1 only ({rank1!r}): {e!r}")
        for q, b in zip(model.parameters(), before):
            mm.check(torch.equal(q.to_local(), b), "the refused step changed a parameter")
    finally:
        fresh_process(None)
    for q in model.parameters():  # the gradients of the refused step, dropped
        q.grad = None
    for o in (opt.muon, opt.adamw):
        o.state.clear()
    run_steps(CFSDP, sc, model, opt, data[1:], ctx.rank, [])
    mm.raise_if_any()


MUON_SD = dict(kind="lm", unit_kw={"shard_placement_fn": largest_dim}, ref=False)


def muon_scenario(kind: str = "lm") -> Scenario:
    """The checkpoint subtests' model: Shard(0) and Shard(1) matrices (largest_dim), the tied
    embedding uneven (19 rows), Muon (lr 0.02) + AdamW (the rest)."""
    return Scenario(**{**MUON_SD, "kind": kind}, make_optim=muon_factory(dict(lr=0.02)))


def full_state(model: nn.Module, opt: Pair) -> dict[str, torch.Tensor]:
    """``full_tensor()`` of every parameter and every optimizer state tensor (Muon's momentum
    buffers, AdamW's moments and step), keyed ``param:<fqn>`` / ``<optim>:<fqn>:<key>``: what a
    checkpoint must bring back, independent of the world size.  Collective."""
    out = {}
    for n, p in model.named_parameters():
        out[f"param:{n}"] = p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        for name, o in (("muon", opt.muon), ("adamw", opt.adamw)):
            for k, v in (o.state.get(p, {}) if o is not None else {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"{name}:{n}:{k}"] = (v.full_tensor() if isinstance(v, DTensor)
                                              else v.detach().clone())
    return out


def check_full_state(mm: pc.Mismatches, got: dict, want: dict, what: str) -> None:
    mm.check(list(got) == list(want), f"{what}: state {list(got)} != {list(want)}")
    for k in want:
        if k in got:
            mm.tensors(f"{what}: {k}", got[k], want[k], a_name="loaded", b_name="saved")


def _momentum_placed(mm: pc.Mismatches, model: nn.Module, opt: Pair) -> None:
    for p in (p for p in model.parameters() if p.ndim >= 2):
        buf = opt.muon.state[p].get("momentum_buffer")
        mm.check(isinstance(buf, DTensor) and buf.placements == p.placements
                     and buf.shape == p.shape, f"momentum buffer of a {p.placements} parameter "
                     f"is {type(buf).__name__} {getattr(buf, 'placements', None)}")


def _resume(ctx, save, load) -> None:
    """2 steps, ``save(model, opt)`` (returns the checkpoint), 2 more (the uninterrupted run);
    a fresh model (other weights) and optimizers ``load(checkpoint, model, opt)``: its state
    (full tensors) is the saved one and its next 2 steps are the uninterrupted run's, bitwise
    (losses and local parameters)."""
    mesh, mm = mesh_1d(ctx), pc.Mismatches(ctx)
    sc = muon_scenario()
    data = batches("lm", 4, ctx.world_size)
    model = make_model(CFSDP, sc, mesh)
    opt = sc.make_optim(CFSDP, model)
    run_steps(CFSDP, sc, model, opt, data[:2], ctx.rank, [])
    _momentum_placed(mm, model, opt)
    saved, want = save(model, opt), full_state(model, opt)
    fresh = make_model(CFSDP, sc, mesh)
    with torch.no_grad():  # another start: the load must bring everything back
        for p in fresh.parameters():
            p.to_local().mul_(0.5)
    fresh_opt = sc.make_optim(CFSDP, fresh)
    load(saved, fresh, fresh_opt)
    check_full_state(mm, full_state(fresh, fresh_opt), want, "after the load")
    a = run_steps(CFSDP, sc, model, opt, data[2:], ctx.rank, [])
    b = run_steps(CFSDP, sc, fresh, fresh_opt, data[2:], ctx.rank, [])
    for i, (x, y) in enumerate(zip(b, a)):
        mm.tensors(f"loss #{i} after the load", x, y, a_name="loaded", b_name="uninterrupted")
    for (n, p), q in zip(fresh.named_parameters(), model.parameters()):
        mm.tensors(f"local param {n} 2 steps after the load", p.to_local(), q.to_local(),
                   a_name="loaded", b_name="uninterrupted")
    mm.raise_if_any()


@h.subtest
def muon_state_dict(ctx):
    """get/set_optimizer_state_dict (full_state_dict=True) round trip of cfsdp.optim.Muon: the
    momentum buffers are DTensors placed as their parameters; a fresh model and Muon loaded
    from the full state dicts after 2 steps (Shard(0) and Shard(1) matrices) hold the saved
    state and continue 2 more steps bitwise as the uninterrupted run (Muon and the pairing's
    AdamW in one DSD call)."""
    full = StateDictOptions(full_state_dict=True)

    def save(model, opt):  # cloned: state dicts hold live tensors (AdamW's step)
        return (clone_tree(get_model_state_dict(model, options=full)),
                clone_tree(get_optimizer_state_dict(model, (opt.muon, opt.adamw), options=full)))

    def load(saved, model, opt):
        set_model_state_dict(model, saved[0], options=full)
        set_optimizer_state_dict(model, (opt.muon, opt.adamw), saved[1], options=full)

    _resume(ctx, save, load)


@h.subtest
def muon_dcp_resume(ctx):
    """torch.distributed.checkpoint: dcp.save of get_state_dict(model, (Muon, AdamW)) (sharded:
    the momentum buffers saved as their DTensor shards), dcp.load + set_state_dict into a fresh
    model and optimizers at the same world size: the loaded state (full tensors) is the saved
    one, the next 2 steps bitwise the uninterrupted run's."""
    with shared_tmpdir(ctx) as root:
        def save(model, opt):
            dcp_save(ctx, model, (opt.muon, opt.adamw), root)
            return root

        _resume(ctx, save, lambda path, model, opt: dcp_load(ctx, model, (opt.muon, opt.adamw), path))


def _named_dtensor(mesh, placements) -> nn.Parameter:
    return nn.Parameter(DTensor.from_local(torch.randn(4, 6), mesh, placements))


def _refused(mm: pc.Mismatches, mesh, bad: dict) -> None:
    """Each ``name: placements`` refused when its group is added: NotImplementedError naming
    the parameter and saying what to use."""
    for name, pls in bad.items():
        e = raised(lambda: cfsdp.optim.Muon([(name, _named_dtensor(mesh, pls))]))
        mm.check(isinstance(e, NotImplementedError) and f"'{name}'" in str(e)
                 and "fully_shard" in str(e), f"{name} ({pls}): {e!r}")


@h.subtest
def muon_bad_layout(ctx):
    """Layouts whose chunks are not torch.chunk along one dim (``Partial``, ``_StridedShard``):
    NotImplementedError naming the parameter and what to use, when the group is added; a
    sharded parameter with a gradient placed otherwise, a sharded bf16 one without Nesterov, or
    any sharded bf16 / fp16 one: at step(), nothing stepped."""
    mm = pc.Mismatches(ctx)
    mesh = mesh_1d(ctx)
    _refused(mm, mesh, {"blocks.0.partial": [Partial()],
                        "blocks.1.strided": [_StridedShard(0, split_factor=2)]})
    p = _named_dtensor(mesh, [Shard(0)])
    before = p.to_local().clone()
    opt = cfsdp.optim.Muon([("mlp.w", p)])
    p.grad = DTensor.from_local(torch.ones(p.shape), mesh, [Partial()])
    e = raised(opt.step)
    mm.check(isinstance(e, NotImplementedError) and "'mlp.w'" in str(e) and "Partial" in str(e),
             f"a Shard(0) parameter with a Partial gradient: {e!r}")
    mm.check(torch.equal(p.to_local(), before), "the refused step changed the parameter")
    # bf16 without Nesterov: torch normalizes the bf16 momentum buffer in place
    p = nn.Parameter(DTensor.from_local(torch.randn(4, 6, dtype=torch.bfloat16), mesh, [Shard(0)]))
    opt = cfsdp.optim.Muon([("head.w", p)], nesterov=False)
    p.grad = DTensor.from_local(torch.ones(4, 6, dtype=torch.bfloat16), mesh, [Shard(0)])
    e = raised(opt.step)
    mm.check(isinstance(e, NotImplementedError) and "'head.w'" in str(e) and "nesterov=True" in str(e),
             f"a sharded bf16 parameter without Nesterov: {e!r}")
    # bf16 / fp16 with Nesterov: torch's 16-bit add_(alpha=) rounds by position in the whole
    # tensor (measured: a bf16 mlp at 2 ranks ended 13 elements off the all-gather Muon)
    for dtype in (torch.bfloat16, torch.float16):
        p = nn.Parameter(DTensor.from_local(torch.randn(4, 6, dtype=dtype), mesh, [Shard(0)]))
        before = p.to_local().clone()
        opt = cfsdp.optim.Muon([("head.w", p)])
        p.grad = DTensor.from_local(torch.ones(4, 6, dtype=dtype), mesh, [Shard(0)])
        e = raised(opt.step)
        mm.check(isinstance(e, NotImplementedError) and "'head.w'" in str(e)
                 and f"sharded {dtype} parameter" in str(e) and "fp32" in str(e),
                 f"a sharded {dtype} parameter with Nesterov: {e!r}")
        mm.check(torch.equal(p.to_local(), before), f"the refused {dtype} step changed it")
    mm.raise_if_any()


if WORLD == 4:

    @h.subtest
    def muon_hsdp(ctx):
        """HSDP 2 x 2 ((Replicate(), Shard(d)), gradients all-reduced over replicas): Shard(0)
        and Shard(1) matrices (largest_dim) and stacked experts, bitwise as the oracle, each
        matrix orthogonalized once per shard group; a layout sharded over both mesh dims whose
        blocks do not tile the matrix ((Shard(0), Partial())) is refused, named (TP x FSDP's
        own layouts: worker_tp.py's fs_muon)."""
        for case in ("lm_largest_dim", "experts_shard0"):
            _muon_run(ctx, case, mesh_2d(ctx))
        mm = pc.Mismatches(ctx)
        _refused(mm, mesh_2d(ctx), {"tp.w": [Shard(0), Partial()]})
        mm.raise_if_any()
