"""Wrap-time and wrap-memory benchmark on a large (>= 1B-parameter) GPT-like model.

Launch with torchrun (gloo, CPU), e.g.::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 \\
        benchmarks/bench_wrap.py --repeats 3 --out benchmarks/out/wrap.json

Two ways to start, each for every contender, one after another in one run:

* ``cpu`` -- the model is built on the CPU (filled with deterministic values;
  not timed), then wrapped: ``cfsdp`` / ``fsdp1`` with
  ``FullyShardedDataParallel`` (one unit per block), ``cfsdp_fs`` / ``fsdp2``
  with ``fully_shard`` on each block and then the root.  The time is the wrap
  call alone.  Memory while wrapping is the peak RSS during the wrap (VmHWM,
  reset just before it) less the RSS before the model was built, compared
  with the model's bytes plus two shards (``2 * model / world``).
* ``meta`` -- the model is built on the meta device and wrapped there
  (``fully_shard`` faces only: FSDP1 materialises units during the wrap, a
  different contract), then ``to_empty(device="cpu")`` and a deterministic
  fill of the local shards.  Reported: the wrap call, and wrap + to_empty +
  fill.

Each contender's time is the median over ``--repeats`` fresh models; a repeat
is the max over ranks.  Rank 0 prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fsdp import (  # noqa: E402
    Setup,
    _read_status_kib,
    machine_info_basic,
    release_memory,
    reset_peak_rss,
    wrap_cfsdp,
    wrap_cfsdp_fs,
    wrap_fsdp1,
    wrap_fsdp2,
)
from models import GPTConfig, build_model  # noqa: E402

# ~1.03B parameters: 20 blocks of 12 * 2048^2 plus embeddings and head
BIG = GPTConfig(vocab_size=8192, seq_len=128, n_layer=20, n_head=16, d_model=2048, batch_size=1)
WRAPS: dict[str, Callable] = {
    "cfsdp": wrap_cfsdp,
    "fsdp1": wrap_fsdp1,
    "cfsdp_fs": wrap_cfsdp_fs,
    "fsdp2": wrap_fsdp2,
}
META_OK = ("cfsdp_fs", "fsdp2")


def fill_(model: nn.Module) -> None:
    """Deterministic, cheap values in every (local shard of a) parameter."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            t = p.to_local() if isinstance(p, DTensor) else p
            t.fill_(0.001 * (i % 17))


def build(cfg: GPTConfig, device: str) -> nn.Module:
    with torch.device("meta"):
        model = build_model(cfg, 0)
    if device == "cpu":
        model.to_empty(device="cpu")
        fill_(model)
    return model


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def one(name: str, mode: str, cfg: GPTConfig) -> dict[str, float]:
    release_memory()
    rss_base = _read_status_kib("VmRSS") * 1024  # before the model exists
    model = build(cfg, mode)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    release_memory()
    dist.barrier()
    rss0 = _read_status_kib("VmRSS") * 1024
    reset_peak_rss()
    t0 = time.perf_counter()
    wrapped = WRAPS[name](model, cfg, Setup())
    t_wrap = time.perf_counter() - t0
    peak = _read_status_kib("VmHWM") * 1024
    out = {"wrap_s": _max_over_ranks(t_wrap), "model_bytes": model_bytes}
    out["wrap_growth_bytes"] = _max_over_ranks(float(peak - rss0))
    # the memory the model and its shards take at the wrap's peak
    out["wrap_peak_bytes"] = _max_over_ranks(float(peak - rss_base))
    if mode == "meta":
        t1 = time.perf_counter()
        wrapped.to_empty(device="cpu")
        fill_(wrapped)
        out["materialise_s"] = _max_over_ranks(time.perf_counter() - t1)
        out["wrap_and_materialise_s"] = out["wrap_s"] + out["materialise_s"]
    del wrapped, model
    release_memory()
    dist.barrier()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="meta,cpu")
    p.add_argument("--contenders", default=",".join(WRAPS))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a GPTConfig field, e.g. n_layer=4 (smoke runs)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/wrap.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = BIG
    for kv in args.set:
        k, v = kv.split("=", 1)
        cfg = GPTConfig(**{**cfg.__dict__, k: int(v)})
    W = dist.get_world_size()
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(cfg, 0).parameters())
    if dist.get_rank() == 0:
        print(f"model: {params / 1e9:.3f}B parameters, {W} ranks", flush=True)
    results: dict[str, dict[str, Any]] = {}
    # warm-up: first calls pay imports and lazy set-up, not the wrap itself
    tiny = GPTConfig(**{**cfg.__dict__, "n_layer": 1, "d_model": 64, "n_head": 2, "vocab_size": 64})
    for name in WRAPS:
        one(name, "cpu", tiny)
        if name in META_OK:
            one(name, "meta", tiny)
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        for name in [c.strip() for c in args.contenders.split(",") if c.strip()]:
            if mode == "meta" and name not in META_OK:
                continue
            runs = [one(name, mode, cfg) for _ in range(args.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            med["runs"] = runs
            mb = med["model_bytes"]
            med["model_plus_two_shards_bytes"] = mb + 2 * mb / W
            results[f"{mode}/{name}"] = med
            if dist.get_rank() == 0:
                print(f"{mode}/{name}: wrap {med['wrap_s']:.3f} s, growth "
                      f"{med['wrap_growth_bytes'] / 2**20:.0f} MiB", flush=True)
    if dist.get_rank() == 0:
        lines = ["| start | contender | wrap s | vs fsdp2 | peak RSS while wrapping MiB "
                 "| model + 2 shards MiB | growth MiB | wrap+materialise s |",
                 "|---|---|---|---|---|---|---|---|"]
        for key, r in results.items():
            mode, name = key.split("/")
            ref = results.get(f"{mode}/fsdp2")
            ratio = f"{r['wrap_s'] / ref['wrap_s']:.2f}" if ref else "-"
            wm = r.get("wrap_and_materialise_s")
            lines.append(
                f"| {mode} | {name} | {r['wrap_s']:.3f} | {ratio} | {r['wrap_peak_bytes'] / 2**20:.0f} "
                f"| {r['model_plus_two_shards_bytes'] / 2**20:.0f} | {r['wrap_growth_bytes'] / 2**20:.0f} "
                f"| {'-' if wm is None else f'{wm:.3f}'} |"
            )
        table = "\n".join(lines)
        print(table)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "machine": machine_info_basic(),
            "config": cfg.__dict__,
            "params": params,
            "results": results,
            "table": table,
        }, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
