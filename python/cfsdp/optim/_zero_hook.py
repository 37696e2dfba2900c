"""ZeRO-2 under DDP: ``cfsdp.optim.reduce_scatter_hook``, a DDP communication hook that
reduce-scatters each gradient bucket to the owners of its parameters.

[Note: ZeRO-2 hook]
Optional and off by default (beyond torch)::

    ddp = DDP(model)
    zero = cfsdp.optim.ZeroRedundancyOptimizer(ddp.parameters(), cfsdp.optim.AdamW, lr=1e-3)
    ddp.register_comm_hook(zero, cfsdp.optim.reduce_scatter_hook)

DDP hands the hook each bucket of gradients (flat, in DDP's order) as it becomes ready.
A rank steps only the parameters it owns ([Note: ZeRO partition] in ``zero.py``), so it
needs the reduced gradient of those only: the hook packs the bucket rank-major (each
rank's owned elements in bucket order, padded to the largest rank's count ``B``; one
``torch.cat`` into a scratch buffer), reduce-scatters it with ``comm.reduce_scatter``
(sum times ``1/W``, DDP's average; shared memory within a host, the process group
otherwise) and copies its block back over its own parameters' places in the bucket.  A
reduce-scatter moves half the bytes of DDP's all-reduce (gloo's reduce-scatter is an
all-reduce inside: there the bytes are the same).

After DDP has copied the buckets into the gradients (its end-of-backward callback), the
gradients of the parameters this rank does not own are set to ``None``: a rank holds
gradients only for what it steps.  (The hook queues an autograd final callback that
queues a second one, which therefore runs after DDP's.)  A parameter listed twice in the
optimizer may be stepped on several ranks ([Note: ZeRO duplicate parameters] in
``_zero_buckets.py``): each of them gets its gradient (the packing lists it once per such
rank).  Hence:

* ``torch.nn.utils.clip_grad_norm_(model.parameters())`` would see this rank's gradients
  only: use ``zero.clip_grad_norm_`` (the norm of all owners' gradients);
* gradients may be accumulated over several backward passes under ``ddp.no_sync()``
  only; a second synchronised backward before ``step()`` / ``zero_grad()`` would add the
  owned parameters' earlier gradient once instead of ``W`` times, so the hook raises
  ``RuntimeError`` saying so;
* a rank that joined early (``Join([ddp, zero])`` with uneven inputs) takes part in DDP's
  shadow reductions through this hook, outside any backward pass: there the hook gives
  its owned parameters the reduced gradients (the other ranks' average, as DDP's join
  divides by the initial world size), so the ZeRO join hook's ``step()`` updates them
  right, without a gradient-setting hook of the user's.

Memory: DDP still allocates its buckets for every gradient (they are DDP's); the hook adds
one scratch of the largest bucket's ``W * B + B`` elements per dtype.  Each bucket's
reduce-scatter completes inside the hook (it returns a completed future), so it does not
overlap the rest of the backward pass as DDP's asynchronous all-reduce does.

Numerics: DDP multiplies each gradient by ``1/W`` and all-reduces the sum; the hook sums
and multiplies once.  With ``W`` a power of two the scaling is exact, so at ``W = 2`` the
gradients are DDP's bit for bit; otherwise they differ by the rounding of the sum's
order (and of ``1/W``).
"""

# no ``from __future__ import annotations`` here: DDP's register_comm_hook compares the
# hook's annotations with the objects dist.GradBucket and torch.futures.Future[torch.Tensor]
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _core
from .._runtime import comm
from .._torch import core as _torch_core
from .zero import ZeroRedundancyOptimizer

__all__ = ["reduce_scatter_hook"]

_ENGINE = _torch_core.ENGINE


