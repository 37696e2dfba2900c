"""The all-gather-everywhere Muon: the oracle of ``cfsdp.optim.Muon`` on sharded DTensor
parameters (tests/distributed/fully_shard/muon.py; ``AllGatherMuon``) and on the
FullyShardedDataParallel wrapper's flat shards (``muon_wrapper`` in worker_optim.py;
``WrapperAllGatherMuon``); ``spy_muon`` counts what a ``cfsdp.optim.Muon`` orthogonalizes and
exchanges; ``small_buckets`` bounds the exchange's buckets small and records how many each
exchange made.  (benchmarks/bench_muon.py's contender (a) is the lean form trainers write: momentum on
the shard, one full matrix at a time; this one keeps full copies, which a test can afford.)

What the usual hand-made fix does on FSDP2: every rank ``full_tensor()``s every gradient and
parameter, runs torch's own ``torch.optim.Muon`` on the full matrices (so every rank
orthogonalizes every matrix: W-fold redundant), and writes back its local chunk. It keeps the
full momentum buffers (torch's ``momentum_buffer`` of each full matrix). A 3-D parameter
``[E, M, N]`` is E matrices, each a parameter of the inner ``torch.optim.Muon`` (torch's Muon
takes 2-D ones only; its math is per matrix, the momentum elementwise, so this is the
per-trailing-matrix Muon that cfsdp's docs promise).

Bits: the momentum is elementwise and Newton–Schulz deterministic on the same full input, the
weight decay and the update elementwise, so a correct sharded Muon is bitwise this.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from cfsdp.optim import _muon, _muon_bucket
from cfsdp.optim._muon_shard import exchange


def local_part(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's part of ``full`` as ``like`` places it (``Shard(d)``: torch.chunk along d,
    empty past the last chunk; ``Replicate``: all of it).  Sharded over two mesh dims (TP x
    FSDP, ``_StridedShard`` included): DTensor's own ``redistribute`` from ``Replicate`` takes
    it (and any other placement, e.g. ``_StridedShard`` on a one-rank dp dim), so the oracle
    does not re-derive the layout."""
    mesh, out = like.device_mesh, full
    sharded = [pl for md, pl in enumerate(like.placements) if mesh.size(md) > 1 and not pl.is_replicate()]
    if len(sharded) > 1 or any(type(pl) not in (Shard, Replicate) for pl in like.placements):
        rep = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return rep.redistribute(mesh, like.placements).to_local()
    for md, pl in enumerate(like.placements):
        if pl.is_shard():
            n, i = mesh.size(md), mesh.get_local_rank(md)
            chunks = torch.chunk(out, n, dim=pl.dim)
            out = chunks[i] if i < len(chunks) else out.narrow(pl.dim, 0, 0)
        elif not pl.is_replicate():
            raise AssertionError(f"the oracle takes Shard and Replicate placements, got {pl!r}")
    return out


