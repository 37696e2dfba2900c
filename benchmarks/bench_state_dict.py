"""State-dict gather benchmark: cfsdp against torch's FSDP1 (time and rank 0's peak memory).

Launch with torchrun (gloo, CPU, one thread per rank)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 \\
        benchmarks/bench_state_dict.py --repeats 5 --out benchmarks/out/state_dict.json

The model is the GPT-2-like model of ``models.py`` (default here: ``d_model=768,
n_layer=12``, about 100 M parameters, ~400 MB in fp32), auto-wrapped one unit per block.
For each contender (cfsdp, then torch FSDP1; same model, seed, wrapping) and each state-dict
type, ``model.state_dict()`` is called ``--repeats`` times:

* ``full``: FULL_STATE_DICT with ``FullStateDictConfig(offload_to_cpu=True, rank0_only=True)``
  (gathered unit by unit, rank 0 keeps the full state dict). torch's FSDP1 on a CPU device
  crashes with ``offload_to_cpu=True`` (it frees the storage its CPU->CPU "copy" shares;
  SIGSEGV in torch 2.13), so FSDP1 runs with ``offload_to_cpu=False``, which on a CPU device
  keeps the same memory (the tensors are in CPU memory either way).
* ``sharded``: SHARDED_STATE_DICT with the default ``ShardedStateDictConfig()``.

A call's time is the max over ranks (after a barrier); the table shows the median. Memory
is measured on rank 0: before each call, garbage is collected, freed heap trimmed and the RSS
high-water mark reset (``bench_fsdp``'s helpers); growth is VmHWM during the call minus VmRSS
before it, i.e. the state dict itself plus every transient buffer, for the first call (the
allocator's heap is then fresh, so fragmentation shows) and the median call. It is also given
as a multiple of the full model's bytes and of (full model + largest unit), the ideal for a
unit-by-unit gather. Rank 0 prints a markdown table and
writes JSON to ``--out``. A contender/type that raises is reported with its error.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullStateDictConfig, ShardedStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fsdp import (  # noqa: E402
    Setup,
    exit_now,
    finish,
    _read_status_kib,
    machine_info,
    release_memory,
    reset_peak_rss,
    wrap_cfsdp,
    wrap_fsdp1,
)
from models import GPTConfig, build_model, config_dict, wrap_unit_class  # noqa: E402

SEED = 0
CONTENDERS = {"cfsdp": wrap_cfsdp, "fsdp1": wrap_fsdp1}
KINDS = ("full", "sharded")
MIB = 1024 * 1024


def fsdp_class(name: str):
    if name == "cfsdp":
        import cfsdp

        return cfsdp.FullyShardedDataParallel
    return TorchFSDP


def state_dict_settings(contender: str, kind: str):
    if kind == "full":
        # see the module doc: torch FSDP1 cannot offload on a CPU device
        return StateDictType.FULL_STATE_DICT, FullStateDictConfig(
            offload_to_cpu=contender == "cfsdp", rank0_only=True
        )
    return StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()


def model_bytes(cfg: GPTConfig) -> tuple[int, int]:
    """(bytes of the full model's parameters and buffers, bytes of its largest unit)."""
    model = build_model(cfg, SEED)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    unit_cls = wrap_unit_class(cfg)
    in_units, largest = 0, 0
    for m in model.modules():
        if isinstance(m, unit_cls):
            b = sum(p.numel() * p.element_size() for p in m.parameters())
            in_units += b
            largest = max(largest, b)
    root_unit = sum(p.numel() * p.element_size() for p in model.parameters()) - in_units
    return total, max(largest, root_unit)


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure(contender: str, kind: str, model: nn.Module, repeats: int) -> dict[str, Any]:
    fsdp = fsdp_class(contender)
    sd_type, cfg = state_dict_settings(contender, kind)
    times, growth_kib, n_keys = [], [], 0
    with fsdp.state_dict_type(model, sd_type, cfg):
        for _ in range(repeats):
            release_memory()
            dist.barrier()
            before = _read_status_kib("VmRSS")
            reset_peak_rss()
            t0 = time.perf_counter()
            sd = model.state_dict()
            dt = time.perf_counter() - t0
            growth_kib.append(_read_status_kib("VmHWM") - before)
            n_keys = len(sd)
            del sd
            times.append(max_over_ranks(dt))
    return {
        "config": repr(cfg),
        "times_s": times,
        "median_s": statistics.median(times),
        "rank0_growth_mib": [g / 1024 for g in growth_kib],
        "rank0_peak_growth_mib": max(growth_kib) / 1024,
        "rank0_first_growth_mib": growth_kib[0] / 1024,
        "rank0_median_growth_mib": statistics.median(growth_kib) / 1024,
        "n_keys_rank0": n_keys,
    }


def markdown_table(results: dict[str, Any], full_b: int, unit_b: int) -> str:
    rows = [
        "| contender | state dict | median time (s) | rank-0 growth, first call (MiB) | x full model "
        "| rank-0 growth, median call (MiB) | x full model | x (full model + largest unit) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for contender, per_kind in results.items():
        for kind, r in per_kind.items():
            if "error" in r:
                rows.append(f"| {contender} | {kind} | error: {r['error'].splitlines()[-1]} | | | | | |")
                continue
            first = r["rank0_first_growth_mib"] * MIB
            med = r["rank0_median_growth_mib"] * MIB
            rows.append(
                f"| {contender} | {kind} | {r['median_s']:.3f} | {first / MIB:.0f} | {first / full_b:.2f} "
                f"| {med / MIB:.0f} | {med / full_b:.2f} | {med / (full_b + unit_b):.2f} |"
            )
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override an integer GPTConfig field (default d_model=768, n_layer=12)")
    p.add_argument("--timeout", type=float, default=600.0, help="process-group timeout, s")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/state_dict.json"))
    args = p.parse_args()
    overrides = {"d_model": 768, "n_layer": 12, "n_head": 12}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in {f.name for f in dataclasses.fields(GPTConfig)}:
            p.error(f"--set {item!r}: GPTConfig has no field {key!r}")
        overrides[key] = int(value)
    args.cfg = dataclasses.replace(GPTConfig(), **overrides)
    args.contenders = [c for c in args.contenders.split(",") if c]
    args.kinds = [k for k in args.kinds.split(",") if k]
    for c in args.contenders:
        if c not in CONTENDERS:
            p.error(f"unknown contender {c!r}; choose from {list(CONTENDERS)}")
    for k in args.kinds:
        if k not in KINDS:
            p.error(f"unknown state dict kind {k!r}; choose from {list(KINDS)}")
    args.warmup, args.iters = 0, args.repeats  # for bench_fsdp.machine_info
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    rss_reset = reset_peak_rss()
    if not rss_reset:
        raise SystemExit("/proc/self/clear_refs is not writable: cannot measure peak growth")
    full_b, unit_b = model_bytes(args.cfg)
    results: dict[str, dict[str, Any]] = {}
    for contender in args.contenders:
        model = CONTENDERS[contender](build_model(args.cfg, SEED), args.cfg, Setup())
        results[contender] = {}
        for kind in args.kinds:
            if rank == 0:
                print(f"{contender} {kind} ...", flush=True)
            try:
                results[contender][kind] = measure(contender, kind, model, args.repeats)
            except Exception:  # noqa: BLE001 - reported in the table and the JSON
                results[contender][kind] = {"error": traceback.format_exc()}
                if rank == 0:
                    print(results[contender][kind]["error"], flush=True)
        del model
        release_memory()
    if rank == 0:
        n_params = sum(p.numel() for p in build_model(args.cfg, SEED).parameters())
        print(f"\n### GPT {config_dict(args.cfg)}: {n_params:,} params, full model "
              f"{full_b / MIB:.0f} MiB, largest unit {unit_b / MIB:.0f} MiB, "
              f"{dist.get_world_size()} ranks\n")
        print(markdown_table(results, full_b, unit_b), flush=True)
    report = None
    if rank == 0:
        report = {
            "machine": machine_info(args, rss_reset, Setup()),
            "model": {**config_dict(args.cfg), "n_params": n_params,
                      "full_model_bytes": full_b, "largest_unit_bytes": unit_b},
            "results": results,
        }
    finish(report, args.out)


if __name__ == "__main__":
    main()
    exit_now()
