"""ZeroRedundancyOptimizer: cfsdp's against torch's, plain DDP + AdamW and cfsdp's FSDP wrapper.

Launch with torchrun (2 ranks, one thread each)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/bench_zero.py \\
        --out benchmarks/out/zero.json

The model is bench_fsdp.py's GPT-2-like one with 2 blocks of width 512 and a vocabulary
of 2048 (8.47M parameters; ``--set KEY=VALUE`` changes a field), per-rank batch 2 x 128
tokens, the same seed and data for every contender.  Contenders, one after another:

==============================  ============================================================
``ddp``                         DDP + ``torch.optim.AdamW`` (the reference for the losses)
``torch_zero``                  DDP + torch's ZeroRedundancyOptimizer(torch AdamW)
``torch_zero_bv``               the same with ``parameters_as_bucket_view=True``
``torch_zero_bv_cfsdp_adamw``   torch's ZeRO (bucket view) with ``cfsdp.optim.AdamW`` inside
``cfsdp_zero``                  DDP + cfsdp's ZeroRedundancyOptimizer(cfsdp.optim.AdamW)
``cfsdp_zero_bv``               the same with ``parameters_as_bucket_view=True``
``cfsdp_zero2``                 ``cfsdp_zero_bv`` + ``cfsdp.optim.reduce_scatter_hook`` (ZeRO-2)
``cfsdp_fsdp``                  ``cfsdp.FullyShardedDataParallel`` (a unit per block) +
                                ``cfsdp.optim.AdamW``
==============================  ============================================================

Every contender is built first; then each measurement runs in rounds, every contender once
per round in a rotating order, each timed after a barrier, the slowest rank's time kept:
the machine is shared, and interleaving spreads the other load over all contenders alike.
The tables give the median over the timed rounds after ``--warmup`` (``--iters`` end-to-end,
``--step-iters`` of ``step()`` and its halves), and, in a second table, the minimum: the
cost with the least interference from the machine's other load.  Per contender:

* **step ms**: ``optimizer.step()`` alone, after a barrier, repeated on one backward's
  gradients (a ZeRO's step includes its parameter sync); for the ZeROs also its two
  halves, **local ms** (``_local_step()``) and **sync ms** (``_sync_params()``), which
  both implementations have;
* **e2e ms**: a whole iteration (zero_grad, forward, cross-entropy, backward, step),
  after a barrier;
* **state MiB/rank**: the optimizer state's bytes on each rank (distinct storages: a flat
  buffer counted once), the largest rank's and the share of the total (ZeRO target 1/W);
* **param MiB/rank**: the parameters' bytes on each rank (distinct storages of the
  model's parameters), each storage weighted by its mapping's proportional set size
  over its resident size (``Pss / Rss`` in ``/proc/self/smaps``: 1 for private memory,
  1/W for cfsdp's bucket shared by W ranks), the largest rank's;
* **consolidate ms**: ZeROs: ``consolidate_state_dict(0)`` then ``state_dict()`` on rank
  0, ending with a barrier (``--consolidate-iters`` rounds after one warm-up); the FSDP wrapper:
  ``FSDP.optim_state_dict(model, optim)`` (full); plain DDP: none (its state is whole);
* **max rel loss diff vs ddp** over the e2e steps (cfsdp.optim's Adam is a few ulps from
  torch's per step: torch's CPU sqrt is MKL's; the torch-AdamW ZeROs must be 0).

Ratios in the table are to ``torch_zero_bv``, the faster torch ZeRO.  The JSON holds
everything, per-step times and losses included, and the machine block.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fsdp import exit_now, machine_info_basic, release_memory  # noqa: E402
from models import GPTConfig, build_model, config_dict, make_batch, wrap_unit_class  # noqa: E402

SEED = 0
LR = 1e-3
BASE = GPTConfig(n_layer=2, d_model=512, vocab_size=2048)
CONTENDERS = ("ddp", "torch_zero", "torch_zero_bv", "torch_zero_bv_cfsdp_adamw", "cfsdp_zero",
              "cfsdp_zero_bv", "cfsdp_zero2", "cfsdp_fsdp")
RATIO_TO = "torch_zero_bv"


def build(name: str, cfg: GPTConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
    import cfsdp

    model = build_model(cfg, SEED)
    kw = dict(lr=LR)
    if name == "ddp":
        m = DDP(model)
        return m, torch.optim.AdamW(m.parameters(), **kw)
    if name == "cfsdp_fsdp":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        m = cfsdp.FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy(
            {wrap_unit_class(cfg)}), device_id=torch.device("cpu"))
        return m, cfsdp.optim.AdamW(m.parameters(), **kw)
    m = DDP(model)
    bv = name.endswith("_bv") or name.endswith("_bv_cfsdp_adamw") or name == "cfsdp_zero2"
    if name.startswith("torch_zero"):
        inner = cfsdp.optim.AdamW if name.endswith("cfsdp_adamw") else torch.optim.AdamW
        return m, TorchZeRO(m.parameters(), inner, parameters_as_bucket_view=bv, **kw)
    opt = cfsdp.ZeroRedundancyOptimizer(m.parameters(), cfsdp.optim.AdamW,
                                        parameters_as_bucket_view=bv, **kw)
    if name == "cfsdp_zero2":
        m.register_comm_hook(opt, cfsdp.optim.reduce_scatter_hook)
    return m, opt


def fwd_bwd(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach()


def slowest(times: list[float]) -> list[float]:
    """Per round, the slowest rank's time (seconds)."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def rounds(names: list, n: int, body: Callable[[str], Any]) -> dict[str, list[float]]:
    """``n`` rounds; in each, every contender once (the order rotated every round), timed
    after a barrier.  Interleaving spreads the machine's other load over all contenders
    alike (the benchmark machine is shared).  Returns the slowest rank's times."""
    out: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n):
        k = i % max(1, len(names))
        for name in names[k:] + names[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            body(name)
            out[name].append(time.perf_counter() - t0)
    return {name: slowest(ts) for name, ts in out.items()}


def summary(times: list[float], skip: int) -> dict[str, float]:
    ts = times[skip:]
    return {"median_s": statistics.median(ts), "min_s": min(ts)}


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages of this rank's optimizer state tensors."""
    state = opt.optim.state if hasattr(opt, "consolidate_state_dict") else opt.state
    seen: dict[int, int] = {}
    for st in state.values():
        for v in (st or {}).values():
            if isinstance(v, torch.Tensor):
                t = v.to_local() if hasattr(v, "to_local") else v
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _mappings() -> list[tuple[int, int, float]]:
    """This process's memory mappings: (start, end, Pss / Rss), from /proc/self/smaps."""
    out: list = []
    start = end = rss = 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = head[0].split("-")
                start, end = int(lo, 16), int(hi, 16)
            elif head[0] == "Rss:":
                rss = int(head[1])
            elif head[0] == "Pss:":
                out.append((start, end, int(head[1]) / rss if rss else 1.0))
    return out


def param_bytes(model: nn.Module) -> float:
    """This rank's share of its parameters' bytes: every distinct storage weighted by the
    Pss / Rss of the mapping that holds it (1: private; 1/W: shared by W processes)."""
    maps = _mappings()
    seen: dict[int, int] = {}
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    total = 0.0
    for ptr, n in seen.items():
        share = next((f for lo, hi, f in maps if lo <= ptr < hi), 1.0)
        total += n * min(1.0, share)
    return total


def run_all(names: list, cfg: GPTConfig, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every contender built at once, then timed round by round (see ``rounds``)."""
    import cfsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    built: dict[str, tuple] = {}
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            built[name] = build(name, cfg)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    live = [name for name in names if name in built]
    n = args.warmup + args.iters
    losses: dict[str, list[float]] = {name: [] for name in live}

    def iteration(name: str) -> None:
        model, opt = built[name]
        x, y = make_batch(cfg, SEED, rank, len(losses[name]))
        opt.zero_grad(set_to_none=True)
        losses[name].append(float(fwd_bwd(model, x, y)))
        opt.step()

    e2e = rounds(live, n, iteration)
    for name in live:  # one backward's gradients for the step-only rounds
        model, opt = built[name]
        x, y = make_batch(cfg, SEED, rank, n)
        opt.zero_grad(set_to_none=True)
        fwd_bwd(model, x, y)
    ns = args.warmup + args.step_iters
    step = rounds(live, ns, lambda name: built[name][1].step())
    zeros = [name for name in live if hasattr(built[name][1], "_sync_params")]
    local = rounds(zeros, ns, lambda name: built[name][1]._local_step())
    sync = rounds(zeros, ns, lambda name: built[name][1]._sync_params())

    def consolidate(name: str) -> None:
        model, opt = built[name]
        if name == "cfsdp_fsdp":
            cfsdp.FullyShardedDataParallel.optim_state_dict(model, opt)
            return
        opt.consolidate_state_dict(0)
        if rank == 0:
            opt.state_dict()
        dist.barrier()

    cons_names = [name for name in live if name == "cfsdp_fsdp" or name in zeros]
    cons = rounds(cons_names, args.consolidate_iters + 1, consolidate)
    for name in live:
        sb = torch.tensor([state_bytes(built[name][1]), param_bytes(built[name][0])],
                          dtype=torch.float64)
        all_sb = [torch.zeros_like(sb) for _ in range(world)]
        dist.all_gather(all_sb, sb)
        r: dict[str, Any] = {"e2e": summary(e2e[name], args.warmup),
                             "step": summary(step[name], args.warmup),
                             "state_bytes_per_rank": [int(t[0]) for t in all_sb],
                             "param_bytes_per_rank": [int(t[1]) for t in all_sb],
                             "losses": losses[name], "e2e_times": e2e[name][args.warmup:],
                             "step_times": step[name][args.warmup:]}
        if name in zeros:
            r["local"] = summary(local[name], args.warmup)
            r["sync"] = summary(sync[name], args.warmup)
        if name in cons:
            r["consolidate"] = summary(cons[name], 1)  # the first one warms up
        results[name] = r
    built.clear()
    release_memory()
    return {name: results[name] for name in names}


def table(results: dict[str, dict[str, Any]], world: int, stat: str) -> str:
    """One markdown table of ``stat`` ("median_s" or "min_s") over the timed rounds."""
    ref = results.get(RATIO_TO, {})
    ddp_losses = results.get("ddp", {}).get("losses")
    cols = ["contender", "step ms", f"step / {RATIO_TO}", "local ms", "sync ms", "e2e ms",
            f"e2e / {RATIO_TO}", "state MiB/rank (max)", "state share of total",
            "param MiB/rank (max)", "consolidate ms", f"consolidate / {RATIO_TO}", "max rel loss diff vs ddp"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def get(r, key):
        return r[key][stat] if key in r else None

    def ms(v):
        return f"{1e3 * v:.1f}" if v is not None else "–"

    def ratio(r, key):
        v, w = get(r, key), get(ref, key)
        return f"{v / w:.2f}×" if v is not None and w else "–"

    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |" + " |" * (len(cols) - 2))
            continue
        sb = r["state_bytes_per_rank"]
        share = f"{max(sb) / sum(sb):.3f}" if sum(sb) else "–"
        if name == "ddp" and sum(sb):
            share = f"{max(sb) * world / sum(sb):.2f} (whole)"
        diff = "–"
        if ddp_losses:
            diff = f"{max(abs(a - b) / abs(b) for a, b in zip(r['losses'], ddp_losses)):.1e}"
        lines.append("| " + " | ".join([
            name, ms(get(r, "step")), ratio(r, "step"), ms(get(r, "local")),
            ms(get(r, "sync")), ms(get(r, "e2e")), ratio(r, "e2e"),
            f"{max(sb) / 2**20:.1f}", share, f"{max(r['param_bytes_per_rank']) / 2**20:.1f}",
            ms(get(r, "consolidate")),
            ratio(r, "consolidate"), diff]) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20, help="timed end-to-end rounds")
    p.add_argument("--step-iters", type=int, default=60,
                   help="timed rounds of step() alone (and of its two halves)")
    p.add_argument("--consolidate-iters", type=int, default=5)
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help="comma-separated subset of " + ",".join(CONTENDERS))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override an integer field of the model config")
    p.add_argument("--out", default="benchmarks/out/zero.json")
    args = p.parse_args()
    cfg = BASE
    for kv in args.set:
        k, v = kv.split("=", 1)
        if not hasattr(cfg, k):
            raise SystemExit(f"--set: GPTConfig has no field {k!r}")
        cfg = replace(cfg, **{k: int(v)})
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    n_params = sum(p.numel() for p in build_model(cfg, SEED).parameters())
    results = run_all(args.contenders.split(","), cfg, args)
    if rank == 0:
        print(f"\n### {config_dict(cfg)}, {n_params:,} parameters, world {world}\n")
        for stat, what in (("median_s", "medians"), ("min_s", "minima")):
            print(f"{what} over the timed rounds:\n\n{table(results, world, stat)}\n", flush=True)
        report = {"machine": {**machine_info_basic(), "warmup": args.warmup,
                              "iters": args.iters, "step_iters": args.step_iters,
                              "consolidate_iters": args.consolidate_iters},
                  "model": {**config_dict(cfg), "parameters": n_params}, "results": results}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(f"wrote {out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()