class _BucketPlan:
    """How one DDP bucket is packed rank-major and unpacked (built once per bucket)."""

    def __init__(self, zero: ZeroRedundancyOptimizer, bucket: dist.GradBucket, key: tuple):
        self.key = key
        buf = bucket.buffer()
        W, rank, holders = zero.world_size, zero.rank, zero._param_holders
        spans: list = [[] for _ in range(W)]  # per rank: (bucket view, numel)
        self.foreign: list = []
        for i, (p, g) in enumerate(zip(bucket.parameters(), bucket.gradients())):
            ranks = holders.get(p)  # its owner; every rank stepping a copy of a duplicate
            if ranks is None:
                raise ValueError(
                    f"cfsdp.optim.reduce_scatter_hook: parameter {i} of DDP bucket "
                    f"{bucket.index()} (shape {tuple(p.shape)}) is not a parameter of the "
                    "ZeroRedundancyOptimizer the hook was registered with; give that "
                    "optimizer all of the DDP model's trainable parameters")
            off = (_core.address(g) - _core.address(buf)) // buf.element_size()
            if g.numel() != p.numel() or not 0 <= off <= buf.numel() - p.numel():
                raise AssertionError(f"DDP bucket {bucket.index()}: gradient {i} is not a view "
                                     "of the bucket's buffer")
            for r in ranks:
                spans[r].append((buf[off : off + p.numel()], p))
            if rank not in ranks:
                self.foreign.append(p)
        counts = [sum(v.numel() for v, _ in row) for row in spans]
        self.B = max(counts)
        zeros = torch.zeros(self.B - min(counts), dtype=buf.dtype, device=buf.device)
        self.pieces = []  # the rank-major packing, padding included
        for row, n in zip(spans, counts):
            self.pieces += [v for v, _ in row] + ([zeros[: self.B - n]] if n < self.B else [])
        self.mine = spans[rank]
        self.dtype, self.device = buf.dtype, buf.device


def _plan(zero: ZeroRedundancyOptimizer, bucket: dist.GradBucket) -> _BucketPlan:
    buf = bucket.buffer()
    key = (_core.address(buf), buf.numel(), buf.dtype, tuple(map(id, bucket.parameters())))
    plan = zero._rs_plans.get(bucket.index())
    if plan is None or plan.key != key:  # DDP rebuilds its buckets after the first pass
        plan = zero._rs_plans[bucket.index()] = _BucketPlan(zero, bucket, key)
    return plan


def _scratch(zero: ZeroRedundancyOptimizer, plan: "_BucketPlan") -> tuple[Tensor, Tensor]:
    W, n = zero.world_size, plan.B
    s = zero._rs_scratch.get(plan.dtype)
    if s is None or s.numel() < (W + 1) * n:
        s = zero._rs_scratch[plan.dtype] = torch.empty((W + 1) * n, dtype=plan.dtype,
                                                      device=plan.device)
    return s[: W * n], s[W * n : (W + 1) * n]


def _after_ddp(zero: ZeroRedundancyOptimizer) -> None:
    """End of backward, after DDP copied the buckets into the gradients."""
    for plan in zero._rs_plans.values():
        for p in plan.foreign:
            p.grad = None
    zero._rs_in_backward = False
    zero._grads_partitioned = True


def reduce_scatter_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """ZeRO-2 for DDP (see [Note: ZeRO-2 hook]): register it with
    ``ddp.register_comm_hook(zero, cfsdp.optim.reduce_scatter_hook)``, ``zero`` a
    ``cfsdp.optim.ZeroRedundancyOptimizer`` over the DDP model's parameters on DDP's
    process group.  Each rank ends the backward pass with the averaged gradients of the
    parameters it owns and ``None`` for the others."""
    zero = state
    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise TypeError("cfsdp.optim.reduce_scatter_hook: register it with the "
                        "cfsdp.optim.ZeroRedundancyOptimizer as its state: "
                        f"ddp.register_comm_hook(zero, reduce_scatter_hook), not {type(state)}")
    in_backward = True
    if not zero._rs_in_backward:  # the first bucket of a backward pass (or of a shadow)
        try:
            _ENGINE.queue_callback(lambda: _ENGINE.queue_callback(lambda: _after_ddp(zero)))
        except RuntimeError:  # not in a backward pass: DDP's Join shadow of one
            in_backward = False
        if in_backward:
            if zero._grads_partitioned:
                raise RuntimeError(
                    "cfsdp.optim.reduce_scatter_hook: a second synchronised backward pass "
                    "before step() or zero_grad(): each rank keeps only the reduced gradients "
                    "of the parameters it owns, so accumulating over synchronised passes "
                    "would count the earlier gradients once instead of once per rank. "
                    "Accumulate under ddp.no_sync() and synchronise the last pass only.")
            zero._rs_in_backward = True
    plan = _plan(zero, bucket)
    if plan.B:
        inp, out = _scratch(zero, plan)
        torch.cat(plan.pieces, out=inp)
        comm.reduce_scatter(out, inp, zero.process_group, async_op=False,
                            scale=1.0 / zero.world_size)
        off = 0
        for view, p in plan.mine:
            n = view.numel()
            view.copy_(out[off : off + n])
            if not in_backward:  # a joined rank: its owned gradients, for its step
                p.grad = out[off : off + n].view_as(p).clone()
            off += n
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
