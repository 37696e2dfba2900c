"""Muon's optimizer step on sharded parameters: cfsdp against the all-gather-everywhere Muon.

Launch with torchrun (one thread per rank), once per world size::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/bench_muon.py \\
        --out benchmarks/out/muon_w2.json
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 benchmarks/bench_muon.py \\
        --out benchmarks/out/muon_w4.json

The model is ``--blocks`` transformer-like blocks of width ``--dim`` whose weights are all
matrices (per block ``qkv`` [3d, d], ``proj`` [d, d], ``fc1`` [4d, d], ``fc2`` [d, 4d]; no
bias), each block and the root ``fully_shard``-ed (dim-0 shards).  One forward/backward
on a fixed batch makes the gradients; then ``step()`` is timed on them ``--iters`` times
per contender, in rounds (every contender once per round, in a rotating order, each after a
barrier, the slowest rank's time kept: the machine is shared).  Contenders:

=================  =====================================================================
``allgather``      (a) torch's ``fully_shard`` + the all-gather-everywhere Muon that trainers
                   write by hand: momentum on the local shard, every update all-gathered
                   (``full_tensor()``) to every rank, EVERY rank runs torch's
                   Newton–Schulz on EVERY matrix, keeps its own rows
``torch_dtensor``  (b) ``torch.optim.Muon`` given ``fully_shard``'s DTensor parameters as they
                   are (DTensor's op dispatch does the gathers), if it runs
``single``         (c) ``torch.optim.Muon`` in one process on the whole model (rank 0; the
                   others wait at the barrier)
``cfsdp``          ``cfsdp.fully_shard`` + ``cfsdp.optim.Muon``: each matrix orthogonalized
                   by one owner rank, the exchange through shared memory (the run fails if
                   the group does not take it)
``cfsdp_pg``       the same on a second process group over the same ranks, set up with
                   ``CFSDP_SHM=0``: the exchange through gloo's ``all_to_all_single`` (what
                   cfsdp did before its shared-memory all-to-all)
=================  =====================================================================

``--contenders`` picks some of them (default: all).

Per contender: **step ms** (median and min over rounds), **NS GFLOP/rank**
(Newton–Schulz work per step on the busiest rank, counted from the shapes each rank's
Newton–Schulz calls get: per iteration ``4 m^2 n + 2 m^3`` for an ``m x n`` matrix,
``m <= n``; for (b) these are the DTensors' global shapes: DTensor's dispatch decides the
local work), **peak MiB/rank** (the RSS high-water mark over the timed steps minus the
RSS before them, the largest rank's) and **max |param - single|** after the same number
of steps from the same start (the numbers check: cfsdp and (a) must be 0).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fsdp import _read_status_kib, release_memory, reset_peak_rss  # noqa: E402

import cfsdp  # noqa: E402
import cfsdp.optim._muon as cf_muon  # noqa: E402
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402
from cfsdp._runtime import comm  # noqa: E402
from torch.optim import _muon as torch_muon  # noqa: E402

LR, MOMENTUM, WD = 0.02, 0.95, 0.01


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc1 = nn.Linear(d, 4 * d, bias=False)
        self.fc2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        h = self.qkv(x).unflatten(-1, (3, -1)).sum(-2)
        x = x + self.proj(h)
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d: int, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


# --------------------------------------------------------------------------
# Newton–Schulz work, counted from the shapes each rank orthogonalizes

_flops = [0]


def _ns_flops(shape: torch.Size, steps: int) -> int:
    *batch, m, n = shape
    m, n = min(m, n), max(m, n)
    b = 1
    for s in batch:
        b *= s
    return b * steps * (4 * m * m * n + 2 * m ** 3)


@contextlib.contextmanager
def counting_newton_schulz():
    """Count every Newton–Schulz call's work, torch's function and cfsdp's."""
    t_fn, c_fn = torch_muon._zeropower_via_newtonschulz, cf_muon._newton_schulz

    def t_count(grad, coeffs, steps, eps):
        _flops[0] += _ns_flops(grad.shape, steps)
        return t_fn(grad, coeffs, steps, eps)

    def c_count(x, coeffs, steps, eps):
        _flops[0] += _ns_flops(x.shape, steps)
        return c_fn(x, coeffs, steps, eps)

    torch_muon._zeropower_via_newtonschulz, cf_muon._newton_schulz = t_count, c_count
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz, cf_muon._newton_schulz = t_fn, c_fn


# --------------------------------------------------------------------------
# contender (a): the all-gather-everywhere Muon on FSDP2's DTensors


class AllGatherMuon:
    """Momentum on the local shard, the update all-gathered to every rank, torch's
    Newton–Schulz on every matrix by every rank, the rank's rows written back: torch Muon's
    numbers (momentum is elementwise) at W-fold Newton–Schulz work."""

    def __init__(self, params, lr=LR, momentum=MOMENTUM, weight_decay=WD):
        self.params = list(params)
        self.lr, self.momentum, self.wd = lr, momentum, weight_decay
        self.bufs = [torch.zeros_like(p.to_local()) for p in self.params]
        self.coeffs = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
        self.steps, self.eps = torch_muon.DEFAULT_NS_STEPS, torch_muon.EPS

    @torch.no_grad()
    def step(self) -> None:
        for p, buf in zip(self.params, self.bufs):
            g = p.grad.to_local()
            buf.lerp_(g, 1 - self.momentum)
            update = g.lerp(buf, self.momentum)  # nesterov (torch's default)
            full = DTensor.from_local(update, p.device_mesh, p.placements,
                                      shape=p.shape, stride=p.stride()).full_tensor()
            ortho = torch_muon._zeropower_via_newtonschulz(full, self.coeffs, self.steps,
                                                           self.eps)
            rank = p.device_mesh.get_local_rank()
            chunk = ortho.chunk(p.device_mesh.size(), dim=0)
            mine = chunk[rank] if rank < len(chunk) else ortho[:0]
            lr = torch_muon._adjust_lr(self.lr, None, p.shape)
            local = p.to_local()
            local.mul_(1 - self.lr * self.wd)
            local.add_(mine, alpha=-lr)


