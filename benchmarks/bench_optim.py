"""Optimizer step on sharded parameters: cfsdp.optim.AdamW against torch's AdamW.

Launch with torchrun (2 ranks, one thread each)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/bench_optim.py \\
        --out benchmarks/out/optim.json

The GPT-2-like model of ``bench_fsdp.py`` is sharded by each face (cfsdp's ``fully_shard``,
torch's ``fully_shard``, cfsdp's FSDP1 wrapper with ``use_orig_params`` False and True); one
forward/backward gives every parameter its (sharded) gradient, then each optimizer times
``optimizer.step()`` on the SAME parameters and gradients: cfsdp.optim.AdamW and
torch.optim.AdamW with ``foreach=False`` (torch's CPU default), ``foreach=True`` and
``fused=True``.  Besides the parameters as the face gives them (DTensors for fully_shard),
each also runs on the plain local shards (``nn.Parameter`` views of the DTensors' local
tensors, gradients likewise), which is what torch's kernels see without DTensor dispatch.
Every optimizer keeps its own state; steps change the parameters, which does not matter for
timing.  Reported: the median over ``--iters`` steps (after ``--warmup``) of the slower rank,
the ratio of cfsdp's step to torch's fastest, and the bytes the fused step must move (Adam:
read p, g, m, v and write p, m, v: 28 bytes per element) against the time, as a bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fsdp import Setup, machine_info, wrap_cfsdp_fs, wrap_fsdp2  # noqa: E402
from models import GPTConfig, build_model, config_dict, make_batch, wrap_unit_class  # noqa: E402

SEED = 0
FUSED_BYTES_PER_ELEM = 28  # AdamW, no amsgrad: read p, g, m, v; write p, m, v (fp32)


def wrap_cfsdp1(model: nn.Module, cfg: GPTConfig, uop: bool) -> nn.Module:
    import cfsdp
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return cfsdp.FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({wrap_unit_class(cfg)}),
        use_orig_params=uop, device_id=torch.device("cpu"))


FACES: dict[str, Callable[[nn.Module, GPTConfig], nn.Module]] = {
    "cfsdp_fs": lambda m, cfg: wrap_cfsdp_fs(m, cfg, Setup()),
    "fsdp2": lambda m, cfg: wrap_fsdp2(m, cfg, Setup()),
    "cfsdp_fsdp1_flat": lambda m, cfg: wrap_cfsdp1(m, cfg, False),
    "cfsdp_fsdp1_orig": lambda m, cfg: wrap_cfsdp1(m, cfg, True),
}


def optimizers() -> dict[str, Callable[[list], torch.optim.Optimizer]]:
    import cfsdp.optim

    kw = dict(lr=1e-4, weight_decay=0.01)
    return {
        "cfsdp": lambda ps: cfsdp.optim.AdamW(ps, **kw),
        "torch_single": lambda ps: torch.optim.AdamW(ps, foreach=False, **kw),
        "torch_foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **kw),
        "torch_fused": lambda ps: torch.optim.AdamW(ps, fused=True, **kw),
    }


def plain_views(params: list) -> list:
    """nn.Parameters aliasing the local shards (and local gradients) of ``params``."""
    out = []
    for p in params:
        lp = p.to_local() if isinstance(p, DTensor) else p.detach()
        q = nn.Parameter(lp)
        g = p.grad
        q.grad = g.to_local() if isinstance(g, DTensor) else g
        out.append(q)
    return out


def time_steps(opt: torch.optim.Optimizer, warmup: int, iters: int) -> list[float]:
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
    return times


def slower_rank_median(times: list[float]) -> float:
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run_face(face: str, cfg: GPTConfig, args: argparse.Namespace) -> dict[str, Any]:
    model = FACES[face](build_model(cfg, SEED), cfg)
    x, y = make_batch(cfg, SEED, dist.get_rank(), 0)
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    numel = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    res: dict[str, Any] = {"local_numel": numel, "n_params": len(params), "steps": {}}
    kinds = [("dtensor" if isinstance(params[0], DTensor) else "face", params)]
    kinds.append(("plain", plain_views(params)))
    for kind, ps in kinds:
        for name, make in optimizers().items():
            key = f"{kind}/{name}"
            try:
                opt = make(ps)
                med = slower_rank_median(time_steps(opt, args.warmup, args.iters))
                res["steps"][key] = {"median_s": med,
                                     "GB_per_s": FUSED_BYTES_PER_ELEM * numel / med / 1e9}
                del opt
            except Exception as e:  # a torch kernel that does not take these tensors
                res["steps"][key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    for kind, _ in kinds:
        torch_times = [v["median_s"] for k, v in res["steps"].items()
                       if k.startswith(kind + "/torch") and "median_s" in v]
        ours = res["steps"].get(f"{kind}/cfsdp", {}).get("median_s")
        if torch_times and ours:
            res[f"{kind}/ratio_vs_fastest_torch"] = ours / min(torch_times)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--faces", default=",".join(FACES), help="comma-separated subset of " + ",".join(FACES))
    p.add_argument("--out", default=None, help="JSON results (rank 0)")
    args = p.parse_args()
    args.set = []
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = GPTConfig()
    results = {"machine": machine_info(args, False, Setup()), "model": config_dict(cfg), "faces": {}}
    for face in args.faces.split(","):
        results["faces"][face] = run_face(face, cfg, args)
        if dist.get_rank() == 0:
            r = results["faces"][face]
            print(f"\n{face}: {r['n_params']} params, {r['local_numel'] / 1e6:.2f} M elements per rank")
            for key, v in r["steps"].items():
                if "median_s" in v:
                    print(f"  {key:24s} {1e3 * v['median_s']:9.2f} ms   {v['GB_per_s']:6.2f} GB/s (at 28 B/elem)")
                else:
                    print(f"  {key:24s}  n/a: {v['error']}")
            for key, v in r.items():
                if key.endswith("ratio_vs_fastest_torch"):
                    print(f"  {key}: {v:.3f}")
    if dist.get_rank() == 0 and args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