class Pair:
    """Muon on the matrices, torch's AdamW on the rest: one optimizer to a training loop."""

    def __init__(self, muon, adamw):
        self.muon, self.adamw = muon, adamw

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        if self.adamw is not None:
            self.adamw.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.muon.step()
        if self.adamw is not None:
            self.adamw.step()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class AllGatherMuon:
    """``torch.optim.Muon(**kwargs)`` on the full matrices of DTensor ``params`` (see the module
    docstring); ``step()`` and ``zero_grad()`` as an optimizer's."""

    def __init__(self, params, **kwargs):
        self.params = list(params)
        self.shadows: list[list[nn.Parameter]] = []
        for p in self.params:
            full = _full(p).detach()
            self.shadows.append([nn.Parameter(m.clone()) for m in full.reshape(-1, *full.shape[-2:])])
        self.inner = torch.optim.Muon([s for ss in self.shadows for s in ss], **kwargs)
        self.ns_matrices = 0  # matrices this rank orthogonalized (all of them, every step)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        stepped = []
        for p, ss in zip(self.params, self.shadows):
            if p.grad is None:
                for s in ss:
                    s.grad = None
                continue
            full_p, full_g = _full(p), _full(p.grad)
            for s, fp, fg in zip(ss, full_p.reshape(-1, *full_p.shape[-2:]),
                                 full_g.reshape(-1, *full_g.shape[-2:])):
                s.copy_(fp)
                s.grad = fg.clone()
            stepped.append((p, ss))
        self.inner.step()
        for p, ss in stepped:
            self.ns_matrices += len(ss)
            full = torch.stack([s.detach() for s in ss]).reshape(p.shape)
            if isinstance(p, DTensor):
                p.to_local().copy_(local_part(full, p))
            else:  # a single process's parameter (the reference on the global batch)
                p.copy_(full)

    def full_momentum(self, p: DTensor) -> torch.Tensor:
        """The full momentum buffer of ``p`` (its matrices' buffers stacked)."""
        ss = self.shadows[next(i for i, q in enumerate(self.params) if q is p)]
        return torch.stack([self.inner.state[s]["momentum_buffer"] for s in ss]).reshape(p.shape)

    def load_full_momentum(self, p: DTensor, full: torch.Tensor) -> None:
        """Set the full momentum buffer of ``p`` (e.g. read from a checkpoint): its matrices'
        buffers of the inner ``torch.optim.Muon``, as torch creates them (one per matrix)."""
        ss = self.shadows[next(i for i, q in enumerate(self.params) if q is p)]
        for s, m in zip(ss, full.reshape(-1, *full.shape[-2:])):
            self.inner.state[s]["momentum_buffer"] = m.detach().clone()

class WrapperAllGatherMuon:
    """The same for the FullyShardedDataParallel wrapper: ``torch.optim.Muon(**kwargs)`` on full
    copies of the original matrices ``(unit, k)`` (``unit.infos[k]``) of wrapper units. Each
    step all-gathers each unit's flat shard and flat gradient shard (the same gradient bits the
    wrapper's optimizer sees, flat or through ``use_orig_params=True`` views), takes each
    matrix's full parameter and gradient from the unit's layout, steps torch's Muon on all of
    them (every rank every matrix), and writes this rank's range of each back into the shard.
    ``zero_grad`` is the model's (the wrapper's own path)."""

    def __init__(self, matrices, **kwargs):
        self.matrices = list(matrices)
        self.shadows = []
        gathered = {}
        for unit, k in self.matrices:
            if id(unit) not in gathered:
                gathered[id(unit)] = self._gather(unit, unit.shard)
            self.shadows.append(nn.Parameter(self._full(unit, k, gathered[id(unit)]).clone()))
        self.inner = torch.optim.Muon(self.shadows, **kwargs)
        self.ns_matrices = 0
        self.skip: set = set()  # (unit, k) whose gradient the caller cleared: not stepped

    @staticmethod
    def _gather(unit, shard: torch.Tensor) -> torch.Tensor:
        out = shard.new_empty(unit.layout.padded_numel)
        torch.distributed.all_gather_into_tensor(out, shard.contiguous(), group=unit.group)
        return out

    @staticmethod
    def _full(unit, k: int, flat: torch.Tensor) -> torch.Tensor:
        """Original ``k`` of the unit's all-gathered ``flat`` buffer: its tensor, and for a
        tensor-parallel ``Shard(d)`` one the whole matrix (``full_tensor()`` over its TP mesh,
        a collective: every rank steps the same matrices in the same order)."""
        info, off = unit.infos[k], unit.layout.offsets[k]
        local = info.view(flat[off: off + info.numel])
        sp = info.tp_spec
        if sp is None or not any(pl.is_shard() for pl in sp.placements):
            return local
        return DTensor.from_local(local.contiguous(), sp.mesh, sp.placements, shape=sp.shape,
                                  stride=sp.stride, run_check=False).full_tensor()

    @staticmethod
    def _local(unit, k: int, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's chunk of original ``k``'s whole matrix ``full`` (itself when not
        tensor-parallel), as the unit holds it."""
        sp = unit.infos[k].tp_spec
        if sp is None or not any(pl.is_shard() for pl in sp.placements):
            return full
        return local_part(full, DTensor.from_local(
            unit.infos[k].param.detach(), sp.mesh, sp.placements, shape=sp.shape,
            stride=sp.stride, run_check=False))

    @torch.no_grad()
    def step(self) -> None:
        params, grads = {}, {}
        for unit, _ in self.matrices:
            if id(unit) not in params and unit.flat_param.grad is not None:
                params[id(unit)] = self._gather(unit, unit.shard)
                grads[id(unit)] = self._gather(unit, unit.flat_param.grad)
        stepped = []
        for (unit, k), s in zip(self.matrices, self.shadows):
            if id(unit) not in grads or (unit, k) in self.skip:
                s.grad = None
                continue
            s.copy_(self._full(unit, k, params[id(unit)]))
            s.grad = self._full(unit, k, grads[id(unit)]).clone()
            stepped.append((unit, k, s))
        self.inner.step()
        for unit, k, s in stepped:
            self.ns_matrices += 1
            sl = unit.layout.slices[unit.rank][k]
            flat = unit.infos[k].flat(self._local(unit, k, s.detach()))
            unit.shard[sl.shard_offset: sl.shard_offset + sl.numel].copy_(
                flat[sl.param_start: sl.param_start + sl.numel])


def muon_pair(impl: str, model) -> Pair:
    """Muon on ``model``'s matrices (``impl`` "torch": the all-gather oracle, for torch's
    model; else ``cfsdp.optim.Muon``), torch's AdamW on the rest (the usual pairing)."""
    import cfsdp

    mats = [(n, p) for n, p in model.named_parameters() if p.ndim >= 2]
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.ndim < 2], lr=1e-2,
                              weight_decay=0.01)
    if impl == "torch":
        return Pair(AllGatherMuon([p for _, p in mats], lr=0.02), adamw)
    return Pair(cfsdp.optim.Muon(mats, lr=0.02), adamw)