# --------------------------------------------------------------------------
# building and measuring


def build(name: str, args, mesh) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = Net(args.dim, args.blocks)
    kw = dict(lr=LR, momentum=MOMENTUM, weight_decay=WD)
    if name == "single":
        return model, torch.optim.Muon(model.parameters(), **kw)
    shard = cfsdp.fully_shard if name.startswith("cfsdp") else torch_fully_shard
    for b in model.blocks:
        shard(b, mesh=mesh)
    shard(model, mesh=mesh)
    if name.startswith("cfsdp"):
        return model, cfsdp.optim.Muon(model.parameters(), **kw)
    if name == "allgather":
        return model, AllGatherMuon(model.parameters(), **kw)
    return model, torch.optim.Muon(model.parameters(), **kw)


def full_params(model: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for p in model.parameters()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--contenders", default="allgather,torch_dtensor,single,cfsdp,cfsdp_pg")
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
    # cfsdp_pg: a second group over the same ranks whose transport is set up (at its first
    # collective, the build's forward below) with shared memory off
    pg_mesh = DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu")
    torch.manual_seed(1)
    x = torch.randn(8, 32, args.dim)  # the same global batch on every rank

    names = args.contenders.split(",")
    built, errors = {}, {}
    for name in names:
        saved = os.environ.get("CFSDP_SHM")
        if name == "cfsdp_pg":
            os.environ["CFSDP_SHM"] = "0"
        try:
            model, opt = build(name, args, pg_mesh if name == "cfsdp_pg" else mesh)
            model(x).square().mean().backward()
            built[name] = (model, opt)
        except Exception as e:  # noqa: BLE001 - (b) may not run: its error is the result
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        finally:
            if saved is None:
                os.environ.pop("CFSDP_SHM", None)
            else:
                os.environ["CFSDP_SHM"] = saved
    for name, group in (("cfsdp", mesh.get_group()), ("cfsdp_pg", pg_mesh.get_group())):
        if name in built:  # what each exchange goes through, or the comparison means nothing
            want = "shared memory" if name == "cfsdp" else "process group"
            got = comm.describe(group)
            if not got.startswith(want):
                raise SystemExit(f"{name}: the exchange's group takes {got!r}, not {want}")

    # the numbers: the same steps from the same start, against the single process
    ref = None
    diffs: dict[str, float] = {}
    for name in ["single"] + [n for n in names if n != "single"]:
        if name not in built or name in errors:
            continue
        model, opt = build(name, args, pg_mesh if name == "cfsdp_pg" else mesh)
        try:
            for _ in range(args.check_steps):
                for p in model.parameters():
                    p.grad = None
                model(x).square().mean().backward()
                opt.step()
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            built.pop(name, None)
            continue
        got = full_params(model)
        if ref is None:
            ref = got
        diffs[name] = max(float((a - b).abs().max()) for a, b in zip(got, ref))
        del model, opt

    times: dict[str, list[float]] = {n: [] for n in built}
    flops: dict[str, int] = {}
    peaks: dict[str, int] = {}
    order = list(built)
    with counting_newton_schulz():
        for r in range(args.warmup + args.iters):
            order = order[1:] + order[:1]
            for name in order:
                model, opt = built[name]
                release_memory()
                base = _read_status_kib("VmRSS")
                reset_peak_rss()
                _flops[0] = 0
                dist.barrier()
                t0 = time.perf_counter()
                if name != "single" or rank == 0:
                    opt.step()
                dt = time.perf_counter() - t0
                peak = _read_status_kib("VmHWM") - base
                gathered = [None] * world
                dist.all_gather_object(gathered, (dt, _flops[0], peak))
                if r >= args.warmup:
                    times[name].append(max(g[0] for g in gathered))
                    flops[name] = max(g[1] for g in gathered)
                    peaks[name] = max(peaks.get(name, 0), max(g[2] for g in gathered))
    if rank != 0:
        dist.destroy_process_group()
        return
    res = {}
    for name in names:
        if name not in built:
            res[name] = {"error": errors.get(name, "not built")}
            continue
        ts = times[name]
        res[name] = {"step_ms_median": 1e3 * statistics.median(ts), "step_ms_min": 1e3 * min(ts),
                     "ns_gflop_per_rank": flops[name] / 1e9, "peak_mib_per_rank": peaks[name] / 1024,
                     "max_abs_diff_vs_single": diffs.get(name), "times_s": ts}
    a = res.get("allgather", {})
    print(f"world {world}, dim {args.dim}, blocks {args.blocks}, {args.iters} rounds")
    print("| contender | step ms (median) | min | x (a) | NS GFLOP/rank | peak MiB/rank | max |diff| vs single |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        r = res[name]
        if "error" in r:
            print(f"| {name} | did not run: {r['error']} | | | | | |")
            continue
        ratio = r["step_ms_median"] / a["step_ms_median"] if "step_ms_median" in a else float("nan")
        print(f"| {name} | {r['step_ms_median']:.1f} | {r['step_ms_min']:.1f} | {ratio:.2f} | "
              f"{r['ns_gflop_per_rank']:.3f} | {r['peak_mib_per_rank']:.1f} | "
              f"{r['max_abs_diff_vs_single']} |")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"world": world, "args": vars(args), "results": res,
                       "machine": {"python": platform.python_version(), "torch": torch.__version__,
                                   "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%MZ",
                                                                                 time.gmtime())}},
                      f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