def spy_muon(opt, counts: list) -> None:
    """Record in ``counts``, per step of the ``cfsdp.optim.Muon`` ``opt``, ``[matrices this rank
    orthogonalizes, exchanges it joins]``."""
    inner, step = opt._cf_orthogonalize, opt.step

    def ortho(updates, group, **kw):
        counts[-1][0] += sum(math.prod(u.shape[:-2]) for u in updates)
        return inner(updates, group, **kw)

    def counted_exchange(*a, **k):
        counts[-1][1] += 1
        return exchange(*a, **k)

    def counted_step(*a, **k):
        counts.append([0, 0])
        _muon.exchange = counted_exchange
        try:
            return step(*a, **k)
        finally:
            _muon.exchange = exchange

    opt._cf_orthogonalize, opt.step = ortho, counted_step


@contextlib.contextmanager
def small_buckets(bound: int):
    """Within: ``cfsdp.optim.Muon``'s exchange cuts its matrices into buckets of at most
    ``bound`` bytes on the wire (a larger matrix alone); yields a list that gets each exchange's
    bucket count (its plan, from ``_muon_owners.plan_buckets``)."""
    plans: list = []
    old_bound, plan = _muon_bucket.BUCKET_BYTES, _muon_bucket.plan_buckets

    def counted(nbytes, b):
        out = plan(nbytes, b)
        plans.append(len(out))
        return out

    _muon_bucket.BUCKET_BYTES, _muon_bucket.plan_buckets = bound, counted
    try:
        yield plans
    finally:
        _muon_bucket.BUCKET_BYTES, _muon_bucket.plan_buckets = old_bound, plan


def shm_expected() -> bool:
    """Whether cfsdp's collectives on one host take shared memory in this process (the C core,
    ``CFSDP_SHM`` not "0"): then Muon's exchange must too."""
    import os

    import cfsdp

    return cfsdp.backend == "c" and os.environ.get("CFSDP_SHM", "1").strip() != "0"


@contextlib.contextmanager
def exchange_transports():
    """Within: every all-to-all of ``cfsdp.optim.Muon``'s exchange is recorded by the transport
    that carries it (``comm.transport(...).transport``: "shared memory (...)", "process group
    ...", "two levels ..."); yields that list."""
    from cfsdp._runtime import comm

    seen: list = []
    real = comm.all_to_all

    def spy(out, inp, counts, group, async_op):
        seen.append(comm.transport(group, inp).transport)
        return real(out, inp, counts, group, async_op)

    _muon_bucket.comm.all_to_all = spy
    try:
        yield seen
    finally:
        _muon_bucket.comm.all_to_all = real
